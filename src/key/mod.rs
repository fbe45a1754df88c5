//! Keys: who a request is counted against.
//!
//! A [`KeyExtractor`] turns a request into a [`Key`]: the client IP
//! ([`PeerIp`], or [`ClientIp`] behind trusted proxies), a header such as an API key
//! ([`HeaderKey`]), the authenticated user an auth layer put into the request extensions
//! ([`ExtensionKey`]), one shared [`GlobalKey`], or any closure
//! `Fn(&Request<B>) -> Option<impl Into<Key>>`.
//!
//! # Keys are safe in Redis
//!
//! A [`Key`] is made from untrusted bytes, so it is encoded before it becomes part of a
//! store key `<prefix>:{<key>}:<limit>`: bytes outside `A-Z a-z 0-9 - . _ : / @ + =` are
//! percent-encoded (so `{`, `}`, newlines and non-UTF-8 can neither end the hash tag nor
//! make two keys equal), and a key whose encoding is longer than 128 bytes is replaced by
//! `#` and the first 128 bits of its SHA-256, in hex. Different inputs give different keys,
//! short keys stay readable in `redis-cli`, and no key is longer than 128 bytes.

mod extension;
mod global;
mod header;
mod ip;

use std::{fmt, net::IpAddr};

use compact_str::CompactString;
use http::Request;
use sha2::{Digest, Sha256};

pub use extension::ExtensionKey;
pub use global::GlobalKey;
pub use header::HeaderKey;
pub use ip::{ClientIp, DEFAULT_IPV6_PREFIX, ForwardedHeader, PeerIp};

/// The longest encoded key; longer ones are hashed.
pub const MAX_KEY_LEN: usize = 128;

/// An encoded, bounded identity: see the [module docs](crate::key).
///
/// Keys up to 24 bytes (every IP address) live inline, without an allocation.
#[derive(Clone, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct Key(CompactString);

impl Key {
    /// Encodes `bytes` (any bytes at all) into a key.
    ///
    /// ```
    /// use tollgate::key::Key;
    ///
    /// assert_eq!(Key::new("api-key-1").as_str(), "api-key-1");
    /// assert_eq!(Key::new("a}b{c").as_str(), "a%7Db%7Bc");
    /// assert_eq!(Key::new([0xff, b'\n']).as_str(), "%FF%0A");
    /// assert_eq!(Key::new("x".repeat(10_000)).as_str().len(), 33);
    /// ```
    pub fn new(bytes: impl AsRef<[u8]>) -> Self {
        let bytes = bytes.as_ref();
        if bytes.is_empty() {
            // An empty hash tag `{}` would not be a tag: Redis Cluster would hash each
            // limit's whole key, and one key's limits could land in different slots.
            // `~` is escaped everywhere else, so it stands for "empty" alone.
            return Self(CompactString::const_new("~"));
        }
        let mut encoded = CompactString::with_capacity(bytes.len());
        escape_into(bytes, &mut encoded);
        if encoded.len() <= MAX_KEY_LEN {
            return Self(encoded);
        }
        // `#` is always escaped above, so a hashed key never equals an encoded one.
        let digest = Sha256::digest(bytes);
        let mut hashed = CompactString::with_capacity(33);
        hashed.push('#');
        for byte in &digest[..16] {
            hashed.push(HEX[usize::from(byte >> 4)] as char);
            hashed.push(HEX[usize::from(byte & 0xf)] as char);
        }
        Self(hashed)
    }

    /// A key from text known to be key-safe (IP addresses), without escaping it again.
    pub(crate) fn from_safe(text: CompactString) -> Self {
        debug_assert!(
            text.bytes().all(is_safe) && text.len() <= MAX_KEY_LEN,
            "{text}"
        );
        Self(text)
    }

    /// The encoded key, as it appears in store keys.
    pub fn as_str(&self) -> &str {
        &self.0
    }
}

impl fmt::Debug for Key {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        fmt::Debug::fmt(&self.0, f)
    }
}

impl fmt::Display for Key {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.0)
    }
}

impl From<&str> for Key {
    fn from(value: &str) -> Self {
        Self::new(value)
    }
}

impl From<String> for Key {
    fn from(value: String) -> Self {
        Self::new(value)
    }
}

impl From<&[u8]> for Key {
    fn from(value: &[u8]) -> Self {
        Self::new(value)
    }
}

impl From<IpAddr> for Key {
    fn from(value: IpAddr) -> Self {
        Self::new(value.to_string())
    }
}

macro_rules! key_from_int {
    ($($t:ty),*) => {$(
        impl From<$t> for Key {
            fn from(value: $t) -> Self {
                Self(CompactString::new(itoa::Buffer::new().format(value)))
            }
        }
    )*};
}
key_from_int!(u32, u64, i32, i64, u128);

const HEX: &[u8; 16] = b"0123456789ABCDEF";

fn is_safe(byte: u8) -> bool {
    byte.is_ascii_alphanumeric()
        || matches!(byte, b'-' | b'.' | b'_' | b':' | b'/' | b'@' | b'+' | b'=')
}

/// Appends `bytes` to `out`, percent-encoding every byte that is not safe. Runs of safe
/// bytes (usually the whole key) are copied at once.
fn escape_into(mut bytes: &[u8], out: &mut CompactString) {
    loop {
        let run = bytes
            .iter()
            .position(|&b| !is_safe(b))
            .unwrap_or(bytes.len());
        let (safe, rest) = bytes.split_at(run);
        out.push_str(std::str::from_utf8(safe).expect("safe bytes are ASCII"));
        let Some((&byte, rest)) = rest.split_first() else {
            return;
        };
        out.push('%');
        out.push(HEX[usize::from(byte >> 4)] as char);
        out.push(HEX[usize::from(byte & 0xf)] as char);
        bytes = rest;
    }
}

/// Why no key could be extracted from a request.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct KeyError {
    message: String,
}

impl KeyError {
    /// A key error with a message for logs (never sent to the client).
    pub fn new(message: impl Into<String>) -> Self {
        Self {
            message: message.into(),
        }
    }
}

impl fmt::Display for KeyError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.message)
    }
}

impl std::error::Error for KeyError {}

/// Extracts the [`Key`] a request is counted against.
///
/// Implemented by the shipped extractors and by every closure
/// `Fn(&Request<B>) -> Option<K>` where `K: Into<Key>` (`None` means "no key").
///
/// ```
/// use http::Request;
/// use tollgate::key::{Key, KeyExtractor};
///
/// let tenant = |req: &Request<()>| {
///     req.uri().path().split('/').nth(2).map(|t| Key::new(t))
/// };
/// let req = Request::get("/tenants/acme/items").body(()).unwrap();
/// assert_eq!(tenant.extract(&req).unwrap().as_str(), "acme");
/// ```
pub trait KeyExtractor<B>: Send + Sync + 'static {
    /// The key of `request`, or why there is none.
    ///
    /// # Errors
    ///
    /// When the request carries no usable key (a missing header, no peer address, ...).
    fn extract(&self, request: &Request<B>) -> Result<Key, KeyError>;
}

impl<B, F, K> KeyExtractor<B> for F
where
    F: Fn(&Request<B>) -> Option<K> + Send + Sync + 'static,
    K: Into<Key>,
{
    fn extract(&self, request: &Request<B>) -> Result<Key, KeyError> {
        self(request)
            .map(Into::into)
            .ok_or_else(|| KeyError::new("the key closure returned None"))
    }
}

#[cfg(test)]
mod tests {
    use std::collections::HashSet;

    use super::*;

    #[test]
    fn encoding_is_injective_on_tricky_inputs() {
        let inputs: Vec<Vec<u8>> = vec![
            b"a".to_vec(),
            b"%61".to_vec(),
            b"{a}".to_vec(),
            b"%7Ba%7D".to_vec(),
            b"a\nb".to_vec(),
            b"a%0Ab".to_vec(),
            vec![0xff],
            b"%FF".to_vec(),
            b"#".to_vec(),
            b"x".repeat(200),
            b"x".repeat(201),
            b"".to_vec(),
            b"\0".to_vec(),
        ];
        let keys: HashSet<Key> = inputs.iter().map(Key::new).collect();
        assert_eq!(keys.len(), inputs.len());
        for key in &keys {
            assert!(key.as_str().len() <= MAX_KEY_LEN);
            assert!(!key.as_str().contains(['{', '}', '\n', '\0', ' ']));
        }
    }

    #[test]
    fn integers_and_ips_are_readable() {
        assert_eq!(Key::from(42u64).as_str(), "42");
        assert_eq!(Key::from("::1".parse::<IpAddr>().unwrap()).as_str(), "::1");
    }
}
