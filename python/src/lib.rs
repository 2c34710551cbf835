//! `stablebuf._native`: the Rust half of the `stablebuf` Python package.
//!
//! The package puts PyTorch allocations into stablebuf regions through PyTorch's pluggable
//! allocator hooks: each tag's `torch.cuda.MemPool` allocates through one of this library's
//! exported C entry points ([`abi`]), which carve its segments side by side out of the tag's
//! [`Region`](stablebuf::region::Region) ([`regions`]). The Python functions here sleep, wake,
//! snapshot and bind those regions; the pure-Python package (`python/stablebuf/`) adds the
//! PyTorch glue (pools, the `region()` context manager, the guarded `CUDAGraph`).
//!
//! Layers: [`errors`], [`tags`] and [`stats`] are pure logic (tested by `cargo test` without a
//! GPU); [`regions`] is the only module that calls the core crate's region API; [`context`]
//! keeps the caller's CUDA context current across those calls (regions may live on several
//! devices); [`abi`] is the C boundary; this file is the Python boundary.

// The extension's only `unsafe` is DLPack's (raw capsules for PyTorch); every driver call goes
// through the core crate's safe functions (`stablebuf::device`). The C entry points of `abi`
// are `#[no_mangle]`, which the lint counts too, and allowed one by one there.
#![deny(unsafe_code)]

pub mod abi;
pub mod context;
#[allow(unsafe_code)] // DLPack: raw capsules handed to PyTorch
pub mod dlpack;
pub mod errors;
pub mod graphs;
pub mod kv;
pub mod publish;
pub mod regions;
pub mod stats;
pub mod tags;

use pyo3::exceptions::{PyBaseException, PyException, PyValueError};
use pyo3::prelude::*;
use pyo3::types::PyDict;
use stablebuf::region::Snapshot;

use crate::context::ContextNeutral;
use crate::errors::{Failure, Kind};
use crate::regions::{Streams, Transfer};
use crate::stats::{TagStats, Value};

pyo3::create_exception!(
    stablebuf,
    Error,
    PyException,
    "Base class of every stablebuf error. After one, the regions are as they were before the call."
);
pyo3::create_exception!(
    stablebuf,
    OutOfMemory,
    Error,
    "Device (or pinned host) memory ran out; the message says how much was asked and how much was free."
);
pyo3::create_exception!(
    stablebuf,
    OverBudget,
    Error,
    "A memory budget refused the request; the message names the budget and its numbers."
);
pyo3::create_exception!(
    stablebuf,
    Asleep,
    Error,
    "The region is asleep: its memory is released. Call stablebuf.wake(tag) first."
);
pyo3::create_exception!(
    stablebuf,
    Unbound,
    Error,
    "The region has no weight set bound (after stablebuf.unbind). Bind one first."
);
pyo3::create_exception!(
    stablebuf,
    UnknownTag,
    Error,
    "No region has this tag: regions are created by `with stablebuf.region(tag):`."
);
pyo3::create_exception!(
    stablebuf,
    SnapshotMismatch,
    Error,
    "The weight set cannot be bound into this region (taken from another region, or the region grew past it)."
);
pyo3::create_exception!(
    stablebuf,
    DeviceMismatch,
    Error,
    "The region lives on another CUDA device: a tag names one region on one device (names both)."
);

impl From<Failure> for PyErr {
    fn from(failure: Failure) -> PyErr {
        let message = failure.message;
        match failure.kind {
            Kind::Error => Error::new_err(message),
            Kind::OutOfMemory => OutOfMemory::new_err(message),
            Kind::OverBudget => OverBudget::new_err(message),
            Kind::Asleep => Asleep::new_err(message),
            Kind::Unbound => Unbound::new_err(message),
            Kind::UnknownTag => UnknownTag::new_err(message),
            Kind::SnapshotMismatch => SnapshotMismatch::new_err(message),
            Kind::DeviceMismatch => DeviceMismatch::new_err(message),
        }
    }
}

/// A weight set: a second physical backing of one region's used span (see `stablebuf.snapshot`).
///
/// Bind it with `stablebuf.bind(tag, weight_set)`: the region's addresses (every tensor and
/// every captured graph over them) then read and write this memory. Its memory lives while
/// this object, or the region it is bound in, holds it.
#[pyclass(module = "stablebuf", name = "WeightSet", frozen)]
pub struct WeightSet {
    tag: String,
    /// Dropped wherever Python lets go of it: its release must not move the current device.
    snapshot: ContextNeutral<Snapshot>,
}

#[pymethods]
impl WeightSet {
    /// The tag of the region it was taken from (and can be bound into).
    #[getter]
    fn tag(&self) -> &str {
        &self.tag
    }

    /// Unique for the life of the process.
    #[getter]
    fn id(&self) -> u64 {
        self.snapshot.id()
    }

    /// Bytes of device memory it holds: the region's used span when it was taken.
    #[getter]
    fn nbytes(&self) -> usize {
        self.snapshot.bytes()
    }

    /// The set's memory as a one-dimensional `uint8` array for `torch.from_dlpack`, at the
    /// set's own (home) address, whether or not it is bound: the same physical memory as the
    /// region's addresses while it is bound there, so a copy into it changes what the
    /// region's tensors (and graphs) read. The array keeps the set alive; work queued on it
    /// must be ordered against the region's readers by the caller (events), as for any copy.
    fn memory<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, crate::dlpack::DlpackExport>> {
        let device = regions::device(&self.tag)?;
        let snapshot = (*self.snapshot).clone();
        let tag = self.tag.clone();
        let ptr = py.detach(move || regions::home_of(&tag, &snapshot))?;
        // The capsules' owner: dropped wherever PyTorch frees the last tensor over the set.
        let owner = std::sync::Arc::new(ContextNeutral::new((*self.snapshot).clone()));
        let export = crate::dlpack::DlpackExport::new(
            ptr,
            self.snapshot.bytes(),
            (crate::dlpack::DEVICE_CUDA, device),
            owner,
        );
        Bound::new(py, export)
    }

    fn __repr__(&self) -> String {
        format!(
            "WeightSet(tag={:?}, id={}, nbytes={})",
            self.tag,
            self.snapshot.id(),
            self.snapshot.bytes()
        )
    }

    fn __eq__(&self, other: &Bound<'_, PyAny>) -> bool {
        other
            .cast::<WeightSet>()
            .is_ok_and(|other| other.get().snapshot.same_as(&self.snapshot))
    }

    fn __hash__(&self) -> u64 {
        self.snapshot.id()
    }
}

fn weight_set(tag: &str, snapshot: Snapshot) -> WeightSet {
    WeightSet {
        tag: tag.to_string(),
        snapshot: ContextNeutral::new(snapshot),
    }
}

fn transfers<'py>(py: Python<'py>, done: Vec<Transfer>) -> PyResult<Bound<'py, PyDict>> {
    let out = PyDict::new(py);
    for transfer in done {
        let entry = PyDict::new(py);
        entry.set_item("bytes", transfer.bytes)?;
        entry.set_item("seconds", transfer.seconds)?;
        let gb_per_s = if transfer.seconds > 0.0 && transfer.storage != "discarded" {
            transfer.bytes as f64 / transfer.seconds / 1e9
        } else {
            0.0
        };
        entry.set_item("gb_per_s", gb_per_s)?;
        entry.set_item("storage", transfer.storage)?;
        out.set_item(transfer.tag, entry)?;
    }
    Ok(out)
}

/// Registers `tag` on CUDA device `device`, creating its region there (`capacity` bytes of
/// virtual addresses, 1 TiB by default: reserving costs no memory), and returns its allocator
/// slot. Registering an existing tag returns its slot; from another device than the tag's it
/// raises `DeviceMismatch` (a tag names one region on one device).
/// With `last_use`, binds, sleeps and frees of the new region wait only for the uses noted
/// with `note_use` (see `regions::register`).
#[pyfunction]
#[pyo3(signature = (tag, device, capacity=None, last_use=false))]
fn register(
    py: Python<'_>,
    tag: &str,
    device: i32,
    capacity: Option<usize>,
    last_use: bool,
) -> PyResult<usize> {
    Ok(py.detach(|| regions::register(tag, device, capacity, last_use))?)
}

/// Notes that the work enqueued so far on `streams` (`{device: stream handle}`, each region's
/// on its own device's) used the regions of `tags` (matters for regions created with
/// `last_use`: their binds wait only up to the last noted use).
#[pyfunction]
fn note_use(tags: Vec<String>, streams: Streams) -> PyResult<()> {
    Ok(regions::note_use(&tags, &streams)?)
}

/// The CUDA device the region `tag` lives on.
#[pyfunction]
fn region_device(tag: &str) -> PyResult<i32> {
    Ok(regions::device(tag)?)
}

/// Registered tags, in slot order.
#[pyfunction(name = "tags")]
fn registered_tags() -> Vec<String> {
    regions::tags()
}

/// Name of the exported allocation function that serves allocator slot `slot`.
#[pyfunction]
fn alloc_symbol(slot: usize) -> PyResult<String> {
    if slot >= tags::MAX_TAGS {
        return Err(Error::new_err(format!(
            "slot {slot}: there are {} slots",
            tags::MAX_TAGS
        )));
    }
    Ok(abi::alloc_symbol(slot))
}

/// The exception for this thread's last failed allocation (cleared by reading), or `None`.
/// PyTorch reports a failed allocation as its own out-of-memory error; this is the cause.
#[pyfunction]
fn take_alloc_error(py: Python<'_>) -> Option<Py<PyBaseException>> {
    abi::take_alloc_failure().map(|failure| PyErr::from(failure).into_value(py))
}

/// Messages of frees that failed since the last call (PyTorch's free has no way to report).
#[pyfunction]
fn take_free_errors() -> Vec<String> {
    abi::take_free_failures()
}

/// Sleeps the regions of `tags`: with `keep`, their bytes are copied to pinned host memory;
/// without, discarded. Returns `{tag: {"bytes", "seconds", "gb_per_s", "storage"}}`.
/// `streams` (`{device: stream handle}`) are the CUDA streams the copies are ordered on, each
/// region's on its own device's.
#[pyfunction]
fn sleep<'py>(
    py: Python<'py>,
    tags: Vec<String>,
    keep: bool,
    streams: Streams,
) -> PyResult<Bound<'py, PyDict>> {
    let done = py.detach(|| regions::sleep(&tags, keep, &streams))?;
    transfers(py, done)
}

/// Wakes the regions of `tags` (each backed by one allocation under one mapping), each on its
/// own device's stream of `streams`. Returns the same record as `sleep`.
#[pyfunction]
fn wake<'py>(py: Python<'py>, tags: Vec<String>, streams: Streams) -> PyResult<Bound<'py, PyDict>> {
    let done = py.detach(|| regions::wake(&tags, &streams))?;
    transfers(py, done)
}

/// A new weight set of `tag` holding the region's current contents, copied on `stream` (a
/// stream of the region's device).
#[pyfunction]
fn snapshot(py: Python<'_>, tag: &str, stream: usize) -> PyResult<WeightSet> {
    let snapshot = py.detach(|| regions::snapshot(tag, stream))?;
    Ok(weight_set(tag, snapshot))
}

/// Binds `weights` under `tag`'s addresses; returns the weight set bound before, if any.
#[pyfunction]
fn bind(py: Python<'_>, tag: &str, weights: &Bound<'_, WeightSet>) -> PyResult<Option<WeightSet>> {
    let weights = weights.get();
    let previous = py.detach(|| regions::bind(tag, &weights.snapshot, &weights.tag))?;
    Ok(previous.map(|snapshot| weight_set(tag, snapshot)))
}

/// Makes `tag`'s region read `weights` by `strategy` (`"auto"`, `"copy"` or `"remap"`): a remap
/// as `bind`, or a copy on `stream` (a stream of the region's device) into the region's own
/// live set. Returns which way it went,
/// `"copy"` or `"remap"`.
#[pyfunction]
fn switch(
    py: Python<'_>,
    tag: &str,
    weights: &Bound<'_, WeightSet>,
    strategy: &str,
    stream: usize,
) -> PyResult<&'static str> {
    let Some(strategy) = regions::parse_strategy(strategy) else {
        return Err(PyValueError::new_err(format!(
            "strategy must be \"auto\", \"copy\" or \"remap\", not {strategy:?}"
        )));
    };
    let weights = weights.get();
    let way =
        py.detach(|| regions::switch(tag, &weights.snapshot, &weights.tag, strategy, stream))?;
    Ok(regions::way_name(way))
}

/// The weight-set size in bytes above which a remap is cheaper than a copy on CUDA device
/// `device` (its cost model, calibrated once per process), or `None` if one way always wins.
#[pyfunction]
fn crossover_bytes(py: Python<'_>, device: i32) -> PyResult<Option<usize>> {
    Ok(py.detach(|| regions::crossover_bytes(device))?)
}

/// Uploads PyTorch's executable graph `exec` (`torch.cuda.CUDAGraph.raw_cuda_graph_exec()`)
/// of device `device` on its stream `stream` (`cuGraphUpload`), so that the first replay costs
/// what later ones do. Ordered after the work queued on `stream`.
#[pyfunction]
fn upload_graph(py: Python<'_>, device: i32, exec: u64, stream: usize) -> PyResult<()> {
    Ok(py.detach(|| graphs::upload(device, exec, stream))?)
}

/// The weight set bound under `tag` now (`None` before the first snapshot or wake).
#[pyfunction]
fn bound(tag: &str) -> PyResult<Option<WeightSet>> {
    Ok(regions::bound(tag)?.map(|snapshot| weight_set(tag, snapshot)))
}

/// Unmaps `tag`'s weight set; graphs guarded by the tag raise `Unbound` until a bind.
#[pyfunction]
fn unbind(py: Python<'_>, tag: &str) -> PyResult<()> {
    Ok(py.detach(|| regions::unbind(tag))?)
}

/// Raises `Asleep` or `Unbound` unless a graph over the regions of `tags` may replay now.
#[pyfunction]
fn check_replayable(tags: Vec<String>) -> PyResult<()> {
    Ok(regions::check_replayable(&tags)?)
}

/// `{tag: {"reserved", "allocated", "allocations", "span", "mapped", "mappings", "asleep",
/// "host_bytes", "device"}}` for every region.
#[pyfunction(name = "stats")]
fn region_stats(py: Python<'_>) -> PyResult<Bound<'_, PyDict>> {
    let out = PyDict::new(py);
    for (one, device) in py.detach(regions::stats) {
        let entry = PyDict::new(py);
        for (key, value) in TagStats::from(&one).fields() {
            match value {
                Value::Int(n) => entry.set_item(key, n)?,
                Value::Flag(flag) => entry.set_item(key, flag)?,
            }
        }
        entry.set_item("device", device)?;
        out.set_item(one.tag, entry)?;
    }
    Ok(out)
}

/// The SVG timeline (address against time) of every region's maps, unmaps, allocations and
/// frees, as text.
#[pyfunction]
fn timeline_svg(py: Python<'_>, title: &str) -> PyResult<String> {
    Ok(py.detach(|| regions::timeline(title))?)
}

/// Pins `nbytes` of host memory through `device`'s context for sleeping regions now (about
/// 0.5 s per GiB, once) and returns the pinned capacity. One arena per process, portable:
/// regions of every device sleep into it.
#[pyfunction]
fn reserve_host(py: Python<'_>, nbytes: usize, device: i32) -> PyResult<usize> {
    Ok(py.detach(|| regions::reserve_host(nbytes, device))?)
}

/// `{"capacity", "free", "pin_seconds", "pins"}` of the pinned arena, or `None` before the
/// first pin.
#[pyfunction]
fn host_arena(py: Python<'_>) -> PyResult<Option<Bound<'_, PyDict>>> {
    let Some((capacity, free, pin_seconds, pins)) = regions::host_arena() else {
        return Ok(None);
    };
    let out = PyDict::new(py);
    out.set_item("capacity", capacity)?;
    out.set_item("free", free)?;
    out.set_item("pin_seconds", pin_seconds)?;
    out.set_item("pins", pins)?;
    Ok(Some(out))
}

/// The tag of the region whose reservation holds `address`, or `None`.
#[pyfunction]
fn owner(address: u64) -> Option<String> {
    regions::owner(address)
}

/// Whether a CUDA driver (libcuda) can be loaded on this machine.
#[pyfunction]
fn driver_present() -> bool {
    stablebuf::driver_present()
}

/// Releases the memory stablebuf holds for release (issue 43) on `device`, or on every device
/// when `None`, now; returns the bytes released.
#[pyfunction]
#[pyo3(signature = (device=None))]
fn trim(py: Python<'_>, device: Option<i64>) -> PyResult<usize> {
    match device {
        None => Ok(py.detach(stablebuf::release::trim_all)),
        Some(device) => {
            let ordinal = usize::try_from(device)
                .map_err(|_| PyValueError::new_err(format!("no device {device}")))?;
            Ok(py.detach(|| stablebuf::release::trim(ordinal)))
        }
    }
}

/// What device `device`'s release queue holds and did, as a dict of counts.
#[pyfunction]
#[pyo3(signature = (device=0))]
fn release_stats(device: i64) -> PyResult<std::collections::BTreeMap<&'static str, u64>> {
    let ordinal = usize::try_from(device)
        .map_err(|_| PyValueError::new_err(format!("no device {device}")))?;
    let s = stablebuf::release::stats(ordinal);
    Ok([
        ("held_bytes", s.held_bytes as u64),
        ("held_allocations", s.held_allocations as u64),
        ("pieces", s.pieces),
        ("releases", s.releases),
        ("released_bytes", s.released_bytes),
        ("reused", s.reused),
        ("reused_bytes", s.reused_bytes),
        ("retries", s.retries),
        ("background_pieces", s.background_pieces),
    ]
    .into_iter()
    .collect())
}

/// Sets the release policy: `mode` is "immediate", "background" or "manual".
#[pyfunction]
#[pyo3(signature = (mode, idle_ms=20.0, gap_ms=1.0, piece_bytes=256 << 20))]
fn set_release_policy(mode: &str, idle_ms: f64, gap_ms: f64, piece_bytes: usize) -> PyResult<()> {
    use stablebuf::release::{ReleaseMode, ReleasePolicy};
    let mode = match mode {
        "immediate" => ReleaseMode::Immediate,
        "background" => ReleaseMode::Background,
        "manual" => ReleaseMode::Manual,
        other => {
            return Err(PyValueError::new_err(format!(
                "release mode {other:?}: expected \"immediate\", \"background\" or \"manual\""
            )))
        }
    };
    let duration = |name: &str, ms: f64| {
        std::time::Duration::try_from_secs_f64(ms / 1000.0)
            .map_err(|_| PyValueError::new_err(format!("{name} = {ms} ms is not a duration")))
    };
    stablebuf::release::set_policy(ReleasePolicy {
        mode,
        idle: duration("idle_ms", idle_ms)?,
        gap: duration("gap_ms", gap_ms)?,
        piece_bytes,
    });
    Ok(())
}

#[pymodule]
fn _native(m: &Bound<'_, PyModule>) -> PyResult<()> {
    let py = m.py();
    m.add("__version__", env!("CARGO_PKG_VERSION"))?;
    m.add("MAX_TAGS", tags::MAX_TAGS)?;
    m.add("FREE_SYMBOL", abi::FREE_SYMBOL)?;
    m.add("Error", py.get_type::<Error>())?;
    m.add("OutOfMemory", py.get_type::<OutOfMemory>())?;
    m.add("OverBudget", py.get_type::<OverBudget>())?;
    m.add("Asleep", py.get_type::<Asleep>())?;
    m.add("Unbound", py.get_type::<Unbound>())?;
    m.add("UnknownTag", py.get_type::<UnknownTag>())?;
    m.add("SnapshotMismatch", py.get_type::<SnapshotMismatch>())?;
    m.add("DeviceMismatch", py.get_type::<DeviceMismatch>())?;
    m.add_class::<WeightSet>()?;
    m.add_function(wrap_pyfunction!(register, m)?)?;
    m.add_function(wrap_pyfunction!(registered_tags, m)?)?;
    m.add_function(wrap_pyfunction!(alloc_symbol, m)?)?;
    m.add_function(wrap_pyfunction!(take_alloc_error, m)?)?;
    m.add_function(wrap_pyfunction!(take_free_errors, m)?)?;
    m.add_function(wrap_pyfunction!(sleep, m)?)?;
    m.add_function(wrap_pyfunction!(wake, m)?)?;
    m.add_function(wrap_pyfunction!(snapshot, m)?)?;
    m.add_function(wrap_pyfunction!(bind, m)?)?;
    m.add_function(wrap_pyfunction!(switch, m)?)?;
    m.add_function(wrap_pyfunction!(crossover_bytes, m)?)?;
    m.add_function(wrap_pyfunction!(upload_graph, m)?)?;
    m.add_function(wrap_pyfunction!(bound, m)?)?;
    m.add_function(wrap_pyfunction!(unbind, m)?)?;
    m.add_function(wrap_pyfunction!(check_replayable, m)?)?;
    m.add_function(wrap_pyfunction!(note_use, m)?)?;
    m.add_function(wrap_pyfunction!(region_device, m)?)?;
    m.add_function(wrap_pyfunction!(region_stats, m)?)?;
    m.add_function(wrap_pyfunction!(timeline_svg, m)?)?;
    m.add_function(wrap_pyfunction!(reserve_host, m)?)?;
    m.add_function(wrap_pyfunction!(host_arena, m)?)?;
    m.add_function(wrap_pyfunction!(owner, m)?)?;
    m.add_function(wrap_pyfunction!(driver_present, m)?)?;
    m.add_function(wrap_pyfunction!(trim, m)?)?;
    m.add_function(wrap_pyfunction!(release_stats, m)?)?;
    m.add_function(wrap_pyfunction!(set_release_policy, m)?)?;
    publish::register(m)?;
    kv::register(m)?;
    Ok(())
}
