//! The reference model of leased quota: what the script grants a node beside a request,
//! and how unspent units go back.
//!
//! A lease is pre-paid: the units are counted (taken from the bucket) in the same step
//! that decides a real request, so a node that spends them later (or never) can only
//! under-admit.
//! - fixed window: a lease belongs to the window it was granted in; "at most `limit` per
//!   aligned window" holds whoever spends the units; units of a window that ended are
//!   worthless and are never spent in the next one.
//! - sliding-window counter: the same, and units counted into the current window are also
//!   within the estimate at any later moment of that window (the previous window's weight
//!   only shrinks), so spending them later keeps the estimate within `limit`.
//! - token bucket and GCRA: a lease lasts one window. The long-run rate is exact (every
//!   unit spent was taken from the bucket first); any interval of length `t` admits at
//!   most `burst + limit * t / window` plus what the leases held at its start, since
//!   those units were taken earlier and are spent later. Units go back as tokens (never
//!   beyond the bucket), resp. by moving the arrival time back (never before now).
//! - The sliding-window log is never leased: a unit logged at grant time but spent later
//!   would leave the log (and free its room) before the request it stands for is a window
//!   old, so "at most `limit` in any interval" would break.
//!
//! The script (`lua/lease.lua`) mirrors [`grant`] and [`give_back`]; the property tests
//! hold them equal.
//!
//! ```
//! use std::time::Duration;
//! use tollgate::{Limit, algorithm::{self, State, lease}};
//!
//! let limits = [Limit::fixed_window(100, Duration::from_secs(1))?];
//! let mut states = [State::new(limits[0].algorithm())];
//! assert!(algorithm::check(&mut states, &limits, 1_250, 1).is_allowed());
//! // 99 left: at most half of them are granted.
//! let grant = lease::grant(&mut states, &limits, 1_250, 80);
//! assert_eq!((grant.units, grant.ms_left, grant.starts[0]), (49, 750, 1_000));
//! lease::give_back(&mut states, &limits, 1_260, &grant.starts, 49);
//! assert_eq!(algorithm::check(&mut states, &limits, 1_300, 99).limits()[0].remaining, 0);
//! # Ok::<(), tollgate::ConfigError>(())
//! ```

use smallvec::SmallVec;

use super::{Model, State};
use crate::{Algorithm, Limit};

/// Whether units of `algorithm` may be leased.
pub fn leasable(algorithm: Algorithm) -> bool {
    !matches!(algorithm, Algorithm::SlidingWindow)
}

/// Whether `limit` may be leased: a leasable algorithm and no lockout (a lease spent
/// locally could not see a block start, so a locked-out key could get through).
pub fn limit_leasable(limit: &Limit) -> bool {
    leasable(limit.algorithm()) && limit.lockout_ms() == 0
}

/// What [`grant`] gave.
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub struct Grant {
    /// Units granted, from every limit alike (0: none).
    pub units: u64,
    /// Milliseconds until the lease ends: the earliest end of its limits' windows (a
    /// bucket's lease lasts one window).
    pub ms_left: u64,
    /// Each limit's window start: what a return names the window by (0 for a bucket).
    pub starts: SmallVec<[u64; 2]>,
}

/// Grants up to `asked` units beside a request that was just allowed at `now` (the
/// states as [`check`](super::check) left them): at most half of what each limit has
/// left, so that leases shrink as the budget runs out and the last units go to requests
/// one by one. The same number of units from every limit, or none: a lease is spent
/// all-or-nothing like a request. Nothing is granted when a limit is not
/// [`limit_leasable`].
pub fn grant(states: &mut [State], limits: &[Limit], now: u64, asked: u64) -> Grant {
    let mut units = asked;
    let mut ms_left = u64::MAX;
    let mut starts = SmallVec::new();
    for (state, limit) in states.iter().zip(limits) {
        let (start, ends) = match state {
            State::FixedWindow(s) => (s.start(), s.start() + limit.window_ms() - now),
            State::SlidingWindowCounter(s) => (s.start(), s.start() + limit.window_ms() - now),
            State::TokenBucket(_) | State::Gcra(_) => (0, limit.window_ms()),
            State::SlidingWindow(_) => {
                units = 0;
                (0, 0)
            }
        };
        if limit.lockout_ms() > 0 {
            units = 0;
        }
        units = units.min(state.remaining(now, limit) / 2);
        ms_left = ms_left.min(ends);
        starts.push(start);
    }
    if units > 0 {
        for (state, limit) in states.iter_mut().zip(limits) {
            state.commit(now, limit, units);
        }
    }
    Grant {
        units,
        ms_left: if ms_left == u64::MAX { 0 } else { ms_left },
        starts,
    }
}

/// Takes back at `now` `units` leased in the windows starting at `starts` (one per
/// limit), where that window still counts: a fixed window only while it lasts, a
/// sliding-window counter's also while it is the previous window (elsewhere the units are
/// worthless and nothing changes); a bucket gets them back as tokens.
pub fn give_back(states: &mut [State], limits: &[Limit], now: u64, starts: &[u64], units: u64) {
    for ((state, limit), &start) in states.iter_mut().zip(limits).zip(starts) {
        match state {
            State::FixedWindow(s) => s.give_back(start, units),
            State::SlidingWindowCounter(s) => s.give_back(start, limit.window_ms(), units),
            State::TokenBucket(s) => s.give_back(now, limit, units),
            State::Gcra(s) => s.give_back(now, limit, units),
            State::SlidingWindow(_) => {}
        }
    }
}
