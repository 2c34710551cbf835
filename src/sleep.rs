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
    /// (its contents are not kept). Replays fail with
    /// [`GraphError::Asleep`](crate::error::GraphError::Asleep)
    /// until [`Space::wake`]. Datasets bound here but not passed stay bound. No-op if asleep
    /// (the first sleep's record of what to bind at wake is kept).
    ///
    /// All or nothing: if an offload fails (say, no host memory), the datasets this call already
    /// offloaded are restored and bound here again, and the space stays awake.
    pub fn sleep<'a>(
        &self,
        datasets: impl IntoIterator<Item = &'a mut Dataset>,
        storage: &HostStorage,
        stream: &Arc<CudaStream>,
    ) -> Result<Vec<TransferReport>> {
        if self.is_asleep() {
            return Ok(Vec::new());
        }
        let bound = self.shared.bound_datasets();
        let mut reports = Vec::new();
        let mut offloaded: Vec<&'a mut Dataset> = Vec::new();
        let mut failure = None;
        for dataset in datasets
            .into_iter()
            .filter(|d| bound.contains(&Some(d.id())))
        {
            match dataset.offload(storage, stream) {
                Ok(report) => {
                    reports.push(report);
                    offloaded.push(dataset);
                }
                Err(error) => {
                    failure = Some(error);
                    break;
                }
            }
        }
        let failure = match failure {
            Some(error) => Some(error),
            None => self.shared.enter_sleep(bound).err(),
        };
        if let Some(error) = failure {
            for dataset in offloaded.into_iter().rev() {
                if let Err(undo) = dataset.restore(stream).and_then(|_| self.bind(dataset)) {
                    tracing::error!(%undo, dataset = dataset.id(), "could not bring a dataset back after a failed sleep");
                }
            }
            return Err(error);
        }
        // A sleep is asked for to give the device memory back: the scratch memory handed to
        // the release queue (issue 43) goes now, with whatever else the device held.
        crate::driver::deferred::trim(self.context().ordinal());
        Ok(reports)
    }

    /// Wakes a sleeping space: new scratch memory (uninitialised) at the same addresses, and
    /// every dataset among `datasets` that was bound at sleep restored and bound again, so
    /// graphs captured before the sleep replay on the same contents. No-op when awake.
    ///
    /// If a restore or bind fails (say, out of device memory), the space stays asleep and the
    /// error is returned; what was restored and bound so far stays so, and a retry continues.
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
