//! Waiting on a `RedisStore` through a failover (`tests/cluster.rs`, `tests/sentinel.rs`):
//! every check under a timeout, so that a hang fails instead of blocking, and every wait
//! polled with a deadline.

use std::time::{Duration, Instant};

use tokio::time::timeout;
use tollgate::{
    Decision, Limit, StoreError,
    key::Key,
    store::{RedisStore, Store},
};

/// A check slower than this is a hang.
pub const CHECK_TIMEOUT: Duration = Duration::from_secs(5);

/// One check that must answer in time: a decision or a `StoreError`, never a hang.
pub async fn check(
    store: &RedisStore,
    key: &Key,
    limits: &[Limit],
) -> Result<Decision, StoreError> {
    timeout(CHECK_TIMEOUT, store.check(key, limits, 1))
        .await
        .unwrap_or_else(|_| panic!("a check did not answer within {CHECK_TIMEOUT:?}"))
}

/// Polls `done` every 10 ms; panics naming `what` after `limit`. Returns the time taken.
pub async fn wait_until(what: &str, limit: Duration, mut done: impl FnMut() -> bool) -> Duration {
    let start = Instant::now();
    while !done() {
        assert!(start.elapsed() < limit, "waited {limit:?} for {what}");
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    start.elapsed()
}

/// Checks `key` every 10 ms until the store decides again (an allowed request, which
/// `limits` must leave room for); panics naming `after` with the last error once `limit`
/// has passed. Returns the time taken.
pub async fn resumed(
    store: &RedisStore,
    key: &Key,
    limits: &[Limit],
    after: &str,
    limit: Duration,
) -> Duration {
    let start = Instant::now();
    let mut tries = 0;
    loop {
        tries += 1;
        match check(store, key, limits).await {
            Ok(decision) => {
                assert!(decision.is_allowed());
                return start.elapsed();
            }
            Err(error) => assert!(
                start.elapsed() < limit,
                "no decision {limit:?} after {after} ({tries} tries): {error}"
            ),
        }
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
}
