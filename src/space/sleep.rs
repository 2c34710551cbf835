//! A space's sleep and wake, straight down: the space unbinds its own groups, each dataset
//! copies its bytes out and releases its memory, and nothing calls back up.
//!
//! ```text
//!   Space::sleep
//!     1. begin: fence wait; the passed datasets' groups and the scratch taken out of the
//!        replay path (mappings kept); replays see Asleep
//!     2. each dataset: unbound from other spaces, bytes saved to the host (device memory kept)
//!     3. commit: the taken mappings dropped, each dataset's memory released, one trim
//!        or undo: the host copies dropped, the mappings put back (no driver call can fail)
//! ```

use std::sync::Arc;

use cudarc::driver::CudaStream;

use super::backing::{Backing, Binding, Mapped};
use super::{Space, SpaceShared};
use crate::dataset::{Binder, Dataset, DatasetOf, Saved};
use crate::error::Result;
use crate::host::{HostStorage, TransferReport};
use crate::vmm_core::{Backend, Waiter};

/// What a sleep took out of the space before the datasets were saved: put back on failure,
/// dropped (unmapped) once every save succeeded.
#[derive(Debug)]
struct Taken<B: Backend> {
    /// The groups unbound by the sleep and what was under each.
    groups: Vec<(usize, TakenBacking<B>)>,
    scratch: Option<Mapped<B>>,
}

/// A dataset whose bytes a sleep saved, and the other spaces it was unbound from for it.
type SavedDataset<'a, B, D> = (&'a mut D, Saved<B>, Vec<Arc<dyn Binder<B>>>);

#[derive(Debug)]
enum TakenBacking<B: Backend> {
    /// A remap group's mapping of the dataset's memory.
    Remap(Binding<B>),
    /// A copy-in group's claim that its memory holds this dataset's inputs.
    CopyIn(u64),
}

impl Space {
    /// Puts the space to sleep: every dataset among `datasets` that is bound here is offloaded to
    /// `storage` (unbinding it after the GPU is done with it), and the scratch memory is released
    /// (its contents are not kept). Replays fail with
    /// [`GraphError::Asleep`](crate::error::GraphError::Asleep)
    /// until [`Space::wake`]. Datasets bound here but not passed stay bound. No-op if asleep
    /// (the first sleep's record of what to bind at wake is kept).
    ///
    /// All or nothing: if an offload fails (say, no host memory), nothing was released yet: the
    /// datasets stay on the device and bound here (and wherever else they were), and the space
    /// stays awake.
    pub fn sleep<'a>(
        &self,
        datasets: impl IntoIterator<Item = &'a mut Dataset>,
        storage: &HostStorage,
        stream: &Arc<CudaStream>,
    ) -> Result<Vec<TransferReport>> {
        self.shared.sleep(datasets, storage, stream)
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
        self.shared.wake(datasets, stream)
    }
}

impl<B: Backend> TakenBacking<B> {
    fn dataset(&self) -> u64 {
        match self {
            TakenBacking::Remap(binding) => binding.dataset_id,
            TakenBacking::CopyIn(id) => *id,
        }
    }
}

impl<B: Backend> SpaceShared<B> {
    /// See [`Space::sleep`].
    pub(crate) fn sleep<'a, D: DatasetOf<B> + 'a>(
        self: &Arc<Self>,
        datasets: impl IntoIterator<Item = &'a mut D>,
        storage: &HostStorage,
        stream: &B::Stream,
    ) -> Result<Vec<TransferReport>> {
        let mut datasets: Vec<&'a mut D> = datasets.into_iter().collect();
        let ids: Vec<u64> = datasets.iter().map(|d| d.core().id()).collect();
        let Some(taken) = self.begin_sleep(&ids)? else {
            return Ok(Vec::new());
        };
        // Only the datasets whose groups the sleep took.
        datasets.retain(|d| {
            let id = d.core().id();
            taken.groups.iter().any(|(_, t)| t.dataset() == id)
        });
        let me = self.binder();
        let mut saved: Vec<SavedDataset<'a, B, D>> = Vec::new();
        let mut failure = None;
        for dataset in datasets {
            let core = dataset.core();
            // Bound in other spaces too: out of those first (a lone offload's step).
            let others = match core.unbind_all(Some(&me)) {
                Ok(others) => others,
                Err(error) => {
                    failure = Some(error);
                    break;
                }
            };
            match core.save_to_host(storage, stream) {
                Ok(copy) => saved.push((dataset, copy, others)),
                Err(error) => {
                    core.bind_again_in(&others);
                    failure = Some(error);
                    break;
                }
            }
        }
        if let Some(error) = failure {
            for (dataset, copy, others) in saved.into_iter().rev() {
                drop(copy); // the host memory goes back
                dataset.core().bind_again_in(&others);
            }
            self.cancel_sleep(taken);
            return Err(error);
        }
        // Unmaps the groups' mappings and the scratch: the fence in `begin_sleep` drained their
        // use, and nothing could use them since.
        drop(taken);
        let reports = saved
            .into_iter()
            .map(|(dataset, copy, _)| dataset.core_mut().release_to_host(copy))
            .collect();
        // A sleep is asked for to give the device memory back: what the release queue holds
        // (issue 43) goes now, with whatever else the device held.
        self.backend.release_held();
        Ok(reports)
    }

    /// See [`Space::wake`].
    pub(crate) fn wake<'a, D: DatasetOf<B> + 'a>(
        self: &Arc<Self>,
        datasets: impl IntoIterator<Item = &'a mut D>,
        stream: &B::Stream,
    ) -> Result<Vec<TransferReport>> {
        let Some(sleeping) = self.sleeping() else {
            return Ok(Vec::new());
        };
        self.restore_scratch()?;
        let mut reports = Vec::new();
        for dataset in datasets
            .into_iter()
            .filter(|d| sleeping.contains(&Some(d.core().id())))
        {
            reports.push(dataset.restore_on(stream)?);
            self.bind_noted(dataset.core(), None)?;
        }
        self.leave_sleep();
        Ok(reports)
    }
    /// The first step of a sleep: `None` if asleep. Otherwise, after the fence, takes every group
    /// bound to one of `datasets` and the scratch out of the replay path (their mappings kept in
    /// the returned [`Taken`]), and records what each group had bound: the space is asleep.
    fn begin_sleep(&self, datasets: &[u64]) -> Result<Option<Taken<B>>> {
        let mut state = self.lock();
        if state.sleeping.is_some() {
            return Ok(None);
        }
        let bound: Vec<Option<u64>> = state.backings.iter().map(Backing::dataset).collect();
        state.fence.wait()?;
        let mut groups = Vec::new();
        for (index, backing) in state.backings.iter_mut().enumerate() {
            if !bound[index].is_some_and(|id| datasets.contains(&id)) {
                continue;
            }
            let taken = match backing {
                Backing::Remap(slot) => slot.take().map(TakenBacking::Remap),
                Backing::CopyIn { current, .. } => current.take().map(TakenBacking::CopyIn),
            };
            if let Some(taken) = taken {
                groups.push((index, taken));
            }
        }
        for (index, _) in &groups {
            state.bound.set(*index, false);
        }
        let scratch = state.scratch.take();
        state.sleeping = Some(bound);
        tracing::debug!(space = self.id, groups = groups.len(), "sleeping");
        Ok(Some(Taken { groups, scratch }))
    }

    /// Undoes [`SpaceShared::begin_sleep`] after a failed save: the space is awake with what it
    /// had, except where a bind in the meantime put something else (then that stays).
    fn cancel_sleep(&self, taken: Taken<B>) {
        let mut state = self.lock();
        let state = &mut *state;
        for (index, taken) in taken.groups {
            let put_back = match (&mut state.backings[index], taken) {
                (Backing::Remap(slot @ None), TakenBacking::Remap(binding)) => {
                    *slot = Some(binding);
                    true
                }
                (
                    Backing::CopyIn {
                        current: current @ None,
                        held: Some(held),
                        ..
                    },
                    TakenBacking::CopyIn(id),
                ) if *held == id => {
                    *current = Some(id);
                    true
                }
                // Bound anew meanwhile: the taken mapping goes (nothing used it since the fence).
                _ => false,
            };
            if put_back {
                state.bound.set(index, true);
            }
        }
        if state.scratch.is_none() {
            state.scratch = taken.scratch;
        }
        state.sleeping = None;
    }
}
