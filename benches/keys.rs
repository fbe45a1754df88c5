//! What extracting a key costs per request: the peer IP, a header value as it is, and a
//! header value hashed (SHA-256) or keyed-hashed (HMAC-SHA256), as the example gateway
//! does by default.

use std::{hint::black_box, net::SocketAddr};

use criterion::{BenchmarkId, Criterion};
use http::Request;
use tollgate::key::{HeaderKey, KeyExtractor, PeerIp};

pub(crate) fn bench_all(c: &mut Criterion) {
    let mut group = c.benchmark_group("keys");
    let mut from_peer = Request::new(());
    from_peer
        .extensions_mut()
        .insert("203.0.113.9:40000".parse::<SocketAddr>().unwrap());
    let peer = PeerIp::new();
    group.bench_function(BenchmarkId::from_parameter("peer_ipv4"), |b| {
        b.iter(|| black_box(peer.extract(black_box(&from_peer)).unwrap()));
    });
    // A typical API key: 32 characters.
    let with_key = Request::get("/")
        .header("x-api-key", "sk_live_4eC39HqLyjWDarjtT1zdp7dc")
        .body(())
        .unwrap();
    let header = HeaderKey::new("x-api-key").unwrap();
    let cases = [
        ("header_plain", header.clone()),
        ("header_sha256", header.clone().hashed()),
        ("header_hmac", header.hashed_with([7u8; 32])),
    ];
    for (name, key) in cases {
        group.bench_function(BenchmarkId::from_parameter(name), |b| {
            b.iter(|| black_box(key.extract(black_box(&with_key)).unwrap()));
        });
    }
    group.finish();
}
