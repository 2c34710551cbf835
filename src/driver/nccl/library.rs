//! libnccl opened at run time from wherever [`super::locate`] finds it, and the handful of its
//! functions stablebuf calls, resolved once.
//!
//! cudarc's own NCCL loader asks only for `libnccl.so` and `libnccl.so.1`, `.9` … `.13`, never the
//! `libnccl.so.2` that NCCL 2.x and PyTorch's pip package ship, and cannot be given a folder; so
//! stablebuf opens the library itself (`libloading`, the crate cudarc uses too) and keeps the
//! types of NCCL's C API here, which has been stable across 2.x.

use std::ffi::{c_char, c_int, c_void, CStr};
use std::sync::OnceLock;

use super::locate::{self, Candidate, SearchEnv};
use crate::error::{DriverError, Error, Result};

/// `ncclUniqueId`: 128 opaque bytes, passed by value.
#[repr(C)]
#[derive(Clone, Copy)]
pub(crate) struct UniqueId {
    pub(crate) internal: [c_char; 128],
}

/// `ncclComm_t`.
pub(crate) type Comm = *mut c_void;
/// `ncclResult_t` (0: success).
pub(crate) type NcclResult = c_int;
/// `ncclDataType_t` values used here.
pub(crate) const NCCL_FLOAT32: c_int = 7;
/// `ncclRedOp_t` values used here.
pub(crate) const NCCL_SUM: c_int = 0;

/// The functions of libnccl stablebuf uses.
pub(crate) struct Nccl {
    _library: libloading::Library,
    /// Where it was loaded from (shown in logs and `Collective::library`).
    pub(crate) origin: String,
    pub(crate) version: c_int,
    pub(crate) get_unique_id: unsafe extern "C" fn(*mut UniqueId) -> NcclResult,
    pub(crate) comm_init_rank:
        unsafe extern "C" fn(*mut Comm, c_int, UniqueId, c_int) -> NcclResult,
    pub(crate) comm_destroy: unsafe extern "C" fn(Comm) -> NcclResult,
    pub(crate) all_reduce: unsafe extern "C" fn(
        *const c_void,
        *mut c_void,
        usize,
        c_int,
        c_int,
        Comm,
        *mut c_void,
    ) -> NcclResult,
    pub(crate) comm_register:
        unsafe extern "C" fn(Comm, *mut c_void, usize, *mut *mut c_void) -> NcclResult,
    pub(crate) comm_deregister: unsafe extern "C" fn(Comm, *mut c_void) -> NcclResult,
    get_error_string: unsafe extern "C" fn(NcclResult) -> *const c_char,
}

impl std::fmt::Debug for Nccl {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Nccl")
            .field("origin", &self.origin)
            .field("version", &self.version)
            .finish_non_exhaustive()
    }
}

impl Nccl {
    /// NCCL's text for `code`.
    pub(crate) fn error_string(&self, code: NcclResult) -> String {
        // SAFETY: ncclGetErrorString takes any code and returns a static NUL-terminated string.
        let text = unsafe { (self.get_error_string)(code) };
        if text.is_null() {
            return format!("ncclResult_t {code}");
        }
        // SAFETY: non-NULL, static and NUL-terminated (NCCL's contract).
        unsafe { CStr::from_ptr(text) }
            .to_string_lossy()
            .into_owned()
    }

    /// Opens `candidate` and resolves every function, or says why not.
    fn open(candidate: &Candidate) -> std::result::Result<Self, String> {
        // SAFETY: loading libnccl runs its initialisers, which only set up NCCL's own state;
        // no other code runs in this process because of the load.
        let library = unsafe {
            match candidate {
                Candidate::Name(name) => libloading::Library::new(*name),
                Candidate::Path(path) => libloading::Library::new(path),
            }
        }
        .map_err(|e| e.to_string())?;
        macro_rules! symbol {
            ($name:literal) => {
                // SAFETY: the symbol is NCCL's C function of this name; the field it goes into
                // has that function's prototype (nccl.h, stable across 2.x), and the library
                // stays loaded as long as the pointer (both live in this struct).
                *unsafe { library.get(concat!($name, "\0").as_bytes()) }
                    .map_err(|e| format!("{}: {e}", $name))?
            };
        }
        let get_version: unsafe extern "C" fn(*mut c_int) -> NcclResult = symbol!("ncclGetVersion");
        let mut version = 0;
        // SAFETY: valid out-pointer.
        unsafe { get_version(&mut version) };
        Ok(Self {
            origin: candidate.to_string(),
            version,
            get_unique_id: symbol!("ncclGetUniqueId"),
            comm_init_rank: symbol!("ncclCommInitRank"),
            comm_destroy: symbol!("ncclCommDestroy"),
            all_reduce: symbol!("ncclAllReduce"),
            comm_register: symbol!("ncclCommRegister"),
            comm_deregister: symbol!("ncclCommDeregister"),
            get_error_string: symbol!("ncclGetErrorString"),
            _library: library,
        })
    }
}

/// The outcome of the one search of the process.
static LOADED: OnceLock<std::result::Result<Nccl, Vec<String>>> = OnceLock::new();

fn search() -> std::result::Result<Nccl, Vec<String>> {
    let mut tried = Vec::new();
    // Names and folders that need no subprocess first; the Python environment only if they fail.
    for ask_python in [false, true] {
        for candidate in locate::candidates(&SearchEnv::current(ask_python)) {
            let label = candidate.to_string();
            if tried.iter().any(|t: &String| t.starts_with(&label)) {
                continue;
            }
            match Nccl::open(&candidate) {
                Ok(nccl) => {
                    tracing::info!(library = %nccl.origin, version = nccl.version, "libnccl loaded");
                    return Ok(nccl);
                }
                Err(why) => tried.push(format!("{label}: {why}")),
            }
        }
    }
    Err(tried)
}

/// libnccl, loaded on first use;
/// [`DriverError::LibraryMissing`](crate::error::DriverError::LibraryMissing) lists every place
/// tried.
pub(crate) fn nccl() -> Result<&'static Nccl> {
    match LOADED.get_or_init(search) {
        Ok(nccl) => Ok(nccl),
        Err(tried) => Err(Error::Driver(DriverError::LibraryMissing {
            library: "libnccl",
            searched: tried.join("; "),
        })),
    }
}
