//! cuBLAS SGEMM on slots, checked and safe, ready to be captured into a graph.

use std::sync::Arc;

use cudarc::driver::CudaStream;

use super::{dim, need};
use crate::buffer::DeviceBuffer;
use crate::driver::blas::{BlasHandle, Sgemm};
use crate::error::Result;

/// Bytes of workspace cuBLAS wants on Hopper; smaller GPUs use less of it.
pub const RECOMMENDED_WORKSPACE: usize = 32 << 20;

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
        self.handle.sgemm(Sgemm {
            m: ni,
            n: mi,
            k: ki,
            alpha,
            a: b.device_address(),
            lda: ni,
            b: a.device_address(),
            ldb: ki,
            beta,
            c: c.device_address(),
            ldc: ni,
        })
    }
}
