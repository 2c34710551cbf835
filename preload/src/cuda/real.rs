//! The real CUDA functions, found at run time and never linked (a link-time dependency on
//! `libcudart` makes the loader exit 127 where pip's `libcudart.so.13` is not on the search
//! path: torch_memory_saver PR #108).
//!
//! Runtime lookup, in order, until `cudaGetDevice` is found:
//! 1. `dlsym(RTLD_NEXT, ..)`: the next definition after this library in the global scope;
//! 2. `dlopen(name, RTLD_NOLOAD)` of `libcudart.so.13`, `.so.12` and `.so`: a runtime already
//!    loaded with `RTLD_LOCAL` (PyTorch's pip wheels load theirs as a dependency of a module that
//!    Python imports `RTLD_LOCAL`, where `RTLD_NEXT` cannot see it);
//! 3. `dl_iterate_phdr`: any loaded object whose path contains `libcudart`.
//!
//! The driver is found the same way (`libcuda.so.1`), and as a last resort opened with `dlopen`
//! (the runtime would load it anyway). A table is resolved once, on the first call that needs
//! it, and kept only if found, so a later call can still succeed.
//!
//! This module and `ffi.rs` are the only ones with `unsafe`.

#![allow(non_snake_case)]

use std::ffi::{c_char, c_int, c_uint, c_void, CStr, CString};
use std::sync::OnceLock;

use crate::cuda::codes::{cu, cuda, nccl, Fail};

pub type Stream = *mut c_void;
pub type Event = *mut c_void;
pub type DevicePtr = u64;

/// `dim3`, passed by value.
#[repr(C)]
#[derive(Clone, Copy, Debug)]
pub struct Dim3 {
    pub x: c_uint,
    pub y: c_uint,
    pub z: c_uint,
}

/// `struct cudaPitchedPtr`, passed by value (`cudaMemset3D`).
#[repr(C)]
#[derive(Clone, Copy, Debug)]
pub struct PitchedPtr {
    pub ptr: *mut c_void,
    pub pitch: usize,
    pub xsize: usize,
    pub ysize: usize,
}

/// `struct cudaExtent`, passed by value (`cudaMemset3D`).
#[repr(C)]
#[derive(Clone, Copy, Debug)]
pub struct Extent {
    pub width: usize,
    pub height: usize,
    pub depth: usize,
}

/// `cudaStreamLegacy` and `cudaStreamPerThread`: the handles CUDA gives the two default streams.
pub const STREAM_LEGACY: u64 = 0x1;
pub const STREAM_PER_THREAD: u64 = 0x2;

/// `cudaMemcpyDeviceToDevice` and `cudaMemcpyDefault`.
pub const MEMCPY_DEVICE_TO_DEVICE: c_int = 3;
pub const MEMCPY_DEFAULT: c_int = 4;

macro_rules! function_table {
    ($(#[$meta:meta])* $table:ident { $( $name:ident : fn($($arg:ty),*) -> $ret:ty; )* }) => {
        $(#[$meta])*
        pub struct $table {
            $( pub $name: Option<unsafe extern "C" fn($($arg),*) -> $ret>, )*
        }

        impl $table {
            fn resolve(lookup: &dyn Fn(&CStr) -> *mut c_void) -> Self {
                Self {
                    $( $name: {
                        let name = concat!(stringify!($name), "\0");
                        let symbol = CStr::from_bytes_with_nul(name.as_bytes())
                            .expect("a literal with one NUL at the end");
                        let found = lookup(symbol);
                        if found.is_null() {
                            None
                        } else {
                            // SAFETY: `found` is the address of the C function of that name
                            // in the CUDA library, whose prototype the field's type spells
                            // out (cuda_runtime_api.h / cuda.h).
                            Some(unsafe {
                                std::mem::transmute::<*mut c_void, unsafe extern "C" fn($($arg),*) -> $ret>(found)
                            })
                        }
                    }, )*
                }
            }

            /// `(name, address)` of every function found, for entry-point lookups.
            #[allow(dead_code)]
            pub fn addresses(&self) -> Vec<(&'static str, usize)> {
                let mut out = Vec::new();
                $( if let Some(f) = self.$name { out.push((stringify!($name), f as usize)); } )*
                out
            }
        }
    };
}

function_table! {
    /// `libcudart` functions: the hooked ones, and the few the layer calls itself.
    Runtime {
        cudaMalloc: fn(*mut *mut c_void, usize) -> c_int;
        cudaPointerGetAttributes: fn(*mut c_void, *const c_void) -> c_int;
        cudaMallocAsync: fn(*mut *mut c_void, usize, Stream) -> c_int;
        cudaFree: fn(*mut c_void) -> c_int;
        cudaFreeAsync: fn(*mut c_void, Stream) -> c_int;
        cudaMemGetInfo: fn(*mut usize, *mut usize) -> c_int;
        cudaGetDriverEntryPoint: fn(*const c_char, *mut *mut c_void, u64, *mut c_int) -> c_int;
        cudaGetDriverEntryPointByVersion: fn(*const c_char, *mut *mut c_void, c_uint, u64, *mut c_int) -> c_int;
        cudaIpcGetMemHandle: fn(*mut c_void, *mut c_void) -> c_int;
        cudaMemcpy: fn(*mut c_void, *const c_void, usize, c_int) -> c_int;
        cudaMemcpyAsync: fn(*mut c_void, *const c_void, usize, c_int, Stream) -> c_int;
        cudaMemcpy_ptds: fn(*mut c_void, *const c_void, usize, c_int) -> c_int;
        cudaMemcpyAsync_ptsz: fn(*mut c_void, *const c_void, usize, c_int, Stream) -> c_int;
        cudaMallocAsync_ptsz: fn(*mut *mut c_void, usize, Stream) -> c_int;
        cudaFreeAsync_ptsz: fn(*mut c_void, Stream) -> c_int;
        cudaGetDriverEntryPoint_ptsz: fn(*const c_char, *mut *mut c_void, u64, *mut c_int) -> c_int;
        cudaGetDriverEntryPointByVersion_ptsz: fn(*const c_char, *mut *mut c_void, c_uint, u64, *mut c_int) -> c_int;
        // Not hooked: called by the layer.
        cudaGetDevice: fn(*mut c_int) -> c_int;
        cudaSetDevice: fn(c_int) -> c_int;
        cudaStreamIsCapturing: fn(Stream, *mut c_int) -> c_int;
    }
}

function_table! {
    /// `libcuda` functions: the hooked ones, and the few the layer calls itself.
    Driver {
        cuMemAlloc_v2: fn(*mut DevicePtr, usize) -> c_int;
        cuMemGetAddressRange_v2: fn(*mut DevicePtr, *mut usize, DevicePtr) -> c_int;
        cuPointerGetAttribute: fn(*mut c_void, c_int, DevicePtr) -> c_int;
        cuPointerGetAttributes: fn(c_uint, *mut c_int, *mut *mut c_void, DevicePtr) -> c_int;
        cuMemRetainAllocationHandle: fn(*mut u64, *mut c_void) -> c_int;
        cuMemFree_v2: fn(DevicePtr) -> c_int;
        cuMemGetInfo_v2: fn(*mut usize, *mut usize) -> c_int;
        cuGetProcAddress: fn(*const c_char, *mut *mut c_void, c_int, u64) -> c_int;
        cuGetProcAddress_v2: fn(*const c_char, *mut *mut c_void, c_int, u64, *mut c_int) -> c_int;
        // Not hooked: called by the layer.
        cuCtxGetCurrent: fn(*mut *mut c_void) -> c_int;
        cuCtxSetCurrent: fn(*mut c_void) -> c_int;
        cuCtxGetDevice: fn(*mut c_int) -> c_int;
        cuDeviceGet: fn(*mut c_int, c_int) -> c_int;
        cuDevicePrimaryCtxRetain: fn(*mut *mut c_void, c_int) -> c_int;
        cuDevicePrimaryCtxRelease_v2: fn(c_int) -> c_int;
        cuDeviceGetCount: fn(*mut c_int) -> c_int;
        cuDevicePrimaryCtxGetState: fn(c_int, *mut c_uint, *mut c_int) -> c_int;
        cuCtxPushCurrent_v2: fn(*mut c_void) -> c_int;
        cuCtxPopCurrent_v2: fn(*mut *mut c_void) -> c_int;
    }
}

function_table! {
    /// `libnccl` functions: the hooked ones (registration, the end of a communicator).
    Nccl {
        ncclCommRegister: fn(*mut c_void, *mut c_void, usize, *mut *mut c_void) -> c_int;
        ncclCommDeregister: fn(*mut c_void, *mut c_void) -> c_int;
        ncclCommDestroy: fn(*mut c_void) -> c_int;
        ncclCommAbort: fn(*mut c_void) -> c_int;
    }
}

// SAFETY: the tables hold plain function pointers into shared libraries that stay loaded (the
// handles are never closed); calling them from any thread is what the CUDA APIs allow.
unsafe impl Send for Runtime {}
// SAFETY: as above; the tables are never written after they are built.
unsafe impl Sync for Runtime {}
// SAFETY: as for `Runtime`.
unsafe impl Send for Driver {}
// SAFETY: as for `Runtime`.
unsafe impl Sync for Driver {}
// SAFETY: as for `Runtime` (libnccl's handle is never closed either).
unsafe impl Send for Nccl {}
// SAFETY: as for `Runtime`.
unsafe impl Sync for Nccl {}

// The flush points' real functions, from `flush_points.rs` (one name and prototype each).
macro_rules! runtime_flush_points {
    ($( $name:ident($($arg:ident: $ty:ty),* $(,)?); )*) => {
        function_table! {
            /// `libcudart`'s flush points.
            RuntimeFlushPoints { $( $name: fn($($ty),*) -> c_int; )* }
        }
    };
}
macro_rules! driver_flush_points {
    ($( $name:ident($($arg:ident: $ty:ty),* $(,)?); )*) => {
        function_table! {
            /// `libcuda`'s flush points.
            DriverFlushPoints { $( $name: fn($($ty),*) -> c_int; )* }
        }
    };
}
include!("flush_points.rs");

// SAFETY: as for `Runtime`.
unsafe impl Send for RuntimeFlushPoints {}
// SAFETY: as for `Runtime`.
unsafe impl Sync for RuntimeFlushPoints {}
// SAFETY: as for `Runtime`.
unsafe impl Send for DriverFlushPoints {}
// SAFETY: as for `Runtime`.
unsafe impl Sync for DriverFlushPoints {}

static RUNTIME: OnceLock<(Runtime, RuntimeFlushPoints)> = OnceLock::new();
static DRIVER: OnceLock<(Driver, DriverFlushPoints)> = OnceLock::new();
static NCCL: OnceLock<Nccl> = OnceLock::new();

const RUNTIME_NAMES: &[&CStr] = &[c"libcudart.so.13", c"libcudart.so.12", c"libcudart.so"];
const DRIVER_NAMES: &[&CStr] = &[c"libcuda.so.1", c"libcuda.so"];
const NCCL_NAMES: &[&CStr] = &[c"libnccl.so.2", c"libnccl.so"];

fn runtime_tables() -> Option<&'static (Runtime, RuntimeFlushPoints)> {
    if let Some(tables) = RUNTIME.get() {
        return Some(tables);
    }
    let tables = resolve(c"cudaGetDevice", RUNTIME_NAMES, "libcudart", Load::No).map(|lookup| {
        (
            Runtime::resolve(&lookup),
            RuntimeFlushPoints::resolve(&lookup),
        )
    })?;
    let _ = RUNTIME.set(tables);
    RUNTIME.get()
}

fn driver_tables() -> Option<&'static (Driver, DriverFlushPoints)> {
    if let Some(tables) = DRIVER.get() {
        return Some(tables);
    }
    let tables =
        resolve(c"cuDriverGetVersion", DRIVER_NAMES, "libcuda.so", Load::Yes).map(|lookup| {
            (
                Driver::resolve(&lookup),
                DriverFlushPoints::resolve(&lookup),
            )
        })?;
    let _ = DRIVER.set(tables);
    DRIVER.get()
}

/// The runtime's functions, or `None` if no runtime is loaded in this process.
pub fn runtime() -> Option<&'static Runtime> {
    runtime_tables().map(|(functions, _)| functions)
}

/// The runtime's flush points, or `None` if no runtime is loaded in this process.
pub fn runtime_flush_points() -> Option<&'static RuntimeFlushPoints> {
    runtime_tables().map(|(_, flush_points)| flush_points)
}

/// The driver's functions, or `None` if libcuda cannot be loaded.
pub fn driver() -> Option<&'static Driver> {
    driver_tables().map(|(functions, _)| functions)
}

/// The driver's flush points, or `None` if libcuda cannot be loaded.
pub fn driver_flush_points() -> Option<&'static DriverFlushPoints> {
    driver_tables().map(|(_, flush_points)| flush_points)
}

/// libnccl's hooked functions, or `None` if no libnccl is loaded in this process. Never loads
/// one: a caller of these functions holds a communicator, so its libnccl is loaded already
/// (through `RTLD_NEXT` when it is in the global scope, else by its soname or path).
pub fn nccl_functions() -> Option<&'static Nccl> {
    if let Some(table) = NCCL.get() {
        return Some(table);
    }
    let table = resolve(c"ncclCommRegister", NCCL_NAMES, "libnccl", Load::NcclNever)
        .map(|lookup| Nccl::resolve(&lookup))?;
    let _ = NCCL.set(table);
    NCCL.get()
}

/// A handle from `dlopen` (never closed), usable from any thread.
struct Handle(*mut c_void);
// SAFETY: a dlopen handle is a process-wide token; dlsym on it is thread-safe.
unsafe impl Send for Handle {}
// SAFETY: as above.
unsafe impl Sync for Handle {}

/// Whether [`resolve`] may load the library, and which notice it prints when nothing is found.
#[derive(Clone, Copy, PartialEq, Eq)]
enum Load {
    /// The CUDA runtime: only a loaded one.
    No,
    /// The CUDA driver: opened if need be (the runtime would load it anyway).
    Yes,
    /// libnccl: only a loaded one.
    NcclNever,
}

/// How to look names up: through `RTLD_NEXT` when the probe is found there, else through the
/// handle of a loaded copy of the library.
fn resolve(
    probe: &CStr,
    names: &[&CStr],
    path_contains: &str,
    load: Load,
) -> Option<impl Fn(&CStr) -> *mut c_void> {
    let may_load = load == Load::Yes;
    // SAFETY: dlsym with the RTLD_NEXT pseudo-handle and a NUL-terminated name.
    let next = unsafe { libc::dlsym(libc::RTLD_NEXT, probe.as_ptr()) };
    // A handle counts only if the probe is found through it (a path that merely contains the
    // fragment, e.g. an NCCL network plugin, is given back).
    let open_with_probe = |name: &CStr, flags: c_int| {
        open(name, flags).and_then(|handle| {
            // SAFETY: a handle from dlopen and a NUL-terminated name.
            if unsafe { libc::dlsym(handle.0, probe.as_ptr()) }.is_null() {
                // SAFETY: gives back the reference `open` took; the handle is not used again.
                unsafe { libc::dlclose(handle.0) };
                None
            } else {
                Some(handle)
            }
        })
    };
    let handle = if !next.is_null() {
        None
    } else {
        let found = names
            .iter()
            .find_map(|name| open_with_probe(name, libc::RTLD_NOLOAD | libc::RTLD_LAZY))
            .or_else(|| {
                loaded_objects()
                    .iter()
                    .filter(|path| {
                        path.to_bytes()
                            .windows(path_contains.len())
                            .any(|w| w == path_contains.as_bytes())
                    })
                    .find_map(|path| open_with_probe(path, libc::RTLD_NOLOAD | libc::RTLD_LAZY))
            })
            .or_else(|| {
                may_load
                    .then(|| {
                        names
                            .iter()
                            .find_map(|n| open_with_probe(n, libc::RTLD_LAZY | libc::RTLD_LOCAL))
                    })
                    .flatten()
            });
        match found {
            Some(handle) => Some(handle),
            None if load == Load::NcclNever => {
                crate::cuda::notice::notice_once(
                    "nccl",
                    &format!(
                        "stablebuf-preload: an NCCL function was called through the layer but no \
                         {path_contains} was found in this process (tried RTLD_NEXT, {} and \
                         every loaded object); the layer's NCCL hooks answer ncclSystemError. \
                         Set STABLEBUF_PRELOAD_MODE=off if this program loads NCCL in a way \
                         the layer cannot see (dlmopen, a static libnccl).",
                        names
                            .iter()
                            .map(|n| n.to_string_lossy())
                            .collect::<Vec<_>>()
                            .join(", ")
                    ),
                );
                return None;
            }
            None => {
                crate::cuda::notice::notice_once(
                    if may_load { "driver" } else { "runtime" },
                    &format!(
                        "stablebuf-preload: no {path_contains} found in this process (tried \
                         RTLD_NEXT, {} and every loaded object); CUDA calls through the layer \
                         fail with a 'shared object symbol not found' error. Unset LD_PRELOAD or \
                         set STABLEBUF_PRELOAD_MODE=off if this program does not use CUDA.",
                        names
                            .iter()
                            .map(|n| n.to_string_lossy())
                            .collect::<Vec<_>>()
                            .join(", ")
                    ),
                );
                return None;
            }
        }
    };
    Some(move |name: &CStr| match &handle {
        // SAFETY: RTLD_NEXT pseudo-handle, NUL-terminated name.
        None => unsafe { libc::dlsym(libc::RTLD_NEXT, name.as_ptr()) },
        // SAFETY: a handle from dlopen that is never closed; NUL-terminated name.
        Some(handle) => unsafe { libc::dlsym(handle.0, name.as_ptr()) },
    })
}

fn open(name: &CStr, flags: c_int) -> Option<Handle> {
    // SAFETY: dlopen with a NUL-terminated name; with RTLD_NOLOAD it only finds loaded objects.
    let handle = unsafe { libc::dlopen(name.as_ptr(), flags) };
    (!handle.is_null()).then_some(Handle(handle))
}

/// Paths of every object loaded in the process.
fn loaded_objects() -> Vec<CString> {
    unsafe extern "C" fn each(
        info: *mut libc::dl_phdr_info,
        _size: usize,
        data: *mut c_void,
    ) -> c_int {
        // SAFETY: dl_iterate_phdr passes a valid info pointer for the duration of the call, and
        // `data` is the `&mut Vec<CString>` given below.
        unsafe {
            let paths = &mut *data.cast::<Vec<CString>>();
            let name = (*info).dlpi_name;
            if !name.is_null() {
                paths.push(CStr::from_ptr(name).to_owned());
            }
        }
        0
    }
    let mut paths: Vec<CString> = Vec::new();
    // SAFETY: the callback only reads the info it is given and writes to `paths`, which
    // outlives the call.
    unsafe {
        libc::dl_iterate_phdr(Some(each), (&mut paths as *mut Vec<CString>).cast());
    }
    paths
}

/// A loaded object that launches GPU work the layer cannot see (`crate::cuda::unseen`), as its path
/// and the fragment it matched. The scan runs again only when objects were loaded since the
/// last one (`dlpi_adds`), so the check costs one `dl_iterate_phdr` step per copy otherwise.
pub fn unseen_launcher_loaded() -> Option<(String, &'static str)> {
    use std::sync::atomic::{AtomicU64, Ordering};
    static SCANNED_AT: AtomicU64 = AtomicU64::new(u64::MAX);

    unsafe extern "C" fn adds(
        info: *mut libc::dl_phdr_info,
        _size: usize,
        data: *mut c_void,
    ) -> c_int {
        // SAFETY: dl_iterate_phdr passes a valid info for the call; `data` is the `&mut u64`
        // given below. Returning 1 stops after the first object.
        unsafe { *data.cast::<u64>() = (*info).dlpi_adds };
        1
    }
    let mut loaded: u64 = 0;
    // SAFETY: the callback only reads the info and writes the u64, which outlives the call.
    unsafe {
        libc::dl_iterate_phdr(Some(adds), (&mut loaded as *mut u64).cast());
    }
    if SCANNED_AT.swap(loaded, Ordering::SeqCst) == loaded {
        return None;
    }
    loaded_objects().iter().find_map(|path| {
        let path = path.to_string_lossy();
        crate::cuda::unseen::launches_unseen(&path).map(|fragment| (path.into_owned(), fragment))
    })
}

/// Whether `name` names the same function as the pointer `found` (used for entry points).
pub fn driver_function_named(found: usize) -> Option<&'static str> {
    let (functions, flush_points) = driver_tables()?;
    functions
        .addresses()
        .into_iter()
        .chain(flush_points.addresses())
        .find(|&(_, address)| address == found)
        .map(|(name, _)| name)
}

// ---- the calls the layer makes itself -------------------------------------------------------

fn missing(name: &str) -> Fail {
    Fail::Missing(format!("the real {name}"))
}

/// The runtime's current device (`cudaGetDevice`).
pub fn current_device() -> Result<usize, Fail> {
    let get = runtime()
        .and_then(|r| r.cudaGetDevice)
        .ok_or_else(|| missing("cudaGetDevice"))?;
    let mut device: c_int = 0;
    // SAFETY: cudaGetDevice writes one int through a valid pointer.
    let result = unsafe { get(&mut device) };
    if result != cuda::SUCCESS {
        return Err(Fail::Driver {
            result: cu::NOT_INITIALIZED,
            what: format!("cudaGetDevice failed with cudaError {result}"),
        });
    }
    usize::try_from(device).map_err(|_| Fail::Internal(format!("device {device}")))
}

/// The device of the current driver context (`cuCtxGetDevice`): CUDA_ERROR_INVALID_CONTEXT
/// when none is current, as the driver's own allocation would say.
pub fn driver_current_device() -> Result<usize, Fail> {
    let get = driver()
        .and_then(|d| d.cuCtxGetDevice)
        .ok_or_else(|| missing("cuCtxGetDevice"))?;
    let mut device: c_int = 0;
    // SAFETY: cuCtxGetDevice writes one int through a valid pointer.
    let result = unsafe { get(&mut device) };
    if result != cu::SUCCESS {
        return Err(Fail::Driver {
            result,
            what: "cuCtxGetDevice (no current context?)".into(),
        });
    }
    usize::try_from(device).map_err(|_| Fail::Internal(format!("device {device}")))
}

/// The primary context of device `ordinal`, the context the layer's own allocations are made
/// in (cudarc works in primary contexts, and holds a reference to each one it uses, so taking
/// and dropping one more here neither creates nor destroys it). `None` if the driver cannot say.
pub fn primary_context(ordinal: usize) -> Option<*mut c_void> {
    let driver = driver()?;
    let (get, retain, release) = (
        driver.cuDeviceGet?,
        driver.cuDevicePrimaryCtxRetain?,
        driver.cuDevicePrimaryCtxRelease_v2?,
    );
    let mut device: c_int = 0;
    // SAFETY: one valid out-pointer and an ordinal.
    if unsafe { get(&mut device, c_int::try_from(ordinal).ok()?) } != cu::SUCCESS {
        return None;
    }
    let mut context: *mut c_void = std::ptr::null_mut();
    // SAFETY: one valid out-pointer and a device the driver just named.
    if unsafe { retain(&mut context, device) } != cu::SUCCESS {
        return None;
    }
    // SAFETY: drops the reference taken just above.
    if unsafe { release(device) } != cu::SUCCESS {
        // The driver kept our reference: the context stays alive, but an answer we could not
        // take back cleanly is not one to give; the caller keeps the driver's own answer.
        return None;
    }
    (!context.is_null()).then_some(context)
}

/// Whether `stream` is capturing. Unknown (no runtime) reads as capturing: the caller then
/// takes the conservative path.
pub fn stream_is_capturing(stream: u64) -> bool {
    let Some(query) = runtime().and_then(|r| r.cudaStreamIsCapturing) else {
        return true;
    };
    let mut status: c_int = 0;
    // SAFETY: `stream` is the caller's own stream handle, given back to the runtime as is.
    let result = unsafe { query(stream as Stream, &mut status) };
    result != cuda::SUCCESS || status != 0
}

/// Performs a device-to-device copy on `stream` of `device` and waits for that stream.
pub fn copy_and_wait(
    device: usize,
    dst: u64,
    src: u64,
    bytes: usize,
    stream: u64,
) -> Result<(), Fail> {
    let rt = runtime().ok_or_else(|| missing("CUDA runtime"))?;
    let copy = rt
        .cudaMemcpyAsync
        .ok_or_else(|| missing("cudaMemcpyAsync"))?;
    let sync = runtime_flush_points()
        .and_then(|flush_points| flush_points.cudaStreamSynchronize)
        .ok_or_else(|| missing("cudaStreamSynchronize"))?;
    // A per-thread default stream belongs to the thread that made the copy; this may run on
    // another. The legacy stream waits for every blocking stream (per-thread default streams
    // included), so the copy still comes after all the work it could depend on.
    let stream = if stream == STREAM_PER_THREAD {
        STREAM_LEGACY
    } else {
        stream
    };
    with_device(device, || {
        // SAFETY: both ranges are live allocations of the layer on `device` (the engine holds
        // its lock, so neither can be freed meanwhile); the stream is the caller's own.
        let result = unsafe {
            copy(
                dst as *mut c_void,
                src as *const c_void,
                bytes,
                MEMCPY_DEVICE_TO_DEVICE,
                stream as Stream,
            )
        };
        if result != cuda::SUCCESS {
            return Err(Fail::Driver {
                result: cu::UNKNOWN,
                what: format!("cudaMemcpyAsync of a deferred copy failed with cudaError {result}"),
            });
        }
        // SAFETY: the caller's stream handle, as above.
        let result = unsafe { sync(stream as Stream) };
        if result != cuda::SUCCESS {
            return Err(Fail::Driver {
                result: cu::UNKNOWN,
                what: format!(
                    "cudaStreamSynchronize after a deferred copy failed with cudaError {result}"
                ),
            });
        }
        Ok(())
    })
}

/// `ncclCommRegister(comm, buff, size, &handle)` of the real libnccl: the handle, or the
/// `ncclResult_t` it failed with (`ncclSystemError` when no libnccl is found).
pub fn nccl_register(comm: usize, buff: u64, size: usize) -> Result<usize, c_int> {
    let Some(register) = nccl_functions().and_then(|n| n.ncclCommRegister) else {
        return Err(nccl::SYSTEM_ERROR);
    };
    let mut handle: *mut c_void = std::ptr::null_mut();
    // SAFETY: `comm` is the communicator a caller of ncclCommRegister passed to the layer (not
    // destroyed since: the layer drops its records at ncclCommDestroy/ncclCommAbort), and
    // the out-pointer is a local.
    let result = unsafe { register(comm as *mut c_void, buff as *mut c_void, size, &mut handle) };
    if result == nccl::SUCCESS {
        Ok(handle as usize)
    } else {
        Err(result)
    }
}

/// `ncclCommDeregister(comm, handle)` of the real libnccl (`ncclSystemError` when no libnccl
/// is found).
pub fn nccl_deregister(comm: usize, handle: usize) -> c_int {
    let Some(deregister) = nccl_functions().and_then(|n| n.ncclCommDeregister) else {
        return nccl::SYSTEM_ERROR;
    };
    // SAFETY: a live communicator (as above) and a handle its ncclCommRegister returned.
    unsafe { deregister(comm as *mut c_void, handle as *mut c_void) }
}

/// Waits for all work of every device whose primary context is active (no context is made
/// for a device nobody used). Returns the devices waited for. Used before NCCL registrations
/// are dropped: a collective still running on any device may read a peer's registered buffer.
pub fn synchronize_active_devices() -> Result<Vec<usize>, Fail> {
    let driver = driver().ok_or(Fail::NoDriver)?;
    let (Some(count), Some(get), Some(state), Some(retain), Some(release), Some(push), Some(pop)) = (
        driver.cuDeviceGetCount,
        driver.cuDeviceGet,
        driver.cuDevicePrimaryCtxGetState,
        driver.cuDevicePrimaryCtxRetain,
        driver.cuDevicePrimaryCtxRelease_v2,
        driver.cuCtxPushCurrent_v2,
        driver.cuCtxPopCurrent_v2,
    ) else {
        return Err(missing(
            "cuDeviceGetCount/cuDevicePrimaryCtx*/cuCtxPush/PopCurrent",
        ));
    };
    let synchronize = driver_flush_points()
        .and_then(|f| f.cuCtxSynchronize)
        .ok_or_else(|| missing("cuCtxSynchronize"))?;
    let failed = |call: &str, result: c_int| Fail::Driver {
        result,
        what: format!("{call} while waiting for the devices before an NCCL deregistration"),
    };
    let mut devices: c_int = 0;
    // SAFETY: one valid out-pointer.
    let result = unsafe { count(&mut devices) };
    if result != cu::SUCCESS {
        return Err(failed("cuDeviceGetCount", result));
    }
    let mut waited = Vec::new();
    for ordinal in 0..devices {
        let mut device: c_int = 0;
        // SAFETY: one valid out-pointer and an ordinal below the count.
        if unsafe { get(&mut device, ordinal) } != cu::SUCCESS {
            continue;
        }
        let (mut flags, mut active): (c_uint, c_int) = (0, 0);
        // SAFETY: two valid out-pointers and a device the driver just named.
        if unsafe { state(device, &mut flags, &mut active) } != cu::SUCCESS || active == 0 {
            continue;
        }
        let mut context: *mut c_void = std::ptr::null_mut();
        // SAFETY: as above; the primary context is active, so this only takes a reference.
        let result = unsafe { retain(&mut context, device) };
        if result != cu::SUCCESS {
            return Err(failed("cuDevicePrimaryCtxRetain", result));
        }
        // SAFETY: the context just retained; pushed and popped on this thread.
        let result = unsafe { push(context) };
        let waited_for = if result == cu::SUCCESS {
            // SAFETY: the pushed context is current.
            let result = unsafe { synchronize() };
            let mut popped: *mut c_void = std::ptr::null_mut();
            // SAFETY: pops what was pushed above.
            unsafe { pop(&mut popped) };
            result
        } else {
            result
        };
        // SAFETY: drops the reference taken above.
        unsafe { release(device) };
        if waited_for != cu::SUCCESS {
            return Err(failed("cuCtxSynchronize", waited_for));
        }
        waited.push(ordinal as usize);
    }
    Ok(waited)
}

/// Runs `f` with `device` as the runtime's current device, then puts the old one back.
fn with_device<T>(device: usize, f: impl FnOnce() -> Result<T, Fail>) -> Result<T, Fail> {
    let current = current_device()?;
    if current == device {
        return f();
    }
    let set = runtime()
        .and_then(|r| r.cudaSetDevice)
        .ok_or_else(|| missing("cudaSetDevice"))?;
    // SAFETY: plain integer argument.
    let result = unsafe { set(device as c_int) };
    if result != cuda::SUCCESS {
        return Err(Fail::InvalidValue(format!(
            "cudaSetDevice({device}): {result}"
        )));
    }
    let out = f();
    // SAFETY: plain integer argument.
    unsafe { set(current as c_int) };
    out
}

/// Puts the thread's current driver context back when dropped. The layer's own driver calls
/// (through cudarc) make the primary context of the device they work on current; a program
/// with a context of its own must find it still current afterwards.
pub struct ContextGuard {
    saved: Option<*mut c_void>,
}

impl ContextGuard {
    /// Remembers the current context. With none current, nothing is put back: the layer's
    /// work leaves the device's primary context current, as the runtime's own first call would.
    pub fn save() -> Self {
        let saved = driver().and_then(|d| d.cuCtxGetCurrent).and_then(|get| {
            let mut ctx: *mut c_void = std::ptr::null_mut();
            // SAFETY: one valid out-pointer.
            (unsafe { get(&mut ctx) } == cu::SUCCESS).then_some(ctx)
        });
        Self {
            saved: saved.filter(|ctx| !ctx.is_null()),
        }
    }
}

impl Drop for ContextGuard {
    fn drop(&mut self) {
        let Some(saved) = self.saved else {
            return;
        };
        let Some(driver) = driver() else {
            return;
        };
        let (Some(get), Some(set)) = (driver.cuCtxGetCurrent, driver.cuCtxSetCurrent) else {
            return;
        };
        let mut now: *mut c_void = std::ptr::null_mut();
        // SAFETY: one valid out-pointer.
        let read = unsafe { get(&mut now) };
        if read != cu::SUCCESS || now != saved {
            // SAFETY: `saved` was current on this thread when the guard was made.
            unsafe { set(saved) };
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn without_cuda_nothing_is_found_and_nothing_breaks() {
        // The test machine has no CUDA: every lookup path is tried and fails cleanly.
        if runtime().is_some() {
            return; // a machine with CUDA: nothing to check here
        }
        assert!(matches!(current_device(), Err(Fail::Missing(_))));
        assert!(
            stream_is_capturing(0),
            "unknown reads as capturing (conservative)"
        );
        assert!(copy_and_wait(0, 1, 2, 3, 0).is_err());
        drop(ContextGuard::save());
    }

    #[test]
    fn loaded_objects_include_libc() {
        let objects = loaded_objects();
        assert!(
            objects
                .iter()
                .any(|p| p.to_string_lossy().contains("libc.so")),
            "{objects:?}"
        );
    }

    #[test]
    fn tables_list_what_they_found() {
        let lookup = |name: &CStr| {
            if name == c"cudaMalloc" {
                std::ptr::dangling_mut::<c_void>()
            } else {
                std::ptr::null_mut()
            }
        };
        let table = Runtime::resolve(&lookup);
        assert!(table.cudaMalloc.is_some() && table.cudaFree.is_none());
        assert_eq!(
            table.addresses(),
            vec![("cudaMalloc", std::ptr::dangling_mut::<c_void>() as usize)]
        );
    }
}
