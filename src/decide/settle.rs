//! [`settle`]: what a request gets once the store has answered. The failure policy for
//! errors, waiting or the rejection for denials, the metrics for both, and the charge
//! that counting after the response settles later.

use http::Request;

use super::{
    Answer, Asked, Next, Shared,
    in_flight::Answers as InFlightAnswers,
    shadow::Answers,
    wait::{self, Round},
};
use crate::{
    Decision, FailurePolicy, StoreError,
    count_after::{Charged, Held},
    metrics::Outcome as Recorded,
    rejection::OnRejection,
    rules::Active,
    store::Guarded,
};

/// Acts on the store's `answer` about `request`, under the `rules` it was asked with:
/// records the metrics, applies the failure policy to an error, and says whether to
/// answer at once (a denial, a store failure), to wait (a reservation, or a denial that
/// may wait its turn), or to call the inner service. With `counts` (a layer that counts
/// after the response), a call carries the charge the store made, to settle once the
/// response is there.
pub(crate) fn settle<ReqB, ResB, R>(
    shared: &Shared<R>,
    rules: &Active,
    answer: Answer,
    request: &Request<ReqB>,
    asked: &Asked,
    round: Round,
    counts: bool,
) -> Next<ResB>
where
    R: OnRejection<ReqB, ResB>,
{
    match answer {
        Answer::One(result) => settle_one(shared, rules, result, request, asked, round, counts),
        Answer::Shadowed(answers) => shadowed(shared, rules, answers, request, asked, counts),
        Answer::InFlight(answers) => {
            in_flight(shared, rules, *answers, request, asked, round, counts)
        }
    }
}

/// [`settle`] for rules with an in-flight limit: as [`settle_one`] (and [`shadowed`] for
/// their shadow limits), and the permit taken rides on the call to the inner service,
/// which gives it back once the response is over, or on the ticket of a reservation,
/// held while it waits. A store error under [`FailurePolicy::Local`] asks the local
/// store for the limits and a permit alike. A denial by the cap is final: only a denial
/// by the limits may wait its turn (and asks again with the cap).
#[inline(never)]
fn in_flight<ReqB, ResB, R>(
    shared: &Shared<R>,
    rules: &Active,
    answers: InFlightAnswers,
    request: &Request<ReqB>,
    asked: &Asked,
    round: Round,
    counts: bool,
) -> Next<ResB>
where
    R: OnRejection<ReqB, ResB>,
{
    let InFlightAnswers { admitted, shadow } = answers;
    let (shadow_at, allowed) = match shadow {
        Some(shadow) => shadow_verdict(shared, shadow, asked),
        None => (None, Recorded::Allowed),
    };
    let policy = rules.rules.on_store_error();
    let first = round == Round::First;
    let (result, permit, local) = match admitted {
        Ok(admitted) => {
            let (decision, permit) = admitted.into_parts();
            (Ok(decision), permit, round == Round::WaitedLocal)
        }
        Err(error) => match (&rules.local, rules.rules.in_flight()) {
            (Some(local), Some(cap))
                if matches!(policy, FailurePolicy::Local(_)) && round != Round::WaitedLocal =>
            {
                record(shared, rules, Recorded::StoreError, asked);
                policy.log_failure(&error, &asked.key, &shared.name);
                // The memory store answers at once, and reserves.
                let reserve_ms = match &rules.waiting {
                    Some(waiting) if first && waiting.has_room(&asked.key) => waiting.max_wait_ms(),
                    _ => 0,
                };
                match local.check_in_flight_now(
                    &asked.key,
                    rules.limits(),
                    asked.cost,
                    cap,
                    reserve_ms,
                ) {
                    Ok(Ok(admitted)) => {
                        let (decision, permit) = admitted.into_parts();
                        (Ok(decision), permit, true)
                    }
                    Ok(Err(error)) => (Err(error), None, true),
                    Err(_) => (Err(StoreError::circuit_open()), None, true),
                }
            }
            _ => (Err(error), None, round == Round::WaitedLocal),
        },
    };
    // The cap's denial ends the decision with one limit more than the rules have.
    let cap_full = permit.is_none()
        && matches!(&result, Ok(decision) if !decision.is_allowed()
            && decision.limits().len() > rules.limits().len());
    let store = rules.store_for(local);
    // A permit beside a denial (never from the shipped stores) goes back at once.
    let permit = permit.map(|permit| {
        Held::new(
            store.clone(),
            rules.limits().clone(),
            permit,
            shared.name.clone(),
        )
    });
    let asker = Asker {
        store,
        allowed,
        may_wait: first && !cap_full,
        local,
    };
    let failed = result.is_err();
    let next = act(shared, rules, &asker, result, request, asked);
    let next = if counts {
        charge(shared, rules, next, shadow_at, failed || local, asked)
    } else {
        next
    };
    match (next, permit) {
        (Next::Call(decision, charged), Some(permit)) => {
            let charged = charged.unwrap_or_else(|| {
                Box::new(Charged::new(
                    shared.name.clone(),
                    asked.key.clone(),
                    asked.cost,
                    [None, None],
                ))
            });
            Next::Call(decision, Some(Box::new(charged.holding(permit))))
        }
        // A reservation holds its permit while it waits.
        (Next::Wait(ticket), Some(permit)) => Next::Wait(Box::new(ticket.holding(permit))),
        (next, _) => next,
    }
}

/// [`settle`] for the answer of one store call (rules without shadow limits).
#[inline(always)]
pub(crate) fn settle_one<ReqB, ResB, R>(
    shared: &Shared<R>,
    rules: &Active,
    result: Result<Decision, StoreError>,
    request: &Request<ReqB>,
    asked: &Asked,
    round: Round,
    counts: bool,
) -> Next<ResB>
where
    R: OnRejection<ReqB, ResB>,
{
    let local = round == Round::WaitedLocal;
    let asker = Asker {
        store: rules.store_for(local),
        allowed: Recorded::Allowed,
        may_wait: round == Round::First,
        local,
    };
    if round != Round::First {
        waited(shared, &result, local);
    }
    if !counts {
        // Returned as `act` made it: a `Next` moved through a branch costs a copy.
        return act(shared, rules, &asker, result, request, asked);
    }
    let failed = result.is_err();
    let next = act(shared, rules, &asker, result, request, asked);
    charge(shared, rules, next, None, failed || local, asked)
}

/// Counts a request answered after waiting its turn as delayed, with the outcome [`act`]
/// counts it as (after a wait a denial is final); in the failure policy's `local` store,
/// as the store error it was counted as before it waited.
#[inline(never)]
fn waited<R>(shared: &Shared<R>, result: &Result<Decision, StoreError>, local: bool) {
    let recorded = match result {
        _ if local => Recorded::StoreError,
        Ok(decision) if decision.is_allowed() => Recorded::Allowed,
        Ok(_) => Recorded::Denied,
        Err(_) => Recorded::StoreError,
    };
    shared.metrics.delayed(recorded);
}

/// [`settle`] for rules with shadow limits: the answer about the shadow limits only
/// changes what the request is counted as (`would_reject` rather than `allowed`) and
/// logs. A shadow call that failed changes nothing: the request is decided by the
/// enforced limits alone.
#[inline(never)]
fn shadowed<ReqB, ResB, R>(
    shared: &Shared<R>,
    rules: &Active,
    answers: Answers,
    request: &Request<ReqB>,
    asked: &Asked,
    counts: bool,
) -> Next<ResB>
where
    R: OnRejection<ReqB, ResB>,
{
    let Answers { enforced, shadow } = answers;
    let failed = shadow.is_err();
    let (shadow_at, allowed) = shadow_verdict(shared, shadow, asked);
    let (next, enforced_failed) = match enforced {
        Some(result) => {
            let failed = result.is_err();
            let asker = Asker {
                store: &rules.store,
                allowed,
                may_wait: true,
                local: false,
            };
            (act(shared, rules, &asker, result, request, asked), failed)
        }
        None => {
            // A layer in shadow: its store failing is still a store error to count.
            let recorded = if failed {
                Recorded::StoreError
            } else {
                allowed
            };
            record(shared, rules, recorded, asked);
            (Next::Call(None, None), false)
        }
    };
    if counts {
        charge(shared, rules, next, shadow_at, enforced_failed, asked)
    } else {
        next
    }
}

/// What the shadow limits' answer makes of a request: when they charged it (to settle
/// after the response), and what it is counted as (`would_reject` when they denied it,
/// which is logged).
fn shadow_verdict<R>(
    shared: &Shared<R>,
    shadow: Result<Decision, StoreError>,
    asked: &Asked,
) -> (Option<u64>, Recorded) {
    let at = charged_at(&shadow);
    if would_reject(shared, shadow, asked) {
        (at, Recorded::WouldReject)
    } else {
        (at, Recorded::Allowed)
    }
}

/// When the store charged a request it allowed.
fn charged_at(result: &Result<Decision, StoreError>) -> Option<u64> {
    match result {
        Ok(decision) if decision.is_allowed() => decision.decided_at_ms(),
        _ => None,
    }
}

/// `next`, carrying the charge to settle after the response when it calls the inner
/// service and a store charged the request: its enforced limits (in the failure policy's
/// local store when `local`) and its shadow limits (charged at `shadow_at`).
fn charge<ResB, R>(
    shared: &Shared<R>,
    rules: &Active,
    next: Next<ResB>,
    shadow_at: Option<u64>,
    local: bool,
    asked: &Asked,
) -> Next<ResB> {
    let Next::Call(decision, None) = next else {
        return next;
    };
    let enforced_at = decision.as_ref().and_then(Decision::decided_at_ms);
    if enforced_at.is_none() && shadow_at.is_none() {
        return Next::Call(decision, None);
    }
    let [recounted, shadow_recounted] = rules.recounted();
    let enforced = enforced_at
        .filter(|_| !recounted.is_empty())
        .map(|at| (rules.store_for(local).clone(), recounted.clone(), at));
    let shadow = shadow_at
        .filter(|_| !shadow_recounted.is_empty())
        .map(|at| (rules.store.clone(), shadow_recounted.clone(), at));
    if enforced.is_none() && shadow.is_none() {
        return Next::Call(decision, None);
    }
    let charged = Charged::new(
        shared.name.clone(),
        asked.key.clone(),
        asked.cost,
        [enforced, shadow],
    );
    Next::Call(decision, Some(Box::new(charged)))
}

/// Whether the shadow limits denied the request; logs it when they did.
fn would_reject<R>(
    shared: &Shared<R>,
    shadow: Result<Decision, StoreError>,
    asked: &Asked,
) -> bool {
    let layer = &*shared.name;
    // Never the key itself: it may be an API key.
    let key = asked.key.redacted();
    match shadow {
        Ok(decision) if decision.is_allowed() => false,
        Ok(decision) => {
            let retry_after_ms = decision.retry_after_ms();
            tracing::info!(key = %key, layer, retry_after_ms, "rate limit would reject (shadow)");
            true
        }
        Err(error) => {
            let error = error.chain();
            tracing::debug!(error = %error, key = %key, layer, "rate limit shadow check failed");
            false
        }
    }
}

/// Counts a request with `recorded`, for the layer and for its plan.
#[inline]
fn record<R>(shared: &Shared<R>, rules: &Active, recorded: Recorded, asked: &Asked) {
    shared.metrics.decided(recorded, &asked.timer);
    if let Some(plan) = &rules.plan {
        shared.metrics.plan(plan, recorded);
    }
}

/// How a store's answer is acted on.
struct Asker<'a> {
    /// The store that answered: the layer's, or the failure policy's local one.
    store: &'a Guarded,
    /// What an allowed request is counted as (`allowed` or `would_reject`).
    allowed: Recorded,
    /// A denial may wait its turn.
    may_wait: bool,
    /// The store is the failure policy's local one, answering for the layer's, which
    /// failed: the request was counted as a store error already, and counts nothing more.
    local: bool,
}

/// Acts on the answer of `asker`'s store about a request: a reservation waits in line,
/// a denial may wait its turn, a store error goes to the failure policy; the outcome is
/// counted (unless the local store answers a store error, counted already).
fn act<ReqB, ResB, R>(
    shared: &Shared<R>,
    rules: &Active,
    asker: &Asker<'_>,
    result: Result<Decision, StoreError>,
    request: &Request<ReqB>,
    asked: &Asked,
) -> Next<ResB>
where
    R: OnRejection<ReqB, ResB>,
{
    // A reservation: its wait, in line (or, with no place left, a denial). Tested by
    // reference: moving the answer through a match costs every request a copy.
    if let Ok(decision) = &result
        && decision.wait_ms() > 0
        && decision.is_allowed()
    {
        return reserved(shared, rules, asker, result, request, asked);
    }
    let recorded = match &result {
        Ok(decision) if decision.is_allowed() => asker.allowed,
        Ok(decision) => {
            // A request that waits is counted once it is answered.
            if asker.may_wait
                && let Some(waiting) = &rules.waiting
                && let Some(ticket) = waiting.admit(
                    asker.store,
                    asker.local,
                    &asked.key,
                    rules.limits(),
                    asked.cost,
                    decision,
                )
            {
                return Next::Wait(Box::new(ticket));
            }
            Recorded::Denied
        }
        Err(_) => Recorded::StoreError,
    };
    if !asker.local {
        record(shared, rules, recorded, asked);
    }
    let decision = match result {
        Ok(decision) => decision,
        Err(error) => return on_store_error(shared, rules, asker, &error, request, asked),
    };
    if decision.is_allowed() {
        return Next::Call(Some(decision), None);
    }
    let mut response = shared.rejection.rate_limited(request, &decision);
    rules.headers.write(response.headers_mut(), &decision);
    Next::Answer(response)
}

/// A request whose units the store reserved (`result`): waits in line, or with no place
/// left (or no line: a store that reserved unasked) is denied, after giving the units
/// back when no other reservation of the key is in line (then they are the last ones
/// counted; see [`wait`]). Out of line: rare.
#[inline(never)]
fn reserved<ReqB, ResB, R>(
    shared: &Shared<R>,
    rules: &Active,
    asker: &Asker<'_>,
    result: Result<Decision, StoreError>,
    request: &Request<ReqB>,
    asked: &Asked,
) -> Next<ResB>
where
    R: OnRejection<ReqB, ResB>,
{
    let final_round = Asker {
        may_wait: false,
        ..*asker
    };
    let Ok(decision) = result else {
        return act(shared, rules, &final_round, result, request, asked);
    };
    let (decision, alone) = match &rules.waiting {
        Some(waiting) => {
            let alone = waiting.none_reserved(&asked.key);
            match waiting.admit_reserved(asker.store, asker.local, &asked.key, decision) {
                Ok(ticket) => return Next::Wait(Box::new(ticket)),
                Err(decision) => (decision, alone),
            }
        }
        None => (decision, true),
    };
    if alone {
        wait::release(
            asker.store,
            rules.limits(),
            &asked.key,
            asked.cost,
            &decision,
        );
    }
    let refused = wait::refused(&decision);
    act(shared, rules, &final_round, Ok(refused), request, asked)
}

/// The failure policy's answer to a store error (counted already): fail open, fail
/// closed, or the answer of the local fallback store, asked as the shared store would
/// have been (so a request may reserve and wait there too), counting nothing more.
#[inline(never)]
fn on_store_error<ReqB, ResB, R>(
    shared: &Shared<R>,
    rules: &Active,
    asker: &Asker<'_>,
    error: &StoreError,
    request: &Request<ReqB>,
    asked: &Asked,
) -> Next<ResB>
where
    R: OnRejection<ReqB, ResB>,
{
    let Asked { key, cost, .. } = asked;
    let policy = rules.rules.on_store_error();
    policy.log_failure(error, key, &shared.name);
    let local = match (policy, &rules.local) {
        (FailurePolicy::Allow, _) => return Next::Call(None, None),
        // Its own answer failing (never: memory) would fail open, not loop.
        (FailurePolicy::Local(_), Some(local)) if !asker.local => local,
        (FailurePolicy::Local(_), _) => return Next::Call(None, None),
        _ => return Next::Answer(shared.rejection.store_failed(request, error)),
    };
    let may_wait = asker.may_wait;
    let answer = match &rules.waiting {
        Some(waiting) if may_wait && waiting.has_room(key) => {
            local.reserve_now(key, rules.limits(), *cost, waiting.max_wait_ms())
        }
        _ => local.check_now(key, rules.limits(), *cost),
    };
    // The memory store answers at once.
    let result = answer.unwrap_or_else(|_| Err(StoreError::circuit_open()));
    let local = Asker {
        store: local,
        allowed: asker.allowed,
        may_wait,
        local: true,
    };
    act(shared, rules, &local, result, request, asked)
}
