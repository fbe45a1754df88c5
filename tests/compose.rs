//! Features of one layer that used to be decided by separate code paths, together: counting
//! after the response with plans (also set at run time), with `max_wait`, and with the local
//! fallback; shadow limits with reservations; the local fallback with `max_wait`. On the
//! memory store and on real Redis (killed, where the fallback is what is tested). The
//! stores' clocks are frozen, so a wait can only end in a 200 when the request was
//! reserved: asking again would find the same empty bucket.

#![cfg(feature = "redis")]

use tollgate_test_support as support;

use std::{
    convert::Infallible,
    time::{Duration, Instant},
};

use axum::body::Body;
use http::{HeaderName, Request, Response, StatusCode};
use tollgate::{
    FailurePolicy, Limit, RateLimitLayer,
    clock::ManualClock,
    key::{GlobalKey, Key},
    plan::{Plan, Plans},
    store::{MemoryStore, RedisStore, Store},
};
use tower::{Layer, Service, ServiceExt, service_fn};

const HOUR: Duration = Duration::from_secs(3600);
const SECOND: Duration = Duration::from_secs(1);
const NOW_MS: u64 = 1_700_000_000_000;

fn memory() -> MemoryStore {
    MemoryStore::new().with_clock(ManualClock::new(NOW_MS))
}

async fn redis(server: &support::RedisServer, prefix: &str) -> RedisStore {
    RedisStore::connect(server.url())
        .await
        .unwrap()
        .with_prefix(prefix)
        .unwrap()
        .with_clock(ManualClock::new(NOW_MS))
}

/// The key of every request under `GlobalKey`.
fn global() -> Key {
    tollgate::key::KeyExtractor::<()>::extract(&GlobalKey, &Request::new(())).unwrap()
}

fn hourly(n: u32) -> Limit {
    Limit::fixed_window(n, HOUR).unwrap()
}

/// A handler answering the status in `x-status` (200 without), and `x-tokens: <n>` when
/// the request asks for it with `x-tokens`.
fn handler()
-> impl Service<Request<Body>, Response = Response<Body>, Error = Infallible, Future = impl Send>
+ Clone
+ Send {
    service_fn(|request: Request<Body>| async move {
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
    })
}

/// One request through `service` with these headers: its status.
async fn send<S, B>(service: &S, headers: &[(&str, &str)]) -> StatusCode
where
    S: Service<Request<Body>, Response = Response<B>, Error = Infallible> + Clone,
{
    let mut request = Request::new(Body::empty());
    for (name, value) in headers {
        request.headers_mut().insert(
            HeaderName::from_bytes(name.as_bytes()).unwrap(),
            value.parse().unwrap(),
        );
    }
    tokio::time::timeout(Duration::from_secs(10), service.clone().oneshot(request))
        .await
        .expect("answered")
        .unwrap()
        .status()
}

fn unauthorized(response: &Response<Body>) -> bool {
    response.status() == StatusCode::UNAUTHORIZED
}

/// A count-after layer decides under each request's plan, in the plan's state, also for
/// plans set at run time: successes never count, a plan's failures count against its own
/// limit. (Before: a count-after layer decided under the layer's own limit of 100.)
async fn count_after_decides_under_plans(store: impl Store + Clone) {
    let plans = Plans::new([
        Plan::new("free", [hourly(2)]).unwrap(),
        Plan::new("pro", [hourly(4)]).unwrap(),
    ])
    .unwrap()
    .with_header(HeaderName::from_static("x-plan"));
    let layer = RateLimitLayer::new(hourly(100))
        .with_key(GlobalKey)
        .with_store(store)
        .with_timeout(Some(Duration::from_secs(5)))
        .with_plans(plans)
        .with_count_when(unauthorized);
    let rules = layer.rules_handle();
    let service = layer.layer(handler());
    let free = [("x-plan", "free")];
    let free_fails = [("x-plan", "free"), ("x-status", "401")];
    for _ in 0..5 {
        assert_eq!(send(&service, &free).await, StatusCode::OK);
    }
    for _ in 0..2 {
        assert_eq!(send(&service, &free_fails).await, StatusCode::UNAUTHORIZED);
    }
    assert_eq!(send(&service, &free).await, StatusCode::TOO_MANY_REQUESTS);
    // "pro" has its own state.
    let pro_fails = [("x-plan", "pro"), ("x-status", "401")];
    for _ in 0..4 {
        assert_eq!(send(&service, &pro_fails).await, StatusCode::UNAUTHORIZED);
    }
    assert_eq!(
        send(&service, &pro_fails).await,
        StatusCode::TOO_MANY_REQUESTS
    );

    // Plans set at run time apply to the count-after layer too.
    let team = Plans::new([Plan::new("team", [hourly(1)]).unwrap()])
        .unwrap()
        .with_header(HeaderName::from_static("x-plan"));
    rules.set(rules.rules().with_plans(team));
    let team_fails = [("x-plan", "team"), ("x-status", "401")];
    assert_eq!(send(&service, &team_fails).await, StatusCode::UNAUTHORIZED);
    assert_eq!(
        send(&service, &team_fails).await,
        StatusCode::TOO_MANY_REQUESTS
    );
    assert_eq!(
        send(&service, &[("x-plan", "team")]).await,
        StatusCode::TOO_MANY_REQUESTS
    );
}

#[tokio::test]
async fn count_after_decides_under_plans_memory() {
    count_after_decides_under_plans(memory()).await;
}

#[tokio::test]
async fn count_after_decides_under_plans_redis() {
    let server = support::RedisServer::start();
    count_after_decides_under_plans(redis(&server, "plans").await).await;
}

/// `max_wait` and `late_cost` together, in either builder order: a request over a token
/// bucket is reserved and waits instead of a 429, and its late cost of 0 gives the reserved
/// unit back. (Before: `.with_max_wait(..).with_late_cost(..)` dropped the wait: a 429 at once.)
async fn count_after_waits_for_its_reservation(store: impl Store + Clone) {
    let bucket = Limit::token_bucket(1, SECOND).unwrap();
    let tokens = |response: &Response<Body>| {
        response
            .headers()
            .get("x-tokens")
            .and_then(|v| v.to_str().ok()?.parse().ok())
    };
    let layer = RateLimitLayer::new(bucket)
        .with_key(GlobalKey)
        .with_store(store)
        .with_timeout(Some(Duration::from_secs(5)))
        .with_max_wait(Some(Duration::from_secs(2)))
        .with_late_cost(tokens);
    let limiter = layer.limiter();
    let service = layer.layer(handler());
    assert_eq!(send(&service, &[]).await, StatusCode::OK);
    let started = Instant::now();
    assert_eq!(send(&service, &[("x-tokens", "0")]).await, StatusCode::OK);
    let waited = started.elapsed();
    assert!(
        waited >= Duration::from_millis(900),
        "reserved: waited {waited:?}"
    );
    // The reserved unit came back: the next one waits a second, not two.
    let mut left = Duration::ZERO;
    for _ in 0..100 {
        left = limiter.peek(&global(), 1).await.unwrap().retry_after();
        if left <= SECOND {
            break;
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    assert!(left > Duration::ZERO && left <= SECOND, "{left:?}");
}

#[tokio::test]
async fn count_after_waits_for_its_reservation_memory() {
    count_after_waits_for_its_reservation(memory()).await;
}

#[tokio::test]
async fn count_after_waits_for_its_reservation_redis() {
    let server = support::RedisServer::start();
    count_after_waits_for_its_reservation(redis(&server, "wait").await).await;
}

/// A layer with a shadow limit reserves like one without: the request over the bucket
/// waits for its reservation and passes. (Before: with shadow limits the layer only
/// checked, asked again after the wait, found the bucket as empty under the frozen clock,
/// and answered 429.)
async fn shadow_limits_reserve(store: impl Store + Clone) {
    let layer = RateLimitLayer::new(Limit::gcra(1, SECOND).unwrap())
        .with_shadow_limit(hourly(100))
        .with_key(GlobalKey)
        .with_store(store)
        .with_timeout(Some(Duration::from_secs(5)))
        .with_max_wait(Some(Duration::from_secs(2)));
    let limiter = layer.limiter();
    let service = layer.layer(handler());
    assert_eq!(send(&service, &[]).await, StatusCode::OK);
    let started = Instant::now();
    assert_eq!(send(&service, &[]).await, StatusCode::OK);
    assert!(started.elapsed() >= Duration::from_millis(900));
    // The shadow limit counted both.
    let shadow = limiter.peek_shadow(&global(), 0).await.unwrap();
    assert_eq!(shadow.remaining(), Some(98));
}

#[tokio::test]
async fn shadow_limits_reserve_memory() {
    shadow_limits_reserve(memory()).await;
}

#[tokio::test]
async fn shadow_limits_reserve_redis() {
    let server = support::RedisServer::start();
    shadow_limits_reserve(redis(&server, "shadow").await).await;
}

/// Redis, killed after connecting: every decision fails (and the breaker opens).
async fn dead_redis() -> (support::RedisServer, RedisStore) {
    let mut server = support::RedisServer::start();
    let store = redis(&server, "dead").await;
    server.kill();
    (server, store)
}

/// With the store down, the local fallback reserves and lets a request wait, as the
/// store would have. (Before: the fallback only checked, and its denials never waited.)
#[tokio::test]
async fn the_local_fallback_reserves_and_waits() {
    let (_server, store) = dead_redis().await;
    let service = RateLimitLayer::new(Limit::gcra(1, SECOND).unwrap())
        .with_key(GlobalKey)
        .with_store(store)
        .with_on_store_error(FailurePolicy::Local(memory()))
        .with_max_wait(Some(Duration::from_secs(2)))
        .layer(handler());
    assert_eq!(send(&service, &[]).await, StatusCode::OK);
    let started = Instant::now();
    assert_eq!(send(&service, &[]).await, StatusCode::OK);
    assert!(started.elapsed() >= Duration::from_millis(900));
    // Beyond max_wait: a 429, from the local store.
    let mut statuses = Vec::new();
    for _ in 0..3 {
        statuses.push(send(&service, &[]).await);
    }
    assert!(
        statuses.contains(&StatusCode::TOO_MANY_REQUESTS),
        "{statuses:?}"
    );
}

/// With the store down, a count-after layer settles the local fallback's charges there:
/// successes give their unit back. (Before: the local charge stayed, a 429 on the third.)
#[tokio::test]
async fn count_after_settles_in_the_local_fallback() {
    let (_server, store) = dead_redis().await;
    let local = memory();
    let layer = RateLimitLayer::new(hourly(2))
        .with_key(GlobalKey)
        .with_store(store)
        .with_on_store_error(FailurePolicy::Local(local.clone()))
        .with_count_when(unauthorized);
    let service = layer.layer(handler());
    for _ in 0..6 {
        assert_eq!(send(&service, &[]).await, StatusCode::OK);
    }
    for _ in 0..2 {
        assert_eq!(
            send(&service, &[("x-status", "401")]).await,
            StatusCode::UNAUTHORIZED
        );
    }
    assert_eq!(send(&service, &[]).await, StatusCode::TOO_MANY_REQUESTS);
    // The local store holds exactly the two failures.
    let peek = local.peek(&global(), &[hourly(2)], 0).await.unwrap();
    assert_eq!(peek.remaining(), Some(0));
}

/// The inner service reads what was decided from the request's extensions: the plan and
/// what is left; a request let through without a decision carries none.
async fn the_handler_sees_the_decision(store: impl Store + Clone) {
    let plans = Plans::new([Plan::new("free", [hourly(3)]).unwrap()])
        .unwrap()
        .with_header(HeaderName::from_static("x-plan"));
    let echo = service_fn(|request: Request<Body>| async move {
        let info = request
            .extensions()
            .get::<tollgate::RateLimitInfo>()
            .cloned();
        let text = match info {
            Some(info) => format!(
                "{}:{}",
                info.plan().unwrap_or("-"),
                info.decision().remaining().unwrap()
            ),
            None => "none".to_owned(),
        };
        Ok::<_, Infallible>(Response::new(Body::from(text)))
    });
    let service = RateLimitLayer::new(hourly(5))
        .with_key(tollgate::key::HeaderKey::new("x-user").unwrap())
        .with_on_missing_key(tollgate::MissingKey::Allow)
        .with_store(store)
        .with_timeout(Some(Duration::from_secs(5)))
        .with_plans(plans)
        .with_request_info(true)
        .layer(echo);
    let body = |headers: &'static [(&'static str, &'static str)]| {
        let service = service.clone();
        async move {
            let mut request = Request::new(Body::empty());
            for (name, value) in headers {
                request.headers_mut().insert(*name, value.parse().unwrap());
            }
            let response = service.oneshot(request).await.unwrap();
            let bytes = http_body_util::BodyExt::collect(response.into_body())
                .await
                .unwrap()
                .to_bytes();
            String::from_utf8(bytes.to_vec()).unwrap()
        }
    };
    assert_eq!(body(&[("x-user", "a"), ("x-plan", "free")]).await, "free:2");
    assert_eq!(body(&[("x-user", "a")]).await, "-:4");
    assert_eq!(body(&[]).await, "none");
}

#[tokio::test]
async fn the_handler_sees_the_decision_memory() {
    the_handler_sees_the_decision(memory()).await;
}

#[tokio::test]
async fn the_handler_sees_the_decision_redis() {
    let server = support::RedisServer::start();
    the_handler_sees_the_decision(redis(&server, "info").await).await;
}

/// `max_wait` is part of the rules: a `RulesHandle` turns waiting on and off while the
/// layer serves, and the layer's other settings stay.
#[tokio::test]
async fn max_wait_changes_at_run_time() {
    let layer = RateLimitLayer::new(Limit::gcra(1, SECOND).unwrap())
        .with_key(GlobalKey)
        .with_store(memory());
    let rules = layer.rules_handle();
    let service = layer.layer(handler());
    assert_eq!(send(&service, &[]).await, StatusCode::OK);
    assert_eq!(send(&service, &[]).await, StatusCode::TOO_MANY_REQUESTS);
    rules.set(rules.rules().with_max_wait(Some(Duration::from_secs(2))));
    let started = Instant::now();
    assert_eq!(send(&service, &[]).await, StatusCode::OK);
    assert!(started.elapsed() >= Duration::from_millis(900));
    rules.set(rules.rules().with_max_wait(None));
    let started = Instant::now();
    assert_eq!(send(&service, &[]).await, StatusCode::TOO_MANY_REQUESTS);
    assert!(started.elapsed() < Duration::from_millis(500));
}

/// A limit counted up front keeps each request's charge while the late cost adjusts the
/// layer's other limits: 3 requests an hour beside 100 tokens an hour, in one layer.
/// (Before: the late cost adjusted every limit, so a request that used no tokens did not
/// count as a request.)
async fn counted_up_front_beside_a_late_cost(store: impl Store + Clone) {
    let requests = hourly(3).counted_up_front();
    let tokens = hourly(100).with_name("tokens").unwrap();
    let late = |response: &Response<Body>| {
        response
            .headers()
            .get("x-tokens")
            .and_then(|v| v.to_str().ok()?.parse().ok())
    };
    let layer = RateLimitLayer::new(requests.clone())
        .with_limit(tokens.clone())
        .with_key(GlobalKey)
        .with_store(store.clone())
        .with_timeout(Some(Duration::from_secs(5)))
        .with_late_cost(late);
    let service = layer.layer(handler());
    assert_eq!(send(&service, &[("x-tokens", "0")]).await, StatusCode::OK);
    assert_eq!(send(&service, &[("x-tokens", "30")]).await, StatusCode::OK);
    assert_eq!(send(&service, &[("x-tokens", "0")]).await, StatusCode::OK);
    // Three requests: the request limit is spent whatever they cost in tokens.
    assert_eq!(
        send(&service, &[("x-tokens", "0")]).await,
        StatusCode::TOO_MANY_REQUESTS
    );
    // The tokens limit holds what the responses said: 30 of 100 (settled after the
    // responses, so wait for the last).
    let mut left = None;
    for _ in 0..200 {
        let decision = store
            .peek(&global(), std::slice::from_ref(&tokens), 0)
            .await
            .unwrap();
        left = decision.remaining();
        if left == Some(70) {
            break;
        }
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    assert_eq!(left, Some(70));
}

#[tokio::test]
async fn counted_up_front_beside_a_late_cost_memory() {
    counted_up_front_beside_a_late_cost(memory()).await;
}

#[tokio::test]
async fn counted_up_front_beside_a_late_cost_redis() {
    let server = support::RedisServer::start();
    counted_up_front_beside_a_late_cost(redis(&server, "upfront").await).await;
}

/// A plan's own shadow limits count under that plan only, in place of the layer's:
/// here the free plan's stricter shadow limit would reject its third request, the pro
/// plan's requests are never shadowed. (Before: plans had the layer's shadow limits only.)
async fn a_plan_has_shadow_limits_of_its_own(store: impl Store + Clone) {
    let (logs, _guard) = support::logs::Logs::capture();
    let plans = Plans::new([
        Plan::new("free", [hourly(5)])
            .unwrap()
            .with_shadow_limits([hourly(2).with_name("stricter").unwrap()])
            .unwrap(),
        Plan::new("pro", [hourly(5)]).unwrap(),
    ])
    .unwrap()
    .with_header(HeaderName::from_static("x-plan"));
    let service = RateLimitLayer::new(hourly(100))
        .with_key(GlobalKey)
        .with_store(store)
        .with_timeout(Some(Duration::from_secs(5)))
        .with_plans(plans)
        .layer(handler());
    for _ in 0..3 {
        assert_eq!(send(&service, &[("x-plan", "pro")]).await, StatusCode::OK);
    }
    assert!(!logs.text().contains("would reject"), "{}", logs.text());
    for _ in 0..3 {
        assert_eq!(send(&service, &[("x-plan", "free")]).await, StatusCode::OK);
    }
    let text = logs.text();
    assert_eq!(text.matches("would reject").count(), 1, "{text}");
}

#[tokio::test]
async fn a_plan_has_shadow_limits_of_its_own_memory() {
    a_plan_has_shadow_limits_of_its_own(memory()).await;
}

#[tokio::test]
async fn a_plan_has_shadow_limits_of_its_own_redis() {
    let server = support::RedisServer::start();
    a_plan_has_shadow_limits_of_its_own(redis(&server, "planshadow").await).await;
}

/// A plan's shadow limit may not share the state of the plan's limits, and an unlimited
/// plan has nothing to shadow.
#[test]
fn a_plan_refuses_shadow_limits_it_cannot_have() {
    let same = Plan::new("free", [hourly(5)])
        .unwrap()
        .with_shadow_limits([hourly(5)]);
    assert_eq!(same.unwrap_err().field(), "shadow_limits");
    let unlimited = Plan::unlimited("vip")
        .unwrap()
        .with_shadow_limits([hourly(5)]);
    assert_eq!(unlimited.unwrap_err().field(), "shadow_limits");
}
