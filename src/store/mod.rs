//! Stores: where the algorithms' state lives and where decisions are made.
//!
//! - [`MemoryStore`]: in-process, the embedded default. Each process has its own budget.
//! - `RedisStore` (feature `redis`): one Lua script per decision, so that every replica
//!   of a service shares one budget.

mod check;
mod guarded;
mod memory;
mod prefix;
#[cfg(feature = "redis")]
pub(crate) mod redis;

use std::{fmt, sync::Arc};

pub use check::Check;
pub(crate) use guarded::Guarded;
pub use memory::MemoryStore;
pub use prefix::validate_prefix;
#[cfg(feature = "sentinel")]
pub use redis::SentinelConfig;
#[cfg(feature = "tls")]
pub use redis::TlsConfig;
#[cfg(feature = "redis")]
pub use redis::{DEFAULT_PREFIX, LeaseConfig, RedisStore, SCRIPT_SOURCE};

use crate::{Decision, Limit, key::Key};

/// Decides requests: checks `cost` against every limit for `key` in one atomic step,
/// all-or-nothing, and records it when allowed.
///
/// The answer owns everything it needs (`'static`), so implementations read the
/// arguments before they return it. A store that decides without I/O returns
/// [`Check::ready`]: the layer then skips the timer and allocation of a pending call.
pub trait Store: Send + Sync + fmt::Debug + 'static {
    /// Decides one request of `cost` against `limits` (at least one) for `key`.
    fn check(&self, key: &Key, limits: &[Limit], cost: u32) -> Check;

    /// Told by [`RulesHandle::set`](crate::RulesHandle::set) before `limits` come into
    /// force. A store that keeps limits besides the state (the memory store, to know when
    /// state expires) updates those whose state carries over; the default does nothing.
    fn limits_changed(&self, limits: &[Limit]) {
        let _ = limits;
    }

    /// What the store can decide without I/O when it must not be asked (the layer's
    /// circuit breaker is open): an allowed decision paid from quota it holds already
    /// (the Redis store's leases), or `None` for the failure policy. Never a denial. The
    /// default holds nothing.
    fn check_held(&self, key: &Key, limits: &[Limit], cost: u32) -> Option<Decision> {
        let _ = (key, limits, cost);
        None
    }
}

impl<S: Store + ?Sized> Store for Arc<S> {
    fn check(&self, key: &Key, limits: &[Limit], cost: u32) -> Check {
        (**self).check(key, limits, cost)
    }

    fn limits_changed(&self, limits: &[Limit]) {
        (**self).limits_changed(limits);
    }

    fn check_held(&self, key: &Key, limits: &[Limit], cost: u32) -> Option<Decision> {
        (**self).check_held(key, limits, cost)
    }
}
