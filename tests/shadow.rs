//! Shadow mode on memory, Redis (with and without the block cache) and a cluster: shadow
//! limits never reject, enforced limits count exactly as if the shadow ones were absent,
//! and the `would_reject` outcome shows in the metrics.

#![cfg(all(feature = "redis", feature = "metrics"))]

use tollgate_test_support as support;

use std::{convert::Infallible, future::Future, num::NonZeroUsize, sync::Arc, time::Duration};

use http::{Request, Response, StatusCode};
use metrics_exporter_prometheus::{PrometheusBuilder, PrometheusRecorder};
use support::RedisServer;
use tollgate::{
    Limit, RateLimitLayer,
    headers::HeaderStyle,
    key::HeaderKey,
    rules::Rules,
    store::{MemoryStore, RedisStore, Store},
};
use tower::{Layer, Service, ServiceExt, service_fn};

/// `q` per hour, named `name`.
fn hourly(name: &str, q: u32) -> Limit {
    Limit::fixed_window(q, Duration::from_secs(3600))
        .unwrap()
        .with_name(name)
        .unwrap()
}

async fn hello(_request: Request<()>) -> Result<Response<&'static str>, Infallible> {
    Ok(Response::new("ok"))
}

/// What one request got: its status and its `X-RateLimit-Remaining`, if any.
type Seen = (StatusCode, Option<u64>);

async fn send<S, B>(service: &mut S, key: &str) -> Seen
where
    S: Service<Request<()>, Response = Response<B>, Error = Infallible>,
{
    let request = Request::builder().header("x-key", key).body(()).unwrap();
    let response = service.ready().await.unwrap().call(request).await.unwrap();
    let remaining = response
        .headers()
        .get("x-ratelimit-remaining")
        .map(|v| v.to_str().unwrap().parse().unwrap());
    (response.status(), remaining)
}

/// A layer on `store` keyed by `x-key`, with the legacy fields (one remaining count). A
/// generous timeout: on a loaded machine the default 100 ms would fail a call open and
/// shift the counts the tests assert.
fn layer(store: &Arc<dyn Store>, limit: Limit) -> RateLimitLayer<HeaderKey, u32> {
    RateLimitLayer::new(limit)
        .with_key(HeaderKey::new("x-key").unwrap())
        .with_headers(HeaderStyle::default().with_legacy(true))
        .with_store(store.clone())
        .with_timeout(Some(Duration::from_secs(10)))
}

/// The count of `outcome` on route `route` in `recorder`'s page.
fn outcome(recorder: &PrometheusRecorder, route: &str, outcome: &str) -> u64 {
    let labels = format!(r#"route="{route}",outcome="{outcome}""#);
    let page = recorder.handle().render();
    page.lines()
        .find(|line| line.starts_with("tollgate_requests_total{") && line.contains(&labels))
        .map_or(0, |line| line.rsplit(' ').next().unwrap().parse().unwrap())
}

/// Runs `test` on a current-thread runtime under a recorder of its own, so that parallel
/// tests never see each other's counts.
fn with_metrics<F: Future<Output = ()>>(test: impl FnOnce() -> F) -> PrometheusRecorder {
    let recorder = PrometheusBuilder::new().build_recorder();
    let runtime = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap();
    metrics::with_local_recorder(&recorder, || runtime.block_on(test()));
    recorder
}

/// The whole scenario on one store, under the recorder of `with_metrics`.
async fn scenario(store: impl Store) {
    let store: Arc<dyn Store> = Arc::new(store);
    let enforced = || hourly("enforced", 5);
    // Twice as many requests as the shadow limit lets through, and more than the
    // enforced one: the enforced limit must count exactly as a layer without the shadow
    // limit does, on another key of the same store.
    let mut shadowed = layer(&store, enforced())
        .with_shadow_limit(hourly("shadow", 2))
        .with_name("mixed")
        .layer(service_fn(hello));
    let mut plain = layer(&store, enforced())
        .with_name("plain")
        .layer(service_fn(hello));
    let mut with_shadow = Vec::new();
    let mut without = Vec::new();
    for _ in 0..8 {
        with_shadow.push(send(&mut shadowed, "a").await);
        without.push(send(&mut plain, "b").await);
    }
    let ok = StatusCode::OK;
    let limited = StatusCode::TOO_MANY_REQUESTS;
    assert_eq!(with_shadow, without);
    assert_eq!(
        without,
        [
            (ok, Some(4)),
            (ok, Some(3)),
            (ok, Some(2)),
            (ok, Some(1)),
            (ok, Some(0)),
            (limited, Some(0)),
            (limited, Some(0)),
            (limited, Some(0)),
        ]
    );

    // A shadow limit above the enforced one counts the requests the enforced one
    // rejects too: it sees what a layer in front would.
    let mut wide = layer(&store, hourly("narrow", 2))
        .with_shadow_limit(hourly("wide", 4))
        .with_name("wide")
        .layer(service_fn(hello));
    for _ in 0..4 {
        send(&mut wide, "c").await;
    }
    // Enforcing the wide limit now: key "c" spent its 4 under it.
    let mut enforcing = layer(&store, hourly("wide", 4)).layer(service_fn(hello));
    assert_eq!(send(&mut enforcing, "c").await, (limited, Some(0)));
    assert_eq!(send(&mut enforcing, "d").await, (ok, Some(3)));

    // A layer in shadow: nothing is rejected, and no rate-limit fields are written.
    let mut watching = layer(&store, hourly("watch", 2))
        .with_shadow(true)
        .with_name("watch")
        .layer(service_fn(hello));
    for _ in 0..5 {
        assert_eq!(send(&mut watching, "e").await, (ok, None));
    }
}

fn assert_counts(recorder: &PrometheusRecorder) {
    assert_eq!(outcome(recorder, "mixed", "allowed"), 2);
    assert_eq!(outcome(recorder, "mixed", "would_reject"), 3);
    assert_eq!(outcome(recorder, "mixed", "denied"), 3);
    assert_eq!(outcome(recorder, "plain", "allowed"), 5);
    assert_eq!(outcome(recorder, "plain", "would_reject"), 0);
    assert_eq!(outcome(recorder, "wide", "allowed"), 2);
    assert_eq!(outcome(recorder, "wide", "denied"), 2);
    assert_eq!(outcome(recorder, "watch", "allowed"), 2);
    assert_eq!(outcome(recorder, "watch", "would_reject"), 3);
    assert_eq!(outcome(recorder, "watch", "denied"), 0);
}

#[test]
fn memory_shadow_limits_never_reject_and_enforced_ones_count_exactly() {
    assert_counts(&with_metrics(|| scenario(MemoryStore::new())));
}

#[test]
fn redis_shadow_limits_never_reject_and_enforced_ones_count_exactly() {
    let server = RedisServer::start();
    let recorder = with_metrics(|| async {
        let store = RedisStore::connect(server.url()).await.unwrap();
        scenario(store.with_block_cache(None)).await;
    });
    assert_counts(&recorder);
    support::assert_every_key_expires(&server);
}

/// The block cache answers the shadow limits' repeated denials without Redis; the
/// enforced limits, cached apart, keep being counted there.
#[test]
fn redis_block_cache_keeps_shadow_decisions_exact() {
    let server = RedisServer::start();
    let recorder = with_metrics(|| async {
        let store = RedisStore::connect(server.url()).await.unwrap();
        scenario(store.with_block_cache(NonZeroUsize::new(1000))).await;
    });
    assert_counts(&recorder);
}

#[cfg(feature = "cluster")]
#[test]
fn cluster_shadow_limits_never_reject_and_enforced_ones_count_exactly() {
    let cluster = support::cluster::RedisCluster::start();
    let recorder = with_metrics(|| async {
        let store = RedisStore::connect(tollgate::store::RedisTarget::cluster(&cluster.urls()))
            .await
            .unwrap();
        scenario(store).await;
    });
    assert_counts(&recorder);
    assert!(cluster.assert_every_key_expires() > 0);
}

/// Shadow flags change at run time through the rules handle: a 429 becomes a pass and
/// back, and the budget spent meanwhile stays spent.
#[test]
fn the_rules_handle_turns_shadow_on_and_off() {
    let recorder = with_metrics(|| async {
        let store: Arc<dyn Store> = Arc::new(MemoryStore::new());
        let layer = layer(&store, hourly("h", 1)).with_name("live");
        let handle = layer.rules_handle();
        let mut service = layer.layer(service_fn(hello));
        assert_eq!(send(&mut service, "k").await.0, StatusCode::OK);
        assert_eq!(
            send(&mut service, "k").await.0,
            StatusCode::TOO_MANY_REQUESTS
        );
        handle.set(handle.rules().with_shadow(true));
        assert_eq!(send(&mut service, "k").await, (StatusCode::OK, None));
        handle.set(handle.rules().with_shadow(false));
        assert_eq!(
            send(&mut service, "k").await.0,
            StatusCode::TOO_MANY_REQUESTS
        );
        // A limit moved to shadow by the handle, another one enforced.
        let rules = handle
            .rules()
            .with_limits([hourly("other", 10)])
            .unwrap()
            .with_shadow_limits([hourly("h", 1)])
            .unwrap();
        handle.set(rules);
        assert_eq!(send(&mut service, "k").await, (StatusCode::OK, Some(9)));
    });
    assert_eq!(outcome(&recorder, "live", "allowed"), 1);
    assert_eq!(outcome(&recorder, "live", "denied"), 2);
    assert_eq!(outcome(&recorder, "live", "would_reject"), 2);
}

#[test]
fn a_shadow_limit_with_the_state_of_an_enforced_one_is_refused() {
    let error = Rules::new([hourly("h", 1)])
        .unwrap()
        .with_shadow_limits([hourly("h", 1)])
        .unwrap_err();
    assert!(error.to_string().contains("shadow_limits"), "{error}");
    // The builder moves it to shadow instead.
    let layer = RateLimitLayer::new(hourly("h", 1)).with_shadow_limit(hourly("h", 1));
    let rules = layer.rules_handle().rules();
    assert!(rules.limits().is_empty());
    assert_eq!(rules.shadow_limits().len(), 1);
}

/// A layer in shadow never rejects, not even when its store fails under a fail-closed
/// policy; the failure still counts as `store_error`.
#[test]
fn a_layer_in_shadow_lets_requests_through_when_its_store_fails() {
    let mut server = RedisServer::start();
    let url = server.url();
    let recorder = with_metrics(|| async {
        let store: Arc<dyn Store> = Arc::new(RedisStore::connect(url).await.unwrap());
        server.kill();
        let mut service = layer(&store, hourly("h", 1))
            .with_shadow(true)
            .with_on_store_error(tollgate::FailurePolicy::Deny)
            .with_name("dead")
            .layer(service_fn(hello));
        assert_eq!(send(&mut service, "k").await, (StatusCode::OK, None));
    });
    assert_eq!(outcome(&recorder, "dead", "store_error"), 1);
    assert_eq!(outcome(&recorder, "dead", "allowed"), 0);
}
