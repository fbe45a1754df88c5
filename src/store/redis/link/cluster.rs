//! `ASK` on the cluster connection's per-slot path: followed once more, `ASKING` and the
//! call in one pipeline to the node it names.

use redis::{
    ErrorKind, RedisError, RedisResult, ServerErrorKind, Value, aio::ConnectionLike,
    cluster_async::ClusterConnection, cluster_routing::SingleNodeRoutingInfo,
};

use crate::store::redis::wire::function;

/// A call the cluster connection gave up on with `error`: an `ASK` (its slot is being
/// migrated and its keys are gone, so it never ran) is followed once more, to the node it
/// names, `ASKING` and the call in one pipeline; any other error stands.
///
/// redis-rs follows `ASK` itself, but sends `ASKING` apart from the call on the node's
/// shared connection: another call redirected there at the same moment (a hot key's two
/// batches on the wire) can take the `ASKING`, and the call is answered `MOVED` back to
/// the source, which says `ASK` again, until its retries run out and the redirect reached
/// the caller as a store error during a resharding.
pub(crate) async fn follow_ask(
    cluster: &mut ClusterConnection,
    mode: &function::Mode,
    call: &redis::Cmd,
    error: RedisError,
) -> RedisResult<Vec<i64>> {
    if error.kind() != ErrorKind::Server(ServerErrorKind::Ask) {
        return Err(error);
    }
    let Some((host, port)) = error
        .redirect_node()
        .and_then(|(node, _)| node.rsplit_once(':'))
        .and_then(|(host, port)| Some((host.to_owned(), port.parse().ok()?)))
    else {
        return Err(error);
    };
    let mut asking = Asking {
        cluster,
        route: SingleNodeRoutingInfo::ByAddress { host, port },
    };
    // `run`: a missing function or script on the target is loaded there (after `ASKING`
    // as well, which changes nothing for those commands) and the call sent once more.
    mode.run(&mut asking, call).await
}

/// The cluster connection, each command sent to one node right after `ASKING`, in one
/// pipeline (one write on that node's connection: nothing comes in between).
struct Asking<'a> {
    cluster: &'a mut ClusterConnection,
    route: SingleNodeRoutingInfo,
}

impl ConnectionLike for Asking<'_> {
    fn req_packed_command<'a>(&'a mut self, cmd: &'a redis::Cmd) -> redis::RedisFuture<'a, Value> {
        Box::pin(async move {
            let mut pipeline = redis::pipe();
            pipeline.add_command(redis::cmd("ASKING"));
            pipeline.add_command(cmd.clone());
            let mut values = self
                .cluster
                .route_pipeline(pipeline, 1, 1, self.route.clone())
                .await?;
            values.pop().ok_or_else(|| {
                RedisError::from((ErrorKind::Client, "a pipeline's answers ran short"))
            })
        })
    }

    fn req_packed_commands<'a>(
        &'a mut self,
        pipeline: &'a redis::Pipeline,
        offset: usize,
        count: usize,
    ) -> redis::RedisFuture<'a, Vec<Value>> {
        // Only single commands are sent this way (`Mode::run`).
        self.cluster.req_packed_commands(pipeline, offset, count)
    }

    fn get_db(&self) -> i64 {
        0
    }
}
