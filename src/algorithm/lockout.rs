//! Lockouts ([`Limit::with_lockout`]): after a limit denies a key, the key is blocked for a
//! set time. Algorithm-agnostic: the block is one number per key and limit, the time it
//! ends, and it wraps whatever the algorithm decides. `lua/lockout.lua` mirrors this.

use smallvec::SmallVec;

use super::{Model, State, judge};
use crate::{Decision, Limit, LimitDecision, decision::LimitDecisions};

/// [`check`](super::check) with lockouts: `blocked_until` holds, per limit (same order),
/// the time (ms) its block on this key ends, 0 when there is none; it is updated when a
/// request starts a block.
///
/// - A limit whose block has time left at `now` denies the request; its `retry_after` is
///   the time left, or the algorithm's own wait when longer (so that the same request is
///   allowed exactly then, instead of starting a new block). A block keeps the end it was
///   given when the lockout changes (a clock that stepped back sees it end no earlier:
///   `retry_after` stays exact), and a limit whose lockout was removed ignores it.
/// - A denied request that such a limit denied (not only another limit) and that found
///   it unblocked starts a block of the full lockout at `now`. A request during a block
///   does not extend it.
/// - The limits that block (or just blocked) report `remaining` 0 and a `reset_after`
///   of at least the time left.
/// - Limits without a lockout ignore their entry, and everything else is exactly
///   [`check`](super::check): all-or-nothing, and a denied request consumes nothing.
///
/// ```
/// use std::time::Duration;
/// use tollgate::{Limit, algorithm::{self, State}};
///
/// let limits = [Limit::fixed_window(1, Duration::from_secs(1))?
///     .with_lockout(Duration::from_secs(60))?];
/// let mut states = [State::new(limits[0].algorithm())];
/// let mut blocked_until = [0];
/// assert!(algorithm::check_with_lockouts(&mut states, &mut blocked_until, &limits, 0, 1).is_allowed());
/// // The second request breaches the limit: blocked for a minute from now.
/// let denied = algorithm::check_with_lockouts(&mut states, &mut blocked_until, &limits, 10, 1);
/// assert_eq!(denied.retry_after(), Duration::from_secs(60));
/// // The window has rolled, but the block stands, and is not extended.
/// let still = algorithm::check_with_lockouts(&mut states, &mut blocked_until, &limits, 30_010, 1);
/// assert_eq!(still.retry_after(), Duration::from_secs(30));
/// assert!(algorithm::check_with_lockouts(&mut states, &mut blocked_until, &limits, 60_010, 1).is_allowed());
/// # Ok::<(), tollgate::ConfigError>(())
/// ```
///
/// # Panics
///
/// When `states`, `blocked_until` and `limits` differ in length or a state belongs to
/// another algorithm than its limit: bugs in the caller.
pub fn check_with_lockouts(
    states: &mut [State],
    blocked_until: &mut [u64],
    limits: &[Limit],
    now: u64,
    cost: u32,
) -> Decision {
    assert_eq!(states.len(), limits.len(), "one state per limit");
    assert_eq!(blocked_until.len(), limits.len(), "one block per limit");
    let cost = u64::from(cost);
    let mut decisions = LimitDecisions::new();
    let mut before: SmallVec<[Option<State>; 2]> = SmallVec::new();
    for ((state, limit), &until) in states.iter_mut().zip(limits).zip(&*blocked_until) {
        before.push(state.kept_on_denial());
        let (mut fits, mut retry_after_ms) = judge(state, limit, now, cost);
        let left = time_left(until, limit, now);
        if left > 0 {
            fits = false;
            retry_after_ms = retry_after_ms.max(left);
        }
        decisions.push(LimitDecision {
            allowed: fits,
            limit: limit.limit(),
            remaining: 0,
            reset_after_ms: 0,
            retry_after_ms,
        });
    }
    let all_fit = decisions.iter().all(|d| d.allowed);
    let mut blocked_ms = 0;
    for (((state, limit), until), decision) in states
        .iter_mut()
        .zip(limits)
        .zip(blocked_until.iter_mut())
        .zip(&mut decisions)
    {
        if all_fit {
            state.commit(now, limit, cost);
        }
        decision.remaining = state.remaining(now, limit);
        decision.reset_after_ms = state.reset_after(now, limit);
        let lockout = limit.lockout_ms();
        if lockout > 0 && !decision.allowed {
            let mut left = time_left(*until, limit, now);
            if left == 0 {
                *until = now + lockout;
                left = lockout;
            }
            decision.remaining = 0;
            decision.retry_after_ms = decision.retry_after_ms.max(left);
            decision.reset_after_ms = decision.reset_after_ms.max(left);
            blocked_ms = if blocked_ms == 0 {
                left
            } else {
                blocked_ms.min(left)
            };
        }
    }
    if !all_fit {
        for (state, before) in states.iter_mut().zip(before) {
            if let Some(before) = before {
                *state = before;
            }
        }
    }
    Decision::from_limits(decisions)
        .blocked_for(blocked_ms)
        .decided_at(now)
}

/// Milliseconds left at `now` on a block that ends at `until` (0 when the limit has no
/// lockout: removing a lockout ends its blocks).
#[inline]
fn time_left(until: u64, limit: &Limit, now: u64) -> u64 {
    if limit.lockout_ms() == 0 {
        return 0;
    }
    until.saturating_sub(now)
}

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use super::*;
    use crate::algorithm::check;

    fn locked(limit: Limit, lockout_ms: u64) -> Limit {
        limit
            .with_lockout(Duration::from_millis(lockout_ms))
            .unwrap()
    }

    #[test]
    fn a_breach_blocks_for_the_lockout_and_requests_do_not_extend_it() {
        let limit = locked(
            Limit::fixed_window(2, Duration::from_secs(1)).unwrap(),
            5_000,
        );
        let limits = [limit];
        let mut states = [State::new(limits[0].algorithm())];
        let mut until = [0];
        let mut at = |now, cost| check_with_lockouts(&mut states, &mut until, &limits, now, cost);
        assert!(at(0, 1).is_allowed());
        assert!(at(1, 1).is_allowed());
        let breach = at(2, 1);
        assert!(!breach.is_allowed());
        assert_eq!(breach.limits()[0].retry_after_ms, 5_000);
        assert_eq!(breach.limits()[0].remaining, 0);
        assert_eq!(breach.limits()[0].reset_after_ms, 5_000);
        // A new window, a cheaper request: still blocked, for the time left only.
        let during = at(3_000, 0);
        assert!(!during.is_allowed());
        assert_eq!(during.limits()[0].retry_after_ms, 2_002);
        assert!(!at(5_001, 1).is_allowed());
        assert!(at(5_002, 1).is_allowed());
    }

    #[test]
    fn without_a_breach_it_decides_like_check() {
        let limits = [
            locked(
                Limit::token_bucket(10, Duration::from_secs(1)).unwrap(),
                10_000,
            ),
            Limit::fixed_window(2, Duration::from_millis(300)).unwrap(),
        ];
        let mut a: Vec<State> = limits.iter().map(|l| State::new(l.algorithm())).collect();
        let mut b = a.clone();
        let mut until = [0, 0];
        // The fixed window denies, the bucket never does: no block.
        for now in [0, 10, 20, 30, 310, 320, 330, 700] {
            assert_eq!(
                check_with_lockouts(&mut a, &mut until, &limits, now, 1),
                check(&mut b, &limits, now, 1)
            );
        }
        assert_eq!(until, [0, 0]);
    }

    #[test]
    fn a_longer_wait_than_the_block_is_reported() {
        // A window far longer than the lockout: retry_after is the window's, so that a
        // client that waits it out does not breach again.
        let limits = [locked(
            Limit::fixed_window(1, Duration::from_secs(60)).unwrap(),
            1_000,
        )];
        let mut states = [State::new(limits[0].algorithm())];
        let mut until = [0];
        assert!(check_with_lockouts(&mut states, &mut until, &limits, 0, 1).is_allowed());
        let d = check_with_lockouts(&mut states, &mut until, &limits, 100, 1);
        assert_eq!(d.limits()[0].retry_after_ms, 59_900);
        assert_eq!(until, [1_100]);
    }

    #[test]
    fn a_removed_lockout_ends_running_blocks_a_changed_one_keeps_them() {
        let long = locked(
            Limit::fixed_window(1, Duration::from_secs(1)).unwrap(),
            60_000,
        );
        let short = locked(
            Limit::fixed_window(1, Duration::from_secs(1)).unwrap(),
            2_000,
        );
        let none = Limit::fixed_window(1, Duration::from_secs(1)).unwrap();
        let mut states = [State::new(long.algorithm())];
        let mut until = [0];
        for now in [0, 1] {
            check_with_lockouts(&mut states, &mut until, std::slice::from_ref(&long), now, 1);
        }
        assert_eq!(until, [60_001]);
        let d = check_with_lockouts(&mut states, &mut until, &[short], 1_500, 1);
        assert_eq!(d.limits()[0].retry_after_ms, 58_501);
        assert_eq!(d.blocked_ms(), 58_501);
        assert!(check_with_lockouts(&mut states, &mut until, &[none], 1_500, 1).is_allowed());
    }
}
