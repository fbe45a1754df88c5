//! Lockouts (`Limit::with_lockout`) end to end: real HTTP (axum over TCP) and real tonic
//! clients, on the memory store, Redis and a Redis Cluster.
//!
//! Time is a `ManualClock` (the Redis store sends it as the script's `now`), starting 20 s
//! into a minute: the login limit below (3 a minute, a 15-minute lockout) has 40 s left in
//! its window, and every `Retry-After` is known exactly.

use tollgate_test_support as support;

use std::{net::SocketAddr, time::Duration};

use axum::{Router, routing::any};
use http::{Request, Response, StatusCode};
use http_body_util::Empty;
use hyper_util::{client::legacy::Client, rt::TokioExecutor};
use tokio::{net::TcpListener, time::timeout};
use tollgate::{
    Limit, RateLimitLayer,
    clock::ManualClock,
    key::{GlobalKey, HeaderKey},
    store::{MemoryStore, Store},
};

/// 20 s into a minute.
const NOW_MS: u64 = 1_700_000_000_000;
const MINUTE: Duration = Duration::from_secs(60);
const LOCKOUT: Duration = Duration::from_secs(15 * 60);

/// 3 logins a minute; the one after that locks the key out for 15 minutes.
fn login() -> Limit {
    Limit::fixed_window(3, MINUTE)
        .unwrap()
        .with_name("login")
        .unwrap()
        .with_lockout(LOCKOUT)
        .unwrap()
}

/// Serves `/login` behind `layer` on a free loopback port.
async fn serve(layer: RateLimitLayer<GlobalKey>) -> SocketAddr {
    async fn ok() -> &'static str {
        "ok"
    }
    let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    let app = Router::new().route("/login", any(ok)).layer(layer);
    tokio::spawn(async move { axum::serve(listener, app).await.unwrap() });
    addr
}

/// One real HTTP request over TCP.
async fn post(addr: SocketAddr) -> Response<hyper::body::Incoming> {
    let client = Client::builder(TokioExecutor::new()).build_http::<Empty<bytes::Bytes>>();
    let request = Request::post(format!("http://{addr}/login"))
        .body(Empty::new())
        .unwrap();
    timeout(Duration::from_secs(5), client.request(request))
        .await
        .unwrap()
        .unwrap()
}

fn header<B>(response: &Response<B>, name: &str) -> Option<String> {
    response
        .headers()
        .get(name)
        .map(|v| v.to_str().unwrap().to_owned())
}

/// The whole story over HTTP, on `store` (which reads `clock`): three logins pass, the
/// fourth locks the key out for 15 minutes, a new window does not lift the block, requests
/// during it do not extend it, and at its end the limit counts again from a full window.
async fn a_breach_locks_out_over_http(store: impl Store, clock: &ManualClock) {
    let addr = serve(
        RateLimitLayer::new(login())
            .with_key(GlobalKey)
            .with_store(store)
            .with_timeout(Some(Duration::from_secs(10))),
    )
    .await;
    for remaining in [2, 1, 0] {
        let response = post(addr).await;
        assert_eq!(response.status(), StatusCode::OK);
        assert_eq!(
            header(&response, "ratelimit"),
            Some(format!(r#""login";r={remaining};t=40"#))
        );
    }
    let breach = post(addr).await;
    assert_eq!(breach.status(), StatusCode::TOO_MANY_REQUESTS);
    assert_eq!(header(&breach, "retry-after").as_deref(), Some("900"));
    assert_eq!(
        header(&breach, "ratelimit").as_deref(),
        Some(r#""login";r=0;t=900"#)
    );

    // The window rolls over after 40 s; the key stays locked, and the requests it sends
    // meanwhile do not move the end of the block.
    for (advance_s, left_s) in [(60, 840), (1, 839), (600, 239)] {
        clock.advance(Duration::from_secs(advance_s));
        let response = post(addr).await;
        assert_eq!(response.status(), StatusCode::TOO_MANY_REQUESTS);
        assert_eq!(
            header(&response, "retry-after"),
            Some(left_s.to_string()),
            "{advance_s}"
        );
        assert_eq!(
            header(&response, "ratelimit"),
            Some(format!(r#""login";r=0;t={left_s}"#))
        );
    }
    // One millisecond before the end: still locked, for a second (rounded up).
    clock.advance(Duration::from_millis(239_000 - 1));
    let last = post(addr).await;
    assert_eq!(last.status(), StatusCode::TOO_MANY_REQUESTS);
    assert_eq!(header(&last, "retry-after").as_deref(), Some("1"));
    // The block ends: the limit counts again, and locks out again.
    clock.advance(Duration::from_millis(1));
    for _ in 0..3 {
        assert_eq!(post(addr).await.status(), StatusCode::OK);
    }
    let again = post(addr).await;
    assert_eq!(again.status(), StatusCode::TOO_MANY_REQUESTS);
    assert_eq!(header(&again, "retry-after").as_deref(), Some("900"));
}

#[tokio::test]
async fn a_breach_locks_out_over_http_memory() {
    let clock = ManualClock::new(NOW_MS);
    let store = MemoryStore::new().with_clock(clock.clone());
    a_breach_locks_out_over_http(store, &clock).await;
}

/// A request denied by another limit of the same layer starts no block.
#[tokio::test]
async fn only_the_limit_with_the_lockout_starts_a_block() {
    let clock = ManualClock::new(NOW_MS);
    let store = MemoryStore::new().with_clock(clock.clone());
    let layer = RateLimitLayer::new(login())
        .with_limit(Limit::fixed_window(1, Duration::from_secs(1)).unwrap())
        .with_key(GlobalKey)
        .with_store(store)
        .with_timeout(Some(Duration::from_secs(10)));
    let addr = serve(layer).await;
    assert_eq!(post(addr).await.status(), StatusCode::OK);
    let denied = post(addr).await;
    assert_eq!(denied.status(), StatusCode::TOO_MANY_REQUESTS);
    assert_eq!(header(&denied, "retry-after").as_deref(), Some("1"));
    clock.advance(Duration::from_secs(1));
    assert_eq!(post(addr).await.status(), StatusCode::OK);
}

/// The lockout on tonic: a locked-out client gets RESOURCE_EXHAUSTED with the time left
/// on the block in `retry-after`, per API key.
async fn a_breach_locks_out_over_grpc(store: impl Store, clock: &ManualClock) {
    use tonic::{
        Code, Request,
        transport::{Channel, Server, server::TcpIncoming},
    };
    use tonic_health::pb::{HealthCheckRequest, health_client::HealthClient};

    let layer = RateLimitLayer::new(login())
        .with_key(HeaderKey::new("x-api-key").unwrap())
        .with_store(store)
        .with_timeout(Some(Duration::from_secs(10)));
    let incoming = TcpIncoming::bind("127.0.0.1:0".parse().unwrap()).unwrap();
    let addr: SocketAddr = incoming.local_addr().unwrap();
    let (_reporter, health) = tonic_health::server::health_reporter();
    let (_stop, stopped) = tokio::sync::oneshot::channel::<()>();
    let router = Server::builder().layer(layer).add_service(health);
    tokio::spawn(router.serve_with_incoming_shutdown(incoming, async {
        stopped.await.ok();
    }));
    let channel = Channel::from_shared(format!("http://{addr}"))
        .unwrap()
        .connect()
        .await
        .unwrap();
    let mut client = HealthClient::new(channel);
    let check = |key: &str| {
        let mut request = Request::new(HealthCheckRequest::default());
        request
            .metadata_mut()
            .insert("x-api-key", key.parse().unwrap());
        request
    };
    for _ in 0..3 {
        client.check(check("k1")).await.unwrap();
    }
    let retry_after = |status: &tonic::Status| {
        status
            .metadata()
            .get("retry-after")
            .map(|v| v.to_str().unwrap().to_owned())
    };
    let status = client.check(check("k1")).await.unwrap_err();
    assert_eq!(status.code(), Code::ResourceExhausted, "{status:?}");
    assert_eq!(retry_after(&status).as_deref(), Some("900"));
    clock.advance(Duration::from_secs(100));
    let status = client.check(check("k1")).await.unwrap_err();
    assert_eq!(status.code(), Code::ResourceExhausted, "{status:?}");
    assert_eq!(retry_after(&status).as_deref(), Some("800"));
    assert_eq!(
        status
            .metadata()
            .get("ratelimit")
            .unwrap()
            .to_str()
            .unwrap(),
        r#""login";r=0;t=800"#
    );
    // Another key is not locked out.
    client.check(check("k2")).await.unwrap();
    clock.advance(Duration::from_secs(800));
    client.check(check("k1")).await.unwrap();
}

#[tokio::test]
async fn a_breach_locks_out_over_grpc_memory() {
    let clock = ManualClock::new(NOW_MS);
    let store = MemoryStore::new().with_clock(clock.clone());
    a_breach_locks_out_over_grpc(store, &clock).await;
}

#[cfg(feature = "redis")]
mod redis {
    use support::RedisServer;
    use tollgate::{key::Key, store::RedisStore};

    use super::*;

    async fn store(server: &RedisServer, clock: &ManualClock) -> RedisStore {
        RedisStore::connect(server.url())
            .await
            .unwrap()
            .with_clock(clock.clone())
    }

    /// Without the block cache, which would answer most of the denials by itself.
    async fn uncached(server: &RedisServer, clock: &ManualClock) -> RedisStore {
        store(server, clock).await.with_block_cache(None)
    }

    #[tokio::test]
    async fn a_breach_locks_out_over_http_redis() {
        let server = RedisServer::start();
        let clock = ManualClock::new(NOW_MS);
        a_breach_locks_out_over_http(uncached(&server, &clock).await, &clock).await;
        support::assert_every_key_expires(&server);
        // And with it.
        let clock = ManualClock::new(NOW_MS);
        let store = store(&server, &clock).await.with_prefix("cached").unwrap();
        a_breach_locks_out_over_http(store, &clock).await;
    }

    #[tokio::test]
    async fn a_breach_locks_out_over_grpc_redis() {
        let server = RedisServer::start();
        let clock = ManualClock::new(NOW_MS);
        a_breach_locks_out_over_grpc(uncached(&server, &clock).await, &clock).await;
    }

    /// The block is a key beside the limit's, with the same hash tag, that expires with
    /// the block (plus the 5 s a caller's clock may lag); a request during the block
    /// does not rewrite it.
    #[tokio::test]
    async fn the_block_is_a_key_that_expires_with_it() {
        let server = RedisServer::start();
        let clock = ManualClock::new(NOW_MS);
        let store = uncached(&server, &clock).await;
        let limits = [login()];
        let key = Key::new("mallory");
        for _ in 0..4 {
            store.check(&key, &limits, 1).await.unwrap();
        }
        let block = format!("{}:lockout", store.redis_key(&key, &limits[0]));
        assert_eq!(block, "tollgate:{custom|mallory}:login:fw2:3:60000:lockout");
        let read = |name: &str| server.cli(&[name, &block]).unwrap().trim().to_owned();
        assert_eq!(read("GET"), (NOW_MS + 900_000).to_string());
        let ttl: u64 = read("PTTL").parse().unwrap();
        assert!((900_000..=905_000).contains(&ttl), "{ttl}");
        clock.advance(Duration::from_secs(300));
        assert!(!store.check(&key, &limits, 1).await.unwrap().is_allowed());
        assert_eq!(read("GET"), (NOW_MS + 900_000).to_string());
        assert_eq!(support::assert_every_key_expires(&server), 2);
    }

    /// The block key lives exactly as long as its block: with the script reading Redis
    /// TIME (no margin for a caller's clock), the key's expiry time (PEXPIRETIME, Redis's
    /// clock) is the block's end (its value), read on the same clock in the same script.
    /// The script's TIME and its SET fall in one millisecond, or in the next when a
    /// millisecond ends between them: so each of 20 blocks expires at its end or 1 ms
    /// after, and most exactly at it. A TTL 1 ms short (or long) fails both.
    #[tokio::test]
    async fn the_block_key_expires_exactly_when_the_block_ends() {
        let server = RedisServer::start();
        let store = RedisStore::connect(server.url())
            .await
            .unwrap()
            .with_block_cache(None);
        let mut conn = support::test_connection(&server.url()).await;
        let limits = [Limit::gcra(1, Duration::from_secs(3_600))
            .unwrap()
            .with_name("login")
            .unwrap()
            .with_lockout(LOCKOUT)
            .unwrap()];
        let mut exact = 0;
        for i in 0..20 {
            let key = Key::new(format!("k{i}"));
            assert!(store.check(&key, &limits, 1).await.unwrap().is_allowed());
            assert!(!store.check(&key, &limits, 1).await.unwrap().is_allowed());
            let block = format!("{}:lockout", store.redis_key(&key, &limits[0]));
            let ends: u64 = ::redis::cmd("GET")
                .arg(&block)
                .query_async(&mut conn)
                .await
                .unwrap();
            let expires: u64 = ::redis::cmd("PEXPIRETIME")
                .arg(&block)
                .query_async(&mut conn)
                .await
                .unwrap();
            assert!(
                expires == ends || expires == ends + 1,
                "block {i} ends at {ends}, its key expires at {expires}"
            );
            exact += usize::from(expires == ends);
        }
        assert!(
            exact >= 10,
            "{exact} of 20 block keys expire exactly at the block's end"
        );
    }

    /// A flood from a locked-out key costs Redis about one call: the block cache answers
    /// it, with the time left, until the block ends; then Redis decides again (limiting
    /// comes back: the first requests pass, the fourth locks out again).
    #[tokio::test]
    async fn the_block_cache_answers_a_locked_out_flood() {
        let server = RedisServer::start();
        let clock = ManualClock::new(NOW_MS);
        let store = store(&server, &clock).await;
        let limits = [login()];
        let key = Key::new("mallory");
        for _ in 0..4 {
            store.check(&key, &limits, 1).await.unwrap();
        }
        let before = server.script_calls();
        clock.advance(Duration::from_secs(120));
        for _ in 0..500 {
            let d = store.check(&key, &limits, 1).await.unwrap();
            assert!(!d.is_allowed());
            assert_eq!(d.retry_after(), Duration::from_secs(780));
        }
        assert_eq!(server.script_calls() - before, 0);
        clock.advance(Duration::from_secs(780));
        for allowed in [true, true, true, false] {
            assert_eq!(
                store.check(&key, &limits, 1).await.unwrap().is_allowed(),
                allowed
            );
        }
    }

    /// When the limit's own wait outlasts the block (an hour's window, a 10 s lockout), the
    /// block cache keeps the denial only until the block ends: the next such request must
    /// reach Redis, where it starts a new block (which a free request then sees).
    #[tokio::test]
    async fn the_block_cache_lets_a_new_breach_through() {
        let server = RedisServer::start();
        let clock = ManualClock::new(NOW_MS);
        let store = store(&server, &clock).await;
        let limits = [Limit::fixed_window(1, Duration::from_secs(3600))
            .unwrap()
            .with_lockout(Duration::from_secs(10))
            .unwrap()];
        let key = Key::new("mallory");
        assert!(store.check(&key, &limits, 1).await.unwrap().is_allowed());
        let breach = store.check(&key, &limits, 1).await.unwrap();
        assert_eq!(breach.retry_after(), Duration::from_secs(2800));
        clock.advance(Duration::from_secs(11));
        // The block ended; the window still denies: a new block.
        let again = store.check(&key, &limits, 1).await.unwrap();
        assert_eq!(again.retry_after(), Duration::from_secs(2789));
        clock.advance(Duration::from_secs(1));
        // A free request (cost 0) fits the window, but not the new block.
        let free = store.check(&key, &limits, 0).await.unwrap();
        assert!(!free.is_allowed());
        assert_eq!(free.retry_after(), Duration::from_secs(9));
    }

    /// A request that can never fit goes past the block cache to Redis, where it can
    /// start a block: the key's cached denial (of a limit that did not block then) must
    /// not answer afterwards with its earlier `retry_after` and `remaining`.
    #[tokio::test]
    async fn a_block_started_past_the_block_cache_is_not_hidden_by_it() {
        let server = RedisServer::start();
        let clock = ManualClock::new(NOW_MS);
        let store = store(&server, &clock).await;
        // One a minute, and the login limit: 3 a minute with a 15-minute lockout.
        let limits = [Limit::fixed_window(1, MINUTE).unwrap(), login()];
        let key = Key::new("mallory");
        assert!(store.check(&key, &limits, 1).await.unwrap().is_allowed());
        // The first limit denies, for the 40 s left in its window; the login limit fits,
        // so no block: this denial is cached.
        let denied = store.check(&key, &limits, 1).await.unwrap();
        assert_eq!(denied.retry_after(), Duration::from_secs(40));
        assert_eq!(denied.limits()[1].remaining, 2);
        // More than the login limit ever holds: it denies, and blocks the key.
        let breach = store.check(&key, &limits, 4).await.unwrap();
        assert_eq!(breach.retry_after(), LOCKOUT);
        // The first request again: blocked for the whole lockout, not the 40 s cached.
        for _ in 0..3 {
            let blocked = store.check(&key, &limits, 1).await.unwrap();
            assert!(!blocked.is_allowed());
            assert_eq!(blocked.retry_after(), LOCKOUT);
            assert!(!blocked.limits()[1].allowed);
            assert_eq!(blocked.limits()[1].remaining, 0);
        }
    }
}

#[cfg(feature = "cluster")]
mod cluster {
    use support::cluster::RedisCluster;
    use tollgate::{key::Key, store::RedisStore};

    use super::*;

    /// On a cluster, over HTTP, and with keys on every master: the block key shares its
    /// limit key's slot, so each decision is one script on one master.
    #[tokio::test]
    async fn a_breach_locks_out_in_a_cluster() {
        let cluster = RedisCluster::start();
        let clock = ManualClock::new(NOW_MS);
        let store = RedisStore::connect(tollgate::store::RedisTarget::cluster(&cluster.urls()))
            .await
            .unwrap()
            .with_clock(clock.clone())
            .with_block_cache(None);
        a_breach_locks_out_over_http(store.clone(), &clock).await;

        // Many keys, so that every master holds some blocks; two limits with lockouts.
        let limits = [
            login(),
            Limit::token_bucket(2, Duration::from_secs(1))
                .unwrap()
                .with_lockout(Duration::from_secs(30))
                .unwrap(),
        ];
        for i in 0..60 {
            let key = Key::new(format!("user{i}"));
            assert!(store.check(&key, &limits, 2).await.unwrap().is_allowed());
            let breach = store.check(&key, &limits, 1).await.unwrap();
            assert!(!breach.is_allowed());
            // The bucket denied and locked for 30 s; the login limit had room.
            assert_eq!(breach.limits()[1].retry_after_ms, 30_000);
            assert!(breach.limits()[0].allowed);
        }
        clock.advance(Duration::from_secs(30));
        for i in 0..60 {
            let key = Key::new(format!("user{i}"));
            assert!(store.check(&key, &limits, 1).await.unwrap().is_allowed());
        }
    }
}
