//! `RedisStore::connect_sentinel` against a real Sentinel setup (`test-support/src/sentinel.rs`:
//! a master, a replica, three sentinels): it finds the master, and through a failover under
//! load (the master killed, or `SENTINEL FAILOVER`) every request gets 200 or 429 from a
//! layer that fails open, the script is loaded on the new master, and limiting resumes
//! within seconds with the state the replica had.
//!
//! Windows are an hour long and time is a `ManualClock`, so counts are exact. Everything
//! waits by polling with deadlines; every check runs under a timeout, so a hang fails.

#![cfg(feature = "sentinel")]

use tollgate_test_support as support;

use std::{
    convert::Infallible,
    sync::{
        Arc,
        atomic::{AtomicBool, AtomicU64, Ordering},
    },
    time::{Duration, Instant},
};

use http::{Request, Response, StatusCode};
use support::{
    failover::{CHECK_TIMEOUT, check, resumed, wait_until},
    sentinel::{MASTER_NAME, SentinelSetup},
};
use tokio::{task::JoinSet, time::timeout};
use tollgate::{
    FailurePolicy, Limit, RateLimitLayer,
    clock::ManualClock,
    key::{GlobalKey, Key},
    store::{RedisStore, SentinelConfig},
};
use tower::{Layer, ServiceExt, service_fn};

const HOUR: Duration = Duration::from_secs(3600);
const NOW_MS: u64 = 1_700_000_000_000;
/// How long the failover and the first decision after it may take.
const RESUME: Duration = Duration::from_secs(30);
/// Bounds of every request stream.
const STREAM_TIME: Duration = Duration::from_secs(120);
const PACE: Duration = Duration::from_millis(1);

async fn connect(setup: &SentinelSetup) -> RedisStore {
    let config = SentinelConfig::new(&setup.sentinel_urls(), MASTER_NAME);
    RedisStore::connect(config.clone())
        .await
        .unwrap()
        .with_clock(ManualClock::new(NOW_MS))
}

#[derive(Debug, Default)]
struct Tally {
    allowed: AtomicU64,
    denied: AtomicU64,
    /// Store errors; through a layer that fails open, 200s without rate-limit fields.
    errors: AtomicU64,
}

impl Tally {
    fn get(&self) -> [u64; 3] {
        [&self.allowed, &self.denied, &self.errors].map(|c| c.load(Ordering::Relaxed))
    }
}

#[tokio::test]
async fn finds_the_master_and_decides() {
    let setup = SentinelSetup::start();
    let store = connect(&setup).await;
    let limit = [Limit::fixed_window(3, HOUR).unwrap()];
    let key = Key::new("a");
    for _ in 0..3 {
        assert!(check(&store, &key, &limit).await.unwrap().is_allowed());
    }
    assert!(!check(&store, &key, &limit).await.unwrap().is_allowed());
    // The state is on the master (and replicated), not on a replica written to directly.
    let redis_key = store.redis_key(&key, &limit[0]);
    assert_eq!(
        setup.servers[0]
            .cli(&["EXISTS", &redis_key])
            .unwrap()
            .trim(),
        "1"
    );

    // An unknown master name fails at connect, clearly.
    let wrong = SentinelConfig::new(&setup.sentinel_urls(), "no-such-master");
    let error = support::chain(&RedisStore::connect(wrong.clone()).await.unwrap_err());
    assert!(error.to_lowercase().contains("master"), "{error}");
}

#[tokio::test]
async fn logs_in_to_the_master_as_an_acl_user() {
    let setup = SentinelSetup::start();
    for server in &setup.servers {
        support::acl::set_user(
            server,
            &support::acl::documented_rules("tollgate", "tollgate"),
        );
    }
    let config = SentinelConfig::new(&setup.sentinel_urls(), MASTER_NAME)
        .with_master_user(Some("tollgate"), support::acl::PASSWORD);
    let store = RedisStore::connect(config.clone()).await.unwrap();
    let limit = [Limit::sliding_window(2, HOUR).unwrap()];
    assert!(
        check(&store, &Key::new("a"), &limit)
            .await
            .unwrap()
            .is_allowed()
    );
    let wrong = SentinelConfig::new(&setup.sentinel_urls(), MASTER_NAME)
        .with_master_user(Some("tollgate"), "wrong");
    assert!(RedisStore::connect(wrong.clone()).await.is_err());
}

/// Everything over TLS: `rediss://` sentinels, and the master reached over TLS with the
/// test CA and a client certificate.
#[cfg(feature = "tls")]
#[tokio::test]
async fn finds_the_master_over_tls() {
    let tls = Arc::new(support::tls::TlsFiles::generate());
    let setup = SentinelSetup::start_tls(&tls);
    let urls = setup.sentinel_urls();
    assert!(urls.iter().all(|u| u.starts_with("rediss://")), "{urls:?}");
    let certificates = tollgate::store::TlsConfig::new()
        .with_ca_pem(tls.ca_pem.clone())
        .with_client_cert_pem(tls.client_cert_pem.clone(), tls.client_key_pem.clone());
    let target = tollgate::store::RedisTarget::sentinel(SentinelConfig::new(&urls, MASTER_NAME))
        .with_tls(certificates);
    let store = RedisStore::connect(target).await.unwrap();
    let limit = [Limit::fixed_window(2, HOUR).unwrap()];
    let key = Key::new("a");
    for _ in 0..2 {
        assert!(check(&store, &key, &limit).await.unwrap().is_allowed());
    }
    assert!(!check(&store, &key, &limit).await.unwrap().is_allowed());
    assert!(
        setup.servers[0].script_calls() > 0,
        "not decided on the master"
    );
}

enum Trigger {
    /// SIGKILL the master: the sentinels see it down and promote the replica.
    Kill,
    /// `SENTINEL FAILOVER`: the old master is demoted (and its clients disconnected).
    FailoverCommand,
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_killed_master_fails_over_and_limiting_resumes() {
    failover_under_load(Trigger::Kill).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sentinel_failover_moves_the_master_and_limiting_resumes() {
    failover_under_load(Trigger::FailoverCommand).await;
}

async fn failover_under_load(trigger: Trigger) {
    let mut setup = SentinelSetup::start();
    let store = connect(&setup).await;
    let hot = Key::new("hot");
    let tight = [Limit::fixed_window(20, HOUR)
        .unwrap()
        .with_name("tight")
        .unwrap()];
    let loose = [Limit::fixed_window(1_000_000, HOUR)
        .unwrap()
        .with_name("loose")
        .unwrap()];
    for i in 0..20 {
        assert!(
            check(&store, &hot, &tight).await.unwrap().is_allowed(),
            "request {i}"
        );
    }
    assert!(!check(&store, &hot, &tight).await.unwrap().is_allowed());
    setup.wait_replicated();
    let (old_master, new_master) = (setup.servers[0].port(), setup.servers[1].port());
    assert_eq!(setup.master_port(), Some(old_master));

    // Layers that fail open, one soon denying (50 per hour), one asking Redis always.
    let stop = Arc::new(AtomicBool::new(false));
    let mut streams = JoinSet::new();
    let layered = Arc::new(Tally::default());
    for quota in [50, 1_000_000] {
        let layer = RateLimitLayer::new(Limit::fixed_window(quota, HOUR).unwrap())
            .with_store(store.clone())
            .with_key(GlobalKey)
            .with_on_store_error(FailurePolicy::Allow)
            .with_timeout(Some(Duration::from_secs(2)));
        let service = layer.layer(service_fn(|_: Request<()>| async {
            Ok::<_, Infallible>(Response::new(String::from("ok")))
        }));
        for _ in 0..2 {
            let (service, stop, tally) = (service.clone(), stop.clone(), layered.clone());
            streams.spawn(async move {
                let start = Instant::now();
                while !stop.load(Ordering::Relaxed) && start.elapsed() < STREAM_TIME {
                    let call = service.clone().oneshot(Request::new(()));
                    let response = timeout(CHECK_TIMEOUT, call)
                        .await
                        .expect("the layer answered in time")
                        .unwrap();
                    let counter = match response.status() {
                        StatusCode::OK if response.headers().contains_key("ratelimit") => {
                            &tally.allowed
                        }
                        StatusCode::OK => &tally.errors,
                        StatusCode::TOO_MANY_REQUESTS => &tally.denied,
                        other => panic!("the layer answered {other} during the failover"),
                    };
                    counter.fetch_add(1, Ordering::Relaxed);
                    tokio::time::sleep(PACE).await;
                }
            });
        }
    }
    wait_until("requests before the failover", RESUME, || {
        let [allowed, denied, _] = layered.get();
        allowed >= 100 && denied > 0
    })
    .await;
    let before = layered.get();

    match trigger {
        Trigger::Kill => setup.servers[0].kill(),
        Trigger::FailoverCommand => {
            let reply = setup.sentinels[0]
                .cli(&["SENTINEL", "FAILOVER", MASTER_NAME])
                .unwrap_or_default();
            assert_eq!(reply.trim(), "OK", "SENTINEL FAILOVER: {reply:?}");
        }
    }
    let promoted_in = setup.wait_for("the sentinels to name the replica", |s| {
        s.master_port() == Some(new_master)
    });
    // The store moves: by a broken connection (kill), or by asking the sentinels (after
    // SENTINEL FAILOVER the old master stays writable until Sentinel demotes it).
    let new = setup.index_of(new_master);
    let moved_in = wait_until("the store to use the new master", RESUME, || {
        setup.servers[new].script_calls() > 0
    })
    .await;
    let resumed_in = resumed(&store, &hot, &loose, "the move", RESUME).await;
    // The new master has the replicated state: the exhausted limit stays exhausted.
    let after = check(&store, &hot, &tight).await.unwrap();
    assert!(
        !after.is_allowed(),
        "the failover reset the limit: {after:?}"
    );
    // The layers decide on the new master again.
    let resumed = layered.get();
    wait_until("decisions after the failover", RESUME, || {
        layered.get()[0] >= resumed[0] + 100
    })
    .await;
    stop.store(true, Ordering::Relaxed);
    while let Some(result) = streams.join_next().await {
        result.unwrap();
    }

    let role = setup.servers[new].cli(&["ROLE"]).unwrap();
    assert!(role.starts_with("master"), "{role}");
    // Replicas never get SCRIPT LOAD: the store loaded it on the new master.
    assert!(
        setup.servers[new].script_loads() >= 1,
        "the script was not loaded on the new master: {:?} {:?}",
        setup.servers[new].cli(&["INFO", "commandstats"]),
        setup.servers[1 - new].cli(&["INFO", "commandstats"]),
    );
    let [ok, limited, failed_open] = layered.get();
    assert!(limited > before[1], "no 429 after the failover");
    eprintln!(
        "sentinel failover ({}): the sentinels named the new master {promoted_in:?} after \
         the trigger, the store used it {moved_in:?} later, a direct decision then took \
         {resumed_in:?}; layers: {ok} x 200 decided, \
         {limited} x 429, {failed_open} x 200 failed open (before: {before:?})",
        match trigger {
            Trigger::Kill => "kill -9",
            Trigger::FailoverCommand => "SENTINEL FAILOVER",
        }
    );
}
