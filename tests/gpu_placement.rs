//! Where a dataset's memory lives, on one GPU: a dataset in pinned host memory binds under a
//! device space's slots and a captured graph reads it in place; peer settings are checked.

mod common;

use common::{gpu, random_vec, rng};
use stablebuf::buffer::copy_between;
use stablebuf::error::DriverError;
use stablebuf::vmm::Location;
use stablebuf::{Error, Layout, Space, SpaceOptions, StableGraph};

const MIB: usize = 1 << 20;

#[test]
#[ignore = "needs a CUDA GPU"]
fn a_dataset_in_host_memory_binds_under_device_slots_and_replays_read_it_in_place() {
    let gpu = gpu();
    let mut rng = rng("host_dataset");
    let bytes = 24 * MIB + 4096; // not a granule multiple
    let layout = Layout::builder()
        .group("weights")
        .input("w", bytes)
        .scratch("out", bytes)
        .build()
        .unwrap();
    let space = Space::new(&gpu.ctx, layout).unwrap();
    let local = space.new_dataset("weights").unwrap();
    let host = space.new_dataset_at("weights", Location::Host).unwrap();
    assert_eq!(host.location(), Location::Host);
    assert_eq!(local.location(), Location::Device(gpu.ctx.ordinal()));
    let words = bytes / 4;
    let data_local = random_vec(&mut rng, words);
    let data_host = random_vec(&mut rng, words);
    local.write(&gpu.stream, "w", &data_local).unwrap();
    host.write(&gpu.stream, "w", &data_host).unwrap();
    let (w, out) = (
        space.slot("w").unwrap().clone(),
        space.slot("out").unwrap().clone(),
    );
    let kernels = gpu.kernels.clone();
    // Copy nodes check their addresses when captured: capture with a dataset bound.
    space.bind(&local).unwrap();
    let graph = StableGraph::capture(&gpu.stream, &[&space], move |s| {
        copy_between(s, &out, 0, &w, 0, w.bytes())?;
        kernels.affine(s, &out, 3.0, -1.0)
    })
    .unwrap();
    for round in 0..4 {
        let (dataset, want) = if round % 2 == 0 {
            (&host, &data_host)
        } else {
            (&local, &data_local)
        };
        space.bind(dataset).unwrap();
        space
            .write(&gpu.stream, "out", &vec![f32::NAN; words])
            .unwrap();
        graph.replay().unwrap();
        gpu.stream.synchronize().unwrap();
        let got: Vec<f32> = space.read(&gpu.stream, "out").unwrap();
        for (i, (g, w)) in got.iter().zip(want.iter()).enumerate() {
            assert!(
                approx::relative_eq!(*g, 3.0 * w - 1.0, max_relative = 1e-6),
                "round {round}, element {i}: {g} vs {}",
                3.0 * w - 1.0
            );
        }
    }
}

#[test]
#[ignore = "needs a CUDA GPU"]
fn peers_that_do_not_exist_are_typed_errors() {
    let gpu = gpu();
    let layout = Layout::builder().input("x", MIB).build().unwrap();
    let count = stablebuf::device::device_count().unwrap();
    assert!(count >= 1);
    let missing = count + 3;
    match Space::with_options(
        &gpu.ctx,
        layout.clone(),
        SpaceOptions::default().peers([missing]),
    ) {
        Err(Error::Driver(DriverError::NoSuchDevice { ordinal, count: c })) => {
            assert_eq!((ordinal, c), (missing, count))
        }
        other => panic!("expected NoSuchDevice, got {other:?}"),
    }
    let own = gpu.ctx.ordinal();
    let space =
        Space::with_options(&gpu.ctx, layout, SpaceOptions::default().peers([own])).unwrap();
    assert_eq!(space.devices(), [own], "the own device is not listed twice");
    assert!(matches!(
        space.new_dataset_at("data", Location::Device(missing)),
        Err(Error::Driver(DriverError::NoSuchDevice { .. }))
    ));
    assert!(stablebuf::device::can_access_peer(own, own).unwrap());
}
