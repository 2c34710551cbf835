//! The register-tiled PTX matmul vs cuBLAS SGEMM (FP32, TF32 off), GPU time by CUDA events.

mod common;

use std::time::Duration;

use common::{criterion, gpu, Recorder};
use stablebuf::cudarc::driver::sys::CUevent_flags;
use stablebuf::{Blas, Layout, MatmulKernel, Space, RECOMMENDED_WORKSPACE};

const GROUP: &str = "matmul";

fn main() {
    let Some(gpu) = gpu() else { return };
    let rec = Recorder::default();
    let mut c = criterion();
    let sizes = [1024usize, 2048, 4096, 8192];
    for &n in &sizes {
        let bytes = n * n * 4;
        let layout = Layout::builder()
            .scratch("a", bytes)
            .scratch("b", bytes)
            .scratch("c", bytes)
            .scratch("ws", RECOMMENDED_WORKSPACE)
            .build()
            .unwrap();
        let space = Space::new(&gpu.ctx, layout).unwrap();
        let (a, b, cc) = (
            space.slot("a").unwrap().clone(),
            space.slot("b").unwrap().clone(),
            space.slot("c").unwrap().clone(),
        );
        gpu.kernels.fill(&gpu.stream, &a, 0.5).unwrap();
        gpu.kernels.fill(&gpu.stream, &b, -0.25).unwrap();
        let blas = Blas::new(&gpu.stream, space.slot("ws").unwrap()).unwrap();
        let row = format!("{n}^3");
        let mut group = c.benchmark_group(GROUP);
        group.throughput(criterion::Throughput::Elements(2 * (n as u64).pow(3)));
        for variant in ["ptx-regtile", "cublas"] {
            let launch = || match variant {
                "cublas" => blas.sgemm(&a, &b, &cc, n, n, n).unwrap(),
                _ => assert_eq!(
                    gpu.kernels
                        .matmul(
                            &gpu.stream,
                            MatmulKernel::RegisterTiled,
                            &a,
                            &b,
                            &cc,
                            n,
                            n,
                            n
                        )
                        .unwrap(),
                    MatmulKernel::RegisterTiled
                ),
            };
            launch();
            gpu.stream.synchronize().unwrap();
            group.bench_function(format!("{variant}/{n}"), |bench| {
                bench.iter_custom(|iters| {
                    let start = gpu
                        .ctx
                        .new_event(Some(CUevent_flags::CU_EVENT_DEFAULT))
                        .unwrap();
                    let end = gpu
                        .ctx
                        .new_event(Some(CUevent_flags::CU_EVENT_DEFAULT))
                        .unwrap();
                    start.record(&gpu.stream).unwrap();
                    for _ in 0..iters {
                        launch();
                    }
                    end.record(&gpu.stream).unwrap();
                    let seconds = f64::from(start.elapsed_ms(&end).unwrap()) / 1e3;
                    rec.record(GROUP, &row, variant, seconds / iters as f64);
                    Duration::from_secs_f64(seconds)
                })
            });
        }
        group.finish();
    }
    c.final_summary();
    println!("\n== matmul, GFLOP/s (medians, GPU time by events)");
    println!(
        "{:<10} {:>14} {:>14} {:>18}",
        "size", "ptx-regtile", "cublas", "ptx/cublas"
    );
    for &n in &sizes {
        let row = format!("{n}^3");
        let flops = 2.0 * (n as f64).powi(3);
        if let (Some(p), Some(b)) = (
            rec.median(GROUP, &row, "ptx-regtile"),
            rec.median(GROUP, &row, "cublas"),
        ) {
            println!(
                "{row:<10} {:>14.0} {:>14.0} {:>17.0}%",
                flops / p / 1e9,
                flops / b / 1e9,
                b / p * 100.0
            );
        }
    }
}
