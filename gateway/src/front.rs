//! The main listener's requests: the body limit, the peer, the route by the config's
//! longest prefix, and the route's service (`routes`), for each request of a connection.

use std::{borrow::Cow, convert::Infallible, future::Future, net::SocketAddr, pin::Pin, sync::Arc};

use axum::{
    body::Body,
    extract::ConnectInfo,
    http::{Request, StatusCode, Uri, header::CONTENT_LENGTH, uri::PathAndQuery},
    response::Response,
};
use http_body_util::Limited;
use hyper::body::Incoming;
use tower::ServiceExt;

use crate::{path, proxy, server::Live, traffic};

/// The main listener's service, one per connection, in place of an axum `Router`: a
/// proxied request is routed by the config's longest prefix anyway, so the router's
/// matching, its boxed handler and its layers were work per request for nothing.
pub(crate) struct Front {
    live: Arc<Live>,
    peer: SocketAddr,
    /// `server.max_body_bytes`.
    max_body_bytes: usize,
}

impl Front {
    /// The service of a connection from `peer`.
    pub(crate) fn new(live: Arc<Live>, peer: SocketAddr, max_body_bytes: usize) -> Self {
        Self {
            live,
            peer,
            max_body_bytes,
        }
    }
}

/// The future of a [`Front`] answer.
type FrontFuture = Pin<Box<dyn Future<Output = Result<Response, Infallible>> + Send>>;

impl hyper::service::Service<Request<Incoming>> for Front {
    type Response = Response;
    type Error = Infallible;
    type Future = FrontFuture;

    fn call(&self, request: Request<Incoming>) -> FrontFuture {
        // The body limit comes first (as tower-http's `RequestBodyLimit` did): a body
        // announced too large is refused before a route or a limit is looked at; one
        // that grows too large while streamed fails the proxy's upstream request, which
        // answers 413 too.
        let announced = request
            .headers()
            .get(CONTENT_LENGTH)
            .and_then(|value| value.to_str().ok()?.parse::<usize>().ok());
        let limit = match announced {
            Some(length) if length > self.max_body_bytes => {
                let response =
                    proxy::status(StatusCode::PAYLOAD_TOO_LARGE, "length limit exceeded");
                return Box::pin(std::future::ready(Ok(response)));
            }
            Some(length) => length.min(self.max_body_bytes),
            None => self.max_body_bytes,
        };
        let mut request = request.map(|body| Body::new(Limited::new(body, limit)));
        // The `ip` key and the forwarding headers read the peer from here.
        request.extensions_mut().insert(ConnectInfo(self.peer));
        let live = self.live.clone();
        Box::pin(async move { Ok(dispatch(&live, request).await) })
    }
}

/// Answers every request: normalise the path, pick the route, let its service answer;
/// measured from here to the end of the response's body, when the traffic metrics are on.
async fn dispatch(live: &Arc<Live>, mut request: Request<Body>) -> Response {
    let normalized = match path::normalized(request.uri().path()) {
        Ok(path) => path,
        Err(error) => {
            tracing::debug!(method = %request.method(), uri = %request.uri(), %error, "bad request path");
            let response = proxy::status(StatusCode::BAD_REQUEST, "bad request path\n");
            return unmatched(live, &mut request, response);
        }
    };
    // One look at the route table: a reload during this request does not change it.
    let routed = {
        let gateway = live.routes();
        gateway
            .routed(&normalized)
            .map(|(service, metrics)| (service.clone(), metrics.cloned()))
    };
    let Some((service, metrics)) = routed else {
        tracing::debug!(method = %request.method(), path = %normalized, "no route");
        let response = proxy::status(StatusCode::NOT_FOUND, "no route\n");
        return unmatched(live, &mut request, response);
    };
    // Limits and upstream both see the normalised path, so they agree on the route; a
    // path already normal in origin form (most are) is kept as it is.
    let uri = request.uri();
    let rewritten = if matches!(normalized, Cow::Owned(_))
        || uri.scheme().is_some()
        || uri.authority().is_some()
    {
        let path_and_query = match uri.query() {
            Some(query) => format!("{normalized}?{query}"),
            None => normalized.into_owned(),
        };
        Some(path_and_query.parse::<PathAndQuery>())
    } else {
        None
    };
    let tracker = metrics.map(|metrics| metrics.start(&mut request));
    match rewritten {
        Some(Ok(path_and_query)) => *request.uri_mut() = Uri::from(path_and_query),
        Some(Err(_)) => {
            let response = proxy::status(StatusCode::BAD_REQUEST, "bad request path\n");
            return respond(tracker, response);
        }
        None => {}
    }
    // Only for the log line, and only when it is written.
    let logged = tracing::enabled!(tracing::Level::DEBUG)
        .then(|| (request.method().clone(), request.uri().path().to_owned()));
    let response = match service.oneshot(request).await {
        Ok(response) => response,
        Err(never) => match never {},
    };
    if let Some((method, path)) = logged {
        tracing::debug!(%method, path, status = response.status().as_u16(), "answered");
    }
    respond(tracker, response)
}

/// `response`, measured by `tracker` if the traffic metrics are on.
fn respond(tracker: Option<traffic::Tracker>, response: Response) -> Response {
    match tracker {
        Some(tracker) => tracker.respond(response),
        None => response,
    }
}

/// The gateway's `response` to a request that matches no route, counted under
/// `traffic::UNMATCHED` if the traffic metrics are on.
#[inline(never)]
fn unmatched(live: &Live, request: &mut Request<Body>, response: Response) -> Response {
    let metrics = live.routes().unmatched().cloned();
    respond(metrics.map(|metrics| metrics.start(request)), response)
}
