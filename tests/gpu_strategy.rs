//! Bind strategies, pipelined lanes and cuBLAS graphs on a real GPU, checked against CPU
//! references on fresh random data with outputs poisoned before every run.

mod common;

use std::sync::Arc;

use common::{assert_matches, capture_matmul, cpu_matmul, gpu, random_vec, rng};
use stablebuf::error::{GraphError, LayoutError};
use stablebuf::graph::NodeKind;
use stablebuf::kernels::{Blas, MatmulKernel, RECOMMENDED_WORKSPACE};
use stablebuf::{BindStrategy, CostModel, Dataset, Error, Layout, Pipeline, Space, SpaceOptions};

const F32: usize = 4;

/// Group "io": input a, output c, input b (interleaved on purpose); scratch none.
fn io_layout(m: usize, n: usize, k: usize) -> Layout {
    Layout::builder()
        .group("io")
        .input("a", m * k * F32)
        .output("c", m * n * F32)
        .input("b", k * n * F32)
        .build()
        .unwrap()
}

#[test]
#[ignore = "needs a CUDA GPU"]
fn copy_in_groups_compute_on_each_bound_dataset_and_copy_outputs_out() {
    let gpu = gpu();
    let mut rng = rng("copy_in");
    let (m, n, k) = (96, 64, 80);
    let options = SpaceOptions::default().bind(BindStrategy::CopyIn);
    let space = Space::with_options(&gpu.ctx, io_layout(m, n, k), options).unwrap();
    assert_eq!(space.strategy("io").unwrap(), BindStrategy::CopyIn);
    let addresses: Vec<u64> = space.slots().iter().map(|s| s.device_ptr()).collect();

    let sets: Vec<(Dataset, Vec<f32>)> = (0..3)
        .map(|_| {
            let (a, b) = (random_vec(&mut rng, m * k), random_vec(&mut rng, k * n));
            let d = space.new_dataset("io").unwrap();
            d.write(&gpu.stream, "a", &a).unwrap();
            d.write(&gpu.stream, "b", &b).unwrap();
            d.write(&gpu.stream, "c", &vec![f32::NAN; m * n]).unwrap();
            (d, cpu_matmul(&a, &b, m, n, k))
        })
        .collect();
    let graph = capture_matmul(
        &space,
        &gpu.stream,
        &gpu.kernels,
        MatmulKernel::Auto,
        (m, n, k),
    );
    assert!(matches!(
        graph.replay(),
        Err(Error::Graph(GraphError::Unbound { .. }))
    ));

    for round in 0..6 {
        let (data, want) = &sets[round % 3];
        space.bind(data).unwrap();
        gpu.kernels
            .fill(&gpu.stream, space.slot("c").unwrap(), f32::NAN)
            .unwrap();
        graph.replay().unwrap();
        assert_matches(
            &space.read(&gpu.stream, "c").unwrap(),
            want,
            k,
            &format!("round {round}"),
        );
        // The output lives in the space until copied out.
        space.copy_out(data, &gpu.stream).unwrap();
        assert_matches(&data.read(&gpu.stream, "c").unwrap(), want, k, "copied out");
        assert_eq!(
            space
                .slots()
                .iter()
                .map(|s| s.device_ptr())
                .collect::<Vec<_>>(),
            addresses
        );
    }
    assert_eq!(space.bound_dataset("io").unwrap(), Some(sets[2].0.id()));
    assert!(matches!(
        space.copy_out(&sets[0].0, &gpu.stream),
        Err(Error::Graph(GraphError::Unbound { .. }))
    ));
    space.unbind("io").unwrap();
    assert!(matches!(
        graph.replay(),
        Err(Error::Graph(GraphError::Unbound { .. }))
    ));
}

#[test]
#[ignore = "needs a CUDA GPU"]
fn auto_picks_copy_for_small_groups_and_remap_for_large_ones_from_a_calibrated_model() {
    let gpu = gpu();
    let model = CostModel::for_device(&gpu.ctx).unwrap();
    eprintln!(
        "calibrated: {model:?}, crossover {:?} bytes",
        model.crossover_bytes()
    );
    let crossover = model
        .crossover_bytes()
        .expect("remap must win somewhere on a real GPU");
    assert!(
        (8 << 20..2 << 30).contains(&crossover),
        "crossover {crossover} far from the measured ~100 MiB"
    );
    let layout = Layout::builder()
        .group("small")
        .input("s", 2 << 20)
        .group("large")
        .input("l", 1 << 30)
        .build()
        .unwrap();
    let space = Space::with_options(
        &gpu.ctx,
        layout,
        SpaceOptions::default().bind(BindStrategy::Auto),
    )
    .unwrap();
    assert_eq!(space.strategy("small").unwrap(), BindStrategy::CopyIn);
    assert_eq!(space.strategy("large").unwrap(), BindStrategy::Remap);
}

#[test]
#[ignore = "needs a CUDA GPU"]
fn a_pipeline_rotates_datasets_through_lanes_and_every_step_is_correct() {
    let gpu = gpu();
    let mut rng = rng("pipeline");
    let (m, n, k) = (128, 128, 256);
    let layout = Layout::builder()
        .group("weights")
        .input("w", k * n * F32)
        .group("batch")
        .input("x", m * k * F32)
        .scratch("y", m * n * F32)
        .build()
        .unwrap();
    let kernels = gpu.kernels.clone();
    let mut pipeline = Pipeline::new(
        &gpu.ctx,
        &layout,
        2,
        SpaceOptions::default().group_bind("batch", BindStrategy::CopyIn),
        |space, _| {
            let (x, w, y) = (
                space.slot("x")?.clone(),
                space.slot("w")?.clone(),
                space.slot("y")?.clone(),
            );
            let kernels = kernels.clone();
            Ok(move |s: &Arc<_>| {
                kernels
                    .matmul(s, MatmulKernel::Auto, &x, &w, &y, m, n, k)
                    .map(drop)
            })
        },
    )
    .unwrap();
    let probe = pipeline.lanes()[0].space().clone();
    let weights: Vec<(Dataset, Vec<f32>)> = (0..2)
        .map(|_| {
            let w = random_vec(&mut rng, k * n);
            let d = probe.new_dataset("weights").unwrap();
            d.write(&gpu.stream, "w", &w).unwrap();
            (d, w)
        })
        .collect();
    let batches: Vec<(Dataset, Vec<f32>)> = (0..3)
        .map(|_| {
            let x = random_vec(&mut rng, m * k);
            let d = probe.new_dataset("batch").unwrap();
            d.write(&gpu.stream, "x", &x).unwrap();
            (d, x)
        })
        .collect();
    for step in 0..12 {
        let (wd, w) = &weights[step % 2];
        let (xd, x) = &batches[step % 3];
        let lane_space = pipeline.lanes()[step % 2].space().clone();
        let lane_stream = pipeline.lanes()[step % 2].stream().clone();
        gpu.kernels
            .fill(&lane_stream, lane_space.slot("y").unwrap(), f32::NAN)
            .unwrap();
        let lane = pipeline.step(&[wd, xd]).unwrap();
        assert!(Arc::ptr_eq(lane.stream(), &lane_stream));
        lane.stream().synchronize().unwrap();
        let got: Vec<f32> = lane.space().read(lane.stream(), "y").unwrap();
        assert_matches(&got, &cpu_matmul(x, w, m, n, k), k, &format!("step {step}"));
    }
    pipeline.synchronize().unwrap();
}

/// Lane 0's graph spins 20 ms before `log = 2·log + 1`; lane 1's does `log = 2·log + 2` at
/// once. Replays in step order give 0 → 1 → 4 → 9 → 20 over four steps; had lane 1 been free to
/// run beside lane 0's spin, its update would land first and the result would differ.
#[test]
#[ignore = "needs a CUDA GPU"]
fn pipelined_replays_run_in_step_order_while_every_step_rebinds() {
    let gpu = gpu();
    let mut rng = rng("pipeline_order");
    let log_space = Space::new(
        &gpu.ctx,
        Layout::builder().scratch("log", 4).build().unwrap(),
    )
    .unwrap();
    let log = log_space.slot("log").unwrap().clone();
    let layout = Layout::builder()
        .group("in")
        .input("x", 1 << 20)
        .build()
        .unwrap();
    let kernels = gpu.kernels.clone();
    let mut lane_count = 0;
    let mut pipeline = Pipeline::new(&gpu.ctx, &layout, 2, SpaceOptions::default(), |space, _| {
        let lane = lane_count;
        lane_count += 1;
        let (kernels, log, x) = (kernels.clone(), log.clone(), space.slot("x")?.clone());
        Ok(move |s: &Arc<_>| {
            if lane == 0 {
                kernels.spin(s, std::time::Duration::from_millis(20))?;
            }
            // Reads the bound input too, so every replay uses the dataset bound for it.
            kernels.affine(s, &x, 1.0, 0.0)?;
            kernels.affine(s, &log, 2.0, lane as f32 + 1.0)
        })
    })
    .unwrap();
    assert!(pipeline.replays_in_order(), "in order by default");
    let probe = pipeline.lanes()[0].space().clone();
    let inputs: Vec<Dataset> = (0..3)
        .map(|_| {
            let d = probe.new_dataset("in").unwrap();
            d.write(&gpu.stream, "x", &random_vec(&mut rng, (1 << 20) / 4))
                .unwrap();
            d
        })
        .collect();
    gpu.kernels.fill(&gpu.stream, &log, 0.0).unwrap();
    gpu.stream.synchronize().unwrap();
    for step in 0..4 {
        pipeline.step(&[&inputs[step % 3]]).unwrap();
    }
    pipeline.synchronize().unwrap();
    let got: Vec<f32> = log_space.read(&gpu.stream, "log").unwrap();
    assert_eq!(got, [20.0], "replays ran out of step order");
}

#[test]
#[ignore = "needs a CUDA GPU"]
fn cublas_sgemm_captures_as_kernels_only_and_replays_on_rebound_data() {
    let gpu = gpu();
    let mut rng = rng("cublas_graph");
    let (m, n, k) = (256, 512, 384);
    let layout = Layout::builder()
        .group("inputs")
        .input("a", m * k * F32)
        .input("b", k * n * F32)
        .scratch("c", m * n * F32)
        .scratch("workspace", RECOMMENDED_WORKSPACE)
        .build()
        .unwrap();
    let space = Space::new(&gpu.ctx, layout).unwrap();
    let blas = Blas::new(&gpu.stream, space.slot("workspace").unwrap()).unwrap();
    let (a, b, c) = (
        space.slot("a").unwrap().clone(),
        space.slot("b").unwrap().clone(),
        space.slot("c").unwrap().clone(),
    );
    assert!(matches!(
        blas.sgemm(&a, &b, &c, m + 1, n, k),
        Err(Error::Layout(LayoutError::BufferTooSmall { .. }))
    ));
    let sets: Vec<(Dataset, Vec<f32>)> = (0..2)
        .map(|_| {
            let (x, y) = (random_vec(&mut rng, m * k), random_vec(&mut rng, k * n));
            let d = space.new_dataset("inputs").unwrap();
            d.write(&gpu.stream, "a", &x).unwrap();
            d.write(&gpu.stream, "b", &y).unwrap();
            (d, cpu_matmul(&x, &y, m, n, k))
        })
        .collect();
    space.bind(&sets[0].0).unwrap();
    blas.sgemm(&a, &b, &c, m, n, k).unwrap(); // warm-up outside the capture
    gpu.stream.synchronize().unwrap();
    let mut graph = space
        .capture(&gpu.stream, move |_| blas.sgemm(&a, &b, &c, m, n, k))
        .unwrap();
    let kinds = graph.node_kinds().unwrap();
    assert!(
        !kinds.is_empty() && kinds.iter().all(|k| *k == NodeKind::Kernel),
        "{kinds:?}"
    );
    for (data, want) in sets.iter().chain(sets.iter()) {
        space.bind(data).unwrap();
        assert!(graph.check_update().unwrap().is_success());
        gpu.kernels
            .fill(&gpu.stream, space.slot("c").unwrap(), f32::NAN)
            .unwrap();
        graph.replay().unwrap();
        assert_matches(
            &space.read(&gpu.stream, "c").unwrap(),
            want,
            k,
            "cuBLAS graph",
        );
    }
}
