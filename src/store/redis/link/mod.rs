//! The link to Redis: one connection of whichever kind the store was given (a connection
//! manager, a cluster connection, a bb8 pool, a Sentinel-followed master), and the one
//! place that sends on it ([`Connection::on_link`]): every script call, command and ping
//! of the store goes through that one `match` over the kinds.

use std::{
    sync::{Arc, Weak},
    time::Duration,
};

use redis::{
    Cmd, RedisResult, ScriptInvocation, Value,
    aio::{ConnectionLike, ConnectionManager},
};

#[cfg(feature = "cluster")]
pub(crate) mod cluster;
#[cfg(feature = "sentinel")]
pub(crate) mod sentinel;

use super::wire::{function::Mode, script::SCRIPT, store_error, unreachable};
use crate::{StoreError, StoreErrorKind};

/// The first wait between attempts to connect in the background, doubled after each
/// failure up to [`LAST_RETRY`]: a Redis that comes up is used within about two seconds,
/// and one that stays down costs a connection attempt every two seconds.
const FIRST_RETRY: Duration = Duration::from_millis(100);
const LAST_RETRY: Duration = Duration::from_secs(2);

/// A connection to Redis, and whether it calls the script as a function (shared by its
/// clones).
#[derive(Clone)]
pub(crate) struct Connection {
    pub(crate) link: Link,
    pub(crate) mode: Arc<Mode>,
}

impl From<Link> for Connection {
    fn from(link: Link) -> Self {
        Self {
            link,
            mode: Arc::default(),
        }
    }
}

/// The kinds of connections.
#[derive(Clone)]
pub(crate) enum Link {
    Manager(ConnectionManager),
    #[cfg(feature = "cluster")]
    Cluster(redis::cluster_async::ClusterConnection),
    #[cfg(feature = "bb8")]
    Pool(bb8_redis::bb8::Pool<bb8_redis::RedisConnectionManager>),
    #[cfg(feature = "sentinel")]
    Sentinel(Arc<sentinel::SentinelConnection>),
}

impl Connection {
    /// Fails at once while the first connection is still being made in the background
    /// ([`RedisConnect::in_background`]): no call waits for a Redis that was never up.
    #[inline]
    pub(crate) fn ready(&self) -> Result<(), StoreError> {
        if self.mode.connecting() {
            self.keep_connecting();
            return Err(StoreError::not_connected());
        }
        Ok(())
    }

    pub(crate) fn is_cluster(&self) -> bool {
        #[cfg(feature = "cluster")]
        if let Link::Cluster(_) = self.link {
            return true;
        }
        false
    }
}

impl Link {
    /// What the store's `Debug` calls this kind of link.
    pub(crate) fn kind(&self) -> &'static str {
        match self {
            Link::Manager(_) => "ConnectionManager",
            #[cfg(feature = "cluster")]
            Link::Cluster(_) => "ClusterConnection",
            #[cfg(feature = "bb8")]
            Link::Pool(_) => "bb8::Pool",
            #[cfg(feature = "sentinel")]
            Link::Sentinel(_) => "Sentinel",
        }
    }
}

/// What the store sends on a link.
pub(crate) enum Request<'a> {
    /// A script call (`encode::script_call` and its kin): `FCALL` or `EVALSHA`, with
    /// [`Mode::run`]'s reloads and fallbacks, and on a cluster an `ASK` followed once more.
    Script(&'a Cmd),
    /// One command.
    Command(&'a Cmd),
    /// A script of its own (the in-flight permits'): `EVALSHA`, loaded on `NOSCRIPT`.
    Invoke(&'a ScriptInvocation<'a>),
    /// Loads the library, or the script where Redis has no functions ([`load`]).
    Load,
}

/// What a [`Request`] answers.
enum Reply {
    Integers(Vec<i64>),
    Value(Value),
    Loaded,
}

impl Request<'_> {
    /// Sends this request on `connection`, with `mode` for script calls.
    async fn send<C: ConnectionLike + Send>(
        &self,
        mode: &Mode,
        connection: &mut C,
    ) -> RedisResult<Reply> {
        match self {
            Self::Script(call) => mode.run(connection, call).await.map(Reply::Integers),
            Self::Command(cmd) => cmd.query_async(connection).await.map(Reply::Value),
            Self::Invoke(invocation) => invocation.invoke_async(connection).await.map(Reply::Value),
            Self::Load => loaded(mode, connection).await.map(|()| Reply::Loaded),
        }
    }
}

impl Link {
    /// The one dispatch: sends `request` on this link, whatever its kind, with `mode` for
    /// script calls. Without [`Connection::ready`]'s check: the background connector's
    /// first call is made here before the connection is ready.
    async fn send(&self, mode: &Mode, request: &Request<'_>) -> Result<Reply, StoreError> {
        match self {
            Link::Manager(manager) => request.send(mode, &mut manager.clone()).await,
            #[cfg(feature = "cluster")]
            Link::Cluster(cluster) => {
                let mut cluster = cluster.clone();
                match (request.send(mode, &mut cluster).await, request) {
                    (Err(error), Request::Script(call)) => {
                        cluster::follow_ask(&mut cluster, mode, call, error)
                            .await
                            .map(Reply::Integers)
                    }
                    (result, _) => result,
                }
            }
            #[cfg(feature = "bb8")]
            Link::Pool(pool) => {
                let mut connection = checkout(pool).await?;
                request.send(mode, &mut *connection).await
            }
            #[cfg(feature = "sentinel")]
            Link::Sentinel(sentinel) => {
                let (generation, mut connection) = sentinel.connection().await?;
                let result = request.send(mode, &mut connection).await;
                if let Err(error) = &result {
                    sentinel.failed(generation, error);
                }
                result
            }
        }
        .map_err(store_error)
    }
}

/// A reply of another shape than its request's: never sent by [`Request::send`].
fn unexpected() -> StoreError {
    StoreError::new(StoreErrorKind::Response, "a reply of the wrong shape")
}

impl Connection {
    /// Sends a script call (`encode::script_call`); its reply's integers.
    pub(crate) async fn invoke(&self, call: &Cmd) -> Result<Vec<i64>, StoreError> {
        self.ready()?;
        match self.link.send(&self.mode, &Request::Script(call)).await? {
            Reply::Integers(values) => Ok(values),
            Reply::Value(_) | Reply::Loaded => Err(unexpected()),
        }
    }

    /// Sends one command.
    pub(crate) async fn query(&self, cmd: &Cmd) -> Result<Value, StoreError> {
        self.ready()?;
        match self.link.send(&self.mode, &Request::Command(cmd)).await? {
            Reply::Value(value) => Ok(value),
            Reply::Integers(_) | Reply::Loaded => Err(unexpected()),
        }
    }

    /// Runs a script of its own on one key (`EVALSHA`, loading it on `NOSCRIPT`).
    pub(crate) async fn eval(
        &self,
        invocation: &ScriptInvocation<'_>,
    ) -> Result<Value, StoreError> {
        self.ready()?;
        match self
            .link
            .send(&self.mode, &Request::Invoke(invocation))
            .await?
        {
            Reply::Value(value) => Ok(value),
            Reply::Integers(_) | Reply::Loaded => Err(unexpected()),
        }
    }

    /// `PING`, for its side effect only: a connection that finds itself broken reconnects
    /// (a pool checks its connections itself).
    pub(crate) async fn ping(&self) {
        #[cfg(feature = "bb8")]
        if let Link::Pool(_) = self.link {
            return;
        }
        let _ = self.query(&redis::cmd("PING")).await;
    }
}

/// A connection from a bb8 pool, its errors as the store's.
#[cfg(feature = "bb8")]
async fn checkout(
    pool: &bb8_redis::bb8::Pool<bb8_redis::RedisConnectionManager>,
) -> Result<bb8_redis::bb8::PooledConnection<'_, bb8_redis::RedisConnectionManager>, StoreError> {
    pool.get().await.map_err(|e| match e {
        bb8_redis::bb8::RunError::User(e) => store_error(e),
        bb8_redis::bb8::RunError::TimedOut => StoreError::timeout(),
    })
}

impl Connection {
    /// Marks this connection as not connected yet (every call fails at once, see
    /// [`Connection::ready`]) and makes the first connection in the background, with
    /// backoff; `error` is why the attempt at start failed.
    pub(crate) fn connect_in_background(&self, error: &StoreError) {
        tracing::warn!(
            error = %error.chain(),
            "tollgate: Redis is not reachable at start; connecting in the background. \
             Until it connects, every rate limit decision fails at once and each layer's \
             failure policy answers it"
        );
        self.mode.set_connecting(true);
        self.keep_connecting();
    }

    /// Starts the task that makes the first connection unless it runs: it dies with the
    /// runtime it ran on, and a store used on another runtime since must not wait
    /// forever. Without a runtime here, the next call on one starts it.
    #[cold]
    pub(crate) fn keep_connecting(&self) {
        let Ok(runtime) = tokio::runtime::Handle::try_current() else {
            return;
        };
        if !self.mode.claim_connector() {
            return;
        }
        let running = Running(Arc::downgrade(&self.mode));
        runtime.spawn(connect_later(self.link.clone(), running));
    }
}

/// Held by the connecting task: frees its place when the task ends, also when its
/// runtime shuts down.
struct Running(Weak<Mode>);

impl Drop for Running {
    fn drop(&mut self) {
        if let Some(mode) = self.0.upgrade() {
            mode.release_connector();
        }
    }
}

/// Tries to make the first connection over `link` (and load what calls need there) until
/// it succeeds or the store is gone.
async fn connect_later(link: Link, running: Running) {
    let mode = &running.0;
    let mut delay = FIRST_RETRY;
    loop {
        tokio::time::sleep(delay).await;
        let Some(mode) = mode.upgrade() else {
            return;
        };
        match link.send(&mode, &Request::Load).await {
            Ok(_) => {
                mode.set_connecting(false);
                tracing::info!("tollgate: connected to Redis; decisions are made there now");
                return;
            }
            Err(error) if unreachable(&error) => {
                tracing::debug!(error = %error.chain(), "tollgate: Redis still unreachable");
            }
            Err(error) => {
                // Reachable, but it refused us (a password, an ACL): worth every line.
                tracing::warn!(error = %error.chain(), "tollgate: Redis refused the store; retrying");
            }
        }
        delay = (delay * 2).min(LAST_RETRY);
    }
}

/// Loads the library (every master of a cluster), or the script where Redis has no
/// functions for this user.
pub(crate) async fn load<C: ConnectionLike + Send>(
    mode: &Mode,
    connection: &mut C,
) -> Result<(), StoreError> {
    loaded(mode, connection).await.map_err(store_error)
}

/// [`load`], its error as Redis gave it.
async fn loaded<C: ConnectionLike + Send>(mode: &Mode, connection: &mut C) -> RedisResult<()> {
    mode.load(connection).await?;
    if !mode.functions() {
        SCRIPT.load_async(connection).await?;
    }
    Ok(())
}
