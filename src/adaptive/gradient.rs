//! [`Gradient`]: the limit from the ratio of a baseline latency to the window's.

use std::time::Duration;

use super::window::Window;
use crate::ConfigError;

/// A latency gradient: each window, `gradient = clamp(tolerance * baseline / mean, 0.5,
/// 1)`, `target = limit * gradient + sqrt(limit)`, and the limit moves `smoothing` of the
/// way to the target. A window with a drop backs off by 0.9 instead. See the
/// [module docs](super) for how the baseline is learned.
///
/// Defaults: tolerance 1.2, smoothing 0.2, a baseline over 600 windows. Under a sustained
/// overload the limit settles where `gradient = 1 - 1 / sqrt(limit)`: a mean latency of
/// about `tolerance / (1 - 1 / sqrt(limit))` times the baseline (1.4x at a limit of 50),
/// so that the p99 stays within 2x.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Gradient {
    tolerance: f64,
    smoothing: f64,
    long_window: u32,
}

impl Default for Gradient {
    fn default() -> Self {
        Self::new()
    }
}

impl Gradient {
    /// Tolerance 1.2, smoothing 0.2, long window 600.
    pub fn new() -> Self {
        Self {
            tolerance: 1.2,
            smoothing: 0.2,
            long_window: 600,
        }
    }

    /// How much slower than the baseline a window may be before the limit shrinks.
    /// Refused below 1.
    pub fn with_tolerance(mut self, tolerance: f64) -> Result<Self, ConfigError> {
        if !(tolerance >= 1.0 && tolerance.is_finite()) {
            return Err(ConfigError::new(
                "adaptive.tolerance",
                format!("must be at least 1 (got {tolerance})"),
            ));
        }
        self.tolerance = tolerance;
        Ok(self)
    }

    /// How far toward its target the limit moves per window. Refused outside `(0, 1]`.
    pub fn with_smoothing(mut self, smoothing: f64) -> Result<Self, ConfigError> {
        if !(smoothing > 0.0 && smoothing <= 1.0) {
            return Err(ConfigError::new(
                "adaptive.smoothing",
                format!("must be in (0, 1] (got {smoothing})"),
            ));
        }
        self.smoothing = smoothing;
        Ok(self)
    }

    /// How many windows the baseline averages over. Refused when zero.
    pub fn with_long_window(mut self, windows: u32) -> Result<Self, ConfigError> {
        if windows == 0 {
            return Err(ConfigError::new(
                "adaptive.long_window",
                "must be at least 1 (got 0)",
            ));
        }
        self.long_window = windows;
        Ok(self)
    }

    /// The tolerance. See [`with_tolerance`](Self::with_tolerance).
    pub fn tolerance(&self) -> f64 {
        self.tolerance
    }

    /// The smoothing. See [`with_smoothing`](Self::with_smoothing).
    pub fn smoothing(&self) -> f64 {
        self.smoothing
    }

    /// The long window. See [`with_long_window`](Self::with_long_window).
    pub fn long_window(&self) -> u32 {
        self.long_window
    }
}

/// A [`Gradient`] with its baseline.
#[derive(Debug, Clone)]
pub(super) struct State {
    settings: Gradient,
    /// The baseline latency in microseconds; `None` before the first window.
    baseline_us: Option<f64>,
    /// Windows seen, up to the long window: the baseline is a plain mean until then.
    windows: u32,
}

/// What a window under half of the baseline multiplies the baseline by.
const FORGET: f64 = 0.95;

/// How much more slowly a queueing window moves the baseline.
const QUEUEING_WEIGHT: f64 = 0.01;

/// The lowest gradient: a window at most halves the target.
const MIN_GRADIENT: f64 = 0.5;

/// What a window with a drop multiplies the limit by.
const BACKOFF: f64 = 0.9;

impl State {
    pub(super) fn new(settings: Gradient) -> Self {
        Self {
            settings,
            baseline_us: None,
            windows: 0,
        }
    }

    pub(super) fn baseline(&self) -> Option<Duration> {
        self.baseline_us
            .map(|us| Duration::from_micros(us.round() as u64))
    }

    /// Learns the baseline from a closed window with samples (pressed or not).
    pub(super) fn learn(&mut self, window: &Window) {
        if window.samples == 0 {
            return;
        }
        let mean = window.mean_us();
        let Gradient {
            tolerance,
            long_window,
            ..
        } = self.settings;
        let baseline = match self.baseline_us {
            None => mean,
            Some(baseline) => {
                self.windows = (self.windows + 1).min(long_window);
                let mut weight = 1.0 / f64::from(self.windows.max(1));
                if mean > tolerance * baseline {
                    weight *= QUEUEING_WEIGHT;
                }
                let mut baseline = baseline + (mean - baseline) * weight;
                if mean * 2.0 < baseline {
                    baseline *= FORGET;
                }
                baseline
            }
        };
        self.baseline_us = Some(baseline);
    }

    /// The limit after a pressed window without drops (see `Window::pressed`), once
    /// [`learn`](Self::learn) has seen it.
    pub(super) fn next(&self, limit: f64, window: &Window) -> f64 {
        let (Some(baseline), true) = (self.baseline_us, window.samples > 0) else {
            return limit;
        };
        let Gradient {
            tolerance,
            smoothing,
            ..
        } = self.settings;
        let gradient = (tolerance * baseline / window.mean_us()).clamp(MIN_GRADIENT, 1.0);
        let target = limit * gradient + limit.sqrt();
        limit + (target - limit) * smoothing
    }

    /// Whether the window's mean latency is within the tolerance of the baseline.
    pub(super) fn healthy(&self, window: &Window) -> bool {
        self.baseline_us
            .is_none_or(|baseline| window.mean_us() <= self.settings.tolerance * baseline)
    }

    /// The limit after a window with a drop.
    pub(super) fn back_off(limit: f64) -> f64 {
        limit * BACKOFF
    }
}
