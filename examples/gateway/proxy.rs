//! Forwarding a request to an upstream with hyper-util's client, bodies streamed both ways.

use std::{net::SocketAddr, sync::Arc, time::Duration};

use axum::{
    body::Body,
    extract::ConnectInfo,
    http::{
        HeaderMap, HeaderName, HeaderValue, Request, Response, StatusCode, Uri, Version,
        header::{self, CONNECTION},
        uri::Scheme,
    },
};
use hyper_util::{
    client::legacy::{Client, connect::HttpConnector},
    rt::TokioExecutor,
};

use crate::config::Upstream;

/// The HTTP client every route shares (one connection pool).
pub(crate) type HttpClient = Client<HttpConnector, Body>;

/// How long connecting to an upstream may take before the request gets 502.
const CONNECT_TIMEOUT: Duration = Duration::from_secs(5);

/// Counts requests that got 502 because the upstream failed, per route.
pub(crate) const UPSTREAM_ERRORS_TOTAL: &str = "tollgate_gateway_upstream_errors_total";

pub(crate) fn client() -> HttpClient {
    let mut connector = HttpConnector::new();
    connector.set_connect_timeout(Some(CONNECT_TIMEOUT));
    connector.set_nodelay(true);
    Client::builder(TokioExecutor::new()).build(connector)
}

/// Forwards requests of one route to its upstream.
#[derive(Clone, Debug)]
pub(crate) struct Proxy {
    client: HttpClient,
    upstream: Arc<Upstream>,
    route: Arc<str>,
}

impl Proxy {
    pub(crate) fn new(client: HttpClient, upstream: Upstream, route: &str) -> Self {
        Self {
            client,
            upstream: Arc::new(upstream),
            route: route.into(),
        }
    }

    /// Forwards `request` (its path already normalised) and returns the upstream's answer,
    /// or 502 when there is none. Never fails.
    pub(crate) async fn forward(&self, request: Request<Body>) -> Response<Body> {
        let (mut parts, body) = request.into_parts();
        let peer = parts
            .extensions
            .get::<ConnectInfo<SocketAddr>>()
            .map(|info| info.0);
        let uri = match self.upstream_uri(&parts.uri) {
            Ok(uri) => uri,
            Err(error) => {
                tracing::warn!(%error, uri = %parts.uri, "cannot build the upstream URI");
                return status(StatusCode::BAD_REQUEST, "bad request\n");
            }
        };
        parts.uri = uri;
        // The client speaks HTTP/1.1 to upstreams whatever the downstream version was.
        parts.version = Version::HTTP_11;
        remove_hop_by_hop(&mut parts.headers);
        if let Some(peer) = peer {
            append_forwarded_for(&mut parts.headers, peer);
        }
        // `Host` passes through unchanged (it is end-to-end); the client sets it from the
        // upstream URI only when the request had none.
        let request = Request::from_parts(parts, body);
        match self.client.request(request).await {
            Ok(response) => {
                let (mut parts, body) = response.into_parts();
                remove_hop_by_hop(&mut parts.headers);
                Response::from_parts(parts, Body::new(body))
            }
            Err(error) => {
                tracing::warn!(
                    route = %self.route,
                    upstream = %self.upstream.authority,
                    error = %ErrorChain(&error),
                    "upstream request failed"
                );
                metrics::counter!(UPSTREAM_ERRORS_TOTAL, "route" => self.route.clone())
                    .increment(1);
                status(StatusCode::BAD_GATEWAY, "bad gateway\n")
            }
        }
    }

    fn upstream_uri(&self, uri: &Uri) -> Result<Uri, http::Error> {
        let mut path_and_query = String::with_capacity(64);
        path_and_query.push_str(&self.upstream.base_path);
        path_and_query.push_str(uri.path());
        if let Some(query) = uri.query() {
            path_and_query.push('?');
            path_and_query.push_str(query);
        }
        Uri::builder()
            .scheme(Scheme::HTTP)
            .authority(self.upstream.authority.clone())
            .path_and_query(path_and_query)
            .build()
    }
}

/// A plain-text answer of the gateway itself.
pub(crate) fn status(status: StatusCode, body: &'static str) -> Response<Body> {
    let mut response = Response::new(Body::from(body));
    *response.status_mut() = status;
    response.headers_mut().insert(
        header::CONTENT_TYPE,
        HeaderValue::from_static("text/plain; charset=utf-8"),
    );
    response
}

/// Headers that describe one connection, not the message (RFC 9110 section 7.6.1), plus
/// every header the `Connection` header names.
const HOP_BY_HOP: [&str; 9] = [
    "connection",
    "proxy-connection",
    "keep-alive",
    "proxy-authenticate",
    "proxy-authorization",
    "te",
    "trailer",
    "transfer-encoding",
    "upgrade",
];

fn remove_hop_by_hop(headers: &mut HeaderMap) {
    let named: Vec<HeaderName> = headers
        .get_all(CONNECTION)
        .iter()
        .filter_map(|value| value.to_str().ok())
        .flat_map(|value| value.split(','))
        .filter_map(|name| HeaderName::from_bytes(name.trim().as_bytes()).ok())
        .collect();
    for name in named {
        headers.remove(name);
    }
    for name in HOP_BY_HOP {
        headers.remove(name);
    }
}

/// Appends the TCP peer to `X-Forwarded-For`, joining repeated headers into one list, as
/// every proxy does: upstreams read it from the right (see `tollgate::key::ClientIp`).
fn append_forwarded_for(headers: &mut HeaderMap, peer: SocketAddr) {
    let peer = peer.ip().to_canonical().to_string();
    let mut list = headers
        .get_all("x-forwarded-for")
        .iter()
        .filter_map(|value| value.to_str().ok())
        .map(str::trim)
        .filter(|value| !value.is_empty())
        .collect::<Vec<_>>()
        .join(", ");
    if !list.is_empty() {
        list.push_str(", ");
    }
    list.push_str(&peer);
    match HeaderValue::try_from(list) {
        Ok(value) => {
            headers.insert("x-forwarded-for", value);
        }
        Err(_) => {
            // Unreachable in practice (the parts were header values already); fall back to
            // the peer alone rather than forwarding a list we could not extend.
            headers.insert(
                "x-forwarded-for",
                HeaderValue::try_from(peer).unwrap_or(HeaderValue::from_static("unknown")),
            );
        }
    }
}

/// Displays an error with its sources: hyper-util's errors say little at the top level.
struct ErrorChain<'a>(&'a (dyn std::error::Error + 'static));

impl std::fmt::Display for ErrorChain<'_> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{}", self.0)?;
        let mut source = self.0.source();
        while let Some(error) = source {
            write!(f, ": {error}")?;
            source = error.source();
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn hop_by_hop_headers_and_the_ones_connection_names_are_removed() {
        let mut headers = HeaderMap::new();
        headers.insert(
            "connection",
            HeaderValue::from_static("keep-alive, X-Secret"),
        );
        headers.insert("keep-alive", HeaderValue::from_static("timeout=5"));
        headers.insert("x-secret", HeaderValue::from_static("1"));
        headers.insert("te", HeaderValue::from_static("trailers"));
        headers.insert("upgrade", HeaderValue::from_static("websocket"));
        headers.insert("x-custom", HeaderValue::from_static("kept"));
        remove_hop_by_hop(&mut headers);
        assert_eq!(headers.len(), 1, "{headers:?}");
        assert_eq!(headers["x-custom"], "kept");
    }

    #[test]
    fn forwarded_for_is_appended() {
        let peer: SocketAddr = "192.0.2.7:5000".parse().unwrap();
        let mut headers = HeaderMap::new();
        append_forwarded_for(&mut headers, peer);
        assert_eq!(headers["x-forwarded-for"], "192.0.2.7");
        let mut headers = HeaderMap::new();
        headers.append(
            "x-forwarded-for",
            HeaderValue::from_static("1.1.1.1, 2.2.2.2"),
        );
        headers.append("x-forwarded-for", HeaderValue::from_static("3.3.3.3"));
        append_forwarded_for(&mut headers, peer);
        assert_eq!(
            headers["x-forwarded-for"],
            "1.1.1.1, 2.2.2.2, 3.3.3.3, 192.0.2.7"
        );
        let mapped: SocketAddr = "[::ffff:192.0.2.8]:1".parse().unwrap();
        let mut headers = HeaderMap::new();
        append_forwarded_for(&mut headers, mapped);
        assert_eq!(headers["x-forwarded-for"], "192.0.2.8");
    }
}
