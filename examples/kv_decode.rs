//! Decode attention over a KV cache on stable addresses, under one CUDA graph captured once at
//! `max_batch` (issue 45).
//!
//! The step, per layer: append the step's token to every running sequence at `length − 1`,
//! then bf16 grouped-query decode attention (`kernels/decode_attention.cu`) over each
//! sequence's valid tokens, lengths read from the cache's device array. Between replays the
//! host only grows sequences (mapping a granule when a row crosses one) and publishes the
//! lengths; the graph is never re-captured.
//!
//! 1. **Checked serving run** (fresh seed, printed): sequences are admitted with random prompts
//!    copied into their rows, forked by prefix sharing (granules mapped twice, copied on
//!    write), released and replaced, and the cache sleeps and wakes once; every
//!    `--check-every` steps the FP32 outputs of every layer are compared with the CPU
//!    reference (`approx`), outputs poisoned with NaN before each replay, and at the end every
//!    row's bytes with the host mirror, bit for bit.
//! 2. **Step time follows the tokens.** The same graph with sequence lengths drawn around a
//!    mean of `max_len`/16 … `max_len`/2, against a static cache (every row backed to
//!    `max_len`) whose graph reads every row in full, as attention over a static cache with a
//!    mask does. Target: at mean `max_len`/4, ≤ 0.5× the static step. Also the cache's device
//!    memory against the static cache's and against the tokens' bytes plus one granule per
//!    (sequence, layer, K/V).
//!
//! ```text
//! cargo run --release --example kv_decode -- [--layers 4] [--heads 32] [--kv-heads 8]
//!     [--head-dim 128] [--max-batch 16] [--max-len 8192] [--steps 48] [--seed N]
//! ```
//! The default (Llama-3-8B's attention shape, 4 layers) needs about 2.5 GiB and runs in
//! seconds; exits non-zero on any mismatch or missed target.

#[path = "kv/mod.rs"]
mod kv;
mod support;

use std::sync::Arc;
use std::time::Instant;

use clap::Parser;
use kv::{last_layer_gated, serve, serve_space, step_work, Model, ServeRun, StepIo};
use rand::{rngs::StdRng, Rng, SeedableRng};
use stablebuf::cudarc::driver::CudaStream;
use stablebuf::error::LayoutError;
use stablebuf::kernels::AttentionKernels;
use stablebuf::kv::{KvCache, KvStats};
use stablebuf::{Error, Result, StableGraph};

/// Decode attention over a KV cache whose memory follows the tokens, under one graph: checked
/// against the CPU reference, timed against a static cache read in full.
#[derive(Parser, Debug)]
struct Args {
    /// Transformer layers.
    #[arg(long, default_value_t = 4, value_parser = support::at_least(1))]
    layers: usize,
    /// Query heads.
    #[arg(long, default_value_t = 32, value_parser = support::at_least(1))]
    heads: usize,
    /// Key/value heads (divides --heads).
    #[arg(long, default_value_t = 8, value_parser = support::at_least(1))]
    kv_heads: usize,
    /// Elements per head (at most 256).
    #[arg(long, default_value_t = 128, value_parser = support::at_least(1))]
    head_dim: usize,
    /// Sequence slots (the batch the graph is captured at).
    #[arg(long, default_value_t = 16, value_parser = support::at_least(1))]
    max_batch: usize,
    /// Tokens reserved per sequence.
    #[arg(long, default_value_t = 8192, value_parser = support::at_least(64))]
    max_len: usize,
    /// Steps of the checked serving run.
    #[arg(long, default_value_t = 48, value_parser = support::at_least(1))]
    steps: usize,
    /// Compare with the CPU reference every this many steps.
    #[arg(long, default_value_t = 8, value_parser = support::at_least(1))]
    check_every: usize,
    /// Seed of the checked run (default: fresh, printed).
    #[arg(long, env = "STABLEBUF_SEED")]
    seed: Option<u64>,
    /// Timed replays per chunk; the step time is the median chunk's.
    #[arg(long, default_value_t = 20, value_parser = support::at_least(1))]
    replays: usize,
    #[command(flatten)]
    common: support::Common,
}

fn main() -> std::process::ExitCode {
    let args = Args::parse();
    support::run(&args.common, || run(&args))
}

fn failed(what: String) -> Error {
    Error::Layout(LayoutError::InvalidShape(what))
}

fn sync(stream: &Arc<CudaStream>) -> Result<()> {
    stream.synchronize().map_err(Error::from)
}

/// Median µs per replay over 5 chunks of `replays` replays (after a warm-up chunk).
fn step_us(graph: &StableGraph, replays: usize) -> Result<f64> {
    let mut chunks = Vec::new();
    for round in 0..6 {
        sync(graph.stream())?;
        let start = Instant::now();
        for _ in 0..replays {
            graph.replay()?;
        }
        sync(graph.stream())?;
        if round > 0 {
            chunks.push(start.elapsed().as_secs_f64() * 1e6 / replays as f64);
        }
    }
    Ok(support::percentile(&chunks, 0.5))
}

fn mib(bytes: usize) -> String {
    format!("{:.0}", bytes as f64 / (1 << 20) as f64)
}

fn run(args: &Args) -> Result<()> {
    let model = Model {
        layers: args.layers,
        heads: args.heads,
        kv_heads: args.kv_heads,
        head_dim: args.head_dim,
        max_batch: args.max_batch,
        max_len: args.max_len,
    };
    let ctx = args.common.open_device()?;
    let stream = ctx.new_stream()?;
    let kernels = Arc::new(AttentionKernels::load(&ctx)?);
    let layout = model.layout();
    let cache = Arc::new(KvCache::new(&ctx, layout)?);
    let granule = cache.granule();
    println!(
        "{} layers, {} heads / {} KV heads × {}, bf16, max_batch {}, max_len {}: {} bytes per \
         token per layer and K/V, {} tokens per {} MiB granule, rows of {} granules",
        model.layers,
        model.heads,
        model.kv_heads,
        model.head_dim,
        model.max_batch,
        model.max_len,
        layout.token_bytes(),
        layout.tokens_per_granule(granule),
        granule >> 20,
        cache.seq_stride() / granule,
    );

    // 1. The checked serving run.
    // Prompts cross a granule boundary at the default shape (1,024 tokens per granule).
    let max_prompt = (model.max_len / 4).min(1200);
    let cap = (max_prompt + args.steps + 1).min(model.max_len);
    let space = serve_space(&ctx, &model, max_prompt)?;
    let io = StepIo::new(&space, &stream, model)?;
    let graph = StableGraph::capture(
        &stream,
        &[&space],
        step_work(kernels.clone(), model, &cache, io, last_layer_gated(&model))?,
    )?;
    let seed = args.seed.unwrap_or_else(|| {
        std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map_or(0, |d| d.as_nanos() as u64)
    });
    println!("checked serving run: seed {seed} (--seed to replay)");
    let mut rng = StdRng::seed_from_u64(seed);
    let started = Instant::now();
    let report = serve(
        &mut rng,
        &cache,
        &space,
        &stream,
        &|| graph.replay(),
        model,
        ServeRun {
            steps: args.steps,
            max_prompt,
            check_every: args.check_every,
            sleep_at: args.steps / 2,
            zero_ahead: true,
        },
        cap,
    )?;
    println!(
        "RESULT kv_decode check: {} steps, {} admitted, {} forked (up to {} shared granules), {} \
         released, one sleep and wake; {} outputs match the CPU reference (max abs error {:.2e}), \
         {} tokens match the mirror bit for bit, {} bytes past the lengths read zero ({} \
         granules zeroed ahead) ({:.1} s)",
        args.steps,
        report.admitted,
        report.forked,
        report.shared_granules_seen,
        report.released,
        report.checked_outputs,
        report.max_abs_error,
        report.checked_tokens,
        report.checked_tail_bytes,
        report.zeroed_ahead,
        started.elapsed().as_secs_f64()
    );
    if report.checked_outputs == 0 || report.checked_tokens == 0 {
        return Err(failed("the checked run compared nothing".into()));
    }

    // 2. Step time against a static cache read in full.
    for seq in 0..model.max_batch {
        cache.release(seq)?;
    }
    cache.trim();
    let full = Arc::new(KvCache::new(&ctx, layout)?);
    for seq in 0..model.max_batch {
        full.grow(seq, model.max_len)?;
    }
    full.publish_lengths()?;
    let full_graph = StableGraph::capture(
        &stream,
        &[&space],
        step_work(kernels.clone(), model, &full, io, last_layer_gated(&model))?,
    )?;
    let static_us = step_us(&full_graph, args.replays)?;
    let static_bytes = full.stats().bytes;
    let mut table = support::table([
        "mean length",
        "stablebuf µs/step",
        "static (full read) µs/step",
        "ratio",
        "cache MiB",
        "static MiB",
        "bound MiB",
    ]);
    let mut verdict = None;
    let mut memory_ok = true;
    for divisor in [16usize, 8, 4, 2] {
        let mean = model.max_len / divisor;
        for seq in 0..model.max_batch {
            cache.release(seq)?;
        }
        let mut tokens = 0;
        for seq in 0..model.max_batch {
            let len = rng.gen_range(1..=(2 * mean - 1).min(model.max_len));
            cache.grow(seq, len)?;
            tokens += len;
        }
        cache.publish_lengths()?;
        cache.trim();
        let stable_us = step_us(&graph, args.replays)?;
        let stats: KvStats = cache.stats();
        // Data granules only: the tokens' bytes plus one granule per (sequence, layer, K/V).
        let data_bytes = stats.physical_granules * granule;
        let bound = tokens * layout.token_bytes() * 2 * model.layers
            + model.max_batch * 2 * model.layers * granule;
        memory_ok &= data_bytes <= bound;
        let ratio = stable_us / static_us;
        if divisor == 4 {
            verdict = Some(ratio);
        }
        table.add_row([
            format!("{} (max_len/{divisor})", tokens / model.max_batch),
            format!("{stable_us:.1}"),
            format!("{static_us:.1}"),
            format!("{ratio:.3}"),
            mib(stats.bytes),
            mib(static_bytes),
            mib(bound),
        ]);
    }
    println!("{table}");
    let ratio = verdict.unwrap_or(f64::NAN);
    let pass = ratio <= 0.5;
    println!(
        "RESULT kv_decode step time at mean max_len/4: {ratio:.3}× the static cache read in full \
         (target ≤ 0.5): {}",
        if pass { "PASS" } else { "FAIL" }
    );
    println!(
        "RESULT kv_decode memory: data granules ≤ tokens' bytes + one granule per (sequence, \
         layer, K/V) at every length: {}",
        if memory_ok { "PASS" } else { "FAIL" }
    );
    if !pass || !memory_ok {
        return Err(failed(
            "a kv_decode target was missed (see the RESULT lines)".into(),
        ));
    }
    Ok(())
}
