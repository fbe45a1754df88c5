//! The script's source, joined from `lua/` at build time, and its `EVALSHA` handle.

use std::sync::LazyLock;

use redis::Script;

/// The script: the algorithms and the entry point, joined at build time, so that one
/// EVALSHA decides a batch of requests with several limits each.
pub const SCRIPT_SOURCE: &str = concat!(
    include_str!("../../../../lua/prelude.lua"),
    include_str!("../../../../lua/fixed_window.lua"),
    include_str!("../../../../lua/sliding_window.lua"),
    include_str!("../../../../lua/sliding_window_counter.lua"),
    include_str!("../../../../lua/token_bucket.lua"),
    include_str!("../../../../lua/gcra.lua"),
    include_str!("../../../../lua/in_flight.lua"),
    include_str!("../../../../lua/lease.lua"),
    include_str!("../../../../lua/lockout.lua"),
    include_str!("../../../../lua/main.lua"),
);

pub(crate) static SCRIPT: LazyLock<Script> = LazyLock::new(|| Script::new(SCRIPT_SOURCE));
