//! The script as a Redis Functions library (Redis 7+): `FUNCTION LOAD` once, then every
//! decision is an `FCALL`, which runs only the per-call part of the script. The algorithms'
//! definitions (and the prelude's) are made once, when the library loads, where `EVALSHA`
//! runs the whole script's top level on every call.
//!
//! One source of truth: the library is [`SCRIPT_SOURCE`] with two lines swapped (see
//! lua/prelude.lua and the "Per call" line of lua/main.lua), a header and a footer, built
//! on first use. Line `n + 1` of the library is line `n` of the script, so an ACL denial's
//! `@user_function:<line>` names the script's line (acl.rs).
//!
//! The library and its function are named after the script's hash (`tollgate_<12 hex
//! digits>`), so two versions of tollgate sharing one Redis (a rolling upgrade) each call
//! their own. A server without functions (before 7.0, or an ACL user without `+fcall` or
//! `+function`) gets `EVALSHA` instead, from then on for that connection.
//!
//! Over 600 lines with its tests (about 420 without): they hold every `FCALL` form to
//! its `EVALSHA` fallback through this file's private names, and stay beside them.

use std::sync::{
    LazyLock,
    atomic::{AtomicBool, Ordering},
};

use redis::{
    Arg, Cmd, ErrorKind, RedisError, RedisResult, Script, ServerErrorKind, Value,
    aio::ConnectionLike,
};

pub(crate) use super::in_flight::{Adjust, InFlightEntry};
use super::{
    in_flight, reply,
    script::{SCRIPT, SCRIPT_SOURCE},
};

/// The line of lua/prelude.lua that takes EVAL's globals; a library declares the locals
/// only (its function sets them per call).
const KEYS_LINE: &str = "local KEYS, ARGV = KEYS, ARGV\n";
/// The line of lua/main.lua where the per-call part starts.
const PER_CALL_LINE: &str =
    "-- Per call: from here on, once per call (a library's function body; see prelude.lua).\n";

/// The library's own functions, which only a library has: one request against one fixed
/// window, and many (lua/one.lua), decided without the general function's parsing (about
/// half of a call's instructions inside Redis; BENCHMARKS.md); a batch of in-flight
/// decisions and releases on one fixed window each (lua/one_in_flight.lua).
const FIXED_WINDOW_SOURCE: &str = concat!(
    include_str!("../../../../lua/one.lua"),
    include_str!("../../../../lua/one_in_flight.lua"),
);

/// The library's name, which is also its general function's: `tollgate_` and the first
/// 12 hex digits of the SHA-1 of its Lua (the script, then lua/one.lua and
/// lua/one_in_flight.lua).
pub(crate) static NAME: LazyLock<String> = LazyLock::new(|| {
    let lua = Script::new(&format!("{SCRIPT_SOURCE}{FIXED_WINDOW_SOURCE}"));
    format!("tollgate_{}", &lua.get_hash()[..12])
});

/// The name of the function for a batch of in-flight decisions and releases
/// (lua/one_in_flight.lua): `<NAME>_fi`.
static IN_FLIGHT_NAME: LazyLock<String> = LazyLock::new(|| format!("{}_fi", *NAME));

/// The name of the function for one request against one fixed window: `<NAME>_fw`.
static FIXED_WINDOW_NAME: LazyLock<String> = LazyLock::new(|| fixed_window_name(&NAME));

/// The name of library `library`'s function for one request against one fixed window.
fn fixed_window_name(library: &str) -> String {
    format!("{library}_fw")
}

/// The name of the function for many such requests of any slots on one cluster master:
/// `<NAME>_fwn`.
static FIXED_WINDOWS_NAME: LazyLock<String> =
    LazyLock::new(|| format!("{}n", fixed_window_name(&NAME)));

/// The library's source, for `FUNCTION LOAD`.
pub(crate) static LIBRARY: LazyLock<String> = LazyLock::new(|| library(SCRIPT_SOURCE, &NAME));

/// `source` (the script) as a library named `name`, with a function of that name, one
/// named `<name>_fw` and one named `<name>_fwn` (lua/one.lua; the last may touch keys of
/// any slots on its node), and one named `<name>_fi` (lua/one_in_flight.lua).
fn library(source: &str, name: &str) -> String {
    assert!(
        source.matches(KEYS_LINE).count() == 1 && source.matches(PER_CALL_LINE).count() == 1,
        "lua/: the lines the library is built around are missing or repeated"
    );
    let body = source
        .replacen(KEYS_LINE, "local KEYS, ARGV\n", 1)
        .replacen(
            PER_CALL_LINE,
            "local function decide(keys, args) KEYS, ARGV = keys, args\n",
            1,
        );
    let fixed_window = fixed_window_name(name);
    format!(
        "#!lua name={name}\n{body}end\n{FIXED_WINDOW_SOURCE}\
         redis.register_function('{name}', decide)\n\
         redis.register_function('{fixed_window}', decide_fixed_window)\n\
         redis.register_function{{function_name = '{fixed_window}n', \
         callback = decide_fixed_windows, flags = {{ 'allow-cross-slot-keys' }}}}\n\
         redis.register_function('{name}_fi', decide_in_flight)\n"
    )
}

/// The lines of the library before the script's first (the header).
pub(crate) const HEADER_LINES: usize = 1;

/// Whether a connection calls the library (`FCALL`) or the script (`EVALSHA`); shared by
/// the connection's clones. Starts with functions, and turns to the script for good once
/// the server shows it has none for this user. A store
/// [connecting in the background](crate::store::RedisConnect::in_background) calls neither until
/// its first connection is made (and the library loaded).
#[derive(Debug)]
pub(crate) struct Mode {
    functions: AtomicBool,
    connecting: AtomicBool,
    /// Whether the task that makes the first connection runs (it dies with its runtime).
    connector: AtomicBool,
}

impl Default for Mode {
    fn default() -> Self {
        Self {
            functions: AtomicBool::new(true),
            connecting: AtomicBool::new(false),
            connector: AtomicBool::new(false),
        }
    }
}

impl Mode {
    pub(crate) fn functions(&self) -> bool {
        self.functions.load(Ordering::Relaxed)
    }

    /// Whether the first connection is still being made in the background.
    #[inline]
    pub(crate) fn connecting(&self) -> bool {
        self.connecting.load(Ordering::Acquire)
    }

    /// The first connection is being made, or (`false`) was made and the library loaded.
    pub(crate) fn set_connecting(&self, connecting: bool) {
        self.connecting.store(connecting, Ordering::Release);
    }

    /// Claims the right to run the connecting task: `false` when one runs already.
    pub(crate) fn claim_connector(&self) -> bool {
        !self.connector.swap(true, Ordering::AcqRel)
    }

    /// The connecting task ended (connected, or its runtime shut down).
    pub(crate) fn release_connector(&self) {
        self.connector.store(false, Ordering::Release);
    }

    fn script_only(&self) {
        if self.functions.swap(false, Ordering::Relaxed) {
            tracing::info!(
                "tollgate: Redis functions are unavailable here (Redis before 7.0, or an ACL \
                 user without +fcall/+function): decisions use EVALSHA"
            );
        }
    }

    /// Loads the library (`FUNCTION LOAD REPLACE`: idempotent, on every master of a
    /// cluster); a server that cannot turns this connection to the script.
    pub(crate) async fn load<C: ConnectionLike>(&self, connection: &mut C) -> RedisResult<()> {
        let result: RedisResult<redis::Value> = redis::cmd("FUNCTION")
            .arg("LOAD")
            .arg("REPLACE")
            .arg(LIBRARY.as_str())
            .query_async(connection)
            .await;
        match result {
            Err(error) if unavailable(&error) => {
                self.script_only();
                Ok(())
            }
            Err(error) => Err(error),
            Ok(_) => Ok(()),
        }
    }

    /// Runs `call` (made with [`head`](Self::head)). An `FCALL` that meets a missing
    /// function (after `FUNCTION FLUSH`, a restart, a failover, on a new cluster node)
    /// loads the library and calls once more; one that finds no functions (turning this
    /// connection to the script) is sent as `EVALSHA`. An `EVALSHA` reloads the script on
    /// `NOSCRIPT`. Only these errors are retried: each proves the call never ran.
    pub(crate) async fn run<C: ConnectionLike>(
        &self,
        connection: &mut C,
        call: &Cmd,
    ) -> RedisResult<Vec<i64>> {
        let evalsha;
        let mut call = call;
        if is_fcall(call) {
            match query(call, connection).await {
                Err(error) if missing(&error) => {
                    self.load(connection).await?;
                    if self.functions() {
                        return query(call, connection).await;
                    }
                }
                Err(error) if unavailable(&error) => self.script_only(),
                result => return result,
            }
            evalsha = as_evalsha(call);
            call = &evalsha;
        }
        match query(call, connection).await {
            Err(error) if error.kind() == ErrorKind::Server(ServerErrorKind::NoScript) => {
                SCRIPT.load_async(connection).await?;
                query(call, connection).await
            }
            result => result,
        }
    }

    /// Starts a script call of `keys` keys as this connection sends it: `FCALL <function>
    /// <keys>`, or `EVALSHA <sha> <keys>` once functions turned out unavailable (the
    /// arguments that follow, the script's `KEYS` and `ARGV`, are the same for both).
    pub(crate) fn head(&self, cmd: &mut Cmd, keys: usize) {
        if self.functions() {
            cmd.arg("FCALL").arg(NAME.as_str()).arg(keys);
        } else {
            cmd.arg("EVALSHA").arg(SCRIPT.get_hash()).arg(keys);
        }
    }
}

/// The call of the library's function for one request of `cost` (1 to `limit`) against
/// one fixed window of `limit` per `window_ms` without a lockout, on `key`, at `now`
/// (None: Redis `TIME`). Only for a connection that calls functions; [`Mode::run`] turns
/// it into the general script's form if they turn out unavailable.
pub(crate) fn fixed_window_call(
    now: Option<u64>,
    key: &[u8],
    limit: u64,
    window_ms: u64,
    cost: u32,
) -> Cmd {
    let mut cmd = Cmd::with_capacity(8, 48 + key.len());
    cmd.arg("FCALL")
        .arg(FIXED_WINDOW_NAME.as_str())
        .arg(1)
        .arg(key);
    match now {
        Some(now) => cmd.arg(now),
        None => cmd.arg(""),
    };
    cmd.arg(limit).arg(window_ms).arg(cost);
    cmd
}

/// One request for [`fixed_windows_call`]: its key, limit, window ms and cost.
pub(crate) type FixedWindowRequest<'a> = (&'a [u8], u64, u64, u32);

/// The call of the library's function for many requests like [`fixed_window_call`]'s,
/// each given as its key, limit, window ms and cost (lua/one.lua's
/// `decide_fixed_windows`; no key is declared). `elsewhere`: on a cluster master, whose
/// keys may be of any slots and some not its own; a request whose key the node did not
/// serve then answers -1 first (never counted). Its reply holds four values per request,
/// then the `now` it decided at, as the general function's does for such requests.
pub(crate) fn fixed_windows_call(
    now: Option<u64>,
    elsewhere: bool,
    requests: &[FixedWindowRequest<'_>],
) -> Cmd {
    let count = requests.len();
    let mut cmd = Cmd::with_capacity(5 + 4 * count, 48 + 64 * count);
    cmd.arg("FCALL").arg(FIXED_WINDOWS_NAME.as_str()).arg(0);
    match now {
        Some(now) => cmd.arg(now),
        None => cmd.arg(""),
    };
    cmd.arg(u8::from(elsewhere));
    for &(key, limit, window_ms, cost) in requests {
        cmd.arg(key).arg(limit).arg(window_ms).arg(cost);
    }
    cmd
}

/// The call of the library's function for a batch of in-flight decisions and releases
/// (lua/one_in_flight.lua): [`in_flight::call`] of `<NAME>_fi`.
pub(crate) fn in_flight_call(now: Option<u64>, entries: &[InFlightEntry<'_>]) -> Cmd {
    in_flight::call(&IN_FLIGHT_NAME, now, entries)
}

/// Sends a script call and reads its reply: [`Cmd::query_async`] into a `Vec<i64>`, in
/// one pass over the reply.
async fn query<C: ConnectionLike>(call: &Cmd, connection: &mut C) -> RedisResult<Vec<i64>> {
    integers(connection.req_packed_command(call).await?)
}

/// The script's reply, a list of integers, as `from_redis_value::<Vec<i64>>` after
/// `extract_error` reads it (what `query_async` does), in one pass: those walk the reply
/// twice, each into a new `Vec`, which cost a request about as much as its share of the
/// call's building. Anything but an integer takes their way.
pub(crate) fn integers(reply: Value) -> RedisResult<Vec<i64>> {
    let Value::Array(values) = reply else {
        return Ok(redis::from_redis_value(reply.extract_error()?)?);
    };
    let mut out = Vec::with_capacity(values.len());
    for value in values {
        out.push(match value {
            Value::Int(n) => n,
            other => redis::from_redis_value(other.extract_error()?)?,
        });
    }
    Ok(out)
}

/// Whether `call` is an `FCALL` (else an `EVALSHA`).
fn is_fcall(call: &Cmd) -> bool {
    matches!(call.args_iter().next(), Some(Arg::Simple(b"FCALL")))
}

/// `call` (`FCALL <function> ...`) as `EVALSHA <sha> ...`: the same arguments, or for
/// [`fixed_window_call`] the general script's form of its one request (lua/main.lua: one
/// group of one limit, code 1, capacity = limit, no lockout; one request of group 1), and
/// for [`fixed_windows_call`] that of its requests (one Redis only: on a cluster a call
/// without declared keys never takes this way, see `nodes`).
pub(crate) fn as_evalsha(call: &Cmd) -> Cmd {
    let mut args = call.args_iter().filter_map(|arg| match arg {
        Arg::Simple(bytes) => Some(bytes),
        _ => None,
    });
    let function = args.nth(1);
    let mut cmd = Cmd::with_capacity(call.args_iter().len() + 7, 0);
    cmd.arg("EVALSHA").arg(SCRIPT.get_hash());
    if function == Some(IN_FLIGHT_NAME.as_bytes()) {
        let words: Vec<&[u8]> = args.collect();
        in_flight::as_script(&mut cmd, &words);
    } else if function == Some(FIXED_WINDOWS_NAME.as_bytes()) {
        let (_keys, now, _elsewhere) = (args.next(), args.next(), args.next());
        let rest: Vec<&[u8]> = args.collect();
        let requests: Vec<&[&[u8]]> = rest.chunks_exact(4).collect();
        fixed_windows_as_script(&mut cmd, now.unwrap_or(b""), &requests);
    } else if function == Some(FIXED_WINDOW_NAME.as_bytes()) {
        let [_keys, key, now, limit, window, cost] = [(); 6].map(|()| args.next().unwrap_or(b""));
        fixed_windows_as_script(&mut cmd, now, &[&[key, limit, window, cost]]);
    } else {
        for arg in args {
            cmd.arg(arg);
        }
    }
    cmd
}

/// Appends to `cmd` (`EVALSHA <sha>`) the general script's arguments for `requests`, each
/// one against one fixed window, given as its key, limit, window ms and cost: the keys,
/// `now`, one group per distinct limit and window in order of first use (one limit of
/// code 1, capacity = limit, no lockout), then each request's cost and group
/// (lua/main.lua), as `script_call` lays them out.
fn fixed_windows_as_script(cmd: &mut Cmd, now: &[u8], requests: &[&[&[u8]]]) {
    let mut groups: Vec<(&[u8], &[u8])> = Vec::new();
    let mut group_of = Vec::with_capacity(requests.len());
    for request in requests {
        let limit = (request[1], request[2]);
        let index = match groups.iter().position(|&g| g == limit) {
            Some(index) => index,
            None => {
                groups.push(limit);
                groups.len() - 1
            }
        };
        group_of.push(index + 1);
    }
    cmd.arg(requests.len());
    for request in requests {
        cmd.arg(request[0]);
    }
    cmd.arg(now).arg(groups.len());
    for (limit, window) in &groups {
        cmd.arg(1)
            .arg(1)
            .arg(*limit)
            .arg(*window)
            .arg(*limit)
            .arg(0);
    }
    cmd.arg(requests.len());
    for (request, group) in requests.iter().zip(group_of) {
        cmd.arg(request[3]).arg(group);
    }
}

/// The function is not on this server (never loaded, flushed, a new node).
fn missing(error: &RedisError) -> bool {
    reply::missing_function(error)
}

/// The server has no functions, or this user may not use them: `FCALL` or `FUNCTION`
/// unknown (before Redis 7.0) or denied by the ACL (`NOPERM`).
pub(crate) fn unavailable(error: &RedisError) -> bool {
    let names_functions = |command: &str| {
        let command = command.to_ascii_lowercase();
        command == "fcall" || command == "function" || command.starts_with("function|")
    };
    let named = if reply::no_perm(error) {
        error.detail().and_then(reply::quoted_command)
    } else {
        reply::unknown_command(error)
    };
    named.is_some_and(names_functions) || function_without_load(error)
}

/// Dragonfly has a `FUNCTION` command without `LOAD` (and no `FCALL`): it answers the load
/// "wrong number of arguments for 'function' command", or "Unknown subcommand ... Try
/// FUNCTION HELP." (its users' reports; not run here), where Redis before 7.0 says
/// "unknown command".
fn function_without_load(error: &RedisError) -> bool {
    error.code() == Some("ERR")
        && error.detail().is_some_and(|detail| {
            let detail = detail.to_ascii_lowercase();
            detail.starts_with("wrong number of arguments for 'function'")
                || (detail.starts_with("unknown subcommand") && detail.contains("function help"))
        })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_library_is_the_script_with_the_same_line_numbers() {
        let library = LIBRARY.as_str();
        assert!(library.starts_with(&format!("#!lua name={}\n", *NAME)));
        let lines: Vec<&str> = library.lines().collect();
        for (n, line) in SCRIPT_SOURCE.lines().enumerate() {
            let same = lines[n + HEADER_LINES];
            if line != same {
                assert!(
                    line == KEYS_LINE.trim_end() || line == PER_CALL_LINE.trim_end(),
                    "line {n}: {line} / {same}"
                );
            }
        }
    }

    fn words(cmd: &Cmd) -> Vec<String> {
        cmd.args_iter()
            .map(|arg| match arg {
                Arg::Simple(bytes) => String::from_utf8(bytes.to_vec()).unwrap(),
                _ => panic!("a cursor"),
            })
            .collect()
    }

    fn request(group: &[u64], cost: u32) -> crate::store::redis::encode::Encoded {
        crate::store::redis::encode::Encoded {
            keys: {
                let mut keys = crate::store::redis::keys::Keys::default();
                for i in 0..group.len() / 5 {
                    keys.push(&["app:{k}:", &i.to_string()]);
                }
                keys
            },
            cost,
            at: None,
            kept: None,
            group: group.iter().copied().collect(),
            quotas: group.chunks(5).map(|g| g[1] as u32).collect(),
            peek: false,
            reserve_ms: 0,
            slot: 0,
            lease: None,
            permit: None,
        }
    }

    /// One request against one fixed window goes to the library's `<name>_fw`; where
    /// functions turn out unavailable, that call becomes exactly the general script's call
    /// of the same request. Every other shape goes to the general function.
    #[test]
    fn one_fixed_window_has_its_own_function_and_the_scripts_form_as_fallback() {
        use crate::store::redis::encode::script_call;
        let functions = Mode::default();
        let script = Mode::default();
        script.script_only();
        let fixed_window = [1, 10, 1000, 10, 0];
        for now in [None, Some(1_700_000_000_000)] {
            for cost in [1, 10] {
                let one = request(&fixed_window, cost);
                let lean = script_call(&functions, now, &[&one]);
                assert_eq!(words(&lean)[..2], ["FCALL", FIXED_WINDOW_NAME.as_str()]);
                assert_eq!(
                    words(&as_evalsha(&lean)),
                    words(&script_call(&script, now, &[&one]))
                );
            }
        }
        let mut peek = request(&fixed_window, 1);
        peek.peek = true;
        let mut reserving = request(&fixed_window, 1);
        reserving.reserve_ms = 100;
        let mut adjustment = request(&fixed_window, 1);
        adjustment.at = Some(5);
        let general = [
            request(&fixed_window, 11),                        // more than the limit
            request(&fixed_window, 0),                         // nothing to count
            request(&[1, 10, 1000, 10, 60_000], 1),            // a lockout
            request(&[4, 10, 1000, 10, 0], 1),                 // a token bucket
            request(&[1, 10, 1000, 10, 0, 1, 5, 60, 5, 0], 1), // two limits
            peek,
            reserving,
            adjustment,
        ];
        for one in &general {
            let call = script_call(&functions, None, &[one]);
            assert_eq!(words(&call)[..2], ["FCALL", NAME.as_str()], "{one:?}");
        }
        // Two requests in one call: the general function too.
        let one = request(&fixed_window, 1);
        let call = script_call(&functions, None, &[&one, &one]);
        assert_eq!(words(&call)[1], NAME.as_str());
    }

    /// Many one-fixed-window requests go to `<name>_fwn`, which the library registers
    /// with `allow-cross-slot-keys`: no key declared; `now`, whether the keys may be
    /// another node's (a cluster master's call), then each request's key, limit, window
    /// and cost in turn.
    #[test]
    fn many_fixed_windows_go_in_one_call_of_a_cross_slot_function() {
        let call = fixed_windows_call(
            Some(7),
            true,
            &[(b"a:{1}:fw2", 10, 1000, 1), (b"a:{2}:fw2", 5, 60_000, 2)],
        );
        let name = FIXED_WINDOWS_NAME.as_str();
        let expected = "FCALL _ 0 7 1 a:{1}:fw2 10 1000 1 a:{2}:fw2 5 60000 2";
        let expected: Vec<&str> = expected
            .split(' ')
            .map(|w| if w == "_" { name } else { w })
            .collect();
        assert_eq!(words(&call), expected);
        assert_eq!(words(&fixed_windows_call(None, false, &[]))[3..], ["", "0"]);
        let registered = format!(
            "redis.register_function{{function_name = '{name}', callback = \
             decide_fixed_windows, flags = {{ 'allow-cross-slot-keys' }}}}"
        );
        assert!(LIBRARY.contains(&registered), "{}", &*LIBRARY);
    }

    /// On one Redis a batch of distinct keys, each against one fixed window, goes to
    /// `<name>_fwn`; where functions turn out unavailable, that call becomes exactly the
    /// general script's call of the same batch. A repeated key, or any other shape in the
    /// batch, keeps the whole batch on the general function.
    #[test]
    fn a_batch_of_cold_fixed_windows_has_its_function_and_the_scripts_form_as_fallback() {
        use crate::store::redis::{
            encode::{Encoded, standalone_call},
            keys::Keys,
        };
        let functions = Mode::default();
        let script = Mode::default();
        script.script_only();
        let on = |key: &str, group: &[u64], cost: u32| {
            let mut one = request(group, cost);
            one.keys = Keys::default();
            one.keys.push(&["app:{", key, "}:fw2"]);
            one
        };
        let (minute, hour) = ([1, 10, 60_000, 10, 0], [1, 5, 3_600_000, 5, 0]);
        let batch = [
            on("a", &minute, 1),
            on("b", &hour, 2),
            on("c", &minute, 10),
            on("d", &hour, 1),
        ];
        let batch: Vec<&Encoded> = batch.iter().collect();
        for now in [None, Some(1_700_000_000_000_u64)] {
            let lean = standalone_call(&functions, now, &batch);
            let now_word = now.map_or(String::new(), |n| n.to_string());
            assert_eq!(
                words(&lean)[..5],
                ["FCALL", FIXED_WINDOWS_NAME.as_str(), "0", &now_word, "0"]
            );
            assert_eq!(
                words(&as_evalsha(&lean)),
                words(&standalone_call(&script, now, &batch))
            );
        }
        let repeated = [
            on("a", &minute, 1),
            on("b", &minute, 1),
            on("a", &minute, 1),
        ];
        let lockout = [on("a", &minute, 1), on("b", &[1, 10, 60_000, 10, 5_000], 1)];
        let alone = [on("a", &minute, 1)];
        for general in [&repeated[..], &lockout[..], &alone[..]] {
            let general: Vec<&Encoded> = general.iter().collect();
            let call = standalone_call(&functions, None, &general);
            assert_ne!(words(&call)[1], FIXED_WINDOWS_NAME.as_str());
        }
    }

    /// A batch of in-flight decisions and releases on one fixed window each goes to the
    /// library's `<name>_fi`; where functions turn out unavailable, that call becomes
    /// exactly the general script's call of the same batch. Any other request in the
    /// batch keeps it on the general function.
    #[test]
    fn in_flight_batches_have_their_function_and_the_scripts_form_as_fallback() {
        use crate::store::redis::encode::{Encoded, script_call};
        use crate::{Limit, key::Key};
        use std::time::Duration;
        let functions = Mode::default();
        let script = Mode::default();
        script.script_only();
        let minute = [Limit::fixed_window(10, Duration::from_secs(60)).unwrap()];
        let hour = [Limit::fixed_window(5, Duration::from_secs(3600)).unwrap()];
        let taking = |key: &str, limits: &[Limit], cost: u32, id: &str| {
            let key = Key::new(key);
            Encoded::in_flight(
                "app",
                &key,
                limits,
                cost,
                None,
                false,
                (3, 30_000),
                id.into(),
            )
        };
        let giving = |key: &str, limits: &[Limit], units: u32, at: i64, id: &str| {
            let key = Key::new(key);
            Encoded::in_flight(
                "app",
                &key,
                limits,
                units,
                Some(at),
                false,
                (3, 1),
                id.into(),
            )
        };
        let batch = [
            taking("a", &minute, 1, "01"),
            taking("a", &minute, 10, "02"),
            giving("b", &[], 1, 0, "03"),
            giving("a", &minute, 4, 1_700_000_000_000, "04"),
            taking("c", &hour, 2, "05"),
            giving("c", &hour, 1, -1, "06"),
        ];
        for now in [None, Some(1_700_000_000_000)] {
            for requests in [&batch[..], &batch[..1], &batch[2..3]] {
                let requests: Vec<&Encoded> = requests.iter().collect();
                let lean = script_call(&functions, now, &requests);
                assert_eq!(words(&lean)[..2], ["FCALL", IN_FLIGHT_NAME.as_str()]);
                assert_eq!(
                    words(&as_evalsha(&lean)),
                    words(&script_call(&script, now, &requests))
                );
            }
        }
        let mut peek = taking("a", &minute, 1, "07");
        peek.peek = true;
        let two = [minute[0].clone(), hour[0].clone()];
        let locked = [minute[0]
            .clone()
            .with_lockout(Duration::from_secs(60))
            .unwrap()];
        let bucket = [Limit::token_bucket(10, Duration::from_secs(60)).unwrap()];
        let plain = Encoded::new("app", &Key::new("p"), &minute, 1, None, false);
        for other in [
            taking("a", &minute, 11, "08"), // more than the limit
            taking("a", &two, 1, "09"),     // two limits
            taking("a", &locked, 1, "10"),  // a lockout
            taking("a", &bucket, 1, "11"),  // a token bucket
            taking("a", &[], 1, "12"),      // no rate limit
            giving("a", &minute, 0, 0, "13"),
            peek,
            plain,
        ] {
            let requests = [&batch[0], &other];
            let call = script_call(&functions, None, &requests);
            assert_eq!(words(&call)[1], NAME.as_str(), "{other:?}");
        }
    }

    /// The replies of Redis 6.0.9, 7.0.15, Valkey 8.1.8 and 9.1.2 (and Dragonfly's).
    #[test]
    fn errors_that_mean_no_functions() {
        use reply::tests::reply;
        for line in [
            "ERR unknown command `FCALL`, with args beginning with: `tollgate_0a1b`, `1`, ",
            "ERR unknown command `FUNCTION`, with args beginning with: `LOAD`, `x`, ",
            "ERR unknown command 'FUNCTION'",
            "NOPERM this user has no permissions to run the 'fcall' command",
            "NOPERM this user has no permissions to run the 'function|load' command",
            "NOPERM User no-fcall has no permissions to run the 'fcall' command",
            "NOPERM User no-functions has no permissions to run the 'function|load' command",
            // Dragonfly (from its users' reports).
            "ERR wrong number of arguments for 'function' command",
            "ERR Unknown subcommand or wrong number of arguments for 'LOAD'. Try FUNCTION HELP.",
        ] {
            assert!(unavailable(&reply(line)), "{line}");
        }
        // Denials that EVALSHA would meet as well are the caller's to see.
        for line in [
            "NOPERM this user has no permissions to access one of the keys used as arguments",
            "NOPERM No permissions to access a key",
            "NOPERM User fcall has no permissions to run the 'zadd' command",
            "ERR The user executing the script can't run this command or subcommand script: \
             tollgate_0a1b, on @user_function:52.",
            "ERR ACL failure in script: User narrow has no permissions to run the 'fcall' \
             command script: on @user_script:1.",
            "ERR unknown command 'ZADDX'",
            "ERR Function not found",
            "ERR wrong number of arguments for 'evalsha' command",
            "ERR Unknown subcommand or wrong number of arguments for 'LOAD'. Try SCRIPT HELP.",
        ] {
            assert!(!unavailable(&reply(line)), "{line}");
        }
        assert!(missing(&reply("ERR Function not found")));
        assert!(!missing(&reply("NOSCRIPT No matching script.")));
    }

    /// [`integers`] reads every reply as `query_async::<Vec<i64>>` does: the script's
    /// lists of integers, and the odd shapes and errors alike.
    #[test]
    fn integers_read_a_reply_as_query_async_does() {
        let parse = |resp: &str| redis::parse_redis_value(resp.as_bytes()).unwrap();
        let general = |reply: Value| -> RedisResult<Vec<i64>> {
            Ok(redis::from_redis_value(reply.extract_error()?)?)
        };
        for resp in [
            "*5\r\n:1\r\n:99\r\n:1000\r\n:0\r\n:1764460800000\r\n",
            "*0\r\n",
            "*2\r\n:-3\r\n$2\r\n17\r\n",
            "*2\r\n:1\r\n$3\r\nabc\r\n",
            "*2\r\n:1\r\n-ERR inside\r\n",
            "*2\r\n:1\r\n*1\r\n:2\r\n",
            "-NOSCRIPT No matching script\r\n",
            "$-1\r\n",
            ":7\r\n",
            "+OK\r\n",
        ] {
            let (ours, theirs) = (integers(parse(resp)), general(parse(resp)));
            match (&ours, &theirs) {
                (Ok(a), Ok(b)) => assert_eq!(a, b, "{resp:?}"),
                (Err(a), Err(b)) => {
                    assert_eq!(a.kind(), b.kind(), "{resp:?}");
                    assert_eq!(a.to_string(), b.to_string(), "{resp:?}");
                }
                _ => panic!("{resp:?}: {ours:?} against {theirs:?}"),
            }
        }
    }
}
