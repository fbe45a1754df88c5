//! Naming what a Redis ACL user lacks. Redis 7 reports a command the script may not run as
//! "can't run this command ... `@user_script:<line>`" (`@user_function:<line>` in the
//! library, one line further down) without naming it; the line of the script names it.

use redis::{ErrorKind, RedisError, ServerErrorKind};

use super::{SCRIPT_SOURCE, function};
use crate::{StoreError, StoreErrorKind};

/// A store error that names the missing permission, when `error` is an ACL denial.
pub(super) fn explain(error: &RedisError) -> Option<StoreError> {
    let text = error.to_string();
    let script_denied = text.contains("can't run this command");
    let denied = script_denied
        || error.kind() == ErrorKind::Server(ServerErrorKind::NoPerm)
        || text.contains("NOPERM");
    if !denied {
        return None;
    }
    let missing = if let Some(command) = script_command(&text).or_else(|| quoted_command(&text)) {
        format!(
            "run {} (add +{} to its ACL)",
            command.to_uppercase(),
            command.to_lowercase()
        )
    } else if text.contains("key") {
        "use these keys (its key pattern must cover `<prefix>:*`, e.g. ~tollgate:*)".to_owned()
    } else {
        "run a command tollgate needs".to_owned()
    };
    Some(StoreError::new(
        StoreErrorKind::Response,
        format!(
            "NOPERM: the Redis ACL user may not {missing}; README \"Stores and Redis\" has the \
             ACL line tollgate needs. Redis said: {text}"
        ),
    ))
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

/// `... the 'zadd' command ...`: older Redis and commands outside the script name it.
fn quoted_command(text: &str) -> Option<String> {
    let rest = text.split("run the '").nth(1)?;
    Some(rest.split('\'').next()?.to_owned())
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The explanation, below the store error's own `Display`.
    fn explained(error: &RedisError) -> String {
        let error = explain(error).unwrap();
        std::error::Error::source(&error).unwrap().to_string()
    }

    fn server_error(code: &str, detail: &str) -> RedisError {
        let kind = match code {
            "NOPERM" => ErrorKind::Server(ServerErrorKind::NoPerm),
            _ => ErrorKind::Server(ServerErrorKind::ResponseError),
        };
        RedisError::from((kind, "", detail.to_owned()))
    }

    #[test]
    fn a_denied_script_command_is_named_from_its_line() {
        let line = SCRIPT_SOURCE
            .lines()
            .position(|l| l.contains("redis.call('ZADD'"))
            .unwrap()
            + 1;
        let detail = format!(
            "The user executing the script can't run this command or subcommand script: \
             6a1a, on @user_script:{line}."
        );
        let error = explained(&server_error("ERR", &detail));
        assert!(error.contains("run ZADD (add +zadd to its ACL)"), "{error}");
        // The same line of the library (FCALL) is one further down.
        let detail = format!(
            "The user executing the script can't run this command or subcommand script: \
             tollgate_6a1a, on @user_function:{}.",
            line + 1
        );
        let error = explained(&server_error("ERR", &detail));
        assert!(error.contains("run ZADD (add +zadd to its ACL)"), "{error}");
    }

    #[test]
    fn a_denied_command_and_keys_are_named() {
        let error = explained(&server_error(
            "NOPERM",
            "this user has no permissions to run the 'evalsha' command",
        ));
        assert!(error.contains("+evalsha"), "{error}");
        let error = explained(&server_error(
            "NOPERM",
            "this user has no permissions to access one of the keys used as arguments",
        ));
        assert!(error.contains("~tollgate:*"), "{error}");
    }

    #[test]
    fn other_errors_are_left_alone() {
        assert!(explain(&server_error("ERR", "something else")).is_none());
    }
}
