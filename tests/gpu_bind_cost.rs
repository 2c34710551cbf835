//! A bind of a many-slot group costs what the raw driver costs for the same bytes, whatever the
//! slot count and whatever touched the slots before: side by side in one process, in
//! interleaved rounds, against a floor warmed the same way (reserve once; per round: the same
//! kernels over the same pieces, the GPU finished, then unmap + map + set-access of the range).
//! Prints the table with the driver-call split of one profiled bind per row, and fails above
//! 1.5× the floor (the target is 1.1×; the margin absorbs a noisy machine).

mod common;
// The driver-call profiler the examples use (its `summary` is theirs).
#[allow(dead_code)]
#[path = "../examples/support/calls.rs"]
mod calls;

use std::sync::Arc;

use calls::profile;
use common::{gpu, Gpu};
use stablebuf::cudarc::driver::sys;
use stablebuf::vmm::{granularity, Mapping, Physical, Reservation};
use stablebuf::{Dataset, DeviceBuffer, Layout, Space, StableGraph};

const MIB: usize = 1 << 20;
const ROUNDS: usize = 31;

#[derive(Clone, Copy)]
struct Range(u64, usize);

impl DeviceBuffer for Range {
    fn device_address(&self) -> sys::CUdeviceptr {
        self.0
    }
    fn byte_len(&self) -> usize {
        self.1
    }
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Touch {
    /// One fill kernel per slot, launched one by one.
    KernelPerSlot,
    /// One graph whose nodes fill every slot, replayed.
    OneGraph,
}

fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(f64::total_cmp);
    v[v.len() / 2]
}

/// A space whose group "w" is `slots` slots of `per_slot` bytes, with two datasets, the first
/// bound; and the slots' ranges.
fn many_slot_space(g: &Gpu, slots: usize, per_slot: usize) -> (Space, [Dataset; 2], Vec<Range>) {
    let mut builder = Layout::builder().group("w");
    for s in 0..slots {
        builder = builder.input(format!("s{s}"), per_slot);
    }
    let space = Space::new(&g.ctx, builder.build().unwrap()).unwrap();
    let sets = [
        space.new_dataset("w").unwrap(),
        space.new_dataset("w").unwrap(),
    ];
    space.bind(&sets[0]).unwrap();
    let pieces = space
        .slots()
        .iter()
        .map(|s| Range(s.device_ptr(), s.bytes()))
        .collect();
    (space, sets, pieces)
}

/// The raw driver's floor for `total` bytes: one reservation and two physical allocations to
/// swap under it, the first mapped.
fn floor_backing(
    g: &Gpu,
    total: usize,
    gran: usize,
) -> (Arc<Reservation>, [Arc<Physical>; 2], Mapping) {
    let reservation = Arc::new(Reservation::new(&g.ctx, total, gran).unwrap());
    let physical = [
        Arc::new(Physical::new(&g.ctx, total, false).unwrap()),
        Arc::new(Physical::new(&g.ctx, total, false).unwrap()),
    ];
    let mapping =
        Mapping::new(&reservation, 0, &physical[0], 0, total, &[g.ctx.ordinal()]).unwrap();
    (reservation, physical, mapping)
}

#[test]
#[ignore = "needs a CUDA GPU"]
fn a_many_slot_bind_costs_what_the_driver_costs_for_the_same_bytes() {
    let g = gpu();
    let gran = granularity(&g.ctx, false).unwrap();
    let mut rows = Vec::new();
    let mut worst = 0f64;
    for slots in [1usize, 16, 64, 256, 1024] {
        let per_slot = ((1 << 30) / slots).max(gran);
        let total = per_slot * slots;
        let (space, sets, space_pieces) = many_slot_space(&g, slots, per_slot);
        // The floor: the same bytes, one reservation, two physical allocations swapped.
        let (reservation, physical, mapping) = floor_backing(&g, total, gran);
        let mut floor_mapping = Some(mapping);
        let floor_pieces: Vec<Range> = (0..slots)
            .map(|s| Range(reservation.base() + (s * per_slot) as u64, per_slot))
            .collect();
        let graph_over = |pieces: &[Range]| {
            let (k, pieces) = (g.kernels.clone(), pieces.to_vec());
            StableGraph::capture(&g.stream, &[&space], move |s| {
                pieces.iter().try_for_each(|p| k.fill(s, p, 1.5))
            })
            .unwrap()
        };
        let space_graph = graph_over(&space_pieces);
        let floor_graph = graph_over(&floor_pieces);
        for touch in [Touch::KernelPerSlot, Touch::OneGraph] {
            let warm = |pieces: &[Range], graph: &StableGraph| {
                match touch {
                    Touch::KernelPerSlot => {
                        for p in pieces {
                            g.kernels.fill(&g.stream, p, 2.5).unwrap();
                        }
                    }
                    Touch::OneGraph => graph.replay_on(&g.stream).unwrap(),
                }
                g.stream.synchronize().unwrap();
            };
            let (mut lib, mut floor, mut ratios) = (Vec::new(), Vec::new(), Vec::new());
            for round in 0..ROUNDS + 2 {
                warm(&space_pieces, &space_graph);
                let start = std::time::Instant::now();
                space.bind(&sets[(round + 1) % 2]).unwrap();
                let lib_us = start.elapsed().as_secs_f64() * 1e6;
                warm(&floor_pieces, &floor_graph);
                let start = std::time::Instant::now();
                g.ctx.synchronize().unwrap(); // what the library's default fence does
                drop(floor_mapping.take()); // cuMemUnmap
                floor_mapping = Some(
                    Mapping::new(
                        &reservation,
                        0,
                        &physical[(round + 1) % 2],
                        0,
                        total,
                        &[g.ctx.ordinal()],
                    )
                    .unwrap(),
                );
                let floor_us = start.elapsed().as_secs_f64() * 1e6;
                if round >= 2 {
                    lib.push(lib_us);
                    floor.push(floor_us);
                    ratios.push(lib_us / floor_us);
                }
            }
            // One profiled bind: where the time goes.
            warm(&space_pieces, &space_graph);
            let (_, calls) = profile(|| space.bind(&sets[0]).unwrap());
            // The median of per-round ratios: each round's two binds ran back to back, so
            // drifts of the machine cancel.
            let (lib_m, floor_m, ratio) = (median(lib), median(floor), median(ratios));
            worst = worst.max(ratio);
            rows.push(format!(
                "{slots:>5} slots x {:>5} MiB {touch:<14?} bind {lib_m:>8.1} us  floor {floor_m:>8.1} us  {ratio:>5.2}x   [{}]",
                per_slot / MIB,
                calls
                    .iter()
                    .map(|(c, n, us)| format!("{c} x{n} {us:.0}"))
                    .collect::<Vec<_>>()
                    .join(", ")
            ));
        }
    }
    println!("many-slot bind vs driver floor ({ROUNDS} interleaved rounds; medians, and the median per-round ratio):");
    for row in &rows {
        println!("  {row}");
    }
    println!(
        "many-slot bind: worst {worst:.2}x the floor (target <= 1.1x): {}",
        if worst <= 1.1 { "met" } else { "NOT met" }
    );
    assert!(
        worst <= 1.5,
        "a many-slot bind cost {worst:.2}x the driver floor"
    );
}

/// Issue 31's first row: a bind right after a large space was dropped. A group of 64 slots ×
/// 16 MiB is bound back and forth, each bind followed by the raw driver's remap of the same
/// bytes (interleaved, warmed the same way), in three phases of one process:
///   quiet     nothing dropped yet (the second floor: the same bind in a quiet process);
///   library   right after a space with two 16 GiB datasets (less on a smaller device), bound
///             and written, was dropped;
///   raw       right after the same 32 GiB was created, mapped, written and released through
///             the raw driver (what the driver alone does after such a release).
/// Prints every phase's first binds and medians with the driver-call split of the first
/// binds, and fails if, right after the drop, the library's bind costs more than 1.5× the
/// raw remap measured beside it (the library's own release path competing with the bind).
#[test]
#[ignore = "needs a CUDA GPU"]
fn a_bind_right_after_a_large_space_is_dropped_costs_what_the_driver_costs_then() {
    const SLOTS: usize = 64;
    const SLOT: usize = 16 * MIB;
    const AFTER: usize = 50;
    let g = gpu();
    let gran = granularity(&g.ctx, false).unwrap();
    let (free, _) = g.ctx.mem_get_info().unwrap();
    // Two datasets of 16 GiB each, smaller where the device has less room (never skipped).
    let room = free.saturating_sub(8 * SLOTS * SLOT) / 2 / gran * gran;
    let big = room.min(16 << 30);
    assert!(
        big >= 1 << 30,
        "{} GiB free: too little for two 1 GiB datasets beside the slots",
        free >> 30
    );
    let gib = big as f64 / (1u64 << 30) as f64;
    let total = SLOTS * SLOT;
    let (space, sets, pieces) = many_slot_space(&g, SLOTS, SLOT);
    let (reservation, physical, mapping) = floor_backing(&g, total, gran);
    let mut floor_mapping = Some(mapping);
    let floor_piece = Range(reservation.base(), total);
    let mut flip = 0usize;
    // One interleaved round: the library's bind, then the raw remap; µs of each (and the
    // driver calls of the bind when `profiled`).
    let mut round = |profiled: bool| {
        flip += 1;
        for p in &pieces {
            g.kernels.fill(&g.stream, p, 2.5).unwrap();
        }
        g.stream.synchronize().unwrap();
        let start = std::time::Instant::now();
        let calls = if profiled {
            profile(|| space.bind(&sets[flip % 2]).unwrap()).1
        } else {
            space.bind(&sets[flip % 2]).unwrap();
            Vec::new()
        };
        let lib_us = start.elapsed().as_secs_f64() * 1e6;
        g.kernels.fill(&g.stream, &floor_piece, 2.5).unwrap();
        g.stream.synchronize().unwrap();
        let start = std::time::Instant::now();
        g.ctx.synchronize().unwrap();
        drop(floor_mapping.take());
        floor_mapping = Some(
            Mapping::new(
                &reservation,
                0,
                &physical[flip % 2],
                0,
                total,
                &[g.ctx.ordinal()],
            )
            .unwrap(),
        );
        (lib_us, start.elapsed().as_secs_f64() * 1e6, calls)
    };
    let mut phase = |name: &str, rounds: usize, warmup: usize| {
        let mut trace = Vec::new();
        for i in 0..warmup + rounds {
            let (lib, floor, calls) = round(i == warmup || i == warmup + 1);
            if i >= warmup {
                trace.push((lib, floor, calls));
            }
        }
        let lib: Vec<f64> = trace.iter().map(|t| t.0).collect();
        let floor: Vec<f64> = trace.iter().map(|t| t.1).collect();
        let first: Vec<String> = trace
            .iter()
            .take(12)
            .map(|t| format!("{:.0}/{:.0}", t.0, t.1))
            .collect();
        println!(
            "  {name:<8} bind median {:>7.1} us (first 10: {:>7.1})  raw remap median {:>7.1} us (first 10: {:>7.1})",
            median(lib.clone()),
            median(lib[..10].to_vec()),
            median(floor.clone()),
            median(floor[..10].to_vec())
        );
        println!("           first binds / remaps, us: {}", first.join(" "));
        for (n, t) in trace.iter().take(2).enumerate() {
            let calls: Vec<String> =
                t.2.iter()
                    .map(|(c, k, us)| format!("{c} x{k} {us:.0}"))
                    .collect();
            println!("           bind {n} calls: [{}]", calls.join(", "));
        }
        let ratios: Vec<f64> = trace.iter().map(|t| t.0 / t.1).collect();
        (
            median(lib.clone()),
            median(lib[..10].to_vec()),
            median(ratios[..10].to_vec()),
        )
    };
    println!(
        "bind of {SLOTS} slots x {} MiB after a large release (interleaved with the raw remap):",
        SLOT / MIB
    );
    let (quiet, _, _) = phase("quiet", 21, 2);

    // A server drops a model: a space with two large datasets, bound in turn and written.
    {
        let big = Space::new(
            &g.ctx,
            Layout::builder()
                .group("m")
                .input("weights", big)
                .build()
                .unwrap(),
        )
        .unwrap();
        let models = [big.new_dataset("m").unwrap(), big.new_dataset("m").unwrap()];
        for m in &models {
            big.bind(m).unwrap();
            let slot = &big.slots()[0];
            g.kernels
                .fill(&g.stream, &Range(slot.device_ptr(), slot.bytes()), 0.5)
                .unwrap();
            g.stream.synchronize().unwrap();
        }
        let start = std::time::Instant::now();
        drop(models);
        drop(big);
        println!(
            "  dropping the 2 x {gib:.0} GiB space took {:.1} ms",
            start.elapsed().as_secs_f64() * 1e3
        );
    }
    let (_, lib_first, lib_ratio) = phase("library", AFTER, 0);

    std::thread::sleep(std::time::Duration::from_secs(3));
    {
        let start = std::time::Instant::now();
        let ranges: Vec<_> = (0..2)
            .map(|_| {
                let r = Arc::new(Reservation::new(&g.ctx, big, gran).unwrap());
                let p = Arc::new(Physical::new(&g.ctx, big, false).unwrap());
                let m = Mapping::new(&r, 0, &p, 0, big, &[g.ctx.ordinal()]).unwrap();
                g.kernels
                    .fill(&g.stream, &Range(r.base(), big), 0.5)
                    .unwrap();
                g.stream.synchronize().unwrap();
                (m, p, r)
            })
            .collect();
        let made = start.elapsed();
        let start = std::time::Instant::now();
        drop(ranges);
        println!(
            "  raw: creating, mapping and writing 2 x {gib:.0} GiB took {:.1} ms, releasing it {:.1} ms",
            made.as_secs_f64() * 1e3,
            start.elapsed().as_secs_f64() * 1e3
        );
    }
    let (_, raw_first, raw_ratio) = phase("raw", AFTER, 0);
    println!(
        "bind after a drop: first 10 binds {:.2}x the quiet bind, {lib_ratio:.2}x the raw remap beside them; after a raw release {:.2}x the quiet bind, {raw_ratio:.2}x the raw remap (target <= 1.1x both)",
        lib_first / quiet,
        raw_first / quiet
    );
    assert!(
        lib_ratio <= 1.5,
        "right after a space was dropped the bind cost {lib_ratio:.2}x the raw remap beside it"
    );
}

/// The server-life events of issue 43's rows, each done by the library and, as the floor
/// "the raw driver doing the same sequence", by raw driver calls.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum LifeEvent {
    /// A space with two large datasets, bound and written, dropped.
    DropLarge,
    /// The same, then the process idles until nothing is held for release (the background
    /// release ran, in pieces), then the binds: does the piecewise release avoid the driver's
    /// slow phase, or only move it?
    DropThenIdle,
    /// The same memory released by another thread while the binds run.
    ConcurrentRelease,
    /// Another space (one dataset) sleeps (`HostStorage::Discard`: no copies) and wakes.
    SleepWake,
    /// A pool's cache of 64 MiB blocks drained.
    PoolDrain,
    /// A pool block grown in place by `mid` bytes.
    Grow,
    /// A 1000-node graph over the bound slots (over the raw range, for the floor) replayed.
    Graph1000,
}

/// What an event leaves alive until its row is measured (the memory the event made, a thread
/// still releasing).
struct Aftermath {
    _keep: Box<dyn std::any::Any>,
    thread: Option<std::thread::JoinHandle<()>>,
}

impl Aftermath {
    fn keep(keep: impl std::any::Any) -> Self {
        Self {
            _keep: Box::new(keep),
            thread: None,
        }
    }
}

/// A space with two `big`-byte datasets, each bound and written.
fn large_space(g: &Gpu, big: usize) -> (Space, [Dataset; 2]) {
    let space = Space::new(
        &g.ctx,
        Layout::builder()
            .group("m")
            .input("weights", big)
            .build()
            .unwrap(),
    )
    .unwrap();
    let models = [
        space.new_dataset("m").unwrap(),
        space.new_dataset("m").unwrap(),
    ];
    for m in &models {
        space.bind(m).unwrap();
        let slot = &space.slots()[0];
        g.kernels
            .fill(&g.stream, &Range(slot.device_ptr(), slot.bytes()), 0.5)
            .unwrap();
        g.stream.synchronize().unwrap();
    }
    (space, models)
}

type RawRange = (Mapping, Arc<Physical>, Arc<Reservation>);

/// `count` raw allocations of `bytes`, each mapped at a reservation of its own and written.
fn raw_ranges(g: &Gpu, count: usize, bytes: usize, gran: usize) -> Vec<RawRange> {
    (0..count)
        .map(|_| {
            let r = Arc::new(Reservation::new(&g.ctx, bytes, gran).unwrap());
            let p = Arc::new(Physical::new(&g.ctx, bytes, false).unwrap());
            let m = Mapping::new(&r, 0, &p, 0, bytes, &[g.ctx.ordinal()]).unwrap();
            g.kernels
                .fill(&g.stream, &Range(r.base(), bytes), 0.5)
                .unwrap();
            g.stream.synchronize().unwrap();
            (m, p, r)
        })
        .collect()
}

/// Issue 43's rows: a bind of 64 slots × 16 MiB through a server's life. For each event
/// ([`LifeEvent`]) and each release mode (background, the new default, and immediate, the old
/// behaviour), in one process:
///   quiet     the bind with nothing happening, measured right before the row (floor 2);
///   library   the library does the event, then the binds, each followed by the raw remap of
///             the same bytes (interleaved, warmed the same way: "remap beside");
///   raw       after a pause, the raw driver does the same sequence, then the same rounds (floor 1).
/// Prints per row the first 10 binds' median against both floors, the remap beside, the event's
/// own time, the release queue's counters and the driver-call split of the first bind; fails
/// only where the library's bind costs more than 1.5× the raw remap beside it in background
/// mode (the library's own release competing with the bind). The target is 1.1× both floors.
#[test]
#[ignore = "needs a CUDA GPU"]
fn binds_through_a_servers_life_cost_what_the_driver_costs_then() {
    use stablebuf::release::{self, ReleaseMode, ReleasePolicy};
    use stablebuf::{ElasticPool, HostStorage, PoolOptions};
    use std::time::{Duration, Instant};

    const SLOTS: usize = 64;
    const SLOT: usize = 16 * MIB;
    const AFTER: usize = 30;
    const QUIET: usize = 21;
    const CHUNK: usize = 64 * MIB;
    let g = gpu();
    let gran = granularity(&g.ctx, false).unwrap();
    let (free, _) = g.ctx.mem_get_info().unwrap();
    // Two datasets of 16 GiB each, smaller where the device has less room (never skipped);
    // `mid` for the sleep, the drain and the grow.
    let room = free.saturating_sub(8 * SLOTS * SLOT) / 2 / gran * gran;
    let big = room.min(16 << 30);
    assert!(
        big >= 1 << 30,
        "{} GiB free: too little for two 1 GiB datasets beside the slots",
        free >> 30
    );
    let mid = (big / 4).min(4 << 30) / CHUNK * CHUNK;
    // Diagnosis knobs (unset: every row, the default policy, 100 ms): STABLEBUF_BIND_ROWS
    // names the rows (`DropThenIdle,Grow`), STABLEBUF_BIND_PIECES_MIB the background pieces
    // to try (`64,256,all`), STABLEBUF_BIND_IDLE_WAIT_MS the wait after the idle release.
    let only: Option<Vec<String>> = std::env::var("STABLEBUF_BIND_ROWS")
        .ok()
        .map(|v| v.split(',').map(|s| s.trim().to_string()).collect());
    let piece_sizes: Vec<usize> = std::env::var("STABLEBUF_BIND_PIECES_MIB")
        .ok()
        .map(|v| {
            v.split(',')
                .map(|s| match s.trim() {
                    "all" => usize::MAX,
                    n => {
                        n.parse::<usize>()
                            .expect("STABLEBUF_BIND_PIECES_MIB: MiB or `all`")
                            * MIB
                    }
                })
                .collect()
        })
        .unwrap_or_else(|| vec![ReleasePolicy::default().piece_bytes]);
    // STABLEBUF_BIND_REPEAT: rounds of each row (default 1); with more, the worst is taken
    // over each row's median (one sample is noise at the 1.1x level on a busy host).
    let repeats: usize = std::env::var("STABLEBUF_BIND_REPEAT")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(1)
        .max(1);
    let idle_wait = Duration::from_millis(
        std::env::var("STABLEBUF_BIND_IDLE_WAIT_MS")
            .ok()
            .and_then(|v| v.parse().ok())
            .unwrap_or(100),
    );
    let total = SLOTS * SLOT;
    let (space, sets, pieces) = many_slot_space(&g, SLOTS, SLOT);
    let (reservation, physical, mapping) = floor_backing(&g, total, gran);
    let mut floor_mapping = Some(mapping);
    let floor_piece = Range(reservation.base(), total);
    let floor_pieces: Vec<Range> = (0..SLOTS)
        .map(|s| Range(reservation.base() + (s * SLOT) as u64, SLOT))
        .collect();
    let mut flip = 0usize;
    // One interleaved round: the library's bind, then the raw remap; µs of each, and the
    // driver calls of the bind when `profiled`.
    let mut round = |profiled: bool| {
        flip += 1;
        for p in &pieces {
            g.kernels.fill(&g.stream, p, 2.5).unwrap();
        }
        g.stream.synchronize().unwrap();
        let start = Instant::now();
        let calls = if profiled {
            let (_, calls) = profile(|| space.bind(&sets[flip % 2]).unwrap());
            calls
                .iter()
                .map(|(c, k, us)| format!("{c} x{k} {us:.0}"))
                .collect::<Vec<_>>()
                .join(", ")
        } else {
            space.bind(&sets[flip % 2]).unwrap();
            String::new()
        };
        let lib_us = start.elapsed().as_secs_f64() * 1e6;
        g.kernels.fill(&g.stream, &floor_piece, 2.5).unwrap();
        g.stream.synchronize().unwrap();
        let start = Instant::now();
        g.ctx.synchronize().unwrap();
        drop(floor_mapping.take());
        floor_mapping = Some(
            Mapping::new(
                &reservation,
                0,
                &physical[flip % 2],
                0,
                total,
                &[g.ctx.ordinal()],
            )
            .unwrap(),
        );
        (lib_us, start.elapsed().as_secs_f64() * 1e6, calls)
    };
    // `rounds` rounds: (median of the first 10 binds, median bind, median of the first 10
    // per-round bind/remap ratios, the first bind's driver calls).
    let mut phase = |rounds: usize| {
        let trace: Vec<_> = (0..rounds).map(|i| round(i == 0)).collect();
        let lib: Vec<f64> = trace.iter().map(|t| t.0).collect();
        let ratios: Vec<f64> = trace.iter().map(|t| t.0 / t.1).collect();
        (
            median(lib[..10].to_vec()),
            median(lib),
            median(ratios[..10].to_vec()),
            trace[0].2.clone(),
        )
    };
    // The events' setup (not timed) and the event itself (timed), by the library or raw.
    let library_event = |event: LifeEvent| -> Aftermath {
        match event {
            LifeEvent::DropLarge | LifeEvent::DropThenIdle => {
                let made = large_space(&g, big);
                drop(made);
                if event == LifeEvent::DropThenIdle {
                    let start = Instant::now();
                    while release::held_bytes(g.ctx.ordinal()) > 0
                        && start.elapsed() < Duration::from_secs(60)
                    {
                        std::thread::sleep(Duration::from_millis(5));
                    }
                    std::thread::sleep(idle_wait);
                }
                Aftermath::keep(())
            }
            LifeEvent::ConcurrentRelease => {
                let made = large_space(&g, big);
                let thread = std::thread::spawn(move || {
                    drop(made);
                    release::trim_all();
                });
                Aftermath {
                    _keep: Box::new(()),
                    thread: Some(thread),
                }
            }
            LifeEvent::SleepWake => {
                let other = Space::new(
                    &g.ctx,
                    Layout::builder()
                        .group("o")
                        .input("x", mid)
                        .build()
                        .unwrap(),
                )
                .unwrap();
                let mut dataset = other.new_dataset("o").unwrap();
                other.bind(&dataset).unwrap();
                other
                    .sleep([&mut dataset], &HostStorage::Discard, &g.stream)
                    .unwrap();
                other.wake([&mut dataset], &g.stream).unwrap();
                g.stream.synchronize().unwrap();
                Aftermath::keep((other, dataset))
            }
            LifeEvent::PoolDrain => {
                let pool = ElasticPool::new(&g.ctx, PoolOptions::default()).unwrap();
                let tenant = pool.register("t", 2 * mid).unwrap();
                let blocks: Vec<_> = (0..mid / CHUNK)
                    .map(|_| tenant.alloc(CHUNK).unwrap())
                    .collect();
                drop(blocks);
                pool.settle();
                pool.drain();
                Aftermath::keep((tenant, pool))
            }
            LifeEvent::Grow => {
                let pool = ElasticPool::new(&g.ctx, PoolOptions::default()).unwrap();
                let tenant = pool.register("t", 2 * mid + CHUNK).unwrap();
                let mut block = tenant.alloc_growable(CHUNK, mid + CHUNK).unwrap();
                block.grow(mid + CHUNK).unwrap();
                Aftermath::keep((block, tenant, pool))
            }
            LifeEvent::Graph1000 => {
                let (k, pieces) = (g.kernels.clone(), pieces.clone());
                let graph = StableGraph::capture(&g.stream, &[&space], move |s| {
                    (0..1000).try_for_each(|i| k.fill(s, &pieces[i % pieces.len()], 1.5))
                })
                .unwrap();
                graph.replay_on(&g.stream).unwrap();
                g.stream.synchronize().unwrap();
                Aftermath::keep(graph)
            }
        }
    };
    let raw_event = |event: LifeEvent| -> Aftermath {
        match event {
            LifeEvent::DropLarge | LifeEvent::DropThenIdle => {
                drop(raw_ranges(&g, 2, big, gran));
                if event == LifeEvent::DropThenIdle {
                    std::thread::sleep(idle_wait);
                }
                Aftermath::keep(())
            }
            LifeEvent::ConcurrentRelease => {
                let made = raw_ranges(&g, 2, big, gran);
                let thread = std::thread::spawn(move || drop(made));
                Aftermath {
                    _keep: Box::new(()),
                    thread: Some(thread),
                }
            }
            LifeEvent::SleepWake => {
                let r = Arc::new(Reservation::new(&g.ctx, mid, gran).unwrap());
                let p = Arc::new(Physical::new(&g.ctx, mid, false).unwrap());
                let m = Mapping::new(&r, 0, &p, 0, mid, &[g.ctx.ordinal()]).unwrap();
                drop((m, p));
                let p = Arc::new(Physical::new(&g.ctx, mid, false).unwrap());
                let m = Mapping::new(&r, 0, &p, 0, mid, &[g.ctx.ordinal()]).unwrap();
                Aftermath::keep((m, p, r))
            }
            LifeEvent::PoolDrain => {
                let r = Arc::new(Reservation::new(&g.ctx, mid, gran).unwrap());
                let chunks: Vec<Arc<Physical>> = (0..mid / CHUNK)
                    .map(|_| Arc::new(Physical::new(&g.ctx, CHUNK, false).unwrap()))
                    .collect();
                let maps = Mapping::new_many(&r, 0, &chunks, &[g.ctx.ordinal()]).unwrap();
                drop(maps);
                drop(chunks);
                Aftermath::keep(r)
            }
            LifeEvent::Grow => {
                let r = Arc::new(Reservation::new(&g.ctx, mid + CHUNK, gran).unwrap());
                let first = Arc::new(Physical::new(&g.ctx, CHUNK, false).unwrap());
                let m0 = Mapping::new(&r, 0, &first, 0, CHUNK, &[g.ctx.ordinal()]).unwrap();
                let more = Arc::new(Physical::new(&g.ctx, mid, false).unwrap());
                let m1 = Mapping::new(&r, CHUNK, &more, 0, mid, &[g.ctx.ordinal()]).unwrap();
                Aftermath::keep((m1, m0, more, first, r))
            }
            LifeEvent::Graph1000 => {
                let (k, pieces) = (g.kernels.clone(), floor_pieces.clone());
                let graph = StableGraph::capture(&g.stream, &[], move |s| {
                    (0..1000).try_for_each(|i| k.fill(s, &pieces[i % pieces.len()], 1.5))
                })
                .unwrap();
                graph.replay_on(&g.stream).unwrap();
                g.stream.synchronize().unwrap();
                Aftermath::keep(graph)
            }
        }
    };
    let events = [
        LifeEvent::DropLarge,
        LifeEvent::DropThenIdle,
        LifeEvent::ConcurrentRelease,
        LifeEvent::SleepWake,
        LifeEvent::PoolDrain,
        LifeEvent::Grow,
        LifeEvent::Graph1000,
    ];
    let mut rows = Vec::new();
    let mut worst_beside = 0f64;
    // Per row: the library's bind over its floor, the quiet bind, or where the driver itself
    // is slower after the same event, the raw driver's bind after it (the issue's "or show,
    // with the raw driver's own numbers in the same run, why a row cannot be").
    let mut worst_floor = 0f64;
    println!(
        "issue 43 rows: bind of {SLOTS} slots x {} MiB through a server's life (big {:.1} GiB, mid {:.1} GiB; first 10 binds after the event)",
        SLOT / MIB,
        big as f64 / (1u64 << 30) as f64,
        mid as f64 / (1u64 << 30) as f64
    );
    let runs: Vec<(ReleaseMode, usize)> = piece_sizes
        .iter()
        .map(|&piece| (ReleaseMode::Background, piece))
        .chain([(ReleaseMode::Immediate, ReleasePolicy::default().piece_bytes)])
        .collect();
    for event in events {
        if only
            .as_ref()
            .is_some_and(|names| !names.contains(&format!("{event:?}")))
        {
            continue;
        }
        for &(mode, piece_bytes) in &runs {
            release::set_policy(ReleasePolicy {
                mode,
                piece_bytes,
                ..ReleasePolicy::default()
            });
            let piece_label = match (mode, piece_bytes) {
                (ReleaseMode::Background, usize::MAX) => " pieces all".to_string(),
                (ReleaseMode::Background, p) if p != ReleasePolicy::default().piece_bytes => {
                    format!(" pieces {} MiB", p / MIB)
                }
                _ => String::new(),
            };
            // Per round: library x quiet, library x remap beside, library x raw sequence.
            let mut rounds: Vec<[f64; 3]> = Vec::new();
            for _ in 0..repeats {
                release::trim_all();
                std::thread::sleep(Duration::from_secs(2));
                let (_, quiet, _, _) = phase(QUIET);
                let stats_before = release::stats(g.ctx.ordinal());
                let start = Instant::now();
                let aftermath = library_event(event);
                let lib_event_ms = start.elapsed().as_secs_f64() * 1e3;
                let (lib_first, _, lib_beside, lib_calls) = phase(AFTER);
                if let Some(thread) = aftermath.thread {
                    thread.join().unwrap();
                }
                drop(aftermath._keep);
                let stats = release::stats(g.ctx.ordinal());
                release::trim_all();
                std::thread::sleep(Duration::from_secs(3));
                let start = Instant::now();
                let aftermath = raw_event(event);
                let raw_event_ms = start.elapsed().as_secs_f64() * 1e3;
                let (raw_first, _, raw_beside, raw_calls) = phase(AFTER);
                if let Some(thread) = aftermath.thread {
                    thread.join().unwrap();
                }
                drop(aftermath._keep);
                rounds.push([lib_first / quiet, lib_beside, lib_first / raw_first]);
                rows.push(format!(
                "{event:<17?} {mode:<10?}{piece_label} quiet {quiet:>6.1} us | library {lib_first:>7.1} us = {:>5.2}x quiet, {lib_beside:>5.2}x remap beside, {:>5.2}x the raw sequence | raw sequence {raw_first:>7.1} us = {:>5.2}x quiet, {raw_beside:>5.2}x remap beside | event: library {lib_event_ms:.1} ms, raw {raw_event_ms:.1} ms | queue: held {} MiB, +{} reused, +{} pieces, +{} released ({} background), +{} retries\n      first bind calls: library [{lib_calls}]\n                        raw     [{raw_calls}]",
                lib_first / quiet,
                lib_first / raw_first,
                raw_first / quiet,
                stats.held_bytes / MIB,
                stats.reused.saturating_sub(stats_before.reused),
                stats.pieces.saturating_sub(stats_before.pieces),
                stats.releases.saturating_sub(stats_before.releases),
                stats.background_pieces.saturating_sub(stats_before.background_pieces),
                stats.retries.saturating_sub(stats_before.retries),
            ));
                println!("  {}", rows.last().unwrap());
            }
            let mid = |i: usize| median(rounds.iter().map(|r| r[i]).collect());
            if repeats > 1 {
                println!(
                    "  {event:<17?} {mode:<10?}{piece_label} median of {repeats}: library {:.2}x quiet, {:.2}x remap beside, {:.2}x the raw sequence",
                    mid(0),
                    mid(1),
                    mid(2)
                );
            }
            if mode == ReleaseMode::Background {
                worst_beside = worst_beside.max(mid(1));
                worst_floor = worst_floor.max(mid(0).min(mid(2)));
            }
        }
    }
    release::set_policy(ReleasePolicy::default());
    println!(
        "issue 43 rows: worst library bind {worst_beside:.2}x the remap beside it in background mode (reported: it sets a many-slot bind against one raw remap, and the raw sequence's own bind sits at 1.2x there after a sleep or a grow)"
    );
    println!(
        "issue 43 rows: worst library bind {worst_floor:.2}x its floor in background mode (the quiet bind, or the raw driver's bind after the same event where that is slower; medians over the rounds; target <= 1.1x)"
    );
    assert!(
        worst_beside <= 1.5,
        "a bind through a server's life cost {worst_beside:.2}x the raw remap beside it"
    );
}
