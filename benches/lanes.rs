//! Pipelined lanes: what rebinding every step costs per step, with 2 and 3 lanes, replays in
//! step order (the default) and free to overlap (the old behaviour), against the same lanes fed
//! the same data every step (no bind happens) and against one stream replaying alone. The work
//! is an MLP (3 layers, hidden 4096, batch 256, FP32 cuBLAS SGEMM + bias/ReLU) whose 192 MiB of
//! weights are remapped and whose 4 MiB batch is copied in, every step. Variants in paired
//! rounds; each run is `STEPS` steps from an idle GPU to the last one's completion.

mod common;

use std::cell::RefCell;
use std::sync::Arc;
use std::time::Duration;

use common::{
    criterion, gpu, print_profile, profile, seconds, verdict, Gpu, Ratio, Recorder, Variants,
};
use criterion::SamplingMode;
use stablebuf::cudarc::driver::{sys::CUevent_flags, CudaStream};
use stablebuf::kernels::{Blas, Kernels, RECOMMENDED_WORKSPACE};
use stablebuf::{BindStrategy, Dataset, Layout, Pipeline, Result, Slot, Space, SpaceOptions};

const GROUP: &str = "pipelined lanes, per step";
const LAYERS: usize = 3;
const HIDDEN: usize = 4096;
const BATCH: usize = 256;
const STEPS: usize = 40;
/// Issue 14, section 4: rebinding may add at most 5% per step with 2 lanes.
const OVERHEAD_TARGET: f64 = 1.05;

fn layout() -> Layout {
    let (h, b) = (HIDDEN, BATCH);
    let mut builder = Layout::builder().group("weights");
    for l in 0..LAYERS {
        builder = builder
            .input(format!("w{l}"), h * h * 4)
            .input(format!("b{l}"), h * 4);
    }
    builder = builder.group("batch").input("x", b * h * 4);
    for l in 0..LAYERS {
        builder = builder.scratch(format!("h{l}"), b * h * 4);
    }
    builder
        .scratch("workspace", RECOMMENDED_WORKSPACE)
        .build()
        .unwrap()
}

/// The forward pass over `space`'s slots, with a cuBLAS handle on `stream`, warmed up once.
fn work(
    space: &Space,
    stream: &Arc<CudaStream>,
    kernels: &Arc<Kernels>,
) -> Result<impl FnMut(&Arc<CudaStream>) -> Result<()> + Send + 'static> {
    let blas = Blas::new(stream, space.slot("workspace")?)?;
    let slot = |name: String| space.slot(&name).cloned();
    let x = slot("x".into())?;
    let layers: Vec<(Slot, Slot, Slot)> = (0..LAYERS)
        .map(|l| {
            Ok((
                slot(format!("w{l}"))?,
                slot(format!("b{l}"))?,
                slot(format!("h{l}"))?,
            ))
        })
        .collect::<Result<_>>()?;
    let kernels = kernels.clone();
    let pass = move |s: &Arc<CudaStream>| {
        for (l, (w, b, h)) in layers.iter().enumerate() {
            let input = if l == 0 { &x } else { &layers[l - 1].2 };
            blas.sgemm(input, w, h, BATCH, HIDDEN, HIDDEN)?;
            kernels.bias_act(s, h, b, BATCH, HIDDEN, l + 1 < LAYERS)?;
        }
        Ok(())
    };
    if space.is_fully_bound() {
        pass(stream)?;
        stream.synchronize()?;
    }
    Ok(pass)
}

struct Data {
    weights: Vec<Dataset>,
    batches: Vec<Dataset>,
}

impl Data {
    fn step(&self, i: usize, rotate: bool) -> [&Dataset; 2] {
        let (w, x) = if rotate {
            (i % self.weights.len(), i % self.batches.len())
        } else {
            (0, 0)
        };
        [&self.weights[w], &self.batches[x]]
    }
}

fn lanes(gpu: &Gpu, count: usize, data: &Data) -> Pipeline {
    let options = SpaceOptions::default().group_bind("batch", BindStrategy::Auto);
    Pipeline::new(&gpu.ctx, &layout(), count, options, |space, stream| {
        for dataset in data.step(0, false) {
            space.bind(dataset)?;
        }
        work(space, stream, &gpu.kernels)
    })
    .unwrap()
}

/// Seconds per step of `STEPS` steps, from an idle GPU to the last step's completion.
fn run(pipeline: &RefCell<Pipeline>, in_order: bool, data: &Data, rotate: bool) -> f64 {
    let mut pipeline = pipeline.borrow_mut();
    pipeline.order_replays(in_order);
    pipeline.synchronize().unwrap();
    let elapsed = seconds(|| {
        for i in 0..STEPS {
            pipeline.step(&data.step(i, rotate)).unwrap();
        }
        pipeline.synchronize().unwrap();
    });
    elapsed / STEPS as f64
}

fn main() {
    let Some(gpu) = gpu() else { return };
    let rec = Recorder::default();
    let mut c = criterion();
    let probe = Space::new(&gpu.ctx, layout()).unwrap();
    let filled = |group: &str, count: usize| -> Vec<Dataset> {
        (0..count)
            .map(|i| {
                let d = probe.new_dataset(group).unwrap();
                for slot in d.slots().to_vec() {
                    let values = vec![0.01 * (i + 1) as f32; slot.bytes / 4];
                    d.write(&gpu.stream, &slot.name, &values).unwrap();
                }
                d
            })
            .collect()
    };
    let data = Data {
        weights: filled("weights", 3),
        batches: filled("batch", 4),
    };

    // The floor: one space, one stream, the same data, replays back to back.
    let alone = Space::new(&gpu.ctx, layout()).unwrap();
    for dataset in data.step(0, false) {
        alone.bind(dataset).unwrap();
    }
    let graph = alone
        .capture(
            &gpu.stream,
            work(&alone, &gpu.stream, &gpu.kernels).unwrap(),
        )
        .unwrap();
    let event = || {
        gpu.ctx
            .new_event(Some(CUevent_flags::CU_EVENT_DEFAULT))
            .unwrap()
    };
    let (start, end) = (event(), event());
    start.record(&gpu.stream).unwrap();
    for _ in 0..20 {
        graph.replay().unwrap();
    }
    end.record(&gpu.stream).unwrap();
    let replay_us = f64::from(start.elapsed_ms(&end).unwrap()) * 1e3 / 20.0;
    println!("GPU time of one replay (CUDA events): {replay_us:.1} µs");

    let two_rebind = RefCell::new(lanes(&gpu, 2, &data));
    let two_same = RefCell::new(lanes(&gpu, 2, &data));
    let three_rebind = RefCell::new(lanes(&gpu, 3, &data));
    let three_same = RefCell::new(lanes(&gpu, 3, &data));

    let mut group = c.benchmark_group(GROUP);
    group
        .sample_size(10)
        .sampling_mode(SamplingMode::Flat)
        .warm_up_time(Duration::from_millis(100))
        .measurement_time(Duration::from_secs(3));
    Variants::new(GROUP)
        .add("replay only", || {
            gpu.stream.synchronize().unwrap();
            seconds(|| {
                for _ in 0..STEPS {
                    graph.replay().unwrap();
                }
                gpu.stream.synchronize().unwrap();
            }) / STEPS as f64
        })
        .add("2 in order, rebind", || run(&two_rebind, true, &data, true))
        .add("2 in order, same", || run(&two_same, true, &data, false))
        .add("2 unordered, rebind", || {
            run(&two_rebind, false, &data, true)
        })
        .add("2 unordered, same", || run(&two_same, false, &data, false))
        .add("3 in order, rebind", || {
            run(&three_rebind, true, &data, true)
        })
        .add("3 in order, same", || run(&three_same, true, &data, false))
        .bench(&mut group, &rec, "MLP");
    group.finish();
    c.final_summary();

    let row = ["MLP".to_string()];
    let overhead = |lanes: &str| Ratio::of(&format!("{lanes}, rebind"), &format!("{lanes}, same"));
    rec.paired_table(
        GROUP,
        &[
            "replay only",
            "2 in order, rebind",
            "2 in order, same",
            "2 unordered, rebind",
            "2 unordered, same",
            "3 in order, rebind",
            "3 in order, same",
        ],
        &row,
        "µs per step",
        1e6,
        &[
            overhead("2 in order"),
            overhead("2 unordered"),
            overhead("3 in order"),
            Ratio::of("2 in order, rebind", "replay only"),
        ],
    );

    // One rebinding step, driver call by call: what the host does while the other lane runs.
    {
        let mut pipeline = two_rebind.borrow_mut();
        pipeline.order_replays(true);
        for i in 0..4 {
            pipeline.step(&data.step(i, true)).unwrap();
        }
        let (_, calls) = profile(|| pipeline.step(&data.step(4, true)).map(drop).unwrap());
        println!();
        print_profile("one 2-lane step (binds + replay)", &calls);
        pipeline.synchronize().unwrap();
    }

    println!("\n== targets (issue 14, section 4)");
    for (lanes, target) in [
        ("2 in order", true),
        ("2 unordered", false),
        ("3 in order", false),
    ] {
        let spread = rec.ratio(GROUP, &row[0], &overhead(lanes));
        let median = spread.map_or(f64::NAN, |s| s.median);
        let line = format!(
            "{lanes} lanes: rebinding every step adds {:+.1}% per step over the same lanes fed the same data ({})",
            (median - 1.0) * 100.0,
            spread.map_or("-".into(), |s| s.to_string())
        );
        if target {
            println!(
                "{line}; target <= {:+.0}%: {}",
                (OVERHEAD_TARGET - 1.0) * 100.0,
                verdict(median <= OVERHEAD_TARGET)
            );
        } else {
            println!("{line}");
        }
    }
}
