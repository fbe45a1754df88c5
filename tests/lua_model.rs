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

const ALGORITHMS: &[Algorithm] = Algorithm::ALL;

fn algorithm_strategy() -> impl Strategy<Value = Algorithm> {
    prop::sample::select(ALGORITHMS)
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
    /// The clock steps back (another replica's clock, behind this one's).
    Back(u64),
    /// The previous decision's `retry_after` (or `reset_after` of its first limit), plus
    /// -1, 0 or +1 ms: the boundaries where off-by-one mistakes live.
    RetryAfter(i64),
    ResetAfter(i64),
}

/// (wait, cost, which of two keys), with a clock that only moves forward.
fn forward_steps_strategy() -> impl Strategy<Value = Vec<(Wait, u32, usize)>> {
    steps_with(Just(Wait::Ms(0)))
}

/// (wait, cost, which of two keys), with a clock that sometimes steps back.
fn steps_strategy() -> impl Strategy<Value = Vec<(Wait, u32, usize)>> {
    steps_with(prop_oneof![
        (1u64..10).prop_map(Wait::Back),
        (1u64..3_000).prop_map(Wait::Back),
    ])
}

fn steps_with(
    back: impl Strategy<Value = Wait> + 'static,
) -> impl Strategy<Value = Vec<(Wait, u32, usize)>> {
    let wait = prop_oneof![
        2 => Just(Wait::Ms(0)),
        2 => (0u64..50).prop_map(Wait::Ms),
        2 => (0u64..4_000).prop_map(Wait::Ms),
        2 => (-1i64..=1).prop_map(Wait::RetryAfter),
        2 => (-1i64..=1).prop_map(Wait::ResetAfter),
        1 => back,
    ];
    prop::collection::vec((wait, 0u32..8, 0usize..2), 1..60)
}

/// The time of the next request.
fn next_now(now: u64, wait: Wait, previous: Option<&Decision>) -> u64 {
    let dt = match (wait, previous) {
        (Wait::Ms(ms), _) => ms as i64,
        (Wait::Back(ms), _) => return now - ms,
        (Wait::RetryAfter(delta), Some(d)) => d.retry_after().as_millis() as i64 + delta,
        (Wait::ResetAfter(delta), Some(d)) => {
            d.limits()[0].reset_after().as_millis() as i64 + delta
        }
        (_, None) => 0,
    };
    now + dt.max(0) as u64
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
            now = next_now(now, wait, previous.as_ref());
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
    fn the_block_cache_changes_no_decision(limits in limits_strategy(), steps in forward_steps_strategy()) {
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

    /// The sliding-window log with many weighted entries (larger limits and costs,
    /// requests close together, the clock sometimes behind): the script finds the entry
    /// a `retry_after` waits for by bisection over its numbered units; it must agree with
    /// the model's walk through the entries.
    #[test]
    fn a_long_log_decides_like_the_model(
        limit in 20u32..400,
        window_ms in 50u64..2_000,
        steps in prop::collection::vec(
            (prop_oneof![4 => (0u64..15).prop_map(Wait::Ms), 1 => (1u64..30).prop_map(Wait::Back)], 1u32..40),
            1..150,
        ),
    ) {
        let limits = [Limit::sliding_window(limit, Duration::from_millis(window_ms)).unwrap()];
        let steps: Vec<(Wait, u32, usize)> = steps.into_iter().map(|(w, c)| (w, c, 0)).collect();
        let expected = model_run(&limits, &steps);
        let runtime = tokio::runtime::Builder::new_current_thread().enable_all().build().unwrap();
        runtime.block_on(async {
            let clock = ManualClock::new(START);
            let store = case_store(&clock, false).await;
            for (i, (&(_, cost, _), (now, _, want))) in steps.iter().zip(&expected).enumerate() {
                clock.set(*now);
                let got = store.check(&Key::new("a"), &limits, cost).await.unwrap();
                prop_assert_eq!(&got, want, "step {} of {:?} with {:?}", i, steps, limits);
            }
            Ok(())
        })?;
    }

    /// `retry_after` is exact, also after the clock stepped back: the same request is
    /// still denied one millisecond earlier, and allowed at it.
    #[test]
    fn retry_after_is_exact(limit in limit_strategy(), steps in steps_strategy()) {
        let limits = std::slice::from_ref(&limit);
        let mut states = [State::new(limit.algorithm())];
        let mut now = START;
        let mut previous: Option<Decision> = None;
        for &(wait, cost, _) in &steps {
            now = next_now(now, wait, previous.as_ref());
            let decision = algorithm::check(&mut states, limits, now, cost);
            if !decision.is_allowed() && cost <= limit.capacity() {
                let retry = decision.limits()[0].retry_after_ms;
                let at = |t: u64| algorithm::check(&mut states.clone(), limits, t, cost).is_allowed();
                prop_assert!(retry > 0);
                prop_assert!(!at(now + retry - 1), "{:?} at {}: early", limit, now);
                prop_assert!(at(now + retry), "{:?} at {}: {} ms", limit, now, retry);
            }
            previous = Some(decision);
        }
    }

    /// Every run of allowed requests, in the order they were decided, whose times span
    /// `[lo, hi]`, stays within what the algorithm allows in that span, also when the
    /// clock steps back (requests then come in any order of time): a step back never
    /// grants more than a clock that only moved forward through the same span.
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
        for i in 0..run.len() {
            let (mut lo, mut hi, mut used) = (u64::MAX, 0, 0);
            for &(t, cost) in &run[i..] {
                (lo, hi, used) = (lo.min(t), hi.max(t), used + cost);
                let bound = match limit.algorithm() {
                    // `limit` per aligned window the span touches.
                    Algorithm::FixedWindow | Algorithm::SlidingWindowCounter => {
                        (hi / w - lo / w + 1) * l
                    }
                    // Any span shorter than the window.
                    Algorithm::SlidingWindow => {
                        if hi - lo >= w { break; }
                        l
                    }
                    _ => b + (hi - lo) * l / w,
                };
                prop_assert!(used <= bound, "{} used in [{}, {}] > {} for {:?}", used, lo, hi, bound, limit);
            }
        }
    }

    /// `State::expires_at` (what the memory store forgets by, and the TTL the script
    /// sets) is exact: from then on the state decides every later request exactly like a
    /// missing key, and after a write, one millisecond earlier it still decides otherwise
    /// (its `reset_after` says so). A shorter TTL would let a key vanish while its state
    /// still matters; a longer one keeps memory for nothing.
    #[test]
    fn a_state_expires_exactly_when_it_stops_mattering(
        limit in limit_strategy(),
        steps in steps_strategy(),
        tail in prop::collection::vec((0u64..300, 0u32..8), 1..12),
    ) {
        let limits = std::slice::from_ref(&limit);
        let fresh = || [State::new(limit.algorithm())];
        let run = |mut states: [State; 1], from: u64| -> Vec<Decision> {
            let mut now = from;
            tail.iter()
                .map(|&(wait, cost)| {
                    now += wait;
                    algorithm::check(&mut states, limits, now, cost)
                })
                .collect()
        };
        let mut states = fresh();
        let mut now = START;
        let mut previous: Option<Decision> = None;
        for &(wait, cost, _) in &steps {
            now = next_now(now, wait, previous.as_ref());
            let decision = algorithm::check(&mut states, limits, now, cost);
            let expires_at = states[0].expires_at(&limit);
            prop_assert_eq!(
                run(states.clone(), expires_at.max(now)),
                run(fresh(), expires_at.max(now)),
                "after {:?} at {} for {:?}: expires at {}", states, now, limit, expires_at
            );
            if decision.is_allowed() && cost > 0 {
                prop_assert!(expires_at > now);
                prop_assert_eq!(decision.limits()[0].reset_after_ms, expires_at - now);
                let early = |mut states: [State; 1]| {
                    algorithm::check(&mut states, limits, expires_at - 1, 0)
                };
                prop_assert_ne!(early(states.clone()), early(fresh()), "{:?}", limit);
            }
            previous = Some(decision);
        }
    }
}

/// Up to two limits for leasing: every algorithm, the sliding-window log (whose list then
/// never gets a lease) less often.
fn lease_limits_strategy() -> impl Strategy<Value = Vec<Limit>> {
    let algorithm = prop_oneof![
        3 => Just(Algorithm::FixedWindow),
        3 => Just(Algorithm::SlidingWindowCounter),
        2 => Just(Algorithm::TokenBucket),
        2 => Just(Algorithm::Gcra),
        1 => algorithm_strategy(),
    ];
    let window = prop_oneof![1u64..20, 1u64..3_000];
    prop::collection::vec((algorithm, 1u32..80, window, 1u32..100), 1..=2).prop_map(|limits| {
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

/// The script's algorithm codes (`Algorithm::code`).
fn code(algorithm: Algorithm) -> u64 {
    match algorithm {
        Algorithm::FixedWindow => 1,
        Algorithm::SlidingWindow => 2,
        Algorithm::SlidingWindowCounter => 3,
        Algorithm::TokenBucket => 4,
        Algorithm::Gcra => 5,
        _ => unreachable!(),
    }
}

/// One step of the lease test: a request (with an ask, and units of an earlier grant
/// going back before it) or a return alone.
#[derive(Debug, Clone)]
struct LeaseStep {
    wait: Wait,
    cost: u32,
    ask: u64,
    back: Option<(usize, u64)>,
    alone: bool,
}

fn lease_steps_strategy() -> impl Strategy<Value = Vec<LeaseStep>> {
    let wait = prop_oneof![
        3 => Just(Wait::Ms(0)),
        3 => (0u64..50).prop_map(Wait::Ms),
        2 => (0u64..4_000).prop_map(Wait::Ms),
        1 => (1u64..3_000).prop_map(Wait::Back),
    ];
    let back = prop::option::weighted(0.4, (any::<usize>(), 1u64..40));
    prop::collection::vec(
        (
            wait,
            0u32..8,
            prop_oneof![1 => Just(0u64), 3 => 1u64..40],
            back,
            prop::bool::weighted(0.15),
        ),
        1..60,
    )
    .prop_map(|steps| {
        steps
            .into_iter()
            .map(|(wait, cost, ask, back, alone)| LeaseStep {
                wait,
                cost,
                ask,
                back,
                alone,
            })
            .collect()
    })
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 200, ..ProptestConfig::default() })]

    /// The lease path of the script (`lua/lease.lua`) grants and takes back exactly like
    /// the model (`algorithm::lease`): the same units, lease end and window starts, and
    /// the same decisions before and after returns, also when the clock steps back and
    /// for lists that hold an algorithm that is not leased.
    #[test]
    fn lua_leases_like_the_model(limits in lease_limits_strategy(), steps in lease_steps_strategy()) {
        let runtime = tokio::runtime::Builder::new_current_thread().enable_all().build().unwrap();
        let case = CASE.with(|c| { c.set(c.get() + 1); c.get() });
        let keys: Vec<String> = (0..limits.len()).map(|i| format!("lease{case}:{{k}}:{i}")).collect();
        let mut group = vec![limits.len() as u64];
        for l in &limits {
            group.extend([code(l.algorithm()), u64::from(l.limit()), l.window().as_millis() as u64, u64::from(l.capacity())]);
        }
        let mut states: Vec<State> = limits.iter().map(|l| State::new(l.algorithm())).collect();
        // Grants so far: window starts and units not yet given back.
        let mut grants: Vec<(Vec<u64>, u64)> = Vec::new();
        let mut now = START;
        runtime.block_on(async {
            let url = SERVER.with(|s| s.url());
            let client = redis::Client::open(url).unwrap();
            let mut connection = client.get_multiplexed_async_connection().await.unwrap();
            for (i, step) in steps.iter().enumerate() {
                now = match step.wait {
                    Wait::Back(ms) => now - ms,
                    Wait::Ms(ms) => now + ms,
                    _ => now,
                };
                let back = match step.back {
                    Some((pick, units)) if !grants.is_empty() => {
                        let n = grants.len();
                        let grant = &mut grants[pick % n];
                        let units = units.min(grant.1).max(1);
                        grant.1 = grant.1.saturating_sub(units);
                        Some((grant.0.clone(), units))
                    }
                    _ => None,
                };
                let mut cmd = redis::cmd("EVAL");
                cmd.arg(tollgate::store::SCRIPT_SOURCE).arg(keys.len());
                for key in &keys {
                    cmd.arg(key);
                }
                cmd.arg(now).arg(1).arg(&group);
                let alone = step.alone && back.is_some();
                if alone {
                    cmd.arg(0).arg(0);
                } else {
                    cmd.arg(1).arg(step.cost).arg(1);
                    if step.ask > 0 {
                        cmd.arg(1).arg(1).arg(step.ask);
                    } else {
                        cmd.arg(0);
                    }
                }
                match &back {
                    Some((starts, units)) => {
                        cmd.arg(1).arg(1).arg(1).arg(units).arg(starts);
                    }
                    None => { cmd.arg(0); }
                }
                let got: Vec<i64> = cmd.query_async(&mut connection).await.unwrap();
                // The model: returns first, then the request and its grant.
                if let Some((starts, units)) = &back {
                    algorithm::lease::give_back(&mut states, &limits, now, starts, *units);
                }
                let mut want: Vec<i64> = Vec::new();
                if !alone {
                    let decision = algorithm::check(&mut states, &limits, now, step.cost);
                    for d in decision.limits() {
                        want.extend([i64::from(d.allowed), d.remaining as i64, d.reset_after_ms as i64, d.retry_after_ms as i64]);
                    }
                    if step.ask > 0 {
                        if decision.is_allowed() {
                            let grant = algorithm::lease::grant(&mut states, &limits, now, step.ask);
                            want.extend([grant.units as i64, grant.ms_left as i64]);
                            want.extend(grant.starts.iter().map(|&s| s as i64));
                            if grant.units > 0 {
                                prop_assert!(limits.iter().all(|l| algorithm::lease::leasable(l.algorithm())));
                                grants.push((grant.starts.to_vec(), grant.units));
                            }
                        } else {
                            // Denied: nothing granted (the rest is not read).
                            let n = want.len();
                            prop_assert_eq!(got.get(n), Some(&0), "step {}", i);
                            want.extend_from_slice(&got[n..]);
                        }
                    }
                }
                prop_assert_eq!(&got, &want, "step {} of {:?} with {:?}", i, steps, limits);
            }
            Ok(())
        })?;
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
    for &algorithm in ALGORITHMS {
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
