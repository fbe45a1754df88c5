//! `RateLimitLayer::with_max_wait`: a denied request whose `retry_after` is within the bound
//! waits and then passes, instead of a 429; the line is bounded per layer and per key, and
//! a client that hangs up gives its place back. Most of these use fixed windows, which
//! wait and ask again; reservations (token bucket, GCRA) are in tests/reserve.rs.
//!
//! Time is Tokio's, paused: the store reads a clock that follows it, so a request that
//! sleeps its `retry_after` finds the store's window rolled exactly then.

#[cfg(feature = "redis")]
use tollgate_test_support as support;

use std::{convert::Infallible, time::Duration};

use futures_util::FutureExt;
use http::{Request, Response, StatusCode};
use tokio::time::Instant;
use tollgate::{
    Limit, RateLimitLayer, clock::Clock, count_after::RateLimitBody, key::HeaderKey,
    store::MemoryStore,
};
use tower::{Layer, Service, ServiceExt, service_fn};

/// Milliseconds since a start on an aligned second, on Tokio's clock.
#[derive(Debug, Clone)]
struct TokioClock {
    start: Instant,
}

/// A whole second: fixed windows of a second start with the test.
const EPOCH_MS: u64 = 1_700_000_000_000;

impl Clock for TokioClock {
    fn now_ms(&self) -> u64 {
        EPOCH_MS + self.start.elapsed().as_millis() as u64
    }
}

type Svc = tower::util::BoxCloneService<Request<()>, Response<RateLimitBody<String>>, Infallible>;

/// 2 a second per `x-key`, waiting up to `max_wait`, at most `total` and `per_key`
/// waiters.
fn service(max_wait: Duration, total: usize, per_key: usize) -> Svc {
    let clock = TokioClock {
        start: Instant::now(),
    };
    service_on(
        MemoryStore::new().with_clock(clock),
        max_wait,
        total,
        per_key,
    )
}

fn service_on(
    store: impl tollgate::store::Store,
    max_wait: Duration,
    total: usize,
    per_key: usize,
) -> Svc {
    let layer = RateLimitLayer::new(Limit::fixed_window(2, Duration::from_secs(1)).unwrap())
        .with_key(HeaderKey::new("x-key").unwrap())
        .with_store(store)
        // Paused time runs ahead while Redis answers: no timeout.
        .with_timeout(None)
        .with_max_wait(Some(max_wait))
        .with_max_waiters(total, per_key);
    let inner =
        service_fn(|_: Request<()>| async { Ok::<_, Infallible>(Response::new("ok".to_owned())) });
    tower::util::BoxCloneService::new(layer.layer(inner))
}

fn request(key: &str) -> Request<()> {
    Request::get("/").header("x-key", key).body(()).unwrap()
}

async fn send(service: &Svc, key: &str) -> (StatusCode, Duration) {
    let start = Instant::now();
    let response = service.clone().oneshot(request(key)).await.unwrap();
    (response.status(), start.elapsed())
}

#[tokio::test(start_paused = true)]
async fn a_request_within_max_wait_waits_and_passes() {
    let service = service(Duration::from_secs(2), 10, 10);
    tokio::time::advance(Duration::from_millis(300)).await;
    for _ in 0..2 {
        assert_eq!(send(&service, "a").await, (StatusCode::OK, Duration::ZERO));
    }
    // Denied until the window ends in 700 ms: waits exactly that long, then passes.
    let (status, waited) = send(&service, "a").await;
    assert_eq!(status, StatusCode::OK);
    assert_eq!(waited, Duration::from_millis(700));
    // Limiting holds: the next window has one unit left, then a wait of a second.
    assert_eq!(send(&service, "a").await, (StatusCode::OK, Duration::ZERO));
    assert_eq!(
        send(&service, "a").await,
        (StatusCode::OK, Duration::from_secs(1))
    );
}

#[tokio::test(start_paused = true)]
async fn a_request_beyond_max_wait_is_denied_at_once() {
    let service = service(Duration::from_millis(500), 10, 10);
    tokio::time::advance(Duration::from_millis(300)).await;
    for _ in 0..2 {
        send(&service, "a").await;
    }
    // 700 ms to wait, 500 allowed.
    assert_eq!(
        send(&service, "a").await,
        (StatusCode::TOO_MANY_REQUESTS, Duration::ZERO)
    );
}

/// Polls a request once (it starts waiting) and returns its future.
fn start(service: &Svc, key: &str) -> tollgate_future::Boxed {
    let mut service = service.clone();
    let request = request(key);
    let mut future: tollgate_future::Boxed = Box::pin(async move {
        service.ready().await.unwrap();
        service.call(request).await.unwrap()
    });
    assert!(future.as_mut().now_or_never().is_none(), "it waits");
    future
}

mod tollgate_future {
    pub(crate) type Boxed = std::pin::Pin<
        Box<
            dyn std::future::Future<
                    Output = http::Response<tollgate::count_after::RateLimitBody<String>>,
                > + Send,
        >,
    >;
}

#[tokio::test(start_paused = true)]
async fn the_line_is_bounded_per_key_and_per_layer_and_a_hang_up_leaves_it() {
    let service = service(Duration::from_secs(5), 2, 1);
    for key in ["a", "b", "c"] {
        for _ in 0..2 {
            send(&service, key).await;
        }
    }
    let a = start(&service, "a");
    // One waiter per key: a second one for "a" is denied at once.
    assert_eq!(send(&service, "a").await.0, StatusCode::TOO_MANY_REQUESTS);
    let b = start(&service, "b");
    // Two per layer: "c" is denied at once.
    assert_eq!(send(&service, "c").await.0, StatusCode::TOO_MANY_REQUESTS);
    // "a" hangs up: its place, for its key and in the layer, is free again.
    drop(a);
    let a = start(&service, "a");
    assert_eq!(send(&service, "c").await.0, StatusCode::TOO_MANY_REQUESTS);
    let (a, b) = tokio::join!(a, b);
    assert_eq!(a.status(), StatusCode::OK);
    assert_eq!(b.status(), StatusCode::OK);
    // Both answered: both places are free (in a new window, after two requests each).
    for key in ["c", "d", "e"] {
        for _ in 0..2 {
            assert_eq!(send(&service, key).await.0, StatusCode::OK);
        }
    }
    let c = start(&service, "c");
    let d = start(&service, "d");
    assert_eq!(send(&service, "e").await.0, StatusCode::TOO_MANY_REQUESTS);
    drop((c, d));
}

/// A waiter that is overtaken (the units it waited for went to a later request) waits
/// again while its whole wait stays within `max_wait`; beyond that it gets the 429.
#[tokio::test(start_paused = true)]
async fn an_overtaken_waiter_waits_again_within_max_wait_only() {
    let service = service(Duration::from_millis(1500), 10, 10);
    tokio::time::advance(Duration::from_millis(300)).await;
    for _ in 0..2 {
        send(&service, "a").await;
    }
    let t0 = Instant::now();
    let waiter = start(&service, "a");
    // At the window's end, two others take both units before the waiter is polled again.
    tokio::time::advance(Duration::from_millis(700)).await;
    let (s1, s2) = (send(&service, "a").await.0, send(&service, "a").await.0);
    assert_eq!((s1, s2), (StatusCode::OK, StatusCode::OK));
    // The waiter is denied again with a second to wait: 1.7 s in all, over 1.5 s.
    let response = waiter.await;
    assert_eq!(response.status(), StatusCode::TOO_MANY_REQUESTS);
    assert_eq!(t0.elapsed(), Duration::from_millis(700));
    assert_eq!(response.headers()["retry-after"], "1");
}

/// Overtaken, but the next wait still ends within `max_wait`: it waits again and passes.
#[tokio::test(start_paused = true)]
async fn an_overtaken_waiter_within_max_wait_waits_again_and_passes() {
    let service = service(Duration::from_millis(1800), 10, 10);
    tokio::time::advance(Duration::from_millis(300)).await;
    for _ in 0..2 {
        send(&service, "a").await;
    }
    let t0 = Instant::now();
    let waiter = start(&service, "a");
    tokio::time::advance(Duration::from_millis(700)).await;
    for _ in 0..2 {
        assert_eq!(send(&service, "a").await.0, StatusCode::OK);
    }
    let response = waiter.await;
    assert_eq!(response.status(), StatusCode::OK);
    assert_eq!(t0.elapsed(), Duration::from_millis(1700));
}

/// On Redis the decision is not ready at once: the response future waits for it (a
/// reservation, GCRA reserves), then waits its turn and runs. Real time (Tokio's paused clock jumps ahead to
/// the Redis connection's own timers while it waits for Redis, so it cannot time this):
/// a GCRA of 1 per 500 ms on Redis's clock makes the second request wait about 500 ms;
/// the bounds are generous, the order of events is what is checked.
#[cfg(feature = "redis")]
#[tokio::test]
async fn a_request_waits_on_redis_too() {
    let server = support::RedisServer::start();
    let store = tollgate::store::RedisStore::connect(server.url())
        .await
        .unwrap();
    let layer = RateLimitLayer::new(Limit::gcra(1, Duration::from_millis(500)).unwrap())
        .with_key(HeaderKey::new("x-key").unwrap())
        .with_store(store)
        .with_timeout(Some(Duration::from_secs(10)))
        .with_max_wait(Some(Duration::from_secs(5)))
        .with_max_waiters(10, 10);
    let inner =
        service_fn(|_: Request<()>| async { Ok::<_, Infallible>(Response::new("ok".to_owned())) });
    let service: Svc = tower::util::BoxCloneService::new(layer.layer(inner));
    let t0 = std::time::Instant::now();
    assert_eq!(send(&service, "a").await.0, StatusCode::OK);
    let (status, _) = send(&service, "a").await;
    assert_eq!(
        status,
        StatusCode::OK,
        "the second request waits, then passes"
    );
    // Not before the first request's emission interval is over (less the first call's
    // own time, at most), and well within max_wait.
    let waited = t0.elapsed();
    assert!(
        waited >= Duration::from_millis(400) && waited < Duration::from_secs(5),
        "{waited:?}"
    );
    // Without max_wait, the same two requests: the second is a 429 (it is sent at once,
    // well within the 500 ms).
    let strict = RateLimitLayer::new(Limit::gcra(1, Duration::from_millis(500)).unwrap())
        .with_key(HeaderKey::new("x-key").unwrap())
        .with_store(
            tollgate::store::RedisStore::connect(server.url())
                .await
                .unwrap()
                .with_prefix("strict")
                .unwrap(),
        )
        .with_timeout(Some(Duration::from_secs(10)));
    let inner =
        service_fn(|_: Request<()>| async { Ok::<_, Infallible>(Response::new("ok".to_owned())) });
    let strict: Svc = tower::util::BoxCloneService::new(strict.layer(inner));
    assert_eq!(send(&strict, "a").await.0, StatusCode::OK);
    assert_eq!(send(&strict, "a").await.0, StatusCode::TOO_MANY_REQUESTS);
}

/// Over real HTTP (axum, real time): the second request of a GCRA of 1 per 2 s waits
/// about 2 s and passes; a client that hangs up while it waits gives its place (the only
/// one) back, so the next request may wait in turn instead of a 429.
#[tokio::test]
async fn over_http_a_waiter_passes_and_a_hang_up_frees_its_place() {
    use axum::{Router, routing::get};
    use http_body_util::Empty;
    use hyper_util::{client::legacy::Client, rt::TokioExecutor};

    let layer = RateLimitLayer::new(Limit::gcra(1, Duration::from_secs(2)).unwrap())
        .with_key(HeaderKey::new("x-key").unwrap())
        .with_max_wait(Some(Duration::from_secs(5)))
        .with_max_waiters(1, 1);
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    let app = Router::new()
        .route("/", get(|| async { "ok" }))
        .layer(layer);
    tokio::spawn(async move { axum::serve(listener, app).await.unwrap() });
    let client = Client::builder(TokioExecutor::new()).build_http::<Empty<bytes::Bytes>>();
    let get = |key: &'static str| {
        let request = Request::get(format!("http://{addr}/"))
            .header("x-key", key)
            .body(Empty::new())
            .unwrap();
        client.request(request)
    };
    async fn within<F: std::future::Future>(future: F) -> F::Output {
        tokio::time::timeout(Duration::from_secs(10), future)
            .await
            .expect("an answer within 10 s")
    }

    assert_eq!(within(get("a")).await.unwrap().status(), StatusCode::OK);
    let start = std::time::Instant::now();
    let waited = within(get("a")).await.unwrap();
    assert_eq!(waited.status(), StatusCode::OK);
    // 2 s less the moments between the two requests (under a second, generously).
    assert!(
        start.elapsed() >= Duration::from_secs(1),
        "{:?}",
        start.elapsed()
    );

    // "b" spends its unit; its next request waits (reserved for 2 s on), and its client
    // gives up after 200 ms.
    let b0 = std::time::Instant::now();
    assert_eq!(within(get("b")).await.unwrap().status(), StatusCode::OK);
    assert!(
        tokio::time::timeout(Duration::from_millis(200), get("b"))
            .await
            .is_err()
    );
    // The place is free again (one in all): this one waits and passes.
    let response = within(async {
        loop {
            let response = get("b").await.unwrap();
            // The server may not have seen the hang-up yet: then a quick 429.
            if response.status() != StatusCode::TOO_MANY_REQUESTS {
                return response;
            }
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    })
    .await;
    assert_eq!(response.status(), StatusCode::OK);
    // The hang-up gave its units back too: this one took its turn at 2 s, not 4 s.
    assert!(b0.elapsed() < Duration::from_secs(3), "{:?}", b0.elapsed());
}

/// A request that waited its turn counts as delayed, with the outcome it is counted as
/// (`allowed` once its window came); one denied at once (its `retry_after` beyond
/// `max_wait`) does not.
#[cfg(feature = "metrics")]
#[test]
fn a_request_that_waited_counts_as_delayed() {
    let recorder = metrics_exporter_prometheus::PrometheusBuilder::new().build_recorder();
    let runtime = tokio::runtime::Builder::new_current_thread()
        .enable_time()
        .start_paused(true)
        .build()
        .unwrap();
    metrics::with_local_recorder(&recorder, || {
        runtime.block_on(async {
            let waits = service(Duration::from_secs(2), 16, 16);
            let denies = service(Duration::from_millis(500), 16, 16);
            for _ in 0..2 {
                assert_eq!(send(&waits, "a").await.0, StatusCode::OK);
                assert_eq!(send(&denies, "b").await.0, StatusCode::OK);
            }
            // Before the wait below rolls the window.
            assert_eq!(send(&denies, "b").await.0, StatusCode::TOO_MANY_REQUESTS);
            let (status, waited) = send(&waits, "a").await;
            assert_eq!(status, StatusCode::OK);
            assert_eq!(waited, Duration::from_secs(1));
        });
    });
    let page = recorder.handle().render();
    let count = |name: &str, outcome: &str| -> Option<f64> {
        page.lines()
            .filter(|line| line.starts_with(&format!("{name}{{")))
            .find(|line| line.contains(&format!("outcome=\"{outcome}\"")))
            .and_then(|line| line.rsplit(' ').next()?.parse().ok())
    };
    let delayed = tollgate::metrics::DELAYED_REQUESTS_TOTAL;
    assert_eq!(count(delayed, "allowed"), Some(1.0), "{page}");
    assert_eq!(count(delayed, "denied"), None, "{page}");
    assert_eq!(
        count("tollgate_requests_total", "allowed"),
        Some(5.0),
        "{page}"
    );
    assert_eq!(
        count("tollgate_requests_total", "denied"),
        Some(1.0),
        "{page}"
    );
}
