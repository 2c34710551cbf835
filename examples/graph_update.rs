//! Capture a matmul graph over slots, replay it, rebind the inputs to a second dataset (same
//! addresses), prove with an update check that the executable is reusable, replay the same exec
//! and verify the new result. Prints capture + instantiate, update-check and replay times.
//! Exits non-zero on any mismatch.

#[path = "../tests/common/mod.rs"]
mod common;
mod support;

use std::sync::Arc;
use std::time::Instant;

use clap::Parser;
use common::{assert_matches, cpu_matmul, max_abs_error, random_vec, rng};
use stablebuf::kernels::{Kernels, MatmulKernel};
use stablebuf::{Layout, Space};

/// Capture a matmul graph once, rebind its inputs to a second dataset at the same addresses,
/// and replay the same exec on both; checked against the CPU.
#[derive(Parser)]
struct Args {
    /// Matrix size: the graph computes C = A·B with n×n matrices.
    #[arg(long, default_value_t = 1024, value_parser = support::at_least(1))]
    n: usize,
    #[command(flatten)]
    common: support::Common,
}

fn main() -> std::process::ExitCode {
    let args = Args::parse();
    support::run(&args.common, || run(&args))
}

fn run(args: &Args) -> stablebuf::Result<()> {
    let n = args.n;
    let ctx = args.common.open_device()?;
    let stream = ctx.new_stream()?;
    let kernels = Arc::new(Kernels::load(&ctx)?);
    let layout = Layout::builder()
        .group("inputs")
        .input("a", n * n * 4)
        .input("b", n * n * 4)
        .scratch("c", n * n * 4)
        .build()?;
    let space = Space::new(&ctx, layout)?;
    let mut rng = rng("graph_update");

    let mut datasets = Vec::new();
    let bar = support::progress(2, "inputs and CPU references");
    for _ in 0..2 {
        let (a, b) = (random_vec(&mut rng, n * n), random_vec(&mut rng, n * n));
        let dataset = space.new_dataset("inputs")?;
        dataset.write(&stream, "a", &a)?;
        dataset.write(&stream, "b", &b)?;
        datasets.push((dataset, cpu_matmul(&a, &b, n, n, n)));
        bar.inc(1);
    }
    bar.finish_and_clear();

    let (a, b, c) = (
        space.slot("a")?.clone(),
        space.slot("b")?.clone(),
        space.slot("c")?.clone(),
    );
    let k = kernels.clone();
    let mut graph = space.capture(&stream, move |s| {
        k.matmul(s, MatmulKernel::Auto, &a, &b, &c, n, n, n)
            .map(drop)
    })?;
    println!(
        "captured {n}x{n}x{n} matmul graph: capture {:.1} µs + instantiate {:.1} µs, nodes {:?}",
        graph.capture_time().as_secs_f64() * 1e6,
        graph.instantiate_time().as_secs_f64() * 1e6,
        graph.node_kinds()?
    );

    for (round, (dataset, want)) in datasets.iter().enumerate() {
        space.bind(dataset)?;
        if round > 0 {
            let report = graph.check_update()?;
            println!(
                "rebound inputs to dataset {}; update check: {:?} (re-capture {:.1} µs, cuGraphExecUpdate {:.1} µs)",
                dataset.id(),
                report.outcome,
                report.capture_time.as_secs_f64() * 1e6,
                report.update_time.as_secs_f64() * 1e6
            );
            if !report.is_success() {
                std::process::exit(1);
            }
        }
        space.write(&stream, "c", &vec![f32::NAN; n * n])?; // poison
        let start = Instant::now();
        graph.replay()?;
        stream.synchronize()?;
        let replay = start.elapsed();
        let got: Vec<f32> = space.read(&stream, "c")?;
        println!(
            "replay {} on dataset {}: {:.1} µs (launch + sync), max |error| vs CPU {:.2e}",
            round + 1,
            dataset.id(),
            replay.as_secs_f64() * 1e6,
            max_abs_error(&got, want)
        );
        assert_matches(&got, want, n, &format!("replay {}", round + 1));
    }
    println!("same exec replayed on both datasets: no re-capture, no re-instantiation");
    Ok(())
}
