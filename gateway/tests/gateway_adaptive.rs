//! `[routes.adaptive]` over real HTTP: requests beyond the adaptive limit held in a slow
//! upstream, the least critical shed first, the shed answers (503 or 429 with
//! `Retry-After`), shadow mode, a reload that may not change the section, and the
//! library's adaptive metrics on `/metrics`.
//!
//! The limits here never move (`window = "1h"`, more `min_samples` than requests), so
//! that what is admitted and shed is exact; the algorithms' arithmetic is the library's
//! (`tests/adaptive.rs`).

include!("common/modules.rs");

use std::{collections::BTreeMap, net::SocketAddr, sync::Arc, time::Duration};

use axum::{
    Router,
    body::{Body, Bytes},
    extract::{Request, State},
    response::IntoResponse,
};
use http_body_util::BodyExt;
use hyper_util::{
    client::legacy::{Client, connect::HttpConnector},
    rt::TokioExecutor,
};
use prometheus_parse::{Scrape, Value};
use tokio::{
    net::TcpListener,
    sync::{Semaphore, mpsc},
    task::JoinHandle,
};

use config::Config;

const TIMEOUT: Duration = Duration::from_secs(20);

type HttpClient = Client<HttpConnector, Body>;

fn client() -> HttpClient {
    Client::builder(TokioExecutor::new()).build(HttpConnector::new())
}

/// A slow upstream: every request announces its path on `arrived`, then waits for a
/// permit of `hold` before it is answered `hello`.
struct Upstream {
    addr: SocketAddr,
    hold: Arc<Semaphore>,
    arrived: mpsc::UnboundedReceiver<String>,
}

impl Upstream {
    async fn start() -> Self {
        type Shared = (Arc<Semaphore>, mpsc::UnboundedSender<String>);
        async fn answer(
            State((hold, arrived)): State<Shared>,
            request: Request,
        ) -> impl IntoResponse {
            let _ = arrived.send(request.uri().path().to_owned());
            hold.acquire().await.unwrap().forget();
            "hello"
        }
        let hold = Arc::new(Semaphore::new(0));
        let (tx, arrived) = mpsc::unbounded_channel();
        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        let app = Router::new()
            .fallback(answer)
            .with_state((hold.clone(), tx));
        tokio::spawn(async move { axum::serve(listener, app).await.unwrap() });
        Self {
            addr,
            hold,
            arrived,
        }
    }

    /// Waits until a request to `path` is at the upstream.
    async fn arrival(&mut self, path: &str) {
        let got = tokio::time::timeout(TIMEOUT, self.arrived.recv())
            .await
            .expect("a request at the upstream in time")
            .unwrap();
        assert_eq!(got, path);
    }

    /// No request reached the upstream since the last [`arrival`](Self::arrival).
    fn none_arrived(&mut self) {
        assert_eq!(self.arrived.try_recv().ok(), None);
    }
}

/// What a client got: the status, `Retry-After` and the body.
type Answer = (u16, Option<String>, Bytes);

/// Headers of a request: (name, value).
type Headers = &'static [(&'static str, &'static str)];

async fn get(client: &HttpClient, url: String, headers: Headers) -> Answer {
    let mut request = http::Request::get(url);
    for (name, value) in headers {
        request = request.header(*name, *value);
    }
    let response = tokio::time::timeout(
        TIMEOUT,
        client.request(request.body(Body::empty()).unwrap()),
    )
    .await
    .expect("an answer in time")
    .unwrap();
    let status = response.status().as_u16();
    let retry_after = response
        .headers()
        .get("retry-after")
        .map(|v| v.to_str().unwrap().to_owned());
    let body = response.into_body().collect().await.unwrap().to_bytes();
    (status, retry_after, body)
}

/// A request once the adaptive limit has room: a request that just ended gives its place
/// back when the gateway has sent its body's end, a moment after its client read it, so
/// one sent right after may still be shed (which costs nothing: it is sent again).
async fn get_admitted(client: &HttpClient, url: String) -> Answer {
    let deadline = tokio::time::Instant::now() + TIMEOUT;
    loop {
        let answer = get(client, url.clone(), &[]).await;
        if answer.0 != 503 {
            return answer;
        }
        assert!(tokio::time::Instant::now() < deadline, "still shed");
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
}

/// A request sent in the background (it is held at the upstream).
fn spawn_get(client: &HttpClient, url: String, headers: Headers) -> JoinHandle<Answer> {
    let client = client.clone();
    tokio::spawn(async move { get(&client, url, headers).await })
}

async fn scrape(client: &HttpClient, admin: SocketAddr) -> (Scrape, String) {
    let (status, _, body) = get(client, format!("http://{admin}/metrics"), &[]).await;
    assert_eq!(status, 200);
    let text = String::from_utf8(body.to_vec()).unwrap();
    let scrape = Scrape::parse(text.lines().map(|l| Ok(l.to_owned()))).unwrap();
    (scrape, text)
}

/// The value of the counter or gauge `metric` with exactly `labels` (`None` when absent).
fn value(scrape: &Scrape, metric: &str, labels: &[(&str, &str)]) -> Option<f64> {
    let want: BTreeMap<String, String> = labels
        .iter()
        .map(|(k, v)| ((*k).to_owned(), (*v).to_owned()))
        .collect();
    let found: Vec<f64> = scrape
        .samples
        .iter()
        .filter(|s| {
            s.metric == metric
                && s.labels
                    .iter()
                    .map(|(k, v)| (k.clone(), v.clone()))
                    .collect::<BTreeMap<_, _>>()
                    == want
        })
        .map(|s| match s.value {
            Value::Counter(v) | Value::Gauge(v) | Value::Untyped(v) => v,
            _ => panic!("{metric} is not a number"),
        })
        .collect();
    assert!(found.len() <= 1, "{metric}{want:?} twice");
    found.first().copied()
}

/// A route `path` with a rate limit no test reaches (or `limit`) and `adaptive`.
fn route(path: &str, upstream: SocketAddr, limit: u32, adaptive: &str) -> String {
    format!(
        r#"
[[routes]]
path = "{path}"
upstream = "http://{upstream}"
[[routes.limits]]
key = "global"
algorithm = "fixed_window"
limit = {limit}
window = "1h"
[routes.adaptive]
window = "1h"
min_samples = 1000
{adaptive}
"#
    )
}

/// Critical requests may use all of a limit of 4, default ones 3, sheddable ones 2: those
/// beyond are shed (503, never reaching the upstream), and `/metrics` shows the limit, the
/// requests in flight and the shed ones by priority, exactly.
#[cfg(feature = "metrics")]
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn beyond_the_limit_the_least_critical_are_shed_first_and_metrics_show_it() {
    let mut up = Upstream::start().await;
    let adaptive = "min = 1\ninitial = 4\nmax = 4\ncritical_share = 0.25\n\
                    default_share = 0.25\npriority_header = \"x-priority\"";
    // `/b` has limits under two kinds of key: the adaptive limit is the `ip` layer's.
    let two_keys = format!(
        "\n[[routes]]\npath = \"/b\"\nupstream = \"http://{}\"\n[[routes.limits]]\n\
         key = \"global\"\nalgorithm = \"fixed_window\"\nlimit = 1000\nwindow = \"1h\"\n\
         [[routes.limits]]\nkey = \"ip\"\nalgorithm = \"fixed_window\"\nlimit = 1000\n\
         window = \"1h\"\n[routes.adaptive]\nmax = 3\n",
        up.addr
    );
    let text = format!(
        "listen = \"127.0.0.1:0\"\nadmin_listen = \"127.0.0.1:0\"\n{}{two_keys}",
        route("/a", up.addr, 1_000_000, adaptive)
    );
    let gw = server::start(Config::parse(&text).unwrap()).await.unwrap();
    let admin = gw.admin_addr().unwrap();
    let url = format!("http://{}/a", gw.addr());
    let client = client();

    let mut held = Vec::new();
    let shed = |answer: Answer| {
        assert_eq!((answer.0, answer.1.as_deref()), (503, Some("1")));
    };
    // Two sheddable requests in flight; the third is shed.
    for _ in 0..2 {
        held.push(spawn_get(
            &client,
            url.clone(),
            &[("x-priority", "sheddable")],
        ));
        up.arrival("/a").await;
    }
    shed(get(&client, url.clone(), &[("x-priority", "sheddable")]).await);
    // A default one gets the third place, not a fourth.
    held.push(spawn_get(&client, url.clone(), &[]));
    up.arrival("/a").await;
    shed(get(&client, url.clone(), &[("x-priority", "default")]).await);
    shed(get(&client, url.clone(), &[("x-priority", "sheddable")]).await);
    // A critical one the last; then every priority is shed.
    held.push(spawn_get(
        &client,
        url.clone(),
        &[("x-priority", "critical")],
    ));
    up.arrival("/a").await;
    shed(get(&client, url.clone(), &[("x-priority", "critical")]).await);
    // An unknown value is the default priority.
    shed(get(&client, url.clone(), &[("x-priority", "urgent")]).await);
    up.none_arrived();

    let (page, text) = scrape(&client, admin).await;
    let route = [("route", "/a")];
    let shed_total = |priority: &str, shadow: &str| {
        value(
            &page,
            "tollgate_adaptive_shed_total",
            &[("route", "/a"), ("priority", priority), ("shadow", shadow)],
        )
        .unwrap_or(0.0)
    };
    assert_eq!(
        value(&page, "tollgate_adaptive_limit", &route),
        Some(4.0),
        "{text}"
    );
    assert_eq!(
        value(&page, "tollgate_adaptive_in_flight", &route),
        Some(4.0),
        "{text}"
    );
    assert_eq!(shed_total("sheddable", "false"), 2.0, "{text}");
    assert_eq!(shed_total("default", "false"), 2.0, "{text}");
    assert_eq!(shed_total("critical", "false"), 1.0, "{text}");
    for priority in ["sheddable", "default", "critical"] {
        assert_eq!(shed_total(priority, "true"), 0.0, "{text}");
    }
    assert_eq!(
        value(&page, "tollgate_adaptive_samples_total", &route).unwrap_or(0.0),
        0.0
    );
    // The shed requests never reached the rate limit: only the four admitted counted.
    assert_eq!(
        value(
            &page,
            "tollgate_requests_total",
            &[("route", "/a"), ("outcome", "allowed")]
        ),
        Some(4.0),
        "{text}"
    );

    // Answered: nothing in flight, four samples, the limit as it was.
    up.hold.add_permits(4);
    for task in held {
        let (status, _, body) = task.await.unwrap();
        assert_eq!((status, &body[..]), (200, &b"hello"[..]));
    }
    let deadline = tokio::time::Instant::now() + TIMEOUT;
    let (page, text) = loop {
        // A permit is given back when the gateway has sent the body's end, just after
        // the client read it.
        let (page, text) = scrape(&client, admin).await;
        if value(&page, "tollgate_adaptive_in_flight", &route) == Some(0.0) {
            break (page, text);
        }
        assert!(
            tokio::time::Instant::now() < deadline,
            "still in flight:\n{text}"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    };
    assert_eq!(
        value(&page, "tollgate_adaptive_samples_total", &route),
        Some(4.0),
        "{text}"
    );
    assert_eq!(
        value(&page, "tollgate_adaptive_limit", &route),
        Some(4.0),
        "{text}"
    );
    assert_eq!(shed_total("sheddable", "false"), 2.0);

    // The route with two layers: its series carry the outer (`ip`) layer's name.
    up.hold.add_permits(1);
    assert_eq!(
        get(&client, format!("http://{}/b", gw.addr()), &[]).await.0,
        200
    );
    up.arrival("/b").await;
    let deadline = tokio::time::Instant::now() + TIMEOUT;
    loop {
        let (page, text) = scrape(&client, admin).await;
        let b = |route| {
            value(
                &page,
                "tollgate_adaptive_samples_total",
                &[("route", route)],
            )
        };
        if b("/b ip") == Some(1.0) {
            assert_eq!(b("/b global"), None, "{text}");
            assert_eq!(
                value(&page, "tollgate_adaptive_limit", &[("route", "/b ip")]),
                Some(3.0)
            );
            break;
        }
        assert!(tokio::time::Instant::now() < deadline, "no sample:\n{text}");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

/// A shed request gets 503 with `Retry-After` (the configured hint, whole seconds), or
/// 429 with `shed_status = 429`; it spends no rate budget. In shadow mode it passes.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn shed_answers_and_shadow_mode() {
    let mut up = Upstream::start().await;
    let one = "min = 1\ninitial = 1\nmax = 1";
    let per_key = format!(
        "\n[[routes]]\npath = \"/k\"\nupstream = \"http://{}\"\n[[routes.limits]]\n\
         key = \"header:x-k\"\nalgorithm = \"fixed_window\"\nlimit = 1000\nwindow = \"1h\"\n\
         [routes.adaptive]\n{one}\nper_key = 10\n",
        up.addr
    );
    let text = format!(
        "listen = \"127.0.0.1:0\"\n{per_key}{}{}{}",
        route("/s503", up.addr, 2, one),
        route(
            "/s429",
            up.addr,
            1_000_000,
            &format!("{one}\nshed_status = 429\nretry_after = \"1500ms\"")
        ),
        route(
            "/shadow",
            up.addr,
            1_000_000,
            &format!("{one}\nshadow = true")
        ),
    );
    let gw = server::start(Config::parse(&text).unwrap()).await.unwrap();
    let base = format!("http://{}", gw.addr());
    let client = client();

    // 503 + Retry-After: 1; the shed one spent none of the limit of 2.
    let held = spawn_get(&client, format!("{base}/s503"), &[]);
    up.arrival("/s503").await;
    let (status, retry_after, _) = get(&client, format!("{base}/s503"), &[]).await;
    assert_eq!((status, retry_after.as_deref()), (503, Some("1")));
    up.none_arrived();
    up.hold.add_permits(1);
    assert_eq!(held.await.unwrap().0, 200);
    up.hold.add_permits(1);
    let (status, _, _) = get_admitted(&client, format!("{base}/s503")).await;
    assert_eq!(status, 200, "the second unit of the rate limit");
    up.arrival("/s503").await;
    let (status, _, _) = get_admitted(&client, format!("{base}/s503")).await;
    assert_eq!(status, 429, "the rate limit, spent by two requests");

    // 429 + Retry-After: 2 (1.5 s rounded up).
    let held = spawn_get(&client, format!("{base}/s429"), &[]);
    up.arrival("/s429").await;
    let (status, retry_after, _) = get(&client, format!("{base}/s429"), &[]).await;
    assert_eq!((status, retry_after.as_deref()), (429, Some("2")));
    up.none_arrived();
    up.hold.add_permits(1);
    assert_eq!(held.await.unwrap().0, 200);

    // Shadow: the second request reaches the upstream too.
    let first = spawn_get(&client, format!("{base}/shadow"), &[]);
    up.arrival("/shadow").await;
    let second = spawn_get(&client, format!("{base}/shadow"), &[]);
    up.arrival("/shadow").await;
    up.hold.add_permits(2);
    for task in [first, second] {
        let (status, retry_after, _) = task.await.unwrap();
        assert_eq!((status, retry_after), (200, None));
    }

    // `per_key`: a limit of 1 for each `x-k` (the layer's key).
    let a: Headers = &[("x-k", "a")];
    let held = spawn_get(&client, format!("{base}/k"), a);
    up.arrival("/k").await;
    let other = spawn_get(&client, format!("{base}/k"), &[("x-k", "b")]);
    up.arrival("/k").await;
    assert_eq!(get(&client, format!("{base}/k"), a).await.0, 503);
    up.none_arrived();
    up.hold.add_permits(2);
    assert_eq!((held.await.unwrap().0, other.await.unwrap().0), (200, 200));
}

/// A reload may not add, change or remove a running route's `[routes.adaptive]`: refused
/// naming the section, counted as refused, the running config (and its adaptive limit,
/// with the requests in flight under it) stays. A reload of anything else keeps the
/// adaptive limit's state.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_reload_cannot_change_the_adaptive_section() {
    let mut up = Upstream::start().await;
    let up_addr = up.addr;
    let plain = |path: &str| {
        format!(
            "\n[[routes]]\npath = \"{path}\"\nupstream = \"http://{}\"\n[[routes.limits]]\n\
             key = \"ip\"\nalgorithm = \"fixed_window\"\nlimit = 1000\nwindow = \"1h\"\n",
            up_addr
        )
    };
    let text = |limit: u32, max: u32, extra: &str| {
        format!(
            "listen = \"127.0.0.1:0\"\nadmin_listen = \"127.0.0.1:0\"\n{}{}{extra}",
            route(
                "/r",
                up_addr,
                limit,
                &format!("min = 1\ninitial = 1\nmax = {max}")
            ),
            plain("/plain"),
        )
    };
    let file = std::env::temp_dir().join(format!("tollgate-adaptive-{}.toml", std::process::id()));
    std::fs::write(&file, text(1000, 1, "")).unwrap();
    let gw = server::start(Config::load(&file).unwrap()).await.unwrap();
    let admin = gw.admin_addr().unwrap();
    let url = format!("http://{}/r", gw.addr());
    let client = client();
    let mut watcher = reload::Watcher::new(file.clone(), gw.live());
    let reloads = |page: &Scrape, result: &str| {
        value(
            page,
            "tollgate_gateway_config_reloads_total",
            &[("result", result)],
        )
        .unwrap()
    };
    let (before, _) = scrape(&client, admin).await;

    let held = spawn_get(&client, url.clone(), &[]);
    up.arrival("/r").await;
    let adaptive_of_plain = format!(
        "listen = \"127.0.0.1:0\"\nadmin_listen = \"127.0.0.1:0\"\n{}{}",
        route("/r", up.addr, 1000, "min = 1\ninitial = 1\nmax = 1"),
        route("/plain", up.addr, 1000, ""),
    );
    let without = format!(
        "listen = \"127.0.0.1:0\"\nadmin_listen = \"127.0.0.1:0\"\n{}{}",
        plain("/r"),
        plain("/plain")
    );
    for (changed, what, index) in [
        (text(1000, 2, ""), "changed", 0),
        (adaptive_of_plain, "added", 1),
        (without, "removed", 0),
    ] {
        std::fs::write(&file, changed).unwrap();
        let error = watcher.reload().unwrap_err();
        assert_eq!(error.field, format!("routes[{index}].adaptive"), "{error}");
        assert!(error.message.starts_with(what), "{error}");
        assert_eq!(gw.version(), 1);
    }
    // Still the old limit of 1, with the held request in it.
    assert_eq!(get(&client, url.clone(), &[]).await.0, 503);

    // Another rate limit, and a new route with an adaptive section of its own: applied,
    // and the running adaptive limit still counts the held request.
    let added = route("/new", up.addr, 10, "max = 5");
    std::fs::write(&file, text(2000, 1, &added)).unwrap();
    assert_eq!(watcher.reload(), Ok(2));
    assert_eq!(get(&client, url.clone(), &[]).await.0, 503);
    up.none_arrived();
    up.hold.add_permits(1);
    assert_eq!(held.await.unwrap().0, 200);
    up.hold.add_permits(1);
    assert_eq!(get_admitted(&client, url.clone()).await.0, 200);
    up.arrival("/r").await;
    std::fs::remove_file(&file).unwrap();

    let (after, page) = scrape(&client, admin).await;
    assert_eq!(
        reloads(&after, "refused") - reloads(&before, "refused"),
        3.0,
        "{page}"
    );
    assert_eq!(
        reloads(&after, "applied") - reloads(&before, "applied"),
        1.0,
        "{page}"
    );
}
