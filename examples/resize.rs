//! The resize scenario: allocate 1.5 GiB, fill it, grow it to 3 GiB, ten times over.
//!
//! - stablebuf: a block that reserved 3 GiB of addresses grows in place (one more mapping behind
//!   the same address, no copy). Run twice: with the pool's cache warm (the chunks freed by the
//!   last round are reused) and with the cache drained before each grow (a fresh `cuMemCreate`).
//!   A third run keeps every round's block (a workload that keeps growing, so no grow can
//!   reuse freed memory) with the pool creating memory ahead of need
//!   (`PoolOptions::create_ahead`): the grow maps memory a worker created while the program
//!   did its work (verifying the data; `ElasticPool::settle` waits for the worker so every round
//!   measures the same thing). One profiled grow of each kind prints the driver-call split.
//! - baseline: `cudaMalloc(3 GiB)` + copy 1.5 GiB + `cudaFree(old)`.
//!
//! Every round writes a seeded pattern before growing and checks it after, on the GPU, then
//! fills and checks the grown part. Prints average times and ratios, writes the pool's timeline
//! as `resize-timeline.svg` (into `--svg-dir`, `$STABLEBUF_SVG_DIR` by default), and exits
//! non-zero on any mismatch.

mod support;

use std::path::PathBuf;
use std::sync::Arc;
use std::time::{Duration, Instant};

use clap::Parser;
use stablebuf::buffer::{copy_between, LinearBuffer};
use stablebuf::cudarc::driver::CudaStream;
use stablebuf::kernels::Kernels;
use stablebuf::pool::human_bytes;
use stablebuf::pool::Block;
use stablebuf::{DeviceBuffer, ElasticPool, Error, PoolOptions, Result};

const MIB: usize = 1 << 20;
const SMALL: usize = 1536 * MIB;
const LARGE: usize = 3072 * MIB;

/// Grow a 1.5 GiB block to 3 GiB in place (pool cache warm, then fresh memory) against
/// cudaMalloc + copy + cudaFree, with the data checked on the GPU every round.
#[derive(Parser)]
struct Args {
    /// Rounds per approach.
    #[arg(long, default_value_t = 10, value_parser = clap::value_parser!(u32).range(1..))]
    rounds: u32,
    /// Where the timeline SVG goes.
    #[arg(long, env = "STABLEBUF_SVG_DIR", default_value = ".")]
    svg_dir: PathBuf,
    #[command(flatten)]
    common: support::Common,
}

fn sync(stream: &Arc<CudaStream>) -> Result<()> {
    stream.synchronize().map_err(Error::from)
}

/// Fails unless `[first, first + count)` holds the pattern for `seed`.
fn verify(
    kernels: &Kernels,
    stream: &Arc<CudaStream>,
    buffer: &impl DeviceBuffer,
    first: usize,
    count: usize,
    seed: u32,
    what: &str,
) -> Result<()> {
    let wrong = kernels.pattern_mismatches(stream, buffer, first, count, seed)?;
    if wrong != 0 {
        eprintln!("{what}: {wrong} of {count} elements are wrong");
        std::process::exit(1);
    }
    Ok(())
}

struct Timings {
    name: &'static str,
    rounds: Vec<Duration>,
}

impl Timings {
    fn mean_us(&self) -> f64 {
        self.rounds.iter().map(Duration::as_secs_f64).sum::<f64>() * 1e6 / self.rounds.len() as f64
    }
}

fn grow_rounds(
    pool: &ElasticPool,
    kernels: &Kernels,
    stream: &Arc<CudaStream>,
    drain_first: bool,
    count: u32,
    name: &'static str,
) -> Result<Timings> {
    let tenant = pool.register(name, 2 * LARGE)?;
    let mut rounds = Vec::new();
    let bar = support::progress(count.into(), name);
    for round in 0..count {
        let seed = 0x5eed_0000 + round;
        let mut block = tenant.alloc_growable(SMALL, LARGE)?;
        let address = block.address();
        kernels.fill_pattern(stream, &block, 0, SMALL / 4, seed)?;
        sync(stream)?;
        if drain_first {
            pool.drain();
        }
        let start = Instant::now();
        block.grow(LARGE)?;
        rounds.push(start.elapsed());
        if block.address() != address {
            eprintln!("{name}: the address moved");
            std::process::exit(1);
        }
        verify(kernels, stream, &block, 0, SMALL / 4, seed, name)?;
        kernels.fill_pattern(stream, &block, SMALL / 4, (LARGE - SMALL) / 4, seed)?;
        verify(kernels, stream, &block, 0, LARGE / 4, seed, name)?;
        bar.inc(1);
    }
    bar.finish_and_clear();
    println!("  {}", tenant.stats()?);
    Ok(Timings { name, rounds })
}

/// Grows of a workload that keeps growing (every round's block is kept), with the pool
/// creating memory ahead of need.
fn ahead_rounds(
    ctx: &Arc<stablebuf::cudarc::driver::CudaContext>,
    kernels: &Kernels,
    stream: &Arc<CudaStream>,
    count: u32,
) -> Result<Timings> {
    let name = "stablebuf grow, new memory created ahead";
    let pool = ElasticPool::new(ctx, PoolOptions::default().create_ahead(true))?;
    // Room for every kept block and the profiled one after them.
    let tenant = pool.register(name, LARGE * (count as usize + 1))?;
    let mut kept: Vec<Block> = Vec::new();
    let mut rounds = Vec::new();
    let bar = support::progress(count.into(), name);
    for round in 0..count {
        let seed = 0xa4ea_0000 + round;
        let mut block = tenant.alloc_growable(SMALL, LARGE)?;
        kernels.fill_pattern(stream, &block, 0, SMALL / 4, seed)?;
        sync(stream)?;
        // The program's own work between grows outlasts one cuMemCreate; settle makes every
        // round measure the same thing instead of racing the worker.
        pool.settle();
        let start = Instant::now();
        block.grow(LARGE)?;
        rounds.push(start.elapsed());
        verify(kernels, stream, &block, 0, SMALL / 4, seed, name)?;
        kernels.fill_pattern(stream, &block, SMALL / 4, (LARGE - SMALL) / 4, seed)?;
        verify(kernels, stream, &block, 0, LARGE / 4, seed, name)?;
        kept.push(block);
        bar.inc(1);
    }
    bar.finish_and_clear();
    // One more, profiled: the driver calls of a grow into memory created ahead.
    let mut block = tenant.alloc_growable(SMALL, LARGE)?;
    sync(stream)?;
    pool.settle();
    let (grown, calls) = support::calls::profile(|| block.grow(LARGE));
    grown?;
    println!(
        "  driver calls of one grow into memory created ahead: {}",
        support::calls::summary(&calls, &[])
    );
    println!("  {}", tenant.stats()?);
    drop((kept, block));
    Ok(Timings { name, rounds })
}

fn copy_rounds(
    ctx: &Arc<stablebuf::cudarc::driver::CudaContext>,
    kernels: &Kernels,
    stream: &Arc<CudaStream>,
    count: u32,
) -> Result<Timings> {
    let name = "cudaMalloc(3 GiB) + copy 1.5 GiB + cudaFree";
    let mut rounds = Vec::new();
    let bar = support::progress(count.into(), name);
    for round in 0..count {
        let seed = 0xc0de_0000 + round;
        let old = LinearBuffer::new(ctx, SMALL)?;
        kernels.fill_pattern(stream, &old, 0, SMALL / 4, seed)?;
        sync(stream)?;
        let start = Instant::now();
        let new = LinearBuffer::new(ctx, LARGE)?;
        copy_between(stream, &new, 0, &old, 0, SMALL)?;
        sync(stream)?;
        drop(old); // cudaFree
        rounds.push(start.elapsed());
        verify(
            kernels,
            stream,
            &new,
            0,
            SMALL / 4,
            seed,
            "cudaMalloc + copy + free",
        )?;
        kernels.fill_pattern(stream, &new, SMALL / 4, (LARGE - SMALL) / 4, seed)?;
        verify(
            kernels,
            stream,
            &new,
            0,
            LARGE / 4,
            seed,
            "cudaMalloc + copy + free",
        )?;
        bar.inc(1);
    }
    bar.finish_and_clear();
    Ok(Timings { name, rounds })
}

fn main() -> std::process::ExitCode {
    let args = Args::parse();
    support::run(&args.common, || run(&args))
}

fn run(args: &Args) -> Result<()> {
    let rounds = args.rounds;
    let ctx = args.common.open_device()?;
    let stream = ctx.new_stream()?;
    let kernels = Kernels::load(&ctx)?;
    let pool = ElasticPool::new(&ctx, PoolOptions::default())?;
    println!(
        "resize {} -> {}, {rounds} rounds each, data checked on the GPU every round",
        human_bytes(SMALL),
        human_bytes(LARGE)
    );

    let baseline = copy_rounds(&ctx, &kernels, &stream, rounds)?;
    let warm = grow_rounds(
        &pool,
        &kernels,
        &stream,
        false,
        rounds,
        "stablebuf grow, pool cache warm",
    )?;
    let fresh = grow_rounds(
        &pool,
        &kernels,
        &stream,
        true,
        rounds,
        "stablebuf grow, new memory each time",
    )?;

    let ahead = ahead_rounds(&ctx, &kernels, &stream, rounds)?;
    // The split of a grow into fresh memory: create / map / set-access.
    {
        let tenant = pool.register("profiled fresh grow", 2 * LARGE)?;
        let mut block = tenant.alloc_growable(SMALL, LARGE)?;
        sync(&stream)?;
        pool.drain();
        let (grown, calls) = support::calls::profile(|| block.grow(LARGE));
        grown?;
        println!(
            "  driver calls of one grow into new memory: {}",
            support::calls::summary(&calls, &[])
        );
    }

    let base = baseline.mean_us();
    let mut table = support::table(["approach", "mean µs", "first round µs", "vs baseline"]);
    for t in [&warm, &fresh, &ahead, &baseline] {
        table.add_row([
            t.name.to_string(),
            format!("{:.1}", t.mean_us()),
            format!("{:.1}", t.rounds[0].as_secs_f64() * 1e6),
            format!("{:.1}x", base / t.mean_us()),
        ]);
    }
    println!("\n{table}");
    println!("\npool: {}", pool.stats());

    let path = args.svg_dir.join("resize-timeline.svg");
    pool.write_timeline(
        "resize 1.5 -> 3 GiB: growth in place (cache warm, then fresh memory)",
        &path,
    )?;
    println!("timeline: {}", path.display());
    println!("data verified in every round: OK");
    Ok(())
}
