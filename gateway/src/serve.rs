//! Serving one listener with hyper's HTTP/1 server, with the connection limits
//! `axum::serve` cannot set: a header-read timeout (it needs hyper's timer), a write-idle
//! timeout, a cap on open connections and a bound on graceful shutdown.
//!
//! Without them a client that trickles its headers a byte a second, or opens connections
//! and never speaks, holds a file descriptor for as long as it likes; and one that sends
//! a request and never reads the response holds its connection slot, and the upstream
//! connection streaming that response, for ever (the socket's send buffer fills and the
//! write waits).

use std::{
    future::Future,
    io,
    pin::Pin,
    sync::Arc,
    task::{Context, Poll, ready},
    time::{Duration, Instant},
};

use axum::{
    Router,
    extract::{ConnectInfo, Request},
};
use hyper::{body::Incoming, server::conn::http1};
use hyper_util::{
    rt::{TokioIo, TokioTimer},
    server::graceful::GracefulShutdown,
    service::TowerToHyperService,
};
use tokio::{
    io::{AsyncRead, AsyncWrite, ReadBuf},
    net::TcpListener,
    sync::Semaphore,
    task::JoinSet,
    time::Sleep,
};
use tower::ServiceExt;

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

/// Serves `app` on `listener` until `stop` resolves, then stops accepting, lets the
/// requests in flight finish for up to `shutdown_timeout`, and closes what is left.
/// Handlers see the peer as `ConnectInfo<SocketAddr>`, as with axum's
/// `into_make_service_with_connect_info`.
pub(crate) async fn serve(
    listener: TcpListener,
    app: Router,
    limits: ConnectionLimits,
    stop: impl Future<Output = ()>,
) {
    let mut http = http1::Builder::new();
    http.timer(TokioTimer::new())
        .header_read_timeout(limits.header_read_timeout);
    let permits = Arc::new(Semaphore::new(limits.max_connections));
    let graceful = GracefulShutdown::new();
    let mut connections = JoinSet::new();
    let mut last_full_warning: Option<Instant> = None;
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
        let app = app.clone();
        let service = tower::service_fn(move |mut request: Request<Incoming>| {
            request.extensions_mut().insert(ConnectInfo(peer));
            app.clone().oneshot(request)
        });
        let stream = WriteIdle::new(stream, limits.write_idle_timeout);
        let connection = graceful
            .watch(http.serve_connection(TokioIo::new(stream), TowerToHyperService::new(service)));
        connections.spawn(async move {
            if let Err(error) = connection.await {
                tracing::debug!(%peer, %error, "connection ended with an error");
            }
            drop(permit);
        });
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
