//! [`Decision`]: what a store decided for one request.

use std::{sync::Arc, time::Duration};

use smallvec::SmallVec;

/// Per-limit outcomes: inline for up to two limits, the common case.
pub(crate) type LimitDecisions = SmallVec<[LimitDecision; 2]>;

/// The outcome for one [`Limit`](crate::Limit) of a request.
///
/// A custom [`Store`](crate::store::Store) builds these with [`allow`](Self::allow) and
/// [`deny`](Self::deny).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[non_exhaustive]
pub struct LimitDecision {
    /// Whether this limit alone had room for the request.
    pub allowed: bool,
    /// The limit's quota per window.
    pub limit: u32,
    /// Units left after this request (before it, when the request was denied).
    pub remaining: u64,
    /// Milliseconds until this limit is fully restored.
    pub reset_after_ms: u64,
    /// Milliseconds until the same request would fit this limit (0 when it fits now).
    pub retry_after_ms: u64,
}

impl LimitDecision {
    /// This limit of `limit` units had room: `remaining` are left, and it is fully
    /// restored in `reset_after_ms`.
    pub const fn allow(limit: u32, remaining: u64, reset_after_ms: u64) -> Self {
        Self {
            allowed: true,
            limit,
            remaining,
            reset_after_ms,
            retry_after_ms: 0,
        }
    }

    /// This limit of `limit` units had no room: `remaining` are left, it is fully restored
    /// in `reset_after_ms`, and the same request would fit in `retry_after_ms`.
    pub const fn deny(
        limit: u32,
        remaining: u64,
        reset_after_ms: u64,
        retry_after_ms: u64,
    ) -> Self {
        Self {
            allowed: false,
            limit,
            remaining,
            reset_after_ms,
            retry_after_ms,
        }
    }

    /// Time until this limit is fully restored.
    pub fn reset_after(&self) -> Duration {
        Duration::from_millis(self.reset_after_ms)
    }

    /// Time until the same request would fit this limit.
    pub fn retry_after(&self) -> Duration {
        Duration::from_millis(self.retry_after_ms)
    }
}

/// What a store decided for one request over all of its limits, all-or-nothing: the
/// request is allowed only when every limit has room, and a denied request consumes
/// nothing from any of them.
///
/// Equality compares the outcome (allowed, every limit's numbers and the
/// [`wait`](Self::wait)), not [`decided_at_ms`](Self::decided_at_ms).
#[derive(Debug, Clone)]
pub struct Decision {
    allowed: bool,
    limits: LimitDecisions,
    /// The least time (ms) left on a lockout block among the limits that blocked this
    /// request, 0 when none did: how long a cached copy of this denial stays true (after
    /// that, the same request would start a new block). See
    /// [`Limit::with_lockout`](crate::Limit::with_lockout). A `u32` (saturating, about 49
    /// days) fits beside `allowed`, so a `Decision` is no larger than without it; a cache
    /// that reads a saturated value only forgets a denial early.
    blocked_ms: u32,
    /// A reservation ([`wait`](Self::wait)): ms to wait before the request may run, 0 for
    /// a request that may run at once. Saturating, as `blocked_ms`.
    wait_ms: u32,
    /// The store's time of the decision (ms), where a refund finds the units' state.
    at_ms: Option<u64>,
}

impl PartialEq for Decision {
    fn eq(&self, other: &Self) -> bool {
        self.allowed == other.allowed
            && self.limits == other.limits
            && self.wait_ms == other.wait_ms
    }
}

impl Eq for Decision {}

impl Decision {
    /// A decision from per-limit outcomes, in the order of the limits.
    pub fn new(limits: Vec<LimitDecision>) -> Self {
        Self::from_limits(SmallVec::from_vec(limits))
    }

    pub(crate) fn from_limits(limits: LimitDecisions) -> Self {
        let allowed = limits.iter().all(|l| l.allowed);
        Self {
            allowed,
            limits,
            blocked_ms: 0,
            wait_ms: 0,
            at_ms: None,
        }
    }

    /// The same decision with the in-flight cap's answer last: `cap` is `None` when the
    /// cap had room (nothing is added), else its denial, which denies the decision.
    pub(crate) fn with_cap(mut self, cap: Option<LimitDecision>) -> Self {
        if let Some(cap) = cap {
            self.allowed = false;
            self.limits.push(cap);
        }
        self
    }

    /// Takes the last limit's outcome out (the in-flight cap a store decided beside the
    /// limits), the decision then being the other limits' alone.
    #[cfg_attr(not(feature = "redis"), allow(dead_code))]
    pub(crate) fn pop_limit(&mut self) -> Option<LimitDecision> {
        let last = self.limits.pop();
        self.allowed = self.limits.iter().all(|l| l.allowed);
        last
    }

    /// The same decision, allowed after a wait of `wait_ms`: a reservation, made by
    /// [`Store::reserve`](crate::store::Store::reserve). The units are counted already at the
    /// moment the request may run; the caller waits `wait_ms`, then runs it without asking
    /// the store again. (0: no wait. Saturates at `u32::MAX` ms, about 49 days.)
    #[must_use]
    pub fn with_wait(mut self, wait_ms: u64) -> Self {
        self.wait_ms = u32::try_from(wait_ms).unwrap_or(u32::MAX);
        self
    }

    /// How long an allowed request must wait before it runs: zero unless the store
    /// [reserved](crate::store::Store::reserve) its units for a moment ahead. See
    /// [`RateLimitLayer::with_max_wait`](crate::RateLimitLayer::with_max_wait).
    pub fn wait(&self) -> Duration {
        Duration::from_millis(self.wait_ms())
    }

    /// [`wait`](Self::wait) in milliseconds.
    pub fn wait_ms(&self) -> u64 {
        u64::from(self.wait_ms)
    }

    /// The same decision, blocked by a lockout for `blocked_ms` more (0: not blocked).
    pub(crate) fn blocked_for(mut self, blocked_ms: u64) -> Self {
        self.blocked_ms = u32::try_from(blocked_ms).unwrap_or(u32::MAX);
        self
    }

    /// See [`blocked_for`](Self::blocked_for).
    #[cfg_attr(not(feature = "redis"), allow(dead_code))]
    pub(crate) fn blocked_ms(&self) -> u64 {
        u64::from(self.blocked_ms)
    }

    /// The same decision, made at `at_ms` on the store's clock.
    #[must_use]
    pub fn decided_at(mut self, at_ms: u64) -> Self {
        self.at_ms = Some(at_ms);
        self
    }

    /// When the store made this decision, on its own clock (ms): the memory store's clock,
    /// Redis `TIME` or the clock given to the Redis store. A
    /// [refund](crate::Adjustment::Refund) names it to find the window or log entry the
    /// units were charged to. `None` from a store that does not say.
    pub fn decided_at_ms(&self) -> Option<u64> {
        self.at_ms
    }

    /// A decision that allows the request without any limit (used by the fail-open
    /// policy and when no key applies).
    pub fn unlimited() -> Self {
        Self {
            allowed: true,
            limits: SmallVec::new(),
            blocked_ms: 0,
            wait_ms: 0,
            at_ms: None,
        }
    }

    /// Whether the request may pass.
    pub fn is_allowed(&self) -> bool {
        self.allowed
    }

    /// Per-limit outcomes, in the order of the layer's limits.
    pub fn limits(&self) -> &[LimitDecision] {
        &self.limits
    }

    /// Time until the same request would be allowed: the longest wait of the limits that
    /// denied it, zero when allowed.
    pub fn retry_after(&self) -> Duration {
        Duration::from_millis(self.retry_after_ms())
    }

    pub(crate) fn retry_after_ms(&self) -> u64 {
        self.limits
            .iter()
            .map(|l| l.retry_after_ms)
            .max()
            .unwrap_or(0)
    }

    /// The most restrictive limit: the one with the fewest units remaining.
    pub fn tightest(&self) -> Option<&LimitDecision> {
        self.limits
            .iter()
            .min_by_key(|l| (l.remaining, u64::MAX - l.reset_after_ms))
    }

    /// Units remaining under the most restrictive limit.
    pub fn remaining(&self) -> Option<u64> {
        self.tightest().map(|l| l.remaining)
    }
}

/// What a [`RateLimitLayer`](crate::RateLimitLayer) decided for a request, in the
/// request's extensions for the inner service (as express-rate-limit's `req.rateLimit`):
/// the decision (limit, remaining, reset per limit) and the [plan](crate::plan) it was
/// decided under. With [`RateLimitLayer::with_request_info`](crate::RateLimitLayer::with_request_info),
/// set on every request the store allowed; absent on one let through
/// without a decision (no key with [`MissingKey::Allow`](crate::MissingKey::Allow), a
/// failing store under [`FailurePolicy::Allow`](crate::FailurePolicy::Allow), an
/// unlimited plan).
///
/// ```
/// use axum::{Extension, Router, routing::get};
/// use tollgate::RateLimitInfo;
///
/// async fn handler(Extension(info): Extension<RateLimitInfo>) -> String {
///     format!("{:?} left", info.decision().remaining())
/// }
/// let app: Router = Router::new().route("/", get(handler));
/// # let _ = app;
/// ```
#[derive(Debug, Clone)]
pub struct RateLimitInfo {
    decision: Decision,
    plan: Option<Arc<str>>,
}

impl RateLimitInfo {
    pub(crate) fn new(decision: Decision, plan: Option<Arc<str>>) -> Self {
        Self { decision, plan }
    }

    /// The decision: per limit, its quota, what is left and when it is restored.
    pub fn decision(&self) -> &Decision {
        &self.decision
    }

    /// The name of the plan the request was decided under, if the layer has plans.
    pub fn plan(&self) -> Option<&str> {
        self.plan.as_deref()
    }
}
