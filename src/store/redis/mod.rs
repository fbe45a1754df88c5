//! The Redis store: every decision is one atomic Lua script.

use std::{
    fmt,
    sync::{Arc, LazyLock, OnceLock},
};

mod acl;
mod admin;
mod batch;
mod block_cache;
mod connect;
mod function;
mod invalidate;
mod lease;
#[cfg(feature = "cluster")]
mod nodes;
mod permits;
mod reply;
#[cfg(feature = "sentinel")]
mod sentinel;

pub use self::connect::RedisConnect;
#[cfg(feature = "tls")]
pub use self::connect::TlsConfig;
pub use self::lease::LeaseConfig;
pub use self::permits::{ACQUIRE as IN_FLIGHT_ACQUIRE_SOURCE, RENEW as IN_FLIGHT_RENEW_SOURCE};
#[cfg(feature = "sentinel")]
pub use self::sentinel::SentinelConfig;

use futures_util::future::BoxFuture;
use redis::{Cmd, RedisError, RedisResult, Script, aio::ConnectionManager};
use smallvec::SmallVec;
use tokio::sync::oneshot;

use self::{
    batch::{Coalescer, CoalescerConfig, Submitted},
    block_cache::{BlockCache, DEFAULT_BLOCK_CACHE_SIZE},
    lease::{Leases, Spent},
};
use super::{Check, Reset, Store};
use crate::{
    Adjustment, Algorithm, ConfigError, Decision, Limit, LimitDecision, StoreError, StoreErrorKind,
    clock::{Clock, MonotonicClock},
    decision::LimitDecisions,
    key::Key,
};

/// The script: the algorithms and the entry point, joined at build time, so that one
/// EVALSHA decides a batch of requests with several limits each.
pub const SCRIPT_SOURCE: &str = concat!(
    include_str!("../../../lua/prelude.lua"),
    include_str!("../../../lua/fixed_window.lua"),
    include_str!("../../../lua/sliding_window.lua"),
    include_str!("../../../lua/sliding_window_counter.lua"),
    include_str!("../../../lua/token_bucket.lua"),
    include_str!("../../../lua/gcra.lua"),
    include_str!("../../../lua/lease.lua"),
    include_str!("../../../lua/lockout.lua"),
    include_str!("../../../lua/main.lua"),
);

static SCRIPT: LazyLock<Script> = LazyLock::new(|| Script::new(SCRIPT_SOURCE));

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
/// let layer = RateLimitLayer::new(Limit::per_minute(100)?).store(store);
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
    reset_source: Option<invalidate::Nodes>,
    /// On a cluster: its masters, for per-node pipelines of coalesced calls.
    masters: Option<Arc<batch::Nodes>>,
}

/// A connection to Redis, and whether it calls the script as a function (shared by its
/// clones).
#[derive(Clone)]
pub(crate) struct Connection {
    pub(crate) link: Link,
    pub(crate) mode: Arc<function::Mode>,
}

impl From<Link> for Connection {
    fn from(link: Link) -> Self {
        Self {
            link,
            mode: Arc::default(),
        }
    }
}

/// The kinds of connections.
#[derive(Clone)]
pub(crate) enum Link {
    Manager(ConnectionManager),
    #[cfg(feature = "cluster")]
    Cluster(redis::cluster_async::ClusterConnection),
    #[cfg(feature = "bb8")]
    Pool(bb8_redis::bb8::Pool<bb8_redis::RedisConnectionManager>),
    #[cfg(feature = "sentinel")]
    Sentinel(Arc<sentinel::SentinelConnection>),
}

impl Connection {
    /// Fails at once while the first connection is still being made in the background
    /// ([`RedisConnect::in_background`]): no call waits for a Redis that was never up.
    #[inline]
    pub(crate) fn ready(&self) -> Result<(), StoreError> {
        if self.mode.connecting() {
            self.keep_connecting();
            return Err(StoreError::not_connected());
        }
        Ok(())
    }

    fn is_cluster(&self) -> bool {
        #[cfg(feature = "cluster")]
        if let Link::Cluster(_) = self.link {
            return true;
        }
        false
    }
}

impl fmt::Debug for RedisStore {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let connection = match self.connection.link {
            Link::Manager(_) => "ConnectionManager",
            #[cfg(feature = "cluster")]
            Link::Cluster(_) => "ClusterConnection",
            #[cfg(feature = "bb8")]
            Link::Pool(_) => "bb8::Pool",
            #[cfg(feature = "sentinel")]
            Link::Sentinel(_) => "Sentinel",
        };
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
    /// Connects to the Redis at `url`: `redis://[[user]:password@]host:port[/db]`, or
    /// `rediss://...` for TLS (feature `tls`; the system's root certificates are trusted,
    /// see [`connect_tls`](Self::connect_tls) for a private CA or a client certificate).
    /// With an ACL user, see the README for the least privilege tollgate needs.
    ///
    /// The connection reconnects by itself: after Redis restarts, the first call that
    /// finds the connection broken starts a new one. A connection attempt gives up after
    /// about a second, so that a Redis that is down fails calls quickly and the layer's
    /// [`FailurePolicy`](crate::FailurePolicy) answers them.
    ///
    /// Awaiting the [`RedisConnect`] connects; with
    /// [`in_background`](RedisConnect::in_background) a Redis that is not up yet does not
    /// stop the service from starting.
    ///
    /// # Errors
    ///
    /// When the URL is invalid (also: `rediss://` without the `tls` feature) or Redis
    /// cannot be reached now.
    pub fn connect(url: &str) -> RedisConnect {
        RedisConnect::client(connect::open(url))
    }

    /// Connects to a Redis Cluster through any of its `nodes` (feature `cluster`).
    ///
    /// Every key of one decision shares a hash tag, so each script runs on the one master
    /// that owns the key's slot; different keys spread over all masters. `MOVED` and `ASK`
    /// redirections (failover, resharding) are followed by redis-rs, and the script is
    /// loaded on every master on `NOSCRIPT`. Coalesced decisions are grouped by slot, and
    /// the calls of the slots one master owns go to it together, in one pipeline (see the
    /// README's "Redis Cluster").
    ///
    /// # Errors
    ///
    /// When a URL is invalid or no node can be reached now.
    #[cfg(feature = "cluster")]
    pub fn connect_cluster<N: AsRef<str>>(nodes: &[N]) -> RedisConnect {
        RedisConnect::cluster(nodes, None)
    }

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
            block_cache: Some(Arc::new(BlockCache::new(DEFAULT_BLOCK_CACHE_SIZE))),
            lease_config: None,
            leases: None,
            reset_source: None,
            masters: None,
        }
    }

    /// Listens for resets on `nodes` (see [`invalidate`]).
    pub(crate) fn with_reset_source(mut self, nodes: invalidate::Nodes) -> Self {
        self.reset_source = Some(nodes);
        self.listen_for_resets();
        self
    }

    /// Points the block cache at the reset channel of the current prefix.
    fn listen_for_resets(&self) {
        if let Some(cache) = &self.block_cache {
            let source = self.reset_source.as_ref();
            cache.listen_to(
                source.map(|nodes| invalidate::Source::new(nodes.clone(), &self.prefix)),
            );
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

    /// Whether decisions that wait at the same moment share one script call (on by
    /// default).
    ///
    /// A background task takes every decision waiting when it is free and sends them as
    /// one `EVALSHA` (per hash slot on a cluster, those of one master in one pipeline), so
    /// Redis runs one script per batch instead of one per request; a lone request is sent
    /// at once, without waiting for company. Off, each decision is its own `EVALSHA`.
    ///
    /// The task runs on the Tokio runtime of the first decision after it is needed; if
    /// that runtime shuts down, the next decision starts a new task on its own runtime.
    pub fn with_coalescing(mut self, on: bool) -> Self {
        self.coalescing = on;
        self.settings_changed();
        self
    }

    /// At most `max` decisions wait for Redis at once (4096 by default); beyond that a
    /// decision fails at once with [`StoreErrorKind::Overloaded`] and the layer's failure
    /// policy answers it, so a slow Redis never grows an unbounded queue in memory.
    /// Applies with coalescing on, whichever of the two is set first.
    pub fn with_queue_limit(mut self, max: usize) -> Self {
        self.coalescer_config.queue = max.max(1);
        self.settings_changed();
        self
    }

    /// Remembers up to `entries` denied keys (10 000 by default; 0 turns it off).
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
    pub fn with_block_cache(mut self, entries: usize) -> Self {
        self.block_cache = (entries > 0).then(|| Arc::new(BlockCache::new(entries)));
        self.listen_for_resets();
        self
    }

    /// Leases quota for hot keys (off by default): a request that goes to Redis anyway
    /// takes a batch of units beside its own, in the same script call, and the next
    /// requests of that key on this node spend them without a Redis call. See
    /// [`LeaseConfig`] and the README's "Leased quota" for what holds with several nodes.
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
        let mut out =
            String::with_capacity(self.prefix.len() + key.as_str().len() + limit.id().len() + 4);
        out.push_str(&self.prefix);
        out.push_str(":{");
        out.push_str(key.as_str());
        out.push_str("}:");
        out.push_str(limit.id());
        out
    }

    fn encode(&self, key: &Key, limits: &[Limit], cost: u32) -> Encoded {
        self.encode_as(key, limits, cost, None)
    }

    /// [`encode`](Self::encode), for a request (`at` = None) or an adjustment of `cost`
    /// units (`at`: the refund's decision time, or -1 for a top-up).
    fn encode_as(&self, key: &Key, limits: &[Limit], cost: u32, at: Option<i64>) -> Encoded {
        let keys = Keys::new(&self.prefix, key, limits);
        let slot = if self.connection.is_cluster() {
            slot_of(keys.iter().next().unwrap_or_default())
        } else {
            0
        };
        let mut group = SmallVec::new();
        for limit in limits {
            group.push(u64::from(limit.algorithm().code()));
            group.push(u64::from(limit.limit()));
            group.push(limit.window_ms());
            group.push(u64::from(limit.capacity()));
            group.push(limit.lockout_ms());
        }
        Encoded {
            keys,
            cost,
            at,
            group,
            quotas: limits.iter().map(Limit::limit).collect(),
            peek: false,
            reserve_ms: 0,
            slot,
            lease: None,
        }
    }
}

/// Milliseconds on the store's local clock (a [`MonotonicClock`] when none was set): for
/// the block cache only; decisions use Redis `TIME` or the explicit clock.
fn local_now_ms(clock: Option<&Arc<dyn Clock>>) -> u64 {
    clock.map_or_else(|| MonotonicClock.now_ms(), |c| c.now_ms())
}

impl Store for RedisStore {
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
        self.peek_check(key, limits, cost)
    }

    fn reset(&self, key: &Key, limits: &[Limit]) -> Reset {
        self.reset_state(key, limits)
    }

    fn adjust(&self, key: &Key, limits: &[Limit], adjustment: Adjustment) -> Check {
        self.adjust_call(key, limits, adjustment)
    }

    fn connecting(&self) -> bool {
        self.connection.mode.connecting()
    }
}

impl RedisStore {
    /// [`Store::check`], reserving up to `reserve_ms` ahead when it is not 0
    /// ([`Store::reserve`]).
    fn decide(&self, key: &Key, limits: &[Limit], cost: u32, reserve_ms: u64) -> Check {
        let mut lease_entry = None;
        if let Some(leases) = &self.leases {
            if reserve_ms > 0 {
                if let Some(decision) = leases.spend_held(key, limits, cost) {
                    return Check::ready(Ok(decision));
                }
            } else {
                match leases.spend(key, limits, cost) {
                    Spent::Here(decision) => return Check::ready(Ok(decision)),
                    Spent::Redis(entry) => lease_entry = entry,
                }
            }
        }
        // A request that can never fit is not "blocked until" anything: Redis answers it.
        let fits_at_all = limits.iter().all(|l| cost <= l.capacity());
        let block_cache = match &self.block_cache {
            Some(cache) => {
                let fingerprint = BlockCache::fingerprint(limits);
                if fits_at_all {
                    let now = local_now_ms(self.clock.as_ref());
                    if let Some(decision) = cache.get(key, fingerprint, cost, now)
                        && (reserve_ms == 0 || decision.retry_after_ms() > reserve_ms)
                    {
                        // A lease due for a refill still pays before a cached denial answers.
                        if let (Some(leases), Some(_)) = (&self.leases, &lease_entry)
                            && let Some(decision) = leases.spend_held(key, limits, cost)
                        {
                            return Check::ready(Ok(decision));
                        }
                        return Check::ready(Ok(decision));
                    }
                }
                Some((cache.clone(), key.clone(), fingerprint, cache.generation()))
            }
            None => None,
        };
        let mut encoded = self.encode(key, limits, cost);
        encoded.reserve_ms = reserve_ms;
        if let (Some(leases), Some(entry)) = (&self.leases, lease_entry) {
            match leases.attach(entry, limits, cost) {
                Ok(attach) => encoded.lease = attach.map(Arc::new),
                Err(decision) => return Check::ready(Ok(decision)),
            }
        }
        let call = match self.send(encoded) {
            Ok(call) => call,
            Err(error) => return Check::ready(Err(error)),
        };
        let clock = self.clock.clone();
        Check::pending(async move {
            let decision = call.decision().await?;
            if let Some((cache, key, fingerprint, generation)) = block_cache {
                let now = local_now_ms(clock.as_ref());
                if !fits_at_all {
                    // Not cached, but a lockout it ran into may have started a block
                    // (its only write), which a cached denial of the key would not show.
                    if decision.blocked_ms() > 0 {
                        cache.forget(&key, fingerprint, now);
                    }
                } else if decision.is_allowed() {
                    cache.forget(&key, fingerprint, now);
                } else {
                    cache.insert(key, fingerprint, cost, now, &decision, generation);
                }
            }
            Ok(decision)
        })
    }

    /// Queues `encoded` for the batching task, or (coalescing off, or no runtime to run
    /// the task on) starts its own script call.
    fn send(&self, encoded: Encoded) -> Result<Call, StoreError> {
        self.connection.ready()?;
        let encoded = match self.coalescer() {
            Some(coalescer) => match coalescer.submit(encoded) {
                Submitted::Queued(reply) => return Ok(Call::Queued(reply)),
                Submitted::Refused(error) => return Err(error),
                Submitted::NoRuntime(encoded) => *encoded,
            },
            None => encoded,
        };
        let connection = self.connection.clone();
        let clock = self.clock.clone();
        // Boxed on its own: the call's futures would otherwise size every decision's
        // future, queued ones included, for this rarer path.
        Ok(Call::Direct(Box::pin(async move {
            let now = clock.as_ref().map(|c| c.now_ms());
            let call = script_call(&connection.mode, now, &[&encoded]);
            let reply = invoke(connection, call).await;
            let len = encoded.quotas.len() * 4;
            // The request's results, its ask's (when it asked), then `now`.
            let asked = encoded.lease.as_ref().map_or(0, |a| a.reply_len(&encoded));
            let (decision, grant) = match &reply {
                Ok(reply) => {
                    let (values, at) = split_now(reply, len + asked);
                    let (own, grant) = values.split_at(len.min(values.len()));
                    (parse(own, &encoded.quotas, at), Some(grant))
                }
                Err(error) => (Err(error.clone()), None),
            };
            match &encoded.lease {
                Some(attach) => attach.settle(&encoded, decision, grant),
                None => decision,
            }
        })))
    }
}

/// The numbers the script's ARGV has per limit.
const LIMIT_FIELDS: usize = 5;

/// The key that holds a limit's block ([`Limit::with_lockout`]) next to the limit's key
/// `limit_key`: the same hash tag, and a last part no limit id has (ids end in digits).
fn lockout_key(limit_key: &str) -> String {
    let mut out = String::with_capacity(limit_key.len() + LOCKOUT_SUFFIX.len());
    out.push_str(limit_key);
    out.push_str(LOCKOUT_SUFFIX);
    out
}

/// What [`lockout_key`] appends.
const LOCKOUT_SUFFIX: &str = ":lockout";

/// A request's Redis keys, end to end in one buffer: the keys of a request with one limit
/// (or two short ones) need no allocation of their own, which one `String` each did, and
/// which the batching task then freed on another thread.
#[derive(Debug, Clone, Default)]
pub(crate) struct Keys {
    text: SmallVec<[u8; 96]>,
    ends: SmallVec<[u32; 2]>,
}

impl Keys {
    /// The keys a request for `key` under `limits` touches: each limit's (what
    /// [`RedisStore::redis_key`] makes), then the block key ([`lockout_key`]) of each limit
    /// with a lockout.
    fn new(prefix: &str, key: &Key, limits: &[Limit]) -> Self {
        let mut keys = Self::default();
        let key = key.as_str();
        for limit in limits {
            keys.push(&[prefix, ":{", key, "}:", limit.id()]);
        }
        for limit in limits.iter().filter(|l| l.lockout_ms() > 0) {
            keys.push(&[prefix, ":{", key, "}:", limit.id(), LOCKOUT_SUFFIX]);
        }
        keys
    }

    /// Appends a key made of `parts`.
    fn push(&mut self, parts: &[&str]) {
        // Sized once, then copied into: `extend_from_slice` per part cost twice as much.
        let mut at = self.text.len();
        self.text
            .resize(at + parts.iter().map(|p| p.len()).sum::<usize>(), 0);
        for part in parts {
            self.text[at..at + part.len()].copy_from_slice(part.as_bytes());
            at += part.len();
        }
        self.ends.push(u32::try_from(at).unwrap_or(u32::MAX));
    }

    pub(crate) fn len(&self) -> usize {
        self.ends.len()
    }

    /// The keys, in order.
    pub(crate) fn iter(&self) -> impl Iterator<Item = &[u8]> {
        let mut start = 0;
        self.ends.iter().map(move |&end| {
            let key = &self.text[start..end as usize];
            start = end as usize;
            key
        })
    }
}

impl RedisStore {
    /// [`Store::adjust`]: one script call (coalesced with the decisions waiting at the
    /// same moment, so it keeps its place in their order). A refund drops the key's
    /// cached denial here (it may fit earlier now); other replicas' block caches keep
    /// theirs until its `retry_after`, denying no more than they would have.
    fn adjust_call(&self, key: &Key, limits: &[Limit], adjustment: Adjustment) -> Check {
        let (units, at) = match adjustment {
            Adjustment::Refund {
                units,
                charged_at_ms,
            } => (units, i64::try_from(charged_at_ms).unwrap_or(i64::MAX)),
            Adjustment::TopUp { units } => (units, -1),
        };
        if units == 0 {
            // Nothing to move, and "-0" would read as a request of cost 0.
            return Check::ready(Ok(Decision::unlimited()));
        }
        if let (Some(cache), Adjustment::Refund { .. }) = (&self.block_cache, adjustment) {
            let now = local_now_ms(self.clock.as_ref());
            cache.forget(key, BlockCache::fingerprint(limits), now);
        }
        let encoded = self.encode_as(key, limits, units, Some(at));
        match self.send(encoded) {
            Ok(call) => Check::pending(call.decision()),
            Err(error) => Check::ready(Err(error)),
        }
    }
}

/// How a decision reaches Redis: queued for the batching task, or its own script call.
enum Call {
    Queued(oneshot::Receiver<Result<Decision, StoreError>>),
    Direct(BoxFuture<'static, Result<Decision, StoreError>>),
}

impl Call {
    async fn decision(self) -> Result<Decision, StoreError> {
        match self {
            Call::Queued(reply) => reply.await.unwrap_or_else(|_| {
                Err(StoreError::new(
                    StoreErrorKind::Unavailable,
                    "the batch task stopped",
                ))
            }),
            Call::Direct(call) => call.await,
        }
    }
}

/// One request, ready to join a script call.
#[derive(Debug, Clone)]
pub(crate) struct Encoded {
    keys: Keys,
    cost: u32,
    /// An adjustment of `cost` units rather than a request: the script's `at` argument.
    at: Option<i64>,
    /// Its limits, as the script's ARGV has them: code, limit, window ms, capacity,
    /// lockout ms each.
    group: SmallVec<[u64; LIMIT_FIELDS]>,
    quotas: SmallVec<[u32; 2]>,
    /// Decided without committing: sent with its group index negated.
    peek: bool,
    /// Reserves up to this many ms ahead ([`Store::reserve`]); 0: a plain check.
    reserve_ms: u64,
    /// The hash slot of the keys (0 outside a cluster).
    slot: u16,
    /// What rides on it for leased quota (an ask, units going back).
    lease: Option<Arc<lease::Attach>>,
}

impl Encoded {
    /// The limit and window of a request that the library's function for one fixed
    /// window decides (lua/one.lua): one fixed-window limit without a lockout, a cost of
    /// 1 to the limit, and nothing riding on it (no peek, adjustment, reservation or
    /// lease).
    fn one_fixed_window(&self) -> Option<(u64, u64)> {
        let fixed_window = u64::from(Algorithm::FixedWindow.code());
        match self.group[..] {
            [code, limit, window_ms, _, 0]
                if code == fixed_window
                    && (1..=limit).contains(&u64::from(self.cost))
                    && self.keys.len() == 1
                    && self.at.is_none()
                    && !self.peek
                    && self.reserve_ms == 0
                    && self.lease.is_none() =>
            {
                Some((limit, window_ms))
            }
            _ => None,
        }
    }

    /// This request as the function for many fixed windows takes it (key, limit, window
    /// ms, cost), when it is one against one fixed window ([`Self::one_fixed_window`]).
    fn as_fixed_window(&self) -> Option<function::FixedWindowRequest<'_>> {
        let (limit, window_ms) = self.one_fixed_window()?;
        Some((self.keys.iter().next()?, limit, window_ms, self.cost))
    }
}

/// The script call (`FCALL`, or `EVALSHA` where Redis has no functions: see
/// [`function::Mode::run`]) deciding `requests` in order, at `now` (None: Redis `TIME`).
///
/// Built straight into one [`Cmd`] buffer; each distinct list of limits is sent once
/// and requests name theirs by index, so a batch of requests under the same limits costs
/// two arguments per request besides its keys.
pub(crate) fn script_call(mode: &function::Mode, now: Option<u64>, requests: &[&Encoded]) -> Cmd {
    if let [request] = requests
        && mode.functions()
        && let Some((key, limit, window_ms, cost)) = request.as_fixed_window()
    {
        return function::fixed_window_call(now, key, limit, window_ms, cost);
    }
    let mut groups: SmallVec<[&[u64]; 4]> = SmallVec::new();
    let mut group_of: SmallVec<[usize; 32]> = SmallVec::with_capacity(requests.len());
    for request in requests {
        let index = match groups.iter().position(|&g| g == &request.group[..]) {
            Some(index) => index,
            None => {
                groups.push(&request.group);
                groups.len() - 1
            }
        };
        group_of.push(index + 1);
    }
    let keys: usize = requests.iter().map(|r| r.keys.len()).sum();
    let group_args: usize = groups.iter().map(|g| 1 + g.len()).sum();
    let adjustments = requests.iter().filter(|r| r.at.is_some()).count();
    let args = 3 + keys + 2 + group_args + 1 + 2 * requests.len() + adjustments;
    let key_bytes: usize = requests.iter().map(|r| r.keys.text.len()).sum();
    let mut cmd = Cmd::with_capacity(args, 64 + key_bytes + 12 * (args - keys));
    mode.head(&mut cmd, keys);
    for request in requests {
        for key in request.keys.iter() {
            cmd.arg(key);
        }
    }
    match now {
        Some(now) => cmd.arg(now),
        None => cmd.arg(""),
    };
    cmd.arg(groups.len());
    for group in &groups {
        cmd.arg(group.len() / LIMIT_FIELDS);
        for &value in *group {
            cmd.arg(value);
        }
    }
    cmd.arg(requests.len());
    for (request, &group) in requests.iter().zip(&group_of) {
        match request.at {
            None if request.peek => cmd.arg(request.cost).arg(-(group as i64)),
            None => cmd.arg(request.cost).arg(group),
            // A negative cost, then `at` (see lua/main.lua).
            Some(at) => cmd.arg(-i64::from(request.cost)).arg(group).arg(at),
        };
    }
    let reserving = requests.iter().filter(|r| r.reserve_ms > 0).count();
    if requests.iter().any(|r| r.lease.is_some()) {
        lease::sections(&mut cmd, requests, &group_of);
    } else if reserving > 0 {
        // No asks, no returns: the reservations follow (see lua/main.lua).
        cmd.arg(0).arg(0);
    }
    if reserving > 0 {
        cmd.arg(reserving);
        for (index, request) in requests.iter().enumerate() {
            if request.reserve_ms > 0 {
                cmd.arg(index + 1).arg(request.reserve_ms);
            }
        }
    }
    cmd
}

/// The call for a coalesced batch on one Redis (not a cluster): two or more requests
/// against one fixed window each, on distinct keys, go in one call of the library's
/// function for many (`<library>_fwn`, lua/one.lua), which skips the general function's
/// groups; every other batch is [`script_call`]'s. (A key repeated in the batch, a hot
/// key, is cheaper on the general path, which reads and writes it once.)
pub(crate) fn standalone_call(
    mode: &function::Mode,
    now: Option<u64>,
    requests: &[&Encoded],
) -> Cmd {
    if requests.len() >= 2
        && mode.functions()
        && let Some(lean) = fixed_windows(requests)
    {
        return function::fixed_windows_call(now, false, &lean);
    }
    script_call(mode, now, requests)
}

/// Each request's key, limit, window ms and cost, when every one of `requests` is one
/// against one fixed window ([`Encoded::one_fixed_window`]) and no key repeats.
fn fixed_windows<'a>(requests: &[&'a Encoded]) -> Option<Vec<function::FixedWindowRequest<'a>>> {
    let mut lean: Vec<function::FixedWindowRequest<'a>> = Vec::with_capacity(requests.len());
    // Linear in the batch (up to `max_batch` requests), where comparing pairs is not.
    let mut seen = std::collections::HashSet::with_capacity(requests.len());
    for request in requests {
        let one = request.as_fixed_window()?;
        if !seen.insert(one.0) {
            return None;
        }
        lean.push(one);
    }
    Some(lean)
}

/// The Redis Cluster hash slot of `key`: CRC16 of its hash tag, modulo 16384.
#[cfg(feature = "cluster")]
fn slot_of(key: &[u8]) -> u16 {
    let tag = key
        .iter()
        .position(|&b| b == b'{')
        .and_then(|open| {
            let rest = &key[open + 1..];
            rest.iter()
                .position(|&b| b == b'}')
                .map(|close| &rest[..close])
        })
        .filter(|tag| !tag.is_empty())
        .unwrap_or(key);
    crc16::State::<crc16::XMODEM>::calculate(tag) % 16384
}

#[cfg(not(feature = "cluster"))]
fn slot_of(_key: &[u8]) -> u16 {
    0
}

/// A connection from a bb8 pool, its errors as the store's.
#[cfg(feature = "bb8")]
pub(crate) async fn checkout(
    pool: &bb8_redis::bb8::Pool<bb8_redis::RedisConnectionManager>,
) -> Result<bb8_redis::bb8::PooledConnection<'_, bb8_redis::RedisConnectionManager>, StoreError> {
    pool.get().await.map_err(|e| match e {
        bb8_redis::bb8::RunError::User(e) => store_error(e),
        bb8_redis::bb8::RunError::TimedOut => StoreError::timeout(),
    })
}

/// Sends a [`script_call`].
pub(crate) async fn invoke(connection: Connection, call: Cmd) -> Result<Vec<i64>, StoreError> {
    connection.ready()?;
    let mode = &connection.mode;
    match connection.link {
        Link::Manager(mut manager) => mode.run(&mut manager, &call).await,
        #[cfg(feature = "cluster")]
        Link::Cluster(mut cluster) => match mode.run(&mut cluster, &call).await {
            Err(error) => nodes::follow_ask(&mut cluster, mode, &call, error).await,
            result => result,
        },
        #[cfg(feature = "bb8")]
        Link::Pool(pool) => {
            let mut connection = checkout(&pool).await?;
            mode.run(&mut *connection, &call).await
        }
        #[cfg(feature = "sentinel")]
        Link::Sentinel(sentinel) => return sentinel.evalsha(mode, &call).await,
    }
    .map_err(store_error)
}

/// `PING`, for its side effect only: a connection that finds itself broken reconnects.
pub(crate) async fn ping(connection: Connection) {
    if connection.ready().is_err() {
        return;
    }
    let ping = redis::cmd("PING");
    let _: RedisResult<()> = match connection.link {
        Link::Manager(mut manager) => ping.query_async(&mut manager).await,
        #[cfg(feature = "cluster")]
        Link::Cluster(mut cluster) => ping.query_async(&mut cluster).await,
        #[cfg(feature = "bb8")]
        Link::Pool(_) => Ok(()),
        #[cfg(feature = "sentinel")]
        Link::Sentinel(sentinel) => {
            sentinel.ping().await;
            Ok(())
        }
    };
}

/// One request's share of the script's reply: four integers per limit; `now` is the time
/// the script decided at (the reply's last value).
pub(crate) fn parse(
    reply: &[i64],
    quotas: &[u32],
    now: Option<i64>,
) -> Result<Decision, StoreError> {
    if reply.len() != quotas.len() * 4 {
        return Err(StoreError::new(
            StoreErrorKind::Response,
            format!(
                "script returned {} values for {} limits",
                reply.len(),
                quotas.len()
            ),
        ));
    }
    let to_u64 = |v: i64| u64::try_from(v).unwrap_or(0);
    // A limit whose lockout blocks the request sends `remaining` as minus the time left
    // on the block (lua/lockout.lua): remaining 0, and the block for the block cache.
    let mut blocked_ms = 0;
    let mut decisions: LimitDecisions = reply
        .chunks_exact(4)
        .zip(quotas)
        .map(|(v, &limit)| {
            if v[1] < 0 {
                let left = v[1].unsigned_abs();
                blocked_ms = if blocked_ms == 0 {
                    left
                } else {
                    blocked_ms.min(left)
                };
            }
            LimitDecision {
                allowed: v[0] == 1,
                limit,
                remaining: to_u64(v[1]),
                reset_after_ms: to_u64(v[2]),
                retry_after_ms: to_u64(v[3]),
            }
        })
        .collect();
    // A reservation: every limit allowed, with the wait as its retry_after (lua/main.lua).
    let mut wait = 0;
    if decisions.iter().all(|d| d.allowed) {
        for limit in &mut decisions {
            wait = wait.max(limit.retry_after_ms);
            limit.retry_after_ms = 0;
        }
    }
    let decision = Decision::from_limits(decisions)
        .blocked_for(blocked_ms)
        .with_wait(wait);
    Ok(match now.and_then(|now| u64::try_from(now).ok()) {
        Some(now) => decision.decided_at(now),
        None => decision,
    })
}

/// A reply's values and the `now` the script appended last (see lua/main.lua): `values`
/// counts the requests' results and their asks' results, which come before it.
pub(crate) fn split_now(reply: &[i64], values: usize) -> (&[i64], Option<i64>) {
    match reply.len().checked_sub(values) {
        Some(1) => (&reply[..values], reply.last().copied()),
        _ => (reply, None),
    }
}

fn store_error(error: RedisError) -> StoreError {
    if let Some(denied) = acl::explain(&error) {
        return denied;
    }
    let kind = if error.is_timeout() {
        StoreErrorKind::Timeout
    } else if error.is_io_error() || error.is_connection_dropped() || error.is_connection_refusal()
    {
        StoreErrorKind::Unavailable
    } else {
        StoreErrorKind::Response
    };
    StoreError::new(kind, error)
}

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use super::*;

    /// A request's keys, built in one buffer, are the keys `redis_key` and `lockout_key`
    /// name, in the order the script reads them: with and without lockouts, and past
    /// the buffer's inline size.
    #[test]
    fn a_requests_keys_are_its_limits_keys_then_their_block_keys() {
        let minute = Limit::fixed_window(10, Duration::from_secs(60)).unwrap();
        let locked = Limit::per_second(5)
            .unwrap()
            .with_lockout(Duration::from_secs(600))
            .unwrap();
        let long = "k".repeat(200);
        for key in [Key::new("client-1"), Key::new(&long)] {
            for limits in [
                vec![minute.clone()],
                vec![minute.clone(), locked.clone()],
                vec![locked.clone(), minute.clone()],
            ] {
                let limit_key =
                    |limit: &Limit| format!("tollgate:{{{}}}:{}", key.as_str(), limit.id());
                let mut expected: Vec<String> = limits.iter().map(limit_key).collect();
                for limit in limits.iter().filter(|l| l.lockout_ms() > 0) {
                    expected.push(lockout_key(&limit_key(limit)));
                }
                let keys = Keys::new(DEFAULT_PREFIX, &key, &limits);
                let got: Vec<&[u8]> = keys.iter().collect();
                let expected: Vec<&[u8]> = expected.iter().map(|k| k.as_bytes()).collect();
                assert_eq!(got, expected);
                assert_eq!(keys.len(), expected.len());
            }
        }
    }
}
