//! What is under each group's addresses of a space: a dataset's own memory, mapped there, or
//! memory the space owns holding a copy of a dataset's inputs
//! ([`BindStrategy`](crate::strategy::BindStrategy)).

use std::sync::Arc;

use crate::vmm_core::{Backend, MappedRange};

/// Memory mapped under part of a space: a dataset's, or the space's own.
#[derive(Debug)]
pub(super) struct Mapped<B: Backend> {
    // Field order is drop order: unmapped before the memory is released.
    pub(super) mapping: B::Mapping,
    pub(super) memory: Arc<B::Memory>,
}

impl<B: Backend> Mapped<B> {
    pub(super) fn ptr(&self) -> u64 {
        self.mapping.ptr()
    }

    /// Never unmap: the GPU may still use the memory.
    pub(super) fn leak_on_drop(&mut self) {
        self.mapping.leak_on_drop();
    }
}

/// A dataset mapped under a group.
#[derive(Debug)]
pub(super) struct Binding<B: Backend> {
    pub(super) dataset_id: u64,
    pub(super) mapped: Mapped<B>,
}

/// What is under one group's addresses.
#[derive(Debug)]
pub(super) enum Backing<B: Backend> {
    /// The bound dataset's own memory, mapped there.
    Remap(Option<Binding<B>>),
    /// Memory the space owns, holding a copy of the inputs of dataset `current`.
    CopyIn {
        resident: Mapped<B>,
        current: Option<u64>,
        /// The dataset whose inputs the memory holds, kept through an unbind (gone once a copy
        /// into it starts): binding it back after a failed offload or sleep copies nothing.
        held: Option<u64>,
    },
}

impl<B: Backend> Backing<B> {
    /// The id of the dataset whose data is under the group, if any.
    pub(super) fn dataset(&self) -> Option<u64> {
        match self {
            Backing::Remap(binding) => binding.as_ref().map(|b| b.dataset_id),
            Backing::CopyIn { current, .. } => *current,
        }
    }

    /// Never unmap: the GPU may still use the memory.
    pub(super) fn leak_on_drop(&mut self) {
        match self {
            Backing::Remap(Some(binding)) => binding.mapped.leak_on_drop(),
            Backing::Remap(None) => {}
            Backing::CopyIn { resident, .. } => resident.leak_on_drop(),
        }
    }
}
