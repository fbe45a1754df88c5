//! An in-flight limit together with `max_wait`, on the memory store and on real Redis:
//! one store call takes the permit and reserves the rate limits (all-or-nothing); a full
//! cap answers 429 at once, reserving nothing; a request that waits holds its permit
//! (waiting requests count toward the cap) and gives it back when it is dropped; a
//! request that waits its turn and asks again asks with the cap; a rules change that
//! adds `max_wait` to in-flight rules is accepted.
//!
//! The stores' clocks are frozen (`ManualClock`): a reservation's wait is exact, and a
//! wait of a minute never ends during a test. Waits that must end are a few hundred ms
//! of real time, asserted with generous deadlines (never a fixed sleep race).

#[cfg(feature = "redis")]
use tollgate_test_support as support;

use std::{
    convert::Infallible,
    sync::{
        Arc,
        atomic::{AtomicUsize, Ordering},
    },
    time::{Duration, Instant},
};

use axum::body::Body;
use bytes::Bytes;
use http::{Request, Response, StatusCode};
use http_body_util::BodyExt;
use tokio::sync::Semaphore;
use tollgate::{
    Adjustment, Decision, InFlightLimit, Limit, RateLimitLayer,
    clock::ManualClock,
    count_after::RateLimitBody,
    key::{HeaderKey, Key, KeyExtractor},
    store::{Admitted, Capabilities, Capability, Check, MemoryStore, Permit, Reset, Store},
};
use tower::{Layer, Service, ServiceExt, service_fn};

const NOW_MS: u64 = 1_800_000_000_000;
/// How long a permit given back may take to be free again (Redis: a queued call).
const DEADLINE: Duration = Duration::from_secs(10);

type Answer = Response<RateLimitBody<Body>>;
type Svc = tower::util::BoxCloneSyncService<Request<Body>, Answer, Infallible>;

/// A store that counts the in-flight decisions it answered, and those that reserved.
#[derive(Debug, Clone)]
struct Counting {
    inner: Arc<dyn Store>,
    answered: Arc<AtomicUsize>,
    reserving: Arc<AtomicUsize>,
    others: Arc<AtomicUsize>,
    capabilities: Capabilities,
}

impl Counting {
    fn new(inner: Arc<dyn Store>) -> Self {
        let capabilities = inner.capabilities();
        Self {
            inner,
            answered: Arc::default(),
            reserving: Arc::default(),
            others: Arc::default(),
            capabilities,
        }
    }

    /// The same store claiming no [`Capability::Reserve`]: a layer on it never reserves.
    fn without_reserve(mut self) -> Self {
        let mut caps = Capabilities::NONE;
        for cap in Capability::ALL {
            if cap != Capability::Reserve && self.capabilities.contains(cap) {
                caps = caps.with(cap);
            }
        }
        self.capabilities = caps;
        self
    }

    fn answered(&self) -> usize {
        self.answered.load(Ordering::SeqCst)
    }

    /// Waits until `n` in-flight decisions were answered.
    async fn until_answered(&self, n: usize) {
        let start = Instant::now();
        while self.answered() < n {
            assert!(start.elapsed() < DEADLINE, "never decided");
            tokio::time::sleep(Duration::from_millis(5)).await;
        }
    }
}

impl Store for Counting {
    fn check(&self, key: &Key, limits: &[Limit], cost: u32) -> Check {
        self.others.fetch_add(1, Ordering::SeqCst);
        self.inner.check(key, limits, cost)
    }

    fn capabilities(&self) -> Capabilities {
        self.capabilities
    }

    fn reserve(&self, key: &Key, limits: &[Limit], cost: u32, max_wait_ms: u64) -> Check {
        self.others.fetch_add(1, Ordering::SeqCst);
        self.inner.reserve(key, limits, cost, max_wait_ms)
    }

    fn peek(&self, key: &Key, limits: &[Limit], cost: u32) -> Check {
        self.inner.peek(key, limits, cost)
    }

    fn reset(&self, key: &Key, limits: &[Limit]) -> Reset {
        self.inner.reset(key, limits)
    }

    fn adjust(&self, key: &Key, limits: &[Limit], adjustment: Adjustment) -> Check {
        self.inner.adjust(key, limits, adjustment)
    }

    fn check_in_flight(
        &self,
        key: &Key,
        limits: &[Limit],
        cost: u32,
        in_flight: &InFlightLimit,
        max_wait_ms: u64,
    ) -> Check<Admitted> {
        if max_wait_ms > 0 {
            self.reserving.fetch_add(1, Ordering::SeqCst);
        }
        let check = self
            .inner
            .check_in_flight(key, limits, cost, in_flight, max_wait_ms);
        let answered = self.answered.clone();
        Check::pending(async move {
            let result = check.await;
            answered.fetch_add(1, Ordering::SeqCst);
            result
        })
    }

    fn release_in_flight(
        &self,
        permit: Permit,
        limits: &[Limit],
        adjustment: Option<Adjustment>,
    ) -> Check {
        self.inner.release_in_flight(permit, limits, adjustment)
    }
}

/// The handler: 200 with a body that stays open until `gate` lets it end.
#[derive(Clone)]
struct App {
    gate: Arc<Semaphore>,
}

impl App {
    fn new() -> Self {
        Self {
            gate: Arc::new(Semaphore::new(0)),
        }
    }

    fn service(&self, layer: &RateLimitLayer<HeaderKey>) -> Svc {
        let gate = self.gate.clone();
        Svc::new(layer.layer(service_fn(move |_: Request<Body>| {
            let gate = gate.clone();
            async move {
                Ok::<_, Infallible>(Response::new(Body::from_stream(
                    futures_util::stream::once(async move {
                        gate.acquire().await.unwrap().forget();
                        Ok::<_, Infallible>(Bytes::from_static(b"done"))
                    }),
                )))
            }
        })))
    }

    /// Lets `answer`'s body end and reads it to its end: its permit goes back.
    async fn finish(&self, answer: Answer) {
        assert_eq!(answer.status(), StatusCode::OK);
        self.gate.add_permits(1);
        let mut body = answer.into_body();
        while let Some(frame) = body.frame().await {
            frame.unwrap();
        }
        assert!(!body.holds_permit());
    }
}

fn request(client: &str) -> Request<Body> {
    Request::get("/")
        .header("x-client", client)
        .body(Body::empty())
        .unwrap()
}

async fn send<S>(service: &mut S, client: &str) -> Answer
where
    S: Service<Request<Body>, Response = Answer, Error = Infallible>,
{
    let answer = service.ready().await.unwrap().call(request(client));
    tokio::time::timeout(Duration::from_secs(20), answer)
        .await
        .expect("answered")
        .unwrap()
}

/// At most `max` in flight; a denial by the cap would say `Retry-After: 30` (a cap denial
/// that waited would take that long).
fn cap(max: u32) -> InFlightLimit {
    InFlightLimit::new(max)
        .unwrap()
        .with_permit_ttl(Duration::from_secs(120))
        .with_retry_after(Duration::from_secs(30))
}

/// One per `every` (a GCRA with a burst of one), at most `max` in flight, waiting up to
/// `max_wait`, on `store`.
fn layer(
    store: Counting,
    every: Duration,
    max: u32,
    max_wait: Duration,
) -> RateLimitLayer<HeaderKey> {
    let limit = Limit::gcra(1, every).unwrap().with_burst(1).unwrap();
    RateLimitLayer::new(limit)
        .with_key(HeaderKey::new("x-client").unwrap())
        .with_store(store)
        .with_timeout(Some(Duration::from_secs(5)))
        .with_in_flight(cap(max))
        .with_max_wait(Some(max_wait))
}

/// A request that may wait is one store call: the permit taken and the rate limit
/// reserved together; it waits its 300 ms holding the permit, runs without asking again,
/// and gives the permit back when its body ends.
async fn reserves_with_its_permit_in_one_call(store: Arc<dyn Store>) {
    let store = Counting::new(store);
    let app = App::new();
    let layer = layer(
        store.clone(),
        Duration::from_millis(300),
        2,
        Duration::from_secs(2),
    );
    layer.validate().unwrap();
    let mut service = app.service(&layer);
    let first = send(&mut service, "a").await;
    app.finish(first).await;
    let started = Instant::now();
    let second = send(&mut service, "a").await;
    assert_eq!(second.status(), StatusCode::OK);
    assert!(
        started.elapsed() >= Duration::from_millis(250),
        "it waited its turn"
    );
    assert!(second.body().holds_permit());
    assert_eq!(store.answered(), 2, "one in-flight decision each");
    assert_eq!(
        store.reserving.load(Ordering::SeqCst),
        2,
        "both asked to reserve"
    );
    assert_eq!(
        store.others.load(Ordering::SeqCst),
        0,
        "no other decision call"
    );
    app.finish(second).await;
}

/// A full cap answers 429 at once, even with `max_wait`, and reserves nothing.
async fn a_full_cap_answers_at_once(store: Arc<dyn Store>) {
    let store = Counting::new(store);
    let app = App::new();
    // Two a minute: the first request leaves one unit.
    let limit = Limit::gcra(2, Duration::from_secs(60))
        .unwrap()
        .with_burst(2)
        .unwrap();
    let layer = RateLimitLayer::new(limit)
        .with_key(HeaderKey::new("x-client").unwrap())
        .with_store(store.clone())
        .with_timeout(Some(Duration::from_secs(5)))
        .with_in_flight(cap(1))
        .with_max_wait(Some(Duration::from_secs(120)));
    let mut service = app.service(&layer);
    let held = send(&mut service, "a").await;
    assert!(held.body().holds_permit());
    for _ in 0..3 {
        let started = Instant::now();
        let denied = send(&mut service, "a").await;
        assert_eq!(denied.status(), StatusCode::TOO_MANY_REQUESTS);
        assert_eq!(denied.headers()["retry-after"], "30");
        assert!(
            started.elapsed() < Duration::from_secs(5),
            "answered at once"
        );
        assert!(!denied.body().holds_permit());
    }
    app.finish(held).await;
    // The denials reserved nothing: the second unit is there, at once (a reservation by
    // a denial would make this one wait 30 s of a frozen clock: forever).
    let start = Instant::now();
    loop {
        let answer = send(&mut service, "a").await;
        if answer.status() == StatusCode::OK {
            assert!(start.elapsed() < Duration::from_secs(5));
            app.finish(answer).await;
            break;
        }
        // The first permit's release may still be on its way (Redis).
        assert_eq!(answer.headers()["retry-after"], "30");
        assert!(start.elapsed() < DEADLINE, "the permit never came back");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

/// A request that waits holds its permit: with a cap of 2, one running and one waiting
/// fill it (a third is 429 at once, though it could reserve); dropped while it waits, the
/// waiting one gives its permit back, and its reservation (the latest of its key) too.
async fn waiting_requests_hold_their_permits(store: Arc<dyn Store>) {
    let store = Counting::new(store);
    let app = App::new();
    let minute = Duration::from_secs(60);
    let layer = layer(store.clone(), minute, 2, Duration::from_secs(600));
    let limits = [Limit::gcra(1, minute).unwrap().with_burst(1).unwrap()];
    let key = HeaderKey::new("x-client")
        .unwrap()
        .extract(&request("a"))
        .unwrap();
    let mut service = app.service(&layer);
    let running = send(&mut service, "a").await;
    assert!(running.body().holds_permit());
    // Reserved for a minute on (a frozen clock: it waits until dropped).
    let waiting = {
        let mut service = service.clone();
        tokio::spawn(async move { send(&mut service, "a").await })
    };
    store.until_answered(2).await;
    let retry = |decision: Decision| decision.retry_after();
    assert_eq!(
        retry(store.inner.peek(&key, &limits, 1).await.unwrap()),
        2 * minute
    );
    // A third could reserve (2 minutes, within 10), but the cap is full: 429 at once.
    let started = Instant::now();
    let third = send(&mut service, "a").await;
    assert_eq!(third.status(), StatusCode::TOO_MANY_REQUESTS);
    assert!(
        started.elapsed() < Duration::from_secs(5),
        "answered at once"
    );
    // Another key is not held up.
    let other = send(&mut service, "b").await;
    app.finish(other).await;
    // The waiting request goes away: its permit comes back, and its units.
    waiting.abort();
    assert!(waiting.await.unwrap_err().is_cancelled());
    let start = Instant::now();
    let again = loop {
        let mut service = service.clone();
        let again = tokio::spawn(async move { send(&mut service, "a").await });
        let seen = store.answered();
        store.until_answered(seen + 1).await;
        if !again.is_finished() {
            break again;
        }
        // Denied by the cap: the permit is still on its way back (Redis).
        assert_eq!(again.await.unwrap().status(), StatusCode::TOO_MANY_REQUESTS);
        assert!(start.elapsed() < DEADLINE, "the permit never came back");
        tokio::time::sleep(Duration::from_millis(20)).await;
    };
    // It waits a minute, as the dropped one did (three minutes' wait next, not four):
    // the dropped one's units were given back.
    assert_eq!(
        retry(store.inner.peek(&key, &limits, 1).await.unwrap()),
        2 * minute
    );
    // It holds the second permit: the cap is full again.
    let started = Instant::now();
    let denied = send(&mut service, "a").await;
    assert_eq!(denied.status(), StatusCode::TOO_MANY_REQUESTS);
    assert!(started.elapsed() < Duration::from_secs(5));
    again.abort();
    let _ = again.await;
    app.finish(running).await;
}

/// A store that cannot reserve: a denied request waits its turn and asks again, with the
/// cap. Asked again while the cap is full, it is denied by the cap (before: asked without
/// the cap, it ran without a permit); asked again once a permit is free, it runs holding
/// one. (`clock`: the store's, moved on while the request waits.)
async fn asking_again_asks_with_the_cap(store: Arc<dyn Store>, clock: ManualClock) {
    let store = Counting::new(store).without_reserve();
    let app = App::new();
    let every = Duration::from_secs(2);
    let layer = layer(store.clone(), every, 1, Duration::from_secs(5));
    let mut service = app.service(&layer);
    // Another layer on the same store and key, with its own limit: its request holds the
    // key's one permit.
    let blocker_app = App::new();
    let blocker_layer = RateLimitLayer::new(
        Limit::per_minute(100)
            .unwrap()
            .with_name("blocker")
            .unwrap(),
    )
    .with_key(HeaderKey::new("x-client").unwrap())
    .with_store(store.clone())
    .with_timeout(Some(Duration::from_secs(5)))
    .with_in_flight(cap(1));
    let mut blocker = blocker_app.service(&blocker_layer);

    for cap_full in [true, false] {
        // The unit of the next 2 s is spent ...
        let first = until_ok(&mut service, &store).await;
        app.finish(first).await;
        let seen = store.answered();
        // ... so this one is denied by the rate limit (the cap has room, once the first
        // permit is back), and waits 2 s to ask again.
        let waiter = {
            let mut service = service.clone();
            tokio::spawn(async move { send(&mut service, "a").await })
        };
        store.until_answered(seen + 1).await;
        let blocking = if cap_full {
            Some(until_ok(&mut blocker, &store).await)
        } else {
            None
        };
        clock.advance(every);
        let waited = waiter.await.unwrap();
        if cap_full {
            assert_eq!(waited.status(), StatusCode::TOO_MANY_REQUESTS);
            assert_eq!(waited.headers()["retry-after"], "30", "denied by the cap");
            assert!(!waited.body().holds_permit());
            blocker_app.finish(blocking.unwrap()).await;
            // Its unit was not spent: the next one finds it.
        } else {
            assert!(waited.body().holds_permit());
            app.finish(waited).await;
            clock.advance(every);
        }
    }
    assert_eq!(store.reserving.load(Ordering::SeqCst), 0, "never reserves");
}

/// Sends until allowed (a permit given back may still be on its way: Redis).
async fn until_ok<S>(service: &mut S, store: &Counting) -> Answer
where
    S: Service<Request<Body>, Response = Answer, Error = Infallible>,
{
    let start = Instant::now();
    loop {
        let answer = send(service, "a").await;
        if answer.status() == StatusCode::OK {
            assert!(answer.body().holds_permit());
            return answer;
        }
        assert_eq!(
            answer.headers()["retry-after"],
            "30",
            "only the cap may deny"
        );
        assert!(start.elapsed() < DEADLINE, "the permit never came back");
        let _ = store;
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

/// Rules that add `max_wait` to in-flight rules are accepted, and requests then wait.
async fn a_swap_adds_max_wait(store: Arc<dyn Store>) {
    let store = Counting::new(store);
    let app = App::new();
    let limit = Limit::gcra(1, Duration::from_millis(300))
        .unwrap()
        .with_burst(1)
        .unwrap();
    let layer = RateLimitLayer::new(limit)
        .with_key(HeaderKey::new("x-client").unwrap())
        .with_store(store.clone())
        .with_timeout(Some(Duration::from_secs(5)))
        .with_in_flight(cap(2));
    let handle = layer.rules_handle();
    let mut service = app.service(&layer);
    let first = send(&mut service, "a").await;
    app.finish(first).await;
    let denied = send(&mut service, "a").await;
    assert_eq!(denied.status(), StatusCode::TOO_MANY_REQUESTS);
    let before = handle.version();
    let after = handle.set(handle.rules().with_max_wait(Some(Duration::from_secs(2))));
    assert!(after > before, "accepted");
    assert_eq!(handle.rules().max_wait(), Some(Duration::from_secs(2)));
    assert!(handle.rules().in_flight().is_some());
    let waited = send(&mut service, "a").await;
    assert_eq!(waited.status(), StatusCode::OK);
    assert!(waited.body().holds_permit());
    app.finish(waited).await;
}

fn memory() -> Arc<dyn Store> {
    memory_with(&ManualClock::new(NOW_MS))
}

fn memory_with(clock: &ManualClock) -> Arc<dyn Store> {
    Arc::new(MemoryStore::new().with_clock(clock.clone()))
}

#[test]
fn in_flight_with_max_wait_builds_in_either_order() {
    let wait = Some(Duration::from_secs(1));
    let base = || RateLimitLayer::new(Limit::per_minute(10).unwrap());
    base()
        .with_in_flight(cap(2))
        .with_max_wait(wait)
        .validate()
        .unwrap();
    base()
        .with_max_wait(wait)
        .with_in_flight(cap(2))
        .validate()
        .unwrap();
}

#[tokio::test]
async fn memory_reserves_with_its_permit_in_one_call() {
    reserves_with_its_permit_in_one_call(memory()).await;
}

#[tokio::test]
async fn memory_a_full_cap_answers_at_once() {
    a_full_cap_answers_at_once(memory()).await;
}

#[tokio::test]
async fn memory_waiting_requests_hold_their_permits() {
    waiting_requests_hold_their_permits(memory()).await;
}

#[tokio::test]
async fn memory_asking_again_asks_with_the_cap() {
    let clock = ManualClock::new(NOW_MS);
    asking_again_asks_with_the_cap(memory_with(&clock), clock).await;
}

#[tokio::test]
async fn memory_a_swap_adds_max_wait() {
    a_swap_adds_max_wait(memory()).await;
}

/// The reserved decision is the store's: exact in the memory store (a frozen clock).
#[tokio::test]
async fn memory_check_in_flight_reserves_and_takes_the_permit() {
    let store = MemoryStore::new().with_clock(ManualClock::new(NOW_MS));
    let limits = [Limit::gcra(1, Duration::from_secs(1))
        .unwrap()
        .with_burst(1)
        .unwrap()];
    let key = Key::new("a");
    let cap = cap(2);
    let (first, p1) = store
        .check_in_flight_now(&key, &limits, 1, &cap, 5_000)
        .into_parts();
    assert!(first.is_allowed() && first.wait_ms() == 0 && p1.is_some());
    let (second, p2) = store
        .check_in_flight_now(&key, &limits, 1, &cap, 5_000)
        .into_parts();
    assert!(second.is_allowed());
    assert_eq!(second.wait_ms(), 1_000);
    assert!(p2.is_some(), "the permit is taken with the reservation");
    // The cap is full: nothing is reserved.
    let (full, p3) = store
        .check_in_flight_now(&key, &limits, 1, &cap, 5_000)
        .into_parts();
    assert!(!full.is_allowed() && p3.is_none());
    assert_eq!(full.limits().len(), 2, "the cap's denial last");
    // A wait beyond max_wait takes nothing: the permit stays free (the wait is 2 s, not
    // 3 s: the full cap reserved nothing).
    store
        .release_in_flight(p2.unwrap(), &limits, None)
        .await
        .unwrap();
    let (beyond, p4) = store
        .check_in_flight_now(&key, &limits, 1, &cap, 500)
        .into_parts();
    assert!(!beyond.is_allowed() && p4.is_none());
    assert_eq!(beyond.limits().len(), 1, "denied by the limit, not the cap");
    assert_eq!(beyond.retry_after(), Duration::from_secs(2));
    let (taken, p5) = store
        .check_in_flight_now(&key, &limits, 1, &cap, 5_000)
        .into_parts();
    assert_eq!(taken.wait_ms(), 2_000);
    assert!(p5.is_some(), "the second permit was still free");
    store
        .release_in_flight(p1.unwrap(), &limits, None)
        .await
        .unwrap();
    store
        .release_in_flight(p5.unwrap(), &limits, None)
        .await
        .unwrap();
}

#[cfg(feature = "redis")]
mod redis {
    use super::*;
    use tollgate::store::RedisStore;

    async fn store(server: &support::RedisServer, clock: &ManualClock) -> Arc<dyn Store> {
        Arc::new(
            RedisStore::connect(server.url())
                .await
                .unwrap()
                .with_clock(clock.clone()),
        )
    }

    fn frozen() -> ManualClock {
        ManualClock::new(NOW_MS)
    }

    fn members(server: &support::RedisServer, client: &str) -> u64 {
        let key = format!("tollgate:{{header:x-client|{client}}}:inflight");
        server
            .cli(&["ZCARD", &key])
            .unwrap()
            .trim()
            .parse()
            .unwrap()
    }

    async fn released(server: &support::RedisServer, client: &str) {
        let start = Instant::now();
        while members(server, client) > 0 {
            assert!(start.elapsed() < DEADLINE, "the permit never came back");
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
    }

    #[tokio::test]
    async fn redis_reserves_with_its_permit_in_one_call() {
        let server = support::RedisServer::start();
        reserves_with_its_permit_in_one_call(store(&server, &frozen()).await).await;
        support::assert_every_key_expires(&server);
    }

    /// `INFO commandstats`: a request that waits is one script call (the permit and the
    /// reservation), and one more after its response (the permit's release); while it
    /// waits, its permit is in Redis.
    #[tokio::test]
    async fn redis_a_waiting_request_costs_one_decision_call_and_one_release_call() {
        let server = support::RedisServer::start();
        let store = Counting::new(store(&server, &frozen()).await);
        let app = App::new();
        let layer = layer(
            store.clone(),
            Duration::from_millis(400),
            2,
            Duration::from_secs(2),
        );
        let mut service = app.service(&layer);
        let warm = send(&mut service, "warm").await;
        app.finish(warm).await;
        released(&server, "warm").await;
        let first = send(&mut service, "a").await;
        app.finish(first).await;
        released(&server, "a").await;
        let before = server.script_calls();
        let waiting = {
            let mut service = service.clone();
            tokio::spawn(async move { send(&mut service, "a").await })
        };
        store.until_answered(3).await;
        assert_eq!(
            members(&server, "a"),
            1,
            "the permit is held while it waits"
        );
        let waited = waiting.await.unwrap();
        assert_eq!(waited.status(), StatusCode::OK);
        assert_eq!(server.script_calls(), before + 1, "one decision call");
        app.finish(waited).await;
        released(&server, "a").await;
        assert_eq!(server.script_calls(), before + 2, "and one release call");
        support::assert_every_key_expires(&server);
    }

    #[tokio::test]
    async fn redis_a_full_cap_answers_at_once() {
        let server = support::RedisServer::start();
        a_full_cap_answers_at_once(store(&server, &frozen()).await).await;
    }

    #[tokio::test]
    async fn redis_waiting_requests_hold_their_permits() {
        let server = support::RedisServer::start();
        waiting_requests_hold_their_permits(store(&server, &frozen()).await).await;
        released(&server, "a").await;
    }

    #[tokio::test]
    async fn redis_asking_again_asks_with_the_cap() {
        let server = support::RedisServer::start();
        let clock = frozen();
        asking_again_asks_with_the_cap(store(&server, &clock).await, clock).await;
    }

    #[tokio::test]
    async fn redis_a_swap_adds_max_wait() {
        let server = support::RedisServer::start();
        a_swap_adds_max_wait(store(&server, &frozen()).await).await;
    }

    /// The script's reservation with a permit decides as the memory store does, call by
    /// call (the reference for the in-flight limit with the rate limits), also when the
    /// cap is full and when the wait is beyond max_wait.
    #[tokio::test]
    async fn redis_reserves_with_a_permit_like_the_memory_store() {
        let server = support::RedisServer::start();
        let clock = frozen();
        let redis = store(&server, &clock).await;
        let memory = memory_with(&clock);
        let limits = [
            Limit::gcra(2, Duration::from_secs(1))
                .unwrap()
                .with_burst(2)
                .unwrap(),
            Limit::token_bucket(5, Duration::from_secs(10)).unwrap(),
        ];
        let cap = cap(3);
        let key = Key::new("a");
        let mut held: [Vec<Permit>; 2] = Default::default();
        // (cost, max wait, advance ms, release one)
        let steps = [
            (1, 2_000, 0, false),
            (1, 2_000, 0, false),
            (1, 2_000, 0, false),
            (1, 2_000, 0, false), // the cap is full
            (1, 2_000, 0, true),
            (2, 400, 0, false), // beyond max wait
            (1, 0, 0, false),   // a plain check
            (3, 5_000, 700, false),
            (1, 5_000, 100, true),
            (6, 5_000, 0, false), // dearer than the burst
        ];
        for (i, (cost, max_wait, advance, release)) in steps.into_iter().enumerate() {
            clock.advance(Duration::from_millis(advance));
            let mut answers = Vec::new();
            for (s, store) in [&memory, &redis].into_iter().enumerate() {
                if release && let Some(permit) = held[s].pop() {
                    store
                        .release_in_flight(permit, &limits, None)
                        .await
                        .unwrap();
                }
                let (decision, permit) = store
                    .check_in_flight(&key, &limits, cost, &cap, max_wait)
                    .await
                    .unwrap()
                    .into_parts();
                held[s].extend(permit);
                answers.push(decision);
            }
            let (m, r) = (&answers[0], &answers[1]);
            assert_eq!(m.is_allowed(), r.is_allowed(), "step {i}: {m:?} / {r:?}");
            assert_eq!(m.wait_ms(), r.wait_ms(), "step {i}");
            assert_eq!(m.limits(), r.limits(), "step {i}");
            assert_eq!(held[0].len(), held[1].len(), "step {i}");
        }
        let zset = "tollgate:{custom|a}:inflight";
        let count: u64 = server
            .cli(&["ZCARD", zset])
            .unwrap()
            .trim()
            .parse()
            .unwrap();
        assert_eq!(count, held[1].len() as u64);
    }
}

/// A Redis Cluster: the permit and the limits share the key's hash tag, so one script call
/// on the key's master takes the permit and reserves.
#[cfg(feature = "cluster")]
mod cluster {
    use super::*;
    use support::cluster::RedisCluster;
    use tollgate::store::{RedisStore, RedisTarget};

    async fn store(cluster: &RedisCluster) -> Arc<dyn Store> {
        Arc::new(
            RedisStore::connect(RedisTarget::cluster(&cluster.urls()))
                .await
                .unwrap()
                .with_clock(ManualClock::new(NOW_MS)),
        )
    }

    #[tokio::test]
    async fn cluster_in_flight_with_max_wait() {
        let cluster = RedisCluster::start();
        reserves_with_its_permit_in_one_call(store(&cluster).await).await;
        a_full_cap_answers_at_once(store(&cluster).await).await;
    }

    #[tokio::test]
    async fn cluster_waiting_requests_hold_their_permits() {
        let cluster = RedisCluster::start();
        waiting_requests_hold_their_permits(store(&cluster).await).await;
    }
}

/// Redis behind Sentinel: the same script on the master.
#[cfg(feature = "sentinel")]
mod sentinel {
    use super::*;
    use support::sentinel::{MASTER_NAME, SentinelSetup};
    use tollgate::store::{RedisStore, SentinelConfig};

    #[tokio::test]
    async fn sentinel_in_flight_with_max_wait() {
        let setup = SentinelSetup::start();
        let connect = || async {
            let store =
                RedisStore::connect(SentinelConfig::new(&setup.sentinel_urls(), MASTER_NAME))
                    .await
                    .unwrap()
                    .with_clock(ManualClock::new(NOW_MS));
            Arc::new(store) as Arc<dyn Store>
        };
        reserves_with_its_permit_in_one_call(connect().await).await;
        waiting_requests_hold_their_permits(connect().await).await;
    }
}
