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
    /// `libnccl` (NCCL's user-buffer registration and the end of a communicator).
    Nccl,
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
    /// Asks about a device pointer (its range, attributes or handle): the layer's memory is
    /// made ready and described as one allocation (see `query.rs`).
    Query,
    /// Work that may touch any memory: deferred copies are performed first.
    Flush,
    /// NCCL's registration of a user buffer, or the end of a communicator: a registration of
    /// tagged memory is kept current across pauses and resumes (`engine/nccl.rs`).
    NcclRegistration,
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

const fn nccl(name: &'static str) -> Hooked {
    Hooked {
        name,
        library: Library::Nccl,
        role: Role::NcclRegistration,
    }
}

const fn drv(name: &'static str, role: Role) -> Hooked {
    Hooked {
        name,
        library: Library::Driver,
        role,
    }
}

/// The CUDA (and NCCL) functions the layer hooks for more than a flush point. The real ones are
/// found at run time (never linked). With [`RUNTIME_FLUSH_POINTS`] and [`DRIVER_FLUSH_POINTS`]:
/// every hooked function ([`hooked`]).
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
    rt("cudaPointerGetAttributes", Role::Query),
    rt("cudaMemcpy", Role::Copy),
    rt("cudaMemcpyAsync", Role::Copy),
    // Runtime: per-thread-default-stream forms of the memory functions.
    rt("cudaMemcpy_ptds", Role::Copy),
    rt("cudaMemcpyAsync_ptsz", Role::Copy),
    rt("cudaMallocAsync_ptsz", Role::Allocate),
    rt("cudaFreeAsync_ptsz", Role::Free),
    rt("cudaGetDriverEntryPoint_ptsz", Role::EntryPoint),
    rt("cudaGetDriverEntryPointByVersion_ptsz", Role::EntryPoint),
    // Driver: memory.
    drv("cuMemAlloc_v2", Role::Allocate),
    drv("cuMemFree_v2", Role::Free),
    drv("cuMemGetInfo_v2", Role::MemoryInfo),
    drv("cuGetProcAddress", Role::EntryPoint),
    drv("cuGetProcAddress_v2", Role::EntryPoint),
    // Driver: pointer queries.
    drv("cuMemGetAddressRange_v2", Role::Query),
    drv("cuPointerGetAttribute", Role::Query),
    drv("cuPointerGetAttributes", Role::Query),
    drv("cuMemRetainAllocationHandle", Role::Query),
    // NCCL: registrations of tagged memory are renewed around pauses; a communicator's end
    // drops its records.
    nccl("ncclCommRegister"),
    nccl("ncclCommDeregister"),
    nccl("ncclCommDestroy"),
    nccl("ncclCommAbort"),
];

// The flush points, named once in `flush_points.rs`: here only their names.
macro_rules! runtime_flush_points {
    ($( $name:ident($($arg:ident: $ty:ty),* $(,)?); )*) => {
        /// The runtime's flush points (`flush_points.rs`): launches, graph launches and graphs
        /// built by hand, memsets and copies the layer does not defer, synchronisations, with
        /// the per-thread-default-stream forms and `__cudaLaunchKernel` (nvcc's `<<<>>>`).
        pub const RUNTIME_FLUSH_POINTS: &[Hooked] = &[$( rt(stringify!($name), Role::Flush), )*];
    };
}
macro_rules! driver_flush_points {
    ($( $name:ident($($arg:ident: $ty:ty),* $(,)?); )*) => {
        /// The driver's flush points (`flush_points.rs`), with the per-thread variants that
        /// `cuGetProcAddress` hands out with `CU_GET_PROC_ADDRESS_PER_THREAD_DEFAULT_STREAM`.
        pub const DRIVER_FLUSH_POINTS: &[Hooked] = &[$( drv(stringify!($name), Role::Flush), )*];
    };
}
include!("flush_points.rs");

/// Every hooked CUDA function: [`HOOKED`], then the flush points.
pub fn hooked() -> impl Iterator<Item = &'static Hooked> {
    HOOKED
        .iter()
        .chain(RUNTIME_FLUSH_POINTS)
        .chain(DRIVER_FLUSH_POINTS)
}

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
    hooked().map(|h| h.name).chain(ABI.iter().copied())
}
