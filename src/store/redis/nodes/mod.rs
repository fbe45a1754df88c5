//! Per-node pipelines on a cluster: the coalesced calls of several hash slots that live on
//! one master go to it together, in one pipeline, each still its own one-slot script call.
//!
//! A script call may declare keys of one slot only, so with many cold keys nearly every
//! coalesced call is alone in its slot. redis-rs's cluster connection cannot send one
//! pipeline across slots safely (it retries a whole pipeline when one of its commands is
//! redirected, counting the others twice), so the batching task keeps its own view of
//! which master owns which slot (`CLUSTER SLOTS`, refreshed when a node redirects or
//! cannot be reached) and one multiplexed connection per master, sends every coalesced
//! call whose master it knows on that connection (several in one pipeline), and reads
//! each call's answer on its own:
//!
//! - an answer is given to the call's requests as on the per-slot path;
//! - `ASK` (the slot is migrating and the keys are gone): the call goes to the importing
//!   node right after `ASKING`, both in one pipeline, so that nothing comes in between;
//! - `MOVED`, `TRYAGAIN`, `CLUSTERDOWN`, `MASTERDOWN`, `LOADING`, `READONLY`, `NOSCRIPT`
//!   (and a missing function) mean the call never ran: it is sent again on the per-slot
//!   path (the cluster connection), which follows redirections and reloads the script;
//! - any other error (a script error, a timeout, a connection lost mid-pipeline) is the
//!   calls' error, never retried (they may have counted), and the layer's failure policy
//!   answers it;
//! - a master that cannot be reached (nothing sent) gets its calls on the per-slot path,
//!   and none for a second while the slot map is asked for again.
//!
//! On Redis 7+ the commonest call, one request against one fixed window, need not be a
//! call of its own: those of one pipeline go together in one call of `<library>_fwn`
//! (lua/one.lua), which may touch keys of any slots on its node (`allow-cross-slot-keys`)
//! and so gets them in `ARGV`, none declared. Its requests are the exception to "keys only
//! through `KEYS`" (shared/DESIGN.md): this module routes them by its own slot map, and
//! Redis still checks each key against the slots the node serves when a command touches
//! it. A key the node does not serve fails its request's first command (a `pcall`), which
//! writes nothing; that request answers -1 and takes the per-slot path, so it counts once.

use std::{
    collections::HashMap,
    sync::{
        Arc,
        atomic::{AtomicBool, Ordering},
    },
    time::{Duration, Instant},
};

use parking_lot::{Mutex, RwLock};
use redis::{
    AsyncConnectionConfig, ConnectionAddr, ConnectionInfo, RedisResult, ServerError,
    ServerErrorKind, Value,
    aio::{ConnectionLike, MultiplexedConnection},
    cluster_async::ClusterConnection,
};
use tokio::sync::{OnceCell, OwnedSemaphorePermit};

use super::{
    deliver::{Batch, deliver, deliver_share, send},
    encode::{Encoded, script_call},
    link::Connection,
    wire::{CONNECTION_TIMEOUT, RESPONSE_TIMEOUT, TlsConfig, function, store_error},
};
use crate::{StoreError, StoreErrorKind};

mod slots;

use self::slots::{Address, SlotMap};

/// How long a master that could not be reached gets no pipelines (its calls take the
/// per-slot path, which waits out a failover by itself).
const DOWN_FOR: Duration = Duration::from_secs(1);

/// The slot map is asked for at most this often.
const REFRESH_EVERY: Duration = Duration::from_millis(100);

/// Which master owns which slot, and a connection to each.
pub(crate) struct Nodes {
    /// The first seed node's settings (user, password, TLS): a master's connection is
    /// this with its address.
    template: ConnectionInfo,
    #[cfg_attr(not(feature = "tls"), allow(dead_code))]
    tls: Option<TlsConfig>,
    /// Asked for the slot map.
    cluster: ClusterConnection,
    map: RwLock<SlotMap>,
    connections: Mutex<HashMap<Address, Arc<OnceCell<MultiplexedConnection>>>>,
    /// Masters that could not be reached, and since when.
    down: Mutex<HashMap<Address, Instant>>,
    refreshing: AtomicBool,
    last_refresh: Mutex<Option<Instant>>,
}

impl Nodes {
    pub(crate) fn new(
        template: ConnectionInfo,
        tls: Option<TlsConfig>,
        cluster: ClusterConnection,
    ) -> Self {
        Self {
            template,
            tls,
            cluster,
            map: RwLock::default(),
            connections: Mutex::default(),
            down: Mutex::default(),
            refreshing: AtomicBool::new(false),
            last_refresh: Mutex::new(None),
        }
    }

    /// The master that owns `slot`, when known and reachable; None: send the slot's call
    /// on the per-slot path. An empty map asks for one.
    pub(crate) fn master_of(self: &Arc<Self>, slot: u16) -> Option<Address> {
        let found = {
            let map = self.map.read();
            let index = map.owner.get(usize::from(slot)).copied();
            index.and_then(|index| map.masters.get(usize::from(index)).cloned())
        };
        let Some(address) = found else {
            self.refresh();
            return None;
        };
        let mut down = self.down.lock();
        if let Some(since) = down.get(&address) {
            if since.elapsed() < DOWN_FOR {
                drop(down);
                // A failover may have promoted a replica meanwhile.
                self.refresh();
                return None;
            }
            down.remove(&address);
        }
        Some(address)
    }

    /// The connection to `address`, made on first use.
    pub(crate) async fn connection(&self, address: &Address) -> RedisResult<MultiplexedConnection> {
        let cell = self
            .connections
            .lock()
            .entry(address.clone())
            .or_default()
            .clone();
        let result = cell
            .get_or_try_init(|| self.connect(address))
            .await
            .cloned();
        if result.is_err() {
            self.forget(address);
            self.down.lock().insert(address.clone(), Instant::now());
        }
        result
    }

    async fn connect(&self, address: &Address) -> RedisResult<MultiplexedConnection> {
        let (host, port) = (address.0.clone(), address.1);
        let addr = match self.template.addr() {
            ConnectionAddr::TcpTls { insecure, .. } => ConnectionAddr::TcpTls {
                host,
                port,
                insecure: *insecure,
                tls_params: None,
            },
            _ => ConnectionAddr::Tcp(host, port),
        };
        let info = self.template.clone().set_addr(addr);
        #[cfg(feature = "tls")]
        let client = match &self.tls {
            Some(tls) => redis::Client::build_with_tls(info, tls.certificates())?,
            None => redis::Client::open(info)?,
        };
        #[cfg(not(feature = "tls"))]
        let client = redis::Client::open(info)?;
        let config = AsyncConnectionConfig::new()
            .set_connection_timeout(Some(CONNECTION_TIMEOUT))
            .set_response_timeout(Some(RESPONSE_TIMEOUT));
        client
            .get_multiplexed_async_connection_with_config(&config)
            .await
    }

    /// Drops the connection to `address` (lost, or its runtime is gone): the next
    /// pipeline makes a new one.
    pub(crate) fn forget(&self, address: &Address) {
        self.connections.lock().remove(address);
    }

    /// Drops every connection: their tasks died with the runtime they ran on.
    pub(crate) fn forget_all(&self) {
        self.connections.lock().clear();
    }

    /// Asks the cluster for its slot map in the background (one request at a time, at
    /// most one every [`REFRESH_EVERY`]): after a redirection, while a master is lost, or
    /// on first use.
    pub(crate) fn refresh(self: &Arc<Self>) {
        if self.refreshing.swap(true, Ordering::AcqRel) {
            return;
        }
        {
            let mut last = self.last_refresh.lock();
            if last.is_some_and(|at| at.elapsed() < REFRESH_EVERY) {
                self.refreshing.store(false, Ordering::Release);
                return;
            }
            *last = Some(Instant::now());
        }
        let Ok(runtime) = tokio::runtime::Handle::try_current() else {
            self.refreshing.store(false, Ordering::Release);
            return;
        };
        let nodes = self.clone();
        runtime.spawn(async move {
            let mut cluster = nodes.cluster.clone();
            let slots: RedisResult<Value> = redis::cmd("CLUSTER")
                .arg("SLOTS")
                .query_async(&mut cluster)
                .await;
            if let Ok(slots) = slots
                && let Some(map) = SlotMap::parse(slots)
            {
                *nodes.map.write() = map;
            }
            nodes.refreshing.store(false, Ordering::Release);
        });
    }
}

/// Whether a call answered `error` in a pipeline never ran, so that sending it again on
/// the per-slot path cannot count it twice; `moved` too when the slot map is stale.
pub(crate) fn never_ran(error: &ServerError) -> (bool, bool) {
    match error.kind() {
        Some(ServerErrorKind::Moved | ServerErrorKind::Ask | ServerErrorKind::ReadOnly) => {
            (true, true)
        }
        Some(
            ServerErrorKind::TryAgain
            | ServerErrorKind::ClusterDown
            | ServerErrorKind::MasterDown
            | ServerErrorKind::BusyLoading
            | ServerErrorKind::NoScript,
        ) => (true, false),
        // FCALL of a function the node does not have (flushed, new node, failover), or
        // FCALL unknown (Redis before 7.0) or denied by the ACL: the per-slot path loads
        // the library or turns the connection to EVALSHA.
        _ => (
            (error.code() == "ERR"
                && error
                    .details()
                    .is_some_and(|d| d.starts_with("Function not found")))
                || function::unavailable(&error.clone().into()),
            false,
        ),
    }
}

/// Sends the per-slot `calls` of one coalesced batch: those of each known master in one
/// pipeline on its connection ([`send_to_master`]), the others each on the per-slot path.
/// One future for all (the batching task spawns it): its first poll writes every call it
/// can, so the calls of consecutive batches reach each node in order (`batch::in_order`).
pub(crate) fn send_by_master(
    nodes: &Arc<Nodes>,
    calls: Vec<Batch>,
    connection: &Connection,
    now: Option<u64>,
    permit: &Arc<OwnedSemaphorePermit>,
) -> impl Future<Output = ()> + Send + 'static {
    let mut sends: Vec<futures_util::future::BoxFuture<'static, ()>> = Vec::new();
    for (master, calls) in by_master(nodes, calls) {
        match master {
            Some(address) => sends.push(Box::pin(send_to_master(
                nodes.clone(),
                address,
                calls,
                connection.clone(),
                now,
                permit.clone(),
            ))),
            None => {
                for batch in calls {
                    sends.push(Box::pin(send(
                        batch,
                        connection.clone(),
                        now,
                        permit.clone(),
                    )));
                }
            }
        }
    }
    async move {
        futures_util::future::join_all(sends).await;
    }
}

/// The per-slot calls grouped by the master that owns their slot (None: not known, or
/// not reachable now).
fn by_master(nodes: &Arc<Nodes>, calls: Vec<Batch>) -> Vec<(Option<Address>, Vec<Batch>)> {
    let mut groups: Vec<(Option<Address>, Vec<Batch>)> = Vec::new();
    for batch in calls {
        let master = nodes.master_of(batch[0].0.slot);
        match groups.iter_mut().find(|(m, _)| *m == master) {
            Some((_, group)) => group.push(batch),
            None => groups.push((master, vec![batch])),
        }
    }
    groups
}

/// The per-slot calls `calls` of the master at `address`, in one pipeline on its own
/// connection; each answer is read on its own (see the `nodes` module for which calls
/// are sent again on the per-slot path, and which errors stand). Calls answered `ASK`
/// (their slot is being migrated, and their keys are gone) go to the importing node, each
/// right after `ASKING` in one pipeline, so that no other command comes in between.
async fn send_to_master(
    nodes: Arc<Nodes>,
    address: Address,
    calls: Vec<Batch>,
    connection: Connection,
    now: Option<u64>,
    _permit: Arc<OwnedSemaphorePermit>,
) {
    let asked = pipelined(&nodes, &address, calls, false, &connection, now).await;
    let mut targets: Vec<(Address, Vec<Batch>)> = Vec::new();
    for (target, batch) in asked {
        match targets.iter_mut().find(|(a, _)| *a == target) {
            Some((_, calls)) => calls.push(batch),
            None => targets.push((target, vec![batch])),
        }
    }
    let sends = targets.into_iter().map(|(target, calls)| {
        let (nodes, connection) = (&nodes, &connection);
        async move {
            // Asked again (ASKING lost): the per-slot path.
            let left = pipelined(nodes, &target, calls, true, connection, now).await;
            per_slot(left.into_iter().map(|(_, b)| b).collect(), connection, now).await;
        }
    });
    futures_util::future::join_all(sends).await;
}

/// `calls` in one pipeline to `address` (each after `ASKING` when `asking`). Returns the
/// calls answered `ASK`, with the node to ask.
async fn pipelined(
    nodes: &Arc<Nodes>,
    address: &Address,
    calls: Vec<Batch>,
    asking: bool,
    connection: &Connection,
    now: Option<u64>,
) -> Vec<(Address, Batch)> {
    let mut node = match nodes.connection(address).await {
        Ok(node) => node,
        Err(_) => {
            // Nothing was sent: the per-slot path finds the slot's owner.
            nodes.refresh();
            per_slot(calls, connection, now).await;
            return Vec::new();
        }
    };
    let (lean, calls) = if asking {
        (Vec::new(), calls)
    } else {
        lean_calls(&connection.mode, calls)
    };
    let mut pipeline = redis::pipe();
    if !lean.is_empty() {
        let requests: Vec<_> = lean
            .iter()
            .filter_map(|batch| batch.first()?.0.as_fixed_window())
            .collect();
        pipeline.add_command(function::fixed_windows_call(now, true, &requests));
    }
    for batch in &calls {
        if asking {
            pipeline.add_command(redis::cmd("ASKING"));
        }
        let requests: Vec<&Encoded> = batch.iter().map(|(r, _)| r).collect();
        pipeline.add_command(script_call(&connection.mode, now, &requests));
    }
    let count = calls.len() * if asking { 2 } else { 1 } + usize::from(!lean.is_empty());
    let values = match node.req_packed_commands(&pipeline, 0, count).await {
        Ok(values) => values,
        Err(error) => {
            // Lost mid-pipeline or timed out: any call may have counted, none is retried.
            if !error.is_timeout() {
                nodes.forget(address);
            }
            nodes.refresh();
            let error = store_error(error);
            for batch in calls.into_iter().chain(lean) {
                deliver(batch, &Err(error.clone()));
            }
            return Vec::new();
        }
    };
    let mut values = values.into_iter();
    let mut again = Vec::new();
    let mut asked = Vec::new();
    let mut stale = false;
    if !lean.is_empty() {
        stale |= deliver_lean(lean, values.next(), &mut again);
    }
    for batch in calls {
        if asking {
            // ASKING's OK (were it refused, the call is answered MOVED).
            values.next();
        }
        match answer(values.next()) {
            Answer::Ran(result) => deliver(batch, &result),
            Answer::NeverRan(error, moved) => {
                stale |= moved;
                match ask_target(&error).filter(|_| !asking) {
                    Some(target) => asked.push((target, batch)),
                    None => again.push(batch),
                }
            }
        }
    }
    if stale {
        nodes.refresh();
    }
    per_slot(again, connection, now).await;
    asked
}

/// The calls that go together in one call of the library's function for many requests
/// against one fixed window each (`<library>_fwn`, lua/one.lua), and the others: calls of
/// one such request, two or more of them, on a connection that calls functions. A call of
/// several requests of one slot stays as it is (a hot key's requests are coalesced).
fn lean_calls(mode: &function::Mode, calls: Vec<Batch>) -> (Vec<Batch>, Vec<Batch>) {
    if !mode.functions() {
        return (Vec::new(), calls);
    }
    let (lean, others): (Vec<Batch>, Vec<Batch>) = calls
        .into_iter()
        .partition(|batch| batch.len() == 1 && batch[0].0.as_fixed_window().is_some());
    match lean.len() {
        0 | 1 => (Vec::new(), others.into_iter().chain(lean).collect()),
        _ => (lean, others),
    }
}

/// Gives each of the `lean` calls (see [`lean_calls`]) its share of their function call's
/// reply: four values each, then the `now` it decided at. A call whose key the node did
/// not serve (-1: never counted), or all of them when the function call never ran, go to
/// `again`, for the per-slot path; any other error is theirs. Returns whether the slot
/// map is stale.
fn deliver_lean(lean: Vec<Batch>, reply: Option<Value>, again: &mut Vec<Batch>) -> bool {
    let values = match answer(reply) {
        Answer::NeverRan(_, moved) => {
            again.extend(lean);
            return moved;
        }
        Answer::Ran(Ok(values)) if values.len() == lean.len() * 4 + 1 => values,
        Answer::Ran(result) => {
            let error = result.err().unwrap_or_else(|| {
                StoreError::new(
                    StoreErrorKind::Response,
                    format!("the function's reply does not fit {} requests", lean.len()),
                )
            });
            for batch in lean {
                deliver(batch, &Err(error.clone()));
            }
            return false;
        }
    };
    let now = values.last().copied();
    let mut stale = false;
    for (batch, share) in lean.into_iter().zip(values.chunks_exact(4)) {
        if share[0] == -1 {
            stale = true;
            again.push(batch);
        } else {
            deliver_share(batch, share, now);
        }
    }
    stale
}

/// A call's answer in a pipeline.
enum Answer {
    /// It ran (or may have): its reply, or the error that stands.
    Ran(Result<Vec<i64>, StoreError>),
    /// The error proves it never ran, so it may be sent again ([`never_ran`]); `true`
    /// when the slot map is stale.
    NeverRan(ServerError, bool),
}

/// Reads `value`, the next answer of a pipeline (None: the answers ran short).
fn answer(value: Option<Value>) -> Answer {
    Answer::Ran(match value {
        Some(Value::ServerError(error)) => {
            let (retry, moved) = never_ran(&error);
            if retry {
                return Answer::NeverRan(error, moved);
            }
            Err(store_error(error.into()))
        }
        Some(value) => function::integers(value).map_err(store_error),
        None => Err(StoreError::new(
            StoreErrorKind::Response,
            "a pipeline's answers ran short",
        )),
    })
}

/// The node an `ASK` answer names (`ASK <slot> <host>:<port>`).
fn ask_target(error: &ServerError) -> Option<Address> {
    if error.kind() != Some(ServerErrorKind::Ask) {
        return None;
    }
    let node = error.details()?.split_ascii_whitespace().nth(1)?;
    let (host, port) = node.rsplit_once(':')?;
    Some(Arc::new((host.to_owned(), port.parse().ok()?)))
}

/// Each of `calls` on the per-slot path (redirections followed, the script reloaded).
async fn per_slot(calls: Vec<Batch>, connection: &Connection, now: Option<u64>) {
    let sends = calls.into_iter().map(|batch| {
        let connection = connection.clone();
        async move {
            let requests: Vec<&Encoded> = batch.iter().map(|(r, _)| r).collect();
            let call = script_call(&connection.mode, now, &requests);
            let result = connection.invoke(&call).await;
            drop(requests);
            deliver(batch, &result);
        }
    });
    futures_util::future::join_all(sends).await;
}

#[cfg(test)]
mod tests {
    use super::*;

    fn server_error(reply: &str) -> ServerError {
        match redis::parse_redis_value(reply.as_bytes()).unwrap() {
            Value::ServerError(error) => error,
            other => panic!("not an error: {other:?}"),
        }
    }

    #[test]
    fn calls_refused_for_want_of_functions_never_ran() {
        for reply in [
            "-ERR unknown command 'FCALL', with args beginning with: 'tollgate' \r\n",
            "-NOPERM this user has no permissions to run the 'fcall' command\r\n",
            "-ERR Function not found\r\n",
            "-NOSCRIPT No matching script.\r\n",
        ] {
            assert_eq!(never_ran(&server_error(reply)), (true, false), "{reply}");
        }
        let script_error = server_error("-ERR user_script:1: boom\r\n");
        assert_eq!(never_ran(&script_error), (false, false));
    }
}
