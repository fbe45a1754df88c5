use std::time::Duration;

use super::*;

pub(super) fn run(limit: &Limit, steps: &[(u64, u32)]) -> Vec<LimitDecision> {
    let limits = std::slice::from_ref(limit);
    let mut states = [State::new(limit.algorithm())];
    steps
        .iter()
        .map(|&(now, cost)| check(&mut states, limits, now, cost).limits()[0])
        .collect()
}

#[test]
fn multi_limit_is_all_or_nothing() {
    let per_second = Limit::fixed_window(10, Duration::from_secs(1)).unwrap();
    let per_hour = Limit::fixed_window(3, Duration::from_secs(3600)).unwrap();
    let limits = [per_second, per_hour];
    let mut states = limits.clone().map(|l| State::new(l.algorithm()));
    for i in 0..3 {
        assert!(check(&mut states, &limits, i, 1).is_allowed());
    }
    let denied = check(&mut states, &limits, 3, 1);
    assert!(!denied.is_allowed());
    // The hourly limit denied it, so the per-second one was not charged.
    assert_eq!(denied.limits()[0].remaining, 7);
    assert!(denied.limits()[0].allowed);
    assert!(!denied.limits()[1].allowed);
    assert_eq!(denied.limits()[1].retry_after_ms, 3_600_000 - 3);
}

#[test]
fn a_denied_request_leaves_the_state_as_it_found_it() {
    // One limit and two, so that both paths of `check` keep the step-back fix.
    let bucket = Limit::token_bucket(10, Duration::from_secs(1)).unwrap();
    let window = Limit::fixed_window(10, Duration::from_secs(1)).unwrap();
    for limits in [vec![bucket.clone()], vec![bucket, window]] {
        let mut states: Vec<State> = limits.iter().map(|l| State::new(l.algorithm())).collect();
        assert!(check(&mut states, &limits, 0, 10).is_allowed());
        let used = states.clone();
        // Denied later (more than the capacity), then from a clock half a window
        // behind: neither may find the bucket refilled or the window rolled.
        assert!(!check(&mut states, &limits, 1500, 11).is_allowed());
        assert!(!check(&mut states, &limits, 500, 10).is_allowed());
        assert_eq!(states, used, "{limits:?}");
    }
}

/// One limit's decisions for steps that are either checks `(now, cost)` or
/// adjustments.
fn adjusted(limit: &Limit, steps: &[(u64, Result<u32, Adjustment>)]) -> Vec<LimitDecision> {
    let limits = std::slice::from_ref(limit);
    let mut states = [State::new(limit.algorithm())];
    steps
        .iter()
        .map(|&(now, step)| match step {
            Ok(cost) => check(&mut states, limits, now, cost).limits()[0],
            Err(adjustment) => adjust(&mut states, limits, now, adjustment).limits()[0],
        })
        .collect()
}

fn refund(units: u32, charged_at_ms: u64) -> Result<u32, Adjustment> {
    Err(Adjustment::Refund {
        units,
        charged_at_ms,
    })
}

fn top_up(units: u32) -> Result<u32, Adjustment> {
    Err(Adjustment::TopUp { units })
}

#[test]
fn a_refund_goes_to_the_window_it_was_charged_to() {
    let limit = Limit::fixed_window(3, Duration::from_secs(1)).unwrap();
    let d = adjusted(
        &limit,
        &[
            (100, Ok(3)),
            (200, refund(2, 100)),
            (1100, Ok(3)),
            (1200, refund(3, 100)),
        ],
    );
    assert_eq!(d[1].remaining, 2);
    // Charged in the window from 0, refunded in the one from 1000: nothing.
    assert_eq!(d[3].remaining, 0);
    // The counter's previous window still weighs, and takes the refund.
    let limit = Limit::sliding_window_counter(4, Duration::from_secs(1)).unwrap();
    let d = adjusted(
        &limit,
        &[(900, Ok(4)), (1500, refund(4, 900)), (1500, Ok(4))],
    );
    assert_eq!(d[1].remaining, 4);
    assert!(d[2].allowed);
}

#[test]
fn a_refund_takes_from_its_own_log_entry() {
    let limit = Limit::sliding_window(4, Duration::from_secs(1)).unwrap();
    let d = adjusted(
        &limit,
        &[
            (0, Ok(2)),
            (100, Ok(2)),
            (200, refund(2, 0)),
            (300, Ok(2)),
            (1000, Ok(2)),
            (1099, Ok(1)),
        ],
    );
    assert_eq!(d[2].remaining, 2);
    assert!(d[3].allowed);
    // The units at 0 are gone; those at 100 and 300 still count until 1100.
    assert!(!d[4].allowed);
    assert_eq!(d[4].retry_after_ms, 100);
    assert!(!d[5].allowed);
}

#[test]
fn top_ups_leave_a_bounded_debt() {
    // 10 tokens per second, one every 100 ms.
    let bucket = Limit::token_bucket(10, Duration::from_secs(1)).unwrap();
    let gcra = Limit::gcra(10, Duration::from_secs(1)).unwrap();
    for limit in [bucket, gcra] {
        let d = adjusted(
            &limit,
            &[
                (0, Ok(4)),
                (0, top_up(10)),
                (0, Ok(1)),
                (0, top_up(1000)),
                (0, Ok(1)),
            ],
        );
        // 10 - 4 - 10 = -4: one token is 5 refills away.
        assert_eq!(d[2].retry_after_ms, 500, "{limit:?}");
        assert_eq!(d[1].remaining, 0);
        // At most one capacity of debt: a token 11 refills away.
        assert_eq!(d[4].retry_after_ms, 1100, "{limit:?}");
    }
    // A window counts at most its limit: the debt ends with the window.
    let window = Limit::fixed_window(10, Duration::from_secs(1)).unwrap();
    let d = adjusted(&window, &[(0, top_up(1000)), (999, Ok(1)), (1000, Ok(10))]);
    assert_eq!(d[1].retry_after_ms, 1);
    assert!(d[2].allowed);
}

#[test]
fn gcra_refunds_never_move_the_arrival_time_before_now() {
    let limit = Limit::gcra(10, Duration::from_secs(1)).unwrap();
    let d = adjusted(
        &limit,
        &[
            (0, Ok(10)),
            (500, refund(100, 0)),
            (500, Ok(10)),
            (500, Ok(1)),
        ],
    );
    assert_eq!(d[1].remaining, 10);
    assert!(d[2].allowed);
    assert!(!d[3].allowed);
    assert_eq!(d[3].retry_after_ms, 100);
}

#[test]
fn cost_above_capacity_is_denied_for_one_window() {
    let limit = Limit::token_bucket(5, Duration::from_secs(1)).unwrap();
    let d = run(&limit, &[(0, 6)]);
    assert!(!d[0].allowed);
    assert_eq!(d[0].retry_after_ms, 1000);
    assert_eq!(d[0].remaining, 5);
}

#[test]
fn token_bucket_and_gcra_decide_alike() {
    let tb = Limit::token_bucket(7, Duration::from_millis(900))
        .unwrap()
        .with_burst(3)
        .unwrap();
    let gcra = Limit::gcra(7, Duration::from_millis(900))
        .unwrap()
        .with_burst(3)
        .unwrap();
    let mut now = 5_000;
    let steps: Vec<(u64, u32)> = (0..500u64)
        .map(|i| {
            now += (i * 37) % 211;
            (now, (i % 3) as u32 + 1)
        })
        .collect();
    assert_eq!(run(&tb, &steps), run(&gcra, &steps));
}
