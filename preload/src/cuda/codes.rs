//! What goes wrong inside the layer ([`Fail`]), and how it crosses the C ABI: as the
//! `cudaError_t` a runtime caller expects, the `CUresult` a driver caller expects, or one of the
//! layer's own `STABLEBUF_*` codes (see `include/stablebuf_preload.h`).

use stablebuf::error::{
    DriverError, GraphError, LayoutError, OffloadError, PoolError, RegionError,
};
use std::fmt;

/// `cudaError_t` values the layer returns.
pub mod cuda {
    pub const SUCCESS: i32 = 0;
    pub const INVALID_VALUE: i32 = 1;
    pub const MEMORY_ALLOCATION: i32 = 2;
    pub const INSUFFICIENT_DRIVER: i32 = 35;
    pub const SHARED_OBJECT_SYMBOL_NOT_FOUND: i32 = 302;
    pub const NOT_PERMITTED: i32 = 800;
    pub const NOT_SUPPORTED: i32 = 801;
    pub const STREAM_CAPTURE_UNSUPPORTED: i32 = 900;
    pub const UNKNOWN: i32 = 999;
}

/// `CUresult` values the layer returns.
pub mod cu {
    pub const SUCCESS: i32 = 0;
    pub const INVALID_VALUE: i32 = 1;
    pub const OUT_OF_MEMORY: i32 = 2;
    pub const NOT_INITIALIZED: i32 = 3;
    pub const SHARED_OBJECT_SYMBOL_NOT_FOUND: i32 = 302;
    pub const NOT_PERMITTED: i32 = 800;
    pub const NOT_SUPPORTED: i32 = 801;
    pub const STREAM_CAPTURE_UNSUPPORTED: i32 = 900;
    pub const UNKNOWN: i32 = 999;
}

/// `ncclResult_t` values the layer returns or looks at (`nccl.h`).
pub mod nccl {
    pub const SUCCESS: i32 = 0;
    pub const UNHANDLED_CUDA_ERROR: i32 = 1;
    pub const SYSTEM_ERROR: i32 = 2;
    pub const INTERNAL_ERROR: i32 = 3;
    pub const INVALID_ARGUMENT: i32 = 4;
    pub const INVALID_USAGE: i32 = 5;
}

/// The layer's own C ABI codes (`STABLEBUF_*` in the header).
pub mod abi {
    pub const OK: i32 = 0;
    pub const INVALID_ARGUMENT: i32 = 1;
    pub const OUT_OF_MEMORY: i32 = 2;
    pub const UNKNOWN_TAG: i32 = 3;
    pub const NOT_VMM: i32 = 4;
    pub const CUDA: i32 = 5;
    pub const INTERNAL: i32 = 6;
    pub const FORKED: i32 = 7;
    pub const NO_CUDA: i32 = 8;

    /// Every code with its meaning, in order: the header and `stablebuf_error_string` agree
    /// with this table (a test checks the header).
    pub const TABLE: &[(i32, &str, &str)] = &[
        (OK, "STABLEBUF_OK", "success"),
        (
            INVALID_ARGUMENT,
            "STABLEBUF_ERR_INVALID_ARGUMENT",
            "invalid argument (NULL pointer, tag not UTF-8 or longer than 255 bytes, size 0)",
        ),
        (
            OUT_OF_MEMORY,
            "STABLEBUF_ERR_OUT_OF_MEMORY",
            "out of device or pinned host memory; a resume that fails so keeps the host copy: retry later",
        ),
        (
            UNKNOWN_TAG,
            "STABLEBUF_ERR_UNKNOWN_TAG",
            "no thread ever set this tag with stablebuf_set_tag",
        ),
        (
            NOT_VMM,
            "STABLEBUF_ERR_NOT_VMM",
            "the layer is not in vmm mode (STABLEBUF_PRELOAD_MODE): nothing to pause",
        ),
        (
            CUDA,
            "STABLEBUF_ERR_CUDA",
            "a CUDA call failed; set STABLEBUF_PRELOAD_LOG=warn to see which",
        ),
        (
            INTERNAL,
            "STABLEBUF_ERR_INTERNAL",
            "internal error in the layer (a bug; it was caught, the program goes on)",
        ),
        (
            FORKED,
            "STABLEBUF_ERR_FORKED",
            "called in a child process after fork: the parent's pool is not usable here",
        ),
        (
            NO_CUDA,
            "STABLEBUF_ERR_NO_CUDA",
            "the CUDA runtime or driver could not be found in this process",
        ),
    ];

    pub fn describe(code: i32) -> &'static str {
        TABLE
            .iter()
            .find(|(c, _, _)| *c == code)
            .map_or("unknown stablebuf error code", |(_, _, text)| text)
    }
}

/// A failure inside the layer, classified by what the caller should be told.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Fail {
    /// Out of device memory (pool, region or driver), or over the budget.
    OutOfMemory(String),
    /// Bad input from the caller.
    InvalidValue(String),
    /// Allowed in general, not now (e.g. allocating under a paused tag).
    NotPermitted(String),
    /// The call cannot be served while a stream capture is under way.
    Capturing(String),
    /// A tag no thread ever set.
    UnknownTag(String),
    /// The layer is not in vmm mode.
    NotVmm,
    /// A CUDA driver call failed with this `CUresult`.
    Driver { result: i32, what: String },
    /// The real CUDA runtime or driver (or one function of it) was not found.
    Missing(String),
    /// No CUDA driver could be loaded at all.
    NoDriver,
    /// This process is a child after fork.
    Forked,
    /// A bug in the layer (a caught panic, a broken invariant).
    Internal(String),
}

impl fmt::Display for Fail {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Fail::OutOfMemory(what) => write!(f, "out of memory: {what}"),
            Fail::InvalidValue(what) => write!(f, "invalid value: {what}"),
            Fail::NotPermitted(what) => write!(f, "not permitted: {what}"),
            Fail::Capturing(what) => write!(f, "not supported during stream capture: {what}"),
            Fail::UnknownTag(tag) => write!(f, "unknown tag {tag:?}"),
            Fail::NotVmm => write!(f, "the layer is not in vmm mode"),
            Fail::Driver { result, what } => write!(f, "{what} (CUresult {result})"),
            Fail::Missing(what) => write!(f, "not found: {what}"),
            Fail::NoDriver => write!(f, "no CUDA driver (libcuda) could be loaded"),
            Fail::Forked => write!(f, "called in a child after fork"),
            Fail::Internal(what) => write!(f, "internal error: {what}"),
        }
    }
}

impl Fail {
    /// As a `cudaError_t` for a runtime caller.
    pub fn runtime_code(&self) -> i32 {
        match self {
            Fail::OutOfMemory(_) => cuda::MEMORY_ALLOCATION,
            Fail::InvalidValue(_) | Fail::UnknownTag(_) => cuda::INVALID_VALUE,
            Fail::NotPermitted(_) | Fail::Forked => cuda::NOT_PERMITTED,
            Fail::Capturing(_) => cuda::STREAM_CAPTURE_UNSUPPORTED,
            Fail::NotVmm => cuda::NOT_SUPPORTED,
            Fail::Driver { result, .. } => runtime_from_driver(*result),
            Fail::Missing(_) => cuda::SHARED_OBJECT_SYMBOL_NOT_FOUND,
            Fail::NoDriver => cuda::INSUFFICIENT_DRIVER,
            Fail::Internal(_) => cuda::UNKNOWN,
        }
    }

    /// As a `CUresult` for a driver caller.
    pub fn driver_code(&self) -> i32 {
        match self {
            Fail::OutOfMemory(_) => cu::OUT_OF_MEMORY,
            Fail::InvalidValue(_) | Fail::UnknownTag(_) => cu::INVALID_VALUE,
            Fail::NotPermitted(_) | Fail::Forked => cu::NOT_PERMITTED,
            Fail::Capturing(_) => cu::STREAM_CAPTURE_UNSUPPORTED,
            Fail::NotVmm => cu::NOT_SUPPORTED,
            Fail::Driver { result, .. } => *result,
            Fail::Missing(_) => cu::SHARED_OBJECT_SYMBOL_NOT_FOUND,
            Fail::NoDriver => cu::NOT_INITIALIZED,
            Fail::Internal(_) => cu::UNKNOWN,
        }
    }

    /// As one of the layer's own codes.
    pub fn abi_code(&self) -> i32 {
        match self {
            Fail::OutOfMemory(_) => abi::OUT_OF_MEMORY,
            Fail::InvalidValue(_) => abi::INVALID_ARGUMENT,
            Fail::UnknownTag(_) => abi::UNKNOWN_TAG,
            Fail::NotVmm => abi::NOT_VMM,
            Fail::NotPermitted(_) | Fail::Capturing(_) | Fail::Driver { .. } => abi::CUDA,
            Fail::Missing(_) | Fail::NoDriver => abi::NO_CUDA,
            Fail::Forked => abi::FORKED,
            Fail::Internal(_) => abi::INTERNAL,
        }
    }

    pub fn is_out_of_memory(&self) -> bool {
        matches!(self, Fail::OutOfMemory(_))
    }
}

/// The runtime's number for a driver failure where the two agree; `cudaErrorUnknown` otherwise.
pub fn runtime_from_driver(result: i32) -> i32 {
    match result {
        cu::SUCCESS => cuda::SUCCESS,
        cu::INVALID_VALUE => cuda::INVALID_VALUE,
        cu::OUT_OF_MEMORY => cuda::MEMORY_ALLOCATION,
        cu::NOT_PERMITTED => cuda::NOT_PERMITTED,
        cu::NOT_SUPPORTED => cuda::NOT_SUPPORTED,
        // The stream-capture errors 900..=907 have the same numbers in both APIs.
        900..=907 => result,
        _ => cuda::UNKNOWN,
    }
}

impl From<&stablebuf::Error> for Fail {
    fn from(error: &stablebuf::Error) -> Self {
        use stablebuf::Error;
        let what = error.to_string();
        match error {
            _ if error.is_out_of_memory() => Fail::OutOfMemory(what),
            Error::Pool(PoolError::OverBudget { .. })
            | Error::Pool(PoolError::VirtualCapacity { .. })
            | Error::Offload(OffloadError::RestoreOutOfMemory { .. }) => Fail::OutOfMemory(what),
            Error::Offload(OffloadError::HostOutOfMemory { .. }) => Fail::OutOfMemory(what),
            Error::Driver(DriverError::Failed { result, .. }) => Fail::Driver {
                result: *result as i32,
                what,
            },
            Error::Driver(DriverError::NoDriver) => Fail::NoDriver,
            Error::Graph(GraphError::BindDuringCapture) => Fail::Capturing(what),
            Error::Layout(LayoutError::InvalidShape(_))
            | Error::Layout(LayoutError::BufferTooSmall { .. })
            | Error::Pool(PoolError::BeyondCapacity { .. })
            | Error::Region(RegionError::UnknownAllocation { .. })
            | Error::Region(RegionError::SnapshotMismatch { .. })
            | Error::Layout(LayoutError::EmptyName) => Fail::InvalidValue(what),
            Error::Graph(GraphError::Asleep)
            | Error::Graph(GraphError::Unbound { .. })
            | Error::Region(RegionError::RegionAsleep { .. }) => Fail::NotPermitted(what),
            _ => Fail::Internal(what),
        }
    }
}

impl From<stablebuf::Error> for Fail {
    fn from(error: stablebuf::Error) -> Self {
        Fail::from(&error)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn out_of_memory_is_what_pytorch_retries_on() {
        let oom = Fail::OutOfMemory("asked 1 GiB".into());
        assert_eq!(oom.runtime_code(), 2, "cudaErrorMemoryAllocation");
        assert_eq!(oom.driver_code(), 2, "CUDA_ERROR_OUT_OF_MEMORY");
        assert_eq!(oom.abi_code(), abi::OUT_OF_MEMORY);
    }

    #[test]
    fn stablebuf_errors_are_classified() {
        let pool_oom = stablebuf::Error::Pool(stablebuf::error::PoolError::PoolOutOfMemory {
            asked: 1,
            cached: 0,
            held: 0,
            drained: 0,
        });
        assert!(Fail::from(&pool_oom).is_out_of_memory());
        let budget = stablebuf::Error::Pool(stablebuf::error::PoolError::OverBudget {
            scope: "pool budget".into(),
            asked: 2,
            limit: 1,
            held: 0,
        });
        assert_eq!(Fail::from(budget).runtime_code(), cuda::MEMORY_ALLOCATION);
        let driver = stablebuf::Error::Driver(stablebuf::error::DriverError::Failed {
            call: "cuMemMap",
            result: stablebuf::cudarc::driver::sys::CUresult::CUDA_ERROR_INVALID_VALUE,
            bytes: 0,
        });
        let fail = Fail::from(driver);
        assert_eq!(fail.driver_code(), cu::INVALID_VALUE);
        assert_eq!(fail.runtime_code(), cuda::INVALID_VALUE);
        assert_eq!(fail.abi_code(), abi::CUDA);
        assert_eq!(
            Fail::from(stablebuf::Error::Driver(
                stablebuf::error::DriverError::NoDriver
            ))
            .abi_code(),
            abi::NO_CUDA
        );
        assert_eq!(
            Fail::from(stablebuf::Error::Graph(
                stablebuf::error::GraphError::BindDuringCapture
            ))
            .runtime_code(),
            cuda::STREAM_CAPTURE_UNSUPPORTED
        );
        let asleep = stablebuf::Error::Region(stablebuf::error::RegionError::RegionAsleep {
            tag: "weights".into(),
        });
        assert_eq!(Fail::from(asleep).runtime_code(), cuda::NOT_PERMITTED);
        let unknown = stablebuf::Error::Region(stablebuf::error::RegionError::UnknownAllocation {
            address: 0x10,
        });
        assert_eq!(Fail::from(unknown).driver_code(), cu::INVALID_VALUE);
        let restore =
            stablebuf::Error::Offload(stablebuf::error::OffloadError::RestoreOutOfMemory {
                dataset: 1,
                asked: 2,
                free: 1,
            });
        assert_eq!(Fail::from(restore).abi_code(), abi::OUT_OF_MEMORY);
    }

    #[test]
    fn driver_results_map_to_runtime_numbers_only_where_they_agree() {
        assert_eq!(
            runtime_from_driver(cu::OUT_OF_MEMORY),
            cuda::MEMORY_ALLOCATION
        );
        assert_eq!(runtime_from_driver(901), 901);
        // CUDA_ERROR_INVALID_CONTEXT (201) means something else in the runtime.
        assert_eq!(runtime_from_driver(201), cuda::UNKNOWN);
    }

    #[test]
    fn every_abi_code_is_described_once_and_in_the_header() {
        let header = include_str!("../../include/stablebuf_preload.h");
        for (index, (code, name, text)) in abi::TABLE.iter().enumerate() {
            assert_eq!(*code as usize, index, "codes are dense, in order");
            assert_eq!(abi::describe(*code), *text);
            let define = format!("#define {name} {code}");
            assert!(header.contains(&define), "header lacks `{define}`");
        }
        assert_eq!(abi::describe(-5), "unknown stablebuf error code");
    }

    #[test]
    fn each_failure_has_a_code_in_each_abi() {
        let all = [
            Fail::OutOfMemory(String::new()),
            Fail::InvalidValue(String::new()),
            Fail::NotPermitted(String::new()),
            Fail::Capturing(String::new()),
            Fail::UnknownTag("t".into()),
            Fail::NotVmm,
            Fail::Driver {
                result: 700,
                what: String::new(),
            },
            Fail::Missing(String::new()),
            Fail::NoDriver,
            Fail::Forked,
            Fail::Internal(String::new()),
        ];
        for fail in all {
            assert_ne!(fail.runtime_code(), cuda::SUCCESS, "{fail}");
            assert_ne!(fail.driver_code(), cu::SUCCESS, "{fail}");
            assert_ne!(fail.abi_code(), abi::OK, "{fail}");
            assert!(abi::TABLE.iter().any(|(c, _, _)| *c == fail.abi_code()));
        }
    }
}
