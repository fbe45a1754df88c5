//! One key's traffic and lease on this node, and the table that tells a hot key from a
//! cold one before it gets an entry.

use std::{
    hash::BuildHasher,
    sync::{
        Arc,
        atomic::{AtomicU64, Ordering},
    },
};

use hashbrown::DefaultHashBuilder;
use parking_lot::Mutex;
use quick_cache::Equivalent;
use smallvec::SmallVec;

use crate::{
    Decision, LimitDecision, decision::LimitDecisions, key::Key, store::redis::encode::Target,
};

#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub(super) struct EntryKey {
    pub(super) key: Key,
    pub(super) limits: u64,
}

#[derive(Hash)]
pub(super) struct EntryKeyRef<'a> {
    pub(super) key: &'a Key,
    pub(super) limits: u64,
}

impl Equivalent<EntryKey> for EntryKeyRef<'_> {
    fn equivalent(&self, other: &EntryKey) -> bool {
        self.limits == other.limits && *self.key == other.key
    }
}

/// One key and list of limits on this node: its traffic and its lease.
#[derive(Default)]
pub(crate) struct Entry {
    pub(super) state: Mutex<EntryState>,
}

#[derive(Default)]
pub(super) struct EntryState {
    /// The current measuring period: since when, requests and units in it.
    pub(super) since: u64,
    pub(super) requests: u64,
    pub(super) units: u64,
    /// Requests in the period before, if it ended less than a period ago.
    pub(super) previous_requests: u64,
    /// Smoothed units per period.
    pub(super) rate: u64,
    /// The last request (local ms).
    pub(super) last: u64,
    /// A request carrying an ask is on its way.
    pub(super) asking: bool,
    /// In [`Leases::held`].
    pub(super) registered: bool,
    /// Bumped by a reset: a grant asked for before it is not taken.
    pub(super) generation: u64,
    pub(super) lease: Option<Lease>,
}

impl EntryState {
    pub(super) fn observe(&mut self, now: u64, cost: u32, period: u64) {
        if now >= self.since + period {
            let elapsed = now - self.since;
            self.rate = (self.rate + self.units.saturating_mul(period) / elapsed) / 2;
            self.previous_requests = if elapsed < 2 * period {
                self.requests
            } else {
                0
            };
            (self.since, self.requests, self.units) = (now, 0, 0);
        }
        self.requests += 1;
        self.units += u64::from(cost);
        self.last = now;
    }

    pub(super) fn hot(&self) -> bool {
        self.requests >= 2 || self.previous_requests >= 2
    }
}

/// Keys seen lately that have no entry: a table of slots, each the last key hashed to it
/// (32 bits of its hash) and when (local ms, low 32 bits). A key whose slot names it
/// within one period is seen again: hot, so it gets an entry. Slots are overwritten by
/// other keys and raced without a lock; either only makes a key wait for one more
/// request before it is watched (or, rarely, watched one request early), never changes
/// a decision.
pub(super) struct Seen {
    pub(super) slots: Box<[AtomicU64]>,
    pub(super) hasher: DefaultHashBuilder,
}

impl Seen {
    pub(super) fn new(keys: usize) -> Self {
        let len = keys.next_power_of_two().max(64);
        Self {
            slots: (0..len).map(|_| AtomicU64::new(0)).collect(),
            hasher: DefaultHashBuilder::default(),
        }
    }

    /// Records `lookup` at `now`; when it was last seen, if within `period` ms.
    pub(super) fn again(&self, lookup: &EntryKeyRef<'_>, now: u64, period: u64) -> Option<u64> {
        let hash = self.hasher.hash_one(lookup);
        let slot = &self.slots[(hash as usize) & (self.slots.len() - 1)];
        let tag = hash >> 32;
        let stamp = (tag << 32) | (now & 0xFFFF_FFFF);
        let last = slot.swap(stamp, Ordering::Relaxed);
        if last >> 32 != tag || last == 0 {
            return None;
        }
        let ago = (now as u32).wrapping_sub(last as u32);
        (u64::from(ago) < period).then(|| now.saturating_sub(u64::from(ago)))
    }
}

/// Units held for one key and list of limits, in one window.
pub(super) struct Lease {
    pub(super) units: u64,
    pub(super) granted: u64,
    /// Local ms from which the lease is worthless (its window ended).
    pub(super) deadline: u64,
    /// Each limit's window start, as Redis counted it.
    pub(super) starts: SmallVec<[u64; 2]>,
    /// Each limit's quota, remaining without this lease, and when it resets (local ms).
    pub(super) limits: SmallVec<[(u32, u64, u64); 2]>,
    /// The script's `now` at the grant: a decision spent from the lease says it was made
    /// then, so that a refund or top-up after the response
    /// ([`Store::adjust`](crate::store::Store::adjust)) finds the window the units were counted in.
    pub(super) granted_at: Option<u64>,
    /// Where to send the units back.
    pub(super) target: Arc<Target>,
}

impl Lease {
    /// A local decision: allowed, `remaining` counting what the lease still holds.
    pub(super) fn decision(&self, now: u64) -> Decision {
        let limits: LimitDecisions = self
            .limits
            .iter()
            .map(|&(limit, base, reset_at)| {
                LimitDecision::allow(limit, base + self.units, reset_at.saturating_sub(now))
            })
            .collect();
        let decision = Decision::from_limits(limits);
        match self.granted_at {
            Some(at) => decision.decided_at(at),
            None => decision,
        }
    }
}
