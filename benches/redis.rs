//! `RedisStore::check` next to the floor: a raw EVALSHA of a trivial script on the same
//! kind of connection, one at a time and 64 concurrent; with the `cluster` feature, the
//! same check on a local Redis Cluster (three masters, three replicas) beside it.

use std::time::Duration;

use criterion::{BenchmarkId, Criterion};
use futures_util::future::join_all;
use redis::{Script, aio::ConnectionManager};
use tollgate::{
    Limit,
    key::Key,
    store::{RedisStore, Store},
};

use crate::support::RedisServer;

pub(crate) fn bench_all(c: &mut Criterion) {
    let server = RedisServer::start();
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(1)
        .enable_all()
        .build()
        .unwrap();
    let (store, manager) = runtime.block_on(async {
        let store = RedisStore::connect(server.url()).await.unwrap();
        let client = redis::Client::open(server.url()).unwrap();
        (store, ConnectionManager::new(client).await.unwrap())
    });
    #[cfg(feature = "cluster")]
    let cluster = crate::support::cluster::RedisCluster::start();
    #[cfg(feature = "cluster")]
    let cluster_store = runtime
        .block_on(RedisStore::connect(tollgate::store::RedisTarget::cluster(
            &cluster.urls(),
        )))
        .unwrap();
    let trivial = Script::new("return redis.call('INCR', KEYS[1])");
    let limits = [Limit::fixed_window(u32::MAX, Duration::from_secs(60)).unwrap()];
    let key = Key::new("bench");
    let distinct: Vec<Key> = (0..64).map(|i| Key::new(format!("client-{i}"))).collect();

    let mut group = c.benchmark_group("redis");
    for concurrency in [1usize, 64] {
        group.throughput(criterion::Throughput::Elements(concurrency as u64));
        group.bench_function(BenchmarkId::new("raw_evalsha_incr", concurrency), |b| {
            b.to_async(&runtime).iter(|| {
                join_all((0..concurrency).map(|_| {
                    let mut manager = manager.clone();
                    let invocation = trivial.key("bench:raw");
                    async move {
                        let _: i64 = invocation.invoke_async(&mut manager).await.unwrap();
                    }
                }))
            });
        });
        group.bench_function(
            BenchmarkId::new("store_check_fixed_window", concurrency),
            |b| {
                b.to_async(&runtime)
                    .iter(|| join_all((0..concurrency).map(|_| store.check(&key, &limits, 1))));
            },
        );
        // One key per concurrent request, as with per-client limits: a batch then reads and
        // writes every key (the hot key above is read and written once per batch).
        group.bench_function(
            BenchmarkId::new("store_check_fixed_window_distinct_keys", concurrency),
            |b| {
                b.to_async(&runtime).iter(|| {
                    join_all(
                        distinct[..concurrency]
                            .iter()
                            .map(|key| store.check(key, &limits, 1)),
                    )
                });
            },
        );
        // The same key, so the same single master: the cost of the cluster client.
        #[cfg(feature = "cluster")]
        group.bench_function(
            BenchmarkId::new("cluster_store_check_fixed_window", concurrency),
            |b| {
                b.to_async(&runtime).iter(|| {
                    join_all((0..concurrency).map(|_| cluster_store.check(&key, &limits, 1)))
                });
            },
        );
    }
    group.finish();
    drop(server);
    #[cfg(feature = "cluster")]
    drop(cluster);
}
