//! How leasing is configured.

use std::time::Duration;

use crate::ConfigError;

/// How a [`RedisStore`](crate::store::RedisStore) leases quota
/// ([`with_leases`](crate::store::RedisStore::with_leases)).
///
/// ```
/// use std::time::Duration;
/// use tollgate::store::LeaseConfig;
///
/// let config = LeaseConfig::new()
///     .with_period(Duration::from_millis(200))?
///     .with_max_fraction(0.05)?
///     .with_idle(Duration::from_secs(2))?;
/// # Ok::<(), tollgate::ConfigError>(())
/// ```
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct LeaseConfig {
    pub(super) period_ms: u64,
    pub(super) max_fraction: f64,
    pub(super) idle_ms: u64,
    pub(super) keys: usize,
}

impl Default for LeaseConfig {
    fn default() -> Self {
        Self {
            period_ms: 100,
            max_fraction: 0.1,
            idle_ms: 1_000,
            keys: 10_000,
        }
    }
}

impl LeaseConfig {
    /// The defaults: a period of 100 ms, at most a tenth of a limit per lease, returned
    /// after 1 s idle, 10 000 keys watched.
    pub fn new() -> Self {
        Self::default()
    }

    /// A lease holds about this much of the node's traffic of its key (100 ms by
    /// default), and a key is hot after two requests within it. Longer: fewer Redis
    /// calls, more units held per node.
    ///
    /// # Errors
    ///
    /// `period` outside 1 ms ..= 60 s.
    pub fn with_period(mut self, period: Duration) -> Result<Self, ConfigError> {
        let ms = period.as_millis();
        if !(1..=60_000).contains(&ms) {
            return Err(ConfigError::new(
                "leases.period",
                format!("must be between 1ms and 60s (got {period:?})"),
            ));
        }
        self.period_ms = ms as u64;
        Ok(self)
    }

    /// A lease holds at most this fraction of the smallest limit it covers (0.1 by
    /// default), refills included: what one node can hold back from the others. Limits too small for one
    /// unit are not leased.
    ///
    /// # Errors
    ///
    /// `fraction` outside (0, 0.5].
    pub fn with_max_fraction(mut self, fraction: f64) -> Result<Self, ConfigError> {
        if !(fraction > 0.0 && fraction <= 0.5) {
            return Err(ConfigError::new(
                "leases.max_fraction",
                format!("must be above 0 and at most 0.5 (got {fraction})"),
            ));
        }
        self.max_fraction = fraction;
        Ok(self)
    }

    /// A lease not spent from for this long goes back to Redis (1 s by default), so that
    /// other nodes can spend it.
    ///
    /// # Errors
    ///
    /// `idle` outside 10 ms ..= 1 h.
    pub fn with_idle(mut self, idle: Duration) -> Result<Self, ConfigError> {
        let ms = idle.as_millis();
        if !(10..=3_600_000).contains(&ms) {
            return Err(ConfigError::new(
                "leases.idle",
                format!("must be between 10ms and 1h (got {idle:?})"),
            ));
        }
        self.idle_ms = ms as u64;
        Ok(self)
    }

    /// How many keys' traffic is watched at most (10 000 by default; the coldest are
    /// forgotten first). Leases held are never forgotten before they go back.
    pub fn with_max_keys(mut self, keys: usize) -> Self {
        self.keys = keys.max(1);
        self
    }
}
