//! The Redis store: every decision is one atomic Lua script.

//!
//! The files, bottom up (no file imports one above it):
//!
//! - `wire/`: timeouts, the scheme check and TLS settings, Redis errors as store errors,
//!   the script and its function library, error replies read by code, ACL denials.
//! - `keys`: the key layout, written once. `link/`: the connection kinds and the one
//!   dispatch that sends on them (`link/sentinel`, `link/cluster`: what the Sentinel and
//!   cluster links need). `encode`: a request as the script's arguments, its reply as
//!   decisions.
//! - `block_cache/` (with its reset listener), `deliver` (a batch's call and replies),
//!   `nodes` (cluster per-master pipelines), `batch` (the coalescer), `lease/`, `admin`
//!   (peek, reset).
//! - This file: the store, its settings and the `Store` impl; `request`: the request
//!   path (leases, block cache, coalescer, the call), as methods of the store.
//! - Above it, naming the store: `connect` (the constructors) and `permits` (in-flight
//!   permits); nothing here imports them.

use std::{
    fmt,
    num::NonZeroUsize,
    sync::{Arc, OnceLock},
};

mod admin;
mod batch;
mod block_cache;
mod connect;
mod deliver;
mod encode;
mod keys;
mod lease;
mod link;
#[cfg(feature = "cluster")]
mod nodes;
mod permits;
mod request;
mod wire;

pub use self::connect::{RedisConnect, RedisTarget};
pub use self::lease::LeaseConfig;
#[cfg(feature = "sentinel")]
pub use self::link::sentinel::SentinelConfig;
pub use self::permits::{ACQUIRE as IN_FLIGHT_ACQUIRE_SOURCE, RENEW as IN_FLIGHT_RENEW_SOURCE};
#[cfg(feature = "tls")]
pub use self::wire::TlsConfig;
pub use self::wire::script::SCRIPT_SOURCE;

use redis::aio::ConnectionManager;

use self::{
    batch::{Coalescer, CoalescerConfig},
    block_cache::{BlockCache, ResetNodes, Source, local_now_ms},
    encode::Encoded,
    lease::Leases,
    link::{Connection, Link},
};
use super::{Admitted, Check, Permit, Reset, Store};
use crate::{
    Adjustment, ConfigError, Decision, InFlightLimit, Limit, StoreError,
    clock::{Clock, MonotonicClock},
    key::Key,
};

/// The default key prefix.
pub const DEFAULT_PREFIX: &str = "tollgate";

/// A [`Store`] in Redis (6.0 or later): each decision is one call of a Lua script that
/// reads, decides and writes atomically, so every replica of a service shares one
/// budget and no two requests can race. From Redis 7.0 the script is a function library
/// (`FUNCTION LOAD`, then `FCALL`: its definitions are made once, not on every call);
/// before, or for an ACL user without `+fcall` / `+function|load`, it is `EVALSHA`.
///
/// - Keys are `<prefix>:{<key>}:<limit id>`: all limits of one key share a hash tag (one
///   Redis Cluster slot), and different keys spread over the cluster.
/// - Time is Redis `TIME`, one clock for every replica, unless a local clock is set with
///   [`with_clock`](Self::with_clock).
/// - Every key the script writes gets a TTL in the same script (the time after which the
///   state decides like a missing key), so nothing is immortal.
/// - After a Redis restart, failover, `FUNCTION FLUSH` or `SCRIPT FLUSH` the library (the
///   script) is reloaded on the "Function not found" (`NOSCRIPT`) error and the call
///   retried once; nothing else is ever retried (a call that timed out may already have
///   counted).
///
/// The default connection is redis-rs's auto-reconnecting multiplexed
/// [`ConnectionManager`]: one connection pipelines every concurrent call, which measured
/// faster than a pool. Decisions waiting at the same moment share one script call
/// ([`with_coalescing`](Self::with_coalescing)), and keys Redis denied are answered from a
/// local [block cache](Self::with_block_cache) until their `retry_after` passes. Clones
/// share the connection, the batching task and the cache.
///
/// ```no_run
/// # async fn run() -> Result<(), Box<dyn std::error::Error>> {
/// use tollgate::{Limit, RateLimitLayer, store::RedisStore};
///
/// let store = RedisStore::connect("redis://127.0.0.1:6379").await?.with_prefix("myapp")?;
/// let layer = RateLimitLayer::new(Limit::per_minute(100)?).with_store(store);
/// # Ok(()) }
/// ```
///
#[doc = include_str!("engines.md")]
#[derive(Clone)]
pub struct RedisStore {
    connection: Connection,
    prefix: Arc<str>,
    clock: Option<Arc<dyn Clock>>,
    /// Whether decisions are coalesced, and how many may wait: plain settings, so that
    /// the builder methods can be called in any order.
    coalescing: bool,
    coalescer_config: CoalescerConfig,
    /// Built from the settings on first use; a builder call replaces it with a new, empty
    /// cell. Clones share it.
    coalescer: Arc<OnceLock<Coalescer>>,
    block_cache: Option<Arc<BlockCache>>,
    /// Leased quota, when on: the settings, and the leases built from them.
    lease_config: Option<LeaseConfig>,
    leases: Option<Arc<Leases>>,
    /// The nodes the block cache hears resets from (none: a connection given as is).
    reset_source: Option<ResetNodes>,
    /// On a cluster: its masters, for per-node pipelines of coalesced calls.
    masters: Option<Arc<batch::Nodes>>,
}

impl fmt::Debug for RedisStore {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let connection = self.connection.link.kind();
        f.debug_struct("RedisStore")
            .field("connection", &connection)
            .field("functions", &self.connection.mode.functions())
            .field("connecting", &self.connection.mode.connecting())
            .field("prefix", &self.prefix)
            .field("clock", &self.clock)
            .field("coalescing", &self.coalescing)
            .field("queue_limit", &self.coalescer_config.queue)
            .field("block_cache", &self.block_cache.is_some())
            .field("leases", &self.lease_config)
            .finish()
    }
}

impl RedisStore {
    /// How many decisions may wait for Redis at once by default (see
    /// [`with_coalescing`](Self::with_coalescing)).
    pub const DEFAULT_QUEUE_LIMIT: NonZeroUsize = batch::DEFAULT_QUEUE;
    /// How many denied keys the block cache remembers by default (see
    /// [`with_block_cache`](Self::with_block_cache)).
    pub const DEFAULT_BLOCK_CACHE_SIZE: NonZeroUsize = block_cache::DEFAULT_BLOCK_CACHE_SIZE;

    /// Uses an existing connection manager.
    pub fn from_manager(manager: ConnectionManager) -> Self {
        Self::new(Link::Manager(manager).into())
    }

    /// Uses a bb8-redis pool: each call checks a connection out. Slower than the default
    /// multiplexed connection; for apps that already have a pool.
    #[cfg(feature = "bb8")]
    pub fn from_pool(pool: bb8_redis::bb8::Pool<bb8_redis::RedisConnectionManager>) -> Self {
        Self::new(Link::Pool(pool).into())
    }

    fn new(connection: Connection) -> Self {
        // The block cache's clock: its first read calibrates it, here rather than in a
        // request.
        MonotonicClock.now_ms();
        Self {
            connection,
            prefix: DEFAULT_PREFIX.into(),
            clock: None,
            coalescing: true,
            coalescer_config: CoalescerConfig::default(),
            coalescer: Arc::default(),
            block_cache: Some(Arc::new(BlockCache::new(
                Self::DEFAULT_BLOCK_CACHE_SIZE.get(),
            ))),
            lease_config: None,
            leases: None,
            reset_source: None,
            masters: None,
        }
    }

    /// Listens for resets on `nodes` (see `block_cache::listen`).
    fn with_reset_source(mut self, nodes: ResetNodes) -> Self {
        self.reset_source = Some(nodes);
        self.listen_for_resets();
        self
    }

    /// Points the block cache at the reset channel of the current prefix.
    fn listen_for_resets(&self) {
        if let Some(cache) = &self.block_cache {
            let source = self.reset_source.as_ref();
            cache.listen_to(source.map(|nodes| Source::new(nodes.clone(), &self.prefix)));
        }
    }

    /// Puts every key under `prefix` (default `tollgate`), to share one Redis between
    /// applications.
    ///
    /// # Errors
    ///
    /// When `prefix` is empty, longer than 64 bytes or has characters other than ASCII
    /// letters, digits and `-_.:/` (braces would change the hash tag).
    pub fn with_prefix(mut self, prefix: &str) -> Result<Self, ConfigError> {
        super::validate_prefix(prefix)?;
        self.prefix = prefix.into();
        self.listen_for_resets();
        Ok(self)
    }

    /// Sends the time from `clock` instead of reading Redis `TIME`: for tests, and for
    /// Redis-compatible servers without `TIME` in scripts. Replicas' clocks then must
    /// agree. Keys then live 5 s past the end of their state, so that a clock lagging
    /// Redis's never finds state gone that it still counts. The block cache reads the
    /// same clock.
    pub fn with_clock(mut self, clock: impl Clock) -> Self {
        self.clock = Some(Arc::new(clock));
        self.settings_changed();
        self
    }

    /// Whether decisions that wait at the same moment share one script call: `Some(max)`
    /// (on by default, with [`DEFAULT_QUEUE_LIMIT`](Self::DEFAULT_QUEUE_LIMIT)) lets at
    /// most `max` decisions wait for Redis at once; `None` turns it off.
    ///
    /// A background task takes every decision waiting when it is free and sends them as
    /// one `EVALSHA` (per hash slot on a cluster, those of one master in one pipeline), so
    /// Redis runs one script per batch instead of one per request; a lone request is sent
    /// at once, without waiting for company. Off, each decision is its own `EVALSHA`.
    ///
    /// Beyond `max` waiting decisions, a decision fails at once with
    /// [`StoreErrorKind::Overloaded`](crate::StoreErrorKind::Overloaded) and the layer's failure policy answers it, so a slow
    /// Redis never grows an unbounded queue in memory.
    ///
    /// The task runs on the Tokio runtime of the first decision after it is needed; if
    /// that runtime shuts down, the next decision starts a new task on its own runtime.
    pub fn with_coalescing(mut self, max_waiting: Option<NonZeroUsize>) -> Self {
        self.coalescing = max_waiting.is_some();
        if let Some(max) = max_waiting {
            self.coalescer_config.queue = max.get();
        }
        self.settings_changed();
        self
    }

    /// Remembers up to `entries` denied keys (`Some`,
    /// [`DEFAULT_BLOCK_CACHE_SIZE`](Self::DEFAULT_BLOCK_CACHE_SIZE) by default; `None`
    /// turns it off).
    ///
    /// Once Redis denies a key with `retry_after` T, the same request (same limits, same
    /// cost) is denied here until T passes, without a Redis call: a flood from
    /// one key costs Redis about one call per retry period instead of one per request.
    /// The decision and `retry_after` are exact, because nothing can make a denied request
    /// fit earlier than its `retry_after`; `remaining` is the value Redis gave at the
    /// denial (it may have grown since). If the Redis state is wiped meanwhile, the key
    /// stays denied until T. A request that can never fit (a cost above a limit's
    /// capacity) always goes to Redis; if it runs into a lockout, which may start a block,
    /// the key's cached denial is dropped.
    pub fn with_block_cache(mut self, entries: Option<NonZeroUsize>) -> Self {
        self.block_cache = entries.map(|entries| Arc::new(BlockCache::new(entries.get())));
        self.listen_for_resets();
        self
    }

    /// Leases quota for hot keys (off by default): a request that goes to Redis anyway
    /// takes a batch of units beside its own, in the same script call, and the next
    /// requests of that key on this node spend them without a Redis call. See
    /// [`LeaseConfig`] and [Leased quota](crate::guide::leases) for what holds with several
    /// nodes.
    ///
    /// Every leased unit is counted in Redis before it is spent. Fixed window and
    /// sliding-window counter limits keep "at most `limit` per aligned window" exactly
    /// across any number of nodes; token bucket and GCRA keep their long-run rate, and an
    /// interval admits at most what it would without leases plus what the leases held. A
    /// list with a sliding-window log limit is never leased.
    /// A cold key (fewer than two requests within a lease period on this node) is decided
    /// exactly as without leases. Call [`release_leases`](Self::release_leases) on
    /// shutdown.
    pub fn with_leases(mut self, config: LeaseConfig) -> Self {
        self.lease_config = Some(config);
        self.settings_changed();
        self
    }

    /// Gives every unit this store holds in leases back to Redis, so that other nodes can
    /// spend it: call it on shutdown, once no more requests come. (Idle leases go back by
    /// themselves; a store dropped inside a Tokio runtime returns its leases too.)
    ///
    /// # Errors
    ///
    /// When a return call fails: those units stay counted until their window ends.
    pub async fn release_leases(&self) -> Result<(), StoreError> {
        match &self.leases {
            Some(leases) => leases.release().await,
            None => Ok(()),
        }
    }

    /// The batching machinery and the leases follow the settings: built anew, from all of
    /// them.
    fn settings_changed(&mut self) {
        self.coalescer = Arc::default();
        self.leases = self.lease_config.map(|config| {
            Arc::new(Leases::new(
                config,
                self.connection.clone(),
                self.clock.clone(),
            ))
        });
    }

    /// The coalescer, when coalescing is on.
    fn coalescer(&self) -> Option<&Coalescer> {
        if !self.coalescing {
            return None;
        }
        Some(self.coalescer.get_or_init(|| {
            Coalescer::new(
                self.connection.clone(),
                self.clock.clone(),
                self.coalescer_config,
                self.masters.clone(),
            )
        }))
    }

    /// The Redis key that holds `limit`'s state for `key`.
    pub fn redis_key(&self, key: &Key, limit: &Limit) -> String {
        keys::limit_key(&self.prefix, key, limit)
    }

    fn encode(&self, key: &Key, limits: &[Limit], cost: u32) -> Encoded {
        self.encode_as(key, limits, cost, None)
    }

    /// [`encode`](Self::encode), for a request (`at` = None) or an adjustment of `cost`
    /// units (`at`: the refund's decision time, or -1 for a top-up).
    fn encode_as(&self, key: &Key, limits: &[Limit], cost: u32, at: Option<i64>) -> Encoded {
        let cluster = self.connection.is_cluster();
        Encoded::new(&self.prefix, key, limits, cost, at, cluster)
    }
}

impl Store for RedisStore {
    /// Every capability.
    fn capabilities(&self) -> crate::store::Capabilities {
        crate::store::Capabilities::ALL
    }

    fn check_held(&self, key: &Key, limits: &[Limit], cost: u32) -> Option<Decision> {
        self.leases.as_ref()?.spend_held(key, limits, cost)
    }

    fn check(&self, key: &Key, limits: &[Limit], cost: u32) -> Check {
        self.decide(key, limits, cost, 0)
    }

    /// A reserving request spends leased units only when it fits in them now (no
    /// reservation is made from a lease), and otherwise goes to Redis without an ask: a
    /// reservation is always made in Redis. A cached denial answers it only when its
    /// `retry_after` is beyond `max_wait_ms` (no reservation could be made either); a
    /// reservation is never cached as a denial.
    fn reserve(&self, key: &Key, limits: &[Limit], cost: u32, max_wait_ms: u64) -> Check {
        // Limits that never reserve are checked as usual (no reservation section sent).
        let reserve_ms = if crate::algorithm::reservable(limits) {
            max_wait_ms
        } else {
            0
        };
        self.decide(key, limits, cost, reserve_ms)
    }

    fn peek(&self, key: &Key, limits: &[Limit], cost: u32) -> Check {
        if limits.is_empty() {
            return Check::ready(Ok(Decision::unlimited()));
        }
        let encoded = self.encode(key, limits, cost);
        admin::peek(self.connection.clone(), self.clock.clone(), encoded)
    }

    fn reset(&self, key: &Key, limits: &[Limit]) -> Reset {
        admin::reset(
            self.connection.clone(),
            &self.prefix,
            key,
            limits,
            self.leases.clone(),
            self.block_cache.clone(),
        )
    }

    fn adjust(&self, key: &Key, limits: &[Limit], adjustment: Adjustment) -> Check {
        self.adjust_call(key, limits, adjustment)
    }

    fn check_in_flight(
        &self,
        key: &Key,
        limits: &[Limit],
        cost: u32,
        in_flight: &InFlightLimit,
        max_wait_ms: u64,
    ) -> Check<Admitted> {
        // Limits that never reserve are checked as usual (no reservation section sent).
        let reserve_ms = if crate::algorithm::reservable(limits) {
            max_wait_ms
        } else {
            0
        };
        self.check_in_flight_call(key, limits, cost, in_flight, reserve_ms)
    }

    fn release_in_flight(
        &self,
        permit: Permit,
        limits: &[Limit],
        adjustment: Option<Adjustment>,
    ) -> Check {
        self.release_in_flight_call(&permit, limits, adjustment)
    }

    fn connecting(&self) -> bool {
        self.connection.mode.connecting()
    }
}
