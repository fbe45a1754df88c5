use std::{
    net::{IpAddr, Ipv6Addr, SocketAddr},
    sync::{
        Arc,
        atomic::{AtomicBool, Ordering},
    },
};

use compact_str::format_compact;
use http::{HeaderMap, Request};
use ipnet::IpNet;

use super::{Key, KeyError, KeyExtractor};

/// The default IPv6 grouping: one key per /64, the block a single host usually gets (an
/// attacker who owns a /64 can otherwise pick a fresh address for every request).
pub const DEFAULT_IPV6_PREFIX: u8 = 64;

/// The TCP peer's IP address.
///
/// **Behind a reverse proxy or load balancer this is the proxy's address, so every client
/// shares one budget: use [`ClientIp`] with the proxies' addresses instead.**
///
/// The address is read from the request extensions: axum's `ConnectInfo<SocketAddr>`
/// (serve with `into_make_service_with_connect_info::<SocketAddr>()`), axum's
/// `MockConnectInfo<SocketAddr>` (tests), tonic's `TcpConnectInfo` (feature `tonic`;
/// `tonic::transport::Server` adds it to every request before its layers run), or a plain
/// `SocketAddr` extension. IPv4-mapped IPv6 addresses count as IPv4, and IPv6 addresses are
/// grouped by prefix ([`DEFAULT_IPV6_PREFIX`] bits).
///
/// tonic's TLS transport wraps the address in `TlsConnectInfo<TcpConnectInfo>`, which this
/// extractor does not read: key such servers with a closure that reads it, or insert the
/// `SocketAddr` in a layer in front of this one.
///
/// Without an address (a server not set up as above) every request has no key: the
/// default rejection answers 500 with a body naming the fix, and the extractor logs one
/// warning (once per extractor and its clones, so once per layer).
#[derive(Debug, Clone)]
pub struct PeerIp {
    ipv6_prefix: u8,
    no_peer: NoPeerWarning,
}

impl PeerIp {
    /// Keys requests by the peer address.
    pub fn new() -> Self {
        Self {
            ipv6_prefix: DEFAULT_IPV6_PREFIX,
            no_peer: NoPeerWarning::default(),
        }
    }

    /// Groups IPv6 clients by their first `bits` bits (1 to 128; 128 keys every address
    /// separately). Values above 128 are treated as 128.
    pub fn with_ipv6_prefix(mut self, bits: u8) -> Self {
        self.ipv6_prefix = bits.clamp(1, 128);
        self
    }
}

impl Default for PeerIp {
    fn default() -> Self {
        Self::new()
    }
}

impl<B> KeyExtractor<B> for PeerIp {
    fn extract(&self, request: &Request<B>) -> Result<Key, KeyError> {
        let peer = peer_addr(request).ok_or_else(|| self.no_peer.error())?;
        Ok(ip_key(peer, self.ipv6_prefix))
    }

    fn key_for(&self, value: &str) -> Result<Key, KeyError> {
        Ok(ip_key(parse_ip(value)?, self.ipv6_prefix))
    }
}

/// A client address an admin typed.
fn parse_ip(value: &str) -> Result<IpAddr, KeyError> {
    value
        .trim()
        .parse()
        .map_err(|_| KeyError::new(format!("not an IP address: {value:?}")))
}

/// Which header carries the proxies' record of the client address.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
#[non_exhaustive]
pub enum ForwardedHeader {
    /// `X-Forwarded-For: client, proxy1, proxy2` (the de-facto standard).
    #[default]
    XForwardedFor,
    /// RFC 7239 `Forwarded: for=client, for=proxy1`.
    Forwarded,
}

/// The client's IP address behind trusted reverse proxies.
///
/// The forwarding header is believed only when the TCP peer is one of the trusted proxies,
/// and then it is read **from the right**: each address that belongs to a trusted proxy is
/// skipped, and the first one that does not is the client. The leftmost entries are written
/// by the client itself, so a client that is not behind a trusted proxy, or that sends its
/// own header through one, cannot choose its key.
///
/// Only one header is read (X-Forwarded-For by default): make sure your proxies set that
/// one. A malformed entry stops the walk at the last address a trusted proxy vouched for.
///
/// The TCP peer is read as [`PeerIp`] reads it, and a missing one is answered and logged
/// the same way. Both extractors put keys in the `ip` namespace: they name the same thing.
///
/// ```
/// use std::net::SocketAddr;
/// use http::Request;
/// use tollgate::key::{ClientIp, KeyExtractor};
///
/// let key = ClientIp::new(["10.0.0.0/8".parse()?]);
/// let mut req = Request::get("/")
///     .header("x-forwarded-for", "6.6.6.6, 203.0.113.9, 10.0.0.2")
///     .body(())?;
/// req.extensions_mut().insert("10.0.0.1:4000".parse::<SocketAddr>()?);
/// assert_eq!(key.extract(&req)?.as_str(), "ip|203.0.113.9");
/// # Ok::<(), Box<dyn std::error::Error>>(())
/// ```
#[derive(Debug, Clone)]
pub struct ClientIp {
    trusted: Vec<IpNet>,
    header: ForwardedHeader,
    ipv6_prefix: u8,
    no_peer: NoPeerWarning,
}

impl ClientIp {
    /// Believes forwarding headers from peers in `trusted` (CIDRs).
    pub fn new(trusted: impl IntoIterator<Item = IpNet>) -> Self {
        Self {
            trusted: trusted.into_iter().map(|net| net.trunc()).collect(),
            header: ForwardedHeader::default(),
            ipv6_prefix: DEFAULT_IPV6_PREFIX,
            no_peer: NoPeerWarning::default(),
        }
    }

    /// Reads `header` instead of X-Forwarded-For.
    pub fn with_header(mut self, header: ForwardedHeader) -> Self {
        self.header = header;
        self
    }

    /// Groups IPv6 clients by their first `bits` bits; see [`PeerIp::with_ipv6_prefix`].
    pub fn with_ipv6_prefix(mut self, bits: u8) -> Self {
        self.ipv6_prefix = bits.clamp(1, 128);
        self
    }

    fn is_trusted(&self, ip: IpAddr) -> bool {
        self.trusted.iter().any(|net| net.contains(&ip))
    }

    /// The client address for a request from `peer` with `headers`.
    pub fn client_ip(&self, peer: IpAddr, headers: &HeaderMap) -> IpAddr {
        let mut client = canonical(peer);
        if !self.is_trusted(client) {
            return client;
        }
        let hops = match self.header {
            ForwardedHeader::XForwardedFor => {
                forwarded_hops(headers, "x-forwarded-for", parse_xff_entry)
            }
            ForwardedHeader::Forwarded => {
                forwarded_hops(headers, "forwarded", parse_forwarded_element)
            }
        };
        for hop in hops.into_iter().rev() {
            let Some(ip) = hop else {
                // A trusted proxy vouched for `client`; what it forwarded is unreadable.
                return client;
            };
            client = canonical(ip);
            if !self.is_trusted(client) {
                return client;
            }
        }
        client
    }
}

impl<B> KeyExtractor<B> for ClientIp {
    fn extract(&self, request: &Request<B>) -> Result<Key, KeyError> {
        let peer = peer_addr(request).ok_or_else(|| self.no_peer.error())?;
        Ok(ip_key(
            self.client_ip(peer, request.headers()),
            self.ipv6_prefix,
        ))
    }

    /// `value` is the client's address (not a proxy's).
    fn key_for(&self, value: &str) -> Result<Key, KeyError> {
        Ok(ip_key(parse_ip(value)?, self.ipv6_prefix))
    }
}

/// What a server without peer addresses is told: the fix, in the rejection's body.
const NO_PEER: &str = "tollgate: no client address: serve with \
    into_make_service_with_connect_info::<SocketAddr>() (axum), enable tollgate's `tonic` \
    feature (tonic), insert a SocketAddr extension, or choose another key";

/// Warns once (per extractor and its clones) that requests carry no peer address: the
/// server is set up wrong and every request is rejected (or, with `MissingKey::Allow`,
/// unlimited), which a debug line per request would hide.
#[derive(Debug, Clone, Default)]
struct NoPeerWarning {
    warned: Arc<AtomicBool>,
}

impl NoPeerWarning {
    fn error(&self) -> KeyError {
        if !self.warned.swap(true, Ordering::Relaxed) {
            tracing::warn!("{NO_PEER}");
        }
        KeyError::misconfigured(NO_PEER)
    }
}

fn peer_addr<B>(request: &Request<B>) -> Option<IpAddr> {
    let extensions = request.extensions();
    #[cfg(feature = "axum")]
    if let Some(info) = extensions.get::<axum::extract::ConnectInfo<SocketAddr>>() {
        return Some(info.0.ip());
    }
    #[cfg(feature = "axum")]
    if let Some(mock) = extensions.get::<axum::extract::connect_info::MockConnectInfo<SocketAddr>>()
    {
        return Some(mock.0.ip());
    }
    #[cfg(feature = "tonic")]
    if let Some(addr) = extensions
        .get::<tonic::transport::server::TcpConnectInfo>()
        .and_then(|info| info.remote_addr())
    {
        return Some(addr.ip());
    }
    if let Some(addr) = extensions.get::<SocketAddr>() {
        return Some(addr.ip());
    }
    None
}

fn canonical(ip: IpAddr) -> IpAddr {
    match ip {
        IpAddr::V6(v6) => v6.to_ipv4_mapped().map_or(ip, IpAddr::V4),
        v4 => v4,
    }
}

fn ip_key(ip: IpAddr, ipv6_prefix: u8) -> Key {
    // Addresses print as digits, hex letters, `.`, `:` and `/`: key-safe, no escaping,
    // and an IPv4 key (`ip|` and at most 15 bytes) is short enough to stay inline.
    Key::from_safe(match canonical(ip) {
        IpAddr::V4(v4) => format_compact!("ip|{v4}"),
        IpAddr::V6(v6) if ipv6_prefix >= 128 => format_compact!("ip|{v6}"),
        IpAddr::V6(v6) => {
            let mask = u128::MAX << (128 - u32::from(ipv6_prefix));
            let network = Ipv6Addr::from(u128::from(v6) & mask);
            format_compact!("ip|{network}/{ipv6_prefix}")
        }
    })
}

/// Every entry of every instance of `name`, in order; `None` for an unreadable entry.
fn forwarded_hops(
    headers: &HeaderMap,
    name: &str,
    parse: fn(&str) -> Option<IpAddr>,
) -> Vec<Option<IpAddr>> {
    let mut hops = Vec::new();
    for value in headers.get_all(name) {
        match value.to_str() {
            Ok(value) => hops.extend(value.split(',').map(|entry| parse(entry.trim()))),
            Err(_) => hops.push(None),
        }
    }
    hops
}

/// `1.2.3.4`, `1.2.3.4:80`, `2001:db8::1`, `[2001:db8::1]:80`.
fn parse_xff_entry(entry: &str) -> Option<IpAddr> {
    parse_node(entry)
}

fn parse_node(node: &str) -> Option<IpAddr> {
    if let Ok(ip) = node.parse::<IpAddr>() {
        return Some(ip);
    }
    if let Ok(addr) = node.parse::<SocketAddr>() {
        return Some(addr.ip());
    }
    // `[2001:db8::1]` without a port.
    node.strip_prefix('[')?
        .strip_suffix(']')?
        .parse::<Ipv6Addr>()
        .ok()
        .map(IpAddr::V6)
}

/// One `Forwarded` element: `for=192.0.2.1;proto=https` or `for="[2001:db8::1]:80"`.
fn parse_forwarded_element(element: &str) -> Option<IpAddr> {
    let value = element.split(';').find_map(|pair| {
        let (name, value) = pair.trim().split_once('=')?;
        name.trim()
            .eq_ignore_ascii_case("for")
            .then_some(value.trim())
    })?;
    let value = value
        .strip_prefix('"')
        .and_then(|v| v.strip_suffix('"'))
        .unwrap_or(value);
    parse_node(value)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn client(trusted: &[&str], peer: &str, xff: &[&str]) -> String {
        let key = ClientIp::new(trusted.iter().map(|n| n.parse().unwrap()));
        let mut req = Request::get("/");
        for value in xff {
            req = req.header("x-forwarded-for", *value);
        }
        let mut req = req.body(()).unwrap();
        req.extensions_mut()
            .insert(peer.parse::<SocketAddr>().unwrap());
        let key = key.extract(&req).unwrap();
        key.as_str().strip_prefix("ip|").unwrap().to_owned()
    }

    #[test]
    fn untrusted_peers_cannot_choose_their_key() {
        assert_eq!(
            client(&["10.0.0.0/8"], "6.6.6.6:1", &["1.1.1.1"]),
            "6.6.6.6"
        );
        assert_eq!(client(&[], "6.6.6.6:1", &["1.1.1.1"]), "6.6.6.6");
    }

    #[test]
    fn walks_from_the_right_skipping_trusted_hops() {
        let trusted = ["10.0.0.0/8", "192.168.0.0/16"];
        assert_eq!(
            client(&trusted, "10.0.0.1:1", &["9.9.9.9, 8.8.8.8, 192.168.1.1"]),
            "8.8.8.8"
        );
        // Repeated headers are one list, in order.
        assert_eq!(
            client(&trusted, "10.0.0.1:1", &["9.9.9.9", "8.8.8.8", "10.1.1.1"]),
            "8.8.8.8"
        );
        // All trusted: the leftmost.
        assert_eq!(client(&trusted, "10.0.0.1:1", &["10.2.2.2"]), "10.2.2.2");
        // No header: the proxy itself.
        assert_eq!(client(&trusted, "10.0.0.1:1", &[]), "10.0.0.1");
    }

    #[test]
    fn malformed_entries_stop_at_the_last_vouched_address() {
        let trusted = ["10.0.0.0/8"];
        assert_eq!(
            client(&trusted, "10.0.0.1:1", &["1.1.1.1, garbage"]),
            "10.0.0.1"
        );
        assert_eq!(
            client(&trusted, "10.0.0.1:1", &["1.1.1.1, 10.0.0.5, ,"]),
            "10.0.0.1"
        );
        assert_eq!(
            client(&trusted, "10.0.0.1:1", &["[2001:db8::1]:443"]),
            "2001:db8::/64"
        );
        assert_eq!(client(&trusted, "10.0.0.1:1", &["5.5.5.5:8080"]), "5.5.5.5");
    }

    #[test]
    fn forwarded_header_is_parsed() {
        let key =
            ClientIp::new(["10.0.0.0/8".parse().unwrap()]).with_header(ForwardedHeader::Forwarded);
        let mut req = Request::get("/")
            .header(
                "forwarded",
                r#"for=6.6.6.6, for="[2001:db8:cafe::17]:4711";proto=https, For=10.0.0.3"#,
            )
            .body(())
            .unwrap();
        req.extensions_mut()
            .insert("10.0.0.1:1".parse::<SocketAddr>().unwrap());
        assert_eq!(key.extract(&req).unwrap().as_str(), "ip|2001:db8:cafe::/64");
    }

    #[test]
    fn ipv6_grouping_and_mapped_ipv4() {
        let v6: IpAddr = "2001:db8:1:2:3:4:5:6".parse().unwrap();
        assert_eq!(ip_key(v6, 64).as_str(), "ip|2001:db8:1:2::/64");
        assert_eq!(ip_key(v6, 56).as_str(), "ip|2001:db8:1::/56");
        assert_eq!(ip_key(v6, 128).as_str(), "ip|2001:db8:1:2:3:4:5:6");
        let mapped: IpAddr = "::ffff:1.2.3.4".parse().unwrap();
        assert_eq!(ip_key(mapped, 64).as_str(), "ip|1.2.3.4");
    }

    #[cfg(feature = "tonic")]
    #[test]
    fn tonic_connect_info_is_the_peer() {
        use tonic::transport::server::{Connected, TcpConnectInfo};

        // `TcpConnectInfo` has private fields: make it the way tonic does, from a stream.
        let runtime = tokio::runtime::Builder::new_current_thread()
            .enable_io()
            .build()
            .unwrap();
        let info: TcpConnectInfo = runtime.block_on(async {
            let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
            let addr = listener.local_addr().unwrap();
            let (_client, accepted) = tokio::join!(tokio::net::TcpStream::connect(addr), async {
                listener.accept().await.unwrap().0
            });
            accepted.connect_info()
        });
        let mut req = Request::get("/").body(()).unwrap();
        req.extensions_mut().insert(info);
        assert_eq!(
            PeerIp::new().extract(&req).unwrap().as_str(),
            "ip|127.0.0.1"
        );
        assert_eq!(
            ClientIp::new([]).extract(&req).unwrap().as_str(),
            "ip|127.0.0.1"
        );
    }

    #[test]
    fn missing_peer_is_an_error_not_a_panic() {
        let req = Request::get("/").body(()).unwrap();
        let error = PeerIp::new().extract(&req).unwrap_err();
        assert!(error.is_misconfigured());
        assert!(
            error
                .to_string()
                .contains("into_make_service_with_connect_info")
        );
        assert!(
            ClientIp::new([])
                .extract(&req)
                .unwrap_err()
                .is_misconfigured()
        );
    }

    #[test]
    fn ip_keys_are_in_the_ip_namespace_and_inline() {
        let widest: IpAddr = "255.255.255.255".parse().unwrap();
        let key = ip_key(widest, 64);
        assert_eq!(key.namespace(), "ip");
        assert!(!key.0.is_heap_allocated(), "{key}");
    }
}
