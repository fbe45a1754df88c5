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
    decide::{Asked, Checks, Next, Shared, settle, settle_shadowed},
    future::{Pending, ResponseFuture},
    key::KeyExtractor,
    metrics,
    plan::{self, Chosen},
    rejection::OnRejection,
    rules::Active,
    wait::Ticket,
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
    /// The rules this service last saw in force, refreshed when a newer version exists.
    rules: Arc<Active>,
}

impl<S, K, C, R> RateLimit<S, K, C, R> {
    pub(crate) fn from_parts(inner: S, key: Arc<K>, cost: C, shared: Arc<Shared<R>>) -> Self {
        let rules = shared.rules.active.load_full();
        Self {
            inner,
            key,
            cost,
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

impl<S: Clone, K, C: Clone, R> Clone for RateLimit<S, K, C, R> {
    fn clone(&self) -> Self {
        Self {
            inner: self.inner.clone(),
            key: self.key.clone(),
            cost: self.cost.clone(),
            shared: self.shared.clone(),
            rules: self.rules.clone(),
        }
    }
}

impl<S: fmt::Debug, K: fmt::Debug, C: fmt::Debug, R> fmt::Debug for RateLimit<S, K, C, R> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("RateLimit")
            .field("inner", &self.inner)
            .field("key", &self.key)
            .field("cost", &self.cost)
            .field("limits", self.rules.limits())
            .finish_non_exhaustive()
    }
}

/// Acts on a decision made at once: the service that was polled ready takes the request
/// now, so neither it nor the request has to wait in the future. A macro, not a method:
/// moving the request into a call cost a request ~35 instructions even when inlined.
macro_rules! answer_now {
    ($this:ident, $next:expr, $request:ident, $asked:ident) => {
        match $next {
            Next::Answer(response) => ResponseFuture::ready(response),
            Next::Wait(ticket) => $this.waiting(*ticket, $request, &$asked),
            // Nothing to write: the response needs neither the decision nor the rules.
            Next::Call(Some(decision)) if $this.rules.headers.writes_when_allowed() => {
                ResponseFuture::calling($this.inner.call($request), decision, $this.rules.clone())
            }
            Next::Call(_) => ResponseFuture::unlimited($this.inner.call($request)),
        }
    };
}

/// Decides a request with its key, cost and timer under the rules the service holds: the
/// rest of `call`, and of `planned` once the plan's rules are held. A macro for the reason
/// `answer_now!` is one: a request moved into a method costs a copy.
macro_rules! decide {
    ($this:ident, $request:ident, $key:ident, $cost:ident, $timer:ident) => {{
        let shared = &$this.shared;
        let rules = &$this.rules;
        if rules.shadow().is_some() {
            $this.shadowed(
                $request,
                Asked {
                    key: $key,
                    cost: $cost,
                    timer: $timer,
                },
            )
        } else {
            let check = shared.ask(&$key, rules.limits(), $cost);
            let asked = Asked {
                key: $key,
                cost: $cost,
                timer: $timer,
            };
            match check {
                // Decided already: the memory store, a block-cache hit, an open circuit.
                Ok(result) => {
                    let next = settle(shared, rules, result, &$request, &asked, false);
                    answer_now!($this, next, $request, asked)
                }
                Err(check) => {
                    let pending = Pending {
                        service: $this.take_ready(),
                        request: $request,
                        asked,
                        waited: false,
                    };
                    ResponseFuture::checking(
                        check,
                        pending,
                        $this.shared.clone(),
                        $this.rules.clone(),
                    )
                }
            }
        }
    }};
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
        // The rules this request is decided, answered and given its fields under, even
        // when they change before it is done.
        self.shared.rules.refresh(&mut self.rules);
        let shared = &self.shared;
        let rules = &self.rules;
        let key = match self.key.extract(&request) {
            Ok(key) => key,
            Err(error) => {
                shared.metrics.request(metrics::Outcome::KeyMissing);
                return match rules.rules.on_missing_key() {
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
        if rules.has_plans() {
            return self.planned(request, Asked { key, cost, timer });
        }
        decide!(self, request, key, cost, timer)
    }
}

impl<S, K, C, R> RateLimit<S, K, C, R> {
    /// [`call`](Service::call) for a layer with [plans](crate::plan): decides the request
    /// under its plan's rules. Out of line, so that layers without plans pay one branch
    /// for them.
    #[inline(never)]
    fn planned<ReqB, ResB>(
        &mut self,
        request: Request<ReqB>,
        asked: Asked,
    ) -> ResponseFuture<S, ReqB, R>
    where
        S: Service<Request<ReqB>, Response = Response<ResB>> + Clone,
        R: OnRejection<ReqB, ResB>,
    {
        let layer = self.rules.clone();
        let rules = match layer.choose(&request, &asked.key) {
            Ok(Chosen::Layer) => layer.clone(),
            Ok(Chosen::Plan(rules)) => rules.clone(),
            Ok(Chosen::Unlimited(plan)) => {
                plan::unlimited(&self.shared, plan);
                return ResponseFuture::unlimited(self.inner.call(request));
            }
            Err(resolving) => {
                let pending = Pending {
                    service: self.take_ready(),
                    request,
                    asked,
                    waited: false,
                };
                return ResponseFuture::resolving(resolving, pending, self.shared.clone(), layer);
            }
        };
        // Decided and answered under the plan's rules; the service goes on holding the
        // layer's.
        self.rules = rules;
        let Asked { key, cost, timer } = asked;
        let future = decide!(self, request, key, cost, timer);
        self.rules = layer;
        future
    }

    /// [`call`](Service::call) for a layer with shadow limits: two store calls, made
    /// together, then the same settling. Out of line, so that layers without shadow
    /// limits pay one branch for it.
    #[inline(never)]
    fn shadowed<ReqB, ResB>(
        &mut self,
        request: Request<ReqB>,
        asked: Asked,
    ) -> ResponseFuture<S, ReqB, R>
    where
        S: Service<Request<ReqB>, Response = Response<ResB>> + Clone,
        R: OnRejection<ReqB, ResB>,
    {
        let shared = &self.shared;
        let rules = &self.rules;
        let shadow = rules.shadow().map_or(&[][..], |limits| &limits[..]);
        let checks = match Checks::start(&shared.store, &asked, rules.limits(), shadow) {
            Ok(answers) => {
                let next = settle_shadowed(shared, rules, answers, &request, &asked);
                return answer_now!(self, next, request, asked);
            }
            Err(checks) => checks,
        };
        let pending = Pending {
            service: self.take_ready(),
            request,
            asked,
            waited: false,
        };
        ResponseFuture::shadowing(checks, pending, self.shared.clone(), self.rules.clone())
    }

    /// A denied request that waits its turn ([`wait`](crate::wait)): out of line, as it is
    /// rare.
    #[inline(never)]
    fn waiting<ReqB>(
        &mut self,
        ticket: Ticket,
        request: Request<ReqB>,
        asked: &Asked,
    ) -> ResponseFuture<S, ReqB, R>
    where
        S: Service<Request<ReqB>> + Clone,
    {
        let check = ticket.wait(
            self.shared.store.clone(),
            self.rules.clone(),
            asked.key.clone(),
            asked.cost,
        );
        // Borrowed, not moved: a move in one arm of `answer_now!` would cost every
        // request a drop flag.
        let asked = Asked {
            key: asked.key.clone(),
            cost: asked.cost,
            timer: asked.timer,
        };
        let pending = Pending {
            service: self.take_ready(),
            request,
            asked,
            waited: true,
        };
        ResponseFuture::checking(check, pending, self.shared.clone(), self.rules.clone())
    }

    /// The service that was polled ready, for a request that waits for the store; its
    /// clone goes on serving.
    fn take_ready(&mut self) -> S
    where
        S: Clone,
    {
        let clone = self.inner.clone();
        std::mem::replace(&mut self.inner, clone)
    }
}
