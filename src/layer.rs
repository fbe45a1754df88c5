//! [`RateLimitLayer`]: the configuration, applied with `.layer(..)`.

use std::{
    fmt,
    sync::{Arc, OnceLock},
    time::Duration,
};

use tower_layer::Layer;

use http::{HeaderMap, Response};

use crate::{
    CircuitBreaker, FailurePolicy, InFlightLimit, Limit, MissingKey,
    count_after::{CountWhen, LateCost, TrailerCost, UpFront},
    decide::Shared,
    headers::HeaderStyle,
    key::PeerIp,
    limiter::Limiter,
    rejection::DefaultRejection,
    rules::{Cell, Rules, RulesHandle},
    service::RateLimit,
    store::{MemoryStore, Store},
};
#[cfg(doc)]
use crate::{DEFAULT_MAX_WAITERS, DEFAULT_MAX_WAITERS_PER_KEY, DEFAULT_TIMEOUT};

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
pub struct RateLimitLayer<K = PeerIp, C = u32, R = DefaultRejection, M = UpFront> {
    key: Arc<K>,
    cost: C,
    rejection: R,
    /// How requests are counted: up front, or after their response
    /// ([`count_when`](Self::count_when), [`late_cost`](Self::late_cost)).
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
}

impl Settings {
    /// The rules cell of the layer as it is now, made on first use.
    fn cell(&self) -> &Arc<Cell> {
        self.cell.get_or_init(|| {
            if self.store.connecting() {
                warn_connecting(&self.name, self.rules.on_store_error());
            }
            Cell::new(self.rules.clone(), self.store.clone())
        })
    }

    /// A builder call: the layer is a new one, with rules of its own.
    fn changed(&mut self) -> &mut Self {
        if let Some(cell) = self.cell.get() {
            // Keep what a handle may have set.
            self.rules = cell.active.load().rules.clone();
        }
        self.cell = Arc::default();
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
impl<K, C: Clone, R: Clone, M: Clone> Clone for RateLimitLayer<K, C, R, M> {
    fn clone(&self) -> Self {
        Self {
            key: self.key.clone(),
            cost: self.cost.clone(),
            rejection: self.rejection.clone(),
            recount: self.recount.clone(),
            settings: self.settings.clone(),
        }
    }
}

impl<K: fmt::Debug, C: fmt::Debug, R: fmt::Debug, M: fmt::Debug> fmt::Debug
    for RateLimitLayer<K, C, R, M>
{
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("RateLimitLayer")
            .field("key", &self.key)
            .field("cost", &self.cost)
            .field("rejection", &self.rejection)
            .field("recount", &self.recount)
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
            settings: Settings {
                rules: Rules::new([limit]).expect("one limit is a valid rule set"),
                store: Arc::new(MemoryStore::new()),
                name: Arc::from(DEFAULT_NAME),
                cell: Arc::default(),
            },
        }
    }
}

impl<K, C, R, M> RateLimitLayer<K, C, R, M> {
    /// Adds another limit. A request passes only when every limit has room, and a denied
    /// request consumes nothing from any of them; all are decided in one store call.
    /// Adding a limit equal to one already present changes nothing; one with the same
    /// [carried-over](crate::OnChange::CarryOver) state (name, algorithm and window)
    /// replaces it.
    pub fn limit(mut self, limit: Limit) -> Self {
        self.settings.changed().rules.push_limit(limit);
        self
    }

    /// Decides each request under the limits of its plan, picked by `plans`'s resolver;
    /// the limits given to the layer apply to requests without a plan when there is no
    /// default plan. See [`plan`](crate::plan).
    pub fn plans(mut self, plans: crate::Plans) -> Self {
        let settings = self.settings.changed();
        settings.rules = settings.rules.clone().with_plans(plans);
        self
    }

    /// Adds a shadow limit: decided and counted on every request, never rejecting; a
    /// request it would reject passes and is counted as `would_reject` (feature
    /// `metrics`) and logged at `info`. An enforced limit with the same state becomes this
    /// shadow one. See [Shadow mode](crate#shadow-mode) and [`Rules::with_shadow_limits`].
    pub fn shadow_limit(mut self, limit: Limit) -> Self {
        self.settings.changed().rules.push_shadow_limit(limit);
        self
    }

    /// Puts every limit of the layer in shadow (`true`): a request that would get a 429
    /// goes to the inner service instead, and is counted as `would_reject` and logged.
    /// See [Shadow mode](crate#shadow-mode) and [`Rules::with_shadow`].
    pub fn shadow(mut self, shadow: bool) -> Self {
        let settings = self.settings.changed();
        settings.rules = settings.rules.clone().with_shadow(shadow);
        self
    }

    /// Counts requests by `key` instead. See [`key`](crate::key) for the extractors.
    pub fn key<K2>(self, key: K2) -> RateLimitLayer<K2, C, R, M> {
        RateLimitLayer {
            key: Arc::new(key),
            cost: self.cost,
            rejection: self.rejection,
            recount: self.recount,
            settings: self.settings,
        }
    }

    /// Charges each request `cost` units: a fixed `u32` or a closure
    /// `Fn(&Request<B>) -> u32`. See [`RequestCost`](crate::RequestCost).
    pub fn cost<C2>(self, cost: C2) -> RateLimitLayer<K, C2, R, M> {
        RateLimitLayer {
            key: self.key,
            cost,
            rejection: self.rejection,
            recount: self.recount,
            settings: self.settings,
        }
    }

    /// Keeps the state in `store` (a `RedisStore` to share limits between replicas).
    pub fn store(mut self, store: impl Store) -> Self {
        self.settings.changed().store = Arc::new(store);
        self
    }

    /// Keeps the state in a store already shared with other layers.
    pub fn shared_store(mut self, store: Arc<dyn Store>) -> Self {
        self.settings.changed().store = store;
        self
    }

    /// What requests get when the store fails or times out. See [`FailurePolicy`].
    pub fn on_store_error(mut self, policy: FailurePolicy) -> Self {
        let settings = self.settings.changed();
        settings.rules = settings.rules.clone().with_on_store_error(policy);
        self
    }

    /// What requests without a key get. See [`MissingKey`].
    pub fn on_missing_key(mut self, policy: MissingKey) -> Self {
        let settings = self.settings.changed();
        settings.rules = settings.rules.clone().with_on_missing_key(policy);
        self
    }

    /// How long a store call may take before the failure policy applies
    /// ([`DEFAULT_TIMEOUT`] by default; `None` waits for the store as long as it takes).
    /// A call that timed out is never retried: it may already have counted.
    pub fn timeout(mut self, timeout: Option<Duration>) -> Self {
        let settings = self.settings.changed();
        settings.rules = settings.rules.clone().with_timeout(timeout);
        self
    }

    /// Stops asking a store that keeps failing, for a moment: its requests go straight to
    /// the failure policy, so a dead Redis costs no timeout per request. On by default
    /// ([`CircuitBreaker::default`]: open after 5 consecutive failures, probe every
    /// 500 ms); `None` asks the store every time.
    pub fn circuit_breaker(mut self, breaker: Option<CircuitBreaker>) -> Self {
        let settings = self.settings.changed();
        settings.rules = settings.rules.clone().with_circuit_breaker(breaker);
        self
    }

    /// Lets a request that would be denied wait instead, when it would fit within
    /// `max_wait` (nginx `limit_req delay=`, a throttling queue). Bursts are smoothed
    /// instead of failed; the client sees a slower answer, not a 429.
    ///
    /// - **Token bucket and GCRA limits reserve**: the layer asks the store to
    ///   [reserve](crate::Store::reserve), which counts the request at once for the moment
    ///   it may run (a bucket goes into debt, GCRA's arrival time moves ahead) and answers
    ///   "allowed after [`wait`](crate::Decision::wait)". The request sleeps that long and
    ///   runs without asking again: nobody can overtake it, and it never waits in vain.
    ///   Several limits reserve together or not at all (the longest wait counts).
    /// - **Fixed and sliding windows, the log and lockouts do not reserve** (a window
    ///   cannot hold units for a later window without counting them in the wrong one):
    ///   a denied request whose `retry_after` is within `max_wait` sleeps that long and
    ///   asks the store again. A request that arrives meanwhile may take the units first;
    ///   the waiter then waits again while its whole wait stays within `max_wait`, and is
    ///   answered 429 otherwise. So does a list of limits with one of these among them,
    ///   and a custom [`Store`] without `reserve`.
    /// - At most [`max_waiters`](Self::max_waiters) requests wait per layer and per key;
    ///   beyond that the answer is 429 at once, so waiting never holds unbounded memory.
    ///   A client that hangs up gives its place back at once, and a reserved one its
    ///   units too ([`Adjustment::Refund`](crate::Adjustment::Refund)) when no
    ///   reservation of its key in this layer's line was made after it (the README's
    ///   "Hanging up", under `max_wait`, says why, and what that means with replicas).
    /// - A request that can never fit (costlier than a limit's capacity) does not wait.
    /// - Waiting uses Tokio's timer: the service must run on a Tokio runtime.
    ///
    /// Off by default.
    ///
    /// ```
    /// use std::time::Duration;
    /// use tollgate::{Limit, RateLimitLayer};
    ///
    /// // 10 a second; a burst above it is spread out over up to half a second.
    /// let layer = RateLimitLayer::new(Limit::gcra(10, Duration::from_secs(1))?)
    ///     .max_wait(Duration::from_millis(500))
    ///     .max_waiters(100, 5);
    /// # Ok::<(), tollgate::ConfigError>(())
    /// ```
    pub fn max_wait(mut self, max_wait: Duration) -> Self {
        let settings = self.settings.changed();
        settings.rules = settings.rules.clone().with_max_wait(Some(max_wait));
        self
    }

    /// At most `in_flight.max()` requests of a key in flight at once, decided in the
    /// same store call as the limits, all-or-nothing: a request the cap denies spends no
    /// units, and one the limits deny takes no permit. The permit comes back when the
    /// response body ends or is dropped, when the response future is dropped, or when
    /// the inner service fails; with [`count_when`](Self::count_when) or a late cost, in
    /// the same store call as the adjustment, once the body ends. Changeable at run time
    /// ([`Rules::with_in_flight`]); plans have the layer's. See [`InFlightLimit`] (the
    /// stores, the permit TTL). Off by default.
    ///
    /// It replaces an [`InFlightLayer`](crate::InFlightLayer) stacked beside this
    /// layer: one store call per request instead of two, and the layer's key, name,
    /// metrics, failure policy, breaker and [`RulesHandle`] apply to it. A request
    /// with an in-flight limit does not [wait](Self::max_wait): a denial is answered at
    /// once.
    pub fn in_flight(mut self, in_flight: InFlightLimit) -> Self {
        let settings = self.settings.changed();
        settings.rules = settings.rules.clone().with_in_flight(Some(in_flight));
        self
    }

    /// How many requests may [wait](Self::max_wait) at once: `total` for the layer (and
    /// its clones), `per_key` for one key ([`DEFAULT_MAX_WAITERS`] and
    /// [`DEFAULT_MAX_WAITERS_PER_KEY`] by default). Beyond either, a request is answered
    /// 429 at once.
    pub fn max_waiters(mut self, total: usize, per_key: usize) -> Self {
        let settings = self.settings.changed();
        settings.rules = settings.rules.clone().with_max_waiters(total, per_key);
        self
    }

    /// Puts a [`RateLimitInfo`](crate::RateLimitInfo) (the decision and its plan) in the
    /// extensions of each request the store allowed, for the inner service (a handler
    /// that shows a client its budget). Off by default. See [`Rules::with_request_info`].
    pub fn request_info(mut self, on: bool) -> Self {
        let settings = self.settings.changed();
        settings.rules = settings.rules.clone().with_request_info(on);
        self
    }

    /// Which rate-limit fields responses carry. See [`HeaderStyle`].
    pub fn headers(mut self, style: HeaderStyle) -> Self {
        let settings = self.settings.changed();
        settings.rules = settings.rules.clone().with_headers(style);
        self
    }

    /// Builds the answers to rejected requests with `rejection`. See
    /// [`OnRejection`](crate::OnRejection).
    pub fn on_rejection<R2>(self, rejection: R2) -> RateLimitLayer<K, C, R2, M> {
        RateLimitLayer {
            key: self.key,
            cost: self.cost,
            rejection,
            recount: self.recount,
            settings: self.settings,
        }
    }

    /// Keeps a request's units spent only when `predicate` holds on its response (say,
    /// only failed logins count). The request is still checked first, so a key over its
    /// limit is rejected; see [`count_after`](crate::count_after) for the bound that holds
    /// while requests are in flight, and what a dropped response or an error counts.
    pub fn count_when<P, B>(self, predicate: P) -> RateLimitLayer<K, C, R, CountWhen<P>>
    where
        P: Fn(&Response<B>) -> bool,
    {
        self.recount(CountWhen(predicate))
    }

    /// Charges what `cost` reads from the response (say, a header with the tokens a
    /// request used): the difference to the up-front [cost](Self::cost) is given back or
    /// charged late, even over the limit. `None` keeps the up-front cost. See
    /// [`count_after`](crate::count_after).
    pub fn late_cost<F, B>(self, cost: F) -> RateLimitLayer<K, C, R, LateCost<F>>
    where
        F: Fn(&Response<B>) -> Option<u32>,
    {
        self.recount(LateCost(cost))
    }

    /// [`late_cost`](Self::late_cost) from the response's trailers (a gRPC trailer with
    /// the tokens used, or `grpc-status` to count only failed calls), read when the body
    /// ends; `cost` gets `None` when the body had no trailers. A trailers-only gRPC
    /// response (`grpc-status` in its headers, as tonic answers an error) is read at
    /// once, its headers standing for its trailers. The service answers with a
    /// [`CountedBody`](crate::count_after::CountedBody).
    pub fn late_cost_from_trailers<F>(self, cost: F) -> RateLimitLayer<K, C, R, TrailerCost<F>>
    where
        F: Fn(Option<&HeaderMap>) -> Option<u32>,
    {
        self.recount(TrailerCost(cost))
    }

    fn recount<M2>(self, recount: M2) -> RateLimitLayer<K, C, R, M2> {
        RateLimitLayer {
            key: self.key,
            cost: self.cost,
            rejection: self.rejection,
            recount,
            settings: self.settings,
        }
    }

    /// Names this layer in metrics (the `route` label, feature `metrics`) and in the
    /// store-failure log lines; [`DEFAULT_NAME`] by default. See [`metrics`](crate::metrics).
    pub fn name(mut self, name: impl Into<String>) -> Self {
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
        Limiter::new(self.key.clone(), self.settings.cell().clone())
    }
}

impl<S, K, C: Clone, R: Clone, M: Clone> Layer<S> for RateLimitLayer<K, C, R, M> {
    type Service = RateLimit<S, K, C, R, M>;

    fn layer(&self, inner: S) -> Self::Service {
        let settings = &self.settings;
        let shared = Shared {
            rules: settings.cell().clone(),
            rejection: self.rejection.clone(),
            name: settings.name.clone(),
            metrics: crate::metrics::LayerMetrics::new(&settings.name),
        };
        RateLimit::new(
            inner,
            self.key.clone(),
            self.cost.clone(),
            self.recount.clone(),
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
