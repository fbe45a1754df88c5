//! Criterion benches. `cargo bench --all-features` runs them all; Redis benches start
//! their own redis-server.

#![allow(missing_docs)]

use criterion::{criterion_group, criterion_main};

mod algorithms;
mod keys;
mod layer;
mod memory;
#[cfg(feature = "redis")]
mod redis;
#[cfg(feature = "redis")]
use tollgate_test_support as support;

#[cfg(feature = "redis")]
criterion_group!(
    benches,
    algorithms::bench_all,
    keys::bench_all,
    layer::bench_all,
    memory::bench_all,
    redis::bench_all
);
#[cfg(not(feature = "redis"))]
criterion_group!(
    benches,
    algorithms::bench_all,
    keys::bench_all,
    layer::bench_all,
    memory::bench_all
);
criterion_main!(benches);
