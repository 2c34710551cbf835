//! The process-wide layer: configuration, mode, the engine (vmm) or the monitor log, fork and
//! re-entrancy guards, and what happens at exit. Safe Rust; `ffi.rs` calls into it.

use std::cell::Cell;
use std::collections::BTreeSet;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, MutexGuard, OnceLock, PoisonError};
use std::time::{Duration, Instant};

use tracing_subscriber::filter::Targets;
use tracing_subscriber::layer::SubscriberExt;

use crate::cuda::codes::Fail;
use crate::cuda::notice::notice_once;
use crate::cuda::real;
use crate::engine::gpu::{GpuDevice, GpuOptions, HostSlot};
use crate::engine::monitor::{merge_events, MonitorLog};
use crate::engine::nccl::{RealNccl, Registered, Registrations, Report, Step};
use crate::engine::query::Allocation;
use crate::engine::stats::{Counters, StablebufStats, ABI_VERSION};
use crate::engine::tags;
use crate::engine::{Copied, CopyCall, Engine, Freed};
use crate::hooks::env::{self, Config, Mode, NcclRegister};

/// Monitor mode keeps this many allocation records for the timeline.
const MONITOR_RECORDS: usize = 1 << 18;

pub struct Layer {
    pub config: Config,
    started: Instant,
    pid: u32,
    pub counters: Arc<Counters>,
    engine: Option<Engine<GpuDevice>>,
    monitor: Option<Mutex<MonitorLog>>,
    /// Tag names set outside vmm mode (kept so a tag stays one shared string).
    names: Mutex<BTreeSet<Arc<str>>>,
    /// Calls inside the engine or monitor right now (the exit handler waits for 0).
    busy: AtomicUsize,
    /// NCCL registrations of tagged memory (vmm), renewed around pauses. Lock order: this,
    /// then the engine's locks (the engine never takes this one).
    nccl: Mutex<Registrations>,
}

/// The real libnccl, for the registration book.
struct LibNccl;

impl RealNccl for LibNccl {
    fn register(&self, comm: usize, buff: u64, size: usize) -> Result<usize, i32> {
        real::nccl_register(comm, buff, size)
    }

    fn deregister(&self, comm: usize, handle: usize) -> i32 {
        real::nccl_deregister(comm, handle)
    }
}

static LAYER: OnceLock<Layer> = OnceLock::new();
static FORKED: AtomicBool = AtomicBool::new(false);

fn lock<T>(mutex: &Mutex<T>) -> MutexGuard<'_, T> {
    mutex.lock().unwrap_or_else(PoisonError::into_inner)
}

/// The layer, set up from the environment on first use (normally at load time).
pub fn layer() -> &'static Layer {
    LAYER.get_or_init(Layer::from_env)
}

/// Called once at load time: reads the environment, starts logging, prints help.
pub fn init() {
    let _ = layer();
}

/// Marks this process as a child after `fork` (called by the `pthread_atfork` child handler).
pub fn forked() {
    FORKED.store(true, Ordering::SeqCst);
}

fn in_child() -> bool {
    FORKED.load(Ordering::Relaxed) || LAYER.get().is_some_and(|l| l.pid != std::process::id())
}

thread_local! {
    static INSIDE: Cell<bool> = const { Cell::new(false) };
}

/// Marks this thread as inside the layer: hooks called meanwhile (by the layer itself, or by
/// CUDA calling back into exported symbols) pass straight through.
pub struct Inside(());

impl Inside {
    /// `None` if this thread is inside already (or its thread-local storage is gone).
    pub fn enter() -> Option<Inside> {
        INSIDE
            .try_with(|inside| !inside.replace(true))
            .ok()
            .filter(|&entered| entered)
            .map(|_| Inside(()))
    }
}

impl Drop for Inside {
    fn drop(&mut self) {
        let _ = INSIDE.try_with(|inside| inside.set(false));
    }
}

/// Where a hooked call goes.
pub enum Route {
    /// Straight to CUDA (layer off, nested call, child after fork).
    Pass,
    Monitor(&'static Layer),
    Vmm(&'static Layer, &'static Engine<GpuDevice>),
}

pub fn route() -> Route {
    if in_child() {
        return Route::Pass;
    }
    let layer = layer();
    match (layer.config.mode, &layer.engine, &layer.monitor) {
        (Mode::Vmm, Some(engine), _) => Route::Vmm(layer, engine),
        (Mode::Monitor, _, Some(_)) => Route::Monitor(layer),
        _ => Route::Pass,
    }
}

/// Whether copy elision is on (decides whether flush points do anything). On the hot path of
/// every launch: one atomic load past the configuration, no system call.
pub fn eliding() -> bool {
    LAYER.get().is_some_and(|l| l.config.eliding()) && !FORKED.load(Ordering::Relaxed)
}

/// Counts a call as busy inside the layer for its lifetime.
struct Busy<'a>(&'a AtomicUsize);

impl<'a> Busy<'a> {
    fn new(counter: &'a AtomicUsize) -> Self {
        counter.fetch_add(1, Ordering::SeqCst);
        Busy(counter)
    }
}

impl Drop for Busy<'_> {
    fn drop(&mut self) {
        self.0.fetch_sub(1, Ordering::SeqCst);
    }
}

/// Which entry point an allocation came through (for counters and the monitor log).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Api {
    Runtime,
    Driver,
}

impl Layer {
    fn from_env() -> Layer {
        let (config, warnings) = Config::from_lookup(|name| std::env::var(name).ok());
        start_logging(config.log.as_deref());
        for warning in &warnings {
            eprintln!("stablebuf-preload: {warning}");
        }
        if config.help {
            eprint!("{}", env::help_text());
        }
        let started = Instant::now();
        let counters = Arc::new(Counters::default());
        let engine = (config.mode == Mode::Vmm).then(|| {
            let options = GpuOptions {
                budget: config.budget,
                stitching: config.stitching,
                drain_on_oom: config.drain_on_oom,
                origin: started,
            };
            let host = Arc::new(HostSlot::new(config.host_arena));
            Engine::new(
                move |ordinal| GpuDevice::open(ordinal, &options, host.clone()),
                config.elide_copies,
                config.elide_min,
                counters.clone(),
            )
        });
        let monitor =
            (config.mode == Mode::Monitor).then(|| Mutex::new(MonitorLog::new(MONITOR_RECORDS)));
        tracing::debug!(
            mode = config.mode.name(),
            nccl_register = config.nccl_register.name(),
            "stablebuf-preload loaded"
        );
        Layer {
            config,
            started,
            pid: std::process::id(),
            counters,
            engine,
            monitor,
            names: Mutex::new(BTreeSet::new()),
            busy: AtomicUsize::new(0),
            nccl: Mutex::new(Registrations::new()),
        }
    }

    fn now(&self) -> Duration {
        self.started.elapsed()
    }

    // ---- allocations ----------------------------------------------------------------------

    fn count_alloc(&self, api: Api) {
        Counters::bump(match api {
            Api::Runtime => &self.counters.runtime_allocs,
            Api::Driver => &self.counters.driver_allocs,
        });
    }

    /// vmm: allocates `bytes` on the caller's current device, under this thread's tag.
    pub fn vmm_alloc(
        &self,
        engine: &Engine<GpuDevice>,
        api: Api,
        call: &'static str,
        bytes: usize,
    ) -> Result<u64, Fail> {
        let _busy = Busy::new(&self.busy);
        let _context = real::ContextGuard::save();
        self.count_alloc(api);
        let device = match api {
            Api::Runtime => real::current_device()?,
            Api::Driver => real::driver_current_device()?,
        };
        let tag = tags::current();
        if tag.is_none() && engine.would_hold(bytes) {
            // A held allocation faults if a library's unseen launch touches it first.
            self.check_unseen_launchers(engine);
        }
        let result = engine.alloc(device, bytes, tag.clone());
        match &result {
            Ok(address) => tracing::debug!(
                call,
                device,
                bytes,
                address,
                tag = tag.as_deref(),
                "allocated"
            ),
            Err(fail) => {
                tracing::warn!(call, device, bytes, tag = tag.as_deref(), %fail, "allocation failed")
            }
        }
        result
    }

    /// vmm: frees `address` if the layer owns it.
    pub fn vmm_free(
        &self,
        engine: &Engine<GpuDevice>,
        call: &'static str,
        address: u64,
    ) -> Result<Freed, Fail> {
        let _busy = Busy::new(&self.busy);
        let _context = real::ContextGuard::save();
        let result = engine.free(address);
        match &result {
            Ok(Freed::NotOwned) => Counters::bump(&self.counters.foreign_frees),
            Ok(Freed::Done) => {}
            Err(fail) => tracing::warn!(call, address, %fail, "free failed"),
        }
        result
    }

    /// Whether the layer owns `address` (vmm).
    pub fn owns(&self, address: u64) -> bool {
        self.engine.as_ref().is_some_and(|e| e.owns(address))
    }

    /// vmm: the allocation `address` lies in, settled for a pointer query
    /// ([`Engine::settle`]: mapped, deferred copies performed). `Ok(None)`: not the layer's.
    pub fn settle(
        &self,
        engine: &Engine<GpuDevice>,
        call: &'static str,
        address: u64,
    ) -> Result<Option<Allocation>, Fail> {
        let _busy = Busy::new(&self.busy);
        let _context = real::ContextGuard::save();
        engine.settle(address).inspect_err(|fail| {
            tracing::error!(call, address, %fail, "making the layer's memory ready for a pointer query failed")
        })
    }

    /// monitor: an allocation went through.
    pub fn monitor_alloc(&self, api: Api, call: &'static str, address: u64, bytes: usize) {
        let Some(monitor) = &self.monitor else {
            return;
        };
        let _busy = Busy::new(&self.busy);
        self.count_alloc(api);
        let at = self.now();
        lock(monitor).alloc(at, call, address, bytes);
        tracing::info!(target: "stablebuf_preload::engine::monitor", call, address = format_args!("{address:#x}"),
            bytes, at_us = at.as_micros() as u64, "alloc");
    }

    /// monitor: a free went through.
    pub fn monitor_free(&self, call: &'static str, address: u64) {
        let Some(monitor) = &self.monitor else {
            return;
        };
        let _busy = Busy::new(&self.busy);
        let at = self.now();
        let bytes = lock(monitor).free(at, call, address);
        Counters::bump(if bytes.is_some() {
            &self.counters.frees
        } else {
            &self.counters.foreign_frees
        });
        tracing::info!(target: "stablebuf_preload::engine::monitor", call, address = format_args!("{address:#x}"),
            bytes, at_us = at.as_micros() as u64, "free");
    }

    /// Adds the pool's cached bytes of `device` to a free-memory figure (vmm).
    pub fn pool_view_of_free(&self, free: usize, api: Api) -> usize {
        let Some(engine) = &self.engine else {
            return free;
        };
        let device = match api {
            Api::Runtime => real::current_device(),
            Api::Driver => real::driver_current_device(),
        };
        free + device.map_or(0, |d| engine.cached(d))
    }

    // ---- copy elision -------------------------------------------------------------------

    /// vmm with elision: decides about a copy.
    pub fn copy(&self, engine: &Engine<GpuDevice>, call: CopyCall) -> Result<Copied, Fail> {
        let _busy = Busy::new(&self.busy);
        let _context = real::ContextGuard::save();
        if call.device_to_device && !engine.unsure() {
            self.check_unseen_launchers(engine);
        }
        engine.copy(call)
    }

    /// Stops elision for good if a library that launches GPU work outside the hooks is
    /// loaded (rescans only when objects were loaded since the last look).
    fn check_unseen_launchers(&self, engine: &Engine<GpuDevice>) {
        if let Some((path, fragment)) = real::unseen_launcher_loaded() {
            self.stop_eliding_with(
                engine,
                &format!(
                    "{path} is loaded ({fragment}*: a library that launches GPU work the layer \
                     cannot see)"
                ),
            );
        }
    }

    /// Copy elision stops for good: pending copies are performed now, none is deferred
    /// again. Said once on stderr (with the reason), whatever the log filter.
    pub fn stop_eliding(&self, why: &str) {
        let Some(engine) = &self.engine else {
            return;
        };
        if !engine.eliding() || engine.unsure() {
            return;
        }
        let _busy = Busy::new(&self.busy);
        let _context = real::ContextGuard::save();
        self.stop_eliding_with(engine, why);
    }

    fn stop_eliding_with(&self, engine: &Engine<GpuDevice>, why: &str) {
        match engine.stop_eliding() {
            Ok(true) => notice_once(
                "elision-off",
                &format!(
                    "stablebuf-preload: copy elision is off from now on (copies are performed): \
                     {why}"
                ),
            ),
            Ok(false) => {}
            Err(fail) => {
                tracing::error!(%fail, "performing deferred copies when stopping elision failed")
            }
        }
    }

    /// A flush point: performs deferred copies. Failures are logged (the call itself goes on).
    pub fn flush_point(&self, call: &'static str) {
        let Some(engine) = &self.engine else {
            return;
        };
        if !engine.touch() {
            return;
        }
        let _busy = Busy::new(&self.busy);
        let _context = real::ContextGuard::save();
        if let Err(fail) = engine.flush() {
            tracing::error!(call, %fail, "performing deferred copies before this call failed");
        }
    }

    // ---- tags, pause, resume ------------------------------------------------------------

    /// Sets this thread's tag (`None`: untagged).
    pub fn set_tag(&self, tag: Option<&str>) {
        let name = tag.map(|tag| match &self.engine {
            Some(engine) => engine.register_tag(tag),
            None => {
                let mut names = lock(&self.names);
                match names.get(tag) {
                    Some(name) => name.clone(),
                    None => {
                        let name: Arc<str> = Arc::from(tag);
                        names.insert(name.clone());
                        name
                    }
                }
            }
        });
        tags::set_current(name);
    }

    fn vmm(&self) -> Result<&Engine<GpuDevice>, Fail> {
        if in_child() {
            return Err(Fail::Forked);
        }
        self.engine.as_ref().ok_or(Fail::NotVmm)
    }

    pub fn pause(&self, tag: Option<&str>, keep: bool) -> Result<(), Fail> {
        let engine = self.vmm()?;
        let _busy = Busy::new(&self.busy);
        let _context = real::ContextGuard::save();
        // Held for the whole pause: a registration meanwhile waits, then sees the tag paused.
        let mut book = lock(&self.nccl);
        if !book.is_empty() {
            let pausing = engine.tags_to_pause(tag)?;
            let pausing = |t: &str| pausing.iter().any(|p| &**p == t);
            if book.any_registered_in(pausing) {
                // A collective still running may read a registered buffer through a peer's
                // mapping, which the deregistration takes away: wait for every device first
                // (the pause itself waits only for the tag's devices, and only afterwards).
                if let Err(fail) = real::synchronize_active_devices() {
                    tracing::warn!(%fail, "waiting for the devices before deregistering NCCL buffers failed; deregistering anyway");
                }
                let report = book.before_pause(&LibNccl, pausing);
                self.nccl_reported("before the pause", &report);
            }
        }
        let result = engine.pause(tag, keep);
        // Tags that did not end up paused (a device failed) get their registrations back.
        self.nccl_renew(engine, &mut book, "after the pause");
        drop(book);
        let transfer = result?;
        tracing::info!(
            tag,
            keep,
            bytes = transfer.bytes,
            copied = transfer.copied,
            ms = transfer.elapsed.as_secs_f64() * 1e3,
            "paused"
        );
        Ok(())
    }

    pub fn resume(&self, tag: Option<&str>) -> Result<(), Fail> {
        let engine = self.vmm()?;
        let _busy = Busy::new(&self.busy);
        let _context = real::ContextGuard::save();
        let mut book = lock(&self.nccl);
        let result = engine.resume(tag);
        // The memory is mapped and restored: registrations of every awake tag are made again
        // (also after a failed resume: tags that did wake get theirs).
        self.nccl_renew(engine, &mut book, "after the resume");
        drop(book);
        let transfer = result?;
        tracing::info!(
            tag,
            bytes = transfer.bytes,
            copied = transfer.copied,
            ms = transfer.elapsed.as_secs_f64() * 1e3,
            "resumed"
        );
        Ok(())
    }

    // ---- NCCL registrations ---------------------------------------------------------------

    /// vmm: `ncclCommRegister(comm, buff, size)`. Tagged memory gets a proxy handle whose
    /// registration is renewed around pauses; any other range is registered as is. Errors are
    /// `ncclResult_t` codes.
    pub fn nccl_register(
        &self,
        engine: &Engine<GpuDevice>,
        comm: usize,
        buff: u64,
        size: usize,
    ) -> Result<usize, i32> {
        let _busy = Busy::new(&self.busy);
        let mut book = lock(&self.nccl);
        let (tags, paused) = {
            let _context = real::ContextGuard::save();
            // NCCL is about to ask the driver about this memory: make it ready, as a pointer
            // query does (a held allocation mapped, deferred copies performed).
            if let Err(fail) = engine.settle(buff) {
                tracing::warn!(%fail, buff, "making memory ready for ncclCommRegister failed");
            }
            let tags = engine.tags_in(buff, size);
            let paused_now = engine.paused_tags();
            let paused = tags.iter().any(|t| paused_now.contains(t));
            (tags, paused)
        };
        if self.config.nccl_register == NcclRegister::Skip && !tags.is_empty() {
            // NCCL's own answer for a registration it skips: NCCL copies through its buffers.
            tracing::debug!(
                comm,
                buff,
                size,
                "ncclCommRegister of tagged memory skipped"
            );
            return Ok(0);
        }
        let result = book.register(&LibNccl, comm, buff, size, tags, paused);
        match &result {
            Ok(Registered::Proxy(proxy)) => tracing::debug!(
                comm,
                buff,
                size,
                proxy,
                suspended = paused,
                "ncclCommRegister of tagged memory: kept current across pauses"
            ),
            Ok(Registered::Real(_)) => {}
            Err(code) => tracing::warn!(comm, buff, size, code, "ncclCommRegister failed"),
        }
        self.nccl_publish(&book);
        result.map(Registered::handle)
    }

    /// vmm: `ncclCommDeregister(comm, proxy)` of a proxy handle (a real one goes straight to
    /// NCCL): the current real registration, or nothing while suspended.
    pub fn nccl_deregister(&self, comm: usize, handle: usize) -> i32 {
        let _busy = Busy::new(&self.busy);
        let mut book = lock(&self.nccl);
        let code = book.deregister(&LibNccl, comm, handle);
        if code != 0 {
            tracing::warn!(
                comm,
                handle,
                code,
                "ncclCommDeregister of a proxy handle failed"
            );
        }
        self.nccl_publish(&book);
        code
    }

    /// vmm: `comm` is being destroyed or aborted: its records go (NCCL drops its own
    /// registrations with the communicator).
    pub fn nccl_forget(&self, comm: usize, call: &'static str) {
        let _busy = Busy::new(&self.busy);
        let mut book = lock(&self.nccl);
        let dropped = book.forget_comm(comm);
        if dropped > 0 {
            tracing::debug!(
                call,
                comm,
                dropped,
                "dropped the communicator's NCCL registrations"
            );
        }
        self.nccl_publish(&book);
    }

    /// Registers again what a pause or resume left suspended in awake tags.
    fn nccl_renew(&self, engine: &Engine<GpuDevice>, book: &mut Registrations, when: &str) {
        if book.suspended() == 0 {
            return;
        }
        let paused = engine.paused_tags();
        let report = book.after_change(&LibNccl, |t| paused.contains(t));
        self.nccl_reported(when, &report);
        self.nccl_publish(book);
    }

    fn nccl_reported(&self, when: &str, report: &Report) {
        Counters::add(
            &self.counters.nccl_reregistrations,
            report.registered as u64,
        );
        Counters::add(&self.counters.nccl_failures, report.failures.len() as u64);
        if report.deregistered + report.registered > 0 {
            tracing::info!(
                when,
                deregistered = report.deregistered,
                registered = report.registered,
                "NCCL registrations of tagged memory renewed"
            );
        }
        for failure in &report.failures {
            let what = match failure.step {
                Step::Deregister => "deregistering it before the pause failed: NCCL keeps the old pages and may give wrong results after the resume; deregister it yourself before pausing",
                Step::Register => "registering it again after the resume failed: it stays unregistered (NCCL copies through its own buffers: right, slower), is tried again after the next pause or resume, and ncclCommDeregister of it succeeds",
            };
            let text = format!(
                "stablebuf-preload: NCCL registration of {:#x} ({} bytes, communicator {:#x}) {when}: {what} (ncclResult_t {})",
                failure.buff, failure.size, failure.comm, failure.code
            );
            tracing::warn!("{text}");
            notice_once("nccl-renew", &text);
        }
    }

    fn nccl_publish(&self, book: &Registrations) {
        Counters::set(&self.counters.nccl_registrations, book.len() as u64);
        Counters::set(&self.counters.nccl_suspended, book.suspended() as u64);
    }

    pub fn reserve_host(&self, bytes: usize) -> Result<(), Fail> {
        let engine = self.vmm()?;
        let _busy = Busy::new(&self.busy);
        let _context = real::ContextGuard::save();
        let device = real::current_device().or_else(|_| real::driver_current_device())?;
        engine.reserve_host(device, bytes)
    }

    // ---- statistics and exit ------------------------------------------------------------

    pub fn stats(&self) -> StablebufStats {
        let mut stats = StablebufStats {
            abi_version: ABI_VERSION,
            mode: if in_child() {
                0
            } else {
                self.config.mode.code()
            },
            ..StablebufStats::default()
        }
        .with_counters(&self.counters);
        if in_child() {
            // The parent's pool and log are not this process's: counters only, no locks.
            return stats;
        }
        if let Some(engine) = &self.engine {
            let view = engine.view();
            stats.live_allocations = view.live_allocations as u64;
            stats.live_bytes = view.live_bytes as u64;
            stats.tags = view.tags as u64;
            stats.tags_paused = view.tags_paused as u64;
            stats.tagged_bytes = view.tagged_bytes as u64;
            stats.host_bytes = view.host_bytes as u64;
            stats.host_arena_bytes = view.host_arena_bytes as u64;
            stats.pool_mapped = view.pool.mapped as u64;
            stats.pool_cached = view.pool.cached as u64;
            stats.pool_peak_mapped = view.pool.peak_mapped as u64;
            stats.pool_mappings = view.pool.mappings as u64;
            stats.pool_creates = view.pool.creates;
            stats.pool_reuses = view.pool.reuses;
            stats.pool_stitched = view.pool.stitched;
            stats.pool_drains = view.pool.drains;
        }
        if let Some(monitor) = &self.monitor {
            let (count, bytes) = lock(monitor).live();
            stats.live_allocations = count as u64;
            stats.live_bytes = bytes as u64;
        }
        stats
    }

    /// At exit: the summary line and the timeline, from recorded events only (no CUDA call: the
    /// runtime may have torn its context down). Skipped if another thread is still inside the
    /// layer after a short wait, rather than risk waiting on its locks forever.
    pub fn at_exit(&self) {
        if in_child() || self.config.mode == Mode::Off {
            return;
        }
        let deadline = Instant::now() + Duration::from_millis(200);
        while self.busy.load(Ordering::SeqCst) > 0 {
            if Instant::now() > deadline {
                eprintln!(
                    "stablebuf-preload: another thread is inside the layer at exit; no summary"
                );
                return;
            }
            std::thread::sleep(Duration::from_millis(5));
        }
        let (summary, events) = match self.config.mode {
            Mode::Monitor => {
                let Some(monitor) = &self.monitor else { return };
                let Ok(log) = monitor.try_lock() else { return };
                if log.calls().is_empty() {
                    return; // a process that never allocated (a shell, a helper): say nothing
                }
                (vec![log.summary()], log.events())
            }
            Mode::Vmm => {
                let Some(engine) = &self.engine else { return };
                let stats = self.stats();
                if stats.runtime_allocs + stats.driver_allocs + stats.tags == 0 {
                    return;
                }
                let mut lines = vec![vmm_summary(&stats)];
                lines.extend(engine.try_summary().unwrap_or_default());
                let events = merge_events(engine.try_events().unwrap_or_default());
                (lines, events)
            }
            Mode::Off => return,
        };
        for line in &summary {
            eprintln!("{line}");
        }
        if let Some(path) = self.config.timeline_path(self.pid) {
            let title = format!(
                "stablebuf-preload ({}) pid {}",
                self.config.mode.name(),
                self.pid
            );
            match stablebuf::pool::timeline::write_svg(&events, &title, &path) {
                Ok(()) => eprintln!("stablebuf-preload: timeline written to {}", path.display()),
                Err(error) => eprintln!(
                    "stablebuf-preload: could not write the timeline to {}: {error}",
                    path.display()
                ),
            }
        }
    }
}

/// The one-line vmm summary.
pub fn vmm_summary(stats: &StablebufStats) -> String {
    use stablebuf::pool::human_bytes;
    let b = |n: u64| human_bytes(n as usize);
    format!(
        "stablebuf-preload vmm: {} allocations ({} runtime, {} driver), {} frees, {} foreign \
         frees passed on, {} out-of-memory answers; live {} in {}; pool mapped {} (peak {}), \
         cached {}, {} stitched, {} drains; copies deferred {}, elided {} ({}), performed {}, \
         cancelled {}; tags {} ({} paused), {} pauses, {} resumes; entry points hooked {}, IPC \
         refusals {}",
        stats.runtime_allocs + stats.driver_allocs,
        stats.runtime_allocs,
        stats.driver_allocs,
        stats.frees,
        stats.foreign_frees,
        stats.oom_errors,
        b(stats.live_bytes),
        stats.live_allocations,
        b(stats.pool_mapped),
        b(stats.pool_peak_mapped),
        b(stats.pool_cached),
        stats.pool_stitched,
        stats.pool_drains,
        stats.copies_deferred,
        stats.copies_elided,
        b(stats.bytes_elided),
        stats.copies_performed,
        stats.copies_cancelled,
        stats.tags,
        stats.tags_paused,
        stats.pauses,
        stats.resumes,
        stats.entry_points,
        stats.ipc_refusals,
    ) + &nccl_summary(stats)
}

/// The NCCL part of the summary: only where registrations of tagged memory were seen.
fn nccl_summary(stats: &StablebufStats) -> String {
    if stats.nccl_registrations + stats.nccl_reregistrations + stats.nccl_failures == 0 {
        return String::new();
    }
    format!(
        "; NCCL registrations of tagged memory {} ({} suspended), {} made again after resumes, {} failures",
        stats.nccl_registrations,
        stats.nccl_suspended,
        stats.nccl_reregistrations,
        stats.nccl_failures,
    )
}

fn start_logging(filter: Option<&str>) {
    let Some(filter) = filter else {
        return;
    };
    let filter = filter.parse::<Targets>().unwrap_or_else(|error| {
        eprintln!(
            "stablebuf-preload: {}={filter:?} is not a filter ({error}); using warn",
            env::LOG
        );
        Targets::new().with_default(tracing::Level::WARN)
    });
    let subscriber = tracing_subscriber::fmt()
        .with_writer(std::io::stderr)
        .with_target(true)
        .with_max_level(tracing::Level::TRACE)
        .finish()
        .with(filter);
    // A host program with its own global subscriber keeps it.
    let _ = tracing::subscriber::set_global_default(subscriber);
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_guard_lets_nested_calls_through() {
        let outer = Inside::enter().expect("not inside yet");
        assert!(Inside::enter().is_none(), "a nested call passes through");
        drop(outer);
        assert!(Inside::enter().is_some(), "left again");
        // Another thread has its own guard.
        let _held = Inside::enter();
        assert!(std::thread::spawn(|| Inside::enter().is_some())
            .join()
            .unwrap());
    }

    #[test]
    fn the_summary_names_every_count() {
        let stats = StablebufStats {
            runtime_allocs: 3,
            driver_allocs: 1,
            copies_elided: 2,
            bytes_elided: 3 << 30,
            entry_points: 2,
            ..StablebufStats::default()
        };
        let line = vmm_summary(&stats);
        assert!(
            line.starts_with("stablebuf-preload vmm: 4 allocations (3 runtime, 1 driver)"),
            "{line}"
        );
        assert!(line.contains("elided 2 (3.00 GiB)"), "{line}");
        assert!(line.contains("entry points hooked 2"), "{line}");
        assert!(
            !line.contains("NCCL"),
            "no NCCL part without registrations: {line}"
        );
        let nccl = StablebufStats {
            nccl_registrations: 4,
            nccl_reregistrations: 8,
            ..stats
        };
        assert!(
            vmm_summary(&nccl).ends_with(
                "; NCCL registrations of tagged memory 4 (0 suspended), 8 made again after resumes, 0 failures"
            ),
            "{}",
            vmm_summary(&nccl)
        );
    }
}
