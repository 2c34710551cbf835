//! Driver entry points: which hooked function a `cuGetProcAddress` /
//! `cudaGetDriverEntryPoint*` lookup resolves to, so the layer can hand out its hook instead of
//! the driver's function. Programs (and libraries) that fetch `cuMemAlloc` at run time are
//! caught this way, not only those that link the symbol.
//!
//! The lookup takes a base name (`"cuMemAlloc"`), a CUDA version and flags; the driver returns
//! the newest variant introduced at or before that version (`cuMemAlloc_v2` since 3.2). The
//! memory functions have no per-thread-stream variants, so their variant follows from name and
//! version alone. Functions that take a stream do have `_ptsz`/`_ptds` variants: for those the
//! layer substitutes only when the pointer the driver returned *is* the legacy-stream function
//! it hooks (compared by address), never guessing stream semantics.

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

/// Every hooked driver function by base name.
pub const VARIANTS: &[Variant] = &[
    v("cuMemAlloc", "cuMemAlloc_v2", 3020, false),
    v("cuMemFree", "cuMemFree_v2", 3020, false),
    v("cuMemGetInfo", "cuMemGetInfo_v2", 3020, false),
    Variant {
        base: "cuGetProcAddress",
        hooked: "cuGetProcAddress",
        since: 11030,
        until: 11999,
        stream_ordered: false,
    },
    v("cuGetProcAddress", "cuGetProcAddress_v2", 12000, false),
    v("cuLaunchKernel", "cuLaunchKernel", 4000, true),
    v("cuLaunchKernelEx", "cuLaunchKernelEx", 11060, true),
    v(
        "cuLaunchCooperativeKernel",
        "cuLaunchCooperativeKernel",
        9000,
        true,
    ),
    v("cuGraphLaunch", "cuGraphLaunch", 10000, true),
    v("cuMemcpy", "cuMemcpy", 4000, true),
    v("cuMemcpyAsync", "cuMemcpyAsync", 4000, true),
    v("cuMemcpyDtoD", "cuMemcpyDtoD_v2", 3020, true),
    v("cuMemcpyDtoDAsync", "cuMemcpyDtoDAsync_v2", 3020, true),
    v("cuMemcpyHtoD", "cuMemcpyHtoD_v2", 3020, true),
    v("cuMemcpyHtoDAsync", "cuMemcpyHtoDAsync_v2", 3020, true),
    v("cuMemcpyDtoH", "cuMemcpyDtoH_v2", 3020, true),
    v("cuMemcpyDtoHAsync", "cuMemcpyDtoHAsync_v2", 3020, true),
    v("cuMemsetD8", "cuMemsetD8_v2", 3020, true),
    v("cuMemsetD32", "cuMemsetD32_v2", 3020, true),
    v("cuMemsetD8Async", "cuMemsetD8Async", 3020, true),
    v("cuMemsetD32Async", "cuMemsetD32Async", 3020, true),
    v("cuStreamSynchronize", "cuStreamSynchronize", 2000, true),
    v("cuCtxSynchronize", "cuCtxSynchronize", 2000, false),
];

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
    pub returned: Option<&'a str>,
}

/// Which hooked function to hand out instead of what the driver returned, if any.
/// `stream_hooks`: whether flush-point hooks are wanted (copy elision is on).
pub fn substitute(lookup: &Lookup<'_>, stream_hooks: bool) -> Option<&'static str> {
    let variant = VARIANTS
        .iter()
        .find(|v| v.base == lookup.symbol && (v.since..=v.until).contains(&lookup.version))?;
    if !variant.stream_ordered {
        return Some(variant.hooked);
    }
    let per_thread = lookup.flags & PER_THREAD_DEFAULT_STREAM != 0;
    (stream_hooks && !per_thread && lookup.returned == Some(variant.hooked))
        .then_some(variant.hooked)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::symbols::{Library, Role, HOOKED};

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
            substitute(&lookup("cuMemAlloc", 12000), false),
            Some("cuMemAlloc_v2")
        );
        assert_eq!(
            substitute(&lookup("cuMemAlloc", i32::MAX), false),
            Some("cuMemAlloc_v2")
        );
        assert_eq!(
            substitute(&lookup("cuMemFree", 13000), false),
            Some("cuMemFree_v2")
        );
        assert_eq!(
            substitute(&lookup("cuMemGetInfo", 3020), false),
            Some("cuMemGetInfo_v2")
        );
        // Before 3.2 the driver returns the 32-bit v1 function, which is not hooked.
        assert_eq!(substitute(&lookup("cuMemAlloc", 3010), false), None);
        assert_eq!(substitute(&lookup("cuMemAllocManaged", 12000), false), None);
        assert_eq!(
            substitute(&lookup("cuMemAlloc_v2", 12000), false),
            None,
            "base names only"
        );
    }

    #[test]
    fn get_proc_address_itself_is_handed_out_by_version() {
        assert_eq!(
            substitute(&lookup("cuGetProcAddress", 11080), false),
            Some("cuGetProcAddress")
        );
        assert_eq!(
            substitute(&lookup("cuGetProcAddress", 12000), false),
            Some("cuGetProcAddress_v2")
        );
        assert_eq!(substitute(&lookup("cuGetProcAddress", 11000), false), None);
    }

    #[test]
    fn stream_functions_only_when_the_driver_returned_the_legacy_one() {
        let mut launch = lookup("cuLaunchKernel", 12000);
        assert_eq!(
            substitute(&launch, true),
            None,
            "address not recognised: leave it"
        );
        launch.returned = Some("cuLaunchKernel");
        assert_eq!(substitute(&launch, true), Some("cuLaunchKernel"));
        assert_eq!(substitute(&launch, false), None, "not without copy elision");
        launch.flags = PER_THREAD_DEFAULT_STREAM;
        assert_eq!(
            substitute(&launch, true),
            None,
            "per-thread stream variant: never"
        );
        let mut memcpy = lookup("cuMemcpyDtoDAsync", 12000);
        memcpy.returned = Some("cuMemcpyDtoDAsync_v2");
        assert_eq!(substitute(&memcpy, true), Some("cuMemcpyDtoDAsync_v2"));
    }

    #[test]
    fn every_hooked_driver_function_has_a_variant_and_back() {
        for hooked in HOOKED.iter().filter(|h| h.library == Library::Driver) {
            let variant = VARIANTS
                .iter()
                .find(|v| v.hooked == hooked.name)
                .unwrap_or_else(|| panic!("{} has no entry-point variant", hooked.name));
            assert_eq!(
                variant.stream_ordered,
                hooked.role == Role::Flush && hooked.name != "cuCtxSynchronize",
                "{}",
                hooked.name
            );
        }
        for variant in VARIANTS {
            assert!(
                HOOKED.iter().any(|h| h.name == variant.hooked),
                "{} is not hooked",
                variant.hooked
            );
        }
    }
}
