//! Devices and peer access between them, and whether there is a driver at all.

use cudarc::driver::{result, sys};

use super::{traced, traced_raw};
use crate::error::{DriverError, Error, Result};

// Which of cudarc's modes is on decides how `driver_present` can tell; with none of ours on,
// cudarc may still be loading dynamically through another crate's `fallback-dynamic-loading`.
#[cfg(not(any(
    feature = "dynamic-loading",
    feature = "dynamic-linking",
    feature = "static-linking"
)))]
compile_error!(
    "stablebuf: turn on one of the features `dynamic-loading` (the default), `dynamic-linking` \
     (beside candle-core's `cuda`) or `static-linking`"
);

/// Whether libcuda can be loaded here. Everything else in the crate needs it.
#[cfg(feature = "dynamic-loading")]
pub fn driver_present() -> bool {
    // SAFETY: only tries to open the shared library; no CUDA call is made.
    unsafe { sys::is_culib_present() }
}

/// Whether libcuda can be loaded here. Linked builds only start where the loader found libcuda,
/// so this is always true.
#[cfg(not(feature = "dynamic-loading"))]
pub fn driver_present() -> bool {
    true
}

/// How many CUDA devices this process sees (needs the driver; 0 without one is an error).
pub fn device_count() -> Result<usize> {
    if !driver_present() {
        return Err(Error::Driver(DriverError::NoDriver));
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
    if !driver_present() {
        return Err(Error::Driver(DriverError::NoDriver));
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
