//! NCCL registrations of the layer's tagged memory, kept current across pauses and resumes.
//!
//! `ncclCommRegister` records a range in the communicator's registration cache, and the first
//! collective that uses it retains the physical memory behind it (and, in one process driving
//! several GPUs, hands it to the peers). A pause releases that memory and a resume maps new
//! memory at the same addresses, so a registration made before a pause reads and writes the old
//! pages afterwards (`demo/nccl_register_pause.py`: every element wrong). NCCL takes its driver
//! functions from its own static runtime, so no pointer query of the layer reaches it: the layer
//! renews the registrations instead.
//!
//! A registration of a range that holds tagged memory gets a record and the caller a *proxy*
//! handle (an odd number: no real handle, a pointer from `malloc`, is odd). Before a pause
//! unmaps a tag, every registration in it is deregistered (the record is *suspended*); after
//! the resume has mapped and restored the tag, each one is registered again and the record
//! holds the new real handle. The caller's `ncclCommDeregister(proxy)` deregisters the current
//! real handle, or nothing while suspended. Registrations of any other memory pass straight
//! through (real handle, no record). This module is the bookkeeping, over [`RealNccl`], so the
//! tests run it against a fake NCCL; `hooks/layer.rs` holds it under a lock and calls it around
//! the engine's pause and resume.

use std::collections::BTreeMap;
use std::sync::Arc;

use crate::cuda::codes::nccl;

/// What the bookkeeping needs of NCCL: the real `ncclCommRegister` and `ncclCommDeregister`.
/// Communicators and handles are opaque numbers here.
pub trait RealNccl {
    /// The real handle, or the `ncclResult_t` the registration failed with.
    fn register(&self, comm: usize, buff: u64, size: usize) -> Result<usize, i32>;
    /// The `ncclResult_t` of deregistering a real handle.
    fn deregister(&self, comm: usize, handle: usize) -> i32;
}

/// The low bits every proxy handle has, and no real one: NCCL's handles are `malloc`ed
/// structures (16-byte aligned), or NULL.
const PROXY_BITS: usize = 0x5;
const PROXY_MASK: usize = 0xf;

/// Whether `handle` is one of the layer's proxy handles (live or not).
pub fn is_proxy(handle: usize) -> bool {
    handle & PROXY_MASK == PROXY_BITS
}

fn proxy_of(id: u64) -> usize {
    ((id as usize) << 4) | PROXY_BITS
}

/// One registration of tagged memory.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Record {
    pub comm: usize,
    pub buff: u64,
    pub size: usize,
    /// The tags of the layer's memory in the range: a pause of any of them suspends it.
    pub tags: Vec<Arc<str>>,
    /// The real handle while registered; `None` while suspended.
    pub real: Option<usize>,
    /// The last attempt to register it again failed with this `ncclResult_t` (it stays
    /// suspended and is tried again after the next pause or resume).
    pub failed: Option<i32>,
}

/// What `ncclCommRegister` gives the caller.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Registered {
    /// Not the layer's tagged memory (or NCCL registered nothing): NCCL's own handle.
    Real(usize),
    /// Tagged memory: a proxy handle, whose record the layer keeps current.
    Proxy(usize),
}

impl Registered {
    /// The handle to hand the caller.
    pub fn handle(self) -> usize {
        match self {
            Registered::Real(handle) | Registered::Proxy(handle) => handle,
        }
    }
}

/// Which step of keeping a registration current failed.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Step {
    /// Deregistering before a pause: NCCL keeps its registration (and the old pages).
    Deregister,
    /// Registering again after a resume: the buffer stays unregistered (NCCL then copies
    /// through its own buffers: right, slower).
    Register,
}

/// A failed step, for the notice and the log.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Failure {
    pub step: Step,
    pub comm: usize,
    pub buff: u64,
    pub size: usize,
    pub code: i32,
}

/// What one pass over the records did.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Report {
    pub deregistered: usize,
    pub registered: usize,
    pub failures: Vec<Failure>,
}

/// Every registration of tagged memory, by proxy handle.
#[derive(Debug, Default)]
pub struct Registrations {
    records: BTreeMap<usize, Record>,
    next_id: u64,
}

impl Registrations {
    pub fn new() -> Self {
        Self::default()
    }

    /// `ncclCommRegister(comm, buff, size)`. `tags` are the tags of the layer's memory in the
    /// range ([`crate::engine::Engine::tags_in`]); `paused` whether one of them is paused now.
    /// Outside tagged memory NCCL's answer is handed back as is. Inside, the caller gets a
    /// proxy; while a tag is paused the registration is only recorded (NCCL would fail on
    /// unmapped memory) and made at the resume. Errors are `ncclResult_t` codes.
    pub fn register(
        &mut self,
        real: &impl RealNccl,
        comm: usize,
        buff: u64,
        size: usize,
        tags: Vec<Arc<str>>,
        paused: bool,
    ) -> Result<Registered, i32> {
        if tags.is_empty() {
            return real.register(comm, buff, size).map(Registered::Real);
        }
        if comm == 0 {
            return Err(nccl::INVALID_ARGUMENT); // as NCCL's CommCheck says
        }
        let handle = if paused {
            None
        } else {
            match real.register(comm, buff, size)? {
                // NCCL registered nothing (local registration off, or memory it skips): there
                // is nothing to keep current, and NULL is what the caller must see.
                0 => return Ok(Registered::Real(0)),
                handle => Some(handle),
            }
        };
        self.next_id += 1;
        let proxy = proxy_of(self.next_id);
        self.records.insert(
            proxy,
            Record {
                comm,
                buff,
                size,
                tags,
                real: handle,
                failed: None,
            },
        );
        Ok(Registered::Proxy(proxy))
    }

    /// `ncclCommDeregister(comm, handle)`: a real handle goes to NCCL; a proxy deregisters its
    /// current real handle (nothing while suspended: success) and is forgotten. A proxy the
    /// layer does not know (deregistered already, or its communicator destroyed) is
    /// `ncclInvalidArgument`; one of another communicator `ncclInvalidUsage` (NCCL's answer for
    /// a handle it cannot find), and stays.
    pub fn deregister(&mut self, real: &impl RealNccl, comm: usize, handle: usize) -> i32 {
        if !is_proxy(handle) {
            return real.deregister(comm, handle);
        }
        let Some(record) = self.records.get(&handle) else {
            return nccl::INVALID_ARGUMENT;
        };
        if record.comm != comm {
            return nccl::INVALID_USAGE;
        }
        if let Some(current) = record.real {
            let code = real.deregister(comm, current);
            if code != nccl::SUCCESS {
                return code; // NCCL still holds it: the record stays, as NCCL's does
            }
        }
        self.records.remove(&handle);
        nccl::SUCCESS
    }

    /// Whether a pause of the tags `pausing` says yes to must deregister anything.
    pub fn any_registered_in(&self, pausing: impl Fn(&str) -> bool) -> bool {
        self.records
            .values()
            .any(|r| r.real.is_some() && r.tags.iter().any(|t| pausing(t)))
    }

    /// Before a pause: deregisters every registration in a tag about to be paused. A failure
    /// leaves that record registered (NCCL keeps the old pages: reported).
    pub fn before_pause(&mut self, real: &impl RealNccl, pausing: impl Fn(&str) -> bool) -> Report {
        let mut report = Report::default();
        for record in self.records.values_mut() {
            let Some(current) = record.real else {
                continue;
            };
            if !record.tags.iter().any(|t| pausing(t)) {
                continue;
            }
            match real.deregister(record.comm, current) {
                nccl::SUCCESS => {
                    record.real = None;
                    report.deregistered += 1;
                }
                code => report.failures.push(Failure {
                    step: Step::Deregister,
                    comm: record.comm,
                    buff: record.buff,
                    size: record.size,
                    code,
                }),
            }
        }
        report
    }

    /// After a pause or a resume (whether it succeeded or not): registers again every
    /// suspended registration none of whose tags is paused now. A failure leaves the record
    /// suspended, with the code, to be tried again next time.
    pub fn after_change(&mut self, real: &impl RealNccl, paused: impl Fn(&str) -> bool) -> Report {
        let mut report = Report::default();
        for record in self.records.values_mut() {
            if record.real.is_some() || record.tags.iter().any(|t| paused(t)) {
                continue;
            }
            match real.register(record.comm, record.buff, record.size) {
                Ok(handle) => {
                    record.real = Some(handle);
                    record.failed = None;
                    report.registered += 1;
                }
                Err(code) => {
                    record.failed = Some(code);
                    report.failures.push(Failure {
                        step: Step::Register,
                        comm: record.comm,
                        buff: record.buff,
                        size: record.size,
                        code,
                    });
                }
            }
        }
        report
    }

    /// `ncclCommDestroy`/`ncclCommAbort` of `comm`: forgets its records (NCCL releases its own
    /// registrations with the communicator; a record kept would be deregistered through a
    /// freed communicator at the next pause). Returns how many were dropped.
    pub fn forget_comm(&mut self, comm: usize) -> usize {
        let before = self.records.len();
        self.records.retain(|_, r| r.comm != comm);
        before - self.records.len()
    }

    /// Registrations kept (registered or suspended).
    pub fn len(&self) -> usize {
        self.records.len()
    }

    pub fn is_empty(&self) -> bool {
        self.records.is_empty()
    }

    /// Registrations suspended now (their tag is paused, or registering again failed).
    pub fn suspended(&self) -> usize {
        self.records.values().filter(|r| r.real.is_none()).count()
    }

    pub fn get(&self, proxy: usize) -> Option<&Record> {
        self.records.get(&proxy)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::cell::RefCell;

    /// NCCL as a log of calls: handles are 16-byte aligned numbers, as from `malloc`.
    #[derive(Default)]
    struct FakeNccl {
        calls: RefCell<Vec<String>>,
        next: RefCell<usize>,
        /// Codes the next registrations fail with, in order.
        fail_register: RefCell<Vec<i32>>,
        fail_deregister: RefCell<Vec<i32>>,
        /// Registrations NCCL skips (returns NULL for).
        skip: RefCell<bool>,
    }

    impl FakeNccl {
        fn take(&self) -> Vec<String> {
            std::mem::take(&mut *self.calls.borrow_mut())
        }
    }

    impl RealNccl for FakeNccl {
        fn register(&self, comm: usize, buff: u64, size: usize) -> Result<usize, i32> {
            self.calls
                .borrow_mut()
                .push(format!("register {comm:#x} {buff:#x} {size}"));
            let mut failing = self.fail_register.borrow_mut();
            if !failing.is_empty() {
                return Err(failing.remove(0));
            }
            drop(failing);
            if *self.skip.borrow() {
                return Ok(0);
            }
            let mut next = self.next.borrow_mut();
            *next += 1;
            Ok(0x5500_0000 + *next * 0x40)
        }

        fn deregister(&self, comm: usize, handle: usize) -> i32 {
            self.calls
                .borrow_mut()
                .push(format!("deregister {comm:#x} {handle:#x}"));
            let mut failing = self.fail_deregister.borrow_mut();
            if !failing.is_empty() {
                return failing.remove(0);
            }
            nccl::SUCCESS
        }
    }

    const COMM0: usize = 0xc000;
    const COMM1: usize = 0xc100;

    fn tags(names: &[&str]) -> Vec<Arc<str>> {
        names.iter().map(|n| Arc::from(*n)).collect()
    }

    fn proxy(registered: Registered) -> usize {
        match registered {
            Registered::Proxy(handle) => handle,
            other => panic!("expected a proxy, got {other:?}"),
        }
    }

    #[test]
    fn proxies_are_never_real_handles() {
        for id in 1..1000 {
            let p = proxy_of(id);
            assert!(is_proxy(p) && p != 0);
            assert_eq!(p % 2, 1, "odd: no malloc result");
        }
        for real in [0usize, 0x10, 0x5500_0040, 0x7f12_3456_7890] {
            assert!(!is_proxy(real), "{real:#x}");
        }
    }

    #[test]
    fn outside_tagged_memory_registration_passes_straight_through() {
        let nccl = FakeNccl::default();
        let mut book = Registrations::new();
        let got = book
            .register(&nccl, COMM0, 0x1000, 64, vec![], false)
            .unwrap();
        let Registered::Real(handle) = got else {
            panic!("{got:?}")
        };
        assert!(!is_proxy(handle));
        assert!(book.is_empty(), "no record");
        assert_eq!(book.deregister(&nccl, COMM0, handle), nccl::SUCCESS);
        assert_eq!(
            nccl.take(),
            vec![
                "register 0xc000 0x1000 64".to_string(),
                format!("deregister 0xc000 {handle:#x}")
            ]
        );
        // A failure of the real registration is NCCL's code, unchanged.
        nccl.fail_register
            .borrow_mut()
            .push(nccl::UNHANDLED_CUDA_ERROR);
        assert_eq!(
            book.register(&nccl, COMM0, 0x1000, 64, vec![], false),
            Err(nccl::UNHANDLED_CUDA_ERROR)
        );
    }

    #[test]
    fn inside_tagged_memory_the_caller_gets_a_proxy_that_deregisters_the_real_handle() {
        let nccl = FakeNccl::default();
        let mut book = Registrations::new();
        let p = proxy(
            book.register(&nccl, COMM0, 0x2000, 128, tags(&["w"]), false)
                .unwrap(),
        );
        assert!(is_proxy(p));
        let real = book.get(p).unwrap().real.unwrap();
        assert_eq!(nccl.take(), vec!["register 0xc000 0x2000 128"]);
        assert_eq!(
            book.deregister(&nccl, COMM1, p),
            nccl::INVALID_USAGE,
            "another comm"
        );
        assert_eq!(book.len(), 1, "kept");
        assert_eq!(book.deregister(&nccl, COMM0, p), nccl::SUCCESS);
        assert_eq!(nccl.take(), vec![format!("deregister 0xc000 {real:#x}")]);
        assert!(book.is_empty());
        assert_eq!(
            book.deregister(&nccl, COMM0, p),
            nccl::INVALID_ARGUMENT,
            "twice"
        );
        assert!(nccl.take().is_empty(), "a stale proxy never reaches NCCL");
    }

    #[test]
    fn a_failed_or_skipped_first_registration_keeps_no_record() {
        let nccl = FakeNccl::default();
        let mut book = Registrations::new();
        nccl.fail_register.borrow_mut().push(nccl::SYSTEM_ERROR);
        assert_eq!(
            book.register(&nccl, COMM0, 0x2000, 128, tags(&["w"]), false),
            Err(nccl::SYSTEM_ERROR)
        );
        *nccl.skip.borrow_mut() = true;
        assert_eq!(
            book.register(&nccl, COMM0, 0x2000, 128, tags(&["w"]), false),
            Ok(Registered::Real(0)),
            "NCCL skipped it: NULL, as without the layer"
        );
        assert!(book.is_empty());
        assert_eq!(
            book.register(&nccl, 0, 0x2000, 128, tags(&["w"]), false),
            Err(nccl::INVALID_ARGUMENT),
            "NULL communicator"
        );
    }

    #[test]
    fn a_pause_deregisters_and_the_resume_registers_again() {
        let nccl = FakeNccl::default();
        let mut book = Registrations::new();
        let send = proxy(
            book.register(&nccl, COMM0, 0x2000, 128, tags(&["w"]), false)
                .unwrap(),
        );
        let recv = proxy(
            book.register(&nccl, COMM0, 0x3000, 128, tags(&["w"]), false)
                .unwrap(),
        );
        let other = proxy(
            book.register(&nccl, COMM0, 0x4000, 64, tags(&["kv"]), false)
                .unwrap(),
        );
        let old = [send, recv, other].map(|p| book.get(p).unwrap().real.unwrap());
        nccl.take();

        assert!(book.any_registered_in(|t| t == "w"));
        assert!(!book.any_registered_in(|t| t == "nothing"));
        let report = book.before_pause(&nccl, |t| t == "w");
        assert_eq!((report.deregistered, report.failures.len()), (2, 0));
        assert_eq!(
            nccl.take(),
            vec![
                format!("deregister 0xc000 {:#x}", old[0]),
                format!("deregister 0xc000 {:#x}", old[1])
            ]
        );
        assert_eq!(book.suspended(), 2);
        assert_eq!(book.get(other).unwrap().real, Some(old[2]), "kv untouched");

        // While w is paused nothing is registered again.
        let report = book.after_change(&nccl, |t| t == "w");
        assert_eq!(report, Report::default());
        assert!(nccl.take().is_empty());

        let report = book.after_change(&nccl, |_| false);
        assert_eq!((report.registered, report.failures.len()), (2, 0));
        assert_eq!(
            nccl.take(),
            vec!["register 0xc000 0x2000 128", "register 0xc000 0x3000 128"]
        );
        let new = book.get(send).unwrap().real.unwrap();
        assert_ne!(new, old[0], "a new real handle behind the same proxy");
        assert_eq!(book.suspended(), 0);
        assert_eq!(book.deregister(&nccl, COMM0, send), nccl::SUCCESS);
        assert_eq!(nccl.take(), vec![format!("deregister 0xc000 {new:#x}")]);
    }

    #[test]
    fn deregistering_while_suspended_asks_nccl_nothing() {
        let nccl = FakeNccl::default();
        let mut book = Registrations::new();
        let p = proxy(
            book.register(&nccl, COMM0, 0x2000, 128, tags(&["w"]), false)
                .unwrap(),
        );
        book.before_pause(&nccl, |t| t == "w");
        nccl.take();
        assert_eq!(book.deregister(&nccl, COMM0, p), nccl::SUCCESS);
        assert!(nccl.take().is_empty());
        assert!(book.is_empty());
        assert_eq!(
            book.after_change(&nccl, |_| false),
            Report::default(),
            "gone for good"
        );
    }

    #[test]
    fn registering_while_paused_is_recorded_and_made_at_the_resume() {
        let nccl = FakeNccl::default();
        let mut book = Registrations::new();
        let p = proxy(
            book.register(&nccl, COMM0, 0x2000, 128, tags(&["w"]), true)
                .unwrap(),
        );
        assert!(
            nccl.take().is_empty(),
            "NCCL is not asked about unmapped memory"
        );
        assert_eq!(book.suspended(), 1);
        assert_eq!(book.after_change(&nccl, |_| false).registered, 1);
        assert!(book.get(p).unwrap().real.is_some());
    }

    #[test]
    fn a_failed_registration_after_the_resume_stays_suspended_and_deregisters_cleanly() {
        let nccl = FakeNccl::default();
        let mut book = Registrations::new();
        let p = proxy(
            book.register(&nccl, COMM0, 0x2000, 128, tags(&["w"]), false)
                .unwrap(),
        );
        book.before_pause(&nccl, |t| t == "w");
        nccl.fail_register
            .borrow_mut()
            .push(nccl::UNHANDLED_CUDA_ERROR);
        let report = book.after_change(&nccl, |_| false);
        assert_eq!(report.registered, 0);
        assert_eq!(
            report.failures,
            vec![Failure {
                step: Step::Register,
                comm: COMM0,
                buff: 0x2000,
                size: 128,
                code: nccl::UNHANDLED_CUDA_ERROR
            }]
        );
        let record = book.get(p).unwrap();
        assert_eq!(
            (record.real, record.failed),
            (None, Some(nccl::UNHANDLED_CUDA_ERROR))
        );
        nccl.take();
        assert_eq!(book.deregister(&nccl, COMM0, p), nccl::SUCCESS);
        assert!(
            nccl.take().is_empty(),
            "nothing registered: nothing to deregister"
        );
        assert!(book.is_empty());
    }

    #[test]
    fn a_failed_registration_is_tried_again_after_the_next_change() {
        let nccl = FakeNccl::default();
        let mut book = Registrations::new();
        let p = proxy(
            book.register(&nccl, COMM0, 0x2000, 128, tags(&["w"]), false)
                .unwrap(),
        );
        book.before_pause(&nccl, |_| true);
        nccl.fail_register.borrow_mut().push(nccl::SYSTEM_ERROR);
        assert_eq!(book.after_change(&nccl, |_| false).failures.len(), 1);
        let retried = book.after_change(&nccl, |_| false);
        assert_eq!((retried.registered, retried.failures.len()), (1, 0));
        let record = book.get(p).unwrap();
        assert!(record.real.is_some() && record.failed.is_none());
    }

    #[test]
    fn a_failed_deregistration_before_a_pause_keeps_the_record_registered() {
        let nccl = FakeNccl::default();
        let mut book = Registrations::new();
        let p = proxy(
            book.register(&nccl, COMM0, 0x2000, 128, tags(&["w"]), false)
                .unwrap(),
        );
        let real = book.get(p).unwrap().real;
        nccl.fail_deregister.borrow_mut().push(nccl::INVALID_USAGE);
        let report = book.before_pause(&nccl, |_| true);
        assert_eq!(report.deregistered, 0);
        assert_eq!(report.failures[0].step, Step::Deregister);
        assert_eq!(book.get(p).unwrap().real, real);
        assert_eq!(
            book.after_change(&nccl, |_| false).registered,
            0,
            "not suspended"
        );
    }

    #[test]
    fn two_communicators_on_one_buffer_are_renewed_each_with_its_own() {
        let nccl = FakeNccl::default();
        let mut book = Registrations::new();
        let a = proxy(
            book.register(&nccl, COMM0, 0x2000, 128, tags(&["w"]), false)
                .unwrap(),
        );
        let b = proxy(
            book.register(&nccl, COMM1, 0x2000, 128, tags(&["w"]), false)
                .unwrap(),
        );
        assert_ne!(a, b);
        let (ra, rb) = (
            book.get(a).unwrap().real.unwrap(),
            book.get(b).unwrap().real.unwrap(),
        );
        nccl.take();
        assert_eq!(book.before_pause(&nccl, |t| t == "w").deregistered, 2);
        assert_eq!(
            nccl.take(),
            vec![
                format!("deregister {COMM0:#x} {ra:#x}"),
                format!("deregister {COMM1:#x} {rb:#x}")
            ]
        );
        assert_eq!(book.after_change(&nccl, |_| false).registered, 2);
        assert_eq!(
            nccl.take(),
            vec!["register 0xc000 0x2000 128", "register 0xc100 0x2000 128"]
        );
        assert_eq!(book.deregister(&nccl, COMM1, b), nccl::SUCCESS);
        assert_eq!(book.len(), 1, "a's registration stays");
        assert_eq!(book.get(a).unwrap().comm, COMM0);
    }

    #[test]
    fn a_range_over_two_tags_waits_for_both() {
        let nccl = FakeNccl::default();
        let mut book = Registrations::new();
        let p = proxy(
            book.register(&nccl, COMM0, 0x2000, 4096, tags(&["a", "b"]), false)
                .unwrap(),
        );
        assert_eq!(book.before_pause(&nccl, |t| t == "b").deregistered, 1);
        assert_eq!(
            book.after_change(&nccl, |t| t == "a").registered,
            0,
            "a is paused now"
        );
        assert!(book.get(p).unwrap().real.is_none());
        assert_eq!(book.after_change(&nccl, |_| false).registered, 1);
    }

    #[test]
    fn destroying_a_communicator_drops_its_records_only() {
        let nccl = FakeNccl::default();
        let mut book = Registrations::new();
        let a = proxy(
            book.register(&nccl, COMM0, 0x2000, 128, tags(&["w"]), false)
                .unwrap(),
        );
        let b = proxy(
            book.register(&nccl, COMM1, 0x2000, 128, tags(&["w"]), false)
                .unwrap(),
        );
        nccl.take();
        assert_eq!(book.forget_comm(COMM0), 1);
        assert!(
            nccl.take().is_empty(),
            "NCCL releases its own registrations at the end"
        );
        assert!(book.get(a).is_none() && book.get(b).is_some());
        assert_eq!(book.before_pause(&nccl, |_| true).deregistered, 1, "only b");
        assert_eq!(
            book.deregister(&nccl, COMM0, a),
            nccl::INVALID_ARGUMENT,
            "the destroyed communicator's proxy"
        );
        assert_eq!(book.forget_comm(0xdead), 0);
    }
}
