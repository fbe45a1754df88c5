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
    pub(crate) key: Key,
    pub(crate) cost: u32,
    pub(crate) timer: Timer,
    /// How the circuit breaker let this request through.
    pub(crate) admission: Admission,
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

/// The result of waiting for the store.
enum Outcome {
    Decided(Decision),
    /// Pass the request on without limiting (fail open).
    Unlimited,
    /// Answer with the rejection's store-failure response.
    Failed(StoreError),
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
                        key,
                        cost,
                        timer,
                        admission,
                    } = pending.take().expect("polled after completion");
                    if let Some(breaker) = &shared.breaker {
                        match &result {
                            Ok(_) => breaker.succeeded(),
                            Err(_) if admission != Admission::Skip => breaker.failed(admission),
                            Err(_) => {}
                        }
                    }
                    let recorded = match &result {
                        Ok(decision) if decision.is_allowed() => Recorded::Allowed,
                        Ok(_) => Recorded::Denied,
                        Err(_) => Recorded::StoreError,
                    };
                    shared.metrics.decided(recorded, &timer);
                    let outcome = match result {
                        Ok(decision) => Outcome::Decided(decision),
                        Err(error) => on_store_error(shared, error, &key, cost, admission),
                    };
                    match outcome {
                        Outcome::Decided(decision) if !decision.is_allowed() => {
                            let mut response = shared.rejection.rate_limited(&request, &decision);
                            shared.headers.write(response.headers_mut(), &decision);
                            return Poll::Ready(Ok(response));
                        }
                        Outcome::Failed(error) => {
                            return Poll::Ready(Ok(shared
                                .rejection
                                .store_failed(&request, &error)));
                        }
                        Outcome::Decided(decision) => {
                            let future = service.call(request);
                            this.state.set(State::Calling {
                                future,
                                decision: Some(decision),
                            });
                        }
                        Outcome::Unlimited => {
                            let future = service.call(request);
                            this.state.set(State::Calling {
                                future,
                                decision: None,
                            });
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

fn on_store_error<R>(
    shared: &Shared<R>,
    error: StoreError,
    key: &Key,
    cost: u32,
    admission: Admission,
) -> Outcome {
    let policy = shared.on_store_error.as_str();
    let layer = &*shared.name;
    if admission == Admission::Skip {
        // The failures that opened the circuit were logged already.
        tracing::debug!(%error, %key, policy, layer, "rate limit store skipped");
    } else {
        tracing::warn!(%error, %key, policy, layer, "rate limit store failed");
    }
    match &shared.on_store_error {
        FailurePolicy::Allow => Outcome::Unlimited,
        FailurePolicy::Deny => Outcome::Failed(error),
        FailurePolicy::Local(store) => Outcome::Decided(store.decide(key, &shared.limits, cost)),
    }
}
