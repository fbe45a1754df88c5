//! The Redis store: every decision is one atomic Lua script.

use std::{
    fmt,
    sync::{Arc, LazyLock},
    time::Duration,
};

use futures_util::{FutureExt, future::BoxFuture};
use redis::{
    RedisError, Script, ScriptInvocation,
    aio::{ConnectionManager, ConnectionManagerConfig},
};
use smallvec::SmallVec;

use super::Store;
use crate::{
    ConfigError, Decision, Limit, LimitDecision, StoreError, StoreErrorKind, clock::Clock, key::Key,
};

/// The script: the algorithms and the entry point, joined at build time, so that one
/// EVALSHA decides a batch of requests with several limits each.
pub const SCRIPT_SOURCE: &str = concat!(
    include_str!("../../lua/prelude.lua"),
    include_str!("../../lua/fixed_window.lua"),
    include_str!("../../lua/sliding_window.lua"),
    include_str!("../../lua/sliding_window_counter.lua"),
    include_str!("../../lua/token_bucket.lua"),
    include_str!("../../lua/gcra.lua"),
    include_str!("../../lua/main.lua"),
);

static SCRIPT: LazyLock<Script> = LazyLock::new(|| Script::new(SCRIPT_SOURCE));

/// The default key prefix.
pub const DEFAULT_PREFIX: &str = "tollgate";

/// A [`Store`] in Redis (6.2 or later): each decision is one `EVALSHA` of a Lua script
/// that reads, decides and writes atomically, so every replica of a service shares one
/// budget and no two requests can race.
///
/// - Keys are `<prefix>:{<key>}:<limit id>`: all limits of one key share a hash tag (one
///   Redis Cluster slot), and different keys spread over the cluster.
/// - Time is Redis `TIME`, one clock for every replica, unless a local clock is set with
///   [`with_clock`](Self::with_clock).
/// - Every key the script writes gets a TTL in the same script (the time after which the
///   state decides like a missing key), so nothing is immortal.
/// - After a Redis restart, failover or `SCRIPT FLUSH` the script is reloaded on the
///   `NOSCRIPT` error and the call retried once; nothing else is ever retried (a call that
///   timed out may already have counted).
///
/// The default connection is redis-rs's auto-reconnecting multiplexed
/// [`ConnectionManager`]: one connection pipelines every concurrent call, which measured
/// faster than a pool. Clones share the connection.
///
/// ```no_run
/// # async fn run() -> Result<(), Box<dyn std::error::Error>> {
/// use tollgate::{Limit, RateLimitLayer, store::RedisStore};
///
/// let store = RedisStore::connect("redis://127.0.0.1:6379").await?.with_prefix("myapp")?;
/// let layer = RateLimitLayer::new(Limit::per_minute(100)?).store(store);
/// # Ok(()) }
/// ```
#[derive(Clone)]
pub struct RedisStore {
    connection: Connection,
    prefix: Arc<str>,
    clock: Option<Arc<dyn Clock>>,
}

#[derive(Clone)]
enum Connection {
    Manager(ConnectionManager),
    #[cfg(feature = "cluster")]
    Cluster(redis::cluster_async::ClusterConnection),
    #[cfg(feature = "bb8")]
    Pool(bb8_redis::bb8::Pool<bb8_redis::RedisConnectionManager>),
}

impl fmt::Debug for RedisStore {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let connection = match self.connection {
            Connection::Manager(_) => "ConnectionManager",
            #[cfg(feature = "cluster")]
            Connection::Cluster(_) => "ClusterConnection",
            #[cfg(feature = "bb8")]
            Connection::Pool(_) => "bb8::Pool",
        };
        f.debug_struct("RedisStore")
            .field("connection", &connection)
            .field("prefix", &self.prefix)
            .field("clock", &self.clock)
            .finish()
    }
}

impl RedisStore {
    /// Connects to the Redis at `url` (`redis://[:password@]host:port[/db]`).
    ///
    /// The connection reconnects by itself: after Redis restarts, the first call that
    /// finds the connection broken starts a new one. A connection attempt gives up after
    /// about a second, so that a Redis that is down fails calls quickly and the layer's
    /// [`FailurePolicy`](crate::FailurePolicy) answers them.
    ///
    /// # Errors
    ///
    /// When the URL is invalid or Redis cannot be reached now.
    pub async fn connect(url: &str) -> Result<Self, StoreError> {
        let client = redis::Client::open(url).map_err(store_error)?;
        let config = ConnectionManagerConfig::new()
            .set_number_of_retries(2)
            .set_min_delay(Duration::from_millis(50))
            .set_max_delay(Duration::from_millis(250))
            .set_connection_timeout(Some(Duration::from_millis(500)))
            .set_response_timeout(Some(Duration::from_secs(1)));
        let mut manager = ConnectionManager::new_with_config(client, config)
            .await
            .map_err(store_error)?;
        // Loaded now, the first burst of calls does not all meet NOSCRIPT at once.
        SCRIPT.load_async(&mut manager).await.map_err(store_error)?;
        Ok(Self::from_manager(manager))
    }

    /// Connects to a Redis Cluster through any of its `nodes` (feature `cluster`).
    ///
    /// Every key of one decision shares a hash tag, so each script runs on the one master
    /// that owns the key's slot; different keys spread over all masters. `MOVED` and `ASK`
    /// redirections (failover, resharding) are followed by redis-rs, and the script is
    /// loaded on every master on `NOSCRIPT`.
    ///
    /// # Errors
    ///
    /// When a URL is invalid or no node can be reached now.
    #[cfg(feature = "cluster")]
    pub async fn connect_cluster<N: AsRef<str>>(nodes: &[N]) -> Result<Self, StoreError> {
        let nodes: Vec<&str> = nodes.iter().map(AsRef::as_ref).collect();
        let client = redis::cluster::ClusterClient::builder(nodes)
            .retries(2)
            .min_retry_wait(50)
            .max_retry_wait(250)
            .connection_timeout(Duration::from_millis(500))
            .response_timeout(Duration::from_secs(1))
            .build()
            .map_err(store_error)?;
        let mut connection = client.get_async_connection().await.map_err(store_error)?;
        SCRIPT
            .load_async(&mut connection)
            .await
            .map_err(store_error)?;
        Ok(Self::new(Connection::Cluster(connection)))
    }

    /// Uses an existing connection manager.
    pub fn from_manager(manager: ConnectionManager) -> Self {
        Self::new(Connection::Manager(manager))
    }

    /// Uses a bb8-redis pool: each decision checks a connection out. Slower than the
    /// default multiplexed connection; for apps that already have a pool.
    #[cfg(feature = "bb8")]
    pub fn from_pool(pool: bb8_redis::bb8::Pool<bb8_redis::RedisConnectionManager>) -> Self {
        Self::new(Connection::Pool(pool))
    }

    fn new(connection: Connection) -> Self {
        Self {
            connection,
            prefix: DEFAULT_PREFIX.into(),
            clock: None,
        }
    }

    /// Puts every key under `prefix` (default `tollgate`), to share one Redis between
    /// applications.
    ///
    /// # Errors
    ///
    /// When `prefix` is longer than 64 bytes or has characters other than ASCII letters,
    /// digits and `-_.:/` (braces would change the hash tag).
    pub fn with_prefix(mut self, prefix: &str) -> Result<Self, ConfigError> {
        let valid = prefix.len() <= 64
            && prefix.bytes().all(|b| {
                b.is_ascii_alphanumeric() || matches!(b, b'-' | b'_' | b'.' | b':' | b'/')
            });
        if !valid {
            return Err(ConfigError::new(
                "prefix",
                format!("must be at most 64 of A-Z a-z 0-9 - _ . : / (got {prefix:?})"),
            ));
        }
        self.prefix = prefix.into();
        Ok(self)
    }

    /// Sends the time from `clock` instead of reading Redis `TIME`: for tests, and for
    /// Redis-compatible servers without `TIME` in scripts. Replicas' clocks then must
    /// agree. Keys then live 5 s past the end of their state, so that a clock lagging
    /// Redis's never finds state gone that it still counts.
    pub fn with_clock(mut self, clock: impl Clock) -> Self {
        self.clock = Some(Arc::new(clock));
        self
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

    fn invocation(&self, key: &Key, limits: &[Limit], cost: u32) -> ScriptInvocation<'static> {
        let mut invocation = SCRIPT.prepare_invoke();
        match &self.clock {
            Some(clock) => invocation.arg(clock.now_ms()),
            None => invocation.arg(""),
        };
        invocation.arg(1).arg(cost).arg(limits.len());
        for limit in limits {
            invocation
                .key(self.redis_key(key, limit))
                .arg(limit.algorithm().code())
                .arg(limit.limit())
                .arg(limit.window_ms())
                .arg(limit.capacity());
        }
        invocation
    }
}

impl Store for RedisStore {
    fn check(
        &self,
        key: &Key,
        limits: &[Limit],
        cost: u32,
    ) -> BoxFuture<'static, Result<Decision, StoreError>> {
        let invocation = self.invocation(key, limits, cost);
        let connection = self.connection.clone();
        let quotas: SmallVec<[u32; 4]> = limits.iter().map(Limit::limit).collect();
        async move {
            let reply = invoke(connection, invocation).await?;
            parse(&reply, &quotas)
        }
        .boxed()
    }
}

async fn invoke(
    connection: Connection,
    invocation: ScriptInvocation<'static>,
) -> Result<Vec<i64>, StoreError> {
    match connection {
        Connection::Manager(mut manager) => invocation.invoke_async(&mut manager).await,
        #[cfg(feature = "cluster")]
        Connection::Cluster(mut cluster) => invocation.invoke_async(&mut cluster).await,
        #[cfg(feature = "bb8")]
        Connection::Pool(pool) => {
            let mut connection = pool.get().await.map_err(|e| match e {
                bb8_redis::bb8::RunError::User(e) => store_error(e),
                bb8_redis::bb8::RunError::TimedOut => StoreError::timeout(),
            })?;
            invocation.invoke_async(&mut *connection).await
        }
    }
    .map_err(store_error)
}

/// One request's share of the script's reply: four integers per limit.
fn parse(reply: &[i64], quotas: &[u32]) -> Result<Decision, StoreError> {
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
    let decisions = reply
        .chunks_exact(4)
        .zip(quotas)
        .map(|(v, &limit)| LimitDecision {
            allowed: v[0] == 1,
            limit,
            remaining: to_u64(v[1]),
            reset_after_ms: to_u64(v[2]),
            retry_after_ms: to_u64(v[3]),
        })
        .collect();
    Ok(Decision::new(decisions))
}

fn store_error(error: RedisError) -> StoreError {
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
