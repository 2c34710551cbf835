// stablebuf decode kernels: the small bf16 operations around cuBLAS GemmEx in a memory-bound
// decode step (RMSNorm, bias + activation, bias + residual), conversions, fills and a checksum.
//
// Header-free on purpose, like matmul.cu: NVRTC from the `nvidia-cuda-nvrtc-cu12` wheel has no
// CUDA headers, so there is no `__nv_bfloat16`. A bf16 value travels as its 16 bits in an
// `unsigned short`; every kernel converts to FP32, computes in FP32 and rounds once when it
// stores. All matrices are row-major, `rows x cols`.

// The upper 16 bits of an FP32 value are a bf16 value: widening is a shift.
__device__ __forceinline__ float bf16_to_f32(unsigned short bits) {
    return __uint_as_float((unsigned int)bits << 16);
}

// FP32 to bf16, rounding to nearest, ties to even. A NaN stays a (quiet) NaN; values past the
// largest bf16 round to infinity, as IEEE rounding does.
__device__ __forceinline__ unsigned short f32_to_bf16(float value) {
    unsigned int u = __float_as_uint(value);
    if ((u & 0x7fffffffu) > 0x7f800000u) return (unsigned short)((u >> 16) | 0x0040u);
    u += 0x7fffu + ((u >> 16) & 1u);
    return (unsigned short)(u >> 16);
}

// Activation codes shared with the host (`Activation` in src/kernels/decode.rs).
#define ACT_IDENTITY 0
#define ACT_GELU_TANH 1
#define ACT_SILU 2

__device__ __forceinline__ float activate(float v, int act) {
    if (act == ACT_GELU_TANH) {
        float inner = 0.7978845608028654f * (v + 0.044715f * v * v * v);
        return 0.5f * v * (1.0f + tanhf(inner));
    }
    if (act == ACT_SILU) return v / (1.0f + expf(-v));
    return v;
}

// out[r, c] = bf16(act(y[r, c] + bias[c])): the epilogue of an up-projection whose GEMM wrote
// FP32. y is FP32, bias and out are bf16.
extern "C" __global__ void bias_act_bf16(const float* __restrict__ y,
                                         const unsigned short* __restrict__ bias,
                                         unsigned short* __restrict__ out, int rows, int cols,
                                         int act) {
    size_t n = (size_t)rows * cols;
    for (size_t i = blockIdx.x * (size_t)blockDim.x + threadIdx.x; i < n;
         i += (size_t)gridDim.x * blockDim.x) {
        float v = y[i] + bf16_to_f32(bias[i % cols]);
        out[i] = f32_to_bf16(activate(v, act));
    }
}

// out[r, c] = bf16(residual[r, c] + (y[r, c] + bias[c])): the epilogue of a down-projection.
// `out` may be `residual` (each element is read before it is written, by the same thread), so
// neither is __restrict__.
extern "C" __global__ void residual_add_bf16(const float* __restrict__ y,
                                             const unsigned short* __restrict__ bias,
                                             const unsigned short* residual, unsigned short* out,
                                             int rows, int cols) {
    size_t n = (size_t)rows * cols;
    for (size_t i = blockIdx.x * (size_t)blockDim.x + threadIdx.x; i < n;
         i += (size_t)gridDim.x * blockDim.x) {
        float v = y[i] + bf16_to_f32(bias[i % cols]);
        out[i] = f32_to_bf16(bf16_to_f32(residual[i]) + v);
    }
}

// out[r, :] = bf16(x[r, :] / sqrt(mean(x[r, :]^2) + eps) * gamma): one block of RMS_THREADS
// threads per row. Every thread reads its elements before the barrier and writes only its own
// elements after it, so `out` may be `x`.
#define RMS_THREADS 256
extern "C" __global__ void __launch_bounds__(RMS_THREADS)
    rms_norm_bf16(const unsigned short* x, const unsigned short* __restrict__ gamma,
                  unsigned short* out, int rows, int cols, float eps) {
    __shared__ float partial[RMS_THREADS];
    const size_t base = (size_t)blockIdx.x * cols;
    float acc = 0.0f;
    for (int c = threadIdx.x; c < cols; c += RMS_THREADS) {
        float v = bf16_to_f32(x[base + c]);
        acc += v * v;
    }
    partial[threadIdx.x] = acc;
    __syncthreads();
    for (int stride = RMS_THREADS / 2; stride > 0; stride >>= 1) {
        if (threadIdx.x < stride) partial[threadIdx.x] += partial[threadIdx.x + stride];
        __syncthreads();
    }
    const float scale = rsqrtf(partial[0] / (float)cols + eps);
    for (int c = threadIdx.x; c < cols; c += RMS_THREADS)
        out[base + c] = f32_to_bf16(bf16_to_f32(x[base + c]) * scale * bf16_to_f32(gamma[c]));
}

// Writes the bf16 bit pattern `bits` (low 16 bits) to n elements: poisons outputs with NaN.
extern "C" __global__ void fill_bf16(unsigned short* __restrict__ p, unsigned long long n,
                                     unsigned int bits) {
    for (unsigned long long i = blockIdx.x * (unsigned long long)blockDim.x + threadIdx.x; i < n;
         i += (unsigned long long)gridDim.x * blockDim.x)
        p[i] = (unsigned short)bits;
}

// splitmix64's finaliser.
__device__ __forceinline__ unsigned long long mix64(unsigned long long x) {
    x ^= x >> 30;
    x *= 0xBF58476D1CE4E5B9ull;
    x ^= x >> 27;
    x *= 0x94D049BB133111EBull;
    x ^= x >> 31;
    return x;
}

// p[i] = bf16(lo + (hi - lo) * u(seed, i)) with u uniform in [0, 1) on a 2^-24 grid: the same
// values for the same seed on any GPU, and on the host (`uniform_bf16` in src/kernels/decode.rs
// computes them bit for bit: the fused multiply-add is explicit on both sides). Fills GiBs of
// weights in milliseconds, where a host upload would take seconds.
extern "C" __global__ void fill_uniform_bf16(unsigned short* __restrict__ p, unsigned long long n,
                                             unsigned long long seed, float lo, float hi) {
    const unsigned long long key = mix64(seed);
    for (unsigned long long i = blockIdx.x * (unsigned long long)blockDim.x + threadIdx.x; i < n;
         i += (unsigned long long)gridDim.x * blockDim.x) {
        unsigned long long h = mix64((i + 1ull) * 0x9E3779B97F4A7C15ull ^ key);
        float u = (float)(h >> 40) * 5.9604644775390625e-8f;  // 2^-24
        p[i] = f32_to_bf16(__fmaf_rn(hi - lo, u, lo));
    }
}

extern "C" __global__ void convert_f32_to_bf16(const float* __restrict__ in,
                                               unsigned short* __restrict__ out,
                                               unsigned long long n) {
    for (unsigned long long i = blockIdx.x * (unsigned long long)blockDim.x + threadIdx.x; i < n;
         i += (unsigned long long)gridDim.x * blockDim.x)
        out[i] = f32_to_bf16(in[i]);
}

extern "C" __global__ void convert_bf16_to_f32(const unsigned short* __restrict__ in,
                                               float* __restrict__ out, unsigned long long n) {
    for (unsigned long long i = blockIdx.x * (unsigned long long)blockDim.x + threadIdx.x; i < n;
         i += (unsigned long long)gridDim.x * blockDim.x)
        out[i] = bf16_to_f32(in[i]);
}

// out[b] = the FP32 sum of the elements block b visits (grid-stride, SUM_THREADS per block):
// one kernel that reads a whole range and writes gridDim.x floats, with no atomics and no
// zeroing first, so it is one graph node and deterministic. The host adds the partial sums.
#define SUM_THREADS 256
extern "C" __global__ void __launch_bounds__(SUM_THREADS)
    partial_sums_bf16(const unsigned short* __restrict__ p, unsigned long long n,
                      float* __restrict__ out) {
    __shared__ float partial[SUM_THREADS];
    float acc = 0.0f;
    for (unsigned long long i = blockIdx.x * (unsigned long long)SUM_THREADS + threadIdx.x; i < n;
         i += (unsigned long long)gridDim.x * SUM_THREADS)
        acc += bf16_to_f32(p[i]);
    partial[threadIdx.x] = acc;
    __syncthreads();
    for (int stride = SUM_THREADS / 2; stride > 0; stride >>= 1) {
        if (threadIdx.x < stride) partial[threadIdx.x] += partial[threadIdx.x + stride];
        __syncthreads();
    }
    if (threadIdx.x == 0) out[blockIdx.x] = partial[0];
}
