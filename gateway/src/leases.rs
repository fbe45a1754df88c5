//! `[store] leases`: leased quota for hot keys (`RedisStore::with_leases`).
//!
//! ```toml
//! [store]
//! backend = "redis"
//! leases = true                 # the defaults, or a table:
//! # leases = { period = "100ms", max_fraction = 0.1, idle = "1s" }
//! ```
//!
//! Off by default. Only with a Redis backend (the memory store decides in process
//! already); limits with the sliding-window log are never leased.

use std::time::Duration;

use serde::Deserialize;

use crate::config::ConfigError;

/// As written: `true`/`false`, or a table of parameters.
#[derive(Debug, Deserialize)]
#[serde(untagged)]
pub(crate) enum RawLeases {
    Switch(bool),
    Table(RawLeaseTable),
}

#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields)]
pub(crate) struct RawLeaseTable {
    period: Option<String>,
    max_fraction: Option<f64>,
    idle: Option<String>,
}

/// Validated lease parameters (unset: the library's defaults).
#[derive(Debug, Clone, Default, PartialEq)]
pub(crate) struct LeasesConfig {
    pub(crate) period: Option<Duration>,
    pub(crate) max_fraction: Option<f64>,
    pub(crate) idle: Option<Duration>,
}

fn duration(field: &str, value: Option<&str>) -> Result<Option<Duration>, ConfigError> {
    value
        .map(|v| {
            humantime::parse_duration(v).map_err(|e| {
                ConfigError::new(
                    field,
                    format!("{v:?} is not a duration such as \"100ms\" ({e})"),
                )
            })
        })
        .transpose()
}

impl RawLeases {
    /// `None`: leases off. `redis` says whether the backend is a Redis one.
    pub(crate) fn validate(self, redis: bool) -> Result<Option<LeasesConfig>, ConfigError> {
        let table = match self {
            Self::Switch(false) => return Ok(None),
            Self::Switch(true) => RawLeaseTable::default(),
            Self::Table(table) => table,
        };
        if !redis {
            return Err(ConfigError::new(
                "store.leases",
                "needs a Redis backend (the memory store decides in process already)",
            ));
        }
        let config = LeasesConfig {
            period: duration("store.leases.period", table.period.as_deref())?,
            max_fraction: table.max_fraction,
            idle: duration("store.leases.idle", table.idle.as_deref())?,
        };
        // The library's own checks, so that a bad value fails at load.
        #[cfg(feature = "redis")]
        config.library()?;
        Ok(Some(config))
    }
}

impl LeasesConfig {
    /// The library's [`LeaseConfig`](tollgate::store::LeaseConfig).
    #[cfg(feature = "redis")]
    pub(crate) fn library(&self) -> Result<tollgate::store::LeaseConfig, ConfigError> {
        let field = |e: tollgate::ConfigError| {
            ConfigError::new(format!("store.{}", e.field()), e.to_string())
        };
        let mut config = tollgate::store::LeaseConfig::new();
        if let Some(period) = self.period {
            config = config.with_period(period).map_err(field)?;
        }
        if let Some(fraction) = self.max_fraction {
            config = config.with_max_fraction(fraction).map_err(field)?;
        }
        if let Some(idle) = self.idle {
            config = config.with_idle(idle).map_err(field)?;
        }
        Ok(config)
    }
}
