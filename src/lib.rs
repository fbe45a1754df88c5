//! Rate limiting for [Tower] services: axum and tonic apps add it with `.layer(..)`.
//!
//! For each request a [`KeyExtractor`](key::KeyExtractor) picks who it is counted against
//! (client IP, an API key header, the authenticated user, ...), a [`Store`](store::Store) decides it
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
//!     .with_limit(Limit::fixed_window(1000, Duration::from_secs(3600))?)
//!     .with_key(HeaderKey::new("x-api-key")?);
//! let app: Router = Router::new().route("/", get(|| async { "hello" })).layer(layer);
//! # Ok(()) }
//! ```
//!
//! # Which layers share a budget
//!
//! [`RateLimitLayer::new(limit)`](RateLimitLayer::new) starts with the peer IP as key and a
//! new in-memory store. Cloning a layer (or applying it with `Router::layer`, which clones
//! it per route) **shares one budget**. A budget is a store's state for one key and one
//! limit, so layers built separately share one exactly when they use the same store (one
//! Redis for every replica, or [`with_store`](RateLimitLayer::with_store)), the same
//! kind of key and equal limits with the same [`named`](Limit::with_name) name (or none). Keys
//! of different kinds never share one (see [`key`]). For separate budgets on one store,
//! name the limits differently.
//!
//! # Choosing a key
//!
//! **Behind a proxy or load balancer every client has the proxy's address: use
//! [`ClientIp`](key::ClientIp), not the default [`PeerIp`](key::PeerIp).** See
//! [`key`](key#choosing-a-key), and the [security notes](guide::security).
//!
//! # Stores
//!
//! - [`MemoryStore`](store::MemoryStore): in-process, the default. Each process has its own budget; it tracks
//!   at most [`MemoryStore::DEFAULT_MAX_KEYS`](store::MemoryStore::DEFAULT_MAX_KEYS) keys unless told otherwise.
//! - `RedisStore` (feature `redis`): one atomic Lua script per decision on Redis 6.0+ and
//!   Valkey, so every replica shares one budget; one node, [Cluster](guide::cluster),
//!   [Sentinel](guide::sentinel), TLS and ACL users: [the Redis guide](guide::redis).
//!   When the store fails, the [`FailurePolicy`] decides: allow (default), deny with 503,
//!   or a local fallback ([`guide::failures`]).
//!
//! # Guide
//!
//! Each feature has one page, in [`guide`] or in its public module:
//! [algorithms](guide::algorithms), [keys](key), [headers], [gRPC](guide::grpc),
//! [Redis](guide::redis), [failures](guide::failures), [leases](guide::leases),
//! [lockout](guide::lockout), [waiting](guide::waiting), [in flight](in_flight),
//! [changing rules](rules), [shadow mode](guide::shadow), [plans](plan),
//! [peek and reset](guide::peek_reset), [counting after the response](count_after),
//! [metrics], [security notes](guide::security).
//!
//! A [`Limiter`] ([`RateLimitLayer::limiter`]) peeks and resets a key's budget, builds a
//! key from a value an admin typed ([`Limiter::key_for`]) and decides one request outside
//! HTTP ([`Limiter::check`]: a WebSocket message, a job) through the layer's pipeline.
//! [`RateLimitLayer::with_exempt`] lets an allowlist through uncounted; a request that is
//! not exempt and has no key still gets [`MissingKey`]'s answer.
//!
//! # Feature flags
//!
//! - `axum` (default): [`PeerIp`](key::PeerIp) reads axum's `ConnectInfo<SocketAddr>`.
//! - `redis`: `RedisStore` over redis-rs's auto-reconnecting `ConnectionManager`.
//! - `bb8`: build a `RedisStore` from a bb8-redis pool.
//! - `cluster`: `RedisStore::connect(RedisTarget::cluster(..))` for Redis Cluster.
//! - `tls`: `rediss://` (one node, cluster, Sentinel) over rustls with the ring provider (no
//!   system OpenSSL); `store::TlsConfig` for a private CA and client certificates.
//! - `sentinel`: `RedisStore::connect(SentinelConfig::new(..))` follows the master Redis
//!   Sentinel names.
//! - `metrics`: request counters and decision latency per layer through the `metrics`
//!   facade; see [`metrics`].
//! - `tonic`: [`PeerIp`](key::PeerIp) and [`ClientIp`](key::ClientIp) read tonic's
//!   `TcpConnectInfo`, so `tonic::transport::Server::builder().layer(..)` can limit by IP.
//! - `grpc-status-details`: `DefaultRejection::with_grpc_retry_info` puts a
//!   `google.rpc.RetryInfo` into rate-limited gRPC answers (`grpc-status-details-bin`).
//!
//! [Tower]: https://docs.rs/tower

#![cfg_attr(docsrs, feature(doc_cfg))]

pub mod adaptive;
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
pub mod guide;
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
pub use layer::{DEFAULT_NAME, RateLimitLayer};
pub use limit::{
    Algorithm, DEFAULT_IN_FLIGHT_RETRY_AFTER, DEFAULT_IN_FLIGHT_TTL, InFlightLimit, Limit,
    MAX_SLIDING_WINDOW_LIMIT, MAX_WINDOW, OnChange,
};
pub use limiter::{Limiter, Verdict};
pub use policy::{Exempt, FailurePolicy, MissingKey, NoExemption, RequestCost};
pub use rejection::{DefaultRejection, GrpcMissingKey, OnRejection, is_grpc};
pub use service::RateLimit;

// One public path per type: a type with a public module of its own (plans, rules, stores,
// headers, in-flight limits) is exported there only.

// The README's examples compile as doctests.
#[cfg(doctest)]
#[doc = include_str!("../README.md")]
struct ReadmeDoctests;
