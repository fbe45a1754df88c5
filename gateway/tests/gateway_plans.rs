//! The example gateway's plans (`[[routes.plans]]`) over real HTTP: the plan header picks
//! the limits, the default plan takes the rest, each plan keeps its own budget, the
//! route's own limits still apply, a reload changes the plans, and bad plan configs are
//! refused naming the field. On the memory backend, and on a private `redis-server`.
//!
//! Windows are an hour long, so that counts are exact however slow the machine is.

include!("common/modules.rs");
#[cfg(feature = "redis")]
use tollgate_test_support as support;

use std::time::Duration;

use axum::{
    body::{Body, Bytes},
    http::{HeaderMap, StatusCode},
};
use http_body_util::BodyExt;
use hyper_util::{
    client::legacy::{Client, connect::HttpConnector},
    rt::TokioExecutor,
};

use config::Config;
use server::Running;

const TIMEOUT: Duration = Duration::from_secs(20);

/// `[[routes]]` on `/api`: 100 an hour per IP for everyone, then the plans (free 2 an hour,
/// paid 5, internal unlimited, free by default, `x-plan` names the plan) per API key.
const ROUTES: &str = r#"
[[routes]]
path = "/api"
plan_header = "x-plan"
default_plan = "free"

[[routes.limits]]
key = "ip"
algorithm = "fixed_window"
limit = 100
window = "1h"
name = "per-ip"

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
"#;

fn config(store: &str, routes: &str) -> Config {
    let text =
        format!("listen = \"127.0.0.1:0\"\nadmin_listen = \"127.0.0.1:0\"\n{store}\n{routes}");
    Config::parse(&text).unwrap_or_else(|e| panic!("{e}\n{text}"))
}

type HttpClient = Client<HttpConnector, Body>;

struct Reply {
    status: StatusCode,
    headers: HeaderMap,
    body: Bytes,
}

impl Reply {
    /// Every line of the field `name`, joined.
    fn field(&self, name: &str) -> String {
        let lines: Vec<&str> = self
            .headers
            .get_all(name)
            .iter()
            .map(|v| v.to_str().unwrap())
            .collect();
        lines.join(" | ")
    }
}

async fn get(client: &HttpClient, url: String, key: Option<&str>, plan: Option<&str>) -> Reply {
    let mut request = http::Request::get(url);
    if let Some(key) = key {
        request = request.header("x-api-key", key);
    }
    if let Some(plan) = plan {
        request = request.header("x-plan", plan);
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

/// The scenario on a route at `path` (tests running at once share the metrics recorder:
/// each has a route of its own).
async fn plans_pick_the_limits(store: &str, path: &str) {
    let routes = ROUTES.replace("path = \"/api\"", &format!("path = {path:?}"));
    let gateway: Running = server::start(config(store, &routes)).await.unwrap();
    let client = Client::builder(TokioExecutor::new()).build(HttpConnector::new());
    let api = || format!("http://{}{path}", gateway.addr());
    let status = |key: &'static str, plan: Option<&'static str>| {
        let client = client.clone();
        let url = api();
        async move { get(&client, url, Some(key), plan).await.status }
    };

    // free: 2 an hour; the fields show the plan's policy next to the route's own limit.
    let reply = get(&client, api(), Some("k1"), Some("free")).await;
    assert_eq!(reply.status, StatusCode::OK);
    assert_eq!(reply.body, "ok");
    assert_eq!(
        reply.field("ratelimit-policy"),
        r#""free.hourly";q=2;w=3600 | "per-ip";q=100;w=3600"#
    );
    assert_eq!(status("k1", Some("free")).await, StatusCode::OK);
    let reply = get(&client, api(), Some("k1"), Some("free")).await;
    assert_eq!(reply.status, StatusCode::TOO_MANY_REQUESTS);
    assert!(
        reply
            .field("ratelimit")
            .starts_with(r#""free.hourly";r=0;"#)
    );

    // paid: a budget of its own for the same key.
    for _ in 0..5 {
        assert_eq!(status("k1", Some("paid")).await, StatusCode::OK);
    }
    assert_eq!(
        status("k1", Some("paid")).await,
        StatusCode::TOO_MANY_REQUESTS
    );

    // internal: unlimited (the route's own per-IP limit still counts it).
    for _ in 0..10 {
        let reply = get(&client, api(), Some("k1"), Some("internal")).await;
        assert_eq!(reply.status, StatusCode::OK);
        assert_eq!(reply.field("ratelimit-policy"), r#""per-ip";q=100;w=3600"#);
    }

    // No plan, or an unknown one: the default plan.
    assert_eq!(status("k2", None).await, StatusCode::OK);
    assert_eq!(status("k2", Some("platinum")).await, StatusCode::OK);
    assert_eq!(status("k2", None).await, StatusCode::TOO_MANY_REQUESTS);

    // The plans' metrics.
    let admin = gateway.admin_addr().unwrap();
    let page = get(&client, format!("http://{admin}/metrics"), None, None).await;
    let page = std::str::from_utf8(&page.body).unwrap().to_owned();
    let value = |plan: &str, outcome: &str| -> u64 {
        let labels = [
            format!(r#"route="{path} plans""#),
            format!(r#"plan="{plan}""#),
            format!(r#"outcome="{outcome}""#),
        ];
        page.lines()
            .filter(|line| line.starts_with("tollgate_plan_requests_total{"))
            .find(|line| labels.iter().all(|l| line.contains(l.as_str())))
            .map_or(0, |line| line.rsplit(' ').next().unwrap().parse().unwrap())
    };
    if cfg!(feature = "metrics") {
        assert_eq!(value("free", "allowed"), 4, "{page}");
        assert_eq!(value("free", "denied"), 2, "{page}");
        assert_eq!(value("paid", "allowed"), 5, "{page}");
        assert_eq!(value("internal", "allowed"), 10, "{page}");
    }

    // A reload that adds a plan: it applies to the next request, and the other plans
    // keep their budgets.
    let more = format!("{routes}\n[[routes.plans]]\nname = \"platinum\"\nunlimited = true\n");
    gateway.live().apply(config(store, &more)).unwrap();
    assert_eq!(status("k2", Some("platinum")).await, StatusCode::OK);
    assert_eq!(status("k2", Some("platinum")).await, StatusCode::OK);
    assert_eq!(status("k2", None).await, StatusCode::TOO_MANY_REQUESTS);
    assert_eq!(
        status("k1", Some("paid")).await,
        StatusCode::TOO_MANY_REQUESTS
    );
    gateway.stop().await.unwrap();
}

#[tokio::test]
async fn memory_plans_pick_the_limits() {
    plans_pick_the_limits("", "/memory").await;
}

#[cfg(feature = "redis")]
#[tokio::test]
async fn redis_plans_pick_the_limits() {
    let redis = support::RedisServer::start();
    let store = format!(
        "[store]\nbackend = \"redis\"\nurl = {:?}\nprefix = \"plans\"\ntimeout_ms = 2000\n",
        redis.url()
    );
    plans_pick_the_limits(&store, "/redis").await;
    // Each plan's state in keys of its own.
    let keys = redis.cli(&["KEYS", "plans:*"]).unwrap();
    assert!(keys.lines().any(|k| k.contains(":@free:")), "{keys}");
    assert!(keys.lines().any(|k| k.contains(":@paid:")), "{keys}");
    support::assert_every_key_expires(&redis);
}

/// Configs without plans keep working unchanged; bad plan configs are refused, naming
/// the field.
#[test]
fn bad_plans_are_refused_naming_the_field() {
    let parse = |routes: &str| Config::parse(&format!("listen = \"127.0.0.1:0\"\n{routes}"));
    assert!(parse(ROUTES).is_ok());
    let plan_limit = "[[routes.plans.limits]]\nkey = \"ip\"\nalgorithm = \"fixed_window\"\n\
                      limit = 1\nwindow = \"1h\"\n";
    let route = "[[routes]]\npath = \"/\"\n";
    let header = "plan_header = \"x-plan\"\n";
    let default = "default_plan = \"a\"\n";
    let cases: Vec<(String, &str)> = vec![
        (format!("{route}{header}"), "routes[0].plan_header"),
        (format!("{route}{default}"), "routes[0].default_plan"),
        (
            format!("{route}{default}[[routes.plans]]\nname = \"a\"\n{plan_limit}"),
            "routes[0].plan_header",
        ),
        (
            format!(
                "{route}plan_header = \"x plan\"\n{default}[[routes.plans]]\nname = \"a\"\n{plan_limit}"
            ),
            "routes[0].plan_header",
        ),
        (
            format!("{route}{header}[[routes.plans]]\nname = \"a\"\n{plan_limit}"),
            "routes[0].default_plan",
        ),
        (
            format!(
                "{route}{header}default_plan = \"b\"\n[[routes.plans]]\nname = \"a\"\n{plan_limit}"
            ),
            "routes[0].default_plan",
        ),
        (
            format!(
                "{route}{header}{default}[[routes.plans]]\nname = \"a\"\n{plan_limit}\
                 [[routes.plans]]\nname = \"a\"\nunlimited = true\n"
            ),
            "routes[0].plans[1].name",
        ),
        (
            format!("{route}{header}{default}[[routes.plans]]\nname = \"a b\"\nunlimited = true\n"),
            "routes[0].plans[0].name",
        ),
        (
            format!("{route}{header}{default}[[routes.plans]]\nname = \"a\"\n"),
            "routes[0].plans[0].limits",
        ),
        (
            format!(
                "{route}{header}{default}[[routes.plans]]\nname = \"a\"\nunlimited = true\n{plan_limit}"
            ),
            "routes[0].plans[0].unlimited",
        ),
        (
            format!(
                "{route}{header}{default}[[routes.plans]]\nname = \"a\"\n{plan_limit}\
                 [[routes.plans]]\nname = \"b\"\n{}",
                plan_limit.replace("\"ip\"", "\"global\"")
            ),
            "routes[0].plans[1].limits[0].key",
        ),
        (
            format!(
                "{route}{header}{default}[[routes.plans]]\nname = \"a\"\n{plan_limit}shadow = true\n"
            ),
            "routes[0].plans[0].limits[0].shadow",
        ),
        (
            format!(
                "{route}{header}{default}[[routes.plans]]\nname = \"a\"\n{}",
                plan_limit.replace("limit = 1", "limit = 0")
            ),
            "routes[0].plans[0].limits[0].limit",
        ),
    ];
    for (routes, field) in cases {
        match parse(&routes) {
            Ok(_) => panic!("accepted:\n{routes}"),
            Err(error) => assert_eq!(error.field, field, "{error}\n{routes}"),
        }
    }
}
