//! Devices and peer access between them.

use cudarc::driver::{result, sys};

use super::{traced, traced_raw};
use crate::error::{Error, Result};

/// How many CUDA devices this process sees (needs the driver; 0 without one is an error).
pub fn device_count() -> Result<usize> {
    if !super::driver_present() {
        return Err(Error::NoDriver);
    }
    // cuInit is idempotent; cudarc calls it before any context is made.
    traced("cuInit", 0, result::init)?;
    traced("cuDeviceGetCount", 0, result::device::get_count).map(|n| n.max(0) as usize)
}

/// Whether kernels on device `from` can read and write memory that lives on device `to`
/// (`cuDeviceCanAccessPeer`; true when they are the same device).
pub fn can_access_peer(from: usize, to: usize) -> Result<bool> {
    if from == to {
        return Ok(true);
    }
    if !super::driver_present() {
        return Err(Error::NoDriver);
    }
    let device = |ordinal: usize| traced("cuDeviceGet", 0, || result::device::get(ordinal as i32));
    let (from, to) = (device(from)?, device(to)?);
    let mut can: i32 = 0;
    traced_raw("cuDeviceCanAccessPeer", 0, || {
        // SAFETY: `can` is a valid out-pointer; both handles came from cuDeviceGet.
        unsafe { sys::cuDeviceCanAccessPeer(&mut can, from, to) }
    })?;
    Ok(can != 0)
}
