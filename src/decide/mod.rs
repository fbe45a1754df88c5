//! The request pipeline, in one place: every request of a
//! [`RateLimit`](crate::RateLimit) service goes through [`Shared::start`] (the store call:
//! enforced limits, reserving when the request may wait, and shadow limits beside them)
//! and then [`settle`] (failure policy, waiting, rejection, metrics, the charge to
//! settle after the response). The service calls them for answers that are ready at once,
//! its [`ResponseFuture`](crate::ResponseFuture) for those it waited for: the same two
//! functions, whatever features the layer combines.

pub(crate) mod settle;
mod shadow;
pub(crate) mod wait;

use std::sync::Arc;

use http::{Request, Response};

pub(crate) use self::settle::settle;
use self::{settle::settle_one, wait::Round};
use self::{
    shadow::{Answers, Checks},
    wait::Ticket,
};
use crate::{
    Decision, Limit, StoreError,
    count_after::Charged,
    key::Key,
    metrics::{LayerMetrics, Timer},
    rejection::OnRejection,
    rules::{Active, Cell},
    store::Check,
};

/// What a [`RateLimit`](crate::RateLimit) service shares with its response futures.
pub(crate) struct Shared<R> {
    /// The rules in force: each request reads them once, as it arrives.
    pub(crate) rules: Arc<Cell>,
    pub(crate) rejection: R,
    /// The layer's name: the `route` label of its metrics.
    pub(crate) name: Arc<str>,
    pub(crate) metrics: LayerMetrics,
}

/// How the store was asked about a request: what [`settle`] needs besides its answer.
pub(crate) struct Asked {
    pub(crate) key: Key,
    pub(crate) cost: u32,
    pub(crate) timer: Timer,
}

/// The store's answer about a request.
pub(crate) enum Answer {
    /// About its limits, in one call.
    One(Result<Decision, StoreError>),
    /// About its enforced and its shadow limits, in two calls.
    Shadowed(Answers),
}

/// The store call a request waits for.
pub(crate) enum Asking {
    One(Check),
    Both(Checks),
}

impl Asking {
    /// Polls the call: its answer once there.
    pub(crate) fn poll(&mut self, cx: &mut std::task::Context<'_>) -> std::task::Poll<Answer> {
        use std::{future::Future, pin::Pin};
        match self {
            Self::One(check) => Pin::new(check).poll(cx).map(Answer::One),
            Self::Both(checks) => Pin::new(checks).poll(cx).map(Answer::Shadowed),
        }
    }
}

/// What to do with a request once the store has answered.
pub(crate) enum Next<ResB> {
    /// Answer at once, without the inner service.
    Answer(Response<ResB>),
    /// Call the inner service, then write this decision's fields on its response (none
    /// when failing open), and settle the charge (counting after the response only).
    Call(Option<Decision>, Option<Box<Charged>>),
    /// Denied, but may wait its turn: see [`wait`]. Boxed, so that the variant costs the
    /// other answers nothing.
    Wait(Box<Ticket>),
    /// The store is still deciding: wait for this call, then [`settle`] its answer.
    /// (Never from [`settle`].)
    Ask(Asking),
}

impl<R> Shared<R> {
    /// Decides a request under `rules` (a plan's, or the layer's), the one entry for
    /// every new request: asks the store about its enforced limits, for a reservation
    /// when the rules let requests wait and the line has room, else for a plain check,
    /// and about its shadow limits, if any, in a call of their own beside it; then
    /// [`settle`]s the answer if it is there at once. Else [`Next::Ask`]: the call to
    /// wait for, whose answer the caller settles. (Not a `Result`: wrapping the answer
    /// would cost every request a copy of it.)
    #[inline(always)]
    pub(crate) fn decide<ReqB, ResB>(
        &self,
        rules: &Active,
        request: &Request<ReqB>,
        asked: &Asked,
        counts: bool,
    ) -> Next<ResB>
    where
        R: OnRejection<ReqB, ResB>,
    {
        match rules.shadow() {
            None => match ask(rules, &asked.key, rules.limits(), asked.cost) {
                Ok(result) => settle_one(self, rules, result, request, asked, Round::First, counts),
                Err(check) => Next::Ask(Asking::One(check)),
            },
            Some(shadow) => self.decide_shadowed(rules, shadow, request, asked, counts),
        }
    }

    /// [`decide`](Self::decide) for rules with shadow limits. Out of line, so that layers
    /// without shadow limits pay one branch for them.
    #[inline(never)]
    fn decide_shadowed<ReqB, ResB>(
        &self,
        rules: &Active,
        shadow: &[Limit],
        request: &Request<ReqB>,
        asked: &Asked,
        counts: bool,
    ) -> Next<ResB>
    where
        R: OnRejection<ReqB, ResB>,
    {
        let enforced = rules.limits();
        let enforced = (!enforced.is_empty()).then(|| ask(rules, &asked.key, enforced, asked.cost));
        let shadow = rules.store.check_now(&asked.key, shadow, asked.cost);
        match Checks::start(enforced, shadow) {
            Ok(answers) => settle(
                self,
                rules,
                Answer::Shadowed(answers),
                request,
                asked,
                Round::First,
                counts,
            ),
            Err(checks) => Next::Ask(Asking::Both(checks)),
        }
    }

    /// The wait of a request that `ticket` gave a place in line, then the store's fresh
    /// answer (or the reservation's), as a call to wait for.
    pub(crate) fn wait(&self, ticket: Ticket, rules: &Active, asked: &Asked) -> Asking {
        let _ = self;
        Asking::One(ticket.wait(rules.limits().clone(), asked.key.clone(), asked.cost))
    }
}

/// Asks the store about a request's enforced limits: for a reservation when the rules let
/// requests wait and the line has room ([`wait`]), else a plain check.
#[inline(always)]
fn ask(
    rules: &Active,
    key: &Key,
    limits: &[Limit],
    cost: u32,
) -> Result<Result<Decision, StoreError>, Check> {
    match &rules.waiting {
        Some(waiting) if waiting.has_room(key) => {
            rules
                .store
                .reserve_now(key, limits, cost, waiting.max_wait_ms())
        }
        _ => rules.store.check_now(key, limits, cost),
    }
}
