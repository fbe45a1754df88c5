use super::{Model, div_ceil};
use crate::Limit;

/// Token bucket: `burst` tokens, refilled at `limit` per `window`.
///
/// Tokens are counted in units of `1 / window_ms` of a token, so the bucket holds
/// `burst * window_ms` units and refills exactly `limit` units per millisecond.
///
/// A [top-up](super::adjust) (units spent by a request that already ran) may take the
/// bucket below zero, down to minus its capacity: later requests wait until the debt is
/// refilled. A refund puts units back, up to the capacity.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TokenBucket {
    /// [`NEW`]: a key not seen yet, which is a full bucket. (No bucket holds that many
    /// units: capacities stay below 2^50.) Negative: a debt left by a top-up.
    tokens: i64,
    last: u64,
}

const NEW: i64 = i64::MAX;

impl Default for TokenBucket {
    fn default() -> Self {
        Self {
            tokens: NEW,
            last: 0,
        }
    }
}

impl TokenBucket {
    fn capacity(limit: &Limit) -> i64 {
        // Below 2^50 (Limit's validation).
        (u64::from(limit.burst()) * limit.window_ms()) as i64
    }

    fn tokens(&self) -> i64 {
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
        // Below 2^50 (a lease holds at most half a bucket), as in the script.
        let back = i64::try_from(units.saturating_mul(limit.window_ms())).unwrap_or(i64::MAX);
        self.tokens = self.tokens.saturating_add(back).min(capacity);
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
            let to_full = div_ceil((capacity - self.tokens) as u64, u64::from(limit.limit()));
            self.tokens = if elapsed >= to_full {
                capacity
            } else {
                self.tokens + (elapsed * u64::from(limit.limit())) as i64
            };
            self.last = now;
        }
    }

    fn fits(&self, _now: u64, limit: &Limit, cost: u64) -> bool {
        (cost * limit.window_ms()) as i64 <= self.tokens()
    }

    fn wait(&self, now: u64, limit: &Limit, cost: u64) -> u64 {
        let missing = (cost * limit.window_ms()) as i64 - self.tokens();
        self.paused(now) + div_ceil(missing as u64, u64::from(limit.limit()))
    }

    fn commit(&mut self, _now: u64, limit: &Limit, cost: u64) {
        self.tokens = self.tokens() - (cost * limit.window_ms()) as i64;
    }

    fn remaining(&self, _now: u64, limit: &Limit) -> u64 {
        self.tokens().max(0) as u64 / limit.window_ms()
    }

    fn reset_after(&self, now: u64, limit: &Limit) -> u64 {
        let missing = (Self::capacity(limit) - self.tokens()).max(0) as u64;
        if missing == 0 {
            0
        } else {
            self.paused(now) + div_ceil(missing, u64::from(limit.limit()))
        }
    }

    fn expires_at(&self, limit: &Limit) -> u64 {
        // At least 0: a store may ask with a limit newer than the state (see `normalize`).
        let missing = (Self::capacity(limit) - self.tokens()).max(0) as u64;
        self.last + div_ceil(missing, u64::from(limit.limit()))
    }

    /// Back into the bucket, never above its capacity (the refill may have filled it).
    fn refund(&mut self, _now: u64, limit: &Limit, units: u64, _at: u64) {
        // A debt and a full bucket are two capacities apart: no refund gives back more.
        let back = (units.min(2 * u64::from(limit.burst())) * limit.window_ms()) as i64;
        self.tokens = (self.tokens() + back).min(Self::capacity(limit));
    }

    /// Out of the bucket even when it holds too few, down to minus its capacity.
    fn top_up(&mut self, _now: u64, limit: &Limit, units: u64) {
        let capacity = Self::capacity(limit);
        // A full bucket and the deepest debt are two capacities apart.
        let spent = (units.min(2 * u64::from(limit.burst())) * limit.window_ms()) as i64;
        self.tokens = (self.tokens() - spent).max(-capacity).min(self.tokens());
    }

    /// Not while refilling is paused (the clock stepped back behind the last refill):
    /// the wait would not say when the bucket refills.
    fn can_reserve(&self, now: u64) -> bool {
        self.last <= now
    }

    /// Into debt: the bucket as it will be `wait` ms from now (refilled, at most full),
    /// less `cost`, less the refill until then, so that it holds exactly that when the
    /// request runs. (A debt of at most the refill of `wait`, below 2^51 units: see
    /// [`check_reserving`](super::check_reserving).)
    fn reserve(&mut self, _now: u64, limit: &Limit, cost: u64, wait: u64) {
        // Both below 2^51 (Limit's validation, and the bound on `wait`).
        let refill = (wait * u64::from(limit.limit())) as i64;
        let spent = (cost * limit.window_ms()) as i64;
        self.tokens = (self.tokens() + refill).min(Self::capacity(limit)) - spent - refill;
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
