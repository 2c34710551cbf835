//! Putting things to sleep: offloading tagged datasets, and a space's sleep and wake (its bound
//! datasets offloaded and restored, its scratch memory released and recreated).

use std::sync::Arc;

use cudarc::driver::CudaStream;

use crate::dataset::Dataset;
use crate::error::Result;
use crate::host::{HostStorage, TransferReport};
use crate::space::Space;

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

impl Space {
    /// Puts the space to sleep: every dataset among `datasets` that is bound here is offloaded to
    /// `storage` (unbinding it after the GPU is done with it), and the scratch memory is released
    /// (its contents are not kept). Replays fail with [`Error::Asleep`](crate::Error::Asleep)
    /// until [`Space::wake`]. Datasets bound here but not passed stay bound.
    pub fn sleep<'a>(
        &self,
        datasets: impl IntoIterator<Item = &'a mut Dataset>,
        storage: &HostStorage,
        stream: &Arc<CudaStream>,
    ) -> Result<Vec<TransferReport>> {
        let bound = self.shared.bound_datasets();
        let mut reports = Vec::new();
        for dataset in datasets
            .into_iter()
            .filter(|d| bound.contains(&Some(d.id())))
        {
            reports.push(dataset.offload(storage, stream)?);
        }
        self.shared.enter_sleep(bound)?;
        Ok(reports)
    }

    /// Wakes a sleeping space: new scratch memory (uninitialised) at the same addresses, and
    /// every dataset among `datasets` that was bound at sleep restored and bound again, so
    /// graphs captured before the sleep replay on the same contents. No-op when awake.
    pub fn wake<'a>(
        &self,
        datasets: impl IntoIterator<Item = &'a mut Dataset>,
        stream: &Arc<CudaStream>,
    ) -> Result<Vec<TransferReport>> {
        let Some(sleeping) = self.shared.sleeping() else {
            return Ok(Vec::new());
        };
        self.shared.restore_scratch()?;
        let mut reports = Vec::new();
        for dataset in datasets
            .into_iter()
            .filter(|d| sleeping.contains(&Some(d.id())))
        {
            reports.push(dataset.restore(stream)?);
            self.bind(dataset)?;
        }
        self.shared.leave_sleep();
        Ok(reports)
    }
}
