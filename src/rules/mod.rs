//! [`Rules`] and [`RulesHandle`]: the part of a layer's configuration that can change while
//! it serves (its limits and [shadow](crate#shadow-mode) limits, failure policy,
//! missing-key policy and header style), swapped atomically.
//!
//! Each request reads the rules once, when it arrives, and is decided, answered and given
//! its headers under that one set: a change never shows half-applied to a request, and
//! requests in flight finish under the rules they started with. The rules sit in an
//! [`arc_swap::ArcSwap`]; each service keeps the set it last saw and compares one version
//! number per request, so reading them costs a request no lock and no shared counter.
//!
//! ```
//! use std::time::Duration;
//! use tollgate::{Limit, OnChange, RateLimitLayer, Rules};
//!
//! let per_minute = |n| -> Result<Limit, tollgate::ConfigError> {
//!     Limit::token_bucket(n, Duration::from_secs(60))?
//!         .named("api")?
//!         .on_change(OnChange::CarryOver)
//! };
//! let layer = RateLimitLayer::new(per_minute(100)?);
//! let rules = layer.rules_handle();
//! // Later, from a config reload: the next request is decided under 200/min, with the
//! // tokens its client has left.
//! let version = rules.set(rules.rules().with_limits([per_minute(200)?])?);
//! assert_eq!(version, 2);
//! assert_eq!(layer.limits()[0].limit(), 200);
//! # Ok::<(), tollgate::ConfigError>(())
//! ```

use std::{
    fmt,
    sync::{Arc, atomic::AtomicU64, atomic::Ordering},
};

use arc_swap::ArcSwap;

use crate::{
    ConfigError, FailurePolicy, HeaderStyle, Limit, MissingKey, Plans,
    headers::HeaderWriter,
    plan::{Chosen, PlanTable, Resolving},
    store::Store,
};

/// A layer's changeable configuration: its limits and policies. Built with
/// [`Rules::new`] and the `with_*` methods, applied with [`RulesHandle::set`].
#[derive(Debug, Clone)]
pub struct Rules {
    limits: Arc<[Limit]>,
    /// Decided and counted, never enforced: see [`with_shadow_limits`](Self::with_shadow_limits).
    shadow_limits: Arc<[Limit]>,
    /// Every limit is a shadow one: see [`with_shadow`](Self::with_shadow).
    shadow: bool,
    on_store_error: FailurePolicy,
    on_missing_key: MissingKey,
    headers: HeaderStyle,
    /// Limits chosen per request: see [`with_plans`](Self::with_plans).
    plans: Option<Plans>,
}

impl Rules {
    /// `limits` (at least one) with the default policies: fail open, reject requests
    /// without a key, the IETF fields.
    ///
    /// # Errors
    ///
    /// See [`with_limits`](Self::with_limits).
    pub fn new(limits: impl IntoIterator<Item = Limit>) -> Result<Self, ConfigError> {
        Self {
            limits: Arc::from([]),
            shadow_limits: Arc::from([]),
            shadow: false,
            on_store_error: FailurePolicy::default(),
            on_missing_key: MissingKey::default(),
            headers: HeaderStyle::default(),
            plans: None,
        }
        .with_limits(limits)
    }

    /// The same rules with these limits instead (all must allow a request, as for
    /// [`RateLimitLayer::limit`](crate::RateLimitLayer::limit); equal limits count once).
    ///
    /// # Errors
    ///
    /// No limit at all (field `limits`), or two different limits with the same state
    /// (field `name`): two [carried-over](crate::OnChange::CarryOver) limits with one
    /// name, algorithm and window.
    pub fn with_limits(
        mut self,
        limits: impl IntoIterator<Item = Limit>,
    ) -> Result<Self, ConfigError> {
        let limits = unique(limits)?;
        if limits.is_empty() && self.shadow_limits.is_empty() {
            return Err(ConfigError::new("limits", "must hold at least one limit"));
        }
        disjoint(&limits, &self.shadow_limits)?;
        self.limits = limits.into();
        Ok(self)
    }

    /// The same rules with these shadow limits instead (none by default): each request
    /// is decided and counted on them as usual, but never rejected by them; a request
    /// they would reject is counted as `would_reject` in the metrics (feature `metrics`)
    /// and logged at `info`. They are decided in a store call of their own, so the
    /// enforced limits count exactly as if they were absent, and they see every request
    /// that reaches the layer with a key, as a layer in front of this one would. See
    /// [Shadow mode](crate#shadow-mode).
    ///
    /// # Errors
    ///
    /// A shadow limit with the state of an enforced one (field `shadow_limits`: they
    /// would count each request twice), or two shadow limits sharing one state (as for
    /// [`with_limits`](Self::with_limits)).
    pub fn with_shadow_limits(
        mut self,
        limits: impl IntoIterator<Item = Limit>,
    ) -> Result<Self, ConfigError> {
        let shadow = unique(limits)?;
        if shadow.is_empty() && self.limits.is_empty() {
            return Err(ConfigError::new("limits", "must hold at least one limit"));
        }
        disjoint(&self.limits, &shadow)?;
        self.shadow_limits = shadow.into();
        Ok(self)
    }

    /// The same rules with every limit in shadow (`true`) or not: no request is
    /// rejected for its rate, and each one a limit would reject is counted as
    /// `would_reject` and logged. All limits are still decided together, in one store
    /// call. See [Shadow mode](crate#shadow-mode).
    pub fn with_shadow(mut self, shadow: bool) -> Self {
        self.shadow = shadow;
        self
    }

    /// The same rules with this failure policy. See [`FailurePolicy`].
    pub fn with_on_store_error(mut self, policy: FailurePolicy) -> Self {
        self.on_store_error = policy;
        self
    }

    /// The same rules with this missing-key policy. See [`MissingKey`].
    pub fn with_on_missing_key(mut self, policy: MissingKey) -> Self {
        self.on_missing_key = policy;
        self
    }

    /// The same rules with these rate-limit fields. See [`HeaderStyle`].
    pub fn with_headers(mut self, style: HeaderStyle) -> Self {
        self.headers = style;
        self
    }

    /// The same rules with these [plans](crate::plan): each request is decided under the
    /// limits of the plan their resolver picks, or under these rules' limits when it
    /// picks none and there is no default plan.
    pub fn with_plans(mut self, plans: Plans) -> Self {
        self.plans = Some(plans);
        self
    }

    /// The same rules without plans: every request is decided under the limits.
    pub fn without_plans(mut self) -> Self {
        self.plans = None;
        self
    }

    /// The plans, if any. See [`with_plans`](Self::with_plans).
    pub fn plans(&self) -> Option<&Plans> {
        self.plans.as_ref()
    }

    /// These rules with a plan's (stored) limits in place of their own, and no plans.
    pub(crate) fn for_plan(&self, limits: Arc<[Limit]>) -> Self {
        Self {
            limits,
            plans: None,
            ..self.clone()
        }
    }

    /// The limits, in the order they are reported.
    pub fn limits(&self) -> &[Limit] {
        &self.limits
    }

    /// The shadow limits. See [`with_shadow_limits`](Self::with_shadow_limits).
    pub fn shadow_limits(&self) -> &[Limit] {
        &self.shadow_limits
    }

    /// Whether every limit is in shadow. See [`with_shadow`](Self::with_shadow).
    pub fn is_shadow(&self) -> bool {
        self.shadow
    }

    /// Every limit, enforced then shadow: what the store keeps state for.
    pub(crate) fn all_limits(&self) -> Arc<[Limit]> {
        if self.shadow_limits.is_empty() {
            return self.limits.clone();
        }
        self.limits
            .iter()
            .chain(self.shadow_limits.iter())
            .cloned()
            .collect()
    }

    /// [`all_limits`](Self::all_limits), and every plan's limits as they are stored
    /// (each plan's state apart): every limit that may hold state for a key.
    pub(crate) fn every_stored_limit(&self) -> Arc<[Limit]> {
        let all = self.all_limits();
        let Some(plans) = &self.plans else {
            return all;
        };
        let planned = plans.plans().iter().filter_map(|p| p.stored_limits());
        all.iter()
            .cloned()
            .chain(planned.flat_map(|l| l.to_vec()))
            .collect()
    }

    /// The failure policy.
    pub fn on_store_error(&self) -> &FailurePolicy {
        &self.on_store_error
    }

    /// The missing-key policy.
    pub fn on_missing_key(&self) -> MissingKey {
        self.on_missing_key
    }

    /// The rate-limit fields.
    pub fn headers(&self) -> HeaderStyle {
        self.headers
    }

    /// `limits` with the rest of these rules, for the layer's builder (which cannot fail):
    /// a limit with the same state as one present replaces it.
    pub(crate) fn push_limit(&mut self, limit: Limit) {
        self.shadow_limits = without(&self.shadow_limits, &limit);
        self.limits = pushed(&self.limits, limit);
    }

    /// A shadow limit, for the layer's builder: an enforced limit with the same state
    /// becomes this shadow one (so no state is counted twice).
    pub(crate) fn push_shadow_limit(&mut self, limit: Limit) {
        self.limits = without(&self.limits, &limit);
        self.shadow_limits = pushed(&self.shadow_limits, limit);
    }
}

/// `limits` plus `limit`, which replaces one with the same state.
fn pushed(limits: &[Limit], limit: Limit) -> Arc<[Limit]> {
    let mut limits = limits.to_vec();
    match limits.iter_mut().find(|l| l.id() == limit.id()) {
        Some(same) => *same = limit,
        None => limits.push(limit),
    }
    limits.into()
}

/// `limits` without the one with `limit`'s state.
fn without(limits: &Arc<[Limit]>, limit: &Limit) -> Arc<[Limit]> {
    if limits.iter().all(|l| l.id() != limit.id()) {
        return limits.clone();
    }
    limits
        .iter()
        .filter(|l| l.id() != limit.id())
        .cloned()
        .collect()
}

/// `limits` with equal ones counted once; two different ones with one state refused.
pub(crate) fn unique(limits: impl IntoIterator<Item = Limit>) -> Result<Vec<Limit>, ConfigError> {
    let mut unique: Vec<Limit> = Vec::new();
    for limit in limits {
        match unique.iter().find(|l| l.id() == limit.id()) {
            Some(same) if *same == limit => {}
            Some(same)
                if same.lockout() != limit.lockout()
                    && same.clone().with_lockout_ms(0) == limit.clone().with_lockout_ms(0) =>
            {
                return Err(ConfigError::new(
                    "lockout",
                    format!(
                        "{limit:?} differs from another limit only in its lockout: they would \
                         share one state; keep one"
                    ),
                ));
            }
            Some(_) => {
                return Err(ConfigError::new(
                    "name",
                    format!(
                        "{:?} is carried over by two different limits with the same \
                         algorithm and window: they would share one state",
                        limit.name().unwrap_or_default()
                    ),
                ));
            }
            None => unique.push(limit),
        }
    }
    Ok(unique)
}

/// Refuses a shadow limit with the state of an enforced one.
fn disjoint(enforced: &[Limit], shadow: &[Limit]) -> Result<(), ConfigError> {
    match shadow
        .iter()
        .find(|s| enforced.iter().any(|e| e.id() == s.id()))
    {
        Some(both) => Err(ConfigError::new(
            "shadow_limits",
            format!("{both:?} has the state of an enforced limit: each request would count twice"),
        )),
        None => Ok(()),
    }
}

/// Rules as requests use them: with what is derived from them prepared once.
#[derive(Debug)]
pub(crate) struct Active {
    pub(crate) rules: Rules,
    pub(crate) headers: HeaderWriter,
    pub(crate) version: u64,
    /// The limits that reject: none when the layer is in shadow.
    enforced: Arc<[Limit]>,
    /// The limits decided in a store call of their own and never enforced; `None` (the
    /// common case, which costs a request nothing more) when there are none.
    shadow: Option<Arc<[Limit]>>,
    /// The plans, each with its rules prepared; `None` (the common case) without plans.
    plans: Option<Box<PlanTable>>,
    /// The name of the plan these rules are of, for the metrics; `None` for a layer's.
    pub(crate) plan: Option<Arc<str>>,
}

impl Active {
    fn new(rules: Rules, version: u64) -> Self {
        let (enforced, shadow) = if rules.shadow {
            (Arc::from([]), Some(rules.all_limits()))
        } else if rules.shadow_limits.is_empty() {
            (rules.limits.clone(), None)
        } else {
            (rules.limits.clone(), Some(rules.shadow_limits.clone()))
        };
        let plans = rules
            .plans
            .as_ref()
            .map(|plans| Box::new(PlanTable::new(plans, &rules, version)));
        Self {
            headers: HeaderWriter::new(rules.headers, &enforced),
            rules,
            version,
            enforced,
            shadow,
            plans,
            plan: None,
        }
    }

    /// The rules of the plan `plan`: `rules` holds its limits; its fields name it.
    pub(crate) fn for_plan(rules: Rules, version: u64, plan: &Arc<str>) -> Self {
        let mut active = Self::new(rules, version);
        active.headers = HeaderWriter::for_plan(active.rules.headers, &active.enforced, plan);
        active.plan = Some(plan.clone());
        active
    }

    /// Whether requests are decided under plans.
    #[inline]
    pub(crate) fn has_plans(&self) -> bool {
        self.plans.is_some()
    }

    /// The plan of `request` with `key` (the layer's own limits without plans).
    pub(crate) fn choose<B>(
        &self,
        request: &http::Request<B>,
        key: &crate::key::Key,
    ) -> Result<Chosen<'_>, Resolving> {
        match &self.plans {
            Some(plans) => plans.choose(request, key),
            None => Ok(Chosen::Layer),
        }
    }

    /// The plan called `name` once a lookup answered.
    pub(crate) fn named(&self, name: Option<&str>) -> Chosen<'_> {
        match &self.plans {
            Some(plans) => plans.named(name),
            None => Chosen::Layer,
        }
    }

    /// The enforced limits, in the order they are reported.
    pub(crate) fn limits(&self) -> &Arc<[Limit]> {
        &self.enforced
    }

    /// The shadow limits, if any.
    #[inline]
    pub(crate) fn shadow(&self) -> Option<&Arc<[Limit]>> {
        self.shadow.as_ref()
    }
}

/// The rules of one layer (and all its clones and services), shared with its handles.
pub(crate) struct Cell {
    pub(crate) active: ArcSwap<Active>,
    /// The version of `active`, published after it: a service compares it with the
    /// version of the rules it holds (one relaxed-cost load per request, where loading
    /// `active` itself would cost arc-swap's debt protocol) and reloads only when it grew.
    current: AtomicU64,
    /// The layer's store, told about new limits (see [`Store::limits_changed`]).
    store: Arc<dyn Store>,
    /// Orders concurrent [`RulesHandle::set`] calls: versions only grow.
    next_version: AtomicU64,
}

impl Cell {
    pub(crate) fn new(rules: Rules, store: Arc<dyn Store>) -> Arc<Self> {
        Arc::new(Self {
            active: ArcSwap::from_pointee(Active::new(rules, 1)),
            current: AtomicU64::new(1),
            store,
            next_version: AtomicU64::new(2),
        })
    }

    /// Replaces `held` by the rules in force if they are newer.
    #[inline]
    pub(crate) fn refresh(&self, held: &mut Arc<Active>) {
        if held.version < self.current.load(Ordering::Acquire) {
            *held = self.active.load_full();
        }
    }
}

/// Changes a layer's [`Rules`] while it serves: see the [module docs](crate::rules).
///
/// Obtained from [`RateLimitLayer::rules_handle`](crate::RateLimitLayer::rules_handle)
/// once the layer is configured (a builder call after it gives the layer rules of its
/// own). Clones change the same layer; it is cheap to keep in a config-reload task.
///
/// What happens to the budgets: a limit that does not change keeps its state; a changed
/// one starts fresh or carries its state over, as each [`Limit`] chose with
/// [`Limit::on_change`]. A store's state is never rewritten by a change: the new
/// parameters apply to each key's state when its next request reads it.
#[derive(Clone)]
pub struct RulesHandle {
    cell: Arc<Cell>,
}

impl RulesHandle {
    pub(crate) fn new(cell: Arc<Cell>) -> Self {
        Self { cell }
    }

    /// The rules in force.
    pub fn rules(&self) -> Rules {
        self.cell.active.load().rules.clone()
    }

    /// The version of the rules in force: 1 as built, then one more for each
    /// [`set`](Self::set).
    pub fn version(&self) -> u64 {
        self.cell.active.load().version
    }

    /// Applies `rules` to every request that arrives from now on; requests in flight
    /// finish under the rules they started with. Returns the new version.
    pub fn set(&self, rules: Rules) -> u64 {
        // The memory store learns when the plans' state expires too.
        let all = rules.every_stored_limit();
        self.cell.store.limits_changed(&all);
        if let FailurePolicy::Local(store) = &rules.on_store_error {
            store.limits_changed(&all);
        }
        let version = self.cell.next_version.fetch_add(1, Ordering::Relaxed);
        let active = Arc::new(Active::new(rules, version));
        // Two concurrent sets: the later version wins, whichever stores last.
        self.cell.active.rcu(|current| {
            if current.version > version {
                current.clone()
            } else {
                active.clone()
            }
        });
        // After the swap: whoever sees this version finds it (or a later one) in `active`.
        self.cell.current.fetch_max(version, Ordering::Release);
        version
    }
}

impl fmt::Debug for RulesHandle {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let active = self.cell.active.load();
        f.debug_struct("RulesHandle")
            .field("version", &active.version)
            .field("rules", &active.rules)
            .finish()
    }
}

impl fmt::Debug for Cell {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Cell")
            .field("active", &self.active.load())
            .finish_non_exhaustive()
    }
}
