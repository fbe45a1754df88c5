//! The stories of issue 25, end to end through axum, on the memory store and on real
//! Redis: a login endpoint behind a trusted proxy, and a public API whose plans and limits
//! change at run time while requests run.

#![cfg(feature = "redis")]

use tollgate_test_support as support;

use std::{
    net::SocketAddr,
    sync::{
        Arc,
        atomic::{AtomicBool, Ordering},
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
