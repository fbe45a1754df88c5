//! Leased quota against real Redis: several `RedisStore`s in one process are several
//! nodes sharing one budget, on one injected clock.

#![cfg(feature = "redis")]

use tollgate_test_support as support;

use std::{
    sync::{
        Arc,
        atomic::{AtomicU64, Ordering},
    },
    time::{Duration, Instant},
};

use proptest::prelude::*;
use support::RedisServer;
use tollgate::{
    Algorithm, Decision, Limit,
    algorithm::{self, State},
    clock::{Clock, ManualClock},
    key::Key,
    store::{LeaseConfig, RedisStore, Store},
};

/// A multiple of every window used here.
const START: u64 = 1_700_000_000_000;

async fn node(url: &str, prefix: &str, clock: &ManualClock, config: LeaseConfig) -> RedisStore {
    RedisStore::connect(url)
        .await
        .unwrap()
        .with_prefix(prefix)
        .unwrap()
        .with_clock(clock.clone())
        .with_leases(config)
}

/// `tasks` tasks on each node send `each[node]` requests of cost 1 for `key`, yielding
/// between requests as requests from a network would; allowed per node.
async fn hammer(
    nodes: &[RedisStore],
    limits: &[Limit],
    key: &Key,
    tasks: usize,
    each: &[usize],
) -> Vec<u64> {
    hammer_until(nodes, limits, key, tasks, each, usize::MAX).await
}

/// [`hammer`], where a task also stops after `denials` denials: a load that lasts as
/// long as the budget does.
async fn hammer_until(
    nodes: &[RedisStore],
    limits: &[Limit],
    key: &Key,
    tasks: usize,
    each: &[usize],
    denials: usize,
) -> Vec<u64> {
    let limits: Arc<[Limit]> = limits.into();
    let counts: Vec<Arc<AtomicU64>> = nodes.iter().map(|_| Arc::default()).collect();
    let mut handles = Vec::new();
    for ((store, count), &each) in nodes.iter().zip(&counts).zip(each) {
        for _ in 0..tasks {
            let (store, count, limits, key) =
                (store.clone(), count.clone(), limits.clone(), key.clone());
            handles.push(tokio::spawn(async move {
                let mut denied = 0;
                for _ in 0..each {
                    let decision = store.check(&key, &limits, 1).await.unwrap();
                    if decision.is_allowed() {
                        count.fetch_add(1, Ordering::Relaxed);
                    } else {
                        assert!(decision.retry_after() > Duration::ZERO, "{decision:?}");
                        denied += 1;
                        if denied == denials {
                            break;
                        }
                    }
                    tokio::task::yield_now().await;
                }
            }));
        }
    }
    for handle in handles {
        handle.await.unwrap();
    }
    counts.iter().map(|c| c.load(Ordering::Relaxed)).collect()
}

/// Script calls the server has run so far.
fn script_calls(server: &RedisServer) -> u64 {
    server.script_calls()
}

/// 10 windows, each hit at two moments by every node's 32 tasks: first with 60% of the
/// limit in all (the nodes keep leases), then until every task was denied 3 times (at
/// saturation: the leases held must be spent, the rest goes by Redis); allowed per window
/// and node, and requests sent.
async fn saturate(
    nodes: &[RedisStore],
    clock: &ManualClock,
    limit: &Limit,
) -> (Vec<Vec<u64>>, u64) {
    let w = limit.window().as_millis() as u64;
    let l = limit.limit() as usize;
    let first = vec![(6 * l / 10).div_ceil(32 * nodes.len()); nodes.len()];
    let key = Key::new("global");
    let mut windows = Vec::new();
    let mut requests = 0;
    for window in 0..10u64 {
        let mut allowed = vec![0; nodes.len()];
        clock.set(START + window * w + (window * 97) % (w / 2));
        let got = hammer(nodes, std::slice::from_ref(limit), &key, 32, &first).await;
        requests += (first[0] * 32 * nodes.len()) as u64;
        clock.set(START + window * w + w / 2 + (window * 31) % (w / 2));
        let many = vec![l; nodes.len()];
        let then = hammer_until(nodes, std::slice::from_ref(limit), &key, 32, &many, 3).await;
        for (a, g) in allowed.iter_mut().zip(got.into_iter().zip(then)) {
            *a += g.0 + g.1;
            requests += g.1 + 3 * 32;
        }
        windows.push(allowed);
    }
    (windows, requests)
}

fn assert_bound(windows: &[Vec<u64>], limit: &Limit) {
    for (i, allowed) in windows.iter().enumerate() {
        let total: u64 = allowed.iter().sum();
        assert!(
            total <= u64::from(limit.limit()),
            "window {i}: {allowed:?} allowed, over {limit:?}"
        );
    }
}

async fn bound_on_nodes(n: usize, algorithm: Algorithm) {
    let server = RedisServer::start();
    let clock = ManualClock::new(START);
    let limit = Limit::new(algorithm, 1_000, Duration::from_secs(1)).unwrap();
    let mut nodes = Vec::new();
    for _ in 0..n {
        nodes.push(node(&server.url(), "bound", &clock, LeaseConfig::new()).await);
    }
    let calls = script_calls(&server);
    let (windows, requests) = saturate(&nodes, &clock, &limit).await;
    let calls = script_calls(&server) - calls;
    assert_bound(&windows, &limit);
    let totals: Vec<u64> = windows.iter().map(|w| w.iter().sum()).collect();
    println!(
        "{n} nodes, {algorithm:?}: allowed per window {totals:?}; {calls} script calls for \
         {requests} requests ({:.4} per request)",
        calls as f64 / requests as f64
    );
    if algorithm == Algorithm::FixedWindow {
        // Little stranded: at saturation nearly the whole limit is spent in every window.
        for (i, &total) in totals.iter().enumerate() {
            assert!(total >= 970, "window {i}: only {total} of 1000 allowed");
        }
    }
    // Little stranded, for either algorithm: every window gets at least 97% of what one
    // node without leases (the model) admits under the same load at the same moments.
    let model = model_saturate(n, &limit);
    println!("{n} nodes, {algorithm:?}: the model allows {model:?}");
    for (i, (&got, &want)) in totals.iter().zip(&model).enumerate() {
        assert!(
            got * 100 >= want * 97,
            "window {i}: {got} allowed, the model {want}: {totals:?} against {model:?}"
        );
    }
}

/// What [`saturate`] lets through per window when the model decides every request.
fn model_saturate(nodes: usize, limit: &Limit) -> Vec<u64> {
    let w = limit.window().as_millis() as u64;
    let l = limit.limit() as usize;
    let first = (6 * l / 10).div_ceil(32 * nodes) * 32 * nodes;
    let limits = std::slice::from_ref(limit);
    let mut states = [State::new(limit.algorithm())];
    let mut out = Vec::new();
    for window in 0..10u64 {
        let mut allowed = 0;
        let now = START + window * w + (window * 97) % (w / 2);
        for _ in 0..first {
            allowed += u64::from(algorithm::check(&mut states, limits, now, 1).is_allowed());
        }
        let now = START + window * w + w / 2 + (window * 31) % (w / 2);
        while algorithm::check(&mut states, limits, now, 1).is_allowed() {
            allowed += 1;
        }
        out.push(allowed);
    }
    out
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn two_nodes_never_exceed_a_fixed_window() {
    bound_on_nodes(2, Algorithm::FixedWindow).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn four_nodes_never_exceed_a_fixed_window() {
    bound_on_nodes(4, Algorithm::FixedWindow).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn two_nodes_never_exceed_a_sliding_window_counter() {
    bound_on_nodes(2, Algorithm::SlidingWindowCounter).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn four_nodes_never_exceed_a_sliding_window_counter() {
    bound_on_nodes(4, Algorithm::SlidingWindowCounter).await;
}

/// Token bucket and GCRA: 2 and 4 nodes x 32 tasks on one key, 10 moments half a window
/// apart, each until every task was denied 3 times. From the first moment on, no more
/// passes than the bucket and its refill allow (every leased unit was taken from it
/// first); between any two moments, at most that plus what the leases held (taken
/// earlier, spent later); and nearly all of it is spent.
async fn bucket_bound_on_nodes(n: usize, algorithm: Algorithm) {
    let server = RedisServer::start();
    let clock = ManualClock::new(START);
    let limit = Limit::new(algorithm, 1_000, Duration::from_secs(1)).unwrap();
    let mut nodes = Vec::new();
    for _ in 0..n {
        nodes.push(node(&server.url(), "bucket", &clock, LeaseConfig::new()).await);
    }
    let key = Key::new("global");
    let mut allowed = Vec::new();
    for step in 0..10u64 {
        clock.set(START + step * 500);
        let got = hammer_until(
            &nodes,
            std::slice::from_ref(&limit),
            &key,
            32,
            &vec![2_000; n],
            3,
        )
        .await;
        allowed.push(got.iter().sum::<u64>());
    }
    // Capacity, and the refill of half a window between moments.
    let (burst, refill) = (1_000u64, 500u64);
    let held = n as u64 * 100; // max_fraction 0.1 of the limit, per node
    for i in 0..allowed.len() {
        for j in i..allowed.len() {
            let used: u64 = allowed[i..=j].iter().sum();
            let bound = burst + refill * (j - i) as u64;
            if i == 0 {
                assert!(used <= bound, "{algorithm:?} on {n}: {allowed:?}");
            }
            assert!(used <= bound + held, "{algorithm:?} on {n}: {allowed:?}");
        }
    }
    let total: u64 = allowed.iter().sum();
    let most = burst + refill * 9;
    println!("{n} nodes, {algorithm:?}: allowed per moment {allowed:?}, {total} of {most}");
    assert!(
        total * 100 >= most * 97,
        "{algorithm:?} on {n}: {allowed:?}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn two_and_four_nodes_keep_a_token_bucket() {
    bucket_bound_on_nodes(2, Algorithm::TokenBucket).await;
    bucket_bound_on_nodes(4, Algorithm::TokenBucket).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn two_and_four_nodes_keep_gcra() {
    bucket_bound_on_nodes(2, Algorithm::Gcra).await;
    bucket_bound_on_nodes(4, Algorithm::Gcra).await;
}

/// Two nodes under the same saturating load share the limit about evenly.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn two_nodes_at_equal_load_share_fairly() {
    let server = RedisServer::start();
    let clock = ManualClock::new(START);
    let limit = Limit::fixed_window(1_000, Duration::from_secs(1)).unwrap();
    let a = node(&server.url(), "fair", &clock, LeaseConfig::new()).await;
    let b = node(&server.url(), "fair", &clock, LeaseConfig::new()).await;
    let (windows, _) = saturate(&[a, b], &clock, &limit).await;
    let a: u64 = windows.iter().map(|w| w[0]).sum();
    let b: u64 = windows.iter().map(|w| w[1]).sum();
    let share = a as f64 / (a + b) as f64;
    println!("fair: {a} and {b} allowed ({share:.3})");
    assert!((0.4..=0.6).contains(&share), "{a} against {b}");
}

/// A node asking a fifth of the limit next to one asking three times it gets nearly all
/// it asks for: the big node's leases never take more than a tenth of the limit at once.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_small_node_beside_a_flooding_one_gets_its_share() {
    let server = RedisServer::start();
    let clock = ManualClock::new(START);
    let limit = Limit::fixed_window(1_000, Duration::from_secs(1)).unwrap();
    let small = node(&server.url(), "small", &clock, LeaseConfig::new()).await;
    let big = node(&server.url(), "small", &clock, LeaseConfig::new()).await;
    let key = Key::new("global");
    let (mut asked, mut got) = (0, 0);
    for window in 0..10 {
        clock.set(START + window * 1_000 + 10);
        let allowed = hammer(
            &[small.clone(), big.clone()],
            std::slice::from_ref(&limit),
            &key,
            32,
            &[200 / 32, 3_000 / 32],
        )
        .await;
        asked += (200 / 32) * 32;
        got += allowed[0];
    }
    println!("small node: {got} of {asked}");
    // A window goes to whoever asks first, so the share follows the scheduler too: alone
    // 1920 of 1920, beside 31 other tests 1878 to 1920, once 1807 (94%) in a CI run.
    assert!(got * 100 >= asked * 85, "{got} of {asked}");
}

/// A node never holds more than `max_fraction` of the smallest limit (`LeaseConfig`,
/// README "Leased quota"): the refill at a quarter left asks only for what tops the lease
/// up to that, not for a whole lease beside what it still holds (which held 32 to 35 of
/// a limit of 300 at a fraction of 0.1). What a node holds is what Redis counts beyond
/// what it allowed; the clock stands still, so nothing ends or goes back meanwhile.
#[tokio::test]
async fn a_node_never_holds_more_than_max_fraction_of_the_smallest_limit() {
    let server = RedisServer::start();
    let clock = ManualClock::new(START);
    let small = Limit::fixed_window(300, Duration::from_secs(60)).unwrap();
    let large = Limit::fixed_window(5_000, Duration::from_secs(3_600)).unwrap();
    let limits = [small.clone(), large];
    let key = Key::new("global");
    let a = node(&server.url(), "cap", &clock, LeaseConfig::new()).await;
    let (mut allowed, mut most) = (0, 0);
    for _ in 0..250 {
        if a.check(&key, &limits, 1).await.unwrap().is_allowed() {
            allowed += 1;
        }
        let held = count_in_redis(&server, &a, &key, &small) - allowed;
        most = most.max(held);
    }
    println!("held at most {most} of 300");
    assert!(most <= 30, "a node held {most} units, above a tenth of 300");
    // It leased at all, and to the full cap: the bound was met, not missed.
    assert!(most >= 25, "held at most {most}");
}

/// The Redis count of `limit` for `key` (fixed window: `count * 2^20 + window tag`).
fn count_in_redis(server: &RedisServer, store: &RedisStore, key: &Key, limit: &Limit) -> u64 {
    let value = server.cli(&["GET", &store.redis_key(key, limit)]).unwrap();
    u64::from(support::fixed_window_count(&value))
}

/// Waits (up to 10 s) until Redis counts `want`.
async fn until_counted(
    server: &RedisServer,
    store: &RedisStore,
    key: &Key,
    limit: &Limit,
    want: u64,
) {
    let deadline = Instant::now() + Duration::from_secs(10);
    loop {
        let got = count_in_redis(server, store, key, limit);
        if got == want {
            return;
        }
        assert!(
            Instant::now() < deadline,
            "Redis still counts {got}, not {want}"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

/// One node takes a lease with 50 requests: Redis counts more than were spent.
async fn leased(
    server: &RedisServer,
    clock: &ManualClock,
    config: LeaseConfig,
) -> (RedisStore, Limit, Key) {
    let limit = Limit::fixed_window(1_000, Duration::from_secs(60)).unwrap();
    let key = Key::new("global");
    let a = node(&server.url(), "return", clock, config).await;
    for _ in 0..50 {
        assert!(
            a.check(&key, std::slice::from_ref(&limit), 1)
                .await
                .unwrap()
                .is_allowed()
        );
    }
    assert!(count_in_redis(server, &a, &key, &limit) > 50);
    (a, limit, key)
}

/// Another node then spends exactly what is left.
async fn the_rest_goes_to_another_node(server: &RedisServer, clock: &ManualClock, limit: &Limit) {
    let b = node(&server.url(), "return", clock, LeaseConfig::new()).await;
    let allowed = hammer(
        &[b],
        std::slice::from_ref(limit),
        &Key::new("global"),
        4,
        &[500],
    )
    .await;
    assert_eq!(allowed, [950]);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_idle_lease_goes_back_and_another_node_spends_it() {
    let server = RedisServer::start();
    let clock = ManualClock::new(START);
    let config = LeaseConfig::new()
        .with_idle(Duration::from_millis(100))
        .unwrap();
    let (a, limit, key) = leased(&server, &clock, config).await;
    clock.advance(Duration::from_millis(150));
    until_counted(&server, &a, &key, &limit, 50).await;
    the_rest_goes_to_another_node(&server, &clock, &limit).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_dropped_node_gives_its_lease_back() {
    let server = RedisServer::start();
    let clock = ManualClock::new(START);
    let (a, limit, key) = leased(&server, &clock, LeaseConfig::new()).await;
    let probe = a.clone().with_leases(LeaseConfig::new());
    drop(a);
    until_counted(&server, &probe, &key, &limit, 50).await;
    the_rest_goes_to_another_node(&server, &clock, &limit).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn release_leases_gives_everything_back() {
    let server = RedisServer::start();
    let clock = ManualClock::new(START);
    let (a, limit, key) = leased(&server, &clock, LeaseConfig::new()).await;
    a.release_leases().await.unwrap();
    assert_eq!(count_in_redis(&server, &a, &key, &limit), 50);
    the_rest_goes_to_another_node(&server, &clock, &limit).await;
}

/// A lease belongs to its window: units a node still holds when the window ends are
/// never spent in the next one, where the nodes together get exactly `limit`.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_lease_is_never_spent_in_the_next_window() {
    let server = RedisServer::start();
    let clock = ManualClock::new(START);
    for algorithm in [Algorithm::FixedWindow, Algorithm::SlidingWindowCounter] {
        let prefix = format!("next{algorithm:?}");
        let limit = Limit::new(algorithm, 1_000, Duration::from_secs(1)).unwrap();
        let a = node(&server.url(), &prefix, &clock, LeaseConfig::new()).await;
        let b = node(&server.url(), &prefix, &clock, LeaseConfig::new()).await;
        let key = Key::new("global");
        clock.set(START + 10_000 + 900);
        for _ in 0..50 {
            assert!(
                a.check(&key, std::slice::from_ref(&limit), 1)
                    .await
                    .unwrap()
                    .is_allowed()
            );
        }
        // Two windows later (the sliding-window counter's previous window is empty).
        clock.set(START + 12_000 + 100);
        let nodes = [a, b];
        let allowed = hammer_until(
            &nodes,
            std::slice::from_ref(&limit),
            &key,
            32,
            &[1_000, 1_000],
            3,
        )
        .await;
        // Never above the limit (old units spent here would make it more); the budget is
        // spent nearly to the last unit.
        let total: u64 = allowed.iter().sum();
        assert!((990..=1_000).contains(&total), "{algorithm:?}: {allowed:?}");
    }
}

/// Leases never stop limiting: with one node, window after window, exactly `limit`
/// requests pass, most without a Redis call, and every denial carries Redis's exact
/// `retry_after`, also after the leases of the window before ended.
#[tokio::test]
async fn limiting_comes_back_after_every_lease_ends() {
    let server = RedisServer::start();
    let clock = ManualClock::new(START);
    for algorithm in [Algorithm::FixedWindow, Algorithm::SlidingWindowCounter] {
        let limit = Limit::new(algorithm, 100, Duration::from_secs(1)).unwrap();
        let limits = std::slice::from_ref(&limit);
        let store = node(
            &server.url(),
            &format!("back{algorithm:?}"),
            &clock,
            LeaseConfig::new(),
        )
        .await;
        let key = Key::new("global");
        let calls = script_calls(&server);
        for window in 0..4u64 {
            // The start of every other window, so that the sliding-window counter's
            // previous window weighs nothing or everything: `limit` or 0 may pass.
            let offset = if window % 2 == 0 { 0 } else { 400 };
            let now = START + 2 * window * 1_000 + offset;
            clock.set(now);
            let mut allowed = 0;
            let mut last: Option<Decision> = None;
            for _ in 0..300 {
                let decision = store.check(&key, limits, 1).await.unwrap();
                if decision.is_allowed() {
                    allowed += 1;
                } else {
                    last = Some(decision);
                }
            }
            assert_eq!(allowed, 100, "{algorithm:?}, window {window}");
            // Redis's answer, exactly as without leases.
            let mut states = [State::new(algorithm)];
            let mut want = None;
            for _ in 0..101 {
                want = Some(algorithm::check(&mut states, limits, now, 1));
            }
            assert_eq!(
                last.unwrap(),
                want.unwrap(),
                "{algorithm:?}, window {window}"
            );
        }
        let calls = script_calls(&server) - calls;
        assert!(
            calls < 4 * 300 / 2,
            "{calls} script calls for 1200 requests"
        );
    }
}

/// Redis gone: units already leased are still spent until the lease ends, then the
/// store fails (and the layer's failure policy answers).
#[tokio::test]
async fn leased_units_are_spent_while_redis_is_down_until_the_lease_ends() {
    let mut server = RedisServer::start();
    let clock = ManualClock::new(START);
    let (a, limit, key) = leased(&server, &clock, LeaseConfig::new()).await;
    let held = count_in_redis(&server, &a, &key, &limit) - 50;
    server.kill();
    let limits = std::slice::from_ref(&limit);
    let mut allowed = 0;
    let mut failed = 0;
    for _ in 0..held + 5 {
        match a.check(&key, limits, 1).await {
            Ok(decision) => {
                assert!(decision.is_allowed());
                assert_eq!(failed, 0, "allowed after a failure");
                allowed += 1;
            }
            Err(_) => failed += 1,
        }
    }
    assert_eq!((allowed, failed), (held, 5));
    // A second lease, left with units, ends with its window.
    server.restart();
    let b = node(&server.url(), "down", &clock, LeaseConfig::new()).await;
    clock.advance(Duration::from_secs(60));
    for _ in 0..50 {
        assert!(b.check(&key, limits, 1).await.unwrap().is_allowed());
    }
    server.kill();
    assert!(b.check(&key, limits, 1).await.unwrap().is_allowed());
    clock.advance(Duration::from_secs(60));
    assert!(b.check(&key, limits, 1).await.is_err());
}

thread_local! {
    static SERVER: RedisServer = RedisServer::start();
    static CASE: std::cell::Cell<u64> = const { std::cell::Cell::new(0) };
}

fn leased_limits_strategy() -> impl Strategy<Value = Vec<Limit>> {
    // Not the buckets: a unit taken from a bucket and spent later leaves room that its
    // refill fills in between, so even one node may admit up to what its lease held more
    // than the model in a short interval (the bound `bucket_bound_on_nodes` checks).
    let algorithm = prop::sample::select(vec![
        Algorithm::FixedWindow,
        Algorithm::SlidingWindowCounter,
    ]);
    let window = prop_oneof![10u64..200, 200u64..3_000];
    prop::collection::vec((algorithm, 10u32..200, window, 10u32..300), 1..=2).prop_map(|limits| {
        let mut seen = std::collections::HashSet::new();
        limits
            .into_iter()
            .map(|(a, l, w, b)| {
                let limit = Limit::new(a, l, Duration::from_millis(w)).unwrap();
                match a {
                    Algorithm::TokenBucket | Algorithm::Gcra => limit.with_burst(b).unwrap(),
                    _ => limit,
                }
            })
            .filter(|l| seen.insert(format!("{l:?}")))
            .collect()
    })
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 64, ..ProptestConfig::default() })]

    /// With one node and one request at a time, a store with leases decides exactly like
    /// the model: the same requests allowed, the same `retry_after`; `remaining` exact for
    /// the fixed window, never above the model's for the sliding-window counter (it does
    /// not rise between Redis calls, where the previous window's weight shrinks).
    #[test]
    fn one_node_with_leases_decides_like_the_model(
        limits in leased_limits_strategy(),
        steps in prop::collection::vec(
            (prop_oneof![4 => 0u64..5, 2 => 0u64..100, 1 => 0u64..3_000], 0u32..4),
            1..200,
        ),
    ) {
        let runtime = tokio::runtime::Builder::new_current_thread().enable_all().build().unwrap();
        let case = CASE.with(|c| { c.set(c.get() + 1); c.get() });
        runtime.block_on(async {
            let clock = ManualClock::new(START);
            let url = SERVER.with(|s| s.url());
            let store = node(&url, &format!("model{case}"), &clock, LeaseConfig::new())
                .await
                .with_block_cache(None);
            let mut states: Vec<State> = limits.iter().map(|l| State::new(l.algorithm())).collect();
            let key = Key::new("k");
            for (i, &(wait, cost)) in steps.iter().enumerate() {
                clock.advance(Duration::from_millis(wait));
                let now = clock.now_ms();
                let want = algorithm::check(&mut states, &limits, now, cost);
                let got = store.check(&key, &limits, cost).await.unwrap();
                prop_assert_eq!(got.is_allowed(), want.is_allowed(), "step {} at {}: {:?} {:?}", i, now, got, want);
                prop_assert_eq!(got.retry_after(), want.retry_after(), "step {}", i);
                for ((g, w), limit) in got.limits().iter().zip(want.limits()).zip(&limits) {
                    if limit.algorithm() == Algorithm::FixedWindow {
                        prop_assert_eq!(g.remaining, w.remaining, "step {}: {:?} {:?}", i, got, want);
                    } else {
                        prop_assert!(g.remaining <= w.remaining, "step {}: {:?} {:?}", i, got, want);
                    }
                }
            }
            Ok(())
        })?;
    }
}

/// On a Redis Cluster: two nodes keep every key's limit per aligned window, for keys on
/// different masters, and a release gives every key's units back (one call per slot).
#[cfg(feature = "cluster")]
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn on_a_cluster_leases_keep_the_bound_and_go_back() {
    let cluster = support::cluster::RedisCluster::start();
    let clock = ManualClock::new(START);
    let connect = || async {
        RedisStore::connect(tollgate::store::RedisTarget::cluster(&cluster.urls()))
            .await
            .unwrap()
            .with_clock(clock.clone())
            .with_leases(LeaseConfig::new())
    };
    let nodes = [connect().await, connect().await];
    let keys: Vec<Key> = (0..6).map(|i| Key::new(format!("client{i}"))).collect();
    for algorithm in [Algorithm::FixedWindow, Algorithm::SlidingWindowCounter] {
        let limit = Limit::new(algorithm, 500, Duration::from_secs(1)).unwrap();
        for window in 0..3u64 {
            clock.set(START + 2 * window * 1_000 + 100 * window);
            for key in &keys {
                let allowed =
                    hammer_until(&nodes, std::slice::from_ref(&limit), key, 8, &[500, 500], 3)
                        .await;
                let total: u64 = allowed.iter().sum();
                assert!(total <= 500, "{algorithm:?} {key:?}: {allowed:?}");
                assert!(total >= 485, "{algorithm:?} {key:?}: only {allowed:?}");
            }
        }
    }
    // Leases on every key, then released: Redis counts exactly what was spent.
    let limit = Limit::fixed_window(1_000, Duration::from_secs(60)).unwrap();
    clock.set(START + 60_000);
    for key in &keys {
        for _ in 0..50 {
            assert!(
                nodes[0]
                    .check(key, std::slice::from_ref(&limit), 1)
                    .await
                    .unwrap()
                    .is_allowed()
            );
        }
    }
    let count = |key: &Key| -> u64 {
        let redis_key = nodes[0].redis_key(key, &limit);
        let node = cluster.node_for_key(&redis_key);
        let value = cluster.cli(node, &["GET", &redis_key]).unwrap();
        u64::from(support::fixed_window_count(&value))
    };
    assert!(keys.iter().any(|k| count(k) > 50));
    nodes[0].release_leases().await.unwrap();
    for key in &keys {
        assert_eq!(count(key), 50, "{key:?}");
    }
}

/// Through a layer with the default circuit breaker and `FailurePolicy::Deny`: with Redis
/// gone, other keys' failures open the circuit, and the hot key's leased units are still
/// spent (200) until they run out (503); no request is allowed beyond them.
#[tokio::test]
async fn leased_units_are_spent_while_the_circuit_is_open() {
    use http::{Request, Response, StatusCode};
    use tollgate::{FailurePolicy, RateLimitLayer, key::HeaderKey};
    use tower::{Layer, ServiceExt, service_fn};

    let mut server = RedisServer::start();
    let clock = ManualClock::new(START);
    let store = node(&server.url(), "circuit", &clock, LeaseConfig::new()).await;
    let limit = Limit::fixed_window(1_000, Duration::from_secs(60)).unwrap();
    let layer = RateLimitLayer::new(limit.clone())
        .with_store(store.clone())
        .with_key(HeaderKey::new("x-user").unwrap())
        .with_on_store_error(FailurePolicy::Deny)
        .with_timeout(Some(Duration::from_secs(2)));
    let service = layer.layer(service_fn(|_: Request<()>| async {
        Ok::<_, std::convert::Infallible>(Response::new(String::new()))
    }));
    let send = |user: &str| {
        let request = Request::get("/").header("x-user", user).body(()).unwrap();
        let service = service.clone();
        async move { service.oneshot(request).await.unwrap().status() }
    };
    for _ in 0..50 {
        assert_eq!(send("hot").await, StatusCode::OK);
    }
    let key = Key::new("header:x-user|hot");
    let redis_keys = server.cli(&["--scan", "--pattern", "circuit:*"]).unwrap();
    let redis_key = redis_keys.lines().next().unwrap().trim().to_owned();
    let value = server.cli(&["GET", &redis_key]).unwrap();
    let held = u64::from(support::fixed_window_count(&value)) - 50;
    assert!(held > 0, "{key:?}: no lease");
    server.kill();
    // Five cold keys fail: the circuit opens.
    for i in 0..5 {
        assert_eq!(
            send(&format!("cold{i}")).await,
            StatusCode::SERVICE_UNAVAILABLE
        );
    }
    let mut statuses = Vec::new();
    for _ in 0..held + 3 {
        statuses.push(send("hot").await);
    }
    let ok = statuses
        .iter()
        .take_while(|s| **s == StatusCode::OK)
        .count() as u64;
    assert_eq!(ok, held, "{statuses:?}");
    assert!(
        statuses[ok as usize..]
            .iter()
            .all(|s| *s == StatusCode::SERVICE_UNAVAILABLE)
    );
}

/// Without coalescing (each decision its own script call) leases are taken, spent and
/// given back the same way.
#[tokio::test]
async fn without_coalescing_leases_work_the_same() {
    let server = RedisServer::start();
    let clock = ManualClock::new(START);
    let limit = Limit::fixed_window(1_000, Duration::from_secs(60)).unwrap();
    let key = Key::new("global");
    let store = node(&server.url(), "direct", &clock, LeaseConfig::new())
        .await
        .with_coalescing(None);
    let calls = script_calls(&server);
    for _ in 0..200 {
        assert!(
            store
                .check(&key, std::slice::from_ref(&limit), 1)
                .await
                .unwrap()
                .is_allowed()
        );
    }
    assert!(
        script_calls(&server) - calls < 100,
        "{}",
        script_calls(&server) - calls
    );
    assert!(count_in_redis(&server, &store, &key, &limit) > 200);
    store.release_leases().await.unwrap();
    assert_eq!(count_in_redis(&server, &store, &key, &limit), 200);
}

/// The task that returns idle leases lives on a runtime: a store that outlives the
/// runtime it first leased on starts it again on the next one.
#[test]
fn idle_leases_go_back_after_the_first_runtime_shut_down() {
    let server = RedisServer::start();
    let clock = ManualClock::new(START);
    let runtime = || {
        tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .unwrap()
    };
    let config = LeaseConfig::new()
        .with_idle(Duration::from_millis(100))
        .unwrap();
    let limit = Limit::fixed_window(1_000, Duration::from_secs(60)).unwrap();
    let limits = std::slice::from_ref(&limit);
    let (a, b) = (Key::new("a"), Key::new("b"));
    let store = runtime().block_on(async {
        let store = node(&server.url(), "runtimes", &clock, config).await;
        for _ in 0..50 {
            assert!(store.check(&a, limits, 1).await.unwrap().is_allowed());
        }
        store
    });
    runtime().block_on(async {
        for _ in 0..50 {
            assert!(store.check(&b, limits, 1).await.unwrap().is_allowed());
        }
        assert!(count_in_redis(&server, &store, &b, &limit) > 50);
        clock.advance(Duration::from_millis(150));
        until_counted(&server, &store, &b, &limit, 50).await;
        until_counted(&server, &store, &a, &limit, 50).await;
    });
}

/// A list with a lockout is never leased: a unit spent here could not see the block
/// another node's denial starts. Redis counts exactly what was spent, and once the block
/// runs, this node is denied too.
#[tokio::test]
async fn a_limit_with_a_lockout_is_never_leased() {
    let server = RedisServer::start();
    let clock = ManualClock::new(START);
    let limit = Limit::fixed_window(200, Duration::from_secs(60))
        .unwrap()
        .with_lockout(Duration::from_secs(60))
        .unwrap();
    let limits = std::slice::from_ref(&limit);
    let key = Key::new("global");
    let a = node(&server.url(), "locked", &clock, LeaseConfig::new()).await;
    for _ in 0..50 {
        assert!(a.check(&key, limits, 1).await.unwrap().is_allowed());
    }
    assert_eq!(count_in_redis(&server, &a, &key, &limit), 50);
    // Another node spends the rest and is denied once: the key is blocked.
    let b = node(&server.url(), "locked", &clock, LeaseConfig::new()).await;
    assert_eq!(hammer_until(&[b], limits, &key, 1, &[200], 1).await, [150]);
    let decision = a.check(&key, limits, 1).await.unwrap();
    assert!(!decision.is_allowed(), "{decision:?}");
    assert!(
        decision.retry_after() > Duration::from_secs(50),
        "{decision:?}"
    );
}

/// A reset drops this node's lease without giving it back: the next request goes to
/// Redis, and a release afterwards takes nothing from the state the reset left.
#[tokio::test]
async fn a_reset_drops_this_nodes_lease() {
    let server = RedisServer::start();
    let clock = ManualClock::new(START);
    let (a, limit, key) = leased(&server, &clock, LeaseConfig::new()).await;
    a.reset(&key, std::slice::from_ref(&limit)).await.unwrap();
    for _ in 0..3 {
        assert!(
            a.check(&key, std::slice::from_ref(&limit), 1)
                .await
                .unwrap()
                .is_allowed()
        );
    }
    let limit_key = a.redis_key(&key, &limit);
    assert_eq!(server.cli(&["EXISTS", &limit_key]).unwrap().trim(), "1");
    a.release_leases().await.unwrap();
    assert_eq!(count_in_redis(&server, &a, &key, &limit), 3);
}

/// A decision paid from a lease says when its units were counted (the grant), so a
/// refund after the response gives the unit back to that window in Redis.
#[tokio::test]
async fn a_decision_paid_from_a_lease_can_be_refunded() {
    let server = RedisServer::start();
    let clock = ManualClock::new(START);
    let (a, limit, key) = leased(&server, &clock, LeaseConfig::new()).await;
    let limits = std::slice::from_ref(&limit);
    // Requests until one is paid from the lease (Redis counts no more).
    let mut spent = 50;
    let local = loop {
        let before = count_in_redis(&server, &a, &key, &limit);
        let decision = a.check(&key, limits, 1).await.unwrap();
        assert!(decision.is_allowed());
        spent += 1;
        if count_in_redis(&server, &a, &key, &limit) == before {
            break decision;
        }
        assert!(spent < 100, "no request was paid from the lease");
    };
    let at = local.decided_at_ms().expect("a leased decision says when");
    let before = count_in_redis(&server, &a, &key, &limit);
    let refund = tollgate::Adjustment::Refund {
        units: 1,
        charged_at_ms: at,
    };
    assert!(a.adjust(&key, limits, refund).await.unwrap().is_allowed());
    assert_eq!(count_in_redis(&server, &a, &key, &limit), before - 1);
    a.release_leases().await.unwrap();
    assert_eq!(count_in_redis(&server, &a, &key, &limit), spent - 1);
}

/// A peek reads Redis: it neither spends this node's lease nor asks for one.
#[tokio::test]
async fn a_peek_neither_spends_nor_takes_a_lease() {
    let server = RedisServer::start();
    let clock = ManualClock::new(START);
    let (a, limit, key) = leased(&server, &clock, LeaseConfig::new()).await;
    let limits = std::slice::from_ref(&limit);
    let counted = count_in_redis(&server, &a, &key, &limit);
    for _ in 0..20 {
        let peek = a.peek(&key, limits, 1).await.unwrap();
        assert_eq!(peek.limits()[0].remaining, 1_000 - counted - 1);
    }
    assert_eq!(count_in_redis(&server, &a, &key, &limit), counted);
    a.release_leases().await.unwrap();
    assert_eq!(count_in_redis(&server, &a, &key, &limit), 50);
}

/// A node behind a layer, as a server runs it: `FailurePolicy::Deny`, the default circuit
/// breaker, one global key, a 10 s store timeout.
type Node = tower::util::BoxCloneSyncService<
    http::Request<()>,
    http::Response<tollgate::count_after::RateLimitBody<String>>,
    std::convert::Infallible,
>;

fn layered(store: RedisStore, limit: &Limit) -> Node {
    use tollgate::{FailurePolicy, RateLimitLayer, key::GlobalKey};
    use tower::Layer;
    let layer = RateLimitLayer::new(limit.clone())
        .with_store(store)
        .with_key(GlobalKey)
        .with_on_store_error(FailurePolicy::Deny)
        .with_timeout(Some(Duration::from_secs(10)));
    let inner = tower::service_fn(|_: http::Request<()>| async {
        Ok::<_, std::convert::Infallible>(http::Response::new(String::new()))
    });
    tower::util::BoxCloneSyncService::new(layer.layer(inner))
}

/// Answers one node's tasks got: 200, 429, 503.
#[derive(Debug, Default, Clone, Copy, PartialEq, Eq)]
struct Answers {
    ok: u64,
    limited: u64,
    unavailable: u64,
}

/// [`hammer_until`] through layers: `tasks` tasks per node send up to `each` requests,
/// each task stopping after `refusals` answers other than 200; the answers per node.
async fn hammer_layers(nodes: &[Node], tasks: usize, each: usize, refusals: usize) -> Vec<Answers> {
    use http::StatusCode;
    use tower::ServiceExt;
    let mut handles = Vec::new();
    for node in nodes {
        let mut per_node = Vec::new();
        for _ in 0..tasks {
            let node = node.clone();
            per_node.push(tokio::spawn(async move {
                let mut answers = Answers::default();
                for _ in 0..each {
                    let request = http::Request::get("/").body(()).unwrap();
                    let response = node.clone().oneshot(request).await.unwrap();
                    match response.status() {
                        StatusCode::OK => answers.ok += 1,
                        StatusCode::TOO_MANY_REQUESTS => {
                            assert!(
                                response.headers().contains_key("retry-after"),
                                "{response:?}"
                            );
                            answers.limited += 1;
                        }
                        StatusCode::SERVICE_UNAVAILABLE => answers.unavailable += 1,
                        other => panic!("unexpected {other}"),
                    }
                    if (answers.limited + answers.unavailable) as usize == refusals {
                        break;
                    }
                    tokio::task::yield_now().await;
                }
                answers
            }));
        }
        handles.push(per_node);
    }
    let mut out = Vec::new();
    for per_node in handles {
        let mut sum = Answers::default();
        for handle in per_node {
            let a = handle.await.unwrap();
            sum.ok += a.ok;
            sum.limited += a.limited;
            sum.unavailable += a.unavailable;
        }
        out.push(sum);
    }
    out
}

/// Bound with Redis killed mid-window, under `FailurePolicy::Deny`: `n` nodes x 32 tasks
/// behind layers, one global key, 1000 per 1 s window. Two windows as usual; in the
/// fourth, Redis is killed after 60% of the limit: the nodes spend what their leases
/// still hold (200), then answer 503, and the window stays within the limit. Redis
/// comes back (empty) before the fourth window: from then on limiting is back (429 with
/// `Retry-After`, nearly the whole limit and never more per window) and so are the
/// leases (few script calls per request).
async fn bound_with_redis_killed(n: usize, algorithm: Algorithm) {
    let mut server = RedisServer::start();
    let clock = ManualClock::new(START);
    let limit = Limit::new(algorithm, 1_000, Duration::from_secs(1)).unwrap();
    let mut nodes = Vec::new();
    for _ in 0..n {
        let store = node(&server.url(), "killed", &clock, LeaseConfig::new()).await;
        nodes.push(layered(store, &limit));
    }
    let first = (600usize).div_ceil(32 * n);
    let mut totals = Vec::new();
    let mut spent_while_down = 0;
    let (mut calls, mut requests) = (0, 0);
    // No traffic in window 2: the sliding-window counter's previous window weighs
    // nothing in window 3, so that 60% of the limit passes before Redis is killed.
    for window in [0, 1, 3, 4, 5, 6, 7u64] {
        let back = window >= 4;
        if window == 4 {
            server.restart();
        }
        clock.set(START + window * 1_000 + (window * 97) % 500);
        let calls_before = if back { script_calls(&server) } else { 0 };
        let mut allowed = 0;
        if window == 4 {
            // The circuit opened while Redis was down: it probes every 500 ms (real
            // time). Until it closes, requests are answered 503.
            let deadline = Instant::now() + Duration::from_secs(10);
            for node in &nodes {
                loop {
                    let got = hammer_layers(std::slice::from_ref(node), 1, 1, 1).await[0];
                    allowed += got.ok;
                    if got.ok == 1 {
                        break;
                    }
                    assert_eq!(got.unavailable, 1, "{got:?}");
                    assert!(Instant::now() < deadline, "Redis never decided again");
                    tokio::time::sleep(Duration::from_millis(50)).await;
                }
            }
        }
        let got = hammer_layers(&nodes, 32, first, usize::MAX).await;
        allowed += got.iter().map(|a| a.ok).sum::<u64>();
        assert!(got.iter().all(|a| a.unavailable == 0), "{got:?}");
        if window == 5 && algorithm == Algorithm::FixedWindow {
            // Leases are taken again: Redis counts more than has passed.
            let keys = server.cli(&["--scan", "--pattern", "killed:*"]).unwrap();
            let redis_key = keys.lines().next().unwrap().trim().to_owned();
            let value = server.cli(&["GET", &redis_key]).unwrap();
            let counted: u64 = u64::from(support::fixed_window_count(&value));
            assert!(
                counted > allowed,
                "no lease after Redis came back: {counted} counted, {allowed} passed"
            );
        }
        if window == 3 {
            server.kill();
        }
        clock.set(START + window * 1_000 + 500 + (window * 31) % 500);
        let got = hammer_layers(&nodes, 32, 1_000, 3).await;
        let sent: u64 = got.iter().map(|a| a.ok + a.limited + a.unavailable).sum();
        allowed += got.iter().map(|a| a.ok).sum::<u64>();
        if window == 3 {
            // Redis is gone: what passed came from the leases, the rest is 503.
            spent_while_down = got.iter().map(|a| a.ok).sum::<u64>();
            assert!(got.iter().all(|a| a.limited == 0), "{got:?}");
        } else {
            // Redis decides: every task ends on 429s, never on a failure.
            assert!(
                got.iter()
                    .all(|a| a.unavailable == 0 && a.limited == 32 * 3),
                "window {window}: {got:?}"
            );
        }
        if back {
            calls += script_calls(&server) - calls_before;
            requests += sent + (first * 32 * n) as u64;
        }
        totals.push(allowed);
    }
    println!(
        "{n} nodes, {algorithm:?}, Redis killed in window 3 and back in 4: allowed per \
         window {totals:?}, {spent_while_down} from leases while Redis was down; after: \
         {calls} script calls for {requests} requests"
    );
    for (i, &total) in totals.iter().enumerate() {
        assert!(total <= 1_000, "window {i}: {totals:?}");
    }
    assert!(
        spent_while_down > 0,
        "no leased unit was spent while Redis was down"
    );
    if algorithm == Algorithm::FixedWindow {
        // Little stranded, also after Redis came back (totals[2] is window 3).
        for (i, &total) in totals.iter().enumerate().filter(|&(i, _)| i != 2) {
            assert!(total >= 970, "window {i}: {totals:?}");
        }
    }
    // Leases are taken again: far fewer script calls than requests.
    assert!(
        calls * 5 < requests,
        "{calls} script calls for {requests} requests after Redis came back"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn two_nodes_keep_the_bound_when_redis_is_killed_mid_window() {
    bound_with_redis_killed(2, Algorithm::FixedWindow).await;
    bound_with_redis_killed(2, Algorithm::SlidingWindowCounter).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn four_nodes_keep_the_bound_when_redis_is_killed_mid_window() {
    bound_with_redis_killed(4, Algorithm::FixedWindow).await;
    bound_with_redis_killed(4, Algorithm::SlidingWindowCounter).await;
}

/// [`hammer_until`], keeping the last denial each node answered.
async fn last_denials(
    nodes: &[RedisStore],
    limits: &[Limit],
    key: &Key,
    tasks: usize,
    denials: usize,
) -> Vec<Decision> {
    let limits: Arc<[Limit]> = limits.into();
    let sequence = Arc::new(AtomicU64::new(0));
    let mut handles = Vec::new();
    for store in nodes {
        let mut per_node = Vec::new();
        for _ in 0..tasks {
            let (store, limits, key, sequence) =
                (store.clone(), limits.clone(), key.clone(), sequence.clone());
            per_node.push(tokio::spawn(async move {
                let mut last = None;
                let mut denied = 0;
                while denied < denials {
                    let decision = store.check(&key, &limits, 1).await.unwrap();
                    if !decision.is_allowed() {
                        last = Some((sequence.fetch_add(1, Ordering::Relaxed), decision));
                        denied += 1;
                    }
                    tokio::task::yield_now().await;
                }
                last
            }));
        }
        handles.push(per_node);
    }
    let mut out = Vec::new();
    for per_node in handles {
        let mut last: Option<(u64, Decision)> = None;
        for handle in per_node {
            let got = handle.await.unwrap();
            if got.as_ref().map(|g| g.0) > last.as_ref().map(|l| l.0) {
                last = got;
            }
        }
        out.push(last.unwrap().1);
    }
    out
}

/// The `retry_after` contract on every node, with leases on: the nodes (8 tasks each)
/// saturate the key together until every task was denied 3 times, leases taken and
/// spent on the way. Every node's last denial is Redis's (the same `retry_after` as a
/// peek at Redis). Then, one node per round in turn, with the last denial that node
/// answered: one millisecond before its `retry_after` the same request is still denied,
/// and at exactly `retry_after` it passes. (One node per round: a unit freed at
/// `retry_after` is there for one request, whichever node sends it.) The windows are
/// 10 s, so that a lease's end (a thousandth of the time left before the window's) is
/// not the window's.
async fn retry_after_holds_on_every_node(n: usize, algorithm: Algorithm) {
    let server = RedisServer::start();
    let clock = ManualClock::new(START + 123);
    let limit = Limit::new(algorithm, 200, Duration::from_secs(10)).unwrap();
    let limits = std::slice::from_ref(&limit);
    let key = Key::new("global");
    let mut nodes = Vec::new();
    for _ in 0..n {
        nodes.push(node(&server.url(), "retry", &clock, LeaseConfig::new()).await);
    }
    for round in 0..2 * n {
        let denials = last_denials(&nodes, limits, &key, 8, 3).await;
        let i = round % n;
        let denied = &denials[i];
        let wait = denied.retry_after();
        assert!(wait >= Duration::from_millis(1), "{denied:?}");
        // The denial is Redis's: Redis (read without spending) has no room either, and
        // says the same `retry_after`.
        for (j, node) in nodes.iter().enumerate() {
            let redis = node.peek(&key, limits, 1).await.unwrap();
            assert!(
                !redis.is_allowed() && redis.retry_after() == denials[j].retry_after(),
                "{algorithm:?}, {n} nodes, round {round}, node {j} denied with {:?}, \
                 Redis says {redis:?}",
                denials[j]
            );
        }
        clock.advance(wait - Duration::from_millis(1));
        let early = nodes[i].check(&key, limits, 1).await.unwrap();
        assert!(
            !early.is_allowed(),
            "{algorithm:?}, {n} nodes, round {round}, node {i}: allowed 1 ms before \
             retry_after ({denied:?}, then {early:?})"
        );
        clock.advance(Duration::from_millis(1));
        let then = nodes[i].check(&key, limits, 1).await.unwrap();
        assert!(
            then.is_allowed(),
            "{algorithm:?}, {n} nodes, round {round}, node {i}: denied after waiting \
             retry_after ({denied:?}, then {then:?})"
        );
        // Into the next window (or a refilled bucket) at an uneven moment.
        clock.advance(Duration::from_millis(10_000 + 37 * round as u64));
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn retry_after_holds_on_every_node_of_two_and_four() {
    for algorithm in [
        Algorithm::FixedWindow,
        Algorithm::SlidingWindowCounter,
        Algorithm::TokenBucket,
        Algorithm::Gcra,
    ] {
        retry_after_holds_on_every_node(2, algorithm).await;
        retry_after_holds_on_every_node(4, algorithm).await;
    }
}

/// Cold keys are untouched: a key requested once per period never asks for a lease (each
/// request goes to Redis, which counts exactly what passed), and it asks at its second
/// request within one period. Many other cold keys in between change neither.
#[tokio::test]
async fn a_key_asks_for_a_lease_only_once_it_is_hot() {
    let server = RedisServer::start();
    let clock = ManualClock::new(START);
    let limit = Limit::fixed_window(1_000, Duration::from_secs(3600)).unwrap();
    let limits = std::slice::from_ref(&limit);
    let store = node(&server.url(), "cold", &clock, LeaseConfig::new()).await;
    let key = Key::new("k");
    let calls = script_calls(&server);
    for i in 1..=20u64 {
        assert!(store.check(&key, limits, 1).await.unwrap().is_allowed());
        // Other keys, each seen once.
        for j in 0..50 {
            let other = Key::new(format!("other{i}-{j}"));
            assert!(store.check(&other, limits, 1).await.unwrap().is_allowed());
        }
        assert_eq!(count_in_redis(&server, &store, &key, &limit), i);
        clock.advance(Duration::from_millis(100));
    }
    assert_eq!(script_calls(&server) - calls, 20 * 51);
    // Twice within a period: the second request asks, and Redis counts its lease.
    assert!(store.check(&key, limits, 1).await.unwrap().is_allowed());
    clock.advance(Duration::from_millis(99));
    assert!(store.check(&key, limits, 1).await.unwrap().is_allowed());
    assert!(count_in_redis(&server, &store, &key, &limit) > 22);
    store.release_leases().await.unwrap();
    assert_eq!(count_in_redis(&server, &store, &key, &limit), 22);
}

/// The exact sliding-window log is never leased, alone or in a list of limits: every
/// request goes to Redis, which counts exactly what passed.
#[tokio::test]
async fn the_sliding_window_log_is_never_leased() {
    let server = RedisServer::start();
    let clock = ManualClock::new(START);
    let log = Limit::sliding_window(1_000, Duration::from_secs(60)).unwrap();
    let window = Limit::fixed_window(1_000, Duration::from_secs(60)).unwrap();
    let store = node(&server.url(), "log", &clock, LeaseConfig::new()).await;
    let key = Key::new("global");
    let calls = script_calls(&server);
    for limits in [vec![log.clone()], vec![window.clone(), log]] {
        for _ in 0..50 {
            assert!(store.check(&key, &limits, 1).await.unwrap().is_allowed());
        }
    }
    assert_eq!(script_calls(&server) - calls, 100);
    assert_eq!(count_in_redis(&server, &store, &key, &window), 50);
}

/// `remaining` never rises between store contacts: two nodes sending one request at a
/// time in turn, each taking leases, within one fixed window; each node's `remaining`
/// only falls (the other node's leases count as spent), exactly the limit passes, and
/// both end at 0.
#[tokio::test]
async fn remaining_never_rises_on_either_node() {
    let server = RedisServer::start();
    let clock = ManualClock::new(START);
    let limit = Limit::fixed_window(1_000, Duration::from_secs(60)).unwrap();
    let limits = std::slice::from_ref(&limit);
    let a = node(&server.url(), "remaining", &clock, LeaseConfig::new()).await;
    let b = node(&server.url(), "remaining", &clock, LeaseConfig::new()).await;
    let key = Key::new("global");
    let mut last = [u64::MAX; 2];
    let mut allowed = 0;
    for i in 0..1_200 {
        let node = if i % 3 == 0 { &b } else { &a };
        let decision = node.check(&key, limits, 1).await.unwrap();
        let remaining = decision.limits()[0].remaining;
        let n = usize::from(i % 3 == 0);
        assert!(
            remaining <= last[n],
            "request {i}, node {n}: remaining rose from {} to {remaining}",
            last[n]
        );
        last[n] = remaining;
        allowed += u64::from(decision.is_allowed());
    }
    assert_eq!(allowed, 1_000);
    assert_eq!(last, [0, 0]);
}

/// The count of a fixed-window `limit` for `key` in Redis (0 when there is none), through
/// a connection of the test's own: cheap enough to read after every request.
async fn counted(
    conn: &mut redis::aio::MultiplexedConnection,
    store: &RedisStore,
    key: &Key,
    limit: &Limit,
) -> u64 {
    let value: Option<String> = redis::cmd("GET")
        .arg(store.redis_key(key, limit))
        .query_async(conn)
        .await
        .unwrap();
    value.map_or(0, |v| u64::from(support::fixed_window_count(&v)))
}

/// [`counted`] in the fixed window that starts at `start` (0 while Redis holds another).
async fn counted_since(
    conn: &mut redis::aio::MultiplexedConnection,
    store: &RedisStore,
    key: &Key,
    limit: &Limit,
    start: u64,
) -> u64 {
    let value: Option<String> = redis::cmd("GET")
        .arg(store.redis_key(key, limit))
        .query_async(conn)
        .await
        .unwrap();
    let Some(value) = value else { return 0 };
    let window_ms = u64::try_from(limit.window().as_millis()).unwrap();
    if support::fixed_window_tag(&value) == support::fixed_window_tag_of(start, window_ms) {
        u64::from(support::fixed_window_count(&value))
    } else {
        0
    }
}

/// One request of cost 1 for `key` on `store`, one at a time: whether it passed, what
/// Redis counted before it, the units it leased (what Redis counted for it beyond its
/// own unit), and whether a lease paid it. The window must outlast the test, so that no lease ends or goes back on
/// its way: then a request spent from a lease counts nothing, one that Redis denies
/// nothing, one that Redis allows 1 and its grant.
async fn lease_of(
    conn: &mut redis::aio::MultiplexedConnection,
    store: &RedisStore,
    key: &Key,
    limit: &Limit,
) -> (bool, u64, u64, bool) {
    let before = counted(conn, store, key, limit).await;
    let decision = store
        .check(key, std::slice::from_ref(limit), 1)
        .await
        .unwrap();
    let after = counted(conn, store, key, limit).await;
    let more = after
        .checked_sub(before)
        .unwrap_or_else(|| panic!("Redis counted {before}, then {after}"));
    if !decision.is_allowed() {
        assert_eq!(more, 0, "a denied request was counted: {decision:?}");
    }
    let from_lease = decision.is_allowed() && more == 0;
    (
        decision.is_allowed(),
        before,
        more.saturating_sub(1),
        from_lease,
    )
}

async fn connection(server: &RedisServer) -> redis::aio::MultiplexedConnection {
    support::test_connection(&server.url()).await
}

/// A lease holds about one period of this node's traffic of the key: three nodes on one
/// key, a budget too large to bound a lease, 20 periods of 100 ms on the clock. A node
/// sending one request every 150 ms never leases; one sending 4 per period leases a few
/// units at a time; one sending 100 per period leases batches of about 100, once its
/// smoothed rate has caught up (the first periods count from nothing).
#[tokio::test]
async fn lease_size_follows_each_nodes_rate_of_a_key() {
    let server = RedisServer::start();
    let clock = ManualClock::new(START);
    let mut conn = connection(&server).await;
    // A tenth of it is 10 000 units: max_fraction bounds no lease here.
    let limit = Limit::fixed_window(100_000, Duration::from_secs(3600)).unwrap();
    let key = Key::new("global");
    let cold = node(&server.url(), "size", &clock, LeaseConfig::new()).await;
    let slow = node(&server.url(), "size", &clock, LeaseConfig::new()).await;
    let fast = node(&server.url(), "size", &clock, LeaseConfig::new()).await;
    let (mut slow_grants, mut fast_grants) = (Vec::new(), Vec::new());
    for ms in 0..2_000u64 {
        clock.set(START + ms);
        if ms % 150 == 0 {
            let (allowed, _, grant, _) = lease_of(&mut conn, &cold, &key, &limit).await;
            assert!(allowed);
            assert_eq!(grant, 0, "the cold node leased at {ms} ms");
        }
        if ms % 25 == 0 {
            let (allowed, _, grant, _) = lease_of(&mut conn, &slow, &key, &limit).await;
            assert!(allowed);
            if grant > 0 {
                slow_grants.push(grant);
            }
        }
        let (allowed, _, grant, _) = lease_of(&mut conn, &fast, &key, &limit).await;
        assert!(allowed);
        if grant > 0 {
            fast_grants.push((ms, grant));
        }
    }
    println!("slow node's leases: {slow_grants:?}");
    println!("fast node's leases: {fast_grants:?}");
    assert!(!slow_grants.is_empty(), "the slow node never leased");
    let slow_max = *slow_grants.iter().max().unwrap();
    assert!(slow_max <= 8, "the slow node leased {slow_grants:?}");
    let late: Vec<u64> = fast_grants
        .iter()
        .filter(|&&(ms, _)| ms >= 500)
        .map(|&(_, grant)| grant)
        .collect();
    assert!(late.len() >= 5, "the fast node leased {fast_grants:?}");
    for &grant in &late {
        assert!(
            (50..=120).contains(&grant),
            "the fast node leased {grant} at 100 per period: {fast_grants:?}"
        );
        assert!(grant >= 6 * slow_max, "{grant} against {slow_max}");
    }
    // Nothing else was counted: every unit leased and not spent goes back.
    for store in [&cold, &slow, &fast] {
        store.release_leases().await.unwrap();
    }
    let sent = 2_000 + 2_000 / 25 + 2_000u64.div_ceil(150);
    assert_eq!(counted(&mut conn, &fast, &key, &limit).await, sent);
}

/// A lease is bounded by `max_fraction` of the limit, and shrinks as the shared budget
/// runs low: two nodes, each at 500 requests per period on one key (far more than the
/// bound), take turns until each was denied 3 times. What a node holds is at most 5% of
/// the limit (reached), every grant at most half of what the limit had left after its request
/// (both nodes' leases counted as spent), so the last grants are of a unit or two; the
/// limit is spent exactly, and at exhaustion no unit is stranded in a lease.
#[tokio::test]
async fn a_lease_is_bounded_and_shrinks_as_the_budget_runs_low() {
    let server = RedisServer::start();
    let clock = ManualClock::new(START);
    let mut conn = connection(&server).await;
    let limit = Limit::fixed_window(4_000, Duration::from_secs(3600)).unwrap();
    let config = LeaseConfig::new().with_max_fraction(0.05).unwrap();
    let key = Key::new("global");
    let nodes = [
        node(&server.url(), "shrink", &clock, config).await,
        node(&server.url(), "shrink", &clock, config).await,
    ];
    let (mut grants, mut allowed, mut denied) = (Vec::new(), 0u64, [0; 2]);
    // What each node holds (its grants less what it spent from them), and the most.
    let (mut held, mut most) = ([0u64; 2], 0);
    let mut ms = 0;
    while denied.iter().any(|&d| d < 3) {
        clock.set(START + ms);
        for _ in 0..5 {
            for (n, store) in nodes.iter().enumerate() {
                if denied[n] == 3 {
                    continue;
                }
                let (ok, before, grant, from_lease) =
                    lease_of(&mut conn, store, &key, &limit).await;
                held[n] = held[n] + grant - u64::from(from_lease);
                most = most.max(held[n]);
                if ok {
                    allowed += 1;
                } else {
                    denied[n] += 1;
                }
                if grant > 0 {
                    grants.push((before, grant));
                }
            }
        }
        ms += 1;
        assert!(ms < 10_000, "still not exhausted after {ms} ms");
    }
    println!("leases (counted before, leased): {grants:?}");
    // A refill tops a lease up: what a node holds, grant and rest together, reaches the
    // bound and never passes it.
    assert!(grants.iter().all(|&(_, grant)| grant <= 200), "{grants:?}");
    assert_eq!(most, 200, "{grants:?}");
    for &(before, grant) in &grants {
        let left = 4_000 - before - 1;
        assert!(
            grant <= left / 2,
            "{grant} leased with {left} left: {grants:?}"
        );
    }
    let last = grants.last().unwrap();
    assert!(last.1 <= 2, "the last lease took {}: {grants:?}", last.1);
    assert!(
        grants.iter().filter(|&&(_, grant)| grant < 200).count() >= 5,
        "no shrinking: {grants:?}"
    );
    // The whole budget was spent, and none of it is left in a lease.
    assert_eq!(allowed, 4_000);
    assert_eq!(counted(&mut conn, &nodes[0], &key, &limit).await, 4_000);
    for store in &nodes {
        store.release_leases().await.unwrap();
    }
    assert_eq!(counted(&mut conn, &nodes[0], &key, &limit).await, 4_000);
}

/// Redis never counts more than a limit, leased units included (they are pre-paid
/// within it): the per-second limit in the second that starts at `start`, and the
/// per-minute one.
async fn within(
    conn: &mut redis::aio::MultiplexedConnection,
    store: &RedisStore,
    key: &Key,
    limits: &[Limit; 2],
    start: u64,
) {
    let second = counted_since(conn, store, key, &limits[0], start).await;
    let minute = counted(conn, store, key, &limits[1]).await;
    assert!(
        second <= u64::from(limits[0].limit()) && minute <= u64::from(limits[1].limit()),
        "at {start}: Redis counts {second} in the second, {minute} in the minute"
    );
}

/// Multi-limit requests stay all-or-nothing across nodes: 2 nodes x 32 tasks, each
/// request under two limits of one key, 500 per second and 2 670 per minute, 10 seconds
/// of one minute on the clock. Each second is hit first with 64% of the second's limit
/// (the nodes keep leases); in seconds 1 and 3 that is all, and the nodes end the second
/// holding leases, which die with it (the shorter window); the other seconds are then hit
/// until every task was denied 3 times. Seconds 0, 2, 4 and 5 end on the per-second limit
/// (500 each, with 320 in seconds 1 and 3: 2 640), second 6 on the per-minute one (30
/// left: a lease ignoring a limit's room would overshoot it), the rest are denied by it.
/// - Redis never counts more than a limit, leased units included;
/// - a light second counted what it allowed plus the units the nodes held when it ended,
///   alike in both limits, and none of them is spent in the next second;
/// - at the end of the other seconds, and in the middle of the even ones (while the nodes
///   hold leases), both nodes give their leases back: then each limit counted exactly the
///   requests allowed (per second, and in all for the minute), so no limit counted a
///   request another refused, nor a leased unit the other did not;
/// - every aligned window of either limit admitted at most its limit.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn two_nodes_keep_two_limits_all_or_nothing() {
    let server = RedisServer::start();
    let minute = START.next_multiple_of(60_000);
    let clock = ManualClock::new(minute);
    let mut conn = connection(&server).await;
    let second = Limit::fixed_window(500, Duration::from_secs(1)).unwrap();
    let per_minute = Limit::fixed_window(2_670, Duration::from_secs(60)).unwrap();
    let limits = [second.clone(), per_minute.clone()];
    let key = Key::new("global");
    let nodes = [
        node(&server.url(), "two", &clock, LeaseConfig::new()).await,
        node(&server.url(), "two", &clock, LeaseConfig::new()).await,
    ];
    let release = || async {
        for store in &nodes {
            store.release_leases().await.unwrap();
        }
    };
    let calls = script_calls(&server);
    let (mut total, mut requests, mut per_second) = (0, 0, Vec::new());
    for s in 0..10u64 {
        let start = minute + s * 1_000;
        clock.set(start + (s * 97) % 500);
        let mut allowed: u64 = hammer(&nodes, &limits, &key, 32, &[5, 5])
            .await
            .iter()
            .sum();
        within(&mut conn, &nodes[0], &key, &limits, start).await;
        requests += 5 * 64;
        if s == 1 || s == 3 {
            // The leases still held die with the second: counted in it by both limits
            // (the leases of the seconds before went back), never spent in the next.
            total += allowed;
            let counted_second = counted_since(&mut conn, &nodes[0], &key, &second, start).await;
            let counted_minute = counted(&mut conn, &nodes[0], &key, &per_minute).await;
            assert!(
                counted_second >= allowed,
                "second {s}: {allowed} allowed, {counted_second} counted"
            );
            assert_eq!(
                counted_minute - total,
                counted_second - allowed,
                "second {s}: units held counted by one limit only"
            );
            per_second.push(allowed);
            continue;
        }
        if s % 2 == 0 {
            release().await;
            let counted_second = counted_since(&mut conn, &nodes[0], &key, &second, start).await;
            assert_eq!(counted_second, allowed, "second {s}, mid-second");
            let counted_minute = counted(&mut conn, &nodes[0], &key, &per_minute).await;
            assert_eq!(counted_minute, total + allowed, "second {s}, mid-second");
        }
        clock.set(start + 500 + (s * 31) % 500);
        let then = hammer_until(&nodes, &limits, &key, 32, &[500, 500], 3).await;
        within(&mut conn, &nodes[0], &key, &limits, start).await;
        allowed += then.iter().sum::<u64>();
        requests += then.iter().sum::<u64>() + 3 * 64;
        total += allowed;
        release().await;
        let counted_second = counted_since(&mut conn, &nodes[0], &key, &second, start).await;
        assert_eq!(
            counted_second, allowed,
            "second {s}: {allowed} allowed, {counted_second} counted"
        );
        let counted_minute = counted(&mut conn, &nodes[0], &key, &per_minute).await;
        assert_eq!(counted_minute, total, "second {s}: {total} allowed so far");
        assert!(allowed <= 500, "second {s}: {allowed} allowed");
        per_second.push(allowed);
    }
    let calls = script_calls(&server) - calls;
    println!(
        "allowed per second {per_second:?}, {total} in the minute; {calls} script calls for \
         {requests} requests"
    );
    assert!(total <= 2_670, "{total} allowed in the minute");
    // Both limits bound on the way: nearly every full second's limit while the minute had
    // room, then nearly the minute's; and leases carried most of the requests.
    for s in [0, 2, 4, 5] {
        assert!(per_second[s] >= 485, "second {s}: {per_second:?}");
    }
    assert_eq!((per_second[1], per_second[3]), (320, 320), "{per_second:?}");
    assert!(total >= 2_640, "{per_second:?}");
    assert!(
        calls * 3 < requests,
        "{calls} script calls for {requests} requests"
    );
}
