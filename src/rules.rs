//! [`Rules`] and [`RulesHandle`]: the part of a layer's configuration that can change while
//! it serves (its limits, failure policy, missing-key policy and header style), swapped
//! atomically.
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
    ConfigError, FailurePolicy, HeaderStyle, Limit, MissingKey, headers::HeaderWriter, store::Store,
};

/// A layer's changeable configuration: its limits and policies. Built with
/// [`Rules::new`] and the `with_*` methods, applied with [`RulesHandle::set`].
#[derive(Debug, Clone)]
pub struct Rules {
    limits: Arc<[Limit]>,
    on_store_error: FailurePolicy,
    on_missing_key: MissingKey,
    headers: HeaderStyle,
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
            on_store_error: FailurePolicy::default(),
            on_missing_key: MissingKey::default(),
            headers: HeaderStyle::default(),
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
        let mut unique: Vec<Limit> = Vec::new();
        for limit in limits {
            match unique.iter().find(|l| l.id() == limit.id()) {
                Some(same) if *same == limit => {}
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
        if unique.is_empty() {
            return Err(ConfigError::new("limits", "must hold at least one limit"));
        }
        self.limits = unique.into();
        Ok(self)
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

    /// The limits, in the order they are reported.
    pub fn limits(&self) -> &[Limit] {
        &self.limits
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
        let mut limits = self.limits.to_vec();
        match limits.iter_mut().find(|l| l.id() == limit.id()) {
            Some(same) => *same = limit,
            None => limits.push(limit),
        }
        self.limits = limits.into();
    }
}

/// Rules as requests use them: with what is derived from them prepared once.
#[derive(Debug)]
pub(crate) struct Active {
    pub(crate) rules: Rules,
    pub(crate) headers: HeaderWriter,
    pub(crate) version: u64,
}

impl Active {
    fn new(rules: Rules, version: u64) -> Self {
        Self {
            headers: HeaderWriter::new(rules.headers, &rules.limits),
            rules,
            version,
        }
    }

    pub(crate) fn limits(&self) -> &Arc<[Limit]> {
        &self.rules.limits
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
        self.cell.store.limits_changed(&rules.limits);
        if let FailurePolicy::Local(store) = &rules.on_store_error {
            store.limits_changed(&rules.limits);
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
