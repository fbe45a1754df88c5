//! [`Plans`]: limits chosen per request (free, paid, internal, ...).
//!
//! A [`Plan`] is a name with its limits, or unlimited. A layer given [`Plans`]
//! ([`RateLimitLayer::with_plans`](crate::RateLimitLayer::with_plans), [`Rules::with_plans`](crate::rules::Rules::with_plans)) asks
//! their resolver which plan each request is on, after its key is extracted, and decides
//! the request under that plan's limits instead of the layer's own: all-or-nothing, in
//! one store call, as always.
//!
//! - **Resolvers.** A header whose value names the plan ([`Plans::with_header`]), a sync
//!   closure over the request and its key ([`Plans::with_resolver`]: an extension set by
//!   the auth layer, a claim), or an async lookup by key ([`Plans::with_lookup`]: a
//!   database) whose answers are cached per key for a TTL, in a bounded cache (below).
//! - **No answer.** A request the resolver gives no plan, an unknown plan name, or a
//!   lookup that fails (logged at `warn`, not cached) is decided under the
//!   [default plan](Plans::with_default) or, without one, under the layer's own limits:
//!   never unlimited by accident.
//! - **State.** Each plan's limits keep their own state: their store keys carry the
//!   plan's name, so a client moving from `free` to `paid` starts `paid` with a full
//!   budget, and moving back finds `free` as it left it. A plan built with
//!   [`Plan::with_shared_state`] keeps its limits' own keys instead: limits equal (or
//!   [carried over](crate::OnChange::CarryOver) under one name) in two such plans share
//!   one budget. So to let clients keep what they spent across plans, build the plans
//!   with `Plan::sharing_state(true)` and give their limits one name with
//!   `OnChange::CarryOver`: then a `pro` client who spent 2 of `trial`'s 2 has 2 of
//!   `pro`'s 4 left.
//! - **Fields and metrics.** A plan's policies are called `<plan>.<policy>` in
//!   `RateLimit-Policy` and `RateLimit` (`"free.hourly";q=100;w=3600`, or
//!   `"free.100-per-1h"` for an unnamed limit), their writers
//!   prepared once per plan. With the feature `metrics`, each request decided under a
//!   plan is also counted in [`tollgate_plan_requests_total`](crate::metrics::PLAN_REQUESTS_TOTAL)
//!   with the labels `route`, `plan` and `outcome` (and in `tollgate_requests_total` as
//!   before). An [unlimited](Plan::unlimited) plan makes no store call and writes no
//!   fields.
//! - **Changes.** Plans are part of the [`Rules`](crate::rules::Rules), so a [`RulesHandle`](crate::rules::RulesHandle)
//!   changes them while the layer serves.
//!
//! A layer without plans pays one predictable branch per request for them.
//!
//! ```
//! use std::time::Duration;
//! use tollgate::{Limit, RateLimitLayer, key::HeaderKey, plan::{Plan, Plans}};
//!
//! let hourly = |n| Limit::fixed_window(n, Duration::from_secs(3600));
//! let plans = Plans::new([
//!     Plan::new("free", [hourly(100)?])?,
//!     Plan::new("paid", [hourly(10_000)?, Limit::token_bucket(50, Duration::from_secs(1))?])?,
//!     Plan::unlimited("internal")?,
//! ])?
//! .with_default("free")?
//! // Set by the auth layer in front, never by clients.
//! .with_resolver(|request| request.header("x-plan"));
//! // The layer's own limit applies only without a plan: here never, as there is a default.
//! let layer = RateLimitLayer::new(hourly(100)?)
//!     .with_key(HeaderKey::new("x-api-key")?)
//!     .with_plans(plans);
//! # let _ = layer;
//! # Ok::<(), Box<dyn std::error::Error>>(())
//! ```
//!
//! # Lookups
//!
//! A [`PlanLookup`]'s answer (a plan name, or none for the default) is cached per key for
//! the [TTL](PlanLookup::with_ttl) (60 s by default: how long a changed plan takes to apply) in
//! a bounded `quick_cache` ([`max_keys`](PlanLookup::with_max_keys), 10 000 keys by default, the
//! coldest evicted first). A cache hit is decided at once, a miss waits for the lookup, and
//! the requests of one key that miss together wait for one lookup (a cold key costs the
//! database one query). Tests set a `ManualClock` with [`PlanLookup::with_clock`].
//!
//! ```
//! use std::time::Duration;
//! use tollgate::{Limit, RateLimitLayer, key::{HeaderKey, Key}, plan::{Plan, PlanLookup, Plans}};
//!
//! let hourly = |n| Limit::fixed_window(n, Duration::from_secs(3600));
//! let plans = Plans::new([Plan::new("free", [hourly(100)?])?, Plan::new("paid", [hourly(10_000)?])?])?
//!     .with_default("free")?;
//! let lookup = PlanLookup::new(|key: Key| async move {
//!     let plan: Option<String> = None; // SELECT plan FROM customers WHERE api_key = ...
//!     Ok::<_, std::io::Error>(plan)
//! })
//! .with_ttl(Duration::from_secs(60))
//! .with_max_keys(100_000);
//! let layer = RateLimitLayer::new(hourly(100)?)
//!     .with_key(HeaderKey::new("x-api-key")?)
//!     .with_plans(plans.with_lookup(lookup));
//! # let _ = layer;
//! # Ok::<(), Box<dyn std::error::Error>>(())
//! ```
//!
//! Works the same on memory, Redis and Redis Cluster (`tests/plans.rs`, over axum and a
//! tonic client too). In the example gateway: `[[routes.plans]]` with `plan_header` and
//! `default_plan` (gateway/README.md, "Plans").

use std::{fmt, future::Future, sync::Arc, time::Duration};

use futures_util::{FutureExt, future::BoxFuture};
use http::{Extensions, HeaderMap, HeaderName, Method, Request, Uri};
use quick_cache::sync::Cache;

use crate::{
    ConfigError, Limit,
    clock::{Clock, MonotonicClock},
    key::Key,
};

/// A named set of limits, or unlimited: one tier of a product. See the
/// [module docs](crate::plan).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Plan {
    pub(crate) name: Arc<str>,
    /// `None`: unlimited.
    limits: Option<Arc<[Limit]>>,
    /// `None`: the layer's shadow limits.
    shadow_limits: Option<Arc<[Limit]>>,
    shared_state: bool,
}

impl Plan {
    /// The plan `name` with `limits` (at least one; all must allow a request).
    ///
    /// # Errors
    ///
    /// A name that is empty, longer than 64 bytes or not of `A-Z a-z 0-9 - _ .` (field
    /// `plan`), no limit (field `limits`), two different limits with one state (field
    /// `name`, as for [`Rules::with_limits`](crate::rules::Rules::with_limits)).
    pub fn new(
        name: impl Into<String>,
        limits: impl IntoIterator<Item = Limit>,
    ) -> Result<Self, ConfigError> {
        let name = plan_name(name.into())?;
        let limits = crate::rules::unique(limits)?;
        if limits.is_empty() {
            return Err(ConfigError::new(
                "limits",
                format!("plan {name:?} must hold at least one limit (or be unlimited)"),
            ));
        }
        Ok(Self {
            name,
            limits: Some(limits.into()),
            shadow_limits: None,
            shared_state: false,
        })
    }

    /// The plan `name` without limits: its requests are never counted nor rejected and
    /// get no rate-limit fields.
    ///
    /// # Errors
    ///
    /// An invalid name, as for [`new`](Self::new).
    pub fn unlimited(name: impl Into<String>) -> Result<Self, ConfigError> {
        Ok(Self {
            name: plan_name(name.into())?,
            limits: None,
            shadow_limits: None,
            shared_state: false,
        })
    }

    /// Whether this plan's limits keep their own state (`false`, the default: their store
    /// keys carry the plan's name) or share it with equal limits of the layer and of other
    /// sharing plans (`true`). Share to let a client who changes plans keep what it spent:
    /// give the limits of both plans one [name](Limit::with_name) and
    /// [`OnChange::CarryOver`](crate::OnChange::CarryOver).
    pub fn with_shared_state(mut self, share: bool) -> Self {
        self.shared_state = share;
        self
    }

    /// This plan's own [shadow limits](crate::rules::Rules::with_shadow_limits), in place of the
    /// layer's (which a plan without its own has): say, a stricter free tier to try before
    /// it is enforced. An empty list gives the plan none. They keep their state as the
    /// plan's limits do (see [`sharing_state`](Self::with_shared_state)).
    ///
    /// # Errors
    ///
    /// A shadow limit with the state of one of the plan's limits (field `shadow_limits`),
    /// two with one state (field `name`), or an unlimited plan (field `shadow_limits`).
    pub fn with_shadow_limits(
        mut self,
        limits: impl IntoIterator<Item = Limit>,
    ) -> Result<Self, ConfigError> {
        let Some(enforced) = &self.limits else {
            return Err(ConfigError::new(
                "shadow_limits",
                format!(
                    "plan {:?} is unlimited: it has nothing to shadow",
                    self.name
                ),
            ));
        };
        let shadow = crate::rules::unique(limits)?;
        crate::rules::disjoint(enforced, &shadow)?;
        self.shadow_limits = Some(shadow.into());
        Ok(self)
    }

    /// The plan's own shadow limits, if it has them. See
    /// [`with_shadow_limits`](Self::with_shadow_limits).
    pub fn shadow_limits(&self) -> Option<&[Limit]> {
        self.shadow_limits.as_deref()
    }

    /// The name.
    pub fn name(&self) -> &str {
        &self.name
    }

    /// The limits, as given; `None` for an unlimited plan.
    pub fn limits(&self) -> Option<&[Limit]> {
        self.limits.as_deref()
    }

    /// Whether the plan is unlimited.
    pub fn is_unlimited(&self) -> bool {
        self.limits.is_none()
    }

    /// Whether the limits share their state. See [`sharing_state`](Self::with_shared_state).
    pub fn shares_state(&self) -> bool {
        self.shared_state
    }

    /// The limits as the store keeps them: under the plan's name unless shared.
    pub(crate) fn stored_limits(&self) -> Option<Arc<[Limit]>> {
        self.stored(self.limits.as_ref()?)
    }

    /// The plan's own shadow limits as the store keeps them, if it has them.
    pub(crate) fn stored_shadow_limits(&self) -> Option<Arc<[Limit]>> {
        self.stored(self.shadow_limits.as_ref()?)
    }

    fn stored(&self, limits: &Arc<[Limit]>) -> Option<Arc<[Limit]>> {
        if self.shared_state {
            return Some(limits.clone());
        }
        Some(limits.iter().map(|l| l.scoped(&self.name)).collect())
    }
}

fn plan_name(name: String) -> Result<Arc<str>, ConfigError> {
    let valid = !name.is_empty()
        && name.len() <= 64
        && name
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || matches!(b, b'-' | b'_' | b'.'));
    if !valid {
        return Err(ConfigError::new(
            "plan",
            format!("must be 1 to 64 of A-Z a-z 0-9 - _ . (got {name:?})"),
        ));
    }
    Ok(name.into())
}

/// A layer's plans, its default plan and the resolver that picks one per request. See
/// the [module docs](crate::plan).
#[derive(Debug, Clone)]
pub struct Plans {
    pub(crate) plans: Arc<[Plan]>,
    pub(crate) default: Option<Arc<str>>,
    pub(crate) resolver: Resolver,
}

impl Plans {
    /// These plans (at least one, each name once), with no resolver yet (every request
    /// gets the default plan) and no default plan (the layer's own limits).
    ///
    /// # Errors
    ///
    /// No plan, or two plans with one name (field `plans`).
    pub fn new(plans: impl IntoIterator<Item = Plan>) -> Result<Self, ConfigError> {
        let plans: Vec<Plan> = plans.into_iter().collect();
        if plans.is_empty() {
            return Err(ConfigError::new("plans", "must hold at least one plan"));
        }
        for (i, plan) in plans.iter().enumerate() {
            if plans[..i].iter().any(|p| p.name == plan.name) {
                return Err(ConfigError::new(
                    "plans",
                    format!("{:?} is the name of two plans", plan.name()),
                ));
            }
        }
        Ok(Self {
            plans: plans.into(),
            default: None,
            resolver: Resolver::None,
        })
    }

    /// The plan of requests that the resolver gives none, an unknown one, or whose
    /// lookup fails. Without it they are decided under the layer's own limits.
    ///
    /// # Errors
    ///
    /// `name` is not one of the plans (field `default_plan`).
    pub fn with_default(mut self, name: &str) -> Result<Self, ConfigError> {
        match self.plans.iter().find(|p| &*p.name == name) {
            Some(plan) => {
                self.default = Some(plan.name.clone());
                Ok(self)
            }
            None => Err(ConfigError::new(
                "default_plan",
                format!("{name:?} is not one of the plans"),
            )),
        }
    }

    /// Picks the plan from the value of the header `name`, which names it.
    ///
    /// **Let only a component you trust set this header** (an auth proxy in front that
    /// removes the client's own): a client that can send it chooses its own plan.
    pub fn with_header(mut self, name: HeaderName) -> Self {
        self.resolver = Resolver::Header(name);
        self
    }

    /// Picks the plan with `resolve`, from the request and its key, without waiting: its
    /// headers, an extension set by an auth layer in front, the key itself. `None` (or
    /// an unknown name) means the default plan. The name is borrowed from the request
    /// (a header, an extension's field) or `'static` (`Some("paid")`).
    pub fn with_resolver<F>(mut self, resolve: F) -> Self
    where
        F: for<'a> Fn(&'a PlanRequest<'a>) -> Option<&'a str> + Send + Sync + 'static,
    {
        self.resolver = Resolver::Sync(Arc::new(resolve));
        self
    }

    /// Picks the plan with an async lookup by key (a database), cached: see
    /// [`PlanLookup`].
    pub fn with_lookup(mut self, lookup: PlanLookup) -> Self {
        self.resolver = Resolver::Lookup(lookup);
        self
    }

    /// The plans.
    pub fn plans(&self) -> &[Plan] {
        &self.plans
    }

    /// The default plan's name, if any.
    pub fn default_plan(&self) -> Option<&str> {
        self.default.as_deref()
    }
}

/// What a [resolver](Plans::with_resolver) sees of a request: its head and its key.
#[derive(Debug, Clone, Copy)]
pub struct PlanRequest<'a> {
    method: &'a Method,
    uri: &'a Uri,
    headers: &'a HeaderMap,
    extensions: &'a Extensions,
    key: &'a Key,
}

impl<'a> PlanRequest<'a> {
    /// The view of `request`, counted against `key`.
    pub fn new<B>(request: &'a Request<B>, key: &'a Key) -> Self {
        Self {
            method: request.method(),
            uri: request.uri(),
            headers: request.headers(),
            extensions: request.extensions(),
            key,
        }
    }

    /// The method.
    pub fn method(&self) -> &'a Method {
        self.method
    }

    /// The URI.
    pub fn uri(&self) -> &'a Uri {
        self.uri
    }

    /// The headers.
    pub fn headers(&self) -> &'a HeaderMap {
        self.headers
    }

    /// The extensions (where an auth layer leaves what it knows of the client).
    pub fn extensions(&self) -> &'a Extensions {
        self.extensions
    }

    /// The key the request is counted against.
    pub fn key(&self) -> &'a Key {
        self.key
    }

    /// The value of the header `name`, if it is present and visible ASCII.
    pub fn header(&self, name: &str) -> Option<&'a str> {
        self.headers.get(name)?.to_str().ok()
    }
}

type SyncResolve = dyn for<'a> Fn(&'a PlanRequest<'a>) -> Option<&'a str> + Send + Sync;
type Lookup = dyn Fn(Key) -> BoxFuture<'static, Result<Option<String>, BoxError>> + Send + Sync;
type BoxError = Box<dyn std::error::Error + Send + Sync>;

#[derive(Clone)]
pub(crate) enum Resolver {
    /// Every request gets the default plan.
    None,
    Header(HeaderName),
    Sync(Arc<SyncResolve>),
    Lookup(PlanLookup),
}

impl fmt::Debug for Resolver {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Self::None => f.write_str("None"),
            Self::Header(name) => f.debug_tuple("Header").field(name).finish(),
            Self::Sync(_) => f.write_str("Sync(..)"),
            Self::Lookup(lookup) => f.debug_tuple("Lookup").field(lookup).finish(),
        }
    }
}

/// An async plan lookup by key (a database query), with its answers cached per key.
///
/// A request whose key has a fresh answer in the cache is decided at once; one whose key
/// has none waits for the lookup, and requests for one key that miss together wait for
/// one lookup. The answer, a plan name or none (the default plan), is kept for the
/// [TTL](Self::with_ttl) in a cache of at most [`max_keys`](Self::with_max_keys) keys
/// (`quick_cache`, which evicts the coldest keys when full). A lookup that fails is
/// logged at `warn` and not cached: the request gets the default plan, the next one
/// looks up again.
///
/// ```
/// use std::time::Duration;
/// use tollgate::{key::Key, plan::PlanLookup};
///
/// let lookup = PlanLookup::new(|key: Key| async move {
///     // A database query in real code.
///     let plan = if key.as_str().ends_with("|vip") { Some("paid".to_owned()) } else { None };
///     Ok::<_, std::io::Error>(plan)
/// })
/// .with_ttl(Duration::from_secs(30))
/// .with_max_keys(50_000);
/// # let _ = lookup;
/// ```
#[derive(Clone)]
pub struct PlanLookup {
    lookup: Arc<Lookup>,
    cache: Arc<Cache<Key, Cached>>,
    ttl_ms: u64,
    max_keys: usize,
    clock: Arc<dyn Clock>,
}

#[derive(Debug, Clone)]
struct Cached {
    plan: Option<Arc<str>>,
    expires_ms: u64,
}

impl PlanLookup {
    /// The default time an answer is kept: one minute.
    pub const DEFAULT_TTL: Duration = Duration::from_secs(60);
    /// The default number of keys whose answers are kept.
    pub const DEFAULT_MAX_KEYS: usize = 10_000;

    /// Looks plans up with `lookup`: the key's plan name, `None` for the default plan,
    /// or an error (the default plan, not cached).
    pub fn new<F, Fut, E>(lookup: F) -> Self
    where
        F: Fn(Key) -> Fut + Send + Sync + 'static,
        Fut: Future<Output = Result<Option<String>, E>> + Send + 'static,
        E: Into<BoxError>,
    {
        let lookup: Arc<Lookup> =
            Arc::new(move |key| lookup(key).map(|r| r.map_err(Into::into)).boxed());
        Self {
            lookup,
            cache: Arc::new(Cache::new(Self::DEFAULT_MAX_KEYS)),
            ttl_ms: Self::DEFAULT_TTL.as_millis() as u64,
            max_keys: Self::DEFAULT_MAX_KEYS,
            clock: Arc::new(MonotonicClock),
        }
    }

    /// How long an answer is kept ([`DEFAULT_TTL`](Self::DEFAULT_TTL) by default): how
    /// long a changed plan may take to apply. Zero looks up on every request.
    pub fn with_ttl(mut self, ttl: Duration) -> Self {
        self.ttl_ms = u64::try_from(ttl.as_millis()).unwrap_or(u64::MAX);
        self
    }

    /// How many keys' answers are kept at most
    /// ([`DEFAULT_MAX_KEYS`](Self::DEFAULT_MAX_KEYS) by default; at least 1). Starts an
    /// empty cache.
    pub fn with_max_keys(mut self, max_keys: usize) -> Self {
        self.max_keys = max_keys.max(1);
        self.cache = Arc::new(Cache::new(self.max_keys));
        self
    }

    /// Times the TTL with `clock` (tests: a [`ManualClock`](crate::clock::ManualClock)).
    pub fn with_clock(mut self, clock: impl Clock) -> Self {
        self.clock = Arc::new(clock);
        self
    }

    /// The cached answer for `key`, if fresh: `Some(None)` is a cached "default plan".
    pub(crate) fn cached(&self, key: &Key) -> Option<Option<Arc<str>>> {
        let cached = self.cache.get(key)?;
        (self.clock.now_ms() < cached.expires_ms).then_some(cached.plan)
    }

    /// Looks `key` up and caches the answer; `None` when it failed or named no plan. One
    /// request per key looks up at a time: the others that miss meanwhile wait for its
    /// answer (quick_cache's placeholder), so a cold key costs the database one query
    /// however many requests it has at once.
    pub(crate) fn resolve(&self, key: Key) -> BoxFuture<'static, Option<Arc<str>>> {
        let this = self.clone();
        async move {
            let cache = this.cache.clone();
            // An expired answer goes, so that the next lookup holds the placeholder.
            let now = this.clock.now_ms();
            cache.remove_if(&key, |cached| now >= cached.expires_ms);
            let guard = match cache.get_value_or_guard_async(&key).await {
                // Another request's lookup answered meanwhile.
                Ok(cached) if this.clock.now_ms() < cached.expires_ms => return cached.plan,
                Ok(_) => None,
                Err(guard) => Some(guard),
            };
            match (this.lookup)(key.clone()).await {
                Ok(plan) => {
                    let plan: Option<Arc<str>> = plan.map(Into::into);
                    let cached = Cached {
                        plan: plan.clone(),
                        expires_ms: this.clock.now_ms().saturating_add(this.ttl_ms),
                    };
                    match guard {
                        Some(guard) => {
                            let _ = guard.insert(cached);
                        }
                        None => this.cache.insert(key, cached),
                    }
                    plan
                }
                Err(error) => {
                    // Never the key itself: it may be an API key.
                    tracing::warn!(
                        error = %error,
                        key = %key.redacted(),
                        "rate limit plan lookup failed; using the default plan"
                    );
                    None
                }
            }
        }
        .boxed()
    }
}

impl fmt::Debug for PlanLookup {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("PlanLookup")
            .field("ttl_ms", &self.ttl_ms)
            .field("max_keys", &self.max_keys)
            .field("cached", &self.cache.len())
            .finish_non_exhaustive()
    }
}

#[cfg(test)]
mod tests;
