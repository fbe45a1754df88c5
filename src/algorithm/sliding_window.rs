use std::collections::VecDeque;

use super::Model;
use crate::Limit;

/// Sliding window log: the time of every request still inside the window, so that at
/// most `limit` fall in *any* interval of `window`. An entry at `t` counts while
/// `now - t < window`.
///
/// A clock that steps back must not find less than a later clock left behind, so the log
/// changes only when a request is allowed (as the script writes only then): entries that
/// have left the window are dropped on the next write, not when a request merely looks
/// (a denied request at a later time would otherwise drop entries that a clock a little
/// behind still counts). A request from a clock behind is logged at the newest entry's
/// time (it stays in the window longer, never shorter), so entries stay in the order they
/// were written: the script keeps running totals of units in that order.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct SlidingWindow {
    /// `(time, units)`, oldest first; one element per millisecond that had requests.
    entries: VecDeque<(u64, u64)>,
    /// The units of all `entries`, including those that have left the window.
    count: u64,
}

impl SlidingWindow {
    /// The entries that have left the window at `now` (a prefix): how many, and their
    /// units. Usually none: every write drops them.
    fn gone(&self, now: u64, window: u64) -> (usize, u64) {
        let mut gone = (0, 0);
        for &(at, units) in &self.entries {
            if at + window > now {
                break;
            }
            gone = (gone.0 + 1, gone.1 + units);
        }
        gone
    }

    /// The units still in the window at `now`.
    fn live(&self, now: u64, window: u64) -> u64 {
        self.count - self.gone(now, window).1
    }
}

impl Model for SlidingWindow {
    /// Nothing: the log changes only when a request is allowed.
    fn normalize(&mut self, _now: u64, _limit: &Limit) {}

    fn fits(&self, now: u64, limit: &Limit, cost: u64) -> bool {
        self.live(now, limit.window_ms()) + cost <= u64::from(limit.limit())
    }

    fn wait(&self, now: u64, limit: &Limit, cost: u64) -> u64 {
        let window = limit.window_ms();
        let (skip, _) = self.gone(now, window);
        // The oldest `live + cost - limit` units must leave the window first.
        let must_expire = self.live(now, window) + cost - u64::from(limit.limit());
        let mut seen = 0;
        for &(at, units) in self.entries.iter().skip(skip) {
            seen += units;
            if seen >= must_expire {
                return at + window - now;
            }
        }
        window
    }

    fn commit(&mut self, now: u64, limit: &Limit, cost: u64) {
        if cost == 0 {
            return;
        }
        let (gone, units) = self.gone(now, limit.window_ms());
        self.entries.drain(..gone);
        self.count = self.count - units + cost;
        match self.entries.back_mut() {
            Some((newest, units)) if *newest >= now => *units += cost,
            _ => self.entries.push_back((now, cost)),
        }
    }

    fn remaining(&self, now: u64, limit: &Limit) -> u64 {
        u64::from(limit.limit()).saturating_sub(self.live(now, limit.window_ms()))
    }

    fn reset_after(&self, now: u64, limit: &Limit) -> u64 {
        self.entries.back().map_or(0, |&(newest, _)| {
            (newest + limit.window_ms()).saturating_sub(now)
        })
    }

    fn expires_at(&self, limit: &Limit) -> u64 {
        self.entries
            .back()
            .map_or(0, |&(newest, _)| newest + limit.window_ms())
    }

    /// Out of the entry logged at `at`, while it is in the window. An entry left with no
    /// units goes, unless it is the log's only one (the script never empties a key,
    /// which would delete it: see `save` in the Lua).
    fn refund(&mut self, now: u64, limit: &Limit, units: u64, at: u64) {
        if at.saturating_add(limit.window_ms()) <= now {
            return;
        }
        let Some(index) = self.entries.iter().position(|&(t, _)| t == at) else {
            return;
        };
        let taken = units.min(self.entries[index].1);
        if taken == 0 {
            // An entry already emptied (kept as the only one) stays as it is.
            return;
        }
        self.entries[index].1 -= taken;
        self.count -= taken;
        if self.entries[index].1 == 0 && self.entries.len() > 1 {
            self.entries.remove(index);
        }
    }

    /// Logged now as a request would be, but the window never holds more than the limit.
    fn top_up(&mut self, now: u64, limit: &Limit, units: u64) {
        let room = u64::from(limit.limit()).saturating_sub(self.live(now, limit.window_ms()));
        self.commit(now, limit, units.min(room));
    }
}

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use crate::{Limit, algorithm::tests::run};

    #[test]
    fn no_burst_across_a_boundary() {
        let limit = Limit::sliding_window(3, Duration::from_secs(1)).unwrap();
        let steps = [
            (997, 1),
            (998, 1),
            (999, 1),
            (1000, 1),
            (1996, 1),
            (1997, 1),
        ];
        let d = run(&limit, &steps);
        let allowed: Vec<bool> = d.iter().map(|d| d.allowed).collect();
        assert_eq!(allowed, [true, true, true, false, false, true]);
        // The oldest entry (997) leaves the window at 1997.
        assert_eq!(d[3].retry_after_ms, 997);
        assert_eq!(d[4].retry_after_ms, 1);
    }

    #[test]
    fn retry_after_counts_the_cost() {
        let limit = Limit::sliding_window(4, Duration::from_millis(100)).unwrap();
        let d = run(&limit, &[(0, 1), (10, 1), (20, 2), (30, 3)]);
        // 4 units used; 3 more need the first three units (at 0, 10, 20) gone: at 120.
        assert!(!d[3].allowed);
        assert_eq!(d[3].retry_after_ms, 90);
    }

    #[test]
    fn a_denied_request_drops_nothing_a_clock_behind_still_counts() {
        let limit = Limit::sliding_window(2, Duration::from_millis(100)).unwrap();
        // Full at 50; a clock ahead is denied at 150 (the entry has left its window
        // there), then a clock behind, at 120, still counts it.
        let d = run(&limit, &[(50, 2), (150, 3), (120, 1), (150, 1)]);
        let allowed: Vec<bool> = d.iter().map(|d| d.allowed).collect();
        assert_eq!(allowed, [true, false, false, true]);
        assert_eq!(d[2].retry_after_ms, 30);
        assert_eq!(d[1].remaining, 2);
    }

    #[test]
    fn a_clock_that_steps_back_logs_at_the_newest_entry() {
        let limit = Limit::sliding_window(2, Duration::from_millis(100)).unwrap();
        let d = run(&limit, &[(50, 1), (40, 1), (149, 1), (150, 1)]);
        let allowed: Vec<bool> = d.iter().map(|d| d.allowed).collect();
        // The unit at 40 was logged at 50: both leave at 150.
        assert_eq!(allowed, [true, true, false, true]);
        assert_eq!(d[1].reset_after_ms, 110);
        assert_eq!(d[2].retry_after_ms, 1);
    }
}
