//! A tensor-parallel MLP layer over stable buffers, one process per GPU, with NCCL: each rank
//! holds a column shard of W1 and a row shard of W2, computes `relu(x·W1ᵣ + b1ᵣ)·W2ᵣ` and
//! all-reduces the partial outputs. The layer (two SGEMMs, bias + ReLU, the all-reduce) is
//! captured ONCE per rank; every step rotates the weight set and the batch by rebinding on every
//! rank and replays the same execs. Outputs are checked against a CPU reference every step.
//!
//! Compared side by side in one run: rebind vs copy-in into static buffers (a space whose
//! weights group uses `BindStrategy::CopyIn`). NCCL buffer registration of the all-reduce
//! buffer, which a rebind puts other memory under, is tried three ways: none, registered once,
//! and registered again after every bind; each way's outputs are checked.
//!
//! Run: `cargo run --release --features nccl --example tensor_parallel [-- --ranks 2]`. Needs
//! libnccl on the loader's path (PyTorch's `nvidia/nccl/lib`, linked as `libnccl.so`); with one
//! GPU it runs one rank (the all-reduce is then a copy). Set NCCL_NVLS_ENABLE=0.

mod support;

use std::process::{Command, ExitCode};
use std::sync::Arc;
use std::time::Instant;

use clap::Parser;
use rand::{rngs::StdRng, Rng, SeedableRng};
use stablebuf::collective::{Collective, CollectiveId};
use stablebuf::kernels::{Blas, Kernels, RECOMMENDED_WORKSPACE};
use stablebuf::{
    open_device, BindStrategy, Dataset, Layout, Result, Space, SpaceOptions, StableGraph,
};

/// A tensor-parallel MLP layer, one process per GPU, with NCCL (libnccl must be on the loader's
/// path): captured once per rank, weight set and batch rebound every step, against copy-in,
/// with and without NCCL buffer registration.
#[derive(Parser)]
struct Args {
    /// Ranks (processes, one GPU each, from `--device` on); default: up to 2, one per GPU.
    #[arg(long, value_parser = support::at_least(1))]
    ranks: Option<usize>,
    /// Rows of the batch.
    #[arg(long, default_value_t = 8, value_parser = support::at_least(1))]
    batch: usize,
    /// Hidden size (input and output width of the layer).
    #[arg(long, default_value_t = 1024, value_parser = support::at_least(1))]
    hidden: usize,
    /// Inner width of the layer, split evenly across ranks.
    #[arg(long, default_value_t = 4096, value_parser = support::at_least(1))]
    ffn: usize,
    /// Steps per variant.
    #[arg(long, default_value_t = 30, value_parser = support::at_least(1))]
    steps: usize,
    #[command(flatten)]
    common: support::Common,
}

const SETS: usize = 3;
const BATCHES: usize = 2;

#[derive(Clone, Copy, Debug)]
struct Shape {
    batch: usize,
    hidden: usize,
    ffn: usize,
    world: usize,
}

impl Shape {
    fn shard(&self) -> usize {
        self.ffn / self.world
    }
}

fn main() -> ExitCode {
    let args = Args::parse();
    if let Ok(rank) = std::env::var("STABLEBUF_RANK") {
        support::init_logging();
        return match rank_main(rank.parse().unwrap_or(0), &args) {
            Ok(()) => ExitCode::SUCCESS,
            Err(error) => {
                eprintln!("rank {rank}: error: {error}");
                ExitCode::FAILURE
            }
        };
    }
    let mut ranks_passed = true;
    let code = support::run(&args.common, || {
        ranks_passed = launch(&args)? == 0;
        Ok(())
    });
    if ranks_passed {
        code
    } else {
        ExitCode::FAILURE
    }
}

/// Starts one process per rank with the communicator's id, and waits for all of them.
fn launch(args: &Args) -> Result<i32> {
    // `device_count` panics in cudarc where there is no libcuda: ask first.
    if !stablebuf::driver_present() {
        return Err(stablebuf::Error::Driver(
            stablebuf::error::DriverError::NoDriver,
        ));
    }
    let gpus = stablebuf::device::device_count()?.saturating_sub(args.common.device);
    let world = args.ranks.unwrap_or(gpus.min(2)).clamp(1, gpus.max(1));
    if world > gpus {
        eprintln!("asked for {world} ranks, {gpus} GPUs");
    }
    if gpus < 2 {
        println!("one GPU here: running 1 rank (two GPUs are needed for a real all-reduce)");
    }
    let id = CollectiveId::new()?;
    let exe = std::env::current_exe().map_err(|source| stablebuf::Error::Io {
        call: "current_exe",
        source,
    })?;
    let children: Vec<_> = (0..world)
        .map(|rank| {
            Command::new(&exe)
                .args(std::env::args().skip(1))
                .env("STABLEBUF_RANK", rank.to_string())
                .env("STABLEBUF_WORLD", world.to_string())
                .env("STABLEBUF_NCCL_ID", id.to_hex())
                .env("NCCL_NVLS_ENABLE", "0")
                .spawn()
                .map_err(|source| stablebuf::Error::Io {
                    call: "spawn",
                    source,
                })
        })
        .collect::<Result<_>>()?;
    let mut code = 0;
    for mut child in children {
        let status = child.wait().map_err(|source| stablebuf::Error::Io {
            call: "wait",
            source,
        })?;
        if !status.success() {
            code = 1;
        }
    }
    println!(
        "tensor_parallel: {world} rank(s) {}",
        if code == 0 { "passed" } else { "FAILED" }
    );
    Ok(code)
}

/// Row-major `rows × cols` values from `seed` (the same on every rank).
fn matrix(seed: u64, rows: usize, cols: usize, scale: f32) -> Vec<f32> {
    let mut rng = StdRng::seed_from_u64(seed);
    (0..rows * cols)
        .map(|_| rng.gen_range(-scale..scale))
        .collect()
}

/// The full layer's weights of set `set`: W1 (hidden × ffn), b1 (ffn), W2 (ffn × hidden).
fn weights(shape: Shape, set: usize) -> (Vec<f32>, Vec<f32>, Vec<f32>) {
    let scale = 1.0 / (shape.hidden as f32).sqrt();
    (
        matrix(100 + set as u64, shape.hidden, shape.ffn, scale),
        matrix(200 + set as u64, 1, shape.ffn, 0.1),
        matrix(300 + set as u64, shape.ffn, shape.hidden, scale),
    )
}

fn batch(shape: Shape, index: usize) -> Vec<f32> {
    matrix(400 + index as u64, shape.batch, shape.hidden, 1.0)
}

/// `relu(x·W1 + b1)·W2` on the CPU, in f64.
fn reference(shape: Shape, x: &[f32], (w1, b1, w2): &(Vec<f32>, Vec<f32>, Vec<f32>)) -> Vec<f32> {
    let (b, h, f) = (shape.batch, shape.hidden, shape.ffn);
    let mut hidden = vec![0f64; b * f];
    for i in 0..b {
        for k in 0..h {
            let xv = f64::from(x[i * h + k]);
            let row = &w1[k * f..(k + 1) * f];
            for (j, w) in row.iter().enumerate() {
                hidden[i * f + j] += xv * f64::from(*w);
            }
        }
        for j in 0..f {
            hidden[i * f + j] = (hidden[i * f + j] + f64::from(b1[j])).max(0.0);
        }
    }
    let mut out = vec![0f64; b * h];
    for i in 0..b {
        for k in 0..f {
            let hv = hidden[i * f + k];
            if hv == 0.0 {
                continue;
            }
            for (j, w) in w2[k * h..(k + 1) * h].iter().enumerate() {
                out[i * h + j] += hv * f64::from(*w);
            }
        }
    }
    out.into_iter().map(|v| v as f32).collect()
}

/// Rank `rank`'s shard of a weight set: W1's columns, b1's entries and W2's rows of its slice.
fn shard(shape: Shape, rank: usize, full: &(Vec<f32>, Vec<f32>, Vec<f32>)) -> [Vec<f32>; 3] {
    let (h, f, s) = (shape.hidden, shape.ffn, shape.shard());
    let columns = rank * s..(rank + 1) * s;
    let w1: Vec<f32> = (0..h)
        .flat_map(|k| full.0[k * f + columns.start..k * f + columns.end].to_vec())
        .collect();
    let b1 = full.1[columns.clone()].to_vec();
    let w2 = full.2[columns.start * h..columns.end * h].to_vec();
    [w1, b1, w2]
}

fn layout(shape: Shape) -> Result<Layout> {
    let (b, h, s) = (shape.batch, shape.hidden, shape.shard());
    Layout::builder()
        .group("weights")
        .input("w1", h * s * 4)
        .input("b1", s * 4)
        .input("w2", s * h * 4)
        .group("batch")
        .input("x", b * h * 4)
        .output("y", b * h * 4)
        .scratch("h", b * s * 4)
        .scratch("workspace", RECOMMENDED_WORKSPACE)
        .build()
}

/// One rank's space, graph and datasets.
struct Rank {
    space: Space,
    graph: StableGraph,
    weights: Vec<Dataset>,
    batches: Vec<Dataset>,
}

#[allow(clippy::too_many_arguments)]
fn build(
    shape: Shape,
    rank: usize,
    ctx: &Arc<stablebuf::cudarc::driver::CudaContext>,
    stream: &Arc<stablebuf::cudarc::driver::CudaStream>,
    collective: &Collective,
    kernels: &Arc<Kernels>,
    strategy: BindStrategy,
    full_weights: &[(Vec<f32>, Vec<f32>, Vec<f32>)],
    inputs: &[Vec<f32>],
) -> Result<Rank> {
    let options = SpaceOptions::default().group_bind("weights", strategy);
    let space = Space::with_options(ctx, layout(shape)?, options)?;
    let weights = full_weights
        .iter()
        .map(|full| {
            let d = space.new_dataset("weights")?;
            let [w1, b1, w2] = shard(shape, rank, full);
            d.write(stream, "w1", &w1)?;
            d.write(stream, "b1", &b1)?;
            d.write(stream, "w2", &w2)?;
            Ok(d)
        })
        .collect::<Result<Vec<_>>>()?;
    let batches = inputs
        .iter()
        .map(|x| {
            let d = space.new_dataset("batch")?;
            d.write(stream, "x", x)?;
            Ok(d)
        })
        .collect::<Result<Vec<_>>>()?;
    space.bind(&weights[0])?;
    space.bind(&batches[0])?;
    let blas = Blas::new(stream, space.slot("workspace")?)?;
    let slot = |name: &str| space.slot(name).cloned();
    let (x, w1, b1, w2, h, y) = (
        slot("x")?,
        slot("w1")?,
        slot("b1")?,
        slot("w2")?,
        slot("h")?,
        slot("y")?,
    );
    let (kernels, collective) = (kernels.clone(), collective.clone());
    let (b, hd, s) = (shape.batch, shape.hidden, shape.shard());
    let graph = space.capture(stream, move |st| {
        blas.sgemm(&x, &w1, &h, b, s, hd)?;
        kernels.bias_act(st, &h, &b1, b, s, true)?;
        blas.sgemm(&h, &w2, &y, b, hd, s)?;
        collective.all_reduce_sum(st, &y)
    })?;
    Ok(Rank {
        space,
        graph,
        weights,
        batches,
    })
}

#[derive(Clone, Copy, PartialEq, Eq, Debug)]
enum Registration {
    None,
    Once,
    AfterEveryBind,
}

fn rank_main(rank: usize, args: &Args) -> Result<()> {
    let world: usize = std::env::var("STABLEBUF_WORLD")
        .ok()
        .and_then(|w| w.parse().ok())
        .unwrap_or(1);
    let id = CollectiveId::from_hex(&std::env::var("STABLEBUF_NCCL_ID").unwrap_or_default())?;
    let shape = Shape {
        batch: args.batch,
        hidden: args.hidden,
        ffn: args.ffn,
        world,
    };
    if !shape.ffn.is_multiple_of(world) {
        return Err(stablebuf::Error::Layout(
            stablebuf::error::LayoutError::InvalidShape(format!(
                "ffn {} is not divisible by {world} ranks",
                shape.ffn
            )),
        ));
    }
    let steps = args.steps;
    let ctx = open_device(args.common.device + rank)?;
    let stream = ctx.new_stream()?;
    let kernels = Arc::new(Kernels::load(&ctx)?);
    let collective = Collective::join(&ctx, rank, world, id)?;
    let full: Vec<_> = (0..SETS).map(|s| weights(shape, s)).collect();
    let inputs: Vec<Vec<f32>> = (0..BATCHES).map(|i| batch(shape, i)).collect();
    let expected: Vec<Vec<Vec<f32>>> = full
        .iter()
        .map(|w| inputs.iter().map(|x| reference(shape, x, w)).collect())
        .collect();
    let lanes = [
        ("rebind", BindStrategy::Remap),
        ("copy-in", BindStrategy::CopyIn),
    ];
    let mut results = Vec::new();
    for (name, strategy) in lanes {
        let r = build(
            shape,
            rank,
            &ctx,
            &stream,
            &collective,
            &kernels,
            strategy,
            &full,
            &inputs,
        )?;
        let modes: &[Registration] = if strategy == BindStrategy::Remap {
            &[
                Registration::None,
                Registration::Once,
                Registration::AfterEveryBind,
            ]
        } else {
            &[Registration::None]
        };
        for &mode in modes {
            let mut registered = match mode {
                Registration::None => None,
                _ => Some(collective.register(r.space.slot("y")?)?),
            };
            let mut times = Vec::new();
            let mut worst = 0f32;
            for step in 0..steps {
                let (set, index) = (step % SETS, step % BATCHES);
                // Poison what the layer writes, so a replay that does nothing cannot pass.
                r.space
                    .write(&stream, "h", &vec![f32::NAN; shape.batch * shape.shard()])?;
                r.batches[index].write(
                    &stream,
                    "y",
                    &vec![f32::NAN; shape.batch * shape.hidden],
                )?;
                stream.synchronize()?;
                let start = Instant::now();
                r.space.bind(&r.weights[set])?;
                r.space.bind(&r.batches[index])?;
                if mode == Registration::AfterEveryBind {
                    drop(registered.take()); // deregisters the old pages first
                    registered = Some(collective.register(r.space.slot("y")?)?);
                }
                r.graph.replay()?;
                stream.synchronize()?;
                times.push(start.elapsed().as_secs_f64() * 1e6);
                let got: Vec<f32> = r.batches[index].read(&stream, "y")?;
                let want = &expected[set][index];
                for (i, (g, w)) in got.iter().zip(want).enumerate() {
                    let error = (g - w).abs() / w.abs().max(1.0);
                    if error.is_nan() || error > 2e-3 {
                        return Err(stablebuf::Error::Layout(
                            stablebuf::error::LayoutError::InvalidShape(format!(
                                "{name} ({mode:?}), step {step}: y[{i}] = {g}, CPU {w}"
                            )),
                        ));
                    }
                    worst = worst.max(error);
                }
            }
            drop(registered);
            let median = support::percentile(&times, 0.5);
            results.push((name, mode, median, worst));
        }
    }
    if rank == 0 {
        let rebind = results[0].2;
        println!(
            "rank 0 of {world}: batch {}, hidden {}, ffn {} ({} per rank), {steps} steps, {SETS} weight sets rotated every step",
            shape.batch, shape.hidden, shape.ffn, shape.shard()
        );
        let mut table = support::table([
            "variant",
            "registration",
            "µs/step",
            "vs rebind",
            "max rel err",
        ]);
        for (name, mode, median, worst) in &results {
            table.add_row([
                name.to_string(),
                format!("{mode:?}"),
                format!("{median:.1}"),
                format!("{:.2}x", median / rebind),
                format!("{worst:.2e}"),
            ]);
        }
        println!("{table}");
    }
    Ok(())
}
