//! `RateLimitLayer` in real axum apps: concurrent requests over TCP, the header contract,
//! every key extractor behind axum (peer IP through `MockConnectInfo`), the hooks (cost,
//! rejection), gRPC answers, and the failure policies against a Redis that died.
//!
//! Time is frozen: every store reads a `ManualClock` (the Redis store sends it as the
//! script's explicit `now`), so hour-long windows, which are aligned to the epoch, can
//! never roll over during a test and every `t` is known exactly.

use tollgate_test_support as support;

use std::{
    convert::Infallible,
    fmt,
    future::{Ready, ready},
    net::SocketAddr,
    sync::{
        Arc,
        atomic::{AtomicBool, Ordering},
    },
    task::{Context, Poll, Waker},
    time::Duration,
};

use axum::{
    Router,
    body::Body,
    extract::connect_info::MockConnectInfo,
    middleware::{self, Next},
    routing::any,
};
use bytes::Bytes;
use http::{HeaderValue, Request, Response, StatusCode, header::CONTENT_TYPE};
use http_body_util::Empty;
use hyper_util::{client::legacy::Client, rt::TokioExecutor};
use tokio::{net::TcpListener, task::JoinSet, time::timeout};
use tollgate::{
    Decision, Limit, MissingKey, RateLimitLayer,
    clock::ManualClock,
    headers::HeaderStyle,
    key::{ClientIp, ExtensionKey, GlobalKey, HeaderKey},
    store::{MemoryStore, Store},
};
use tower::{Service, ServiceBuilder, ServiceExt};

const HOUR: Duration = Duration::from_secs(3600);
const DAY: Duration = Duration::from_secs(24 * 3600);
/// The frozen time: 800 s into an hour (so an hour window resets in `t=2800`).
const NOW_MS: u64 = 1_700_000_000_000;
const HOUR_LEFT: u64 = 2800;

const OK: StatusCode = StatusCode::OK;
const LIMITED: StatusCode = StatusCode::TOO_MANY_REQUESTS;

fn memory() -> MemoryStore {
    MemoryStore::new().with_clock(ManualClock::new(NOW_MS))
}

fn hourly(limit: u32) -> Limit {
    Limit::fixed_window(limit, HOUR).unwrap()
}

fn named(limit: Limit, name: &str) -> Limit {
    limit.with_name(name).unwrap()
}

/// `limit` per hour and peer IP, in a fresh in-memory store on the frozen clock.
fn per_hour(limit: u32) -> RateLimitLayer {
    RateLimitLayer::new(hourly(limit)).with_store(memory())
}

/// `limit` per hour for everyone together.
fn global(limit: u32) -> RateLimitLayer<GlobalKey> {
    per_hour(limit).with_key(GlobalKey)
}

async fn ok() -> &'static str {
    "ok"
}

/// The app every test limits: three routes answering 200 to any method.
fn routes() -> Router {
    Router::new()
        .route("/", any(ok))
        .route("/a", any(ok))
        .route("/b", any(ok))
}

fn peer(ip: &str) -> MockConnectInfo<SocketAddr> {
    MockConnectInfo(SocketAddr::new(ip.parse().unwrap(), 40_000))
}

fn get(uri: &str) -> Request<Body> {
    Request::get(uri).body(Body::empty()).unwrap()
}

/// `GET /` with the header `name` set to each of `values`, in order.
fn with_header<V>(name: &str, values: impl IntoIterator<Item = V>) -> Request<Body>
where
    HeaderValue: TryFrom<V>,
    <HeaderValue as TryFrom<V>>::Error: Into<http::Error>,
{
    let mut request = Request::get("/");
    for value in values {
        request = request.header(name, value);
    }
    request.body(Body::empty()).unwrap()
}

fn api_key<V>(value: V) -> Request<Body>
where
    HeaderValue: TryFrom<V>,
    <HeaderValue as TryFrom<V>>::Error: Into<http::Error>,
{
    with_header("x-api-key", [value])
}

/// Sends one request; every answer must come well within 2 s, whatever the store does.
async fn send(app: &Router, request: Request<Body>) -> Response<Body> {
    timeout(Duration::from_secs(2), app.clone().oneshot(request))
        .await
        .unwrap()
        .unwrap()
}

/// The statuses of `n` requests made by `request`, sent one after the other.
async fn statuses(
    app: &Router,
    n: usize,
    mut request: impl FnMut() -> Request<Body>,
) -> Vec<StatusCode> {
    let mut statuses = Vec::with_capacity(n);
    for _ in 0..n {
        statuses.push(send(app, request()).await.status());
    }
    statuses
}

/// `allowed` times 200, then `limited` times 429.
fn expect(allowed: usize, limited: usize) -> Vec<StatusCode> {
    let mut statuses = vec![OK; allowed];
    statuses.resize(allowed + limited, LIMITED);
    statuses
}

/// Every field line of `name`, as text.
fn lines<B>(response: &Response<B>, name: &str) -> Vec<String> {
    response
        .headers()
        .get_all(name)
        .iter()
        .map(|v| v.to_str().unwrap().to_owned())
        .collect()
}

/// Checks the exact `RateLimit-Policy` and `RateLimit` field lines.
fn assert_lines<B>(response: &Response<B>, policy: &[&str], limit: &[&str]) {
    assert_eq!(lines(response, "ratelimit-policy"), policy);
    assert_eq!(lines(response, "ratelimit"), limit);
}

/// The structured-field list items of every `name` field line, in order.
fn items<B>(response: &Response<B>, name: &str) -> Vec<String> {
    lines(response, name)
        .iter()
        .flat_map(|line| line.split(',').map(|item| item.trim().to_owned()))
        .collect()
}

/// The quoted policy name an item starts with.
fn item_name(item: &str) -> &str {
    item.split(';').next().unwrap().trim_matches('"')
}

/// The integer parameter `key` of `item` (`"p";r=3;t=5`, key `r` gives 3).
fn param(item: &str, key: &str) -> Option<u64> {
    item.split(';')
        .skip(1)
        .find_map(|p| p.strip_prefix(key)?.strip_prefix('=')?.parse().ok())
}

/// The `r` of the first `RateLimit` item.
fn remaining<B>(response: &Response<B>) -> u64 {
    param(&items(response, "ratelimit")[0], "r").unwrap()
}

/// Checks the IETF fields: a `RateLimit` item with `r` and `t` for each `RateLimit-Policy`
/// item with `q` and `w` (same names, same order), and no `pk`.
fn assert_ietf_fields<B>(response: &Response<B>) {
    let policies = items(response, "ratelimit-policy");
    let limits = items(response, "ratelimit");
    assert!(
        !limits.is_empty(),
        "no RateLimit field: {:?}",
        response.headers()
    );
    let names = |items: &[String]| -> Vec<String> {
        items.iter().map(|i| item_name(i).to_owned()).collect()
    };
    assert_eq!(names(&policies), names(&limits));
    for policy in &policies {
        assert!(param(policy, "q").is_some_and(|q| q >= 1), "{policy}");
        assert!(param(policy, "w").is_some_and(|w| w >= 1), "{policy}");
    }
    for limit in &limits {
        assert!(
            param(limit, "r").is_some() && param(limit, "t").is_some(),
            "{limit}"
        );
    }
    assert!(
        policies
            .iter()
            .chain(&limits)
            .all(|i| param(i, "pk").is_none() && !i.contains("pk=")),
        "a pk leaks a client identifier: {:?}",
        response.headers()
    );
}

fn assert_no_rate_limit_fields<B>(response: &Response<B>) {
    for name in ["ratelimit", "ratelimit-policy", "x-ratelimit-limit"] {
        assert!(
            !response.headers().contains_key(name),
            "{name} in {:?}",
            response.headers()
        );
    }
}

/// `Retry-After` as whole seconds: an integer, at least 1, and no earlier than any `t`
/// of the same response.
fn retry_after<B>(response: &Response<B>) -> u64 {
    let value = &response.headers()["retry-after"];
    let secs: u64 = value.to_str().unwrap().parse().unwrap();
    assert!(secs >= 1, "Retry-After 0");
    for item in items(response, "ratelimit") {
        let t = param(&item, "t").unwrap();
        assert!(
            t <= secs,
            "Retry-After {secs} is earlier than t={t} ({item})"
        );
    }
    secs
}

/// A 429 with `Retry-After` and the rate-limit fields.
fn assert_limited<B>(response: &Response<B>) -> u64 {
    assert_eq!(response.status(), LIMITED);
    assert_ietf_fields(response);
    retry_after(response)
}

// ---- Concurrency over TCP -----------------------------------------------------------

/// What the 200 concurrent requests are counted against.
#[derive(Clone, Copy)]
enum Keyed {
    Global,
    Peer,
}

/// Serves `app` on a free loopback port with real `ConnectInfo`.
async fn serve(app: Router) -> SocketAddr {
    let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    let service = app.into_make_service_with_connect_info::<SocketAddr>();
    tokio::spawn(async move { axum::serve(listener, service).await.unwrap() });
    addr
}

/// 200 concurrent requests against a limit of 50: exactly 50 pass, each `r` from 49 down
/// to 0 once (every decision atomic), and the other 150 are complete 429s.
async fn two_hundred_concurrent_requests(store: impl Store, keyed: Keyed) {
    // A generous store timeout: with the default 100 ms a loaded machine can fail open
    // (the default policy) and let more than 50 through; this test is about the limit.
    let layer = RateLimitLayer::new(hourly(50))
        .with_store(store)
        .with_timeout(Some(Duration::from_secs(10)));
    let app = match keyed {
        Keyed::Global => routes().layer(layer.with_key(GlobalKey)),
        Keyed::Peer => routes().layer(layer),
    };
    let uri: http::Uri = format!("http://{}/", serve(app).await).parse().unwrap();
    let client = Client::builder(TokioExecutor::new()).build_http::<Empty<Bytes>>();
    let mut requests = JoinSet::new();
    for _ in 0..200 {
        let (client, uri) = (client.clone(), uri.clone());
        requests.spawn(async move { client.get(uri).await.unwrap() });
    }
    let responses = timeout(Duration::from_secs(60), requests.join_all())
        .await
        .unwrap();
    let (allowed, limited): (Vec<_>, Vec<_>) =
        responses.into_iter().partition(|r| r.status() == OK);
    assert_eq!((allowed.len(), limited.len()), (50, 150));
    for response in &allowed {
        assert_ietf_fields(response);
        assert!(!response.headers().contains_key("retry-after"));
    }
    let mut left: Vec<u64> = allowed.iter().map(remaining).collect();
    left.sort_unstable();
    assert_eq!(left, (0..50).collect::<Vec<u64>>());
    for response in &limited {
        assert_eq!(assert_limited(response), HOUR_LEFT);
        assert_eq!(remaining(response), 0);
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn concurrent_requests_memory_global_key() {
    two_hundred_concurrent_requests(memory(), Keyed::Global).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn concurrent_requests_memory_peer_ip() {
    two_hundred_concurrent_requests(memory(), Keyed::Peer).await;
}

// ---- The header contract -------------------------------------------------------------

#[tokio::test]
async fn fields_follow_the_draft_on_allowed_and_denied_responses() {
    let app = routes().layer(global(3));
    let first = send(&app, get("/")).await;
    assert_eq!(first.status(), OK);
    let policy = [r#""3-per-1h";q=3;w=3600"#];
    assert_lines(&first, &policy, &[r#""3-per-1h";r=2;t=2800"#]);
    assert!(!first.headers().contains_key("retry-after"));
    assert!(!first.headers().contains_key("x-ratelimit-limit"));

    assert_eq!(statuses(&app, 2, || get("/")).await, expect(2, 0));
    let denied = send(&app, get("/")).await;
    assert_eq!(assert_limited(&denied), HOUR_LEFT);
    assert_lines(&denied, &policy, &[r#""3-per-1h";r=0;t=2800"#]);
}

#[tokio::test]
async fn retry_after_rounds_up_and_is_never_earlier_than_any_t() {
    // One token per 3600/7 s = 514.285.. s: rounded up to 515, and the bucket's full
    // restore (t) would be later, so t is capped at Retry-After.
    let bucket = Limit::token_bucket(7, HOUR).unwrap();
    let app = routes().layer(
        RateLimitLayer::new(bucket)
            .with_store(memory())
            .with_key(GlobalKey),
    );
    assert_eq!(statuses(&app, 7, || get("/")).await, expect(7, 0));
    assert_eq!(assert_limited(&send(&app, get("/")).await), 515);

    // Two limits in one layer: the hourly one denies; the daily one resets later.
    let limits = RateLimitLayer::new(named(hourly(1), "hourly"))
        .with_limit(named(Limit::fixed_window(100, DAY).unwrap(), "daily"))
        .with_store(memory())
        .with_key(GlobalKey);
    let app = routes().layer(limits);
    assert_eq!(send(&app, get("/")).await.status(), OK);
    let denied = send(&app, get("/")).await;
    assert_eq!(assert_limited(&denied), HOUR_LEFT);
    // The daily limit's t is capped at Retry-After too.
    assert_lines(
        &denied,
        &[r#""hourly";q=1;w=3600, "daily";q=100;w=86400"#],
        &[r#""hourly";r=0;t=2800, "daily";r=99;t=2800"#],
    );
}

/// An inner and an outer layer, each with its own named limit.
fn stacked(inner: Limit, outer: Limit) -> Router {
    let inner = RateLimitLayer::new(named(inner, "inner")).with_store(memory());
    let outer = RateLimitLayer::new(named(outer, "outer")).with_store(memory());
    // The layer added last runs first: `outer` decides before `inner`.
    routes()
        .layer(inner.with_key(GlobalKey))
        .layer(outer.with_key(GlobalKey))
}

#[tokio::test]
async fn stacked_layers_each_append_their_own_field_lines() {
    let app = stacked(hourly(5), hourly(9));
    let response = send(&app, get("/")).await;
    assert_eq!(response.status(), OK);
    assert_ietf_fields(&response);
    assert_lines(
        &response,
        &[r#""inner";q=5;w=3600"#, r#""outer";q=9;w=3600"#],
        &[r#""inner";r=4;t=2800"#, r#""outer";r=8;t=2800"#],
    );
}

/// DESIGN.md wants `Retry-After` never earlier than any `t` of the response: when the
/// inner layer denies (`Retry-After: 2800`), the outer layer, which allowed (and counted:
/// stacked layers decide one after the other), caps its `t` at 2800 too.
#[tokio::test]
async fn stacked_layers_keep_retry_after_no_earlier_than_any_t() {
    let app = stacked(hourly(1), Limit::fixed_window(100, DAY).unwrap());
    assert_eq!(send(&app, get("/")).await.status(), OK);
    let denied = send(&app, get("/")).await;
    assert_eq!(denied.status(), LIMITED);
    assert_eq!(
        lines(&denied, "ratelimit"),
        [r#""inner";r=0;t=2800"#, r#""outer";r=98;t=2800"#]
    );
    retry_after(&denied);
}

/// The first response of a 3-per-hour layer that writes these fields.
async fn first_response(ietf: bool, legacy: bool) -> Response<Body> {
    let app = routes()
        .layer(global(3).with_headers(HeaderStyle::NONE.with_ietf(ietf).with_legacy(legacy)));
    send(&app, get("/")).await
}

#[tokio::test]
async fn legacy_fields_only_when_enabled() {
    let response = first_response(true, true).await;
    assert_ietf_fields(&response);
    for (name, value) in [
        ("x-ratelimit-limit", "3"),
        ("x-ratelimit-remaining", "2"),
        ("x-ratelimit-reset", "2800"),
    ] {
        assert_eq!(lines(&response, name), [value]);
    }

    let legacy_only = first_response(false, true).await;
    assert_eq!(lines(&legacy_only, "x-ratelimit-remaining"), ["2"]);
    assert!(!legacy_only.headers().contains_key("ratelimit"));
    assert!(!legacy_only.headers().contains_key("ratelimit-policy"));

    let ietf_only = first_response(true, false).await;
    assert!(!ietf_only.headers().contains_key("x-ratelimit-limit"));
}

#[tokio::test]
async fn header_style_none_keeps_only_retry_after() {
    let app = routes().layer(global(1).with_headers(HeaderStyle::NONE));
    let allowed = send(&app, get("/")).await;
    assert_eq!(allowed.status(), OK);
    assert_no_rate_limit_fields(&allowed);
    let denied = send(&app, get("/")).await;
    assert_eq!(denied.status(), LIMITED);
    assert_no_rate_limit_fields(&denied);
    assert_eq!(retry_after(&denied), HOUR_LEFT);
}

// ---- Key extractors --------------------------------------------------------------------

/// The peer IP comes from axum's `MockConnectInfo` in tests, as from `ConnectInfo` when
/// served.
#[tokio::test]
async fn peer_ip_reads_mock_connect_info() {
    let limited = routes().layer(per_hour(1));
    let one = limited.clone().layer(peer("192.0.2.1"));
    let other = limited.layer(peer("192.0.2.2"));
    assert_eq!(statuses(&one, 2, || get("/")).await, expect(1, 1));
    assert_eq!(statuses(&other, 2, || get("/")).await, expect(1, 1));
}

/// Without `ConnectInfo` there is no peer address: every request is a 500 whose body
/// names the fix, and the layer's extractor warns once, not once per request.
#[tokio::test]
async fn without_connect_info_the_answer_names_the_fix_and_warns_once() {
    let (logs, _guard) = support::logs::Logs::capture();
    let app = routes().layer(per_hour(5));
    for _ in 0..3 {
        let response = send(&app, get("/")).await;
        assert_eq!(response.status(), StatusCode::INTERNAL_SERVER_ERROR);
        assert_no_rate_limit_fields(&response);
        let body = axum::body::to_bytes(response.into_body(), 4096)
            .await
            .unwrap();
        let body = String::from_utf8(body.to_vec()).unwrap();
        assert!(
            body.starts_with("tollgate: no client address: serve with ")
                && body.contains("into_make_service_with_connect_info::<SocketAddr>()"),
            "{body}"
        );
    }
    let text = logs.text();
    // One warning; the debug line per request stays.
    let warnings: Vec<&str> = text.lines().filter(|l| l.contains(" WARN ")).collect();
    assert_eq!(warnings.len(), 1, "{text}");
    assert!(warnings[0].contains("no client address"), "{text}");
}

/// The same through a real server started without `into_make_service_with_connect_info`.
#[tokio::test]
async fn served_without_connect_info_the_answer_names_the_fix() {
    let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    let app = routes().layer(per_hour(5));
    tokio::spawn(async move { axum::serve(listener, app).await.unwrap() });
    let client = Client::builder(TokioExecutor::new()).build_http::<Empty<Bytes>>();
    let uri: http::Uri = format!("http://{addr}/").parse().unwrap();
    let response = timeout(Duration::from_secs(5), client.get(uri))
        .await
        .unwrap()
        .unwrap();
    assert_eq!(response.status(), StatusCode::INTERNAL_SERVER_ERROR);
    let body = http_body_util::BodyExt::collect(response.into_body())
        .await
        .unwrap()
        .to_bytes();
    let body = String::from_utf8(body.to_vec()).unwrap();
    assert!(
        body.contains("into_make_service_with_connect_info"),
        "{body}"
    );
}

/// 2 per hour and client IP, with the proxies of 10.0.0.0/8 trusted, for requests from
/// the TCP peer `ip` (through `MockConnectInfo`: the tests using this fail with 400 until
/// the bug shown by `peer_ip_reads_mock_connect_info` is fixed).
fn client_ip_from(ip: &str) -> Router {
    let trusted = ClientIp::new(["10.0.0.0/8".parse().unwrap()]);
    routes()
        .layer(per_hour(2).with_key(trusted))
        .layer(peer(ip))
}

#[tokio::test]
async fn spoofed_forwarded_for_from_an_untrusted_peer_does_not_change_the_key() {
    let app = client_ip_from("203.0.113.7");
    let spoofs = [
        "1.1.1.1",
        "2.2.2.2",
        "10.0.0.9",
        "3.3.3.3, 10.0.0.1",
        "4.4.4.4",
    ];
    let mut spoof = spoofs.iter();
    let rotating = || with_header("x-forwarded-for", [*spoof.next().unwrap()]);
    assert_eq!(statuses(&app, 5, rotating).await, expect(2, 3));
}

#[tokio::test]
async fn clients_behind_a_trusted_proxy_get_separate_budgets() {
    let app = client_ip_from("10.0.0.1");
    let from = |xff: &'static str| move || with_header("x-forwarded-for", [xff]);
    assert_eq!(statuses(&app, 3, from("198.51.100.1")).await, expect(2, 1));
    assert_eq!(statuses(&app, 3, from("198.51.100.2")).await, expect(2, 1));
    // What the client wrote itself (left of what the proxy saw) does not matter.
    let prepended = from("6.6.6.6, 198.51.100.2");
    assert_eq!(statuses(&app, 1, prepended).await, expect(0, 1));
}

fn by_api_key(limit: u32) -> RateLimitLayer<HeaderKey> {
    per_hour(limit).with_key(HeaderKey::new("x-api-key").unwrap())
}

#[tokio::test]
async fn api_keys_are_isolated() {
    let app = routes().layer(by_api_key(2));
    assert_eq!(statuses(&app, 3, || api_key("key-a")).await, expect(2, 1));
    assert_eq!(statuses(&app, 3, || api_key("key-b")).await, expect(2, 1));
}

#[tokio::test]
async fn a_missing_api_key_is_a_400_or_unlimited_when_allowed() {
    let app = routes().layer(by_api_key(1));
    let response = send(&app, get("/")).await;
    assert_eq!(response.status(), StatusCode::BAD_REQUEST);
    assert_no_rate_limit_fields(&response);

    let app = routes().layer(by_api_key(1).with_on_missing_key(MissingKey::Allow));
    assert_eq!(statuses(&app, 3, || get("/")).await, [OK; 3]);
    assert_no_rate_limit_fields(&send(&app, get("/")).await);
    // Requests with a key are still limited.
    assert_eq!(statuses(&app, 2, || api_key("k")).await, expect(1, 1));
}

/// Header values an attacker might send as an identity, all different identities.
fn hostile_values() -> Vec<HeaderValue> {
    let long = |c: &str, n: usize| HeaderValue::from_str(&c.repeat(n)).unwrap();
    let mut values = vec![long("k", 8192), long("k", 8193), long("K", 8192)];
    for text in [
        "{}",
        "{a}",
        "a",
        "%7Ba%7D",
        "%257Ba%257D",
        ":",
        "a:b",
        "a%3Ab",
        "#",
        "a b",
    ] {
        values.push(HeaderValue::from_static(text));
    }
    for bytes in [&b"\xff"[..], b"%FF", b"a\xff\xfe", b"{\xff}", b"\x80:\x80"] {
        values.push(HeaderValue::from_bytes(bytes).unwrap());
    }
    values
}

/// Every hostile value gets a budget of its own (its first request passes, its second is
/// limited), and nothing is ever a 5xx.
async fn hostile_identities_get_their_own_buckets(store: impl Store) {
    let app = routes().layer(
        RateLimitLayer::new(hourly(1))
            .with_store(store)
            .with_key(HeaderKey::new("x-api-key").unwrap()),
    );
    for value in hostile_values() {
        let label = format!("{:?}", value.as_bytes().get(..16));
        assert_eq!(
            statuses(&app, 2, || api_key(value.clone())).await,
            expect(1, 1),
            "{label}"
        );
    }
    // Repeated or empty headers have no key: a clear 400, never a fresh bucket.
    let repeated = || with_header("x-api-key", ["a", "fresh"]);
    let empty = || api_key("");
    for request in [&repeated as &dyn Fn() -> Request<Body>, &empty] {
        assert_eq!(
            statuses(&app, 2, request).await,
            [StatusCode::BAD_REQUEST; 2]
        );
    }
}

#[tokio::test]
async fn hostile_api_keys_never_5xx_nor_share_a_bucket() {
    hostile_identities_get_their_own_buckets(memory()).await;
}

#[tokio::test]
async fn hostile_forwarded_for_values_never_5xx() {
    let app = client_ip_from("10.0.0.1");
    for value in hostile_values() {
        let status = send(&app, with_header("x-forwarded-for", [value]))
            .await
            .status();
        assert!(status == OK || status == LIMITED, "{status}");
    }
}

// ---- Authenticated users (ExtensionKey) ---------------------------------------------

#[derive(Clone, Debug)]
struct UserId(String);

impl fmt::Display for UserId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "user-{}", self.0)
    }
}

/// A stand-in auth layer: `x-user` becomes a `UserId` extension.
async fn authenticate(mut request: Request<Body>, next: Next) -> Response<Body> {
    let user = request.headers().get("x-user").map(|v| v.to_str().unwrap());
    if let Some(user) = user.map(|u| UserId(u.to_owned())) {
        request.extensions_mut().insert(user);
    }
    next.run(request).await
}

fn user(name: &'static str) -> impl Fn() -> Request<Body> {
    move || with_header("x-user", [name])
}

#[tokio::test]
async fn users_from_an_auth_middleware_get_their_own_budgets() {
    let limit = per_hour(2).with_key(ExtensionKey::<UserId>::new());
    // The layer added last runs first: auth, then the rate limit.
    let app = routes()
        .layer(limit.clone())
        .layer(middleware::from_fn(authenticate));
    assert_eq!(statuses(&app, 3, user("alice")).await, expect(2, 1));
    assert_eq!(statuses(&app, 3, user("bob")).await, expect(2, 1));

    // In the wrong order the rate limit runs before auth and finds no user.
    let wrong = routes()
        .layer(middleware::from_fn(authenticate))
        .layer(limit);
    let status = send(&wrong, user("carol")()).await.status();
    assert_eq!(status, StatusCode::BAD_REQUEST);
}

// ---- Hooks: rejection, cost; sharing and readiness -----------------------------------

#[tokio::test]
async fn a_custom_rejection_still_gets_retry_after_and_the_fields() {
    let json = |request: &Request<Body>, decision: &Decision| -> Response<Body> {
        let body = format!(
            r#"{{"error":"rate_limited","path":"{}","retry_after_ms":{}}}"#,
            request.uri().path(),
            decision.retry_after().as_millis()
        );
        Response::builder()
            .status(LIMITED)
            .header(CONTENT_TYPE, "application/json")
            .body(Body::from(body))
            .unwrap()
    };
    let app = routes().layer(global(1).with_on_rejection(json));
    assert_eq!(send(&app, get("/a")).await.status(), OK);
    let denied = send(&app, get("/a")).await;
    assert_eq!(assert_limited(&denied), HOUR_LEFT);
    assert_eq!(lines(&denied, "content-type"), ["application/json"]);
    let body = axum::body::to_bytes(denied.into_body(), 1024)
        .await
        .unwrap();
    assert_eq!(
        body,
        r#"{"error":"rate_limited","path":"/a","retry_after_ms":2800000}"#
    );
}

#[tokio::test]
async fn clones_of_a_layer_share_one_budget() {
    // `Router::layer` clones the layer into every route.
    let app = routes().layer(global(3));
    let mut paths = ["/a", "/b"].iter().cycle();
    assert_eq!(
        statuses(&app, 4, || get(paths.next().unwrap())).await,
        expect(3, 1)
    );

    // Explicit clones on separate routes, too.
    let layer = global(3);
    let app = Router::new()
        .route("/a", any(ok).layer(layer.clone()))
        .route("/b", any(ok).layer(layer));
    let mut paths = ["/a", "/b"].iter().cycle();
    assert_eq!(
        statuses(&app, 4, || get(paths.next().unwrap())).await,
        expect(3, 1)
    );

    // Two layers built separately are two budgets.
    let app = Router::new()
        .route("/a", any(ok).layer(global(1)))
        .route("/b", any(ok).layer(global(1)));
    assert_eq!(send(&app, get("/a")).await.status(), OK);
    assert_eq!(send(&app, get("/b")).await.status(), OK);
}

/// An inner service that is ready only when its gate is open.
#[derive(Clone, Default)]
struct Gate(Arc<AtomicBool>);

impl Service<Request<Body>> for Gate {
    type Response = Response<Body>;
    type Error = Infallible;
    type Future = Ready<Result<Response<Body>, Infallible>>;

    fn poll_ready(&mut self, _cx: &mut Context<'_>) -> Poll<Result<(), Infallible>> {
        if self.0.load(Ordering::SeqCst) {
            Poll::Ready(Ok(()))
        } else {
            Poll::Pending
        }
    }

    fn call(&mut self, _request: Request<Body>) -> Self::Future {
        ready(Ok(Response::new(Body::empty())))
    }
}

#[tokio::test]
async fn poll_ready_delegates_and_limits_are_not_back_pressure() {
    let gate = Gate::default();
    let mut service = ServiceBuilder::new().layer(global(1)).service(gate.clone());
    let mut cx = Context::from_waker(Waker::noop());
    assert!(service.poll_ready(&mut cx).is_pending());
    gate.0.store(true, Ordering::SeqCst);
    assert!(matches!(service.poll_ready(&mut cx), Poll::Ready(Ok(()))));
    assert_eq!(service.call(get("/")).await.unwrap().status(), OK);
    // The budget is spent, yet the service stays ready: being limited is an answer.
    let limited = service.ready().await.unwrap().call(get("/")).await.unwrap();
    assert_limited(&limited);
    gate.0.store(false, Ordering::SeqCst);
    assert!(service.poll_ready(&mut cx).is_pending());
}

#[tokio::test]
async fn cost_weighs_requests() {
    let items = |request: &Request<Body>| -> u32 {
        let query = request.uri().query().unwrap_or("");
        query.strip_prefix("n=").map_or(1, |n| n.parse().unwrap())
    };
    let app = routes().layer(global(10).with_cost(items));
    let mut left = Vec::new();
    for uri in ["/?n=4", "/?n=4", "/?n=4", "/?n=2", "/"] {
        let response = send(&app, get(uri)).await;
        left.push((response.status(), remaining(&response)));
    }
    // A denied request consumes nothing: the third leaves 2 for the fourth.
    assert_eq!(
        left,
        [(OK, 6), (OK, 2), (LIMITED, 2), (OK, 0), (LIMITED, 0)]
    );
}

#[tokio::test]
async fn grpc_requests_are_never_429() {
    let app = routes().layer(global(1));
    let grpc = || {
        Request::post("/")
            .header(CONTENT_TYPE, "application/grpc+proto")
            .body(Body::empty())
            .unwrap()
    };
    assert_eq!(send(&app, grpc()).await.status(), OK);
    let denied = send(&app, grpc()).await;
    assert_eq!(denied.status(), OK);
    assert_eq!(lines(&denied, "grpc-status"), ["8"]);
    assert!(!lines(&denied, "grpc-message")[0].is_empty());
    assert_eq!(retry_after(&denied), HOUR_LEFT);
    assert_ietf_fields(&denied);
}

// ---- Redis ---------------------------------------------------------------------------

#[cfg(feature = "redis")]
mod redis_store {
    use crate::support::{self, RedisServer};
    use tollgate::{FailurePolicy, store::RedisStore};

    use super::*;

    async fn store(server: &RedisServer) -> RedisStore {
        let store = RedisStore::connect(server.url()).await.unwrap();
        store.with_clock(ManualClock::new(NOW_MS))
    }

    async fn concurrent(keyed: Keyed) {
        let server = RedisServer::start();
        two_hundred_concurrent_requests(store(&server).await, keyed).await;
        support::assert_every_key_expires(&server);
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn concurrent_requests_redis_global_key() {
        concurrent(Keyed::Global).await;
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn concurrent_requests_redis_peer_ip() {
        concurrent(Keyed::Peer).await;
    }

    #[tokio::test]
    async fn hostile_api_keys_make_short_expiring_redis_keys() {
        let server = RedisServer::start();
        hostile_identities_get_their_own_buckets(store(&server).await).await;
        let scan = server.cli(&["--scan"]).unwrap();
        let keys: Vec<&str> = scan.lines().filter(|k| !k.is_empty()).collect();
        assert_eq!(keys.len(), hostile_values().len(), "{keys:#?}");
        for key in &keys {
            assert!(key.len() <= 200, "{} bytes: {key}", key.len());
        }
        support::assert_every_key_expires(&server);
    }

    /// An app limited to 3 per hour in a Redis that has already died.
    async fn dead_redis(policy: FailurePolicy) -> (RedisServer, Router) {
        let mut server = RedisServer::start();
        let layer = global(3)
            .with_store(store(&server).await)
            .with_on_store_error(policy)
            .with_timeout(Some(Duration::from_millis(100)));
        server.kill();
        (server, routes().layer(layer))
    }

    #[tokio::test]
    async fn store_down_allow_passes_without_fields() {
        let (_server, app) = dead_redis(FailurePolicy::Allow).await;
        for _ in 0..5 {
            let response = send(&app, get("/")).await;
            assert_eq!(response.status(), OK);
            assert_no_rate_limit_fields(&response);
            assert!(!response.headers().contains_key("retry-after"));
        }
    }

    #[tokio::test]
    async fn store_down_deny_is_503_with_retry_after() {
        let (_server, app) = dead_redis(FailurePolicy::Deny).await;
        for _ in 0..3 {
            let response = send(&app, get("/")).await;
            assert_eq!(response.status(), StatusCode::SERVICE_UNAVAILABLE);
            retry_after(&response);
        }
    }

    #[tokio::test]
    async fn store_down_local_keeps_limiting() {
        // `FailurePolicy::local()` (it is `Local(MemoryStore)`) on a clock 100 s ahead of
        // the Redis store's, so that its answers cannot be mistaken for Redis's.
        let local = MemoryStore::new().with_clock(ManualClock::new(NOW_MS + 100_000));
        let (_server, app) = dead_redis(FailurePolicy::Local(local)).await;
        assert_eq!(statuses(&app, 5, || get("/")).await, expect(3, 2));
        assert_eq!(assert_limited(&send(&app, get("/")).await), HOUR_LEFT - 100);
    }
}
