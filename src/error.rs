//! Errors: invalid configuration, and a store that could not decide.

use std::{error::Error as StdError, fmt, sync::Arc};

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

/// What went wrong when a [`Store`](crate::Store) could not decide.
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
}

/// A store failed to decide; the layer's failure policy chooses what the request gets.
///
/// Cheap to clone: one failed call of a batch fails every request in it.
#[derive(Debug, Clone)]
pub struct StoreError {
    kind: StoreErrorKind,
    source: Option<Arc<dyn StdError + Send + Sync>>,
}

impl StoreError {
    /// A new error of `kind` caused by `source`.
    pub fn new(kind: StoreErrorKind, source: impl Into<Box<dyn StdError + Send + Sync>>) -> Self {
        Self {
            kind,
            source: Some(Arc::from(source.into())),
        }
    }

    /// The call did not finish within `timeout`.
    pub fn timeout() -> Self {
        Self {
            kind: StoreErrorKind::Timeout,
            source: None,
        }
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
        };
        match &self.source {
            Some(source) => write!(f, "{what}: {source}"),
            None => f.write_str(what),
        }
    }
}

impl StdError for StoreError {
    fn source(&self) -> Option<&(dyn StdError + 'static)> {
        self.source
            .as_deref()
            .map(|e| e as &(dyn StdError + 'static))
    }
}
