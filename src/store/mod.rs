//! Stores: where the algorithms' state lives and where decisions are made ([`Store`]),
//! and where the permits of in-flight limits are counted ([`Permits`]).
//!
//! - [`MemoryStore`]: in-process, the embedded default. Each process has its own budget.
//! - `RedisStore` (feature `redis`): one Lua script per decision, so that every replica
//!   of a service shares one budget: one node, Cluster, Sentinel, TLS, ACL users. See
//!   [the Redis guide](crate::guide::redis) and, for what happens when it fails,
//!   [`guide::failures`](crate::guide::failures).

mod capabilities;
mod check;
mod guarded;
mod memory;
mod permits;
mod prefix;
#[cfg(feature = "redis")]
pub(crate) mod redis;

use std::{fmt, future::Future, pin::Pin, sync::Arc};

pub(crate) use capabilities::store_name;
pub use capabilities::{Capabilities, Capability};
pub use check::Check;
pub(crate) use guarded::Guarded;
pub use memory::MemoryStore;
pub(crate) use permits::LocalPermits;
pub use permits::{Acquired, Admitted, Permit, Permits};
pub use prefix::validate_prefix;
#[cfg(feature = "sentinel")]
pub use redis::SentinelConfig;
#[cfg(feature = "tls")]
pub use redis::TlsConfig;
#[cfg(feature = "redis")]
pub use redis::{
    DEFAULT_PREFIX, LeaseConfig, RedisConnect, RedisStore, RedisTarget, SCRIPT_SOURCE,
};
#[cfg(feature = "redis")]
pub use redis::{IN_FLIGHT_ACQUIRE_SOURCE, IN_FLIGHT_RENEW_SOURCE};

use crate::{Adjustment, Decision, InFlightLimit, Limit, StoreError, StoreErrorKind, key::Key};

/// What [`Store::reset`] returns: the reset, done once it resolves.
pub type Reset = Pin<Box<dyn Future<Output = Result<(), StoreError>> + Send + 'static>>;

/// Decides requests: checks `cost` against every limit for `key` in one atomic step,
/// all-or-nothing, and records it when allowed.
///
/// The answer owns everything it needs (`'static`), so implementations read the
/// arguments before they return it. A store that decides without I/O returns
/// [`Check::ready`]: the layer then skips the timer and allocation of a pending call.
///
/// # Capabilities
///
/// Besides [`check`](Self::check), a store may [reserve](Self::reserve),
/// [adjust](Self::adjust), [peek](Self::peek) and [reset](Self::reset); it says which in
/// [`capabilities`](Self::capabilities) (required: there is no default to fall back to).
/// A method it does not claim answers [`StoreErrorKind::Unsupported`] by default, and a
/// layer that needs it is refused when it is built
/// ([`RateLimitLayer::validate`](crate::RateLimitLayer::validate)), with an error naming
/// the store and the feature; what each capability serves is on [`Capability`]. The
/// memory and Redis stores have them all.
///
/// ```
/// use tollgate::{Decision, Limit, RateLimitLayer, key::Key};
/// use tollgate::store::{Capabilities, Check, Store};
///
/// #[derive(Debug)]
/// struct AllowAll;
///
/// impl Store for AllowAll {
///     fn check(&self, _: &Key, _: &[Limit], _: u32) -> Check {
///         Check::ready(Ok(Decision::unlimited()))
///     }
///
///     fn capabilities(&self) -> Capabilities {
///         Capabilities::NONE
///     }
/// }
///
/// // Counting after the response needs `adjust`: refused, naming both.
/// let layer = RateLimitLayer::new(Limit::per_minute(5)?)
///     .with_store(AllowAll)
///     .with_count_when(|response: &http::Response<axum::body::Body>| response.status() == 401);
/// let error = layer.validate().unwrap_err().to_string();
/// assert!(error.contains("AllowAll") && error.contains("count_when"), "{error}");
/// # Ok::<(), tollgate::ConfigError>(())
/// ```
pub trait Store: Send + Sync + fmt::Debug + 'static {
    /// Decides one request of `cost` against `limits` (at least one) for `key`.
    fn check(&self, key: &Key, limits: &[Limit], cost: u32) -> Check;

    /// What this store can do besides [`check`](Self::check): the methods below that it
    /// implements. See [Capabilities](Self#capabilities).
    fn capabilities(&self) -> Capabilities;

    /// [`check`](Self::check), reserving where the algorithms allow it: a request that
    /// does not fit now but would within `max_wait_ms` may be answered *allowed with a
    /// wait* ([`Decision::wait`]); its units are counted now for the moment it may run,
    /// so nobody can take them meanwhile, and the caller runs it after the wait without
    /// asking again. Only the token bucket and GCRA reserve (the bucket into debt, GCRA
    /// by moving its arrival time ahead, by at most what refills in `max_wait_ms`), and
    /// only when every limit of the request can: a window, a log or a lockout among them
    /// makes it the plain denial of [`check`](Self::check).
    /// [`RateLimitLayer::with_max_wait`](crate::RateLimitLayer::with_max_wait) asks this.
    ///
    /// [`Capability::Reserve`]. The default answers [`StoreErrorKind::Unsupported`];
    /// a layer never asks a store that does not claim it (its denied requests wait and
    /// ask again).
    fn reserve(&self, key: &Key, limits: &[Limit], cost: u32, max_wait_ms: u64) -> Check {
        let _ = (key, limits, cost, max_wait_ms);
        Check::ready(Err(unsupported(self, Capability::Reserve)))
    }

    /// Told by [`RulesHandle::set`](crate::rules::RulesHandle::set) before `limits` come into
    /// force. A store that keeps limits besides the state (the memory store, to know when
    /// state expires) updates those whose state carries over; the default does nothing.
    fn limits_changed(&self, limits: &[Limit]) {
        let _ = limits;
    }

    /// What the store can decide without I/O when it must not be asked (the layer's
    /// circuit breaker is open): an allowed decision paid from quota it holds already
    /// (the Redis store's leases), or `None` for the failure policy. Never a denial. The
    /// default holds nothing.
    fn check_held(&self, key: &Key, limits: &[Limit], cost: u32) -> Option<Decision> {
        let _ = (key, limits, cost);
        None
    }

    /// The decision [`check`](Self::check) would make now for a request of `cost`
    /// (`remaining` as that request would leave it; cost 0 reads what is left), with
    /// nothing written: no key created, no expiry moved. For admin tools and handlers
    /// that show a client its budget. [`Capability::Peek`]; the default answers
    /// [`StoreErrorKind::Unsupported`].
    fn peek(&self, key: &Key, limits: &[Limit], cost: u32) -> Check {
        let _ = (key, limits, cost);
        Check::ready(Err(unsupported(self, Capability::Peek)))
    }

    /// Clears the state of `key` under `limits` in one atomic step: its next request
    /// finds a full budget. A store that answers some requests without asking where the
    /// state lives (the Redis store's block cache) forgets them too, on every replica.
    /// [`Capability::Reset`]; the default answers [`StoreErrorKind::Unsupported`].
    fn reset(&self, key: &Key, limits: &[Limit]) -> Reset {
        let _ = (key, limits);
        Box::pin(std::future::ready(Err(unsupported(
            self,
            Capability::Reset,
        ))))
    }

    /// Gives back or charges units after a request was decided (see [`Adjustment`]),
    /// for every limit of `key` in one atomic step. The decision is the state after it.
    /// Counting after the response ([`RateLimitLayer::with_count_when`](crate::RateLimitLayer::with_count_when),
    /// late costs) needs it: [`Capability::Adjust`]. The default fails with
    /// [`StoreErrorKind::Unsupported`].
    fn adjust(&self, key: &Key, limits: &[Limit], adjustment: Adjustment) -> Check {
        let _ = (key, limits, adjustment);
        Check::ready(Err(unsupported(self, Capability::Adjust)))
    }

    /// [`check`](Self::check) with an in-flight cap beside `limits` (which may be
    /// empty), in one atomic step, all-or-nothing: the request is allowed only when
    /// every limit has room and fewer than `in_flight.max()` permits of `key` are held;
    /// then its units are spent and a permit is taken (in [`Admitted`]). A request the
    /// cap denies spends nothing; its decision ends with the cap's denial (one
    /// [`LimitDecision`](crate::LimitDecision) more than `limits`). See
    /// [`InFlightLimit`].
    ///
    /// With `max_wait_ms` above 0 (asked only of a store with [`Capability::Reserve`]),
    /// the limits are [reserved](Self::reserve) as `reserve` would, in the same step: a
    /// request the cap has room for that does not fit now but would within
    /// `max_wait_ms` is allowed *with a wait* ([`Decision::wait`]), its units counted
    /// for the moment it may run **and its permit taken now** (it is held while the
    /// request waits). A cap with no room reserves nothing; a wait beyond
    /// `max_wait_ms` takes nothing. 0: never reserves.
    ///
    /// The memory and Redis stores implement it; the default fails with
    /// [`StoreErrorKind::Unsupported`].
    fn check_in_flight(
        &self,
        key: &Key,
        limits: &[Limit],
        cost: u32,
        in_flight: &InFlightLimit,
        max_wait_ms: u64,
    ) -> Check<Admitted> {
        let _ = (key, limits, cost, in_flight, max_wait_ms);
        Check::ready(Err(StoreError::unsupported("in-flight limits")))
    }

    /// Gives back `permit` (taken by [`check_in_flight`](Self::check_in_flight)) and
    /// applies `adjustment` to `limits` of its key, in one atomic step (one Redis call).
    /// The default fails with [`StoreErrorKind::Unsupported`].
    fn release_in_flight(
        &self,
        permit: Permit,
        limits: &[Limit],
        adjustment: Option<Adjustment>,
    ) -> Check {
        let _ = (permit, limits, adjustment);
        Check::ready(Err(StoreError::unsupported("in-flight limits")))
    }

    /// Whether the store is still making its first connection: it started while its
    /// backend was unreachable (a `RedisStore` started `in_background`), and every decision fails
    /// until it connects. A layer on it logs at start what its failure policy answers
    /// meanwhile. The default: `false` (a store that is always connected).
    fn connecting(&self) -> bool {
        false
    }
}

/// What a store's method answers when the store does not have its capability.
fn unsupported<S: fmt::Debug + ?Sized>(store: &S, capability: Capability) -> StoreError {
    StoreError::new(
        StoreErrorKind::Unsupported,
        format!(
            "{} cannot {} (Store::capabilities does not claim {capability:?})",
            store_name(&store),
            capability.method()
        ),
    )
}

impl<S: Store + ?Sized> Store for Arc<S> {
    fn check(&self, key: &Key, limits: &[Limit], cost: u32) -> Check {
        (**self).check(key, limits, cost)
    }

    fn capabilities(&self) -> Capabilities {
        (**self).capabilities()
    }

    fn reserve(&self, key: &Key, limits: &[Limit], cost: u32, max_wait_ms: u64) -> Check {
        (**self).reserve(key, limits, cost, max_wait_ms)
    }

    fn limits_changed(&self, limits: &[Limit]) {
        (**self).limits_changed(limits);
    }

    fn check_held(&self, key: &Key, limits: &[Limit], cost: u32) -> Option<Decision> {
        (**self).check_held(key, limits, cost)
    }

    fn peek(&self, key: &Key, limits: &[Limit], cost: u32) -> Check {
        (**self).peek(key, limits, cost)
    }

    fn reset(&self, key: &Key, limits: &[Limit]) -> Reset {
        (**self).reset(key, limits)
    }

    fn adjust(&self, key: &Key, limits: &[Limit], adjustment: Adjustment) -> Check {
        (**self).adjust(key, limits, adjustment)
    }

    fn check_in_flight(
        &self,
        key: &Key,
        limits: &[Limit],
        cost: u32,
        in_flight: &InFlightLimit,
        max_wait_ms: u64,
    ) -> Check<Admitted> {
        (**self).check_in_flight(key, limits, cost, in_flight, max_wait_ms)
    }

    fn release_in_flight(
        &self,
        permit: Permit,
        limits: &[Limit],
        adjustment: Option<Adjustment>,
    ) -> Check {
        (**self).release_in_flight(permit, limits, adjustment)
    }

    fn connecting(&self) -> bool {
        (**self).connecting()
    }
}
