//! [`Permits`]: where the permits of an [`InFlightLayer`](crate::in_flight::InFlightLayer) are
//! counted, next to [`Store`](super::Store) (where decisions are made).
//!
//! A permit is taken by one call and given back by another, explicitly: a store that
//! shares permits between processes (the Redis store) does I/O for both, and a later
//! store call may take a permit together with a request's decision, or give it back
//! together with an [adjustment](crate::Adjustment).

use std::{
    fmt,
    hash::{Hash, Hasher},
    sync::{
        Arc,
        atomic::{AtomicU64, Ordering},
    },
    time::Duration,
};

use hashbrown::{Equivalent, HashMap};
use parking_lot::Mutex;
use tokio::sync::oneshot;

use super::{Check, MemoryStore};
use crate::{Adjustment, Decision, InFlightLimit, Limit, key::Key};

/// Counts requests in flight per key: what an [`InFlightLayer`](crate::in_flight::InFlightLayer)
/// keeps its permits in. Implemented by [`MemoryStore`] (in the process) and `RedisStore`
/// (feature `redis`: shared by every replica, as leases).
pub trait Permits: Send + Sync + fmt::Debug + 'static {
    /// Takes one of `max` permits of `key`, or answers [`Acquired::full`] when all `max`
    /// are held. Layers on one store share a key's permits when their `max` is the same.
    /// The permit is held until it is [released](Self::release); a store shared between
    /// processes ends it `ttl` after its last renewal when its holder stops renewing (a
    /// process that died).
    fn acquire(&self, key: &Key, max: u32, ttl: Duration) -> Check<Acquired>;

    /// Gives `permit` back. Every permit taken comes back through this call, once.
    fn release(&self, permit: Permit);
}

impl<P: Permits + ?Sized> Permits for Arc<P> {
    fn acquire(&self, key: &Key, max: u32, ttl: Duration) -> Check<Acquired> {
        (**self).acquire(key, max, ttl)
    }

    fn release(&self, permit: Permit) {
        (**self).release(permit);
    }
}

/// One permit taken: what [`Permits::release`] gives back.
#[derive(Debug)]
#[must_use = "a permit stays taken until it is released"]
pub struct Permit {
    key: Key,
    max: u32,
    id: u64,
    /// Stops the task that renews the permit when dropped (a store shared between
    /// processes; only the Redis store has one).
    #[cfg_attr(not(feature = "redis"), allow(dead_code))]
    renewal: Option<oneshot::Sender<()>>,
}

impl Permit {
    /// Permit `id` (unique in its store) of `key`, one of `max`.
    pub fn new(key: Key, max: u32, id: u64) -> Self {
        Self {
            key,
            max,
            id,
            renewal: None,
        }
    }

    /// The key it was taken for.
    pub fn key(&self) -> &Key {
        &self.key
    }

    /// The most permits of its key, as asked.
    pub fn max(&self) -> u32 {
        self.max
    }

    /// Its id, unique in its store.
    pub fn id(&self) -> u64 {
        self.id
    }

    /// The same permit, renewed by a task until `stop` is dropped with it.
    #[cfg_attr(not(feature = "redis"), allow(dead_code))]
    pub(crate) fn renewed_until_dropped(mut self, stop: oneshot::Sender<()>) -> Self {
        self.renewal = Some(stop);
        self
    }
}

/// What [`Permits::acquire`] answers: a permit, or none because all were held.
#[derive(Debug)]
#[must_use = "a permit taken stays taken until it is released"]
pub struct Acquired {
    permit: Option<Permit>,
    held: u64,
    decided_at_ms: Option<u64>,
}

impl Acquired {
    /// `permit` was taken; `held` permits of its key are held with it.
    pub fn taken(permit: Permit, held: u64) -> Self {
        Self {
            permit: Some(permit),
            held,
            decided_at_ms: None,
        }
    }

    /// No permit: all of the key's are held (`held` of them, which may be more than the
    /// maximum while requests whose permits the store lost count again).
    pub fn full(held: u64) -> Self {
        Self {
            permit: None,
            held,
            decided_at_ms: None,
        }
    }

    /// The same answer, made at `at_ms` on the store's clock (as
    /// [`Decision::decided_at`](crate::Decision::decided_at)).
    pub fn decided_at(mut self, at_ms: u64) -> Self {
        self.decided_at_ms = Some(at_ms);
        self
    }

    /// When the store made this answer, if it says.
    pub fn decided_at_ms(&self) -> Option<u64> {
        self.decided_at_ms
    }

    /// Whether a permit was taken.
    pub fn is_taken(&self) -> bool {
        self.permit.is_some()
    }

    /// How many permits of the key are held after this answer.
    pub fn held(&self) -> u64 {
        self.held
    }

    /// The permit taken, if any.
    pub fn into_permit(self) -> Option<Permit> {
        self.permit
    }
}

/// What [`Store::check_in_flight`](super::Store::check_in_flight) answers: the decision
/// of the rate limits and the in-flight cap together, and the permit taken when it
/// allowed the request (never one when it denied it).
#[derive(Debug)]
#[must_use = "a permit taken stays taken until it is released"]
pub struct Admitted {
    decision: Decision,
    permit: Option<Permit>,
}

impl Admitted {
    /// `decision`, with `permit` taken when it allowed the request. A permit beside a
    /// denial is given back by the caller.
    pub fn new(decision: Decision, permit: Option<Permit>) -> Self {
        Self { decision, permit }
    }

    /// The decision.
    pub fn decision(&self) -> &Decision {
        &self.decision
    }

    /// The decision and the permit taken, if any.
    pub fn into_parts(self) -> (Decision, Option<Permit>) {
        (self.decision, self.permit)
    }
}

/// The slot of [`LocalPermits`] that an [`InFlightLimit`](crate::InFlightLimit) counts in:
/// one per key whatever its `max` (an [`InFlightLayer`](crate::in_flight::InFlightLayer)'s slots are
/// its `max`, at least 1), so that a changed `max` keeps the permits held.
pub(crate) const ANY_MAX: u32 = 0;

/// Permits counted in this process: in flight per key and maximum; a key leaves the map
/// when its last permit comes back, so a key with nothing in flight takes no memory.
#[derive(Debug, Default)]
pub(crate) struct LocalPermits {
    held: Mutex<HashMap<(Key, u32), u32>>,
    next_id: AtomicU64,
}

/// `(key, max)` looked up without cloning the key; hashes as the tuple does.
struct Lookup<'a>(&'a Key, u32);

impl Hash for Lookup<'_> {
    fn hash<H: Hasher>(&self, state: &mut H) {
        self.0.hash(state);
        self.1.hash(state);
    }
}

impl Equivalent<(Key, u32)> for Lookup<'_> {
    fn equivalent(&self, other: &(Key, u32)) -> bool {
        *self.0 == other.0 && self.1 == other.1
    }
}

impl LocalPermits {
    pub(crate) fn new() -> Self {
        Self::default()
    }

    /// Takes one of `max` permits of `key` now.
    pub(crate) fn take(&self, key: &Key, max: u32) -> Acquired {
        let mut held = self.held.lock();
        let count = match held.get_mut(&Lookup(key, max)) {
            Some(count) if *count >= max => return Acquired::full(u64::from(*count)),
            Some(count) => {
                *count += 1;
                *count
            }
            None => {
                held.insert((key.clone(), max), 1);
                1
            }
        };
        drop(held);
        let id = self.next_id.fetch_add(1, Ordering::Relaxed);
        Acquired::taken(Permit::new(key.clone(), max, id), u64::from(count))
    }

    /// Runs `decide` under the lock of the permits, and takes one of `max` permits of
    /// `key` (slot [`ANY_MAX`]) when it allows: a request finding all `max` held gets
    /// `full()` instead, and decides nothing. One atomic step for both, in the process.
    pub(crate) fn take_with(
        &self,
        key: &Key,
        max: u32,
        full: impl FnOnce() -> Decision,
        decide: impl FnOnce() -> Decision,
    ) -> Admitted {
        let mut held = self.held.lock();
        let count = held.get(&Lookup(key, ANY_MAX)).copied().unwrap_or(0);
        if count >= max {
            return Admitted::new(full(), None);
        }
        let decision = decide();
        if !decision.is_allowed() {
            return Admitted::new(decision, None);
        }
        *held.entry((key.clone(), ANY_MAX)).or_insert(0) += 1;
        drop(held);
        let id = self.next_id.fetch_add(1, Ordering::Relaxed);
        Admitted::new(decision, Some(Permit::new(key.clone(), ANY_MAX, id)))
    }

    /// Gives `permit` back.
    pub(crate) fn give_back(&self, permit: &Permit) {
        let lookup = Lookup(&permit.key, permit.max);
        let mut held = self.held.lock();
        if let Some(count) = held.get_mut(&lookup) {
            *count -= 1;
            if *count == 0 {
                held.remove(&lookup);
            }
        }
    }
}

impl Permits for LocalPermits {
    fn acquire(&self, key: &Key, max: u32, _ttl: Duration) -> Check<Acquired> {
        Check::ready(Ok(self.take(key, max)))
    }

    fn release(&self, permit: Permit) {
        self.give_back(&permit);
    }
}

impl MemoryStore {
    /// [`Permits::acquire`], answered now.
    pub(crate) fn take_permit(&self, key: &Key, max: u32) -> Acquired {
        let acquired = self.local_permits().take(key, max);
        acquired.decided_at(self.now_ms())
    }
}

impl MemoryStore {
    /// [`Store::check_in_flight`](super::Store::check_in_flight), answered now: `limits`
    /// decided (reserved within `max_wait_ms`, when above 0, as
    /// [`reserve_now`](Self::reserve_now) does) under the lock of the permits. A request
    /// the cap denies is decided nothing: its decision is the limits' as a
    /// [peek](super::Store::peek) reads them, with the cap's denial last. A reservation
    /// takes its permit now.
    pub fn check_in_flight_now(
        &self,
        key: &Key,
        limits: &[Limit],
        cost: u32,
        in_flight: &InFlightLimit,
        max_wait_ms: u64,
    ) -> Admitted {
        let full = || {
            let peeked = if limits.is_empty() {
                Decision::new(Vec::new()).decided_at(self.now_ms())
            } else {
                self.peek_now(key, limits, cost)
            };
            peeked.with_cap(Some(in_flight.denial()))
        };
        let decide = || {
            if limits.is_empty() {
                Decision::new(Vec::new()).decided_at(self.now_ms())
            } else if max_wait_ms > 0 {
                self.reserve_now(key, limits, cost, max_wait_ms)
            } else {
                self.decide(key, limits, cost)
            }
        };
        self.local_permits()
            .take_with(key, in_flight.max(), full, decide)
    }

    /// [`Store::release_in_flight`](super::Store::release_in_flight), now.
    pub(crate) fn release_in_flight_now(
        &self,
        permit: &Permit,
        limits: &[Limit],
        adjustment: Option<Adjustment>,
    ) -> Decision {
        let decision = match adjustment {
            Some(adjustment) if !limits.is_empty() => {
                self.adjust_now(permit.key(), limits, adjustment)
            }
            _ => Decision::new(Vec::new()).decided_at(self.now_ms()),
        };
        self.local_permits().give_back(permit);
        decision
    }
}

/// In the process: a permit ends when it is released (no TTL, nothing to renew). Clones of
/// the store share the permits.
impl Permits for MemoryStore {
    fn acquire(&self, key: &Key, max: u32, _ttl: Duration) -> Check<Acquired> {
        Check::ready(Ok(self.take_permit(key, max)))
    }

    fn release(&self, permit: Permit) {
        self.local_permits().give_back(&permit);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn take(permits: &impl Permits, key: &str, max: u32) -> Option<Permit> {
        let check = permits.acquire(&Key::new(key), max, Duration::from_secs(1));
        check.into_ready().unwrap().unwrap().into_permit()
    }

    #[test]
    fn counts_per_key_and_maximum_and_forgets_a_key_with_nothing_held() {
        let local = LocalPermits::new();
        let a = take(&local, "a", 2).unwrap();
        let b = take(&local, "a", 2).unwrap();
        assert_ne!(a.id(), b.id());
        assert!(take(&local, "a", 2).is_none());
        // Another key, and the same key under another maximum, count apart.
        let c = take(&local, "b", 2).unwrap();
        let d = take(&local, "a", 3).unwrap();
        local.release(a);
        let e = take(&local, "a", 2).unwrap();
        for permit in [b, c, d, e] {
            local.release(permit);
        }
        assert!(local.held.lock().is_empty());
    }

    #[test]
    fn clones_of_a_memory_store_share_its_permits() {
        let store = MemoryStore::new();
        let held = take(&store, "a", 1).unwrap();
        assert!(take(&store.clone(), "a", 1).is_none());
        store.clone().release(held);
        assert!(take(&store, "a", 1).is_some());
    }
}
