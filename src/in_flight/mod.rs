//! [`InFlightLayer`]: at most N requests in flight per key.
//!
//! A rate limit counts requests when they start, so a client may hold any number of long
//! requests open (streams, uploads, slow responses) and stay within it. This layer counts
//! the requests *running* per key instead: a request takes a permit when it starts and
//! gives it back when its response body ends (or is dropped), when its response future
//! is dropped, or when the inner service fails. A request that finds all `max` permits of
//! its key held is answered 429 with `Retry-After` (gRPC: `RESOURCE_EXHAUSTED`) by the
//! same [`OnRejection`](crate::OnRejection) hook as [`RateLimitLayer`](crate::RateLimitLayer)'s
//! (nginx `limit_conn`, Traefik `inFlightReq`; tower's `ConcurrencyLimitLayer` is one
//! global count).
//!
//! **With a rate limit, prefer the in-flight stage of the rate limit's own pipeline**,
//! [`RateLimitLayer::with_in_flight`](crate::RateLimitLayer::with_in_flight) with an
//! [`InFlightLimit`](crate::InFlightLimit): one store call decides both all-or-nothing
//! (here a request the cap admits may still be rate-limited, and the other way round),
//! one more gives the permit back with any adjustment after the response, and the
//! layer's rules, plans, metrics and handle apply to it. This layer stays for an
//! in-flight limit on its own (its permits are renewed while a request runs, so a long
//! response keeps counting; the stage's permits end one TTL after they were taken). The
//! two keep their permits apart. Stacked:
//!
//! ```
//! use std::time::Duration;
//! use axum::{Router, routing::get};
//! use tollgate::{Limit, RateLimitLayer, key::HeaderKey, in_flight::InFlightLayer};
//!
//! # fn main() -> Result<(), Box<dyn std::error::Error>> {
//! let app: Router = Router::new()
//!     .route("/", get(|| async { "hello" }))
//!     // At most 4 requests at once per API key ...
//!     .layer(InFlightLayer::new(4)?.with_key(HeaderKey::new("x-api-key")?))
//!     // ... and 100 a minute.
//!     .layer(RateLimitLayer::new(Limit::per_minute(100)?).with_key(HeaderKey::new("x-api-key")?));
//! # Ok(()) }
//! ```
//!
//! As a `RateLimitLayer`, it asks its store under a [timeout](InFlightLayer::with_timeout) and
//! a [circuit breaker](InFlightLayer::with_circuit_breaker), applies its [`FailurePolicy`]
//! when the store fails, and counts its requests in [`metrics`](crate::metrics) under its
//! [name](InFlightLayer::with_name). Under [`FailurePolicy::Allow`](crate::FailurePolicy::Allow)
//! (the default) a request the store could not answer runs holding no permit. A permit
//! taken after a timeout, or by a request dropped while asking, is given back at once.
//!
//! # Stores
//!
//! The permits live in a [`Permits`](crate::store::Permits) store, set with
//! [`InFlightLayer::with_store`]:
//!
//! - In memory (the default, or a [`MemoryStore`](crate::store::MemoryStore) to share with other
//!   layers): permits are counted in the process; a key with no request in flight takes
//!   no memory.
//! - Redis, one node, a cluster or Sentinel (feature `redis`, a `RedisStore`): permits are
//!   entries with a TTL in a sorted set `<prefix>:{<key>}:inflight:<max>` (one hash tag,
//!   so one cluster slot), renewed every third of the [TTL](InFlightLayer::with_permit_ttl)
//!   while the request runs and removed when it ends. **A node that dies holds its
//!   permits at most one TTL longer** ([`DEFAULT_PERMIT_TTL`], 10 s). When Redis fails or
//!   does not answer within the timeout, the layer's [`FailurePolicy`] applies: allow
//!   (default), deny (503), or count the permits in the policy's memory store, in the
//!   process, until Redis answers again.
//! - If Redis loses the permits (a restart without persistence, a failover to a replica
//!   that had not seen them), requests that get in before the running ones renew may
//!   exceed `max` for up to a third of the TTL (plus the time Redis takes to answer
//!   again): the next renewal of each running request adds its permit back (logged at
//!   `warn`), even beyond `max`, because the request still runs. New requests are then
//!   refused until enough running ones end.
//! - A permit whose removal fails (Redis out of reach when its request ends) is removed
//!   once Redis answers again (tried again after 100 ms, doubling up to a third of the
//!   TTL); at the latest its TTL ends it, one TTL after its last renewal. Nothing lingers
//!   longer: every permits key has a TTL to its last permit's end.
//! - Redis costs per request: one script to take the permit (drop ended entries, count,
//!   add if there is room) and one `ZREM` to give it back, plus one script per third of
//!   the TTL while it runs.
//!
//! Layers on one store share a key's permits when their keys are of the same kind and
//! their `max` is the same.
//!
//! [`FailurePolicy`]: crate::FailurePolicy

mod body;
mod future;
mod layer;
mod service;
mod shared;

pub use body::InFlightBody;
pub use future::InFlightFuture;
pub use layer::{DEFAULT_PERMIT_TTL, DEFAULT_RETRY_AFTER, InFlightLayer};
pub use service::InFlight;
