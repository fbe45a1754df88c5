//! The route table: each route's service (its rate-limit layers around the proxy, or the
//! `ok` answer), built from a config, and changed in place by a reload where the library
//! lets it change at run time.
//!
//! A route's rate limits are one `RateLimitLayer` per kind of key (ip, then each header,
//! then global), then one for its plans, innermost; its `max_in_flight` is an
//! `InFlightLayer` around them all. A reload compares each route of the new config with
//! the running route of the same `path`:
//!
//! - **Same layers** (the same kinds of key, plans keyed alike, the same `count_when` /
//!   `cost_header`, `upstream`, `trusted_proxies` and header-key hashing): the running
//!   layers stay, and each gets its new [`Rules`](tollgate::rules::Rules) through its
//!   [`RulesHandle`]: limits, shadow limits, `shadow`, `delay`, plans,
//!   `[store].timeout_ms`, `on_error` and the circuit breaker's settings. So the route
//!   keeps its circuit breakers (open stays open while their settings stay), its waiting
//!   lines (requests waiting under `delay` keep their place and are answered) and its
//!   metrics, and its admin endpoints follow.
//! - **`max_in_flight` changed** (or the store's `timeout_ms` / `on_error` / breaker,
//!   which the in-flight limit uses too): the in-flight limit is built anew around the
//!   running rate-limit layers. The permits live in the store, which a reload keeps, so a
//!   request in flight still counts.
//! - **`[routes.adaptive]`** is a stage of the route's outermost layer, whose state
//!   (the learned limit, the requests in flight under it) lives in the layer: kept with
//!   the layers. A reload may not add, change or remove it on a running route (refused
//!   before this module sees it, `server::Live::apply`).
//! - **Anything else** (a route added, a kind of key added or removed, an upstream
//!   changed...): the route is built anew, its adaptive limit too (starting again at
//!   `initial`, without the requests still in flight under the old one). Budgets live in the store and stay as each
//!   limit's `on_change` says; the new route's breakers start closed and its waiting line
//!   empty (requests already waiting finish in the old one).

use std::{convert::Infallible, sync::Arc, time::Duration};

use axum::{body::Body, extract::Request, http::StatusCode, response::Response};
use ipnet::IpNet;
use tollgate::{
    CircuitBreaker, FailurePolicy, RateLimitLayer,
    in_flight::{InFlightBody, InFlightLayer},
    key::{ClientIp, GlobalKey, HeaderKey},
    rules::RulesHandle,
    store::{Permits, Store},
};
use tower::{Layer, ServiceExt, service_fn, util::BoxCloneSyncService};

use crate::{
    admin,
    config::{
        Config, CountAfter, HeaderKeys, KeySpec, OnError, Route, RouteLimit, Upstream,
        adaptive::AdaptiveConfig,
    },
    path,
    proxy::{self, Proxy},
    traffic::RouteMetrics,
};

/// One route's service: its rate-limit layers around the proxy (or the `ok` answer).
pub(crate) type RouteService = BoxCloneSyncService<Request, Response, Infallible>;

/// What every build of the route table uses and a reload keeps.
pub(crate) struct Lasting {
    /// The budgets live in it.
    pub(crate) store: Arc<dyn Store>,
    /// The same store, where the `max_in_flight` permits live.
    pub(crate) permits: Arc<dyn Permits>,
    /// The fallback of `on_error = "local"` (a memory store).
    pub(crate) local: FailurePolicy,
    /// Its pooled upstream connections stay.
    pub(crate) client: proxy::HttpClient,
}

/// The routes, longest prefix first.
#[derive(Debug)]
pub(crate) struct Gateway {
    routes: Vec<Built>,
    /// The traffic metrics of requests that match no route (`None`: not recorded, no
    /// `admin_listen`).
    unmatched: Option<Arc<RouteMetrics>>,
}

/// How a reload built the route table: running routes kept in place, and built anew.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub(crate) struct Reuse {
    pub(crate) kept: usize,
    pub(crate) rebuilt: usize,
}

impl Gateway {
    /// The route table of `config`. With `previous` (the running table, on a reload),
    /// a route whose layers stay the same keeps them, under its new rules (module docs).
    pub(crate) fn build(
        config: &Config,
        lasting: &Lasting,
        previous: Option<&Gateway>,
    ) -> (Self, Reuse) {
        let policy = match config.store.on_error {
            OnError::Allow => FailurePolicy::Allow,
            OnError::Deny => FailurePolicy::Deny,
            OnError::Local => lasting.local.clone(),
        };
        let proxy = Arc::new(proxy::Settings {
            client: lasting.client.clone(),
            trusted_proxies: config.trusted_proxies.clone(),
            upstream_timeout: config.server.upstream_timeout,
            metered: metered(config),
        });
        let mut count = Reuse::default();
        let mut routes: Vec<Built> = config
            .routes
            .iter()
            .map(|route| {
                let running = previous.and_then(|p| p.routes.iter().find(|b| b.path == route.path));
                let context = Context {
                    route,
                    config,
                    lasting,
                    policy: &policy,
                };
                match running.and_then(|running| context.update(running)) {
                    Some(kept) => {
                        count.kept += 1;
                        kept
                    }
                    None => {
                        if running.is_some() {
                            count.rebuilt += 1;
                        }
                        context.build(&proxy)
                    }
                }
            })
            .collect();
        // Longest prefix first; two different prefixes of one length never both match.
        routes.sort_by_key(|built| std::cmp::Reverse(built.path.len()));
        // The running table's, when there is one: the same series.
        let unmatched = match previous {
            Some(previous) => previous.unmatched.clone(),
            None => metered(config).then(|| RouteMetrics::new(crate::traffic::UNMATCHED, None)),
        };
        (Self { routes, unmatched }, count)
    }

    /// The traffic metrics of requests that match no route, if they are recorded.
    pub(crate) fn unmatched(&self) -> Option<&Arc<RouteMetrics>> {
        self.unmatched.as_ref()
    }

    /// The service of the route `path` (normalised) belongs to, and its traffic
    /// metrics if they are recorded.
    pub(crate) fn routed(&self, path: &str) -> Option<(&RouteService, Option<&Arc<RouteMetrics>>)> {
        self.routes
            .iter()
            .find(|built| path::matches_prefix(&built.path, path))
            .map(|built| (&built.service, built.metrics.as_ref()))
    }

    /// Every route's rate-limit layers, for the admin endpoints.
    pub(crate) fn admin(&self) -> impl Iterator<Item = &admin::Entry> {
        self.routes.iter().flat_map(|built| built.admin.iter())
    }
}

/// One route as built, and what a reload needs to change it in place.
struct Built {
    path: String,
    /// The whole route: `inner` behind its in-flight limit, if any.
    service: RouteService,
    /// The endpoint behind the rate-limit layers.
    inner: RouteService,
    /// What the rate-limit layers were built for.
    shape: Shape,
    /// What the in-flight limit was built for (`None`: no `max_in_flight`).
    in_flight: Option<InFlightShape>,
    /// The rate-limit layers' rules, outermost first (as `shape.layers`).
    handles: Vec<RulesHandle>,
    admin: Vec<admin::Entry>,
    /// The route's traffic metrics (`None`: not recorded).
    metrics: Option<Arc<RouteMetrics>>,
}

/// Whether the traffic metrics are recorded: with `admin_listen`, which installs the
/// recorder that serves them.
fn metered(config: &Config) -> bool {
    config.admin_listen.is_some()
}

impl std::fmt::Debug for Built {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Built")
            .field("path", &self.path)
            .field("layers", &self.shape.layers)
            .finish_non_exhaustive()
    }
}

/// What a route's rate-limit layers and endpoint are made of that their rules cannot
/// change: when it stays, a reload keeps them.
#[derive(Debug, PartialEq)]
struct Shape {
    /// Each layer's key, and whether it is the plans' layer, outermost first.
    layers: Vec<(KeySpec, bool)>,
    count_after: Option<CountAfter>,
    upstream: Option<Upstream>,
    /// The `ip` key's extractor and the proxy's forwarding headers.
    trusted_proxies: Vec<IpNet>,
    /// The `header:<name>` keys' extractor.
    header_keys: HeaderKeys,
    /// The outermost layer's adaptive stage: its state lives in the layer.
    adaptive: Option<AdaptiveConfig>,
}

/// What a route's in-flight limit is made of.
#[derive(Debug, PartialEq)]
struct InFlightShape {
    max: u32,
    key: KeySpec,
    on_error: OnError,
    timeout: Duration,
    breaker: CircuitBreaker,
    trusted_proxies: Vec<IpNet>,
    header_keys: HeaderKeys,
}

/// One route of a config being built.
struct Context<'a> {
    route: &'a Route,
    config: &'a Config,
    lasting: &'a Lasting,
    policy: &'a FailurePolicy,
}

/// A rate-limit layer as configured, before its key: its key, whether it is the plans'
/// layer, and the layer.
type Configured = (KeySpec, bool, RateLimitLayer);

impl Context<'_> {
    fn shape(&self, layers: &[Configured]) -> Shape {
        Shape {
            layers: layers
                .iter()
                .map(|(key, plans, _)| (key.clone(), *plans))
                .collect(),
            count_after: self.route.count_after.clone(),
            upstream: self.route.upstream.clone(),
            trusted_proxies: self.config.trusted_proxies.clone(),
            header_keys: self.config.store.header_keys.clone(),
            adaptive: self.route.adaptive.clone(),
        }
    }

    fn in_flight_shape(&self) -> Option<InFlightShape> {
        let max = self.route.max_in_flight?;
        // Keyed by the route's first limit's key, else its plans' key, else the client IP.
        let key = self
            .route
            .limits
            .first()
            .map(|limit| limit.key.clone())
            .or_else(|| self.route.plans.as_ref().map(|plans| plans.key.clone()))
            .unwrap_or(KeySpec::Ip);
        Some(InFlightShape {
            max,
            key,
            on_error: self.config.store.on_error,
            timeout: self.config.store.timeout,
            breaker: self.config.store.breaker,
            trusted_proxies: self.config.trusted_proxies.clone(),
            header_keys: self.config.store.header_keys.clone(),
        })
    }

    /// `running` under this route's config, when its layers can stay: each gets its new
    /// rules, and the in-flight limit is built anew around them if it changed.
    fn update(&self, running: &Built) -> Option<Built> {
        let layers = self.layers();
        if self.shape(&layers) != running.shape {
            return None;
        }
        for ((_, _, layer), handle) in layers.iter().zip(&running.handles) {
            handle.set(layer.rules_handle().rules());
        }
        let in_flight = self.in_flight_shape();
        let service = if in_flight == running.in_flight {
            running.service.clone()
        } else {
            self.with_in_flight(in_flight.as_ref(), running.inner.clone())
        };
        Some(Built {
            path: running.path.clone(),
            service,
            inner: running.inner.clone(),
            shape: self.shape(&layers),
            in_flight,
            handles: running.handles.clone(),
            admin: running.admin.clone(),
            metrics: running.metrics.clone(),
        })
    }

    /// The route built anew.
    fn build(&self, proxy: &Arc<proxy::Settings>) -> Built {
        let route = self.route;
        let mut inner: RouteService = match &route.upstream {
            Some(upstream) => {
                let proxy = Arc::new(Proxy::new(proxy.clone(), upstream.clone(), &route.path));
                BoxCloneSyncService::new(service_fn(move |request: Request| {
                    let proxy = proxy.clone();
                    async move { Ok(proxy.forward(request).await) }
                }))
            }
            None => BoxCloneSyncService::new(service_fn(|_request: Request| async {
                Ok(proxy::status(StatusCode::OK, "ok"))
            })),
        };
        let layers = self.layers();
        let shape = self.shape(&layers);
        let mut handles = Vec::with_capacity(layers.len());
        let mut admin = Vec::with_capacity(layers.len());
        // Wrapped from the innermost (last) layer outwards.
        for (key, plans, layer) in layers.into_iter().rev() {
            let (service, handle, entry) = self.keyed(layer, key, plans, inner);
            inner = service;
            handles.push(handle);
            admin.push(entry);
        }
        handles.reverse();
        admin.reverse();
        let in_flight = self.in_flight_shape();
        Built {
            path: route.path.clone(),
            service: self.with_in_flight(in_flight.as_ref(), inner.clone()),
            inner,
            shape,
            in_flight,
            handles,
            admin,
            metrics: metered(self.config).then(|| {
                RouteMetrics::new(&route.path, route.upstream.as_ref().map(|u| &u.authority))
            }),
        }
    }

    /// The route's rate-limit layers as configured, outermost first: one per kind of key
    /// in the order ip, header, global, then the plans' layer.
    ///
    /// A layer decides its limits all-or-nothing in one store call; limits with different
    /// keys are in different layers, decided one after another: a request that one layer
    /// allows and a later one denies has used its budget in the first.
    fn layers(&self) -> Vec<Configured> {
        let route = self.route;
        let groups = key_groups(&route.limits);
        let several = groups.len() > 1;
        let mut layers: Vec<Configured> = groups
            .into_iter()
            .map(|(key, limits)| {
                let name = if several {
                    format!("{} {key}", route.path)
                } else {
                    route.path.clone()
                };
                // A shadow limit given to `new` is moved to shadow by `shadow_limit`.
                let mut layer = RateLimitLayer::new(limits[0].limit.clone());
                for limit in &limits {
                    layer = if limit.shadow {
                        layer.with_shadow_limit(limit.limit.clone())
                    } else {
                        layer.with_limit(limit.limit.clone())
                    };
                }
                (key, false, self.common(layer, name))
            })
            .collect();
        if let Some(plans) = self.plan_layer() {
            layers.push(plans);
        }
        // The adaptive limit is the outermost layer's first stage: a request it sheds
        // spends no rate budget and costs no store call.
        if let Some(adaptive) = &route.adaptive
            && !layers.is_empty()
        {
            let stage = adaptive
                .library()
                .expect("[routes.adaptive] validated with the config");
            let (key, plans, outer) = layers.remove(0);
            layers.insert(0, (key, plans, outer.with_adaptive(stage)));
        }
        layers
    }

    /// What every rate-limit layer of the route has: `shadow`, `delay`, the store and
    /// its policies, a name.
    fn common(&self, layer: RateLimitLayer, name: String) -> RateLimitLayer {
        let layer = layer
            .with_shadow(self.route.shadow)
            .with_store(self.lasting.store.clone())
            .with_on_store_error(self.policy.clone())
            .with_timeout(Some(self.config.store.timeout))
            .with_circuit_breaker(Some(self.config.store.breaker))
            .with_name(name);
        layer.with_max_wait(self.route.delay)
    }

    /// The layer of a route's plans, innermost (after the route's own limits), keyed by
    /// the plans' key. Every request has a plan (the default one at least), so the
    /// layer's own limit (any plan limit, required by the builder) never decides a
    /// request. `None` when no plan has limits.
    fn plan_layer(&self) -> Option<Configured> {
        let route = self.route;
        let plans = route.plans.as_ref()?;
        // Only unlimited plans: nothing to limit.
        let any = plans
            .plans
            .iter()
            .find_map(|p| p.limits.as_ref()?.first())?;
        let built = plans.plans.iter().map(|plan| match &plan.limits {
            Some(limits) => tollgate::plan::Plan::new(plan.name.as_str(), limits.iter().cloned()),
            None => tollgate::plan::Plan::unlimited(plan.name.as_str()),
        });
        // Validated with the config: these cannot fail.
        let built = built
            .collect::<Result<Vec<_>, _>>()
            .and_then(tollgate::plan::Plans::new)
            .and_then(|p| p.with_default(&plans.default))
            .expect("plans validated with the config")
            .with_header(plans.header.clone());
        let name = if route.limits.is_empty() {
            route.path.clone()
        } else {
            format!("{} plans", route.path)
        };
        // The plans are the route's limits too: their denials wait as the others do, and
        // they count after the response as the route says.
        let layer = self.common(RateLimitLayer::new(any.clone()).with_plans(built), name);
        Some((plans.key.clone(), true, layer))
    }

    /// `layer` keyed by `key`, around `service`, counting after the response when the
    /// route says so: the service, its rules' handle and its admin entry.
    fn keyed(
        &self,
        layer: RateLimitLayer,
        key: KeySpec,
        plans: bool,
        service: RouteService,
    ) -> (RouteService, RulesHandle, admin::Entry) {
        let path = &self.route.path;
        let after = self.route.count_after.as_ref();
        match key {
            KeySpec::Ip => {
                let layer =
                    layer.with_key(ClientIp::new(self.config.trusted_proxies.iter().copied()));
                let entry = admin::Entry::ip(path, plans, layer.limiter());
                let handle = layer.rules_handle();
                (wrap(layer, after, service), handle, entry)
            }
            KeySpec::Header(name) => {
                let layer = layer.with_key(header_key(name.clone(), self.config));
                let entry =
                    admin::Entry::header(path, plans, KeySpec::Header(name), layer.limiter());
                let handle = layer.rules_handle();
                (wrap(layer, after, service), handle, entry)
            }
            KeySpec::Global => {
                let layer = layer.with_key(GlobalKey);
                let entry = admin::Entry::global(path, plans, layer.limiter());
                let handle = layer.rules_handle();
                (wrap(layer, after, service), handle, entry)
            }
        }
    }

    /// `service` behind the route's `max_in_flight`, outermost: a request it denies spends
    /// no rate budget.
    fn with_in_flight(&self, shape: Option<&InFlightShape>, service: RouteService) -> RouteService {
        let Some(shape) = shape else {
            return service;
        };
        let layer = InFlightLayer::new(shape.max)
            .expect("max_in_flight validated with the config")
            .with_store(self.lasting.permits.clone())
            .with_on_store_error(self.policy.clone())
            .with_timeout(Some(shape.timeout))
            .with_circuit_breaker(Some(shape.breaker))
            .with_name(format!("{} in_flight", self.route.path));
        // The permit rides in the body until it ends: boxed into axum's body here.
        fn boxed<S>(service: S) -> RouteService
        where
            S: tower::Service<
                    Request,
                    Response = http::Response<InFlightBody<Body>>,
                    Error = Infallible,
                > + Clone
                + Send
                + Sync
                + 'static,
            S::Future: Send + 'static,
        {
            BoxCloneSyncService::new(service.map_response(|response| response.map(Body::new)))
        }
        match &shape.key {
            KeySpec::Ip => boxed(
                layer
                    .with_key(ClientIp::new(self.config.trusted_proxies.iter().copied()))
                    .layer(service),
            ),
            KeySpec::Header(name) => boxed(
                layer
                    .with_key(header_key(name.clone(), self.config))
                    .layer(service),
            ),
            KeySpec::Global => boxed(layer.with_key(GlobalKey).layer(service)),
        }
    }
}

/// The key of a `header:<name>` limit: the header's value, hashed as the store's
/// `hash_header_keys` / `key_secret_env` say.
fn header_key(name: http::HeaderName, config: &Config) -> HeaderKey {
    let key = HeaderKey::from(name);
    match &config.store.header_keys {
        HeaderKeys::Plain => key,
        HeaderKeys::Sha256 => key.hashed(),
        HeaderKeys::Hmac(secret) => key.hashed_with(&secret.0),
    }
}

/// `service` behind `layer`, counting after the response when the route says so
/// (`count_when`, `cost_header`).
fn wrap<K>(
    layer: RateLimitLayer<K>,
    after: Option<&CountAfter>,
    service: RouteService,
) -> RouteService
where
    K: tollgate::key::KeyExtractor<axum::body::Body> + Send + Sync + 'static,
{
    // The layer's body holds a request's in-flight permit, when it has one: boxed.
    let boxed = |response: http::Response<_>| response.map(axum::body::Body::new);
    match after {
        None => BoxCloneSyncService::new(layer.layer(service).map_response(boxed)),
        Some(after) => {
            let after = after.clone();
            let layer = layer.with_late_cost(move |response: &Response| after.cost(response));
            BoxCloneSyncService::new(layer.layer(service).map_response(boxed))
        }
    }
}

/// The limits grouped by key, groups ordered ip, headers (in config order), global.
fn key_groups(limits: &[RouteLimit]) -> Vec<(KeySpec, Vec<RouteLimit>)> {
    let mut groups: Vec<(KeySpec, Vec<RouteLimit>)> = Vec::new();
    for limit in limits {
        match groups.iter_mut().find(|(key, _)| *key == limit.key) {
            Some((_, group)) => group.push(limit.clone()),
            None => groups.push((limit.key.clone(), vec![limit.clone()])),
        }
    }
    groups.sort_by_key(|(key, _)| match key {
        KeySpec::Ip => 0,
        KeySpec::Header(_) => 1,
        KeySpec::Global => 2,
    });
    groups
}

#[cfg(test)]
mod tests {
    use super::*;
    use tollgate::Limit;

    #[test]
    fn limits_are_grouped_by_key_ip_first_global_last() {
        let limit = |n| Limit::fixed_window(n, Duration::from_secs(1)).unwrap();
        let header = KeySpec::Header(http::HeaderName::from_static("x-api-key"));
        let limits = vec![
            RouteLimit {
                key: KeySpec::Global,
                limit: limit(1),
                shadow: false,
            },
            RouteLimit {
                key: header.clone(),
                limit: limit(2),
                shadow: false,
            },
            RouteLimit {
                key: KeySpec::Ip,
                limit: limit(3),
                shadow: false,
            },
            RouteLimit {
                key: KeySpec::Global,
                limit: limit(4),
                shadow: false,
            },
        ];
        let groups = key_groups(&limits);
        let shape: Vec<_> = groups.iter().map(|(k, l)| (k.clone(), l.len())).collect();
        assert_eq!(
            shape,
            vec![(KeySpec::Ip, 1), (header, 1), (KeySpec::Global, 2)]
        );
    }
}
