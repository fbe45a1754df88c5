//! Peek and reset on Redis: the script with its peek flag, and one `DEL` of every key a
//! limit owns followed by a `PUBLISH` that tells the other replicas' block caches.

use redis::{Cmd, RedisResult, Value};

use super::{
    Connection, RedisStore, invalidate, invoke, parse, script_call, split_now, store_error,
};
use crate::{Decision, Limit, StoreError, key::Key, store::Check, store::Reset};

impl RedisStore {
    /// Every Redis key that holds state of `limit` for `key`: what a reset deletes. A
    /// change that gives a limit more state per key adds it here. The lockout key is
    /// deleted whether or not the limit has a lockout now (a block from before the lockout
    /// was removed is not read, but it is state of this limit all the same).
    pub(crate) fn state_keys(&self, key: &Key, limit: &Limit) -> impl Iterator<Item = String> {
        let limit_key = self.redis_key(key, limit);
        let block_key = super::lockout_key(&limit_key);
        [limit_key, block_key].into_iter()
    }

    /// The script, asked to decide without committing (a negative group index).
    pub(super) fn peek_check(&self, key: &Key, limits: &[Limit], cost: u32) -> Check {
        if limits.is_empty() {
            return Check::ready(Ok(Decision::unlimited()));
        }
        let mut encoded = self.encode(key, limits, cost);
        encoded.peek = true;
        let connection = self.connection.clone();
        let clock = self.clock.clone();
        Check::pending(async move {
            let now = clock.as_ref().map(|c| c.now_ms());
            let call = script_call(&connection.mode, now, &[&encoded]);
            let reply = invoke(connection, call).await?;
            let (values, at) = split_now(&reply, encoded.quotas.len() * 4);
            parse(values, &encoded.quotas, at)
        })
    }

    /// One `DEL` of all the state (one hash slot: the keys share the key's hash tag),
    /// then this store's block cache forgets the key and a `PUBLISH` tells the others.
    pub(super) fn reset_state(&self, key: &Key, limits: &[Limit]) -> Reset {
        let mut del = redis::cmd("DEL");
        let mut any = false;
        for limit in limits {
            for state_key in self.state_keys(key, limit) {
                del.arg(state_key);
                any = true;
            }
        }
        // This node's lease of the key goes (before the DEL, so that none of its units is
        // spent meanwhile, and after it, for a grant that arrived in between).
        let leases = self.leases.clone();
        let owned: Option<(Key, Vec<Limit>)> = leases.as_ref().map(|leases| {
            leases.forget(key, limits);
            (key.clone(), limits.to_vec())
        });
        let connection = self.connection.clone();
        let cache = self.block_cache.clone();
        let channel = invalidate::channel(&self.prefix);
        let key = key.as_str().to_owned();
        Box::pin(async move {
            if any {
                query(connection.clone(), &del).await?;
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
            if let Err(error) = query(connection, &publish).await {
                tracing::warn!(
                    error = %error.chain(),
                    "reset: state cleared, but other replicas were not told",
                );
            }
            Ok(())
        })
    }
}

/// Sends one command on whatever connection the store has.
pub(super) async fn query(connection: Connection, cmd: &Cmd) -> Result<Value, StoreError> {
    connection.ready()?;
    let result: RedisResult<Value> = match connection.link {
        super::Link::Manager(mut manager) => cmd.query_async(&mut manager).await,
        #[cfg(feature = "cluster")]
        super::Link::Cluster(mut cluster) => cmd.query_async(&mut cluster).await,
        #[cfg(feature = "bb8")]
        super::Link::Pool(pool) => {
            let mut connection = super::checkout(&pool).await?;
            cmd.query_async(&mut *connection).await
        }
        #[cfg(feature = "sentinel")]
        super::Link::Sentinel(sentinel) => return sentinel.query(cmd).await,
    };
    result.map_err(store_error)
}
