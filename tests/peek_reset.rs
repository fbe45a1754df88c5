//! Peek and reset on every store (memory, Redis, Redis Cluster), through the layer's
//! [`Limiter`], and across replicas: a reset reaches the block cache of a store that
//! shares the Redis (pub/sub), so it stops denying at once.
//!
//! Windows are an hour long and time is a `ManualClock`, so counts are exact; waiting
//! for another replica polls with a generous deadline, never a fixed sleep.

use tollgate_test_support as support;

use std::{
    convert::Infallible,
    future::Future,
    sync::Arc,
    time::{Duration, Instant},
};

use http::{Request, Response, StatusCode};
use tollgate::{
    Decision, FailurePolicy, Limit, RateLimitLayer, StoreErrorKind,
    clock::ManualClock,
    key::{HeaderKey, Key},
    rules::Rules,
    store::{Check, MemoryStore, Store},
};
use tower::{Layer, ServiceExt, service_fn};

const HOUR: Duration = Duration::from_secs(3600);
const NOW_MS: u64 = 1_700_000_000_000;
/// How long another replica may take to hear a reset (it is milliseconds in practice).
const PROPAGATION: Duration = Duration::from_secs(10);

fn every_algorithm(limit: u32) -> [Limit; 5] {
    [
        Limit::fixed_window(limit, HOUR).unwrap(),
        Limit::sliding_window(limit, HOUR).unwrap(),
        Limit::sliding_window_counter(limit, HOUR).unwrap(),
        Limit::token_bucket(limit, HOUR).unwrap(),
        Limit::gcra(limit, HOUR).unwrap(),
    ]
}

/// What every store must do, for each algorithm: a peek answers what the next check
/// answers and changes nothing; a reset gives the key a full budget and leaves other
/// keys and other limits alone. `exists` says whether `key` holds state under `limit`
/// (`None`: the store cannot tell).
async fn peek_and_reset<S: Store, F: Future<Output = Option<bool>>>(
    store: &S,
    exists: impl Fn(Key, Limit) -> F,
) {
    for limit in every_algorithm(3) {
        let limits = std::slice::from_ref(&limit);
        let key = Key::new(format!("peek-{:?}", limit.algorithm()));
        let other = Key::new(format!("other-{:?}", limit.algorithm()));
        let name = format!("{:?}", limit.algorithm());

        // A fresh key: the answer of a first request, and no state made.
        let peeked = store.peek(&key, limits, 1).await.unwrap();
        assert!(peeked.is_allowed(), "{name}");
        assert_eq!(peeked.remaining(), Some(2), "{name}");
        assert_ne!(
            exists(key.clone(), limit.clone()).await,
            Some(true),
            "{name}: peek made state"
        );
        // As often as asked, the same answer: nothing is consumed.
        assert_eq!(store.peek(&key, limits, 1).await.unwrap(), peeked, "{name}");
        assert_eq!(
            store.check(&key, limits, 1).await.unwrap(),
            peeked,
            "{name}"
        );

        for _ in 0..2 {
            let next = store.peek(&key, limits, 1).await.unwrap();
            assert_eq!(store.check(&key, limits, 1).await.unwrap(), next, "{name}");
        }
        // Spent: a peek is the denial the next request gets, retry_after and all; cost 0
        // reads what is left.
        let denied = store.peek(&key, limits, 1).await.unwrap();
        assert!(!denied.is_allowed(), "{name}");
        assert!(denied.retry_after() > Duration::ZERO, "{name}");
        assert_eq!(
            store.check(&key, limits, 1).await.unwrap(),
            denied,
            "{name}"
        );
        let left = store.peek(&key, limits, 0).await.unwrap();
        assert!(left.is_allowed(), "{name}");
        assert_eq!(left.remaining(), Some(0), "{name}");
        store.check(&other, limits, 1).await.unwrap();

        store.reset(&key, limits).await.unwrap();
        assert_ne!(
            exists(key.clone(), limit.clone()).await,
            Some(true),
            "{name}: state left"
        );
        assert_eq!(
            store.peek(&key, limits, 0).await.unwrap().remaining(),
            Some(3)
        );
        assert!(
            store.check(&key, limits, 3).await.unwrap().is_allowed(),
            "{name}"
        );
        // The other key kept its spent unit.
        assert_eq!(
            store.peek(&other, limits, 0).await.unwrap().remaining(),
            Some(2)
        );
    }

    // Two limits of one key: resetting one leaves the other's state.
    let [minute, hour] = [
        Limit::fixed_window(5, Duration::from_secs(60)).unwrap(),
        Limit::fixed_window(5, HOUR).unwrap(),
    ];
    let both = [minute.clone(), hour.clone()];
    let key = Key::new("two-limits");
    assert!(store.check(&key, &both, 2).await.unwrap().is_allowed());
    store
        .reset(&key, std::slice::from_ref(&minute))
        .await
        .unwrap();
    let left = store.peek(&key, &both, 0).await.unwrap();
    let remaining: Vec<u64> = left.limits().iter().map(|l| l.remaining).collect();
    assert_eq!(remaining, [5, 3]);
    assert_ne!(exists(key.clone(), hour).await, Some(false));
    assert_ne!(exists(key, minute).await, Some(true));
}

#[tokio::test]
async fn the_memory_store_peeks_and_resets() {
    let store = MemoryStore::new().with_clock(ManualClock::new(NOW_MS));
    peek_and_reset(&store, |_, _| async { None }).await;

    // What it holds: a peek adds no key, a reset of every limit removes the key.
    let store = MemoryStore::new().with_clock(ManualClock::new(NOW_MS));
    let limits = every_algorithm(3);
    let key = Key::new("k");
    store.peek(&key, &limits, 1).await.unwrap();
    assert!(store.is_empty());
    store.check(&key, &limits, 1).await.unwrap();
    store.peek(&key, &limits, 1).await.unwrap();
    assert_eq!(store.len(), 1);
    store.reset(&key, &limits[..2]).await.unwrap();
    assert_eq!(store.len(), 1);
    let left: Vec<u64> = store
        .peek(&key, &limits, 0)
        .await
        .unwrap()
        .limits()
        .iter()
        .map(|l| l.remaining)
        .collect();
    assert_eq!(left, [3, 3, 2, 2, 2]);
    store.reset(&key, &limits[2..]).await.unwrap();
    assert!(store.is_empty());
}

/// Lockouts under peek and reset, on a store on `clock`: a peek that would be denied
/// reports the block the request would start but starts none (the request after it, a
/// second later, starts its own, a second later); a peek during a block reports the
/// time left; a reset ends the block with the budget.
async fn peek_and_reset_with_a_lockout<S: Store>(store: &S, clock: &ManualClock) {
    let lockout = Duration::from_secs(600);
    let second = Duration::from_secs(1);
    let limit = Limit::fixed_window(1, Duration::from_secs(60))
        .unwrap()
        .with_lockout(lockout)
        .unwrap();
    let limits = std::slice::from_ref(&limit);
    let key = Key::new("locked");
    assert!(store.check(&key, limits, 1).await.unwrap().is_allowed());
    // Spent: the peek answers the denial a request would get, block included ...
    let peeked = store.peek(&key, limits, 1).await.unwrap();
    assert!(!peeked.is_allowed());
    assert_eq!(peeked.retry_after(), lockout);
    // ... and starts no block.
    clock.advance(second);
    let denied = store.check(&key, limits, 1).await.unwrap();
    assert_eq!(
        denied.retry_after(),
        lockout,
        "the first denial starts the block"
    );
    clock.advance(second);
    let during = store.peek(&key, limits, 1).await.unwrap();
    assert!(!during.is_allowed());
    assert_eq!(during.retry_after(), lockout - second);
    // A reset ends the block with the budget.
    store.reset(&key, limits).await.unwrap();
    assert!(store.peek(&key, limits, 1).await.unwrap().is_allowed());
    assert!(store.check(&key, limits, 1).await.unwrap().is_allowed());
}

#[tokio::test]
async fn the_memory_store_peeks_and_resets_lockouts() {
    let clock = ManualClock::new(NOW_MS);
    let store = MemoryStore::new().with_clock(clock.clone());
    peek_and_reset_with_a_lockout(&store, &clock).await;
}

/// A layer's [`Limiter`]: keys as the layer's extractor makes them (hashed header keys
/// included), peeks under the rules in force, and a reset that the next request through
/// the layer sees.
#[tokio::test]
async fn the_limiter_peeks_and_resets_what_the_layer_counts() {
    let layer = RateLimitLayer::new(Limit::fixed_window(2, HOUR).unwrap())
        .with_store(MemoryStore::new().with_clock(ManualClock::new(NOW_MS)))
        .with_key(HeaderKey::new("x-api-key").unwrap().hashed());
    let limiter = layer.limiter();
    let service = layer.layer(service_fn(|_: Request<()>| async {
        Ok::<_, Infallible>(Response::new(()))
    }));
    let request = || {
        Request::get("/")
            .header("x-api-key", "k-1")
            .body(())
            .unwrap()
    };
    let key = limiter.key_of(&request()).unwrap();
    assert!(key.as_str().starts_with("header:x-api-key|#"), "{key:?}");
    for _ in 0..2 {
        let status = service.clone().oneshot(request()).await.unwrap().status();
        assert_eq!(status, StatusCode::OK);
    }
    let peeked = limiter.peek(&key, 1).await.unwrap();
    assert!(!peeked.is_allowed());
    let status = service.clone().oneshot(request()).await.unwrap().status();
    assert_eq!(status, StatusCode::TOO_MANY_REQUESTS);

    limiter.reset(&key).await.unwrap();
    assert_eq!(limiter.peek(&key, 0).await.unwrap().remaining(), Some(2));
    let status = service.clone().oneshot(request()).await.unwrap().status();
    assert_eq!(status, StatusCode::OK);

    // New rules: the limiter answers under them.
    let rules = layer.rules_handle();
    rules.set(Rules::new([Limit::fixed_window(10, HOUR).unwrap()]).unwrap());
    let peeked = limiter.peek(&key, 0).await.unwrap();
    assert_eq!(peeked.limits()[0].limit, 10);
}

/// A layer with plans: `peek_plan` reads a plan's own state, and a reset clears every
/// plan's state of the key, so the client finds a full budget whatever its plan.
#[tokio::test]
async fn the_limiter_peeks_each_plan_and_resets_them_all() {
    use tollgate::plan::{Plan, Plans};
    let plans = Plans::new([
        Plan::new("free", [Limit::fixed_window(2, HOUR).unwrap()]).unwrap(),
        Plan::new("paid", [Limit::fixed_window(5, HOUR).unwrap()]).unwrap(),
        Plan::unlimited("internal").unwrap(),
    ])
    .unwrap()
    .with_default("free")
    .unwrap()
    .with_header(http::HeaderName::from_static("x-plan"));
    let layer = RateLimitLayer::new(Limit::fixed_window(1, HOUR).unwrap())
        .with_store(MemoryStore::new().with_clock(ManualClock::new(NOW_MS)))
        .with_key(HeaderKey::new("x-api-key").unwrap())
        .with_plans(plans);
    let limiter = layer.limiter();
    let service = layer.layer(service_fn(|_: Request<()>| async {
        Ok::<_, Infallible>(Response::new(()))
    }));
    let request = |plan: &str| {
        Request::get("/")
            .header("x-api-key", "k")
            .header("x-plan", plan)
            .body(())
            .unwrap()
    };
    let key = limiter.key_of(&request("free")).unwrap();
    for _ in 0..2 {
        let status = service
            .clone()
            .oneshot(request("free"))
            .await
            .unwrap()
            .status();
        assert_eq!(status, StatusCode::OK);
    }
    let status = service
        .clone()
        .oneshot(request("paid"))
        .await
        .unwrap()
        .status();
    assert_eq!(status, StatusCode::OK);
    let left = |d: Decision| d.remaining();
    assert_eq!(
        left(limiter.peek_plan("free", &key, 0).await.unwrap()),
        Some(0)
    );
    assert_eq!(
        left(limiter.peek_plan("paid", &key, 0).await.unwrap()),
        Some(4)
    );
    assert!(
        limiter
            .peek_plan("internal", &key, 1)
            .await
            .unwrap()
            .limits()
            .is_empty()
    );
    // An unknown plan is the default one, as for a request.
    assert_eq!(
        left(limiter.peek_plan("gold", &key, 0).await.unwrap()),
        Some(0)
    );

    limiter.reset(&key).await.unwrap();
    assert_eq!(
        left(limiter.peek_plan("free", &key, 0).await.unwrap()),
        Some(2)
    );
    assert_eq!(
        left(limiter.peek_plan("paid", &key, 0).await.unwrap()),
        Some(5)
    );
    let status = service
        .clone()
        .oneshot(request("free"))
        .await
        .unwrap()
        .status();
    assert_eq!(status, StatusCode::OK);
}

/// Shadow limits are peeked apart and reset with the rest; the local fallback store of
/// `FailurePolicy::Local` is reset too.
#[tokio::test]
async fn a_reset_clears_shadow_limits_and_the_local_fallback() {
    let local = MemoryStore::new().with_clock(ManualClock::new(NOW_MS));
    let store = MemoryStore::new().with_clock(ManualClock::new(NOW_MS));
    let enforced = Limit::fixed_window(5, HOUR).unwrap();
    let shadow = Limit::gcra(2, HOUR).unwrap();
    let layer = RateLimitLayer::new(enforced.clone())
        .with_shadow_limit(shadow.clone())
        .with_store(store.clone())
        .with_on_store_error(FailurePolicy::Local(local.clone()));
    let limiter = layer.limiter();
    let key = Key::new("client");
    store
        .check(&key, std::slice::from_ref(&enforced), 1)
        .await
        .unwrap();
    store
        .check(&key, std::slice::from_ref(&shadow), 2)
        .await
        .unwrap();
    local
        .check(&key, std::slice::from_ref(&enforced), 4)
        .await
        .unwrap();
    assert_eq!(limiter.peek(&key, 0).await.unwrap().remaining(), Some(4));
    assert_eq!(
        limiter.peek_shadow(&key, 0).await.unwrap().remaining(),
        Some(0)
    );

    limiter.reset(&key).await.unwrap();
    assert_eq!(limiter.peek(&key, 0).await.unwrap().remaining(), Some(5));
    assert_eq!(
        limiter.peek_shadow(&key, 0).await.unwrap().remaining(),
        Some(2)
    );
    let local_left = local
        .peek(&key, std::slice::from_ref(&enforced), 0)
        .await
        .unwrap();
    assert_eq!(local_left.remaining(), Some(5));
}

/// A store without peek and reset says so with a clear error kind, through the limiter.
#[tokio::test]
async fn a_store_without_peek_or_reset_says_so() {
    #[derive(Debug)]
    struct CheckOnly;
    impl Store for CheckOnly {
        fn check(&self, _: &Key, _: &[Limit], _: u32) -> Check {
            Check::ready(Ok(Decision::unlimited()))
        }

        fn capabilities(&self) -> tollgate::store::Capabilities {
            tollgate::store::Capabilities::NONE
        }
    }
    let limiter = RateLimitLayer::new(Limit::fixed_window(1, HOUR).unwrap())
        .with_store(CheckOnly)
        .limiter();
    let key = Key::new("k");
    let error = limiter.peek(&key, 1).await.unwrap_err();
    assert_eq!(error.kind(), StoreErrorKind::Unsupported);
    let error = limiter.reset(&key).await.unwrap_err();
    assert_eq!(error.kind(), StoreErrorKind::Unsupported);
    assert!(
        support::chain(&error).contains("reset"),
        "{}",
        support::chain(&error)
    );
}

/// Polls `done` until it holds, for at most `limit`.
async fn eventually<F: Future<Output = bool>>(
    what: &str,
    limit: Duration,
    mut done: impl FnMut() -> F,
) {
    let start = Instant::now();
    while !done().await {
        assert!(start.elapsed() < limit, "{what}: not within {limit:?}");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

#[cfg(feature = "redis")]
mod redis_store {
    use tollgate::store::RedisStore;

    use super::*;
    use support::RedisServer;

    async fn connect(server: &RedisServer, prefix: &str) -> RedisStore {
        RedisStore::connect(server.url())
            .await
            .unwrap()
            .with_prefix(prefix)
            .unwrap()
            .with_clock(ManualClock::new(NOW_MS))
    }

    #[tokio::test]
    async fn redis_peeks_and_resets() {
        let server = Arc::new(RedisServer::start());
        let store = connect(&server, "pr").await;
        let probe = store.clone();
        let cli = server.clone();
        peek_and_reset(&store, move |key, limit| {
            let found = cli
                .cli(&["EXISTS", &probe.redis_key(&key, &limit)])
                .unwrap();
            async move { Some(found.trim() == "1") }
        })
        .await;
        support::assert_every_key_expires(&server);
    }

    #[tokio::test]
    async fn redis_peeks_and_resets_lockouts() {
        let server = RedisServer::start();
        let clock = ManualClock::new(NOW_MS);
        let store = connect(&server, "lock").await.with_clock(clock.clone());
        peek_and_reset_with_a_lockout(&store, &clock).await;
        // Without the block cache too: every answer from the script.
        let clock = ManualClock::new(NOW_MS);
        let store = connect(&server, "lock-nc")
            .await
            .with_block_cache(None)
            .with_clock(clock.clone());
        peek_and_reset_with_a_lockout(&store, &clock).await;
        support::assert_every_key_expires(&server);
    }

    /// The store that resets forgets its own block-cache entries at once, without
    /// waiting for its own announcement (a store made from a connection manager does
    /// not listen for resets at all).
    #[tokio::test]
    async fn a_reset_clears_this_stores_block_cache_at_once() {
        let server = RedisServer::start();
        let client = redis::Client::open(server.url()).unwrap();
        let manager = redis::aio::ConnectionManager::new(client).await.unwrap();
        let store = RedisStore::from_manager(manager)
            .with_prefix("own")
            .unwrap()
            .with_clock(ManualClock::new(NOW_MS));
        let limits = [Limit::fixed_window(1, HOUR).unwrap()];
        let key = Key::new("client");
        assert!(store.check(&key, &limits, 1).await.unwrap().is_allowed());
        assert!(!store.check(&key, &limits, 1).await.unwrap().is_allowed());
        let cached = store.check(&key, &limits, 1);
        assert!(
            cached.is_ready(),
            "the denial is answered from the block cache"
        );
        assert!(!cached.await.unwrap().is_allowed());

        store.reset(&key, &limits).await.unwrap();
        let next = store.check(&key, &limits, 1);
        assert!(!next.is_ready(), "the block cache still answers");
        assert!(next.await.unwrap().is_allowed());
    }

    /// How many clients listen on `channel` on `server`.
    fn subscribers(server: &RedisServer, channel: &str) -> u64 {
        let out = server
            .cli(&["PUBSUB", "NUMSUB", channel])
            .unwrap_or_default();
        out.lines()
            .nth(1)
            .and_then(|n| n.trim().parse().ok())
            .unwrap_or(0)
    }

    /// Two replicas share one Redis: B denies a key from its block cache, A resets the
    /// key, and B's next request is allowed. Then B's subscription is killed: it
    /// subscribes again, and resets reach it again.
    #[tokio::test]
    async fn a_reset_reaches_another_replicas_block_cache() {
        let server = RedisServer::start();
        let a = connect(&server, "shared").await;
        let b = connect(&server, "shared").await;
        let limits = [Limit::fixed_window(1, HOUR).unwrap()];
        for round in 0..2 {
            let key = Key::new(format!("client-{round}"));
            assert!(b.check(&key, &limits, 1).await.unwrap().is_allowed());
            assert!(!b.check(&key, &limits, 1).await.unwrap().is_allowed());
            assert!(
                b.check(&key, &limits, 1).is_ready(),
                "round {round}: not cached"
            );
            // B listens from its first remembered denial on.
            eventually("B subscribes", PROPAGATION, || async {
                subscribers(&server, "shared:reset") == 1
            })
            .await;
            // The subscription may have cleared the cache as it started: block again.
            let _ = b.check(&key, &limits, 1).await.unwrap();
            assert!(
                b.check(&key, &limits, 1).is_ready(),
                "round {round}: not cached"
            );

            a.reset(&key, &limits).await.unwrap();
            eventually("B allows after the reset", PROPAGATION, || async {
                b.check(&key, &limits, 1).await.unwrap().is_allowed()
            })
            .await;

            // Drop B's subscription: the task subscribes again.
            server.cli(&["CLIENT", "KILL", "TYPE", "pubsub"]).unwrap();
            assert!(!b.check(&key, &limits, 1).await.unwrap().is_allowed());
        }
    }
}

/// As the README documents: the least-privilege line peeks; resetting needs `+del
/// +publish`, and hearing resets `+subscribe` and the channel. A store that may not
/// subscribe says so once.
#[cfg(feature = "redis")]
mod acl_users {
    use tollgate::store::RedisStore;

    use super::*;
    use support::{RedisServer, acl, logs::Logs};

    async fn connect(server: &RedisServer, user: &str, extra: &[&str]) -> RedisStore {
        let mut rules = acl::documented_rules(user, "tollgate");
        // Redis 6.0 has no channel rules: every user may use every channel.
        let channels = support::redis_server_version() >= (6, 2);
        rules.extend(
            extra
                .iter()
                .filter(|rule| channels || !rule.starts_with('&'))
                .map(|rule| (*rule).to_owned()),
        );
        acl::set_user(server, &rules);
        RedisStore::connect(acl::url_for(server, user))
            .await
            .unwrap()
            .with_clock(ManualClock::new(NOW_MS))
    }

    #[tokio::test]
    async fn acl_users_peek_and_reset_as_documented() {
        let (logs, _guard) = Logs::capture();
        let server = RedisServer::start();
        let limits = [Limit::fixed_window(1, HOUR).unwrap()];
        let key = Key::new("client");

        // The documented line alone: peeks, may not reset, warns that it cannot listen.
        let plain = connect(&server, "plain", &[]).await;
        assert!(plain.peek(&key, &limits, 1).await.unwrap().is_allowed());
        let error = plain.reset(&key, &limits).await.unwrap_err();
        assert!(
            support::chain(&error).contains("NOPERM"),
            "{}",
            support::chain(&error)
        );
        assert!(plain.check(&key, &limits, 1).await.unwrap().is_allowed());
        assert!(!plain.check(&key, &limits, 1).await.unwrap().is_allowed());
        let start = Instant::now();
        while !logs
            .text()
            .contains("may not subscribe to the reset channel")
        {
            assert!(start.elapsed() < PROPAGATION, "no warning: {}", logs.text());
            tokio::time::sleep(Duration::from_millis(20)).await;
        }

        // With the documented additions, a reset reaches the other store's block cache.
        let extra = ["+del", "+publish", "+subscribe", "&tollgate:reset"];
        let a = connect(&server, "admin-a", &extra).await;
        let b = connect(&server, "admin-b", &extra).await;
        let key = Key::new("other-client");
        assert!(b.check(&key, &limits, 1).await.unwrap().is_allowed());
        assert!(!b.check(&key, &limits, 1).await.unwrap().is_allowed());
        eventually("B subscribes", PROPAGATION, || async {
            let out = server
                .cli(&["PUBSUB", "NUMSUB", "tollgate:reset"])
                .unwrap_or_default();
            out.lines().nth(1).is_some_and(|n| n.trim() == "1")
        })
        .await;
        let _ = b.check(&key, &limits, 1).await.unwrap();
        assert!(b.check(&key, &limits, 1).is_ready(), "not cached");
        a.reset(&key, &limits).await.unwrap();
        eventually("B allows after the reset", PROPAGATION, || async {
            b.check(&key, &limits, 1).await.unwrap().is_allowed()
        })
        .await;
        // Said once, however often the plain store retried.
        assert_eq!(logs.text().matches("may not subscribe").count(), 1);
    }
}

#[cfg(feature = "cluster")]
mod cluster_store {
    use tollgate::store::RedisStore;

    use super::*;
    use support::cluster::RedisCluster;

    async fn connect(cluster: &RedisCluster) -> RedisStore {
        RedisStore::connect(tollgate::store::RedisTarget::cluster(&cluster.urls()))
            .await
            .unwrap()
            .with_clock(ManualClock::new(NOW_MS))
    }

    #[tokio::test]
    async fn a_cluster_peeks_and_resets_lockouts() {
        let cluster = RedisCluster::start();
        let clock = ManualClock::new(NOW_MS);
        let store = connect(&cluster).await.with_clock(clock.clone());
        peek_and_reset_with_a_lockout(&store, &clock).await;
    }

    /// Peek and reset on a cluster, then a reset from one cluster store reaches the
    /// block cache of another (PUBLISH reaches every node).
    #[tokio::test]
    async fn a_cluster_peeks_resets_and_tells_every_replica() {
        let cluster = Arc::new(RedisCluster::start());
        let store = connect(&cluster).await;
        let probe = store.clone();
        let nodes = cluster.clone();
        peek_and_reset(&store, move |key, limit| {
            let redis_key = probe.redis_key(&key, &limit);
            let node = nodes.node_for_key(&redis_key);
            let found = nodes.cli(node, &["EXISTS", &redis_key]).unwrap();
            async move { Some(found.trim() == "1") }
        })
        .await;

        let a = connect(&cluster).await;
        let b = connect(&cluster).await;
        let limits = [Limit::fixed_window(1, HOUR).unwrap()];
        let key = Key::new("cluster-client");
        assert!(b.check(&key, &limits, 1).await.unwrap().is_allowed());
        assert!(!b.check(&key, &limits, 1).await.unwrap().is_allowed());
        let listening = || {
            cluster
                .running()
                .map(|i| {
                    let out = cluster
                        .cli(i, &["PUBSUB", "NUMSUB", "tollgate:reset"])
                        .unwrap_or_default();
                    out.lines()
                        .nth(1)
                        .and_then(|n| n.trim().parse::<u64>().ok())
                        .unwrap_or(0)
                })
                .sum::<u64>()
        };
        eventually("B subscribes", PROPAGATION, || async { listening() >= 1 }).await;
        let _ = b.check(&key, &limits, 1).await.unwrap();
        assert!(b.check(&key, &limits, 1).is_ready(), "not cached");

        a.reset(&key, &limits).await.unwrap();
        eventually("B allows after the reset", PROPAGATION, || async {
            b.check(&key, &limits, 1).await.unwrap().is_allowed()
        })
        .await;
    }
}

/// Behind Sentinel: peek and reset on the master, and a reset heard by another store's
/// block cache (its listener subscribes on the master the sentinels name).
#[cfg(feature = "sentinel")]
mod sentinel_store {
    use tollgate::store::{RedisStore, SentinelConfig};

    use super::*;
    use support::sentinel::{MASTER_NAME, SentinelSetup};

    async fn connect(setup: &SentinelSetup) -> RedisStore {
        let config = SentinelConfig::new(&setup.sentinel_urls(), MASTER_NAME);
        RedisStore::connect(config.clone())
            .await
            .unwrap()
            .with_clock(ManualClock::new(NOW_MS))
    }

    #[tokio::test]
    async fn sentinel_stores_peek_reset_and_tell_each_other() {
        let setup = Arc::new(SentinelSetup::start());
        let master = setup.index_of(setup.master_port().unwrap());
        let store = connect(&setup).await;
        let probe = store.clone();
        let nodes = setup.clone();
        peek_and_reset(&store, move |key, limit| {
            let found = nodes.servers[master]
                .cli(&["EXISTS", &probe.redis_key(&key, &limit)])
                .unwrap();
            async move { Some(found.trim() == "1") }
        })
        .await;

        let a = connect(&setup).await;
        let b = connect(&setup).await;
        let limits = [Limit::fixed_window(1, HOUR).unwrap()];
        let key = Key::new("sentinel-client");
        assert!(b.check(&key, &limits, 1).await.unwrap().is_allowed());
        assert!(!b.check(&key, &limits, 1).await.unwrap().is_allowed());
        eventually("B subscribes", PROPAGATION, || async {
            let out = setup.servers[master]
                .cli(&["PUBSUB", "NUMSUB", "tollgate:reset"])
                .unwrap_or_default();
            out.lines().nth(1).is_some_and(|n| n.trim() == "1")
        })
        .await;
        let _ = b.check(&key, &limits, 1).await.unwrap();
        assert!(b.check(&key, &limits, 1).is_ready(), "not cached");
        a.reset(&key, &limits).await.unwrap();
        eventually("B allows after the reset", PROPAGATION, || async {
            b.check(&key, &limits, 1).await.unwrap().is_allowed()
        })
        .await;
    }
}
