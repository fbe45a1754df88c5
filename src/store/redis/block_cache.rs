//! The block cache: denied keys are answered locally until their `retry_after` passes.

use quick_cache::{Equivalent, sync::Cache};

use crate::{Decision, Limit, LimitDecision, decision::LimitDecisions, key::Key};

/// The default number of denied keys remembered.
pub(crate) const DEFAULT_BLOCK_CACHE_SIZE: usize = 10_000;

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
}

impl BlockCache {
    pub(crate) fn new(capacity: usize) -> Self {
        Self {
            entries: Cache::new(capacity),
        }
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

    /// Forgets a denial of `key`: a cheaper request fit, so the denial's `retry_after` may
    /// be later now than it was.
    pub(crate) fn forget(&self, key: &Key, limits: u64) {
        if !self.entries.is_empty() {
            self.entries.remove(&CacheKeyRef { key, limits });
        }
    }

    /// Remembers that Redis denied `key` at `now`.
    ///
    /// A denial under a lockout block is remembered until the block ends at most, even
    /// when `retry_after` is longer (the algorithm's wait): then the same request starts
    /// a new block, which Redis must see.
    pub(crate) fn insert(&self, key: Key, limits: u64, cost: u32, now: u64, decision: &Decision) {
        let mut valid = decision.retry_after().as_millis() as u64;
        if decision.blocked_ms() > 0 {
            valid = valid.min(decision.blocked_ms());
        }
        if valid == 0 {
            return;
        }
        let blocked = Blocked {
            at: now,
            until: now + valid,
            cost,
            blocked_ms: decision.blocked_ms(),
            limits: decision.limits().into(),
        };
        self.entries.insert(CacheKey { key, limits }, blocked);
    }
}
