// Copy elision must give exactly what the copy would have given, whatever the program does
// between the copy and the free. This program runs the grow-by-copy idiom
//
//   cudaMalloc(&src); fill(src); cudaMalloc(&dst); cudaMemcpy(dst, src, D2D); <op>; cudaFree(src)
//
// with one <op> per scenario, then prints a hash of every buffer it can read ("HASH" lines).
// The runner (run-gpu.sh) runs it without the layer and with vmm + elision and compares every
// line: a deferred copy that was performed too late, or a graft over a written source, changes
// a hash. `random` runs seeded random programs (malloc, grow-by-copy, launch, memset, copy,
// graph capture and launch, free) from several threads, each thread on its own buffers (so
// the results do not depend on how threads interleave, but the layer's state is shared).
//
//   nvcc -O2 -std=c++17 -cudart shared -arch=sm_90 -I preload/include elision_interleavings.cu \
//        -o elision_interleavings -lcuda -ldl [--default-stream per-thread]
//   ./elision_interleavings list | <scenario> | random <programs> <seed>
//
// Buffers are small (MiB): run with STABLEBUF_PRELOAD_ELIDE_MIN=1M so they are eligible.
// Exit status: 0 ok, 2 a CUDA call failed.

#include <cuda.h>
#include <cuda_runtime.h>
#include <dlfcn.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <algorithm>
#include <string>
#include <thread>
#include <vector>

#include "stablebuf_preload.h"

#define CHECK_CUDA(call)                                                                    \
    do {                                                                                    \
        cudaError_t err_ = (call);                                                          \
        if (err_ != cudaSuccess) {                                                          \
            printf("FATAL %s:%d: %s returned %d (%s)\n", __FILE__, __LINE__, #call,         \
                   (int)err_, cudaGetErrorString(err_));                                    \
            fflush(stdout);                                                                 \
            exit(2);                                                                        \
        }                                                                                   \
    } while (0)

#define CHECK_CU(call)                                                                      \
    do {                                                                                    \
        CUresult res_ = (call);                                                             \
        if (res_ != CUDA_SUCCESS) {                                                         \
            printf("FATAL %s:%d: %s returned %d\n", __FILE__, __LINE__, #call, (int)res_);  \
            fflush(stdout);                                                                 \
            exit(2);                                                                        \
        }                                                                                   \
    } while (0)

static const size_t MIB = (size_t)1 << 20;
static const size_t WORDS = 4 * MIB / 4;  // the source: 4 MiB
static const int GRID = 256, BLOCK = 256;

__device__ __forceinline__ uint32_t pattern(uint64_t i, uint32_t seed) {
    uint32_t x = (uint32_t)i * 2654435761u ^ seed * 0x9e3779b9u;
    x ^= x >> 16;
    x *= 0x7feb352du;
    x ^= x >> 15;
    return x;
}

__global__ void fill_kernel(uint32_t *p, uint64_t n, uint32_t seed) {
    uint64_t stride = (uint64_t)gridDim.x * blockDim.x;
    for (uint64_t i = (uint64_t)blockIdx.x * blockDim.x + threadIdx.x; i < n; i += stride)
        p[i] = pattern(i, seed);
}

__global__ void add_kernel(uint32_t *dst, const uint32_t *src, uint64_t n) {
    uint64_t stride = (uint64_t)gridDim.x * blockDim.x;
    for (uint64_t i = (uint64_t)blockIdx.x * blockDim.x + threadIdx.x; i < n; i += stride)
        dst[i] = dst[i] * 31u + src[i];
}

// FNV-1a over the words, on the host (after one device-to-host copy).
static uint64_t hash_words(const uint32_t *device, size_t n) {
    std::vector<uint32_t> host(n);
    CHECK_CUDA(cudaMemcpy(host.data(), device, n * 4, cudaMemcpyDeviceToHost));
    uint64_t h = 1469598103934665603ull;
    for (size_t i = 0; i < n; i++) {
        h ^= host[i];
        h *= 1099511628211ull;
    }
    return h;
}

typedef int (*stats_fn)(struct stablebuf_stats *);

static void print_stats(const char *what) {
    stats_fn f = (stats_fn)dlsym(RTLD_DEFAULT, "stablebuf_stats");
    if (!f) {
        printf("STATS %s layer=none\n", what);
        return;
    }
    struct stablebuf_stats s;
    memset(&s, 0, sizeof s);
    s.size = sizeof s;
    if (f(&s) != 0) {
        printf("STATS %s failed\n", what);
        return;
    }
    printf("STATS %s deferred=%llu elided=%llu performed=%llu cancelled=%llu\n", what,
           (unsigned long long)s.copies_deferred, (unsigned long long)s.copies_elided,
           (unsigned long long)s.copies_performed, (unsigned long long)s.copies_cancelled);
}

// ---- the scenarios ------------------------------------------------------------------------

struct Resize {
    uint32_t *src = nullptr, *dst = nullptr;
};

// malloc src, fill it, malloc dst (fresh), copy all of src to the start of dst: deferred.
static Resize begin_resize(uint32_t seed) {
    Resize r;
    CHECK_CUDA(cudaMalloc(&r.src, WORDS * 4));
    fill_kernel<<<GRID, BLOCK>>>(r.src, WORDS, seed);
    CHECK_CUDA(cudaGetLastError());
    CHECK_CUDA(cudaMalloc(&r.dst, 2 * WORDS * 4));
    CHECK_CUDA(cudaMemcpy(r.dst, r.src, WORDS * 4, cudaMemcpyDeviceToDevice));
    return r;
}

static uint32_t *filled(size_t words, uint32_t seed) {
    uint32_t *p;
    CHECK_CUDA(cudaMalloc(&p, words * 4));
    fill_kernel<<<GRID, BLOCK>>>(p, words, seed);
    CHECK_CUDA(cudaGetLastError());
    CHECK_CUDA(cudaDeviceSynchronize());
    return p;
}

static void report(const char *name, const char *buffer, const uint32_t *p, size_t words) {
    printf("HASH %s %s %016llx\n", name, buffer, (unsigned long long)hash_words(p, words));
}

static void writer_thread(uint32_t *p, uint32_t seed) {
    // cudaStreamLegacy: ordered after the copy in both stream modes (legacy and per-thread).
    fill_kernel<<<GRID, BLOCK, 0, cudaStreamLegacy>>>(p, WORDS, seed);
    cudaError_t e = cudaStreamSynchronize(cudaStreamLegacy);
    if (e != cudaSuccess) printf("FATAL thread: %d\n", (int)e);
}

static CUfunction driver_function(const void *kernel) {
    cudaFunction_t f;
    CHECK_CUDA(cudaGetFuncBySymbol(&f, kernel));
    return (CUfunction)f;
}

static void run_scenario(const std::string &name) {
    const char *n = name.c_str();
    // Buffers made before the resize (so the resize's destination stays fresh).
    uint32_t *other = filled(WORDS, 40);
    uint32_t *third = filled(2 * WORDS, 41);
    uint32_t *unrelated = filled(WORDS, 42);
    cudaStream_t side;
    CHECK_CUDA(cudaStreamCreateWithFlags(&side, cudaStreamNonBlocking));
    cudaGraphExec_t prebuilt = nullptr;
    Resize r;
    if (name == "graph_writes_src") {
        // The graph is captured before the copy, on the source that is about to be copied.
        CHECK_CUDA(cudaMalloc(&r.src, WORDS * 4));
        fill_kernel<<<GRID, BLOCK>>>(r.src, WORDS, 1);
        cudaGraph_t g;
        CHECK_CUDA(cudaStreamBeginCapture(side, cudaStreamCaptureModeRelaxed));
        fill_kernel<<<GRID, BLOCK, 0, side>>>(r.src, WORDS, 77);
        CHECK_CUDA(cudaStreamEndCapture(side, &g));
        CHECK_CUDA(cudaGraphInstantiate(&prebuilt, g, 0));
        CHECK_CUDA(cudaGraphDestroy(g));
        CHECK_CUDA(cudaDeviceSynchronize());
        CHECK_CUDA(cudaMalloc(&r.dst, 2 * WORDS * 4));
        CHECK_CUDA(cudaMemcpy(r.dst, r.src, WORDS * 4, cudaMemcpyDeviceToDevice));
    } else {
        r = begin_resize(1);
    }

    cudaGraphExec_t after_free = nullptr;
    if (name == "plain") {
    } else if (name == "kernel_writes_src") {
        fill_kernel<<<GRID, BLOCK>>>(r.src, WORDS, 2);
    } else if (name == "kernel_writes_dst") {
        fill_kernel<<<GRID, BLOCK>>>(r.dst, WORDS / 2, 3);
    } else if (name == "kernel_reads_dst") {
        add_kernel<<<GRID, BLOCK>>>(third, r.dst, WORDS);
    } else if (name == "memcpy_into_src") {
        CHECK_CUDA(cudaMemcpy(r.src, other, WORDS * 4, cudaMemcpyDeviceToDevice));
    } else if (name == "memcpy_async_into_dst") {
        CHECK_CUDA(cudaMemcpyAsync(r.dst + WORDS / 4, other, WORDS, cudaMemcpyDeviceToDevice, 0));
    } else if (name == "memcpy_dst_to_host") {
        std::vector<uint32_t> host(16);
        CHECK_CUDA(cudaMemcpy(host.data(), r.dst, 64, cudaMemcpyDeviceToHost));
        printf("HASH %s host %08x%08x\n", n, host[0], host[15]);
    } else if (name == "memcpy2d_into_src") {
        CHECK_CUDA(cudaMemcpy2D(r.src, 4096, other, 4096, 2048, 64, cudaMemcpyDeviceToDevice));
    } else if (name == "memset_src") {
        CHECK_CUDA(cudaMemset(r.src, 0x5a, WORDS * 4));
    } else if (name == "memset_async_dst") {
        CHECK_CUDA(cudaMemsetAsync(r.dst, 0x11, WORDS * 2, 0));
    } else if (name == "other_stream_writes_src") {
        cudaEvent_t e;
        CHECK_CUDA(cudaEventCreateWithFlags(&e, cudaEventDisableTiming));
        CHECK_CUDA(cudaEventRecord(e, 0));
        CHECK_CUDA(cudaStreamWaitEvent(side, e, 0));
        fill_kernel<<<GRID, BLOCK, 0, side>>>(r.src, WORDS, 5);
        CHECK_CUDA(cudaStreamSynchronize(side));
        CHECK_CUDA(cudaEventDestroy(e));
    } else if (name == "other_thread_writes_src") {
        std::thread t(writer_thread, r.src, 6u);
        t.join();
    } else if (name == "graph_writes_src") {
        CHECK_CUDA(cudaGraphLaunch(prebuilt, 0));
    } else if (name == "capture_between") {
        // Capture (not launch) a kernel writing dst; launched after the free.
        cudaGraph_t g;
        CHECK_CUDA(cudaStreamBeginCapture(side, cudaStreamCaptureModeRelaxed));
        fill_kernel<<<GRID, BLOCK, 0, side>>>(r.dst, WORDS / 2, 7);
        CHECK_CUDA(cudaStreamEndCapture(side, &g));
        CHECK_CUDA(cudaGraphInstantiate(&after_free, g, 0));
        CHECK_CUDA(cudaGraphDestroy(g));
    } else if (name == "free_unrelated") {
        CHECK_CUDA(cudaFree(unrelated));
        unrelated = nullptr;
    } else if (name == "free_dst_first") {
        CHECK_CUDA(cudaFree(r.dst));
        r.dst = nullptr;
    } else if (name == "driver_launch_writes_src" || name == "driver_launch_ptsz_writes_src") {
        // As cuBLAS-like code does: the launch function from cuGetProcAddress.
        bool per_thread = name == "driver_launch_ptsz_writes_src";
        void *fn = nullptr;
        CUdriverProcAddressQueryResult status;
        CHECK_CU(cuGetProcAddress("cuLaunchKernel", &fn, 12000,
                                  per_thread ? CU_GET_PROC_ADDRESS_PER_THREAD_DEFAULT_STREAM
                                             : CU_GET_PROC_ADDRESS_DEFAULT,
                                  &status));
        typedef CUresult (*launch_fn)(CUfunction, unsigned, unsigned, unsigned, unsigned,
                                      unsigned, unsigned, unsigned, CUstream, void **, void **);
        CUfunction f = driver_function((const void *)fill_kernel);
        uint32_t *p = r.src;
        uint64_t words = WORDS;
        uint32_t seed = 8;
        void *args[] = {&p, &words, &seed};
        CHECK_CU(((launch_fn)fn)(f, GRID, 1, 1, BLOCK, 1, 1, 0, nullptr, args, nullptr));
    } else if (name == "driver_write_value_src") {
        void *fn = nullptr;
        CUdriverProcAddressQueryResult status;
        CHECK_CU(cuGetProcAddress("cuStreamWriteValue32", &fn, 12000, CU_GET_PROC_ADDRESS_DEFAULT,
                                  &status));
        typedef CUresult (*write_fn)(CUstream, CUdeviceptr, cuuint32_t, unsigned);
        CUresult res = ((write_fn)fn)(nullptr, (CUdeviceptr)r.src, 0xdeadbeefu, 0);
        if (res == CUDA_ERROR_NOT_SUPPORTED) {
            printf("HASH %s skipped stream-memory-operations-not-supported\n", n);
        } else {
            CHECK_CU(res);
        }
    } else if (name == "driver_memset_src") {
        CHECK_CU(cuMemsetD32Async((CUdeviceptr)r.src, 0x12345678u, WORDS, nullptr));
    } else {
        printf("FATAL unknown scenario %s\n", n);
        exit(2);
    }
    CHECK_CUDA(cudaGetLastError());
    CHECK_CUDA(cudaFree(r.src));
    if (after_free) {
        CHECK_CUDA(cudaGraphLaunch(after_free, 0));
        CHECK_CUDA(cudaGraphExecDestroy(after_free));
    }
    CHECK_CUDA(cudaDeviceSynchronize());
    if (r.dst) report(n, "dst", r.dst, WORDS);
    report(n, "third", third, 2 * WORDS);
    report(n, "other", other, WORDS);
    if (unrelated) report(n, "unrelated", unrelated, WORDS);
    if (r.dst) CHECK_CUDA(cudaFree(r.dst));
    CHECK_CUDA(cudaFree(other));
    CHECK_CUDA(cudaFree(third));
    if (unrelated) CHECK_CUDA(cudaFree(unrelated));
    if (prebuilt) CHECK_CUDA(cudaGraphExecDestroy(prebuilt));
    CHECK_CUDA(cudaStreamDestroy(side));
    print_stats(n);
}

static const char *SCENARIOS[] = {
    "plain", "kernel_writes_src", "kernel_writes_dst", "kernel_reads_dst", "memcpy_into_src",
    "memcpy_async_into_dst", "memcpy_dst_to_host", "memcpy2d_into_src", "memset_src",
    "memset_async_dst", "other_stream_writes_src", "other_thread_writes_src",
    "graph_writes_src", "capture_between", "free_unrelated", "free_dst_first",
    "driver_memset_src", "driver_launch_writes_src", "driver_launch_ptsz_writes_src",
    "driver_write_value_src",
};

// ---- random programs ----------------------------------------------------------------------

struct Rng {
    uint64_t s;
    uint32_t next() {
        s ^= s << 13;
        s ^= s >> 7;
        s ^= s << 17;
        return (uint32_t)(s >> 11);
    }
    uint32_t below(uint32_t n) { return next() % n; }
};

struct Slot {
    uint32_t *p = nullptr;
    size_t words = 0;  // allocated
    size_t valid = 0;  // written (only these are hashed)
};

// ELIDE_TRACE=<program>: every operation of that program's threads goes to stderr, so a
// program whose hashes differ can be read step by step.
static int traced_program() {
    static int traced = getenv("ELIDE_TRACE") ? atoi(getenv("ELIDE_TRACE")) : -1;
    return traced;
}
#define TRACE(...)                                                                            \
    do {                                                                                      \
        if (program == traced_program()) {                                                    \
            fprintf(stderr, "TRACE P%d T%d op%d: ", program, thread, op);                   \
            fprintf(stderr, __VA_ARGS__);                                                     \
            fprintf(stderr, "\n");                                                            \
        }                                                                                     \
    } while (0)

static void random_thread(uint64_t seed, int program, int thread, std::vector<std::string> *out) {
    Rng rng{seed * 0x9e3779b97f4a7c15ull + 1};
    cudaStream_t s;
    // Non-blocking: this thread's work never waits for, nor races with, another thread's.
    CHECK_CUDA(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking));
    Slot slots[3];
    int ops = 8 + (int)rng.below(10);
    for (int op = 0; op < ops; op++) {
        Slot &a = slots[rng.below(3)];
        Slot &b = slots[rng.below(3)];
        uint32_t kind = rng.below(9);
        int ai = (int)(&a - slots), bi = (int)(&b - slots);
        if (!a.p || kind == 0) {
            TRACE("realloc slot %d (%p) then fill", ai, (void *)a.p);
            if (a.p) CHECK_CUDA(cudaFree(a.p));
            a.words = (1 + rng.below(3)) * (MIB / 4);
            CHECK_CUDA(cudaMalloc(&a.p, a.words * 4));
            fill_kernel<<<GRID, BLOCK, 0, s>>>(a.p, a.words, rng.next());
            a.valid = a.words;
        } else if (kind <= 3) {
            // Grow by copy, with 0-2 operations between the copy and the free.
            uint32_t *grown;
            size_t words = a.words * 2;
            CHECK_CUDA(cudaMalloc(&grown, words * 4));
            CHECK_CUDA(cudaMemcpyAsync(grown, a.p, a.words * 4, cudaMemcpyDeviceToDevice, s));
            int between = (int)rng.below(3);
            TRACE("grow slot %d %p -> %p (%zu words copied, valid %zu), %d between", ai,
                  (void *)a.p, (void *)grown, a.words, a.valid, between);
            for (int k = 0; k < between; k++) {
                uint32_t what = rng.below(5);
                TRACE("  between %d: %u (b = slot %d %p)", k, what, bi, (void *)b.p);
                switch (what) {
                case 0: fill_kernel<<<GRID, BLOCK, 0, s>>>(a.p, a.words, rng.next()); break;
                case 1: fill_kernel<<<GRID, BLOCK, 0, s>>>(grown, a.words / 2, rng.next()); break;
                case 2: CHECK_CUDA(cudaMemsetAsync(a.p, rng.below(256), a.words * 2, s)); break;
                case 3:
                    if (b.p && b.p != a.p) add_kernel<<<GRID, BLOCK, 0, s>>>(b.p, grown, std::min(b.valid, a.valid));
                    break;
                default: CHECK_CUDA(cudaStreamSynchronize(s)); break;
                }
            }
            CHECK_CUDA(cudaFree(a.p));
            a.p = grown;
            a.words = words;
        } else if (kind == 4) {
            TRACE("fill slot %d valid %zu", ai, a.valid);
            fill_kernel<<<GRID, BLOCK, 0, s>>>(a.p, a.valid, rng.next());
        } else if (kind == 5 && b.p && b.p != a.p) {
            size_t n = std::min(a.valid, b.valid);
            TRACE("add slot %d += slot %d, %zu words", ai, bi, n);
            add_kernel<<<GRID, BLOCK, 0, s>>>(a.p, b.p, n);
        } else if (kind == 6 && b.p && b.p != a.p) {
            size_t n = std::min(a.words, b.valid);
            TRACE("copy slot %d <- slot %d, %zu words", ai, bi, n);
            CHECK_CUDA(cudaMemcpyAsync(a.p, b.p, n * 4, cudaMemcpyDeviceToDevice, s));
            a.valid = std::max(a.valid, n);
        } else if (kind == 7) {
            TRACE("memset slot %d valid %zu", ai, a.valid);
            CHECK_CUDA(cudaMemsetAsync(a.p, rng.below(256), a.valid * 4, s));
        } else {
            TRACE("kind %u on slot %d: graph fill valid/2 (or nothing)", kind, ai);
            // A graph with one kernel writing a (built with the graph API: a stream capture
            // here would conflict with other threads' implicit synchronisations), launched once.
            cudaGraph_t g;
            cudaGraphExec_t e;
            uint32_t *p = a.p;
            uint64_t n = a.valid / 2;
            uint32_t seed = rng.next();
            void *args[] = {&p, &n, &seed};
            cudaKernelNodeParams kp = {};
            kp.func = (void *)fill_kernel;
            kp.gridDim = dim3(GRID);
            kp.blockDim = dim3(BLOCK);
            kp.kernelParams = args;
            cudaGraphNode_t node;
            CHECK_CUDA(cudaGraphCreate(&g, 0));
            CHECK_CUDA(cudaGraphAddKernelNode(&node, g, nullptr, 0, &kp));
            CHECK_CUDA(cudaGraphInstantiate(&e, g, 0));
            CHECK_CUDA(cudaGraphLaunch(e, s));
            CHECK_CUDA(cudaStreamSynchronize(s));
            CHECK_CUDA(cudaGraphExecDestroy(e));
            CHECK_CUDA(cudaGraphDestroy(g));
        }
        CHECK_CUDA(cudaGetLastError());
    }
    CHECK_CUDA(cudaStreamSynchronize(s));
    for (int i = 0; i < 3; i++) {
        if (!slots[i].p) continue;
        char line[128];
        snprintf(line, sizeof line, "RHASH %d %d %d %zu %016llx", program, thread, i,
                 slots[i].valid, (unsigned long long)hash_words(slots[i].p, slots[i].valid));
        out->push_back(line);
        CHECK_CUDA(cudaFree(slots[i].p));
    }
    CHECK_CUDA(cudaStreamDestroy(s));
}

static void run_random(int programs, uint64_t seed) {
    Rng rng{seed | 1};
    for (int program = 0; program < programs; program++) {
        int threads = 2 + (int)rng.below(3);
        std::vector<std::vector<std::string>> lines(threads);
        std::vector<std::thread> running;
        for (int t = 0; t < threads; t++)
            running.emplace_back(random_thread, rng.next() + ((uint64_t)program << 32), program, t,
                                 &lines[t]);
        for (auto &t : running) t.join();
        for (auto &thread_lines : lines)
            for (auto &l : thread_lines) printf("%s\n", l.c_str());
    }
    printf("RANDOM programs=%d seed=%llu\n", programs, (unsigned long long)seed);
    print_stats("random");
}

int main(int argc, char **argv) {
    if (argc < 2) {
        printf("usage: %s list | all | <scenario> | random <programs> <seed>\n", argv[0]);
        return 2;
    }
    std::string what = argv[1];
    CHECK_CUDA(cudaSetDevice(0));
    CHECK_CUDA(cudaFree(0));
    if (what == "list") {
        for (const char *s : SCENARIOS) printf("%s\n", s);
    } else if (what == "all") {
        for (const char *s : SCENARIOS) run_scenario(s);
    } else if (what == "random") {
        run_random(argc > 2 ? atoi(argv[2]) : 1000, argc > 3 ? strtoull(argv[3], 0, 10) : 1);
    } else {
        run_scenario(what);
    }
    fflush(stdout);
    return 0;
}
