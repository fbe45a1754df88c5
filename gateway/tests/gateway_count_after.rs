//! The example gateway's `count_when` and `cost_header` route options, end to end over
//! real HTTP: the gateway runs in-process (as in tests/gateway.rs) in front of an
//! upstream that answers the status and `x-cost` it is asked for. Memory, and a private
//! `redis-server` with the `redis` feature. Windows are an hour: counts are exact.

include!("common/modules.rs");
#[cfg(feature = "redis")]
use tollgate_test_support as support;

use std::{net::SocketAddr, time::Duration};

use axum::{
    Router,
    body::Body,
    extract::Request,
    http::StatusCode,
    response::{IntoResponse, Response},
};
use hyper_util::{
    client::legacy::{Client, connect::HttpConnector},
    rt::TokioExecutor,
};
use tokio::net::TcpListener;

use config::Config;
use server::Running;

/// Answers the status in `x-want-status` (200 without), with `x-cost: <x-want-cost>`.
async fn upstream(request: Request) -> Response {
    let headers = request.headers();
    let status = headers
        .get("x-want-status")
        .and_then(|v| v.to_str().ok()?.parse::<u16>().ok())
        .map_or(StatusCode::OK, |s| StatusCode::from_u16(s).unwrap());
    let mut response = (status, "upstream").into_response();
    if let Some(cost) = headers.get("x-want-cost") {
        response.headers_mut().insert("x-cost", cost.clone());
    }
    response
}

async fn start(store: &str) -> Running {
    let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr: SocketAddr = listener.local_addr().unwrap();
    tokio::spawn(async move {
        axum::serve(listener, Router::new().fallback(upstream))
            .await
            .unwrap();
    });
    let text = format!(
        r#"listen = "127.0.0.1:0"
{store}
[[routes]]
path = "/login"
upstream = "http://{addr}"
count_when = "failure"

[[routes.limits]]
key = "header:x-user"
algorithm = "fixed_window"
limit = 3
window = "1h"

[[routes]]
path = "/plans"
upstream = "http://{addr}"
count_when = "failure"
plan_header = "x-plan"
default_plan = "free"

[[routes.plans]]
name = "free"

[[routes.plans.limits]]
key = "header:x-user"
algorithm = "fixed_window"
limit = 2
window = "1h"

[[routes.plans]]
name = "pro"

[[routes.plans.limits]]
key = "header:x-user"
algorithm = "fixed_window"
limit = 4
window = "1h"

[[routes]]
path = "/wait"
upstream = "http://{addr}"
count_when = "failure"
delay = "3s"

[[routes.limits]]
key = "header:x-user"
algorithm = "gcra"
limit = 1
window = "1s"

[[routes]]
path = "/llm"
upstream = "http://{addr}"
cost_header = "x-cost"

[[routes.limits]]
key = "global"
algorithm = "token_bucket"
limit = 10
window = "1h"
"#
    );
    let config = Config::parse(&text).unwrap_or_else(|e| panic!("{e}\n{text}"));
    server::start(config).await.unwrap()
}

/// GET `path` with these headers; the status and `retry-after`.
async fn send(gateway: &Running, path: &str, headers: &[(&str, &str)]) -> (u16, Option<u64>) {
    let client: Client<HttpConnector, Body> =
        Client::builder(TokioExecutor::new()).build(HttpConnector::new());
    let mut request = http::Request::get(format!("http://{}{path}", gateway.addr()));
    for (name, value) in headers {
        request = request.header(*name, *value);
    }
    let response = tokio::time::timeout(
        Duration::from_secs(20),
        client.request(request.body(Body::empty()).unwrap()),
    )
    .await
    .unwrap()
    .unwrap();
    let retry = response
        .headers()
        .get("retry-after")
        .and_then(|v| v.to_str().ok()?.parse().ok());
    (response.status().as_u16(), retry)
}

/// `count_when = "failure"`: only answers of 400 and above count; once a user has three,
/// every request of theirs is a 429 before it reaches the upstream.
/// `cost_header = "x-cost"`: the upstream's `x-cost` is what a request costs, charged over
/// the limit too (10 tokens an hour, one per 360 s); a value that is no whole number
/// (hostile, or too large) keeps the 1 charged.
async fn counts_after_the_response(store: &str) {
    let gateway = start(store).await;
    let ok = [("x-user", "ann")];
    let failed = [("x-user", "ann"), ("x-want-status", "401")];
    for _ in 0..10 {
        assert_eq!(send(&gateway, "/login", &ok).await.0, 200);
    }
    for _ in 0..3 {
        assert_eq!(send(&gateway, "/login", &failed).await.0, 401);
    }
    assert_eq!(send(&gateway, "/login", &ok).await.0, 429);
    assert_eq!(send(&gateway, "/login", &[("x-user", "bob")]).await.0, 200);

    // Plans count after the response too, each against its own limit (before: as
    // decided, so successes spent the plan's budget).
    for plan in ["free", "pro"] {
        let ok = [("x-user", "cy"), ("x-plan", plan)];
        let failed = [("x-user", "cy"), ("x-plan", plan), ("x-want-status", "500")];
        for _ in 0..6 {
            assert_eq!(send(&gateway, "/plans", &ok).await.0, 200, "{plan}");
        }
        let allowed = if plan == "free" { 2 } else { 4 };
        for _ in 0..allowed {
            assert_eq!(send(&gateway, "/plans", &failed).await.0, 500, "{plan}");
        }
        assert_eq!(send(&gateway, "/plans", &ok).await.0, 429, "{plan}");
    }

    // `delay` with `count_when`: after a kept failure, a request over the rate waits
    // instead of a 429 (before: the delay was dropped, a 429 at once); its success gives
    // its unit back, so the next one does not wait.
    let dee = [("x-user", "dee")];
    let dee_fails = [("x-user", "dee"), ("x-want-status", "500")];
    assert_eq!(send(&gateway, "/wait", &dee_fails).await.0, 500);
    let started = std::time::Instant::now();
    assert_eq!(send(&gateway, "/wait", &dee).await.0, 200);
    assert!(started.elapsed() >= Duration::from_millis(500), "it waited");

    for _ in 0..30 {
        assert_eq!(send(&gateway, "/llm", &[("x-want-cost", "0")]).await.0, 200);
    }
    for hostile in ["-5", "abc", "99999999999999999999", "1.5"] {
        assert_eq!(
            send(&gateway, "/llm", &[("x-want-cost", hostile)]).await.0,
            200
        );
    }
    // 4 spent; 1 up front and 12 in the end: 10 - 16 = a debt of 6 tokens.
    assert_eq!(
        send(&gateway, "/llm", &[("x-want-cost", "12")]).await.0,
        200
    );
    let (status, retry) = send(&gateway, "/llm", &[]).await;
    assert_eq!(status, 429);
    // One token needs the debt paid off first: 7 refills of 360 s.
    assert_eq!(retry, Some(7 * 360));
    gateway.stop().await.unwrap();
}

#[tokio::test]
async fn memory_counts_after_the_response() {
    counts_after_the_response("").await;
}

#[cfg(feature = "redis")]
#[tokio::test]
async fn redis_counts_after_the_response() {
    let redis = support::RedisServer::start();
    let store = format!(
        "[store]\nbackend = \"redis\"\nurl = {:?}\nprefix = \"after\"\ntimeout_ms = 2000\n",
        redis.url()
    );
    counts_after_the_response(&store).await;
}

#[test]
fn invalid_count_options_are_rejected_naming_the_field() {
    let cases = [
        ("count_when = \"sometimes\"", "routes[0].count_when"),
        ("count_when = \"\"", "routes[0].count_when"),
        ("cost_header = \"bad header\"", "routes[0].cost_header"),
        ("cost_header = \"\"", "routes[0].cost_header"),
    ];
    for (line, field) in cases {
        let text = format!("listen = \"127.0.0.1:0\"\n[[routes]]\npath = \"/\"\n{line}\n");
        let error = Config::parse(&text).unwrap_err().to_string();
        assert!(error.contains(field), "{line}: {error}");
    }
    for line in ["count_when = \"always\"", "count_when = \"success\""] {
        let text = format!(
            "listen = \"127.0.0.1:0\"\n[[routes]]\npath = \"/\"\n{line}\ncost_header = \"x-cost\"\n"
        );
        Config::parse(&text).unwrap_or_else(|e| panic!("{line}: {e}"));
    }
}
