//! Connecting to Redis as it is run: one node or a cluster, over TLS (`rediss://`, a
//! custom CA, client certificates) with feature `tls`, as an ACL user named in the URL.

use std::{sync::Arc, time::Duration};

use redis::aio::ConnectionManagerConfig;

use super::{RedisStore, SCRIPT, invalidate::Nodes, store_error};
use crate::{StoreError, StoreErrorKind};

/// How long one connection attempt may take: a Redis that is down fails calls quickly and
/// the layer's failure policy answers them.
pub(super) const CONNECTION_TIMEOUT: Duration = Duration::from_millis(500);
/// How long a command may wait for its answer.
pub(super) const RESPONSE_TIMEOUT: Duration = Duration::from_secs(1);

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
    /// script loaded.
    pub(super) async fn connect_client(client: redis::Client) -> Result<Self, StoreError> {
        let config = ConnectionManagerConfig::new()
            .set_number_of_retries(2)
            .set_min_delay(Duration::from_millis(50))
            .set_max_delay(Duration::from_millis(250))
            .set_connection_timeout(Some(CONNECTION_TIMEOUT))
            .set_response_timeout(Some(RESPONSE_TIMEOUT));
        let mut manager = redis::aio::ConnectionManager::new_with_config(client.clone(), config)
            .await
            .map_err(store_error)?;
        let store = Self::from_manager(manager.clone());
        // Loaded now, the first burst of calls does not all meet a missing function (or
        // NOSCRIPT) at once.
        store.load(&mut manager).await?;
        Ok(store.with_reset_source(Nodes::Fixed(Arc::new([client]))))
    }

    /// Loads the library (every master of a cluster), or the script where Redis has no
    /// functions for this user.
    async fn load<C: redis::aio::ConnectionLike>(
        &self,
        connection: &mut C,
    ) -> Result<(), StoreError> {
        let mode = &self.connection.mode;
        mode.load(connection).await.map_err(store_error)?;
        if !mode.functions() {
            SCRIPT.load_async(connection).await.map_err(store_error)?;
        }
        Ok(())
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
            .response_timeout(RESPONSE_TIMEOUT);
        #[cfg(feature = "tls")]
        let builder = match tls {
            Some(tls) => builder.certs(tls.certificates()),
            None => builder,
        };
        let client = builder.build().map_err(store_error)?;
        let mut connection = client.get_async_connection().await.map_err(store_error)?;
        let store = Self::new(super::Link::Cluster(connection.clone()).into());
        store.load(&mut connection).await?;
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
    pub async fn connect_tls(url: &str, tls: &TlsConfig) -> Result<Self, StoreError> {
        check_scheme(url)?;
        let client = redis::Client::build_with_tls(url, tls.certificates()).map_err(store_error)?;
        Self::connect_client(client).await
    }

    /// Connects to a Redis Cluster through any of its `rediss://` `nodes` over TLS, with
    /// the CA and client certificate in `tls` (features `cluster` and `tls`). See
    /// [`connect_cluster`](Self::connect_cluster).
    ///
    /// # Errors
    ///
    /// When a URL is invalid, a PEM does not parse, or no node can be reached now.
    #[cfg(all(feature = "cluster", feature = "tls"))]
    pub async fn connect_cluster_tls<N: AsRef<str>>(
        nodes: &[N],
        tls: &TlsConfig,
    ) -> Result<Self, StoreError> {
        let nodes: Vec<&str> = nodes.iter().map(AsRef::as_ref).collect();
        Self::connect_cluster_with(&nodes, Some(tls)).await
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
