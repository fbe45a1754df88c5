//! Test harness: real `redis-server` processes on free loopback ports, stopped on drop;
//! [`cluster::RedisCluster`] forms six of them into a Redis Cluster.
//!
//! Never touches the machine's shared Redis on 6379. A missing `redis-server` is a loud
//! failure that names the fix; nothing is skipped.

#![allow(dead_code, unreachable_pub)]

pub mod acl;
pub mod cluster;
#[cfg(feature = "redis")]
pub mod failover;
pub mod kinds;
pub mod logs;
pub mod sentinel;
pub mod tls;

use std::{
    io::{BufRead, BufReader},
    net::TcpListener,
    path::PathBuf,
    process::{Child, Command, Stdio},
    sync::Arc,
    time::{Duration, Instant},
};

/// A plain multiplexed connection for a test's own commands, waiting up to 10 s to connect
/// and for each answer: redis-rs's defaults (1 s, 500 ms) fail on a loaded machine.
#[cfg(feature = "redis")]
pub async fn test_connection(url: &str) -> redis::aio::MultiplexedConnection {
    let config = redis::AsyncConnectionConfig::new()
        .set_connection_timeout(Some(Duration::from_secs(10)))
        .set_response_timeout(Some(Duration::from_secs(10)));
    redis::Client::open(url)
        .unwrap()
        .get_multiplexed_async_connection_with_config(&config)
        .await
        .unwrap()
}

/// The `redis-server` binary: `$REDIS_SERVER`, or the one on `PATH`.
/// The count in a fixed window's stored value, `count * 2^20 + window tag`
/// (lua/fixed_window.lua), as `redis-cli GET` prints it.
pub fn fixed_window_count(value: &str) -> u32 {
    let value: u64 = value
        .trim()
        .parse()
        .unwrap_or_else(|_| panic!("not a fixed window's value: {value:?}"));
    u32::try_from(value >> 20).unwrap()
}

/// The window tag in a fixed window's stored value (see [`fixed_window_count`]).
pub fn fixed_window_tag(value: &str) -> u64 {
    let value: u64 = value
        .trim()
        .parse()
        .unwrap_or_else(|_| panic!("not a fixed window's value: {value:?}"));
    value & 0xF_FFFF
}

/// The tag of the fixed window that starts at `start` ms (lua/fixed_window.lua's `fw_tag`).
pub fn fixed_window_tag_of(start: u64, window_ms: u64) -> u64 {
    (start / window_ms) % 0xF_FFFF + 1
}

pub fn redis_server_bin() -> String {
    std::env::var("REDIS_SERVER").unwrap_or_else(|_| "redis-server".to_owned())
}

/// An error with its causes (`StoreError`'s `Display` names only its own level), as the
/// layer logs it.
pub fn chain(error: &dyn std::error::Error) -> String {
    let mut out = error.to_string();
    let mut source = error.source();
    while let Some(cause) = source {
        out.push_str(": ");
        out.push_str(&cause.to_string());
        source = cause.source();
    }
    out
}

/// The major version of [`redis_server_bin`].
pub fn redis_server_major_version() -> u32 {
    redis_server_version().0
}

/// The (major, minor) version of [`redis_server_bin`] (`redis-server --version`), read
/// once.
pub fn redis_server_version() -> (u32, u32) {
    static VERSION: std::sync::OnceLock<(u32, u32)> = std::sync::OnceLock::new();
    *VERSION.get_or_init(|| {
        let out = Command::new(redis_server_bin())
            .arg("--version")
            .output()
            .unwrap_or_else(|e| panic!("could not run `{} --version`: {e}", redis_server_bin()));
        let text = String::from_utf8_lossy(&out.stdout);
        let mut numbers = text
            .split("v=")
            .nth(1)
            .unwrap_or_default()
            .split(['.', ' '])
            .map(str::parse::<u32>);
        match (numbers.next(), numbers.next()) {
            (Some(Ok(major)), Some(Ok(minor))) => (major, minor),
            _ => panic!("no version in `redis-server --version`: {text}"),
        }
    })
}

/// `DEBUG` (for DEBUG SLEEP) is off by default since Redis 7, and the option to turn it
/// on does not exist before.
fn debug_command_args() -> &'static [&'static str] {
    if redis_server_major_version() >= 7 {
        &["--enable-debug-command", "local"]
    } else {
        &[]
    }
}

/// `redis://127.0.0.1:<port>`, or `rediss://` over TLS.
pub fn loopback_url(port: u16, tls: bool) -> String {
    let scheme = if tls { "rediss" } else { "redis" };
    format!("{scheme}://127.0.0.1:{port}")
}

/// A free TCP port on 127.0.0.1 (bound and released; the OS will not hand it out again
/// right away).
pub fn free_port() -> u16 {
    TcpListener::bind("127.0.0.1:0")
        .and_then(|l| l.local_addr())
        .map(|a| a.port())
        .expect("bind an ephemeral port")
}

/// One `redis-server` child process, killed (and its directory removed) on drop.
pub struct RedisServer {
    child: Option<Child>,
    port: u16,
    dir: PathBuf,
    extra_args: Vec<String>,
    /// Serving TLS only (`--port 0 --tls-port <port>`), with these certificates.
    tls: Option<Arc<tls::TlsFiles>>,
}

impl RedisServer {
    /// Starts a fresh server on a free port and waits until it answers PING.
    pub fn start() -> Self {
        Self::start_with(&[])
    }

    /// Starts a server with extra command-line arguments (`["--cluster-enabled", "yes"]`).
    pub fn start_with(extra_args: &[&str]) -> Self {
        Self::start_on(free_port(), extra_args)
    }

    /// Starts a server on `port`.
    pub fn start_on(port: u16, extra_args: &[&str]) -> Self {
        Self::start_on_with_tls(port, extra_args, None)
    }

    /// Starts a server that speaks only TLS, with certificates signed by `tls`'s CA and
    /// client certificates required.
    pub fn start_tls(tls: &Arc<tls::TlsFiles>) -> Self {
        Self::start_on_with_tls(free_port(), &[], Some(tls.clone()))
    }

    /// Starts a server on `port`, TLS-only when `tls` is given.
    pub fn start_on_with_tls(
        port: u16,
        extra_args: &[&str],
        tls: Option<Arc<tls::TlsFiles>>,
    ) -> Self {
        let dir =
            std::env::temp_dir().join(format!("tollgate-redis-{}-{port}", std::process::id()));
        std::fs::create_dir_all(&dir).expect("create the redis test directory");
        let mut server = Self {
            child: None,
            port,
            dir,
            extra_args: extra_args.iter().map(|s| (*s).to_owned()).collect(),
            tls,
        };
        server.spawn();
        server
    }

    fn spawn(&mut self) {
        let listen = match &self.tls {
            Some(tls) => tls.server_args(self.port, true),
            None => vec!["--port".to_owned(), self.port.to_string()],
        };
        let child = Command::new(redis_server_bin())
            .args(&listen)
            .args(["--bind", "127.0.0.1", "--save", "", "--appendonly", "no"])
            .args(["--dir", self.dir.to_str().expect("utf-8 temp dir")])
            .args(debug_command_args())
            .args(&self.extra_args)
            .stdout(Stdio::piped())
            .stderr(Stdio::inherit())
            .spawn()
            .unwrap_or_else(|e| {
                panic!(
                    "could not start `{}` ({e}). The Redis tests need redis-server: \
                     install it (`apt-get install redis-server`) or set REDIS_SERVER.",
                    redis_server_bin()
                )
            });
        self.child = Some(child);
        self.wait_ready();
    }

    fn wait_ready(&mut self) {
        let deadline = Instant::now() + Duration::from_secs(10);
        // Drain stdout in the background so the server never blocks on a full pipe.
        if let Some(stdout) = self.child.as_mut().and_then(|c| c.stdout.take()) {
            std::thread::spawn(move || for _ in BufReader::new(stdout).lines() {});
        }
        while Instant::now() < deadline {
            if let Some(status) = self
                .child
                .as_mut()
                .and_then(|c| c.try_wait().ok().flatten())
            {
                panic!(
                    "redis-server on port {} exited at start: {status}",
                    self.port
                );
            }
            if self
                .cli(&["PING"])
                .map(|o| o.trim() == "PONG")
                .unwrap_or(false)
            {
                return;
            }
            std::thread::sleep(Duration::from_millis(20));
        }
        panic!(
            "redis-server on port {} did not answer PING within 10s",
            self.port
        );
    }

    /// The port.
    pub fn port(&self) -> u16 {
        self.port
    }

    /// Whether the process runs (not [`kill`](Self::kill)ed).
    pub fn is_running(&self) -> bool {
        self.child.is_some()
    }

    /// `redis://127.0.0.1:<port>`, or `rediss://` for a TLS server.
    pub fn url(&self) -> String {
        loopback_url(self.port, self.tls.is_some())
    }

    /// The certificates of a TLS server.
    pub fn tls(&self) -> Option<&Arc<tls::TlsFiles>> {
        self.tls.as_ref()
    }

    /// `redis-cli` arguments that reach this server (`-p`, and TLS options).
    pub fn cli_args(&self) -> Vec<String> {
        let mut args = vec!["-p".to_owned(), self.port.to_string()];
        if let Some(tls) = &self.tls {
            args.extend(tls.cli_args());
        }
        args
    }

    /// Runs `redis-cli -p <port> <args>` and returns its stdout.
    pub fn cli(&self, args: &[&str]) -> Option<String> {
        let out = Command::new("redis-cli")
            .args(self.cli_args())
            .args(args)
            .stderr(Stdio::null())
            .output()
            .ok()?;
        out.status
            .success()
            .then(|| String::from_utf8_lossy(&out.stdout).into_owned())
    }

    /// How many times `command` (lower case, e.g. `evalsha`, `script|load`) ran since the
    /// server started or since `CONFIG RESETSTAT`, from `INFO commandstats`; 0 if it never
    /// ran. Before Redis 7 a subcommand counts as its command (all `SCRIPT` calls).
    pub fn calls(&self, command: &str) -> u64 {
        let stats = self
            .cli(&["INFO", "commandstats"])
            .expect("INFO commandstats");
        // Before Redis 7, subcommands (`script|load`) count under their command.
        let command = match command.split_once('|') {
            Some((parent, _)) if redis_server_major_version() < 7 => parent,
            _ => command,
        };
        let prefix = format!("cmdstat_{command}:calls=");
        stats
            .lines()
            .find_map(|l| l.strip_prefix(&prefix))
            .and_then(|rest| rest.split(',').next())
            .map_or(0, |n| n.parse().unwrap())
    }

    /// How many script calls ran: `FCALL`s of the library (Redis 7+) and `EVALSHA`s of the
    /// script (before Redis 7, or where functions are unavailable).
    pub fn script_calls(&self) -> u64 {
        self.calls("fcall") + self.calls("evalsha")
    }

    /// How many times the script or the library was loaded (`SCRIPT LOAD`, `FUNCTION
    /// LOAD`); before Redis 7 every `SCRIPT` subcommand counts.
    pub fn script_loads(&self) -> u64 {
        let functions = if redis_server_major_version() >= 7 {
            self.calls("function|load")
        } else {
            0
        };
        self.calls("script|load") + functions
    }

    /// Drops every loaded script and function library (`SCRIPT FLUSH`, and `FUNCTION
    /// FLUSH` on Redis 7+), as a restart would.
    pub fn flush_scripts(&self) {
        assert_eq!(self.cli(&["SCRIPT", "FLUSH"]).unwrap().trim(), "OK");
        if redis_server_major_version() >= 7 {
            assert_eq!(self.cli(&["FUNCTION", "FLUSH"]).unwrap().trim(), "OK");
        }
    }

    /// Kills the server with SIGKILL (no shutdown, no save).
    pub fn kill(&mut self) {
        if let Some(mut child) = self.child.take() {
            let _ = child.kill();
            let _ = child.wait();
        }
    }

    /// Starts the server again on the same port after [`kill`](Self::kill).
    pub fn restart(&mut self) {
        self.kill();
        self.spawn();
    }
}

impl Drop for RedisServer {
    fn drop(&mut self) {
        self.kill();
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}

/// Fails unless every key in `server` has a TTL (no immortal rate-limit state). Returns
/// how many keys it checked.
pub fn assert_every_key_expires(server: &RedisServer) -> usize {
    let keys = server.cli(&["--scan"]).expect("redis-cli --scan");
    let keys: Vec<&str> = keys.lines().filter(|k| !k.is_empty()).collect();
    for key in &keys {
        let ttl = server.cli(&["PTTL", key]).expect("redis-cli PTTL");
        let ttl: i64 = ttl.trim().parse().expect("PTTL is an integer");
        // -1: no TTL, the defect. -2: the key expired between SCAN and PTTL, fine.
        assert_ne!(ttl, -1, "key {key:?} has no TTL");
    }
    keys.len()
}
