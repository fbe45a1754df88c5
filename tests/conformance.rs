//! One scenario table, run against every store: the in-memory store and Redis (through
//! the Lua script, on one server and on a real Redis Cluster with the `cluster` feature)
//! must decide alike. Time is injected: a `ManualClock` drives the
//! memory store and is sent to the script as its explicit `now`.

#![cfg(feature = "redis")]

use tollgate_test_support as support;

use std::time::Duration;

use support::RedisServer;
use tollgate::{
    Algorithm, Decision, Limit, OnChange,
    clock::{Clock, ManualClock},
    key::Key,
    store::{MemoryStore, RedisStore, Store},
};

/// A store under test with the clock that drives it.
struct Harness {
    store: Box<dyn Store>,
    clock: ManualClock,
}

impl Harness {
    async fn check(&self, key: &str, limits: &[Limit], cost: u32) -> Decision {
        self.store
            .check(&Key::new(key), limits, cost)
            .await
            .unwrap()
    }

    fn advance(&self, ms: u64) {
        self.clock.advance(Duration::from_millis(ms));
    }

    /// Checks `n` requests of cost 1 and returns how many were allowed.
    async fn allowed(&self, key: &str, limits: &[Limit], n: u32) -> u32 {
        let mut allowed = 0;
        for _ in 0..n {
            allowed += u32::from(self.check(key, limits, 1).await.is_allowed());
        }
        allowed
    }
}

// A start well inside a window of every length used below (aligned windows).
const START: u64 = 1_700_000_000_000;

fn secs(s: u64) -> Duration {
    Duration::from_secs(s)
}

fn ms(ms: u64) -> Duration {
    Duration::from_millis(ms)
}

/// `limit` per `window` with each of the five algorithms.
fn every_algorithm(limit: u32, window: Duration) -> Vec<Limit> {
    Algorithm::ALL
        .iter()
        .map(|&algorithm| Limit::new(algorithm, limit, window).unwrap())
        .collect()
}

async fn fixed_window_allows_twice_the_limit_across_a_boundary(h: Harness) {
    let limit = [Limit::fixed_window(5, secs(1)).unwrap()];
    h.advance(990);
    assert_eq!(h.allowed("a", &limit, 10).await, 5);
    h.advance(10); // the next window
    assert_eq!(h.allowed("a", &limit, 10).await, 5);
}

async fn sliding_window_holds_in_any_interval(h: Harness) {
    let limit = [Limit::sliding_window(5, secs(1)).unwrap()];
    h.advance(990);
    assert_eq!(h.allowed("a", &limit, 10).await, 5);
    h.advance(10);
    assert_eq!(h.allowed("a", &limit, 10).await, 0);
    let denied = h.check("a", &limit, 1).await;
    assert_eq!(denied.retry_after(), ms(990));
    h.advance(989);
    assert!(!h.check("a", &limit, 1).await.is_allowed());
    h.advance(1);
    assert_eq!(h.allowed("a", &limit, 10).await, 5);
}

async fn sliding_window_counter_weights_the_previous_window(h: Harness) {
    let limit = [Limit::sliding_window_counter(10, ms(100)).unwrap()];
    assert_eq!(h.allowed("a", &limit, 10).await, 10);
    h.advance(125); // a quarter into the next window: 7.5 still count
    assert_eq!(h.allowed("a", &limit, 5).await, 2);
    let denied = h.check("a", &limit, 1).await;
    assert!(!denied.is_allowed());
    // 10 * (100 - e) + 2 * 100 + 100 <= 1000  ->  e >= 30
    assert_eq!(denied.retry_after(), ms(5));
}

async fn token_bucket_refills_continuously(h: Harness) {
    let limit = [Limit::token_bucket(10, secs(1))
        .unwrap()
        .with_burst(3)
        .unwrap()];
    assert_eq!(h.allowed("a", &limit, 5).await, 3);
    let denied = h.check("a", &limit, 1).await;
    assert_eq!(denied.retry_after(), ms(100));
    assert_eq!(denied.limits()[0].remaining, 0);
    h.advance(99);
    assert!(!h.check("a", &limit, 1).await.is_allowed());
    h.advance(1);
    assert!(h.check("a", &limit, 1).await.is_allowed());
    h.advance(10_000);
    let full = h.check("a", &limit, 1).await;
    assert_eq!(full.limits()[0].remaining, 2);
    assert_eq!(full.limits()[0].reset_after(), ms(100));
}

async fn gcra_spaces_requests(h: Harness) {
    let limit = [Limit::gcra(3, ms(10)).unwrap().with_burst(1).unwrap()];
    assert!(h.check("a", &limit, 1).await.is_allowed());
    let denied = h.check("a", &limit, 1).await;
    // One emission interval is 3.33 ms: the next request fits after 4 whole ms.
    assert_eq!(denied.retry_after(), ms(4));
    h.advance(3);
    assert!(!h.check("a", &limit, 1).await.is_allowed());
    h.advance(1);
    assert!(h.check("a", &limit, 1).await.is_allowed());
}

/// Every algorithm: denied now, still denied 1 ms before `retry_after`, allowed at it.
async fn retry_after_is_exact(h: Harness) {
    let limits = every_algorithm(3, ms(700));
    for (i, limit) in limits.iter().enumerate() {
        let key = format!("retry-{i}");
        let limit = std::slice::from_ref(limit);
        for step in 0..3 {
            h.advance(50);
            assert!(
                h.check(&key, limit, 1).await.is_allowed(),
                "{limit:?} step {step}"
            );
        }
        let denied = h.check(&key, limit, 1).await;
        assert!(!denied.is_allowed(), "{limit:?}");
        let wait = denied.retry_after().as_millis() as u64;
        assert!(wait > 0, "{limit:?}");
        h.advance(wait - 1);
        assert!(
            !h.check(&key, limit, 1).await.is_allowed(),
            "{limit:?} early"
        );
        h.advance(1);
        assert!(
            h.check(&key, limit, 1).await.is_allowed(),
            "{limit:?} at retry_after"
        );
    }
}

async fn multi_limit_is_all_or_nothing(h: Harness) {
    // 3 per second and 5 per hour on one API key.
    let limits = [
        Limit::fixed_window(3, secs(1)).unwrap(),
        Limit::fixed_window(5, secs(3600)).unwrap(),
    ];
    assert_eq!(h.allowed("k", &limits, 10).await, 3);
    // Denied by the per-second limit: the hourly one was not charged.
    let denied = h.check("k", &limits, 1).await;
    assert!(!denied.limits()[0].allowed);
    assert!(denied.limits()[1].allowed);
    assert_eq!(denied.limits()[1].remaining, 2);
    h.advance(1000);
    assert_eq!(h.allowed("k", &limits, 10).await, 2);
    // Denied by the hourly limit: the per-second one was not charged.
    let denied = h.check("k", &limits, 1).await;
    assert!(denied.limits()[0].allowed);
    assert_eq!(denied.limits()[0].remaining, 1);
    assert!(!denied.limits()[1].allowed);
}

async fn costs_are_weighed(h: Harness) {
    let limit = [Limit::sliding_window(10, secs(1)).unwrap()];
    assert!(h.check("a", &limit, 7).await.is_allowed());
    let denied = h.check("a", &limit, 4).await;
    assert!(!denied.is_allowed());
    assert_eq!(denied.limits()[0].remaining, 3);
    assert!(h.check("a", &limit, 3).await.is_allowed());
    // More than the limit can ever hold: denied, told to wait one window.
    let never = h.check("b", &limit, 11).await;
    assert!(!never.is_allowed());
    assert_eq!(never.retry_after(), secs(1));
}

async fn keys_are_isolated(h: Harness) {
    let limit = [Limit::fixed_window(2, secs(60)).unwrap()];
    assert_eq!(h.allowed("tenant-a", &limit, 5).await, 2);
    assert_eq!(h.allowed("tenant-b", &limit, 5).await, 2);
    assert_eq!(h.allowed("{tenant-a}", &limit, 5).await, 2);
    assert_eq!(h.allowed("tenant-a\n", &limit, 5).await, 2);
}

/// Two replicas share the store, one's clock 5 ms behind the other's, and take turns
/// across a window boundary (each turn: the one ahead asks for 1, the one behind for 0
/// and for 1). A step back never grants budget: every algorithm admits no more than a
/// clock that only moved forward through the same 45 ms: the limit once, or, for the
/// aligned windows, once in each of the two windows the span touches.
async fn a_clock_that_steps_back_grants_no_extra_budget(h: Harness) {
    let limits = every_algorithm(3, ms(700));
    // 20 ms before a window boundary (START is 400 ms into a 700 ms window).
    h.advance(280);
    let ahead = h.clock.now_ms();
    let mut allowed = [0; 5];
    for turn in 0..40 {
        for (i, limit) in limits.iter().enumerate() {
            let key = format!("replicas-{i}");
            let limit = std::slice::from_ref(limit);
            h.clock.set(ahead + turn);
            allowed[i] += u32::from(h.check(&key, limit, 1).await.is_allowed());
            h.clock.set(ahead + turn - 5);
            h.check(&key, limit, 0).await;
            allowed[i] += u32::from(h.check(&key, limit, 1).await.is_allowed());
        }
    }

    // Each spends its budget, then a clock 5 s behind asks (for 0, then 1), then the
    // first clock again: nothing was handed back, neither behind nor back at now.
    h.advance(10_000);
    let now = h.clock.now_ms();
    let mut granted = [0; 5];
    for (i, limit) in limits.iter().enumerate() {
        let key = format!("behind-{i}");
        let limit = std::slice::from_ref(limit);
        h.clock.set(now);
        assert!(h.check(&key, limit, 3).await.is_allowed(), "{limit:?}");
        h.clock.set(now - 5_000);
        assert!(h.check(&key, limit, 0).await.is_allowed(), "{limit:?}");
        granted[i] += u32::from(h.check(&key, limit, 1).await.is_allowed());
        h.clock.set(now);
        granted[i] += u32::from(h.check(&key, limit, 1).await.is_allowed());
    }
    assert_eq!(
        (allowed, granted),
        ([6, 3, 3, 3, 3], [0; 5]),
        "fixed window, sliding window, sliding window counter, token bucket, GCRA"
    );
}

/// `limit` per `window` named `api`, whose state carries over a change (or not).
fn api(algorithm: Algorithm, limit: u32, window: Duration, on_change: OnChange) -> Limit {
    Limit::new(algorithm, limit, window)
        .unwrap()
        .with_name("api")
        .unwrap()
        .with_on_change(on_change)
        .unwrap()
}

/// The window algorithms count spent units: carried over, they stay counted against a
/// raised or a lowered limit.
async fn carried_over_windows_keep_their_counts(h: Harness) {
    for algorithm in [
        Algorithm::FixedWindow,
        Algorithm::SlidingWindow,
        Algorithm::SlidingWindowCounter,
    ] {
        let key = algorithm.as_str();
        let at = |limit| [api(algorithm, limit, secs(3600), OnChange::CarryOver)];
        assert_eq!(h.allowed(key, &at(3), 5).await, 3, "{algorithm}");
        // Raised: the 3 spent stay spent.
        assert_eq!(h.allowed(key, &at(5), 5).await, 2, "{algorithm}");
        // Lowered below what was spent: nothing left, and never a negative remainder.
        let denied = h.check(key, &at(2), 1).await;
        assert!(!denied.is_allowed(), "{algorithm}");
        assert_eq!(denied.limits()[0].remaining, 0, "{algorithm}");
        assert_eq!(denied.limits()[0].limit, 2, "{algorithm}");
        // And back up: what was spent under every version still counts.
        assert_eq!(h.allowed(key, &at(8), 5).await, 3, "{algorithm}");
    }
}

/// A changed limit that resets (the default) starts with its whole budget; an unchanged
/// one keeps its own either way.
async fn a_changed_limit_resets_by_default(h: Harness) {
    for &algorithm in Algorithm::ALL {
        let key = algorithm.as_str();
        let at = |limit| [api(algorithm, limit, secs(3600), OnChange::Reset)];
        assert_eq!(h.allowed(key, &at(3), 5).await, 3, "{algorithm}");
        assert_eq!(h.allowed(key, &at(4), 5).await, 4, "{algorithm}");
        // Back to 3: its state was never touched by the 4, and is spent.
        assert_eq!(h.allowed(key, &at(3), 5).await, 0, "{algorithm}");
    }
}

/// A carried-over token bucket keeps its tokens, at most the new burst, and refills at
/// the new rate.
async fn a_carried_over_token_bucket_keeps_its_tokens(h: Harness) {
    let bucket = |limit, burst| {
        [Limit::token_bucket(limit, secs(1))
            .unwrap()
            .with_burst(burst)
            .unwrap()
            .with_name("api")
            .unwrap()
            .with_on_change(OnChange::CarryOver)
            .unwrap()]
    };
    assert_eq!(h.allowed("a", &bucket(10, 10), 8).await, 8);
    // A larger burst: the 2 tokens left stay 2.
    let left = h.check("a", &bucket(10, 20), 0).await;
    assert_eq!(left.limits()[0].remaining, 2);
    // Refilled at the new rate: 20 per second is one token per 50 ms.
    h.advance(50);
    assert_eq!(h.allowed("a", &bucket(20, 20), 5).await, 3);
    // A burst that shrinks below the tokens held, in the same millisecond as the last
    // write: the bucket keeps what fits.
    h.advance(10_000);
    assert!(h.check("b", &bucket(10, 10), 1).await.is_allowed());
    let shrunk = h.check("b", &bucket(10, 3), 1).await;
    assert!(shrunk.is_allowed());
    assert_eq!(shrunk.limits()[0].remaining, 2);
    assert_eq!(h.allowed("b", &bucket(10, 3), 5).await, 2);
}

/// A carried-over GCRA keeps its theoretical arrival time: the time until it is full
/// again, so spent units scale with the rate (5 of 10 spent are 10 of 20).
async fn a_carried_over_gcra_keeps_its_arrival_time(h: Harness) {
    let at = |limit| [api(Algorithm::Gcra, limit, secs(1), OnChange::CarryOver)];
    assert_eq!(h.allowed("a", &at(10), 5).await, 5);
    let now = h.check("a", &at(20), 0).await;
    assert_eq!(now.limits()[0].remaining, 10);
    assert_eq!(now.limits()[0].reset_after(), ms(500));
    assert_eq!(h.allowed("a", &at(20), 20).await, 10);
}

/// A carried-over limit whose window changes starts fresh: the window is part of what
/// the state means.
async fn a_new_window_is_new_state(h: Harness) {
    let limit = |window| [api(Algorithm::FixedWindow, 3, window, OnChange::CarryOver)];
    assert_eq!(h.allowed("a", &limit(secs(3600)), 5).await, 3);
    assert_eq!(h.allowed("a", &limit(secs(7200)), 5).await, 3);
}

/// Test certificates for a store over TLS with a client certificate.
#[cfg(feature = "tls")]
fn tls_config(tls: &support::tls::TlsFiles) -> tollgate::store::TlsConfig {
    tollgate::store::TlsConfig::new()
        .with_ca_pem(tls.ca_pem.clone())
        .with_client_cert_pem(tls.client_cert_pem.clone(), tls.client_key_pem.clone())
}

macro_rules! conformance {
    ($($scenario:ident),* $(,)?) => {
        mod memory {
            use super::*;
            $(
                #[tokio::test]
                async fn $scenario() {
                    let clock = ManualClock::new(START);
                    let store = MemoryStore::new().with_clock(clock.clone());
                    super::$scenario(Harness { store: Box::new(store), clock }).await;
                }
            )*
        }

        mod redis {
            use super::*;
            $(
                #[tokio::test]
                async fn $scenario() {
                    let server = RedisServer::start();
                    let clock = ManualClock::new(START);
                    let store = RedisStore::connect(server.url())
                        .await
                        .unwrap()
                        .with_clock(clock.clone());
                    super::$scenario(Harness { store: Box::new(store), clock }).await;
                    support::assert_every_key_expires(&server);
                }
            )*
        }

        /// One node that speaks only TLS and requires a client certificate.
        #[cfg(feature = "tls")]
        mod redis_tls {
            use super::*;
            $(
                #[tokio::test]
                async fn $scenario() {
                    let tls = std::sync::Arc::new(support::tls::TlsFiles::generate());
                    let server = RedisServer::start_tls(&tls);
                    let clock = ManualClock::new(START);
                    let store = RedisStore::connect(tollgate::store::RedisTarget::node(server.url()).with_tls(tls_config(&tls)))
                        .await
                        .unwrap()
                        .with_clock(clock.clone());
                    super::$scenario(Harness { store: Box::new(store), clock }).await;
                    assert!(support::assert_every_key_expires(&server) > 0, "no keys");
                }
            )*
        }

        /// As the least-privileged ACL user the README documents.
        mod redis_acl {
            use super::*;
            $(
                #[tokio::test]
                async fn $scenario() {
                    let server = RedisServer::start();
                    let url = support::acl::least_privilege_user(&server, "tollgate");
                    let clock = ManualClock::new(START);
                    let store = RedisStore::connect(url)
                        .await
                        .unwrap()
                        .with_clock(clock.clone());
                    super::$scenario(Harness { store: Box::new(store), clock }).await;
                    assert!(support::assert_every_key_expires(&server) > 0, "no keys");
                }
            )*
        }

        /// A real cluster of three masters and three replicas per scenario.
        #[cfg(feature = "cluster")]
        mod cluster {
            use super::*;
            use support::cluster::RedisCluster;
            $(
                #[tokio::test]
                async fn $scenario() {
                    let cluster = RedisCluster::start();
                    let clock = ManualClock::new(START);
                    let store = RedisStore::connect(tollgate::store::RedisTarget::cluster(&cluster.urls()))
                        .await
                        .unwrap()
                        .with_clock(clock.clone());
                    super::$scenario(Harness { store: Box::new(store), clock }).await;
                    // Scans every master; finding no key at all would mean looking in the
                    // wrong place.
                    assert!(cluster.assert_every_key_expires() > 0, "no keys on any master");
                }
            )*
        }
    };
}

conformance!(
    fixed_window_allows_twice_the_limit_across_a_boundary,
    sliding_window_holds_in_any_interval,
    sliding_window_counter_weights_the_previous_window,
    token_bucket_refills_continuously,
    gcra_spaces_requests,
    retry_after_is_exact,
    multi_limit_is_all_or_nothing,
    costs_are_weighed,
    keys_are_isolated,
    a_clock_that_steps_back_grants_no_extra_budget,
    carried_over_windows_keep_their_counts,
    a_changed_limit_resets_by_default,
    a_carried_over_token_bucket_keeps_its_tokens,
    a_carried_over_gcra_keeps_its_arrival_time,
    a_new_window_is_new_state,
);

/// A real cluster speaking only TLS (clients, bus, replication): a few scenarios, since each
/// starts six nodes.
#[cfg(all(feature = "cluster", feature = "tls"))]
mod cluster_tls {
    use super::*;
    use support::cluster::RedisCluster;

    macro_rules! over_tls_cluster {
        ($($scenario:ident),* $(,)?) => {
            $(
                #[tokio::test]
                async fn $scenario() {
                    let tls = std::sync::Arc::new(support::tls::TlsFiles::generate());
                    let cluster = RedisCluster::start_tls(&tls);
                    let clock = ManualClock::new(START);
                    let store = RedisStore::connect(tollgate::store::RedisTarget::cluster(&cluster.urls()).with_tls(tls_config(&tls)))
                        .await
                        .unwrap()
                        .with_clock(clock.clone());
                    super::$scenario(Harness { store: Box::new(store), clock }).await;
                    assert!(cluster.assert_every_key_expires() > 0, "no keys on any master");
                }
            )*
        };
    }

    over_tls_cluster!(
        retry_after_is_exact,
        multi_limit_is_all_or_nothing,
        keys_are_isolated
    );
}
