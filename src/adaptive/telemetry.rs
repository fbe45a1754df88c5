//! The adaptive stage's metrics (feature `metrics`): see [`metrics`](crate::metrics) for
//! the names. Handles are registered once per recorder, as the layer's are.

use std::sync::Arc;

use super::{Concurrency, Priority};

/// One stage's metrics; nothing without the feature.
pub(crate) struct StageMetrics {
    #[cfg(feature = "metrics")]
    route: Arc<str>,
    /// One limit for the layer: its limit and baseline are gauges too. (Per key there
    /// are many: they are read through the handle.)
    #[cfg(feature = "metrics")]
    one: bool,
    #[cfg(feature = "metrics")]
    handles: crate::metrics::PerRecorder<Handles>,
}

#[cfg(feature = "metrics")]
struct Handles {
    limit: ::metrics::Gauge,
    in_flight: ::metrics::Gauge,
    min_rtt: ::metrics::Gauge,
    samples: ::metrics::Counter,
    /// By priority (sheddable, default, critical), then shadow (false, true).
    shed: [[::metrics::Counter; 2]; 3],
}

#[cfg(feature = "metrics")]
impl Handles {
    fn register(recorder: &dyn ::metrics::Recorder, route: &Arc<str>) -> Self {
        use crate::metrics::{
            ADAPTIVE_IN_FLIGHT, ADAPTIVE_LIMIT, ADAPTIVE_MIN_RTT_SECONDS, ADAPTIVE_SAMPLES_TOTAL,
            ADAPTIVE_SHED_TOTAL,
        };
        let metadata =
            ::metrics::Metadata::new(module_path!(), ::metrics::Level::INFO, Some(module_path!()));
        let key = |name: &'static str, extra: Vec<::metrics::Label>| {
            let mut labels = vec![::metrics::Label::new("route", route.to_string())];
            labels.extend(extra);
            ::metrics::Key::from_parts(name, labels)
        };
        let gauge = |name| recorder.register_gauge(&key(name, Vec::new()), &metadata);
        let shed = |priority: Priority| {
            [false, true].map(|shadow| {
                let labels = vec![
                    ::metrics::Label::new("priority", priority.as_str()),
                    ::metrics::Label::new("shadow", if shadow { "true" } else { "false" }),
                ];
                recorder.register_counter(&key(ADAPTIVE_SHED_TOTAL, labels), &metadata)
            })
        };
        Self {
            limit: gauge(ADAPTIVE_LIMIT),
            in_flight: gauge(ADAPTIVE_IN_FLIGHT),
            min_rtt: gauge(ADAPTIVE_MIN_RTT_SECONDS),
            samples: recorder.register_counter(&key(ADAPTIVE_SAMPLES_TOTAL, Vec::new()), &metadata),
            shed: [Priority::Sheddable, Priority::Default, Priority::Critical].map(shed),
        }
    }
}

impl StageMetrics {
    pub(crate) fn new(route: &Arc<str>, one: bool) -> Self {
        #[cfg(not(feature = "metrics"))]
        let _ = (route, one);
        Self {
            #[cfg(feature = "metrics")]
            route: route.clone(),
            #[cfg(feature = "metrics")]
            one,
            #[cfg(feature = "metrics")]
            handles: crate::metrics::PerRecorder::new(),
        }
    }

    #[cfg(feature = "metrics")]
    fn with_handles(&self, f: impl FnOnce(&Handles)) {
        self.handles
            .with(|recorder| Handles::register(recorder, &self.route), f);
    }

    /// A request took a permit of `concurrency`: with one limit for the layer, the limit
    /// gauge is set here too, so that it reads right before the first sample.
    #[inline]
    pub(crate) fn acquired(&self, concurrency: &Concurrency) {
        #[cfg(feature = "metrics")]
        self.with_handles(|handles| {
            handles.in_flight.increment(1.0);
            if self.one {
                handles.limit.set(f64::from(concurrency.snapshot().limit));
            }
        });
        #[cfg(not(feature = "metrics"))]
        let _ = concurrency;
    }

    /// A request gave its permit back, with a sample the limit `concurrency` learned
    /// from (`learned`) or without.
    #[inline]
    pub(crate) fn released(&self, learned: bool, concurrency: &Concurrency) {
        #[cfg(feature = "metrics")]
        self.with_handles(|handles| {
            handles.in_flight.decrement(1.0);
            if learned {
                handles.samples.increment(1);
                if self.one {
                    let now = concurrency.snapshot();
                    handles.limit.set(f64::from(now.limit));
                    if let Some(baseline) = now.baseline {
                        handles.min_rtt.set(baseline.as_secs_f64());
                    }
                }
            }
        });
        #[cfg(not(feature = "metrics"))]
        let _ = (learned, concurrency);
    }

    /// A request of `priority` was shed (or would have been, in `shadow` mode).
    #[inline]
    pub(crate) fn shed(&self, priority: Priority, shadow: bool) {
        #[cfg(feature = "metrics")]
        self.with_handles(|handles| {
            handles.shed[priority as usize][usize::from(shadow)].increment(1);
        });
        #[cfg(not(feature = "metrics"))]
        let _ = (priority, shadow);
    }
}
