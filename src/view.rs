//! Typed views of slots, usable with cudarc's copy helpers and cuBLAS.

use std::marker::PhantomData;
use std::sync::Arc;

use cudarc::driver::{
    sys, CudaStream, DevicePtr, DevicePtrMut, DeviceRepr, DeviceSlice, SyncOnDrop,
};

use crate::buffer::DeviceBuffer;
use crate::driver::{self, interop::impl_kernel_arg};
use crate::error::{Error, LayoutError, Result};

/// `len` elements of `T` at a slot's address, tied to a stream and to the space or dataset it
/// came from (`'a`). A cudarc citizen: `memcpy_htod`, `memcpy_dtoh`, `clone_dtoh`,
/// `memset_zeros`, `memcpy_dtod` and `CudaBlas::gemm` accept it, and it is a kernel argument.
///
/// Views never synchronise on drop (`SyncOnDrop::Sync(None)`), so they are safe to use while
/// capturing. Ordering against rebinding is the space's fence's job.
#[derive(Debug)]
pub struct SlotView<'a, T> {
    ptr: sys::CUdeviceptr,
    len: usize,
    stream: Arc<CudaStream>,
    _marker: PhantomData<Borrowed<'a, T>>,
}

/// What a view holds without owning: a borrow of its space or dataset, and elements of `T`.
type Borrowed<'a, T> = (&'a (), fn() -> T);

impl_kernel_arg!(SlotView<'c, T>, ptr);

impl<T> SlotView<'_, T> {
    pub(crate) fn new(
        ptr: sys::CUdeviceptr,
        slot: &str,
        bytes: usize,
        stream: &Arc<CudaStream>,
    ) -> Result<Self> {
        let len = element_count::<T>(slot, bytes)?;
        Ok(Self {
            ptr,
            len,
            stream: stream.clone(),
            _marker: PhantomData,
        })
    }

    /// Elements of `T` in the view.
    pub fn len(&self) -> usize {
        self.len
    }

    /// Whether the view has no elements (an empty [`slice`](Self::slice)).
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// The device address.
    pub fn device_ptr(&self) -> sys::CUdeviceptr {
        self.ptr
    }

    /// The `len` elements from element `start`: a checked sub-range of the view (say, the head
    /// of a 1 GiB slot), usable wherever the whole view is.
    pub fn slice(&self, start: usize, len: usize) -> Result<SlotView<'_, T>> {
        let elem = std::mem::size_of::<T>();
        crate::buffer::require_range("view slice", self.len, start, len)?;
        Ok(SlotView {
            ptr: self.ptr + (start * elem) as u64,
            len,
            stream: self.stream.clone(),
            _marker: PhantomData,
        })
    }
}

/// How many `T` fit exactly in `bytes`.
pub(crate) fn element_count<T>(slot: &str, bytes: usize) -> Result<usize> {
    let elem = std::mem::size_of::<T>();
    if elem == 0 || !bytes.is_multiple_of(elem) {
        return Err(Error::Layout(LayoutError::ElementSize {
            slot: slot.into(),
            bytes,
            elem_bytes: elem,
        }));
    }
    Ok(bytes / elem)
}

/// `Err(HostLength)` unless `data` is exactly `slot_bytes` long. Checked before a view is made,
/// so a wrong length is reported as such even when the slot is not a whole number of `T`.
pub(crate) fn require_host_len<T>(slot: &str, slot_bytes: usize, data: &[T]) -> Result<()> {
    let host_bytes = std::mem::size_of_val(data);
    if host_bytes != slot_bytes {
        return Err(Error::Layout(LayoutError::HostLength {
            slot: slot.into(),
            slot_bytes,
            host_bytes,
        }));
    }
    Ok(())
}

/// Copies `data` (exactly `slot_bytes`) into slot `slot` through the view `view` makes; the
/// length is checked first, so a wrong length is reported as such even when the slot is not a
/// whole number of `T`.
pub(crate) fn write_slot<'a, T: DeviceRepr>(
    slot: &str,
    slot_bytes: usize,
    data: &[T],
    view: impl FnOnce() -> Result<SlotView<'a, T>>,
) -> Result<()> {
    require_host_len(slot, slot_bytes, data)?;
    write(&mut view()?, slot, data)
}

/// `write` and `read` of a slot by name, for the holders of slots ([`Space`](crate::Space) and
/// [`Dataset`](crate::Dataset)): one implementation for both, through their `view` and
/// `slot_bytes`. `$write_doc` is `write`'s docs.
macro_rules! slot_copies {
    ($write_doc:expr) => {
        #[doc = $write_doc]
        pub fn write<T: cudarc::driver::DeviceRepr>(
            &self,
            stream: &std::sync::Arc<cudarc::driver::CudaStream>,
            name: &str,
            data: &[T],
        ) -> $crate::error::Result<()> {
            let bytes = self.slot_bytes(name)?;
            $crate::view::write_slot(name, bytes, data, || self.view::<T>(name, stream))
        }

        /// Copies slot `name` to the host.
        pub fn read<T: cudarc::driver::DeviceRepr>(
            &self,
            stream: &std::sync::Arc<cudarc::driver::CudaStream>,
            name: &str,
        ) -> $crate::error::Result<Vec<T>> {
            $crate::view::read(&self.view::<T>(name, stream)?)
        }
    };
}

pub(crate) use slot_copies;

/// Copies `data` into the view and waits for the copy, so `data` may be dropped at once.
pub(crate) fn write<T: DeviceRepr>(
    view: &mut SlotView<'_, T>,
    slot: &str,
    data: &[T],
) -> Result<()> {
    let host_bytes = std::mem::size_of_val(data);
    let slot_bytes = view.len * std::mem::size_of::<T>();
    if data.len() != view.len {
        return Err(Error::Layout(LayoutError::HostLength {
            slot: slot.into(),
            slot_bytes,
            host_bytes,
        }));
    }
    let stream = view.stream.clone();
    driver::traced("cuMemcpyHtoDAsync", host_bytes, || {
        stream.memcpy_htod(data, view)
    })?;
    driver::synchronize_stream(&stream)
}

/// Copies the view to a new host vector (blocking).
pub(crate) fn read<T: DeviceRepr>(view: &SlotView<'_, T>) -> Result<Vec<T>> {
    let stream = view.stream.clone();
    driver::traced(
        "cuMemcpyDtoHAsync",
        view.len * std::mem::size_of::<T>(),
        || stream.clone_dtoh(view),
    )
}

impl<T> DeviceSlice<T> for SlotView<'_, T> {
    fn len(&self) -> usize {
        self.len
    }

    fn stream(&self) -> &Arc<CudaStream> {
        &self.stream
    }
}

impl<T> DevicePtr<T> for SlotView<'_, T> {
    fn device_ptr<'b>(&'b self, _stream: &'b CudaStream) -> (sys::CUdeviceptr, SyncOnDrop<'b>) {
        (self.ptr, SyncOnDrop::Sync(None))
    }
}

impl<T> DevicePtrMut<T> for SlotView<'_, T> {
    fn device_ptr_mut<'b>(
        &'b mut self,
        _stream: &'b CudaStream,
    ) -> (sys::CUdeviceptr, SyncOnDrop<'b>) {
        (self.ptr, SyncOnDrop::Sync(None))
    }
}

impl<T> DeviceBuffer for SlotView<'_, T> {
    fn device_address(&self) -> sys::CUdeviceptr {
        self.ptr
    }

    fn byte_len(&self) -> usize {
        self.len * std::mem::size_of::<T>()
    }
}
