//! [`RulesHandle`]: changes a layer's rules while it serves.

use std::{
    fmt,
    sync::{Arc, atomic::Ordering},
};

use super::{
    active::{Active, Cell},
    set::Rules,
};
use crate::{FailurePolicy, store::Store};

/// Changes a layer's [`Rules`] while it serves: see the [module docs](crate::rules).
///
/// Obtained from [`RateLimitLayer::rules_handle`](crate::RateLimitLayer::rules_handle)
/// once the layer is configured (a builder call after it gives the layer rules of its
/// own). Clones change the same layer; it is cheap to keep in a config-reload task.
///
/// What happens to the budgets: a limit that does not change keeps its state; a changed
/// one starts fresh or carries its state over, as each [`Limit`](crate::Limit) chose with
/// [`Limit::with_on_change`](crate::Limit::with_on_change). A store's state is never rewritten by a change: the new
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
    ///
    /// Rules a layer would refuse when built (an in-flight limit on a store that cannot
    /// count requests in flight, see
    /// [`RateLimitLayer::validate`](crate::RateLimitLayer::validate)) are refused here
    /// too: the rules in force stay, the refusal is logged at `error`, and the version
    /// returned is theirs, unchanged.
    pub fn set(&self, rules: Rules) -> u64 {
        if let Err(error) = super::needs(&rules, &*self.cell.lasting.store) {
            tracing::error!(%error, "rate limit rules refused");
            return self.version();
        }
        // The memory store learns when the plans' state expires too.
        let all = rules.every_stored_limit();
        self.cell.lasting.store.limits_changed(&all);
        if let FailurePolicy::Local(store) = rules.on_store_error() {
            store.limits_changed(&all);
        }
        let version = self.cell.next_version.fetch_add(1, Ordering::Relaxed);
        let active = Arc::new(Active::new(rules, version, &self.cell.lasting));
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
