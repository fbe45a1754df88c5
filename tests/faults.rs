//! Fault injection against real redis-server processes the harness controls: killed and
//! restarted under load, SCRIPT FLUSH, CLIENT KILL, DEBUG SLEEP and CLIENT PAUSE, and the
//! block cache under a one-key flood. Every request must get an answer by the failure
//! policy (never a 500, never a hang), and limiting must resume by itself.
//!
//! Time bounds here are generous on purpose (seconds, against a 100 ms store timeout):
//! they catch hangs, not slowness.

#![cfg(feature = "redis")]

use tollgate_test_support as support;

use std::{
    num::NonZeroUsize,
    sync::{
        Arc,
        atomic::{AtomicBool, Ordering},
    },
    time::{Duration, Instant},
};

use axum::{Router, body::Body, routing::get};
use http::{Request, Response, StatusCode};
use support::RedisServer;
use tokio::{task::JoinSet, time::timeout};
use tollgate::{
    CircuitBreaker, FailurePolicy, Limit, RateLimitLayer, StoreErrorKind,
    key::GlobalKey,
    key::Key,
    store::{RedisStore, Store},
};
use tower::ServiceExt;

const TIMEOUT: Duration = Duration::from_millis(100);
/// Far beyond the store timeout: a request slower than this hangs.
const HANG: Duration = Duration::from_secs(3);

/// A huge limit over a long window: every request Redis decides is allowed and carries
/// the `RateLimit` fields; requests decided by the failure policy do not.
fn app(store: RedisStore, policy: FailurePolicy) -> Router {
    app_with_timeout(store, policy, TIMEOUT)
}

fn app_with_timeout(store: RedisStore, policy: FailurePolicy, timeout: Duration) -> Router {
    let limit = Limit::fixed_window(100_000_000, Duration::from_secs(3600)).unwrap();
    let layer = RateLimitLayer::new(limit)
        .with_key(GlobalKey)
        .with_store(store)
        .with_timeout(Some(timeout))
        .with_on_store_error(policy);
    Router::new()
        .route("/", get(|| async { "ok" }))
        .layer(layer)
}

async fn send(app: &Router) -> Response<Body> {
    let request = Request::get("/").body(Body::empty()).unwrap();
    timeout(HANG, app.clone().oneshot(request))
        .await
        .expect("a request hung")
        .unwrap()
}

fn decided_by_redis(response: &Response<Body>) -> bool {
    response.headers().contains_key("ratelimit")
}

/// Requests from `tasks` concurrent clients until stopped; returns every status.
struct Load {
    stop: Arc<AtomicBool>,
    tasks: JoinSet<Vec<StatusCode>>,
}

impl Load {
    fn start(app: &Router, tasks: usize) -> Self {
        let stop = Arc::new(AtomicBool::new(false));
        let mut set = JoinSet::new();
        for _ in 0..tasks {
            let app = app.clone();
            let stop = stop.clone();
            set.spawn(async move {
                let mut statuses = Vec::new();
                // Bounded: at most 20 000 requests per client.
                while !stop.load(Ordering::Relaxed) && statuses.len() < 20_000 {
                    statuses.push(send(&app).await.status());
                    tokio::task::yield_now().await;
                }
                statuses
            });
        }
        Self { stop, tasks: set }
    }

    async fn stop(mut self) -> Vec<StatusCode> {
        self.stop.store(true, Ordering::Relaxed);
        let mut all = Vec::new();
        while let Some(statuses) = self.tasks.join_next().await {
            all.extend(statuses.unwrap());
        }
        all
    }
}

/// Polls until Redis decides a request again; panics after `within`.
async fn wait_until_redis_decides(app: &Router, within: Duration) {
    let started = Instant::now();
    while started.elapsed() < within {
        if decided_by_redis(&send(app).await) {
            eprintln!("limiting resumed after {:?}", started.elapsed());
            return;
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    let last = send(app).await;
    panic!(
        "limiting did not resume within {within:?}: {:?} {:?}",
        last.status(),
        last.headers()
    );
}

async fn pause() {
    tokio::time::sleep(Duration::from_millis(300)).await;
}

/// Kills Redis with SIGKILL under load from 8 clients, answers one request while it is
/// down, restarts it on the same port and waits until Redis decides again. Returns the
/// answer given while it was down and every status the clients saw.
async fn kill_9_and_restart_under_load(policy: FailurePolicy) -> (Response<Body>, Vec<StatusCode>) {
    let mut server = RedisServer::start();
    let app = app(RedisStore::connect(server.url()).await.unwrap(), policy);
    let load = Load::start(&app, 8);
    pause().await;
    server.kill();
    let down = send(&app).await;
    pause().await;
    server.restart();
    wait_until_redis_decides(&app, Duration::from_secs(10)).await;
    let statuses = load.stop().await;
    assert!(statuses.len() > 50, "{}", statuses.len());
    (down, statuses)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn kill_9_and_restart_under_load_fail_open() {
    let (down, statuses) = kill_9_and_restart_under_load(FailurePolicy::Allow).await;
    assert_eq!(down.status(), StatusCode::OK);
    // Passed by the failure policy, not decided by a Redis that was still there.
    assert!(!decided_by_redis(&down), "{:?}", down.headers());
    assert!(
        statuses.iter().all(|s| *s == StatusCode::OK),
        "{statuses:?}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn kill_9_and_restart_under_load_fail_closed() {
    let (down, statuses) = kill_9_and_restart_under_load(FailurePolicy::Deny).await;
    // While Redis is down, requests are answered 503 (never 500).
    assert_eq!(down.status(), StatusCode::SERVICE_UNAVAILABLE);
    assert!(
        statuses
            .iter()
            .all(|s| *s == StatusCode::OK || *s == StatusCode::SERVICE_UNAVAILABLE),
        "{statuses:?}"
    );
    assert!(statuses.contains(&StatusCode::SERVICE_UNAVAILABLE));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn script_flush_under_load_fails_nothing() {
    let server = RedisServer::start();
    let store = RedisStore::connect(server.url()).await.unwrap();
    // A long timeout: this test is about NOSCRIPT, not about a busy machine's latency.
    let app = app_with_timeout(store, FailurePolicy::Deny, Duration::from_secs(2));
    let load = Load::start(&app, 8);
    server.cli(&["CONFIG", "RESETSTAT"]).unwrap();
    for _ in 0..5 {
        pause().await;
        server.flush_scripts();
    }
    pause().await;
    let statuses = load.stop().await;
    // The flushes hit calls in flight: the store met NOSCRIPT (or a missing function) and
    // loaded the script (the library) again.
    assert!(server.script_loads() >= 1, "the script was never reloaded");
    // NOSCRIPT reloads the script and retries: no request ever failed.
    assert!(statuses.len() > 50, "{}", statuses.len());
    assert!(
        statuses.iter().all(|s| *s == StatusCode::OK),
        "{statuses:?}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn client_kill_under_load_recovers() {
    let server = RedisServer::start();
    let app = app(
        RedisStore::connect(server.url()).await.unwrap(),
        FailurePolicy::Deny,
    );
    let load = Load::start(&app, 8);
    for round in 0..3 {
        pause().await;
        let killed = server.cli(&["CLIENT", "KILL", "TYPE", "normal"]).unwrap();
        // The first kill hits the store's connection under load. (Later ones may find
        // none: with the circuit open, nothing reconnects until the next probe.)
        let killed: u32 = killed.trim().parse().unwrap();
        if round == 0 {
            assert!(killed >= 1, "no connection was killed");
        }
    }
    wait_until_redis_decides(&app, Duration::from_secs(10)).await;
    let statuses = load.stop().await;
    // Calls on a killed connection fail (503 by the policy), never 500.
    assert!(
        statuses
            .iter()
            .all(|s| *s == StatusCode::OK || *s == StatusCode::SERVICE_UNAVAILABLE),
        "{statuses:?}"
    );
}

/// Makes Redis stall (`DEBUG SLEEP`) for `seconds`, from another thread; join the handle
/// to wait until Redis answers again.
fn stall(server: &RedisServer, seconds: u32) -> std::thread::JoinHandle<()> {
    let port = server.port().to_string();
    std::thread::spawn(move || {
        let out = std::process::Command::new("redis-cli")
            .args(["-p", &port, "DEBUG", "SLEEP", &seconds.to_string()])
            .output()
            .unwrap();
        assert!(out.status.success(), "DEBUG SLEEP failed: {out:?}");
    })
}

/// DEBUG SLEEP makes Redis stall longer than the timeout: requests are answered by the
/// policy at the timeout, and once the circuit opens, at once.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_stalled_redis_costs_at_most_the_timeout() {
    let server = RedisServer::start();
    let app = app(
        RedisStore::connect(server.url()).await.unwrap(),
        FailurePolicy::Allow,
    );
    assert!(decided_by_redis(&send(&app).await));
    let sleeper = stall(&server, 3);
    pause().await;
    let (mut slow, mut during_stall) = (0, 0);
    for _ in 0..30 {
        let started = Instant::now();
        let response = send(&app).await;
        if sleeper.is_finished() {
            // The stall is over (a very slow machine): what follows proves nothing.
            break;
        }
        during_stall += 1;
        assert_eq!(response.status(), StatusCode::OK);
        // Passed by the failure policy: Redis cannot have decided while it slept.
        assert!(!decided_by_redis(&response), "{:?}", response.headers());
        // Far below the 3 s stall: each request waited at most about the timeout.
        assert!(
            started.elapsed() < Duration::from_secs(1),
            "{:?}",
            started.elapsed()
        );
        if started.elapsed() >= TIMEOUT - Duration::from_millis(10) {
            slow += 1;
        }
    }
    // The stall happened: requests were answered during it, and the first ones waited for
    // the timeout before the circuit opened.
    assert!(
        during_stall >= 10,
        "only {during_stall} requests during the stall"
    );
    assert!(
        slow >= 1,
        "no request waited for the timeout: was Redis stalled?"
    );
    // Five failures open the circuit; then only the probes wait (without the breaker all
    // 30 would; the margin absorbs a busy machine).
    assert!(slow <= 15, "{slow} requests waited for the timeout");
    sleeper.join().unwrap();
    wait_until_redis_decides(&app, Duration::from_secs(10)).await;
}

/// The circuit opens while Redis stalls; the probe sent after the cooldown is abandoned by
/// its client (its future dropped mid-check); Redis recovers. Limiting must resume: an
/// abandoned probe once left the breaker "probing" forever, and every later request was
/// passed unlimited by the failure policy.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_abandoned_probe_does_not_disable_limiting() {
    let server = RedisServer::start();
    let store = RedisStore::connect(server.url()).await.unwrap();
    // 3 per hour, failing open, 200 ms timeout, the default breaker (5 failures, 500 ms).
    let layer = RateLimitLayer::new(Limit::fixed_window(3, Duration::from_secs(3600)).unwrap())
        .with_key(GlobalKey)
        .with_store(store)
        .with_timeout(Some(Duration::from_millis(200)))
        .with_on_store_error(FailurePolicy::Allow);
    let app = Router::new()
        .route("/", get(|| async { "ok" }))
        .layer(layer);
    let sleeper = stall(&server, 4);
    pause().await;
    // Fail until the circuit opens: an answer without waiting for the timeout.
    let mut opened = false;
    for _ in 0..20 {
        let started = Instant::now();
        let response = send(&app).await;
        assert!(!decided_by_redis(&response));
        if started.elapsed() < Duration::from_millis(100) {
            opened = true;
            break;
        }
    }
    assert!(opened, "the circuit never opened");
    // After the cooldown, the next request probes; its client hangs up after 50 ms.
    tokio::time::sleep(Duration::from_millis(600)).await;
    let probe = Request::get("/").body(Body::empty()).unwrap();
    let hung_up = timeout(Duration::from_millis(50), app.clone().oneshot(probe)).await;
    assert!(
        hung_up.is_err(),
        "the probe did not wait for the stalled Redis"
    );
    assert!(
        !sleeper.is_finished(),
        "Redis woke up before the probe was abandoned"
    );
    sleeper.join().unwrap();
    // Redis is back: within a cooldown or so (generous here), Redis decides again (its
    // 429s carry the fields too)...
    wait_until_redis_decides(&app, Duration::from_secs(5)).await;
    // ...and the limit holds: 3 per hour, so some of these are 429.
    let mut statuses = Vec::new();
    for _ in 0..5 {
        statuses.push(send(&app).await.status());
    }
    assert!(
        statuses.contains(&StatusCode::TOO_MANY_REQUESTS),
        "{statuses:?}"
    );
}

/// With Redis paused, decisions queue up to the configured bound and no further: the
/// rest fail at once as Overloaded.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_queue_of_waiting_decisions_is_bounded() {
    let server = RedisServer::start();
    let store = RedisStore::connect(server.url())
        .await
        .unwrap()
        .with_coalescing(NonZeroUsize::new(64));
    let limits = [Limit::fixed_window(1_000_000, Duration::from_secs(3600)).unwrap()];
    // Warm up: the batching task runs.
    store.check(&Key::new("k"), &limits, 1).await.unwrap();
    server.cli(&["CLIENT", "PAUSE", "1500", "ALL"]).unwrap();
    let mut set = JoinSet::new();
    for i in 0..2000u32 {
        let check = store.check(&Key::from(i), &limits, 1);
        set.spawn(async move { timeout(Duration::from_secs(10), check).await });
    }
    let (mut queued, mut overloaded) = (0, 0);
    while let Some(result) = set.join_next().await {
        match result.unwrap().expect("a decision hung") {
            // Decided, or sent and timed out in redis-rs (1 s) while Redis was paused.
            Ok(_) => queued += 1,
            Err(e) if e.kind() == StoreErrorKind::Timeout => queued += 1,
            Err(e) if e.kind() == StoreErrorKind::Overloaded => overloaded += 1,
            Err(e) => panic!("{e}"),
        }
    }
    // At most the queue (64) plus the batches on the wire (2 x 128) waited for Redis.
    assert!(queued <= 64 + 2 * 128, "{queued} decisions were queued");
    assert_eq!(queued + overloaded, 2000);
}

/// A flood of one key at 100x its limit: the block cache answers the denials, so Redis
/// sees about `limit` calls per window, plus one to learn of each denial.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_one_key_flood_spares_redis() {
    let server = RedisServer::start();
    let store = RedisStore::connect(server.url()).await.unwrap();
    let limits = [Limit::fixed_window(10, Duration::from_secs(1)).unwrap()];
    server.cli(&["CONFIG", "RESETSTAT"]).unwrap();
    let started = Instant::now();
    let mut allowed = 0;
    for _ in 0..1000 {
        allowed += u32::from(
            store
                .check(&Key::new("flood"), &limits, 1)
                .await
                .unwrap()
                .is_allowed(),
        );
    }
    let windows = started.elapsed().as_secs() + 2;
    let calls = server.script_calls();
    assert!(calls > 0, "the script was never called");
    assert!(allowed as u64 <= 10 * windows);
    assert!(
        calls <= 12 * windows,
        "{calls} Redis calls for 1000 requests in {windows} windows"
    );
}

/// Requests without any circuit breaker still never wait beyond the timeout.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn without_the_breaker_every_request_waits_at_most_the_timeout() {
    let server = RedisServer::start();
    let store = RedisStore::connect(server.url()).await.unwrap();
    let limit = Limit::fixed_window(1_000, Duration::from_secs(3600)).unwrap();
    let layer = RateLimitLayer::new(limit)
        .with_key(GlobalKey)
        .with_store(store)
        .with_timeout(Some(TIMEOUT))
        .with_circuit_breaker(None::<CircuitBreaker>)
        .with_on_store_error(FailurePolicy::Deny);
    let app = Router::new()
        .route("/", get(|| async { "ok" }))
        .layer(layer);
    server.cli(&["CLIENT", "PAUSE", "1500", "ALL"]).unwrap();
    for _ in 0..5 {
        let started = Instant::now();
        assert_eq!(send(&app).await.status(), StatusCode::SERVICE_UNAVAILABLE);
        assert!(
            started.elapsed() < Duration::from_secs(1),
            "{:?}",
            started.elapsed()
        );
    }
}
