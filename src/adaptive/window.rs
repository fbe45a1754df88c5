//! The completed requests of one window: what an algorithm decides from.

use std::time::Duration;

/// The samples of a window, from its start.
#[derive(Debug, Clone, Default)]
pub(crate) struct Window {
    /// When the window started (the caller's monotonic time).
    pub(crate) started: Duration,
    /// Completed requests whose latency counts.
    pub(crate) samples: u32,
    /// The sum of their latencies, in microseconds.
    pub(crate) latency_us: u64,
    /// Requests that were dropped (a sign of overload).
    pub(crate) dropped: u32,
    /// Samples slower than [`Aimd`](super::Aimd)'s latency threshold.
    pub(crate) slow: u32,
    /// Requests shed during the window.
    pub(crate) shed: u32,
    /// The most requests in flight at once during the window.
    pub(crate) busiest: u32,
    /// The same by priority (indexed by `Priority as usize`).
    pub(crate) busiest_by: [u32; 3],
}

/// The share of the limit whose use in a window makes it *pressed*: see
/// [`Window::pressed`].
const PRESSED: f64 = 0.75;

impl Window {
    pub(crate) fn new(started: Duration, in_flight: u32, in_flight_by: [u32; 3]) -> Self {
        Self {
            started,
            busiest: in_flight,
            busiest_by: in_flight_by,
            ..Self::default()
        }
    }

    /// The mean latency of the window's samples, in microseconds (at least 1).
    pub(crate) fn mean_us(&self) -> f64 {
        if self.samples == 0 {
            return 1.0;
        }
        (self.latency_us as f64 / f64::from(self.samples)).max(1.0)
    }

    /// Whether the window is over at `now`: long enough, and with enough requests.
    pub(crate) fn is_over(&self, now: Duration, length: Duration, min_samples: u32) -> bool {
        self.samples + self.dropped >= min_samples && now.saturating_sub(self.started) >= length
    }

    /// Whether the traffic pressed against `limit`: a request was shed, or the busiest
    /// moment used at least 3/4 of it. Only then does latency say something about the
    /// limit; else the traffic, not the limit, kept requests out of the queue.
    pub(crate) fn pressed(&self, limit: f64) -> bool {
        self.shed > 0 || f64::from(self.busiest) >= PRESSED * limit
    }
}
