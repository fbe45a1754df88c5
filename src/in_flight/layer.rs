//! [`InFlightLayer`]: the configuration, applied with `.layer(..)`.

use std::{fmt, sync::Arc, time::Duration};

use tower_layer::Layer;

use super::{service::InFlight, shared::Shared};
use crate::{
    ConfigError, FailurePolicy, MissingKey,
    breaker::{Breaker, CircuitBreaker},
    key::PeerIp,
    metrics::LayerMetrics,
    rejection::DefaultRejection,
    store::{Guarded, LocalPermits, Permits},
};

/// The `Retry-After` a request denied by an [`InFlightLayer`] gets by default: 1 s. No
/// one knows when a request in flight will end; a second is a short wait for a client and
/// a long one for a server that is busy.
pub const DEFAULT_RETRY_AFTER: Duration = Duration::from_secs(1);

/// How long a permit in Redis lives without renewal by default: 10 s. It bounds how long
/// the permits of a node that died stay taken.
pub const DEFAULT_PERMIT_TTL: Duration = Duration::from_secs(10);

/// Allows at most `max` requests in flight per key. See the [module docs](crate::in_flight).
///
/// Starts keyed by the peer IP, counting in the process; every other part is set with a
/// builder method. Clones of the layer, and every service it makes, share the permits
/// (one store).
pub struct InFlightLayer<K = PeerIp, R = DefaultRejection> {
    key: Arc<K>,
    rejection: Arc<R>,
    settings: Settings,
}

/// Everything that does not change the layer's type.
#[derive(Debug, Clone)]
struct Settings {
    max: u32,
    store: Arc<dyn Permits>,
    ttl: Duration,
    timeout: Option<Duration>,
    breaker: Option<Arc<Breaker>>,
    on_store_error: FailurePolicy,
    on_missing_key: MissingKey,
    retry_after: Duration,
    name: Arc<str>,
}

// By hand: neither the key extractor nor the rejection need be `Clone`.
impl<K, R> Clone for InFlightLayer<K, R> {
    fn clone(&self) -> Self {
        Self {
            key: self.key.clone(),
            rejection: self.rejection.clone(),
            settings: self.settings.clone(),
        }
    }
}

impl<K: fmt::Debug, R: fmt::Debug> fmt::Debug for InFlightLayer<K, R> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("InFlightLayer")
            .field("key", &self.key)
            .field("rejection", &self.rejection)
            .field("settings", &self.settings)
            .finish()
    }
}

impl InFlightLayer {
    /// At most `max` requests in flight per peer IP, counted in the process.
    ///
    /// # Errors
    ///
    /// When `max` is 0 (field `max_in_flight`): no request could ever pass.
    pub fn new(max: u32) -> Result<Self, ConfigError> {
        if max == 0 {
            return Err(ConfigError::new(
                "max_in_flight",
                "must be at least 1 (0 would deny every request)",
            ));
        }
        Ok(Self {
            key: Arc::new(PeerIp::new()),
            rejection: Arc::new(DefaultRejection::new()),
            settings: Settings {
                max,
                store: Arc::new(LocalPermits::new()),
                ttl: DEFAULT_PERMIT_TTL,
                timeout: Some(crate::rules::DEFAULT_TIMEOUT),
                breaker: Some(Arc::new(Breaker::new(CircuitBreaker::default()))),
                on_store_error: FailurePolicy::Allow,
                on_missing_key: MissingKey::Reject,
                retry_after: DEFAULT_RETRY_AFTER,
                name: Arc::from(crate::DEFAULT_NAME),
            },
        })
    }
}

impl<K, R> InFlightLayer<K, R> {
    /// The most requests in flight per key.
    pub fn max(&self) -> u32 {
        self.settings.max
    }

    /// Counts requests by `key` instead. See [`key`](crate::key) for the extractors.
    pub fn with_key<K2>(self, key: K2) -> InFlightLayer<K2, R> {
        InFlightLayer {
            key: Arc::new(key),
            rejection: self.rejection,
            settings: self.settings,
        }
    }

    /// Answers denied requests, requests without a key and store failures with
    /// `rejection` (see [`OnRejection`](crate::OnRejection)). A denied request's
    /// [`Decision`](crate::Decision) has one limit of `max` with nothing remaining and the
    /// [`retry_after`](Self::with_retry_after) wait.
    pub fn with_on_rejection<R2>(self, rejection: R2) -> InFlightLayer<K, R2> {
        InFlightLayer {
            key: self.key,
            rejection: Arc::new(rejection),
            settings: self.settings,
        }
    }

    /// Keeps the permits in `store`: a [`MemoryStore`](crate::store::MemoryStore) (in the
    /// process, shared with the layers on it) or a `RedisStore` (shared by every replica,
    /// see the [module docs](crate::in_flight#stores)).
    pub fn with_store(mut self, store: impl Permits) -> Self {
        self.settings.store = Arc::new(store);
        self
    }

    /// How long a permit in a store shared between processes lives unless renewed
    /// ([`DEFAULT_PERMIT_TTL`] by default, at least 3 ms): the longest a dead node's
    /// permits stay taken, and a permit whose removal failed. A request in flight renews
    /// its permit every third of it, which is also how long running requests may go
    /// uncounted after Redis lost their permits.
    pub fn with_permit_ttl(mut self, ttl: Duration) -> Self {
        self.settings.ttl = ttl.max(Duration::from_millis(3));
        self
    }

    /// How long taking a permit may take before the failure policy applies
    /// ([`DEFAULT_TIMEOUT`](crate::rules::DEFAULT_TIMEOUT) by default; `None`: as long as it
    /// takes). A permit taken after the timeout is given back at once.
    pub fn with_timeout(mut self, timeout: Option<Duration>) -> Self {
        self.settings.timeout = timeout;
        self
    }

    /// Stops asking a store that keeps failing, for a moment: its requests go straight to
    /// the failure policy, so a dead Redis costs no timeout per request. On by default
    /// ([`CircuitBreaker::default`]); `None` asks the store every time. As
    /// [`RateLimitLayer::with_circuit_breaker`](crate::RateLimitLayer::with_circuit_breaker).
    pub fn with_circuit_breaker(mut self, breaker: Option<CircuitBreaker>) -> Self {
        self.settings.breaker = breaker.map(|config| Arc::new(Breaker::new(config)));
        self
    }

    /// What requests get when the store fails or times out ([`FailurePolicy::Allow`] by
    /// default). [`FailurePolicy::Local`] counts the permits in its memory store, in the
    /// process, until the store answers again.
    pub fn with_on_store_error(mut self, policy: FailurePolicy) -> Self {
        self.settings.on_store_error = policy;
        self
    }

    /// What requests without a key get ([`MissingKey::Reject`] by default).
    pub fn with_on_missing_key(mut self, policy: MissingKey) -> Self {
        self.settings.on_missing_key = policy;
        self
    }

    /// The `Retry-After` of a denied request ([`DEFAULT_RETRY_AFTER`] by default; rounded
    /// up to whole seconds, at least 1).
    pub fn with_retry_after(mut self, retry_after: Duration) -> Self {
        self.settings.retry_after = retry_after;
        self
    }

    /// Names this layer in metrics (the `route` label, feature `metrics`) and in the
    /// store-failure log lines; [`DEFAULT_NAME`](crate::DEFAULT_NAME) by default. See
    /// [`metrics`](crate::metrics).
    pub fn with_name(mut self, name: impl Into<String>) -> Self {
        self.settings.name = name.into().into();
        self
    }
}

impl<S, K, R> Layer<S> for InFlightLayer<K, R> {
    type Service = InFlight<S, K, R>;

    fn layer(&self, inner: S) -> Self::Service {
        let settings = &self.settings;
        let shared = Shared {
            max: settings.max,
            permits: Guarded::permits(
                settings.store.clone(),
                settings.timeout,
                settings.breaker.clone(),
            ),
            ttl: settings.ttl,
            on_store_error: settings.on_store_error.clone(),
            on_missing_key: settings.on_missing_key,
            retry_after: settings.retry_after,
            name: settings.name.clone(),
            metrics: LayerMetrics::new(&settings.name),
        };
        InFlight::new(
            inner,
            self.key.clone(),
            self.rejection.clone(),
            Arc::new(shared),
        )
    }
}
