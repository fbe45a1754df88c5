use super::Model;
use crate::Limit;

/// Sliding window counter: the previous aligned window's count, weighted by the part of
/// it that still overlaps a window ending now, plus the current window's count.
///
/// Scaled by the window length so that the weighting stays in integers: the estimate is
/// `previous * (window - elapsed) + current * window`, compared with `limit * window`.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct SlidingWindowCounter {
    start: u64,
    /// Counts never exceed the limit (a `u32`): kept as such, the state is 16 bytes.
    current: u32,
    previous: u32,
}

impl SlidingWindowCounter {
    fn estimate(&self, now: u64, window: u64) -> u64 {
        let elapsed = self.elapsed(now);
        u64::from(self.previous) * (window - elapsed) + u64::from(self.current) * window
    }

    /// Milliseconds into the counted window (0 before it: the clock stepped back).
    fn elapsed(&self, now: u64) -> u64 {
        now.saturating_sub(self.start)
    }

    /// Milliseconds until the counted window starts (the clock stepped back behind it):
    /// until then the state stays as it is at the window's start.
    fn lag(&self, now: u64) -> u64 {
        self.start.saturating_sub(now)
    }
}

impl SlidingWindowCounter {
    /// The start of the counted window.
    pub(super) fn start(&self) -> u64 {
        self.start
    }

    /// Takes back `units` counted into the window that starts at `start`: from the current
    /// count while that window is the counted one, from the previous count once it is the
    /// previous one (it still weighs on this window), not at all later (see
    /// [`lease`](super::lease)).
    pub(super) fn give_back(&mut self, start: u64, window: u64, units: u64) {
        let units = u32::try_from(units).unwrap_or(u32::MAX);
        if self.start == start {
            self.current = self.current.saturating_sub(units);
        } else if self.start == start + window {
            self.previous = self.previous.saturating_sub(units);
        }
    }
}

impl Model for SlidingWindowCounter {
    fn normalize(&mut self, now: u64, limit: &Limit) {
        let window = limit.window_ms();
        let start = now - now % window;
        // Only a later window rolls. A clock that stepped back into an earlier window
        // keeps counting into the latest one: starting that earlier window again would
        // hand out its budget a second time.
        if start <= self.start {
            return;
        }
        self.previous = if self.start + window == start {
            self.current
        } else {
            0
        };
        self.current = 0;
        self.start = start;
    }

    fn fits(&self, now: u64, limit: &Limit, cost: u64) -> bool {
        let window = limit.window_ms();
        self.estimate(now, window) + cost * window <= u64::from(limit.limit()) * window
    }

    fn wait(&self, now: u64, limit: &Limit, cost: u64) -> u64 {
        let window = limit.window_ms();
        let limit = u64::from(limit.limit());
        let (current, previous) = (u64::from(self.current), u64::from(self.previous));
        let left_in_window = window - self.elapsed(now);
        let lag = self.lag(now);
        // Later in this window, as the previous window's weight shrinks?
        if previous > 0 && current + cost <= limit {
            let room = (limit - cost - current) * window / previous;
            if room >= 1 {
                return lag + left_in_window - room;
            }
        }
        // In the next window, where this window's count becomes the weighted one.
        if current == 0 {
            return lag + left_in_window;
        }
        let room = ((limit - cost) * window / current).min(window);
        lag + left_in_window + (window - room)
    }

    fn commit(&mut self, _now: u64, _limit: &Limit, cost: u64) {
        // Committed only when `current + cost` fits the limit, a `u32`.
        self.current += u32::try_from(cost).expect("a committed cost fits the limit");
    }

    fn remaining(&self, now: u64, limit: &Limit) -> u64 {
        let window = limit.window_ms();
        (u64::from(limit.limit()) * window).saturating_sub(self.estimate(now, window)) / window
    }

    fn reset_after(&self, now: u64, limit: &Limit) -> u64 {
        let left_in_window = self.lag(now) + limit.window_ms() - self.elapsed(now);
        if self.current > 0 {
            left_in_window + limit.window_ms()
        } else if self.previous > 0 {
            left_in_window
        } else {
            0
        }
    }

    fn expires_at(&self, limit: &Limit) -> u64 {
        self.start + 2 * limit.window_ms()
    }

    /// Into the window the units were charged to: the current one, or the previous one
    /// once the window rolled (where they still weigh); nothing once it is older.
    fn refund(&mut self, _now: u64, limit: &Limit, units: u64, at: u64) {
        let window = limit.window_ms();
        let charged = at - at % window;
        let units = u32::try_from(units).unwrap_or(u32::MAX);
        if self.start == charged {
            self.current -= units.min(self.current);
        } else if self.start == charged.saturating_add(window) {
            self.previous -= units.min(self.previous);
        }
    }

    /// Counted even over the limit, but a window never counts more than its limit.
    fn top_up(&mut self, _now: u64, limit: &Limit, units: u64) {
        let units = u32::try_from(units).unwrap_or(u32::MAX);
        self.current = self
            .current
            .max(self.current.saturating_add(units).min(limit.limit()));
    }
}

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use crate::{Limit, algorithm::tests::run};

    #[test]
    fn weights_the_previous_window() {
        let limit = Limit::sliding_window_counter(10, Duration::from_millis(100)).unwrap();
        // Ten in the first window; a quarter into the next, 7.5 still count.
        let mut steps: Vec<(u64, u32)> = (0..10).map(|i| (i, 1)).collect();
        steps.extend([(125, 1), (125, 1), (125, 1), (126, 1)]);
        let d = run(&limit, &steps);
        let allowed: Vec<bool> = d[10..].iter().map(|d| d.allowed).collect();
        // 7.5 + 1 + 1 = 9.5 fits, 10.5 does not.
        assert_eq!(allowed, [true, true, false, false]);
        // At 126: 10 * 74 + 2 * 100 + 100 = 1040 > 1000; the weight must fall to 700:
        // previous * (100 - e) <= 700 -> e >= 30, at 130.
        assert_eq!(d[13].retry_after_ms, 4);
    }

    #[test]
    fn retry_moves_into_the_next_window_when_needed() {
        let limit = Limit::sliding_window_counter(2, Duration::from_millis(100)).unwrap();
        let d = run(&limit, &[(50, 1), (60, 1), (70, 1)]);
        assert!(!d[2].allowed);
        // Next window: previous = 2, need 2 * (100 - e) <= 100 -> e >= 50, at 150.
        assert_eq!(d[2].retry_after_ms, 80);
        assert_eq!(d[1].reset_after_ms, 140);
    }

    #[test]
    fn a_clock_that_steps_back_counts_into_the_latest_window() {
        let limit = Limit::sliding_window_counter(3, Duration::from_millis(100)).unwrap();
        // Two at 99, one at 100 (the two weigh fully: full), then a clock 5 ms behind:
        // still the window from 100, still full.
        let d = run(&limit, &[(99, 1), (99, 1), (100, 1), (95, 1), (95, 0)]);
        let allowed: Vec<bool> = d.iter().map(|d| d.allowed).collect();
        assert_eq!(allowed, [true, true, true, false, true]);
        // At 95, as at 100: 2 * (100 - e) + 100 + 100 <= 300 -> e >= 50, at 150.
        assert_eq!(d[3].retry_after_ms, 55);
        assert_eq!(d[4].reset_after_ms, 205);
    }
}
