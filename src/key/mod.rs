//! Keys: who a request is counted against.
//!
//! A [`KeyExtractor`] turns a request into a [`Key`]: the client IP
//! ([`PeerIp`], or [`ClientIp`] behind trusted proxies), a header such as an API key
//! ([`HeaderKey`]), the authenticated user an auth layer put into the request extensions
//! ([`ExtensionKey`]), one shared [`GlobalKey`], or any closure
//! `Fn(&Request<B>) -> Option<impl Into<Key>>`.
//!
//! | extractor | key |
//! |---|---|
//! | [`PeerIp`] (default) | the TCP peer (axum `ConnectInfo<SocketAddr>`, tonic `TcpConnectInfo` with feature `tonic`, or a `SocketAddr` extension); IPv6 grouped by /64 |
//! | [`ClientIp::new(trusted_cidrs)`](ClientIp::new) | the client behind trusted reverse proxies (below) |
//! | [`HeaderKey::new("x-api-key")`](HeaderKey::new) | a header's value; missing, empty or repeated header = no key |
//! | [`ExtensionKey::<UserId>::new()`](ExtensionKey::new) | a value an auth layer put into the request extensions |
//! | [`GlobalKey`] | one key for all requests |
//! | any `Fn(&Request<B>) -> Option<impl Into<Key>>` | whatever you compute |
//!
//! # Choosing a key
//!
//! **Behind a proxy or load balancer, [`PeerIp`] is the proxy: use [`ClientIp`].** It
//! believes `X-Forwarded-For` (or `Forwarded: for=`) only when the TCP peer is a trusted
//! proxy, and reads it from the right, skipping trusted addresses: the first untrusted
//! address is the client. A client cannot choose its key by sending these headers.
//!
//! Requests without a key are answered 400 (gRPC: `INVALID_ARGUMENT`), or passed on
//! unlimited with [`.with_on_missing_key(MissingKey::Allow)`](crate::MissingKey). A server that
//! gives [`PeerIp`] or [`ClientIp`] no peer address (axum served without
//! `into_make_service_with_connect_info::<SocketAddr>()`) is misconfigured, not the client:
//! those requests get 500 (gRPC: `INTERNAL`) with the fix in the body (`grpc-message`), and
//! the extractor logs it once at `warn`.
//!
//! # Keys of different kinds never meet
//!
//! A key is `<namespace>|<value>`: the [`Namespace`] names the kind of extractor (`ip`,
//! `header:<name>`, `ext:<type>`, `global`, `custom` for [`Key::new`] and closures, or
//! `custom:<name>` for your own: `Namespace::new("tenant").key(v)` gives `custom:tenant|v`),
//! so a header value that spells an IP address, `global`,
//! or another header's value is still its own client: layers with different extractors
//! keep separate budgets even on one shared store. [`PeerIp`] and [`ClientIp`] share `ip`,
//! as both name a client address (a service that moves behind a proxy keeps its budgets).
//!
//! A closure may return a key another extractor made (say, `PeerIp`'s when there is no
//! API key): that key keeps its namespace and shares that extractor's budget.
//!
//! # Keys are safe in Redis
//!
//! A [`Key`] is made from untrusted bytes, so it is encoded before it becomes part of a
//! store key `<prefix>:{<key>}:<limit>`: bytes outside `A-Z a-z 0-9 - . _ : / @ + =` are
//! percent-encoded (so `{`, `}`, `|`, newlines and non-UTF-8 can neither end the hash tag
//! or the namespace nor make two keys equal), and a value whose key would be longer than
//! 128 bytes is replaced by `#` and the first 128 bits of its SHA-256, in hex. Different
//! inputs give different keys, short keys stay readable in `redis-cli`, and no key is
//! longer than 128 bytes.
//!
//! **Readable also means that API keys are visible to anyone who can read the store (Redis
//! `MONITOR`, `SLOWLOG`, RDB files).** [`HeaderKey::hashed_with`] stores the first 128 bits
//! of an HMAC-SHA256 of the value under your secret instead ([`HeaderKey::hashed`]: a plain
//! SHA-256, which someone who can guess a key can confirm). Logs never show a key's value,
//! only its namespace and a short digest ([`Key::redacted`]:
//! `header:x-api-key|sha256:5F1C03A2`).

mod extension;
mod global;
mod header;
mod ip;
mod namespace;

use std::{fmt, net::IpAddr};

use compact_str::CompactString;
use hmac::{Hmac, Mac};
use http::Request;
use sha2::Sha256;

pub use extension::ExtensionKey;
pub use global::GlobalKey;
pub use header::HeaderKey;
pub use ip::{ClientIp, DEFAULT_IPV6_PREFIX, ForwardedHeader, PeerIp};
pub use namespace::Namespace;

/// The longest key, namespace included; longer values are hashed.
pub const MAX_KEY_LEN: usize = 128;

/// An encoded, bounded identity in its [`Namespace`]: see the [module docs](crate::key).
///
/// Keys up to 24 bytes (every IPv4 address with its namespace) live inline, without an
/// allocation.
#[derive(Clone, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct Key(CompactString);

impl Key {
    /// Encodes `bytes` (any bytes at all) into a key in the `custom` namespace: the one
    /// of closures and your own extractors, which no built-in extractor produces.
    ///
    /// ```
    /// use tollgate::key::Key;
    ///
    /// assert_eq!(Key::new("api-key-1").as_str(), "custom|api-key-1");
    /// assert_eq!(Key::new("a}b{c|").as_str(), "custom|a%7Db%7Bc%7C");
    /// assert_eq!(Key::new([0xff, b'\n']).as_str(), "custom|%FF%0A");
    /// assert_eq!(Key::new("x".repeat(10_000)).as_str().len(), 40);
    /// ```
    pub fn new(bytes: impl AsRef<[u8]>) -> Self {
        custom().key(bytes)
    }

    /// A key from text known to be key-safe and namespaced (IP addresses), as is.
    pub(crate) fn from_safe(text: CompactString) -> Self {
        debug_assert!(
            text.len() <= MAX_KEY_LEN
                && text
                    .split_once(namespace::SEPARATOR)
                    .is_some_and(|(ns, value)| {
                        !ns.is_empty() && !value.is_empty() && value.bytes().all(is_safe)
                    }),
            "{text}"
        );
        Self(text)
    }

    /// [`Key::from_safe`] for a constant.
    pub(crate) const fn from_safe_static(text: &'static str) -> Self {
        Self(CompactString::const_new(text))
    }

    /// The encoded key, as it appears in store keys.
    pub fn as_str(&self) -> &str {
        &self.0
    }

    /// The key's namespace: `ip`, `header:x-api-key`, `custom`, ...
    pub fn namespace(&self) -> &str {
        self.0
            .split_once(namespace::SEPARATOR)
            .map_or(self.as_str(), |(namespace, _)| namespace)
    }

    /// A form for logs that never shows the value: the namespace and a pseudonym, the
    /// first 64 bits of the key's HMAC-SHA256 under a secret drawn at random once per
    /// process (`header:x-api-key|id:5F1C03A2B7E4019C`). One key has one pseudonym for
    /// the life of the process, so the lines of one incident can be followed; without the
    /// secret, which never leaves the process, a pseudonym cannot be traced back to its
    /// key by hashing candidates (every IPv4 address, a list of likely API keys), and
    /// the same key has another pseudonym in another process or after a restart.
    pub fn redacted(&self) -> Redacted<'_> {
        Redacted(self)
    }
}

/// A [`Key`] for logs: see [`Key::redacted`].
#[derive(Clone, Copy)]
pub struct Redacted<'a>(&'a Key);

// By hand: a derived `Debug` would show the key (`?key.redacted()` in a log line).
impl fmt::Debug for Redacted<'_> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        fmt::Display::fmt(self, f)
    }
}

impl fmt::Display for Redacted<'_> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        // Keyed only when the log line is written.
        let mut mac = pseudonym_key().clone();
        mac.update(self.0.as_str().as_bytes());
        let digest = mac.finalize().into_bytes();
        let mut hex = CompactString::with_capacity(16);
        push_hex(&digest[..8], &mut hex);
        write!(f, "{}|id:{hex}", self.0.namespace())
    }
}

/// The keyed HMAC of [`Key::redacted`]'s pseudonyms: a 256-bit secret drawn once per
/// process from std's `RandomState` (SipHash keys the OS's randomness seeds: 128 bits of
/// entropy), never written anywhere.
fn pseudonym_key() -> &'static Hmac<Sha256> {
    static KEY: std::sync::OnceLock<Hmac<Sha256>> = std::sync::OnceLock::new();
    KEY.get_or_init(|| {
        use std::hash::{BuildHasher, Hasher};
        let mut secret = [0u8; 32];
        for (i, chunk) in secret.chunks_mut(8).enumerate() {
            let mut hasher = std::collections::hash_map::RandomState::new().build_hasher();
            hasher.write_usize(i);
            chunk.copy_from_slice(&hasher.finish().to_le_bytes());
        }
        <Hmac<Sha256> as Mac>::new_from_slice(&secret).expect("HMAC takes a key of any length")
    })
}

/// The `custom` namespace, made once.
fn custom() -> &'static Namespace {
    static CUSTOM: std::sync::LazyLock<Namespace> =
        std::sync::LazyLock::new(|| Namespace::kind(Namespace::CUSTOM));
    &CUSTOM
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

/// An address a closure returned is a `custom` key, not an `ip` one: a closure may read it
/// from anywhere (a header), so it must not share [`PeerIp`]'s budgets.
impl From<IpAddr> for Key {
    fn from(value: IpAddr) -> Self {
        Self::new(value.to_string())
    }
}

macro_rules! key_from_int {
    ($($t:ty),*) => {$(
        impl From<$t> for Key {
            fn from(value: $t) -> Self {
                Self::new(itoa::Buffer::new().format(value))
            }
        }
    )*};
}
key_from_int!(u32, u64, i32, i64, u128);

const HEX: &[u8; 16] = b"0123456789ABCDEF";

/// Appends `bytes` in upper-case hex.
fn push_hex(bytes: &[u8], out: &mut CompactString) {
    for byte in bytes {
        out.push(HEX[usize::from(byte >> 4)] as char);
        out.push(HEX[usize::from(byte & 0xf)] as char);
    }
}

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
        push_hex(&[byte], out);
        bytes = rest;
    }
}

/// Why no key could be extracted from a request.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct KeyError {
    message: String,
    misconfigured: bool,
}

impl KeyError {
    /// A key error with a message for logs (never sent to the client): the request lacks
    /// what the key is made of.
    pub fn new(message: impl Into<String>) -> Self {
        Self {
            message: message.into(),
            misconfigured: false,
        }
    }

    /// The server, not the request, is at fault (no peer address because the server was
    /// not set up to record it): the default rejection answers 500 and shows `message`,
    /// which should name the fix, in the body.
    pub fn misconfigured(message: impl Into<String>) -> Self {
        Self {
            message: message.into(),
            misconfigured: true,
        }
    }

    /// Whether the server is at fault; see [`KeyError::misconfigured`].
    pub fn is_misconfigured(&self) -> bool {
        self.misconfigured
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
/// `Fn(&Request<B>) -> Option<K>` where `K: Into<Key>` (`None` means "no key"). A
/// closure's values are in the `custom` namespace (through [`Key::new`]); give a kind of
/// key its own with a [`Namespace`].
///
/// ```
/// use http::Request;
/// use tollgate::key::{Key, KeyExtractor};
///
/// let tenant = |req: &Request<()>| {
///     req.uri().path().split('/').nth(2).map(|t| Key::new(t))
/// };
/// let req = Request::get("/tenants/acme/items").body(()).unwrap();
/// assert_eq!(tenant.extract(&req).unwrap().as_str(), "custom|acme");
/// ```
pub trait KeyExtractor<B>: Send + Sync + 'static {
    /// The key of `request`, or why there is none.
    ///
    /// # Errors
    ///
    /// When the request carries no usable key (a missing header, no peer address, ...).
    fn extract(&self, request: &Request<B>) -> Result<Key, KeyError>;

    /// The key this extractor gives a request whose key material is `value`: the API key
    /// for [`HeaderKey`], the client address for [`PeerIp`] and [`ClientIp`] (grouped by
    /// their IPv6 prefix), the extension's `Display` text for [`ExtensionKey`]; validated,
    /// grouped and hashed as [`extract`](Self::extract) does, so that it names the same
    /// state. For an admin tool or a job: see [`Limiter::key_for`](crate::Limiter::key_for).
    ///
    /// # Errors
    ///
    /// When `value` is not valid key material for this extractor, or the extractor cannot
    /// make a key from a value (closures, and extractors that do not say how: the
    /// default).
    fn key_for(&self, value: &str) -> Result<Key, KeyError> {
        let _ = value;
        Err(KeyError::new(
            "this key extractor cannot make a key from a typed value",
        ))
    }
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
            b"|".to_vec(),
            b"%7C".to_vec(),
            b"custom|a".to_vec(),
        ];
        let keys: HashSet<Key> = inputs.iter().map(Key::new).collect();
        assert_eq!(keys.len(), inputs.len());
        for key in &keys {
            assert!(key.as_str().len() <= MAX_KEY_LEN);
            assert!(!key.as_str().contains(['{', '}', '\n', '\0', ' ']));
            // One separator: nothing in a value can start another namespace.
            assert_eq!(key.as_str().matches('|').count(), 1, "{key}");
            assert_eq!(key.namespace(), "custom");
        }
    }

    #[test]
    fn redacted_keys_show_the_namespace_and_a_pseudonym_only() {
        let key = Namespace::named("header", b"x-api-key").key("secret-api-key-123");
        let shown = key.redacted().to_string();
        assert!(shown.starts_with("header:x-api-key|id:"), "{shown}");
        assert_eq!(shown.len(), "header:x-api-key|id:".len() + 16);
        assert!(!shown.contains("secret"), "{shown}");
        assert_eq!(format!("{:?}", key.redacted()), shown);
        assert_eq!(key.redacted().to_string(), shown, "one pseudonym per key");
        let other = Namespace::named("header", b"x-api-key").key("secret-api-key-124");
        assert_ne!(other.redacted().to_string(), shown);
    }

    /// An IP key's pseudonym is not its unsalted hash: anyone could find the address by
    /// hashing all 2^32 IPv4 addresses (it was the first 32 bits of its SHA-256).
    #[test]
    fn a_redacted_ip_is_not_its_plain_hash() {
        use sha2::Digest;
        let key = Key::from_safe(CompactString::const_new("ip|203.0.113.7"));
        let shown = key.redacted().to_string();
        let digest = Sha256::digest(key.as_str().as_bytes());
        for bits in [4, 8] {
            let mut plain = CompactString::default();
            push_hex(&digest[..bits], &mut plain);
            assert!(
                !shown.contains(plain.as_str()),
                "{shown} is SHA-256 of the key"
            );
        }
        assert!(shown.starts_with("ip|id:"), "{shown}");
    }

    #[test]
    fn integers_and_ips_are_readable() {
        assert_eq!(Key::from(42u64).as_str(), "custom|42");
        // A closure's address is a custom key, never PeerIp's.
        assert_eq!(
            Key::from("::1".parse::<IpAddr>().unwrap()).as_str(),
            "custom|::1"
        );
    }
}
