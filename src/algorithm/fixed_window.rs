use super::Model;
use crate::Limit;

/// Fixed window: a counter for the current window. Windows are aligned to multiples of
/// the window length since the Unix epoch (`start = now - now % window`), so every replica
/// and the Redis script agree on where a window begins. A request from before the
/// counted window (a clock that stepped back) is counted into it.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct FixedWindow {
    start: u64,
    count: u64,
}

impl FixedWindow {
    /// The start of the counted window.
    pub(super) fn start(&self) -> u64 {
        self.start
    }

    /// Takes back `units` counted into the window that starts at `start`, if it is still
    /// the counted one (a lease's unspent units; see [`lease`](super::lease)).
    pub(super) fn give_back(&mut self, start: u64, units: u64) {
        if self.start == start {
            self.count = self.count.saturating_sub(units);
        }
    }
}

impl Model for FixedWindow {
    fn normalize(&mut self, now: u64, limit: &Limit) {
        let start = now - now % limit.window_ms();
        // Only a later window starts afresh. A clock that stepped back into an earlier
        // window keeps counting into the latest one: starting that earlier window again
        // at zero would hand out its budget a second time.
        if start > self.start {
            self.start = start;
            self.count = 0;
        }
    }

    fn fits(&self, _now: u64, limit: &Limit, cost: u64) -> bool {
        self.count + cost <= u64::from(limit.limit())
    }

    fn wait(&self, now: u64, limit: &Limit, _cost: u64) -> u64 {
        self.start + limit.window_ms() - now
    }

    fn commit(&mut self, _now: u64, _limit: &Limit, cost: u64) {
        self.count += cost;
    }

    fn remaining(&self, _now: u64, limit: &Limit) -> u64 {
        u64::from(limit.limit()).saturating_sub(self.count)
    }

    fn reset_after(&self, now: u64, limit: &Limit) -> u64 {
        if self.count == 0 {
            0
        } else {
            self.start + limit.window_ms() - now
        }
    }

    fn expires_at(&self, limit: &Limit) -> u64 {
        self.start + limit.window_ms()
    }

    /// Only into the window the units were charged to, while it is the counted one.
    fn refund(&mut self, _now: u64, limit: &Limit, units: u64, at: u64) {
        if self.start == at - at % limit.window_ms() {
            self.count -= units.min(self.count);
        }
    }

    /// Counted even over the limit, but a window never counts more than its limit: the
    /// debt ends with the window.
    fn top_up(&mut self, _now: u64, limit: &Limit, units: u64) {
        self.count = self.count.max(
            self.count
                .saturating_add(units)
                .min(u64::from(limit.limit())),
        );
    }
}

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use crate::{Limit, algorithm::tests::run};

    #[test]
    fn lets_twice_the_limit_through_across_a_boundary() {
        let limit = Limit::fixed_window(3, Duration::from_secs(1)).unwrap();
        let steps = [
            (997, 1),
            (998, 1),
            (999, 1),
            (1000, 1),
            (1001, 1),
            (1002, 1),
            (1003, 1),
        ];
        let allowed: Vec<bool> = run(&limit, &steps).iter().map(|d| d.allowed).collect();
        assert_eq!(allowed, [true, true, true, true, true, true, false]);
    }

    #[test]
    fn a_clock_that_steps_back_counts_into_the_latest_window() {
        let limit = Limit::fixed_window(2, Duration::from_secs(1)).unwrap();
        let d = run(
            &limit,
            &[(999, 1), (1000, 1), (998, 1), (999, 1), (1500, 1)],
        );
        let allowed: Vec<bool> = d.iter().map(|d| d.allowed).collect();
        assert_eq!(allowed, [true, true, true, false, false]);
        // Denied at 999: the window counted into ends at 2000.
        assert_eq!(d[3].retry_after_ms, 1001);
    }

    #[test]
    fn retry_after_is_the_end_of_the_window() {
        let limit = Limit::fixed_window(1, Duration::from_secs(1)).unwrap();
        let d = run(
            &limit,
            &[(10_250, 1), (10_400, 1), (10_999, 1), (11_000, 1)],
        );
        assert_eq!(d[1].retry_after_ms, 600);
        assert_eq!(d[1].remaining, 0);
        assert_eq!(d[2].retry_after_ms, 1);
        assert!(d[3].allowed);
        assert_eq!(d[0].reset_after_ms, 750);
    }
}
