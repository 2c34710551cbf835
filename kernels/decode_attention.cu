// stablebuf decode attention over a KV cache on stable addresses (issue 45): one query token
// per sequence, grouped-query heads, bf16 K/V read from the cache's token-major rows, each
// sequence's length read from device memory, so one captured graph serves every step and reads
// only valid tokens: the work follows the tokens, not max_len.
//
// Header-free like decode.cu (NVRTC from the wheel has no CUDA headers): bf16 travels as
// `unsigned short`, everything is computed in FP32.
//
//   q    [batch, heads, dim]                 bf16
//   k, v row b at b * seq_stride elements;   token t at + t * kv_heads * dim; head g at + g * dim
//   lengths [batch]                          unsigned int (tokens; clamped to max_len)
//   out  [batch, heads, dim]                 FP32
//
// Grid (heads, batch), ATT_WARPS warps per block. Each warp takes tokens w, w + ATT_WARPS, ...,
// scores them (lanes over dim, shuffle reduction) and keeps its own online softmax (running
// max, sum and dim accumulators, ATT_MAX_DIM / 32 per lane); the warps' partials are merged at
// the end. A sequence of length 0 gives zeros.

#define ATT_WARPS 4
#define ATT_MAX_DIM 256
// -inf without math headers.
#define ATT_NEG_INF __int_as_float(0xff800000)

__device__ __forceinline__ float att_bf16(unsigned short bits) {
    return __uint_as_float((unsigned int)bits << 16);
}

__device__ __forceinline__ unsigned short att_to_bf16(float value) {
    unsigned int u = __float_as_uint(value);
    if ((u & 0x7fffffffu) > 0x7f800000u) return (unsigned short)((u >> 16) | 0x0040u);
    u += 0x7fffu + ((u >> 16) & 1u);
    return (unsigned short)(u >> 16);
}

extern "C" __global__ void __launch_bounds__(ATT_WARPS * 32)
decode_attention_bf16(const unsigned short* __restrict__ q, const unsigned short* __restrict__ k,
                      const unsigned short* __restrict__ v, const unsigned int* __restrict__ lengths,
                      float* __restrict__ out, int heads, int kv_heads, int dim,
                      unsigned long long seq_stride, int max_len, float scale) {
    __shared__ float sq[ATT_MAX_DIM];
    __shared__ float sacc[ATT_WARPS][ATT_MAX_DIM];
    __shared__ float smax[ATT_WARPS];
    __shared__ float ssum[ATT_WARPS];
    const int h = blockIdx.x, b = blockIdx.y;
    const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
    const int g = h / (heads / kv_heads);
    unsigned int len = lengths[b];
    if (len > (unsigned int)max_len) len = (unsigned int)max_len;

    const unsigned short* qh = q + ((unsigned long long)b * heads + h) * dim;
    for (int d = threadIdx.x; d < dim; d += blockDim.x) sq[d] = att_bf16(qh[d]) * scale;
    __syncthreads();

    const unsigned long long row = (unsigned long long)b * seq_stride;
    const unsigned long long token_elems = (unsigned long long)kv_heads * dim;
    float m = ATT_NEG_INF, l = 0.0f;
    float acc[ATT_MAX_DIM / 32];
#pragma unroll
    for (int i = 0; i < ATT_MAX_DIM / 32; ++i) acc[i] = 0.0f;

    for (unsigned int t = warp; t < len; t += ATT_WARPS) {
        const unsigned long long at = row + t * token_elems + (unsigned long long)g * dim;
        float s = 0.0f;
        for (int d = lane; d < dim; d += 32) s += sq[d] * att_bf16(k[at + d]);
#pragma unroll
        for (int o = 16; o > 0; o >>= 1) s += __shfl_xor_sync(0xffffffffu, s, o);
        const float m_new = fmaxf(m, s);
        const float rescale = expf(m - m_new);  // 0 on the first token (m = -inf)
        const float p = expf(s - m_new);
        l = l * rescale + p;
#pragma unroll
        for (int i = 0; i < ATT_MAX_DIM / 32; ++i) {
            const int d = lane + 32 * i;
            if (d < dim) acc[i] = acc[i] * rescale + p * att_bf16(v[at + d]);
        }
        m = m_new;
    }
#pragma unroll
    for (int i = 0; i < ATT_MAX_DIM / 32; ++i) {
        const int d = lane + 32 * i;
        if (d < dim) sacc[warp][d] = acc[i];
    }
    if (lane == 0) {
        smax[warp] = m;
        ssum[warp] = l;
    }
    __syncthreads();

    float mx = ATT_NEG_INF;
    for (int w = 0; w < ATT_WARPS; ++w) mx = fmaxf(mx, smax[w]);
    float total = 0.0f;
    for (int w = 0; w < ATT_WARPS; ++w)
        if (smax[w] != ATT_NEG_INF) total += ssum[w] * expf(smax[w] - mx);
    float* oh = out + ((unsigned long long)b * heads + h) * dim;
    for (int d = threadIdx.x; d < dim; d += blockDim.x) {
        float o = 0.0f;
        for (int w = 0; w < ATT_WARPS; ++w)
            if (smax[w] != ATT_NEG_INF) o += sacc[w][d] * expf(smax[w] - mx);
        oh[d] = total > 0.0f ? o / total : 0.0f;
    }
}

// Writes each sequence's new token (k_new, v_new: [batch, kv_heads * dim] bf16) at position
// lengths[b] - 1 of its rows: the append a decode step does before attention, inside the same
// graph. Sequences of length 0 (free slots) or past max_len write nothing.
extern "C" __global__ void kv_append_bf16(unsigned short* __restrict__ k,
                                          unsigned short* __restrict__ v,
                                          const unsigned short* __restrict__ k_new,
                                          const unsigned short* __restrict__ v_new,
                                          const unsigned int* __restrict__ lengths, int batch,
                                          int token_elems, unsigned long long seq_stride,
                                          int max_len) {
    const unsigned long long n = (unsigned long long)batch * token_elems;
    for (unsigned long long i = blockIdx.x * (unsigned long long)blockDim.x + threadIdx.x; i < n;
         i += (unsigned long long)gridDim.x * blockDim.x) {
        const unsigned long long b = i / token_elems, e = i % token_elems;
        const unsigned int len = lengths[b];
        if (len == 0 || len > (unsigned int)max_len) continue;
        const unsigned long long at = b * seq_stride + (unsigned long long)(len - 1) * token_elems + e;
        k[at] = k_new[i];
        v[at] = v_new[i];
    }
}

// FP32 to bf16 for the attention output, when the next GEMM wants bf16.
extern "C" __global__ void attention_out_bf16(const float* __restrict__ in,
                                              unsigned short* __restrict__ out,
                                              unsigned long long n) {
    for (unsigned long long i = blockIdx.x * (unsigned long long)blockDim.x + threadIdx.x; i < n;
         i += (unsigned long long)gridDim.x * blockDim.x)
        out[i] = att_to_bf16(in[i]);
}
