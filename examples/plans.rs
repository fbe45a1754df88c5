//! Limits chosen per request: an axum app whose clients are on a plan, `free`, `paid` or
//! `internal`, named by the `x-plan` header, each API key (`x-api-key`) limited by its
//! plan's limits. In-memory store.
//!
//! ```text
//! cargo run --example plans                    # serve on 127.0.0.1:3000
//! cargo run --example plans -- 127.0.0.1:4000  # serve elsewhere
//! cargo run --example plans -- --demo          # serve on a free port, call it, exit
//! ```
//!
//! `curl -i -H 'x-api-key: k1' 127.0.0.1:3000` four times: `free` allows 3 a minute, so
//! the fourth is a 429. With `-H 'x-plan: paid'` the same key has 10 a minute, with
//! `-H 'x-plan: internal'` no limit (and no rate-limit fields).

use std::time::Duration;

use axum::{
    Router,
    http::{HeaderName, Request, Response, StatusCode},
    routing::get,
};
use http_body_util::Empty;
use hyper::body::Bytes;
use hyper_util::{client::legacy::Client, rt::TokioExecutor};
use tollgate::{
    Limit, RateLimitLayer,
    key::HeaderKey,
    plan::{Plan, Plans},
};

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

    // `free`: at most 3 in any minute (a sliding window: no 6 around a minute's boundary).
    let free = Limit::sliding_window(3, Duration::from_secs(60))?;
    let plans = Plans::new([
        Plan::new("free", [free.clone()])?,
        Plan::new(
            "paid",
            [
                Limit::per_minute(10)?,
                Limit::token_bucket(5, Duration::from_secs(1))?,
            ],
        )?,
        Plan::unlimited("internal")?,
    ])?
    // No header, or a plan name that is not one of these: `free`, never unlimited.
    .with_default("free")?
    // **Only behind a proxy or auth layer that sets `x-plan` itself** and drops the
    // client's: a client that could send it would choose its own plan. An auth layer's
    // extension (`Plans::with_resolver`) or a database lookup by key (`PlanLookup`) work
    // the same way.
    .with_header(HeaderName::from_static("x-plan"));
    // The layer's own limit applies to requests without a plan: never here, as there is a
    // default plan. Each plan's limits keep their own state per key.
    let limits = RateLimitLayer::new(free)
        .with_key(HeaderKey::new("x-api-key")?.hashed())
        .with_plans(plans);

    let app = Router::new()
        .route("/", get(|| async { "hello\n" }))
        .layer(limits);
    let listener = tokio::net::TcpListener::bind(addr).await?;
    let addr = listener.local_addr()?;
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
    let get = |plan: Option<&str>| {
        let mut request = Request::get(format!("http://{addr}/")).header("x-api-key", "k1");
        if let Some(plan) = plan {
            request = request.header("x-plan", plan);
        }
        client.request(request.body(Empty::new()).expect("a valid request"))
    };

    let (mut free, mut paid) = (Vec::new(), Vec::new());
    for n in 1..=4 {
        free.push(print(&format!("free #{n}"), &get(None).await?).0);
    }
    // The same key on `paid` starts with `paid`'s full budget.
    for n in 1..=4 {
        paid.push(print(&format!("paid #{n}"), &get(Some("paid")).await?).0);
    }
    let internal = print("internal", &get(Some("internal")).await?);
    // An unknown plan is the default plan, whose budget k1 has spent.
    let unknown = print("x-plan: gold", &get(Some("gold")).await?).0;
    stop.send(()).ok();
    serving.await??;

    let (ok, denied) = (StatusCode::OK, StatusCode::TOO_MANY_REQUESTS);
    if free != [ok, ok, ok, denied]
        || paid.contains(&denied)
        || internal != (ok, false)
        || unknown != denied
    {
        return Err("the plans did not limit as configured".into());
    }
    Ok(())
}

/// Prints a response's status and rate-limit fields; the status and whether it had any.
fn print<B>(what: &str, response: &Response<B>) -> (StatusCode, bool) {
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
        "{what:<13} {} | ratelimit: {} | policy: {} | retry-after: {}",
        response.status().as_u16(),
        all("ratelimit"),
        all("ratelimit-policy"),
        all("retry-after"),
    );
    (response.status(), headers.contains_key("ratelimit"))
}
