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

/// The shares of the limit kept for more critical requests: default requests may not use
/// what is kept for critical ones, sheddable ones neither that nor what is kept for
/// default ones.
///
/// What is kept for a priority follows its demand: the larger of its static share of the
/// limit ([`critical_share`](Self::critical_share), 10% by default; rounded down to whole
/// requests) and 1.25x the most requests of that priority in flight at once during the
/// current and the last window (rounded up). So when critical traffic needs 40% of the
/// capacity during an overload, 50% is kept for it, and the sheddable requests it pushes
/// out are what gets shed; when it needs little, the static share still stands as a
/// floor. The static shares alone would hold back a fixed 10%: a burst of critical
/// requests beyond it would be shed while sheddable ones still held most of the limit.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Shares {
    critical: f64,
    default: f64,
}

impl Default for Shares {
    /// At least 10% kept for critical requests, another 10% for default and critical ones.
    fn default() -> Self {
        Self {
            critical: 0.1,
            default: 0.1,
        }
    }
}

impl Shares {
    /// Keeps at least `critical` of the limit for critical requests and `default` more for
    /// default (and critical) ones, more while their demand needs it. Refused when a share
    /// is negative or they add up to 1 or more.
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

    /// How many requests of `priority` and less critical ones may be in flight under
    /// `limit` (besides all of them together: `limit`), when at most `peaks[p]` requests of
    /// priority `p` were in flight at once lately (indexed by `Priority as usize`).
    pub(crate) fn allowed(&self, limit: u32, priority: Priority, peaks: [u32; 3]) -> u32 {
        let kept = |share: f64, peak: u32| {
            let demand = (f64::from(peak) * DEMAND_HEADROOM).ceil() as u32;
            ((f64::from(limit) * share).floor() as u32).max(demand)
        };
        let kept = match priority {
            Priority::Critical => 0,
            Priority::Default => kept(self.critical, peaks[Priority::Critical as usize]),
            Priority::Sheddable => kept(self.critical, peaks[Priority::Critical as usize])
                .saturating_add(kept(self.default, peaks[Priority::Default as usize])),
        };
        limit - kept.min(limit)
    }
}

/// What is kept for a priority beyond the most of it lately in flight at once: room for
/// its demand to grow until the next window sees it.
const DEMAND_HEADROOM: f64 = 1.25;
