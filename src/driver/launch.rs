//! Kernel launches with typed parameter lists.
//!
//! Launching is `unsafe` in cudarc because nothing checks that the arguments pushed match the
//! PTX function's parameters. Here each function is declared once, in [`abi`], with its
//! parameter list as a tuple type; a [`KernelFn`] can only be launched with exactly that tuple,
//! so everything above this module launches safely. Sizes are the launchers' job (they check
//! every buffer against the shape before launching).

use std::marker::PhantomData;
use std::sync::Arc;

use cudarc::driver::{
    CudaContext, CudaFunction, CudaModule, CudaStream, DeviceRepr, LaunchArgs, LaunchConfig,
    PushKernelArg,
};
use cudarc::nvrtc::Ptx;

use super::{bind_context, traced};
use crate::error::Result;

/// A kernel's parameter list as a tuple of plain values (device pointers are `u64`).
pub(crate) trait KernelArgs {
    fn push<'a>(&'a self, launch: &mut LaunchArgs<'a>);
}

macro_rules! kernel_args {
    ($($name:ident),+) => {
        impl<$($name: DeviceRepr),+> KernelArgs for ($($name,)+) {
            #[allow(non_snake_case)]
            fn push<'a>(&'a self, launch: &mut LaunchArgs<'a>) {
                let ($($name,)+) = self;
                $(launch.arg($name);)+
            }
        }
    };
}
kernel_args!(A);
kernel_args!(A, B);
kernel_args!(A, B, C);
kernel_args!(A, B, C, D);
kernel_args!(A, B, C, D, E);
kernel_args!(A, B, C, D, E, F);
kernel_args!(A, B, C, D, E, F, G);
kernel_args!(A, B, C, D, E, F, G, H);
kernel_args!(A, B, C, D, E, F, G, H, I);
kernel_args!(A, B, C, D, E, F, G, H, I, J);
kernel_args!(A, B, C, D, E, F, G, H, I, J, K);

/// A PTX function's name and parameter list, declared in [`abi`].
#[derive(Clone, Copy, Debug)]
pub(crate) struct Signature<A> {
    name: &'static str,
    _args: PhantomData<fn(A)>,
}

impl<A> Signature<A> {
    /// # Safety
    /// The PTX function `name` takes exactly the parameters `A`, in order, with the same sizes.
    const unsafe fn declare(name: &'static str) -> Self {
        Self {
            name,
            _args: PhantomData,
        }
    }
}

/// A loaded function that launches only with its declared parameter list.
#[derive(Debug)]
pub(crate) struct KernelFn<A> {
    function: CudaFunction,
    _args: PhantomData<fn(A)>,
}

impl<A: KernelArgs> KernelFn<A> {
    /// Enqueues the function on `stream`.
    pub(crate) fn launch(&self, stream: &CudaStream, config: LaunchConfig, args: A) -> Result<()> {
        traced("cuLaunchKernel", 0, || {
            let mut launch = stream.launch_builder(&self.function);
            args.push(&mut launch);
            // SAFETY: `A` is the parameter list this function was declared with in `abi`, so the
            // pushed values match the kernel's parameters in number, order and size.
            unsafe { launch.launch(config) }.map(drop)
        })
    }
}

/// Loads PTX text into `ctx` (the driver JIT-compiles it for the device once).
pub(crate) fn load_module(ctx: &Arc<CudaContext>, ptx: &str) -> Result<Arc<CudaModule>> {
    bind_context(ctx)?;
    traced("cuModuleLoadData", ptx.len(), || {
        ctx.load_module(Ptx::from_src(ptx))
    })
}

/// Looks up `signature`'s function in `module`.
pub(crate) fn function<A>(
    module: &Arc<CudaModule>,
    signature: Signature<A>,
) -> Result<KernelFn<A>> {
    let function = traced("cuModuleGetFunction", 0, || {
        module.load_function(signature.name)
    })?;
    Ok(KernelFn {
        function,
        _args: PhantomData,
    })
}

/// The parameter lists of the functions in `kernels/matmul.cu` and `kernels/decode.cu`, as
/// written there. `u64` stands for a device pointer; `i32` for `int`; `u32` for `unsigned int`;
/// `u64` also for `unsigned long long`.
pub(crate) mod abi {
    use super::Signature;

    type Ptr = u64;
    /// `decode_attention_bf16`'s parameters: q, k, v, lengths, out, heads, kv_heads, dim,
    /// seq_stride, max_len, scale.
    pub(crate) type AttentionArgs = (Ptr, Ptr, Ptr, Ptr, Ptr, i32, i32, i32, u64, i32, f32);
    /// `kv_append_bf16`'s parameters: k, v, k_new, v_new, lengths, batch, token_elems,
    /// seq_stride, max_len.
    pub(crate) type AppendArgs = (Ptr, Ptr, Ptr, Ptr, Ptr, i32, i32, u64, i32);

    // SAFETY (every declaration below): checked by hand against the `extern "C"` signatures in
    // kernels/matmul.cu; a kernel whose parameters change must change here too.
    /// `matmul_naive(const float*, const float*, float*, int M, int N, int K)`
    pub(crate) const MATMUL_NAIVE: Signature<(Ptr, Ptr, Ptr, i32, i32, i32)> =
        unsafe { Signature::declare("matmul_naive") };
    /// `matmul_tiled(const float*, const float*, float*, int M, int N, int K)`
    pub(crate) const MATMUL_TILED: Signature<(Ptr, Ptr, Ptr, i32, i32, i32)> =
        unsafe { Signature::declare("matmul_tiled") };
    /// `matmul_regtile(const float*, const float*, float*, int M, int N, int K)`
    pub(crate) const MATMUL_REGTILE: Signature<(Ptr, Ptr, Ptr, i32, i32, i32)> =
        unsafe { Signature::declare("matmul_regtile") };
    /// `bias_act(float* y, const float* bias, int rows, int cols, int act)`
    pub(crate) const BIAS_ACT: Signature<(Ptr, Ptr, i32, i32, i32)> =
        unsafe { Signature::declare("bias_act") };
    /// `fill_f32(float*, unsigned long long n, float value)`
    pub(crate) const FILL_F32: Signature<(Ptr, u64, f32)> =
        unsafe { Signature::declare("fill_f32") };
    /// `spin_ns(unsigned long long ns)`
    pub(crate) const SPIN_NS: Signature<(u64,)> = unsafe { Signature::declare("spin_ns") };
    /// `fill_pattern_u32(unsigned*, unsigned long long first, unsigned long long count, unsigned seed)`
    pub(crate) const FILL_PATTERN_U32: Signature<(Ptr, u64, u64, u32)> =
        unsafe { Signature::declare("fill_pattern_u32") };
    /// `count_pattern_mismatches_u32(const unsigned*, u64 first, u64 count, unsigned seed, u64* out)`
    pub(crate) const COUNT_PATTERN_MISMATCHES_U32: Signature<(Ptr, u64, u64, u32, Ptr)> =
        unsafe { Signature::declare("count_pattern_mismatches_u32") };
    /// `affine_f32(float*, unsigned long long n, float a, float b)`
    pub(crate) const AFFINE_F32: Signature<(Ptr, u64, f32, f32)> =
        unsafe { Signature::declare("affine_f32") };

    // SAFETY (every declaration below): checked by hand against the `extern "C"` signatures in
    // kernels/decode.cu (bf16 travels as `unsigned short*`, a device pointer like any other).
    /// `bias_act_bf16(const float* y, const unsigned short* bias, unsigned short* out, int rows,
    /// int cols, int act)`
    pub(crate) const BIAS_ACT_BF16: Signature<(Ptr, Ptr, Ptr, i32, i32, i32)> =
        unsafe { Signature::declare("bias_act_bf16") };
    /// `residual_add_bf16(const float* y, const unsigned short* bias,
    /// const unsigned short* residual, unsigned short* out, int rows, int cols)`
    pub(crate) const RESIDUAL_ADD_BF16: Signature<(Ptr, Ptr, Ptr, Ptr, i32, i32)> =
        unsafe { Signature::declare("residual_add_bf16") };
    /// `rms_norm_bf16(const unsigned short* x, const unsigned short* gamma, unsigned short* out,
    /// int rows, int cols, float eps)`
    pub(crate) const RMS_NORM_BF16: Signature<(Ptr, Ptr, Ptr, i32, i32, f32)> =
        unsafe { Signature::declare("rms_norm_bf16") };
    /// `fill_bf16(unsigned short*, unsigned long long n, unsigned int bits)`
    pub(crate) const FILL_BF16: Signature<(Ptr, u64, u32)> =
        unsafe { Signature::declare("fill_bf16") };
    /// `fill_uniform_bf16(unsigned short*, unsigned long long n, unsigned long long seed,
    /// float lo, float hi)`
    pub(crate) const FILL_UNIFORM_BF16: Signature<(Ptr, u64, u64, f32, f32)> =
        unsafe { Signature::declare("fill_uniform_bf16") };
    /// `convert_f32_to_bf16(const float*, unsigned short*, unsigned long long n)`
    pub(crate) const CONVERT_F32_TO_BF16: Signature<(Ptr, Ptr, u64)> =
        unsafe { Signature::declare("convert_f32_to_bf16") };
    /// `convert_bf16_to_f32(const unsigned short*, float*, unsigned long long n)`
    pub(crate) const CONVERT_BF16_TO_F32: Signature<(Ptr, Ptr, u64)> =
        unsafe { Signature::declare("convert_bf16_to_f32") };
    /// `partial_sums_bf16(const unsigned short*, unsigned long long n, float* out)`
    pub(crate) const PARTIAL_SUMS_BF16: Signature<(Ptr, u64, Ptr)> =
        unsafe { Signature::declare("partial_sums_bf16") };
    /// `decode_attention_bf16(const unsigned short* q, const unsigned short* k, const unsigned
    /// short* v, const unsigned int* lengths, float* out, int heads, int kv_heads, int dim,
    /// unsigned long long seq_stride, int max_len, float scale)` (kernels/decode_attention.cu)
    pub(crate) const DECODE_ATTENTION_BF16: Signature<AttentionArgs> =
        unsafe { Signature::declare("decode_attention_bf16") };
    /// `kv_append_bf16(unsigned short* k, unsigned short* v, const unsigned short* k_new, const
    /// unsigned short* v_new, const unsigned int* lengths, int batch, int token_elems, unsigned
    /// long long seq_stride, int max_len)`
    pub(crate) const KV_APPEND_BF16: Signature<AppendArgs> =
        unsafe { Signature::declare("kv_append_bf16") };
    /// `attention_out_bf16(const float*, unsigned short*, unsigned long long n)`
    pub(crate) const ATTENTION_OUT_BF16: Signature<(Ptr, Ptr, u64)> =
        unsafe { Signature::declare("attention_out_bf16") };
}
