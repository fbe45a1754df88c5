//! The server that `bench/load.sh` measures: a hello-world axum route behind one
//! rate limiter, chosen with `--mode`, in one of two scenarios.
//!
//! ```text
//! cargo run --release -p tollgate-bench --bin bench_server -- \
//!     --mode redis --scenario allow --redis redis://127.0.0.1:16379 --port 0
//! ```
//!
//! Modes:
//! - `plain`: axum only, the baseline;
//! - `memory`: tollgate with its `MemoryStore`; `memory-noheaders`: the same without
//!   rate-limit fields on responses (`HeaderStyle::NONE`), to see what writing them costs;
//! - `redis`: tollgate with `RedisStore::connect` (the defaults: `ConnectionManager`,
//!   coalescing and block cache on); `redis-nocoalesce`: coalescing off;
//!   `redis-nocache`: block cache off; `redis-lease`: leased quota on
//!   (`RedisStore::with_leases` with the defaults); `redis-pool`: over a bb8-redis pool of 16
//!   (bb8's defaults, so a `PING` per checkout); `redis-cluster`: `connect_cluster` on
//!   the nodes given with `--cluster`;
//! - what issue 17's features cost, each the `memory` or `redis` mode with one feature on:
//!   `memory-lockout`, `redis-lockout`: the limit with a lockout of an hour
//!   (`Limit::with_lockout`: in `reject`, the first breach locks the key out and every
//!   later request is refused by the lockout); `memory-wait`, `redis-wait`: the layer with
//!   `max_wait` of a second (`allow`: nothing waits; `reject`: a route that could wait but
//!   whose `retry_after`, about an hour, is beyond it, so it still refuses at once);
//!   `memory-inflight`, `redis-inflight`: an `InFlightLayer` on the same key *instead of*
//!   the rate limit (`allow`: a maximum of a million, so every request takes a permit and
//!   gives it back, in Redis a script call, a renewal task and a `ZREM`; `reject`: a
//!   maximum of one, held for good by a request the server makes to itself at start, so
//!   every request is refused);
//! - `memory-rate-inflight`, `redis-rate-inflight`: the rate limit *with* an in-flight
//!   limit of a million as a stage of its pipeline (`RateLimitLayer::with_in_flight`): one
//!   store call decides both, one more gives the permit back when the body ends;
//! - `governor`: tower_governor 0.8;
//! - `handwritten`: an axum middleware that runs a fixed-window `INCR`+`PEXPIRE` script per
//!   request with `redis::Script::invoke_async` on one `MultiplexedConnection`, the
//!   reference point of the performance issue.
//!
//! Scenarios: `allow` (a limit so high that nothing is rejected) and `reject` (1 request
//! per hour on one key shared by every request, so everything after the first is
//! rejected: the one-key flood), both on one global key; and `clients`, the `allow` limit
//! per client, keyed by the `x-client` header (which `bench/clients.lua` makes wrk send,
//! one of 10 000 values per request); and `flood`, a limit of a million per hour and
//! client that nothing reaches, with a client never seen before in every request
//! (`bench/flood.lua`): a client rotating API keys or IPv6 addresses, whose keys stay
//! live, so that a memory store fills to its bound and then evicts a key per request;
//! and `zipf`, the `clients` limit and key, with the 10 000 clients' shares of the
//! requests following a Zipf law (s = 1.1, `bench/zipf.lua`): a few hot keys and a long
//! tail.
//! `--max-keys <n>` bounds the memory modes' store (`MemoryStore::with_max_keys`; the
//! default bound otherwise), so that a short run can flood it several times over. Every
//! limiter is a fixed window.
//!
//! Prints `listening on 127.0.0.1:<port>` once it serves (Redis connected, scripts
//! loaded). On SIGTERM or Ctrl-C it stops and prints `statuses: 200=<n> 429=<n>
//! other=<n>`, the answers it gave, so that the script can check that a scenario did what
//! it says (a store error would otherwise pass unnoticed, or be counted as a rejection);
//! store failures are answered 503 and logged to stderr.

use std::{
    net::SocketAddr,
    process::ExitCode,
    sync::{
        Arc, LazyLock,
        atomic::{AtomicU64, Ordering},
    },
    time::Duration,
};

use axum::{
    Router,
    extract::{Request, State},
    http::StatusCode,
    middleware::{self, Next},
    response::{IntoResponse, Response},
    routing::get,
};
use tollgate::{
    FailurePolicy, InFlightLimit, Limit, RateLimitLayer,
    headers::HeaderStyle,
    in_flight::InFlightLayer,
    key::{GlobalKey, Key, KeyError, KeyExtractor},
    store::{LeaseConfig, MemoryStore, RedisStore},
};
use tower::{ServiceExt, util::MapResponseLayer};
use tower_governor::{
    GovernorError, GovernorLayer, governor::GovernorConfigBuilder,
    key_extractor::GlobalKeyExtractor,
};

type Error = Box<dyn std::error::Error + Send + Sync>;

/// The allowed scenario: a fixed window of this many requests per second.
const ALLOW_LIMIT: u32 = 1_000_000_000;
const ALLOW_WINDOW: Duration = Duration::from_secs(1);
/// The flood scenario: a million requests per hour and key, so that keys stay live for
/// the whole run (each is used once).
const FLOOD_LIMIT: u32 = 1_000_000;
const FLOOD_WINDOW: Duration = Duration::from_secs(3600);
/// The rejecting scenario: one request per hour.
const REJECT_LIMIT: u32 = 1;
const REJECT_WINDOW: Duration = Duration::from_secs(3600);
/// The `*-lockout` modes' lockout after a breach.
const LOCKOUT: Duration = Duration::from_secs(3600);
/// The `*-wait` modes' `max_wait`.
const MAX_WAIT: Duration = Duration::from_secs(1);
/// The `*-inflight` modes' maximum in flight: never reached (`allow`), or one, held by
/// the server itself (`reject`).
const ALLOW_IN_FLIGHT: u32 = 1_000_000;
const REJECT_IN_FLIGHT: u32 = 1;
/// The route whose body never ends, which holds the in-flight permit in `reject`.
const HOLD_PATH: &str = "/hold";

/// The hand-written reference: a fixed window counted with INCR, the TTL set on the
/// first hit. Returns `{allowed, remaining or ms until reset}`.
static FIXED_WINDOW: LazyLock<redis::Script> = LazyLock::new(|| {
    redis::Script::new(
        r"
local count = redis.call('INCR', KEYS[1])
if count == 1 then
  redis.call('PEXPIRE', KEYS[1], ARGV[2])
end
local limit = tonumber(ARGV[1])
if count > limit then
  return {0, redis.call('PTTL', KEYS[1])}
end
return {1, limit - count}
",
    )
});

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Mode {
    Plain,
    Memory,
    MemoryNoHeaders,
    Redis,
    RedisNoCoalesce,
    RedisNoCache,
    RedisLease,
    RedisPool,
    RedisCluster,
    RedisTls,
    Governor,
    Handwritten,
    MemoryLockout,
    RedisLockout,
    MemoryWait,
    RedisWait,
    MemoryInFlight,
    RedisInFlight,
    MemoryRateInFlight,
    RedisRateInFlight,
}

impl Mode {
    const ALL: [(&'static str, Mode); 20] = [
        ("plain", Mode::Plain),
        ("memory", Mode::Memory),
        ("memory-noheaders", Mode::MemoryNoHeaders),
        ("redis", Mode::Redis),
        ("redis-nocoalesce", Mode::RedisNoCoalesce),
        ("redis-nocache", Mode::RedisNoCache),
        ("redis-lease", Mode::RedisLease),
        ("redis-pool", Mode::RedisPool),
        ("redis-cluster", Mode::RedisCluster),
        ("redis-tls", Mode::RedisTls),
        ("governor", Mode::Governor),
        ("handwritten", Mode::Handwritten),
        ("memory-lockout", Mode::MemoryLockout),
        ("redis-lockout", Mode::RedisLockout),
        ("memory-wait", Mode::MemoryWait),
        ("redis-wait", Mode::RedisWait),
        ("memory-inflight", Mode::MemoryInFlight),
        ("redis-inflight", Mode::RedisInFlight),
        ("memory-rate-inflight", Mode::MemoryRateInFlight),
        ("redis-rate-inflight", Mode::RedisRateInFlight),
    ];

    fn parse(name: &str) -> Result<Self, Error> {
        Self::ALL
            .iter()
            .find(|(n, _)| *n == name)
            .map(|(_, mode)| *mode)
            .ok_or_else(|| {
                let names: Vec<&str> = Self::ALL.iter().map(|(n, _)| *n).collect();
                format!("unknown mode {name:?}; one of {}", names.join(", ")).into()
            })
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Scenario {
    Allow,
    Reject,
    Clients,
    Flood,
    Zipf,
}

/// The header that names the client in the `clients` scenario.
const CLIENT_HEADER: &str = "x-client";

#[derive(Debug)]
struct Args {
    mode: Mode,
    scenario: Scenario,
    redis: Option<String>,
    cluster: Vec<String>,
    /// `redis-tls`: a `rediss://` URL and the PEM CA its certificate is signed by.
    redis_tls: Option<(String, String)>,
    port: u16,
    /// The memory modes' bound (`None`: `MemoryStore`'s default).
    max_keys: Option<usize>,
}

const USAGE: &str = "usage: bench_server --mode <mode> [--scenario allow|reject|clients|flood|zipf] \
                     [--redis <url>] [--cluster <url,url,..>] [--port <port>] \
                     [--max-keys <n>] [--redis-tls <rediss-url> --tls-ca <ca.pem>]";

fn parse_args() -> Result<Args, Error> {
    let mut mode = None;
    let mut scenario = Scenario::Allow;
    let mut redis = None;
    let mut cluster = Vec::new();
    let (mut redis_tls, mut tls_ca) = (None, None);
    let mut port = 0;
    let mut max_keys = None;
    let mut args = std::env::args().skip(1);
    while let Some(flag) = args.next() {
        let mut value = || {
            args.next()
                .ok_or_else(|| format!("{flag} needs a value\n{USAGE}"))
        };
        match flag.as_str() {
            "--mode" => mode = Some(Mode::parse(&value()?)?),
            "--scenario" => {
                scenario = match value()?.as_str() {
                    "allow" => Scenario::Allow,
                    "reject" => Scenario::Reject,
                    "clients" => Scenario::Clients,
                    "flood" => Scenario::Flood,
                    "zipf" => Scenario::Zipf,
                    other => return Err(format!("unknown scenario {other:?}\n{USAGE}").into()),
                }
            }
            "--redis" => redis = Some(value()?),
            "--cluster" => {
                cluster = value()?
                    .split(',')
                    .filter(|s| !s.is_empty())
                    .map(str::to_owned)
                    .collect();
            }
            "--redis-tls" => redis_tls = Some(value()?),
            "--tls-ca" => tls_ca = Some(value()?),
            "--port" => port = value()?.parse()?,
            "--max-keys" => max_keys = Some(value()?.parse()?),
            "-h" | "--help" => return Err(USAGE.into()),
            other => return Err(format!("unknown argument {other:?}\n{USAGE}").into()),
        }
    }
    let mode = mode.ok_or_else(|| format!("--mode is required\n{USAGE}"))?;
    Ok(Args {
        mode,
        scenario,
        redis,
        cluster,
        redis_tls: redis_tls.zip(tls_ca),
        port,
        max_keys,
    })
}

/// Answers given, by status.
#[derive(Debug, Default)]
struct Statuses {
    ok: AtomicU64,
    too_many: AtomicU64,
    other: AtomicU64,
}

impl Statuses {
    fn count(&self, status: StatusCode) {
        let counter = match status {
            StatusCode::OK => &self.ok,
            StatusCode::TOO_MANY_REQUESTS => &self.too_many,
            _ => &self.other,
        };
        counter.fetch_add(1, Ordering::Relaxed);
    }
}

#[tokio::main]
async fn main() -> ExitCode {
    match run().await {
        Ok(()) => ExitCode::SUCCESS,
        Err(error) => {
            eprintln!("bench_server: {error}");
            ExitCode::FAILURE
        }
    }
}

async fn run() -> Result<(), Error> {
    // Store failures are logged (tollgate warns once per failed decision), so that the
    // script can show why a run was invalid. RUST_LOG overrides the level.
    tracing_subscriber::fmt()
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_default_env()
                .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("warn")),
        )
        .with_writer(std::io::stderr)
        .with_ansi(false)
        .without_time()
        .init();
    let args = parse_args()?;
    let app = app(&args).await?;
    let statuses = Arc::new(Statuses::default());
    let counted = statuses.clone();
    let app = app.layer(MapResponseLayer::new(move |response: Response| {
        counted.count(response.status());
        response
    }));

    let listener = tokio::net::TcpListener::bind(("127.0.0.1", args.port)).await?;
    println!("listening on {}", listener.local_addr()?);
    axum::serve(
        listener,
        app.into_make_service_with_connect_info::<SocketAddr>(),
    )
    .with_graceful_shutdown(shutdown())
    .await?;
    println!(
        "statuses: 200={} 429={} other={}",
        statuses.ok.load(Ordering::Relaxed),
        statuses.too_many.load(Ordering::Relaxed),
        statuses.other.load(Ordering::Relaxed)
    );
    Ok(())
}

/// SIGTERM (what the script sends) or Ctrl-C.
async fn shutdown() {
    let mut term = tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate())
        .expect("install a SIGTERM handler");
    tokio::select! {
        _ = term.recv() => {}
        _ = tokio::signal::ctrl_c() => {}
    }
}

async fn hello() -> &'static str {
    "Hello, World!"
}

/// A body that never ends: the request holds its in-flight permit for good.
async fn hold() -> axum::body::Body {
    axum::body::Body::from_stream(futures_util::stream::pending::<
        Result<bytes::Bytes, std::convert::Infallible>,
    >())
}

async fn app(args: &Args) -> Result<Router, Error> {
    let router = Router::new().route("/", get(hello));
    let reject = args.scenario == Scenario::Reject;
    let per_client = matches!(
        args.scenario,
        Scenario::Clients | Scenario::Flood | Scenario::Zipf
    );
    let (limit, window) = match args.scenario {
        Scenario::Reject => (REJECT_LIMIT, REJECT_WINDOW),
        Scenario::Flood => (FLOOD_LIMIT, FLOOD_WINDOW),
        Scenario::Allow | Scenario::Clients | Scenario::Zipf => (ALLOW_LIMIT, ALLOW_WINDOW),
    };
    // A store failure is answered 503, so that it shows in the status counts instead of
    // passing as an allowed request.
    let fixed_window = Limit::fixed_window(limit, window)?;
    let lockout = matches!(args.mode, Mode::MemoryLockout | Mode::RedisLockout);
    let layer = RateLimitLayer::new(if lockout {
        fixed_window.with_lockout(LOCKOUT)?
    } else {
        fixed_window
    })
    .with_key(BenchKey { per_client })
    .with_on_store_error(FailurePolicy::Deny);
    let redis_url = || {
        args.redis
            .as_deref()
            .ok_or_else(|| Error::from("this mode needs --redis <url>"))
    };
    let memory = || match args.max_keys {
        Some(max_keys) => MemoryStore::new().with_max_keys(max_keys),
        None => MemoryStore::new(),
    };
    Ok(match args.mode {
        Mode::Plain => router,
        Mode::Memory => router.layer(layer.with_store(memory())),
        Mode::MemoryNoHeaders => {
            router.layer(layer.with_store(memory()).with_headers(HeaderStyle::NONE))
        }
        Mode::Redis => router.layer(layer.with_store(RedisStore::connect(redis_url()?).await?)),
        Mode::RedisNoCoalesce => router.layer(
            layer.with_store(
                RedisStore::connect(redis_url()?)
                    .await?
                    .with_coalescing(None),
            ),
        ),
        Mode::RedisNoCache => router.layer(
            layer.with_store(
                RedisStore::connect(redis_url()?)
                    .await?
                    .with_block_cache(None),
            ),
        ),
        Mode::RedisLease => router.layer(
            layer.with_store(
                RedisStore::connect(redis_url()?)
                    .await?
                    .with_leases(LeaseConfig::new()),
            ),
        ),
        Mode::RedisPool => {
            let manager = bb8_redis::RedisConnectionManager::new(redis_url()?)?;
            let pool = bb8_redis::bb8::Pool::builder()
                .max_size(16)
                .build(manager)
                .await?;
            router.layer(layer.with_store(RedisStore::from_pool(pool)))
        }
        Mode::RedisCluster => {
            if args.cluster.is_empty() {
                return Err("mode redis-cluster needs --cluster <url,url,..>".into());
            }
            router.layer(layer.with_store(
                RedisStore::connect(tollgate::store::RedisTarget::cluster(&args.cluster)).await?,
            ))
        }
        Mode::RedisTls => router.layer(layer.with_store(connect_tls(args).await?)),
        Mode::MemoryLockout => router.layer(layer.with_store(memory())),
        Mode::RedisLockout => {
            router.layer(layer.with_store(RedisStore::connect(redis_url()?).await?))
        }
        Mode::MemoryWait => router.layer(layer.with_store(memory()).with_max_wait(Some(MAX_WAIT))),
        Mode::RedisWait => router.layer(
            layer
                .with_store(RedisStore::connect(redis_url()?).await?)
                .with_max_wait(Some(MAX_WAIT)),
        ),
        Mode::MemoryInFlight | Mode::RedisInFlight => {
            let max = if reject {
                REJECT_IN_FLIGHT
            } else {
                ALLOW_IN_FLIGHT
            };
            let mut in_flight = InFlightLayer::new(max)?
                .with_key(BenchKey { per_client })
                .with_on_store_error(FailurePolicy::Deny);
            if args.mode == Mode::RedisInFlight {
                in_flight = in_flight.with_store(RedisStore::connect(redis_url()?).await?);
            }
            let router = router.route(HOLD_PATH, get(hold)).layer(in_flight);
            if reject {
                // The one permit, taken for good (its body never ends and is never
                // dropped): every request wrk sends is refused. Not counted in the
                // statuses, which are counted outside this router.
                let request = http::Request::get(HOLD_PATH).body(axum::body::Body::empty())?;
                let held = router.clone().oneshot(request).await?;
                if held.status() != StatusCode::OK {
                    return Err(format!("holding the permit: {}", held.status()).into());
                }
                std::mem::forget(held);
            }
            router
        }
        Mode::MemoryRateInFlight => router.layer(
            layer
                .with_store(memory())
                .with_in_flight(InFlightLimit::new(ALLOW_IN_FLIGHT)?),
        ),
        Mode::RedisRateInFlight => router.layer(
            layer
                .with_store(RedisStore::connect(redis_url()?).await?)
                .with_in_flight(InFlightLimit::new(ALLOW_IN_FLIGHT)?),
        ),
        Mode::Governor => {
            let mut config = GovernorConfigBuilder::default();
            if reject {
                config.period(REJECT_WINDOW).burst_size(REJECT_LIMIT);
            } else {
                // One cell per nanosecond: never empty.
                config.per_nanosecond(1).burst_size(ALLOW_LIMIT);
            }
            let invalid = "invalid governor quota";
            if per_client {
                let config = config.key_extractor(ClientHeader).finish().ok_or(invalid)?;
                router.layer(GovernorLayer::new(config))
            } else {
                let config = config
                    .key_extractor(GlobalKeyExtractor)
                    .finish()
                    .ok_or(invalid)?;
                router.layer(GovernorLayer::new(config))
            }
        }
        Mode::Handwritten => {
            let client = redis::Client::open(redis_url()?)?;
            let mut connection = client.get_multiplexed_async_connection().await?;
            FIXED_WINDOW.load_async(&mut connection).await?;
            let state = Handwritten {
                connection,
                key: if reject {
                    "bench:handwritten:reject"
                } else {
                    "bench:handwritten:allow"
                },
                per_client,
                limit: u64::from(limit),
                window_ms: u64::try_from(window.as_millis())?,
            };
            router.layer(middleware::from_fn_with_state(state, handwritten))
        }
    })
}

/// The `x-client` header, when it is valid text.
fn client<B>(request: &http::Request<B>) -> Option<&str> {
    request.headers().get(CLIENT_HEADER)?.to_str().ok()
}

/// Every limiter's key: one global key, or the `x-client` header.
#[derive(Debug, Clone, Copy)]
struct BenchKey {
    per_client: bool,
}

impl<B> KeyExtractor<B> for BenchKey {
    fn extract(&self, request: &http::Request<B>) -> Result<Key, KeyError> {
        if !self.per_client {
            return GlobalKey.extract(request);
        }
        client(request)
            .map(Key::new)
            .ok_or_else(|| KeyError::new("no x-client header"))
    }
}

/// governor's key in the `clients` scenario (the others use its `GlobalKeyExtractor`).
#[derive(Debug, Clone, Copy)]
struct ClientHeader;

impl tower_governor::key_extractor::KeyExtractor for ClientHeader {
    type Key = String;

    fn extract<T>(&self, request: &http::Request<T>) -> Result<String, GovernorError> {
        client(request)
            .map(str::to_owned)
            .ok_or(GovernorError::UnableToExtractKey)
    }
}

#[derive(Clone)]
struct Handwritten {
    connection: redis::aio::MultiplexedConnection,
    key: &'static str,
    /// Append the `x-client` header to `key`.
    per_client: bool,
    limit: u64,
    window_ms: u64,
}

/// The reference middleware: one script call per request.
async fn handwritten(State(state): State<Handwritten>, request: Request, next: Next) -> Response {
    let mut connection = state.connection;
    let key = match (state.per_client, client(&request)) {
        (true, Some(client)) => format!("{}:{client}", state.key),
        (true, None) => return StatusCode::BAD_REQUEST.into_response(),
        (false, _) => state.key.to_owned(),
    };
    let decided: redis::RedisResult<(i64, i64)> = FIXED_WINDOW
        .key(key)
        .arg(state.limit)
        .arg(state.window_ms)
        .invoke_async(&mut connection)
        .await;
    match decided {
        Ok((1, _)) => next.run(request).await,
        Ok(_) => StatusCode::TOO_MANY_REQUESTS.into_response(),
        Err(_) => StatusCode::SERVICE_UNAVAILABLE.into_response(),
    }
}

/// `redis-tls`: the default store over TLS (feature `tls`), trusting the given CA.
#[cfg(feature = "tls")]
async fn connect_tls(args: &Args) -> Result<RedisStore, Error> {
    let (url, ca) = args
        .redis_tls
        .as_ref()
        .ok_or("mode redis-tls needs --redis-tls <rediss-url> --tls-ca <ca.pem>")?;
    let tls = tollgate::store::TlsConfig::new().with_ca_pem(std::fs::read(ca)?);
    Ok(RedisStore::connect(tollgate::store::RedisTarget::node(url).with_tls(tls.clone())).await?)
}

#[cfg(not(feature = "tls"))]
async fn connect_tls(args: &Args) -> Result<RedisStore, Error> {
    let url = args.redis_tls.as_ref().map_or("", |(url, _)| url.as_str());
    Err(
        format!("mode redis-tls ({url}) needs the tls feature (FEATURES=redis,bb8,cluster,tls)")
            .into(),
    )
}
