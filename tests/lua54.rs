//! The scripts under Lua 5.4, the Lua of Dragonfly (and of engines that may follow it):
//! there `/` always yields a float, integers and floats are different numbers, a float is
//! sent to a command as `"3.0"` and comes back from a script as a string. Redis and
//! Valkey run Lua 5.1, whose numbers are all doubles, so no test against them can see it.
//!
//! How: a store decides a mixed workload (every algorithm, several limits, lockouts,
//! peeks, reservations, adjustments, coalesced batches, leases, resets) on a real Redis,
//! while `MONITOR` records every script call it sends. Each call is then replayed twice,
//! from the same empty state: on a second real Redis (Lua 5.1), and in a Lua 5.4
//! interpreter (mlua, vendored) running the same library or script, whose `redis.call`
//! forwards each command to a third real Redis. The Lua 5.4 run must pass every command
//! only integers and strings, touch only declared keys (Dragonfly refuses others) except
//! in the function that declares none, reply with integers only, and give exactly the
//! replies and the final keys of the Lua 5.1 run.

#![cfg(feature = "redis")]

use tollgate_test_support as support;

use std::{cell::RefCell, collections::HashMap, rc::Rc, time::Duration};

use futures_util::StreamExt;
use mlua::{Lua, Value as LuaValue, Variadic};
use redis::Value;
use support::RedisServer;
use tollgate::{
    Adjustment, Algorithm, Limit,
    clock::ManualClock,
    key::Key,
    store::RedisStore,
    store::{LeaseConfig, Store},
};

const START: u64 = 1_700_000_000_000;

/// One command a client sent, as `MONITOR` printed it.
type Command = Vec<Vec<u8>>;

/// The words of a `MONITOR` line (`<time> [<db> <client>] "WORD" "WORD" ...`), unless the
/// command ran inside a script (client `lua`).
fn monitor_words(line: &str) -> Option<Command> {
    let (client, rest) = line.split_once("] ")?;
    if client.ends_with(" lua") {
        return None;
    }
    let bytes = rest.as_bytes();
    let mut words = Vec::new();
    let mut i = 0;
    while i < bytes.len() {
        if bytes[i] != b'"' {
            i += 1;
            continue;
        }
        i += 1;
        let mut word = Vec::new();
        while bytes[i] != b'"' {
            if bytes[i] == b'\\' {
                i += 1;
                match bytes[i] {
                    b'n' => word.push(b'\n'),
                    b'r' => word.push(b'\r'),
                    b't' => word.push(b'\t'),
                    b'a' => word.push(7),
                    b'b' => word.push(8),
                    b'x' => {
                        let hex = std::str::from_utf8(&bytes[i + 1..i + 3]).unwrap();
                        word.push(u8::from_str_radix(hex, 16).unwrap());
                        i += 2;
                    }
                    other => word.push(other),
                }
            } else {
                word.push(bytes[i]);
            }
            i += 1;
        }
        i += 1;
        words.push(word);
    }
    Some(words)
}

fn text(word: &[u8]) -> String {
    String::from_utf8_lossy(word).to_ascii_uppercase()
}

/// A reply in one shape for both runs (RESP2 as a script's reply converts to it).
fn normal(value: Value) -> Value {
    match value {
        Value::Okay => Value::SimpleString("OK".to_owned()),
        Value::Array(items) => Value::Array(items.into_iter().map(normal).collect()),
        other => other,
    }
}

/// What the Lua 5.4 run needs per call: the keys it may touch.
#[derive(Default)]
struct CallKeys {
    keys: Vec<Vec<u8>>,
    /// A function registered with `allow-cross-slot-keys` (it declares no keys).
    undeclared: bool,
}

/// The Lua 5.4 side: an interpreter whose `redis.call` forwards to a real Redis.
struct Lua54 {
    lua: Lua,
    functions: Rc<RefCell<HashMap<String, (mlua::Function, bool)>>>,
    call: Rc<RefCell<CallKeys>>,
    /// What went against Lua 5.4's rules, in order.
    faults: Rc<RefCell<Vec<String>>>,
}

impl Lua54 {
    fn new(url: &str) -> Self {
        let lua = Lua::new();
        let connection = Rc::new(RefCell::new(
            redis::Client::open(url).unwrap().get_connection().unwrap(),
        ));
        let call = Rc::new(RefCell::new(CallKeys::default()));
        let faults = Rc::new(RefCell::new(Vec::new()));
        let functions = Rc::new(RefCell::new(HashMap::new()));
        let redis_table = lua.create_table().unwrap();
        for (name, protected) in [("call", false), ("pcall", true)] {
            let (connection, call, faults) = (connection.clone(), call.clone(), faults.clone());
            let f = lua
                .create_function(move |lua, args: Variadic<LuaValue>| {
                    let mut words: Vec<Vec<u8>> = Vec::new();
                    for arg in args.iter() {
                        match arg {
                            LuaValue::Integer(n) => words.push(n.to_string().into_bytes()),
                            LuaValue::String(s) => words.push(s.as_bytes().to_vec()),
                            LuaValue::Number(f) => {
                                let command = words.first().map(|w| text(w)).unwrap_or_default();
                                faults.borrow_mut().push(format!(
                                    "a float ({f:?}) as argument {} of {command}: Lua 5.4 sends \
                                     it as {f:?} (\"{}\" with a fraction), which counters refuse",
                                    words.len() + 1,
                                    if f.fract() == 0.0 {
                                        format!("{f:.1}")
                                    } else {
                                        f.to_string()
                                    }
                                ));
                                words.push(format!("{f}").into_bytes());
                            }
                            other => {
                                return Err(mlua::Error::runtime(format!(
                                    "redis.call with a {}",
                                    other.type_name()
                                )));
                            }
                        }
                    }
                    let command = text(&words[0]);
                    if command != "TIME" {
                        let call = call.borrow();
                        if !call.undeclared && !call.keys.contains(&words[1]) {
                            faults.borrow_mut().push(format!(
                                "{command} of the undeclared key {}",
                                String::from_utf8_lossy(&words[1])
                            ));
                        }
                    }
                    let mut cmd = redis::cmd(&command);
                    for word in &words[1..] {
                        cmd.arg(word.as_slice());
                    }
                    match cmd.query::<Value>(&mut *connection.borrow_mut()) {
                        Ok(value) => to_lua(lua, value),
                        Err(error) if protected => {
                            let t = lua.create_table()?;
                            t.raw_set("err", error.to_string())?;
                            Ok(LuaValue::Table(t))
                        }
                        Err(error) => Err(mlua::Error::runtime(error.to_string())),
                    }
                })
                .unwrap();
            redis_table.raw_set(name, f).unwrap();
        }
        let registered = functions.clone();
        let register = lua
            .create_function(
                move |_, (first, second): (LuaValue, Option<mlua::Function>)| {
                    let (name, callback, undeclared) = match (first, second) {
                        (LuaValue::String(name), Some(callback)) => {
                            (name.to_str()?.to_owned(), callback, false)
                        }
                        (LuaValue::Table(t), None) => {
                            let flags: Option<mlua::Table> = t.get("flags")?;
                            let undeclared = flags.is_some_and(|flags| {
                                flags
                                    .sequence_values::<String>()
                                    .any(|f| f.is_ok_and(|f| f == "allow-cross-slot-keys"))
                            });
                            (t.get("function_name")?, t.get("callback")?, undeclared)
                        }
                        _ => return Err(mlua::Error::runtime("register_function's arguments")),
                    };
                    registered.borrow_mut().insert(name, (callback, undeclared));
                    Ok(())
                },
            )
            .unwrap();
        redis_table.raw_set("register_function", register).unwrap();
        lua.globals().raw_set("redis", redis_table).unwrap();
        Self {
            lua,
            functions,
            call,
            faults,
        }
    }

    /// Loads a library's code (its `#!lua` line is Redis's, not Lua's).
    fn load_library(&self, code: &str) {
        let body = code.split_once('\n').unwrap().1;
        self.lua.load(body).set_name("library").exec().unwrap();
    }

    fn table(&self, words: &[Vec<u8>]) -> mlua::Table {
        let t = self.lua.create_table().unwrap();
        for (i, word) in words.iter().enumerate() {
            t.raw_set(i + 1, self.lua.create_string(word).unwrap())
                .unwrap();
        }
        t
    }

    /// Runs `FCALL name n keys.. args..` or `EVAL(SHA) script n keys.. args..` (the script
    /// given) and returns its reply as Redis would send it, or the error's text.
    fn run(&self, words: &[Vec<u8>], script: Option<&str>) -> Result<Value, String> {
        let n: usize = String::from_utf8_lossy(&words[2]).parse().unwrap();
        let (keys, args) = words[3..].split_at(n);
        let (keys_table, args_table) = (self.table(keys), self.table(args));
        let result = match script {
            None => {
                let name = String::from_utf8_lossy(&words[1]).into_owned();
                let (callback, undeclared) = self.functions.borrow()[&name].clone();
                *self.call.borrow_mut() = CallKeys {
                    keys: keys.to_vec(),
                    undeclared,
                };
                callback.call::<LuaValue>((keys_table, args_table))
            }
            Some(script) => {
                *self.call.borrow_mut() = CallKeys {
                    keys: keys.to_vec(),
                    undeclared: false,
                };
                let globals = self.lua.globals();
                globals.raw_set("KEYS", keys_table).unwrap();
                globals.raw_set("ARGV", args_table).unwrap();
                self.lua
                    .load(script)
                    .set_name("script")
                    .call::<LuaValue>(())
            }
        };
        match result {
            Ok(value) => self.reply(value),
            Err(error) => Err(error.to_string()),
        }
    }

    /// A script's reply as Redis converts it; a float is a fault (Lua 5.4 engines send a
    /// non-integral number as a string, Redis's Lua never has one).
    fn reply(&self, value: LuaValue) -> Result<Value, String> {
        Ok(match value {
            LuaValue::Integer(n) => Value::Int(n),
            LuaValue::Number(f) => {
                self.faults
                    .borrow_mut()
                    .push(format!("a float ({f:?}) in a script's reply"));
                Value::Int(f as i64)
            }
            LuaValue::String(s) => Value::BulkString(s.as_bytes().to_vec()),
            LuaValue::Boolean(true) => Value::Int(1),
            LuaValue::Boolean(false) | LuaValue::Nil => Value::Nil,
            LuaValue::Table(t) => {
                if let Ok(error) = t.raw_get::<String>("err") {
                    return Err(error);
                }
                if let Ok(status) = t.raw_get::<String>("ok") {
                    return Ok(Value::SimpleString(status));
                }
                let mut items = Vec::new();
                for item in t.sequence_values::<LuaValue>() {
                    items.push(self.reply(item.unwrap())?);
                }
                Value::Array(items)
            }
            other => return Err(format!("a script returned a {}", other.type_name())),
        })
    }
}

/// A Redis reply as a script sees it.
fn to_lua(lua: &Lua, value: Value) -> mlua::Result<LuaValue> {
    Ok(match value {
        Value::Nil => LuaValue::Boolean(false),
        Value::Int(n) => LuaValue::Integer(n),
        Value::BulkString(bytes) => LuaValue::String(lua.create_string(bytes)?),
        Value::Array(items) => {
            let t = lua.create_table()?;
            for (i, item) in items.into_iter().enumerate() {
                t.raw_set(i + 1, to_lua(lua, item)?)?;
            }
            LuaValue::Table(t)
        }
        Value::Okay => {
            let t = lua.create_table()?;
            t.raw_set("ok", "OK")?;
            LuaValue::Table(t)
        }
        Value::SimpleString(s) => {
            let t = lua.create_table()?;
            t.raw_set("ok", s)?;
            LuaValue::Table(t)
        }
        other => return Err(mlua::Error::runtime(format!("reply {other:?}"))),
    })
}

/// Every key of a server with its value, read by its type (no TTLs: the two runs write
/// at different moments).
fn contents(url: &str) -> Vec<(String, Value)> {
    let mut connection = redis::Client::open(url).unwrap().get_connection().unwrap();
    let mut keys: Vec<String> = redis::cmd("KEYS").arg("*").query(&mut connection).unwrap();
    keys.sort();
    keys.into_iter()
        .map(|key| {
            let kind: String = redis::cmd("TYPE").arg(&key).query(&mut connection).unwrap();
            let value = match kind.as_str() {
                "string" => redis::cmd("GET").arg(&key).query(&mut connection),
                "hash" => redis::cmd("HGETALL").arg(&key).query(&mut connection),
                "zset" => redis::cmd("ZRANGE")
                    .arg(&key)
                    .arg(0)
                    .arg(-1)
                    .arg("WITHSCORES")
                    .query(&mut connection),
                other => panic!("{key}: a {other}"),
            };
            (key, normal(value.unwrap()))
        })
        .collect()
}

/// Small deterministic randomness for the workload.
struct Steps(u64);

impl Steps {
    fn next(&mut self, below: u64) -> u64 {
        self.0 = self
            .0
            .wrapping_mul(6_364_136_223_846_793_005)
            .wrapping_add(1);
        (self.0 >> 33) % below
    }
}

fn limit(algorithm: Algorithm, limit: u32, window_ms: u64) -> Limit {
    Limit::new(algorithm, limit, Duration::from_millis(window_ms)).unwrap()
}

/// Drives a store through every script path on `url` (prefix `prefix`); resets need
/// more than the ACL line of the decisions.
async fn workload(url: &str, prefix: &str, resets: bool) {
    let clock = ManualClock::new(START);
    let store = RedisStore::connect(url)
        .await
        .unwrap()
        .with_prefix(prefix)
        .unwrap()
        .with_clock(clock.clone())
        .with_block_cache(None);
    let mut steps = Steps(7);
    let sets: Vec<Vec<Limit>> = Algorithm::ALL
        .iter()
        .flat_map(|&a| {
            let bursty = matches!(a, Algorithm::TokenBucket | Algorithm::Gcra);
            let first = if bursty {
                limit(a, 7, 1_000).with_burst(3).unwrap()
            } else {
                limit(a, 7, 1_000)
            };
            [
                vec![first.clone()],
                vec![
                    limit(a, 3, 300)
                        .with_lockout(Duration::from_millis(700))
                        .unwrap(),
                    limit(Algorithm::FixedWindow, 20, 60_000)
                        .with_name("day")
                        .unwrap(),
                ],
            ]
        })
        .collect();
    for (i, limits) in sets.iter().enumerate() {
        let key = Key::new(format!("k{i}"));
        for _ in 0..60 {
            clock.advance(Duration::from_millis(steps.next(120)));
            let cost = [0, 1, 1, 1, 2, 3, 5][steps.next(7) as usize];
            let decision = match steps.next(6) {
                0 => store.peek(&key, limits, cost).await,
                1 => store.reserve(&key, limits, cost, 400).await,
                _ => store.check(&key, limits, cost).await,
            }
            .unwrap();
            if let (true, Some(at)) = (decision.is_allowed(), decision.decided_at_ms()) {
                let adjustment = match steps.next(4) {
                    0 if cost > 0 => Some(Adjustment::Refund {
                        units: 1,
                        charged_at_ms: at,
                    }),
                    1 => Some(Adjustment::TopUp { units: 2 }),
                    _ => None,
                };
                if let Some(adjustment) = adjustment {
                    store.adjust(&key, limits, adjustment).await.unwrap();
                }
            }
        }
        if resets && i % 3 == 0 {
            store.reset(&key, limits).await.unwrap();
        }
    }
    // Coalesced batches: cold fixed windows (one call of many), and a hot key.
    let fixed = [limit(Algorithm::FixedWindow, 5, 1_000)];
    for round in 0..3 {
        let checks = (0..40).map(|n| {
            let key = Key::new(format!("cold{}", n + round * 10));
            store.check(&key, &fixed, 1)
        });
        for decision in futures_util::future::join_all(checks).await {
            decision.unwrap();
        }
        clock.advance(Duration::from_millis(400));
    }
    // Leases: a hot key on a store that leases quota.
    let leasing = RedisStore::connect(url)
        .await
        .unwrap()
        .with_prefix(&format!("{prefix}l"))
        .unwrap()
        .with_clock(clock.clone())
        .with_block_cache(None)
        .with_leases(LeaseConfig::new());
    for algorithm in [
        Algorithm::FixedWindow,
        Algorithm::TokenBucket,
        Algorithm::Gcra,
    ] {
        let limits = [limit(algorithm, 400, 10_000)];
        let key = Key::new("hot");
        for _ in 0..12 {
            let checks = (0..20).map(|_| leasing.check(&key, &limits, 1));
            for decision in futures_util::future::join_all(checks).await {
                decision.unwrap();
            }
            clock.advance(Duration::from_millis(50));
        }
    }
    leasing.release_leases().await.unwrap();
}

/// Records what `work` sends to the server at `url`.
async fn recorded<F: std::future::Future<Output = ()>>(url: &str, work: F) -> Vec<Command> {
    let client = redis::Client::open(url).unwrap();
    let monitor = client.get_async_monitor().await.unwrap();
    let mut lines = monitor.into_on_message::<String>();
    work.await;
    let mut connection = support::test_connection(url).await;
    let _: String = redis::cmd("ECHO")
        .arg("end-of-workload")
        .query_async(&mut connection)
        .await
        .unwrap();
    let mut commands = Vec::new();
    while let Some(line) = tokio::time::timeout(Duration::from_secs(30), lines.next())
        .await
        .expect("MONITOR fell silent")
    {
        let Some(words) = monitor_words(&line) else {
            continue;
        };
        if text(&words[0]) == "ECHO" && words[1] == b"end-of-workload" {
            return commands;
        }
        commands.push(words);
    }
    panic!("MONITOR ended early");
}

/// Replays `commands` on a Redis (Lua 5.1) and in Lua 5.4, and compares.
fn replay(source: &RedisServer, commands: &[Command]) -> HashMap<String, usize> {
    let (redis51, data54) = (RedisServer::start(), RedisServer::start());
    let mut on51 = redis::Client::open(redis51.url())
        .unwrap()
        .get_connection()
        .unwrap();
    let lua = Lua54::new(&data54.url());
    let script = tollgate::store::SCRIPT_SOURCE;
    let sha: String = redis::cmd("SCRIPT")
        .arg("LOAD")
        .arg(script)
        .query(&mut on51)
        .unwrap();
    let mut seen: HashMap<String, usize> = HashMap::new();
    let mut library_loaded = false;
    for words in commands {
        let command = text(&words[0]);
        let kind = match command.as_str() {
            "FCALL" => {
                if !library_loaded {
                    let code = library_code(source);
                    let _: String = redis::cmd("FUNCTION")
                        .arg("LOAD")
                        .arg("REPLACE")
                        .arg(&code)
                        .query(&mut on51)
                        .unwrap();
                    lua.load_library(&code);
                    library_loaded = true;
                }
                String::from_utf8_lossy(&words[1]).into_owned()
            }
            "EVALSHA" => {
                assert_eq!(words[1], sha.as_bytes(), "an EVALSHA of another script");
                "script".to_owned()
            }
            "DEL" | "UNLINK" => {
                let mut cmd = redis::cmd(&command);
                for word in &words[1..] {
                    cmd.arg(word.as_slice());
                }
                let a: Value = cmd.query(&mut on51).unwrap();
                let mut data = redis::Client::open(data54.url())
                    .unwrap()
                    .get_connection()
                    .unwrap();
                let b: Value = cmd.query(&mut data).unwrap();
                assert_eq!(a, b);
                continue;
            }
            _ => continue,
        };
        *seen.entry(kind).or_default() += 1;
        let mut cmd = redis::cmd(&command);
        for word in &words[1..] {
            cmd.arg(word.as_slice());
        }
        let expected = cmd
            .query::<Value>(&mut on51)
            .map(normal)
            .map_err(|e| e.to_string());
        let got = lua.run(words, (command == "EVALSHA").then_some(script));
        let call = String::from_utf8_lossy(&words.concat()).into_owned();
        assert!(
            expected.is_ok(),
            "the call failed on Redis itself: {expected:?}\n{call}"
        );
        assert_eq!(got, expected, "Lua 5.4 answered otherwise than Lua 5.1");
        let faults = lua.faults.borrow();
        assert!(
            faults.is_empty(),
            "under Lua 5.4: {}\nin the call {:?}",
            faults.join("\n"),
            words
                .iter()
                .map(|w| String::from_utf8_lossy(w).into_owned())
                .collect::<Vec<_>>()
        );
    }
    assert_eq!(
        contents(&data54.url()),
        contents(&redis51.url()),
        "Lua 5.4 left other keys than Lua 5.1"
    );
    seen
}

/// The code of the library loaded on `server`.
fn library_code(server: &RedisServer) -> String {
    let mut connection = redis::Client::open(server.url())
        .unwrap()
        .get_connection()
        .unwrap();
    let libraries: Vec<Vec<Value>> = redis::cmd("FUNCTION")
        .arg("LIST")
        .arg("WITHCODE")
        .query(&mut connection)
        .unwrap();
    let library = &libraries[0];
    let at = library
        .iter()
        .position(|v| matches!(v, Value::BulkString(b) if b == b"library_code"))
        .unwrap();
    match &library[at + 1] {
        Value::BulkString(code) => String::from_utf8(code.clone()).unwrap(),
        other => panic!("library_code {other:?}"),
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_library_runs_alike_under_lua_5_4() {
    if support::redis_server_major_version() < 7 {
        // No functions before Redis 7: the script's own test below covers it.
        return;
    }
    let server = RedisServer::start();
    let commands = recorded(&server.url(), workload(&server.url(), "t", true)).await;
    let seen = tokio::task::spawn_blocking(move || replay(&server, &commands))
        .await
        .unwrap();
    let names: Vec<&String> = seen.keys().collect();
    assert_eq!(
        seen.len(),
        3,
        "the general function, _fw and _fwn: {names:?}"
    );
    assert!(seen.values().all(|&n| n >= 3), "{seen:?}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_script_runs_alike_under_lua_5_4() {
    let server = RedisServer::start();
    // A user without functions: the store sends the script (EVALSHA), as it does to an
    // engine without FUNCTION (Dragonfly).
    let mut rules = support::acl::documented_rules("scripts", "t");
    rules.retain(|rule| rule != "+fcall" && rule != "+function|load");
    rules.push("~tl:*".to_owned());
    support::acl::set_user(&server, &rules);
    let url = support::acl::url_for(&server, "scripts");
    let commands = recorded(&server.url(), workload(&url, "t", false)).await;
    let seen = tokio::task::spawn_blocking(move || replay(&server, &commands))
        .await
        .unwrap();
    assert!(
        seen.get("script").is_some_and(|&n| n > 100) && seen.len() == 1,
        "{seen:?}"
    );
}
