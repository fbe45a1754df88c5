//! The wire: what every connection shares, below the links and topologies. Timeouts, the
//! URL scheme check (and TLS settings), and Redis errors as the store's errors; the
//! script and its function library, replies read by their codes, ACL denials named.

use std::time::Duration;

use redis::RedisError;

use crate::{StoreError, StoreErrorKind};

mod acl;
pub(crate) mod function;
mod in_flight;
#[cfg(test)]
mod in_flight_tests;
pub(crate) mod reply;
pub(crate) mod script;

/// How long one connection attempt may take: a Redis that is down fails calls quickly and
/// the layer's failure policy answers them.
pub(crate) const CONNECTION_TIMEOUT: Duration = Duration::from_millis(500);
/// How long a command may wait for its answer.
pub(crate) const RESPONSE_TIMEOUT: Duration = Duration::from_secs(1);

/// A Redis error as the store's: an ACL denial names what is missing; timeouts and lost
/// connections keep their kinds.
pub(crate) fn store_error(error: RedisError) -> StoreError {
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

/// Whether `error` says Redis could not be reached (rather than that it refused us).
pub(crate) fn unreachable(error: &StoreError) -> bool {
    matches!(
        error.kind(),
        StoreErrorKind::Unavailable | StoreErrorKind::Timeout
    )
}

/// A client for `url`; `rediss://` without the `tls` feature is refused with a message
/// that names the feature (redis-rs's own says only "the feature is not enabled").
pub(crate) fn open(url: &str) -> Result<redis::Client, StoreError> {
    check_scheme(url)?;
    redis::Client::open(url).map_err(store_error)
}

/// Refuses `rediss://` in a build without TLS; installs the TLS crypto provider in one
/// with it.
pub(crate) fn check_scheme(url: &str) -> Result<(), StoreError> {
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

/// No TLS in this build: nothing can be passed where TLS settings go.
#[cfg(all(feature = "cluster", not(feature = "tls")))]
#[derive(Debug, Clone)]
pub(crate) enum TlsConfig {}

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

    pub(crate) fn certificates(&self) -> redis::TlsCertificates {
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
