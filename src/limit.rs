//! [`Limit`]: an algorithm and its quota, validated when it is built.

use std::{
    fmt,
    hash::{Hash, Hasher},
    str::FromStr,
    sync::Arc,
    time::Duration,
};

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

    const fn key_tag(self) -> &'static str {
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

    const fn has_burst(self) -> bool {
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
    fn locking_out(mut self, lockout_ms: u64) -> Self {
        if lockout_ms > 0 {
            self.lockout_ms = lockout_ms;
            self.params_fingerprint =
                fixed_hash(&format!("{}:lockout:{lockout_ms}", self.params_fingerprint));
        }
        self
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

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn rejects_zero_values_naming_the_field() {
        let err = Limit::fixed_window(0, Duration::from_secs(1)).unwrap_err();
        assert_eq!(err.field(), "limit");
        let err = Limit::fixed_window(1, Duration::ZERO).unwrap_err();
        assert_eq!(err.field(), "window");
        assert!(err.to_string().contains("window"), "{err}");
        let err = Limit::token_bucket(1, Duration::from_secs(1))
            .unwrap()
            .with_burst(0)
            .unwrap_err();
        assert_eq!(err.field(), "burst");
    }

    #[test]
    fn rejects_sub_millisecond_windows_and_huge_limits() {
        assert!(Limit::fixed_window(1, Duration::from_micros(1500)).is_err());
        assert!(Limit::fixed_window(1, MAX_WINDOW + Duration::from_secs(1)).is_err());
        assert!(
            Limit::sliding_window(MAX_SLIDING_WINDOW_LIMIT + 1, Duration::from_secs(1)).is_err()
        );
        assert_eq!(
            Limit::fixed_window(u32::MAX, MAX_WINDOW)
                .unwrap_err()
                .field(),
            "limit"
        );
        assert!(Limit::fixed_window(u32::MAX, Duration::from_secs(60)).is_ok());
    }

    #[test]
    fn burst_only_for_buckets() {
        let err = Limit::fixed_window(5, Duration::from_secs(1))
            .unwrap()
            .with_burst(10)
            .unwrap_err();
        assert_eq!(err.field(), "burst");
    }

    #[test]
    fn ids_name_every_parameter() {
        let a = Limit::token_bucket(5, Duration::from_secs(1)).unwrap();
        let b = a.clone().with_burst(6).unwrap();
        let c = Limit::gcra(5, Duration::from_secs(1)).unwrap();
        let d = a.clone().with_name("api").unwrap();
        assert_eq!(a.id(), "tb:5:1000:5");
        assert_eq!(b.id(), "tb:5:1000:6");
        assert_eq!(c.id(), "gcra:5:1000:5");
        assert_eq!(d.id(), "api:tb:5:1000:5");
        assert!(a.clone().with_name("a b").is_err());
    }

    #[test]
    fn carried_over_ids_leave_out_limit_and_burst() {
        let a = Limit::token_bucket(5, Duration::from_secs(1))
            .unwrap()
            .with_name("api")
            .unwrap()
            .with_on_change(OnChange::CarryOver)
            .unwrap();
        let b = Limit::token_bucket(9, Duration::from_secs(1))
            .unwrap()
            .with_burst(20)
            .unwrap()
            .with_name("api")
            .unwrap()
            .with_on_change(OnChange::CarryOver)
            .unwrap();
        assert_eq!(a.id(), "api:tb:1000");
        assert_eq!(a.id(), b.id());
        assert_eq!(a.fingerprint(), b.fingerprint());
        assert_ne!(a.params_fingerprint(), b.params_fingerprint());
        assert_eq!(b.state_on_change(), OnChange::CarryOver);
        // A new window or algorithm is new state.
        let c = Limit::token_bucket(5, Duration::from_secs(2))
            .unwrap()
            .with_name("api")
            .unwrap()
            .with_on_change(OnChange::CarryOver)
            .unwrap();
        assert_ne!(a.id(), c.id());
        let err = Limit::per_second(1)
            .unwrap()
            .with_on_change(OnChange::CarryOver)
            .unwrap_err();
        assert_eq!(err.field(), "name");
        assert_eq!(
            "carry_over".parse::<OnChange>().unwrap(),
            OnChange::CarryOver
        );
        assert_eq!("keep".parse::<OnChange>().unwrap_err().field(), "on_change");
    }

    #[test]
    fn lockouts_are_validated_and_keep_the_state() {
        let limit = Limit::fixed_window(5, Duration::from_secs(60)).unwrap();
        for bad in [
            Duration::ZERO,
            Duration::from_micros(1500),
            MAX_WINDOW + Duration::from_millis(1),
        ] {
            let err = limit.clone().with_lockout(bad).unwrap_err();
            assert_eq!(err.field(), "lockout", "{bad:?}");
        }
        let locked = limit
            .clone()
            .with_lockout(Duration::from_secs(900))
            .unwrap()
            .with_name("login")
            .unwrap()
            .with_on_change(OnChange::CarryOver)
            .unwrap();
        // Kept through the other builder calls; not part of the state's identity, but of
        // the parameters a cache of decisions tells apart.
        assert_eq!(locked.lockout(), Some(Duration::from_secs(900)));
        let plain = limit
            .with_name("login")
            .unwrap()
            .with_on_change(OnChange::CarryOver)
            .unwrap();
        assert_eq!(plain.lockout(), None);
        assert_eq!(locked.id(), plain.id());
        assert_ne!(locked.params_fingerprint(), plain.params_fingerprint());
        assert_ne!(locked, plain);
        // Two limits of one rule set that differ only in their lockout would share one
        // state: refused, naming the field.
        let err = crate::rules::Rules::new([locked.clone(), plain]).unwrap_err();
        assert_eq!(err.field(), "lockout");
        assert!(crate::rules::Rules::new([locked.clone(), locked]).is_ok());
    }

    #[test]
    fn algorithm_names_round_trip() {
        for &algorithm in Algorithm::ALL {
            assert_eq!(algorithm.as_str().parse::<Algorithm>().unwrap(), algorithm);
        }
        assert_eq!(
            "leaky".parse::<Algorithm>().unwrap_err().field(),
            "algorithm"
        );
    }
}

/// The permit TTL of an [`InFlightLimit`] by default: how long a permit that is never
/// given back (its process died) keeps counting.
pub const DEFAULT_IN_FLIGHT_TTL: Duration = Duration::from_secs(60);

/// The `Retry-After` of a request an [`InFlightLimit`] denies, by default.
pub const DEFAULT_IN_FLIGHT_RETRY_AFTER: Duration = Duration::from_secs(1);

/// At most `max` requests in flight per key: a stage of the
/// [`RateLimitLayer`](crate::RateLimitLayer)'s pipeline, set with
/// [`RateLimitLayer::with_in_flight`](crate::RateLimitLayer::with_in_flight) or
/// [`Rules::with_in_flight`](crate::rules::Rules::with_in_flight).
///
/// A request takes a permit in the **same atomic store call** that decides its rate
/// limits, all-or-nothing: a request the in-flight cap denies spends no units of its rate
/// limits, and one its rate limits deny takes no permit. The permit comes back when the
/// response body ends or is dropped, when the response future is dropped (the client
/// hung up), or when the inner service fails; with counting after the response
/// ([`count_when`](crate::RateLimitLayer::with_count_when), late costs) the permit's release
/// and the adjustment go to the store in one call, once the body ends.
///
/// A request denied by the cap gets the layer's rejection (429, `Retry-After:`
/// [`retry_after`](Self::with_retry_after), gRPC `RESOURCE_EXHAUSTED`); its decision
/// carries the rate limits' fields and, last, one denied [`LimitDecision`](crate::LimitDecision)
/// for the cap (limit `max`, remaining 0).
///
/// # Stores
///
/// - [`MemoryStore`](crate::store::MemoryStore): permits are counted in the process, under the
///   lock that orders the decision; a key with nothing in flight takes no memory.
/// - `RedisStore`: the permits of a key are a sorted set `<prefix>:{<key>}:inflight` (the
///   limits' hash tag, so one cluster slot) of permit ids scored by the time their TTL
///   ends, decided by the same script call as the rate limits. **A permit ends one
///   [`permit_ttl`](Self::with_permit_ttl) after it was taken** even when its request
///   still runs (nothing renews it): a replica that dies gives its permits back at most
///   one TTL later, and a response that lasts longer than the TTL stops counting after
///   it. Set the TTL above your longest response.
///
/// Changing `max` through a [`RulesHandle`](crate::rules::RulesHandle) keeps the permits
/// held: the state is one per key, whatever `max` is.
///
/// ```
/// use std::time::Duration;
/// use tollgate::{InFlightLimit, Limit, RateLimitLayer};
///
/// // 100 a minute, at most 2 at once, per peer IP.
/// let layer = RateLimitLayer::new(Limit::per_minute(100)?)
///     .with_in_flight(InFlightLimit::new(2)?.with_permit_ttl(Duration::from_secs(120)));
/// # let _ = layer;
/// # Ok::<(), tollgate::ConfigError>(())
/// ```
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct InFlightLimit {
    max: u32,
    permit_ttl_ms: u64,
    retry_after_ms: u64,
}

impl InFlightLimit {
    /// At most `max` requests in flight per key, permits ending after
    /// [`DEFAULT_IN_FLIGHT_TTL`].
    ///
    /// # Errors
    ///
    /// When `max` is 0 (field `max_in_flight`).
    pub fn new(max: u32) -> Result<Self, ConfigError> {
        if max == 0 {
            return Err(ConfigError::new(
                "max_in_flight",
                "must be at least 1 (0 would deny every request)",
            ));
        }
        Ok(Self {
            max,
            permit_ttl_ms: DEFAULT_IN_FLIGHT_TTL.as_millis() as u64,
            retry_after_ms: DEFAULT_IN_FLIGHT_RETRY_AFTER.as_millis() as u64,
        })
    }

    /// The same limit with permits that end `ttl` after they were taken when they are
    /// never given back (at least 1 ms, at most [`MAX_WINDOW`]).
    pub fn with_permit_ttl(mut self, ttl: Duration) -> Self {
        self.permit_ttl_ms = ttl.clamp(Duration::from_millis(1), MAX_WINDOW).as_millis() as u64;
        self
    }

    /// The same limit answering the requests it denies with this `Retry-After` (rounded
    /// up to whole seconds, at least 1).
    pub fn with_retry_after(mut self, retry_after: Duration) -> Self {
        self.retry_after_ms = retry_after.as_millis().min(u128::from(u32::MAX)) as u64;
        self
    }

    /// The most requests in flight per key.
    pub fn max(&self) -> u32 {
        self.max
    }

    /// How long a permit that is never given back counts.
    pub fn permit_ttl(&self) -> Duration {
        Duration::from_millis(self.permit_ttl_ms)
    }

    /// The permit TTL in ms.
    pub fn permit_ttl_ms(&self) -> u64 {
        self.permit_ttl_ms
    }

    /// The `Retry-After` of a denial.
    pub fn retry_after(&self) -> Duration {
        Duration::from_millis(self.retry_after_ms)
    }

    /// The decision of the cap for a request it denies: limit `max`, nothing left.
    pub(crate) fn denial(&self) -> crate::LimitDecision {
        crate::LimitDecision::deny(
            self.max,
            0,
            self.retry_after_ms.max(1),
            self.retry_after_ms.max(1),
        )
    }
}
