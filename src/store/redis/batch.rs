//! Coalescing: the decisions waiting at the same moment go to Redis as one script call.

use std::{mem, sync::Arc};

use parking_lot::RwLock;
use tokio::sync::{Semaphore, mpsc, oneshot};

#[cfg(feature = "cluster")]
pub(crate) use super::nodes::Nodes;
use super::{
    deliver::{Batch, Reply, send},
    encode::Encoded,
    link::Connection,
};
use crate::{Decision, StoreError, StoreErrorKind, clock::Clock};

/// Decisions that may wait for a batch by default.
pub(crate) const DEFAULT_QUEUE: std::num::NonZeroUsize = std::num::NonZeroUsize::new(4096).unwrap();

/// How the batching task behaves.
#[derive(Debug, Clone, Copy)]
pub(crate) struct CoalescerConfig {
    /// Decisions waiting for a batch, at most.
    pub(crate) queue: usize,
    /// Requests in one script call, at most.
    pub(crate) max_batch: usize,
    /// Script calls on the wire at once, at most. While they are all out, new decisions
    /// wait and join the next batch.
    pub(crate) max_in_flight: usize,
}

impl Default for CoalescerConfig {
    fn default() -> Self {
        Self {
            queue: DEFAULT_QUEUE.get(),
            max_batch: 128,
            max_in_flight: 2,
        }
    }
}

/// What became of a submitted request.
pub(crate) enum Submitted {
    /// Queued; the decision comes on this channel.
    Queued(oneshot::Receiver<Result<Decision, StoreError>>),
    /// Not queued: the queue is full (or the task is gone).
    Refused(StoreError),
    /// No runtime to run the task on: the caller calls Redis itself.
    NoRuntime(Box<Encoded>),
}

type Queue = mpsc::Sender<(Encoded, Reply)>;

/// Without the `cluster` feature there are no masters to pipeline to.
#[cfg(not(feature = "cluster"))]
pub(crate) enum Nodes {}

/// The sending half of the batching task, started on first use (it needs a runtime).
///
/// The task lives on the runtime of the decision that started it. When that runtime
/// shuts down, the task goes with it and its queue closes; the next decision starts a new
/// task on its own runtime, so a store outlives the runtime it was first used on.
pub(crate) struct Coalescer {
    config: CoalescerConfig,
    connection: Connection,
    clock: Option<Arc<dyn Clock>>,
    /// On a cluster: the masters, to pipeline the calls of several slots to each.
    nodes: Option<Arc<Nodes>>,
    sender: RwLock<Option<Queue>>,
}

impl Coalescer {
    pub(crate) fn new(
        connection: Connection,
        clock: Option<Arc<dyn Clock>>,
        config: CoalescerConfig,
        nodes: Option<Arc<Nodes>>,
    ) -> Self {
        Self {
            config,
            connection,
            clock,
            nodes,
            sender: RwLock::new(None),
        }
    }

    /// Queues `request` for the batching task, starting the task if there is none (or its
    /// runtime is gone).
    pub(crate) fn submit(&self, request: Encoded) -> Submitted {
        let (reply, receiver) = oneshot::channel();
        let mut item = (request, reply);
        if let Some(sender) = &*self.sender.read() {
            match sender.try_send(item) {
                Ok(()) => return Submitted::Queued(receiver),
                Err(mpsc::error::TrySendError::Full(_)) => return self.overloaded(),
                Err(mpsc::error::TrySendError::Closed(back)) => item = back,
            }
        }
        let Ok(runtime) = tokio::runtime::Handle::try_current() else {
            return Submitted::NoRuntime(Box::new(item.0));
        };
        let mut sender = self.sender.write();
        // Another decision may have started a task meanwhile; else start one.
        let mut restart = false;
        if sender.as_ref().is_some_and(mpsc::Sender::is_closed) {
            *sender = None;
            restart = true;
        }
        let queue = sender.get_or_insert_with(|| {
            let (queue, tasks) = mpsc::channel(self.config.queue);
            runtime.spawn(run(
                tasks,
                self.connection.clone(),
                self.clock.clone(),
                self.nodes.clone(),
                self.config,
                restart,
            ));
            queue
        });
        match queue.try_send(item) {
            Ok(()) => Submitted::Queued(receiver),
            Err(mpsc::error::TrySendError::Full(_)) => self.overloaded(),
            Err(mpsc::error::TrySendError::Closed(_)) => Submitted::Refused(StoreError::new(
                StoreErrorKind::Unavailable,
                "the batch task stopped",
            )),
        }
    }

    fn overloaded(&self) -> Submitted {
        Submitted::Refused(StoreError::new(
            StoreErrorKind::Overloaded,
            format!("{} decisions already wait for Redis", self.config.queue),
        ))
    }
}

/// The batching task: ends when every store clone is gone.
///
/// A task that replaces one whose runtime shut down first pings Redis: the connection's
/// own task most likely died with that runtime, and the failed ping makes the connection
/// reconnect on this runtime before the first batch goes out, rather than fail it.
async fn run(
    mut receiver: mpsc::Receiver<(Encoded, Reply)>,
    connection: Connection,
    clock: Option<Arc<dyn Clock>>,
    #[cfg_attr(not(feature = "cluster"), allow(unused_variables))] nodes: Option<Arc<Nodes>>,
    config: CoalescerConfig,
    restart: bool,
) {
    if restart {
        connection.ping().await;
        #[cfg(feature = "cluster")]
        if let Some(nodes) = &nodes {
            nodes.forget_all();
        }
    }
    let permits = Arc::new(Semaphore::new(config.max_in_flight.max(1)));
    let mut waiting = Vec::new();
    // The last call sent, first polled when this says so (see `in_order`).
    let mut sent: Option<oneshot::Receiver<()>> = None;
    while let Some(first) = receiver.recv().await {
        waiting.push(first);
        // Wait for a free slot on the wire; whatever arrives meanwhile joins the batch.
        let Ok(permit) = permits.clone().acquire_owned().await else {
            return;
        };
        while waiting.len() < config.max_batch {
            match receiver.try_recv() {
                Ok(next) => waiting.push(next),
                Err(_) => break,
            }
        }
        let now = clock.as_ref().map(|c| c.now_ms());
        let permit = Arc::new(permit);
        let calls = by_slot(mem::take(&mut waiting));
        #[cfg(feature = "cluster")]
        if let Some(nodes) = &nodes {
            let (started, next) = oneshot::channel();
            let previous = sent.replace(next);
            let sends = super::nodes::send_by_master(nodes, calls, &connection, now, &permit);
            tokio::spawn(in_order(previous, started, sends));
            continue;
        }
        for batch in calls {
            let (started, next) = oneshot::channel();
            let previous = sent.replace(next);
            let send = send(batch, connection.clone(), now, permit.clone());
            tokio::spawn(in_order(previous, started, send));
        }
    }
}

/// Runs `call` once the call before it (`previous`) was first polled, and says so on
/// `started` after its own first poll: a call is written on the connection when first
/// polled, so calls reach Redis in the order they were made. Spawned one after the other,
/// a later task can run first (tokio runs the task spawned last first on its worker), and
/// a refund and the check made right after it would be decided the other way round.
async fn in_order<F: Future<Output = ()>>(
    previous: Option<oneshot::Receiver<()>>,
    started: oneshot::Sender<()>,
    call: F,
) {
    if let Some(previous) = previous {
        // An error: the call before is done, or its task gone.
        let _ = previous.await;
    }
    let mut call = std::pin::pin!(call);
    let mut started = Some(started);
    std::future::poll_fn(|cx| {
        let poll = call.as_mut().poll(cx);
        if let Some(started) = started.take() {
            let _ = started.send(());
        }
        poll
    })
    .await;
}

/// Splits a batch by hash slot (a script's keys must share one slot in a cluster).
fn by_slot(mut batch: Batch) -> Vec<Batch> {
    let first = batch.first().map(|(r, _)| r.slot);
    if batch.iter().all(|(r, _)| Some(r.slot) == first) {
        return vec![batch];
    }
    batch.sort_by_key(|(r, _)| r.slot);
    let mut groups: Vec<Batch> = Vec::new();
    for item in batch {
        match groups.last_mut() {
            Some(group) if group[0].0.slot == item.0.slot => group.push(item),
            _ => groups.push(vec![item]),
        }
    }
    groups
}
