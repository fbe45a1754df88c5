use super::Model;
use crate::Limit;

/// GCRA: one theoretical arrival time (TAT). A request of cost `c` fits when pushing the
/// TAT by `c` emission intervals keeps it within `burst` intervals of now.
///
/// The emission interval is `window / limit` milliseconds, rarely a whole number, so the
/// TAT is kept exactly as `tat + frac / limit` ms (`frac < limit`), and distances are
/// scaled by `limit`: `burst` intervals are `burst * window` scaled units. It decides
/// exactly like [`TokenBucket`](super::TokenBucket) while storing one timestamp.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Gcra {
    tat: u64,
    frac: u64,
}

impl Gcra {
    fn tolerance(limit: &Limit) -> u64 {
        u64::from(limit.burst()) * limit.window_ms()
    }

    /// How far the TAT is ahead of now, scaled by `limit`, at most the tolerance. (Beyond
    /// it only after the clock stepped back, which the saturating product covers without
    /// a division: this runs several times per decision.)
    fn ahead(&self, now: u64, limit: &Limit) -> u64 {
        if self.tat < now {
            return 0;
        }
        let ahead_ms = self.tat - now;
        ahead_ms
            .saturating_mul(u64::from(limit.limit()))
            .saturating_add(self.frac)
            .min(Self::tolerance(limit))
    }
}

impl Gcra {
    /// Moves the TAT back by `units` emission intervals (a lease's unspent units), never
    /// before `now`; not at all when the TAT is more than the tolerance ahead (the clock
    /// stepped back), where the capped distance would move it back further (see
    /// [`lease`](super::lease)).
    pub(super) fn give_back(&mut self, now: u64, limit: &Limit, units: u64) {
        let limit_per_window = u64::from(limit.limit());
        if self.tat < now || self.tat - now > Self::tolerance(limit).div_ceil(limit_per_window) {
            return;
        }
        let ahead = self
            .ahead(now, limit)
            .saturating_sub(units * limit.window_ms());
        self.tat = now + ahead / limit_per_window;
        self.frac = ahead % limit_per_window;
    }
}

impl Model for Gcra {
    fn normalize(&mut self, _now: u64, _limit: &Limit) {}

    fn fits(&self, now: u64, limit: &Limit, cost: u64) -> bool {
        self.ahead(now, limit) + cost * limit.window_ms() <= Self::tolerance(limit)
    }

    fn wait(&self, now: u64, limit: &Limit, cost: u64) -> u64 {
        // ceil(((tat - now) * limit + frac - room) / limit), split so that it stays exact
        // (and needs no cap) when the TAT is more than the tolerance ahead, after the
        // clock stepped back. The request does not fit, so the TAT is ahead of now.
        let room = Self::tolerance(limit) - cost * limit.window_ms();
        let ahead_ms = self.tat - now;
        if self.frac > room {
            ahead_ms + 1
        } else {
            ahead_ms - (room - self.frac) / u64::from(limit.limit())
        }
    }

    fn commit(&mut self, now: u64, limit: &Limit, cost: u64) {
        // Nothing to add. (Writing `now + ahead` back would move the TAT back when the
        // clock stepped back: `ahead` is capped at the tolerance.)
        if cost == 0 {
            return;
        }
        let ahead = self.ahead(now, limit) + cost * limit.window_ms();
        self.tat = now + ahead / u64::from(limit.limit());
        self.frac = ahead % u64::from(limit.limit());
    }

    fn remaining(&self, now: u64, limit: &Limit) -> u64 {
        (Self::tolerance(limit) - self.ahead(now, limit)) / limit.window_ms()
    }

    fn reset_after(&self, now: u64, _limit: &Limit) -> u64 {
        // ceil(((tat - now) * limit + frac) / limit), exact also beyond the tolerance.
        if self.tat < now {
            0
        } else {
            self.tat - now + u64::from(self.frac > 0)
        }
    }

    fn expires_at(&self, _limit: &Limit) -> u64 {
        self.tat + u64::from(self.frac > 0)
    }

    /// The TAT moves back by `units` intervals, never before now (a full bucket).
    fn refund(&mut self, now: u64, limit: &Limit, units: u64, _at: u64) {
        if self.tat < now {
            return;
        }
        let scale = u64::from(limit.limit());
        // As the token bucket: no refund gives back more than two capacities.
        let back = units.min(2 * u64::from(limit.burst())) * limit.window_ms();
        let ahead = ((self.tat - now) * scale + self.frac).saturating_sub(back);
        self.tat = now + ahead / scale;
        self.frac = ahead % scale;
    }

    /// The TAT moves on by `units` intervals even beyond the tolerance, up to twice the
    /// tolerance ahead of now (the token bucket's debt of one capacity); never back.
    fn top_up(&mut self, now: u64, limit: &Limit, units: u64) {
        let scale = u64::from(limit.limit());
        let tolerance = Self::tolerance(limit);
        let ahead = if self.tat < now {
            0
        } else {
            (self.tat - now) * scale + self.frac
        };
        let spent = units.min(2 * u64::from(limit.burst())) * limit.window_ms();
        if ahead >= 2 * tolerance || spent == 0 {
            return;
        }
        let ahead = (ahead + spent).min(2 * tolerance);
        self.tat = now + ahead / scale;
        self.frac = ahead % scale;
    }

    fn can_reserve(&self, _now: u64) -> bool {
        true
    }

    /// The TAT moves on from where it would be `wait` ms from now: from itself, or from
    /// `now + wait` when it lies before that; exactly the request arriving then. (It ends
    /// at most the tolerance plus `wait` ahead: the TAT less `wait` leaves room for
    /// `cost`. Beyond the tolerance, `ahead` caps it and nothing fits until it is back.)
    fn reserve(&mut self, now: u64, limit: &Limit, cost: u64, wait: u64) {
        let scale = u64::from(limit.limit());
        let ahead = if self.tat < now {
            0
        } else {
            (self.tat - now) * scale + self.frac
        };
        let ahead = ahead.max(wait * scale) + cost * limit.window_ms();
        self.tat = now + ahead / scale;
        self.frac = ahead % scale;
    }
}

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use crate::{Limit, algorithm::tests::run};

    #[test]
    fn spaces_requests_by_the_emission_interval() {
        let limit = Limit::gcra(10, Duration::from_secs(1))
            .unwrap()
            .with_burst(1)
            .unwrap();
        let d = run(&limit, &[(1000, 1), (1050, 1), (1100, 1)]);
        assert!(d[0].allowed);
        assert!(!d[1].allowed);
        assert_eq!(d[1].retry_after_ms, 50);
        assert!(d[2].allowed);
    }

    #[test]
    fn a_request_of_cost_zero_never_moves_the_arrival_time_back() {
        let limit = Limit::gcra(1, Duration::from_secs(1)).unwrap();
        // Full at 1000; a cost-0 request from a clock 500 ms behind, then 1000 again.
        let d = run(&limit, &[(1000, 1), (500, 0), (1000, 1)]);
        assert!(d[1].allowed);
        assert!(!d[2].allowed);
        assert_eq!(d[2].retry_after_ms, 1000);
    }
}
