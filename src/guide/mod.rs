//! The guide: how each feature behaves, what it costs and what it guarantees, one topic
//! per page. Docs only: this module has no items.
//!
//! The reference for each type stays on the type; these pages say how the parts work
//! together, on every store. Each topic is written once, here or in the public module
//! named in the table, and the other places link to it.
//!
//! | topic | page |
//! |---|---|
//! | The algorithms, their guarantees and their state | [`algorithms`] |
//! | Who a request is counted against; proxies; keys in Redis | [`key`](crate::key) |
//! | Which layers share a budget | [crate docs](crate#which-layers-share-a-budget) |
//! | `RateLimit` fields, `Retry-After`, the denied answer | [`headers`](crate::headers) |
//! | gRPC (tonic): statuses, metadata, streams | [`grpc`] |
//! | The Redis store: versions, engines, key layout, functions, coalescing | [`redis`] |
//! | Connecting: TLS, ACL users (least privilege) | [`redis#connecting`](redis#connecting) |
//! | Redis Cluster: key layout, failover, resharding, pipelines | [`cluster`] |
//! | Redis Sentinel | [`sentinel`] |
//! | The in-memory store: bounds, eviction | [`MemoryStore`](crate::store::MemoryStore) |
//! | When the store fails: timeouts, breaker, block cache, fallback | [`failures`] |
//! | Leased quota for hot keys | [`leases`] |
//! | Lockout after a breach | [`lockout`] |
//! | Waiting instead of 429 | [`waiting`] |
//! | At most N requests in flight per key | [`in_flight`](crate::in_flight) |
//! | Changing rules while running | [`rules`](crate::rules) |
//! | Shadow mode | [`shadow`] |
//! | Plans: limits chosen per request | [`plan`](crate::plan) |
//! | Peek and reset | [`peek_reset`] |
//! | Counting after the response | [`count_after`](crate::count_after) |
//! | Metrics | [`metrics`](crate::metrics) |
//! | Security notes | [`security`] |
//! | Which features work together, on which store | [`composition`] |

#[doc = include_str!("composition.md")]
pub mod composition {}

#[doc = include_str!("algorithms.md")]
pub mod algorithms {}

#[doc = include_str!("grpc.md")]
pub mod grpc {}

#[doc = include_str!("redis.md")]
pub mod redis {}

#[doc = include_str!("cluster.md")]
pub mod cluster {}

#[doc = include_str!("sentinel.md")]
pub mod sentinel {}

#[doc = include_str!("failures.md")]
pub mod failures {}

#[doc = include_str!("leases.md")]
pub mod leases {}

#[doc = include_str!("lockout.md")]
pub mod lockout {}

#[doc = include_str!("waiting.md")]
pub mod waiting {}

#[doc = include_str!("shadow.md")]
pub mod shadow {}

#[doc = include_str!("peek_reset.md")]
pub mod peek_reset {}

#[doc = include_str!("security.md")]
pub mod security {}
