//! [`Shared::decide`]: the one entry of every new request, and the wait of one that
//! waits its turn.

use http::Request;

use super::{
    Answer, Asked, Asking, Next, Shared,
    in_flight::Calls,
    settle::{settle, settle_one},
    shadow::Checks,
    wait::{Round, Ticket},
};
use crate::{
    Decision, InFlightLimit, Limit, StoreError, key::Key, rejection::OnRejection, rules::Active,
    store::Check,
};

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
        if let Some(in_flight) = rules.rules.in_flight() {
            return self.decide_in_flight(rules, in_flight, request, asked, counts);
        }
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
}

impl<R> Shared<R> {
    /// [`decide`](Self::decide) for rules with an in-flight limit: the enforced limits
    /// and the cap in one store call (reserving the limits and taking the permit at
    /// once when the rules let requests wait, the line has room and the store can
    /// reserve, as [`ask`] does), the shadow limits, if any, in a call of their own
    /// beside it. Out of line: layers without one pay a branch.
    #[inline(never)]
    fn decide_in_flight<ReqB, ResB>(
        &self,
        rules: &Active,
        in_flight: &InFlightLimit,
        request: &Request<ReqB>,
        asked: &Asked,
        counts: bool,
    ) -> Next<ResB>
    where
        R: OnRejection<ReqB, ResB>,
    {
        let admit = rules.store.check_in_flight_now(
            &asked.key,
            rules.limits(),
            asked.cost,
            in_flight,
            reserve_ms(rules, &asked.key),
        );
        let shadow = rules
            .shadow()
            .map(|shadow| rules.store.check_now(&asked.key, shadow, asked.cost));
        match Calls::new(admit, shadow) {
            Ok(answers) => settle(
                self,
                rules,
                Answer::InFlight(Box::new(answers)),
                request,
                asked,
                Round::First,
                counts,
            ),
            Err(calls) => Next::Ask(Asking::InFlight(calls)),
        }
    }
}

/// Asks the store about a request's enforced limits: for a reservation when the rules let
/// requests wait, the line has room ([`wait`]) and the store can reserve, else a plain
/// check (a denial may still wait its turn, and ask again).
#[inline(always)]
fn ask(
    rules: &Active,
    key: &Key,
    limits: &[Limit],
    cost: u32,
) -> Result<Result<Decision, StoreError>, Check> {
    match &rules.waiting {
        Some(waiting) if rules.reserves && waiting.has_room(key) => {
            rules
                .store
                .reserve_now(key, limits, cost, waiting.max_wait_ms())
        }
        _ => rules.store.check_now(key, limits, cost),
    }
}

/// How far ahead a request of `key` may reserve under `rules`: their `max_wait` when the
/// line has room and the store can reserve, else 0 (a plain check).
#[inline]
pub(crate) fn reserve_ms(rules: &Active, key: &Key) -> u64 {
    match &rules.waiting {
        Some(waiting) if rules.reserves && waiting.has_room(key) => waiting.max_wait_ms(),
        _ => 0,
    }
}

impl Asking {
    /// The wait of a request that `ticket` gave a place in line, then the store's fresh
    /// answer (or the reservation's), as a call to wait for. Under an in-flight limit,
    /// asked again with the cap (the answer is then the cap's and the limits' together,
    /// with the permit taken when allowed), and a reservation's answer carries the
    /// permit it held while it waited.
    pub(crate) fn wait(ticket: Ticket, rules: &Active, asked: &Asked) -> Self {
        match rules.rules.in_flight() {
            Some(cap) => Self::InFlight(Box::new(Calls::waited(ticket.wait_in_flight(
                rules.limits().clone(),
                asked.key.clone(),
                asked.cost,
                *cap,
            )))),
            None => Self::One(ticket.wait(rules.limits().clone(), asked.key.clone(), asked.cost)),
        }
    }
}
