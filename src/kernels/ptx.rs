//! The PTX `build.rs` compiled from `kernels/matmul.cu`.

/// PTX for every kernel in `kernels/matmul.cu`, targeting `compute_70` (JIT-compiled by the
/// driver on any newer GPU). The first line is the source fingerprint.
pub const PTX: &str = include_str!(concat!(env!("OUT_DIR"), "/matmul.ptx"));

/// How `build.rs` produced [`PTX`]: `nvcc <release> (<arch>)`, `nvrtc <version> (<arch>)` or
/// `committed` (the fallback copy under `kernels/`).
pub const PTX_COMPILER: &str = env!("STABLEBUF_PTX_COMPILER");
