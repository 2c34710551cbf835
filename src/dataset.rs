//! Datasets: the physical backing of one slot group.
//!
//! A dataset is ONE physical allocation laid out exactly like its group's slots, so binding it
//! is one mapping whatever the slot count (measured on the H100: 64 slots × 16 MiB rebind in
//! 3.17 ms as 64 mappings, 0.11 ms as one). It is also mapped at a private "home" address of its
//! own, so it can be filled, read and computed on whether or not any space binds it.
//!
//! A dataset is not tied to one space: it binds into any space whose layout has the same
//! fingerprint, even into several at once (the same memory mapped at several addresses).
//!
//! **Dropping a bound dataset unbinds it** from every space it is bound in (waiting on each
//! space's fence first), and then releases its memory. Those spaces' replays then fail with
//! [`Error::Unbound`] until another dataset is bound.

use std::sync::{Arc, Mutex, Weak};

use cudarc::driver::{CudaContext, CudaStream, DeviceRepr};

use crate::driver::vmm::{self, Mapping, Physical, Reservation};
use crate::error::{Error, Result};
use crate::fence::{Fence, FencePolicy};
use crate::layout::{Layout, Placement, Role};
use crate::space::{next_id, unbind_everywhere, SpaceShared};
use crate::view::{self, SlotView};

/// One slot of a dataset, at an offset from the dataset's start.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct DatasetSlot {
    pub name: String,
    pub role: Role,
    /// Offset inside the dataset (a multiple of the granularity).
    pub offset: usize,
    /// Bytes declared in the layout.
    pub bytes: usize,
    /// Bytes taken: `bytes` rounded up to the granularity.
    pub span: usize,
}

/// Physical memory for one group of a layout. See the module docs.
#[derive(Debug)]
pub struct Dataset {
    id: u64,
    ctx: Arc<CudaContext>,
    layout_fingerprint: u64,
    group: String,
    group_index: usize,
    slots: Vec<DatasetSlot>,
    fence: Mutex<Fence>,
    bound_in: Mutex<Vec<Weak<SpaceShared>>>,
    /// Maps the memory at the dataset's own address; owns the physical allocation.
    home: Mapping,
}

impl Dataset {
    pub(crate) fn new(
        ctx: &Arc<CudaContext>,
        layout: &Layout,
        placement: &Placement,
        group_index: usize,
        access: &[usize],
    ) -> Result<Self> {
        let region = &placement.groups[group_index];
        let physical = Arc::new(Physical::new(ctx, region.bytes, false)?);
        let reservation = Arc::new(Reservation::new(
            ctx,
            region.bytes,
            vmm::granularity(ctx, false)?,
        )?);
        let home = Mapping::new(&reservation, 0, &physical, 0, region.bytes, access)?;
        let slots = region
            .slots
            .iter()
            .map(|&i| {
                let s = &placement.slots[i];
                DatasetSlot {
                    name: s.name.clone(),
                    role: s.role,
                    offset: s.offset - region.offset,
                    bytes: s.bytes,
                    span: s.span,
                }
            })
            .collect();
        let id = next_id();
        tracing::debug!(dataset = id, group = %region.name, bytes = region.bytes, "dataset created");
        Ok(Self {
            id,
            ctx: ctx.clone(),
            layout_fingerprint: layout.fingerprint(),
            group: region.name.clone(),
            group_index,
            slots,
            fence: Mutex::new(Fence::new(ctx, FencePolicy::Context)),
            bound_in: Mutex::new(Vec::new()),
            home,
        })
    }

    /// Unique for the life of the process.
    pub fn id(&self) -> u64 {
        self.id
    }

    /// The group this dataset backs.
    pub fn group(&self) -> &str {
        &self.group
    }

    /// Bytes of physical memory (the group's size, rounded to the granularity).
    pub fn bytes(&self) -> usize {
        self.home.bytes()
    }

    /// Fingerprint of the layout it was made for.
    pub fn layout_fingerprint(&self) -> u64 {
        self.layout_fingerprint
    }

    pub fn slots(&self) -> &[DatasetSlot] {
        &self.slots
    }

    pub fn context(&self) -> &Arc<CudaContext> {
        &self.ctx
    }

    pub(crate) fn group_index(&self) -> usize {
        self.group_index
    }

    /// The dataset's private address (its home mapping).
    pub fn home_ptr(&self) -> u64 {
        self.home.ptr()
    }

    /// (offset, bytes) of each run of adjacent input slots, for copy-in binds.
    pub(crate) fn input_runs(&self) -> Vec<(usize, usize)> {
        self.runs(|role| role != Role::Output)
    }

    /// (offset, bytes) of each run of adjacent output slots, for copy-out.
    pub(crate) fn output_runs(&self) -> Vec<(usize, usize)> {
        self.runs(|role| role == Role::Output)
    }

    fn runs(&self, keep: impl Fn(Role) -> bool) -> Vec<(usize, usize)> {
        let mut runs: Vec<(usize, usize)> = Vec::new();
        let mut previous_end = None;
        for slot in self.slots.iter().filter(|s| keep(s.role)) {
            match runs.last_mut() {
                // Adjacent (this slot starts where the last one's span ended): extend the run.
                Some((offset, bytes)) if previous_end == Some(slot.offset) => {
                    *bytes = slot.offset + slot.bytes - *offset
                }
                _ => runs.push((slot.offset, slot.bytes)),
            }
            previous_end = Some(slot.offset + slot.span);
        }
        runs
    }

    pub(crate) fn physical(&self) -> &Arc<Physical> {
        self.home.physical()
    }

    pub(crate) fn note_bound_in(&self, space: Weak<SpaceShared>) {
        let mut spaces = self.bound_in.lock().unwrap_or_else(|p| p.into_inner());
        spaces.retain(|s| s.strong_count() > 0);
        if !spaces.iter().any(|s| s.ptr_eq(&space)) {
            spaces.push(space);
        }
    }

    fn slot(&self, name: &str) -> Result<&DatasetSlot> {
        self.slots
            .iter()
            .find(|s| s.name == name)
            .ok_or_else(|| Error::UnknownSlot { slot: name.into() })
    }

    /// A typed view of slot `name` at the dataset's home address (not the space's), to fill or
    /// read the dataset with cudarc copies or kernels whether or not it is bound.
    pub fn view<T>(&self, name: &str, stream: &Arc<CudaStream>) -> Result<SlotView<'_, T>> {
        let slot = self.slot(name)?;
        self.fence
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .attach(stream);
        SlotView::new(
            self.home.ptr() + slot.offset as u64,
            &slot.name,
            slot.bytes,
            stream,
        )
    }

    /// Copies `data` (exactly the slot's size) into slot `name`; returns when the copy is done.
    pub fn write<T: DeviceRepr>(
        &self,
        stream: &Arc<CudaStream>,
        name: &str,
        data: &[T],
    ) -> Result<()> {
        let slot = self.slot(name)?;
        view::require_host_len(name, slot.bytes, data)?;
        let mut view = self.view::<T>(name, stream)?;
        view::write(&mut view, name, data)
    }

    /// Copies slot `name` to the host.
    pub fn read<T: DeviceRepr>(&self, stream: &Arc<CudaStream>, name: &str) -> Result<Vec<T>> {
        view::read(&self.view::<T>(name, stream)?)
    }
}

impl Drop for Dataset {
    fn drop(&mut self) {
        let spaces = std::mem::take(self.bound_in.get_mut().unwrap_or_else(|p| p.into_inner()));
        for space in &spaces {
            if let Err(error) = unbind_everywhere(space, self.id, self.group_index) {
                // The space keeps its mapping, and the mapping keeps the memory alive: nothing is
                // freed under the GPU. It is released when that space unbinds or drops.
                tracing::error!(%error, dataset = self.id, "could not unbind a dropped dataset");
            }
        }
        let fence = self.fence.get_mut().unwrap_or_else(|p| p.into_inner());
        if let Err(error) = fence.wait() {
            tracing::error!(%error, dataset = self.id, "waiting for the GPU before freeing a dataset failed; leaking it");
            self.home.leak_on_drop();
        }
        // `home` drops next: unmap, then release (unless a space still maps it), then free.
    }
}
