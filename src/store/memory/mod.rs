//! The in-process store: the reference model behind sharded locks, bounded.
//!
//! Two things keep memory in check, both a few steps per request, never a scan under a
//! lock: a sweep that drops expired state (it resumes where it stopped, a few buckets
//! per request, one round a second), and, once a shard holds its share of
//! [`MemoryStore::max_keys`], an eviction per new key (CLOCK: a hand over the table's
//! buckets that drops expired state it meets, else the first key not used since the hand
//! last passed).
//!
//! Here: the store and its builders. `inner` holds the shards and the decisions, with
//! `Inner::open`, the one way a request opens a key's state;
//! `shard` holds a shard's table and entries, `evict` the sweep and the eviction,
//! `lockout` the blocks; none of them imports this module.

use std::{
    fmt,
    sync::{
        Arc,
        atomic::{AtomicU64, AtomicUsize},
    },
};

use crossbeam_utils::CachePadded;
use hashbrown::DefaultHashBuilder;
use parking_lot::Mutex;

mod evict;
mod inner;
mod lockout;
mod shard;

use self::{
    evict::drop_expired,
    inner::Inner,
    shard::{SHARDS, Shard, lock},
};
use super::{Admitted, Check, Permit, Reset, Store, permits::LocalPermits};
use crate::{
    Adjustment, Decision, InFlightLimit, Limit,
    clock::{Clock, MonotonicClock},
    key::Key,
};

/// An in-process [`Store`]: every algorithm with the same semantics as the Redis scripts
/// (it runs the reference model the scripts are tested against), for a single process.
///
/// Keys are spread over 64 shards, each behind its own lock; all limits of one key live in
/// one shard, so a multi-limit decision takes one lock.
///
/// # Memory
///
/// **Bounded by default**: at most [`DEFAULT_MAX_KEYS`](Self::DEFAULT_MAX_KEYS) keys
/// (917 504, 114 MiB at the bound), [`with_max_keys`](Self::with_max_keys) to change it.
/// A key with one limit takes a 56-byte entry in a hash table that is 44% to 87% full
/// (75-120 bytes per key below the bound); keys longer than 24 bytes and further limits
/// add their own heap bytes. At the bound, where keys keep coming and going, a shard's
/// table settles at the smallest power of two of buckets (57 bytes each) that holds 16/7
/// of its share: below that, the markers removed keys leave in the table would make it
/// double. (hashbrown clears those markers by rehashing the table in place when they run
/// out of room, once per several thousand evictions in a shard: amortised O(1), but that
/// one request holds the shard's lock for the rehash of one 64th of the store.)
///
/// [Lockout](crate::Limit::with_lockout) blocks live in a table of their own per shard
/// (a block outlives its key's state), with the same bound as the keys.
///
/// Expired state is dropped as requests come in: once a second a sweep round starts, and
/// every request sweeps a few buckets until all have been, so memory follows the keys
/// active in the last window without any task to schedule, and no request waits for a
/// whole shard to be scanned.
///
/// # At the bound
///
/// A new key in a full shard takes the place of another, chosen by CLOCK (second chance):
/// a hand moves over the shard's table, drops the first expired state it meets, and
/// otherwise evicts the first key that has not decided a request since the hand last
/// passed (looking at a handful of keys at most, O(1) per new key). Evicting a key forgets
/// its spent budget, so what this means for a limiter:
/// - nothing stops limiting and memory stays bounded, whatever the number of keys;
/// - a key that keeps sending, in particular one that is being denied, is marked used by
///   every request and survives a flood of one-shot keys: an attacker cannot reset another
///   client's budget this way while that client is active;
/// - a key that is quiet for as long as it takes the flood to bring in about `max_keys`
///   new keys can be evicted: its next request starts with a full budget. A client that
///   rotates keys gets that anyway (each new key has a full budget), so a bound only
///   matters for keys that stopped sending: size it above the number of keys you expect
///   in one window.
///
/// A flood of never-seen keys costs little throughput (BENCHMARKS.md). The store times
/// itself with a [`MonotonicClock`]: the wall clock read once and then advanced by the
/// CPU's time-stamp counter, a few nanoseconds per read instead of the system clock's ~30
/// on a VM.
///
/// Clones share the same state.
#[derive(Clone)]
pub struct MemoryStore {
    inner: Arc<Inner>,
}

impl fmt::Debug for MemoryStore {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("MemoryStore")
            .field("clock", &self.inner.clock)
            .field("max_keys", &self.inner.max_keys)
            .finish_non_exhaustive()
    }
}

impl Default for MemoryStore {
    fn default() -> Self {
        Self::new()
    }
}

impl MemoryStore {
    /// How many keys [`new`](Self::new) tracks at most: 64 shards of 14 336, the most a
    /// table of 32 768 buckets holds without doubling, so 114 MiB of tables at the bound
    /// (a bound of 1 000 000 would take 228 MiB). See [At the bound](Self#at-the-bound)
    /// for what happens there.
    pub const DEFAULT_MAX_KEYS: usize = SHARDS * 14_336;

    /// An empty store on a [`MonotonicClock`], for at most
    /// [`DEFAULT_MAX_KEYS`](Self::DEFAULT_MAX_KEYS) keys.
    pub fn new() -> Self {
        Self::build(Arc::new(MonotonicClock), Self::DEFAULT_MAX_KEYS)
    }

    /// The same store reading time from `clock` (a [`ManualClock`](crate::clock::ManualClock)
    /// in tests).
    pub fn with_clock(self, clock: impl Clock) -> Self {
        Self::build(Arc::new(clock), self.inner.max_keys)
    }

    /// Tracks at most `max_keys` keys (at least 64, one per shard) instead of
    /// [`DEFAULT_MAX_KEYS`](Self::DEFAULT_MAX_KEYS). A new key beyond the bound takes the
    /// place of expired state, else of a key not used recently: see
    /// [At the bound](Self#at-the-bound). Memory at the bound follows the bound in steps
    /// of 2 (see [Memory](Self#memory)): 458 752 keys take 57 MiB, 917 504 (the default)
    /// 114 MiB, anything from there up to 1 835 008 twice that. `usize::MAX` lifts the
    /// bound (memory then grows with the number of keys seen in a window).
    pub fn with_max_keys(self, max_keys: usize) -> Self {
        Self::build(self.inner.clock.clone(), max_keys)
    }

    fn build(clock: Arc<dyn Clock>, max_keys: usize) -> Self {
        // The first read of a `MonotonicClock` calibrates it: here, not in a request.
        clock.now_ms();
        // Shares that add up to `max_keys`: the first `max_keys % SHARDS` shards take one
        // more.
        let shards = (0..SHARDS)
            .map(|i| {
                let share = max_keys / SHARDS + usize::from(i < max_keys % SHARDS);
                CachePadded::new(Mutex::new(Shard::new(share.max(1))))
            })
            .collect();
        Self {
            inner: Arc::new(Inner {
                shards,
                hasher: DefaultHashBuilder::default(),
                clock,
                max_keys: max_keys.max(SHARDS),
                next_sweep_ms: AtomicU64::new(0),
                sweep_cursor: AtomicUsize::new(0),
                permits: LocalPermits::new(),
            }),
        }
    }

    pub(super) fn local_permits(&self) -> &LocalPermits {
        &self.inner.permits
    }

    pub(super) fn now_ms(&self) -> u64 {
        self.inner.clock.now_ms()
    }

    /// Decides now, synchronously: what [`Store::check`] answers.
    pub fn decide(&self, key: &Key, limits: &[Limit], cost: u32) -> Decision {
        let now = self.inner.clock.now_ms();
        self.inner.maybe_sweep(now);
        self.inner.decide(key, limits, cost, now, 0)
    }

    /// Decides now, reserving up to `max_wait_ms` ahead: what [`Store::reserve`] answers.
    pub fn reserve_now(
        &self,
        key: &Key,
        limits: &[Limit],
        cost: u32,
        max_wait_ms: u64,
    ) -> Decision {
        let now = self.inner.clock.now_ms();
        self.inner.maybe_sweep(now);
        self.inner.decide(key, limits, cost, now, max_wait_ms)
    }

    /// Applies `adjustment` now, synchronously: what [`Store::adjust`] answers. A refund
    /// for a key this store no longer holds (expired or evicted) changes nothing.
    pub fn adjust_now(&self, key: &Key, limits: &[Limit], adjustment: Adjustment) -> Decision {
        let now = self.inner.clock.now_ms();
        self.inner.adjust(key, limits, adjustment, now)
    }

    /// What [`Store::peek`] answers, now.
    pub(crate) fn peek_now(&self, key: &Key, limits: &[Limit], cost: u32) -> Decision {
        let now = self.inner.clock.now_ms();
        self.inner.peek(key, limits, cost, now)
    }

    /// How many keys hold state (expired state not yet swept included).
    pub fn len(&self) -> usize {
        self.inner.shards.iter().map(|s| lock(s).table.len()).sum()
    }

    /// Whether no key holds state.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// How many keys the store tracks at most.
    pub fn max_keys(&self) -> usize {
        self.inner.max_keys
    }

    /// Drops all expired state now (every shard in turn, each under its lock while it is
    /// scanned: a call for maintenance, not for the request path).
    pub fn purge_expired(&self) {
        let now = self.inner.clock.now_ms();
        for shard in &self.inner.shards {
            let mut shard = lock(shard);
            let Shard {
                table,
                known,
                blocks,
                ..
            } = &mut *shard;
            for index in 0..table.num_buckets() {
                drop_expired(table, known, index, now);
            }
            blocks.purge(now);
        }
    }
}

impl Store for MemoryStore {
    /// Every capability.
    fn capabilities(&self) -> super::Capabilities {
        super::Capabilities::ALL
    }

    fn check(&self, key: &Key, limits: &[Limit], cost: u32) -> Check {
        Check::ready(Ok(self.decide(key, limits, cost)))
    }

    fn reserve(&self, key: &Key, limits: &[Limit], cost: u32, max_wait_ms: u64) -> Check {
        Check::ready(Ok(self.reserve_now(key, limits, cost, max_wait_ms)))
    }

    fn peek(&self, key: &Key, limits: &[Limit], cost: u32) -> Check {
        let now = self.inner.clock.now_ms();
        Check::ready(Ok(self.inner.peek(key, limits, cost, now)))
    }

    fn reset(&self, key: &Key, limits: &[Limit]) -> Reset {
        self.inner.reset(key, limits);
        Box::pin(std::future::ready(Ok(())))
    }

    fn adjust(&self, key: &Key, limits: &[Limit], adjustment: Adjustment) -> Check {
        Check::ready(Ok(self.adjust_now(key, limits, adjustment)))
    }

    fn check_in_flight(
        &self,
        key: &Key,
        limits: &[Limit],
        cost: u32,
        in_flight: &InFlightLimit,
        max_wait_ms: u64,
    ) -> Check<Admitted> {
        Check::ready(Ok(self.check_in_flight_now(
            key,
            limits,
            cost,
            in_flight,
            max_wait_ms,
        )))
    }

    fn release_in_flight(
        &self,
        permit: Permit,
        limits: &[Limit],
        adjustment: Option<Adjustment>,
    ) -> Check {
        Check::ready(Ok(self.release_in_flight_now(&permit, limits, adjustment)))
    }

    /// A carried-over limit keeps its fingerprint with new parameters: the sweeps judge
    /// its state's expiry by the new ones, as the next decision will.
    fn limits_changed(&self, limits: &[Limit]) {
        for shard in &self.inner.shards {
            let known = &mut lock(shard).known;
            for limit in limits {
                known.update(limit);
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use super::*;
    use crate::clock::ManualClock;

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
