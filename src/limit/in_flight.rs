//! [`InFlightLimit`]: the in-flight stage's cap per key.

use std::time::Duration;

use super::MAX_WINDOW;
use crate::ConfigError;

/// The permit TTL of an [`InFlightLimit`] by default: how long a permit that is never
/// given back (its process died) keeps counting.
pub const DEFAULT_IN_FLIGHT_TTL: Duration = Duration::from_secs(60);

/// The `Retry-After` of a request an [`InFlightLimit`] denies, by default.
pub const DEFAULT_IN_FLIGHT_RETRY_AFTER: Duration = Duration::from_secs(1);

/// At most `max` requests in flight per key: a stage of the
/// [`RateLimitLayer`](crate::RateLimitLayer)'s pipeline, set with
/// [`RateLimitLayer::with_in_flight`](crate::RateLimitLayer::with_in_flight) or
/// [`Rules::with_in_flight`](crate::rules::Rules::with_in_flight).
///
/// A request takes a permit in the **same atomic store call** that decides its rate
/// limits, all-or-nothing: a request the in-flight cap denies spends no units of its rate
/// limits, and one its rate limits deny takes no permit. The permit comes back when the
/// response body ends or is dropped, when the response future is dropped (the client
/// hung up), or when the inner service fails; with counting after the response
/// ([`count_when`](crate::RateLimitLayer::with_count_when), late costs) the permit's release
/// and the adjustment go to the store in one call, once the body ends.
///
/// A request denied by the cap gets the layer's rejection (429, `Retry-After:`
/// [`retry_after`](Self::with_retry_after), gRPC `RESOURCE_EXHAUSTED`); its decision
/// carries the rate limits' fields and, last, one denied [`LimitDecision`](crate::LimitDecision)
/// for the cap (limit `max`, remaining 0).
///
/// # Stores
///
/// - [`MemoryStore`](crate::store::MemoryStore): permits are counted in the process, under the
///   lock that orders the decision; a key with nothing in flight takes no memory.
/// - `RedisStore`: the permits of a key are a sorted set `<prefix>:{<key>}:inflight` (the
///   limits' hash tag, so one cluster slot) of permit ids scored by the time their TTL
///   ends, decided by the same script call as the rate limits. **A permit ends one
///   [`permit_ttl`](Self::with_permit_ttl) after it was taken** even when its request
///   still runs (nothing renews it): a replica that dies gives its permits back at most
///   one TTL later, and a response that lasts longer than the TTL stops counting after
///   it. Set the TTL above your longest response.
///
/// Changing `max` through a [`RulesHandle`](crate::rules::RulesHandle) keeps the permits
/// held: the state is one per key, whatever `max` is.
///
/// ```
/// use std::time::Duration;
/// use tollgate::{InFlightLimit, Limit, RateLimitLayer};
///
/// // 100 a minute, at most 2 at once, per peer IP.
/// let layer = RateLimitLayer::new(Limit::per_minute(100)?)
///     .with_in_flight(InFlightLimit::new(2)?.with_permit_ttl(Duration::from_secs(120)));
/// # let _ = layer;
/// # Ok::<(), tollgate::ConfigError>(())
/// ```
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct InFlightLimit {
    max: u32,
    permit_ttl_ms: u64,
    retry_after_ms: u64,
}

impl InFlightLimit {
    /// At most `max` requests in flight per key, permits ending after
    /// [`DEFAULT_IN_FLIGHT_TTL`].
    ///
    /// # Errors
    ///
    /// When `max` is 0 (field `max_in_flight`).
    pub fn new(max: u32) -> Result<Self, ConfigError> {
        if max == 0 {
            return Err(ConfigError::new(
                "max_in_flight",
                "must be at least 1 (0 would deny every request)",
            ));
        }
        Ok(Self {
            max,
            permit_ttl_ms: DEFAULT_IN_FLIGHT_TTL.as_millis() as u64,
            retry_after_ms: DEFAULT_IN_FLIGHT_RETRY_AFTER.as_millis() as u64,
        })
    }

    /// The same limit with permits that end `ttl` after they were taken when they are
    /// never given back (at least 1 ms, at most [`MAX_WINDOW`]).
    pub fn with_permit_ttl(mut self, ttl: Duration) -> Self {
        self.permit_ttl_ms = ttl.clamp(Duration::from_millis(1), MAX_WINDOW).as_millis() as u64;
        self
    }

    /// The same limit answering the requests it denies with this `Retry-After` (rounded
    /// up to whole seconds, at least 1).
    pub fn with_retry_after(mut self, retry_after: Duration) -> Self {
        self.retry_after_ms = retry_after.as_millis().min(u128::from(u32::MAX)) as u64;
        self
    }

    /// The most requests in flight per key.
    pub fn max(&self) -> u32 {
        self.max
    }

    /// How long a permit that is never given back counts.
    pub fn permit_ttl(&self) -> Duration {
        Duration::from_millis(self.permit_ttl_ms)
    }

    /// The permit TTL in ms.
    pub fn permit_ttl_ms(&self) -> u64 {
        self.permit_ttl_ms
    }

    /// The `Retry-After` of a denial.
    pub fn retry_after(&self) -> Duration {
        Duration::from_millis(self.retry_after_ms)
    }

    /// The decision of the cap for a request it denies: limit `max`, nothing left.
    pub(crate) fn denial(&self) -> crate::LimitDecision {
        crate::LimitDecision::deny(
            self.max,
            0,
            self.retry_after_ms.max(1),
            self.retry_after_ms.max(1),
        )
    }
}
