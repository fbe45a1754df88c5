//! Adaptive concurrency: an in-flight limit per process that follows the service's own
//! latency and errors, and sheds the least critical requests first when it is reached.
//!
//! A fixed in-flight limit is too low on a good day or too high on a bad one. An
//! [`AdaptiveLimit`] starts at [`initial`](AdaptiveLimit::initial) and moves between
//! [`min`](AdaptiveLimit::min) and [`max`](AdaptiveLimit::max), once per *window* of
//! completed requests (at least [`window`](AdaptiveLimit::with_window) long and
//! [`min_samples`](AdaptiveLimit::with_window) requests), by one of two algorithms:
//!
//! - [`Aimd`]: additive increase, multiplicative decrease. A window with a dropped
//!   request (a 5xx, a timeout, gRPC `UNAVAILABLE` / `DEADLINE_EXCEEDED`, or what your
//!   predicate says) multiplies the limit by [`backoff`](Aimd::with_backoff) (0.9); a
//!   pressed window (below) without one adds [`increase`](Aimd::with_increase) (1). It
//!   reacts to errors only, not to latency, unless requests slower than
//!   [`slow`](Aimd::with_slow) count as drops (more than a tenth of a pressed window's).
//! - [`Gradient`]: the ratio of a long-run latency to the window's (a gradient, as in
//!   Netflix's Gradient2 and Envoy's adaptive concurrency). With `tolerance` 1.2, the
//!   limit grows (by about its square root, smoothed) while the window's mean latency is
//!   within 1.2x of the long-run one, and shrinks (at most halving) as it goes beyond.
//!
//! # Pressed windows, and the limit between overloads
//!
//! Latency says something about the limit only while the traffic presses against it: a
//! window is *pressed* when it shed a request or its busiest moment used 3/4 of the
//! limit. Only then do the algorithms grow or shrink the limit from latency (Gradient2
//! likewise ignores windows under half the limit). A slow window that did not press is a
//! stalled timer or a slow dependency at low load, which a lower limit would not make
//! faster: on a loaded machine it was what made a 0.5x load shed.
//!
//! A window that did not press (and dropped nothing) eases the limit a fifth of the way
//! toward 3x its busiest moment, or [`initial`](AdaptiveLimit::initial) if larger. So
//! between overloads the limit follows the demand with room to spare (the least critical
//! requests keep about twice their demand once the shares below are kept, and a window
//! presses only once the demand grew 2.25x), it comes back to the same normal-day value
//! after an overload (from above or below), a quiet night does not leave a huge limit for
//! the morning, and it never eases below `initial`. A pressed window keeps whatever the
//! algorithm decides, and the easing raises the limit only while the latency shows no
//! queueing (few slow requests for AIMD, a mean within the tolerance for the gradient):
//! the traffic cannot raise the limit without the latency agreeing, even while a queue
//! grows too slowly to press.
//!
//! # How the baseline latency is learned, without a probe
//!
//! Envoy learns a minimum RTT by pinning the limit low for a moment, which sheds healthy
//! traffic while it probes (the issue its users hit first). [`Gradient`] has no probe: its
//! baseline is a slow moving average of the windows' mean latency, which
//!
//! - follows a window that is *not* queueing (mean within `tolerance` of the baseline)
//!   with weight `1 / long_window` (600 windows by default: about a minute at 100 ms
//!   windows under load), so a service that got slower for good is followed;
//! - follows a window that *is* queueing a hundred times more slowly, so that a sustained
//!   overload cannot raise the baseline and, with it, the limit (the creep Gradient2's
//!   users report);
//! - drops by 5% per window while a window's mean is under half of it, so that a baseline
//!   learned during a slow period comes down once the service is fast again, and the limit
//!   recovers after an overload ends.
//!
//! # Priorities
//!
//! A request's [`Priority`] decides how much of the limit it may use: critical requests
//! all of it; default ones (with the sheddable ones in flight) all but what is kept for
//! critical requests; sheddable ones all but that and what is kept for default ones. What
//! is kept for a priority follows its demand: 1.25x the most of its requests in flight at
//! once in the current and the last window, with its static share of the limit
//! ([`critical_share`](Shares::critical_share) and [`default_share`](Shares::default_share),
//! 10% each) as a floor. So when the service is saturated, sheddable requests are turned
//! away first, and critical traffic keeps what it uses, however large a share of the
//! capacity that is (a fixed 10% shed 14% of the critical requests when they were 40% of
//! the capacity at 4x, BENCHMARKS.md "Overload"); when it needs little, the floor stands.
//!
//! [`Concurrency`] is the running state, one per process (or per key): it admits
//! requests ([`Concurrency::try_acquire`]) and takes each finished one's latency and
//! outcome ([`Permit::finish`]). Times are given by the caller (a monotonic
//! [`Duration`] since any fixed start), so tests drive it with made-up times.
//!
//! # The stage of a layer
//!
//! [`RateLimitLayer::with_adaptive`](crate::RateLimitLayer::with_adaptive) runs an
//! [`Adaptive`] stage in the layer's pipeline:
//!
//! ```text
//! request ─► (exempt? passes) ─► key ─► adaptive permit ─► plan ─► store call ─► inner service
//!                                          │ shed: 503 + Retry-After (no store call, no units)
//! ```
//!
//! - **Before the store call.** The permit is taken in process, right after the key is
//!   extracted: a shed request costs no store round trip and spends no rate-limit units.
//!   A request the limits then deny (or the failure policy refuses) gives its permit back
//!   without a sample. Exempt requests, and requests without a key that the
//!   [missing-key policy](crate::MissingKey) lets through, skip the stage as they skip
//!   every other.
//! - **Waiting.** A request that waits its turn
//!   ([`with_max_wait`](crate::RateLimitLayer::with_max_wait)) holds its permit while it
//!   waits (it is work the service has accepted), but its latency counts from the call to
//!   the inner service: a wait in line, or a slow store, says nothing about the service.
//! - **In flight until the body ends.** The permit is given back when the response body
//!   ends, fails or is dropped (or the response future is dropped, or the inner service
//!   fails), as an [in-flight limit](crate::InFlightLimit)'s permit is, in the same body
//!   wrapper. The **latency sample** is the time from the call to the response head (a
//!   stream's length is the client's business, not a sign of overload); it is recorded
//!   when the body ends, with the outcome the head and trailers gave.
//! - **Priority**: [`Adaptive::with_priority`]'s closure, else a [`Priority`] in the
//!   request's extensions (set by your own layer, which knows the caller), else the
//!   [header](Adaptive::with_priority_header) (which any client can send), else
//!   [`Priority::Default`].
//! - **Shed answers** come from the layer's [`OnRejection::shed`](crate::OnRejection::shed):
//!   by default 503 (or 429, [`Adaptive::with_shed_status`]) with `Retry-After` (1 s,
//!   [`Adaptive::with_retry_after`]); a gRPC call gets HTTP 200 trailers-only
//!   `grpc-status: 14` UNAVAILABLE (retryable) with `retry-after` metadata and a
//!   `grpc-message` naming the priority. Shed requests are not counted in
//!   `tollgate_requests_total` (they never reached the limits), but in
//!   `tollgate_adaptive_shed_total`.
//! - **Shadow mode** ([`Adaptive::with_shadow`]): the limit runs and learns from the
//!   requests it admits; one it would shed passes without a permit and is counted with
//!   `shadow="true"`.
//! - **One limit for the layer** (its clones and every service they make: each process
//!   measures its own upstream), or **one per key** ([`Adaptive::with_per_key`], bounded;
//!   an evicted key's requests in flight still give their permits back). A
//!   [`RulesHandle`](crate::rules::RulesHandle) swap keeps the stage's state; a builder
//!   call after services were made makes a new layer, with a new state (as for the
//!   rules).
//! - **Composes** with every other option of the layer (plans, shadow limits,
//!   `count_when` and late costs, `max_wait`, lockouts, in-flight limits, leases, rules
//!   swaps, every failure policy): it is decided before them, in process, whatever the
//!   store does. With a store that is down, requests are still shed by it.
//! - **Time** is read from Tokio's clock ([`tokio::time::Instant`]), so tests pause and
//!   advance it.
//! - **Visibility**: [`RateLimitLayer::adaptive_handle`](crate::RateLimitLayer::adaptive_handle)
//!   gives an [`AdaptiveHandle`] whose [`snapshot`](AdaptiveHandle::snapshot) is the
//!   state now; with the `metrics` feature, the gauges and counters listed in
//!   [`metrics`](crate::metrics).
//!
//! ## What a response means for the limit
//!
//! By default: a 5xx status, or a `grpc-status` of 14 UNAVAILABLE or 4 DEADLINE_EXCEEDED
//! (in the headers of a trailers-only answer, or in the trailers at the body's end), is
//! [`Outcome::Dropped`]; so is an inner service error or a body that fails. A response
//! future or body dropped before the end (the client hung up) gives no sample. Anything
//! else is [`Outcome::Success`]. [`Adaptive::with_outcome`] replaces the reading of the
//! head (trailers are then not read).
//!
//! ```
//! use std::time::Duration;
//! use axum::{Router, routing::get};
//! use http::HeaderName;
//! use tollgate::{Limit, RateLimitLayer, key::GlobalKey};
//! use tollgate::adaptive::{Adaptive, AdaptiveLimit, Gradient};
//!
//! # fn main() -> Result<(), Box<dyn std::error::Error>> {
//! let adaptive = Adaptive::new(
//!     AdaptiveLimit::new(Gradient::new()).with_bounds(4, 20, 500)?,
//! )
//! .with_priority_header(HeaderName::from_static("x-priority"))
//! .with_retry_after(Duration::from_secs(2))?;
//! let layer = RateLimitLayer::new(Limit::per_second(1000)?)
//!     .with_key(GlobalKey)
//!     .with_adaptive(adaptive);
//! let handle = layer.adaptive_handle().expect("the layer has the stage");
//! let app: Router = Router::new().route("/", get(|| async { "ok" })).layer(layer);
//! assert_eq!(handle.snapshot().limit, 20);
//! # let _ = app;
//! # Ok(()) }
//! ```

mod aimd;
mod concurrency;
mod gradient;
mod priority;
mod running;
mod stage;
mod telemetry;
mod window;

use std::time::Duration;

pub use aimd::Aimd;
pub use concurrency::{Concurrency, Permit, Shed, Snapshot};
pub use gradient::Gradient;
pub use priority::{Priority, Shares};
pub use running::AdaptiveHandle;
pub(crate) use running::{Stage, Tracked, shed_message};
pub use stage::{Adaptive, DEFAULT_RETRY_AFTER, Shedding};

use crate::ConfigError;
use window::Window;

/// What became of a request, for the limit: its latency counts ([`Outcome::Success`]),
/// it is a sign of overload ([`Outcome::Dropped`]: a 5xx, a timeout), or it says nothing
/// about the service ([`Outcome::Ignore`]: the client hung up, a 4xx of its own making).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Outcome {
    /// Served: its latency is a sample.
    Success,
    /// Failed in a way that overload causes: the limit backs off.
    Dropped,
    /// Neither: no sample (the request still stops counting as in flight).
    Ignore,
}

/// The algorithm of an [`AdaptiveLimit`].
#[derive(Debug, Clone, Copy, PartialEq)]
#[non_exhaustive]
pub enum Algorithm {
    /// See [`Aimd`].
    Aimd(Aimd),
    /// See [`Gradient`].
    Gradient(Gradient),
}

/// The settings of an adaptive in-flight limit: its algorithm, its bounds, its window and
/// the shares of the limit kept for critical and default requests. See the
/// [module docs](self).
///
/// ```
/// use std::time::Duration;
/// use tollgate::adaptive::{AdaptiveLimit, Gradient};
///
/// let limit = AdaptiveLimit::new(Gradient::new())
///     .with_bounds(4, 20, 500)?
///     .with_window(Duration::from_millis(100), 10)?;
/// assert_eq!((limit.min(), limit.initial(), limit.max()), (4, 20, 500));
/// # Ok::<(), tollgate::ConfigError>(())
/// ```
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct AdaptiveLimit {
    algorithm: Algorithm,
    min: u32,
    initial: u32,
    max: u32,
    window: Duration,
    min_samples: u32,
    shares: Shares,
}

/// The bounds by default: at least 1, starting at 20, at most 1 000 requests in flight.
pub const DEFAULT_BOUNDS: (u32, u32, u32) = (1, 20, 1000);

/// How long a window lasts at least, by default.
pub const DEFAULT_WINDOW: Duration = Duration::from_millis(100);

/// How many completed requests a window has at least, by default.
pub const DEFAULT_MIN_SAMPLES: u32 = 10;

impl AdaptiveLimit {
    /// An adaptive limit run by `algorithm` ([`Aimd`] or [`Gradient`]), with the
    /// [default bounds](DEFAULT_BOUNDS), window and [shares](Shares).
    pub fn new(algorithm: impl Into<Algorithm>) -> Self {
        let (min, initial, max) = DEFAULT_BOUNDS;
        Self {
            algorithm: algorithm.into(),
            min,
            initial,
            max,
            window: DEFAULT_WINDOW,
            min_samples: DEFAULT_MIN_SAMPLES,
            shares: Shares::default(),
        }
    }

    /// The limit starts at `initial` and stays within `min..=max`. Refused unless
    /// `1 <= min <= initial <= max`.
    pub fn with_bounds(mut self, min: u32, initial: u32, max: u32) -> Result<Self, ConfigError> {
        if min == 0 {
            return Err(ConfigError::new(
                "adaptive.min",
                "must be at least 1 (got 0)",
            ));
        }
        if !(min <= initial && initial <= max) {
            return Err(ConfigError::new(
                "adaptive.initial",
                format!("must be within min..=max (got {initial}, min {min}, max {max})"),
            ));
        }
        (self.min, self.initial, self.max) = (min, initial, max);
        Ok(self)
    }

    /// The limit changes at most once per window: a window closes when it lasted at least
    /// `window` and holds at least `min_samples` completed requests. Refused when either is
    /// zero.
    pub fn with_window(mut self, window: Duration, min_samples: u32) -> Result<Self, ConfigError> {
        if window.is_zero() {
            return Err(ConfigError::new(
                "adaptive.window",
                "must be above zero (got 0)",
            ));
        }
        if min_samples == 0 {
            return Err(ConfigError::new(
                "adaptive.min_samples",
                "must be at least 1 (got 0)",
            ));
        }
        (self.window, self.min_samples) = (window, min_samples);
        Ok(self)
    }

    /// The shares of the limit kept for critical and default requests. See [`Shares`].
    pub fn with_shares(mut self, shares: Shares) -> Self {
        self.shares = shares;
        self
    }

    /// The algorithm.
    pub fn algorithm(&self) -> Algorithm {
        self.algorithm
    }

    /// The lowest the limit goes.
    pub fn min(&self) -> u32 {
        self.min
    }

    /// The limit before the first window.
    pub fn initial(&self) -> u32 {
        self.initial
    }

    /// The highest the limit goes.
    pub fn max(&self) -> u32 {
        self.max
    }

    /// The shortest window. See [`with_window`](Self::with_window).
    pub fn window(&self) -> Duration {
        self.window
    }

    /// The fewest completed requests in a window. See [`with_window`](Self::with_window).
    pub fn min_samples(&self) -> u32 {
        self.min_samples
    }

    /// The shares kept for critical and default requests.
    pub fn shares(&self) -> Shares {
        self.shares
    }
}

impl From<Aimd> for Algorithm {
    fn from(aimd: Aimd) -> Self {
        Self::Aimd(aimd)
    }
}

impl From<Gradient> for Algorithm {
    fn from(gradient: Gradient) -> Self {
        Self::Gradient(gradient)
    }
}

/// How far a window that did not press against the limit moves it toward its target.
const EASE: f64 = 0.2;

/// What a window that did not press against the limit moves it toward: this many times its
/// busiest moment (or `initial`, if larger). 3x leaves the least critical requests about
/// twice their demand once the shares of the others are kept, and a window counts as
/// pressed only once the demand grew 2.25x (3/4 of the limit).
const HEADROOM: f64 = 3.0;

/// The running state of an algorithm.
#[derive(Debug, Clone)]
enum Estimate {
    Aimd(Aimd),
    Gradient(gradient::State),
}

impl Estimate {
    fn new(algorithm: Algorithm) -> Self {
        match algorithm {
            Algorithm::Aimd(aimd) => Self::Aimd(aimd),
            Algorithm::Gradient(gradient) => Self::Gradient(gradient::State::new(gradient)),
        }
    }

    /// The next limit (unclamped) after a closed window: a drop backs off; a window that
    /// pressed against the limit goes to the algorithm; any other eases the limit toward
    /// the larger of twice its busiest moment and `initial` (see the [module docs](self)).
    fn next(&mut self, limit: f64, window: &Window, initial: u32) -> f64 {
        let pressed = window.pressed(limit);
        match self {
            Self::Aimd(aimd) => {
                // Queueing makes every request slow; one slow request in ten is a stalled
                // timer or a slow call.
                if window.dropped > 0 || (pressed && window.slow * 10 > window.samples) {
                    return aimd.back_off(limit);
                }
                if pressed {
                    return aimd.grow(limit);
                }
            }
            Self::Gradient(state) => {
                state.learn(window);
                if window.dropped > 0 {
                    return gradient::State::back_off(limit);
                }
                if pressed {
                    return state.next(limit, window);
                }
            }
        }
        let target = (HEADROOM * f64::from(window.busiest)).max(f64::from(initial));
        // Up only while the latency agrees: a queue that grows slowly does not press yet.
        if target > limit && !self.healthy(window) {
            return limit;
        }
        limit + (target - limit) * EASE
    }

    /// Whether the window's latency shows no queueing: few slow samples (AIMD), a mean
    /// within the tolerance of the baseline (gradient).
    fn healthy(&self, window: &Window) -> bool {
        match self {
            Self::Aimd(_) => window.slow * 10 <= window.samples,
            Self::Gradient(state) => state.healthy(window),
        }
    }

    /// The latency above which a sample is slow ([`Aimd::with_slow`]).
    fn slow(&self) -> Option<Duration> {
        match self {
            Self::Aimd(aimd) => aimd.slow(),
            Self::Gradient(_) => None,
        }
    }

    /// The baseline latency, for algorithms that keep one.
    fn baseline(&self) -> Option<Duration> {
        match self {
            Self::Aimd(_) => None,
            Self::Gradient(state) => state.baseline(),
        }
    }
}
