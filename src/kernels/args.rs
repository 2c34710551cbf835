//! What the launchers of the kernel sets share: element sizes, the host-side checks of
//! dimensions and buffer sizes, and the grid-stride launch shape.

use cudarc::driver::LaunchConfig;

use crate::buffer::DeviceBuffer;
use crate::error::{Error, LayoutError, Result};

pub(super) const F32: usize = std::mem::size_of::<f32>();
pub(super) const U32: usize = std::mem::size_of::<u32>();
/// Bytes of one bf16 element (carried as `u16`).
pub(super) const BF16: usize = std::mem::size_of::<u16>();

pub(super) fn dim(name: &str, value: usize) -> Result<i32> {
    match i32::try_from(value) {
        Ok(v) if v > 0 => Ok(v),
        _ => Err(Error::Layout(LayoutError::InvalidShape(format!(
            "{name} = {value} must be in 1..=i32::MAX"
        )))),
    }
}

/// `Err` unless `buffer` holds `elems[0] × elems[1]` FP32 values.
pub(super) fn need(what: &'static str, buffer: &dyn DeviceBuffer, elems: [usize; 2]) -> Result<()> {
    need_elems(what, buffer, elems, F32)
}

/// `Err` unless `buffer` holds `elems[0] × elems[1]` elements of `elem_bytes` bytes each.
pub(super) fn need_elems(
    what: &'static str,
    buffer: &dyn DeviceBuffer,
    elems: [usize; 2],
    elem_bytes: usize,
) -> Result<()> {
    let needed = elems[0]
        .checked_mul(elems[1])
        .and_then(|n| n.checked_mul(elem_bytes))
        .ok_or_else(|| {
            Error::Layout(LayoutError::InvalidShape(format!(
                "{what}: {} x {} overflows",
                elems[0], elems[1]
            )))
        })?;
    if buffer.byte_len() < needed {
        return Err(Error::Layout(LayoutError::BufferTooSmall {
            what,
            needed,
            available: buffer.byte_len(),
        }));
    }
    Ok(())
}

pub(super) fn grid_stride(elements: u64) -> LaunchConfig {
    let blocks = elements.div_ceil(256).clamp(1, 8192) as u32;
    LaunchConfig {
        grid_dim: (blocks, 1, 1),
        block_dim: (256, 1, 1),
        shared_mem_bytes: 0,
    }
}
