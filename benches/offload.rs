//! Offload and restore speed: the pinned arena and pageable memory, against the floor (a raw
//! `cuMemcpyAsync` between the device and an already pinned buffer of the same size). Same
//! process, same dataset.

mod common;

use std::time::{Duration, Instant};

use common::{criterion, gpu, human_bytes, Recorder};
use stablebuf::{memory_info, HostArena, HostStorage, Layout, Space};

const OFFLOAD: &str = "offload";
const RESTORE: &str = "restore";

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

    for &size in &sizes {
        let row = human_bytes(size);
        let space = Space::new(
            &gpu.ctx,
            Layout::builder()
                .group("g")
                .input("d", size)
                .build()
                .unwrap(),
        )
        .unwrap();
        let mut dataset = space.new_dataset("g").unwrap();
        let mut group = c.benchmark_group("offload + restore");
        group
            .sample_size(10)
            .measurement_time(Duration::from_secs(3));
        for (variant, storage) in [
            ("arena", HostStorage::Pinned(arena.clone())),
            ("pageable", HostStorage::Pageable),
        ] {
            group.bench_function(format!("{variant}/{row}"), |b| {
                b.iter_custom(|iters| {
                    let mut total = Duration::ZERO;
                    for _ in 0..iters {
                        let out = dataset.offload(&storage, &gpu.stream).unwrap();
                        let back = dataset.restore(&gpu.stream).unwrap();
                        rec.record(OFFLOAD, &row, variant, out.elapsed.as_secs_f64());
                        rec.record(RESTORE, &row, variant, back.elapsed.as_secs_f64());
                        total += out.elapsed + back.elapsed;
                    }
                    total
                })
            });
        }
        group.bench_function(format!("floor/{row}"), |b| {
            b.iter_custom(|iters| {
                let mut total = Duration::ZERO;
                let mut view = dataset.view::<u8>("d", &gpu.stream).unwrap();
                for _ in 0..iters {
                    let t = Instant::now();
                    // Exact-size slices: cudarc copies the host side's whole length.
                    let target = &mut floor_host.as_mut_slice().unwrap()[..size];
                    gpu.stream.memcpy_dtoh(&view, target).unwrap();
                    gpu.stream.synchronize().unwrap();
                    let d2h = t.elapsed();
                    let t = Instant::now();
                    let source = &floor_host.as_slice().unwrap()[..size];
                    gpu.stream.memcpy_htod(source, &mut view).unwrap();
                    gpu.stream.synchronize().unwrap();
                    let h2d = t.elapsed();
                    rec.record(OFFLOAD, &row, "floor", d2h.as_secs_f64());
                    rec.record(RESTORE, &row, "floor", h2d.as_secs_f64());
                    total += d2h + h2d;
                }
                total
            })
        });
        group.finish();
    }
    c.final_summary();
    for (what, label) in [
        (OFFLOAD, "offload (device -> host)"),
        (RESTORE, "restore (host -> device)"),
    ] {
        println!("\n== {label}: GB/s (medians), and the ratio to the raw pinned-copy floor");
        println!(
            "{:<8} {:>10} {:>10} {:>10} {:>14} {:>16} {:>12}",
            "size", "arena", "pageable", "floor", "arena/floor", "pageable/floor", "arena ms"
        );
        for &size in &sizes {
            let row = human_bytes(size);
            let gbs = |v: &str| {
                rec.median(what, &row, v)
                    .map(|s| size as f64 / s / 1e9)
                    .unwrap_or(f64::NAN)
            };
            let (a, p, f) = (gbs("arena"), gbs("pageable"), gbs("floor"));
            let ms = rec.median(what, &row, "arena").unwrap_or(f64::NAN) * 1e3;
            println!(
                "{row:<8} {a:>10.1} {p:>10.1} {f:>10.1} {:>13.2}x {:>15.2}x {ms:>12.1}",
                a / f,
                p / f
            );
        }
    }
}
