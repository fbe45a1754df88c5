//! Building the gateway from a validated config, serving it, and stopping it gracefully.

use std::{
    future::Future,
    io,
    net::SocketAddr,
    path::PathBuf,
    sync::{
        Arc, Mutex,
        atomic::{AtomicU64, Ordering},
    },
    time::Duration,
};

use arc_swap::ArcSwap;
use axum::{Router, routing::get};
use metrics_exporter_prometheus::{Matcher, PrometheusBuilder, PrometheusHandle};
use tokio::{net::TcpListener, sync::watch, task::JoinHandle};
use tollgate::{
    FailurePolicy,
    store::{MemoryStore, Permits, Store},
};

pub(crate) use crate::routes::Gateway;
use crate::{
    admin,
    config::{Backend, Config, ConfigError, Route, SentinelBackend, StoreConfig},
    front::Front,
    proxy,
    reload::{self, Watcher},
    routes::Lasting,
    serve::{self, ConnectionLimits, Workers, serve},
    traffic,
};

/// Startup errors (a store that cannot be reached, an address in use, ...).
pub(crate) type Error = Box<dyn std::error::Error + Send + Sync>;

/// Bucket bounds of `tollgate_decision_seconds`: 50 us to 1 s.
const DECISION_BUCKETS: &[f64] = &[
    0.000_05, 0.000_1, 0.000_25, 0.000_5, 0.001, 0.002_5, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5,
    1.0,
];

/// What a reload changes: the route table (with its limits), swapped atomically, and
/// what it was built from.
pub(crate) struct Live {
    /// Each request reads it once: it is routed and limited under one config.
    gateway: ArcSwap<Gateway>,
    /// The running config: what a reload is compared with.
    config: Mutex<Config>,
    /// The store, the in-flight permits, the local fallback and the upstream client:
    /// kept across reloads.
    lasting: Lasting,
    version: AtomicU64,
    /// The routes of the last good rule set from Redis (`[rules] source = "redis"`):
    /// they replace the file's routes, also when the file is reloaded.
    redis_routes: Mutex<Option<Vec<Route>>>,
}

impl std::fmt::Debug for Live {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Live")
            .field("version", &self.version())
            .finish_non_exhaustive()
    }
}

impl Live {
    /// The route table in force.
    pub(crate) fn gateway(&self) -> Arc<Gateway> {
        self.gateway.load_full()
    }

    /// The route table in force, for one request (no reference count taken).
    pub(crate) fn routes(&self) -> arc_swap::Guard<Arc<Gateway>> {
        self.gateway.load()
    }

    /// The admin bearer token in force (`admin_token_env`), if any.
    pub(crate) fn admin_token(&self) -> Option<Vec<u8>> {
        let config = self.config.lock().unwrap_or_else(|e| e.into_inner());
        config.admin_token.as_ref().map(|t| t.0.clone())
    }

    /// Whether `admin_listen` is a loopback address (it never changes on a reload).
    pub(crate) fn admin_on_loopback(&self) -> bool {
        let config = self.config.lock().unwrap_or_else(|e| e.into_inner());
        config.admin_listen.is_some_and(|a| a.ip().is_loopback())
    }

    /// The version of the config in force: 1 as started, one more per applied reload.
    pub(crate) fn version(&self) -> u64 {
        self.version.load(Ordering::Relaxed)
    }

    /// Applies the routes of a validated rule set from Redis. Returns the new version.
    #[cfg_attr(not(feature = "redis"), allow(dead_code))]
    pub(crate) fn apply_routes(&self, routes: Vec<Route>) -> Result<u64, ConfigError> {
        let mut new = self
            .config
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .clone();
        new.routes = routes.clone();
        let version = self.apply_routes_of(new)?;
        // Kept only once applied: a refused rule set leaves the last good one in force.
        *self.redis_routes.lock().unwrap_or_else(|e| e.into_inner()) = Some(routes);
        Ok(version)
    }

    /// Applies a validated config to the next requests, keeping (with a warning) what
    /// only a restart changes. Returns the new version, or why it is refused (a change
    /// that a reload cannot make: the running config stays).
    pub(crate) fn apply(&self, mut new: Config) -> Result<u64, ConfigError> {
        if let Some(routes) = &*self.redis_routes.lock().unwrap_or_else(|e| e.into_inner()) {
            new.routes = routes.clone();
        }
        self.apply_routes_of(new)
    }

    /// [`apply`](Self::apply) with `new`'s routes as they are.
    fn apply_routes_of(&self, mut new: Config) -> Result<u64, ConfigError> {
        let mut running = self.config.lock().unwrap_or_else(|e| e.into_inner());
        adaptive_unchanged(&running.routes, &new.routes)?;
        let restart = |field: &str| {
            tracing::warn!(
                field,
                "config reload: {field} changed, which needs a restart; the running value stays"
            );
        };
        if new.listen != running.listen {
            restart("listen");
        }
        if new.admin_listen != running.admin_listen {
            restart("admin_listen");
        }
        if new.server != running.server {
            restart("[server]");
        }
        if new.store.backend != running.store.backend {
            restart("store.backend (and its url or nodes)");
        }
        if new.store.prefix != running.store.prefix {
            restart("store.prefix");
        }
        if new.store.leases != running.store.leases {
            restart("store.leases");
        }
        if new.store.background != running.store.background {
            restart("store.connect");
        }
        if new.rules != running.rules {
            restart("[rules]");
        }
        new.listen = running.listen;
        new.admin_listen = running.admin_listen;
        new.server = running.server.clone();
        new.store.backend = running.store.backend.clone();
        new.store.prefix = running.store.prefix.clone();
        new.store.leases = running.store.leases.clone();
        new.store.background = running.store.background;
        new.rules = running.rules.clone();
        warn_about_exposure(&new, Some(&running));
        let (gateway, reuse) = Gateway::build(&new, &self.lasting, Some(&self.gateway.load()));
        // Limits whose state carries over keep their store keys with new parameters: a
        // store that remembers limits (the memory store's expiry) learns them.
        let limits: Vec<tollgate::Limit> = new
            .routes
            .iter()
            .flat_map(|route| route.limits.iter().map(|l| l.limit.clone()))
            .collect();
        self.lasting.store.limits_changed(&limits);
        if let FailurePolicy::Local(local) = &self.lasting.local {
            local.limits_changed(&limits);
        }
        self.gateway.store(Arc::new(gateway));
        let version = self.version.fetch_add(1, Ordering::Relaxed) + 1;
        metrics::gauge!(reload::RULES_VERSION).set(version as f64);
        reload::applied();
        tracing::info!(
            version,
            routes = new.routes.len(),
            kept = reuse.kept,
            rebuilt = reuse.rebuilt,
            "config reloaded"
        );
        *running = new;
        Ok(version)
    }
}

/// A reload cannot change a running route's `[routes.adaptive]` (added, removed or
/// changed): the adaptive limit's state is the layer's, which a [`RulesHandle`] swap
/// keeps as it is. Refused naming the section; a route whose `path` is new may have one.
///
/// [`RulesHandle`]: tollgate::rules::RulesHandle
fn adaptive_unchanged(running: &[Route], new: &[Route]) -> Result<(), ConfigError> {
    for (index, route) in new.iter().enumerate() {
        let Some(old) = running.iter().find(|old| old.path == route.path) else {
            continue;
        };
        if old.adaptive != route.adaptive {
            let what = match (&old.adaptive, &route.adaptive) {
                (None, _) => "added",
                (_, None) => "removed",
                _ => "changed",
            };
            return Err(ConfigError::new(
                format!("routes[{index}].adaptive"),
                format!(
                    "{what} on the running route {:?}: the adaptive limit cannot change on a \
                     reload (restart the gateway to change it)",
                    route.path
                ),
            ));
        }
    }
    Ok(())
}

/// A started gateway. Dropping it shuts the servers down gracefully in the background.
#[derive(Debug)]
pub(crate) struct Running {
    addr: SocketAddr,
    admin_addr: Option<SocketAddr>,
    shutdown: watch::Sender<bool>,
    tasks: Vec<JoinHandle<()>>,
    live: Arc<Live>,
    leased: Leased,
}

/// The Redis store whose leased units a shutdown gives back (`store.leases` on).
#[derive(Debug, Default)]
pub(crate) struct Leased(#[cfg(feature = "redis")] Option<tollgate::store::RedisStore>);

impl Leased {
    /// Gives the leased units back to Redis, so that the other gateways can spend them.
    async fn release(self) {
        #[cfg(feature = "redis")]
        if let Some(store) = self.0 {
            match store.release_leases().await {
                Ok(()) => tracing::info!("leased units returned to redis"),
                Err(error) => tracing::warn!(%error, "could not return leased units to redis"),
            }
        }
    }
}

impl Running {
    /// The address the gateway listens on (with the real port when `listen` had port 0).
    pub(crate) fn addr(&self) -> SocketAddr {
        self.addr
    }

    /// The address `/metrics` is served on, if any.
    pub(crate) fn admin_addr(&self) -> Option<SocketAddr> {
        self.admin_addr
    }

    /// The version of the config in force (1 as started).
    #[allow(dead_code)] // for tests/gateway_reload.rs
    pub(crate) fn version(&self) -> u64 {
        self.live.version()
    }

    /// What a reload changes, for a [`Watcher`] of one's own.
    #[allow(dead_code)] // for tests/gateway_reload.rs
    pub(crate) fn live(&self) -> Arc<Live> {
        self.live.clone()
    }

    /// Reloads the config from `path` on SIGHUP and whenever its contents change (read
    /// every `every`), until the gateway stops. See [`reload`].
    pub(crate) fn watch(&mut self, path: PathBuf, every: Duration) {
        let watcher = Watcher::new(path, self.live.clone());
        let stop = self.shutdown.subscribe();
        self.tasks.push(tokio::spawn(watcher.run(every, stop)));
    }

    /// Stops accepting connections, lets the requests in flight finish for up to
    /// `server.shutdown_timeout`, closes the connections still open after that, and
    /// returns when every connection is closed.
    pub(crate) async fn stop(self) -> io::Result<()> {
        self.shutdown.send_replace(true);
        for task in self.tasks {
            task.await.map_err(io::Error::other)?;
        }
        self.leased.release().await;
        Ok(())
    }

    /// Serves until `signal` resolves, then stops gracefully (see [`stop`](Self::stop)).
    /// The server never ends on its own: it retries failed accepts.
    pub(crate) async fn run_until(self, signal: impl Future<Output = ()>) -> io::Result<()> {
        signal.await;
        tracing::info!("shutting down: waiting for the requests in flight");
        self.stop().await
    }
}

/// Connects the store, builds every route, binds the listeners and starts serving.
/// Warns about a config that works but exposes what it should not: admin endpoints that
/// anyone on a network may use, proxies trusted for every address, or (on a reload,
/// `previous` the config before it) a token that went away.
fn warn_about_exposure(config: &Config, previous: Option<&Config>) {
    if let Some(admin) = config.admin_listen
        && config.admin_token.is_none()
    {
        if previous.is_some_and(|p| p.admin_token.is_some()) {
            tracing::warn!(
                %admin,
                "config reload removed admin_token_env: the admin endpoints now read and reset \
                 budgets for anyone who reaches admin_listen"
            );
        } else if !admin.ip().is_loopback() {
            tracing::warn!(
                %admin,
                "admin_listen is not a loopback address and there is no admin_token_env: \
                 anyone who reaches it may read and reset budgets"
            );
        }
    }
    for net in config
        .trusted_proxies
        .iter()
        .filter(|net| net.prefix_len() == 0)
    {
        tracing::warn!(
            %net,
            "trusted_proxies holds every address: any client may write X-Forwarded-For and so \
             choose its own `ip` key"
        );
    }
}

pub(crate) async fn start(mut config: Config) -> Result<Running, Error> {
    warn_about_exposure(&config, None);
    let prometheus = config.admin_listen.map(|_| prometheus()).transpose()?;
    let (store, permits, leased) = connect_store(&config.store).await?;
    let follow = first_rule_set(&mut config, store.connecting()).await?;
    let lasting = Lasting {
        store,
        permits,
        local: FailurePolicy::local(),
        client: proxy::client(),
    };
    let (gateway, _) = Gateway::build(&config, &lasting, None);

    let listener = TcpListener::bind(config.listen)
        .await
        .map_err(|e| format!("listen: cannot bind {}: {e}", config.listen))?;
    let addr = listener.local_addr()?;
    let admin = match config.admin_listen {
        Some(admin) => {
            let listener = TcpListener::bind(admin)
                .await
                .map_err(|e| format!("admin_listen: cannot bind {admin}: {e}"))?;
            Some(listener)
        }
        None => None,
    };
    let admin_addr = admin.as_ref().map(TcpListener::local_addr).transpose()?;

    let (shutdown, signal) = watch::channel(false);
    let limits = ConnectionLimits {
        header_read_timeout: config.server.header_read_timeout,
        max_connections: config.server.max_connections,
        shutdown_timeout: config.server.shutdown_timeout,
        write_idle_timeout: config.server.write_idle_timeout,
    };
    metrics::describe_gauge!(
        reload::RULES_VERSION,
        "The version of the config in force: 1 at start, one more per applied reload."
    );
    metrics::describe_counter!(
        reload::RELOADS_REFUSED_TOTAL,
        metrics::Unit::Count,
        "Config reloads refused because the new file was invalid."
    );
    metrics::describe_counter!(
        reload::CONFIG_RELOADS_TOTAL,
        metrics::Unit::Count,
        "Config reloads (the file, or a rule set from Redis), by result: applied or refused."
    );
    metrics::describe_gauge!(
        reload::CONFIG_LAST_RELOAD_SUCCESS,
        metrics::Unit::Seconds,
        "Unix time the config in force was loaded: at start, then at each applied reload."
    );
    metrics::gauge!(reload::RULES_VERSION).set(1.0);
    reload::loaded();
    let routes = config.routes.len();
    let live = Arc::new(Live {
        gateway: ArcSwap::from_pointee(gateway),
        config: Mutex::new(config.clone()),
        lasting,
        version: AtomicU64::new(1),
        redis_routes: Mutex::new(follow.as_ref().and_then(|f| f.routes.clone())),
    });
    let front = {
        let live = live.clone();
        let max_body_bytes = config.server.max_body_bytes;
        move |peer| Front::new(live.clone(), peer, max_body_bytes)
    };
    let workers = Workers::per_core()?;
    let mut tasks = vec![tokio::spawn(serve(
        listener,
        front,
        limits,
        stopped(signal.clone()),
        Some(workers),
    ))];
    if let Some(follow) = follow {
        tasks.push(follow.spawn(live.clone(), signal.clone()));
    }
    if let (Some(listener), Some(handle)) = (admin, prometheus) {
        let admin_app = Router::new()
            .route("/metrics", get(move || async move { handle.render() }))
            .merge(admin::router(live.clone()));
        tasks.push(tokio::spawn(serve(
            listener,
            serve::router(admin_app),
            limits,
            stopped(signal),
            None,
        )));
    }
    tracing::info!(%addr, ?admin_addr, routes, "gateway started");
    Ok(Running {
        addr,
        admin_addr,
        shutdown,
        tasks,
        live,
        leased,
    })
}

/// How a gateway with `[rules] source = "redis"` follows the rule set.
struct Follow {
    #[cfg(feature = "redis")]
    location: crate::rules_source::Location,
    /// The version found at start, and its routes if they were good.
    seen: Option<u64>,
    routes: Option<Vec<Route>>,
    interval: Duration,
}

impl Follow {
    #[cfg(feature = "redis")]
    fn spawn(self, live: Arc<Live>, stop: watch::Receiver<bool>) -> JoinHandle<()> {
        let follower = crate::rules_source::Follower::new(self.location, live, self.seen);
        tokio::spawn(follower.run(self.interval, stop))
    }

    #[cfg(not(feature = "redis"))]
    fn spawn(self, _live: Arc<Live>, _stop: watch::Receiver<bool>) -> JoinHandle<()> {
        let _ = (self.seen, self.interval);
        tokio::spawn(async {})
    }
}

/// With `[rules] source = "redis"`: the rule set stored now replaces the file's routes
/// (when it is good), so that a new replica starts with the fleet's rules.
#[cfg(feature = "redis")]
async fn first_rule_set(
    config: &mut Config,
    store_connecting: bool,
) -> Result<Option<Follow>, Error> {
    use crate::rules_source::{Location, fetch};
    let Backend::Redis { url } = &config.store.backend else {
        return Ok(None);
    };
    if !config.rules.from_redis {
        return Ok(None);
    }
    let location = Location::new(url, &config.store.prefix);
    let client = redis::Client::open(url.as_str())?;
    let mut follow = Follow {
        location: location.clone(),
        seen: None,
        routes: None,
        interval: config.rules.check_interval,
    };
    if store_connecting {
        // `store.connect = "background"` and Redis is not up: the follower reads the rule
        // set once it is.
        tracing::warn!(
            "rules.source: redis is not reachable yet; serving the file's routes until the \
             rule set can be read"
        );
        return Ok(Some(follow));
    }
    let mut connection = redis::aio::ConnectionManager::new(client)
        .await
        .map_err(|e| format!("rules.source: cannot read the rule set from {url:?}: {e}"))?;
    match fetch(&mut connection, &location).await? {
        None => tracing::info!("no rule set in redis yet; serving the file's routes"),
        Some((version, Ok(routes))) => {
            tracing::info!(rules = version, "serving the rule set from redis");
            config.routes = routes.clone();
            follow.seen = Some(version);
            follow.routes = Some(routes);
        }
        Some((version, Err(error))) => {
            reload::refused();
            tracing::error!(rules = version, field = error.field, %error,
                "rule set from redis refused; serving the file's routes");
            follow.seen = Some(version);
        }
    }
    Ok(Some(follow))
}

#[cfg(not(feature = "redis"))]
async fn first_rule_set(
    _config: &mut Config,
    _store_connecting: bool,
) -> Result<Option<Follow>, Error> {
    // `rules.source = "redis"` needs `store.backend = "redis"`, refused without the feature.
    Ok(None)
}

/// Resolves when shutdown is asked for, or when the [`Running`] handle is dropped.
async fn stopped(mut signal: watch::Receiver<bool>) {
    let _ = signal.wait_for(|stop| *stop).await;
}

/// The store, as the rate limits and as the in-flight limits use it, and its leases.
type Connected = (Arc<dyn Store>, Arc<dyn Permits>, Leased);

async fn connect_store(config: &StoreConfig) -> Result<Connected, Error> {
    tracing::debug!(
        prefix = config.prefix,
        tls_files = config.tls.is_set(),
        "connecting the store"
    );
    match &config.backend {
        Backend::Memory => {
            let store = MemoryStore::new();
            Ok((Arc::new(store.clone()), Arc::new(store), Leased::default()))
        }
        Backend::Redis { url } => connect_redis(url, config).await,
        Backend::RedisCluster { nodes } => connect_redis_cluster(nodes, config).await,
        Backend::RedisSentinel(sentinel) => connect_redis_sentinel(sentinel, config).await,
    }
}

/// The `tollgate::store::TlsConfig` of `store.tls_*_file`, the files read now.
#[cfg(feature = "tls")]
fn tls_config(tls: &crate::config::StoreTls) -> Result<tollgate::store::TlsConfig, Error> {
    let read = |field: &str, path: &str| {
        std::fs::read(path).map_err(|e| format!("store.{field}: cannot read {path:?}: {e}"))
    };
    let mut config = tollgate::store::TlsConfig::new();
    if let Some(path) = &tls.ca_file {
        config = config.with_ca_pem(read("tls_ca_file", path)?);
    }
    if let (Some(cert), Some(key)) = (&tls.cert_file, &tls.key_file) {
        config =
            config.with_client_cert_pem(read("tls_cert_file", cert)?, read("tls_key_file", key)?);
    }
    Ok(config)
}

/// The store under `store.prefix`, with `store.leases`.
#[cfg(feature = "redis")]
fn with_prefix(
    store: tollgate::store::RedisStore,
    config: &StoreConfig,
) -> Result<Connected, Error> {
    let mut store = store
        .with_prefix(&config.prefix)
        .map_err(|e| format!("store.prefix: {e}"))?;
    let mut leased = Leased::default();
    if let Some(leases) = &config.leases {
        store = store.with_leases(leases.library()?);
        leased = Leased(Some(store.clone()));
    }
    Ok((Arc::new(store.clone()), Arc::new(store), leased))
}

#[cfg(feature = "redis")]
async fn connect_redis(url: &str, config: &StoreConfig) -> Result<Connected, Error> {
    let connecting = if config.tls.is_set() {
        #[cfg(feature = "tls")]
        {
            tollgate::store::RedisStore::connect(
                tollgate::store::RedisTarget::node(url).with_tls(tls_config(&config.tls)?),
            )
            .in_background(config.background)
            .await
        }
        #[cfg(not(feature = "tls"))]
        return Err("store.tls_ca_file: needs the gateway built with the tls feature".into());
    } else {
        tollgate::store::RedisStore::connect(url)
            .in_background(config.background)
            .await
    };
    let store = connecting.map_err(|e| {
        format!(
            "store.url: cannot connect to {:?}: {e}{}",
            redact(url),
            cause(&e)
        )
    })?;
    if !store.connecting() {
        tracing::info!(
            url = redact(url),
            prefix = config.prefix,
            "connected to redis"
        );
    }
    with_prefix(store, config)
}

/// `: <cause>` of a store error (its `Display` names only its own level).
#[cfg(feature = "redis")]
fn cause(error: &tollgate::StoreError) -> String {
    std::error::Error::source(error).map_or_else(String::new, |cause| format!(": {cause}"))
}

#[cfg(not(feature = "redis"))]
async fn connect_redis(_url: &str, _config: &StoreConfig) -> Result<Connected, Error> {
    // Config validation already refused this; kept for a clear message all the same.
    Err("store.backend: \"redis\" needs the gateway built with the redis feature".into())
}

#[cfg(feature = "cluster")]
async fn connect_redis_cluster(nodes: &[String], config: &StoreConfig) -> Result<Connected, Error> {
    let connecting = if config.tls.is_set() {
        #[cfg(feature = "tls")]
        {
            tollgate::store::RedisStore::connect(
                tollgate::store::RedisTarget::cluster(nodes).with_tls(tls_config(&config.tls)?),
            )
            .await
        }
        #[cfg(not(feature = "tls"))]
        return Err("store.tls_ca_file: needs the gateway built with the tls feature".into());
    } else {
        tollgate::store::RedisStore::connect(tollgate::store::RedisTarget::cluster(nodes)).await
    };
    let nodes: Vec<String> = nodes.iter().map(|n| redact(n)).collect();
    let store = connecting.map_err(|e| {
        format!(
            "store.nodes: cannot connect to the cluster at {nodes:?}: {e}{}",
            cause(&e)
        )
    })?;
    tracing::info!(?nodes, prefix = config.prefix, "connected to redis cluster");
    with_prefix(store, config)
}

#[cfg(not(feature = "cluster"))]
async fn connect_redis_cluster(
    _nodes: &[String],
    _config: &StoreConfig,
) -> Result<Connected, Error> {
    // Config validation already refused this; kept for a clear message all the same.
    Err("store.backend: \"redis-cluster\" needs the gateway built with the cluster feature".into())
}

#[cfg(feature = "sentinel")]
async fn connect_redis_sentinel(
    sentinel: &SentinelBackend,
    config: &StoreConfig,
) -> Result<Connected, Error> {
    let mut library =
        tollgate::store::SentinelConfig::new(&sentinel.sentinels, &sentinel.master_name);
    if let Some(password) = &sentinel.password {
        library = library.with_master_user(sentinel.username.as_deref(), password);
    }
    #[allow(unused_mut)]
    let mut target = tollgate::store::RedisTarget::sentinel(library);
    // TLS to the master when the sentinels are reached over TLS.
    if sentinel
        .sentinels
        .iter()
        .any(|s| s.starts_with("rediss://"))
    {
        #[cfg(feature = "tls")]
        {
            target = target.with_tls(tls_config(&config.tls)?);
        }
    }
    let sentinels: Vec<String> = sentinel.sentinels.iter().map(|n| redact(n)).collect();
    let store = tollgate::store::RedisStore::connect(target)
        .in_background(config.background)
        .await
        .map_err(|e| {
            format!(
                "store.sentinels: cannot find master {:?} through {sentinels:?}: {e}{}",
                sentinel.master_name,
                cause(&e)
            )
        })?;
    if !store.connecting() {
        tracing::info!(
            ?sentinels,
            master = sentinel.master_name,
            prefix = config.prefix,
            "connected to redis through sentinel"
        );
    }
    with_prefix(store, config)
}

#[cfg(not(feature = "sentinel"))]
async fn connect_redis_sentinel(
    _sentinel: &SentinelBackend,
    _config: &StoreConfig,
) -> Result<Connected, Error> {
    // Config validation already refused this; kept for a clear message all the same.
    Err(
        "store.backend: \"redis-sentinel\" needs the gateway built with the sentinel feature"
            .into(),
    )
}

/// `url` without its password, for logs and errors.
#[cfg(feature = "redis")]
fn redact(url: &str) -> String {
    match url.parse::<http::Uri>() {
        Ok(uri) if uri.authority().is_some_and(|a| a.as_str().contains('@')) => {
            let authority = uri.authority().map(|a| a.as_str()).unwrap_or_default();
            let (user, host) = authority.rsplit_once('@').unwrap_or_default();
            let user = user.split(':').next().unwrap_or_default();
            url.replacen(authority, &format!("{user}:***@{host}"), 1)
        }
        _ => url.to_owned(),
    }
}

/// The process's Prometheus recorder, installed on first use (tests start several
/// gateways in one process; there is one global recorder).
fn prometheus() -> Result<PrometheusHandle, Error> {
    static HANDLE: Mutex<Option<PrometheusHandle>> = Mutex::new(None);
    let mut handle = HANDLE.lock().unwrap_or_else(|e| e.into_inner());
    if let Some(handle) = &*handle {
        return Ok(handle.clone());
    }
    let installed = PrometheusBuilder::new()
        .set_buckets_for_metric(
            Matcher::Full(tollgate::metrics::DECISION_SECONDS.to_owned()),
            DECISION_BUCKETS,
        )?
        .set_buckets_for_metric(
            Matcher::Full(traffic::SERVER_DURATION.to_owned()),
            traffic::DURATION_BUCKETS,
        )?
        .set_buckets_for_metric(
            Matcher::Full(traffic::CLIENT_DURATION.to_owned()),
            traffic::DURATION_BUCKETS,
        )?
        .set_buckets_for_metric(
            Matcher::Full(traffic::SERVER_REQUEST_BODY.to_owned()),
            traffic::SIZE_BUCKETS,
        )?
        .set_buckets_for_metric(
            Matcher::Full(traffic::SERVER_RESPONSE_BODY.to_owned()),
            traffic::SIZE_BUCKETS,
        )?
        .install_recorder()
        .map_err(|e| format!("admin_listen: cannot install the Prometheus recorder: {e}"))?;
    tollgate::metrics::describe();
    traffic::describe();
    metrics::describe_counter!(
        proxy::UPSTREAM_ERRORS_TOTAL,
        metrics::Unit::Count,
        "Requests answered 502 because the upstream failed."
    );
    if !cfg!(feature = "metrics") {
        tracing::warn!(
            "built without tollgate's `metrics` feature: /metrics has no tollgate_requests_total \
             or tollgate_decision_seconds (cargo run -p tollgate-gateway --features metrics)"
        );
    }
    // Histograms are kept as raw samples until upkeep folds them into buckets.
    let upkeep = installed.clone();
    std::thread::Builder::new()
        .name("metrics-upkeep".into())
        .spawn(move || {
            loop {
                std::thread::sleep(Duration::from_secs(5));
                upkeep.run_upkeep();
            }
        })?;
    *handle = Some(installed.clone());
    Ok(installed)
}
