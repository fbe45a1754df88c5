//! Story 1 of issue 25 through tonic: an LLM-style gRPC API behind one `RateLimitLayer`
//! (`Server::builder().layer(..)`), served over TCP to a real tonic client, on the memory
//! store and on real Redis. Per API key (hashed), a plan from metadata (free: 20 calls a
//! minute and 10 000 tokens a day; pro: 200 and 1 000 000), the token cost read from a
//! response **trailer** after the call (`late_cost_from_trailers`), at most 2 calls in
//! flight per key, up to 2 s of waiting instead of RESOURCE_EXHAUSTED, a stricter free
//! limit in shadow. The axum version, with the metrics, is in `tests/stories.rs`.
//!
//! The service is `tonic-health`'s `Check`, behind a small layer standing for the model:
//! it reports the tokens asked for in `x-want-tokens` as an `x-tokens` trailer, and with
//! `x-block` waits for a gate first. The stores read a frozen `ManualClock`.

#![cfg(feature = "tonic")]

#[cfg(feature = "redis")]
use tollgate_test_support as support;

use std::{
    pin::Pin,
    sync::{
        Arc,
        atomic::{AtomicUsize, Ordering},
    },
    task::{Context, Poll, ready},
    time::{Duration, Instant},
};

use bytes::Bytes;
use http::{HeaderMap, HeaderName};
use http_body::Frame;
use tokio::sync::Semaphore;
use tollgate::{
    InFlightLimit, Limit, RateLimitLayer,
    clock::ManualClock,
    key::HeaderKey,
    plan::{Plan, Plans},
    store::{MemoryStore, Store},
};
use tonic::{
    Code, Request,
    transport::{Channel, Server, server::TcpIncoming},
};
use tonic_health::{
    pb::{HealthCheckRequest, health_client::HealthClient},
    server::HealthReporter,
};
use tower::Service;

const MINUTE: Duration = Duration::from_secs(60);
const DAY: Duration = Duration::from_secs(86_400);
const NOW_MS: u64 = 1_700_000_000_000;

/// The model in front of the health service: the `x-tokens` trailer, and `x-block`.
#[derive(Clone)]
struct Model<S> {
    inner: S,
    gate: Arc<Semaphore>,
    entered: Arc<AtomicUsize>,
}

type BoxFuture<T> = Pin<Box<dyn std::future::Future<Output = T> + Send>>;

impl<S, B> Service<http::Request<B>> for Model<S>
where
    S: Service<http::Request<B>, Response = http::Response<tonic::body::Body>>
        + Clone
        + Send
        + 'static,
    S::Future: Send,
    B: Send + 'static,
{
    type Response = http::Response<tonic::body::Body>;
    type Error = S::Error;
    type Future = BoxFuture<Result<Self::Response, S::Error>>;

    fn poll_ready(&mut self, cx: &mut Context<'_>) -> Poll<Result<(), S::Error>> {
        self.inner.poll_ready(cx)
    }

    fn call(&mut self, request: http::Request<B>) -> Self::Future {
        let tokens: Option<u32> = request
            .headers()
            .get("x-want-tokens")
            .map(|v| v.to_str().unwrap().parse().unwrap());
        let block = request.headers().contains_key("x-block");
        let clone = self.inner.clone();
        let mut inner = std::mem::replace(&mut self.inner, clone);
        let (gate, entered) = (self.gate.clone(), self.entered.clone());
        Box::pin(async move {
            if block {
                entered.fetch_add(1, Ordering::SeqCst);
                gate.acquire().await.unwrap().forget();
            }
            let response = inner.call(request).await?;
            Ok(response.map(|body| tonic::body::Body::new(WithTokens { body, tokens })))
        })
    }
}

/// A response body whose trailers get `x-tokens`.
struct WithTokens {
    body: tonic::body::Body,
    tokens: Option<u32>,
}

impl http_body::Body for WithTokens {
    type Data = Bytes;
    type Error = tonic::Status;

    fn poll_frame(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, tonic::Status>>> {
        let frame = ready!(Pin::new(&mut self.body).poll_frame(cx));
        Poll::Ready(match frame {
            Some(Ok(frame)) => match frame.into_trailers() {
                Ok(mut trailers) => {
                    if let Some(tokens) = self.tokens.take() {
                        trailers.insert("x-tokens", tokens.into());
                    }
                    Some(Ok(Frame::trailers(trailers)))
                }
                Err(frame) => Some(Ok(frame)),
            },
            other => other,
        })
    }

    fn is_end_stream(&self) -> bool {
        self.body.is_end_stream()
    }
}

struct Running {
    client: HealthClient<Channel>,
    gate: Arc<Semaphore>,
    entered: Arc<AtomicUsize>,
    _reporter: HealthReporter,
    _stop: tokio::sync::oneshot::Sender<()>,
}

async fn serve(store: impl Store) -> Running {
    let plan = |name: &str, per_minute: u32, per_day: u32| {
        Plan::new(
            name,
            [
                Limit::token_bucket(per_minute, MINUTE)
                    .unwrap()
                    .with_name("requests")
                    .unwrap()
                    .counted_up_front(),
                Limit::token_bucket(per_day, DAY)
                    .unwrap()
                    .with_name("tokens")
                    .unwrap(),
            ],
        )
        .unwrap()
    };
    let strict = Limit::token_bucket(10, MINUTE)
        .unwrap()
        .with_name("strict")
        .unwrap()
        .counted_up_front();
    let plans = Plans::new([
        plan("free", 20, 10_000)
            .with_shadow_limits([strict])
            .unwrap(),
        plan("pro", 200, 1_000_000),
    ])
    .unwrap()
    .with_default("free")
    .unwrap()
    .with_header(HeaderName::from_static("x-plan"));
    // The story's one layer, with the tokens read from the `x-tokens` trailer.
    let layer = RateLimitLayer::new(Limit::token_bucket(20, MINUTE).unwrap())
        .with_name("llm")
        .with_key(HeaderKey::new("x-api-key").unwrap().hashed())
        .with_store(store)
        .with_timeout(Some(Duration::from_secs(5)))
        .with_plans(plans)
        .with_in_flight(InFlightLimit::new(2).unwrap())
        .with_max_wait(Some(Duration::from_secs(2)))
        .with_late_cost_from_trailers(|trailers: Option<&HeaderMap>| {
            trailers?.get("x-tokens")?.to_str().ok()?.parse().ok()
        });
    let incoming = TcpIncoming::bind("127.0.0.1:0".parse().unwrap()).unwrap();
    let addr = incoming.local_addr().unwrap();
    let (reporter, health) = tonic_health::server::health_reporter();
    let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
    let gate = Arc::new(Semaphore::new(0));
    let entered = Arc::new(AtomicUsize::new(0));
    let (g, e) = (gate.clone(), entered.clone());
    let model = tower::layer::layer_fn(move |inner| Model {
        inner,
        gate: g.clone(),
        entered: e.clone(),
    });
    let router = Server::builder()
        .layer(
            tower::ServiceBuilder::new()
                .layer(layer)
                .layer(model)
                .into_inner(),
        )
        .add_service(health);
    tokio::spawn(router.serve_with_incoming_shutdown(incoming, async {
        stopped.await.ok();
    }));
    let channel = Channel::from_shared(format!("http://{addr}"))
        .unwrap()
        .connect()
        .await
        .unwrap();
    Running {
        client: HealthClient::new(channel),
        gate,
        entered,
        _reporter: reporter,
        _stop: stop,
    }
}

fn call(
    api_key: &str,
    plan: Option<&str>,
    tokens: u32,
    block: bool,
) -> Request<HealthCheckRequest> {
    let mut request = Request::new(HealthCheckRequest::default());
    let metadata = request.metadata_mut();
    metadata.insert("x-api-key", api_key.parse().unwrap());
    metadata.insert("x-want-tokens", tokens.to_string().parse().unwrap());
    if let Some(plan) = plan {
        metadata.insert("x-plan", plan.parse().unwrap());
    }
    if block {
        metadata.insert("x-block", "1".parse().unwrap());
    }
    request
}

/// On Redis: the script calls, and a key's permits.
#[cfg(feature = "redis")]
struct Calls<'a> {
    server: &'a support::RedisServer,
}

#[cfg(not(feature = "redis"))]
struct Calls<'a> {
    _never: std::marker::PhantomData<&'a ()>,
}

impl Calls<'_> {
    #[cfg(feature = "redis")]
    fn count(&self) -> u64 {
        self.server.script_calls()
    }

    #[cfg(not(feature = "redis"))]
    fn count(&self) -> u64 {
        0
    }

    /// Waits until `api_key` holds no permit (its release, with the adjustment, landed).
    #[cfg(feature = "redis")]
    async fn settled(&self, api_key: &str) {
        use tollgate::key::KeyExtractor;
        let request = http::Request::get("/")
            .header("x-api-key", api_key)
            .body(())
            .unwrap();
        let key = HeaderKey::new("x-api-key")
            .unwrap()
            .hashed()
            .extract(&request)
            .unwrap();
        let zset = format!("tollgate:{{{}}}:inflight", key.as_str());
        let start = Instant::now();
        loop {
            let held: u64 = self
                .server
                .cli(&["ZCARD", &zset])
                .unwrap()
                .trim()
                .parse()
                .unwrap();
            if held == 0 {
                return;
            }
            assert!(
                start.elapsed() < Duration::from_secs(10),
                "a permit never came back"
            );
            tokio::time::sleep(Duration::from_millis(5)).await;
        }
    }

    #[cfg(not(feature = "redis"))]
    async fn settled(&self, _: &str) {}
}

/// One call: its code; on Redis, one script call to decide and one after the call.
async fn one(
    running: &mut Running,
    calls: Option<&Calls<'_>>,
    request: Request<HealthCheckRequest>,
) -> Code {
    let api_key = request
        .metadata()
        .get("x-api-key")
        .unwrap()
        .to_str()
        .unwrap()
        .to_owned();
    let before = calls.map(Calls::count);
    let code = match running.client.check(request).await {
        Ok(_) => Code::Ok,
        Err(status) => status.code(),
    };
    if let (Some(calls), Some(before)) = (calls, before) {
        if code == Code::Ok {
            calls.settled(&api_key).await;
            assert_eq!(calls.count() - before, 2, "one call to decide, one after");
        } else {
            assert_eq!(calls.count() - before, 1, "one call to decide");
        }
    }
    code
}

async fn llm_story(store: impl Store, clock: &ManualClock, calls: Option<&Calls<'_>>) {
    let mut running = serve(store).await;
    assert_eq!(
        one(&mut running, None, call("warm", None, 1, false)).await,
        Code::Ok
    );
    if let Some(calls) = calls {
        calls.settled("warm").await;
    }
    // Free: 20 a minute (the shadow limit never refuses); the 21st would fit in 3 s:
    // beyond the 2 s of waiting, RESOURCE_EXHAUSTED at once.
    for i in 0..20 {
        let code = one(&mut running, calls, call("free-1", None, 1, false)).await;
        assert_eq!(code, Code::Ok, "call {}", i + 1);
    }
    let started = Instant::now();
    let code = one(&mut running, calls, call("free-1", None, 1, false)).await;
    assert_eq!(code, Code::ResourceExhausted);
    assert!(started.elapsed() < Duration::from_secs(2));
    // 1.5 s on, it waits 1.5 s instead.
    clock.advance(Duration::from_millis(1_500));
    let started = Instant::now();
    let code = one(&mut running, calls, call("free-1", None, 1, false)).await;
    assert_eq!(code, Code::Ok);
    assert!(
        started.elapsed() >= Duration::from_millis(1_200),
        "it waited"
    );

    // Tokens from the trailer, charged to the day's budget: the 10 001st refuses.
    assert_eq!(
        one(&mut running, calls, call("free-2", None, 9_999, false)).await,
        Code::Ok
    );
    assert_eq!(
        one(&mut running, calls, call("free-2", None, 1, false)).await,
        Code::Ok
    );
    let code = one(&mut running, calls, call("free-2", None, 1, false)).await;
    assert_eq!(code, Code::ResourceExhausted, "the 10 001st token");

    // Two in flight per key: a third is RESOURCE_EXHAUSTED at once.
    let blocked: Vec<_> = (0..2)
        .map(|_| {
            let mut client = running.client.clone();
            tokio::spawn(async move { client.check(call("free-3", None, 1, true)).await })
        })
        .collect();
    let start = Instant::now();
    while running.entered.load(Ordering::SeqCst) < 2 {
        assert!(start.elapsed() < Duration::from_secs(10), "never entered");
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    let started = Instant::now();
    let code = one(&mut running, calls, call("free-3", None, 1, false)).await;
    assert_eq!(code, Code::ResourceExhausted);
    assert!(
        started.elapsed() < Duration::from_millis(900),
        "answered at once"
    );
    running.gate.add_permits(2);
    for call in blocked {
        call.await.unwrap().unwrap();
    }
    if let Some(calls) = calls {
        calls.settled("free-3").await;
    }
    assert_eq!(
        one(&mut running, calls, call("free-3", None, 1, false)).await,
        Code::Ok
    );

    // Pro: 200 a minute, a million tokens.
    for i in 0..30 {
        let code = one(&mut running, calls, call("pro-1", Some("pro"), 1, false)).await;
        assert_eq!(code, Code::Ok, "pro call {}", i + 1);
    }
    let code = one(
        &mut running,
        calls,
        call("pro-1", Some("pro"), 20_000, false),
    )
    .await;
    assert_eq!(code, Code::Ok);
}

#[tokio::test]
async fn llm_api_through_tonic_on_memory() {
    let clock = ManualClock::new(NOW_MS);
    llm_story(MemoryStore::new().with_clock(clock.clone()), &clock, None).await;
}

#[cfg(feature = "redis")]
#[tokio::test]
async fn llm_api_through_tonic_on_redis() {
    let server = support::RedisServer::start();
    let clock = ManualClock::new(NOW_MS);
    let store = tollgate::store::RedisStore::connect(server.url())
        .await
        .unwrap()
        .with_clock(clock.clone());
    llm_story(store, &clock, Some(&Calls { server: &server })).await;
    support::assert_every_key_expires(&server);
}
