//! A cuBLAS handle with a workspace, and raw SGEMM. The checked, row-major interface on slots is
//! `kernels::Blas`; this level only wraps the handle and the calls.

use std::sync::Arc;

use cudarc::cublas::{result as cublas, sys as cublas_sys, CudaBlas};
use cudarc::driver::{sys, CudaStream};

use crate::error::{Error, Result};

fn blas_call<T>(
    call: &'static str,
    f: impl FnOnce() -> Result<T, cublas::CublasError>,
) -> Result<T> {
    let span = tracing::debug_span!("cublas", call);
    let _entered = span.enter();
    f().map_err(|cublas::CublasError(status)| Error::Cublas { call, status })
}

/// A cuBLAS handle bound to one stream.
#[derive(Debug)]
pub(crate) struct BlasHandle {
    blas: CudaBlas,
}

/// Column-major operand shapes of one SGEMM: `C[m,n] = alpha · A[m,k] · B[k,n] + beta · C`.
#[derive(Clone, Copy, Debug)]
pub(crate) struct Sgemm {
    pub m: i32,
    pub n: i32,
    pub k: i32,
    pub alpha: f32,
    pub a: sys::CUdeviceptr,
    pub lda: i32,
    pub b: sys::CUdeviceptr,
    pub ldb: i32,
    pub beta: f32,
    pub c: sys::CUdeviceptr,
    pub ldc: i32,
}

impl BlasHandle {
    pub(crate) fn new(stream: &Arc<CudaStream>) -> Result<Self> {
        super::bind_context(stream.context())?;
        let blas = blas_call("cublasCreate_v2", || CudaBlas::new(stream.clone()))?;
        Ok(Self { blas })
    }

    /// Gives cuBLAS `bytes` of device memory at `ptr` as its workspace, so captured graphs hold
    /// no allocation nodes. The caller keeps the range mapped while the handle is used.
    pub(crate) fn set_workspace(&self, ptr: sys::CUdeviceptr, bytes: usize) -> Result<()> {
        blas_call("cublasSetWorkspace_v2", || {
            // SAFETY: the handle is live; the range is device memory the caller keeps mapped.
            unsafe { cublas_sys::cublasSetWorkspace_v2(*self.blas.handle(), ptr as *mut _, bytes) }
                .result()
        })
    }

    /// Enqueues one column-major SGEMM. The caller has checked that each pointer holds its
    /// operand in full (A: lda × k, B: ldb × n, C: ldc × n floats).
    pub(crate) fn sgemm(&self, g: Sgemm) -> Result<()> {
        let op = cublas_sys::cublasOperation_t::CUBLAS_OP_N;
        blas_call("cublasSgemm_v2", || {
            // SAFETY: the operands were checked by the caller; alpha and beta are host values
            // read during the call.
            unsafe {
                cublas::sgemm(
                    *self.blas.handle(),
                    op,
                    op,
                    g.m,
                    g.n,
                    g.k,
                    &g.alpha,
                    g.a as *const f32,
                    g.lda,
                    g.b as *const f32,
                    g.ldb,
                    &g.beta,
                    g.c as *mut f32,
                    g.ldc,
                )
            }
        })
    }
}
