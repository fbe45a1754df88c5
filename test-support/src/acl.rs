//! ACL users on a test server, from the least-privilege line the guide documents, so that
//! the line users paste is the one the tests run with.

use super::RedisServer;

/// The password the tests give their ACL users.
pub const PASSWORD: &str = "s3cret-test-password";

/// The `ACL SETUSER tollgate ...` line of the guide's Redis page (`src/guide/redis.md`,
/// rendered as `tollgate::guide::redis`), as documented (with `CHANGE-ME` as
/// its password and `tollgate` as its key prefix).
pub fn documented_line() -> String {
    let readme = include_str!("../../src/guide/redis.md");
    let lines: Vec<&str> = readme
        .lines()
        .filter(|l| l.starts_with("ACL SETUSER tollgate "))
        .collect();
    assert_eq!(
        lines.len(),
        1,
        "src/guide/redis.md must have exactly one `ACL SETUSER tollgate ...` line"
    );
    lines[0].to_owned()
}

/// The documented line's arguments after `ACL SETUSER`, for user `user`, the test
/// password, and keys under `prefix`.
pub fn documented_rules(user: &str, prefix: &str) -> Vec<String> {
    let line = documented_line();
    let mut words = line.split_whitespace();
    assert_eq!(words.next(), Some("ACL"));
    assert_eq!(words.next(), Some("SETUSER"));
    assert_eq!(words.next(), Some("tollgate"));
    let mut rules = vec![user.to_owned()];
    // As the guide says: Redis 6.0 has no Pub/Sub channel rules.
    // Nor does it know functions (Redis 7.0): the guide says to leave them out there.
    let version = super::redis_server_version();
    let words = words
        .filter(|w| *w != "resetchannels" || version >= (6, 2))
        .filter(|w| !matches!(*w, "+fcall" | "+function|load") || version >= (7, 0));
    for word in words {
        rules.push(match word {
            ">CHANGE-ME" => format!(">{PASSWORD}"),
            "~tollgate:*" => format!("~{prefix}:*"),
            other => other.to_owned(),
        });
    }
    assert!(
        rules.contains(&format!(">{PASSWORD}")) && rules.contains(&format!("~{prefix}:*")),
        "the guide's ACL line must use the password `>CHANGE-ME` and the keys `~tollgate:*`: \
         {line}"
    );
    rules
}

/// Creates `user` with `rules` (after `ACL SETUSER <user>`) on `server`; the default user
/// stays as it is, so the harness's `redis-cli` keeps working.
pub fn set_user(server: &RedisServer, rules: &[String]) {
    let mut args = vec!["ACL", "SETUSER"];
    args.extend(rules.iter().map(String::as_str));
    let reply = server.cli(&args).unwrap_or_default();
    assert_eq!(reply.trim(), "OK", "ACL SETUSER {rules:?}: {reply:?}");
}

/// Creates the guide's least-privilege user `tollgate` (keys under `tollgate:`) and
/// returns the URL that logs in as it.
pub fn least_privilege_user(server: &RedisServer, user: &str) -> String {
    set_user(server, &documented_rules(user, "tollgate"));
    url_for(server, user)
}

/// `redis://<user>:<password>@127.0.0.1:<port>` (or `rediss://`).
pub fn url_for(server: &RedisServer, user: &str) -> String {
    server
        .url()
        .replacen("://", &format!("://{user}:{PASSWORD}@"), 1)
}
