//! [`Algorithm`]: which rate-limit algorithm a [`Limit`](super::Limit) runs.

use std::{fmt, str::FromStr};

use crate::ConfigError;

/// The rate-limit algorithms. Each is implemented twice, with the same integer arithmetic:
/// as a pure reference model (which the in-memory store runs) and as a Lua function in the
/// Redis script.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub enum Algorithm {
    /// At most `limit` per window; windows are aligned to multiples of `window` since the
    /// Unix epoch, so up to `2 * limit` can pass around a window boundary.
    FixedWindow,
    /// At most `limit` in *any* interval of length `window` (an exact log of requests).
    SlidingWindow,
    /// The previous window's count weighted by how much of it still overlaps the sliding
    /// window, plus the current count. O(1) state; approximate.
    SlidingWindowCounter,
    /// A bucket of `burst` tokens refilled at `limit / window`.
    TokenBucket,
    /// The generic cell rate algorithm: the token bucket's decisions from one timestamp.
    Gcra,
}

impl Algorithm {
    /// Every algorithm, in the order of the docs (a slice: the enum is non-exhaustive).
    pub const ALL: &'static [Self] = &[
        Self::FixedWindow,
        Self::SlidingWindow,
        Self::SlidingWindowCounter,
        Self::TokenBucket,
        Self::Gcra,
    ];
}

impl Algorithm {
    /// The name used in config files and key ids (`fixed_window`, `sliding_window`, ...).
    pub const fn as_str(self) -> &'static str {
        match self {
            Self::FixedWindow => "fixed_window",
            Self::SlidingWindow => "sliding_window",
            Self::SlidingWindowCounter => "sliding_window_counter",
            Self::TokenBucket => "token_bucket",
            Self::Gcra => "gcra",
        }
    }

    /// The short code that goes into Redis keys and the script's arguments.
    #[cfg_attr(not(feature = "redis"), allow(dead_code))]
    pub(crate) const fn code(self) -> u8 {
        match self {
            Self::FixedWindow => 1,
            Self::SlidingWindow => 2,
            Self::SlidingWindowCounter => 3,
            Self::TokenBucket => 4,
            Self::Gcra => 5,
        }
    }

    pub(super) const fn key_tag(self) -> &'static str {
        match self {
            // Earlier builds used "fw" for a "<start>:<count>" string: a new name, so
            // that the counts INCRBY updates in place never meet that format in one key.
            Self::FixedWindow => "fw2",
            // Earlier builds used "sw" for one sorted-set member per unit: a new name,
            // so that weighted entries never meet that format in one key.
            Self::SlidingWindow => "sw2",
            Self::SlidingWindowCounter => "swc",
            Self::TokenBucket => "tb",
            Self::Gcra => "gcra",
        }
    }

    pub(super) const fn has_burst(self) -> bool {
        matches!(self, Self::TokenBucket | Self::Gcra)
    }
}

impl fmt::Display for Algorithm {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

impl FromStr for Algorithm {
    type Err = ConfigError;

    fn from_str(s: &str) -> Result<Self, Self::Err> {
        Ok(match s {
            "fixed_window" => Self::FixedWindow,
            "sliding_window" => Self::SlidingWindow,
            "sliding_window_counter" => Self::SlidingWindowCounter,
            "token_bucket" => Self::TokenBucket,
            "gcra" => Self::Gcra,
            other => {
                return Err(ConfigError::new(
                    "algorithm",
                    format!(
                        "must be one of fixed_window, sliding_window, sliding_window_counter, \
                         token_bucket, gcra (got {other:?})"
                    ),
                ));
            }
        })
    }
}
