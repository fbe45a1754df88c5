//! The request pipeline, in one place: every request of a
//! [`RateLimit`](crate::RateLimit) service goes through [`Shared::start`] (the store call:
//! enforced limits, reserving when the request may wait, and shadow limits beside them)
//! and then [`settle`] (failure policy, waiting, rejection, metrics, the charge to
//! settle after the response). The service calls them for answers that are ready at once,
//! its [`ResponseFuture`](crate::ResponseFuture) for those it waited for: the same two
//! functions, whatever features the layer combines.

mod in_flight;
pub(crate) mod settle;
mod shadow;
mod start;
pub(crate) mod wait;

use std::sync::Arc;

use http::Response;

pub(crate) use self::settle::settle;
use self::{
    shadow::{Answers, Checks},
    wait::Ticket,
};
use crate::{
    Decision, StoreError,
    adaptive::Stage,
    count_after::Charged,
    key::Key,
    metrics::{LayerMetrics, Timer},
    rules::Cell,
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
    /// The adaptive stage, if the layer has one: taken before the store call.
    pub(crate) adaptive: Option<Arc<Stage>>,
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
    /// About its limits and its in-flight cap, in one call (and its shadow limits, if
    /// any, in a second one). Boxed: rare, and larger than the others.
    InFlight(Box<in_flight::Answers>),
}

/// The store call a request waits for.
pub(crate) enum Asking {
    One(Check),
    Both(Checks),
    InFlight(Box<in_flight::Calls>),
}

impl Asking {
    /// Polls the call: its answer once there.
    pub(crate) fn poll(&mut self, cx: &mut std::task::Context<'_>) -> std::task::Poll<Answer> {
        use std::{future::Future, pin::Pin};
        match self {
            Self::One(check) => Pin::new(check).poll(cx).map(Answer::One),
            Self::Both(checks) => Pin::new(checks).poll(cx).map(Answer::Shadowed),
            Self::InFlight(calls) => calls.poll(cx).map(|a| Answer::InFlight(Box::new(a))),
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
