//! [`ResponseFuture`]: waits for the store's decision, then answers or calls the inner
//! service.

use std::{
    fmt,
    future::Future,
    ops::ControlFlow,
    pin::Pin,
    sync::Arc,
    task::{Context, Poll, ready},
};

use futures_util::FutureExt;
use http::{Request, Response};
use pin_project_lite::pin_project;
use tower_service::Service;

use crate::{
    Decision,
    decide::{Asked, Checks, Next, Shared, settle, settle_shadowed},
    plan::{self, Chosen, Resolving, Started},
    rejection::OnRejection,
    rules::Active,
    store::Check,
    wait::Ticket,
};

pin_project! {
    /// The response future of [`RateLimit`](crate::RateLimit).
    pub struct ResponseFuture<S, ReqB, R>
    where
        S: Service<Request<ReqB>>,
    {
        #[pin]
        state: State<S, ReqB>,
        // Set while checking.
        shared: Option<Arc<Shared<R>>>,
        // The rules the request is decided and answered under: set while checking, and
        // while calling with a decision whose fields the response gets.
        rules: Option<Arc<Active>>,
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
            pending: Option<Pending<S, ReqB>>,
        },
        // A layer with plans, waiting for a plan lookup (`rules` are the layer's).
        Resolving {
            resolving: Resolving,
            pending: Option<Pending<S, ReqB>>,
        },
        // A layer with shadow limits: its two store calls.
        Shadowing {
            checks: Checks,
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
    /// It [waited](crate::wait) its turn already: a denial now is final.
    pub(crate) waited: bool,
}

impl<S, ReqB, R> ResponseFuture<S, ReqB, R>
where
    S: Service<Request<ReqB>>,
{
    pub(crate) fn checking(
        check: Check,
        pending: Pending<S, ReqB>,
        shared: Arc<Shared<R>>,
        rules: Arc<Active>,
    ) -> Self {
        Self {
            state: State::Checking {
                check,
                pending: Some(pending),
            },
            shared: Some(shared),
            rules: Some(rules),
        }
    }

    pub(crate) fn shadowing(
        checks: Checks,
        pending: Pending<S, ReqB>,
        shared: Arc<Shared<R>>,
        rules: Arc<Active>,
    ) -> Self {
        Self {
            state: State::Shadowing {
                checks,
                pending: Some(pending),
            },
            shared: Some(shared),
            rules: Some(rules),
        }
    }

    pub(crate) fn resolving(
        resolving: Resolving,
        pending: Pending<S, ReqB>,
        shared: Arc<Shared<R>>,
        rules: Arc<Active>,
    ) -> Self {
        Self {
            state: State::Resolving {
                resolving,
                pending: Some(pending),
            },
            shared: Some(shared),
            rules: Some(rules),
        }
    }

    pub(crate) fn unlimited(future: S::Future) -> Self {
        Self {
            state: State::Calling {
                future,
                decision: None,
            },
            shared: None,
            rules: None,
        }
    }

    /// The inner service's future, whose response gets `decision`'s fields as `rules`
    /// write them.
    pub(crate) fn calling(future: S::Future, decision: Decision, rules: Arc<Active>) -> Self {
        Self {
            state: State::Calling {
                future,
                decision: Some(decision),
            },
            shared: None,
            rules: Some(rules),
        }
    }

    pub(crate) fn ready(response: S::Response) -> Self {
        Self {
            state: State::Ready {
                response: Some(response),
            },
            shared: None,
            rules: None,
        }
    }
}

/// The state of a denied request that waits its turn ([`wait`](crate::wait)): the wait
/// and the store's fresh answer, as a check.
fn wait<S, ReqB, R>(
    ticket: Ticket,
    shared: &Shared<R>,
    rules: &Arc<Active>,
    service: S,
    request: Request<ReqB>,
    asked: Asked,
) -> State<S, ReqB>
where
    S: Service<Request<ReqB>>,
{
    let check = ticket.wait(
        shared.store.clone(),
        rules.clone(),
        asked.key.clone(),
        asked.cost,
    );
    State::Checking {
        check,
        pending: Some(Pending {
            service,
            request,
            asked,
            waited: true,
        }),
    }
}

/// What a waiting request does once settled: the answer to give now (`Break`), or the
/// state to go on in (calling the inner service, or waiting its turn).
fn proceed<S, ReqB, R, ResB>(
    next: Next<ResB>,
    shared: &Shared<R>,
    rules: &Arc<Active>,
    pending: Pending<S, ReqB>,
) -> ControlFlow<Response<ResB>, State<S, ReqB>>
where
    S: Service<Request<ReqB>>,
{
    let Pending {
        mut service,
        request,
        asked,
        ..
    } = pending;
    match next {
        Next::Answer(response) => ControlFlow::Break(response),
        Next::Call(decision) => ControlFlow::Continue(State::Calling {
            future: service.call(request),
            decision,
        }),
        Next::Wait(ticket) => {
            ControlFlow::Continue(wait(*ticket, shared, rules, service, request, asked))
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
                StateProj::Checking { check, pending } => {
                    let shared = this.shared.as_ref().expect("checking without config");
                    let rules = this.rules.as_ref().expect("checking without rules");
                    // The store's timeout and circuit breaker are inside `check`.
                    let result = ready!(check.poll_unpin(cx));
                    let pending = pending.take().expect("polled after completion");
                    let next = settle(
                        shared,
                        rules,
                        result,
                        &pending.request,
                        &pending.asked,
                        pending.waited,
                    );
                    match proceed(next, shared, rules, pending) {
                        ControlFlow::Break(response) => return Poll::Ready(Ok(response)),
                        ControlFlow::Continue(state) => this.state.set(state),
                    }
                }
                StateProj::Resolving { resolving, pending } => {
                    let shared = this.shared.as_ref().expect("resolving without config");
                    let name = ready!(Pin::new(resolving).poll(cx));
                    let layer = this.rules.take().expect("resolving without rules");
                    let mut pending = pending.take().expect("polled after completion");
                    let rules = match layer.named(name.as_deref()) {
                        Chosen::Layer => layer.clone(),
                        Chosen::Plan(rules) => rules.clone(),
                        Chosen::Unlimited(name) => {
                            plan::unlimited(shared, name);
                            let future = pending.service.call(pending.request);
                            this.state.set(State::Calling {
                                future,
                                decision: None,
                            });
                            continue;
                        }
                    };
                    let started = plan::start(shared, &rules, &pending.request, &pending.asked);
                    *this.rules = Some(rules);
                    match started {
                        Started::Next(next) => {
                            let rules = this.rules.as_ref().expect("rules set above");
                            match proceed(next, shared, rules, pending) {
                                ControlFlow::Break(response) => return Poll::Ready(Ok(response)),
                                ControlFlow::Continue(state) => this.state.set(state),
                            }
                        }
                        Started::Check(check) => this.state.set(State::Checking {
                            check,
                            pending: Some(pending),
                        }),
                        Started::Checks(checks) => this.state.set(State::Shadowing {
                            checks,
                            pending: Some(pending),
                        }),
                    }
                }
                StateProj::Shadowing { checks, pending } => {
                    let shared = this.shared.as_ref().expect("checking without config");
                    let rules = this.rules.as_ref().expect("checking without rules");
                    let answers = ready!(Pin::new(checks).poll(cx));
                    let pending = pending.take().expect("polled after completion");
                    let next =
                        settle_shadowed(shared, rules, answers, &pending.request, &pending.asked);
                    match proceed(next, shared, rules, pending) {
                        ControlFlow::Break(response) => return Poll::Ready(Ok(response)),
                        ControlFlow::Continue(state) => this.state.set(state),
                    }
                }
                StateProj::Calling { future, decision } => {
                    let mut response = ready!(future.poll(cx))?;
                    if let (Some(decision), Some(rules)) = (decision.take(), this.rules.as_ref()) {
                        rules.headers.write(response.headers_mut(), &decision);
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
