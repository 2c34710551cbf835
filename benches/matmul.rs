//! The register-tiled PTX matmul vs cuBLAS SGEMM (FP32, TF32 off), GPU time by CUDA events,
//! in paired rounds.

mod common;

use common::{criterion, gpu, Ratio, Recorder, Variants};
use stablebuf::cudarc::driver::sys::CUevent_flags;
use stablebuf::kernels::{Blas, MatmulKernel, RECOMMENDED_WORKSPACE};
use stablebuf::{Layout, Space};

const GROUP: &str = "matmul";
/// Launches per timed variant run: two, so the events' own overhead is small even at 1024^3.
const LAUNCHES: usize = 2;

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
        group
            .throughput(criterion::Throughput::Elements(2 * (n as u64).pow(3)))
            .sampling_mode(criterion::SamplingMode::Flat);
        let launch = |variant: &str| match variant {
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
        // GPU seconds per launch, from events around a few back-to-back launches.
        let gpu_time = |variant: &str| {
            let event = || {
                gpu.ctx
                    .new_event(Some(CUevent_flags::CU_EVENT_DEFAULT))
                    .unwrap()
            };
            let (start, end) = (event(), event());
            start.record(&gpu.stream).unwrap();
            for _ in 0..LAUNCHES {
                launch(variant);
            }
            end.record(&gpu.stream).unwrap();
            f64::from(start.elapsed_ms(&end).unwrap()) / 1e3 / LAUNCHES as f64
        };
        Variants::new(GROUP)
            .add("ptx-regtile", || gpu_time("ptx-regtile"))
            .add("cublas", || gpu_time("cublas"))
            .bench(&mut group, &rec, &row);
        group.finish();
    }
    c.final_summary();
    let rows: Vec<String> = sizes.iter().map(|n| format!("{n}^3")).collect();
    rec.paired_table(
        GROUP,
        &["ptx-regtile", "cublas"],
        &rows,
        "µs of GPU time per launch",
        1e6,
        &[Ratio::of("cublas", "ptx-regtile")],
    );
    println!(
        "\n== matmul, GFLOP/s (medians); PTX as a share of cuBLAS is the per-round ratio above"
    );
    println!("{:<10} {:>14} {:>14}", "size", "ptx-regtile", "cublas");
    for &n in &sizes {
        let row = format!("{n}^3");
        let flops = 2.0 * (n as f64).powi(3);
        if let (Some(p), Some(b)) = (
            rec.median(GROUP, &row, "ptx-regtile"),
            rec.median(GROUP, &row, "cublas"),
        ) {
            println!(
                "{row:<10} {:>14.0} {:>14.0}",
                flops / p / 1e9,
                flops / b / 1e9
            );
        }
    }
}
