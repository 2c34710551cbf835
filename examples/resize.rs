//! The resize scenario: allocate 1.5 GiB, fill it, grow it to 3 GiB, ten times over.
//!
//! - stablebuf: a block that reserved 3 GiB of addresses grows in place (one more mapping behind
//!   the same address, no copy). Run twice: with the pool's cache warm (the chunks freed by the
//!   last round are reused) and with the cache drained before each grow (a fresh `cuMemCreate`).
//! - baseline: `cudaMalloc(3 GiB)` + copy 1.5 GiB + `cudaFree(old)`.
//!
//! Every round writes a seeded pattern before growing and checks it after, on the GPU, then
//! fills and checks the grown part. Prints average times and ratios, writes the pool's timeline
//! as `resize-timeline.svg` (into `$STABLEBUF_SVG_DIR` if set), and exits non-zero on any
//! mismatch.

use std::sync::Arc;
use std::time::{Duration, Instant};

use stablebuf::buffer::{copy_between, LinearBuffer};
use stablebuf::cudarc::driver::CudaStream;
use stablebuf::pool::human_bytes;
use stablebuf::{open_device, DeviceBuffer, ElasticPool, Error, Kernels, PoolOptions, Result};

const MIB: usize = 1 << 20;
const SMALL: usize = 1536 * MIB;
const LARGE: usize = 3072 * MIB;
const ROUNDS: u32 = 10;

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
    name: &'static str,
) -> Result<Timings> {
    let tenant = pool.register(name, 2 * LARGE)?;
    let mut rounds = Vec::new();
    for round in 0..ROUNDS {
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
    }
    println!("  {}", tenant.stats()?);
    Ok(Timings { name, rounds })
}

fn copy_rounds(
    ctx: &Arc<stablebuf::cudarc::driver::CudaContext>,
    kernels: &Kernels,
    stream: &Arc<CudaStream>,
) -> Result<Timings> {
    let mut rounds = Vec::new();
    for round in 0..ROUNDS {
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
    }
    Ok(Timings {
        name: "cudaMalloc(3 GiB) + copy 1.5 GiB + cudaFree",
        rounds,
    })
}

fn main() -> Result<()> {
    let ctx = open_device(0)?;
    let stream = ctx.new_stream()?;
    let kernels = Kernels::load(&ctx)?;
    let pool = ElasticPool::new(&ctx, PoolOptions::default())?;
    println!(
        "resize {} -> {}, {ROUNDS} rounds each, data checked on the GPU every round",
        human_bytes(SMALL),
        human_bytes(LARGE)
    );

    let baseline = copy_rounds(&ctx, &kernels, &stream)?;
    let warm = grow_rounds(
        &pool,
        &kernels,
        &stream,
        false,
        "stablebuf grow, pool cache warm",
    )?;
    let fresh = grow_rounds(
        &pool,
        &kernels,
        &stream,
        true,
        "stablebuf grow, new memory each time",
    )?;

    let base = baseline.mean_us();
    println!("\n| approach | mean µs | first round µs | vs baseline |");
    println!("| --- | --- | --- | --- |");
    for t in [&warm, &fresh, &baseline] {
        println!(
            "| {} | {:.1} | {:.1} | {:.1}x |",
            t.name,
            t.mean_us(),
            t.rounds[0].as_secs_f64() * 1e6,
            base / t.mean_us()
        );
    }
    println!("\npool: {}", pool.stats());

    let dir = std::env::var("STABLEBUF_SVG_DIR").unwrap_or_else(|_| ".".into());
    let path = std::path::Path::new(&dir).join("resize-timeline.svg");
    pool.write_timeline(
        "resize 1.5 -> 3 GiB: growth in place (cache warm, then fresh memory)",
        &path,
    )?;
    println!("timeline: {}", path.display());
    println!("data verified in every round: OK");
    Ok(())
}
