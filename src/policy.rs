//! What the layer does when it cannot decide: no key, or a failing store.

use std::fmt;

use http::Request;

use crate::{StoreError, key::Key, store::MemoryStore};

/// What a request gets when the store fails (an error, or no answer within the timeout).
///
/// The default is [`Allow`](Self::Allow): availability first, every failure logged with
/// `tracing::warn!`. Choose [`Deny`](Self::Deny) to protect a backend that must not be
/// overrun, or [`Local`](Self::Local) to keep limiting per process until the store is back.
#[derive(Clone, Default)]
#[non_exhaustive]
pub enum FailurePolicy {
    /// Fail open: pass the request to the inner service, without rate-limit fields.
    #[default]
    Allow,
    /// Fail closed: answer 503 with `Retry-After: 1` (gRPC: UNAVAILABLE), never 500.
    Deny,
    /// Decide with this in-process store, with the same limits, until the shared store
    /// answers again. Budgets are then per process.
    Local(MemoryStore),
}

impl FailurePolicy {
    /// [`Local`](Self::Local) with a new [`MemoryStore`], bounded by
    /// [`MemoryStore::DEFAULT_MAX_KEYS`].
    pub fn local() -> Self {
        Self::Local(MemoryStore::new())
    }

    /// The config name: `allow`, `deny` or `local`.
    pub fn as_str(&self) -> &'static str {
        match self {
            Self::Allow => "allow",
            Self::Deny => "deny",
            Self::Local(_) => "local",
        }
    }

    /// What a request of layer `layer` for `key` gets now that its store call failed with
    /// `error`, logged the same way for every kind of layer (a rate limit, an in-flight
    /// limit).
    pub(crate) fn on_failure(&self, error: StoreError, key: &Key, layer: &str) -> Failed<'_> {
        self.log_failure(&error, key, layer);
        match self {
            Self::Allow => Failed::Allow,
            Self::Deny => Failed::Deny(error),
            Self::Local(store) => Failed::Local(store),
        }
    }

    /// Logs a store call of layer `layer` for `key` that failed with `error`, before this
    /// policy answers. A skipped call (the circuit is open) goes to `debug`, since the
    /// failures that opened the circuit were logged.
    pub(crate) fn log_failure(&self, error: &StoreError, key: &Key, layer: &str) {
        let policy = self.as_str();
        let chain = error.chain();
        // Never the key itself: it may be an API key.
        let redacted = key.redacted();
        if error.is_circuit_open() {
            tracing::debug!(error = %chain, key = %redacted, policy, layer, "rate limit store skipped");
        } else {
            tracing::warn!(error = %chain, key = %redacted, policy, layer, "rate limit store failed");
        }
    }
}

/// What [`FailurePolicy::on_failure`] says a request gets.
#[derive(Debug)]
pub(crate) enum Failed<'a> {
    /// Passes, unlimited.
    Allow,
    /// Is answered with this error (503).
    Deny(StoreError),
    /// Is decided by this in-process store.
    Local(&'a MemoryStore),
}

impl fmt::Debug for FailurePolicy {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

/// What a request without a key gets.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
#[non_exhaustive]
pub enum MissingKey {
    /// Answer 400 (gRPC: INVALID_ARGUMENT) without calling the inner service; 500 (gRPC:
    /// INTERNAL) naming the fix when the server is at fault (no peer address).
    #[default]
    Reject,
    /// Pass the request on unlimited (for example, limit only requests with an API key).
    Allow,
}

/// How much of the quota one request uses. Implemented by `u32` (a fixed cost) and by
/// every closure `Fn(&Request<B>) -> u32`.
///
/// ```
/// use http::Request;
/// use tollgate::RequestCost;
///
/// // Batch endpoints cost one unit per item in `?n=`.
/// let cost = |req: &Request<()>| -> u32 {
///     req.uri().query()
///         .and_then(|q| q.strip_prefix("n="))
///         .and_then(|n| n.parse().ok())
///         .unwrap_or(1)
/// };
/// let req = Request::get("/batch?n=5").body(()).unwrap();
/// assert_eq!(cost.cost(&req), 5);
/// ```
pub trait RequestCost<B>: Send + Sync + 'static {
    /// The cost of `request`.
    fn cost(&self, request: &Request<B>) -> u32;
}

impl<B> RequestCost<B> for u32 {
    fn cost(&self, _request: &Request<B>) -> u32 {
        *self
    }
}

impl<B, F> RequestCost<B> for F
where
    F: Fn(&Request<B>) -> u32 + Send + Sync + 'static,
{
    fn cost(&self, request: &Request<B>) -> u32 {
        self(request)
    }
}

/// Which requests pass a layer without a key and without counting: see
/// [`RateLimitLayer::with_exempt`](crate::RateLimitLayer::with_exempt). Implemented by
/// every closure `Fn(&Request<B>) -> bool` and by [`NoExemption`], the default.
pub trait Exempt<B>: Clone + Send + Sync + 'static {
    /// Whether `request` passes uncounted.
    fn is_exempt(&self, request: &Request<B>) -> bool;
}

/// No request is exempt: the default of [`RateLimitLayer`](crate::RateLimitLayer).
#[derive(Debug, Clone, Copy, Default)]
pub struct NoExemption;

impl<B> Exempt<B> for NoExemption {
    #[inline(always)]
    fn is_exempt(&self, _request: &Request<B>) -> bool {
        false
    }
}

impl<B, F> Exempt<B> for F
where
    F: Fn(&Request<B>) -> bool + Clone + Send + Sync + 'static,
{
    fn is_exempt(&self, request: &Request<B>) -> bool {
        self(request)
    }
}
