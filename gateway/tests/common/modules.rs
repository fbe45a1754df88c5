// The example gateway's modules, for the test crates that start gateways in-process
// (`tests/gateway.rs`, `tests/gateway_reload.rs`): `include!` this file at the crate root,
// where the modules' `crate::` paths expect each other. Not a module of `support`.

#[allow(dead_code)]
#[path = "../../examples/gateway/admin.rs"]
mod admin;
#[allow(dead_code)]
#[path = "../../examples/gateway/config.rs"]
mod config;
#[allow(dead_code)]
#[path = "../../examples/gateway/path.rs"]
mod path;
#[allow(dead_code)]
#[path = "../../examples/gateway/proxy.rs"]
mod proxy;
#[allow(dead_code)]
#[path = "../../examples/gateway/reload.rs"]
mod reload;
#[cfg(feature = "redis")]
#[allow(dead_code)]
#[path = "../../examples/gateway/rules_source.rs"]
mod rules_source;
#[allow(dead_code)]
#[path = "../../examples/gateway/serve.rs"]
mod serve;
#[allow(dead_code)]
#[path = "../../examples/gateway/server.rs"]
mod server;
