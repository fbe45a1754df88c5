//! The request path of the [`RedisStore`]: a decision through the leases, the block
//! cache and the coalescer (or a call of its own), and the calls that come back.

use std::sync::Arc;

use futures_util::future::BoxFuture;
use tokio::sync::oneshot;

use super::{
    batch::Submitted,
    block_cache::{BlockCache, local_now_ms},
    encode::{Encoded, Rider, parse, script_call, split_now},
    lease::Spent,
};
use crate::store::Check;
use crate::{Adjustment, Decision, Limit, StoreError, StoreErrorKind, clock::Clock, key::Key};

use super::RedisStore;

impl RedisStore {
    /// [`Store::check`], reserving up to `reserve_ms` ahead when it is not 0
    /// ([`Store::reserve`]).
    pub(super) fn decide(&self, key: &Key, limits: &[Limit], cost: u32, reserve_ms: u64) -> Check {
        let mut lease_entry = None;
        if let Some(leases) = &self.leases {
            if reserve_ms > 0 {
                if let Some(decision) = leases.spend_held(key, limits, cost) {
                    return Check::ready(Ok(decision));
                }
            } else {
                match leases.spend(key, limits, cost) {
                    Spent::Here(decision) => return Check::ready(Ok(decision)),
                    Spent::Redis(entry) => lease_entry = entry,
                }
            }
        }
        // A request that can never fit is not "blocked until" anything: Redis answers it.
        let fits_at_all = limits.iter().all(|l| cost <= l.capacity());
        let block_cache = match &self.block_cache {
            Some(cache) => {
                let fingerprint = BlockCache::fingerprint(limits);
                if fits_at_all {
                    let now = local_now_ms(self.clock.as_ref());
                    if let Some(decision) = cache.get(key, fingerprint, cost, now)
                        && (reserve_ms == 0 || decision.retry_after_ms() > reserve_ms)
                    {
                        // A lease due for a refill still pays before a cached denial answers.
                        if let (Some(leases), Some(_)) = (&self.leases, &lease_entry)
                            && let Some(decision) = leases.spend_held(key, limits, cost)
                        {
                            return Check::ready(Ok(decision));
                        }
                        return Check::ready(Ok(decision));
                    }
                }
                Some((cache.clone(), key.clone(), fingerprint, cache.generation()))
            }
            None => None,
        };
        let mut encoded = self.encode(key, limits, cost);
        encoded.reserve_ms = reserve_ms;
        if let (Some(leases), Some(entry)) = (&self.leases, lease_entry) {
            match leases.attach(entry, limits, cost) {
                Ok(attach) => {
                    encoded.lease = attach.map(|attach| Arc::new(attach) as Arc<dyn Rider>);
                }
                Err(decision) => return Check::ready(Ok(decision)),
            }
        }
        let call = match self.send(encoded) {
            Ok(call) => call,
            Err(error) => return Check::ready(Err(error)),
        };
        let clock = self.clock.clone();
        Check::pending(async move {
            let decision = call.decision().await?;
            if let Some((cache, key, fingerprint, generation)) = block_cache {
                let now = local_now_ms(clock.as_ref());
                if !fits_at_all {
                    // Not cached, but a lockout it ran into may have started a block
                    // (its only write), which a cached denial of the key would not show.
                    if decision.blocked_ms() > 0 {
                        cache.forget(&key, fingerprint, now);
                    }
                } else if decision.is_allowed() {
                    cache.forget(&key, fingerprint, now);
                } else {
                    cache.insert(key, fingerprint, cost, now, &decision, generation);
                }
            }
            Ok(decision)
        })
    }

    /// Queues `encoded` for the batching task, or (coalescing off, or no runtime to run
    /// the task on) starts its own script call.
    pub(super) fn send(&self, encoded: Encoded) -> Result<Call, StoreError> {
        self.connection.ready()?;
        let encoded = match self.coalescer() {
            Some(coalescer) => match coalescer.submit(encoded) {
                Submitted::Queued(reply) => return Ok(Call::Queued(reply)),
                Submitted::Refused(error) => return Err(error),
                Submitted::NoRuntime(encoded) => *encoded,
            },
            None => encoded,
        };
        let connection = self.connection.clone();
        let clock = self.clock.clone();
        // Boxed on its own: the call's futures would otherwise size every decision's
        // future, queued ones included, for this rarer path.
        Ok(Call::Direct(Box::pin(async move {
            let now = clock.as_ref().map(|c| c.now_ms());
            let call = script_call(&connection.mode, now, &[&encoded]);
            let reply = connection.invoke(&call).await;
            let len = encoded.quotas.len() * 4;
            // The request's results, its ask's (when it asked), then `now`.
            let asked = encoded.grant_len();
            let (decision, grant) = match &reply {
                Ok(reply) => {
                    let (values, at) = split_now(reply, len + asked);
                    let (own, grant) = values.split_at(len.min(values.len()));
                    (parse(own, &encoded.quotas, at), Some(grant))
                }
                Err(error) => (Err(error.clone()), None),
            };
            match &encoded.lease {
                Some(attach) => attach.settle(&encoded, decision, grant),
                None => decision,
            }
        })))
    }
}

impl RedisStore {
    /// [`Store::adjust`]: one script call (coalesced with the decisions waiting at the
    /// same moment, so it keeps its place in their order). A refund drops the key's
    /// cached denial here (it may fit earlier now); other replicas' block caches keep
    /// theirs until its `retry_after`, denying no more than they would have.
    pub(super) fn adjust_call(&self, key: &Key, limits: &[Limit], adjustment: Adjustment) -> Check {
        if let Adjustment::Settle {
            charged,
            kept,
            charged_at_ms,
        } = adjustment
            && charged > 0
        {
            return self.settle_call(key, limits, charged, kept, charged_at_ms);
        }
        let Some(adjustment) = adjustment.to_states() else {
            // Settles nothing pending, and moves nothing.
            return Check::ready(Ok(Decision::unlimited()));
        };
        let (units, at) = match adjustment {
            Adjustment::Refund {
                units,
                charged_at_ms,
            } => (units, i64::try_from(charged_at_ms).unwrap_or(i64::MAX)),
            Adjustment::TopUp { units } => (units, -1),
            // (Made a refund or a top-up above.)
            Adjustment::Settle { .. } => return Check::ready(Ok(Decision::unlimited())),
        };
        if units == 0 {
            // Nothing to move, and "-0" would read as a request of cost 0.
            return Check::ready(Ok(Decision::unlimited()));
        }
        if let (Some(cache), Adjustment::Refund { .. }) = (&self.block_cache, adjustment) {
            let now = local_now_ms(self.clock.as_ref());
            cache.forget(key, BlockCache::fingerprint(limits), now);
        }
        let encoded = self.encode_as(key, limits, units, Some(at));
        match self.send(encoded) {
            Ok(call) => Check::pending(call.decision()),
            Err(error) => Check::ready(Err(error)),
        }
    }
}

impl RedisStore {
    /// [`adjust_call`](Self::adjust_call) for a settle: one script call ends the pending
    /// units (of the limits that count them) and moves the difference (lua/main.lua).
    fn settle_call(
        &self,
        key: &Key,
        limits: &[Limit],
        charged: u32,
        kept: u32,
        charged_at_ms: u64,
    ) -> Check {
        if kept < charged
            && let Some(cache) = &self.block_cache
        {
            let now = local_now_ms(self.clock.as_ref());
            cache.forget(key, BlockCache::fingerprint(limits), now);
        }
        let at = i64::try_from(charged_at_ms).unwrap_or(i64::MAX);
        let mut encoded = self.encode_as(key, limits, charged, Some(at));
        encoded.kept = Some(kept);
        match self.send(encoded) {
            Ok(call) => Check::pending(call.decision()),
            Err(error) => Check::ready(Err(error)),
        }
    }
}

/// How a decision reaches Redis: queued for the batching task, or its own script call.
pub(super) enum Call {
    Queued(oneshot::Receiver<Result<Decision, StoreError>>),
    Direct(BoxFuture<'static, Result<Decision, StoreError>>),
}

impl Call {
    pub(super) async fn decision(self) -> Result<Decision, StoreError> {
        match self {
            Call::Queued(reply) => reply.await.unwrap_or_else(|_| {
                Err(StoreError::new(
                    StoreErrorKind::Unavailable,
                    "the batch task stopped",
                ))
            }),
            Call::Direct(call) => call.await,
        }
    }
}
