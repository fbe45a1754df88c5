//! `RedisStore` on a real Redis Cluster (`test-support/src/cluster.rs`: six `redis-server`
//! processes, three masters with one replica each): keys spread over every master,
//! multi-limit decisions never cross slots, and decisions go on through a failover and a
//! resharding while requests flow.
//!
//! Windows are an hour long and time is a `ManualClock` (sent as the script's `now`), so
//! counts are exact. Nothing sleeps to wait for the cluster: the harness polls with
//! deadlines, and every check runs under a generous timeout, so a hang fails the test
//! instead of blocking it. The request streams are bounded in count and in time.

#![cfg(feature = "cluster")]

use tollgate_test_support as support;

use std::{
    convert::Infallible,
    sync::{
        Arc, Mutex,
        atomic::{AtomicBool, AtomicU64, Ordering},
    },
    time::{Duration, Instant},
};

use http::{Request, Response, StatusCode};
use support::{
    cluster::RedisCluster,
    failover::{CHECK_TIMEOUT, check, resumed, wait_until},
};
use tokio::{task::JoinSet, time::timeout};
use tollgate::{
    Decision, FailurePolicy, Limit, RateLimitLayer, StoreError, StoreErrorKind,
    clock::ManualClock,
    key::{GlobalKey, Key},
    store::{RedisStore, Store},
};
use tower::{Layer, ServiceExt, service_fn};

const HOUR: Duration = Duration::from_secs(3600);
/// 800 s into an hour: hour-long windows never roll over during a test.
const NOW_MS: u64 = 1_700_000_000_000;
/// How long the cluster may take to serve a slot again after a failover.
const RESUME: Duration = Duration::from_secs(20);

fn every_algorithm(limit: u32) -> [Limit; 5] {
    [
        Limit::fixed_window(limit, HOUR).unwrap(),
        Limit::sliding_window(limit, HOUR).unwrap(),
        Limit::sliding_window_counter(limit, HOUR).unwrap(),
        Limit::token_bucket(limit, HOUR).unwrap(),
        Limit::gcra(limit, HOUR).unwrap(),
    ]
}

async fn connect(cluster: &RedisCluster) -> RedisStore {
    RedisStore::connect(tollgate::store::RedisTarget::cluster(&cluster.urls()))
        .await
        .unwrap()
        .with_clock(ManualClock::new(NOW_MS))
}

/// Layers keyed by different extractors on one cluster keep separate budgets.
#[tokio::test]
async fn kinds_of_keys_never_share_state_in_a_cluster() {
    let cluster = RedisCluster::start();
    let store = connect(&cluster).await.with_block_cache(None);
    support::kinds::kinds_never_share_state(Arc::new(store)).await;
}

/// What a stream of requests got back, shared with the test while it runs.
#[derive(Debug, Default)]
struct Tally {
    allowed: AtomicU64,
    denied: AtomicU64,
    /// `StoreError`s; through a layer: 200s without rate-limit fields (failed open).
    errors: AtomicU64,
    /// Errors after which the request may still have counted (timeouts, lost connections);
    /// an error answer (MOVED, ASK, TRYAGAIN, CLUSTERDOWN) means the script did not run.
    uncertain: AtomicU64,
    /// The first few errors, for the report.
    samples: Mutex<Vec<String>>,
}

impl Tally {
    fn record(&self, outcome: &Result<Decision, StoreError>) {
        let counter = match outcome {
            Ok(decision) if decision.is_allowed() => &self.allowed,
            Ok(_) => &self.denied,
            Err(error) => {
                if error.kind() != StoreErrorKind::Response {
                    self.uncertain.fetch_add(1, Ordering::Relaxed);
                }
                let mut samples = self.samples.lock().unwrap();
                if samples.len() < 3 {
                    samples.push(format!(
                        "{error}: {}",
                        std::error::Error::source(error).map_or(String::new(), |e| e.to_string())
                    ));
                }
                &self.errors
            }
        };
        counter.fetch_add(1, Ordering::Relaxed);
    }

    fn samples(&self) -> Vec<String> {
        self.samples.lock().unwrap().clone()
    }

    fn get(&self) -> [u64; 3] {
        [&self.allowed, &self.denied, &self.errors].map(|c| c.load(Ordering::Relaxed))
    }

    fn answers(&self) -> u64 {
        self.get().iter().sum()
    }
}

/// The bounds of every request stream: it stops at `stop`, or after this long, or after
/// this many requests per task, whichever comes first.
const STREAM_TIME: Duration = Duration::from_secs(90);
const STREAM_REQUESTS: usize = 50_000;
/// The pause between two requests of one task: a steady stream, not a busy loop.
const PACE: Duration = Duration::from_millis(1);

/// `tasks` tasks checking `limits` on `key` in a loop, each check under [`check`]'s
/// timeout (a hang panics the task, which fails the test when it is joined).
fn stream(
    set: &mut JoinSet<()>,
    store: &RedisStore,
    key: &Key,
    limits: &[Limit],
    tasks: usize,
    stop: &Arc<AtomicBool>,
) -> Arc<Tally> {
    let tally = Arc::new(Tally::default());
    for _ in 0..tasks {
        let (store, key, limits) = (store.clone(), key.clone(), limits.to_vec());
        let (stop, tally) = (stop.clone(), tally.clone());
        set.spawn(async move {
            let start = Instant::now();
            for _ in 0..STREAM_REQUESTS {
                if stop.load(Ordering::Relaxed) || start.elapsed() > STREAM_TIME {
                    break;
                }
                tally.record(&check(&store, &key, &limits).await);
                tokio::time::sleep(PACE).await;
            }
        });
    }
    tally
}

/// Joins every stream; a panic in one (a hang, a bug) fails the test here.
async fn join(mut set: JoinSet<()>, stop: &AtomicBool) {
    stop.store(true, Ordering::Relaxed);
    while let Some(result) = set.join_next().await {
        result.unwrap();
    }
}

#[tokio::test]
async fn keys_spread_over_every_master_and_never_cross_slots() {
    let cluster = RedisCluster::start();
    let store = connect(&cluster).await;
    let limits = every_algorithm(3);
    let identities = 300;
    for i in 0..identities {
        // All five algorithms on one key in one call: a CROSSSLOT error would be an Err.
        let decision = store
            .check(&Key::new(format!("user-{i}")), &limits, 1)
            .await
            .unwrap();
        assert!(decision.is_allowed(), "user-{i}: {decision:?}");
        assert_eq!(decision.limits().len(), 5);
    }
    let masters = cluster.masters();
    assert_eq!(masters.len(), 3, "{}", cluster.describe());
    let sizes: Vec<u64> = masters.iter().map(|&m| cluster.dbsize(m)).collect();
    assert!(sizes.iter().all(|&size| size > 0), "{sizes:?}");
    assert_eq!(sizes.iter().sum::<u64>(), 5 * identities, "{sizes:?}");
    // Each identity's keys are in one slot, on the master that owns it.
    for i in [0, 1, 2, 99, 150, 299] {
        let key = Key::new(format!("user-{i}"));
        let names: Vec<String> = limits.iter().map(|l| store.redis_key(&key, l)).collect();
        let slot = cluster.keyslot(&names[0]);
        let master = cluster.master_of_slot(slot);
        for name in &names {
            assert_eq!(cluster.keyslot(name), slot, "{name}");
            let exists = cluster.cli(master, &["EXISTS", name]).unwrap();
            assert_eq!(exists.trim(), "1", "{name} on node {master}");
        }
    }
    // A hostile identity cannot pick its slot: braces are encoded, the whole identity is
    // the hash tag.
    let hostile = Key::new("{user-0}");
    let name = store.redis_key(&hostile, &limits[0]);
    assert_eq!(
        cluster.keyslot(&name),
        cluster.keyslot("custom|%7Buser-0%7D")
    );
    assert!(cluster.assert_every_key_expires() >= 5 * 300);
}

/// Kill -9 the master that owns a hot key while requests flow: the replica is promoted
/// (automatically, after `cluster-node-timeout`), every request gets an answer in time
/// (decisions or `StoreError`s, and only 200 or 429 through a layer that fails open), and
/// limiting resumes on the new master with the state it had replicated.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_killed_master_fails_over_and_limiting_resumes() {
    let mut cluster = RedisCluster::start();
    let store = connect(&cluster).await;
    let hot = Key::new("hot");
    let tight = [Limit::fixed_window(20, HOUR)
        .unwrap()
        .with_name("tight")
        .unwrap()];
    let loose = [Limit::fixed_window(1_000_000, HOUR)
        .unwrap()
        .with_name("loose")
        .unwrap()];
    let tight_key = store.redis_key(&hot, &tight[0]);
    let loose_key = store.redis_key(&hot, &loose[0]);
    let slot = cluster.keyslot(&tight_key);
    assert_eq!(cluster.keyslot(&loose_key), slot);
    let master = cluster.master_of_slot(slot);
    let replica = cluster.replica_of(master);

    // Exhaust the tight limit and let the replica catch up with that state.
    for i in 0..20 {
        let decision = check(&store, &hot, &tight).await.unwrap();
        assert!(decision.is_allowed(), "request {i}");
    }
    assert!(!check(&store, &hot, &tight).await.unwrap().is_allowed());
    cluster.wait_replicated(master);

    // The same store behind layers that fail open: a global limit of 50 (soon denying)
    // and a loose one (asking Redis on every request).
    let stop = Arc::new(AtomicBool::new(false));
    let mut streams = JoinSet::new();
    let direct = stream(&mut streams, &store, &hot, &loose, 3, &stop);
    let layered = Arc::new(Tally::default());
    for quota in [50, 1_000_000] {
        let layer = RateLimitLayer::new(Limit::fixed_window(quota, HOUR).unwrap())
            .with_store(store.clone())
            .with_key(GlobalKey)
            .with_on_store_error(FailurePolicy::Allow)
            .with_timeout(Some(Duration::from_secs(2)));
        let service = layer.layer(service_fn(|_: Request<()>| async {
            Ok::<_, Infallible>(Response::new(String::from("ok")))
        }));
        let (stop, tally) = (stop.clone(), layered.clone());
        streams.spawn(async move {
            let start = Instant::now();
            for _ in 0..STREAM_REQUESTS {
                if stop.load(Ordering::Relaxed) || start.elapsed() > STREAM_TIME {
                    break;
                }
                let call = service.clone().oneshot(Request::new(()));
                let response = timeout(CHECK_TIMEOUT, call)
                    .await
                    .expect("the layer answered in time")
                    .unwrap();
                let counter = match response.status() {
                    StatusCode::OK if response.headers().contains_key("ratelimit") => {
                        &tally.allowed
                    }
                    StatusCode::OK => &tally.errors,
                    StatusCode::TOO_MANY_REQUESTS => &tally.denied,
                    other => panic!("the layer answered {other} while Redis failed over"),
                };
                counter.fetch_add(1, Ordering::Relaxed);
                tokio::time::sleep(PACE).await;
            }
        });
    }
    // Requests flow, and the layer has denied some, before the kill.
    wait_until("requests before the kill", RESUME, || {
        direct.answers() >= 100 && layered.get()[1] > 0
    })
    .await;

    let before_kill = (direct.get(), layered.get());
    cluster.kill(master);
    let promoted_in = cluster.wait_for("the replica to take over", RESUME, |c| {
        c.all_agree_owner(slot, replica) && c.is_serving()
    });
    let resumed_in = resumed(&store, &hot, &loose, "the promotion", RESUME).await;
    // The new master has the replicated state: the exhausted limit stays exhausted.
    let after = check(&store, &hot, &tight).await.unwrap();
    assert!(
        !after.is_allowed(),
        "the failover reset the limit: {after:?}"
    );
    // Requests keep flowing on the new master.
    let answered = direct.answers();
    wait_until("requests after the failover", RESUME, || {
        direct.get()[0] >= before_kill.0[0] + 100 && direct.answers() >= answered + 100
    })
    .await;
    join(streams, &stop).await;

    assert_eq!(cluster.node_for_key(&loose_key), replica);
    for key in [&tight_key, &loose_key] {
        let exists = cluster.cli(replica, &["EXISTS", key]).unwrap();
        assert_eq!(exists.trim(), "1", "{key} on the new master");
    }
    assert_eq!(
        support::fixed_window_count(&cluster.cli(replica, &["GET", &tight_key]).unwrap()),
        20
    );
    let stats = cluster.cli(replica, &["INFO", "commandstats"]).unwrap();
    if support::redis_server_major_version() >= 7 {
        // A function library is replicated: the promoted replica had it and called it.
        assert!(stats.contains("cmdstat_fcall:"), "{stats}");
    } else {
        // Replicas never see SCRIPT LOAD: the script ran there because NOSCRIPT reloaded it.
        assert!(stats.contains("cmdstat_script|load:"), "{stats}");
    }
    // The layers limited, and answered every request (200 or 429, in time) through the
    // failover. Whether they failed open meanwhile depends on how long the slot had no
    // master: Valkey 9 fails over before a request gives up.
    let [ok, limited, failed_open] = layered.get();
    assert!(limited > 0 && ok > 0, "{:?}", layered.get());
    let [allowed, denied, errors] = direct.get();
    // No master left for the slot (the new one killed too, no replica to promote): the
    // failure policy answers every request, in time.
    cluster.kill(replica);
    for (policy, expected) in [
        (FailurePolicy::Allow, StatusCode::OK),
        (FailurePolicy::Deny, StatusCode::SERVICE_UNAVAILABLE),
    ] {
        let layer = RateLimitLayer::new(Limit::fixed_window(1_000_000, HOUR).unwrap())
            .with_store(store.clone())
            .with_key(|_: &Request<()>| Some("hot"))
            .with_on_store_error(policy.clone())
            .with_timeout(Some(Duration::from_secs(2)));
        let service = layer.layer(service_fn(|_: Request<()>| async {
            Ok::<_, Infallible>(Response::new(String::from("ok")))
        }));
        for _ in 0..3 {
            let response = timeout(CHECK_TIMEOUT, service.clone().oneshot(Request::new(())))
                .await
                .expect("the layer answered in time")
                .unwrap();
            assert_eq!(response.status(), expected, "{policy:?}");
            assert!(!response.headers().contains_key("ratelimit"), "{policy:?}");
        }
    }
    assert!(check(&store, &hot, &loose).await.is_err());
    eprintln!(
        "failover: promoted {promoted_in:?} after the kill, first decision {resumed_in:?} \
         later; store: {allowed} allowed, {denied} denied, {errors} errors {:?} \
         (before the kill: {:?}); layers: {ok} x 200, {limited} x 429, {failed_open} x 200 \
         failed open",
        direct.samples(),
        before_kill.0
    );
}

/// Move the hot key's slot to another master while requests flow: redirections are
/// followed, nothing hangs, and the count moves with the key (a limit of N per hour allows
/// exactly N in total across the move).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn moving_the_hot_slot_keeps_its_count() {
    const N: u32 = 300;
    let cluster = Arc::new(RedisCluster::start());
    let store = connect(&cluster).await;
    let hot = Key::new("hot");
    let limit = [Limit::fixed_window(N, HOUR).unwrap()];
    let multi = every_algorithm(100_000);
    let name = store.redis_key(&hot, &limit[0]);
    let slot = cluster.keyslot(&name);
    let from = cluster.master_of_slot(slot);
    let to = *cluster.masters().iter().find(|&&m| m != from).unwrap();

    let mut allowed = 0;
    for _ in 0..50 {
        allowed += u32::from(check(&store, &hot, &limit).await.unwrap().is_allowed());
        check(&store, &hot, &multi).await.unwrap();
    }
    assert_eq!(allowed, 50);
    assert_eq!(cluster.cli(from, &["EXISTS", &name]).unwrap().trim(), "1");

    let stop = Arc::new(AtomicBool::new(false));
    let mut streams = JoinSet::new();
    let single = stream(&mut streams, &store, &hot, &limit, 3, &stop);
    let several = stream(&mut streams, &store, &hot, &multi, 1, &stop);
    wait_until("requests before the move", RESUME, || {
        single.answers() >= 50
    })
    .await;
    let moving = cluster.clone();
    let started = Instant::now();
    let moved = tokio::task::spawn_blocking(move || moving.move_slot(slot, to))
        .await
        .unwrap();
    let took = started.elapsed();
    let answered = single.answers();
    wait_until("requests after the move", RESUME, || {
        single.answers() >= answered + 50 && several.answers() >= 10
    })
    .await;
    join(streams, &stop).await;

    // The key went with its slot.
    assert!(moved >= 6, "moved {moved} keys");
    assert_eq!(cluster.node_for_key(&name), to);
    let left = cluster.cli(from, &["CLUSTER", "COUNTKEYSINSLOT", &slot.to_string()]);
    assert_eq!(left.unwrap().trim(), "0");
    // Exactly N in total, before, during and after the move.
    for _ in 0..N + 10 {
        allowed += u32::from(check(&store, &hot, &limit).await.unwrap().is_allowed());
    }
    // (A request that timed out may have counted without being told so: only those
    // may make up the difference. Redirections and TRYAGAIN never ran the script.)
    let [during, _, errors] = single.get();
    let uncertain = single.uncertain.load(Ordering::Relaxed);
    let total = u64::from(allowed) + during;
    assert!(
        total <= u64::from(N) && total + uncertain >= u64::from(N),
        "allowed {total} of {N} ({errors} errors, {uncertain} of them maybe counted)"
    );
    assert_eq!(
        support::fixed_window_count(&cluster.cli(to, &["GET", &name]).unwrap()),
        N
    );
    // The old owner redirected the store at least once: ASK while the slot was migrating,
    // MOVED once it was gone (whichever the store met first depends on when it refreshed
    // its slot map, so either proves the redirection was followed).
    let errorstats = cluster.cli(from, &["INFO", "errorstats"]).unwrap();
    assert!(
        errorstats.contains("errorstat_MOVED") || errorstats.contains("errorstat_ASK"),
        "{errorstats}"
    );
    let several_samples = several.samples();
    let several = several.get();
    eprintln!(
        "resharding: {moved} keys moved in {took:?}; single-limit stream {:?} {:?}, \
         five-limit stream {several:?} {:?} (allowed, denied, errors)",
        single.get(),
        single.samples(),
        several_samples,
    );
}

/// A master without the library (flushed here; a node added to the cluster, or restarted
/// without persistence, is the same) gets it loaded when a call meets the missing function,
/// and the call runs once more: every decision counts exactly once, on every master.
#[tokio::test]
async fn a_master_without_the_library_loads_it_on_demand() {
    let cluster = RedisCluster::start();
    if support::redis_server_major_version() < 7 {
        return; // no functions: NOSCRIPT reloads the script (the failover test)
    }
    let store = connect(&cluster).await.with_block_cache(None);
    let limits = every_algorithm(2);
    let masters = cluster.masters();
    let flushed = masters[0];
    let flush = cluster.cli(flushed, &["FUNCTION", "FLUSH"]).unwrap();
    assert_eq!(flush.trim(), "OK");
    cluster.cli(flushed, &["CONFIG", "RESETSTAT"]).unwrap();
    let mut on_flushed = 0;
    for i in 0..60 {
        let key = Key::new(format!("user-{i}"));
        let slot = cluster.keyslot(&store.redis_key(&key, &limits[0]));
        on_flushed += u32::from(cluster.master_of_slot(slot) == flushed);
        let mut allowed = 0;
        for _ in 0..3 {
            let decision = store.check(&key, &limits, 1).await.unwrap();
            allowed += u32::from(decision.is_allowed());
        }
        assert_eq!(allowed, 2, "user-{i}");
    }
    assert!(on_flushed > 0, "no key on the flushed master");
    let stats = cluster.cli(flushed, &["INFO", "commandstats"]).unwrap();
    assert!(stats.contains("cmdstat_function|load:"), "{stats}");
    assert!(stats.contains("cmdstat_fcall:"), "{stats}");
    assert!(!stats.contains("cmdstat_evalsha:"), "{stats}");
}

/// On a cluster nearly every call holds one request (a call holds one slot's keys): one
/// against one fixed window goes to the library's function for that shape
/// (`<library>_fw`) when it is alone in its batch (or alone on its master), and with
/// others of its master's slots to the function for many (`<library>_fwn`, one call per
/// master and pipeline); a master that lost the library loads it again; every key counts
/// exactly.
///
/// Which calls of a burst go alone is the batching task's timing (how much of the burst
/// it found queued, whether the slot map was read yet): the single calls are made here
/// by checking one key of each master on its own, and bursts go on until each master ran
/// `_fwn` (bounded), so the functions' use is checked without relying on that timing.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn one_fixed_window_calls_go_to_their_own_function_on_every_master() {
    let cluster = RedisCluster::start();
    let store = connect(&cluster).await.with_block_cache(None);
    let limits = [Limit::fixed_window(3, HOUR).unwrap()];
    let functions = support::redis_server_major_version() >= 7;
    for master in cluster.masters() {
        let set = ["CONFIG", "SET", "slowlog-log-slower-than", "0"];
        cluster.cli(master, &set).unwrap();
        cluster
            .cli(master, &["CONFIG", "SET", "slowlog-max-len", "100000"])
            .unwrap();
        cluster.cli(master, &["SLOWLOG", "RESET"]).unwrap();
    }
    // How many calls of each function a master's slow log (every command) holds.
    let calls = |master: usize| {
        let log = cluster.cli(master, &["SLOWLOG", "GET", "100000"]).unwrap();
        let lean = log.lines().filter(|l| l.trim().ends_with("_fw")).count();
        let shared = log.lines().filter(|l| l.trim().ends_with("_fwn")).count();
        (lean, shared)
    };
    let keys: Vec<Key> = (0..300).map(|i| Key::new(format!("client-{i}"))).collect();
    let mut allowed = vec![0; keys.len()];
    for round in 0..4 {
        if round == 2 && functions {
            let flushed = cluster.masters()[0];
            let flush = cluster.cli(flushed, &["FUNCTION", "FLUSH"]).unwrap();
            assert_eq!(flush.trim(), "OK");
        }
        // One check per key, all submitted at once: calls of many slots per pipeline.
        for (total, got) in allowed
            .iter_mut()
            .zip(burst(&store, &keys, &limits, 1).await)
        {
            *total += got;
        }
    }
    assert!(allowed.iter().all(|&a| a == 3), "{allowed:?}");
    // Until every master ran shared calls: the store reads the slot map on first use, in
    // the background, and a burst before it knows the map goes call by call.
    let start = Instant::now();
    for round in 0.. {
        if !functions || cluster.masters().into_iter().all(|m| calls(m).1 > 0) {
            break;
        }
        let more: Vec<Key> = (0..300)
            .map(|i| Key::new(format!("more-{round}-{i}")))
            .collect();
        let got = burst(&store, &more, &limits, 1).await;
        assert!(got.iter().all(|&a| a == 1), "{got:?}");
        let missing: Vec<usize> = cluster
            .masters()
            .into_iter()
            .filter(|&m| calls(m).1 == 0)
            .collect();
        assert!(
            start.elapsed() < RESUME,
            "nodes {missing:?}: no call of <library>_fwn"
        );
    }
    // One key of each master checked alone: a call of its own.
    let mut alone = Vec::new();
    for master in cluster.masters() {
        let key = keys_on(&cluster, &store, &limits[0], master, "alone-", 1).remove(0);
        let mut allowed = 0;
        for _ in 0..4 {
            allowed += u32::from(check(&store, &key, &limits).await.unwrap().is_allowed());
        }
        assert_eq!(allowed, 3, "{key:?}");
        alone.push(key);
    }
    for master in cluster.masters() {
        let (lean, shared) = calls(master);
        if functions {
            assert!(lean >= 4, "node {master}: {lean} calls of <library>_fw");
            assert!(shared > 0, "node {master}: no call of <library>_fwn");
        } else {
            assert_eq!(lean + shared, 0, "node {master}");
        }
    }
    for key in keys.iter().step_by(7).chain(&alone) {
        assert_eq!(
            stored_count(&cluster, &store, key, &limits[0]),
            3,
            "{key:?}"
        );
    }
}

/// `checks` concurrent checks of each of `keys` under `limits`, all submitted before any
/// is awaited, so coalesced batches hold the calls of many slots (several per master,
/// which go to it in one pipeline). Returns each key's allowed count.
async fn burst(store: &RedisStore, keys: &[Key], limits: &[Limit], checks: usize) -> Vec<u32> {
    let pending: Vec<_> = keys
        .iter()
        .flat_map(|key| (0..checks).map(move |_| (key, store.check(key, limits, 1))))
        .collect();
    let mut allowed = vec![0; keys.len()];
    for (key, check) in pending {
        let decision = timeout(CHECK_TIMEOUT, check)
            .await
            .expect("a check answered in time")
            .unwrap_or_else(|error| panic!("{key:?}: {error}"));
        let index = keys.iter().position(|k| k == key).unwrap();
        allowed[index] += u32::from(decision.is_allowed());
    }
    allowed
}

/// The ids of the connections on node `index` that ran a script call (FCALL or EVALSHA)
/// last (a pipeline connection runs nothing else), or all of them (`any`).
fn clients(cluster: &RedisCluster, index: usize, any: bool) -> Vec<String> {
    let list = cluster.cli(index, &["CLIENT", "LIST"]).unwrap();
    list.lines()
        .filter(|l| any || l.contains(" cmd=evalsha ") || l.contains(" cmd=fcall "))
        .filter_map(|l| l.split(' ').find_map(|f| f.strip_prefix("id=")))
        .map(str::to_owned)
        .collect()
}

/// Hundreds of cold keys at once: the coalesced calls of the slots one master owns go to
/// it in one pipeline, each its own one-slot script call, and every key's limit holds
/// exactly. After `SCRIPT FLUSH` (and `FUNCTION FLUSH`) on every master, the pipelined
/// calls meet NOSCRIPT (or a missing function) and are sent again (script or library
/// reloaded): still exact, and no errors.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn calls_of_many_slots_go_to_their_master_together_and_decide_exactly() {
    let cluster = RedisCluster::start();
    let store = connect(&cluster).await.with_block_cache(None);
    let limits = [
        Limit::fixed_window(3, HOUR).unwrap(),
        Limit::gcra(3, HOUR).unwrap(),
    ];
    // The cluster connection's connections to the masters.
    store.check(&Key::new("first"), &limits, 1).await.unwrap();
    let before: Vec<(usize, Vec<String>)> = cluster
        .masters()
        .into_iter()
        .map(|m| (m, clients(&cluster, m, true)))
        .collect();
    let keys: Vec<Key> = (0..400).map(|i| Key::new(format!("client-{i}"))).collect();
    let allowed = burst(&store, &keys, &limits, 5).await;
    assert!(allowed.iter().all(|&a| a == 3), "{allowed:?}");
    // Pipelines go on a connection of their own to each master, beside the cluster
    // connection's (which sent the first batch, before the slot map was known).
    let start = Instant::now();
    for round in 0.. {
        let more: Vec<Key> = (0..400)
            .map(|i| Key::new(format!("more-{round}-{i}")))
            .collect();
        let allowed = burst(&store, &more, &limits, 5).await;
        assert!(allowed.iter().all(|&a| a == 3), "{allowed:?}");
        let pipelined = |&(master, ref before): &(usize, Vec<String>)| {
            clients(&cluster, master, false)
                .iter()
                .any(|id| !before.contains(id))
        };
        if before.iter().all(pipelined) {
            break;
        }
        assert!(start.elapsed() < RESUME, "no pipelines");
    }
    let functions = support::redis_server_major_version() >= 7;
    for master in cluster.masters() {
        assert_eq!(
            cluster.cli(master, &["SCRIPT", "FLUSH"]).unwrap().trim(),
            "OK"
        );
        if functions {
            let flush = cluster.cli(master, &["FUNCTION", "FLUSH"]).unwrap();
            assert_eq!(flush.trim(), "OK");
        }
        cluster.cli(master, &["CONFIG", "RESETSTAT"]).unwrap();
    }
    let flushed: Vec<Key> = (0..400).map(|i| Key::new(format!("flushed-{i}"))).collect();
    let allowed = burst(&store, &flushed, &limits, 5).await;
    assert!(allowed.iter().all(|&a| a == 3), "{allowed:?}");
    for master in cluster.masters() {
        let stats = cluster.cli(master, &["INFO", "all"]).unwrap();
        let reloaded = if functions {
            stats.contains("cmdstat_function|load:")
        } else {
            stats.contains("errorstat_NOSCRIPT")
        };
        assert!(reloaded, "node {master}: {stats}");
    }
    // Every key holds exactly its count.
    for key in keys.iter().chain(&flushed).step_by(17) {
        assert_eq!(
            stored_count(&cluster, &store, key, &limits[0]),
            3,
            "{key:?}"
        );
    }
}

/// `count` keys named `<prefix><n>` whose slots the master `master` owns (the slot map
/// read once).
fn keys_on(
    cluster: &RedisCluster,
    store: &RedisStore,
    limit: &Limit,
    master: usize,
    prefix: &str,
    count: usize,
) -> Vec<Key> {
    let topology = cluster.topology();
    let port = cluster.node(master).port();
    let owner = topology.iter().find(|n| n.port == port).unwrap().clone();
    (0..)
        .map(|i| Key::new(format!("{prefix}{i}")))
        .filter(|key| owner.owns(cluster.keyslot(&store.redis_key(key, limit))))
        .take(count)
        .collect()
}

/// Move a slot while many keys of its master are checked at once (so their calls share
/// pipelines with the moving slot's): calls answered ASK or MOVED inside a pipeline never
/// ran and are sent again, every other answer stands, so every key's count in Redis is
/// exactly the number of requests it allowed, and no request failed.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn moving_a_slot_under_pipelined_traffic_counts_each_request_once() {
    let cluster = Arc::new(RedisCluster::start());
    let store = connect(&cluster).await.with_block_cache(None);
    let limit = [Limit::fixed_window(1_000_000, HOUR).unwrap()];
    let hot = Key::new("hot");
    let name = store.redis_key(&hot, &limit[0]);
    let slot = cluster.keyslot(&name);
    let from = cluster.master_of_slot(slot);
    let to = *cluster.masters().iter().find(|&&m| m != from).unwrap();
    let mut keys = keys_on(&cluster, &store, &limit[0], from, "neighbour-", 40);
    keys.push(hot.clone());

    let stop = Arc::new(AtomicBool::new(false));
    let mut streams = JoinSet::new();
    let tallies: Vec<Arc<Tally>> = keys
        .iter()
        .map(|key| stream(&mut streams, &store, key, &limit, 2, &stop))
        .collect();
    let hot_tally = tallies.last().unwrap().clone();
    wait_until("requests before the move", RESUME, || {
        hot_tally.answers() >= 100
    })
    .await;
    let moving = cluster.clone();
    let moved = tokio::task::spawn_blocking(move || moving.move_slot(slot, to))
        .await
        .unwrap();
    // Allowed, not only answered: calls redirected inside a pipeline are sent again.
    let allowed = hot_tally.get()[0];
    wait_until("requests allowed after the move", RESUME, || {
        hot_tally.get()[0] >= allowed + 100
    })
    .await;
    join(streams, &stop).await;

    assert!(moved >= 1, "moved {moved} keys");
    assert_eq!(cluster.node_for_key(&name), to);
    for (key, tally) in keys.iter().zip(&tallies) {
        let [allowed, denied, errors] = tally.get();
        assert_eq!((denied, errors), (0, 0), "{key:?}: {:?}", tally.samples());
        let count = stored_count(&cluster, &store, key, &limit[0]);
        assert_eq!(count, allowed, "{key:?}");
    }
    // The old owner redirected pipelined calls.
    let errorstats = cluster.cli(from, &["INFO", "errorstats"]).unwrap();
    assert!(
        errorstats.contains("errorstat_MOVED") || errorstats.contains("errorstat_ASK"),
        "{errorstats}"
    );
}

/// The hash slot of `key`'s Redis keys (the store wraps a key in a hash tag).
fn slot_of(key: &Key) -> u16 {
    crc16::State::<crc16::XMODEM>::calculate(key.as_str().as_bytes()) % 16384
}

/// `count` keys named `<prefix><n>` in hash slot `slot`.
fn keys_in_slot(slot: u16, prefix: &str, count: usize) -> Vec<Key> {
    (0..)
        .map(|i| Key::new(format!("{prefix}{i}")))
        .filter(|key| slot_of(key) == slot)
        .take(count)
        .collect()
}

/// One request against one fixed window per key, of many slots on one master, goes in one
/// call of `<library>_fwn`, which touches keys of any slots on its node; a key the node
/// does not serve fails its command there, writes nothing and is sent again on its slot's
/// path. Through a slot's migration (`MIGRATING`: keys still on the source count there,
/// the others go to the target after `ASK`; then the slot moved, and the store's slot map
/// stale: `MOVED`), every key counts each request exactly once, and no check fails.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn calls_of_many_slots_share_one_function_call_and_count_once_through_a_migration() {
    let cluster = RedisCluster::start();
    if support::redis_server_major_version() < 7 {
        return; // no functions: each slot its own script call (tests above)
    }
    let store = connect(&cluster).await.with_block_cache(None);
    let limit = [Limit::fixed_window(1_000, HOUR).unwrap()];
    let from = cluster.masters()[0];
    let to = cluster.masters()[1];
    let neighbours = keys_on(&cluster, &store, &limit[0], from, "neighbour-", 40);
    let slot = slot_of(&neighbours[0]);
    let moving = keys_in_slot(slot, "moving-", 4);
    let others: Vec<Key> = neighbours[1..]
        .iter()
        .filter(|key| slot_of(key) != slot)
        .cloned()
        .collect();
    let mut allowed: std::collections::HashMap<Key, u64> = Default::default();
    let mut burst_of = async |keys: Vec<Key>| {
        for (key, got) in keys.iter().zip(burst(&store, &keys, &limit, 1).await) {
            *allowed.entry(key.clone()).or_default() += u64::from(got);
        }
    };
    // Until the store pipelines to the masters (it reads the slot map on first use).
    let start = Instant::now();
    for master in cluster.masters() {
        cluster.cli(master, &["CONFIG", "RESETSTAT"]).unwrap();
    }
    loop {
        burst_of(others.clone()).await;
        let stats = cluster.cli(from, &["INFO", "commandstats"]).unwrap();
        let fcalls = field(&stats, "cmdstat_fcall:", "calls=");
        if fcalls > 0 && fcalls < others.len() as u64 {
            break;
        }
        assert!(start.elapsed() < RESUME, "no shared calls: {stats}");
        cluster.cli(from, &["CONFIG", "RESETSTAT"]).unwrap();
    }
    // Two of the slot's keys exist on the source before the migration starts.
    for key in &moving[..2] {
        burst_of(vec![key.clone()]).await;
    }
    let ok = |index: usize, args: &[&str]| {
        assert_eq!(cluster.cli(index, args).unwrap().trim(), "OK", "{args:?}");
    };
    assert_eq!(cluster.begin_move(slot, to), from);
    cluster.cli(from, &["SLOWLOG", "RESET"]).unwrap();
    ok(from, &["CONFIG", "SET", "slowlog-log-slower-than", "0"]);
    // Migrating: each of the slot's keys with the others in one call (one key of the
    // slot per burst, or the slot's keys would share a call of their own).
    for round in 0..3 {
        for key in &moving {
            let mut keys = others.clone();
            keys.push(key.clone());
            burst_of(keys).await;
        }
        if round == 1 {
            // Half-way: the first of the existing keys goes to the target.
            let name = store.redis_key(&moving[0], &limit[0]);
            let port = cluster.node(to).port().to_string();
            let args = ["MIGRATE", "127.0.0.1", &port, &name, "0", "5000"];
            ok(from, &args);
        }
    }
    let log = cluster.cli(from, &["SLOWLOG", "GET", "100000"]).unwrap();
    assert!(
        log.lines().any(|l| l.trim().ends_with("_fwn")),
        "no call of <library>_fwn: {log}"
    );
    // Moved: the store's slot map still names the source.
    let moved = cluster.move_slot(slot, to);
    assert_eq!(moved, 1, "the one key left on the source");
    for _ in 0..3 {
        for key in &moving {
            let mut keys = others.clone();
            keys.push(key.clone());
            burst_of(keys).await;
        }
    }
    for (key, &count) in &allowed {
        assert_eq!(
            stored_count(&cluster, &store, key, &limit[0]),
            count,
            "{key:?}"
        );
    }
    assert_eq!(allowed[&moving[0]], 1 + 6, "{allowed:?}");
    assert_eq!(allowed[&moving[3]], 6, "{allowed:?}");
}

/// The count `key`'s fixed window `limit` holds in the cluster.
fn stored_count(cluster: &RedisCluster, store: &RedisStore, key: &Key, limit: &Limit) -> u64 {
    let name = store.redis_key(key, limit);
    let state = cluster
        .cli(cluster.node_for_key(&name), &["GET", &name])
        .unwrap();
    u64::from(support::fixed_window_count(&state))
}

/// The number after `name` on the line of `info` that starts with `line`; 0 if none.
fn field(info: &str, line: &str, name: &str) -> u64 {
    info.lines()
        .find_map(|l| l.strip_prefix(line))
        .and_then(|l| l.split(name).nth(1))
        .and_then(|v| v.split(|c: char| !c.is_ascii_digit()).next())
        .and_then(|v| v.parse().ok())
        .unwrap_or(0)
}

/// Kill the master of many keys while they are checked at once: once its replica is
/// promoted, limiting comes back, and bursts of cold keys on the new master (pipelined to
/// its address, read from the refreshed slot map) decide exactly.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn after_a_failover_pipelined_calls_reach_the_new_master() {
    let mut cluster = RedisCluster::start();
    let store = connect(&cluster).await.with_block_cache(None);
    let limits = [Limit::fixed_window(3, HOUR).unwrap()];
    let loose = [Limit::fixed_window(1_000_000, HOUR).unwrap()];
    let master = cluster.masters()[0];
    let replica = cluster.replica_of(master);
    let keys = keys_on(&cluster, &store, &loose[0], master, "neighbour-", 20);

    let stop = Arc::new(AtomicBool::new(false));
    let mut streams = JoinSet::new();
    let tallies: Vec<Arc<Tally>> = keys
        .iter()
        .map(|key| stream(&mut streams, &store, key, &loose, 1, &stop))
        .collect();
    wait_until("requests before the kill", RESUME, || {
        tallies.iter().map(|t| t.answers()).sum::<u64>() >= 200
    })
    .await;
    cluster.kill(master);
    let slot = cluster.keyslot(&store.redis_key(&keys[0], &loose[0]));
    cluster.wait_for("the replica to take over", RESUME, |c| {
        c.all_agree_owner(slot, replica) && c.is_serving()
    });
    resumed(&store, &keys[0], &loose, "the promotion", RESUME).await;
    let before: u64 = tallies.iter().map(|t| t.get()[0]).sum();
    wait_until("requests after the failover", RESUME, || {
        tallies.iter().map(|t| t.get()[0]).sum::<u64>() >= before + 200
    })
    .await;
    join(streams, &stop).await;

    // Fresh keys of the promoted master, many at once (pipelined to its address once
    // the store has read the new slot map): exact.
    let fresh = keys_on(&cluster, &store, &limits[0], replica, "fresh-", 40);
    let allowed = burst(&store, &fresh, &limits, 5).await;
    assert!(allowed.iter().all(|&a| a == 3), "{allowed:?}");
    // One check per key at a time: on Redis 7 the promoted master gets them in shared
    // calls of <library>_fwn (its library came by replication), still exact.
    cluster.cli(replica, &["CONFIG", "RESETSTAT"]).unwrap();
    let fresher = keys_on(&cluster, &store, &limits[0], replica, "fresher-", 40);
    let mut allowed = vec![0; fresher.len()];
    for _ in 0..5 {
        for (total, got) in allowed
            .iter_mut()
            .zip(burst(&store, &fresher, &limits, 1).await)
        {
            *total += got;
        }
    }
    assert!(allowed.iter().all(|&a| a == 3), "{allowed:?}");
    if support::redis_server_major_version() >= 7 {
        let stats = cluster.cli(replica, &["INFO", "commandstats"]).unwrap();
        let calls = field(&stats, "cmdstat_fcall:", "calls=");
        assert!(
            calls > 0 && calls < 100,
            "200 checks in {calls} calls: {stats}"
        );
    }
}

/// A hot key's burst in a slot held `MIGRATING`, the key already on the importing node:
/// every coalesced call of the key is answered `ASK` by the source, two such calls are on
/// the wire at once (each its own batch), and each must reach the target right after an
/// `ASKING` of its own. A store that sends `ASKING` and its call apart on a shared
/// connection lets one call's `ASKING` be taken by the other: the call is answered
/// `MOVED` back to the source, which says `ASK` again, until the redirect surfaces as the
/// caller's error. Every request answers, and the count is exactly the requests allowed.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_hot_keys_burst_in_a_migrating_slot_follows_every_ask_and_counts_once() {
    const BURST: usize = 300;
    let cluster = RedisCluster::start();
    let first = connect(&cluster).await.with_block_cache(None);
    let limit = [Limit::fixed_window(1_000_000, HOUR).unwrap()];
    let hot = Key::new("hot");
    let name = first.redis_key(&hot, &limit[0]);
    let slot = cluster.keyslot(&name);
    let from = cluster.master_of_slot(slot);
    let to = *cluster.masters().iter().find(|&&m| m != from).unwrap();
    let mut allowed = 0;
    for _ in 0..5 {
        allowed += u64::from(check(&first, &hot, &limit).await.unwrap().is_allowed());
    }
    assert_eq!(cluster.begin_move(slot, to), from);
    let port = cluster.node(to).port().to_string();
    let migrate = ["MIGRATE", "127.0.0.1", &port, &name, "0", "5000"];
    assert_eq!(cluster.cli(from, &migrate).unwrap().trim(), "OK");
    let mut errors = Vec::new();
    for round in 0..6 {
        // A new store the first time (its slot map not read yet: the per-slot path),
        // then `first` (its own pipelines to the masters).
        let store = if round == 0 {
            connect(&cluster).await.with_block_cache(None)
        } else {
            first.clone()
        };
        let pending: Vec<_> = (0..BURST).map(|_| store.check(&hot, &limit, 1)).collect();
        for check in pending {
            match timeout(CHECK_TIMEOUT, check)
                .await
                .expect("a check answered in time")
            {
                Ok(decision) => allowed += u64::from(decision.is_allowed()),
                Err(error) => errors.push(format!(
                    "round {round}: {error}: {}",
                    std::error::Error::source(&error).map_or(String::new(), |e| e.to_string())
                )),
            }
        }
    }
    assert!(
        errors.is_empty(),
        "{} errors: {:?}",
        errors.len(),
        &errors[..errors.len().min(3)]
    );
    assert_eq!(allowed, 5 + 6 * BURST as u64);
    assert_eq!(
        cluster.move_slot(slot, to),
        0,
        "the key was on the target already"
    );
    assert_eq!(stored_count(&cluster, &first, &hot, &limit[0]), allowed);
    let errorstats = cluster.cli(from, &["INFO", "errorstats"]).unwrap();
    assert!(errorstats.contains("errorstat_ASK"), "{errorstats}");
}

/// The in-flight stage on a cluster: a batch's decisions (one fixed window and a permit
/// each) and its permits' releases (bare, and with a top-up) go per slot to the
/// library's function for them (`<library>_fi`) on every master, all-or-nothing: each
/// key's window counts exactly, at most `max` permits are held, and every permit comes
/// back.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn in_flight_calls_go_to_their_own_function_on_every_master() {
    use tollgate::{Adjustment, InFlightLimit};
    let cluster = RedisCluster::start();
    let store = connect(&cluster).await.with_block_cache(None);
    let functions = support::redis_server_major_version() >= 7;
    for master in cluster.masters() {
        let set = ["CONFIG", "SET", "slowlog-log-slower-than", "0"];
        cluster.cli(master, &set).unwrap();
        cluster
            .cli(master, &["CONFIG", "SET", "slowlog-max-len", "100000"])
            .unwrap();
        cluster.cli(master, &["SLOWLOG", "RESET"]).unwrap();
    }
    let limits = [Limit::fixed_window(5, HOUR).unwrap()];
    let cap = InFlightLimit::new(2)
        .unwrap()
        .with_permit_ttl(Duration::from_secs(60));
    let keys: Vec<Key> = (0..60).map(|i| Key::new(format!("client-{i}"))).collect();
    let mut allowed = vec![0u32; keys.len()];
    for round in 0..4 {
        // Three decisions per key at once: two permits at most.
        let checks: Vec<_> = keys
            .iter()
            .flat_map(|key| (0..3).map(|_| store.check_in_flight(key, &limits, 1, &cap, 0)))
            .collect();
        let mut permits = Vec::new();
        for (i, admitted) in futures_util::future::join_all(checks)
            .await
            .into_iter()
            .enumerate()
        {
            let (decision, permit) = admitted.unwrap().into_parts();
            assert_eq!(decision.is_allowed(), permit.is_some());
            if let Some(permit) = permit {
                allowed[i / 3] += 1;
                permits.push(permit);
            }
        }
        // In round 0 each key's third decision finds both permits held.
        if round == 0 {
            assert!(allowed.iter().all(|&a| a == 2), "{allowed:?}");
        }
        // Every other release tops the window up by one unit.
        let releases: Vec<_> = permits
            .into_iter()
            .enumerate()
            .map(|(i, permit)| {
                let adjustment = (i % 2 == 0).then_some(Adjustment::TopUp { units: 1 });
                store.release_in_flight(permit, &limits, adjustment)
            })
            .collect();
        for released in futures_util::future::join_all(releases).await {
            released.unwrap();
        }
    }
    for (key, &got) in keys.iter().zip(&allowed) {
        // Two allowed a round and one top-up each, up to the limit of 5: rounds 0 and 1.
        assert_eq!(got, 4, "{key:?}");
        assert_eq!(
            stored_count(&cluster, &store, key, &limits[0]),
            5,
            "{key:?}"
        );
        let permits = stored_card(&cluster, &format!("tollgate:{{{}}}:inflight", key.as_str()));
        assert_eq!(permits, 0, "{key:?}");
    }
    for master in cluster.masters() {
        let log = cluster.cli(master, &["SLOWLOG", "GET", "100000"]).unwrap();
        let lean = log.lines().filter(|l| l.trim().ends_with("_fi")).count();
        if functions {
            assert!(lean > 0, "node {master}: no call of <library>_fi");
        } else {
            assert_eq!(lean, 0, "node {master}");
        }
    }
}

/// The size of sorted set `name` in the cluster (0: no such key).
fn stored_card(cluster: &RedisCluster, name: &str) -> u64 {
    let card = cluster
        .cli(cluster.node_for_key(name), &["ZCARD", name])
        .unwrap();
    card.trim().parse().unwrap()
}
