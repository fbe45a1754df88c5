//! Resets reach every replica's block cache: a reset `PUBLISH`es the key on the channel
//! `<prefix>:reset`, and each store whose block cache holds a denial listens there
//! (a background task, started with the first denial it remembers, that reconnects).
//!
//! The bound: a replica forgets a reset key's denials as soon as the message arrives.
//! Each time the task (re)subscribes it forgets every denial, since it may have missed
//! resets meanwhile; while it is not subscribed (Redis unreachable, a connection that died
//! without closing), a denial lasts at most its `retry_after`, as it always did.
//! In Redis Cluster a `PUBLISH` reaches every node, so one subscription to any node hears
//! every reset; behind Sentinel the task subscribes on the master the sentinels name (a
//! `PUBLISH` on a master reaches its replicas too, so a demoted one still hears it). A
//! store made from a connection manager or a pool has no address to subscribe to and
//! does not listen.

use std::{
    sync::{
        Arc, Weak,
        atomic::{AtomicBool, Ordering},
    },
    time::Duration,
};

use futures_util::StreamExt;

use crate::store::redis::keys::reset_channel;

/// How long the task waits before connecting again after a failure, doubling up to
/// [`MAX_RECONNECT_DELAY`] while it keeps failing (say, an ACL without `+subscribe`).
const RECONNECT_DELAY: Duration = Duration::from_millis(200);
const MAX_RECONNECT_DELAY: Duration = Duration::from_secs(60);
/// How often an idle task checks whether its cache is gone.
const IDLE_CHECK: Duration = Duration::from_secs(1);

/// What the listener tells of the resets it hears: the block cache.
pub(crate) trait Resets: Send + Sync + 'static {
    /// `key` was reset.
    fn reset(&self, key: &str);
    /// Resets may have been missed (the subscription was lost, or is new).
    fn reset_all(&self);
}

/// The nodes a store hears resets from.
#[derive(Clone)]
pub(crate) enum ResetNodes {
    /// These, tried in order: the one node, or a cluster's nodes.
    Fixed(Arc<[redis::Client]>),
    /// The master the sentinels name at each (re)subscription.
    #[cfg(feature = "sentinel")]
    Sentinel(Arc<crate::store::redis::link::sentinel::SentinelConnection>),
}

impl ResetNodes {
    async fn clients(&self) -> Vec<redis::Client> {
        match self {
            Self::Fixed(clients) => clients.to_vec(),
            #[cfg(feature = "sentinel")]
            Self::Sentinel(sentinel) => sentinel.master_client().await.into_iter().collect(),
        }
    }
}

/// Where to subscribe: the nodes and the channel.
#[derive(Clone)]
pub(crate) struct Source {
    nodes: ResetNodes,
    channel: Arc<str>,
}

impl Source {
    pub(crate) fn new(nodes: ResetNodes, prefix: &str) -> Self {
        Self {
            nodes,
            channel: reset_channel(prefix).into(),
        }
    }
}

/// Starts the listening task of a block cache.
#[derive(Default)]
pub(crate) struct Listener {
    source: Option<Source>,
}

impl Listener {
    pub(crate) fn set_source(&mut self, source: Option<Source>) {
        self.source = source;
    }

    /// Spawns the task for `cache` unless it runs (`listening`) or there is no source or
    /// runtime.
    pub(crate) fn start<C: Resets>(&mut self, cache: &Arc<C>, listening: &Arc<AtomicBool>) {
        let Some(source) = &self.source else {
            return;
        };
        let Ok(runtime) = tokio::runtime::Handle::try_current() else {
            return;
        };
        if listening.swap(true, Ordering::AcqRel) {
            return;
        }
        let running = Running(listening.clone());
        runtime.spawn(listen(Arc::downgrade(cache), source.clone(), running));
    }
}

/// Clears the flag when the task ends, also when its runtime shuts down (the next denial
/// then starts a new one).
struct Running(Arc<AtomicBool>);

impl Drop for Running {
    fn drop(&mut self) {
        self.0.store(false, Ordering::Release);
    }
}

/// Subscribes and forgets the denials of every key announced, until the cache is gone.
async fn listen<C: Resets>(cache: Weak<C>, source: Source, _running: Running) {
    let mut delay = RECONNECT_DELAY;
    let mut warned = false;
    loop {
        for client in source.nodes.clients().await {
            if cache.strong_count() == 0 {
                return;
            }
            let mut pubsub = match client.get_async_pubsub().await {
                Ok(pubsub) => pubsub,
                Err(error) => {
                    tracing::debug!(%error, "block cache: cannot connect to hear resets");
                    continue;
                }
            };
            if let Err(error) = pubsub.subscribe(&*source.channel).await {
                tracing::debug!(%error, "block cache: cannot subscribe to hear resets");
                let refused = crate::store::redis::wire::reply::no_perm(&error);
                if refused && !warned {
                    warned = true;
                    tracing::warn!(
                        channel = &*source.channel,
                        "block cache: may not subscribe to the reset channel (+subscribe and \
                         the channel in the ACL); resets reach this store's denials only \
                         when their retry_after ends",
                    );
                }
                continue;
            }
            delay = RECONNECT_DELAY;
            match cache.upgrade() {
                // Resets may have been missed while not subscribed.
                Some(cache) => cache.reset_all(),
                None => return,
            }
            let mut messages = pubsub.on_message();
            loop {
                match tokio::time::timeout(IDLE_CHECK, messages.next()).await {
                    Ok(Some(message)) => {
                        let Some(cache) = cache.upgrade() else {
                            return;
                        };
                        if let Ok(key) = std::str::from_utf8(message.get_payload_bytes()) {
                            cache.reset(key);
                        }
                    }
                    // The connection closed: subscribe again.
                    Ok(None) => break,
                    Err(_idle) if cache.strong_count() == 0 => return,
                    Err(_idle) => {}
                }
            }
            tracing::debug!("block cache: reset subscription lost, subscribing again");
        }
        if cache.strong_count() == 0 {
            return;
        }
        tokio::time::sleep(delay).await;
        delay = (delay * 2).min(MAX_RECONNECT_DELAY);
    }
}
