use std::fmt;

use hmac::{Hmac, Mac};
use http::{HeaderName, Request};
use sha2::{Digest, Sha256};

use super::{Key, KeyError, KeyExtractor, Namespace};

/// The value of one request header, such as an API key.
///
/// A request without the header, with an empty value, or with the header more than once
/// has no key (so a client cannot pick a fresh bucket by adding a second copy). Values
/// are encoded as described in the [module docs](crate::key): any bytes are safe. Keys
/// are in the namespace `header:<name>`: a value never shares state with another header's,
/// with an IP's or with [`GlobalKey`](super::GlobalKey)'s.
///
/// **By default the value is stored as it is: an API key becomes part of a Redis key name,
/// visible to `MONITOR`, `SLOWLOG`, RDB files and anyone who can read the store.** Use
/// [`hashed_with`](Self::hashed_with) (an HMAC with your secret) for secrets.
///
/// ```
/// use http::Request;
/// use tollgate::key::{HeaderKey, KeyExtractor};
///
/// let key = HeaderKey::new("x-api-key")?;
/// let req = Request::get("/").header("X-Api-Key", "k1").body(()).unwrap();
/// assert_eq!(key.extract(&req).unwrap().as_str(), "header:x-api-key|k1");
///
/// let hashed = HeaderKey::new("x-api-key")?.hashed_with(b"a secret shared by the replicas");
/// let stored = hashed.extract(&req).unwrap();
/// assert!(stored.as_str().starts_with("header:x-api-key|#"));
/// assert!(!stored.as_str().contains("k1"));
/// # Ok::<(), http::header::InvalidHeaderName>(())
/// ```
#[derive(Clone)]
pub struct HeaderKey {
    name: HeaderName,
    namespace: Namespace,
    hashing: Hashing,
}

/// How a header value becomes a key's value.
#[derive(Clone)]
enum Hashing {
    /// Encoded as it is (hashed only when long).
    Off,
    /// SHA-256.
    Digest,
    /// HMAC-SHA256, keyed once: each request clones the keyed state.
    Hmac(Box<Hmac<Sha256>>),
}

impl HeaderKey {
    /// Keys requests by the header `name` (case-insensitive).
    ///
    /// # Errors
    ///
    /// When `name` is not a valid header name.
    pub fn new(name: &str) -> Result<Self, http::header::InvalidHeaderName> {
        HeaderName::from_bytes(name.as_bytes()).map(Self::from)
    }

    /// The header name.
    pub fn name(&self) -> &HeaderName {
        &self.name
    }

    /// Stores the first 128 bits of the value's SHA-256 instead of the value: the store
    /// no longer shows API keys. Anyone who can read the store and guess a key can still
    /// confirm the guess; prefer [`hashed_with`](Self::hashed_with).
    pub fn hashed(mut self) -> Self {
        self.hashing = Hashing::Digest;
        self
    }

    /// Stores the first 128 bits of the value's HMAC-SHA256 under `secret` instead of the
    /// value: without the secret, the store's keys say nothing about the API keys. Every
    /// replica sharing a store needs the same secret (a new secret starts fresh budgets).
    /// Use at least 32 random bytes.
    pub fn hashed_with(mut self, secret: impl AsRef<[u8]>) -> Self {
        // HMAC takes a key of any length, so this cannot fail.
        let mac = <Hmac<Sha256> as Mac>::new_from_slice(secret.as_ref())
            .expect("HMAC accepts keys of any length");
        self.hashing = Hashing::Hmac(Box::new(mac));
        self
    }
}

impl From<HeaderName> for HeaderKey {
    fn from(name: HeaderName) -> Self {
        Self {
            namespace: Namespace::named("header", name.as_str().as_bytes()),
            name,
            hashing: Hashing::Off,
        }
    }
}

impl fmt::Debug for HeaderKey {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        // Never the secret.
        let hashing = match self.hashing {
            Hashing::Off => "off",
            Hashing::Digest => "sha256",
            Hashing::Hmac(_) => "hmac-sha256",
        };
        f.debug_struct("HeaderKey")
            .field("name", &self.name)
            .field("hashing", &hashing)
            .finish()
    }
}

impl<B> KeyExtractor<B> for HeaderKey {
    fn extract(&self, request: &Request<B>) -> Result<Key, KeyError> {
        let mut values = request.headers().get_all(&self.name).iter();
        let value = values
            .next()
            .filter(|v| !v.as_bytes().is_empty())
            .ok_or_else(|| KeyError::new(format!("missing header {}", self.name)))?;
        if values.next().is_some() {
            return Err(KeyError::new(format!(
                "header {} sent more than once",
                self.name
            )));
        }
        Ok(self.key_of(value.as_bytes()))
    }

    fn key_for(&self, value: &str) -> Result<Key, KeyError> {
        let header = http::HeaderValue::from_str(value)
            .map_err(|_| KeyError::new(format!("not a valid value of header {}", self.name)))?;
        if header.as_bytes().is_empty() {
            return Err(KeyError::new(format!(
                "empty value of header {}",
                self.name
            )));
        }
        Ok(self.key_of(header.as_bytes()))
    }
}

impl HeaderKey {
    /// The key of a request whose header holds `value`.
    fn key_of(&self, value: &[u8]) -> Key {
        match &self.hashing {
            Hashing::Off => self.namespace.key(value),
            Hashing::Digest => self.namespace.digest_key(&Sha256::digest(value)),
            Hashing::Hmac(mac) => {
                let mut mac = (**mac).clone();
                mac.update(value);
                self.namespace.digest_key(&mac.finalize().into_bytes())
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn extract(req: http::request::Builder) -> Result<Key, KeyError> {
        HeaderKey::new("x-api-key")
            .unwrap()
            .extract(&req.body(()).unwrap())
    }

    #[test]
    fn missing_empty_and_repeated_headers_have_no_key() {
        assert!(extract(Request::get("/")).is_err());
        assert!(extract(Request::get("/").header("x-api-key", "")).is_err());
        let repeated = Request::get("/")
            .header("x-api-key", "a")
            .header("X-API-KEY", "b");
        assert!(extract(repeated).is_err());
    }

    #[test]
    fn hostile_values_are_encoded() {
        let value = http::HeaderValue::from_bytes(b"{tenant}\xff:x").unwrap();
        let key = extract(Request::get("/").header("x-api-key", value)).unwrap();
        assert_eq!(key.as_str(), "header:x-api-key|%7Btenant%7D%FF:x");
        let long = "k".repeat(8192);
        let key = extract(Request::get("/").header("x-api-key", long)).unwrap();
        assert_eq!(key.as_str().len(), "header:x-api-key|#".len() + 32);
    }

    fn hashed(key: &HeaderKey, value: &str) -> Key {
        key.extract(
            &Request::get("/")
                .header("x-api-key", value)
                .body(())
                .unwrap(),
        )
        .unwrap()
    }

    #[test]
    fn hashed_values_stay_in_their_header_namespace() {
        let plain = HeaderKey::new("x-api-key").unwrap();
        for key in [
            plain.clone().hashed(),
            plain.clone().hashed_with("s1"),
            plain.clone().hashed_with("s2"),
        ] {
            let a = hashed(&key, "sk_live_123");
            assert_eq!(a.namespace(), "header:x-api-key");
            assert_eq!(a.as_str().len(), "header:x-api-key|#".len() + 32);
            assert!(!a.as_str().contains("sk_live"), "{a}");
            assert_ne!(a, hashed(&key, "sk_live_124"));
            assert_eq!(a, hashed(&key.clone(), "sk_live_123"));
        }
        let digest = hashed(&plain.clone().hashed(), "k");
        let one = hashed(&plain.clone().hashed_with("s1"), "k");
        let two = hashed(&plain.clone().hashed_with("s2"), "k");
        assert!(digest != one && one != two && digest != two);
        // The secret never shows in Debug.
        let debug = format!("{:?}", plain.hashed_with("topsecret"));
        assert!(
            !debug.contains("topsecret") && debug.contains("hmac-sha256"),
            "{debug}"
        );
    }

    #[test]
    fn the_hmac_is_rfc_4231s() {
        // RFC 4231 test case 2: key "Jefe", data "what do ya want for nothing?".
        let key = HeaderKey::new("x-api-key").unwrap().hashed_with("Jefe");
        let stored = hashed(&key, "what do ya want for nothing?");
        assert_eq!(
            stored.as_str(),
            "header:x-api-key|#5BDCC146BF60754E6A042426089575C7"
        );
    }
}
