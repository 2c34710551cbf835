//! A memory-bound decode loop whose weight set changes every step (RL policy refresh,
//! multi-model serving): the same captured graph of hundreds of nodes, five ways to point it at
//! the next set, side by side in one process, every output checked.
//!
//! The step: L pre-norm MLP layers (default 32 layers, hidden 2048, MLP 4×, bf16 weights,
//! 2 GiB per set; `--hidden 4096` gives 8 GiB), GEMMs by cuBLAS GemmEx (bf16 in, FP32
//! accumulate) and RMSNorm / bias + GELU / bias + residual kernels, batch 1 and 8, captured as
//! one `StableGraph` (about 5 nodes per layer). Hidden 2048 keeps each GEMM at 32 MiB, the size
//! of the 4096² linears of the PyTorch reference in `driver-costs.md`, and the set at 1–3 GiB
//! with 32 layers of MLP 4×, which hidden 4096 cannot (8 GiB). Four sets are resident.
//!
//! Variants (see `decode/loops.rs`): (a) stablebuf `Pipeline`, 2 and 3 lanes, rebinding group
//! "weights" every step; (b) copy-in, serial; (c) copy-in pipelined on a side stream into two
//! static sets; (d) re-capture + instantiate; (e) no swap: the same lanes (e2, e3) and one graph
//! on one stream (e1). The floor of (a) is the same lanes not rebinding.
//!
//! Measurement: variants run in interleaved chunks (`--rounds` rounds of `--chunk` steps, the
//! variant order rotating each round, after one warm-up chunk each). A CUDA event after each
//! step gives its end time; µs/step is the median, over 6-step windows, of the time per step
//! (windows rather than single steps because lanes on separate streams can finish in pairs);
//! "mean" is the chunk span over its steps. Checks: every step's output (copied to a history
//! slot on the step's stream) against the output of (e1)'s graph with the same set bound,
//! bit for bit where possible, else within 1/64 + 2% of RMS; any mismatch exits non-zero.
//!
//! Section 5 of issue 14 (bind cost and graph size): after the table, a bind into a lane space
//! is timed after replaying the decode graph, a 1-node graph touching 2 MiB, a 1-node graph
//! reading the whole set, a graph of as many nodes as the decode graph touching 2 MiB, and
//! nothing, GPU idle each time, with the driver calls split (fence, `cuMemUnmap`, `cuMemMap`,
//! `cuMemSetAccess`) through the library's tracing events. What grows, and by how much, is
//! printed; the (a) vs (e) rows above show whether the lanes hide it.
//!
//! ```text
//! cargo run --release --example decode_loop -- [--layers 32] [--hidden 2048] [--ratio 4]
//!     [--batches 1,8] [--sets 4] [--rounds 5] [--chunk 24] [--act gelu|silu]
//!     [--bind-samples 15] [--skip-bind-study]
//! ```
//! The default run takes about 10–20 s on an H100 and needs (sets + 3) × 2 GiB of free memory
//! (14 GiB).

#[path = "decode/mod.rs"]
mod decode;
mod support;

use std::process::ExitCode;
use std::sync::Arc;
use std::time::Instant;

use clap::Parser;
use decode::loops::{
    describe_nodes, make_sets, median, run_rounds, BatchResult, Checked, LaneSteps, Runner, Setup,
    Variant, INPUT_SEED, SKIP, WINDOW,
};
use decode::{fill_input, work, Act, Acts, Raw, Shape, Weights};
use stablebuf::device::memory_info;
use stablebuf::kernels::Blas;
use stablebuf::kernels::DecodeKernels;
use stablebuf::{FencePolicy, Result, Space, SpaceOptions, StableGraph};

/// A memory-bound decode loop with a new weight set every step: stablebuf rebinding vs copy-in
/// vs re-capture, checked and timed side by side.
#[derive(Parser, Debug)]
struct Args {
    /// Layers (each: RMSNorm, up GEMM, bias + activation, down GEMM, bias + residual).
    #[arg(long, default_value_t = 32)]
    layers: usize,
    /// Hidden size.
    #[arg(long, default_value_t = 2048)]
    hidden: usize,
    /// MLP inner size as a multiple of hidden.
    #[arg(long, default_value_t = 4)]
    ratio: usize,
    /// Batch sizes to run, comma-separated.
    #[arg(long, value_delimiter = ',', default_values_t = [1usize, 8])]
    batches: Vec<usize>,
    /// Resident weight sets (at least 2).
    #[arg(long, default_value_t = 4)]
    sets: usize,
    /// Timed rounds; each runs one chunk of every variant.
    #[arg(long, default_value_t = 5)]
    rounds: usize,
    /// Steps per chunk (rounded up to a multiple of 6, so 2 and 3 lanes stay aligned).
    #[arg(long, default_value_t = 24)]
    chunk: usize,
    #[arg(long, value_enum, default_value_t = Act::Gelu)]
    act: Act,
    /// Samples per case of the bind-cost study.
    #[arg(long, default_value_t = 15)]
    bind_samples: usize,
    /// Skip the bind-cost study.
    #[arg(long)]
    skip_bind_study: bool,
    #[command(flatten)]
    common: support::Common,
}

const GIB: f64 = (1u64 << 30) as f64;

fn main() -> ExitCode {
    let args = Args::parse();
    calls::install();
    let mut checks_passed = true;
    let code = support::run(&args.common, || {
        checks_passed = run(&args)?;
        Ok(())
    });
    if checks_passed {
        code
    } else {
        ExitCode::FAILURE
    }
}

fn run(args: &Args) -> Result<bool> {
    if args.sets < 2 || args.rounds == 0 || args.batches.is_empty() || args.batches.contains(&0) {
        return Err(stablebuf::Error::Layout(
            stablebuf::error::LayoutError::InvalidShape(
                "need --sets >= 2, --rounds >= 1 and batch sizes >= 1".into(),
            ),
        ));
    }
    let shape = Shape {
        layers: args.layers,
        hidden: args.hidden,
        ratio: args.ratio,
        max_batch: *args.batches.iter().max().expect("checked non-empty"),
        act: args.act.into(),
        ranks: 1,
        rank: 0,
    };
    let chunk = args.chunk.max(SKIP + WINDOW + 1).div_ceil(6) * 6;
    let ctx = args.common.open_device()?;
    let kernels = Arc::new(DecodeKernels::load(&ctx)?);
    let main_space = Space::new(&ctx, decode::layout(shape)?)?;
    let set_bytes = main_space.placement().groups[0].bytes;
    let (free, total) = memory_info(&ctx)?;
    let needed = (args.sets + 3) * set_bytes + (1 << 30);
    if needed > free {
        return Err(stablebuf::Error::Layout(
            stablebuf::error::LayoutError::InvalidShape(format!(
            "needs about {:.1} GiB free ({} sets + 3 static copies of {:.2} GiB), {:.1} GiB are; \
             lower --sets, --layers or --hidden",
            needed as f64 / GIB,
            args.sets,
            set_bytes as f64 / GIB,
            free as f64 / GIB
        )),
        ));
    }
    println!(
        "decode loop on {} ({:.0} GiB): {} layers, hidden {}, MLP {}x, {:?}, bf16 weights {:.2} GiB \
         per set ({:.2} GiB read per step), {} sets, batches {:?}",
        ctx.name()?,
        total as f64 / GIB,
        shape.layers,
        shape.hidden,
        shape.ratio,
        shape.act,
        set_bytes as f64 / GIB,
        shape.weight_bytes() as f64 / GIB,
        args.sets,
        args.batches
    );
    let started = Instant::now();
    let fill_stream = ctx.new_stream()?;
    let sets = make_sets(&main_space, &kernels, &fill_stream, shape, args.sets, 1)?;
    let setup = Setup::new(&ctx, &kernels, shape, main_space, &sets)?;
    let runner = Runner::new(&ctx, &kernels, shape, chunk)?;
    println!(
        "timing: {} rounds x {chunk} steps per variant after one warm-up chunk, variants \
         interleaved; µs/step = median of {WINDOW}-step windows of CUDA-event step ends",
        args.rounds
    );

    let mut results = Vec::new();
    for &batch in &args.batches {
        results.push(run_batch(&setup, &runner, batch, args.rounds, chunk)?);
    }
    print_table(&results, setup.set_bytes());
    let all_ok = results
        .iter()
        .all(|r| r.rows.iter().all(|row| row.failures().next().is_none()));
    print_targets(&results);

    if !args.skip_bind_study {
        bind_study(&setup, args.bind_samples, &results)?;
    }
    println!("\ntotal run time {:.1} s", started.elapsed().as_secs_f64());
    if all_ok {
        println!("every checked output matched the no-swap reference of its weight set");
    } else {
        println!("OUTPUT MISMATCHES:");
        for row in results.iter().flat_map(|r| &r.rows) {
            for failure in row.failures() {
                println!("  {failure}");
            }
        }
    }
    println!("{}", one_line_verdict(&results, setup.set_bytes(), all_ok));
    Ok(all_ok)
}

/// The run in one line, last, for a reader who reads nothing else: were the outputs right, and
/// what did a new weight set every step cost against not swapping and against copying it in.
/// Taken at the smallest batch (the most memory-bound step, where a copy hurts most).
fn one_line_verdict(results: &[BatchResult], set_bytes: usize, all_ok: bool) -> String {
    let Some(result) = results.iter().min_by_key(|r| r.batch) else {
        return "verdict: nothing ran".into();
    };
    let us = |label: &str| result.us(label);
    let best = if us("a3") < us("a2") { "a3" } else { "a2" };
    let floor = floor_of(best);
    let vs_floor = us(best) / us(&floor);
    let vs_copy = us("b").min(us("c")) / us(best);
    let outcome = if all_ok {
        "outputs correct"
    } else {
        "OUTPUT MISMATCHES (see above)"
    };
    format!(
        "verdict: {outcome}; a new {} weight set every step by rebinding ({best}) costs {vs_floor:.2}x \
         the no-swap floor ({floor}) and runs {vs_copy:.2}x faster than copying it in, \
         at batch {}",
        human(set_bytes),
        result.batch
    )
}

fn run_batch(
    setup: &Setup<'_>,
    runner: &Runner,
    batch: usize,
    rounds: usize,
    chunk: usize,
) -> Result<BatchResult> {
    let replay = setup.replay(batch)?;
    let nodes = describe_nodes(&replay.graph)?;
    let references = setup.references(&replay, batch)?;
    let lanes2 = setup.lanes(2, batch)?;
    let lanes3 = setup.lanes(3, batch)?;
    let mut variants: Vec<Box<dyn Variant + '_>> = vec![
        Box::new(replay),
        Box::new(LaneSteps::new(lanes2.clone(), false, setup.sets)),
        Box::new(LaneSteps::new(lanes2, true, setup.sets)),
        Box::new(LaneSteps::new(lanes3.clone(), false, setup.sets)),
        Box::new(LaneSteps::new(lanes3, true, setup.sets)),
        Box::new(setup.copy_serial(batch)?),
        Box::new(setup.copy_pipelined(batch)?),
        Box::new(setup.recapture(batch)?),
    ];
    let rows = run_rounds(
        &mut variants,
        runner,
        &[(&references, Checked::default())],
        batch,
        rounds,
        chunk,
    )?;
    Ok(BatchResult { batch, nodes, rows })
}

fn human(bytes: usize) -> String {
    if bytes == 0 {
        "0".into()
    } else {
        format!("{:.2} GiB", bytes as f64 / GIB)
    }
}

/// The floor each variant is held to: the same lanes without rebinding for (a), one graph on
/// one stream for everything else.
fn floor_of(label: &str) -> String {
    match label.strip_prefix('a') {
        Some(lanes) => format!("e{lanes}"),
        None => "e1".into(),
    }
}

fn print_table(results: &[BatchResult], set_bytes: usize) {
    println!();
    println!(
        "{:>5}  {:<40} {:>9} {:>9} {:>7} {:>6} {:>10} {:>11} {:>16} {:>10}",
        "batch",
        "variant",
        "µs/step",
        "mean",
        "×floor",
        "floor",
        "host µs",
        "copied",
        "checked (bit=)",
        "max|Δ|/rms"
    );
    for result in results {
        println!("  batch {}: graph of {}", result.batch, result.nodes);
        for row in &result.rows {
            let floor = floor_of(&row.label);
            println!(
                "{:>5}  {:<40} {:>9.1} {:>9.1} {:>6.3}x {:>6} {:>10.1} {:>11} {:>16} {:>10.1e}",
                result.batch,
                format!("({}) {}", row.label, row.describe),
                row.per_step(),
                row.mean(),
                row.per_step() / result.us(&floor),
                floor,
                median(&row.host_us),
                human(row.copied),
                format!("{} ({})", row.checked().steps, row.checked().bitwise),
                row.checked().worst
            );
            if row.adjusted > 0 {
                println!(
                    "       ({} steps of {} bound another set than planned: the lane held it)",
                    row.adjusted, row.label
                );
            }
        }
    }
    println!(
        "\"host µs\" is the median time of one step call on the host (for (a): wait for the \
         lane's previous step, then bind and enqueue). Bytes copied per step by (b) and (c): \
         {} (read + written: twice that in traffic); (a), (d), (e) copy nothing.",
        human(set_bytes)
    );
}

fn verdict(met: bool) -> &'static str {
    if met {
        "met"
    } else {
        "NOT met"
    }
}

fn print_targets(results: &[BatchResult]) {
    println!("\nratios (per-step medians of this run)");
    for result in results {
        let us = |label: &str| result.us(label);
        let (best, best_label) = if us("a3") <= us("a2") {
            (us("a3"), "a3")
        } else {
            (us("a2"), "a2")
        };
        let best_copy = us("b").min(us("c"));
        println!(
            "  batch {}: best stablebuf ({best_label}) {:.1} µs/step: {:.2}x faster than (b) \
             copy-in serial, {:.2}x than (c) copy-in pipelined, {:.2}x than (d) re-capture; \
             (b)/(e1) {:.2}x, (c)/(e1) {:.2}x (PyTorch 2.11 measured on an H100: 2.68x, 2.28x)",
            result.batch,
            best,
            us("b") / best,
            us("c") / best,
            us("d") / best,
            us("b") / us("e1"),
            us("c") / us("e1"),
        );
        for lanes in ["2", "3"] {
            let ratio = us(&format!("a{lanes}")) / us(&format!("e{lanes}"));
            println!(
                "    target (a{lanes}) within 1.05x of (e{lanes}), the same lanes not \
                 rebinding: {ratio:.3}x, {}; vs (e1), one stream: {:.3}x",
                verdict(ratio <= 1.05),
                us(&format!("a{lanes}")) / us("e1")
            );
        }
        if result.batch == 1 {
            let speedup = best_copy / best;
            println!(
                "    target (a) >= 2x faster than the better of (b) and (c) at batch 1: \
                 {speedup:.2}x, {}",
                verdict(speedup >= 2.0)
            );
        }
    }
}

/// Times of one bind, split by driver call (µs).
#[derive(Default, Clone)]
struct BindSample {
    total: f64,
    fence: f64,
    unmap: f64,
    map: f64,
    access: f64,
}

/// Section 5: what a bind costs after different work, GPU idle each time.
fn bind_study(setup: &Setup<'_>, samples: usize, results: &[BatchResult]) -> Result<()> {
    let (ctx, kernels, shape) = (&setup.ctx, &setup.kernels, setup.shape);
    let stream = ctx.new_stream()?;
    let options = SpaceOptions::default().fence(FencePolicy::AttachedStreams);
    let space = Space::with_options(ctx, setup.layout.clone(), options)?;
    space.attach(&stream);
    let (first, second) = (&setup.sets[0], &setup.sets[1]);
    space.bind(first)?;
    let acts = Acts::in_space(&space)?;
    fill_input(kernels, &stream, &acts, INPUT_SEED)?;
    let blas = Arc::new(Blas::new(&stream, &acts.workspace)?);
    let region = &space.placement().groups[0];
    let group = Raw {
        ptr: space.base() + region.offset as u64,
        bytes: region.bytes,
    };
    let small = group.part(0, space.placement().granularity.min(group.bytes));
    // The partial sums land in the cuBLAS workspace: the graphs replay one at a time on one
    // stream, and the decode graph's GEMMs do not need what is left there.
    let sink = acts.workspace;

    let mut step = work(
        blas,
        kernels.clone(),
        Weights::in_space(&space, shape)?,
        acts,
        shape,
        1,
        None,
    );
    step(&stream)?;
    stream.synchronize()?;
    let decode_graph = space.capture(&stream, step)?;
    let nodes = decode_graph.node_kinds()?.len();
    let capture = |touch: Raw, repeat: usize| -> Result<StableGraph> {
        let k = kernels.clone();
        space.capture(&stream, move |s| {
            for _ in 0..repeat {
                k.partial_sums(s, &touch, &sink)?;
            }
            Ok(())
        })
    };
    let one_small = capture(small, 1)?;
    let one_all = capture(group, 1)?;
    let many_small = capture(small, nodes)?;
    let cases: Vec<(String, Option<&StableGraph>)> = vec![
        ("nothing ran since the last bind".into(), None),
        ("1 node, reads 2 MiB".into(), Some(&one_small)),
        (
            format!("1 node, reads the whole {}", human(group.bytes)),
            Some(&one_all),
        ),
        (
            format!("{nodes} nodes, each reads 2 MiB"),
            Some(&many_small),
        ),
        (
            format!("decode step (batch 1): {nodes} nodes, reads all"),
            Some(&decode_graph),
        ),
    ];
    for (_, graph) in &cases {
        if let Some(graph) = graph {
            graph.replay()?;
        }
    }
    stream.synchronize()?;

    let mut measured: Vec<Vec<BindSample>> = vec![Vec::new(); cases.len()];
    for round in 0..samples.max(1) {
        for j in 0..cases.len() {
            let k = (j + round) % cases.len();
            if let Some(graph) = cases[k].1 {
                graph.replay()?;
            }
            stream.synchronize()?;
            let target = if space.bound_dataset("weights")? == Some(first.id()) {
                second
            } else {
                first
            };
            calls::start();
            let start = Instant::now();
            space.bind(target)?;
            let total = start.elapsed().as_secs_f64() * 1e6;
            let mut sample = BindSample {
                total,
                ..Default::default()
            };
            for (call, micros) in calls::stop() {
                match call.as_str() {
                    "cuStreamSynchronize" | "cuStreamIsCapturing" | "cuCtxSynchronize" => {
                        sample.fence += micros
                    }
                    "cuMemUnmap" => sample.unmap += micros,
                    "cuMemMap" => sample.map += micros,
                    "cuMemSetAccess" => sample.access += micros,
                    _ => {}
                }
            }
            measured[k].push(sample);
        }
    }

    let med = |samples: &[BindSample], f: fn(&BindSample) -> f64| {
        median(&samples.iter().map(f).collect::<Vec<_>>())
    };
    println!(
        "\nbind cost vs the work that ran before it (issue 14, section 5): one bind of group \
         \"weights\" ({}) into a lane-like space, GPU idle, {} samples per case, interleaved; \
         medians in µs",
        human(group.bytes),
        samples.max(1)
    );
    println!(
        "  {:<44} {:>8} {:>8} {:>10} {:>8} {:>14} {:>8}",
        "work replayed before the bind",
        "bind",
        "fence",
        "cuMemUnmap",
        "cuMemMap",
        "cuMemSetAccess",
        "rest"
    );
    let mut rows = Vec::new();
    for ((name, _), samples) in cases.iter().zip(&measured) {
        let row = [
            med(samples, |s| s.total),
            med(samples, |s| s.fence),
            med(samples, |s| s.unmap),
            med(samples, |s| s.map),
            med(samples, |s| s.access),
            med(samples, |s| s.total - s.fence - s.unmap - s.map - s.access),
        ];
        println!(
            "  {:<44} {:>8.1} {:>8.1} {:>10.1} {:>8.1} {:>14.1} {:>8.1}",
            name, row[0], row[1], row[2], row[3], row[4], row[5]
        );
        rows.push(row);
    }
    let (idle, decode_row) = (rows[0], rows[4]);
    let parts = ["fence", "cuMemUnmap", "cuMemMap", "cuMemSetAccess", "rest"];
    let (grew_most, growth) = parts
        .iter()
        .enumerate()
        .map(|(i, name)| (*name, decode_row[i + 1] - idle[i + 1]))
        .max_by(|a, b| a.1.total_cmp(&b.1))
        .expect("five parts");
    println!(
        "  after the decode graph a bind costs {:+.1} µs vs after nothing ({:+.1} µs vs 1 node on \
         2 MiB); the largest growth is in {grew_most} ({growth:+.1} µs). Node count alone: {:+.1} \
         µs ({nodes} nodes vs 1, same 2 MiB); bytes touched alone: {:+.1} µs (whole set vs \
         2 MiB, 1 node).",
        decode_row[0] - idle[0],
        decode_row[0] - rows[1][0],
        rows[3][0] - rows[1][0],
        rows[2][0] - rows[1][0],
    );
    for result in results {
        for lanes in ["2", "3"] {
            let (a, e) = (
                result.us(&format!("a{lanes}")),
                result.us(&format!("e{lanes}")),
            );
            let hidden = a - e < 0.25 * decode_row[0];
            println!(
                "  batch {}, {lanes} lanes: rebinding adds {:+.1} µs/step ({:+.1}%) against a bind \
                 of {:.1} µs: {}",
                result.batch,
                a - e,
                (a / e - 1.0) * 100.0,
                decode_row[0],
                if hidden {
                    "hidden by the pipeline (less than a quarter of the bind shows)"
                } else {
                    "NOT hidden: a visible part of the bind is on the critical path"
                }
            );
        }
    }
    Ok(())
}

/// Collects the `micros` of the library's per-driver-call tracing events while switched on.
mod calls {
    use std::sync::atomic::{AtomicBool, Ordering};
    use std::sync::Mutex;

    use tracing::field::{Field, Visit};
    use tracing::{Event, Subscriber};
    use tracing_subscriber::filter::dynamic_filter_fn;
    use tracing_subscriber::layer::{Context, Layer, SubscriberExt};
    use tracing_subscriber::util::SubscriberInitExt;

    static ON: AtomicBool = AtomicBool::new(false);
    static CALLS: Mutex<Vec<(String, f64)>> = Mutex::new(Vec::new());

    struct Collector;

    #[derive(Default)]
    struct Fields {
        call: Option<String>,
        micros: Option<f64>,
    }

    impl Visit for Fields {
        fn record_str(&mut self, field: &Field, value: &str) {
            if field.name() == "call" {
                self.call = Some(value.to_string());
            }
        }
        fn record_f64(&mut self, field: &Field, value: f64) {
            if field.name() == "micros" {
                self.micros = Some(value);
            }
        }
        fn record_debug(&mut self, _field: &Field, _value: &dyn std::fmt::Debug) {}
    }

    impl<S: Subscriber> Layer<S> for Collector {
        fn on_event(&self, event: &Event<'_>, _ctx: Context<'_, S>) {
            let mut fields = Fields::default();
            event.record(&mut fields);
            if let (Some(call), Some(micros)) = (fields.call, fields.micros) {
                CALLS
                    .lock()
                    .unwrap_or_else(|p| p.into_inner())
                    .push((call, micros));
            }
        }
    }

    /// Installs the collector (off) as the global subscriber, with the examples' logging
    /// (`RUST_LOG`) beside it.
    pub fn install() {
        let filter = dynamic_filter_fn(|meta, _| {
            ON.load(Ordering::Relaxed) && meta.target().starts_with("stablebuf")
        });
        let _ = tracing_subscriber::registry()
            .with(Collector.with_filter(filter))
            .with(super::support::log_layer())
            .try_init();
    }

    pub fn start() {
        CALLS.lock().unwrap_or_else(|p| p.into_inner()).clear();
        ON.store(true, Ordering::Relaxed);
    }

    /// Stops collecting and returns (call, µs) of every driver call since `start`.
    pub fn stop() -> Vec<(String, f64)> {
        ON.store(false, Ordering::Relaxed);
        std::mem::take(&mut *CALLS.lock().unwrap_or_else(|p| p.into_inner()))
    }
}
