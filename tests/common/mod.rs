//! Helpers for the GPU tests: a device or a clear panic, fresh random data, CPU references.
#![allow(dead_code)]

use std::sync::Arc;
use std::time::{SystemTime, UNIX_EPOCH};

use rand::{rngs::StdRng, Rng, SeedableRng};

pub mod deadline;
pub mod leaks;
pub mod patterns;
use stablebuf::cudarc::driver::{CudaContext, CudaStream};
use stablebuf::kernels::Kernels;
use stablebuf::open_device;

pub struct Gpu {
    pub ctx: Arc<CudaContext>,
    pub stream: Arc<CudaStream>,
    pub kernels: Arc<Kernels>,
}

/// Test output through libtest's capture, filtered by RUST_LOG as `target=level` directives
/// ("stablebuf=debug", "trace"); unset: nothing.
fn init_test_logging() {
    use tracing_subscriber::filter::{LevelFilter, Targets};
    use tracing_subscriber::layer::SubscriberExt;
    use tracing_subscriber::util::SubscriberInitExt;
    let filter = std::env::var("RUST_LOG")
        .ok()
        .and_then(|value| value.parse::<Targets>().ok())
        .unwrap_or_else(|| Targets::new().with_default(LevelFilter::OFF));
    let _ = tracing_subscriber::registry()
        .with(tracing_subscriber::fmt::layer().with_test_writer())
        .with(filter)
        .try_init();
}

/// Device 0, a fresh stream and the kernels. GPU tests are `#[ignore]`d, so this only runs when
/// asked for with `--include-ignored`; without a GPU that is a failure, with this message.
pub fn gpu() -> Gpu {
    init_test_logging();
    let ctx = open_device(0).expect("this test needs a CUDA GPU and driver");
    let stream = ctx.new_stream().expect("new stream");
    let kernels = Arc::new(Kernels::load(&ctx).expect("load kernels"));
    Gpu {
        ctx,
        stream,
        kernels,
    }
}

/// A random generator with a fresh seed, printed so a failure can be replayed.
pub fn rng(test: &str) -> StdRng {
    let seed = std::env::var("STABLEBUF_SEED")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or_else(|| {
            SystemTime::now()
                .duration_since(UNIX_EPOCH)
                .unwrap()
                .as_nanos() as u64
        });
    eprintln!("{test}: seed {seed} (set STABLEBUF_SEED to replay)");
    StdRng::seed_from_u64(seed)
}

pub fn random_vec(rng: &mut StdRng, len: usize) -> Vec<f32> {
    (0..len).map(|_| rng.gen_range(-1.0f32..1.0)).collect()
}

/// Row-major C = A·B in f64.
pub fn cpu_matmul(a: &[f32], b: &[f32], m: usize, n: usize, k: usize) -> Vec<f32> {
    let mut c = vec![0f32; m * n];
    for i in 0..m {
        for j in 0..n {
            let mut acc = 0f64;
            for p in 0..k {
                acc += f64::from(a[i * k + p]) * f64::from(b[p * n + j]);
            }
            c[i * n + j] = acc as f32;
        }
    }
    c
}

/// Every element close to the reference (FP32 accumulation over `k` terms); NaN never is.
pub fn assert_matches(got: &[f32], want: &[f32], k: usize, what: &str) {
    assert_eq!(got.len(), want.len(), "{what}: length");
    let epsilon = 2e-6 * k as f32;
    for (i, (g, w)) in got.iter().zip(want).enumerate() {
        assert!(
            approx::relative_eq!(*g, *w, epsilon = epsilon, max_relative = 1e-4),
            "{what}: element {i}: got {g}, want {w}"
        );
    }
}

/// Largest absolute difference, for printing.
pub fn max_abs_error(got: &[f32], want: &[f32]) -> f32 {
    got.iter()
        .zip(want)
        .map(|(g, w)| (g - w).abs())
        .fold(0.0, |m, e| if e.is_nan() { f32::NAN } else { m.max(e) })
}

/// Captures `C = A·B` (`m × k` by `k × n`) over slots "a", "b" and "c" of `space` on `stream`.
pub fn capture_matmul(
    space: &stablebuf::Space,
    stream: &Arc<CudaStream>,
    kernels: &Arc<Kernels>,
    kind: stablebuf::kernels::MatmulKernel,
    (m, n, k): (usize, usize, usize),
) -> stablebuf::StableGraph {
    let slot = |name: &str| space.slot(name).unwrap().clone();
    let (a, b, c, kernels) = (slot("a"), slot("b"), slot("c"), kernels.clone());
    space
        .capture(stream, move |s| {
            kernels.matmul(s, kind, &a, &b, &c, m, n, k).map(drop)
        })
        .unwrap()
}
