//! Hostile input: property tests of the invariants the fuzz targets in `fuzz/` check, so
//! that `cargo test` keeps checking them (the fuzz targets need `cargo fuzz`; see README).
//!
//! - `Key::new`: never panics, at most `MAX_KEY_LEN` bytes, only safe characters, and
//!   injective (a readable key decodes back to its input; a hashed one never equals a
//!   readable one).
//! - `ClientIp`: any X-Forwarded-For / Forwarded values from any peer with any trusted set
//!   give a valid IP key; an untrusted peer is its own key; what a client writes to the
//!   left of the list changes nothing once an untrusted hop was found.
//! - `HeaderKey`: one non-empty value is the key (in the namespace `header:<name>`),
//!   whatever its bytes, size or the case of its name; none, an empty one or a repeated
//!   one is no key.
//! - Namespaces: a header value, closure or extension that spells an IP, `global` or
//!   another header's value never shares state with that other kind of key, on one shared
//!   `MemoryStore` (`tests/redis.rs` and `tests/cluster.rs` run the same scenario).
//!
//! Each property runs 500 to 2000 cases; the whole file takes a few seconds in a debug
//! build. The gateway's config and path normaliser have theirs in
//! `gateway/tests/hostile.rs`.

mod oracles;

use std::net::{IpAddr, Ipv4Addr, Ipv6Addr, SocketAddr};

use http::{HeaderMap, HeaderName, HeaderValue, Request};
use ipnet::IpNet;
use oracles::{
    POOL, TRUSTED, canonical, check_header_key, check_ip_key, check_key, is_hashed, named, peer_key,
};
use proptest::{collection::vec, prelude::*};
use tollgate::key::{ClientIp, ForwardedHeader, HeaderKey, KeyExtractor};
use tollgate_test_support::kinds;

fn config(cases: u32) -> ProptestConfig {
    ProptestConfig {
        cases,
        // A failure is a finding: keep it in the test's output, not in a regressions file.
        failure_persistence: None,
        ..ProptestConfig::default()
    }
}

// ---------------------------------------------------------------------------------------
// Key encoding

/// Bytes that are special to the encoding, to Redis or to logs half of the time, and any
/// byte the other half.
fn hostile_byte() -> impl Strategy<Value = u8> {
    const SPECIAL: &[u8] = b"%{}#~:/ \n\r\0\xff0123456789ABCDEFabcdef";
    any::<u16>().prop_map(|n| {
        let [pick, byte] = n.to_le_bytes();
        if pick < 128 {
            byte
        } else {
            SPECIAL[usize::from(byte) % SPECIAL.len()]
        }
    })
}

/// Around the lengths where the encoding switches to a hash (128 encoded bytes).
fn hostile_bytes() -> impl Strategy<Value = Vec<u8>> {
    prop_oneof![vec(hostile_byte(), 0..50), vec(hostile_byte(), 40..140)]
}

/// `bytes` with every byte percent-encoded: what an attacker would send to collide with
/// the key of `bytes`.
fn percent_encode_all(bytes: &[u8]) -> Vec<u8> {
    bytes
        .iter()
        .flat_map(|b| format!("%{b:02X}").into_bytes())
        .collect()
}

proptest! {
    #![proptest_config(config(1000))]

    #[test]
    fn key_encoding_is_bounded_safe_and_injective(a in hostile_bytes(), b in hostile_bytes()) {
        let (ka, kb) = (check_key(&a), check_key(&b));
        if a != b && !(is_hashed(&ka) && is_hashed(&kb)) {
            prop_assert_ne!(&ka, &kb);
        }
        // The encoded spelling of an input is another input, with another key.
        let encoded = percent_encode_all(&a);
        let ke = check_key(&encoded);
        if encoded != a && !(is_hashed(&ka) && is_hashed(&ke)) {
            prop_assert_ne!(&ka, &ke);
        }
        // So is the key's own text.
        let kk = check_key(ka.as_str().as_bytes());
        if ka.as_str().as_bytes() != a.as_slice() && !(is_hashed(&ka) && is_hashed(&kk)) {
            prop_assert_ne!(&ka, &kk);
        }
    }
}

#[test]
fn huge_keys_are_hashed_and_distinct() {
    for len in [8 * 1024, 64 * 1024] {
        let a = vec![b'{'; len];
        let mut b = a.clone();
        b[len - 1] = b'}';
        let (ka, kb) = (check_key(&a), check_key(&b));
        assert!(is_hashed(&ka) && is_hashed(&kb));
        assert_ne!(ka, kb);
    }
}

/// Layers keyed by different extractors on one shared memory store keep separate budgets.
#[tokio::test]
async fn kinds_of_keys_never_share_state_in_memory() {
    let store = tollgate::store::MemoryStore::new()
        .with_clock(tollgate::clock::ManualClock::new(1_700_000_000_000));
    kinds::kinds_never_share_state(std::sync::Arc::new(store)).await;
}

// ---------------------------------------------------------------------------------------
// ClientIp: X-Forwarded-For and Forwarded

fn addr() -> impl Strategy<Value = IpAddr> {
    prop_oneof![
        3 => prop::sample::select(POOL).prop_map(|s| s.parse().unwrap()),
        1 => any::<[u8; 4]>().prop_map(|b| IpAddr::V4(Ipv4Addr::from(b))),
        1 => any::<[u8; 16]>().prop_map(|b| IpAddr::V6(Ipv6Addr::from(b))),
        1 => any::<[u8; 4]>().prop_map(|b| IpAddr::V6(Ipv4Addr::from(b).to_ipv6_mapped())),
    ]
}

/// One list entry as text: an address in one of the spellings proxies use, or not one.
fn hop() -> impl Strategy<Value = String> {
    prop_oneof![
        6 => addr().prop_map(|ip| ip.to_string()),
        3 => (addr(), any::<u16>()).prop_map(|(ip, port)| SocketAddr::new(ip, port).to_string()),
        2 => addr().prop_map(|ip| match ip {
            IpAddr::V6(v6) => format!("[{v6}]"),
            v4 => v4.to_string(),
        }),
        1 => prop::sample::select(vec![
            "", " ", "unknown", "_hidden", "1.2.3", "1.2.3.4:99999", "[::1", "::1]:80",
            "fe80::1%eth0", "999.1.1.1", "\"", "for=", ";", "=",
        ])
        .prop_map(str::to_owned),
        1 => "[ -~]{0,12}",
    ]
}

/// Addresses inside the trusted sets: the peer is one of them half of the time.
const PROXIES: &[&str] = &[
    "10.0.0.1",
    "::ffff:10.0.0.1",
    "192.168.1.1",
    "127.0.0.1",
    "::1",
    "2001:db8::1",
    "172.16.0.9",
    "fe80::1",
];

/// One header line, spelled for either header.
#[derive(Debug, Clone)]
struct Line {
    /// Sent under the header the extractor does not read.
    other: bool,
    upper: bool,
    /// The value when the line is X-Forwarded-For, and when it is Forwarded.
    xff: Vec<u8>,
    forwarded: Vec<u8>,
}

fn line() -> impl Strategy<Value = Line> {
    // Entries, and whether to quote them, add parameters, leave out spaces.
    type Hops = (Vec<String>, bool, bool, bool);
    let structured = (
        vec(hop(), 0..6),
        any::<bool>(),
        any::<bool>(),
        any::<bool>(),
    )
        .prop_map(|hops: Hops| Ok(hops));
    let raw = vec(any::<u8>(), 0..64).prop_map(Err);
    (
        prop::bool::weighted(0.25),
        any::<bool>(),
        // Mostly in the header's own syntax; sometimes in the other one's.
        prop::bool::weighted(0.15),
        prop_oneof![4 => structured, 1 => raw],
    )
        .prop_map(|(other, upper, mismatch, value)| {
            let (hops, quoted, params, tight) = match value {
                Ok(hops) => hops,
                Err(bytes) => {
                    return Line {
                        other,
                        upper,
                        xff: bytes.clone(),
                        forwarded: bytes,
                    };
                }
            };
            let spell = |forwarded_syntax: bool| {
                let parts: Vec<String> = hops
                    .iter()
                    .map(|text| {
                        let mut part = match (forwarded_syntax, quoted) {
                            (false, _) => text.clone(),
                            (true, false) => format!("for={text}"),
                            (true, true) => format!("For=\"{text}\""),
                        };
                        if params {
                            part.push_str(";proto=https;by=_gw");
                        }
                        part
                    })
                    .collect();
                parts.join(if tight { "," } else { ", " }).into_bytes()
            };
            Line {
                other,
                upper,
                xff: spell(mismatch),
                forwarded: spell(!mismatch),
            }
        })
}

fn header_name(forwarded: bool, upper: bool) -> HeaderName {
    let name = match (forwarded, upper) {
        (false, false) => "x-forwarded-for",
        (false, true) => "X-Forwarded-For",
        (true, false) => "forwarded",
        (true, true) => "Forwarded",
    };
    HeaderName::from_bytes(name.as_bytes()).unwrap()
}

proptest! {
    #![proptest_config(config(2000))]

    #[test]
    fn client_ip_is_a_valid_key_a_client_cannot_choose(
        peer in prop_oneof![1 => addr(), 3 => prop::sample::select(PROXIES).prop_map(|s| s.parse().unwrap())],
        trusted in 0..TRUSTED.len(),
        forwarded in any::<bool>(),
        ipv6_prefix in prop_oneof![Just(64u8), Just(128u8), Just(0u8), any::<u8>()],
        lines in vec(line(), 0..4),
        injected in vec(any::<u8>(), 0..32),
    ) {
        let trusted: Vec<IpNet> = TRUSTED[trusted].iter().map(|n| n.parse().unwrap()).collect();
        let header = if forwarded { ForwardedHeader::Forwarded } else { ForwardedHeader::XForwardedFor };
        let extractor = ClientIp::new(trusted.iter().copied())
            .with_header(header)
            .with_ipv6_prefix(ipv6_prefix);
        let is_trusted = |ip: IpAddr| trusted.iter().any(|n| n.trunc().contains(&ip));

        let mut headers = HeaderMap::new();
        let mut relevant = HeaderMap::new();
        for line in &lines {
            let line_forwarded = forwarded != line.other;
            let bytes = if line_forwarded { &line.forwarded } else { &line.xff };
            let Ok(value) = HeaderValue::from_bytes(bytes) else { continue };
            let name = header_name(line_forwarded, line.upper);
            if !line.other {
                relevant.append(name.clone(), value.clone());
            }
            headers.append(name, value);
        }

        let mut req = Request::new(());
        *req.headers_mut() = headers.clone();
        req.extensions_mut().insert(SocketAddr::new(peer, 4000));
        let key = extractor.extract(&req).unwrap();
        check_ip_key(&key, ipv6_prefix);

        let ip = extractor.client_ip(peer, &headers);
        prop_assert_eq!(ip, canonical(ip));
        prop_assert_eq!(&key, &peer_key(ip, ipv6_prefix));
        if !is_trusted(canonical(peer)) {
            prop_assert_eq!(ip, canonical(peer), "an untrusted peer chose its key");
        }
        prop_assert!(ip == canonical(peer) || named(&headers).contains(&ip), "{} came from nowhere", ip);
        prop_assert_eq!(extractor.client_ip(peer, &relevant), ip, "the other header counted");
        // Once an untrusted hop was found, what is further left does not matter.
        if !is_trusted(ip) && let Ok(injected) = HeaderValue::from_bytes(&injected) {
            let mut with = HeaderMap::new();
            with.append(header_name(forwarded, false), injected);
            for (name, value) in &relevant {
                with.append(name, value.clone());
            }
            prop_assert_eq!(extractor.client_ip(peer, &with), ip, "the client chose its key");
        }
    }
}

#[test]
fn forwarding_headers_of_8_kib_and_more() {
    let extractor = ClientIp::new(["10.0.0.0/8".parse().unwrap()]);
    let peer: SocketAddr = "10.0.0.1:1".parse().unwrap();
    let list = vec!["6.6.6.6"; 2000].join(", ") + ", 203.0.113.9";
    let garbage = "\u{7f}x{}:".repeat(4096).replace('\u{7f}', "\t");
    for value in [list.as_str(), garbage.as_str()] {
        assert!(value.len() >= 8 * 1024);
        let mut req = Request::new(());
        req.headers_mut()
            .insert("x-forwarded-for", HeaderValue::from_str(value).unwrap());
        req.extensions_mut().insert(peer);
        let key = extractor.extract(&req).unwrap();
        check_ip_key(&key, 64);
        if value == list {
            assert_eq!(key.as_str(), "ip|203.0.113.9");
        } else {
            assert_eq!(key.as_str(), "ip|10.0.0.1");
        }
    }
}

// ---------------------------------------------------------------------------------------
// HeaderKey

proptest! {
    #![proptest_config(config(500))]

    #[test]
    fn header_key_takes_exactly_one_non_empty_value(
        name in prop_oneof![Just("x-api-key".to_owned()), "[a-zA-Z0-9-]{1,20}", ".{0,8}"],
        values in vec((any::<bool>(), any::<u8>(), prop_oneof![
            vec(any::<u8>(), 0..40),
            vec(hostile_byte(), 0..200),
        ]), 0..4),
    ) {
        let extractor = HeaderKey::new(&name).unwrap_or_else(|_| HeaderKey::new("x-api-key").unwrap());
        let ours_name = extractor.name().clone();
        let other = if ours_name == "x-other" { "x-different" } else { "x-other" };
        let mut req = Request::new(());
        let mut ours = Vec::new();
        for (same, case, bytes) in &values {
            let Ok(value) = HeaderValue::from_bytes(bytes) else { continue };
            let sent = if *same {
                // The same name in another letter case.
                ours_name
                    .as_str()
                    .chars()
                    .enumerate()
                    .map(|(i, c)| if (case >> (i % 8)) & 1 == 1 { c.to_ascii_uppercase() } else { c })
                    .collect::<String>()
            } else {
                other.to_owned()
            };
            let sent = HeaderName::from_bytes(sent.as_bytes()).unwrap();
            if sent == ours_name {
                ours.push(bytes.clone());
            }
            req.headers_mut().append(sent, value);
        }
        let result = extractor.extract(&req);
        match ours.as_slice() {
            [one] if !one.is_empty() => {
                let key = result.unwrap();
                check_header_key(&key, ours_name.as_str(), one);
            }
            _ => prop_assert!(result.is_err(), "{} values gave a key", ours.len()),
        }
    }
}

#[test]
fn header_values_of_8_kib_and_more_are_distinct_bounded_keys() {
    let extractor = HeaderKey::new("x-api-key").unwrap();
    let mut keys = Vec::new();
    for len in [8 * 1024, 8 * 1024 + 1, 64 * 1024] {
        for fill in [b'k', b'{', 0xff] {
            let mut value = vec![fill; len];
            value[0] = b'a';
            let mut req = Request::new(());
            req.headers_mut()
                .insert("x-api-key", HeaderValue::from_bytes(&value).unwrap());
            let key = extractor.extract(&req).unwrap();
            check_header_key(&key, "x-api-key", &value);
            keys.push(key);
        }
    }
    let count = keys.len();
    keys.sort();
    keys.dedup();
    assert_eq!(keys.len(), count, "two large values share a key");
}
