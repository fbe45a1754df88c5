//! `RateLimitLayer` in front of real tonic servers, called by real tonic clients over TCP:
//! `Server::builder().layer(..)` compiles and serves, allowed calls succeed and carry the
//! rate-limit fields as metadata, the call after the limit fails with RESOURCE_EXHAUSTED
//! and its retry hints (`retry-after`, and when enabled `grpc-retry-pushback-ms` and a
//! `google.rpc.RetryInfo`), a server-streaming call is limited at its start only, keys come
//! from metadata and from tonic's `TcpConnectInfo`, a missing key is INVALID_ARGUMENT (or
//! UNAUTHENTICATED), and the answers are trailers-only. The memory and Redis stores both.
//!
//! The service is `tonic-health` (`grpc.health.v1.Health`: unary `Check`, server-streaming
//! `Watch`). Time is frozen: the stores read a `ManualClock` 800 s into an hour, so hour
//! windows never roll over during a test and every wait is exactly 2800 s.

#[cfg(feature = "redis")]
use tollgate_test_support as support;

use std::{net::SocketAddr, time::Duration};

use http_body_util::BodyExt;
use tollgate::{
    DefaultRejection, GrpcMissingKey, Limit, MissingKey, OnRejection, RateLimitLayer,
    clock::ManualClock,
    key::{HeaderKey, KeyExtractor},
    store::{MemoryStore, Store},
};
use tonic::{
    Code, Request, Status,
    body::Body,
    metadata::MetadataMap,
    transport::{Channel, Server, server::TcpIncoming},
};
use tonic_health::{
    ServingStatus,
    pb::{
        HealthCheckRequest, HealthCheckResponse, health_check_response, health_client::HealthClient,
    },
    server::HealthReporter,
};
use tower::{Service, ServiceExt};

const HOUR: Duration = Duration::from_secs(3600);
/// The frozen time: 800 s into an hour, so an hour window resets in 2800 s.
const NOW_MS: u64 = 1_700_000_000_000;

fn memory() -> MemoryStore {
    MemoryStore::new().with_clock(ManualClock::new(NOW_MS))
}

fn hourly(limit: u32) -> Limit {
    Limit::fixed_window(limit, HOUR).unwrap()
}

/// `limit` calls per hour for each `x-api-key`, in `store`.
fn per_api_key(limit: u32, store: impl Store) -> RateLimitLayer<HeaderKey> {
    RateLimitLayer::new(hourly(limit))
        .with_key(HeaderKey::new("x-api-key").unwrap())
        .with_store(store)
        // Generous: on a loaded machine the default 100 ms would fail a Redis call open.
        .with_timeout(Some(Duration::from_secs(10)))
}

/// A health server behind a rate-limit layer, on a free loopback port; stopped on drop.
struct Running {
    client: HealthClient<Channel>,
    channel: Channel,
    reporter: HealthReporter,
    _stop: tokio::sync::oneshot::Sender<()>,
}

/// Serves `grpc.health.v1.Health` as `Server::builder().layer(layer)` and connects a client.
async fn serve<K, C, R>(layer: RateLimitLayer<K, C, R>) -> Running
where
    K: KeyExtractor<Body> + Clone,
    C: tollgate::RequestCost<Body> + Clone,
    R: OnRejection<Body, Body> + Clone,
{
    let incoming = TcpIncoming::bind("127.0.0.1:0".parse().unwrap()).unwrap();
    let addr: SocketAddr = incoming.local_addr().unwrap();
    let (reporter, health) = tonic_health::server::health_reporter();
    let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
    let router = Server::builder().layer(layer).add_service(health);
    tokio::spawn(router.serve_with_incoming_shutdown(incoming, async {
        stopped.await.ok();
    }));
    let channel = Channel::from_shared(format!("http://{addr}"))
        .unwrap()
        .connect()
        .await
        .unwrap();
    Running {
        client: HealthClient::new(channel.clone()),
        channel,
        reporter,
        _stop: stop,
    }
}

/// A `Check` of the whole server, with `x-api-key: <api_key>` unless `None`.
fn check(api_key: Option<&str>) -> Request<HealthCheckRequest> {
    let mut request = Request::new(HealthCheckRequest::default());
    if let Some(key) = api_key {
        request
            .metadata_mut()
            .insert("x-api-key", key.parse().unwrap());
    }
    request
}

fn meta<'a>(metadata: &'a MetadataMap, name: &str) -> Option<&'a str> {
    metadata.get(name).map(|v| v.to_str().unwrap())
}

/// A `Check` that must succeed; its metadata.
async fn allowed(running: &mut Running, api_key: Option<&str>) -> MetadataMap {
    let response = running.client.check(check(api_key)).await.unwrap();
    let metadata = response.metadata().clone();
    assert_eq!(
        response.into_inner().status(),
        health_check_response::ServingStatus::Serving
    );
    metadata
}

/// A `Check` that must fail; its status.
async fn denied(running: &mut Running, api_key: Option<&str>) -> Status {
    running.client.check(check(api_key)).await.unwrap_err()
}

/// The status of a call denied by an hour limit of 3 (fixed window, 2800 s left).
fn assert_exhausted(status: &Status) {
    assert_eq!(status.code(), Code::ResourceExhausted, "{status:?}");
    assert_eq!(status.message(), "rate limit exceeded; retry in 2800s");
    let metadata = status.metadata();
    assert_eq!(meta(metadata, "retry-after"), Some("2800"));
    assert_eq!(
        meta(metadata, "ratelimit-policy"),
        Some(r#""3-per-1h";q=3;w=3600"#)
    );
    assert_eq!(
        meta(metadata, "ratelimit"),
        Some(r#""3-per-1h";r=0;t=2800"#)
    );
}

/// Three calls pass for `k1` and show what is left; the fourth is RESOURCE_EXHAUSTED with
/// the wait; `k2` still has its own budget.
async fn three_per_key_then_exhausted(store: impl Store) {
    let mut running = serve(per_api_key(3, store)).await;
    for remaining in [2, 1, 0] {
        let metadata = allowed(&mut running, Some("k1")).await;
        assert_eq!(
            meta(&metadata, "ratelimit"),
            Some(format!(r#""3-per-1h";r={remaining};t=2800"#).as_str())
        );
        assert_eq!(meta(&metadata, "retry-after"), None);
    }
    let status = denied(&mut running, Some("k1")).await;
    assert_exhausted(&status);
    // The opt-ins are off by default.
    assert_eq!(meta(status.metadata(), "grpc-retry-pushback-ms"), None);
    assert!(status.details().is_empty());
    // Denied calls consume nothing, and other keys are separate.
    assert_exhausted(&denied(&mut running, Some("k1")).await);
    allowed(&mut running, Some("k2")).await;
}

#[tokio::test]
async fn calls_over_the_limit_are_resource_exhausted_with_retry_after_memory() {
    three_per_key_then_exhausted(memory()).await;
}

#[tokio::test]
async fn retry_pushback_when_enabled() {
    let layer = per_api_key(1, memory())
        .with_on_rejection(DefaultRejection::new().with_grpc_retry_pushback(true));
    let mut running = serve(layer).await;
    allowed(&mut running, Some("k1")).await;
    let status = denied(&mut running, Some("k1")).await;
    assert_eq!(status.code(), Code::ResourceExhausted);
    assert_eq!(meta(status.metadata(), "retry-after"), Some("2800"));
    assert_eq!(
        meta(status.metadata(), "grpc-retry-pushback-ms"),
        Some("2800000")
    );
}

#[cfg(feature = "grpc-status-details")]
#[tokio::test]
async fn retry_info_in_status_details_when_enabled() {
    use tonic_types::StatusExt;

    let layer = per_api_key(1, memory()).with_on_rejection(
        DefaultRejection::new()
            .with_grpc_retry_info(true)
            .with_grpc_retry_pushback(true),
    );
    let mut running = serve(layer).await;
    allowed(&mut running, Some("k1")).await;
    let status = denied(&mut running, Some("k1")).await;
    assert_eq!(status.code(), Code::ResourceExhausted);
    let info = status.get_details_retry_info().expect("a RetryInfo detail");
    assert_eq!(info.retry_delay, Some(Duration::from_secs(2800)));
    // The rich status repeats the code and message.
    let details = status.get_error_details_vec();
    assert_eq!(details.len(), 1, "{details:?}");
    assert_eq!(
        meta(status.metadata(), "grpc-retry-pushback-ms"),
        Some("2800000")
    );
}

/// The next message of a `Watch` stream.
async fn next_status(stream: &mut tonic::Streaming<HealthCheckResponse>) -> ServingStatus {
    let message = stream.message().await.unwrap().expect("a status update");
    match message.status() {
        health_check_response::ServingStatus::Serving => ServingStatus::Serving,
        health_check_response::ServingStatus::NotServing => ServingStatus::NotServing,
        _ => ServingStatus::Unknown,
    }
}

#[tokio::test]
async fn a_server_stream_is_limited_at_its_start_only() {
    let mut running = serve(per_api_key(2, memory())).await;
    allowed(&mut running, Some("k1")).await;

    let mut watch = running.client.watch(check(Some("k1"))).await.unwrap();
    assert_eq!(
        meta(watch.metadata(), "ratelimit"),
        Some(r#""2-per-1h";r=0;t=2800"#)
    );
    let stream = watch.get_mut();
    assert_eq!(next_status(stream).await, ServingStatus::Serving);

    // The budget is gone: a new stream is refused before it starts ...
    let status = running.client.watch(check(Some("k1"))).await.unwrap_err();
    assert_eq!(status.code(), Code::ResourceExhausted);
    assert_eq!(meta(status.metadata(), "retry-after"), Some("2800"));

    // ... while the open one goes on receiving, however many messages it gets.
    for next in [
        ServingStatus::NotServing,
        ServingStatus::Serving,
        ServingStatus::NotServing,
    ] {
        running.reporter.set_service_status("", next).await;
        assert_eq!(next_status(stream).await, next);
    }
}

#[tokio::test]
async fn a_missing_api_key_is_invalid_argument_by_default() {
    let mut running = serve(per_api_key(5, memory())).await;
    let status = denied(&mut running, None).await;
    assert_eq!(status.code(), Code::InvalidArgument, "{status:?}");
    assert_eq!(status.message(), "missing rate limit key");
    // A key sent twice is no key either (a second copy must not open a fresh bucket).
    let mut twice = check(Some("k1"));
    twice
        .metadata_mut()
        .append("x-api-key", "k2".parse().unwrap());
    let status = running.client.check(twice).await.unwrap_err();
    assert_eq!(status.code(), Code::InvalidArgument);
}

#[tokio::test]
async fn a_missing_api_key_can_be_unauthenticated_or_allowed() {
    let layer = per_api_key(5, memory()).with_on_rejection(
        DefaultRejection::new().with_grpc_missing_key(GrpcMissingKey::Unauthenticated),
    );
    let mut running = serve(layer).await;
    let status = denied(&mut running, None).await;
    assert_eq!(status.code(), Code::Unauthenticated, "{status:?}");

    let layer = per_api_key(1, memory()).with_on_missing_key(MissingKey::Allow);
    let mut running = serve(layer).await;
    for _ in 0..3 {
        let metadata = allowed(&mut running, None).await;
        assert_eq!(meta(&metadata, "ratelimit"), None);
    }
}

#[cfg(feature = "tonic")]
#[tokio::test]
async fn peer_ip_reads_tonics_connect_info() {
    use std::sync::Arc;

    use tollgate::key::{Key, KeyExtractor, PeerIp};

    // The key `PeerIp` gives a client at `ip`.
    let peer_key = |ip: &str| -> Key {
        let mut request = http::Request::new(());
        request
            .extensions_mut()
            .insert(std::net::SocketAddr::new(ip.parse().unwrap(), 1));
        PeerIp::new().extract(&request).unwrap()
    };

    let store: Arc<dyn Store> = Arc::new(memory());
    // The default key: the TCP peer.
    let mut running = serve(
        RateLimitLayer::new(hourly(2))
            .with_store(store.clone())
            .with_timeout(Some(Duration::from_secs(10))),
    )
    .await;
    allowed(&mut running, None).await;
    allowed(&mut running, None).await;
    assert_eq!(
        denied(&mut running, None).await.code(),
        Code::ResourceExhausted
    );
    // It was 127.0.0.1's budget that ran out.
    let decision = store
        .check(&peer_key("127.0.0.1"), &[hourly(2)], 1)
        .await
        .unwrap();
    assert!(!decision.is_allowed());
    assert!(
        store
            .check(&peer_key("127.0.0.2"), &[hourly(2)], 1)
            .await
            .unwrap()
            .is_allowed()
    );
}

/// Without the `tonic` feature the peer address is not found, and every call is refused
/// as a misconfigured server, with the fix in the message.
#[cfg(not(feature = "tonic"))]
#[tokio::test]
async fn peer_ip_needs_the_tonic_feature() {
    let mut running = serve(RateLimitLayer::new(hourly(2)).with_store(memory())).await;
    let status = denied(&mut running, None).await;
    assert_eq!(status.code(), Code::Internal);
    assert!(status.message().contains("`tonic` feature"), "{status:?}");
}

/// The denied answer on the wire, as the raw HTTP/2 response a gRPC client receives.
#[tokio::test]
async fn denied_calls_are_http_200_trailers_only() {
    let running = serve(per_api_key(1, memory())).await;
    let call = || {
        // An empty `HealthCheckRequest` in one gRPC frame: no compression, length 0.
        http::Request::post("http://localhost/grpc.health.v1.Health/Check")
            .header("content-type", "application/grpc")
            .header("te", "trailers")
            .header("x-api-key", "k1")
            .body(Body::new(http_body_util::Full::new(
                bytes::Bytes::from_static(&[0, 0, 0, 0, 0]),
            )))
            .unwrap()
    };
    let mut channel = running.channel.clone();
    let first = channel.ready().await.unwrap().call(call()).await.unwrap();
    assert_eq!(first.status(), http::StatusCode::OK);
    assert!(!first.headers().contains_key("grpc-status"));
    let body = first.into_body().collect().await.unwrap();
    assert_eq!(body.trailers().unwrap()["grpc-status"], "0");

    let second = channel.ready().await.unwrap().call(call()).await.unwrap();
    assert_eq!(second.status(), http::StatusCode::OK);
    let headers = second.headers().clone();
    assert_eq!(headers["content-type"], "application/grpc");
    assert_eq!(headers["grpc-status"], "8");
    assert_eq!(
        headers["grpc-message"],
        "rate limit exceeded; retry in 2800s"
    );
    assert_eq!(headers["retry-after"], "2800");
    let body = second.into_body().collect().await.unwrap();
    assert!(
        body.trailers().is_none(),
        "trailers-only: no second header block"
    );
    assert!(body.to_bytes().is_empty());
}

#[cfg(feature = "redis")]
mod redis {
    use support::RedisServer;
    use tollgate::store::RedisStore;

    use super::*;

    async fn store(server: &RedisServer) -> RedisStore {
        let store = RedisStore::connect(server.url()).await.unwrap();
        store.with_clock(ManualClock::new(NOW_MS))
    }

    #[tokio::test]
    async fn calls_over_the_limit_are_resource_exhausted_with_retry_after_redis() {
        let server = RedisServer::start();
        three_per_key_then_exhausted(store(&server).await).await;
        support::assert_every_key_expires(&server);
    }

    #[tokio::test]
    async fn a_server_stream_is_limited_at_its_start_redis() {
        let server = RedisServer::start();
        let layer = per_api_key(1, store(&server).await)
            .with_on_rejection(DefaultRejection::new().with_grpc_retry_pushback(true));
        let mut running = serve(layer).await;
        let mut watch = running.client.watch(check(Some("k1"))).await.unwrap();
        assert_eq!(next_status(watch.get_mut()).await, ServingStatus::Serving);
        let status = running.client.watch(check(Some("k1"))).await.unwrap_err();
        assert_eq!(status.code(), Code::ResourceExhausted);
        assert_eq!(
            meta(status.metadata(), "grpc-retry-pushback-ms"),
            Some("2800000")
        );
    }
}

/// `max_wait` over gRPC (GCRA, 1 a second per `x-api-key`, real time): a call beyond the
/// limit waits its reserved turn and succeeds instead of RESOURCE_EXHAUSTED; a later call
/// runs after it; a call whose client gives up (its deadline passes) while it waits gives
/// its place and units back, so the call after it takes its turn.
#[tokio::test]
async fn a_waiting_call_runs_at_its_turn_and_a_cancelled_one_gives_it_back() {
    let layer = RateLimitLayer::new(Limit::gcra(1, Duration::from_secs(1)).unwrap())
        .with_key(HeaderKey::new("x-api-key").unwrap())
        .with_max_wait(Some(Duration::from_secs(5)));
    let running = serve(layer).await;
    let t0 = std::time::Instant::now();
    let call = |timeout: Option<Duration>| {
        let mut client = running.client.clone();
        let mut request = check(Some("k"));
        if let Some(timeout) = timeout {
            request.set_timeout(timeout);
        }
        tokio::spawn(async move {
            let result = client.check(request).await.map(|_| ());
            (result.map_err(|s| s.code()), std::time::Instant::now())
        })
    };
    assert_eq!(call(None).await.unwrap().0, Ok(()));
    // At 1 s.
    let second = call(None);
    tokio::time::sleep(Duration::from_millis(50)).await;
    // At 2 s, but its client gives up after 200 ms: that turn is free again.
    let cancelled = call(Some(Duration::from_millis(200)));
    let cancelled = cancelled.await.unwrap().0;
    assert!(
        matches!(cancelled, Err(Code::DeadlineExceeded | Code::Cancelled)),
        "{cancelled:?}"
    );
    tokio::time::sleep(Duration::from_millis(100)).await;
    // Takes the cancelled call's turn: at 2 s, not 3 s.
    let fourth = call(None);
    let (second, fourth) = (second.await.unwrap(), fourth.await.unwrap());
    assert_eq!((second.0, fourth.0), (Ok(()), Ok(())));
    let (second, fourth) = (second.1 - t0, fourth.1 - t0);
    assert!(second >= Duration::from_millis(700), "{second:?}");
    assert!(
        fourth >= second + Duration::from_millis(700),
        "{second:?} {fourth:?}"
    );
    assert!(fourth < Duration::from_millis(2_700), "{fourth:?}");
}
