//! The in-process store: the reference model behind sharded locks, bounded.
//!
//! Two things keep memory in check, both a few steps per request, never a scan under a
//! lock: a sweep that drops expired state (it resumes where it stopped, a few buckets
//! per request, one round a second), and, once a shard holds its share of
//! [`MemoryStore::max_keys`], an eviction per new key (CLOCK: a hand over the table's
//! buckets that drops expired state it meets, else the first key not used since the hand
//! last passed).
//!
//! Here: the store, and [`Inner::with_entry`], the one way a request opens a key's state.
//! `shard` holds a shard's table and entries, `evict` the sweep and the eviction,
//! `lockout` the blocks; none of them imports this module.

use std::{
    fmt,
    hash::BuildHasher,
    sync::{
        Arc,
        atomic::{AtomicU64, AtomicUsize, Ordering},
    },
};

use crossbeam_utils::CachePadded;
use hashbrown::DefaultHashBuilder;
use parking_lot::{Mutex, MutexGuard};
use smallvec::SmallVec;

mod evict;
mod lockout;
mod shard;

use self::{
    evict::{SWEEP_BUCKETS, SWEEP_INTERVAL_MS, drop_expired, evict},
    shard::{Entry, Known, REFERENCED, SHARDS, Shard, Slot, Slots, fingerprint, lock},
};
use super::{Admitted, Check, Permit, Reset, Store, permits::LocalPermits};
use crate::{
    Adjustment, Decision, InFlightLimit, Limit,
    algorithm::{self, Pending, State},
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

struct Inner {
    /// Each on its own cache line: two threads locking neighbouring shards would
    /// otherwise take the line from each other.
    shards: Box<[CachePadded<Mutex<Shard>>]>,
    hasher: DefaultHashBuilder,
    clock: Arc<dyn Clock>,
    max_keys: usize,
    next_sweep_ms: AtomicU64,
    /// The shard the sweep round is in.
    sweep_cursor: AtomicUsize,
    /// In-flight permits ([`Permits`](super::Permits)), apart from the limits' state.
    permits: LocalPermits,
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

/// What [`Inner::with_entry`] opens, under the shard's lock.
struct Opened<'a> {
    /// The key's slots: one per limit seen for it.
    slots: &'a mut Slots,
    known: &'a mut Known,
    blocks: &'a mut lockout::Blocks,
    /// The key's hash (the blocks are found by it too).
    hash: u64,
    /// The shard's share of the store's bound, which bounds its blocks as well.
    max_keys: usize,
}

impl Inner {
    /// Decides, reserving up to `reserve_ms` ahead when it is not 0 (see
    /// [`algorithm::check_reserving`]; a list with a lockout never reserves). Inlined, so
    /// that the plain check's call (`reserve_ms` = 0) keeps none of the reserving code.
    #[inline(always)]
    fn decide(
        &self,
        key: &Key,
        limits: &[Limit],
        cost: u32,
        now: u64,
        reserve_ms: u64,
    ) -> Decision {
        if lockouts(limits) {
            return self.decide_with_lockouts(key, limits, cost, now);
        }
        self.with_entry(
            key,
            now,
            |_, _, _| None,
            |Opened { slots, known, .. }| {
                // One limit, the common case: decide on its slot's state in place. A slot that
                // existed is marked used (a new one is not: a key seen once is the first to go).
                if let [limit] = limits {
                    let slot = match slots.find(fingerprint(limit)) {
                        Some(index) => {
                            let slot = &mut slots[index];
                            slot.tagged |= REFERENCED;
                            slot
                        }
                        None => {
                            slots.push(Slot::new(limit, known));
                            slots.last_mut().expect("just pushed")
                        }
                    };
                    let states = std::slice::from_mut(&mut slot.state);
                    return if reserve_ms == 0 {
                        algorithm::check(states, limits, now, cost)
                    } else {
                        algorithm::check_reserving(states, limits, now, cost, reserve_ms)
                    };
                }

                // Take each limit's state out of its slot, decide, and put them back.
                let (indexes, mut states) = slots.take_states(limits, known);
                let decision = if reserve_ms == 0 {
                    algorithm::check(&mut states, limits, now, cost)
                } else {
                    algorithm::check_reserving(&mut states, limits, now, cost, reserve_ms)
                };
                slots.put_back(&indexes, states);
                decision
            },
        )
    }

    /// [`decide`](Self::decide) on copies of the states: nothing is inserted, marked
    /// used or changed.
    fn peek(&self, key: &Key, limits: &[Limit], cost: u32, now: u64) -> Decision {
        let hash = self.hash(key);
        let shard = self.shard(hash);
        let slots = shard.table.find(hash, |e| e.key == *key).map(|e| &e.slots);
        let states: SmallVec<[State; 2]> = limits
            .iter()
            .map(|limit| {
                slots
                    .and_then(|slots| slots.find(fingerprint(limit)).map(|i| &slots[i]))
                    .map_or_else(|| State::new(limit.algorithm()), |slot| slot.state.clone())
            })
            .collect();
        let lockouts = lockout_states(&shard.blocks, hash, key, limits);
        drop(shard);
        if limits.iter().any(|limit| limit.lockout_ms() > 0) {
            let blocked: SmallVec<[u64; 2]> = lockouts.iter().map(|b| b.0).collect();
            let pending: SmallVec<[Pending; 2]> = lockouts.iter().map(|b| b.1).collect();
            return algorithm::peek_with_pending(&states, &blocked, &pending, limits, now, cost);
        }
        algorithm::peek(&states, limits, now, cost)
    }

    /// Drops the state of `key` under `limits` (the key too once it holds none), under
    /// the shard's lock: one step for every limit.
    fn reset(&self, key: &Key, limits: &[Limit]) {
        let hash = self.hash(key);
        let mut shard = self.shard(hash);
        let Shard {
            table,
            known,
            blocks,
            ..
        } = &mut *shard;
        for limit in limits {
            blocks.remove(hash, key, fingerprint(limit));
        }
        let Ok(mut occupied) = table.find_entry(hash, |e| e.key == *key) else {
            return;
        };
        let slots = &mut occupied.get_mut().slots;
        slots.retain(|slot| {
            let reset = limits
                .iter()
                .any(|limit| fingerprint(limit) == slot.tagged & !REFERENCED);
            if reset {
                known.release(slot);
            }
            !reset
        });
        if slots.is_empty() {
            occupied.remove();
        }
    }

    /// [`MemoryStore::adjust_now`]: the limits' states, as [`decide`](Self::decide) finds
    /// them, through [`algorithm::adjust`]. A refund makes no state for a key or limit
    /// that has none (nothing is there to give back to); a top-up does.
    fn adjust(&self, key: &Key, limits: &[Limit], adjustment: Adjustment, now: u64) -> Decision {
        // A refund (or a settle that keeps what it charged) makes no state.
        let refund = !matches!(adjustment.to_states(), Some(Adjustment::TopUp { .. }));
        // The pending units a settle ends, beside the states and in the same step.
        let settled = adjustment
            .settled()
            .filter(|_| limits.iter().any(Limit::pending));
        let release = move |blocks: &mut lockout::Blocks, hash: u64, max_keys: usize| {
            if let Some((charged, at)) = settled {
                let before = lockout_states(blocks, hash, key, limits);
                let until: SmallVec<[u64; 2]> = before.iter().map(|b| b.0).collect();
                let mut pending: SmallVec<[Pending; 2]> = before.iter().map(|b| b.1).collect();
                algorithm::settle_pending(&mut pending, limits, charged, at);
                put_lockouts(
                    blocks, hash, key, limits, &before, &until, &pending, now, max_keys,
                );
            }
        };
        // A refund for a key that holds nothing changes nothing, and makes no entry.
        // (A top-up makes the entry, and releases in `f` below: not here too.)
        let missing = |blocks: &mut lockout::Blocks, hash: u64, max_keys: usize| {
            refund.then(|| {
                release(blocks, hash, max_keys);
                let mut fresh: SmallVec<[State; 2]> =
                    limits.iter().map(|l| State::new(l.algorithm())).collect();
                algorithm::adjust(&mut fresh, limits, now, adjustment)
            })
        };
        self.with_entry(key, now, missing, |opened| {
            let Opened {
                slots,
                known,
                blocks,
                hash,
                max_keys,
            } = opened;
            release(blocks, hash, max_keys);
            let mut indexes: SmallVec<[Option<usize>; 4]> = SmallVec::new();
            for limit in limits {
                let index = match slots.find(fingerprint(limit)) {
                    Some(index) => Some(index),
                    None if refund => None,
                    None => {
                        slots.push(Slot::new(limit, known));
                        Some(slots.len() - 1)
                    }
                };
                indexes.push(index);
            }
            let mut states: SmallVec<[State; 2]> = indexes
                .iter()
                .zip(limits)
                .map(|(index, limit)| {
                    let fresh = State::new(limit.algorithm());
                    match index {
                        Some(i) => std::mem::replace(&mut slots[*i].state, fresh),
                        None => fresh,
                    }
                })
                .collect();
            let decision = algorithm::adjust(&mut states, limits, now, adjustment);
            for (index, state) in indexes.iter().zip(states) {
                if let Some(i) = index {
                    slots[*i].state = state;
                }
            }
            decision
        })
    }

    fn hash(&self, key: &Key) -> u64 {
        self.hasher.hash_one(key.as_str())
    }

    /// Locks the shard of the key hashed `hash`.
    #[inline(always)]
    fn shard(&self, hash: u64) -> MutexGuard<'_, Shard> {
        // Bits 32.. pick the shard: hashbrown uses the lowest bits for the bucket and the
        // top seven as the tag, so within a shard both stay well spread.
        lock(&self.shards[(hash >> 32) as usize % SHARDS])
    }

    /// Hashes `key`, locks its shard and runs `f` on its entry, made when missing (after
    /// an eviction when the shard is full) unless `missing` answers for a missing key
    /// instead. Inlined with both closures, so that the request path pays nothing for
    /// them.
    #[inline(always)]
    fn with_entry<R>(
        &self,
        key: &Key,
        now: u64,
        missing: impl FnOnce(&mut lockout::Blocks, u64, usize) -> Option<R>,
        f: impl FnOnce(Opened<'_>) -> R,
    ) -> R {
        let hash = self.hash(key);
        let mut shard = self.shard(hash);
        let Shard {
            table,
            known,
            max_keys,
            hand,
            blocks,
            ..
        } = &mut *shard;
        let entry = match table.find_entry(hash, |e| e.key == *key) {
            Ok(occupied) => occupied.into_mut(),
            Err(absent) => {
                if let Some(answer) = missing(blocks, hash, *max_keys) {
                    return answer;
                }
                let table = absent.into_table();
                if table.len() >= *max_keys {
                    evict(table, known, hand, now);
                }
                let entry = Entry {
                    key: key.clone(),
                    slots: Slots::new(),
                };
                table
                    .insert_unique(hash, entry, |e| self.hash(&e.key))
                    .into_mut()
            }
        };
        f(Opened {
            slots: &mut entry.slots,
            known,
            blocks,
            hash,
            max_keys: *max_keys,
        })
    }

    /// While a sweep round is under way, sweeps the next [`SWEEP_BUCKETS`] buckets of the
    /// shard the round is in; the round ends after the last shard.
    fn maybe_sweep(&self, now: u64) {
        if now < self.next_sweep_ms.load(Ordering::Relaxed) {
            return;
        }
        let cursor = self.sweep_cursor.load(Ordering::Relaxed);
        // A busy shard is left to the next request: no request waits to sweep, and
        // concurrent requests do not queue up on the one shard a round is in.
        let Some(mut shard) = self.shards[cursor].try_lock() else {
            return;
        };
        // Another request finished this shard before this one took the lock.
        if self.sweep_cursor.load(Ordering::Relaxed) != cursor {
            return;
        }
        if shard.sweep(now, SWEEP_BUCKETS) {
            let next = (cursor + 1) % SHARDS;
            if next == 0 {
                self.next_sweep_ms
                    .store(now + SWEEP_INTERVAL_MS, Ordering::Relaxed);
            }
            self.sweep_cursor.store(next, Ordering::Relaxed);
        }
    }

    /// Decides a request whose limits have lockouts: the states from the key's slots
    /// (made when missing) and the blocks from the shard's [`Blocks`], through the
    /// reference model's [`check_with_lockouts`](algorithm::check_with_lockouts). Apart
    /// from [`Inner::decide`], so that requests without lockouts pay one test for it.
    #[cold]
    #[inline(never)]
    fn decide_with_lockouts(&self, key: &Key, limits: &[Limit], cost: u32, now: u64) -> Decision {
        self.with_entry(
            key,
            now,
            |_, _, _| None,
            |opened| {
                let Opened {
                    slots,
                    known,
                    blocks,
                    hash,
                    max_keys,
                } = opened;
                let (indexes, mut states) = slots.take_states(limits, known);
                let before = lockout_states(blocks, hash, key, limits);
                let mut until: SmallVec<[u64; 2]> = before.iter().map(|b| b.0).collect();
                let mut pending: SmallVec<[Pending; 2]> = before.iter().map(|b| b.1).collect();
                let decision = algorithm::check_with_pending(
                    &mut states,
                    &mut until,
                    &mut pending,
                    limits,
                    now,
                    cost,
                );
                slots.put_back(&indexes, states);
                put_lockouts(
                    blocks, hash, key, limits, &before, &until, &pending, now, max_keys,
                );
                decision
            },
        )
    }
}

/// The block end and pending units of each of `limits` for `key` (none for a limit
/// without a lockout).
fn lockout_states(
    blocks: &lockout::Blocks,
    hash: u64,
    key: &Key,
    limits: &[Limit],
) -> SmallVec<[(u64, Pending); 2]> {
    limits
        .iter()
        .map(|limit| match limit.lockout_ms() {
            0 => (0, Pending::default()),
            _ => blocks.get(hash, key, fingerprint(limit)),
        })
        .collect()
}

/// Writes back the blocks and pending units of `limits` that changed from `before`.
#[allow(clippy::too_many_arguments)]
fn put_lockouts(
    blocks: &mut lockout::Blocks,
    hash: u64,
    key: &Key,
    limits: &[Limit],
    before: &[(u64, Pending)],
    until: &[u64],
    pending: &[Pending],
    now: u64,
    max_keys: usize,
) {
    for (((limit, old), &until), &pending) in limits.iter().zip(before).zip(until).zip(pending) {
        if limit.lockout_ms() > 0 && (until, pending) != *old {
            let pending_until = pending.expires_at(limit);
            blocks.set(
                hash,
                key,
                fingerprint(limit),
                (until, pending, pending_until),
                now,
                max_keys,
            );
        }
    }
}

/// Whether any of `limits` has a lockout.
#[inline(always)]
fn lockouts(limits: &[Limit]) -> bool {
    match limits {
        [limit] => limit.lockout_ms() != 0,
        _ => limits.iter().any(|l| l.lockout_ms() != 0),
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
