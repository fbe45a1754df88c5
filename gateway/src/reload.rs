//! Reloading the config while serving: on SIGHUP, and when the file's contents change.
//!
//! A reload validates the whole file exactly as at startup. A bad file is refused, with
//! the field in the log, and the running routes and limits stay; a good one replaces the
//! route table in one atomic swap, so the next request is routed and limited under the new
//! file while requests in flight finish under the old one, and no connection is touched.
//! Budgets live in the store, which a reload keeps: a limit that did not change keeps its
//! budget, a changed one resets or carries over (`on_change`).
//!
//! What a reload cannot change (the listeners, `[server]`, the store's backend and
//! prefix) keeps its running value, with a warning that names it: those need a restart.
//!
//! The file is polled (its contents, every `every`) rather than watched with inotify:
//! editors save by renaming a new file over the old one and Kubernetes swaps a ConfigMap
//! by moving a symlink, both of which a watch on the file misses, and inotify does not
//! work on every filesystem (network mounts, some container bind mounts). Reading a
//! config file of a few kilobytes twice a second costs nothing measurable, and comparing
//! contents also ignores a touch that changed nothing.

use std::{
    future::Future,
    path::PathBuf,
    sync::Arc,
    time::{Duration, SystemTime},
};

use tokio::sync::watch;

use crate::{
    config::{Config, ConfigError},
    server::Live,
};

/// `tollgate_gateway_rules_version`: the version of the rules in force (1 at start, one
/// more per applied reload).
pub(crate) const RULES_VERSION: &str = "tollgate_gateway_rules_version";
/// `tollgate_gateway_reloads_refused_total`: reloads refused because the new config was
/// invalid, or changed what a reload cannot (a route's `[routes.adaptive]`).
pub(crate) const RELOADS_REFUSED_TOTAL: &str = "tollgate_gateway_reloads_refused_total";

/// Config reloads by `result`: `applied` or `refused`.
pub(crate) const CONFIG_RELOADS_TOTAL: &str = "tollgate_gateway_config_reloads_total";
/// When the config in force was loaded: at start, then at each applied reload.
pub(crate) const CONFIG_LAST_RELOAD_SUCCESS: &str =
    "tollgate_gateway_config_last_reload_success_timestamp_seconds";

/// The config was loaded at start: the reload series start at zero.
pub(crate) fn loaded() {
    metrics::counter!(CONFIG_RELOADS_TOTAL, "result" => "applied").increment(0);
    metrics::counter!(CONFIG_RELOADS_TOTAL, "result" => "refused").increment(0);
    set_last_success();
}

/// A reload (of the file, or a rule set from Redis) was applied.
pub(crate) fn applied() {
    metrics::counter!(CONFIG_RELOADS_TOTAL, "result" => "applied").increment(1);
    set_last_success();
}

/// A reload was refused: the running config stays.
pub(crate) fn refused() {
    metrics::counter!(RELOADS_REFUSED_TOTAL).increment(1);
    metrics::counter!(CONFIG_RELOADS_TOTAL, "result" => "refused").increment(1);
}

fn set_last_success() {
    let now = SystemTime::now()
        .duration_since(SystemTime::UNIX_EPOCH)
        .map_or(0.0, |since| since.as_secs_f64());
    metrics::gauge!(CONFIG_LAST_RELOAD_SUCCESS).set(now);
}

/// How often the config file is read to see whether it changed.
pub(crate) const DEFAULT_POLL: Duration = Duration::from_millis(500);

/// Where the config comes from and what it was when last applied (or refused).
pub(crate) struct Watcher {
    path: PathBuf,
    live: Arc<Live>,
    /// The file's text last seen, so that an unchanged file is not reapplied and a bad
    /// one is refused once, not at every poll.
    seen: Option<String>,
}

impl Watcher {
    pub(crate) fn new(path: PathBuf, live: Arc<Live>) -> Self {
        let seen = std::fs::read_to_string(&path).ok();
        Self { path, live, seen }
    }

    /// Reads the file and applies it: the new rules version, or why it was refused.
    pub(crate) fn reload(&mut self) -> Result<u64, ConfigError> {
        let text = std::fs::read_to_string(&self.path);
        self.seen = text.as_ref().ok().cloned();
        let config = text
            .map_err(|e| ConfigError {
                field: String::new(),
                message: format!("cannot read {}: {e}", self.path.display()),
            })
            .and_then(|text| Config::parse(&text))
            .and_then(|config| self.live.apply(config));
        match config {
            Ok(version) => Ok(version),
            Err(error) => {
                refused();
                tracing::error!(
                    path = %self.path.display(),
                    field = error.field,
                    %error,
                    version = self.live.version(),
                    "config reload refused; the running config stays"
                );
                Err(error)
            }
        }
    }

    /// Reloads when the file's text differs from the last seen.
    fn reload_if_changed(&mut self) {
        // A file that cannot be read right now (being replaced) is looked at next time.
        let Ok(text) = std::fs::read_to_string(&self.path) else {
            return;
        };
        if self.seen.as_deref() != Some(text.as_str()) {
            tracing::info!(path = %self.path.display(), "config file changed; reloading");
            let _ = self.reload();
        }
    }

    /// Reloads on SIGHUP and when the file changes (read every `every`), until `stop`.
    /// SIGHUP is listened for from this call on (it must run inside the runtime), so a
    /// signal sent right after it is not missed.
    pub(crate) fn run(
        mut self,
        every: Duration,
        mut stop: watch::Receiver<bool>,
    ) -> impl Future<Output = ()> + Send + 'static {
        let mut hangup = Hangup::listen();
        async move {
            let mut poll = tokio::time::interval(every);
            poll.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
            loop {
                tokio::select! {
                    () = hangup.recv() => {
                        tracing::info!(path = %self.path.display(), "SIGHUP; reloading the config");
                        let _ = self.reload();
                    }
                    _ = poll.tick() => self.reload_if_changed(),
                    _ = stop.wait_for(|stop| *stop) => return,
                }
            }
        }
    }
}

/// SIGHUP, where there is one.
struct Hangup {
    #[cfg(unix)]
    signal: Option<tokio::signal::unix::Signal>,
}

impl Hangup {
    fn listen() -> Self {
        #[cfg(unix)]
        {
            use tokio::signal::unix::{SignalKind, signal};
            let signal = signal(SignalKind::hangup())
                .inspect_err(|error| {
                    tracing::error!(%error, "cannot listen for SIGHUP; reloading on file changes only");
                })
                .ok();
            Self { signal }
        }
        #[cfg(not(unix))]
        Self {}
    }

    async fn recv(&mut self) {
        #[cfg(unix)]
        if let Some(signal) = &mut self.signal
            && signal.recv().await.is_some()
        {
            return;
        }
        std::future::pending::<()>().await;
    }
}
