//! [`Limiter`]: peek at and reset a key's budget under a layer's rules and store, from
//! handlers and admin code.

use std::{fmt, future::Future, sync::Arc};

use http::Request;

use crate::{
    Decision, FailurePolicy, Limit, Rules, StoreError,
    key::{Key, KeyError, KeyExtractor},
    rules::{Cell, Chosen},
    store::Store,
};

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
}

impl<K> Limiter<K> {
    pub(crate) fn new(key: Arc<K>, cell: Arc<Cell>) -> Self {
        Self { key, cell }
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

impl<K> Clone for Limiter<K> {
    fn clone(&self) -> Self {
        Self {
            key: self.key.clone(),
            cell: self.cell.clone(),
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
