//! What the layer does when it cannot decide: no key, or a failing store.

use std::fmt;

use http::Request;

use crate::store::MemoryStore;

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
