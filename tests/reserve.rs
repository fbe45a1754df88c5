//! `RateLimitLayer::with_max_wait` with reservations (token bucket and GCRA): a request that
//! would fit within `max_wait` is counted at once for the moment it may run, waits, and
//! runs without asking the store again. Waiters are served in order at their reserved
//! times, a later request never overtakes them, none waits in vain, and a waiter that
//! hangs up gives its units back when it is the key's latest reservation.
//!
//! Memory-store tests run on Tokio's paused clock (the store reads a clock that follows
//! it, so times are exact); the Redis and cluster tests run in real time with generous
//! margins, and count the store calls to show each request asked exactly once.

#[cfg(feature = "redis")]
use tollgate_test_support as support;

use std::{
    convert::Infallible,
    sync::{
        Arc,
        atomic::{AtomicUsize, Ordering},
    },
    time::Duration,
};

use http::{Request, Response, StatusCode};
use parking_lot::Mutex;
use tokio::time::Instant;
use tollgate::{
    Adjustment, Limit, RateLimitLayer,
    clock::Clock,
    key::{HeaderKey, Key},
    store::{Check, MemoryStore, Store},
};
use tower::{Layer, Service, ServiceExt, service_fn};

/// Milliseconds on Tokio's clock.
#[derive(Debug, Clone)]
struct TokioClock {
    start: Instant,
}

const EPOCH_MS: u64 = 1_700_000_000_000;

impl Clock for TokioClock {
    fn now_ms(&self) -> u64 {
        EPOCH_MS + self.start.elapsed().as_millis() as u64
    }
}

/// A store that counts the calls made to it (checks and reservations, adjustments).
#[derive(Debug, Clone)]
struct Counting<S> {
    inner: S,
    asked: Arc<AtomicUsize>,
    adjusted: Arc<AtomicUsize>,
}

impl<S> Counting<S> {
    fn new(inner: S) -> Self {
        Self {
            inner,
            asked: Arc::default(),
            adjusted: Arc::default(),
        }
    }
}

impl<S: Store> Store for Counting<S> {
    fn capabilities(&self) -> tollgate::store::Capabilities {
        self.inner.capabilities()
    }

    fn check(&self, key: &Key, limits: &[Limit], cost: u32) -> Check {
        self.asked.fetch_add(1, Ordering::SeqCst);
        self.inner.check(key, limits, cost)
    }

    fn reserve(&self, key: &Key, limits: &[Limit], cost: u32, max_wait_ms: u64) -> Check {
        self.asked.fetch_add(1, Ordering::SeqCst);
        self.inner.reserve(key, limits, cost, max_wait_ms)
    }

    fn adjust(&self, key: &Key, limits: &[Limit], adjustment: Adjustment) -> Check {
        self.adjusted.fetch_add(1, Ordering::SeqCst);
        self.inner.adjust(key, limits, adjustment)
    }
}

type Svc = tower::util::BoxCloneService<Request<()>, Response<String>, Infallible>;

/// When each request ran (its `x-id`), in the order they ran, since `start`.
#[derive(Debug, Clone, Default)]
struct Runs(Arc<Mutex<Vec<(String, Duration)>>>);

impl Runs {
    fn take(&self) -> Vec<(String, Duration)> {
        std::mem::take(&mut self.0.lock())
    }
}

fn service<L>(layer: L, runs: &Runs, start: Instant) -> Svc
where
    L: Layer<Svc>,
    L::Service: Service<
            Request<()>,
            Response = Response<tollgate::count_after::RateLimitBody<String>>,
            Error = Infallible,
        > + Clone
        + Send
        + 'static,
    <L::Service as Service<Request<()>>>::Future: Send + 'static,
{
    let runs = runs.clone();
    let inner = service_fn(move |request: Request<()>| {
        let id = request.headers()["x-id"].to_str().unwrap().to_owned();
        runs.0.lock().push((id, start.elapsed()));
        async { Ok::<_, Infallible>(Response::new("ok".to_owned())) }
    });
    let layered = layer.layer(tower::util::BoxCloneService::new(inner));
    tower::util::BoxCloneService::new(tower::ServiceExt::map_response(
        layered,
        |response: Response<tollgate::count_after::RateLimitBody<String>>| {
            response.map(tollgate::count_after::RateLimitBody::into_inner)
        },
    ))
}

fn layer(limits: Vec<Limit>, store: impl Store, max_wait: Duration) -> RateLimitLayer<HeaderKey> {
    let mut limits = limits.into_iter();
    let mut layer = RateLimitLayer::new(limits.next().unwrap());
    for limit in limits {
        layer = layer.with_limit(limit);
    }
    layer
        .with_key(HeaderKey::new("x-key").unwrap())
        .with_store(store)
        .with_timeout(Some(Duration::from_secs(10)))
        .with_max_wait(Some(max_wait))
        .with_max_waiters(100, 10)
}

fn request(key: &str, id: &str) -> Request<()> {
    Request::get("/")
        .header("x-key", key)
        .header("x-id", id)
        .body(())
        .unwrap()
}

/// Sends a request on a task of its own and lets it be decided (the memory store decides
/// at once): it is then answered or waiting in line.
async fn start(service: &Svc, key: &str, id: &str) -> tokio::task::JoinHandle<Response<String>> {
    let mut service = service.clone();
    let request = request(key, id);
    let handle = tokio::spawn(async move {
        service.ready().await.unwrap();
        service.call(request).await.unwrap()
    });
    for _ in 0..3 {
        tokio::task::yield_now().await;
    }
    handle
}

async fn statuses(handles: Vec<tokio::task::JoinHandle<Response<String>>>) -> Vec<StatusCode> {
    let mut out = Vec::new();
    for handle in handles {
        out.push(handle.await.unwrap().status());
    }
    out
}

fn ms(ms: u64) -> Duration {
    Duration::from_millis(ms)
}

fn ids(runs: &[(String, Duration)]) -> Vec<&str> {
    runs.iter().map(|(id, _)| id.as_str()).collect()
}

/// GCRA, 10 a second with a burst of 2 (one every 100 ms): five requests beyond the burst
/// run at 100, 200, ... 500 ms, in the order they came; one that comes later, while they
/// wait, runs after all of them (at 600 ms), not first. Each asked the store once.
#[tokio::test(start_paused = true)]
async fn gcra_waiters_run_in_order_at_their_reserved_times() {
    let t0 = Instant::now();
    let clock = TokioClock { start: t0 };
    let store = Counting::new(MemoryStore::new().with_clock(clock));
    let limit = Limit::gcra(10, Duration::from_secs(1))
        .unwrap()
        .with_burst(2)
        .unwrap();
    let runs = Runs::default();
    let svc = service(layer(vec![limit], store.clone(), ms(1_000)), &runs, t0);
    let mut waiting = Vec::new();
    for i in 0..7 {
        waiting.push(start(&svc, "a", &format!("r{i}")).await);
    }
    // 150 ms later (r2 ran at 100), a newcomer: behind the others in line.
    tokio::time::sleep(ms(150)).await;
    waiting.push(start(&svc, "a", "late").await);
    assert!(statuses(waiting).await.iter().all(|s| *s == StatusCode::OK));
    let want: Vec<(String, Duration)> = [
        ("r0", 0),
        ("r1", 0),
        ("r2", 100),
        ("r3", 200),
        ("r4", 300),
        ("r5", 400),
        ("r6", 500),
        ("late", 600),
    ]
    .iter()
    .map(|&(id, t)| (id.to_owned(), ms(t)))
    .collect();
    assert_eq!(runs.take(), want);
    // One store call per request: nobody asked again, nobody waited in vain.
    assert_eq!(store.asked.load(Ordering::SeqCst), 8);
}

/// The token bucket, 4 a second with a burst of 4 and requests of cost 2: the bucket goes
/// into debt for the waiters, who run every 500 ms in order; a request beyond
/// `max_wait` is a 429 at once and changes nothing.
#[tokio::test(start_paused = true)]
async fn token_bucket_waiters_run_in_order_and_beyond_max_wait_is_a_429() {
    let t0 = Instant::now();
    let clock = TokioClock { start: t0 };
    let store = MemoryStore::new().with_clock(clock);
    let limit = Limit::token_bucket(4, Duration::from_secs(1)).unwrap();
    let runs = Runs::default();
    let layer = layer(vec![limit], store, ms(1_000)).with_cost(|_: &Request<()>| 2);
    let svc = service(layer, &runs, t0);
    let mut waiting = Vec::new();
    for i in 0..4 {
        waiting.push(start(&svc, "a", &format!("r{i}")).await);
    }
    // r2 waits 500 ms, r3 1000 ms; one more would wait 1500 ms: a 429 now.
    let denied = start(&svc, "a", "denied").await.await.unwrap();
    assert_eq!(denied.status(), StatusCode::TOO_MANY_REQUESTS);
    assert_eq!(denied.headers()["retry-after"], "2");
    assert!(statuses(waiting).await.iter().all(|s| *s == StatusCode::OK));
    let want: Vec<(String, Duration)> = [("r0", 0), ("r1", 0), ("r2", 500), ("r3", 1_000)]
        .iter()
        .map(|&(id, t)| (id.to_owned(), ms(t)))
        .collect();
    assert_eq!(runs.take(), want);
    // The denial took nothing: the bucket is empty at 1 s, and 500 ms later holds 2.
    tokio::time::sleep(ms(500)).await;
    let next = start(&svc, "a", "next").await.await.unwrap();
    assert_eq!(next.status(), StatusCode::OK);
    assert_eq!(runs.take(), [("next".to_owned(), ms(1_500))]);
}

/// A waiter that hangs up gives its units back when it is the key's latest
/// reservation: the next request takes its time. One in the middle of the line keeps
/// them (giving them back would let a newcomer run beside a waiter behind it); once the
/// waiters behind it are gone too, the last one's units go back.
#[tokio::test(start_paused = true)]
async fn a_hung_up_waiter_gives_its_units_back_when_it_is_the_latest() {
    let t0 = Instant::now();
    let clock = TokioClock { start: t0 };
    let store = Counting::new(MemoryStore::new().with_clock(clock));
    // One a second, burst 1.
    let limit = Limit::gcra(1, Duration::from_secs(1)).unwrap();
    let runs = Runs::default();
    let svc = service(layer(vec![limit], store.clone(), ms(5_000)), &runs, t0);
    let first = start(&svc, "a", "first").await.await.unwrap();
    assert_eq!(first.status(), StatusCode::OK);
    let b = start(&svc, "a", "b").await; // at 1 s
    let c = start(&svc, "a", "c").await; // at 2 s
    tokio::time::sleep(ms(100)).await;
    // "c" is the latest: its units go back, and "d" takes its time (2 s, not 3 s).
    hang_up(c).await;
    assert_eq!(store.adjusted.load(Ordering::SeqCst), 1);
    let d = start(&svc, "a", "d").await;
    // "b" is no longer the latest ("d" is behind it): hanging up, it keeps its units.
    hang_up(b).await;
    assert_eq!(store.adjusted.load(Ordering::SeqCst), 1);
    let e = start(&svc, "a", "e").await; // after "d" (2 s): 3 s
    assert_eq!(statuses(vec![d, e]).await, [StatusCode::OK, StatusCode::OK]);
    let want: Vec<(String, Duration)> = [("first", 0), ("d", 2_000), ("e", 3_000)]
        .iter()
        .map(|&(id, t)| (id.to_owned(), ms(t)))
        .collect();
    assert_eq!(runs.take(), want);
    // A waiter that reaches its time keeps its units: nothing more was given back.
    assert_eq!(store.adjusted.load(Ordering::SeqCst), 1);
}

/// A client that hangs up: its request's task is aborted (its future dropped).
async fn hang_up(handle: tokio::task::JoinHandle<Response<String>>) {
    handle.abort();
    assert!(handle.await.unwrap_err().is_cancelled());
}

/// Several limits reserve all-or-nothing: the longest wait of them is the wait, and every
/// limit counts the request for that moment; a request one of them could not reserve
/// within `max_wait` changes none. With a fixed window among the limits nothing is
/// reserved: the request waits and asks again, as before reservations.
#[tokio::test(start_paused = true)]
async fn several_limits_reserve_all_or_nothing() {
    let t0 = Instant::now();
    let clock = TokioClock { start: t0 };
    let store = Counting::new(MemoryStore::new().with_clock(clock.clone()));
    // 10 a second (burst 1), and 2 a second (burst 2).
    let fast = Limit::gcra(10, Duration::from_secs(1))
        .unwrap()
        .with_burst(1)
        .unwrap();
    let slow = Limit::token_bucket(2, Duration::from_secs(1)).unwrap();
    let limits = vec![fast.clone(), slow.clone()];
    let runs = Runs::default();
    let svc = service(layer(limits.clone(), store.clone(), ms(600)), &runs, t0);
    let mut waiting = Vec::new();
    for i in 0..4 {
        waiting.push(start(&svc, "a", &format!("r{i}")).await);
    }
    // r0 now; r1 after 100 ms (fast); r2 at 500 ms (slow: its 2 tokens are spent by r0
    // and r1); r3 would wait until 1000 ms: beyond 600, a 429, counted in neither.
    assert_eq!(
        statuses(waiting).await,
        [
            StatusCode::OK,
            StatusCode::OK,
            StatusCode::OK,
            StatusCode::TOO_MANY_REQUESTS
        ]
    );
    let want: Vec<(String, Duration)> = [("r0", 0), ("r1", 100), ("r2", 500)]
        .iter()
        .map(|&(id, t)| (id.to_owned(), ms(t)))
        .collect();
    assert_eq!(runs.take(), want);
    // At 1 s the slow bucket holds one token again (r2 left it a token in debt; the 429
    // took nothing), and the fast limit has room since 600 ms: one runs at once.
    tokio::time::sleep_until(t0 + ms(1_000)).await;
    let now = start(&svc, "a", "now").await.await.unwrap();
    assert_eq!(now.status(), StatusCode::OK);
    assert_eq!(runs.take(), [("now".to_owned(), ms(1_000))]);
    // Each asked once: the waiters ran at their reserved times without asking again.
    assert_eq!(store.asked.load(Ordering::SeqCst), 5);

    // With a fixed window beside the GCRA, nothing is reserved: the waiter asks again.
    let counting = Counting::new(MemoryStore::new().with_clock(clock));
    let window = Limit::fixed_window(100, Duration::from_secs(60)).unwrap();
    let svc = service(
        layer(vec![fast, window], counting.clone(), ms(600)),
        &runs,
        t0,
    );
    let now = t0.elapsed();
    let a = start(&svc, "b", "w0").await;
    let b = start(&svc, "b", "w1").await;
    assert_eq!(statuses(vec![a, b]).await, [StatusCode::OK, StatusCode::OK]);
    let ran = runs.take();
    assert_eq!(ran[1].1 - now, ms(100));
    assert_eq!(counting.asked.load(Ordering::SeqCst), 3, "asked again once");
}

/// On Redis (and a cluster): requests sent one after another beyond the burst are each
/// served in order, about one interval apart, every one with a single store call; a
/// later one runs after all of them; a waiter that hangs up gives its units back (the
/// next request takes its time). Real time, generous margins.
#[cfg(feature = "redis")]
async fn redis_waiters_in_order(store: tollgate::store::RedisStore) {
    let interval = ms(400);
    let store = Counting::new(store);
    let limit = Limit::gcra(1, interval).unwrap();
    let runs = Runs::default();
    let t0 = Instant::now();
    let svc = service(layer(vec![limit], store.clone(), ms(10_000)), &runs, t0);
    let send = |id: &str| {
        let mut svc = svc.clone();
        let request = request("k", id);
        tokio::spawn(async move {
            svc.ready().await.unwrap();
            svc.call(request).await.unwrap().status()
        })
    };
    // Each sent once the one before it has its answer (its reservation) from Redis.
    let answered = |n: usize| {
        let store = store.clone();
        async move {
            tokio::time::timeout(Duration::from_secs(10), async {
                while store.asked.load(Ordering::SeqCst) < n {
                    tokio::time::sleep(ms(5)).await;
                }
            })
            .await
            .expect("asked within 10 s");
            // Its answer, too: the reply follows the call within this.
            tokio::time::sleep(ms(30)).await;
        }
    };
    let mut handles = Vec::new();
    for i in 0..4 {
        handles.push(send(&format!("r{i}")));
        answered(i + 1).await;
    }
    // A hang-up: the latest waiter gives its units back...
    let gone = send("gone");
    answered(5).await;
    gone.abort();
    tokio::time::sleep(ms(50)).await;
    assert_eq!(
        store.adjusted.load(Ordering::SeqCst),
        1,
        "its units went back"
    );
    // ...and a newcomer takes its place, behind the four.
    handles.push(send("late"));
    for handle in handles {
        assert_eq!(handle.await.unwrap(), StatusCode::OK);
    }
    let runs = runs.take();
    assert_eq!(ids(&runs), ["r0", "r1", "r2", "r3", "late"]);
    for pair in runs.windows(2) {
        let gap = pair[1].1 - pair[0].1;
        // One interval apart (less what the Redis calls of the pair took apart).
        assert!(gap >= ms(300), "{runs:?}");
    }
    // "late" took the hung-up waiter's time: 4 intervals after r0, not 5.
    assert!(runs[4].1 - runs[0].1 < ms(1_900), "{runs:?}");
    // One store call per request.
    assert_eq!(store.asked.load(Ordering::SeqCst), 6);
}

#[cfg(feature = "redis")]
#[tokio::test]
async fn redis_waiters_run_in_order_and_a_hang_up_gives_its_units_back() {
    let server = support::RedisServer::start();
    let store = tollgate::store::RedisStore::connect(server.url())
        .await
        .unwrap();
    redis_waiters_in_order(store).await;
}

#[cfg(feature = "cluster")]
#[tokio::test]
async fn cluster_waiters_run_in_order_and_a_hang_up_gives_its_units_back() {
    let cluster = support::cluster::RedisCluster::start();
    let store = tollgate::store::RedisStore::connect(tollgate::store::RedisTarget::cluster(
        &cluster.urls(),
    ))
    .await
    .unwrap();
    redis_waiters_in_order(store).await;
}

/// The Redis store's block cache never answers a reservation with a denial whose wait it
/// could reserve, and never keeps a reservation as a denial: a key denied (and cached)
/// reserves in Redis all the same while its wait is within the bound.
#[cfg(feature = "redis")]
#[tokio::test]
async fn the_block_cache_never_stands_in_for_a_reservation() {
    use tollgate::clock::ManualClock;

    let server = support::RedisServer::start();
    let clock = ManualClock::new(EPOCH_MS);
    let store = tollgate::store::RedisStore::connect(server.url())
        .await
        .unwrap()
        .with_clock(clock.clone());
    let limits = [Limit::gcra(1, Duration::from_secs(1)).unwrap()];
    let key = Key::new("k");
    assert!(store.check(&key, &limits, 1).await.unwrap().is_allowed());
    // Denied, and cached as denied for a second.
    let denied = store.check(&key, &limits, 1).await.unwrap();
    assert_eq!(denied.retry_after(), ms(1_000));
    // Within 1.5 s: reserved in Redis (the cached denial does not answer it).
    let reserved = store.reserve(&key, &limits, 1, 1_500).await.unwrap();
    assert!(reserved.is_allowed());
    assert_eq!(reserved.wait(), ms(1_000));
    // The next would wait 2 s: denied, and cached.
    let denied = store.reserve(&key, &limits, 1, 1_500).await.unwrap();
    assert!(!denied.is_allowed());
    assert_eq!(denied.retry_after(), ms(2_000));
    // 600 ms on, the cached denial says 1.4 s: within the bound, so Redis reserves it.
    clock.advance(ms(600));
    let reserved = store.reserve(&key, &limits, 1, 1_500).await.unwrap();
    assert!(reserved.is_allowed());
    assert_eq!(reserved.wait(), ms(1_400));
    // And the reservation was not cached as a denial: a plain check asks Redis, which
    // answers the wait behind both reservations.
    let calls = server.script_calls();
    let denied = store.check(&key, &limits, 1).await.unwrap();
    assert_eq!(server.script_calls(), calls + 1);
    assert_eq!(denied.retry_after(), ms(2_400));
}
