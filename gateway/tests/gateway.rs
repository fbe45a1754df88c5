//! The example gateway, end to end over real TCP.
//!
//! The gateway runs **in-process**: this file includes the gateway's modules with `#[path]`
//! and calls `server::start` with `listen = "127.0.0.1:0"`, so every test owns a gateway on
//! a free port, reads the bound address back, and stops it (or drops it) at the end. That
//! lets a test start two gateways on one Redis. The binary's own part, `main.rs`, only
//! parses `--config`, prints the address and waits for a signal.
//!
//! Upstreams are small axum servers in this file that record what they received. Limits use
//! windows of an hour or more, so that counts are exact however slow the machine is; nothing
//! sleeps to wait for a clock.
//!
//! The scenarios that depend on the store run on the memory backend, and again on a private
//! `redis-server` (tollgate-test-support) with the `redis` feature.

include!("common/modules.rs");
#[cfg(feature = "redis")]
use tollgate_test_support as support;

use std::{
    net::SocketAddr,
    sync::{
        Arc, Mutex,
        atomic::{AtomicUsize, Ordering},
    },
    time::Duration,
};

use axum::{
    Router,
    body::{Body, Bytes},
    extract::{Request, State},
    http::{HeaderMap, Method, StatusCode, Uri},
    response::{IntoResponse, Response},
};
use futures_util::StreamExt;
use http_body_util::BodyExt;
use hyper_util::{
    client::legacy::{Client, connect::HttpConnector},
    rt::TokioExecutor,
};
use tokio::{
    net::TcpListener,
    sync::{mpsc, oneshot},
    task::JoinHandle,
};

use config::Config;
use server::Running;

/// Long enough that no test waits on it; exact counts need no clock.
const TIMEOUT: Duration = Duration::from_secs(20);

// ---------------------------------------------------------------------------------------
// Harness

/// `[store]` for the memory backend: the defaults.
const MEMORY: &str = "";

/// Starts a gateway from `listen = 127.0.0.1:0`, `store` and `routes` (TOML).
async fn gateway(store: &str, routes: &str) -> Running {
    let text = format!("listen = \"127.0.0.1:0\"\n{store}\n{routes}");
    let config = Config::parse(&text).unwrap_or_else(|e| panic!("{e}\n{text}"));
    server::start(config).await.unwrap()
}

fn url(gateway: &Running, path: &str) -> String {
    format!("http://{}{path}", gateway.addr())
}

/// What an upstream received.
#[derive(Debug, Clone)]
struct Seen {
    method: Method,
    uri: Uri,
    headers: HeaderMap,
    body: Bytes,
}

/// A recording upstream: answers 200 `upstream saw <n> bytes` with `x-upstream: yes`, or
/// the status in the request's `x-want-status`.
struct Upstream {
    addr: SocketAddr,
    seen: Arc<Mutex<Vec<Seen>>>,
    task: JoinHandle<()>,
}

impl Upstream {
    async fn start() -> Self {
        let seen = Arc::new(Mutex::new(Vec::new()));
        let app = Router::new().fallback(record).with_state(seen.clone());
        let (addr, task) = serve(app).await;
        Self { addr, seen, task }
    }

    fn url(&self) -> String {
        format!("http://{}", self.addr)
    }

    fn seen(&self) -> Vec<Seen> {
        self.seen.lock().unwrap().clone()
    }

    fn paths(&self) -> Vec<String> {
        self.seen().iter().map(|s| s.uri.to_string()).collect()
    }
}

impl Drop for Upstream {
    fn drop(&mut self) {
        self.task.abort();
    }
}

async fn record(State(seen): State<Arc<Mutex<Vec<Seen>>>>, request: Request) -> Response {
    let (parts, body) = request.into_parts();
    // Only whole requests are recorded: a body cut off on the way is not a request.
    let Ok(body) = body
        .collect()
        .await
        .map(http_body_util::Collected::to_bytes)
    else {
        return StatusCode::BAD_REQUEST.into_response();
    };
    let status = parts
        .headers
        .get("x-want-status")
        .and_then(|v| v.to_str().ok()?.parse::<u16>().ok())
        .map_or(StatusCode::OK, |s| StatusCode::from_u16(s).unwrap());
    let answer = format!("upstream saw {} bytes", body.len());
    seen.lock().unwrap().push(Seen {
        method: parts.method,
        uri: parts.uri,
        headers: parts.headers,
        body,
    });
    Response::builder()
        .status(status)
        .header("x-upstream", "yes")
        .body(Body::from(answer))
        .unwrap()
}

async fn serve(app: Router) -> (SocketAddr, JoinHandle<()>) {
    let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    let task = tokio::spawn(async move {
        axum::serve(listener, app).await.unwrap();
    });
    (addr, task)
}

/// A port nothing listens on (bound, then released).
async fn closed_port() -> u16 {
    let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
    listener.local_addr().unwrap().port()
}

type HttpClient = Client<HttpConnector, Body>;

fn client() -> HttpClient {
    Client::builder(TokioExecutor::new()).build(HttpConnector::new())
}

#[derive(Debug)]
struct Reply {
    status: StatusCode,
    headers: HeaderMap,
    body: Bytes,
}

impl Reply {
    fn text(&self) -> &str {
        std::str::from_utf8(&self.body).unwrap()
    }

    fn retry_after(&self) -> Option<u64> {
        self.headers.get("retry-after")?.to_str().ok()?.parse().ok()
    }
}

async fn send(client: &HttpClient, request: http::Request<Body>) -> Reply {
    let response = tokio::time::timeout(TIMEOUT, client.request(request))
        .await
        .expect("no answer in time")
        .unwrap();
    let (parts, body) = response.into_parts();
    let body = body.collect().await.unwrap().to_bytes();
    Reply {
        status: parts.status,
        headers: parts.headers,
        body,
    }
}

async fn get(client: &HttpClient, url: &str) -> Reply {
    send(client, http::Request::get(url).body(Body::empty()).unwrap()).await
}

async fn statuses(client: &HttpClient, gateway: &Running, paths: &[&str]) -> Vec<u16> {
    let mut statuses = Vec::new();
    for path in paths {
        statuses.push(get(client, &url(gateway, path)).await.status.as_u16());
    }
    statuses
}

/// `[[routes]]` with one limit.
fn route(path: &str, upstream: Option<&str>, limit: Option<(&str, &str, u32, &str)>) -> String {
    let mut text = format!("[[routes]]\npath = {path:?}\n");
    if let Some(upstream) = upstream {
        text += &format!("upstream = {upstream:?}\n");
    }
    if let Some((key, algorithm, limit, window)) = limit {
        text += &format!(
            "[[routes.limits]]\nkey = {key:?}\nalgorithm = {algorithm:?}\nlimit = {limit}\n\
             window = {window:?}\n"
        );
    }
    text
}

// ---------------------------------------------------------------------------------------
// Proxying

#[tokio::test]
async fn proxies_method_path_query_headers_and_body_intact() {
    let upstream = Upstream::start().await;
    let gw = gateway(MEMORY, &route("/api", Some(&upstream.url()), None)).await;
    let client = client();

    let body: Vec<u8> = (0..100 * 1024).map(|i| (i % 251) as u8).collect();
    let request = http::Request::post(url(&gw, "/api/items?x=1&y=a%20b&x=2"))
        .header("x-custom", "hello, world")
        .header("x-forwarded-for", "203.0.113.9")
        .header("content-type", "application/octet-stream")
        .header("connection", "x-hop")
        .header("x-hop", "secret")
        .header("keep-alive", "timeout=5")
        .body(Body::from(body.clone()))
        .unwrap();
    let reply = send(&client, request).await;

    assert_eq!(reply.status, StatusCode::OK);
    assert_eq!(reply.headers["x-upstream"], "yes");
    assert_eq!(reply.text(), "upstream saw 102400 bytes");
    let seen = upstream.seen();
    assert_eq!(seen.len(), 1);
    let seen = &seen[0];
    assert_eq!(seen.method, Method::POST);
    assert_eq!(seen.uri.path(), "/api/items");
    assert_eq!(seen.uri.query(), Some("x=1&y=a%20b&x=2"));
    assert_eq!(seen.body.as_ref(), body.as_slice());
    assert_eq!(seen.headers["x-custom"], "hello, world");
    assert_eq!(seen.headers["content-type"], "application/octet-stream");
    assert_eq!(seen.headers["content-length"], "102400");
    // The peer the gateway saw: a client that is not a trusted proxy cannot add to it.
    assert_eq!(seen.headers["x-forwarded-for"], "127.0.0.1");
    // Host is end-to-end: the upstream sees the name the client used.
    assert_eq!(seen.headers["host"], gw.addr().to_string());
    // Hop-by-hop headers, and the ones Connection names, stay on their hop.
    assert!(!seen.headers.contains_key("x-hop"), "{:?}", seen.headers);
    assert!(!seen.headers.contains_key("keep-alive"));
    gw.stop().await.unwrap();
}

/// `HEAD` is answered as it was when axum's router served the listener: the length of the
/// body a `GET` would get, and no body, from the upstream and from the gateway's own
/// answers alike (hyper's server sees to both).
#[tokio::test]
async fn head_gets_the_length_and_no_body() {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};

    let upstream = Upstream::start().await;
    let gw = gateway(MEMORY, &route("/api", Some(&upstream.url()), None)).await;
    // Raw HTTP: a body sent after the head would show up before the close.
    let addr = gw.addr();
    let head = |path: &'static str| async move {
        let mut stream = tokio::net::TcpStream::connect(addr).await.unwrap();
        let request = format!("HEAD {path} HTTP/1.1\r\nHost: gw\r\nConnection: close\r\n\r\n");
        stream.write_all(request.as_bytes()).await.unwrap();
        let mut answer = Vec::new();
        tokio::time::timeout(TIMEOUT, stream.read_to_end(&mut answer))
            .await
            .expect("no answer in time")
            .unwrap();
        String::from_utf8(answer).unwrap().to_ascii_lowercase()
    };
    // The upstream's answer to a GET is `upstream saw 0 bytes`, 20 bytes.
    let proxied = head("/api/x").await;
    assert!(proxied.starts_with("http/1.1 200"), "{proxied}");
    assert!(proxied.contains("\r\ncontent-length: 20\r\n"), "{proxied}");
    assert!(
        proxied.ends_with("\r\n\r\n"),
        "a body after the head: {proxied}"
    );
    // The gateway's own `no route\n`, 9 bytes.
    let own = head("/elsewhere").await;
    assert!(own.starts_with("http/1.1 404"), "{own}");
    assert!(own.contains("\r\ncontent-length: 9\r\n"), "{own}");
    assert!(own.ends_with("\r\n\r\n"), "a body after the head: {own}");
    assert_eq!(upstream.seen()[0].method, Method::HEAD);
    gw.stop().await.unwrap();
}

#[tokio::test]
async fn upstream_statuses_pass_through_and_a_base_path_is_prepended() {
    let upstream = Upstream::start().await;
    let base = format!("{}/v2/", upstream.url());
    let gw = gateway(MEMORY, &route("/", Some(&base), None)).await;
    let client = client();
    for status in [201, 204, 404, 418, 500, 503] {
        let request = http::Request::delete(url(&gw, "/things/7"))
            .header("x-want-status", status.to_string())
            .body(Body::empty())
            .unwrap();
        let reply = send(&client, request).await;
        assert_eq!(reply.status.as_u16(), status);
        assert_eq!(reply.headers["x-upstream"], "yes");
    }
    let seen = upstream.seen();
    assert!(seen.iter().all(|s| s.method == Method::DELETE));
    assert!(
        seen.iter().all(|s| s.uri.path() == "/v2/things/7"),
        "{seen:?}"
    );
}

/// An upstream on raw TCP that answers every `GET` with `200 ok` on a kept-alive
/// connection and closes each connection, without a word, after `close_after` answers
/// (as an upstream's keep-alive timeout does). Counts the connections it accepted.
async fn keep_alive_upstream(close_after: usize) -> (SocketAddr, Arc<AtomicUsize>) {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    let accepted = Arc::new(AtomicUsize::new(0));
    let count = accepted.clone();
    tokio::spawn(async move {
        while let Ok((mut stream, _)) = listener.accept().await {
            count.fetch_add(1, Ordering::SeqCst);
            tokio::spawn(async move {
                let mut head = Vec::new();
                let mut buf = [0u8; 4096];
                for _ in 0..close_after {
                    while !head.windows(4).any(|w| w == b"\r\n\r\n") {
                        match stream.read(&mut buf).await {
                            Ok(0) | Err(_) => return,
                            Ok(n) => head.extend_from_slice(&buf[..n]),
                        }
                    }
                    head.clear();
                    let answer = b"HTTP/1.1 200 OK\r\ncontent-length: 2\r\n\r\nok";
                    if stream.write_all(answer).await.is_err() {
                        return;
                    }
                }
            });
        }
    });
    (addr, accepted)
}

#[tokio::test]
async fn upstream_connections_are_kept_alive_and_one_the_upstream_closed_is_replaced() {
    let (addr, accepted) = keep_alive_upstream(5).await;
    let upstream = format!("http://{addr}");
    let gw = gateway(MEMORY, &route("/", Some(&upstream), None)).await;
    let client = client();
    // One request at a time: each takes the connection the one before gave back.
    for _ in 0..5 {
        let reply = get(&client, &url(&gw, "/x")).await;
        assert_eq!((reply.status, reply.text()), (StatusCode::OK, "ok"));
    }
    assert_eq!(
        accepted.load(Ordering::SeqCst),
        1,
        "one kept-alive connection"
    );
    // The upstream has closed it after its fifth answer: the next request gets a new one.
    tokio::time::sleep(Duration::from_millis(200)).await;
    for _ in 0..3 {
        let reply = get(&client, &url(&gw, "/x")).await;
        assert_eq!((reply.status, reply.text()), (StatusCode::OK, "ok"));
    }
    assert_eq!(accepted.load(Ordering::SeqCst), 2);
    gw.stop().await.unwrap();
}

#[tokio::test]
async fn unreachable_upstream_is_502() {
    let port = closed_port().await;
    let upstream = format!("http://127.0.0.1:{port}");
    let gw = gateway(MEMORY, &route("/", Some(&upstream), None)).await;
    let client = client();
    for _ in 0..3 {
        let reply = get(&client, &url(&gw, "/x")).await;
        assert_eq!(reply.status, StatusCode::BAD_GATEWAY);
    }
    // The gateway is still up and answering.
    let reply = get(&client, &url(&gw, "/x")).await;
    assert_eq!(reply.status, StatusCode::BAD_GATEWAY);
    gw.stop().await.unwrap();
}

/// Bodies are streamed both ways: the upstream reads the first request chunk while the
/// client has not sent the second, and the client reads the first response chunk while the
/// upstream has not written the second. A buffering gateway would hang here (and time out).
#[tokio::test]
async fn bodies_are_streamed_not_buffered() {
    // The upstream reports each request chunk, then streams its answer chunk by chunk as
    // the test releases them.
    let (chunk_seen_tx, mut chunk_seen) = mpsc::unbounded_channel::<Bytes>();
    let (answer_tx, answer_rx) = mpsc::unbounded_channel::<Bytes>();
    let answer_rx = Arc::new(Mutex::new(Some(answer_rx)));
    let app = Router::new().fallback(move |request: Request| {
        let chunk_seen_tx = chunk_seen_tx.clone();
        let answer_rx = answer_rx.lock().unwrap().take().unwrap();
        async move {
            let mut body = request.into_body().into_data_stream();
            while let Some(chunk) = body.next().await {
                chunk_seen_tx.send(chunk.unwrap()).unwrap();
            }
            let stream = futures_util::stream::unfold(answer_rx, |mut rx| async move {
                let chunk = rx.recv().await?;
                Some((Ok::<_, std::io::Error>(chunk), rx))
            });
            Response::new(Body::from_stream(stream))
        }
    });
    let (addr, task) = serve(app).await;
    let gw = gateway(MEMORY, &route("/", Some(&format!("http://{addr}")), None)).await;

    let (request_tx, request_rx) = mpsc::unbounded_channel::<Bytes>();
    let request_body = futures_util::stream::unfold(request_rx, |mut rx| async move {
        let chunk = rx.recv().await?;
        Some((Ok::<_, std::io::Error>(chunk), rx))
    });
    let request = http::Request::post(url(&gw, "/upload"))
        .body(Body::from_stream(request_body))
        .unwrap();
    let client = client();
    let response = tokio::spawn(async move { client.request(request).await });

    request_tx.send(Bytes::from_static(b"first")).unwrap();
    assert_eq!(next(&mut chunk_seen).await.unwrap(), "first");
    request_tx.send(Bytes::from_static(b"second")).unwrap();
    assert_eq!(next(&mut chunk_seen).await.unwrap(), "second");
    drop(request_tx);

    answer_tx.send(Bytes::from_static(b"one")).unwrap();
    let response = tokio::time::timeout(TIMEOUT, response)
        .await
        .expect("no response head")
        .unwrap()
        .unwrap();
    assert_eq!(response.status(), StatusCode::OK);
    let mut body = response.into_body();
    let frame = tokio::time::timeout(TIMEOUT, body.frame())
        .await
        .expect("first response chunk not streamed")
        .unwrap()
        .unwrap();
    assert_eq!(frame.into_data().unwrap(), "one");
    answer_tx.send(Bytes::from_static(b"two")).unwrap();
    drop(answer_tx);
    let rest = body.collect().await.unwrap().to_bytes();
    assert_eq!(rest, "two");
    task.abort();
}

async fn next(rx: &mut mpsc::UnboundedReceiver<Bytes>) -> Option<Bytes> {
    tokio::time::timeout(TIMEOUT, rx.recv())
        .await
        .expect("chunk not streamed")
}

// ---------------------------------------------------------------------------------------
// Limits and routes, on any store

/// Exactly `limit` requests pass on each route, then 429 with Retry-After and the
/// RateLimit fields; two routes with equal limits keep separate budgets.
async fn per_route_limits(store: &str) {
    let upstream = Upstream::start().await;
    let limit = Some(("ip", "sliding_window", 3, "1h"));
    let routes = [
        route("/a", Some(&upstream.url()), limit),
        route("/b", None, limit),
        route("/free", None, None),
    ]
    .concat();
    let gw = gateway(store, &routes).await;
    let client = client();

    for i in 0..3 {
        let reply = get(&client, &url(&gw, "/a/x")).await;
        assert_eq!(reply.status, StatusCode::OK, "request {i}");
        assert_eq!(reply.headers["x-upstream"], "yes");
        let fields = reply.headers["ratelimit"].to_str().unwrap();
        assert!(
            fields.starts_with(&format!("\"r0-l0\";r={};t=", 2 - i)),
            "{fields}"
        );
    }
    let denied = get(&client, &url(&gw, "/a/x")).await;
    assert_eq!(denied.status, StatusCode::TOO_MANY_REQUESTS);
    let retry = denied.retry_after().expect("Retry-After");
    assert!((3000..=3600).contains(&retry), "Retry-After {retry}");
    assert_eq!(denied.headers["ratelimit-policy"], "\"r0-l0\";q=3;w=3600");
    assert_eq!(
        upstream.seen().len(),
        3,
        "a denied request never reaches the upstream"
    );

    // /b has its own budget, and answers "ok" itself.
    let reply = get(&client, &url(&gw, "/b")).await;
    assert_eq!((reply.status, reply.text()), (StatusCode::OK, "ok"));
    assert_eq!(
        statuses(&client, &gw, &["/b", "/b", "/b", "/b"]).await,
        [200, 200, 429, 429]
    );
    // A route without limits is never limited.
    assert!(
        statuses(&client, &gw, &["/free"; 10])
            .await
            .iter()
            .all(|s| *s == 200)
    );
    // Denials consumed nothing: still exactly 3 upstream calls.
    assert_eq!(upstream.seen().len(), 3);
    gw.stop().await.unwrap();
}

/// `//api`, `/api/../api`, `/%61pi`... are `/api`: they pass its limits, and the upstream
/// gets the normalised path.
async fn normalised_paths_cannot_skip_limits(store: &str) {
    let upstream = Upstream::start().await;
    let routes = [
        route(
            "/api",
            Some(&upstream.url()),
            Some(("ip", "sliding_window", 2, "1h")),
        ),
        route("/", None, None),
    ]
    .concat();
    let gw = gateway(store, &routes).await;
    let client = client();

    assert_eq!(
        statuses(&client, &gw, &["//api", "/%61pi/x?q=1"]).await,
        [200, 200]
    );
    assert_eq!(upstream.paths(), ["/api", "/api/x?q=1"]);
    let tricks = [
        "/api",
        "//api",
        "/api/../api",
        "/%61pi",
        "/%61%70%69/",
        "/./api",
        "/x/../api/y",
        "/%2e%2e/api",
        "/api/%2e",
        "///api///v1",
    ];
    assert_eq!(statuses(&client, &gw, &tricks).await, [429; 10]);
    assert_eq!(upstream.seen().len(), 2);
    // Segment boundaries: /apix is not /api; encoded slashes are refused.
    let reply = get(&client, &url(&gw, "/apix")).await;
    assert_eq!((reply.status, reply.text()), (StatusCode::OK, "ok"));
    assert_eq!(
        statuses(&client, &gw, &["/api%2Fx", "/%2F/api", "/api%zz"]).await,
        [400; 3]
    );
    assert_eq!(upstream.seen().len(), 2);
    gw.stop().await.unwrap();
}

/// Header and global limits on one route: a layer per kind of key. A missing header is
/// 400; the global budget is shared by every key.
async fn header_and_global_keys(store: &str) {
    let routes = r#"
        [[routes]]
        path = "/"
        [[routes.limits]]
        key = "header:x-api-key"
        algorithm = "gcra"
        limit = 2
        window = "1h"
        [[routes.limits]]
        key = "global"
        algorithm = "token_bucket"
        limit = 3
        window = "1h"
    "#;
    let gw = gateway(store, routes).await;
    let client = client();
    let with_key = |key: &str| {
        http::Request::get(url(&gw, "/"))
            .header("x-api-key", key)
            .body(Body::empty())
            .unwrap()
    };
    let mut got = Vec::new();
    for key in ["k1", "k1", "k1", "k2", "k2", "k3"] {
        got.push(send(&client, with_key(key)).await.status.as_u16());
    }
    // k1: 2 by its own limit; k2: 1 before the global 3 are used; k3: global.
    assert_eq!(got, [200, 200, 429, 200, 429, 429]);
    let missing = get(&client, &url(&gw, "/")).await;
    assert_eq!(missing.status, StatusCode::BAD_REQUEST);
    gw.stop().await.unwrap();
}

/// Several limits with the same key are all-or-nothing: the request denied by the tighter
/// one uses nothing of the other.
async fn same_key_limits_are_all_or_nothing(store: &str) {
    let routes = r#"
        [[routes]]
        path = "/"
        [[routes.limits]]
        key = "ip"
        algorithm = "fixed_window"
        limit = 2
        window = "300d"
        [[routes.limits]]
        key = "ip"
        algorithm = "sliding_window"
        limit = 3
        window = "1h"
    "#;
    let gw = gateway(store, routes).await;
    let client = client();
    let reply = get(&client, &url(&gw, "/")).await;
    assert_eq!(
        reply.headers["ratelimit-policy"],
        "\"r0-l0\";q=2;w=25920000, \"r0-l1\";q=3;w=3600"
    );
    assert_eq!(
        statuses(&client, &gw, &["/", "/", "/"]).await,
        [200, 429, 429]
    );
    let denied = get(&client, &url(&gw, "/")).await;
    // The sliding window still has 1 left: the denials took nothing from it.
    let fields = denied.headers["ratelimit"].to_str().unwrap().to_owned();
    assert!(fields.contains("\"r0-l1\";r=1;"), "{fields}");
    gw.stop().await.unwrap();
}

/// `lockout = "2h"` on a limit of 2 an hour: the third request locks the client out for
/// two hours, longer than any wait of the window itself, so `Retry-After` is the block's
/// (a few seconds' margin for a slow machine); other routes are not affected.
async fn a_lockout_blocks_the_client(store: &str) {
    let routes = format!(
        "{}lockout = \"2h\"\n{}",
        route("/login", None, Some(("ip", "fixed_window", 2, "1h"))),
        route("/other", None, Some(("ip", "fixed_window", 2, "1h"))),
    );
    let gw = gateway(store, &routes).await;
    let client = client();
    assert_eq!(
        statuses(&client, &gw, &["/login", "/login"]).await,
        [200, 200]
    );
    for _ in 0..3 {
        let denied = get(&client, &url(&gw, "/login")).await;
        assert_eq!(denied.status, StatusCode::TOO_MANY_REQUESTS);
        let retry = denied.retry_after().expect("Retry-After");
        assert!((7_190..=7_200).contains(&retry), "Retry-After {retry}");
        let fields = denied.headers["ratelimit"].to_str().unwrap();
        assert_eq!(fields, format!("\"r0-l0\";r=0;t={retry}"));
    }
    assert_eq!(statuses(&client, &gw, &["/other"]).await, [200]);
    gw.stop().await.unwrap();
}

#[tokio::test]
async fn memory_a_lockout_blocks_the_client() {
    a_lockout_blocks_the_client(MEMORY).await;
}

/// `delay = "5s"` on a route: the request its limit (GCRA, 1 per 2 s) would deny waits
/// about 2 s and passes; a route without `delay` answers 429.
async fn a_delayed_route_waits_instead_of_429(store: &str) {
    let limit = "[[routes.limits]]\nkey = \"global\"\nalgorithm = \"gcra\"\nlimit = 1\n\
                 window = \"2s\"\n";
    let routes = format!(
        "[[routes]]\npath = \"/slow\"\ndelay = \"5s\"\n{limit}[[routes]]\npath = \"/fast\"\n{limit}"
    );
    let gw = gateway(store, &routes).await;
    let client = client();
    assert_eq!(statuses(&client, &gw, &["/slow"]).await, [200]);
    let start = std::time::Instant::now();
    assert_eq!(statuses(&client, &gw, &["/slow"]).await, [200]);
    // 2 s less the moments between the two requests (under a second, generously).
    assert!(
        start.elapsed() >= Duration::from_secs(1),
        "{:?}",
        start.elapsed()
    );
    assert_eq!(
        statuses(&client, &gw, &["/fast", "/fast"]).await,
        [200, 429]
    );
    gw.stop().await.unwrap();
}

/// `delay` reserves (GCRA, 1 per second): a request that comes while another waits goes
/// behind it, and each runs at its reserved time without asking the store again (on
/// Redis: one script call per request, counted by `script_calls`).
async fn a_delayed_route_serves_waiters_in_order(
    store: &str,
    script_calls: Option<&dyn Fn() -> u64>,
) {
    let routes = "[[routes]]\npath = \"/slow\"\ndelay = \"5s\"\n[[routes.limits]]\n\
                  key = \"global\"\nalgorithm = \"gcra\"\nlimit = 1\nwindow = \"1s\"\n";
    let gw = gateway(store, routes).await;
    let client = client();
    let calls_before = script_calls.map(|calls| calls());
    let t0 = std::time::Instant::now();
    assert_eq!(statuses(&client, &gw, &["/slow"]).await, [200]);
    let send = || {
        let (client, url) = (client.clone(), url(&gw, "/slow"));
        tokio::spawn(async move {
            let status = get(&client, &url).await.status;
            (status, std::time::Instant::now())
        })
    };
    let first = send();
    tokio::time::sleep(Duration::from_millis(300)).await;
    let second = send();
    let (first, second) = (first.await.unwrap(), second.await.unwrap());
    assert_eq!((first.0.as_u16(), second.0.as_u16()), (200, 200));
    // The first waiter runs about a second in, the one that came later a second after it.
    let (first, second) = (first.1 - t0, second.1 - t0);
    assert!(first >= Duration::from_millis(700), "{first:?}");
    assert!(
        second >= first + Duration::from_millis(700),
        "{first:?} {second:?}"
    );
    if let (Some(calls), Some(before)) = (script_calls, calls_before) {
        assert_eq!(calls() - before, 3, "one script call per request");
    }
    gw.stop().await.unwrap();
}

/// `max_in_flight = 2` on a route keyed by a header: two responses still streaming from
/// the upstream hold both permits of their client, a third request gets 429 with
/// `Retry-After: 1`, another client passes, and a body that ends frees its permit.
async fn max_in_flight_holds_streaming_responses(store: &str) {
    let gate = Arc::new(tokio::sync::Semaphore::new(0));
    let upstream = {
        let gate = gate.clone();
        Router::new().fallback(move || {
            let gate = gate.clone();
            async move {
                Body::from_stream(futures_util::stream::once(async move {
                    gate.acquire().await.unwrap().forget();
                    Ok::<_, std::convert::Infallible>(Bytes::from_static(b"done"))
                }))
            }
        })
    };
    let (upstream, _task) = serve(upstream).await;
    let routes = format!(
        "[[routes]]\npath = \"/\"\nupstream = \"http://{upstream}\"\nmax_in_flight = 2\n\
         [[routes.limits]]\nkey = \"header:x-client\"\nalgorithm = \"fixed_window\"\n\
         limit = 1000\nwindow = \"1h\"\n"
    );
    let gw = gateway(store, &routes).await;
    let client = client();
    let start = |who: &str| {
        let request = http::Request::get(url(&gw, "/"))
            .header("x-client", who)
            .body(Body::empty())
            .unwrap();
        let response = client.request(request);
        async move {
            tokio::time::timeout(TIMEOUT, response)
                .await
                .expect("no answer in time")
                .unwrap()
        }
    };
    let first = start("a").await;
    let _second = start("a").await;
    assert_eq!(first.status(), StatusCode::OK);
    let third = start("a").await;
    assert_eq!(third.status(), StatusCode::TOO_MANY_REQUESTS);
    assert_eq!(third.headers()["retry-after"], "1");
    assert_eq!(start("b").await.status(), StatusCode::OK);

    gate.add_permits(1);
    let body = first.into_body().collect().await.unwrap().to_bytes();
    assert_eq!(&body[..], b"done");
    let deadline = std::time::Instant::now() + Duration::from_secs(10);
    let _held = loop {
        let response = start("a").await;
        if response.status() == StatusCode::OK {
            break response;
        }
        assert!(
            std::time::Instant::now() < deadline,
            "the permit never came back"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    };
    assert_eq!(start("a").await.status(), StatusCode::TOO_MANY_REQUESTS);
    gate.add_permits(16);
}

#[tokio::test]
async fn memory_max_in_flight_holds_streaming_responses() {
    max_in_flight_holds_streaming_responses(MEMORY).await;
}

/// A reload rebuilds the route's layers, but the permits live in the store the gateway
/// keeps: a response still streaming counts after the reload (it started the count afresh
/// before).
#[tokio::test]
async fn memory_max_in_flight_counts_across_a_reload() {
    let gate = Arc::new(tokio::sync::Semaphore::new(0));
    let upstream = {
        let gate = gate.clone();
        Router::new().fallback(move || {
            let gate = gate.clone();
            async move {
                Body::from_stream(futures_util::stream::once(async move {
                    gate.acquire().await.unwrap().forget();
                    Ok::<_, std::convert::Infallible>(Bytes::from_static(b"done"))
                }))
            }
        })
    };
    let (upstream, _task) = serve(upstream).await;
    let text = |limit: u32| {
        format!(
            "listen = \"127.0.0.1:0\"\n[[routes]]\npath = \"/\"\n\
             upstream = \"http://{upstream}\"\nmax_in_flight = 1\n\
             [[routes.limits]]\nkey = \"header:x-client\"\nalgorithm = \"fixed_window\"\n\
             limit = {limit}\nwindow = \"1h\"\n"
        )
    };
    let gw = server::start(Config::parse(&text(1000)).unwrap())
        .await
        .unwrap();
    let client = client();
    let start = || {
        let request = http::Request::get(url(&gw, "/"))
            .header("x-client", "a")
            .body(Body::empty())
            .unwrap();
        let response = client.request(request);
        async move {
            tokio::time::timeout(TIMEOUT, response)
                .await
                .expect("no answer in time")
                .unwrap()
        }
    };
    let held = start().await;
    assert_eq!(held.status(), StatusCode::OK);
    assert_eq!(start().await.status(), StatusCode::TOO_MANY_REQUESTS);

    assert_eq!(gw.live().apply(Config::parse(&text(2000)).unwrap()), Ok(2));
    assert_eq!(
        start().await.status(),
        StatusCode::TOO_MANY_REQUESTS,
        "the reload forgot the request in flight"
    );

    gate.add_permits(1);
    let body = held.into_body().collect().await.unwrap().to_bytes();
    assert_eq!(&body[..], b"done");
    let deadline = std::time::Instant::now() + Duration::from_secs(10);
    while start().await.status() != StatusCode::OK {
        assert!(
            std::time::Instant::now() < deadline,
            "the permit never came back"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    gate.add_permits(16);
    gw.stop().await.unwrap();
}

#[tokio::test]
async fn memory_a_delayed_route_waits_instead_of_429() {
    a_delayed_route_waits_instead_of_429(MEMORY).await;
}

#[tokio::test]
async fn memory_a_delayed_route_serves_waiters_in_order() {
    a_delayed_route_serves_waiters_in_order(MEMORY, None).await;
}

#[tokio::test]
async fn memory_per_route_limits() {
    per_route_limits(MEMORY).await;
}

#[tokio::test]
async fn memory_normalised_paths_cannot_skip_limits() {
    normalised_paths_cannot_skip_limits(MEMORY).await;
}

#[tokio::test]
async fn memory_header_and_global_keys() {
    header_and_global_keys(MEMORY).await;
}

#[tokio::test]
async fn memory_same_key_limits_are_all_or_nothing() {
    same_key_limits_are_all_or_nothing(MEMORY).await;
}

#[tokio::test]
async fn longest_prefix_wins_on_segment_boundaries() {
    let api = Upstream::start().await;
    let v2 = Upstream::start().await;
    let routes = [
        route("/", None, None),
        route(
            "/api",
            Some(&api.url()),
            Some(("global", "sliding_window", 1, "1h")),
        ),
        route("/api/v2/", Some(&v2.url()), None),
    ]
    .concat();
    let gw = gateway(MEMORY, &routes).await;
    let client = client();
    // /api/v2 is its own, unlimited route; /api/v2x and /api/v are /api's.
    assert_eq!(
        statuses(
            &client,
            &gw,
            &["/api/v2", "/api/v2/x", "/api/v2/x", "/api/v2x", "/api/v"]
        )
        .await,
        [200, 200, 200, 200, 429]
    );
    assert_eq!(v2.paths(), ["/api/v2", "/api/v2/x", "/api/v2/x"]);
    assert_eq!(api.paths(), ["/api/v2x"]);
    let reply = get(&client, &url(&gw, "/apix")).await;
    assert_eq!(reply.text(), "ok");
}

#[tokio::test]
async fn no_route_is_404() {
    let gw = gateway(MEMORY, &route("/api", None, None)).await;
    let client = client();
    assert_eq!(
        statuses(&client, &gw, &["/", "/apix", "/api/x"]).await,
        [404, 404, 200]
    );
}

// ---------------------------------------------------------------------------------------
// The demo, config errors, shutdown

#[tokio::test]
async fn demo_config_denies_the_sixth_request() {
    let mut config = Config::demo();
    assert_eq!(config.listen, "127.0.0.1:8080".parse().unwrap());
    config.listen = "127.0.0.1:0".parse().unwrap();
    let gw = server::start(config).await.unwrap();
    let client = client();
    // A sliding window of 5 per 10s: exact as long as these six take under ten seconds.
    let mut got = Vec::new();
    for _ in 0..6 {
        let reply = get(&client, &url(&gw, "/anything")).await;
        got.push(reply.status.as_u16());
        if reply.status == StatusCode::OK {
            assert_eq!(reply.text(), "ok");
        } else {
            assert!(reply.retry_after().is_some_and(|s| (1..=10).contains(&s)));
        }
    }
    assert_eq!(got, [200, 200, 200, 200, 200, 429]);
    gw.stop().await.unwrap();
}

/// The gateway binary prints its addresses on stdout and logs on stderr, without colour
/// codes when stderr is not a terminal.
#[test]
fn the_binary_logs_to_stderr_without_colour_codes() {
    use std::io::{BufRead, BufReader, Read};

    let binary = std::path::Path::new(env!("CARGO_BIN_EXE_gateway"));
    assert!(binary.exists(), "{} was not built", binary.display());
    let dir = std::env::temp_dir().join(format!("tollgate-gateway-logs-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let config = dir.join("gateway.toml");
    std::fs::write(&config, "listen = \"127.0.0.1:0\"\n").unwrap();
    let mut child = std::process::Command::new(binary)
        .args(["--config", config.to_str().unwrap()])
        .env("RUST_LOG", "info")
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .unwrap();
    let mut stdout = BufReader::new(child.stdout.take().unwrap());
    let mut first = String::new();
    stdout.read_line(&mut first).unwrap();
    assert!(
        first.starts_with("listening on http://127.0.0.1:"),
        "{first:?}"
    );
    child.kill().unwrap();
    child.wait().unwrap();
    let mut rest = String::new();
    stdout.read_to_string(&mut rest).unwrap();
    let mut logs = String::new();
    child
        .stderr
        .take()
        .unwrap()
        .read_to_string(&mut logs)
        .unwrap();
    let _ = std::fs::remove_dir_all(&dir);
    assert!(rest.is_empty(), "logs on stdout: {rest:?}");
    assert!(logs.contains("gateway started"), "{logs:?}");
    assert!(!logs.contains('\u{1b}'), "colour codes: {logs:?}");
}

#[test]
fn the_example_config_file_is_valid() {
    let path = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("gateway.toml");
    let config = Config::load(&path).unwrap();
    assert_eq!(config.routes.len(), 4);
    assert!(config.admin_listen.is_some());
}

/// The config shape shown in the gateway's README.md is a valid config, with the documented
/// defaults.
#[test]
fn the_documented_config_shape_is_valid() {
    let root = std::path::Path::new(env!("CARGO_MANIFEST_DIR"));
    let doc = "README.md";
    let text = std::fs::read_to_string(root.join(doc)).unwrap();
    let shape = text
        .split("```toml\n")
        .skip(1)
        .filter_map(|block| block.split_once("```").map(|(toml, _)| toml))
        .find(|toml| toml.starts_with("listen = "))
        .unwrap_or_else(|| panic!("no config shape in {doc}"));
    let config = Config::parse(shape).unwrap_or_else(|e| panic!("{doc}: {e}\n{shape}"));
    assert_eq!(config.server, config::ServerConfig::default(), "{doc}");
    assert_eq!(config.store.prefix, "tollgate");
    assert_eq!(config.store.timeout, tollgate::rules::DEFAULT_TIMEOUT);
    assert_eq!(config.routes.len(), 1);
}

#[test]
fn invalid_configs_are_rejected_naming_the_field_and_value() {
    let ok_route = "[[routes]]\npath = \"/\"\n";
    let limit =
        |fields: &str| format!("listen = \"127.0.0.1:0\"\n{ok_route}[[routes.limits]]\n{fields}\n");
    let base = "key = \"ip\"\nalgorithm = \"fixed_window\"\nlimit = 5\nwindow = \"1m\"";
    let cases: Vec<(String, &[&str])> = vec![
        // Structure, from serde: unknown fields anywhere, missing listen, wrong types.
        (
            "listen = \"127.0.0.1:0\"\nlisten_addr = 1".into(),
            &["unknown field", "listen_addr"],
        ),
        (ok_route.to_owned(), &["missing field", "listen"]),
        (
            "listen = \"127.0.0.1:0\"\n[store]\nbackend = \"memory\"\ncolour = 1".into(),
            &["unknown field", "colour"],
        ),
        (
            limit(&format!("{base}\nburts = 3")),
            &["unknown field", "burts"],
        ),
        (
            limit(&base.replace("limit = 5", "limit = -1")),
            &["limit", "-1"],
        ),
        // Values, validated: each names the field and the value.
        (
            "listen = \"localhost\"".into(),
            &["listen", "\"localhost\""],
        ),
        (
            limit(&base.replace("limit = 5", "limit = 0")),
            &["routes[0].limits[0].limit", "got 0"],
        ),
        (
            limit(&format!("{base}\nshadow = 1")),
            &["shadow", "invalid type"],
        ),
        (
            format!(
                "{}[[routes.limits]]\n{base}\nname = \"same\"\nshadow = true",
                limit(&format!("{base}\nname = \"same\""))
            ),
            &["routes[0].limits[1].shadow", "both enforced and in shadow"],
        ),
        (
            limit(&base.replace("\"1m\"", "\"abc\"")),
            &["routes[0].limits[0].window", "\"abc\""],
        ),
        (
            limit(&base.replace("\"1m\"", "\"0s\"")),
            &["routes[0].limits[0].window", "0ns"],
        ),
        (
            "listen = \"127.0.0.1:0\"\n[[routes]]\npath = \"/\"\ndelay = \"soon\"".into(),
            &["routes[0].delay", "\"soon\""],
        ),
        (
            "listen = \"127.0.0.1:0\"\n[[routes]]\npath = \"/\"\nmax_in_flight = 0".into(),
            &["routes[0].max_in_flight", "at least 1"],
        ),
        (
            "listen = \"127.0.0.1:0\"\n[[routes]]\npath = \"/\"\ndelay = \"2h\"".into(),
            &["routes[0].delay", "from 1ms to 1h"],
        ),
        (
            limit(&format!("{base}\nlockout = \"soon\"")),
            &["routes[0].limits[0].lockout", "\"soon\""],
        ),
        (
            limit(&format!("{base}\nlockout = \"0s\"")),
            &["routes[0].limits[0].lockout", "at least 1ms"],
        ),
        (
            limit(&base.replace("fixed_window", "leaky_bucket")),
            &["routes[0].limits[0].algorithm", "\"leaky_bucket\""],
        ),
        (
            limit(&format!("{base}\nburst = 10")),
            &["routes[0].limits[0].burst", "fixed_window"],
        ),
        (
            limit(&base.replace("\"ip\"", "\"cookie\"")),
            &["routes[0].limits[0].key", "\"cookie\""],
        ),
        (
            limit(&base.replace("\"ip\"", "\"header:bad name\"")),
            &["routes[0].limits[0].key", "bad name"],
        ),
        (
            limit(&format!("{base}\nname = \"a b\"")),
            &["routes[0].limits[0].name", "\"a b\""],
        ),
        (
            "listen = \"127.0.0.1:0\"\n[[routes]]\npath = \"/\"\nupstream = \"not a url\"".into(),
            &["routes[0].upstream", "\"not a url\""],
        ),
        (
            "listen = \"127.0.0.1:0\"\n[[routes]]\npath = \"/\"\nupstream = \"ftp://x:1\"".into(),
            &["routes[0].upstream", "\"ftp://x:1\""],
        ),
        (
            "listen = \"127.0.0.1:0\"\n[[routes]]\npath = \"api\"".into(),
            &["routes[0].path", "\"api\""],
        ),
        (
            "listen = \"127.0.0.1:0\"\n[[routes]]\npath = \"/a\"\n[[routes]]\npath = \"/a/\""
                .into(),
            &["routes[1].path", "routes[0]"],
        ),
        (
            "listen = \"127.0.0.1:0\"\ntrusted_proxies = [\"10.0.0.0/33\"]".into(),
            &["trusted_proxies[0]", "\"10.0.0.0/33\""],
        ),
        (
            "listen = \"127.0.0.1:0\"\n[store]\nbackend = \"etcd\"".into(),
            &["store.backend", "\"etcd\""],
        ),
        (
            "listen = \"127.0.0.1:0\"\n[store]\nbackend = \"redis\"\nurl = \"http//nope\"".into(),
            &["store.url", "\"http//nope\""],
        ),
        (
            "listen = \"127.0.0.1:0\"\n[store]\nbackend = \"redis\"".into(),
            &["store.url", "required"],
        ),
        (
            "listen = \"127.0.0.1:0\"\n[store]\non_error = \"maybe\"".into(),
            &["store.on_error", "\"maybe\""],
        ),
        (
            "listen = \"127.0.0.1:0\"\n[store]\ntimeout_ms = 0".into(),
            &["store.timeout_ms", "got 0"],
        ),
        (
            "listen = \"127.0.0.1:0\"\n[store]\nbackend = \"redis-cluster\"".into(),
            &["store.nodes", "at least one node"],
        ),
        // The prefix rule is the library's (`RedisStore::with_prefix`), checked at load.
        (
            "listen = \"127.0.0.1:0\"\n[store]\nprefix = \"a+b\"".into(),
            &["store.prefix", "\"a+b\""],
        ),
        (
            "listen = \"127.0.0.1:0\"\n[store]\nprefix = \"{tg}\"".into(),
            &["store.prefix", "\"{tg}\""],
        ),
        (
            "listen = \"127.0.0.1:0\"\n[store]\nprefix = \"\"".into(),
            &["store.prefix", "1 to 64"],
        ),
        (
            format!(
                "listen = \"127.0.0.1:0\"\n[store]\nprefix = \"{}\"",
                "p".repeat(65)
            ),
            &["store.prefix", "1 to 64"],
        ),
        (
            "listen = \"127.0.0.1:0\"\n[server]\nheader_timeout = \"1s\"".into(),
            &["unknown field", "header_timeout"],
        ),
        (
            "listen = \"127.0.0.1:0\"\n[server]\nheader_read_timeout = \"0s\"".into(),
            &["server.header_read_timeout", "\"0s\""],
        ),
        (
            "listen = \"127.0.0.1:0\"\n[server]\nupstream_timeout = \"soon\"".into(),
            &["server.upstream_timeout", "\"soon\""],
        ),
        (
            "listen = \"127.0.0.1:0\"\n[server]\nshutdown_timeout = \"25h\"".into(),
            &["server.shutdown_timeout", "\"25h\""],
        ),
        (
            "listen = \"127.0.0.1:0\"\n[server]\nmax_body_bytes = 0".into(),
            &["server.max_body_bytes", "got 0"],
        ),
        (
            "listen = \"127.0.0.1:0\"\n[server]\nmax_connections = 0".into(),
            &["server.max_connections", "got 0"],
        ),
        (
            "listen = \"127.0.0.1:0\"\n[server]\nmax_connections = 1000001".into(),
            &["server.max_connections", "got 1000001"],
        ),
        (
            "listen = \"127.0.0.1:0\"\n[store]\nbackend = \"redis-cluster\"\nnodes = []".into(),
            &["store.nodes", "at least one node"],
        ),
        (
            "listen = \"127.0.0.1:0\"\n[store]\nbackend = \"redis-cluster\"\n\
             nodes = [\"redis://127.0.0.1:7000\", \"127.0.0.1:7001\"]"
                .into(),
            &["store.nodes[1]", "\"127.0.0.1:7001\""],
        ),
    ];
    for (text, expected) in &cases {
        let error = match Config::parse(text) {
            Ok(_) => panic!("accepted:\n{text}"),
            Err(error) => error.to_string(),
        };
        for part in *expected {
            assert!(
                error.contains(part),
                "{part:?} not in {error:?} for:\n{text}"
            );
        }
    }
    // A file that cannot be read names itself.
    let error = Config::load(std::path::Path::new("/nonexistent/gateway.toml")).unwrap_err();
    assert!(
        error.to_string().contains("/nonexistent/gateway.toml"),
        "{error}"
    );
}

#[cfg(not(feature = "redis"))]
#[test]
fn redis_backend_without_the_feature_is_a_clear_error() {
    let text =
        "listen = \"127.0.0.1:0\"\n[store]\nbackend = \"redis\"\nurl = \"redis://127.0.0.1:1\"";
    let error = Config::parse(text).unwrap_err().to_string();
    assert!(
        error.contains("store.backend") && error.contains("redis feature"),
        "{error}"
    );
}

#[cfg(not(feature = "cluster"))]
#[test]
fn redis_cluster_backend_without_the_feature_is_a_clear_error() {
    let text = "listen = \"127.0.0.1:0\"\n[store]\nbackend = \"redis-cluster\"\n\
                nodes = [\"redis://127.0.0.1:7000\"]";
    let error = Config::parse(text).unwrap_err().to_string();
    assert!(
        error.contains("store.backend") && error.contains("cluster feature"),
        "{error}"
    );
}

#[tokio::test]
async fn shutdown_lets_requests_in_flight_finish() {
    let (arrived_tx, arrived) = oneshot::channel::<()>();
    let (release, release_rx) = oneshot::channel::<()>();
    let hooks = Arc::new(Mutex::new(Some((arrived_tx, release_rx))));
    let app = Router::new().fallback(move || {
        let hooks = hooks.lock().unwrap().take();
        async move {
            if let Some((arrived, release)) = hooks {
                arrived.send(()).unwrap();
                release.await.unwrap();
            }
            "finished"
        }
    });
    let (addr, task) = serve(app).await;
    let gw = gateway(MEMORY, &route("/", Some(&format!("http://{addr}")), None)).await;
    let gateway_addr = gw.addr();
    let client = client();
    let request = http::Request::get(url(&gw, "/slow"))
        .body(Body::empty())
        .unwrap();
    let in_flight = tokio::spawn(async move { send(&client, request).await });
    tokio::time::timeout(TIMEOUT, arrived)
        .await
        .unwrap()
        .unwrap();

    let stopping = tokio::spawn(gw.stop());
    // New connections are refused once the listener is closed (polled, bounded).
    let mut refused = false;
    for _ in 0..1000 {
        if tokio::net::TcpStream::connect(gateway_addr).await.is_err() {
            refused = true;
            break;
        }
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    assert!(
        refused,
        "the gateway still accepts connections while shutting down"
    );
    assert!(
        !stopping.is_finished(),
        "stopped before the request in flight finished"
    );

    release.send(()).unwrap();
    let reply = tokio::time::timeout(TIMEOUT, in_flight)
        .await
        .unwrap()
        .unwrap();
    assert_eq!((reply.status, reply.text()), (StatusCode::OK, "finished"));
    tokio::time::timeout(TIMEOUT, stopping)
        .await
        .unwrap()
        .unwrap()
        .unwrap();
    task.abort();
}

// ---------------------------------------------------------------------------------------
// Hardening: clients and upstreams that misbehave cannot hold the gateway.
//
// Each test sets a short `[server]` limit and asserts only that the gateway acts before the
// harness's 20 s `TIMEOUT`: a slow machine makes them slower, never wrong.

/// An upstream that accepts connections and never answers; `accepted` reports each one.
struct HungUpstream {
    addr: SocketAddr,
    accepted: mpsc::UnboundedReceiver<()>,
    task: JoinHandle<()>,
}

impl HungUpstream {
    async fn start() -> Self {
        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        let (tx, accepted) = mpsc::unbounded_channel();
        let task = tokio::spawn(async move {
            let mut held = Vec::new();
            while let Ok((stream, _)) = listener.accept().await {
                held.push(stream);
                let _ = tx.send(());
            }
        });
        Self {
            addr,
            accepted,
            task,
        }
    }

    fn url(&self) -> String {
        format!("http://{}", self.addr)
    }
}

impl Drop for HungUpstream {
    fn drop(&mut self) {
        self.task.abort();
    }
}

/// A client that sends a request line, then one header byte every 50 ms, is disconnected
/// after `header_read_timeout`; so is one that connects and sends nothing.
#[tokio::test]
async fn a_client_trickling_its_headers_is_disconnected() {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};

    let server = "[server]\nheader_read_timeout = \"300ms\"\n";
    let gw = gateway(server, &route("/", None, None)).await;

    let stream = tokio::net::TcpStream::connect(gw.addr()).await.unwrap();
    let (mut read, mut write) = stream.into_split();
    write
        .write_all(b"GET / HTTP/1.1\r\nX-Slow: ")
        .await
        .unwrap();
    let trickle = async move {
        loop {
            tokio::time::sleep(Duration::from_millis(50)).await;
            if write.write_all(b"a").await.is_err() {
                return;
            }
        }
    };
    let closed = async move {
        let mut buf = Vec::new();
        let _ = read.read_to_end(&mut buf).await;
    };
    let disconnected = tokio::time::timeout(TIMEOUT, async {
        tokio::select! {
            () = closed => {}
            () = trickle => {}
        }
    })
    .await;
    assert!(
        disconnected.is_ok(),
        "a trickling client kept its connection"
    );

    let mut silent = tokio::net::TcpStream::connect(gw.addr()).await.unwrap();
    let mut buf = Vec::new();
    let read = tokio::time::timeout(TIMEOUT, silent.read_to_end(&mut buf)).await;
    assert!(read.is_ok(), "a silent client kept its connection");

    // Clients that send their request in time are served as before.
    assert_eq!(statuses(&client(), &gw, &["/"]).await, [200]);
    gw.stop().await.unwrap();
}

/// A client that sends a request and never reads the response (an endless stream from
/// the upstream) is disconnected once a write to it has made no progress for
/// `write_idle_timeout`, which frees its connection slot and ends the upstream's response
/// (before, both were held for as long as the client stayed connected).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_client_that_never_reads_is_disconnected_after_write_idle_timeout() {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};

    /// Set when the upstream's response stream is dropped: its connection ended.
    struct Ended(Arc<std::sync::atomic::AtomicBool>);
    impl Drop for Ended {
        fn drop(&mut self) {
            self.0.store(true, std::sync::atomic::Ordering::SeqCst);
        }
    }
    let ended = Arc::new(std::sync::atomic::AtomicBool::new(false));
    let upstream = {
        let ended = ended.clone();
        Router::new().fallback(move || {
            let guard = Ended(ended.clone());
            async move {
                let chunk = Bytes::from(vec![b'x'; 64 * 1024]);
                Body::from_stream(futures_util::stream::unfold(guard, move |guard| {
                    let chunk = chunk.clone();
                    async move { Some((Ok::<_, std::convert::Infallible>(chunk), guard)) }
                }))
            }
        })
    };
    let (upstream, _task) = serve(upstream).await;
    let server = "[server]\nwrite_idle_timeout = \"300ms\"\nmax_connections = 1\n";
    let gw = gateway(
        server,
        &route("/", Some(&format!("http://{upstream}")), None),
    )
    .await;

    let mut stalled = tokio::net::TcpStream::connect(gw.addr()).await.unwrap();
    stalled
        .write_all(b"GET /endless HTTP/1.1\r\nHost: gateway\r\n\r\n")
        .await
        .unwrap();
    let deadline = std::time::Instant::now() + TIMEOUT;
    while !ended.load(std::sync::atomic::Ordering::SeqCst) {
        assert!(
            std::time::Instant::now() < deadline,
            "a client that never reads kept its response streaming"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    // The client's connection was closed: what was buffered, then the end.
    let mut sink = vec![0; 1 << 20];
    let drained = tokio::time::timeout(TIMEOUT, async {
        loop {
            match stalled.read(&mut sink).await {
                Ok(0) | Err(_) => return,
                Ok(_) => {}
            }
        }
    })
    .await;
    assert!(drained.is_ok(), "the connection stayed open");
    // Its slot is free (max_connections = 1): the next client is served.
    let reply = tokio::time::timeout(TIMEOUT, async {
        let mut next = tokio::net::TcpStream::connect(gw.addr()).await.unwrap();
        next.write_all(b"GET /x HTTP/1.1\r\nHost: gateway\r\n\r\n")
            .await
            .unwrap();
        let mut head = [0; 12];
        next.read_exact(&mut head).await.unwrap();
        head
    })
    .await
    .expect("the slot was not freed");
    assert_eq!(&reply, b"HTTP/1.1 200");
    gw.stop().await.unwrap();
}

/// An upstream that never answers costs a client `upstream_timeout`, then 504.
#[tokio::test]
async fn a_hung_upstream_is_504_after_upstream_timeout() {
    let mut upstream = HungUpstream::start().await;
    let server = "[server]\nupstream_timeout = \"300ms\"\n";
    let gw = gateway(server, &route("/", Some(&upstream.url()), None)).await;
    let client = client();
    for _ in 0..2 {
        let reply = get(&client, &url(&gw, "/slow")).await;
        assert_eq!(reply.status, StatusCode::GATEWAY_TIMEOUT);
        assert_eq!(reply.text(), "gateway timeout\n");
    }
    // The upstream did get the requests: the 504s are its silence, not a failed connect.
    let accepted = tokio::time::timeout(TIMEOUT, upstream.accepted.recv()).await;
    assert!(
        matches!(accepted, Ok(Some(()))),
        "the upstream saw no connection"
    );
    gw.stop().await.unwrap();
}

/// A body larger than `max_body_bytes` is answered 413, announced or streamed, and the
/// upstream never receives it whole; a body of exactly the limit passes.
#[tokio::test]
async fn a_body_over_max_body_bytes_is_413() {
    let upstream = Upstream::start().await;
    let server = "[server]\nmax_body_bytes = 1000\n";
    let gw = gateway(server, &route("/", Some(&upstream.url()), None)).await;
    let client = client();

    let post = |body: Body| http::Request::post(url(&gw, "/upload")).body(body).unwrap();
    let reply = send(&client, post(Body::from(vec![b'x'; 1000]))).await;
    assert_eq!(reply.status, StatusCode::OK);
    assert_eq!(reply.text(), "upstream saw 1000 bytes");

    // Announced by Content-Length: refused before the upstream is asked.
    let reply = send(&client, post(Body::from(vec![b'x'; 1001]))).await;
    assert_eq!(reply.status, StatusCode::PAYLOAD_TOO_LARGE);
    assert_eq!(reply.text(), "length limit exceeded");

    // Streamed without a length: refused when it passes the limit.
    let chunks =
        [vec![b'x'; 600], vec![b'x'; 600]].map(|chunk| Ok::<_, std::io::Error>(Bytes::from(chunk)));
    let streamed = Body::from_stream(futures_util::stream::iter(chunks));
    let reply = send(&client, post(streamed)).await;
    assert_eq!(reply.status, StatusCode::PAYLOAD_TOO_LARGE);
    assert_eq!(reply.text(), "length limit exceeded");

    let sizes: Vec<usize> = upstream.seen().iter().map(|s| s.body.len()).collect();
    assert_eq!(sizes, [1000]);
    gw.stop().await.unwrap();
}

/// With `max_connections = 2` and two connections held open, a third client is not
/// served until one of them closes.
#[tokio::test]
async fn connections_beyond_max_connections_wait() {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};

    let server = "[server]\nmax_connections = 2\nheader_read_timeout = \"1h\"\n";
    let gw = gateway(server, &route("/", None, None)).await;

    // Two keep-alive connections, each served once (so certainly accepted), then idle.
    let mut held = Vec::new();
    for _ in 0..2 {
        let mut stream = tokio::net::TcpStream::connect(gw.addr()).await.unwrap();
        stream
            .write_all(b"GET / HTTP/1.1\r\nHost: gw\r\n\r\n")
            .await
            .unwrap();
        let mut answer = Vec::new();
        while !answer.ends_with(b"\r\n\r\nok") {
            let mut buf = [0; 1024];
            let n = tokio::time::timeout(TIMEOUT, stream.read(&mut buf))
                .await
                .expect("no answer in time")
                .unwrap();
            assert!(n > 0, "closed: {:?}", String::from_utf8_lossy(&answer));
            answer.extend_from_slice(&buf[..n]);
        }
        held.push(stream);
    }

    let client = client();
    let third_url = url(&gw, "/third");
    let mut third = tokio::spawn(async move { get(&client, &third_url).await.status });
    // Not served while both are held (however long we would wait: half a second shows it).
    let early = tokio::time::timeout(Duration::from_millis(500), &mut third).await;
    assert!(early.is_err(), "a third connection was served: {early:?}");

    drop(held.pop());
    let status = tokio::time::timeout(TIMEOUT, third)
        .await
        .expect("the third client was not served after a connection closed")
        .unwrap();
    assert_eq!(status, StatusCode::OK);
    gw.stop().await.unwrap();
}

/// A request whose upstream never answers does not hold shutdown beyond
/// `shutdown_timeout`: its connection is closed.
#[tokio::test]
async fn shutdown_finishes_within_shutdown_timeout_with_a_hung_request() {
    let mut upstream = HungUpstream::start().await;
    let server = "[server]\nshutdown_timeout = \"300ms\"\nupstream_timeout = \"1h\"\n";
    let gw = gateway(server, &route("/", Some(&upstream.url()), None)).await;
    let client = client();
    let request_url = url(&gw, "/hang");
    let in_flight = tokio::spawn(async move {
        client
            .request(http::Request::get(request_url).body(Body::empty()).unwrap())
            .await
            .map(|response| response.status())
    });
    tokio::time::timeout(TIMEOUT, upstream.accepted.recv())
        .await
        .expect("the request never reached the upstream")
        .unwrap();

    tokio::time::timeout(TIMEOUT, gw.stop())
        .await
        .expect("shutdown waited for the hung request")
        .unwrap();
    // The hung request's connection was closed: its client sees an error, not a hang.
    let outcome = tokio::time::timeout(TIMEOUT, in_flight)
        .await
        .expect("the hung request's connection stayed open")
        .unwrap();
    assert!(outcome.is_err(), "{outcome:?}");
}

/// Two `Host` lines, an invalid `Host` or none in HTTP/1.1 are answered 400 and never
/// forwarded (RFC 9112 section 3.2): the gateway and the upstream could read different ones.
#[tokio::test]
async fn a_request_with_a_bad_host_is_refused() {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};

    let upstream = Upstream::start().await;
    let gw = gateway(MEMORY, &route("/", Some(&upstream.url()), None)).await;
    let exchange = |request: &'static str| {
        let addr = gw.addr();
        async move {
            let mut stream = tokio::net::TcpStream::connect(addr).await.unwrap();
            stream.write_all(request.as_bytes()).await.unwrap();
            let mut answer = vec![0; 64];
            let n = tokio::time::timeout(TIMEOUT, stream.read(&mut answer))
                .await
                .expect("no answer in time")
                .unwrap();
            String::from_utf8_lossy(&answer[..n]).into_owned()
        }
    };
    for request in [
        "GET /two HTTP/1.1\r\nHost: a.example\r\nHost: b.example\r\n\r\n",
        "GET /bad HTTP/1.1\r\nHost: a b\r\n\r\n",
        "GET /userinfo HTTP/1.1\r\nHost: me@a.example\r\n\r\n",
        "GET /none HTTP/1.1\r\n\r\n",
    ] {
        let answer = exchange(request).await;
        assert!(
            answer.starts_with("HTTP/1.1 400"),
            "{request:?}: {answer:?}"
        );
    }
    assert!(upstream.paths().is_empty(), "{:?}", upstream.paths());
    // One valid Host, and HTTP/1.0 without one, pass.
    for request in [
        "GET /one HTTP/1.1\r\nHost: a.example:8080\r\nConnection: close\r\n\r\n",
        "GET /old HTTP/1.0\r\n\r\n",
    ] {
        let answer = exchange(request).await;
        assert!(answer.contains(" 200 "), "{request:?}: {answer:?}");
    }
    assert_eq!(upstream.paths(), ["/one", "/old"]);
    gw.stop().await.unwrap();
}

/// `Forwarded`, `X-Real-IP` and `X-Forwarded-For` written by a client reach the upstream
/// only through a trusted proxy; `X-Real-IP` is always the address the `ip` key is computed from.
#[tokio::test]
async fn forged_forwarding_headers_never_reach_the_upstream() {
    let upstream = Upstream::start().await;
    let routes = route("/", Some(&upstream.url()), None);
    let client = client();
    let forged = |gw: &Running| {
        http::Request::get(url(gw, "/who"))
            .header("forwarded", "for=6.6.6.6;proto=https")
            .header("forwarded", "for=\"[2001:db8::6]\"")
            .header("x-real-ip", "6.6.6.6")
            .header("x-forwarded-for", "6.6.6.6, 203.0.113.9")
            // CGI and WSGI upstreams read these as X-Real-IP and X-Forwarded-For.
            .header("x_real_ip", "6.6.6.6")
            .header("X_Forwarded_For", "6.6.6.6")
            // Would drop the list the `ip` key reads before X-Real-IP is set from it.
            .header("connection", "X-Forwarded-For, Forwarded")
            .body(Body::empty())
            .unwrap()
    };

    // From a peer that is not a trusted proxy: the peer alone.
    let gw = gateway(MEMORY, &routes).await;
    assert_eq!(send(&client, forged(&gw)).await.status, StatusCode::OK);
    let seen = upstream.seen().pop().unwrap().headers;
    let all = |name: &str| -> Vec<&str> {
        seen.get_all(name)
            .iter()
            .map(|v| v.to_str().unwrap())
            .collect()
    };
    assert_eq!(all("x-real-ip"), ["127.0.0.1"]);
    assert!(all("x_real_ip").is_empty() && all("x_forwarded_for").is_empty());
    assert_eq!(all("forwarded"), ["for=127.0.0.1"]);
    assert_eq!(all("x-forwarded-for"), ["127.0.0.1"]);
    gw.stop().await.unwrap();

    // From a trusted proxy: its lists with the peer appended; X-Real-IP is the client the
    // walk from the right finds in X-Forwarded-For, as for the `ip` key.
    let gw = gateway("trusted_proxies = [\"127.0.0.1\"]\n", &routes).await;
    assert_eq!(send(&client, forged(&gw)).await.status, StatusCode::OK);
    let seen = upstream.seen().pop().unwrap().headers;
    let all = |name: &str| -> Vec<&str> {
        seen.get_all(name)
            .iter()
            .map(|v| v.to_str().unwrap())
            .collect()
    };
    assert_eq!(all("x-real-ip"), ["203.0.113.9"]);
    assert!(all("x_real_ip").is_empty() && all("x_forwarded_for").is_empty());
    assert_eq!(
        all("forwarded"),
        ["for=6.6.6.6;proto=https, for=\"[2001:db8::6]\", for=127.0.0.1"]
    );
    assert_eq!(all("x-forwarded-for"), ["6.6.6.6, 203.0.113.9, 127.0.0.1"]);
    gw.stop().await.unwrap();
}

// ---------------------------------------------------------------------------------------
// Metrics

#[cfg(feature = "metrics")]
#[tokio::test]
async fn metrics_count_outcomes_per_route() {
    let port = closed_port().await;
    let text = format!(
        "listen = \"127.0.0.1:0\"\nadmin_listen = \"127.0.0.1:0\"\n{}{}",
        route("/metered", None, Some(("ip", "sliding_window", 2, "1h"))),
        route(
            "/metered-key",
            Some(&format!("http://127.0.0.1:{port}")),
            Some(("header:x-k", "gcra", 5, "1h"))
        ),
    );
    let gw = server::start(Config::parse(&text).unwrap()).await.unwrap();
    let client = client();
    assert_eq!(
        statuses(&client, &gw, &["/metered"; 3]).await,
        [200, 200, 429]
    );
    assert_eq!(statuses(&client, &gw, &["/metered-key"]).await, [400]);
    let request = http::Request::get(url(&gw, "/metered-key"))
        .header("x-k", "1")
        .body(Body::empty())
        .unwrap();
    assert_eq!(send(&client, request).await.status, StatusCode::BAD_GATEWAY);

    let admin = gw.admin_addr().unwrap();
    let page = get(&client, &format!("http://{admin}/metrics")).await;
    assert_eq!(page.status, StatusCode::OK);
    let page = page.text().to_owned();
    let value = |name: &str, labels: &[&str]| -> Option<f64> {
        page.lines()
            .filter(|line| line.starts_with(&format!("{name}{{")))
            .find(|line| labels.iter().all(|l| line.contains(l)))
            .and_then(|line| line.rsplit(' ').next()?.parse().ok())
    };
    let requests = "tollgate_requests_total";
    assert_eq!(
        value(requests, &["route=\"/metered\"", "outcome=\"allowed\""]),
        Some(2.0),
        "{page}"
    );
    assert_eq!(
        value(requests, &["route=\"/metered\"", "outcome=\"denied\""]),
        Some(1.0)
    );
    assert_eq!(
        value(
            requests,
            &["route=\"/metered-key\"", "outcome=\"key_missing\""]
        ),
        Some(1.0)
    );
    assert_eq!(
        value(requests, &["route=\"/metered-key\"", "outcome=\"allowed\""]),
        Some(1.0)
    );
    assert_eq!(
        value("tollgate_decision_seconds_count", &["route=\"/metered\""]),
        Some(3.0),
        "{page}"
    );
    assert!(
        value(
            "tollgate_decision_seconds_bucket",
            &["route=\"/metered\"", "le=\"+Inf\""]
        )
        .is_some()
    );
    assert_eq!(
        value(
            "tollgate_gateway_upstream_errors_total",
            &["route=\"/metered-key\""]
        ),
        Some(1.0)
    );
    gw.stop().await.unwrap();
}

/// A client's broken body (a malformed chunk, a hang-up mid-body) is its own fault: never
/// a 502, and never counted or logged as an upstream failure (any client could fake
/// upstream-down alerts).
#[cfg(feature = "metrics")]
#[tokio::test]
async fn a_broken_request_body_is_not_an_upstream_failure() {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};

    let upstream = Upstream::start().await;
    let text = format!(
        "listen = \"127.0.0.1:0\"\nadmin_listen = \"127.0.0.1:0\"\n{}",
        route("/broken", Some(&upstream.url()), None)
    );
    let gw = server::start(Config::parse(&text).unwrap()).await.unwrap();
    let send_raw = |request: &'static [u8], hang_up: bool| {
        let addr = gw.addr();
        async move {
            let mut stream = tokio::net::TcpStream::connect(addr).await.unwrap();
            stream.write_all(request).await.unwrap();
            if hang_up {
                stream.shutdown().await.unwrap();
            }
            let mut answer = Vec::new();
            let _ = tokio::time::timeout(TIMEOUT, stream.read_to_end(&mut answer)).await;
            String::from_utf8_lossy(&answer).into_owned()
        }
    };
    let malformed = send_raw(
        b"POST /broken HTTP/1.1\r\nHost: gw\r\nTransfer-Encoding: chunked\r\n\r\n\
          5\r\nhello\r\nzz\r\n\r\n",
        false,
    )
    .await;
    assert!(malformed.starts_with("HTTP/1.1 400"), "{malformed:?}");
    // Trailers far beyond any header limit (64 KiB in one field) after a good chunk.
    let oversized: &'static [u8] = {
        let mut request =
            b"POST /broken HTTP/1.1\r\nHost: gw\r\nTransfer-Encoding: chunked\r\n\r\n\
                            5\r\nhello\r\n0\r\nX-Big: "
                .to_vec();
        request.extend(std::iter::repeat_n(b'a', 64 * 1024));
        request.extend(b"\r\n\r\n");
        request.leak()
    };
    let trailers = send_raw(oversized, false).await;
    assert!(!trailers.starts_with("HTTP/1.1 502"), "{trailers:?}");
    // Half a body, then the client's side of the connection closes.
    send_raw(
        b"POST /broken HTTP/1.1\r\nHost: gw\r\nContent-Length: 100\r\n\r\nhalf",
        true,
    )
    .await;
    // A whole request still reaches the upstream.
    let ok = get(&client(), &url(&gw, "/broken")).await;
    assert_eq!(ok.status, StatusCode::OK);

    let admin = gw.admin_addr().unwrap();
    let page = get(&client(), &format!("http://{admin}/metrics")).await;
    let page = page.text();
    assert!(
        !page.contains("tollgate_gateway_upstream_errors_total{"),
        "a client's body counted as an upstream failure:\n{page}"
    );
    gw.stop().await.unwrap();
}

/// `shadow = true` on a limit and on a route: never a 429 from a shadow limit, the
/// enforced limit next to it counts as without it, and the metrics show `would_reject`.
#[cfg(feature = "metrics")]
#[tokio::test]
async fn shadow_limits_never_answer_429_and_show_as_would_reject() {
    let limit = |limit: u32, shadow: bool| {
        format!(
            "[[routes.limits]]\nkey = \"ip\"\nalgorithm = \"fixed_window\"\nlimit = {limit}\n\
             window = \"1h\"\nshadow = {shadow}\n"
        )
    };
    let text = format!(
        "listen = \"127.0.0.1:0\"\nadmin_listen = \"127.0.0.1:0\"\n\
         [[routes]]\npath = \"/mixed\"\n{}{}\
         [[routes]]\npath = \"/watched\"\nshadow = true\n{}",
        limit(4, false),
        limit(2, true),
        limit(1, false),
    );
    let gw = server::start(Config::parse(&text).unwrap()).await.unwrap();
    let client = client();
    assert_eq!(
        statuses(&client, &gw, &["/mixed"; 6]).await,
        [200, 200, 200, 200, 429, 429]
    );
    assert_eq!(
        statuses(&client, &gw, &["/watched"; 4]).await,
        [200, 200, 200, 200]
    );
    // The enforced limit's fields only: it counted the requests the shadow one would
    // have rejected.
    let last = get(&client, &url(&gw, "/mixed")).await;
    let fields = last.headers["ratelimit-policy"]
        .to_str()
        .unwrap()
        .to_owned();
    assert!(
        fields.contains("q=4") && !fields.contains("q=2"),
        "{fields}"
    );

    let admin = gw.admin_addr().unwrap();
    let page = get(&client, &format!("http://{admin}/metrics")).await;
    let page = page.text().to_owned();
    let count = |route: &str, outcome: &str| -> u64 {
        let labels = format!("route=\"{route}\",outcome=\"{outcome}\"");
        page.lines()
            .find(|line| line.starts_with("tollgate_requests_total{") && line.contains(&labels))
            .map_or(0, |line| line.rsplit(' ').next().unwrap().parse().unwrap())
    };
    assert_eq!(count("/mixed", "allowed"), 2, "{page}");
    assert_eq!(count("/mixed", "would_reject"), 2, "{page}");
    assert_eq!(count("/mixed", "denied"), 3, "{page}");
    assert_eq!(count("/watched", "allowed"), 1, "{page}");
    assert_eq!(count("/watched", "would_reject"), 3, "{page}");
    assert_eq!(count("/watched", "denied"), 0, "{page}");
    gw.stop().await.unwrap();
}

// ---------------------------------------------------------------------------------------
// Redis

#[cfg(feature = "redis")]
mod redis {
    use super::*;
    use support::RedisServer;

    /// `[store]` on `redis`, under a prefix of its own.
    fn store(redis: &RedisServer, prefix: &str) -> String {
        format!(
            "[store]\nbackend = \"redis\"\nurl = {:?}\nprefix = {prefix:?}\ntimeout_ms = 2000\n",
            redis.url()
        )
    }

    /// `leases = true`: a hot global key is decided from leased units (Redis counts more
    /// than was spent while the gateway runs), and a graceful stop gives them back.
    #[tokio::test]
    async fn redis_leases_spend_locally_and_go_back_on_shutdown() {
        let redis = RedisServer::start();
        let store = store(&redis, "leases") + "leases = true\n";
        let routes = r#"
            [[routes]]
            path = "/"
            [[routes.limits]]
            key = "global"
            algorithm = "fixed_window"
            limit = 1000
            window = "1h"
        "#;
        let gw = gateway(&store, routes).await;
        let client = client();
        for _ in 0..60 {
            assert_eq!(get(&client, &url(&gw, "/")).await.status, StatusCode::OK);
        }
        let keys = redis.cli(&["--scan", "--pattern", "leases:*"]).unwrap();
        let key = keys.lines().next().unwrap().trim().to_owned();
        let counted = || -> u64 {
            let value = redis.cli(&["GET", &key]).unwrap();
            u64::from(support::fixed_window_count(&value))
        };
        assert!(counted() > 60, "{}", counted());
        gw.stop().await.unwrap();
        assert_eq!(counted(), 60);
    }

    #[test]
    fn invalid_leases_are_rejected_naming_the_field() {
        let with = |backend: &str, leases: &str| {
            format!("listen = \"127.0.0.1:0\"\n[store]\n{backend}\nleases = {leases}\n")
        };
        let redis = "backend = \"redis\"\nurl = \"redis://127.0.0.1:6379\"";
        for ok in [
            "true",
            "false",
            "{ period = \"200ms\", max_fraction = 0.05, idle = \"2s\" }",
        ] {
            let config = Config::parse(&with(redis, ok)).unwrap();
            assert_eq!(config.store.leases.is_some(), ok != "false", "{ok}");
        }
        for (backend, leases, field) in [
            ("", "true", "store.leases:"),
            (redis, "{ max_fraction = 0.9 }", "store.leases.max_fraction"),
            (redis, "{ period = \"soon\" }", "store.leases.period"),
            (redis, "{ idle = \"1ms\" }", "store.leases.idle"),
        ] {
            let error = Config::parse(&with(backend, leases))
                .unwrap_err()
                .to_string();
            assert!(error.contains(field), "{leases}: {error}");
        }
    }

    #[tokio::test]
    async fn redis_per_route_limits() {
        let redis = RedisServer::start();
        per_route_limits(&store(&redis, "routes")).await;
    }

    #[tokio::test]
    async fn redis_normalised_paths_cannot_skip_limits() {
        let redis = RedisServer::start();
        normalised_paths_cannot_skip_limits(&store(&redis, "paths")).await;
    }

    #[tokio::test]
    async fn redis_header_and_global_keys() {
        let redis = RedisServer::start();
        header_and_global_keys(&store(&redis, "keys")).await;
    }

    #[tokio::test]
    async fn redis_a_delayed_route_waits_instead_of_429() {
        let redis = RedisServer::start();
        a_delayed_route_waits_instead_of_429(&store(&redis, "delay")).await;
    }

    #[tokio::test]
    async fn redis_a_delayed_route_serves_waiters_in_order() {
        let redis = RedisServer::start();
        let calls = || redis.script_calls();
        a_delayed_route_serves_waiters_in_order(&store(&redis, "delay"), Some(&calls)).await;
    }

    #[tokio::test]
    async fn redis_max_in_flight_holds_streaming_responses() {
        let redis = RedisServer::start();
        max_in_flight_holds_streaming_responses(&store(&redis, "inflight")).await;
        // The permits were taken in Redis (ZADD runs only in the in-flight scripts here).
        assert!(redis.calls("zadd") >= 4, "{}", redis.calls("zadd"));
    }

    #[tokio::test]
    async fn redis_a_lockout_blocks_the_client() {
        let redis = RedisServer::start();
        a_lockout_blocks_the_client(&store(&redis, "lockout")).await;
    }

    /// Header keys are hashed by default, so API keys never appear in Redis key names;
    /// `hash_header_keys = false` stores them as they are.
    #[tokio::test]
    async fn redis_header_keys_are_hashed_by_default() {
        let redis = RedisServer::start();
        header_and_global_keys(&store(&redis, "hashed")).await;
        header_and_global_keys(&(store(&redis, "plain") + "hash_header_keys = false\n")).await;
        let hashed = redis.cli(&["--scan", "--pattern", "hashed:*"]).unwrap();
        assert!(hashed.contains("hashed:{header:x-api-key|#"), "{hashed}");
        let plain = redis.cli(&["--scan", "--pattern", "plain:*"]).unwrap();
        for key in ["k1", "k2"] {
            assert!(!hashed.contains(&format!("|{key}}}")), "{hashed}");
            assert!(
                plain.contains(&format!("plain:{{header:x-api-key|{key}}}")),
                "{plain}"
            );
        }
    }

    #[tokio::test]
    async fn redis_same_key_limits_are_all_or_nothing() {
        let redis = RedisServer::start();
        same_key_limits_are_all_or_nothing(&store(&redis, "multi")).await;
    }

    /// Two gateways on one Redis share one budget: exactly `limit` pass in total, whichever
    /// instance the requests reach.
    #[tokio::test]
    async fn two_gateways_on_one_redis_enforce_one_combined_limit() {
        let redis = RedisServer::start();
        let upstream = Upstream::start().await;
        let routes = route(
            "/api",
            Some(&upstream.url()),
            Some(("ip", "sliding_window", 5, "1h")),
        );
        let store = store(&redis, "shared");
        let one = gateway(&store, &routes).await;
        let two = gateway(&store, &routes).await;
        let client = client();
        let mut allowed = 0;
        for i in 0..12 {
            let gw = if i % 2 == 0 { &one } else { &two };
            match get(&client, &url(gw, "/api")).await.status {
                StatusCode::OK => allowed += 1,
                StatusCode::TOO_MANY_REQUESTS => {}
                other => panic!("unexpected {other}"),
            }
        }
        assert_eq!(allowed, 5);
        assert_eq!(upstream.seen().len(), 5);
        // Concurrent requests to both instances: still nothing more.
        let mut tasks = Vec::new();
        for i in 0..20 {
            let client = client.clone();
            let url = url(if i % 2 == 0 { &one } else { &two }, "/api");
            tasks.push(tokio::spawn(async move { get(&client, &url).await.status }));
        }
        for task in tasks {
            assert_eq!(task.await.unwrap(), StatusCode::TOO_MANY_REQUESTS);
        }
        // The keys are the config's: <prefix>:{<client>}:<limit name>...
        let keys = redis.cli(&["--scan", "--pattern", "shared:*"]).unwrap();
        assert!(keys.contains("shared:{ip|127.0.0.1}:r0-l0:"), "{keys}");
        one.stop().await.unwrap();
        two.stop().await.unwrap();
    }

    /// With Redis down, `on_error` decides: deny answers 503, allow lets requests through.
    #[tokio::test]
    async fn failure_policy_applies_when_redis_is_down() {
        let mut redis = RedisServer::start();
        let routes = route("/", None, Some(("ip", "sliding_window", 100, "1h")));
        let deny = store(&redis, "deny").replace("timeout_ms = 2000", "on_error = \"deny\"");
        let allow = store(&redis, "allow").replace("timeout_ms = 2000", "on_error = \"allow\"");
        let deny = gateway(&deny, &routes).await;
        let allow = gateway(&allow, &routes).await;
        let client = client();
        assert_eq!(statuses(&client, &deny, &["/"]).await, [200]);
        redis.kill();
        let reply = get(&client, &url(&deny, "/")).await;
        assert_eq!(reply.status, StatusCode::SERVICE_UNAVAILABLE);
        assert_eq!(reply.retry_after(), Some(1));
        let reply = get(&client, &url(&allow, "/")).await;
        assert_eq!((reply.status, reply.text()), (StatusCode::OK, "ok"));
        // Passed by the policy, not decided by Redis.
        assert!(
            !reply.headers.contains_key("ratelimit"),
            "{:?}",
            reply.headers
        );
    }

    /// The circuit opens while Redis stalls; the client of the probe after the cooldown
    /// hangs up (so the gateway drops the probe mid-check); Redis resumes. The limit must
    /// be enforced again: an abandoned probe once disabled limiting for good, every later
    /// request passing unlimited by `on_error = "allow"`.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_client_hanging_up_on_the_probe_does_not_disable_limiting() {
        let redis = RedisServer::start();
        let upstream = Upstream::start().await;
        let routes = route(
            "/api",
            Some(&upstream.url()),
            Some(("ip", "fixed_window", 3, "1h")),
        );
        let store = store(&redis, "probe").replace(
            "timeout_ms = 2000",
            "timeout_ms = 200\non_error = \"allow\"",
        );
        let gateway = gateway(&store, &routes).await;
        let client = client();
        let api = url(&gateway, "/api");
        // Redis stalls for 4 s.
        let port = redis.port().to_string();
        let sleeper = std::thread::spawn(move || {
            std::process::Command::new("redis-cli")
                .args(["-p", &port, "DEBUG", "SLEEP", "4"])
                .output()
                .unwrap()
        });
        tokio::time::sleep(Duration::from_millis(300)).await;
        // Failing open until the circuit opens: then answers come without the timeout.
        let mut opened = false;
        for _ in 0..20 {
            let started = std::time::Instant::now();
            let reply = get(&client, &api).await;
            assert_eq!(reply.status, StatusCode::OK);
            assert!(
                !reply.headers.contains_key("ratelimit"),
                "{:?}",
                reply.headers
            );
            if started.elapsed() < Duration::from_millis(100) {
                opened = true;
                break;
            }
        }
        assert!(opened, "the circuit never opened");
        // After the cooldown (500 ms), the next request probes; its client hangs up.
        tokio::time::sleep(Duration::from_millis(600)).await;
        let mut probe = tokio::net::TcpStream::connect(gateway.addr())
            .await
            .unwrap();
        tokio::io::AsyncWriteExt::write_all(
            &mut probe,
            b"GET /api HTTP/1.1\r\nhost: gateway\r\n\r\n",
        )
        .await
        .unwrap();
        tokio::time::sleep(Duration::from_millis(50)).await;
        drop(probe);
        assert!(
            !sleeper.is_finished(),
            "Redis woke up before the probe hung up"
        );
        sleeper.join().unwrap();
        // Redis is back: limiting resumes (generous bound: about one cooldown)...
        let started = std::time::Instant::now();
        let mut statuses = Vec::new();
        while started.elapsed() < Duration::from_secs(5) {
            let reply = get(&client, &api).await;
            statuses.push(reply.status);
            if reply.status == StatusCode::TOO_MANY_REQUESTS {
                break;
            }
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
        // ...and 3 per hour holds again: 429s appear, and stay.
        assert_eq!(
            statuses.last(),
            Some(&StatusCode::TOO_MANY_REQUESTS),
            "{} requests passed unlimited after Redis resumed",
            statuses.len()
        );
        for _ in 0..5 {
            assert_eq!(
                get(&client, &api).await.status,
                StatusCode::TOO_MANY_REQUESTS
            );
        }
        gateway.stop().await.unwrap();
    }

    /// Two gateways on one Redis Cluster share one budget, too; the keys spread over the
    /// masters, one client's limits on one of them.
    #[cfg(feature = "cluster")]
    #[tokio::test]
    async fn two_gateways_on_a_redis_cluster_enforce_one_combined_limit() {
        let cluster = support::cluster::RedisCluster::start();
        let upstream = Upstream::start().await;
        let mut routes = route(
            "/api",
            Some(&upstream.url()),
            Some(("header:x-client", "sliding_window", 5, "1h")),
        );
        routes += "[[routes.limits]]\nkey = \"header:x-client\"\nalgorithm = \"gcra\"\n\
                   limit = 100\nwindow = \"1h\"\n";
        let nodes: Vec<String> = cluster.urls();
        let store = format!(
            "[store]\nbackend = \"redis-cluster\"\nnodes = {nodes:?}\nprefix = \"shared\"\n\
             timeout_ms = 2000\non_error = \"deny\"\n"
        );
        let one = gateway(&store, &routes).await;
        let two = gateway(&store, &routes).await;
        let client = client();
        let request = |gw: &Running, who: &str| {
            http::Request::get(url(gw, "/api"))
                .header("x-client", who)
                .body(Body::empty())
                .unwrap()
        };
        // Clients enough to land on every master; each gets exactly 5, across both.
        let clients: Vec<String> = (0..30).map(|i| format!("client-{i}")).collect();
        for who in &clients {
            let mut allowed = 0;
            for i in 0..8 {
                let gw = if i % 2 == 0 { &one } else { &two };
                match send(&client, request(gw, who)).await.status {
                    StatusCode::OK => allowed += 1,
                    StatusCode::TOO_MANY_REQUESTS => {}
                    other => panic!("unexpected {other} for {who}"),
                }
            }
            assert_eq!(allowed, 5, "{who}");
        }
        assert_eq!(upstream.seen().len(), 5 * clients.len());
        // Concurrent requests to both instances: still nothing more.
        let mut tasks = Vec::new();
        for i in 0..20 {
            let client = client.clone();
            let request = request(if i % 2 == 0 { &one } else { &two }, "client-0");
            tasks.push(tokio::spawn(
                async move { send(&client, request).await.status },
            ));
        }
        for task in tasks {
            assert_eq!(task.await.unwrap(), StatusCode::TOO_MANY_REQUESTS);
        }
        let masters = cluster.masters();
        assert_eq!(masters.len(), 3);
        for master in masters {
            let keys = cluster
                .cli(master, &["--scan", "--pattern", "shared:*"])
                .unwrap();
            assert!(!keys.is_empty(), "no keys on node {master}");
        }
        // Header keys are hashed by default: the tag is the digest of `client-0`.
        use tollgate::key::KeyExtractor as _;
        let tag = tollgate::key::HeaderKey::new("x-client")
            .unwrap()
            .hashed()
            .extract(
                &http::Request::get("/")
                    .header("x-client", "client-0")
                    .body(())
                    .unwrap(),
            )
            .unwrap();
        let keys = cluster
            .cli(
                cluster.node_for_key(&format!("shared:{{{tag}}}:x")),
                &["--scan"],
            )
            .unwrap();
        assert!(keys.contains(&format!("shared:{{{tag}}}:r0-l0:")), "{keys}");
        assert!(keys.contains(&format!("shared:{{{tag}}}:r0-l1:")), "{keys}");
        assert!(!keys.contains("client-"), "{keys}");
        assert!(cluster.assert_every_key_expires() >= 2 * clients.len());
        one.stop().await.unwrap();
        two.stop().await.unwrap();
    }

    #[cfg(feature = "cluster")]
    #[tokio::test]
    async fn unreachable_redis_cluster_fails_at_startup() {
        let port = closed_port().await;
        let text = format!(
            "listen = \"127.0.0.1:0\"\n[store]\nbackend = \"redis-cluster\"\n\
             nodes = [\"redis://127.0.0.1:{port}\"]"
        );
        let error = server::start(Config::parse(&text).unwrap())
            .await
            .unwrap_err();
        assert!(error.to_string().contains("store.nodes"), "{error}");
    }

    #[tokio::test]
    async fn unreachable_redis_fails_at_startup() {
        let port = closed_port().await;
        let text = format!(
            "listen = \"127.0.0.1:0\"\n[store]\nbackend = \"redis\"\n\
             url = \"redis://127.0.0.1:{port}\""
        );
        let error = server::start(Config::parse(&text).unwrap())
            .await
            .unwrap_err();
        assert!(error.to_string().contains("store.url"), "{error}");
        // The cause is named, not only "unavailable".
        assert!(error.to_string().contains("refused"), "{error}");
    }

    /// `connect = "background"`: the gateway starts while nothing listens on the Redis
    /// port, `on_error` answers (here 503, fail closed), and once a redis-server is up on
    /// that port the limits are decided there: exactly `limit` pass, then 429.
    #[tokio::test]
    async fn connect_in_the_background_starts_before_redis_and_limits_once_it_is_up() {
        let port = support::free_port();
        let store = format!(
            "[store]\nbackend = \"redis\"\nurl = \"redis://127.0.0.1:{port}\"\n\
             prefix = \"later\"\non_error = \"deny\"\nconnect = \"background\"\n"
        );
        let routes = route("/", None, Some(("global", "fixed_window", 3, "1h")));
        let gw = gateway(&store, &routes).await;
        let client = client();
        for _ in 0..10 {
            let reply = get(&client, &url(&gw, "/")).await;
            assert_eq!(reply.status, StatusCode::SERVICE_UNAVAILABLE);
            assert_eq!(reply.retry_after(), Some(1));
        }
        let redis = RedisServer::start_on(port, &[]);
        let deadline = std::time::Instant::now() + Duration::from_secs(15);
        let first = loop {
            let reply = get(&client, &url(&gw, "/")).await;
            if reply.status != StatusCode::SERVICE_UNAVAILABLE {
                break reply;
            }
            assert!(
                std::time::Instant::now() < deadline,
                "the gateway did not use Redis within 15 s of it coming up"
            );
            tokio::time::sleep(Duration::from_millis(20)).await;
        };
        assert_eq!(first.status, StatusCode::OK);
        assert_eq!(
            statuses(&client, &gw, &["/", "/", "/"]).await,
            [200, 200, 429]
        );
        let keys = redis.cli(&["--scan", "--pattern", "later:*"]).unwrap();
        let key = keys.lines().next().unwrap().trim().to_owned();
        let value = redis.cli(&["GET", &key]).unwrap();
        assert_eq!(support::fixed_window_count(&value), 3);
        gw.stop().await.unwrap();
    }

    #[test]
    fn store_connect_is_validated_naming_the_field() {
        let with = |backend: &str, connect: &str| {
            format!("listen = \"127.0.0.1:0\"\n[store]\n{backend}\nconnect = {connect:?}\n")
        };
        let redis = "backend = \"redis\"\nurl = \"redis://127.0.0.1:6379\"";
        let default = Config::parse(&format!("listen = \"127.0.0.1:0\"\n[store]\n{redis}\n"));
        assert!(!default.unwrap().store.background);
        assert!(
            !Config::parse(&with(redis, "at_start"))
                .unwrap()
                .store
                .background
        );
        assert!(
            Config::parse(&with(redis, "background"))
                .unwrap()
                .store
                .background
        );
        let mut refused = vec![("", "background"), (redis, "later")];
        let cluster = "backend = \"redis-cluster\"\nnodes = [\"redis://127.0.0.1:7000\"]";
        if cfg!(feature = "cluster") {
            refused.push((cluster, "background"));
        }
        for (backend, connect) in refused {
            let error = Config::parse(&with(backend, connect))
                .unwrap_err()
                .to_string();
            assert!(error.contains("store.connect"), "{connect}: {error}");
        }
    }
}

// ---------------------------------------------------------------------------------------
// Redis as it is run: TLS, ACL users, Sentinel

/// One example config per kind of Redis (stores/), valid as documented.
#[cfg(all(feature = "tls", feature = "sentinel", feature = "cluster"))]
#[test]
fn the_example_store_configs_are_valid() {
    use config::Backend;
    let root = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("stores");
    let load = |name: &str| {
        Config::load(&root.join(name)).unwrap_or_else(|e| panic!("stores/{name}: {e}"))
    };
    let tls = load("tls.toml");
    assert!(matches!(&tls.store.backend, Backend::Redis { url } if url.starts_with("rediss://")));
    assert!(tls.store.tls.ca_file.is_some() && tls.store.tls.key_file.is_some());
    let acl = load("acl.toml");
    assert!(matches!(&acl.store.backend, Backend::Redis { url } if url.contains("tollgate:")));
    let sentinel = load("sentinel.toml");
    assert!(matches!(&sentinel.store.backend, Backend::RedisSentinel(s) if s.sentinels.len() == 3));
    let cluster = load("cluster.toml");
    assert!(matches!(&cluster.store.backend, Backend::RedisCluster { nodes } if nodes.len() == 2));
}

#[test]
fn invalid_store_connection_fields_are_rejected_naming_the_field() {
    let store = |fields: &str| format!("listen = \"127.0.0.1:0\"\n[store]\n{fields}\n");
    let cases: Vec<(String, &[&str])> = vec![
        (
            store("backend = \"redis-sentinel\"\nmaster_name = \"m\""),
            &["store.sentinels", "at least one"],
        ),
        (
            store("backend = \"redis-sentinel\"\nsentinels = [\"redis://127.0.0.1:26379\"]"),
            &["store.master_name", "required"],
        ),
        (
            store(
                "backend = \"redis-sentinel\"\nsentinels = [\"127.0.0.1:26379\"]\n\
                 master_name = \"m\"",
            ),
            &["store.sentinels[0]", "\"127.0.0.1:26379\""],
        ),
        (
            store(
                "backend = \"redis-sentinel\"\nsentinels = [\"redis://127.0.0.1:26379\"]\n\
                 master_name = \"m\"\nmaster_username = \"u\"",
            ),
            &["store.master_password", "master_username"],
        ),
        (
            store("backend = \"memory\"\ntls_cert_file = \"c.crt\""),
            &["store.tls_key_file", "required"],
        ),
        (
            store("backend = \"memory\"\ntls_key_file = \"c.key\""),
            &["store.tls_cert_file", "required"],
        ),
        (
            store("backend = \"memory\"\ntls_ca_file = \"\""),
            &["store.tls_ca_file", "file path"],
        ),
        (
            store("backend = \"nope\""),
            &["store.backend", "redis-sentinel", "\"nope\""],
        ),
    ];
    #[cfg(feature = "redis")]
    let cases = {
        let mut cases = cases;
        cases.push((
            store(
                "backend = \"redis\"\nurl = \"redis://127.0.0.1:6379\"\n\
                 tls_ca_file = \"ca.crt\"",
            ),
            &["store.url", "must be rediss://"],
        ));
        #[cfg(feature = "tls")]
        cases.push((
            store(
                "backend = \"redis\"\nurl = \"rediss://127.0.0.1:6380\"\n\
                 tls_ca_file = \"ca.crt\"",
            ) + "\n[rules]\nsource = \"redis\"",
            &["rules.source", "store.tls_ca_file"],
        ));
        cases
    };
    for (text, expected) in cases {
        let error = Config::parse(&text).unwrap_err().to_string();
        for part in expected {
            assert!(
                error.contains(part),
                "{text}\n-> {error}\n(expected {part:?})"
            );
        }
    }
}

#[cfg(all(feature = "redis", not(feature = "tls")))]
#[test]
fn rediss_without_the_tls_feature_is_a_clear_config_error() {
    let text = "listen = \"127.0.0.1:0\"\n[store]\nbackend = \"redis\"\n\
                url = \"rediss://127.0.0.1:6380\"";
    let error = Config::parse(text).unwrap_err().to_string();
    assert!(
        error.contains("store.url") && error.contains("tls feature"),
        "{error}"
    );
}

#[cfg(not(feature = "sentinel"))]
#[test]
fn redis_sentinel_backend_without_the_feature_is_a_clear_error() {
    let text = "listen = \"127.0.0.1:0\"\n[store]\nbackend = \"redis-sentinel\"\n\
                sentinels = [\"redis://127.0.0.1:26379\"]\nmaster_name = \"m\"";
    let error = Config::parse(text).unwrap_err().to_string();
    assert!(
        error.contains("store.backend") && error.contains("sentinel feature"),
        "{error}"
    );
}

#[cfg(feature = "redis")]
mod redis_as_run {
    use super::*;
    use support::{RedisServer, acl};

    #[tokio::test]
    async fn as_the_documented_acl_user() {
        let redis = RedisServer::start();
        let url = acl::least_privilege_user(&redis, "tollgate");
        per_route_limits(&format!(
            "[store]\nbackend = \"redis\"\nurl = {url:?}\ntimeout_ms = 2000\n"
        ))
        .await;
    }

    /// The password never reaches the logs or the startup error.
    #[tokio::test]
    async fn a_wrong_password_fails_at_startup_without_showing_it() {
        let redis = RedisServer::start();
        acl::least_privilege_user(&redis, "tollgate");
        let text = format!(
            "listen = \"127.0.0.1:0\"\n[store]\nbackend = \"redis\"\n\
             url = \"redis://tollgate:not-the-password@127.0.0.1:{}\"",
            redis.port()
        );
        let error = server::start(Config::parse(&text).unwrap())
            .await
            .unwrap_err()
            .to_string();
        assert!(error.contains("store.url"), "{error}");
        assert!(!error.contains("not-the-password"), "{error}");
    }

    #[cfg(feature = "tls")]
    #[tokio::test]
    async fn over_tls_with_a_private_ca_and_a_client_certificate() {
        let tls = Arc::new(support::tls::TlsFiles::generate());
        let redis = RedisServer::start_tls(&tls);
        per_route_limits(&format!(
            "[store]\nbackend = \"redis\"\nurl = {:?}\ntimeout_ms = 2000\n\
             tls_ca_file = {:?}\ntls_cert_file = {:?}\ntls_key_file = {:?}\n",
            redis.url(),
            tls.path("ca.crt"),
            tls.path("client.crt"),
            tls.path("client.key"),
        ))
        .await;
    }

    #[cfg(feature = "tls")]
    #[tokio::test]
    async fn a_missing_certificate_file_fails_at_startup_naming_the_field() {
        let tls = Arc::new(support::tls::TlsFiles::generate());
        let redis = RedisServer::start_tls(&tls);
        let text = format!(
            "listen = \"127.0.0.1:0\"\n[store]\nbackend = \"redis\"\nurl = {:?}\n\
             tls_ca_file = \"/nonexistent/ca.crt\"",
            redis.url()
        );
        let error = server::start(Config::parse(&text).unwrap())
            .await
            .unwrap_err()
            .to_string();
        assert!(
            error.contains("store.tls_ca_file") && error.contains("/nonexistent/ca.crt"),
            "{error}"
        );
    }

    #[cfg(all(feature = "tls", feature = "cluster"))]
    #[tokio::test]
    async fn on_a_tls_cluster() {
        let tls = Arc::new(support::tls::TlsFiles::generate());
        let cluster = support::cluster::RedisCluster::start_tls(&tls);
        per_route_limits(&format!(
            "[store]\nbackend = \"redis-cluster\"\nnodes = {:?}\ntimeout_ms = 2000\n\
             tls_ca_file = {:?}\ntls_cert_file = {:?}\ntls_key_file = {:?}\n",
            cluster.urls(),
            tls.path("ca.crt"),
            tls.path("client.crt"),
            tls.path("client.key"),
        ))
        .await;
    }

    #[cfg(feature = "sentinel")]
    #[tokio::test]
    async fn through_sentinel() {
        let setup = support::sentinel::SentinelSetup::start();
        per_route_limits(&format!(
            "[store]\nbackend = \"redis-sentinel\"\nsentinels = {:?}\nmaster_name = {:?}\n\
             timeout_ms = 2000\n",
            setup.sentinel_urls(),
            support::sentinel::MASTER_NAME,
        ))
        .await;
    }
}
