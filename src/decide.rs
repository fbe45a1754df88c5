//! What a request gets once the store has answered: the failure policy for errors, the
//! rejection for denials, the metrics for both. [`RateLimit`](crate::RateLimit) settles
//! answers that are ready at once, its [`ResponseFuture`](crate::ResponseFuture) those it
//! waited for; both through [`settle`], so the policy lives here once.

use std::sync::Arc;

use http::{Request, Response};

use crate::{
    Decision, FailurePolicy, Limit, MissingKey, StoreError,
    headers::HeaderWriter,
    key::Key,
    metrics::{self, Outcome as Recorded, Timer},
    rejection::OnRejection,
    store::Guarded,
};

/// What a [`RateLimit`](crate::RateLimit) service shares with its response futures.
pub(crate) struct Shared<R> {
    pub(crate) limits: Arc<[Limit]>,
    /// The layer's store, under its timeout and circuit breaker.
    pub(crate) store: Guarded,
    pub(crate) headers: HeaderWriter,
    pub(crate) on_store_error: FailurePolicy,
    pub(crate) on_missing_key: MissingKey,
    pub(crate) rejection: R,
    /// The layer's name: the `route` label of its metrics.
    pub(crate) name: Arc<str>,
    pub(crate) metrics: metrics::LayerMetrics,
}

/// How the store was asked about a request: what [`settle`] needs besides its answer.
pub(crate) struct Asked {
    pub(crate) key: Key,
    pub(crate) cost: u32,
    pub(crate) timer: Timer,
}

/// What to do with a request once the store has answered.
pub(crate) enum Next<ResB> {
    /// Answer at once, without the inner service.
    Answer(Response<ResB>),
    /// Call the inner service, then write this decision's fields on its response (none
    /// when failing open).
    Call(Option<Decision>),
}

/// Acts on the store's answer about `request`: records the metrics, applies the failure
/// policy to an error, and says whether to answer at once (a denial, a store failure) or
/// to call the inner service.
pub(crate) fn settle<ReqB, ResB, R>(
    shared: &Shared<R>,
    result: Result<Decision, StoreError>,
    request: &Request<ReqB>,
    asked: &Asked,
) -> Next<ResB>
where
    R: OnRejection<ReqB, ResB>,
{
    let recorded = match &result {
        Ok(decision) if decision.is_allowed() => Recorded::Allowed,
        Ok(_) => Recorded::Denied,
        Err(_) => Recorded::StoreError,
    };
    shared.metrics.decided(recorded, &asked.timer);
    let decision = match result {
        Ok(decision) => decision,
        Err(error) => match on_store_error(shared, error, asked) {
            Ok(Some(decision)) => decision,
            Ok(None) => return Next::Call(None),
            Err(error) => return Next::Answer(shared.rejection.store_failed(request, &error)),
        },
    };
    if decision.is_allowed() {
        return Next::Call(Some(decision));
    }
    let mut response = shared.rejection.rate_limited(request, &decision);
    shared.headers.write(response.headers_mut(), &decision);
    Next::Answer(response)
}

/// The failure policy's answer to a store error: a decision (the local fallback store's),
/// none (fail open), or the error to answer with (fail closed).
fn on_store_error<R>(
    shared: &Shared<R>,
    error: StoreError,
    asked: &Asked,
) -> Result<Option<Decision>, StoreError> {
    let Asked { key, cost, .. } = asked;
    let policy = shared.on_store_error.as_str();
    let layer = &*shared.name;
    let chain = error.chain();
    // Never the key itself: it may be an API key.
    let redacted = key.redacted();
    if error.is_circuit_open() {
        // The failures that opened the circuit were logged already.
        tracing::debug!(error = %chain, key = %redacted, policy, layer, "rate limit store skipped");
    } else {
        tracing::warn!(error = %chain, key = %redacted, policy, layer, "rate limit store failed");
    }
    match &shared.on_store_error {
        FailurePolicy::Allow => Ok(None),
        FailurePolicy::Deny => Err(error),
        FailurePolicy::Local(store) => Ok(Some(store.decide(key, &shared.limits, *cost))),
    }
}
