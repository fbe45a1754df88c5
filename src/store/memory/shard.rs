//! A shard: its table, what its entries hold, and the limits its slots were made for.

use hashbrown::{HashMap, HashTable};
use parking_lot::{Mutex, MutexGuard};
use smallvec::SmallVec;

use super::lockout;
use crate::{Limit, algorithm::State, key::Key};

/// How many shards a store has, each behind its own lock.
pub(super) const SHARDS: usize = 64;

/// One lock's worth of keys.
///
/// Entries are inline, 56 bytes for a key with one limit: a table is 44% to 87% full, so
/// 75 to 120 bytes per key. Boxing them (8 bytes per slot, the entry on the heap) would
/// add a pointer read, a cache miss once there are many keys, to every decision: with 1M
/// keys that measured 0.45x governor's decisions/s against 0.72x inline. (For the same
/// reason the store does not use `quick_cache`, whose entries sit in a slab behind the
/// table, with list links, and which cannot prefer expired state.)
pub(super) struct Shard {
    /// Hashed once per decision: the hash picks the shard (from bits that the table
    /// itself does not use) and finds the entry.
    pub(super) table: HashTable<Entry>,
    /// The limits this shard's slots were made for, by fingerprint: a slot keeps only the
    /// fingerprint, and the sweep asks its limit when the state expires (an expiry in
    /// every slot would make entries 8 bytes larger).
    pub(super) known: Known,
    /// Keys this shard holds at most: its share of the store's bound.
    pub(super) max_keys: usize,
    /// The CLOCK hand: the bucket where the next eviction starts looking.
    pub(super) hand: usize,
    /// The bucket where this shard's sweep resumes.
    pub(super) swept_to: usize,
    /// The keys blocked by a limit's lockout, apart from `table`: see `lockout`.
    pub(super) blocks: lockout::Blocks,
}

/// Beyond this many known limits, a limit is forgotten when its last slot goes.
pub(super) const KNOWN_LIMITS_KEPT: usize = 64;

/// The top bit of [`Slot::tagged`]: CLOCK's reference bit, set when an existing slot
/// decides a request and cleared as the eviction hand passes. It takes a bit of the limit's
/// 64-bit fingerprint so that entries stay 56 bytes.
pub(super) const REFERENCED: u64 = 1 << 63;

/// A limit's fingerprint as slots keep it (without the [`REFERENCED`] bit).
pub(super) fn fingerprint(limit: &Limit) -> u64 {
    limit.fingerprint() & !REFERENCED
}

pub(super) struct Entry {
    pub(super) key: Key,
    pub(super) slots: Slots,
}

impl Entry {
    /// Whether every slot's state has expired: the key decides like a missing one.
    pub(super) fn is_expired(&self, known: &Known, now: u64) -> bool {
        self.slots.iter().all(|slot| known.expires_at(slot) <= now)
    }

    /// Whether a slot decided a request since the last call; clears the marks.
    pub(super) fn take_referenced(&mut self) -> bool {
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
pub(super) enum Slots {
    One(Slot),
    /// Two or more, or none once purged.
    Many(Vec<Slot>),
}

impl Slots {
    pub(super) const fn new() -> Self {
        Self::Many(Vec::new())
    }

    pub(super) fn push(&mut self, slot: Slot) {
        *self = match std::mem::replace(self, Self::new()) {
            Self::Many(slots) if slots.is_empty() => Self::One(slot),
            Self::One(first) => Self::Many(vec![first, slot]),
            Self::Many(mut slots) => {
                slots.push(slot);
                Self::Many(slots)
            }
        };
    }

    pub(super) fn retain(&mut self, mut keep: impl FnMut(&Slot) -> bool) {
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
    pub(super) fn find(&self, fingerprint: u64) -> Option<usize> {
        self.iter()
            .position(|slot| slot.tagged & !REFERENCED == fingerprint)
    }

    /// Takes the state of each of `limits` out of its slot (marked used; made when
    /// missing), to decide a request of several limits on: with the slots' indexes, for
    /// [`put_back`](Self::put_back).
    pub(super) fn take_states(
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
    pub(super) fn put_back(&mut self, indexes: &[usize], states: SmallVec<[State; 2]>) {
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

pub(super) struct Slot {
    /// The limit's [`fingerprint`], and the [`REFERENCED`] bit.
    pub(super) tagged: u64,
    pub(super) state: State,
}

impl Shard {
    pub(super) fn new(max_keys: usize) -> Self {
        Self {
            table: HashTable::new(),
            known: Known::default(),
            max_keys,
            hand: 0,
            swept_to: 0,
            blocks: lockout::Blocks::default(),
        }
    }
}

/// A shard's limits by fingerprint, with how many slots use each.
#[derive(Default)]
pub(super) struct Known(pub(super) HashMap<u64, Used>);

pub(super) struct Used {
    limit: Limit,
    pub(super) slots: usize,
}

impl Known {
    /// When `slot`'s state decides like a missing key (0 when its limit is unknown, which
    /// cannot happen: a limit is known while a slot uses it).
    pub(super) fn expires_at(&self, slot: &Slot) -> u64 {
        self.0
            .get(&(slot.tagged & !REFERENCED))
            .map_or(0, |used| slot.state.expires_at(&used.limit))
    }

    /// Takes `limit`'s new parameters for the slots that share its fingerprint (a
    /// carried-over limit that changed).
    pub(super) fn update(&mut self, limit: &Limit) {
        if let Some(used) = self.0.get_mut(&fingerprint(limit))
            && used.limit != *limit
        {
            used.limit = limit.clone();
        }
    }

    /// Counts `slot`, which is going away, out of its limit's users. Beyond
    /// [`KNOWN_LIMITS_KEPT`] (limits made at run time, say), a limit no slot uses any
    /// more is forgotten.
    pub(super) fn release(&mut self, slot: &Slot) {
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
    pub(super) fn new(limit: &Limit, known: &mut Known) -> Self {
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

pub(super) fn lock(shard: &Mutex<Shard>) -> MutexGuard<'_, Shard> {
    shard.lock()
}

#[cfg(test)]
mod tests {
    use super::Entry;

    #[test]
    fn an_entry_for_one_limit_stays_56_bytes() {
        // What keeps a tracked key under 128 bytes at a table's emptiest (44% full):
        // `benches/memory_per_key.rs` measures it.
        assert_eq!(std::mem::size_of::<Entry>(), 56);
    }
}
