//! [`ResponseFuture`]: waits for the store's decision, then answers or calls the inner
//! service.

use std::{
    fmt,
    future::Future,
    pin::Pin,
    sync::Arc,
    task::{Context, Poll, ready},
};

use futures_util::FutureExt;
use http::{Request, Response};
use pin_project_lite::pin_project;
use tokio::time::Sleep;
use tower_service::Service;

use crate::{
    Decision, FailurePolicy, StoreError,
    breaker::Admission,
    key::Key,
    metrics::{Outcome as Recorded, Timer},
    rejection::OnRejection,
    service::Shared,
    store::Check,
};

pin_project! {
    /// The response future of [`RateLimit`](crate::RateLimit).
    pub struct ResponseFuture<S, ReqB, R>
    where
        S: Service<Request<ReqB>>,
    {
        #[pin]
        state: State<S, ReqB>,
        shared: Option<Arc<Shared<R>>>,
    }
}

pin_project! {
    #[project = StateProj]
    enum State<S, ReqB>
    where
        S: Service<Request<ReqB>>,
    {
        Checking {
            check: Check,
            deadline: Option<Pin<Box<Sleep>>>,
            pending: Option<Pending<S, ReqB>>,
        },
        Calling {
            #[pin]
            future: S::Future,
            decision: Option<Decision>,
        },
        Ready {
            response: Option<S::Response>,
        },
    }
}

/// What a checking request needs once the store has decided.
pub(crate) struct Pending<S, ReqB> {
    pub(crate) service: S,
    pub(crate) request: Request<ReqB>,
    pub(crate) asked: Asked,
}

/// How the store was asked about a request: what [`settle`] needs besides its answer.
pub(crate) struct Asked {
    pub(crate) key: Key,
    pub(crate) cost: u32,
    pub(crate) timer: Timer,
    /// How the circuit breaker let this request through.
    pub(crate) admission: Admission,
}

/// What to do with a request once the store has answered.
pub(crate) enum Next<ResB> {
    /// Answer at once, without the inner service.
    Answer(Response<ResB>),
    /// Call the inner service, then write this decision's fields on its response (none
    /// when failing open).
    Call(Option<Decision>),
}

impl<S, ReqB, R> ResponseFuture<S, ReqB, R>
where
    S: Service<Request<ReqB>>,
{
    pub(crate) fn checking(
        check: Check,
        pending: Pending<S, ReqB>,
        shared: Arc<Shared<R>>,
    ) -> Self {
        Self {
            state: State::Checking {
                check,
                deadline: None,
                pending: Some(pending),
            },
            shared: Some(shared),
        }
    }

    pub(crate) fn unlimited(future: S::Future) -> Self {
        Self {
            state: State::Calling {
                future,
                decision: None,
            },
            shared: None,
        }
    }

    /// The inner service's future, whose response gets `decision`'s fields.
    pub(crate) fn calling(
        future: S::Future,
        decision: Option<Decision>,
        shared: Arc<Shared<R>>,
    ) -> Self {
        Self {
            state: State::Calling { future, decision },
            shared: Some(shared),
        }
    }

    pub(crate) fn ready(response: S::Response) -> Self {
        Self {
            state: State::Ready {
                response: Some(response),
            },
            shared: None,
        }
    }
}

impl<S, ReqB, R> fmt::Debug for ResponseFuture<S, ReqB, R>
where
    S: Service<Request<ReqB>>,
{
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("ResponseFuture").finish_non_exhaustive()
    }
}

impl<S, ReqB, R, ResB> Future for ResponseFuture<S, ReqB, R>
where
    S: Service<Request<ReqB>, Response = Response<ResB>>,
    R: OnRejection<ReqB, ResB>,
{
    type Output = Result<Response<ResB>, S::Error>;

    fn poll(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Self::Output> {
        let mut this = self.project();
        loop {
            match this.state.as_mut().project() {
                StateProj::Checking {
                    check,
                    deadline,
                    pending,
                } => {
                    let shared = this.shared.as_ref().expect("checking without config");
                    let result = match check.poll_unpin(cx) {
                        Poll::Ready(result) => result,
                        Poll::Pending => {
                            let Some(timeout) = shared.timeout else {
                                return Poll::Pending;
                            };
                            // The timer is created only for a store that is not ready at
                            // once, so the in-memory store never pays for one.
                            let deadline = deadline
                                .get_or_insert_with(|| Box::pin(tokio::time::sleep(timeout)));
                            ready!(deadline.as_mut().poll(cx));
                            Err(StoreError::timeout())
                        }
                    };
                    let Pending {
                        mut service,
                        request,
                        asked,
                    } = pending.take().expect("polled after completion");
                    match settle(shared, result, &request, &asked) {
                        Next::Answer(response) => return Poll::Ready(Ok(response)),
                        Next::Call(decision) => {
                            let future = service.call(request);
                            this.state.set(State::Calling { future, decision });
                        }
                    }
                }
                StateProj::Calling { future, decision } => {
                    let mut response = ready!(future.poll(cx))?;
                    if let (Some(decision), Some(shared)) = (decision.take(), this.shared.as_ref())
                    {
                        shared.headers.write(response.headers_mut(), &decision);
                    }
                    return Poll::Ready(Ok(response));
                }
                StateProj::Ready { response } => {
                    return Poll::Ready(Ok(response.take().expect("polled after completion")));
                }
            }
        }
    }
}

/// Acts on the store's answer about `request`: feeds the circuit breaker and the metrics,
/// applies the failure policy to an error, and says whether to answer at once (a denial,
/// a store failure) or to call the inner service.
pub(crate) fn settle<ReqB, ResB, R>(
    shared: &Shared<R>,
    result: Result<Decision, StoreError>,
    request: &Request<ReqB>,
    asked: &Asked,
) -> Next<ResB>
where
    R: OnRejection<ReqB, ResB>,
{
    if let Some(breaker) = &shared.breaker {
        match &result {
            Ok(_) => breaker.succeeded(),
            Err(_) if asked.admission != Admission::Skip => breaker.failed(asked.admission),
            Err(_) => {}
        }
    }
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
    let Asked {
        key,
        cost,
        admission,
        ..
    } = asked;
    let policy = shared.on_store_error.as_str();
    let layer = &*shared.name;
    // Never the key itself: it may be an API key.
    let redacted = key.redacted();
    if *admission == Admission::Skip {
        // The failures that opened the circuit were logged already.
        tracing::debug!(%error, key = %redacted, policy, layer, "rate limit store skipped");
    } else {
        tracing::warn!(%error, key = %redacted, policy, layer, "rate limit store failed");
    }
    match &shared.on_store_error {
        FailurePolicy::Allow => Ok(None),
        FailurePolicy::Deny => Err(error),
        FailurePolicy::Local(store) => Ok(Some(store.decide(key, &shared.limits, *cost))),
    }
}
