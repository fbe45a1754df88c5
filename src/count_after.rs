//! Counting after the response: units that stay spent only when the response says so
//! ([`count_when`](crate::RateLimitLayer::count_when)), and costs known only once the
//! response (or its trailers) is there ([`late_cost`](crate::RateLimitLayer::late_cost),
//! [`late_cost_from_trailers`](crate::RateLimitLayer::late_cost_from_trailers)).
//!
//! # How it counts
//!
//! A request is decided before the inner service runs, exactly as without this: a key
//! over its limit is rejected, and an allowed request's cost is **spent up front**. Once
//! the response is there, the units it should not have cost are given back (a
//! [refund](crate::Adjustment::Refund)), and units it cost beyond its up-front cost are
//! charged (a [top-up](crate::Adjustment::TopUp), counted even over the limit, so that
//! later requests wait until it is paid off).
//!
//! Spending first is what keeps the limit: **at any moment, the units kept plus the units
//! of the requests still in flight are at most the limit** (per window, for the windowed
//! algorithms). Concurrent requests cannot slip through between a check and a charge,
//! because there is no such gap; the price is that a request in flight holds its units
//! until its response says whether to keep them.
//!
//! - A response future dropped before the response (the client hung up) and an inner
//!   service error **keep the units spent**: nothing says the request should not count,
//!   and a client must not escape the count by hanging up (a login attempt it abandons
//!   may have been checked).
//! - A denied request, a request without a key let through, and a request the failure
//!   policy let through (the store failed) are not adjusted: nothing was charged to the
//!   store (a local fallback store's charge stays there).
//! - The adjustment is sent when the response (or the body's end, for trailers) is
//!   there, without making the response wait for it. On the memory store it is applied
//!   at once; on Redis it joins the queue of coalesced decisions in order, so a request
//!   sent after the response is decided after it (with coalescing off, it may overtake).
//!   A failed adjustment is logged at `warn` and changes nothing.
//! - The response's rate-limit fields are those of the up-front decision.
//! - A count-after layer decides under the layer's own limits and shadow limits: it does
//!   not apply [plans](crate::plan) or [`max_wait`](crate::RateLimitLayer::max_wait)
//!   (a waiting request would hold its charge across the wait). Put plans, or waiting,
//!   in a layer of their own.
//! - The store must implement [`Store::adjust`](crate::Store::adjust) (the memory and
//!   Redis stores do) and say when it decided
//!   ([`Decision::decided_at_ms`](crate::Decision::decided_at_ms)); otherwise units stay
//!   spent.
//!
//! ```
//! use std::time::Duration;
//! use tollgate::{Limit, RateLimitLayer, key::GlobalKey};
//!
//! // Five failed logins a minute; successful ones do not count.
//! let layer = RateLimitLayer::new(Limit::per_minute(5)?)
//!     .key(GlobalKey)
//!     .count_when(|response: &http::Response<axum::body::Body>| {
//!         response.status().is_client_error()
//!     });
//! # let _ = layer;
//! # Ok::<(), tollgate::ConfigError>(())
//! ```

use std::{
    fmt,
    future::Future,
    pin::Pin,
    sync::Arc,
    task::{Context, Poll, ready},
};

use http::{HeaderMap, Request, Response};
use http_body::{Body, Frame, SizeHint};
use pin_project_lite::pin_project;
use tower_layer::Layer;
use tower_service::Service;

use crate::{
    Adjustment, Decision, Limit, MissingKey, RateLimitLayer, RequestCost, StoreError,
    decide::{Answers, Asked, Checks, Next, Shared, settle, settle_shadowed},
    key::{Key, KeyExtractor},
    metrics,
    rejection::OnRejection,
    rules::Active,
    store::{Check, Guarded},
};

/// Decides, from the response, what a request finally costs. Implemented by
/// [`CountWhen`], [`LateCost`] and [`TrailerCost`], made by the layer's builder methods.
pub trait Recount<B>: Clone + Send + Sync + 'static {
    /// The body of the responses the service answers with.
    type Body;

    /// Settles `charged` (the request's up-front charge, `None` when nothing was charged)
    /// from `response`, and passes the response on.
    fn finish(&self, response: Response<B>, charged: Option<Charged>) -> Response<Self::Body>;
}

/// Keeps a request's units only when the predicate holds on its response. Made by
/// [`RateLimitLayer::count_when`].
#[derive(Clone, Copy)]
pub struct CountWhen<P>(P);

// By hand: closures are not `Debug`.
impl<F> fmt::Debug for CountWhen<F> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("CountWhen(..)")
    }
}

impl<B, P> Recount<B> for CountWhen<P>
where
    P: Fn(&Response<B>) -> bool + Clone + Send + Sync + 'static,
{
    type Body = B;

    fn finish(&self, response: Response<B>, charged: Option<Charged>) -> Response<B> {
        if let Some(charged) = charged {
            let units = if (self.0)(&response) { charged.cost } else { 0 };
            charged.settle(units);
        }
        response
    }
}

/// Charges what the response says the request cost (`None`: its up-front cost). Made by
/// [`RateLimitLayer::late_cost`].
#[derive(Clone, Copy)]
pub struct LateCost<F>(F);

// By hand: closures are not `Debug`.
impl<F> fmt::Debug for LateCost<F> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("LateCost(..)")
    }
}

impl<B, F> Recount<B> for LateCost<F>
where
    F: Fn(&Response<B>) -> Option<u32> + Clone + Send + Sync + 'static,
{
    type Body = B;

    fn finish(&self, response: Response<B>, charged: Option<Charged>) -> Response<B> {
        if let Some(charged) = charged {
            let cost = charged.cost;
            charged.settle((self.0)(&response).unwrap_or(cost));
        }
        response
    }
}

/// Charges what the response's trailers say the request cost, once its body ends
/// (`None`, or no trailers: its up-front cost). A trailers-only gRPC response
/// (`grpc-status` in its headers) is read at once, its headers as its trailers. Made by
/// [`RateLimitLayer::late_cost_from_trailers`]; responses get a [`CountedBody`].
#[derive(Clone, Copy)]
pub struct TrailerCost<F>(F);

// By hand: closures are not `Debug`.
impl<F> fmt::Debug for TrailerCost<F> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("TrailerCost(..)")
    }
}

impl<B, F> Recount<B> for TrailerCost<F>
where
    F: Fn(Option<&HeaderMap>) -> Option<u32> + Clone + Send + Sync + 'static,
{
    type Body = CountedBody<B, F>;

    fn finish(&self, response: Response<B>, charged: Option<Charged>) -> Response<Self::Body> {
        // A trailers-only gRPC answer (an error status, most often) carries its trailers
        // in its headers: they are read now.
        let charged = match charged {
            Some(charged) if response.headers().contains_key("grpc-status") => {
                let cost = charged.cost;
                charged.settle((self.0)(Some(response.headers())).unwrap_or(cost));
                None
            }
            charged => charged,
        };
        response.map(|inner| CountedBody {
            inner,
            pending: charged.map(|charged| (charged, self.0.clone())),
        })
    }
}

pin_project! {
    /// A response body that settles its request's charge from its trailers when it ends.
    /// A body dropped before its end keeps the charge.
    pub struct CountedBody<B, F> {
        #[pin]
        inner: B,
        pending: Option<(Charged, F)>,
    }
}

impl<B, F> CountedBody<B, F> {
    /// The body it wraps, for a response that needs no counting.
    pub fn new(inner: B) -> Self {
        Self {
            inner,
            pending: None,
        }
    }
}

impl<B: fmt::Debug, F> fmt::Debug for CountedBody<B, F> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("CountedBody")
            .field("inner", &self.inner)
            .field("pending", &self.pending.as_ref().map(|(c, _)| c))
            .finish()
    }
}

impl<B, F> Body for CountedBody<B, F>
where
    B: Body,
    F: Fn(Option<&HeaderMap>) -> Option<u32>,
{
    type Data = B::Data;
    type Error = B::Error;

    fn poll_frame(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Self::Data>, Self::Error>>> {
        let this = self.project();
        let frame = ready!(this.inner.poll_frame(cx));
        match &frame {
            Some(Ok(frame)) => {
                if let Some(trailers) = frame.trailers_ref()
                    && let Some((charged, read)) = this.pending.take()
                {
                    let cost = charged.cost;
                    charged.settle(read(Some(trailers)).unwrap_or(cost));
                }
            }
            None => {
                if let Some((charged, read)) = this.pending.take() {
                    let cost = charged.cost;
                    charged.settle(read(None).unwrap_or(cost));
                }
            }
            // A body that failed keeps the charge.
            Some(Err(_)) => {
                this.pending.take();
            }
        }
        Poll::Ready(frame)
    }

    fn is_end_stream(&self) -> bool {
        // Not before the charge is settled: the last poll, which sees the end, settles it.
        self.pending.is_none() && self.inner.is_end_stream()
    }

    fn size_hint(&self) -> SizeHint {
        self.inner.size_hint()
    }
}

/// What a layer's services share for their adjustments.
#[derive(Debug)]
struct After {
    store: Guarded,
    name: Arc<str>,
}

/// A request's up-front charge, until its response settles it: dropped unsettled, the
/// units stay spent.
pub struct Charged {
    after: Arc<After>,
    key: Key,
    cost: u32,
    /// The limits charged, and when: the enforced ones and the shadow ones (each only
    /// when its call allowed the request).
    charges: [Option<(Arc<[Limit]>, u64)>; 2],
}

impl fmt::Debug for Charged {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Charged")
            .field("key", &self.key.redacted())
            .field("cost", &self.cost)
            .finish_non_exhaustive()
    }
}

impl Charged {
    /// The units charged up front.
    pub fn cost(&self) -> u32 {
        self.cost
    }

    /// Makes the request cost `units` in the end: gives back or charges the difference.
    pub fn settle(self, units: u32) {
        let adjustment = |at: u64| {
            if units < self.cost {
                Some(Adjustment::Refund {
                    units: self.cost - units,
                    charged_at_ms: at,
                })
            } else if units > self.cost {
                Some(Adjustment::TopUp {
                    units: units - self.cost,
                })
            } else {
                None
            }
        };
        for (limits, at) in self.charges.iter().flatten() {
            let Some(adjustment) = adjustment(*at) else {
                continue;
            };
            match self.after.store.adjust_now(&self.key, limits, adjustment) {
                Ok(result) => self.report(result),
                Err(check) => self.wait(check),
            }
        }
    }

    /// Lets a pending adjustment finish on its own: it is already queued in order (see
    /// the [module docs](self)); only its outcome is waited for.
    fn wait(&self, check: Check) {
        let Ok(runtime) = tokio::runtime::Handle::try_current() else {
            tracing::warn!(
                layer = &*self.after.name,
                "rate limit adjustment dropped: no runtime"
            );
            return;
        };
        let after = self.after.clone();
        let key = self.key.redacted().to_string();
        runtime.spawn(async move {
            if let Err(error) = check.await {
                let error = error.chain();
                tracing::warn!(error = %error, key, layer = &*after.name, "rate limit adjustment failed");
            }
        });
    }

    fn report(&self, result: Result<Decision, StoreError>) {
        if let Err(error) = result {
            let error = error.chain();
            let key = self.key.redacted();
            tracing::warn!(error = %error, key = %key, layer = &*self.after.name, "rate limit adjustment failed");
        }
    }
}

/// [`RateLimitLayer`] whose requests are counted after their response: see the
/// [module docs](self). Made by [`RateLimitLayer::count_when`],
/// [`late_cost`](RateLimitLayer::late_cost) and
/// [`late_cost_from_trailers`](RateLimitLayer::late_cost_from_trailers).
#[derive(Debug, Clone)]
pub struct CountAfterLayer<K, C, R, M> {
    layer: RateLimitLayer<K, C, R>,
    recount: M,
}

impl<K, C, R> RateLimitLayer<K, C, R> {
    /// Keeps a request's units spent only when `predicate` holds on its response (say,
    /// only failed logins count). The request is still checked first, so a key over its
    /// limit is rejected; see [`count_after`](crate::count_after) for the bound that holds
    /// while requests are in flight, and what a dropped response or an error counts.
    pub fn count_when<P, B>(self, predicate: P) -> CountAfterLayer<K, C, R, CountWhen<P>>
    where
        P: Fn(&Response<B>) -> bool,
    {
        CountAfterLayer {
            layer: self,
            recount: CountWhen(predicate),
        }
    }

    /// Charges what `cost` reads from the response (say, a header with the tokens a
    /// request used): the difference to the up-front [cost](Self::cost) is given back or
    /// charged late, even over the limit. `None` keeps the up-front cost. See
    /// [`count_after`](crate::count_after).
    pub fn late_cost<F, B>(self, cost: F) -> CountAfterLayer<K, C, R, LateCost<F>>
    where
        F: Fn(&Response<B>) -> Option<u32>,
    {
        CountAfterLayer {
            layer: self,
            recount: LateCost(cost),
        }
    }

    /// [`late_cost`](Self::late_cost) from the response's trailers (a gRPC trailer with
    /// the tokens used, or `grpc-status` to count only failed calls), read when the body
    /// ends; `cost` gets `None` when the body had no trailers. A trailers-only gRPC
    /// response (`grpc-status` in its headers, as tonic answers an error) is read at
    /// once, its headers standing for its trailers. The service answers with a
    /// [`CountedBody`].
    pub fn late_cost_from_trailers<F>(self, cost: F) -> CountAfterLayer<K, C, R, TrailerCost<F>>
    where
        F: Fn(Option<&HeaderMap>) -> Option<u32>,
    {
        CountAfterLayer {
            layer: self,
            recount: TrailerCost(cost),
        }
    }
}

impl<S, K, C: Clone, R: Clone, M: Clone> Layer<S> for CountAfterLayer<K, C, R, M> {
    type Service = CountAfter<S, K, C, R, M>;

    fn layer(&self, inner: S) -> Self::Service {
        // Without `max_wait`: a waiting request would hold its charge across the wait,
        // which the count-after bound does not cover (see `count_when`).
        let (key, cost, shared) = self.layer.parts_waiting(false);
        let rules = shared.rules.active.load_full();
        if rules.has_plans() {
            tracing::warn!(
                layer = &*shared.name,
                "a count-after layer decides under its own limits: its plans are not applied"
            );
        }
        let after = Arc::new(After {
            store: shared.store.clone(),
            name: shared.name.clone(),
        });
        CountAfter {
            inner,
            key,
            cost,
            shared,
            rules,
            after,
            recount: self.recount.clone(),
        }
    }
}

/// The service of a [`CountAfterLayer`].
pub struct CountAfter<S, K, C, R, M> {
    inner: S,
    key: Arc<K>,
    cost: C,
    shared: Arc<Shared<R>>,
    rules: Arc<Active>,
    after: Arc<After>,
    recount: M,
}

impl<S: Clone, K, C: Clone, R, M: Clone> Clone for CountAfter<S, K, C, R, M> {
    fn clone(&self) -> Self {
        Self {
            inner: self.inner.clone(),
            key: self.key.clone(),
            cost: self.cost.clone(),
            shared: self.shared.clone(),
            rules: self.rules.clone(),
            after: self.after.clone(),
            recount: self.recount.clone(),
        }
    }
}

impl<S: fmt::Debug, K: fmt::Debug, C: fmt::Debug, R, M> fmt::Debug for CountAfter<S, K, C, R, M> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("CountAfter")
            .field("inner", &self.inner)
            .field("key", &self.key)
            .field("cost", &self.cost)
            .field("limits", self.rules.limits())
            .finish_non_exhaustive()
    }
}

impl<S, K, C, R, M, ReqB, ResB> Service<Request<ReqB>> for CountAfter<S, K, C, R, M>
where
    S: Service<Request<ReqB>, Response = Response<ResB>> + Clone,
    K: KeyExtractor<ReqB>,
    C: RequestCost<ReqB> + Clone,
    R: OnRejection<ReqB, ResB>,
    M: Recount<ResB>,
{
    type Response = Response<M::Body>;
    type Error = S::Error;
    type Future = CountAfterFuture<S, ReqB, R, M>;

    #[inline]
    fn poll_ready(&mut self, cx: &mut Context<'_>) -> Poll<Result<(), Self::Error>> {
        self.inner.poll_ready(cx)
    }

    fn call(&mut self, request: Request<ReqB>) -> Self::Future {
        self.shared.rules.refresh(&mut self.rules);
        let parts = Parts {
            shared: self.shared.clone(),
            rules: self.rules.clone(),
            after: self.after.clone(),
            recount: self.recount.clone(),
        };
        let key = match self.key.extract(&request) {
            Ok(key) => key,
            Err(error) => {
                self.shared.metrics.request(metrics::Outcome::KeyMissing);
                let state = match self.rules.rules.on_missing_key() {
                    MissingKey::Allow => State::Calling {
                        future: self.inner.call(request),
                        decision: None,
                        charged: None,
                    },
                    MissingKey::Reject => {
                        let response = self.shared.rejection.key_missing(&request, &error);
                        State::Ready {
                            response: Some(response),
                        }
                    }
                };
                return CountAfterFuture { state, parts };
            }
        };
        let cost = self.cost.cost(&request);
        let asked = Asked {
            key,
            cost,
            timer: metrics::Timer::start(),
        };
        let waiting = match self.rules.shadow() {
            None => match self
                .shared
                .store
                .check_now(&asked.key, self.rules.limits(), cost)
            {
                Ok(result) => {
                    let (next, charged) = parts.settle(Answer::One(result), &request, asked);
                    let state = parts.next(next, charged, || self.inner.call(request));
                    return CountAfterFuture { state, parts };
                }
                Err(check) => Waiting::One(check),
            },
            Some(shadow) => {
                match Checks::start(&self.shared.store, &asked, self.rules.limits(), &shadow[..]) {
                    Ok(answers) => {
                        let (next, charged) =
                            parts.settle(Answer::Shadowed(answers), &request, asked);
                        let state = parts.next(next, charged, || self.inner.call(request));
                        return CountAfterFuture { state, parts };
                    }
                    Err(checks) => Waiting::Both(checks),
                }
            }
        };
        let clone = self.inner.clone();
        let service = std::mem::replace(&mut self.inner, clone);
        CountAfterFuture {
            state: State::Checking {
                waiting,
                pending: Some((service, request, asked)),
            },
            parts,
        }
    }
}

/// The store's answer about a request: one call, or the enforced and shadow calls.
enum Answer {
    One(Result<Decision, StoreError>),
    Shadowed(Answers),
}

/// The store call a request waits for.
enum Waiting {
    One(Check),
    Both(Checks),
}

/// What a [`CountAfterFuture`] holds besides its state.
struct Parts<R, M> {
    shared: Arc<Shared<R>>,
    rules: Arc<Active>,
    after: Arc<After>,
    recount: M,
}

impl<R, M> Parts<R, M> {
    /// [`settle`] (or [`settle_shadowed`]), and the charge to settle after the response
    /// when the store charged the request.
    fn settle<ReqB, ResB>(
        &self,
        answer: Answer,
        request: &Request<ReqB>,
        asked: Asked,
    ) -> (Next<ResB>, Option<Charged>)
    where
        R: OnRejection<ReqB, ResB>,
    {
        let charged_at = |result: &Result<Decision, StoreError>| match result {
            Ok(decision) if decision.is_allowed() => decision.decided_at_ms(),
            _ => None,
        };
        let (next, charges) = match answer {
            Answer::One(result) => {
                let at = charged_at(&result);
                let next = settle(&self.shared, &self.rules, result, request, &asked, false);
                let enforced = at.map(|at| (self.rules.limits().clone(), at));
                (next, [enforced, None])
            }
            Answer::Shadowed(answers) => {
                let enforced = answers
                    .enforced
                    .as_ref()
                    .and_then(charged_at)
                    .map(|at| (self.rules.limits().clone(), at));
                let shadow = charged_at(&answers.shadow)
                    .zip(self.rules.shadow())
                    .map(|(at, limits)| (limits.clone(), at));
                let next = settle_shadowed(&self.shared, &self.rules, answers, request, &asked);
                (next, [enforced, shadow])
            }
        };
        // Called without a decision too: a layer whose limits are all in shadow.
        let charged =
            (charges.iter().any(Option::is_some) && matches!(next, Next::Call(_))).then(|| {
                Charged {
                    after: self.after.clone(),
                    key: asked.key,
                    cost: asked.cost,
                    charges,
                }
            });
        (next, charged)
    }

    fn next<F: Future, ResB, P>(
        &self,
        next: Next<ResB>,
        charged: Option<Charged>,
        call: impl FnOnce() -> F,
    ) -> State<F, Response<ResB>, P> {
        match next {
            Next::Answer(response) => State::Ready {
                response: Some(response),
            },
            Next::Call(decision) => State::Calling {
                future: call(),
                decision,
                charged,
            },
            // Never: a count-after layer is built without `max_wait` (`parts_waiting`).
            Next::Wait(_) => unreachable!("a count-after layer never waits"),
        }
    }
}

pin_project! {
    /// The response future of [`CountAfter`].
    pub struct CountAfterFuture<S, ReqB, R, M>
    where
        S: Service<Request<ReqB>>,
    {
        #[pin]
        state: State<S::Future, S::Response, (S, Request<ReqB>, Asked)>,
        parts: Parts<R, M>,
    }
}

pin_project! {
    #[project = StateProj]
    enum State<F, T, P = ()> {
        Checking {
            waiting: Waiting,
            pending: Option<P>,
        },
        Calling {
            #[pin]
            future: F,
            decision: Option<Decision>,
            charged: Option<Charged>,
        },
        Ready {
            response: Option<T>,
        },
    }
}

impl<S, ReqB, R, M> fmt::Debug for CountAfterFuture<S, ReqB, R, M>
where
    S: Service<Request<ReqB>>,
{
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("CountAfterFuture").finish_non_exhaustive()
    }
}

impl<S, ReqB, R, M, ResB> Future for CountAfterFuture<S, ReqB, R, M>
where
    S: Service<Request<ReqB>, Response = Response<ResB>>,
    R: OnRejection<ReqB, ResB>,
    M: Recount<ResB>,
{
    type Output = Result<Response<M::Body>, S::Error>;

    fn poll(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Self::Output> {
        let mut this = self.project();
        loop {
            match this.state.as_mut().project() {
                StateProj::Checking { waiting, pending } => {
                    let answer = match waiting {
                        Waiting::One(check) => Answer::One(ready!(Pin::new(check).poll(cx))),
                        Waiting::Both(checks) => {
                            Answer::Shadowed(ready!(Pin::new(checks).poll(cx)))
                        }
                    };
                    let (mut service, request, asked) =
                        pending.take().expect("polled after completion");
                    let (next, charged) = this.parts.settle(answer, &request, asked);
                    let state = this.parts.next(next, charged, || service.call(request));
                    this.state.set(state);
                }
                StateProj::Calling {
                    future,
                    decision,
                    charged,
                } => {
                    // An error keeps the charge: `charged` is dropped unsettled.
                    let mut response = ready!(future.poll(cx))?;
                    if let Some(decision) = decision.take() {
                        this.parts
                            .rules
                            .headers
                            .write(response.headers_mut(), &decision);
                    }
                    return Poll::Ready(Ok(this.parts.recount.finish(response, charged.take())));
                }
                StateProj::Ready { response } => {
                    let response = response.take().expect("polled after completion");
                    return Poll::Ready(Ok(this.parts.recount.finish(response, None)));
                }
            }
        }
    }
}
