//! Driver entry points: which hooked function a `cuGetProcAddress` /
//! `cudaGetDriverEntryPoint*` lookup resolves to, so the layer can hand out its hook instead of
//! the driver's function. Programs (and libraries) that fetch `cuMemAlloc` at run time are
//! caught this way, not only those that link the symbol.
//!
//! The lookup takes a base name (`"cuMemAlloc"`), a CUDA version and flags; the driver returns
//! the newest variant introduced at or before that version (`cuMemAlloc_v2` since 3.2). The
//! memory functions have no per-thread-stream variants, so their variant follows from name and
//! version alone. Functions that take a stream (the flush points of copy elision) have
//! `_ptsz`/`_ptds` variants: for those the layer hands out the hook of exactly the function
//! the driver returned (recognised by address), so the hook calls that same function and the
//! stream semantics never change. A function that may touch memory and that the layer does
//! not wrap makes the lookup [`Substitution::Unseen`]: copy elision stops for the process,
//! because calls through that pointer will never be flush points.

/// `CU_GET_PROC_ADDRESS_PER_THREAD_DEFAULT_STREAM` / `cudaEnablePerThreadDefaultStream`.
pub const PER_THREAD_DEFAULT_STREAM: u64 = 2;

/// How a base name maps to a hooked function.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Variant {
    pub base: &'static str,
    /// The exported name of the hooked variant.
    pub hooked: &'static str,
    /// First CUDA version (1000 × major + 10 × minor) whose lookup returns this variant.
    pub since: i32,
    /// Last CUDA version that returns it (`i32::MAX`: still current).
    pub until: i32,
    /// Takes a stream: has per-thread-default-stream variants.
    pub stream_ordered: bool,
}

const fn v(base: &'static str, hooked: &'static str, since: i32, stream_ordered: bool) -> Variant {
    Variant {
        base,
        hooked,
        since,
        until: i32::MAX,
        stream_ordered,
    }
}

/// The hooked driver memory and pointer-query functions by base name (the flush points are
/// matched by address).
pub const VARIANTS: &[Variant] = &[
    v("cuMemAlloc", "cuMemAlloc_v2", 3020, false),
    v("cuMemFree", "cuMemFree_v2", 3020, false),
    v("cuMemGetInfo", "cuMemGetInfo_v2", 3020, false),
    v(
        "cuMemGetAddressRange",
        "cuMemGetAddressRange_v2",
        3020,
        false,
    ),
    v(
        "cuPointerGetAttribute",
        "cuPointerGetAttribute",
        4000,
        false,
    ),
    v(
        "cuPointerGetAttributes",
        "cuPointerGetAttributes",
        7000,
        false,
    ),
    v(
        "cuMemRetainAllocationHandle",
        "cuMemRetainAllocationHandle",
        11000,
        false,
    ),
    Variant {
        base: "cuGetProcAddress",
        hooked: "cuGetProcAddress",
        since: 11030,
        until: 11999,
        stream_ordered: false,
    },
    v("cuGetProcAddress", "cuGetProcAddress_v2", 12000, false),
];

/// Driver functions (by prefix of their base name) that cannot read or write the contents of
/// device memory, nor order or wait for work that does: handing them out unwrapped is safe for
/// copy elision. Everything else that the layer does not wrap is treated as touching memory.
/// An allowlist, so a function CUDA adds later is unsafe until someone looks at it.
pub const HARMLESS_PREFIXES: &[&str] = &[
    "cuInit",
    "cuDriverGetVersion",
    "cuGetErrorString",
    "cuGetErrorName",
    "cuGetProcAddress",
    "cuDevice",
    "cuCtxCreate",
    "cuCtxDestroy",
    "cuCtxGet",
    "cuCtxSet",
    "cuCtxPushCurrent",
    "cuCtxPopCurrent",
    "cuCtxAttach",
    "cuCtxDetach",
    "cuCtxEnablePeerAccess",
    "cuCtxDisablePeerAccess",
    "cuGreenCtx",
    "cuDevicePrimaryCtx",
    "cuModule",
    "cuLibrary",
    "cuKernel",
    "cuFunc",
    "cuLink",
    "cuOccupancy",
    "cuMemAlloc",
    "cuMemFree",
    "cuMemGetInfo",
    "cuMemGetAddressRange",
    "cuMemHostAlloc",
    "cuMemHostFree",
    "cuMemHostGetDevicePointer",
    "cuMemHostGetFlags",
    "cuMemHostRegister",
    "cuMemHostUnregister",
    "cuMemCreate",
    "cuMemRelease",
    "cuMemAddressReserve",
    "cuMemAddressFree",
    "cuMemMap",
    "cuMemUnmap",
    "cuMemSetAccess",
    "cuMemGetAccess",
    "cuMemExportToShareableHandle",
    "cuMemImportFromShareableHandle",
    "cuMemGetAllocationGranularity",
    "cuMemGetAllocationPropertiesFromHandle",
    "cuMemRetainAllocationHandle",
    "cuMemGetHandleForAddressRange",
    "cuMemPool",
    "cuMemAdvise",
    "cuMemRangeGetAttribute",
    "cuPointerGetAttribute",
    "cuPointerSetAttribute",
    "cuStreamCreate",
    "cuStreamDestroy",
    "cuStreamGet",
    "cuStreamIsCapturing",
    "cuStreamSetAttribute",
    "cuStreamCopyAttributes",
    "cuThreadExchangeStreamCaptureMode",
    "cuEventCreate",
    "cuEventDestroy",
    "cuEventElapsedTime",
    "cuGraphCreate",
    "cuGraphDestroy",
    "cuGraphAdd",
    "cuGraphClone",
    "cuGraphGet",
    "cuGraphNode",
    "cuGraphKernelNode",
    "cuGraphMemcpyNode",
    "cuGraphMemsetNode",
    "cuGraphHostNode",
    "cuGraphChildGraphNode",
    "cuGraphEventRecordNode",
    "cuGraphEventWaitNode",
    "cuGraphExternalSemaphores",
    "cuGraphBatchMemOpNode",
    "cuGraphMemAllocNode",
    "cuGraphMemFreeNode",
    "cuGraphConditionalHandleCreate",
    "cuGraphDebugDotPrint",
    "cuGraphInstantiate",
    "cuGraphExecDestroy",
    "cuGraphExecGetFlags",
    "cuGraphExecUpdate",
    "cuGraphExecKernelNodeSetParams",
    "cuGraphExecMemcpyNodeSetParams",
    "cuGraphExecMemsetNodeSetParams",
    "cuGraphExecHostNodeSetParams",
    "cuGraphExecChildGraphNodeSetParams",
    "cuGraphExecEventRecordNodeSetEvent",
    "cuGraphExecEventWaitNodeSetEvent",
    "cuGraphExecExternalSemaphores",
    "cuGraphExecBatchMemOpNodeSetParams",
    "cuGraphExecNodeSetParams",
    "cuGraphRelease",
    "cuGraphRetain",
    "cuGraphRemoveDependencies",
    "cuGraphDestroyNode",
    "cuUserObject",
    "cuDeviceGraphMemTrim",
    "cuTexObject",
    "cuSurfObject",
    "cuTexRef",
    "cuSurfRef",
    "cuTensorMapEncode",
    "cuTensorMapReplace",
    "cuArrayCreate",
    "cuArrayDestroy",
    "cuArrayGet",
    "cuArray3DCreate",
    "cuArray3DGet",
    "cuMipmappedArray",
    "cuProfiler",
    "cuCoredump",
    "cuLogs",
    "cuImportExternal",
    "cuExternalMemoryGet",
    "cuDestroyExternal",
    "cuIpcGetEventHandle",
    "cuIpcOpenEventHandle",
    "cuMulticastCreate",
    "cuMulticastGetGranularity",
    "cuMulticastAddDevice",
    "cuMulticastBind",
    "cuMulticastUnbind",
];

/// Whether a driver function may be handed out unwrapped without blinding copy elision.
pub fn harmless(symbol: &str) -> bool {
    HARMLESS_PREFIXES.iter().any(|p| symbol.starts_with(p))
}

/// The lookup the caller made.
#[derive(Clone, Copy, Debug)]
pub struct Lookup<'a> {
    pub symbol: &'a str,
    /// The CUDA version asked for (`i32::MAX` for the runtime's `cudaGetDriverEntryPoint`,
    /// which uses its own, recent version).
    pub version: i32,
    pub flags: u64,
    /// The name of the real function the driver returned, if its address is one of the
    /// exported functions the layer resolved (`None` if it is not, or unknown).
    pub returned: Option<&'static str>,
}

/// What to do with the pointer a lookup returned.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Substitution {
    /// Hand out the layer's hook of this (exported) name instead.
    Hook(&'static str),
    /// Leave the driver's pointer.
    Keep,
    /// Leave it, but it may touch memory unseen: copy elision must stop (when it is on).
    Unseen,
}

/// Which hooked function to hand out instead of what the driver returned, if any.
/// `eliding`: whether flush-point hooks are wanted (copy elision is on). `is_flush_hook(name)`
/// says whether the layer exports a flush-point hook of that real function's name.
pub fn substitute(
    lookup: &Lookup<'_>,
    eliding: bool,
    is_flush_hook: impl Fn(&str) -> bool,
) -> Substitution {
    if let Some(variant) = VARIANTS
        .iter()
        .find(|v| v.base == lookup.symbol && (v.since..=v.until).contains(&lookup.version))
    {
        return Substitution::Hook(variant.hooked);
    }
    if !eliding {
        return Substitution::Keep;
    }
    match lookup.returned {
        Some(returned) if is_flush_hook(returned) => Substitution::Hook(returned),
        _ if harmless(lookup.symbol) => Substitution::Keep,
        _ => Substitution::Unseen,
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::cuda::symbols::{hooked, Library, Role};

    fn lookup(symbol: &str, version: i32) -> Lookup<'_> {
        Lookup {
            symbol,
            version,
            flags: 0,
            returned: None,
        }
    }

    #[test]
    fn memory_functions_follow_name_and_version() {
        assert_eq!(
            substitute(&lookup("cuMemAlloc", 12000), false, flush),
            Substitution::Hook("cuMemAlloc_v2")
        );
        assert_eq!(
            substitute(&lookup("cuMemAlloc", i32::MAX), false, flush),
            Substitution::Hook("cuMemAlloc_v2")
        );
        assert_eq!(
            substitute(&lookup("cuMemFree", 13000), false, flush),
            Substitution::Hook("cuMemFree_v2")
        );
        assert_eq!(
            substitute(&lookup("cuMemGetInfo", 3020), false, flush),
            Substitution::Hook("cuMemGetInfo_v2")
        );
        // Before 3.2 the driver returns the 32-bit v1 function, which is not hooked.
        assert_eq!(
            substitute(&lookup("cuMemAlloc", 3010), false, flush),
            Substitution::Keep
        );
        assert_eq!(
            substitute(&lookup("cuMemAllocManaged", 12000), false, flush),
            Substitution::Keep
        );
        assert_eq!(
            substitute(&lookup("cuMemAlloc_v2", 12000), false, flush),
            Substitution::Keep,
            "base names only"
        );
    }

    #[test]
    fn get_proc_address_itself_is_handed_out_by_version() {
        assert_eq!(
            substitute(&lookup("cuGetProcAddress", 11080), false, flush),
            Substitution::Hook("cuGetProcAddress")
        );
        assert_eq!(
            substitute(&lookup("cuGetProcAddress", 12000), false, flush),
            Substitution::Hook("cuGetProcAddress_v2")
        );
        assert_eq!(
            substitute(&lookup("cuGetProcAddress", 11000), false, flush),
            Substitution::Keep
        );
    }

    fn flush(name: &str) -> bool {
        hooked().any(|h| h.name == name && h.role == Role::Flush && h.library == Library::Driver)
    }

    #[test]
    fn stream_functions_are_handed_out_by_the_address_the_driver_returned() {
        let mut launch = lookup("cuLaunchKernel", 12000);
        assert_eq!(
            substitute(&launch, true, flush),
            Substitution::Unseen,
            "address not recognised: a launch the layer cannot see"
        );
        assert_eq!(
            substitute(&launch, false, flush),
            Substitution::Keep,
            "without elision nothing is wrapped"
        );
        launch.returned = Some("cuLaunchKernel");
        assert_eq!(
            substitute(&launch, true, flush),
            Substitution::Hook("cuLaunchKernel")
        );
        // The per-thread lookup returns the _ptsz function: its own hook, never the legacy one.
        launch.flags = PER_THREAD_DEFAULT_STREAM;
        launch.returned = Some("cuLaunchKernel_ptsz");
        assert_eq!(
            substitute(&launch, true, flush),
            Substitution::Hook("cuLaunchKernel_ptsz")
        );
        let mut memcpy = lookup("cuMemcpyDtoDAsync", 12000);
        memcpy.returned = Some("cuMemcpyDtoDAsync_v2");
        assert_eq!(
            substitute(&memcpy, true, flush),
            Substitution::Hook("cuMemcpyDtoDAsync_v2")
        );
        let mut write = lookup("cuStreamWriteValue32", 13000);
        write.returned = Some("cuStreamWriteValue32_v2_ptsz");
        assert_eq!(
            substitute(&write, true, flush),
            Substitution::Hook("cuStreamWriteValue32_v2_ptsz")
        );
    }

    #[test]
    fn unknown_functions_blind_elision_unless_harmless() {
        for symbol in [
            "cuMemCreate",
            "cuDeviceGetAttribute",
            "cuModuleGetFunction",
            "cuStreamCreate",
        ] {
            assert_eq!(
                substitute(&lookup(symbol, 12000), true, flush),
                Substitution::Keep,
                "{symbol}"
            );
        }
        for symbol in [
            "cuLaunchGridAsync",
            "cuGetExportTable",
            "cuSomethingNewInCuda14",
            "cuStreamWriteValue32",
        ] {
            assert_eq!(
                substitute(&lookup(symbol, 12000), true, flush),
                Substitution::Unseen,
                "{symbol}"
            );
        }
    }

    #[test]
    fn no_hooked_flush_point_is_on_the_harmless_list() {
        for function in hooked().filter(|h| h.role == Role::Flush) {
            assert!(!harmless(function.name), "{}", function.name);
        }
        // Graph building (nodes, parameters) runs nothing: only launches do.
        for prefix in HARMLESS_PREFIXES
            .iter()
            .filter(|p| !p.starts_with("cuGraph"))
        {
            for word in [
                "Launch",
                "Memcpy",
                "Memset",
                "Synchronize",
                "Record",
                "Wait",
                "Write",
            ] {
                assert!(
                    !prefix.contains(word),
                    "{prefix} looks like it touches memory"
                );
            }
        }
    }

    #[test]
    fn every_hooked_memory_function_has_a_variant_and_back() {
        for function in hooked().filter(|h| h.library == Library::Driver && h.role != Role::Flush) {
            assert!(
                VARIANTS.iter().any(|v| v.hooked == function.name),
                "{} has no entry-point variant",
                function.name
            );
        }
        for variant in VARIANTS {
            assert!(
                hooked().any(|h| h.name == variant.hooked),
                "{} is not hooked",
                variant.hooked
            );
        }
    }
}
