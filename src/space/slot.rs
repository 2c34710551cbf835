//! [`Slot`]: a named, fixed address inside a space.

use cudarc::driver::sys;

use crate::buffer::DeviceBuffer;
use crate::driver::interop::impl_kernel_arg;
use crate::layout::Role;

/// A named, fixed address inside a space. Cheap to clone; pass `&Slot` as a kernel argument.
///
/// The address is valid for the life of the space. Whether memory is behind it depends on the
/// slot's group being bound (scratch slots always are, while the space is awake).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Slot {
    ptr: sys::CUdeviceptr,
    name: String,
    bytes: usize,
    role: Role,
    group: Option<String>,
}

impl_kernel_arg!(Slot, ptr);

impl Slot {
    pub(super) fn new(
        ptr: sys::CUdeviceptr,
        name: String,
        bytes: usize,
        role: Role,
        group: Option<String>,
    ) -> Self {
        Self {
            ptr,
            name,
            bytes,
            role,
            group,
        }
    }

    /// The name given in the layout.
    pub fn name(&self) -> &str {
        &self.name
    }

    /// The device address. Never changes for the life of the space.
    pub fn device_ptr(&self) -> sys::CUdeviceptr {
        self.ptr
    }

    /// Bytes declared in the layout.
    pub fn bytes(&self) -> usize {
        self.bytes
    }

    /// Input, output or scratch.
    pub fn role(&self) -> Role {
        self.role
    }

    /// The slot's group; `None` for scratch.
    pub fn group(&self) -> Option<&str> {
        self.group.as_deref()
    }
}

impl DeviceBuffer for Slot {
    fn device_address(&self) -> sys::CUdeviceptr {
        self.ptr
    }

    fn byte_len(&self) -> usize {
        self.bytes
    }
}
