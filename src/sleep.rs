//! Putting things to sleep: offloading and restoring tagged datasets. A space's own sleep and
//! wake ([`Space::sleep`](crate::Space::sleep), [`Space::wake`](crate::Space::wake)) live with
//! the space.

use std::sync::Arc;

use cudarc::driver::CudaStream;

use crate::dataset::Dataset;
use crate::error::Result;
use crate::host::{HostStorage, TransferReport};

/// Offloads every dataset tagged `tag` (see [`Dataset::set_tag`]), one after the other: each copy
/// already runs at full PCIe bandwidth, so copies in the same direction gain nothing from being
/// overlapped. Stops at the first error; datasets offloaded before it stay offloaded.
pub fn offload_tagged<'a>(
    datasets: impl IntoIterator<Item = &'a mut Dataset>,
    tag: &str,
    storage: &HostStorage,
    stream: &Arc<CudaStream>,
) -> Result<Vec<TransferReport>> {
    datasets
        .into_iter()
        .filter(|d| d.tag() == Some(tag))
        .map(|d| d.offload(storage, stream))
        .collect()
}

/// Restores every dataset tagged `tag`. Stops at the first error (say, out of memory); those
/// restored stay restored and the rest keep their host copies, so a retry continues.
pub fn restore_tagged<'a>(
    datasets: impl IntoIterator<Item = &'a mut Dataset>,
    tag: &str,
    stream: &Arc<CudaStream>,
) -> Result<Vec<TransferReport>> {
    datasets
        .into_iter()
        .filter(|d| d.tag() == Some(tag))
        .map(|d| d.restore(stream))
        .collect()
}
