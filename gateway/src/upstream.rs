//! The upstream connections: HTTP/1.1 over TCP, kept alive in a pool per upstream, and
//! driven by the request that uses them.
//!
//! A general client (hyper-util's `legacy::Client`) runs every connection as a task of its
//! own and hands each request to it, and each response back, through channels; once the
//! response is read it spawns one more task that returns the connection to its pool. A
//! proxied request thus crossed three tasks, usually on both threads. Here the request's
//! own task polls its connection: while it waits for the response head (the future
//! [`Pool::send`] returns) and while the client's side reads the response body
//! ([`UpstreamBody`]). The connection goes back to the pool as soon as the body has ended,
//! and is closed when the body is dropped before its end (the client went away), as any
//! half-read HTTP/1 connection must be.
//!
//! Each worker thread (`serve::Workers`) keeps its own idle connections, so a connection
//! is always polled on the thread whose runtime registered its socket.
//!
//! An idle connection is polled by no one: one the upstream closed is found closed when
//! it is taken (and a request that could not be written on it is sent again on a new
//! connection), or dropped after [`IDLE_TIMEOUT`].

use std::{
    collections::HashMap,
    future::{Future, poll_fn},
    io,
    pin::Pin,
    sync::{Arc, Mutex, Weak},
    task::{Context, Poll, Waker},
    time::{Duration, Instant},
};

use axum::body::Body;
use bytes::Bytes;
use http::{Request, Response, uri::Authority};
use http_body::{Body as _, Frame, SizeHint};
use hyper::{
    body::Incoming,
    client::conn::http1::{self, Connection, SendRequest},
};
use hyper_util::rt::TokioIo;
use tokio::net::TcpStream;

/// How long connecting to an upstream may take before the request gets 502.
pub(crate) const CONNECT_TIMEOUT: Duration = Duration::from_secs(5);

/// How long a connection may stay idle in the pool (hyper-util's client's default).
pub(crate) const IDLE_TIMEOUT: Duration = Duration::from_secs(90);

/// How often the pool drops the connections idle for longer than [`IDLE_TIMEOUT`].
const REAP_INTERVAL: Duration = Duration::from_secs(30);

/// Why a request got no response from its upstream.
pub(crate) type Error = Box<dyn std::error::Error + Send + Sync>;

/// The pools of every upstream, shared by every route and kept across reloads.
#[derive(Clone, Default)]
pub(crate) struct Client {
    pools: Arc<Mutex<HashMap<Authority, Arc<Pool>>>>,
}

impl std::fmt::Debug for Client {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Client").finish_non_exhaustive()
    }
}

impl Client {
    /// A client whose idle connections are dropped after [`IDLE_TIMEOUT`] by a task on
    /// the current runtime (when there is one), which ends with the client.
    pub(crate) fn new() -> Self {
        let client = Self::default();
        if let Ok(runtime) = tokio::runtime::Handle::try_current() {
            let pools = Arc::downgrade(&client.pools);
            runtime.spawn(reap(pools));
        }
        client
    }

    /// The pool of `authority`'s connections.
    pub(crate) fn pool(&self, authority: &Authority) -> Arc<Pool> {
        let mut pools = self.pools.lock().unwrap_or_else(|e| e.into_inner());
        pools
            .entry(authority.clone())
            .or_insert_with(|| Arc::new(Pool::new(authority)))
            .clone()
    }
}

/// Drops, every [`REAP_INTERVAL`], the idle connections past [`IDLE_TIMEOUT`], until the
/// client is gone.
async fn reap(pools: Weak<Mutex<HashMap<Authority, Arc<Pool>>>>) {
    let mut interval = tokio::time::interval(REAP_INTERVAL);
    interval.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    interval.tick().await;
    loop {
        interval.tick().await;
        let Some(pools) = pools.upgrade() else {
            return;
        };
        let pools: Vec<Arc<Pool>> = pools
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .values()
            .cloned()
            .collect();
        for pool in pools {
            pool.reap();
        }
    }
}

thread_local! {
    /// The worker thread this is (`serve::Workers`, from 1), 0 on any other thread.
    static WORKER: std::cell::Cell<usize> = const { std::cell::Cell::new(0) };
}

/// Marks the current thread as worker `index` (from 1): the connections it opens go back
/// to its own idle list, so that they are polled by the runtime they were registered
/// with, on this thread, and never wake another.
pub(crate) fn set_worker(index: usize) {
    WORKER.with(|worker| worker.set(index));
}

/// One upstream's idle connections, one list per worker thread, and where to open new
/// ones.
pub(crate) struct Pool {
    host: String,
    port: u16,
    idle: Box<[Mutex<Vec<Idle>>]>,
}

impl std::fmt::Debug for Pool {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Pool")
            .field("host", &self.host)
            .field("port", &self.port)
            .finish_non_exhaustive()
    }
}

/// An open connection to an upstream: the side that sends requests and the side that
/// does the I/O, which whoever waits on the connection polls.
struct Conn {
    send: SendRequest<Body>,
    io: Connection<TokioIo<TcpStream>, Body>,
}

struct Idle {
    conn: Conn,
    since: Instant,
}

impl Pool {
    fn new(authority: &Authority) -> Self {
        // `[::1]` is the authority's spelling of an IPv6 address; connect takes `::1`.
        let host = authority.host();
        let host = host
            .strip_prefix('[')
            .and_then(|h| h.strip_suffix(']'))
            .unwrap_or(host);
        // One list per worker (one per core) and one for every other thread.
        let lists = std::thread::available_parallelism().map_or(1, |n| n.get()) + 1;
        Self {
            host: host.to_owned(),
            port: authority.port_u16().unwrap_or(80),
            idle: (0..lists).map(|_| Mutex::new(Vec::new())).collect(),
        }
    }

    /// The current thread's idle list.
    fn idle(&self) -> &Mutex<Vec<Idle>> {
        &self.idle[WORKER.with(std::cell::Cell::get) % self.idle.len()]
    }

    /// Sends `request` (origin-form URI) and returns the response head, its body reading
    /// through the connection. Errors are the connection's or the request body's.
    pub(crate) async fn send(
        self: &Arc<Self>,
        request: Request<Body>,
    ) -> Result<Response<Body>, Error> {
        let (mut conn, reused) = match self.take() {
            Some(conn) => (conn, true),
            None => (self.connect().await?, false),
        };
        let (response, open) = match conn.round_trip(request).await {
            Ok(done) => done,
            // A kept-alive connection the upstream closed while it was idle: the request
            // was not written, send it again on a new one (as hyper-util's client does).
            Err(mut error) if reused && error.message().is_some() => {
                let request = error.take_message().expect("checked just before");
                conn = self.connect().await?;
                conn.round_trip(request)
                    .await
                    .map_err(|e| Box::new(e.into_error()) as Error)?
            }
            Err(error) => return Err(Box::new(error.into_error())),
        };
        Ok(response.map(|body| {
            Body::new(UpstreamBody {
                body,
                conn: open.then_some(conn),
                pool: self.clone(),
            })
        }))
    }

    /// An idle connection that is still open, if any.
    fn take(&self) -> Option<Conn> {
        let mut cx = Context::from_waker(Waker::noop());
        loop {
            let Idle { mut conn, since } = {
                let mut idle = self.idle().lock().unwrap_or_else(|e| e.into_inner());
                idle.pop()?
            };
            if since.elapsed() >= IDLE_TIMEOUT {
                continue;
            }
            // Polled once, the connection reads what came while it was idle: the
            // upstream's close ends it. (The waker is replaced when it is polled next.)
            if Pin::new(&mut conn.io).poll(&mut cx).is_ready() || !conn.send.is_ready() {
                continue;
            }
            return Some(conn);
        }
    }

    async fn connect(&self) -> Result<Conn, Error> {
        let connecting = TcpStream::connect((self.host.as_str(), self.port));
        let stream = match tokio::time::timeout(CONNECT_TIMEOUT, connecting).await {
            Ok(Ok(stream)) => stream,
            Ok(Err(error)) => return Err(Box::new(ConnectError(error))),
            Err(_elapsed) => {
                return Err(Box::new(ConnectError(io::Error::new(
                    io::ErrorKind::TimedOut,
                    format!("no connection within {CONNECT_TIMEOUT:?}"),
                ))));
            }
        };
        // Requests are small and latency matters more than packet count.
        let _ = stream.set_nodelay(true);
        let (send, io) = http1::Builder::new()
            .handshake(TokioIo::new(stream))
            .await
            .map_err(|e| Box::new(e) as Error)?;
        Ok(Conn { send, io })
    }

    /// Puts a connection whose exchange has ended back, or drops it when it cannot take
    /// another request.
    fn put(self: &Arc<Self>, mut conn: Conn) {
        let mut cx = Context::from_waker(Waker::noop());
        // Lets the connection see the end of the response it just read, so that it waits
        // for the next request (or ends, when the upstream said `Connection: close`).
        if Pin::new(&mut conn.io).poll(&mut cx).is_ready() {
            return;
        }
        if conn.send.is_ready() {
            self.push(conn);
            return;
        }
        // Still writing the request's body (the upstream answered before reading it
        // all): a task finishes it, then returns the connection.
        if let Ok(runtime) = tokio::runtime::Handle::try_current() {
            let pool = self.clone();
            runtime.spawn(async move {
                let ready = poll_fn(|cx| {
                    if Pin::new(&mut conn.io).poll(cx).is_ready() {
                        return Poll::Ready(false);
                    }
                    conn.send.poll_ready(cx).map(|ready| ready.is_ok())
                })
                .await;
                if ready {
                    pool.push(conn);
                }
            });
        }
    }

    fn push(&self, conn: Conn) {
        let mut idle = self.idle().lock().unwrap_or_else(|e| e.into_inner());
        idle.push(Idle {
            conn,
            since: Instant::now(),
        });
    }

    fn reap(&self) {
        for idle in &self.idle {
            let mut idle = idle.lock().unwrap_or_else(|e| e.into_inner());
            idle.retain(|idle| idle.since.elapsed() < IDLE_TIMEOUT);
        }
    }
}

impl Conn {
    /// Sends `request` and polls the connection until the response head is in; with
    /// whether the connection is still open.
    async fn round_trip(
        &mut self,
        request: Request<Body>,
    ) -> Result<(Response<Incoming>, bool), hyper::client::conn::TrySendError<Request<Body>>> {
        let response = self.send.try_send_request(request);
        let mut response = std::pin::pin!(response);
        let mut io_done = false;
        poll_fn(|cx| {
            // The connection writes the request and reads the response head (and what
            // of the body came with it); when it ends (closed, failed), the response
            // future has its error.
            if !io_done && Pin::new(&mut self.io).poll(cx).is_ready() {
                io_done = true;
            }
            response.as_mut().poll(cx)
        })
        .await
        .map(|response| (response, !io_done))
    }
}

/// A response body from an upstream, which polls its connection while it is read and
/// returns the connection to the pool at its end.
struct UpstreamBody {
    body: Incoming,
    /// `None` once the connection has ended or gone back to the pool.
    conn: Option<Conn>,
    pool: Arc<Pool>,
}

impl UpstreamBody {
    /// At the body's end: the connection goes back to the pool.
    fn release(&mut self) {
        if let Some(conn) = self.conn.take() {
            self.pool.put(conn);
        }
    }
}

impl http_body::Body for UpstreamBody {
    type Data = Bytes;
    type Error = hyper::Error;

    fn poll_frame(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, hyper::Error>>> {
        let this = &mut *self;
        if let Some(conn) = &mut this.conn {
            // The connection reads the body into `body`; once it ends, what it read is
            // still there to take, and a failure shows as the body's error.
            if Pin::new(&mut conn.io).poll(cx).is_ready() {
                this.conn = None;
            }
        }
        let frame = Pin::new(&mut this.body).poll_frame(cx);
        match &frame {
            Poll::Ready(None) => this.release(),
            Poll::Ready(Some(Ok(_))) if this.body.is_end_stream() => this.release(),
            Poll::Ready(Some(Err(_))) => this.conn = None,
            _ => {}
        }
        frame
    }

    fn is_end_stream(&self) -> bool {
        self.body.is_end_stream()
    }

    fn size_hint(&self) -> SizeHint {
        self.body.size_hint()
    }
}

impl Drop for UpstreamBody {
    fn drop(&mut self) {
        // Ended (the server need not poll a body that says it has ended): reusable.
        // Dropped before its end (the client went away): closed, as a connection with a
        // response half read must be.
        if self.body.is_end_stream() {
            self.release();
        }
    }
}

/// The upstream could not be connected to.
#[derive(Debug)]
pub(crate) struct ConnectError(io::Error);

impl std::fmt::Display for ConnectError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("cannot connect to the upstream")
    }
}

impl std::error::Error for ConnectError {
    fn source(&self) -> Option<&(dyn std::error::Error + 'static)> {
        Some(&self.0)
    }
}
