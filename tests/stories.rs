//! The stories of issue 25, end to end through axum, on the memory store and on real
//! Redis: an LLM-style API in one layer (story 1; through tonic in `tests/story_grpc.rs`),
//! a login endpoint behind a trusted proxy, and a public API whose plans and limits
//! change at run time while requests run.

#![cfg(feature = "redis")]

use tollgate_test_support as support;

use std::{
    net::SocketAddr,
    sync::{
        Arc,
        atomic::{AtomicBool, AtomicUsize, Ordering},
    },
    time::{Duration, Instant},
};

use axum::{
    Router, body::Body, extract::connect_info::MockConnectInfo, http::HeaderMap, routing::post,
};
use http::{HeaderName, Request, Response, StatusCode};
use tollgate::{
    CircuitBreaker, FailurePolicy, Limit, RateLimitLayer,
    clock::ManualClock,
    key::{ClientIp, HeaderKey},
    plan::{Plan, Plans},
    store::{MemoryStore, RedisStore, Store},
};
use tower::ServiceExt;

const MINUTE: Duration = Duration::from_secs(60);
const DAY: Duration = Duration::from_secs(24 * 3600);
const NOW_MS: u64 = 1_700_000_000_000;

async fn redis(url: &str, prefix: &str, clock: &ManualClock) -> RedisStore {
    RedisStore::connect(url)
        .await
        .unwrap()
        .with_prefix(prefix)
        .unwrap()
        .with_clock(clock.clone())
}

async fn send(app: &Router, request: Request<Body>) -> Response<Body> {
    tokio::time::timeout(Duration::from_secs(20), app.clone().oneshot(request))
        .await
        .expect("answered")
        .unwrap()
}

// Story 2: a login endpoint behind a trusted proxy. Only 401s count, 5 a minute per
// client IP, a 15-minute lockout after the breach, fail closed when the store is down.

/// 200 for the password `right`, else 401.
async fn login(headers: HeaderMap) -> StatusCode {
    match headers.get("x-password").map(|v| v.as_bytes()) {
        Some(b"right") => StatusCode::OK,
        _ => StatusCode::UNAUTHORIZED,
    }
}

fn login_app(store: impl Store) -> Router {
    let logins = Limit::fixed_window(5, MINUTE)
        .unwrap()
        .with_lockout(15 * MINUTE)
        .unwrap();
    let layer = RateLimitLayer::new(logins)
        .with_key(ClientIp::new(["10.0.0.0/8".parse().unwrap()]))
        .with_store(store)
        .with_timeout(Some(Duration::from_secs(5)))
        .with_on_store_error(FailurePolicy::Deny)
        .with_count_when(|response: &Response<Body>| response.status() == StatusCode::UNAUTHORIZED);
    // Every request arrives from the proxy at 10.0.0.1, which names the client.
    Router::new()
        .route("/login", post(login))
        .layer(layer)
        .layer(MockConnectInfo(SocketAddr::from(([10, 0, 0, 1], 40_000))))
}

fn attempt(client: &str, password: &str) -> Request<Body> {
    Request::post("/login")
        .header("x-forwarded-for", format!("{client}, 10.0.0.7"))
        .header("x-password", password)
        .body(Body::empty())
        .unwrap()
}

async fn login_story(store: impl Store, clock: &ManualClock) {
    let app = login_app(store);
    let client = "203.0.113.9";
    // Successful logins never count.
    for _ in 0..12 {
        assert_eq!(
            send(&app, attempt(client, "right")).await.status(),
            StatusCode::OK
        );
    }
    // Five failures a minute are allowed; the sixth attempt breaches and starts the lockout,
    // even with the right password.
    for _ in 0..5 {
        let status = send(&app, attempt(client, "wrong")).await.status();
        assert_eq!(status, StatusCode::UNAUTHORIZED);
    }
    let denied = send(&app, attempt(client, "right")).await;
    assert_eq!(denied.status(), StatusCode::TOO_MANY_REQUESTS);
    assert_eq!(denied.headers()["retry-after"], "900");
    // Another client behind the same proxy is its own key.
    let other = send(&app, attempt("198.51.100.4", "wrong")).await.status();
    assert_eq!(other, StatusCode::UNAUTHORIZED);
    // The lockout outlives the window: still blocked 14 minutes on, free after 15.
    clock.advance(14 * MINUTE);
    let status = send(&app, attempt(client, "right")).await.status();
    assert_eq!(status, StatusCode::TOO_MANY_REQUESTS);
    clock.advance(MINUTE);
    assert_eq!(
        send(&app, attempt(client, "right")).await.status(),
        StatusCode::OK
    );
}

#[tokio::test]
async fn login_endpoint_on_memory() {
    let clock = ManualClock::new(NOW_MS);
    login_story(MemoryStore::new().with_clock(clock.clone()), &clock).await;
}

#[tokio::test]
async fn login_endpoint_on_redis_fails_closed_when_redis_is_down() {
    let mut server = support::RedisServer::start();
    let clock = ManualClock::new(NOW_MS);
    let store = redis(&server.url(), "login", &clock).await;
    login_story(store.clone(), &clock).await;
    // Fail closed: with the store down, no login attempt reaches the handler.
    let app = login_app(store);
    server.kill();
    for password in ["right", "wrong"] {
        let status = send(&app, attempt("192.0.2.1", password)).await.status();
        assert_eq!(status, StatusCode::SERVICE_UNAVAILABLE);
    }
}

// Story 3: a public API whose plans and limits change at run time through `RulesHandle`
// while 8 tasks send requests.

/// Version `v` of the plans: free `10v` a minute and `1000v` a day, pro ten times that.
fn plans(v: u32) -> Plans {
    let limits = |per_minute: u32| {
        [
            Limit::fixed_window(per_minute, MINUTE)
                .unwrap()
                .with_name("minute")
                .unwrap(),
            Limit::fixed_window(per_minute * 100, DAY)
                .unwrap()
                .with_name("day")
                .unwrap(),
        ]
    };
    Plans::new([
        Plan::new("free", limits(10 * v)).unwrap(),
        Plan::new("pro", limits(100 * v)).unwrap(),
    ])
    .unwrap()
    .with_default("free")
    .unwrap()
    .with_header(HeaderName::from_static("x-plan"))
}

/// The `q` of each item of a response's `RateLimit-Policy`, in order.
fn quotas(response: &Response<Body>) -> Vec<u32> {
    response
        .headers()
        .get_all("ratelimit-policy")
        .iter()
        .flat_map(|v| v.to_str().unwrap().split(',').map(str::to_owned))
        .map(|item| {
            let q = item.split(';').find_map(|p| p.trim().strip_prefix("q="));
            q.expect("a q parameter").parse().unwrap()
        })
        .collect()
}

async fn runtime_changes(store: impl Store) {
    let layer = RateLimitLayer::new(Limit::fixed_window(1, MINUTE).unwrap())
        .with_key(HeaderKey::new("x-api-key").unwrap())
        .with_store(store)
        .with_timeout(Some(Duration::from_secs(5)))
        .with_plans(plans(1));
    let rules = layer.rules_handle();
    let app = Router::new()
        .route("/", axum::routing::get(|| async { "ok" }))
        .layer(layer);
    let stop = Arc::new(AtomicBool::new(false));
    let tasks: Vec<_> = (0..8)
        .map(|task| {
            let (app, stop) = (app.clone(), stop.clone());
            tokio::spawn(async move {
                let mut seen = Vec::new();
                let mut n = 0u32;
                while !stop.load(Ordering::Relaxed) {
                    let plan = if (task + n).is_multiple_of(2) {
                        "free"
                    } else {
                        "pro"
                    };
                    let request = Request::get("/")
                        .header("x-api-key", format!("key-{task}-{}", n % 3))
                        .header("x-plan", plan)
                        .body(Body::empty())
                        .unwrap();
                    let response = send(&app, request).await;
                    assert_ne!(response.status(), StatusCode::SERVICE_UNAVAILABLE);
                    seen.push((plan, quotas(&response)));
                    n += 1;
                    tokio::task::yield_now().await;
                }
                seen
            })
        })
        .collect();
    for v in 2..=4 {
        tokio::time::sleep(Duration::from_millis(40)).await;
        rules.set(rules.rules().with_plans(plans(v)));
    }
    tokio::time::sleep(Duration::from_millis(40)).await;
    stop.store(true, Ordering::Relaxed);
    let mut versions = [0usize; 5];
    for task in tasks {
        for (plan, quotas) in task.await.unwrap() {
            let base = if plan == "free" { 10 } else { 100 };
            // Both limits of one version, never a mix.
            let v = (1..=4).find(|v| quotas == [base * v, base * v * 100]);
            let v = v.unwrap_or_else(|| panic!("{plan}: {quotas:?} is no version's pair"));
            versions[v as usize] += 1;
        }
    }
    assert!(
        versions[1] > 0 && versions[4] > 0,
        "seen per version: {versions:?}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn runtime_changes_on_memory_give_every_response_one_rule_set() {
    runtime_changes(MemoryStore::new()).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn runtime_changes_on_redis_give_every_response_one_rule_set() {
    let server = support::RedisServer::start();
    let store = RedisStore::connect(server.url()).await.unwrap();
    runtime_changes(store).await;
}

/// A waiting line survives a change of limits: the request waiting in it is answered
/// after its wait, and the line is still full for the next one (a new line would let it
/// wait).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_waiting_line_survives_a_change_of_limits() {
    let bucket = Limit::token_bucket(1, Duration::from_secs(1)).unwrap();
    let layer = RateLimitLayer::new(bucket.clone())
        .with_key(HeaderKey::new("x-api-key").unwrap())
        .with_store(MemoryStore::new().with_clock(ManualClock::new(NOW_MS)))
        .with_max_wait(Some(Duration::from_secs(3)))
        .with_max_waiters(1, 1);
    let rules = layer.rules_handle();
    let app = Router::new()
        .route("/", axum::routing::get(|| async { "ok" }))
        .layer(layer);
    let get = || {
        Request::get("/")
            .header("x-api-key", "a")
            .body(Body::empty())
            .unwrap()
    };
    assert_eq!(send(&app, get()).await.status(), StatusCode::OK);
    let started = Instant::now();
    let waiting = tokio::spawn({
        let app = app.clone();
        async move { send(&app, get()).await.status() }
    });
    tokio::time::sleep(Duration::from_millis(200)).await;
    let hourly = Limit::fixed_window(1000, Duration::from_secs(3600)).unwrap();
    rules.set(rules.rules().with_limits([bucket, hourly]).unwrap());
    // The line holds one request already: the next is answered at once.
    let full = send(&app, get()).await;
    assert_eq!(full.status(), StatusCode::TOO_MANY_REQUESTS);
    assert!(started.elapsed() < Duration::from_millis(900));
    assert_eq!(waiting.await.unwrap(), StatusCode::OK);
    assert!(started.elapsed() >= Duration::from_millis(900));
}

/// An open circuit breaker stays open across a change of limits: with Redis back, the
/// changed layer still answers from its failure policy until the cooldown ends, while a
/// layer without a breaker on the same store is answered by Redis.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_open_breaker_survives_a_change_of_limits() {
    let mut server = support::RedisServer::start();
    let store = RedisStore::connect(server.url()).await.unwrap();
    let limit = Limit::fixed_window(100, MINUTE).unwrap();
    let layer = RateLimitLayer::new(limit.clone())
        .with_key(HeaderKey::new("x-api-key").unwrap())
        .with_store(store.clone())
        .with_timeout(Some(Duration::from_secs(5)))
        .with_on_store_error(FailurePolicy::Deny)
        .with_circuit_breaker(Some(CircuitBreaker::new(2, Duration::from_secs(120))));
    let rules = layer.rules_handle();
    let app = Router::new()
        .route("/", axum::routing::get(|| async { "ok" }))
        .layer(layer);
    let control = Router::new()
        .route("/", axum::routing::get(|| async { "ok" }))
        .layer(
            RateLimitLayer::new(limit)
                .with_key(HeaderKey::new("x-api-key").unwrap())
                .with_store(store)
                .with_timeout(Some(Duration::from_secs(5)))
                .with_on_store_error(FailurePolicy::Deny),
        );
    let get = || {
        Request::get("/")
            .header("x-api-key", "a")
            .body(Body::empty())
            .unwrap()
    };
    assert_eq!(send(&app, get()).await.status(), StatusCode::OK);
    server.kill();
    for _ in 0..3 {
        let status = send(&app, get()).await.status();
        assert_eq!(status, StatusCode::SERVICE_UNAVAILABLE);
    }
    server.restart();
    // Redis answers again (the control layer reconnects).
    let mut back = false;
    for _ in 0..100 {
        if send(&control, get()).await.status() == StatusCode::OK {
            back = true;
            break;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    assert!(back, "Redis came back");
    let changed = Limit::fixed_window(200, MINUTE).unwrap();
    rules.set(rules.rules().with_limits([changed]).unwrap());
    let status = send(&app, get()).await.status();
    assert_eq!(
        status,
        StatusCode::SERVICE_UNAVAILABLE,
        "the breaker is still open"
    );
}

// Story 1: an LLM-style API. Per API key (hashed), a plan from a header (free: 20
// requests a minute and 10 000 tokens a day; pro: 200 and 1 000 000), the token cost read
// from a response header after the response, at most 2 requests in flight per key, up to
// 2 s of waiting instead of 429 for the per-minute limit, a stricter free limit in
// shadow. One layer.

/// The LLM: reports the tokens asked for in `x-want-tokens`; with `x-block`, tells
/// `entered` and waits for a permit of `gate` first. Behind the story's one layer (the
/// guide's example, `src/guide/composition.md`).
fn llm_app(
    store: impl Store,
    gate: Arc<tokio::sync::Semaphore>,
    entered: Arc<AtomicUsize>,
) -> Router {
    let plan = |name: &str, per_minute: u32, per_day: u32| {
        Plan::new(
            name,
            [
                // Requests are counted up front, beside the tokens counted after.
                Limit::token_bucket(per_minute, MINUTE)
                    .unwrap()
                    .with_name("requests")
                    .unwrap()
                    .counted_up_front(),
                Limit::token_bucket(per_day, DAY)
                    .unwrap()
                    .with_name("tokens")
                    .unwrap(),
            ],
        )
        .unwrap()
    };
    let strict = Limit::token_bucket(10, MINUTE)
        .unwrap()
        .with_name("strict")
        .unwrap()
        .counted_up_front();
    let free = plan("free", 20, 10_000)
        .with_shadow_limits([strict])
        .unwrap();
    let plans = Plans::new([free, plan("pro", 200, 1_000_000)])
        .unwrap()
        .with_default("free")
        .unwrap()
        .with_header(HeaderName::from_static("x-plan"));
    let layer = RateLimitLayer::new(Limit::token_bucket(20, MINUTE).unwrap())
        .with_name("llm")
        .with_key(HeaderKey::new("x-api-key").unwrap().hashed())
        .with_store(store)
        .with_timeout(Some(Duration::from_secs(5)))
        .with_plans(plans)
        .with_in_flight(tollgate::InFlightLimit::new(2).unwrap())
        .with_max_wait(Some(Duration::from_secs(2)))
        .with_late_cost(|response: &Response<Body>| {
            response
                .headers()
                .get("x-tokens")?
                .to_str()
                .ok()?
                .parse()
                .ok()
        });
    let handler = move |headers: HeaderMap| {
        let (gate, entered) = (gate.clone(), entered.clone());
        async move {
            if headers.contains_key("x-block") {
                entered.fetch_add(1, Ordering::SeqCst);
                gate.acquire().await.unwrap().forget();
            }
            let tokens = headers
                .get("x-want-tokens")
                .map_or("1".to_owned(), |v| v.to_str().unwrap().to_owned());
            ([("x-tokens", tokens)], "completion")
        }
    };
    Router::new()
        .route("/v1/complete", post(handler))
        .layer(layer)
}

fn completion(api_key: &str, plan: Option<&str>, tokens: u32) -> Request<Body> {
    let mut request = Request::post("/v1/complete")
        .header("x-api-key", api_key)
        .header("x-want-tokens", tokens.to_string());
    if let Some(plan) = plan {
        request = request.header("x-plan", plan);
    }
    request.body(Body::empty()).unwrap()
}

/// What the story checks on Redis besides the behaviour: the script calls per request.
struct Calls<'a> {
    server: &'a support::RedisServer,
    prefix: &'a str,
}

impl Calls<'_> {
    /// Waits until `api_key` holds no permit (its release, with the late cost's
    /// adjustment, has landed).
    async fn settled(&self, api_key: &str) {
        use tollgate::key::KeyExtractor;
        let request = completion(api_key, None, 1);
        let key = HeaderKey::new("x-api-key")
            .unwrap()
            .hashed()
            .extract(&request)
            .unwrap();
        let zset = format!("{}:{{{}}}:inflight", self.prefix, key.as_str());
        let start = Instant::now();
        loop {
            let held: u64 = self
                .server
                .cli(&["ZCARD", &zset])
                .unwrap()
                .trim()
                .parse()
                .unwrap();
            if held == 0 {
                return;
            }
            assert!(
                start.elapsed() < Duration::from_secs(10),
                "a permit of {api_key} never came back: {zset} {:?}",
                self.server.cli(&["KEYS", "*inflight*"])
            );
            tokio::time::sleep(Duration::from_millis(5)).await;
        }
    }
}

/// Sends `request`, reads its body to the end, and (on Redis) checks that it cost one
/// script call to decide and one after the response (the late cost's adjustment and the
/// permit's release together).
async fn complete(app: &Router, calls: Option<&Calls<'_>>, request: Request<Body>) -> Response<()> {
    use http_body_util::BodyExt;
    let api_key = request.headers()["x-api-key"].to_str().unwrap().to_owned();
    let before = calls.map(|c| c.server.script_calls());
    let response = send(app, request).await;
    let decided = calls.map(|c| c.server.script_calls());
    let (parts, body) = response.into_parts();
    body.collect().await.unwrap();
    if let Some(calls) = calls {
        let (before, decided) = (before.unwrap(), decided.unwrap());
        assert_eq!(
            decided - before,
            1,
            "one decision call (limits, shadow and permit)"
        );
        // A denial holds no permit and settles nothing: no call after it.
        if parts.status == StatusCode::OK {
            calls.settled(&api_key).await;
            let after = calls.server.script_calls();
            assert_eq!(after - decided, 1, "one call after the response");
        }
    }
    Response::from_parts(parts, ())
}

fn would_reject(recorder: &metrics_exporter_prometheus::PrometheusRecorder) -> u64 {
    let page = recorder.handle().render();
    page.lines()
        .find(|line| {
            line.starts_with("tollgate_requests_total{")
                && line.contains(r#"route="llm""#)
                && line.contains(r#"outcome="would_reject""#)
        })
        .map_or(0, |line| line.rsplit(' ').next().unwrap().parse().unwrap())
}

async fn llm_story(
    store: impl Store,
    clock: &ManualClock,
    calls: Option<&Calls<'_>>,
    recorder: &metrics_exporter_prometheus::PrometheusRecorder,
) {
    let gate = Arc::new(tokio::sync::Semaphore::new(0));
    let entered = Arc::new(AtomicUsize::new(0));
    let app = llm_app(store, gate.clone(), entered.clone());
    // Warm: the script loaded.
    assert_eq!(
        send(&app, completion("warm", None, 1)).await.status(),
        StatusCode::OK
    );
    if let Some(calls) = calls {
        calls.settled("warm").await;
    }

    // Free: 20 a minute. The shadow limit (10 a minute) never refuses, but the 11th to
    // the 20th are counted as `would_reject`.
    for i in 0..20 {
        let response = complete(&app, calls, completion("free-1", None, 1)).await;
        assert_eq!(response.status(), StatusCode::OK, "request {}", i + 1);
    }
    assert_eq!(would_reject(recorder), 10);
    // The 21st would fit in 3 s: beyond the 2 s of waiting, a 429 at once.
    let started = Instant::now();
    let denied = complete(&app, calls, completion("free-1", None, 1)).await;
    assert_eq!(denied.status(), StatusCode::TOO_MANY_REQUESTS);
    assert_eq!(denied.headers()["retry-after"], "3");
    assert!(
        started.elapsed() < Duration::from_secs(2),
        "answered at once"
    );
    // 1.5 s on, it fits in 1.5 s: it waits instead (reserved: no second ask).
    clock.advance(Duration::from_millis(1_500));
    let started = Instant::now();
    let waited = complete(&app, calls, completion("free-1", None, 1)).await;
    assert_eq!(waited.status(), StatusCode::OK);
    assert!(
        started.elapsed() >= Duration::from_millis(1_200),
        "it waited"
    );

    // Tokens: reported after the response, charged to the day's budget.
    let response = complete(&app, calls, completion("free-2", None, 9_999)).await;
    assert_eq!(response.status(), StatusCode::OK);
    let response = complete(&app, calls, completion("free-2", None, 1)).await;
    assert_eq!(response.status(), StatusCode::OK, "the 10 000th token");
    let refused = complete(&app, calls, completion("free-2", None, 1)).await;
    assert_eq!(
        refused.status(),
        StatusCode::TOO_MANY_REQUESTS,
        "the 10 001st token"
    );

    // Two in flight per key: a third is 429 at once (a cap denial never waits).
    let running: Vec<_> = (0..2)
        .map(|_| {
            let app = app.clone();
            let mut request = completion("free-3", None, 1);
            request
                .headers_mut()
                .insert("x-block", "1".parse().unwrap());
            tokio::spawn(async move { send(&app, request).await })
        })
        .collect();
    let start = Instant::now();
    while entered.load(Ordering::SeqCst) < 2 {
        assert!(start.elapsed() < Duration::from_secs(10), "never entered");
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    let started = Instant::now();
    let third = complete(&app, calls, completion("free-3", None, 1)).await;
    assert_eq!(third.status(), StatusCode::TOO_MANY_REQUESTS);
    assert!(
        started.elapsed() < Duration::from_millis(900),
        "answered at once"
    );
    // Another key is not held up.
    let other = complete(&app, calls, completion("free-4", None, 1)).await;
    assert_eq!(other.status(), StatusCode::OK);
    gate.add_permits(2);
    for running in running {
        let response = running.await.unwrap();
        assert_eq!(response.status(), StatusCode::OK);
        use http_body_util::BodyExt;
        response.into_body().collect().await.unwrap();
    }
    if let Some(calls) = calls {
        calls.settled("free-3").await;
    }
    let fourth = complete(&app, calls, completion("free-3", None, 1)).await;
    assert_eq!(fourth.status(), StatusCode::OK);

    // Pro: 200 a minute and no shadow limit: 30 at once, none refused or counted
    // `would_reject`.
    let shadowed = would_reject(recorder);
    for i in 0..30 {
        let response = complete(&app, calls, completion("pro-1", Some("pro"), 1)).await;
        assert_eq!(response.status(), StatusCode::OK, "pro request {}", i + 1);
        assert!(
            response.headers()["ratelimit-policy"]
                .to_str()
                .unwrap()
                .contains("q=200"),
            "{:?}",
            response.headers()["ratelimit-policy"]
        );
    }
    let response = complete(&app, calls, completion("pro-1", Some("pro"), 20_000)).await;
    assert_eq!(response.status(), StatusCode::OK, "a pro budget of tokens");
    assert_eq!(would_reject(recorder), shadowed);
}

/// A metrics recorder and a current-thread runtime to run a story on under it (on which
/// the Redis calls of a decision coalesce deterministically: see the note on
/// `llm_api_on_redis`).
fn recorder_and_runtime() -> (
    metrics_exporter_prometheus::PrometheusRecorder,
    tokio::runtime::Runtime,
) {
    let recorder = metrics_exporter_prometheus::PrometheusBuilder::new().build_recorder();
    let runtime = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap();
    (recorder, runtime)
}

#[test]
fn llm_api_on_memory() {
    let clock = ManualClock::new(NOW_MS);
    let store = MemoryStore::new().with_clock(clock.clone());
    let (recorder, runtime) = recorder_and_runtime();
    metrics::with_local_recorder(&recorder, || {
        runtime.block_on(llm_story(store, &clock, None, &recorder));
    });
}

/// On Redis, every request costs one script call to decide (its plan's limits, its shadow
/// limit and its permit: the decision and the shadow check are queued together and go
/// as one coalesced call) and one after its response (the late cost's adjustment with
/// the permit's release).
#[test]
fn llm_api_on_redis() {
    let server = support::RedisServer::start();
    let clock = ManualClock::new(NOW_MS);
    let (recorder, runtime) = recorder_and_runtime();
    metrics::with_local_recorder(&recorder, || {
        runtime.block_on(async {
            let store = redis(&server.url(), "llm", &clock).await;
            let calls = Calls {
                server: &server,
                prefix: "llm",
            };
            llm_story(store, &clock, Some(&calls), &recorder).await;
        });
    });
    support::assert_every_key_expires(&server);
}
