//! Plans (limits chosen per request) on memory, Redis and a cluster: each plan decides
//! under its own limits and keeps its own state (or shares it, when asked), all-or-nothing
//! in one store call; fields and metrics name the plan; requests without a plan, with an
//! unknown one or whose lookup fails are limited by the default plan (or the layer's own
//! limits), never let through unlimited; lookups are cached per key for their TTL; plans
//! change at run time. Real HTTP (axum) and a real tonic client at the end.
//!
//! Time is frozen: every store and lookup cache reads a `ManualClock`, 800 s into an hour.

#![cfg(all(feature = "redis", feature = "metrics"))]

use tollgate_test_support as support;

use std::{
    collections::HashMap,
    convert::Infallible,
    future::Future,
    net::SocketAddr,
    sync::{
        Arc, Mutex,
        atomic::{AtomicUsize, Ordering},
    },
    time::Duration,
};

use http::{HeaderName, Request, Response, StatusCode};
use metrics_exporter_prometheus::{PrometheusBuilder, PrometheusRecorder};
use support::RedisServer;
use tollgate::{
    Limit, OnChange, RateLimitLayer,
    clock::ManualClock,
    key::HeaderKey,
    plan::{Plan, PlanLookup, Plans},
    store::{MemoryStore, RedisStore, Store},
};
use tower::{Layer, Service, ServiceExt, service_fn};

const HOUR: Duration = Duration::from_secs(3600);
/// The frozen time: 800 s into an hour (an hour window resets in `t=2800`).
const NOW_MS: u64 = 1_700_000_000_000;

const OK: StatusCode = StatusCode::OK;
const LIMITED: StatusCode = StatusCode::TOO_MANY_REQUESTS;

fn hourly(name: &str, q: u32) -> Limit {
    Limit::fixed_window(q, HOUR)
        .unwrap()
        .with_name(name)
        .unwrap()
}

fn per_minute(name: &str, q: u32) -> Limit {
    Limit::fixed_window(q, Duration::from_secs(60))
        .unwrap()
        .with_name(name)
        .unwrap()
}

async fn hello(_request: Request<()>) -> Result<Response<&'static str>, Infallible> {
    Ok(Response::new("ok"))
}

/// What one request got: its status and its `RateLimit-Policy` and `RateLimit` fields.
#[derive(Debug, PartialEq, Eq)]
struct Seen {
    status: StatusCode,
    policy: Option<String>,
    fields: Option<String>,
}

fn seen<B>(response: &Response<B>) -> Seen {
    let field = |name: &str| {
        response
            .headers()
            .get(name)
            .map(|v| v.to_str().unwrap().to_owned())
    };
    Seen {
        status: response.status(),
        policy: field("ratelimit-policy"),
        fields: field("ratelimit"),
    }
}

async fn send<S, B>(service: &mut S, key: &str, plan: Option<&str>) -> Seen
where
    S: Service<Request<()>, Response = Response<B>, Error = Infallible>,
{
    let mut request = Request::builder().header("x-key", key);
    if let Some(plan) = plan {
        request = request.header("x-plan", plan);
    }
    let response = service
        .ready()
        .await
        .unwrap()
        .call(request.body(()).unwrap())
        .await
        .unwrap();
    seen(&response)
}

/// The status only.
async fn status<S, B>(service: &mut S, key: &str, plan: Option<&str>) -> StatusCode
where
    S: Service<Request<()>, Response = Response<B>, Error = Infallible>,
{
    send(service, key, plan).await.status
}

/// free: 2 an hour; paid: 5 an hour and 3 a minute; internal: unlimited; trial: as free;
/// the default is
/// free; the plan is the value of `x-plan`.
fn plans() -> Plans {
    Plans::new([
        Plan::new("free", [hourly("hourly", 2)]).unwrap(),
        Plan::new("paid", [hourly("hourly", 5), per_minute("burst", 3)]).unwrap(),
        Plan::unlimited("internal").unwrap(),
        // The same limit as free's, with a state of its own.
        Plan::new("trial", [hourly("hourly", 2)]).unwrap(),
    ])
    .unwrap()
    .with_default("free")
    .unwrap()
    .with_header(HeaderName::from_static("x-plan"))
}

/// A layer on `store` keyed by `x-key`, with 1 an hour of its own. A generous store
/// timeout: with the default 100 ms a loaded machine can fail open and let more through.
fn layer(store: &Arc<dyn Store>) -> RateLimitLayer<HeaderKey, u32> {
    RateLimitLayer::new(hourly("layer", 1))
        .with_key(HeaderKey::new("x-key").unwrap())
        .with_store(store.clone())
        .with_timeout(Some(Duration::from_secs(10)))
}

/// The count of `tollgate_plan_requests_total` with `plan` and `outcome` on `route`.
fn plan_count(recorder: &PrometheusRecorder, route: &str, plan: &str, outcome: &str) -> u64 {
    let labels = [
        format!(r#"route="{route}""#),
        format!(r#"plan="{plan}""#),
        format!(r#"outcome="{outcome}""#),
    ];
    let page = recorder.handle().render();
    page.lines()
        .find(|line| {
            line.starts_with("tollgate_plan_requests_total{")
                && labels.iter().all(|l| line.contains(l.as_str()))
        })
        .map_or(0, |line| line.rsplit(' ').next().unwrap().parse().unwrap())
}

/// The layer's own count of `outcome` (all plans together).
fn count(recorder: &PrometheusRecorder, route: &str, outcome: &str) -> u64 {
    let labels = format!(r#"route="{route}",outcome="{outcome}""#);
    let page = recorder.handle().render();
    page.lines()
        .find(|line| line.starts_with("tollgate_requests_total{") && line.contains(&labels))
        .map_or(0, |line| line.rsplit(' ').next().unwrap().parse().unwrap())
}

/// Runs `test` on a current-thread runtime under a recorder of its own.
fn with_metrics<F: Future<Output = ()>>(test: impl FnOnce() -> F) -> PrometheusRecorder {
    let recorder = PrometheusBuilder::new().build_recorder();
    let runtime = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap();
    metrics::with_local_recorder(&recorder, || runtime.block_on(test()));
    recorder
}

fn fields(policy: &str, fields: &str) -> (Option<String>, Option<String>) {
    (Some(policy.to_owned()), Some(fields.to_owned()))
}

/// The whole scenario on one store whose clock is `clock`.
async fn scenario(store: impl Store, clock: ManualClock) {
    let store: Arc<dyn Store> = Arc::new(store);
    let mut service = layer(&store)
        .with_plans(plans())
        .with_name("plans")
        .layer(service_fn(hello));

    // free: 2, then 429, with the plan's policy named.
    let free = r#""free.hourly";q=2;w=3600"#;
    for remaining in [1, 0] {
        let got = send(&mut service, "a", Some("free")).await;
        assert_eq!(got.status, OK);
        assert_eq!(
            (got.policy, got.fields),
            fields(free, &format!(r#""free.hourly";r={remaining};t=2800"#))
        );
    }
    let got = send(&mut service, "a", Some("free")).await;
    assert_eq!(got.status, LIMITED);
    assert_eq!(
        (got.policy, got.fields),
        fields(free, r#""free.hourly";r=0;t=2800"#)
    );

    // trial has free's very limit, and a state of its own.
    let got = send(&mut service, "a", Some("trial")).await;
    assert_eq!(
        (got.status, got.fields),
        (OK, Some(r#""trial.hourly";r=1;t=2800"#.to_owned()))
    );

    // The same client moves to paid: a full budget of its own (the state is the plan's).
    let paid = r#""paid.hourly";q=5;w=3600, "paid.burst";q=3;w=60"#;
    let got = send(&mut service, "a", Some("paid")).await;
    assert_eq!(
        (got.status, got.policy, got.fields),
        (
            OK,
            Some(paid.to_owned()),
            Some(r#""paid.hourly";r=4;t=2800, "paid.burst";r=2;t=40"#.to_owned())
        )
    );
    assert_eq!(status(&mut service, "a", Some("paid")).await, OK);
    assert_eq!(status(&mut service, "a", Some("paid")).await, OK);
    // The burst limit is spent: all-or-nothing, the hourly one counts nothing for it.
    for _ in 0..3 {
        assert_eq!(status(&mut service, "a", Some("paid")).await, LIMITED);
    }
    // A minute later (the burst window is aligned: 40 s left of it).
    clock.advance(Duration::from_secs(40));
    let got = send(&mut service, "a", Some("paid")).await;
    assert_eq!(
        (got.status, got.fields),
        (
            OK,
            Some(r#""paid.hourly";r=1;t=2760, "paid.burst";r=2;t=60"#.to_owned())
        )
    );
    // Back to free: the spent free budget is still spent.
    assert_eq!(status(&mut service, "a", Some("free")).await, LIMITED);

    // No plan, or an unknown one: the default plan (free), never unlimited.
    assert_eq!(status(&mut service, "b", None).await, OK);
    assert_eq!(status(&mut service, "b", Some("gold")).await, OK);
    assert_eq!(status(&mut service, "b", None).await, LIMITED);
    assert_eq!(status(&mut service, "b", Some("free")).await, LIMITED);

    // internal: never counted, no fields.
    for _ in 0..10 {
        let got = send(&mut service, "a", Some("internal")).await;
        assert_eq!((got.status, got.policy, got.fields), (OK, None, None));
    }

    // Plans that share their state: one named, carried-over limit, 2 in trial and 4 in
    // pro; a client moving up keeps what it spent.
    let shared = |plan: &str, q| {
        Plan::new(
            plan,
            [hourly("shared", q)
                .with_on_change(OnChange::CarryOver)
                .unwrap()],
        )
        .unwrap()
        .with_shared_state(true)
    };
    let sharing = Plans::new([shared("trial", 2), shared("pro", 4)])
        .unwrap()
        .with_header(HeaderName::from_static("x-plan"));
    let mut service = layer(&store)
        .with_plans(sharing)
        .with_name("sharing")
        .layer(service_fn(hello));
    assert_eq!(status(&mut service, "c", Some("trial")).await, OK);
    assert_eq!(status(&mut service, "c", Some("trial")).await, OK);
    assert_eq!(status(&mut service, "c", Some("trial")).await, LIMITED);
    let got = send(&mut service, "c", Some("pro")).await;
    assert_eq!(
        (got.status, got.fields),
        (OK, Some(r#""pro.shared";r=1;t=2760"#.to_owned()))
    );
    // No plan and no default plan: the layer's own limit (1 an hour).
    assert_eq!(status(&mut service, "d", None).await, OK);
    assert_eq!(status(&mut service, "d", Some("nope")).await, LIMITED);
}

fn assert_counts(recorder: &PrometheusRecorder) {
    assert_eq!(plan_count(recorder, "plans", "free", "allowed"), 4);
    assert_eq!(plan_count(recorder, "plans", "free", "denied"), 4);
    assert_eq!(plan_count(recorder, "plans", "paid", "allowed"), 4);
    assert_eq!(plan_count(recorder, "plans", "paid", "denied"), 3);
    assert_eq!(plan_count(recorder, "plans", "internal", "allowed"), 10);
    // The layer's own counter still counts every request, whatever its plan.
    assert_eq!(plan_count(recorder, "plans", "trial", "allowed"), 1);
    assert_eq!(count(recorder, "plans", "allowed"), 19);
    assert_eq!(count(recorder, "plans", "denied"), 7);
    // Requests under the layer's own limits are no plan's.
    assert_eq!(count(recorder, "sharing", "allowed"), 4);
    assert_eq!(plan_count(recorder, "sharing", "trial", "allowed"), 2);
    assert_eq!(plan_count(recorder, "sharing", "pro", "allowed"), 1);
}

#[test]
fn memory_each_plan_decides_under_its_own_limits_and_state() {
    let clock = ManualClock::new(NOW_MS);
    let store = MemoryStore::new().with_clock(clock.clone());
    assert_counts(&with_metrics(|| scenario(store, clock)));
}

#[test]
fn redis_each_plan_decides_under_its_own_limits_and_state() {
    let server = RedisServer::start();
    let recorder = with_metrics(|| async {
        let clock = ManualClock::new(NOW_MS);
        let store = RedisStore::connect(server.url())
            .await
            .unwrap()
            .with_clock(clock.clone());
        scenario(store, clock).await;
    });
    assert_counts(&recorder);
    // The plans' state is in keys of their own, which expire like any other.
    let keys = server.cli(&["KEYS", "*@paid:*"]).unwrap();
    assert_eq!(keys.lines().count(), 2, "{keys}");
    support::assert_every_key_expires(&server);
}

#[cfg(feature = "cluster")]
#[test]
fn cluster_each_plan_decides_under_its_own_limits_and_state() {
    let cluster = support::cluster::RedisCluster::start();
    let recorder = with_metrics(|| async {
        let clock = ManualClock::new(NOW_MS);
        let store = RedisStore::connect(tollgate::store::RedisTarget::cluster(&cluster.urls()))
            .await
            .unwrap()
            .with_clock(clock.clone());
        scenario(store, clock).await;
    });
    assert_counts(&recorder);
    assert!(cluster.assert_every_key_expires() > 0);
}

/// A plan's limits are decided together in one script call, as a layer's are.
#[test]
fn redis_a_plan_with_two_limits_is_one_script_call() {
    let server = RedisServer::start();
    let runtime = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap();
    runtime.block_on(async {
        let store: Arc<dyn Store> = Arc::new(
            RedisStore::connect(server.url())
                .await
                .unwrap()
                .with_clock(ManualClock::new(NOW_MS))
                .with_block_cache(None),
        );
        let mut service = layer(&store).with_plans(plans()).layer(service_fn(hello));
        // Loads the script.
        assert_eq!(status(&mut service, "a", Some("paid")).await, OK);
        let before = server.script_calls();
        for _ in 0..2 {
            assert_eq!(status(&mut service, "a", Some("paid")).await, OK);
        }
        assert_eq!(status(&mut service, "a", Some("paid")).await, LIMITED);
        assert_eq!(server.script_calls() - before, 3);
        // An unlimited plan never asks the store.
        assert_eq!(status(&mut service, "a", Some("internal")).await, OK);
        assert_eq!(server.script_calls() - before, 3);
    });
}

/// A plan lookup with a database of its own: key -> plan, counting its queries, failing
/// on request.
#[derive(Clone, Default)]
struct Database {
    plans: Arc<Mutex<HashMap<String, String>>>,
    queries: Arc<AtomicUsize>,
    down: Arc<std::sync::atomic::AtomicBool>,
}

impl Database {
    fn set(&self, key: &str, plan: &str) {
        self.plans
            .lock()
            .unwrap()
            .insert(format!("header:x-key|{key}"), plan.to_owned());
    }

    fn queries(&self) -> usize {
        self.queries.load(Ordering::SeqCst)
    }

    fn lookup(&self, clock: &ManualClock) -> PlanLookup {
        let db = self.clone();
        PlanLookup::new(move |key: tollgate::key::Key| {
            let db = db.clone();
            async move {
                // A real wait, so that the request waits for the lookup.
                tokio::task::yield_now().await;
                db.queries.fetch_add(1, Ordering::SeqCst);
                if db.down.load(Ordering::SeqCst) {
                    return Err(std::io::Error::other("database down"));
                }
                Ok(db.plans.lock().unwrap().get(key.as_str()).cloned())
            }
        })
        .with_ttl(Duration::from_secs(30))
        .with_clock(clock.clone())
    }
}

/// The async lookup: answers are cached per key for the TTL (a changed plan applies when
/// it runs out), a failed lookup gives the default plan and is not cached.
async fn lookup_scenario(store: impl Store, clock: ManualClock) {
    let store: Arc<dyn Store> = Arc::new(store);
    let db = Database::default();
    db.set("a", "paid");
    let plans = Plans::new([
        Plan::new("free", [hourly("hourly", 1)]).unwrap(),
        Plan::new("paid", [hourly("hourly", 100)]).unwrap(),
    ])
    .unwrap()
    .with_default("free")
    .unwrap()
    .with_lookup(db.lookup(&clock));
    let mut service = layer(&store).with_plans(plans).layer(service_fn(hello));

    let got = send(&mut service, "a", None).await;
    assert_eq!(
        (got.status, got.fields),
        (OK, Some(r#""paid.hourly";r=99;t=2800"#.to_owned()))
    );
    assert_eq!(db.queries(), 1);
    for _ in 0..5 {
        assert_eq!(status(&mut service, "a", None).await, OK);
    }
    assert_eq!(db.queries(), 1, "answered from the cache");

    // A key the database does not know: the default plan, cached too.
    assert_eq!(status(&mut service, "b", None).await, OK);
    assert_eq!(status(&mut service, "b", None).await, LIMITED);
    assert_eq!(db.queries(), 2);

    // The plan changes in the database: it applies once the cached answer is 30 s old.
    db.set("a", "free");
    clock.advance(Duration::from_secs(29));
    assert_eq!(status(&mut service, "a", None).await, OK);
    assert_eq!(db.queries(), 2);
    clock.advance(Duration::from_secs(1));
    let got = send(&mut service, "a", None).await;
    assert_eq!(
        (got.status, got.fields),
        (OK, Some(r#""free.hourly";r=0;t=2770"#.to_owned()))
    );
    assert_eq!(db.queries(), 3);
    assert_eq!(status(&mut service, "a", None).await, LIMITED);

    // The database fails: the default plan (limited, not unlimited), and every request
    // asks again, so the real plan is back as soon as the database is.
    db.set("c", "paid");
    db.down.store(true, Ordering::SeqCst);
    assert_eq!(status(&mut service, "c", None).await, OK);
    assert_eq!(status(&mut service, "c", None).await, LIMITED);
    assert_eq!(db.queries(), 5);
    db.down.store(false, Ordering::SeqCst);
    let got = send(&mut service, "c", None).await;
    assert_eq!(
        (got.status, got.fields),
        (OK, Some(r#""paid.hourly";r=99;t=2770"#.to_owned()))
    );
    assert_eq!(db.queries(), 6);

    // Requests for a cold key that arrive together wait for one lookup.
    db.set("d", "paid");
    let calls = (0..5).map(|_| {
        let request = Request::builder().header("x-key", "d").body(()).unwrap();
        service.clone().oneshot(request)
    });
    let responses = futures_util::future::join_all(calls).await;
    let remaining: Vec<String> = responses
        .into_iter()
        .map(|response| seen(&response.unwrap()).fields.unwrap())
        .collect();
    assert_eq!(db.queries(), 7, "one lookup for five requests");
    for r in 95..100 {
        let fields = format!(r#""paid.hourly";r={r};t=2770"#);
        assert!(remaining.contains(&fields), "{remaining:?}");
    }
}

#[tokio::test]
async fn memory_plan_lookups_are_cached_per_key_for_their_ttl() {
    let clock = ManualClock::new(NOW_MS);
    lookup_scenario(MemoryStore::new().with_clock(clock.clone()), clock).await;
}

#[tokio::test]
async fn redis_plan_lookups_are_cached_per_key_for_their_ttl() {
    let server = RedisServer::start();
    let clock = ManualClock::new(NOW_MS);
    let store = RedisStore::connect(server.url())
        .await
        .unwrap()
        .with_clock(clock.clone());
    lookup_scenario(store, clock).await;
}

/// A sync resolver sees the request's extensions (what an auth layer in front leaves)
/// and its key.
#[tokio::test]
async fn a_sync_resolver_reads_an_extension_or_the_key() {
    #[derive(Clone)]
    struct Claims {
        plan: String,
    }
    let store: Arc<dyn Store> = Arc::new(MemoryStore::new().with_clock(ManualClock::new(NOW_MS)));
    let plans = Plans::new([
        Plan::new("free", [hourly("hourly", 1)]).unwrap(),
        Plan::unlimited("staff").unwrap(),
    ])
    .unwrap()
    .with_default("free")
    .unwrap()
    .with_resolver(|request| {
        if request.key().as_str().ends_with("|root") {
            return Some("staff");
        }
        request
            .extensions()
            .get::<Claims>()
            .map(|claims| claims.plan.as_str())
    });
    let mut service = layer(&store).with_plans(plans).layer(service_fn(hello));
    let with_claims = |key: &str, plan: &str| {
        let mut request = Request::builder().header("x-key", key).body(()).unwrap();
        request.extensions_mut().insert(Claims {
            plan: plan.to_owned(),
        });
        request
    };
    for _ in 0..3 {
        let request = with_claims("a", "staff");
        let response = service.ready().await.unwrap().call(request).await.unwrap();
        assert_eq!(response.status(), OK);
    }
    for expected in [OK, LIMITED] {
        let request = with_claims("a", "free");
        let response = service.ready().await.unwrap().call(request).await.unwrap();
        assert_eq!(response.status(), expected);
    }
    for _ in 0..3 {
        assert_eq!(status(&mut service, "root", None).await, OK);
    }
}

/// Plans come and go with the rules handle: a layer without plans gets them, then loses
/// them, and each plan's state stays through the changes.
#[tokio::test]
async fn the_rules_handle_changes_plans_at_run_time() {
    let store: Arc<dyn Store> = Arc::new(MemoryStore::new().with_clock(ManualClock::new(NOW_MS)));
    let layer = layer(&store);
    let handle = layer.rules_handle();
    let mut service = layer.layer(service_fn(hello));
    assert_eq!(status(&mut service, "a", Some("internal")).await, OK);
    assert_eq!(status(&mut service, "a", Some("internal")).await, LIMITED);

    handle.set(handle.rules().with_plans(plans()));
    assert!(handle.rules().plans().is_some());
    for _ in 0..5 {
        assert_eq!(status(&mut service, "a", Some("internal")).await, OK);
    }
    assert_eq!(status(&mut service, "a", Some("free")).await, OK);

    handle.set(handle.rules().without_plans());
    assert_eq!(status(&mut service, "a", Some("internal")).await, LIMITED);

    handle.set(handle.rules().with_plans(plans()));
    assert_eq!(status(&mut service, "a", Some("free")).await, OK);
    assert_eq!(status(&mut service, "a", Some("free")).await, LIMITED);
}

async fn serve(app: axum::Router) -> SocketAddr {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    tokio::spawn(async move { axum::serve(listener, app).await.unwrap() });
    addr
}

/// An axum app over real HTTP, on Redis: the plan from a header, then from a lookup.
#[tokio::test]
async fn axum_over_http_on_redis() {
    let server = RedisServer::start();
    let store: Arc<dyn Store> = Arc::new(
        RedisStore::connect(server.url())
            .await
            .unwrap()
            .with_clock(ManualClock::new(NOW_MS)),
    );
    let by_header = layer(&store).with_plans(plans());
    let clock = ManualClock::new(NOW_MS);
    let db = Database::default();
    db.set("vip", "paid");
    let by_lookup = layer(&store).with_plans(plans().with_lookup(db.lookup(&clock)));
    let app = axum::Router::new()
        .route("/header", axum::routing::get(|| async { "ok" }))
        .layer(by_header)
        .merge(
            axum::Router::new()
                .route("/lookup", axum::routing::get(|| async { "ok" }))
                .layer(by_lookup),
        );
    let addr = serve(app).await;
    let client = hyper_util::client::legacy::Client::builder(hyper_util::rt::TokioExecutor::new())
        .build_http::<http_body_util::Empty<bytes::Bytes>>();
    let get = |path: &str, key: &str, plan: Option<&str>| {
        let mut request = Request::get(format!("http://{addr}{path}")).header("x-key", key);
        if let Some(plan) = plan {
            request = request.header("x-plan", plan);
        }
        let request = request.body(http_body_util::Empty::new()).unwrap();
        let client = client.clone();
        async move { seen(&client.request(request).await.unwrap()) }
    };
    let got = get("/header", "h", Some("paid")).await;
    assert_eq!(
        (got.status, got.fields),
        (
            OK,
            Some(r#""paid.hourly";r=4;t=2800, "paid.burst";r=2;t=40"#.to_owned())
        )
    );
    assert_eq!(get("/header", "h", None).await.status, OK);
    assert_eq!(get("/header", "h", None).await.status, OK);
    let got = get("/header", "h", Some("free")).await;
    assert_eq!(
        (got.status, got.fields),
        (LIMITED, Some(r#""free.hourly";r=0;t=2800"#.to_owned()))
    );
    let got = get("/header", "h", Some("internal")).await;
    assert_eq!((got.status, got.fields), (OK, None));

    // The lookup ignores the header: a client cannot pick its own plan there.
    for _ in 0..2 {
        assert_eq!(get("/lookup", "other", Some("internal")).await.status, OK);
    }
    assert_eq!(
        get("/lookup", "other", Some("internal")).await.status,
        LIMITED
    );
    for _ in 0..3 {
        assert_eq!(get("/lookup", "vip", None).await.status, OK);
    }
    assert_eq!(db.queries(), 2);
}

/// A real tonic client: the plan comes in the call's metadata, the fields name it.
#[cfg(feature = "tonic")]
#[tokio::test]
async fn a_tonic_client_gets_its_plans_fields() {
    use tonic::transport::{Channel, Server, server::TcpIncoming};
    use tonic_health::pb::{HealthCheckRequest, health_client::HealthClient};

    let store: Arc<dyn Store> = Arc::new(MemoryStore::new().with_clock(ManualClock::new(NOW_MS)));
    let incoming = TcpIncoming::bind("127.0.0.1:0".parse().unwrap()).unwrap();
    let addr: SocketAddr = incoming.local_addr().unwrap();
    let (_reporter, health) = tonic_health::server::health_reporter();
    let router = Server::builder()
        .layer(layer(&store).with_plans(plans()))
        .add_service(health);
    tokio::spawn(router.serve_with_incoming(incoming));
    let channel = Channel::from_shared(format!("http://{addr}"))
        .unwrap()
        .connect()
        .await
        .unwrap();
    let mut client = HealthClient::new(channel);
    let call = |plan: &str| {
        let mut request = tonic::Request::new(HealthCheckRequest::default());
        request.metadata_mut().insert("x-key", "g".parse().unwrap());
        request
            .metadata_mut()
            .insert("x-plan", plan.parse().unwrap());
        request
    };
    let response = client.check(call("free")).await.unwrap();
    assert_eq!(
        response.metadata().get("ratelimit").unwrap(),
        r#""free.hourly";r=1;t=2800"#
    );
    let response = client.check(call("internal")).await.unwrap();
    assert!(response.metadata().get("ratelimit").is_none());
    client.check(call("free")).await.unwrap();
    let status = client.check(call("free")).await.unwrap_err();
    assert_eq!(status.code(), tonic::Code::ResourceExhausted);
    assert_eq!(
        status.metadata().get("ratelimit-policy").unwrap(),
        r#""free.hourly";q=2;w=3600"#
    );
}

/// A hostile plan header (bytes that are not text, a huge value) is no plan: the default
/// plan, no panic.
#[tokio::test]
async fn a_hostile_plan_header_gets_the_default_plan() {
    let store: Arc<dyn Store> = Arc::new(MemoryStore::new().with_clock(ManualClock::new(NOW_MS)));
    let mut service = layer(&store).with_plans(plans()).layer(service_fn(hello));
    let long = "internal".repeat(10_000);
    let values = [
        http::HeaderValue::from_bytes(b"intern\xffal").unwrap(),
        http::HeaderValue::from_str(&long).unwrap(),
    ];
    let mut statuses = Vec::new();
    for value in values.iter().cycle().take(3) {
        let mut request = Request::builder().header("x-key", "h").body(()).unwrap();
        request.headers_mut().insert("x-plan", value.clone());
        let response = service.ready().await.unwrap().call(request).await.unwrap();
        statuses.push((response.status(), seen(&response).policy));
    }
    let free = Some(r#""free.hourly";q=2;w=3600"#.to_owned());
    assert_eq!(
        statuses,
        [(OK, free.clone()), (OK, free.clone()), (LIMITED, free)]
    );
}
