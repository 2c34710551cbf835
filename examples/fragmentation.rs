//! The fragmentation scenario: fill most of the device with 64 MiB allocations, free a random
//! half, then ask for one block close to all the memory left (free plus cached).
//!
//! Compared in one run, with the same seed for which half is freed:
//! - a block-caching pool over `cudaMalloc` that cannot merge its cached blocks (what PyTorch's
//!   caching allocator does without expandable segments): no cached block is big enough and the
//!   device has too little free, so it fails; or it releases its whole cache and retries;
//! - stablebuf stitching the cached chunks side by side into one range (no `cuMemCreate` when
//!   the cache covers the request; one, for the rest, when it does not);
//! - stablebuf with stitching off: `cuMemCreate` runs out of memory, the pool drains its cache
//!   and retries.
//!
//! Every block that is served is written and checked end to end by kernels. Prints a table and
//! writes the pool's timeline as `fragmentation-timeline.svg` (into `--svg-dir`,
//! `$STABLEBUF_SVG_DIR` by default). Exits non-zero if a check fails or an approach that must
//! succeed does not.

mod support;

use std::path::PathBuf;
use std::sync::Arc;
use std::time::Instant;

use clap::Parser;
use rand::seq::SliceRandom;
use rand::SeedableRng;
use stablebuf::buffer::LinearBuffer;
use stablebuf::cudarc::driver::{CudaContext, CudaStream};
use stablebuf::device::memory_info;
use stablebuf::kernels::Kernels;
use stablebuf::pool::human_bytes;
use stablebuf::pool::Block;
use stablebuf::{ElasticPool, PoolOptions, Result};

const CHUNK: usize = 64 << 20;

/// Fill the device with 64 MiB blocks, free a random half, then ask for one block near all
/// the memory left: a block cache over cudaMalloc against stablebuf stitching cached chunks.
#[derive(Parser)]
struct Args {
    /// Share of free device memory to fill with 64 MiB blocks before freeing half.
    #[arg(long, default_value_t = 0.92, value_parser = support::fraction)]
    fill: f64,
    /// Share of what is left (cached, or free + cached) the big request asks for.
    #[arg(long, default_value_t = 0.95, value_parser = support::fraction)]
    ask: f64,
    /// Seed of the random half that is freed (the same for every approach).
    #[arg(long, default_value_t = 0x00f_4a6)]
    seed: u64,
    /// Where the timeline SVG goes.
    #[arg(long, env = "STABLEBUF_SVG_DIR", default_value = ".")]
    svg_dir: PathBuf,
    #[command(flatten)]
    common: support::Common,
}

struct Row {
    approach: &'static str,
    asked: usize,
    outcome: String,
    ms: f64,
    creates: String,
    mappings: String,
    released: String,
}

fn print_table(rows: &[Row]) {
    let mut table = support::table([
        "approach",
        "asked",
        "result",
        "ms",
        "new cuMemCreate",
        "mappings",
        "released first",
    ]);
    for r in rows {
        table.add_row([
            r.approach.to_string(),
            human_bytes(r.asked),
            r.outcome.clone(),
            format!("{:.1}", r.ms),
            r.creates.clone(),
            r.mappings.clone(),
            r.released.clone(),
        ]);
    }
    println!("\n{table}");
}

/// Which of `count` allocations to free: a random half, the same for every approach.
fn freed_half(count: usize, seed: u64) -> Vec<bool> {
    let mut order: Vec<usize> = (0..count).collect();
    order.shuffle(&mut rand::rngs::StdRng::seed_from_u64(seed));
    let mut freed = vec![false; count];
    for &i in &order[..count / 2] {
        freed[i] = true;
    }
    freed
}

fn check_block(
    kernels: &Kernels,
    stream: &Arc<CudaStream>,
    block: &Block,
    seed: u32,
) -> Result<()> {
    let words = block.len() / 4;
    kernels.fill(stream, block, f32::NAN)?;
    let poisoned = kernels.pattern_mismatches(stream, block, 0, words, seed)?;
    kernels.fill_pattern(stream, block, 0, words, seed)?;
    let wrong = kernels.pattern_mismatches(stream, block, 0, words, seed)?;
    if poisoned != words as u64 || wrong != 0 {
        eprintln!(
            "block check failed: {poisoned} poisoned of {words}, {wrong} wrong after writing"
        );
        std::process::exit(1);
    }
    Ok(())
}

/// The block cache: `cudaMalloc` blocks, freed ones kept whole for reuse.
fn block_cache(
    ctx: &Arc<CudaContext>,
    count: usize,
    freed: &[bool],
    ask: f64,
    rows: &mut Vec<Row>,
) -> Result<()> {
    let mut live = Vec::with_capacity(count);
    let bar = support::progress(count as u64, "block cache: cudaMalloc 64 MiB blocks");
    for _ in 0..count {
        live.push(LinearBuffer::new(ctx, CHUNK)?);
        bar.inc(1);
    }
    bar.finish_and_clear();
    let mut cache = Vec::new();
    let mut kept = Vec::new();
    for (buffer, &free) in live.into_iter().zip(freed) {
        if free {
            cache.push(buffer)
        } else {
            kept.push(buffer)
        }
    }
    let cached: usize = cache.iter().map(LinearBuffer::bytes).sum();
    let (free_now, _) = memory_info(ctx)?;
    println!(
        "block cache: {} in use, {} cached in {} blocks, {} free on the device",
        human_bytes(kept.len() * CHUNK),
        human_bytes(cached),
        cache.len(),
        human_bytes(free_now)
    );
    for (what, asked) in [
        ("of cached", (cached as f64 * ask) as usize),
        (
            "of free + cached",
            ((free_now + cached) as f64 * ask) as usize,
        ),
    ] {
        // No cached block is anywhere near big enough; a cudaMalloc must find the memory.
        let start = Instant::now();
        let attempt = LinearBuffer::new(ctx, asked);
        let ms = start.elapsed().as_secs_f64() * 1e3;
        rows.push(Row {
            approach: "block cache, keep cache",
            asked,
            outcome: match &attempt {
                Ok(_) => "served".into(),
                Err(e) if e.is_out_of_memory() => "out of memory".into(),
                Err(e) => format!("error: {e}"),
            },
            ms,
            creates: "1 cudaMalloc".into(),
            mappings: "-".into(),
            released: "0".into(),
        });
        println!(
            "  {:.0}% {what}: {}",
            ask * 100.0,
            rows.last().unwrap().outcome
        );
    }
    let asked = ((free_now + cached) as f64 * ask) as usize;
    let start = Instant::now();
    let released = cache.len();
    drop(cache); // release the whole cache, one cudaFree per block
    let served = LinearBuffer::new(ctx, asked);
    let ms = start.elapsed().as_secs_f64() * 1e3;
    rows.push(Row {
        approach: "block cache, release cache + retry",
        asked,
        outcome: match &served {
            Ok(_) => "served".into(),
            Err(e) => format!("failed: {e}"),
        },
        ms,
        creates: "1 cudaMalloc".into(),
        mappings: "-".into(),
        released: format!("{released} blocks ({})", human_bytes(cached)),
    });
    Ok(())
}

struct Served {
    ms: f64,
    block: Block,
    creates: u64,
    released: usize,
}

fn serve(pool: &ElasticPool, tenant: &stablebuf::pool::Tenant, asked: usize) -> Result<Served> {
    let before = pool.stats();
    let start = Instant::now();
    let block = tenant.alloc(asked)?;
    let ms = start.elapsed().as_secs_f64() * 1e3;
    let after = pool.stats();
    Ok(Served {
        ms,
        block,
        creates: after.creates - before.creates,
        released: after.drained_bytes - before.drained_bytes,
    })
}

fn main() -> std::process::ExitCode {
    let args = Args::parse();
    support::run(&args.common, || run(&args))
}

fn run(args: &Args) -> Result<()> {
    let ctx = args.common.open_device()?;
    let stream = ctx.new_stream()?;
    let kernels = Kernels::load(&ctx)?;
    let (free, total) = memory_info(&ctx)?;
    let count = (free as f64 * args.fill) as usize / CHUNK;
    let freed = freed_half(count, args.seed);
    println!(
        "device: {} free of {}; filling {:.0}% of free with {count} x 64 MiB, freeing a random half",
        human_bytes(free),
        human_bytes(total),
        args.fill * 100.0
    );
    let mut rows = Vec::new();
    block_cache(&ctx, count, &freed, args.ask, &mut rows)?;

    let pool = ElasticPool::new(&ctx, PoolOptions::default())?;
    let tenant = pool.register("model", 2 * total)?;
    let start = Instant::now();
    let mut blocks: Vec<Option<Block>> = Vec::with_capacity(count);
    for _ in 0..count {
        blocks.push(Some(tenant.alloc(CHUNK)?));
    }
    println!(
        "stablebuf: filled {count} blocks in {:.1} ms",
        start.elapsed().as_secs_f64() * 1e3
    );
    for (slot, &free) in blocks.iter_mut().zip(&freed) {
        if free {
            *slot = None;
        }
    }
    // The blocks that stay hold a pattern, checked after everything else has run.
    let kept = blocks.iter().flatten().count() as u64;
    let bar = support::progress(kept, "stablebuf: write the kept blocks");
    for block in blocks.iter().flatten() {
        kernels.fill_pattern(&stream, block, 0, block.len() / 4, 9)?;
        bar.inc(1);
    }
    bar.finish_and_clear();
    let stats = pool.stats();
    let (free_now, _) = memory_info(&ctx)?;
    println!(
        "after freeing half: {stats}; {} free on the device",
        human_bytes(free_now)
    );

    let of_cached = (stats.cached as f64 * args.ask) as usize;
    let of_all = ((free_now + stats.cached) as f64 * args.ask) as usize;
    for (approach, asked, seed) in [
        ("stablebuf, stitching", of_cached, 1u32),
        ("stablebuf, stitching", of_all, 2),
    ] {
        let served = serve(&pool, &tenant, asked)?;
        check_block(&kernels, &stream, &served.block, seed)?;
        rows.push(Row {
            approach,
            asked,
            outcome: "served".into(),
            ms: served.ms,
            creates: served.creates.to_string(),
            mappings: served.block.info()?.mappings.to_string(),
            released: human_bytes(served.released),
        });
        drop(served.block); // its chunks return to the cache
    }

    pool.set_stitching(false);
    let served = serve(&pool, &tenant, of_all)?;
    check_block(&kernels, &stream, &served.block, 3)?;
    rows.push(Row {
        approach: "stablebuf, no stitching: drain + retry",
        asked: of_all,
        outcome: "served".into(),
        ms: served.ms,
        creates: served.creates.to_string(),
        mappings: served.block.info()?.mappings.to_string(),
        released: human_bytes(served.released),
    });
    drop(served.block);
    let bar = support::progress(kept, "stablebuf: check the kept blocks");
    for block in blocks.iter().flatten() {
        let words = block.len() / 4;
        if kernels.pattern_mismatches(&stream, block, 0, words, 9)? != 0 {
            eprintln!("a block that was never freed lost its data");
            std::process::exit(1);
        }
        bar.inc(1);
    }
    bar.finish_and_clear();
    print_table(&rows);
    let served_all = rows
        .iter()
        .filter(|r| r.approach.starts_with("stablebuf"))
        .all(|r| r.outcome == "served");
    println!("\npool: {}", pool.stats());

    let path = args.svg_dir.join("fragmentation-timeline.svg");
    pool.write_timeline(
        "fragmentation: fill with 64 MiB blocks, free half, stitch, then drain and retry",
        &path,
    )?;
    println!("timeline: {}", path.display());
    drop((blocks, tenant));
    if !served_all {
        eprintln!("stablebuf failed to serve a request");
        std::process::exit(1);
    }
    Ok(())
}
