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

/// A connection to Redis about to be made: what [`RedisStore::connect`] and the other
/// `connect_*` constructors return. Awaiting it connects.
///
/// By default a Redis that cannot be reached fails the await, so that a wrong address is
/// seen at start. [`in_background`](Self::in_background) starts the service anyway.
#[must_use = "nothing connects until it is awaited"]
pub struct RedisConnect {
    /// Taken when first polled.
    target: Option<Target>,
    background: bool,
    running: Option<BoxFuture<'static, Result<RedisStore, StoreError>>>,
}

/// What to connect to.
enum Target {
    Client(Result<redis::Client, StoreError>),
    #[cfg(feature = "cluster")]
    Cluster {
        nodes: Vec<String>,
        tls: Option<TlsConfig>,
    },
    #[cfg(feature = "sentinel")]
    Sentinel(SentinelConfig),
}

impl RedisConnect {
    fn client(client: Result<redis::Client, StoreError>) -> Self {
        Self {
            target: Some(Target::Client(client)),
            background: false,
            running: None,
        }
    }

    #[cfg(feature = "cluster")]
    fn cluster<N: AsRef<str>>(nodes: &[N], tls: Option<&TlsConfig>) -> Self {
        Self {
            target: Some(Target::Cluster {
                nodes: nodes.iter().map(|n| n.as_ref().to_owned()).collect(),
                tls: tls.cloned(),
            }),
            background: false,
            running: None,
        }
    }

    #[cfg(feature = "sentinel")]
    fn sentinel(config: &SentinelConfig) -> Self {
        Self {
            target: Some(Target::Sentinel(config.clone())),
            background: false,
            running: None,
        }
    }

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
    /// is built): `connect_cluster(..).in_background(true)` fails the await.
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
async fn connect(target: Target, background: bool) -> Result<RedisStore, StoreError> {
    match target {
        Target::Client(client) => RedisStore::connect_client(client?, background).await,
        #[cfg(feature = "cluster")]
        Target::Cluster { nodes, tls } => {
            if background {
                return Err(StoreError::new(
                    StoreErrorKind::Unsupported,
                    "in_background: a Redis Cluster must be reachable at start \
                     (redis-rs's cluster client connects when it is built)",
                ));
            }
            let nodes: Vec<&str> = nodes.iter().map(String::as_str).collect();
            RedisStore::connect_cluster_with(&nodes, tls.as_ref()).await
        }
        #[cfg(feature = "sentinel")]
        Target::Sentinel(config) => RedisStore::connect_sentinel_with(&config, background).await,
    }
}

impl fmt::Debug for RedisConnect {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        // Never a URL: it may hold a password.
        let target = match &self.target {
            Some(Target::Client(_)) => "redis",
            #[cfg(feature = "cluster")]
            Some(Target::Cluster { .. }) => "cluster",
            #[cfg(feature = "sentinel")]
            Some(Target::Sentinel(_)) => "sentinel",
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
    /// Connects to the Redis at `url`: `redis://[[user]:password@]host:port[/db]`, or
    /// `rediss://...` for TLS (feature `tls`; the system's root certificates are trusted,
    /// see [`connect_tls`](Self::connect_tls) for a private CA or a client certificate).
    /// With an ACL user, see [ACL users](crate::guide::redis#acl-users) for the least
    /// privilege tollgate needs.
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
        RedisConnect::client(open(url))
    }

    /// Connects to a Redis Cluster through any of its `nodes` (feature `cluster`).
    ///
    /// Every key of one decision shares a hash tag, so each script runs on the one master
    /// that owns the key's slot; different keys spread over all masters. `MOVED` and `ASK`
    /// redirections (failover, resharding) are followed by redis-rs, and the script is
    /// loaded on every master on `NOSCRIPT`. Coalesced decisions are grouped by slot, and
    /// the calls of the slots one master owns go to it together, in one pipeline (see
    /// [Redis Cluster](crate::guide::cluster)).
    ///
    /// # Errors
    ///
    /// When a URL is invalid or no node can be reached now.
    #[cfg(feature = "cluster")]
    pub fn connect_cluster<N: AsRef<str>>(nodes: &[N]) -> RedisConnect {
        RedisConnect::cluster(nodes, None)
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

    /// Connects to the master that Redis Sentinel names `master_name` (feature
    /// `sentinel`), and follows it through failovers.
    ///
    /// When the master's connection breaks or it answers `READONLY` (it was demoted), the
    /// next call asks the sentinels again and connects to the new master, loading the
    /// script there; decisions meanwhile fail and the layer's
    /// [`FailurePolicy`](crate::FailurePolicy) answers them. Replication is asynchronous,
    /// so counts the old master had not yet sent to its replica are lost at a failover.
    ///
    /// With [`in_background`](RedisConnect::in_background), sentinels or a master that
    /// cannot be reached yet do not stop the service from starting.
    ///
    /// # Errors
    ///
    /// When a URL is invalid, no sentinel answers, or the master cannot be reached now.
    #[cfg(feature = "sentinel")]
    pub fn connect_sentinel(config: &SentinelConfig) -> RedisConnect {
        RedisConnect::sentinel(config)
    }

    /// [`connect_sentinel`](Self::connect_sentinel); `background`: see
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

    /// Connects to the Redis at `url` (`rediss://[user:password@]host:port[/db]`) over TLS,
    /// trusting the CA and presenting the client certificate in `tls` (feature `tls`).
    ///
    /// [`connect`](Self::connect) takes `rediss://` URLs too, trusting the system's root
    /// certificates; this is for a private CA and for servers that ask for a client
    /// certificate (`tls-auth-clients yes`).
    ///
    /// ```no_run
    /// # async fn run() -> Result<(), Box<dyn std::error::Error>> {
    /// use tollgate::store::{RedisStore, TlsConfig};
    ///
    /// let tls = TlsConfig::new()
    ///     .with_ca_pem(std::fs::read("ca.crt")?)
    ///     .with_client_cert_pem(std::fs::read("client.crt")?, std::fs::read("client.key")?);
    /// let store = RedisStore::connect_tls("rediss://tollgate:secret@redis.internal:6380", &tls).await?;
    /// # Ok(()) }
    /// ```
    ///
    /// # Errors
    ///
    /// When the URL is not `rediss://`, a PEM does not parse, the server's certificate is
    /// not trusted, or Redis cannot be reached now.
    #[cfg(feature = "tls")]
    pub fn connect_tls(url: &str, tls: &TlsConfig) -> RedisConnect {
        RedisConnect::client(check_scheme(url).and_then(|()| {
            redis::Client::build_with_tls(url, tls.certificates()).map_err(store_error)
        }))
    }

    /// Connects to a Redis Cluster through any of its `rediss://` `nodes` over TLS, with
    /// the CA and client certificate in `tls` (features `cluster` and `tls`). See
    /// [`connect_cluster`](Self::connect_cluster).
    ///
    /// # Errors
    ///
    /// When a URL is invalid, a PEM does not parse, or no node can be reached now.
    #[cfg(all(feature = "cluster", feature = "tls"))]
    pub fn connect_cluster_tls<N: AsRef<str>>(nodes: &[N], tls: &TlsConfig) -> RedisConnect {
        RedisConnect::cluster(nodes, Some(tls))
    }
}
