//! A cuBLAS handle with a workspace, and raw SGEMM and GemmEx (bf16). The checked, row-major
//! interface on slots is `kernels::Blas`; this level only wraps the handle and the calls.

use std::sync::Arc;

use cudarc::cublas::{result as cublas, sys as cublas_sys, CudaBlas};
use cudarc::driver::{sys, CudaStream};

use crate::error::{DriverError, Error, Result};

fn blas_call<T>(
    call: &'static str,
    f: impl FnOnce() -> Result<T, cublas::CublasError>,
) -> Result<T> {
    let span = tracing::debug_span!("cublas", call);
    let _entered = span.enter();
    f().map_err(|cublas::CublasError(status)| Error::Driver(DriverError::Cublas { call, status }))
}

/// A cuBLAS handle bound to one stream.
#[derive(Debug)]
pub(crate) struct BlasHandle {
    blas: CudaBlas,
}

/// Column-major operands of one GEMM: `C[m,n] = alpha · op(A)[m,k] · B[k,n] + beta · C`, each
/// matrix a device pointer and its leading dimension. One SGEMM is exactly this ([`BlasHandle::sgemm`],
/// no transpose); a bf16 GemmEx adds its own switches ([`GemmBf16`]).
#[derive(Clone, Copy, Debug)]
pub(crate) struct Gemm {
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

/// One bf16 GemmEx: [`Gemm`]'s operands, A and B bf16, C bf16 or FP32, FP32 accumulation
/// (`CUBLAS_COMPUTE_32F`), the default algorithm. B is never transposed.
#[derive(Clone, Copy, Debug)]
pub(crate) struct GemmBf16 {
    /// The operands and scales.
    pub gemm: Gemm,
    /// `op(A) = Aᵀ` (A is stored `k × m`, leading dimension `lda ≥ k`) instead of A.
    pub transpose_a: bool,
    /// C holds FP32 (`CUDA_R_32F`) rather than bf16 (`CUDA_R_16BF`).
    pub c_f32: bool,
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
    pub(crate) fn sgemm(&self, g: Gemm) -> Result<()> {
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

    /// Enqueues one column-major bf16 GemmEx. The caller has checked that each pointer holds
    /// its operand in full (A: lda × (k or m) bf16, B: ldb × n bf16, C: ldc × n elements of
    /// C's type).
    pub(crate) fn gemm_bf16(
        &self,
        GemmBf16 {
            gemm: g,
            transpose_a,
            c_f32,
        }: GemmBf16,
    ) -> Result<()> {
        use cublas_sys::{cublasComputeType_t, cublasGemmAlgo_t, cublasOperation_t, cudaDataType};
        let transa = if transpose_a {
            cublasOperation_t::CUBLAS_OP_T
        } else {
            cublasOperation_t::CUBLAS_OP_N
        };
        let c_type = if c_f32 {
            cudaDataType::CUDA_R_32F
        } else {
            cudaDataType::CUDA_R_16BF
        };
        blas_call("cublasGemmEx", || {
            // SAFETY: the operands were checked by the caller; with CUBLAS_COMPUTE_32F the scale
            // type is FP32, so alpha and beta point to f32 host values that outlive the call
            // (the default host pointer mode reads them during the call).
            unsafe {
                cublas::gemm_ex(
                    *self.blas.handle(),
                    transa,
                    cublasOperation_t::CUBLAS_OP_N,
                    g.m,
                    g.n,
                    g.k,
                    (&g.alpha as *const f32).cast(),
                    g.a as *const std::ffi::c_void,
                    cudaDataType::CUDA_R_16BF,
                    g.lda,
                    g.b as *const std::ffi::c_void,
                    cudaDataType::CUDA_R_16BF,
                    g.ldb,
                    (&g.beta as *const f32).cast(),
                    g.c as *mut std::ffi::c_void,
                    c_type,
                    g.ldc,
                    cublasComputeType_t::CUBLAS_COMPUTE_32F,
                    cublasGemmAlgo_t::CUBLAS_GEMM_DEFAULT,
                )
            }
        })
    }
}
