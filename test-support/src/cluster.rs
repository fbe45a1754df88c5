//! A real Redis Cluster on loopback: six `redis-server` processes (three masters, three
//! replicas) created with `redis-cli --cluster create`, killed on drop (also when the test
//! panics: the servers are dropped while unwinding).
//!
//! Node indices are positions in [`RedisCluster::urls`]; which of them are masters is read
//! from the cluster itself (`CLUSTER NODES`), since failovers and resharding change it.

use std::{
    collections::HashSet,
    net::TcpListener,
    process::{Command, Stdio},
    sync::Arc,
    time::{Duration, Instant},
};

use super::{RedisServer, free_port, tls::TlsFiles};

/// How many nodes: three masters, each with one replica.
pub const NODES: usize = 6;
/// `cluster-node-timeout`: short, so that a killed master is failed over in a few
/// seconds, yet long enough that a busy machine does not fail over a live node.
pub const NODE_TIMEOUT_MS: u64 = 2000;
/// Redis Cluster's number of hash slots.
pub const SLOTS: u16 = 16384;

/// How long the harness waits for the cluster to form or to settle.
const SETTLE: Duration = Duration::from_secs(30);

/// One node as `CLUSTER NODES` describes it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct NodeInfo {
    pub id: String,
    pub port: u16,
    pub master: bool,
    /// Flagged `fail` or `fail?` by the node that answered.
    pub failing: bool,
    /// A replica's master.
    pub master_id: Option<String>,
    /// Owned slot ranges, inclusive (importing/migrating markers left out).
    pub slots: Vec<(u16, u16)>,
}

impl NodeInfo {
    pub fn owns(&self, slot: u16) -> bool {
        self.slots.iter().any(|&(a, b)| (a..=b).contains(&slot))
    }
}

/// Six `redis-server` processes forming one cluster.
pub struct RedisCluster {
    nodes: Vec<RedisServer>,
}

impl RedisCluster {
    /// Starts six nodes, creates the cluster (three masters with one replica each) and waits
    /// until every node reports `cluster_state:ok` with all slots covered and every replica
    /// is in sync with its master.
    pub fn start() -> Self {
        Self::start_with_tls(None)
    }

    /// [`start`](Self::start) with every node speaking only TLS (clients, cluster bus and
    /// replication), with certificates signed by `tls`'s CA.
    pub fn start_tls(tls: &Arc<TlsFiles>) -> Self {
        Self::start_with_tls(Some(tls))
    }

    fn start_with_tls(tls: Option<&Arc<TlsFiles>>) -> Self {
        let tls_args: &[&str] = if tls.is_some() {
            &["--tls-cluster", "yes", "--tls-replication", "yes"]
        } else {
            &[]
        };
        let timeout = NODE_TIMEOUT_MS.to_string();
        let mut taken = HashSet::new();
        let mut nodes = Vec::with_capacity(NODES);
        for _ in 0..NODES {
            let port = cluster_port(&mut taken);
            let config_file = format!("nodes-{port}.conf");
            nodes.push(RedisServer::start_on_with_tls(
                port,
                &[
                    tls_args,
                    &[
                        "--cluster-enabled",
                        "yes",
                        // Relative to the server's own `--dir`: unique per node.
                        "--cluster-config-file",
                        &config_file,
                        "--cluster-node-timeout",
                        &timeout,
                        // Replicas sync at once instead of after the default 5 s.
                        "--repl-diskless-sync-delay",
                        "0",
                    ],
                ]
                .concat(),
                tls.cloned(),
            ));
        }
        let cluster = Self { nodes };
        cluster.create();
        cluster.wait_for("the new cluster to be formed", SETTLE, Self::is_formed);
        cluster
    }

    fn create(&self) {
        let addresses: Vec<String> = self
            .nodes
            .iter()
            .map(|n| format!("127.0.0.1:{}", n.port()))
            .collect();
        let mut tls_args = self.nodes[0].cli_args();
        tls_args.drain(..2); // not -p: the addresses are given
        // Under `timeout` (coreutils): on a machine loaded enough that the nodes never
        // agree, `--cluster create` waits for the join forever; a failed test is better
        // than a hung run.
        let out = Command::new("timeout")
            .args(["120", "redis-cli"])
            .args(&tls_args)
            .args(["--cluster", "create"])
            .args(&addresses)
            .args(["--cluster-replicas", "1", "--cluster-yes"])
            .stdin(Stdio::null())
            .output()
            .unwrap_or_else(|e| {
                panic!("could not run redis-cli ({e}): install redis-tools (apt-get install redis-tools)")
            });
        let stdout = String::from_utf8_lossy(&out.stdout);
        assert!(
            out.status.success() && stdout.contains("[OK] All 16384 slots covered"),
            "redis-cli --cluster create failed: {}\n{stdout}\n{}",
            out.status,
            String::from_utf8_lossy(&out.stderr)
        );
    }

    /// Every running node says `cluster_state:ok` and sees three masters (not failing)
    /// covering all slots: the cluster serves every key.
    pub fn is_serving(&self) -> bool {
        self.running().all(|i| {
            let Some(info) = self.cli(i, &["CLUSTER", "INFO"]) else {
                return false;
            };
            field(&info, "cluster_state") == Some("ok")
                && field(&info, "cluster_slots_ok") == Some("16384")
                && self
                    .nodes_seen_by(i)
                    .is_some_and(|nodes| covered_by_three_masters(&nodes))
        })
    }

    /// The freshly created cluster is complete: serving, every node knows all six, and each
    /// master has one replica that is in sync with it.
    pub fn is_formed(&self) -> bool {
        self.is_serving()
            && self.running().all(|i| {
                let Some(nodes) = self.nodes_seen_by(i) else {
                    return false;
                };
                let masters: Vec<&str> = nodes
                    .iter()
                    .filter(|n| n.master && !n.slots.is_empty())
                    .map(|n| n.id.as_str())
                    .collect();
                let replicas_of = |id: &str| {
                    nodes
                        .iter()
                        .filter(|n| !n.failing && n.master_id.as_deref() == Some(id))
                        .count()
                };
                let me = nodes.iter().find(|n| n.port == self.nodes[i].port());
                let in_sync = match me {
                    Some(me) if me.master => true,
                    Some(_) => self
                        .cli(i, &["INFO", "replication"])
                        .is_some_and(|r| field(&r, "master_link_status") == Some("up")),
                    None => false,
                };
                nodes.len() == NODES && masters.iter().all(|m| replicas_of(m) == 1) && in_sync
            })
    }

    /// Polls `ready` every 50 ms until it holds; panics naming `what` after `timeout`.
    /// Returns how long it took.
    pub fn wait_for(
        &self,
        what: &str,
        timeout: Duration,
        mut ready: impl FnMut(&Self) -> bool,
    ) -> Duration {
        let start = Instant::now();
        while start.elapsed() < timeout {
            if ready(self) {
                return start.elapsed();
            }
            std::thread::sleep(Duration::from_millis(50));
        }
        let views: Vec<String> = self
            .running()
            .map(|i| {
                format!(
                    "node {i} (port {}):\n{}",
                    self.nodes[i].port(),
                    self.cli(i, &["CLUSTER", "NODES"]).unwrap_or_default()
                )
            })
            .collect();
        panic!(
            "timed out after {timeout:?} waiting for {what}:\n{}",
            views.join("\n")
        );
    }

    /// Every node's URL, dead or alive.
    pub fn urls(&self) -> Vec<String> {
        self.nodes.iter().map(RedisServer::url).collect()
    }

    /// The server at `index`.
    pub fn node(&self, index: usize) -> &RedisServer {
        &self.nodes[index]
    }

    /// The indices of the running nodes.
    pub fn running(&self) -> impl Iterator<Item = usize> + '_ {
        (0..self.nodes.len()).filter(|&i| self.nodes[i].is_running())
    }

    /// `redis-cli` on node `index`.
    pub fn cli(&self, index: usize, args: &[&str]) -> Option<String> {
        self.nodes[index].cli(args)
    }

    /// The node's own view of the cluster (`CLUSTER NODES`), if it answers.
    pub fn nodes_seen_by(&self, index: usize) -> Option<Vec<NodeInfo>> {
        let text = self.cli(index, &["CLUSTER", "NODES"])?;
        text.lines()
            .filter(|l| !l.trim().is_empty())
            .map(parse_node)
            .collect()
    }

    /// The cluster as the first running node sees it.
    pub fn topology(&self) -> Vec<NodeInfo> {
        self.running()
            .find_map(|i| self.nodes_seen_by(i))
            .expect("no running node answers CLUSTER NODES")
    }

    fn index_of_port(&self, port: u16) -> usize {
        self.nodes
            .iter()
            .position(|n| n.port() == port)
            .unwrap_or_else(|| panic!("port {port} is not a node of this cluster"))
    }

    fn index_of_id(&self, topology: &[NodeInfo], id: &str) -> usize {
        let node = topology.iter().find(|n| n.id == id);
        self.index_of_port(node.unwrap_or_else(|| panic!("unknown node id {id}")).port)
    }

    /// The node id of node `index`.
    pub fn id(&self, index: usize) -> String {
        let port = self.nodes[index].port();
        self.topology()
            .into_iter()
            .find(|n| n.port == port)
            .map(|n| n.id)
            .expect("the node is in the topology")
    }

    /// The masters that own slots, in node order.
    pub fn masters(&self) -> Vec<usize> {
        let mut masters: Vec<usize> = self
            .topology()
            .iter()
            .filter(|n| n.master && !n.failing && !n.slots.is_empty())
            .map(|n| self.index_of_port(n.port))
            .collect();
        masters.sort_unstable();
        masters
    }

    /// The replica of master `index`.
    pub fn replica_of(&self, index: usize) -> usize {
        let topology = self.topology();
        let id = self.id(index);
        let replica = topology
            .iter()
            .find(|n| n.master_id.as_deref() == Some(id.as_str()))
            .unwrap_or_else(|| panic!("node {index} has no replica:\n{}", self.describe()));
        self.index_of_port(replica.port)
    }

    /// Waits until the replica of `master` has everything `master` wrote so far (its
    /// replication offset reached the master's).
    pub fn wait_replicated(&self, master: usize) {
        let offset = |index: usize, name: &str| -> Option<u64> {
            let info = self.cli(index, &["INFO", "replication"])?;
            field(&info, name)?.parse().ok()
        };
        let target = offset(master, "master_repl_offset").expect("master_repl_offset");
        let replica = self.replica_of(master);
        self.wait_for("the replica to catch up", SETTLE, |_| {
            offset(replica, "slave_repl_offset").is_some_and(|o| o >= target)
        });
    }

    /// The hash slot of `key` (`CLUSTER KEYSLOT`).
    pub fn keyslot(&self, key: &str) -> u16 {
        let index = self.running().next().expect("a running node");
        let slot = self
            .cli(index, &["CLUSTER", "KEYSLOT", key])
            .expect("CLUSTER KEYSLOT");
        slot.trim().parse().expect("a slot number")
    }

    /// The master that owns `slot`, as the first running node sees it.
    pub fn master_of_slot(&self, slot: u16) -> usize {
        let topology = self.topology();
        let owner = topology
            .iter()
            .find(|n| n.master && n.owns(slot))
            .unwrap_or_else(|| panic!("no master owns slot {slot}"));
        self.index_of_port(owner.port)
    }

    /// The master that holds the Redis key `key`.
    pub fn node_for_key(&self, key: &str) -> usize {
        self.master_of_slot(self.keyslot(key))
    }

    /// Whether every running node agrees that `master` owns `slot`.
    pub fn all_agree_owner(&self, slot: u16, master: usize) -> bool {
        let port = self.nodes[master].port();
        self.running().all(|i| {
            self.nodes_seen_by(i).is_some_and(|nodes| {
                nodes
                    .iter()
                    .any(|n| n.port == port && n.master && n.owns(slot))
            })
        })
    }

    /// `DBSIZE` of node `index`.
    pub fn dbsize(&self, index: usize) -> u64 {
        let size = self.cli(index, &["DBSIZE"]).expect("DBSIZE");
        size.trim().parse().expect("DBSIZE is an integer")
    }

    /// SIGKILLs node `index` (no failover is asked for: the cluster notices by itself).
    pub fn kill(&mut self, index: usize) {
        self.nodes[index].kill();
    }

    /// Starts moving `slot` to master `to` (`SETSLOT IMPORTING` on the target, then
    /// `MIGRATING` on its owner), moving no key; returns the owner. Idempotent, so
    /// [`move_slot`](Self::move_slot) can finish a move begun here.
    pub fn begin_move(&self, slot: u16, to: usize) -> usize {
        let from = self.master_of_slot(slot);
        assert_ne!(from, to, "slot {slot} is already on node {to}");
        let (from_id, to_id, slot) = (self.id(from), self.id(to), slot.to_string());
        for (index, state, id) in [(to, "IMPORTING", &from_id), (from, "MIGRATING", &to_id)] {
            let reply = self.cli(index, &["CLUSTER", "SETSLOT", &slot, state, id]);
            assert_eq!(
                reply.unwrap_or_default().trim(),
                "OK",
                "node {index}: {state}"
            );
        }
        from
    }

    /// Moves `slot` with its keys to master `to` the way `redis-cli --cluster reshard`
    /// does: `SETSLOT IMPORTING` on the target, `MIGRATING` on the source, `MIGRATE` the
    /// keys in batches, then `SETSLOT NODE` on every master, and waits until every running
    /// node agrees. Returns the number of keys moved.
    pub fn move_slot(&self, slot: u16, to: usize) -> usize {
        let from = self.begin_move(slot, to);
        let to_id = self.id(to);
        let slot_arg = slot.to_string();
        let ok = |index: usize, args: &[&str]| {
            let reply = self.cli(index, args).unwrap_or_default();
            assert_eq!(reply.trim(), "OK", "node {index}: {args:?}");
        };
        let to_port = self.nodes[to].port().to_string();
        let mut moved = 0;
        // Bounded: while MIGRATING, new keys of the slot go to the target (ASK), so the
        // source only ever shrinks.
        for _ in 0..10_000 {
            let keys = self
                .cli(from, &["CLUSTER", "GETKEYSINSLOT", &slot_arg, "100"])
                .expect("CLUSTER GETKEYSINSLOT");
            let keys: Vec<&str> = keys.lines().filter(|k| !k.is_empty()).collect();
            if keys.is_empty() {
                break;
            }
            let mut args = vec!["MIGRATE", "127.0.0.1", &to_port, "", "0", "5000", "KEYS"];
            args.extend(&keys);
            let reply = self.cli(from, &args).unwrap_or_default();
            assert!(
                matches!(reply.trim(), "OK" | "NOKEY"),
                "MIGRATE {keys:?}: {reply:?}"
            );
            moved += keys.len();
        }
        ok(to, &["CLUSTER", "SETSLOT", &slot_arg, "NODE", &to_id]);
        ok(from, &["CLUSTER", "SETSLOT", &slot_arg, "NODE", &to_id]);
        for master in self.masters() {
            if master != from && master != to {
                ok(master, &["CLUSTER", "SETSLOT", &slot_arg, "NODE", &to_id]);
            }
        }
        self.wait_for("every node to see the moved slot", SETTLE, |c| {
            c.all_agree_owner(slot, to)
        });
        moved
    }

    /// Fails unless every key on every running master has a TTL. Returns how many keys it
    /// checked.
    pub fn assert_every_key_expires(&self) -> usize {
        self.masters()
            .into_iter()
            .map(|master| super::assert_every_key_expires(&self.nodes[master]))
            .sum()
    }

    /// The node ids as `index -> id`, for messages.
    pub fn describe(&self) -> String {
        let topology = self.topology();
        let mut out = String::new();
        for node in &topology {
            let index = self.index_of_port(node.port);
            let role = match &node.master_id {
                Some(master) => format!("replica of {}", self.index_of_id(&topology, master)),
                None => format!("master {:?}", node.slots),
            };
            let failing = if node.failing { " (failing)" } else { "" };
            out += &format!("node {index} port {}: {role}{failing}\n", node.port);
        }
        out
    }
}

/// Three masters, none failing, own all the slots between them.
fn covered_by_three_masters(nodes: &[NodeInfo]) -> bool {
    let masters: Vec<&NodeInfo> = nodes
        .iter()
        .filter(|n| n.master && !n.failing && !n.slots.is_empty())
        .collect();
    let covered: u32 = masters
        .iter()
        .flat_map(|m| &m.slots)
        .map(|&(a, b)| u32::from(b - a) + 1)
        .sum();
    masters.len() == 3 && covered == u32::from(SLOTS)
}

/// A free port `p` whose cluster bus port `p + 10000` is free too, neither taken by this
/// cluster already.
fn cluster_port(taken: &mut HashSet<u16>) -> u16 {
    for _ in 0..1000 {
        let port = free_port();
        let Some(bus) = port.checked_add(10_000) else {
            continue;
        };
        if taken.contains(&port) || taken.contains(&bus) {
            continue;
        }
        if TcpListener::bind(("127.0.0.1", bus)).is_err() {
            continue;
        }
        taken.insert(port);
        taken.insert(bus);
        return port;
    }
    panic!("found no free port p with p + 10000 free in 1000 tries");
}

/// `name:value` from `INFO`-style text.
fn field<'a>(text: &'a str, name: &str) -> Option<&'a str> {
    text.lines()
        .find_map(|line| line.trim().strip_prefix(name)?.strip_prefix(':'))
}

/// `<id> <ip:port@cport[,hostname]> <flags> <master> <ping> <pong> <epoch> <link> <slot>...`
fn parse_node(line: &str) -> Option<NodeInfo> {
    let parts: Vec<&str> = line.split_whitespace().collect();
    if parts.len() < 8 {
        return None;
    }
    let address = parts[1].split(['@', ',']).next()?;
    let port = address.rsplit(':').next()?.parse().ok()?;
    let flags: Vec<&str> = parts[2].split(',').collect();
    let slots = parts[8..]
        .iter()
        .filter(|s| !s.starts_with('['))
        .map(|s| match s.split_once('-') {
            Some((a, b)) => Some((a.parse().ok()?, b.parse().ok()?)),
            None => s.parse().ok().map(|a| (a, a)),
        })
        .collect::<Option<Vec<_>>>()?;
    Some(NodeInfo {
        id: parts[0].to_owned(),
        port,
        master: flags.contains(&"master"),
        failing: flags.iter().any(|f| f.starts_with("fail")),
        master_id: (parts[3] != "-").then(|| parts[3].to_owned()),
        slots,
    })
}
