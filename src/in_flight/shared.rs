//! What the services and futures of one in-flight layer share, and the one place that
//! turns a store's answer into what the request gets.

use std::{fmt, sync::Arc, time::Duration};

use http::{HeaderValue, Request, Response, header::RETRY_AFTER};

use crate::{
    Decision, FailurePolicy, LimitDecision, MissingKey, StoreError,
    headers::ceil_secs,
    key::Key,
    metrics::{LayerMetrics, Outcome, Timer},
    policy::Failed,
    rejection::OnRejection,
    store::{Acquired, Guarded, Permit, Permits},
};

/// The layer's settings as its services use them.
pub(super) struct Shared {
    pub(super) max: u32,
    /// The store, under the layer's timeout and circuit breaker.
    pub(super) permits: Guarded<dyn Permits>,
    pub(super) ttl: Duration,
    pub(super) on_store_error: FailurePolicy,
    pub(super) on_missing_key: MissingKey,
    pub(super) retry_after: Duration,
    pub(super) name: Arc<str>,
    pub(super) metrics: LayerMetrics,
}

impl fmt::Debug for Shared {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Shared")
            .field("max", &self.max)
            .field("permits", &self.permits)
            .field("ttl", &self.ttl)
            .field("on_store_error", &self.on_store_error)
            .field("on_missing_key", &self.on_missing_key)
            .field("retry_after", &self.retry_after)
            .field("name", &self.name)
            .finish_non_exhaustive()
    }
}

/// Where a held permit came from, and so goes back to.
#[derive(Debug, Clone, Copy)]
enum Source {
    Store,
    /// The memory store of [`FailurePolicy::Local`].
    Fallback,
}

/// A request's permit, given back to where it came from when dropped.
#[derive(Debug)]
pub(super) struct Held {
    shared: Arc<Shared>,
    permit: Option<Permit>,
    source: Source,
}

impl Drop for Held {
    fn drop(&mut self) {
        let Some(permit) = self.permit.take() else {
            return;
        };
        match (self.source, &self.shared.on_store_error) {
            (Source::Fallback, FailurePolicy::Local(store)) => store.release(permit),
            _ => self.shared.permits.store().release(permit),
        }
    }
}

/// What a request gets once its permit was asked for.
pub(super) enum Next<B> {
    /// Call the inner service, holding this permit (none: let through unlimited).
    Call(Option<Held>),
    /// Answer with this response.
    Answer(Response<B>),
}

impl Shared {
    /// What a request without a key gets.
    pub(super) fn key_missing(&self) -> MissingKey {
        self.metrics.request(Outcome::KeyMissing);
        self.on_missing_key
    }
}

/// The store answered `result` for `request` (of `key`), asked at `timer`: counts it and
/// says what the request gets, applying the failure policy to an error.
pub(super) fn settle<R, ReqB, ResB>(
    shared: &Arc<Shared>,
    rejection: &R,
    result: Result<Acquired, StoreError>,
    key: &Key,
    request: &Request<ReqB>,
    timer: &Timer,
) -> Next<ResB>
where
    R: OnRejection<ReqB, ResB>,
{
    let outcome = match &result {
        Ok(acquired) if acquired.is_taken() => Outcome::Allowed,
        Ok(_) => Outcome::Denied,
        Err(_) => Outcome::StoreError,
    };
    shared.metrics.decided(outcome, timer);
    match result {
        Ok(acquired) => held(shared, acquired, Source::Store, rejection, request),
        Err(error) => match shared.on_store_error.on_failure(error, key, &shared.name) {
            Failed::Allow => Next::Call(None),
            Failed::Deny(error) => Next::Answer(rejection.store_failed(request, &error)),
            Failed::Local(store) => {
                let acquired = store.take_permit(key, shared.max);
                held(shared, acquired, Source::Fallback, rejection, request)
            }
        },
    }
}

fn held<R, ReqB, ResB>(
    shared: &Arc<Shared>,
    acquired: Acquired,
    source: Source,
    rejection: &R,
    request: &Request<ReqB>,
) -> Next<ResB>
where
    R: OnRejection<ReqB, ResB>,
{
    match acquired.into_permit() {
        Some(permit) => Next::Call(Some(Held {
            shared: shared.clone(),
            permit: Some(permit),
            source,
        })),
        None => Next::Answer(denied(rejection, shared, request)),
    }
}

/// The answer to a request that found every permit of its key held.
fn denied<R, ReqB, ResB>(rejection: &R, shared: &Shared, request: &Request<ReqB>) -> Response<ResB>
where
    R: OnRejection<ReqB, ResB>,
{
    let retry_ms = u64::try_from(shared.retry_after.as_millis()).unwrap_or(u64::MAX);
    let decision = Decision::new(vec![LimitDecision::deny(shared.max, 0, retry_ms, retry_ms)]);
    let mut response = rejection.rate_limited(request, &decision);
    let secs = ceil_secs(retry_ms).max(1);
    response
        .headers_mut()
        .insert(RETRY_AFTER, HeaderValue::from(secs));
    response
}
