//! cuBLAS SGEMM on slots, checked and safe, ready to be captured into a graph.

use std::sync::Arc;

use cudarc::cublas::{result as cublas, sys as cublas_sys, CudaBlas};
use cudarc::driver::CudaStream;

use super::kernels::{dim, need, DeviceBuffer};
use crate::error::{Error, Result};

/// Bytes of workspace cuBLAS wants on Hopper; smaller GPUs use less of it.
pub const RECOMMENDED_WORKSPACE: usize = 32 << 20;

fn blas_call<T>(
    call: &'static str,
    f: impl FnOnce() -> Result<T, cublas::CublasError>,
) -> Result<T> {
    let span = tracing::debug_span!("cublas", call);
    let _entered = span.enter();
    f().map_err(|cublas::CublasError(status)| Error::Cublas { call, status })
}

/// A cuBLAS handle bound to one stream, with a workspace this crate owns.
///
/// With a workspace set, cuBLAS puts no memory allocation nodes into captured graphs, so a graph
/// of SGEMMs over slots is pure kernels (check it with `StableGraph::node_kinds`). TF32 stays off
/// (cuBLAS's default math mode): results are true FP32.
#[derive(Debug)]
pub struct Blas {
    blas: CudaBlas,
}

impl Blas {
    /// A handle on `stream` using `workspace` (a scratch slot of at least
    /// [`RECOMMENDED_WORKSPACE`] bytes is right for any current GPU).
    pub fn new(stream: &Arc<CudaStream>, workspace: &impl DeviceBuffer) -> Result<Self> {
        super::bind_context(stream.context())?;
        let blas = blas_call("cublasCreate_v2", || CudaBlas::new(stream.clone()))?;
        let (ptr, bytes) = (workspace.device_address(), workspace.byte_len());
        blas_call("cublasSetWorkspace_v2", || {
            // SAFETY: the handle is live; the workspace is device memory of `bytes` bytes that
            // the caller keeps mapped (a slot of a live space) while this handle is used.
            unsafe { cublas_sys::cublasSetWorkspace_v2(*blas.handle(), ptr as *mut _, bytes) }
                .result()
        })?;
        Ok(Self { blas })
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
        let (mi, ni, ki) = (dim("m", m)?, dim("n", n)?, dim("k", k)?);
        need("sgemm A", a, [m, k])?;
        need("sgemm B", b, [k, n])?;
        need("sgemm C", c, [m, n])?;
        let (alpha, beta) = (1.0f32, 0.0f32);
        let (pa, pb, pc) = (a.device_address(), b.device_address(), c.device_address());
        let op = cublas_sys::cublasOperation_t::CUBLAS_OP_N;
        blas_call("cublasSgemm_v2", || {
            // Column-major cuBLAS computes Cᵀ = Bᵀ·Aᵀ, which is row-major C = A·B.
            // SAFETY: the three buffers were checked above to hold B (n×k), A (k×m) and C (n×m)
            // in column-major terms; alpha and beta are read on the host during the call.
            unsafe {
                cublas::sgemm(
                    *self.blas.handle(),
                    op,
                    op,
                    ni,
                    mi,
                    ki,
                    &alpha,
                    pb as *const f32,
                    ni,
                    pa as *const f32,
                    ki,
                    &beta,
                    pc as *mut f32,
                    ni,
                )
            }
        })
    }
}
