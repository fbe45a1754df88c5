//! RedisStore against a real redis-server: the default Redis clock, script reloading,
//! the key layout, and the bb8 pool.

#![cfg(feature = "redis")]

mod support;

use std::time::Duration;

use support::RedisServer;
use tollgate::{Limit, Store, key::Key, store::RedisStore};

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
    RedisStore::connect(&server.url())
        .await
        .unwrap()
        .with_block_cache(0)
}

#[tokio::test]
async fn redis_time_is_the_default_clock() {
    let server = RedisServer::start();
    let store = RedisStore::connect(&server.url()).await.unwrap();
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
        assert_eq!(server.cli(&["SCRIPT", "FLUSH"]).unwrap().trim(), "OK");
        let decision = store.check(&Key::new("k"), &limits, 1).await.unwrap();
        allowed_total += u32::from(decision.is_allowed());
    }
    // Five allowed (or more only if the hour turned over, at most ten).
    assert!(allowed_total >= 5, "{allowed_total}");
    // SCRIPT FLUSH counts as SCRIPT before Redis 7: 10 flushes besides.
    let flushes = if support::redis_server_major_version() < 7 {
        10
    } else {
        0
    };
    assert_eq!(
        server.calls("script|load"),
        10 + flushes,
        "the script was reloaded after each flush"
    );
}

#[tokio::test]
async fn keys_follow_the_documented_layout() {
    let server = RedisServer::start();
    let store = RedisStore::connect(&server.url())
        .await
        .unwrap()
        .with_prefix("app")
        .unwrap();
    let limits = [
        Limit::fixed_window(5, Duration::from_secs(60)).unwrap(),
        Limit::token_bucket(5, Duration::from_secs(1))
            .unwrap()
            .named("burst")
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
        ["app:{user:1}:burst:tb:5:1000:5", "app:{user:1}:fw:5:60000"]
    );
    assert_eq!(store.redis_key(&Key::new("user:1"), &limits[0]), keys[1]);
    // Both keys of one identity hash to one slot.
    let slot = |key: &str| server.cli(&["CLUSTER", "KEYSLOT", key]);
    assert_eq!(slot(&keys[0]), slot(&keys[1]));
}

#[tokio::test]
async fn hostile_identities_stay_bounded_and_apart() {
    let server = RedisServer::start();
    let store = RedisStore::connect(&server.url()).await.unwrap();
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
    assert_eq!(server.calls("evalsha"), 5);
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
            server.calls("evalsha"),
            server.calls("get"),
            server.calls("set")
        ),
        (1, 1, 1)
    );
    assert!(!store.check(&hot, &limit, 1).await.unwrap().is_allowed());
    support::assert_every_key_expires(&server);
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
        RedisStore::connect(&format!("redis://127.0.0.1:{port}"))
            .await
            .is_err()
    );
}
