use http::Request;

use super::{Key, KeyError, KeyExtractor};

/// One key for every request: the limit is shared by all clients (protects a backend's
/// total capacity). Its key, `global|~`, is in a namespace of its own: no header value or
/// closure can spend from it.
#[derive(Debug, Clone, Copy, Default)]
pub struct GlobalKey;

/// Built at compile time: a request only copies it.
const GLOBAL: Key = Key::from_safe_static("global|~");

impl<B> KeyExtractor<B> for GlobalKey {
    fn extract(&self, _request: &Request<B>) -> Result<Key, KeyError> {
        // A static string: nothing to allocate or escape per request. `~` is the value
        // `Namespace::key` gives an empty identity.
        Ok(GLOBAL)
    }

    /// The one global key, whatever `value` is.
    fn key_for(&self, _value: &str) -> Result<Key, KeyError> {
        Ok(GLOBAL)
    }
}
