//! The adaptive stage on real Redis: the permit rides the path of a request that waits
//! for the store (taken before the call, released at the body's end), shed requests
//! spend no units, and with Redis killed every failure policy still sheds.

#![cfg(feature = "redis")]

use tollgate_test_support as support;

use std::{sync::Arc, time::Duration};

use axum::body::Body;
use http::{Request, Response, StatusCode};
use http_body_util::BodyExt;
use tokio::sync::Semaphore;
use tollgate::{
    FailurePolicy, Limit, RateLimitLayer,
    adaptive::{Adaptive, AdaptiveLimit, Aimd},
    key::GlobalKey,
    store::RedisStore,
};
use tower::{Layer, Service, ServiceExt, service_fn, util::BoxCloneSyncService};

type Handler = BoxCloneSyncService<Request<Body>, Response<Body>, String>;

/// 200 "ok" once `gate` lets a request through.
fn gated(gate: Arc<Semaphore>) -> Handler {
    BoxCloneSyncService::new(service_fn(move |_req: Request<Body>| {
        let gate = gate.clone();
        async move {
            gate.acquire().await.unwrap().forget();
            Ok(Response::new(Body::from("ok")))
        }
    }))
}

fn fixed(n: u32) -> Adaptive {
    Adaptive::new(AdaptiveLimit::new(Aimd::new()).with_bounds(n, n, n).unwrap())
}

fn request() -> Request<Body> {
    Request::get("/").body(Body::empty()).unwrap()
}

async fn status<S>(service: &mut S) -> StatusCode
where
    S: Service<Request<Body>, Response = Response<tollgate::count_after::RateLimitBody<Body>>>,
    S::Error: std::fmt::Debug,
{
    service.ready().await.unwrap();
    service.call(request()).await.unwrap().status()
}

#[tokio::test]
async fn on_redis_the_permit_rides_the_store_call_and_shed_requests_spend_nothing() {
    let server = support::RedisServer::start();
    let store = RedisStore::connect(server.url()).await.unwrap();
    let layer = RateLimitLayer::new(Limit::per_hour(100).unwrap())
        .with_key(GlobalKey)
        .with_store(store)
        .with_adaptive(fixed(2));
    let handle = layer.adaptive_handle().unwrap();
    let limiter = layer.limiter();
    let gate = Arc::new(Semaphore::new(0));
    let service = layer.layer(gated(gate.clone()));
    let mut held = Vec::new();
    for _ in 0..2 {
        let mut service = service.clone();
        held.push(tokio::spawn(async move {
            service.ready().await.unwrap();
            let response = service.call(request()).await.unwrap();
            response.into_body().collect().await.unwrap();
        }));
    }
    // Both admitted, waiting for Redis or in the handler: the next ones are shed.
    tokio::task::yield_now().await;
    assert_eq!(handle.snapshot().in_flight, 2);
    let mut service = service.clone();
    for _ in 0..5 {
        assert_eq!(status(&mut service).await, StatusCode::SERVICE_UNAVAILABLE);
    }
    gate.add_permits(2);
    for task in held {
        task.await.unwrap();
    }
    let now = handle.snapshot();
    assert_eq!((now.in_flight, now.samples), (0, 2));
    // Two units spent in Redis, not seven.
    let key = limiter.key_for("").unwrap();
    assert_eq!(limiter.peek(&key, 0).await.unwrap().remaining(), Some(98));
}

#[tokio::test]
async fn with_redis_killed_every_failure_policy_still_sheds() {
    for policy in [
        FailurePolicy::Allow,
        FailurePolicy::Deny,
        FailurePolicy::local(),
    ] {
        let mut server = support::RedisServer::start();
        let store = RedisStore::connect(server.url()).await.unwrap();
        server.kill();
        let layer = RateLimitLayer::new(Limit::per_hour(100).unwrap())
            .with_key(GlobalKey)
            .with_store(store)
            .with_timeout(Some(Duration::from_millis(200)))
            .with_on_store_error(policy.clone())
            .with_adaptive(fixed(1));
        let handle = layer.adaptive_handle().unwrap();
        let gate = Arc::new(Semaphore::new(0));
        let service = layer.layer(gated(gate.clone()));
        let held = {
            let mut service = service.clone();
            tokio::spawn(async move {
                service.ready().await.unwrap();
                let response = service.call(request()).await.unwrap();
                let status = response.status();
                response.into_body().collect().await.unwrap();
                status
            })
        };
        tokio::task::yield_now().await;
        let mut service = service.clone();
        assert_eq!(
            status(&mut service).await,
            StatusCode::SERVICE_UNAVAILABLE,
            "{}: shed while Redis is down", policy.as_str()
        );
        gate.add_permits(1);
        let first = held.await.unwrap();
        let expected = match policy {
            FailurePolicy::Deny => StatusCode::SERVICE_UNAVAILABLE,
            _ => StatusCode::OK,
        };
        assert_eq!(first, expected, "{}", policy.as_str());
        assert_eq!(handle.snapshot().in_flight, 0, "{}", policy.as_str());
        // Limiting comes back: a request in flight again sheds the next.
        let _again = {
            let mut service = service.clone();
            service.ready().await.unwrap();
            service.call(request())
        };
        assert_eq!(
            status(&mut service).await,
            StatusCode::SERVICE_UNAVAILABLE,
            "{}",
            policy.as_str()
        );
    }
}
