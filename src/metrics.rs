//! Metrics through the [`metrics`](https://docs.rs/metrics/0.24) facade (feature
//! `metrics`).
//!
//! With the feature on, every layer records, labelled with its
//! [`name`](crate::RateLimitLayer::name) as `route`:
//!
//! | metric | kind | labels | what |
//! |---|---|---|---|
//! | [`tollgate_requests_total`](REQUESTS_TOTAL) | counter | `route`, `outcome` | one per request: `allowed`, `denied`, `store_error` or `key_missing` |
//! | [`tollgate_decision_seconds`](DECISION_SECONDS) | histogram | `route` | time from the store call to its answer (or its timeout) |
//!
//! A request the store could not decide counts as `store_error` whatever the
//! [`FailurePolicy`](crate::FailurePolicy) then does with it; a request without a key counts
//! as `key_missing` whether it is rejected or let through.
//!
//! The metrics go to whichever recorder is installed when the request is decided (for
//! example `metrics-exporter-prometheus`), so a layer built before the recorder was installed
//! still reports. Without the feature nothing is recorded, and these functions compile to
//! nothing.

use std::sync::Arc;

/// The request counter: `tollgate_requests_total{route, outcome}`.
pub const REQUESTS_TOTAL: &str = "tollgate_requests_total";

/// The decision latency histogram, in seconds: `tollgate_decision_seconds{route}`.
pub const DECISION_SECONDS: &str = "tollgate_decision_seconds";

/// Registers the descriptions (`# HELP`) and units of the metrics with the installed
/// recorder. Optional; call it once after installing the recorder. Does nothing without the
/// `metrics` feature.
pub fn describe() {
    #[cfg(feature = "metrics")]
    {
        ::metrics::describe_counter!(
            REQUESTS_TOTAL,
            ::metrics::Unit::Count,
            "Requests seen by a rate-limit layer, by outcome: allowed, denied, store_error, \
             key_missing."
        );
        ::metrics::describe_histogram!(
            DECISION_SECONDS,
            ::metrics::Unit::Seconds,
            "Time a rate-limit layer waited for its store's decision."
        );
    }
}

/// What happened to one request, the `outcome` label.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Outcome {
    Allowed,
    Denied,
    StoreError,
    KeyMissing,
}

impl Outcome {
    #[cfg(feature = "metrics")]
    const fn as_str(self) -> &'static str {
        match self {
            Self::Allowed => "allowed",
            Self::Denied => "denied",
            Self::StoreError => "store_error",
            Self::KeyMissing => "key_missing",
        }
    }
}

/// Started when the store call starts; zero-sized without the feature, so the clock is
/// read only when someone wants the latency.
#[derive(Debug)]
pub(crate) struct Timer {
    #[cfg(feature = "metrics")]
    start: std::time::Instant,
}

impl Timer {
    #[inline]
    pub(crate) fn start() -> Self {
        Self {
            #[cfg(feature = "metrics")]
            start: std::time::Instant::now(),
        }
    }
}

/// Counts one request with `outcome` for the layer `route`.
#[inline]
pub(crate) fn request(route: &Arc<str>, outcome: Outcome) {
    #[cfg(feature = "metrics")]
    ::metrics::counter!(REQUESTS_TOTAL, "route" => route.clone(), "outcome" => outcome.as_str())
        .increment(1);
    #[cfg(not(feature = "metrics"))]
    let _ = (route, outcome);
}

/// Counts a request the store answered (or failed to) and records how long it took.
#[inline]
pub(crate) fn decided(route: &Arc<str>, outcome: Outcome, timer: &Timer) {
    #[cfg(feature = "metrics")]
    ::metrics::histogram!(DECISION_SECONDS, "route" => route.clone())
        .record(timer.start.elapsed().as_secs_f64());
    #[cfg(not(feature = "metrics"))]
    let _ = timer;
    request(route, outcome);
}
