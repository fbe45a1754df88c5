//! One script call for a batch of requests, and every request's share of its reply (or
//! its error): what the batching task and the cluster's per-node pipelines both send and
//! deliver.

use std::sync::Arc;

use tokio::sync::{OwnedSemaphorePermit, oneshot};

use super::{
    encode::{Encoded, parse, script_call, split_now, standalone_call},
    link::Connection,
};
use crate::{Decision, StoreError};

/// Where a request's decision goes.
pub(crate) type Reply = oneshot::Sender<Result<Decision, StoreError>>;

/// The requests of one script call.
pub(crate) type Batch = Vec<(Encoded, Reply)>;

/// One script call for `batch`; every request gets its share of the reply.
pub(crate) async fn send(
    batch: Batch,
    connection: Connection,
    now: Option<u64>,
    _permit: Arc<OwnedSemaphorePermit>,
) {
    let requests: Vec<&Encoded> = batch.iter().map(|(r, _)| r).collect();
    // A call without declared keys would go to any node of a cluster.
    let call = if connection.is_cluster() {
        script_call(&connection.mode, now, &requests)
    } else {
        standalone_call(&connection.mode, now, &requests)
    };
    let result = connection.invoke(&call).await;
    drop(requests);
    deliver(batch, &result);
}

/// Gives the requests of `batch` (no lease rides on them) the decision in `share`, four
/// values per limit, decided at `now`.
#[cfg(feature = "cluster")]
pub(crate) fn deliver_share(batch: Batch, share: &[i64], now: Option<i64>) {
    for (request, reply_to) in batch {
        let _ = reply_to.send(parse(share, &request.quotas, now));
    }
}

/// Gives every request of `batch` its share of the script's reply (or the error).
pub(crate) fn deliver(batch: Batch, result: &Result<Vec<i64>, StoreError>) {
    let requests: Vec<&Encoded> = batch.iter().map(|(r, _)| r).collect();
    // The reply: every request's results in order, then the asks' results in the same
    // order, then the script's `now` (lua/main.lua).
    let own: usize = requests.iter().map(|r| r.quotas.len() * 4).sum();
    let asked: usize = requests.iter().map(|r| r.grant_len()).sum();
    let reply = result.as_ref().map(|values| split_now(values, own + asked));
    drop(requests);
    let mut offset = 0;
    let mut tail = own;
    for (request, reply_to) in batch {
        let len = request.quotas.len() * 4;
        let mut decision = match &reply {
            Ok((values, at)) => {
                let share = values.get(offset..offset + len).unwrap_or_default();
                parse(share, &request.quotas, *at)
            }
            Err(error) => Err((*error).clone()),
        };
        offset += len;
        if let Some(attach) = &request.lease {
            let len = request.grant_len();
            let grant = reply
                .as_ref()
                .ok()
                .and_then(|(values, _)| values.get(tail..tail + len));
            tail += len;
            decision = attach.settle(&request, decision, grant);
        }
        // The caller may have given up (timeout); the decision stands all the same.
        let _ = reply_to.send(decision);
    }
}
