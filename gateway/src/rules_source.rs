//! Routes and limits from Redis (`[rules] source = "redis"`), so that a fleet of gateways
//! changes together.
//!
//! A rule set is the `[[routes]]` part of a config file, stored as text under
//! `<prefix>:rules`, with a counter `<prefix>:rules:version` that each publication
//! increments; the new version is then announced on the channel `<prefix>:rules`.
//! Every gateway applies a new version as the announcement arrives, and also checks the
//! counter every `check_interval` (1 s by default), so a missed announcement (a
//! reconnect, a replica that was starting) only delays a change. A rule set is validated
//! as a config file is: a bad one is refused with the field in the log and counted in
//! `tollgate_gateway_reloads_refused_total`, and the gateway keeps the last good one.
//!
//! `gateway --config FILE --publish-rules RULES` validates RULES and publishes it to the
//! Redis of FILE's `[store]`.

use std::{sync::Arc, time::Duration};

use futures_util::StreamExt;
use redis::AsyncCommands;
use tokio::sync::watch;

use crate::{
    config::{self, Route},
    server::{Error, Live},
};

/// Where a rule set lives: `<prefix>:rules` (the text, and the announcement channel) and
/// `<prefix>:rules:version`.
#[derive(Debug, Clone)]
pub(crate) struct Location {
    url: String,
    rules_key: String,
    version_key: String,
}

impl Location {
    pub(crate) fn new(url: &str, prefix: &str) -> Self {
        Self {
            url: url.to_owned(),
            rules_key: format!("{prefix}:rules"),
            version_key: format!("{prefix}:rules:version"),
        }
    }
}

/// Validates `text` as a rule set and publishes it: the new version.
pub(crate) async fn publish(location: &Location, text: &str) -> Result<u64, Error> {
    config::parse_rule_set(text).map_err(|e| format!("rule set: {e}"))?;
    let client = redis::Client::open(location.url.as_str())?;
    let mut connection = client.get_multiplexed_async_connection().await?;
    let (version,): (u64,) = redis::pipe()
        .atomic()
        .set(&location.rules_key, text)
        .ignore()
        .incr(&location.version_key, 1)
        .query_async(&mut connection)
        .await?;
    let _: i64 = connection.publish(&location.rules_key, version).await?;
    Ok(version)
}

/// The rule set stored now, if any: its version and routes, or why it is refused.
pub(crate) async fn fetch(
    connection: &mut redis::aio::ConnectionManager,
    location: &Location,
) -> Result<Option<(u64, Result<Vec<Route>, config::ConfigError>)>, redis::RedisError> {
    let (version, text): (Option<u64>, Option<String>) = redis::cmd("MGET")
        .arg(&location.version_key)
        .arg(&location.rules_key)
        .query_async(connection)
        .await?;
    Ok(match (version, text) {
        (Some(version), Some(text)) => Some((version, config::parse_rule_set(&text))),
        _ => None,
    })
}

/// Follows the rule set in Redis until `stop`: applies each new version to `live`.
pub(crate) struct Follower {
    location: Location,
    live: Arc<Live>,
    /// The last version applied or refused: each is looked at once.
    seen: Option<u64>,
}

impl Follower {
    pub(crate) fn new(location: Location, live: Arc<Live>, seen: Option<u64>) -> Self {
        Self {
            location,
            live,
            seen,
        }
    }

    /// Applies the stored rule set if its version is new.
    async fn check(&mut self, connection: &mut redis::aio::ConnectionManager) {
        let fetched = match fetch(connection, &self.location).await {
            Ok(fetched) => fetched,
            Err(error) => {
                tracing::warn!(%error, "cannot read the rule set from redis; retrying");
                return;
            }
        };
        let Some((version, routes)) = fetched else {
            return;
        };
        if self.seen == Some(version) {
            return;
        }
        self.seen = Some(version);
        match routes.and_then(|routes| self.live.apply_routes(routes)) {
            Ok(local) => {
                tracing::info!(
                    rules = version,
                    version = local,
                    "rule set from redis applied"
                );
            }
            Err(error) => {
                crate::reload::refused();
                tracing::error!(
                    rules = version,
                    field = error.field,
                    %error,
                    "rule set from redis refused; the last good one stays"
                );
            }
        }
    }

    /// Checks on every announcement and every `interval`, reconnecting as needed.
    pub(crate) async fn run(mut self, interval: Duration, mut stop: watch::Receiver<bool>) {
        let client = match redis::Client::open(self.location.url.as_str()) {
            Ok(client) => client,
            Err(error) => {
                tracing::error!(%error, "rule set: bad redis url; not following");
                return;
            }
        };
        let mut poll = tokio::time::interval(interval);
        poll.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        // Reconnects by itself once it exists.
        let mut connection = None;
        let mut announcements = None;
        // Whether the failure to subscribe was logged: once per run of failures.
        let mut refused = false;
        loop {
            if connection.is_none() {
                connection = redis::aio::ConnectionManager::new(client.clone())
                    .await
                    .ok();
            }
            if announcements.is_none() {
                match subscribe(&client, &self.location.rules_key).await {
                    Ok(stream) => {
                        announcements = Some(stream);
                        refused = false;
                    }
                    // An ACL without the channel, say: changes still arrive, a check later.
                    Err(error) if !refused => {
                        refused = true;
                        tracing::warn!(
                            %error,
                            channel = %self.location.rules_key,
                            "rule set: cannot subscribe to announcements; changes arrive \
                             with the next periodic check"
                        );
                    }
                    Err(_) => {}
                }
            }
            let announced = async {
                match &mut announcements {
                    Some(stream) => stream.next().await.is_some(),
                    None => std::future::pending().await,
                }
            };
            tokio::select! {
                still = announced => {
                    if !still {
                        // The subscription's connection ended: subscribe again, and look
                        // at once in case an announcement was lost.
                        announcements = None;
                    }
                }
                _ = poll.tick() => {}
                _ = stop.wait_for(|stop| *stop) => return,
            }
            if let Some(conn) = &mut connection {
                self.check(conn).await;
            }
        }
    }
}

async fn subscribe(
    client: &redis::Client,
    channel: &str,
) -> Result<redis::aio::PubSubStream, redis::RedisError> {
    let mut pubsub = client.get_async_pubsub().await?;
    pubsub.subscribe(channel).await?;
    Ok(pubsub.into_on_message())
}
