//! What every example shares, so they all behave like the same tool: the common flags, logging,
//! progress bars, tables, percentiles and the way a failure ends the process.
//!
//! To adopt it in a new example (`examples/foo.rs`; `mod support;` finds this file):
//!
//! ```ignore
//! mod support;
//!
//! use clap::Parser;
//!
//! /// One line of what the example shows (clap prints it in `--help`).
//! #[derive(Parser)]
//! struct Args {
//!     /// Steps to run.
//!     #[arg(long, default_value_t = 100, value_parser = support::at_least(1))]
//!     steps: usize,
//!     #[command(flatten)]
//!     common: support::Common,
//! }
//!
//! fn main() -> std::process::ExitCode {
//!     let args = Args::parse(); // `--help` prints and exits 0; an unknown flag exits 2
//!     support::run(&args.common, || run(&args))
//! }
//!
//! fn run(args: &Args) -> stablebuf::Result<()> {
//!     let ctx = args.common.open_device()?; // not `stablebuf::open_device`: see below
//!     let stream = ctx.new_stream()?;
//!     let mut step_us = Vec::new();
//!     let bar = support::progress(args.steps as u64, "steps");
//!     for _ in 0..args.steps {
//!         let start = std::time::Instant::now();
//!         stream.synchronize()?; // the step being measured; print nothing while the bar is up
//!         step_us.push(start.elapsed().as_secs_f64() * 1e6);
//!         bar.inc(1);
//!     }
//!     bar.finish_and_clear();
//!     let mut table = support::table(["what", "p50 µs", "p99 µs"]);
//!     table.add_row([
//!         "step".to_string(),
//!         format!("{:.1}", support::percentile(&step_us, 0.5)),
//!         format!("{:.1}", support::percentile(&step_us, 0.99)),
//!     ]);
//!     println!("{table}");
//!     Ok(())
//! }
//! ```
//!
//! - Defaults must be what the example does with no arguments: `scripts/gpu-bundle` runs every
//!   example that way and it must finish in seconds.
//! - [`run`] installs logging (`RUST_LOG=stablebuf=debug` shows every driver call with its span;
//!   the default shows warnings only) and turns an `Err` into the error's message on stderr and
//!   exit code 1, with the "needs an NVIDIA GPU" hint when the device never opened.
//!   `tests/examples_cli.rs` holds every example to that on a machine without a GPU.
//! - Progress bars go to stderr and are hidden when stdout is not a terminal (logs stay clean)
//!   or with `--quiet`. Keep them out of timed sections, and print nothing while one is up
//!   (log lines are fine: they suspend the bars).
#![allow(dead_code)]

#[allow(dead_code)] // not every example profiles
pub mod calls;

use std::io::{self, IsTerminal, Write};
use std::process::ExitCode;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, OnceLock};

use comfy_table::{presets::ASCII_MARKDOWN, CellAlignment, Table};
use indicatif::{MultiProgress, ProgressBar, ProgressStyle};
use stablebuf::cudarc::driver::CudaContext;
use tracing_subscriber::filter::Targets;
use tracing_subscriber::layer::{Layer, SubscriberExt};
use tracing_subscriber::registry::LookupSpan;
use tracing_subscriber::util::SubscriberInitExt;

/// Printed under the error when an example fails before it could open a device.
pub const NEEDS_GPU: &str =
    "this example needs an NVIDIA GPU with a CUDA driver ≥ 12.4; see scripts/gpu-bundle";

/// The flags every example takes (`#[command(flatten)]` them into the example's own).
#[derive(clap::Args, Clone, Debug)]
pub struct Common {
    /// Show no progress bars (they are also hidden when stdout is not a terminal).
    #[arg(short, long)]
    pub quiet: bool,
    /// The CUDA device to run on, by ordinal.
    #[arg(long, default_value_t = 0, value_name = "ORDINAL")]
    pub device: usize,
    /// Accepted and ignored: harnesses that run every binary as a bench pass it.
    #[arg(long, hide = true)]
    pub bench: bool,
}

static DEVICE_OPENED: AtomicBool = AtomicBool::new(false);
static SHOW_PROGRESS: AtomicBool = AtomicBool::new(false);

impl Common {
    /// Opens the device asked for. Examples open their device through this, so that [`run`]
    /// knows whether a failure came before any device was usable (then it prints
    /// [`NEEDS_GPU`]).
    pub fn open_device(&self) -> stablebuf::Result<Arc<CudaContext>> {
        let ctx = stablebuf::open_device(self.device)?;
        DEVICE_OPENED.store(true, Ordering::Relaxed);
        Ok(ctx)
    }
}

/// Installs logging, runs the example's body and turns its outcome into the exit code: 0, or
/// the error's message (and its causes) on stderr and 1. No `Debug` dump: the message is what
/// a user can act on.
pub fn run(common: &Common, body: impl FnOnce() -> stablebuf::Result<()>) -> ExitCode {
    init_logging();
    SHOW_PROGRESS.store(
        !common.quiet && io::stdout().is_terminal(),
        Ordering::Relaxed,
    );
    match body() {
        Ok(()) => ExitCode::SUCCESS,
        Err(error) => {
            bars().suspend(|| {
                eprintln!("error: {error}");
                let mut source = std::error::Error::source(&error);
                while let Some(cause) = source {
                    eprintln!("  caused by: {cause}");
                    source = cause.source();
                }
                if !DEVICE_OPENED.load(Ordering::Relaxed) {
                    eprintln!("{NEEDS_GPU}");
                }
            });
            ExitCode::FAILURE
        }
    }
}

/// `RUST_LOG` filters (e.g. `stablebuf=debug` for every driver call, inside its span); without
/// it, warnings and errors only. Lines go to stderr, with the progress bars suspended. [`run`]
/// calls it; call it yourself only on a path that does not go through [`run`] (a child
/// process that reports its errors its own way). A second call does nothing.
pub fn init_logging() {
    let _ = tracing_subscriber::registry().with(log_layer()).try_init();
}

/// The logging [`init_logging`] installs, as a layer: an example that installs a subscriber of
/// its own (say, one that collects driver-call timings) adds this to it, so `RUST_LOG` keeps
/// working, and then [`run`]'s own install is a no-op.
pub fn log_layer<S>() -> Box<dyn Layer<S> + Send + Sync>
where
    S: tracing::Subscriber + for<'a> LookupSpan<'a>,
{
    // RUST_LOG as `target=level` directives ("warn", "stablebuf=debug,info"); unset or not
    // such a list: warnings only.
    let filter = std::env::var("RUST_LOG")
        .ok()
        .and_then(|value| value.parse::<Targets>().ok())
        .unwrap_or_else(|| Targets::new().with_default(tracing::Level::WARN));
    tracing_subscriber::fmt::layer()
        .with_writer(|| BarSafeStderr)
        .with_filter(filter)
        .boxed()
}

/// Every progress bar of the process hangs from this, so log lines and the error report can
/// suspend them all at once.
fn bars() -> &'static MultiProgress {
    static BARS: OnceLock<MultiProgress> = OnceLock::new();
    BARS.get_or_init(MultiProgress::new)
}

/// Stderr that clears the progress bars for the time of a write and redraws them after.
struct BarSafeStderr;

impl Write for BarSafeStderr {
    fn write(&mut self, buf: &[u8]) -> io::Result<usize> {
        bars().suspend(|| io::stderr().write(buf))
    }

    fn write_all(&mut self, buf: &[u8]) -> io::Result<()> {
        bars().suspend(|| io::stderr().write_all(buf))
    }

    fn flush(&mut self) -> io::Result<()> {
        io::stderr().flush()
    }
}

/// A progress bar of `len` steps labelled `what`, on stderr; hidden (every call a no-op) when
/// stdout is not a terminal or with `--quiet`. `finish_and_clear` it before printing again.
pub fn progress(len: u64, what: impl Into<String>) -> ProgressBar {
    if !SHOW_PROGRESS.load(Ordering::Relaxed) {
        return ProgressBar::hidden();
    }
    let style = ProgressStyle::with_template("{prefix:<40} [{bar:30}] {pos}/{len} {elapsed}")
        .expect("a valid template")
        .progress_chars("=> ");
    let bar = ProgressBar::new(len)
        .with_style(style)
        .with_prefix(what.into());
    bars().add(bar)
}

/// A table with `header`, drawn as Markdown (readable in a terminal, pasteable into notes),
/// every column but the first right-aligned for numbers. Print it with `println!("{table}")`.
pub fn table<const N: usize>(header: [&str; N]) -> Table {
    let mut table = Table::new();
    table.load_preset(ASCII_MARKDOWN).set_header(header);
    for column in table.column_iter_mut().skip(1) {
        column.set_cell_alignment(CellAlignment::Right);
    }
    table
}

/// The `p`-th quantile of `values` (`p` in 0..=1, e.g. 0.99), nearest rank: the value at
/// index round((len − 1) · p) of the sorted values. NaN for no values. The one percentile
/// every example reports.
pub fn percentile(values: &[f64], p: f64) -> f64 {
    if values.is_empty() {
        return f64::NAN;
    }
    let mut sorted = values.to_vec();
    sorted.sort_by(f64::total_cmp);
    sorted[((sorted.len() - 1) as f64 * p.clamp(0.0, 1.0)).round() as usize]
}

/// A clap value parser for a count of at least `min`: `value_parser = support::at_least(1)`
/// turns `--steps 0` into a usage error instead of a division by zero later.
pub fn at_least(min: usize) -> impl Fn(&str) -> Result<usize, String> + Clone {
    move |text: &str| match text.parse::<usize>() {
        Ok(value) if value >= min => Ok(value),
        Ok(value) => Err(format!("{value} is too small: at least {min}")),
        Err(error) => Err(format!("not a count: {error}")),
    }
}

/// A clap value parser for a fraction in `(0, 1]`.
pub fn fraction(text: &str) -> Result<f64, String> {
    match text.parse::<f64>() {
        Ok(value) if value > 0.0 && value <= 1.0 => Ok(value),
        Ok(value) => Err(format!("{value} is not in (0, 1]")),
        Err(error) => Err(format!("not a number: {error}")),
    }
}
