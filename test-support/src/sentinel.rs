//! Redis Sentinel on loopback: a master, a replica and three sentinels
//! (`redis-server <conf> --sentinel`, config files generated on free ports), killed on drop.

use std::{
    io::{BufRead, BufReader},
    path::PathBuf,
    process::{Child, Command, Stdio},
    time::{Duration, Instant},
};

use std::sync::Arc;

use super::{RedisServer, free_port, redis_server_bin, tls::TlsFiles};

/// The master's name in the sentinels' `sentinel monitor`.
pub const MASTER_NAME: &str = "tollgate-master";
/// `down-after-milliseconds`: a killed master is seen down after this.
pub const DOWN_AFTER_MS: u64 = 1000;
/// How long the harness waits for the topology to form or to settle.
const SETTLE: Duration = Duration::from_secs(30);

/// One `redis-server --sentinel` process.
pub struct SentinelProcess {
    child: Child,
    port: u16,
    dir: PathBuf,
    /// Speaking only TLS, to clients and to the Redis servers.
    tls: Option<Arc<TlsFiles>>,
}

impl SentinelProcess {
    /// One sentinel (quorum 1) watching a master on `master_port` that may not be up yet.
    pub fn watching(master_port: u16) -> Self {
        Self::start(master_port, 1, None)
    }

    fn start(master_port: u16, quorum: u32, tls: Option<&Arc<TlsFiles>>) -> Self {
        let port = free_port();
        let dir =
            std::env::temp_dir().join(format!("tollgate-sentinel-{}-{port}", std::process::id()));
        std::fs::create_dir_all(&dir).expect("create the sentinel directory");
        let config = dir.join("sentinel.conf");
        let listen = match tls {
            Some(tls) => format!(
                "port 0\ntls-port {port}\ntls-cert-file {}\ntls-key-file {}\n\
                 tls-client-cert-file {}\ntls-client-key-file {}\ntls-ca-cert-file {}\n\
                 tls-auth-clients optional\ntls-replication yes\n",
                tls.path("server.crt"),
                tls.path("server.key"),
                tls.path("client.crt"),
                tls.path("client.key"),
                tls.path("ca.crt"),
            ),
            None => format!("port {port}\n"),
        };
        std::fs::write(
            &config,
            format!(
                "{listen}bind 127.0.0.1\ndir {dir}\n\
                 sentinel monitor {MASTER_NAME} 127.0.0.1 {master_port} {quorum}\n\
                 sentinel down-after-milliseconds {MASTER_NAME} {DOWN_AFTER_MS}\n\
                 sentinel failover-timeout {MASTER_NAME} 10000\n\
                 sentinel parallel-syncs {MASTER_NAME} 1\n",
                dir = dir.display()
            ),
        )
        .expect("write sentinel.conf");
        let mut child = Command::new(redis_server_bin())
            .arg(&config)
            .arg("--sentinel")
            .stdout(Stdio::piped())
            .stderr(Stdio::inherit())
            .spawn()
            .expect("start redis-server --sentinel");
        if let Some(stdout) = child.stdout.take() {
            std::thread::spawn(move || for _ in BufReader::new(stdout).lines() {});
        }
        let sentinel = Self {
            child,
            port,
            dir,
            tls: tls.cloned(),
        };
        let deadline = Instant::now() + Duration::from_secs(10);
        while sentinel.cli(&["PING"]).is_none_or(|o| o.trim() != "PONG") {
            assert!(Instant::now() < deadline, "sentinel {port} did not start");
            std::thread::sleep(Duration::from_millis(20));
        }
        sentinel
    }

    /// `redis://127.0.0.1:<port>` (`rediss://` over TLS).
    pub fn url(&self) -> String {
        super::loopback_url(self.port, self.tls.is_some())
    }

    /// `redis-cli -p <port> <args>`.
    pub fn cli(&self, args: &[&str]) -> Option<String> {
        let tls = self.tls.as_ref().map(|t| t.cli_args()).unwrap_or_default();
        let out = Command::new("redis-cli")
            .args(["-p", &self.port.to_string()])
            .args(tls)
            .args(args)
            .stderr(Stdio::null())
            .output()
            .ok()?;
        out.status
            .success()
            .then(|| String::from_utf8_lossy(&out.stdout).into_owned())
    }
}

impl Drop for SentinelProcess {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}

/// A master, its replica and three sentinels (quorum 2) watching it.
pub struct SentinelSetup {
    pub servers: Vec<RedisServer>,
    pub sentinels: Vec<SentinelProcess>,
}

impl SentinelSetup {
    /// Starts everything and waits until the replica is in sync and every sentinel knows
    /// the replica and the two other sentinels.
    pub fn start() -> Self {
        Self::start_with_tls(None)
    }

    /// [`start`](Self::start) with everything speaking only TLS: clients, replication and
    /// the sentinels.
    pub fn start_tls(tls: &Arc<TlsFiles>) -> Self {
        Self::start_with_tls(Some(tls))
    }

    fn start_with_tls(tls: Option<&Arc<TlsFiles>>) -> Self {
        let replication: &[&str] = if tls.is_some() {
            &["--tls-replication", "yes"]
        } else {
            &[]
        };
        let start = |args: &[&str]| {
            let args = [args, replication, &["--repl-diskless-sync-delay", "0"]].concat();
            RedisServer::start_on_with_tls(free_port(), &args, tls.cloned())
        };
        let master = start(&[]);
        let master_port = master.port().to_string();
        let replica = start(&["--replicaof", "127.0.0.1", &master_port]);
        let sentinels = (0..3)
            .map(|_| SentinelProcess::start(master.port(), 2, tls))
            .collect();
        let setup = Self {
            servers: vec![master, replica],
            sentinels,
        };
        setup.wait_for("the replica and the sentinels to be ready", |s| {
            s.is_formed()
        });
        setup
    }

    fn is_formed(&self) -> bool {
        let in_sync = self.servers[1]
            .cli(&["INFO", "replication"])
            .is_some_and(|r| r.contains("master_link_status:up"));
        in_sync
            && self.sentinels.iter().all(|s| {
                let replicas = s
                    .cli(&["SENTINEL", "REPLICAS", MASTER_NAME])
                    .unwrap_or_default();
                let others = s
                    .cli(&["SENTINEL", "SENTINELS", MASTER_NAME])
                    .unwrap_or_default();
                replicas.contains(&self.servers[1].port().to_string())
                    && others.matches("runid").count() == 2
            })
    }

    /// The sentinels' URLs.
    pub fn sentinel_urls(&self) -> Vec<String> {
        self.sentinels.iter().map(SentinelProcess::url).collect()
    }

    /// The port every sentinel names as the master, if they agree.
    pub fn master_port(&self) -> Option<u16> {
        let mut ports = self.sentinels.iter().map(|s| {
            let reply = s.cli(&["SENTINEL", "GET-MASTER-ADDR-BY-NAME", MASTER_NAME])?;
            reply.lines().nth(1)?.trim().parse::<u16>().ok()
        });
        let first = ports.next()??;
        ports.all(|p| p == Some(first)).then_some(first)
    }

    /// The index in `servers` of the server on `port`.
    pub fn index_of(&self, port: u16) -> usize {
        self.servers
            .iter()
            .position(|s| s.port() == port)
            .expect("a server of this setup")
    }

    /// Waits until the replica has everything the master wrote so far.
    pub fn wait_replicated(&self) {
        let offset = |i: usize, name: &str| -> Option<u64> {
            let info = self.servers[i].cli(&["INFO", "replication"])?;
            info.lines()
                .find_map(|l| l.trim().strip_prefix(name)?.strip_prefix(':'))?
                .parse()
                .ok()
        };
        let target = offset(0, "master_repl_offset").expect("master_repl_offset");
        self.wait_for("the replica to catch up", |_| {
            offset(1, "slave_repl_offset").is_some_and(|o| o >= target)
        });
    }

    /// Polls `ready` every 50 ms; panics naming `what` after 30 s. Returns the time taken.
    pub fn wait_for(&self, what: &str, mut ready: impl FnMut(&Self) -> bool) -> Duration {
        let start = Instant::now();
        while start.elapsed() < SETTLE {
            if ready(self) {
                return start.elapsed();
            }
            std::thread::sleep(Duration::from_millis(50));
        }
        let views: Vec<String> = self
            .sentinels
            .iter()
            .map(|s| {
                s.cli(&["SENTINEL", "MASTER", MASTER_NAME])
                    .unwrap_or_default()
            })
            .collect();
        panic!("timed out after {SETTLE:?} waiting for {what}: {views:?}");
    }
}
