//! The reference model of each algorithm: one decision on a hot key.

use std::{hint::black_box, time::Duration};

use criterion::{BenchmarkId, Criterion};
use tollgate::{
    Limit,
    algorithm::{self, State},
};

pub(crate) fn bench_all(c: &mut Criterion) {
    let window = Duration::from_secs(1);
    let limits = [
        Limit::fixed_window(1000, window).unwrap(),
        Limit::sliding_window(1000, window).unwrap(),
        Limit::sliding_window_counter(1000, window).unwrap(),
        Limit::token_bucket(1000, window).unwrap(),
        Limit::gcra(1000, window).unwrap(),
    ];
    let mut group = c.benchmark_group("algorithm");
    for limit in &limits {
        let limits = std::slice::from_ref(limit);
        group.bench_function(BenchmarkId::from_parameter(limit.algorithm()), |b| {
            let mut states = [State::new(limit.algorithm())];
            // 1 ms per request: a key running at its limit, half allowed.
            let mut now = 1_700_000_000_000u64;
            b.iter(|| {
                now += 1;
                black_box(algorithm::check(&mut states, limits, black_box(now), 2))
            });
        });
    }
    group.finish();
}
