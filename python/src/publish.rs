//! The Rust half of `stablebuf.publish`: Unix-socket channels speaking the core crate's
//! weight-publish messages (`stablebuf::share::publish`), exportable weight sets, and weight
//! sets imported from another process with a `__cuda_array_interface__` over their memory.
//!
//! Everything that decides (which set is free, which version is newer, whether a manifest
//! matches) is in the pure-Python `stablebuf/publish.py`; this file moves messages and memory.
//! Sockets are owned here (std's `UnixStream`), so no descriptor crosses into Python.

use std::os::unix::net::{UnixListener, UnixStream};
use std::sync::{Arc, Mutex};

use pyo3::exceptions::PyValueError;
use pyo3::prelude::*;
use pyo3::types::PyDict;
use stablebuf::error::ShareError;
use stablebuf::region::Snapshot;
use stablebuf::share::publish::{self, Expectation, PublishMessage};
use stablebuf::share::ProtocolError;

use crate::context::{ContextNeutral, ContextScope};
use crate::dlpack::{DlpackExport, DEVICE_CUDA};
use crate::errors::Failure;
use crate::{regions, WeightSet};

pyo3::create_exception!(
    stablebuf,
    PublishError,
    crate::Error,
    "Publishing weights between processes failed; the engine keeps serving the set it has bound."
);
pyo3::create_exception!(
    stablebuf,
    PeerClosed,
    PublishError,
    "The other process closed the connection or died (a half-written set is never bound)."
);
pyo3::create_exception!(
    stablebuf,
    OfferMismatch,
    PublishError,
    "The engine's weight set or manifest is not what the trainer expects; the message names the first difference (name, shape, dtype, stride, offset, size, device)."
);
pyo3::create_exception!(
    stablebuf,
    VersionConflict,
    PublishError,
    "A version was committed that is not newer than the last one published."
);
pyo3::create_exception!(
    stablebuf,
    PublishTimeout,
    PublishError,
    "Nothing arrived from the other process in time."
);

/// A core error from the publish path as the matching Python exception.
fn publish_error(error: stablebuf::Error) -> PyErr {
    use stablebuf::Error;
    match &error {
        Error::Share(ShareError::Protocol(
            ProtocolError::Closed | ProtocolError::Truncated { .. },
        )) => PeerClosed::new_err(format!("the peer closed the connection ({error})")),
        Error::Io { source, .. }
            if matches!(
                source.kind(),
                std::io::ErrorKind::BrokenPipe
                    | std::io::ErrorKind::ConnectionReset
                    | std::io::ErrorKind::NotConnected
            ) =>
        {
            PeerClosed::new_err(format!("the peer closed the connection ({error})"))
        }
        Error::Share(ShareError::OfferMismatch { .. })
        | Error::Share(ShareError::DeviceMismatch { .. }) => {
            OfferMismatch::new_err(error.to_string())
        }
        Error::Share(ShareError::Protocol(_)) | Error::Share(ShareError::Rejected { .. }) => {
            PublishError::new_err(error.to_string())
        }
        _ => PyErr::from(regions::core_failure(error)),
    }
}

fn closed() -> PyErr {
    PeerClosed::new_err("the channel is closed")
}

/// Listens on a Unix socket path for a trainer (the engine's side). Accepting never blocks.
#[pyclass(module = "stablebuf", name = "PublishListener")]
pub struct Listener {
    listener: Mutex<Option<UnixListener>>,
    path: String,
}

#[pymethods]
impl Listener {
    /// Binds `path` (a stale socket there is replaced).
    #[new]
    fn new(path: &str) -> PyResult<Self> {
        let io =
            |call: &'static str| move |source| publish_error(stablebuf::Error::Io { call, source });
        use std::os::unix::fs::FileTypeExt;
        // A stale socket of an earlier engine is replaced; any other file is left alone (the
        // bind below then fails with "address in use").
        if std::fs::symlink_metadata(path).is_ok_and(|m| m.file_type().is_socket()) {
            std::fs::remove_file(path).map_err(io("unlink"))?;
        }
        let listener = UnixListener::bind(path).map_err(io("bind"))?;
        listener.set_nonblocking(true).map_err(io("fcntl"))?;
        Ok(Self {
            listener: Mutex::new(Some(listener)),
            path: path.to_string(),
        })
    }

    /// The socket path.
    #[getter]
    fn path(&self) -> &str {
        &self.path
    }

    /// A connection waiting to be accepted, or `None` (never blocks).
    fn accept(&self) -> PyResult<Option<Channel>> {
        let guard = self.listener.lock().unwrap_or_else(|p| p.into_inner());
        let Some(listener) = guard.as_ref() else {
            return Err(closed());
        };
        match listener.accept() {
            Ok((socket, _)) => {
                socket.set_nonblocking(false).map_err(|source| {
                    publish_error(stablebuf::Error::Io {
                        call: "fcntl",
                        source,
                    })
                })?;
                Ok(Some(Channel::from(socket)))
            }
            Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => Ok(None),
            Err(source) => Err(publish_error(stablebuf::Error::Io {
                call: "accept",
                source,
            })),
        }
    }

    /// Stops listening and removes the socket file.
    fn close(&self) {
        let mut guard = self.listener.lock().unwrap_or_else(|p| p.into_inner());
        if guard.take().is_some() {
            let _ = std::fs::remove_file(&self.path);
        }
    }
}

/// One connection between an engine and a trainer.
#[pyclass(module = "stablebuf", name = "PublishChannel")]
pub struct Channel {
    socket: Mutex<Option<UnixStream>>,
}

impl From<UnixStream> for Channel {
    fn from(socket: UnixStream) -> Self {
        Self {
            socket: Mutex::new(Some(socket)),
        }
    }
}

impl Channel {
    /// Runs `f` on the socket without the GIL. The lock is taken without the GIL too: a thread
    /// blocked in a receive holds it, and must be able to take the GIL back to return.
    fn with<T: Send>(
        &self,
        py: Python<'_>,
        f: impl FnOnce(&UnixStream) -> stablebuf::Result<T> + Send,
    ) -> PyResult<T> {
        let outcome = py.detach(|| {
            let guard = self.socket.lock().unwrap_or_else(|p| p.into_inner());
            guard.as_ref().map(f)
        });
        match outcome {
            None => Err(closed()),
            Some(result) => result.map_err(publish_error),
        }
    }
}

#[pymethods]
impl Channel {
    /// Connects to an engine listening on `path`.
    #[staticmethod]
    fn connect(path: &str) -> PyResult<Channel> {
        UnixStream::connect(path)
            .map(Channel::from)
            .map_err(|source| {
                let error = stablebuf::Error::Io {
                    call: "connect",
                    source,
                };
                PeerClosed::new_err(format!("no engine at {path}: {error}"))
            })
    }

    /// Exports weight set `weights` (made with `snapshot_shareable`) and offers it, with the
    /// manifest's `fingerprint`; returns the set's id. Does not wait for the answer.
    fn offer(
        &self,
        py: Python<'_>,
        weights: &Bound<'_, WeightSet>,
        fingerprint: u64,
    ) -> PyResult<u64> {
        let weights = weights.get();
        let (snapshot, tag) = (weights.snapshot.clone(), weights.tag.clone());
        let ctx = regions::device_context_of(&tag).map_err(PyErr::from)?;
        // Exporting makes the set's context current; the caller's comes back (`with` runs the
        // closure on this thread).
        let _scope = ContextScope::keep();
        self.with(py, move |socket| {
            publish::offer_weight_set(socket, &snapshot, &tag, fingerprint, &ctx).map(|o| o.set)
        })
    }

    /// Waits for the trainer's Ack of set `set`; `PublishError` with its reason on a Reject.
    fn wait_ack(&self, py: Python<'_>, set: u64) -> PyResult<()> {
        self.with(py, move |socket| publish::wait_set_ack(socket, set))
    }

    /// Receives one offered set, checks it (device, `tag`, `fingerprint`, `nbytes`), imports
    /// and maps it on `device` with read-write access for `access` (default: `device`), and
    /// acknowledges it. On a mismatch the engine gets a Reject and `OfferMismatch` is raised.
    #[pyo3(signature = (device, tag=None, fingerprint=None, nbytes=None, access=None))]
    fn receive_set<'py>(
        &self,
        py: Python<'py>,
        device: i32,
        tag: Option<String>,
        fingerprint: Option<u64>,
        nbytes: Option<u64>,
        access: Option<Vec<usize>>,
    ) -> PyResult<Bound<'py, ImportedWeightSet>> {
        // Opening the device and importing make its context current; the caller's comes back
        // (`with` runs the closure on this thread), so importing on the engine's GPU does not
        // move PyTorch's current device.
        let _scope = ContextScope::keep();
        let ctx = regions::device_context(device)?;
        let expect = Expectation {
            tag,
            layout_fingerprint: fingerprint,
            bytes: nbytes,
        };
        let access = access.unwrap_or_default();
        // The devices the mapping grants access to may address the set as theirs (a trainer on
        // a peer GPU writes through views on its own GPU).
        let peers: Vec<i32> = access
            .iter()
            .filter_map(|&d| i32::try_from(d).ok())
            .collect();
        let (snapshot, offer) = self.with(py, move |socket| {
            publish::receive_weight_set_for(socket, &ctx, &expect, &access)
        })?;
        let ptr = snapshot.home_ptr().map_err(publish_error)?;
        // The capsules' owner: dropped wherever PyTorch frees the last tensor over the set.
        let owner = Arc::new(ContextNeutral::new(snapshot.clone()));
        let export = DlpackExport::new(ptr, snapshot.bytes(), (DEVICE_CUDA, device), owner)
            .with_peers(peers);
        let set = ImportedWeightSet {
            snapshot: ContextNeutral::new(snapshot),
            set: offer.set,
            tag: offer.tag,
            ptr,
            device,
        };
        Bound::new(py, PyClassInitializer::from(export).add_subclass(set))
    }

    /// Sends the manifest text (in as many parts as it takes).
    fn send_manifest(&self, py: Python<'_>, text: String) -> PyResult<()> {
        self.with(py, move |socket| publish::send_manifest(socket, &text))
    }

    /// Receives a manifest; `PublishError` if the engine refused this trainer instead.
    fn receive_manifest(&self, py: Python<'_>) -> PyResult<String> {
        self.with(py, publish::receive_manifest)
    }

    /// Sends a message without a descriptor: `kind` is `"commit"` (`set`, `version`),
    /// `"released"` (`set`), `"ack"` (`set`) or `"reject"` (`reason`).
    #[pyo3(signature = (kind, set=0, version=0, reason=String::new()))]
    fn send(
        &self,
        py: Python<'_>,
        kind: &str,
        set: u64,
        version: u64,
        reason: String,
    ) -> PyResult<()> {
        let message = match kind {
            "commit" => PublishMessage::Commit { set, version },
            "released" => PublishMessage::Released { set },
            "ack" => PublishMessage::Ack { set },
            "reject" => PublishMessage::Reject { reason },
            other => {
                return Err(PyValueError::new_err(format!(
                    "unknown message kind {other:?} (commit, released, ack, reject)"
                )))
            }
        };
        self.with(py, move |socket| publish::send(socket, &message, None))
    }

    /// Whether a message (or the peer's close) waits to be read. Never blocks.
    fn message_waiting(&self, py: Python<'_>) -> PyResult<bool> {
        self.with(py, publish::message_waiting)
    }

    /// Receives one message without a descriptor as `(kind, set, version, reason)`; kinds as in
    /// `send`. `PeerClosed` when the peer closed or died.
    fn receive(&self, py: Python<'_>) -> PyResult<(String, u64, u64, String)> {
        let message = self.with(py, publish::receive_plain)?;
        Ok(match message {
            PublishMessage::Commit { set, version } => {
                ("commit".into(), set, version, String::new())
            }
            PublishMessage::Released { set } => ("released".into(), set, 0, String::new()),
            PublishMessage::Ack { set } => ("ack".into(), set, 0, String::new()),
            PublishMessage::Reject { reason } => ("reject".into(), 0, 0, reason),
            PublishMessage::Offer(_) | PublishMessage::Manifest { .. } => {
                return Err(PublishError::new_err(
                    "protocol: an offer or manifest arrived where none was expected",
                ))
            }
        })
    }

    /// Closes the connection (idempotent).
    fn close(&self, py: Python<'_>) {
        py.detach(|| {
            let mut guard = self.socket.lock().unwrap_or_else(|p| p.into_inner());
            if let Some(socket) = guard.take() {
                let _ = socket.shutdown(std::net::Shutdown::Both);
            }
        });
    }

    /// Whether `close` was called.
    #[getter]
    fn closed(&self, py: Python<'_>) -> bool {
        py.detach(|| {
            self.socket
                .lock()
                .unwrap_or_else(|p| p.into_inner())
                .is_none()
        })
    }
}

/// A weight set another process published, mapped read-write into this one. Its memory lives
/// while this object (or a tensor made over it through `__cuda_array_interface__` or
/// `__dlpack__`, which it has from [`DlpackExport`]) does.
#[pyclass(module = "stablebuf", name = "ImportedWeightSet", extends = DlpackExport, frozen)]
pub struct ImportedWeightSet {
    /// Dropped wherever Python lets go of it: its release must not move the current device.
    snapshot: ContextNeutral<Snapshot>,
    set: u64,
    tag: String,
    ptr: u64,
    device: i32,
}

#[pymethods]
impl ImportedWeightSet {
    /// The engine's id of the set (named in commits and releases).
    #[getter]
    fn set_id(&self) -> u64 {
        self.set
    }

    /// The tag of the engine's region.
    #[getter]
    fn tag(&self) -> &str {
        &self.tag
    }

    /// Bytes of the set.
    #[getter]
    fn nbytes(&self) -> usize {
        self.snapshot.bytes()
    }

    /// Where the set is mapped in this process.
    #[getter]
    fn ptr(&self) -> u64 {
        self.ptr
    }

    /// The CUDA device it was imported on.
    #[getter]
    fn device(&self) -> i32 {
        self.device
    }

    /// The whole set as a one-dimensional byte array (CUDA Array Interface v3), so
    /// `torch.as_tensor(imported, device=...)` is a zero-copy `uint8` tensor over it.
    #[getter]
    fn __cuda_array_interface__<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyDict>> {
        let out = PyDict::new(py);
        out.set_item("shape", (self.snapshot.bytes(),))?;
        out.set_item("typestr", "|u1")?;
        out.set_item("data", (self.ptr, false))?;
        out.set_item("version", 3)?;
        out.set_item("strides", py.None())?;
        // Writers synchronise their own stream before committing: no stream to order against.
        out.set_item("stream", py.None())?;
        Ok(out)
    }

    fn __repr__(&self) -> String {
        format!(
            "ImportedWeightSet(tag={:?}, set_id={}, nbytes={}, device={})",
            self.tag,
            self.set,
            self.snapshot.bytes(),
            self.device
        )
    }
}

/// A weight set of `tag` that another process can import (`stablebuf.publish.Engine` makes
/// its spare sets with it).
#[pyfunction]
fn snapshot_shareable(py: Python<'_>, tag: &str, stream: usize) -> PyResult<WeightSet> {
    let snapshot = py.detach(|| regions::snapshot_shareable(tag, stream))?;
    Ok(WeightSet {
        tag: tag.to_string(),
        snapshot: ContextNeutral::new(snapshot),
    })
}

/// Wakes the sleeping region `tag` straight onto `weights` (one mapping, no copy back).
#[pyfunction]
fn wake_onto(py: Python<'_>, tag: &str, weights: &Bound<'_, WeightSet>) -> PyResult<()> {
    let weights = weights.get();
    if weights.tag != tag {
        return Err(PyErr::from(Failure::new(
            crate::errors::Kind::SnapshotMismatch,
            format!(
                "a weight set of region `{}` cannot wake region `{tag}`",
                weights.tag
            ),
        )));
    }
    let snapshot = weights.snapshot.clone();
    Ok(py.detach(|| regions::wake_onto(tag, &snapshot))?)
}

/// The first address of `tag`'s reservation.
#[pyfunction]
fn region_base(tag: &str) -> PyResult<u64> {
    Ok(regions::base(tag)?)
}

/// Adds the publish classes, exceptions and functions to the module.
pub fn register(m: &Bound<'_, PyModule>) -> PyResult<()> {
    let py = m.py();
    m.add("PublishError", py.get_type::<PublishError>())?;
    m.add("PeerClosed", py.get_type::<PeerClosed>())?;
    m.add("OfferMismatch", py.get_type::<OfferMismatch>())?;
    m.add("VersionConflict", py.get_type::<VersionConflict>())?;
    m.add("PublishTimeout", py.get_type::<PublishTimeout>())?;
    m.add_class::<Listener>()?;
    m.add_class::<Channel>()?;
    m.add_class::<ImportedWeightSet>()?;
    m.add_class::<crate::dlpack::DlpackExport>()?;
    m.add_class::<crate::dlpack::DlpackProbe>()?;
    m.add_function(wrap_pyfunction!(snapshot_shareable, m)?)?;
    m.add_function(wrap_pyfunction!(wake_onto, m)?)?;
    m.add_function(wrap_pyfunction!(region_base, m)?)?;
    Ok(())
}
