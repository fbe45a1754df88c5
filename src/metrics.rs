//! Metrics through the [`metrics`](https://docs.rs/metrics/0.24) facade (feature
//! `metrics`).
//!
//! With the feature on, every layer ([`RateLimitLayer`](crate::RateLimitLayer),
//! [`InFlightLayer`](crate::in_flight::InFlightLayer)) records, labelled with its
//! [`name`](crate::RateLimitLayer::with_name) as `route`:
//!
//! | metric | kind | labels | what |
//! |---|---|---|---|
//! | [`tollgate_requests_total`](REQUESTS_TOTAL) | counter | `route`, `outcome` | one per request: `allowed`, `denied`, `would_reject`, `store_error`, `key_missing` or `exempt` (passed uncounted, [`with_exempt`](crate::RateLimitLayer::with_exempt)) (an in-flight layer: `allowed` when a permit was taken, `denied` when none was left) |
//! | [`tollgate_decision_seconds`](DECISION_SECONDS) | histogram | `route` | time from the store call to its answer (or its timeout) |
//! | [`tollgate_plan_requests_total`](PLAN_REQUESTS_TOTAL) | counter | `route`, `plan`, `outcome` | one per request decided under a [plan](crate::plan) (also counted in the first) |
//! | [`tollgate_delayed_requests_total`](DELAYED_REQUESTS_TOTAL) | counter | `route`, `outcome` | one per request decided after waiting its turn ([`with_max_wait`](crate::RateLimitLayer::with_max_wait)), with the outcome it is counted as in the first (`allowed`, `denied` when its wait ran out, `store_error`) |
//! | [`tollgate_adaptive_limit`](ADAPTIVE_LIMIT) | gauge | `route` | the [adaptive](crate::adaptive) limit (one per layer; per key: none, see the handle) |
//! | [`tollgate_adaptive_in_flight`](ADAPTIVE_IN_FLIGHT) | gauge | `route` | requests holding an adaptive permit (per key: over all keys) |
//! | [`tollgate_adaptive_samples_total`](ADAPTIVE_SAMPLES_TOTAL) | counter | `route` | finished requests the adaptive limit learned from |
//! | [`tollgate_adaptive_min_rtt_seconds`](ADAPTIVE_MIN_RTT_SECONDS) | gauge | `route` | the [`Gradient`](crate::adaptive::Gradient) baseline latency (one per layer) |
//! | [`tollgate_adaptive_shed_total`](ADAPTIVE_SHED_TOTAL) | counter | `route`, `priority`, `shadow` | requests shed (`shadow="true"`: would have been) |
//!
//! A request the store could not decide counts as `store_error` whatever the
//! [`FailurePolicy`](crate::FailurePolicy) then does with it; a request without a key counts
//! as `key_missing` whether it is rejected or let through. A request let through only
//! because the limits that deny it are in [shadow](crate::guide::shadow) counts as
//! `would_reject` (not `allowed`); one an enforced limit denies counts as `denied`.
//!
//! The metrics go to whichever recorder is installed when the request is decided (for
//! example `metrics-exporter-prometheus`), so a layer built before the recorder was installed
//! still reports. Without the feature nothing is recorded, and these functions compile to
//! nothing.

use std::sync::Arc;

/// The request counter: `tollgate_requests_total{route, outcome}`.
pub const REQUESTS_TOTAL: &str = "tollgate_requests_total";

/// The requests decided under a [plan](crate::plan), by plan:
/// `tollgate_plan_requests_total{route, plan, outcome}` (as well as in
/// [`REQUESTS_TOTAL`], which does not tell plans apart).
pub const PLAN_REQUESTS_TOTAL: &str = "tollgate_plan_requests_total";

/// The requests decided after waiting their turn
/// ([`with_max_wait`](crate::RateLimitLayer::with_max_wait)), by the outcome they are
/// counted as in [`REQUESTS_TOTAL`] (where they are counted too):
/// `tollgate_delayed_requests_total{route, outcome}`. A request that waited and was then
/// allowed is `allowed` there and here; one whose wait ran out is `denied` in both.
pub const DELAYED_REQUESTS_TOTAL: &str = "tollgate_delayed_requests_total";

/// The decision latency histogram, in seconds: `tollgate_decision_seconds{route}`.
pub const DECISION_SECONDS: &str = "tollgate_decision_seconds";

/// The [adaptive](crate::adaptive) limit now: `tollgate_adaptive_limit{route}` (a layer
/// with one limit; per key, see [`AdaptiveHandle`](crate::adaptive::AdaptiveHandle)).
pub const ADAPTIVE_LIMIT: &str = "tollgate_adaptive_limit";

/// The requests holding an [adaptive](crate::adaptive) permit:
/// `tollgate_adaptive_in_flight{route}` (per key: over all keys).
pub const ADAPTIVE_IN_FLIGHT: &str = "tollgate_adaptive_in_flight";

/// The finished requests the [adaptive](crate::adaptive) limit learned from (served or
/// dropped; not the ones whose client hung up): `tollgate_adaptive_samples_total{route}`.
pub const ADAPTIVE_SAMPLES_TOTAL: &str = "tollgate_adaptive_samples_total";

/// The [`Gradient`](crate::adaptive::Gradient) baseline latency, in seconds:
/// `tollgate_adaptive_min_rtt_seconds{route}` (a layer with one limit).
pub const ADAPTIVE_MIN_RTT_SECONDS: &str = "tollgate_adaptive_min_rtt_seconds";

/// The requests the [adaptive](crate::adaptive) limit shed, or would have in shadow
/// mode: `tollgate_adaptive_shed_total{route, priority, shadow}` (never a key label).
pub const ADAPTIVE_SHED_TOTAL: &str = "tollgate_adaptive_shed_total";

/// Registers the descriptions (`# HELP`) and units of the metrics with the installed
/// recorder. Optional; call it once after installing the recorder. Does nothing without the
/// `metrics` feature.
pub fn describe() {
    #[cfg(feature = "metrics")]
    {
        ::metrics::describe_counter!(
            REQUESTS_TOTAL,
            ::metrics::Unit::Count,
            "Requests seen by a rate-limit layer, by outcome: allowed, denied, would_reject, exempt, \
             store_error, key_missing."
        );
        ::metrics::describe_histogram!(
            DECISION_SECONDS,
            ::metrics::Unit::Seconds,
            "Time a rate-limit layer waited for its store's decision."
        );
        ::metrics::describe_counter!(
            PLAN_REQUESTS_TOTAL,
            ::metrics::Unit::Count,
            "Requests a rate-limit layer decided under a plan, by plan and outcome."
        );
        ::metrics::describe_gauge!(
            ADAPTIVE_LIMIT,
            ::metrics::Unit::Count,
            "The adaptive in-flight limit of a layer (one limit per layer)."
        );
        ::metrics::describe_gauge!(
            ADAPTIVE_IN_FLIGHT,
            ::metrics::Unit::Count,
            "Requests holding an adaptive permit (per key: over all keys)."
        );
        ::metrics::describe_counter!(
            ADAPTIVE_SAMPLES_TOTAL,
            ::metrics::Unit::Count,
            "Finished requests the adaptive limit learned from (served or dropped)."
        );
        ::metrics::describe_gauge!(
            ADAPTIVE_MIN_RTT_SECONDS,
            ::metrics::Unit::Seconds,
            "The gradient algorithm's baseline latency (one limit per layer)."
        );
        ::metrics::describe_counter!(
            ADAPTIVE_SHED_TOTAL,
            ::metrics::Unit::Count,
            "Requests the adaptive limit shed (shadow=\"true\": would have shed), by priority."
        );
        ::metrics::describe_counter!(
            DELAYED_REQUESTS_TOTAL,
            ::metrics::Unit::Count,
            "Requests a rate-limit layer decided after they waited their turn (max_wait), by \
             outcome (also counted in tollgate_requests_total)."
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
    /// Allowed, though a shadow limit would have denied it.
    WouldReject,
    /// Passed uncounted: the layer exempts it.
    Exempt,
}

impl Outcome {
    #[cfg(feature = "metrics")]
    const ALL: [Self; 6] = [
        Self::Allowed,
        Self::Denied,
        Self::StoreError,
        Self::KeyMissing,
        Self::WouldReject,
        Self::Exempt,
    ];

    #[cfg(feature = "metrics")]
    pub(crate) const fn as_str(self) -> &'static str {
        match self {
            Self::Allowed => "allowed",
            Self::Denied => "denied",
            Self::StoreError => "store_error",
            Self::KeyMissing => "key_missing",
            Self::WouldReject => "would_reject",
            Self::Exempt => "exempt",
        }
    }
}

/// Started when the store call starts; zero-sized without the feature, so the clock is
/// read only when someone wants the latency (and then the cheap one, see
/// [`MonotonicClock`](crate::clock::MonotonicClock)).
#[derive(Debug, Clone, Copy)]
pub(crate) struct Timer {
    #[cfg(feature = "metrics")]
    start: quanta::Instant,
}

impl Timer {
    #[inline]
    pub(crate) fn start() -> Self {
        Self {
            #[cfg(feature = "metrics")]
            start: quanta::Instant::now(),
        }
    }
}

/// One layer's metrics. With the feature on, its handles are registered once per recorder
/// rather than per request (which hashes the name and labels into the recorder's registry
/// every time), and registered again when the current recorder is another one: a layer
/// built before the recorder was installed, or used under a local recorder, reports all
/// the same.
pub(crate) struct LayerMetrics {
    #[cfg(feature = "metrics")]
    route: Arc<str>,
    #[cfg(feature = "metrics")]
    handles: PerRecorder<Handles>,
}

/// Metric handles `H`, registered with the current recorder the first time they are
/// used, and again when the current recorder is another one. Kept with the address of
/// the recorder they were registered with. (A recorder dropped and another made at the
/// same address would pass for the first: only local recorders, in tests, come and go
/// like that.)
#[cfg(feature = "metrics")]
pub(crate) struct PerRecorder<H> {
    cached: arc_swap::ArcSwapOption<(usize, H)>,
}

#[cfg(feature = "metrics")]
impl<H> PerRecorder<H> {
    pub(crate) fn new() -> Self {
        Self {
            cached: arc_swap::ArcSwapOption::empty(),
        }
    }

    /// Runs `f` with the handles of the current recorder, made by `register` when they
    /// are not those.
    pub(crate) fn with(
        &self,
        register: impl FnOnce(&dyn ::metrics::Recorder) -> H,
        f: impl FnOnce(&H),
    ) {
        ::metrics::with_recorder(|recorder| {
            let address = std::ptr::from_ref(recorder).cast::<()>() as usize;
            let cached = self.cached.load();
            match cached.as_deref() {
                Some((registered, handles)) if *registered == address => f(handles),
                _ => {
                    let fresh = Arc::new((address, register(recorder)));
                    f(&fresh.1);
                    self.cached.store(Some(fresh));
                }
            }
        });
    }
}

#[cfg(feature = "metrics")]
struct Handles {
    /// By [`Outcome`], in its order.
    requests: [::metrics::Counter; 6],
    latency: ::metrics::Histogram,
}

#[cfg(feature = "metrics")]
impl Handles {
    fn register(recorder: &dyn ::metrics::Recorder, route: &Arc<str>) -> Self {
        let metadata =
            ::metrics::Metadata::new(module_path!(), ::metrics::Level::INFO, Some(module_path!()));
        let counter = |outcome: Outcome| {
            let labels = vec![
                ::metrics::Label::new("route", route.to_string()),
                ::metrics::Label::new("outcome", outcome.as_str()),
            ];
            let key = ::metrics::Key::from_parts(REQUESTS_TOTAL, labels);
            recorder.register_counter(&key, &metadata)
        };
        let latency = ::metrics::Key::from_parts(
            DECISION_SECONDS,
            vec![::metrics::Label::new("route", route.to_string())],
        );
        Self {
            requests: Outcome::ALL.map(counter),
            latency: recorder.register_histogram(&latency, &metadata),
        }
    }
}

impl LayerMetrics {
    pub(crate) fn new(route: &Arc<str>) -> Self {
        #[cfg(not(feature = "metrics"))]
        let _ = route;
        Self {
            #[cfg(feature = "metrics")]
            route: route.clone(),
            #[cfg(feature = "metrics")]
            handles: PerRecorder::new(),
        }
    }

    /// Runs `f` with the handles of the current recorder.
    #[cfg(feature = "metrics")]
    fn with_handles(&self, f: impl FnOnce(&Handles)) {
        self.handles
            .with(|recorder| Handles::register(recorder, &self.route), f);
    }

    /// Counts one request with `outcome`.
    #[inline]
    pub(crate) fn request(&self, outcome: Outcome) {
        #[cfg(feature = "metrics")]
        self.with_handles(|handles| handles.requests[outcome as usize].increment(1));
        #[cfg(not(feature = "metrics"))]
        let _ = outcome;
    }

    /// Counts a request the store answered (or failed to) and records how long it took.
    #[inline]
    pub(crate) fn decided(&self, outcome: Outcome, timer: &Timer) {
        #[cfg(feature = "metrics")]
        self.with_handles(|handles| {
            handles.latency.record(timer.start.elapsed().as_secs_f64());
            handles.requests[outcome as usize].increment(1);
        });
        #[cfg(not(feature = "metrics"))]
        let _ = (outcome, timer);
    }

    /// Counts a request that waited its turn in [`DELAYED_REQUESTS_TOTAL`], with the
    /// `outcome` it is (or was, when a local store answered after a store error) counted
    /// as in [`REQUESTS_TOTAL`]. Registered when first used (a request that waited has
    /// slept already), so a layer that never delays shows no such series.
    #[inline]
    pub(crate) fn delayed(&self, outcome: Outcome) {
        #[cfg(feature = "metrics")]
        ::metrics::counter!(
            DELAYED_REQUESTS_TOTAL,
            "route" => self.route.to_string(),
            "outcome" => outcome.as_str(),
        )
        .increment(1);
        #[cfg(not(feature = "metrics"))]
        let _ = outcome;
    }

    /// Counts a request decided under the plan `plan` in [`PLAN_REQUESTS_TOTAL`] (its
    /// outcome was counted for the layer already).
    #[inline]
    pub(crate) fn plan(&self, plan: &str, outcome: Outcome) {
        #[cfg(feature = "metrics")]
        ::metrics::counter!(
            PLAN_REQUESTS_TOTAL,
            "route" => self.route.to_string(),
            "plan" => plan.to_owned(),
            "outcome" => outcome.as_str(),
        )
        .increment(1);
        #[cfg(not(feature = "metrics"))]
        let _ = (plan, outcome);
    }
}

#[cfg(all(test, feature = "metrics"))]
mod tests {
    use metrics_exporter_prometheus::{PrometheusBuilder, PrometheusRecorder};

    use super::*;

    /// The value of `name` on the line whose labels include `labels`, in `recorder`'s page.
    fn value(recorder: &PrometheusRecorder, name: &str, labels: &str) -> Option<f64> {
        let page = recorder.handle().render();
        page.lines()
            .find(|line| line.starts_with(&format!("{name}{{")) && line.contains(labels))
            .and_then(|line| line.rsplit(' ').next()?.parse().ok())
    }

    #[test]
    fn each_recorder_gets_the_requests_made_while_it_is_current() {
        let metrics = LayerMetrics::new(&Arc::from("r"));
        // No recorder yet: nothing to see, nothing breaks.
        metrics.request(Outcome::Allowed);

        let first = PrometheusBuilder::new().build_recorder();
        let second = PrometheusBuilder::new().build_recorder();
        let allowed = r#"route="r",outcome="allowed""#;
        ::metrics::with_local_recorder(&first, || {
            metrics.request(Outcome::Allowed);
            metrics.request(Outcome::Allowed);
            metrics.decided(Outcome::Denied, &Timer::start());
        });
        ::metrics::with_local_recorder(&second, || metrics.request(Outcome::Allowed));
        ::metrics::with_local_recorder(&first, || metrics.request(Outcome::Allowed));

        assert_eq!(value(&first, REQUESTS_TOTAL, allowed), Some(3.0));
        assert_eq!(
            value(&first, REQUESTS_TOTAL, r#"outcome="denied""#),
            Some(1.0)
        );
        assert_eq!(
            value(&first, "tollgate_decision_seconds_count", r#"route="r""#),
            Some(1.0)
        );
        assert_eq!(value(&second, REQUESTS_TOTAL, allowed), Some(1.0));
    }
}
