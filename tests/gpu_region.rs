//! Regions on a real GPU: side-by-side allocations, sleep and wake through a pinned arena with
//! one mapping for the whole span, snapshots bound under a captured graph, the replay guard,
//! typed errors that keep state, and no leaks over many cycles.

mod common;

use common::{gpu, rng, Gpu};
use rand::Rng;
use stablebuf::buffer::LinearBuffer;
use stablebuf::cudarc::driver::sys::CUdeviceptr;
use stablebuf::device::memory_info;
use stablebuf::error::{GraphError, OffloadError, RegionError};
use stablebuf::host::StorageUsed;
use stablebuf::region::{Region, RegionOptions};
use stablebuf::{DeviceBuffer, Error, HostArena, HostStorage, StableGraph};

const MIB: usize = 1 << 20;

/// A region allocation as a kernel argument.
struct Range {
    ptr: CUdeviceptr,
    bytes: usize,
}

impl DeviceBuffer for Range {
    fn device_address(&self) -> CUdeviceptr {
        self.ptr
    }
    fn byte_len(&self) -> usize {
        self.bytes
    }
}

fn random_words(rng: &mut rand::rngs::StdRng, bytes: usize) -> Vec<u32> {
    (0..bytes / 4).map(|_| rng.gen()).collect()
}

fn read(gpu: &Gpu, region: &Region, address: u64, bytes: usize) -> Vec<u32> {
    let mut out = vec![0xdead_beef_u32; bytes / 4];
    region.read_into(&gpu.stream, address, &mut out).unwrap();
    out
}

/// Sizes that are not granule multiples, so rounding and the tails are exercised.
const SIZES: [usize; 5] = [3 * MIB + 4, 64, 17 * MIB, 2 * MIB, 9 * MIB + 1028];

#[test]
#[ignore = "needs a CUDA GPU"]
fn allocations_sit_side_by_side_and_sleep_wake_round_trips_are_bit_exact() {
    let gpu = gpu();
    let mut rng = rng("region_round_trip");
    let region = Region::new(&gpu.ctx, "weights", RegionOptions::default()).unwrap();
    let g = region.granularity();
    let mut at = region.base();
    let mut allocations = Vec::new();
    for bytes in SIZES {
        let address = region.alloc(bytes).unwrap();
        assert_eq!(address, at, "side by side from the low end");
        at += bytes.div_ceil(g) as u64 * g as u64;
        let data = random_words(&mut rng, bytes);
        region.write(&gpu.stream, address, &data).unwrap();
        allocations.push((address, bytes, data));
    }
    let stats = region.stats();
    assert_eq!(
        stats.mappings,
        SIZES.len(),
        "one chunk per allocation before the first wake"
    );
    assert_eq!(stats.span as u64, at - region.base());
    let arena = HostArena::new(&gpu.ctx, 64 * MIB).unwrap();
    for (round, storage) in [
        HostStorage::Pinned(arena.clone()),
        HostStorage::Pageable,
        HostStorage::Pinned(HostArena::new(&gpu.ctx, 4 * MIB).unwrap()), // staged
    ]
    .into_iter()
    .enumerate()
    {
        gpu.ctx.synchronize().unwrap();
        stablebuf::release::trim_all(); // memory held for release is not free to the driver
        let (free_before, _) = memory_info(&gpu.ctx).unwrap();
        let mapped = region.stats().mapped;
        let report = region.sleep(&storage, &gpu.stream).unwrap();
        assert_eq!(
            report.bytes, stats.allocated,
            "round {round}: every live byte saved"
        );
        stablebuf::release::trim_all(); // memory held for release is not free to the driver
        let (free_asleep, _) = memory_info(&gpu.ctx).unwrap();
        assert!(
            free_asleep >= free_before + mapped,
            "round {round}: memory released"
        );
        assert!(region.is_asleep());
        assert!(matches!(
            region.check_replayable(),
            Err(Error::Region(RegionError::RegionAsleep { .. }))
        ));
        assert!(matches!(
            region.alloc(MIB),
            Err(Error::Region(RegionError::RegionAsleep { .. }))
        ));
        region.wake(&gpu.stream).unwrap();
        assert_eq!(
            region.stats().mappings,
            1,
            "round {round}: one mapping after wake"
        );
        for (address, bytes, data) in &allocations {
            assert_eq!(
                &read(&gpu, &region, *address, *bytes),
                data,
                "round {round}"
            );
        }
    }
    assert_eq!(
        region
            .sleep(&HostStorage::Pinned(arena), &gpu.stream)
            .unwrap()
            .storage,
        StorageUsed::Arena
    );
    assert_eq!(
        region
            .sleep(&HostStorage::Pageable, &gpu.stream)
            .unwrap()
            .bytes,
        0,
        "no-op"
    );
    region.wake(&gpu.stream).unwrap();
    assert_eq!(
        region.wake(&gpu.stream).unwrap().bytes,
        0,
        "wake is idempotent"
    );
}

#[test]
#[ignore = "needs a CUDA GPU"]
fn allocations_inside_the_woken_span_need_no_new_memory_and_frees_while_asleep_are_dropped() {
    let gpu = gpu();
    let mut rng = rng("region_holes");
    let region = Region::new(&gpu.ctx, "kv", RegionOptions::default()).unwrap();
    let a = region.alloc(8 * MIB).unwrap();
    let b = region.alloc(8 * MIB).unwrap();
    let c = region.alloc(8 * MIB).unwrap();
    let data_c = random_words(&mut rng, 8 * MIB);
    region.write(&gpu.stream, c, &data_c).unwrap();
    region.sleep(&HostStorage::Pageable, &gpu.stream).unwrap();
    assert_eq!(region.free(b).unwrap(), 8 * MIB, "free while asleep");
    assert_eq!(
        region.stats().host_bytes,
        16 * MIB,
        "b is no longer restored"
    );
    region.wake(&gpu.stream).unwrap();
    assert_eq!(read(&gpu, &region, c, 8 * MIB), data_c);
    gpu.ctx.synchronize().unwrap();
    stablebuf::release::trim_all(); // memory held for release is not free to the driver
    let (free_before, _) = memory_info(&gpu.ctx).unwrap();
    let b2 = region.alloc(4 * MIB).unwrap();
    assert_eq!(b2, b, "the hole inside the span is reused");
    assert_eq!(region.stats().mappings, 1, "no new mapping");
    stablebuf::release::trim_all(); // memory held for release is not free to the driver
    let (free_after, _) = memory_info(&gpu.ctx).unwrap();
    assert_eq!(free_after, free_before, "no new memory");
    region.free(a).unwrap();
    assert!(matches!(
        region.free(a),
        Err(Error::Region(RegionError::UnknownAllocation { .. }))
    ));
    assert!(matches!(
        region.free(c + 4),
        Err(Error::Region(RegionError::UnknownAllocation { .. }))
    ));
    assert_eq!(
        read(&gpu, &region, c, 8 * MIB),
        data_c,
        "errors changed nothing"
    );
}

/// The shortest form of the sequence behind the "wrong data after sleep, snapshot and wake"
/// seed (1795667492865211295): a snapshot taken while a shorter allocation sat at an offset,
/// that allocation freed, a longer one made in the same granules and filled, then the snapshot
/// bound (and a pageable sleep and a wake after, the first suspects). The region must read
/// exactly the snapshot's bytes: the old allocation's data up to its end, and past it the bytes
/// the span held there when the snapshot was taken (here a known stale pattern), never the new
/// allocation's data and never the old allocation's pattern continued. The library always did;
/// the random test's model expected the pattern continued.
#[test]
#[ignore = "needs a CUDA GPU"]
fn a_snapshot_bound_over_a_longer_allocation_in_the_same_granules_reads_its_own_bytes() {
    let gpu = gpu();
    let mut rng = rng("region_bind_longer");
    let region = Region::new(
        &gpu.ctx,
        "bind-longer",
        RegionOptions::default().capacity(64 * MIB),
    )
    .unwrap();
    let g = region.granularity();
    // The lengths of the failing seed: both take the same two granules.
    let (short, long): (usize, usize) = (2_251_475, 2_573_006);
    assert_eq!(short.div_ceil(g), long.div_ceil(g));
    let first = region.alloc(g).unwrap();
    let first_data = random_words(&mut rng, g);
    region.write(&gpu.stream, first, &first_data).unwrap();
    // A full-length allocation leaves a known pattern past `short` in the span once freed.
    let stale_owner = region.alloc(long).unwrap();
    let stale = random_words(&mut rng, long);
    region.write(&gpu.stream, stale_owner, &stale).unwrap();
    drop(region.snapshot(&gpu.stream).unwrap()); // folds everything into the span
    region.free(stale_owner).unwrap(); // inside the span: stays mapped, bytes kept
    let old = region.alloc(short).unwrap();
    assert_eq!(old, stale_owner, "the hole inside the span is reused");
    let old_data = random_words(&mut rng, short);
    region.write(&gpu.stream, old, &old_data).unwrap();
    let set = region.snapshot(&gpu.stream).unwrap();
    region.free(old).unwrap();
    let new = region.alloc(long).unwrap();
    assert_eq!(new, old, "the longer allocation takes the same granules");
    let new_data = random_words(&mut rng, long);
    region.write(&gpu.stream, new, &new_data).unwrap();
    region.bind(&set).unwrap();
    let mut want = old_data.clone();
    want.extend_from_slice(&stale[old_data.len()..]);
    let read_all = |what: &str| {
        let got = read(&gpu, &region, new, long);
        let wrong = got.iter().zip(&want).filter(|(g, w)| g != w).count();
        assert_eq!(wrong, 0, "{what}: {wrong} of {} words differ", want.len());
        assert_eq!(read(&gpu, &region, first, g), first_data, "{what}: first");
    };
    read_all("bound");
    assert_ne!(
        want, new_data,
        "the new allocation's data is not what the set holds"
    );
    region.sleep(&HostStorage::Pageable, &gpu.stream).unwrap();
    assert!(matches!(
        region.snapshot(&gpu.stream),
        Err(Error::Region(RegionError::RegionAsleep { .. }))
    ));
    region.wake(&gpu.stream).unwrap();
    read_all("after a pageable sleep, a refused snapshot and a wake");
    region.free(first).unwrap();
    let got = read(&gpu, &region, new, long);
    assert_eq!(got, want, "a free of another allocation changes nothing");
}

#[test]
#[ignore = "needs a CUDA GPU"]
fn a_graph_captured_once_replays_on_each_bound_snapshot() {
    let gpu = gpu();
    let mut rng = rng("region_snapshots");
    let region = Region::new(&gpu.ctx, "weights", RegionOptions::default()).unwrap();
    let bytes = 6 * MIB;
    let x = region.alloc(bytes).unwrap();
    let y = region.alloc(bytes).unwrap();
    let words = bytes / 4;
    let set_a: Vec<f32> = (0..words).map(|_| rng.gen_range(-1.0..1.0)).collect();
    region.write(&gpu.stream, x, &set_a).unwrap();
    // The first snapshot consolidates the region: its live backing (holding A) becomes a
    // snapshot too, and `copy` is a second backing holding A.
    let copy = region.snapshot(&gpu.stream).unwrap();
    assert_eq!(region.stats().mappings, 1, "snapshot consolidates");
    let live = region.bound().expect("consolidated backing");
    assert!(!live.same_as(&copy));
    // Fill B into `copy` through a bind, then swap back.
    let set_b: Vec<f32> = (0..words).map(|_| rng.gen_range(-1.0..1.0)).collect();
    region.bind(&copy).unwrap();
    region.write(&gpu.stream, x, &set_b).unwrap();
    region.bind(&live).unwrap();
    let k = gpu.kernels.clone();
    let (xr, yr) = (Range { ptr: x, bytes }, Range { ptr: y, bytes });
    let mut graph = StableGraph::capture(&gpu.stream, &[], move |s| {
        stablebuf::buffer::copy_between(s, &yr, 0, &xr, 0, xr.bytes)?;
        k.affine(s, &yr, 2.0, 1.0)
    })
    .unwrap();
    for round in 0..6 {
        let (snapshot, want) = if round % 2 == 0 {
            (&live, &set_a)
        } else {
            (&copy, &set_b)
        };
        region.bind(snapshot).unwrap();
        region
            .write(&gpu.stream, y, &vec![f32::NAN; words])
            .unwrap();
        region.check_replayable().unwrap();
        graph.replay().unwrap();
        gpu.stream.synchronize().unwrap();
        let mut got = vec![0f32; words];
        region.read_into(&gpu.stream, y, &mut got).unwrap();
        for (i, (g, w)) in got.iter().zip(want.iter()).enumerate() {
            assert!(
                approx::relative_eq!(*g, 2.0 * w + 1.0, max_relative = 1e-6),
                "round {round}, {i}: {g}"
            );
        }
    }
    assert!(graph.check_update().unwrap().is_success());
    region.unbind().unwrap();
    assert!(matches!(
        region.check_replayable(),
        Err(Error::Graph(GraphError::Unbound { .. }))
    ));
    region.bind(&copy).unwrap();
    region.check_replayable().unwrap();
    let other = Region::new(&gpu.ctx, "other", RegionOptions::default()).unwrap();
    other.alloc(bytes).unwrap();
    let foreign = other.snapshot(&gpu.stream).unwrap();
    assert!(matches!(
        region.bind(&foreign),
        Err(Error::Region(RegionError::SnapshotMismatch { .. }))
    ));
    region.alloc(bytes).unwrap(); // past the snapshots' span
    assert!(matches!(
        region.bind(&live),
        Err(Error::Region(RegionError::SnapshotMismatch { .. }))
    ));
    let mut got = vec![0f32; words];
    region.read_into(&gpu.stream, x, &mut got).unwrap();
    assert_eq!(got, set_b, "failed binds changed nothing");
}

#[test]
#[ignore = "needs a CUDA GPU"]
fn a_wake_without_room_keeps_the_host_copy_and_a_retry_works() {
    let gpu = gpu();
    let mut rng = rng("region_wake_oom");
    let region = Region::new(&gpu.ctx, "weights", RegionOptions::default()).unwrap();
    let bytes = 256 * MIB;
    let address = region.alloc(bytes).unwrap();
    let data = random_words(&mut rng, bytes);
    region.write(&gpu.stream, address, &data).unwrap();
    region.sleep(&HostStorage::Pageable, &gpu.stream).unwrap();
    // Fill the device so the wake cannot get its span back.
    let mut fillers = Vec::new();
    loop {
        stablebuf::release::trim_all(); // memory held for release is not free to the driver
        let (free, _) = memory_info(&gpu.ctx).unwrap();
        if free < bytes {
            break;
        }
        match LinearBuffer::new(&gpu.ctx, (free - bytes / 2).min(8 << 30)) {
            Ok(buffer) => fillers.push(buffer),
            Err(_) => break,
        }
    }
    match region.wake(&gpu.stream) {
        Err(Error::Offload(OffloadError::RestoreOutOfMemory { asked, .. })) => {
            assert_eq!(asked, bytes)
        }
        other => panic!("expected RestoreOutOfMemory, got {other:?}"),
    }
    assert!(region.is_asleep(), "still asleep with its host copy");
    drop(fillers);
    region.wake(&gpu.stream).unwrap();
    assert_eq!(read(&gpu, &region, address, bytes), data);
}

#[test]
#[ignore = "needs a CUDA GPU"]
fn many_cycles_leave_device_memory_at_its_baseline() {
    let gpu = gpu();
    let arena = HostArena::new(&gpu.ctx, 64 * MIB).unwrap();
    gpu.ctx.synchronize().unwrap();
    stablebuf::release::trim_all(); // memory held for release is not free to the driver
    let (baseline, _) = memory_info(&gpu.ctx).unwrap();
    for cycle in 0..30 {
        let region = Region::new(&gpu.ctx, "cycle", RegionOptions::default()).unwrap();
        let addresses: Vec<u64> = (0..4)
            .map(|i| region.alloc((i + 1) * 3 * MIB).unwrap())
            .collect();
        region
            .sleep(&HostStorage::Pinned(arena.clone()), &gpu.stream)
            .unwrap();
        region.wake(&gpu.stream).unwrap();
        let snapshot = region.snapshot(&gpu.stream).unwrap();
        region.bind(&snapshot).unwrap();
        region.free(addresses[cycle % 4]).unwrap();
        region.alloc(5 * MIB).unwrap();
        region.sleep(&HostStorage::Discard, &gpu.stream).unwrap();
        assert_eq!(
            region.stats().host_bytes,
            0,
            "discarded bytes are held nowhere"
        );
        region.wake(&gpu.stream).unwrap();
    }
    gpu.ctx.synchronize().unwrap();
    stablebuf::release::trim_all(); // memory held for release is not free to the driver
    let (after, _) = memory_info(&gpu.ctx).unwrap();
    assert!(
        after + 4 * MIB >= baseline,
        "leaked {} bytes",
        baseline - after
    );
}
