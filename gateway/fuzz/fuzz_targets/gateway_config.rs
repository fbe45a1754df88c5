//! The gateway's config parsing and validation (`Config::parse`) on arbitrary
//! input: raw text (first byte even), and TOML documents built from the gateway's own field
//! names with arbitrary, often nearly valid, values (first byte odd), so that validation and
//! not only the TOML parser is exercised.
//!
//! Never panics; what it accepts holds what the rest of the gateway relies on: normalised,
//! distinct route paths, a store prefix `RedisStore::with_prefix` accepts, limits and
//! `[server]` bounds in range.
#![no_main]

#[allow(dead_code)]
#[path = "../../src/config.rs"]
mod config;
#[allow(dead_code)]
#[path = "../../src/path.rs"]
mod path;

use arbitrary::{Arbitrary, Unstructured};
use libfuzzer_sys::fuzz_target;
use toml::{Table, Value};

// Values for each field: mostly ones that are valid or nearly so for that field, so that
// validation (not only the TOML parser and serde) is exercised deep down; sometimes another
// field's value, any string, or the wrong type.

const LISTEN: &[&str] = &[
    "127.0.0.1:0",
    "[::1]:0",
    "127.0.0.1:8080",
    "0.0.0.0:80",
    "localhost:80",
    ":80",
];
const CIDRS: &[&str] = &[
    "10.0.0.0/8",
    "::1",
    "1.2.3.4",
    "::ffff:10.0.0.0/104",
    "fe80::/10",
    "10.0.0.1/33",
    "10.0.0.0/",
];
const BACKENDS: &[&str] = &["memory", "redis", "redis-cluster", "memory", "Memory"];
const REDIS_URLS: &[&str] = &[
    "redis://127.0.0.1:6379",
    "rediss://h:1/0",
    "redis://:pw@h",
    "redis://",
    "http://h",
];
const PREFIXES: &[&str] = &[
    "tollgate",
    "tg",
    "a:b",
    "a/b.c_d-e",
    "{tg}",
    "a b",
    "a+b",
    "x\u{e9}",
    "",
];
const ON_ERROR: &[&str] = &["allow", "deny", "local", "fail"];
const PATHS: &[&str] = &[
    "/",
    "/api/",
    "/api",
    "//api/./v1/../v2/",
    "/%61pi/x",
    "/caf\u{e9}",
    "/a/../..",
    "/a%2Fb",
    "/a?b",
    "/%zz",
    "api",
];
const UPSTREAMS: &[&str] = &[
    "http://127.0.0.1:9000",
    "http://127.0.0.1:9000/v1/",
    "http://[::1]:1//",
    "http://h",
    "http://user@host/",
    "http://h/?q",
    "https://h",
    "http://",
    "h:80",
];
const KEYS: &[&str] = &[
    "ip",
    "global",
    "header:X-Api-Key",
    "header: x-tenant ",
    "header:bad name",
    "header:",
    "cookie",
];
const ALGORITHMS: &[&str] = &[
    "fixed_window",
    "sliding_window",
    "sliding_window_counter",
    "token_bucket",
    "gcra",
    "leaky",
];
const WINDOWS: &[&str] = &[
    "1s",
    "500ms",
    "1m",
    "366days",
    "1h 1ms",
    "367days",
    "1500us",
    "0s",
    "18446744073709551615s",
];
const NAMES: &[&str] = &["api.v1", "total", "r0-l0", "bad name", ""];
const TIMEOUTS: &[&str] = &[
    "10s",
    "300ms",
    "1h",
    "24h",
    "1ms",
    "0s",
    "500us",
    "25h",
    "soon",
    "18446744073709551615s",
];
const ALL: &[&[&str]] = &[
    LISTEN, CIDRS, BACKENDS, REDIS_URLS, PREFIXES, ON_ERROR, PATHS, UPSTREAMS, KEYS, ALGORITHMS,
    WINDOWS, NAMES, TIMEOUTS,
];
const INTS: &[i64] = &[
    1,
    5,
    1000,
    100_000,
    100_001,
    u32::MAX as i64,
    0,
    -1,
    u32::MAX as i64 + 1,
    i64::MAX,
];

#[derive(Debug)]
enum Str {
    /// One of the field's own values (most of the time).
    Field(u8),
    /// Any field's value.
    Other(u8, u8),
    Any(String),
    WrongType,
}

impl<'a> Arbitrary<'a> for Str {
    fn arbitrary(u: &mut Unstructured<'a>) -> arbitrary::Result<Self> {
        Ok(match u8::arbitrary(u)? {
            tag @ 0..=199 => Self::Field(tag),
            200..=229 => Self::Other(u.arbitrary()?, u.arbitrary()?),
            230..=252 => Self::Any(u.arbitrary()?),
            _ => Self::WrongType,
        })
    }
}

impl Str {
    fn value(&self, pool: &[&str]) -> Value {
        let pick = |list: &[&str], i: u8| list[usize::from(i) % list.len()].to_owned();
        match self {
            Self::Field(i) => Value::String(pick(pool, *i)),
            Self::Other(l, i) => Value::String(pick(ALL[usize::from(*l) % ALL.len()], *i)),
            Self::Any(s) => Value::String(s.clone()),
            Self::WrongType => Value::Boolean(true),
        }
    }
}

#[derive(Debug)]
enum Int {
    Known(u8),
    Any(i64),
    WrongType,
}

impl<'a> Arbitrary<'a> for Int {
    fn arbitrary(u: &mut Unstructured<'a>) -> arbitrary::Result<Self> {
        Ok(match u8::arbitrary(u)? {
            tag @ 0..=229 => Self::Known(tag),
            230..=252 => Self::Any(u.arbitrary()?),
            _ => Self::WrongType,
        })
    }
}

impl Int {
    fn value(&self) -> Value {
        match self {
            // Mostly the valid ones, at the front of the list.
            Self::Known(i) if i % 4 != 0 => Value::Integer(INTS[usize::from(*i) % 6]),
            Self::Known(i) => Value::Integer(INTS[usize::from(*i) % INTS.len()]),
            Self::Any(n) => Value::Integer(*n),
            Self::WrongType => Value::String("5".to_owned()),
        }
    }
}

#[derive(Arbitrary, Debug)]
struct Server {
    header_read_timeout: Option<Str>,
    upstream_timeout: Option<Str>,
    max_body_bytes: Option<Int>,
    max_connections: Option<Int>,
    shutdown_timeout: Option<Str>,
}

#[derive(Arbitrary, Debug)]
struct Store {
    backend: Option<Str>,
    url: Option<Str>,
    nodes: Option<Vec<Str>>,
    prefix: Option<Str>,
    timeout_ms: Option<Int>,
    on_error: Option<Str>,
}

#[derive(Arbitrary, Debug)]
struct Limit {
    key: Option<Str>,
    algorithm: Option<Str>,
    limit: Option<Int>,
    window: Option<Str>,
    burst: Option<Int>,
    name: Option<Str>,
}

#[derive(Arbitrary, Debug)]
struct Route {
    path: Option<Str>,
    upstream: Option<Str>,
    limits: Vec<Limit>,
}

#[derive(Arbitrary, Debug)]
struct Doc {
    listen: Option<Str>,
    admin_listen: Option<Str>,
    trusted_proxies: Option<Vec<Str>>,
    server: Option<Server>,
    store: Option<Store>,
    routes: Vec<Route>,
    /// A field the gateway does not know.
    unknown: Option<(String, Str)>,
}

fn put(table: &mut Table, key: &str, value: Option<Value>) {
    if let Some(value) = value {
        table.insert(key.to_owned(), value);
    }
}

fn strings(list: &[Str], pool: &[&str]) -> Value {
    Value::Array(list.iter().map(|s| s.value(pool)).collect())
}

fn render(doc: &Doc) -> Option<String> {
    let mut top = Table::new();
    put(
        &mut top,
        "listen",
        doc.listen.as_ref().map(|s| s.value(LISTEN)),
    );
    put(
        &mut top,
        "admin_listen",
        doc.admin_listen.as_ref().map(|s| s.value(LISTEN)),
    );
    put(
        &mut top,
        "trusted_proxies",
        doc.trusted_proxies.as_deref().map(|l| strings(l, CIDRS)),
    );
    if let Some(server) = &doc.server {
        let mut t = Table::new();
        let timeout = |s: &Option<Str>| s.as_ref().map(|s| s.value(TIMEOUTS));
        put(
            &mut t,
            "header_read_timeout",
            timeout(&server.header_read_timeout),
        );
        put(
            &mut t,
            "upstream_timeout",
            timeout(&server.upstream_timeout),
        );
        put(
            &mut t,
            "max_body_bytes",
            server.max_body_bytes.as_ref().map(Int::value),
        );
        put(
            &mut t,
            "max_connections",
            server.max_connections.as_ref().map(Int::value),
        );
        put(
            &mut t,
            "shutdown_timeout",
            timeout(&server.shutdown_timeout),
        );
        top.insert("server".to_owned(), Value::Table(t));
    }
    if let Some(store) = &doc.store {
        let mut t = Table::new();
        put(
            &mut t,
            "backend",
            store.backend.as_ref().map(|s| s.value(BACKENDS)),
        );
        put(
            &mut t,
            "url",
            store.url.as_ref().map(|s| s.value(REDIS_URLS)),
        );
        put(
            &mut t,
            "nodes",
            store.nodes.as_deref().map(|l| strings(l, REDIS_URLS)),
        );
        put(
            &mut t,
            "prefix",
            store.prefix.as_ref().map(|s| s.value(PREFIXES)),
        );
        put(
            &mut t,
            "timeout_ms",
            store.timeout_ms.as_ref().map(Int::value),
        );
        put(
            &mut t,
            "on_error",
            store.on_error.as_ref().map(|s| s.value(ON_ERROR)),
        );
        top.insert("store".to_owned(), Value::Table(t));
    }
    let mut routes = Vec::new();
    for route in &doc.routes {
        let mut r = Table::new();
        put(&mut r, "path", route.path.as_ref().map(|s| s.value(PATHS)));
        put(
            &mut r,
            "upstream",
            route.upstream.as_ref().map(|s| s.value(UPSTREAMS)),
        );
        let mut limits = Vec::new();
        for limit in &route.limits {
            let mut l = Table::new();
            put(&mut l, "key", limit.key.as_ref().map(|s| s.value(KEYS)));
            put(
                &mut l,
                "algorithm",
                limit.algorithm.as_ref().map(|s| s.value(ALGORITHMS)),
            );
            put(&mut l, "limit", limit.limit.as_ref().map(Int::value));
            put(
                &mut l,
                "window",
                limit.window.as_ref().map(|s| s.value(WINDOWS)),
            );
            put(&mut l, "burst", limit.burst.as_ref().map(Int::value));
            put(&mut l, "name", limit.name.as_ref().map(|s| s.value(NAMES)));
            limits.push(Value::Table(l));
        }
        if !limits.is_empty() {
            r.insert("limits".to_owned(), Value::Array(limits));
        }
        routes.push(Value::Table(r));
    }
    if !routes.is_empty() {
        top.insert("routes".to_owned(), Value::Array(routes));
    }
    if let Some((key, value)) = &doc.unknown {
        top.insert(key.clone(), value.value(NAMES));
    }
    toml::to_string(&top).ok()
}

fn check(text: &str) {
    let config = match config::Config::parse(text) {
        Ok(config) => config,
        Err(error) => {
            // The message is printable and names what is wrong.
            let _ = error.to_string();
            assert!(!error.message.is_empty());
            return;
        }
    };
    if let Some(admin) = config.admin_listen {
        assert!(admin != config.listen || admin.port() == 0);
    }
    // The library's rule, which `RedisStore::with_prefix` applies after connecting.
    let prefix = &config.store.prefix;
    assert!(
        tollgate::store::validate_prefix(prefix).is_ok(),
        "{prefix:?}"
    );
    assert!(prefix.len() <= 64, "{prefix:?}");
    assert!(
        prefix
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || b"-_.:/".contains(&b)),
        "{prefix:?}"
    );
    assert!(!config.store.timeout.is_zero());
    let server = &config.server;
    for timeout in [
        server.header_read_timeout,
        server.upstream_timeout,
        server.shutdown_timeout,
    ] {
        // Timers add these to the current instant: bounded, never zero.
        assert!(
            timeout >= std::time::Duration::from_millis(1),
            "{timeout:?}"
        );
        assert!(
            timeout <= std::time::Duration::from_secs(86_400),
            "{timeout:?}"
        );
    }
    assert!(server.max_body_bytes >= 1);
    assert!((1..=1_000_000).contains(&server.max_connections));
    for (i, route) in config.routes.iter().enumerate() {
        assert_eq!(
            path::normalize_prefix(&route.path).as_deref(),
            Ok(route.path.as_str()),
            "route path not normalised"
        );
        assert!(
            route.path == "/" || !route.path.ends_with('/'),
            "{:?}",
            route.path
        );
        assert!(
            config.routes[..i].iter().all(|r| r.path != route.path),
            "duplicate route {:?}",
            route.path
        );
        if let Some(upstream) = &route.upstream {
            let base = &upstream.base_path;
            assert!(
                base.is_empty() || (base.starts_with('/') && !base.ends_with('/')),
                "{base:?}"
            );
            assert!(!upstream.authority.host().is_empty());
        }
        for limit in &route.limits {
            let limit = &limit.limit;
            assert!(limit.limit() >= 1 && limit.burst() >= 1);
            assert!(limit.window() >= std::time::Duration::from_millis(1));
            assert!(limit.window() <= tollgate::MAX_WINDOW);
            assert!(limit.name().is_some());
        }
    }
}

// The first byte chooses: even, the rest is the file's text; odd, the rest builds a `Doc`.
fuzz_target!(|data: &[u8]| {
    let Some((mode, rest)) = data.split_first() else {
        return;
    };
    if mode % 2 == 0 {
        check(&String::from_utf8_lossy(rest));
    } else if let Ok(doc) = Doc::arbitrary_take_rest(Unstructured::new(rest))
        && let Some(text) = render(&doc)
    {
        check(&text);
    }
});
