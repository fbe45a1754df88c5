//! The overload benchmark (issue 27): a simulated upstream of fixed capacity behind no
//! limit, a fixed in-flight limit and tollgate's adaptive limits, offered 0.5x to 4x its
//! capacity, in one run.
//!
//! The upstream has `WORKERS` workers and a service time of `SERVICE`: a request waits
//! for a free worker (FIFO, unbounded queue), so beyond capacity latency grows with load.
//! Load is open loop: requests arrive at a fixed rate whatever the answers, each one
//! critical with probability 10%, else sheddable. Times are real (tokio's timer), since
//! what is measured is sleeping, not CPU.
//!
//! ```text
//! cargo run --release -p tollgate-bench --bin overload            # ~4 min
//! SECONDS=3 cargo run --release -p tollgate-bench --bin overload  # a quick look
//! ```
//!
//! Prints one CSV line per mode and load (and writes them to bench/results-overload.csv):
//! goodput (served per second, as a share of capacity), the admitted requests' p50 and p99
//! latency (as a multiple of the service time), shed requests, and the share of critical
//! requests served. Then, per adaptive mode, how long the limit takes after a 4x overload
//! to come back within 10% of its value at 0.5x.

use std::{
    fmt::Write as _,
    sync::{
        Arc, Mutex,
        atomic::{AtomicU64, Ordering},
    },
    time::{Duration, Instant},
};

use tokio::sync::Semaphore;
use tollgate::adaptive::{AdaptiveLimit, Aimd, Concurrency, Gradient, Outcome, Priority};

const WORKERS: usize = 20;
const SERVICE: Duration = Duration::from_millis(20);
/// Requests a second the upstream serves at most.
const CAPACITY: f64 = WORKERS as f64 / 0.020;
const LOADS: [f64; 4] = [0.5, 1.0, 2.0, 4.0];

#[derive(Clone, Copy, Debug)]
enum Mode {
    None,
    /// A fixed in-flight limit tuned for the normal day: the workers plus half again.
    Fixed,
    Aimd,
    Gradient,
}

impl Mode {
    fn name(self) -> &'static str {
        match self {
            Mode::None => "none",
            Mode::Fixed => "fixed",
            Mode::Aimd => "aimd",
            Mode::Gradient => "gradient",
        }
    }

    fn limit(self) -> Option<Concurrency> {
        let limit = match self {
            Mode::None => return None,
            Mode::Fixed => {
                let fixed = (WORKERS * 3 / 2) as u32;
                AdaptiveLimit::new(Aimd::new()).with_bounds(fixed, fixed, fixed)
            }
            // AIMD backs off on latency: a request over twice the service time is a drop.
            Mode::Aimd => AdaptiveLimit::new(Aimd::new().with_slow(Some(SERVICE * 2)))
                .with_bounds(1, 20, 1000),
            Mode::Gradient => AdaptiveLimit::new(Gradient::new()).with_bounds(1, 20, 1000),
        };
        Some(Concurrency::new(limit.expect("valid bounds")))
    }
}

struct Upstream {
    workers: Semaphore,
}

impl Upstream {
    async fn call(&self) {
        let _worker = self.workers.acquire().await.expect("open");
        tokio::time::sleep(SERVICE).await;
    }
}

#[derive(Default)]
struct Tally {
    served: AtomicU64,
    shed: AtomicU64,
    critical: AtomicU64,
    critical_served: AtomicU64,
    latencies_us: Mutex<Vec<u64>>,
}

/// Offers `load` x capacity for `length`; the tally of what happened.
async fn offer(
    upstream: &Arc<Upstream>,
    limit: &Option<Concurrency>,
    start: Instant,
    load: f64,
    length: Duration,
) -> Arc<Tally> {
    let tally = Arc::new(Tally::default());
    let interval = Duration::from_secs_f64(1.0 / (CAPACITY * load));
    let began = Instant::now();
    let until = began + length;
    let mut tasks = tokio::task::JoinSet::new();
    let mut sent: u64 = 0;
    while began.elapsed() < length {
        // Catch up with the schedule (the timer ticks in milliseconds).
        let due = (began.elapsed().as_secs_f64() / interval.as_secs_f64()) as u64;
        while sent < due {
            sent += 1;
            let priority = if sent.is_multiple_of(10) {
                Priority::Critical
            } else {
                Priority::Sheddable
            };
            let (upstream, limit, tally) = (upstream.clone(), limit.clone(), tally.clone());
            tasks.spawn(async move {
                let critical = priority == Priority::Critical;
                tally
                    .critical
                    .fetch_add(u64::from(critical), Ordering::Relaxed);
                let arrived = Instant::now();
                let permit = match &limit {
                    Some(limit) => match limit.try_acquire(priority, arrived - start) {
                        Ok(permit) => Some(permit),
                        Err(_) => {
                            tally.shed.fetch_add(1, Ordering::Relaxed);
                            return;
                        }
                    },
                    None => None,
                };
                upstream.call().await;
                let done = Instant::now();
                if let Some(permit) = permit {
                    permit.finish(done - start, Outcome::Success);
                }
                // Goodput: what was served within the run (not the queue drained after it).
                if done > until {
                    return;
                }
                tally.served.fetch_add(1, Ordering::Relaxed);
                tally
                    .critical_served
                    .fetch_add(u64::from(critical), Ordering::Relaxed);
                let us = (done - arrived).as_micros() as u64;
                tally.latencies_us.lock().unwrap().push(us);
            });
        }
        tokio::time::sleep(Duration::from_millis(1)).await;
        while tasks.try_join_next().is_some() {}
    }
    while tasks.join_next().await.is_some() {}
    tally
}

fn percentile(sorted: &[u64], p: f64) -> f64 {
    if sorted.is_empty() {
        return 0.0;
    }
    let i = ((sorted.len() as f64 - 1.0) * p).round() as usize;
    sorted[i] as f64
}

#[tokio::main]
async fn main() {
    let seconds: u64 = std::env::var("SECONDS")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or(10);
    let length = Duration::from_secs(seconds);
    let mut csv = String::from(
        "mode,load,goodput_share,p50_x_service,p99_x_service,shed,critical_served_share,limit\n",
    );
    let modes = [Mode::None, Mode::Fixed, Mode::Aimd, Mode::Gradient];
    for load in LOADS {
        for mode in modes {
            let upstream = Arc::new(Upstream {
                workers: Semaphore::new(WORKERS),
            });
            let limit = mode.limit();
            let start = Instant::now();
            // Each run starts from a normal day, so the adaptive limits have learned.
            offer(&upstream, &limit, start, 0.5, Duration::from_secs(5)).await;
            let tally = offer(&upstream, &limit, start, load, length).await;
            let mut latencies = tally.latencies_us.lock().unwrap().clone();
            latencies.sort_unstable();
            let service_us = SERVICE.as_micros() as f64;
            let served = tally.served.load(Ordering::Relaxed) as f64;
            let critical = tally.critical.load(Ordering::Relaxed).max(1) as f64;
            let line = format!(
                "{},{load},{:.3},{:.2},{:.2},{},{:.4},{}",
                mode.name(),
                served / length.as_secs_f64() / CAPACITY,
                percentile(&latencies, 0.5) / service_us,
                percentile(&latencies, 0.99) / service_us,
                tally.shed.load(Ordering::Relaxed),
                tally.critical_served.load(Ordering::Relaxed) as f64 / critical,
                limit
                    .as_ref()
                    .map_or("".to_owned(), |l| l.snapshot().limit.to_string()),
            );
            println!("{line}");
            writeln!(csv, "{line}").unwrap();
        }
    }
    // Recovery: the limit at 0.5x, then 4x for `length`, then 0.5x until the limit is
    // within 10% of its first value (at most 60 s).
    for mode in [Mode::Aimd, Mode::Gradient] {
        let upstream = Arc::new(Upstream {
            workers: Semaphore::new(WORKERS),
        });
        let limit = mode.limit();
        let start = Instant::now();
        offer(&upstream, &limit, start, 0.5, Duration::from_secs(10)).await;
        let normal = limit.as_ref().unwrap().snapshot().limit;
        offer(&upstream, &limit, start, 4.0, length).await;
        let overloaded = limit.as_ref().unwrap().snapshot().limit;
        let ended = Instant::now();
        let mut back = None;
        while ended.elapsed() < Duration::from_secs(60) {
            offer(&upstream, &limit, start, 0.5, Duration::from_millis(500)).await;
            let now = limit.as_ref().unwrap().snapshot().limit;
            if (f64::from(now) - f64::from(normal)).abs() <= 0.1 * f64::from(normal) {
                back = Some(ended.elapsed());
                break;
            }
        }
        println!(
            "recovery,{}: limit {normal} at 0.5x, {overloaded} at 4x, back within 10% after {:?}",
            mode.name(),
            back
        );
    }
    std::fs::write("bench/results-overload.csv", csv).expect("write the CSV");
}
