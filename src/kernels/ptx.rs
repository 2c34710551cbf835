//! The PTX `build.rs` compiled from `kernels/matmul.cu`, `kernels/decode.cu` and
//! `kernels/decode_attention.cu`.

/// PTX for every kernel in `kernels/matmul.cu`, targeting `compute_70` (JIT-compiled by the
/// driver on any newer GPU). The first line is the source fingerprint.
pub const PTX: &str = include_str!(concat!(env!("OUT_DIR"), "/matmul.ptx"));

/// How `build.rs` produced [`PTX`]: `nvcc <release> (<arch>)`, `nvrtc <version> (<arch>)` or
/// `committed` (the fallback copy under `kernels/`).
pub const PTX_COMPILER: &str = env!("STABLEBUF_PTX_COMPILER");

/// PTX for the bf16 decode kernels in `kernels/decode.cu` (loaded by
/// [`DecodeKernels`](super::DecodeKernels)), like [`PTX`]: `compute_70`, fingerprint first.
pub const PTX_DECODE: &str = include_str!(concat!(env!("OUT_DIR"), "/decode.ptx"));

/// How `build.rs` produced [`PTX_DECODE`] (same forms as [`PTX_COMPILER`]).
pub const PTX_DECODE_COMPILER: &str = env!("STABLEBUF_PTX_DECODE_COMPILER");

/// PTX for the decode attention over a KV cache in `kernels/decode_attention.cu` (loaded by
/// [`AttentionKernels`](super::AttentionKernels)), like [`PTX`].
pub const PTX_ATTENTION: &str = include_str!(concat!(env!("OUT_DIR"), "/decode_attention.ptx"));

/// How `build.rs` produced [`PTX_ATTENTION`] (same forms as [`PTX_COMPILER`]).
pub const PTX_ATTENTION_COMPILER: &str = env!("STABLEBUF_PTX_ATTENTION_COMPILER");
