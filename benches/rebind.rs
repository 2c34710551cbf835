//! Rebinding vs copying, and coalesced datasets vs one mapping per slot vs the raw driver floor.
//! Every comparison runs in paired rounds in one process (`common::Variants`); the tables at the
//! end give medians and the median of per-round ratios with their p10–p90 spread.
//!
//! Every timed bind is warm, the way a loop uses memory: a kernel writes the whole bound range
//! just before it (outside the timed part), and the time includes the fence a bind pays.

mod common;

use std::sync::Arc;
use std::time::Duration;

use common::{criterion, gpu, human_bytes, seconds, verdict, Gpu, Ratio, Recorder, Variants};
use criterion::{Criterion, SamplingMode};
use stablebuf::cudarc::driver::sys;
use stablebuf::device::memory_info;
use stablebuf::vmm::{granularity, Mapping, Physical, Reservation};
use stablebuf::{BindStrategy, DeviceBuffer, Layout, Space, SpaceOptions};

/// A device range given to a kernel to touch before a timed bind.
struct Range(u64, usize);

impl DeviceBuffer for Range {
    fn device_address(&self) -> sys::CUdeviceptr {
        self.0
    }
    fn byte_len(&self) -> usize {
        self.1
    }
}

/// A kernel writes all of `range`, and the GPU finishes, before the timed part starts.
fn touch(gpu: &Gpu, range: &Range) {
    gpu.kernels.fill(&gpu.stream, range, 1.0).unwrap();
    gpu.stream.synchronize().unwrap();
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
    group
        .sample_size(10)
        .sampling_mode(SamplingMode::Flat)
        .warm_up_time(Duration::from_millis(100))
        .measurement_time(Duration::from_millis(1500));
    for &size in &sizes {
        let row = human_bytes(size);
        rows.push(row.clone());
        let layout = Layout::builder()
            .group("data")
            .input("d", size)
            .build()
            .unwrap();
        let space = |strategy| {
            Space::with_options(
                &gpu.ctx,
                layout.clone(),
                SpaceOptions::default().bind(strategy),
            )
            .unwrap()
        };
        let spaces = [
            ("remap", space(BindStrategy::Remap)),
            ("copy-in", space(BindStrategy::CopyIn)),
            ("auto", space(BindStrategy::Auto)),
        ];
        let datasets = [
            spaces[0].1.new_dataset("data").unwrap(),
            spaces[0].1.new_dataset("data").unwrap(),
        ];
        println!(
            "auto resolved {row} to {:?}",
            spaces[2].1.strategy("data").unwrap()
        );
        let mut variants = Variants::new(GROUP);
        for (name, space) in &spaces {
            let range = Range(space.slot("d").unwrap().device_ptr(), size);
            space.bind(&datasets[0]).unwrap();
            let mut flip = 0usize; // every bind changes the dataset
            let datasets = &datasets;
            variants = variants.add(name, move || {
                flip += 1;
                touch(gpu, &range);
                seconds(|| space.bind(&datasets[flip % 2]).unwrap())
            });
        }
        variants.bench(&mut group, rec, &row);
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
    group
        .sample_size(10)
        .sampling_mode(SamplingMode::Flat)
        .warm_up_time(Duration::from_millis(100))
        .measurement_time(Duration::from_secs(1));
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
        let coalesced_range = Range(space.slot("s0").unwrap().device_ptr(), total_bytes);

        // One allocation and one mapping per slot (what a per-tensor allocator does).
        let per_slot_va = Arc::new(Reservation::new(&gpu.ctx, total_bytes, gran).unwrap());
        let per_slot: Vec<Vec<Arc<Physical>>> = (0..2)
            .map(|_| {
                (0..n)
                    .map(|_| Arc::new(Physical::new(&gpu.ctx, gran, false).unwrap()))
                    .collect()
            })
            .collect();
        let mut per_slot_mapped: Vec<Option<Mapping>> = (0..n)
            .map(|s| {
                let m = Mapping::new(&per_slot_va, s * gran, &per_slot[0][s], 0, gran, &access);
                Some(m.unwrap())
            })
            .collect();
        let per_slot_range = Range(per_slot_va.base(), total_bytes);

        // The floor: raw unmap + map + set-access of the same bytes as one mapping.
        let floor_va = Arc::new(Reservation::new(&gpu.ctx, total_bytes, gran).unwrap());
        let whole = [
            Arc::new(Physical::new(&gpu.ctx, total_bytes, false).unwrap()),
            Arc::new(Physical::new(&gpu.ctx, total_bytes, false).unwrap()),
        ];
        let mut floor_mapping =
            Some(Mapping::new(&floor_va, 0, &whole[0], 0, total_bytes, &access).unwrap());
        let floor_range = Range(floor_va.base(), total_bytes);

        let (mut flip_c, mut flip_p, mut flip_f) = (0usize, 0usize, 0usize);
        Variants::new(SLOTS)
            .add("coalesced", || {
                flip_c += 1;
                touch(gpu, &coalesced_range);
                seconds(|| space.bind(&datasets[flip_c % 2]).unwrap())
            })
            .add("per-slot", || {
                flip_p += 1;
                touch(gpu, &per_slot_range);
                seconds(|| {
                    gpu.ctx.synchronize().unwrap(); // the same fence a bind pays
                    for (s, slot) in per_slot_mapped.iter_mut().enumerate() {
                        drop(slot.take());
                        let physical = &per_slot[flip_p % 2][s];
                        let m = Mapping::new(&per_slot_va, s * gran, physical, 0, gran, &access);
                        *slot = Some(m.unwrap());
                    }
                })
            })
            .add("driver-floor", || {
                flip_f += 1;
                touch(gpu, &floor_range);
                seconds(|| {
                    gpu.ctx.synchronize().unwrap();
                    drop(floor_mapping.take());
                    let physical = &whole[flip_f % 2];
                    let m = Mapping::new(&floor_va, 0, physical, 0, total_bytes, &access);
                    floor_mapping = Some(m.unwrap());
                })
            })
            .bench(&mut group, rec, &row);
    }
    group.finish();
    rows
}

const MANY: &str = "many-slot group bind, 1 GiB, each slot touched by its own kernel";

/// A group of `n` slots (1 GiB in all, at least a granule each) bound right after one kernel per
/// slot wrote it, against the driver floor warmed by the same kernels over the same pieces: the
/// case decode-shaped weight groups (hundreds of tensors) are in.
fn many_slots(c: &mut Criterion, gpu: &Gpu, rec: &Recorder) -> Vec<String> {
    let gran = granularity(&gpu.ctx, false).unwrap();
    let access = [gpu.ctx.ordinal()];
    let mut rows = Vec::new();
    let mut group = c.benchmark_group(MANY);
    group
        .sample_size(10)
        .sampling_mode(SamplingMode::Flat)
        .warm_up_time(Duration::from_millis(100))
        .measurement_time(Duration::from_secs(1));
    for n in [1usize, 16, 64, 256, 1024] {
        let row = format!("{n} slots");
        rows.push(row.clone());
        let per_slot = ((1usize << 30) / n).max(gran);
        let total_bytes = per_slot * n;
        let mut builder = Layout::builder().group("g");
        for s in 0..n {
            builder = builder.input(format!("s{s}"), per_slot);
        }
        let space = Space::new(&gpu.ctx, builder.build().unwrap()).unwrap();
        let datasets = [
            space.new_dataset("g").unwrap(),
            space.new_dataset("g").unwrap(),
        ];
        space.bind(&datasets[0]).unwrap();
        let slot_ranges: Vec<Range> = space
            .slots()
            .iter()
            .map(|s| Range(s.device_ptr(), s.bytes()))
            .collect();
        let floor_va = Arc::new(Reservation::new(&gpu.ctx, total_bytes, gran).unwrap());
        let whole = [
            Arc::new(Physical::new(&gpu.ctx, total_bytes, false).unwrap()),
            Arc::new(Physical::new(&gpu.ctx, total_bytes, false).unwrap()),
        ];
        let mut floor_mapping =
            Some(Mapping::new(&floor_va, 0, &whole[0], 0, total_bytes, &access).unwrap());
        let floor_ranges: Vec<Range> = (0..n)
            .map(|s| Range(floor_va.base() + (s * per_slot) as u64, per_slot))
            .collect();
        let touch_each = |ranges: &[Range]| {
            for r in ranges {
                gpu.kernels.fill(&gpu.stream, r, 1.0).unwrap();
            }
            gpu.stream.synchronize().unwrap();
        };
        let (mut flip_b, mut flip_f) = (0usize, 0usize);
        Variants::new(MANY)
            .add("bind", || {
                flip_b += 1;
                touch_each(&slot_ranges);
                seconds(|| space.bind(&datasets[flip_b % 2]).unwrap())
            })
            .add("driver-floor", || {
                flip_f += 1;
                touch_each(&floor_ranges);
                seconds(|| {
                    gpu.ctx.synchronize().unwrap(); // the same fence a bind pays
                    drop(floor_mapping.take());
                    let physical = &whole[flip_f % 2];
                    let m = Mapping::new(&floor_va, 0, physical, 0, total_bytes, &access);
                    floor_mapping = Some(m.unwrap());
                })
            })
            .bench(&mut group, rec, &row);
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
    let many_rows = many_slots(&mut c, &gpu, &rec);
    c.final_summary();
    rec.paired_table(
        GROUP,
        &["remap", "copy-in", "auto"],
        &rows,
        "µs",
        1e6,
        &[
            Ratio::of("copy-in", "remap"),
            Ratio::to_best("auto", &["remap", "copy-in"]),
        ],
    );
    rec.paired_table(
        SLOTS,
        &["coalesced", "per-slot", "driver-floor"],
        &slot_rows,
        "µs",
        1e6,
        &[
            Ratio::of("coalesced", "driver-floor"),
            Ratio::of("per-slot", "coalesced"),
        ],
    );

    rec.paired_table(
        MANY,
        &["bind", "driver-floor"],
        &many_rows,
        "µs",
        1e6,
        &[Ratio::of("bind", "driver-floor")],
    );

    println!("\n== targets");
    let auto_worst = rows
        .iter()
        .filter_map(|r| rec.ratio(GROUP, r, &Ratio::to_best("auto", &["remap", "copy-in"])))
        .map(|s| s.median)
        .fold(0.0, f64::max);
    println!(
        "auto within 1.1x of the better of remap and copy-in at every size (worst {auto_worst:.2}x): {}",
        verdict(auto_worst <= 1.1)
    );
    let floor: Vec<f64> = slot_rows
        .iter()
        .filter_map(|r| rec.ratio(SLOTS, r, &Ratio::of("coalesced", "driver-floor")))
        .map(|s| s.median)
        .collect();
    let (low, high) = floor
        .iter()
        .fold((f64::MAX, 0.0f64), |(lo, hi), &v| (lo.min(v), hi.max(v)));
    let many_worst = many_rows
        .iter()
        .filter_map(|r| rec.ratio(MANY, r, &Ratio::of("bind", "driver-floor")))
        .map(|s| s.median)
        .fold(0.0, f64::max);
    println!(
        "a many-slot bind (one kernel per slot before it) within 1.1x of the warm driver floor at 1-1024 slots (worst {many_worst:.2}x): {}",
        verdict(many_worst <= 1.1)
    );
    println!(
        "coalesced/driver-floor holds still across slot counts (medians {low:.2}x-{high:.2}x, within 0.8-1.25x): {}",
        verdict(!floor.is_empty() && low >= 0.8 && high <= 1.25)
    );
}
