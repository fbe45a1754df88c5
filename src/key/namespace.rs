//! Namespaces: which kind of extractor a key came from, so that keys of different kinds
//! never share state.

use std::fmt;

use compact_str::CompactString;
use sha2::{Digest, Sha256};

use super::{Key, MAX_KEY_LEN, escape_into, push_hex};

/// Ends the namespace inside a key. `Key` encoding escapes `|` in every name and value, so
/// the first `|` of a key always ends its namespace: two keys are equal only when both
/// their namespaces and their values are.
pub(crate) const SEPARATOR: char = '|';

/// The longest namespace (without the separator); longer names are hashed.
const MAX_NAMESPACE_LEN: usize = 64;

/// The kind of extractor a [`Key`] came from, plus its name (a header's, a type's, or
/// yours): the part of a store key before `|`, as in `{header:x-api-key|k1}`.
///
/// Every built-in extractor has its own: `ip` ([`PeerIp`](super::PeerIp) and
/// [`ClientIp`](super::ClientIp): both name a client address), `header:<name>`,
/// `ext:<type name>`, `global`. [`Key::new`] (and so every closure returning a value)
/// puts keys in `custom`; [`Namespace::new`] makes `custom:<name>` for your own kinds.
/// Names are encoded like key values (so no name can end a namespace early) and a
/// namespace longer than 64 bytes is replaced by `#` and a digest of the name.
///
/// ```
/// use http::Request;
/// use tollgate::key::{KeyExtractor, Namespace};
///
/// let tenants = Namespace::new("tenant");
/// let tenant = move |req: &Request<()>| req.uri().path().split('/').nth(2).map(|t| tenants.key(t));
/// let req = Request::get("/tenants/acme/items").body(()).unwrap();
/// assert_eq!(tenant.extract(&req)?.as_str(), "custom:tenant|acme");
/// # Ok::<(), tollgate::key::KeyError>(())
/// ```
#[derive(Clone, PartialEq, Eq, Hash)]
pub struct Namespace {
    /// The namespace and the separator: what every key in it starts with.
    prefix: CompactString,
}

impl Namespace {
    /// [`Key::new`] and closures.
    pub(crate) const CUSTOM: &str = "custom";

    /// Your own namespace `custom:<name>`: keys in it never equal a built-in extractor's,
    /// nor a key in another namespace.
    pub fn new(name: impl AsRef<[u8]>) -> Self {
        Self::named("custom", name.as_ref())
    }

    /// A namespace without a name: `ip`, `global`, `custom`.
    pub(crate) fn kind(kind: &'static str) -> Self {
        let mut prefix = CompactString::const_new(kind);
        prefix.push(SEPARATOR);
        Self { prefix }
    }

    /// `<kind>:<name>`, the name encoded (or hashed when long).
    pub(crate) fn named(kind: &'static str, name: &[u8]) -> Self {
        let mut prefix = CompactString::with_capacity(kind.len() + 1 + name.len() + 1);
        prefix.push_str(kind);
        prefix.push(':');
        escape_into(name, &mut prefix);
        if prefix.len() > MAX_NAMESPACE_LEN {
            // `#` is escaped in names, so a hashed name never equals an encoded one.
            prefix.truncate(kind.len() + 1);
            prefix.push('#');
            push_hex(&Sha256::digest(name)[..16], &mut prefix);
        }
        prefix.push(SEPARATOR);
        Self { prefix }
    }

    /// The namespace, as keys show it (without the separator).
    pub fn as_str(&self) -> &str {
        &self.prefix[..self.prefix.len() - 1]
    }

    /// The key of `value` (any bytes) in this namespace. Values are encoded as the
    /// [module docs](crate::key) describe; one whose key would exceed 128 bytes is
    /// replaced by `#` and the first 128 bits of its SHA-256.
    pub fn key(&self, value: impl AsRef<[u8]>) -> Key {
        let value = value.as_ref();
        let mut text = CompactString::with_capacity(self.prefix.len() + value.len());
        text.push_str(&self.prefix);
        if value.is_empty() {
            // An empty value is not an empty tag, but keep `~` for it as before: it is
            // escaped in every value, so it stands for "empty" alone.
            text.push('~');
            return Key(text);
        }
        escape_into(value, &mut text);
        if text.len() > MAX_KEY_LEN {
            text.truncate(self.prefix.len());
            self.push_digest(&Sha256::digest(value), &mut text);
        }
        Key(text)
    }

    /// The key whose value is `digest` (already a hash of the identity): `#` and its
    /// first 128 bits in hex, as long values get.
    pub(crate) fn digest_key(&self, digest: &[u8]) -> Key {
        let mut text = CompactString::with_capacity(self.prefix.len() + 33);
        text.push_str(&self.prefix);
        self.push_digest(digest, &mut text);
        Key(text)
    }

    fn push_digest(&self, digest: &[u8], text: &mut CompactString) {
        // `#` is escaped in every value, so a digest never equals an encoded value.
        text.push('#');
        push_hex(&digest[..16], text);
    }

    /// What every key in this namespace starts with (namespace and separator).
    #[cfg(test)]
    fn prefix(&self) -> &str {
        &self.prefix
    }
}

impl fmt::Debug for Namespace {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        fmt::Debug::fmt(self.as_str(), f)
    }
}

impl fmt::Display for Namespace {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_cannot_end_a_namespace_early() {
        // A name with `|` in it would otherwise make `custom:a|b` + `c` equal to the
        // namespace `custom:a` and the value `b|c`.
        let tricky = Namespace::new("a|b").key("c");
        let plain = Namespace::new("a").key("b|c");
        assert_ne!(tricky, plain);
        assert_eq!(tricky.as_str(), "custom:a%7Cb|c");
        assert_eq!(plain.as_str(), "custom:a|b%7Cc");
    }

    #[test]
    fn long_names_and_values_are_hashed_and_bounded() {
        let long = Namespace::new("n".repeat(500));
        assert_eq!(long.as_str().len(), "custom:#".len() + 32);
        assert_ne!(long, Namespace::new("n".repeat(501)));
        let key = long.key("v".repeat(500));
        assert!(key.as_str().len() <= MAX_KEY_LEN, "{key}");
        // The longest name that is kept, with a value that just fits and one that does not.
        let name = "n".repeat(MAX_NAMESPACE_LEN - "custom:".len());
        let kept = Namespace::new(&name);
        assert_eq!(kept.as_str(), format!("custom:{name}"));
        let room = MAX_KEY_LEN - kept.prefix().len();
        assert_eq!(kept.key("v".repeat(room)).as_str().len(), MAX_KEY_LEN);
        assert_eq!(
            kept.key("v".repeat(room + 1)).as_str().len(),
            kept.prefix().len() + 33
        );
    }

    #[test]
    fn kinds_never_meet() {
        let keys = [
            Namespace::kind("ip").key("1.2.3.4"),
            Namespace::kind("global").key(""),
            Namespace::kind(Namespace::CUSTOM).key("1.2.3.4"),
            Namespace::new("").key("1.2.3.4"),
            Namespace::named("header", b"x-api-key").key("1.2.3.4"),
            Namespace::named("header", b"x-user").key("1.2.3.4"),
            Namespace::named("ext", b"app::User").key("1.2.3.4"),
        ];
        for (i, a) in keys.iter().enumerate() {
            for b in &keys[i + 1..] {
                assert_ne!(a, b);
            }
        }
    }
}
