//! Rebinding vs copying, and coalesced datasets vs one mapping per slot vs the raw driver floor.
//! Every comparison is measured in the same process; the tables at the end give the ratios.

mod common;

use std::sync::Arc;
use std::time::{Duration, Instant};

use common::{criterion, gpu, human_bytes, Gpu, Recorder};
use criterion::Criterion;
use stablebuf::cudarc::driver::sys;
use stablebuf::vmm::{granularity, Mapping, Physical, Reservation};
use stablebuf::{memory_info, BindStrategy, DeviceBuffer, Layout, Space, SpaceOptions};

/// The first 4 KiB of a buffer: touched by a kernel before each timed bind, so binds are
/// measured on memory the GPU just used, as in a real loop.
struct Head(u64);

impl DeviceBuffer for Head {
    fn device_address(&self) -> sys::CUdeviceptr {
        self.0
    }
    fn byte_len(&self) -> usize {
        4096
    }
}

const GROUP: &str = "rebind vs copy-in";

fn rebind_vs_copy(c: &mut Criterion, gpu: &Gpu, rec: &Recorder) -> Vec<String> {
    let (free, _) = memory_info(&gpu.ctx).unwrap();
    let sizes: Vec<usize> = [
        64 << 10,
        1 << 20,
        16 << 20,
        64 << 20,
        256 << 20,
        1 << 30,
        4 << 30,
        16 << 30,
    ]
    .into_iter()
    .filter(|&s| s * 4 < free) // two datasets + a copy-in space's resident copy + headroom
    .collect();
    let mut rows = Vec::new();
    let mut group = c.benchmark_group(GROUP);
    // Remaps vary by ±15% between samples: more samples, so auto and remap (the same operation
    // above the crossover) compare on medians, not noise.
    group
        .sample_size(30)
        .measurement_time(Duration::from_secs(2));
    for &size in &sizes {
        let row = human_bytes(size);
        rows.push(row.clone());
        let layout = Layout::builder()
            .group("data")
            .input("d", size)
            .build()
            .unwrap();
        let spaces: Vec<(&str, Space)> = [
            ("remap", BindStrategy::Remap),
            ("copy-in", BindStrategy::CopyIn),
            ("auto", BindStrategy::Auto),
        ]
        .into_iter()
        .map(|(name, s)| {
            (
                name,
                Space::with_options(&gpu.ctx, layout.clone(), SpaceOptions::default().bind(s))
                    .unwrap(),
            )
        })
        .collect();
        let datasets = [
            spaces[0].1.new_dataset("data").unwrap(),
            spaces[0].1.new_dataset("data").unwrap(),
        ];
        println!(
            "auto resolved {row} to {:?}",
            spaces[2].1.strategy("data").unwrap()
        );
        for (variant, space) in &spaces {
            let head = Head(space.slot("d").unwrap().device_ptr());
            space.bind(&datasets[0]).unwrap();
            let mut flip = 0usize; // persists across calls, so every bind changes the dataset
            group.bench_function(format!("{variant}/{row}"), |b| {
                b.iter_custom(|iters| {
                    let mut total = Duration::ZERO;
                    for _ in 0..iters {
                        flip += 1;
                        gpu.kernels.fill(&gpu.stream, &head, 1.0).unwrap();
                        gpu.stream.synchronize().unwrap();
                        let start = Instant::now();
                        space.bind(&datasets[flip % 2]).unwrap();
                        total += start.elapsed();
                    }
                    rec.record(GROUP, &row, variant, total.as_secs_f64() / iters as f64);
                    total
                })
            });
        }
    }
    group.finish();
    rows
}

const SLOTS: &str = "dataset rebind by slot count (2 MiB slots)";

fn slots(c: &mut Criterion, gpu: &Gpu, rec: &Recorder) -> Vec<String> {
    let gran = granularity(&gpu.ctx, false).unwrap();
    let access = [gpu.ctx.ordinal()];
    let mut rows = Vec::new();
    let mut group = c.benchmark_group(SLOTS);
    for n in [1usize, 4, 16, 64, 256] {
        let row = format!("{n} slots");
        rows.push(row.clone());
        let total_bytes = n * gran;

        // stablebuf: one dataset = one allocation laid out like the slots.
        let mut builder = Layout::builder().group("g");
        for s in 0..n {
            builder = builder.input(format!("s{s}"), gran);
        }
        let space = Space::new(&gpu.ctx, builder.build().unwrap()).unwrap();
        let datasets = [
            space.new_dataset("g").unwrap(),
            space.new_dataset("g").unwrap(),
        ];
        space.bind(&datasets[0]).unwrap();
        let mut flip = 0usize;
        group.bench_function(format!("coalesced/{n}"), |b| {
            b.iter_custom(|iters| {
                let start = Instant::now();
                for _ in 0..iters {
                    flip += 1;
                    space.bind(&datasets[flip % 2]).unwrap();
                }
                let total = start.elapsed();
                rec.record(SLOTS, &row, "coalesced", total.as_secs_f64() / iters as f64);
                total
            })
        });

        // One allocation and one mapping per slot (what a per-tensor allocator does).
        let reservation = Arc::new(Reservation::new(&gpu.ctx, total_bytes, gran).unwrap());
        let per_slot: Vec<Vec<Arc<Physical>>> = (0..2)
            .map(|_| {
                (0..n)
                    .map(|_| Arc::new(Physical::new(&gpu.ctx, gran, false).unwrap()))
                    .collect()
            })
            .collect();
        let mut mapped: Vec<Option<Mapping>> = (0..n)
            .map(|s| {
                Some(
                    Mapping::new(&reservation, s * gran, &per_slot[0][s], 0, gran, &access)
                        .unwrap(),
                )
            })
            .collect();
        let mut flip = 0usize;
        group.bench_function(format!("per-slot/{n}"), |b| {
            b.iter_custom(|iters| {
                let start = Instant::now();
                for _ in 0..iters {
                    flip += 1;
                    gpu.ctx.synchronize().unwrap(); // the same fence a bind pays
                    for (s, slot) in mapped.iter_mut().enumerate() {
                        drop(slot.take());
                        *slot = Some(
                            Mapping::new(
                                &reservation,
                                s * gran,
                                &per_slot[flip % 2][s],
                                0,
                                gran,
                                &access,
                            )
                            .unwrap(),
                        );
                    }
                }
                let total = start.elapsed();
                rec.record(SLOTS, &row, "per-slot", total.as_secs_f64() / iters as f64);
                total
            })
        });
        drop(mapped);

        // The floor: raw unmap + map + set-access of the same bytes as one mapping.
        let whole = [
            Arc::new(Physical::new(&gpu.ctx, total_bytes, false).unwrap()),
            Arc::new(Physical::new(&gpu.ctx, total_bytes, false).unwrap()),
        ];
        let mut mapping =
            Some(Mapping::new(&reservation, 0, &whole[0], 0, total_bytes, &access).unwrap());
        let mut flip = 0usize;
        group.bench_function(format!("driver-floor/{n}"), |b| {
            b.iter_custom(|iters| {
                let start = Instant::now();
                for _ in 0..iters {
                    flip += 1;
                    gpu.ctx.synchronize().unwrap();
                    drop(mapping.take());
                    mapping = Some(
                        Mapping::new(&reservation, 0, &whole[flip % 2], 0, total_bytes, &access)
                            .unwrap(),
                    );
                }
                let total = start.elapsed();
                rec.record(
                    SLOTS,
                    &row,
                    "driver-floor",
                    total.as_secs_f64() / iters as f64,
                );
                total
            })
        });
    }
    group.finish();
    rows
}

fn main() {
    let Some(gpu) = gpu() else { return };
    let model = stablebuf::CostModel::for_device(&gpu.ctx).unwrap();
    println!(
        "calibrated bind cost model: {model:?}; crossover {:?} bytes",
        model.crossover_bytes()
    );
    let rec = Recorder::default();
    let mut c = criterion();
    let rows = rebind_vs_copy(&mut c, &gpu, &rec);
    let slot_rows = slots(&mut c, &gpu, &rec);
    c.final_summary();
    rec.table(
        GROUP,
        &["remap", "copy-in", "auto"],
        &rows,
        "µs",
        1e6,
        &[("copy-in", "remap"), ("auto", "remap"), ("auto", "copy-in")],
    );
    rec.table(
        SLOTS,
        &["coalesced", "per-slot", "driver-floor"],
        &slot_rows,
        "µs",
        1e6,
        &[("coalesced", "driver-floor"), ("per-slot", "coalesced")],
    );
}
