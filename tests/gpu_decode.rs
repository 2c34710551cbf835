//! GPU tests of the bf16 decode path: each decode kernel, cuBLAS bf16 GemmEx, and one captured
//! decode step rebound between weight sets, all against float32 CPU references on fresh random
//! data, outputs poisoned with NaN before every run.

mod common;
#[path = "../examples/decode/mod.rs"]
mod decode;

use std::sync::Arc;

use common::{gpu, rng, Gpu};
use decode::{
    compare, cpu_forward_row, fill_input, fill_weights, host_input, rms, work, Acts, HostWeights,
    Shape, Weights,
};
use rand::{rngs::StdRng, Rng};
use stablebuf::error::LayoutError;
use stablebuf::graph::NodeKind;
use stablebuf::kernels::{
    bf16_from_f32, f32_from_bf16, uniform_bf16, Activation, DecodeKernels, GemmOutput, WeightLayout,
};
use stablebuf::kernels::{Blas, RECOMMENDED_WORKSPACE};
use stablebuf::{Error, Layout, Space};

fn random_f32(rng: &mut StdRng, len: usize, scale: f32) -> Vec<f32> {
    (0..len).map(|_| rng.gen_range(-scale..scale)).collect()
}

fn random_bf16(rng: &mut StdRng, len: usize, scale: f32) -> Vec<u16> {
    (0..len)
        .map(|_| bf16_from_f32(rng.gen_range(-scale..scale)))
        .collect()
}

/// A space of scratch slots of the given byte sizes.
fn scratch(gpu: &Gpu, slots: &[(&str, usize)]) -> Space {
    let layout = slots
        .iter()
        .fold(Layout::builder(), |b, (name, bytes)| {
            b.scratch(*name, *bytes)
        })
        .build()
        .unwrap();
    Space::new(&gpu.ctx, layout).unwrap()
}

/// Every element of `got` (bf16 bits) within `ulps` bf16 units in the last place of `want` (FP32
/// before rounding), plus `atol`; NaN never is.
fn assert_bf16_close(got: &[u16], want: &[f32], ulps: f32, atol: f32, what: &str) {
    assert_eq!(got.len(), want.len(), "{what}: length");
    for (i, (&g, &w)) in got.iter().zip(want).enumerate() {
        let g = f32_from_bf16(g);
        let w_rounded = f32_from_bf16(bf16_from_f32(w));
        let allowed = ulps * w_rounded.abs() / 128.0 + atol;
        assert!(
            (g - w_rounded).abs() <= allowed,
            "{what}: element {i}: got {g}, want {w_rounded} (unrounded {w})"
        );
    }
}

#[test]
#[ignore = "needs a CUDA GPU"]
fn decode_kernels_match_the_cpu() {
    let gpu = gpu();
    let s = &gpu.stream;
    let dk = DecodeKernels::load(&gpu.ctx).unwrap();
    let mut rng = rng("decode_kernels_match_the_cpu");
    // Neither a multiple of the 256-thread block nor of each other.
    let (rows, cols) = (5usize, 1000usize);
    let n = rows * cols;
    let space = scratch(
        &gpu,
        &[
            ("y", n * 4),
            ("bias", cols * 2),
            ("res", n * 2),
            ("out", n * 2),
            ("gamma", cols * 2),
            ("f", n * 4),
            ("sums", 4096 * 4),
            ("small", (n - 1) * 2),
        ],
    );
    let slot = |name: &str| space.slot(name).unwrap().clone();
    let (y, bias, res, out, gamma, f, sums, small) = (
        slot("y"),
        slot("bias"),
        slot("res"),
        slot("out"),
        slot("gamma"),
        slot("f"),
        slot("sums"),
        slot("small"),
    );
    let y_host = random_f32(&mut rng, n, 3.0);
    let bias_host = random_bf16(&mut rng, cols, 0.5);
    let res_host = random_bf16(&mut rng, n, 2.0);
    let gamma_host: Vec<u16> = (0..cols)
        .map(|_| bf16_from_f32(rng.gen_range(0.5f32..1.5)))
        .collect();
    space.write(s, "y", &y_host).unwrap();
    space.write(s, "bias", &bias_host).unwrap();
    space.write(s, "res", &res_host).unwrap();
    space.write(s, "gamma", &gamma_host).unwrap();
    let read = |name: &str| -> Vec<u16> { space.read(s, name).unwrap() };
    let bias_at = |i: usize| f32_from_bf16(bias_host[i % cols]);

    for act in [Activation::Identity, Activation::GeluTanh, Activation::Silu] {
        dk.fill(s, &out, f32::NAN).unwrap();
        dk.bias_act(s, &y, &bias, &out, [rows, cols], act).unwrap();
        let want: Vec<f32> = (0..n).map(|i| act.apply(y_host[i] + bias_at(i))).collect();
        assert_bf16_close(&read("out"), &want, 1.0, 1e-6, &format!("bias_act {act:?}"));
    }

    // residual + (y + bias): the same two FP32 additions on both sides, so bit for bit.
    let want: Vec<u16> = (0..n)
        .map(|i| bf16_from_f32(f32_from_bf16(res_host[i]) + (y_host[i] + bias_at(i))))
        .collect();
    dk.fill(s, &out, f32::NAN).unwrap();
    dk.residual_add(s, &y, &bias, &res, &out, [rows, cols])
        .unwrap();
    assert_eq!(read("out"), want, "residual_add");
    space.write(s, "out", &res_host).unwrap();
    dk.residual_add(s, &y, &bias, &out, &out, [rows, cols])
        .unwrap();
    assert_eq!(read("out"), want, "residual_add in place");

    let eps = 1e-5f32;
    let want: Vec<f32> = (0..rows)
        .flat_map(|r| {
            let row: Vec<f32> = res_host[r * cols..(r + 1) * cols]
                .iter()
                .map(|&b| f32_from_bf16(b))
                .collect();
            let mean_square = row.iter().map(|v| f64::from(*v).powi(2)).sum::<f64>() / cols as f64;
            let scale = (1.0 / (mean_square + f64::from(eps)).sqrt()) as f32;
            row.into_iter()
                .zip(&gamma_host)
                .map(move |(v, &g)| v * scale * f32_from_bf16(g))
                .collect::<Vec<_>>()
        })
        .collect();
    dk.fill(s, &out, f32::NAN).unwrap();
    dk.rms_norm(s, &res, &gamma, &out, [rows, cols], eps)
        .unwrap();
    assert_bf16_close(&read("out"), &want, 2.0, 1e-6, "rms_norm");
    space.write(s, "out", &res_host).unwrap();
    dk.rms_norm(s, &out, &gamma, &out, [rows, cols], eps)
        .unwrap();
    assert_bf16_close(&read("out"), &want, 2.0, 1e-6, "rms_norm in place");

    dk.fill(s, &out, 1.5).unwrap();
    assert!(read("out").iter().all(|&b| b == 0x3fc0), "fill 1.5");
    dk.fill(s, &out, f32::NAN).unwrap();
    assert!(
        read("out").iter().all(|&b| f32_from_bf16(b).is_nan()),
        "fill NaN"
    );

    let seed: u64 = rng.gen();
    dk.fill_uniform(s, &out, seed, -0.75, 0.5).unwrap();
    let want: Vec<u16> = (0..n as u64)
        .map(|i| uniform_bf16(seed, i, -0.75, 0.5))
        .collect();
    assert_eq!(read("out"), want, "fill_uniform, seed {seed}");

    // FP32 → bf16, with the cases rounding gets wrong: ties, specials, overflow.
    let mut floats = random_f32(&mut rng, n, 1e4);
    let specials = [
        f32::NAN,
        f32::INFINITY,
        f32::NEG_INFINITY,
        -0.0,
        0.0,
        f32::MAX,
        f32::MIN_POSITIVE / 3.0,
        1.0 + 1.0 / 256.0,
        1.0 + 3.0 / 256.0,
        f32::from_bits(0x3f80_8001),
    ];
    floats[..specials.len()].copy_from_slice(&specials);
    space.write(s, "f", &floats).unwrap();
    dk.fill(s, &out, f32::NAN).unwrap();
    dk.to_bf16(s, &f, &out, n).unwrap();
    for (i, (&got, &v)) in read("out").iter().zip(&floats).enumerate() {
        let want = bf16_from_f32(v);
        assert!(
            got == want || (v.is_nan() && f32_from_bf16(got).is_nan()),
            "to_bf16 element {i} ({v}): got {got:#06x}, want {want:#06x}"
        );
    }
    gpu.kernels.fill(s, &f, f32::NAN).unwrap();
    dk.to_f32(s, &res, &f, n).unwrap();
    let got: Vec<f32> = space.read(s, "f").unwrap();
    let want: Vec<f32> = res_host.iter().map(|&b| f32_from_bf16(b)).collect();
    assert_eq!(got, want, "to_f32");

    gpu.kernels.fill(s, &sums, f32::NAN).unwrap();
    let count = dk.partial_sums(s, &res, &sums).unwrap();
    assert_eq!(count, DecodeKernels::partial_sum_count(n));
    let partial: Vec<f32> = space.read(s, "sums").unwrap();
    assert!(
        partial[count..].iter().all(|v| v.is_nan()),
        "wrote past its count"
    );
    let total: f64 = partial[..count].iter().map(|&v| f64::from(v)).sum();
    let want: f64 = want.iter().map(|&v| f64::from(v)).sum();
    let magnitude: f64 = res_host
        .iter()
        .map(|&b| f64::from(f32_from_bf16(b)).abs())
        .sum();
    assert!(
        (total - want).abs() <= 1e-5 * magnitude,
        "partial_sums: {total} vs {want}"
    );

    // Sizes are checked on the host: nothing launches.
    assert!(matches!(
        dk.bias_act(s, &y, &bias, &small, [rows, cols], Activation::Silu),
        Err(Error::Layout(LayoutError::BufferTooSmall { .. }))
    ));
    assert!(matches!(
        dk.rms_norm(s, &res, &gamma, &out, [rows, cols], f32::NAN),
        Err(Error::Layout(LayoutError::InvalidShape(_)))
    ));
    assert!(matches!(
        dk.residual_add(s, &y, &bias, &res, &out, [rows, cols + 1]),
        Err(Error::Layout(LayoutError::BufferTooSmall { .. }))
    ));
    let tiny = scratch(&gpu, &[("t", 8)]);
    assert!(matches!(
        dk.partial_sums(s, &res, tiny.slot("t").unwrap()),
        Err(Error::Layout(LayoutError::BufferTooSmall { .. }))
    ));
    s.synchronize().unwrap();
}

#[test]
#[ignore = "needs a CUDA GPU"]
fn gemm_bf16_matches_the_cpu() {
    let gpu = gpu();
    let s = &gpu.stream;
    let mut rng = rng("gemm_bf16_matches_the_cpu");
    for (m, n, k) in [(1usize, 96usize, 40usize), (3, 40, 72), (8, 256, 128)] {
        for layout in [WeightLayout::KByN, WeightLayout::NByK] {
            for output in [GemmOutput::F32, GemmOutput::Bf16] {
                let what = format!("{m}x{n}x{k} {layout:?} {output:?}");
                let c_elem = if output == GemmOutput::F32 { 4 } else { 2 };
                let space = scratch(
                    &gpu,
                    &[
                        ("a", m * k * 2),
                        ("b", k * n * 2),
                        ("c", m * n * c_elem),
                        ("ws", RECOMMENDED_WORKSPACE),
                    ],
                );
                let a = random_bf16(&mut rng, m * k, 1.0);
                let b = random_bf16(&mut rng, k * n, 1.0);
                space.write(s, "a", &a).unwrap();
                space.write(s, "b", &b).unwrap();
                let slot = |name: &str| space.slot(name).unwrap().clone();
                let (sa, sb, sc) = (slot("a"), slot("b"), slot("c"));
                let blas = Blas::new(s, space.slot("ws").unwrap()).unwrap();
                // NaN in either element width: 0xffff halves are bf16 NaN, pairs are FP32 NaN.
                space
                    .write(s, "c", &vec![0xffffu16; m * n * c_elem / 2])
                    .unwrap();
                blas.gemm_bf16(&sa, &sb, layout, &sc, output, [m, n, k])
                    .unwrap();
                let got: Vec<f32> = match output {
                    GemmOutput::F32 => space.read(s, "c").unwrap(),
                    GemmOutput::Bf16 => {
                        let c: Vec<u16> = space.read(s, "c").unwrap();
                        c.into_iter().map(f32_from_bf16).collect()
                    }
                };
                let weight = |p: usize, j: usize| match layout {
                    WeightLayout::KByN => b[p * n + j],
                    WeightLayout::NByK => b[j * k + p],
                };
                for i in 0..m {
                    for j in 0..n {
                        let terms: Vec<f64> = (0..k)
                            .map(|p| {
                                f64::from(f32_from_bf16(a[i * k + p]))
                                    * f64::from(f32_from_bf16(weight(p, j)))
                            })
                            .collect();
                        let want = terms.iter().sum::<f64>() as f32;
                        let scale = terms.iter().map(|t| t.abs()).sum::<f64>() as f32;
                        let got = got[i * n + j];
                        let rounding = if output == GemmOutput::Bf16 {
                            want.abs() / 128.0
                        } else {
                            0.0
                        };
                        assert!(
                            (got - want).abs() <= 1e-4 * scale + rounding + 1e-6,
                            "{what}: C[{i},{j}] = {got}, want {want}"
                        );
                    }
                }
                assert!(matches!(
                    blas.gemm_bf16(&sa, &sb, layout, &sc, output, [m, n + 1, k]),
                    Err(Error::Layout(LayoutError::BufferTooSmall { .. }))
                ));
                assert!(matches!(
                    blas.gemm_bf16(&sa, &sb, layout, &sc, output, [0, n, k]),
                    Err(Error::Layout(LayoutError::InvalidShape(_)))
                ));
            }
        }
    }
    s.synchronize().unwrap();
}

#[test]
#[ignore = "needs a CUDA GPU"]
fn decode_step_rebinds_between_weight_sets() {
    let gpu = gpu();
    let s = &gpu.stream;
    let dk = Arc::new(DecodeKernels::load(&gpu.ctx).unwrap());
    let mut rng = rng("decode_step_rebinds_between_weight_sets");
    let shape = Shape {
        layers: 2,
        hidden: 256,
        ratio: 4,
        max_batch: 8,
        act: Activation::GeluTanh,
        ranks: 1,
        rank: 0,
    };
    let batch = 3;
    let h = shape.hidden;
    let space = Space::new(&gpu.ctx, decode::layout(shape).unwrap()).unwrap();
    let (seed_a, seed_b, seed_x): (u64, u64, u64) = (rng.gen(), rng.gen(), rng.gen());
    // Set A filled on the device, set B written from the host: both paths give these values.
    let (host_a, host_b) = (
        HostWeights::generate(shape, seed_a),
        HostWeights::generate(shape, seed_b),
    );
    let set_a = space.new_dataset("weights").unwrap();
    fill_weights(
        &dk,
        s,
        &Weights::home(&set_a, shape).unwrap(),
        shape,
        seed_a,
    )
    .unwrap();
    let set_b = space.new_dataset("weights").unwrap();
    host_b.upload(&set_b, s).unwrap();
    let acts = Acts::in_space(&space).unwrap();
    fill_input(&dk, s, &acts, seed_x).unwrap();
    let x0 = host_input(shape, seed_x);
    let blas = Arc::new(Blas::new(s, &acts.workspace).unwrap());
    space.bind(&set_a).unwrap();
    let mut step = work(
        blas,
        dk.clone(),
        Weights::in_space(&space, shape).unwrap(),
        acts,
        shape,
        batch,
        None,
    );
    step(s).unwrap(); // cuBLAS chooses and loads its kernels outside the capture
    s.synchronize().unwrap();
    let mut graph = space.capture(s, step).unwrap();

    let kinds = graph.node_kinds().unwrap();
    let kernels = kinds.iter().filter(|k| **k == NodeKind::Kernel).count();
    eprintln!(
        "decode graph: {} nodes, {kernels} kernels: {kinds:?}",
        kinds.len()
    );
    assert!(
        kinds
            .iter()
            .all(|k| matches!(k, NodeKind::Kernel | NodeKind::Memset)),
        "only kernels (and cuBLAS memsets) expected, no allocation nodes: {kinds:?}"
    );
    assert!(
        kernels >= shape.own_kernels() + 2 * shape.layers,
        "{kernels} kernels for {} layers",
        shape.layers
    );

    let rows = [0, 1, batch - 1];
    let run = |graph: &stablebuf::StableGraph| -> Vec<u16> {
        dk.fill(s, &acts.x, f32::NAN).unwrap();
        graph.replay().unwrap();
        let x: Vec<u16> = space.read(s, "x").unwrap();
        assert!(
            x[batch * h..].iter().all(|&b| f32_from_bf16(b).is_nan()),
            "rows past the batch were written"
        );
        x
    };
    let row_of = |x: &[u16], r: usize| -> Vec<f32> {
        x[r * h..(r + 1) * h]
            .iter()
            .map(|&b| f32_from_bf16(b))
            .collect()
    };
    let mut outputs = Vec::new();
    for (name, set, host) in [
        ("A", &set_a, &host_a),
        ("B", &set_b, &host_b),
        ("A again", &set_a, &host_a),
    ] {
        space.bind(set).unwrap();
        let report = graph.check_update().unwrap();
        assert!(report.is_success(), "{report:?}");
        let x = run(&graph);
        for &r in &rows {
            let want = cpu_forward_row(host, &x0, r, shape);
            let got = row_of(&x, r);
            let (worst, ok) = compare(&got, &want, 1.0 / 64.0, 0.02 * rms(&want));
            eprintln!(
                "set {name}, row {r}: max |diff| {worst} (rms {})",
                rms(&want)
            );
            assert!(ok, "set {name}, row {r}: max |diff| {worst}");
        }
        outputs.push(x);
    }
    // The check tells the sets apart: B's output is far from A's reference.
    let want_a = cpu_forward_row(&host_a, &x0, 0, shape);
    let (_, ok) = compare(
        &row_of(&outputs[1], 0),
        &want_a,
        1.0 / 64.0,
        0.02 * rms(&want_a),
    );
    assert!(!ok, "set B's output passed as set A's");
    assert_eq!(outputs[0], outputs[2], "same set, same bits");
}
