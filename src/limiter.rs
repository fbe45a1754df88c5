//! [`Limiter`]: decide for, peek at and reset a key's budget under a layer's rules and
//! store, from handlers, jobs and admin code.

use std::{fmt, future::Future, sync::Arc};

use http::{Request, Response};

use crate::{
    Decision, FailurePolicy, Limit, StoreError,
    decide::{Asked, Asking, Next, Shared, settle, wait::Round},
    key::{Key, KeyError, KeyExtractor},
    metrics::{LayerMetrics, Outcome, Timer},
    rejection::OnRejection,
    rules::Rules,
    rules::{Active, Cell, Chosen},
    store::Store,
};

/// What the layer's pipeline answers [`Limiter::check`]: the answer a request with the
/// same key and cost would get, as a value instead of a response.
#[derive(Debug, Clone)]
#[non_exhaustive]
pub enum Verdict {
    /// Go ahead: the units are spent. The decision of the limits in force, or `None` when
    /// nothing was decided: an [unlimited plan](crate::plan::Plan::unlimited), or a store
    /// failure under [`FailurePolicy::Allow`].
    Allowed(Option<Decision>),
    /// A limit denied it (after waiting up to the rules' `max_wait`, when set): nothing
    /// was spent; try again after [`Decision::retry_after`].
    Denied(Decision),
    /// The store failed and the failure policy ([`FailurePolicy::Deny`]) refuses.
    Unavailable(StoreError),
}

impl Verdict {
    /// Whether to go ahead.
    pub fn is_allowed(&self) -> bool {
        matches!(self, Self::Allowed(_))
    }

    /// The store's decision, when it decided.
    pub fn decision(&self) -> Option<&Decision> {
        match self {
            Self::Allowed(decision) => decision.as_ref(),
            Self::Denied(decision) => Some(decision),
            Self::Unavailable(_) => None,
        }
    }
}

/// The pipeline's answers to a [`Limiter::check`]: the verdict as the "response" that the
/// layer's rejection would build.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Verdicts;

impl OnRejection<(), Verdict> for Verdicts {
    fn rate_limited(&self, _: &Request<()>, decision: &Decision) -> Response<Verdict> {
        Response::new(Verdict::Denied(decision.clone()))
    }

    fn key_missing(&self, _: &Request<()>, error: &KeyError) -> Response<Verdict> {
        // Never asked: a check has its key.
        Response::new(Verdict::Unavailable(StoreError::new(
            crate::StoreErrorKind::Response,
            error.to_string(),
        )))
    }

    fn store_failed(&self, _: &Request<()>, error: &StoreError) -> Response<Verdict> {
        Response::new(Verdict::Unavailable(error.clone()))
    }
}

/// A handle on a [`RateLimitLayer`](crate::RateLimitLayer)'s budgets: what a key has
/// left ([`peek`](Self::peek)) and a fresh budget for it ([`reset`](Self::reset)),
/// always under the rules the layer enforces now (also after a
/// [`RulesHandle::set`](crate::rules::RulesHandle::set)) and on its store, with its timeout.
///
/// Made by [`RateLimitLayer::limiter`](crate::RateLimitLayer::limiter); cheap to clone
/// into handlers. Keys are the layer's: [`key_of`](Self::key_of) asks the layer's
/// extractor, so a hashed header key or a grouped IPv6 address comes out exactly as the
/// layer counts it.
///
/// ```
/// use std::time::Duration;
/// use tollgate::{Limit, RateLimitLayer, key::HeaderKey};
///
/// # #[tokio::main(flavor = "current_thread")]
/// # async fn main() -> Result<(), Box<dyn std::error::Error>> {
/// let layer = RateLimitLayer::new(Limit::fixed_window(100, Duration::from_secs(60))?)
///     .with_key(HeaderKey::new("x-api-key")?.hashed());
/// let limiter = layer.limiter();
///
/// // The key the layer gives requests with this API key.
/// let request = http::Request::get("/").header("x-api-key", "k-123").body(())?;
/// let key = limiter.key_of(&request)?;
///
/// // Cost 0 reads what is left without asking for anything.
/// let left = limiter.peek(&key, 0).await?;
/// assert_eq!(left.remaining(), Some(100));
/// // A fresh budget, on every replica.
/// limiter.reset(&key).await?;
/// # Ok(()) }
/// ```
pub struct Limiter<K> {
    key: Arc<K>,
    cell: Arc<Cell>,
    /// The layer's pipeline, with answers as [`Verdict`]s: its rules, name and metrics.
    shared: Arc<Shared<Verdicts>>,
}

impl<K> Limiter<K> {
    pub(crate) fn new(key: Arc<K>, cell: Arc<Cell>, name: Arc<str>) -> Self {
        let shared = Arc::new(Shared {
            rules: cell.clone(),
            rejection: Verdicts,
            metrics: LayerMetrics::new(&name),
            name,
            // Decisions outside HTTP have no response to learn from.
            adaptive: None,
        });
        Self { key, cell, shared }
    }

    /// Decides one request of `cost` from `key` outside HTTP (a WebSocket message, a
    /// job, a call to another system) through the layer's own pipeline: the rules in
    /// force, the key's plan (the default plan, or the plan a [`PlanLookup`] finds for the
    /// key; a header resolver finds no header here, see [`check_plan`](Self::check_plan)),
    /// shadow limits, waiting up to `max_wait`, the store's timeout, circuit breaker and
    /// failure policy, and the layer's metrics and logs. An allowed check spends the
    /// units as the request would; a denied one spends nothing.
    ///
    /// The key must be the layer's: [`key_of`](Self::key_of) for a request,
    /// [`key_for`](Self::key_for) for a value an admin typed.
    ///
    /// ```
    /// use std::time::Duration;
    /// use tollgate::{Limit, RateLimitLayer, Verdict, key::HeaderKey};
    ///
    /// # #[tokio::main(flavor = "current_thread")]
    /// # async fn main() -> Result<(), Box<dyn std::error::Error>> {
    /// let layer = RateLimitLayer::new(Limit::fixed_window(2, Duration::from_secs(60))?)
    ///     .with_key(HeaderKey::new("x-api-key")?);
    /// let limiter = layer.limiter();
    /// // Each message on a client's WebSocket counts like a request with its API key.
    /// let key = limiter.key_for("k-123")?;
    /// assert!(limiter.check(&key, 1).await.is_allowed());
    /// assert!(limiter.check(&key, 1).await.is_allowed());
    /// assert!(matches!(limiter.check(&key, 1).await, Verdict::Denied(_)));
    /// # Ok(()) }
    /// ```
    ///
    /// [`PlanLookup`]: crate::plan::PlanLookup
    pub fn check(&self, key: &Key, cost: u32) -> impl Future<Output = Verdict> + Send + use<K> {
        let shared = self.shared.clone();
        let asked = Asked {
            key: key.clone(),
            cost,
            timer: Timer::start(),
        };
        async move {
            let request = Request::new(());
            let layer = shared.rules.active.load_full();
            let rules = if layer.has_plans() {
                let chosen = match layer.choose(&request, &asked.key) {
                    Ok(chosen) => chosen,
                    Err(resolving) => {
                        let name = resolving.await;
                        layer.named(name.as_deref())
                    }
                };
                match planned(&shared, &layer, &chosen) {
                    Some(rules) => rules,
                    None => return Verdict::Allowed(None),
                }
            } else {
                layer
            };
            drive(&shared, &rules, &request, &asked).await
        }
    }

    /// [`check`](Self::check) under the [plan](crate::plan) called `plan`, as a request
    /// naming it is decided (a name that is no plan of the layer: the default plan, else
    /// the layer's own limits).
    pub fn check_plan(
        &self,
        plan: &str,
        key: &Key,
        cost: u32,
    ) -> impl Future<Output = Verdict> + Send + use<K> {
        let shared = self.shared.clone();
        let asked = Asked {
            key: key.clone(),
            cost,
            timer: Timer::start(),
        };
        let layer = shared.rules.active.load_full();
        let rules = planned(&shared, &layer, &layer.named(Some(plan)));
        async move {
            match rules {
                Some(rules) => drive(&shared, &rules, &Request::new(()), &asked).await,
                None => Verdict::Allowed(None),
            }
        }
    }

    /// The key the layer's extractor makes of `value` typed by an admin or read from a
    /// job (the API key itself, a client's address), validated, grouped and hashed as it
    /// does for requests: the key names the same state as the requests it stands for.
    /// See [`KeyExtractor::key_for`].
    ///
    /// # Errors
    ///
    /// When `value` is not a valid value for the extractor (not an IP address for
    /// [`PeerIp`](crate::key::PeerIp), not a header value for
    /// [`HeaderKey`](crate::key::HeaderKey)), or the extractor cannot make keys from a
    /// value (a closure).
    pub fn key_for(&self, value: &str) -> Result<Key, KeyError>
    where
        K: KeyExtractor<()>,
    {
        self.key.key_for(value)
    }

    /// The key the layer would count `request` against (its extractor's answer).
    ///
    /// # Errors
    ///
    /// When the extractor finds no key in `request` (a missing header, say).
    pub fn key_of<B>(&self, request: &Request<B>) -> Result<Key, KeyError>
    where
        K: KeyExtractor<B>,
    {
        self.key.extract(request)
    }

    /// The rules in force.
    pub fn rules(&self) -> Rules {
        self.cell.active.load().rules.clone()
    }

    /// The decision a request of `cost` from `key` would get now from the layer's
    /// limits ([`Rules::limits`], also while the whole layer is in shadow), with nothing
    /// written: no key created, no expiry moved. Per limit: allowed, `remaining` as that
    /// request would leave it, `reset_after` and `retry_after`. Cost 0 reads what is
    /// left.
    ///
    /// # Errors
    ///
    /// When the store fails, times out or does not implement peeking
    /// ([`StoreErrorKind::Unsupported`](crate::StoreErrorKind::Unsupported)).
    pub fn peek(
        &self,
        key: &Key,
        cost: u32,
    ) -> impl Future<Output = Result<Decision, StoreError>> + Send + use<K> {
        let rules = self.cell.active.load();
        self.peek_limits(key, rules.rules.limits(), cost)
    }

    /// [`peek`](Self::peek) under the [plan](crate::plan) called `plan`: its limits and
    /// its own state. An unlimited plan answers [`Decision::unlimited`]; a name that is no
    /// plan of the layer is answered as a request naming it is decided (the default
    /// plan, else the layer's own limits).
    ///
    /// # Errors
    ///
    /// As [`peek`](Self::peek).
    pub fn peek_plan(
        &self,
        plan: &str,
        key: &Key,
        cost: u32,
    ) -> impl Future<Output = Result<Decision, StoreError>> + Send + use<K> {
        let rules = self.cell.active.load();
        let limits = match rules.named(Some(plan)) {
            Chosen::Layer => rules.limits().clone(),
            Chosen::Plan(plan) => plan.limits().clone(),
            Chosen::Unlimited(_) => Arc::<[Limit]>::from([]),
        };
        self.peek_limits(key, &limits, cost)
    }

    /// [`peek`](Self::peek) for the [shadow limits](crate::guide::shadow).
    ///
    /// # Errors
    ///
    /// As [`peek`](Self::peek).
    pub fn peek_shadow(
        &self,
        key: &Key,
        cost: u32,
    ) -> impl Future<Output = Result<Decision, StoreError>> + Send + use<K> {
        let rules = self.cell.active.load();
        self.peek_limits(key, rules.rules.shadow_limits(), cost)
    }

    fn peek_limits(
        &self,
        key: &Key,
        limits: &[Limit],
        cost: u32,
    ) -> impl Future<Output = Result<Decision, StoreError>> + Send + use<K> {
        let check = if limits.is_empty() {
            None
        } else {
            Some(self.cell.active.load().store.peek(key, limits, cost))
        };
        async move {
            match check {
                Some(check) => check.await,
                None => Ok(Decision::unlimited()),
            }
        }
    }

    /// Clears `key`'s state under every limit of the layer (enforced, shadow, and every
    /// [plan](crate::plan)'s), in one atomic step per store: its next request finds full
    /// budgets, whatever plan it is decided under. With the Redis store,
    /// every replica's block cache forgets the key's denials (see
    /// [`Store::reset`]); with [`FailurePolicy::Local`], the fallback store's state goes
    /// too.
    ///
    /// # Errors
    ///
    /// When the store fails, times out or does not implement resetting
    /// ([`StoreErrorKind::Unsupported`](crate::StoreErrorKind::Unsupported)).
    pub fn reset(&self, key: &Key) -> impl Future<Output = Result<(), StoreError>> + Send + use<K> {
        let rules = self.cell.active.load();
        let limits = rules.rules.every_stored_limit();
        let reset = rules.store.reset(key, &limits);
        let local = match rules.rules.on_store_error() {
            FailurePolicy::Local(store) => Some(store.reset(key, &limits)),
            _ => None,
        };
        async move {
            if let Some(local) = local {
                local.await?;
            }
            reset.await
        }
    }
}

/// The rules a check is decided under, once its plan is chosen: `None` for an unlimited
/// plan (counted as an allowed request, as the service counts it).
fn planned(
    shared: &Shared<Verdicts>,
    layer: &Arc<Active>,
    chosen: &Chosen<'_>,
) -> Option<Arc<Active>> {
    match *chosen {
        Chosen::Layer => Some(layer.clone()),
        Chosen::Plan(rules) => Some(Arc::clone(rules)),
        Chosen::Unlimited(plan) => {
            shared.metrics.request(Outcome::Allowed);
            shared.metrics.plan(plan, Outcome::Allowed);
            None
        }
    }
}

/// Runs a check through the pipeline: [`Shared::decide`], then each store call (or wait
/// in line) it asks for and [`settle`] of its answer, as the service's response future
/// does, until the pipeline answers.
async fn drive(
    shared: &Shared<Verdicts>,
    rules: &Active,
    request: &Request<()>,
    asked: &Asked,
) -> Verdict {
    let mut next: Next<Verdict> = shared.decide(rules, request, asked, false);
    let mut round = Round::First;
    loop {
        let mut asking = match next {
            Next::Answer(response) => return response.into_body(),
            Next::Call(decision, _) => return Verdict::Allowed(decision),
            Next::Wait(ticket) => {
                round = ticket.round();
                Asking::wait(*ticket, rules, asked)
            }
            Next::Ask(asking) => asking,
        };
        let answer = std::future::poll_fn(|cx| asking.poll(cx)).await;
        next = settle(shared, rules, answer, request, asked, round, false);
    }
}

impl<K> Clone for Limiter<K> {
    fn clone(&self) -> Self {
        Self {
            key: self.key.clone(),
            cell: self.cell.clone(),
            shared: self.shared.clone(),
        }
    }
}

impl<K: fmt::Debug> fmt::Debug for Limiter<K> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Limiter")
            .field("key", &self.key)
            .field("limits", &self.cell.active.load().rules.limits())
            .finish_non_exhaustive()
    }
}
