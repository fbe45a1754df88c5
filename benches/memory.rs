//! MemoryStore next to governor's keyed limiter on the same workloads, 2 threads
//! (`BENCH_THREADS` to change): one hot key, and keys spread over 1M IPv4 addresses.
//! Memory per key is measured by `benches/memory_per_key.rs`.
//!
//! `memory/tollgate/flood`: a key never seen before in every decision, on a store kept
//! at its bound (`FLOOD_BOUND` keys, 100 000 by default; one-hour windows, so that every
//! new key evicts a live one): what a client rotating API keys or IPv6 addresses costs.
//! Each key is made in the timed loop (a few ns).

use std::{
    hint::black_box,
    net::{IpAddr, Ipv4Addr},
    num::NonZeroU32,
    sync::{
        Arc,
        atomic::{AtomicU64, Ordering},
    },
    thread,
    time::{Duration, Instant},
};

use criterion::{BenchmarkId, Criterion, Throughput};
use governor::{Quota, RateLimiter};
use tollgate::{Limit, key::Key, store::MemoryStore};

/// Threads per workload: `BENCH_THREADS` or 2.
fn threads() -> u64 {
    std::env::var("BENCH_THREADS")
        .ok()
        .and_then(|t| t.parse().ok())
        .unwrap_or(2)
}
const KEYS: u32 = 1_000_000;
/// The bound of the store the flood runs against: `FLOOD_BOUND` or 100 000.
fn flood_bound() -> usize {
    std::env::var("FLOOD_BOUND")
        .ok()
        .and_then(|n| n.parse().ok())
        .unwrap_or(100_000)
}

fn ip(i: u32) -> IpAddr {
    IpAddr::V4(Ipv4Addr::from(0x0a00_0000 + i))
}

/// Runs `f(thread, i)` for `iters` iterations split over [`threads`] threads.
fn on_threads(iters: u64, f: impl Fn(u64, u64) + Send + Sync + 'static) -> Duration {
    let f = Arc::new(f);
    let threads = threads();
    let start = Instant::now();
    let handles: Vec<_> = (0..threads)
        .map(|t| {
            let f = f.clone();
            thread::spawn(move || {
                for i in 0..iters / threads {
                    f(t, i);
                }
            })
        })
        .collect();
    for handle in handles {
        handle.join().unwrap();
    }
    start.elapsed()
}

pub(crate) fn bench_all(c: &mut Criterion) {
    let limit = [Limit::gcra(1_000_000, Duration::from_secs(1)).unwrap()];
    let quota = Quota::per_second(NonZeroU32::new(1_000_000).unwrap());
    let keys: Arc<Vec<Key>> = Arc::new((0..KEYS).map(|i| Key::from(ip(i))).collect());
    let ips: Arc<Vec<IpAddr>> = Arc::new((0..KEYS).map(ip).collect());

    let mut group = c.benchmark_group("memory");
    group.throughput(Throughput::Elements(1));
    for (name, spread) in [("hot_key", 1u64), ("1M_keys", u64::from(KEYS))] {
        let store = MemoryStore::new();
        let keys = keys.clone();
        let limits = limit.clone();
        group.bench_function(BenchmarkId::new("tollgate", name), |b| {
            let store = store.clone();
            let keys = keys.clone();
            let limits = limits.clone();
            b.iter_custom(move |iters| {
                let (store, keys, limits) = (store.clone(), keys.clone(), limits.clone());
                let threads = threads();
                on_threads(iters, move |t, i| {
                    let key = &keys[((i * threads + t) % spread) as usize];
                    black_box(store.decide(key, &limits, 1));
                })
            });
        });
        let governor = Arc::new(RateLimiter::keyed(quota));
        let ips = ips.clone();
        group.bench_function(BenchmarkId::new("governor", name), |b| {
            let governor = governor.clone();
            let ips = ips.clone();
            b.iter_custom(move |iters| {
                let (governor, ips) = (governor.clone(), ips.clone());
                let threads = threads();
                on_threads(iters, move |t, i| {
                    let ip = &ips[((i * threads + t) % spread) as usize];
                    let _ = black_box(governor.check_key(ip));
                })
            });
        });
    }
    let bound = flood_bound();
    let store = MemoryStore::new().with_max_keys(bound);
    let hour = [Limit::fixed_window(1, Duration::from_secs(3_600)).unwrap()];
    for i in 0..bound as u64 {
        store.decide(&Key::from(i), &hour, 1);
    }
    let next = Arc::new(AtomicU64::new(bound as u64));
    group.bench_function(BenchmarkId::new("tollgate", "flood"), |b| {
        b.iter_custom(|iters| {
            let (store, hour) = (store.clone(), hour.clone());
            let first = next.fetch_add(iters, Ordering::Relaxed);
            let threads = threads();
            on_threads(iters, move |t, i| {
                let key = Key::from(first + i * threads + t);
                black_box(store.decide(&key, &hour, 1));
            })
        });
    });
    assert!(store.len() <= bound, "{}", store.len());
    group.finish();
}
