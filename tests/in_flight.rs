//! `InFlightLayer`: at most N requests in flight per key, in memory, on one Redis and on a
//! Redis Cluster. Requests hold their response bodies open; a permit comes back when the
//! body ends, when the body or the response future is dropped, and when the inner service
//! fails. In Redis, permits are leases: a node that dies holds them one lease at most, a
//! request that runs longer than its lease keeps it, and every key has a TTL.
//!
//! Redis gives permits back from a spawned task, so after a release the tests ask again
//! until the permit is free, within a generous deadline (never a fixed sleep).

#[cfg(feature = "redis")]
use tollgate_test_support as support;

use std::{
    convert::Infallible,
    io,
    sync::{
        Arc,
        atomic::{AtomicBool, AtomicUsize, Ordering},
    },
    time::{Duration, Instant},
};

use axum::body::Body;
use bytes::Bytes;
use http::{Request, Response, StatusCode, header::RETRY_AFTER};
use http_body_util::BodyExt;
use tokio::sync::{Notify, Semaphore};
use tollgate::{
    CircuitBreaker, ConfigError, FailurePolicy, StoreError, StoreErrorKind,
    in_flight::{InFlight, InFlightBody, InFlightLayer},
    key::{HeaderKey, Key, KeyExtractor},
    store::{Acquired, Check, MemoryStore, Permit, Permits},
};
use tower::{Service, ServiceExt, service_fn};

/// How long a permit given back may take to be free again (Redis: a spawned `ZREM`).
const DEADLINE: Duration = Duration::from_secs(10);
/// The tests' permit TTL.
const TTL: Duration = Duration::from_secs(60);

type Handler = tower::util::BoxCloneSyncService<Request<Body>, Response<Body>, io::Error>;
type Limited = InFlight<Handler, HeaderKey, tollgate::DefaultRejection>;
type Answer = Response<InFlightBody<Body>>;

/// What the test controls in the handler: `gate` ends one open body per permit added;
/// `entered` is told when a request with `x-hang` (which never answers) reached it.
struct App {
    gate: Arc<Semaphore>,
    entered: Arc<Notify>,
}

impl App {
    fn new() -> Self {
        Self {
            gate: Arc::new(Semaphore::new(0)),
            entered: Arc::new(Notify::new()),
        }
    }

    /// The handler: 200 with a body that stays open until the gate lets it end; `x-hang`
    /// never answers, `x-fail` fails.
    fn handler(&self) -> Handler {
        let gate = self.gate.clone();
        let entered = self.entered.clone();
        tower::util::BoxCloneSyncService::new(service_fn(move |req: Request<Body>| {
            let gate = gate.clone();
            let entered = entered.clone();
            async move {
                if req.headers().contains_key("x-hang") {
                    entered.notify_one();
                    std::future::pending::<()>().await;
                }
                if req.headers().contains_key("x-fail") {
                    return Err(io::Error::other("inner service failed"));
                }
                Ok(Response::new(gated_body(gate)))
            }
        }))
    }

    fn service(&self, layer: &InFlightLayer<HeaderKey>) -> Limited {
        tower::Layer::layer(layer, self.handler())
    }

    /// Lets `answer`'s body end, and reads it to its end; the body is returned, not
    /// dropped, so that only its end can have given its permit back.
    async fn finish(&self, answer: Answer) -> InFlightBody<Body> {
        self.gate.add_permits(1);
        let mut body = answer.into_body();
        let mut data = Vec::new();
        while let Some(frame) = body.frame().await {
            data.extend_from_slice(&frame.unwrap().into_data().unwrap());
        }
        assert_eq!(&data[..], b"done");
        assert!(!body.holds_permit());
        body
    }
}

/// A body that sends `done` and ends once `gate` has a permit for it.
fn gated_body(gate: Arc<Semaphore>) -> Body {
    Body::from_stream(futures_util::stream::once(async move {
        gate.acquire().await.unwrap().forget();
        Ok::<_, Infallible>(Bytes::from_static(b"done"))
    }))
}

fn request(client: &str) -> Request<Body> {
    Request::get("/")
        .header("x-client", client)
        .body(Body::empty())
        .unwrap()
}

fn flagged(client: &str, flag: &str) -> Request<Body> {
    let mut request = request(client);
    request.headers_mut().insert(
        http::HeaderName::from_bytes(flag.as_bytes()).unwrap(),
        "1".parse().unwrap(),
    );
    request
}

fn by_client(max: u32) -> InFlightLayer<HeaderKey> {
    InFlightLayer::new(max)
        .unwrap()
        .with_key(HeaderKey::new("x-client").unwrap())
        // A loaded machine must not fail a Redis call open: these tests are about counts.
        .with_timeout(Some(Duration::from_secs(10)))
        // Longer than DEADLINE: a permit that is not given back cannot pass for one that is.
        .with_permit_ttl(TTL)
}

async fn send(service: &mut Limited, request: Request<Body>) -> Answer {
    service.ready().await.unwrap().call(request).await.unwrap()
}

fn assert_denied(answer: &Answer) {
    assert_eq!(answer.status(), StatusCode::TOO_MANY_REQUESTS);
    assert_eq!(answer.headers()[RETRY_AFTER], "1");
    assert!(!answer.body().holds_permit());
}

/// Asks until `client` gets a permit (within [`DEADLINE`]) and returns the answer holding it.
async fn until_allowed(service: &mut Limited, client: &str) -> Answer {
    let start = Instant::now();
    loop {
        let answer = send(service, request(client)).await;
        if answer.status() == StatusCode::OK {
            assert!(answer.body().holds_permit());
            return answer;
        }
        assert_denied(&answer);
        assert!(start.elapsed() < DEADLINE, "the permit never came back");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

/// The contract every store keeps, with at most 2 in flight per client.
async fn two_in_flight(layer: InFlightLayer<HeaderKey>) {
    let app = App::new();
    let mut service = app.service(&layer);

    // Two held open; the third waits for one of them.
    let first = send(&mut service, request("a")).await;
    let second = send(&mut service, request("a")).await;
    assert_eq!(first.status(), StatusCode::OK);
    assert_eq!(second.status(), StatusCode::OK);
    assert!(first.body().holds_permit() && second.body().holds_permit());
    assert_denied(&send(&mut service, request("a")).await);
    // Another client has permits of its own.
    let other = send(&mut service, request("b")).await;
    assert_eq!(other.status(), StatusCode::OK);

    // A body read to its end gives its permit back.
    let _ended = app.finish(first).await;
    let third = until_allowed(&mut service, "a").await;
    assert_denied(&send(&mut service, request("a")).await);

    // So does a body dropped before its end.
    drop(second);
    let fourth = until_allowed(&mut service, "a").await;
    assert_denied(&send(&mut service, request("a")).await);

    // And a response future dropped while the inner service works.
    drop(third);
    let hanging = {
        let mut service = service.clone();
        tokio::spawn(async move { send(&mut service, flagged("a", "x-hang")).await })
    };
    app.entered.notified().await;
    assert_denied(&send(&mut service, request("a")).await);
    hanging.abort();
    let _ = hanging.await;
    let fifth = until_allowed(&mut service, "a").await;

    // And a failing inner service.
    drop(fifth);
    let start = Instant::now();
    // Once the permit is back, the failing request takes it, and gives it back.
    while let Ok(answer) = service
        .ready()
        .await
        .unwrap()
        .call(flagged("a", "x-fail"))
        .await
    {
        assert_denied(&answer);
        assert!(start.elapsed() < DEADLINE, "the permit never came back");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    let sixth = until_allowed(&mut service, "a").await;
    assert_denied(&send(&mut service, request("a")).await);

    // Everything given back: two permits again, never three.
    drop((fourth, sixth, other));
    let _one = until_allowed(&mut service, "a").await;
    let _two = until_allowed(&mut service, "a").await;
    assert_denied(&send(&mut service, request("a")).await);
}

#[tokio::test]
async fn memory_allows_two_in_flight_per_client() {
    two_in_flight(by_client(2)).await;
}

#[test]
fn zero_in_flight_is_rejected_naming_the_field() {
    let error: ConfigError = InFlightLayer::new(0).unwrap_err();
    assert_eq!(error.field(), "max_in_flight");
}

/// Memory gives permits back at once: no waiting needed.
#[tokio::test]
async fn memory_gives_permits_back_at_once() {
    let app = App::new();
    let mut service = app.service(&by_client(1));
    let first = send(&mut service, request("a")).await;
    assert_denied(&send(&mut service, request("a")).await);
    let _ended = app.finish(first).await;
    let second = send(&mut service, request("a")).await;
    assert_eq!(second.status(), StatusCode::OK);
    drop(second);
    assert_eq!(
        send(&mut service, request("a")).await.status(),
        StatusCode::OK
    );
}

/// A gRPC call over the limit gets RESOURCE_EXHAUSTED, never HTTP 429.
#[tokio::test]
async fn grpc_calls_get_resource_exhausted() {
    let app = App::new();
    let mut service = app.service(&by_client(1));
    let _held = send(&mut service, request("a")).await;
    let mut call = request("a");
    call.headers_mut().insert(
        http::header::CONTENT_TYPE,
        "application/grpc".parse().unwrap(),
    );
    let answer = send(&mut service, call).await;
    assert_eq!(answer.status(), StatusCode::OK);
    assert_eq!(answer.headers()["grpc-status"], "8");
    assert_eq!(answer.headers()[RETRY_AFTER], "1");
}

/// Over real HTTP: a response whose body is still streaming holds its permit.
#[tokio::test]
async fn axum_responses_hold_their_permit_until_the_body_ends() {
    use hyper_util::{client::legacy::Client, rt::TokioExecutor};

    let app = App::new();
    let gate = app.gate.clone();
    let router = axum::Router::new()
        .fallback(move || std::future::ready(gated_body(gate.clone())))
        .layer(by_client(2));
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    tokio::spawn(async move { axum::serve(listener, router).await.unwrap() });
    let client = Client::builder(TokioExecutor::new()).build_http::<http_body_util::Empty<Bytes>>();
    let get = || {
        let request = Request::get(format!("http://{addr}/"))
            .header("x-client", "a")
            .body(http_body_util::Empty::new())
            .unwrap();
        client.request(request)
    };
    let first = get().await.unwrap();
    let second = get().await.unwrap();
    assert_eq!(first.status(), StatusCode::OK);
    assert_eq!(second.status(), StatusCode::OK);
    let third = get().await.unwrap();
    assert_eq!(third.status(), StatusCode::TOO_MANY_REQUESTS);
    assert_eq!(third.headers()[RETRY_AFTER], "1");

    // The first body ends: its permit is free once the server has sent the end.
    app.gate.add_permits(1);
    let body = first.into_body().collect().await.unwrap().to_bytes();
    assert_eq!(&body[..], b"done");
    let start = Instant::now();
    let _held = loop {
        let answer = get().await.unwrap();
        if answer.status() == StatusCode::OK {
            break answer;
        }
        assert!(start.elapsed() < DEADLINE, "the permit never came back");
        tokio::time::sleep(Duration::from_millis(20)).await;
    };
    assert_eq!(get().await.unwrap().status(), StatusCode::TOO_MANY_REQUESTS);
}

/// A store that fails every call (a backend that refuses), or never answers while
/// `stalled`; it counts the calls that reach it.
#[derive(Debug, Default)]
struct Failing {
    calls: AtomicUsize,
    stalled: AtomicBool,
}

impl Permits for Failing {
    fn acquire(&self, _key: &Key, _max: u32, _ttl: Duration) -> Check<Acquired> {
        self.calls.fetch_add(1, Ordering::SeqCst);
        if self.stalled.load(Ordering::SeqCst) {
            return Check::pending(std::future::pending());
        }
        Check::ready(Err(StoreError::new(
            StoreErrorKind::Unavailable,
            "connection refused",
        )))
    }

    fn release(&self, _permit: Permit) {
        unreachable!("no permit was ever taken");
    }
}

/// The key `by_client` counts `client`'s requests under.
fn key_of(client: &str) -> Key {
    HeaderKey::new("x-client")
        .unwrap()
        .extract(&request(client))
        .unwrap()
}

fn failing() -> Arc<Failing> {
    Arc::new(Failing::default())
}

/// `FailurePolicy::Local(store)` counts the permits in `store` while the store fails:
/// two layers with one fallback store share a key's permits, and the store sees them.
#[tokio::test]
async fn the_local_policy_counts_in_its_own_memory_store() {
    let memory = MemoryStore::new();
    let layer = |store: Arc<Failing>| {
        by_client(1)
            .with_store(store)
            .with_circuit_breaker(None)
            .with_on_store_error(FailurePolicy::Local(memory.clone()))
    };
    let app = App::new();
    let mut one = app.service(&layer(failing()));
    let mut other = app.service(&layer(failing()));
    let held = send(&mut one, request("a")).await;
    assert_eq!(held.status(), StatusCode::OK);
    assert!(held.body().holds_permit());
    // The other layer's fallback is the same store: no permit left for `a`.
    assert_denied(&send(&mut other, request("a")).await);
    let key = key_of("a");
    let acquired = memory
        .acquire(&key, 1, TTL)
        .await
        .expect("a memory store answers");
    assert!(!acquired.is_taken(), "the fallback store holds the permit");
    // Back in the store once the body ends.
    let _ended = app.finish(held).await;
    let permit = memory.acquire(&key, 1, TTL).await.unwrap().into_permit();
    memory.release(permit.expect("the permit came back to the fallback store"));
    let again = send(&mut other, request("a")).await;
    assert!(again.body().holds_permit());
}

/// A failing store is asked until the breaker opens, then skipped; the failure policy
/// answers meanwhile, logged as a rate limit's store failure under the layer's name.
#[tokio::test]
async fn a_failing_store_opens_the_circuit_and_the_policy_answers() {
    let (logs, _guard) = support::logs::Logs::capture();
    let store = failing();
    let layer = by_client(1)
        .with_store(store.clone())
        .with_circuit_breaker(Some(CircuitBreaker::new(2, Duration::from_secs(60))))
        .with_on_store_error(FailurePolicy::Deny)
        .with_name("uploads");
    let app = App::new();
    let mut service = app.service(&layer);
    for _ in 0..5 {
        let answer = send(&mut service, request("a")).await;
        assert_eq!(answer.status(), StatusCode::SERVICE_UNAVAILABLE);
        assert!(!answer.body().holds_permit());
    }
    assert_eq!(store.calls.load(Ordering::SeqCst), 2, "the circuit opened");
    let text = logs.text();
    let failed: Vec<_> = text
        .lines()
        .filter(|line| line.contains("rate limit store failed"))
        .collect();
    assert_eq!(failed.len(), 2, "{text}");
    assert!(
        failed[0].contains("layer=\"uploads\"") || failed[0].contains("layer=uploads"),
        "{text}"
    );
    assert!(failed[0].contains("policy=\"deny\"") || failed[0].contains("policy=deny"));
    assert!(!failed[0].contains("key=a "), "the key is redacted: {text}");
    assert_eq!(
        text.matches("rate limit store skipped").count(),
        3,
        "{text}"
    );

    // Without a breaker every request asks the store.
    let store = failing();
    let layer = by_client(1)
        .with_store(store.clone())
        .with_circuit_breaker(None);
    let mut service = app.service(&layer);
    for _ in 0..5 {
        let answer = send(&mut service, request("a")).await;
        // Fails open (the default), holding nothing.
        assert_eq!(answer.status(), StatusCode::OK);
        assert!(!answer.body().holds_permit());
    }
    assert_eq!(store.calls.load(Ordering::SeqCst), 5);
}

/// A store that does not answer is given up on after the timeout.
#[tokio::test(start_paused = true)]
async fn a_store_that_does_not_answer_times_out() {
    let store = failing();
    store.stalled.store(true, Ordering::SeqCst);
    let layer = by_client(1)
        .with_store(store.clone())
        .with_timeout(Some(Duration::from_millis(50)))
        .with_on_store_error(FailurePolicy::Deny);
    let app = App::new();
    let mut service = app.service(&layer);
    let start = tokio::time::Instant::now();
    let answer = send(&mut service, request("a")).await;
    assert_eq!(answer.status(), StatusCode::SERVICE_UNAVAILABLE);
    assert_eq!(start.elapsed(), Duration::from_millis(50));
}

/// Each layer counts its requests under its name (feature `metrics`).
#[cfg(feature = "metrics")]
#[test]
fn requests_are_counted_under_the_layers_name() {
    use metrics_exporter_prometheus::PrometheusBuilder;

    let recorder = PrometheusBuilder::new().build_recorder();
    let runtime = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap();
    metrics::with_local_recorder(&recorder, || {
        runtime.block_on(async {
            let app = App::new();
            let mut service = app.service(&by_client(1).with_name("streams"));
            let _held = send(&mut service, request("a")).await;
            assert_denied(&send(&mut service, request("a")).await);
            assert_denied(&send(&mut service, request("a")).await);
            let missing = Request::get("/").body(Body::empty()).unwrap();
            let answer = send(&mut service, missing).await;
            assert_eq!(answer.status(), StatusCode::BAD_REQUEST);
        });
    });
    let page = recorder.handle().render();
    let count = |outcome: &str| -> u64 {
        let labels = format!(r#"route="streams",outcome="{outcome}""#);
        page.lines()
            .find(|line| line.starts_with("tollgate_requests_total{") && line.contains(&labels))
            .map_or(0, |line| line.rsplit(' ').next().unwrap().parse().unwrap())
    };
    assert_eq!(count("allowed"), 1, "{page}");
    assert_eq!(count("denied"), 2, "{page}");
    assert_eq!(count("key_missing"), 1, "{page}");
    assert!(
        page.contains(r#"tollgate_decision_seconds_count{route="streams"} 3"#),
        "{page}"
    );
}

#[cfg(feature = "redis")]
mod redis {
    #[cfg_attr(not(feature = "cluster"), allow(unused_imports))]
    use tollgate::{
        clock::ManualClock,
        store::{Permits, RedisStore},
    };

    use super::{support::RedisServer, *};

    const NOW_MS: u64 = 1_700_000_000_000;

    async fn store(server: &RedisServer) -> RedisStore {
        RedisStore::connect(server.url()).await.unwrap()
    }

    #[tokio::test]
    async fn redis_allows_two_in_flight_per_client() {
        let server = RedisServer::start();
        two_in_flight(by_client(2).with_store(store(&server).await)).await;
        // Released permits leave nothing behind that lives forever.
        support::assert_every_key_expires(&server);
    }

    #[cfg(feature = "cluster")]
    #[tokio::test]
    async fn cluster_allows_two_in_flight_per_client() {
        let cluster = support::cluster::RedisCluster::start();
        let store = RedisStore::connect(tollgate::store::RedisTarget::cluster(&cluster.urls()))
            .await
            .unwrap();
        // As an app that holds its store as `Arc<dyn Permits>` gives it.
        let store: Arc<dyn Permits> = Arc::new(store);
        two_in_flight(by_client(2).with_store(store.clone())).await;
        // Two replicas (layers of their own) share the permits.
        let app = App::new();
        let mut one = app.service(&by_client(2).with_store(store.clone()));
        let mut other = app.service(&by_client(2).with_store(store));
        let _first = until_allowed(&mut one, "c").await;
        let _second = until_allowed(&mut one, "c").await;
        assert_denied(&send(&mut other, request("c")).await);
    }

    /// Through Sentinel, as the README's ACL user: the permit scripts go as EVALSHA there
    /// as everywhere (they went as EVAL, which that user may not run, and every permit
    /// failed).
    #[cfg(feature = "sentinel")]
    #[tokio::test]
    async fn sentinel_allows_two_in_flight_per_client() {
        use support::sentinel::{MASTER_NAME, SentinelSetup};
        let setup = SentinelSetup::start();
        for server in &setup.servers {
            support::acl::set_user(
                server,
                &support::acl::documented_rules("tollgate", "tollgate"),
            );
        }
        let config = tollgate::store::SentinelConfig::new(&setup.sentinel_urls(), MASTER_NAME)
            .with_master_user(Some("tollgate"), support::acl::PASSWORD);
        let store = RedisStore::connect(config.clone()).await.unwrap();
        two_in_flight(by_client(2).with_store(store)).await;
    }

    /// Held permits are keys with a TTL no longer than the lease, named with the key's
    /// hash tag.
    #[tokio::test]
    async fn permits_are_leases_with_a_ttl() {
        let server = RedisServer::start();
        let layer = by_client(3).with_store(store(&server).await);
        let app = App::new();
        let mut service = app.service(&layer);
        let _held = send(&mut service, request("a")).await;
        let keys = server.cli(&["--scan"]).unwrap();
        let key = keys.lines().next().unwrap().to_owned();
        assert!(
            key.starts_with("tollgate:{") && key.ends_with("}:inflight:3"),
            "{key}"
        );
        assert_eq!(server.cli(&["ZCARD", &key]).unwrap().trim(), "1");
        let ttl: u64 = server.cli(&["PTTL", &key]).unwrap().trim().parse().unwrap();
        assert!(ttl > 0 && ttl <= 60_000, "{ttl}");
        assert_eq!(support::assert_every_key_expires(&server), 1);
    }

    /// A node that dies (its runtime gone, no release, no renewal) holds its permits until
    /// their lease ends, and not longer.
    #[tokio::test]
    async fn a_dead_nodes_permits_end_with_their_lease() {
        let server = RedisServer::start();
        let url = server.url();
        // The node: takes both permits, then dies with them.
        std::thread::spawn(move || {
            let runtime = tokio::runtime::Runtime::new().unwrap();
            runtime.block_on(async {
                let store = RedisStore::connect(url)
                    .await
                    .unwrap()
                    .with_clock(ManualClock::new(NOW_MS));
                let layer = by_client(2).with_store(store);
                let app = App::new();
                let mut service = app.service(&layer);
                for _ in 0..2 {
                    let answer = send(&mut service, request("a")).await;
                    assert_eq!(answer.status(), StatusCode::OK);
                    std::mem::forget(answer);
                }
            });
            drop(runtime);
        })
        .join()
        .unwrap();

        let clock = ManualClock::new(NOW_MS);
        let layer = by_client(2).with_store(store(&server).await.with_clock(clock.clone()));
        let app = App::new();
        let mut service = app.service(&layer);
        assert_denied(&send(&mut service, request("a")).await);
        clock.advance(TTL - Duration::from_millis(1));
        assert_denied(&send(&mut service, request("a")).await);
        clock.advance(Duration::from_millis(2));
        let first = send(&mut service, request("a")).await;
        let second = send(&mut service, request("a")).await;
        assert_eq!(first.status(), StatusCode::OK);
        assert_eq!(second.status(), StatusCode::OK);
        assert_denied(&send(&mut service, request("a")).await);
    }

    /// A request that runs for several leases keeps its permit: it is renewed.
    #[tokio::test]
    async fn long_requests_renew_their_permit() {
        let server = RedisServer::start();
        let layer = by_client(1)
            .with_store(store(&server).await)
            .with_permit_ttl(Duration::from_millis(600));
        let app = App::new();
        let mut service = app.service(&layer);
        let held = send(&mut service, request("a")).await;
        assert_eq!(held.status(), StatusCode::OK);
        // Five leases long; renewed every 200 ms.
        let end = Instant::now() + Duration::from_secs(3);
        while Instant::now() < end {
            assert_denied(&send(&mut service, request("a")).await);
            tokio::time::sleep(Duration::from_millis(250)).await;
        }
        let _ended = app.finish(held).await;
        let _again = until_allowed(&mut service, "a").await;
    }

    /// Redis down: the failure policy answers (allow, or deny with 503), and once Redis is
    /// back the limit holds again.
    #[tokio::test]
    async fn a_failing_redis_gets_the_failure_policy_and_limiting_comes_back() {
        let mut server = RedisServer::start();
        let open = by_client(1)
            .with_store(store(&server).await)
            .with_timeout(Some(Duration::from_secs(2)));
        let closed = open.clone().with_on_store_error(FailurePolicy::Deny);
        let app = App::new();
        let mut open = app.service(&open);
        let mut closed = app.service(&closed);
        server.kill();
        let first = send(&mut open, request("a")).await;
        let second = send(&mut open, request("a")).await;
        assert_eq!(first.status(), StatusCode::OK);
        assert_eq!(second.status(), StatusCode::OK);
        assert!(!first.body().holds_permit());
        assert_eq!(
            send(&mut closed, request("a")).await.status(),
            StatusCode::SERVICE_UNAVAILABLE
        );
        drop((first, second));

        server.restart();
        let start = Instant::now();
        let held = loop {
            let answer = send(&mut open, request("a")).await;
            if answer.body().holds_permit() {
                break answer;
            }
            assert!(start.elapsed() < DEADLINE, "limiting never came back");
            tokio::time::sleep(Duration::from_millis(50)).await;
        };
        assert_denied(&send(&mut open, request("a")).await);
        assert_denied(&send(&mut closed, request("a")).await);
        drop(held);
    }

    /// A permit the script takes after the layer gave up waiting (Redis paused past the
    /// timeout) is given back, not left to its 60 s lease.
    #[tokio::test]
    async fn a_permit_taken_after_the_timeout_is_given_back() {
        let server = RedisServer::start();
        let layer = by_client(1)
            .with_store(store(&server).await)
            .with_timeout(Some(Duration::from_millis(200)));
        let app = App::new();
        let mut service = app.service(&layer);
        // The scripts loaded, so that the paused call is the script itself.
        drop(send(&mut service, request("a")).await);
        server.cli(&["CLIENT", "PAUSE", "1500"]).unwrap();
        let answer = send(&mut service, request("a")).await;
        // Failed open (the default policy): passed, holding nothing.
        assert_eq!(answer.status(), StatusCode::OK);
        assert!(!answer.body().holds_permit());
        drop(answer);
        let start = Instant::now();
        let _held = loop {
            let answer = send(&mut service, request("a")).await;
            if answer.body().holds_permit() {
                break answer;
            }
            assert!(start.elapsed() < DEADLINE, "the permit never came back");
            tokio::time::sleep(Duration::from_millis(50)).await;
        };
        assert_denied(&send(&mut service, request("a")).await);
    }

    /// The permits' sorted set (the only key) on `server`.
    fn permits_set(server: &RedisServer) -> String {
        let keys = server.cli(&["--scan"]).unwrap();
        let mut keys = keys.lines().filter(|k| !k.is_empty());
        let key = keys.next().expect("a permits key").to_owned();
        assert_eq!(keys.next(), None, "one key only");
        key
    }

    /// `ZCARD` of `set` as `cli` reads it (0 when the key or the server is gone).
    fn zcard(cli: impl Fn(&[&str]) -> Option<String>, set: &str) -> u64 {
        cli(&["ZCARD", set])
            .and_then(|n| n.trim().parse().ok())
            .unwrap_or(0)
    }

    /// Waits (within `limit`) until `set` holds `n` permits.
    async fn until_held(
        cli: impl Fn(&[&str]) -> Option<String>,
        set: &str,
        n: u64,
        limit: Duration,
    ) {
        let start = Instant::now();
        loop {
            let held = zcard(&cli, set);
            if held == n {
                return;
            }
            assert!(
                start.elapsed() < limit,
                "{set} holds {held} permits after {limit:?}, not {n}"
            );
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    }

    /// Redis restarts without its data while two requests run (max 2): their permits are
    /// gone and a new request gets in. Within a renewal period (a third of the lease) the
    /// running requests count again: three held, more than the maximum, so new requests
    /// are refused until enough end. Once they have, a new batch of two gets in: no leak.
    #[tokio::test]
    async fn a_redis_restart_counts_running_requests_again() {
        // Renewed every 5 s: the newcomer gets in long before the first renewal.
        let ttl = Duration::from_secs(15);
        let mut server = RedisServer::start();
        let layer = by_client(2)
            .with_store(store(&server).await)
            .with_permit_ttl(ttl);
        let app = App::new();
        let mut service = app.service(&layer);
        let taken = Instant::now();
        let first = send(&mut service, request("a")).await;
        let second = send(&mut service, request("a")).await;
        assert!(first.body().holds_permit() && second.body().holds_permit());
        assert_denied(&send(&mut service, request("a")).await);
        let set = permits_set(&server);

        server.restart();
        assert_eq!(zcard(|a| server.cli(a), &set), 0);
        // Until the connection is back the default policy lets requests pass, holding
        // nothing; then the empty set gives a permit.
        let newcomer = loop {
            let answer = send(&mut service, request("a")).await;
            assert_eq!(
                answer.status(),
                StatusCode::OK,
                "refused before the newcomer got in: a renewal came first \
                 ({:?} after the permits were taken)",
                taken.elapsed()
            );
            if answer.body().holds_permit() {
                break answer;
            }
            assert!(taken.elapsed() < ttl / 3, "Redis never came back");
            tokio::time::sleep(Duration::from_millis(20)).await;
        };
        assert!(
            taken.elapsed() < ttl / 3,
            "the test's premise: no renewal yet"
        );

        // The running requests renew and count again: three held, max two.
        until_held(|a| server.cli(a), &set, 3, ttl / 3 + DEADLINE).await;
        assert_denied(&send(&mut service, request("a")).await);
        // One ends: two still run, and no room yet.
        let _ended = app.finish(first).await;
        until_held(|a| server.cli(a), &set, 2, DEADLINE).await;
        assert_denied(&send(&mut service, request("a")).await);
        // The other ends: room for one.
        let _ended = app.finish(second).await;
        let fourth = until_allowed(&mut service, "a").await;
        assert_denied(&send(&mut service, request("a")).await);

        // Everything given back: a new batch of two gets in, never three.
        drop((newcomer, fourth));
        let _one = until_allowed(&mut service, "a").await;
        let _two = until_allowed(&mut service, "a").await;
        assert_denied(&send(&mut service, request("a")).await);
        support::assert_every_key_expires(&server);
    }

    /// Waits until `logs` show a release that failed (within [`DEADLINE`]).
    async fn until_release_failed(logs: &support::logs::Logs) {
        let start = Instant::now();
        while !logs.text().contains("in-flight permit not released yet") {
            assert!(
                start.elapsed() < DEADLINE,
                "no failed release: {}",
                logs.text()
            );
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    }

    /// Redis is down when a request ends, so its permit cannot be given back at once; it
    /// is given back once Redis answers again (the release is tried again), long before
    /// its lease (60 s) would end it. Redis keeps its data here (append-only file, fsync
    /// on every write) so that the permit outlives the outage.
    #[tokio::test]
    async fn a_permit_not_given_back_while_redis_is_down_is_given_back_when_it_returns() {
        let (logs, _guard) = support::logs::Logs::capture();
        let mut server =
            RedisServer::start_with(&["--appendonly", "yes", "--appendfsync", "always"]);
        // The leases never end on this clock: only the release can free the permit.
        let clock = ManualClock::new(NOW_MS);
        let layer = by_client(1).with_store(store(&server).await.with_clock(clock));
        let app = App::new();
        let mut service = app.service(&layer);
        let held = send(&mut service, request("a")).await;
        assert!(held.body().holds_permit());
        let set = permits_set(&server);

        server.kill();
        let _ended = app.finish(held).await;
        until_release_failed(&logs).await;
        server.restart();
        assert_eq!(
            zcard(|a| server.cli(a), &set),
            1,
            "the permit outlived the outage"
        );
        until_held(|a| server.cli(a), &set, 0, DEADLINE).await;
        let _again = until_allowed(&mut service, "a").await;
        assert_denied(&send(&mut service, request("a")).await);
    }

    /// A release that keeps failing (here Redis refuses `ZREM`: the scripts still run)
    /// leaves the permit until its lease ends, one lease after its last renewal, and not
    /// longer.
    #[tokio::test]
    async fn a_permit_whose_release_keeps_failing_ends_with_its_lease() {
        let (logs, _guard) = support::logs::Logs::capture();
        let server = RedisServer::start();
        let clock = ManualClock::new(NOW_MS);
        let layer = by_client(1).with_store(store(&server).await.with_clock(clock.clone()));
        let app = App::new();
        let mut service = app.service(&layer);
        let held = send(&mut service, request("a")).await;
        assert!(held.body().holds_permit());
        server.cli(&["ACL", "SETUSER", "default", "-zrem"]).unwrap();
        let _ended = app.finish(held).await;
        until_release_failed(&logs).await;

        assert_denied(&send(&mut service, request("a")).await);
        clock.advance(TTL - Duration::from_millis(1));
        assert_denied(&send(&mut service, request("a")).await);
        clock.advance(Duration::from_millis(1));
        let again = send(&mut service, request("a")).await;
        assert!(again.body().holds_permit());
        assert_denied(&send(&mut service, request("a")).await);
    }

    /// A cluster master is killed while two requests run (max 2), and the replica that
    /// takes over has lost their permits (as a replica that missed the writes would
    /// have): within a renewal period the running requests count again on the new master,
    /// and once they end a new batch of two gets in.
    #[cfg(feature = "cluster")]
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_cluster_failover_that_lost_the_permits_counts_running_requests_again() {
        let ttl = Duration::from_secs(6);
        let mut cluster = support::cluster::RedisCluster::start();
        let store = RedisStore::connect(tollgate::store::RedisTarget::cluster(&cluster.urls()))
            .await
            .unwrap();
        let layer = by_client(2).with_store(store).with_permit_ttl(ttl);
        let app = App::new();
        let mut service = app.service(&layer);
        let first = send(&mut service, request("a")).await;
        let second = send(&mut service, request("a")).await;
        assert!(first.body().holds_permit() && second.body().holds_permit());
        assert_denied(&send(&mut service, request("a")).await);
        let set = cluster
            .masters()
            .into_iter()
            .find_map(|i| {
                let keys = cluster.cli(i, &["--scan"])?;
                keys.lines().find(|k| !k.is_empty()).map(str::to_owned)
            })
            .expect("the permits key");
        let slot = cluster.keyslot(&set);
        let master = cluster.master_of_slot(slot);
        let replica = cluster.replica_of(master);
        cluster.wait_replicated(master);

        cluster.kill(master);
        cluster.wait_for("the replica to take over", Duration::from_secs(30), |c| {
            c.all_agree_owner(slot, replica) && c.is_serving()
        });
        // The new master forgets the permits (it may have renewed them already).
        cluster.cli(replica, &["DEL", &set]).unwrap();
        until_held(|a| cluster.cli(replica, a), &set, 2, ttl / 3 + DEADLINE).await;
        assert_denied(&send(&mut service, request("a")).await);

        let _ended = app.finish(first).await;
        let third = until_allowed(&mut service, "a").await;
        assert_denied(&send(&mut service, request("a")).await);
        drop((second, third));
        let _one = until_allowed(&mut service, "a").await;
        let _two = until_allowed(&mut service, "a").await;
        assert_denied(&send(&mut service, request("a")).await);
    }

    /// Local: while Redis is down, permits are counted in the process, in the policy's
    /// memory store.
    #[tokio::test]
    async fn a_failing_redis_with_the_local_policy_counts_in_the_process() {
        let mut server = RedisServer::start();
        let memory = MemoryStore::new();
        let layer = by_client(1)
            .with_store(store(&server).await)
            .with_timeout(Some(Duration::from_secs(2)))
            .with_on_store_error(FailurePolicy::Local(memory.clone()));
        let app = App::new();
        let mut service = app.service(&layer);
        server.kill();
        let held = send(&mut service, request("a")).await;
        assert_eq!(held.status(), StatusCode::OK);
        assert!(held.body().holds_permit());
        assert_denied(&send(&mut service, request("a")).await);
        let full = memory.acquire(&key_of("a"), 1, TTL).await.unwrap();
        assert!(!full.is_taken(), "held in the policy's store");
        drop(held);
        assert_eq!(
            send(&mut service, request("a")).await.status(),
            StatusCode::OK
        );
    }
}

/// A tonic server-streaming call held open counts until the client drops it.
#[tokio::test]
async fn a_tonic_stream_holds_its_permit_until_the_client_drops_it() {
    use tonic::{Code, transport::Channel};
    use tonic_health::pb::{HealthCheckRequest, health_client::HealthClient};

    let incoming =
        tonic::transport::server::TcpIncoming::bind("127.0.0.1:0".parse().unwrap()).unwrap();
    let addr = incoming.local_addr().unwrap();
    let (_reporter, health) = tonic_health::server::health_reporter();
    let layer = InFlightLayer::new(1)
        .unwrap()
        .with_key(HeaderKey::new("x-api-key").unwrap());
    let router = tonic::transport::Server::builder()
        .layer(layer)
        .add_service(health);
    tokio::spawn(router.serve_with_incoming(incoming));
    let channel = Channel::from_shared(format!("http://{addr}"))
        .unwrap()
        .connect()
        .await
        .unwrap();
    let mut client = HealthClient::new(channel);
    let watch = |key: &str| {
        let mut request = tonic::Request::new(HealthCheckRequest::default());
        request
            .metadata_mut()
            .insert("x-api-key", key.parse().unwrap());
        request
    };

    let mut stream = client.watch(watch("k1")).await.unwrap().into_inner();
    assert!(stream.message().await.unwrap().is_some());
    let status = client.watch(watch("k1")).await.unwrap_err();
    assert_eq!(status.code(), Code::ResourceExhausted, "{status:?}");
    assert_eq!(status.metadata().get("retry-after").unwrap(), "1");
    // Another key streams meanwhile.
    let _other = client.watch(watch("k2")).await.unwrap();

    drop(stream);
    let start = Instant::now();
    loop {
        match client.watch(watch("k1")).await {
            Ok(_stream) => break,
            Err(status) => assert_eq!(status.code(), Code::ResourceExhausted),
        }
        assert!(start.elapsed() < DEADLINE, "the permit never came back");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}
