//! cuBLAS SGEMM and bf16 GemmEx on slots, checked and safe, ready to be captured into a graph.

use std::sync::Arc;

use cudarc::driver::CudaStream;

use super::args::{dim, need, need_elems, BF16, F32};
use crate::buffer::DeviceBuffer;
use crate::driver::blas::{BlasHandle, Gemm, GemmBf16};
use crate::error::Result;

/// Bytes of workspace cuBLAS wants on Hopper; smaller GPUs use less of it.
pub const RECOMMENDED_WORKSPACE: usize = 32 << 20;

/// How the `B` operand of [`Blas::gemm_bf16`] is stored.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum WeightLayout {
    /// `k × n`, row-major: `C = A · B`.
    KByN,
    /// `n × k`, row-major, like a `torch.nn.Linear` weight (`out × in`): `C = A · Bᵀ`. This is
    /// the layout cuBLAS's GEMV-like kernels read best at small batch.
    NByK,
}

/// The element type [`Blas::gemm_bf16`] writes to `C`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum GemmOutput {
    /// bf16, rounded once from the FP32 accumulator.
    Bf16,
    /// The FP32 accumulator itself (for an epilogue kernel to finish).
    F32,
}

/// A cuBLAS handle bound to one stream, with a workspace this crate owns.
///
/// With a workspace set, cuBLAS puts no memory allocation nodes into captured graphs, so a graph
/// of SGEMMs over slots is pure kernels (check it with
/// [`StableGraph::node_kinds`](crate::StableGraph::node_kinds)). TF32 stays off (cuBLAS's
/// default math mode): results are true FP32.
#[derive(Debug)]
pub struct Blas {
    handle: BlasHandle,
}

impl Blas {
    /// A handle on `stream` using `workspace` (a scratch slot of at least
    /// [`RECOMMENDED_WORKSPACE`] bytes is right for any current GPU). The workspace must stay
    /// mapped while the handle is used.
    pub fn new(stream: &Arc<CudaStream>, workspace: &impl DeviceBuffer) -> Result<Self> {
        let handle = BlasHandle::new(stream)?;
        handle.set_workspace(workspace.device_address(), workspace.byte_len())?;
        Ok(Self { handle })
    }

    /// Enqueues row-major `C[m,n] = A[m,k] · B[k,n]` in FP32 on the handle's stream.
    #[allow(clippy::too_many_arguments)]
    pub fn sgemm(
        &self,
        a: &impl DeviceBuffer,
        b: &impl DeviceBuffer,
        c: &impl DeviceBuffer,
        m: usize,
        n: usize,
        k: usize,
    ) -> Result<()> {
        self.sgemm_scaled(1.0, a, b, 0.0, c, m, n, k)
    }

    /// Enqueues row-major `C[m,n] = alpha · A[m,k] · B[k,n] + beta · C[m,n]` in FP32. With
    /// `beta = 0`, C is only written (its old contents may be NaN). `alpha` and `beta` are host
    /// values, baked into a captured graph.
    #[allow(clippy::too_many_arguments)]
    pub fn sgemm_scaled(
        &self,
        alpha: f32,
        a: &impl DeviceBuffer,
        b: &impl DeviceBuffer,
        beta: f32,
        c: &impl DeviceBuffer,
        m: usize,
        n: usize,
        k: usize,
    ) -> Result<()> {
        let (mi, ni, ki) = (dim("m", m)?, dim("n", n)?, dim("k", k)?);
        need("sgemm A", a, [m, k])?;
        need("sgemm B", b, [k, n])?;
        need("sgemm C", c, [m, n])?;
        // Column-major cuBLAS computes Cᵀ = Bᵀ·Aᵀ, which is row-major C = A·B.
        let gemm = row_major([mi, ni, ki], alpha, a, b, ni, beta, c);
        self.handle.sgemm(gemm)
    }

    /// Enqueues row-major `C[m,n] = A[m,k] · B` in bf16 with FP32 accumulation
    /// (`cublasGemmEx`, `CUBLAS_COMPUTE_32F`, default algorithm) on the handle's stream. A and B
    /// are bf16 (16-bit patterns, e.g. `u16` slots); `layout` says how B is stored; C is written
    /// (never read, so it may hold NaN) as `output`. `[m, n, k]` is the shape.
    pub fn gemm_bf16(
        &self,
        a: &impl DeviceBuffer,
        b: &impl DeviceBuffer,
        layout: WeightLayout,
        c: &impl DeviceBuffer,
        output: GemmOutput,
        [m, n, k]: [usize; 3],
    ) -> Result<()> {
        let (mi, ni, ki) = (dim("m", m)?, dim("n", n)?, dim("k", k)?);
        need_elems("gemm_bf16 A", a, [m, k], BF16)?;
        need_elems("gemm_bf16 B", b, [k, n], BF16)?;
        let c_elem = match output {
            GemmOutput::Bf16 => BF16,
            GemmOutput::F32 => F32,
        };
        need_elems("gemm_bf16 C", c, [m, n], c_elem)?;
        // Column-major cuBLAS computes Cᵀ[n,m] = op(B')·Aᵀ, where B' is B's memory read
        // column-major: `n × k` as stored for KByN, `k × n` (so transposed) for NByK.
        let (transpose_a, lda) = match layout {
            WeightLayout::KByN => (false, ni),
            WeightLayout::NByK => (true, ki),
        };
        self.handle.gemm_bf16(GemmBf16 {
            gemm: row_major([mi, ni, ki], 1.0, a, b, lda, 0.0, c),
            transpose_a,
            c_f32: output == GemmOutput::F32,
        })
    }
}

/// Row-major `C[m,n] = alpha · A[m,k] · B + beta · C` as the column-major GEMM cuBLAS computes:
/// `Cᵀ[n,m] = op(B')·Aᵀ`, B's memory (leading dimension `b_lead`) as the first operand and A's
/// as the second.
fn row_major(
    [m, n, k]: [i32; 3],
    alpha: f32,
    a: &impl DeviceBuffer,
    b: &impl DeviceBuffer,
    b_lead: i32,
    beta: f32,
    c: &impl DeviceBuffer,
) -> Gemm {
    Gemm {
        m: n,
        n: m,
        k,
        alpha,
        a: b.device_address(),
        lda: b_lead,
        b: a.device_address(),
        ldb: k,
        beta,
        c: c.device_address(),
        ldc: n,
    }
}
