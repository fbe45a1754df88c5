//! [`ResponseFuture`]: waits for the store's decision (a plan lookup first, a wait in
//! line after), then answers or calls the inner service.

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

use crate::{
    Decision, RateLimitInfo,
    adaptive::Tracked,
    count_after::{Charged, Recount, UpFront},
    decide::{Asked, Asking, Next, Shared, settle, wait::Round},
    metrics::Outcome,
    rejection::OnRejection,
    rules::{Active, Chosen, Resolving},
};

pin_project! {
    /// The response future of [`RateLimit`](crate::RateLimit).
    pub struct ResponseFuture<S, ReqB, R, M = UpFront>
    where
        S: Service<Request<ReqB>>,
    {
        #[pin]
        state: State<S, ReqB, R>,
        recount: M,
    }
}

pin_project! {
    #[project = StateProj]
    enum State<S, ReqB, R>
    where
        S: Service<Request<ReqB>>,
    {
        // Waiting for the store (or for its turn in line), under `rules`.
        Asking {
            asking: Asking,
            pending: Option<Pending<S, ReqB>>,
            shared: Arc<Shared<R>>,
            rules: Arc<Active>,
        },
        // A layer with plans, waiting for a plan lookup (`layer`: the layer's rules).
        Resolving {
            resolving: Resolving,
            pending: Option<Pending<S, ReqB>>,
            shared: Arc<Shared<R>>,
            layer: Arc<Active>,
        },
        Calling {
            #[pin]
            future: S::Future,
            // The decision whose fields the response gets, as `rules` write them (apart,
            // not a tuple: building one costs every request a copy of the decision).
            decision: Option<Decision>,
            rules: Option<Arc<Active>>,
            charged: Option<Box<Charged>>,
        },
        Ready {
            response: Option<S::Response>,
        },
    }
}

/// What a request that waits for the store needs once it has answered.
pub(crate) struct Pending<S, ReqB> {
    service: S,
    request: Request<ReqB>,
    asked: Asked,
    round: Round,
    /// The adaptive permit, held while the request waits (its latency counts from the
    /// call to the inner service).
    tracked: Option<Box<Tracked>>,
}

impl<S, ReqB> Pending<S, ReqB> {
    pub(crate) fn new(
        service: S,
        request: Request<ReqB>,
        asked: Asked,
        round: Round,
        tracked: Option<Box<Tracked>>,
    ) -> Self {
        Self {
            service,
            request,
            asked,
            round,
            tracked,
        }
    }
}

/// `charged`, holding the adaptive permit `tracked` of the request `asked` about, if it
/// has one: the request reaches the inner service now.
pub(crate) fn attach(
    charged: Option<Box<Charged>>,
    tracked: Option<Box<Tracked>>,
    name: &Arc<str>,
    asked: &Asked,
) -> Option<Box<Charged>> {
    let Some(mut tracked) = tracked else {
        return charged;
    };
    tracked.called();
    let charged = charged.unwrap_or_else(|| {
        Box::new(Charged::new(
            name.clone(),
            asked.key.clone(),
            asked.cost,
            [None, None],
        ))
    });
    Some(charged.tracking(tracked))
}

impl<S, ReqB, R, M> ResponseFuture<S, ReqB, R, M>
where
    S: Service<Request<ReqB>>,
{
    pub(crate) fn asking(
        asking: Asking,
        pending: Pending<S, ReqB>,
        shared: &Arc<Shared<R>>,
        rules: &Arc<Active>,
        recount: M,
    ) -> Self {
        Self {
            state: State::Asking {
                asking,
                pending: Some(pending),
                shared: shared.clone(),
                rules: rules.clone(),
            },
            recount,
        }
    }

    pub(crate) fn resolving(
        resolving: Resolving,
        pending: Pending<S, ReqB>,
        shared: &Arc<Shared<R>>,
        layer: Arc<Active>,
        recount: M,
    ) -> Self {
        Self {
            state: State::Resolving {
                resolving,
                pending: Some(pending),
                shared: shared.clone(),
                layer,
            },
            recount,
        }
    }

    /// The inner service's future, whose response gets the fields of `decision` as
    /// `rules` write them (none without both) and settles the `charged` units.
    pub(crate) fn calling(
        future: S::Future,
        decision: Option<Decision>,
        rules: Option<Arc<Active>>,
        charged: Option<Box<Charged>>,
        recount: M,
    ) -> Self {
        Self {
            state: State::Calling {
                future,
                decision,
                rules,
                charged,
            },
            recount,
        }
    }

    pub(crate) fn ready(response: S::Response, recount: M) -> Self {
        Self {
            state: State::Ready {
                response: Some(response),
            },
            recount,
        }
    }
}

/// The state a request goes on in once settled under `rules`: answered, calling the
/// inner service, or waiting its turn.
fn proceed<S, ReqB, ResB, R>(
    next: Next<ResB>,
    shared: &Arc<Shared<R>>,
    rules: &Arc<Active>,
    pending: Pending<S, ReqB>,
) -> State<S, ReqB, R>
where
    S: Service<Request<ReqB>, Response = Response<ResB>>,
{
    let Pending {
        mut service,
        mut request,
        asked,
        round,
        tracked,
    } = pending;
    match next {
        // A denial gives the adaptive permit back, without a sample.
        Next::Answer(response) => State::Ready {
            response: Some(response),
        },
        Next::Call(decision, charged) => State::Calling {
            future: {
                if rules.rules.request_info()
                    && let Some(decision) = &decision
                {
                    inform(&mut request, decision, rules);
                }
                service.call(request)
            },
            rules: decision.as_ref().map(|_| rules.clone()),
            decision,
            charged: attach(charged, tracked, &shared.name, &asked),
        },
        Next::Wait(ticket) => {
            let round = ticket.round();
            State::Asking {
                asking: Asking::wait(*ticket, rules, &asked),
                pending: Some(Pending::new(service, request, asked, round, tracked)),
                shared: shared.clone(),
                rules: rules.clone(),
            }
        }
        Next::Ask(asking) => State::Asking {
            asking,
            pending: Some(Pending::new(service, request, asked, round, tracked)),
            shared: shared.clone(),
            rules: rules.clone(),
        },
    }
}

/// Tells the inner service what was decided: [`RateLimitInfo`] in the request's
/// extensions.
#[inline(never)]
pub(crate) fn inform<ReqB>(request: &mut Request<ReqB>, decision: &Decision, rules: &Active) {
    let info = RateLimitInfo::new(decision.clone(), rules.plan.clone());
    request.extensions_mut().insert(info);
}

/// Asks the store about `pending` under `rules` (its plan's, once known).
fn start<S, ReqB, ResB, R>(
    shared: &Arc<Shared<R>>,
    rules: &Arc<Active>,
    pending: Pending<S, ReqB>,
    counts: bool,
) -> State<S, ReqB, R>
where
    S: Service<Request<ReqB>, Response = Response<ResB>>,
    R: OnRejection<ReqB, ResB>,
{
    let next = shared.decide(rules, &pending.request, &pending.asked, counts);
    proceed(next, shared, rules, pending)
}

impl<S, ReqB, R, M> fmt::Debug for ResponseFuture<S, ReqB, R, M>
where
    S: Service<Request<ReqB>>,
{
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("ResponseFuture").finish_non_exhaustive()
    }
}

impl<S, ReqB, R, M, ResB> Future for ResponseFuture<S, ReqB, R, M>
where
    S: Service<Request<ReqB>, Response = Response<ResB>>,
    R: OnRejection<ReqB, ResB>,
    M: Recount<ResB>,
{
    type Output = Result<Response<M::Body>, S::Error>;

    fn poll(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Self::Output> {
        let mut this = self.project();
        loop {
            let state = match this.state.as_mut().project() {
                StateProj::Asking {
                    asking,
                    pending,
                    shared,
                    rules,
                } => {
                    // The store's timeout and circuit breaker are inside `asking`.
                    let answer = ready!(asking.poll(cx));
                    let pending = pending.take().expect("polled after completion");
                    let next = settle(
                        shared,
                        rules,
                        answer,
                        &pending.request,
                        &pending.asked,
                        pending.round,
                        M::AFTER,
                    );
                    proceed(next, shared, rules, pending)
                }
                StateProj::Resolving {
                    resolving,
                    pending,
                    shared,
                    layer,
                } => {
                    let name = ready!(Pin::new(resolving).poll(cx));
                    let mut pending = pending.take().expect("polled after completion");
                    match layer.named(name.as_deref()) {
                        Chosen::Layer => start(shared, layer, pending, M::AFTER),
                        Chosen::Plan(rules) => start(shared, rules, pending, M::AFTER),
                        Chosen::Unlimited(plan) => {
                            shared.metrics.request(Outcome::Allowed);
                            shared.metrics.plan(plan, Outcome::Allowed);
                            let tracked = pending.tracked.take();
                            State::Calling {
                                charged: attach(None, tracked, &shared.name, &pending.asked),
                                future: pending.service.call(pending.request),
                                decision: None,
                                rules: None,
                            }
                        }
                    }
                }
                StateProj::Calling {
                    future,
                    decision,
                    rules,
                    charged,
                } => {
                    // An error keeps the charge: `charged` is dropped unsettled (and its
                    // adaptive permit counts a drop).
                    let mut response = match ready!(future.poll(cx)) {
                        Ok(response) => response,
                        Err(error) => {
                            if let Some(charged) = charged {
                                charged.failed();
                            }
                            return Poll::Ready(Err(error));
                        }
                    };
                    if let (Some(decision), Some(rules)) = (decision.take(), rules.as_ref()) {
                        rules.headers.write(response.headers_mut(), &decision);
                    }
                    let charged = match charged.take() {
                        Some(mut charged) => {
                            response = charged.head(response);
                            Some(*charged)
                        }
                        None => None,
                    };
                    return Poll::Ready(Ok(this.recount.finish(response, charged)));
                }
                StateProj::Ready { response } => {
                    let response = response.take().expect("polled after completion");
                    return Poll::Ready(Ok(this.recount.finish(response, None)));
                }
            };
            this.state.set(state);
        }
    }
}
