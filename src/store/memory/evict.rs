//! What keeps the memory store bounded: the sweep that drops expired state a few buckets
//! per request, and CLOCK eviction once a shard holds its share of the keys.

use hashbrown::HashTable;

use super::shard::{Entry, Known, Shard};

/// How often (in store-clock milliseconds) a sweep round starts.
pub(super) const SWEEP_INTERVAL_MS: u64 = 1_000;
/// Buckets one request sweeps while a round is under way: about 2 µs of work, so that a
/// round over a full default store (2M buckets) takes about 16 000 requests.
pub(super) const SWEEP_BUCKETS: usize = 128;
/// Entries past the one the eviction hand stopped at that are checked for expired state,
/// which then goes first (Redis samples 5 keys for its approximated LRU).
const EVICTION_SAMPLE: usize = 8;
/// Marked entries the hand passes over at most for one eviction: if every one is in use,
/// the last goes.
const EVICTION_MAX: usize = 64;

impl Shard {
    /// Drops the expired state in the next `buckets` buckets; true once this pass has
    /// reached the end of the table (the next starts again at its beginning).
    pub(super) fn sweep(&mut self, now: u64, buckets: usize) -> bool {
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
pub(super) fn drop_expired(
    table: &mut HashTable<Entry>,
    known: &mut Known,
    index: usize,
    now: u64,
) {
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
pub(super) fn evict(table: &mut HashTable<Entry>, known: &mut Known, hand: &mut usize, now: u64) {
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

#[cfg(test)]
mod tests {
    use std::{hash::BuildHasher, time::Duration};

    use hashbrown::DefaultHashBuilder;

    use super::{
        super::{SHARDS, shard::*},
        *,
    };
    use crate::{Limit, algorithm, clock::ManualClock, key::Key, store::MemoryStore};

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
}
