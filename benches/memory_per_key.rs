//! Heap bytes per tracked key: tollgate's MemoryStore and governor's keyed limiter, each
//! filled with N distinct IPv4 keys (`cargo bench --bench memory_per_key`). Counts every
//! byte allocated and not freed (allocator bookkeeping excluded), for several N, since a
//! hash table's load factor changes with N.
//!
//! Then a flood: 5M distinct keys with one-hour windows (nothing expires) into
//! `MemoryStore::new()` (bounded to 917 504 keys): what the store holds at the end.

#![allow(missing_docs)]

use std::{
    alloc::System,
    net::{IpAddr, Ipv4Addr},
    num::NonZeroU32,
    time::Duration,
};

use governor::{Quota, RateLimiter};
use stats_alloc::{INSTRUMENTED_SYSTEM, Region, StatsAlloc};
use tollgate::{Limit, key::Key, store::MemoryStore};

#[global_allocator]
static GLOBAL: &StatsAlloc<System> = &INSTRUMENTED_SYSTEM;

fn ip(i: u32) -> IpAddr {
    IpAddr::V4(Ipv4Addr::from(0x0a00_0000 + i))
}

/// Bytes still allocated after `f`, per key.
fn per_key<T>(n: u32, f: impl FnOnce() -> T) -> (f64, T) {
    let region = Region::new(GLOBAL);
    let kept = f();
    let change = region.change();
    let bytes = change.bytes_allocated as f64 - change.bytes_deallocated as f64;
    (bytes / f64::from(n), kept)
}

fn main() {
    let limit = [Limit::gcra(100, Duration::from_secs(1)).unwrap()];
    let quota = Quota::per_second(NonZeroU32::new(100).unwrap());
    println!("keys        tollgate B/key  governor B/key");
    for n in [100_000u32, 500_000, 1_000_000] {
        let keys: Vec<Key> = (0..n).map(|i| Key::from(ip(i))).collect();
        let ips: Vec<IpAddr> = (0..n).map(ip).collect();
        let (tollgate, store) = per_key(n, || {
            // Unbounded: the cost of an entry, not of the bound.
            let store = MemoryStore::new().with_max_keys(usize::MAX);
            for key in &keys {
                store.decide(key, &limit, 1);
            }
            store
        });
        let (governor, limiter) = per_key(n, || {
            let limiter = RateLimiter::keyed(quota);
            for ip in &ips {
                let _ = limiter.check_key(ip);
            }
            limiter
        });
        println!("{n:<11} {tollgate:>14.0}  {governor:>14.0}");
        drop((store, limiter));
    }

    let hour = [Limit::fixed_window(1, Duration::from_secs(3_600)).unwrap()];
    let flood = 5_000_000u64;
    let (per_key, store) = per_key(1, || {
        let store = MemoryStore::new();
        for i in 0..flood {
            store.decide(&Key::from(i), &hour, 1);
        }
        store
    });
    println!(
        "flood of {flood} keys into MemoryStore::new() (bound {}): {} keys held, {:.1} MiB \
         ({:.0} B/key)",
        store.max_keys(),
        store.len(),
        per_key / f64::from(1 << 20),
        per_key / store.len() as f64
    );
}
