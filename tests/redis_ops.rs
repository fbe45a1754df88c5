//! Redis as people run it, against real servers the harness starts: TLS (a private CA,
//! client certificates, what is refused), ACL users (the README's least privilege, on one
//! node and on a cluster, and a clear `NOPERM` answered by the failure policy when the ACL
//! is narrower).

#![cfg(feature = "redis")]

use tollgate_test_support as support;

use std::time::Duration;

use axum::{Router, body::Body, routing::get};
use http::{Request, StatusCode};
use support::{RedisServer, acl};
use tollgate::{
    FailurePolicy, Limit, RateLimitLayer, StoreError,
    key::GlobalKey,
    key::Key,
    store::{RedisStore, Store},
};
use tower::ServiceExt;

const HOUR: Duration = Duration::from_secs(3600);

/// One decision of every algorithm at once, on Redis `TIME` (no local clock): exercises
/// every command the script calls.
async fn decide_all(store: &RedisStore, key: &str) -> Result<bool, StoreError> {
    let limits = [
        Limit::fixed_window(5, HOUR).unwrap(),
        Limit::sliding_window(5, HOUR).unwrap(),
        Limit::sliding_window_counter(5, HOUR).unwrap(),
        Limit::token_bucket(5, HOUR).unwrap(),
        Limit::gcra(5, HOUR).unwrap(),
    ];
    let mut allowed = 0;
    for _ in 0..7 {
        let decision = store.check(&Key::new(key), &limits, 1).await?;
        allowed += u32::from(decision.is_allowed());
    }
    Ok(allowed == 5)
}

#[cfg(not(feature = "tls"))]
#[tokio::test]
async fn rediss_without_the_tls_feature_names_the_feature() {
    let error = RedisStore::connect("rediss://127.0.0.1:1")
        .await
        .unwrap_err();
    let message = support::chain(&error);
    assert!(message.contains("`tls` feature"), "{message}");
}

#[tokio::test]
async fn the_documented_acl_user_decides_on_redis_time() {
    let server = RedisServer::start();
    let url = acl::least_privilege_user(&server, "tollgate");
    let store = RedisStore::connect(url).await.unwrap();
    assert!(decide_all(&store, "tenant").await.unwrap());
    // Without coalescing too (each decision its own EVALSHA).
    let store = store.with_coalescing(None);
    assert!(decide_all(&store, "other").await.unwrap());
    // After SCRIPT FLUSH (and FUNCTION FLUSH), the user may load the script (the library)
    // again by itself.
    server.flush_scripts();
    assert!(decide_all(&store, "third").await.unwrap());
    assert!(server.script_loads() >= 2, "the script was not reloaded");
    // From Redis 7 on, the documented user calls the library.
    if support::redis_server_major_version() >= 7 {
        assert!(server.calls("fcall") > 0);
        assert_eq!(server.calls("evalsha"), 0);
    }
}

/// An ACL user without functions (no `+fcall`, or no `+function|load` either: an ACL
/// written for an older tollgate) still decides, with `EVALSHA`: the store falls back,
/// and the calls that met the denial never ran, so each decision counts once.
#[tokio::test]
async fn an_acl_user_without_functions_falls_back_to_the_script() {
    let server = RedisServer::start();
    if support::redis_server_major_version() < 7 {
        return; // no functions to be denied (the documented line leaves them out)
    }
    for (user, without) in [
        ("no-fcall", &["+fcall"][..]),
        ("no-functions", &["+fcall", "+function|load"][..]),
    ] {
        let rules: Vec<String> = acl::documented_rules(user, "tollgate")
            .into_iter()
            .filter(|rule| !without.contains(&rule.as_str()))
            .collect();
        acl::set_user(&server, &rules);
        server.cli(&["CONFIG", "RESETSTAT"]).unwrap();
        let store = RedisStore::connect(acl::url_for(&server, user))
            .await
            .unwrap()
            .with_block_cache(None);
        assert!(decide_all(&store, user).await.unwrap(), "{user}");
        assert!(server.calls("evalsha") >= 7, "{user}");
        // At most the first call tried FCALL.
        assert!(server.calls("fcall") <= 1, "{user}");
    }
    // A first call that is a batch of cold keys (one call of the function for many where
    // functions are allowed) becomes the script's call of the same batch: exact.
    let store = RedisStore::connect(acl::url_for(&server, "no-fcall"))
        .await
        .unwrap()
        .with_block_cache(None);
    server.cli(&["CONFIG", "RESETSTAT"]).unwrap();
    let limit = [Limit::fixed_window(2, HOUR).unwrap()];
    let keys: Vec<Key> = (0..20).map(|i| Key::new(format!("cold-{i}"))).collect();
    for expected in [true, true, false] {
        let checks = keys.iter().map(|key| store.check(key, &limit, 1));
        for decision in futures_util::future::join_all(checks).await {
            assert_eq!(decision.unwrap().is_allowed(), expected);
        }
    }
    assert!(server.calls("fcall") <= 1);
    assert!(server.calls("evalsha") >= 3);
}

#[tokio::test]
async fn a_wrong_password_is_refused_at_connect() {
    let server = RedisServer::start();
    acl::least_privilege_user(&server, "tollgate");
    let url = format!("redis://tollgate:wrong@127.0.0.1:{}", server.port());
    let error = support::chain(&RedisStore::connect(url).await.unwrap_err());
    assert!(
        error.to_lowercase().contains("authentication failed"),
        "{error}"
    );
}

/// A command missing from the ACL: the store error names it, and the layer's failure
/// policy answers (never a panic, never a 500).
#[tokio::test]
async fn a_narrower_acl_is_a_clear_noperm_answered_by_the_policy() {
    let server = RedisServer::start();
    let rules: Vec<String> = acl::documented_rules("narrow", "tollgate")
        .into_iter()
        .filter(|rule| rule != "+zadd")
        .collect();
    acl::set_user(&server, &rules);
    let store = RedisStore::connect(acl::url_for(&server, "narrow"))
        .await
        .unwrap();

    // The fixed window needs nothing missing: decided.
    let fixed = [Limit::fixed_window(5, HOUR).unwrap()];
    assert!(
        store
            .check(&Key::new("a"), &fixed, 1)
            .await
            .unwrap()
            .is_allowed()
    );
    // The sliding window's log needs ZADD.
    let sliding = [Limit::sliding_window(5, HOUR).unwrap()];
    let error = store.check(&Key::new("a"), &sliding, 1).await.unwrap_err();
    let message = support::chain(&error);
    assert!(
        message.contains("NOPERM") && message.contains("+zadd"),
        "{message}"
    );

    // Through the layer: the failure policy answers.
    for (policy, expected) in [
        (FailurePolicy::Allow, StatusCode::OK),
        (FailurePolicy::Deny, StatusCode::SERVICE_UNAVAILABLE),
    ] {
        let layer = RateLimitLayer::new(Limit::sliding_window(5, HOUR).unwrap())
            .with_key(GlobalKey)
            .with_store(store.clone())
            .with_on_store_error(policy.clone());
        let app = Router::new()
            .route("/", get(|| async { "ok" }))
            .layer(layer);
        for _ in 0..3 {
            let response = app
                .clone()
                .oneshot(Request::get("/").body(Body::empty()).unwrap())
                .await
                .unwrap();
            assert_eq!(response.status(), expected, "{policy:?}");
            assert!(!response.headers().contains_key("ratelimit"));
        }
    }
}

/// Keys outside the user's pattern (a prefix the ACL does not name): `NOPERM` on the key.
#[tokio::test]
async fn a_prefix_outside_the_acl_key_pattern_is_a_clear_noperm() {
    let server = RedisServer::start();
    let store = RedisStore::connect(acl::least_privilege_user(&server, "tollgate"))
        .await
        .unwrap()
        .with_prefix("otherapp")
        .unwrap();
    let error = support::chain(&decide_all(&store, "a").await.unwrap_err());
    assert!(
        error.contains("NOPERM") && error.contains("~tollgate:*"),
        "{error}"
    );
}

/// Cold keys outside the user's key pattern in one batch: the library's call for many
/// declares no keys, so the denial comes from inside the script (Redis: "can't access at
/// least one of the keys", Valkey: "ACL failure in script: No permissions to access a
/// key"). It names the key pattern, not the command on the script's line.
#[tokio::test]
async fn cold_keys_outside_the_acl_key_pattern_are_a_clear_noperm() {
    let server = RedisServer::start();
    let store = RedisStore::connect(acl::least_privilege_user(&server, "tollgate"))
        .await
        .unwrap()
        .with_prefix("otherapp")
        .unwrap()
        .with_block_cache(None);
    let limit = [Limit::fixed_window(2, HOUR).unwrap()];
    let keys: Vec<Key> = (0..20).map(|i| Key::new(format!("cold-{i}"))).collect();
    let checks = keys.iter().map(|key| store.check(key, &limit, 1));
    for result in futures_util::future::join_all(checks).await {
        let error = support::chain(&result.unwrap_err());
        assert!(
            error.contains("NOPERM") && error.contains("~tollgate:*") && !error.contains("(add +"),
            "{error}"
        );
    }
    assert_eq!(server.cli(&["DBSIZE"]).unwrap().trim(), "0");
}

/// The store's key, count and remaining after each of `checks` single checks of `key`
/// on one fixed window of 5 per hour (a manual clock: no window turns over), with
/// `between` run before each check.
async fn counted_one_by_one(
    store: &RedisStore,
    server: &RedisServer,
    checks: usize,
    mut between: impl FnMut(usize),
) -> (u32, Vec<u64>) {
    let limit = [Limit::fixed_window(5, HOUR).unwrap()];
    let key = Key::new("evicted");
    let mut remaining = Vec::new();
    for i in 0..checks {
        between(i);
        let decision = store.check(&key, &limit, 1).await.unwrap();
        remaining.push(decision.limits()[0].remaining);
    }
    let value = server
        .cli(&["GET", &store.redis_key(&key, &limit[0])])
        .unwrap();
    (support::fixed_window_count(&value), remaining)
}

/// The script's path (`EVALSHA`: a user without `+fcall`, or Redis 6) with the script
/// cache emptied between calls: `SCRIPT FLUSH`, or another client's flood of distinct
/// `EVAL`s, which engines that evict scripts (Valkey 8+, Redis 7.4+: those cached by
/// `EVAL`, past 500; neither has a `maxmemory-scripts`) answer by evicting. The script
/// tollgate loads with `SCRIPT LOAD` is never evicted; a flushed one meets `NOSCRIPT`, is
/// loaded again and the call sent once more; each request counts exactly once.
#[tokio::test]
async fn an_emptied_script_cache_counts_each_request_once() {
    let server = RedisServer::start();
    let rules: Vec<String> = acl::documented_rules("no-fcall", "tollgate")
        .into_iter()
        .filter(|rule| rule != "+fcall")
        .collect();
    acl::set_user(&server, &rules);
    let store = RedisStore::connect(acl::url_for(&server, "no-fcall"))
        .await
        .unwrap()
        .with_block_cache(None)
        .with_clock(tollgate::clock::ManualClock::new(1_700_000_000_000));
    let sha = redis::Script::new(tollgate::store::SCRIPT_SOURCE)
        .get_hash()
        .to_owned();
    let evicted = || {
        let stats = server.cli(&["INFO", "stats"]).unwrap();
        stats.lines().find_map(|l| {
            l.strip_prefix("evicted_scripts:")
                .map(|n| n.trim().parse::<u64>().unwrap())
        })
    };
    let evicting = evicted().is_some();
    let flood = |round: usize| {
        let script: String = (0..600)
            .map(|i| format!("EVAL \"return {}\" 0\n", round * 1_000 + i))
            .collect();
        let mut cli = std::process::Command::new("redis-cli")
            .args(server.cli_args())
            .stdin(std::process::Stdio::piped())
            .stdout(std::process::Stdio::null())
            .spawn()
            .unwrap();
        use std::io::Write;
        cli.stdin
            .take()
            .unwrap()
            .write_all(script.as_bytes())
            .unwrap();
        assert!(cli.wait().unwrap().success());
    };

    // Another client's flood before every call: nothing of ours is evicted.
    server.cli(&["CONFIG", "RESETSTAT"]).unwrap();
    let (count, remaining) = counted_one_by_one(&store, &server, 7, flood).await;
    assert_eq!((count, remaining), (5, vec![4, 3, 2, 1, 0, 0, 0]));
    let exists = server.cli(&["SCRIPT", "EXISTS", &sha]).unwrap();
    assert_eq!(exists.trim(), "1", "tollgate's script was evicted");
    if evicting {
        // The flood was big enough to evict on this engine.
        assert!(evicted().unwrap() > 0);
    }
    assert!(server.calls("evalsha") >= 7);
    if support::redis_server_major_version() >= 7 {
        // Only the first call's: the store loaded the library at connect, and learned
        // from the denied FCALL that it must use the script.
        assert_eq!(
            server.calls("script|load"),
            1,
            "reloaded a script never evicted"
        );
    }

    // SCRIPT FLUSH (and FUNCTION FLUSH) before every call: reloaded each time, counted once.
    server
        .cli(&[
            "DEL",
            &store.redis_key(&Key::new("evicted"), &Limit::fixed_window(5, HOUR).unwrap()),
        ])
        .unwrap();
    server.cli(&["CONFIG", "RESETSTAT"]).unwrap();
    let (count, remaining) =
        counted_one_by_one(&store, &server, 7, |_| server.flush_scripts()).await;
    assert_eq!((count, remaining), (5, vec![4, 3, 2, 1, 0, 0, 0]));
    assert_eq!(server.calls("fcall"), 0);
    if support::redis_server_major_version() >= 7 {
        // One NOSCRIPT, one SCRIPT LOAD and one more EVALSHA per flush.
        assert_eq!(server.calls("script|load"), 7);
        assert_eq!(server.calls("evalsha"), 14);
    }
}

/// A master demoted to a replica (a failover the store does not follow: one node, no
/// Sentinel) refuses the store's writes with `READONLY` (on the call, or inside the
/// script): the failure policy answers, nothing is counted, and the call is not retried.
#[tokio::test]
async fn a_demoted_master_is_a_readonly_error_answered_by_the_policy() {
    let master = RedisServer::start();
    let demoted = RedisServer::start();
    let store = RedisStore::connect(demoted.url())
        .await
        .unwrap()
        .with_block_cache(None);
    let limit = [Limit::fixed_window(5, HOUR).unwrap()];
    assert!(
        store
            .check(&Key::new("before"), &limit, 1)
            .await
            .unwrap()
            .is_allowed()
    );
    let port = master.port().to_string();
    demoted.cli(&["REPLICAOF", "127.0.0.1", &port]).unwrap();
    let start = std::time::Instant::now();
    while !demoted
        .cli(&["INFO", "replication"])
        .unwrap()
        .contains("master_link_status:up")
    {
        assert!(
            start.elapsed() < Duration::from_secs(10),
            "the replica never synced"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    demoted.cli(&["CONFIG", "RESETSTAT"]).unwrap();
    for key in ["a", "b"] {
        let error = store.check(&Key::new(key), &limit, 1).await.unwrap_err();
        assert_eq!(error.kind(), tollgate::StoreErrorKind::Response);
        assert!(read_only(&error), "{}", support::chain(&error));
    }
    let layer = RateLimitLayer::new(Limit::fixed_window(5, HOUR).unwrap())
        .with_key(GlobalKey)
        .with_store(store.clone())
        .with_on_store_error(FailurePolicy::Deny);
    let app = Router::new()
        .route("/", get(|| async { "ok" }))
        .layer(layer);
    let response = app
        .oneshot(Request::get("/").body(Body::empty()).unwrap())
        .await
        .unwrap();
    assert_eq!(response.status(), StatusCode::SERVICE_UNAVAILABLE);
    for server in [&master, &demoted] {
        assert_eq!(server.cli(&["DBSIZE"]).unwrap().trim(), "0");
    }
    // Each of the three decisions: at most one call, and one more only after a reply
    // that proves the first never ran (the replica lacks the library or the script).
    assert!(demoted.script_calls() <= 6, "{}", demoted.script_calls());
}

/// Whether the store error is the server's `READONLY`: its code, or on Redis 6 inside the
/// script's `ERR Error running script ...: -READONLY ...`.
fn read_only(error: &StoreError) -> bool {
    let redis =
        std::error::Error::source(error).and_then(|e| e.downcast_ref::<redis::RedisError>());
    redis.is_some_and(|e| {
        e.code() == Some("READONLY")
            || e.detail().is_some_and(|d| {
                d.starts_with("Error running script") && d.contains(": -READONLY ")
            })
    })
}

/// Another client's script runs past the busy threshold: the server answers `BUSY` (on
/// every engine) and the failure policy has the request; it is not retried, so only the
/// decision after the script ended counts.
#[tokio::test]
async fn a_busy_server_is_an_error_and_nothing_is_retried() {
    let server = RedisServer::start();
    let store = RedisStore::connect(server.url())
        .await
        .unwrap()
        .with_block_cache(None)
        .with_clock(tollgate::clock::ManualClock::new(1_700_000_000_000));
    let limit = [Limit::fixed_window(5, HOUR).unwrap()];
    let key = Key::new("busy");
    // `lua-time-limit`: the name on Redis 6.0, an alias of busy-reply-threshold since.
    server
        .cli(&["CONFIG", "SET", "lua-time-limit", "50"])
        .unwrap();
    let busy = "local t = tonumber(redis.call('TIME')[1]) \
                while tonumber(redis.call('TIME')[1]) - t < 3 do end return 1";
    let mut other = std::process::Command::new("redis-cli")
        .args(server.cli_args())
        .args(["EVAL", busy, "0"])
        .stdout(std::process::Stdio::null())
        .spawn()
        .unwrap();
    let start = std::time::Instant::now();
    while !server.cli(&["PING"]).unwrap_or_default().contains("BUSY") {
        assert!(
            start.elapsed() < Duration::from_secs(2),
            "the server never got busy"
        );
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    let error = store.check(&key, &limit, 1).await.unwrap_err();
    let message = support::chain(&error);
    assert!(message.contains("BUSY"), "{message}");
    assert_eq!(error.kind(), tollgate::StoreErrorKind::Response);
    assert!(other.wait().unwrap().success());
    let decision = store.check(&key, &limit, 1).await.unwrap();
    assert_eq!(decision.limits()[0].remaining, 4);
    let value = server
        .cli(&["GET", &store.redis_key(&key, &limit[0])])
        .unwrap();
    assert_eq!(support::fixed_window_count(&value), 1);
}

#[cfg(feature = "cluster")]
#[tokio::test]
async fn the_documented_acl_user_runs_on_a_cluster() {
    let cluster = support::cluster::RedisCluster::start();
    let rules = acl::documented_rules("tollgate", "tollgate");
    for node in cluster.running().collect::<Vec<_>>() {
        acl::set_user(cluster.node(node), &rules);
    }
    let urls: Vec<String> = (0..support::cluster::NODES)
        .map(|i| acl::url_for(cluster.node(i), "tollgate"))
        .collect();
    let store = RedisStore::connect(tollgate::store::RedisTarget::cluster(&urls))
        .await
        .unwrap();
    for tenant in 0..30 {
        assert!(
            decide_all(&store, &format!("tenant-{tenant}"))
                .await
                .unwrap()
        );
    }
    // The tenants spread over every master, so each one ran the script as the user.
    for master in cluster.masters() {
        assert!(cluster.dbsize(master) > 0, "master {master} has no keys");
    }
}

#[cfg(feature = "tls")]
mod tls {
    use std::sync::Arc;

    use support::tls::TlsFiles;
    use tollgate::store::TlsConfig;

    use super::*;

    fn config(tls: &TlsFiles) -> TlsConfig {
        TlsConfig::new()
            .with_ca_pem(tls.ca_pem.clone())
            .with_client_cert_pem(tls.client_cert_pem.clone(), tls.client_key_pem.clone())
    }

    #[tokio::test]
    async fn tls_with_a_private_ca_and_a_client_certificate_decides() {
        let tls = Arc::new(TlsFiles::generate());
        let server = RedisServer::start_tls(&tls);
        let store = RedisStore::connect(
            tollgate::store::RedisTarget::node(server.url()).with_tls(config(&tls)),
        )
        .await
        .unwrap();
        assert!(decide_all(&store, "a").await.unwrap());
    }

    #[tokio::test]
    async fn tls_and_an_acl_user_together() {
        let tls = Arc::new(TlsFiles::generate());
        let server = RedisServer::start_tls(&tls);
        let url = acl::least_privilege_user(&server, "tollgate");
        assert!(url.starts_with("rediss://tollgate:"), "{url}");
        let store =
            RedisStore::connect(tollgate::store::RedisTarget::node(&url).with_tls(config(&tls)))
                .await
                .unwrap();
        assert!(decide_all(&store, "a").await.unwrap());
    }

    #[tokio::test]
    async fn a_server_certificate_from_another_ca_is_refused() {
        let tls = Arc::new(TlsFiles::generate());
        let other = TlsFiles::generate();
        let server = RedisServer::start_tls(&tls);
        let wrong_ca = TlsConfig::new()
            .with_ca_pem(other.ca_pem.clone())
            .with_client_cert_pem(tls.client_cert_pem.clone(), tls.client_key_pem.clone());
        let error = support::chain(
            &RedisStore::connect(
                tollgate::store::RedisTarget::node(server.url()).with_tls(wrong_ca.clone()),
            )
            .await
            .unwrap_err(),
        );
        assert!(error.to_lowercase().contains("certificate"), "{error}");
        // The system's roots do not know the test CA either.
        let error = support::chain(&RedisStore::connect(server.url()).await.unwrap_err());
        assert!(error.to_lowercase().contains("certificate"), "{error}");
    }

    #[tokio::test]
    async fn a_server_that_requires_a_client_certificate_refuses_none() {
        let tls = Arc::new(TlsFiles::generate());
        let server = RedisServer::start_tls(&tls);
        let no_client_cert = TlsConfig::new().with_ca_pem(tls.ca_pem.clone());
        assert!(
            RedisStore::connect(
                tollgate::store::RedisTarget::node(server.url()).with_tls(no_client_cert.clone())
            )
            .await
            .is_err()
        );
    }

    #[tokio::test]
    async fn a_plain_url_given_to_connect_tls_is_refused() {
        let tls = TlsFiles::generate();
        let error = support::chain(
            &RedisStore::connect(
                tollgate::store::RedisTarget::node("redis://127.0.0.1:1").with_tls(config(&tls)),
            )
            .await
            .unwrap_err(),
        );
        assert!(error.contains("rediss://"), "{error}");
    }

    #[tokio::test]
    async fn a_pem_that_does_not_parse_is_an_error_not_a_panic() {
        let tls = Arc::new(TlsFiles::generate());
        let server = RedisServer::start_tls(&tls);
        let garbage = TlsConfig::new().with_ca_pem("not a certificate");
        assert!(
            RedisStore::connect(
                tollgate::store::RedisTarget::node(server.url()).with_tls(garbage.clone())
            )
            .await
            .is_err()
        );
        let bad_key = TlsConfig::new()
            .with_ca_pem(tls.ca_pem.clone())
            .with_client_cert_pem(tls.client_cert_pem.clone(), "-----BEGIN PRIVATE KEY-----\n");
        assert!(
            RedisStore::connect(
                tollgate::store::RedisTarget::node(server.url()).with_tls(bad_key.clone())
            )
            .await
            .is_err()
        );
    }
}
