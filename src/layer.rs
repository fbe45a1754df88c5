//! [`RateLimitLayer`]: the configuration, applied with `.layer(..)`.

use std::{
    fmt,
    sync::{Arc, OnceLock},
    time::Duration,
};

use tower_layer::Layer;

use http::{HeaderMap, Response};

#[cfg(doc)]
use crate::rules::{DEFAULT_MAX_WAITERS, DEFAULT_MAX_WAITERS_PER_KEY, DEFAULT_TIMEOUT};
use crate::{
    CircuitBreaker, FailurePolicy, InFlightLimit, Limit, MissingKey,
    adaptive::{Adaptive, AdaptiveHandle, Stage},
    count_after::{CountWhen, LateCost, TrailerCost, UpFront},
    decide::Shared,
    headers::HeaderStyle,
    key::PeerIp,
    limiter::Limiter,
    policy::NoExemption,
    rejection::DefaultRejection,
    rules::{Cell, Rules, RulesHandle},
    service::RateLimit,
    store::{MemoryStore, Store},
};

/// The name of a layer that was not given one with [`RateLimitLayer::with_name`].
pub const DEFAULT_NAME: &str = "default";

/// Applies [`RateLimit`] to a service: see the [crate docs](crate) for an example.
///
/// Starts with one limit, keyed by the peer IP, on a new [`MemoryStore`] (bounded: at
/// most [`MemoryStore::DEFAULT_MAX_KEYS`] keys); every other part is set with a builder
/// method. **Clones of the layer, and every service it makes, share one budget** (one
/// store), so `Router::layer` applies one limit across all routes; which separately built
/// layers share one: [Which layers share a budget](crate#which-layers-share-a-budget).
pub struct RateLimitLayer<K = PeerIp, C = u32, R = DefaultRejection, M = UpFront, E = NoExemption> {
    key: Arc<K>,
    cost: C,
    rejection: R,
    /// Which requests pass without a key and without counting ([`with_exempt`](Self::with_exempt)).
    exempt: E,
    /// How requests are counted: up front, or after their response
    /// ([`count_when`](Self::with_count_when), [`late_cost`](Self::with_late_cost)).
    recount: M,
    /// Everything that does not change the layer's type.
    settings: Settings,
}

#[derive(Debug, Clone)]
struct Settings {
    /// The rules as built; once a service or a [`RulesHandle`] exists, `cell` holds the
    /// rules in force.
    rules: Rules,
    store: Arc<dyn Store>,
    name: Arc<str>,
    /// Shared by clones of the layer made since its last builder call: they are one layer
    /// to a [`RulesHandle`]. A builder call starts a new one.
    cell: Arc<OnceLock<Arc<Cell>>>,
    /// Whether requests are counted after their response: then the lockouts of its
    /// limits count the units of requests in flight as pending, and block only for kept
    /// units ([`Limit::pending_until_settled`]).
    counts_after: bool,
    adaptive: Option<Adaptive>,
    /// The adaptive stage's running state, made on first use and shared as `cell` is.
    stage: Arc<OnceLock<Arc<Stage>>>,
}

impl Settings {
    /// The rules cell of the layer as it is now, made on first use.
    fn cell(&self) -> &Arc<Cell> {
        self.cell.get_or_init(|| {
            if self.store.connecting() {
                warn_connecting(&self.name, self.rules.on_store_error());
            }
            Cell::new(self.rules.clone(), self.store.clone(), self.counts_after)
        })
    }

    /// The adaptive stage of the layer as it is now, made on first use.
    fn stage(&self) -> Option<&Arc<Stage>> {
        let adaptive = self.adaptive.as_ref()?;
        Some(
            self.stage
                .get_or_init(|| Arc::new(Stage::new(adaptive.clone(), &self.name))),
        )
    }

    /// A builder call: the layer is a new one, with rules of its own.
    fn changed(&mut self) -> &mut Self {
        if let Some(cell) = self.cell.get() {
            // Keep what a handle may have set.
            self.rules = cell.active.load().rules.clone();
        }
        self.cell = Arc::default();
        self.stage = Arc::default();
        self
    }
}

/// Says, once per layer when it starts, what its requests get while the store has not
/// connected yet: only the layer knows its failure policy.
fn warn_connecting(layer: &str, policy: &FailurePolicy) {
    let policy_name = policy.as_str();
    match policy {
        FailurePolicy::Deny => tracing::warn!(
            layer,
            policy = policy_name,
            "rate limit store not connected yet: this layer fails closed, every request \
             is refused with 503 until the store connects"
        ),
        FailurePolicy::Local(_) => tracing::warn!(
            layer,
            policy = policy_name,
            "rate limit store not connected yet: requests are limited per process, in \
             memory, until the store connects"
        ),
        _ => tracing::warn!(
            layer,
            policy = policy_name,
            "rate limit store not connected yet: requests pass unlimited until the store \
             connects"
        ),
    }
}

// By hand: the key extractor is shared through an `Arc`, so it need not be `Clone`.
impl<K, C: Clone, R: Clone, M: Clone, E: Clone> Clone for RateLimitLayer<K, C, R, M, E> {
    fn clone(&self) -> Self {
        Self {
            key: self.key.clone(),
            cost: self.cost.clone(),
            rejection: self.rejection.clone(),
            recount: self.recount.clone(),
            exempt: self.exempt.clone(),
            settings: self.settings.clone(),
        }
    }
}

impl<K: fmt::Debug, C: fmt::Debug, R: fmt::Debug, M: fmt::Debug, E: fmt::Debug> fmt::Debug
    for RateLimitLayer<K, C, R, M, E>
{
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("RateLimitLayer")
            .field("key", &self.key)
            .field("cost", &self.cost)
            .field("rejection", &self.rejection)
            .field("recount", &self.recount)
            .field("exempt", &self.exempt)
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
            recount: UpFront,
            exempt: NoExemption,
            settings: Settings {
                rules: Rules::new([limit]).expect("one limit is a valid rule set"),
                store: Arc::new(MemoryStore::new()),
                name: Arc::from(DEFAULT_NAME),
                cell: Arc::default(),
                counts_after: false,
                adaptive: None,
                stage: Arc::default(),
            },
        }
    }
}

impl<K, C, R, M, E> RateLimitLayer<K, C, R, M, E> {
    /// Adds another limit. A request passes only when every limit has room, and a denied
    /// request consumes nothing from any of them; all are decided in one store call.
    /// Adding a limit equal to one already present changes nothing; one with the same
    /// [carried-over](crate::OnChange::CarryOver) state (name, algorithm and window)
    /// replaces it.
    pub fn with_limit(mut self, limit: Limit) -> Self {
        self.settings.changed().rules.push_limit(limit);
        self
    }

    /// Decides each request under the limits of its plan, picked by `plans`'s resolver;
    /// the limits given to the layer apply to requests without a plan when there is no
    /// default plan. See [`plan`](crate::plan).
    pub fn with_plans(mut self, plans: crate::plan::Plans) -> Self {
        let settings = self.settings.changed();
        settings.rules = settings.rules.clone().with_plans(plans);
        self
    }

    /// Adds a shadow limit: decided and counted on every request, never rejecting; a
    /// request it would reject passes and is counted as `would_reject` (feature
    /// `metrics`) and logged at `info`. An enforced limit with the same state becomes this
    /// shadow one. See [Shadow mode](crate::guide::shadow) and [`Rules::with_shadow_limits`].
    pub fn with_shadow_limit(mut self, limit: Limit) -> Self {
        self.settings.changed().rules.push_shadow_limit(limit);
        self
    }

    /// Puts every limit of the layer in shadow (`true`): a request that would get a 429
    /// goes to the inner service instead, and is counted as `would_reject` and logged.
    /// See [Shadow mode](crate::guide::shadow) and [`Rules::with_shadow`].
    pub fn with_shadow(mut self, shadow: bool) -> Self {
        let settings = self.settings.changed();
        settings.rules = settings.rules.clone().with_shadow(shadow);
        self
    }

    /// Counts requests by `key` instead. See [`key`](crate::key) for the extractors.
    pub fn with_key<K2>(self, key: K2) -> RateLimitLayer<K2, C, R, M, E> {
        RateLimitLayer {
            key: Arc::new(key),
            cost: self.cost,
            rejection: self.rejection,
            recount: self.recount,
            exempt: self.exempt,
            settings: self.settings,
        }
    }

    /// Charges each request `cost` units: a fixed `u32` or a closure
    /// `Fn(&Request<B>) -> u32`. See [`RequestCost`](crate::RequestCost).
    pub fn with_cost<C2>(self, cost: C2) -> RateLimitLayer<K, C2, R, M, E> {
        RateLimitLayer {
            key: self.key,
            cost,
            rejection: self.rejection,
            recount: self.recount,
            exempt: self.exempt,
            settings: self.settings,
        }
    }

    /// Lets the requests `exempt` holds for pass without a key and without counting (an
    /// allowlist: health checks, internal callers, a partner's network): a closure
    /// `Fn(&Request<B>) -> bool`, asked before the key is extracted. Exempt is not the
    /// same as keyless: a request that is not exempt and has no key (a missing API key)
    /// still gets the [missing-key policy](Self::with_on_missing_key), so an allowlist
    /// never leaves keyless requests unlimited. Exempt requests count as `exempt` in
    /// [metrics](crate::metrics), carry no rate-limit fields and reach the inner
    /// service whatever the store does.
    ///
    /// ```
    /// use std::time::Duration;
    /// use http::Request;
    /// use tollgate::{Limit, RateLimitLayer, key::HeaderKey};
    ///
    /// # fn main() -> Result<(), Box<dyn std::error::Error>> {
    /// let layer = RateLimitLayer::new(Limit::per_minute(100)?)
    ///     .with_key(HeaderKey::new("x-api-key")?)
    ///     // Health checks pass; a request without an API key is still answered 400.
    ///     .with_exempt(|request: &Request<axum::body::Body>| request.uri().path() == "/health");
    /// # Ok(()) }
    /// ```
    pub fn with_exempt<E2>(self, exempt: E2) -> RateLimitLayer<K, C, R, M, E2> {
        RateLimitLayer {
            key: self.key,
            cost: self.cost,
            rejection: self.rejection,
            recount: self.recount,
            exempt,
            settings: self.settings,
        }
    }

    /// Keeps the state in `store` (a `RedisStore` to share limits between replicas).
    /// To share one store between layers, give each a clone of an `Arc` of it
    /// (`Arc<S>` and `Arc<dyn Store>` are stores).
    pub fn with_store(mut self, store: impl Store) -> Self {
        self.settings.changed().store = Arc::new(store);
        self
    }

    /// What requests get when the store fails or times out. See [`FailurePolicy`].
    pub fn with_on_store_error(mut self, policy: FailurePolicy) -> Self {
        let settings = self.settings.changed();
        settings.rules = settings.rules.clone().with_on_store_error(policy);
        self
    }

    /// What requests without a key get. See [`MissingKey`].
    pub fn with_on_missing_key(mut self, policy: MissingKey) -> Self {
        let settings = self.settings.changed();
        settings.rules = settings.rules.clone().with_on_missing_key(policy);
        self
    }

    /// How long a store call may take before the failure policy applies
    /// ([`DEFAULT_TIMEOUT`] by default; `None` waits for the store as long as it takes).
    /// A call that timed out is never retried: it may already have counted.
    pub fn with_timeout(mut self, timeout: Option<Duration>) -> Self {
        let settings = self.settings.changed();
        settings.rules = settings.rules.clone().with_timeout(timeout);
        self
    }

    /// Stops asking a store that keeps failing, for a moment: its requests go straight to
    /// the failure policy, so a dead Redis costs no timeout per request. On by default
    /// ([`CircuitBreaker::default`]: open after 5 consecutive failures, probe every
    /// 500 ms); `None` asks the store every time.
    pub fn with_circuit_breaker(mut self, breaker: Option<CircuitBreaker>) -> Self {
        let settings = self.settings.changed();
        settings.rules = settings.rules.clone().with_circuit_breaker(breaker);
        self
    }

    /// Lets a request that would be denied wait instead, when it would fit within
    /// `max_wait` (nginx `limit_req delay=`, a throttling queue). Bursts are smoothed
    /// instead of failed; the client sees a slower answer, not a 429.
    ///
    /// Token bucket and GCRA limits *reserve* (the request is counted at once for the
    /// moment it may run, then sleeps and runs without asking again); the window
    /// algorithms, the log and lockouts sleep until `retry_after` and ask again. At most
    /// [`max_waiters`](Self::with_max_waiters) requests wait. Waiting uses Tokio's timer: the
    /// service must run on a Tokio runtime. See
    /// [Waiting instead of 429](crate::guide::waiting) for the guarantees, hanging up and
    /// replicas.
    ///
    /// `None` (the default) turns waiting off.
    ///
    /// ```
    /// use std::time::Duration;
    /// use tollgate::{Limit, RateLimitLayer};
    ///
    /// // 10 a second; a burst above it is spread out over up to half a second.
    /// let layer = RateLimitLayer::new(Limit::gcra(10, Duration::from_secs(1))?)
    ///     .with_max_wait(Some(Duration::from_millis(500)))
    ///     .with_max_waiters(100, 5);
    /// # Ok::<(), tollgate::ConfigError>(())
    /// ```
    pub fn with_max_wait(mut self, max_wait: Option<Duration>) -> Self {
        let settings = self.settings.changed();
        settings.rules = settings.rules.clone().with_max_wait(max_wait);
        self
    }

    /// At most `in_flight.max()` requests of a key in flight at once, decided in the
    /// same store call as the limits, all-or-nothing: a request the cap denies spends no
    /// units, and one the limits deny takes no permit. The permit comes back when the
    /// response body ends or is dropped, when the response future is dropped, or when
    /// the inner service fails; with [`count_when`](Self::with_count_when) or a late cost, in
    /// the same store call as the adjustment, once the body ends. Changeable at run time
    /// ([`Rules::with_in_flight`](crate::rules::Rules::with_in_flight)); plans have the layer's. See [`InFlightLimit`] (the
    /// stores, the permit TTL). Off by default.
    ///
    /// It replaces an [`InFlightLayer`](crate::in_flight::InFlightLayer) stacked beside this
    /// layer: one store call per request instead of two, and the layer's key, name,
    /// metrics, failure policy, breaker and [`RulesHandle`](crate::rules::RulesHandle) apply to it.
    ///
    /// With [`max_wait`](Self::with_max_wait), a request that may wait takes its permit
    /// and reserves its units in the same store call, and holds the permit while it
    /// waits (waiting requests count toward the cap); dropped while it waits, it gives
    /// the permit back. A request the cap denies is answered 429 at once: in-flight
    /// denials never wait. See [`Rules::with_in_flight`](crate::rules::Rules::with_in_flight).
    pub fn with_in_flight(mut self, in_flight: InFlightLimit) -> Self {
        let settings = self.settings.changed();
        settings.rules = settings.rules.clone().with_in_flight(Some(in_flight));
        self
    }

    /// How many requests may [wait](Self::with_max_wait) at once: `total` for the layer (and
    /// its clones), `per_key` for one key ([`DEFAULT_MAX_WAITERS`] and
    /// [`DEFAULT_MAX_WAITERS_PER_KEY`] by default). Beyond either, a request is answered
    /// 429 at once.
    pub fn with_max_waiters(mut self, total: usize, per_key: usize) -> Self {
        let settings = self.settings.changed();
        settings.rules = settings.rules.clone().with_max_waiters(total, per_key);
        self
    }

    /// Puts a [`RateLimitInfo`](crate::RateLimitInfo) (the decision and its plan) in the
    /// extensions of each request the store allowed, for the inner service (a handler
    /// that shows a client its budget). Off by default. See [`Rules::with_request_info`].
    pub fn with_request_info(mut self, on: bool) -> Self {
        let settings = self.settings.changed();
        settings.rules = settings.rules.clone().with_request_info(on);
        self
    }

    /// Which rate-limit fields responses carry. See [`HeaderStyle`].
    pub fn with_headers(mut self, style: HeaderStyle) -> Self {
        let settings = self.settings.changed();
        settings.rules = settings.rules.clone().with_headers(style);
        self
    }

    /// Adds the [adaptive stage](crate::adaptive#the-stage-of-a-layer): an in-flight limit
    /// that follows latency and errors and sheds the least critical first, before the
    /// store call (a shed request costs no store call, no units). One for the layer and
    /// its clones (or per key); a [`RulesHandle`] swap keeps it. Composes with every option.
    pub fn with_adaptive(mut self, adaptive: Adaptive) -> Self {
        self.settings.changed().adaptive = Some(adaptive);
        self
    }

    /// The running [adaptive](Self::with_adaptive) stage (`None` without one), for metrics
    /// and admin pages; take it once the layer is configured.
    pub fn adaptive_handle(&self) -> Option<AdaptiveHandle> {
        let stage = self.settings.stage()?.clone();
        Some(AdaptiveHandle { stage })
    }

    /// Builds the answers to rejected requests with `rejection`. See
    /// [`OnRejection`](crate::OnRejection).
    pub fn with_on_rejection<R2>(self, rejection: R2) -> RateLimitLayer<K, C, R2, M, E> {
        RateLimitLayer {
            key: self.key,
            cost: self.cost,
            rejection,
            recount: self.recount,
            exempt: self.exempt,
            settings: self.settings,
        }
    }

    fn recount<M2>(mut self, recount: M2) -> RateLimitLayer<K, C, R, M2, E> {
        self.settings.changed().counts_after = true;
        RateLimitLayer {
            key: self.key,
            cost: self.cost,
            rejection: self.rejection,
            recount,
            exempt: self.exempt,
            settings: self.settings,
        }
    }

    /// Names this layer in metrics (the `route` label, feature `metrics`) and in the
    /// store-failure log lines; [`DEFAULT_NAME`] by default. See [`metrics`](crate::metrics).
    pub fn with_name(mut self, name: impl Into<String>) -> Self {
        self.settings.name = name.into().into();
        self
    }

    /// The limits in force, in the order they are reported.
    pub fn limits(&self) -> Arc<[Limit]> {
        match self.settings.cell.get() {
            Some(cell) => cell.active.load().rules.limits().into(),
            None => self.settings.rules.limits().into(),
        }
    }

    /// A handle that changes this layer's [`Rules`] while it serves: every service made
    /// by this layer or its clones, before or after, decides under the rules last set.
    /// Take it once the layer is configured: a builder call afterwards makes a new layer
    /// that the handle does not change. See [`rules`](crate::rules).
    pub fn rules_handle(&self) -> RulesHandle {
        RulesHandle::new(self.settings.cell().clone())
    }

    /// A handle to [peek](Limiter::peek) at and [reset](Limiter::reset) a key's budgets
    /// under this layer's rules in force, on its store. Take it once the layer is
    /// configured, as a [`rules_handle`](Self::rules_handle). See [`Limiter`].
    pub fn limiter(&self) -> Limiter<K> {
        Limiter::new(
            self.key.clone(),
            self.settings.cell().clone(),
            self.settings.name.clone(),
        )
    }

    /// Whether the layer can be built: its store has every
    /// [capability](crate::store::Capability) its features need.
    /// [`layer`](Layer::layer) calls this and panics with the error; call it first to
    /// handle the error instead.
    ///
    /// - Counting after the response ([`count_when`](Self::with_count_when),
    ///   [`late_cost`](Self::with_late_cost), [`late_cost_from_trailers`](Self::with_late_cost_from_trailers))
    ///   needs [`Adjust`](crate::store::Capability::Adjust).
    /// - [`max_wait`](Self::with_max_wait) needs nothing: on a store that cannot
    ///   [reserve](crate::store::Capability::Reserve), a denied request waits its turn
    ///   and asks again (as requests under limits that cannot be reserved do on every
    ///   store), without the reservation's promise that nobody takes its units meanwhile.
    /// - Rules set later through a [`RulesHandle`] cannot need more: the way a layer
    ///   counts is its type, and its local fallback store is a [`MemoryStore`], which has
    ///   every capability.
    ///
    /// # Errors
    ///
    /// A [`ConfigError`](crate::ConfigError) (field `store`) naming the store (the start
    /// of its `Debug`) and the feature it cannot serve.
    pub fn validate(&self) -> Result<(), crate::ConfigError> {
        let settings = &self.settings;
        crate::rules::needs(&settings.rules, &*settings.store)?;
        let capabilities = settings.store.capabilities();
        if settings.counts_after && !capabilities.contains(crate::store::Capability::Adjust) {
            return Err(crate::ConfigError::new(
                "store",
                format!(
                    "{} cannot adjust units after a decision (Store::adjust), which counting \
                     after the response (count_when, late_cost, late_cost_from_trailers) needs",
                    crate::store::store_name(&*settings.store)
                ),
            ));
        }
        Ok(())
    }
}

/// Counting after the response: one rule per layer, chosen once (a second would replace
/// the first, so it does not compile). [`late_cost`](Self::with_late_cost) covers
/// [`count_when`](Self::with_count_when): answer `Some(0)` for a response that does not count.
///
/// ```compile_fail
/// use axum::{body::Body, http::Response};
/// use tollgate::{Limit, RateLimitLayer};
///
/// let limit = Limit::fixed_window(5, std::time::Duration::from_secs(60)).unwrap();
/// let layer = RateLimitLayer::new(limit)
///     .with_count_when(|r: &Response<Body>| r.status() == 401)
///     .with_late_cost(|_: &Response<Body>| Some(1)); // a second rule: does not compile
/// ```
impl<K, C, R, E> RateLimitLayer<K, C, R, UpFront, E> {
    /// Keeps a request's units spent only when `predicate` holds on its response (say,
    /// only failed logins count). The request is still checked first, so a key over its
    /// limit is rejected; see [`count_after`](crate::count_after) for the bound that holds
    /// while requests are in flight, and what a dropped response or an error counts.
    pub fn with_count_when<P, B>(self, predicate: P) -> RateLimitLayer<K, C, R, CountWhen<P>, E>
    where
        P: Fn(&Response<B>) -> bool,
    {
        self.recount(CountWhen(predicate))
    }

    /// Charges what `cost` reads from the response (say, a header with the tokens a
    /// request used): the difference to the up-front [cost](Self::with_cost) is given back or
    /// charged late, even over the limit. `None` keeps the up-front cost. See
    /// [`count_after`](crate::count_after).
    pub fn with_late_cost<F, B>(self, cost: F) -> RateLimitLayer<K, C, R, LateCost<F>, E>
    where
        F: Fn(&Response<B>) -> Option<u32>,
    {
        self.recount(LateCost(cost))
    }

    /// [`late_cost`](Self::with_late_cost) from the response's trailers (a gRPC trailer with
    /// the tokens used, or `grpc-status` to count only failed calls), read when the body
    /// ends; `cost` gets `None` when the body had no trailers. A trailers-only gRPC
    /// response (`grpc-status` in its headers, as tonic answers an error) is read at
    /// once, its headers standing for its trailers. The service answers with a
    /// [`CountedBody`](crate::count_after::CountedBody).
    pub fn with_late_cost_from_trailers<F>(
        self,
        cost: F,
    ) -> RateLimitLayer<K, C, R, TrailerCost<F>, E>
    where
        F: Fn(Option<&HeaderMap>) -> Option<u32>,
    {
        self.recount(TrailerCost(cost))
    }
}

impl<S, K, C: Clone, R: Clone, M: Clone, E: Clone> Layer<S> for RateLimitLayer<K, C, R, M, E> {
    type Service = RateLimit<S, K, C, R, M, E>;

    /// # Panics
    ///
    /// When the store lacks a capability the layer's features need, with the message of
    /// [`validate`](RateLimitLayer::validate)'s error, as a router with a conflicting
    /// route panics when it is built.
    fn layer(&self, inner: S) -> Self::Service {
        if let Err(error) = self.validate() {
            panic!("{error}");
        }
        let settings = &self.settings;
        let shared = Shared {
            rules: settings.cell().clone(),
            rejection: self.rejection.clone(),
            name: settings.name.clone(),
            metrics: crate::metrics::LayerMetrics::new(&settings.name),
            adaptive: settings.stage().cloned(),
        };
        RateLimit::new(
            inner,
            self.key.clone(),
            self.cost.clone(),
            self.recount.clone(),
            self.exempt.clone(),
            Arc::new(shared),
        )
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
