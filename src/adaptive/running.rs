//! The adaptive stage as it runs: [`Stage`] (the limit, or one per key), [`Tracked`]
//! (an admitted request until its response ends) and [`AdaptiveHandle`] (a look at it).

use std::{
    convert::Infallible,
    fmt,
    sync::{
        Arc,
        atomic::{AtomicBool, Ordering},
    },
    time::Duration,
};

use http::{HeaderMap, Request, Response};

use super::{
    Adaptive, Concurrency, Outcome, Permit, Priority, Snapshot, stage::Shedding,
    telemetry::StageMetrics,
};
use crate::key::Key;

/// The running state of a layer's adaptive stage: shared by the layer's clones and every
/// service they make, and untouched by a [`RulesHandle`](crate::rules::RulesHandle).
pub(crate) struct Stage {
    pub(crate) settings: Adaptive,
    limits: Limits,
    /// Where the stage's times count from: Tokio's clock, so that tests pause it.
    origin: tokio::time::Instant,
    metrics: StageMetrics,
}

impl fmt::Debug for Stage {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Stage")
            .field("settings", &self.settings)
            .field("keys", &self.keys())
            .finish_non_exhaustive()
    }
}

enum Limits {
    One(Concurrency),
    /// Bounded: an evicted key's permits hold its state until they are given back.
    PerKey(quick_cache::sync::Cache<Key, Concurrency>),
}

impl Stage {
    pub(crate) fn new(settings: Adaptive, route: &Arc<str>) -> Self {
        let limits = match settings.per_key {
            None => Limits::One(Concurrency::new(settings.limit)),
            Some(max_keys) => Limits::PerKey(quick_cache::sync::Cache::new(max_keys)),
        };
        Self {
            metrics: StageMetrics::new(route, settings.per_key.is_none()),
            settings,
            limits,
            origin: tokio::time::Instant::now(),
        }
    }

    /// Now, on the stage's clock.
    pub(crate) fn now(&self) -> Duration {
        tokio::time::Instant::now().saturating_duration_since(self.origin)
    }

    /// Admits `request` of `key`: `Ok(Some(..))` with its permit, `Ok(None)` when only
    /// shadow mode lets it pass (it holds no permit), or the [`Shedding`] to answer with.
    pub(crate) fn admit<B>(
        self: &Arc<Self>,
        request: &Request<B>,
        key: &Key,
    ) -> Result<Option<Box<Tracked>>, Shedding> {
        let priority = self
            .settings
            .priority_of(request.headers(), request.extensions());
        let concurrency = match &self.limits {
            Limits::One(concurrency) => concurrency.clone(),
            Limits::PerKey(keys) => keys
                .get_or_insert_with(key, || {
                    Ok::<_, Infallible>(Concurrency::new(self.settings.limit))
                })
                .unwrap_or_else(|never| match never {}),
        };
        match concurrency.try_acquire(priority, self.now()) {
            Ok(permit) => {
                self.metrics.acquired(&concurrency);
                Ok(Some(Box::new(Tracked {
                    permit: Some(permit),
                    concurrency,
                    stage: self.clone(),
                    head: None,
                    outcome: Outcome::Success,
                    end: AtomicBool::new(false),
                })))
            }
            Err(shed) => {
                self.metrics.shed(priority, self.settings.shadow);
                if self.settings.shadow {
                    tracing::debug!(%shed, "adaptive limit would shed (shadow mode)");
                    return Ok(None);
                }
                Err(Shedding {
                    shed,
                    status: self.settings.shed_status,
                    retry_after: self.settings.retry_after,
                })
            }
        }
    }

    /// The state now: per key, the sum over the keys kept (limits, in flight, samples,
    /// shed) and no baseline.
    pub(crate) fn snapshot(&self) -> Snapshot {
        match &self.limits {
            Limits::One(concurrency) => concurrency.snapshot(),
            Limits::PerKey(keys) => {
                let mut sum = Concurrency::new(self.settings.limit).snapshot();
                (sum.limit, sum.baseline) = (0, None);
                for (_, concurrency) in keys.iter() {
                    let one = concurrency.snapshot();
                    sum.limit += one.limit;
                    sum.in_flight += one.in_flight;
                    sum.samples += one.samples;
                    for (total, shed) in sum.shed.iter_mut().zip(one.shed) {
                        *total += shed;
                    }
                }
                sum
            }
        }
    }

    /// The state of `key`'s limit (per key), if it is kept.
    pub(crate) fn snapshot_of(&self, key: &Key) -> Option<Snapshot> {
        match &self.limits {
            Limits::One(_) => None,
            Limits::PerKey(keys) => keys.peek(key).map(|c| c.snapshot()),
        }
    }

    /// How many keys are kept (per key), else 1.
    pub(crate) fn keys(&self) -> usize {
        match &self.limits {
            Limits::One(_) => 1,
            Limits::PerKey(keys) => keys.len(),
        }
    }
}

/// An admitted request, until its response ends: its permit, and what the response has
/// said about it so far. Dropped before the end (the client hung up), the permit is
/// given back without a sample.
pub(crate) struct Tracked {
    permit: Option<Permit>,
    concurrency: Concurrency,
    stage: Arc<Stage>,
    /// When the response head arrived: the end of the latency sample.
    head: Option<Duration>,
    outcome: Outcome,
    /// The body said it was over ([`http_body::Body::is_end_stream`]): a server may
    /// drop it without reading it then, which is its end, not a hang-up.
    end: AtomicBool,
}

impl fmt::Debug for Tracked {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Tracked")
            .field("head", &self.head)
            .field("outcome", &self.outcome)
            .finish_non_exhaustive()
    }
}

impl Tracked {
    /// The request reaches the inner service now: its latency counts from here, not from
    /// its admission (a store call, a wait in line).
    pub(crate) fn called(&mut self) {
        if let Some(permit) = &mut self.permit {
            permit.restart(self.stage.now());
        }
    }

    /// The response head is there: the end of the latency sample, and the outcome as
    /// the head says.
    pub(crate) fn head<B>(&mut self, response: Response<B>) -> Response<B> {
        self.head = Some(self.stage.now());
        match &self.stage.settings.outcome {
            Some(classify) => {
                let (parts, body) = response.into_parts();
                self.outcome = classify(&parts);
                Response::from_parts(parts, body)
            }
            None => {
                self.outcome = default_outcome(response.status(), response.headers());
                response
            }
        }
    }

    /// The trailers at the body's end: with the default outcomes, a gRPC status of
    /// overload drops the request.
    pub(crate) fn trailers(&mut self, trailers: &HeaderMap) {
        if self.stage.settings.outcome.is_none() && self.outcome == Outcome::Success {
            self.outcome = default_outcome(http::StatusCode::OK, trailers);
        }
    }

    /// The response ended (its body, or its head for a body that was empty): the sample.
    pub(crate) fn ended(mut self) {
        let outcome = self.outcome;
        self.finish(outcome);
    }

    /// The body says it is over: dropped now, the response ended.
    pub(crate) fn saw_end(&self) {
        self.end.store(true, Ordering::Relaxed);
    }

    /// The inner service or the body failed: a sign of overload.
    pub(crate) fn failed(mut self) {
        self.finish(Outcome::Dropped);
    }

    fn finish(&mut self, outcome: Outcome) {
        let Some(permit) = self.permit.take() else {
            return;
        };
        let now = self.stage.now();
        permit.finish(self.head.unwrap_or(now), outcome);
        let learned = outcome != Outcome::Ignore;
        self.stage.metrics.released(learned, &self.concurrency);
    }
}

impl Drop for Tracked {
    fn drop(&mut self) {
        if self.end.load(Ordering::Relaxed) {
            let outcome = self.outcome;
            self.finish(outcome);
        } else if self.permit.take().is_some() {
            self.stage.metrics.released(false, &self.concurrency);
        }
    }
}

/// The default outcomes: a 5xx, or a `grpc-status` of 14 (UNAVAILABLE) or 4
/// (DEADLINE_EXCEEDED), is [`Outcome::Dropped`]; anything else [`Outcome::Success`].
pub(crate) fn default_outcome(status: http::StatusCode, headers: &HeaderMap) -> Outcome {
    if status.is_server_error() {
        return Outcome::Dropped;
    }
    match headers.get("grpc-status").map(|v| v.as_bytes()) {
        Some(b"14" | b"4") => Outcome::Dropped,
        _ => Outcome::Success,
    }
}

/// A look at the running state of a layer's adaptive stage, for metrics and admin
/// pages: made by [`RateLimitLayer::adaptive_handle`](crate::RateLimitLayer::adaptive_handle).
/// Clones look at the same state.
#[derive(Clone)]
pub struct AdaptiveHandle {
    pub(crate) stage: Arc<Stage>,
}

impl fmt::Debug for AdaptiveHandle {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("AdaptiveHandle")
            .field("settings", &self.stage.settings)
            .field("now", &self.snapshot())
            .finish()
    }
}

impl AdaptiveHandle {
    /// The limit, in-flight count, samples, baseline and shed counts now. Per key: their
    /// sums over the keys kept (the limit too), without a baseline.
    pub fn snapshot(&self) -> Snapshot {
        self.stage.snapshot()
    }

    /// The state of `key`'s own limit, per key (`None` when the key is not kept, or the
    /// stage has one limit for the layer).
    pub fn snapshot_of(&self, key: &Key) -> Option<Snapshot> {
        self.stage.snapshot_of(key)
    }

    /// How many keys have a limit of their own (per key); 1 for one limit per layer.
    pub fn keys(&self) -> usize {
        self.stage.keys()
    }

    /// The stage's settings.
    pub fn settings(&self) -> &Adaptive {
        &self.stage.settings
    }
}

/// The shed answers of [`DefaultRejection`](crate::DefaultRejection): a priority name,
/// for messages.
pub(crate) fn shed_message(shedding: &Shedding) -> String {
    let secs = crate::headers::ceil_secs(
        u64::try_from(shedding.retry_after.as_millis()).unwrap_or(u64::MAX),
    );
    format!(
        "overloaded: {} request shed; retry in {secs}s",
        Priority::as_str(shedding.shed.priority)
    )
}
