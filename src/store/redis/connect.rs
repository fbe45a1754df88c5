//! Connecting to Redis as it is run: one node or a cluster, over TLS (`rediss://`, a
//! custom CA, client certificates) with feature `tls`, as an ACL user named in the URL.

use std::{
    fmt,
    future::Future,
    pin::Pin,
    sync::Arc,
    task::{Context, Poll, ready},
    time::Duration,
};

use futures_util::future::BoxFuture;
use redis::aio::{ConnectionManager, ConnectionManagerConfig};

#[cfg(any(feature = "cluster", feature = "sentinel"))]
use super::link::Link;
#[cfg(feature = "sentinel")]
use super::link::sentinel::{SentinelConfig, SentinelConnection};
#[cfg(any(feature = "cluster", feature = "tls"))]
use super::wire::{TlsConfig, check_scheme};
use super::{
    RedisStore,
    block_cache::ResetNodes,
    link::load,
    wire::{CONNECTION_TIMEOUT, RESPONSE_TIMEOUT, open, store_error, unreachable},
};
use crate::{StoreError, StoreErrorKind};

/// A connection to Redis about to be made: what [`RedisStore::connect`] returns. Awaiting
/// it connects.
///
/// By default a Redis that cannot be reached fails the await, so that a wrong address is
/// seen at start. [`in_background`](Self::in_background) starts the service anyway.
#[must_use = "nothing connects until it is awaited"]
pub struct RedisConnect {
    /// Taken when first polled.
    target: Option<RedisTarget>,
    background: bool,
    running: Option<BoxFuture<'static, Result<RedisStore, StoreError>>>,
}

/// Where a [`RedisStore`] connects: what [`RedisStore::connect`] takes, as redis-rs's
/// `Client::open` takes `impl IntoConnectionInfo`. A URL (`&str`, `String`) is one node;
/// [`cluster`](Self::cluster) and [`sentinel`](Self::sentinel) name the other
/// deployments, and [`with_tls`](Self::with_tls) a private CA or a client certificate for
/// any of them.
///
/// ```no_run
/// # #[cfg(all(feature = "cluster", feature = "tls"))]
/// # async fn run() -> Result<(), Box<dyn std::error::Error>> {
/// use tollgate::store::{RedisStore, RedisTarget, TlsConfig};
///
/// // One node, TLS with the system's root certificates.
/// let one = RedisStore::connect("rediss://tollgate:secret@redis.internal:6380").await?;
/// // A cluster over TLS with a private CA.
/// let tls = TlsConfig::new().with_ca_pem(std::fs::read("ca.crt")?);
/// let nodes = ["rediss://10.0.0.1:7000", "rediss://10.0.0.2:7000"];
/// let cluster = RedisStore::connect(RedisTarget::cluster(&nodes).with_tls(tls)).await?;
/// # Ok(()) }
/// ```
#[derive(Clone)]
pub struct RedisTarget {
    kind: Target,
    #[cfg(feature = "tls")]
    tls: Option<TlsConfig>,
}

/// What to connect to.
#[derive(Clone)]
enum Target {
    Node(String),
    #[cfg(feature = "cluster")]
    Cluster(Vec<String>),
    #[cfg(feature = "sentinel")]
    Sentinel(SentinelConfig),
}

impl RedisTarget {
    /// The Redis at `url`: `redis://[[user]:password@]host:port[/db]`, or `rediss://...`
    /// for TLS (feature `tls`; the system's root certificates are trusted unless
    /// [`with_tls`](Self::with_tls) says otherwise). The same as passing the URL itself.
    pub fn node(url: impl Into<String>) -> Self {
        Self::new(Target::Node(url.into()))
    }

    /// A Redis Cluster, reached through any of its `nodes` (feature `cluster`).
    ///
    /// Every key of one decision shares a hash tag, so each script runs on the one master
    /// that owns the key's slot; different keys spread over all masters. `MOVED` and `ASK`
    /// redirections (failover, resharding) are followed by redis-rs, and the script is
    /// loaded on every master on `NOSCRIPT`. Coalesced decisions are grouped by slot, and
    /// the calls of the slots one master owns go to it together, in one pipeline (see
    /// [Redis Cluster](crate::guide::cluster)).
    #[cfg(feature = "cluster")]
    pub fn cluster<N: AsRef<str>>(nodes: &[N]) -> Self {
        Self::new(Target::Cluster(
            nodes.iter().map(|n| n.as_ref().to_owned()).collect(),
        ))
    }

    /// The master that Redis Sentinel names (feature `sentinel`), followed through
    /// failovers.
    ///
    /// When the master's connection breaks or it answers `READONLY` (it was demoted), the
    /// next call asks the sentinels again and connects to the new master, loading the
    /// script there; decisions meanwhile fail and the layer's
    /// [`FailurePolicy`](crate::FailurePolicy) answers them. Replication is asynchronous,
    /// so counts the old master had not yet sent to its replica are lost at a failover.
    #[cfg(feature = "sentinel")]
    pub fn sentinel(config: SentinelConfig) -> Self {
        Self::new(Target::Sentinel(config))
    }

    /// Trusts the CA and presents the client certificate in `tls` (feature `tls`), for a
    /// private CA and for servers that ask for a client certificate
    /// (`tls-auth-clients yes`). The URLs must be `rediss://` (a Sentinel's master is
    /// reached over TLS, the sentinels too when their URLs are `rediss://`).
    #[cfg(feature = "tls")]
    pub fn with_tls(mut self, tls: TlsConfig) -> Self {
        self.tls = Some(tls);
        self
    }

    fn new(kind: Target) -> Self {
        Self {
            kind,
            #[cfg(feature = "tls")]
            tls: None,
        }
    }
}

impl From<&str> for RedisTarget {
    fn from(url: &str) -> Self {
        Self::node(url)
    }
}

impl From<String> for RedisTarget {
    fn from(url: String) -> Self {
        Self::node(url)
    }
}

impl From<&String> for RedisTarget {
    fn from(url: &String) -> Self {
        Self::node(url.as_str())
    }
}

#[cfg(feature = "sentinel")]
impl From<SentinelConfig> for RedisTarget {
    fn from(config: SentinelConfig) -> Self {
        Self::sentinel(config)
    }
}

impl fmt::Debug for RedisTarget {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        // Never a URL: it may hold a password.
        let mut debug = f.debug_struct("RedisTarget");
        debug.field("kind", &self.kind.name());
        #[cfg(feature = "tls")]
        debug.field("tls", &self.tls.is_some());
        debug.finish()
    }
}

impl Target {
    fn name(&self) -> &'static str {
        match self {
            Target::Node(_) => "redis",
            #[cfg(feature = "cluster")]
            Target::Cluster(_) => "cluster",
            #[cfg(feature = "sentinel")]
            Target::Sentinel(_) => "sentinel",
        }
    }
}

impl RedisConnect {
    /// Starts without Redis when it cannot be reached yet (`true`; off by default), for
    /// deployments where Redis may come up after the service (Kubernetes, compose).
    ///
    /// The first attempt is made when awaited, as without this: a reachable Redis is
    /// connected and the library loaded before the store is returned, and a bad URL, a
    /// wrong password or a refused ACL still fail the await. Only an unreachable Redis
    /// (refused, timed out, a name that does not resolve yet) returns the store anyway,
    /// with one warning; it then connects in the background, retrying with backoff (100
    /// ms, doubling up to 2 s). Until it has connected, every decision fails at once,
    /// without trying Redis, and the layer's [`FailurePolicy`](crate::FailurePolicy)
    /// answers it (a fail-closed layer refuses every request meanwhile, and says so at
    /// start). Once connected the store decides in Redis, with nothing restarted.
    ///
    /// Off by default: a service that cannot reach its store is most often misconfigured,
    /// and is best told at once.
    ///
    /// A Redis Cluster cannot start this way (redis-rs's cluster client connects when it
    /// is built): `connect(RedisTarget::cluster(..)).in_background(true)` fails the await.
    ///
    /// ```no_run
    /// # async fn run() -> Result<(), Box<dyn std::error::Error>> {
    /// use tollgate::store::RedisStore;
    ///
    /// let store = RedisStore::connect("redis://redis:6379").in_background(true).await?;
    /// # Ok(()) }
    /// ```
    pub fn in_background(mut self, on: bool) -> Self {
        self.background = on;
        self
    }
}

/// A future (not only `IntoFuture`), so that `block_on(RedisStore::connect(url))` and
/// `tokio::spawn` take it as they took the `async fn` it replaced.
impl Future for RedisConnect {
    type Output = Result<RedisStore, StoreError>;

    fn poll(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Self::Output> {
        let this = &mut *self;
        let running = match &mut this.running {
            Some(running) => running,
            None => {
                let Some(target) = this.target.take() else {
                    return Poll::Ready(Err(StoreError::new(
                        StoreErrorKind::Response,
                        "RedisConnect polled after it finished",
                    )));
                };
                this.running
                    .insert(Box::pin(connect(target, this.background)))
            }
        };
        let result = ready!(running.as_mut().poll(cx));
        this.running = None;
        Poll::Ready(result)
    }
}

/// Connects to `target`, starting in the background when asked to.
async fn connect(target: RedisTarget, background: bool) -> Result<RedisStore, StoreError> {
    #[cfg(feature = "tls")]
    let tls = target.tls;
    match target.kind {
        Target::Node(url) => {
            #[cfg(feature = "tls")]
            let client = match &tls {
                Some(tls) => check_scheme(&url).and_then(|()| {
                    redis::Client::build_with_tls(url.as_str(), tls.certificates())
                        .map_err(store_error)
                }),
                None => open(&url),
            };
            #[cfg(not(feature = "tls"))]
            let client = open(&url);
            RedisStore::connect_client(client?, background).await
        }
        #[cfg(feature = "cluster")]
        Target::Cluster(nodes) => {
            if background {
                return Err(StoreError::new(
                    StoreErrorKind::Unsupported,
                    "in_background: a Redis Cluster must be reachable at start \
                     (redis-rs's cluster client connects when it is built)",
                ));
            }
            let nodes: Vec<&str> = nodes.iter().map(String::as_str).collect();
            #[cfg(feature = "tls")]
            return RedisStore::connect_cluster_with(&nodes, tls.as_ref()).await;
            #[cfg(not(feature = "tls"))]
            return RedisStore::connect_cluster_with(&nodes, None).await;
        }
        #[cfg(feature = "sentinel")]
        Target::Sentinel(config) => {
            #[cfg(feature = "tls")]
            let config = match tls {
                Some(tls) => config.tls(tls),
                None => config,
            };
            RedisStore::connect_sentinel_with(&config, background).await
        }
    }
}

impl fmt::Debug for RedisConnect {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        // Never a URL: it may hold a password.
        let target = match &self.target {
            Some(target) => target.kind.name(),
            None => "connecting",
        };
        f.debug_struct("RedisConnect")
            .field("target", &target)
            .field("background", &self.background)
            .finish()
    }
}

/// The settings of every connection manager the store makes.
fn manager_config() -> ConnectionManagerConfig {
    ConnectionManagerConfig::new()
        .set_number_of_retries(2)
        .set_min_delay(Duration::from_millis(50))
        .set_max_delay(Duration::from_millis(250))
        .set_connection_timeout(Some(CONNECTION_TIMEOUT))
        .set_response_timeout(Some(RESPONSE_TIMEOUT))
}

impl RedisStore {
    /// Connects to `target`: a URL (`redis://[[user]:password@]host:port[/db]`, or
    /// `rediss://...` for TLS with feature `tls`) or a [`RedisTarget`] (one node, a
    /// cluster, Sentinel; with a private CA or a client certificate). With an ACL user,
    /// see [ACL users](crate::guide::redis#acl-users) for the least privilege tollgate needs. A connection made some other
    /// way is taken by [`from_manager`](Self::from_manager) or
    /// [`from_pool`](Self::from_pool).
    ///
    /// The connection reconnects by itself: after Redis restarts, the first call that
    /// finds the connection broken starts a new one. A connection attempt gives up after
    /// about a second, so that a Redis that is down fails calls quickly and the layer's
    /// [`FailurePolicy`](crate::FailurePolicy) answers them.
    ///
    /// Awaiting the [`RedisConnect`] connects; with
    /// [`in_background`](RedisConnect::in_background) a Redis (or sentinels, or a
    /// master) that is not up yet does not stop the service from starting.
    ///
    /// ```no_run
    /// # #[cfg(all(feature = "cluster", feature = "sentinel", feature = "tls"))]
    /// # async fn run() -> Result<(), Box<dyn std::error::Error>> {
    /// use tollgate::store::{RedisStore, RedisTarget, SentinelConfig, TlsConfig};
    ///
    /// let one = RedisStore::connect("redis://127.0.0.1:6379").await?;
    /// let tls = TlsConfig::new()
    ///     .with_ca_pem(std::fs::read("ca.crt")?)
    ///     .with_client_cert_pem(std::fs::read("client.crt")?, std::fs::read("client.key")?);
    /// let private_ca =
    ///     RedisStore::connect(RedisTarget::node("rediss://redis.internal:6380").with_tls(tls)).await?;
    /// let cluster = RedisStore::connect(RedisTarget::cluster(&["redis://10.0.0.1:7000"])).await?;
    /// let sentinels = ["redis://10.0.0.1:26379", "redis://10.0.0.2:26379"];
    /// let followed = RedisStore::connect(SentinelConfig::new(&sentinels, "mymaster")).await?;
    /// # Ok(()) }
    /// ```
    ///
    /// # Errors
    ///
    /// When a URL is invalid (also: `rediss://` without the `tls` feature, or a plain
    /// URL with [`with_tls`](RedisTarget::with_tls)), a PEM does not parse, the server's
    /// certificate is not trusted, or Redis (no node, no sentinel) cannot be reached now.
    pub fn connect(target: impl Into<RedisTarget>) -> RedisConnect {
        RedisConnect {
            target: Some(target.into()),
            background: false,
            running: None,
        }
    }

    /// The store over an auto-reconnecting connection manager for `client`, with the
    /// script loaded; `background`: see [`RedisConnect::in_background`].
    async fn connect_client(client: redis::Client, background: bool) -> Result<Self, StoreError> {
        let connected = async {
            let mut manager = ConnectionManager::new_with_config(client.clone(), manager_config())
                .await
                .map_err(store_error)?;
            let store = Self::from_manager(manager.clone());
            // Loaded now, the first burst of calls does not all meet a missing function
            // (or NOSCRIPT) at once.
            load(&store.connection.mode, &mut manager).await?;
            Ok(store)
        }
        .await;
        let store = match connected {
            Ok(store) => store,
            Err(error) if background && unreachable(&error) => {
                // Connects on first use, which the background task makes.
                let manager =
                    ConnectionManager::new_lazy_with_config(client.clone(), manager_config())
                        .map_err(store_error)?;
                let store = Self::from_manager(manager);
                store.connection.connect_in_background(&error);
                store
            }
            Err(error) => return Err(error),
        };
        Ok(store.with_reset_source(ResetNodes::Fixed(Arc::new([client]))))
    }

    /// The store over a cluster client for `nodes`, with the script loaded.
    #[cfg(feature = "cluster")]
    async fn connect_cluster_with(
        nodes: &[&str],
        #[cfg_attr(not(feature = "tls"), allow(unused_variables))] tls: Option<&TlsConfig>,
    ) -> Result<Self, StoreError> {
        for node in nodes {
            check_scheme(node)?;
        }
        let builder = redis::cluster::ClusterClient::builder(nodes.iter().copied())
            .retries(2)
            .min_retry_wait(50)
            .max_retry_wait(250)
            .connection_timeout(CONNECTION_TIMEOUT)
            // The retries follow redirections and reconnect; a call whose answer timed out
            // may have counted and must not be sent again: the whole call, retries
            // included, has the time of one answer (redis-rs's default, made explicit).
            .response_timeout(RESPONSE_TIMEOUT)
            .overall_response_timeout(Some(RESPONSE_TIMEOUT));
        #[cfg(feature = "tls")]
        let builder = match tls {
            Some(tls) => builder.certs(tls.certificates()),
            None => builder,
        };
        let client = builder.build().map_err(store_error)?;
        let mut connection = client.get_async_connection().await.map_err(store_error)?;
        let store = Self::new(Link::Cluster(connection.clone()).into());
        load(&store.connection.mode, &mut connection).await?;
        // Resets are published cluster-wide: any one node hears them.
        let listen = nodes
            .iter()
            .filter_map(|node| {
                #[cfg(feature = "tls")]
                if let Some(tls) = tls {
                    return redis::Client::build_with_tls(*node, tls.certificates()).ok();
                }
                redis::Client::open(*node).ok()
            })
            .collect();
        let template =
            redis::IntoConnectionInfo::into_connection_info(*nodes.first().ok_or_else(|| {
                StoreError::new(StoreErrorKind::Response, "no cluster nodes given")
            })?)
            .map_err(store_error)?;
        let masters = super::nodes::Nodes::new(template, tls.cloned(), connection);
        let mut store = store;
        store.masters = Some(Arc::new(masters));
        Ok(store.with_reset_source(ResetNodes::Fixed(listen)))
    }

    /// The store following a Sentinel's master; `background`: see
    /// [`RedisConnect::in_background`].
    #[cfg(feature = "sentinel")]
    async fn connect_sentinel_with(
        config: &SentinelConfig,
        background: bool,
    ) -> Result<Self, StoreError> {
        let sentinel = SentinelConnection::new(config)?;
        // Found now, so that a wrong name or unreachable sentinels fail at startup.
        let unreached = match sentinel.connect().await {
            Ok(()) => None,
            Err(error) if background && unreachable(&error) => Some(error),
            Err(error) => return Err(error),
        };
        let sentinel = Arc::new(sentinel);
        sentinel.watch_in_background();
        // Resets are heard on whichever master the sentinels name (a PUBLISH on the master
        // also reaches its replicas, so a subscription to a demoted one still hears it).
        let nodes = ResetNodes::Sentinel(sentinel.clone());
        let store = Self::new(Link::Sentinel(sentinel).into());
        if let Some(error) = unreached {
            store.connection.connect_in_background(&error);
        }
        Ok(store.with_reset_source(nodes))
    }
}
