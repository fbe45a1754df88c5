//! [`Limit`]: an algorithm and its quota, validated when it is built.

use std::{
    fmt,
    hash::{Hash, Hasher},
    str::FromStr,
    sync::Arc,
    time::Duration,
};

use crate::ConfigError;

mod algorithm;
mod in_flight;
mod lockout;
#[cfg(test)]
mod tests;

pub use algorithm::Algorithm;
pub use in_flight::{DEFAULT_IN_FLIGHT_RETRY_AFTER, DEFAULT_IN_FLIGHT_TTL, InFlightLimit};

/// The longest window a limit may have.
pub const MAX_WINDOW: Duration = Duration::from_secs(366 * 24 * 3600);

/// The largest `limit` of a [`Algorithm::SlidingWindow`]: it keeps one entry per request
/// in the window, so its memory grows with the limit. Use
/// [`Algorithm::SlidingWindowCounter`] above this.
pub const MAX_SLIDING_WINDOW_LIMIT: u32 = 100_000;

/// `capacity * window_ms` must stay below this, so that every intermediate value of the
/// algorithms is an integer that a Lua double (53-bit mantissa) holds exactly.
const MAX_CAPACITY_TIMES_WINDOW: u128 = 1 << 50;

/// An algorithm with its quota: `limit` requests per `window` (and a `burst` for the
/// bucket algorithms).
///
/// Built only through the constructors, which reject what cannot work (a zero limit, a
/// zero window, a zero burst) with a [`ConfigError`] naming the field, so a bad value
/// fails at startup and never at request time.
///
/// ```
/// use std::time::Duration;
/// use tollgate::Limit;
///
/// let per_second = Limit::token_bucket(10, Duration::from_secs(1))?.with_burst(20)?;
/// let per_hour = Limit::fixed_window(1000, Duration::from_secs(3600))?.with_name("hourly")?;
/// assert_eq!(per_second.burst(), 20);
/// assert!(Limit::fixed_window(0, Duration::from_secs(1)).is_err());
/// # Ok::<(), tollgate::ConfigError>(())
/// ```
#[derive(Clone, PartialEq, Eq, Hash)]
pub struct Limit {
    algorithm: Algorithm,
    limit: u32,
    window_ms: u64,
    burst: u32,
    name: Option<Arc<str>>,
    /// What a change of `limit` or `burst` does to the state. See [`OnChange`].
    on_change: OnChange,
    /// The last part of the store key. [`OnChange::Reset`]:
    /// `[name:]algo:limit:window_ms[:burst]`, naming every parameter, so changing a limit
    /// never reads state written by another. [`OnChange::CarryOver`]:
    /// `name:algo:window_ms`, so a changed `limit` or `burst` reads the same state.
    id: Arc<str>,
    /// A 64-bit hash of `id`, for in-process maps: the state's identity.
    fingerprint: u64,
    /// A 64-bit hash of every parameter, for caches of decisions (which a changed
    /// `limit` invalidates even when the state carries over).
    params_fingerprint: u64,
    /// How long a key stays blocked after this limit denied it (0: never). Not part of
    /// `id`: a changed lockout keeps the spent budget. See [`Limit::with_lockout`].
    lockout_ms: u64,
    /// Counting after the response leaves this limit's charge alone. See
    /// [`Limit::counted_up_front`].
    up_front: bool,
    /// Whether the lockout counts a request's units as pending until its response settles
    /// them (a layer that counts after the response sets it): only kept units start a
    /// block. Not part of `id`. See [`Limit::pending_until_settled`].
    pending: bool,
}

/// What happens to a limit's state (its spent budget) when a rules change gives it a new
/// `limit` or `burst`; see [`Limit::with_on_change`]. A limit that does not change keeps its
/// state either way, and a changed algorithm or window always starts fresh: the state's
/// meaning depends on both.
///
/// Carrying over, per algorithm: the new parameters apply to the state as it is.
/// - `fixed_window`, `sliding_window_counter`: the units counted in the current (and
///   previous) window stay counted; `remaining` is the new limit minus them, 0 when they
///   exceed it.
/// - `sliding_window`: every request still in the window stays logged.
/// - `token_bucket`: the tokens in the bucket stay, at most the new `burst`; it refills
///   at the new rate from its last update on.
/// - `gcra`: the theoretical arrival time stays, so the time until the bucket is full
///   again stays; spent units scale with the rate (50 of 100 spent become 100 of 200).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default)]
#[non_exhaustive]
pub enum OnChange {
    /// A changed limit starts with a full budget (its store key names every parameter).
    #[default]
    Reset,
    /// A changed limit keeps its state (its store key is its name, algorithm and window).
    CarryOver,
}

impl OnChange {
    /// The config name: `reset` or `carry_over`.
    pub const fn as_str(self) -> &'static str {
        match self {
            Self::Reset => "reset",
            Self::CarryOver => "carry_over",
        }
    }
}

impl FromStr for OnChange {
    type Err = ConfigError;

    fn from_str(s: &str) -> Result<Self, Self::Err> {
        match s {
            "reset" => Ok(Self::Reset),
            "carry_over" => Ok(Self::CarryOver),
            other => Err(ConfigError::new(
                "on_change",
                format!("must be reset or carry_over (got {other:?})"),
            )),
        }
    }
}

impl fmt::Debug for Limit {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Limit")
            .field("algorithm", &self.algorithm)
            .field("limit", &self.limit)
            .field("window", &self.window())
            .field("burst", &self.burst)
            .field("name", &self.name)
            .field("on_change", &self.on_change)
            .field("lockout", &self.lockout())
            .finish()
    }
}

impl Limit {
    /// `limit` and `window` for any `algorithm`; `burst` starts equal to `limit`.
    ///
    /// # Errors
    ///
    /// When `limit` is 0, `window` is under 1ms, not a whole number of milliseconds or
    /// over [`MAX_WINDOW`], a sliding window's limit is over
    /// [`MAX_SLIDING_WINDOW_LIMIT`], or `limit * window` is too large to count exactly.
    pub fn new(algorithm: Algorithm, limit: u32, window: Duration) -> Result<Self, ConfigError> {
        if limit == 0 {
            return Err(ConfigError::new("limit", "must be at least 1 (got 0)"));
        }
        if window < Duration::from_millis(1) {
            return Err(ConfigError::new(
                "window",
                format!("must be at least 1ms (got {window:?})"),
            ));
        }
        if !window.subsec_nanos().is_multiple_of(1_000_000) {
            return Err(ConfigError::new(
                "window",
                format!("must be a whole number of milliseconds (got {window:?})"),
            ));
        }
        if window > MAX_WINDOW {
            return Err(ConfigError::new(
                "window",
                format!("must be at most 366 days (got {window:?})"),
            ));
        }
        if algorithm == Algorithm::SlidingWindow && limit > MAX_SLIDING_WINDOW_LIMIT {
            return Err(ConfigError::new(
                "limit",
                format!(
                    "of a sliding_window must be at most {MAX_SLIDING_WINDOW_LIMIT}, since it \
                     stores one entry per request (got {limit}); use sliding_window_counter"
                ),
            ));
        }
        let window_ms = window.as_millis() as u64;
        check_capacity("limit", limit, window_ms)?;
        Ok(Self::build(
            algorithm,
            limit,
            window_ms,
            limit,
            None,
            OnChange::Reset,
        ))
    }

    /// At most `limit` per aligned window. See [`Algorithm::FixedWindow`].
    ///
    /// # Errors
    ///
    /// See [`Limit::new`].
    pub fn fixed_window(limit: u32, window: Duration) -> Result<Self, ConfigError> {
        Self::new(Algorithm::FixedWindow, limit, window)
    }

    /// At most `limit` in any interval of `window`. See [`Algorithm::SlidingWindow`].
    ///
    /// # Errors
    ///
    /// See [`Limit::new`].
    pub fn sliding_window(limit: u32, window: Duration) -> Result<Self, ConfigError> {
        Self::new(Algorithm::SlidingWindow, limit, window)
    }

    /// The approximate, O(1) sliding window. See [`Algorithm::SlidingWindowCounter`].
    ///
    /// # Errors
    ///
    /// See [`Limit::new`].
    pub fn sliding_window_counter(limit: u32, window: Duration) -> Result<Self, ConfigError> {
        Self::new(Algorithm::SlidingWindowCounter, limit, window)
    }

    /// `limit` tokens per `window`, bucket size `limit` (change it with
    /// [`with_burst`](Self::with_burst)). See [`Algorithm::TokenBucket`].
    ///
    /// # Errors
    ///
    /// See [`Limit::new`].
    pub fn token_bucket(limit: u32, window: Duration) -> Result<Self, ConfigError> {
        Self::new(Algorithm::TokenBucket, limit, window)
    }

    /// `limit` per `window` spaced evenly, with a tolerance of `burst` (default `limit`).
    /// See [`Algorithm::Gcra`].
    ///
    /// # Errors
    ///
    /// See [`Limit::new`].
    pub fn gcra(limit: u32, window: Duration) -> Result<Self, ConfigError> {
        Self::new(Algorithm::Gcra, limit, window)
    }

    /// `limit` per second, as a fixed window.
    ///
    /// # Errors
    ///
    /// When `limit` is 0.
    pub fn per_second(limit: u32) -> Result<Self, ConfigError> {
        Self::fixed_window(limit, Duration::from_secs(1))
    }

    /// `limit` per minute, as a fixed window.
    ///
    /// # Errors
    ///
    /// When `limit` is 0.
    pub fn per_minute(limit: u32) -> Result<Self, ConfigError> {
        Self::fixed_window(limit, Duration::from_secs(60))
    }

    /// `limit` per hour, as a fixed window.
    ///
    /// # Errors
    ///
    /// When `limit` is 0.
    pub fn per_hour(limit: u32) -> Result<Self, ConfigError> {
        Self::fixed_window(limit, Duration::from_secs(3600))
    }

    /// The bucket size of a token bucket or GCRA: how many requests may pass at once.
    ///
    /// # Errors
    ///
    /// When `burst` is 0, or the algorithm has no burst (the window algorithms).
    pub fn with_burst(self, burst: u32) -> Result<Self, ConfigError> {
        if !self.algorithm.has_burst() {
            return Err(ConfigError::new(
                "burst",
                format!(
                    "applies to token_bucket and gcra only (this limit is {})",
                    self.algorithm
                ),
            ));
        }
        if burst == 0 {
            return Err(ConfigError::new("burst", "must be at least 1 (got 0)"));
        }
        check_capacity("burst", burst, self.window_ms)?;
        Ok(Self::build(
            self.algorithm,
            self.limit,
            self.window_ms,
            burst,
            self.name,
            self.on_change,
        )
        .locking_out(self.lockout_ms))
    }

    /// A name for this limit: the policy name in the `RateLimit` headers and a part of
    /// its store key, so that two routes with equal limits on one store keep separate
    /// budgets (or share one, by giving both the same name).
    ///
    /// # Errors
    ///
    /// When `name` is empty, longer than 64 bytes, or has characters other than ASCII
    /// letters, digits, `-`, `_` and `.`.
    pub fn with_name(self, name: impl Into<String>) -> Result<Self, ConfigError> {
        let name = name.into();
        let valid = !name.is_empty()
            && name.len() <= 64
            && name
                .bytes()
                .all(|b| b.is_ascii_alphanumeric() || matches!(b, b'-' | b'_' | b'.'));
        if !valid {
            return Err(ConfigError::new(
                "name",
                format!("must be 1 to 64 of A-Z a-z 0-9 - _ . (got {name:?})"),
            ));
        }
        Ok(Self::build(
            self.algorithm,
            self.limit,
            self.window_ms,
            self.burst,
            Some(name.into()),
            self.on_change,
        )
        .locking_out(self.lockout_ms))
    }

    /// What a rules change that gives this limit a new `limit` or `burst` does to its
    /// state: [`OnChange::Reset`] (the default) starts fresh, [`OnChange::CarryOver`]
    /// keeps the spent budget, as [`OnChange`] defines per algorithm. See
    /// [`RulesHandle`](crate::rules::RulesHandle).
    ///
    /// Carrying over identifies the state by the limit's name, algorithm and window, so
    /// two limits of one rule set must not share all three.
    ///
    /// # Errors
    ///
    /// [`OnChange::CarryOver`] for a limit without a [name](Self::with_name) (field `name`):
    /// only a name says which limit a changed one was.
    pub fn with_on_change(self, on_change: OnChange) -> Result<Self, ConfigError> {
        if on_change == OnChange::CarryOver && self.name.is_none() {
            return Err(ConfigError::new(
                "name",
                "is needed to carry state over (on_change = carry_over): name the limit first",
            ));
        }
        Ok(Self::build(
            self.algorithm,
            self.limit,
            self.window_ms,
            self.burst,
            self.name,
            on_change,
        )
        .locking_out(self.lockout_ms))
    }

    fn build(
        algorithm: Algorithm,
        limit: u32,
        window_ms: u64,
        burst: u32,
        name: Option<Arc<str>>,
        on_change: OnChange,
    ) -> Self {
        let mut full = String::new();
        if let Some(name) = &name {
            // Names are validated to key-safe characters.
            full.push_str(name);
            full.push(':');
        }
        full.push_str(algorithm.key_tag());
        full.push(':');
        full.push_str(itoa::Buffer::new().format(limit));
        full.push(':');
        full.push_str(itoa::Buffer::new().format(window_ms));
        if algorithm.has_burst() {
            full.push(':');
            full.push_str(itoa::Buffer::new().format(burst));
        }
        let id = match (&name, on_change) {
            // Three parts where a reset id has at least four (a named one, five or six):
            // the two never collide.
            (Some(name), OnChange::CarryOver) => {
                format!("{name}:{}:{window_ms}", algorithm.key_tag())
            }
            _ => full.clone(),
        };
        Self {
            algorithm,
            limit,
            window_ms,
            burst,
            name,
            on_change,
            fingerprint: fixed_hash(&id),
            params_fingerprint: fixed_hash(&full),
            id: id.into(),
            lockout_ms: 0,
            up_front: false,
            pending: false,
        }
    }

    /// The algorithm.
    pub fn algorithm(&self) -> Algorithm {
        self.algorithm
    }

    /// Requests (cost units) allowed per window.
    pub fn limit(&self) -> u32 {
        self.limit
    }

    /// The window.
    pub fn window(&self) -> Duration {
        Duration::from_millis(self.window_ms)
    }

    /// The bucket size (equals `limit` for the window algorithms).
    pub fn burst(&self) -> u32 {
        self.burst
    }

    /// The name given with [`named`](Self::with_name), if any.
    pub fn name(&self) -> Option<&str> {
        self.name.as_deref()
    }

    /// How many cost units fit at once: `burst` for the buckets, `limit` otherwise. A
    /// request costing more is always denied.
    pub fn capacity(&self) -> u32 {
        if self.algorithm.has_burst() {
            self.burst
        } else {
            self.limit
        }
    }

    pub(crate) fn window_ms(&self) -> u64 {
        self.window_ms
    }

    /// The last part of this limit's store key.
    #[cfg_attr(not(feature = "redis"), allow(dead_code))]
    pub(crate) fn id(&self) -> &str {
        &self.id
    }

    /// A hash of [`id`](Self::id): what in-process maps key a limit by.
    pub(crate) fn fingerprint(&self) -> u64 {
        self.fingerprint
    }

    /// A hash of every parameter: what caches of decisions key a limit by.
    #[cfg_attr(not(feature = "redis"), allow(dead_code))]
    pub(crate) fn params_fingerprint(&self) -> u64 {
        self.params_fingerprint
    }

    /// This limit with its state kept apart under `scope` (a [plan](crate::plan::Plan)'s name):
    /// the same parameters under another store key, `@<scope>:<id>`. `@` is not a name
    /// character, so a scoped id never equals an unscoped one.
    pub(crate) fn scoped(&self, scope: &str) -> Self {
        let mut limit = self.clone();
        let id = format!("@{scope}:{}", self.id);
        limit.fingerprint = fixed_hash(&id);
        limit.params_fingerprint = fixed_hash(&format!("@{scope}:{:x}", self.params_fingerprint));
        limit.id = id.into();
        limit
    }

    /// What a change of `limit` or `burst` does to the state. See [`OnChange`].
    pub fn state_on_change(&self) -> OnChange {
        self.on_change
    }
}

/// Fixed keys: equal strings give equal hashes in every store and process run.
fn fixed_hash(text: &str) -> u64 {
    let mut hasher = std::hash::DefaultHasher::new();
    text.hash(&mut hasher);
    hasher.finish()
}

fn check_capacity(field: &'static str, amount: u32, window_ms: u64) -> Result<(), ConfigError> {
    if u128::from(amount) * u128::from(window_ms) >= MAX_CAPACITY_TIMES_WINDOW {
        return Err(ConfigError::new(
            field,
            format!(
                "times the window in milliseconds must stay below 2^50 to be counted exactly \
                 (got {amount} x {window_ms}ms)"
            ),
        ));
    }
    Ok(())
}
