//! Property tests: the Lua script decides exactly like the Rust reference model, and the
//! model never allows more than each algorithm guarantees.

#![cfg(feature = "redis")]

use tollgate_test_support as support;

use std::time::Duration;

use proptest::prelude::*;
use tollgate::{
    Algorithm, Decision, Limit, OnChange,
    algorithm::{self, State},
    clock::{Clock, ManualClock},
    key::Key,
    store::{RedisStore, Store},
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
    distinct(prop::collection::vec(limit_strategy(), 1..=3))
}

/// A limit, with a lockout half of the time (from 1 ms to longer than most windows).
fn locked_limit_strategy() -> impl Strategy<Value = Limit> {
    let lockout = prop_oneof![
        Just(None),
        (1u64..20).prop_map(Some),
        (1u64..5_000).prop_map(Some)
    ];
    (limit_strategy(), lockout).prop_map(|(limit, lockout)| match lockout {
        Some(ms) => limit.with_lockout(Duration::from_millis(ms)).unwrap(),
        None => limit,
    })
}

/// Up to three limits with distinct ids, some with lockouts.
fn locked_limits_strategy() -> impl Strategy<Value = Vec<Limit>> {
    distinct(prop::collection::vec(locked_limit_strategy(), 1..=3))
}

/// Drops limits whose id (every parameter but the lockout) an earlier one has: they
/// would share one state.
fn distinct(limits: impl Strategy<Value = Vec<Limit>>) -> impl Strategy<Value = Vec<Limit>> {
    limits.prop_map(|mut limits| {
        let mut seen = std::collections::HashSet::new();
        limits.retain(|l| seen.insert((l.algorithm(), l.limit(), l.window(), l.burst())));
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

/// The model's decisions with lockouts, with the time of each request.
fn model_run_locked(limits: &[Limit], steps: &[(Wait, u32, usize)]) -> Vec<(u64, u32, Decision)> {
    let mut states: [Vec<State>; 2] =
        std::array::from_fn(|_| limits.iter().map(|l| State::new(l.algorithm())).collect());
    let mut blocks: [Vec<u64>; 2] = std::array::from_fn(|_| vec![0; limits.len()]);
    let mut now = START;
    let mut previous: Option<Decision> = None;
    steps
        .iter()
        .map(|&(wait, cost, key)| {
            now = next_now(now, wait, previous.as_ref());
            let decision = algorithm::check_with_lockouts(
                &mut states[key],
                &mut blocks[key],
                limits,
                now,
                cost,
            );
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
    // Each version with or without a lockout: a block written under one is read (or,
    // without a lockout, ignored) under the next.
    let lockout = prop_oneof![Just(0u64), 1u64..20, 1u64..5_000];
    let versions = prop::collection::vec((1u32..20, 1u32..30, lockout), 1..=3);
    (algorithm, window, versions).prop_map(|(algorithm, window_ms, versions)| {
        versions
            .into_iter()
            .map(|(limit, burst, lockout_ms)| {
                let l = Limit::new(algorithm, limit, Duration::from_millis(window_ms)).unwrap();
                let l = match algorithm {
                    Algorithm::Gcra => l.with_burst(burst).unwrap(),
                    _ => l,
                };
                let l = l
                    .with_name("api")
                    .unwrap()
                    .with_on_change(OnChange::CarryOver)
                    .unwrap();
                match lockout_ms {
                    0 => l,
                    ms => l.with_lockout(Duration::from_millis(ms)).unwrap(),
                }
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
        let mut blocks = [[0u64], [0u64]];
        let mut now = START;
        let mut expected = Vec::new();
        for (i, &(wait, cost, key)) in steps.iter().enumerate() {
            // Plain waits only: `retry_after` belongs to the version that answered.
            if let Wait::Ms(ms) = wait {
                now += ms;
            }
            let limit = &versions[picks[i] % versions.len()];
            let decision = algorithm::check_with_lockouts(
                &mut states[key],
                &mut blocks[key],
                std::slice::from_ref(limit),
                now,
                cost,
            );
            expected.push((now, limit.clone(), decision));
        }
        runtime.block_on(async {
            let clock = ManualClock::new(START);
            let store = case_store(&clock, false).await;
            let keys = [Key::new("a"), Key::new("b")];
            for (i, (&(_, cost, key), (now, limit, want))) in steps.iter().zip(&expected).enumerate() {
                clock.set(*now);
                let got = store.check(&keys[key], std::slice::from_ref(limit), cost).await.env()?;
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
                let got = store.check(&keys[key], &limits, cost).await.env()?;
                prop_assert_eq!(&got, want, "step {} of {:?} with {:?}", i, steps, limits);
            }
            Ok(())
        })?;
    }

    /// Lockouts: the script's blocks decide exactly like the model's, also with the clock
    /// stepping back, several limits, and boundaries at `retry_after`.
    #[test]
    fn lua_decides_like_the_model_with_lockouts(limits in locked_limits_strategy(), steps in steps_strategy()) {
        let runtime = tokio::runtime::Builder::new_current_thread().enable_all().build().unwrap();
        let expected = model_run_locked(&limits, &steps);
        runtime.block_on(async {
            let clock = ManualClock::new(START);
            let store = case_store(&clock, false).await;
            let keys = [Key::new("a"), Key::new("b")];
            for (i, (&(_, cost, key), (now, _, want))) in steps.iter().zip(&expected).enumerate() {
                clock.set(*now);
                let got = store.check(&keys[key], &limits, cost).await.env()?;
                prop_assert_eq!(&got, want, "step {} of {:?} with {:?}", i, steps, limits);
            }
            Ok(())
        })?;
    }

    /// Lockouts that count pending units (a layer counting after the response): the
    /// script's pending records, settles and blocks decide exactly like the model's
    /// (`check_with_pending`, `settle_pending` and `adjust` with `Adjustment::Settle`),
    /// with charges settled out of order, kept, refunded or topped up, across windows
    /// and with the clock stepping back.
    #[test]
    fn lua_decides_like_the_model_with_pending_lockouts(
        limits in locked_limits_strategy(),
        steps in steps_strategy(),
        settles in prop::collection::vec((0u8..3, 0usize..8, 0u32..10), 60),
    ) {
        let limits: Vec<Limit> = limits.into_iter().map(Limit::pending_until_settled).collect();
        let mut states: [Vec<State>; 2] =
            std::array::from_fn(|_| limits.iter().map(|l| State::new(l.algorithm())).collect());
        let mut blocks: [Vec<u64>; 2] = std::array::from_fn(|_| vec![0; limits.len()]);
        let mut pending: [Vec<algorithm::Pending>; 2] =
            std::array::from_fn(|_| vec![algorithm::Pending::default(); limits.len()]);
        // (key, units charged, when): the allowed charges not settled yet.
        let mut outstanding: Vec<(usize, u32, u64)> = Vec::new();
        let mut now = START;
        let mut previous: Option<Decision> = None;
        // (now, key, a settle or a check's cost, the model's decision)
        let mut expected: Vec<(u64, usize, Result<u32, tollgate::Adjustment>, Decision)> = Vec::new();
        for (i, &(wait, cost, key)) in steps.iter().enumerate() {
            now = next_now(now, wait, previous.as_ref());
            let (settle, pick, kept) = settles[i];
            if settle > 0 && !outstanding.is_empty() {
                let (k, charged, at) = outstanding.remove(pick % outstanding.len());
                let kept = if settle == 1 { charged } else { kept };
                let adjustment = tollgate::Adjustment::Settle { charged, kept, charged_at_ms: at };
                algorithm::settle_pending(&mut pending[k], &limits, charged, at);
                let d = algorithm::adjust(&mut states[k], &limits, now, adjustment);
                expected.push((now, k, Err(adjustment), d));
            }
            let d = algorithm::check_with_pending(
                &mut states[key], &mut blocks[key], &mut pending[key], &limits, now, cost,
            );
            if d.is_allowed() && cost > 0 {
                outstanding.push((key, cost, now));
            }
            previous = Some(d.clone());
            expected.push((now, key, Ok(cost), d));
        }
        let runtime = tokio::runtime::Builder::new_current_thread().enable_all().build().unwrap();
        runtime.block_on(async {
            let clock = ManualClock::new(START);
            let store = case_store(&clock, false).await;
            let keys = [Key::new("a"), Key::new("b")];
            for (i, (now, key, step, want)) in expected.iter().enumerate() {
                clock.set(*now);
                let got = match step {
                    Ok(cost) => store.check(&keys[*key], &limits, *cost).await.env()?,
                    Err(adjustment) => store.adjust(&keys[*key], &limits, *adjustment).await.env()?,
                };
                prop_assert_eq!(&got, want, "step {} ({:?}) of {:?} with {:?}", i, step, expected, limits);
            }
            Ok(())
        })?;
    }

    /// A peek (the script's negative group index) answers exactly what the model's
    /// `peek` does, which is what a check would answer, among checks of the same keys,
    /// and writes nothing: each key's value and TTL are the same after as before.
    #[test]
    fn a_peek_decides_like_the_model_and_writes_nothing(
        limits in limits_strategy(),
        steps in steps_strategy(),
        peeks in prop::collection::vec(any::<bool>(), 60),
    ) {
        let runtime = tokio::runtime::Builder::new_current_thread().enable_all().build().unwrap();
        let mut states: [Vec<State>; 2] =
            std::array::from_fn(|_| limits.iter().map(|l| State::new(l.algorithm())).collect());
        let mut now = START;
        let mut previous: Option<Decision> = None;
        let expected: Vec<(u64, Decision)> = steps
            .iter()
            .enumerate()
            .map(|(i, &(wait, cost, key))| {
                now = next_now(now, wait, previous.as_ref());
                let decision = if peeks[i] {
                    algorithm::peek(&states[key], &limits, now, cost)
                } else {
                    algorithm::check(&mut states[key], &limits, now, cost)
                };
                previous = Some(decision.clone());
                (now, decision)
            })
            .collect();
        runtime.block_on(async {
            let clock = ManualClock::new(START);
            let store = case_store(&clock, false).await;
            let mut redis = raw_connection().await;
            let keys = [Key::new("a"), Key::new("b")];
            for (i, (&(_, cost, key), (now, want))) in steps.iter().zip(&expected).enumerate() {
                clock.set(*now);
                let got = if peeks[i] {
                    let redis_keys: Vec<String> =
                        limits.iter().map(|l| store.redis_key(&keys[key], l)).collect();
                    let before = dump(&mut redis, &redis_keys).await?;
                    let got = store.peek(&keys[key], &limits, cost).await.env()?;
                    let after = dump(&mut redis, &redis_keys).await?;
                    for ((value, ttl), (value_after, ttl_after)) in before.iter().zip(&after) {
                        prop_assert_eq!(value, value_after, "step {} of {:?}", i, steps);
                        // Redis's own clock runs on: the TTL may only have shrunk.
                        prop_assert!(ttl_after <= ttl && (*ttl < 0) == (*ttl_after < 0));
                    }
                    got
                } else {
                    store.check(&keys[key], &limits, cost).await.env()?
                };
                prop_assert_eq!(&got, want, "step {} of {:?} with {:?}", i, steps, limits);
            }
            Ok(())
        })?;
    }

    /// Without any lockout, `check_with_lockouts` is `check`.
    #[test]
    fn no_lockout_decides_like_check(limits in limits_strategy(), steps in steps_strategy()) {
        let plain = model_run(&limits, &steps);
        let locked = model_run_locked(&limits, &steps);
        prop_assert_eq!(plain, locked);
    }

    /// With lockouts, `retry_after` is still exact: the same request is denied one
    /// millisecond earlier (no new block starts meanwhile: the request is not sent) and
    /// allowed at it.
    #[test]
    fn retry_after_is_exact_with_lockouts(limit in locked_limit_strategy(), steps in steps_strategy()) {
        let limits = std::slice::from_ref(&limit);
        let mut states = [State::new(limit.algorithm())];
        let mut blocks = [0];
        let mut now = START;
        let mut previous: Option<Decision> = None;
        for &(wait, cost, _) in &steps {
            now = next_now(now, wait, previous.as_ref());
            let decision = algorithm::check_with_lockouts(&mut states, &mut blocks, limits, now, cost);
            if !decision.is_allowed() && cost <= limit.capacity() {
                let retry = decision.limits()[0].retry_after_ms;
                let at = |t: u64| {
                    algorithm::check_with_lockouts(&mut states.clone(), &mut blocks.clone(), limits, t, cost)
                        .is_allowed()
                };
                prop_assert!(retry > 0);
                prop_assert!(!at(now + retry - 1), "{:?} at {}: early", limit, now);
                prop_assert!(at(now + retry), "{:?} at {}: {} ms", limit, now, retry);
            }
            previous = Some(decision);
        }
    }

    /// Peeks inside one script call among checks of the same key (a batch, as a caller
    /// that coalesced them would send): each peek answers what a check at that point
    /// would, and leaves the state for the requests after it exactly as it found it.
    #[test]
    fn peeks_in_a_batch_leave_the_state_to_the_requests_after_them(
        limits in limits_strategy(),
        requests in prop::collection::vec((0u32..8, any::<bool>()), 1..30),
        before in prop::collection::vec(0u32..8, 0..10),
    ) {
        let runtime = tokio::runtime::Builder::new_current_thread().enable_all().build().unwrap();
        let now = START;
        let mut states: Vec<State> = limits.iter().map(|l| State::new(l.algorithm())).collect();
        for &cost in &before {
            algorithm::check(&mut states, &limits, now, cost);
        }
        let expected: Vec<Decision> = requests
            .iter()
            .map(|&(cost, peek)| {
                if peek {
                    algorithm::peek(&states, &limits, now, cost)
                } else {
                    algorithm::check(&mut states, &limits, now, cost)
                }
            })
            .collect();
        runtime.block_on(async {
            let clock = ManualClock::new(now);
            let store = case_store(&clock, false).await;
            let key = Key::new("batch");
            for &cost in &before {
                store.check(&key, &limits, cost).await.env()?;
            }
            let redis_keys: Vec<String> = limits.iter().map(|l| store.redis_key(&key, l)).collect();
            // The script's ARGV as documented in lua/main.lua: one group, every request
            // naming it, negated for a peek.
            let mut call = redis::cmd("EVAL");
            call.arg(tollgate::store::SCRIPT_SOURCE).arg(redis_keys.len() * requests.len());
            for _ in &requests {
                for redis_key in &redis_keys {
                    call.arg(redis_key);
                }
            }
            call.arg(now).arg(1).arg(limits.len());
            for limit in &limits {
                let code = ALGORITHMS.iter().position(|a| *a == limit.algorithm()).unwrap() + 1;
                call.arg(code)
                    .arg(limit.limit())
                    .arg(limit.window().as_millis() as u64)
                    .arg(limit.capacity())
                    .arg(0); // no lockout
            }
            call.arg(requests.len());
            for &(cost, peek) in &requests {
                call.arg(cost).arg(if peek { -1 } else { 1 });
            }
            let mut redis = raw_connection().await;
            let reply: Vec<i64> = call.query_async(&mut redis).await.env()?;
            // (allowed, remaining, reset_after, retry_after) per limit of each request.
            let got: Vec<Vec<(bool, u64, u64, u64)>> = reply
                .chunks_exact(4 * limits.len())
                .map(|request| {
                    request
                        .chunks_exact(4)
                        .map(|v| (v[0] == 1, v[1] as u64, v[2] as u64, v[3] as u64))
                        .collect()
                })
                .collect();
            let expected: Vec<Vec<(bool, u64, u64, u64)>> = expected
                .iter()
                .map(|d| {
                    d.limits()
                        .iter()
                        .map(|l| (l.allowed, l.remaining, l.reset_after_ms, l.retry_after_ms))
                        .collect()
                })
                .collect();
            prop_assert_eq!(&got, &expected, "{:?} after {:?} with {:?}", requests, before, limits);
            // And what the batch saved is what the model kept.
            let after = store.peek(&key, &limits, 0).await.env()?;
            prop_assert_eq!(after, algorithm::peek(&states, &limits, now, 0));
            Ok(())
        })?;
    }

    /// The block cache answers repeated denials locally: the same decisions and the same
    /// `retry_after` as Redis without it; `remaining` may lag behind, never ahead.
    #[test]
    fn the_block_cache_changes_no_decision(limits in locked_limits_strategy(), steps in forward_steps_strategy()) {
        let runtime = tokio::runtime::Builder::new_current_thread().enable_all().build().unwrap();
        let expected = model_run_locked(&limits, &steps);
        runtime.block_on(async {
            let clock = ManualClock::new(START);
            let store = case_store(&clock, true).await;
            let keys = [Key::new("a"), Key::new("b")];
            for (&(_, cost, key), (now, _, want)) in steps.iter().zip(&expected) {
                clock.set(*now);
                let got = store.check(&keys[key], &limits, cost).await.env()?;
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
        a in locked_limits_strategy(),
        b in locked_limits_strategy(),
        batches in prop::collection::vec(
            (0u64..3_000, prop::collection::vec((0u32..6, 0usize..3, any::<bool>()), 1..40)),
            1..6,
        ),
    ) {
        // The second list shares the first's first limit: in place of its limit with the
        // same id (which may differ in its lockout), or of its first, so that it keeps one
        // limit per id (two would share one state).
        let mut b = b;
        let id = |l: &Limit| (l.algorithm(), l.limit(), l.window(), l.burst());
        let same = b.iter().position(|l| id(l) == id(&a[0])).unwrap_or(0);
        b[same] = a[0].clone();
        let lists = [a, b];
        let runtime = tokio::runtime::Builder::new_current_thread().enable_all().build().unwrap();
        runtime.block_on(async {
            let clock = ManualClock::new(START);
            let store = case_store(&clock, false).await;
            let keys = [Key::new("a"), Key::new("b"), Key::new("c")];
            // The model's state and block of each (key, limit id).
            let mut model: std::collections::HashMap<(usize, String), (State, u64)> = Default::default();
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
                    let ids: Vec<(usize, String)> = limits
                        .iter()
                        .map(|l| (key, format!("{:?}", (l.algorithm(), l.limit(), l.window(), l.burst()))))
                        .collect();
                    let (mut states, mut blocks): (Vec<State>, Vec<u64>) = ids
                        .iter()
                        .zip(limits)
                        .map(|(id, l)| model.remove(id).unwrap_or_else(|| (State::new(l.algorithm()), 0)))
                        .unzip();
                    let want = algorithm::check_with_lockouts(&mut states, &mut blocks, limits, now, cost);
                    model.extend(ids.into_iter().zip(states.into_iter().zip(blocks)));
                    prop_assert_eq!(got.env()?, want, "{:?} at {}", (cost, key, second), now);
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
                let got = store.check(&Key::new("a"), &limits, cost).await.env()?;
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
/// never gets a lease) less often, and a lockout now and then (a list with one is never
/// leased either).
fn lease_limits_strategy() -> impl Strategy<Value = Vec<Limit>> {
    let algorithm = prop_oneof![
        3 => Just(Algorithm::FixedWindow),
        3 => Just(Algorithm::SlidingWindowCounter),
        2 => Just(Algorithm::TokenBucket),
        2 => Just(Algorithm::Gcra),
        1 => algorithm_strategy(),
    ];
    let window = prop_oneof![1u64..20, 1u64..3_000];
    let lockout = prop::option::weighted(0.15, 1u64..3_000);
    prop::collection::vec((algorithm, 1u32..80, window, 1u32..100, lockout), 1..=2).prop_map(
        |limits| {
            let mut seen = std::collections::HashSet::new();
            limits
                .into_iter()
                .map(|(a, l, w, b, lockout)| {
                    let limit = Limit::new(a, l, Duration::from_millis(w)).unwrap();
                    let limit = match a {
                        Algorithm::TokenBucket | Algorithm::Gcra => limit.with_burst(b).unwrap(),
                        _ => limit,
                    };
                    match lockout {
                        Some(ms) => limit.with_lockout(Duration::from_millis(ms)).unwrap(),
                        None => limit,
                    }
                })
                .filter(|l| seen.insert(format!("{l:?}")))
                .collect()
        },
    )
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
/// going back before it) or a return alone. The request may be a peek or an adjustment,
/// whose ask is never granted.
#[derive(Debug, Clone)]
struct LeaseStep {
    wait: Wait,
    cost: u32,
    ask: u64,
    back: Option<(usize, u64)>,
    alone: bool,
    kind: LeaseKind,
}

/// What the request of a [`LeaseStep`] is.
#[derive(Debug, Clone, Copy)]
enum LeaseKind {
    Check,
    Peek,
    /// A refund to the state as it was this many ms ago.
    Refund(u64),
    TopUp,
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
            prop_oneof![
                6 => Just(LeaseKind::Check),
                1 => Just(LeaseKind::Peek),
                1 => (0u64..100).prop_map(LeaseKind::Refund),
                1 => Just(LeaseKind::TopUp),
            ],
        ),
        1..60,
    )
    .prop_map(|steps| {
        steps
            .into_iter()
            .map(|(wait, cost, ask, back, alone, kind)| LeaseStep {
                wait,
                cost,
                ask,
                back,
                alone,
                kind,
            })
            .collect()
    })
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 200, ..ProptestConfig::default() })]

    /// The lease path of the script (`lua/lease.lua`) grants and takes back exactly like
    /// the model (`algorithm::lease`): the same units, lease end and window starts, and
    /// the same decisions before and after returns, also when the clock steps back, for
    /// lists that hold an algorithm that is not leased or a lockout (never granted), and
    /// beside peeks and adjustments (never granted). The reply is the requests' results,
    /// then the asks', then the script's `now`.
    #[test]
    fn lua_leases_like_the_model(limits in lease_limits_strategy(), steps in lease_steps_strategy()) {
        let runtime = tokio::runtime::Builder::new_current_thread().enable_all().build().unwrap();
        let case = CASE.with(|c| { c.set(c.get() + 1); c.get() });
        let mut keys: Vec<String> = (0..limits.len()).map(|i| format!("lease{case}:{{k}}:{i}")).collect();
        // Then a block key per limit with a lockout.
        for (i, l) in limits.iter().enumerate() {
            if l.lockout().is_some() {
                keys.push(format!("lease{case}:{{k}}:{i}:lockout"));
            }
        }
        let mut group = vec![limits.len() as u64];
        for l in &limits {
            let lockout = l.lockout().map_or(0, |d| d.as_millis() as u64);
            group.extend([code(l.algorithm()), u64::from(l.limit()), l.window().as_millis() as u64, u64::from(l.capacity()), lockout]);
        }
        let mut states: Vec<State> = limits.iter().map(|l| State::new(l.algorithm())).collect();
        let mut blocks: Vec<u64> = vec![0; limits.len()];
        // Grants so far: window starts and units not yet given back.
        let mut grants: Vec<(Vec<u64>, u64)> = Vec::new();
        let mut now = START;
        runtime.block_on(async {
            let mut connection = raw_connection().await;
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
                // An adjustment of 0 units is never sent ("-0" is a request of cost 0).
                let kind = match step.kind {
                    LeaseKind::Refund(_) | LeaseKind::TopUp if step.cost == 0 => LeaseKind::Check,
                    kind => kind,
                };
                let cost = i64::from(step.cost);
                if alone {
                    cmd.arg(0).arg(0);
                } else {
                    match kind {
                        LeaseKind::Check => cmd.arg(1).arg(cost).arg(1),
                        LeaseKind::Peek => cmd.arg(1).arg(cost).arg(-1),
                        LeaseKind::Refund(ago) => cmd.arg(1).arg(-cost).arg(1).arg(now - ago.min(now)),
                        LeaseKind::TopUp => cmd.arg(1).arg(-cost).arg(1).arg(-1),
                    };
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
                let mut got: Vec<i64> = cmd.query_async(&mut connection).await.env()?;
                // Any reply with requests ends with the script's `now`.
                if !alone {
                    prop_assert_eq!(got.pop(), Some(now as i64), "step {}", i);
                }
                // A lockout block sends remaining as minus its time left: the lockout
                // tests check that; here it is the model's 0.
                for v in got.chunks_mut(4).take(if alone { 0 } else { limits.len() }) {
                    v[1] = v[1].max(0);
                }
                // The model: returns first, then the request and its grant.
                if let Some((starts, units)) = &back {
                    algorithm::lease::give_back(&mut states, &limits, now, starts, *units);
                }
                let mut want: Vec<i64> = Vec::new();
                if !alone {
                    let decision = match kind {
                        LeaseKind::Check => algorithm::check_with_lockouts(&mut states, &mut blocks, &limits, now, step.cost),
                        LeaseKind::Peek => algorithm::peek_with_lockouts(&states, &blocks, &limits, now, step.cost),
                        LeaseKind::Refund(ago) => {
                            let a = tollgate::Adjustment::Refund { units: step.cost, charged_at_ms: now - ago.min(now) };
                            algorithm::adjust(&mut states, &limits, now, a)
                        }
                        LeaseKind::TopUp => {
                            let a = tollgate::Adjustment::TopUp { units: step.cost };
                            algorithm::adjust(&mut states, &limits, now, a)
                        }
                    };
                    for d in decision.limits() {
                        want.extend([i64::from(d.allowed), d.remaining as i64, d.reset_after_ms as i64, d.retry_after_ms as i64]);
                    }
                    if step.ask > 0 {
                        if !matches!(kind, LeaseKind::Check) {
                            // A peek or an adjustment never takes a lease.
                            want.extend(std::iter::repeat_n(0, 2 + limits.len()));
                        } else if decision.is_allowed() {
                            let grant = algorithm::lease::grant(&mut states, &limits, now, step.ask);
                            want.extend([grant.units as i64, grant.ms_left as i64]);
                            want.extend(grant.starts.iter().map(|&s| s as i64));
                            if grant.units > 0 {
                                prop_assert!(limits.iter().all(algorithm::lease::limit_leasable));
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
    let store = RedisStore::connect(server)
        .await
        .unwrap_or_else(|error| environment_fault(&error))
        .with_prefix(&format!("case{case}"))
        .unwrap()
        .with_clock(clock.clone());
    if block_cache {
        store
    } else {
        store.with_block_cache(None)
    }
}

/// A plain connection to the shared server, to look at keys, waiting up to 10 s to
/// connect and for each answer (as `support::test_connection`).
async fn raw_connection() -> redis::aio::MultiplexedConnection {
    let server = SERVER.with(|s| s.url());
    let config = redis::AsyncConnectionConfig::new()
        .set_connection_timeout(Some(Duration::from_secs(10)))
        .set_response_timeout(Some(Duration::from_secs(10)));
    let client = redis::Client::open(server).unwrap_or_else(|error| environment_fault(&error));
    client
        .get_multiplexed_async_connection_with_config(&config)
        .await
        .unwrap_or_else(|error| environment_fault(&error))
}

/// Stops the whole test binary for a fault of the environment (Redis timed out or went
/// away), saying so. Not a panic: proptest catches panics in a case, shrinks the inputs
/// as if they had found a bug, and saves them as a regression seed, though replaying
/// them passes. (A timed-out call may have counted, so it cannot be retried, and the
/// store's 1 s answer timeout is its own.) Written to stderr directly, past the test
/// harness's capture, which the exit would discard.
fn environment_fault(error: &dyn std::fmt::Display) -> ! {
    use std::io::Write;
    let _ = writeln!(
        std::io::stderr(),
        "\nlua_model: environment fault, not a counterexample (no seed written): {error}\n\
         Redis did not answer in time or went away, likely a loaded machine; run again."
    );
    std::process::exit(3)
}

/// A Redis call's value in a property test: a fault of the environment stops the test
/// binary ([`environment_fault`]), any other error (a script error, a reply of the wrong
/// shape) fails the case, a counterexample like a wrong answer.
trait Env<T> {
    fn env(self) -> Result<T, TestCaseError>;
}

impl<T> Env<T> for Result<T, tollgate::StoreError> {
    fn env(self) -> Result<T, TestCaseError> {
        use tollgate::StoreErrorKind::{Overloaded, Timeout, Unavailable};
        self.map_err(|error| match error.kind() {
            Timeout | Unavailable | Overloaded => environment_fault(&error),
            _ => TestCaseError::fail(format!("store error: {error:?}")),
        })
    }
}

impl<T> Env<T> for redis::RedisResult<T> {
    fn env(self) -> Result<T, TestCaseError> {
        self.map_err(|error| {
            if error.is_timeout()
                || error.is_io_error()
                || error.is_connection_dropped()
                || error.is_connection_refusal()
            {
                environment_fault(&error)
            }
            TestCaseError::fail(format!("redis error: {error:?}"))
        })
    }
}

/// Each key's serialized value (`DUMP`; none when absent) and TTL in ms.
async fn dump(
    redis: &mut redis::aio::MultiplexedConnection,
    keys: &[String],
) -> Result<Vec<(Option<Vec<u8>>, i64)>, TestCaseError> {
    let mut out = Vec::new();
    for key in keys {
        let value: Option<Vec<u8>> = redis::cmd("DUMP").arg(key).query_async(redis).await.env()?;
        let ttl: i64 = redis::cmd("PTTL").arg(key).query_async(redis).await.env()?;
        out.push((value, ttl));
    }
    Ok(out)
}

thread_local! {
    static SERVER: support::RedisServer = support::RedisServer::start();
    static CASE: std::cell::Cell<u64> = const { std::cell::Cell::new(0) };
}

/// One step of a history with adjustments after responses.
#[derive(Debug, Clone, Copy)]
enum Op {
    Check(u32),
    /// Gives back `units` of the `n`-th last allowed check of the key (its time), or of
    /// a time that no check had when there is none.
    Refund(usize, u32),
    TopUp(u32),
}

fn op_strategy() -> impl Strategy<Value = Op> {
    prop_oneof![
        4 => (0u32..8).prop_map(Op::Check),
        3 => (0usize..4, 1u32..8).prop_map(|(n, u)| Op::Refund(n, u)),
        2 => (1u32..12).prop_map(Op::TopUp),
    ]
}

/// Batches of steps decided at one moment (submitted together, so that the coalescer
/// sends each batch as one script call): (wait before it, [(op, key)]).
fn adjusted_batches_strategy() -> impl Strategy<Value = Vec<(Wait, Vec<(Op, usize)>)>> {
    let wait = prop_oneof![
        2 => Just(Wait::Ms(0)),
        2 => (0u64..50).prop_map(Wait::Ms),
        2 => (0u64..4_000).prop_map(Wait::Ms),
        1 => (-1i64..=1).prop_map(Wait::RetryAfter),
        1 => (1u64..30).prop_map(Wait::Back),
    ];
    prop::collection::vec(
        (
            wait,
            prop::collection::vec((op_strategy(), 0usize..2), 1..4),
        ),
        1..30,
    )
}

/// What the model does with the same batches: the decisions, in order, and the times of
/// allowed checks per key (for the refunds).
fn model_adjusted(
    limits: &[Limit],
    batches: &[(Wait, Vec<(Op, usize)>)],
) -> Vec<(u64, Vec<(tollgate::Adjustment, Decision)>)> {
    let mut states: [Vec<State>; 2] =
        std::array::from_fn(|_| limits.iter().map(|l| State::new(l.algorithm())).collect());
    let mut allowed_at: [Vec<u64>; 2] = Default::default();
    let mut now = START;
    let mut previous: Option<Decision> = None;
    let mut out = Vec::new();
    for (wait, ops) in batches {
        now = next_now(now, *wait, previous.as_ref());
        let mut decided = Vec::new();
        for &(op, key) in ops {
            let (adjustment, decision) = match op {
                Op::Check(cost) => {
                    let d = algorithm::check(&mut states[key], limits, now, cost);
                    if d.is_allowed() && cost > 0 {
                        allowed_at[key].push(now);
                    }
                    previous = Some(d.clone());
                    // Marked as a check: a top-up of 0 is never sent.
                    (tollgate::Adjustment::TopUp { units: 0 }, d.clone())
                }
                Op::Refund(n, units) => {
                    let times = &allowed_at[key];
                    let at = times.len().checked_sub(n + 1).map_or(now + 7, |i| times[i]);
                    let a = tollgate::Adjustment::Refund {
                        units,
                        charged_at_ms: at,
                    };
                    (a, algorithm::adjust(&mut states[key], limits, now, a))
                }
                Op::TopUp(units) => {
                    let a = tollgate::Adjustment::TopUp { units };
                    (a, algorithm::adjust(&mut states[key], limits, now, a))
                }
            };
            decided.push((adjustment, decision));
        }
        out.push((now, decided));
    }
    out
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 200, ..ProptestConfig::default() })]

    /// Refunds and top-ups (negative costs in the script) decide like the model, mixed
    /// with checks in one script call and alone, and every decision names the time it
    /// was made at (what a refund sends back).
    #[test]
    fn lua_adjusts_like_the_model(limits in limits_strategy(), batches in adjusted_batches_strategy()) {
        let expected = model_adjusted(&limits, &batches);
        let runtime = tokio::runtime::Builder::new_current_thread().enable_all().build().unwrap();
        runtime.block_on(async {
            let clock = ManualClock::new(START);
            let store = case_store(&clock, false).await;
            let keys = [Key::new("a"), Key::new("b")];
            for ((_, ops), (now, want)) in batches.iter().zip(&expected) {
                clock.set(*now);
                let calls: Vec<_> = ops
                    .iter()
                    .zip(want)
                    .map(|(&(op, key), (adjustment, _))| match op {
                        Op::Check(cost) => store.check(&keys[key], &limits, cost),
                        _ => store.adjust(&keys[key], &limits, *adjustment),
                    })
                    .collect();
                let got = futures_util::future::join_all(calls).await;
                for ((op, (_, want)), got) in ops.iter().zip(want).zip(got) {
                    let got = got.env()?;
                    prop_assert_eq!(&got, want, "{:?} at {} in {:?} with {:?}", op, now, batches, limits);
                    prop_assert_eq!(got.decided_at_ms(), Some(*now));
                }
            }
            Ok(())
        })?;
    }

    /// The long log with refunds: many weighted entries, refunds of entries in the
    /// middle (every newer entry is numbered anew), the clock sometimes behind.
    #[test]
    fn a_long_log_refunds_like_the_model(
        limit in 20u32..200,
        window_ms in 50u64..2_000,
        batches in prop::collection::vec(
            (
                prop_oneof![4 => (0u64..15).prop_map(Wait::Ms), 1 => (1u64..30).prop_map(Wait::Back)],
                prop::collection::vec(
                    (prop_oneof![
                        3 => (1u32..30).prop_map(Op::Check),
                        2 => (0usize..12, 1u32..40).prop_map(|(n, u)| Op::Refund(n, u)),
                        1 => (1u32..30).prop_map(Op::TopUp),
                    ], Just(0usize)),
                    1..3,
                ),
            ),
            1..80,
        ),
    ) {
        let limits = [Limit::sliding_window(limit, Duration::from_millis(window_ms)).unwrap()];
        let expected = model_adjusted(&limits, &batches);
        let runtime = tokio::runtime::Builder::new_current_thread().enable_all().build().unwrap();
        runtime.block_on(async {
            let clock = ManualClock::new(START);
            let store = case_store(&clock, false).await;
            let key = Key::new("a");
            for ((_, ops), (now, want)) in batches.iter().zip(&expected) {
                clock.set(*now);
                let calls: Vec<_> = ops
                    .iter()
                    .zip(want)
                    .map(|(&(op, _), (adjustment, _))| match op {
                        Op::Check(cost) => store.check(&key, &limits, cost),
                        _ => store.adjust(&key, &limits, *adjustment),
                    })
                    .collect();
                let got = futures_util::future::join_all(calls).await;
                for ((op, (_, want)), got) in ops.iter().zip(want).zip(got) {
                    prop_assert_eq!(&got.env()?, want, "{:?} at {} with {:?}", op, now, limits);
                }
            }
            Ok(())
        })?;
    }

    /// A refund of a check's own units, right after it, undoes it exactly: every later
    /// decision is the one it would have been without the pair (`reset_after` aside: a
    /// log may keep an emptied entry). And top-ups keep the state bounded: after any of
    /// them the key is full again within two windows (two bursts' refill for buckets).
    #[test]
    fn a_refund_undoes_its_check(
        limit in limit_strategy(),
        steps in forward_steps_strategy(),
        cost in 1u32..8,
        tail in prop::collection::vec((0u64..300, 0u32..8), 1..12),
    ) {
        let limits = std::slice::from_ref(&limit);
        let history = model_run(limits, &steps);
        let mut states = [State::new(limit.algorithm())];
        for ((now, cost, _), _) in history.iter().zip(&steps) {
            algorithm::check(&mut states, limits, *now, *cost);
        }
        let now = history.last().map_or(START, |(t, _, _)| *t);
        let mut undone = states.clone();
        let d = algorithm::check(&mut undone, limits, now, cost);
        if d.is_allowed() {
            let at = d.decided_at_ms().unwrap();
            algorithm::adjust(&mut undone, limits, now, tollgate::Adjustment::Refund { units: cost, charged_at_ms: at });
        }
        let outcome = |mut states: [State; 1]| -> Vec<(bool, u64, u64)> {
            let mut t = now;
            tail.iter().map(|&(wait, cost)| {
                t += wait;
                let d = algorithm::check(&mut states, limits, t, cost);
                (d.is_allowed(), d.retry_after().as_millis() as u64, d.remaining().unwrap())
            }).collect()
        };
        prop_assert_eq!(outcome(undone), outcome(states.clone()), "{:?}", limit);

        let mut indebted = states;
        for _ in 0..5 {
            algorithm::adjust(&mut indebted, limits, now, tollgate::Adjustment::TopUp { units: u32::MAX });
        }
        let w = limit.window().as_millis() as u64;
        let refill = 2 * w * u64::from(limit.capacity()).div_ceil(u64::from(limit.limit()));
        let full = algorithm::check(&mut indebted, limits, now + refill + 1, 0);
        prop_assert_eq!(full.remaining(), Some(u64::from(limit.capacity())), "{:?}", limit);
    }
}

/// Found by `a_long_log_refunds_like_the_model`: a refund that finds its entry already
/// emptied (kept as the log's only entry) changes nothing, in the model as in Lua, so
/// that both keep the same entries (and `reset_after`).
#[test]
fn a_refund_of_an_emptied_entry_changes_nothing() {
    let limits = [Limit::sliding_window(28, Duration::from_millis(50)).unwrap()];
    let t = START;
    let batches = vec![
        (Wait::Ms(0), vec![(Op::Check(11), 0)]),
        (Wait::Ms(2), vec![(Op::Refund(0, 11), 0), (Op::Check(1), 0)]),
        (Wait::Back(2), vec![(Op::Check(11), 0)]),
        (
            Wait::Back(1),
            vec![(Op::Refund(0, 1), 0), (Op::Check(13), 0)],
        ),
        (Wait::Ms(0), vec![(Op::Refund(2, 28), 0)]),
    ];
    let expected = model_adjusted(&limits, &batches);
    assert_eq!(expected[3].0, t - 1);
    let runtime = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap();
    runtime.block_on(async {
        let clock = ManualClock::new(START);
        let store = case_store(&clock, false).await;
        let key = Key::new("a");
        for ((_, ops), (now, want)) in batches.iter().zip(&expected) {
            clock.set(*now);
            for (&(op, _), (adjustment, want)) in ops.iter().zip(want) {
                let got = match op {
                    Op::Check(cost) => store.check(&key, &limits, cost).await,
                    _ => store.adjust(&key, &limits, *adjustment).await,
                };
                assert_eq!(&got.unwrap(), want, "{op:?} at {now}");
            }
        }
    });
}

/// One step against the permits of one key (after a wait, with a lease): take a permit,
/// renew the `n`-th permit taken so far, or give it back.
#[derive(Debug, Clone, Copy)]
enum PermitOp {
    Acquire,
    Renew(usize),
    Release(usize),
}

fn permit_steps_strategy() -> impl Strategy<Value = Vec<(PermitWait, PermitOp, u64)>> {
    let op = prop_oneof![
        3 => Just(PermitOp::Acquire),
        2 => (0usize..8).prop_map(PermitOp::Renew),
        1 => (0usize..8).prop_map(PermitOp::Release),
    ];
    // Leases of seconds: a write sets the key's TTL (real time) to at least one lease, so
    // no key expires while a case runs; waits as long as leases end them on the model's
    // clock.
    let wait = prop_oneof![
        (0u64..3).prop_map(PermitWait::Ms),
        (0u64..10_000).prop_map(PermitWait::Ms),
        (-1i64..=1).prop_map(PermitWait::ToFirstEnd),
    ];
    prop::collection::vec((wait, op, 1_000u64..8_000), 1..40)
}

/// How far the clock moves before a step.
#[derive(Debug, Clone, Copy)]
enum PermitWait {
    Ms(u64),
    /// To the first lease end not yet passed, plus -1, 0 or +1 ms: where off-by-one
    /// mistakes live.
    ToFirstEnd(i64),
}

fn next_permit_now(now: u64, wait: PermitWait, model: &algorithm::in_flight::Permits) -> u64 {
    match wait {
        PermitWait::Ms(ms) => now + ms,
        PermitWait::ToFirstEnd(delta) => model
            .ends()
            .map(|(_, end)| end)
            .filter(|&end| end >= now)
            .min()
            .map_or(now, |end| now.max(end.saturating_add_signed(delta))),
    }
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 100, ..ProptestConfig::default() })]

    /// The in-flight scripts take, renew and give back permits exactly like the model
    /// (`algorithm::in_flight::Permits`): the same answers, the same leases after every step, and a
    /// TTL that ends with the last lease.
    #[test]
    fn in_flight_scripts_follow_the_lease_model(
        max in 1u32..4,
        steps in permit_steps_strategy(),
    ) {
        let runtime = tokio::runtime::Builder::new_current_thread().enable_all().build().unwrap();
        runtime.block_on(async {
            let mut redis = raw_connection().await;
            let case = CASE.with(|c| {
                c.set(c.get() + 1);
                c.get()
            });
            let key = format!("leases{case}:{{k}}:inflight:{max}");
            let acquire = redis::Script::new(tollgate::store::IN_FLIGHT_ACQUIRE_SOURCE);
            let renew = redis::Script::new(tollgate::store::IN_FLIGHT_RENEW_SOURCE);
            let mut model = algorithm::in_flight::Permits::default();
            let mut taken: Vec<String> = Vec::new();
            let mut now = START;
            for (i, &(wait, op, lease)) in steps.iter().enumerate() {
                now = next_permit_now(now, wait, &model);
                match op {
                    PermitOp::Acquire => {
                        let id = format!("p{i}");
                        let expected = model.acquire(now, lease, max, &id);
                        let got: (i64, i64) = acquire
                            .key(&key)
                            .arg(now)
                            .arg(lease)
                            .arg(max)
                            .arg(&id)
                            .invoke_async(&mut redis)
                            .await
                            .env()?;
                        prop_assert_eq!(
                            (got.0 == 1, u64::try_from(got.1).unwrap()),
                            expected,
                            "step {}", i
                        );
                        if expected.0 {
                            taken.push(id);
                        }
                    }
                    PermitOp::Renew(n) | PermitOp::Release(n) if taken.is_empty() => {
                        let _ = n;
                    }
                    PermitOp::Renew(n) => {
                        let id = &taken[n % taken.len()];
                        let expected = model.renew(now, lease, id);
                        let got: i64 = renew
                            .key(&key)
                            .arg(now)
                            .arg(lease)
                            .arg(id)
                            .invoke_async(&mut redis)
                            .await
                            .env()?;
                        prop_assert_eq!(got == 1, expected, "step {}", i);
                    }
                    PermitOp::Release(n) => {
                        let id = &taken[n % taken.len()];
                        model.release(id);
                        let _: i64 = redis::cmd("ZREM")
                            .arg(&key)
                            .arg(id)
                            .query_async(&mut redis)
                            .await
                            .env()?;
                    }
                }
                let held: Vec<(String, u64)> = redis::cmd("ZRANGE")
                    .arg(&key)
                    .arg(0)
                    .arg(-1)
                    .arg("WITHSCORES")
                    .query_async(&mut redis)
                    .await
                    .env()?;
                let mut held: Vec<(String, u64)> = held;
                held.sort();
                let expected: Vec<(String, u64)> =
                    model.ends().map(|(id, end)| (id.to_owned(), end)).collect();
                prop_assert_eq!(&held, &expected, "step {}", i);
                // Every write set the TTL to the last lease's end; time in Redis runs on
                // meanwhile, so the TTL is at most that (and the key exists while held).
                let ttl: i64 = redis::cmd("PTTL")
                    .arg(&key)
                    .query_async(&mut redis)
                    .await
                    .env()?;
                if held.is_empty() {
                    prop_assert_eq!(ttl, -2, "step {}: an empty set is no key", i);
                } else {
                    prop_assert!(ttl > 0, "step {}: held leases without a TTL ({})", i, ttl);
                }
            }
            Ok(())
        })?;
    }
}

/// Limits for reservations: mostly token buckets and GCRAs (which reserve), sometimes a
/// fixed window among them (then a request reserves nothing).
fn reserve_limits_strategy() -> impl Strategy<Value = Vec<Limit>> {
    let algorithm = prop::sample::select(vec![
        Algorithm::TokenBucket,
        Algorithm::Gcra,
        Algorithm::TokenBucket,
        Algorithm::Gcra,
        Algorithm::FixedWindow,
    ]);
    let window = prop_oneof![1u64..20, 1u64..3_000];
    let limit =
        (algorithm, 1u32..20, window, 1u32..30).prop_map(|(algorithm, limit, window_ms, burst)| {
            let l = Limit::new(algorithm, limit, Duration::from_millis(window_ms)).unwrap();
            match algorithm {
                Algorithm::TokenBucket | Algorithm::Gcra => l.with_burst(burst).unwrap(),
                _ => l,
            }
        });
    distinct(prop::collection::vec(limit, 1..=3))
}

/// One step of a history with reservations.
#[derive(Debug, Clone, Copy)]
enum Reserving {
    Check(u32),
    /// Cost, max wait ms.
    Reserve(u32, u64),
    /// Gives back the key's last reservation (its cost, at its decision's time), as a
    /// client that hangs up does.
    Release,
    TopUp(u32),
}

fn reserving_strategy() -> impl Strategy<Value = Reserving> {
    let max_wait = prop_oneof![1u64..50, 1u64..5_000];
    prop_oneof![
        2 => (0u32..8).prop_map(Reserving::Check),
        5 => (0u32..8, max_wait).prop_map(|(c, m)| Reserving::Reserve(c, m)),
        1 => Just(Reserving::Release),
        1 => (1u32..6).prop_map(Reserving::TopUp),
    ]
}

fn reserving_batches_strategy() -> impl Strategy<Value = Vec<(Wait, Vec<(Reserving, usize)>)>> {
    let wait = prop_oneof![
        2 => Just(Wait::Ms(0)),
        2 => (0u64..50).prop_map(Wait::Ms),
        2 => (0u64..4_000).prop_map(Wait::Ms),
        1 => (-1i64..=1).prop_map(Wait::RetryAfter),
        1 => (1u64..30).prop_map(Wait::Back),
    ];
    prop::collection::vec(
        (
            wait,
            prop::collection::vec((reserving_strategy(), 0usize..2), 1..5),
        ),
        1..30,
    )
}

/// The model's answers to `batches`: per batch its time and, per step, what to send (a
/// release as its adjustment) and the decision.
#[allow(clippy::type_complexity)]
fn model_reserving(
    limits: &[Limit],
    batches: &[(Wait, Vec<(Reserving, usize)>)],
) -> Vec<(u64, Vec<(Option<tollgate::Adjustment>, Decision)>)> {
    let mut states: [Vec<State>; 2] =
        std::array::from_fn(|_| limits.iter().map(|l| State::new(l.algorithm())).collect());
    let mut reserved: [Vec<(u32, u64)>; 2] = Default::default();
    let mut now = START;
    let mut previous: Option<Decision> = None;
    let mut out = Vec::new();
    for (wait, ops) in batches {
        now = next_now(now, *wait, previous.as_ref());
        let mut decided = Vec::new();
        for &(op, key) in ops {
            let (adjustment, decision) = match op {
                Reserving::Check(cost) => {
                    (None, algorithm::check(&mut states[key], limits, now, cost))
                }
                Reserving::Reserve(cost, max) => {
                    let d = algorithm::check_reserving(&mut states[key], limits, now, cost, max);
                    if d.wait_ms() > 0 && cost > 0 {
                        reserved[key].push((cost, now));
                    }
                    (None, d)
                }
                Reserving::Release => {
                    let (units, at) = reserved[key].pop().unwrap_or((1, now));
                    let a = tollgate::Adjustment::Refund {
                        units,
                        charged_at_ms: at,
                    };
                    (Some(a), algorithm::adjust(&mut states[key], limits, now, a))
                }
                Reserving::TopUp(units) => {
                    let a = tollgate::Adjustment::TopUp { units };
                    (Some(a), algorithm::adjust(&mut states[key], limits, now, a))
                }
            };
            previous = Some(decision.clone());
            decided.push((adjustment, decision));
        }
        out.push((now, decided));
    }
    out
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 200, ..ProptestConfig::default() })]

    /// Reservations (`Store::reserve`) decide like the model's `check_reserving`, mixed
    /// with plain checks, releases and top-ups in one script call (coalesced) and alone,
    /// also when the clock steps back and with a fixed window among the limits.
    #[test]
    fn lua_reserves_like_the_model(
        limits in reserve_limits_strategy(),
        batches in reserving_batches_strategy(),
    ) {
        let expected = model_reserving(&limits, &batches);
        let runtime = tokio::runtime::Builder::new_current_thread().enable_all().build().unwrap();
        runtime.block_on(async {
            let clock = ManualClock::new(START);
            let store = case_store(&clock, false).await;
            let keys = [Key::new("a"), Key::new("b")];
            for ((_, ops), (now, want)) in batches.iter().zip(&expected) {
                clock.set(*now);
                let calls: Vec<_> = ops
                    .iter()
                    .zip(want)
                    .map(|(&(op, key), (adjustment, _))| match (op, adjustment) {
                        (Reserving::Check(cost), _) => store.check(&keys[key], &limits, cost),
                        (Reserving::Reserve(cost, max), _) => {
                            store.reserve(&keys[key], &limits, cost, max)
                        }
                        (_, Some(a)) => store.adjust(&keys[key], &limits, *a),
                        (_, None) => unreachable!("an adjustment without one"),
                    })
                    .collect();
                let got = futures_util::future::join_all(calls).await;
                for ((op, (_, want)), got) in ops.iter().zip(want).zip(got) {
                    let got = got.env()?;
                    prop_assert_eq!(&got, want, "{:?} at {} in {:?} with {:?}", op, now, batches, limits);
                }
            }
            Ok(())
        })?;
    }

    /// A reservation is exactly the request arriving at its time: the requests allowed
    /// (reserved or at once) on one key, replayed on a fresh state at the times they run
    /// (`now + wait`, in that order), are every one allowed; and a reservation is made
    /// whenever every limit reserves and the wait is within the bound. (Clock forward
    /// only: a step back makes the times of a run overlap.)
    #[test]
    fn a_reservation_is_the_request_arriving_when_it_runs(
        limits in reserve_limits_strategy(),
        steps in prop::collection::vec((0u64..400, 0u32..8, prop_oneof![1u64..50, 1u64..5_000]), 1..60),
    ) {
        let mut states: Vec<State> = limits.iter().map(|l| State::new(l.algorithm())).collect();
        let mut now = START;
        let mut runs = Vec::new();
        let reserves = limits
            .iter()
            .all(|l| matches!(l.algorithm(), Algorithm::TokenBucket | Algorithm::Gcra));
        for &(wait, cost, max) in &steps {
            now += wait;
            let before = states.clone();
            let d = algorithm::check_reserving(&mut states, &limits, now, cost, max);
            if d.is_allowed() {
                runs.push((now + d.wait_ms(), cost));
                prop_assert!(d.wait_ms() <= max);
                prop_assert!(reserves || d.wait_ms() == 0);
            } else {
                prop_assert_eq!(&states, &before, "a denial changes nothing");
                let plain = algorithm::peek(&before, &limits, now, cost);
                let fits_in = plain.retry_after().as_millis() as u64;
                let capacity_ok = limits.iter().all(|l| cost <= l.capacity());
                prop_assert!(
                    !(reserves && capacity_ok && fits_in <= max),
                    "denied though it could reserve {} <= {}", fits_in, max
                );
            }
        }
        runs.sort_by_key(|&(t, _)| t);
        let mut replay: Vec<State> = limits.iter().map(|l| State::new(l.algorithm())).collect();
        for &(t, cost) in &runs {
            let d = algorithm::check(&mut replay, &limits, t, cost);
            prop_assert!(d.is_allowed(), "a run at {} of cost {} in {:?} with {:?}", t, cost, runs, limits);
        }
    }
}
