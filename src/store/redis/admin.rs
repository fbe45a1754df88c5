//! Peek and reset on Redis: the script with its peek flag, and one `DEL` of every key a
//! limit owns followed by a `PUBLISH` that tells the other replicas' block caches.

use std::sync::Arc;

use super::{
    block_cache::BlockCache,
    encode::{Encoded, parse, script_call, split_now},
    keys::{reset_channel, state_keys},
    lease::Leases,
    link::Connection,
};
use crate::{
    Limit,
    clock::Clock,
    key::Key,
    store::{Check, Reset},
};

/// The script, asked to decide `encoded` without committing (a negative group index).
pub(crate) fn peek(
    connection: Connection,
    clock: Option<Arc<dyn Clock>>,
    mut encoded: Encoded,
) -> Check {
    encoded.peek = true;
    Check::pending(async move {
        let now = clock.as_ref().map(|c| c.now_ms());
        let call = script_call(&connection.mode, now, &[&encoded]);
        let reply = connection.invoke(&call).await?;
        let (values, at) = split_now(&reply, encoded.quotas.len() * 4);
        parse(values, &encoded.quotas, at)
    })
}

/// One `DEL` of all the state of `key` under `limits` (one hash slot: the keys share the
/// key's hash tag), then this store's block cache forgets the key and a `PUBLISH` tells
/// the others.
pub(crate) fn reset(
    connection: Connection,
    prefix: &str,
    key: &Key,
    limits: &[Limit],
    leases: Option<Arc<Leases>>,
    cache: Option<Arc<BlockCache>>,
) -> Reset {
    let mut del = redis::cmd("DEL");
    let mut any = false;
    for limit in limits {
        for state_key in state_keys(prefix, key, limit) {
            del.arg(state_key);
            any = true;
        }
    }
    // This node's lease of the key goes (before the DEL, so that none of its units is
    // spent meanwhile, and after it, for a grant that arrived in between).
    let owned: Option<(Key, Vec<Limit>)> = leases.as_ref().map(|leases| {
        leases.forget(key, limits);
        (key.clone(), limits.to_vec())
    });
    let channel = reset_channel(prefix);
    let key = key.as_str().to_owned();
    Box::pin(async move {
        if any {
            connection.query(&del).await?;
        }
        if let (Some(leases), Some((key, limits))) = (&leases, &owned) {
            leases.forget(key, limits);
        }
        if let Some(cache) = cache {
            cache.reset(&key);
        }
        let mut publish = redis::cmd("PUBLISH");
        publish.arg(channel).arg(&key);
        // The state is gone either way; other replicas' denials then last at most
        // their retry_after.
        if let Err(error) = connection.query(&publish).await {
            tracing::warn!(
                error = %error.chain(),
                "reset: state cleared, but other replicas were not told",
            );
        }
        Ok(())
    })
}
