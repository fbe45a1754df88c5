//! The properties that the fuzz targets (`fuzz/`) and `tests/hostile.rs` check alike,
//! written once: each file includes this one (`#[path]` from the fuzz crate).

#![allow(dead_code, unreachable_pub)]

use std::net::{IpAddr, Ipv6Addr, SocketAddr};

use http::{HeaderMap, Request};
use tollgate::key::{Key, KeyExtractor, MAX_KEY_LEN, PeerIp};

/// Sets of trusted proxies, some written carelessly.
pub const TRUSTED: &[&[&str]] = &[
    &[],
    &["10.0.0.0/8"],
    &[
        "10.0.0.0/8",
        "192.168.0.0/16",
        "127.0.0.1/32",
        "::1/128",
        "2001:db8::/32",
    ],
    &["0.0.0.0/0", "::/0"],
    // Not truncated, and IPv4-mapped: what a careless config may say.
    &["10.1.2.3/8", "::ffff:10.0.0.0/104"],
    &["fe80::/10", "172.16.0.0/12"],
];

/// Addresses that matter: private, loopback, mapped, unspecified, documentation.
pub const POOL: &[&str] = &[
    "10.0.0.1",
    "::ffff:10.0.0.1",
    "192.168.1.1",
    "127.0.0.1",
    "::1",
    "2001:db8::1",
    "2001:db8:ffff:ffff:ffff:ffff:ffff:ffff",
    "6.6.6.6",
    "fe80::1",
    "172.16.0.9",
    "0.0.0.0",
    "::",
];

/// The bytes a key's value that was not hashed stands for (`~` is the empty value).
pub fn decode(value: &str) -> Option<Vec<u8>> {
    if value.starts_with('#') {
        return None;
    }
    if value == "~" {
        return Some(Vec::new());
    }
    let bytes = value.as_bytes();
    let mut out = Vec::with_capacity(bytes.len());
    let mut i = 0;
    while i < bytes.len() {
        if bytes[i] == b'%' {
            let hex = std::str::from_utf8(&bytes[i + 1..i + 3]).unwrap();
            out.push(u8::from_str_radix(hex, 16).unwrap());
            i += 3;
        } else {
            out.push(bytes[i]);
            i += 1;
        }
    }
    Some(out)
}

/// `Key::new(input)`, checked with [`check_encoded`] in the `custom` namespace.
#[track_caller]
pub fn check_key(input: &[u8]) -> Key {
    let key = Key::new(input);
    check_encoded(&key, "custom", input);
    // Deterministic.
    assert_eq!(Key::new(input), key);
    key
}

/// `key` is `input` in `namespace`: bounded, key-safe, one `|` ending the namespace, and
/// a readable value decodes back to its input (so two inputs never share a key unless
/// both were hashed).
#[track_caller]
pub fn check_encoded(key: &Key, namespace: &str, input: &[u8]) {
    let s = key.as_str();
    assert!(s.len() <= MAX_KEY_LEN, "{} bytes: {s:?}", s.len());
    assert!(
        s.bytes()
            .all(|b| b.is_ascii_graphic() && b != b'{' && b != b'}'),
        "unsafe byte in {s:?}"
    );
    let (ns, value) = s
        .split_once('|')
        .unwrap_or_else(|| panic!("no namespace: {s:?}"));
    assert_eq!(ns, namespace, "{s:?}");
    assert_eq!(key.namespace(), namespace);
    assert!(!value.is_empty() && !value.contains('|'), "{s:?}");
    match decode(value) {
        // Readable keys decode back to the input: that is what makes them injective.
        Some(decoded) => assert_eq!(decoded, input, "{s:?}"),
        None => {
            assert_eq!(value.len(), 33, "{s:?}");
            assert!(value[1..].bytes().all(|b| b.is_ascii_hexdigit()), "{s:?}");
            // Hashed only when the readable form would be too long.
            assert!(
                ns.len() + 1 + input.len() * 3 > MAX_KEY_LEN,
                "{} input bytes hashed",
                input.len()
            );
        }
    }
}

/// `key` is `input` sent in the header `name`: in the namespace `header:<name>`, the name
/// encoded like a value (or hashed, when the namespace would exceed 64 bytes).
#[track_caller]
pub fn check_header_key(key: &Key, name: &str, input: &[u8]) {
    let encoded = Key::new(name);
    let encoded = encoded.as_str().strip_prefix("custom|").unwrap();
    let namespace = format!("header:{encoded}");
    if namespace.len() <= 64 {
        check_encoded(key, &namespace, input);
    } else {
        let hashed = key.namespace().strip_prefix("header:#").unwrap();
        assert_eq!(hashed.len(), 32, "{key:?}");
        check_encoded(key, key.namespace(), input);
    }
}

/// Whether `key`'s value is hashed (a long one).
pub fn is_hashed(key: &Key) -> bool {
    key.as_str()
        .split_once('|')
        .is_some_and(|(_, value)| value.starts_with('#'))
}

pub fn canonical(ip: IpAddr) -> IpAddr {
    match ip {
        IpAddr::V6(v6) => v6.to_ipv4_mapped().map_or(ip, IpAddr::V4),
        v4 => v4,
    }
}

/// Every address written anywhere in `headers` (a superset of what the parsers read):
/// tokens between `,` `;` `=` `"` and white space, as an address, a socket address or a
/// bracketed IPv6 address.
pub fn named(headers: &HeaderMap) -> Vec<IpAddr> {
    let mut ips = Vec::new();
    for value in headers.values() {
        let text = String::from_utf8_lossy(value.as_bytes());
        for token in text.split(|c: char| matches!(c, ',' | ';' | '=' | '"') || c.is_whitespace()) {
            let ip = token
                .parse::<IpAddr>()
                .ok()
                .or_else(|| token.parse::<SocketAddr>().ok().map(|a| a.ip()))
                .or_else(|| {
                    let inner = token.strip_prefix('[')?.strip_suffix(']')?;
                    inner.parse::<Ipv6Addr>().ok().map(IpAddr::V6)
                });
            ips.extend(ip.map(canonical));
        }
    }
    ips
}

/// The key `PeerIp` gives a request from `ip`.
pub fn peer_key(ip: IpAddr, prefix: u8) -> Key {
    let mut req = Request::new(());
    req.extensions_mut().insert(SocketAddr::new(ip, 1));
    PeerIp::new()
        .with_ipv6_prefix(prefix)
        .extract(&req)
        .unwrap()
}

/// An IPv4 address, an IPv6 address (prefix 128) or an IPv6 network of `prefix` bits, in
/// the `ip` namespace.
#[track_caller]
pub fn check_ip_key(key: &Key, prefix: u8) {
    let s = key
        .as_str()
        .strip_prefix("ip|")
        .unwrap_or_else(|| panic!("not in the ip namespace: {key:?}"));
    let prefix = prefix.clamp(1, 128);
    match s.split_once('/') {
        Some((net, bits)) => {
            let net: Ipv6Addr = net.parse().unwrap_or_else(|_| panic!("{s:?}"));
            let bits: u8 = bits.parse().unwrap_or_else(|_| panic!("{s:?}"));
            assert_eq!(bits, prefix, "{s:?}");
            assert!(bits < 128, "{s:?}");
            let host_bits = u128::MAX >> bits;
            assert_eq!(u128::from(net) & host_bits, 0, "host bits in {s:?}");
        }
        None => match s.parse::<IpAddr>() {
            Ok(IpAddr::V4(_)) => {}
            Ok(IpAddr::V6(v6)) => {
                assert_eq!(prefix, 128, "{s:?}");
                assert!(v6.to_ipv4_mapped().is_none(), "mapped {s:?}");
            }
            Err(_) => panic!("not an IP key: {s:?}"),
        },
    }
}
