//! The block cache: denied keys are answered locally until their `retry_after` passes,
//! or until a reset of the key (on this replica or, through Redis pub/sub, on any other;
//! see [`listen`]).

use std::sync::{
    Arc,
    atomic::{AtomicBool, AtomicU64, Ordering},
};

use parking_lot::Mutex;
use quick_cache::{Equivalent, sync::Cache};

mod listen;

use self::listen::{Listener, Resets};
pub(crate) use self::listen::{ResetNodes, Source};

use crate::{
    Decision, Limit, LimitDecision,
    clock::{Clock, MonotonicClock},
    decision::LimitDecisions,
    key::Key,
};

/// Milliseconds on the store's local clock (a [`MonotonicClock`] when none was set): for
/// the block cache and the leases only; decisions use Redis `TIME` or the explicit clock.
pub(crate) fn local_now_ms(clock: Option<&Arc<dyn Clock>>) -> u64 {
    clock.map_or_else(|| MonotonicClock.now_ms(), |c| c.now_ms())
}

/// The default number of denied keys remembered.
pub(crate) const DEFAULT_BLOCK_CACHE_SIZE: std::num::NonZeroUsize =
    std::num::NonZeroUsize::new(10_000).unwrap();

/// A denial, as Redis answered it at `at` (local ms).
#[derive(Debug, Clone)]
struct Blocked {
    at: u64,
    until: u64,
    cost: u32,
    /// The decision's lockout block, ms left at `at` (0: none).
    blocked_ms: u64,
    limits: std::sync::Arc<[LimitDecision]>,
}

#[derive(Debug, Clone, PartialEq, Eq, Hash)]
struct CacheKey {
    key: Key,
    limits: u64,
}

/// A borrowed [`CacheKey`], so that a lookup allocates nothing.
#[derive(Hash)]
struct CacheKeyRef<'a> {
    key: &'a Key,
    limits: u64,
}

impl Equivalent<CacheKey> for CacheKeyRef<'_> {
    fn equivalent(&self, other: &CacheKey) -> bool {
        self.limits == other.limits && *self.key == other.key
    }
}

/// Denied keys, bounded (quick_cache evicts the coldest entries when full).
pub(crate) struct BlockCache {
    entries: Cache<CacheKey, Blocked>,
    /// One more for every reset seen: a denial Redis gave before a reset that arrives
    /// after it (its call was in flight) is not remembered.
    generation: AtomicU64,
    /// Where resets announced by other replicas are heard, once the first denial is
    /// remembered.
    listener: Mutex<Listener>,
    /// Whether the listening task runs (it clears this when it ends).
    listening: Arc<AtomicBool>,
    /// The latest `until` of any denial remembered: from then on none stands, and a
    /// lookup would find nothing (the common case of a store that denies nothing). One
    /// atomic load instead of a hash and a shard lock per request.
    standing_until: AtomicU64,
}

impl BlockCache {
    pub(crate) fn new(capacity: usize) -> Self {
        Self {
            entries: Cache::new(capacity),
            generation: AtomicU64::new(0),
            listener: Mutex::new(Listener::default()),
            listening: Arc::new(AtomicBool::new(false)),
            standing_until: AtomicU64::new(0),
        }
    }

    /// Hears resets on `source` from the next denial on (`None`: nowhere).
    pub(crate) fn listen_to(&self, source: Option<Source>) {
        self.listener.lock().set_source(source);
    }

    /// The generation to give [`insert`](Self::insert): read before asking Redis.
    pub(crate) fn generation(&self) -> u64 {
        self.generation.load(Ordering::Acquire)
    }

    /// Forgets every denial of `key` (any limits): it was reset. Denials asked for
    /// before now and answered after are not remembered either.
    pub(crate) fn reset(&self, key: &str) {
        self.generation.fetch_add(1, Ordering::AcqRel);
        if !self.entries.is_empty() {
            self.entries.retain(|k, _| k.key.as_str() != key);
        }
    }

    /// Forgets every denial: resets may have been missed (the subscription was lost).
    pub(crate) fn reset_all(&self) {
        self.generation.fetch_add(1, Ordering::AcqRel);
        self.entries.clear();
    }

    /// A fingerprint of a list of limits, in order, and of all their parameters: a
    /// denial under 100/min says nothing about 200/min, even when the state carries over.
    pub(crate) fn fingerprint(limits: &[Limit]) -> u64 {
        limits.iter().fold(0, |acc, limit| {
            acc.rotate_left(17).wrapping_mul(0x9E37_79B9_7F4A_7C15) ^ limit.params_fingerprint()
        })
    }

    /// The denial still standing for `key` at `now`, if any, for a request of `cost`.
    pub(crate) fn get(&self, key: &Key, limits: u64, cost: u32, now: u64) -> Option<Decision> {
        if !self.may_stand(now) {
            return None;
        }
        let lookup = CacheKeyRef { key, limits };
        let blocked = self.entries.get(&lookup)?;
        // A cheaper request may fit earlier than the one that was denied, a dearer one
        // later: only the same request has the same `retry_after`.
        if now >= blocked.until || cost != blocked.cost {
            return None;
        }
        let elapsed = now.saturating_sub(blocked.at);
        let limits: LimitDecisions = blocked
            .limits
            .iter()
            .map(|l| {
                let retry_after_ms = l.retry_after_ms.saturating_sub(elapsed);
                LimitDecision {
                    allowed: retry_after_ms == 0 && l.allowed,
                    retry_after_ms,
                    reset_after_ms: l.reset_after_ms.saturating_sub(elapsed),
                    ..*l
                }
            })
            .collect();
        Some(Decision::from_limits(limits).blocked_for(blocked.blocked_ms.saturating_sub(elapsed)))
    }

    /// Whether a denial remembered may still stand at `now`. When not, every entry has
    /// expired (each `until` is at most the latest), and lookups and removals are moot.
    #[inline]
    fn may_stand(&self, now: u64) -> bool {
        now < self.standing_until.load(Ordering::Relaxed)
    }

    /// Forgets a denial of `key` (the store's clock reads `now`): a cheaper request fit,
    /// so the denial's `retry_after` may be later now than it was.
    pub(crate) fn forget(&self, key: &Key, limits: u64, now: u64) {
        if self.may_stand(now) {
            self.entries.remove(&CacheKeyRef { key, limits });
        }
    }

    /// Remembers that Redis denied `key` at `now`, unless a reset came since
    /// `generation` was read (the denial may predate it).
    ///
    /// A denial under a lockout block is remembered until the block ends at most, even
    /// when `retry_after` is longer (the algorithm's wait): then the same request starts
    /// a new block, which Redis must see.
    #[allow(clippy::too_many_arguments)]
    pub(crate) fn insert(
        self: &Arc<Self>,
        key: Key,
        limits: u64,
        cost: u32,
        now: u64,
        decision: &Decision,
        generation: u64,
    ) {
        let mut valid = decision.retry_after().as_millis() as u64;
        if decision.blocked_ms() > 0 {
            valid = valid.min(decision.blocked_ms());
        }
        if valid == 0 {
            return;
        }
        if !self.listening.load(Ordering::Acquire) {
            self.listener.lock().start(self, &self.listening);
        }
        if self.generation() != generation {
            return;
        }
        let until = now + valid;
        // Raised before the entry goes in: a lookup ordered after this insert sees both.
        self.standing_until.fetch_max(until, Ordering::Relaxed);
        let blocked = Blocked {
            at: now,
            until,
            cost,
            blocked_ms: decision.blocked_ms(),
            limits: decision.limits().into(),
        };
        let cache_key = CacheKey { key, limits };
        self.entries.insert(cache_key.clone(), blocked);
        // A reset between the check above and the insert: take it back.
        if self.generation() != generation {
            self.entries.remove(&cache_key);
        }
    }
}

impl Resets for BlockCache {
    fn reset(&self, key: &str) {
        BlockCache::reset(self, key);
    }

    fn reset_all(&self) {
        BlockCache::reset_all(self);
    }
}

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use super::*;

    fn denial() -> Decision {
        Decision::new(vec![LimitDecision {
            allowed: false,
            limit: 1,
            remaining: 0,
            reset_after_ms: 60_000,
            retry_after_ms: 60_000,
        }])
    }

    /// A denial Redis gave before a reset, answered after it (its call was in flight),
    /// is not remembered; one asked for after the reset is.
    #[test]
    fn a_denial_from_before_a_reset_is_not_remembered() {
        let cache = Arc::new(BlockCache::new(100));
        let limits = [Limit::fixed_window(1, Duration::from_secs(60)).unwrap()];
        let fingerprint = BlockCache::fingerprint(&limits);
        let key = Key::new("k");
        let asked = cache.generation();
        cache.reset(key.as_str());
        cache.insert(key.clone(), fingerprint, 1, 0, &denial(), asked);
        assert!(cache.get(&key, fingerprint, 1, 1).is_none());
        let asked = cache.generation();
        cache.insert(key.clone(), fingerprint, 1, 0, &denial(), asked);
        assert!(cache.get(&key, fingerprint, 1, 1).is_some());
        // A reset of another key leaves it; one of this key drops it.
        cache.reset(Key::new("other").as_str());
        assert!(cache.get(&key, fingerprint, 1, 1).is_some());
        cache.reset(key.as_str());
        assert!(cache.get(&key, fingerprint, 1, 1).is_none());
    }

    /// Lookups skip the cache once every denial in it has expired, and only then: a
    /// denial that stands is found however many others have expired, and a new denial
    /// stands again.
    #[test]
    fn lookups_skip_only_a_cache_whose_denials_have_all_expired() {
        let cache = Arc::new(BlockCache::new(100));
        let limits =
            BlockCache::fingerprint(&[Limit::fixed_window(1, Duration::from_secs(60)).unwrap()]);
        let (short, long) = (Key::new("short"), Key::new("long"));
        let denial_for = |ms: u64| {
            Decision::new(vec![LimitDecision {
                allowed: false,
                limit: 1,
                remaining: 0,
                reset_after_ms: ms,
                retry_after_ms: ms,
            }])
        };
        assert!(!cache.may_stand(0));
        cache.insert(
            long.clone(),
            limits,
            1,
            0,
            &denial_for(60_000),
            cache.generation(),
        );
        cache.insert(
            short.clone(),
            limits,
            1,
            0,
            &denial_for(1_000),
            cache.generation(),
        );
        assert!(cache.get(&short, limits, 1, 999).is_some());
        // The short denial expired, the long one stands (and is found after the short
        // one's time, and after a forget of the other key).
        assert!(cache.get(&short, limits, 1, 1_000).is_none());
        cache.forget(&short, limits, 1_000);
        assert!(cache.get(&long, limits, 1, 59_999).is_some());
        // Both expired: nothing is found, nothing is looked up.
        assert!(!cache.may_stand(60_000));
        assert!(cache.get(&long, limits, 1, 60_000).is_none());
        // A new denial stands until its own end.
        cache.insert(
            short.clone(),
            limits,
            1,
            70_000,
            &denial_for(500),
            cache.generation(),
        );
        assert!(cache.get(&short, limits, 1, 70_499).is_some());
        assert!(cache.get(&long, limits, 1, 70_499).is_none());
        assert!(cache.get(&short, limits, 1, 70_500).is_none());
        // A forget while it stands still drops it.
        cache.insert(
            long.clone(),
            limits,
            1,
            80_000,
            &denial_for(500),
            cache.generation(),
        );
        cache.forget(&long, limits, 80_001);
        assert!(cache.get(&long, limits, 1, 80_002).is_none());
    }
}
