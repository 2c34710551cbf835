//! Several GPUs: spaces read by graphs on peer devices across rebinds, sleep and wake, datasets
//! whose memory lives on a peer, binds racing a peer's replay, and the typed refusals of bad
//! device input. Written for any number of GPUs (every test uses all visible devices, pairing
//! device 0 with each peer); each needs at least two with peer access. The bundle runner runs
//! this binary with `--include-ignored` only where `nvidia-smi` lists two or more, so on one GPU
//! the tests report as ignored, never as passed.

mod common;

use std::sync::Arc;
use std::time::{Duration, Instant};

use common::{random_vec, rng};
use stablebuf::buffer::copy_between;
use stablebuf::cudarc::driver::{CudaContext, CudaStream};
use stablebuf::error::{DriverError, GraphError};
use stablebuf::kernels::Kernels;
use stablebuf::vmm::Location;
use stablebuf::{
    open_device, Dataset, Error, FencePolicy, HostStorage, Layout, Space, SpaceOptions, StableGraph,
};

const MIB: usize = 1 << 20;

/// Every visible device (at least two).
fn devices() -> Vec<Arc<CudaContext>> {
    let count = stablebuf::device::device_count().expect("a CUDA driver");
    assert!(count >= 2, "this test needs two CUDA GPUs, found {count}");
    (0..count).map(|d| open_device(d).unwrap()).collect()
}

/// `2·w + 0.5`, what every graph here computes from a slot.
fn check(got: &[f32], want: &[f32], what: &str) {
    assert_eq!(got.len(), want.len(), "{what}: length");
    for (i, (g, w)) in got.iter().zip(want).enumerate() {
        let expected = 2.0 * w + 0.5;
        assert!(
            approx::relative_eq!(*g, expected, max_relative = 1e-6),
            "{what}, element {i}: {g} vs {expected}"
        );
    }
}

/// A space on `owner` with one input slot `x` in group "g", shared with `peers`.
fn shared_space(
    owner: &Arc<CudaContext>,
    bytes: usize,
    peers: &[usize],
    fence: FencePolicy,
) -> Space {
    let layout = Layout::builder()
        .group("g")
        .input("x", bytes)
        .build()
        .unwrap();
    let options = SpaceOptions::default()
        .peers(peers.iter().copied())
        .fence(fence);
    Space::with_options(owner, layout, options).unwrap()
}

/// Datasets of "g" filled with fresh random data, and that data.
fn random_datasets(
    space: &Space,
    stream: &Arc<CudaStream>,
    rng: &mut rand::rngs::StdRng,
    count: usize,
) -> (Vec<Dataset>, Vec<Vec<f32>>) {
    let words = space.slot("x").unwrap().bytes() / 4;
    let data: Vec<Vec<f32>> = (0..count).map(|_| random_vec(rng, words)).collect();
    let datasets = data
        .iter()
        .map(|v| {
            let d = space.new_dataset("g").unwrap();
            d.write(stream, "x", v).unwrap();
            d
        })
        .collect();
    stream.synchronize().unwrap();
    (datasets, data)
}

/// A graph on `ctx`'s device that copies slot `x` of `space` into its own scratch slot `out`
/// and transforms it there (`2·x + 0.5`), after spinning for `spin` (so a test can race it).
struct PeerReader {
    stream: Arc<CudaStream>,
    output: Space,
    graph: StableGraph,
}

impl PeerReader {
    fn new(ctx: &Arc<CudaContext>, space: &Space, spin: Duration) -> Self {
        let stream = ctx.new_stream().unwrap();
        let kernels = Arc::new(Kernels::load(ctx).unwrap());
        let bytes = space.slot("x").unwrap().bytes();
        let output = Space::new(
            ctx,
            Layout::builder().scratch("out", bytes).build().unwrap(),
        )
        .unwrap();
        let (x, out) = (
            space.slot("x").unwrap().clone(),
            output.slot("out").unwrap().clone(),
        );
        // Copy nodes are checked by the driver at capture: the slot must have memory under it
        // then (see `StableGraph::capture`), so the caller binds a dataset first.
        let graph = StableGraph::capture(&stream, &[space, &output], move |s| {
            if !spin.is_zero() {
                kernels.spin(s, spin)?;
            }
            copy_between(s, &out, 0, &x, 0, x.bytes())?;
            kernels.affine(s, &out, 2.0, 0.5)
        })
        .unwrap();
        Self {
            stream,
            output,
            graph,
        }
    }

    fn poison(&self) {
        let words = self.output.slot("out").unwrap().bytes() / 4;
        self.output
            .write(&self.stream, "out", &vec![f32::NAN; words])
            .unwrap();
    }

    fn read(&self) -> Vec<f32> {
        self.stream.synchronize().unwrap();
        self.output.read(&self.stream, "out").unwrap()
    }
}

#[test]
#[ignore = "needs two CUDA GPUs"]
fn a_graph_on_each_peer_reads_a_slot_and_keeps_reading_it_after_every_rebind() {
    let ctxs = devices();
    let mut rng = rng("peer_graph");
    let peers: Vec<usize> = (1..ctxs.len()).collect();
    for fence in [FencePolicy::Context, FencePolicy::AttachedStreams] {
        let space = shared_space(&ctxs[0], 16 * MIB, &peers, fence);
        assert_eq!(space.devices(), (0..ctxs.len()).collect::<Vec<_>>());
        let stream0 = ctxs[0].new_stream().unwrap();
        let (datasets, data) = random_datasets(&space, &stream0, &mut rng, 3);
        space.bind(&datasets[0]).unwrap();
        let readers: Vec<PeerReader> = ctxs[1..]
            .iter()
            .map(|ctx| PeerReader::new(ctx, &space, Duration::ZERO))
            .collect();
        for round in 0..7 {
            let index = round % datasets.len();
            space.bind(&datasets[index]).unwrap();
            for (peer, reader) in readers.iter().enumerate() {
                reader.poison();
                reader.graph.replay().unwrap();
                check(
                    &reader.read(),
                    &data[index],
                    &format!("{fence:?}, round {round}, reader on device {}", peer + 1),
                );
            }
        }
    }
}

#[test]
#[ignore = "needs two CUDA GPUs"]
fn a_dataset_on_a_peer_binds_under_the_local_slots() {
    let ctxs = devices();
    let mut rng = rng("peer_dataset");
    let bytes = 8 * MIB;
    let words = bytes / 4;
    let layout = Layout::builder()
        .group("g")
        .input("x", bytes)
        .scratch("y", bytes)
        .build()
        .unwrap();
    let space = Space::new(&ctxs[0], layout).unwrap();
    let stream = ctxs[0].new_stream().unwrap();
    let kernels = Arc::new(Kernels::load(&ctxs[0]).unwrap());
    // One dataset on every peer plus one local, bound in turn under the same graph.
    let mut datasets = Vec::new();
    let mut data = Vec::new();
    for owner in 0..ctxs.len() {
        let d = space.new_dataset_at("g", Location::Device(owner)).unwrap();
        let v = random_vec(&mut rng, words);
        d.write(&stream, "x", &v).unwrap();
        datasets.push(d);
        data.push(v);
    }
    space.bind(&datasets[1]).unwrap();
    let (x, y, k) = (
        space.slot("x").unwrap().clone(),
        space.slot("y").unwrap().clone(),
        kernels.clone(),
    );
    let graph = StableGraph::capture(&stream, &[&space], move |s| {
        copy_between(s, &y, 0, &x, 0, x.bytes())?;
        k.affine(s, &y, 2.0, 0.5)
    })
    .unwrap();
    for round in 0..2 * datasets.len() {
        let owner = (round + 1) % datasets.len();
        space.bind(&datasets[owner]).unwrap();
        space.write(&stream, "y", &vec![f32::NAN; words]).unwrap();
        graph.replay().unwrap();
        stream.synchronize().unwrap();
        let got: Vec<f32> = space.read(&stream, "y").unwrap();
        check(
            &got,
            &data[owner],
            &format!("round {round}, dataset on device {owner}"),
        );
    }
}

#[test]
#[ignore = "needs two CUDA GPUs"]
fn a_space_shared_by_every_device_sleeps_and_wakes_under_graphs_on_all_of_them() {
    let ctxs = devices();
    let mut rng = rng("peer_sleep");
    let peers: Vec<usize> = (1..ctxs.len()).collect();
    let space = shared_space(&ctxs[0], 32 * MIB, &peers, FencePolicy::Context);
    let stream0 = ctxs[0].new_stream().unwrap();
    let (mut datasets, data) = random_datasets(&space, &stream0, &mut rng, 2);
    space.bind(&datasets[0]).unwrap();
    // A reader on every device, the owner included.
    let readers: Vec<PeerReader> = ctxs
        .iter()
        .map(|ctx| PeerReader::new(ctx, &space, Duration::ZERO))
        .collect();
    stablebuf::release::trim_all(); // memory held for release is not free to the driver
    let free_before = stablebuf::device::memory_info(&ctxs[0]).unwrap().0;
    for cycle in 0..3 {
        let index = cycle % 2;
        space.bind(&datasets[index]).unwrap();
        for reader in &readers {
            reader.poison();
            reader.graph.replay().unwrap();
            check(
                &reader.read(),
                &data[index],
                &format!("cycle {cycle}, before sleep"),
            );
        }
        let arena = stablebuf::HostArena::new(&ctxs[0], 64 * MIB).unwrap();
        let storage = HostStorage::Pinned(arena);
        space
            .sleep(datasets.iter_mut(), &storage, &stream0)
            .unwrap();
        assert!(space.is_asleep());
        for (device, reader) in readers.iter().enumerate() {
            match reader.graph.replay() {
                Err(Error::Graph(GraphError::Asleep)) => {}
                other => panic!("cycle {cycle}: replay on device {device} while asleep: {other:?}"),
            }
        }
        space.wake(datasets.iter_mut(), &stream0).unwrap();
        for (device, reader) in readers.iter().enumerate() {
            reader.poison();
            reader.graph.replay().unwrap();
            check(
                &reader.read(),
                &data[index],
                &format!("cycle {cycle}, after wake, reader on device {device}"),
            );
        }
    }
    // Sleep released and wake re-created the memory: no drift on the owner.
    stablebuf::release::trim_all(); // memory held for release is not free to the driver
    let free_after = stablebuf::device::memory_info(&ctxs[0]).unwrap().0;
    let drift = free_before.abs_diff(free_after);
    assert!(
        drift <= 64 * MIB,
        "device 0 free memory drifted by {drift} bytes over 3 cycles"
    );
}

#[test]
#[ignore = "needs two CUDA GPUs"]
fn a_bind_on_the_owner_waits_for_a_peer_graph_that_is_still_reading() {
    let ctxs = devices();
    let mut rng = rng("peer_race");
    let peers: Vec<usize> = (1..ctxs.len()).collect();
    let spin = Duration::from_millis(60);
    for fence in [FencePolicy::Context, FencePolicy::AttachedStreams] {
        let space = shared_space(&ctxs[0], 64 * MIB, &peers, fence);
        let stream0 = ctxs[0].new_stream().unwrap();
        let (datasets, data) = random_datasets(&space, &stream0, &mut rng, 2);
        space.bind(&datasets[0]).unwrap();
        let reader = PeerReader::new(&ctxs[1], &space, spin);
        for round in 0..4 {
            let (now, next) = (round % 2, (round + 1) % 2);
            space.bind(&datasets[now]).unwrap();
            reader.poison();
            reader.stream.synchronize().unwrap();
            // The peer spins first, then reads the slot: a bind that did not wait for it would
            // unmap the memory under the read (a fault) or put the next dataset there.
            reader.graph.replay().unwrap();
            let start = Instant::now();
            space.bind(&datasets[next]).unwrap();
            let waited = start.elapsed();
            check(
                &reader.read(),
                &data[now],
                &format!("{fence:?}, round {round}: the peer read what was bound at its launch"),
            );
            assert!(
                waited >= spin / 2,
                "{fence:?}, round {round}: the bind returned after {waited:?}, before the peer's \
                 {spin:?} graph could have finished"
            );
        }
    }
}

#[test]
#[ignore = "needs two CUDA GPUs"]
fn bad_device_input_is_refused_with_typed_errors_and_the_space_still_works() {
    let ctxs = devices();
    let count = ctxs.len();
    let mut rng = rng("peer_refusals");
    // A device that does not exist: as a device to open, a peer, and a dataset's home.
    assert!(matches!(
        open_device(count),
        Err(Error::Driver(DriverError::NoSuchDevice { ordinal, count: c })) if ordinal == count && c == count
    ));
    let layout = Layout::builder()
        .group("g")
        .input("x", 4 * MIB)
        .build()
        .unwrap();
    let options = SpaceOptions::default().peers([count + 3]);
    assert!(matches!(
        Space::with_options(&ctxs[0], layout.clone(), options),
        Err(Error::Driver(DriverError::NoSuchDevice { ordinal, .. })) if ordinal == count + 3
    ));
    // A space that grants only its own device.
    let space = Space::new(&ctxs[0], layout).unwrap();
    assert_eq!(space.devices(), [0]);
    assert!(matches!(
        space.new_dataset_at("g", Location::Device(count)),
        Err(Error::Driver(DriverError::NoSuchDevice { .. }))
    ));
    let stream0 = ctxs[0].new_stream().unwrap();
    let (datasets, data) = random_datasets(&space, &stream0, &mut rng, 2);
    space.bind(&datasets[0]).unwrap();
    // A graph on a device the space does not grant would fault on its first access: refused.
    let stream1 = ctxs[1].new_stream().unwrap();
    let x = space.slot("x").unwrap().clone();
    let kernels1 = Arc::new(Kernels::load(&ctxs[1]).unwrap());
    match StableGraph::capture(&stream1, &[&space], move |s| {
        kernels1.affine(s, &x, 1.0, 0.0)
    }) {
        Err(Error::Graph(GraphError::NotGranted { device: 1, granted })) => {
            assert_eq!(granted, [0])
        }
        other => panic!("capture on an ungranted device: {other:?}"),
    }
    // A dataset of a space on another device cannot bind here.
    let other = shared_space(&ctxs[1], 4 * MIB, &[], FencePolicy::Context);
    let foreign = other.new_dataset("g").unwrap();
    assert!(matches!(
        space.bind(&foreign),
        Err(Error::Driver(DriverError::ContextMismatch {
            expected: 0,
            found: 1
        }))
    ));
    // After every refusal the space is as it was: still bound to dataset 0, and it rebinds and
    // replays correctly on its own device.
    assert_eq!(space.bound_dataset("g").unwrap(), Some(datasets[0].id()));
    let reader = PeerReader::new(&ctxs[0], &space, Duration::ZERO);
    for (index, dataset) in datasets.iter().enumerate() {
        space.bind(dataset).unwrap();
        reader.poison();
        reader.graph.replay().unwrap();
        check(&reader.read(), &data[index], "after the refusals");
    }
    // Peers that cannot reach each other give `DriverError::PeerAccess`; every pair on a machine
    // with
    // NVLink or one PCIe switch can, so say what this machine is instead of passing silently.
    for from in 0..count {
        for to in 0..count {
            let can = stablebuf::device::can_access_peer(from, to).unwrap();
            eprintln!("peer access {from} -> {to}: {can}");
        }
    }
}
