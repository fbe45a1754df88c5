//! Serving one listener with hyper's HTTP/1 server, with the connection limits
//! `axum::serve` cannot set: a header-read timeout (it needs hyper's timer), a write-idle
//! timeout, a cap on open connections and a bound on graceful shutdown.
//!
//! Without them a client that trickles its headers a byte a second, or opens connections
//! and never speaks, holds a file descriptor for as long as it likes; and one that sends
//! a request and never reads the response holds its connection slot, and the upstream
//! connection streaming that response, for ever (the socket's send buffer fills and the
//! write waits).
//!
//! The main listener's connections run on [`Workers`]: a current-thread runtime per core.
//! Its accept loop stays on the main runtime, which also runs the admin listener, the
//! reload watcher and the store's connections.

use std::{
    convert::Infallible,
    future::Future,
    io,
    net::SocketAddr,
    pin::Pin,
    sync::Arc,
    task::{Context, Poll, ready},
    time::{Duration, Instant},
};

use axum::{Router, extract::ConnectInfo, response::Response};
use http::Request;
use hyper::{body::Incoming, server::conn::http1};
use hyper_util::{
    rt::{TokioIo, TokioTimer},
    server::graceful::GracefulShutdown,
    service::TowerToHyperService,
};
use tokio::{
    io::{AsyncRead, AsyncWrite, ReadBuf},
    net::{TcpListener, TcpStream},
    runtime::Handle,
    sync::{Semaphore, oneshot},
    task::JoinSet,
    time::Sleep,
};
use tower::{ServiceExt, util::BoxCloneSyncService};

/// What one listener allows its clients (`[server]` in the config).
#[derive(Debug, Clone, Copy)]
pub(crate) struct ConnectionLimits {
    /// Time for a request's headers to arrive, counted from the first byte the server
    /// waits for; also how long an idle keep-alive connection stays open.
    pub(crate) header_read_timeout: Duration,
    /// Connections served at once; the next ones wait in the listen backlog.
    pub(crate) max_connections: usize,
    /// How long shutdown waits for requests in flight before closing their connections.
    pub(crate) shutdown_timeout: Duration,
    /// How long a write to the client may make no progress before the connection is
    /// closed.
    pub(crate) write_idle_timeout: Duration,
}

/// How long to pause after an accept error that is not one connection's fault (out of
/// file descriptors): retrying at once would spin.
const ACCEPT_ERROR_PAUSE: Duration = Duration::from_millis(100);

/// At most one warning per interval that every connection is taken.
const FULL_WARNING_INTERVAL: Duration = Duration::from_secs(60);

/// The threads that serve the main listener's connections: one per core, each with a
/// runtime of its own (current-thread, as nginx's workers), so that a connection, its
/// timers and its upstream connections ([`crate::upstream`]) stay on one thread and wake
/// no other. The accept loop hands each new connection to the next one in turn.
pub(crate) struct Workers {
    handles: Vec<Handle>,
    /// Dropped when the workers are: each thread's runtime then stops.
    _stop: Vec<oneshot::Sender<()>>,
}

impl Workers {
    /// `threads` worker threads (at least one).
    pub(crate) fn start(threads: usize) -> io::Result<Self> {
        let mut handles = Vec::with_capacity(threads);
        let mut stop = Vec::with_capacity(threads);
        for index in 0..threads.max(1) {
            let (started, handle) = std::sync::mpsc::channel();
            let (stop_tx, stop_rx) = oneshot::channel::<()>();
            std::thread::Builder::new()
                .name(format!("gateway-worker-{index}"))
                .spawn(move || {
                    let runtime = match tokio::runtime::Builder::new_current_thread()
                        .enable_all()
                        .build()
                    {
                        Ok(runtime) => runtime,
                        Err(error) => {
                            let _ = started.send(Err(error));
                            return;
                        }
                    };
                    crate::upstream::set_worker(index + 1);
                    let _ = started.send(Ok(runtime.handle().clone()));
                    let _ = runtime.block_on(stop_rx);
                })?;
            handles.push(handle.recv().map_err(io::Error::other)??);
            stop.push(stop_tx);
        }
        Ok(Self {
            handles,
            _stop: stop,
        })
    }

    /// One worker thread per core.
    pub(crate) fn per_core() -> io::Result<Self> {
        Self::start(std::thread::available_parallelism().map_or(1, |n| n.get()))
    }
}

impl std::fmt::Debug for Workers {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Workers")
            .field("threads", &self.handles.len())
            .finish()
    }
}

/// Serves `listener` until `stop` resolves, then stops accepting, lets the requests in
/// flight finish for up to `shutdown_timeout`, and closes what is left. Each connection
/// gets its service from `make` with its peer's address, and runs on the next of
/// `workers` (on the current runtime without).
pub(crate) async fn serve<M, S>(
    listener: TcpListener,
    make: M,
    limits: ConnectionLimits,
    stop: impl Future<Output = ()>,
    workers: Option<Workers>,
) where
    M: Fn(SocketAddr) -> S,
    S: hyper::service::Service<Request<Incoming>, Response = Response, Error = Infallible>
        + Send
        + 'static,
    S::Future: Send + 'static,
{
    let mut http = http1::Builder::new();
    http.timer(TokioTimer::new())
        .header_read_timeout(limits.header_read_timeout);
    let permits = Arc::new(Semaphore::new(limits.max_connections));
    let graceful = GracefulShutdown::new();
    let mut connections = JoinSet::new();
    let mut last_full_warning: Option<Instant> = None;
    let mut next_worker = 0;
    tokio::pin!(stop);
    loop {
        // A connection is accepted only with a permit, so at most `max_connections` are
        // open; the next clients wait in the kernel's listen backlog.
        let permit = match permits.clone().try_acquire_owned() {
            Ok(permit) => permit,
            Err(_) => {
                if last_full_warning.is_none_or(|at| at.elapsed() >= FULL_WARNING_INTERVAL) {
                    last_full_warning = Some(Instant::now());
                    tracing::warn!(
                        max_connections = limits.max_connections,
                        "server.max_connections are open: new clients wait until one closes"
                    );
                }
                tokio::select! {
                    permit = permits.clone().acquire_owned() => match permit {
                        Ok(permit) => permit,
                        Err(_closed) => break, // never closed; stop serving if it were
                    },
                    () = &mut stop => break,
                }
            }
        };
        let accepted = tokio::select! {
            accepted = listener.accept() => accepted,
            () = &mut stop => break,
        };
        let (stream, peer) = match accepted {
            Ok(accepted) => accepted,
            Err(error) if is_connection_error(&error) => continue,
            Err(error) => {
                tracing::error!(%error, "accept failed; pausing");
                tokio::select! {
                    () = tokio::time::sleep(ACCEPT_ERROR_PAUSE) => continue,
                    () = &mut stop => break,
                }
            }
        };
        // Forget the connections that have ended.
        while connections.try_join_next().is_some() {}
        // Answers are small and latency matters more than packet count.
        let _ = stream.set_nodelay(true);
        let service = make(peer);
        let http = http.clone();
        let watcher = graceful.watcher();
        let write_idle = limits.write_idle_timeout;
        let Some(workers) = &workers else {
            let stream = WriteIdle::new(stream, write_idle);
            let connection = watcher.watch(http.serve_connection(TokioIo::new(stream), service));
            connections.spawn(async move {
                if let Err(error) = connection.await {
                    tracing::debug!(%peer, %error, "connection ended with an error");
                }
                drop(permit);
            });
            continue;
        };
        // Registered anew with the worker's own I/O driver.
        let stream = match stream.into_std() {
            Ok(stream) => stream,
            Err(error) => {
                tracing::debug!(%peer, %error, "cannot hand the connection to a worker");
                continue;
            }
        };
        let worker = &workers.handles[next_worker % workers.handles.len()];
        next_worker = next_worker.wrapping_add(1);
        connections.spawn_on(
            async move {
                let stream = match TcpStream::from_std(stream) {
                    Ok(stream) => WriteIdle::new(stream, write_idle),
                    Err(error) => {
                        tracing::debug!(%peer, %error, "cannot register the connection");
                        return;
                    }
                };
                let connection =
                    watcher.watch(http.serve_connection(TokioIo::new(stream), service));
                if let Err(error) = connection.await {
                    tracing::debug!(%peer, %error, "connection ended with an error");
                }
                drop(permit);
            },
            worker,
        );
    }
    drop(listener);
    if tokio::time::timeout(limits.shutdown_timeout, graceful.shutdown())
        .await
        .is_err()
    {
        while connections.try_join_next().is_some() {}
        tracing::warn!(
            open = connections.len(),
            timeout = ?limits.shutdown_timeout,
            "requests still in flight after server.shutdown_timeout: closing their connections"
        );
    }
    // Aborts whatever is still open and waits until it is gone.
    connections.shutdown().await;
    drop(workers);
}

/// The service of a listener that an axum `Router` answers (the admin listener): handlers
/// see the peer as `ConnectInfo<SocketAddr>`, as with axum's
/// `into_make_service_with_connect_info`.
pub(crate) fn router(
    app: Router,
) -> impl Fn(
    SocketAddr,
) -> TowerToHyperService<BoxCloneSyncService<Request<Incoming>, Response, Infallible>> {
    move |peer| {
        let app = app.clone();
        TowerToHyperService::new(BoxCloneSyncService::new(tower::service_fn(
            move |mut request: Request<Incoming>| {
                request.extensions_mut().insert(ConnectInfo(peer));
                app.clone().oneshot(request)
            },
        )))
    }
}

/// Errors of one connection that failed while being accepted: accept the next one.
fn is_connection_error(error: &io::Error) -> bool {
    matches!(
        error.kind(),
        io::ErrorKind::ConnectionRefused
            | io::ErrorKind::ConnectionAborted
            | io::ErrorKind::ConnectionReset
    )
}

/// A connection whose writes fail with `TimedOut` once one has waited `timeout` without
/// the client taking a byte: hyper then closes the connection, dropping the response
/// (and with it the upstream's). The clock restarts at every write that goes through, so
/// a slow reader that keeps reading is never cut off, however long the response.
struct WriteIdle<S> {
    inner: S,
    timeout: Duration,
    /// Running while a write waits; `None` after one went through.
    stalled: Option<Pin<Box<Sleep>>>,
}

impl<S> WriteIdle<S> {
    fn new(inner: S, timeout: Duration) -> Self {
        Self {
            inner,
            timeout,
            stalled: None,
        }
    }

    /// After a write that waits: `TimedOut` once it has waited `timeout`.
    fn poll_stalled(&mut self, cx: &mut Context<'_>) -> Poll<io::Error> {
        let timeout = self.timeout;
        let stalled = self
            .stalled
            .get_or_insert_with(|| Box::pin(tokio::time::sleep(timeout)));
        ready!(stalled.as_mut().poll(cx));
        Poll::Ready(io::Error::new(
            io::ErrorKind::TimedOut,
            format!("the client took nothing for server.write_idle_timeout ({timeout:?})"),
        ))
    }

    /// `poll` of a write (`wrote`: bytes taken, which restart the clock) or a flush.
    fn progress<T>(
        &mut self,
        cx: &mut Context<'_>,
        poll: Poll<io::Result<T>>,
        wrote: bool,
    ) -> Poll<io::Result<T>> {
        match poll {
            Poll::Ready(result) => {
                // A flush that has nothing to do proves nothing about the client.
                if wrote {
                    self.stalled = None;
                }
                Poll::Ready(result)
            }
            Poll::Pending => self.poll_stalled(cx).map(Err),
        }
    }
}

impl<S: AsyncRead + Unpin> AsyncRead for WriteIdle<S> {
    fn poll_read(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<io::Result<()>> {
        Pin::new(&mut self.inner).poll_read(cx, buf)
    }
}

impl<S: AsyncWrite + Unpin> AsyncWrite for WriteIdle<S> {
    fn poll_write(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<io::Result<usize>> {
        let poll = Pin::new(&mut self.inner).poll_write(cx, buf);
        self.progress(cx, poll, true)
    }

    fn poll_write_vectored(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        bufs: &[io::IoSlice<'_>],
    ) -> Poll<io::Result<usize>> {
        let poll = Pin::new(&mut self.inner).poll_write_vectored(cx, bufs);
        self.progress(cx, poll, true)
    }

    fn is_write_vectored(&self) -> bool {
        self.inner.is_write_vectored()
    }

    fn poll_flush(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        let poll = Pin::new(&mut self.inner).poll_flush(cx);
        self.progress(cx, poll, false)
    }

    fn poll_shutdown(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        let poll = Pin::new(&mut self.inner).poll_shutdown(cx);
        self.progress(cx, poll, false)
    }
}
