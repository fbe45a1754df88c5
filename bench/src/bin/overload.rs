//! The overload benchmark (issue 27): a simulated upstream of fixed capacity behind no
//! limit, a fixed in-flight limit, tollgate's adaptive limits and two adaptive tower
//! crates, offered 0.5x to 4x its capacity, in one run.
//!
//! The upstream is a tower `Service` of `WORKERS` workers and a service time of `SERVICE`:
//! a request waits for a free worker (FIFO, unbounded queue), so beyond capacity latency
//! grows with load. Every mode is a tower layer around that same service (tollgate's:
//! `RateLimitLayer::with_adaptive`, as users add it, the priority in the request's
//! extensions). Load is open loop: requests arrive at a fixed rate whatever the answers, every 10th critical, the
//! others sheddable. Times are real (tokio's timer), since what is measured is sleeping,
//! not CPU; so the run first measures the unloaded latency (one request at a time) on the
//! machine as it is, and the goals are read against it.
//!
//! ```text
//! cargo run --release -p tollgate-bench --bin overload                 # ~10 min
//! SECONDS=3 MODES=aimd,gradient LOADS=0.5,4 CHART=0 cargo run ...     # a quick look
//! ```
//!
//! Writes `bench/results-overload.csv` (one line per mode and load: goodput as a share of
//! the nominal capacity and of the effective one, `WORKERS` / the unloaded p50, since the
//! timer's lateness makes each request hold its worker longer than `SERVICE`; the admitted
//! requests' p50 and p99 in ms and as a multiple of the unloaded p50, shed requests,
//! critical requests served (not shed), the limit at the end),
//! `bench/results-overload-timeline.csv` (every 100 ms of one 0.5x -> 4x -> 0.5x scenario
//! per adaptive mode: limit, in flight, p99 of the requests that ended in those 100 ms)
//! and `bench/chart-overload.svg`, and prints the recovery time per mode: how long after
//! the overload ends the limit is back within 10% of its normal-day value (and stays so
//! for a second). `OUT` prefixes the three paths (default `bench/`).

use std::{
    fmt::Write as _,
    future::Future,
    pin::Pin,
    sync::{
        Arc, Mutex,
        atomic::{AtomicU32, AtomicU64, AtomicUsize, Ordering},
    },
    task::{Context, Poll},
    time::{Duration, Instant},
};

use axum::body::{Body, HttpBody as _};
use http::{Request, Response, StatusCode};
use plotters::prelude::*;
use tokio::sync::Semaphore;
use tollgate::{
    DefaultRejection, Limit, RateLimitLayer,
    adaptive::{Adaptive, AdaptiveHandle, AdaptiveLimit, Aimd, Gradient, Priority},
    headers::HeaderStyle,
    key::GlobalKey,
};
use tower::{BoxError, Layer, Service, ServiceBuilder, ServiceExt, util::BoxCloneService};

const WORKERS: usize = 20;
const SERVICE: Duration = Duration::from_millis(20);
/// Requests a second the upstream serves at most.
const CAPACITY: f64 = WORKERS as f64 / 0.020;
const SAMPLE: Duration = Duration::from_millis(100);

type BoxFuture = Pin<Box<dyn Future<Output = Result<(), BoxError>> + Send>>;
/// A mode: a layer around the upstream, as one service type.
type Mode = BoxCloneService<Priority, (), BoxError>;
/// The current limit of a mode, if it has one to show.
type Probe = Arc<dyn Fn() -> Option<u32> + Send + Sync>;

/// The simulated upstream: `WORKERS` workers, each request holds one for `SERVICE`.
#[derive(Clone)]
struct Upstream {
    workers: Arc<Semaphore>,
    in_flight: Arc<AtomicU32>,
}

impl Upstream {
    fn new() -> Self {
        Self {
            workers: Arc::new(Semaphore::new(WORKERS)),
            in_flight: Arc::new(AtomicU32::new(0)),
        }
    }
}

impl Service<Priority> for Upstream {
    type Response = ();
    type Error = BoxError;
    type Future = BoxFuture;

    fn poll_ready(&mut self, _: &mut Context<'_>) -> Poll<Result<(), BoxError>> {
        Poll::Ready(Ok(()))
    }

    fn call(&mut self, _: Priority) -> BoxFuture {
        let this = self.clone();
        Box::pin(async move {
            this.in_flight.fetch_add(1, Ordering::Relaxed);
            {
                let _worker = this.workers.acquire().await?;
                tokio::time::sleep(SERVICE).await;
            }
            this.in_flight.fetch_sub(1, Ordering::Relaxed);
            Ok(())
        })
    }
}

/// The benchmark's request type around tollgate's layer around `S`.
type Tollgate<S> = FromHttp<tollgate::RateLimit<ToHttp<S>, GlobalKey, u32, DefaultRejection>>;

/// tollgate's adaptive limit as users add it: `RateLimitLayer::with_adaptive` (one global
/// rate limit too high to deny, the memory store, no header fields) around `S`, between
/// two adapters from and to the benchmark's `Priority` requests (the priority rides in the
/// HTTP request's extensions, which the stage reads). A 503 is a shed request.
fn tollgate_layer<S>(limit: AdaptiveLimit) -> (impl Layer<S, Service = Tollgate<S>>, AdaptiveHandle)
where
    S: Service<Priority, Response = (), Error = BoxError, Future = BoxFuture>
        + Clone
        + Send
        + 'static,
{
    let layer = RateLimitLayer::new(Limit::per_second(u32::MAX).expect("valid limit"))
        .with_key(GlobalKey)
        .with_headers(HeaderStyle::NONE)
        .with_adaptive(Adaptive::new(limit));
    let handle = layer.adaptive_handle().expect("an adaptive stage");
    let layer = tower::layer::layer_fn(move |inner| FromHttp {
        inner: layer.layer(ToHttp { inner }),
    });
    (layer, handle)
}

/// `Priority` requests to HTTP ones, for the layer.
#[derive(Clone)]
struct FromHttp<S> {
    inner: S,
}

impl<S> Service<Priority> for FromHttp<S>
where
    S: Service<
            Request<()>,
            Response = Response<tollgate::count_after::RateLimitBody<Body>>,
            Error = BoxError,
        >,
    S::Future: Send + 'static,
{
    type Response = ();
    type Error = BoxError;
    type Future = BoxFuture;

    fn poll_ready(&mut self, cx: &mut Context<'_>) -> Poll<Result<(), BoxError>> {
        self.inner.poll_ready(cx)
    }

    fn call(&mut self, priority: Priority) -> BoxFuture {
        let mut request = Request::new(());
        request.extensions_mut().insert(priority);
        let call = self.inner.call(request);
        Box::pin(async move {
            let response = call.await?;
            // A server asks an empty body whether it is over and drops it unread: its
            // end, which gives the permit back with its sample.
            let _ = response.body().is_end_stream();
            if response.status() == StatusCode::SERVICE_UNAVAILABLE {
                return Err("shed".into());
            }
            Ok(())
        })
    }
}

/// HTTP requests back to `Priority` ones, for the upstream.
#[derive(Clone)]
struct ToHttp<S> {
    inner: S,
}

impl<S> Service<Request<()>> for ToHttp<S>
where
    S: Service<Priority, Response = (), Error = BoxError, Future = BoxFuture>,
{
    type Response = Response<Body>;
    type Error = BoxError;
    type Future = Pin<Box<dyn Future<Output = Result<Response<Body>, BoxError>> + Send>>;

    fn poll_ready(&mut self, cx: &mut Context<'_>) -> Poll<Result<(), BoxError>> {
        self.inner.poll_ready(cx)
    }

    fn call(&mut self, request: Request<()>) -> Self::Future {
        let priority = request
            .extensions()
            .get::<Priority>()
            .copied()
            .unwrap_or_default();
        let call = self.inner.call(priority);
        Box::pin(async move {
            call.await?;
            Ok(Response::new(Body::empty()))
        })
    }
}

/// tower-acc's algorithm, with its current limit readable.
#[derive(Clone)]
struct Recorded<A> {
    inner: A,
    limit: Arc<AtomicUsize>,
}

impl<A: tower_acc::Algorithm> tower_acc::Algorithm for Recorded<A> {
    fn max_concurrency(&self) -> usize {
        self.inner.max_concurrency()
    }

    fn update(&mut self, rtt: Duration, in_flight: usize, is_error: bool, is_canceled: bool) {
        self.inner.update(rtt, in_flight, is_error, is_canceled);
        self.limit
            .store(self.inner.max_concurrency(), Ordering::Relaxed);
    }
}

/// tower-resilience-adaptive's algorithm behind an `Arc`, with its limit readable.
struct Shared(Arc<tower_resilience_adaptive::Gradient2>);

impl tower_resilience_adaptive::ConcurrencyAlgorithm for Shared {
    fn record_success(&self, latency: Duration) {
        self.0.record_success(latency);
    }
    fn record_success_with_load(&self, latency: Duration, in_flight: usize) {
        self.0.record_success_with_load(latency, in_flight);
    }
    fn record_failure(&self) {
        self.0.record_failure();
    }
    fn record_dropped(&self) {
        self.0.record_dropped();
    }
    fn limit(&self) -> usize {
        self.0.limit()
    }
    fn min_limit(&self) -> usize {
        self.0.min_limit()
    }
    fn max_limit(&self) -> usize {
        self.0.max_limit()
    }
}

const MODES: [&str; 6] = [
    "none",
    "fixed",
    "aimd",
    "gradient",
    "tower-acc",
    "resilience",
];
/// The modes that adapt: the chart and the recovery time.
const ADAPTIVE: [&str; 4] = ["aimd", "gradient", "tower-acc", "resilience"];

/// Mode `name` around `upstream`, and its probe.
fn mode(name: &str, upstream: Upstream) -> (Mode, Probe) {
    let tollgate = |limit: Result<AdaptiveLimit, tollgate::ConfigError>| {
        let (layer, handle) = tollgate_layer(limit.expect("valid settings"));
        let service = layer.layer(upstream.clone());
        let probe: Probe = Arc::new(move || Some(handle.snapshot().limit));
        (BoxCloneService::new(service), probe)
    };
    match name {
        "none" => (BoxCloneService::new(upstream), Arc::new(|| None)),
        // A fixed in-flight limit tuned for the normal day: the workers plus half again.
        "fixed" => {
            let fixed = (WORKERS * 3 / 2) as u32;
            tollgate(AdaptiveLimit::new(Aimd::new()).with_bounds(fixed, fixed, fixed))
        }
        // AIMD backs off on latency: a request over 1.5x the service time (the latency
        // objective) counts as dropped while the traffic presses against the limit.
        "aimd" => tollgate(
            AdaptiveLimit::new(Aimd::new().with_slow(Some(SERVICE * 3 / 2)))
                .with_bounds(1, 20, 1000),
        ),
        "gradient" => tollgate(AdaptiveLimit::new(Gradient::new()).with_bounds(1, 20, 1000)),
        // tower-acc's default (Vegas: initial 20, max 1000); its limit answers with
        // `Pending`, so `LoadShed` turns that into an error, as a server would shed.
        "tower-acc" => {
            let limit = Arc::new(AtomicUsize::new(20));
            let algorithm = Recorded {
                inner: tower_acc::Vegas::default(),
                limit: limit.clone(),
            };
            let service = ServiceBuilder::new()
                .load_shed()
                .layer(tower_acc::ConcurrencyLimitLayer::new(algorithm))
                .service(upstream);
            let probe: Probe = Arc::new(move || Some(limit.load(Ordering::Relaxed) as u32));
            (BoxCloneService::new(service), probe)
        }
        // tower-resilience-adaptive's Gradient2, its defaults but the bounds ours (1, 20,
        // 1000; its default maximum is 100); `LoadShed` as above.
        "resilience" => {
            let algorithm = Arc::new(
                tower_resilience_adaptive::Gradient2::builder()
                    .initial_limit(20)
                    .min_limit(1)
                    .max_limit(1000)
                    .build()
                    .expect("valid settings"),
            );
            let probe = algorithm.clone();
            let service = ServiceBuilder::new()
                .load_shed()
                .layer(tower_resilience_adaptive::AdaptiveLimiterLayer::new(
                    Shared(algorithm),
                ))
                .map_err(BoxError::from)
                .service(upstream);
            let probe: Probe = Arc::new(move || {
                use tower_resilience_adaptive::ConcurrencyAlgorithm as _;
                Some(probe.limit() as u32)
            });
            (BoxCloneService::new(service), probe)
        }
        other => panic!("no mode {other}"),
    }
}

#[derive(Default)]
struct Tally {
    served: AtomicU64,
    shed: AtomicU64,
    critical: AtomicU64,
    critical_served: AtomicU64,
    /// Latencies of the admitted requests, in microseconds.
    latencies_us: Mutex<Vec<u64>>,
    /// The same, since the sampler last took them.
    recent_us: Mutex<Vec<u64>>,
}

/// Offers `load` x capacity to `service` for `length`; the tally of what happened.
async fn offer(service: &Mode, load: f64, length: Duration) -> Arc<Tally> {
    let tally = Arc::new(Tally::default());
    offer_into(service, load, length, &tally).await;
    tally
}

async fn offer_into(service: &Mode, load: f64, length: Duration, tally: &Arc<Tally>) {
    let interval = 1.0 / (CAPACITY * load);
    let began = Instant::now();
    let until = began + length;
    let mut tasks = tokio::task::JoinSet::new();
    let mut sent: u64 = 0;
    while began.elapsed() < length {
        // Catch up with the schedule (the timer ticks in milliseconds).
        let due = (began.elapsed().as_secs_f64() / interval) as u64;
        while sent < due {
            sent += 1;
            let priority = if sent.is_multiple_of(10) {
                Priority::Critical
            } else {
                Priority::Sheddable
            };
            let (service, tally) = (service.clone(), tally.clone());
            tasks.spawn(async move {
                let critical = priority == Priority::Critical;
                tally
                    .critical
                    .fetch_add(u64::from(critical), Ordering::Relaxed);
                let arrived = Instant::now();
                let answer = match service.oneshot(priority).await {
                    Ok(()) => Instant::now(),
                    Err(_) => {
                        tally.shed.fetch_add(1, Ordering::Relaxed);
                        return;
                    }
                };
                // Served, not shed (the upstream never fails), even if after the run.
                tally
                    .critical_served
                    .fetch_add(u64::from(critical), Ordering::Relaxed);
                // Goodput: what was served within the run (not the queue drained after it).
                if answer > until {
                    return;
                }
                tally.served.fetch_add(1, Ordering::Relaxed);
                let us = (answer - arrived).as_micros() as u64;
                tally.latencies_us.lock().unwrap().push(us);
                tally.recent_us.lock().unwrap().push(us);
            });
        }
        tokio::time::sleep(Duration::from_millis(1)).await;
        while tasks.try_join_next().is_some() {}
    }
    while tasks.join_next().await.is_some() {}
}

fn percentile(sorted: &[u64], p: f64) -> f64 {
    if sorted.is_empty() {
        return f64::NAN;
    }
    let i = ((sorted.len() as f64 - 1.0) * p).round() as usize;
    sorted[i] as f64
}

/// The latency of one request at a time for `length`: (p50, p99) in microseconds.
async fn unloaded(length: Duration) -> (f64, f64) {
    let service: Mode = BoxCloneService::new(Upstream::new());
    let began = Instant::now();
    let mut latencies = Vec::new();
    while began.elapsed() < length {
        let at = Instant::now();
        service.clone().oneshot(Priority::Default).await.unwrap();
        latencies.push(at.elapsed().as_micros() as u64);
    }
    latencies.sort_unstable();
    (percentile(&latencies, 0.5), percentile(&latencies, 0.99))
}

fn env_list(name: &str, default: &[&str]) -> Vec<String> {
    std::env::var(name).map_or_else(
        |_| default.iter().map(|s| (*s).to_owned()).collect(),
        |v| v.split(',').map(str::to_owned).collect(),
    )
}

/// One 100 ms sample of the timeline.
#[derive(Clone, Copy)]
struct Sample {
    at: f64,
    limit: Option<u32>,
    in_flight: u32,
    p99_ms: f64,
}

/// The phases of the timeline scenario: (load, seconds).
const TIMELINE: [(f64, u64); 3] = [(0.5, 10), (4.0, 10), (0.5, 30)];

/// Runs the timeline scenario for mode `name`, sampling every 100 ms.
async fn timeline(name: &str) -> Vec<Sample> {
    let upstream = Upstream::new();
    let start = Instant::now();
    let (service, probe) = mode(name, upstream.clone());
    let tally = Arc::new(Tally::default());
    let samples = Arc::new(Mutex::new(Vec::new()));
    let sampler = {
        let (tally, samples) = (tally.clone(), samples.clone());
        tokio::spawn(async move {
            let mut tick = tokio::time::interval(SAMPLE);
            loop {
                tick.tick().await;
                let mut recent = std::mem::take(&mut *tally.recent_us.lock().unwrap());
                recent.sort_unstable();
                samples.lock().unwrap().push(Sample {
                    at: start.elapsed().as_secs_f64(),
                    limit: probe(),
                    in_flight: upstream.in_flight.load(Ordering::Relaxed),
                    p99_ms: percentile(&recent, 0.99) / 1000.0,
                });
            }
        })
    };
    for (load, seconds) in TIMELINE {
        offer_into(&service, load, Duration::from_secs(seconds), &tally).await;
    }
    sampler.abort();
    samples.lock().unwrap().clone()
}

/// The normal-day limit (the median over the last 5 s of the first 0.5x phase) and how
/// long after the overload the limit is back within 10% of it and stays so for 1 s.
fn recovery(samples: &[Sample]) -> Option<(f64, Option<f64>)> {
    let (normal_end, overload_end) = (TIMELINE[0].1 as f64, (TIMELINE[0].1 + TIMELINE[1].1) as f64);
    let mut normal: Vec<u32> = samples
        .iter()
        .filter(|s| s.at > normal_end - 5.0 && s.at <= normal_end)
        .map(|s| s.limit)
        .collect::<Option<_>>()?;
    normal.sort_unstable();
    let normal = f64::from(*normal.get(normal.len() / 2)?);
    let after: Vec<&Sample> = samples.iter().filter(|s| s.at > overload_end).collect();
    let within = |s: &Sample| (f64::from(s.limit.unwrap_or(0)) - normal).abs() <= 0.1 * normal;
    let steady = (1.0 / SAMPLE.as_secs_f64()) as usize;
    let back = (0..after.len())
        .find(|&i| after[i..].len() >= steady && after[i..i + steady].iter().all(|s| within(s)));
    Some((normal, back.map(|i| after[i].at - overload_end)))
}

fn chart(
    path: &str,
    timelines: &[(String, Vec<Sample>)],
    unloaded_ms: f64,
) -> Result<(), BoxError> {
    let root = SVGBackend::new(path, (1200, 300 * timelines.len() as u32)).into_drawing_area();
    root.fill(&WHITE)?;
    let rows = root.split_evenly((timelines.len(), 2));
    let end = TIMELINE.iter().map(|(_, s)| *s as f64).sum::<f64>();
    for (i, (name, samples)) in timelines.iter().enumerate() {
        let most = samples
            .iter()
            .map(|s| f64::from(s.limit.unwrap_or(0).max(s.in_flight)))
            .fold(10.0, f64::max);
        let mut chart = ChartBuilder::on(&rows[2 * i])
            .caption(
                format!("{name}: limit and in flight (0.5x, 4x from 10 s, 0.5x from 20 s)"),
                ("sans-serif", 16),
            )
            .margin(10)
            .x_label_area_size(30)
            .y_label_area_size(50)
            .build_cartesian_2d(0.0..end, 0.0..most * 1.15)?;
        chart
            .configure_mesh()
            .x_desc("s")
            .y_desc("requests")
            .light_line_style(WHITE)
            .draw()?;
        chart
            .draw_series(LineSeries::new(
                samples
                    .iter()
                    .filter_map(|s| Some((s.at, f64::from(s.limit?)))),
                BLUE.stroke_width(2),
            ))?
            .label("limit")
            .legend(|(x, y)| PathElement::new([(x, y), (x + 16, y)], BLUE.stroke_width(2)));
        chart
            .draw_series(LineSeries::new(
                samples.iter().map(|s| (s.at, f64::from(s.in_flight))),
                RED.mix(0.8),
            ))?
            .label("in flight")
            .legend(|(x, y)| PathElement::new([(x, y), (x + 16, y)], RED.mix(0.8)));
        chart
            .draw_series(LineSeries::new(
                [(0.0, WORKERS as f64), (end, WORKERS as f64)],
                BLACK.mix(0.4),
            ))?
            .label("workers")
            .legend(|(x, y)| PathElement::new([(x, y), (x + 16, y)], BLACK.mix(0.4)));
        chart
            .configure_series_labels()
            .position(SeriesLabelPosition::UpperRight)
            .background_style(WHITE.mix(0.9))
            .border_style(BLACK.mix(0.3))
            .draw()?;

        let top = samples
            .iter()
            .map(|s| s.p99_ms)
            .filter(|v| v.is_finite())
            .fold(3.0 * unloaded_ms, f64::max)
            .min(10.0 * unloaded_ms);
        let mut chart = ChartBuilder::on(&rows[2 * i + 1])
            .caption(
                format!("{name}: p99 of the requests ended in each 100 ms (ms)"),
                ("sans-serif", 16),
            )
            .margin(10)
            .x_label_area_size(30)
            .y_label_area_size(50)
            .build_cartesian_2d(0.0..end, 0.0..top * 1.05)?;
        chart
            .configure_mesh()
            .x_desc("s")
            .y_desc("ms")
            .light_line_style(WHITE)
            .draw()?;
        chart
            .draw_series(LineSeries::new(
                samples
                    .iter()
                    .filter(|s| s.p99_ms.is_finite())
                    .map(|s| (s.at, s.p99_ms.min(top))),
                GREEN.mix(0.9).stroke_width(2),
            ))?
            .label("p99")
            .legend(|(x, y)| PathElement::new([(x, y), (x + 16, y)], GREEN.stroke_width(2)));
        let goal = 2.0 * unloaded_ms;
        chart
            .draw_series(LineSeries::new([(0.0, goal), (end, goal)], BLACK.mix(0.4)))?
            .label("2x unloaded p50")
            .legend(|(x, y)| PathElement::new([(x, y), (x + 16, y)], BLACK.mix(0.4)));
        chart
            .configure_series_labels()
            .position(SeriesLabelPosition::UpperRight)
            .background_style(WHITE.mix(0.9))
            .border_style(BLACK.mix(0.3))
            .draw()?;
    }
    root.present()?;
    Ok(())
}

#[tokio::main]
async fn main() -> Result<(), BoxError> {
    let seconds: u64 = std::env::var("SECONDS")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or(10);
    let out = std::env::var("OUT").unwrap_or_else(|_| "bench/".to_owned());
    let length = Duration::from_secs(seconds);
    let modes = env_list("MODES", &MODES);
    let loads: Vec<f64> = env_list("LOADS", &["0.5", "1", "2", "4"])
        .iter()
        .map(|l| l.parse().expect("a load"))
        .collect();

    let (p50_us, p99_us) = unloaded(Duration::from_secs(3)).await;
    let unloaded_ms = p50_us / 1000.0;
    // What the workers serve at most on this machine now: a request holds one for the
    // unloaded latency (the timer's lateness included), not just `SERVICE`.
    let effective = WORKERS as f64 / (p50_us / 1e6);
    println!(
        "unloaded: p50 {:.2} ms, p99 {:.2} ms (service time {} ms)",
        unloaded_ms,
        p99_us / 1000.0,
        SERVICE.as_millis()
    );
    let mut csv = String::from(
        "mode,load,goodput_share,goodput_x_effective,p50_ms,p99_ms,p99_x_unloaded,shed,critical_served_share,limit,unloaded_p50_ms\n",
    );
    for &load in &loads {
        for name in &modes {
            let upstream = Upstream::new();
            let (service, probe) = mode(name, upstream);
            // Each run starts from a normal day, so the adaptive limits have learned.
            offer(&service, 0.5, Duration::from_secs(5)).await;
            let tally = offer(&service, load, length).await;
            let mut latencies = tally.latencies_us.lock().unwrap().clone();
            latencies.sort_unstable();
            let served = tally.served.load(Ordering::Relaxed) as f64;
            let critical = tally.critical.load(Ordering::Relaxed).max(1) as f64;
            let p99 = percentile(&latencies, 0.99) / 1000.0;
            let line = format!(
                "{name},{load},{:.3},{:.3},{:.2},{:.2},{:.2},{},{:.4},{},{unloaded_ms:.2}",
                served / length.as_secs_f64() / CAPACITY,
                served / length.as_secs_f64() / effective,
                percentile(&latencies, 0.5) / 1000.0,
                p99,
                p99 / unloaded_ms,
                tally.shed.load(Ordering::Relaxed),
                tally.critical_served.load(Ordering::Relaxed) as f64 / critical,
                probe().map_or(String::new(), |l| l.to_string()),
            );
            println!("{line}");
            writeln!(csv, "{line}")?;
        }
    }
    std::fs::write(format!("{out}results-overload.csv"), csv)?;

    if std::env::var("CHART").is_ok_and(|c| c == "0") {
        return Ok(());
    }
    let mut timelines = Vec::new();
    let mut csv = String::from("mode,t_s,limit,in_flight,p99_ms\n");
    for name in ADAPTIVE.iter().filter(|m| modes.iter().any(|n| n == *m)) {
        let samples = timeline(name).await;
        for s in &samples {
            writeln!(
                csv,
                "{name},{:.2},{},{},{:.2}",
                s.at,
                s.limit.map_or(String::new(), |l| l.to_string()),
                s.in_flight,
                s.p99_ms
            )?;
        }
        match recovery(&samples) {
            Some((normal, back)) => println!(
                "recovery,{name}: normal-day limit {normal}, back within 10% after {}",
                back.map_or("more than 30 s".to_owned(), |s| format!("{s:.1} s"))
            ),
            None => println!("recovery,{name}: no limit to show"),
        }
        timelines.push(((*name).to_owned(), samples));
    }
    std::fs::write(format!("{out}results-overload-timeline.csv"), csv)?;
    chart(&format!("{out}chart-overload.svg"), &timelines, unloaded_ms)?;
    Ok(())
}
