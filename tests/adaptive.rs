//! The adaptive limit's arithmetic, priorities and recovery, with made-up times: no sleeps.
//!
//! The simulated upstream has `CAPACITY` workers and a service time of `SERVICE`: with `n`
//! requests in it, each takes `SERVICE * max(1, n / CAPACITY)` (processor sharing), so
//! latency grows with load beyond capacity. `clients` closed-loop clients each send their
//! next request as soon as the last one ends (or, when shed, 1 ms later).

use std::time::Duration;

use tollgate::adaptive::{AdaptiveLimit, Aimd, Concurrency, Gradient, Outcome, Priority, Shares};

const CAPACITY: u32 = 10;
const SERVICE: Duration = Duration::from_millis(10);
const MS: Duration = Duration::from_millis(1);

/// Runs `clients` closed-loop clients of `priority` for `length` from `*now`, one round at
/// a time: each round admits what the limit lets in, they all finish after the upstream's
/// latency for that many. Returns (admitted, shed, the worst latency admitted).
fn run(
    concurrency: &Concurrency,
    now: &mut Duration,
    length: Duration,
    clients: &[(Priority, u32)],
) -> (u64, u64, Duration) {
    let end = *now + length;
    let (mut admitted, mut shed, mut worst) = (0, 0, Duration::ZERO);
    while *now < end {
        let mut permits = Vec::new();
        for &(priority, count) in clients {
            for _ in 0..count {
                match concurrency.try_acquire(priority, *now) {
                    Ok(permit) => permits.push(permit),
                    Err(_) => shed += 1,
                }
            }
        }
        if permits.is_empty() {
            *now += MS;
            continue;
        }
        let n = permits.len() as u32;
        let latency = if n > CAPACITY {
            SERVICE * n / CAPACITY
        } else {
            SERVICE
        };
        worst = worst.max(latency);
        *now += latency;
        for permit in permits {
            permit.finish(*now, Outcome::Success);
            admitted += 1;
        }
    }
    (admitted, shed, worst)
}

fn gradient(initial: u32) -> Concurrency {
    Concurrency::new(
        AdaptiveLimit::new(Gradient::new())
            .with_bounds(1, initial, 1000)
            .unwrap(),
    )
}

#[test]
fn settings_are_refused_naming_the_field() {
    let error = AdaptiveLimit::new(Aimd::new())
        .with_bounds(0, 1, 2)
        .unwrap_err();
    assert_eq!(error.field(), "adaptive.min");
    let error = AdaptiveLimit::new(Aimd::new())
        .with_bounds(5, 4, 10)
        .unwrap_err();
    assert_eq!(error.field(), "adaptive.initial");
    let error = AdaptiveLimit::new(Aimd::new())
        .with_window(Duration::ZERO, 1)
        .unwrap_err();
    assert_eq!(error.field(), "adaptive.window");
    assert_eq!(
        Aimd::new().with_backoff(1.0).unwrap_err().field(),
        "adaptive.backoff"
    );
    assert_eq!(
        Gradient::new().with_tolerance(0.9).unwrap_err().field(),
        "adaptive.tolerance"
    );
    assert_eq!(
        Gradient::new().with_smoothing(0.0).unwrap_err().field(),
        "adaptive.smoothing"
    );
    assert_eq!(
        Shares::new(0.6, 0.4).unwrap_err().field(),
        "adaptive.shares"
    );
}

/// A limit of 10: sheddable requests may use 8, default 9, critical all 10.
#[test]
fn the_least_critical_are_shed_first() {
    let concurrency = Concurrency::new(
        AdaptiveLimit::new(Aimd::new())
            .with_bounds(10, 10, 10)
            .unwrap(),
    );
    let now = Duration::ZERO;
    let mut held = Vec::new();
    for _ in 0..8 {
        held.push(concurrency.try_acquire(Priority::Sheddable, now).unwrap());
    }
    let shed = concurrency
        .try_acquire(Priority::Sheddable, now)
        .unwrap_err();
    assert_eq!(
        (shed.priority, shed.limit, shed.in_flight),
        (Priority::Sheddable, 10, 8)
    );
    held.push(concurrency.try_acquire(Priority::Default, now).unwrap());
    assert!(concurrency.try_acquire(Priority::Default, now).is_err());
    held.push(concurrency.try_acquire(Priority::Critical, now).unwrap());
    assert!(concurrency.try_acquire(Priority::Critical, now).is_err());
    let snapshot = concurrency.snapshot();
    assert_eq!(snapshot.in_flight, 10);
    assert_eq!(snapshot.shed, [1, 1, 1]);
    // Dropped permits come back (no sample): everything is free again.
    drop(held);
    assert_eq!(concurrency.snapshot().in_flight, 0);
    assert_eq!(concurrency.snapshot().samples, 0);
    assert!(concurrency.try_acquire(Priority::Sheddable, now).is_ok());
}

/// AIMD, window by window: +1 per window that used half the limit, ×0.9 per window with a
/// drop, nothing for a window that did not use the limit.
#[test]
fn aimd_adds_and_multiplies() {
    let concurrency = Concurrency::new(
        AdaptiveLimit::new(Aimd::new())
            .with_bounds(1, 10, 100)
            .unwrap()
            .with_window(Duration::from_millis(100), 5)
            .unwrap(),
    );
    let mut now = Duration::ZERO;
    // A window: 5 requests at once (half of 10), 100 ms later.
    let mut window = |concurrency: &Concurrency, at_once: u32, outcome: Outcome| {
        let permits: Vec<_> = (0..at_once)
            .map(|_| concurrency.try_acquire(Priority::Default, now).unwrap())
            .collect();
        now += Duration::from_millis(100);
        for permit in permits {
            permit.finish(now, outcome);
        }
        concurrency.snapshot().limit
    };
    assert_eq!(window(&concurrency, 5, Outcome::Success), 11);
    assert_eq!(window(&concurrency, 6, Outcome::Success), 12);
    // 5 of 12 is under half: the traffic kept the limit from mattering.
    assert_eq!(window(&concurrency, 5, Outcome::Success), 12);
    assert_eq!(window(&concurrency, 5, Outcome::Dropped), 10); // 12 * 0.9 = 10.8
    assert_eq!(window(&concurrency, 5, Outcome::Dropped), 9); // 9.72
    // Ignored outcomes (a client that hung up) are no samples: the window stays open.
    assert_eq!(window(&concurrency, 5, Outcome::Ignore), 9);
    assert_eq!(concurrency.snapshot().samples, 16);
}

/// AIMD with a latency threshold backs off on slow requests too.
#[test]
fn aimd_counts_slow_requests_as_drops() {
    let concurrency = Concurrency::new(
        AdaptiveLimit::new(Aimd::new().with_slow(Some(Duration::from_millis(50))))
            .with_bounds(1, 10, 100)
            .unwrap()
            .with_window(Duration::from_millis(1), 1)
            .unwrap(),
    );
    let start = Duration::ZERO;
    let permit = concurrency.try_acquire(Priority::Default, start).unwrap();
    permit.finish(start + Duration::from_millis(80), Outcome::Success);
    assert_eq!(concurrency.snapshot().limit, 9);
}

/// The gradient limit under 4x its upstream's capacity keeps admitted latency within 2x
/// the unloaded one and the upstream busy, and comes back once the overload ends.
#[test]
fn gradient_holds_an_overload_and_recovers() {
    let concurrency = gradient(20);
    let mut now = Duration::ZERO;
    // A normal day: half the capacity. Nothing is shed.
    let (_, shed, worst) = run(
        &concurrency,
        &mut now,
        Duration::from_secs(30),
        &[(Priority::Default, 5)],
    );
    assert_eq!(shed, 0, "nothing shed at 0.5x");
    assert_eq!(worst, SERVICE);
    let normal = concurrency.snapshot().limit;
    let baseline = concurrency.snapshot().baseline.unwrap();
    assert!(baseline <= SERVICE + MS, "baseline {baseline:?}");

    // 4x the capacity for a minute: the limit comes down to about the capacity.
    let (admitted, _, _) = run(
        &concurrency,
        &mut now,
        Duration::from_secs(30),
        &[(Priority::Default, 40)],
    );
    let (admitted_late, _, worst) = run(
        &concurrency,
        &mut now,
        Duration::from_secs(30),
        &[(Priority::Default, 40)],
    );
    let limit = concurrency.snapshot().limit;
    eprintln!(
        "overload: {:?} worst {worst:?} normal {normal}",
        concurrency.snapshot()
    );
    assert!(limit <= 3 * CAPACITY, "limit under overload: {limit}");
    assert!(
        worst <= 2 * SERVICE,
        "p100 admitted under overload: {worst:?}"
    );
    // Goodput: the upstream served at least 90% of its capacity (1 000 a second).
    let goodput = admitted_late as f64 / 30.0;
    assert!(
        goodput >= 900.0,
        "goodput {goodput}/s (first half {admitted})"
    );
    // The overload did not teach the baseline its queueing.
    let learned = concurrency.snapshot().baseline.unwrap();
    assert!(
        learned <= SERVICE * 3 / 2,
        "baseline after the overload {learned:?}"
    );

    // Back to a normal day at full capacity: nothing is shed, the limit stays where the
    // normal day had it (within 10%).
    let (_, shed, worst) = run(
        &concurrency,
        &mut now,
        Duration::from_secs(30),
        &[(Priority::Default, 10)],
    );
    assert_eq!(shed, 0, "nothing shed after the overload");
    assert_eq!(worst, SERVICE);
    let after = concurrency.snapshot().limit;
    assert!(
        f64::from(after) >= 0.9 * f64::from(normal),
        "limit after: {after}, normal day {normal}"
    );
}

/// An upstream that fails for 10 s drives the limit to its minimum; once it is healthy
/// again, under full load the limit is back within 10% of the normal day's in 30 s.
#[test]
fn the_limit_recovers_after_failures_end() {
    let concurrency = gradient(20);
    let mut now = Duration::ZERO;
    run(
        &concurrency,
        &mut now,
        Duration::from_secs(10),
        &[(Priority::Default, 10)],
    );
    let normal = concurrency.snapshot().limit;
    let failing_until = now + Duration::from_secs(10);
    while now < failing_until {
        let permits: Vec<_> = (0..10)
            .filter_map(|_| concurrency.try_acquire(Priority::Default, now).ok())
            .collect();
        now += SERVICE;
        for permit in permits {
            permit.finish(now, Outcome::Dropped);
        }
    }
    assert_eq!(
        concurrency.snapshot().limit,
        1,
        "failures drive it to the minimum"
    );
    run(
        &concurrency,
        &mut now,
        Duration::from_secs(30),
        &[(Priority::Default, 10)],
    );
    let after = concurrency.snapshot().limit;
    assert!(
        f64::from(after) >= 0.9 * f64::from(normal),
        "limit 30 s after the failures: {after}, normal day {normal}"
    );
}

/// Critical traffic is served under an overload of sheddable traffic.
#[test]
fn critical_requests_are_served_while_sheddable_ones_are_shed() {
    let concurrency = gradient(20);
    let mut now = Duration::ZERO;
    run(
        &concurrency,
        &mut now,
        Duration::from_secs(10),
        &[(Priority::Default, 5)],
    );
    let mut served = 0;
    let mut critical_shed = 0;
    let end = now + Duration::from_secs(30);
    while now < end {
        // Critical clients first in the round, as they arrive mixed with sheddable ones.
        let mut permits = Vec::new();
        for i in 0..44 {
            let priority = if i % 11 == 0 {
                Priority::Critical
            } else {
                Priority::Sheddable
            };
            match concurrency.try_acquire(priority, now) {
                Ok(permit) => permits.push((priority, permit)),
                Err(shed) => critical_shed += u32::from(shed.priority == Priority::Critical),
            }
        }
        let n = permits.len() as u32;
        now += if n > CAPACITY {
            SERVICE * n / CAPACITY
        } else {
            SERVICE
        };
        for (priority, permit) in permits {
            served += u32::from(priority == Priority::Critical);
            permit.finish(now, Outcome::Success);
        }
    }
    let snapshot = concurrency.snapshot();
    let critical = served + critical_shed;
    assert!(
        f64::from(served) >= 0.99 * f64::from(critical),
        "critical served {served} of {critical}; shed {:?}",
        snapshot.shed
    );
    assert!(snapshot.shed[0] > 0, "sheddable requests were shed");
}
