//! Rate limiting for [Tower] services: axum and tonic apps add it with `.layer(..)`.
//!
//! For each request a [`KeyExtractor`](key::KeyExtractor) picks who it is counted against
//! (client IP, an API key header, the authenticated user, ...), a [`Store`] decides it
//! atomically against one or more [`Limit`]s, and the request either reaches the inner
//! service or is answered `429 Too Many Requests` with `Retry-After` (gRPC:
//! `RESOURCE_EXHAUSTED`). Allowed and denied responses carry the IETF `RateLimit-Policy`
//! and `RateLimit` fields.
//!
//! # Example
//!
//! ```
//! use std::time::Duration;
//! use axum::{Router, routing::get};
//! use tollgate::{Limit, RateLimitLayer, key::HeaderKey};
//!
//! # fn main() -> Result<(), Box<dyn std::error::Error>> {
//! // 10 requests per second and 1000 per hour for each API key, all-or-nothing.
//! let layer = RateLimitLayer::new(Limit::token_bucket(10, Duration::from_secs(1))?)
//!     .limit(Limit::fixed_window(1000, Duration::from_secs(3600))?)
//!     .key(HeaderKey::new("x-api-key")?);
//! let app: Router = Router::new().route("/", get(|| async { "hello" })).layer(layer);
//! # Ok(()) }
//! ```
//!
//! # Algorithms
//!
//! | algorithm | guarantee | state per key |
//! |---|---|---|
//! | [`fixed_window`](Limit::fixed_window) | at most `limit` per aligned window (up to `2 * limit` across a boundary) | one counter |
//! | [`sliding_window`](Limit::sliding_window) | at most `limit` in *any* interval of `window` | one entry per millisecond with requests in the window, weighted by their cost |
//! | [`sliding_window_counter`](Limit::sliding_window_counter) | approximate sliding window, at most `limit` per aligned window | two counters |
//! | [`token_bucket`](Limit::token_bucket) | at most `burst + limit * t / window` in any interval `t` | tokens and a timestamp |
//! | [`gcra`](Limit::gcra) | the same as the token bucket | one timestamp |
//!
//! Denied requests consume nothing. Arithmetic is exact integer arithmetic, in the
//! reference model (`src/algorithm/`, which the memory store runs) and in the Lua scripts
//! alike.
//!
//! # gRPC
//!
//! tonic servers take the same layer: `Server::builder().layer(layer)`. gRPC calls are
//! never answered HTTP 429: a denied call gets a trailers-only `RESOURCE_EXHAUSTED` with the
//! wait in its message and `retry-after` metadata, a call without a key `INVALID_ARGUMENT`.
//! See [`DefaultRejection`] for the answers and their opt-ins; streams are counted once,
//! when they start.
//!
//! # Choosing a key
//!
//! [`PeerIp`](key::PeerIp) (the default) is the TCP peer. **Behind a proxy or load balancer
//! every client has the proxy's address: use [`ClientIp`](key::ClientIp) with the proxies'
//! CIDRs, which reads `X-Forwarded-For` from the right and only from trusted peers.**
//! Each kind of key has its own namespace, so a header value that spells an IP or
//! `global` never spends that client's budget. **API keys are stored as they are unless
//! hashed:** [`HeaderKey::hashed_with`](key::HeaderKey::hashed_with).
//! See [`key`] for all extractors and for how keys are made safe for Redis.
//!
//! # Stores
//!
//! - [`MemoryStore`]: in-process, the default. Each process has its own budget; it tracks
//!   at most [`MemoryStore::DEFAULT_MAX_KEYS`] keys unless told otherwise.
//! - `RedisStore` (feature `redis`): one atomic Lua script per decision on Redis 6.0+
//!   (`TIME` in scripts), so every replica shares one budget. When the store fails, the
//!   [`FailurePolicy`] decides: allow (default), deny with 503, or a local fallback.
//!
//! # Requests in flight
//!
//! [`InFlightLayer`] allows at most N requests *running* at once per key (streams, long
//! answers), on memory, Redis and Redis Cluster: a request holds a permit until its
//! response body ends or is dropped. Stack it with a `RateLimitLayer`. See [`in_flight`].
//!
//! # Changing rules while running
//!
//! [`RateLimitLayer::rules_handle`] returns a [`RulesHandle`] that swaps the layer's
//! limits and policies atomically while it serves; a changed limit starts fresh or keeps
//! its spent budget, as [`Limit::on_change`] chose. See [`rules`].
//!
//! # Plans
//!
//! Limits chosen per request (free, paid, internal): [`RateLimitLayer::plans`] with
//! [`Plans`], each [`Plan`] a name and its limits or unlimited, picked by a header, a sync
//! resolver or a cached async [`PlanLookup`]. Each plan keeps its own state; requests
//! without a known plan get the default plan. See [`plan`].
//!
//! # Peek and reset
//!
//! [`RateLimitLayer::limiter`] returns a [`Limiter`] for handlers and admin code: its
//! [`peek`](Limiter::peek) answers the decision a request would get now, with nothing
//! written, and its [`reset`](Limiter::reset) gives a key a fresh budget under the
//! layer's rules in force, on every replica at once (the Redis store's block caches hear
//! resets over pub/sub). [`Limiter::key_of`] makes the key with the layer's own extractor.
//! Stores implement [`Store::peek`] and [`Store::reset`].
//!
//! # Shadow mode
//!
//! To roll a limit out by watching first, make it a shadow limit
//! ([`RateLimitLayer::shadow_limit`], [`Rules::with_shadow_limits`]) or put the whole
//! layer in shadow ([`RateLimitLayer::shadow`], [`Rules::with_shadow`]; both can change at
//! run time through a [`RulesHandle`]). Shadow limits are decided and counted like any
//! other but never reject: a request they would reject reaches the inner service, is
//! counted with the outcome `would_reject` (feature `metrics`; see [`metrics`]) and is
//! logged at `info` (`rate limit would reject (shadow)`, with the layer and the redacted
//! key).
//!
//! - The shadow limits of a layer that also enforces limits are decided in a store call
//!   of their own, made together with the enforced one (a second call, only for layers
//!   that have shadow limits). So the enforced limits count exactly as if the shadow
//!   ones were absent: deciding all in one all-or-nothing call would stop counting the
//!   enforced limits whenever a shadow limit is exceeded.
//! - The shadow limits count every request that reaches the layer with a key, those the
//!   enforced limits reject included (all-or-nothing among themselves): what they would
//!   count as a layer of their own in front of this one.
//! - A request an enforced limit rejects counts as `denied`; one that only shadow limits
//!   would reject as `would_reject`; a failed shadow call changes nothing (logged at
//!   `debug`). A layer in shadow lets every request through, even when its store fails
//!   under [`FailurePolicy::Deny`] (counted as `store_error`).
//! - Responses carry the enforced limits' fields only, and a layer in shadow writes none:
//!   clients that pace themselves by those fields would otherwise slow down for a limit
//!   that is not enforced.
//!
//! ```
//! use std::time::Duration;
//! use tollgate::{Limit, RateLimitLayer};
//!
//! // Enforce 100 per minute; watch what 20 per second would reject.
//! let layer = RateLimitLayer::new(Limit::fixed_window(100, Duration::from_secs(60))?)
//!     .shadow_limit(Limit::gcra(20, Duration::from_secs(1))?)
//!     .name("api");
//! assert_eq!(layer.rules_handle().rules().shadow_limits().len(), 1);
//! # Ok::<(), tollgate::ConfigError>(())
//! ```
//!
//! # Feature flags
//!
//! - `axum` (default): [`PeerIp`](key::PeerIp) reads axum's `ConnectInfo<SocketAddr>`.
//! - `redis`: `RedisStore` over redis-rs's auto-reconnecting `ConnectionManager`.
//! - `bb8`: build a `RedisStore` from a bb8-redis pool.
//! - `cluster`: `RedisStore::connect_cluster` for Redis Cluster.
//! - `tls`: `rediss://` (one node, cluster, Sentinel) over rustls with the ring provider (no
//!   system OpenSSL); `store::TlsConfig` for a private CA and client certificates.
//! - `sentinel`: `RedisStore::connect_sentinel` follows the master Redis Sentinel names.
//! - `metrics`: request counters and decision latency per layer through the `metrics`
//!   facade; see [`metrics`].
//! - `tonic`: [`PeerIp`](key::PeerIp) and [`ClientIp`](key::ClientIp) read tonic's
//!   `TcpConnectInfo`, so `tonic::transport::Server::builder().layer(..)` can limit by IP.
//! - `grpc-status-details`: `DefaultRejection::grpc_retry_info` puts a
//!   `google.rpc.RetryInfo` into rate-limited gRPC answers (`grpc-status-details-bin`).
//!
//! [Tower]: https://docs.rs/tower

#![cfg_attr(docsrs, feature(doc_cfg))]

mod adjustment;
// The reference model is public for the crate's own tests and benches (integration tests
// cannot turn on a feature of the crate they test without skipping when it is off), not
// API: hidden, and free to change in any release.
#[doc(hidden)]
pub mod algorithm;
mod breaker;
pub mod clock;
pub mod count_after;
mod decide;
mod decision;
mod error;
mod future;
pub mod headers;
pub mod in_flight;
pub mod key;
mod layer;
mod limit;
mod limiter;
pub mod metrics;
pub mod plan;
mod policy;
mod rejection;
pub mod rules;
mod service;
pub mod store;

pub use adjustment::Adjustment;
pub use breaker::CircuitBreaker;
pub use decision::{Decision, LimitDecision, RateLimitInfo};
pub use error::{ConfigError, StoreError, StoreErrorKind};
pub use future::ResponseFuture;
pub use headers::HeaderStyle;
pub use in_flight::InFlightLayer;
pub use layer::{DEFAULT_NAME, RateLimitLayer};
pub use limit::{
    Algorithm, DEFAULT_IN_FLIGHT_RETRY_AFTER, DEFAULT_IN_FLIGHT_TTL, InFlightLimit, Limit,
    MAX_SLIDING_WINDOW_LIMIT, MAX_WINDOW, OnChange,
};
pub use limiter::Limiter;
pub use plan::{Plan, PlanLookup, PlanRequest, Plans};
pub use policy::{FailurePolicy, MissingKey, RequestCost};
pub use rejection::{DefaultRejection, GrpcMissingKey, OnRejection, is_grpc};
pub use rules::set::{DEFAULT_MAX_WAITERS, DEFAULT_MAX_WAITERS_PER_KEY, DEFAULT_TIMEOUT};
pub use rules::{Rules, RulesHandle};
pub use service::RateLimit;
pub use store::{MemoryStore, Store};

// The README's examples compile as doctests.
#[cfg(doctest)]
#[doc = include_str!("../README.md")]
struct ReadmeDoctests;
