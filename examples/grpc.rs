//! A tonic gRPC server behind tollgate: the standard health service (`grpc.health.v1`,
//! from `tonic-health`, so no protoc is needed), limited per peer IP and per API key
//! (`x-api-key` metadata).
//!
//! ```text
//! cargo run --example grpc --features tonic                    # serve on 127.0.0.1:50051
//! cargo run --example grpc --features tonic -- 127.0.0.1:6000  # serve elsewhere
//! cargo run --example grpc --features tonic -- --demo          # serve on a free port, call it, exit
//! ```
//!
//! Any gRPC client works, for example `grpc-health-probe -addr 127.0.0.1:50051
//! -rpc-header x-api-key:k1`. Denied calls fail with RESOURCE_EXHAUSTED, a message with the
//! wait in seconds, and `retry-after`, `grpc-retry-pushback-ms` and the `RateLimit` fields in
//! their metadata; calls without an API key fail with UNAUTHENTICATED.

use std::{net::SocketAddr, time::Duration};

use tollgate::{DefaultRejection, GrpcMissingKey, Limit, RateLimitLayer, key::HeaderKey};
use tonic::{
    Code, Request, Status,
    transport::{Channel, Server, server::TcpIncoming},
};
use tonic_health::pb::{HealthCheckRequest, health_client::HealthClient};

type Error = Box<dyn std::error::Error + Send + Sync>;

/// How many calls each API key may make per minute (the demo makes one more).
const PER_KEY_PER_MINUTE: u32 = 5;

#[tokio::main]
async fn main() -> Result<(), Error> {
    let arg = std::env::args().nth(1);
    let demo = arg.as_deref() == Some("--demo");
    let addr: SocketAddr = match arg.as_deref() {
        None => "127.0.0.1:50051".parse()?,
        Some("--demo") => "127.0.0.1:0".parse()?,
        Some(addr) => addr.parse()?,
    };

    let incoming = TcpIncoming::bind(addr)?;
    let addr = incoming.local_addr()?;
    let (_reporter, health) = tonic_health::server::health_reporter();

    // Outer layer: every client IP (tonic's `TcpConnectInfo`, read with the `tonic`
    // feature) gets a bucket of 20 calls refilled at 20 per second.
    let per_ip =
        RateLimitLayer::new(Limit::token_bucket(20, Duration::from_secs(1))?).with_name("ip");
    // Inner layer: each API key gets 5 calls a minute. A call without the key is answered
    // UNAUTHENTICATED, and denied calls tell gRPC retry policies how long to wait.
    let per_key = RateLimitLayer::new(Limit::fixed_window(
        PER_KEY_PER_MINUTE,
        Duration::from_secs(60),
    )?)
    .with_key(HeaderKey::new("x-api-key")?)
    .with_on_rejection(
        DefaultRejection::new()
            .with_grpc_retry_pushback(true)
            .with_grpc_missing_key(GrpcMissingKey::Unauthenticated),
    )
    .with_name("api-key");

    let server = Server::builder()
        .layer(per_ip)
        .layer(per_key)
        .add_service(health);

    if !demo {
        println!("grpc.health.v1.Health listening on {addr}");
        server
            .serve_with_incoming_shutdown(incoming, async {
                tokio::signal::ctrl_c().await.ok();
            })
            .await?;
        return Ok(());
    }

    let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
    let serving = tokio::spawn(server.serve_with_incoming_shutdown(incoming, async {
        stopped.await.ok();
    }));
    let channel = Channel::from_shared(format!("http://{addr}"))?
        .connect()
        .await?;
    let mut client = HealthClient::new(channel);

    for n in 1..=PER_KEY_PER_MINUTE + 1 {
        let outcome = client.check(check("k1")).await;
        match outcome {
            Ok(response) => println!("call {n}: {:?}", response.into_inner().status()),
            Err(status) => print_denied(n, &status),
        }
    }
    // Another API key has its own budget.
    let other = client.check(check("k2")).await?;
    println!("key k2: {:?}", other.into_inner().status());
    // No API key at all.
    let missing = client
        .check(Request::new(HealthCheckRequest::default()))
        .await
        .expect_err("a call without an API key is rejected");
    assert_eq!(missing.code(), Code::Unauthenticated);
    println!("no key: {:?} {:?}", missing.code(), missing.message());

    stop.send(()).ok();
    serving.await??;
    Ok(())
}

/// A health check of the whole server with `api_key` in the `x-api-key` metadata.
fn check(api_key: &'static str) -> Request<HealthCheckRequest> {
    let mut request = Request::new(HealthCheckRequest::default());
    request
        .metadata_mut()
        .insert("x-api-key", api_key.parse().expect("ASCII metadata"));
    request
}

fn print_denied(n: u32, status: &Status) {
    let metadata = status.metadata();
    let get = |name: &str| {
        metadata
            .get(name)
            .and_then(|v| v.to_str().ok())
            .unwrap_or("-")
            .to_owned()
    };
    println!(
        "call {n}: {:?} {:?}, retry-after: {}, grpc-retry-pushback-ms: {}, ratelimit: {}",
        status.code(),
        status.message(),
        get("retry-after"),
        get("grpc-retry-pushback-ms"),
        get("ratelimit"),
    );
}
