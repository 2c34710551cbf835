// The seed report's two scenarios in plain CUDA C, plus a test that the preload layer catches
// every allocation path it claims to. Runs the same with and without the layer:
//
//   nvcc -O2 -cudart shared -arch=sm_90 -I preload/include seed_scenarios.cu -o seed_scenarios -lcuda -ldl
//   ./seed_scenarios all                       # without the layer
//   LD_PRELOAD=libstablebuf_preload.so STABLEBUF_PRELOAD_MODE=vmm ./seed_scenarios all
//
// `-cudart shared` matters: nvcc links the CUDA runtime statically by default, and a statically
// linked cudaMalloc cannot be interposed by LD_PRELOAD (the call never leaves the binary).
//
// Subcommands: resize, frag, catch, all (resize then frag). Every result is one line starting
// with "RESULT" (key=value pairs) for the runner to parse; "CHECK" lines are single checks.
// Exit status: 0 when every check held, 1 when one failed, 2 when a CUDA call failed outright.

#include <cuda.h>
#include <cuda_runtime.h>
#include <dlfcn.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include <algorithm>
#include <vector>

#include "stablebuf_preload.h"

#define CHECK_CUDA(call)                                                                    \
    do {                                                                                    \
        cudaError_t err_ = (call);                                                          \
        if (err_ != cudaSuccess) {                                                          \
            printf("FATAL %s:%d: %s returned %d (%s)\n", __FILE__, __LINE__, #call,         \
                   (int)err_, cudaGetErrorString(err_));                                    \
            exit(2);                                                                        \
        }                                                                                   \
    } while (0)

#define CHECK_CU(call)                                                                      \
    do {                                                                                    \
        CUresult res_ = (call);                                                             \
        if (res_ != CUDA_SUCCESS) {                                                         \
            printf("FATAL %s:%d: %s returned %d\n", __FILE__, __LINE__, #call, (int)res_);  \
            exit(2);                                                                        \
        }                                                                                   \
    } while (0)

static const size_t MIB = (size_t)1 << 20;
static const size_t GIB = (size_t)1 << 30;

static double now_us(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return ts.tv_sec * 1e6 + ts.tv_nsec / 1e3;
}

// ---- device helpers ---------------------------------------------------------------------

__device__ __forceinline__ uint32_t pattern(uint64_t i, uint32_t seed) {
    uint32_t x = (uint32_t)i * 2654435761u ^ (uint32_t)(i >> 32) ^ seed;
    x ^= x >> 16;
    x *= 0x7feb352du;
    x ^= x >> 15;
    return x;
}

__global__ void fill_kernel(uint32_t *p, uint64_t n, uint32_t seed) {
    uint64_t stride = (uint64_t)gridDim.x * blockDim.x;
    for (uint64_t i = (uint64_t)blockIdx.x * blockDim.x + threadIdx.x; i < n; i += stride) {
        p[i] = pattern(i, seed);
    }
}

// Counts words that differ from the pattern, and sums the words (a checksum that must be the
// same in every mode).
__global__ void verify_kernel(const uint32_t *p, uint64_t n, uint32_t seed,
                              unsigned long long *bad, unsigned long long *sum) {
    uint64_t stride = (uint64_t)gridDim.x * blockDim.x;
    unsigned long long my_bad = 0, my_sum = 0;
    for (uint64_t i = (uint64_t)blockIdx.x * blockDim.x + threadIdx.x; i < n; i += stride) {
        uint32_t v = p[i];
        my_sum += v;
        if (v != pattern(i, seed)) my_bad++;
    }
    if (my_bad) atomicAdd(bad, my_bad);
    atomicAdd(sum, my_sum);
}

static void fill(void *p, size_t bytes, uint32_t seed) {
    fill_kernel<<<1024, 256>>>((uint32_t *)p, bytes / 4, seed);
    CHECK_CUDA(cudaGetLastError());
}

static unsigned long long *counters = NULL;  // [bad, sum] for verify, allocated once

static void verify_init(void) {
    CHECK_CUDA(cudaMalloc((void **)&counters, 2 * sizeof(unsigned long long)));
}

// Returns the number of mismatching words; *checksum gets the sum of the words.
static unsigned long long verify(const void *p, size_t bytes, uint32_t seed,
                                 unsigned long long *checksum) {
    CHECK_CUDA(cudaMemset(counters, 0, 2 * sizeof(unsigned long long)));
    verify_kernel<<<1024, 256>>>((const uint32_t *)p, bytes / 4, seed, counters, counters + 1);
    CHECK_CUDA(cudaGetLastError());
    unsigned long long host[2];
    CHECK_CUDA(cudaMemcpy(host, counters, sizeof host, cudaMemcpyDeviceToHost));
    if (checksum) *checksum = host[1];
    return host[0];
}

// ---- the layer, if loaded ---------------------------------------------------------------

typedef int (*stats_fn)(struct stablebuf_stats *);
typedef int (*tag_fn)(const char *);
typedef int (*pause_fn)(const char *, int);

static stats_fn layer_stats(void) { return (stats_fn)dlsym(RTLD_DEFAULT, "stablebuf_stats"); }

static int read_stats(struct stablebuf_stats *s) {
    memset(s, 0, sizeof *s);
    s->size = sizeof *s;
    stats_fn f = layer_stats();
    return f ? f(s) : -1;
}

static const char *mode_name(void) {
    struct stablebuf_stats s;
    if (read_stats(&s) != 0) return "none";
    switch (s.mode) {
        case 0: return "off";
        case 1: return "monitor";
        case 2: return "vmm";
        default: return "?";
    }
}

static void print_pool(const char *scenario) {
    struct stablebuf_stats s;
    if (read_stats(&s) != 0) return;
    printf("POOL %s mode=%s mapped=%llu cached=%llu mappings=%llu creates=%llu reuses=%llu "
           "stitched=%llu drains=%llu oom=%llu deferred=%llu elided=%llu performed=%llu\n",
           scenario, mode_name(), (unsigned long long)s.pool_mapped,
           (unsigned long long)s.pool_cached, (unsigned long long)s.pool_mappings,
           (unsigned long long)s.pool_creates, (unsigned long long)s.pool_reuses,
           (unsigned long long)s.pool_stitched, (unsigned long long)s.pool_drains,
           (unsigned long long)s.oom_errors, (unsigned long long)s.copies_deferred,
           (unsigned long long)s.copies_elided, (unsigned long long)s.copies_performed);
}

// ---- scenario 1: resize by copy ---------------------------------------------------------

// Allocate 1.5 GiB, fill, allocate 3 GiB, copy, free the old, verify on the device; ten
// rounds. Timed: allocate 3 GiB + copy + free old, up to the copy's completion.
static int resize(int rounds) {
    const size_t old_bytes = 3 * GIB / 2, new_bytes = 3 * GIB;
    std::vector<double> times;
    unsigned long long bad_total = 0, checksum_total = 0;
    for (int r = 0; r < rounds; r++) {
        void *a = NULL, *b = NULL;
        CHECK_CUDA(cudaMalloc(&a, old_bytes));
        fill(a, old_bytes, 1000 + r);
        CHECK_CUDA(cudaDeviceSynchronize());

        double t0 = now_us();
        CHECK_CUDA(cudaMalloc(&b, new_bytes));
        CHECK_CUDA(cudaMemcpy(b, a, old_bytes, cudaMemcpyDeviceToDevice));
        CHECK_CUDA(cudaFree(a));
        CHECK_CUDA(cudaDeviceSynchronize());
        times.push_back(now_us() - t0);

        unsigned long long checksum = 0;
        bad_total += verify(b, old_bytes, 1000 + r, &checksum);
        checksum_total += checksum;
        // The new block's tail is usable too.
        fill((char *)b + old_bytes, new_bytes - old_bytes, 7);
        CHECK_CUDA(cudaDeviceSynchronize());
        CHECK_CUDA(cudaFree(b));
    }
    std::vector<double> sorted = times;
    std::sort(sorted.begin(), sorted.end());
    double mean = 0;
    for (double t : times) mean += t;
    mean /= times.size();
    double steady = 0;
    for (size_t i = 1; i < times.size(); i++) steady += times[i];
    steady = times.size() > 1 ? steady / (times.size() - 1) : mean;
    printf("RESULT scenario=resize mode=%s rounds=%d mean_us=%.1f median_us=%.1f min_us=%.1f "
           "first_us=%.1f steady_us=%.1f mismatches=%llu checksum=%llu\n",
           mode_name(), rounds, mean, sorted[sorted.size() / 2], sorted[0], times[0], steady,
           bad_total, checksum_total);
    print_pool("resize");
    return bad_total == 0 ? 0 : 1;
}

// ---- scenario 2: fragmentation ----------------------------------------------------------

// Fill ~92% of free memory with 64 MiB blocks, free a random half (the same half every run),
// then ask for one block of 95% of what is free plus cached.
static int frag(void) {
    const size_t block = 64 * MIB;
    size_t free0 = 0, total = 0;
    CHECK_CUDA(cudaMemGetInfo(&free0, &total));
    size_t want = (size_t)(free0 * 0.92) / block;
    std::vector<void *> blocks;
    double t0 = now_us();
    for (size_t i = 0; i < want; i++) {
        void *p = NULL;
        if (cudaMalloc(&p, block) != cudaSuccess) {
            cudaGetLastError();
            break;
        }
        blocks.push_back(p);
    }
    double fill_ms = (now_us() - t0) / 1e3;
    // A fixed-seed shuffle: the same blocks are freed in every mode.
    uint64_t state = 0x9e3779b97f4a7c15ull;
    std::vector<size_t> order(blocks.size());
    for (size_t i = 0; i < order.size(); i++) order[i] = i;
    for (size_t i = order.size(); i > 1; i--) {
        state = state * 6364136223846793005ull + 1442695040888963407ull;
        size_t j = (size_t)((state >> 33) % i);
        std::swap(order[i - 1], order[j]);
    }
    size_t freed = blocks.size() / 2;
    t0 = now_us();
    for (size_t k = 0; k < freed; k++) {
        CHECK_CUDA(cudaFree(blocks[order[k]]));
        blocks[order[k]] = NULL;
    }
    double free_ms = (now_us() - t0) / 1e3;
    size_t free1 = 0;
    CHECK_CUDA(cudaMemGetInfo(&free1, &total));
    size_t ask = (size_t)(free1 * 0.95) / (2 * MIB) * (2 * MIB);

    void *big = NULL;
    t0 = now_us();
    cudaError_t err = cudaMalloc(&big, ask);
    double ask_ms = (now_us() - t0) / 1e3;
    unsigned long long bad = 0;
    int served = err == cudaSuccess;
    if (served) {
        fill(big, ask, 42);
        bad = verify(big, ask, 42, NULL);
        CHECK_CUDA(cudaFree(big));
    } else {
        cudaGetLastError();
    }
    printf("RESULT scenario=frag mode=%s total=%zu free_before=%zu blocks=%zu freed=%zu "
           "free_after=%zu ask=%zu served=%d error=%d ask_ms=%.2f fill_ms=%.1f free_ms=%.1f "
           "mismatches=%llu\n",
           mode_name(), total, free0, blocks.size() + 0, freed, free1, ask, served, (int)err,
           ask_ms, fill_ms, free_ms, bad);
    print_pool("frag");
    for (void *p : blocks)
        if (p) CHECK_CUDA(cudaFree(p));
    return bad == 0 ? 0 : 1;
}

// ---- the catch test ---------------------------------------------------------------------

static int checks_passed = 0, checks_failed = 0;

static void check(const char *name, long long expected, long long got) {
    int ok = expected == got;
    printf("CHECK %s expected=%lld got=%lld %s\n", name, expected, got, ok ? "ok" : "FAILED");
    if (ok) checks_passed++;
    else checks_failed++;
}

typedef CUresult (*mem_alloc_fn)(CUdeviceptr *, size_t);

// Every allocation path the layer claims to catch, and the error paths it promises.
static int catch_test(void) {
    CHECK_CUDA(cudaSetDevice(0));
    CHECK_CUDA(cudaFree(0));  // the usual way to create the runtime's context
    struct stablebuf_stats s0, s1;
    int layer = read_stats(&s0) == 0;
    int counting = layer && s0.mode != 0;  // monitor and vmm count allocations
    int vmm = layer && s0.mode == 2;
    const size_t bytes = 64 * MIB;
    printf("CATCH layer=%d mode=%s\n", layer, mode_name());

    // 1. cudaMalloc (runtime symbol).
    void *p_rt = NULL;
    CHECK_CUDA(cudaMalloc(&p_rt, bytes));
    // 2. cuMemAlloc (the driver symbol cuMemAlloc_v2, linked from libcuda).
    CUdeviceptr p_sym = 0;
    CHECK_CU(cuMemAlloc(&p_sym, bytes));
    // 3. cuGetProcAddress("cuMemAlloc").
    mem_alloc_fn via_proc = NULL;
    CUdriverProcAddressQueryResult proc_status;
    CHECK_CU(cuGetProcAddress("cuMemAlloc", (void **)&via_proc, CUDA_VERSION,
                              CU_GET_PROC_ADDRESS_DEFAULT, &proc_status));
    CUdeviceptr p_proc = 0;
    CHECK_CU(via_proc(&p_proc, bytes));
    // 4. cudaGetDriverEntryPoint("cuMemAlloc"). Deprecated in CUDA 13 (the header may hide
    //    it) but still exported: looked up like any symbol, which is also what a program linked
    //    against it resolves to.
    typedef cudaError_t (*entry_point_fn)(const char *, void **, unsigned long long,
                                          cudaDriverEntryPointQueryResult *);
    entry_point_fn get_entry_point =
        (entry_point_fn)dlsym(RTLD_DEFAULT, "cudaGetDriverEntryPoint");
    if (!get_entry_point) {
        printf("FATAL cudaGetDriverEntryPoint is not exported by this runtime\n");
        exit(2);
    }
    mem_alloc_fn via_entry = NULL;
    cudaDriverEntryPointQueryResult entry_status;
    CHECK_CUDA(get_entry_point("cuMemAlloc", (void **)&via_entry, cudaEnableDefault,
                               &entry_status));
    CUdeviceptr p_entry = 0;
    CHECK_CU(via_entry(&p_entry, bytes));
    // 5. cudaGetDriverEntryPointByVersion("cuMemAlloc").
    mem_alloc_fn via_version = NULL;
    CHECK_CUDA(cudaGetDriverEntryPointByVersion("cuMemAlloc", (void **)&via_version,
                                                CUDART_VERSION, cudaEnableDefault,
                                                &entry_status));
    CUdeviceptr p_version = 0;
    CHECK_CU(via_version(&p_version, bytes));
    // 6. cudaMallocAsync on a stream.
    cudaStream_t stream;
    CHECK_CUDA(cudaStreamCreate(&stream));
    void *p_async = NULL;
    CHECK_CUDA(cudaMallocAsync(&p_async, bytes, stream));
    CHECK_CUDA(cudaStreamSynchronize(stream));

    read_stats(&s1);
    if (layer) {
        check("runtime_allocs(cudaMalloc+cudaMallocAsync)", counting ? 2 : 0,
              (long long)(s1.runtime_allocs - s0.runtime_allocs));
        check("driver_allocs(symbol+cuGetProcAddress+2 entry points)", counting ? 4 : 0,
              (long long)(s1.driver_allocs - s0.driver_allocs));
        check("entry_points_hooked", counting ? 3 : 0,
              (long long)(s1.entry_points - s0.entry_points));
        if (vmm) check("live_allocations", 6, (long long)(s1.live_allocations - s0.live_allocations));
    }

    // The memory works: fill and verify each allocation on the device.
    void *all[6] = {p_rt, (void *)p_sym, (void *)p_proc, (void *)p_entry, (void *)p_version,
                    p_async};
    unsigned long long bad = 0;
    for (int i = 0; i < 6; i++) {
        fill(all[i], bytes, 77 + i);
        bad += verify(all[i], bytes, 77 + i, NULL);
    }
    check("mismatches", 0, (long long)bad);

    // NULL outputs are tolerated by the layer (the runtime itself may refuse them).
    size_t free_only = 0, total_only = 0;
    cudaError_t info_rt = cudaMemGetInfo(&free_only, NULL);
    CUresult info_drv = cuMemGetInfo(NULL, &total_only);
    cudaGetLastError();  // without the layer the runtime may have refused NULL: clear it
    if (counting) {
        check("cudaMemGetInfo(&free, NULL)", 0, info_rt);
        check("cuMemGetInfo(NULL, &total)", 0, info_drv);
        check("free_reported", 1, free_only > 0);
        check("total_reported", 1, total_only > 0);
    } else {
        printf("INFO cudaMemGetInfo(&free, NULL)=%d cuMemGetInfo(NULL, &total)=%d (no layer)\n",
               (int)info_rt, (int)info_drv);
    }

    // Legacy IPC of the layer's memory: a clear error in vmm mode, success otherwise.
    cudaIpcMemHandle_t handle;
    cudaError_t ipc = cudaIpcGetMemHandle(&handle, p_rt);
    check("cudaIpcGetMemHandle", vmm ? cudaErrorInvalidValue : cudaSuccess, ipc);
    cudaGetLastError();

    // A pointer the layer does not own (managed memory) is freed by CUDA.
    void *managed = NULL;
    CHECK_CUDA(cudaMallocManaged(&managed, 2 * MIB, cudaMemAttachGlobal));
    struct stablebuf_stats s2;
    read_stats(&s2);
    CHECK_CUDA(cudaFree(managed));

    CHECK_CUDA(cudaFree(p_rt));
    CHECK_CU(cuMemFree(p_sym));
    CHECK_CU(cuMemFree(p_proc));
    CHECK_CU(cuMemFree(p_entry));
    CHECK_CU(cuMemFree(p_version));
    CHECK_CUDA(cudaFreeAsync(p_async, stream));
    CHECK_CUDA(cudaStreamSynchronize(stream));
    struct stablebuf_stats s3;
    read_stats(&s3);
    if (layer) {
        check("frees_of_layer_pointers", counting ? 6 : 0, (long long)(s3.frees - s2.frees));
        check("foreign_frees(managed)", counting ? 1 : 0,
              (long long)(s3.foreign_frees - s2.foreign_frees));
        if (vmm) check("live_allocations_after", (long long)s0.live_allocations,
                       (long long)s3.live_allocations);
    }

    // Pause and resume through the C ABI, from C.
    if (vmm) {
        tag_fn set_tag = (tag_fn)dlsym(RTLD_DEFAULT, "stablebuf_set_tag");
        pause_fn pause = (pause_fn)dlsym(RTLD_DEFAULT, "stablebuf_pause");
        tag_fn resume = (tag_fn)dlsym(RTLD_DEFAULT, "stablebuf_resume");
        check("set_tag", STABLEBUF_OK, set_tag("catch"));
        void *tagged = NULL;
        CHECK_CUDA(cudaMalloc(&tagged, bytes));
        check("set_tag(NULL)", STABLEBUF_OK, set_tag(NULL));
        fill(tagged, bytes, 5);
        CHECK_CUDA(cudaDeviceSynchronize());
        size_t before = 0, after = 0;
        CHECK_CU(cuMemGetInfo(&before, NULL));
        check("pause(catch, keep)", STABLEBUF_OK, pause("catch", 1));
        CHECK_CU(cuMemGetInfo(&after, NULL));
        // cuMemGetInfo through the layer adds the pool's cache, which a pause does not change.
        check("pause_freed_at_least_the_allocation", 1, after >= before + bytes);
        check("pause(unknown)", STABLEBUF_ERR_UNKNOWN_TAG, pause("never-set", 1));
        check("resume(catch)", STABLEBUF_OK, resume("catch"));
        check("resume(catch) again", STABLEBUF_OK, resume("catch"));
        check("mismatches_after_resume", 0, (long long)verify(tagged, bytes, 5, NULL));
        CHECK_CUDA(cudaFree(tagged));
    }
    CHECK_CUDA(cudaStreamDestroy(stream));
    printf("RESULT scenario=catch mode=%s passed=%d failed=%d\n", mode_name(), checks_passed,
           checks_failed);
    return checks_failed == 0 ? 0 : 1;
}

int main(int argc, char **argv) {
    const char *what = argc > 1 ? argv[1] : "all";
    int rounds = argc > 2 ? atoi(argv[2]) : 10;
    setvbuf(stdout, NULL, _IOLBF, 0);
    CHECK_CUDA(cudaSetDevice(0));
    CHECK_CUDA(cudaFree(0));
    verify_init();
    int status = 0;
    if (!strcmp(what, "resize") || !strcmp(what, "all")) status |= resize(rounds);
    if (!strcmp(what, "frag") || !strcmp(what, "all")) status |= frag();
    if (!strcmp(what, "catch")) status |= catch_test();
    return status;
}
