//! Deciding outside HTTP and exempting requests, on memory and on real Redis:
//! [`Limiter::check`] goes through the layer's own pipeline (its rules, plans, waiting,
//! failure policy) and spends the same state as requests with the same key;
//! [`Limiter::key_for`] makes that key from a typed value; `with_exempt` lets an
//! allowlist through uncounted while a request without a key still gets the missing-key
//! policy.

use tollgate_test_support as support;

use std::{convert::Infallible, net::SocketAddr, time::Duration};

use http::{Request, Response, StatusCode};
use support::RedisServer;
use tollgate::{
    FailurePolicy, Limit, RateLimitLayer, Verdict,
    key::{GlobalKey, HeaderKey, Key, KeyExtractor, PeerIp},
    plan::{Plan, Plans},
    store::{MemoryStore, RedisStore, Store},
};
use tower::{Layer, ServiceExt, service_fn};

const HOUR: Duration = Duration::from_secs(3600);
/// Store calls under a loaded machine: generous.
const TIMEOUT: Option<Duration> = Some(Duration::from_secs(5));

fn hourly(limit: u32) -> Limit {
    Limit::fixed_window(limit, HOUR).unwrap()
}

async fn redis(server: &RedisServer) -> RedisStore {
    RedisStore::connect(server.url()).await.unwrap()
}

/// What a request with `api_key` on `path` gets from `layer`.
async fn status<E>(
    layer: &RateLimitLayer<
        HeaderKey,
        u32,
        tollgate::DefaultRejection,
        tollgate::count_after::UpFront,
        E,
    >,
    path: &str,
    api_key: Option<&str>,
) -> StatusCode
where
    E: tollgate::Exempt<()> + Clone,
{
    let service = layer.layer(service_fn(|_req: Request<()>| async {
        Ok::<_, Infallible>(Response::new(()))
    }));
    let mut request = Request::get(path);
    if let Some(api_key) = api_key {
        request = request.header("x-api-key", api_key);
    }
    service
        .oneshot(request.body(()).unwrap())
        .await
        .unwrap()
        .status()
}

fn by_api_key(store: impl Store, limit: u32) -> RateLimitLayer<HeaderKey> {
    RateLimitLayer::new(hourly(limit))
        .with_key(HeaderKey::new("x-api-key").unwrap().hashed_with("secret"))
        .with_store(store)
        .with_timeout(TIMEOUT)
}

/// A check spends what a request with the same key spends, and is denied once they
/// together used the limit: one state, one pipeline.
async fn checks_and_requests_share_one_budget(store: impl Store) {
    let layer = by_api_key(store, 3);
    let limiter = layer.limiter();
    let key = limiter.key_for("k-1").unwrap();
    let request = Request::get("/")
        .header("x-api-key", "k-1")
        .body(())
        .unwrap();
    assert_eq!(
        limiter.key_of(&request).unwrap(),
        key,
        "typed and extracted keys differ"
    );

    let first = limiter.check(&key, 1).await;
    assert!(first.is_allowed(), "{first:?}");
    assert_eq!(first.decision().unwrap().remaining(), Some(2));
    assert_eq!(status(&layer, "/", Some("k-1")).await, StatusCode::OK);
    assert!(limiter.check(&key, 1).await.is_allowed());
    // Three spent: the request and the check are both denied now.
    assert_eq!(
        status(&layer, "/", Some("k-1")).await,
        StatusCode::TOO_MANY_REQUESTS
    );
    match limiter.check(&key, 1).await {
        Verdict::Denied(decision) => assert!(decision.retry_after() > Duration::ZERO),
        other => panic!("expected a denial, got {other:?}"),
    }
    // Another key has its own budget.
    assert!(
        limiter
            .check(&limiter.key_for("k-2").unwrap(), 3)
            .await
            .is_allowed()
    );
}

#[tokio::test]
async fn memory_checks_and_requests_share_one_budget() {
    checks_and_requests_share_one_budget(MemoryStore::new()).await;
}

#[tokio::test]
async fn redis_checks_and_requests_share_one_budget() {
    let server = RedisServer::start();
    checks_and_requests_share_one_budget(redis(&server).await).await;
}

/// A check is decided under the key's plan: the default plan by itself, a named plan
/// with `check_plan`; each with its own state.
async fn checks_follow_plans(store: impl Store) {
    let plans = Plans::new([
        Plan::new("free", [hourly(1)]).unwrap(),
        Plan::new("pro", [hourly(3)]).unwrap(),
    ])
    .unwrap()
    .with_header(http::HeaderName::from_static("x-plan"))
    .with_default("free")
    .unwrap();
    let layer = by_api_key(store, 100).with_plans(plans);
    let limiter = layer.limiter();
    let key = limiter.key_for("k").unwrap();
    assert!(limiter.check(&key, 1).await.is_allowed());
    assert!(
        !limiter.check(&key, 1).await.is_allowed(),
        "the free plan allows 1"
    );
    for _ in 0..3 {
        assert!(limiter.check_plan("pro", &key, 1).await.is_allowed());
    }
    assert!(!limiter.check_plan("pro", &key, 1).await.is_allowed());
}

#[tokio::test]
async fn memory_checks_follow_plans() {
    checks_follow_plans(MemoryStore::new()).await;
}

#[tokio::test]
async fn redis_checks_follow_plans() {
    let server = RedisServer::start();
    checks_follow_plans(redis(&server).await).await;
}

/// A check that would be denied waits its turn when the rules let requests wait, as a
/// request does.
async fn checks_wait_within_max_wait(store: impl Store) {
    let layer = RateLimitLayer::new(Limit::gcra(10, Duration::from_secs(1)).unwrap())
        .with_key(GlobalKey)
        .with_store(store)
        .with_timeout(TIMEOUT)
        .with_max_wait(Some(Duration::from_secs(5)));
    let limiter = layer.limiter();
    let key = limiter.key_for("").unwrap();
    // A burst of 10 passes at once; the next ones wait about 100 ms each instead of
    // being denied.
    for i in 0..12 {
        let verdict = limiter.check(&key, 1).await;
        assert!(verdict.is_allowed(), "check {i}: {verdict:?}");
    }
}

#[tokio::test]
async fn memory_checks_wait_within_max_wait() {
    checks_wait_within_max_wait(MemoryStore::new()).await;
}

#[tokio::test]
async fn redis_checks_wait_within_max_wait() {
    let server = RedisServer::start();
    checks_wait_within_max_wait(redis(&server).await).await;
}

/// With Redis down, a check gets the layer's failure policy: refused under `Deny`,
/// allowed without a decision under `Allow`, decided in memory under `Local`.
#[tokio::test]
async fn a_failed_store_gets_the_failure_policy() {
    let url = support::loopback_url(support::free_port(), false);
    let down = RedisStore::connect(url).in_background(true).await.unwrap();
    let layer = |policy| by_api_key(down.clone(), 1).with_on_store_error(policy);

    let deny = layer(FailurePolicy::Deny).limiter();
    let key = deny.key_for("k").unwrap();
    assert!(matches!(deny.check(&key, 1).await, Verdict::Unavailable(_)));

    let allow = layer(FailurePolicy::Allow).limiter();
    assert!(matches!(allow.check(&key, 1).await, Verdict::Allowed(None)));
    assert!(matches!(allow.check(&key, 1).await, Verdict::Allowed(None)));

    let local = layer(FailurePolicy::Local(MemoryStore::new())).limiter();
    assert!(matches!(
        local.check(&key, 1).await,
        Verdict::Allowed(Some(_))
    ));
    assert!(matches!(local.check(&key, 1).await, Verdict::Denied(_)));
}

/// `key_for` makes the extractor's key: a hashed API key, an IPv6 address grouped by its
/// prefix; a value that is no valid key material, and a closure extractor, are errors.
#[test]
fn typed_keys_are_the_extractors_keys() {
    let header = HeaderKey::new("x-api-key").unwrap().hashed_with("s3cret");
    let request = Request::get("/")
        .header("x-api-key", "k-1")
        .body(())
        .unwrap();
    let typed = KeyExtractor::<()>::key_for(&header, "k-1").unwrap();
    assert_eq!(typed, header.extract(&request).unwrap());
    assert!(!typed.as_str().contains("k-1"), "hashed: {typed}");
    assert!(KeyExtractor::<()>::key_for(&header, "bad\nvalue").is_err());
    assert!(KeyExtractor::<()>::key_for(&header, "").is_err());

    let peer = PeerIp::new().with_ipv6_prefix(56);
    let mut request = Request::get("/").body(()).unwrap();
    request.extensions_mut().insert(SocketAddr::from((
        [0x2001, 0xdb8, 0, 0x12, 0, 0, 0, 1],
        443,
    )));
    let grouped = KeyExtractor::<()>::key_for(&peer, "2001:db8:0:34::9").unwrap();
    assert_eq!(grouped, peer.extract(&request).unwrap());
    assert!(KeyExtractor::<()>::key_for(&peer, "not an address").is_err());

    let closure = |_: &Request<()>| Some(Key::new("x"));
    assert!(closure.key_for("x").is_err());
}

/// An exempt request passes uncounted, even with its key spent; a request without a key
/// that is not exempt is still rejected (the missing-key policy), never let through.
async fn exempt_is_not_keyless(store: impl Store) {
    let layer =
        by_api_key(store, 1).with_exempt(|request: &Request<()>| request.uri().path() == "/health");
    // No key, not exempt: 400, as without an allowlist.
    assert_eq!(status(&layer, "/api", None).await, StatusCode::BAD_REQUEST);
    // No key, exempt: through.
    assert_eq!(status(&layer, "/health", None).await, StatusCode::OK);
    // Exempt requests do not count: the key still has its one request afterwards.
    for _ in 0..3 {
        assert_eq!(status(&layer, "/health", Some("k")).await, StatusCode::OK);
    }
    assert_eq!(status(&layer, "/api", Some("k")).await, StatusCode::OK);
    assert_eq!(
        status(&layer, "/api", Some("k")).await,
        StatusCode::TOO_MANY_REQUESTS
    );
    // And they pass with the key spent.
    assert_eq!(status(&layer, "/health", Some("k")).await, StatusCode::OK);
}

#[tokio::test]
async fn memory_exempt_is_not_keyless() {
    exempt_is_not_keyless(MemoryStore::new()).await;
}

#[tokio::test]
async fn redis_exempt_is_not_keyless() {
    let server = RedisServer::start();
    exempt_is_not_keyless(redis(&server).await).await;
}

/// The allowlist survives builder calls made after it (a new key extractor, a store).
#[tokio::test]
async fn exempt_survives_later_builder_calls() {
    let layer = RateLimitLayer::new(hourly(1))
        .with_exempt(|request: &Request<()>| request.uri().path() == "/health")
        .with_key(HeaderKey::new("x-api-key").unwrap())
        .with_store(MemoryStore::new());
    assert_eq!(status(&layer, "/health", None).await, StatusCode::OK);
    assert_eq!(status(&layer, "/api", None).await, StatusCode::BAD_REQUEST);
}
