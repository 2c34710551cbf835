//! The bf16 kernels of a memory-bound decode step (`kernels/decode.cu`): RMSNorm, bias +
//! activation and bias + residual around cuBLAS GemmEx ([`Blas::gemm_bf16`](super::Blas)), plus
//! fills, conversions and a checksum. Host twins of the arithmetic ([`bf16_from_f32`],
//! [`Activation::apply`], [`uniform_bf16`]) let tests build exact CPU references.
//!
//! bf16 values travel as their 16 bits (`u16` on the host, `unsigned short` in the kernels);
//! every kernel computes in FP32 and rounds once (to nearest, ties to even) when it stores.
//! Every launcher checks the buffers against the shape first, so a wrong size is an
//! [`Error`], never an out-of-bounds access on the GPU.
//!
//! ```text
//!   one pre-norm MLP layer, x the bf16 residual stream (batch × hidden):
//!   n = rms_norm(x, gamma)                      bf16
//!   u = n · W_upᵀ          (gemm_bf16, F32 out)  FP32   batch × 4·hidden
//!   a = act(u + b_up)      (bias_act)           bf16
//!   d = a · W_downᵀ        (gemm_bf16, F32 out)  FP32   batch × hidden
//!   x = x + (d + b_down)   (residual_add)       bf16
//! ```

use std::sync::Arc;

use cudarc::driver::{CudaStream, LaunchConfig};

use super::args::{dim, grid_stride, need_elems, BF16, F32};
use super::table::kernel_table;
use crate::buffer::DeviceBuffer;
use crate::driver::launch::KernelFn;
use crate::error::{Error, LayoutError, Result};

/// The activation [`DecodeKernels::bias_act`] applies.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Activation {
    /// None: `act(v) = v`.
    Identity,
    /// GELU, tanh approximation (GPT-2's, PyTorch's `approximate="tanh"`).
    GeluTanh,
    /// SiLU (swish): `v · sigmoid(v)`.
    Silu,
}

impl Activation {
    /// The code `kernels/decode.cu` uses (`ACT_*`).
    fn code(self) -> i32 {
        match self {
            Activation::Identity => 0,
            Activation::GeluTanh => 1,
            Activation::Silu => 2,
        }
    }

    /// The activation on the host, in FP32, as the kernel computes it (up to the last bit of
    /// `tanhf`/`expf`): the CPU reference of tests.
    pub fn apply(self, v: f32) -> f32 {
        match self {
            Activation::Identity => v,
            Activation::GeluTanh => {
                let inner = 0.797_884_6_f32 * (v + 0.044_715 * v * v * v);
                0.5 * v * (1.0 + inner.tanh())
            }
            Activation::Silu => v / (1.0 + (-v).exp()),
        }
    }
}

/// FP32 to bf16 bits, rounding to nearest, ties to even, exactly as the kernels store; NaN stays
/// NaN.
pub fn bf16_from_f32(value: f32) -> u16 {
    let u = value.to_bits();
    if u & 0x7fff_ffff > 0x7f80_0000 {
        return ((u >> 16) | 0x0040) as u16;
    }
    (u.wrapping_add(0x7fff + ((u >> 16) & 1)) >> 16) as u16
}

/// bf16 bits to FP32 (exact).
pub fn f32_from_bf16(bits: u16) -> f32 {
    f32::from_bits(u32::from(bits) << 16)
}

fn mix64(mut x: u64) -> u64 {
    x ^= x >> 30;
    x = x.wrapping_mul(0xBF58_476D_1CE4_E5B9);
    x ^= x >> 27;
    x = x.wrapping_mul(0x94D0_49BB_1331_11EB);
    x ^= x >> 31;
    x
}

/// Element `index` of what [`DecodeKernels::fill_uniform`] writes with `seed`, `lo` and `hi`,
/// bit for bit: `bf16(lo + (hi - lo) · u)` with `u` uniform in `[0, 1)` on a 2⁻²⁴ grid.
pub fn uniform_bf16(seed: u64, index: u64, lo: f32, hi: f32) -> u16 {
    let h = mix64(index.wrapping_add(1).wrapping_mul(0x9E37_79B9_7F4A_7C15) ^ mix64(seed));
    let u = (h >> 40) as f32 * (1.0 / 16_777_216.0);
    bf16_from_f32((hi - lo).mul_add(u, lo))
}

/// Threads per block of `rms_norm_bf16` and `partial_sums_bf16` (`RMS_THREADS`, `SUM_THREADS`).
const BLOCK: u32 = 256;
/// The most blocks [`DecodeKernels::partial_sums`] launches, so the most sums it writes.
pub const MAX_PARTIAL_SUMS: usize = 4096;

kernel_table! {
    /// The loaded `kernels/decode.cu` module and its functions. See the module docs.
    pub struct DecodeKernels from super::PTX_DECODE {
        bias_act: KernelFn<(u64, u64, u64, i32, i32, i32)> = BIAS_ACT_BF16,
        residual_add: KernelFn<(u64, u64, u64, u64, i32, i32)> = RESIDUAL_ADD_BF16,
        rms_norm: KernelFn<(u64, u64, u64, i32, i32, f32)> = RMS_NORM_BF16,
        fill: KernelFn<(u64, u64, u32)> = FILL_BF16,
        fill_uniform: KernelFn<(u64, u64, u64, f32, f32)> = FILL_UNIFORM_BF16,
        to_bf16: KernelFn<(u64, u64, u64)> = CONVERT_F32_TO_BF16,
        to_f32: KernelFn<(u64, u64, u64)> = CONVERT_BF16_TO_F32,
        partial_sums: KernelFn<(u64, u64, u64)> = PARTIAL_SUMS_BF16,
    }
}

impl DecodeKernels {
    /// Enqueues `out[r, c] = bf16(act(y[r, c] + bias[c]))` for `[rows, cols]`: `y` FP32,
    /// `bias` (`cols`) and `out` bf16.
    pub fn bias_act(
        &self,
        stream: &Arc<CudaStream>,
        y: &impl DeviceBuffer,
        bias: &impl DeviceBuffer,
        out: &impl DeviceBuffer,
        [rows, cols]: [usize; 2],
        act: Activation,
    ) -> Result<()> {
        let (ri, ci) = (dim("rows", rows)?, dim("cols", cols)?);
        need_elems("bias_act y", y, [rows, cols], F32)?;
        need_elems("bias_act bias", bias, [1, cols], BF16)?;
        need_elems("bias_act out", out, [rows, cols], BF16)?;
        let args = (
            y.device_address(),
            bias.device_address(),
            out.device_address(),
            ri,
            ci,
            act.code(),
        );
        self.bias_act
            .launch(stream, grid_stride((rows * cols) as u64), args)
    }

    /// Enqueues `out[r, c] = bf16(residual[r, c] + (y[r, c] + bias[c]))` for `[rows, cols]`:
    /// `y` FP32, the rest bf16. `out` may be the same buffer as `residual` (in place).
    pub fn residual_add(
        &self,
        stream: &Arc<CudaStream>,
        y: &impl DeviceBuffer,
        bias: &impl DeviceBuffer,
        residual: &impl DeviceBuffer,
        out: &impl DeviceBuffer,
        [rows, cols]: [usize; 2],
    ) -> Result<()> {
        let (ri, ci) = (dim("rows", rows)?, dim("cols", cols)?);
        need_elems("residual_add y", y, [rows, cols], F32)?;
        need_elems("residual_add bias", bias, [1, cols], BF16)?;
        need_elems("residual_add residual", residual, [rows, cols], BF16)?;
        need_elems("residual_add out", out, [rows, cols], BF16)?;
        let args = (
            y.device_address(),
            bias.device_address(),
            residual.device_address(),
            out.device_address(),
            ri,
            ci,
        );
        self.residual_add
            .launch(stream, grid_stride((rows * cols) as u64), args)
    }

    /// Enqueues `out[r, :] = bf16(x[r, :] / sqrt(mean(x[r, :]²) + eps) · gamma)` for
    /// `[rows, cols]`, all bf16, one block per row. `out` may be `x`.
    pub fn rms_norm(
        &self,
        stream: &Arc<CudaStream>,
        x: &impl DeviceBuffer,
        gamma: &impl DeviceBuffer,
        out: &impl DeviceBuffer,
        [rows, cols]: [usize; 2],
        eps: f32,
    ) -> Result<()> {
        let (ri, ci) = (dim("rows", rows)?, dim("cols", cols)?);
        if !(eps.is_finite() && eps >= 0.0) {
            return Err(Error::Layout(LayoutError::InvalidShape(format!(
                "rms_norm eps = {eps} must be finite and not negative"
            ))));
        }
        need_elems("rms_norm x", x, [rows, cols], BF16)?;
        need_elems("rms_norm gamma", gamma, [1, cols], BF16)?;
        need_elems("rms_norm out", out, [rows, cols], BF16)?;
        let cfg = LaunchConfig {
            grid_dim: (ri as u32, 1, 1),
            block_dim: (BLOCK, 1, 1),
            shared_mem_bytes: 0,
        };
        let args = (
            x.device_address(),
            gamma.device_address(),
            out.device_address(),
            ri,
            ci,
            eps,
        );
        self.rms_norm.launch(stream, cfg, args)
    }

    /// Enqueues a fill of every whole bf16 element of `buffer` with `bf16(value)` (NaN
    /// poisons outputs).
    pub fn fill(
        &self,
        stream: &Arc<CudaStream>,
        buffer: &impl DeviceBuffer,
        value: f32,
    ) -> Result<()> {
        let count = (buffer.byte_len() / BF16) as u64;
        if count == 0 {
            return Ok(());
        }
        let bits = u32::from(bf16_from_f32(value));
        self.fill.launch(
            stream,
            grid_stride(count),
            (buffer.device_address(), count, bits),
        )
    }

    /// Enqueues a fill of every whole bf16 element `i` of `buffer` with
    /// [`uniform_bf16`]`(seed, i, lo, hi)`: reproducible random data, generated on the device.
    pub fn fill_uniform(
        &self,
        stream: &Arc<CudaStream>,
        buffer: &impl DeviceBuffer,
        seed: u64,
        lo: f32,
        hi: f32,
    ) -> Result<()> {
        if !(lo.is_finite() && hi.is_finite() && lo <= hi) {
            return Err(Error::Layout(LayoutError::InvalidShape(format!(
                "fill_uniform range [{lo}, {hi}) must be finite and ordered"
            ))));
        }
        let count = (buffer.byte_len() / BF16) as u64;
        if count == 0 {
            return Ok(());
        }
        self.fill_uniform.launch(
            stream,
            grid_stride(count),
            (buffer.device_address(), count, seed, lo, hi),
        )
    }

    /// Enqueues `out[i] = bf16(input[i])` for `count` elements (`input` FP32).
    pub fn to_bf16(
        &self,
        stream: &Arc<CudaStream>,
        input: &impl DeviceBuffer,
        out: &impl DeviceBuffer,
        count: usize,
    ) -> Result<()> {
        need_elems("to_bf16 input", input, [1, count], F32)?;
        need_elems("to_bf16 out", out, [1, count], BF16)?;
        if count == 0 {
            return Ok(());
        }
        let args = (input.device_address(), out.device_address(), count as u64);
        self.to_bf16.launch(stream, grid_stride(count as u64), args)
    }

    /// Enqueues `out[i] = f32(input[i])` for `count` elements (`input` bf16).
    pub fn to_f32(
        &self,
        stream: &Arc<CudaStream>,
        input: &impl DeviceBuffer,
        out: &impl DeviceBuffer,
        count: usize,
    ) -> Result<()> {
        need_elems("to_f32 input", input, [1, count], BF16)?;
        need_elems("to_f32 out", out, [1, count], F32)?;
        if count == 0 {
            return Ok(());
        }
        let args = (input.device_address(), out.device_address(), count as u64);
        self.to_f32.launch(stream, grid_stride(count as u64), args)
    }

    /// How many partial sums [`DecodeKernels::partial_sums`] writes for `count` elements.
    pub fn partial_sum_count(count: usize) -> usize {
        count.div_ceil(BLOCK as usize).clamp(1, MAX_PARTIAL_SUMS)
    }

    /// Enqueues one kernel that reads every whole bf16 element of `input` and writes
    /// [`DecodeKernels::partial_sum_count`] FP32 partial sums to `out` (their total is the sum
    /// of the elements); returns that count. No atomics and no zeroing first: it is one graph
    /// node, and its result does not depend on timing. A checksum, and a way to touch a whole
    /// range with one kernel.
    pub fn partial_sums(
        &self,
        stream: &Arc<CudaStream>,
        input: &impl DeviceBuffer,
        out: &impl DeviceBuffer,
    ) -> Result<usize> {
        let count = input.byte_len() / BF16;
        if count == 0 {
            return Err(Error::Layout(LayoutError::InvalidShape(
                "partial_sums of an empty buffer".into(),
            )));
        }
        let blocks = Self::partial_sum_count(count);
        need_elems("partial_sums out", out, [1, blocks], F32)?;
        let cfg = LaunchConfig {
            grid_dim: (blocks as u32, 1, 1),
            block_dim: (BLOCK, 1, 1),
            shared_mem_bytes: 0,
        };
        let args = (input.device_address(), count as u64, out.device_address());
        self.partial_sums.launch(stream, cfg, args)?;
        Ok(blocks)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn bf16_rounds_to_nearest_even_and_keeps_specials() {
        assert_eq!(bf16_from_f32(1.0), 0x3f80);
        assert_eq!(f32_from_bf16(0x3f80), 1.0);
        // 1 + 2^-8 is halfway between 1 and the next bf16 (1 + 2^-7): ties go to even (1).
        assert_eq!(bf16_from_f32(1.0 + 1.0 / 256.0), 0x3f80);
        // 1 + 3·2^-8 is halfway between 1 + 2^-7 (odd) and 1 + 2^-6: up to even.
        assert_eq!(bf16_from_f32(1.0 + 3.0 / 256.0), 0x3f82);
        // Just above halfway rounds up.
        assert_eq!(bf16_from_f32(f32::from_bits(0x3f80_8001)), 0x3f81);
        assert_eq!(bf16_from_f32(-2.5), 0xc020);
        assert!(f32_from_bf16(bf16_from_f32(f32::NAN)).is_nan());
        assert_eq!(bf16_from_f32(f32::INFINITY), 0x7f80);
        assert_eq!(bf16_from_f32(f32::MAX), 0x7f80, "past the largest bf16");
        for v in [0.0f32, -0.0, 3.140625, -1e-30, 65280.0] {
            let bits = bf16_from_f32(v);
            assert_eq!(bf16_from_f32(f32_from_bf16(bits)), bits, "{v} round trip");
        }
    }

    #[test]
    fn uniform_values_stay_in_range_and_depend_on_seed_and_index() {
        let values: Vec<f32> = (0..10_000)
            .map(|i| f32_from_bf16(uniform_bf16(7, i, -0.5, 0.25)))
            .collect();
        assert!(values.iter().all(|v| (-0.5..=0.25).contains(v)));
        let mean = values.iter().sum::<f32>() / values.len() as f32;
        assert!((mean + 0.125).abs() < 0.01, "mean {mean}");
        assert_ne!(uniform_bf16(7, 3, -1.0, 1.0), uniform_bf16(8, 3, -1.0, 1.0));
        assert_ne!(uniform_bf16(7, 3, -1.0, 1.0), uniform_bf16(7, 4, -1.0, 1.0));
        assert_eq!(uniform_bf16(1, 5, 2.0, 2.0), bf16_from_f32(2.0));
    }

    #[test]
    fn activations_match_their_definitions() {
        assert_eq!(Activation::Identity.apply(-3.0), -3.0);
        assert!((Activation::Silu.apply(1.0) - 0.731_058_6).abs() < 1e-6);
        assert!((Activation::GeluTanh.apply(1.0) - 0.841_192).abs() < 1e-5);
        assert!(Activation::GeluTanh.apply(-10.0).abs() < 1e-6);
        assert_eq!(Activation::GeluTanh.apply(0.0), 0.0);
    }

    #[test]
    fn partial_sum_count_is_bounded() {
        assert_eq!(DecodeKernels::partial_sum_count(1), 1);
        assert_eq!(DecodeKernels::partial_sum_count(257), 2);
        assert_eq!(
            DecodeKernels::partial_sum_count(usize::MAX / 4),
            MAX_PARTIAL_SUMS
        );
    }
}
