use super::{Model, div_ceil};
use crate::Limit;

/// Token bucket: `burst` tokens, refilled at `limit` per `window`.
///
/// Tokens are counted in units of `1 / window_ms` of a token, so the bucket holds
/// `burst * window_ms` units and refills exactly `limit` units per millisecond.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TokenBucket {
    /// [`NEW`]: a key not seen yet, which is a full bucket. (No bucket holds that many
    /// units: capacities stay below 2^50.)
    tokens: u64,
    last: u64,
}

const NEW: u64 = u64::MAX;

impl Default for TokenBucket {
    fn default() -> Self {
        Self {
            tokens: NEW,
            last: 0,
        }
    }
}

impl TokenBucket {
    fn capacity(limit: &Limit) -> u64 {
        u64::from(limit.burst()) * limit.window_ms()
    }

    fn tokens(&self) -> u64 {
        if self.tokens == NEW { 0 } else { self.tokens }
    }

    /// Milliseconds before refilling starts again (the clock stepped back).
    fn paused(&self, now: u64) -> u64 {
        self.last.saturating_sub(now)
    }
}

impl TokenBucket {
    /// Puts back `units` taken at an earlier moment (a lease's unspent units), refilled to
    /// `now` first: never beyond the bucket (see [`lease`](super::lease)).
    pub(super) fn give_back(&mut self, now: u64, limit: &Limit, units: u64) {
        if self.tokens == NEW {
            return;
        }
        self.normalize(now, limit);
        let capacity = Self::capacity(limit);
        self.tokens = (self.tokens + units * limit.window_ms()).min(capacity);
    }
}

impl Model for TokenBucket {
    fn normalize(&mut self, now: u64, limit: &Limit) {
        let capacity = Self::capacity(limit);
        if self.tokens == NEW {
            self.tokens = capacity;
            self.last = now;
            return;
        }
        // More than the bucket holds: its burst (or window) shrank while the state carried
        // over (`OnChange::CarryOver`). The bucket keeps what fits.
        self.tokens = self.tokens.min(capacity);
        if now > self.last {
            let elapsed = now - self.last;
            let to_full = div_ceil(capacity - self.tokens, u64::from(limit.limit()));
            self.tokens = if elapsed >= to_full {
                capacity
            } else {
                self.tokens + elapsed * u64::from(limit.limit())
            };
            self.last = now;
        }
    }

    fn fits(&self, _now: u64, limit: &Limit, cost: u64) -> bool {
        cost * limit.window_ms() <= self.tokens()
    }

    fn wait(&self, now: u64, limit: &Limit, cost: u64) -> u64 {
        let missing = cost * limit.window_ms() - self.tokens();
        self.paused(now) + div_ceil(missing, u64::from(limit.limit()))
    }

    fn commit(&mut self, _now: u64, limit: &Limit, cost: u64) {
        self.tokens = self.tokens() - cost * limit.window_ms();
    }

    fn remaining(&self, _now: u64, limit: &Limit) -> u64 {
        self.tokens() / limit.window_ms()
    }

    fn reset_after(&self, now: u64, limit: &Limit) -> u64 {
        let missing = Self::capacity(limit).saturating_sub(self.tokens());
        if missing == 0 {
            0
        } else {
            self.paused(now) + div_ceil(missing, u64::from(limit.limit()))
        }
    }

    fn expires_at(&self, limit: &Limit) -> u64 {
        // Saturating: a store may ask with a limit newer than the state (see `normalize`).
        let missing = Self::capacity(limit).saturating_sub(self.tokens());
        self.last + div_ceil(missing, u64::from(limit.limit()))
    }
}

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use crate::{Limit, algorithm::tests::run};

    #[test]
    fn refills_continuously() {
        let limit = Limit::token_bucket(10, Duration::from_secs(1))
            .unwrap()
            .with_burst(2)
            .unwrap();
        let d = run(
            &limit,
            &[(0, 1), (0, 1), (0, 1), (99, 1), (100, 1), (100, 1)],
        );
        let allowed: Vec<bool> = d.iter().map(|d| d.allowed).collect();
        assert_eq!(allowed, [true, true, false, false, true, false]);
        assert_eq!(d[2].retry_after_ms, 100);
        assert_eq!(d[3].retry_after_ms, 1);
        assert_eq!(d[4].reset_after_ms, 200);
    }

    #[test]
    fn fractional_rates_are_exact() {
        // 3 per 10 ms: one token every 3.33 ms, 300 in one second, on top of the burst.
        let limit = Limit::token_bucket(3, Duration::from_millis(10))
            .unwrap()
            .with_burst(2)
            .unwrap();
        let steps: Vec<(u64, u32)> = (0..=1000).map(|t| (t, 1)).collect();
        let allowed = run(&limit, &steps).iter().filter(|d| d.allowed).count();
        assert_eq!(allowed, 302); // the full bucket at 0, then 300 refills
    }
}
