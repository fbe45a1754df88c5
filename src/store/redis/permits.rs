//! [`Permits`] in Redis, for [`InFlightLayer`](crate::in_flight::InFlightLayer): permits with a TTL,
//! renewed while they are held.
//!
//! The permits of one key are a sorted set `<prefix>:{<key>}:inflight:<max>` of permit
//! ids scored by the time (ms) their TTL ends. Taking a permit drops the ended ones,
//! counts the rest and adds one if there is room; a task renews it while the request
//! runs and removes it when it is released. A node that dies stops renewing, so its
//! permits end at most one TTL after its last renewal. A removal that fails (Redis out
//! of reach when the request ended) is tried again, after 100 ms and then less and less
//! often, for one TTL; if Redis does not answer in that time, the TTL ends the permit.
//!
//! A renewal that finds its permit gone (Redis restarted without it, a failover to a
//! replica that had not seen it, or its TTL ended while Redis was out of reach) adds it
//! back, even beyond the maximum: the request still runs, and counting it is the honest
//! count. New requests are then refused until enough running ones end; the alternative,
//! not counting it, would let up to `max` more in for as long as it runs.

use std::{
    sync::{
        LazyLock,
        atomic::{AtomicU64, Ordering},
    },
    time::Duration,
};

use redis::{Script, Value};
use tokio::sync::oneshot;

use super::{
    RedisStore,
    block_cache::BlockCache,
    encode::Encoded,
    keys::{in_flight_key, permits_key},
    link::Connection,
    local_now_ms,
};
use crate::{
    Adjustment, InFlightLimit, Limit, StoreError, StoreErrorKind,
    key::Key,
    store::{Acquired, Admitted, Check, Permit, Permits},
};

/// The in-flight script that takes a permit ([`Permits::acquire`](crate::algorithm::in_flight::Permits::acquire)).
///
/// `KEYS[1]`: the permits of one key. ARGV: now in ms ("" reads Redis
/// `TIME`), TTL ms, max permits, the permit id. Returns `{1, held}` when taken,
/// `{0, held}` when all `max` are held.
pub const ACQUIRE: &str = r"
local now = tonumber(ARGV[1])
if not now then
  local t = redis.call('TIME')
  now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
end
local lease = tonumber(ARGV[2])
redis.call('ZREMRANGEBYSCORE', KEYS[1], '-inf', now)
local held = redis.call('ZCARD', KEYS[1])
if held >= tonumber(ARGV[3]) then
  return {0, held}
end
redis.call('ZADD', KEYS[1], now + lease, ARGV[4])
local last = redis.call('ZRANGE', KEYS[1], -1, -1, 'WITHSCORES')
redis.call('PEXPIRE', KEYS[1], math.max(tonumber(last[2]) - now, 1))
return {1, held + 1}
";

/// The in-flight script that renews a permit ([`Permits::renew`](crate::algorithm::in_flight::Permits::renew)).
///
/// `KEYS[1]`: the permits of one key. ARGV: now ("" reads `TIME`), TTL
/// ms, the permit id. Returns 1 when the permit was held, 0 when it was gone (Redis lost
/// it in a restart or a failover, or its TTL ended while Redis was out of reach) and
/// is added back: the request still runs, so it counts, even if that makes more than
/// `max` held until enough requests end.
pub const RENEW: &str = r"
local now = tonumber(ARGV[1])
if not now then
  local t = redis.call('TIME')
  now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
end
local added = redis.call('ZADD', KEYS[1], now + tonumber(ARGV[2]), ARGV[3])
local last = redis.call('ZRANGE', KEYS[1], -1, -1, 'WITHSCORES')
redis.call('PEXPIRE', KEYS[1], math.max(tonumber(last[2]) - now, 1))
return 1 - added
";

static ACQUIRE_SCRIPT: LazyLock<Script> = LazyLock::new(|| Script::new(ACQUIRE));
static RENEW_SCRIPT: LazyLock<Script> = LazyLock::new(|| Script::new(RENEW));

/// Permit ids: unique per process (a random start) and between processes (the start is
/// 64 random bits from the standard library's hasher keys). In Redis, as 16 hex digits.
fn next_id() -> u64 {
    static NEXT: LazyLock<AtomicU64> = LazyLock::new(|| {
        use std::hash::{BuildHasher, RandomState};
        AtomicU64::new(RandomState::new().hash_one(std::process::id()))
    });
    NEXT.fetch_add(1, Ordering::Relaxed)
}

fn id_arg(id: u64) -> String {
    format!("{id:016x}")
}

/// Shared by every replica. A permit's renewal task ends when the permit is released (or
/// dropped), and then removes the permit (best effort: when that fails, its TTL ends it).
impl Permits for RedisStore {
    fn acquire(&self, key: &Key, max: u32, ttl: Duration) -> Check<Acquired> {
        Check::pending(self.acquire_permit(key, max, ttl))
    }

    fn release(&self, permit: Permit) {
        drop(permit);
    }
}

/// A permit asked for but not yet known to be held: removed when dropped (a timeout, a
/// client that hung up), because the script may have added it all the same.
struct Asking {
    release: Option<(Connection, String, String)>,
}

impl Drop for Asking {
    fn drop(&mut self) {
        if let Some((connection, key, id)) = self.release.take() {
            spawn_release(connection, key, id);
        }
    }
}

fn spawn_release(connection: Connection, key: String, id: String) {
    // Without a runtime the TTL ends the permit.
    if let Ok(runtime) = tokio::runtime::Handle::try_current() {
        runtime.spawn(release(connection, key, id));
    }
}

async fn release(connection: Connection, key: String, id: String) {
    let mut zrem = redis::cmd("ZREM");
    zrem.arg(&key).arg(&id);
    if let Err(error) = connection.query(&zrem).await {
        tracing::debug!(error = %error.chain(), "in-flight permit not released; its TTL ends it");
    }
}

impl RedisStore {
    /// Takes one of `max` permits of `key` for `ttl`, renewed every third of it until
    /// the returned permit is released.
    fn acquire_permit(
        &self,
        key: &Key,
        max: u32,
        ttl: Duration,
    ) -> impl Future<Output = Result<Acquired, StoreError>> + Send + 'static {
        let connection = self.connection.clone();
        let clock = self.clock.clone();
        let set = permits_key(&self.prefix, key, max);
        let key = key.clone();
        let id = next_id();
        let ttl_ms = u64::try_from(ttl.as_millis()).unwrap_or(u64::MAX).max(1);
        async move {
            let member = id_arg(id);
            let mut asking = Asking {
                release: Some((connection.clone(), set.clone(), member.clone())),
            };
            let now = clock.as_ref().map(|c| c.now_ms());
            let args = [
                now_arg(now),
                ttl_ms.to_string(),
                max.to_string(),
                member.clone(),
            ];
            let reply = run(&connection, &ACQUIRE_SCRIPT, &set, &args).await?;
            let (taken, held) = match &reply {
                Value::Array(values) => match values.as_slice() {
                    [Value::Int(taken), Value::Int(held)] => {
                        (*taken == 1, u64::try_from(*held).unwrap_or(0))
                    }
                    _ => return Err(unexpected(&reply)),
                },
                _ => return Err(unexpected(&reply)),
            };
            // From here the renewal task (or nobody, when denied) owns the permit.
            asking.release = None;
            let acquired = if taken {
                let (stop, stopped) = oneshot::channel();
                tokio::spawn(hold(connection, clock, set, member, ttl_ms, stopped));
                let permit = Permit::new(key, max, id).renewed_until_dropped(stop);
                Acquired::taken(permit, held)
            } else {
                Acquired::full(held)
            };
            Ok(match now {
                Some(now) => acquired.decided_at(now),
                None => acquired,
            })
        }
    }
}

fn unexpected(reply: &Value) -> StoreError {
    StoreError::new(
        StoreErrorKind::Response,
        format!("in-flight script returned {reply:?}"),
    )
}

fn now_arg(now: Option<u64>) -> String {
    now.map_or_else(String::new, |now| now.to_string())
}

/// Renews the permit every third of its TTL until `stopped` fires (its holder released
/// it), then removes it.
async fn hold(
    connection: Connection,
    clock: Option<std::sync::Arc<dyn crate::clock::Clock>>,
    set: String,
    id: String,
    ttl_ms: u64,
    mut stopped: oneshot::Receiver<()>,
) {
    let every = Duration::from_millis((ttl_ms / 3).max(1));
    loop {
        let sleep = std::pin::pin!(tokio::time::sleep(every));
        match futures_util::future::select(&mut stopped, sleep).await {
            futures_util::future::Either::Left(_) => break,
            futures_util::future::Either::Right(_) => {}
        }
        let now = clock.as_ref().map(|c| c.now_ms());
        let args = [now_arg(now), ttl_ms.to_string(), id.clone()];
        match run(&connection, &RENEW_SCRIPT, &set, &args).await {
            Ok(Value::Int(1)) => {}
            // Redis lost it (a restart, a failover) or its TTL ended while Redis was
            // out of reach: the request still runs, so it counts again.
            Ok(Value::Int(0)) => {
                tracing::warn!("in-flight permit lost by Redis; added back");
            }
            Ok(other) => {
                tracing::warn!(reply = ?other, "in-flight renewal: unexpected reply");
            }
            Err(error) => {
                tracing::warn!(error = %error.chain(), "in-flight permit not renewed");
            }
        }
    }
    give_back(connection, set, id, Duration::from_millis(ttl_ms)).await;
}

/// The first wait before a failed release is tried again; it doubles up to a third of the
/// TTL.
const RETRY_FIRST: Duration = Duration::from_millis(100);

/// Removes the permit of a request that ended. While Redis does not answer, tries again
/// (after 100 ms, doubling up to a third of the TTL) for one TTL: a permit given back
/// as soon as Redis answers again, and at the latest its TTL ends it. Removing our own
/// (unique) id late never takes anyone else's permit.
async fn give_back(connection: Connection, set: String, id: String, ttl: Duration) {
    let give_up = tokio::time::Instant::now() + ttl;
    let mut wait = RETRY_FIRST.min(ttl / 3);
    loop {
        let mut zrem = redis::cmd("ZREM");
        zrem.arg(&set).arg(&id);
        let Err(error) = connection.query(&zrem).await else {
            return;
        };
        if tokio::time::Instant::now() + wait >= give_up {
            tracing::debug!(error = %error.chain(), "in-flight permit not released; its TTL ends it");
            return;
        }
        tracing::debug!(error = %error.chain(), "in-flight permit not released yet; trying again");
        tokio::time::sleep(wait).await;
        wait = (wait * 2).min(ttl / 3);
    }
}

/// Runs `script` on `key` with `args`: EVALSHA, loading the script on NOSCRIPT.
async fn run(
    connection: &Connection,
    script: &Script,
    key: &str,
    args: &[String],
) -> Result<Value, StoreError> {
    let mut invocation = script.key(key);
    for arg in args {
        invocation.arg(arg);
    }
    connection.eval(&invocation).await
}

/// The in-flight limits of the pipeline ([`InFlightLimit`]): a permit taken in the same
/// script call as the request's rate limits (lua/in_flight.lua), and given back in the
/// same call as its adjustment. No renewal: a permit ends one TTL after it was taken.
impl RedisStore {
    /// [`Store::check_in_flight`](crate::store::Store::check_in_flight): one script call, queued
    /// with the other decisions (no lease is spent or asked, no cached denial answers
    /// it). Dropped before the answer (a timeout, a client that hung up), it removes its
    /// permit, which the script may have added all the same.
    pub(super) fn check_in_flight_call(
        &self,
        key: &Key,
        limits: &[Limit],
        cost: u32,
        in_flight: &InFlightLimit,
        reserve_ms: u64,
    ) -> Check<Admitted> {
        let id = next_id();
        let member = id_arg(id);
        let max = in_flight.max();
        let mut encoded = Encoded::in_flight(
            &self.prefix,
            key,
            limits,
            cost,
            None,
            self.connection.is_cluster(),
            (max, in_flight.permit_ttl_ms()),
            member.clone(),
        );
        encoded.reserve_ms = reserve_ms;
        let call = match self.send(encoded) {
            Ok(call) => call,
            Err(error) => return Check::ready(Err(error)),
        };
        let asking = Asking {
            release: Some((
                self.connection.clone(),
                in_flight_key(&self.prefix, key),
                member,
            )),
        };
        let key = key.clone();
        let denial = in_flight.denial();
        Check::pending(async move {
            let mut asking = asking;
            let result = call.decision().await;
            // Answered: the script took the permit only if it allowed the request.
            asking.release = None;
            let mut decision = result?;
            let cap = decision.pop_limit();
            let has_room = cap.as_ref().is_some_and(|cap| cap.allowed);
            if has_room && decision.is_allowed() {
                return Ok(Admitted::new(decision, Some(Permit::new(key, max, id))));
            }
            let decision = decision.with_cap((!has_room).then_some(denial));
            Ok(Admitted::new(decision, None))
        })
    }

    /// [`Store::release_in_flight`](crate::store::Store::release_in_flight): one script call
    /// that removes the permit and applies the adjustment (queued in order with the
    /// decisions, as [`Store::adjust`](crate::store::Store::adjust)).
    pub(super) fn release_in_flight_call(
        &self,
        permit: &Permit,
        limits: &[Limit],
        adjustment: Option<Adjustment>,
    ) -> Check {
        if let Some(settle @ Adjustment::Settle { .. }) = adjustment {
            // The settle of a lockout's pending units has no in-flight form: its own call,
            // queued first, then the permit alone; the caller waits for both as one.
            let settled = crate::store::Store::adjust(self, permit.key(), limits, settle);
            let released = self.release_in_flight_call(permit, limits, None);
            return Check::pending(async move {
                settled.await?;
                released.await
            });
        }
        let (units, at) = match adjustment {
            Some(Adjustment::Settle { .. }) => unreachable!("sent on its own above"),
            Some(Adjustment::Refund {
                units,
                charged_at_ms,
            }) => (units, i64::try_from(charged_at_ms).unwrap_or(i64::MAX)),
            Some(Adjustment::TopUp { units }) => (units, -1),
            None => (0, 0),
        };
        let key = permit.key();
        if let (Some(cache), Some(Adjustment::Refund { .. })) = (&self.block_cache, adjustment) {
            cache.forget(
                key,
                BlockCache::fingerprint(limits),
                local_now_ms(self.clock.as_ref()),
            );
        }
        // No units to move: the permit alone, as a refund of one unit of the in-flight
        // limit only ("-0" would read as a request of cost 0).
        let (limits, units, at) = if units == 0 || limits.is_empty() {
            (&[][..], 1, 0)
        } else {
            (limits, units, at)
        };
        let encoded = Encoded::in_flight(
            &self.prefix,
            key,
            limits,
            units,
            Some(at),
            self.connection.is_cluster(),
            (permit.max(), 1),
            id_arg(permit.id()),
        );
        match self.send(encoded) {
            Ok(call) => Check::pending(call.decision()),
            Err(error) => Check::ready(Err(error)),
        }
    }
}
