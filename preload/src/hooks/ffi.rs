//! The exported C ABI: the hooked CUDA functions and the `stablebuf_*` functions of
//! `include/stablebuf_preload.h`. With `real.rs`, the only `unsafe` of the crate.
//!
//! Every exported function catches panics and answers with an error code: a failure inside
//! the layer never unwinds into, or aborts, the host program. Every hook passes straight
//! through when the layer is off, in a child after `fork`, or when it is called from inside
//! the layer itself (a thread-local guard). Names exported must be listed in `symbols.rs`
//! (the linker's version script hides everything else; a test checks both ways).

#![allow(non_snake_case)]
#![allow(clippy::missing_safety_doc)]

use std::ffi::{c_char, c_int, c_uint, c_void, CStr, CString};
use std::panic::{catch_unwind, AssertUnwindSafe};
use std::sync::OnceLock;

use crate::cuda::codes::{abi, cu, cuda, nccl, Fail};
use crate::cuda::entry;
use crate::cuda::notice;
use crate::cuda::real::{self, DevicePtr, Dim3, Event, Extent, PitchedPtr, Stream};
use crate::engine::nccl::is_proxy;
use crate::engine::query::{self, Allocation, Answer};
use crate::engine::stats::{bytes_to_write, Counters, StablebufStats};
use crate::engine::tags;
use crate::engine::{Copied, CopyCall, Freed};
use crate::hooks::env::{self, Mode, NcclRegister};
use crate::hooks::layer::{self, Api, Inside, Route};

// ---- helpers ----------------------------------------------------------------------------

/// Runs a hook body, turning a panic into `on_panic` (and a log line).
fn guarded(call: &'static str, on_panic: c_int, body: impl FnOnce() -> c_int) -> c_int {
    match catch_unwind(AssertUnwindSafe(body)) {
        Ok(code) => code,
        Err(_) => {
            notice::notice_once(
                "panic",
                &format!(
                    "stablebuf-preload: internal error in {call} (caught; returning {on_panic})"
                ),
            );
            on_panic
        }
    }
}

fn missing(api: Api, name: &'static str) -> c_int {
    tracing::warn!(function = name, "the real function was not found");
    match api {
        Api::Runtime => cuda::SHARED_OBJECT_SYMBOL_NOT_FOUND,
        Api::Driver => cu::SHARED_OBJECT_SYMBOL_NOT_FOUND,
    }
}

/// The real runtime function `$name`, or return the "not found" code from the hook.
macro_rules! real_runtime {
    ($name:ident) => {
        match real::runtime().and_then(|table| table.$name) {
            Some(function) => function,
            None => return missing(Api::Runtime, stringify!($name)),
        }
    };
}

macro_rules! real_runtime_flush {
    ($name:ident) => {
        match real::runtime_flush_points().and_then(|table| table.$name) {
            Some(function) => function,
            None => return missing(Api::Runtime, stringify!($name)),
        }
    };
}

macro_rules! real_driver_flush {
    ($name:ident) => {
        match real::driver_flush_points().and_then(|table| table.$name) {
            Some(function) => function,
            None => return missing(Api::Driver, stringify!($name)),
        }
    };
}

macro_rules! real_driver {
    ($name:ident) => {
        match real::driver().and_then(|table| table.$name) {
            Some(function) => function,
            None => return missing(Api::Driver, stringify!($name)),
        }
    };
}

/// Performs deferred copies before a call that may touch any memory (copy elision only).
fn flush_point(call: &'static str) {
    if !layer::eliding() {
        return;
    }
    let Some(_inside) = Inside::enter() else {
        return;
    };
    if let Route::Vmm(layer, _) = layer::route() {
        layer.flush_point(call);
    }
}

// ---- runtime: memory --------------------------------------------------------------------

/// `cudaMalloc`: vmm serves it from the pool (or this thread's tag's region); monitor logs it.
#[no_mangle]
pub unsafe extern "C" fn cudaMalloc(ptr: *mut *mut c_void, size: usize) -> c_int {
    guarded("cudaMalloc", cuda::UNKNOWN, || {
        runtime_alloc(
            "cudaMalloc",
            ptr,
            size,
            |p, s| {
                let real = real_runtime!(cudaMalloc);
                // SAFETY: the caller's arguments, passed on unchanged.
                unsafe { real(p, s) }
            },
            None,
        )
    })
}

/// `cudaMallocAsync`: as `cudaMalloc` (the pool's memory is ready at once), except on a
/// capturing stream, where the runtime makes a graph memory node: passed through.
#[no_mangle]
pub unsafe extern "C" fn cudaMallocAsync(
    ptr: *mut *mut c_void,
    size: usize,
    stream: Stream,
) -> c_int {
    guarded("cudaMallocAsync", cuda::UNKNOWN, || {
        runtime_alloc(
            "cudaMallocAsync",
            ptr,
            size,
            |p, s| {
                let real = real_runtime!(cudaMallocAsync);
                // SAFETY: the caller's arguments, passed on unchanged.
                unsafe { real(p, s, stream) }
            },
            Some(stream as u64),
        )
    })
}

fn runtime_alloc(
    call: &'static str,
    ptr: *mut *mut c_void,
    size: usize,
    real: impl FnOnce(*mut *mut c_void, usize) -> c_int,
    stream: Option<u64>,
) -> c_int {
    let Some(_inside) = Inside::enter() else {
        return real(ptr, size);
    };
    match layer::route() {
        Route::Pass => real(ptr, size),
        Route::Monitor(layer) => {
            let code = real(ptr, size);
            if code == cuda::SUCCESS && !ptr.is_null() {
                // SAFETY: the runtime just wrote the pointer through `ptr`.
                let address = unsafe { *ptr } as u64;
                layer.monitor_alloc(Api::Runtime, call, address, size);
            }
            code
        }
        Route::Vmm(layer, engine) => {
            if ptr.is_null() {
                return cuda::INVALID_VALUE;
            }
            if stream.is_some_and(real::stream_is_capturing) {
                return real(ptr, size);
            }
            match layer.vmm_alloc(engine, Api::Runtime, call, size) {
                Ok(address) => {
                    // SAFETY: `ptr` is the caller's non-NULL out-pointer.
                    unsafe { *ptr = address as *mut c_void };
                    cuda::SUCCESS
                }
                Err(fail) => fail.runtime_code(),
            }
        }
    }
}

/// `cudaFree`: the layer's pointers are freed by the layer, all others by CUDA.
#[no_mangle]
pub unsafe extern "C" fn cudaFree(ptr: *mut c_void) -> c_int {
    guarded("cudaFree", cuda::UNKNOWN, || {
        runtime_free("cudaFree", ptr, None, || {
            let real = real_runtime!(cudaFree);
            // SAFETY: the caller's argument, passed on unchanged.
            unsafe { real(ptr) }
        })
    })
}

/// `cudaFreeAsync`: as `cudaFree`; the layer's free waits for the device first, which orders
/// it after the stream's work. Refused on a capturing stream for the layer's pointers.
#[no_mangle]
pub unsafe extern "C" fn cudaFreeAsync(ptr: *mut c_void, stream: Stream) -> c_int {
    guarded("cudaFreeAsync", cuda::UNKNOWN, || {
        runtime_free("cudaFreeAsync", ptr, Some(stream as u64), || {
            let real = real_runtime!(cudaFreeAsync);
            // SAFETY: the caller's arguments, passed on unchanged.
            unsafe { real(ptr, stream) }
        })
    })
}

fn runtime_free(
    call: &'static str,
    ptr: *mut c_void,
    stream: Option<u64>,
    real: impl FnOnce() -> c_int,
) -> c_int {
    if ptr.is_null() {
        return real();
    }
    let Some(_inside) = Inside::enter() else {
        return real();
    };
    match layer::route() {
        Route::Pass => real(),
        Route::Monitor(layer) => {
            let code = real();
            if code == cuda::SUCCESS {
                layer.monitor_free(call, ptr as u64);
            }
            code
        }
        Route::Vmm(layer, engine) => {
            if let Some(stream) = stream {
                if layer.owns(ptr as u64) && real::stream_is_capturing(stream) {
                    tracing::warn!(
                        call,
                        address = ptr as u64,
                        "the layer cannot free its memory inside a stream capture"
                    );
                    return cuda::STREAM_CAPTURE_UNSUPPORTED;
                }
            }
            match layer.vmm_free(engine, call, ptr as u64) {
                Ok(Freed::Done) => cuda::SUCCESS,
                Ok(Freed::NotOwned) => real(),
                Err(fail) => fail.runtime_code(),
            }
        }
    }
}

/// `cudaMemGetInfo`: in vmm mode free memory counts what the pool holds cached (it is free
/// for this program's allocations). Either output may be NULL.
#[no_mangle]
pub unsafe extern "C" fn cudaMemGetInfo(free: *mut usize, total: *mut usize) -> c_int {
    guarded("cudaMemGetInfo", cuda::UNKNOWN, || {
        let real = real_runtime!(cudaMemGetInfo);
        memory_info(Api::Runtime, free, total, |f, t| {
            // SAFETY: our own locals as out-pointers, or the caller's, passed on unchanged.
            unsafe { real(f, t) }
        })
    })
}

fn memory_info(
    api: Api,
    free: *mut usize,
    total: *mut usize,
    real: impl Fn(*mut usize, *mut usize) -> c_int,
) -> c_int {
    let Some(_inside) = Inside::enter() else {
        return real(free, total);
    };
    let layer = match layer::route() {
        Route::Pass => return real(free, total),
        Route::Monitor(layer) | Route::Vmm(layer, _) => layer,
    };
    let (mut f, mut t) = (0usize, 0usize);
    let code = real(&mut f, &mut t);
    if code != cuda::SUCCESS {
        return code;
    }
    let f = layer.pool_view_of_free(f, api);
    // SAFETY: each output is written only if the caller passed one.
    unsafe {
        if !free.is_null() {
            *free = f;
        }
        if !total.is_null() {
            *total = t;
        }
    }
    cuda::SUCCESS
}

/// `cudaIpcGetMemHandle`: legacy IPC cannot export VMM memory; for the layer's pointers this
/// is a clear error (and a line naming the variable that turns the layer off).
#[no_mangle]
pub unsafe extern "C" fn cudaIpcGetMemHandle(handle: *mut c_void, ptr: *mut c_void) -> c_int {
    guarded("cudaIpcGetMemHandle", cuda::UNKNOWN, || {
        let real = real_runtime!(cudaIpcGetMemHandle);
        if let Some(_inside) = Inside::enter() {
            if let Route::Vmm(layer, _) = layer::route() {
                if layer.owns(ptr as u64) {
                    Counters::bump(&layer.counters.ipc_refusals);
                    notice::notice_once(
                        "ipc",
                        &format!(
                            "stablebuf-preload: cudaIpcGetMemHandle({:#x}) refused with \
                             cudaErrorInvalidValue: the pointer is VMM memory from the layer's \
                             pool, which legacy CUDA IPC cannot export. Run this program with \
                             STABLEBUF_PRELOAD_MODE=off (or without LD_PRELOAD) if it shares \
                             memory through cudaIpc*.",
                            ptr as u64
                        ),
                    );
                    return cuda::INVALID_VALUE;
                }
            }
        }
        // SAFETY: the caller's arguments, passed on unchanged.
        unsafe { real(handle, ptr) }
    })
}

// ---- pointer queries ---------------------------------------------------------------------

/// The layer's allocation that `address` lies in, made ready for a query (mapped, deferred
/// copies performed): vmm only. `Ok(None)` for anyone else's pointer, in another mode, and for
/// calls the layer makes itself.
fn settled(call: &'static str, address: u64) -> Result<Option<Allocation>, Fail> {
    let Some(_inside) = Inside::enter() else {
        return Ok(None);
    };
    let Route::Vmm(layer, engine) = layer::route() else {
        return Ok(None);
    };
    layer.settle(engine, call, address)
}

/// `cuMemGetAddressRange`: for the layer's memory, the whole allocation (start, size asked
/// for), however many mappings serve it; for any other pointer the driver's answer.
#[no_mangle]
pub unsafe extern "C" fn cuMemGetAddressRange_v2(
    base: *mut DevicePtr,
    size: *mut usize,
    ptr: DevicePtr,
) -> c_int {
    guarded("cuMemGetAddressRange_v2", cu::UNKNOWN, || {
        let real = real_driver!(cuMemGetAddressRange_v2);
        match settled("cuMemGetAddressRange_v2", ptr) {
            Ok(Some(allocation)) => {
                // SAFETY: the caller's out-pointers, each NULL (not wanted, as cuda.h allows)
                // or pointing at a CUdeviceptr / size_t.
                unsafe {
                    if !base.is_null() {
                        *base = allocation.start;
                    }
                    if !size.is_null() {
                        *size = allocation.bytes;
                    }
                }
                cu::SUCCESS
            }
            // SAFETY: the caller's arguments, passed on unchanged.
            Ok(None) => unsafe { real(base, size, ptr) },
            Err(fail) => fail.driver_code(),
        }
    })
}

/// One attribute of a pointer into the layer's memory ([`query::answer`]), written to `data`.
///
/// # Safety
/// `data` is NULL or points at storage for `attribute`'s value, as `cuPointerGetAttribute`
/// requires.
unsafe fn answer_attribute(
    real: unsafe extern "C" fn(*mut c_void, c_int, DevicePtr) -> c_int,
    data: *mut c_void,
    attribute: c_int,
    ptr: DevicePtr,
    allocation: &Allocation,
) -> c_int {
    match query::answer(attribute, allocation) {
        Answer::Value(value) => {
            if data.is_null() {
                return cu::INVALID_VALUE;
            }
            // SAFETY: every attribute answered with a value is a CUdeviceptr, size_t or
            // pointer: 8 bytes on the 64-bit platforms the layer builds for. The caller's
            // storage need not be aligned.
            unsafe { (data as *mut u64).write_unaligned(value) };
            cu::SUCCESS
        }
        // SAFETY: the caller's storage, and an address inside the same allocation.
        Answer::AskAt(start) => unsafe { real(data, attribute, start) },
        // SAFETY: the caller's arguments, passed on unchanged.
        Answer::PassThrough => unsafe { real(data, attribute, ptr) },
        Answer::ContextOf { device } => {
            // SAFETY: the caller's arguments, passed on unchanged.
            let code = unsafe { real(data, attribute, ptr) };
            if code != cu::SUCCESS || data.is_null() {
                return code;
            }
            // SAFETY: CONTEXT's value is a CUcontext, one pointer, just written by the driver.
            let named = unsafe { (data as *mut *mut c_void).read_unaligned() };
            if named.is_null() {
                if let Some(context) = real::primary_context(device) {
                    // SAFETY: as above: the caller's storage for one CUcontext.
                    unsafe { (data as *mut *mut c_void).write_unaligned(context) };
                }
            }
            code
        }
    }
}

/// `cuPointerGetAttribute`: the range attributes of the layer's memory describe the whole
/// allocation, its identifiers are the same for every pointer into it (see [`query`]).
#[no_mangle]
pub unsafe extern "C" fn cuPointerGetAttribute(
    data: *mut c_void,
    attribute: c_int,
    ptr: DevicePtr,
) -> c_int {
    guarded("cuPointerGetAttribute", cu::UNKNOWN, || {
        let real = real_driver!(cuPointerGetAttribute);
        match settled("cuPointerGetAttribute", ptr) {
            // SAFETY: the caller's arguments.
            Ok(Some(allocation)) => unsafe {
                answer_attribute(real, data, attribute, ptr, &allocation)
            },
            // SAFETY: the caller's arguments, passed on unchanged.
            Ok(None) => unsafe { real(data, attribute, ptr) },
            Err(fail) => fail.driver_code(),
        }
    })
}

/// `cuPointerGetAttributes`: each attribute as [`cuPointerGetAttribute`] answers it. CUDA
/// answers every attribute of a pointer it does not know with a neutral value instead of
/// failing; for the layer's memory the driver knows the pointer, so each one succeeds or the
/// call fails as a whole, as it would.
#[no_mangle]
pub unsafe extern "C" fn cuPointerGetAttributes(
    count: c_uint,
    attributes: *mut c_int,
    data: *mut *mut c_void,
    ptr: DevicePtr,
) -> c_int {
    guarded("cuPointerGetAttributes", cu::UNKNOWN, || {
        let real = real_driver!(cuPointerGetAttributes);
        let allocation = match settled("cuPointerGetAttributes", ptr) {
            Ok(Some(allocation)) => allocation,
            // SAFETY: the caller's arguments, passed on unchanged.
            Ok(None) => return unsafe { real(count, attributes, data, ptr) },
            Err(fail) => return fail.driver_code(),
        };
        let single = real_driver!(cuPointerGetAttribute);
        if count > 0 && (attributes.is_null() || data.is_null()) {
            return cu::INVALID_VALUE;
        }
        for i in 0..count as usize {
            // SAFETY: `attributes` and `data` hold `count` entries each (cuda.h).
            let (attribute, slot) = unsafe { (*attributes.add(i), *data.add(i)) };
            // SAFETY: the caller's storage for this attribute.
            let code = unsafe { answer_attribute(single, slot, attribute, ptr, &allocation) };
            if code != cu::SUCCESS {
                return code;
            }
        }
        cu::SUCCESS
    })
}

/// `cuMemRetainAllocationHandle`: refused for the layer's memory with CUDA's answer for
/// `cudaMalloc` memory ([`query::RETAIN_REFUSED`] says why, once on stderr).
#[no_mangle]
pub unsafe extern "C" fn cuMemRetainAllocationHandle(handle: *mut u64, addr: *mut c_void) -> c_int {
    guarded("cuMemRetainAllocationHandle", cu::UNKNOWN, || {
        let real = real_driver!(cuMemRetainAllocationHandle);
        match settled("cuMemRetainAllocationHandle", addr as u64) {
            Ok(Some(allocation)) => {
                notice::notice_once(
                    "retain",
                    &format!(
                        "stablebuf-preload: cuMemRetainAllocationHandle({:#x}) refused with \
                         CUDA_ERROR_INVALID_VALUE: {} (allocation at {:#x}, {} bytes)",
                        addr as u64,
                        query::RETAIN_REFUSED,
                        allocation.start,
                        allocation.bytes
                    ),
                );
                cu::INVALID_VALUE
            }
            // SAFETY: the caller's arguments, passed on unchanged.
            Ok(None) => unsafe { real(handle, addr) },
            Err(fail) => fail.driver_code(),
        }
    })
}

/// `cudaPointerGetAttributes`: the layer's memory is made ready first (a held allocation is
/// mapped), so the runtime, which asks the driver itself, describes device memory.
#[no_mangle]
pub unsafe extern "C" fn cudaPointerGetAttributes(
    attributes: *mut c_void,
    ptr: *const c_void,
) -> c_int {
    guarded("cudaPointerGetAttributes", cuda::UNKNOWN, || {
        let real = real_runtime!(cudaPointerGetAttributes);
        if let Err(fail) = settled("cudaPointerGetAttributes", ptr as u64) {
            return fail.runtime_code();
        }
        // SAFETY: the caller's arguments, passed on unchanged.
        unsafe { real(attributes, ptr) }
    })
}

// ---- runtime: copies (copy elision) -----------------------------------------------------

fn elided_copy(call: CopyCall, name: &'static str) -> bool {
    if !layer::eliding() {
        return false;
    }
    let Some(_inside) = Inside::enter() else {
        return false;
    };
    let Route::Vmm(layer, engine) = layer::route() else {
        return false;
    };
    match layer.copy(engine, call) {
        Ok(Copied::Deferred) => true,
        Ok(Copied::PassThrough) => false,
        Err(fail) => {
            tracing::error!(call = name, %fail, "performing deferred copies failed");
            false
        }
    }
}

fn device_to_device(kind: c_int) -> bool {
    kind == real::MEMCPY_DEVICE_TO_DEVICE || kind == real::MEMCPY_DEFAULT
}

/// The one `CopyCall` of the runtime's copy hooks (`cudaMemcpy`, `cudaMemcpyAsync` and their
/// per-thread-stream forms), handed to copy elision: true when the copy was deferred (the
/// hook returns success without calling the runtime).
fn elided_runtime_copy(
    hook: &'static str,
    dst: *mut c_void,
    src: *const c_void,
    count: usize,
    kind: c_int,
    stream: u64,
    sync: bool,
) -> bool {
    let call = CopyCall {
        dst: dst as u64,
        src: src as u64,
        bytes: count,
        device_to_device: device_to_device(kind),
        stream,
        sync,
    };
    elided_copy(call, hook)
}

/// `cudaMemcpy`: with copy elision, a deferrable device-to-device copy returns at once (as a
/// device-to-device `cudaMemcpy` may); every other copy first performs deferred ones.
#[no_mangle]
pub unsafe extern "C" fn cudaMemcpy(
    dst: *mut c_void,
    src: *const c_void,
    count: usize,
    kind: c_int,
) -> c_int {
    guarded("cudaMemcpy", cuda::UNKNOWN, || {
        let real = real_runtime!(cudaMemcpy);
        if elided_runtime_copy("cudaMemcpy", dst, src, count, kind, 0, true) {
            return cuda::SUCCESS;
        }
        // SAFETY: the caller's arguments, passed on unchanged.
        unsafe { real(dst, src, count, kind) }
    })
}

#[no_mangle]
pub unsafe extern "C" fn cudaMemcpyAsync(
    dst: *mut c_void,
    src: *const c_void,
    count: usize,
    kind: c_int,
    stream: Stream,
) -> c_int {
    guarded("cudaMemcpyAsync", cuda::UNKNOWN, || {
        let real = real_runtime!(cudaMemcpyAsync);
        if elided_runtime_copy(
            "cudaMemcpyAsync",
            dst,
            src,
            count,
            kind,
            stream as u64,
            false,
        ) {
            return cuda::SUCCESS;
        }
        // SAFETY: the caller's arguments, passed on unchanged.
        unsafe { real(dst, src, count, kind, stream) }
    })
}

/// The stream a per-thread-default-stream call (`_ptsz`, `_ptds`) means: handle 0 there is the
/// calling thread's default stream (`cudaStreamPerThread`), not the legacy one.
fn per_thread_stream(stream: Stream) -> u64 {
    if stream.is_null() {
        real::STREAM_PER_THREAD
    } else {
        stream as u64
    }
}

/// `cudaMemcpy` of a program built with `--default-stream per-thread`.
#[no_mangle]
pub unsafe extern "C" fn cudaMemcpy_ptds(
    dst: *mut c_void,
    src: *const c_void,
    count: usize,
    kind: c_int,
) -> c_int {
    guarded("cudaMemcpy_ptds", cuda::UNKNOWN, || {
        let real = real_runtime!(cudaMemcpy_ptds);
        if elided_runtime_copy(
            "cudaMemcpy_ptds",
            dst,
            src,
            count,
            kind,
            real::STREAM_PER_THREAD,
            true,
        ) {
            return cuda::SUCCESS;
        }
        // SAFETY: the caller's arguments, passed on unchanged.
        unsafe { real(dst, src, count, kind) }
    })
}

/// `cudaMemcpyAsync` of a program built with `--default-stream per-thread`.
#[no_mangle]
pub unsafe extern "C" fn cudaMemcpyAsync_ptsz(
    dst: *mut c_void,
    src: *const c_void,
    count: usize,
    kind: c_int,
    stream: Stream,
) -> c_int {
    guarded("cudaMemcpyAsync_ptsz", cuda::UNKNOWN, || {
        let real = real_runtime!(cudaMemcpyAsync_ptsz);
        if elided_runtime_copy(
            "cudaMemcpyAsync_ptsz",
            dst,
            src,
            count,
            kind,
            per_thread_stream(stream),
            false,
        ) {
            return cuda::SUCCESS;
        }
        // SAFETY: the caller's arguments, passed on unchanged.
        unsafe { real(dst, src, count, kind, stream) }
    })
}

/// `cudaMallocAsync` of a program built with `--default-stream per-thread`.
#[no_mangle]
pub unsafe extern "C" fn cudaMallocAsync_ptsz(
    ptr: *mut *mut c_void,
    size: usize,
    stream: Stream,
) -> c_int {
    guarded("cudaMallocAsync_ptsz", cuda::UNKNOWN, || {
        runtime_alloc(
            "cudaMallocAsync_ptsz",
            ptr,
            size,
            |p, s| {
                let real = real_runtime!(cudaMallocAsync_ptsz);
                // SAFETY: the caller's arguments, passed on unchanged.
                unsafe { real(p, s, stream) }
            },
            Some(per_thread_stream(stream)),
        )
    })
}

/// `cudaFreeAsync` of a program built with `--default-stream per-thread`.
#[no_mangle]
pub unsafe extern "C" fn cudaFreeAsync_ptsz(ptr: *mut c_void, stream: Stream) -> c_int {
    guarded("cudaFreeAsync_ptsz", cuda::UNKNOWN, || {
        runtime_free(
            "cudaFreeAsync_ptsz",
            ptr,
            Some(per_thread_stream(stream)),
            || {
                let real = real_runtime!(cudaFreeAsync_ptsz);
                // SAFETY: the caller's arguments, passed on unchanged.
                unsafe { real(ptr, stream) }
            },
        )
    })
}

// ---- runtime: entry points --------------------------------------------------------------

#[no_mangle]
pub unsafe extern "C" fn cudaGetDriverEntryPoint(
    symbol: *const c_char,
    func: *mut *mut c_void,
    flags: u64,
    status: *mut c_int,
) -> c_int {
    guarded("cudaGetDriverEntryPoint", cuda::UNKNOWN, || {
        let real = real_runtime!(cudaGetDriverEntryPoint);
        // A lookup made from inside the layer, or by CUDA inside an outer lookup, passes
        // through untouched: the outermost one substitutes.
        let inside = Inside::enter();
        // SAFETY: the caller's arguments, passed on unchanged.
        let code = unsafe { real(symbol, func, flags, status) };
        if code == cuda::SUCCESS && inside.is_some() {
            // SAFETY: checked for NULL inside; `symbol` is the caller's C string.
            unsafe { substitute_entry(symbol, func, i32::MAX, flags) };
        }
        code
    })
}

#[no_mangle]
pub unsafe extern "C" fn cudaGetDriverEntryPointByVersion(
    symbol: *const c_char,
    func: *mut *mut c_void,
    version: c_uint,
    flags: u64,
    status: *mut c_int,
) -> c_int {
    guarded("cudaGetDriverEntryPointByVersion", cuda::UNKNOWN, || {
        let real = real_runtime!(cudaGetDriverEntryPointByVersion);
        // A lookup made from inside the layer, or by CUDA inside an outer lookup, passes
        // through untouched: the outermost one substitutes.
        let inside = Inside::enter();
        // SAFETY: the caller's arguments, passed on unchanged.
        let code = unsafe { real(symbol, func, version, flags, status) };
        if code == cuda::SUCCESS && inside.is_some() {
            let version = i32::try_from(version).unwrap_or(i32::MAX);
            // SAFETY: checked for NULL inside; `symbol` is the caller's C string.
            unsafe { substitute_entry(symbol, func, version, flags) };
        }
        code
    })
}

#[no_mangle]
pub unsafe extern "C" fn cudaGetDriverEntryPoint_ptsz(
    symbol: *const c_char,
    func: *mut *mut c_void,
    flags: u64,
    status: *mut c_int,
) -> c_int {
    guarded("cudaGetDriverEntryPoint_ptsz", cuda::UNKNOWN, || {
        let real = real_runtime!(cudaGetDriverEntryPoint_ptsz);
        let inside = Inside::enter();
        // SAFETY: the caller's arguments, passed on unchanged.
        let code = unsafe { real(symbol, func, flags, status) };
        if code == cuda::SUCCESS && inside.is_some() {
            // SAFETY: checked for NULL inside; `symbol` is the caller's C string.
            unsafe {
                substitute_entry(
                    symbol,
                    func,
                    i32::MAX,
                    flags | entry::PER_THREAD_DEFAULT_STREAM,
                )
            };
        }
        code
    })
}

#[no_mangle]
pub unsafe extern "C" fn cudaGetDriverEntryPointByVersion_ptsz(
    symbol: *const c_char,
    func: *mut *mut c_void,
    version: c_uint,
    flags: u64,
    status: *mut c_int,
) -> c_int {
    guarded(
        "cudaGetDriverEntryPointByVersion_ptsz",
        cuda::UNKNOWN,
        || {
            let real = real_runtime!(cudaGetDriverEntryPointByVersion_ptsz);
            let inside = Inside::enter();
            // SAFETY: the caller's arguments, passed on unchanged.
            let code = unsafe { real(symbol, func, version, flags, status) };
            if code == cuda::SUCCESS && inside.is_some() {
                let version = i32::try_from(version).unwrap_or(i32::MAX);
                // SAFETY: checked for NULL inside; `symbol` is the caller's C string.
                unsafe {
                    substitute_entry(
                        symbol,
                        func,
                        version,
                        flags | entry::PER_THREAD_DEFAULT_STREAM,
                    )
                };
            }
            code
        },
    )
}

/// After a successful lookup: if it resolved to a function the layer hooks, hand out the hook.
///
/// # Safety
/// `symbol` is NULL or a NUL-terminated C string, and `func` is NULL or the caller's writable
/// out-pointer of the lookup that just succeeded.
unsafe fn substitute_entry(
    symbol: *const c_char,
    func: *mut *mut c_void,
    version: i32,
    flags: u64,
) {
    if symbol.is_null() || func.is_null() {
        return;
    }
    // SAFETY: `func` is the caller's out-pointer that the real lookup just wrote.
    let found = unsafe { *func };
    if found.is_null() {
        return;
    }
    let layer = match layer::route() {
        Route::Pass => return,
        Route::Monitor(layer) | Route::Vmm(layer, _) => layer,
    };
    // SAFETY: the caller's NUL-terminated symbol name.
    let Ok(name) = unsafe { CStr::from_ptr(symbol) }.to_str() else {
        return;
    };
    let lookup = entry::Lookup {
        symbol: name,
        version,
        flags,
        returned: real::driver_function_named(found as usize),
    };
    match entry::substitute(&lookup, layer::eliding(), |n| flush_hook(n).is_some()) {
        entry::Substitution::Keep => {}
        entry::Substitution::Hook(hooked) => {
            let Some(hook) = driver_hook(hooked) else {
                return;
            };
            if hook == found {
                return; // already the hook (a nested lookup handed it out)
            }
            // SAFETY: as above; the hook has the prototype of the function it replaces and
            // calls that very function (same name, same stream semantics).
            unsafe { *func = hook };
            Counters::bump(&layer.counters.entry_points);
            tracing::debug!(
                symbol = name,
                hooked,
                version,
                flags,
                "entry point: handing out the layer's hook"
            );
        }
        entry::Substitution::Unseen => {
            // A function that may touch memory, handed out unwrapped: its calls will not be
            // flush points, so copy elision can no longer be sure of anything.
            layer.stop_eliding(&format!(
                "cuGetProcAddress(\"{name}\", version {version}, flags {flags}) returned a \
                 driver function the layer does not wrap"
            ));
        }
    }
}

// ---- driver: memory ---------------------------------------------------------------------

#[no_mangle]
pub unsafe extern "C" fn cuMemAlloc_v2(dptr: *mut DevicePtr, bytesize: usize) -> c_int {
    guarded("cuMemAlloc_v2", cu::UNKNOWN, || {
        let real = || {
            let real = real_driver!(cuMemAlloc_v2);
            // SAFETY: the caller's arguments, passed on unchanged.
            unsafe { real(dptr, bytesize) }
        };
        let Some(_inside) = Inside::enter() else {
            return real();
        };
        match layer::route() {
            Route::Pass => real(),
            Route::Monitor(layer) => {
                let code = real();
                if code == cu::SUCCESS && !dptr.is_null() {
                    // SAFETY: the driver just wrote the address through `dptr`.
                    let address = unsafe { *dptr };
                    layer.monitor_alloc(Api::Driver, "cuMemAlloc_v2", address, bytesize);
                }
                code
            }
            Route::Vmm(layer, engine) => {
                if dptr.is_null() || bytesize == 0 {
                    return cu::INVALID_VALUE; // as the driver says
                }
                match layer.vmm_alloc(engine, Api::Driver, "cuMemAlloc_v2", bytesize) {
                    Ok(address) => {
                        // SAFETY: the caller's non-NULL out-pointer.
                        unsafe { *dptr = address };
                        cu::SUCCESS
                    }
                    Err(fail) => fail.driver_code(),
                }
            }
        }
    })
}

#[no_mangle]
pub unsafe extern "C" fn cuMemFree_v2(dptr: DevicePtr) -> c_int {
    guarded("cuMemFree_v2", cu::UNKNOWN, || {
        let real = || {
            let real = real_driver!(cuMemFree_v2);
            // SAFETY: the caller's argument, passed on unchanged.
            unsafe { real(dptr) }
        };
        if dptr == 0 {
            return real();
        }
        let Some(_inside) = Inside::enter() else {
            return real();
        };
        match layer::route() {
            Route::Pass => real(),
            Route::Monitor(layer) => {
                let code = real();
                if code == cu::SUCCESS {
                    layer.monitor_free("cuMemFree_v2", dptr);
                }
                code
            }
            Route::Vmm(layer, engine) => match layer.vmm_free(engine, "cuMemFree_v2", dptr) {
                Ok(Freed::Done) => cu::SUCCESS,
                Ok(Freed::NotOwned) => real(),
                Err(fail) => fail.driver_code(),
            },
        }
    })
}

#[no_mangle]
pub unsafe extern "C" fn cuMemGetInfo_v2(free: *mut usize, total: *mut usize) -> c_int {
    guarded("cuMemGetInfo_v2", cu::UNKNOWN, || {
        let real = real_driver!(cuMemGetInfo_v2);
        memory_info(Api::Driver, free, total, |f, t| {
            // SAFETY: our own locals as out-pointers, or the caller's, passed on unchanged.
            unsafe { real(f, t) }
        })
    })
}

/// The legacy (CUDA 11.3–11.8) lookup.
#[no_mangle]
pub unsafe extern "C" fn cuGetProcAddress(
    symbol: *const c_char,
    pfn: *mut *mut c_void,
    version: c_int,
    flags: u64,
) -> c_int {
    guarded("cuGetProcAddress", cu::UNKNOWN, || {
        let real = real_driver!(cuGetProcAddress);
        // A lookup made from inside the layer, or by CUDA inside an outer lookup, passes
        // through untouched: the outermost one substitutes.
        let inside = Inside::enter();
        // SAFETY: the caller's arguments, passed on unchanged.
        let code = unsafe { real(symbol, pfn, version, flags) };
        if code == cu::SUCCESS && inside.is_some() {
            // SAFETY: checked for NULL inside.
            unsafe { substitute_entry(symbol, pfn, version, flags) };
        }
        code
    })
}

/// The lookup of CUDA ≥ 12 (`cuGetProcAddress` in `cuda.h` is a macro for this one).
#[no_mangle]
pub unsafe extern "C" fn cuGetProcAddress_v2(
    symbol: *const c_char,
    pfn: *mut *mut c_void,
    version: c_int,
    flags: u64,
    status: *mut c_int,
) -> c_int {
    guarded("cuGetProcAddress_v2", cu::UNKNOWN, || {
        let real = real_driver!(cuGetProcAddress_v2);
        // A lookup made from inside the layer, or by CUDA inside an outer lookup, passes
        // through untouched: the outermost one substitutes.
        let inside = Inside::enter();
        // SAFETY: the caller's arguments, passed on unchanged.
        let code = unsafe { real(symbol, pfn, version, flags, status) };
        if code == cu::SUCCESS && inside.is_some() {
            // SAFETY: checked for NULL inside.
            unsafe { substitute_entry(symbol, pfn, version, flags) };
        }
        code
    })
}

// ---- flush points -----------------------------------------------------------------------

/// Hooks that perform deferred copies (copy elision), then call the real function with the
/// caller's arguments unchanged.
macro_rules! flush_hooks {
    ($lookup:ident; $( $lib:ident fn $name:ident($($arg:ident: $ty:ty),* $(,)?); )*) => {
        $(
            #[no_mangle]
            pub unsafe extern "C" fn $name($($arg: $ty),*) -> c_int {
                guarded(stringify!($name), flush_hooks!(@unknown $lib), || {
                    let real = flush_hooks!(@real $lib $name);
                    flush_point(stringify!($name));
                    // SAFETY: the caller's arguments, passed unchanged to the real function
                    // of the same prototype.
                    unsafe { real($($arg),*) }
                })
            }
        )*

        /// This library's flush-point hook named `name`, as a pointer.
        fn $lookup(name: &str) -> Option<*mut c_void> {
            let address: usize = match name {
                $( stringify!($name) => $name as *const () as usize, )*
                _ => return None,
            };
            Some(address as *mut c_void)
        }
    };
    (@unknown runtime) => { cuda::UNKNOWN };
    (@unknown driver) => { cu::UNKNOWN };
    (@real runtime $name:ident) => { real_runtime_flush!($name) };
    (@real driver $name:ident) => { real_driver_flush!($name) };
}

macro_rules! runtime_flush_points {
    ($( $name:ident($($arg:ident: $ty:ty),* $(,)?); )*) => {
        flush_hooks! { runtime_flush_hook; $( runtime fn $name($($arg: $ty),*); )* }
    };
}

macro_rules! driver_flush_points {
    ($( $name:ident($($arg:ident: $ty:ty),* $(,)?); )*) => {
        flush_hooks! { driver_flush_hook; $( driver fn $name($($arg: $ty),*); )* }
    };
}

include!("../cuda/flush_points.rs");

/// The flush-point hook named `name`, as a pointer to hand out from lookups.
fn flush_hook(name: &str) -> Option<*mut c_void> {
    driver_flush_hook(name).or_else(|| runtime_flush_hook(name))
}

/// The layer's hook for a hooked driver function, as a pointer to hand out from lookups.
fn driver_hook(name: &str) -> Option<*mut c_void> {
    let address: usize = match name {
        "cuMemAlloc_v2" => cuMemAlloc_v2 as *const () as usize,
        "cuMemFree_v2" => cuMemFree_v2 as *const () as usize,
        "cuMemGetInfo_v2" => cuMemGetInfo_v2 as *const () as usize,
        "cuGetProcAddress" => cuGetProcAddress as *const () as usize,
        "cuGetProcAddress_v2" => cuGetProcAddress_v2 as *const () as usize,
        "cuMemGetAddressRange_v2" => cuMemGetAddressRange_v2 as *const () as usize,
        "cuPointerGetAttribute" => cuPointerGetAttribute as *const () as usize,
        "cuPointerGetAttributes" => cuPointerGetAttributes as *const () as usize,
        "cuMemRetainAllocationHandle" => cuMemRetainAllocationHandle as *const () as usize,
        _ if name.starts_with("cu") && !name.starts_with("cuda") => return flush_hook(name),
        _ => return None,
    };
    Some(address as *mut c_void)
}

// ---- NCCL: registrations of tagged memory ------------------------------------------------

/// The real libnccl function `$name`, or return `ncclSystemError` from the hook (no libnccl
/// found in this process; a notice said so).
macro_rules! real_nccl {
    ($name:ident) => {
        match real::nccl_functions().and_then(|table| table.$name) {
            Some(function) => function,
            None => {
                tracing::warn!(
                    function = stringify!($name),
                    "the real NCCL function was not found"
                );
                return nccl::SYSTEM_ERROR;
            }
        }
    };
}

/// `ncclCommRegister`: in vmm mode a range that holds tagged memory is registered, and the
/// caller gets a proxy handle whose registration the layer drops before a pause of the tag and
/// makes again after its resume (`engine/nccl.rs`); any other range is NCCL's business alone.
/// PyTorch and programs linked with libnccl reach this through the dynamic symbol; a call
/// through `dlsym` on libnccl's own handle does not.
#[no_mangle]
pub unsafe extern "C" fn ncclCommRegister(
    comm: *mut c_void,
    buff: *mut c_void,
    size: usize,
    handle: *mut *mut c_void,
) -> c_int {
    guarded("ncclCommRegister", nccl::INTERNAL_ERROR, || {
        let real = real_nccl!(ncclCommRegister);
        // SAFETY: the caller's arguments, passed on unchanged.
        let pass = || unsafe { real(comm, buff, size, handle) };
        let Some(_inside) = Inside::enter() else {
            return pass();
        };
        let Route::Vmm(layer, engine) = layer::route() else {
            return pass();
        };
        if layer.config.nccl_register == NcclRegister::Pass {
            return pass();
        }
        if handle.is_null() {
            return nccl::INVALID_ARGUMENT;
        }
        match layer.nccl_register(engine, comm as usize, buff as u64, size) {
            Ok(registered) => {
                // SAFETY: the caller's non-NULL out-pointer.
                unsafe { *handle = registered as *mut c_void };
                nccl::SUCCESS
            }
            Err(code) => code,
        }
    })
}

/// `ncclCommDeregister`: a proxy handle deregisters the registration the layer keeps for it
/// (nothing while its tag is paused); NCCL's own handles go straight to NCCL.
#[no_mangle]
pub unsafe extern "C" fn ncclCommDeregister(comm: *mut c_void, handle: *mut c_void) -> c_int {
    guarded("ncclCommDeregister", nccl::INTERNAL_ERROR, || {
        let real = real_nccl!(ncclCommDeregister);
        // SAFETY: the caller's arguments, passed on unchanged.
        let pass = || unsafe { real(comm, handle) };
        if !is_proxy(handle as usize) {
            return pass();
        }
        let Some(_inside) = Inside::enter() else {
            return pass();
        };
        match layer::route() {
            Route::Vmm(layer, _) => layer.nccl_deregister(comm as usize, handle as usize),
            _ => pass(),
        }
    })
}

/// Before a communicator ends: the layer forgets its registrations (NCCL releases its own).
fn forget_communicator(comm: *mut c_void, call: &'static str) {
    let Some(_inside) = Inside::enter() else {
        return;
    };
    if let Route::Vmm(layer, _) = layer::route() {
        layer.nccl_forget(comm as usize, call);
    }
}

/// `ncclCommDestroy`: the layer's records of the communicator's registrations go first.
#[no_mangle]
pub unsafe extern "C" fn ncclCommDestroy(comm: *mut c_void) -> c_int {
    guarded("ncclCommDestroy", nccl::INTERNAL_ERROR, || {
        let real = real_nccl!(ncclCommDestroy);
        forget_communicator(comm, "ncclCommDestroy");
        // SAFETY: the caller's argument, passed on unchanged.
        unsafe { real(comm) }
    })
}

/// `ncclCommAbort`: as `ncclCommDestroy`.
#[no_mangle]
pub unsafe extern "C" fn ncclCommAbort(comm: *mut c_void) -> c_int {
    guarded("ncclCommAbort", nccl::INTERNAL_ERROR, || {
        let real = real_nccl!(ncclCommAbort);
        forget_communicator(comm, "ncclCommAbort");
        // SAFETY: the caller's argument, passed on unchanged.
        unsafe { real(comm) }
    })
}

// ---- the layer's own C ABI --------------------------------------------------------------

fn abi_guarded(call: &'static str, body: impl FnOnce() -> Result<(), Fail>) -> c_int {
    guarded(call, abi::INTERNAL, || match body() {
        Ok(()) => abi::OK,
        Err(fail) => {
            tracing::warn!(call, %fail, "failed");
            fail.abi_code()
        }
    })
}

/// A tag argument: NULL and "" mean none.
///
/// # Safety
/// `tag` is NULL or a NUL-terminated C string that outlives `'a`.
unsafe fn tag_argument<'a>(tag: *const c_char) -> Result<Option<&'a str>, Fail> {
    if tag.is_null() {
        return Ok(None);
    }
    // SAFETY: the caller passes a NUL-terminated string (the header says so).
    tags::parse_tag(unsafe { CStr::from_ptr(tag) }.to_bytes())
}

/// Sets the calling thread's tag (NULL or "": untagged).
#[no_mangle]
pub unsafe extern "C" fn stablebuf_set_tag(tag: *const c_char) -> c_int {
    abi_guarded("stablebuf_set_tag", || {
        // SAFETY: see `tag_argument`.
        let tag = unsafe { tag_argument(tag) }?;
        layer::layer().set_tag(tag);
        Ok(())
    })
}

/// Pauses a tag (NULL or "": every tag), keeping contents if `keep_contents` is non-zero.
#[no_mangle]
pub unsafe extern "C" fn stablebuf_pause(tag: *const c_char, keep_contents: c_int) -> c_int {
    abi_guarded("stablebuf_pause", || {
        // SAFETY: see `tag_argument`.
        let tag = unsafe { tag_argument(tag) }?;
        layer::layer().pause(tag, keep_contents != 0)
    })
}

/// Resumes a tag (NULL or "": every paused tag). Idempotent.
#[no_mangle]
pub unsafe extern "C" fn stablebuf_resume(tag: *const c_char) -> c_int {
    abi_guarded("stablebuf_resume", || {
        // SAFETY: see `tag_argument`.
        let tag = unsafe { tag_argument(tag) }?;
        layer::layer().resume(tag)
    })
}

/// Fills `*out` (whose `size` the caller set to `sizeof(struct stablebuf_stats)`).
#[no_mangle]
pub unsafe extern "C" fn stablebuf_stats(out: *mut StablebufStats) -> c_int {
    abi_guarded("stablebuf_stats", || {
        if out.is_null() {
            return Err(Fail::InvalidValue("NULL stats pointer".into()));
        }
        // SAFETY: the caller's struct starts with its `size` field (8 bytes); read unaligned
        // in case the caller's buffer is not 8-byte aligned.
        let asked = unsafe { std::ptr::read_unaligned(out.cast::<u64>()) };
        let Some(bytes) = bytes_to_write(asked) else {
            return Err(Fail::InvalidValue(format!(
                "stats.size is {asked}: set it to sizeof(struct stablebuf_stats)"
            )));
        };
        let mut stats = layer::layer().stats();
        stats.size = bytes as u64;
        let data = stats.to_bytes();
        // SAFETY: the caller declared `asked` ≥ `bytes` writable bytes at `out`.
        unsafe { std::ptr::copy_nonoverlapping(data.as_ptr(), out.cast::<u8>(), bytes) };
        Ok(())
    })
}

/// Pins `bytes` of host memory now, so the first pause that keeps contents does not pay it.
#[no_mangle]
pub unsafe extern "C" fn stablebuf_reserve_host(bytes: usize) -> c_int {
    abi_guarded("stablebuf_reserve_host", || {
        if bytes == 0 {
            return Err(Fail::InvalidValue("reserve_host of 0 bytes".into()));
        }
        layer::layer().reserve_host(bytes)
    })
}

/// A static, NUL-terminated description of a `STABLEBUF_*` code.
#[no_mangle]
pub unsafe extern "C" fn stablebuf_error_string(code: c_int) -> *const c_char {
    static TEXTS: OnceLock<Vec<(c_int, CString)>> = OnceLock::new();
    static UNKNOWN: &CStr = c"unknown stablebuf error code";
    let texts = TEXTS.get_or_init(|| {
        abi::TABLE
            .iter()
            .filter_map(|(code, _, text)| Some((*code, CString::new(*text).ok()?)))
            .collect()
    });
    texts
        .iter()
        .find(|(c, _)| *c == code)
        .map_or(UNKNOWN.as_ptr(), |(_, text)| text.as_ptr())
}

// ---- load, fork and exit ----------------------------------------------------------------

/// Runs when the library is loaded: reads the environment (and prints help), registers the
/// exit and fork handlers. No CUDA call is made here.
extern "C" fn init_at_load() {
    let _ = catch_unwind(|| {
        layer::init();
        nccl_graph_register_default();
        // SAFETY: registers functions of this library; glibc unregisters them if the library
        // is unloaded (both take the caller's DSO handle).
        unsafe {
            libc::atexit(at_exit);
            libc::pthread_atfork(None, None, Some(child_after_fork));
        }
    });
}

#[used]
#[link_section = ".init_array"]
static INIT_AT_LOAD: extern "C" fn() = init_at_load;

/// vmm: `NCCL_GRAPH_REGISTER=0` unless the user set it ([`env::nccl_graph_register_default`]
/// says why), at load time, before any NCCL reads its environment (NCCL reads it when its
/// first communicator is made; a program or Python that sets it later overrides this).
fn nccl_graph_register_default() {
    let mode = layer::layer().config.mode;
    let current = std::env::var(env::NCCL_GRAPH_REGISTER).ok();
    let Some(notice) = env::nccl_graph_register_default(mode, current.as_deref()) else {
        return;
    };
    debug_assert_eq!(mode, Mode::Vmm);
    // SAFETY: two NUL-terminated strings; at load time, from the library's constructor,
    // before the program's own code runs (no other thread reads the environment yet).
    let set = unsafe { libc::setenv(c"NCCL_GRAPH_REGISTER".as_ptr(), c"0".as_ptr(), 1) };
    if set == 0 {
        notice::notice_once("nccl-graph-register", &notice);
    }
}

extern "C" fn at_exit() {
    let _ = catch_unwind(|| layer::layer().at_exit());
}

extern "C" fn child_after_fork() {
    layer::forked();
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::cuda::symbols;
    use std::collections::BTreeSet;

    #[test]
    fn this_file_and_the_flush_points_define_exactly_the_symbol_table() {
        let is_cuda_or_abi = |name: &&str| {
            name.starts_with("cuda")
                || name.starts_with("__cuda")
                || name.starts_with("stablebuf_")
                || (name.starts_with("nccl")
                    && name[4..].starts_with(|c: char| c.is_ascii_uppercase()))
                || (name.starts_with("cu")
                    && name[2..].starts_with(|c: char| c.is_ascii_uppercase()))
        };
        // The hooks written out here, and those generated from `flush_points.rs`.
        let mut defined: BTreeSet<&str> = include_str!("ffi.rs")
            .split("fn ")
            .skip(1)
            .filter_map(|rest| rest.split('(').next())
            .filter(is_cuda_or_abi)
            .collect();
        let flush_points = include_str!("../cuda/flush_points.rs");
        let generated: Vec<&str> = flush_points
            .lines()
            .filter(|line| line.starts_with("    ") && !line.trim_start().starts_with("//"))
            .filter_map(|line| line.trim().split('(').next())
            .filter(is_cuda_or_abi)
            .collect();
        for name in &generated {
            assert!(
                defined.insert(name),
                "{name} is written out here and in flush_points.rs"
            );
        }
        let table: BTreeSet<&str> = symbols::exported().collect();
        assert_eq!(defined, table);
    }

    #[test]
    fn every_hooked_driver_function_can_be_handed_out() {
        for hooked in symbols::HOOKED
            .iter()
            .filter(|h| h.library == symbols::Library::Driver)
        {
            assert!(driver_hook(hooked.name).is_some(), "{}", hooked.name);
        }
        assert!(driver_hook("cuMemCreate").is_none());
    }

    #[test]
    fn error_strings_are_static_and_match_the_table() {
        for (code, _, text) in abi::TABLE {
            // SAFETY: returns a pointer to a static NUL-terminated string.
            let got = unsafe { CStr::from_ptr(stablebuf_error_string(*code)) };
            assert_eq!(got.to_str().unwrap(), *text);
        }
        // SAFETY: as above.
        let unknown = unsafe { CStr::from_ptr(stablebuf_error_string(12345)) };
        assert_eq!(unknown.to_str().unwrap(), "unknown stablebuf error code");
    }

    #[test]
    fn a_panic_becomes_an_error_code() {
        let code = guarded("test", cuda::UNKNOWN, || panic!("boom"));
        assert_eq!(code, cuda::UNKNOWN);
        assert_eq!(guarded("test", cuda::UNKNOWN, || 7), 7);
    }
}
