//! The in-process store: the reference model behind sharded locks.

use std::{
    fmt,
    hash::BuildHasher,
    sync::{
        Arc,
        atomic::{AtomicU64, AtomicUsize, Ordering},
    },
};

use crossbeam_utils::CachePadded;
use hashbrown::{DefaultHashBuilder, HashMap, HashTable};
use parking_lot::{Mutex, MutexGuard};
use smallvec::SmallVec;

use super::{Check, Store};
use crate::{
    Decision, Limit,
    algorithm::{self, State},
    clock::{Clock, MonotonicClock},
    key::Key,
};

const SHARDS: usize = 64;
/// How often (in store-clock milliseconds) every shard is swept for expired state.
const SWEEP_INTERVAL_MS: u64 = 1_000;

/// An in-process [`Store`]: every algorithm with the same semantics as the Redis scripts
/// (it runs the [reference model](crate::algorithm)), for a single process.
///
/// Keys are spread over 64 shards, each behind its own lock; all limits of one key live in
/// one shard, so a multi-limit decision takes one lock. State that has expired is dropped
/// as requests come in: once a second one shard per request is swept until all have been,
/// so memory follows the keys active in the last window without any task to schedule.
/// [`with_max_keys`](Self::with_max_keys) bounds it under a flood of distinct keys.
///
/// Clones share the same state.
#[derive(Clone)]
pub struct MemoryStore {
    inner: Arc<Inner>,
}

struct Inner {
    /// Each on its own cache line: two threads locking neighbouring shards would
    /// otherwise take the line from each other.
    shards: Box<[CachePadded<Mutex<Shard>>]>,
    hasher: DefaultHashBuilder,
    clock: Arc<dyn Clock>,
    max_keys_per_shard: Option<usize>,
    next_sweep_ms: AtomicU64,
    sweep_cursor: AtomicUsize,
}

/// One lock's worth of keys.
///
/// Entries are inline, 56 bytes for a key with one limit: a table is 44% to 87% full, so
/// 75 to 120 bytes per key. Boxing them (8 bytes per slot, the entry on the heap) would
/// add a pointer read, a cache miss once there are many keys, to every decision: with 1M
/// keys that measured 0.45x governor's decisions/s against 0.72x inline.
#[derive(Default)]
struct Shard {
    /// Hashed once per decision: the hash picks the shard (from bits that the table
    /// itself does not use) and finds the entry.
    table: HashTable<Entry>,
    /// The limits this shard's slots were made for, by fingerprint: a slot keeps only the
    /// fingerprint, and the sweep asks its limit when the state expires (an expiry in
    /// every slot would make entries 8 bytes larger).
    known: Known,
}

/// Beyond this many known limits, a sweep forgets the ones no slot uses any more.
const KNOWN_LIMITS_KEPT: usize = 64;

struct Entry {
    key: Key,
    slots: Slots,
}

/// The state of every limit seen for one key: usually one, kept inline. (A `SmallVec`
/// would add 8 bytes of length to every entry; this enum hides its tag in the state's.)
enum Slots {
    One(Slot),
    /// Two or more, or none once purged.
    Many(Vec<Slot>),
}

impl Slots {
    const fn new() -> Self {
        Self::Many(Vec::new())
    }

    fn push(&mut self, slot: Slot) {
        *self = match std::mem::replace(self, Self::new()) {
            Self::Many(slots) if slots.is_empty() => Self::One(slot),
            Self::One(first) => Self::Many(vec![first, slot]),
            Self::Many(mut slots) => {
                slots.push(slot);
                Self::Many(slots)
            }
        };
    }

    fn retain(&mut self, mut keep: impl FnMut(&Slot) -> bool) {
        match self {
            Self::One(slot) => {
                if !keep(slot) {
                    *self = Self::new();
                }
            }
            Self::Many(slots) => slots.retain(keep),
        }
    }
}

impl std::ops::Deref for Slots {
    type Target = [Slot];

    fn deref(&self) -> &[Slot] {
        match self {
            Self::One(slot) => std::slice::from_ref(slot),
            Self::Many(slots) => slots,
        }
    }
}

impl std::ops::DerefMut for Slots {
    fn deref_mut(&mut self) -> &mut [Slot] {
        match self {
            Self::One(slot) => std::slice::from_mut(slot),
            Self::Many(slots) => slots,
        }
    }
}

struct Slot {
    /// [`Limit::fingerprint`].
    limit: u64,
    state: State,
}

impl fmt::Debug for MemoryStore {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("MemoryStore")
            .field("clock", &self.inner.clock)
            .field("max_keys_per_shard", &self.inner.max_keys_per_shard)
            .finish_non_exhaustive()
    }
}

impl Default for MemoryStore {
    fn default() -> Self {
        Self::new()
    }
}

impl MemoryStore {
    /// An empty store on a [`MonotonicClock`], unbounded.
    pub fn new() -> Self {
        Self::build(Arc::new(MonotonicClock), None)
    }

    /// The same store reading time from `clock` (a [`ManualClock`](crate::clock::ManualClock)
    /// in tests).
    pub fn with_clock(self, clock: impl Clock) -> Self {
        Self::build(Arc::new(clock), self.inner.max_keys_per_shard)
    }

    /// Tracks at most about `max_keys` keys. When a new key arrives and its shard is full,
    /// expired state is dropped first; if that frees nothing, the key closest to expiry in
    /// a small sample is forgotten (so a flood of new keys can reset some quiet keys, but
    /// never stops limiting, and memory stays bounded).
    pub fn with_max_keys(self, max_keys: usize) -> Self {
        let per_shard = max_keys.div_ceil(SHARDS).max(1);
        Self::build(self.inner.clock.clone(), Some(per_shard))
    }

    fn build(clock: Arc<dyn Clock>, max_keys_per_shard: Option<usize>) -> Self {
        // The first read of a `MonotonicClock` calibrates it: here, not in a request.
        clock.now_ms();
        let shards = (0..SHARDS)
            .map(|_| CachePadded::new(Mutex::new(Shard::default())))
            .collect();
        Self {
            inner: Arc::new(Inner {
                shards,
                hasher: DefaultHashBuilder::default(),
                clock,
                max_keys_per_shard,
                next_sweep_ms: AtomicU64::new(0),
                sweep_cursor: AtomicUsize::new(0),
            }),
        }
    }

    /// Decides now, synchronously: what [`Store::check`] answers.
    pub fn decide(&self, key: &Key, limits: &[Limit], cost: u32) -> Decision {
        let now = self.inner.clock.now_ms();
        self.inner.maybe_sweep(now);
        self.inner.decide(key, limits, cost, now)
    }

    /// How many keys hold state (expired state not yet swept included).
    pub fn len(&self) -> usize {
        self.inner.shards.iter().map(|s| lock(s).table.len()).sum()
    }

    /// Whether no key holds state.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Drops all expired state now.
    pub fn purge_expired(&self) {
        let now = self.inner.clock.now_ms();
        for shard in &self.inner.shards {
            lock(shard).purge(now);
        }
    }
}

impl Store for MemoryStore {
    fn check(&self, key: &Key, limits: &[Limit], cost: u32) -> Check {
        Check::ready(Ok(self.decide(key, limits, cost)))
    }

    /// A carried-over limit keeps its fingerprint with new parameters: the sweeps judge
    /// its state's expiry by the new ones, as the next decision will.
    fn limits_changed(&self, limits: &[Limit]) {
        for shard in &self.inner.shards {
            let known = &mut lock(shard).known;
            for limit in limits {
                if let Some(old) = known.get_mut(&limit.fingerprint())
                    && old != limit
                {
                    *old = limit.clone();
                }
            }
        }
    }
}

impl Inner {
    fn hash(&self, key: &Key) -> u64 {
        self.hasher.hash_one(key.as_str())
    }

    fn decide(&self, key: &Key, limits: &[Limit], cost: u32, now: u64) -> Decision {
        let hash = self.hash(key);
        // Bits 32.. pick the shard: hashbrown uses the lowest bits for the bucket and the
        // top seven as the tag, so within a shard both stay well spread.
        let mut shard = lock(&self.shards[(hash >> 32) as usize % SHARDS]);
        let Shard { table, known } = &mut *shard;
        let entry = match table.find_entry(hash, |e| e.key == *key) {
            Ok(occupied) => occupied.into_mut(),
            Err(absent) => {
                let table = absent.into_table();
                self.make_room(table, known, now);
                let entry = Entry {
                    key: key.clone(),
                    slots: Slots::new(),
                };
                table
                    .insert_unique(hash, entry, |e| self.hash(&e.key))
                    .into_mut()
            }
        };
        let slots = &mut entry.slots;

        // One limit, the common case: decide on its slot's state in place.
        if let [limit] = limits {
            let slot = match slots.iter().position(|s| s.limit == limit.fingerprint()) {
                Some(index) => &mut slots[index],
                None => {
                    slots.push(Slot::new(limit, known));
                    slots.last_mut().expect("just pushed")
                }
            };
            return algorithm::check(std::slice::from_mut(&mut slot.state), limits, now, cost);
        }

        // Take each limit's state out of its slot, decide, and put them back.
        let mut indexes: SmallVec<[usize; 4]> = SmallVec::new();
        for limit in limits {
            let index = match slots.iter().position(|s| s.limit == limit.fingerprint()) {
                Some(index) => index,
                None => {
                    slots.push(Slot::new(limit, known));
                    slots.len() - 1
                }
            };
            indexes.push(index);
        }
        let mut states: SmallVec<[State; 2]> = indexes
            .iter()
            .zip(limits)
            .map(|(&i, limit)| {
                std::mem::replace(&mut slots[i].state, State::new(limit.algorithm()))
            })
            .collect();
        let decision = algorithm::check(&mut states, limits, now, cost);
        for (&i, state) in indexes.iter().zip(states) {
            slots[i].state = state;
        }
        decision
    }

    /// Sweeps one shard per call while a sweep round is due.
    fn maybe_sweep(&self, now: u64) {
        if now < self.next_sweep_ms.load(Ordering::Relaxed) {
            return;
        }
        let cursor = self.sweep_cursor.fetch_add(1, Ordering::Relaxed) % SHARDS;
        if cursor == SHARDS - 1 {
            self.next_sweep_ms
                .store(now + SWEEP_INTERVAL_MS, Ordering::Relaxed);
        }
        lock(&self.shards[cursor]).purge(now);
    }

    fn make_room(&self, table: &mut HashTable<Entry>, known: &mut Known, now: u64) {
        let Some(max) = self.max_keys_per_shard else {
            return;
        };
        if table.len() < max {
            return;
        }
        purge(table, known, now);
        if table.len() < max {
            return;
        }
        let victim = table
            .iter()
            .take(8)
            .min_by_key(|e| e.slots.iter().map(|s| s.expires_at(known)).max())
            .map(|e| e.key.clone());
        if let Some(victim) = victim
            && let Ok(entry) = table.find_entry(self.hash(&victim), |e| e.key == victim)
        {
            entry.remove();
        }
    }
}

/// A shard's limits by fingerprint.
type Known = HashMap<u64, Limit>;

impl Slot {
    /// The state of a key not seen yet under `limit`, which `known` remembers.
    fn new(limit: &Limit, known: &mut Known) -> Self {
        known
            .entry(limit.fingerprint())
            .or_insert_with(|| limit.clone());
        Self {
            limit: limit.fingerprint(),
            state: State::new(limit.algorithm()),
        }
    }

    /// When the state decides like a missing key (0 when its limit is unknown, which
    /// cannot happen: every slot is made through [`Slot::new`]).
    fn expires_at(&self, known: &Known) -> u64 {
        known
            .get(&self.limit)
            .map_or(0, |limit| self.state.expires_at(limit))
    }
}

impl Shard {
    fn purge(&mut self, now: u64) {
        purge(&mut self.table, &mut self.known, now);
    }
}

/// Drops expired state, and keys left without any; past [`KNOWN_LIMITS_KEPT`] known limits
/// (limits made at run time, say), also the limits no slot uses any more.
fn purge(table: &mut HashTable<Entry>, known: &mut Known, now: u64) {
    table.retain(|entry| {
        entry.slots.retain(|slot| slot.expires_at(known) > now);
        !entry.slots.is_empty()
    });
    if known.len() > KNOWN_LIMITS_KEPT {
        let used: hashbrown::HashSet<u64> = table
            .iter()
            .flat_map(|entry| entry.slots.iter().map(|slot| slot.limit))
            .collect();
        known.retain(|fingerprint, _| used.contains(fingerprint));
    }
}

fn lock(shard: &Mutex<Shard>) -> MutexGuard<'_, Shard> {
    shard.lock()
}

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use super::*;
    use crate::clock::ManualClock;

    #[test]
    fn forgets_expired_keys_without_being_asked() {
        let clock = ManualClock::new(1_000_000);
        let store = MemoryStore::new().with_clock(clock.clone());
        let limit = [Limit::fixed_window(5, Duration::from_secs(10)).unwrap()];
        for i in 0..100_000u32 {
            assert!(store.decide(&Key::from(i), &limit, 1).is_allowed());
        }
        assert_eq!(store.len(), 100_000);
        clock.advance(Duration::from_secs(11));
        // Ordinary traffic on one key sweeps every shard within one round.
        for _ in 0..SHARDS {
            store.decide(&Key::new("active"), &limit, 1);
        }
        assert_eq!(store.len(), 1);
    }

    #[test]
    fn max_keys_bounds_memory() {
        let store = MemoryStore::new()
            .with_clock(ManualClock::new(0))
            .with_max_keys(1_000);
        let limit = [Limit::fixed_window(5, Duration::from_secs(10)).unwrap()];
        for i in 0..50_000u32 {
            store.decide(&Key::from(i), &limit, 1);
        }
        assert!(store.len() <= 1_000 + SHARDS, "{}", store.len());
    }

    #[test]
    fn an_entry_for_one_limit_stays_56_bytes() {
        // What keeps a tracked key under 128 bytes at a table's emptiest (44% full):
        // `benches/memory_per_key.rs` measures it.
        assert_eq!(std::mem::size_of::<Entry>(), 56);
    }

    #[test]
    fn sweeps_forget_limits_that_no_key_uses_any_more() {
        let clock = ManualClock::new(0);
        let store = MemoryStore::new().with_clock(clock.clone());
        let known = |store: &MemoryStore| -> usize {
            store.inner.shards.iter().map(|s| lock(s).known.len()).sum()
        };
        // 200 limits made at run time for one key (so in one shard); then one that stays
        // busy.
        let tenant = Key::new("tenant");
        for i in 1..=200 {
            let limit = Limit::fixed_window(i, Duration::from_secs(1)).unwrap();
            store.decide(&tenant, &[limit], 1);
        }
        assert_eq!(known(&store), 200);
        clock.advance(Duration::from_secs(5));
        let busy = [Limit::fixed_window(5, Duration::from_secs(60)).unwrap()];
        store.decide(&Key::new("busy"), &busy, 1);
        store.purge_expired();
        assert_eq!(known(&store), 1);
        assert_eq!(store.len(), 1);
        assert_eq!(
            store.decide(&Key::new("busy"), &busy, 1).limits()[0].remaining,
            3
        );
    }

    #[test]
    fn limits_of_one_key_share_state_across_lists() {
        let store = MemoryStore::new().with_clock(ManualClock::new(0));
        let a = Limit::fixed_window(2, Duration::from_secs(10)).unwrap();
        let b = Limit::fixed_window(100, Duration::from_secs(10)).unwrap();
        let key = Key::new("k");
        assert!(store.decide(&key, std::slice::from_ref(&a), 1).is_allowed());
        assert!(store.decide(&key, &[b.clone(), a.clone()], 1).is_allowed());
        let denied = store.decide(&key, &[a, b], 1);
        assert!(!denied.is_allowed());
        assert_eq!(denied.limits()[1].remaining, 99);
    }
}
