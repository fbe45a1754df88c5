//! The gateway's TOML config: parsed with serde (unknown fields are errors) and validated
//! completely before anything starts, so that a bad file fails at once with a message
//! naming the field and the value.
//!
//! See `README.md` (of this package) for the reference and `gateway.toml` for an example.

use std::{fmt, net::SocketAddr, path::Path, time::Duration};

use http::{HeaderName, Uri};
use ipnet::IpNet;
use serde::Deserialize;
use tollgate::{Algorithm, Limit, OnChange};

use crate::path;

/// `[store] leases` (next to this file, so that every crate that includes this module by
/// path gets it too).
#[path = "leases.rs"]
pub(crate) mod leases;

/// `[routes.adaptive]` (next to this file, as `leases`).
#[path = "adaptive.rs"]
pub(crate) mod adaptive;

/// The config used without `--config`: a demo that shows a 429 after five quick `curl`s.
pub(crate) const DEMO: &str = r#"
listen = "127.0.0.1:8080"

[[routes]]
path = "/"

[[routes.limits]]
name = "demo"
key = "ip"
algorithm = "sliding_window"
limit = 5
window = "10s"
"#;

/// A config that failed to load: where, and why.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct ConfigError {
    /// The field, as a path into the file: `routes[0].limits[1].window`.
    pub(crate) field: String,
    pub(crate) message: String,
}

impl ConfigError {
    pub(crate) fn new(field: impl Into<String>, message: impl Into<String>) -> Self {
        Self {
            field: field.into(),
            message: message.into(),
        }
    }
}

impl fmt::Display for ConfigError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        if self.field.is_empty() {
            write!(f, "invalid config: {}", self.message)
        } else {
            write!(f, "invalid config: {}: {}", self.field, self.message)
        }
    }
}

impl std::error::Error for ConfigError {}

/// A validated config.
#[derive(Debug, Clone)]
pub(crate) struct Config {
    pub(crate) listen: SocketAddr,
    /// Where `/metrics` and `/ratelimit/` are served, if anywhere.
    pub(crate) admin_listen: Option<SocketAddr>,
    /// The bearer token `/ratelimit/` asks for (`admin_token_env`).
    pub(crate) admin_token: Option<KeySecret>,
    pub(crate) trusted_proxies: Vec<IpNet>,
    pub(crate) server: ServerConfig,
    pub(crate) store: StoreConfig,
    pub(crate) routes: Vec<Route>,
    /// Where the routes come from (`[rules]`).
    pub(crate) rules: RulesConfig,
}

/// How much one client or upstream may hold of the gateway: `[server]`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct ServerConfig {
    /// How long a client may take to send a request's headers, and how long an idle
    /// keep-alive connection stays open.
    pub(crate) header_read_timeout: Duration,
    /// How long an upstream may take to send its response head (then 504).
    pub(crate) upstream_timeout: Duration,
    /// The largest request body forwarded (then 413).
    pub(crate) max_body_bytes: usize,
    /// How many client connections are served at once; more wait to be accepted.
    pub(crate) max_connections: usize,
    /// How long a graceful shutdown waits for requests in flight before closing them.
    pub(crate) shutdown_timeout: Duration,
    /// How long a response may wait for the client to take more of it (a write that
    /// makes no progress) before the connection is closed.
    pub(crate) write_idle_timeout: Duration,
}

impl Default for ServerConfig {
    fn default() -> Self {
        Self {
            header_read_timeout: Duration::from_secs(10),
            upstream_timeout: Duration::from_secs(30),
            max_body_bytes: 10 * 1024 * 1024,
            max_connections: 512,
            shutdown_timeout: Duration::from_secs(20),
            write_idle_timeout: Duration::from_secs(60),
        }
    }
}

/// The longest timeout `[server]` accepts: longer is a mistake, and timers cannot add
/// unbounded durations to the current instant.
const MAX_SERVER_TIMEOUT: Duration = Duration::from_secs(24 * 60 * 60);

/// The most connections `max_connections` allows (each one is a file descriptor, two
/// while it is proxied).
const MAX_CONNECTIONS: u64 = 1_000_000;

#[derive(Debug, Clone)]
pub(crate) struct StoreConfig {
    pub(crate) backend: Backend,
    /// Certificates for `rediss://` beyond the system's roots.
    pub(crate) tls: StoreTls,
    pub(crate) prefix: String,
    pub(crate) timeout: Duration,
    pub(crate) on_error: OnError,
    /// Each rate-limit layer's circuit breaker (`breaker_failures`, `breaker_cooldown`).
    pub(crate) breaker: tollgate::CircuitBreaker,
    /// How `header:<name>` keys are stored.
    pub(crate) header_keys: HeaderKeys,
    /// Leased quota (`leases`): off when `None`.
    pub(crate) leases: Option<leases::LeasesConfig>,
    /// `connect = "background"`: start while Redis is unreachable, and connect later.
    pub(crate) background: bool,
}

/// How header values (API keys) appear in store keys.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) enum HeaderKeys {
    /// As they are (`hash_header_keys = false`): readable by anyone who can read Redis.
    Plain,
    /// SHA-256 (the default without `key_secret_env`).
    Sha256,
    /// HMAC-SHA256 under the secret in the environment variable `key_secret_env`.
    Hmac(KeySecret),
}

/// The HMAC secret: never printed.
#[derive(Clone, PartialEq, Eq)]
pub(crate) struct KeySecret(pub(crate) Vec<u8>);

impl fmt::Debug for KeySecret {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("KeySecret(..)")
    }
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) enum Backend {
    Memory,
    Redis { url: String },
    RedisCluster { nodes: Vec<String> },
    RedisSentinel(SentinelBackend),
}

/// `backend = "redis-sentinel"`: the master the sentinels name.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct SentinelBackend {
    pub(crate) sentinels: Vec<String>,
    pub(crate) master_name: String,
    pub(crate) username: Option<String>,
    pub(crate) password: Option<String>,
}

/// PEM files for TLS to Redis: a private CA, and a client certificate with its key.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub(crate) struct StoreTls {
    pub(crate) ca_file: Option<String>,
    pub(crate) cert_file: Option<String>,
    pub(crate) key_file: Option<String>,
}

impl StoreTls {
    /// Whether any file is given.
    pub(crate) fn is_set(&self) -> bool {
        self.ca_file.is_some() || self.cert_file.is_some()
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum OnError {
    Allow,
    Deny,
    Local,
}

#[derive(Debug, Clone)]
pub(crate) struct Route {
    /// Normalised, without a trailing slash (except `/`).
    pub(crate) path: String,
    pub(crate) upstream: Option<Upstream>,
    pub(crate) limits: Vec<RouteLimit>,
    /// Every limit of the route in shadow: decided and counted, never rejecting.
    pub(crate) shadow: bool,
    /// Counting after the response (`count_when`, `cost_header`); `None`: as decided.
    pub(crate) count_after: Option<CountAfter>,
    /// A request its limits would deny waits up to this long instead (`max_wait`).
    pub(crate) delay: Option<Duration>,
    /// Limits chosen per request by a header: `[[routes.plans]]`.
    pub(crate) plans: Option<RoutePlans>,
    /// At most this many requests in flight per key (the key of the route's first
    /// limit, else of its plans, else the client IP): `max_in_flight`.
    pub(crate) max_in_flight: Option<u32>,
    /// An adaptive in-flight limit that sheds by priority: `[routes.adaptive]`.
    pub(crate) adaptive: Option<adaptive::AdaptiveConfig>,
}

/// A route's plans: each request is limited by the plan its `plan_header` names, or by
/// the default plan.
#[derive(Debug, Clone)]
pub(crate) struct RoutePlans {
    pub(crate) header: HeaderName,
    pub(crate) default: String,
    /// Who every plan's limits count against (one key for all plans of a route).
    pub(crate) key: KeySpec,
    pub(crate) plans: Vec<RoutePlan>,
}

/// One plan: its name and limits, `None` when unlimited.
#[derive(Debug, Clone)]
pub(crate) struct RoutePlan {
    pub(crate) name: String,
    pub(crate) limits: Option<Vec<Limit>>,
}

/// When a route's requests stay counted, read from the response: `count_when` and
/// `cost_header`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct CountAfter {
    pub(crate) when: CountWhen,
    /// A response header holding the request's cost (a whole number of units); absent or
    /// not a number: the request costs 1.
    pub(crate) cost_header: Option<HeaderName>,
}

/// `count_when`: which responses keep their request's units.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum CountWhen {
    Always,
    /// Status 400 or above (failed logins, and the 429s of the route's inner layers).
    Failure,
    /// Status below 400.
    Success,
}

impl CountAfter {
    /// The units a request finally costs, from its response: `None` keeps the 1 charged.
    pub(crate) fn cost<B>(&self, response: &http::Response<B>) -> Option<u32> {
        let failed = response.status().as_u16() >= 400;
        let counts = match self.when {
            CountWhen::Always => true,
            CountWhen::Failure => failed,
            CountWhen::Success => !failed,
        };
        if !counts {
            return Some(0);
        }
        let value = response.headers().get(self.cost_header.as_ref()?)?;
        value.to_str().ok()?.trim().parse().ok()
    }
}

/// An upstream base URL: `http://host:port` with an optional base path that is put in
/// front of every forwarded path.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct Upstream {
    pub(crate) authority: http::uri::Authority,
    /// Empty, or starting with `/` and without a trailing slash.
    pub(crate) base_path: String,
}

#[derive(Debug, Clone)]
pub(crate) struct RouteLimit {
    pub(crate) key: KeySpec,
    pub(crate) limit: Limit,
    /// Decided and counted, never rejecting (the metrics show `would_reject`).
    pub(crate) shadow: bool,
}

/// Who a limit counts requests against.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) enum KeySpec {
    /// The client IP (X-Forwarded-For is believed only from `trusted_proxies`).
    Ip,
    /// The value of one header (a request without it gets 400).
    Header(HeaderName),
    /// One budget shared by every client.
    Global,
}

impl fmt::Display for KeySpec {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Self::Ip => f.write_str("ip"),
            Self::Header(name) => write!(f, "header:{name}"),
            Self::Global => f.write_str("global"),
        }
    }
}

// The file as written. Optional fields are `Option`s so that validation, not serde,
// decides the defaults and the messages.

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct RawConfig {
    listen: String,
    admin_listen: Option<String>,
    admin_token_env: Option<String>,
    #[serde(default)]
    trusted_proxies: Vec<String>,
    #[serde(default)]
    server: RawServer,
    #[serde(default)]
    store: RawStore,
    #[serde(default)]
    routes: Vec<RawRoute>,
    #[serde(default)]
    rules: RawRules,
}

#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields)]
struct RawServer {
    header_read_timeout: Option<String>,
    upstream_timeout: Option<String>,
    max_body_bytes: Option<u64>,
    max_connections: Option<u64>,
    shutdown_timeout: Option<String>,
    write_idle_timeout: Option<String>,
}

#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields)]
struct RawStore {
    backend: Option<String>,
    url: Option<String>,
    nodes: Option<Vec<String>>,
    sentinels: Option<Vec<String>>,
    master_name: Option<String>,
    master_username: Option<String>,
    master_password: Option<String>,
    tls_ca_file: Option<String>,
    tls_cert_file: Option<String>,
    tls_key_file: Option<String>,
    prefix: Option<String>,
    timeout_ms: Option<u64>,
    on_error: Option<String>,
    /// Consecutive store failures that open a layer's circuit breaker.
    breaker_failures: Option<u32>,
    /// How long an open breaker waits before it lets a request probe the store.
    breaker_cooldown: Option<String>,
    hash_header_keys: Option<bool>,
    key_secret_env: Option<String>,
    leases: Option<leases::RawLeases>,
    /// `at_start` (default) or `background`.
    connect: Option<String>,
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct RawRoute {
    path: String,
    upstream: Option<String>,
    #[serde(default)]
    limits: Vec<RawLimit>,
    /// Every limit of the route in shadow.
    #[serde(default)]
    shadow: bool,
    /// `always` (default), `failure` or `success`: which responses keep their units.
    count_when: Option<String>,
    /// A response header with the request's cost, charged after the response.
    cost_header: Option<String>,
    /// A humantime duration: how long a request its limits would deny may wait instead.
    delay: Option<String>,
    /// At most this many requests in flight per key.
    max_in_flight: Option<u32>,
    /// The header whose value names the plan.
    plan_header: Option<String>,
    /// The plan of requests without the header or with an unknown plan.
    default_plan: Option<String>,
    #[serde(default)]
    plans: Vec<RawPlan>,
    /// An adaptive in-flight limit.
    adaptive: Option<adaptive::RawAdaptive>,
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct RawPlan {
    name: String,
    #[serde(default)]
    unlimited: bool,
    #[serde(default)]
    limits: Vec<RawLimit>,
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct RawLimit {
    key: String,
    algorithm: String,
    limit: u32,
    window: String,
    burst: Option<u32>,
    name: Option<String>,
    /// `reset` (default) or `carry_over`: what a reload that changes this limit does to
    /// its budget.
    on_change: Option<String>,
    /// A humantime duration: once this limit denies a key, the key is blocked that long.
    lockout: Option<String>,
    /// Decided and counted, never rejecting.
    #[serde(default)]
    shadow: bool,
}

impl Config {
    /// Reads and validates the file at `path`.
    pub(crate) fn load(path: &Path) -> Result<Self, ConfigError> {
        let text = std::fs::read_to_string(path)
            .map_err(|e| ConfigError::new("", format!("cannot read {}: {e}", path.display())))?;
        Self::parse(&text)
    }

    /// The demo config ([`DEMO`]).
    pub(crate) fn demo() -> Self {
        Self::parse(DEMO).expect("the demo config is valid")
    }

    /// Parses and validates a config file's text.
    pub(crate) fn parse(text: &str) -> Result<Self, ConfigError> {
        let raw: RawConfig = toml::from_str(text).map_err(|e| {
            // toml's message shows the line, the column and serde's reason (`unknown field
            // `x``, `missing field `listen``, `invalid type`); keep it whole.
            ConfigError::new("", e.to_string().trim_end().to_owned())
        })?;
        raw.validate()
    }
}

impl RawConfig {
    fn validate(self) -> Result<Config, ConfigError> {
        let listen = parse_addr("listen", &self.listen)?;
        let admin_listen = self
            .admin_listen
            .as_deref()
            .map(|a| parse_addr("admin_listen", a))
            .transpose()?;
        if admin_listen.is_some_and(|a| a == listen && a.port() != 0) {
            return Err(ConfigError::new(
                "admin_listen",
                format!("must differ from listen (both are {listen})"),
            ));
        }
        let admin_token = admin_token(self.admin_token_env.as_deref(), admin_listen.is_some())?;
        let trusted_proxies = self
            .trusted_proxies
            .iter()
            .enumerate()
            .map(|(i, cidr)| parse_cidr(&format!("trusted_proxies[{i}]"), cidr))
            .collect::<Result<_, _>>()?;
        let server = self.server.validate()?;
        let store = self.store.validate()?;
        let routes = validate_routes(self.routes)?;
        let rules = self.rules.validate(&store)?;
        Ok(Config {
            listen,
            admin_listen,
            admin_token,
            trusted_proxies,
            server,
            store,
            routes,
            rules,
        })
    }
}

/// The routes, each validated, with unique paths.
fn validate_routes(raw: Vec<RawRoute>) -> Result<Vec<Route>, ConfigError> {
    let mut routes: Vec<Route> = Vec::with_capacity(raw.len());
    for (index, raw) in raw.into_iter().enumerate() {
        let route = raw.validate(index)?;
        if let Some(other) = routes.iter().position(|r| r.path == route.path) {
            return Err(ConfigError::new(
                format!("routes[{index}].path"),
                format!("{:?} is also the path of routes[{other}]", route.path),
            ));
        }
        routes.push(route);
    }
    Ok(routes)
}

/// A rule set as published to Redis (`--publish-rules`): only `[[routes]]`.
#[cfg_attr(not(feature = "redis"), allow(dead_code))]
#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct RawRuleSet {
    #[serde(default)]
    routes: Vec<RawRoute>,
}

/// Parses and validates a rule set's text: `[[routes]]` tables, as in the config file.
#[cfg_attr(not(feature = "redis"), allow(dead_code))]
pub(crate) fn parse_rule_set(text: &str) -> Result<Vec<Route>, ConfigError> {
    let raw: RawRuleSet = toml::from_str(text)
        .map_err(|e| ConfigError::new("", e.to_string().trim_end().to_owned()))?;
    validate_routes(raw.routes)
}

/// Where the routes come from: `[rules]`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct RulesConfig {
    /// Routes from Redis (published with `--publish-rules`) instead of the file.
    pub(crate) from_redis: bool,
    /// How often the Redis rule set is checked besides the change announcements.
    pub(crate) check_interval: Duration,
}

impl Default for RulesConfig {
    fn default() -> Self {
        Self {
            from_redis: false,
            check_interval: Duration::from_secs(1),
        }
    }
}

#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields)]
struct RawRules {
    source: Option<String>,
    check_interval: Option<String>,
}

impl RawRules {
    fn validate(self, store: &StoreConfig) -> Result<RulesConfig, ConfigError> {
        let mut rules = RulesConfig::default();
        match self.source.as_deref() {
            None | Some("file") => {}
            Some("redis") => {
                if !matches!(store.backend, Backend::Redis { .. }) {
                    return Err(ConfigError::new(
                        "rules.source",
                        "\"redis\" needs store.backend = \"redis\" (the rules live under the \
                         store's prefix)",
                    ));
                }
                if store.tls.is_set() {
                    // The rules connection does not take the store's certificates yet:
                    // refused here rather than failing at startup with a TLS error.
                    return Err(ConfigError::new(
                        "rules.source",
                        "\"redis\" does not support store.tls_ca_file / tls_cert_file / \
                         tls_key_file yet (rediss:// with the system's roots works)",
                    ));
                }
                rules.from_redis = true;
            }
            Some(other) => {
                return Err(ConfigError::new(
                    "rules.source",
                    format!("must be file or redis (got {other:?})"),
                ));
            }
        }
        if let Some(interval) = &self.check_interval {
            rules.check_interval = parse_timeout("rules.check_interval", interval)?;
        }
        Ok(rules)
    }
}

impl RawServer {
    fn validate(self) -> Result<ServerConfig, ConfigError> {
        let defaults = ServerConfig::default();
        let timeout = |field: &str, value: Option<String>, default: Duration| match value {
            None => Ok(default),
            Some(value) => parse_timeout(&format!("server.{field}"), &value),
        };
        let count = |field: &str, value: Option<u64>, default: usize, max: u64| match value {
            None => Ok(default),
            Some(n) if (1..=max).contains(&n) => usize::try_from(n).map_err(|_| {
                ConfigError::new(
                    format!("server.{field}"),
                    format!("is too large for this machine (got {n})"),
                )
            }),
            Some(n) => Err(ConfigError::new(
                format!("server.{field}"),
                format!("must be 1 to {max} (got {n})"),
            )),
        };
        Ok(ServerConfig {
            header_read_timeout: timeout(
                "header_read_timeout",
                self.header_read_timeout,
                defaults.header_read_timeout,
            )?,
            upstream_timeout: timeout(
                "upstream_timeout",
                self.upstream_timeout,
                defaults.upstream_timeout,
            )?,
            max_body_bytes: count(
                "max_body_bytes",
                self.max_body_bytes,
                defaults.max_body_bytes,
                u64::MAX,
            )?,
            max_connections: count(
                "max_connections",
                self.max_connections,
                defaults.max_connections,
                MAX_CONNECTIONS,
            )?,
            shutdown_timeout: timeout(
                "shutdown_timeout",
                self.shutdown_timeout,
                defaults.shutdown_timeout,
            )?,
            write_idle_timeout: timeout(
                "write_idle_timeout",
                self.write_idle_timeout,
                defaults.write_idle_timeout,
            )?,
        })
    }
}

/// A `[server]` timeout: a humantime duration from 1 ms to [`MAX_SERVER_TIMEOUT`].
fn parse_timeout(field: &str, value: &str) -> Result<Duration, ConfigError> {
    let duration = humantime::parse_duration(value).map_err(|e| {
        ConfigError::new(
            field,
            format!("{value:?} is not a duration such as \"500ms\", \"10s\" or \"1m\" ({e})"),
        )
    })?;
    if duration < Duration::from_millis(1) || duration > MAX_SERVER_TIMEOUT {
        return Err(ConfigError::new(
            field,
            format!("must be from 1ms to 24h (got {value:?})"),
        ));
    }
    Ok(duration)
}

impl RawStore {
    fn validate(self) -> Result<StoreConfig, ConfigError> {
        // Checked whatever the backend, so that a typo shows before it is needed.
        if let Some(url) = &self.url {
            check_redis_url("store.url", url)?;
        }
        for (i, node) in self.nodes.iter().flatten().enumerate() {
            check_redis_url(&format!("store.nodes[{i}]"), node)?;
        }
        for (i, sentinel) in self.sentinels.iter().flatten().enumerate() {
            check_redis_url(&format!("store.sentinels[{i}]"), sentinel)?;
        }
        let tls = self.tls()?;
        let backend = match self.backend.as_deref().unwrap_or("memory") {
            "memory" => Backend::Memory,
            "redis" => {
                let Some(url) = self.url else {
                    return Err(ConfigError::new(
                        "store.url",
                        "is required with backend = \"redis\"",
                    ));
                };
                if !cfg!(feature = "redis") {
                    return Err(ConfigError::new(
                        "store.backend",
                        "\"redis\" needs the gateway built with the redis feature \
                         (cargo run -p tollgate-gateway --features redis -- ...)",
                    ));
                }
                Backend::Redis { url }
            }
            "redis-cluster" => {
                let nodes = self.nodes.unwrap_or_default();
                if nodes.is_empty() {
                    return Err(ConfigError::new(
                        "store.nodes",
                        "needs at least one node with backend = \"redis-cluster\"",
                    ));
                }
                if !cfg!(feature = "cluster") {
                    return Err(ConfigError::new(
                        "store.backend",
                        "\"redis-cluster\" needs the gateway built with the cluster feature \
                         (cargo run -p tollgate-gateway --features cluster -- ...)",
                    ));
                }
                Backend::RedisCluster { nodes }
            }
            "redis-sentinel" => Backend::RedisSentinel(self.sentinel()?),
            other => {
                return Err(ConfigError::new(
                    "store.backend",
                    format!(
                        "must be memory, redis, redis-cluster or redis-sentinel (got {other:?})"
                    ),
                ));
            }
        };
        check_tls(&backend, &tls)?;
        let prefix = self.prefix.unwrap_or_else(|| "tollgate".to_owned());
        // The rule `RedisStore::with_prefix` applies, checked here so that a bad prefix
        // fails at load and not after connecting; the memory store has no prefix, but a
        // typo shows before it is needed.
        tollgate::store::validate_prefix(&prefix)
            .map_err(|e| ConfigError::new("store.prefix", e.to_string()))?;
        let timeout = match self.timeout_ms {
            None => tollgate::rules::DEFAULT_TIMEOUT,
            Some(0) => {
                return Err(ConfigError::new(
                    "store.timeout_ms",
                    "must be at least 1 (got 0)",
                ));
            }
            Some(ms) => Duration::from_millis(ms),
        };
        let on_error = match self.on_error.as_deref().unwrap_or("allow") {
            "allow" => OnError::Allow,
            "deny" => OnError::Deny,
            "local" => OnError::Local,
            other => {
                return Err(ConfigError::new(
                    "store.on_error",
                    format!("must be allow, deny or local (got {other:?})"),
                ));
            }
        };
        let mut breaker = tollgate::CircuitBreaker::default();
        match self.breaker_failures {
            None => {}
            Some(n @ 1..=1_000_000) => breaker = breaker.with_failures(n),
            Some(n) => {
                return Err(ConfigError::new(
                    "store.breaker_failures",
                    format!("must be 1 to 1000000 (got {n})"),
                ));
            }
        }
        if let Some(cooldown) = &self.breaker_cooldown {
            breaker = breaker.with_cooldown(parse_timeout("store.breaker_cooldown", cooldown)?);
        }
        let header_keys =
            header_key_hashing(self.hash_header_keys, self.key_secret_env.as_deref())?;
        let leases = match self.leases {
            Some(leases) => leases.validate(!matches!(backend, Backend::Memory))?,
            None => None,
        };
        let background = match self.connect.as_deref().unwrap_or("at_start") {
            "at_start" => false,
            "background" => match backend {
                Backend::Redis { .. } | Backend::RedisSentinel(_) => true,
                Backend::Memory => {
                    return Err(ConfigError::new(
                        "store.connect",
                        "\"background\" needs a redis backend (the memory store has nothing \
                         to connect to)",
                    ));
                }
                Backend::RedisCluster { .. } => {
                    return Err(ConfigError::new(
                        "store.connect",
                        "\"background\" is not supported with backend = \"redis-cluster\" \
                         (a cluster must be reachable at start)",
                    ));
                }
            },
            other => {
                return Err(ConfigError::new(
                    "store.connect",
                    format!("must be at_start or background (got {other:?})"),
                ));
            }
        };
        Ok(StoreConfig {
            backend,
            tls,
            prefix,
            timeout,
            on_error,
            breaker,
            header_keys,
            leases,
            background,
        })
    }
}

impl RawStore {
    fn tls(&self) -> Result<StoreTls, ConfigError> {
        let tls = StoreTls {
            ca_file: self.tls_ca_file.clone(),
            cert_file: self.tls_cert_file.clone(),
            key_file: self.tls_key_file.clone(),
        };
        for (field, value) in [
            ("store.tls_ca_file", &tls.ca_file),
            ("store.tls_cert_file", &tls.cert_file),
            ("store.tls_key_file", &tls.key_file),
        ] {
            if value.as_deref() == Some("") {
                return Err(ConfigError::new(field, "must be a file path (got \"\")"));
            }
        }
        match (&tls.cert_file, &tls.key_file) {
            (Some(_), None) => Err(ConfigError::new(
                "store.tls_key_file",
                "is required with store.tls_cert_file (the client certificate's key)",
            )),
            (None, Some(_)) => Err(ConfigError::new(
                "store.tls_cert_file",
                "is required with store.tls_key_file (the client certificate)",
            )),
            _ => Ok(tls),
        }
    }

    fn sentinel(&self) -> Result<SentinelBackend, ConfigError> {
        let sentinels = self.sentinels.clone().unwrap_or_default();
        if sentinels.is_empty() {
            return Err(ConfigError::new(
                "store.sentinels",
                "needs at least one sentinel with backend = \"redis-sentinel\"",
            ));
        }
        let master_name = match self.master_name.as_deref() {
            Some(name) if !name.is_empty() => name.to_owned(),
            _ => {
                return Err(ConfigError::new(
                    "store.master_name",
                    "is required with backend = \"redis-sentinel\" (the name in `sentinel monitor`)",
                ));
            }
        };
        if self.master_username.is_some() && self.master_password.is_none() {
            return Err(ConfigError::new(
                "store.master_password",
                "is required with store.master_username",
            ));
        }
        if !cfg!(feature = "sentinel") {
            return Err(ConfigError::new(
                "store.backend",
                "\"redis-sentinel\" needs the gateway built with the sentinel feature \
                 (cargo run -p tollgate-gateway --features sentinel -- ...)",
            ));
        }
        Ok(SentinelBackend {
            sentinels,
            master_name,
            username: self.master_username.clone(),
            password: self.master_password.clone(),
        })
    }
}

/// TLS is used exactly where the backend's URLs say `rediss://`: a build without the `tls`
/// feature refuses them, and certificate files need them.
fn check_tls(backend: &Backend, tls: &StoreTls) -> Result<(), ConfigError> {
    let urls: Vec<(String, &str)> = match backend {
        Backend::Memory => return Ok(()),
        Backend::Redis { url } => vec![("store.url".to_owned(), url.as_str())],
        Backend::RedisCluster { nodes } => nodes
            .iter()
            .enumerate()
            .map(|(i, n)| (format!("store.nodes[{i}]"), n.as_str()))
            .collect(),
        Backend::RedisSentinel(sentinel) => sentinel
            .sentinels
            .iter()
            .enumerate()
            .map(|(i, n)| (format!("store.sentinels[{i}]"), n.as_str()))
            .collect(),
    };
    let is_tls = |url: &str| {
        url.get(..9)
            .is_some_and(|s| s.eq_ignore_ascii_case("rediss://"))
    };
    for (field, url) in &urls {
        if is_tls(url) && !cfg!(feature = "tls") {
            return Err(ConfigError::new(
                field.clone(),
                format!(
                    "{url:?} is rediss:// (TLS): build the gateway with the tls feature \
                     (cargo run -p tollgate-gateway --features tls -- ...)"
                ),
            ));
        }
        if tls.is_set() && !is_tls(url) {
            return Err(ConfigError::new(
                field.clone(),
                format!("must be rediss:// with store.tls_*_file (got {url:?})"),
            ));
        }
    }
    Ok(())
}

/// `admin_token_env`: the admin endpoints' bearer token, read from that environment
/// variable, which must be set and not empty (an empty token would open them).
fn admin_token(var: Option<&str>, admin: bool) -> Result<Option<KeySecret>, ConfigError> {
    let Some(var) = var else {
        return Ok(None);
    };
    if !admin {
        return Err(ConfigError::new("admin_token_env", "needs admin_listen"));
    }
    match std::env::var_os(var) {
        Some(token) if !token.is_empty() => Ok(Some(KeySecret(token.into_encoded_bytes()))),
        _ => Err(ConfigError::new(
            "admin_token_env",
            format!("the environment variable {var:?} is not set or is empty"),
        )),
    }
}

/// `store.hash_header_keys` (default true) and `store.key_secret_env`: API keys are hashed
/// before they become store keys, with an HMAC when a secret is given.
fn header_key_hashing(
    hash: Option<bool>,
    secret_env: Option<&str>,
) -> Result<HeaderKeys, ConfigError> {
    match (hash.unwrap_or(true), secret_env) {
        (false, None) => Ok(HeaderKeys::Plain),
        (false, Some(_)) => Err(ConfigError::new(
            "store.key_secret_env",
            "needs hash_header_keys = true (it is false)",
        )),
        (true, None) => Ok(HeaderKeys::Sha256),
        (true, Some(var)) => match std::env::var_os(var) {
            Some(secret) if !secret.is_empty() => {
                Ok(HeaderKeys::Hmac(KeySecret(secret.into_encoded_bytes())))
            }
            _ => Err(ConfigError::new(
                "store.key_secret_env",
                format!("the environment variable {var:?} is not set or is empty"),
            )),
        },
    }
}

impl RawRoute {
    fn validate(mut self, index: usize) -> Result<Route, ConfigError> {
        let at = format!("routes[{index}]");
        let plans = validate_plans(
            &at,
            index,
            self.plan_header.take(),
            self.default_plan.take(),
            std::mem::take(&mut self.plans),
        )?;
        let path = path::normalize_prefix(&self.path).map_err(|e| {
            ConfigError::new(format!("{at}.path"), format!("{e} (got {:?})", self.path))
        })?;
        if self.path.contains(['?', '#']) {
            return Err(ConfigError::new(
                format!("{at}.path"),
                format!(
                    "must be a path without query or fragment (got {:?})",
                    self.path
                ),
            ));
        }
        let upstream = self
            .upstream
            .as_deref()
            .map(|u| parse_upstream(&format!("{at}.upstream"), u))
            .transpose()?;
        let limits: Vec<RouteLimit> = self
            .limits
            .into_iter()
            .enumerate()
            .map(|(j, raw)| raw.validate(index, j, &format!("{at}.limits[{j}]")))
            .collect::<Result<_, _>>()?;
        // Carried over, a limit's state is its name, algorithm and window: two limits of
        // one key that share them would share one budget.
        for (j, limit) in limits.iter().enumerate() {
            let same = |other: &RouteLimit| {
                other.key == limit.key
                    && other.limit != limit.limit
                    && other.limit.state_on_change() == OnChange::CarryOver
                    && limit.limit.state_on_change() == OnChange::CarryOver
                    && other.limit.name() == limit.limit.name()
                    && other.limit.algorithm() == limit.limit.algorithm()
                    && other.limit.window() == limit.limit.window()
            };
            // A limit both enforced and in shadow would count each request twice.
            let twice = |other: &RouteLimit| {
                other.key == limit.key && other.shadow != limit.shadow && other.limit == limit.limit
            };
            if let Some(other) = limits[..j].iter().position(twice) {
                return Err(ConfigError::new(
                    format!("{at}.limits[{j}].shadow"),
                    format!(
                        "limits[{other}] is the same limit with the same key, {}: one state \
                         cannot be both enforced and in shadow",
                        if limit.shadow {
                            "enforced"
                        } else {
                            "in shadow"
                        }
                    ),
                ));
            }
            if let Some(other) = limits[..j].iter().position(same) {
                return Err(ConfigError::new(
                    format!("{at}.limits[{j}].name"),
                    format!(
                        "{:?} with on_change = \"carry_over\" is also limits[{other}], with the \
                         same key, algorithm and window: they would share one budget",
                        limit.limit.name().unwrap_or_default()
                    ),
                ));
            }
        }
        let delay = self
            .delay
            .as_deref()
            .map(|delay| parse_delay(&format!("{at}.delay"), delay))
            .transpose()?;
        let count_after =
            count_after(&at, self.count_when.as_deref(), self.cost_header.as_deref())?;
        if self.max_in_flight == Some(0) {
            return Err(ConfigError::new(
                format!("{at}.max_in_flight"),
                "must be at least 1 (0 would deny every request)",
            ));
        }
        let adaptive = self
            .adaptive
            .map(|adaptive| adaptive.validate(&at))
            .transpose()?;
        // The adaptive limit is a stage of the route's outermost rate-limit layer, and a
        // layer has at least one rate limit.
        let limited = !limits.is_empty()
            || plans
                .as_ref()
                .is_some_and(|p| p.plans.iter().any(|plan| plan.limits.is_some()));
        if adaptive.is_some() && !limited {
            return Err(ConfigError::new(
                format!("{at}.adaptive"),
                format!(
                    "needs a rate limit on the route: {at}.limits (or a plan with limits); \
                     the adaptive limit is a stage of the route's rate-limit layer"
                ),
            ));
        }
        Ok(Route {
            path,
            upstream,
            limits,
            shadow: self.shadow,
            plans,
            delay,
            count_after,
            max_in_flight: self.max_in_flight,
            adaptive,
        })
    }
}

/// A route's `plan_header`, `default_plan` and `[[routes.plans]]`: all or none of them.
fn validate_plans(
    at: &str,
    route: usize,
    header: Option<String>,
    default: Option<String>,
    raw: Vec<RawPlan>,
) -> Result<Option<RoutePlans>, ConfigError> {
    if raw.is_empty() {
        let set = match (&header, &default) {
            (Some(_), _) => "plan_header",
            (None, Some(_)) => "default_plan",
            (None, None) => return Ok(None),
        };
        return Err(ConfigError::new(
            format!("{at}.{set}"),
            "needs [[routes.plans]]: the route has no plans",
        ));
    }
    let header = header.ok_or_else(|| {
        ConfigError::new(
            format!("{at}.plan_header"),
            "is required with [[routes.plans]]: the header whose value names the plan",
        )
    })?;
    let header = HeaderName::from_bytes(header.trim().as_bytes()).map_err(|_| {
        ConfigError::new(
            format!("{at}.plan_header"),
            format!("{header:?} is not a valid header name"),
        )
    })?;
    let mut plans: Vec<RoutePlan> = Vec::with_capacity(raw.len());
    let mut key: Option<KeySpec> = None;
    for (j, plan) in raw.into_iter().enumerate() {
        let at = format!("{at}.plans[{j}]");
        // The library's rule for plan names.
        tollgate::plan::Plan::unlimited(plan.name.as_str())
            .map_err(|e| ConfigError::new(format!("{at}.name"), e.to_string()))?;
        if let Some(other) = plans.iter().position(|p| p.name == plan.name) {
            return Err(ConfigError::new(
                format!("{at}.name"),
                format!("{:?} is also the name of plans[{other}]", plan.name),
            ));
        }
        let limits = match (plan.unlimited, plan.limits.is_empty()) {
            (true, true) => None,
            (true, false) => {
                return Err(ConfigError::new(
                    format!("{at}.unlimited"),
                    "an unlimited plan has no limits",
                ));
            }
            (false, true) => {
                return Err(ConfigError::new(
                    format!("{at}.limits"),
                    "a plan needs at least one limit, or unlimited = true",
                ));
            }
            (false, false) => {
                let mut limits = Vec::with_capacity(plan.limits.len());
                for (k, raw) in plan.limits.into_iter().enumerate() {
                    let at = format!("{at}.limits[{k}]");
                    if raw.shadow {
                        return Err(ConfigError::new(
                            format!("{at}.shadow"),
                            "plans have no shadow limits (the route's shadow = true puts them                              all in shadow)",
                        ));
                    }
                    let limit = raw.validate(route, k, &at)?;
                    match &key {
                        None => key = Some(limit.key.clone()),
                        Some(first) if *first != limit.key => {
                            return Err(ConfigError::new(
                                format!("{at}.key"),
                                format!(
                                    "every plan limit of a route counts against one key:                                      {first} here, not {}",
                                    limit.key
                                ),
                            ));
                        }
                        Some(_) => {}
                    }
                    limits.push(limit.limit);
                }
                // Two limits of a plan with one state (the library's check).
                tollgate::plan::Plan::new(plan.name.as_str(), limits.clone())
                    .map_err(|e| ConfigError::new(format!("{at}.limits"), e.to_string()))?;
                Some(limits)
            }
        };
        plans.push(RoutePlan {
            name: plan.name,
            limits,
        });
    }
    let default = default.ok_or_else(|| {
        ConfigError::new(
            format!("{at}.default_plan"),
            "is required with [[routes.plans]]: the plan of requests without a known plan",
        )
    })?;
    if !plans.iter().any(|p| p.name == default) {
        return Err(ConfigError::new(
            format!("{at}.default_plan"),
            format!("{default:?} is not the name of one of the route's plans"),
        ));
    }
    Ok(Some(RoutePlans {
        header,
        default,
        // Only unlimited plans: the key is never used.
        key: key.unwrap_or(KeySpec::Global),
        plans,
    }))
}

/// A route's `count_when` and `cost_header`: `None` when neither changes anything.
fn count_after(
    at: &str,
    when: Option<&str>,
    cost_header: Option<&str>,
) -> Result<Option<CountAfter>, ConfigError> {
    let when = match when {
        None | Some("always") => CountWhen::Always,
        Some("failure") => CountWhen::Failure,
        Some("success") => CountWhen::Success,
        Some(other) => {
            return Err(ConfigError::new(
                format!("{at}.count_when"),
                format!("must be \"always\", \"failure\" or \"success\" (got {other:?})"),
            ));
        }
    };
    let cost_header = cost_header
        .map(|name| {
            HeaderName::try_from(name).map_err(|_| {
                ConfigError::new(
                    format!("{at}.cost_header"),
                    format!("must be a header name (got {name:?})"),
                )
            })
        })
        .transpose()?;
    if when == CountWhen::Always && cost_header.is_none() {
        return Ok(None);
    }
    Ok(Some(CountAfter { when, cost_header }))
}

impl RawLimit {
    fn validate(self, route: usize, index: usize, at: &str) -> Result<RouteLimit, ConfigError> {
        // The library's errors name their field (`limit`, `window`, `burst`, `name`,
        // `algorithm`) and the value; put where it is in the file in front.
        let lib = |e: tollgate::ConfigError| {
            ConfigError::new(format!("{at}.{}", e.field()), e.to_string())
        };
        let key = parse_key(&format!("{at}.key"), &self.key)?;
        let algorithm: Algorithm = self.algorithm.parse().map_err(lib)?;
        let window = humantime::parse_duration(&self.window).map_err(|e| {
            ConfigError::new(
                format!("{at}.window"),
                format!(
                    "{:?} is not a duration such as \"500ms\", \"10s\", \"1m\" or \"1h\" ({e})",
                    self.window
                ),
            )
        })?;
        let mut limit = Limit::new(algorithm, self.limit, window).map_err(lib)?;
        if let Some(burst) = self.burst {
            limit = limit.with_burst(burst).map_err(lib)?;
        }
        // A name unique to this limit: equal limits on two routes keep separate budgets.
        let name = self.name.unwrap_or_else(|| format!("r{route}-l{index}"));
        let mut limit = limit.with_name(name).map_err(lib)?;
        if let Some(on_change) = &self.on_change {
            let on_change: OnChange = on_change.parse().map_err(lib)?;
            limit = limit.with_on_change(on_change).map_err(lib)?;
        }
        if let Some(lockout) = &self.lockout {
            let lockout = humantime::parse_duration(lockout).map_err(|e| {
                ConfigError::new(
                    format!("{at}.lockout"),
                    format!("{lockout:?} is not a duration such as \"15m\" or \"1h\" ({e})"),
                )
            })?;
            limit = limit.with_lockout(lockout).map_err(lib)?;
        }
        Ok(RouteLimit {
            key,
            limit,
            shadow: self.shadow,
        })
    }
}

/// The longest `delay` of a route: a waiting request holds its connection.
const MAX_DELAY: Duration = Duration::from_secs(3600);

/// A route's `delay`: a humantime duration from 1 ms to [`MAX_DELAY`].
fn parse_delay(field: &str, value: &str) -> Result<Duration, ConfigError> {
    let delay = humantime::parse_duration(value).map_err(|e| {
        ConfigError::new(
            field,
            format!("{value:?} is not a duration such as \"500ms\" or \"2s\" ({e})"),
        )
    })?;
    if delay < Duration::from_millis(1) || delay > MAX_DELAY {
        return Err(ConfigError::new(
            field,
            format!("must be from 1ms to 1h (got {value:?})"),
        ));
    }
    Ok(delay)
}

fn parse_addr(field: &str, value: &str) -> Result<SocketAddr, ConfigError> {
    value.parse().map_err(|_| {
        ConfigError::new(
            field,
            format!("must be an IP address and port such as \"127.0.0.1:8080\" (got {value:?})"),
        )
    })
}

fn parse_cidr(field: &str, value: &str) -> Result<IpNet, ConfigError> {
    // A bare address is a network of one.
    value
        .parse::<IpNet>()
        .or_else(|_| value.parse::<std::net::IpAddr>().map(IpNet::from))
        .map_err(|_| {
            ConfigError::new(
                field,
                format!("must be a CIDR such as \"10.0.0.0/8\" or an IP address (got {value:?})"),
            )
        })
}

fn parse_key(field: &str, value: &str) -> Result<KeySpec, ConfigError> {
    match value {
        "ip" => return Ok(KeySpec::Ip),
        "global" => return Ok(KeySpec::Global),
        _ => {}
    }
    if let Some(name) = value.strip_prefix("header:") {
        return HeaderName::from_bytes(name.trim().as_bytes())
            .map(KeySpec::Header)
            .map_err(|_| {
                ConfigError::new(
                    field,
                    format!("{name:?} is not a valid header name (got {value:?})"),
                )
            });
    }
    Err(ConfigError::new(
        field,
        format!("must be ip, global or header:<name> (got {value:?})"),
    ))
}

fn parse_upstream(field: &str, value: &str) -> Result<Upstream, ConfigError> {
    let bad = |why: &str| ConfigError::new(field, format!("{why} (got {value:?})"));
    let uri: Uri = value
        .parse()
        .map_err(|_| bad("must be a URL such as \"http://127.0.0.1:9000\""))?;
    match uri.scheme_str() {
        Some("http") => {}
        Some("https") => {
            return Err(bad(
                "https upstreams are not supported: the example's client speaks plain HTTP",
            ));
        }
        _ => return Err(bad("must be a URL such as \"http://127.0.0.1:9000\"")),
    }
    let Some(authority) = uri.authority().cloned() else {
        return Err(bad("must have a host"));
    };
    if authority.host().is_empty() || authority.as_str().contains('@') {
        return Err(bad("must have a host and no user info"));
    }
    if uri.query().is_some() {
        return Err(bad("must not have a query"));
    }
    let base_path = uri.path().trim_end_matches('/').to_owned();
    Ok(Upstream {
        authority,
        base_path,
    })
}

fn check_redis_url(field: &str, value: &str) -> Result<(), ConfigError> {
    let bad = || {
        ConfigError::new(
            field,
            format!("must be a URL such as \"redis://127.0.0.1:6379\" (got {value:?})"),
        )
    };
    let uri: Uri = value.parse().map_err(|_| bad())?;
    let scheme_ok = matches!(uri.scheme_str(), Some("redis" | "rediss"));
    let host_ok = uri.authority().is_some_and(|a| !a.host().is_empty());
    if scheme_ok && host_ok {
        Ok(())
    } else {
        Err(bad())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn header_keys(store: &str) -> Result<HeaderKeys, ConfigError> {
        let text = format!("listen = \"127.0.0.1:0\"\n[store]\n{store}\n");
        Config::parse(&text).map(|c| c.store.header_keys)
    }

    #[test]
    fn header_keys_are_hashed_unless_turned_off() {
        assert_eq!(header_keys(""), Ok(HeaderKeys::Sha256));
        assert_eq!(
            header_keys("hash_header_keys = false"),
            Ok(HeaderKeys::Plain)
        );
        let path = std::env::var_os("PATH").unwrap().into_encoded_bytes();
        assert_eq!(
            header_keys(r#"key_secret_env = "PATH""#),
            Ok(HeaderKeys::Hmac(KeySecret(path)))
        );
        let unset = header_keys(r#"key_secret_env = "TOLLGATE_TEST_UNSET_SECRET""#).unwrap_err();
        assert_eq!(unset.field, "store.key_secret_env");
        assert!(
            unset.message.contains("TOLLGATE_TEST_UNSET_SECRET"),
            "{unset}"
        );
        let both = header_keys("hash_header_keys = false\nkey_secret_env = \"PATH\"");
        assert_eq!(both.unwrap_err().field, "store.key_secret_env");
        // The secret never shows in Debug.
        let debug = format!("{:?}", HeaderKeys::Hmac(KeySecret(b"hunter2".to_vec())));
        assert!(!debug.contains("hunter2"), "{debug}");
    }

    #[test]
    fn server_fields_are_read() {
        let config = Config::parse(
            r#"
            listen = "127.0.0.1:0"
            [server]
            header_read_timeout = "2s"
            upstream_timeout = "1m"
            max_body_bytes = 4096
            max_connections = 100
            shutdown_timeout = "500ms"
            write_idle_timeout = "7s"
            "#,
        )
        .unwrap();
        assert_eq!(
            config.server,
            ServerConfig {
                header_read_timeout: Duration::from_secs(2),
                upstream_timeout: Duration::from_secs(60),
                max_body_bytes: 4096,
                max_connections: 100,
                shutdown_timeout: Duration::from_millis(500),
                write_idle_timeout: Duration::from_secs(7),
            }
        );
        let zero =
            Config::parse("listen = \"127.0.0.1:0\"\n[server]\nwrite_idle_timeout = \"0s\"\n")
                .unwrap_err();
        assert_eq!(zero.field, "server.write_idle_timeout");
    }

    #[test]
    fn the_circuit_breaker_is_read() {
        let breaker = |store: &str| {
            Config::parse(&format!("listen = \"127.0.0.1:0\"\n[store]\n{store}"))
                .map(|c| c.store.breaker)
        };
        assert_eq!(breaker(""), Ok(tollgate::CircuitBreaker::default()));
        assert_eq!(
            breaker("breaker_failures = 2\nbreaker_cooldown = \"3s\""),
            Ok(tollgate::CircuitBreaker::new(2, Duration::from_secs(3)))
        );
        assert_eq!(
            breaker("breaker_failures = 0").unwrap_err().field,
            "store.breaker_failures"
        );
        assert_eq!(
            breaker("breaker_cooldown = \"soon\"").unwrap_err().field,
            "store.breaker_cooldown"
        );
    }

    #[test]
    fn demo_is_valid() {
        let config = Config::demo();
        assert_eq!(config.listen, "127.0.0.1:8080".parse().unwrap());
        assert_eq!(config.store.backend, Backend::Memory);
        assert_eq!(config.routes.len(), 1);
        assert_eq!(config.routes[0].limits[0].limit.limit(), 5);
    }

    #[test]
    fn defaults_and_names() {
        let config = Config::parse(
            r#"
            listen = "127.0.0.1:0"
            [[routes]]
            path = "/api/"
            upstream = "http://127.0.0.1:9000/v1/"
            [[routes.limits]]
            key = "header:X-Api-Key"
            algorithm = "gcra"
            limit = 10
            window = "1s"
            burst = 20
            [[routes.limits]]
            key = "global"
            algorithm = "fixed_window"
            limit = 100
            window = "1m"
            name = "total"
            "#,
        )
        .unwrap();
        assert_eq!(config.store.timeout, tollgate::rules::DEFAULT_TIMEOUT);
        assert_eq!(config.store.on_error, OnError::Allow);
        assert_eq!(config.store.prefix, "tollgate");
        assert_eq!(config.server, ServerConfig::default());
        assert_eq!(config.server.header_read_timeout, Duration::from_secs(10));
        assert_eq!(config.server.max_connections, 512);
        let route = &config.routes[0];
        assert_eq!(route.path, "/api");
        let upstream = route.upstream.as_ref().unwrap();
        assert_eq!(upstream.authority.as_str(), "127.0.0.1:9000");
        assert_eq!(upstream.base_path, "/v1");
        assert_eq!(
            route.limits[0].key,
            KeySpec::Header(HeaderName::from_static("x-api-key"))
        );
        assert_eq!(route.limits[0].limit.burst(), 20);
        assert_eq!(route.limits[0].limit.name(), Some("r0-l0"));
        assert_eq!(route.limits[1].limit.name(), Some("total"));
    }
}
