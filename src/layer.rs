//! [`RateLimitLayer`]: the configuration, applied with `.layer(..)`.

use std::{fmt, sync::Arc, time::Duration};

use tower_layer::Layer;

use crate::{
    FailurePolicy, Limit, MissingKey,
    breaker::{Breaker, CircuitBreaker},
    decide::Shared,
    headers::{HeaderStyle, HeaderWriter},
    key::PeerIp,
    rejection::DefaultRejection,
    service::RateLimit,
    store::{Guarded, MemoryStore, Store},
};

/// The default time a store call may take before the failure policy applies.
pub const DEFAULT_TIMEOUT: Duration = Duration::from_millis(100);

/// The name of a layer that was not given one with [`RateLimitLayer::name`].
pub const DEFAULT_NAME: &str = "default";

/// Applies [`RateLimit`] to a service: see the [crate docs](crate) for an example.
///
/// Starts with one limit, keyed by the peer IP, on a new [`MemoryStore`] (bounded: at
/// most [`MemoryStore::DEFAULT_MAX_KEYS`] keys); every other part is set with a builder
/// method. **Clones of the layer, and every service it makes,
/// share one budget** (one store), so `Router::layer` applies one limit across all
/// routes. A second layer with its own store has its own budgets; layers on one store
/// (Redis, [`shared_store`](Self::shared_store)) share a key's budget when their keys are
/// of the same kind and their limits are equal and equally [named](crate::Limit::named),
/// so name the limits differently to keep them apart.
pub struct RateLimitLayer<K = PeerIp, C = u32, R = DefaultRejection> {
    key: Arc<K>,
    cost: C,
    rejection: R,
    /// Everything that does not change the layer's type.
    settings: Settings,
}

#[derive(Debug, Clone)]
struct Settings {
    limits: Vec<Limit>,
    store: Arc<dyn Store>,
    on_store_error: FailurePolicy,
    on_missing_key: MissingKey,
    timeout: Option<Duration>,
    headers: HeaderStyle,
    name: Arc<str>,
    breaker: Option<Arc<Breaker>>,
}

// By hand: the key extractor is shared through an `Arc`, so it need not be `Clone`.
impl<K, C: Clone, R: Clone> Clone for RateLimitLayer<K, C, R> {
    fn clone(&self) -> Self {
        Self {
            key: self.key.clone(),
            cost: self.cost.clone(),
            rejection: self.rejection.clone(),
            settings: self.settings.clone(),
        }
    }
}

impl<K: fmt::Debug, C: fmt::Debug, R: fmt::Debug> fmt::Debug for RateLimitLayer<K, C, R> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("RateLimitLayer")
            .field("key", &self.key)
            .field("cost", &self.cost)
            .field("rejection", &self.rejection)
            .field("settings", &self.settings)
            .finish()
    }
}

impl RateLimitLayer {
    /// Limits each peer IP to `limit`, in memory.
    pub fn new(limit: Limit) -> Self {
        Self {
            key: Arc::new(PeerIp::new()),
            cost: 1,
            rejection: DefaultRejection::new(),
            settings: Settings {
                limits: vec![limit],
                store: Arc::new(MemoryStore::new()),
                on_store_error: FailurePolicy::default(),
                on_missing_key: MissingKey::default(),
                timeout: Some(DEFAULT_TIMEOUT),
                headers: HeaderStyle::default(),
                name: Arc::from(DEFAULT_NAME),
                breaker: Some(Arc::new(Breaker::new(CircuitBreaker::default()))),
            },
        }
    }
}

impl<K, C, R> RateLimitLayer<K, C, R> {
    /// Adds another limit. A request passes only when every limit has room, and a denied
    /// request consumes nothing from any of them; all are decided in one store call.
    /// Adding a limit equal to one already present changes nothing.
    pub fn limit(mut self, limit: Limit) -> Self {
        if !self.settings.limits.contains(&limit) {
            self.settings.limits.push(limit);
        }
        self
    }

    /// Counts requests by `key` instead. See [`key`](crate::key) for the extractors.
    pub fn key<K2>(self, key: K2) -> RateLimitLayer<K2, C, R> {
        RateLimitLayer {
            key: Arc::new(key),
            cost: self.cost,
            rejection: self.rejection,
            settings: self.settings,
        }
    }

    /// Charges each request `cost` units: a fixed `u32` or a closure
    /// `Fn(&Request<B>) -> u32`. See [`RequestCost`](crate::RequestCost).
    pub fn cost<C2>(self, cost: C2) -> RateLimitLayer<K, C2, R> {
        RateLimitLayer {
            key: self.key,
            cost,
            rejection: self.rejection,
            settings: self.settings,
        }
    }

    /// Keeps the state in `store` (a `RedisStore` to share limits between replicas).
    pub fn store(mut self, store: impl Store) -> Self {
        self.settings.store = Arc::new(store);
        self
    }

    /// Keeps the state in a store already shared with other layers.
    pub fn shared_store(mut self, store: Arc<dyn Store>) -> Self {
        self.settings.store = store;
        self
    }

    /// What requests get when the store fails or times out. See [`FailurePolicy`].
    pub fn on_store_error(mut self, policy: FailurePolicy) -> Self {
        self.settings.on_store_error = policy;
        self
    }

    /// What requests without a key get. See [`MissingKey`].
    pub fn on_missing_key(mut self, policy: MissingKey) -> Self {
        self.settings.on_missing_key = policy;
        self
    }

    /// How long a store call may take before the failure policy applies
    /// ([`DEFAULT_TIMEOUT`] by default; `None` waits for the store as long as it takes).
    /// A call that timed out is never retried: it may already have counted.
    pub fn timeout(mut self, timeout: Option<Duration>) -> Self {
        self.settings.timeout = timeout;
        self
    }

    /// Stops asking a store that keeps failing, for a moment: its requests go straight to
    /// the failure policy, so a dead Redis costs no timeout per request. On by default
    /// ([`CircuitBreaker::default`]: open after 5 consecutive failures, probe every
    /// 500 ms); `None` asks the store every time.
    pub fn circuit_breaker(mut self, breaker: Option<CircuitBreaker>) -> Self {
        self.settings.breaker = breaker.map(|config| Arc::new(Breaker::new(config)));
        self
    }

    /// Which rate-limit fields responses carry. See [`HeaderStyle`].
    pub fn headers(mut self, style: HeaderStyle) -> Self {
        self.settings.headers = style;
        self
    }

    /// Builds the answers to rejected requests with `rejection`. See
    /// [`OnRejection`](crate::OnRejection).
    pub fn on_rejection<R2>(self, rejection: R2) -> RateLimitLayer<K, C, R2> {
        RateLimitLayer {
            key: self.key,
            cost: self.cost,
            rejection,
            settings: self.settings,
        }
    }

    /// Names this layer in metrics (the `route` label, feature `metrics`) and in the
    /// store-failure log lines; [`DEFAULT_NAME`] by default. See [`metrics`](crate::metrics).
    pub fn name(mut self, name: impl Into<String>) -> Self {
        self.settings.name = name.into().into();
        self
    }

    /// The limits, in the order they are reported.
    pub fn limits(&self) -> &[Limit] {
        &self.settings.limits
    }
}

impl<S, K, C: Clone, R: Clone> Layer<S> for RateLimitLayer<K, C, R> {
    type Service = RateLimit<S, K, C, R>;

    fn layer(&self, inner: S) -> Self::Service {
        let shared = Shared {
            headers: HeaderWriter::new(self.settings.headers, &self.settings.limits),
            limits: self.settings.limits.clone().into(),
            store: Guarded::new(
                self.settings.store.clone(),
                self.settings.timeout,
                self.settings.breaker.clone(),
            ),
            on_store_error: self.settings.on_store_error.clone(),
            on_missing_key: self.settings.on_missing_key,
            rejection: self.rejection.clone(),
            name: self.settings.name.clone(),
            metrics: crate::metrics::LayerMetrics::new(&self.settings.name),
        };
        RateLimit::from_parts(inner, self.key.clone(), self.cost.clone(), Arc::new(shared))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_default_store_is_bounded() {
        let layer = RateLimitLayer::new(Limit::fixed_window(1, Duration::from_secs(1)).unwrap());
        let shown = format!("{layer:?}");
        let bound = format!("max_keys: {}", MemoryStore::DEFAULT_MAX_KEYS);
        assert!(shown.contains(&bound), "{shown}");
    }
}
