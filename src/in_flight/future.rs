//! [`InFlightFuture`]: waits for the permit when the store answers later, calls the inner
//! service and hands the permit to the response body.

use std::{
    fmt,
    future::Future,
    pin::Pin,
    sync::Arc,
    task::{Context, Poll, ready},
};

use http::{Request, Response};
use pin_project_lite::pin_project;
use tower_service::Service;

use super::{
    body::InFlightBody,
    shared::{Held, Next, Shared, settle},
};
use crate::{key::Key, metrics::Timer, rejection::OnRejection, store::Acquired, store::Check};

/// A request waiting for its permit from the store.
pub(super) struct Waiting<S, ReqB, R> {
    pub(super) service: S,
    pub(super) request: Request<ReqB>,
    pub(super) key: Key,
    pub(super) shared: Arc<Shared>,
    pub(super) rejection: Arc<R>,
    pub(super) timer: Timer,
}

pin_project! {
    /// The response future of [`InFlight`](super::InFlight): takes the permit, calls the
    /// inner service and hands the permit to the response body.
    pub struct InFlightFuture<S, ReqB, R>
    where
        S: Service<Request<ReqB>>,
    {
        #[pin]
        state: State<S, ReqB, R>,
    }
}

pin_project! {
    #[project = StateProj]
    enum State<S, ReqB, R>
    where
        S: Service<Request<ReqB>>,
    {
        Acquiring {
            acquire: Check<Acquired>,
            waiting: Option<Waiting<S, ReqB, R>>,
        },
        Calling {
            #[pin]
            future: S::Future,
            permit: Option<Held>,
        },
        Ready {
            response: Option<S::Response>,
        },
    }
}

impl<S, ReqB, R> InFlightFuture<S, ReqB, R>
where
    S: Service<Request<ReqB>>,
{
    pub(super) fn acquiring(acquire: Check<Acquired>, waiting: Waiting<S, ReqB, R>) -> Self {
        Self {
            state: State::Acquiring {
                acquire,
                waiting: Some(waiting),
            },
        }
    }

    pub(super) fn calling(future: S::Future, permit: Option<Held>) -> Self {
        Self {
            state: State::Calling { future, permit },
        }
    }

    pub(super) fn ready(response: S::Response) -> Self {
        Self {
            state: State::Ready {
                response: Some(response),
            },
        }
    }
}

impl<S, ReqB, R> fmt::Debug for InFlightFuture<S, ReqB, R>
where
    S: Service<Request<ReqB>>,
{
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("InFlightFuture").finish_non_exhaustive()
    }
}

impl<S, ReqB, R, ResB> Future for InFlightFuture<S, ReqB, R>
where
    S: Service<Request<ReqB>, Response = Response<ResB>>,
    R: OnRejection<ReqB, ResB>,
{
    type Output = Result<Response<InFlightBody<ResB>>, S::Error>;

    fn poll(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Self::Output> {
        let mut this = self.project();
        loop {
            match this.state.as_mut().project() {
                StateProj::Acquiring { acquire, waiting } => {
                    let result = ready!(Pin::new(acquire).poll(cx));
                    let Some(waiting) = waiting.take() else {
                        panic!("InFlightFuture polled after completion");
                    };
                    let Waiting {
                        mut service,
                        request,
                        key,
                        shared,
                        rejection,
                        timer,
                    } = waiting;
                    match settle(&shared, &*rejection, result, &key, &request, &timer) {
                        Next::Call(permit) => {
                            let future = service.call(request);
                            this.state.set(State::Calling { future, permit });
                        }
                        Next::Answer(response) => this.state.set(State::Ready {
                            response: Some(response),
                        }),
                    }
                }
                StateProj::Calling { future, permit } => {
                    // On error the permit is dropped with the future.
                    let response = ready!(future.poll(cx))?;
                    let permit = permit.take();
                    return Poll::Ready(Ok(response.map(|body| InFlightBody::new(body, permit))));
                }
                StateProj::Ready { response } => {
                    let response = response
                        .take()
                        .expect("InFlightFuture polled after completion");
                    return Poll::Ready(Ok(response.map(|body| InFlightBody::new(body, None))));
                }
            }
        }
    }
}
