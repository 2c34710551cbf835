// stablebuf kernels: FP32 matmuls and the small helpers the examples and tests need.
//
// Header-free on purpose: NVRTC from the `nvidia-cuda-nvrtc-cu12` wheel has no CUDA headers.
// All matrices are row-major; C[M,N] = A[M,K] * B[K,N].

// One thread per output element. The reference for correctness, not for speed.
extern "C" __global__ void matmul_naive(const float* __restrict__ A, const float* __restrict__ B,
                                        float* __restrict__ C, int M, int N, int K) {
    int row = blockIdx.y * blockDim.y + threadIdx.y;
    int col = blockIdx.x * blockDim.x + threadIdx.x;
    if (row >= M || col >= N) return;
    float acc = 0.0f;
    for (int k = 0; k < K; ++k) acc += A[row * K + k] * B[k * N + col];
    C[row * N + col] = acc;
}

// Shared-memory tiling, 16x16 tiles, any shape (edges are bounds-checked).
#define TILE 16
extern "C" __global__ void matmul_tiled(const float* __restrict__ A, const float* __restrict__ B,
                                        float* __restrict__ C, int M, int N, int K) {
    __shared__ float As[TILE][TILE];
    __shared__ float Bs[TILE][TILE + 1];
    int row = blockIdx.y * TILE + threadIdx.y;
    int col = blockIdx.x * TILE + threadIdx.x;
    float acc = 0.0f;
    for (int t = 0; t < K; t += TILE) {
        int ak = t + threadIdx.x;
        int bk = t + threadIdx.y;
        As[threadIdx.y][threadIdx.x] = (row < M && ak < K) ? A[row * K + ak] : 0.0f;
        Bs[threadIdx.y][threadIdx.x] = (bk < K && col < N) ? B[bk * N + col] : 0.0f;
        __syncthreads();
#pragma unroll
        for (int k = 0; k < TILE; ++k) acc += As[threadIdx.y][k] * Bs[k][threadIdx.x];
        __syncthreads();
    }
    if (row < M && col < N) C[row * N + col] = acc;
}

// Register tiling: a 128x128 block tile, 8-deep K slices, 256 threads each computing 8x8 outputs,
// 128-bit loads and stores. A is stored transposed in shared memory so both operands are read
// as float4. Requires M % 128 == 0, N % 128 == 0, K % 8 == 0 and 16-byte aligned pointers
// (the host checks; other shapes go to matmul_tiled).
#define RT_BM 128
#define RT_BN 128
#define RT_BK 8
#define RT_TM 8
#define RT_TN 8
extern "C" __global__ void __launch_bounds__(256)
    matmul_regtile(const float* __restrict__ A, const float* __restrict__ B, float* __restrict__ C,
                   int M, int N, int K) {
    __shared__ __align__(16) float As[2][RT_BK * RT_BM];
    __shared__ __align__(16) float Bs[2][RT_BK * RT_BN];

    const int tid = threadIdx.x;
    const int threadRow = tid / (RT_BN / RT_TN);
    const int threadCol = tid % (RT_BN / RT_TN);

    A += (size_t)blockIdx.y * RT_BM * K;
    B += (size_t)blockIdx.x * RT_BN;
    C += (size_t)blockIdx.y * RT_BM * N + (size_t)blockIdx.x * RT_BN;

    // Each thread moves one float4 of the A tile (128x8) and one of the B tile (8x128).
    const int aRow = tid / (RT_BK / 4);
    const int aCol = tid % (RT_BK / 4);
    const int bRow = tid / (RT_BN / 4);
    const int bCol = tid % (RT_BN / 4);

    float acc[RT_TM][RT_TN];
#pragma unroll
    for (int i = 0; i < RT_TM; ++i)
#pragma unroll
        for (int j = 0; j < RT_TN; ++j) acc[i][j] = 0.0f;

    // Prologue: stage the first K slice.
    float4 aNext = *reinterpret_cast<const float4*>(&A[(size_t)aRow * K + aCol * 4]);
    float4 bNext = *reinterpret_cast<const float4*>(&B[(size_t)bRow * N + bCol * 4]);
    As[0][(aCol * 4 + 0) * RT_BM + aRow] = aNext.x;
    As[0][(aCol * 4 + 1) * RT_BM + aRow] = aNext.y;
    As[0][(aCol * 4 + 2) * RT_BM + aRow] = aNext.z;
    As[0][(aCol * 4 + 3) * RT_BM + aRow] = aNext.w;
    *reinterpret_cast<float4*>(&Bs[0][bRow * RT_BN + bCol * 4]) = bNext;
    __syncthreads();

    int buf = 0;
    for (int k0 = 0; k0 < K; k0 += RT_BK) {
        const bool more = k0 + RT_BK < K;
        // Fetch the next slice into registers while this one is consumed (double buffering).
        if (more) {
            aNext = *reinterpret_cast<const float4*>(&A[(size_t)aRow * K + k0 + RT_BK + aCol * 4]);
            bNext = *reinterpret_cast<const float4*>(&B[(size_t)(k0 + RT_BK + bRow) * N + bCol * 4]);
        }
#pragma unroll
        for (int d = 0; d < RT_BK; ++d) {
            float regM[RT_TM];
            float regN[RT_TN];
            // Rows of this thread are threadRow*4 + {0..3} and 64 + threadRow*4 + {0..3}: two
            // float4 reads that neighbouring threads make from neighbouring addresses.
            float4 m0 = *reinterpret_cast<const float4*>(&As[buf][d * RT_BM + threadRow * 4]);
            float4 m1 = *reinterpret_cast<const float4*>(&As[buf][d * RT_BM + 64 + threadRow * 4]);
            float4 n0 = *reinterpret_cast<const float4*>(&Bs[buf][d * RT_BN + threadCol * 4]);
            float4 n1 = *reinterpret_cast<const float4*>(&Bs[buf][d * RT_BN + 64 + threadCol * 4]);
            regM[0] = m0.x; regM[1] = m0.y; regM[2] = m0.z; regM[3] = m0.w;
            regM[4] = m1.x; regM[5] = m1.y; regM[6] = m1.z; regM[7] = m1.w;
            regN[0] = n0.x; regN[1] = n0.y; regN[2] = n0.z; regN[3] = n0.w;
            regN[4] = n1.x; regN[5] = n1.y; regN[6] = n1.z; regN[7] = n1.w;
#pragma unroll
            for (int i = 0; i < RT_TM; ++i)
#pragma unroll
                for (int j = 0; j < RT_TN; ++j) acc[i][j] += regM[i] * regN[j];
        }
        if (more) {
            const int nb = buf ^ 1;
            As[nb][(aCol * 4 + 0) * RT_BM + aRow] = aNext.x;
            As[nb][(aCol * 4 + 1) * RT_BM + aRow] = aNext.y;
            As[nb][(aCol * 4 + 2) * RT_BM + aRow] = aNext.z;
            As[nb][(aCol * 4 + 3) * RT_BM + aRow] = aNext.w;
            *reinterpret_cast<float4*>(&Bs[nb][bRow * RT_BN + bCol * 4]) = bNext;
            __syncthreads();
            buf = nb;
        }
    }

#pragma unroll
    for (int i = 0; i < RT_TM; ++i) {
        const int r = (i < 4) ? (threadRow * 4 + i) : (64 + threadRow * 4 + (i - 4));
        float4 lo = make_float4(acc[i][0], acc[i][1], acc[i][2], acc[i][3]);
        float4 hi = make_float4(acc[i][4], acc[i][5], acc[i][6], acc[i][7]);
        *reinterpret_cast<float4*>(&C[(size_t)r * N + threadCol * 4]) = lo;
        *reinterpret_cast<float4*>(&C[(size_t)r * N + 64 + threadCol * 4]) = hi;
    }
}

// y[r, c] = act(y[r, c] + bias[c]); act 0 = identity, 1 = ReLU.
extern "C" __global__ void bias_act(float* __restrict__ y, const float* __restrict__ bias, int rows,
                                    int cols, int act) {
    size_t n = (size_t)rows * cols;
    for (size_t i = blockIdx.x * (size_t)blockDim.x + threadIdx.x; i < n;
         i += (size_t)gridDim.x * blockDim.x) {
        float v = y[i] + bias[i % cols];
        y[i] = (act == 1 && v < 0.0f) ? 0.0f : v;
    }
}

// Fills n floats with one value (used to poison outputs before a run).
extern "C" __global__ void fill_f32(float* __restrict__ p, unsigned long long n, float value) {
    for (unsigned long long i = blockIdx.x * (unsigned long long)blockDim.x + threadIdx.x; i < n;
         i += (unsigned long long)gridDim.x * blockDim.x)
        p[i] = value;
}

// Busy-waits for `ns` nanoseconds of GPU time: stands in for a long kernel in ordering tests.
extern "C" __global__ void spin_ns(unsigned long long ns) {
    unsigned long long start, now;
    asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(start));
    do {
        asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(now));
    } while (now - start < ns);
}

// A 32-bit value that depends only on the element's index and a seed (splitmix64's finaliser):
// a pattern written before a buffer grows or moves can be checked element by element after.
__device__ __forceinline__ unsigned int pattern_u32(unsigned long long i, unsigned int seed) {
    unsigned long long x = (i + 1) * 0x9E3779B97F4A7C15ull ^ ((unsigned long long)seed << 32 | seed);
    x ^= x >> 30;
    x *= 0xBF58476D1CE4E5B9ull;
    x ^= x >> 27;
    x *= 0x94D049BB133111EBull;
    x ^= x >> 31;
    // Always odd, so it never equals an even poison such as a NaN fill (0x7fc00000): a check
    // of a poisoned range then fails on every element, not on all but a few by chance.
    return (unsigned int)x | 1u;
}

// p[i] = pattern(i, seed) for i in [first, first + count).
extern "C" __global__ void fill_pattern_u32(unsigned int* __restrict__ p, unsigned long long first,
                                            unsigned long long count, unsigned int seed) {
    for (unsigned long long j = blockIdx.x * (unsigned long long)blockDim.x + threadIdx.x; j < count;
         j += (unsigned long long)gridDim.x * blockDim.x)
        p[first + j] = pattern_u32(first + j, seed);
}

// Adds to *mismatches the number of i in [first, first + count) where p[i] != pattern(i, seed).
extern "C" __global__ void count_pattern_mismatches_u32(const unsigned int* __restrict__ p,
                                                        unsigned long long first,
                                                        unsigned long long count, unsigned int seed,
                                                        unsigned long long* mismatches) {
    unsigned long long local = 0;
    for (unsigned long long j = blockIdx.x * (unsigned long long)blockDim.x + threadIdx.x; j < count;
         j += (unsigned long long)gridDim.x * blockDim.x)
        local += p[first + j] != pattern_u32(first + j, seed);
    if (local != 0)
        atomicAdd(mismatches, local);
}

// p[i] = a * p[i] + b: reads and writes every element, in place.
extern "C" __global__ void affine_f32(float* __restrict__ p, unsigned long long n, float a, float b) {
    for (unsigned long long i = blockIdx.x * (unsigned long long)blockDim.x + threadIdx.x; i < n;
         i += (unsigned long long)gridDim.x * blockDim.x)
        p[i] = a * p[i] + b;
}
