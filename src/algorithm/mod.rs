//! The reference model: every algorithm as a pure state transition.
//!
//! **Not API.** This module is the specification the stores are tested against, public
//! only so that the crate's integration tests and benches can run it; it is hidden from
//! the docs and may change in any release. The algorithms themselves are chosen with
//! [`Algorithm`](crate::Algorithm) and [`Limit`].
//!
//! `(state, now, limit, cost) -> (state', decision)`, with no I/O and no clock reads. The
//! in-memory store runs this model; the Lua functions in `lua/` implement the same
//! integer arithmetic, and the conformance tests hold the two equal decision by decision.
//!
//! All arithmetic is on integers. Time is whole milliseconds; the bucket algorithms count
//! in units of `1 / window_ms` of a token, so that refilling `limit` tokens per window is
//! exactly `limit` units per millisecond: nothing is ever rounded. [`Limit`]'s validation
//! keeps every intermediate value below 2^53, where Lua's doubles are exact.
//!
//! Each decision happens in two steps: every limit of a request is asked whether the cost
//! *fits*, and only when all of them say yes is it *committed* to each. Denied requests
//! consume nothing.
//!
//! `now` may step back: replicas whose clocks differ by a few milliseconds share one
//! Redis, and a clock given with `with_clock` may be adjusted. A step back never grants
//! budget: a window that has started stays the one counted into, a bucket does not
//! refill, an arrival time never moves back, and a log entry is never written before
//! the newest one. And a state changes only when a request is allowed (the script writes
//! a key only then), so that a denied request from a clock ahead leaves nothing behind
//! that a clock behind would read differently.
//!
//! ```
//! use std::time::Duration;
//! use tollgate::{Limit, algorithm::{self, State}};
//!
//! let limits = [Limit::fixed_window(2, Duration::from_secs(1))?];
//! let mut states = [State::new(limits[0].algorithm())];
//! assert!(algorithm::check(&mut states, &limits, 0, 1).is_allowed());
//! assert!(algorithm::check(&mut states, &limits, 10, 1).is_allowed());
//! let denied = algorithm::check(&mut states, &limits, 20, 1);
//! assert!(!denied.is_allowed());
//! assert_eq!(denied.retry_after(), Duration::from_millis(980));
//! # Ok::<(), tollgate::ConfigError>(())
//! ```

mod fixed_window;
mod gcra;
pub mod in_flight;
pub mod lease;
mod lockout;
mod sliding_window;
mod sliding_window_counter;
mod token_bucket;

pub use fixed_window::FixedWindow;
pub use gcra::Gcra;
pub use lockout::{Pending, check_with_lockouts, check_with_pending, settle_pending};
pub use sliding_window::SlidingWindow;
pub use sliding_window_counter::SlidingWindowCounter;
pub use token_bucket::TokenBucket;

use smallvec::SmallVec;

use crate::{Adjustment, Algorithm, Decision, Limit, LimitDecision, decision::LimitDecisions};

/// The state one algorithm keeps for one key and limit. `State::new` is the state of a key
/// that does not exist yet.
#[derive(Debug, Clone, PartialEq, Eq)]
#[allow(missing_docs)]
pub enum State {
    FixedWindow(FixedWindow),
    /// Boxed: its log would make every other state as large.
    SlidingWindow(Box<SlidingWindow>),
    SlidingWindowCounter(SlidingWindowCounter),
    TokenBucket(TokenBucket),
    Gcra(Gcra),
}

/// The questions the driver asks each algorithm. `now` is in milliseconds, `cost` in
/// requests; all of them assume [`normalize`](Model::normalize) ran first at `now`.
pub(crate) trait Model {
    /// Brings the state to `now` without changing any decision at `now` or later
    /// (refills, rolls windows). [`check`] undoes it when the request is denied.
    fn normalize(&mut self, now: u64, limit: &Limit);
    /// Whether `cost` fits now.
    fn fits(&self, now: u64, limit: &Limit, cost: u64) -> bool;
    /// Milliseconds until `cost` fits (only asked when it does not, and `cost` is at most
    /// the limit's capacity).
    fn wait(&self, now: u64, limit: &Limit, cost: u64) -> u64;
    /// Consumes `cost`.
    fn commit(&mut self, now: u64, limit: &Limit, cost: u64);
    /// Whole units left.
    fn remaining(&self, now: u64, limit: &Limit) -> u64;
    /// Milliseconds until the limit is fully restored.
    fn reset_after(&self, now: u64, limit: &Limit) -> u64;
    /// When the state is worth nothing more than a missing key (its TTL).
    fn expires_at(&self, limit: &Limit) -> u64;
    /// Gives back `units` charged by a decision made at `at`, to the state they were
    /// charged to, if it is still there; never more than the state holds.
    fn refund(&mut self, now: u64, limit: &Limit, units: u64, at: u64);
    /// Charges `units` already spent, even when they do not fit; each algorithm bounds
    /// the debt it keeps.
    fn top_up(&mut self, now: u64, limit: &Limit, units: u64);
    /// Whether `cost` may be [reserved](reserve) here at `now`: only states that can
    /// hold units spent in the future (the token bucket's debt, GCRA's arrival time ahead).
    fn can_reserve(&self, now: u64) -> bool {
        let _ = now;
        false
    }
    /// Commits `cost` exactly as a request arriving `wait` ms after `now` would (only
    /// asked when [`can_reserve`](Self::can_reserve) and `wait` refills at most one
    /// capacity).
    fn reserve(&mut self, now: u64, limit: &Limit, cost: u64, wait: u64) {
        let _ = wait;
        self.commit(now, limit, cost);
    }
}

macro_rules! dispatch {
    ($self:expr, $s:ident => $body:expr) => {
        match $self {
            State::FixedWindow($s) => $body,
            State::SlidingWindow($s) => $body,
            State::SlidingWindowCounter($s) => $body,
            State::TokenBucket($s) => $body,
            State::Gcra($s) => $body,
        }
    };
}

impl State {
    /// The state of a key not seen yet.
    pub fn new(algorithm: Algorithm) -> Self {
        match algorithm {
            Algorithm::FixedWindow => Self::FixedWindow(FixedWindow::default()),
            Algorithm::SlidingWindow => Self::SlidingWindow(Box::default()),
            Algorithm::SlidingWindowCounter => {
                Self::SlidingWindowCounter(SlidingWindowCounter::default())
            }
            Algorithm::TokenBucket => Self::TokenBucket(TokenBucket::default()),
            Algorithm::Gcra => Self::Gcra(Gcra::default()),
        }
    }

    /// The algorithm this state belongs to.
    pub fn algorithm(&self) -> Algorithm {
        match self {
            Self::FixedWindow(_) => Algorithm::FixedWindow,
            Self::SlidingWindow(_) => Algorithm::SlidingWindow,
            Self::SlidingWindowCounter(_) => Algorithm::SlidingWindowCounter,
            Self::TokenBucket(_) => Algorithm::TokenBucket,
            Self::Gcra(_) => Algorithm::Gcra,
        }
    }

    /// The time (ms) from which this state decides exactly like a missing key, so that a
    /// store may forget it: the TTL the Redis script sets.
    pub fn expires_at(&self, limit: &Limit) -> u64 {
        Model::expires_at(self, limit)
    }

    /// What a denied request must leave behind: the state before [`Model::normalize`]
    /// (`None`: normalizing changes nothing). The script writes a key only when a request
    /// is allowed, so a window rolled or a bucket refilled for a denied request is not
    /// kept there: a clock that then steps back must find the same state here. (The log
    /// does not normalize at all, and is never copied.)
    fn kept_on_denial(&self) -> Option<Self> {
        match self {
            Self::SlidingWindow(_) | Self::Gcra(_) => None,
            other => Some(other.clone()),
        }
    }
}

/// [`Model`] by a `match` on the variant rather than through a trait object, so that each
/// algorithm's arithmetic can be inlined into [`check`].
impl Model for State {
    #[inline]
    fn normalize(&mut self, now: u64, limit: &Limit) {
        dispatch!(self, s => s.normalize(now, limit));
    }

    #[inline]
    fn fits(&self, now: u64, limit: &Limit, cost: u64) -> bool {
        dispatch!(self, s => s.fits(now, limit, cost))
    }

    #[inline]
    fn wait(&self, now: u64, limit: &Limit, cost: u64) -> u64 {
        dispatch!(self, s => s.wait(now, limit, cost))
    }

    #[inline]
    fn commit(&mut self, now: u64, limit: &Limit, cost: u64) {
        dispatch!(self, s => s.commit(now, limit, cost));
    }

    // Always: called once per limit of every decision, and small once the algorithm is
    // known (left out of line, it cost a decision ~10 instructions).
    #[inline(always)]
    fn remaining(&self, now: u64, limit: &Limit) -> u64 {
        dispatch!(self, s => s.remaining(now, limit))
    }

    #[inline(always)]
    fn reset_after(&self, now: u64, limit: &Limit) -> u64 {
        dispatch!(self, s => s.reset_after(now, limit))
    }

    #[inline]
    fn expires_at(&self, limit: &Limit) -> u64 {
        dispatch!(self, s => s.expires_at(limit))
    }

    fn refund(&mut self, now: u64, limit: &Limit, units: u64, at: u64) {
        dispatch!(self, s => s.refund(now, limit, units, at));
    }

    fn top_up(&mut self, now: u64, limit: &Limit, units: u64) {
        dispatch!(self, s => s.top_up(now, limit, units));
    }

    fn can_reserve(&self, now: u64) -> bool {
        dispatch!(self, s => s.can_reserve(now))
    }

    fn reserve(&mut self, now: u64, limit: &Limit, cost: u64, wait: u64) {
        dispatch!(self, s => s.reserve(now, limit, cost, wait));
    }
}

/// Applies `adjustment` to every limit's state at `now` (ms): units given back after a
/// request (a refund), or charged late (a top-up). The decision is the state after it:
/// every limit allowed, with its `remaining` and `reset_after`.
///
/// What each algorithm does:
/// - a refund returns units to the state they were charged to, and does nothing once that
///   state is gone: the same fixed window (or sliding-window-counter window, current or
///   previous), the log entry written at [`Decision::decided_at_ms`], tokens back into
///   the bucket (at most its capacity), the GCRA arrival time moved back (never before
///   now). It never gives back more than was charged.
/// - a [settle](Adjustment::Settle) is the refund or top-up of the difference (nothing
///   when the request keeps what it was charged); the pending units it ends live beside
///   the lockout ([`settle_pending`]), not in the states.
/// - a top-up is counted even over the limit: windowed algorithms count at most their
///   limit in a window (the debt ends with the window); the token bucket goes down to
///   minus its capacity, the arrival time up to twice the tolerance ahead (one burst of
///   debt, then refilled at the usual rate).
///
/// # Panics
///
/// As [`check`].
pub fn adjust(
    states: &mut [State],
    limits: &[Limit],
    now: u64,
    adjustment: Adjustment,
) -> Decision {
    assert_eq!(states.len(), limits.len(), "one state per limit");
    let moved = adjustment.to_states();
    let decisions = states
        .iter_mut()
        .zip(limits)
        .map(|(state, limit)| {
            assert_eq!(
                state.algorithm(),
                limit.algorithm(),
                "state of another algorithm"
            );
            // A settle that moves nothing writes nothing (as the script saves nothing):
            // its answer is read from a copy.
            let mut unchanged;
            let state = if moved.is_some() {
                state
            } else {
                unchanged = state.clone();
                &mut unchanged
            };
            state.normalize(now, limit);
            match moved {
                Some(Adjustment::Refund {
                    units,
                    charged_at_ms,
                }) => {
                    state.refund(now, limit, u64::from(units), charged_at_ms);
                }
                Some(Adjustment::TopUp { units }) => {
                    state.top_up(now, limit, u64::from(units));
                }
                _ => {}
            }
            LimitDecision {
                allowed: true,
                limit: limit.limit(),
                remaining: state.remaining(now, limit),
                reset_after_ms: state.reset_after(now, limit),
                retry_after_ms: 0,
            }
        })
        .collect();
    Decision::from_limits(decisions).decided_at(now)
}

/// Decides one request of `cost` against `limits` at `now` (ms), all-or-nothing, and
/// updates `states` (one per limit, same order) only when every limit has room.
///
/// # Panics
///
/// When `states` and `limits` differ in length or a state belongs to another algorithm
/// than its limit: both are bugs in the caller.
pub fn check(states: &mut [State], limits: &[Limit], now: u64, cost: u32) -> Decision {
    assert_eq!(states.len(), limits.len(), "one state per limit");
    let cost = u64::from(cost);
    if let ([state], [limit]) = (&mut *states, limits) {
        return check_one(state, limit, now, cost);
    }
    let mut decisions = LimitDecisions::new();
    let mut before: SmallVec<[Option<State>; 2]> = SmallVec::new();
    for (state, limit) in states.iter_mut().zip(limits) {
        before.push(state.kept_on_denial());
        let (fits, retry_after_ms) = judge(state, limit, now, cost);
        decisions.push(LimitDecision {
            allowed: fits,
            limit: limit.limit(),
            remaining: 0,
            reset_after_ms: 0,
            retry_after_ms,
        });
    }
    let all_fit = decisions.iter().all(|d| d.allowed);
    for ((state, limit), decision) in states.iter_mut().zip(limits).zip(&mut decisions) {
        if all_fit {
            state.commit(now, limit, cost);
        }
        decision.remaining = state.remaining(now, limit);
        decision.reset_after_ms = state.reset_after(now, limit);
    }
    if !all_fit {
        for (state, before) in states.iter_mut().zip(before) {
            if let Some(before) = before {
                *state = before;
            }
        }
    }
    Decision::from_limits(decisions).decided_at(now)
}

/// [`check`], reserving where the algorithms allow it: a request that does not fit now
/// but would in `wait` ms, `0 < wait <= max_wait_ms`, is allowed *with that wait*
/// ([`Decision::wait`]), and its units are counted now exactly as if it had arrived
/// `wait` ms later; later requests queue behind it. Nobody can take those units
/// meanwhile, so the caller sleeps `wait` and then runs the request without asking again.
///
/// Only the token bucket and GCRA reserve: the bucket by going into debt, GCRA by moving
/// its arrival time further ahead, by at most what refills in `max_wait_ms` (and at most
/// 2^51 units of `1 / window_ms` of a request, so that all stays exact). A request
/// reserves only when every one of its limits can (all-or-nothing): a fixed or sliding
/// window, a log or a lockout among them, a clock that stepped back behind a bucket's
/// last refill, or a wait beyond `max_wait_ms` make it the plain denial of [`check`].
/// (A window cannot hold units for a later window without counting them in the wrong
/// one, and the log would need an entry in the future that the sliding window would
/// count too early.)
///
/// # Panics
///
/// As [`check`].
pub fn check_reserving(
    states: &mut [State],
    limits: &[Limit],
    now: u64,
    cost: u32,
    max_wait_ms: u64,
) -> Decision {
    assert_eq!(states.len(), limits.len(), "one state per limit");
    let cost = u64::from(cost);
    let mut before: SmallVec<[Option<State>; 2]> = SmallVec::new();
    let mut judged: SmallVec<[(bool, u64); 2]> = SmallVec::new();
    for (state, limit) in states.iter_mut().zip(limits) {
        before.push(state.kept_on_denial());
        judged.push(judge(state, limit, now, cost));
    }
    let all_fit = judged.iter().all(|&(fits, _)| fits);
    let wait = if all_fit {
        0
    } else {
        reservation(states, limits, &judged, now, cost, max_wait_ms)
    };
    let mut decisions = LimitDecisions::new();
    for ((state, limit), &(fits, retry_after_ms)) in states.iter_mut().zip(limits).zip(&judged) {
        if all_fit {
            state.commit(now, limit, cost);
        } else if wait > 0 {
            state.reserve(now, limit, cost, wait);
        }
        decisions.push(LimitDecision {
            allowed: fits || wait > 0,
            limit: limit.limit(),
            remaining: state.remaining(now, limit),
            reset_after_ms: state.reset_after(now, limit),
            retry_after_ms: if wait > 0 { 0 } else { retry_after_ms },
        });
    }
    if !all_fit && wait == 0 {
        for (state, before) in states.iter_mut().zip(before) {
            if let Some(before) = before {
                *state = before;
            }
        }
    }
    Decision::from_limits(decisions)
        .with_wait(wait)
        .decided_at(now)
}

/// The most a reservation may hold ahead, in a limit's scaled units (`wait * limit`):
/// with the state's own capacity (below 2^50) every value stays below 2^53, exact in
/// the script's doubles.
pub(crate) const MAX_RESERVED: u64 = 1 << 51;

/// Whether a request under `limits` can ever be reserved: every limit a token bucket or
/// a GCRA, none with a lockout.
pub(crate) fn reservable(limits: &[Limit]) -> bool {
    limits.iter().all(|l| {
        matches!(l.algorithm(), Algorithm::TokenBucket | Algorithm::Gcra) && l.lockout_ms() == 0
    })
}

/// The wait a request that does not fit now may reserve (see [`check_reserving`]), 0 when
/// it may not.
fn reservation(
    states: &[State],
    limits: &[Limit],
    judged: &[(bool, u64)],
    now: u64,
    cost: u64,
    max_wait_ms: u64,
) -> u64 {
    let wait = judged.iter().map(|&(_, retry)| retry).max().unwrap_or(0);
    if wait == 0 || wait > max_wait_ms {
        return 0;
    }
    if !reservable(limits) {
        return 0;
    }
    let reservable = states.iter().zip(limits).all(|(state, limit)| {
        cost <= u64::from(limit.capacity())
            && state.can_reserve(now)
            && wait.saturating_mul(u64::from(limit.limit())) <= MAX_RESERVED
    });
    if reservable { wait } else { 0 }
}

/// The decision [`check`] would make, with `states` left as they are: what a store's
/// `peek` answers. `remaining` is what the request would leave (cost 0: what is left).
///
/// # Panics
///
/// As [`check`].
pub fn peek(states: &[State], limits: &[Limit], now: u64, cost: u32) -> Decision {
    check(&mut states.to_vec(), limits, now, cost)
}

/// [`peek`] for limits with lockouts: the decision
/// [`check_with_lockouts`] would give, with the blocks as they are in `blocked_until`
/// (one per limit, 0: none); neither the states nor the blocks change, so a peek that
/// would be denied starts no block.
pub fn peek_with_lockouts(
    states: &[State],
    blocked_until: &[u64],
    limits: &[Limit],
    now: u64,
    cost: u32,
) -> Decision {
    check_with_lockouts(
        &mut states.to_vec(),
        &mut blocked_until.to_vec(),
        limits,
        now,
        cost,
    )
}

/// [`peek_with_lockouts`] with the pending units of [`check_with_pending`]: nothing
/// changes, the pending records included.
pub fn peek_with_pending(
    states: &[State],
    blocked_until: &[u64],
    pending: &[Pending],
    limits: &[Limit],
    now: u64,
    cost: u32,
) -> Decision {
    check_with_pending(
        &mut states.to_vec(),
        &mut blocked_until.to_vec(),
        &mut pending.to_vec(),
        limits,
        now,
        cost,
    )
}

/// [`check`] for the usual single limit: the same steps, without the list of states to
/// restore that several limits need (pushing, zipping and dropping it cost a request
/// about 150 instructions).
#[inline]
fn check_one(state: &mut State, limit: &Limit, now: u64, cost: u64) -> Decision {
    let before = state.kept_on_denial();
    let (fits, retry_after_ms) = judge(state, limit, now, cost);
    if fits {
        state.commit(now, limit, cost);
    }
    let decision = LimitDecision {
        allowed: fits,
        limit: limit.limit(),
        remaining: state.remaining(now, limit),
        reset_after_ms: state.reset_after(now, limit),
        retry_after_ms,
    };
    if let (false, Some(before)) = (fits, before) {
        *state = before;
    }
    let mut decisions = LimitDecisions::new();
    decisions.push(decision);
    Decision::from_limits(decisions).decided_at(now)
}

/// One limit's part of a decision: brings `state` up to `now`, then says whether `cost`
/// fits and, if not, how long until it would (nothing is committed).
#[inline(always)]
fn judge(state: &mut State, limit: &Limit, now: u64, cost: u64) -> (bool, u64) {
    assert_eq!(
        state.algorithm(),
        limit.algorithm(),
        "state of another algorithm"
    );
    state.normalize(now, limit);
    let fits = cost <= u64::from(limit.capacity()) && state.fits(now, limit, cost);
    let retry_after_ms = if fits {
        0
    } else if cost > u64::from(limit.capacity()) {
        // Never fits: report one window, the longest any limit asks anyone to wait.
        limit.window_ms()
    } else {
        state.wait(now, limit, cost)
    };
    (fits, retry_after_ms)
}

/// `ceil(a / b)` for `b > 0`.
#[inline]
pub(crate) fn div_ceil(a: u64, b: u64) -> u64 {
    a.div_ceil(b)
}

#[cfg(test)]
mod tests;
