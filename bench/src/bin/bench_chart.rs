//! Summarises the raw results of `bench/load.sh`: prints the table (medians over rounds,
//! ratios to `plain` from the same round and scenario) and the issue's targets, and draws
//! the chart.
//!
//! ```text
//! cargo run --release -p tollgate-bench --bin bench_chart -- [bench/results.csv] [bench/chart.svg]
//! ```
//!
//! The CSV has a header line and the columns `round,scenario,mode,rps,p50_us,p99_us,
//! requests,non2xx,socket_errors,status_200,status_429,status_other,server_cpu_us,
//! redis_cpu_us,redis_calls_per_req,valid` (CPU microseconds per request in the server and
//! in Redis, and Redis calls per request: script calls and PINGs); rows whose `valid` is
//! not `1` (the scenario did not do what it says) are left out of the medians.

use std::{collections::BTreeMap, error::Error, fmt::Write as _, process::ExitCode};

use plotters::prelude::*;

type Result<T> = std::result::Result<T, Box<dyn Error>>;

/// One measured run.
#[derive(Debug, Clone)]
struct Run {
    round: u32,
    scenario: String,
    mode: String,
    rps: f64,
    p50_us: f64,
    p99_us: f64,
    server_cpu_us: f64,
    redis_cpu_us: f64,
    redis_calls: f64,
    valid: bool,
}

/// The medians of one mode in one scenario.
#[derive(Debug, Clone)]
struct Row {
    scenario: String,
    mode: String,
    rps: f64,
    p50_us: f64,
    p99_us: f64,
    /// Throughput / plain's in the same round and scenario.
    ratio: Option<f64>,
    ratio_min: Option<f64>,
    ratio_max: Option<f64>,
    /// p99 / plain's p99 in the same round and scenario.
    p99_ratio: Option<f64>,
    /// CPU time per request, in microseconds.
    server_cpu_us: f64,
    redis_cpu_us: f64,
    /// Redis calls (script calls and PINGs) per request.
    redis_calls: f64,
    valid_rounds: usize,
    rounds: usize,
}

const SCENARIOS: [&str; 4] = ["allow", "reject", "clients", "zipf"];

fn main() -> ExitCode {
    let mut args = std::env::args().skip(1);
    let csv = args
        .next()
        .unwrap_or_else(|| "bench/results.csv".to_owned());
    let svg = args.next().unwrap_or_else(|| "bench/chart.svg".to_owned());
    match run(&csv, &svg) {
        Ok(()) => ExitCode::SUCCESS,
        Err(error) => {
            eprintln!("bench_chart: {error}");
            ExitCode::FAILURE
        }
    }
}

fn run(csv: &str, svg: &str) -> Result<()> {
    let text = std::fs::read_to_string(csv).map_err(|e| format!("read {csv}: {e}"))?;
    let runs = parse(&text)?;
    let rows = summarise(&runs);
    if rows.is_empty() {
        return Err(format!("{csv} has no results").into());
    }
    print!("{}", table(&rows));
    println!();
    print!("{}", targets(&rows));
    chart(&rows, svg)?;
    println!("\nchart: {svg}");
    Ok(())
}

fn parse(text: &str) -> Result<Vec<Run>> {
    let mut lines = text.lines().filter(|l| !l.trim().is_empty());
    let header: Vec<&str> = lines.next().ok_or("empty CSV")?.split(',').collect();
    let column = |name: &str| {
        header
            .iter()
            .position(|h| h.trim() == name)
            .ok_or_else(|| format!("the CSV has no column {name:?}"))
    };
    let [
        round,
        scenario,
        mode,
        rps,
        p50,
        p99,
        server_cpu,
        redis_cpu,
        redis_calls,
        valid,
    ] = [
        "round",
        "scenario",
        "mode",
        "rps",
        "p50_us",
        "p99_us",
        "server_cpu_us",
        "redis_cpu_us",
        "redis_calls_per_req",
        "valid",
    ]
    .map(column);
    let (round, scenario, mode, rps, p50, p99, valid) =
        (round?, scenario?, mode?, rps?, p50?, p99?, valid?);
    // The CPU columns came later: without them, CPU shows as unknown.
    let (server_cpu, redis_cpu, redis_calls) = (server_cpu.ok(), redis_cpu.ok(), redis_calls.ok());
    lines
        .enumerate()
        .map(|(n, line)| {
            let fields: Vec<&str> = line.split(',').map(str::trim).collect();
            let field = |i: usize| {
                fields
                    .get(i)
                    .copied()
                    .ok_or_else(|| format!("line {}: too few fields", n + 2))
            };
            let number = |i: usize| -> Result<f64> {
                let f = field(i)?;
                f.parse()
                    .map_err(|_| format!("line {}: {f:?} is not a number", n + 2).into())
            };
            Ok(Run {
                round: field(round)?.parse()?,
                scenario: field(scenario)?.to_owned(),
                mode: field(mode)?.to_owned(),
                rps: number(rps)?,
                p50_us: number(p50)?,
                p99_us: number(p99)?,
                server_cpu_us: server_cpu.map_or(Ok(f64::NAN), number)?,
                redis_cpu_us: redis_cpu.map_or(Ok(f64::NAN), number)?,
                redis_calls: redis_calls.map_or(Ok(f64::NAN), number)?,
                valid: field(valid)? == "1",
            })
        })
        .collect()
}

fn median(mut values: Vec<f64>) -> Option<f64> {
    if values.is_empty() {
        return None;
    }
    values.sort_by(f64::total_cmp);
    let mid = values.len() / 2;
    Some(if values.len() % 2 == 1 {
        values[mid]
    } else {
        (values[mid - 1] + values[mid]) / 2.0
    })
}

/// Medians per scenario and mode, modes in the order they were first run.
fn summarise(runs: &[Run]) -> Vec<Row> {
    let mut modes: Vec<&str> = Vec::new();
    for run in runs {
        if !modes.contains(&run.mode.as_str()) {
            modes.push(&run.mode);
        }
    }
    let plain: BTreeMap<(u32, &str), &Run> = runs
        .iter()
        .filter(|r| r.mode == "plain" && r.valid)
        .map(|r| ((r.round, r.scenario.as_str()), r))
        .collect();
    let mut rows = Vec::new();
    for scenario in SCENARIOS {
        for mode in &modes {
            let all: Vec<&Run> = runs
                .iter()
                .filter(|r| r.scenario == scenario && r.mode == *mode)
                .collect();
            if all.is_empty() {
                continue;
            }
            let valid: Vec<&Run> = all.iter().copied().filter(|r| r.valid).collect();
            // Each run's `f` over plain's from the same round and scenario.
            let relative = |f: fn(&Run) -> f64| -> Vec<f64> {
                valid
                    .iter()
                    .filter_map(|r| {
                        let base = f(plain.get(&(r.round, scenario))?);
                        (base > 0.0).then(|| f(r) / base)
                    })
                    .collect()
            };
            let ratios = relative(|r| r.rps);
            let p99_ratios = relative(|r| r.p99_us);
            let stat = |f: fn(&Run) -> f64| median(valid.iter().map(|r| f(r)).collect());
            rows.push(Row {
                scenario: scenario.to_owned(),
                mode: (*mode).to_owned(),
                rps: stat(|r| r.rps).unwrap_or(f64::NAN),
                p50_us: stat(|r| r.p50_us).unwrap_or(f64::NAN),
                p99_us: stat(|r| r.p99_us).unwrap_or(f64::NAN),
                ratio: median(ratios.clone()),
                ratio_min: ratios.iter().copied().reduce(f64::min),
                ratio_max: ratios.iter().copied().reduce(f64::max),
                p99_ratio: median(p99_ratios),
                server_cpu_us: stat(|r| r.server_cpu_us).unwrap_or(f64::NAN),
                redis_cpu_us: stat(|r| r.redis_cpu_us).unwrap_or(f64::NAN),
                redis_calls: stat(|r| r.redis_calls).unwrap_or(f64::NAN),
                valid_rounds: valid.len(),
                rounds: all.len(),
            });
        }
    }
    rows
}

fn ms(us: f64) -> String {
    if us.is_nan() {
        "-".to_owned()
    } else {
        format!("{:.2} ms", us / 1000.0)
    }
}

fn cpu(row: &Row) -> String {
    match (row.server_cpu_us, row.redis_cpu_us) {
        (s, _) if s.is_nan() => "-".to_owned(),
        (s, r) if r.is_nan() || r == 0.0 => format!("{s:.1}"),
        (s, r) => format!("{s:.1} + {r:.1}"),
    }
}

fn calls(per_request: f64) -> String {
    if per_request.is_nan() || per_request == 0.0 {
        "-".to_owned()
    } else {
        format!("{per_request:.3}")
    }
}

fn times(x: Option<f64>) -> String {
    x.map_or_else(|| "-".to_owned(), |x| format!("{x:.2}x"))
}

/// The summary as a Markdown table.
fn table(rows: &[Row]) -> String {
    let mut out = String::from(
        "| scenario | mode | req/s | p50 | p99 | x plain (min-max) | p99 x plain \
         | CPU µs/req server + Redis | Redis calls/req | rounds |\n\
         |---|---|---:|---:|---:|---:|---:|---:|---:|---:|\n",
    );
    for row in rows {
        let range = match (row.ratio_min, row.ratio_max) {
            (Some(lo), Some(hi)) => format!(" ({lo:.2}-{hi:.2})"),
            _ => String::new(),
        };
        let rps = if row.rps.is_nan() {
            "-".to_owned()
        } else {
            format!("{:.0}", row.rps)
        };
        let _ = writeln!(
            out,
            "| {} | {} | {} | {} | {} | {}{} | {} | {} | {} | {}/{} |",
            row.scenario,
            row.mode,
            rps,
            ms(row.p50_us),
            ms(row.p99_us),
            times(row.ratio),
            range,
            times(row.p99_ratio),
            cpu(row),
            calls(row.redis_calls),
            row.valid_rounds,
            row.rounds,
        );
    }
    out
}

/// The targets of the performance issue, each checked against the medians.
fn targets(rows: &[Row]) -> String {
    let find = |scenario: &str, mode: &str| {
        rows.iter()
            .find(|r| r.scenario == scenario && r.mode == mode)
    };
    let mut out = String::from("| target | measured | |\n|---|---:|---|\n");
    let mut check = |what: &str, value: Option<f64>, ok: &dyn Fn(f64) -> bool| {
        let verdict = match value {
            Some(v) if ok(v) => "met",
            Some(_) => "**missed**",
            None => "not measured",
        };
        let _ = writeln!(out, "| {what} | {} | {verdict} |", times(value));
    };
    let ratio = |s: &str, m: &str| find(s, m).and_then(|r| r.ratio);
    let p99 = |s: &str, m: &str| find(s, m).and_then(|r| r.p99_ratio);
    check(
        "MemoryStore, nothing rejected: >= 0.97x plain",
        ratio("allow", "memory"),
        &|v| v >= 0.97,
    );
    check(
        "MemoryStore, everything rejected: >= 0.95x plain",
        ratio("reject", "memory"),
        &|v| v >= 0.95,
    );
    check(
        "RedisStore, nothing rejected: >= 0.80x plain",
        ratio("allow", "redis"),
        &|v| v >= 0.80,
    );
    check(
        "RedisStore, one-key flood: >= 0.90x plain",
        ratio("reject", "redis"),
        &|v| v >= 0.90,
    );
    // Leased quota (issue 14).
    check(
        "redis-lease, nothing rejected: >= 0.90x plain",
        ratio("allow", "redis-lease"),
        &|v| v >= 0.90,
    );
    let cpu_total = |s: &str, m: &str| {
        let row = find(s, m)?;
        let redis = if row.redis_cpu_us.is_nan() {
            0.0
        } else {
            row.redis_cpu_us
        };
        (!row.server_cpu_us.is_nan()).then_some(row.server_cpu_us + redis)
    };
    check(
        "redis-lease, nothing rejected: CPU/req <= 1.15x memory's",
        cpu_total("allow", "redis-lease")
            .zip(cpu_total("allow", "memory"))
            .map(|(l, m)| l / m),
        &|v| v <= 1.15,
    );
    for (versus, margin) in [("redis", 1.1), ("handwritten", 1.1)] {
        check(
            &format!("redis-lease, zipf: ahead of {versus} (>= {margin:.2}x its ratio)"),
            ratio("zipf", "redis-lease")
                .zip(ratio("zipf", versus))
                .map(|(l, v)| l / v),
            &|v| v >= margin,
        );
    }
    check(
        "redis-lease, clients: no worse than redis (>= 0.95x its ratio)",
        ratio("clients", "redis-lease")
            .zip(ratio("clients", "redis"))
            .map(|(l, r)| l / r),
        &|v| v >= 0.95,
    );
    for scenario in ["allow", "reject"] {
        for mode in ["memory", "redis"] {
            check(
                &format!("p99 {mode} ({scenario}): <= 1.5x plain's p99"),
                p99(scenario, mode),
                &|v| v <= 1.5,
            );
        }
    }
    out
}

fn color(scenario: &str) -> RGBColor {
    match scenario {
        "allow" => RGBColor(54, 110, 180),
        "reject" => RGBColor(230, 126, 34),
        "clients" => RGBColor(76, 154, 90),
        _ => RGBColor(142, 68, 173),
    }
}

/// What a panel shows of a row (`None`: nothing to show).
type Measure<'a> = &'a dyn Fn(&Row) -> Option<f64>;

/// One panel of bars: one per scenario for each mode.
struct Panel<'a> {
    caption: &'a str,
    y_desc: &'a str,
    /// The bar's height.
    value: Measure<'a>,
    /// A part of the bar drawn darker from the bottom (the Redis share of the CPU).
    part: Option<(&'a str, Measure<'a>)>,
    label: &'a dyn Fn(f64) -> String,
    /// A horizontal line (1.0 = plain).
    reference: Option<f64>,
}

/// Three panels: throughput relative to plain, p99 latency, and CPU time per request.
fn chart(rows: &[Row], path: &str) -> Result<()> {
    let mut modes: Vec<&str> = Vec::new();
    for row in rows {
        if !modes.contains(&row.mode.as_str()) {
            modes.push(&row.mode);
        }
    }
    let root = SVGBackend::new(path, (1100, 1200)).into_drawing_area();
    root.fill(&WHITE)?;
    let areas = root.split_evenly((3, 1));

    let ratio = |row: &Row| row.ratio;
    draw_panel(
        &areas[0],
        &modes,
        rows,
        &Panel {
            caption: "Throughput relative to plain axum in the same round (median; 1.0 = plain)",
            y_desc: "x plain",
            value: &ratio,
            part: None,
            label: &|v| format!("{v:.2}"),
            reference: Some(1.0),
        },
    )?;
    let p99 = |row: &Row| (!row.p99_us.is_nan()).then_some(row.p99_us / 1000.0);
    draw_panel(
        &areas[1],
        &modes,
        rows,
        &Panel {
            caption: "p99 latency at 64 connections (ms, median over rounds)",
            y_desc: "p99 (ms)",
            value: &p99,
            part: None,
            label: &|v| format!("{v:.1}"),
            reference: None,
        },
    )?;
    let known = |v: f64| (!v.is_nan()).then_some(v);
    let total =
        |row: &Row| known(row.server_cpu_us).map(|s| s + known(row.redis_cpu_us).unwrap_or(0.0));
    let redis = |row: &Row| known(row.redis_cpu_us).filter(|&r| r > 0.0);
    draw_panel(
        &areas[2],
        &modes,
        rows,
        &Panel {
            caption: "CPU time per request (µs, server + Redis; darker: Redis)",
            y_desc: "CPU µs / request",
            value: &total,
            part: Some(("Redis share", &redis)),
            label: &|v| format!("{v:.0}"),
            reference: None,
        },
    )?;
    root.present()?;
    Ok(())
}

/// x units per mode in a panel, and a bar's width and margin in them.
const SLOT: u32 = 20;
const BAR_WIDTH: u32 = 4;
const BAR_GAP: u32 = 2;

fn draw_panel<DB: DrawingBackend>(
    area: &DrawingArea<DB, plotters::coord::Shift>,
    modes: &[&str],
    rows: &[Row],
    panel: &Panel<'_>,
) -> Result<()>
where
    DB::ErrorType: 'static,
{
    let y_max = rows
        .iter()
        .filter_map(panel.value)
        .chain(panel.reference)
        .fold(0.1, f64::max)
        // Headroom for the value labels and the legend.
        * 1.3;
    // Integer x coordinates (the float ones have no default tick formatting): each mode
    // gets SLOT units, its label at the centre, one bar per scenario side by side.
    let slots = modes.len() as u32;
    let n = slots * SLOT;
    let centres: Vec<u32> = (0..slots).map(|i| i * SLOT + SLOT / 2).collect();
    let mut chart = ChartBuilder::on(area)
        .caption(panel.caption, ("sans-serif", 20))
        .margin(12)
        .x_label_area_size(34)
        .y_label_area_size(60)
        .build_cartesian_2d((0..n).with_key_points(centres), 0.0..y_max)?;
    chart
        .configure_mesh()
        .disable_x_mesh()
        .y_labels(8)
        .light_line_style(WHITE)
        .x_label_formatter(&|x| {
            let i = (*x / SLOT) as usize;
            modes.get(i).map_or_else(String::new, |m| (*m).to_owned())
        })
        .x_label_style(("sans-serif", 14))
        .y_desc(panel.y_desc)
        .y_label_formatter(&|y| format!("{y:.1}"))
        .draw()?;
    if let Some(y) = panel.reference {
        chart.draw_series(LineSeries::new(
            [(0, y), (n, y)],
            BLACK.mix(0.6).stroke_width(1),
        ))?;
    }
    for (s, scenario) in SCENARIOS.iter().enumerate() {
        let bars: Vec<(u32, &Row)> = modes
            .iter()
            .enumerate()
            .filter_map(|(i, mode)| {
                let row = rows
                    .iter()
                    .find(|r| r.scenario == *scenario && r.mode == *mode)?;
                Some((i as u32 * SLOT + BAR_GAP + s as u32 * BAR_WIDTH, row))
            })
            .collect();
        let values: Vec<(u32, f64)> = bars
            .iter()
            .filter_map(|&(x, row)| Some((x, (panel.value)(row)?)))
            .collect();
        let fill = color(scenario);
        chart
            .draw_series(
                values.iter().map(|&(x, v)| {
                    Rectangle::new([(x, 0.0), (x + BAR_WIDTH - 1, v)], fill.filled())
                }),
            )?
            .label(*scenario)
            .legend(move |(x, y)| Rectangle::new([(x, y - 6), (x + 14, y + 6)], fill.filled()));
        if let Some((_, part)) = panel.part {
            let dark = RGBColor(fill.0 / 2, fill.1 / 2, fill.2 / 2);
            chart.draw_series(bars.iter().filter_map(|&(x, row)| {
                let v = part(row)?;
                Some(Rectangle::new(
                    [(x, 0.0), (x + BAR_WIDTH - 1, v)],
                    dark.filled(),
                ))
            }))?;
        }
        chart.draw_series(values.iter().map(|&(x, v)| {
            Text::new(
                (panel.label)(v),
                (x, v + y_max * 0.035),
                ("sans-serif", 12).into_font().color(&BLACK),
            )
        }))?;
    }
    if let Some((name, _)) = panel.part {
        // A legend entry only: an empty series.
        chart
            .draw_series(std::iter::empty::<Rectangle<(u32, f64)>>())?
            .label(name)
            .legend(|(x, y)| {
                Rectangle::new([(x, y - 6), (x + 14, y + 6)], BLACK.mix(0.6).filled())
            });
    }
    chart
        .configure_series_labels()
        .position(SeriesLabelPosition::UpperRight)
        .background_style(WHITE.mix(0.9))
        .border_style(BLACK.mix(0.3))
        .label_font(("sans-serif", 14))
        .draw()?;
    Ok(())
}
