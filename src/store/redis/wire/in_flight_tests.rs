//! The library's function for in-flight batches (lua/one_in_flight.lua) against the
//! general function (lua/main.lua) on a real Redis: random sequences of batches of
//! decisions and releases (bare, with a refund, with a top-up), each batch sent as the
//! lean call to one database and as its general form ([`as_evalsha`]) to another, at the
//! same (caller's) `now`. Every reply must be the same, and after every batch both
//! databases must hold the same keys with the same values and TTLs.

use proptest::{prelude::*, test_runner::TestRunner};
use redis::{Connection, Value};
use tollgate_test_support::RedisServer;

use super::{
    function::{Adjust, InFlightEntry, LIBRARY, as_evalsha, in_flight_call},
    script::SCRIPT_SOURCE,
};

/// One operation of a batch.
#[derive(Debug, Clone)]
enum Op {
    /// A decision for client `client` (of two) of `cost` (1 to its limit), its permit's
    /// TTL the case's, or three times it when `long` (two layers with different TTLs on
    /// one key).
    Decide {
        client: usize,
        cost: u32,
        long: bool,
    },
    /// The release of the `pick`-th permit still out (none out: a decision instead), with
    /// an adjustment of `units` (0: bare), a refund when `refund`, else a top-up.
    Release {
        pick: usize,
        units: u32,
        refund: bool,
    },
}

/// The limits of one case: the window's limit and length, the most permits, their TTL.
#[derive(Debug, Clone, Copy)]
struct Shape {
    limit: u64,
    window_ms: u64,
    max: u64,
    ttl_ms: u64,
}

fn shape() -> impl Strategy<Value = Shape> {
    (
        1u64..=4,
        prop_oneof![Just(1_000u64), Just(60_000)],
        1u64..=3,
        200u64..=3_000,
    )
        .prop_map(|(limit, window_ms, max, ttl_ms)| Shape {
            limit,
            window_ms,
            max,
            ttl_ms,
        })
}

fn op() -> impl Strategy<Value = Op> {
    prop_oneof![
        3 => (0usize..2, 1u32..=4, prop::bool::weighted(0.2))
            .prop_map(|(client, cost, long)| Op::Decide { client, cost, long }),
        2 => (0usize..8, 0u32..=3, any::<bool>())
            .prop_map(|(pick, units, refund)| Op::Release { pick, units, refund }),
    ]
}

/// Batches, each after a step of the clock (now and then back: a caller's clock).
fn batches() -> impl Strategy<Value = Vec<(i64, Vec<Op>)>> {
    prop::collection::vec((-300i64..1_500, prop::collection::vec(op(), 1..7)), 1..12)
}

fn connect(server: &RedisServer, db: u8) -> Connection {
    let mut connection = redis::Client::open(server.url())
        .unwrap()
        .get_connection()
        .unwrap();
    redis::cmd("SELECT").arg(db).exec(&mut connection).unwrap();
    connection
}

/// Every key of the connection's database: its name, its value (a string's, or a sorted
/// set's members and scores) and its TTL in ms.
fn contents(connection: &mut Connection) -> Vec<(String, Value, i64)> {
    let mut keys: Vec<String> = redis::cmd("KEYS").arg("*").query(connection).unwrap();
    keys.sort();
    keys.into_iter()
        .map(|key| {
            let kind: String = redis::cmd("TYPE").arg(&key).query(connection).unwrap();
            let value = if kind == "zset" {
                redis::cmd("ZRANGE")
                    .arg(&key)
                    .arg(0)
                    .arg(-1)
                    .arg("WITHSCORES")
                    .query(connection)
            } else {
                redis::cmd("GET").arg(&key).query(connection)
            }
            .unwrap();
            let ttl: i64 = redis::cmd("PTTL").arg(&key).query(connection).unwrap();
            (key, value, ttl)
        })
        .collect()
}

/// Runs `batches` under `shape` on both databases, comparing as it goes.
fn run(
    lean: &mut Connection,
    general: &mut Connection,
    shape: Shape,
    batches: &[(i64, Vec<Op>)],
) -> Result<(), TestCaseError> {
    redis::cmd("FLUSHDB").exec(lean).unwrap();
    redis::cmd("FLUSHDB").exec(general).unwrap();
    let windows: Vec<String> = (0..2)
        .map(|c| format!("t:{{c{c}}}:fw2:{}:{}", shape.limit, shape.window_ms))
        .collect();
    let permits: Vec<String> = (0..2).map(|c| format!("t:{{c{c}}}:inflight")).collect();
    let mut now: u64 = 1_800_000_000_000 - 1_234;
    let mut next_id = 0u64;
    // The permits out: client, id, the `now` it was taken at.
    let mut out: Vec<(usize, String, u64)> = Vec::new();
    for (step, ops) in batches {
        now = now.saturating_add_signed(*step);
        // Each op's id first (the entries borrow them).
        // Client, id, the cost or adjustment, whether a decision, its TTL.
        type Planned = (usize, String, Option<(u32, i64)>, bool, u64);
        let mut planned: Vec<Planned> = Vec::new();
        for op in ops {
            match *op {
                Op::Release {
                    pick,
                    units,
                    refund,
                } if !out.is_empty() => {
                    let (client, id, at) = out.remove(pick % out.len());
                    let adjust = (units > 0).then(|| {
                        (
                            units,
                            if refund {
                                i64::try_from(at).unwrap()
                            } else {
                                -1
                            },
                        )
                    });
                    planned.push((client, id, adjust, false, 1));
                }
                Op::Decide { client, cost, long } => {
                    next_id += 1;
                    let ttl = if long { 3 * shape.ttl_ms } else { shape.ttl_ms };
                    let id = format!("{next_id:016x}");
                    planned.push((client, id, Some((cost, 0)), true, ttl));
                }
                Op::Release { pick, .. } => {
                    next_id += 1;
                    let id = format!("{next_id:016x}");
                    planned.push((pick % 2, id, Some((1, 0)), true, shape.ttl_ms));
                }
            }
        }
        let entries: Vec<InFlightEntry<'_>> = planned
            .iter()
            .map(|(client, id, adjust, decide, ttl_ms)| {
                let (window, permits) = (windows[*client].as_bytes(), permits[*client].as_bytes());
                match (decide, adjust) {
                    (true, Some((cost, _))) => InFlightEntry::Decide {
                        window,
                        permits,
                        cost: (*cost).min(u32::try_from(shape.limit).unwrap()),
                        limit: shape.limit,
                        window_ms: shape.window_ms,
                        max: shape.max,
                        ttl_ms: *ttl_ms,
                        id,
                    },
                    (_, adjust) => InFlightEntry::Release {
                        adjust: adjust.map(|(units, at)| Adjust {
                            window,
                            limit: shape.limit,
                            window_ms: shape.window_ms,
                            units,
                            at,
                        }),
                        permits,
                        max: shape.max,
                        id,
                    },
                }
            })
            .collect();
        let call = in_flight_call(Some(now), &entries);
        let a: Vec<i64> = call.query(lean).unwrap();
        let b: Vec<i64> = as_evalsha(&call).query(general).unwrap();
        prop_assert_eq!(&a, &b, "batch {:?} at {}", entries, now);
        // The permits taken: each decision's permit's answer, the last of its eight.
        let mut at = 0;
        for (client, id, adjust, decide, _) in planned {
            if decide {
                if a[at] == 1 && a[at + 4] == 1 {
                    out.push((client, id, now));
                }
                at += 8;
            } else {
                at += if adjust.is_some() { 8 } else { 4 };
            }
        }
        let (mut x, mut y) = (contents(lean), contents(general));
        for ((_, _, ttl_x), (_, _, ttl_y)) in x.iter_mut().zip(y.iter_mut()) {
            // Both live, set within the same few ms: as the same TTL.
            prop_assert!(*ttl_x > 0 && *ttl_y > 0, "a key without a TTL");
            prop_assert!(
                (*ttl_x - *ttl_y).abs() < 250,
                "TTLs {} and {}",
                ttl_x,
                ttl_y
            );
            (*ttl_x, *ttl_y) = (0, 0);
        }
        prop_assert_eq!(x, y, "after the batch at {}", now);
    }
    Ok(())
}

/// The lean function answers and writes exactly as the general function does.
#[test]
fn the_in_flight_function_decides_like_the_general_function() {
    if tollgate_test_support::redis_server_major_version() < 7 {
        // No functions before Redis 7: every call is the general script's.
        return;
    }
    let server = RedisServer::start();
    let (lean, general) = (
        std::cell::RefCell::new(connect(&server, 0)),
        std::cell::RefCell::new(connect(&server, 1)),
    );
    redis::cmd("FUNCTION")
        .arg("LOAD")
        .arg("REPLACE")
        .arg(LIBRARY.as_str())
        .exec(&mut *lean.borrow_mut())
        .unwrap();
    redis::cmd("SCRIPT")
        .arg("LOAD")
        .arg(SCRIPT_SOURCE)
        .exec(&mut *general.borrow_mut())
        .unwrap();
    let mut runner = TestRunner::new(ProptestConfig {
        cases: 96,
        ..ProptestConfig::default()
    });
    runner
        .run(&(shape(), batches()), |(shape, batches)| {
            run(
                &mut lean.borrow_mut(),
                &mut general.borrow_mut(),
                shape,
                &batches,
            )
        })
        .unwrap();
}
