//! An axum app behind tollgate, on the in-memory store: every route limited per client IP,
//! and `/api` limited more strictly per API key (`x-api-key`, stored hashed).
//!
//! ```text
//! cargo run --example axum                    # serve on 127.0.0.1:3000
//! cargo run --example axum -- 127.0.0.1:4000  # serve elsewhere
//! cargo run --example axum -- --demo          # serve on a free port, call it, exit
//! ```
//!
//! `curl -i -H 'x-api-key: k1' 127.0.0.1:3000/api` four times: the fourth answer is
//! `429 Too Many Requests` with `Retry-After` and the `RateLimit-Policy` and `RateLimit`
//! fields (one line per layer). A call to `/api` without the header gets 400.

use std::{net::SocketAddr, time::Duration};

use axum::{
    Router,
    http::{Request, Response, StatusCode},
    routing::get,
};
use http_body_util::Empty;
use hyper::body::Bytes;
use hyper_util::{client::legacy::Client, rt::TokioExecutor};
use tollgate::{Limit, RateLimitLayer, key::HeaderKey};

type Error = Box<dyn std::error::Error + Send + Sync>;

#[tokio::main]
async fn main() -> Result<(), Error> {
    let arg = std::env::args().nth(1);
    let demo = arg.as_deref() == Some("--demo");
    let addr = match arg.as_deref() {
        None => "127.0.0.1:3000",
        Some("--demo") => "127.0.0.1:0",
        Some(addr) => addr,
    };

    // Every route: each client IP (the default key, read from axum's `ConnectInfo`) gets
    // bursts of 10 requests, refilled at one a second.
    let per_ip =
        RateLimitLayer::new(Limit::token_bucket(10, Duration::from_secs(10))?.with_name("ip")?);
    // `/api` only: at most 3 requests in any minute per API key (a sliding window: a fixed
    // one, `Limit::per_minute`, lets 6 through around a minute's boundary). `hashed()`
    // keeps the key's SHA-256 in the store, not the key; `hashed_with(secret)` (an HMAC)
    // is better still once the store is a Redis that others can read.
    let per_key = RateLimitLayer::new(
        Limit::sliding_window(3, Duration::from_secs(60))?.with_name("api-key")?,
    )
    .with_key(HeaderKey::new("x-api-key")?.hashed());

    let app = Router::new()
        .route("/", get(|| async { "hello\n" }))
        .route("/api", get(|| async { "api\n" }).layer(per_key))
        .layer(per_ip);

    let listener = tokio::net::TcpListener::bind(addr).await?;
    let addr = listener.local_addr()?;
    // Without `ConnectInfo` the per-IP layer has no peer address and answers 500.
    let app = app.into_make_service_with_connect_info::<SocketAddr>();
    if !demo {
        println!("listening on http://{addr}");
        axum::serve(listener, app)
            .with_graceful_shutdown(async {
                tokio::signal::ctrl_c().await.ok();
            })
            .await?;
        return Ok(());
    }

    let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
    let serving = tokio::spawn(
        axum::serve(listener, app)
            .with_graceful_shutdown(async {
                stopped.await.ok();
            })
            .into_future(),
    );
    let client = Client::builder(TokioExecutor::new()).build_http::<Empty<Bytes>>();
    let get = |path: &str, api_key: Option<&str>| {
        let mut request = Request::get(format!("http://{addr}{path}"));
        if let Some(api_key) = api_key {
            request = request.header("x-api-key", api_key);
        }
        client.request(request.body(Empty::new()).expect("a valid request"))
    };

    // Key k1 spends its 3 requests; the 4th is denied by the per-key limit.
    let mut k1 = Vec::new();
    for n in 1..=4 {
        k1.push(print(
            &format!("/api k1 #{n}"),
            &get("/api", Some("k1")).await?,
        ));
    }
    // Another key has its own budget; no key at all is a 400.
    print("/api k2", &get("/api", Some("k2")).await?);
    print("/api no key", &get("/api", None).await?);
    // The client IP has spent 6 of its 10 now: a few more and the per-IP limit denies.
    let mut root = Vec::new();
    for n in 1..=6 {
        root.push(print(&format!("/ #{n}"), &get("/", None).await?));
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
        "{what:<12} {} | ratelimit: {} | policy: {} | retry-after: {}",
        response.status().as_u16(),
        all("ratelimit"),
        all("ratelimit-policy"),
        all("retry-after"),
    );
    response.status()
}
