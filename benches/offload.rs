//! Offload and restore speed: the pinned arena and pageable memory, against the floor (a raw
//! `cuMemcpyAsync` between the device and an already pinned buffer of the same size). Same
//! process, same dataset, variants in paired rounds.
//!
//! Restore is timed two ways: right after the offload (as a loop that sleeps and wakes at once
//! does), and after the device has settled (a real sleep lasts longer than the driver takes to
//! scrub the memory the offload released). A profile of the driver calls of one restore shows
//! what each costs.

mod common;

use std::time::{Duration, Instant};

use common::{
    call_micros, criterion, gpu, human_bytes, print_profile, profile, seconds, verdict, Gpu,
    Recorder, Variants,
};
use stablebuf::cudarc::driver::PinnedHostSlice;
use stablebuf::device::memory_info;
use stablebuf::{Dataset, HostArena, HostStorage, Layout, Space};

const OFFLOAD: &str = "offload (device -> host)";
const RESTORE: &str = "restore (host -> device)";
/// Targets of issue 14, for the sizes it names.
const TARGET_SIZES: [usize; 2] = [1 << 30, 8 << 30];
const RESTORE_VS_FLOOR: f64 = 0.97;
const PAGEABLE_GB_S: f64 = 10.0;

/// Waits until the device is idle and the driver has had time to finish what the offload left
/// (scrubbing released memory), then spins briefly so the host is awake for the timed part.
fn settle(gpu: &Gpu, bytes: usize) {
    gpu.ctx.synchronize().unwrap();
    std::thread::sleep(
        Duration::from_millis(20) + Duration::from_millis(10) * (bytes >> 30) as u32,
    );
    let start = Instant::now();
    while start.elapsed() < Duration::from_millis(2) {
        std::hint::spin_loop();
    }
}

/// A kernel writes the whole dataset, as the work before a sleep would, and the GPU finishes.
fn touch(gpu: &Gpu, dataset: &Dataset) {
    let view = dataset.view::<f32>("d", &gpu.stream).unwrap();
    gpu.kernels.fill(&gpu.stream, &view, 1.0).unwrap();
    gpu.stream.synchronize().unwrap();
}

/// Offload then restore, timed separately; `settled` waits between the two.
fn cycle(gpu: &Gpu, dataset: &mut Dataset, storage: &HostStorage, settled: bool) -> (f64, f64) {
    touch(gpu, dataset);
    let out = dataset.offload(storage, &gpu.stream).unwrap();
    if settled {
        settle(gpu, dataset.bytes());
    }
    let back = dataset.restore(&gpu.stream).unwrap();
    (out.elapsed.as_secs_f64(), back.elapsed.as_secs_f64())
}

/// The floor: a raw copy of the dataset's bytes to the pinned buffer and back.
fn floor(gpu: &Gpu, dataset: &Dataset, host: &mut PinnedHostSlice<u8>, size: usize) -> (f64, f64) {
    touch(gpu, dataset);
    let mut view = dataset.view::<u8>("d", &gpu.stream).unwrap();
    let d2h = seconds(|| {
        // Exact-size slices: cudarc copies the host side's whole length.
        let target = &mut host.as_mut_slice().unwrap()[..size];
        gpu.stream.memcpy_dtoh(&view, target).unwrap();
        gpu.stream.synchronize().unwrap();
    });
    let h2d = seconds(|| {
        let source = &host.as_slice().unwrap()[..size];
        gpu.stream.memcpy_htod(source, &mut view).unwrap();
        gpu.stream.synchronize().unwrap();
    });
    (d2h, h2d)
}

fn main() {
    let Some(gpu) = gpu() else { return };
    let rec = Recorder::default();
    let mut c = criterion();
    let (free, _) = memory_info(&gpu.ctx).unwrap();
    let sizes: Vec<usize> = [192 << 20, 1 << 30, 8 << 30]
        .into_iter()
        .filter(|&s| s * 2 < free)
        .collect();
    let largest = *sizes.last().unwrap();
    let start = Instant::now();
    let arena = HostArena::new(&gpu.ctx, largest).unwrap();
    // SAFETY: the buffer is only ever written by device-to-host copies before it is read.
    let mut floor_host = unsafe { gpu.ctx.alloc_pinned::<u8>(largest) }.unwrap();
    println!(
        "pinned {} of arena and {} for the floor once, in {:.1} s",
        human_bytes(largest),
        human_bytes(largest),
        start.elapsed().as_secs_f64()
    );
    let pinned = HostStorage::Pinned(arena.clone());
    let mut rows = Vec::new();
    let mut datasets = Vec::new();
    for &size in &sizes {
        let row = human_bytes(size);
        rows.push(row.clone());
        let space = Space::new(
            &gpu.ctx,
            Layout::builder()
                .group("g")
                .input("d", size)
                .build()
                .unwrap(),
        )
        .unwrap();
        let dataset = std::cell::RefCell::new(space.new_dataset("g").unwrap());
        let host = std::cell::RefCell::new(&mut floor_host);
        let mut group = c.benchmark_group("offload + restore");
        group
            .sample_size(10)
            .sampling_mode(criterion::SamplingMode::Flat)
            .warm_up_time(Duration::from_millis(100))
            .measurement_time(Duration::from_secs(3));
        let both = |(out, back): (f64, f64)| vec![(OFFLOAD, out), (RESTORE, back)];
        Variants::new(OFFLOAD)
            .add_timed("arena", || {
                both(cycle(&gpu, &mut dataset.borrow_mut(), &pinned, false))
            })
            .add_timed("arena, settled", || {
                let (_, back) = cycle(&gpu, &mut dataset.borrow_mut(), &pinned, true);
                vec![(RESTORE, back)]
            })
            .add_timed("pageable", || {
                both(cycle(
                    &gpu,
                    &mut dataset.borrow_mut(),
                    &HostStorage::Pageable,
                    false,
                ))
            })
            .add_timed("floor", || {
                both(floor(&gpu, &dataset.borrow(), &mut host.borrow_mut(), size))
            })
            .bench(&mut group, &rec, &row);
        group.finish();
        datasets.push((size, space, dataset.into_inner()));
    }
    c.final_summary();

    let gb_s = |what: &str, row: &str, variant: &str, size: usize| {
        rec.median(what, row, variant)
            .map_or(f64::NAN, |s| size as f64 / s / 1e9)
    };
    for what in [OFFLOAD, RESTORE] {
        println!("\n== {what}: GB/s (medians), and speed / floor speed (median of per-round ratios [p10-p90])");
        let variants: &[&str] = if what == RESTORE {
            &["arena", "arena, settled", "pageable", "floor"]
        } else {
            &["arena", "pageable", "floor"]
        };
        let mut header = format!("{:<8}", "size");
        for v in variants {
            header += &format!(" {v:>15}");
        }
        for v in variants.iter().filter(|v| **v != "floor") {
            header += &format!(" {:>26}", format!("{v}/floor"));
        }
        println!("{header}");
        for (&size, row) in sizes.iter().zip(&rows) {
            let mut line = format!("{row:<8}");
            for v in variants {
                line += &format!(" {:>15.1}", gb_s(what, row, v, size));
            }
            for v in variants.iter().filter(|v| **v != "floor") {
                // Speed over floor speed = floor time over variant time.
                let ratio = common::Ratio::of("floor", v);
                let spread = rec.ratio(what, row, &ratio);
                line += &format!(" {:>26}", spread.map_or("-".into(), |s| s.to_string()));
            }
            println!("{line}");
        }
    }

    // What a restore costs, call by call, right after an offload and after the device settled.
    println!("\n== one restore, driver call by call (µs; the copy is the stream sync)");
    for (size, _space, dataset) in &mut datasets {
        for settled in [false, true] {
            dataset.offload(&pinned, &gpu.stream).unwrap();
            if settled {
                settle(&gpu, *size);
            }
            let (report, calls) = profile(|| dataset.restore(&gpu.stream).unwrap());
            let label = format!(
                "{} {}: {:.2} ms in all",
                human_bytes(*size),
                if settled {
                    "settled"
                } else {
                    "right after offload"
                },
                report.elapsed.as_secs_f64() * 1e3
            );
            print_profile(&label, &calls);
            let (_, create) = call_micros(&calls, "cuMemCreate");
            let (_, map) = call_micros(&calls, "cuMemMap");
            let (_, access) = call_micros(&calls, "cuMemSetAccess");
            let (_, copy) = call_micros(&calls, "cuStreamSynchronize");
            println!(
                "    create {create:.0} + map {map:.0} + set-access {access:.0} µs before the copy ({copy:.0} µs)"
            );
        }
    }

    println!("\n== targets (issue 14, section 2)");
    for &size in &TARGET_SIZES {
        let row = human_bytes(size);
        if !sizes.contains(&size) {
            println!("{row}: not measured (the device has too little free memory)");
            continue;
        }
        for variant in ["arena", "arena, settled"] {
            let ratio = rec
                .ratio(RESTORE, &row, &common::Ratio::of("floor", variant))
                .map_or(f64::NAN, |s| s.median);
            println!(
                "{row}: restore through the arena ({variant}) at {ratio:.3}x the floor (target >= {RESTORE_VS_FLOOR}): {}",
                verdict(ratio >= RESTORE_VS_FLOOR)
            );
        }
        let (out, back) = (
            gb_s(OFFLOAD, &row, "pageable", size),
            gb_s(RESTORE, &row, "pageable", size),
        );
        println!(
            "{row}: pageable offload {out:.1} GB/s, restore {back:.1} GB/s (target >= {PAGEABLE_GB_S} each way): {}",
            verdict(out >= PAGEABLE_GB_S && back >= PAGEABLE_GB_S)
        );
    }
}
