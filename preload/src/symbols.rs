// The one table of what the library exports. `build.rs` includes this file to write the linker
// version script (everything not listed here stays local), the export test compares `nm -D` of
// the built library with it, and a source test checks that `ffi.rs` defines exactly these
// functions. Keep it free of `use` and crate paths: it is compiled in both places.

/// Which library a hooked function belongs to.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Library {
    /// `libcudart` (the CUDA runtime).
    Runtime,
    /// `libcuda` (the CUDA driver).
    Driver,
}

/// What the layer does with a hooked function.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Role {
    /// Allocates device memory: served by the pool (vmm) or logged (monitor).
    Allocate,
    /// Frees device memory: the layer's own pointers are freed by it, others passed on.
    Free,
    /// Reports free and total memory (the pool's view in vmm mode; NULL outputs tolerated).
    MemoryInfo,
    /// Looks up a driver function: the layer's hooks are returned for hooked driver functions.
    EntryPoint,
    /// `cudaIpcGetMemHandle`: refused with a clear error for the layer's (VMM) pointers.
    Ipc,
    /// A device-to-device copy that copy elision may defer.
    Copy,
    /// Work that may touch any memory: deferred copies are performed first.
    Flush,
}

/// One hooked CUDA function.
#[derive(Clone, Copy, Debug)]
pub struct Hooked {
    pub name: &'static str,
    pub library: Library,
    pub role: Role,
}

const fn rt(name: &'static str, role: Role) -> Hooked {
    Hooked {
        name,
        library: Library::Runtime,
        role,
    }
}

const fn drv(name: &'static str, role: Role) -> Hooked {
    Hooked {
        name,
        library: Library::Driver,
        role,
    }
}

/// Every CUDA function the layer defines. The real ones are found at run time (never linked).
pub const HOOKED: &[Hooked] = &[
    // Runtime: memory.
    rt("cudaMalloc", Role::Allocate),
    rt("cudaMallocAsync", Role::Allocate),
    rt("cudaFree", Role::Free),
    rt("cudaFreeAsync", Role::Free),
    rt("cudaMemGetInfo", Role::MemoryInfo),
    rt("cudaGetDriverEntryPoint", Role::EntryPoint),
    rt("cudaGetDriverEntryPointByVersion", Role::EntryPoint),
    rt("cudaIpcGetMemHandle", Role::Ipc),
    rt("cudaMemcpy", Role::Copy),
    rt("cudaMemcpyAsync", Role::Copy),
    // Runtime: flush points.
    rt("cudaLaunchKernel", Role::Flush),
    rt("cudaLaunchKernelExC", Role::Flush),
    rt("cudaLaunchCooperativeKernel", Role::Flush),
    rt("cudaLaunchHostFunc", Role::Flush),
    rt("cudaGraphLaunch", Role::Flush),
    rt("cudaMemset", Role::Flush),
    rt("cudaMemsetAsync", Role::Flush),
    rt("cudaMemset2D", Role::Flush),
    rt("cudaMemset2DAsync", Role::Flush),
    rt("cudaMemcpy2D", Role::Flush),
    rt("cudaMemcpy2DAsync", Role::Flush),
    rt("cudaMemcpy3D", Role::Flush),
    rt("cudaMemcpy3DAsync", Role::Flush),
    rt("cudaMemcpyPeer", Role::Flush),
    rt("cudaMemcpyPeerAsync", Role::Flush),
    rt("cudaMemcpyToSymbol", Role::Flush),
    rt("cudaMemcpyFromSymbol", Role::Flush),
    rt("cudaStreamSynchronize", Role::Flush),
    rt("cudaStreamQuery", Role::Flush),
    rt("cudaStreamWaitEvent", Role::Flush),
    rt("cudaStreamBeginCapture", Role::Flush),
    rt("cudaEventRecord", Role::Flush),
    rt("cudaEventSynchronize", Role::Flush),
    rt("cudaEventQuery", Role::Flush),
    rt("cudaDeviceSynchronize", Role::Flush),
    // Driver: memory.
    drv("cuMemAlloc_v2", Role::Allocate),
    drv("cuMemFree_v2", Role::Free),
    drv("cuMemGetInfo_v2", Role::MemoryInfo),
    drv("cuGetProcAddress", Role::EntryPoint),
    drv("cuGetProcAddress_v2", Role::EntryPoint),
    // Driver: flush points.
    drv("cuLaunchKernel", Role::Flush),
    drv("cuLaunchKernelEx", Role::Flush),
    drv("cuLaunchCooperativeKernel", Role::Flush),
    drv("cuGraphLaunch", Role::Flush),
    drv("cuMemcpy", Role::Flush),
    drv("cuMemcpyAsync", Role::Flush),
    drv("cuMemcpyDtoD_v2", Role::Flush),
    drv("cuMemcpyDtoDAsync_v2", Role::Flush),
    drv("cuMemcpyHtoD_v2", Role::Flush),
    drv("cuMemcpyHtoDAsync_v2", Role::Flush),
    drv("cuMemcpyDtoH_v2", Role::Flush),
    drv("cuMemcpyDtoHAsync_v2", Role::Flush),
    drv("cuMemsetD8_v2", Role::Flush),
    drv("cuMemsetD32_v2", Role::Flush),
    drv("cuMemsetD8Async", Role::Flush),
    drv("cuMemsetD32Async", Role::Flush),
    drv("cuStreamSynchronize", Role::Flush),
    drv("cuCtxSynchronize", Role::Flush),
];

/// The layer's own C ABI (declared in `include/stablebuf_preload.h`).
pub const ABI: &[&str] = &[
    "stablebuf_set_tag",
    "stablebuf_pause",
    "stablebuf_resume",
    "stablebuf_stats",
    "stablebuf_reserve_host",
    "stablebuf_error_string",
];

/// Every symbol the library exports, in table order.
pub fn exported() -> impl Iterator<Item = &'static str> {
    HOOKED.iter().map(|h| h.name).chain(ABI.iter().copied())
}
