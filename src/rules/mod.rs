//! [`Rules`] and [`RulesHandle`]: the part of a layer's configuration that can change while
//! it serves (its limits and [shadow](crate::guide::shadow) limits, failure policy,
//! missing-key policy and header style), swapped atomically.
//! [`RateLimitLayer::rules_handle`](crate::RateLimitLayer::rules_handle) returns the handle,
//! after the builder calls; it changes the rules of every service the layer made.
//!
//! Each request reads the rules once, when it arrives, and is decided, answered and given
//! its headers under that one set: a change never shows half-applied to a request, and
//! requests in flight finish under the rules they started with. The rules sit in an
//! [`arc_swap::ArcSwap`]; each service keeps the set it last saw and compares one version
//! number per request, so reading them costs a request no lock and no shared counter
//! (+1% to +6% instructions per request on the memory store's ready path; BENCHMARKS.md,
//! "Rules that change while running"). Nothing is dropped or waits.
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
//!
//! # Budgets
//!
//! - A limit that does not change keeps its state.
//! - A changed `limit` or `burst` starts fresh ([`OnChange::Reset`](crate::OnChange::Reset),
//!   the default: the store key names every parameter) or carries the state over
//!   ([`OnChange::CarryOver`](crate::OnChange::CarryOver), named limits only: the key is the
//!   name, algorithm and window). Carried over, the window algorithms keep what they
//!   counted (`remaining` = new limit minus it, never below 0), a token bucket keeps its
//!   tokens (at most the new `burst`) and refills at the new rate, GCRA keeps its time
//!   until full ([`OnChange`](crate::OnChange) says it per algorithm).
//! - A new algorithm or window is always new state.
//! - The store is never rewritten: each key's state meets the new parameters at its next
//!   request, in the memory store, the Lua script and Redis Cluster alike
//!   (`tests/conformance.rs`).
//! - One corner differs between stores: a carried-over token bucket whose rate is lowered
//!   (or burst raised) and that stays untouched past the time it would have been full at
//!   the **old** rate is full on Redis (its key expired by the TTL the old rate set), while
//!   the memory store refills it at the new rate from its last update.
//!
//! Plans ([`Rules::with_plans`]) and shadow limits are part of the rules too. The example
//! gateway reloads its config on SIGHUP and file changes the same way, and can take its
//! routes from a rule set in Redis that a whole fleet follows within about a second
//! (gateway/README.md, "Reloading the config" and "Rules from Redis").

mod active;
mod handle;
pub(crate) mod set;

pub(crate) use active::{Active, Cell, Chosen, Resolving};
pub use handle::RulesHandle;
pub use set::{DEFAULT_MAX_WAITERS, DEFAULT_MAX_WAITERS_PER_KEY, DEFAULT_TIMEOUT, Rules};
pub(crate) use set::{disjoint, needs, unique};
