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
    let mut pending: SmallVec<[Pending; 2]> = limits.iter().map(|_| Pending::default()).collect();
    check_with_pending(states, blocked_until, &mut pending, limits, now, cost)
}

/// The units of one lockout limit's requests that are still *pending* (allowed, counted,
/// but not settled yet: their responses are not there), for a limit whose lockout counts
/// them apart ([`Limit::pending_until_settled`]): the units charged in the window that
/// starts at `start` (aligned, `now - now % window`) and those charged in the window
/// before it. The window is the limit's, for every algorithm.
///
/// Pending units stop mattering with their window (a fixed window's with its own, the
/// others' one window later): the record expires at [`expires_at`](Self::expires_at)
/// (its TTL in Redis), and a request in flight longer than that counts as kept from
/// then on (the strict side).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Pending {
    /// The window start of the newest charge.
    pub start: u64,
    /// Units pending from the window at `start`.
    pub current: u64,
    /// Units pending from the window before it.
    pub previous: u64,
}

impl Pending {
    /// The pending units that still count at `now` toward what `limit` holds: the
    /// current window's, and for every algorithm but the fixed window (whose previous
    /// window is over), the previous window's too.
    pub fn live(&self, now: u64, limit: &Limit) -> u64 {
        let window = limit.window_ms();
        let at = now - now % window;
        let fixed = limit.algorithm() == crate::Algorithm::FixedWindow;
        // A clock a little behind the newest charge's sees that charge's window.
        if at <= self.start {
            self.current + if fixed { 0 } else { self.previous }
        } else if at == self.start + window && !fixed {
            self.current
        } else {
            0
        }
    }

    /// Counts `units` charged at `now` as pending.
    pub fn add(&mut self, now: u64, limit: &Limit, units: u64) {
        let window = limit.window_ms();
        let at = now - now % window;
        if at > self.start {
            self.previous = if at == self.start + window {
                self.current
            } else {
                0
            };
            self.current = 0;
            self.start = at;
        }
        self.current += units;
    }

    /// Ends `units` charged at `at` being pending (their request was settled): nothing
    /// once their window is no longer held, never more than is held.
    pub fn release(&mut self, limit: &Limit, units: u64, at: u64) {
        let window = limit.window_ms();
        let charged = at - at % window;
        if charged == self.start {
            self.current -= units.min(self.current);
        } else if charged.saturating_add(window) == self.start {
            self.previous -= units.min(self.previous);
        }
    }

    /// When the record is worth nothing more than none (0: it holds nothing).
    pub fn expires_at(&self, limit: &Limit) -> u64 {
        if self.current == 0 && self.previous == 0 {
            0
        } else {
            self.start + 2 * limit.window_ms()
        }
    }

    /// [`live`](Self::live) on a record that may have expired at `now`.
    fn live_at(&self, now: u64, limit: &Limit) -> u64 {
        if self.expires_at(limit) <= now {
            0
        } else {
            self.live(now, limit)
        }
    }
}

/// [`check_with_lockouts`] where the limits with [`Limit::pending_until_settled`] count
/// the units of the requests they allow as pending in `pending` (one per limit, same
/// order; the others ignore theirs) until [`settle_pending`] ends them, and a request
/// such a limit denies starts a block only when the units **kept** breach it: when the
/// request would be denied with the pending units given back. A request denied only
/// because of requests still in flight is a plain denial (its `retry_after` the
/// algorithm's), and starts no block.
///
/// # Panics
///
/// As [`check_with_lockouts`], and when `pending` differs from `limits` in length.
pub fn check_with_pending(
    states: &mut [State],
    blocked_until: &mut [u64],
    pending: &mut [Pending],
    limits: &[Limit],
    now: u64,
    cost: u32,
) -> Decision {
    assert_eq!(states.len(), limits.len(), "one state per limit");
    assert_eq!(blocked_until.len(), limits.len(), "one block per limit");
    assert_eq!(pending.len(), limits.len(), "one pending record per limit");
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
    for ((((state, limit), until), decision), pending) in states
        .iter_mut()
        .zip(limits)
        .zip(blocked_until.iter_mut())
        .zip(&mut decisions)
        .zip(pending.iter_mut())
    {
        if all_fit {
            state.commit(now, limit, cost);
            if limit.pending() {
                pending.add(now, limit, cost);
            }
        }
        decision.remaining = state.remaining(now, limit);
        decision.reset_after_ms = state.reset_after(now, limit);
        let lockout = limit.lockout_ms();
        if lockout > 0 && !decision.allowed {
            let mut left = time_left(*until, limit, now);
            if left == 0 {
                if limit.pending() && kept_fit(state, limit, now, cost, pending.live_at(now, limit))
                {
                    // Denied because of requests in flight: no block.
                    continue;
                }
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
    // When it was decided: what a refund of its charge names (counting after the response).
    Decision::from_limits(decisions)
        .blocked_for(blocked_ms)
        .decided_at(now)
}

/// Whether `cost` would fit `state` (normalized at `now`, nothing committed) with
/// `pending` units given back: whether the units kept leave room for it.
fn kept_fit(state: &State, limit: &Limit, now: u64, cost: u64, pending: u64) -> bool {
    if cost <= pending {
        return true;
    }
    cost <= u64::from(limit.capacity()) && state.fits(now, limit, cost - pending)
}

/// Ends the pending units of a settled request (see [`check_with_pending`]): `charged`
/// units charged at `charged_at_ms` (an [`Adjustment::Settle`](crate::Adjustment::Settle)'s),
/// in the record of every limit with [`Limit::pending_until_settled`].
///
/// # Panics
///
/// When `pending` and `limits` differ in length.
pub fn settle_pending(pending: &mut [Pending], limits: &[Limit], charged: u32, charged_at_ms: u64) {
    assert_eq!(pending.len(), limits.len(), "one pending record per limit");
    for (pending, limit) in pending.iter_mut().zip(limits) {
        if limit.pending() {
            pending.release(limit, u64::from(charged), charged_at_ms);
        }
    }
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

    /// Units in flight fill the limit but start no block; once kept, they do.
    #[test]
    fn pending_units_deny_without_a_block_until_kept() {
        let limits = [locked(
            Limit::fixed_window(2, Duration::from_secs(1)).unwrap(),
            5_000,
        )
        .pending_until_settled()];
        let mut states = [State::new(limits[0].algorithm())];
        let mut until = [0];
        let mut pending = [Pending::default()];
        let mut at = |now, cost, pending: &mut [Pending]| {
            check_with_pending(&mut states, &mut until, pending, &limits, now, cost)
        };
        assert!(at(0, 1, &mut pending).is_allowed());
        assert!(at(1, 1, &mut pending).is_allowed());
        assert_eq!(pending[0].live(2, &limits[0]), 2);
        let denied = at(2, 1, &mut pending);
        assert!(!denied.is_allowed());
        assert_eq!(denied.blocked_ms(), 0);
        assert_eq!(denied.limits()[0].retry_after_ms, 998);
        // One is kept, one is still in flight: the kept one leaves room, no block.
        settle_pending(&mut pending, &limits, 1, 0);
        assert_eq!(at(3, 1, &mut pending).blocked_ms(), 0);
        // Both kept: the breach blocks for the lockout.
        settle_pending(&mut pending, &limits, 1, 1);
        assert_eq!(pending[0].live(4, &limits[0]), 0);
        let breach = at(4, 1, &mut pending);
        assert_eq!(breach.blocked_ms(), 5_000);
    }

    /// A record keeps the current and the previous window; a fixed window counts only
    /// the current one, the others both; settling a unit of an older window changes
    /// nothing.
    #[test]
    fn pending_units_follow_their_windows() {
        let fixed = Limit::fixed_window(10, Duration::from_secs(1))
            .unwrap()
            .with_lockout(Duration::from_secs(1))
            .unwrap()
            .pending_until_settled();
        let bucket = Limit::token_bucket(10, Duration::from_secs(1))
            .unwrap()
            .with_lockout(Duration::from_secs(1))
            .unwrap()
            .pending_until_settled();
        let mut p = Pending::default();
        p.add(100, &fixed, 2);
        p.add(1_100, &fixed, 3);
        assert_eq!((p.start, p.current, p.previous), (1_000, 3, 2));
        assert_eq!(p.live(1_200, &fixed), 3);
        assert_eq!(p.live(1_200, &bucket), 5);
        assert_eq!(p.live(2_000, &bucket), 3);
        assert_eq!(p.live(3_000, &bucket), 0);
        assert_eq!(p.expires_at(&bucket), 3_000);
        p.release(&fixed, 1, 100);
        p.release(&fixed, 9, 1_500);
        assert_eq!((p.current, p.previous), (0, 1));
        p.add(3_100, &fixed, 1);
        assert_eq!((p.start, p.current, p.previous), (3_000, 1, 0));
        // Charged two windows back: no longer held.
        p.release(&fixed, 1, 1_500);
        assert_eq!((p.current, p.previous), (1, 0));
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
