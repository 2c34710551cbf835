//! The kernels `build.rs` compiled from `kernels/matmul.cu` ([`Kernels`]) and
//! `kernels/decode.cu` ([`DecodeKernels`]: the bf16 operations of a decode step), their typed
//! launchers, and cuBLAS SGEMM and bf16 GemmEx ([`Blas`]).
//!
//! Each launcher checks shapes and buffer sizes on the host first, so a wrong size is an
//! [`Error`], never an out-of-bounds access on the GPU.

mod args;
mod attention;
mod blas;
mod decode;
mod ptx;
mod table;

use std::sync::Arc;
use std::time::Duration;

use cudarc::driver::{CudaStream, DevicePtr, LaunchConfig};

use crate::buffer::{require_range, DeviceBuffer};
use crate::driver::launch::KernelFn;
use crate::driver::traced;
use crate::error::{Error, LayoutError, Result};
use args::{dim, grid_stride, need, F32, U32};
use table::kernel_table;

pub use attention::{attention_reference, AttentionKernels, AttentionShape, MAX_HEAD_DIM};
pub use blas::{Blas, GemmOutput, WeightLayout, RECOMMENDED_WORKSPACE};
pub use decode::{
    bf16_from_f32, f32_from_bf16, uniform_bf16, Activation, DecodeKernels, MAX_PARTIAL_SUMS,
};
pub use ptx::{
    PTX, PTX_ATTENTION, PTX_ATTENTION_COMPILER, PTX_COMPILER, PTX_DECODE, PTX_DECODE_COMPILER,
};

type Matmul = KernelFn<(u64, u64, u64, i32, i32, i32)>;

/// Which matmul kernel to launch.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum MatmulKernel {
    /// One thread per output: the correctness reference.
    Naive,
    /// 16×16 shared-memory tiles; any shape.
    Tiled,
    /// 128×128 block tiles with 8×8 register tiles per thread; needs M and N multiples of 128,
    /// K a multiple of 8 and 16-byte aligned buffers.
    RegisterTiled,
    /// [`MatmulKernel::RegisterTiled`] where its conditions hold, else [`MatmulKernel::Tiled`].
    Auto,
}

kernel_table! {
    /// The loaded kernel module and its functions.
    pub struct Kernels from PTX {
        naive: Matmul = MATMUL_NAIVE,
        tiled: Matmul = MATMUL_TILED,
        register_tiled: Matmul = MATMUL_REGTILE,
        bias_act: KernelFn<(u64, u64, i32, i32, i32)> = BIAS_ACT,
        fill: KernelFn<(u64, u64, f32)> = FILL_F32,
        spin: KernelFn<(u64,)> = SPIN_NS,
        fill_pattern: KernelFn<(u64, u64, u64, u32)> = FILL_PATTERN_U32,
        count_mismatches: KernelFn<(u64, u64, u64, u32, u64)> = COUNT_PATTERN_MISMATCHES_U32,
        affine: KernelFn<(u64, u64, f32, f32)> = AFFINE_F32,
    }
}

impl Kernels {
    /// The kernel [`MatmulKernel::Auto`] resolves to for this shape and these buffers.
    pub fn resolve(
        kind: MatmulKernel,
        m: usize,
        n: usize,
        k: usize,
        buffers: [&dyn DeviceBuffer; 3],
    ) -> MatmulKernel {
        match kind {
            MatmulKernel::Auto => {
                let aligned = buffers.iter().all(|b| b.device_address() % 16 == 0);
                if aligned && m.is_multiple_of(128) && n.is_multiple_of(128) && k.is_multiple_of(8)
                {
                    MatmulKernel::RegisterTiled
                } else {
                    MatmulKernel::Tiled
                }
            }
            other => other,
        }
    }

    /// Enqueues `C[m,n] = A[m,k] · B[k,n]` (row-major FP32) on `stream`; returns the kernel used.
    #[allow(clippy::too_many_arguments)]
    pub fn matmul(
        &self,
        stream: &Arc<CudaStream>,
        kind: MatmulKernel,
        a: &impl DeviceBuffer,
        b: &impl DeviceBuffer,
        c: &impl DeviceBuffer,
        m: usize,
        n: usize,
        k: usize,
    ) -> Result<MatmulKernel> {
        let (mi, ni, ki) = (dim("m", m)?, dim("n", n)?, dim("k", k)?);
        need("matmul A", a, [m, k])?;
        need("matmul B", b, [k, n])?;
        need("matmul C", c, [m, n])?;
        let kind = Self::resolve(kind, m, n, k, [a, b, c]);
        let (function, cfg) = match kind {
            MatmulKernel::Naive | MatmulKernel::Tiled | MatmulKernel::Auto => {
                let f = if kind == MatmulKernel::Naive {
                    &self.naive
                } else {
                    &self.tiled
                };
                let grid = (n.div_ceil(16) as u32, m.div_ceil(16) as u32, 1);
                (
                    f,
                    LaunchConfig {
                        grid_dim: grid,
                        block_dim: (16, 16, 1),
                        shared_mem_bytes: 0,
                    },
                )
            }
            MatmulKernel::RegisterTiled => {
                if kind != Self::resolve(MatmulKernel::Auto, m, n, k, [a, b, c]) {
                    return Err(Error::Layout(LayoutError::InvalidShape(format!(
                        "register-tiled matmul needs m, n multiples of 128, k of 8 and 16-byte \
                         aligned buffers; got {m}x{n}x{k}"
                    ))));
                }
                let grid = ((n / 128) as u32, (m / 128) as u32, 1);
                (
                    &self.register_tiled,
                    LaunchConfig {
                        grid_dim: grid,
                        block_dim: (256, 1, 1),
                        shared_mem_bytes: 0,
                    },
                )
            }
        };
        if cfg.grid_dim.1 > 65_535 {
            return Err(Error::Layout(LayoutError::InvalidShape(format!(
                "m = {m} needs more than 65535 block rows"
            ))));
        }
        let (pa, pb, pc) = (a.device_address(), b.device_address(), c.device_address());
        function.launch(stream, cfg, (pa, pb, pc, mi, ni, ki))?;
        Ok(kind)
    }

    /// Enqueues `y[r, c] = act(y[r, c] + bias[c])` for a `rows × cols` matrix; `relu` picks ReLU
    /// over identity.
    pub fn bias_act(
        &self,
        stream: &Arc<CudaStream>,
        y: &impl DeviceBuffer,
        bias: &impl DeviceBuffer,
        rows: usize,
        cols: usize,
        relu: bool,
    ) -> Result<()> {
        let (ri, ci) = (dim("rows", rows)?, dim("cols", cols)?);
        need("bias_act y", y, [rows, cols])?;
        need("bias_act bias", bias, [1, cols])?;
        let (py, pb, act) = (y.device_address(), bias.device_address(), i32::from(relu));
        let cfg = grid_stride((rows * cols) as u64);
        self.bias_act.launch(stream, cfg, (py, pb, ri, ci, act))
    }

    /// Enqueues a fill of every whole `f32` in `buffer` with `value` (NaN poisons outputs).
    pub fn fill(
        &self,
        stream: &Arc<CudaStream>,
        buffer: &impl DeviceBuffer,
        value: f32,
    ) -> Result<()> {
        let count = (buffer.byte_len() / F32) as u64;
        if count == 0 {
            return Ok(());
        }
        let ptr = buffer.device_address();
        self.fill
            .launch(stream, grid_stride(count), (ptr, count, value))
    }

    /// Enqueues a write of a seeded pattern to `u32` elements `[first, first + count)` of
    /// `buffer`; each element's value depends only on its index and `seed`, so the pattern can
    /// be checked after the buffer grows or its backing moves.
    pub fn fill_pattern(
        &self,
        stream: &Arc<CudaStream>,
        buffer: &impl DeviceBuffer,
        first: usize,
        count: usize,
        seed: u32,
    ) -> Result<()> {
        pattern_range(buffer, first, count)?;
        if count == 0 {
            return Ok(());
        }
        let (ptr, first, count) = (buffer.device_address(), first as u64, count as u64);
        self.fill_pattern
            .launch(stream, grid_stride(count), (ptr, first, count, seed))
    }

    /// Counts the `u32` elements in `[first, first + count)` of `buffer` that differ from the
    /// pattern [`Kernels::fill_pattern`] writes with `seed`. Blocks until the count is known.
    pub fn pattern_mismatches(
        &self,
        stream: &Arc<CudaStream>,
        buffer: &impl DeviceBuffer,
        first: usize,
        count: usize,
        seed: u32,
    ) -> Result<u64> {
        pattern_range(buffer, first, count)?;
        if count == 0 {
            return Ok(0);
        }
        let counter = traced("cuMemAllocAsync", 8, || stream.alloc_zeros::<u64>(1))?;
        let (ptr, first, count) = (buffer.device_address(), first as u64, count as u64);
        {
            // `counter` is one live u64; event tracking is off, so the guard records nothing.
            let (out, _record) = counter.device_ptr(stream);
            self.count_mismatches.launch(
                stream,
                grid_stride(count),
                (ptr, first, count, seed, out),
            )?;
        }
        let host = traced("cuMemcpyDtoHAsync", 8, || stream.clone_dtoh(&counter))?;
        Ok(host[0])
    }

    /// Enqueues `x = a * x + b` over every whole `f32` of `buffer`, in place: a kernel that
    /// reads and writes a range end to end.
    pub fn affine(
        &self,
        stream: &Arc<CudaStream>,
        buffer: &impl DeviceBuffer,
        a: f32,
        b: f32,
    ) -> Result<()> {
        let count = (buffer.byte_len() / F32) as u64;
        if count == 0 {
            return Ok(());
        }
        let ptr = buffer.device_address();
        self.affine
            .launch(stream, grid_stride(count), (ptr, count, a, b))
    }

    /// Enqueues a kernel that keeps the GPU busy for `duration`: a stand-in for long work.
    pub fn spin(&self, stream: &Arc<CudaStream>, duration: Duration) -> Result<()> {
        let nanos = u64::try_from(duration.as_nanos()).unwrap_or(u64::MAX);
        let single = LaunchConfig {
            grid_dim: (1, 1, 1),
            block_dim: (1, 1, 1),
            shared_mem_bytes: 0,
        };
        self.spin.launch(stream, single, (nanos,))
    }
}

/// Checks that `u32` elements `[first, first + count)` lie inside `buffer`.
fn pattern_range(buffer: &dyn DeviceBuffer, first: usize, count: usize) -> Result<()> {
    let bytes = |elements: usize| {
        elements.checked_mul(U32).ok_or_else(|| {
            Error::Layout(LayoutError::InvalidShape(format!(
                "pattern range {first} + {count} overflows"
            )))
        })
    };
    require_range(
        "pattern range",
        buffer.byte_len(),
        bytes(first)?,
        bytes(count)?,
    )
}
