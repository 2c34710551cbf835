//! Device memory as kernel and copy operands: the [`DeviceBuffer`] trait, the one range check
//! every launcher and copy uses, checked device-to-device copies, and the plain `cuMemAlloc`
//! buffer that benchmarks compare against.

use std::sync::Arc;

use cudarc::driver::{sys, CudaStream};

use crate::driver;
use crate::error::{Error, LayoutError, Result};

pub use crate::driver::linear::LinearBuffer;

/// Anything with a device address and a size in bytes: slots, views, pool blocks, mappings,
/// plain buffers. The kernel launchers and [`copy_between`] check every range against
/// [`DeviceBuffer::byte_len`] before they enqueue anything.
pub trait DeviceBuffer {
    /// The first device address.
    fn device_address(&self) -> sys::CUdeviceptr;
    /// Bytes usable from [`DeviceBuffer::device_address`] (0 when the memory is gone).
    fn byte_len(&self) -> usize;
}

/// `Err(BufferTooSmall)` unless `[offset, offset + bytes)` lies within `available` bytes;
/// `Err(InvalidShape)` if the end overflows. The one range check of launchers and copies.
pub(crate) fn require_range(
    what: &'static str,
    available: usize,
    offset: usize,
    bytes: usize,
) -> Result<()> {
    let needed = offset.checked_add(bytes).ok_or_else(|| {
        Error::Layout(LayoutError::InvalidShape(format!(
            "{what}: {offset} + {bytes} overflows"
        )))
    })?;
    if needed > available {
        return Err(Error::Layout(LayoutError::BufferTooSmall {
            what,
            needed,
            available,
        }));
    }
    Ok(())
}

/// Enqueues a copy of `bytes` from `source` at `source_offset` to `target` at `target_offset`
/// on `stream` (device to device). Both ranges are checked against the buffers' lengths first.
pub fn copy_between(
    stream: &Arc<CudaStream>,
    target: &impl DeviceBuffer,
    target_offset: usize,
    source: &impl DeviceBuffer,
    source_offset: usize,
    bytes: usize,
) -> Result<()> {
    require_range("copy target", target.byte_len(), target_offset, bytes)?;
    require_range("copy source", source.byte_len(), source_offset, bytes)?;
    if bytes == 0 {
        return Ok(());
    }
    driver::copy_device(
        stream,
        source.device_address() + source_offset as u64,
        target.device_address() + target_offset as u64,
        bytes,
    )
}

impl DeviceBuffer for LinearBuffer {
    fn device_address(&self) -> sys::CUdeviceptr {
        self.ptr()
    }

    fn byte_len(&self) -> usize {
        self.bytes()
    }
}

/// A raw mapping handed to a launcher is marked exposed: dropping it then waits for the whole
/// context before unmapping, since its owner cannot know which streams used it.
impl DeviceBuffer for driver::vmm::Mapping {
    fn device_address(&self) -> sys::CUdeviceptr {
        self.expose()
    }

    fn byte_len(&self) -> usize {
        self.bytes()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ranges_inside_pass_and_the_rest_are_typed_errors() {
        assert!(require_range("r", 10, 0, 10).is_ok());
        assert!(require_range("r", 10, 10, 0).is_ok());
        assert!(matches!(
            require_range("r", 10, 4, 7),
            Err(Error::Layout(LayoutError::BufferTooSmall {
                needed: 11,
                available: 10,
                ..
            }))
        ));
        assert!(matches!(
            require_range("r", 10, usize::MAX, 2),
            Err(Error::Layout(LayoutError::InvalidShape(_)))
        ));
    }
}
