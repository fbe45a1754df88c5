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

/// AIMD, window by window: +1 per window that pressed against the limit (3/4 of it in
/// flight at once), ×0.9 per window with a drop; a window that did not press eases the
/// limit a fifth of the way toward 3x its busiest moment (or `initial`, if larger).
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
    // A window: `at_once` requests at once, 100 ms later.
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
    // (A window closes at its 5th sample; the rest of its requests count in the next.)
    assert_eq!(window(&concurrency, 8, Outcome::Success), 11);
    assert_eq!(window(&concurrency, 9, Outcome::Success), 12);
    // At most 7 of 12 (the last window's) is under 3/4: the traffic kept the limit from
    // mattering. It eases toward max(3 * 7, 10): 12 + 9 / 5 = 13.8.
    assert_eq!(window(&concurrency, 5, Outcome::Success), 13);
    assert_eq!(window(&concurrency, 5, Outcome::Dropped), 12); // 13.8 * 0.9 = 12.42
    assert_eq!(window(&concurrency, 5, Outcome::Dropped), 11); // 11.18
    // Ignored outcomes (a client that hung up) are no samples: the window stays open.
    assert_eq!(window(&concurrency, 5, Outcome::Ignore), 11);
    assert_eq!(concurrency.snapshot().samples, 22);
}

/// AIMD with a latency threshold backs off on slow requests too, when the traffic presses
/// against the limit; a slow request while it does not (a stalled timer at low load) is
/// not the limit's doing.
#[test]
fn aimd_counts_slow_requests_as_drops_when_pressed() {
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
    assert_eq!(
        concurrency.snapshot().limit,
        10,
        "1 of 10 in flight: not pressed"
    );
    let start = start + Duration::from_millis(100);
    let permits: Vec<_> = (0..8)
        .map(|_| concurrency.try_acquire(Priority::Default, start).unwrap())
        .collect();
    for permit in permits {
        permit.finish(start + Duration::from_millis(80), Outcome::Success);
    }
    assert_eq!(
        concurrency.snapshot().limit,
        9,
        "8 of 10 in flight: pressed"
    );
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

/// What is kept for critical requests follows their demand: 1.25x the most of them in
/// flight lately, with the static share (10%) as a floor; sheddable requests get the rest
/// less what is kept for default ones.
#[test]
fn the_share_kept_for_critical_follows_their_demand() {
    let concurrency = Concurrency::new(
        AdaptiveLimit::new(Aimd::new())
            .with_bounds(20, 20, 20)
            .unwrap()
            .with_window(MS, 1)
            .unwrap(),
    );
    let now = Duration::ZERO;
    let admit = |priority, count| -> Vec<_> {
        (0..count)
            .map_while(|_| concurrency.try_acquire(priority, now).ok())
            .collect()
    };
    // Nothing critical in flight: the static shares, 2 and 2 of 20 (the 16 admitted are
    // dropped at once).
    assert_eq!(admit(Priority::Sheddable, 30).len(), 16);
    assert_eq!(concurrency.snapshot().in_flight, 0);

    // 8 critical in flight: 10 kept for them, 2 for default ones, 8 left for sheddable.
    let critical = admit(Priority::Critical, 8);
    let sheddable = admit(Priority::Sheddable, 30);
    assert_eq!(sheddable.len(), 8);
    // Default ones may use what is kept for them: 20 - 10 - 8.
    let default = admit(Priority::Default, 30);
    assert_eq!(default.len(), 2);
    // Critical ones may use all of the limit.
    let more = admit(Priority::Critical, 30);
    assert_eq!(more.len(), 2);
    assert_eq!(concurrency.snapshot().in_flight, 20);
    assert_eq!(concurrency.snapshot().shed, [2, 1, 1]);

    // Their demand gone for two windows, the floor is back.
    drop((critical, more, sheddable, default));
    for at in [2, 4] {
        let later = Duration::from_millis(at);
        let permit = concurrency.try_acquire(Priority::Sheddable, later).unwrap();
        permit.finish(later + MS, Outcome::Success);
    }
    assert_eq!(admit(Priority::Sheddable, 30).len(), 16);
}

/// An open-loop load on a FIFO upstream of `CAPACITY` workers, 1 ms a step: `load` x the
/// capacity arrives whatever the answers, every 10th request critical, the others
/// sheddable; an admitted request waits for the first free worker, which holds it for
/// `service(now)`.
struct OpenLoop {
    now: Duration,
    /// When each worker is free.
    workers: Vec<Duration>,
    /// Admitted requests and when they end.
    running: Vec<(Duration, tollgate::adaptive::Permit)>,
    sent: u64,
    due: f64,
}

#[derive(Debug, Default)]
struct Tally {
    admitted: u64,
    shed: u64,
    critical: u64,
    critical_served: u64,
    latencies: Vec<Duration>,
}

impl Tally {
    fn p99(&mut self) -> Duration {
        self.latencies.sort_unstable();
        self.latencies[(self.latencies.len() - 1) * 99 / 100]
    }

    /// Admitted requests per second, as a share of the capacity.
    fn goodput(&self, length: Duration) -> f64 {
        let capacity = f64::from(CAPACITY) / SERVICE.as_secs_f64();
        self.admitted as f64 / length.as_secs_f64() / capacity
    }
}

impl OpenLoop {
    fn new() -> Self {
        Self {
            now: Duration::ZERO,
            workers: vec![Duration::ZERO; CAPACITY as usize],
            running: Vec::new(),
            sent: 0,
            due: 0.0,
        }
    }

    fn run(
        &mut self,
        concurrency: &Concurrency,
        length: Duration,
        load: f64,
        service: impl Fn(Duration) -> Duration,
    ) -> Tally {
        let per_ms = load * f64::from(CAPACITY) / SERVICE.as_secs_f64() / 1000.0;
        let end = self.now + length;
        let mut tally = Tally::default();
        while self.now < end {
            let now = self.now;
            self.running.sort_by_key(|(ends, _)| *ends);
            let done = self.running.partition_point(|(ends, _)| *ends <= now);
            for (ends, permit) in self.running.drain(..done) {
                permit.finish(ends, Outcome::Success);
            }
            self.due += per_ms;
            while (self.sent as f64) < self.due {
                self.sent += 1;
                let priority = if self.sent.is_multiple_of(10) {
                    Priority::Critical
                } else {
                    Priority::Sheddable
                };
                let critical = priority == Priority::Critical;
                tally.critical += u64::from(critical);
                let Ok(permit) = concurrency.try_acquire(priority, now) else {
                    tally.shed += 1;
                    continue;
                };
                let worker = (0..self.workers.len())
                    .min_by_key(|&w| self.workers[w])
                    .unwrap();
                let ends = self.workers[worker].max(now) + service(now);
                self.workers[worker] = ends;
                self.running.push((ends, permit));
                tally.admitted += 1;
                tally.critical_served += u64::from(critical);
                tally.latencies.push(ends - now);
            }
            self.now += MS;
        }
        tally
    }
}

fn service(_: Duration) -> Duration {
    SERVICE
}

/// The algorithms as the overload benchmark runs them.
fn both() -> [(&'static str, Concurrency); 2] {
    let bounds = |limit: AdaptiveLimit| Concurrency::new(limit.with_bounds(1, 10, 1000).unwrap());
    [
        (
            "aimd",
            bounds(AdaptiveLimit::new(
                Aimd::new().with_slow(Some(SERVICE * 3 / 2)),
            )),
        ),
        ("gradient", bounds(AdaptiveLimit::new(Gradient::new()))),
    ]
}

/// At 4x the capacity, with critical requests 40% of the capacity: at least 99% of them
/// are served while sheddable ones are shed, the upstream stays busy, and the admitted
/// requests' p99 stays within 2x the service time.
#[test]
fn critical_requests_are_served_at_4x_when_they_need_40_percent() {
    for (name, concurrency) in both() {
        let mut upstream = OpenLoop::new();
        upstream.run(&concurrency, Duration::from_secs(10), 0.5, service);
        let length = Duration::from_secs(30);
        let mut tally = upstream.run(&concurrency, length, 4.0, service);
        let served = tally.critical_served as f64 / tally.critical as f64;
        eprintln!(
            "{name}: critical {served:.4}, goodput {:.3}, p99 {:?}, {:?}",
            tally.goodput(length),
            tally.p99(),
            concurrency.snapshot()
        );
        assert!(served >= 0.99, "{name}: critical served {served}");
        assert!(tally.shed > 0, "{name}: sheddable requests shed");
        assert!(tally.goodput(length) >= 0.9, "{name}: {tally:?}");
        assert!(tally.p99() <= 2 * SERVICE, "{name}: p99 {:?}", tally.p99());
    }
}

/// At half the capacity, after a normal day, timer stalls that make every request 50%
/// slower for 200 ms each second (as a loaded machine's timer does) shed nothing: a window
/// that does not press against the limit says nothing about it.
#[test]
fn nothing_is_shed_at_half_load_with_a_stalling_timer() {
    let stalling = |now: Duration| {
        if now.subsec_millis() < 200 {
            SERVICE * 3 / 2
        } else {
            SERVICE
        }
    };
    for (name, concurrency) in both() {
        let mut upstream = OpenLoop::new();
        upstream.run(&concurrency, Duration::from_secs(5), 0.5, service);
        let tally = upstream.run(&concurrency, Duration::from_secs(60), 0.5, stalling);
        assert_eq!(tally.shed, 0, "{name}: {:?}", concurrency.snapshot());
    }
}

/// After 30 s at 4x, back at 0.5x: the limit is within 10% of its value on the normal day
/// before within 30 s (from above or below), and nothing is shed once what the overload
/// left in flight has drained.
#[test]
fn the_limit_comes_back_to_its_normal_day_value_after_an_overload() {
    for (name, concurrency) in both() {
        let mut upstream = OpenLoop::new();
        upstream.run(&concurrency, Duration::from_secs(30), 0.5, service);
        let normal = f64::from(concurrency.snapshot().limit);
        upstream.run(&concurrency, Duration::from_secs(30), 4.0, service);
        let overloaded = concurrency.snapshot().limit;
        let mut back = None;
        for second in 1..=30 {
            let tally = upstream.run(&concurrency, Duration::from_secs(1), 0.5, service);
            // (The first second drains what the overload left in flight.)
            if second > 1 {
                assert_eq!(tally.shed, 0, "{name}: shed at 0.5x after the overload");
            }
            let limit = f64::from(concurrency.snapshot().limit);
            if back.is_none() && (limit - normal).abs() <= 0.1 * normal {
                back = Some(second);
            }
        }
        let limit = concurrency.snapshot().limit;
        eprintln!(
            "{name}: normal {normal}, overloaded {overloaded}, back after {back:?} s, {limit}"
        );
        assert!(back.is_some(), "{name}: limit {limit}, normal day {normal}");
        assert!(
            (f64::from(limit) - normal).abs() <= 0.1 * normal,
            "{name}: limit {limit} at the end, normal day {normal}"
        );
    }
}
