//! [`RateLimit`]: the middleware service.

use std::{
    fmt,
    sync::Arc,
    task::{Context, Poll},
};

use http::{Request, Response};
use tower_service::Service;

use crate::{
    MissingKey, RequestCost,
    decide::{Asked, Next, Shared, settle},
    future::{Pending, ResponseFuture},
    key::KeyExtractor,
    metrics,
    rejection::OnRejection,
};

/// Rate-limits the requests to `S`. Made by [`RateLimitLayer`](crate::RateLimitLayer).
///
/// Being rate-limited is an answer, not an error: `Error = S::Error`, so an infallible
/// service stays infallible and axum needs no `HandleErrorLayer`. `poll_ready` only asks
/// the inner service; limits never show as back-pressure.
pub struct RateLimit<S, K, C, R> {
    inner: S,
    key: Arc<K>,
    cost: C,
    shared: Arc<Shared<R>>,
}

impl<S, K, C, R> RateLimit<S, K, C, R> {
    pub(crate) fn from_parts(inner: S, key: Arc<K>, cost: C, shared: Arc<Shared<R>>) -> Self {
        Self {
            inner,
            key,
            cost,
            shared,
        }
    }

    /// The inner service.
    pub fn get_ref(&self) -> &S {
        &self.inner
    }

    /// The inner service, mutably.
    pub fn get_mut(&mut self) -> &mut S {
        &mut self.inner
    }

    /// Unwraps the inner service.
    pub fn into_inner(self) -> S {
        self.inner
    }
}

impl<S: Clone, K, C: Clone, R> Clone for RateLimit<S, K, C, R> {
    fn clone(&self) -> Self {
        Self {
            inner: self.inner.clone(),
            key: self.key.clone(),
            cost: self.cost.clone(),
            shared: self.shared.clone(),
        }
    }
}

impl<S: fmt::Debug, K: fmt::Debug, C: fmt::Debug, R> fmt::Debug for RateLimit<S, K, C, R> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("RateLimit")
            .field("inner", &self.inner)
            .field("key", &self.key)
            .field("cost", &self.cost)
            .field("limits", &self.shared.limits)
            .finish_non_exhaustive()
    }
}

impl<S, K, C, R, ReqB, ResB> Service<Request<ReqB>> for RateLimit<S, K, C, R>
where
    S: Service<Request<ReqB>, Response = Response<ResB>> + Clone,
    K: KeyExtractor<ReqB>,
    C: RequestCost<ReqB> + Clone,
    R: OnRejection<ReqB, ResB>,
{
    type Response = Response<ResB>;
    type Error = S::Error;
    type Future = ResponseFuture<S, ReqB, R>;

    #[inline]
    fn poll_ready(&mut self, cx: &mut Context<'_>) -> Poll<Result<(), Self::Error>> {
        self.inner.poll_ready(cx)
    }

    fn call(&mut self, request: Request<ReqB>) -> Self::Future {
        let shared = &self.shared;
        let key = match self.key.extract(&request) {
            Ok(key) => key,
            Err(error) => {
                shared.metrics.request(metrics::Outcome::KeyMissing);
                return match shared.on_missing_key {
                    MissingKey::Allow => ResponseFuture::unlimited(self.inner.call(request)),
                    MissingKey::Reject => {
                        tracing::debug!(%error, "rate limit key missing; rejecting");
                        let response = shared.rejection.key_missing(&request, &error);
                        ResponseFuture::ready(response)
                    }
                };
            }
        };
        let cost = self.cost.cost(&request);
        let timer = metrics::Timer::start();
        let check = shared.store.check_now(&key, &shared.limits, cost);
        let asked = Asked { key, cost, timer };
        let check = match check {
            // Decided already (the memory store, a block-cache hit, an open circuit): the
            // service that was polled ready takes the request now, so neither it nor the
            // request has to wait in the future.
            Ok(result) => {
                return match settle(shared, result, &request, &asked) {
                    Next::Answer(response) => ResponseFuture::ready(response),
                    Next::Call(decision) => ResponseFuture::calling(
                        self.inner.call(request),
                        decision,
                        self.shared.clone(),
                    ),
                };
            }
            Err(check) => check,
        };
        // The clone goes on serving; the service that was polled ready handles this call.
        let clone = self.inner.clone();
        let inner = std::mem::replace(&mut self.inner, clone);
        let pending = Pending {
            service: inner,
            request,
            asked,
        };
        ResponseFuture::checking(check, pending, self.shared.clone())
    }
}
