//! A [`Limit`]'s lockout after a breach, and the units it counts as pending.

use std::time::Duration;

use super::{Limit, MAX_WINDOW, fixed_hash};
use crate::ConfigError;

/// # Lockout
impl Limit {
    /// Blocks a key for `lockout` once this limit denies it: for that long every request
    /// of the key is denied, whatever its cost, with `retry_after` the time left on the
    /// block (or the limit's own wait, when that is longer), which `Retry-After` and the
    /// `RateLimit` fields show (`r=0`). The usual guard for login and one-time-code
    /// endpoints: 5 failed attempts a minute lock the account out for 15 minutes.
    ///
    /// Requests during a block do not extend it; a block starts only when *this* limit
    /// denies a request. See [Lockout after a breach](crate::guide::lockout) for what a
    /// block does, where it is kept and how it meets the other features.
    ///
    /// ```
    /// use std::time::Duration;
    /// use tollgate::Limit;
    ///
    /// let logins = Limit::fixed_window(5, Duration::from_secs(60))?
    ///     .with_lockout(Duration::from_secs(15 * 60))?;
    /// assert_eq!(logins.lockout(), Some(Duration::from_secs(900)));
    /// # Ok::<(), tollgate::ConfigError>(())
    /// ```
    ///
    /// # Errors
    ///
    /// When `lockout` (field `lockout`) is under 1ms, not a whole number of milliseconds,
    /// or over [`MAX_WINDOW`].
    pub fn with_lockout(self, lockout: Duration) -> Result<Self, ConfigError> {
        if lockout < Duration::from_millis(1) {
            return Err(ConfigError::new(
                "lockout",
                format!("must be at least 1ms (got {lockout:?}); leave it out for none"),
            ));
        }
        if !lockout.subsec_nanos().is_multiple_of(1_000_000) {
            return Err(ConfigError::new(
                "lockout",
                format!("must be a whole number of milliseconds (got {lockout:?})"),
            ));
        }
        if lockout > MAX_WINDOW {
            return Err(ConfigError::new(
                "lockout",
                format!("must be at most 366 days (got {lockout:?})"),
            ));
        }
        Ok(self.with_lockout_ms(lockout.as_millis() as u64))
    }

    /// This limit keeps what a request was charged up front: counting after the response
    /// ([`count_when`](crate::RateLimitLayer::with_count_when), late costs) adjusts the layer's
    /// other limits and leaves this one alone. One layer then counts requests and the
    /// tokens the responses report, with one store call up front and one after:
    ///
    /// ```
    /// use std::time::Duration;
    /// use tollgate::{Limit, RateLimitLayer, key::HeaderKey};
    ///
    /// let requests = Limit::token_bucket(20, Duration::from_secs(60))?.counted_up_front();
    /// let tokens = Limit::fixed_window(10_000, Duration::from_secs(86_400))?.with_name("tokens")?;
    /// let layer = RateLimitLayer::new(requests)
    ///     .with_limit(tokens)
    ///     .with_key(HeaderKey::new("x-api-key")?.hashed())
    ///     .with_late_cost(|response: &http::Response<axum::body::Body>| {
    ///         response.headers().get("x-tokens")?.to_str().ok()?.parse().ok()
    ///     });
    /// # let _ = layer;
    /// # Ok::<(), Box<dyn std::error::Error>>(())
    /// ```
    ///
    /// Not part of the limit's state: switching it on or off keeps what was spent.
    pub fn counted_up_front(mut self) -> Self {
        self.up_front = true;
        self
    }

    /// Whether counting after the response leaves this limit alone. See
    /// [`counted_up_front`](Self::counted_up_front).
    pub fn is_counted_up_front(&self) -> bool {
        self.up_front
    }

    /// The lockout set with [`with_lockout`](Self::with_lockout), if any.
    pub fn lockout(&self) -> Option<Duration> {
        (self.lockout_ms > 0).then(|| Duration::from_millis(self.lockout_ms))
    }

    /// The lockout in milliseconds, 0 for none.
    pub(crate) fn lockout_ms(&self) -> u64 {
        self.lockout_ms
    }

    /// This limit with its lockout told that the units of the requests it allows are
    /// *pending* until settled ([`Adjustment::Settle`](crate::Adjustment::Settle)): a
    /// request it denies starts a block only when the units kept (settled, or spent by
    /// requests that do not count after the response) breach it, never because of
    /// requests still in flight. A layer that counts after the response
    /// ([`count_when`](crate::RateLimitLayer::with_count_when), late costs) sets this on its
    /// limits with a lockout; a limit without a lockout is returned as it is. For the
    /// reference model and stores' tests; not needed otherwise.
    #[doc(hidden)]
    pub fn pending_until_settled(mut self) -> Self {
        self.pending = self.lockout_ms > 0;
        self
    }

    /// Whether the lockout counts units as pending until settled (see
    /// [`pending_until_settled`](Self::pending_until_settled)).
    #[inline]
    pub(crate) fn pending(&self) -> bool {
        self.pending
    }

    /// The same limit with a lockout of `lockout_ms` (0: none), unvalidated.
    pub(crate) fn with_lockout_ms(self, lockout_ms: u64) -> Self {
        Self::build(
            self.algorithm,
            self.limit,
            self.window_ms,
            self.burst,
            self.name,
            self.on_change,
        )
        .locking_out(lockout_ms)
    }

    /// A limit just built (no lockout) with a lockout of `lockout_ms`: a decision cache
    /// must tell the two apart, the state must not.
    pub(super) fn locking_out(mut self, lockout_ms: u64) -> Self {
        if lockout_ms > 0 {
            self.lockout_ms = lockout_ms;
            self.params_fingerprint =
                fixed_hash(&format!("{}:lockout:{lockout_ms}", self.params_fingerprint));
        }
        self
    }
}
