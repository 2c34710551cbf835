//! DLPack capsules over memory this crate owns, so `torch.from_dlpack` makes a zero-copy tensor
//! of an imported weight set without NumPy (PyTorch parses `__cuda_array_interface__` type
//! strings with NumPy, which a serving image may lack).
//!
//! The capsule is the legacy `"dltensor"` kind: a `DLManagedTensor` whose `manager_ctx` keeps
//! the memory's owner alive. The consumer (PyTorch) renames the capsule `"used_dltensor"` and
//! calls `deleter` when its tensor dies; a capsule never consumed calls it from its destructor.
//! The owner is a Rust value (`Send`), so the deleter needs no GIL, whatever thread runs it.

use std::any::Any;
use std::ffi::{c_void, CStr};
use std::sync::Arc;

use pyo3::exceptions::PyBufferError;
use pyo3::ffi;
use pyo3::prelude::*;

const DLTENSOR: &CStr = c"dltensor";

/// `kDLCPU` and `kDLCUDA` of `DLDeviceType`.
pub const DEVICE_CPU: i32 = 1;
pub const DEVICE_CUDA: i32 = 2;

#[repr(C)]
struct DLDevice {
    device_type: i32,
    device_id: i32,
}

#[repr(C)]
struct DLDataType {
    code: u8,
    bits: u8,
    lanes: u16,
}

#[repr(C)]
struct DLTensor {
    data: *mut c_void,
    device: DLDevice,
    ndim: i32,
    dtype: DLDataType,
    shape: *mut i64,
    strides: *mut i64,
    byte_offset: u64,
}

#[repr(C)]
struct DLManagedTensor {
    dl_tensor: DLTensor,
    manager_ctx: *mut c_void,
    deleter: Option<unsafe extern "C" fn(*mut DLManagedTensor)>,
}

/// Most dimensions an exported array has (the KV cache's views have four).
pub const MAX_DIMS: usize = 4;

/// The element type, shape and strides an export describes its memory as.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ArrayDesc {
    /// DLPack's `DLDataTypeCode` (0 int, 1 uint, 2 float, 4 bfloat).
    pub code: u8,
    /// Bits per element.
    pub bits: u8,
    /// Elements per dimension, at most [`MAX_DIMS`] of them.
    pub shape: Vec<i64>,
    /// Elements (not bytes) from one index to the next per dimension; `None`: compact.
    pub strides: Option<Vec<i64>>,
}

impl ArrayDesc {
    /// `bytes` bytes as a one-dimensional `uint8` array.
    pub fn bytes(bytes: usize) -> Self {
        Self {
            code: 1, // kDLUInt
            bits: 8,
            shape: vec![bytes as i64],
            strides: None,
        }
    }

    /// Bytes from the first element to one past the last one reachable.
    pub fn span_bytes(&self) -> usize {
        let elem = usize::from(self.bits).div_ceil(8);
        if self.shape.contains(&0) {
            return 0;
        }
        let last = match &self.strides {
            None => self.shape.iter().product::<i64>() - 1,
            Some(strides) => self
                .shape
                .iter()
                .zip(strides)
                .map(|(&n, &s)| (n - 1) * s)
                .sum(),
        };
        (last as usize + 1) * elem
    }

    fn check(&self) -> PyResult<()> {
        let dims_ok = !self.shape.is_empty() && self.shape.len() <= MAX_DIMS;
        let strides_ok = self
            .strides
            .as_ref()
            .is_none_or(|s| s.len() == self.shape.len() && s.iter().all(|&x| x >= 0));
        if !dims_ok || !strides_ok || self.shape.iter().any(|&n| n < 0) {
            return Err(PyBufferError::new_err(format!(
                "cannot export shape {:?} with strides {:?}",
                self.shape, self.strides
            )));
        }
        Ok(())
    }
}

/// What a capsule points at: the DLPack header first (so a pointer to this is a pointer to
/// it), the shape and strides it points into, and the owner of the memory.
#[repr(C)]
struct Managed<T> {
    tensor: DLManagedTensor,
    shape: [i64; MAX_DIMS],
    strides: [i64; MAX_DIMS],
    owner: T,
}

unsafe extern "C" fn delete_managed<T>(tensor: *mut DLManagedTensor) {
    if !tensor.is_null() {
        // SAFETY: every DLManagedTensor with this deleter is the first field of a
        // `Managed<T>` leaked from a Box in `capsule`, and DLPack calls the deleter once.
        drop(unsafe { Box::from_raw(tensor.cast::<Managed<T>>()) });
    }
}

unsafe extern "C" fn capsule_destructor(capsule: *mut ffi::PyObject) {
    // SAFETY: called by Python with the GIL, on a live capsule. Only a capsule still named
    // "dltensor" was never consumed; a consumer renames it and owns the tensor from then on.
    unsafe {
        if ffi::PyCapsule_IsValid(capsule, DLTENSOR.as_ptr()) == 1 {
            let tensor = ffi::PyCapsule_GetPointer(capsule, DLTENSOR.as_ptr());
            let tensor = tensor.cast::<DLManagedTensor>();
            if let Some(deleter) = (*tensor).deleter {
                deleter(tensor);
            }
        }
    }
}

/// A `"dltensor"` capsule describing `bytes` bytes at `ptr` as a one-dimensional `uint8`
/// array on `(device_type, device_id)`, keeping `owner` alive until the consumer's tensor (or
/// the unconsumed capsule) is gone. `owner` must keep `[ptr, ptr + bytes)` valid.
pub fn capsule<T: Send + 'static>(
    py: Python<'_>,
    ptr: u64,
    bytes: usize,
    device_type: i32,
    device_id: i32,
    copy: Option<bool>,
    owner: T,
) -> PyResult<Bound<'_, PyAny>> {
    let array = ArrayDesc::bytes(bytes);
    capsule_of(py, ptr, &array, (device_type, device_id), copy, owner)
}

/// A `"dltensor"` capsule describing the memory at `ptr` as `array` on `(device_type,
/// device_id)`, keeping `owner` alive until the consumer's tensor (or the unconsumed capsule)
/// is gone. `owner` must keep `[ptr, ptr + array.span_bytes())` valid.
pub fn capsule_of<'py, T: Send + 'static>(
    py: Python<'py>,
    ptr: u64,
    array: &ArrayDesc,
    (device_type, device_id): (i32, i32),
    copy: Option<bool>,
    owner: T,
) -> PyResult<Bound<'py, PyAny>> {
    if copy == Some(true) {
        return Err(PyBufferError::new_err(
            "exported memory is shared (a weight set, a KV cache): it cannot be exported as a copy",
        ));
    }
    array.check()?;
    let mut shape = [0i64; MAX_DIMS];
    shape[..array.shape.len()].copy_from_slice(&array.shape);
    let mut strides = [0i64; MAX_DIMS];
    if let Some(given) = &array.strides {
        strides[..given.len()].copy_from_slice(given);
    }
    let managed = Box::into_raw(Box::new(Managed {
        tensor: DLManagedTensor {
            dl_tensor: DLTensor {
                data: ptr as *mut c_void,
                device: DLDevice {
                    device_type,
                    device_id,
                },
                ndim: array.shape.len() as i32,
                dtype: DLDataType {
                    code: array.code,
                    bits: array.bits,
                    lanes: 1,
                },
                shape: std::ptr::null_mut(),
                strides: std::ptr::null_mut(), // compact unless set below
                byte_offset: 0,
            },
            manager_ctx: std::ptr::null_mut(),
            deleter: Some(delete_managed::<T>),
        },
        shape,
        strides,
        owner,
    }));
    let strided = array.strides.is_some();
    // SAFETY: `managed` came from Box::into_raw just above and nothing else has it yet: the
    // shape and strides pointers point into the same (now fixed) allocation, and the capsule
    // takes it over.
    unsafe {
        (*managed).tensor.dl_tensor.shape = (*managed).shape.as_mut_ptr();
        if strided {
            (*managed).tensor.dl_tensor.strides = (*managed).strides.as_mut_ptr();
        }
        (*managed).tensor.manager_ctx = managed.cast();
        let raw = ffi::PyCapsule_New(managed.cast(), DLTENSOR.as_ptr(), Some(capsule_destructor));
        if raw.is_null() {
            delete_managed::<T>(managed.cast());
        }
        Bound::from_owned_ptr_or_err(py, raw)
    }
}

/// Memory exported through the DLPack protocol: `bytes` bytes at `ptr` on
/// `(device_type, device_id)` as a one-dimensional `uint8` array, kept alive by `owner` while a
/// capsule or a tensor made from one uses it. The base class of the Python types that export
/// memory this way (`ImportedWeightSet`, `_DlpackProbe`): their one `__dlpack__` and
/// `__dlpack_device__`.
#[pyclass(module = "stablebuf", name = "_DlpackExport", subclass, frozen)]
pub struct DlpackExport {
    ptr: u64,
    array: ArrayDesc,
    device_type: i32,
    device_id: i32,
    /// Other devices of the same type that may address the memory (a weight set mapped for a
    /// peer GPU as well): `__dlpack__(dl_device=(type, peer))` exports it as theirs.
    peers: Vec<i32>,
    /// What keeps `[ptr, ptr + bytes)` valid; each capsule holds a clone, so its last holder
    /// drops it (a weight set's is context-neutral: the capsule's deleter runs wherever PyTorch
    /// frees the tensor).
    owner: Arc<dyn Any + Send + Sync>,
}

impl DlpackExport {
    /// `owner` must keep `[ptr, ptr + bytes)` valid for as long as it lives.
    pub fn new(
        ptr: u64,
        bytes: usize,
        (device_type, device_id): (i32, i32),
        owner: Arc<dyn Any + Send + Sync>,
    ) -> Self {
        Self::of_array(
            ptr,
            ArrayDesc::bytes(bytes),
            (device_type, device_id),
            owner,
        )
    }

    /// The memory at `ptr` as `array` (element type, shape, strides); `owner` must keep
    /// `[ptr, ptr + array.span_bytes())` valid for as long as it lives.
    pub fn of_array(
        ptr: u64,
        array: ArrayDesc,
        (device_type, device_id): (i32, i32),
        owner: Arc<dyn Any + Send + Sync>,
    ) -> Self {
        Self {
            ptr,
            array,
            device_type,
            device_id,
            peers: Vec::new(),
            owner,
        }
    }

    /// Lets `__dlpack__(dl_device=...)` export the memory as that of any of `peers` (devices
    /// of the same type that may address it: those its mapping grants access to).
    pub fn with_peers(mut self, peers: impl IntoIterator<Item = i32>) -> Self {
        self.peers = peers
            .into_iter()
            .filter(|&peer| peer != self.device_id)
            .collect();
        self
    }

    /// The device a capsule says: the export's own, or `dl_device` when it names a peer.
    fn device_for(&self, dl_device: Option<(i32, i32)>) -> PyResult<(i32, i32)> {
        let own = (self.device_type, self.device_id);
        match dl_device {
            None => Ok(own),
            Some(asked) if asked == own => Ok(own),
            Some((kind, id)) if kind == self.device_type && self.peers.contains(&id) => {
                Ok((kind, id))
            }
            Some(asked) => Err(PyBufferError::new_err(format!(
                "dl_device {asked:?}: this memory is on {own:?} and mapped for devices {:?} of \
                 its type only (a copy to another device is not made here)",
                self.peers
            ))),
        }
    }
}

#[pymethods]
impl DlpackExport {
    /// The memory as a DLPack capsule (one-dimensional `uint8`, or the export's shape and
    /// element type): `torch.from_dlpack(obj)` is a
    /// zero-copy tensor over it that keeps the memory alive, with no NumPy needed. Exported
    /// memory has no work in flight when handed out, so `stream` needs no ordering.
    /// `dl_device=(type, id)` exports it as device `id`'s when its mapping grants that device
    /// access (a peer GPU writing a weight set: its copies are then copies on one device);
    /// any other device is a `BufferError` (no copy is made).
    #[pyo3(signature = (stream=None, max_version=None, dl_device=None, copy=None))]
    fn __dlpack__<'py>(
        &self,
        py: Python<'py>,
        stream: Option<&Bound<'py, PyAny>>,
        max_version: Option<&Bound<'py, PyAny>>,
        dl_device: Option<(i32, i32)>,
        copy: Option<bool>,
    ) -> PyResult<Bound<'py, PyAny>> {
        let _ = (stream, max_version);
        let device = self.device_for(dl_device)?;
        capsule_of(py, self.ptr, &self.array, device, copy, self.owner.clone())
    }

    /// `(device type, device)`: `(kDLCUDA, device)` for device memory, `(kDLCPU, 0)` for host
    /// memory.
    fn __dlpack_device__(&self) -> (i32, i32) {
        (self.device_type, self.device_id)
    }
}

/// Host bytes exported the same way, for the CPU test of the capsules (`torch.from_dlpack`
/// on the CPU): not for use.
#[pyclass(module = "stablebuf", name = "_DlpackProbe", extends = DlpackExport, frozen)]
pub struct DlpackProbe;

#[pymethods]
impl DlpackProbe {
    #[new]
    #[pyo3(signature = (values, peers=Vec::new()))]
    fn new(values: Vec<u8>, peers: Vec<i32>) -> PyClassInitializer<Self> {
        let bytes = Arc::new(values);
        let export = DlpackExport::new(bytes.as_ptr() as u64, bytes.len(), (DEVICE_CPU, 0), bytes)
            .with_peers(peers);
        PyClassInitializer::from(export).add_subclass(Self)
    }
}
