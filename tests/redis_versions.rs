//! The oldest Redis tollgate supports, 6.0, checked two ways:
//!
//! - here, without a server: every command the script calls, and every option it passes,
//!   must be in the table below with the Redis version that introduced it, and none may be
//!   newer than [`OLDEST`]. A command or option the table does not know fails the test, so
//!   a script change has to look its version up.
//! - against a real Redis 6.0 (`.ci/oldest-redis.sh`: the conformance suite, the Redis
//!   store tests and the ACL tests with `REDIS_SERVER` set to a 6.0.9 binary).

#![cfg(feature = "redis")]

use tollgate::store::SCRIPT_SOURCE;

/// The oldest supported Redis, as README.md states it.
const OLDEST: (u32, u32) = (6, 0);

/// Commands the script calls, and the version that introduced each in the form used.
const COMMANDS: &[(&str, (u32, u32), &str)] = &[
    ("GET", (1, 0), ""),
    ("INCRBY", (1, 0), ""),
    ("SET", (2, 6), "SET with PX is 2.6.12"),
    ("HMGET", (2, 0), ""),
    ("HSET", (4, 0), "several field-value pairs in one HSET"),
    ("PEXPIRE", (2, 6), ""),
    (
        "TIME",
        (5, 0),
        "TIME before writes in a script needs effects replication, the default since 5.0",
    ),
    ("ZADD", (2, 4), "several members in one ZADD"),
    ("ZCARD", (1, 2), ""),
    ("ZCOUNT", (2, 0), ""),
    ("ZRANGE", (1, 2), ""),
    ("ZRANGEBYSCORE", (2, 0), "with LIMIT"),
    ("ZRANK", (2, 0), ""),
    ("ZREM", (1, 2), ""),
    ("ZREMRANGEBYSCORE", (1, 2), ""),
];

/// Options (quoted upper-case words in a `redis.call` line) and their versions.
const OPTIONS: &[(&str, (u32, u32))] =
    &[("KEEPTTL", (6, 0)), ("PX", (2, 6)), ("WITHSCORES", (1, 2))];

/// What the script sends besides: `EVALSHA` and `SCRIPT LOAD` (2.6).
const CLIENT_COMMANDS: (u32, u32) = (2, 6);

fn script_calls() -> Vec<&'static str> {
    SCRIPT_SOURCE
        .lines()
        .filter(|line| !line.trim_start().starts_with("--"))
        .filter(|line| line.contains("redis.call("))
        .collect()
}

#[test]
fn every_command_the_script_calls_exists_in_the_oldest_supported_redis() {
    let calls = script_calls();
    assert!(
        calls.len() >= 10,
        "found only {} redis.call lines",
        calls.len()
    );
    for line in calls {
        // Every call on the line: `redis.call('CMD', args...)`.
        for call in line.split("redis.call(").skip(1) {
            check_call(line, call);
        }
    }
    assert!(CLIENT_COMMANDS <= OLDEST);
}

/// `call` is the text after one `redis.call(` of `line`.
fn check_call(line: &str, call: &str) {
    let command = call
        .strip_prefix('\'')
        .and_then(|rest| rest.split('\'').next())
        .unwrap_or_else(|| panic!("a redis.call without a literal command: {line}"));
    let (_, since, why) = COMMANDS
        .iter()
        .find(|(name, _, _)| *name == command)
        .unwrap_or_else(|| {
            panic!("{command} is not in the version table: look up when Redis added it")
        });
    assert!(
        *since <= OLDEST,
        "{command} needs Redis {since:?} ({why}), newer than the oldest supported {OLDEST:?}"
    );
    // Options: the quoted upper-case words after the command, up to the call's end.
    let arguments = call.split_once(')').map_or(call, |(inside, _)| inside);
    let after = arguments.split_once(&format!("'{command}'")).unwrap().1;
    for option in after.split('\'').skip(1).step_by(2) {
        if !option.is_empty() && option.chars().all(|c| c.is_ascii_uppercase()) {
            let (_, since) = OPTIONS
                .iter()
                .find(|(name, _)| *name == option)
                .unwrap_or_else(|| {
                    panic!("option {option} of {command} is not in the version table")
                });
            assert!(*since <= OLDEST, "{command} {option} needs Redis {since:?}");
        }
    }
}

/// Nothing of the newer scripting features: Functions (7.0), shebang flags (7.0).
#[test]
fn the_script_uses_no_redis_7_scripting_features() {
    assert!(
        !SCRIPT_SOURCE.starts_with("#!"),
        "script flags need Redis 7.0"
    );
    for newer in ["redis.register_function", "redis.REDIS_VERSION"] {
        assert!(
            !SCRIPT_SOURCE.contains(newer),
            "{newer} needs a newer Redis"
        );
    }
}

#[test]
fn the_readme_states_the_oldest_version() {
    let readme = include_str!("../README.md");
    assert!(
        readme.contains("Redis 6.0 or later"),
        "README.md must state the oldest supported Redis: 6.0"
    );
}
