//! A service that starts before its Redis (`RedisConnect::in_background`): while Redis
//! is down every decision fails at once and the failure policy answers it; once a
//! redis-server comes up on the port the store was given, decisions come from Redis
//! (exact counts, a 429 at limit + 1) with nothing restarted.
//!
//! Bounds are generous (seconds): the store retries every 2 s at most.

#![cfg(feature = "redis")]

use tollgate_test_support as support;

use std::time::{Duration, Instant};

use axum::{Router, body::Body, routing::get};
use http::{Request, Response, StatusCode};
use support::{RedisServer, fixed_window_count, free_port, logs::Logs, loopback_url};
use tokio::time::timeout;
use tollgate::{
    CircuitBreaker, FailurePolicy, Limit, RateLimitLayer, StoreErrorKind,
    key::GlobalKey,
    store::{RedisStore, Store},
};
use tower::ServiceExt;

/// The limit Redis enforces once it is up.
const LIMIT: u32 = 5;
/// How long Redis may take to be used after it came up: far beyond the 2 s retry.
const CONNECTS_WITHIN: Duration = Duration::from_secs(15);

fn app(store: RedisStore, policy: FailurePolicy) -> Router {
    let limit = Limit::fixed_window(LIMIT, Duration::from_secs(3600)).unwrap();
    // No timeout and no breaker: nothing but the store itself can make a request fast
    // while Redis is down.
    let layer = RateLimitLayer::new(limit)
        .with_key(GlobalKey)
        .with_store(store)
        .with_timeout(None)
        .with_circuit_breaker(None)
        .with_on_store_error(policy);
    Router::new()
        .route("/", get(|| async { "ok" }))
        .layer(layer)
}

async fn send(app: &Router) -> Response<Body> {
    let request = Request::get("/").body(Body::empty()).unwrap();
    timeout(Duration::from_secs(5), app.clone().oneshot(request))
        .await
        .expect("a request hung")
        .unwrap()
}

/// `r=` of the `RateLimit` field: the remaining quota Redis reported.
fn remaining(response: &Response<Body>) -> Option<u32> {
    let field = response.headers().get("ratelimit")?.to_str().ok()?;
    let r = field.split(';').find_map(|part| part.strip_prefix("r="))?;
    r.parse().ok()
}

/// Sends requests until one is decided by Redis; returns it.
async fn until_redis_decides(app: &Router) -> Response<Body> {
    let deadline = Instant::now() + CONNECTS_WITHIN;
    loop {
        let response = send(app).await;
        if remaining(&response).is_some() {
            return response;
        }
        assert!(
            Instant::now() < deadline,
            "Redis did not decide within {CONNECTS_WITHIN:?} of coming up"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

/// The store starts while nothing listens on its port: 50 requests while it is down,
/// each answered by `policy` with `status_while_down`, and all of them quickly (none
/// waits for a connection attempt).
async fn start_before_redis(policy: FailurePolicy, status_while_down: StatusCode) -> Logs {
    let (logs, _guard) = Logs::capture();
    let port = free_port();
    let started = Instant::now();
    let store = RedisStore::connect(loopback_url(port, false))
        .in_background(true)
        .await
        .expect("starts without Redis");
    assert!(
        started.elapsed() < Duration::from_secs(5),
        "start took {:?}",
        started.elapsed()
    );
    assert!(store.connecting());
    let app = app(store.clone(), policy);

    let down = Instant::now();
    for _ in 0..50 {
        let response = send(&app).await;
        assert_eq!(response.status(), status_while_down);
        assert_eq!(remaining(&response), None, "decided by the failure policy");
    }
    // A connection attempt to a closed port with redis-rs's retries takes longer than
    // this alone; 50 of them, far longer.
    assert!(
        down.elapsed() < Duration::from_millis(250),
        "requests while unconnected took {:?}",
        down.elapsed()
    );

    let server = RedisServer::start_on(port, &[]);
    let first = until_redis_decides(&app).await;
    assert_eq!(first.status(), StatusCode::OK);
    assert_eq!(remaining(&first), Some(LIMIT - 1));
    assert!(!store.connecting());
    for left in (0..LIMIT - 1).rev() {
        let response = send(&app).await;
        assert_eq!(response.status(), StatusCode::OK);
        assert_eq!(remaining(&response), Some(left));
    }
    let over = send(&app).await;
    assert_eq!(over.status(), StatusCode::TOO_MANY_REQUESTS);
    assert_eq!(remaining(&over), Some(0));

    // Counted in Redis: exactly the limit (the denial counts nothing).
    let keys = server.cli(&["KEYS", "*"]).unwrap();
    let keys: Vec<&str> = keys.lines().filter(|k| !k.is_empty()).collect();
    assert_eq!(keys.len(), 1, "{keys:?}");
    let value = server.cli(&["GET", keys[0]]).unwrap();
    assert_eq!(fixed_window_count(&value), LIMIT);
    // The library (or the script) was loaded once connected: the calls ran as such.
    assert!(server.script_calls() > u64::from(LIMIT));
    logs
}

#[tokio::test]
async fn a_fail_open_service_starts_before_redis_and_limits_once_it_is_up() {
    let logs = start_before_redis(FailurePolicy::Allow, StatusCode::OK).await;
    let text = logs.text();
    assert!(text.contains("Redis is not reachable at start"), "{text}");
    assert!(text.contains("requests pass unlimited"), "{text}");
    assert!(text.contains("connected to Redis"), "{text}");
}

#[tokio::test]
async fn a_fail_closed_service_starts_before_redis_says_so_and_limits_once_it_is_up() {
    let logs = start_before_redis(FailurePolicy::Deny, StatusCode::SERVICE_UNAVAILABLE).await;
    let text = logs.text();
    let warned = text
        .lines()
        .find(|line| line.contains("fails closed"))
        .unwrap_or_else(|| panic!("no fail-closed warning in {text}"));
    assert!(warned.contains("WARN"), "{warned}");
    assert!(warned.contains("policy=\"deny\""), "{warned}");
}

/// With the default circuit breaker and timeout, as a service runs: the breaker opens on
/// the fast failures, and the first probe after Redis is up closes it.
#[tokio::test]
async fn the_circuit_breaker_lets_redis_in_once_it_is_up() {
    let port = free_port();
    let store = RedisStore::connect(loopback_url(port, false))
        .in_background(true)
        .await
        .unwrap();
    let limit = Limit::fixed_window(LIMIT, Duration::from_secs(3600)).unwrap();
    let layer = RateLimitLayer::new(limit)
        .with_key(GlobalKey)
        .with_store(store)
        .with_circuit_breaker(Some(CircuitBreaker::default()))
        .with_on_store_error(FailurePolicy::Deny);
    let app = Router::new()
        .route("/", get(|| async { "ok" }))
        .layer(layer);
    for _ in 0..20 {
        assert_eq!(send(&app).await.status(), StatusCode::SERVICE_UNAVAILABLE);
    }
    let _server = RedisServer::start_on(port, &[]);
    let first = until_redis_decides(&app).await;
    assert_eq!(remaining(&first), Some(LIMIT - 1));
}

/// A store started on a runtime that shut down since (its connecting task died with it)
/// still connects once used on another: the next decision starts the task again.
#[test]
fn a_store_started_on_a_runtime_that_ended_still_connects() {
    let port = free_port();
    let store = tokio::runtime::Runtime::new()
        .unwrap()
        .block_on(RedisStore::connect(loopback_url(port, false)).in_background(true))
        .unwrap();
    let _server = RedisServer::start_on(port, &[]);
    let runtime = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap();
    runtime.block_on(async {
        let app = app(store, FailurePolicy::Allow);
        let first = until_redis_decides(&app).await;
        assert_eq!(remaining(&first), Some(LIMIT - 1));
    });
}

/// The default is unchanged: an unreachable Redis fails the await, quickly.
#[tokio::test]
async fn without_in_background_an_unreachable_redis_fails_the_start() {
    let started = Instant::now();
    let error = RedisStore::connect(loopback_url(free_port(), false))
        .await
        .unwrap_err();
    assert_eq!(error.kind(), StoreErrorKind::Unavailable);
    assert!(started.elapsed() < Duration::from_secs(5));
}

/// `in_background` defers only an unreachable Redis: a bad URL still fails the await.
#[tokio::test]
async fn in_background_still_refuses_a_bad_url() {
    let error = RedisStore::connect("redis://127.0.0.1:notaport")
        .in_background(true)
        .await
        .unwrap_err();
    assert_ne!(error.kind(), StoreErrorKind::Unavailable, "{error:?}");
}

/// A Redis that is up but refuses the store (a wrong password) fails the await too: it
/// is a mistake, not a Redis that comes up later.
#[tokio::test]
async fn in_background_still_refuses_a_wrong_password() {
    let server = RedisServer::start();
    server
        .cli(&["CONFIG", "SET", "requirepass", "right"])
        .unwrap();
    let url = format!("redis://:wrong@127.0.0.1:{}", server.port());
    let result = RedisStore::connect(url).in_background(true).await;
    assert!(
        result.is_err(),
        "a wrong password started in the background"
    );
}

/// A cluster cannot start in the background (redis-rs's cluster client connects when
/// built): said at once, not silently ignored.
#[cfg(feature = "cluster")]
#[tokio::test]
async fn a_cluster_in_the_background_is_refused() {
    let error = RedisStore::connect(tollgate::store::RedisTarget::cluster(&[loopback_url(
        free_port(),
        false,
    )]))
    .in_background(true)
    .await
    .unwrap_err();
    assert_eq!(error.kind(), StoreErrorKind::Unsupported);
    let cause = support::chain(&error);
    assert!(cause.contains("Redis Cluster"), "{cause}");
}

/// Sentinel: the sentinel names a master that is not up yet; the store starts, the
/// failure policy answers, and once the master is up it decides there.
#[cfg(feature = "sentinel")]
#[tokio::test]
async fn a_sentinel_store_starts_before_its_master() {
    use support::sentinel::{MASTER_NAME, SentinelProcess};
    use tollgate::store::SentinelConfig;

    let master_port = free_port();
    let sentinel = SentinelProcess::watching(master_port);
    let config = SentinelConfig::new(&[sentinel.url()], MASTER_NAME);
    let store = RedisStore::connect(config.clone())
        .in_background(true)
        .await
        .expect("starts without its master");
    assert!(store.connecting());
    let app = app(store, FailurePolicy::Deny);
    for _ in 0..10 {
        assert_eq!(send(&app).await.status(), StatusCode::SERVICE_UNAVAILABLE);
    }
    let _master = RedisServer::start_on(master_port, &[]);
    let first = until_redis_decides(&app).await;
    assert_eq!(remaining(&first), Some(LIMIT - 1));
}
