// Pointer conformance: every call that takes or reports a device pointer, on every kind of
// allocation the preload layer makes, printing each return code and each output value. Run it
// without the layer and under each mode; the outputs must be equal line for line, except the
// lines that preload/demo/pointer_conformance.allowed names, each with its reason
// (run-gpu.sh's `conformance` step does the diff).
//
// Addresses differ between runs, so every pointer printed is an offset from the allocation the
// query was about ("start+0", "start+4096"), and per-allocation identifiers are printed as
// whether they agree between two pointers into the same allocation.
//
//   nvcc -std=c++17 -cudart shared -arch=sm_90 pointer_conformance.cu -o pointer_conformance -lcuda -ldl
//
// Allocation kinds (all plain cudaMalloc without the layer; what each becomes under vmm):
//   small      1 MiB: a pool block
//   odd        1000 bytes
//   large      256 MiB: held unmapped under copy elision until its first use
//   stitched   256 MiB after 64 MiB blocks were freed in between: the pool stitches chunks
//   grafted    256 MiB that a 128 MiB copy's source was grafted into (copy elision)
//   tagged     64 MiB under stablebuf_set_tag("conformance") (a tag's region)
//   resumed    the tagged allocation after stablebuf_pause and stablebuf_resume
// The layer's own functions are found with dlsym; without the layer the tagged kinds are
// plain allocations, so the printed lines are the same.

#include <cuda.h>
#include <cuda_runtime.h>
#include <dlfcn.h>

#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>
#include <vector>

#define CHECK_RT(call)                                                                         \
    do {                                                                                       \
        cudaError_t e_ = (call);                                                               \
        if (e_ != cudaSuccess) {                                                               \
            std::printf("FATAL %s: %s (%d) at line %d\n", #call, cudaGetErrorString(e_),       \
                        (int)e_, __LINE__);                                                    \
            std::exit(1);                                                                      \
        }                                                                                      \
    } while (0)

static constexpr size_t MIB = size_t(1) << 20;

__global__ void fill(uint32_t* out, uint32_t value, size_t words) {
    size_t i = blockIdx.x * size_t(blockDim.x) + threadIdx.x;
    if (i < words) out[i] = value + uint32_t(i);
}

// Prints `what: rc=N` and the fields after it.
static void line(const std::string& kind, const char* what, int rc, const std::string& rest) {
    std::printf("%s %s: rc=%d%s%s\n", kind.c_str(), what, rc, rest.empty() ? "" : " ",
                rest.c_str());
}

static std::string offset(uint64_t value, uint64_t start) {
    char text[64];
    if (value >= start && value - start < (uint64_t(1) << 40)) {
        std::snprintf(text, sizeof text, "start+%llu", (unsigned long long)(value - start));
    } else {
        std::snprintf(text, sizeof text, "other(%s)", value == 0 ? "0" : "nonzero");
    }
    return text;
}

// Reads back `words` words at `p` and says whether word i is value + i.
static bool holds(const void* p, uint32_t value, size_t words) {
    std::vector<uint32_t> host(words);
    CHECK_RT(cudaMemcpy(host.data(), p, words * 4, cudaMemcpyDeviceToHost));
    for (size_t i = 0; i < words; i++) {
        if (host[i] != value + uint32_t(i)) return false;
    }
    return true;
}

static void pointer_attributes(const std::string& kind, CUdeviceptr start, size_t bytes) {
    // Three quarters in: in a later chunk than the start when the layer stitched several.
    const CUdeviceptr inside = start + (bytes > 8192 ? (bytes / 4 * 3) & ~size_t(4095) : bytes / 2);
    // cuMemGetAddressRange from a pointer inside.
    {
        CUdeviceptr base = 0;
        size_t size = 0;
        int rc = cuMemGetAddressRange(&base, &size, inside);
        line(kind, "cuMemGetAddressRange(inside)", rc,
             "base=" + offset(base, start) + " size=" + std::to_string(size));
        base = 0;
        rc = cuMemGetAddressRange(&base, nullptr, start);
        line(kind, "cuMemGetAddressRange(start, no size)", rc, "base=" + offset(base, start));
    }
    // cuPointerGetAttribute, one at a time.
    struct Attr {
        CUpointer_attribute id;
        const char* name;
        int kind;  // 0: int, 1: address, 2: size, 3: 64-bit identifier (compared), 4: context
    };
    const Attr attrs[] = {
        {CU_POINTER_ATTRIBUTE_MEMORY_TYPE, "MEMORY_TYPE", 0},
        {CU_POINTER_ATTRIBUTE_DEVICE_ORDINAL, "DEVICE_ORDINAL", 0},
        {CU_POINTER_ATTRIBUTE_DEVICE_POINTER, "DEVICE_POINTER", 1},
        {CU_POINTER_ATTRIBUTE_IS_MANAGED, "IS_MANAGED", 0},
        {CU_POINTER_ATTRIBUTE_MAPPED, "MAPPED", 0},
        {CU_POINTER_ATTRIBUTE_IS_LEGACY_CUDA_IPC_CAPABLE, "IS_LEGACY_CUDA_IPC_CAPABLE", 0},
        {CU_POINTER_ATTRIBUTE_RANGE_START_ADDR, "RANGE_START_ADDR", 1},
        {CU_POINTER_ATTRIBUTE_RANGE_SIZE, "RANGE_SIZE", 2},
        {CU_POINTER_ATTRIBUTE_BUFFER_ID, "BUFFER_ID", 3},
        {CU_POINTER_ATTRIBUTE_CONTEXT, "CONTEXT", 4},
    };
    for (const Attr& a : attrs) {
        uint64_t at_start = 0, at_inside = 0;
        int rc_start = cuPointerGetAttribute(&at_start, a.id, start);
        int rc_inside = cuPointerGetAttribute(&at_inside, a.id, inside);
        std::string rest;
        switch (a.kind) {
            case 0:
                rest = "start=" + std::to_string((unsigned)at_start) +
                       " inside=" + std::to_string((unsigned)at_inside);
                break;
            case 1:
                rest = "start=" + offset(at_start, start) + " inside=" + offset(at_inside, start);
                break;
            case 2:
                rest = "start=" + std::to_string(at_start) + " inside=" + std::to_string(at_inside);
                break;
            default:
                rest = std::string("same=") + (at_start == at_inside ? "yes" : "no") +
                       " nonzero=" + (at_start != 0 ? "yes" : "no");
        }
        line(kind, (std::string("cuPointerGetAttribute ") + a.name).c_str(),
             rc_start == rc_inside ? rc_start : 1000 + rc_inside, rest);
    }
    // cuPointerGetAttributes, all at once from the pointer inside.
    {
        CUpointer_attribute ids[] = {CU_POINTER_ATTRIBUTE_MEMORY_TYPE,
                                     CU_POINTER_ATTRIBUTE_RANGE_START_ADDR,
                                     CU_POINTER_ATTRIBUTE_RANGE_SIZE,
                                     CU_POINTER_ATTRIBUTE_DEVICE_ORDINAL,
                                     CU_POINTER_ATTRIBUTE_MAPPED};
        unsigned memory_type = 0, mapped = 0;
        int ordinal = -1;
        CUdeviceptr range_start = 0;
        size_t range_size = 0;
        void* data[] = {&memory_type, &range_start, &range_size, &ordinal, &mapped};
        int rc = cuPointerGetAttributes(5, ids, data, inside);
        line(kind, "cuPointerGetAttributes(inside)", rc,
             "type=" + std::to_string(memory_type) + " start=" + offset(range_start, start) +
                 " size=" + std::to_string(range_size) + " ordinal=" + std::to_string(ordinal) +
                 " mapped=" + std::to_string(mapped));
    }
    // cudaPointerGetAttributes.
    {
        cudaPointerAttributes attributes;
        std::memset(&attributes, 0, sizeof attributes);
        int rc = cudaPointerGetAttributes(&attributes, (void*)inside);
        line(kind, "cudaPointerGetAttributes(inside)", rc,
             "type=" + std::to_string((int)attributes.type) +
                 " device=" + std::to_string(attributes.device) +
                 " devicePointer=" + offset((uint64_t)attributes.devicePointer, start));
    }
    // Handles: CUDA gives none for cudaMalloc memory.
    {
        CUmemGenericAllocationHandle handle = 0;
        int rc = cuMemRetainAllocationHandle(&handle, (void*)inside);
        if (rc == CUDA_SUCCESS) cuMemRelease(handle);
        line(kind, "cuMemRetainAllocationHandle(inside)", rc, "");
        cudaIpcMemHandle_t ipc;
        int ipc_rc = cudaIpcGetMemHandle(&ipc, (void*)start);
        line(kind, "cudaIpcGetMemHandle(start)", ipc_rc == cudaSuccess ? 0 : 1, "");
        (void)cudaGetLastError();
    }
}

// Graphs built by hand on the allocation: a memset node, a 1D copy node, a kernel node whose
// parameters are then changed in the executable graph, and an exec update.
static void graphs(const std::string& kind, void* start, size_t bytes, cudaStream_t stream) {
    const size_t words = (bytes < 64 * MIB ? bytes : 64 * MIB) / 4;
    cudaGraph_t graph;
    CHECK_RT(cudaGraphCreate(&graph, 0));
    cudaMemsetParams memset_params = {};
    memset_params.dst = start;
    memset_params.value = 0x5a;
    memset_params.elementSize = 1;
    memset_params.width = words * 4;
    memset_params.height = 1;
    cudaGraphNode_t memset_node;
    int rc = cudaGraphAddMemsetNode(&memset_node, graph, nullptr, 0, &memset_params);
    line(kind, "cudaGraphAddMemsetNode", rc, "");
    cudaGraphExec_t exec = nullptr;
    if (rc == cudaSuccess) {
        int irc = cudaGraphInstantiate(&exec, graph, 0);
        int lrc = irc == cudaSuccess ? cudaGraphLaunch(exec, stream) : -1;
        int src = cudaStreamSynchronize(stream);
        std::vector<uint8_t> host(words * 4);
        CHECK_RT(cudaMemcpy(host.data(), start, host.size(), cudaMemcpyDeviceToHost));
        bool ok = true;
        for (uint8_t b : host) ok = ok && b == 0x5a;
        line(kind, "memset graph", irc, "launch=" + std::to_string(lrc) + " sync=" +
                                            std::to_string(src) + " contents=" + (ok ? "right" : "WRONG"));
        if (exec) cudaGraphExecDestroy(exec);
    }
    CHECK_RT(cudaGraphDestroy(graph));
    (void)cudaGetLastError();

    // A kernel node writing the allocation; then its parameters changed to another value in
    // the executable graph, and the graph updated from an identical one.
    uint32_t* out = (uint32_t*)start;
    uint32_t value = 1000;
    size_t count = words;
    void* args[] = {&out, &value, &count};
    cudaKernelNodeParams params = {};
    params.func = (void*)fill;
    params.gridDim = dim3(unsigned((words + 255) / 256));
    params.blockDim = dim3(256);
    params.kernelParams = args;
    CHECK_RT(cudaGraphCreate(&graph, 0));
    cudaGraphNode_t kernel_node;
    rc = cudaGraphAddKernelNode(&kernel_node, graph, nullptr, 0, &params);
    line(kind, "cudaGraphAddKernelNode", rc, "");
    if (rc == cudaSuccess && cudaGraphInstantiate(&exec, graph, 0) == cudaSuccess) {
        CHECK_RT(cudaGraphLaunch(exec, stream));
        CHECK_RT(cudaStreamSynchronize(stream));
        line(kind, "kernel graph", 0, std::string("contents=") + (holds(start, 1000, words) ? "right" : "WRONG"));
        value = 2000;
        int prc = cudaGraphExecKernelNodeSetParams(exec, kernel_node, &params);
        CHECK_RT(cudaGraphLaunch(exec, stream));
        CHECK_RT(cudaStreamSynchronize(stream));
        line(kind, "cudaGraphExecKernelNodeSetParams", prc,
             std::string("contents=") + (holds(start, 2000, words) ? "right" : "WRONG"));
        cudaGraph_t again;
        CHECK_RT(cudaGraphCreate(&again, 0));
        cudaGraphNode_t again_node;
        value = 3000;
        CHECK_RT(cudaGraphAddKernelNode(&again_node, again, nullptr, 0, &params));
        cudaGraphExecUpdateResultInfo info;
        int urc = cudaGraphExecUpdate(exec, again, &info);
        CHECK_RT(cudaGraphLaunch(exec, stream));
        CHECK_RT(cudaStreamSynchronize(stream));
        line(kind, "cudaGraphExecUpdate", urc,
             "result=" + std::to_string((int)info.result) +
                 " contents=" + (holds(start, 3000, words) ? "right" : "WRONG"));
        cudaGraphDestroy(again);
        cudaGraphExecDestroy(exec);
    }
    CHECK_RT(cudaGraphDestroy(graph));
    (void)cudaGetLastError();

    // A 1D copy node from the allocation's first half into its second half.
    if (words >= 2) {
        const size_t half = words / 2 * 4;
        CHECK_RT(cudaGraphCreate(&graph, 0));
        cudaGraphNode_t copy_node;
        rc = cudaGraphAddMemcpyNode1D(&copy_node, graph, nullptr, 0, (char*)start + half, start,
                                      half, cudaMemcpyDefault);
        line(kind, "cudaGraphAddMemcpyNode1D", rc, "");
        if (rc == cudaSuccess && cudaGraphInstantiate(&exec, graph, 0) == cudaSuccess) {
            CHECK_RT(cudaGraphLaunch(exec, stream));
            CHECK_RT(cudaStreamSynchronize(stream));
            std::vector<uint32_t> host(words / 2 * 2);
            CHECK_RT(cudaMemcpy(host.data(), start, host.size() * 4, cudaMemcpyDefault));
            bool ok = std::memcmp(host.data(), host.data() + words / 2, half) == 0;
            line(kind, "copy graph", 0, std::string("contents=") + (ok ? "right" : "WRONG"));
            cudaGraphExecDestroy(exec);
        }
        CHECK_RT(cudaGraphDestroy(graph));
        (void)cudaGetLastError();
    }
}

// A default-kind copy in and out (the runtime infers the direction from the pointers).
static void default_copies(const std::string& kind, void* start, size_t bytes) {
    const size_t words = (bytes < 4 * MIB ? bytes : 4 * MIB) / 4;
    std::vector<uint32_t> in(words), out(words, 0);
    for (size_t i = 0; i < words; i++) in[i] = uint32_t(i * 2654435761u);
    int rc_in = cudaMemcpy(start, in.data(), words * 4, cudaMemcpyDefault);
    int rc_out = cudaMemcpy(out.data(), start, words * 4, cudaMemcpyDefault);
    line(kind, "cudaMemcpy(Default) in and out", rc_in == 0 ? rc_out : rc_in,
         std::string("contents=") + (in == out ? "right" : "WRONG"));
}

static void check_kind(const std::string& kind, void* p, size_t bytes, cudaStream_t stream) {
    pointer_attributes(kind, (CUdeviceptr)p, bytes);
    graphs(kind, p, bytes, stream);
    default_copies(kind, p, bytes);
}

int main() {
    using SetTag = int (*)(const char*);
    using Pause = int (*)(const char*, int);
    using Resume = int (*)(const char*);
    SetTag set_tag = (SetTag)dlsym(RTLD_DEFAULT, "stablebuf_set_tag");
    Pause pause = (Pause)dlsym(RTLD_DEFAULT, "stablebuf_pause");
    Resume resume = (Resume)dlsym(RTLD_DEFAULT, "stablebuf_resume");
    CHECK_RT(cudaSetDevice(0));
    CHECK_RT(cudaFree(nullptr));
    cudaStream_t stream;
    CHECK_RT(cudaStreamCreate(&stream));

    // Fresh allocations: queried before anything touched them (held ones stay unmapped until
    // a flush point, and the query must be one).
    void* small = nullptr;
    void* odd = nullptr;
    void* large = nullptr;
    CHECK_RT(cudaMalloc(&small, MIB));
    CHECK_RT(cudaMalloc(&odd, 1000));
    CHECK_RT(cudaMalloc(&large, 256 * MIB));
    pointer_attributes("large-fresh", (CUdeviceptr)large, 256 * MIB);
    check_kind("small", small, MIB, stream);
    check_kind("odd", odd, 1000, stream);
    check_kind("large", large, 256 * MIB, stream);

    // Stitched: free every other 64 MiB block, then ask for 256 MiB.
    std::vector<void*> blocks(8);
    for (auto& b : blocks) CHECK_RT(cudaMalloc(&b, 64 * MIB));
    for (size_t i = 0; i < blocks.size(); i += 2) CHECK_RT(cudaFree(blocks[i]));
    void* stitched = nullptr;
    CHECK_RT(cudaMalloc(&stitched, 256 * MIB));
    check_kind("stitched", stitched, 256 * MIB, stream);

    // Grafted: the grow-by-copy idiom (malloc larger, copy all, free old).
    void* source = nullptr;
    void* grown = nullptr;
    CHECK_RT(cudaMalloc(&source, 128 * MIB));
    fill<<<unsigned(32 * MIB / 256), 256, 0, stream>>>((uint32_t*)source, 7, 32 * MIB);
    CHECK_RT(cudaGetLastError());
    CHECK_RT(cudaStreamSynchronize(stream));
    CHECK_RT(cudaMalloc(&grown, 256 * MIB));
    CHECK_RT(cudaMemcpy(grown, source, 128 * MIB, cudaMemcpyDeviceToDevice));
    CHECK_RT(cudaFree(source));
    pointer_attributes("grafted-fresh", (CUdeviceptr)grown, 256 * MIB);
    line("grafted", "contents after the copy", 0,
         std::string("contents=") + (holds(grown, 7, 32 * MIB) ? "right" : "WRONG"));
    check_kind("grafted", grown, 256 * MIB, stream);

    // Tagged, then paused and resumed (plain allocations without the layer).
    if (set_tag) set_tag("conformance");
    void* tagged = nullptr;
    CHECK_RT(cudaMalloc(&tagged, 64 * MIB));
    if (set_tag) set_tag(nullptr);
    check_kind("tagged", tagged, 64 * MIB, stream);
    fill<<<unsigned(16 * MIB / 256), 256, 0, stream>>>((uint32_t*)tagged, 11, 16 * MIB);
    CHECK_RT(cudaGetLastError());
    CHECK_RT(cudaStreamSynchronize(stream));
    if (pause && resume) {
        int prc = pause("conformance", 1);
        int rrc = resume("conformance");
        if (prc != 0 || rrc != 0) std::printf("NOTE pause=%d resume=%d\n", prc, rrc);
    }
    line("resumed", "contents kept", 0,
         std::string("contents=") + (holds(tagged, 11, 16 * MIB) ? "right" : "WRONG"));
    check_kind("resumed", tagged, 64 * MIB, stream);

    for (void* p : {small, odd, large, stitched, grown, tagged}) CHECK_RT(cudaFree(p));
    for (size_t i = 1; i < blocks.size(); i += 2) CHECK_RT(cudaFree(blocks[i]));
    CHECK_RT(cudaStreamDestroy(stream));
    std::printf("END\n");
    return 0;
}
