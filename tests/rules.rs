//! Rules that change while requests flow: `RulesHandle` under load against real Redis
//! (one server and a cluster), and the memory store's expiry after a change.

#![cfg(feature = "redis")]

use tollgate_test_support as support;

use std::{convert::Infallible, sync::Arc, time::Duration};

use http::{Request, Response, StatusCode};
use support::RedisServer;
use tollgate::{
    FailurePolicy, Limit, OnChange, RateLimitLayer,
    clock::ManualClock,
    headers::HeaderStyle,
    key::{HeaderKey, Key},
    rules::Rules,
    store::{MemoryStore, RedisStore, Store},
};
use tower::{Layer, Service, ServiceExt, service_fn};

/// `q` per hour under `name`, carried over a change.
fn hourly(name: &str, q: u32) -> Limit {
    Limit::fixed_window(q, Duration::from_secs(3600))
        .unwrap()
        .with_name(name)
        .unwrap()
        .with_on_change(OnChange::CarryOver)
        .unwrap()
}

/// The rule set of version `q`: two limits, both at `q`.
fn rules(q: u32) -> Rules {
    Rules::new([
        hourly("a", q),
        Limit::sliding_window_counter(q, Duration::from_secs(3600))
            .unwrap()
            .with_name("b")
            .unwrap()
            .with_on_change(OnChange::CarryOver)
            .unwrap(),
    ])
    .unwrap()
    .with_headers(HeaderStyle::default().with_legacy(true))
    .with_on_store_error(FailurePolicy::Deny)
}

fn header<'a, B: std::fmt::Debug>(response: &'a Response<B>, name: &str) -> &'a str {
    response
        .headers()
        .get(name)
        .unwrap_or_else(|| panic!("no {name}: {response:?}"))
        .to_str()
        .unwrap()
}

/// Every field of a response comes from one rule set: the policy's quotas (written from
/// the rules) equal the limit the store decided with (`X-RateLimit-Limit`, from the
/// decision), and there is one `RateLimit` item per policy item.
fn assert_one_version<B: std::fmt::Debug>(response: &Response<B>) -> u32 {
    assert!(
        matches!(
            response.status(),
            StatusCode::OK | StatusCode::TOO_MANY_REQUESTS
        ),
        "{response:?}"
    );
    let policy = header(response, "ratelimit-policy");
    let quotas: Vec<u32> = policy
        .split(", ")
        .map(|item| {
            let q = item.split(";q=").nth(1).unwrap().split(';').next().unwrap();
            q.parse().unwrap()
        })
        .collect();
    assert_eq!(quotas.len(), 2, "{policy}");
    assert_eq!(quotas[0], quotas[1], "half a change: {policy}");
    let decided: u32 = header(response, "x-ratelimit-limit").parse().unwrap();
    assert_eq!(
        decided, quotas[0],
        "decided under other rules than written: {policy}"
    );
    let items = header(response, "ratelimit").split(", ").count();
    assert_eq!(items, 2);
    quotas[0]
}

async fn hello(_request: Request<()>) -> Result<Response<&'static str>, Infallible> {
    Ok(Response::new("ok"))
}

fn request(key: &str) -> Request<()> {
    Request::builder().header("x-key", key).body(()).unwrap()
}

/// Raises and lowers the limits of a layer on `store` forty times while eight tasks send
/// requests: no request fails, each is answered under one rule set, and afterwards the
/// last limits hold with the budget spent under all of them.
async fn raised_and_lowered_under_load(store: impl Store) {
    let layer = RateLimitLayer::new(hourly("a", 1))
        .with_key(HeaderKey::new("x-key").unwrap())
        .with_store(store)
        // Generous: on a loaded machine the default 100 ms would fail a Redis call open.
        .with_timeout(Some(Duration::from_secs(10)));
    let handle = layer.rules_handle();
    handle.set(rules(1000));
    let service = layer.layer(service_fn(hello));
    let mut tasks = Vec::new();
    for task in 0..8 {
        let mut service = service.clone();
        tasks.push(tokio::spawn(async move {
            let mut seen = [0u32; 2];
            for i in 0..150 {
                let key = format!("load-{task}-{}", i % 3);
                let response = service
                    .ready()
                    .await
                    .unwrap()
                    .call(request(&key))
                    .await
                    .unwrap();
                let q = assert_one_version(&response);
                seen[usize::from(q == 1000)] += 1;
            }
            seen
        }));
    }
    let mut version = handle.version();
    for flip in 0..40 {
        tokio::time::sleep(Duration::from_millis(2)).await;
        version = handle.set(rules(if flip % 2 == 0 { 3 } else { 1000 }));
    }
    let mut seen = [0u32; 2];
    for task in tasks {
        let [low, high] = task.await.unwrap();
        seen[0] += low;
        seen[1] += high;
    }
    assert_eq!(seen[0] + seen[1], 8 * 150);
    assert_eq!(version, 42);
    assert_eq!(handle.version(), 42);
    // The last set raised the limits: a key that spent 5 has room under 1000 ...
    for _ in 0..5 {
        let response = service.clone().oneshot(request("after")).await.unwrap();
        assert_eq!(response.status(), StatusCode::OK);
        assert_eq!(assert_one_version(&response), 1000);
    }
    // ... and none once they are lowered to 3: the 5 it spent carried over.
    handle.set(rules(3));
    let response = service.clone().oneshot(request("after")).await.unwrap();
    assert_eq!(response.status(), StatusCode::TOO_MANY_REQUESTS);
    assert_eq!(assert_one_version(&response), 3);
    assert_eq!(header(&response, "x-ratelimit-remaining"), "0");
    // The layer reports the limits in force.
    assert_eq!(layer.limits()[0].limit(), 3);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn redis_limits_raised_and_lowered_under_load() {
    let server = RedisServer::start();
    let store = RedisStore::connect(server.url()).await.unwrap();
    raised_and_lowered_under_load(store).await;
    support::assert_every_key_expires(&server);
}

#[cfg(feature = "cluster")]
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn cluster_limits_raised_and_lowered_under_load() {
    let cluster = support::cluster::RedisCluster::start();
    let store = RedisStore::connect(tollgate::store::RedisTarget::cluster(&cluster.urls()))
        .await
        .unwrap();
    raised_and_lowered_under_load(store).await;
    assert!(cluster.assert_every_key_expires() > 0);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn memory_limits_raised_and_lowered_under_load() {
    raised_and_lowered_under_load(MemoryStore::new()).await;
}

/// Builder calls after a handle was taken make a layer of their own; clones made before
/// share the handle's rules.
#[tokio::test]
async fn a_handle_changes_the_layer_and_its_clones_only() {
    let layer = RateLimitLayer::new(hourly("a", 1)).with_key(HeaderKey::new("x-key").unwrap());
    let clone = layer.clone();
    let handle = layer.rules_handle();
    let other = layer.clone().with_limit(hourly("c", 7));
    handle.set(rules(5));
    assert_eq!(clone.limits()[0].limit(), 5);
    assert_eq!(other.limits().len(), 2);
    assert_eq!(other.limits()[0].limit(), 1);
    // A service made before the change decides under the new rules.
    let mut service = clone.layer(service_fn(hello));
    let response = service
        .ready()
        .await
        .unwrap()
        .call(request("k"))
        .await
        .unwrap();
    assert_eq!(assert_one_version(&response), 5);
}

#[test]
fn a_rule_set_with_two_limits_sharing_one_state_is_refused() {
    let err = Rules::new([hourly("a", 1), hourly("a", 2)]).unwrap_err();
    assert_eq!(err.field(), "name");
    assert_eq!(Rules::new([]).unwrap_err().field(), "limits");
    // Equal limits count once.
    assert_eq!(
        Rules::new([hourly("a", 1), hourly("a", 1)])
            .unwrap()
            .limits()
            .len(),
        1
    );
}

/// The memory store forgets state once it decides like a missing key: after a change
/// that carries a token bucket over at a slower rate, that is judged by the new rate, as
/// Redis's TTL is, not by the old one (which would refill the bucket early).
#[tokio::test]
async fn memory_sweeps_judge_expiry_by_the_limits_in_force() {
    let clock = ManualClock::new(1_700_000_000_000);
    let store = MemoryStore::new().with_clock(clock.clone());
    let bucket = |limit| {
        [Limit::token_bucket(limit, Duration::from_secs(1))
            .unwrap()
            .with_burst(10)
            .unwrap()
            .with_name("api")
            .unwrap()
            .with_on_change(OnChange::CarryOver)
            .unwrap()]
    };
    let key = Key::new("a");
    let check = |limits: [Limit; 1]| store.check(&key, &limits, 1);
    assert!(check(bucket(10)).await.unwrap().is_allowed());
    store.limits_changed(&bucket(1));
    for _ in 0..9 {
        assert!(check(bucket(1)).await.unwrap().is_allowed());
    }
    // A sweep round now, so the one after the wait is a whole new round.
    for i in 0..100 {
        store
            .check(&Key::new(format!("warm-{i}")), &bucket(1), 1)
            .await
            .unwrap();
    }
    // Empty: full again in 10 s at 1/s (it would have been in 1 s at 10/s).
    clock.advance(Duration::from_millis(2_000));
    // Enough requests on other keys for a sweep of every shard.
    for i in 0..200 {
        store
            .check(&Key::new(format!("other-{i}")), &bucket(1), 1)
            .await
            .unwrap();
    }
    let mut allowed = 0;
    for _ in 0..10 {
        allowed += u32::from(check(bucket(1)).await.unwrap().is_allowed());
    }
    assert_eq!(allowed, 2);
}

#[allow(dead_code)]
fn assert_send_sync(handle: tollgate::rules::RulesHandle) -> Arc<dyn Send + Sync> {
    Arc::new(handle)
}
