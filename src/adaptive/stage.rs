//! [`Adaptive`]: the settings of the adaptive stage of a
//! [`RateLimitLayer`](crate::RateLimitLayer), and [`Shedding`]: what the rejection hook is
//! told about a shed request.

use std::{fmt, sync::Arc, time::Duration};

use http::{HeaderMap, HeaderName, StatusCode, response::Parts};

use super::{AdaptiveLimit, Outcome, Priority, Shed};
use crate::ConfigError;

/// A request's priority, read from its head.
pub(crate) type PriorityFn = dyn Fn(&HeaderMap, &http::Extensions) -> Priority + Send + Sync;

/// What a finished response means for the limit.
pub(crate) type OutcomeFn = dyn Fn(&Parts) -> Outcome + Send + Sync;

/// The adaptive stage of a layer ([`RateLimitLayer::with_adaptive`]): an
/// [`AdaptiveLimit`] on the requests in flight, how a request's [`Priority`] is found, how
/// a shed request is answered and what a response means for the limit. See the
/// [module docs](super#the-stage-of-a-layer) for where it sits in the pipeline.
///
/// [`RateLimitLayer::with_adaptive`]: crate::RateLimitLayer::with_adaptive
#[derive(Clone)]
pub struct Adaptive {
    pub(crate) limit: AdaptiveLimit,
    pub(crate) header: Option<HeaderName>,
    pub(crate) priority: Option<Arc<PriorityFn>>,
    pub(crate) shed_status: StatusCode,
    pub(crate) retry_after: Duration,
    pub(crate) shadow: bool,
    pub(crate) per_key: Option<usize>,
    pub(crate) outcome: Option<Arc<OutcomeFn>>,
}

// By hand: closures are not `Debug`.
impl fmt::Debug for Adaptive {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Adaptive")
            .field("limit", &self.limit)
            .field("header", &self.header)
            .field("priority", &self.priority.as_ref().map(|_| ".."))
            .field("shed_status", &self.shed_status)
            .field("retry_after", &self.retry_after)
            .field("shadow", &self.shadow)
            .field("per_key", &self.per_key)
            .field("outcome", &self.outcome.as_ref().map(|_| ".."))
            .finish()
    }
}

/// The `Retry-After` hint of a shed answer, by default.
pub const DEFAULT_RETRY_AFTER: Duration = Duration::from_secs(1);

impl Adaptive {
    /// The stage with `limit`: one limit for the layer (and its clones), every request
    /// [`Priority::Default`], shed requests answered 503 with `Retry-After: 1`, the
    /// [default outcomes](super#what-a-response-means-for-the-limit).
    pub fn new(limit: AdaptiveLimit) -> Self {
        Self {
            limit,
            header: None,
            priority: None,
            shed_status: StatusCode::SERVICE_UNAVAILABLE,
            retry_after: DEFAULT_RETRY_AFTER,
            shadow: false,
            per_key: None,
            outcome: None,
        }
    }

    /// Reads the priority from the header `name`: `critical`, `default` or `sheddable`
    /// ([`Priority::from_name`]); absent or any other value is [`Priority::Default`]. A
    /// [`Priority`] in the request's extensions (set by a layer of your own) comes first.
    ///
    /// **Any client can send this header**: read it only from requests that passed a
    /// proxy which sets or strips it, or a client marks all its traffic critical.
    pub fn with_priority_header(mut self, name: HeaderName) -> Self {
        self.header = Some(name);
        self
    }

    /// Reads the priority with `f` from the request's headers and extensions; it takes
    /// precedence over the [header](Self::with_priority_header) and over a [`Priority`]
    /// in the extensions.
    pub fn with_priority<F>(mut self, f: F) -> Self
    where
        F: Fn(&HeaderMap, &http::Extensions) -> Priority + Send + Sync + 'static,
    {
        self.priority = Some(Arc::new(f));
        self
    }

    /// The status of a shed HTTP answer: 503 Service Unavailable (the default: the
    /// service is overloaded, any client should back off) or 429 Too Many Requests. gRPC
    /// calls get `UNAVAILABLE` either way.
    ///
    /// # Errors
    ///
    /// Any other status, as a [`ConfigError`] naming `adaptive.shed_status`.
    pub fn with_shed_status(mut self, status: StatusCode) -> Result<Self, ConfigError> {
        if status != StatusCode::SERVICE_UNAVAILABLE && status != StatusCode::TOO_MANY_REQUESTS {
            return Err(ConfigError::new(
                "adaptive.shed_status",
                format!("must be 503 or 429 (got {})", status.as_u16()),
            ));
        }
        self.shed_status = status;
        Ok(self)
    }

    /// The `Retry-After` hint of a shed answer ([`DEFAULT_RETRY_AFTER`] by default),
    /// rounded up to whole seconds in the header.
    ///
    /// # Errors
    ///
    /// Zero, as a [`ConfigError`] naming `adaptive.retry_after`: a client told to retry
    /// at once retries into the overload.
    pub fn with_retry_after(mut self, hint: Duration) -> Result<Self, ConfigError> {
        if hint.is_zero() {
            return Err(ConfigError::new(
                "adaptive.retry_after",
                "must be above zero (got 0)",
            ));
        }
        self.retry_after = hint;
        Ok(self)
    }

    /// Shadow mode (`true`): the limit runs and learns, but nothing is shed; a request it
    /// would shed passes (without a permit) and is counted in
    /// `tollgate_adaptive_shed_total{shadow="true"}` and logged at `debug`. For trying a
    /// limit out on live traffic first.
    pub fn with_shadow(mut self, shadow: bool) -> Self {
        self.shadow = shadow;
        self
    }

    /// One adaptive limit per rate-limit key, on top of the key's rate limits, instead of
    /// one for the layer: at most `max_keys` keys are kept (the least recently used go
    /// first; a key that comes back starts again at the initial limit).
    ///
    /// # Errors
    ///
    /// `max_keys` zero, as a [`ConfigError`] naming `adaptive.per_key`.
    pub fn with_per_key(mut self, max_keys: usize) -> Result<Self, ConfigError> {
        if max_keys == 0 {
            return Err(ConfigError::new(
                "adaptive.per_key",
                "must keep at least 1 key (got 0)",
            ));
        }
        self.per_key = Some(max_keys);
        Ok(self)
    }

    /// What a response means for the limit, read from its head, instead of the
    /// [default outcomes](super#what-a-response-means-for-the-limit) (trailers are then
    /// not read). An inner service error is still [`Outcome::Dropped`], a response
    /// dropped before its end still no sample.
    pub fn with_outcome<F>(mut self, f: F) -> Self
    where
        F: Fn(&Parts) -> Outcome + Send + Sync + 'static,
    {
        self.outcome = Some(Arc::new(f));
        self
    }

    /// The adaptive limit.
    pub fn limit(&self) -> &AdaptiveLimit {
        &self.limit
    }

    /// The status of a shed HTTP answer.
    pub fn shed_status(&self) -> StatusCode {
        self.shed_status
    }

    /// The `Retry-After` hint of a shed answer.
    pub fn retry_after(&self) -> Duration {
        self.retry_after
    }

    /// Whether the stage is in shadow mode.
    pub fn is_shadow(&self) -> bool {
        self.shadow
    }

    /// The most keys kept, per key; `None`: one limit for the layer.
    pub fn per_key(&self) -> Option<usize> {
        self.per_key
    }

    /// The priority of a request with these headers and extensions: the closure's, else
    /// a [`Priority`] extension, else the header's, else [`Priority::Default`].
    pub(crate) fn priority_of(
        &self,
        headers: &HeaderMap,
        extensions: &http::Extensions,
    ) -> Priority {
        if let Some(f) = &self.priority {
            return f(headers, extensions);
        }
        if let Some(priority) = extensions.get::<Priority>() {
            return *priority;
        }
        self.header
            .as_ref()
            .and_then(|name| headers.get(name))
            .and_then(|value| value.to_str().ok())
            .and_then(|value| Priority::from_name(value.trim()))
            .unwrap_or_default()
    }
}

/// A request the adaptive stage sheds, as the [rejection hook](crate::OnRejection::shed)
/// is given it: why ([`Shed`]) and how the layer is set to answer.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[non_exhaustive]
pub struct Shedding {
    /// The priority, limit and in-flight count the request was shed at.
    pub shed: Shed,
    /// The status of an HTTP answer ([`Adaptive::with_shed_status`]).
    pub status: StatusCode,
    /// The hint for `Retry-After` ([`Adaptive::with_retry_after`]).
    pub retry_after: Duration,
}
