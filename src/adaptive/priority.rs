//! [`Priority`] and [`Shares`]: how much of the limit each request may use.

use crate::ConfigError;

/// How critical a request is: when the limit is reached, the least critical are shed
/// first. Ordered: `Sheddable < Default < Critical`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash, Default)]
pub enum Priority {
    /// Shed first: batch jobs, prefetches, retries.
    Sheddable,
    /// What a request is without a priority.
    #[default]
    Default,
    /// Served while any capacity is left: logins, checkouts, health checks.
    Critical,
}

impl Priority {
    /// The priority's name: `critical`, `default` or `sheddable` (also a metrics label).
    pub fn as_str(self) -> &'static str {
        match self {
            Self::Sheddable => "sheddable",
            Self::Default => "default",
            Self::Critical => "critical",
        }
    }

    /// The priority named `name` (`critical`, `default`, `sheddable`), as a header or a
    /// config file gives it; `None` for any other value.
    pub fn from_name(name: &str) -> Option<Self> {
        match name {
            "critical" => Some(Self::Critical),
            "default" => Some(Self::Default),
            "sheddable" => Some(Self::Sheddable),
            _ => None,
        }
    }
}

/// The shares of the limit that only more critical requests may use: default requests may
/// not use the last [`critical_share`](Self::critical_share) (10% by default), sheddable
/// ones not the last `critical_share + default_share` (20%). Each share is rounded down to whole requests, so a
/// limit of 1 to 4 keeps nothing apart.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Shares {
    critical: f64,
    default: f64,
}

impl Default for Shares {
    /// 10% kept for critical requests, another 10% for default and critical ones.
    fn default() -> Self {
        Self {
            critical: 0.1,
            default: 0.1,
        }
    }
}

impl Shares {
    /// Keeps `critical` of the limit for critical requests and `default` more for default
    /// (and critical) ones. Refused when a share is negative or they add up to 1 or more.
    pub fn new(critical: f64, default: f64) -> Result<Self, ConfigError> {
        let valid = |share: f64| (0.0..1.0).contains(&share);
        if !valid(critical) || !valid(default) || critical + default >= 1.0 {
            return Err(ConfigError::new(
                "adaptive.shares",
                format!(
                    "must be in 0..1 and add up to less than 1 (got critical {critical}, \
                     default {default})"
                ),
            ));
        }
        Ok(Self { critical, default })
    }

    /// The share only critical requests may use.
    pub fn critical_share(&self) -> f64 {
        self.critical
    }

    /// The share only default and critical requests may use, beyond the critical one.
    pub fn default_share(&self) -> f64 {
        self.default
    }

    /// How many requests of `priority` may be in flight under `limit`.
    pub(crate) fn allowed(&self, limit: u32, priority: Priority) -> u32 {
        let kept = match priority {
            Priority::Critical => 0.0,
            Priority::Default => self.critical,
            Priority::Sheddable => self.critical + self.default,
        };
        let kept = (f64::from(limit) * kept).floor() as u32;
        limit - kept.min(limit)
    }
}
