//! [`RateLimit`]: the middleware service.

use std::{
    fmt,
    sync::Arc,
    task::{Context, Poll},
};

use http::{Request, Response};
use tower_service::Service;

use crate::{
    Decision, MissingKey, RequestCost,
    adaptive::Tracked,
    count_after::{Recount, UpFront},
    decide::{Asked, Asking, Next, Shared, wait::Round},
    future::{Pending, ResponseFuture, attach, inform},
    key::{KeyError, KeyExtractor},
    metrics,
    policy::{Exempt, NoExemption},
    rejection::OnRejection,
    rules::{Active, Chosen},
};

/// Rate-limits the requests to `S`. Made by [`RateLimitLayer`](crate::RateLimitLayer).
///
/// Being rate-limited is an answer, not an error: `Error = S::Error`, so an infallible
/// service stays infallible and axum needs no `HandleErrorLayer`. `poll_ready` only asks
/// the inner service; limits never show as back-pressure.
pub struct RateLimit<S, K, C, R, M = UpFront, E = NoExemption> {
    inner: S,
    key: Arc<K>,
    cost: C,
    recount: M,
    exempt: E,
    shared: Arc<Shared<R>>,
    /// The rules this service last saw in force, refreshed when a newer version exists.
    rules: Arc<Active>,
}

impl<S, K, C, R, M, E> RateLimit<S, K, C, R, M, E> {
    pub(crate) fn new(
        inner: S,
        key: Arc<K>,
        cost: C,
        recount: M,
        exempt: E,
        shared: Arc<Shared<R>>,
    ) -> Self {
        let rules = shared.rules.active.load_full();
        Self {
            inner,
            key,
            cost,
            recount,
            exempt,
            shared,
            rules,
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

impl<S: Clone, K, C: Clone, R, M: Clone, E: Clone> Clone for RateLimit<S, K, C, R, M, E> {
    fn clone(&self) -> Self {
        Self {
            inner: self.inner.clone(),
            key: self.key.clone(),
            cost: self.cost.clone(),
            recount: self.recount.clone(),
            exempt: self.exempt.clone(),
            shared: self.shared.clone(),
            rules: self.rules.clone(),
        }
    }
}

impl<S: fmt::Debug, K: fmt::Debug, C: fmt::Debug, R, M, E> fmt::Debug
    for RateLimit<S, K, C, R, M, E>
{
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("RateLimit")
            .field("inner", &self.inner)
            .field("key", &self.key)
            .field("cost", &self.cost)
            .field("limits", self.rules.limits())
            .finish_non_exhaustive()
    }
}

impl<S, K, C, R, M, E, ReqB, ResB> Service<Request<ReqB>> for RateLimit<S, K, C, R, M, E>
where
    S: Service<Request<ReqB>, Response = Response<ResB>> + Clone,
    K: KeyExtractor<ReqB>,
    C: RequestCost<ReqB> + Clone,
    R: OnRejection<ReqB, ResB>,
    M: Recount<ResB>,
    E: Exempt<ReqB>,
{
    type Response = Response<M::Body>;
    type Error = S::Error;
    type Future = ResponseFuture<S, ReqB, R, M>;

    #[inline]
    fn poll_ready(&mut self, cx: &mut Context<'_>) -> Poll<Result<(), Self::Error>> {
        self.inner.poll_ready(cx)
    }

    fn call(&mut self, request: Request<ReqB>) -> Self::Future {
        // The rules this request is decided, answered and given its fields under, even
        // when they change before it is done.
        self.shared.rules.refresh(&mut self.rules);
        if self.exempt.is_exempt(&request) {
            return self.exempted(request);
        }
        let key = match self.key.extract(&request) {
            Ok(key) => key,
            Err(error) => return self.key_missing(request, &error),
        };
        let asked = Asked {
            key,
            cost: self.cost.cost(&request),
            timer: metrics::Timer::start(),
        };
        // One branch for layers without the adaptive stage.
        if self.shared.adaptive.is_some() {
            return self.adapted(request, asked);
        }
        if self.rules.has_plans() {
            return self.planned(request, asked, None);
        }
        let Self {
            inner,
            recount,
            shared,
            rules,
            ..
        } = self;
        // The match here, not in a function given the request: there, the request dropped
        // with a denial kept a copy of every request (one `memcpy`, ~60 instructions a
        // request, benches/instructions.rs).
        match shared.decide(rules, &request, &asked, M::AFTER) {
            // Decided already: the memory store, a block-cache hit, an open circuit.
            Next::Answer(response) => ResponseFuture::ready(response, recount.clone()),
            Next::Call(Some(decision), charged) if rules.headers.writes_when_allowed() => {
                let future = call_inner(inner, request, Some(&decision), rules);
                let rules = Some(rules.clone());
                ResponseFuture::calling(future, Some(decision), rules, charged, recount.clone())
            }
            // Nothing to write: the response needs neither the decision nor the rules.
            // (Borrowed: a decision moved out of `next` costs a copy.)
            Next::Call(ref decision, charged) => {
                let future = call_inner(inner, request, decision.as_ref(), rules);
                ResponseFuture::calling(future, None, None, charged, recount.clone())
            }
            Next::Wait(ticket) => {
                let round = ticket.round();
                let asking = Asking::wait(*ticket, rules, &asked);
                waits(
                    asking, round, inner, shared, rules, recount, request, asked, None,
                )
            }
            Next::Ask(asking) => waits(
                asking,
                Round::First,
                inner,
                shared,
                rules,
                recount,
                request,
                asked,
                None,
            ),
        }
    }
}

/// Decides a request of a layer with plans or the adaptive stage under `rules`, and
/// calls the inner service or answers: what [`call`](Service::call) does inline for the
/// plain layer, with the request's adaptive permit `tracked` riding on the call.
#[allow(clippy::too_many_arguments)]
fn dispatch<S, ReqB, ResB, R, M>(
    inner: &mut S,
    shared: &Arc<Shared<R>>,
    rules: &Arc<Active>,
    recount: &M,
    request: Request<ReqB>,
    asked: Asked,
    tracked: Option<Box<Tracked>>,
) -> ResponseFuture<S, ReqB, R, M>
where
    S: Service<Request<ReqB>, Response = Response<ResB>> + Clone,
    R: OnRejection<ReqB, ResB>,
    M: Recount<ResB>,
{
    match shared.decide(rules, &request, &asked, M::AFTER) {
        // Decided already: the memory store, a block-cache hit, an open circuit. A
        // denial gives the adaptive permit back, without a sample.
        Next::Answer(response) => ResponseFuture::ready(response, recount.clone()),
        Next::Call(Some(decision), charged) if rules.headers.writes_when_allowed() => {
            let charged = attach(charged, tracked, &shared.name, &asked);
            let future = call_inner(inner, request, Some(&decision), rules);
            let rules = Some(rules.clone());
            ResponseFuture::calling(future, Some(decision), rules, charged, recount.clone())
        }
        Next::Call(ref decision, charged) => {
            let charged = attach(charged, tracked, &shared.name, &asked);
            let future = call_inner(inner, request, decision.as_ref(), rules);
            ResponseFuture::calling(future, None, None, charged, recount.clone())
        }
        Next::Wait(ticket) => {
            let round = ticket.round();
            let asking = Asking::wait(*ticket, rules, &asked);
            waits(
                asking, round, inner, shared, rules, recount, request, asked, tracked,
            )
        }
        Next::Ask(asking) => waits(
            asking,
            Round::First,
            inner,
            shared,
            rules,
            recount,
            request,
            asked,
            tracked,
        ),
    }
}

/// The inner service's future for an allowed request, told what was decided when the
/// rules say so.
#[inline(always)]
fn call_inner<S, ReqB>(
    inner: &mut S,
    request: Request<ReqB>,
    decision: Option<&Decision>,
    rules: &Active,
) -> S::Future
where
    S: Service<Request<ReqB>>,
{
    match decision {
        Some(decision) if rules.rules.request_info() => {
            call_informed(inner, request, decision, rules)
        }
        _ => inner.call(request),
    }
}

/// A request that waits for `asking`: the store's answer, or its turn in line. Out of
/// line, and given the request in its own arm: rare, and a request moved towards it in
/// every arm costs every request a copy.
#[allow(clippy::too_many_arguments)]
#[inline(never)]
fn waits<S, ReqB, R, M>(
    asking: Asking,
    round: Round,
    inner: &mut S,
    shared: &Arc<Shared<R>>,
    rules: &Arc<Active>,
    recount: &M,
    request: Request<ReqB>,
    asked: Asked,
    tracked: Option<Box<Tracked>>,
) -> ResponseFuture<S, ReqB, R, M>
where
    S: Service<Request<ReqB>> + Clone,
    M: Clone,
{
    let pending = Pending::new(take_ready(inner), request, asked, round, tracked);
    ResponseFuture::asking(asking, pending, shared, rules, recount.clone())
}

impl<S, K, C, R, M, E> RateLimit<S, K, C, R, M, E> {
    /// [`call`](Service::call) for an [exempt](crate::RateLimitLayer::with_exempt)
    /// request: the inner service, uncounted. Out of line: rare.
    #[inline(never)]
    fn exempted<ReqB, ResB>(&mut self, request: Request<ReqB>) -> ResponseFuture<S, ReqB, R, M>
    where
        S: Service<Request<ReqB>, Response = Response<ResB>>,
        M: Clone,
    {
        self.shared.metrics.request(metrics::Outcome::Exempt);
        let future = self.inner.call(request);
        ResponseFuture::calling(future, None, None, None, self.recount.clone())
    }

    /// [`call`](Service::call) for a layer with the [adaptive](crate::adaptive) stage:
    /// takes the request's permit before the store call (a shed request costs no store
    /// call and no units), then decides it as without. Out of line, so that layers
    /// without it pay one branch for it.
    #[inline(never)]
    fn adapted<ReqB, ResB>(
        &mut self,
        request: Request<ReqB>,
        asked: Asked,
    ) -> ResponseFuture<S, ReqB, R, M>
    where
        S: Service<Request<ReqB>, Response = Response<ResB>> + Clone,
        R: OnRejection<ReqB, ResB>,
        M: Recount<ResB>,
    {
        let Some(stage) = self.shared.adaptive.clone() else {
            return self.planned(request, asked, None);
        };
        let tracked = match stage.admit(&request, &asked.key) {
            Ok(tracked) => tracked,
            Err(shedding) => {
                let mut response = self.shared.rejection.shed(&request, &shedding);
                if !response.headers().contains_key(http::header::RETRY_AFTER) {
                    let ms = u64::try_from(shedding.retry_after.as_millis()).unwrap_or(u64::MAX);
                    let secs = crate::headers::ceil_secs(ms).max(1);
                    response
                        .headers_mut()
                        .insert(http::header::RETRY_AFTER, http::HeaderValue::from(secs));
                }
                return ResponseFuture::ready(response, self.recount.clone());
            }
        };
        if self.rules.has_plans() {
            return self.planned(request, asked, tracked);
        }
        let rules = self.rules.clone();
        let (inner, shared, recount) = (&mut self.inner, &self.shared, &self.recount);
        dispatch(inner, shared, &rules, recount, request, asked, tracked)
    }

    /// [`call`](Service::call) for a layer with [plans](crate::plan): decides the request
    /// under its plan's rules. Out of line, so that layers without plans pay one branch
    /// for them.
    #[inline(never)]
    fn planned<ReqB, ResB>(
        &mut self,
        request: Request<ReqB>,
        asked: Asked,
        tracked: Option<Box<Tracked>>,
    ) -> ResponseFuture<S, ReqB, R, M>
    where
        S: Service<Request<ReqB>, Response = Response<ResB>> + Clone,
        R: OnRejection<ReqB, ResB>,
        M: Recount<ResB>,
    {
        let layer = self.rules.clone();
        let rules = match layer.choose(&request, &asked.key) {
            Ok(Chosen::Layer) => &layer,
            Ok(Chosen::Plan(rules)) => rules,
            Ok(Chosen::Unlimited(plan)) => {
                self.shared.metrics.request(metrics::Outcome::Allowed);
                self.shared.metrics.plan(plan, metrics::Outcome::Allowed);
                let charged = attach(None, tracked, &self.shared.name, &asked);
                let future = self.inner.call(request);
                return ResponseFuture::calling(future, None, None, charged, self.recount.clone());
            }
            Err(resolving) => {
                let pending = Pending::new(
                    take_ready(&mut self.inner),
                    request,
                    asked,
                    Round::First,
                    tracked,
                );
                let recount = self.recount.clone();
                return ResponseFuture::resolving(resolving, pending, &self.shared, layer, recount);
            }
        };
        let (inner, shared, recount) = (&mut self.inner, &self.shared, &self.recount);
        dispatch(inner, shared, rules, recount, request, asked, tracked)
    }

    /// [`call`](Service::call) for a request without a key: the missing-key policy. Out
    /// of line: rare.
    #[inline(never)]
    fn key_missing<ReqB, ResB>(
        &mut self,
        request: Request<ReqB>,
        error: &KeyError,
    ) -> ResponseFuture<S, ReqB, R, M>
    where
        S: Service<Request<ReqB>, Response = Response<ResB>>,
        R: OnRejection<ReqB, ResB>,
        M: Clone,
    {
        self.shared.metrics.request(metrics::Outcome::KeyMissing);
        match self.rules.rules.on_missing_key() {
            MissingKey::Allow => {
                let future = self.inner.call(request);
                ResponseFuture::calling(future, None, None, None, self.recount.clone())
            }
            MissingKey::Reject => {
                tracing::debug!(%error, "rate limit key missing; rejecting");
                let response = self.shared.rejection.key_missing(&request, error);
                ResponseFuture::ready(response, self.recount.clone())
            }
        }
    }
}

/// Calls the inner service with a request that carries its [`RateLimitInfo`]
/// (`request_info`). Out of line: changing the request in `call` cost every request a
/// copy of it (one `memcpy` of the request, ~60 instructions, measured by
/// benches/instructions.rs).
///
/// [`RateLimitInfo`]: crate::RateLimitInfo
#[inline(never)]
fn call_informed<S, ReqB>(
    inner: &mut S,
    mut request: Request<ReqB>,
    decision: &Decision,
    rules: &Active,
) -> S::Future
where
    S: Service<Request<ReqB>>,
{
    inform(&mut request, decision, rules);
    inner.call(request)
}

/// The service that was polled ready, for a request that waits for the store; its clone
/// goes on serving.
fn take_ready<S: Clone>(inner: &mut S) -> S {
    let clone = inner.clone();
    std::mem::replace(inner, clone)
}
