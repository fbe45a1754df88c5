//! The in-process store: the reference model behind sharded locks, bounded.
//!
//! Two things keep memory in check, both a few steps per request, never a scan under a
//! lock: a sweep that drops expired state (it resumes where it stopped, a few buckets
//! per request, one round a second), and, once a shard holds its share of
//! [`MemoryStore::max_keys`], an eviction per new key (CLOCK: a hand over the table's
//! buckets that drops expired state it meets, else the first key not used since the hand
//! last passed).

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

mod lockout;

use super::{Check, Reset, Store, permits::LocalPermits};
use crate::{
    Adjustment, Decision, Limit,
    algorithm::{self, State},
    clock::{Clock, MonotonicClock},
    key::Key,
};

const SHARDS: usize = 64;
/// How often (in store-clock milliseconds) a sweep round starts.
const SWEEP_INTERVAL_MS: u64 = 1_000;
/// Buckets one request sweeps while a round is under way: about 2 µs of work, so that a
/// round over a full default store (2M buckets) takes about 16 000 requests.
const SWEEP_BUCKETS: usize = 128;
/// Entries past the one the eviction hand stopped at that are checked for expired state,
/// which then goes first (Redis samples 5 keys for its approximated LRU).
const EVICTION_SAMPLE: usize = 8;
/// Marked entries the hand passes over at most for one eviction: if every one is in use,
/// the last goes.
const EVICTION_MAX: usize = 64;

/// An in-process [`Store`]: every algorithm with the same semantics as the Redis scripts
/// (it runs the [reference model](crate::algorithm)), for a single process.
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

/// One lock's worth of keys.
///
/// Entries are inline, 56 bytes for a key with one limit: a table is 44% to 87% full, so
/// 75 to 120 bytes per key. Boxing them (8 bytes per slot, the entry on the heap) would
/// add a pointer read, a cache miss once there are many keys, to every decision: with 1M
/// keys that measured 0.45x governor's decisions/s against 0.72x inline. (For the same
/// reason the store does not use `quick_cache`, whose entries sit in a slab behind the
/// table, with list links, and which cannot prefer expired state.)
struct Shard {
    /// Hashed once per decision: the hash picks the shard (from bits that the table
    /// itself does not use) and finds the entry.
    table: HashTable<Entry>,
    /// The limits this shard's slots were made for, by fingerprint: a slot keeps only the
    /// fingerprint, and the sweep asks its limit when the state expires (an expiry in
    /// every slot would make entries 8 bytes larger).
    known: Known,
    /// Keys this shard holds at most: its share of [`Inner::max_keys`].
    max_keys: usize,
    /// The CLOCK hand: the bucket where the next eviction starts looking.
    hand: usize,
    /// The bucket where this shard's sweep resumes.
    swept_to: usize,
    /// The keys blocked by a limit's lockout, apart from `table`: see `lockout`.
    blocks: lockout::Blocks,
}

/// Beyond this many known limits, a limit is forgotten when its last slot goes.
const KNOWN_LIMITS_KEPT: usize = 64;

/// The top bit of [`Slot::tagged`]: CLOCK's reference bit, set when an existing slot
/// decides a request and cleared as the eviction hand passes. It takes a bit of the limit's
/// 64-bit fingerprint so that entries stay 56 bytes.
const REFERENCED: u64 = 1 << 63;

/// A limit's fingerprint as slots keep it (without the [`REFERENCED`] bit).
fn fingerprint(limit: &Limit) -> u64 {
    limit.fingerprint() & !REFERENCED
}

struct Entry {
    key: Key,
    slots: Slots,
}

impl Entry {
    /// Whether every slot's state has expired: the key decides like a missing one.
    fn is_expired(&self, known: &Known, now: u64) -> bool {
        self.slots.iter().all(|slot| known.expires_at(slot) <= now)
    }

    /// Whether a slot decided a request since the last call; clears the marks.
    fn take_referenced(&mut self) -> bool {
        let mut referenced = false;
        for slot in self.slots.iter_mut() {
            referenced |= slot.tagged & REFERENCED != 0;
            slot.tagged &= !REFERENCED;
        }
        referenced
    }
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

    /// The index of the slot for the limit with this [`fingerprint`].
    fn find(&self, fingerprint: u64) -> Option<usize> {
        self.iter()
            .position(|slot| slot.tagged & !REFERENCED == fingerprint)
    }

    /// Takes the state of each of `limits` out of its slot (marked used; made when
    /// missing), to decide a request of several limits on: with the slots' indexes, for
    /// [`put_back`](Self::put_back).
    fn take_states(
        &mut self,
        limits: &[Limit],
        known: &mut Known,
    ) -> (SmallVec<[usize; 4]>, SmallVec<[State; 2]>) {
        let mut indexes: SmallVec<[usize; 4]> = SmallVec::new();
        for limit in limits {
            let index = match self.find(fingerprint(limit)) {
                Some(index) => {
                    self[index].tagged |= REFERENCED;
                    index
                }
                None => {
                    self.push(Slot::new(limit, known));
                    self.len() - 1
                }
            };
            indexes.push(index);
        }
        let states = indexes
            .iter()
            .zip(limits)
            .map(|(&i, limit)| std::mem::replace(&mut self[i].state, State::new(limit.algorithm())))
            .collect();
        (indexes, states)
    }

    /// Puts back the states [`take_states`](Self::take_states) took, as decided.
    fn put_back(&mut self, indexes: &[usize], states: SmallVec<[State; 2]>) {
        for (&i, state) in indexes.iter().zip(states) {
            self[i].state = state;
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
    /// The limit's [`fingerprint`], and the [`REFERENCED`] bit.
    tagged: u64,
    state: State,
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

    /// A carried-over limit keeps its fingerprint with new parameters: the sweeps judge
    /// its state's expiry by the new ones, as the next decision will.
    fn adjust(&self, key: &Key, limits: &[Limit], adjustment: Adjustment) -> Check {
        Check::ready(Ok(self.adjust_now(key, limits, adjustment)))
    }

    fn limits_changed(&self, limits: &[Limit]) {
        for shard in &self.inner.shards {
            let known = &mut lock(shard).known;
            for limit in limits {
                known.update(limit);
            }
        }
    }
}

impl Inner {
    fn hash(&self, key: &Key) -> u64 {
        self.hasher.hash_one(key.as_str())
    }

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
        let hash = self.hash(key);
        // Bits 32.. pick the shard: hashbrown uses the lowest bits for the bucket and the
        // top seven as the tag, so within a shard both stay well spread.
        let mut shard = lock(&self.shards[(hash >> 32) as usize % SHARDS]);
        let Shard {
            table,
            known,
            max_keys,
            hand,
            ..
        } = &mut *shard;
        let entry = self.entry(table, known, *max_keys, hand, key, hash, now);
        let slots = &mut entry.slots;

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
    }

    /// The entry of `key` (hashed `hash`) in a shard's `table`, made when missing (after an
    /// eviction when the shard is full).
    #[allow(clippy::too_many_arguments)]
    #[inline(always)]
    fn entry<'a>(
        &self,
        table: &'a mut HashTable<Entry>,
        known: &mut Known,
        max_keys: usize,
        hand: &mut usize,
        key: &Key,
        hash: u64,
        now: u64,
    ) -> &'a mut Entry {
        match table.find_entry(hash, |e| e.key == *key) {
            Ok(occupied) => occupied.into_mut(),
            Err(absent) => {
                let table = absent.into_table();
                if table.len() >= max_keys {
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
        }
    }

    /// [`decide`](Self::decide) on copies of the states: nothing is inserted, marked
    /// used or changed.
    fn peek(&self, key: &Key, limits: &[Limit], cost: u32, now: u64) -> Decision {
        let hash = self.hash(key);
        let shard = lock(&self.shards[(hash >> 32) as usize % SHARDS]);
        let slots = shard.table.find(hash, |e| e.key == *key).map(|e| &e.slots);
        let states: SmallVec<[State; 2]> = limits
            .iter()
            .map(|limit| {
                slots
                    .and_then(|slots| slots.find(fingerprint(limit)).map(|i| &slots[i]))
                    .map_or_else(|| State::new(limit.algorithm()), |slot| slot.state.clone())
            })
            .collect();
        let blocked: SmallVec<[u64; 2]> = limits
            .iter()
            .map(|limit| match limit.lockout_ms() {
                0 => 0,
                _ => shard.blocks.until(hash, key, fingerprint(limit)),
            })
            .collect();
        drop(shard);
        if limits.iter().any(|limit| limit.lockout_ms() > 0) {
            return algorithm::peek_with_lockouts(&states, &blocked, limits, now, cost);
        }
        algorithm::peek(&states, limits, now, cost)
    }

    /// Drops the state of `key` under `limits` (the key too once it holds none), under
    /// the shard's lock: one step for every limit.
    fn reset(&self, key: &Key, limits: &[Limit]) {
        let hash = self.hash(key);
        let mut shard = lock(&self.shards[(hash >> 32) as usize % SHARDS]);
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
        let hash = self.hash(key);
        let mut shard = lock(&self.shards[(hash >> 32) as usize % SHARDS]);
        let Shard {
            table,
            known,
            max_keys,
            hand,
            ..
        } = &mut *shard;
        let refund = matches!(adjustment, Adjustment::Refund { .. });
        if refund && table.find(hash, |e| e.key == *key).is_none() {
            let mut fresh: SmallVec<[State; 2]> =
                limits.iter().map(|l| State::new(l.algorithm())).collect();
            return algorithm::adjust(&mut fresh, limits, now, adjustment);
        }
        let slots = &mut self
            .entry(table, known, *max_keys, hand, key, hash, now)
            .slots;
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
}

impl Shard {
    fn new(max_keys: usize) -> Self {
        Self {
            table: HashTable::new(),
            known: Known::default(),
            max_keys,
            hand: 0,
            swept_to: 0,
            blocks: lockout::Blocks::default(),
        }
    }

    /// Drops the expired state in the next `buckets` buckets; true once this pass has
    /// reached the end of the table (the next starts again at its beginning).
    fn sweep(&mut self, now: u64, buckets: usize) -> bool {
        let total = self.table.num_buckets();
        let end = self.swept_to.saturating_add(buckets).min(total);
        for index in self.swept_to..end {
            drop_expired(&mut self.table, &mut self.known, index, now);
        }
        self.swept_to = if end >= total { 0 } else { end };
        end >= total
    }
}

/// Drops the expired state of the entry in bucket `index`, and the entry once it holds none.
fn drop_expired(table: &mut HashTable<Entry>, known: &mut Known, index: usize, now: u64) {
    let Ok(mut occupied) = table.get_bucket_entry(index) else {
        return;
    };
    let slots = &mut occupied.get_mut().slots;
    slots.retain(|slot| {
        let live = known.expires_at(slot) > now;
        if !live {
            known.release(slot);
        }
        live
    });
    if slots.is_empty() {
        occupied.remove();
    }
}

/// Makes room for one key in a full shard: CLOCK (second chance), with a short look
/// ahead for expired state.
///
/// From the hand on, entries marked used since the hand last passed lose their mark and
/// are passed over; the first entry that is expired, or unmarked, stops the hand. An
/// unmarked one is evicted unless one of the next [`EVICTION_SAMPLE`] entries has expired
/// (that one goes instead, and the hand stays). After [`EVICTION_MAX`] marked entries the
/// last one goes: the whole shard is in use.
fn evict(table: &mut HashTable<Entry>, known: &mut Known, hand: &mut usize, now: u64) {
    if table.is_empty() {
        return;
    }
    let buckets = table.num_buckets();
    let mut seen = 0;
    // The table is not empty, so this ends within two turns of the hand.
    let victim = loop {
        // `%`: the hand may point past the end of a table rebuilt smaller (none is).
        let index = *hand % buckets;
        *hand = (index + 1) % buckets;
        let Some(entry) = table.get_bucket_mut(index) else {
            continue;
        };
        seen += 1;
        if entry.is_expired(known, now) {
            break index;
        }
        if !entry.take_referenced() || seen >= EVICTION_MAX {
            match expired_ahead(table, known, *hand, now) {
                Some(expired) => {
                    *hand = index;
                    break expired;
                }
                None => break index,
            }
        }
    };
    if let Ok(occupied) = table.get_bucket_entry(victim) {
        let (entry, _) = occupied.remove();
        for slot in entry.slots.iter() {
            known.release(slot);
        }
    }
}

/// The bucket of an expired entry among the next [`EVICTION_SAMPLE`] from bucket `from`
/// (looking at 4 times as many buckets at most, empty ones included).
fn expired_ahead(table: &HashTable<Entry>, known: &Known, from: usize, now: u64) -> Option<usize> {
    let buckets = table.num_buckets();
    let mut seen = 0;
    for step in 0..(4 * EVICTION_SAMPLE).min(buckets) {
        let index = (from + step) % buckets;
        if let Some(entry) = table.get_bucket(index) {
            if entry.is_expired(known, now) {
                return Some(index);
            }
            seen += 1;
            if seen == EVICTION_SAMPLE {
                break;
            }
        }
    }
    None
}

/// A shard's limits by fingerprint, with how many slots use each.
#[derive(Default)]
struct Known(HashMap<u64, Used>);

struct Used {
    limit: Limit,
    slots: usize,
}

impl Known {
    /// When `slot`'s state decides like a missing key (0 when its limit is unknown, which
    /// cannot happen: a limit is known while a slot uses it).
    fn expires_at(&self, slot: &Slot) -> u64 {
        self.0
            .get(&(slot.tagged & !REFERENCED))
            .map_or(0, |used| slot.state.expires_at(&used.limit))
    }

    /// Takes `limit`'s new parameters for the slots that share its fingerprint (a
    /// carried-over limit that changed).
    fn update(&mut self, limit: &Limit) {
        if let Some(used) = self.0.get_mut(&fingerprint(limit))
            && used.limit != *limit
        {
            used.limit = limit.clone();
        }
    }

    /// Counts `slot`, which is going away, out of its limit's users. Beyond
    /// [`KNOWN_LIMITS_KEPT`] (limits made at run time, say), a limit no slot uses any
    /// more is forgotten.
    fn release(&mut self, slot: &Slot) {
        let fingerprint = slot.tagged & !REFERENCED;
        let many = self.0.len() > KNOWN_LIMITS_KEPT;
        if let hashbrown::hash_map::Entry::Occupied(mut used) = self.0.entry(fingerprint) {
            used.get_mut().slots -= 1;
            if used.get().slots == 0 && many {
                used.remove();
            }
        }
    }
}

impl Slot {
    /// The state of a key not seen yet under `limit`, counted as one of its users in
    /// `known`.
    fn new(limit: &Limit, known: &mut Known) -> Self {
        let fingerprint = fingerprint(limit);
        known
            .0
            .entry(fingerprint)
            .or_insert_with(|| Used {
                limit: limit.clone(),
                slots: 0,
            })
            .slots += 1;
        Self {
            tagged: fingerprint,
            state: State::new(limit.algorithm()),
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
        // Ordinary traffic on one key sweeps every shard within one round: 128 buckets a
        // request, and 100 000 keys take 64 tables of 2 048 buckets.
        let buckets: usize = store
            .inner
            .shards
            .iter()
            .map(|s| lock(s).table.num_buckets())
            .sum();
        assert_eq!(buckets, SHARDS * 2_048);
        for _ in 0..buckets / SWEEP_BUCKETS + SHARDS {
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
        assert_eq!(store.max_keys(), 1_000);
        assert!(store.len() <= 1_000, "{}", store.len());
    }

    #[test]
    fn the_default_store_is_bounded() {
        // A window longer than the test: nothing expires, so only the bound drops keys.
        let store = MemoryStore::new().with_clock(ManualClock::new(0));
        let limit = [Limit::fixed_window(5, Duration::from_secs(3_600)).unwrap()];
        let keys = MemoryStore::DEFAULT_MAX_KEYS as u64 + 10_000;
        for i in 0..keys {
            store.decide(&Key::from(i), &limit, 1);
        }
        assert_eq!(store.max_keys(), MemoryStore::DEFAULT_MAX_KEYS);
        assert!(
            store.len() <= MemoryStore::DEFAULT_MAX_KEYS,
            "{}",
            store.len()
        );
    }

    #[test]
    fn a_limited_key_keeps_its_state_through_a_flood_of_new_keys() {
        let store = MemoryStore::new()
            .with_clock(ManualClock::new(0))
            .with_max_keys(1_000);
        let limit = [Limit::fixed_window(3, Duration::from_secs(3_600)).unwrap()];
        // 100 clients that spent their budget and keep asking.
        let hot: Vec<Key> = (0..100).map(|i| Key::new(format!("hot-{i}"))).collect();
        for key in &hot {
            for _ in 0..3 {
                assert!(store.decide(key, &limit, 1).is_allowed());
            }
        }
        // 20 times the bound of one-shot keys, every one allowed; the limited clients ask
        // again after each 20 of them and stay denied. (Keys land in shards by a hash
        // with a random seed: a shard holds about 16 keys here, and with 100 new keys
        // between asks, a shard that drew several hot keys and several new ones could
        // see its clock hand pass a hot key twice between two asks, in about 1 run in
        // 300. With 20, a shard meets a new key or two between asks.)
        for round in 0..1_000u32 {
            for i in 0..20u32 {
                let key = Key::new(format!("flood-{round}-{i}"));
                assert!(store.decide(&key, &limit, 1).is_allowed());
            }
            for key in &hot {
                assert!(
                    !store.decide(key, &limit, 1).is_allowed(),
                    "{key} was forgotten after {} new keys",
                    (round + 1) * 20
                );
            }
        }
        assert!(store.len() <= 1_000, "{}", store.len());
    }

    #[test]
    fn eviction_takes_expired_state_before_a_key_not_used_recently() {
        let short = Limit::fixed_window(1, Duration::from_secs(1)).unwrap();
        let long = Limit::fixed_window(1, Duration::from_secs(3_600)).unwrap();
        // Each case puts the expired key at another place among eight.
        for expired in 0..8 {
            let mut shard = Shard::new(8);
            let hasher = DefaultHashBuilder::default();
            for i in 0..8 {
                let limit = if i == expired { &short } else { &long };
                let key = Key::from(i);
                let mut slot = Slot::new(limit, &mut shard.known);
                let state = std::slice::from_mut(&mut slot.state);
                algorithm::check(state, std::slice::from_ref(limit), 0, 1);
                let mut slots = Slots::new();
                slots.push(slot);
                shard.table.insert_unique(
                    hasher.hash_one(key.as_str()),
                    Entry { key, slots },
                    |e| hasher.hash_one(e.key.as_str()),
                );
            }
            let Shard {
                table, known, hand, ..
            } = &mut shard;
            evict(table, known, hand, 2_000);
            let left: Vec<String> = table.iter().map(|e| e.key.to_string()).collect();
            assert_eq!(left.len(), 7);
            assert!(!left.contains(&expired.to_string()), "{left:?}");
            assert_eq!(known.0[&fingerprint(&short)].slots, 0);
            assert_eq!(known.0[&fingerprint(&long)].slots, 7);
        }
    }

    #[test]
    fn the_sweep_keeps_state_that_has_not_expired() {
        let clock = ManualClock::new(0);
        let store = MemoryStore::new().with_clock(clock.clone());
        let short = [Limit::fixed_window(1, Duration::from_secs(1)).unwrap()];
        let long = [Limit::fixed_window(1, Duration::from_secs(3_600)).unwrap()];
        for i in 0..1_000u32 {
            store.decide(&Key::from(i), if i % 2 == 0 { &short } else { &long }, 1);
        }
        clock.advance(Duration::from_secs(2));
        store.purge_expired();
        assert_eq!(store.len(), 500);
        for i in (1..1_000u32).step_by(2) {
            assert!(!store.decide(&Key::from(i), &long, 1).is_allowed());
        }
    }

    #[test]
    fn an_entry_for_one_limit_stays_56_bytes() {
        // What keeps a tracked key under 128 bytes at a table's emptiest (44% full):
        // `benches/memory_per_key.rs` measures it.
        assert_eq!(std::mem::size_of::<Entry>(), 56);
    }

    #[test]
    fn forgets_limits_that_no_key_uses_any_more() {
        let clock = ManualClock::new(0);
        let store = MemoryStore::new().with_clock(clock.clone());
        let known = |store: &MemoryStore| -> usize {
            store
                .inner
                .shards
                .iter()
                .map(|s| lock(s).known.0.len())
                .sum()
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
        // The shard keeps 64 of the unused limits (the next keys may well use them), and
        // the busy key's.
        assert!(known(&store) <= KNOWN_LIMITS_KEPT + 1, "{}", known(&store));
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
