use std::{fmt, marker::PhantomData};

use http::Request;

use super::{Key, KeyError, KeyExtractor, Namespace};

/// A value of type `T` that an earlier layer (typically authentication) put into the
/// request extensions: rate limits per authenticated user or tenant.
///
/// The key is `T`'s `Display` form, in the namespace `ext:<T's type name>` (so two
/// extension types never share a budget). The name is [`std::any::type_name`]: renaming or
/// moving `T` (or, rarely, a compiler that spells it differently) starts fresh budgets.
/// Requests without a `T` have no key, so put this layer *after* (inside) the auth layer.
///
/// ```
/// use http::Request;
/// use tollgate::key::{ExtensionKey, KeyExtractor};
///
/// #[derive(Clone)]
/// struct UserId(u64);
/// impl std::fmt::Display for UserId {
///     fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
///         write!(f, "user-{}", self.0)
///     }
/// }
///
/// let mut req = Request::get("/").body(()).unwrap();
/// req.extensions_mut().insert(UserId(7));
/// let key = ExtensionKey::<UserId>::new().extract(&req).unwrap();
/// // The type name, or its hash when long (as in merged doctests, whose paths grow).
/// assert!(key.namespace().starts_with("ext:"));
/// assert!(key.as_str().ends_with("|user-7"));
/// ```
pub struct ExtensionKey<T> {
    namespace: Namespace,
    _marker: PhantomData<fn() -> T>,
}

impl<T> ExtensionKey<T> {
    /// Keys requests by their `T` extension.
    pub fn new() -> Self {
        Self {
            namespace: Namespace::named("ext", std::any::type_name::<T>().as_bytes()),
            _marker: PhantomData,
        }
    }
}

impl<T> Default for ExtensionKey<T> {
    fn default() -> Self {
        Self::new()
    }
}

impl<T> Clone for ExtensionKey<T> {
    fn clone(&self) -> Self {
        Self {
            namespace: self.namespace.clone(),
            _marker: PhantomData,
        }
    }
}

impl<T> fmt::Debug for ExtensionKey<T> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("ExtensionKey")
            .field("type", &std::any::type_name::<T>())
            .finish()
    }
}

impl<B, T> KeyExtractor<B> for ExtensionKey<T>
where
    T: fmt::Display + Send + Sync + 'static,
{
    fn extract(&self, request: &Request<B>) -> Result<Key, KeyError> {
        request
            .extensions()
            .get::<T>()
            .map(|value| self.namespace.key(value.to_string()))
            .ok_or_else(|| {
                KeyError::new(format!(
                    "no {} in the request extensions",
                    std::any::type_name::<T>()
                ))
            })
    }

    /// `value` is the extension's `Display` text (a user id, say).
    fn key_for(&self, value: &str) -> Result<Key, KeyError> {
        Ok(self.namespace.key(value))
    }
}
