//! Offload, restore, sleep and wake on a real GPU: bit-exact round trips through every storage,
//! graphs replaying after wake, typed errors while asleep, out-of-memory restores, no leaks.

mod common;

use std::sync::Arc;

use common::{assert_matches, capture_matmul, cpu_matmul, gpu, random_vec, rng, Gpu};
use rand::Rng;
use stablebuf::device::memory_info;
use stablebuf::error::{GraphError, OffloadError};
use stablebuf::host::StorageUsed;
use stablebuf::kernels::MatmulKernel;
use stablebuf::sleep::{offload_tagged, restore_tagged};
use stablebuf::vmm::Physical;
use stablebuf::{Dataset, Error, HostArena, HostStorage, Layout, Space};

const MIB: usize = 1 << 20;

/// Slots whose sizes are not multiples of the granularity (u32 elements).
fn odd_layout() -> Layout {
    Layout::builder()
        .group("g")
        .input("p", 9 * MIB + 12)
        .input("q", 20)
        .output("r", 31 * MIB + 4)
        .build()
        .unwrap()
}

fn fill_random(gpu: &Gpu, d: &Dataset, rng: &mut rand::rngs::StdRng) -> Vec<Vec<u32>> {
    d.slots()
        .to_vec()
        .iter()
        .map(|s| {
            let v: Vec<u32> = (0..s.bytes / 4).map(|_| rng.gen()).collect();
            d.write(&gpu.stream, &s.name, &v).unwrap();
            v
        })
        .collect()
}

fn read_all(gpu: &Gpu, d: &Dataset) -> Vec<Vec<u32>> {
    d.slots()
        .to_vec()
        .iter()
        .map(|s| d.read::<u32>(&gpu.stream, &s.name).unwrap())
        .collect()
}

#[test]
#[ignore = "needs a CUDA GPU"]
fn round_trips_are_bit_exact_through_every_storage() {
    let gpu = gpu();
    let mut rng = rng("round_trip");
    let space = Space::new(&gpu.ctx, odd_layout()).unwrap();
    let big = HostArena::new(&gpu.ctx, 64 * MIB).unwrap();
    let small = HostArena::new(&gpu.ctx, 8 * MIB).unwrap(); // forces chunked staging
    let tiny = HostArena::new(&gpu.ctx, MIB).unwrap(); // too small even to stage
    let cases = [
        (HostStorage::Pinned(big.clone()), StorageUsed::Arena),
        (HostStorage::Pinned(small.clone()), StorageUsed::ArenaStaged),
        (HostStorage::Pinned(tiny.clone()), StorageUsed::ArenaStaged),
        (HostStorage::Pageable, StorageUsed::Pageable),
    ];
    for (storage, expected) in cases {
        let mut d = space.new_dataset("g").unwrap();
        let want = fill_random(&gpu, &d, &mut rng);
        space.bind(&d).unwrap();
        gpu.ctx.synchronize().unwrap();
        stablebuf::release::trim_all(); // memory held for release is not free to the driver
        let (free_before, _) = memory_info(&gpu.ctx).unwrap();
        let report = d.offload(&storage, &gpu.stream).unwrap();
        assert_eq!(report.storage, expected);
        assert!(!d.is_resident());
        assert_eq!(space.bound_dataset("g").unwrap(), None, "offload unbinds");
        stablebuf::release::trim_all(); // memory held for release is not free to the driver
        let (free_after, _) = memory_info(&gpu.ctx).unwrap();
        assert!(
            free_after >= free_before + d.bytes(),
            "{expected:?}: device memory not released"
        );
        assert!(matches!(
            d.read::<u32>(&gpu.stream, "p"),
            Err(Error::Offload(OffloadError::Offloaded { .. }))
        ));
        assert!(matches!(
            space.bind(&d),
            Err(Error::Offload(OffloadError::Offloaded { .. }))
        ));
        d.restore(&gpu.stream).unwrap();
        assert_eq!(
            read_all(&gpu, &d),
            want,
            "{expected:?}: round trip changed the bytes"
        );
        space.bind(&d).unwrap();
        let through_space: Vec<u32> = space.read(&gpu.stream, "r").unwrap();
        assert_eq!(through_space, want[2]);
    }
    for arena in [&big, &small, &tiny] {
        assert_eq!(
            arena.free_bytes(),
            arena.capacity(),
            "every region went back to its arena"
        );
    }

    // Discard: nothing kept; restore runs the refill.
    let mut d = space.new_dataset("g").unwrap();
    fill_random(&gpu, &d, &mut rng);
    d.set_refill(|d, s| d.write(s, "q", &[7u32; 5]));
    let report = d.offload(&HostStorage::Discard, &gpu.stream).unwrap();
    assert_eq!(report.storage, StorageUsed::Discarded);
    d.restore(&gpu.stream).unwrap();
    assert_eq!(d.read::<u32>(&gpu.stream, "q").unwrap(), [7u32; 5]);
}

#[test]
#[ignore = "needs a CUDA GPU"]
fn a_graph_captured_before_sleep_replays_after_wake_on_the_same_contents() {
    let gpu = gpu();
    let mut rng = rng("sleep_wake");
    let (m, n, k) = (256, 320, 192);
    let layout = Layout::builder()
        .group("weights")
        .input("b", k * n * 4)
        .group("batch")
        .input("a", m * k * 4)
        .scratch("c", m * n * 4)
        .build()
        .unwrap();
    let space = Space::new(&gpu.ctx, layout).unwrap();
    let (a, b) = (random_vec(&mut rng, m * k), random_vec(&mut rng, k * n));
    let mut weights = space.new_dataset("weights").unwrap();
    let mut batch = space.new_dataset("batch").unwrap();
    weights.write(&gpu.stream, "b", &b).unwrap();
    batch.write(&gpu.stream, "a", &a).unwrap();
    space.bind(&weights).unwrap();
    space.bind(&batch).unwrap();
    let graph = capture_matmul(
        &space,
        &gpu.stream,
        &gpu.kernels,
        MatmulKernel::Auto,
        (m, n, k),
    );
    graph.replay().unwrap();
    let before: Vec<f32> = space.read(&gpu.stream, "c").unwrap();
    assert_matches(&before, &cpu_matmul(&a, &b, m, n, k), k, "before sleep");

    let arena = HostArena::new(&gpu.ctx, 64 * MIB).unwrap();
    stablebuf::release::trim_all(); // memory held for release is not free to the driver
    let (free_awake, _) = memory_info(&gpu.ctx).unwrap();
    let reports = space
        .sleep(
            [&mut weights, &mut batch],
            &HostStorage::Pinned(arena),
            &gpu.stream,
        )
        .unwrap();
    assert_eq!(reports.len(), 2);
    assert!(space.is_asleep());
    stablebuf::release::trim_all(); // memory held for release is not free to the driver
    let (free_asleep, _) = memory_info(&gpu.ctx).unwrap();
    assert!(
        free_asleep >= free_awake + weights.bytes() + batch.bytes(),
        "sleep released the datasets and scratch"
    );
    assert!(matches!(
        graph.replay(),
        Err(Error::Graph(GraphError::Asleep))
    ));
    assert!(matches!(
        space.read::<f32>(&gpu.stream, "c"),
        Err(Error::Graph(GraphError::Asleep))
    ));

    space.wake([&mut weights, &mut batch], &gpu.stream).unwrap();
    assert!(!space.is_asleep());
    gpu.kernels
        .fill(&gpu.stream, space.slot("c").unwrap(), f32::NAN)
        .unwrap();
    graph.replay().unwrap();
    let after: Vec<f32> = space.read(&gpu.stream, "c").unwrap();
    assert_eq!(
        after.iter().map(|v| v.to_bits()).collect::<Vec<_>>(),
        before.iter().map(|v| v.to_bits()).collect::<Vec<_>>(),
        "bit for bit"
    );
}

#[test]
#[ignore = "needs a CUDA GPU"]
fn replay_while_offloaded_is_a_typed_error_and_works_after_restore() {
    let gpu = gpu();
    let mut rng = rng("replay_offloaded");
    let (m, n, k) = (64, 64, 64);
    let layout = Layout::builder()
        .group("in")
        .input("a", m * k * 4)
        .input("b", k * n * 4)
        .scratch("c", m * n * 4)
        .build()
        .unwrap();
    let space = Space::new(&gpu.ctx, layout).unwrap();
    let (a, b) = (random_vec(&mut rng, m * k), random_vec(&mut rng, k * n));
    let mut d = space.new_dataset("in").unwrap();
    d.write(&gpu.stream, "a", &a).unwrap();
    d.write(&gpu.stream, "b", &b).unwrap();
    space.bind(&d).unwrap();
    let graph = capture_matmul(
        &space,
        &gpu.stream,
        &gpu.kernels,
        MatmulKernel::Auto,
        (m, n, k),
    );
    d.offload(&HostStorage::Pageable, &gpu.stream).unwrap();
    assert!(matches!(
        graph.replay(),
        Err(Error::Graph(GraphError::Unbound { .. }))
    ));
    d.restore(&gpu.stream).unwrap();
    space.bind(&d).unwrap();
    gpu.kernels
        .fill(&gpu.stream, space.slot("c").unwrap(), f32::NAN)
        .unwrap();
    graph.replay().unwrap();
    assert_matches(
        &space.read(&gpu.stream, "c").unwrap(),
        &cpu_matmul(&a, &b, m, n, k),
        k,
        "after restore",
    );
}

#[test]
#[ignore = "needs a CUDA GPU"]
fn a_restore_under_out_of_memory_keeps_the_host_copy_and_succeeds_later() {
    let gpu = gpu();
    let mut rng = rng("restore_oom");
    let layout = Layout::builder()
        .group("g")
        .input("x", 512 * MIB)
        .build()
        .unwrap();
    let space = Space::new(&gpu.ctx, layout).unwrap();
    let mut d = space.new_dataset("g").unwrap();
    let want: Vec<u32> = (0..512 * MIB / 4).map(|_| rng.gen()).collect();
    d.write(&gpu.stream, "x", &want).unwrap();
    d.offload(&HostStorage::Pageable, &gpu.stream).unwrap();

    // Fill the device: 1 GiB pieces, then 64 MiB pieces, until the driver says no.
    let mut hog: Vec<Physical> = Vec::new();
    for piece in [1 << 30, 64 * MIB] {
        loop {
            match Physical::new(&gpu.ctx, piece, false) {
                Ok(p) => hog.push(p),
                Err(e) => {
                    assert!(e.is_out_of_memory(), "{e}");
                    break;
                }
            }
        }
    }
    match d.restore(&gpu.stream) {
        Err(Error::Offload(OffloadError::RestoreOutOfMemory { asked, free, .. })) => {
            assert_eq!(asked, d.bytes());
            assert!(free < asked, "free {free}");
        }
        other => panic!("expected RestoreOutOfMemory, got {other:?}"),
    }
    assert!(!d.is_resident(), "the host copy is kept");
    drop(hog);
    d.restore(&gpu.stream).unwrap();
    assert_eq!(d.read::<u32>(&gpu.stream, "x").unwrap(), want);
}

#[test]
#[ignore = "needs a CUDA GPU"]
fn tagged_groups_offload_and_restore_together() {
    let gpu = gpu();
    let mut rng = rng("tagged");
    let space = Space::new(&gpu.ctx, odd_layout()).unwrap();
    let mut sets: Vec<(Dataset, Vec<Vec<u32>>)> = (0..3)
        .map(|i| {
            let mut d = space.new_dataset("g").unwrap();
            d.set_tag(if i < 2 { "weights" } else { "kv" });
            let v = fill_random(&gpu, &d, &mut rng);
            (d, v)
        })
        .collect();
    let arena = HostArena::new(&gpu.ctx, 256 * MIB).unwrap();
    let reports = offload_tagged(
        sets.iter_mut().map(|(d, _)| d),
        "weights",
        &HostStorage::Pinned(arena.clone()),
        &gpu.stream,
    )
    .unwrap();
    assert_eq!(reports.len(), 2);
    assert_eq!(
        sets.iter()
            .map(|(d, _)| d.is_resident())
            .collect::<Vec<_>>(),
        [false, false, true]
    );
    restore_tagged(sets.iter_mut().map(|(d, _)| d), "weights", &gpu.stream).unwrap();
    for (d, want) in &sets {
        assert_eq!(&read_all(&gpu, d), want);
    }
    assert_eq!(arena.free_bytes(), arena.capacity());
}

#[test]
#[ignore = "needs a CUDA GPU"]
fn a_hundred_sleep_wake_cycles_leak_neither_device_nor_pinned_memory() {
    let gpu = gpu();
    let mut rng = rng("cycles");
    let layout = Layout::builder()
        .group("w")
        .input("w", 8 * MIB + 100)
        .scratch("s", 3 * MIB)
        .build()
        .unwrap();
    let space = Space::new(&gpu.ctx, layout).unwrap();
    let mut d = space.new_dataset("w").unwrap();
    let want: Vec<u32> = (0..(8 * MIB + 100) / 4).map(|_| rng.gen()).collect();
    d.write(&gpu.stream, "w", &want).unwrap();
    space.bind(&d).unwrap();
    let arena = HostArena::new(&gpu.ctx, 32 * MIB).unwrap();
    let storage = HostStorage::Pinned(arena.clone());
    // One cycle first, so lazily created driver resources are not counted as leaks.
    space.sleep([&mut d], &storage, &gpu.stream).unwrap();
    space.wake([&mut d], &gpu.stream).unwrap();
    gpu.ctx.synchronize().unwrap();
    stablebuf::release::trim_all(); // memory held for release is not free to the driver
    let (baseline, _) = memory_info(&gpu.ctx).unwrap();
    for cycle in 0..100 {
        space.sleep([&mut d], &storage, &gpu.stream).unwrap();
        space.wake([&mut d], &gpu.stream).unwrap();
        if cycle % 25 == 0 {
            assert_eq!(
                space.read::<u32>(&gpu.stream, "w").unwrap(),
                want,
                "cycle {cycle}"
            );
        }
    }
    gpu.ctx.synchronize().unwrap();
    stablebuf::release::trim_all(); // memory held for release is not free to the driver
    let (after, _) = memory_info(&gpu.ctx).unwrap();
    eprintln!("free device memory: baseline {baseline}, after 100 cycles {after}");
    assert!(
        baseline.saturating_sub(after) <= 2 * MIB,
        "lost {} bytes",
        baseline - after
    );
    assert_eq!(
        arena.free_bytes(),
        arena.capacity(),
        "pinned arena fully returned"
    );
    assert_eq!(Arc::strong_count(&arena), 2, "no offload holds the arena");
}

/// Slots that cross the 64 MiB staging chunks at odd offsets (u32 elements).
fn multi_chunk_layout() -> Layout {
    Layout::builder()
        .group("g")
        .input("a", 150 * MIB + 12)
        .input("b", 20)
        .output("c", 31 * MIB + 4)
        .build()
        .unwrap()
}

#[test]
#[ignore = "needs a CUDA GPU"]
fn pageable_transfers_stream_through_staging_and_restore_keeps_the_home_address() {
    let gpu = gpu();
    let mut rng = rng("pageable_staged");
    let space = Space::new(&gpu.ctx, multi_chunk_layout()).unwrap();
    let arena = HostArena::new(&gpu.ctx, 16 * MIB).unwrap(); // staged through its halves
    for storage in [HostStorage::Pageable, HostStorage::Pinned(arena.clone())] {
        let mut d = space.new_dataset("g").unwrap();
        let want = fill_random(&gpu, &d, &mut rng);
        let home = d.home_ptr().unwrap();
        space.bind(&d).unwrap();
        gpu.ctx.synchronize().unwrap();
        stablebuf::release::trim_all(); // memory held for release is not free to the driver
        let (free_before, _) = memory_info(&gpu.ctx).unwrap();
        let out = d.offload(&storage, &gpu.stream).unwrap();
        stablebuf::release::trim_all(); // memory held for release is not free to the driver
        let (free_after, _) = memory_info(&gpu.ctx).unwrap();
        assert!(
            free_after >= free_before + d.bytes(),
            "{storage:?}: the memory was released although the home address is kept"
        );
        let back = d.restore(&gpu.stream).unwrap();
        eprintln!(
            "{:?}: offload {:.1} GB/s, restore {:.1} GB/s",
            out.storage,
            out.gb_per_s(),
            back.gb_per_s()
        );
        assert_eq!(
            d.home_ptr().unwrap(),
            home,
            "restore maps at the same home address"
        );
        assert_eq!(read_all(&gpu, &d), want, "{:?}: bytes changed", out.storage);
        space.bind(&d).unwrap();
        assert_eq!(space.read::<u32>(&gpu.stream, "c").unwrap(), want[2]);
    }
    assert_eq!(arena.free_bytes(), arena.capacity());
}

#[test]
#[ignore = "needs a CUDA GPU"]
fn pageable_offloads_from_several_threads_at_once_are_each_bit_exact() {
    let gpu = gpu();
    let mut rng = rng("pageable_threads");
    let space = Space::new(&gpu.ctx, multi_chunk_layout()).unwrap();
    // Four at once: the process staging buffer serves one; the others copy directly.
    let mut sets: Vec<(Dataset, Vec<Vec<u32>>)> = (0..4)
        .map(|_| {
            let d = space.new_dataset("g").unwrap();
            let want = fill_random(&gpu, &d, &mut rng);
            (d, want)
        })
        .collect();
    gpu.ctx.synchronize().unwrap();
    std::thread::scope(|scope| {
        for (d, _) in sets.iter_mut() {
            let ctx = gpu.ctx.clone();
            scope.spawn(move || {
                let stream = ctx.new_stream().unwrap();
                for _ in 0..3 {
                    let out = d.offload(&HostStorage::Pageable, &stream).unwrap();
                    assert_eq!(out.storage, StorageUsed::Pageable);
                    d.restore(&stream).unwrap();
                }
            });
        }
    });
    for (i, (d, want)) in sets.iter().enumerate() {
        assert_eq!(&read_all(&gpu, d), want, "dataset {i}");
    }
}
