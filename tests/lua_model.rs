//! Property tests: the Lua script decides exactly like the Rust reference model, and the
//! model never allows more than each algorithm guarantees.

#![cfg(feature = "redis")]

mod support;

use std::time::Duration;

use proptest::prelude::*;
use tollgate::{
    Algorithm, Decision, Limit, OnChange, Store,
    algorithm::{self, State},
    clock::{Clock, ManualClock},
    key::Key,
    store::RedisStore,
};

const START: u64 = 1_700_000_000_000;

const ALGORITHMS: [Algorithm; 5] = [
    Algorithm::FixedWindow,
    Algorithm::SlidingWindow,
    Algorithm::SlidingWindowCounter,
    Algorithm::TokenBucket,
    Algorithm::Gcra,
];

fn algorithm_strategy() -> impl Strategy<Value = Algorithm> {
    prop::sample::select(&ALGORITHMS[..])
}

fn limit_strategy() -> impl Strategy<Value = Limit> {
    let window = prop_oneof![1u64..20, 1u64..3_000];
    (algorithm_strategy(), 1u32..20, window, 1u32..30).prop_map(
        |(algorithm, limit, window_ms, burst)| {
            let l = Limit::new(algorithm, limit, Duration::from_millis(window_ms)).unwrap();
            match algorithm {
                Algorithm::TokenBucket | Algorithm::Gcra => l.with_burst(burst).unwrap(),
                _ => l,
            }
        },
    )
}

/// Up to three limits with distinct ids.
fn limits_strategy() -> impl Strategy<Value = Vec<Limit>> {
    prop::collection::vec(limit_strategy(), 1..=3).prop_map(|mut limits| {
        let mut seen = std::collections::HashSet::new();
        limits.retain(|l| seen.insert(format!("{l:?}")));
        limits
    })
}

/// How long to wait before a request.
#[derive(Debug, Clone, Copy)]
enum Wait {
    Ms(u64),
    /// The previous decision's `retry_after` (or `reset_after` of its first limit), plus
    /// -1, 0 or +1 ms: the boundaries where off-by-one mistakes live.
    RetryAfter(i64),
    ResetAfter(i64),
}

/// (wait, cost, which of two keys).
fn steps_strategy() -> impl Strategy<Value = Vec<(Wait, u32, usize)>> {
    let wait = prop_oneof![
        Just(Wait::Ms(0)),
        (0u64..50).prop_map(Wait::Ms),
        (0u64..4_000).prop_map(Wait::Ms),
        (-1i64..=1).prop_map(Wait::RetryAfter),
        (-1i64..=1).prop_map(Wait::ResetAfter),
    ];
    prop::collection::vec((wait, 0u32..8, 0usize..2), 1..60)
}

/// The model's decisions, with the time of each request.
fn model_run(limits: &[Limit], steps: &[(Wait, u32, usize)]) -> Vec<(u64, u32, Decision)> {
    let mut states: [Vec<State>; 2] =
        std::array::from_fn(|_| limits.iter().map(|l| State::new(l.algorithm())).collect());
    let mut now = START;
    let mut previous: Option<Decision> = None;
    steps
        .iter()
        .map(|&(wait, cost, key)| {
            let dt = match (wait, &previous) {
                (Wait::Ms(ms), _) => ms as i64,
                (Wait::RetryAfter(delta), Some(d)) => d.retry_after().as_millis() as i64 + delta,
                (Wait::ResetAfter(delta), Some(d)) => {
                    d.limits()[0].reset_after().as_millis() as i64 + delta
                }
                (_, None) => 0,
            };
            now += dt.max(0) as u64;
            let decision = algorithm::check(&mut states[key], limits, now, cost);
            previous = Some(decision.clone());
            (now, cost, decision)
        })
        .collect()
}

/// Up to three versions of one named, carried-over limit: one algorithm and window, other
/// `limit`s and `burst`s. The token bucket is left out: its key's TTL is the time to refill
/// under the parameters of its last write, so after a lower rate or a larger burst Redis
/// may forget (refill) a bucket that the model still refills (README, "Changing rules").
fn versions_strategy() -> impl Strategy<Value = Vec<Limit>> {
    let algorithm = prop::sample::select(vec![
        Algorithm::FixedWindow,
        Algorithm::SlidingWindow,
        Algorithm::SlidingWindowCounter,
        Algorithm::Gcra,
    ]);
    let window = prop_oneof![1u64..20, 1u64..3_000];
    let versions = prop::collection::vec((1u32..20, 1u32..30), 1..=3);
    (algorithm, window, versions).prop_map(|(algorithm, window_ms, versions)| {
        versions
            .into_iter()
            .map(|(limit, burst)| {
                let l = Limit::new(algorithm, limit, Duration::from_millis(window_ms)).unwrap();
                let l = match algorithm {
                    Algorithm::Gcra => l.with_burst(burst).unwrap(),
                    _ => l,
                };
                l.named("api")
                    .unwrap()
                    .on_change(OnChange::CarryOver)
                    .unwrap()
            })
            .collect()
    })
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 200, ..ProptestConfig::default() })]

    /// Carried over, a limit whose parameters change between requests decides alike in
    /// the model (one state per key, whatever the version) and in Lua (one Redis key).
    #[test]
    fn lua_decides_like_the_model_across_changes(
        versions in versions_strategy(),
        steps in steps_strategy(),
        picks in prop::collection::vec(0usize..3, 60),
    ) {
        let runtime = tokio::runtime::Builder::new_current_thread().enable_all().build().unwrap();
        let mut states: [Vec<State>; 2] =
            std::array::from_fn(|_| vec![State::new(versions[0].algorithm())]);
        let mut now = START;
        let mut expected = Vec::new();
        for (i, &(wait, cost, key)) in steps.iter().enumerate() {
            // Plain waits only: `retry_after` belongs to the version that answered.
            if let Wait::Ms(ms) = wait {
                now += ms;
            }
            let limit = &versions[picks[i] % versions.len()];
            let decision = algorithm::check(&mut states[key], std::slice::from_ref(limit), now, cost);
            expected.push((now, limit.clone(), decision));
        }
        runtime.block_on(async {
            let clock = ManualClock::new(START);
            let store = case_store(&clock, false).await;
            let keys = [Key::new("a"), Key::new("b")];
            for (i, (&(_, cost, key), (now, limit, want))) in steps.iter().zip(&expected).enumerate() {
                clock.set(*now);
                let got = store.check(&keys[key], std::slice::from_ref(limit), cost).await.unwrap();
                prop_assert_eq!(&got, want, "step {} of {:?} with {:?}", i, steps, versions);
            }
            Ok(())
        })?;
    }

    #[test]
    fn lua_decides_like_the_model(limits in limits_strategy(), steps in steps_strategy()) {
        let runtime = tokio::runtime::Builder::new_current_thread().enable_all().build().unwrap();
        let expected = model_run(&limits, &steps);
        runtime.block_on(async {
            let clock = ManualClock::new(START);
            let store = case_store(&clock, false).await;
            let keys = [Key::new("a"), Key::new("b")];
            for (i, (&(_, cost, key), (now, _, want))) in steps.iter().zip(&expected).enumerate() {
                clock.set(*now);
                let got = store.check(&keys[key], &limits, cost).await.unwrap();
                prop_assert_eq!(&got, want, "step {} of {:?} with {:?}", i, steps, limits);
            }
            Ok(())
        })?;
    }

    /// The block cache answers repeated denials locally: the same decisions and the same
    /// `retry_after` as Redis without it; `remaining` may lag behind, never ahead.
    #[test]
    fn the_block_cache_changes_no_decision(limits in limits_strategy(), steps in steps_strategy()) {
        let runtime = tokio::runtime::Builder::new_current_thread().enable_all().build().unwrap();
        let expected = model_run(&limits, &steps);
        runtime.block_on(async {
            let clock = ManualClock::new(START);
            let store = case_store(&clock, true).await;
            let keys = [Key::new("a"), Key::new("b")];
            for (&(_, cost, key), (now, _, want)) in steps.iter().zip(&expected) {
                clock.set(*now);
                let got = store.check(&keys[key], &limits, cost).await.unwrap();
                prop_assert_eq!(got.is_allowed(), want.is_allowed());
                prop_assert_eq!(got.retry_after(), want.retry_after());
                for (g, w) in got.limits().iter().zip(want.limits()) {
                    prop_assert!(g.remaining <= w.remaining);
                }
            }
            Ok(())
        })?;
    }

    /// Requests that wait at the same moment share one script call (coalescing), which
    /// reads each key once and writes it once: their decisions are exactly the model's for
    /// the same requests one after another, also when they mix two lists of limits that
    /// share a limit, and several keys.
    #[test]
    fn a_coalesced_batch_decides_like_one_request_after_another(
        a in limits_strategy(),
        b in limits_strategy(),
        batches in prop::collection::vec(
            (0u64..3_000, prop::collection::vec((0u32..6, 0usize..3, any::<bool>()), 1..40)),
            1..6,
        ),
    ) {
        // The second list shares the first's first limit.
        let mut b = b;
        if !b.contains(&a[0]) {
            b[0] = a[0].clone();
        }
        let lists = [a, b];
        let runtime = tokio::runtime::Builder::new_current_thread().enable_all().build().unwrap();
        runtime.block_on(async {
            let clock = ManualClock::new(START);
            let store = case_store(&clock, false).await;
            let keys = [Key::new("a"), Key::new("b"), Key::new("c")];
            // The model's state of each (key, limit).
            let mut model: std::collections::HashMap<(usize, String), State> = Default::default();
            for (wait, requests) in &batches {
                clock.advance(Duration::from_millis(*wait));
                let now = clock.now_ms();
                // Submitted before any is awaited: the batching task takes them all at once.
                let checks: Vec<_> = requests
                    .iter()
                    .map(|&(cost, key, second)| store.check(&keys[key], &lists[usize::from(second)], cost))
                    .collect();
                let got = futures_util::future::join_all(checks).await;
                for (&(cost, key, second), got) in requests.iter().zip(got) {
                    let limits = &lists[usize::from(second)];
                    let ids: Vec<(usize, String)> = limits.iter().map(|l| (key, format!("{l:?}"))).collect();
                    let mut states: Vec<State> = ids
                        .iter()
                        .zip(limits)
                        .map(|(id, l)| model.remove(id).unwrap_or_else(|| State::new(l.algorithm())))
                        .collect();
                    let want = algorithm::check(&mut states, limits, now, cost);
                    model.extend(ids.into_iter().zip(states));
                    prop_assert_eq!(got.unwrap(), want, "{:?} at {}", (cost, key, second), now);
                }
            }
            Ok(())
        })?;
    }

    #[test]
    fn the_model_keeps_each_guarantee(limit in limit_strategy(), steps in steps_strategy()) {
        let limits = [limit.clone()];
        let run: Vec<(u64, u64)> = model_run(&limits, &steps)
            .into_iter()
            .zip(&steps)
            .filter(|((_, _, d), (_, _, key))| *key == 0 && d.is_allowed())
            .map(|((now, cost, _), _)| (now, u64::from(cost)))
            .collect();
        let w = limit.window().as_millis() as u64;
        let l = u64::from(limit.limit());
        let b = u64::from(limit.burst());
        for (i, &(t0, _)) in run.iter().enumerate() {
            let mut used = 0;
            for &(t1, cost) in &run[i..] {
                used += cost;
                let bound = match limit.algorithm() {
                    // Same aligned window.
                    Algorithm::FixedWindow | Algorithm::SlidingWindowCounter => {
                        if t1 / w != t0 / w { break; }
                        l
                    }
                    // Any interval shorter than the window.
                    Algorithm::SlidingWindow => {
                        if t1 - t0 >= w { break; }
                        l
                    }
                    _ => b + (t1 - t0) * l / w,
                };
                prop_assert!(used <= bound, "{} used in [{}, {}] > {} for {:?}", used, t0, t1, bound, limit);
            }
        }
    }
}

/// At the largest sizes a limit may have (capacity x window just under 2^50), the script
/// still decides like the model and stores every number as plain decimal digits: state
/// that went through "%.14g" (Lua's tostring) would come back rounded.
#[test]
fn the_largest_limits_keep_exact_integer_state() {
    let window = tollgate::MAX_WINDOW;
    let w = window.as_millis() as u64;
    let runtime = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap();
    for algorithm in ALGORITHMS {
        let limits = [Limit::new(algorithm, 30_000, window).unwrap()];
        assert!(
            u128::from(limits[0].capacity()) * u128::from(w) > 1 << 49,
            "{limits:?}"
        );
        let steps: Vec<(Wait, u32, usize)> = [(0, 1), (1, 7), (w / 3, 29_000), (w / 2, 3), (w, 1)]
            .into_iter()
            .map(|(ms, cost)| (Wait::Ms(ms), cost, 0))
            .collect();
        let expected = model_run(&limits, &steps);
        let prefix = runtime.block_on(async {
            let clock = ManualClock::new(START);
            let store = case_store(&clock, false).await;
            for (&(_, cost, _), (now, _, want)) in steps.iter().zip(&expected) {
                clock.set(*now);
                let got = store.check(&Key::new("a"), &limits, cost).await.unwrap();
                assert_eq!(&got, want, "at {now} with {limits:?}");
            }
            store.redis_key(&Key::new("a"), &limits[0])
        });
        let stored = SERVER.with(|server| {
            let cli = |args: &[&str]| server.cli(args).unwrap();
            match cli(&["TYPE", &prefix]).trim() {
                "string" => cli(&["GET", &prefix]),
                "hash" => cli(&["HVALS", &prefix]),
                "zset" => cli(&["ZRANGE", &prefix, "0", "-1", "WITHSCORES"]),
                other => panic!("{prefix} is a {other}"),
            }
        });
        assert!(
            stored
                .chars()
                .all(|c| c.is_ascii_digit() || c == ':' || c.is_ascii_whitespace()),
            "{algorithm:?} stored {stored:?}"
        );
    }
}

/// A store on the shared server with keys of its own (a fresh prefix), on `clock`.
async fn case_store(clock: &ManualClock, block_cache: bool) -> RedisStore {
    let server = SERVER.with(|s| s.url());
    let case = CASE.with(|c| {
        c.set(c.get() + 1);
        c.get()
    });
    let store = RedisStore::connect(&server)
        .await
        .unwrap()
        .with_prefix(&format!("case{case}"))
        .unwrap()
        .with_clock(clock.clone());
    if block_cache {
        store
    } else {
        store.with_block_cache(0)
    }
}

thread_local! {
    static SERVER: support::RedisServer = support::RedisServer::start();
    static CASE: std::cell::Cell<u64> = const { std::cell::Cell::new(0) };
}
