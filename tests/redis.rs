//! RedisStore against a real redis-server: the default Redis clock, script reloading,
//! the key layout, and the bb8 pool.

#![cfg(feature = "redis")]

use tollgate_test_support as support;

use std::{convert::Infallible, num::NonZeroUsize, sync::Arc, time::Duration};

use http::{Request, Response, StatusCode};
use support::{RedisServer, logs::Logs};
use tollgate::{
    FailurePolicy, Limit, RateLimitLayer,
    key::{HeaderKey, Key},
    store::{RedisStore, Store},
};
use tower::{Layer, ServiceExt, service_fn};

/// Layers keyed by different extractors on one Redis keep separate budgets.
#[tokio::test]
async fn kinds_of_keys_never_share_state_in_redis() {
    let server = RedisServer::start();
    let store = uncached(&server)
        .await
        .with_clock(tollgate::clock::ManualClock::new(1_700_000_000_000));
    support::kinds::kinds_never_share_state(std::sync::Arc::new(store)).await;
    // Each kind's keys carry its namespace.
    let keys = server.cli(&["--scan"]).unwrap();
    for namespace in [
        "{ip|",
        "{global|",
        "{header:x-api-key|",
        "{header:x-user|",
        "{custom|",
        "{ext:",
    ] {
        assert!(keys.contains(namespace), "no {namespace} in {keys}");
    }
}

/// An API key as a client sends it.
const API_KEY: &str = "sk_live_0123456789abcdef";

/// The status of one request with `x-api-key: API_KEY` through a new layer keyed by `key`
/// on `store`, 10 per hour under the limit name `name`.
async fn with_api_key(store: &Arc<dyn Store>, key: HeaderKey, name: &str) -> StatusCode {
    let limit = Limit::fixed_window(10, Duration::from_secs(3600))
        .unwrap()
        .with_name(name)
        .unwrap();
    let layer = RateLimitLayer::new(limit)
        .with_store(store.clone())
        .with_key(key)
        .with_on_store_error(FailurePolicy::Allow)
        .with_timeout(Some(Duration::from_millis(500)));
    let service = layer.layer(service_fn(|_: Request<()>| async {
        Ok::<_, Infallible>(Response::new(String::new()))
    }));
    let request = Request::get("/")
        .header("x-api-key", API_KEY)
        .body(())
        .unwrap();
    tokio::time::timeout(Duration::from_secs(5), service.oneshot(request))
        .await
        .unwrap()
        .unwrap()
        .status()
}

/// The hash tag (`{...}`) of the one Redis key whose limit is named `name`.
fn tag_of(keys: &str, name: &str) -> String {
    let key = keys
        .lines()
        .find(|k| k.contains(&format!("}}:{name}:")))
        .unwrap_or_else(|| panic!("no key for {name} in {keys}"));
    let start = key.find('{').unwrap();
    let end = key.find('}').unwrap();
    key[start + 1..end].to_owned()
}

/// Hashed header keys never put the API key into Redis (checked on the server's own key
/// names), stay in the header's namespace, and differ by secret.
#[tokio::test]
async fn hashed_api_keys_never_reach_redis_in_clear() {
    let server = RedisServer::start();
    let store: Arc<dyn Store> = Arc::new(uncached(&server).await);
    let header = || HeaderKey::new("x-api-key").unwrap();
    for (key, name) in [
        (header(), "plain"),
        (header().hashed(), "sha"),
        (header().hashed_with("secret-one"), "one"),
        (header().hashed_with("secret-two"), "two"),
    ] {
        assert_eq!(with_api_key(&store, key, name).await, StatusCode::OK);
    }
    let keys = server.cli(&["--scan"]).unwrap();
    // The scan sees values: unhashed, the API key is in the key name.
    assert_eq!(
        tag_of(&keys, "plain"),
        format!("header:x-api-key|{API_KEY}")
    );
    let hashed: Vec<String> = ["sha", "one", "two"]
        .iter()
        .map(|name| tag_of(&keys, name))
        .collect();
    for tag in &hashed {
        assert!(tag.starts_with("header:x-api-key|#"), "{tag}");
        assert_eq!(tag.len(), "header:x-api-key|#".len() + 32, "{tag}");
    }
    assert_eq!(keys.matches("sk_live").count(), 1, "{keys}");
    assert!(hashed[0] != hashed[1] && hashed[1] != hashed[2] && hashed[0] != hashed[2]);
}

/// A store failure is logged at warn with the key's namespace and a short digest, never
/// the key's value.
#[tokio::test]
async fn store_failures_never_log_the_key() {
    let mut server = RedisServer::start();
    let store: Arc<dyn Store> = Arc::new(uncached(&server).await);
    server.kill();
    let (logs, _guard) = Logs::capture();
    let header = HeaderKey::new("x-api-key").unwrap();
    // Failed open: the request passes, and the failure is logged.
    assert_eq!(with_api_key(&store, header, "down").await, StatusCode::OK);
    let text = logs.text();
    let line = text
        .lines()
        .find(|l| l.contains("rate limit store failed"))
        .unwrap_or_else(|| panic!("no warning in {text}"));
    assert!(line.contains("WARN"), "{line}");
    assert!(line.contains("header:x-api-key|id:"), "{line}");
    assert!(!text.contains("sk_live"), "{text}");
}

fn hourly(limit: u32) -> [Limit; 1] {
    [Limit::fixed_window(limit, Duration::from_secs(3600)).unwrap()]
}

async fn allowed(store: &dyn Store, key: &str, limits: &[Limit], n: u32) -> u32 {
    let mut allowed = 0;
    for _ in 0..n {
        let decision = store.check(&Key::new(key), limits, 1).await.unwrap();
        allowed += u32::from(decision.is_allowed());
    }
    allowed
}

/// A store without the block cache, so that every decision reaches Redis.
async fn uncached(server: &RedisServer) -> RedisStore {
    RedisStore::connect(server.url())
        .await
        .unwrap()
        .with_block_cache(None)
}

#[tokio::test]
async fn redis_time_is_the_default_clock() {
    let server = RedisServer::start();
    let store = RedisStore::connect(server.url()).await.unwrap();
    // An hour-long window can only end during this test once per hour: accept either
    // "all 3 in one window" or a boundary crossing, which allows at most 6.
    let got = allowed(&store, "a", &hourly(3), 10).await;
    assert!((3..=6).contains(&got), "{got}");
    let denied = store.check(&Key::new("a"), &hourly(3), 1).await.unwrap();
    assert!(!denied.is_allowed());
    assert!(denied.retry_after() <= Duration::from_secs(3600));
    assert!(denied.retry_after() > Duration::ZERO);
    support::assert_every_key_expires(&server);
}

/// The write that opens a fixed window sets the key's TTL to the window's end; later
/// writes keep it (SET KEEPTTL), so however often the key is written, it expires when its
/// window ends, by Redis's clock.
#[tokio::test]
async fn a_fixed_window_key_expires_when_its_window_ends() {
    let server = RedisServer::start();
    let store = uncached(&server).await;
    let window_ms: i64 = 3_600_000;
    let limits = [Limit::fixed_window(100, Duration::from_millis(window_ms as u64)).unwrap()];
    let key = store.redis_key(&Key::new("k"), &limits[0]);
    let redis_now_ms = || {
        let time = server.cli(&["TIME"]).unwrap();
        let mut parts = time.lines().map(|p| p.trim().parse::<i64>().unwrap());
        parts.next().unwrap() * 1000 + parts.next().unwrap() / 1000
    };
    // Never straddle a window's end: the five writes take far less than 2 s.
    if window_ms - redis_now_ms() % window_ms < 2_000 {
        tokio::time::sleep(Duration::from_secs(2)).await;
    }
    for written in 1..=5 {
        assert_eq!(allowed(&store, "k", &limits, 1).await, 1);
        let now = redis_now_ms();
        let ttl: i64 = server.cli(&["PTTL", &key]).unwrap().trim().parse().unwrap();
        // What is left of the window, up to the milliseconds between the two reads.
        let to_window_end = window_ms - now % window_ms;
        assert!(
            (ttl - to_window_end).abs() <= 1_000,
            "write {written}: PTTL {ttl}, the window ends in {to_window_end} ms"
        );
    }
    support::assert_every_key_expires(&server);
}

#[tokio::test]
async fn script_flush_between_requests_keeps_decisions_correct() {
    let server = RedisServer::start();
    let store = uncached(&server).await;
    server.cli(&["CONFIG", "RESETSTAT"]).unwrap();
    let limits = hourly(5);
    let mut allowed_total = 0;
    for _ in 0..10 {
        server.flush_scripts();
        let decision = store.check(&Key::new("k"), &limits, 1).await.unwrap();
        allowed_total += u32::from(decision.is_allowed());
    }
    // Five allowed (or more only if the hour turned over, at most ten).
    assert!(allowed_total >= 5, "{allowed_total}");
    // SCRIPT FLUSH counts as SCRIPT before Redis 7: 10 flushes besides. (From Redis 7 on
    // the store calls the library, so it is the library that is loaded again each time.)
    let flushes = if support::redis_server_major_version() < 7 {
        10
    } else {
        0
    };
    assert_eq!(
        server.script_loads(),
        10 + flushes,
        "the script was reloaded after each flush"
    );
}

#[tokio::test]
async fn keys_follow_the_documented_layout() {
    let server = RedisServer::start();
    let store = RedisStore::connect(server.url())
        .await
        .unwrap()
        .with_prefix("app")
        .unwrap();
    let limits = [
        Limit::fixed_window(5, Duration::from_secs(60)).unwrap(),
        Limit::token_bucket(5, Duration::from_secs(1))
            .unwrap()
            .with_name("burst")
            .unwrap(),
    ];
    store.check(&Key::new("user:1"), &limits, 1).await.unwrap();
    let mut keys: Vec<String> = server
        .cli(&["--scan"])
        .unwrap()
        .lines()
        .map(str::to_owned)
        .collect();
    keys.sort();
    assert_eq!(
        keys,
        [
            "app:{custom|user:1}:burst:tb:5:1000:5",
            "app:{custom|user:1}:fw2:5:60000"
        ]
    );
    assert_eq!(store.redis_key(&Key::new("user:1"), &limits[0]), keys[1]);
    // Both keys of one identity hash to one slot.
    let slot = |key: &str| server.cli(&["CLUSTER", "KEYSLOT", key]);
    assert_eq!(slot(&keys[0]), slot(&keys[1]));
}

#[tokio::test]
async fn hostile_identities_stay_bounded_and_apart() {
    let server = RedisServer::start();
    let store = RedisStore::connect(server.url()).await.unwrap();
    let limits = hourly(1);
    let hostile: Vec<Vec<u8>> = vec![
        b"a".to_vec(),
        b"{a}".to_vec(),
        b"a}".to_vec(),
        b"%7Ba%7D".to_vec(),
        b"a\r\nFLUSHALL\r\n".to_vec(),
        vec![0xff, 0xfe, 0],
        vec![b'x'; 8192],
        vec![b'x'; 8193],
    ];
    for identity in &hostile {
        let decision = store.check(&Key::new(identity), &limits, 1).await.unwrap();
        assert!(decision.is_allowed(), "{identity:?} shared a bucket");
    }
    let keys = server.cli(&["--scan"]).unwrap();
    assert_eq!(keys.lines().count(), hostile.len());
    for key in keys.lines() {
        assert!(key.len() <= 160, "unbounded key {key:?}");
        assert_eq!(key.matches('{').count(), 1, "{key}");
    }
    support::assert_every_key_expires(&server);
}

#[tokio::test]
async fn a_batch_of_limits_with_every_algorithm_shares_one_call() {
    let server = RedisServer::start();
    let store = uncached(&server).await;
    let limits = [
        Limit::fixed_window(3, Duration::from_secs(3600)).unwrap(),
        Limit::sliding_window(3, Duration::from_secs(3600)).unwrap(),
        Limit::sliding_window_counter(3, Duration::from_secs(3600)).unwrap(),
        Limit::token_bucket(3, Duration::from_secs(3600)).unwrap(),
        Limit::gcra(3, Duration::from_secs(3600)).unwrap(),
    ];
    // Load the script first, so that the count below is one EVALSHA per decision.
    store.check(&Key::new("warm-up"), &limits, 1).await.unwrap();
    server.cli(&["CONFIG", "RESETSTAT"]).unwrap();
    let got = allowed(&store, "k", &limits, 5).await;
    assert!((3..=4).contains(&got), "{got}");
    assert_eq!(server.script_calls(), 5);
    support::assert_every_key_expires(&server);
}

/// Decisions waiting at the same moment go to Redis as one script call, which reads a
/// key that many of them share once and writes it once.
#[tokio::test]
async fn a_coalesced_batch_reads_and_writes_a_hot_key_once() {
    let server = RedisServer::start();
    let store = uncached(&server).await;
    let hot = Key::new("hot");
    let limit = hourly(30);
    store.check(&Key::new("warm-up"), &limit, 1).await.unwrap();
    server.cli(&["CONFIG", "RESETSTAT"]).unwrap();
    // Submitted before any is awaited: the batching task takes all 100 at once.
    let checks: Vec<_> = (0..100).map(|_| store.check(&hot, &limit, 1)).collect();
    let decisions = futures_util::future::join_all(checks).await;
    let allowed: Vec<bool> = decisions
        .iter()
        .map(|d| d.as_ref().unwrap().is_allowed())
        .collect();
    // In order: the first 30 fit, the rest do not.
    assert_eq!(allowed, (0..100).map(|i| i < 30).collect::<Vec<_>>());
    let remaining: Vec<u64> = decisions
        .iter()
        .map(|d| d.as_ref().unwrap().limits()[0].remaining)
        .collect();
    assert_eq!(
        remaining[..31],
        (0..31).map(|i| 29u64.saturating_sub(i)).collect::<Vec<_>>()[..]
    );
    assert_eq!(
        (
            server.script_calls(),
            server.calls("get"),
            server.calls("set")
        ),
        (1, 1, 1)
    );
    assert!(!store.check(&hot, &limit, 1).await.unwrap().is_allowed());
    support::assert_every_key_expires(&server);
}

/// A call of one request against one fixed window goes to the library's function for
/// that shape (`<library>_fw`, lua/one.lua) on Redis 7+, to the script on Redis 6; after
/// `FUNCTION FLUSH` the library is loaded again, and every decision counts once.
#[tokio::test]
async fn one_request_on_one_fixed_window_has_a_function_of_its_own() {
    let server = RedisServer::start();
    let store = uncached(&server).await;
    let limit = hourly(5);
    let key = Key::new("one");
    server
        .cli(&["CONFIG", "SET", "slowlog-log-slower-than", "0"])
        .unwrap();
    server.cli(&["SLOWLOG", "RESET"]).unwrap();
    assert_eq!(allowed(&store, "one", &limit, 3).await, 3);
    let log = server.cli(&["SLOWLOG", "GET", "100"]).unwrap();
    let lean = log.lines().filter(|l| l.trim().ends_with("_fw")).count();
    if support::redis_server_major_version() >= 7 {
        assert_eq!(lean, 3, "{log}");
    } else {
        assert_eq!(lean, 0, "{log}");
        assert_eq!(server.calls("evalsha"), 3);
    }
    server.flush_scripts();
    assert_eq!(allowed(&store, "one", &limit, 3).await, 2);
    let value = server
        .cli(&["GET", &store.redis_key(&key, &limit[0])])
        .unwrap();
    assert_eq!(support::fixed_window_count(&value), 5);
    support::assert_every_key_expires(&server);
}

/// Cold keys (one fixed window each, one request per key in a batch) take the lean path:
/// each is one `INCRBY` that keeps its key's TTL, no `GET` and no `SET` once the window
/// is open; a denial is counted back with a second `INCRBY`. On Redis 7+ the batch is one
/// call of the library's function for many (`<library>_fwn`), loaded again after a
/// `FUNCTION FLUSH`.
#[tokio::test]
async fn a_batch_of_cold_keys_counts_each_with_one_incrby() {
    let server = RedisServer::start();
    let store = uncached(&server).await;
    server
        .cli(&["CONFIG", "SET", "slowlog-log-slower-than", "0"])
        .unwrap();
    let limit = hourly(2);
    let keys: Vec<Key> = (0..20).map(|i| Key::new(format!("client-{i}"))).collect();
    let round = || async {
        // Submitted before any is awaited: the batching task takes all 20 at once.
        let checks: Vec<_> = keys.iter().map(|key| store.check(key, &limit, 1)).collect();
        futures_util::future::join_all(checks)
            .await
            .into_iter()
            .map(|d| {
                let d = d.unwrap();
                (d.is_allowed(), d.limits()[0].remaining)
            })
            .collect::<Vec<_>>()
    };
    // The first opens each key's window (INCRBY on no key, then SET PX).
    assert_eq!(round().await, vec![(true, 1); 20]);
    server.cli(&["CONFIG", "RESETSTAT"]).unwrap();
    assert_eq!(round().await, vec![(true, 0); 20]);
    let counts = || {
        (
            server.script_calls(),
            server.calls("incrby"),
            server.calls("get"),
            server.calls("set"),
        )
    };
    assert_eq!(counts(), (1, 20, 0, 0));
    let log = server.cli(&["SLOWLOG", "GET", "1000"]).unwrap();
    let shared = log.lines().filter(|l| l.trim().ends_with("_fwn")).count();
    let functions = support::redis_server_major_version() >= 7;
    assert_eq!(shared, usize::from(functions) * 2, "{log}");
    server.flush_scripts();
    server.cli(&["CONFIG", "RESETSTAT"]).unwrap();
    assert_eq!(round().await, vec![(false, 0); 20]);
    // After the flush: the call that met no function (or NOSCRIPT), then the same again.
    assert_eq!(counts(), (2, 40, 0, 0));
    for key in &keys {
        let value = server
            .cli(&["GET", &store.redis_key(key, &limit[0])])
            .unwrap();
        assert_eq!(support::fixed_window_count(&value), 2, "{key:?}");
    }
    support::assert_every_key_expires(&server);
}

/// Decisions still queued or on the wire when the last clone of the store goes get
/// their answers: the batching task sends what waits and finishes its calls before it
/// ends.
#[tokio::test]
async fn decisions_in_flight_when_the_store_goes_are_answered() {
    let server = RedisServer::start();
    let store = uncached(&server).await;
    let limit = hourly(1_000);
    // More than two calls' worth (128 decisions each, two on the wire at once), on keys
    // of their own; none has run yet on this single-threaded runtime.
    let checks: Vec<_> = (0..600)
        .map(|i| store.check(&Key::new(format!("client-{i}")), &limit, 1))
        .collect();
    drop(store);
    for (i, decision) in futures_util::future::join_all(checks)
        .await
        .into_iter()
        .enumerate()
    {
        let decision = decision.unwrap_or_else(|e| panic!("decision {i}: {e}"));
        assert!(decision.is_allowed(), "decision {i}");
    }
    assert_eq!(server.script_calls(), 5);
}

#[cfg(feature = "bb8")]
#[tokio::test]
async fn a_bb8_pool_works_too() {
    use bb8_redis::{RedisConnectionManager, bb8};

    let server = RedisServer::start();
    let manager = RedisConnectionManager::new(server.url()).unwrap();
    let pool = bb8::Pool::builder()
        .max_size(4)
        .build(manager)
        .await
        .unwrap();
    let store = RedisStore::from_pool(pool);
    assert_eq!(allowed(&store, "a", &hourly(3), 10).await % 3, 0);
}

#[tokio::test]
async fn a_bad_url_is_an_error_not_a_panic() {
    assert!(RedisStore::connect("not a url").await.is_err());
    let port = support::free_port();
    assert!(
        RedisStore::connect(format!("redis://127.0.0.1:{port}"))
            .await
            .is_err()
    );
}

/// One builder step of a [`RedisStore`].
#[derive(Debug, Clone, Copy)]
enum Step {
    Clock,
    NoBlockCache,
    Coalescing(Option<NonZeroUsize>),
}

fn apply(store: RedisStore, step: Step, clock: &tollgate::clock::ManualClock) -> RedisStore {
    match step {
        Step::Clock => store.with_clock(clock.clone()),
        Step::NoBlockCache => store.with_block_cache(None),
        Step::Coalescing(max) => store.with_coalescing(max),
    }
}

fn permutations(steps: [Step; 3]) -> Vec<[Step; 3]> {
    let [a, b, c] = steps;
    vec![
        [a, b, c],
        [a, c, b],
        [b, a, c],
        [b, c, a],
        [c, a, b],
        [c, b, a],
    ]
}

/// How a store behaves: whether decisions beyond a queue of 1 are refused at once
/// (coalescing on, with the queue limit), and whether the time is the explicit clock's.
async fn behaviour(store: &RedisStore, key: &str) -> (usize, bool) {
    let limits = hourly(100);
    // Submitted together, before the batching task (on this current-thread runtime) runs.
    let checks: Vec<_> = (0..20)
        .map(|i| store.check(&Key::new(format!("{key}-{i}")), &limits, 1))
        .collect();
    let refused = checks.iter().filter(|c| c.is_ready()).count();
    // Let the queued ones through, so that the queue is empty again.
    futures_util::future::join_all(checks.into_iter().filter(|c| !c.is_ready())).await;
    let decision = store.check(&Key::new(key), &limits, 1).await.unwrap();
    // The manual clock stands 1 s into an hour-long window; Redis's clock does not.
    let on_the_clock = decision.limits()[0].reset_after_ms == 3_599_000;
    (refused, on_the_clock)
}

/// `with_clock`, `with_block_cache` and `with_coalescing` give the same store in any
/// order: once, a clock or a block cache set after coalescing rebuilt the batching task
/// with the default queue.
#[tokio::test]
async fn builder_calls_give_the_same_store_in_any_order() {
    let server = RedisServer::start();
    let clock = tollgate::clock::ManualClock::new(3_600_000 * 500_000 + 1_000);
    let connected = uncached(&server).await;
    let cases = [
        (Step::Coalescing(None), (0, true)),
        (Step::Coalescing(NonZeroUsize::new(1)), (19, true)),
    ];
    for (coalescing, expected) in cases {
        for (i, order) in permutations([Step::Clock, Step::NoBlockCache, coalescing])
            .into_iter()
            .enumerate()
        {
            let store = order
                .iter()
                .fold(connected.clone(), |store, &step| apply(store, step, &clock));
            let got = behaviour(&store, &format!("{coalescing:?}-{i}")).await;
            assert_eq!(got, expected, "{order:?}");
        }
    }
}

/// A store first used in a runtime that then shuts down keeps working in the next one:
/// the batching task is started again on the runtime that needs it.
#[test]
fn a_store_outlives_the_runtime_it_was_first_used_in() {
    let server = RedisServer::start();
    let limits = hourly(5);
    let first = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap();
    let store = first.block_on(async {
        let store = uncached(&server).await;
        let decision = store.check(&Key::new("k"), &limits, 1).await.unwrap();
        assert!(decision.is_allowed());
        store
    });
    drop(first);
    for round in 0..2 {
        let next = tokio::runtime::Builder::new_multi_thread()
            .worker_threads(1)
            .enable_all()
            .build()
            .unwrap();
        next.block_on(async {
            let check = store.check(&Key::new("k"), &limits, 1);
            let decision = tokio::time::timeout(Duration::from_secs(10), check)
                .await
                .expect("a decision hung")
                .unwrap_or_else(|e| {
                    panic!("round {round}: {e}: {:?}", std::error::Error::source(&e))
                });
            assert!(decision.is_allowed());
            assert_eq!(decision.remaining(), Some(3 - round));
        });
    }
}

/// A plain connection for the test's own reads (faster than `redis-cli`, so that the
/// moments read around a check are close together).
async fn raw(server: &RedisServer) -> redis::aio::MultiplexedConnection {
    support::test_connection(&server.url()).await
}

/// Redis's clock, in ms.
async fn redis_ms(conn: &mut redis::aio::MultiplexedConnection) -> u64 {
    let (s, us): (u64, u64) = redis::cmd("TIME").query_async(conn).await.unwrap();
    s * 1000 + us / 1000
}

/// The TTL margin the script adds when the caller sends its own clock (lua/prelude.lua):
/// that clock may lag Redis's by up to this much.
const EXPLICIT_CLOCK_MARGIN_MS: u64 = 5_000;

/// Every algorithm's key lives exactly as long as its state matters, after every write:
/// its expiry time (PEXPIRETIME, on Redis's clock) is the moment of the script plus the
/// decision's `reset_after` (which `lua_model` holds equal to the model's, and the model
/// holds equal to when its state stops mattering), plus the margin with an explicit
/// clock. The moment of the script is only known to lie between two reads of Redis's
/// clock, so each bound is widened by that bracket and no more: a key that could vanish
/// earlier, by any amount beyond the bracket, fails the lower bound; one kept much longer
/// fails the upper.
async fn every_key_lives_as_long_as_its_state_matters(clock_behind_redis_ms: Option<u64>) {
    let server = RedisServer::start();
    let mut conn = raw(&server).await;
    let clock = tollgate::clock::ManualClock::new(0);
    let store = match clock_behind_redis_ms {
        Some(_) => uncached(&server).await.with_clock(clock.clone()),
        None => uncached(&server).await,
    };
    let margin = clock_behind_redis_ms.map_or(0, |_| EXPLICIT_CLOCK_MARGIN_MS);
    let window = Duration::from_secs(1);
    let limits = [
        Limit::fixed_window(10, window).unwrap(),
        Limit::sliding_window(10, window).unwrap(),
        Limit::sliding_window_counter(10, window).unwrap(),
        Limit::token_bucket(10, window).unwrap(),
        Limit::gcra(10, window).unwrap(),
    ];
    // (pause before, cost): two windows and a bit, with several writes in each.
    let schedule = [
        (0, 1),
        (0, 2),
        (300, 1),
        (0, 0),
        (800, 1),
        (10, 3),
        (1_100, 1),
    ];
    let mut widest = 0;
    for (step, (pause_ms, cost)) in schedule.into_iter().enumerate() {
        tokio::time::sleep(Duration::from_millis(pause_ms)).await;
        for limit in &limits {
            let key = Key::new("k");
            let before = redis_ms(&mut conn).await;
            if let Some(behind) = clock_behind_redis_ms {
                clock.set(before - behind);
            }
            let decision = store
                .check(&key, std::slice::from_ref(limit), cost)
                .await
                .unwrap();
            let after = redis_ms(&mut conn).await;
            assert!(decision.is_allowed(), "step {step}: {limit:?}");
            if cost == 0 {
                continue;
            }
            widest = widest.max(after - before);
            let redis_key = store.redis_key(&key, limit);
            let expires: i64 = redis::cmd("PEXPIRETIME")
                .arg(&redis_key)
                .query_async(&mut conn)
                .await
                .unwrap();
            let lives = decision.limits()[0].reset_after_ms + margin;
            // The fixed window keeps the TTL of the write that opened its window
            // (KEEPTTL), so that write's bracket counts too: the widest so far. And 1 ms
            // for Redis TIME's truncation to ms.
            let (low, high) = (before + lives - widest - 1, after + lives + widest + 1);
            assert!(
                (low..=high).contains(&(expires as u64)),
                "step {step}, {limit:?}: expires at {expires}, its state matters until \
                 {before}..{after} + {lives} ms"
            );
        }
    }
    support::assert_every_key_expires(&server);
}

/// Item 9 of the hardening issue, with the script reading Redis TIME.
#[tokio::test]
async fn every_key_lives_as_long_as_its_state_matters_by_redis_time() {
    every_key_lives_as_long_as_its_state_matters(None).await;
}

/// Item 9 of the hardening issue, with the caller's clock (2 s behind Redis's) sent as
/// the script's `now`.
#[tokio::test]
async fn every_key_lives_as_long_as_its_state_matters_by_an_explicit_clock() {
    every_key_lives_as_long_as_its_state_matters(Some(2_000)).await;
}

/// A sliding-window request of any cost writes one sorted-set member: the log holds
/// weighted entries (one per millisecond with requests), so a decision's Redis work and
/// the key's memory do not grow with the cost.
#[tokio::test]
async fn an_expensive_request_writes_one_log_entry() {
    let server = RedisServer::start();
    let clock = tollgate::clock::ManualClock::new(1_700_000_000_000);
    let store = uncached(&server).await.with_clock(clock.clone());
    let limits = [Limit::sliding_window(
        tollgate::MAX_SLIDING_WINDOW_LIMIT,
        Duration::from_secs(3600),
    )
    .unwrap()];
    let key = Key::new("big");
    let redis_key = store.redis_key(&key, &limits[0]);
    store.check(&Key::new("warm-up"), &limits, 1).await.unwrap();
    server.cli(&["CONFIG", "RESETSTAT"]).unwrap();
    let d = store.check(&key, &limits, 99_990).await.unwrap();
    assert!(d.is_allowed());
    assert_eq!(d.limits()[0].remaining, 10);
    let card = |server: &RedisServer| -> u64 {
        server
            .cli(&["ZCARD", &redis_key])
            .unwrap()
            .trim()
            .parse()
            .unwrap()
    };
    assert_eq!(card(&server), 1);
    assert_eq!(server.calls("zadd"), 1);
    let bytes: u64 = server
        .cli(&["MEMORY", "USAGE", &redis_key])
        .unwrap()
        .trim()
        .parse()
        .unwrap();
    assert!(bytes < 512, "{bytes} bytes for one entry");
    // The same millisecond again: the entry grows, no new member.
    assert!(store.check(&key, &limits, 4).await.unwrap().is_allowed());
    assert_eq!(card(&server), 1);
    // Later, a new entry; the limit holds, counted exactly across entries.
    clock.advance(Duration::from_millis(5));
    assert!(store.check(&key, &limits, 6).await.unwrap().is_allowed());
    assert_eq!(card(&server), 2);
    let denied = store.check(&key, &limits, 1).await.unwrap();
    assert!(!denied.is_allowed());
    assert_eq!(denied.limits()[0].remaining, 0);
    // The oldest unit is in the first entry: it leaves when that entry does.
    assert_eq!(denied.retry_after(), Duration::from_millis(3_600_000 - 5));
    // One more unit than the first entry's 99 994 needs the second one gone too.
    clock.advance(Duration::from_millis(3_600_000 - 5));
    assert!(
        !store
            .check(&key, &limits, 99_995)
            .await
            .unwrap()
            .is_allowed()
    );
    assert!(
        store
            .check(&key, &limits, 99_994)
            .await
            .unwrap()
            .is_allowed()
    );
    assert_eq!(card(&server), 2);
    support::assert_every_key_expires(&server);
}

/// Earlier builds kept the sliding-window log as one member per unit under limit id
/// `sw`; the weighted log lives under `sw2`. During a rolling upgrade the old format is
/// never read, so it cannot be misread: old keys keep their TTL and expire.
#[tokio::test]
async fn an_old_format_log_is_left_to_expire() {
    let server = RedisServer::start();
    let store = uncached(&server).await;
    let limits = [Limit::sliding_window(3, Duration::from_secs(60)).unwrap()];
    let key = Key::new("k");
    let new_key = store.redis_key(&key, &limits[0]);
    let old_key = new_key.replace(":sw2:", ":sw:");
    assert_ne!(old_key, new_key);
    let now = redis_ms(&mut raw(&server).await).await.to_string();
    for n in ["1", "2"] {
        server
            .cli(&["ZADD", &old_key, &now, &format!("{now}:{n}")])
            .unwrap();
    }
    server.cli(&["PEXPIRE", &old_key, "60000"]).unwrap();
    assert_eq!(allowed(&store, "k", &limits, 5).await, 3);
    assert_eq!(server.cli(&["ZCARD", &old_key]).unwrap().trim(), "2");
    let ttl: i64 = server
        .cli(&["PTTL", &old_key])
        .unwrap()
        .trim()
        .parse()
        .unwrap();
    assert!((1..=60_000).contains(&ttl), "{ttl}");
    support::assert_every_key_expires(&server);
}

/// The store on a clock of its own: exact counts, whatever the wall clock does.
async fn on_manual_clock(server: &RedisServer) -> RedisStore {
    uncached(server)
        .await
        .with_clock(tollgate::clock::ManualClock::new(1_700_000_000_000))
}

/// From Redis 7 decisions call the script as a function library (`FCALL`, loaded once
/// with `FUNCTION LOAD`); before, where Redis has no functions, they `EVALSHA` it.
#[tokio::test]
async fn decisions_call_the_library_from_redis_7_on_and_the_script_before() {
    let server = RedisServer::start();
    let store = on_manual_clock(&server).await;
    server.cli(&["CONFIG", "RESETSTAT"]).unwrap();
    assert_eq!(allowed(&store, "k", &hourly(2), 3).await, 2);
    let (fcalls, evalshas) = (server.calls("fcall"), server.calls("evalsha"));
    if support::redis_server_major_version() >= 7 {
        assert_eq!((fcalls, evalshas), (3, 0));
        let libraries = server.cli(&["FUNCTION", "LIST"]).unwrap();
        // The library's name, its function's, its functions for one fixed window and
        // for many (the last with the flag allow-cross-slot-keys), and the in-flight
        // stage's.
        assert_eq!(libraries.matches("tollgate_").count(), 5, "{libraries}");
        assert_eq!(libraries.matches("_fw\n").count(), 1, "{libraries}");
        assert_eq!(libraries.matches("_fwn\n").count(), 1, "{libraries}");
        assert_eq!(libraries.matches("_fi\n").count(), 1, "{libraries}");
        assert_eq!(
            libraries.matches("allow-cross-slot-keys").count(),
            1,
            "{libraries}"
        );
    } else {
        assert_eq!((fcalls, evalshas), (0, 3));
    }
}

/// After `FUNCTION FLUSH` (and `SCRIPT FLUSH`: a restart without persistence, a new node)
/// the store loads the library again and calls once more; a call that met the missing
/// function never ran, so each decision counts exactly once.
#[tokio::test]
async fn a_flushed_library_is_loaded_again_and_each_decision_counts_once() {
    let server = RedisServer::start();
    let store = on_manual_clock(&server).await;
    let limits = hourly(3);
    server.cli(&["CONFIG", "RESETSTAT"]).unwrap();
    let mut allowed_total = 0;
    let mut remaining = Vec::new();
    for _ in 0..5 {
        server.flush_scripts();
        let decision = store.check(&Key::new("k"), &limits, 1).await.unwrap();
        allowed_total += u32::from(decision.is_allowed());
        remaining.push(decision.limits()[0].remaining);
    }
    assert_eq!(allowed_total, 3);
    assert_eq!(remaining, [2, 1, 0, 0, 0]);
    let flushes = if support::redis_server_major_version() < 7 {
        5 // SCRIPT FLUSH counts as SCRIPT before Redis 7
    } else {
        0
    };
    assert_eq!(server.script_loads(), 5 + flushes);
}

/// Two versions of tollgate sharing one Redis (a rolling upgrade) each call their own
/// library: loading one leaves the other's in place.
#[tokio::test]
async fn two_versions_of_the_library_run_side_by_side() {
    let server = RedisServer::start();
    if support::redis_server_major_version() < 7 {
        return; // no functions: both versions EVALSHA their own script (by its hash)
    }
    // "The other version": a library of another name, as another script's hash gives.
    let other = "tollgate_000000000000";
    let library = format!(
        "#!lua name={other}\nredis.register_function('{other}', function() return {{7}} end)"
    );
    let loaded = server.cli(&["FUNCTION", "LOAD", &library]).unwrap();
    assert_eq!(loaded.trim(), other);
    let store = on_manual_clock(&server).await;
    assert_eq!(allowed(&store, "k", &hourly(2), 3).await, 2);
    // And once more after this version's library went missing alone.
    let libraries = server.cli(&["FUNCTION", "LIST"]).unwrap();
    let own = libraries
        .lines()
        .map(str::trim)
        .find(|l| l.starts_with("tollgate_") && *l != other)
        .unwrap_or_else(|| panic!("{libraries}"))
        .to_owned();
    assert_eq!(
        server.cli(&["FUNCTION", "DELETE", &own]).unwrap().trim(),
        "OK"
    );
    assert_eq!(allowed(&store, "k2", &hourly(2), 3).await, 2);
    let libraries = server.cli(&["FUNCTION", "LIST"]).unwrap();
    assert!(libraries.contains(&own), "{libraries}");
    // The other version's function is still there and still answers.
    let reply = server.cli(&["FCALL", other, "0"]).unwrap();
    assert_eq!(reply.trim(), "7");
}
