//! Forwarding a request to an upstream (connections from [`crate::upstream`]), bodies
//! streamed both ways.

use std::{
    net::{IpAddr, SocketAddr},
    sync::Arc,
    time::Duration,
};

use axum::{
    body::Body,
    extract::ConnectInfo,
    http::{
        HeaderMap, HeaderName, HeaderValue, Request, Response, StatusCode, Uri, Version,
        header::{self, CONNECTION},
        uri::{Authority, PathAndQuery},
    },
};
use http_body_util::LengthLimitError;
use ipnet::IpNet;
use tollgate::key::ClientIp;

use crate::{
    config::Upstream,
    traffic::{self, Failure},
    upstream::{self, Pool},
};

/// The HTTP client every route shares (a connection pool per upstream).
pub(crate) type HttpClient = upstream::Client;

/// Counts requests that got 502 or 504 because the upstream failed or timed out, per route.
pub(crate) const UPSTREAM_ERRORS_TOTAL: &str = "tollgate_gateway_upstream_errors_total";

pub(crate) fn client() -> HttpClient {
    upstream::Client::new()
}

/// What every route's proxy shares: the client, whom to believe, how long to wait.
#[derive(Debug)]
pub(crate) struct Settings {
    pub(crate) client: HttpClient,
    /// `trusted_proxies`: whose forwarding headers are passed on.
    pub(crate) trusted_proxies: Vec<IpNet>,
    /// How long the upstream may take to send its response head.
    pub(crate) upstream_timeout: Duration,
    /// Whether the traffic metrics are recorded (`admin_listen` set): the upstream's
    /// answers then carry when it was asked ([`traffic::Upstreamed`]).
    pub(crate) metered: bool,
}

/// Forwards requests of one route to its upstream.
#[derive(Clone, Debug)]
pub(crate) struct Proxy {
    settings: Arc<Settings>,
    /// The `ip` key's extractor: the client address `X-Real-IP` gets.
    client_ip: Arc<ClientIp>,
    upstream: Arc<Upstream>,
    /// The upstream's connections.
    pool: Arc<Pool>,
    /// `Host` for a request that has none: the upstream's authority (without `:80`).
    host: HeaderValue,
    route: Arc<str>,
}

impl Proxy {
    pub(crate) fn new(settings: Arc<Settings>, upstream: Upstream, route: &str) -> Self {
        let client_ip = ClientIp::new(settings.trusted_proxies.iter().copied());
        let pool = settings.client.pool(&upstream.authority);
        let host = match upstream.authority.port_u16() {
            Some(80) => upstream.authority.host(),
            _ => upstream.authority.as_str(),
        };
        // An authority is a valid header value.
        let host = HeaderValue::from_str(host).unwrap_or(HeaderValue::from_static("localhost"));
        Self {
            client_ip: Arc::new(client_ip),
            settings,
            upstream: Arc::new(upstream),
            pool,
            host,
            route: route.into(),
        }
    }

    /// Forwards `request` (its path already normalised) and returns the upstream's answer,
    /// 502 when there is none, 504 when its head takes longer than `upstream_timeout`,
    /// 413 when the request body turns out larger than `max_body_bytes`, 400 when the
    /// client's body fails on the way. Never fails.
    pub(crate) async fn forward(&self, request: Request<Body>) -> Response<Body> {
        let (mut parts, body) = request.into_parts();
        if !host_is_valid(&parts.headers, parts.version) {
            return status(StatusCode::BAD_REQUEST, "bad request: Host\n");
        }
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
        remove_underscore_spellings(&mut parts.headers);
        match peer {
            Some(peer) => self.set_forwarding_headers(&mut parts.headers, peer.ip()),
            None => remove_forwarding_headers(&mut parts.headers),
        }
        // `Host` passes through unchanged (it is end-to-end); it is set from the upstream
        // URL only when the request had none (HTTP/1.0).
        if !parts.headers.contains_key(header::HOST) {
            parts.headers.insert(header::HOST, self.host.clone());
        }
        let request = Request::from_parts(parts, body);
        let timeout = self.settings.upstream_timeout;
        // For the traffic metrics, when they are recorded.
        let started = self.settings.metered.then(std::time::Instant::now);
        let error = match tokio::time::timeout(timeout, self.pool.send(request)).await {
            Ok(Ok(mut response)) => {
                remove_hop_by_hop(response.headers_mut());
                traffic::upstream_answered(&mut response, started);
                return response;
            }
            Ok(Err(error)) => error,
            Err(_elapsed) => {
                // Dropping the request future closes its upstream connection.
                tracing::warn!(
                    route = %self.route,
                    upstream = %self.upstream.authority,
                    ?timeout,
                    "upstream sent no response head within server.upstream_timeout"
                );
                self.count_upstream_error();
                let response = status(StatusCode::GATEWAY_TIMEOUT, "gateway timeout\n");
                return traffic::upstream_failed(response, started, Failure::Timeout);
            }
        };
        let error: &(dyn std::error::Error + 'static) = &*error;
        if in_the_chain::<LengthLimitError>(error) {
            // Not the upstream's fault: the client's body passed `max_body_bytes` while it
            // was streamed (a body announced too large never gets here).
            tracing::debug!(route = %self.route, "request body over server.max_body_bytes");
            return status(StatusCode::PAYLOAD_TOO_LARGE, "length limit exceeded");
        }
        if in_the_chain::<axum::Error>(error) {
            // Any client can send a broken body: no upstream alert, no warning.
            tracing::debug!(route = %self.route, error = %ErrorChain(error), "client's request body failed");
            return status(StatusCode::BAD_REQUEST, "bad request body\n");
        }
        tracing::warn!(
            route = %self.route,
            upstream = %self.upstream.authority,
            error = %ErrorChain(error),
            "upstream request failed"
        );
        self.count_upstream_error();
        let failure = if in_the_chain::<upstream::ConnectError>(error) {
            Failure::UpstreamUnreachable
        } else {
            Failure::UpstreamError
        };
        traffic::upstream_failed(
            status(StatusCode::BAD_GATEWAY, "bad gateway\n"),
            started,
            failure,
        )
    }

    fn count_upstream_error(&self) {
        metrics::counter!(UPSTREAM_ERRORS_TOTAL, "route" => self.route.clone()).increment(1);
    }

    /// Sets the headers that tell the upstream where the request came from, with
    /// `trusted_proxies` semantics: a client's own `X-Forwarded-For` and `Forwarded` are
    /// passed on only when its TCP peer is a trusted proxy (and then the peer is appended),
    /// otherwise they are replaced by the peer; `X-Real-IP` is always replaced by the
    /// client address the gateway's `ip` key is computed from. So an upstream that trusts the gateway
    /// never reads an address a client chose.
    fn set_forwarding_headers(&self, headers: &mut HeaderMap, peer: IpAddr) {
        let peer = peer.to_canonical();
        let client = self.client_ip.client_ip(peer, headers);
        let from_trusted_proxy = self
            .settings
            .trusted_proxies
            .iter()
            .any(|net| net.contains(&peer));
        if !from_trusted_proxy {
            remove_forwarding_headers(headers);
        }
        let mut item = Item::new();
        item.address(peer);
        append_to_list(headers, X_FORWARDED_FOR, item.as_str());
        item.forwarded_for(peer);
        append_to_list(headers, FORWARDED, item.as_str());
        item.address(client);
        headers.insert(X_REAL_IP, item.value());
    }

    /// The request's URI as the upstream gets it: origin-form (the path, behind the
    /// upstream's base path, and the query), as HTTP/1.1 sends it to a server.
    fn upstream_uri(&self, uri: &Uri) -> Result<Uri, http::Error> {
        let base = &self.upstream.base_path;
        if base.is_empty() && uri.scheme().is_none() && uri.authority().is_none() {
            // Already origin-form (the dispatcher made it so): nothing to build.
            if let Some(path_and_query) = uri.path_and_query() {
                return Ok(Uri::from(path_and_query.clone()));
            }
        }
        let mut path_and_query = String::with_capacity(base.len() + uri.path().len() + 16);
        path_and_query.push_str(base);
        path_and_query.push_str(uri.path());
        if let Some(query) = uri.query() {
            path_and_query.push('?');
            path_and_query.push_str(query);
        }
        Ok(Uri::from(PathAndQuery::try_from(path_and_query)?))
    }
}

/// Whether the request's `Host` may be forwarded: one, a valid authority, and present in
/// HTTP/1.1 (RFC 9112 section 3.2: otherwise 400). An upstream and the gateway could
/// otherwise each read a different one of two.
fn host_is_valid(headers: &HeaderMap, version: Version) -> bool {
    let mut hosts = headers.get_all(header::HOST).iter();
    match (hosts.next(), hosts.next()) {
        (None, _) => version != Version::HTTP_11,
        (Some(host), None) => {
            plain_authority(host.as_bytes())
                || host.to_str().is_ok_and(|host| {
                    !host.contains('@')
                        && host.parse::<Authority>().is_ok_and(|a| a.as_str() == host)
                })
        }
        (Some(_), Some(_)) => false,
    }
}

/// Whether `host` is a name or IPv4 address with an optional port (`example.com`,
/// `127.0.0.1:8080`): an authority as [`host_is_valid`] wants it, told without parsing
/// one (which copies it). Anything else is checked by parsing.
fn plain_authority(host: &[u8]) -> bool {
    let (name, port) = match host.iter().position(|&b| b == b':') {
        Some(colon) => (&host[..colon], Some(&host[colon + 1..])),
        None => (host, None),
    };
    !name.is_empty()
        && name
            .iter()
            .all(|&b| b.is_ascii_alphanumeric() || b == b'.' || b == b'-')
        && port.is_none_or(|port| !port.is_empty() && port.iter().all(u8::is_ascii_digit))
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
const HOP_BY_HOP: [HeaderName; 9] = [
    CONNECTION,
    HeaderName::from_static("proxy-connection"),
    HeaderName::from_static("keep-alive"),
    header::PROXY_AUTHENTICATE,
    header::PROXY_AUTHORIZATION,
    header::TE,
    header::TRAILER,
    header::TRANSFER_ENCODING,
    header::UPGRADE,
];

fn remove_hop_by_hop(headers: &mut HeaderMap) {
    // Most messages carry none but `Connection: keep-alive`: one look at each name, no
    // allocation, and a removal only of what is there.
    let mut named: Vec<HeaderName> = Vec::new();
    for value in headers.get_all(CONNECTION) {
        let Ok(value) = value.to_str() else { continue };
        for name in value.split(',') {
            let name = name.trim();
            // The forwarding headers are the gateway's own to set
            // (`set_forwarding_headers`): a `Connection: X-Forwarded-For` would drop the
            // list the `ip` key read, and the upstream would see the proxy where the
            // limit counted the client. The hop-by-hop ones go below anyway. (Told
            // apart before a `HeaderName` is made: `keep-alive`, the usual one, would
            // be copied.)
            let known = |known: &str| known.eq_ignore_ascii_case(name);
            if HOP_BY_HOP
                .iter()
                .chain(&FORWARDING)
                .any(|h| known(h.as_str()))
            {
                continue;
            }
            let Ok(name) = HeaderName::from_bytes(name.as_bytes()) else {
                continue;
            };
            if headers.contains_key(&name) {
                named.push(name);
            }
        }
    }
    for name in named {
        headers.remove(name);
    }
    if headers.keys().any(|name| HOP_BY_HOP.contains(name)) {
        for name in HOP_BY_HOP {
            headers.remove(name);
        }
    }
}

const X_FORWARDED_FOR: HeaderName = HeaderName::from_static("x-forwarded-for");
const FORWARDED: HeaderName = header::FORWARDED;
const X_REAL_IP: HeaderName = HeaderName::from_static("x-real-ip");

/// The headers through which a client could claim another address.
const FORWARDING: [HeaderName; 3] = [X_FORWARDED_FOR, FORWARDED, X_REAL_IP];

/// Drops every header through which a client could claim another address.
fn remove_forwarding_headers(headers: &mut HeaderMap) {
    for name in FORWARDING {
        headers.remove(name);
    }
}

/// Drops the underscore spellings of the forwarding headers (`X_Real_IP`,
/// `X_Forwarded_For`): CGI and WSGI servers turn both `-` and `_` into `_`, so an upstream
/// there would read a client's `X_Real_IP` as `X-Real-IP`. No proxy sends them.
fn remove_underscore_spellings(headers: &mut HeaderMap) {
    let spelled: Vec<HeaderName> = headers
        .keys()
        .filter(|name| {
            name.as_str().contains('_')
                && FORWARDING
                    .iter()
                    .any(|f| f.as_str() == name.as_str().replace('_', "-"))
        })
        .cloned()
        .collect();
    for name in spelled {
        headers.remove(name);
    }
}

/// Appends `item` to the comma-separated list in `name`, joining repeated headers into one
/// list, as every proxy does: upstreams read it from the right (see
/// `tollgate::key::ClientIp`).
fn append_to_list(headers: &mut HeaderMap, name: HeaderName, item: &str) {
    let mut list = String::new();
    for value in headers.get_all(&name) {
        let Ok(value) = value.to_str() else { continue };
        let value = value.trim();
        if value.is_empty() {
            continue;
        }
        if list.is_empty() {
            list.reserve(value.len() + 2 + item.len());
        } else {
            list.push_str(", ");
        }
        list.push_str(value);
    }
    if list.is_empty() {
        // The usual case (no list from a trusted proxy): the item alone.
        headers.insert(name, header_value(item));
        return;
    }
    list.push_str(", ");
    list.push_str(item);
    // The parts were header values already and `item` is an address: always valid; fall
    // back to the item alone rather than forward a list that could not be extended.
    let value = HeaderValue::try_from(list).unwrap_or_else(|_| header_value(item));
    headers.insert(name, value);
}

/// `item` (an address, or a `Forwarded` element of one) as a header value.
fn header_value(item: &str) -> HeaderValue {
    HeaderValue::from_str(item).unwrap_or(HeaderValue::from_static("unknown"))
}

/// A forwarding header's item, written into a buffer on the stack: an address prints in
/// at most 45 bytes (`ffff:...` with an IPv4 tail), `for="[...]"` around it in 54.
struct Item {
    buf: [u8; 64],
    len: usize,
}

impl Item {
    fn new() -> Self {
        Self {
            buf: [0; 64],
            len: 0,
        }
    }

    /// `ip` as it prints: `192.0.2.7`, `2001:db8::1`.
    fn address(&mut self, ip: IpAddr) {
        match ip {
            IpAddr::V4(v4) => {
                self.len = 0;
                self.push_v4(v4);
            }
            IpAddr::V6(v6) => self.write(format_args!("{v6}")),
        }
    }

    /// One RFC 7239 `Forwarded` element for `ip`: `for=192.0.2.7`, `for="[2001:db8::1]"`.
    fn forwarded_for(&mut self, ip: IpAddr) {
        match ip {
            IpAddr::V4(v4) => {
                self.buf[..4].copy_from_slice(b"for=");
                self.len = 4;
                self.push_v4(v4);
            }
            IpAddr::V6(v6) => self.write(format_args!("for=\"[{v6}]\"")),
        }
    }

    /// Appends `v4` as `Display` prints it, without the formatting machinery (three
    /// addresses a request).
    fn push_v4(&mut self, v4: std::net::Ipv4Addr) {
        for (i, octet) in v4.octets().into_iter().enumerate() {
            if i > 0 {
                self.buf[self.len] = b'.';
                self.len += 1;
            }
            if octet >= 100 {
                self.buf[self.len] = b'0' + octet / 100;
                self.len += 1;
            }
            if octet >= 10 {
                self.buf[self.len] = b'0' + octet / 10 % 10;
                self.len += 1;
            }
            self.buf[self.len] = b'0' + octet % 10;
            self.len += 1;
        }
    }

    fn write(&mut self, args: std::fmt::Arguments<'_>) {
        use std::io::Write as _;
        let mut cursor = std::io::Cursor::new(&mut self.buf[..]);
        // 64 bytes hold every address: cannot fail (an error would leave it shorter).
        let _ = cursor.write_fmt(args);
        self.len = cursor.position() as usize;
    }

    fn as_str(&self) -> &str {
        // Written from `Display` of addresses and ASCII: UTF-8.
        std::str::from_utf8(&self.buf[..self.len]).unwrap_or("unknown")
    }

    fn value(&self) -> HeaderValue {
        header_value(self.as_str())
    }
}

/// One RFC 7239 `Forwarded` element for `ip`: `for=192.0.2.7`, `for="[2001:db8::1]"`.
#[cfg(test)]
fn forwarded_for(ip: IpAddr) -> String {
    let mut item = Item::new();
    item.forwarded_for(ip);
    item.as_str().to_owned()
}

/// Whether an error of type `E` caused `error`. The request body's own errors show so:
/// `LengthLimitError` when it passed `server.max_body_bytes` (the body's `Limited`,
/// `server::Front`), `axum::Error` when the client's body broke (a malformed
/// chunk, oversized trailers, a hang-up mid-body); an upstream's failures are hyper's and
/// I/O errors.
fn in_the_chain<E: std::error::Error + 'static>(error: &(dyn std::error::Error + 'static)) -> bool {
    let mut source = Some(error);
    while let Some(error) = source {
        if error.is::<E>() {
            return true;
        }
        source = error.source();
    }
    false
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
    fn items_are_appended_to_one_list() {
        let mut headers = HeaderMap::new();
        append_to_list(&mut headers, X_FORWARDED_FOR, "192.0.2.7");
        assert_eq!(headers["x-forwarded-for"], "192.0.2.7");
        let mut headers = HeaderMap::new();
        headers.append(
            "x-forwarded-for",
            HeaderValue::from_static("1.1.1.1, 2.2.2.2"),
        );
        headers.append("x-forwarded-for", HeaderValue::from_static("3.3.3.3"));
        append_to_list(&mut headers, X_FORWARDED_FOR, "192.0.2.7");
        assert_eq!(
            headers["x-forwarded-for"],
            "1.1.1.1, 2.2.2.2, 3.3.3.3, 192.0.2.7"
        );
        assert_eq!(headers.get_all("x-forwarded-for").iter().count(), 1);
    }

    #[test]
    fn ipv4_items_print_as_display_does() {
        for ip in [
            "0.0.0.0",
            "9.10.99.100",
            "192.0.2.7",
            "255.255.255.255",
            "10.0.200.1",
        ] {
            let ip: IpAddr = ip.parse().unwrap();
            let mut item = Item::new();
            item.address(ip);
            assert_eq!(item.as_str(), ip.to_string());
            item.forwarded_for(ip);
            assert_eq!(item.as_str(), format!("for={ip}"));
        }
    }

    #[test]
    fn plain_authorities_are_the_ones_the_parser_takes_as_they_are() {
        for host in [
            "example.com",
            "127.0.0.1:8080",
            "a-b.c:1",
            "x",
            "localhost:65535",
        ] {
            assert!(plain_authority(host.as_bytes()), "{host}");
            assert!(host.parse::<Authority>().is_ok_and(|a| a.as_str() == host));
        }
        for host in [
            "", ":80", "a:", "a:b", "[::1]:80", "a@b", "a b", "a/b", "a:1:2", "é",
        ] {
            assert!(!plain_authority(host.as_bytes()), "{host}");
        }
    }

    #[test]
    fn forwarded_elements_quote_ipv6() {
        assert_eq!(forwarded_for("192.0.2.7".parse().unwrap()), "for=192.0.2.7");
        assert_eq!(
            forwarded_for("2001:db8::1".parse().unwrap()),
            "for=\"[2001:db8::1]\""
        );
    }
}
