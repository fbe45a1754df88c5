//! No silent defaults in `Store` (issue 25): a store says what it can do
//! (`Store::capabilities`), a layer whose features need more is refused when it is built
//! with an error naming the store and the feature, and a method the store does not have
//! fails loudly, naming both, instead of doing less.

use tollgate_test_support as support;

use std::{
    convert::Infallible,
    sync::{
        Arc,
        atomic::{AtomicUsize, Ordering},
    },
    time::Duration,
};

use axum::body::Body;
use http::{HeaderMap, Request, Response, StatusCode};
use tollgate::{
    Adjustment, ConfigError, FailurePolicy, Limit, RateLimitLayer, StoreErrorKind,
    key::{GlobalKey, Key},
    store::{Capabilities, Capability, Check, MemoryStore, Store},
};
use tower::{Layer, ServiceExt, service_fn};

/// A store that only decides: a memory store behind `check`, counting the calls.
#[derive(Debug, Clone, Default)]
struct CheckOnly {
    memory: MemoryStore,
    checks: Arc<AtomicUsize>,
}

impl Store for CheckOnly {
    fn check(&self, key: &Key, limits: &[Limit], cost: u32) -> Check {
        self.checks.fetch_add(1, Ordering::SeqCst);
        self.memory.check(key, limits, cost)
    }

    fn capabilities(&self) -> Capabilities {
        Capabilities::NONE
    }
}

fn per_minute() -> Limit {
    Limit::per_minute(5).unwrap()
}

fn assert_names_both(error: &ConfigError, feature: &str) {
    let message = error.to_string();
    assert_eq!(error.field(), "store", "{message}");
    assert!(message.contains("CheckOnly"), "{message}");
    assert!(message.contains(feature), "{message}");
}

/// Each way of counting after the response needs `adjust`: refused on a store without
/// it, the error naming the store and the feature.
#[test]
fn counting_after_the_response_needs_adjust() {
    let base = || {
        RateLimitLayer::new(per_minute())
            .with_key(GlobalKey)
            .with_store(CheckOnly::default())
    };
    let count_when = base().with_count_when(|r: &Response<Body>| r.status().is_client_error());
    assert_names_both(&count_when.validate().unwrap_err(), "count_when");
    let late_cost = base().with_late_cost(|_: &Response<Body>| Some(3));
    assert_names_both(&late_cost.validate().unwrap_err(), "late_cost");
    let trailers = base().with_late_cost_from_trailers(|_: Option<&HeaderMap>| Some(3));
    assert_names_both(&trailers.validate().unwrap_err(), "late_cost_from_trailers");
    // Whatever comes after it in the builder, and with the other features beside it.
    let later = base()
        .with_count_when(|r: &Response<Body>| r.status().is_client_error())
        .with_max_wait(Some(Duration::from_secs(1)))
        .with_shadow_limit(Limit::per_minute(2).unwrap());
    assert_names_both(&later.validate().unwrap_err(), "count_when");
    // Without counting after the response, the same store builds.
    base()
        .with_max_wait(Some(Duration::from_secs(1)))
        .validate()
        .unwrap();
}

/// `layer` refuses it too, with the same message (a panic, as axum's router panics on a
/// conflicting route when it is built).
#[test]
#[should_panic(expected = "CheckOnly cannot adjust")]
fn layer_panics_with_the_validation_error() {
    let layer = RateLimitLayer::new(per_minute())
        .with_key(GlobalKey)
        .with_store(CheckOnly::default())
        .with_count_when(|r: &Response<Body>| r.status().is_client_error());
    let _ = layer.layer(service_fn(|_: Request<Body>| async {
        Ok::<_, Infallible>(Response::new(Body::empty()))
    }));
}

/// `max_wait` on a store that cannot reserve works by waiting and asking again: the
/// store is never asked to reserve (its `reserve` would fail), and a denied request that
/// waits its turn is checked again and served.
#[tokio::test]
async fn max_wait_on_a_store_without_reserve_waits_and_asks_again() {
    let store = CheckOnly::default();
    // One request per 100 ms.
    let limit = Limit::token_bucket(10, Duration::from_secs(1))
        .unwrap()
        .with_burst(1)
        .unwrap();
    let layer = RateLimitLayer::new(limit)
        .with_key(GlobalKey)
        .with_store(store.clone())
        .with_max_wait(Some(Duration::from_secs(2)));
    let service = layer.layer(service_fn(|_: Request<Body>| async {
        Ok::<_, Infallible>(Response::new(Body::empty()))
    }));
    for _ in 0..2 {
        let response = tokio::time::timeout(
            Duration::from_secs(5),
            service.clone().oneshot(Request::new(Body::empty())),
        )
        .await
        .unwrap()
        .unwrap();
        assert_eq!(response.status(), StatusCode::OK);
    }
    // The first request once, the second twice (denied, then asked again).
    assert_eq!(store.checks.load(Ordering::SeqCst), 3);
}

/// What a store does not claim fails loudly, naming the store and the method: nothing
/// quietly does less (reserve used to answer a plain check).
#[tokio::test]
async fn unclaimed_methods_fail_naming_the_store() {
    let store = CheckOnly::default();
    let key = Key::new("k");
    let limits = [per_minute()];
    let failures = [
        (
            "reserve",
            store.reserve(&key, &limits, 1, 1_000).await.unwrap_err(),
        ),
        (
            "adjust",
            store
                .adjust(&key, &limits, Adjustment::TopUp { units: 1 })
                .await
                .unwrap_err(),
        ),
        ("peek", store.peek(&key, &limits, 0).await.unwrap_err()),
        ("reset", store.reset(&key, &limits).await.unwrap_err()),
    ];
    for (method, error) in failures {
        assert_eq!(error.kind(), StoreErrorKind::Unsupported);
        let chain = support::chain(&error);
        assert!(
            chain.contains("CheckOnly") && chain.contains(&format!("cannot {method}")),
            "{chain}"
        );
    }
    assert_eq!(store.checks.load(Ordering::SeqCst), 0);
}

/// Every combination of counting after the response with the other features builds on
/// the memory store (and its local fallback); the memory store claims everything.
#[test]
fn the_memory_store_accepts_every_combination() {
    assert_eq!(MemoryStore::new().capabilities(), Capabilities::ALL);
    for capability in Capability::ALL {
        assert!(MemoryStore::new().capabilities().contains(capability));
    }
    let layer = RateLimitLayer::new(per_minute())
        .with_key(GlobalKey)
        .with_store(MemoryStore::new())
        .with_shadow_limit(Limit::per_minute(2).unwrap())
        .with_max_wait(Some(Duration::from_secs(1)))
        .with_on_store_error(FailurePolicy::Local(MemoryStore::new()))
        .with_count_when(|r: &Response<Body>| r.status().is_client_error());
    layer.validate().unwrap();
    let layer = RateLimitLayer::new(per_minute())
        .with_late_cost(|_: &Response<Body>| Some(2))
        .with_max_wait(Some(Duration::from_secs(1)));
    layer.validate().unwrap();
}

#[cfg(feature = "redis")]
#[tokio::test]
async fn the_redis_store_accepts_every_combination() {
    use tollgate::store::RedisStore;

    let server = support::RedisServer::start();
    let store = RedisStore::connect(server.url()).await.unwrap();
    assert_eq!(store.capabilities(), Capabilities::ALL);
    let base = || {
        RateLimitLayer::new(per_minute())
            .with_key(GlobalKey)
            .with_store(store.clone())
            .with_shadow_limit(Limit::per_minute(2).unwrap())
            .with_max_wait(Some(Duration::from_secs(1)))
            .with_on_store_error(FailurePolicy::Local(MemoryStore::new()))
    };
    base().validate().unwrap();
    base()
        .with_count_when(|r: &Response<Body>| r.status().is_client_error())
        .validate()
        .unwrap();
    base()
        .with_late_cost(|_: &Response<Body>| Some(2))
        .validate()
        .unwrap();
    base()
        .with_late_cost_from_trailers(|_: Option<&HeaderMap>| Some(2))
        .validate()
        .unwrap();
}

/// An in-flight limit needs a store that counts permits with its limits: refused when the
/// layer is built, naming the store and the feature, and refused at run time too (the
/// rules in force stay). (Before: `check_in_flight`'s default failed every request with
/// `Unsupported`, which the failure policy then answered.)
#[test]
fn an_in_flight_limit_needs_check_in_flight() {
    let cap = tollgate::InFlightLimit::new(2).unwrap();
    let layer = RateLimitLayer::new(per_minute())
        .with_key(GlobalKey)
        .with_store(CheckOnly::default())
        .with_in_flight(cap);
    let error = layer.validate().unwrap_err();
    let message = error.to_string();
    assert_eq!(error.field(), "in_flight", "{message}");
    assert!(message.contains("CheckOnly"), "{message}");
    assert!(message.contains("in-flight"), "{message}");

    let layer = RateLimitLayer::new(per_minute())
        .with_key(GlobalKey)
        .with_store(CheckOnly::default());
    let handle = layer.rules_handle();
    let before = handle.version();
    assert_eq!(handle.set(handle.rules().with_in_flight(Some(cap))), before);
    assert!(handle.rules().in_flight().is_none());

    let memory = RateLimitLayer::new(per_minute()).with_in_flight(cap);
    memory.validate().unwrap();
}
