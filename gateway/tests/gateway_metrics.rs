//! The gateway's traffic metrics on `/metrics`, read with a Prometheus text-format parser
//! after a known run: every count exact, per label set.
//!
//! One test in this binary: the recorder is global to the process, and the series of
//! requests that match no route and of the config reloads are shared by every gateway in
//! it, so no other test may add to them.

include!("common/modules.rs");

use std::{
    collections::{BTreeMap, BTreeSet},
    net::SocketAddr,
    sync::Arc,
    time::{Duration, SystemTime},
};

use axum::{
    Router,
    body::{Body, Bytes},
    extract::{Request, State},
    http::{Method, StatusCode},
    response::{IntoResponse, Response},
};
use futures_util::stream;
use http_body_util::BodyExt;
use hyper_util::{
    client::legacy::{Client, connect::HttpConnector},
    rt::TokioExecutor,
};
use prometheus_parse::{Sample, Scrape, Value};
use tokio::{net::TcpListener, sync::Semaphore};

use config::Config;

const TIMEOUT: Duration = Duration::from_secs(20);

type HttpClient = Client<HttpConnector, Body>;

/// An upstream answering `hello` (5 bytes) after reading the request's body, with the
/// status in `x-want-status` if any; `/m/open/hold` waits for a permit first.
async fn upstream(hold: Arc<Semaphore>) -> SocketAddr {
    async fn answer(State(hold): State<Arc<Semaphore>>, request: Request) -> Response {
        if request.uri().path() == "/m/open/hold" {
            hold.acquire().await.unwrap().forget();
        }
        let status = request
            .headers()
            .get("x-want-status")
            .and_then(|v| v.to_str().ok()?.parse::<u16>().ok())
            .and_then(|s| StatusCode::from_u16(s).ok())
            .unwrap_or(StatusCode::OK);
        let _ = request.into_body().collect().await;
        (status, "hello").into_response()
    }
    let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    let app = Router::new().fallback(answer).with_state(hold);
    tokio::spawn(async move { axum::serve(listener, app).await.unwrap() });
    addr
}

/// What a client saw: per (method label, route, status), the responses and their body bytes.
#[derive(Default)]
struct Seen(BTreeMap<(String, String, u16), (u64, u64)>);

impl Seen {
    fn add(&mut self, method: &str, route: &str, status: u16, bytes: usize) {
        let entry = self
            .0
            .entry((method.to_owned(), route.to_owned(), status))
            .or_default();
        entry.0 += 1;
        entry.1 += bytes as u64;
    }
}

async fn send(client: &HttpClient, request: http::Request<Body>) -> (u16, Bytes) {
    let response = tokio::time::timeout(TIMEOUT, client.request(request))
        .await
        .expect("no answer in time")
        .unwrap();
    let status = response.status().as_u16();
    (
        status,
        response.into_body().collect().await.unwrap().to_bytes(),
    )
}

fn request(method: &str, url: String) -> http::request::Builder {
    http::Request::builder()
        .method(Method::from_bytes(method.as_bytes()).unwrap())
        .uri(url)
}

/// The page, parsed.
async fn scrape(client: &HttpClient, admin: SocketAddr) -> (Scrape, String) {
    let request = request("GET", format!("http://{admin}/metrics"))
        .body(Body::empty())
        .unwrap();
    let (status, body) = send(client, request).await;
    assert_eq!(status, 200);
    let text = String::from_utf8(body.to_vec()).unwrap();
    let scrape = Scrape::parse(text.lines().map(|l| Ok(l.to_owned()))).unwrap();
    (scrape, text)
}

/// The labels of a sample, as a sorted map.
fn labels(sample: &Sample) -> BTreeMap<String, String> {
    sample
        .labels
        .iter()
        .map(|(k, v)| (k.clone(), v.clone()))
        .collect()
}

fn set(pairs: &[(&str, &str)]) -> BTreeMap<String, String> {
    pairs
        .iter()
        .map(|(k, v)| ((*k).to_owned(), (*v).to_owned()))
        .collect()
}

/// The samples of `metric` whose labels include `having`.
fn having<'a>(
    scrape: &'a Scrape,
    metric: &'a str,
    having: &'a [(&'a str, &'a str)],
) -> impl Iterator<Item = &'a Sample> + 'a {
    scrape.samples.iter().filter(move |s| {
        s.metric == metric && having.iter().all(|(k, v)| s.labels.get(k) == Some(*v))
    })
}

/// The value of the counter or gauge `metric` with exactly `labels` (0 when absent).
fn value(scrape: &Scrape, metric: &str, labels_: &[(&str, &str)]) -> f64 {
    let want = set(labels_);
    let found: Vec<f64> = scrape
        .samples
        .iter()
        .filter(|s| s.metric == metric && labels(s) == want)
        .map(|s| match s.value {
            Value::Counter(v) | Value::Gauge(v) | Value::Untyped(v) => v,
            _ => panic!("{metric} is not a number"),
        })
        .collect();
    assert!(found.len() <= 1, "{metric}{want:?} twice");
    found.first().copied().unwrap_or(0.0)
}

/// A histogram with exactly `labels`: its count and sum, checked against its buckets
/// (cumulative, ending in `+Inf` = count). `None` when absent.
fn histogram(scrape: &Scrape, metric: &str, labels_: &[(&str, &str)]) -> Option<(u64, f64)> {
    let want = set(labels_);
    let sample = scrape
        .samples
        .iter()
        .find(|s| s.metric == metric && labels(s) == want)?;
    let Value::Histogram(buckets) = &sample.value else {
        panic!("{metric} is not a histogram: {:?}", sample.value);
    };
    let count = value(scrape, &format!("{metric}_count"), labels_);
    let sum = value(scrape, &format!("{metric}_sum"), labels_);
    let mut buckets = buckets.clone();
    buckets.sort_by(|a, b| a.less_than.total_cmp(&b.less_than));
    for pair in buckets.windows(2) {
        assert!(
            pair[0].count <= pair[1].count,
            "{metric}{want:?}: {buckets:?}"
        );
    }
    let last = buckets.last().unwrap();
    assert!(
        last.less_than.is_infinite() && last.count == count,
        "{metric}{want:?}"
    );
    Some((count as u64, sum))
}

/// The bounds of `metric`'s buckets with exactly `labels`, with their counts.
fn buckets(scrape: &Scrape, metric: &str, labels_: &[(&str, &str)]) -> Vec<(f64, u64)> {
    let want = set(labels_);
    let sample = scrape
        .samples
        .iter()
        .find(|s| s.metric == metric && labels(s) == want)
        .unwrap();
    let Value::Histogram(buckets) = &sample.value else {
        unreachable!()
    };
    let mut buckets: Vec<(f64, u64)> = buckets
        .iter()
        .map(|b| (b.less_than, b.count as u64))
        .collect();
    buckets.sort_by(|a, b| a.0.total_cmp(&b.0));
    buckets
}

/// Every label set of the gateway's traffic series.
fn traffic_series(scrape: &Scrape) -> BTreeSet<(String, BTreeMap<String, String>)> {
    scrape
        .samples
        .iter()
        .filter(|s| s.metric.starts_with("http_"))
        .map(|s| (s.metric.clone(), labels(s)))
        .collect()
}

const SERVER: &str = "http_server_request_duration_seconds";
const CLIENT: &str = "http_client_request_duration_seconds";
const ACTIVE: &str = "http_server_active_requests";
const REQUEST_BODY: &str = "http_server_request_body_size_bytes";
const RESPONSE_BODY: &str = "http_server_response_body_size_bytes";

/// Scrapes until no request is active any more (a request is recorded when the server
/// drops its response body, just after the client has read it).
async fn settled(client: &HttpClient, admin: SocketAddr) -> (Scrape, String) {
    let deadline = tokio::time::Instant::now() + TIMEOUT;
    loop {
        let (scrape, text) = scrape(client, admin).await;
        let active: f64 = having(&scrape, ACTIVE, &[])
            .map(|s| match s.value {
                Value::Gauge(v) => v,
                _ => panic!("{ACTIVE} is not a gauge"),
            })
            .sum();
        if active == 0.0 {
            return (scrape, text);
        }
        assert!(
            tokio::time::Instant::now() < deadline,
            "still active:\n{text}"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_known_run_is_counted_exactly_and_clients_make_no_series() {
    let hold = Arc::new(Semaphore::new(0));
    let up = upstream(hold.clone()).await;
    let closed = {
        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        listener.local_addr().unwrap().port()
    };
    let text = format!(
        r#"listen = "127.0.0.1:0"
admin_listen = "127.0.0.1:0"

[[routes]]
path = "/m/limited"
upstream = "http://{up}"
[[routes.limits]]
key = "ip"
algorithm = "fixed_window"
limit = 3
window = "1h"

[[routes]]
path = "/m/delayed"
delay = "30s"
[[routes.limits]]
key = "header:x-k"
algorithm = "token_bucket"
limit = 1
window = "3s"

[[routes]]
path = "/m/shadow"
[[routes.limits]]
key = "ip"
algorithm = "fixed_window"
limit = 1
window = "1h"
shadow = true

[[routes]]
path = "/m/down"
upstream = "http://127.0.0.1:{closed}"

[[routes]]
path = "/m/open"
upstream = "http://{up}"
"#
    );
    let gw = server::start(Config::parse(&text).unwrap()).await.unwrap();
    let admin = gw.admin_addr().unwrap();
    let base = format!("http://{}", gw.addr());
    let client: HttpClient = Client::builder(TokioExecutor::new()).build(HttpConnector::new());
    let mut seen = Seen::default();

    // N = 3 allowed (POST, 7 bytes each), M = 2 rejected.
    for _ in 0..3 {
        let post = request("POST", format!("{base}/m/limited/x"))
            .body(Body::from("1234567"))
            .unwrap();
        let (status, body) = send(&client, post).await;
        assert_eq!((status, &body[..]), (200, &b"hello"[..]));
        seen.add("POST", "/m/limited", status, body.len());
    }
    for _ in 0..2 {
        let get = request("GET", format!("{base}/m/limited")).body(Body::empty());
        let (status, body) = send(&client, get.unwrap()).await;
        assert_eq!(status, 429);
        seen.add("GET", "/m/limited", status, body.len());
    }

    // K = 2 delayed: two keys, each sends two at once; the second of each waits ~3 s.
    let delayed = ["a", "a", "b", "b"].map(|key| {
        let client = client.clone();
        let get = request("GET", format!("{base}/m/delayed"))
            .header("x-k", key)
            .body(Body::empty())
            .unwrap();
        tokio::spawn(async move { send(&client, get).await })
    });
    for task in delayed {
        let (status, body) = task.await.unwrap();
        assert_eq!(status, 200);
        seen.add("GET", "/m/delayed", status, body.len());
    }

    // A shadow limit would reject the second request, which passes.
    for _ in 0..2 {
        let get = request("GET", format!("{base}/m/shadow")).body(Body::empty());
        let (status, body) = send(&client, get.unwrap()).await;
        assert_eq!(status, 200);
        seen.add("GET", "/m/shadow", status, body.len());
    }

    // An upstream nobody listens on.
    let get = request("GET", format!("{base}/m/down")).body(Body::empty());
    let (status, body) = send(&client, get.unwrap()).await;
    assert_eq!(status, 502);
    seen.add("GET", "/m/down", status, body.len());

    // A body of unknown length (chunked: 4 + 7 bytes), an upstream's 503, two methods
    // outside the known ones, and requests that match no route.
    let chunks = stream::iter([Ok::<_, std::io::Error>("abcd"), Ok("efghijk")]);
    let post = request("POST", format!("{base}/m/open/chunked"))
        .body(Body::from_stream(chunks))
        .unwrap();
    let (status, body) = send(&client, post).await;
    assert_eq!(status, 200);
    seen.add("POST", "/m/open", status, body.len());
    let get = request("GET", format!("{base}/m/open")).header("x-want-status", "503");
    let (status, body) = send(&client, get.body(Body::empty()).unwrap()).await;
    assert_eq!(status, 503);
    seen.add("GET", "/m/open", status, body.len());
    for method in ["PROPFIND", "get"] {
        let other = request(method, format!("{base}/m/open")).body(Body::empty());
        let (status, body) = send(&client, other.unwrap()).await;
        assert_eq!(status, 200, "{method}");
        seen.add("_OTHER", "/m/open", status, body.len());
    }
    for (method, path) in [("GET", "/nowhere"), ("DELETE", "/m/limited-not")] {
        let other = request(method, format!("{base}{path}")).body(Body::empty());
        let (status, body) = send(&client, other.unwrap()).await;
        assert_eq!(status, 404, "{path}");
        seen.add(method, "_unmatched", status, body.len());
    }

    // A request in flight is active, and no longer once answered.
    let held = {
        let client = client.clone();
        let get = request("GET", format!("{base}/m/open/hold")).body(Body::empty());
        tokio::spawn(async move { send(&client, get.unwrap()).await })
    };
    let open_get = [("http_request_method", "GET"), ("http_route", "/m/open")];
    let deadline = tokio::time::Instant::now() + TIMEOUT;
    loop {
        let (scrape, _) = scrape(&client, admin).await;
        if value(&scrape, ACTIVE, &open_get) == 1.0 {
            break;
        }
        assert!(tokio::time::Instant::now() < deadline, "never active");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    hold.add_permits(1);
    let (status, body) = held.await.unwrap();
    assert_eq!(status, 200);
    seen.add("GET", "/m/open", status, body.len());

    // A reload applied, one refused.
    let before_reload = SystemTime::now()
        .duration_since(SystemTime::UNIX_EPOCH)
        .unwrap()
        .as_secs_f64();
    let file = std::env::temp_dir().join(format!("tollgate-metrics-{}.toml", std::process::id()));
    std::fs::write(&file, &text).unwrap();
    let mut watcher = reload::Watcher::new(file.clone(), gw.live());
    assert_eq!(watcher.reload().unwrap(), 2);
    std::fs::write(&file, "listen = 7").unwrap();
    assert!(watcher.reload().is_err());
    std::fs::remove_file(&file).unwrap();

    let (scrape, page) = settled(&client, admin).await;

    // The server's series: per method, route and status, as many as the client saw,
    // with the bytes it read; error_type only on a 5xx.
    let mut requests = 0;
    for ((method, route, status), (count, bytes)) in &seen.0 {
        let status_text = status.to_string();
        let mut labels = vec![
            ("http_request_method", method.as_str()),
            ("http_route", route.as_str()),
            ("http_response_status_code", status_text.as_str()),
        ];
        match (route.as_str(), *status) {
            ("/m/down", _) => labels.push(("error_type", "upstream_unreachable")),
            (_, 503) => labels.push(("error_type", "503")),
            _ => {}
        }
        let (n, _) = histogram(&scrape, SERVER, &labels)
            .unwrap_or_else(|| panic!("no {SERVER}{labels:?}\n{page}"));
        assert_eq!(n, *count, "{labels:?}\n{page}");
        let (n, sent) = histogram(&scrape, RESPONSE_BODY, &labels).unwrap();
        assert_eq!((n, sent), (*count, *bytes as f64), "{labels:?}");
        requests += count;
    }
    // Nothing else: every request counted once, under the labels above.
    let all: u64 = having(&scrape, &format!("{SERVER}_count"), &[])
        .map(|s| match s.value {
            Value::Untyped(v) | Value::Counter(v) => v as u64,
            _ => unreachable!(),
        })
        .sum();
    assert_eq!(all, requests, "{page}");
    assert_eq!(requests, 3 + 2 + 4 + 2 + 1 + 1 + 1 + 2 + 2 + 1);

    // Request bodies: 3 x 7 bytes announced, 11 counted as read, none elsewhere.
    let post_limited = [
        ("http_request_method", "POST"),
        ("http_route", "/m/limited"),
        ("http_response_status_code", "200"),
    ];
    assert_eq!(
        histogram(&scrape, REQUEST_BODY, &post_limited),
        Some((3, 21.0))
    );
    let size_buckets = buckets(&scrape, REQUEST_BODY, &post_limited);
    assert_eq!(size_buckets[0], (0.0, 0), "{size_buckets:?}");
    assert_eq!(size_buckets[1], (64.0, 3), "{size_buckets:?}");
    let post_open = [
        ("http_request_method", "POST"),
        ("http_route", "/m/open"),
        ("http_response_status_code", "200"),
    ];
    assert_eq!(
        histogram(&scrape, REQUEST_BODY, &post_open),
        Some((1, 11.0))
    );
    let get_delayed = [
        ("http_request_method", "GET"),
        ("http_route", "/m/delayed"),
        ("http_response_status_code", "200"),
    ];
    assert_eq!(
        histogram(&scrape, REQUEST_BODY, &get_delayed),
        Some((4, 0.0))
    );
    // The OpenTelemetry buckets; the two that waited took 3 s or more.
    let duration_buckets = buckets(&scrape, SERVER, &get_delayed);
    let bounds: Vec<f64> = duration_buckets.iter().map(|b| b.0).collect();
    assert_eq!(
        bounds[..bounds.len() - 1],
        [
            0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0
        ]
    );
    let under = |bound: f64| duration_buckets.iter().find(|b| b.0 == bound).unwrap().1;
    assert_eq!(under(2.5), 2, "{duration_buckets:?}");

    // The upstream's part: per route, the upstream's address, its status or the failure.
    let up_port = up.port().to_string();
    let client_labels = |method: &'static str,
                         route: &'static str,
                         port: &str,
                         rest: &[(&'static str, &'static str)]| {
        let mut labels: Vec<(&str, String)> = vec![
            ("http_request_method", method.into()),
            ("http_route", route.into()),
            ("server_address", "127.0.0.1".into()),
            ("server_port", port.to_owned()),
        ];
        labels.extend(rest.iter().map(|(k, v)| (*k, (*v).to_owned())));
        labels
    };
    let upstream = |labels: Vec<(&str, String)>| {
        let labels: Vec<(&str, &str)> = labels.iter().map(|(k, v)| (*k, v.as_str())).collect();
        histogram(&scrape, CLIENT, &labels).map(|(n, _)| n)
    };
    let closed_port = closed.to_string();
    for (labels, count) in [
        (
            client_labels(
                "POST",
                "/m/limited",
                &up_port,
                &[("http_response_status_code", "200")],
            ),
            3,
        ),
        (
            client_labels(
                "GET",
                "/m/down",
                &closed_port,
                &[("error_type", "upstream_unreachable")],
            ),
            1,
        ),
        (
            client_labels(
                "POST",
                "/m/open",
                &up_port,
                &[("http_response_status_code", "200")],
            ),
            1,
        ),
        (
            client_labels(
                "GET",
                "/m/open",
                &up_port,
                &[("http_response_status_code", "200")],
            ),
            1,
        ),
        (
            client_labels(
                "GET",
                "/m/open",
                &up_port,
                &[("http_response_status_code", "503"), ("error_type", "503")],
            ),
            1,
        ),
        (
            client_labels(
                "_OTHER",
                "/m/open",
                &up_port,
                &[("http_response_status_code", "200")],
            ),
            2,
        ),
    ] {
        assert_eq!(upstream(labels.clone()), Some(count), "{labels:?}\n{page}");
    }
    let upstream_total: f64 = having(&scrape, &format!("{CLIENT}_count"), &[])
        .map(|s| match s.value {
            Value::Untyped(v) | Value::Counter(v) => v,
            _ => unreachable!(),
        })
        .sum();
    assert_eq!(
        upstream_total, 9.0,
        "the 429s and the ok routes never reach one"
    );

    // Every request is over.
    for sample in having(&scrape, ACTIVE, &[]) {
        assert_eq!(sample.value, Value::Gauge(0.0), "{:?}", sample.labels);
    }

    // Reloads.
    let reloads = "tollgate_gateway_config_reloads_total";
    assert_eq!(value(&scrape, reloads, &[("result", "applied")]), 1.0);
    assert_eq!(value(&scrape, reloads, &[("result", "refused")]), 1.0);
    assert_eq!(
        value(&scrape, "tollgate_gateway_reloads_refused_total", &[]),
        1.0
    );
    assert_eq!(value(&scrape, "tollgate_gateway_rules_version", &[]), 2.0);
    let last = value(
        &scrape,
        "tollgate_gateway_config_last_reload_success_timestamp_seconds",
        &[],
    );
    assert!(last >= before_reload.floor(), "{last} < {before_reload}");

    // The limiter's outcomes (the library's metrics).
    if cfg!(feature = "metrics") {
        let limiter = |route: &str, outcome: &str| {
            value(
                &scrape,
                "tollgate_requests_total",
                &[("route", route), ("outcome", outcome)],
            )
        };
        assert_eq!(limiter("/m/limited", "allowed"), 3.0, "{page}");
        assert_eq!(limiter("/m/limited", "denied"), 2.0);
        assert_eq!(limiter("/m/delayed", "allowed"), 4.0);
        assert_eq!(limiter("/m/delayed", "denied"), 0.0);
        assert_eq!(limiter("/m/shadow", "allowed"), 1.0);
        assert_eq!(limiter("/m/shadow", "would_reject"), 1.0);
        let delayed = |outcome: &str| {
            value(
                &scrape,
                "tollgate_delayed_requests_total",
                &[("route", "/m/delayed"), ("outcome", outcome)],
            )
        };
        assert_eq!(delayed("allowed"), 2.0, "{page}");
        assert_eq!(delayed("denied"), 0.0);
        assert_eq!(
            having(&scrape, "tollgate_delayed_requests_total", &[]).count(),
            1,
            "only the route that delayed has the series"
        );
    }
    assert_eq!(
        value(
            &scrape,
            "tollgate_gateway_upstream_errors_total",
            &[("route", "/m/down")]
        ),
        1.0
    );

    // A hostile client: random methods and paths, matching no route or under one. The
    // first round makes the series of what it can reach; the second, ten times longer,
    // makes none.
    let known = traffic_series(&scrape);
    let mut random = Random(0x5eed_1234_abcd_0001);
    let mut hostile = async |rounds: usize| {
        for _ in 0..rounds {
            let method = format!("X{}", random.token(8).to_uppercase());
            let path = format!("/{}/{}", random.token(12), random.token(5));
            let under = format!("/m/open/{}", random.token(10));
            for (method, path) in [
                (method.as_str(), path.as_str()),
                ("GET", path.as_str()),
                (method.as_str(), under.as_str()),
            ] {
                let hostile = request(method, format!("{base}{path}")).body(Body::empty());
                let (status, _) = send(&client, hostile.unwrap()).await;
                assert!(status == 404 || status == 200, "{method} {path}: {status}");
            }
        }
    };
    hostile(20).await;
    let (first, _) = settled(&client, admin).await;
    let first = traffic_series(&first);
    let new: BTreeSet<_> = first.difference(&known).collect();
    // _OTHER on no route (404) and on /m/open (200): 5 series each (3 histograms' buckets,
    // their _sum and _count share the label set; the gauge has its own).
    for (metric, labels) in &new {
        let route = labels.get("http_route").map(String::as_str);
        let method = labels.get("http_request_method").map(String::as_str);
        assert!(
            matches!(route, Some("_unmatched") | Some("/m/open")) && method == Some("_OTHER"),
            "a new series {metric}{labels:?}"
        );
    }
    hostile(200).await;
    let (after, page) = settled(&client, admin).await;
    assert_eq!(traffic_series(&after), first, "{page}");
    assert!(!page.contains("/m/open/"), "a raw path in a label");
    gw.stop().await.unwrap();
}

/// A small deterministic generator (xorshift), for the hostile client's tokens.
struct Random(u64);

impl Random {
    fn next(&mut self) -> u64 {
        self.0 ^= self.0 << 13;
        self.0 ^= self.0 >> 7;
        self.0 ^= self.0 << 17;
        self.0
    }

    fn token(&mut self, len: usize) -> String {
        const ALPHABET: &[u8] = b"abcdefghijklmnopqrstuvwxyz0123456789";
        (0..len)
            .map(|_| ALPHABET[(self.next() % ALPHABET.len() as u64) as usize] as char)
            .collect()
    }
}
