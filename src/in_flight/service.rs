//! [`InFlight`]: the service an [`InFlightLayer`](super::InFlightLayer) makes.

use std::{
    fmt,
    sync::Arc,
    task::{Context, Poll},
};

use http::{Request, Response};
use tower_service::Service;

use super::{
    body::InFlightBody,
    future::{InFlightFuture, Waiting},
    shared::{Next, Shared, settle},
};
use crate::{MissingKey, key::KeyExtractor, metrics::Timer, rejection::OnRejection};

/// Allows at most N requests in flight per key to `S`. Made by
/// [`InFlightLayer`](super::InFlightLayer).
pub struct InFlight<S, K, R> {
    inner: S,
    key: Arc<K>,
    rejection: Arc<R>,
    shared: Arc<Shared>,
}

impl<S, K, R> InFlight<S, K, R> {
    pub(super) fn new(inner: S, key: Arc<K>, rejection: Arc<R>, shared: Arc<Shared>) -> Self {
        Self {
            inner,
            key,
            rejection,
            shared,
        }
    }

    /// The inner service.
    pub fn get_ref(&self) -> &S {
        &self.inner
    }

    /// Unwraps the inner service.
    pub fn into_inner(self) -> S {
        self.inner
    }
}

impl<S: Clone, K, R> Clone for InFlight<S, K, R> {
    fn clone(&self) -> Self {
        Self {
            inner: self.inner.clone(),
            key: self.key.clone(),
            rejection: self.rejection.clone(),
            shared: self.shared.clone(),
        }
    }
}

impl<S: fmt::Debug, K: fmt::Debug, R> fmt::Debug for InFlight<S, K, R> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("InFlight")
            .field("inner", &self.inner)
            .field("key", &self.key)
            .field("max", &self.shared.max)
            .finish_non_exhaustive()
    }
}

impl<S, K, R, ReqB, ResB> Service<Request<ReqB>> for InFlight<S, K, R>
where
    S: Service<Request<ReqB>, Response = Response<ResB>> + Clone,
    K: KeyExtractor<ReqB>,
    R: OnRejection<ReqB, ResB>,
{
    type Response = Response<InFlightBody<ResB>>;
    type Error = S::Error;
    type Future = InFlightFuture<S, ReqB, R>;

    #[inline]
    fn poll_ready(&mut self, cx: &mut Context<'_>) -> Poll<Result<(), Self::Error>> {
        self.inner.poll_ready(cx)
    }

    fn call(&mut self, request: Request<ReqB>) -> Self::Future {
        let shared = &self.shared;
        let key = match self.key.extract(&request) {
            Ok(key) => key,
            Err(error) => {
                return match shared.key_missing() {
                    MissingKey::Allow => InFlightFuture::calling(self.inner.call(request), None),
                    MissingKey::Reject => {
                        InFlightFuture::ready(self.rejection.key_missing(&request, &error))
                    }
                };
            }
        };
        let timer = Timer::start();
        match shared.permits.acquire_now(&key, shared.max, shared.ttl) {
            // In memory: answered now, so the service polled ready takes the request.
            Ok(result) => match settle(shared, &*self.rejection, result, &key, &request, &timer) {
                Next::Call(permit) => InFlightFuture::calling(self.inner.call(request), permit),
                Next::Answer(response) => InFlightFuture::ready(response),
            },
            Err(acquire) => {
                let clone = self.inner.clone();
                let service = std::mem::replace(&mut self.inner, clone);
                let waiting = Waiting {
                    service,
                    request,
                    key,
                    shared: shared.clone(),
                    rejection: self.rejection.clone(),
                    timer,
                };
                InFlightFuture::acquiring(acquire, waiting)
            }
        }
    }
}
