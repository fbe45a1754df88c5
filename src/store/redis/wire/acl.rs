//! Naming what a Redis ACL user lacks. A denial is read by its code: `NOPERM` outside a
//! script, and inside one `ERR` with the engine's marker (Redis 6.0 to 7.x: "The user
//! executing the script can't ...", Valkey 8+: "ACL failure in script: ..."). Valkey names
//! the denied command in quotes; Redis 7 does not ("can't run this command ...
//! `@user_script:<line>`", `@user_function:<line>` in the library, one line further
//! down), and the line of the script names it.

use redis::RedisError;

use super::{function, reply, script::SCRIPT_SOURCE};
use crate::{StoreError, StoreErrorKind};

/// A store error that names the missing permission, when `error` is an ACL denial.
pub(crate) fn explain(error: &RedisError) -> Option<StoreError> {
    let message = denial(error)?;
    let text = error.to_string();
    // What the denial is about, before the script's name and line that may follow it.
    let about = message.split(" script: ").next().unwrap_or(message);
    let command = reply::quoted_command(about)
        .map(str::to_owned)
        .or_else(|| about.contains("can't run").then(|| script_command(&text))?);
    let missing = if let Some(command) = command {
        format!(
            "run {} (add +{} to its ACL)",
            command.to_uppercase(),
            command.to_lowercase()
        )
    } else if about.contains("channel") {
        "use this channel (add it with `&<channel>` to its ACL)".to_owned()
    } else if about.contains("key") {
        "use these keys (its key pattern must cover `<prefix>:*`, e.g. ~tollgate:*)".to_owned()
    } else {
        "run a command tollgate needs".to_owned()
    };
    Some(StoreError::new(
        StoreErrorKind::Response,
        format!(
            "NOPERM: the Redis ACL user may not {missing}; the guide's Redis page \
             (tollgate::guide::redis, \"ACL users\") has the ACL line tollgate needs. \
             Redis said: {text}"
        ),
    ))
}

/// The message of an ACL denial (without the engine's marker), if `error` is one.
fn denial(error: &RedisError) -> Option<&str> {
    if reply::no_perm(error) {
        return Some(error.detail().unwrap_or_default());
    }
    match reply::inner(error) {
        (Some("ERR") | None, message) => message
            .strip_prefix("ACL failure in script: ")
            .or_else(|| message.strip_prefix("The user executing the script ")),
        _ => None,
    }
}

/// The command at the script line `@user_script:<n>` (or library line
/// `@user_function:<n>`) of a denial.
fn script_command(text: &str) -> Option<String> {
    let (digits, header) = match text.split_once("@user_script:") {
        Some((_, digits)) => (digits, 0),
        None => (
            text.split_once("@user_function:")?.1,
            function::HEADER_LINES,
        ),
    };
    let end = digits
        .find(|c: char| !c.is_ascii_digit())
        .unwrap_or(digits.len());
    let line: usize = digits[..end].parse().ok()?;
    let source = SCRIPT_SOURCE.lines().nth(line.checked_sub(1 + header)?)?;
    let call = source.split("redis.call('").nth(1)?;
    Some(call.split('\'').next()?.to_owned())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::store::redis::wire::reply::tests::reply;

    /// The explanation of the reply line `line`, below the store error's own `Display`.
    fn explained(line: &str) -> String {
        let error = explain(&reply(line)).unwrap_or_else(|| panic!("not a denial: {line}"));
        std::error::Error::source(&error).unwrap().to_string()
    }

    fn line_of(call: &str) -> usize {
        SCRIPT_SOURCE
            .lines()
            .position(|l| l.contains(call))
            .unwrap()
            + 1
    }

    /// A command the script may not run, as each engine reports it (the texts of Redis
    /// 6.0.9, 7.0.15, Valkey 8.1.8 and 9.1.2): named from the script's line where the
    /// engine does not name it.
    #[test]
    fn a_denied_script_command_is_named_on_every_engine() {
        let line = line_of("redis.call('ZADD'");
        for reply in [
            format!(
                "ERR The user executing the script can't run this command or subcommand \
                 script: 6a1a, on @user_script:{line}."
            ),
            // The same line of the library (FCALL) is one further down.
            format!(
                "ERR The user executing the script can't run this command or subcommand \
                 script: tollgate_6a1a, on @user_function:{}.",
                line + 1
            ),
            format!(
                "ERR Error running script (call to f_6a1a): @user_script:{line}: \
                 @user_script: {line}: The user executing the script can't run this command \
                 or subcommand"
            ),
            "ERR ACL failure in script: User narrow has no permissions to run the 'zadd' \
             command script: tollgate_6a1a, on @user_function:9."
                .to_owned(),
            "ERR ACL failure in script: User narrow has no permissions to run the 'zadd' \
             command script: on @user_script:9."
                .to_owned(),
        ] {
            let error = explained(&reply);
            assert!(error.contains("run ZADD (add +zadd to its ACL)"), "{error}");
            assert!(error.contains(&reply[4..]), "{error}");
        }
    }

    #[test]
    fn a_denied_command_and_keys_are_named_on_every_engine() {
        for reply in [
            "NOPERM this user has no permissions to run the 'evalsha' command",
            "NOPERM this user has no permissions to run the 'evalsha' command or its subcommand",
            "NOPERM User tollgate has no permissions to run the 'evalsha' command",
        ] {
            assert!(explained(reply).contains("+evalsha"), "{reply}");
        }
        // Keys: of the call (declared keys), or inside the script (undeclared ones, which
        // the script's line must not turn into a command).
        let line = line_of("redis.call('INCRBY'");
        for reply in [
            "NOPERM this user has no permissions to access one of the keys used as arguments"
                .to_owned(),
            "NOPERM No permissions to access a key".to_owned(),
            format!(
                "ERR The user executing the script can't access at least one of the keys \
                 mentioned in the command arguments script: tollgate_6a1a, on \
                 @user_function:{line}."
            ),
            format!(
                "ERR Error running script (call to f_2db4): @user_script:{line}: \
                 @user_script: {line}: The user executing the script can't access at least \
                 one of the keys mentioned in the command arguments"
            ),
            format!(
                "ERR ACL failure in script: No permissions to access a key script: on \
                 @user_script:{line}."
            ),
        ] {
            let error = explained(&reply);
            assert!(error.contains("~tollgate:*"), "{error}");
            assert!(!error.contains("(add +"), "{error}");
        }
        for reply in [
            "NOPERM this user has no permissions to access one of the channels used as arguments",
            "NOPERM No permissions to access a channel",
        ] {
            assert!(explained(reply).contains("&<channel>"), "{reply}");
        }
    }

    #[test]
    fn other_errors_are_left_alone() {
        for line in [
            "ERR something else",
            "ERR user_script:1: The user executing the script can't say script: on @user_script:1.",
            "WRONGTYPE Operation against a key holding the wrong kind of value script: on @user_script:1.",
            "READONLY You can't write against a read only replica.",
            "ERR Error running script (call to f_37df): @user_script:1: WRONGTYPE Operation against a key",
        ] {
            assert!(explain(&reply(line)).is_none(), "{line}");
        }
    }
}
