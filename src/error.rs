//! Errors: invalid configuration, and a store that could not decide.

use std::{
    error::Error as StdError,
    fmt,
    sync::{Arc, LazyLock},
};

/// A value rejected while building a [`Limit`](crate::Limit) or a layer.
///
/// The message names the field and the value, so that a bad config file points at its
/// own line: `invalid rate limit: window must be at least 1ms (got 0ns)`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ConfigError {
    field: &'static str,
    message: String,
}

impl ConfigError {
    pub(crate) fn new(field: &'static str, message: impl Into<String>) -> Self {
        Self {
            field,
            message: message.into(),
        }
    }

    /// The name of the rejected field (`limit`, `window`, `burst`, ...).
    pub fn field(&self) -> &'static str {
        self.field
    }
}

impl fmt::Display for ConfigError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "invalid rate limit: {} {}", self.field, self.message)
    }
}

impl StdError for ConfigError {}

/// What went wrong when a [`Store`](crate::store::Store) could not decide.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[non_exhaustive]
pub enum StoreErrorKind {
    /// The store did not answer within the configured timeout. The call may still have
    /// counted, so it is never retried.
    Timeout,
    /// The store could not be reached (connection refused, reset, closed).
    Unavailable,
    /// The store answered with an error (script error, wrong reply shape, ...).
    Response,
    /// Too many decisions are already waiting for the store.
    Overloaded,
    /// The store does not implement this operation (a custom [`Store`](crate::store::Store)
    /// without [`peek`](crate::store::Store::peek), [`reset`](crate::store::Store::reset) or
    /// [`adjust`](crate::store::Store::adjust)).
    Unsupported,
}

/// A store failed to decide; the layer's failure policy chooses what the request gets.
///
/// Cheap to clone: one failed call of a batch fails every request in it. `Display` says
/// what failed at this level only (`rate limit store unavailable`); the cause, such as the
/// Redis error, is its [`source`](StdError::source), so that an error chain prints it once.
///
/// ```
/// use std::error::Error;
/// use tollgate::{StoreError, StoreErrorKind};
///
/// let error = StoreError::new(StoreErrorKind::Unavailable, "connection refused");
/// assert_eq!(error.to_string(), "rate limit store unavailable");
/// assert_eq!(error.source().unwrap().to_string(), "connection refused");
/// ```
#[derive(Debug, Clone)]
pub struct StoreError {
    kind: StoreErrorKind,
    source: Option<Arc<dyn StdError + Send + Sync>>,
    /// Made by an open circuit breaker: the store was not asked.
    circuit_open: bool,
}

impl StoreError {
    /// A new error of `kind` caused by `source`.
    pub fn new(kind: StoreErrorKind, source: impl Into<Box<dyn StdError + Send + Sync>>) -> Self {
        Self {
            kind,
            source: Some(Arc::from(source.into())),
            circuit_open: false,
        }
    }

    /// The call did not finish within `timeout`.
    pub fn timeout() -> Self {
        Self {
            kind: StoreErrorKind::Timeout,
            source: None,
            circuit_open: false,
        }
    }

    /// The store does not implement `operation`: what [`Store`](crate::store::Store)'s default
    /// methods answer.
    pub fn unsupported(operation: &str) -> Self {
        Self::new(
            StoreErrorKind::Unsupported,
            format!("this store does not implement {operation}"),
        )
    }

    /// The circuit breaker is open: the store was not asked.
    pub(crate) fn circuit_open() -> Self {
        static CAUSE: LazyLock<Arc<dyn StdError + Send + Sync>> =
            LazyLock::new(|| Arc::from(Box::from("circuit open: the store failed repeatedly")));
        Self {
            kind: StoreErrorKind::Unavailable,
            source: Some(CAUSE.clone()),
            circuit_open: true,
        }
    }

    /// The store has not connected yet (it started while its backend was unreachable
    /// and connects in the background): answered at once, without trying.
    #[cfg(feature = "redis")]
    pub(crate) fn not_connected() -> Self {
        static CAUSE: LazyLock<Arc<dyn StdError + Send + Sync>> = LazyLock::new(|| {
            Arc::from(Box::from(
                "not connected yet: unreachable at start, connecting in the background",
            ))
        });
        Self {
            kind: StoreErrorKind::Unavailable,
            source: Some(CAUSE.clone()),
            circuit_open: false,
        }
    }

    /// Whether an open circuit breaker answered instead of the store.
    pub(crate) fn is_circuit_open(&self) -> bool {
        self.circuit_open
    }

    /// This error followed by its causes, `: `-separated, for log lines.
    pub(crate) fn chain(&self) -> Chain<'_> {
        Chain(self)
    }

    /// What kind of failure this is.
    pub fn kind(&self) -> StoreErrorKind {
        self.kind
    }
}

impl fmt::Display for StoreError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let what = match self.kind {
            StoreErrorKind::Timeout => "rate limit store timed out",
            StoreErrorKind::Unavailable => "rate limit store unavailable",
            StoreErrorKind::Response => "rate limit store answered with an error",
            StoreErrorKind::Overloaded => "rate limit store overloaded",
            StoreErrorKind::Unsupported => "rate limit store does not support this operation",
        };
        f.write_str(what)
    }
}

/// See [`StoreError::chain`].
pub(crate) struct Chain<'a>(&'a StoreError);

impl fmt::Display for Chain<'_> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}", self.0)?;
        let mut cause = self.0.source();
        while let Some(error) = cause {
            write!(f, ": {error}")?;
            cause = error.source();
        }
        Ok(())
    }
}

impl StdError for StoreError {
    fn source(&self) -> Option<&(dyn StdError + 'static)> {
        self.source
            .as_deref()
            .map(|e| e as &(dyn StdError + 'static))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_store_error_shows_its_cause_once_in_a_chain() {
        let cause = std::io::Error::new(std::io::ErrorKind::ConnectionRefused, "refused");
        let error = StoreError::new(StoreErrorKind::Unavailable, cause);
        assert_eq!(error.to_string(), "rate limit store unavailable");
        assert_eq!(error.source().unwrap().to_string(), "refused");
        assert_eq!(
            error.chain().to_string(),
            "rate limit store unavailable: refused"
        );
        let timeout = StoreError::timeout();
        assert_eq!(timeout.to_string(), "rate limit store timed out");
        assert!(timeout.source().is_none());
        assert_eq!(timeout.chain().to_string(), "rate limit store timed out");
    }
}
