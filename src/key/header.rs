use http::{HeaderName, Request};

use super::{Key, KeyError, KeyExtractor};

/// The value of one request header, such as an API key.
///
/// A request without the header, with an empty value, or with the header more than once
/// has no key (so a client cannot pick a fresh bucket by adding a second copy). Values
/// are encoded as described in the [module docs](crate::key): any bytes are safe.
///
/// ```
/// use http::Request;
/// use tollgate::key::{HeaderKey, KeyExtractor};
///
/// let key = HeaderKey::new("x-api-key")?;
/// let req = Request::get("/").header("X-Api-Key", "k1").body(()).unwrap();
/// assert_eq!(key.extract(&req).unwrap().as_str(), "k1");
/// # Ok::<(), http::header::InvalidHeaderName>(())
/// ```
#[derive(Debug, Clone)]
pub struct HeaderKey {
    name: HeaderName,
}

impl HeaderKey {
    /// Keys requests by the header `name` (case-insensitive).
    ///
    /// # Errors
    ///
    /// When `name` is not a valid header name.
    pub fn new(name: &str) -> Result<Self, http::header::InvalidHeaderName> {
        Ok(Self {
            name: HeaderName::from_bytes(name.as_bytes())?,
        })
    }

    /// The header name.
    pub fn name(&self) -> &HeaderName {
        &self.name
    }
}

impl From<HeaderName> for HeaderKey {
    fn from(name: HeaderName) -> Self {
        Self { name }
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
        Ok(Key::new(value.as_bytes()))
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
        assert_eq!(key.as_str(), "%7Btenant%7D%FF:x");
        let long = "k".repeat(8192);
        let key = extract(Request::get("/").header("x-api-key", long)).unwrap();
        assert_eq!(key.as_str().len(), 33);
    }
}
