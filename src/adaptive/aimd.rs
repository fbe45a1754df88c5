//! [`Aimd`]: additive increase, multiplicative decrease, from drops.

use std::time::Duration;

use crate::ConfigError;

/// Additive increase, multiplicative decrease: a window with a dropped request (or, while
/// the traffic presses against the limit, a request slower than [`slow`](Self::with_slow))
/// multiplies the limit by [`backoff`](Self::with_backoff) (0.9); a window that pressed
/// against the limit and dropped nothing adds [`increase`](Self::with_increase) (1). See
/// the [module docs](super).
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Aimd {
    backoff: f64,
    increase: u32,
    slow: Option<Duration>,
}

impl Default for Aimd {
    fn default() -> Self {
        Self::new()
    }
}

impl Aimd {
    /// Backoff 0.9, increase 1, no latency threshold.
    pub fn new() -> Self {
        Self {
            backoff: 0.9,
            increase: 1,
            slow: None,
        }
    }

    /// What a window with a drop multiplies the limit by. Refused outside `0.5..1.0`
    /// (below halves too hard; 1 never backs off).
    pub fn with_backoff(mut self, backoff: f64) -> Result<Self, ConfigError> {
        if !(0.5..1.0).contains(&backoff) {
            return Err(ConfigError::new(
                "adaptive.backoff",
                format!("must be in 0.5..1.0 (got {backoff})"),
            ));
        }
        self.backoff = backoff;
        Ok(self)
    }

    /// What a window without drops that used the limit adds to it. Refused when zero.
    pub fn with_increase(mut self, increase: u32) -> Result<Self, ConfigError> {
        if increase == 0 {
            return Err(ConfigError::new(
                "adaptive.increase",
                "must be at least 1 (got 0)",
            ));
        }
        self.increase = increase;
        Ok(self)
    }

    /// Requests slower than `slow` count as a drop in a window that pressed against the
    /// limit, when they are more than a tenth of its samples (its p90 is slower): so AIMD
    /// also backs off when queueing makes latency grow (set it to your latency objective,
    /// say 1.5x the service's usual latency). A few slow requests are a stalled timer or
    /// a slow call, and a window that did not press says nothing about the limit.
    /// `None` (the default): only drops count.
    pub fn with_slow(mut self, slow: Option<Duration>) -> Self {
        self.slow = slow;
        self
    }

    /// The backoff. See [`with_backoff`](Self::with_backoff).
    pub fn backoff(&self) -> f64 {
        self.backoff
    }

    /// The increase. See [`with_increase`](Self::with_increase).
    pub fn increase(&self) -> u32 {
        self.increase
    }

    /// The latency threshold. See [`with_slow`](Self::with_slow).
    pub fn slow(&self) -> Option<Duration> {
        self.slow
    }

    /// The limit after a pressed window without drops (see `Window::pressed`).
    pub(super) fn grow(&self, limit: f64) -> f64 {
        limit + f64::from(self.increase)
    }

    /// The limit after a window with a drop, or a pressed one with a slow request.
    pub(super) fn back_off(&self, limit: f64) -> f64 {
        limit * self.backoff
    }
}
