//! A store that follows the master Redis Sentinel names (feature `sentinel`).
//!
//! One multiplexed connection to the current master. When it breaks (the master died, or
//! Sentinel demoted it and closed its clients) or answers `READONLY`, it is dropped and the
//! next call asks the sentinels for the master again, loading the script there. Calls in
//! between fail fast and the layer's failure policy answers them. A background task also
//! asks the sentinels every [`WATCH_EVERY`]: after a `SENTINEL FAILOVER` the old master
//! stays up and writable for a while, and nothing else would tell the store to move.

use std::{
    fmt,
    sync::Arc,
    time::{Duration, Instant},
};

use parking_lot::Mutex;
use redis::{
    AsyncConnectionConfig, ConnectionAddr, IntoConnectionInfo, RedisError,
    aio::MultiplexedConnection,
    sentinel::{SentinelClient, SentinelClientBuilder, SentinelServerType},
};

#[cfg(feature = "tls")]
use crate::store::redis::wire::TlsConfig;
use crate::{
    StoreError, StoreErrorKind,
    store::redis::wire::{
        CONNECTION_TIMEOUT, RESPONSE_TIMEOUT, check_scheme, reply, script::SCRIPT, store_error,
    },
};

/// After failing to find a master, calls fail at once for this long instead of each
/// asking the sentinels again.
const RETRY_AFTER_FAILURE: Duration = Duration::from_millis(100);

/// How often the sentinels are asked whether the master moved.
const WATCH_EVERY: Duration = Duration::from_millis(500);

/// Where Sentinel is and which master to follow (feature `sentinel`).
///
/// ```no_run
/// # async fn run() -> Result<(), Box<dyn std::error::Error>> {
/// use tollgate::store::{RedisStore, SentinelConfig};
///
/// let sentinels = ["redis://10.0.0.1:26379", "redis://10.0.0.2:26379", "redis://10.0.0.3:26379"];
/// let config = SentinelConfig::new(&sentinels, "mymaster").with_master_user(Some("tollgate"), "secret");
/// let store = RedisStore::connect(config).await?;
/// # Ok(()) }
/// ```
#[derive(Clone)]
pub struct SentinelConfig {
    sentinels: Vec<String>,
    master_name: String,
    username: Option<String>,
    password: Option<String>,
    db: i64,
    #[cfg(feature = "tls")]
    tls: Option<TlsConfig>,
}

impl SentinelConfig {
    /// The sentinels' URLs (`redis://[user:password@]host:26379`, `rediss://` for TLS; the
    /// first one with credentials gives them for all) and the name of the master they
    /// watch (`sentinel monitor <name> ...`).
    pub fn new<N: AsRef<str>>(sentinels: &[N], master_name: &str) -> Self {
        Self {
            sentinels: sentinels.iter().map(|s| s.as_ref().to_owned()).collect(),
            master_name: master_name.to_owned(),
            username: None,
            password: None,
            db: 0,
            #[cfg(feature = "tls")]
            tls: None,
        }
    }

    /// Logs in to the master as `username` (an ACL user; `None`: the default user) with
    /// `password`.
    pub fn with_master_user(mut self, username: Option<&str>, password: &str) -> Self {
        self.username = username.map(str::to_owned);
        self.password = Some(password.to_owned());
        self
    }

    /// Uses database `db` on the master (0 by default).
    pub fn with_db(mut self, db: i64) -> Self {
        self.db = db;
        self
    }

    /// Connects to the master over TLS with these certificates; the sentinels too when
    /// their URLs are `rediss://` (set through [`RedisTarget::with_tls`](crate::store::RedisTarget::with_tls)).
    #[cfg(feature = "tls")]
    pub(crate) fn tls(mut self, tls: TlsConfig) -> Self {
        self.tls = Some(tls);
        self
    }

    fn client(&self) -> Result<SentinelClient, StoreError> {
        if self.sentinels.is_empty() {
            return Err(StoreError::new(
                StoreErrorKind::Response,
                "no sentinel given: Sentinel needs at least one sentinel URL",
            ));
        }
        let mut addresses = Vec::with_capacity(self.sentinels.len());
        let mut sentinel_auth = None;
        for url in &self.sentinels {
            check_scheme(url)?;
            let info = url.as_str().into_connection_info().map_err(store_error)?;
            let redis = info.redis_settings();
            if sentinel_auth.is_none() && redis.password().is_some() {
                sentinel_auth = Some((
                    redis.username().map(str::to_owned),
                    redis.password().unwrap_or_default().to_owned(),
                ));
            }
            addresses.push(info.addr().clone());
        }
        let sentinel_tls = matches!(addresses[0], redis::ConnectionAddr::TcpTls { .. });
        let mut builder = SentinelClientBuilder::new(
            addresses,
            self.master_name.clone(),
            SentinelServerType::Master,
        )
        .map_err(store_error)?
        .set_client_to_redis_db(self.db);
        if let Some(username) = &self.username {
            builder = builder.set_client_to_redis_username(username);
        }
        if let Some(password) = &self.password {
            builder = builder.set_client_to_redis_password(password);
        }
        if let Some((username, password)) = sentinel_auth {
            if let Some(username) = username {
                builder = builder.set_client_to_sentinel_username(username);
            }
            builder = builder.set_client_to_sentinel_password(password);
        }
        #[cfg(feature = "tls")]
        if let Some(tls) = &self.tls {
            builder = builder
                .set_client_to_redis_tls_mode(redis::TlsMode::Secure)
                .set_client_to_redis_certificates(tls.certificates());
            if sentinel_tls {
                builder = builder
                    .set_client_to_sentinel_tls_mode(redis::TlsMode::Secure)
                    .set_client_to_sentinel_certificates(tls.certificates());
            }
        }
        #[cfg(not(feature = "tls"))]
        let _ = sentinel_tls;
        builder.build().map_err(store_error)
    }
}

impl fmt::Debug for SentinelConfig {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        // Never a password (the sentinels' URLs may hold one).
        f.debug_struct("SentinelConfig")
            .field("sentinels", &self.sentinels.len())
            .field("master_name", &self.master_name)
            .field("username", &self.username)
            .field("db", &self.db)
            .finish_non_exhaustive()
    }
}

/// The sentinel client and the connection to the master it last named.
pub(crate) struct SentinelConnection {
    /// Locked while asking the sentinels, so that one call at a time does.
    client: tokio::sync::Mutex<SentinelClient>,
    current: Mutex<Current>,
}

#[derive(Default)]
struct Current {
    /// The connection and its generation (so that a late failure of an old one does
    /// not drop its successor).
    connection: Option<(u64, MultiplexedConnection)>,
    /// The master's address.
    address: Option<ConnectionAddr>,
    generation: u64,
    /// Set after a failed search: no new one before.
    retry_at: Option<Instant>,
}

impl Current {
    fn ready(&self) -> Option<Result<(u64, MultiplexedConnection), StoreError>> {
        if let Some(connection) = &self.connection {
            return Some(Ok(connection.clone()));
        }
        match self.retry_at {
            Some(at) if Instant::now() < at => Some(Err(StoreError::new(
                StoreErrorKind::Unavailable,
                "Sentinel named no reachable master (retrying shortly)",
            ))),
            _ => None,
        }
    }
}

impl SentinelConnection {
    /// Not connected yet: [`connect`](Self::connect) finds the master.
    pub(crate) fn new(config: &SentinelConfig) -> Result<Self, StoreError> {
        Ok(Self {
            client: tokio::sync::Mutex::new(config.client()?),
            current: Mutex::new(Current::default()),
        })
    }

    /// Asks the sentinels every [`WATCH_EVERY`] whether the master moved, until the last
    /// clone of the store is gone.
    pub(crate) fn watch_in_background(self: &Arc<Self>) {
        let watched = Arc::downgrade(self);
        tokio::spawn(async move {
            let mut tick = tokio::time::interval(WATCH_EVERY);
            tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
            loop {
                tick.tick().await;
                // Ends with the last clone of the store.
                let Some(sentinel) = watched.upgrade() else {
                    break;
                };
                sentinel.watch().await;
            }
        });
    }

    /// Finds the master and connects to it, when not connected.
    pub(crate) async fn connect(&self) -> Result<(), StoreError> {
        self.connection().await.map(|_| ())
    }

    /// The current master's connection, asking the sentinels when there is none.
    pub(crate) async fn connection(&self) -> Result<(u64, MultiplexedConnection), StoreError> {
        if let Some(ready) = self.current.lock().ready() {
            return ready;
        }
        let mut client = self.client.lock().await;
        // Another call may have found the master while this one waited.
        if let Some(ready) = self.current.lock().ready() {
            return ready;
        }
        let config = AsyncConnectionConfig::new()
            .set_connection_timeout(Some(CONNECTION_TIMEOUT))
            .set_response_timeout(Some(RESPONSE_TIMEOUT));
        let found = async {
            let master = client.async_get_client().await?;
            let address = master.get_connection_info().addr().clone();
            let mut connection = master
                .get_multiplexed_async_connection_with_config(&config)
                .await?;
            // Replicas never get SCRIPT LOAD: a promoted one has no script yet.
            SCRIPT.load_async(&mut connection).await?;
            Ok::<_, RedisError>((connection, address))
        }
        .await;
        let mut current = self.current.lock();
        match found {
            Ok((connection, address)) => {
                current.generation += 1;
                let entry = (current.generation, connection);
                current.connection = Some(entry.clone());
                current.address = Some(address);
                current.retry_at = None;
                Ok(entry)
            }
            Err(error) => {
                current.retry_at = Some(Instant::now() + RETRY_AFTER_FAILURE);
                Err(store_error(error))
            }
        }
    }

    /// Asks the sentinels for the master; drops the connection if it leads elsewhere.
    async fn watch(&self) {
        let (generation, address) = {
            let current = self.current.lock();
            match (&current.connection, &current.address) {
                (Some((generation, _)), Some(address)) => (*generation, address.clone()),
                _ => return,
            }
        };
        let named = self.client.lock().await.async_get_client().await;
        if let Ok(master) = named
            && master.get_connection_info().addr() != &address
        {
            tracing::info!(master = %master.get_connection_info().addr(), "Sentinel named a new master");
            self.forget(generation);
        }
    }

    /// Drops connection `generation` if it is still the current one.
    fn forget(&self, generation: u64) {
        let mut current = self.current.lock();
        if matches!(current.connection, Some((g, _)) if g == generation) {
            current.connection = None;
        }
    }

    /// A client for the master the sentinels name now.
    pub(crate) async fn master_client(&self) -> Option<redis::Client> {
        self.client.lock().await.async_get_client().await.ok()
    }

    /// Drops connection `generation` when `error` shows it no longer leads to a master
    /// (the next call asks the sentinels again).
    pub(crate) fn failed(&self, generation: u64, error: &RedisError) {
        if lost_master(error) {
            self.forget(generation);
        }
    }
}

/// Whether `error` means the connection no longer leads to a master.
fn lost_master(error: &RedisError) -> bool {
    error.is_io_error()
        || error.is_connection_dropped()
        || error.is_connection_refusal()
        || error.is_timeout()
        || error.is_unrecoverable_error()
        // The command or a write inside the script on a demoted master.
        || reply::read_only(error)
}
