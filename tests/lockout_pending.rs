//! Lockouts when counting after the response (issue 25, "Lockout counts only what is
//! kept"): a login endpoint where only 401s count, 5 a minute, a 15-minute lockout. Units
//! are spent up front and given back after a successful response, so requests still in
//! flight fill the limit (and may be denied 429 meanwhile); but only kept units start a
//! lockout. Through axum, on the memory store and on real Redis, with a `ManualClock`
//! (the Redis store sends it as the script's `now`) 20 s into a minute.

use tollgate_test_support as support;

use std::{
    sync::{
        Arc,
        atomic::{AtomicUsize, Ordering},
    },
    time::Duration,
};

use axum::{Router, body::Body, extract::State, routing::post};
use http::{Request, Response, StatusCode};
use tokio::{sync::Semaphore, time::timeout};
use tollgate::{
    Limit, RateLimitLayer,
    clock::ManualClock,
    key::GlobalKey,
    store::{MemoryStore, Store},
};
use tower::ServiceExt;

/// 20 s into a minute: the window has 40 s left.
const NOW_MS: u64 = 1_700_000_000_000;
const MINUTE: Duration = Duration::from_secs(60);
const LOCKOUT: Duration = Duration::from_secs(15 * 60);

/// 5 failed logins a minute; the one after that locks the client out for 15 minutes.
fn login() -> Limit {
    Limit::fixed_window(5, MINUTE)
        .unwrap()
        .with_name("login")
        .unwrap()
        .with_lockout(LOCKOUT)
        .unwrap()
}

/// Holds the slow logins until opened, and counts those inside the handler.
#[derive(Clone)]
struct Gate {
    open: Arc<Semaphore>,
    inside: Arc<AtomicUsize>,
}

impl Default for Gate {
    fn default() -> Self {
        Self {
            open: Arc::new(Semaphore::new(0)),
            inside: Arc::default(),
        }
    }
}

impl Gate {
    /// Waits (up to 5 s) until `n` slow logins are inside the handler.
    async fn inside(&self, n: usize) {
        timeout(Duration::from_secs(5), async {
            while self.inside.load(Ordering::SeqCst) < n {
                tokio::time::sleep(Duration::from_millis(1)).await;
            }
        })
        .await
        .expect("the slow logins reach the handler");
    }

    fn release(&self, n: usize) {
        self.open.add_permits(n);
    }
}

/// `x-login: ok` answers 200, `fail` 401; with `x-slow` the answer waits for the gate.
async fn handler(State(gate): State<Gate>, request: Request<Body>) -> StatusCode {
    let headers = request.headers();
    if headers.contains_key("x-slow") {
        gate.inside.fetch_add(1, Ordering::SeqCst);
        gate.open.acquire().await.unwrap().forget();
    }
    match headers.get("x-login").map(|v| v.as_bytes()) {
        Some(b"fail") => StatusCode::UNAUTHORIZED,
        _ => StatusCode::OK,
    }
}

/// The login route behind the layer: only 401s count.
fn app(store: impl Store, gate: &Gate) -> Router {
    let layer = RateLimitLayer::new(login())
        .with_key(GlobalKey)
        .with_store(store)
        .with_timeout(Some(Duration::from_secs(5)))
        .with_count_when(|response: &Response<Body>| response.status() == StatusCode::UNAUTHORIZED);
    Router::new()
        .route("/login", post(handler))
        .with_state(gate.clone())
        .layer(layer)
}

/// One login: `outcome` is `ok` or `fail`; `slow` waits for the gate.
async fn login_request(app: &Router, outcome: &str, slow: bool) -> Response<Body> {
    let mut request = Request::post("/login").header("x-login", outcome);
    if slow {
        request = request.header("x-slow", "1");
    }
    let request = request.body(Body::empty()).unwrap();
    timeout(Duration::from_secs(10), app.clone().oneshot(request))
        .await
        .expect("the login is answered")
        .unwrap()
}

fn retry_after(response: &Response<Body>) -> Option<String> {
    response
        .headers()
        .get("retry-after")
        .map(|v| v.to_str().unwrap().to_owned())
}

/// Six concurrent slow successful logins: five fill the limit while in flight, the sixth
/// is denied (429 until the window ends, 40 s), and none starts a lockout: once they
/// answer 200, the client logs in again at once.
async fn concurrent_slow_successful_logins_never_lock_out(store: impl Store) {
    let gate = Gate::default();
    let app = app(store, &gate);
    let logins: Vec<_> = (0..6)
        .map(|_| {
            let app = app.clone();
            tokio::spawn(async move { login_request(&app, "ok", true).await })
        })
        .collect();
    gate.inside(5).await;
    // The sixth finds the limit full of logins in flight.
    let mut answered = Vec::new();
    let mut waiting = Vec::new();
    for login in logins {
        if login.is_finished() {
            answered.push(login.await.unwrap());
        } else {
            waiting.push(login);
        }
    }
    timeout(Duration::from_secs(5), async {
        while answered.is_empty() {
            let index = waiting.iter().position(|l| l.is_finished());
            match index {
                Some(i) => answered.push(waiting.remove(i).await.unwrap()),
                None => tokio::time::sleep(Duration::from_millis(1)).await,
            }
        }
    })
    .await
    .expect("the sixth login is denied at once");
    assert_eq!(answered.len(), 1);
    assert_eq!(answered[0].status(), StatusCode::TOO_MANY_REQUESTS);
    assert_eq!(
        retry_after(&answered[0]).as_deref(),
        Some("40"),
        "no lockout"
    );
    gate.release(5);
    for login in waiting {
        assert_eq!(login.await.unwrap().status(), StatusCode::OK);
    }
    // Nothing was kept: five more logins pass, fast and slow.
    for i in 0..5 {
        let response = login_request(&app, "ok", false).await;
        assert_eq!(
            response.status(),
            StatusCode::OK,
            "login {i} after the burst"
        );
    }
}

/// Five kept failures fill the limit; the sixth attempt locks the client out for exactly
/// 15 minutes (from the breach, through the window's end); then the limit counts again.
async fn kept_failures_lock_out(store: impl Store, clock: &ManualClock) {
    let gate = Gate::default();
    let app = app(store, &gate);
    for i in 0..5 {
        let response = login_request(&app, "fail", false).await;
        assert_eq!(response.status(), StatusCode::UNAUTHORIZED, "failure {i}");
    }
    let breach = login_request(&app, "fail", false).await;
    assert_eq!(breach.status(), StatusCode::TOO_MANY_REQUESTS);
    assert_eq!(retry_after(&breach).as_deref(), Some("900"));
    // A successful login is locked out too, and does not extend the block.
    clock.advance(Duration::from_secs(60));
    let during = login_request(&app, "ok", false).await;
    assert_eq!(during.status(), StatusCode::TOO_MANY_REQUESTS);
    assert_eq!(retry_after(&during).as_deref(), Some("840"));
    clock.advance(Duration::from_millis(840_000 - 1));
    let last = login_request(&app, "ok", false).await;
    assert_eq!(last.status(), StatusCode::TOO_MANY_REQUESTS);
    assert_eq!(retry_after(&last).as_deref(), Some("1"));
    clock.advance(Duration::from_millis(1));
    assert_eq!(
        login_request(&app, "ok", false).await.status(),
        StatusCode::OK
    );
}

/// Four kept failures and one slow login in flight fill the limit: an attempt meanwhile
/// is denied without a lockout (the kept units leave it room). The slow one succeeds and
/// is given back; a fifth failure is kept, and the attempt after it locks out. The same
/// with a slow *failure* in flight: it is kept once it answers, and then the next
/// attempt locks out.
async fn mixed(store: impl Store, clock: &ManualClock) {
    let gate = Gate::default();
    let app = app(store, &gate);
    for _ in 0..4 {
        assert_eq!(
            login_request(&app, "fail", false).await.status(),
            StatusCode::UNAUTHORIZED
        );
    }
    let slow = {
        let app = app.clone();
        tokio::spawn(async move { login_request(&app, "ok", true).await })
    };
    gate.inside(1).await;
    let denied = login_request(&app, "fail", false).await;
    assert_eq!(denied.status(), StatusCode::TOO_MANY_REQUESTS);
    assert_eq!(retry_after(&denied).as_deref(), Some("40"), "no lockout");
    gate.release(1);
    assert_eq!(slow.await.unwrap().status(), StatusCode::OK);
    assert_eq!(
        login_request(&app, "fail", false).await.status(),
        StatusCode::UNAUTHORIZED
    );
    let breach = login_request(&app, "fail", false).await;
    assert_eq!(breach.status(), StatusCode::TOO_MANY_REQUESTS);
    assert_eq!(retry_after(&breach).as_deref(), Some("900"));

    // After the block, in a new window: four kept, one slow failure in flight.
    clock.advance(LOCKOUT);
    for _ in 0..4 {
        assert_eq!(
            login_request(&app, "fail", false).await.status(),
            StatusCode::UNAUTHORIZED
        );
    }
    let slow = {
        let app = app.clone();
        tokio::spawn(async move { login_request(&app, "fail", true).await })
    };
    gate.inside(2).await;
    let denied = login_request(&app, "ok", false).await;
    assert_eq!(denied.status(), StatusCode::TOO_MANY_REQUESTS);
    assert_ne!(retry_after(&denied).as_deref(), Some("900"), "no lockout");
    gate.release(1);
    assert_eq!(slow.await.unwrap().status(), StatusCode::UNAUTHORIZED);
    let breach = login_request(&app, "ok", false).await;
    assert_eq!(breach.status(), StatusCode::TOO_MANY_REQUESTS);
    assert_eq!(retry_after(&breach).as_deref(), Some("900"));
}

fn memory(clock: &ManualClock) -> MemoryStore {
    MemoryStore::new().with_clock(clock.clone())
}

#[tokio::test]
async fn concurrent_slow_successful_logins_never_lock_out_memory() {
    let clock = ManualClock::new(NOW_MS);
    concurrent_slow_successful_logins_never_lock_out(memory(&clock)).await;
}

#[tokio::test]
async fn kept_failures_lock_out_memory() {
    let clock = ManualClock::new(NOW_MS);
    kept_failures_lock_out(memory(&clock), &clock).await;
}

#[tokio::test]
async fn mixed_memory() {
    let clock = ManualClock::new(NOW_MS);
    mixed(memory(&clock), &clock).await;
}

#[cfg(feature = "redis")]
mod redis {
    use support::RedisServer;
    use tollgate::store::RedisStore;

    use super::*;

    /// Without the block cache, so that every decision is the script's.
    async fn store(server: &RedisServer, clock: &ManualClock, prefix: &str) -> RedisStore {
        RedisStore::connect(server.url())
            .await
            .unwrap()
            .with_prefix(prefix)
            .unwrap()
            .with_clock(clock.clone())
            .with_block_cache(None)
    }

    fn keys(server: &RedisServer, pattern: &str) -> Vec<String> {
        let mut keys: Vec<String> = server
            .cli(&["KEYS", pattern])
            .unwrap()
            .lines()
            .map(str::to_owned)
            .filter(|k| !k.is_empty())
            .collect();
        keys.sort();
        keys
    }

    #[tokio::test]
    async fn concurrent_slow_successful_logins_never_lock_out_redis() {
        let server = RedisServer::start();
        let clock = ManualClock::new(NOW_MS);
        concurrent_slow_successful_logins_never_lock_out(store(&server, &clock, "burst").await)
            .await;
        // No block was written; the pending units' record expires.
        assert!(keys(&server, "burst:*:lockout").is_empty());
        let pending = keys(&server, "burst:*:pending");
        assert_eq!(pending.len(), 1, "{pending:?}");
        assert!(
            pending[0].ends_with(":login:fw2:5:60000:pending"),
            "{pending:?}"
        );
        support::assert_every_key_expires(&server);
    }

    #[tokio::test]
    async fn kept_failures_lock_out_redis() {
        let server = RedisServer::start();
        let clock = ManualClock::new(NOW_MS);
        let kept = store(&server, &clock, "kept").await;
        let blocks = {
            let gate = Gate::default();
            let app = app(kept, &gate);
            for _ in 0..5 {
                login_request(&app, "fail", false).await;
            }
            assert_eq!(
                login_request(&app, "fail", false).await.status(),
                StatusCode::TOO_MANY_REQUESTS
            );
            keys(&server, "kept:*:lockout")
        };
        // The block: its end, and a TTL of the lockout (plus the 5 s a caller's clock
        // may lag Redis's).
        assert_eq!(blocks.len(), 1, "{blocks:?}");
        assert!(
            blocks[0].ends_with(":login:fw2:5:60000:lockout"),
            "{blocks:?}"
        );
        let read = |name: &str| server.cli(&[name, &blocks[0]]).unwrap().trim().to_owned();
        assert_eq!(read("GET"), (NOW_MS + 900_000).to_string());
        let ttl: u64 = read("PTTL").parse().unwrap();
        assert!((895_000..=905_000).contains(&ttl), "{ttl}");
        // The pending record lives until its window's units stop mattering: two windows
        // from the window's start (40 s + 60 s left), plus the 5 s.
        let pending = blocks[0].replace(":lockout", ":pending");
        let ttl: u64 = server
            .cli(&["PTTL", &pending])
            .unwrap()
            .trim()
            .parse()
            .unwrap();
        assert!((95_000..=105_000).contains(&ttl), "{ttl}");
        support::assert_every_key_expires(&server);

        let clock = ManualClock::new(NOW_MS);
        kept_failures_lock_out(store(&server, &clock, "story").await, &clock).await;
    }

    #[tokio::test]
    async fn mixed_redis() {
        let server = RedisServer::start();
        let clock = ManualClock::new(NOW_MS);
        mixed(store(&server, &clock, "mixed").await, &clock).await;
        support::assert_every_key_expires(&server);
    }
}
