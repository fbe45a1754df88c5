//! An HTTP gateway that rate-limits routes and proxies them to upstreams, configured by a
//! TOML file.
//!
//! ```text
//! cargo run --release -p tollgate-gateway -- --config gateway/gateway.toml
//! cargo run --release -p tollgate-gateway       # demo: 5 requests per 10s per IP on /
//! cargo run --release -p tollgate-gateway --features redis,metrics -- --config ...
//! ```
//!
//! Modules: `config` (the TOML contract and its validation), `path` (path normalisation
//! and prefix matching), `proxy` (forwarding: headers, errors), `upstream` (the upstream
//! connections, driven by the requests that use them), `serve` (connections:
//! header-read timeout, connection cap, bounded shutdown, a worker thread per core), `routes` (each route's layers, and what a reload keeps of them), `server` (starting, reloading and stopping), `front` (the main listener's service), `reload` (SIGHUP and file changes), `traffic` (the HTTP traffic metrics). `tests/gateway.rs` includes the same modules to start
//! gateways in-process. The reference is `README.md` (of this package).

mod admin;
mod config;
mod front;
mod path;
mod proxy;
mod reload;
mod routes;
#[cfg(feature = "redis")]
mod rules_source;
mod serve;
mod server;
mod traffic;
mod upstream;

use std::{path::PathBuf, process::ExitCode};

use tracing_subscriber::EnvFilter;

/// The binary's allocator (see Cargo.toml).
#[global_allocator]
static ALLOCATOR: mimalloc::MiMalloc = mimalloc::MiMalloc;

const USAGE: &str = "\
usage: gateway [--config PATH]
       gateway --config PATH --publish-rules RULES

Rate-limiting HTTP gateway (tollgate example). Without --config it listens on
127.0.0.1:8080 with the in-memory store and a demo limit on / (5 requests per 10s
per client IP). With --config, SIGHUP or an edit of the file reloads it.
--publish-rules validates RULES (a file of [[routes]]) and publishes it to the Redis
of the config's [store], for gateways with [rules] source = \"redis\".
Logs: RUST_LOG (default info). Reference: gateway/README.md";

fn main() -> ExitCode {
    let config_path = match parse_args(std::env::args_os().skip(1)) {
        Ok(Some(Args::Help)) => {
            println!("{USAGE}");
            return ExitCode::SUCCESS;
        }
        Ok(Some(Args::Config(path))) => Some(path),
        Ok(Some(Args::Publish { config, rules })) => return publish_rules(&config, &rules),
        Ok(None) => None,
        Err(message) => {
            eprintln!("gateway: {message}\n\n{USAGE}");
            return ExitCode::from(2);
        }
    };
    // The whole config is validated before anything starts.
    let config = match &config_path {
        Some(path) => match config::Config::load(path) {
            Ok(config) => config,
            Err(error) => {
                eprintln!("gateway: {}: {error}", path.display());
                return ExitCode::from(2);
            }
        },
        None => config::Config::demo(),
    };
    // Logs go to stderr (stdout carries only the addresses, for scripts), in colour only
    // when stderr is a terminal: a log file or collector gets no escape codes.
    tracing_subscriber::fmt()
        .with_env_filter(
            EnvFilter::try_from_default_env().unwrap_or_else(|_| EnvFilter::new("info")),
        )
        .with_writer(std::io::stderr)
        .with_ansi(std::io::IsTerminal::is_terminal(&std::io::stderr()))
        .init();
    if config_path.is_none() {
        tracing::info!("no --config: demo config, 5 requests per 10s per client IP on /");
    }
    let runtime = match tokio::runtime::Runtime::new() {
        Ok(runtime) => runtime,
        Err(error) => {
            eprintln!("gateway: cannot start the runtime: {error}");
            return ExitCode::FAILURE;
        }
    };
    runtime.block_on(async {
        let mut running = match server::start(config).await {
            Ok(running) => running,
            Err(error) => {
                eprintln!("gateway: {error}");
                return ExitCode::FAILURE;
            }
        };
        if let Some(path) = config_path {
            // SIGHUP or an edit of the file reloads it (see reload.rs).
            running.watch(path, reload::DEFAULT_POLL);
        }
        println!("listening on http://{}", running.addr());
        if let Some(admin) = running.admin_addr() {
            println!("metrics on http://{admin}/metrics");
        }
        match running.run_until(shutdown_signal()).await {
            Ok(()) => ExitCode::SUCCESS,
            Err(error) => {
                eprintln!("gateway: {error}");
                ExitCode::FAILURE
            }
        }
    })
}

enum Args {
    Help,
    Config(PathBuf),
    Publish { config: PathBuf, rules: PathBuf },
}

fn parse_args(mut args: impl Iterator<Item = std::ffi::OsString>) -> Result<Option<Args>, String> {
    let mut config = None;
    let mut publish = None;
    while let Some(arg) = args.next() {
        let arg = arg
            .into_string()
            .map_err(|arg| format!("unexpected argument {arg:?}"))?;
        match arg.as_str() {
            "-h" | "--help" => return Ok(Some(Args::Help)),
            "--config" | "-c" => {
                let path = args.next().ok_or("--config needs a path")?;
                config = Some(PathBuf::from(path));
            }
            "--publish-rules" => {
                let path = args.next().ok_or("--publish-rules needs a path")?;
                publish = Some(PathBuf::from(path));
            }
            other => match other.strip_prefix("--config=") {
                Some(path) => config = Some(PathBuf::from(path)),
                None => return Err(format!("unexpected argument {other:?}")),
            },
        }
    }
    match (config, publish) {
        (Some(config), Some(rules)) => Ok(Some(Args::Publish { config, rules })),
        (None, Some(_)) => {
            Err("--publish-rules needs --config (for the store's url and prefix)".into())
        }
        (config, None) => Ok(config.map(Args::Config)),
    }
}

/// `--publish-rules`: validates the rule set and publishes it to the config's Redis.
fn publish_rules(config: &std::path::Path, rules: &std::path::Path) -> ExitCode {
    let config = match config::Config::load(config) {
        Ok(config) => config,
        Err(error) => {
            eprintln!("gateway: {}: {error}", config.display());
            return ExitCode::from(2);
        }
    };
    let text = match std::fs::read_to_string(rules) {
        Ok(text) => text,
        Err(error) => {
            eprintln!("gateway: cannot read {}: {error}", rules.display());
            return ExitCode::from(2);
        }
    };
    #[cfg(feature = "redis")]
    {
        let config::Backend::Redis { url } = &config.store.backend else {
            eprintln!("gateway: --publish-rules needs store.backend = \"redis\"");
            return ExitCode::from(2);
        };
        let location = rules_source::Location::new(url, &config.store.prefix);
        let published = tokio::runtime::Runtime::new()
            .map_err(|e| -> server::Error { e.into() })
            .and_then(|runtime| runtime.block_on(rules_source::publish(&location, &text)));
        match published {
            Ok(version) => {
                println!("published rule set version {version}");
                ExitCode::SUCCESS
            }
            Err(error) => {
                eprintln!("gateway: {}: {error}", rules.display());
                ExitCode::from(2)
            }
        }
    }
    #[cfg(not(feature = "redis"))]
    {
        let _ = (config, text);
        eprintln!("gateway: --publish-rules needs the gateway built with the redis feature");
        ExitCode::from(2)
    }
}

/// Resolves on SIGINT (Ctrl-C) or SIGTERM.
async fn shutdown_signal() {
    let ctrl_c = async {
        if let Err(error) = tokio::signal::ctrl_c().await {
            tracing::error!(%error, "cannot listen for Ctrl-C");
            std::future::pending::<()>().await;
        }
    };
    #[cfg(unix)]
    let terminate = async {
        match tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate()) {
            Ok(mut signal) => {
                signal.recv().await;
            }
            Err(error) => {
                tracing::error!(%error, "cannot listen for SIGTERM");
                std::future::pending::<()>().await;
            }
        }
    };
    #[cfg(not(unix))]
    let terminate = std::future::pending::<()>();
    tokio::select! {
        () = ctrl_c => {}
        () = terminate => {}
    }
}
