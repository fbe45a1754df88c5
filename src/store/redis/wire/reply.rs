//! Reading a server's error replies by their code (the reply's first word: `NOPERM`,
//! `READONLY`, `ERR`...), which Redis 6.0 to 7.x and Valkey 8 to 9 share, and not by the
//! sentences after it, which each engine rewords (Valkey 8 shortened `NOSCRIPT`'s, names
//! the user in `NOPERM`'s, and 9.1 drops the script's hash from script errors).
//!
//! An error met inside a script keeps the code of the command that failed there, except
//! on Redis 6, which wraps it: `ERR Error running script (call to f_<sha>):
//! @user_script:<n>: @user_script: <n>: -READONLY ...`. [`inner`] takes the wrapper off.

use redis::RedisError;

/// The code and message of the error that `error` reports: its own, or for a script
/// error that Redis 6 wrapped, that of the error inside (its code `None` when the inner
/// message has none, as Redis 6's own ACL denials in scripts).
pub(crate) fn inner(error: &RedisError) -> (Option<&str>, &str) {
    let code = error.code();
    let detail = error.detail().unwrap_or_default();
    if code != Some("ERR") {
        return (code, detail);
    }
    let Some(rest) = detail.strip_prefix("Error running script (call to ") else {
        return (code, detail);
    };
    let Some((_, mut message)) = rest.split_once("): ") else {
        return (code, detail);
    };
    // `@user_script:<n>: ` and `@user_script: <n>: `, in either order, once or twice.
    while let Some(rest) = message.strip_prefix("@user_script:") {
        let rest = rest.trim_start_matches(|c: char| c == ' ' || c.is_ascii_digit());
        message = rest.strip_prefix(": ").unwrap_or(rest);
    }
    let message = message.strip_prefix('-').unwrap_or(message);
    match message.split_once(' ') {
        Some((word, rest)) if is_code(word) => (Some(word), rest),
        _ => (None, message),
    }
}

/// An error code: upper-case letters only (`READONLY`, `WRONGTYPE`), not a sentence's
/// first word.
fn is_code(word: &str) -> bool {
    word.len() >= 2 && word.bytes().all(|b| b.is_ascii_uppercase())
}

/// A write refused by a replica (`READONLY`), by the command itself or inside a script.
#[cfg_attr(not(feature = "sentinel"), allow(dead_code))]
pub(crate) fn read_only(error: &RedisError) -> bool {
    inner(error).0 == Some("READONLY")
}

/// `FCALL` of a function the server does not have (never loaded, flushed, a new node):
/// `ERR Function not found` on Redis 7 and Valkey alike.
pub(crate) fn missing_function(error: &RedisError) -> bool {
    error.code() == Some("ERR")
        && error
            .detail()
            .is_some_and(|d| d.starts_with("Function not found"))
}

/// An ACL denial by its code (`NOPERM`): outside a script on every engine.
pub(crate) fn no_perm(error: &RedisError) -> bool {
    error.code() == Some("NOPERM")
}

/// The command an ACL denial names in quotes: `... permissions to run the '<cmd>'
/// command` (Redis: "this user has no ...", Valkey: "User <name> has no ...", also inside
/// scripts). The last such phrase: a user's name cannot shift it.
pub(crate) fn quoted_command(message: &str) -> Option<&str> {
    let (_, rest) = message.rsplit_once("run the '")?;
    Some(rest.split('\'').next()?).filter(|c| !c.is_empty())
}

/// The command an `ERR unknown command '<cmd>'` (or `` `<cmd>` ``) reply names: `FCALL`
/// and `FUNCTION` before Redis 7.0.
pub(crate) fn unknown_command(error: &RedisError) -> Option<&str> {
    if error.code() != Some("ERR") {
        return None;
    }
    let rest = error.detail()?.strip_prefix("unknown command ")?;
    let quote = rest.chars().next().filter(|c| matches!(c, '\'' | '`'))?;
    rest[1..].split(quote).next().filter(|c| !c.is_empty())
}

#[cfg(test)]
pub(crate) mod tests {
    use super::*;

    /// The error redis-rs makes of the reply line `line` (as the server sent it).
    pub(crate) fn reply(line: &str) -> RedisError {
        let resp = format!("-{line}\r\n");
        match redis::parse_redis_value(resp.as_bytes()).unwrap() {
            redis::Value::ServerError(error) => error.into(),
            other => panic!("{other:?}"),
        }
    }

    #[test]
    fn read_only_on_every_engine() {
        for line in [
            // Redis 6.0 to 7.x and Valkey, a plain write.
            "READONLY You can't write against a read only replica.",
            // Redis 7.0 / Valkey 8.1, inside a script.
            "READONLY You can't write against a read only replica. script: 897afd4d23ee70efe0ede1685c1c94834429da77, on @user_script:1.",
            // Valkey 9.1.
            "READONLY You can't write against a read only replica. script: on @user_script:1.",
            // Redis 6.0, inside a script.
            "ERR Error running script (call to f_897afd4d23ee70efe0ede1685c1c94834429da77): @user_script:1: @user_script: 1: -READONLY You can't write against a read only replica.",
        ] {
            assert!(read_only(&reply(line)), "{line}");
        }
        for line in [
            "ERR Error running script (call to f_37df): @user_script:1: WRONGTYPE Operation against a key holding the wrong kind of value",
            "ERR user_script:1: READONLY boom script: on @user_script:1.",
            "NOSCRIPT No matching script.",
        ] {
            assert!(!read_only(&reply(line)), "{line}");
        }
        let wrapped = reply(
            "ERR Error running script (call to f_37df): @user_script:1: WRONGTYPE Operation against a key",
        );
        assert_eq!(
            inner(&wrapped),
            (Some("WRONGTYPE"), "Operation against a key")
        );
    }

    #[test]
    fn codes_that_redis_rs_knows_and_those_it_does_not() {
        // BUSY, LOADING (a replica loading its first sync), NOSCRIPT: the same code on
        // every engine, whatever follows it.
        for (line, code) in [
            (
                "BUSY Redis is busy running a script. You can only call SCRIPT KILL or SHUTDOWN NOSAVE.",
                "BUSY",
            ),
            (
                "BUSY Valkey is busy running a script. You can only call SCRIPT KILL or SHUTDOWN NOSAVE.",
                "BUSY",
            ),
            ("LOADING Redis is loading the dataset in memory", "LOADING"),
            ("LOADING Valkey is loading the dataset in memory", "LOADING"),
            ("NOSCRIPT No matching script. Please use EVAL.", "NOSCRIPT"),
            ("NOSCRIPT No matching script.", "NOSCRIPT"),
        ] {
            assert_eq!(inner(&reply(line)).0, Some(code), "{line}");
        }
    }

    #[test]
    fn missing_functions_and_unknown_commands() {
        assert!(missing_function(&reply("ERR Function not found")));
        assert!(!missing_function(&reply(
            "ERR user_script:1: Function not found"
        )));
        for (line, command) in [
            (
                "ERR unknown command `FCALL`, with args beginning with: `nosuch`, `0`, ",
                "FCALL",
            ),
            ("ERR unknown command 'FUNCTION'", "FUNCTION"),
        ] {
            assert_eq!(unknown_command(&reply(line)), Some(command), "{line}");
        }
        assert_eq!(unknown_command(&reply("ERR Function not found")), None);
    }

    #[test]
    fn a_quoted_command_whatever_the_user_is_called() {
        for (message, command) in [
            (
                "this user has no permissions to run the 'zadd' command",
                "zadd",
            ),
            (
                "this user has no permissions to run the 'zadd' command or its subcommand",
                "zadd",
            ),
            (
                "User narrow has no permissions to run the 'zadd' command",
                "zadd",
            ),
            (
                "User run the 'x' has no permissions to run the 'fcall' command",
                "fcall",
            ),
        ] {
            assert_eq!(quoted_command(message), Some(command), "{message}");
        }
        assert_eq!(quoted_command("No permissions to access a key"), None);
    }
}
