//! What a request gets once the store has answered: the failure policy for errors, the
//! rejection for denials, the metrics for both. [`RateLimit`](crate::RateLimit) settles
//! answers that are ready at once, its [`ResponseFuture`](crate::ResponseFuture) those it
//! waited for; both through [`settle`], so the policy lives here once.

use std::{
    future::Future,
    pin::Pin,
    sync::Arc,
    task::{Context, Poll},
};

use futures_util::future::{Join, join};
use http::{Request, Response};

use crate::{
    Decision, FailurePolicy, StoreError,
    key::Key,
    metrics::{self, Outcome as Recorded, Timer},
    rejection::OnRejection,
    rules::{Active, Cell},
    store::{Check, Guarded},
    wait::{self, Ticket, Waiting},
};

/// What a [`RateLimit`](crate::RateLimit) service shares with its response futures.
pub(crate) struct Shared<R> {
    /// The rules in force: each request reads them once, as it arrives.
    pub(crate) rules: Arc<Cell>,
    /// The layer's store, under its timeout and circuit breaker.
    pub(crate) store: Guarded,
    pub(crate) rejection: R,
    /// The layer's name: the `route` label of its metrics.
    pub(crate) name: Arc<str>,
    pub(crate) metrics: metrics::LayerMetrics,
    /// Denied requests may wait ([`RateLimitLayer::max_wait`](crate::RateLimitLayer::max_wait)).
    pub(crate) waiting: Option<Arc<Waiting>>,
}

impl<R> Shared<R> {
    /// Asks the store about a request: for a reservation when the layer lets requests
    /// wait and its line has room ([`wait`](crate::wait)), else a plain check.
    #[inline(always)]
    pub(crate) fn ask(
        &self,
        key: &Key,
        limits: &[crate::Limit],
        cost: u32,
    ) -> Result<Result<Decision, StoreError>, Check> {
        match &self.waiting {
            Some(waiting) if waiting.has_room(key) => {
                self.store
                    .reserve_now(key, limits, cost, waiting.max_wait_ms())
            }
            _ => self.store.check_now(key, limits, cost),
        }
    }
}

/// How the store was asked about a request: what [`settle`] needs besides its answer.
pub(crate) struct Asked {
    pub(crate) key: Key,
    pub(crate) cost: u32,
    pub(crate) timer: Timer,
}

/// What to do with a request once the store has answered.
pub(crate) enum Next<ResB> {
    /// Answer at once, without the inner service.
    Answer(Response<ResB>),
    /// Call the inner service, then write this decision's fields on its response (none
    /// when failing open).
    Call(Option<Decision>),
    /// Denied, but may wait its turn: see [`wait`](crate::wait). Boxed, so that the
    /// variant costs the other answers nothing.
    Wait(Box<Ticket>),
}

/// Acts on the store's answer about `request`, under the `rules` it was asked with:
/// records the metrics, applies the failure policy to an error, and says whether to
/// answer at once (a denial, a store failure) or to call the inner service. A request
/// that [`waited`](crate::wait) already gets a final denial; any other may be told to
/// wait.
pub(crate) fn settle<ReqB, ResB, R>(
    shared: &Shared<R>,
    rules: &Active,
    result: Result<Decision, StoreError>,
    request: &Request<ReqB>,
    asked: &Asked,
    waited: bool,
) -> Next<ResB>
where
    R: OnRejection<ReqB, ResB>,
{
    enforce(
        shared,
        rules,
        result,
        Recorded::Allowed,
        request,
        asked,
        !waited,
    )
}

/// [`settle`] for a layer with shadow limits: `enforced` is the answer about the
/// enforced limits (`None` when every limit is in shadow), `shadow` the one about the
/// shadow limits, which only changes what the request is counted as (`would_reject`
/// rather than `allowed`) and logs. A shadow call that failed changes nothing: the
/// request is decided by the enforced limits alone.
pub(crate) fn settle_shadowed<ReqB, ResB, R>(
    shared: &Shared<R>,
    rules: &Active,
    answers: Answers,
    request: &Request<ReqB>,
    asked: &Asked,
) -> Next<ResB>
where
    R: OnRejection<ReqB, ResB>,
{
    let Answers { enforced, shadow } = answers;
    let failed = shadow.is_err();
    let allowed = if would_reject(shared, shadow, asked) {
        Recorded::WouldReject
    } else {
        Recorded::Allowed
    };
    match enforced {
        Some(result) => enforce(shared, rules, result, allowed, request, asked, true),
        None => {
            // A layer in shadow: its store failing is still a store error to count.
            let recorded = if failed {
                Recorded::StoreError
            } else {
                allowed
            };
            shared.metrics.decided(recorded, &asked.timer);
            crate::plan::decided(shared, rules, recorded);
            Next::Call(None)
        }
    }
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

/// The store's answers about a layer's enforced and shadow limits.
pub(crate) struct Answers {
    pub(crate) enforced: Option<Result<Decision, StoreError>>,
    pub(crate) shadow: Result<Decision, StoreError>,
}

/// The two store calls of a layer with shadow limits, made together: the enforced
/// limits' (absent when every limit is in shadow) and the shadow limits'.
pub(crate) struct Checks {
    enforced: bool,
    /// Boxed: the answers it holds while the other call waits would make every
    /// [`ResponseFuture`](crate::ResponseFuture) larger.
    both: Box<Join<Check, Check>>,
}

impl Checks {
    /// Asks the store about the enforced limits (none if `enforced` is empty) and the
    /// `shadow` ones, in two calls: [`Ok`] when both answered at once.
    pub(crate) fn start(
        store: &Guarded,
        asked: &Asked,
        enforced: &[crate::Limit],
        shadow: &[crate::Limit],
    ) -> Result<Answers, Self> {
        let first = if enforced.is_empty() {
            None
        } else {
            Some(store.check_now(&asked.key, enforced, asked.cost))
        };
        let second = store.check_now(&asked.key, shadow, asked.cost);
        match (first, second) {
            (None, Ok(shadow)) => Ok(Answers {
                enforced: None,
                shadow,
            }),
            (Some(Ok(enforced)), Ok(shadow)) => Ok(Answers {
                enforced: Some(enforced),
                shadow,
            }),
            (first, second) => {
                let enforced = first.is_some();
                let first =
                    first.map_or_else(|| Check::ready(Ok(Decision::unlimited())), into_check);
                let shadow = into_check(second);
                Err(Self {
                    enforced,
                    both: Box::new(join(first, shadow)),
                })
            }
        }
    }
}

/// A check for an answer that may be there already.
fn into_check(answer: Result<Result<Decision, StoreError>, Check>) -> Check {
    match answer {
        Ok(result) => Check::ready(result),
        Err(check) => check,
    }
}

impl Future for Checks {
    type Output = Answers;

    fn poll(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Answers> {
        let (first, shadow) = std::task::ready!(Pin::new(&mut *self.both).poll(cx));
        Poll::Ready(Answers {
            enforced: self.enforced.then_some(first),
            shadow,
        })
    }
}

/// [`settle`], counting an allowed request as `allowed` (or `would_reject`); a denied
/// one may wait its turn when `may_wait`.
fn enforce<ReqB, ResB, R>(
    shared: &Shared<R>,
    rules: &Active,
    result: Result<Decision, StoreError>,
    allowed: Recorded,
    request: &Request<ReqB>,
    asked: &Asked,
    may_wait: bool,
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
        return reserved(shared, rules, result, allowed, request, asked);
    }
    let recorded = match &result {
        Ok(decision) if decision.is_allowed() => allowed,
        Ok(decision) => {
            // A request that waits is counted once it is answered.
            if let Some(waiting) = &shared.waiting
                && may_wait
                && let Some(ticket) =
                    waiting.admit(&asked.key, rules.limits(), asked.cost, decision)
            {
                return Next::Wait(Box::new(ticket));
            }
            Recorded::Denied
        }
        Err(_) => Recorded::StoreError,
    };
    shared.metrics.decided(recorded, &asked.timer);
    crate::plan::decided(shared, rules, recorded);
    let decision = match result {
        Ok(decision) => decision,
        Err(error) => match on_store_error(shared, rules, error, asked) {
            Ok(Some(decision)) => decision,
            Ok(None) => return Next::Call(None),
            Err(error) => return Next::Answer(shared.rejection.store_failed(request, &error)),
        },
    };
    if decision.is_allowed() {
        return Next::Call(Some(decision));
    }
    let mut response = shared.rejection.rate_limited(request, &decision);
    rules.headers.write(response.headers_mut(), &decision);
    Next::Answer(response)
}

/// A request whose units the store reserved (`result`): waits in line, or with no place
/// left (or no line: a store that reserved unasked) is denied, after giving the units
/// back when no other reservation of the key is in line (then they are the last ones
/// counted; see [`wait`](crate::wait)). Out of line: rare.
#[inline(never)]
fn reserved<ReqB, ResB, R>(
    shared: &Shared<R>,
    rules: &Active,
    result: Result<Decision, StoreError>,
    allowed: Recorded,
    request: &Request<ReqB>,
    asked: &Asked,
) -> Next<ResB>
where
    R: OnRejection<ReqB, ResB>,
{
    let Ok(decision) = result else {
        return enforce(shared, rules, result, allowed, request, asked, false);
    };
    let (decision, alone) = match &shared.waiting {
        Some(waiting) => {
            let alone = waiting.none_reserved(&asked.key);
            match waiting.admit_reserved(&asked.key, decision) {
                Ok(ticket) => return Next::Wait(Box::new(ticket)),
                Err(decision) => (decision, alone),
            }
        }
        None => (decision, true),
    };
    if alone {
        wait::release(
            &shared.store,
            rules.limits(),
            &asked.key,
            asked.cost,
            &decision,
        );
    }
    let refused = wait::refused(&decision);
    enforce(shared, rules, Ok(refused), allowed, request, asked, false)
}

/// The failure policy's answer to a store error: a decision (the local fallback store's),
/// none (fail open), or the error to answer with (fail closed).
fn on_store_error<R>(
    shared: &Shared<R>,
    rules: &Active,
    error: StoreError,
    asked: &Asked,
) -> Result<Option<Decision>, StoreError> {
    let Asked { key, cost, .. } = asked;
    let policy = rules.rules.on_store_error().as_str();
    let layer = &*shared.name;
    let chain = error.chain();
    // Never the key itself: it may be an API key.
    let redacted = key.redacted();
    if error.is_circuit_open() {
        // The failures that opened the circuit were logged already.
        tracing::debug!(error = %chain, key = %redacted, policy, layer, "rate limit store skipped");
    } else {
        tracing::warn!(error = %chain, key = %redacted, policy, layer, "rate limit store failed");
    }
    match rules.rules.on_store_error() {
        FailurePolicy::Allow => Ok(None),
        FailurePolicy::Deny => Err(error),
        FailurePolicy::Local(store) => Ok(Some(store.decide(key, rules.limits(), *cost))),
    }
}
