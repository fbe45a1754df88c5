//! `ClientIp` over arbitrary X-Forwarded-For / Forwarded values, peers and trusted sets.
//!
//! Never panics; the key is a valid IP key (an IPv4 address, an IPv6 address, or an IPv6
//! network with the configured prefix), the one `PeerIp` gives for the chosen address; an
//! untrusted peer is its own key whatever it sends; the chosen address is the peer or one
//! written in the headers; the other header and what a client writes in front of the list
//! change nothing once an untrusted hop was found.
#![no_main]

use std::net::{IpAddr, Ipv4Addr, Ipv6Addr, SocketAddr};

use arbitrary::Arbitrary;
use http::{HeaderMap, HeaderValue, Request};
use ipnet::IpNet;
#[path = "../../tests/oracles/mod.rs"]
mod oracles;

use libfuzzer_sys::fuzz_target;
use oracles::{POOL, TRUSTED, canonical, check_ip_key as check_key, named, peer_key};
use tollgate::key::{ClientIp, ForwardedHeader, KeyExtractor};

#[derive(Arbitrary, Debug, Clone, Copy)]
enum Addr {
    Pool(u8),
    V4([u8; 4]),
    V6([u8; 16]),
    Mapped([u8; 4]),
}

impl Addr {
    fn ip(self) -> IpAddr {
        match self {
            Self::Pool(i) => POOL[usize::from(i) % POOL.len()].parse().unwrap(),
            Self::V4(b) => IpAddr::V4(Ipv4Addr::from(b)),
            Self::V6(b) => IpAddr::V6(Ipv6Addr::from(b)),
            Self::Mapped(b) => IpAddr::V6(Ipv4Addr::from(b).to_ipv6_mapped()),
        }
    }
}

/// One entry of a forwarding list, in one of the spellings proxies use (or not).
#[derive(Arbitrary, Debug)]
enum Hop {
    Bare(Addr),
    WithPort(Addr, u16),
    Bracketed(Addr),
    Junk(String),
}

#[derive(Arbitrary, Debug)]
enum Value {
    Raw(Vec<u8>),
    Hops {
        hops: Vec<Hop>,
        /// Written in the other header's syntax when `mismatch % 8 == 0`: `for=` in
        /// X-Forwarded-For, a bare list in Forwarded.
        mismatch: u8,
        quoted: bool,
        params: bool,
        tight: bool,
    },
}

#[derive(Arbitrary, Debug)]
struct Line {
    /// 0: x-forwarded-for, 1: X-Forwarded-For, 2: forwarded, 3: Forwarded.
    name: u8,
    value: Value,
}

#[derive(Arbitrary, Debug)]
struct Input {
    peer: Addr,
    trusted: u8,
    forwarded: bool,
    ipv6_prefix: u8,
    lines: Vec<Line>,
    /// A value a client puts in front of the list.
    injected: Vec<u8>,
}

fn render(hop: &Hop, forwarded: bool, quoted: bool) -> String {
    let text = match *hop {
        Hop::Bare(a) => a.ip().to_string(),
        Hop::WithPort(a, port) => SocketAddr::new(a.ip(), port).to_string(),
        Hop::Bracketed(a) => match a.ip() {
            IpAddr::V6(v6) => format!("[{v6}]"),
            v4 => v4.to_string(),
        },
        Hop::Junk(ref junk) => junk.clone(),
    };
    if forwarded {
        if quoted {
            format!("for=\"{text}\"")
        } else {
            format!("for={text}")
        }
    } else {
        text
    }
}

fuzz_target!(|input: Input| {
    let sets = TRUSTED[usize::from(input.trusted) % TRUSTED.len()];
    let trusted: Vec<IpNet> = sets.iter().map(|n| n.parse().unwrap()).collect();
    let header = if input.forwarded {
        ForwardedHeader::Forwarded
    } else {
        ForwardedHeader::XForwardedFor
    };
    let extractor = ClientIp::new(trusted.iter().copied())
        .header(header)
        .with_ipv6_prefix(input.ipv6_prefix);
    let is_trusted = |ip: IpAddr| trusted.iter().any(|n| n.trunc().contains(&ip));
    let peer = input.peer.ip();

    let mut headers = HeaderMap::new();
    let mut relevant = HeaderMap::new();
    for line in &input.lines {
        let (name, is_forwarded) = match line.name % 4 {
            0 => ("x-forwarded-for", false),
            1 => ("X-Forwarded-For", false),
            2 => ("forwarded", true),
            _ => ("Forwarded", true),
        };
        let bytes = match &line.value {
            Value::Raw(raw) => raw.clone(),
            Value::Hops {
                hops,
                mismatch,
                quoted,
                params,
                tight,
            } => {
                let forwarded_syntax = is_forwarded != (mismatch % 8 == 0);
                let mut parts = Vec::new();
                for hop in hops {
                    let mut part = render(hop, forwarded_syntax, *quoted);
                    if *params {
                        part.push_str(";proto=https;by=_gw");
                    }
                    parts.push(part);
                }
                parts.join(if *tight { "," } else { ", " }).into_bytes()
            }
        };
        let Ok(value) = HeaderValue::from_bytes(&bytes) else {
            continue;
        };
        let name = http::HeaderName::from_bytes(name.as_bytes()).unwrap();
        if is_forwarded == input.forwarded {
            relevant.append(name.clone(), value.clone());
        }
        headers.append(name, value);
    }

    let mut req = Request::new(());
    *req.headers_mut() = headers.clone();
    req.extensions_mut().insert(SocketAddr::new(peer, 4000));
    let key = extractor
        .extract(&req)
        .expect("a request with a peer has a key");
    check_key(&key, input.ipv6_prefix);

    let ip = extractor.client_ip(peer, &headers);
    assert_eq!(ip, canonical(ip), "not canonical: {ip}");
    assert_eq!(key, peer_key(ip, input.ipv6_prefix));
    if !is_trusted(canonical(peer)) {
        assert_eq!(ip, canonical(peer), "an untrusted peer chose its key");
        assert_eq!(key, peer_key(peer, input.ipv6_prefix));
    }
    assert!(
        ip == canonical(peer) || named(&headers).contains(&ip),
        "{ip} came from nowhere"
    );
    // Only the configured header counts.
    assert_eq!(extractor.client_ip(peer, &relevant), ip);
    // Once an untrusted hop is found, what is further left does not matter.
    if !is_trusted(ip)
        && let Ok(injected) = HeaderValue::from_bytes(&input.injected)
    {
        let name = match header {
            ForwardedHeader::Forwarded => "forwarded",
            _ => "x-forwarded-for",
        };
        let mut with = HeaderMap::new();
        with.append(name, injected);
        for (n, v) in &relevant {
            with.append(n, v.clone());
        }
        assert_eq!(
            extractor.client_ip(peer, &with),
            ip,
            "the client chose its key"
        );
    }
});
