//! [`Inner`]: the memory store's shards and how a request decides under one lock
//! ([`Inner::open`], the one way a request opens a key's state, and
//! [`Inner::with_entry`] around it).

use std::{
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

use super::{
    evict::{SWEEP_BUCKETS, SWEEP_INTERVAL_MS, evict},
    lockout,
    shard::{Entry, Known, REFERENCED, SHARDS, Shard, Slot, Slots, fingerprint, lock},
};
use crate::{
    Adjustment, Decision, Limit,
    algorithm::{self, Pending, State},
    clock::Clock,
    key::Key,
    store::permits::LocalPermits,
};

pub(super) struct Inner {
    /// Each on its own cache line: two threads locking neighbouring shards would
    /// otherwise take the line from each other.
    pub(super) shards: Box<[CachePadded<Mutex<Shard>>]>,
    pub(super) hasher: DefaultHashBuilder,
    pub(super) clock: Arc<dyn Clock>,
    pub(super) max_keys: usize,
    pub(super) next_sweep_ms: AtomicU64,
    /// The shard the sweep round is in.
    pub(super) sweep_cursor: AtomicUsize,
    /// In-flight permits ([`Permits`](super::Permits)), apart from the limits' state.
    pub(super) permits: LocalPermits,
}

/// What [`Inner::open`] opens, under the shard's lock.
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
    pub(super) fn decide(
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
        // Opened here rather than through `with_entry`'s closure: the closure stayed a
        // call of its own (~30 instructions a request, benches/instructions.rs).
        let hash = self.hash(key);
        let mut shard = self.shard(hash);
        let Ok(Opened { slots, known, .. }) = self.open(&mut shard, key, hash, now, no_answer);

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

    /// [`decide`](Self::decide) on copies of the states: nothing is inserted, marked
    /// used or changed.
    pub(super) fn peek(&self, key: &Key, limits: &[Limit], cost: u32, now: u64) -> Decision {
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
    pub(super) fn reset(&self, key: &Key, limits: &[Limit]) {
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
    pub(super) fn adjust(
        &self,
        key: &Key,
        limits: &[Limit],
        adjustment: Adjustment,
        now: u64,
    ) -> Decision {
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

    pub(super) fn hash(&self, key: &Key) -> u64 {
        self.hasher.hash_one(key.as_str())
    }

    /// Locks the shard of the key hashed `hash`.
    #[inline(always)]
    pub(super) fn shard(&self, hash: u64) -> MutexGuard<'_, Shard> {
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
        match self.open(&mut shard, key, hash, now, missing) {
            Ok(opened) => f(opened),
            Err(answer) => answer,
        }
    }

    /// The entry of `key` (hashed `hash`) in its locked `shard`, made when missing (after
    /// an eviction when the shard is full) unless `missing` answers for a missing key
    /// instead (`Err`): what [`with_entry`](Self::with_entry) runs its closure on.
    #[inline(always)]
    fn open<'a, R>(
        &self,
        shard: &'a mut Shard,
        key: &Key,
        hash: u64,
        now: u64,
        missing: impl FnOnce(&mut lockout::Blocks, u64, usize) -> Option<R>,
    ) -> Result<Opened<'a>, R> {
        let Shard {
            table,
            known,
            max_keys,
            hand,
            blocks,
            ..
        } = shard;
        let entry = match table.find_entry(hash, |e| e.key == *key) {
            Ok(occupied) => occupied.into_mut(),
            Err(absent) => {
                if let Some(answer) = missing(blocks, hash, *max_keys) {
                    return Err(answer);
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
        Ok(Opened {
            slots: &mut entry.slots,
            known,
            blocks,
            hash,
            max_keys: *max_keys,
        })
    }

    /// While a sweep round is under way, sweeps the next [`SWEEP_BUCKETS`] buckets of the
    /// shard the round is in; the round ends after the last shard.
    pub(super) fn maybe_sweep(&self, now: u64) {
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

/// The `missing` of a decision: a missing key is made, never answered for.
#[inline(always)]
fn no_answer(_: &mut lockout::Blocks, _: u64, _: usize) -> Option<std::convert::Infallible> {
    None
}

/// Whether any of `limits` has a lockout.
#[inline(always)]
fn lockouts(limits: &[Limit]) -> bool {
    match limits {
        [limit] => limit.lockout_ms() != 0,
        _ => limits.iter().any(|l| l.lockout_ms() != 0),
    }
}
