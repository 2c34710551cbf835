//! Fault injection: make chosen driver calls fail, record the calls an operation makes, and
//! count the driver handles alive. Built with the `fault-injection` feature (off by default; it
//! is also always on in this crate's own unit tests); tests reach it as
//! `stablebuf::fault_injection`.
//!
//! Every driver call goes through `driver::traced`, which asks this module first:
//!
//! ```text
//!   traced("cuMemCreate", bytes, f) ─▶ record the call ─▶ a fault armed for it? ─ no ─▶ f()
//!                                                           │ yes
//!                                                           ▼
//!                        returns Err(result) without calling f (f is called first, and its
//!                        outcome dropped, for calls that end something: see `runs_anyway`)
//! ```
//!
//! Armed faults and recordings belong to the thread that made them: calls made by other
//! threads are neither failed nor recorded, so tests running in parallel do not disturb each
//! other. The handle ledger ([`live_handles`]) counts the whole process.

use std::cell::RefCell;
use std::panic::Location;
use std::sync::atomic::{AtomicI64, Ordering};

use cudarc::driver::{sys::CUresult, DriverError};

/// One driver call as the seam saw it: the driver function, the bytes it concerns, and the
/// line of stablebuf's source that made it (its call site).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Call {
    /// The driver function's name.
    pub name: &'static str,
    /// Bytes the call concerns (0 when none).
    pub bytes: usize,
    /// The line of stablebuf's source that made the call.
    pub site: &'static Location<'static>,
}

impl std::fmt::Display for Call {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "{} at {}:{}",
            self.name,
            self.site.file(),
            self.site.line()
        )
    }
}

/// Fail call number `nth` (counting from 0, from when it is armed) among this thread's calls
/// named `name` (among all its calls with `None`), with `result`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Fault {
    /// The driver function whose calls are counted; `None` counts every call.
    pub name: Option<&'static str>,
    /// Which of the counted calls fails, from 0.
    pub nth: usize,
    /// What the failing call returns.
    pub result: CUresult,
}

impl Fault {
    /// Fail the `nth` call named `name` with `result`.
    pub fn nth(name: &'static str, nth: usize, result: CUresult) -> Self {
        Self {
            name: Some(name),
            nth,
            result,
        }
    }

    /// Fail the `nth` driver call of any kind with `result`.
    pub fn nth_call(nth: usize, result: CUresult) -> Self {
        Self {
            name: None,
            nth,
            result,
        }
    }
}

/// A fault that fired: the call it failed, and whether that call was still made.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Fired {
    /// The fault that was armed.
    pub fault: Fault,
    /// The call it made fail.
    pub call: Call,
    /// How many of this thread's calls came before it since [`arm`]: its index in a recording
    /// started at the same time.
    pub index: usize,
    /// The call was made before the failure was reported (see [`runs_anyway`]).
    pub ran: bool,
}

/// Calls that end something: a handle's release, a mapping's unmap, the end of a capture. The
/// driver ends what they end even when it reports a failure, so an injected failure makes the
/// call first and then reports `result`. Skipping them instead would only measure the leak the
/// injector made (a failed unmap leaves the range mapped, and every later map there fails).
pub fn runs_anyway(name: &str) -> bool {
    matches!(
        name,
        "cuMemUnmap"
            | "cuMemRelease"
            | "cuMemAddressFree"
            | "cuMemFreeHost"
            | "cuMemFree"
            | "cuGraphDestroy"
            | "cuGraphExecDestroy"
            | "cuStreamEndCapture"
    )
}

/// Calls that create what a later call releases: the out-of-memory kind of failure is the
/// realistic one for them.
pub fn creates_memory(name: &str) -> bool {
    matches!(
        name,
        "cuMemCreate"
            | "cuMemAddressReserve"
            | "cuMemHostAlloc"
            | "cuMemAlloc"
            | "cuMemAllocAsync"
            | "cuMemMap"
            | "cuMemImportFromShareableHandle"
            | "cuGraphInstantiateWithFlags"
            | "cuStreamCreate"
    )
}

struct Armed {
    fault: Fault,
    seen: usize,
    fired: bool,
}

struct ThreadState {
    armed: Vec<Armed>,
    fired: Vec<Fired>,
    /// Calls seen since [`arm`].
    visited: usize,
    recording: Option<Vec<Call>>,
}

thread_local! {
    static STATE: RefCell<ThreadState> = const {
        RefCell::new(ThreadState {
            armed: Vec::new(),
            fired: Vec::new(),
            visited: 0,
            recording: None,
        })
    };
}

/// Arms `faults` on this thread, replacing any armed before (and forgetting what fired).
pub fn arm(faults: &[Fault]) {
    STATE.with(|state| {
        let mut state = state.borrow_mut();
        state.armed = faults
            .iter()
            .map(|&fault| Armed {
                fault,
                seen: 0,
                fired: false,
            })
            .collect();
        state.fired.clear();
        state.visited = 0;
    });
}

/// Disarms this thread's faults; returns those that fired, in firing order.
pub fn disarm() -> Vec<Fired> {
    STATE.with(|state| {
        let mut state = state.borrow_mut();
        state.armed.clear();
        std::mem::take(&mut state.fired)
    })
}

/// Starts recording this thread's driver calls (dropping an unfinished recording).
pub fn start_recording() {
    STATE.with(|state| state.borrow_mut().recording = Some(Vec::new()));
}

/// Stops recording; returns the calls made since [`start_recording`], in order.
pub fn stop_recording() -> Vec<Call> {
    STATE.with(|state| state.borrow_mut().recording.take().unwrap_or_default())
}

/// Driver handles alive in the process, counted from the calls that made and released them.
/// Compare two readings taken when nothing is in flight: any difference is a leak (or, after a
/// fence failed in a `Drop`, the memory stablebuf kept on purpose rather than unmap under work).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Handles {
    /// `cuMemAddressReserve` minus `cuMemAddressFree`.
    pub reservations: i64,
    /// `cuMemCreate` and `cuMemImportFromShareableHandle` minus `cuMemRelease`.
    pub physical: i64,
    /// Bytes of those.
    pub physical_bytes: i64,
    /// `cuMemMap` minus `cuMemUnmap`.
    pub mappings: i64,
    /// `cuMemHostAlloc` minus `cuMemFreeHost`.
    pub pinned: i64,
    /// `cuMemAlloc` minus `cuMemFree`.
    pub linear: i64,
    /// `cuGraphInstantiateWithFlags` minus `cuGraphExecDestroy`.
    pub execs: i64,
}

const KINDS: usize = 7;
static LEDGER: [AtomicI64; KINDS] = [const { AtomicI64::new(0) }; KINDS];

/// What a successful call does to the ledger: `(kind, +1 or -1)`; physical memory also moves
/// its bytes.
fn ledger_effect(name: &str) -> Option<(usize, i64)> {
    Some(match name {
        "cuMemAddressReserve" => (0, 1),
        "cuMemAddressFree" => (0, -1),
        "cuMemCreate" | "cuMemImportFromShareableHandle" => (1, 1),
        "cuMemRelease" => (1, -1),
        "cuMemMap" => (3, 1),
        "cuMemUnmap" => (3, -1),
        "cuMemHostAlloc" => (4, 1),
        "cuMemFreeHost" => (4, -1),
        "cuMemAlloc" => (5, 1),
        "cuMemFree" => (5, -1),
        "cuGraphInstantiateWithFlags" => (6, 1),
        "cuGraphExecDestroy" => (6, -1),
        _ => return None,
    })
}

fn account(call: &Call) {
    if let Some((kind, sign)) = ledger_effect(call.name) {
        LEDGER[kind].fetch_add(sign, Ordering::SeqCst);
        if kind == 1 {
            LEDGER[2].fetch_add(sign * call.bytes as i64, Ordering::SeqCst);
        }
    }
}

/// The handles alive now (see [`Handles`]).
pub fn live_handles() -> Handles {
    let read = |kind: usize| LEDGER[kind].load(Ordering::SeqCst);
    Handles {
        reservations: read(0),
        physical: read(1),
        physical_bytes: read(2),
        mappings: read(3),
        pinned: read(4),
        linear: read(5),
        execs: read(6),
    }
}

impl ThreadState {
    /// Records `call` and returns the result it must fail with, if an armed fault picks it.
    fn visit(&mut self, call: Call) -> Option<CUresult> {
        if let Some(recording) = &mut self.recording {
            recording.push(call);
        }
        let index = self.visited;
        self.visited += 1;
        let mut injected = None;
        for armed in &mut self.armed {
            if armed.fired || armed.fault.name.is_some_and(|name| name != call.name) {
                continue;
            }
            if armed.seen == armed.fault.nth && injected.is_none() {
                armed.fired = true;
                injected = Some(armed.fault);
            }
            armed.seen += 1;
        }
        let fault = injected?;
        self.fired.push(Fired {
            fault,
            call,
            index,
            ran: runs_anyway(call.name),
        });
        Some(fault.result)
    }
}

/// The seam: makes `f` (the driver call `name`) unless a fault armed on this thread picks it.
pub(crate) fn intercept<T>(
    name: &'static str,
    bytes: usize,
    site: &'static Location<'static>,
    f: impl FnOnce() -> Result<T, DriverError>,
) -> Result<T, DriverError> {
    let call = Call { name, bytes, site };
    // `try_with`: a value dropped while this thread's locals are torn down is not injected.
    let injected = STATE
        .try_with(|state| state.borrow_mut().visit(call))
        .ok()
        .flatten();
    match injected {
        None => {
            let outcome = f();
            if outcome.is_ok() {
                account(&call);
            }
            outcome
        }
        Some(result) if runs_anyway(name) => {
            if f().is_ok() {
                account(&call);
            }
            Err(DriverError(result))
        }
        Some(result) => Err(DriverError(result)),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const OOM: CUresult = CUresult::CUDA_ERROR_OUT_OF_MEMORY;

    #[track_caller]
    fn call(name: &'static str, made: &mut Vec<&'static str>) -> Result<(), DriverError> {
        intercept(name, 4096, Location::caller(), || {
            made.push(name);
            Ok(())
        })
    }

    #[test]
    fn the_nth_call_of_a_name_fails_once_and_is_not_made() {
        let mut made = Vec::new();
        arm(&[Fault::nth("cuMemCreate", 1, OOM)]);
        start_recording();
        assert!(call("cuMemCreate", &mut made).is_ok());
        assert!(call("cuMemMap", &mut made).is_ok());
        assert_eq!(call("cuMemCreate", &mut made), Err(DriverError(OOM)));
        assert!(call("cuMemCreate", &mut made).is_ok(), "fires once");
        let fired = disarm();
        let recorded = stop_recording();
        assert_eq!(made, ["cuMemCreate", "cuMemMap", "cuMemCreate"]);
        assert_eq!(recorded.len(), 4, "failed calls are recorded too");
        assert_eq!(fired.len(), 1);
        assert_eq!(fired[0].call, recorded[2]);
        assert_eq!(fired[0].index, 2);
        assert!(!fired[0].ran);
        assert_ne!(
            recorded[0].site, recorded[1].site,
            "each line is its own site"
        );
    }

    #[test]
    fn any_call_counts_every_name_and_releases_still_run() {
        let mut made = Vec::new();
        let invalid = CUresult::CUDA_ERROR_INVALID_VALUE;
        arm(&[Fault::nth_call(1, invalid)]);
        assert!(call("cuMemMap", &mut made).is_ok());
        assert_eq!(call("cuMemUnmap", &mut made), Err(DriverError(invalid)));
        assert!(call("cuMemRelease", &mut made).is_ok());
        let fired = disarm();
        assert_eq!(made, ["cuMemMap", "cuMemUnmap", "cuMemRelease"]);
        assert!(fired[0].ran, "an unmap runs before its failure is reported");
        assert!(creates_memory("cuMemCreate") && !creates_memory("cuMemUnmap"));
    }

    #[test]
    fn faults_armed_on_one_thread_leave_other_threads_alone() {
        arm(&[Fault::nth_call(0, OOM)]);
        let other = std::thread::spawn(|| {
            let mut made = Vec::new();
            call("cuMemCreate", &mut made)
        })
        .join()
        .unwrap();
        assert!(other.is_ok());
        let mut made = Vec::new();
        assert!(call("cuMemCreate", &mut made).is_err());
        disarm();
    }

    #[test]
    fn the_ledger_counts_made_and_released_handles() {
        // Other tests run in parallel: compare this thread's own effect on a quiet kind only.
        let before = live_handles();
        let mut made = Vec::new();
        for _ in 0..3 {
            call("cuMemAlloc", &mut made).unwrap();
        }
        arm(&[Fault::nth("cuMemAlloc", 0, OOM)]);
        assert!(call("cuMemAlloc", &mut made).is_err());
        disarm();
        assert_eq!(
            live_handles().linear - before.linear,
            3,
            "a failed call makes nothing"
        );
        for _ in 0..3 {
            call("cuMemFree", &mut made).unwrap();
        }
        assert_eq!(live_handles().linear, before.linear);
    }
}
