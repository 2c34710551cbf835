//! A device range by address, shared by the examples' modules (`decode/`, `kv/`) and the GPU
//! tests that include them: what graph work owns in place of a borrowed slot view.

use stablebuf::cudarc::driver::sys;
use stablebuf::DeviceBuffer;

/// A device range given by address: a slot, a part of one, a dataset's own memory or a static
/// buffer, all the same to the launchers.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Raw {
    pub ptr: sys::CUdeviceptr,
    pub bytes: usize,
}

impl DeviceBuffer for Raw {
    fn device_address(&self) -> sys::CUdeviceptr {
        self.ptr
    }
    fn byte_len(&self) -> usize {
        self.bytes
    }
}

impl Raw {
    pub fn of(buffer: &impl DeviceBuffer) -> Self {
        Self {
            ptr: buffer.device_address(),
            bytes: buffer.byte_len(),
        }
    }

    /// `bytes` from `offset`; panics outside the range (a bug in this file, not bad input).
    pub fn part(&self, offset: usize, bytes: usize) -> Self {
        assert!(offset + bytes <= self.bytes, "part outside its range");
        Self {
            ptr: self.ptr + offset as u64,
            bytes,
        }
    }
}
