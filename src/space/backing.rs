//! What is under each group's addresses of a space: a dataset's own memory, mapped there, or
//! memory the space owns holding a copy of a dataset's inputs
//! ([`BindStrategy`](crate::BindStrategy)).

use crate::driver::vmm::Mapping;

/// A dataset mapped under a group.
#[derive(Debug)]
pub(super) struct Binding {
    pub(super) dataset_id: u64,
    pub(super) mapping: Mapping,
}

/// What is under one group's addresses.
#[derive(Debug)]
pub(super) enum Backing {
    /// The bound dataset's own memory, mapped there.
    Remap(Option<Binding>),
    /// Memory the space owns, holding a copy of the inputs of dataset `current`.
    CopyIn {
        resident: Mapping,
        current: Option<u64>,
    },
}

impl Backing {
    /// The id of the dataset whose data is under the group, if any.
    pub(super) fn dataset(&self) -> Option<u64> {
        match self {
            Backing::Remap(binding) => binding.as_ref().map(|b| b.dataset_id),
            Backing::CopyIn { current, .. } => *current,
        }
    }

    /// Never unmap: the GPU may still use the memory (see [`Mapping::leak_on_drop`]).
    pub(super) fn leak_on_drop(&mut self) {
        match self {
            Backing::Remap(Some(binding)) => binding.mapping.leak_on_drop(),
            Backing::Remap(None) => {}
            Backing::CopyIn { resident, .. } => resident.leak_on_drop(),
        }
    }
}
