//! Sleep and wake under a live graph: the inference loop's MLP (3 × 4096, batch 256, FP32,
//! cuBLAS) is captured once and run; then the space sleeps (weights and batch offloaded to a
//! pinned arena, scratch released) and device free memory is printed before and after. A replay
//! while asleep gives a typed error (and the context survives). After wake, the same exec replays
//! and its output must equal the pre-sleep output bit for bit. Exits non-zero on any mismatch.

#[path = "../tests/common/mod.rs"]
mod common;
#[path = "mlp/mod.rs"]
mod mlp;
mod support;

use std::sync::Arc;
use std::time::Instant;

use clap::Parser;
use common::{assert_matches, random_vec, rng};
use mlp::{cpu_forward, layout, space_work, HostWeights, Shape};
use stablebuf::device::memory_info;
use stablebuf::host::TransferReport;
use stablebuf::kernels::Kernels;
use stablebuf::{HostArena, HostStorage, Result, Space};

/// Sleep and wake a space under a live MLP graph: weights and batch offloaded to a pinned host
/// arena, scratch released, a replay while asleep refused, and the same exec after wake giving
/// the pre-sleep output bit for bit.
#[derive(Parser)]
struct Args {
    /// MLP layers.
    #[arg(long, default_value_t = 3, value_parser = support::at_least(1))]
    layers: usize,
    /// Hidden size (the width of every layer).
    #[arg(long, default_value_t = 4096, value_parser = support::at_least(1))]
    hidden: usize,
    /// Rows of the input batch.
    #[arg(long, default_value_t = 256, value_parser = support::at_least(1))]
    batch: usize,
    #[command(flatten)]
    common: support::Common,
}

fn main() -> std::process::ExitCode {
    let args = Args::parse();
    support::run(&args.common, || run(&args))
}

fn run(args: &Args) -> Result<()> {
    let shape = Shape {
        layers: args.layers,
        hidden: args.hidden,
        batch: args.batch,
        ptx: false,
    };
    let (h, b) = (shape.hidden, shape.batch);
    let ctx = args.common.open_device()?;
    let stream = ctx.new_stream()?;
    let kernels = Arc::new(Kernels::load(&ctx)?);
    let space = Space::new(&ctx, layout(shape)?)?;
    let mut rng = rng("sleep_wake");

    let mut weights = space.new_dataset("weights")?;
    let scale = 1.7 / (h as f32).sqrt();
    let host: HostWeights = (0..shape.layers)
        .map(|_| {
            (
                random_vec(&mut rng, h * h)
                    .iter()
                    .map(|v| v * scale)
                    .collect(),
                random_vec(&mut rng, h).iter().map(|v| v * 0.1).collect(),
            )
        })
        .collect();
    for (l, (w, bias)) in host.iter().enumerate() {
        weights.write(&stream, &format!("w{l}"), w)?;
        weights.write(&stream, &format!("b{l}"), bias)?;
    }
    let x = random_vec(&mut rng, b * h);
    let mut batch = space.new_dataset("batch")?;
    batch.write(&stream, "x", &x)?;
    space.bind(&weights)?;
    space.bind(&batch)?;

    let mut work = space_work(&space, &stream, &kernels, shape)?;
    work(&stream)?; // cuBLAS warm-up outside the capture
    stream.synchronize()?;
    let graph = space.capture(&stream, work)?;
    for _ in 0..10 {
        graph.replay()?;
    }
    let out = format!("h{}", shape.layers - 1);
    let before: Vec<f32> = space.read(&stream, &out)?;
    let rows = [0, b / 2, b - 1];
    let sampled = |v: &[f32]| {
        rows.iter()
            .flat_map(|&r| v[r * h..(r + 1) * h].to_vec())
            .collect::<Vec<_>>()
    };
    assert_matches(
        &sampled(&before),
        &cpu_forward(&x, &host, &rows, shape),
        h,
        "before sleep",
    );
    println!(
        "MLP {}x{h}, batch {b}: captured once, ran 10 steps, output checked against the CPU",
        shape.layers
    );

    let start = Instant::now();
    let arena = HostArena::new(&ctx, weights.bytes() + batch.bytes())?;
    println!(
        "pinned a {} MiB host arena once in {:.0} ms (reused by every sleep)",
        arena.capacity() >> 20,
        start.elapsed().as_secs_f64() * 1e3
    );

    let (free_awake, _) = memory_info(&ctx)?;
    let start = Instant::now();
    let offloads = space.sleep(
        [&mut weights, &mut batch],
        &HostStorage::Pinned(arena.clone()),
        &stream,
    )?;
    let sleep_time = start.elapsed();
    let (free_asleep, _) = memory_info(&ctx)?;
    println!(
        "sleep: device free memory {} MiB -> {} MiB (+{} MiB) in {:.1} ms",
        free_awake >> 20,
        free_asleep >> 20,
        (free_asleep - free_awake) >> 20,
        sleep_time.as_secs_f64() * 1e3
    );
    match graph.replay() {
        Err(error) => {
            println!("replay while asleep: refused with a typed error: {error} ({error:?})")
        }
        Ok(()) => {
            eprintln!("a replay while asleep was launched");
            std::process::exit(1);
        }
    }

    let start = Instant::now();
    let restores = space.wake([&mut weights, &mut batch], &stream)?;
    let wake_time = start.elapsed();
    println!("wake: {:.1} ms", wake_time.as_secs_f64() * 1e3);
    graph.replay()?;
    let after: Vec<f32> = space.read(&stream, &out)?;
    let identical = before
        .iter()
        .zip(&after)
        .all(|(x, y)| x.to_bits() == y.to_bits());
    println!(
        "same exec after wake: output equal to the pre-sleep output bit for bit: {}",
        if identical { "YES" } else { "NO" }
    );

    let mut table = support::table([
        "dataset",
        "MiB",
        "offload ms",
        "offload GB/s",
        "restore GB/s",
        "storage",
    ]);
    for (name, (o, r)) in ["weights", "batch"]
        .iter()
        .zip(offloads.iter().zip(&restores))
    {
        let ms = |t: &TransferReport| t.elapsed.as_secs_f64() * 1e3;
        table.add_row([
            name.to_string(),
            (o.bytes >> 20).to_string(),
            format!("{:.2}", ms(o)),
            format!("{:.1}", o.gb_per_s()),
            format!("{:.1}", r.gb_per_s()),
            format!("{:?}", o.storage),
        ]);
    }
    println!("\n{table}");
    if !identical {
        std::process::exit(1);
    }
    Ok(())
}
