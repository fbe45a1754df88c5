use compact_str::CompactString;
use http::Request;

use super::{Key, KeyError, KeyExtractor};

/// One key for every request: the limit is shared by all clients (protects a backend's
/// total capacity).
#[derive(Debug, Clone, Copy, Default)]
pub struct GlobalKey;

impl<B> KeyExtractor<B> for GlobalKey {
    fn extract(&self, _request: &Request<B>) -> Result<Key, KeyError> {
        // A static string: nothing to allocate or escape per request.
        Ok(Key::from_safe(CompactString::const_new("global")))
    }
}
