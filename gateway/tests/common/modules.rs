// The gateway's modules, for the test crates that start gateways in-process
// (`tests/gateway.rs`, `tests/gateway_reload.rs`, ...): `include!` this file at the crate
// root, where the modules' `crate::` paths expect each other. The modules are crate-private
// to the binary (no library target to keep stable), so the tests compile them again.

#[allow(dead_code)]
#[path = "../../src/admin.rs"]
mod admin;
#[allow(dead_code)]
#[path = "../../src/config.rs"]
mod config;
#[allow(dead_code)]
#[path = "../../src/front.rs"]
mod front;
#[allow(dead_code)]
#[path = "../../src/path.rs"]
mod path;
#[allow(dead_code)]
#[path = "../../src/proxy.rs"]
mod proxy;
#[allow(dead_code)]
#[path = "../../src/reload.rs"]
mod reload;
#[cfg(feature = "redis")]
#[allow(dead_code)]
#[path = "../../src/rules_source.rs"]
mod rules_source;
#[allow(dead_code)]
#[path = "../../src/routes.rs"]
mod routes;
#[allow(dead_code)]
#[path = "../../src/serve.rs"]
mod serve;
#[allow(dead_code)]
#[path = "../../src/server.rs"]
mod server;
#[allow(dead_code)]
#[path = "../../src/traffic.rs"]
mod traffic;
#[path = "../../src/upstream.rs"]
mod upstream;
