//! The C entry points PyTorch's pluggable allocator calls.
//!
//! `torch.cuda.memory.CUDAPluggableAllocator(<this .so>, "stablebuf_alloc_<slot>",
//! "stablebuf_free")` looks these up by name. Signatures are PyTorch's:
//! `void* alloc(size_t size, int device, cudaStream_t stream)` and
//! `void free(void* ptr, size_t size, int device, cudaStream_t stream)`.
//!
//! **Why one allocation entry point per tag.** PyTorch passes no pool to the allocator, only
//! size, device and stream. The tag could come from ambient state (a global or thread-local
//! "current tag" set by `region()`), but a pool also allocates outside `region()`: a graph
//! captured with `pool=stablebuf.pool(tag).id`, or PyTorch growing a pool on whatever thread
//! uses it. So each tag's pool gets its own allocator whose entry point *is* the tag (slot `n`
//! serves the `n`-th registered tag), and no allocation can land in the wrong region. One
//! `stablebuf_free` serves all: it finds the region by address.
//!
//! Nothing here unwinds into C: every call runs under `catch_unwind`. A failed allocation
//! returns NULL (PyTorch then frees its cached blocks, retries once, and raises its
//! out-of-memory error) after recording the typed failure for this thread, which
//! `stablebuf.region()` turns into the matching `stablebuf` exception. Failed frees cannot
//! report back through PyTorch: they are kept for [`take_free_failures`].

use std::cell::RefCell;
use std::ffi::{c_int, c_void};
use std::panic::{catch_unwind, AssertUnwindSafe};
use std::sync::Mutex;

use crate::errors::{panic_text, Failure};
use crate::regions;
use crate::tags::MAX_TAGS;

/// PyTorch's allocation function type.
pub type AllocFn = extern "C" fn(usize, c_int, *mut c_void) -> *mut c_void;

/// Name of the free entry point.
pub const FREE_SYMBOL: &str = "stablebuf_free";

/// Name of the allocation entry point of `slot`.
pub fn alloc_symbol(slot: usize) -> String {
    format!("stablebuf_alloc_{slot}")
}

/// At most this many failed frees are kept (the oldest are dropped).
const KEPT_FREE_FAILURES: usize = 64;

thread_local! {
    static LAST_ALLOC_FAILURE: RefCell<Option<Failure>> = const { RefCell::new(None) };
}

static FREE_FAILURES: Mutex<Vec<String>> = Mutex::new(Vec::new());

/// The failure of this thread's last failed allocation, cleared by reading it. PyTorch
/// allocates on the thread that asked for the tensor, so the thread that sees PyTorch's
/// out-of-memory error finds the cause here.
pub fn take_alloc_failure() -> Option<Failure> {
    LAST_ALLOC_FAILURE.with(|last| last.borrow_mut().take())
}

/// Messages of frees that failed since the last call, oldest first.
pub fn take_free_failures() -> Vec<String> {
    std::mem::take(&mut *FREE_FAILURES.lock().unwrap_or_else(|p| p.into_inner()))
}

fn record_free_failure(message: String) {
    let mut kept = FREE_FAILURES.lock().unwrap_or_else(|p| p.into_inner());
    if kept.len() == KEPT_FREE_FAILURES {
        kept.remove(0);
    }
    kept.push(message);
}

/// What every allocation entry point does, for `slot`.
fn alloc_in_slot(slot: usize, size: usize, device: c_int) -> *mut c_void {
    let outcome = catch_unwind(AssertUnwindSafe(|| regions::alloc(slot, size, device)));
    let failure = match outcome {
        Ok(Ok(address)) => {
            LAST_ALLOC_FAILURE.with(|last| last.borrow_mut().take());
            return address as usize as *mut c_void;
        }
        Ok(Err(failure)) => failure,
        Err(payload) => Failure::internal(&panic_text(payload.as_ref())),
    };
    let failure = failure.context(format_args!("allocating {size} bytes"));
    // The thread-local may be gone if the thread is exiting; then there is no one to tell.
    let _ = LAST_ALLOC_FAILURE.try_with(|last| *last.borrow_mut() = Some(failure));
    std::ptr::null_mut()
}

/// Gives `ptr` back to the region that holds it. The size, device and stream PyTorch passes
/// are not needed: the region knows each allocation's size.
#[allow(unsafe_code)] // `no_mangle` only: the symbol PyTorch looks up; no unsafe block
#[no_mangle]
pub extern "C" fn stablebuf_free(
    ptr: *mut c_void,
    size: usize,
    device: c_int,
    stream: *mut c_void,
) {
    let _ = (size, device, stream);
    let address = ptr as usize as u64;
    let outcome = catch_unwind(AssertUnwindSafe(|| regions::free(address)));
    let message = match outcome {
        Ok(Ok(_)) => return,
        Ok(Err(failure)) => failure.to_string(),
        Err(payload) => Failure::internal(&panic_text(payload.as_ref())).to_string(),
    };
    let _ = catch_unwind(|| record_free_failure(format!("freeing {address:#x}: {message}")));
}

macro_rules! alloc_entry_points {
    ($($name:ident = $slot:literal),* $(,)?) => {
        $(
            /// Allocation entry point of one tag's pool (see the module docs).
            #[allow(unsafe_code)] // `no_mangle` only: the symbol PyTorch looks up
            #[no_mangle]
            pub extern "C" fn $name(size: usize, device: c_int, stream: *mut c_void) -> *mut c_void {
                let _ = stream;
                alloc_in_slot($slot, size, device)
            }
        )*
        /// Every allocation entry point, indexed by slot.
        pub const ALLOC_ENTRY_POINTS: [AllocFn; MAX_TAGS] = [$($name),*];
    };
}

alloc_entry_points!(
    stablebuf_alloc_0 = 0,
    stablebuf_alloc_1 = 1,
    stablebuf_alloc_2 = 2,
    stablebuf_alloc_3 = 3,
    stablebuf_alloc_4 = 4,
    stablebuf_alloc_5 = 5,
    stablebuf_alloc_6 = 6,
    stablebuf_alloc_7 = 7,
    stablebuf_alloc_8 = 8,
    stablebuf_alloc_9 = 9,
    stablebuf_alloc_10 = 10,
    stablebuf_alloc_11 = 11,
    stablebuf_alloc_12 = 12,
    stablebuf_alloc_13 = 13,
    stablebuf_alloc_14 = 14,
    stablebuf_alloc_15 = 15,
    stablebuf_alloc_16 = 16,
    stablebuf_alloc_17 = 17,
    stablebuf_alloc_18 = 18,
    stablebuf_alloc_19 = 19,
    stablebuf_alloc_20 = 20,
    stablebuf_alloc_21 = 21,
    stablebuf_alloc_22 = 22,
    stablebuf_alloc_23 = 23,
    stablebuf_alloc_24 = 24,
    stablebuf_alloc_25 = 25,
    stablebuf_alloc_26 = 26,
    stablebuf_alloc_27 = 27,
    stablebuf_alloc_28 = 28,
    stablebuf_alloc_29 = 29,
    stablebuf_alloc_30 = 30,
    stablebuf_alloc_31 = 31,
    stablebuf_alloc_32 = 32,
    stablebuf_alloc_33 = 33,
    stablebuf_alloc_34 = 34,
    stablebuf_alloc_35 = 35,
    stablebuf_alloc_36 = 36,
    stablebuf_alloc_37 = 37,
    stablebuf_alloc_38 = 38,
    stablebuf_alloc_39 = 39,
    stablebuf_alloc_40 = 40,
    stablebuf_alloc_41 = 41,
    stablebuf_alloc_42 = 42,
    stablebuf_alloc_43 = 43,
    stablebuf_alloc_44 = 44,
    stablebuf_alloc_45 = 45,
    stablebuf_alloc_46 = 46,
    stablebuf_alloc_47 = 47,
    stablebuf_alloc_48 = 48,
    stablebuf_alloc_49 = 49,
    stablebuf_alloc_50 = 50,
    stablebuf_alloc_51 = 51,
    stablebuf_alloc_52 = 52,
    stablebuf_alloc_53 = 53,
    stablebuf_alloc_54 = 54,
    stablebuf_alloc_55 = 55,
    stablebuf_alloc_56 = 56,
    stablebuf_alloc_57 = 57,
    stablebuf_alloc_58 = 58,
    stablebuf_alloc_59 = 59,
    stablebuf_alloc_60 = 60,
    stablebuf_alloc_61 = 61,
    stablebuf_alloc_62 = 62,
    stablebuf_alloc_63 = 63,
);

#[cfg(test)]
mod tests {
    use super::*;
    use crate::errors::Kind;

    #[test]
    fn an_unregistered_slot_returns_null_and_records_why() {
        take_alloc_failure();
        let ptr = (ALLOC_ENTRY_POINTS[MAX_TAGS - 1])(1 << 20, 0, std::ptr::null_mut());
        assert!(ptr.is_null());
        let failure = take_alloc_failure().expect("the failure is recorded");
        assert_eq!(failure.kind, Kind::UnknownTag);
        assert!(
            failure.message.contains("allocating 1048576 bytes"),
            "{failure}"
        );
        assert!(take_alloc_failure().is_none(), "reading clears it");
    }

    #[test]
    fn failures_are_per_thread() {
        let ptr = stablebuf_alloc_62(4096, 0, std::ptr::null_mut());
        assert!(ptr.is_null());
        let seen_elsewhere = std::thread::spawn(take_alloc_failure).join().unwrap();
        assert!(seen_elsewhere.is_none());
        assert!(take_alloc_failure().is_some());
    }

    // One test for the shared log, so that parallel tests do not read each other's entries.
    #[test]
    fn failed_frees_are_recorded_not_fatal_and_the_log_is_bounded() {
        stablebuf_free(0x1234_5000 as *mut c_void, 4096, 0, std::ptr::null_mut());
        let failures = take_free_failures();
        assert!(
            failures.iter().any(|m| m.contains("0x12345000")),
            "{failures:?}"
        );
        for n in 0..KEPT_FREE_FAILURES + 10 {
            record_free_failure(format!("failure {n}"));
        }
        let kept = take_free_failures();
        assert_eq!(kept.len(), KEPT_FREE_FAILURES);
        assert_eq!(kept[0], "failure 10");
        assert_eq!(
            kept[KEPT_FREE_FAILURES - 1],
            format!("failure {}", KEPT_FREE_FAILURES + 9)
        );
    }

    #[test]
    fn symbols_are_named_by_slot() {
        assert_eq!(alloc_symbol(0), "stablebuf_alloc_0");
        assert_eq!(alloc_symbol(MAX_TAGS - 1), "stablebuf_alloc_63");
        assert_eq!(ALLOC_ENTRY_POINTS.len(), MAX_TAGS);
    }
}
