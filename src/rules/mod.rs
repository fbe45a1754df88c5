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
//! use tollgate::{Limit, OnChange, RateLimitLayer, rules::Rules};
//!
//! let per_minute = |n| -> Result<Limit, tollgate::ConfigError> {
//!     Limit::token_bucket(n, Duration::from_secs(60))?
//!         .with_name("api")?
//!         .with_on_change(OnChange::CarryOver)
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

mod active;
mod handle;
pub(crate) mod set;

pub(crate) use active::{Active, Cell, Chosen, Resolving};
pub use handle::RulesHandle;
pub(crate) use set::unique;
pub use set::{DEFAULT_MAX_WAITERS, DEFAULT_MAX_WAITERS_PER_KEY, DEFAULT_TIMEOUT, Rules};
