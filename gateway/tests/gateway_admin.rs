//! The example gateway's admin endpoints (`/ratelimit/<route>` on `admin_listen`), end to
//! end over real TCP, with gateways started in-process as in `tests/gateway.rs`.
//!
//! Windows are an hour long, so counts are exact; the cross-gateway reset polls with a
//! generous deadline.

include!("common/modules.rs");
use tollgate_test_support as support;

use std::time::Duration;

use axum::body::{Body, Bytes};
use http::{HeaderMap, Method, StatusCode};
use http_body_util::BodyExt;
use hyper_util::{
    client::legacy::{Client, connect::HttpConnector},
    rt::TokioExecutor,
};

use config::Config;
use server::Running;

const TIMEOUT: Duration = Duration::from_secs(20);

type HttpClient = Client<HttpConnector, Body>;

fn client() -> HttpClient {
    Client::builder(TokioExecutor::new()).build(HttpConnector::new())
}

struct Reply {
    status: StatusCode,
    headers: HeaderMap,
    body: Bytes,
}

impl Reply {
    fn text(&self) -> &str {
        std::str::from_utf8(&self.body).unwrap()
    }
}

async fn send(client: &HttpClient, method: Method, url: &str, headers: &[(&str, &str)]) -> Reply {
    let mut request = http::Request::builder().method(method).uri(url);
    for (name, value) in headers {
        request = request.header(*name, *value);
    }
    let response = tokio::time::timeout(
        TIMEOUT,
        client.request(request.body(Body::empty()).unwrap()),
    )
    .await
    .expect("no answer in time")
    .unwrap();
    let (parts, body) = response.into_parts();
    Reply {
        status: parts.status,
        headers: parts.headers,
        body: body.collect().await.unwrap().to_bytes(),
    }
}

/// The routes every test uses: `/api` limited per IP (2/h), per API key (3/h) and, in
/// shadow, globally; `/` unlimited, so that the public listener answers any path.
const ROUTES: &str = r#"
[[routes]]
path = "/api"
[[routes.limits]]
key = "ip"
algorithm = "fixed_window"
limit = 2
window = "1h"
[[routes.limits]]
key = "header:x-api-key"
algorithm = "gcra"
limit = 3
window = "1h"
[[routes.limits]]
key = "global"
algorithm = "token_bucket"
limit = 1
window = "1h"
shadow = true
name = "all"

[[routes]]
path = "/"
"#;

async fn gateway(head: &str) -> Running {
    let text =
        format!("listen = \"127.0.0.1:0\"\nadmin_listen = \"127.0.0.1:0\"\n{head}\n{ROUTES}");
    let config = Config::parse(&text).unwrap_or_else(|e| panic!("{e}\n{text}"));
    server::start(config).await.unwrap()
}

/// The number that follows the first `after` in `text`.
fn number_after(text: &str, after: &str) -> u64 {
    let start = text
        .find(after)
        .unwrap_or_else(|| panic!("no {after} in {text}"))
        + after.len();
    let digits: String = text[start..]
        .chars()
        .take_while(char::is_ascii_digit)
        .collect();
    digits.parse().unwrap()
}

/// `text` with every `reset_after_ms` value as 0: it counts down with the wall clock
/// between two reads.
fn without_reset_after(text: &str) -> String {
    let mut out = String::new();
    let mut rest = text;
    while let Some(at) = rest.find("\"reset_after_ms\":") {
        let end = at + "\"reset_after_ms\":".len();
        out.push_str(&rest[..end]);
        out.push('0');
        rest = rest[end..].trim_start_matches(|c: char| c.is_ascii_digit());
    }
    out.push_str(rest);
    out
}

fn public(gw: &Running, path: &str) -> String {
    format!("http://{}{path}", gw.addr())
}

fn admin(gw: &Running, path: &str) -> String {
    format!("http://{}{path}", gw.admin_addr().unwrap())
}

/// Statuses of requests to `/api` with `x-api-key: key`.
async fn api(client: &HttpClient, gw: &Running, key: &str, n: usize) -> Vec<u16> {
    let mut statuses = Vec::new();
    for _ in 0..n {
        let reply = send(
            client,
            Method::GET,
            &public(gw, "/api"),
            &[("x-api-key", key)],
        )
        .await;
        statuses.push(reply.status.as_u16());
    }
    statuses
}

#[tokio::test]
async fn admin_reads_and_resets_a_clients_budget() {
    let gw = gateway("").await;
    let client = client();
    let ip = "/ratelimit/api?kind=ip&key=127.0.0.1";

    // Fresh: what the first request would get, per limit, shadow ones included.
    let fresh = send(&client, Method::GET, &admin(&gw, ip), &[]).await;
    assert_eq!(fresh.status, StatusCode::OK, "{}", fresh.text());
    assert_eq!(fresh.headers["content-type"], "application/json");
    let body = fresh.text();
    assert!(
        body.contains(r#""route":"/api","kind":"ip","cost":1,"allowed":true"#),
        "{body}"
    );
    assert!(
        body.contains(r#""algorithm":"fixed_window","limit":2,"window_ms":3600000"#),
        "{body}"
    );
    assert!(body.contains(r#""remaining":1,"#), "{body}");
    // Reading twice counts nothing (the window's end is a millisecond nearer, maybe).
    assert_eq!(
        without_reset_after(
            send(&client, Method::GET, &admin(&gw, ip), &[])
                .await
                .text()
        ),
        without_reset_after(body)
    );

    assert_eq!(api(&client, &gw, "k1", 3).await, [200, 200, 429]);
    let spent = send(&client, Method::GET, &admin(&gw, ip), &[]).await;
    let body = spent.text();
    assert!(
        body.contains(r#""shadow":false,"allowed":false,"remaining":0,"#),
        "{body}"
    );
    let retry_after = number_after(body, "\"retry_after_ms\":");
    assert!(retry_after > 0 && retry_after <= 3_600_000, "{body}");
    // cost=0 reads what is left.
    let left = send(
        &client,
        Method::GET,
        &admin(&gw, &format!("{ip}&cost=0")),
        &[],
    )
    .await;
    assert!(left.text().contains(r#""remaining":0,"#), "{}", left.text());

    // Reset by POST: the client's next request passes.
    let reset = send(&client, Method::POST, &admin(&gw, ip), &[]).await;
    assert_eq!(reset.status, StatusCode::OK, "{}", reset.text());
    assert_eq!(
        reset.text().trim(),
        r#"{"route":"/api","kind":"ip","reset":true}"#
    );
    assert_eq!(api(&client, &gw, "k1", 1).await, [200]);

    // Header keys (hashed in the store): k1 has used 3 of 3 by now (the request the IP
    // limit denied never reached them).
    let key = "/ratelimit/api?kind=header:x-api-key&key=k1";
    let spent = send(&client, Method::GET, &admin(&gw, key), &[]).await;
    assert!(
        spent.text().contains(r#""allowed":false"#),
        "{}",
        spent.text()
    );
    let other = "/ratelimit/api?kind=header:x-api-key&key=k2";
    let other = send(&client, Method::GET, &admin(&gw, other), &[]).await;
    assert!(
        other.text().contains(r#""allowed":true"#),
        "{}",
        other.text()
    );
    let reset = send(&client, Method::DELETE, &admin(&gw, key), &[]).await;
    assert_eq!(reset.status, StatusCode::OK, "{}", reset.text());
    // The IP budget was reset before 3 requests (2 allowed): reset it too.
    send(&client, Method::POST, &admin(&gw, ip), &[]).await;
    assert_eq!(api(&client, &gw, "k1", 1).await, [200]);

    // The global limit is in shadow: shown, never the reason for a denial.
    let global = send(
        &client,
        Method::GET,
        &admin(&gw, "/ratelimit/api?kind=global"),
        &[],
    )
    .await;
    let body = global.text();
    assert!(
        body.contains(r#""kind":"global","cost":1,"allowed":true"#),
        "{body}"
    );
    assert!(
        body.contains(r#""name":"all","algorithm":"token_bucket""#),
        "{body}"
    );
    assert!(body.contains(r#""shadow":true,"allowed":false"#), "{body}");
    gw.stop().await.unwrap();
}

#[tokio::test]
async fn admin_requests_that_cannot_be_answered_say_why() {
    let gw = gateway("").await;
    let client = client();
    let cases = [
        (
            Method::GET,
            "/ratelimit/api?key=127.0.0.1",
            StatusCode::BAD_REQUEST,
            "kind=",
        ),
        (
            Method::GET,
            "/ratelimit/api?kind=ip",
            StatusCode::BAD_REQUEST,
            "missing key",
        ),
        (
            Method::GET,
            "/ratelimit/api?kind=ip&key=nope",
            StatusCode::BAD_REQUEST,
            "not an IP",
        ),
        (
            Method::GET,
            "/ratelimit/api?kind=header:x-user&key=a",
            StatusCode::BAD_REQUEST,
            "x-user",
        ),
        (
            Method::GET,
            "/ratelimit/api?kind=ip&key=1.2.3.4&cost=x",
            StatusCode::BAD_REQUEST,
            "cost",
        ),
        (
            Method::GET,
            "/ratelimit/nowhere?key=1.2.3.4",
            StatusCode::NOT_FOUND,
            "/nowhere",
        ),
        (
            Method::GET,
            "/ratelimit/?key=1.2.3.4",
            StatusCode::NOT_FOUND,
            r#"path \"/\" has"#,
        ),
        (
            Method::PUT,
            "/ratelimit/api?kind=global",
            StatusCode::METHOD_NOT_ALLOWED,
            "GET",
        ),
    ];
    for (method, path, status, says) in cases {
        let reply = send(&client, method.clone(), &admin(&gw, path), &[]).await;
        assert_eq!(reply.status, status, "{method} {path}: {}", reply.text());
        assert!(
            reply.text().contains(says),
            "{method} {path}: {}",
            reply.text()
        );
        assert!(reply.text().starts_with(r#"{"error":"#), "{}", reply.text());
    }
    gw.stop().await.unwrap();
}

/// The public listener has no admin endpoints: `/ratelimit/...` there is just a path of
/// the `/` route, and a POST to it resets nothing.
#[tokio::test]
async fn the_public_listener_never_serves_the_admin_endpoints() {
    let gw = gateway("").await;
    let client = client();
    assert_eq!(api(&client, &gw, "k", 3).await, [200, 200, 429]);
    for method in [Method::GET, Method::POST, Method::DELETE] {
        let reply = send(
            &client,
            method,
            &public(&gw, "/ratelimit/api?kind=ip&key=127.0.0.1"),
            &[],
        )
        .await;
        assert_eq!(reply.status, StatusCode::OK);
        assert_eq!(reply.text(), "ok");
    }
    assert_eq!(api(&client, &gw, "k", 1).await, [429]);
    gw.stop().await.unwrap();
}

/// A tokenless admin listener on loopback refuses what a browser on that host could send
/// for a page of another site: a cross-site form post (`Origin`, `Sec-Fetch-Site`) and a
/// DNS-rebound request (`Host` a name of the attacker's); tools are served as before.
#[tokio::test]
async fn a_browser_page_elsewhere_cannot_use_the_admin_endpoints() {
    let gw = gateway("").await;
    let client = client();
    let path = "/ratelimit/api?kind=ip&key=127.0.0.1";
    let port = gw.admin_addr().unwrap().port();
    let rebound = format!("evil.example:{port}");
    for headers in [
        vec![("origin", "https://evil.example")],
        vec![("sec-fetch-site", "cross-site")],
        vec![("host", rebound.as_str())],
    ] {
        for method in [Method::GET, Method::POST] {
            let reply = send(&client, method, &admin(&gw, path), &headers).await;
            assert_eq!(reply.status, StatusCode::FORBIDDEN, "{headers:?}");
        }
    }
    let local = format!("localhost:{port}");
    for headers in [
        vec![],
        vec![("host", local.as_str())],
        vec![("host", "[::1]")],
    ] {
        let reply = send(&client, Method::POST, &admin(&gw, path), &headers).await;
        assert_eq!(
            reply.status,
            StatusCode::OK,
            "{headers:?}: {}",
            reply.text()
        );
    }
    gw.stop().await.unwrap();
}

/// With `admin_token_env`, every admin request needs the bearer token (`/metrics` keeps
/// its own rules).
#[tokio::test]
async fn the_admin_token_is_required_when_configured() {
    // An environment variable every test process has (setting one needs `unsafe`).
    let token = std::env::var("PATH").unwrap();
    let gw = gateway("admin_token_env = \"PATH\"").await;
    let client = client();
    let path = "/ratelimit/api?kind=ip&key=127.0.0.1";
    let bearer = format!("Bearer {token}");
    let wrong = format!("Bearer {token}x");
    for headers in [
        vec![],
        vec![("authorization", wrong.as_str())],
        vec![("authorization", token.as_str())],
        vec![("authorization", format!("Bearer{token}").leak())],
    ] {
        for method in [Method::GET, Method::POST] {
            let reply = send(&client, method, &admin(&gw, path), &headers).await;
            assert_eq!(reply.status, StatusCode::UNAUTHORIZED, "{headers:?}");
            assert_eq!(reply.headers["www-authenticate"], "Bearer");
        }
    }
    // The scheme is case-insensitive, and more than one space may follow it (RFC 9110).
    for spelled in [
        bearer.clone(),
        format!("bearer {token}"),
        format!("BEARER  {token}"),
    ] {
        let ok = send(
            &client,
            Method::GET,
            &admin(&gw, path),
            &[("authorization", &spelled)],
        )
        .await;
        assert_eq!(ok.status, StatusCode::OK, "{spelled}: {}", ok.text());
    }
    let ok = send(
        &client,
        Method::POST,
        &admin(&gw, path),
        &[("authorization", &bearer)],
    )
    .await;
    assert_eq!(ok.status, StatusCode::OK, "{}", ok.text());
    gw.stop().await.unwrap();
}

/// A header key that is not UTF-8 (obs-text bytes, percent-encoded in the query) resets
/// exactly that key, not the key of its lossy reading (`U+FFFD`).
#[tokio::test]
async fn a_reset_of_a_key_that_is_not_utf8_resets_that_key() {
    let text = "listen = \"127.0.0.1:0\"\nadmin_listen = \"127.0.0.1:0\"\n[[routes]]\n\
                path = \"/\"\n[[routes.limits]]\nkey = \"header:x-k\"\n\
                algorithm = \"fixed_window\"\nlimit = 1\nwindow = \"1h\"\n";
    let gw = server::start(Config::parse(text).unwrap()).await.unwrap();
    let client = client();
    let status = |value: &'static [u8]| {
        let request = http::Request::get(public(&gw, "/"))
            .header("x-k", http::HeaderValue::from_bytes(value).unwrap())
            .body(Body::empty())
            .unwrap();
        let response = client.request(request);
        async move {
            tokio::time::timeout(TIMEOUT, response)
                .await
                .expect("no answer in time")
                .unwrap()
                .status()
                .as_u16()
        }
    };
    let (raw, lossy): (&[u8], &[u8]) = (b"t\xff", "t\u{fffd}".as_bytes());
    assert_eq!([status(raw).await, status(raw).await], [200, 429]);
    assert_eq!([status(lossy).await, status(lossy).await], [200, 429]);
    let reset = send(
        &client,
        Method::POST,
        &admin(&gw, "/ratelimit/?key=t%FF"),
        &[],
    )
    .await;
    assert_eq!(reset.status, StatusCode::OK, "{}", reset.text());
    assert_eq!(status(raw).await, 200, "the key itself was reset");
    assert_eq!(status(lossy).await, 429, "another key was reset");
    // A key no header could carry is refused.
    let refused = send(
        &client,
        Method::POST,
        &admin(&gw, "/ratelimit/?key=a%0Ab"),
        &[],
    )
    .await;
    assert_eq!(
        refused.status,
        StatusCode::BAD_REQUEST,
        "{}",
        refused.text()
    );
    gw.stop().await.unwrap();
}

/// Configs that work but expose what they should not start (and reload) with a warning:
/// a tokenless admin listener beyond loopback, proxies trusted for every address, a
/// reload that drops the token.
#[tokio::test]
async fn exposing_configs_are_warned_about() {
    let (logs, _guard) = support::logs::Logs::capture();
    let parse =
        |head: &str| Config::parse(&format!("listen = \"127.0.0.1:0\"\n{head}\n{ROUTES}")).unwrap();
    // Listening on every interface: nothing is sent to it, it is stopped at once.
    let open = server::start(parse(
        "admin_listen = \"0.0.0.0:0\"\ntrusted_proxies = [\"10.0.0.0/8\", \"::/0\"]",
    ))
    .await
    .unwrap();
    open.stop().await.unwrap();
    let text = logs.text();
    assert!(
        text.contains("admin_listen is not a loopback address"),
        "{text}"
    );
    assert!(
        text.contains("trusted_proxies holds every address") && text.contains("::/0"),
        "{text}"
    );
    assert!(!text.contains("10.0.0.0/8"), "{text}");

    // Loopback with a token: no warning; a reload without the token: one.
    let guarded = server::start(parse(
        "admin_listen = \"127.0.0.1:0\"\nadmin_token_env = \"PATH\"",
    ))
    .await
    .unwrap();
    assert!(!logs.text().contains("removed admin_token_env"));
    guarded
        .live()
        .apply(parse("admin_listen = \"127.0.0.1:0\""))
        .unwrap();
    let text = logs.text();
    assert!(
        text.contains("config reload removed admin_token_env"),
        "{text}"
    );
    assert_eq!(text.matches("WARN").count(), 3, "{text}");
    guarded.stop().await.unwrap();
}

#[test]
fn admin_token_env_is_checked_when_the_config_loads() {
    let parse = |text: &str| Config::parse(&format!("listen = \"127.0.0.1:0\"\n{text}"));
    let without_admin = parse("admin_token_env = \"PATH\"").unwrap_err();
    assert_eq!(without_admin.field, "admin_token_env");
    assert!(
        without_admin.message.contains("admin_listen"),
        "{without_admin}"
    );
    let unset = parse(
        "admin_listen = \"127.0.0.1:0\"\nadmin_token_env = \"TOLLGATE_TEST_UNSET_ADMIN_TOKEN\"",
    )
    .unwrap_err();
    assert_eq!(unset.field, "admin_token_env");
    assert!(
        unset.message.contains("TOLLGATE_TEST_UNSET_ADMIN_TOKEN"),
        "{unset}"
    );
    let config = parse("admin_listen = \"127.0.0.1:0\"\nadmin_token_env = \"PATH\"").unwrap();
    // The token never shows in Debug.
    let token = std::env::var("PATH").unwrap();
    assert!(!format!("{config:?}").contains(&token));
}

/// Two gateways share one Redis: gateway B denies a client from its block cache, a reset
/// through gateway A's admin endpoint reaches it, and B lets the client through.
#[cfg(feature = "redis")]
#[tokio::test]
async fn a_reset_through_one_gateway_reaches_another() {
    let redis = support::RedisServer::start();
    let store = format!(
        "[store]\nbackend = \"redis\"\nurl = \"{}\"\nprefix = \"gw\"",
        redis.url()
    );
    let a = gateway(&store).await;
    let b = gateway(&store).await;
    let client = client();
    assert_eq!(api(&client, &b, "k", 3).await, [200, 200, 429]);
    // B remembers the denial; its listener subscribes (poll, no fixed sleep).
    let start = std::time::Instant::now();
    let subscribed = || {
        redis
            .cli(&["PUBSUB", "NUMSUB", "gw:reset"])
            .and_then(|out| out.lines().nth(1).map(|n| n.trim() != "0"))
            .unwrap_or(false)
    };
    while !subscribed() {
        assert!(start.elapsed() < TIMEOUT, "gateway B never subscribed");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    assert_eq!(api(&client, &b, "k", 1).await, [429]);

    let ip = "/ratelimit/api?kind=ip&key=127.0.0.1";
    let reset = send(&client, Method::POST, &admin(&a, ip), &[]).await;
    assert_eq!(reset.status, StatusCode::OK, "{}", reset.text());
    let start = std::time::Instant::now();
    while api(&client, &b, "k", 1).await != [200] {
        assert!(
            start.elapsed() < TIMEOUT,
            "gateway B still denies after the reset"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    a.stop().await.unwrap();
    b.stop().await.unwrap();
}

/// Header keys hashed with an HMAC secret (`key_secret_env`): the admin endpoint is given
/// the API key itself and finds the same store key the requests were counted under.
#[tokio::test]
async fn hmac_hashed_header_keys_are_found_from_the_api_key() {
    let text = r#"
listen = "127.0.0.1:0"
admin_listen = "127.0.0.1:0"
[store]
key_secret_env = "PATH"
[[routes]]
path = "/keyed"
[[routes.limits]]
key = "header:x-api-key"
algorithm = "sliding_window"
limit = 2
window = "1h"
"#;
    let gw = server::start(Config::parse(text).unwrap()).await.unwrap();
    let client = client();
    let request = |key: &'static str| {
        let url = public(&gw, "/keyed");
        let client = client.clone();
        async move {
            send(&client, Method::GET, &url, &[("x-api-key", key)])
                .await
                .status
                .as_u16()
        }
    };
    for want in [200, 200, 429] {
        assert_eq!(request("secret-key").await, want);
    }
    let path = "/ratelimit/keyed?key=secret-key";
    let spent = send(&client, Method::GET, &admin(&gw, path), &[]).await;
    assert!(
        spent.text().contains(r#""allowed":false"#),
        "{}",
        spent.text()
    );
    let reset = send(&client, Method::DELETE, &admin(&gw, path), &[]).await;
    assert_eq!(reset.status, StatusCode::OK, "{}", reset.text());
    assert_eq!(request("secret-key").await, 200);
    gw.stop().await.unwrap();
}

/// `plan=<name>` reads a client's budget under one of the route's plans (the library's
/// `Limiter::peek_plan`: the plan's limits, its own state), resets the client under every
/// plan, and names the route's plans when the plan is not one of them; without `plan=`
/// the route's own limits answer, as before (404 on a route with only plans).
#[tokio::test]
async fn admin_reads_and_resets_plan_budgets() {
    let text = r#"
listen = "127.0.0.1:0"
admin_listen = "127.0.0.1:0"
[[routes]]
path = "/mixed"
plan_header = "x-plan"
default_plan = "free"
[[routes.limits]]
key = "ip"
algorithm = "fixed_window"
limit = 100
window = "1h"
[[routes.plans]]
name = "free"
[[routes.plans.limits]]
key = "header:x-api-key"
algorithm = "fixed_window"
limit = 2
window = "1h"
name = "hourly"
[[routes.plans]]
name = "paid"
[[routes.plans.limits]]
key = "header:x-api-key"
algorithm = "fixed_window"
limit = 5
window = "1h"
name = "hourly"
[[routes.plans]]
name = "internal"
unlimited = true

[[routes]]
path = "/plans-only"
plan_header = "x-plan"
default_plan = "free"
[[routes.plans]]
name = "free"
[[routes.plans.limits]]
key = "global"
algorithm = "fixed_window"
limit = 1
window = "1h"
"#;
    let gw = server::start(Config::parse(text).unwrap()).await.unwrap();
    let client = client();
    let call = |plan: &'static str| {
        let url = public(&gw, "/mixed");
        let client = client.clone();
        async move {
            let headers = [("x-api-key", "k1"), ("x-plan", plan)];
            send(&client, Method::GET, &url, &headers)
                .await
                .status
                .as_u16()
        }
    };
    assert_eq!(call("free").await, 200);
    assert_eq!(call("paid").await, 200);
    assert_eq!(call("paid").await, 200);
    let read = |path: &'static str| {
        let url = admin(&gw, path);
        let client = client.clone();
        async move { send(&client, Method::GET, &url, &[]).await }
    };
    let free = read("/ratelimit/mixed?plan=free&key=k1&cost=0").await;
    assert_eq!(free.status, StatusCode::OK, "{}", free.text());
    assert_eq!(
        without_reset_after(free.text()),
        r#"{"route":"/mixed","kind":"header:x-api-key","plan":"free","cost":0,"allowed":true,"limits":[{"name":"hourly","algorithm":"fixed_window","limit":2,"window_ms":3600000,"shadow":false,"allowed":true,"remaining":1,"reset_after_ms":0,"retry_after_ms":0}]}
"#
    );
    let paid = read("/ratelimit/mixed?plan=paid&key=k1").await;
    assert_eq!(
        number_after(paid.text(), r#""remaining":"#),
        2,
        "{}",
        paid.text()
    );
    assert_eq!(
        number_after(paid.text(), r#""limit":"#),
        5,
        "{}",
        paid.text()
    );
    let internal = read("/ratelimit/mixed?plan=internal&key=k1").await;
    assert!(
        internal
            .text()
            .contains(r#""plan":"internal","cost":1,"allowed":true,"limits":[]"#),
        "{}",
        internal.text()
    );
    // Without plan=, the route's own limit (per IP).
    let own = read("/ratelimit/mixed?key=127.0.0.1&cost=0").await;
    assert!(
        own.text().contains(r#""kind":"ip","cost":0"#) && own.text().contains(r#""remaining":97"#),
        "{}",
        own.text()
    );
    let unknown = read("/ratelimit/mixed?plan=gold&key=k1").await;
    assert_eq!(unknown.status, StatusCode::BAD_REQUEST);
    assert!(
        unknown
            .text()
            .contains("no plan \\\"gold\\\" (it has free, paid, internal)"),
        "{}",
        unknown.text()
    );
    let only = read("/ratelimit/plans-only?key=x").await;
    assert_eq!(only.status, StatusCode::NOT_FOUND);
    assert!(only.text().contains("has only plans"), "{}", only.text());
    let only = read("/ratelimit/plans-only?plan=free").await;
    assert_eq!(only.status, StatusCode::OK, "{}", only.text());

    // A reset clears the client under every plan.
    let reset = send(
        &client,
        Method::POST,
        &admin(&gw, "/ratelimit/mixed?plan=paid&key=k1"),
        &[],
    )
    .await;
    assert_eq!(reset.status, StatusCode::OK, "{}", reset.text());
    assert_eq!(
        reset.text(),
        "{\"route\":\"/mixed\",\"kind\":\"header:x-api-key\",\"plan\":\"paid\",\"reset\":true}\n"
    );
    for (plan, left) in [("free", 2), ("paid", 5)] {
        let path = format!("/ratelimit/mixed?plan={plan}&key=k1&cost=0");
        let reply = send(&client, Method::GET, &admin(&gw, &path), &[]).await;
        assert_eq!(
            number_after(reply.text(), r#""remaining":"#),
            left,
            "{}",
            reply.text()
        );
    }
    gw.stop().await.unwrap();
}
