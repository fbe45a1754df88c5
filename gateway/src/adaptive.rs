//! `[routes.adaptive]`: an adaptive in-flight limit on a route (tollgate's
//! `RateLimitLayer::with_adaptive`), shedding the least critical requests first.
//!
//! ```toml
//! [routes.adaptive]
//! algorithm = "gradient"        # gradient | aimd
//! max = 200
//! priority_header = "x-priority" # critical | default | sheddable
//! ```
//!
//! Every field is optional; unset ones take the library's defaults (README.md, "Adaptive
//! concurrency"). The values are checked here, each error naming its field, and then by
//! the library's own builders, so that what loads also builds.

use std::time::Duration;

use http::{HeaderName, StatusCode};
use serde::Deserialize;
use tollgate::adaptive::{AdaptiveLimit, Aimd, Algorithm, Gradient, Shares};

use crate::config::ConfigError;

/// The limit a route starts at without `initial` (the library's default, within `min..=max`).
const DEFAULT_INITIAL: u32 = tollgate::adaptive::DEFAULT_BOUNDS.1;

/// The longest `window` and `retry_after`: longer is a mistake.
const MAX_DURATION: Duration = Duration::from_secs(3600);

/// The most keys `per_key` may keep a limit for (each is a small state in memory).
const MAX_KEYS: u64 = 10_000_000;

/// As written.
#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields)]
pub(crate) struct RawAdaptive {
    algorithm: Option<String>,
    min: Option<u32>,
    initial: Option<u32>,
    max: Option<u32>,
    window: Option<String>,
    min_samples: Option<u32>,
    critical_share: Option<f64>,
    default_share: Option<f64>,
    priority_header: Option<String>,
    shed_status: Option<u16>,
    retry_after: Option<String>,
    #[serde(default)]
    shadow: bool,
    per_key: Option<u64>,
    // aimd
    backoff: Option<f64>,
    increase: Option<u32>,
    slow: Option<String>,
    // gradient
    tolerance: Option<f64>,
    smoothing: Option<f64>,
    long_window: Option<u32>,
}

/// A route's validated `[routes.adaptive]`.
#[derive(Debug, Clone, PartialEq)]
pub(crate) struct AdaptiveConfig {
    pub(crate) limit: AdaptiveLimit,
    /// The header whose value (`critical`, `default`, `sheddable`) is a request's
    /// priority; `None`: every request is `default`.
    pub(crate) priority_header: Option<HeaderName>,
    /// 503 (default) or 429.
    pub(crate) shed_status: StatusCode,
    /// The `Retry-After` of a shed request.
    pub(crate) retry_after: Duration,
    /// Shed requests are counted and let through.
    pub(crate) shadow: bool,
    /// One limit per key of the layer (at most this many keys), instead of one per route.
    pub(crate) per_key: Option<usize>,
}

impl RawAdaptive {
    /// Validates the section of the route at `at` (`routes[0]`).
    pub(crate) fn validate(self, at: &str) -> Result<AdaptiveConfig, ConfigError> {
        let at = format!("{at}.adaptive");
        let field = |name: &str| format!("{at}.{name}");
        // The library's errors name `adaptive.<field>`: put the route in front.
        let lib = |e: tollgate::ConfigError| {
            let name = e.field().strip_prefix("adaptive.").unwrap_or(e.field());
            ConfigError::new(field(name), e.to_string())
        };
        let algorithm = self.algorithm(&at, &lib)?;
        let (min, initial, max) = self.bounds(&at)?;
        let window = match &self.window {
            None => tollgate::adaptive::DEFAULT_WINDOW,
            Some(value) => duration(&field("window"), value)?,
        };
        let min_samples = self
            .min_samples
            .unwrap_or(tollgate::adaptive::DEFAULT_MIN_SAMPLES);
        if min_samples == 0 {
            return Err(ConfigError::new(
                field("min_samples"),
                "must be at least 1 (got 0)",
            ));
        }
        let shares = self.shares(&at)?;
        let limit = AdaptiveLimit::new(algorithm)
            .with_bounds(min, initial, max)
            .map_err(lib)?
            .with_window(window, min_samples)
            .map_err(lib)?
            .with_shares(shares);
        let priority_header = self
            .priority_header
            .as_deref()
            .map(|name| {
                HeaderName::from_bytes(name.trim().as_bytes()).map_err(|_| {
                    ConfigError::new(
                        field("priority_header"),
                        format!("{name:?} is not a valid header name"),
                    )
                })
            })
            .transpose()?;
        let shed_status = match self.shed_status {
            None | Some(503) => StatusCode::SERVICE_UNAVAILABLE,
            Some(429) => StatusCode::TOO_MANY_REQUESTS,
            Some(other) => {
                return Err(ConfigError::new(
                    field("shed_status"),
                    format!("must be 503 or 429 (got {other})"),
                ));
            }
        };
        let retry_after = match &self.retry_after {
            None => Duration::from_secs(1),
            Some(value) => duration(&field("retry_after"), value)?,
        };
        let per_key = match self.per_key {
            None => None,
            Some(n @ 1..=MAX_KEYS) => Some(usize::try_from(n).map_err(|_| {
                ConfigError::new(
                    field("per_key"),
                    format!("is too large for this machine (got {n})"),
                )
            })?),
            Some(n) => {
                return Err(ConfigError::new(
                    field("per_key"),
                    format!("must be 1 to {MAX_KEYS} keys (got {n})"),
                ));
            }
        };
        let config = AdaptiveConfig {
            limit,
            priority_header,
            shed_status,
            retry_after,
            shadow: self.shadow,
            per_key,
        };
        // The library's own checks, so that what loads also builds.
        config.library().map_err(lib)?;
        Ok(config)
    }
}

impl AdaptiveConfig {
    /// The library's stage ([`Adaptive`](tollgate::adaptive::Adaptive)).
    pub(crate) fn library(&self) -> Result<tollgate::adaptive::Adaptive, tollgate::ConfigError> {
        let mut adaptive = tollgate::adaptive::Adaptive::new(self.limit)
            .with_shed_status(self.shed_status)?
            .with_retry_after(self.retry_after)?
            .with_shadow(self.shadow);
        if let Some(name) = &self.priority_header {
            adaptive = adaptive.with_priority_header(name.clone());
        }
        if let Some(max_keys) = self.per_key {
            adaptive = adaptive.with_per_key(max_keys)?;
        }
        Ok(adaptive)
    }
}

impl RawAdaptive {
    /// `algorithm` and its own knobs; a knob of the other algorithm is refused.
    fn algorithm(
        &self,
        at: &str,
        lib: &impl Fn(tollgate::ConfigError) -> ConfigError,
    ) -> Result<Algorithm, ConfigError> {
        let aimd_knobs = [
            ("backoff", self.backoff.is_some()),
            ("increase", self.increase.is_some()),
            ("slow", self.slow.is_some()),
        ];
        let gradient_knobs = [
            ("tolerance", self.tolerance.is_some()),
            ("smoothing", self.smoothing.is_some()),
            ("long_window", self.long_window.is_some()),
        ];
        let foreign = |knobs: &[(&str, bool)], name: &str| match knobs.iter().find(|(_, set)| *set)
        {
            Some((knob, _)) => Err(ConfigError::new(
                format!("{at}.{knob}"),
                format!("is not a setting of algorithm = \"{name}\""),
            )),
            None => Ok(()),
        };
        match self.algorithm.as_deref().unwrap_or("gradient") {
            "gradient" => {
                foreign(&aimd_knobs, "gradient")?;
                let mut gradient = Gradient::new();
                if let Some(tolerance) = self.tolerance {
                    gradient = gradient.with_tolerance(tolerance).map_err(lib)?;
                }
                if let Some(smoothing) = self.smoothing {
                    gradient = gradient.with_smoothing(smoothing).map_err(lib)?;
                }
                if let Some(windows) = self.long_window {
                    gradient = gradient.with_long_window(windows).map_err(lib)?;
                }
                Ok(gradient.into())
            }
            "aimd" => {
                foreign(&gradient_knobs, "aimd")?;
                let mut aimd = Aimd::new();
                if let Some(backoff) = self.backoff {
                    aimd = aimd.with_backoff(backoff).map_err(lib)?;
                }
                if let Some(increase) = self.increase {
                    aimd = aimd.with_increase(increase).map_err(lib)?;
                }
                if let Some(slow) = &self.slow {
                    aimd = aimd.with_slow(Some(duration(&format!("{at}.slow"), slow)?));
                }
                Ok(aimd.into())
            }
            other => Err(ConfigError::new(
                format!("{at}.algorithm"),
                format!("must be gradient or aimd (got {other:?})"),
            )),
        }
    }

    /// `min`, `initial`, `max`: `1 <= min <= initial <= max`, the error naming the field
    /// that was given out of order. `initial` unset is the library's 20, within the bounds.
    fn bounds(&self, at: &str) -> Result<(u32, u32, u32), ConfigError> {
        let (default_min, _, default_max) = tollgate::adaptive::DEFAULT_BOUNDS;
        let min = self.min.unwrap_or(default_min);
        if min == 0 {
            return Err(ConfigError::new(
                format!("{at}.min"),
                "must be at least 1 (got 0)",
            ));
        }
        let max = self.max.unwrap_or(default_max.max(min));
        if max < min {
            return Err(ConfigError::new(
                format!("{at}.max"),
                format!("must be at least min (got {max}, min {min})"),
            ));
        }
        let initial = self.initial.unwrap_or(DEFAULT_INITIAL.clamp(min, max));
        if !(min..=max).contains(&initial) {
            return Err(ConfigError::new(
                format!("{at}.initial"),
                format!("must be within min..=max (got {initial}, min {min}, max {max})"),
            ));
        }
        Ok((min, initial, max))
    }

    /// `critical_share` and `default_share`.
    fn shares(&self, at: &str) -> Result<Shares, ConfigError> {
        let defaults = Shares::default();
        let critical = self.critical_share.unwrap_or(defaults.critical_share());
        let default = self.default_share.unwrap_or(defaults.default_share());
        for (name, share) in [("critical_share", critical), ("default_share", default)] {
            if !(0.0..1.0).contains(&share) {
                return Err(ConfigError::new(
                    format!("{at}.{name}"),
                    format!("must be at least 0 and below 1 (got {share})"),
                ));
            }
        }
        Shares::new(critical, default).map_err(|_| {
            ConfigError::new(
                format!("{at}.default_share"),
                format!(
                    "critical_share + default_share must be below 1 (got {critical} + {default})"
                ),
            )
        })
    }
}

/// A `window`, `retry_after` or `slow`: a humantime duration from 1 ms to 1 h.
fn duration(field: &str, value: &str) -> Result<Duration, ConfigError> {
    let duration = humantime::parse_duration(value).map_err(|e| {
        ConfigError::new(
            field,
            format!("{value:?} is not a duration such as \"100ms\" or \"1s\" ({e})"),
        )
    })?;
    if duration < Duration::from_millis(1) || duration > MAX_DURATION {
        return Err(ConfigError::new(
            field,
            format!("must be from 1ms to 1h (got {value:?})"),
        ));
    }
    Ok(duration)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::config::Config;

    fn parse(section: &str) -> Result<Option<AdaptiveConfig>, ConfigError> {
        let text = format!(
            "listen = \"127.0.0.1:0\"\n[[routes]]\npath = \"/\"\n[[routes.limits]]\nkey = \"ip\"\n\
             algorithm = \"fixed_window\"\nlimit = 10\nwindow = \"1s\"\n[routes.adaptive]\n{section}\n"
        );
        Config::parse(&text).map(|mut c| c.routes.remove(0).adaptive)
    }

    fn field(section: &str) -> String {
        match parse(section) {
            Ok(config) => panic!("{section:?} was accepted: {config:?}"),
            Err(error) => error.field,
        }
    }

    #[test]
    fn an_empty_section_has_the_library_defaults() {
        let config = parse("").unwrap().unwrap();
        let limit = AdaptiveLimit::new(Gradient::new());
        assert_eq!(config.limit, limit);
        assert_eq!(config.priority_header, None);
        assert_eq!(config.shed_status, StatusCode::SERVICE_UNAVAILABLE);
        assert_eq!(config.retry_after, Duration::from_secs(1));
        assert!(!config.shadow);
        assert_eq!(config.per_key, None);
    }

    #[test]
    fn every_field_is_read() {
        let config = parse(
            r#"
            algorithm = "aimd"
            min = 2
            initial = 5
            max = 50
            window = "250ms"
            min_samples = 4
            critical_share = 0.2
            default_share = 0.3
            priority_header = "X-Priority"
            shed_status = 429
            retry_after = "3s"
            shadow = true
            per_key = 100
            backoff = 0.75
            increase = 2
            slow = "800ms"
            "#,
        )
        .unwrap()
        .unwrap();
        let aimd = Aimd::new()
            .with_backoff(0.75)
            .unwrap()
            .with_increase(2)
            .unwrap()
            .with_slow(Some(Duration::from_millis(800)));
        let limit = AdaptiveLimit::new(aimd)
            .with_bounds(2, 5, 50)
            .unwrap()
            .with_window(Duration::from_millis(250), 4)
            .unwrap()
            .with_shares(Shares::new(0.2, 0.3).unwrap());
        assert_eq!(
            config,
            AdaptiveConfig {
                limit,
                priority_header: Some(HeaderName::from_static("x-priority")),
                shed_status: StatusCode::TOO_MANY_REQUESTS,
                retry_after: Duration::from_secs(3),
                shadow: true,
                per_key: Some(100),
            }
        );
        let gradient = parse("tolerance = 2.0\nsmoothing = 0.5\nlong_window = 30")
            .unwrap()
            .unwrap();
        let want = Gradient::new()
            .with_tolerance(2.0)
            .unwrap()
            .with_smoothing(0.5)
            .unwrap()
            .with_long_window(30)
            .unwrap();
        assert_eq!(gradient.limit.algorithm(), Algorithm::Gradient(want));
    }

    #[test]
    fn initial_unset_stays_within_the_bounds() {
        let small = parse("max = 4").unwrap().unwrap().limit;
        assert_eq!((small.min(), small.initial(), small.max()), (1, 4, 4));
        let large = parse("min = 50").unwrap().unwrap().limit;
        assert_eq!((large.min(), large.initial(), large.max()), (50, 50, 1000));
        let above = parse("min = 2000").unwrap().unwrap().limit;
        assert_eq!(
            (above.min(), above.initial(), above.max()),
            (2000, 2000, 2000)
        );
    }

    #[test]
    fn each_bad_value_is_refused_naming_its_field() {
        for (section, want) in [
            ("algorithm = \"vegas\"", "algorithm"),
            ("min = 0", "min"),
            ("min = 10\nmax = 5", "max"),
            ("max = 0", "max"),
            ("initial = 100\nmax = 50", "initial"),
            ("initial = 1\nmin = 2", "initial"),
            ("window = \"0s\"", "window"),
            ("window = \"soon\"", "window"),
            ("window = \"2h\"", "window"),
            ("min_samples = 0", "min_samples"),
            ("critical_share = 1.0", "critical_share"),
            ("critical_share = -0.1", "critical_share"),
            ("default_share = 1.5", "default_share"),
            ("critical_share = 0.5\ndefault_share = 0.5", "default_share"),
            ("priority_header = \"bad name\"", "priority_header"),
            ("shed_status = 500", "shed_status"),
            ("retry_after = \"0s\"", "retry_after"),
            ("per_key = 0", "per_key"),
            ("algorithm = \"aimd\"\nbackoff = 1.0", "backoff"),
            ("algorithm = \"aimd\"\nincrease = 0", "increase"),
            ("algorithm = \"aimd\"\nslow = \"0s\"", "slow"),
            ("algorithm = \"aimd\"\ntolerance = 2.0", "tolerance"),
            ("tolerance = 0.5", "tolerance"),
            ("smoothing = 0.0", "smoothing"),
            ("long_window = 0", "long_window"),
            ("backoff = 0.8", "backoff"),
            ("algorithm = \"gradient\"\nslow = \"1s\"", "slow"),
        ] {
            assert_eq!(
                field(section),
                format!("routes[0].adaptive.{want}"),
                "{section}"
            );
        }
        // A route without rate limits has no layer to put the stage in.
        let alone = Config::parse(
            "listen = \"127.0.0.1:0\"\n[[routes]]\npath = \"/\"\n[routes.adaptive]\nmax = 5\n",
        )
        .unwrap_err();
        assert_eq!(alone.field, "routes[0].adaptive");
        assert!(alone.message.contains("routes[0].limits"), "{alone}");
        // Unknown fields, as everywhere in the file.
        let unknown = parse("limit = 5").unwrap_err();
        assert!(
            unknown.message.contains("unknown field `limit`"),
            "{unknown}"
        );
    }
}
