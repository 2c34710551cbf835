//! Several GPUs: a space on GPU 0 read by a graph on GPU 1 across rebinds, and a dataset whose
//! memory lives on the peer. Every test needs two GPUs with peer access; the bundle runner runs
//! this binary with `--include-ignored` only where `nvidia-smi` lists two or more, so on one GPU
//! they report as ignored, never as passed.

mod common;

use std::sync::Arc;

use common::{random_vec, rng};
use stablebuf::buffer::copy_between;
use stablebuf::cudarc::driver::CudaContext;
use stablebuf::{
    open_device, DeviceBuffer, FencePolicy, Kernels, Layout, Location, Space, SpaceOptions,
    StableGraph,
};

const MIB: usize = 1 << 20;

fn two_devices() -> (Arc<CudaContext>, Arc<CudaContext>) {
    let count = stablebuf::device_count().expect("a CUDA driver");
    assert!(count >= 2, "this test needs two CUDA GPUs, found {count}");
    (open_device(0).unwrap(), open_device(1).unwrap())
}

fn check(got: &[f32], want: &[f32], what: &str) {
    for (i, (g, w)) in got.iter().zip(want).enumerate() {
        let expected = 2.0 * w + 0.5;
        assert!(
            approx::relative_eq!(*g, expected, max_relative = 1e-6),
            "{what}, element {i}: {g} vs {expected}"
        );
    }
}

#[test]
#[ignore = "needs two CUDA GPUs"]
fn a_graph_on_the_peer_reads_a_slot_and_keeps_reading_it_after_every_rebind() {
    let (ctx0, ctx1) = two_devices();
    let mut rng = rng("peer_graph");
    let bytes = 16 * MIB;
    let words = bytes / 4;
    let layout = Layout::builder()
        .group("g")
        .input("x", bytes)
        .build()
        .unwrap();
    // A rebind on GPU 0 must wait for the GPU-1 graph that reads the slot: with attached
    // streams it waits for exactly the streams that used the space, on either device.
    let options = SpaceOptions::default()
        .peers([1])
        .fence(FencePolicy::AttachedStreams);
    let space = Space::with_options(&ctx0, layout, options).unwrap();
    assert_eq!(space.devices(), [0, 1]);
    let stream0 = ctx0.new_stream().unwrap();
    let data: Vec<Vec<f32>> = (0..3).map(|_| random_vec(&mut rng, words)).collect();
    let datasets: Vec<_> = data
        .iter()
        .map(|v| {
            let d = space.new_dataset("g").unwrap();
            d.write(&stream0, "x", v).unwrap();
            d
        })
        .collect();
    // The graph lives on GPU 1: it copies the GPU-0 slot into GPU-1 memory and transforms it.
    let stream1 = ctx1.new_stream().unwrap();
    let kernels1 = Arc::new(Kernels::load(&ctx1).unwrap());
    let output = Layout::builder().scratch("out", bytes).build().unwrap();
    let on_gpu1 = Space::new(&ctx1, output).unwrap();
    let (x, out) = (
        space.slot("x").unwrap().clone(),
        on_gpu1.slot("out").unwrap().clone(),
    );
    let graph = StableGraph::capture(&stream1, &[&space, &on_gpu1], move |s| {
        copy_between(s, &out, 0, &x, 0, x.byte_len())?;
        kernels1.affine(s, &out, 2.0, 0.5)
    })
    .unwrap();
    for round in 0..6 {
        let index = round % datasets.len();
        space.bind(&datasets[index]).unwrap();
        on_gpu1
            .write(&stream1, "out", &vec![f32::NAN; words])
            .unwrap();
        graph.replay().unwrap();
        stream1.synchronize().unwrap();
        let got: Vec<f32> = on_gpu1.read(&stream1, "out").unwrap();
        check(&got, &data[index], &format!("round {round}"));
    }
}

#[test]
#[ignore = "needs two CUDA GPUs"]
fn a_dataset_on_the_peer_binds_under_the_local_slots() {
    let (ctx0, _ctx1) = two_devices();
    let mut rng = rng("peer_dataset");
    let bytes = 8 * MIB;
    let words = bytes / 4;
    let layout = Layout::builder()
        .group("g")
        .input("x", bytes)
        .scratch("y", bytes)
        .build()
        .unwrap();
    let space = Space::new(&ctx0, layout).unwrap();
    let remote = space.new_dataset_at("g", Location::Device(1)).unwrap();
    let stream = ctx0.new_stream().unwrap();
    let data = random_vec(&mut rng, words);
    remote.write(&stream, "x", &data).unwrap();
    space.bind(&remote).unwrap();
    let kernels = Arc::new(Kernels::load(&ctx0).unwrap());
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
    space.write(&stream, "y", &vec![f32::NAN; words]).unwrap();
    graph.replay().unwrap();
    stream.synchronize().unwrap();
    let got: Vec<f32> = space.read(&stream, "y").unwrap();
    check(&got, &data, "peer dataset");
}
