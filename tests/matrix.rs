//! The composition matrix: every pair of the layer's features on one layer, on the memory
//! store, on real Redis, and on a Redis Cluster where the pair touches how keys route.
//!
//! Each feature has a probe: the behaviour that shows it is on (plans: each plan's own
//! limit; shadow: a shadow limit counts and never rejects; `count_when`: only failures
//! count; late cost: the response's cost is charged; `max_wait`: a request over a token
//! bucket is reserved and waits instead of a 429; lockout: a breach blocks for the
//! lockout, not the window; leases: counts stay exact with quota held by the node; a rules
//! swap while 8 tasks send requests: the new limits hold; an in-flight limit: a third
//! request of a key is denied while two are held in the handler, and the permits come
//! back; the adaptive stage: with its limit held by requests in the handler, the next
//! request is shed 503 before the store call, spending nothing, and admitted again once
//! they end; failure policies: what a request
//! gets while the store is down, and with the local fallback every other probe passes on
//! the fallback). A cell builds one layer with both features and runs both probes, each
//! aware of the other (under plans a probe counts against its plan's limit, under
//! `count_when` only failed requests count, under `max_wait` one more request is reserved,
//! under a swap the new limits apply), so that a feature the other one drops fails the
//! cell. Cells that are not pairs (two resolvers of one `Plans`, two failure policies) or
//! are refused when built (two count-after rules: a compile error) are listed with why.
//!
//! The stores' clocks are frozen, so windows never roll over and a wait can only end in
//! an allowed request when it was reserved.

#![cfg(feature = "redis")]

use tollgate_test_support as support;

use std::{
    collections::BTreeMap,
    convert::Infallible,
    sync::{
        Arc,
        atomic::{AtomicBool, AtomicUsize, Ordering},
    },
    time::{Duration, Instant},
};

use axum::body::Body;
use http::{HeaderName, Request, Response, StatusCode};
use tokio::sync::Semaphore;
use tollgate::{
    ConfigError, FailurePolicy, InFlightLimit, Limit, Limiter, RateLimitLayer,
    adaptive::{Adaptive, AdaptiveHandle, AdaptiveLimit, Aimd},
    clock::ManualClock,
    key::{HeaderKey, Key, KeyExtractor},
    plan::{Plan, PlanLookup, Plans},
    rules::RulesHandle,
    store::{LeaseConfig, MemoryStore, RedisStore, Store},
};
use tower::{Layer, Service, ServiceExt, service_fn, util::BoxCloneSyncService};

const HOUR: Duration = Duration::from_secs(3600);
const LOCKOUT: Duration = Duration::from_secs(2 * 3600);
const MAX_WAIT: Duration = Duration::from_millis(150);
/// The in-flight limit's cap.
const IN_FLIGHT: u32 = 2;
/// The adaptive limit (fixed: its bounds are all this).
const ADAPTIVE: u32 = 3;
const NOW_MS: u64 = 1_700_000_000_000;

/// The features of the matrix.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord)]
enum F {
    PlanHeader,
    PlanLookup,
    Shadow,
    CountWhen,
    LateCost,
    MaxWait,
    Lockout,
    Leases,
    InFlight,
    Swap,
    Adaptive,
    Allow,
    Deny,
    Local,
}

const FEATURES: [F; 14] = [
    F::PlanHeader,
    F::PlanLookup,
    F::Shadow,
    F::CountWhen,
    F::LateCost,
    F::MaxWait,
    F::Lockout,
    F::Leases,
    F::InFlight,
    F::Swap,
    F::Adaptive,
    F::Allow,
    F::Deny,
    F::Local,
];

impl F {
    fn is_policy(self) -> bool {
        matches!(self, F::Allow | F::Deny | F::Local)
    }

    fn is_plans(self) -> bool {
        matches!(self, F::PlanHeader | F::PlanLookup)
    }

    /// Changes which keys a request touches (a plan's own state, a block key, a shadow
    /// limit's key, leases): what a cluster must route to one slot.
    fn routes(self) -> bool {
        matches!(
            self,
            F::PlanHeader | F::PlanLookup | F::Shadow | F::Lockout | F::Leases | F::InFlight
        )
    }
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Backend {
    Memory,
    Redis,
    Cluster,
}

/// Why a cell is not run, if it is not.
fn not_run(a: F, b: F, backend: Backend) -> Option<&'static str> {
    if a.is_plans() && b.is_plans() {
        return Some("not a pair: one resolver per `Plans` (header, resolver or lookup)");
    }
    if a.is_policy() && b.is_policy() {
        return Some("not a pair: one failure policy per layer");
    }
    if (a, b) == (F::CountWhen, F::LateCost) {
        return Some(
            "refused at compile time: one count-after rule per layer (`late_cost` covers \
             `count_when`: answer `Some(0)` for a response that does not count)",
        );
    }
    if backend == Backend::Memory && (a == F::Leases || b == F::Leases) {
        return Some("not a pair: leases are a `RedisStore` option");
    }
    if backend == Backend::Cluster && !(a.routes() || b.routes()) {
        return Some("on Redis: the pair does not change key routing");
    }
    if backend == Backend::Cluster && (a.is_policy() || b.is_policy()) {
        return Some("on Redis: a failure policy does not change key routing");
    }
    None
}

/// One cell's settings, and what its probes expect.
#[derive(Clone, Copy, Debug)]
struct Ctx {
    a: F,
    b: F,
    /// The limits of the swap are in force.
    swapped: bool,
    /// The store is down (a failure-policy cell on Redis).
    dead: bool,
}

impl Ctx {
    fn has(&self, f: F) -> bool {
        self.a == f || self.b == f
    }

    fn plans(&self) -> bool {
        self.has(F::PlanHeader) || self.has(F::PlanLookup)
    }

    /// Leases need limits big enough for a lease of one unit (a tenth of the limit).
    fn scale(&self) -> u32 {
        if self.has(F::Leases) { 10 } else { 1 }
    }

    /// The limit of a plan (`pro`) or the layer's own.
    fn q(&self, pro: bool) -> u32 {
        let base = if pro { 5 } else { 3 };
        (base + u32::from(self.swapped)) * self.scale()
    }

    /// The limit a probe's requests count against: the `pro` plan's under plans.
    fn probe_q(&self) -> u32 {
        self.q(self.plans())
    }

    /// Requests allowed after the limit is spent: one reserved under `max_wait` (the next
    /// token is 100 ms away, the one after 200 ms, past the wait), none when a lockout
    /// makes the limit one that does not reserve.
    fn extra(&self) -> u32 {
        u32::from(self.has(F::MaxWait) && !self.has(F::Lockout))
    }

    /// The status of an allowed counted request: a failure under `count_when`.
    fn allowed(&self) -> StatusCode {
        if self.has(F::CountWhen) {
            StatusCode::UNAUTHORIZED
        } else {
            StatusCode::OK
        }
    }

    fn policy(&self) -> Option<F> {
        [self.a, self.b].into_iter().find(|f| f.is_policy())
    }
}

/// A limit of `q`: a token bucket refilling one unit per 100 ms under `max_wait` (so that a
/// request is reserved), else `q` an hour; with the lockout when the cell has one.
fn limit(ctx: &Ctx, q: u32) -> Limit {
    let limit = if ctx.has(F::MaxWait) {
        Limit::token_bucket(q, Duration::from_millis(100 * u64::from(q))).unwrap()
    } else {
        Limit::fixed_window(q, HOUR).unwrap()
    };
    if ctx.has(F::Lockout) {
        limit.with_lockout(LOCKOUT).unwrap()
    } else {
        limit
    }
}

fn shadow_limit(ctx: &Ctx) -> Limit {
    Limit::fixed_window(2 * ctx.scale(), HOUR)
        .unwrap()
        .with_name("shadow")
        .unwrap()
}

fn plans(ctx: &Ctx) -> Option<Plans> {
    if !ctx.plans() {
        return None;
    }
    let plans = Plans::new([
        Plan::new("free", [limit(ctx, ctx.q(false))]).unwrap(),
        Plan::new("pro", [limit(ctx, ctx.q(true))]).unwrap(),
    ])
    .unwrap()
    .with_default("free")
    .unwrap();
    Some(if ctx.has(F::PlanHeader) {
        plans.with_header(HeaderName::from_static("x-plan"))
    } else {
        // By key: keys ending in `-pro` are on the pro plan.
        plans.with_lookup(
            PlanLookup::new(|key: Key| async move {
                let pro = key.as_str().ends_with("-pro");
                Ok::<_, Infallible>(pro.then(|| "pro".to_owned()))
            })
            .with_ttl(Duration::ZERO),
        )
    })
}

type Svc = BoxCloneSyncService<Request<Body>, Response<Body>, Infallible>;

/// Where held requests (`x-hold`) wait in the handler: how many came in, and the permits
/// to go on.
#[derive(Clone)]
struct Gate {
    entered: Arc<AtomicUsize>,
    open: Arc<Semaphore>,
}

impl Gate {
    fn new() -> Self {
        Self {
            entered: Arc::new(AtomicUsize::new(0)),
            open: Arc::new(Semaphore::new(0)),
        }
    }

    /// Waits until `n` held requests are in the handler.
    async fn entered(&self, n: usize) {
        let started = Instant::now();
        while self.entered.load(Ordering::SeqCst) < n {
            assert!(
                started.elapsed() < Duration::from_secs(20),
                "{n} requests held"
            );
            tokio::time::sleep(Duration::from_millis(2)).await;
        }
    }
}

/// A handler answering the status in `x-status` (200 without), echoing `x-tokens`; a
/// request with `x-hold` waits at `gate` first.
fn handler(gate: Gate) -> Svc {
    BoxCloneSyncService::new(service_fn(move |request: Request<Body>| {
        let gate = gate.clone();
        async move {
            if request.headers().contains_key("x-hold") {
                gate.entered.fetch_add(1, Ordering::SeqCst);
                gate.open.acquire().await.unwrap().forget();
            }
            let status = request
                .headers()
                .get("x-status")
                .and_then(|v| v.to_str().ok()?.parse::<u16>().ok())
                .unwrap_or(200);
            let mut response = Response::new(Body::empty());
            *response.status_mut() = StatusCode::from_u16(status).unwrap();
            if let Some(tokens) = request.headers().get("x-tokens") {
                response.headers_mut().insert("x-tokens", tokens.clone());
            }
            Ok::<_, Infallible>(response)
        }
    }))
}

fn key_extractor() -> HeaderKey {
    HeaderKey::new("x-key").unwrap()
}

fn key_of(value: &str) -> Key {
    let request = Request::builder().header("x-key", value).body(()).unwrap();
    key_extractor().extract(&request).unwrap()
}

struct Setup {
    service: Svc,
    gate: Gate,
    rules: RulesHandle,
    limiter: Limiter<HeaderKey>,
    adaptive: Option<AdaptiveHandle>,
}

fn finish<L, RB>(
    layer: L,
    rules: RulesHandle,
    limiter: Limiter<HeaderKey>,
    adaptive: Option<AdaptiveHandle>,
) -> Setup
where
    L: Layer<Svc>,
    L::Service: Service<Request<Body>, Response = Response<RB>, Error = Infallible>
        + Clone
        + Send
        + Sync
        + 'static,
    <L::Service as Service<Request<Body>>>::Future: Send + 'static,
    RB: http_body::Body<Data = axum::body::Bytes> + Send + 'static,
    RB::Error: Into<axum::BoxError>,
{
    let gate = Gate::new();
    Setup {
        service: BoxCloneSyncService::new(
            layer
                .layer(handler(gate.clone()))
                .map_response(|r| r.map(Body::new)),
        ),
        gate,
        rules,
        limiter,
        adaptive,
    }
}

/// The layer with the cell's features, or the [`ConfigError`] it is refused with.
fn build(ctx: &Ctx, store: Arc<dyn Store>) -> Result<Setup, ConfigError> {
    let mut layer = RateLimitLayer::new(limit(ctx, ctx.q(false)))
        .with_key(key_extractor())
        .with_store(store)
        .with_timeout(Some(Duration::from_secs(5)));
    if let Some(plans) = plans(ctx) {
        layer = layer.with_plans(plans);
    }
    if ctx.has(F::Shadow) {
        layer = layer.with_shadow_limit(shadow_limit(ctx));
    }
    if ctx.has(F::MaxWait) {
        layer = layer.with_max_wait(Some(MAX_WAIT));
    }
    if ctx.has(F::InFlight) {
        layer = layer.with_in_flight(InFlightLimit::new(IN_FLIGHT).unwrap());
    }
    if ctx.has(F::Adaptive) {
        let limit = AdaptiveLimit::new(Aimd::new())
            .with_bounds(ADAPTIVE, ADAPTIVE, ADAPTIVE)
            .unwrap();
        layer = layer.with_adaptive(Adaptive::new(limit));
    }
    match ctx.policy() {
        Some(F::Allow) => layer = layer.with_on_store_error(FailurePolicy::Allow),
        Some(F::Deny) => layer = layer.with_on_store_error(FailurePolicy::Deny),
        Some(F::Local) => layer = layer.with_on_store_error(FailurePolicy::Local(memory())),
        _ => {}
    }
    if ctx.has(F::CountWhen) {
        let layer =
            layer.with_count_when(|r: &Response<Body>| r.status() == StatusCode::UNAUTHORIZED);
        layer.validate()?;
        let (rules, limiter) = (layer.rules_handle(), layer.limiter());
        let adaptive = layer.adaptive_handle();
        Ok(finish(layer, rules, limiter, adaptive))
    } else if ctx.has(F::LateCost) {
        let layer = layer.with_late_cost(|r: &Response<Body>| {
            r.headers()
                .get("x-tokens")
                .and_then(|v| v.to_str().ok()?.parse().ok())
        });
        layer.validate()?;
        let (rules, limiter) = (layer.rules_handle(), layer.limiter());
        let adaptive = layer.adaptive_handle();
        Ok(finish(layer, rules, limiter, adaptive))
    } else {
        layer.validate()?;
        let (rules, limiter) = (layer.rules_handle(), layer.limiter());
        let adaptive = layer.adaptive_handle();
        Ok(finish(layer, rules, limiter, adaptive))
    }
}

fn memory() -> MemoryStore {
    MemoryStore::new().with_clock(ManualClock::new(NOW_MS))
}

/// One request: its response.
async fn send(service: &Svc, headers: &[(&str, String)]) -> Response<Body> {
    let mut request = Request::new(Body::empty());
    for (name, value) in headers {
        request.headers_mut().insert(
            HeaderName::from_bytes(name.as_bytes()).unwrap(),
            value.parse().unwrap(),
        );
    }
    tokio::time::timeout(Duration::from_secs(20), service.clone().oneshot(request))
        .await
        .expect("answered")
        .unwrap()
}

/// The headers of a request on `key` that counts: the pro plan under plans (the key ends
/// in `-pro` for the lookup), a failure under `count_when`, a cost of `tokens` under late
/// cost.
fn counted(ctx: &Ctx, key: &str, tokens: u32) -> Vec<(&'static str, String)> {
    let mut headers = vec![("x-key", key.to_owned())];
    if ctx.plans() {
        headers.push(("x-plan", "pro".to_owned()));
    }
    if ctx.has(F::CountWhen) {
        headers.push(("x-status", "401".to_owned()));
    }
    if ctx.has(F::LateCost) {
        headers.push(("x-tokens", tokens.to_string()));
    }
    headers
}

/// A request on `key` that does not count under `count_when` (a success).
fn uncounted(ctx: &Ctx, key: &str) -> Vec<(&'static str, String)> {
    let mut headers = vec![("x-key", key.to_owned())];
    if ctx.plans() {
        headers.push(("x-plan", "pro".to_owned()));
    }
    headers
}

fn retry_after(response: &Response<Body>) -> u64 {
    response
        .headers()
        .get("retry-after")
        .expect("a Retry-After")
        .to_str()
        .unwrap()
        .parse()
        .unwrap()
}

/// Sends `allowed` counted requests on `key`, each allowed, then one more that must be
/// denied: that 429.
async fn spend(ctx: &Ctx, setup: &Setup, key: &str, allowed: u32) -> Response<Body> {
    for i in 0..allowed {
        let response = send(&setup.service, &counted(ctx, key, 1)).await;
        assert_eq!(
            response.status(),
            ctx.allowed(),
            "{key}: request {} of {allowed} allowed",
            i + 1
        );
    }
    let response = send(&setup.service, &counted(ctx, key, 1)).await;
    assert_eq!(
        response.status(),
        StatusCode::TOO_MANY_REQUESTS,
        "{key}: the request after {allowed} is denied"
    );
    response
}

/// The probe's limit, spent: the 429 after it.
async fn exhaust(ctx: &Ctx, setup: &Setup, key: &str) -> Response<Body> {
    spend(ctx, setup, key, ctx.probe_q() + ctx.extra()).await
}

/// The behaviour that shows `feature` is on, given the cell's other feature.
async fn probe(feature: F, ctx: &Ctx, setup: &Setup) {
    let name = format!("{feature:?}").to_lowercase();
    match feature {
        F::PlanHeader | F::PlanLookup => {
            // Each plan has its own limit and its own state.
            let free = format!("{name}-a");
            let mut headers = counted(ctx, &free, 1);
            headers.retain(|(h, _)| *h != "x-plan");
            headers.push(("x-plan", "free".to_owned()));
            for i in 0..ctx.q(false) + ctx.extra() {
                let status = send(&setup.service, &headers).await.status();
                assert_eq!(status, ctx.allowed(), "free plan: request {}", i + 1);
            }
            let status = send(&setup.service, &headers).await.status();
            assert_eq!(status, StatusCode::TOO_MANY_REQUESTS, "free plan spent");
            exhaust(ctx, setup, &format!("{name}-pro")).await;
        }
        F::Shadow => {
            let key = format!("{name}-pro");
            if ctx.has(F::CountWhen) {
                for _ in 0..3 {
                    let status = send(&setup.service, &uncounted(ctx, &key)).await.status();
                    assert_eq!(status, StatusCode::OK);
                }
            }
            let shadow = 2 * ctx.scale();
            if ctx.has(F::CountWhen) && !ctx.dead {
                // The last success's units come back after its response: wait for them.
                let mut seen = None;
                for _ in 0..200 {
                    let now = setup
                        .limiter
                        .peek_shadow(&key_of(&key), shadow)
                        .await
                        .unwrap();
                    if now.is_allowed() {
                        seen = None;
                        break;
                    }
                    seen = Some(now);
                    tokio::time::sleep(Duration::from_millis(10)).await;
                }
                assert!(seen.is_none(), "successes do not count in shadow: {seen:?}");
            }
            // The shadow limit's units are spent, and the enforced limit still allows.
            for _ in 0..shadow {
                let status = send(&setup.service, &counted(ctx, &key, 1)).await.status();
                assert_eq!(status, ctx.allowed());
            }
            if !ctx.dead {
                let seen = setup.limiter.peek_shadow(&key_of(&key), 1).await.unwrap();
                assert!(!seen.is_allowed(), "the shadow limit is spent: {seen:?}");
            }
            let status = send(&setup.service, &counted(ctx, &key, 1)).await.status();
            assert_eq!(status, ctx.allowed(), "a shadow limit never rejects");
            spend(ctx, setup, &key, ctx.probe_q() + ctx.extra() - shadow - 1).await;
        }
        F::CountWhen => {
            let key = format!("{name}-pro");
            for _ in 0..ctx.probe_q() + 2 {
                let status = send(&setup.service, &uncounted(ctx, &key)).await.status();
                assert_eq!(status, StatusCode::OK, "successes do not count");
            }
            exhaust(ctx, setup, &key).await;
        }
        F::LateCost => {
            let key = format!("{name}-pro");
            let status = send(&setup.service, &counted(ctx, &key, ctx.probe_q()))
                .await
                .status();
            assert_eq!(status, StatusCode::OK);
            spend(ctx, setup, &key, ctx.extra()).await;
        }
        F::MaxWait => {
            let key = format!("{name}-pro");
            for _ in 0..ctx.probe_q() {
                let status = send(&setup.service, &counted(ctx, &key, 1)).await.status();
                assert_eq!(status, ctx.allowed());
            }
            let started = Instant::now();
            let response = send(&setup.service, &counted(ctx, &key, 1)).await;
            if ctx.extra() == 1 {
                assert_eq!(response.status(), ctx.allowed(), "reserved");
                let waited = started.elapsed();
                assert!(waited >= Duration::from_millis(90), "waited {waited:?}");
                spend(ctx, setup, &key, 0).await;
            } else {
                assert_eq!(response.status(), StatusCode::TOO_MANY_REQUESTS);
            }
        }
        F::Lockout => {
            let denied = exhaust(ctx, setup, &format!("{name}-pro")).await;
            let seconds = retry_after(&denied);
            assert!(
                seconds > HOUR.as_secs(),
                "the breach blocks for the lockout: Retry-After {seconds}"
            );
        }
        F::Leases => {
            // Hot keys get leases; the count stays exact on one node.
            exhaust(ctx, setup, &format!("{name}-pro")).await;
        }
        F::InFlight => {
            // Two requests held in the handler hold the cap's permits (and spend a unit
            // each): a third is denied, and spends nothing.
            let key = format!("{name}-pro");
            let held: Vec<_> = (0..IN_FLIGHT)
                .map(|_| {
                    let service = setup.service.clone();
                    let mut headers = counted(ctx, &key, 1);
                    headers.push(("x-hold", "1".to_owned()));
                    tokio::spawn(async move { send(&service, &headers).await.status() })
                })
                .collect();
            setup.gate.entered(IN_FLIGHT as usize).await;
            let status = send(&setup.service, &counted(ctx, &key, 1)).await.status();
            assert_eq!(status, StatusCode::TOO_MANY_REQUESTS, "a third in flight");
            setup.gate.open.add_permits(IN_FLIGHT as usize);
            for request in held {
                assert_eq!(request.await.unwrap(), ctx.allowed(), "a held request");
            }
            // The permits come back when the responses end (on Redis, in a call after
            // them): a request is allowed again, and the limit is spent after it.
            let mut status = StatusCode::TOO_MANY_REQUESTS;
            for _ in 0..200 {
                status = send(&setup.service, &counted(ctx, &key, 1)).await.status();
                if status != StatusCode::TOO_MANY_REQUESTS {
                    break;
                }
                tokio::time::sleep(Duration::from_millis(10)).await;
            }
            assert_eq!(status, ctx.allowed(), "the permits came back");
            spend(
                ctx,
                setup,
                &key,
                ctx.probe_q() + ctx.extra() - IN_FLIGHT - 1,
            )
            .await;
        }
        F::Adaptive => {
            // Requests of three keys held in the handler fill the limit: the next one is
            // shed before the store call, and spends nothing.
            let held: Vec<_> = ["a", "b", "c"]
                .into_iter()
                .map(|k| {
                    let service = setup.service.clone();
                    let mut headers = uncounted(ctx, &format!("{name}-{k}-pro"));
                    headers.push(("x-hold", "1".to_owned()));
                    tokio::spawn(async move { send(&service, &headers).await.status() })
                })
                .collect();
            setup.gate.entered(ADAPTIVE as usize).await;
            let handle = setup.adaptive.as_ref().unwrap();
            assert_eq!(handle.snapshot().in_flight, ADAPTIVE);
            let key = format!("{name}-pro");
            let shed = send(&setup.service, &counted(ctx, &key, 1)).await;
            assert_eq!(shed.status(), StatusCode::SERVICE_UNAVAILABLE, "shed");
            assert_eq!(retry_after(&shed), 1);
            setup.gate.open.add_permits(ADAPTIVE as usize);
            for request in held {
                assert_eq!(request.await.unwrap(), StatusCode::OK, "a held request");
            }
            assert_eq!(handle.snapshot().in_flight, 0, "the permits came back");
            // The shed request spent nothing: the key's whole limit is left.
            exhaust(ctx, setup, &key).await;
        }
        F::Swap | F::Allow | F::Deny | F::Local => unreachable!("not a probe of its own"),
    }
}

/// Swaps the rules for ones one unit bigger while 8 tasks send requests: none of them gets
/// anything but an answer of the rules, and the new limits hold.
async fn swap(ctx: &mut Ctx, setup: &Setup) {
    let key = "swap-before-pro";
    if !ctx.dead {
        exhaust(ctx, setup, key).await;
    }
    let stop = Arc::new(AtomicBool::new(false));
    let tasks: Vec<_> = (0..8)
        .map(|task| {
            let (service, stop, ctx) = (setup.service.clone(), stop.clone(), *ctx);
            tokio::spawn(async move {
                let mut seen = Vec::new();
                while !stop.load(Ordering::Relaxed) {
                    let key = format!("swap-load-{task}-pro");
                    seen.push(send(&service, &counted(&ctx, &key, 1)).await.status());
                    // The memory store answers without yielding.
                    tokio::task::yield_now().await;
                }
                seen
            })
        })
        .collect();
    tokio::time::sleep(Duration::from_millis(30)).await;
    let mut swapped = *ctx;
    swapped.swapped = true;
    let mut rules = setup
        .rules
        .rules()
        .with_limits([limit(&swapped, swapped.q(false))])
        .unwrap();
    if let Some(plans) = plans(&swapped) {
        rules = rules.with_plans(plans);
    }
    setup.rules.set(rules);
    tokio::time::sleep(Duration::from_millis(30)).await;
    stop.store(true, Ordering::Relaxed);
    for task in tasks {
        for status in task.await.unwrap() {
            let expected = [
                ctx.allowed(),
                StatusCode::TOO_MANY_REQUESTS,
                StatusCode::SERVICE_UNAVAILABLE,
            ];
            assert!(expected.contains(&status), "during the swap: {status}");
        }
    }
    *ctx = swapped;
    if !ctx.dead {
        exhaust(ctx, setup, "swap-after-pro").await;
    }
}

/// What requests get while the store is down under `policy`.
async fn down(ctx: &Ctx, setup: &Setup, policy: F) {
    let expected = match policy {
        F::Allow => ctx.allowed(),
        F::Deny => StatusCode::SERVICE_UNAVAILABLE,
        _ => unreachable!(),
    };
    for i in 0..2 * ctx.probe_q() + 2 {
        let status = send(&setup.service, &counted(ctx, "down-pro", 1))
            .await
            .status();
        assert_eq!(status, expected, "request {} with the store down", i + 1);
    }
}

/// One cell: the layer with both features, and each feature's probe.
/// The pairs refused when the layer is built, and the names the error must give: none
/// (`max_wait` with an in-flight limit was, until the wait kept its permit).
fn refused(a: F, b: F) -> Option<[&'static str; 2]> {
    let _ = (a, b);
    None
}

/// One cell: the layer with both features, and each feature's probe; or, for a pair that
/// is refused, the refusal. Its verdict.
async fn cell(mut ctx: Ctx, store: Arc<dyn Store>, server: Option<support::RedisServer>) -> String {
    let setup = match (build(&ctx, store), refused(ctx.a, ctx.b)) {
        (Ok(setup), None) => setup,
        (Err(error), Some(names)) => {
            let message = error.to_string();
            for name in names {
                assert!(
                    message.contains(name),
                    "the refusal names {name}: {message}"
                );
            }
            return format!("refused when built: {message}");
        }
        (Ok(_), Some(_)) => panic!("built, though the pair is refused"),
        (Err(error), None) => panic!("refused: {error}"),
    };
    let policy = ctx.policy();
    // A failure policy is seen with the store down.
    let _server = server.map(|mut server| {
        server.kill();
        ctx.dead = true;
        server
    });
    if ctx.has(F::Swap) {
        swap(&mut ctx, &setup).await;
    }
    if ctx.dead && policy != Some(F::Local) {
        down(&ctx, &setup, policy.unwrap()).await;
        return "passes".to_owned();
    }
    for feature in [ctx.a, ctx.b] {
        if feature != F::Swap && !feature.is_policy() {
            probe(feature, &ctx, &setup).await;
        }
    }
    "passes".to_owned()
}

async fn redis_store(url: &str, prefix: &str, ctx: &Ctx) -> RedisStore {
    let store = RedisStore::connect(url)
        .await
        .unwrap()
        .with_prefix(prefix)
        .unwrap()
        .with_clock(ManualClock::new(NOW_MS));
    if ctx.has(F::Leases) {
        store.with_leases(LeaseConfig::new())
    } else {
        store
    }
}

async fn cluster_store(urls: &[String], prefix: &str, ctx: &Ctx) -> RedisStore {
    let store = RedisStore::connect(tollgate::store::RedisTarget::cluster(urls))
        .await
        .unwrap()
        .with_prefix(prefix)
        .unwrap()
        .with_clock(ManualClock::new(NOW_MS));
    if ctx.has(F::Leases) {
        store.with_leases(LeaseConfig::new())
    } else {
        store
    }
}

/// Runs every cell on `backend`, each in a task of its own so that one failing cell does
/// not hide the others; prints the matrix and fails when a cell failed.
async fn matrix(backend: Backend) {
    let shared = match backend {
        Backend::Redis => Some(support::RedisServer::start()),
        _ => None,
    };
    let cluster = match backend {
        Backend::Cluster => Some(support::cluster::RedisCluster::start()),
        _ => None,
    };
    let mut verdicts: BTreeMap<(F, F), String> = BTreeMap::new();
    let mut failed = Vec::new();
    for (i, &a) in FEATURES.iter().enumerate() {
        for &b in &FEATURES[i + 1..] {
            if let Some(why) = not_run(a, b, backend) {
                verdicts.insert((a, b), why.to_owned());
                continue;
            }
            let ctx = Ctx {
                a,
                b,
                swapped: false,
                dead: false,
            };
            let prefix = format!("m{i}{b:?}");
            let (store, server): (Arc<dyn Store>, _) = match backend {
                Backend::Memory => (Arc::new(memory()), None),
                Backend::Redis if ctx.policy().is_some() => {
                    let server = support::RedisServer::start();
                    let store = redis_store(&server.url(), &prefix, &ctx).await;
                    (Arc::new(store), Some(server))
                }
                Backend::Redis => {
                    let url = shared.as_ref().unwrap().url();
                    (Arc::new(redis_store(&url, &prefix, &ctx).await), None)
                }
                Backend::Cluster => {
                    let urls = cluster.as_ref().unwrap().urls();
                    (Arc::new(cluster_store(&urls, &prefix, &ctx).await), None)
                }
            };
            eprintln!("cell {a:?} × {b:?} on {backend:?}");
            let outcome = tokio::spawn(cell(ctx, store, server)).await;
            let verdict = match outcome {
                Ok(verdict) => verdict,
                Err(error) => {
                    failed.push(format!("{a:?} × {b:?}"));
                    let message = error
                        .try_into_panic()
                        .ok()
                        .and_then(|p| {
                            p.downcast_ref::<String>()
                                .cloned()
                                .or_else(|| p.downcast_ref::<&str>().map(|s| s.to_string()))
                        })
                        .unwrap_or_default();
                    format!("FAILS: {message}")
                }
            };
            verdicts.insert((a, b), verdict);
        }
    }
    println!("composition matrix on {backend:?}:");
    for ((a, b), verdict) in &verdicts {
        println!("| {a:?} | {b:?} | {verdict} |");
    }
    assert!(failed.is_empty(), "cells failed on {backend:?}: {failed:?}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_pair_composes_on_memory() {
    matrix(Backend::Memory).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_pair_composes_on_redis() {
    matrix(Backend::Redis).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_pair_that_routes_composes_on_a_cluster() {
    matrix(Backend::Cluster).await;
}
