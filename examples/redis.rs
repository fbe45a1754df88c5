//! An axum app whose limits live in Redis, so that every replica shares one budget: each
//! client IP on every route, and `/api` more strictly per API key (`x-api-key`, stored
//! as an HMAC).
//!
//! ```text
//! export API_KEY_SECRET=...   # the HMAC secret for API keys (the demo has its own)
//! cargo run --example redis --features redis                           # redis://127.0.0.1:6379
//! cargo run --example redis --features redis -- redis://10.0.0.5:6379  # or REDIS_URL=...
//! cargo run --example redis --features redis -- --demo [url]           # call itself, exit
//! ```
//!
//! It serves on 127.0.0.1:3000. Try `curl -i -H 'x-api-key: k1' 127.0.0.1:3000/api` four
//! times, from two terminals running the example, or with `redis-cli MONITOR` beside it.

use std::{net::SocketAddr, time::Duration};

use axum::{
    Router,
    http::{Request, Response, StatusCode},
    routing::get,
};
use http_body_util::Empty;
use hyper::body::Bytes;
use hyper_util::{client::legacy::Client, rt::TokioExecutor};
use tollgate::{FailurePolicy, Limit, RateLimitLayer, key::HeaderKey, store::RedisStore};

type Error = Box<dyn std::error::Error + Send + Sync>;

#[tokio::main]
async fn main() -> Result<(), Error> {
    let mut args: Vec<String> = std::env::args().skip(1).collect();
    let demo = args.first().is_some_and(|arg| arg == "--demo");
    if demo {
        args.remove(0);
    }
    let url = args.pop().or_else(|| std::env::var("REDIS_URL").ok());
    let url = url.as_deref().unwrap_or("redis://127.0.0.1:6379");

    // One connection for both layers. Fails here if Redis cannot be reached at start
    // (`.in_background(true)` would start anyway and connect later).
    let mut store = RedisStore::connect(url).await?;
    if demo {
        // A fresh namespace per run, so that a second run within the minute starts afresh.
        let now = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH)?;
        store = store.with_prefix(&format!("tollgate-demo-{}", now.as_millis()))?;
    }
    // While Redis is down or slower than the timeout (100 ms), each process limits on its
    // own: `Allow` (the default) would let any client flood the API through an outage,
    // and `Deny` would turn a Redis outage into an API outage.
    let on_error = FailurePolicy::local();

    let per_ip =
        RateLimitLayer::new(Limit::token_bucket(10, Duration::from_secs(10))?.with_name("ip")?)
            .with_store(store.clone())
            .with_on_store_error(on_error.clone());
    // In Redis anyone with `MONITOR` or a dump sees key names: keep an HMAC of the API
    // key there, under a secret of yours (from your secret store in real code).
    let secret = match std::env::var("API_KEY_SECRET") {
        Ok(secret) => secret,
        Err(_) if demo => "demo secret".to_owned(),
        Err(_) => return Err("set API_KEY_SECRET, the secret API keys are hashed with".into()),
    };
    // At most 3 in any minute (a sliding window: no 6 around a minute's boundary).
    let per_key = RateLimitLayer::new(
        Limit::sliding_window(3, Duration::from_secs(60))?.with_name("api-key")?,
    )
    .with_key(HeaderKey::new("x-api-key")?.hashed_with(secret))
    .with_store(store)
    .with_on_store_error(on_error);

    let app = Router::new()
        .route("/", get(|| async { "hello\n" }))
        .route("/api", get(|| async { "api\n" }).layer(per_key))
        .layer(per_ip)
        .into_make_service_with_connect_info::<SocketAddr>();

    let addr = if demo {
        "127.0.0.1:0"
    } else {
        "127.0.0.1:3000"
    };
    let listener = tokio::net::TcpListener::bind(addr).await?;
    let addr = listener.local_addr()?;
    let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
    let serve = axum::serve(listener, app).with_graceful_shutdown(async move {
        if demo {
            stopped.await.ok();
        } else {
            tokio::signal::ctrl_c().await.ok();
        }
    });
    if !demo {
        println!("listening on http://{addr}, limits in {url}");
        serve.await?;
        return Ok(());
    }

    let serving = tokio::spawn(serve.into_future());
    let client = Client::builder(TokioExecutor::new()).build_http::<Empty<Bytes>>();
    let get = |path: &str, api_key: &str| {
        let request = Request::get(format!("http://{addr}{path}")).header("x-api-key", api_key);
        client.request(request.body(Empty::new()).expect("a valid request"))
    };
    let mut k1 = Vec::new();
    for n in 1..=4 {
        k1.push(print(&format!("/api k1 #{n}"), &get("/api", "k1").await?));
    }
    print("/api k2", &get("/api", "k2").await?);
    // 5 of the IP's 10 are spent: a few more and the per-IP limit denies.
    let mut root = Vec::new();
    for n in 1..=7 {
        root.push(print(&format!("/ #{n}"), &get("/", "k1").await?));
    }
    stop.send(()).ok();
    serving.await??;

    let denied = StatusCode::TOO_MANY_REQUESTS;
    if k1[3] != denied || !root.contains(&denied) {
        return Err("expected a 429 from each limit".into());
    }
    Ok(())
}

/// Prints a response's status and rate-limit fields.
fn print<B>(what: &str, response: &Response<B>) -> StatusCode {
    let headers = response.headers();
    let all = |name: &str| {
        let values: Vec<_> = headers
            .get_all(name)
            .iter()
            .filter_map(|v| v.to_str().ok())
            .collect();
        if values.is_empty() {
            "-".to_owned()
        } else {
            values.join(", ")
        }
    };
    println!(
        "{what:<12} {} | ratelimit: {} | retry-after: {}",
        response.status().as_u16(),
        all("ratelimit"),
        all("retry-after"),
    );
    response.status()
}
