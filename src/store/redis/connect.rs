//! Connecting to Redis as it is run: one node or a cluster, over TLS (`rediss://`, a
//! custom CA, client certificates) with feature `tls`, as an ACL user named in the URL.

use std::{
    fmt,
    future::Future,
    pin::Pin,
    sync::{Arc, Weak},
    task::{Context, Poll, ready},
    time::Duration,
};

use futures_util::future::BoxFuture;
use redis::aio::{ConnectionManager, ConnectionManagerConfig};

#[cfg(feature = "sentinel")]
use super::SentinelConfig;
use super::{Connection, Link, RedisStore, SCRIPT, function::Mode, invalidate::Nodes, store_error};
use crate::{StoreError, StoreErrorKind};

/// How long one connection attempt may take: a Redis that is down fails calls quickly and
/// the layer's failure policy answers them.
pub(super) const CONNECTION_TIMEOUT: Duration = Duration::from_millis(500);
/// How long a command may wait for its answer.
pub(super) const RESPONSE_TIMEOUT: Duration = Duration::from_secs(1);
/// The first wait between attempts to connect in the background, doubled after each
/// failure up to [`LAST_RETRY`]: a Redis that comes up is used within about two seconds,
/// and one that stays down costs a connection attempt every two seconds.
const FIRST_RETRY: Duration = Duration::from_millis(100);
const LAST_RETRY: Duration = Duration::from_secs(2);

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
    pub(super) fn client(client: Result<redis::Client, StoreError>) -> Self {
        Self {
            target: Some(Target::Client(client)),
            background: false,
            running: None,
        }
    }

    #[cfg(feature = "cluster")]
    pub(super) fn cluster<N: AsRef<str>>(nodes: &[N], tls: Option<&TlsConfig>) -> Self {
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
    pub(super) fn sentinel(config: &SentinelConfig) -> Self {
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

/// Whether `error` says Redis could not be reached (rather than that it refused us).
pub(super) fn unreachable(error: &StoreError) -> bool {
    matches!(
        error.kind(),
        StoreErrorKind::Unavailable | StoreErrorKind::Timeout
    )
}

impl Connection {
    /// Marks this connection as not connected yet (every call fails at once, see
    /// [`Connection::ready`]) and makes the first connection in the background, with
    /// backoff; `error` is why the attempt at start failed.
    pub(super) fn connect_in_background(&self, error: &StoreError) {
        tracing::warn!(
            error = %error.chain(),
            "tollgate: Redis is not reachable at start; connecting in the background. \
             Until it connects, every rate limit decision fails at once and each layer's \
             failure policy answers it"
        );
        self.mode.set_connecting(true);
        self.keep_connecting();
    }

    /// Starts the task that makes the first connection unless it runs: it dies with the
    /// runtime it ran on, and a store used on another runtime since must not wait
    /// forever. Without a runtime here, the next call on one starts it.
    #[cold]
    pub(super) fn keep_connecting(&self) {
        let Ok(runtime) = tokio::runtime::Handle::try_current() else {
            return;
        };
        if !self.mode.claim_connector() {
            return;
        }
        let running = Running(Arc::downgrade(&self.mode));
        runtime.spawn(connect_later(self.link.clone(), running));
    }
}

/// Held by the connecting task: frees its place when the task ends, also when its
/// runtime shuts down.
struct Running(Weak<Mode>);

impl Drop for Running {
    fn drop(&mut self) {
        if let Some(mode) = self.0.upgrade() {
            mode.release_connector();
        }
    }
}

/// Tries to make the first connection over `link` until it succeeds or the store is gone.
async fn connect_later(link: Link, running: Running) {
    let mode = &running.0;
    let mut delay = FIRST_RETRY;
    loop {
        tokio::time::sleep(delay).await;
        let Some(mode) = mode.upgrade() else {
            return;
        };
        match first_connection(&link, &mode).await {
            Ok(()) => {
                mode.set_connecting(false);
                tracing::info!("tollgate: connected to Redis; decisions are made there now");
                return;
            }
            Err(error) if unreachable(&error) => {
                tracing::debug!(error = %error.chain(), "tollgate: Redis still unreachable");
            }
            Err(error) => {
                // Reachable, but it refused us (a password, an ACL): worth every line.
                tracing::warn!(error = %error.chain(), "tollgate: Redis refused the store; retrying");
            }
        }
        delay = (delay * 2).min(LAST_RETRY);
    }
}

/// Connects `link` and loads what calls need there (the library or the script).
async fn first_connection(link: &Link, mode: &Mode) -> Result<(), StoreError> {
    match link {
        Link::Manager(manager) => load(mode, &mut manager.clone()).await,
        #[cfg(feature = "sentinel")]
        Link::Sentinel(sentinel) => sentinel.connect().await,
        // Never started in the background.
        #[allow(unreachable_patterns)]
        _ => Ok(()),
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

/// Loads the library (every master of a cluster), or the script where Redis has no
/// functions for this user.
async fn load<C: redis::aio::ConnectionLike>(
    mode: &Mode,
    connection: &mut C,
) -> Result<(), StoreError> {
    mode.load(connection).await.map_err(store_error)?;
    if !mode.functions() {
        SCRIPT.load_async(connection).await.map_err(store_error)?;
    }
    Ok(())
}

/// A client for `url`; `rediss://` without the `tls` feature is refused with a message
/// that names the feature (redis-rs's own says only "the feature is not enabled").
pub(super) fn open(url: &str) -> Result<redis::Client, StoreError> {
    check_scheme(url)?;
    redis::Client::open(url).map_err(store_error)
}

/// Refuses `rediss://` in a build without TLS; installs the TLS crypto provider in one
/// with it.
pub(super) fn check_scheme(url: &str) -> Result<(), StoreError> {
    let tls = url
        .trim_start()
        .get(..9)
        .is_some_and(|scheme| scheme.eq_ignore_ascii_case("rediss://"));
    if tls && !cfg!(feature = "tls") {
        return Err(StoreError::new(
            StoreErrorKind::Response,
            "a rediss:// URL needs TLS: build tollgate with its `tls` feature \
             (features = [\"tls\"])",
        ));
    }
    #[cfg(feature = "tls")]
    install_crypto_provider();
    Ok(())
}

/// rustls needs one process-wide crypto provider; ring's is installed unless the
/// application installed one first (then that one is used).
#[cfg(feature = "tls")]
fn install_crypto_provider() {
    if rustls::crypto::CryptoProvider::get_default().is_none() {
        // Err: another thread installed one meanwhile, which is as good.
        let _ = rustls::crypto::ring::default_provider().install_default();
    }
}

impl RedisStore {
    /// The store over an auto-reconnecting connection manager for `client`, with the
    /// script loaded; `background`: see [`RedisConnect::in_background`].
    pub(super) async fn connect_client(
        client: redis::Client,
        background: bool,
    ) -> Result<Self, StoreError> {
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
        Ok(store.with_reset_source(Nodes::Fixed(Arc::new([client]))))
    }

    /// The store over a cluster client for `nodes`, with the script loaded.
    #[cfg(feature = "cluster")]
    pub(super) async fn connect_cluster_with(
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
        let store = Self::new(super::Link::Cluster(connection.clone()).into());
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
        Ok(store.with_reset_source(Nodes::Fixed(listen)))
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

/// No TLS in this build: nothing can be passed where TLS settings go.
#[cfg(all(feature = "cluster", not(feature = "tls")))]
#[derive(Debug, Clone)]
pub(super) enum TlsConfig {}

/// The certificates of a TLS connection to Redis (feature `tls`): the CA that signed the
/// server's certificate (the system's roots when none is set) and, for servers that ask
/// for one, the client's certificate and key. All in PEM.
#[cfg(feature = "tls")]
#[derive(Clone, Default)]
pub struct TlsConfig {
    ca: Option<Vec<u8>>,
    client: Option<(Vec<u8>, Vec<u8>)>,
}

#[cfg(feature = "tls")]
impl TlsConfig {
    /// Trusts the system's root certificates and presents no client certificate.
    pub fn new() -> Self {
        Self::default()
    }

    /// Trusts only the CA certificate(s) in `pem` (a private CA, as managed Redis
    /// services and self-signed setups use).
    pub fn with_ca_pem(mut self, pem: impl Into<Vec<u8>>) -> Self {
        self.ca = Some(pem.into());
        self
    }

    /// Presents the certificate chain `cert_pem` with its private key `key_pem` (for
    /// `tls-auth-clients yes`).
    pub fn with_client_cert_pem(
        mut self,
        cert_pem: impl Into<Vec<u8>>,
        key_pem: impl Into<Vec<u8>>,
    ) -> Self {
        self.client = Some((cert_pem.into(), key_pem.into()));
        self
    }

    pub(super) fn certificates(&self) -> redis::TlsCertificates {
        redis::TlsCertificates {
            client_tls: self
                .client
                .as_ref()
                .map(|(cert, key)| redis::ClientTlsConfig {
                    client_cert: cert.clone(),
                    client_key: key.clone(),
                }),
            root_cert: self.ca.clone(),
        }
    }
}

#[cfg(feature = "tls")]
impl std::fmt::Debug for TlsConfig {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        // Never the key; whether each part is set is what helps.
        f.debug_struct("TlsConfig")
            .field("ca", &self.ca.is_some())
            .field("client_cert", &self.client.is_some())
            .finish()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn rediss_names_the_feature_when_tls_is_off() {
        let result = check_scheme("rediss://127.0.0.1:6380");
        if cfg!(feature = "tls") {
            assert!(result.is_ok());
        } else {
            let error = result.unwrap_err();
            let message = std::error::Error::source(&error).unwrap().to_string();
            assert!(message.contains("`tls` feature"), "{message}");
        }
        assert!(check_scheme("redis://127.0.0.1:6379").is_ok());
    }
}
