//! The gateway's traffic metrics, named after the OpenTelemetry HTTP semantic conventions
//! as Prometheus exports them (dots become underscores, the unit a suffix): the requests
//! it served ([`SERVER_DURATION`], [`SERVER_ACTIVE`], body sizes), the upstream's part of
//! them apart ([`CLIENT_DURATION`]); `reload.rs` has the config reloads'. The limiter's own metrics
//! (`tollgate_requests_total`, ...) come from the library, labelled with the layer's name.
//!
//! Labels stay bounded whatever a client sends: the method is one of the nine of RFC 9110
//! and RFC 5789 or `_OTHER`, the route is a configured route's `path` (or [`UNMATCHED`],
//! never the request's path), the status is the one the gateway answered, and
//! `error_type` is one of a fixed set.
//!
//! The per-request work is kept small: each route keeps its series' handles, registered
//! with the recorder once per label set (the first request of a method and status on the
//! route), so a request looks its handles up in a short list and records into them, with
//! no label built, hashed or allocated. A gateway without `admin_listen` (no recorder)
//! does none of it.

use std::{
    pin::Pin,
    sync::{
        Arc, Mutex, OnceLock,
        atomic::{AtomicU64, Ordering},
    },
    task::{Context, Poll},
    time::Instant,
};

use arc_swap::ArcSwap;
use axum::body::{Body, Bytes};
use http::{Method, Request, Response, StatusCode};
use http_body::{Body as _, Frame, SizeHint};
use metrics::{Gauge, Histogram, Label};

/// `http.server.request.duration`: from the request's head to the end of its response's
/// body, per method, route, status and error type.
pub(crate) const SERVER_DURATION: &str = "http_server_request_duration_seconds";
/// `http.server.active_requests`: requests whose response has not ended, per method and
/// route.
pub(crate) const SERVER_ACTIVE: &str = "http_server_active_requests";
/// `http.server.request.body.size`, labelled as [`SERVER_DURATION`].
pub(crate) const SERVER_REQUEST_BODY: &str = "http_server_request_body_size_bytes";
/// `http.server.response.body.size`, labelled as [`SERVER_DURATION`].
pub(crate) const SERVER_RESPONSE_BODY: &str = "http_server_response_body_size_bytes";
/// `http.client.request.duration`: the upstream's part of a proxied request, from sending
/// it to the end of the upstream's response body (or the failure).
pub(crate) const CLIENT_DURATION: &str = "http_client_request_duration_seconds";
/// The OpenTelemetry SDK's default bounds for `http.*.request.duration`, in seconds.
pub(crate) const DURATION_BUCKETS: &[f64] = &[
    0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
];

/// Bounds of the body size histograms, in bytes: 0 (no body), then by fours from 64 B to
/// 64 MiB (OpenTelemetry gives none for sizes).
pub(crate) const SIZE_BUCKETS: &[f64] = &[
    0.0,
    64.0,
    256.0,
    1024.0,
    4096.0,
    16_384.0,
    65_536.0,
    262_144.0,
    1_048_576.0,
    4_194_304.0,
    16_777_216.0,
    67_108_864.0,
];

/// The `http_route` of requests that match no route (and of paths refused as invalid):
/// never a client's path. A configured route's path starts with `/`, so none is this.
pub(crate) const UNMATCHED: &str = "_unmatched";

/// The `http_request_method` values: the methods of RFC 9110 and RFC 5789, then `_OTHER`
/// for every other (OpenTelemetry's rule, so that a client cannot make a series).
const METHODS: [&str; 10] = [
    "GET", "HEAD", "POST", "PUT", "DELETE", "CONNECT", "OPTIONS", "TRACE", "PATCH", "_OTHER",
];

fn method_index(method: &Method) -> usize {
    match *method {
        Method::GET => 0,
        Method::HEAD => 1,
        Method::POST => 2,
        Method::PUT => 3,
        Method::DELETE => 4,
        Method::CONNECT => 5,
        Method::OPTIONS => 6,
        Method::TRACE => 7,
        Method::PATCH => 8,
        _ => 9,
    }
}

/// Why a request failed, the `error_type` label besides a 5xx status code.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Failure {
    /// The upstream sent no response head within `server.upstream_timeout` (504).
    Timeout,
    /// The connection to the upstream could not be made (502).
    UpstreamUnreachable,
    /// The upstream's connection failed after it was made: closed or reset before a
    /// response, or an invalid response (502).
    UpstreamError,
    /// The response body broke off (the upstream's connection failed mid-body): counted
    /// as `upstream_error`, with the status that was sent.
    BodyBroke,
}

impl Failure {
    const fn as_str(self) -> &'static str {
        match self {
            Self::Timeout => "timeout",
            Self::UpstreamUnreachable => "upstream_unreachable",
            Self::UpstreamError | Self::BodyBroke => "upstream_error",
        }
    }

    const fn code(failure: Option<Self>) -> u32 {
        match failure {
            None => 0,
            Some(Self::Timeout) => 1,
            Some(Self::UpstreamUnreachable) => 2,
            Some(Self::UpstreamError) => 3,
            Some(Self::BodyBroke) => 4,
        }
    }

    const fn from_code(code: u32) -> Option<Self> {
        match code {
            1 => Some(Self::Timeout),
            2 => Some(Self::UpstreamUnreachable),
            3 => Some(Self::UpstreamError),
            4 => Some(Self::BodyBroke),
            _ => None,
        }
    }
}

/// In a response's extensions, from the proxy: the upstream was asked at `started`, and
/// answered this response, or failed (`failure`) and the gateway answered it.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Upstreamed {
    started: Instant,
    failure: Option<Failure>,
}

/// `response`, as the upstream's answer to a request sent at `started` (`None`: the
/// metrics are off).
#[inline]
pub(crate) fn upstream_answered<B>(response: &mut Response<B>, started: Option<Instant>) {
    if let Some(started) = started {
        response.extensions_mut().insert(Upstreamed {
            started,
            failure: None,
        });
    }
}

/// `response` (the gateway's own), answering a request whose upstream, asked at
/// `started` (`None`: the metrics are off), failed with `failure`.
pub(crate) fn upstream_failed<B>(
    mut response: Response<B>,
    started: Option<Instant>,
    failure: Failure,
) -> Response<B> {
    if let Some(started) = started {
        response.extensions_mut().insert(Upstreamed {
            started,
            failure: Some(failure),
        });
    }
    response
}

/// Describes the metrics to the installed recorder (`# HELP`).
pub(crate) fn describe() {
    metrics::describe_histogram!(
        SERVER_DURATION,
        metrics::Unit::Seconds,
        "Duration of HTTP server requests: from the request head to the end of the response body."
    );
    metrics::describe_gauge!(
        SERVER_ACTIVE,
        metrics::Unit::Count,
        "Number of active HTTP server requests (their response has not ended)."
    );
    metrics::describe_histogram!(
        SERVER_REQUEST_BODY,
        metrics::Unit::Bytes,
        "Size of HTTP server request bodies (Content-Length, else the bytes read)."
    );
    metrics::describe_histogram!(
        SERVER_RESPONSE_BODY,
        metrics::Unit::Bytes,
        "Size of HTTP server response bodies (the bytes sent)."
    );
    metrics::describe_histogram!(
        CLIENT_DURATION,
        metrics::Unit::Seconds,
        "Duration of HTTP client requests to the upstreams: from sending the request to the \
         end of the upstream's response body, or its failure."
    );
}

/// One route's series (or [`UNMATCHED`]'s), registered as they are first used.
#[derive(Debug)]
pub(crate) struct RouteMetrics {
    route: Arc<str>,
    /// `server_address` and `server_port` of the route's upstream, if it has one.
    upstream: Option<(String, String)>,
    by_method: [OnceLock<MethodSeries>; 10],
}

/// The series of one method on one route.
struct MethodSeries {
    active: Gauge,
    /// By [`key`]: few per method (one per status the route answers), so a short list.
    finished: ArcSwap<Vec<(u32, Finished)>>,
    /// Held while a label set is added.
    adding: Mutex<()>,
}

impl std::fmt::Debug for MethodSeries {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("MethodSeries")
            .field("label_sets", &self.finished.load().len())
            .finish_non_exhaustive()
    }
}

/// The histograms of one label set: the server's, and the upstream's when it answered or
/// failed.
#[derive(Clone)]
struct Finished {
    duration: Histogram,
    request_body: Histogram,
    response_body: Histogram,
    client: Option<Histogram>,
}

/// The label set of a finished request: status, failure, and whether the upstream was
/// asked.
fn key(status: StatusCode, failure: Option<Failure>, upstreamed: bool) -> u32 {
    u32::from(status.as_u16()) | Failure::code(failure) << 16 | u32::from(upstreamed) << 24
}

impl RouteMetrics {
    /// The series of the route `route` (its `path`), proxying to `upstream` (its
    /// `host:port`) if it does.
    pub(crate) fn new(route: &str, upstream: Option<&http::uri::Authority>) -> Arc<Self> {
        let upstream = upstream.map(|authority| {
            let port = authority.port_u16().unwrap_or(80);
            (authority.host().to_owned(), port.to_string())
        });
        Arc::new(Self {
            route: route.into(),
            upstream,
            by_method: Default::default(),
        })
    }

    /// Starts measuring `request`: counts it active, and notes its body's size (counting
    /// the bytes of a body of unknown length as they are read).
    pub(crate) fn start(self: &Arc<Self>, request: &mut Request<Body>) -> Tracker {
        let started = Instant::now();
        let method = method_index(request.method());
        self.series(method).active.increment(1.0);
        let request_body = match request.body().size_hint().exact() {
            Some(size) => RequestBody::Known(size),
            None => {
                let read = Arc::new(AtomicU64::new(0));
                let body = std::mem::take(request.body_mut());
                *request.body_mut() = Body::new(CountedBody {
                    inner: body,
                    read: read.clone(),
                });
                RequestBody::Read(read)
            }
        };
        Tracker {
            route: self.clone(),
            method,
            started,
            request_body,
        }
    }

    fn series(&self, method: usize) -> &MethodSeries {
        self.by_method[method].get_or_init(|| MethodSeries {
            active: metrics::gauge!(
                SERVER_ACTIVE,
                "http_request_method" => METHODS[method],
                "http_route" => self.route.to_string(),
            ),
            finished: ArcSwap::from_pointee(Vec::new()),
            adding: Mutex::new(()),
        })
    }

    /// The histograms of `key`, registered now if they are new.
    fn finished(
        &self,
        series: &MethodSeries,
        method: usize,
        key: u32,
        record: impl FnOnce(&Finished),
    ) {
        if let Some((_, finished)) = series.finished.load().iter().find(|(k, _)| *k == key) {
            return record(finished);
        }
        let _adding = series.adding.lock().unwrap_or_else(|e| e.into_inner());
        let known = series.finished.load_full();
        if let Some((_, finished)) = known.iter().find(|(k, _)| *k == key) {
            return record(finished);
        }
        let finished = self.register(method, key);
        record(&finished);
        let mut more = Vec::with_capacity(known.len() + 1);
        more.extend(known.iter().cloned());
        more.push((key, finished));
        series.finished.store(Arc::new(more));
    }

    fn register(&self, method: usize, key: u32) -> Finished {
        let status = (key & 0xffff).to_string();
        let failure = Failure::from_code((key >> 16) & 0xff);
        let upstreamed = key >> 24 != 0;
        let code = key & 0xffff;
        let common = || {
            vec![
                Label::new("http_request_method", METHODS[method]),
                Label::new("http_route", self.route.to_string()),
            ]
        };
        let mut server = common();
        server.push(Label::new("http_response_status_code", status.clone()));
        // OpenTelemetry: a server's error is a 5xx (a 4xx is the client's).
        if let Some(error) = failure
            .map(|f| f.as_str().to_owned())
            .or_else(|| (code >= 500).then(|| status.clone()))
        {
            server.push(Label::new("error_type", error));
        }
        let client = match (&self.upstream, upstreamed) {
            (Some((address, port)), true) => {
                let mut labels = common();
                labels.push(Label::new("server_address", address.clone()));
                labels.push(Label::new("server_port", port.clone()));
                // A request that failed has no response (the status is the gateway's own);
                // OpenTelemetry: a client's error is a 4xx or 5xx.
                let error = match failure {
                    Some(Failure::BodyBroke) => {
                        labels.push(Label::new("http_response_status_code", status.clone()));
                        Some(Failure::BodyBroke.as_str().to_owned())
                    }
                    Some(failure) => Some(failure.as_str().to_owned()),
                    None => {
                        labels.push(Label::new("http_response_status_code", status.clone()));
                        (code >= 400).then(|| status.clone())
                    }
                };
                if let Some(error) = error {
                    labels.push(Label::new("error_type", error));
                }
                Some(metrics::histogram!(CLIENT_DURATION, labels))
            }
            _ => None,
        };
        Finished {
            duration: metrics::histogram!(SERVER_DURATION, server.clone()),
            request_body: metrics::histogram!(SERVER_REQUEST_BODY, server.clone()),
            response_body: metrics::histogram!(SERVER_RESPONSE_BODY, server),
            client,
        }
    }
}

/// The size of a request's body: known from its head, or counted as read.
#[derive(Debug)]
enum RequestBody {
    Known(u64),
    Read(Arc<AtomicU64>),
}

/// A request being measured, from its head until its response ends.
#[derive(Debug)]
pub(crate) struct Tracker {
    route: Arc<RouteMetrics>,
    method: usize,
    started: Instant,
    request_body: RequestBody,
}

impl Tracker {
    /// `response`, measured until its body ends (or is dropped, when the client goes).
    pub(crate) fn respond(self, mut response: Response<Body>) -> Response<Body> {
        let upstreamed = response.extensions_mut().remove::<Upstreamed>();
        let status = response.status();
        let body = std::mem::take(response.body_mut());
        *response.body_mut() = Body::new(TrackedBody {
            inner: body,
            sent: 0,
            ended: Some(Ended {
                tracker: self,
                status,
                upstreamed,
            }),
        });
        response
    }
}

/// What is recorded when a response's body ends.
struct Ended {
    tracker: Tracker,
    status: StatusCode,
    upstreamed: Option<Upstreamed>,
}

impl Ended {
    fn record(self, sent: u64, broke: bool) {
        let Self {
            tracker,
            status,
            upstreamed,
        } = self;
        let now = Instant::now();
        let route = &tracker.route;
        let series = route.series(tracker.method);
        let mut failure = upstreamed.and_then(|u| u.failure);
        if broke {
            failure = Some(Failure::BodyBroke);
        }
        let key = key(status, failure, upstreamed.is_some());
        let request_body = match &tracker.request_body {
            RequestBody::Known(size) => *size,
            RequestBody::Read(read) => read.load(Ordering::Relaxed),
        };
        route.finished(series, tracker.method, key, |finished| {
            finished
                .duration
                .record(now.duration_since(tracker.started).as_secs_f64());
            finished.request_body.record(request_body as f64);
            finished.response_body.record(sent as f64);
            if let (Some(client), Some(upstreamed)) = (&finished.client, upstreamed) {
                client.record(now.duration_since(upstreamed.started).as_secs_f64());
            }
        });
        // Last: a request no longer active has been recorded.
        series.active.decrement(1.0);
    }
}

/// A response body that records its request's metrics when it ends, fails or is dropped.
struct TrackedBody {
    inner: Body,
    sent: u64,
    ended: Option<Ended>,
}

impl http_body::Body for TrackedBody {
    type Data = Bytes;
    type Error = axum::Error;

    fn poll_frame(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, axum::Error>>> {
        let this = &mut *self;
        let polled = Pin::new(&mut this.inner).poll_frame(cx);
        match &polled {
            Poll::Ready(Some(Ok(frame))) => {
                if let Some(data) = frame.data_ref() {
                    this.sent += data.len() as u64;
                }
            }
            Poll::Ready(None) => {
                if let Some(ended) = this.ended.take() {
                    ended.record(this.sent, false);
                }
            }
            Poll::Ready(Some(Err(_))) => {
                if let Some(ended) = this.ended.take() {
                    ended.record(this.sent, true);
                }
            }
            Poll::Pending => {}
        }
        polled
    }

    fn is_end_stream(&self) -> bool {
        self.inner.is_end_stream()
    }

    fn size_hint(&self) -> SizeHint {
        self.inner.size_hint()
    }
}

impl Drop for TrackedBody {
    fn drop(&mut self) {
        if let Some(ended) = self.ended.take() {
            ended.record(self.sent, false);
        }
    }
}

/// A request body of unknown length (chunked) that counts the bytes read from it.
struct CountedBody {
    inner: Body,
    read: Arc<AtomicU64>,
}

impl http_body::Body for CountedBody {
    type Data = Bytes;
    type Error = axum::Error;

    fn poll_frame(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, axum::Error>>> {
        let polled = Pin::new(&mut self.inner).poll_frame(cx);
        if let Poll::Ready(Some(Ok(frame))) = &polled
            && let Some(data) = frame.data_ref()
        {
            self.read.fetch_add(data.len() as u64, Ordering::Relaxed);
        }
        polled
    }

    fn is_end_stream(&self) -> bool {
        self.inner.is_end_stream()
    }

    fn size_hint(&self) -> SizeHint {
        self.inner.size_hint()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn methods_outside_the_known_ones_are_other() {
        for (method, index) in [
            (Method::GET, 0),
            (Method::PATCH, 8),
            (Method::from_bytes(b"get").unwrap(), 9),
            (Method::from_bytes(b"PROPFIND").unwrap(), 9),
            (Method::from_bytes(b"X-RANDOM-123").unwrap(), 9),
        ] {
            assert_eq!(method_index(&method), index, "{method}");
        }
        assert_eq!(METHODS[9], "_OTHER");
    }

    #[test]
    fn a_key_tells_status_failure_and_upstream_apart() {
        let keys = [
            key(StatusCode::OK, None, false),
            key(StatusCode::OK, None, true),
            key(
                StatusCode::BAD_GATEWAY,
                Some(Failure::UpstreamUnreachable),
                true,
            ),
            key(StatusCode::BAD_GATEWAY, Some(Failure::UpstreamError), true),
            key(StatusCode::GATEWAY_TIMEOUT, Some(Failure::Timeout), true),
            key(StatusCode::BAD_GATEWAY, None, true),
        ];
        let distinct: std::collections::HashSet<_> = keys.iter().collect();
        assert_eq!(distinct.len(), keys.len());
        assert_eq!(keys[5] & 0xffff, 502);
    }
}
