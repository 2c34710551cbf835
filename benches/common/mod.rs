//! Shared by the benches: a device (or a clean skip without one), criterion settings, paired
//! rounds of the compared variants, a recorder that prints medians and per-round ratios with
//! their spread, and a profile of the driver calls a piece of code makes.
//!
//! Why paired rounds: absolute times drift between samples (a slot-count row's floor once moved
//! from 37 to 77 µs between neighbouring rows of one run, swinging a ratio from 0.49× to 1.25×).
//! Every round runs each variant once, back to back, so a ratio taken within a round compares
//! variants under the same conditions; the median of those per-round ratios, with its p10–p90
//! spread, is what the tables print. The order rotates from round to round (A B C, B C A, C A B)
//! so no variant always runs right after the same other one.
#![allow(dead_code)]

// The driver-call profiler the examples use (examples/support/calls.rs), one copy for all.
#[path = "../../examples/support/calls.rs"]
mod calls;

use std::collections::BTreeMap;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use criterion::Criterion;
use stablebuf::cudarc::driver::{CudaContext, CudaStream};
use stablebuf::kernels::Kernels;
use stablebuf::{driver_present, open_device};

pub struct Gpu {
    pub ctx: Arc<CudaContext>,
    pub stream: Arc<CudaStream>,
    pub kernels: Arc<Kernels>,
}

/// The device, or `None` (with a message) where there is none, so `cargo bench` on a machine
/// without a GPU skips instead of failing.
pub fn gpu() -> Option<Gpu> {
    if !driver_present() {
        eprintln!("no CUDA driver: skipping GPU benches");
        return None;
    }
    let ctx = open_device(0).ok()?;
    let stream = ctx.new_stream().ok()?;
    let kernels = Arc::new(Kernels::load(&ctx).ok()?);
    Some(Gpu {
        ctx,
        stream,
        kernels,
    })
}

pub fn criterion() -> Criterion {
    Criterion::default()
        .sample_size(10)
        .warm_up_time(Duration::from_millis(300))
        .measurement_time(Duration::from_secs(1))
        .configure_from_args()
}

/// One round: each variant's seconds.
pub type Round = BTreeMap<String, f64>;

type Key = (String, String); // (group, row)

/// Paired rounds by group and row ([`Recorder::round`]), and loose samples by group, row and
/// variant ([`Recorder::record`], for measurements that are not compared round by round).
#[derive(Default)]
pub struct Recorder {
    rounds: Mutex<BTreeMap<Key, Vec<Round>>>,
    samples: Mutex<BTreeMap<(String, String, String), Vec<f64>>>,
}

impl Recorder {
    /// Stores one loose sample (seconds per iteration).
    pub fn record(&self, group: &str, row: &str, variant: &str, seconds_per_iter: f64) {
        self.samples
            .lock()
            .unwrap()
            .entry((group.into(), row.into(), variant.into()))
            .or_default()
            .push(seconds_per_iter);
    }

    /// Stores one round of `group`/`row`.
    pub fn round(&self, group: &str, row: &str, round: Round) {
        self.rounds
            .lock()
            .unwrap()
            .entry((group.to_string(), row.to_string()))
            .or_default()
            .push(round);
    }

    fn rounds(&self, group: &str, row: &str) -> Vec<Round> {
        self.rounds
            .lock()
            .unwrap()
            .get(&(group.to_string(), row.to_string()))
            .cloned()
            .unwrap_or_default()
    }

    /// Median seconds of `variant`: over its paired rounds, or its loose samples if it has
    /// no rounds.
    pub fn median(&self, group: &str, row: &str, variant: &str) -> Option<f64> {
        let mut values: Vec<f64> = self
            .rounds(group, row)
            .iter()
            .filter_map(|r| r.get(variant).copied())
            .collect();
        if values.is_empty() {
            values = self
                .samples
                .lock()
                .unwrap()
                .get(&(group.into(), row.into(), variant.into()))
                .cloned()
                .unwrap_or_default();
        }
        Spread::of(values).map(|s| s.median)
    }

    /// The spread of `ratio` taken round by round.
    pub fn ratio(&self, group: &str, row: &str, ratio: &Ratio) -> Option<Spread> {
        let values = self
            .rounds(group, row)
            .iter()
            .filter_map(|r| (ratio.per_round)(r))
            .collect();
        Spread::of(values)
    }

    /// Prints, for `group`, one line per row: each variant's median (in `unit`, scaled by
    /// `scale`), then `numerator / denominator` of the medians for each ratio asked for. For
    /// loose samples; variants run in paired rounds print with [`Recorder::paired_table`].
    pub fn table(
        &self,
        group: &str,
        variants: &[&str],
        rows: &[String],
        unit: &str,
        scale: f64,
        ratios: &[(&str, &str)],
    ) {
        println!("\n== {group} (medians, {unit}; ratios from the same run)");
        let mut header = format!("{:<14}", "");
        for v in variants {
            header += &format!(" {v:>16}");
        }
        for (n, d) in ratios {
            header += &format!(" {:>22}", format!("{n}/{d}"));
        }
        println!("{header}");
        for row in rows {
            let mut line = format!("{row:<14}");
            for v in variants {
                match self.median(group, row, v) {
                    Some(s) => line += &format!(" {:>16.2}", s * scale),
                    None => line += &format!(" {:>16}", "-"),
                }
            }
            for (n, d) in ratios {
                match (self.median(group, row, n), self.median(group, row, d)) {
                    (Some(a), Some(b)) => line += &format!(" {:>21.2}x", a / b),
                    _ => line += &format!(" {:>22}", "-"),
                }
            }
            println!("{line}");
        }
    }

    /// Prints, for `group`, one line per row: each variant's median (in `unit`, scaled by
    /// `scale`), then each ratio as `median [p10–p90]` of its per-round values.
    pub fn paired_table(
        &self,
        group: &str,
        variants: &[&str],
        rows: &[String],
        unit: &str,
        scale: f64,
        ratios: &[Ratio],
    ) {
        let rounds = rows
            .iter()
            .map(|r| self.rounds(group, r).len())
            .min()
            .unwrap_or(0);
        println!(
            "\n== {group} (medians in {unit} over >= {rounds} paired rounds; each ratio is the median of \
             per-round ratios [p10-p90])"
        );
        let mut header = format!("{:<14}", "");
        for v in variants {
            header += &format!(" {v:>16}");
        }
        for ratio in ratios {
            header += &format!(" {:>26}", ratio.label);
        }
        println!("{header}");
        for row in rows {
            let mut line = format!("{row:<14}");
            for v in variants {
                match self.median(group, row, v) {
                    Some(s) => line += &format!(" {:>16.2}", s * scale),
                    None => line += &format!(" {:>16}", "-"),
                }
            }
            for ratio in ratios {
                match self.ratio(group, row, ratio) {
                    Some(s) => line += &format!(" {:>26}", s.to_string()),
                    None => line += &format!(" {:>26}", "-"),
                }
            }
            println!("{line}");
        }
    }
}

/// Computes a ratio from one round.
pub type PerRound = Box<dyn Fn(&Round) -> Option<f64>>;

/// A ratio computed within each round.
pub struct Ratio {
    pub label: String,
    pub per_round: PerRound,
}

impl Ratio {
    /// `numerator`'s time over `denominator`'s, in the same round. Above 1: the denominator is
    /// faster by that factor.
    pub fn of(numerator: &str, denominator: &str) -> Self {
        let (n, d) = (numerator.to_string(), denominator.to_string());
        Self {
            label: format!("{numerator}/{denominator}"),
            per_round: Box::new(move |r| Some(r.get(&n)? / r.get(&d)?)),
        }
    }

    /// `variant`'s time over the faster of `others` in the same round.
    pub fn to_best(variant: &str, others: &[&str]) -> Self {
        let v = variant.to_string();
        let others: Vec<String> = others.iter().map(|s| s.to_string()).collect();
        Self {
            label: format!("{variant}/best of {}", others.join(",")),
            per_round: Box::new(move |r| {
                let best = others
                    .iter()
                    .filter_map(|o| r.get(o).copied())
                    .min_by(f64::total_cmp)?;
                Some(r.get(&v)? / best)
            }),
        }
    }
}

/// Median and p10–p90 of a sample.
#[derive(Clone, Copy, Debug)]
pub struct Spread {
    pub median: f64,
    pub p10: f64,
    pub p90: f64,
    pub count: usize,
}

impl Spread {
    pub fn of(mut values: Vec<f64>) -> Option<Self> {
        values.retain(|v| v.is_finite());
        if values.is_empty() {
            return None;
        }
        values.sort_by(f64::total_cmp);
        let at = |q: f64| values[((values.len() - 1) as f64 * q).round() as usize];
        let n = values.len();
        let median = if n % 2 == 1 {
            values[n / 2]
        } else {
            (values[n / 2 - 1] + values[n / 2]) / 2.0
        };
        Some(Self {
            median,
            p10: at(0.1),
            p90: at(0.9),
            count: n,
        })
    }
}

impl std::fmt::Display for Spread {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{:.2}x [{:.2}-{:.2}]", self.median, self.p10, self.p90)
    }
}

/// What one run of a variant measured: seconds per group (most variants time one thing).
pub type Timed = Vec<(&'static str, f64)>;

/// One variant: its name and what runs it.
type Variant<'a> = (&'static str, Box<dyn FnMut() -> Timed + 'a>);

/// The variants compared in one row, run in paired rounds.
pub struct Variants<'a> {
    group: &'static str,
    list: Vec<Variant<'a>>,
    rounds: usize,
}

impl<'a> Variants<'a> {
    /// Variants whose times go to `group` (unless they say otherwise).
    pub fn new(group: &'static str) -> Self {
        Self {
            group,
            list: Vec::new(),
            rounds: 0,
        }
    }

    /// A variant that returns the seconds of its timed part.
    pub fn add(mut self, name: &'static str, mut run: impl FnMut() -> f64 + 'a) -> Self {
        let group = self.group;
        self.list
            .push((name, Box::new(move || vec![(group, run())])));
        self
    }

    /// A variant that times several things, each in its own group.
    pub fn add_timed(mut self, name: &'static str, run: impl FnMut() -> Timed + 'a) -> Self {
        self.list.push((name, Box::new(run)));
        self
    }

    /// Runs every variant once, starting one further along the list each round, records the
    /// round under `row`, and returns the seconds the timed parts took together.
    pub fn round(&mut self, rec: &Recorder, row: &str) -> Duration {
        let n = self.list.len();
        let first = self.rounds % n.max(1);
        self.rounds += 1;
        let mut by_group: BTreeMap<&'static str, Round> = BTreeMap::new();
        let mut total = 0.0;
        for i in 0..n {
            let (name, run) = &mut self.list[(first + i) % n];
            for (group, seconds) in run() {
                by_group
                    .entry(group)
                    .or_default()
                    .insert(name.to_string(), seconds);
                total += seconds;
            }
        }
        for (group, round) in by_group {
            rec.round(group, row, round);
        }
        Duration::from_secs_f64(total)
    }

    /// One untimed round first (first touches, lazy driver state), then criterion's iterations,
    /// each a paired round.
    pub fn bench(
        &mut self,
        c: &mut criterion::BenchmarkGroup<'_, criterion::measurement::WallTime>,
        rec: &Recorder,
        row: &str,
    ) {
        for (_, run) in &mut self.list {
            run();
        }
        c.bench_function(row, |b| {
            b.iter_custom(|iters| (0..iters).map(|_| self.round(rec, row)).sum())
        });
    }
}

/// Seconds `f` takes.
pub fn seconds(f: impl FnOnce()) -> f64 {
    let start = Instant::now();
    f();
    start.elapsed().as_secs_f64()
}

/// "met" or "NOT met", for the target lines the benches print.
pub fn verdict(met: bool) -> &'static str {
    if met {
        "met"
    } else {
        "NOT met"
    }
}

pub fn human_bytes(bytes: usize) -> String {
    if bytes >= 1 << 30 {
        format!("{}GiB", bytes >> 30)
    } else if bytes >= 1 << 20 {
        format!("{}MiB", bytes >> 20)
    } else {
        format!("{}KiB", bytes >> 10)
    }
}

/// Driver calls made while `f` ran on this thread: `(call, count, total µs)` (the examples'
/// profiler). Collecting them costs a little per call, so profile in a separate pass, never
/// inside timed rounds.
#[allow(unused_imports)] // not every bench profiles
pub use calls::profile;

/// Prints a profile as `call ×count total µs` pieces on one line.
pub fn print_profile(label: &str, calls: &[(String, u64, f64)]) {
    let parts: Vec<String> = calls
        .iter()
        .map(|(call, count, micros)| format!("{call} x{count} {micros:.0} us"))
        .collect();
    println!("  {label}: {}", parts.join(", "));
}

/// The total µs and count of one call in a profile.
pub fn call_micros(calls: &[(String, u64, f64)], call: &str) -> (u64, f64) {
    calls
        .iter()
        .find(|(c, _, _)| c == call)
        .map_or((0, 0.0), |&(_, n, us)| (n, us))
}
