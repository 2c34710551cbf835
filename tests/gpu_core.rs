//! Core behaviour on a real GPU: fixed addresses, rebinding, graph reuse, ordering, errors, leaks.
//! Every result is checked against a CPU reference on fresh random data, outputs poisoned (NaN)
//! before each run.

mod common;

use std::sync::Arc;
use std::time::{Duration, Instant};

use common::{assert_matches, capture_matmul, cpu_matmul, gpu, random_vec, rng, Gpu};
use stablebuf::cudarc::driver::{CudaStream, LaunchConfig, PushKernelArg};
use stablebuf::device::memory_info;
use stablebuf::error::{GraphError, LayoutError};
use stablebuf::graph::{NodeKind, UpdateOutcome};
use stablebuf::kernels::MatmulKernel;
use stablebuf::{Dataset, Error, FencePolicy, Layout, Space, SpaceOptions, StableGraph};

const F32: usize = 4;

/// A matmul problem: `inputs` group with a, b; scratch output c.
struct Problem {
    m: usize,
    n: usize,
    k: usize,
}

impl Problem {
    fn layout(&self) -> Layout {
        Layout::builder()
            .group("inputs")
            .input("a", self.m * self.k * F32)
            .input("b", self.k * self.n * F32)
            .scratch("c", self.m * self.n * F32)
            .build()
            .unwrap()
    }

    /// A dataset with fresh random a and b, and the CPU reference for c.
    fn dataset(
        &self,
        gpu: &Gpu,
        space: &Space,
        rng: &mut rand::rngs::StdRng,
    ) -> (Dataset, Vec<f32>) {
        let a = random_vec(rng, self.m * self.k);
        let b = random_vec(rng, self.k * self.n);
        let dataset = space.new_dataset("inputs").unwrap();
        dataset.write(&gpu.stream, "a", &a).unwrap();
        dataset.write(&gpu.stream, "b", &b).unwrap();
        (dataset, cpu_matmul(&a, &b, self.m, self.n, self.k))
    }

    fn capture(&self, gpu: &Gpu, space: &Space, kind: MatmulKernel) -> StableGraph {
        capture_matmul(
            space,
            &gpu.stream,
            &gpu.kernels,
            kind,
            (self.m, self.n, self.k),
        )
    }

    /// Poisons c, replays, returns c.
    fn run(&self, gpu: &Gpu, space: &Space, graph: &StableGraph) -> Vec<f32> {
        poison(gpu, space, "c");
        graph.replay().unwrap();
        space.read(&gpu.stream, "c").unwrap()
    }
}

fn slots(space: &Space) -> (stablebuf::Slot, stablebuf::Slot, stablebuf::Slot) {
    (
        space.slot("a").unwrap().clone(),
        space.slot("b").unwrap().clone(),
        space.slot("c").unwrap().clone(),
    )
}

fn poison(gpu: &Gpu, space: &Space, slot: &str) {
    gpu.kernels
        .fill(&gpu.stream, space.slot(slot).unwrap(), f32::NAN)
        .unwrap();
}

#[test]
#[ignore = "needs a CUDA GPU"]
fn every_matmul_kernel_matches_the_cpu_reference() {
    let gpu = gpu();
    let mut rng = rng("every_matmul_kernel");
    let shapes = [
        (1, 1, 1),
        (17, 33, 9),
        (130, 70, 250),
        (256, 384, 128),
        (512, 512, 512),
    ];
    for (m, n, k) in shapes {
        let p = Problem { m, n, k };
        let space = Space::new(&gpu.ctx, p.layout()).unwrap();
        let (data, want) = p.dataset(&gpu, &space, &mut rng);
        space.bind(&data).unwrap();
        let (a, b, c) = slots(&space);
        for kind in [
            MatmulKernel::Naive,
            MatmulKernel::Tiled,
            MatmulKernel::Auto,
            MatmulKernel::RegisterTiled,
        ] {
            poison(&gpu, &space, "c");
            match gpu.kernels.matmul(&gpu.stream, kind, &a, &b, &c, m, n, k) {
                Ok(used) => {
                    let got: Vec<f32> = space.read(&gpu.stream, "c").unwrap();
                    assert_matches(&got, &want, k, &format!("{used:?} {m}x{n}x{k}"));
                    if kind == MatmulKernel::Auto {
                        let big = m % 128 == 0 && n % 128 == 0 && k % 8 == 0;
                        assert_eq!(used == MatmulKernel::RegisterTiled, big);
                    }
                }
                Err(Error::Layout(LayoutError::InvalidShape(_))) => {
                    assert_eq!(kind, MatmulKernel::RegisterTiled, "{m}x{n}x{k}")
                }
                Err(other) => panic!("{kind:?} {m}x{n}x{k}: {other}"),
            }
        }
    }
}

#[test]
#[ignore = "needs a CUDA GPU"]
fn addresses_stay_fixed_across_100_rebinds_and_every_replay_uses_the_bound_data() {
    let gpu = gpu();
    let mut rng = rng("addresses_stay_fixed");
    // Sizes that are not multiples of the granularity.
    let p = Problem {
        m: 96,
        n: 80,
        k: 72,
    };
    let space = Space::new(&gpu.ctx, p.layout()).unwrap();
    let addresses: Vec<u64> = space.slots().iter().map(|s| s.device_ptr()).collect();
    let datasets: Vec<(Dataset, Vec<f32>)> =
        (0..4).map(|_| p.dataset(&gpu, &space, &mut rng)).collect();
    let graph = p.capture(&gpu, &space, MatmulKernel::Auto);
    use rand::Rng;
    for step in 0..100 {
        let (data, want) = &datasets[rng.gen_range(0..datasets.len())];
        space.bind(data).unwrap();
        assert_eq!(space.bound_dataset("inputs").unwrap(), Some(data.id()));
        let now: Vec<u64> = space.slots().iter().map(|s| s.device_ptr()).collect();
        assert_eq!(now, addresses, "step {step}: an address moved");
        assert_matches(
            &p.run(&gpu, &space, &graph),
            want,
            p.k,
            &format!("step {step}"),
        );
    }
}

#[test]
#[ignore = "needs a CUDA GPU"]
fn update_check_succeeds_after_rebind_and_the_replay_uses_the_new_data() {
    let gpu = gpu();
    let mut rng = rng("update_check");
    let p = Problem {
        m: 256,
        n: 256,
        k: 256,
    };
    let space = Space::new(&gpu.ctx, p.layout()).unwrap();
    let (first, want_first) = p.dataset(&gpu, &space, &mut rng);
    let (second, want_second) = p.dataset(&gpu, &space, &mut rng);
    let mut graph = p.capture(&gpu, &space, MatmulKernel::Auto);
    assert_eq!(graph.node_kinds().unwrap(), [NodeKind::Kernel]);

    space.bind(&first).unwrap();
    assert_matches(&p.run(&gpu, &space, &graph), &want_first, p.k, "first");
    space.bind(&second).unwrap();
    let report = graph.check_update().unwrap();
    assert!(report.is_success(), "{report:?}");
    assert_eq!(report.error_node, None);
    assert!(report.update_time > Duration::ZERO);
    assert_matches(&p.run(&gpu, &space, &graph), &want_second, p.k, "second");
}

#[test]
#[ignore = "needs a CUDA GPU"]
fn a_changed_topology_is_reported_as_rejected_and_the_old_exec_still_works() {
    let gpu = gpu();
    let mut rng = rng("changed_topology");
    let p = Problem {
        m: 64,
        n: 48,
        k: 32,
    };
    let space = Space::new(&gpu.ctx, p.layout()).unwrap();
    let (data, want) = p.dataset(&gpu, &space, &mut rng);
    space.bind(&data).unwrap();
    let mut graph = p.capture(&gpu, &space, MatmulKernel::Tiled);

    let (a, b, c) = slots(&space);
    let kernels = gpu.kernels.clone();
    let report = graph
        .update_with(move |s| {
            kernels.fill(s, &c, 1.0)?;
            kernels
                .matmul(s, MatmulKernel::Tiled, &a, &b, &c, 64, 48, 32)
                .map(drop)
        })
        .unwrap();
    assert_eq!(report.outcome, UpdateOutcome::TopologyChanged, "{report:?}");
    assert_eq!(
        graph.node_kinds().unwrap(),
        [NodeKind::Kernel],
        "the graph keeps its old work"
    );
    assert_matches(
        &p.run(&gpu, &space, &graph),
        &want,
        p.k,
        "old exec after rejected update",
    );
    assert!(graph.check_update().unwrap().is_success());
}

/// Launches a 300 ms kernel then a matmul reading dataset `old` through the slots, then binds
/// `new` at once from the host. Returns how long the bind took and what the matmul wrote.
fn rebind_under_a_long_kernel(policy: FencePolicy) -> (Duration, Vec<f32>, Vec<f32>) {
    let gpu = gpu();
    let mut rng = rng("rebind_under_long_kernel");
    let p = Problem {
        m: 128,
        n: 128,
        k: 128,
    };
    let options = SpaceOptions::default().fence(policy);
    let space = Space::with_options(&gpu.ctx, p.layout(), options).unwrap();
    space.attach(&gpu.stream);
    let (old, want_old) = p.dataset(&gpu, &space, &mut rng);
    let (new, _) = p.dataset(&gpu, &space, &mut rng);
    space.bind(&old).unwrap();
    poison(&gpu, &space, "c");
    let (a, b, c) = slots(&space);
    gpu.kernels
        .spin(&gpu.stream, Duration::from_millis(300))
        .unwrap();
    gpu.kernels
        .matmul(&gpu.stream, MatmulKernel::Auto, &a, &b, &c, p.m, p.n, p.k)
        .unwrap();
    let start = Instant::now();
    space.bind(&new).unwrap();
    let waited = start.elapsed();
    let got = space.read(&gpu.stream, "c").unwrap();
    (waited, got, want_old)
}

#[test]
#[ignore = "needs a CUDA GPU"]
fn a_rebind_waits_for_a_long_kernel_on_the_old_backing_context_fence() {
    let (waited, got, want_old) = rebind_under_a_long_kernel(FencePolicy::Context);
    assert!(
        waited >= Duration::from_millis(200),
        "bind returned after {waited:?}: it did not wait"
    );
    assert_matches(&got, &want_old, 128, "result computed on the old backing");
}

#[test]
#[ignore = "needs a CUDA GPU"]
fn a_rebind_waits_for_a_long_kernel_on_the_old_backing_stream_fence() {
    let (waited, got, want_old) = rebind_under_a_long_kernel(FencePolicy::AttachedStreams);
    assert!(
        waited >= Duration::from_millis(200),
        "bind returned after {waited:?}: it did not wait"
    );
    assert_matches(&got, &want_old, 128, "result computed on the old backing");
}

#[test]
#[ignore = "needs a CUDA GPU"]
fn a_stream_fence_lets_one_space_rebind_while_another_space_computes() {
    let gpu = gpu();
    let mut rng = rng("stream_fence_overlap");
    let p = Problem {
        m: 64,
        n: 64,
        k: 64,
    };
    let options = SpaceOptions::default().fence(FencePolicy::AttachedStreams);
    let busy = Space::with_options(&gpu.ctx, p.layout(), options.clone()).unwrap();
    let idle = Space::with_options(&gpu.ctx, p.layout(), options).unwrap();
    let other_stream = gpu.ctx.new_stream().unwrap();
    busy.attach(&other_stream);
    let (x, _) = p.dataset(&gpu, &idle, &mut rng);
    let (y, want_y) = p.dataset(&gpu, &idle, &mut rng);
    idle.bind(&x).unwrap();
    let graph = p.capture(&gpu, &idle, MatmulKernel::Auto);

    gpu.kernels
        .spin(&other_stream, Duration::from_millis(300))
        .unwrap();
    let start = Instant::now();
    idle.bind(&y).unwrap();
    let waited = start.elapsed();
    assert!(
        waited < Duration::from_millis(150),
        "bind waited {waited:?} for another space's stream"
    );
    assert_matches(
        &p.run(&gpu, &idle, &graph),
        &want_y,
        p.k,
        "overlapped rebind",
    );
    other_stream.synchronize().unwrap();
}

#[test]
#[ignore = "needs a CUDA GPU"]
fn replay_while_unbound_is_a_typed_error_and_the_context_stays_usable() {
    let gpu = gpu();
    let mut rng = rng("replay_unbound");
    let p = Problem {
        m: 40,
        n: 56,
        k: 24,
    };
    let space = Space::new(&gpu.ctx, p.layout()).unwrap();
    let graph = p.capture(&gpu, &space, MatmulKernel::Auto);
    assert!(
        matches!(graph.replay(), Err(Error::Graph(GraphError::Unbound { group })) if group == "inputs")
    );

    let (first, want_first) = p.dataset(&gpu, &space, &mut rng);
    space.bind(&first).unwrap();
    assert_matches(&p.run(&gpu, &space, &graph), &want_first, p.k, "after bind");

    space.unbind("inputs").unwrap();
    assert!(matches!(
        graph.replay(),
        Err(Error::Graph(GraphError::Unbound { .. }))
    ));
    assert!(matches!(
        space.view::<f32>("a", &gpu.stream),
        Err(Error::Graph(GraphError::Unbound { .. }))
    ));

    // Dropping a bound dataset unbinds it.
    space.bind(&first).unwrap();
    drop(first);
    assert_eq!(space.bound_dataset("inputs").unwrap(), None);
    assert!(matches!(
        graph.replay(),
        Err(Error::Graph(GraphError::Unbound { .. }))
    ));

    let (second, want_second) = p.dataset(&gpu, &space, &mut rng);
    space.bind(&second).unwrap();
    assert_matches(
        &p.run(&gpu, &space, &graph),
        &want_second,
        p.k,
        "after the errors",
    );
}

#[test]
#[ignore = "needs a CUDA GPU"]
fn bad_inputs_are_typed_errors_and_leave_state_intact() {
    let gpu = gpu();
    let mut rng = rng("bad_inputs");
    let p = Problem {
        m: 32,
        n: 32,
        k: 32,
    };
    let space = Space::new(&gpu.ctx, p.layout()).unwrap();
    let (data, want) = p.dataset(&gpu, &space, &mut rng);
    space.bind(&data).unwrap();
    let graph = p.capture(&gpu, &space, MatmulKernel::Auto);

    assert!(matches!(
        space.slot("nope"),
        Err(Error::Layout(LayoutError::UnknownSlot { .. }))
    ));
    assert!(matches!(
        space.new_dataset("nope"),
        Err(Error::Layout(LayoutError::UnknownGroup { .. }))
    ));
    assert!(matches!(
        data.write(&gpu.stream, "c", &[0f32; 32 * 32]),
        Err(Error::Layout(LayoutError::UnknownSlot { .. }))
    ));
    assert!(matches!(
        data.write(&gpu.stream, "a", &[0f32; 7]),
        Err(Error::Layout(LayoutError::HostLength {
            slot_bytes: 4096,
            host_bytes: 28,
            ..
        }))
    ));
    assert!(matches!(
        space.write(&gpu.stream, "c", &[0f32; 3]),
        Err(Error::Layout(LayoutError::HostLength { .. }))
    ));
    assert!(matches!(
        data.view::<[u8; 3]>("a", &gpu.stream),
        Err(Error::Layout(LayoutError::ElementSize { .. }))
    ));

    // A dataset of another layout.
    let other = Space::new(
        &gpu.ctx,
        Problem {
            m: 32,
            n: 32,
            k: 33,
        }
        .layout(),
    )
    .unwrap();
    let foreign = other.new_dataset("inputs").unwrap();
    assert!(matches!(
        space.bind(&foreign),
        Err(Error::Layout(LayoutError::LayoutMismatch { .. }))
    ));
    assert_eq!(space.bound_dataset("inputs").unwrap(), Some(data.id()));

    // Binding from inside a capture.
    let inner = space.clone();
    let (again, _) = p.dataset(&gpu, &space, &mut rng);
    let again = Arc::new(again);
    let held = again.clone();
    let captured = space.capture(&gpu.stream, move |_| inner.bind(&held));
    assert!(
        matches!(captured, Err(Error::Graph(GraphError::BindDuringCapture))),
        "{captured:?}"
    );
    assert!(!gpu.stream.capture_status().is_ok_and(|s| s
        != stablebuf::cudarc::driver::sys::CUstreamCaptureStatus::CU_STREAM_CAPTURE_STATUS_NONE));

    // Kernel helpers refuse buffers that are too small instead of faulting.
    let (a, b, c) = slots(&space);
    assert!(matches!(
        gpu.kernels
            .matmul(&gpu.stream, MatmulKernel::Tiled, &a, &b, &c, 64, 32, 32),
        Err(Error::Layout(LayoutError::BufferTooSmall { .. }))
    ));
    assert!(matches!(
        gpu.kernels
            .matmul(&gpu.stream, MatmulKernel::Tiled, &a, &b, &c, 0, 32, 32),
        Err(Error::Layout(LayoutError::InvalidShape(_)))
    ));

    // Nothing above changed what is bound or what the graph computes.
    assert_eq!(space.bound_dataset("inputs").unwrap(), Some(data.id()));
    assert_matches(&p.run(&gpu, &space, &graph), &want, p.k, "after the errors");
}

#[test]
#[ignore = "needs a CUDA GPU"]
fn one_dataset_binds_into_several_spaces_with_the_same_layout() {
    let gpu = gpu();
    let mut rng = rng("shared_dataset");
    let p = Problem {
        m: 48,
        n: 64,
        k: 80,
    };
    let left = Space::new(&gpu.ctx, p.layout()).unwrap();
    let right = Space::new(&gpu.ctx, p.layout()).unwrap();
    assert_ne!(left.base(), right.base());
    let (data, want) = p.dataset(&gpu, &left, &mut rng);
    left.bind(&data).unwrap();
    right.bind(&data).unwrap();
    let gl = p.capture(&gpu, &left, MatmulKernel::Auto);
    let gr = p.capture(&gpu, &right, MatmulKernel::Auto);
    assert_matches(&p.run(&gpu, &left, &gl), &want, p.k, "left");
    assert_matches(&p.run(&gpu, &right, &gr), &want, p.k, "right");
    drop(data);
    assert!(matches!(
        gl.replay(),
        Err(Error::Graph(GraphError::Unbound { .. }))
    ));
    assert!(matches!(
        gr.replay(),
        Err(Error::Graph(GraphError::Unbound { .. }))
    ));
}

#[test]
#[ignore = "needs a CUDA GPU"]
fn slots_are_cudarc_citizens_kernel_args_copies_and_cublas() {
    use stablebuf::cudarc::cublas::{sys::cublasOperation_t, CudaBlas, Gemm, GemmConfig};
    let gpu = gpu();
    let mut rng = rng("cudarc_citizens");
    let (m, n, k) = (64usize, 96usize, 32usize);
    let p = Problem { m, n, k };
    let space = Space::new(&gpu.ctx, p.layout()).unwrap();
    let (data, want) = p.dataset(&gpu, &space, &mut rng);
    space.bind(&data).unwrap();

    // A slot straight into cudarc's launch builder.
    let f = gpu.kernels.module().load_function("matmul_naive").unwrap();
    let (a, b, c) = slots(&space);
    poison(&gpu, &space, "c");
    let (mi, ni, ki) = (m as i32, n as i32, k as i32);
    let cfg = LaunchConfig {
        grid_dim: (n.div_ceil(16) as u32, m.div_ceil(16) as u32, 1),
        block_dim: (16, 16, 1),
        shared_mem_bytes: 0,
    };
    let mut launch = gpu.stream.launch_builder(&f);
    launch.arg(&a).arg(&b).arg(&c).arg(&mi).arg(&ni).arg(&ki);
    // SAFETY: matmul_naive(const float*, const float*, float*, int, int, int); sizes match.
    unsafe { launch.launch(cfg) }.unwrap();
    assert_matches(
        &space.read(&gpu.stream, "c").unwrap(),
        &want,
        k,
        "launch_builder",
    );

    // cudarc copies and memset through views.
    let mut cv = space.view::<f32>("c", &gpu.stream).unwrap();
    gpu.stream.memset_zeros(&mut cv).unwrap();
    assert!(gpu
        .stream
        .clone_dtoh(&cv)
        .unwrap()
        .iter()
        .all(|&x| x == 0.0));
    let fresh = random_vec(&mut rng, m * n);
    gpu.stream.memcpy_htod(&fresh, &mut cv).unwrap();
    assert_eq!(gpu.stream.clone_dtoh(&cv).unwrap(), fresh);

    // cuBLAS SGEMM on views: row-major C = A·B is column-major Cᵀ = Bᵀ·Aᵀ.
    let blas = CudaBlas::new(gpu.stream.clone()).unwrap();
    let av = space.view::<f32>("a", &gpu.stream).unwrap();
    let bv = space.view::<f32>("b", &gpu.stream).unwrap();
    poison(&gpu, &space, "c");
    let cfg = GemmConfig {
        transa: cublasOperation_t::CUBLAS_OP_N,
        transb: cublasOperation_t::CUBLAS_OP_N,
        m: n as i32,
        n: m as i32,
        k: k as i32,
        alpha: 1.0f32,
        lda: n as i32,
        ldb: k as i32,
        beta: 0.0f32,
        ldc: n as i32,
    };
    // SAFETY: operand sizes match the GemmConfig.
    unsafe { blas.gemm(cfg, &bv, &av, &mut cv) }.unwrap();
    assert_matches(
        &gpu.stream.clone_dtoh(&cv).unwrap(),
        &want,
        k,
        "cuBLAS on slot views",
    );
}

#[test]
#[ignore = "needs a CUDA GPU"]
fn no_device_memory_leaks_over_repeated_create_bind_replay_drop_cycles() {
    let gpu = gpu();
    let mut rng = rng("no_leak");
    // 16 MiB + 8 MiB inputs per dataset, 8 MiB scratch; host data and references made once.
    let p = Problem {
        m: 1024,
        n: 2048,
        k: 2048,
    };
    let rows = 4; // the reference is checked on the first rows (a full CPU matmul is too slow)
    let inputs: Vec<(Vec<f32>, Vec<f32>, Vec<f32>)> = (0..3)
        .map(|_| {
            let (a, b) = (
                random_vec(&mut rng, p.m * p.k),
                random_vec(&mut rng, p.k * p.n),
            );
            let want = cpu_matmul(&a[..rows * p.k], &b, rows, p.n, p.k);
            (a, b, want)
        })
        .collect();
    let cycle = || {
        let space = Space::new(&gpu.ctx, p.layout()).unwrap();
        let sets: Vec<_> = inputs
            .iter()
            .map(|(a, b, want)| {
                let data = space.new_dataset("inputs").unwrap();
                data.write(&gpu.stream, "a", a).unwrap();
                data.write(&gpu.stream, "b", b).unwrap();
                (data, want)
            })
            .collect();
        let graph = p.capture(&gpu, &space, MatmulKernel::Auto);
        for (data, want) in &sets {
            space.bind(data).unwrap();
            let got = p.run(&gpu, &space, &graph);
            assert_matches(&got[..rows * p.n], want, p.k, "cycle");
        }
    };
    cycle(); // warm-up: module JIT and driver pools
    gpu.ctx.synchronize().unwrap();
    stablebuf::release::trim_all(); // memory held for release is not free to the driver
    let (baseline, _) = memory_info(&gpu.ctx).unwrap();
    for _ in 0..20 {
        cycle();
    }
    gpu.ctx.synchronize().unwrap();
    stablebuf::release::trim_all(); // memory held for release is not free to the driver
    let (after, _) = memory_info(&gpu.ctx).unwrap();
    eprintln!("free device memory: baseline {baseline}, after 20 cycles {after}");
    // One cycle holds ~80 MiB; leaking even one dataset per cycle would lose 480 MiB.
    assert!(
        baseline - after.min(baseline) <= 2 << 20,
        "lost {} bytes",
        baseline - after
    );
}

/// Launches with a stream that is not the capture stream keep working (and attach).
#[test]
#[ignore = "needs a CUDA GPU"]
fn replay_on_another_stream_computes_the_same_result() {
    let gpu = gpu();
    let mut rng = rng("replay_on");
    let p = Problem {
        m: 128,
        n: 256,
        k: 64,
    };
    let space = Space::new(&gpu.ctx, p.layout()).unwrap();
    let (data, want) = p.dataset(&gpu, &space, &mut rng);
    space.bind(&data).unwrap();
    let graph = p.capture(&gpu, &space, MatmulKernel::Auto);
    let other: Arc<CudaStream> = gpu.ctx.new_stream().unwrap();
    gpu.kernels
        .fill(&other, space.slot("c").unwrap(), f32::NAN)
        .unwrap();
    graph.replay_on(&other).unwrap();
    other.synchronize().unwrap();
    assert_matches(
        &space.read(&gpu.stream, "c").unwrap(),
        &want,
        p.k,
        "replay_on",
    );
}
