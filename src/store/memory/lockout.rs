//! The memory store's lockouts ([`Limit::with_lockout`]): the blocks, in a table of their
//! own next to the shard's keys, touched only by requests whose limits have a lockout
//! (`Inner::decide_with_lockouts` in the module above).
//!
//! A block lives apart from the key's algorithm state because it outlives it (a 15-minute
//! block on a one-minute window), and so that entries stay 56 bytes for everyone else.

use hashbrown::HashTable;

use crate::{algorithm::Pending, key::Key};

/// The blocks of one shard: (key, limit) -> when the block ends, and the units pending
/// for the limit's lockout ([`Limit::pending_until_settled`](crate::Limit::pending_until_settled)).
/// An entry lives while either matters.
#[derive(Default)]
pub(super) struct Blocks {
    table: HashTable<Block>,
    /// The table's size at which expired blocks are dropped next: twice the live ones
    /// after the last purge, so that purging costs O(1) per block written.
    purge_at: usize,
}

struct Block {
    /// The hash of (key, limit), kept for the table's rehashing.
    hash: u64,
    key: Key,
    fingerprint: u64,
    until: u64,
    pending: Pending,
    /// When `pending` stops mattering (0: it holds nothing).
    pending_until: u64,
}

/// The fewest blocks a shard holds before it purges expired ones.
const PURGE_MIN: usize = 64;

impl Blocks {
    fn hash(key_hash: u64, fingerprint: u64) -> u64 {
        (key_hash ^ fingerprint).wrapping_mul(0x9E37_79B9_7F4A_7C15)
    }

    /// When the block of `key` under the limit with `fingerprint` ends (0: never blocked),
    /// and the units pending for it.
    pub(super) fn get(&self, key_hash: u64, key: &Key, fingerprint: u64) -> (u64, Pending) {
        self.table
            .find(Self::hash(key_hash, fingerprint), |b| {
                b.fingerprint == fingerprint && b.key == *key
            })
            .map_or((0, Pending::default()), |b| (b.until, b.pending))
    }

    /// Blocks `key` under the limit with `fingerprint` until `until`, with `pending`
    /// units pending until `pending_until` (0: none). Beyond `max` blocks
    /// (the shard's share of the store's keys), expired blocks go first, then an eighth
    /// of the table, oldest in table order: memory stays bounded, and as with the keys'
    /// state, only a flood of breaching keys can end a block early.
    pub(super) fn set(
        &mut self,
        key_hash: u64,
        key: &Key,
        fingerprint: u64,
        (until, pending, pending_until): (u64, Pending, u64),
        now: u64,
        max: usize,
    ) {
        let hash = Self::hash(key_hash, fingerprint);
        if let Some(block) = self
            .table
            .find_mut(hash, |b| b.fingerprint == fingerprint && b.key == *key)
        {
            block.until = until;
            block.pending = pending;
            block.pending_until = pending_until;
            return;
        }
        if self.table.len() >= self.purge_at.max(PURGE_MIN) || self.table.len() >= max {
            self.purge(now);
            if self.table.len() >= max {
                let mut to_drop = self.table.len() / 8 + 1;
                self.table.retain(|_| {
                    if to_drop == 0 {
                        return true;
                    }
                    to_drop -= 1;
                    false
                });
            }
            self.purge_at = 2 * self.table.len();
        }
        self.table.insert_unique(
            hash,
            Block {
                hash,
                key: key.clone(),
                fingerprint,
                until,
                pending,
                pending_until,
            },
            |b| b.hash,
        );
    }

    /// Ends the block of `key` under the limit with `fingerprint`, if any (a reset).
    pub(super) fn remove(&mut self, key_hash: u64, key: &Key, fingerprint: u64) {
        let hash = Self::hash(key_hash, fingerprint);
        if let Ok(block) = self
            .table
            .find_entry(hash, |b| b.fingerprint == fingerprint && b.key == *key)
        {
            block.remove();
        }
    }

    /// Drops the blocks that have ended (and whose pending units stopped mattering).
    pub(super) fn purge(&mut self, now: u64) {
        self.table
            .retain(|b| b.until > now || b.pending_until > now);
    }

    /// How many blocks are held (ended ones not yet purged included).
    #[cfg(test)]
    pub(super) fn len(&self) -> usize {
        self.table.len()
    }
}

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use super::super::{MemoryStore, shard::lock};
    use crate::{Limit, clock::ManualClock, key::Key};

    fn login() -> Limit {
        Limit::fixed_window(2, Duration::from_secs(1))
            .unwrap()
            .with_lockout(Duration::from_secs(60))
            .unwrap()
    }

    #[test]
    fn a_block_outlives_the_swept_state_of_its_key() {
        let clock = ManualClock::new(1_000_000);
        let store = MemoryStore::new().with_clock(clock.clone());
        let limits = [login()];
        let key = Key::new("mallory");
        for _ in 0..3 {
            store.decide(&key, &limits, 1);
        }
        // The window's state expires and is purged; the block stays.
        clock.advance(Duration::from_secs(30));
        store.purge_expired();
        assert_eq!(store.len(), 0);
        let d = store.decide(&key, &limits, 1);
        assert!(!d.is_allowed());
        assert_eq!(d.retry_after(), Duration::from_secs(30));
        clock.advance(Duration::from_secs(30));
        assert!(store.decide(&key, &limits, 1).is_allowed());
        // Limiting came back after the block: the window counts again.
        assert!(store.decide(&key, &limits, 1).is_allowed());
        assert!(!store.decide(&key, &limits, 1).is_allowed());
    }

    /// A block is state until the moment it ends and is dropped then, as the Redis block
    /// key expires: one millisecond before its end a purge keeps it, at its end a purge
    /// drops it.
    #[test]
    fn a_block_is_dropped_exactly_when_it_ends() {
        let clock = ManualClock::new(1_000_000);
        let store = MemoryStore::new().with_clock(clock.clone());
        let limits = [login()];
        let key = Key::new("mallory");
        for _ in 0..3 {
            store.decide(&key, &limits, 1);
        }
        let blocks = || -> usize {
            store
                .inner
                .shards
                .iter()
                .map(|s| lock(s).blocks.len())
                .sum()
        };
        clock.set(1_000_000 + 60_000 - 1);
        store.purge_expired();
        assert_eq!(blocks(), 1);
        let d = store.decide(&key, &limits, 1);
        assert_eq!(
            (d.is_allowed(), d.retry_after()),
            (false, Duration::from_millis(1))
        );
        clock.set(1_000_000 + 60_000);
        store.purge_expired();
        assert_eq!(blocks(), 0);
    }

    /// A settle that charges more than it was charged (a top-up) for a key whose state
    /// was swept ends its pending units once: the units still in flight keep a denial
    /// from blocking.
    #[test]
    fn a_settle_for_a_swept_key_ends_its_pending_units_once() {
        let clock = ManualClock::new(1_000_000);
        let store = MemoryStore::new().with_clock(clock.clone());
        let limits = [Limit::token_bucket(2, Duration::from_secs(1))
            .unwrap()
            .with_lockout(Duration::from_secs(60))
            .unwrap()
            .pending_until_settled()];
        let key = Key::new("k");
        assert!(store.decide(&key, &limits, 1).is_allowed());
        assert!(store.decide(&key, &limits, 1).is_allowed());
        // Refilled and swept; both charges are still pending.
        clock.advance(Duration::from_millis(1_500));
        store.purge_expired();
        assert_eq!(store.len(), 0);
        let settle = crate::Adjustment::Settle {
            charged: 1,
            kept: 2,
            charged_at_ms: 1_000_000,
        };
        store.adjust_now(&key, &limits, settle);
        assert!(store.decide(&key, &limits, 1).is_allowed());
        // Empty, two units in flight: denied, not blocked.
        let denied = store.decide(&key, &limits, 2);
        assert!(!denied.is_allowed());
        assert_eq!(denied.blocked_ms(), 0, "{denied:?}");
    }

    #[test]
    fn blocks_are_bounded_and_purged() {
        let clock = ManualClock::new(0);
        let store = MemoryStore::new()
            .with_clock(clock.clone())
            .with_max_keys(64 * 100);
        let limits = [Limit::fixed_window(1, Duration::from_secs(1))
            .unwrap()
            .with_lockout(Duration::from_secs(3_600))
            .unwrap()];
        let blocks = || -> usize {
            store
                .inner
                .shards
                .iter()
                .map(|s| lock(s).blocks.len())
                .sum()
        };
        for i in 0..50_000u32 {
            store.decide(&Key::from(i), &limits, 2);
        }
        assert!(blocks() <= 64 * 100, "{}", blocks());
        assert!(blocks() >= 64 * 50, "{}", blocks());
        clock.advance(Duration::from_secs(3_600));
        store.purge_expired();
        assert_eq!(blocks(), 0);
    }
}
