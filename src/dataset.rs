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
//! [`GraphError::Unbound`](crate::error::GraphError::Unbound) until another dataset is bound.
//!
//! The bytes' life (create, offload, restore, drop) is [`DatasetCore`], generic over the
//! driver ([`Backend`]) so that it runs against the fake driver in tests; [`Dataset`] is it on
//! the real driver, with what only the real one has (views, export, the refill callback).

use std::sync::{Arc, Mutex, Weak};

use cudarc::driver::{CudaContext, CudaStream};

use crate::driver::vmm::{Location, Physical};
use crate::error::{DriverError, Error, LayoutError, OffloadError, Result};
use crate::fence::FencePolicy;
use crate::host::{self, HostStorage, StorageUsed, TransferReport};
use crate::ids::next_id;
use crate::layout::{Layout, Placement, Role};
use crate::view::{self, SlotView};
use crate::vmm_core::{Backend, MappedRange, Vmm, Waiter};

/// One slot of a dataset, at an offset from the dataset's start.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct DatasetSlot {
    /// The slot's name in the layout.
    pub name: String,
    /// Input or output (a dataset holds no scratch slots).
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
    pub(crate) core: DatasetCore<Vmm>,
    tag: Option<String>,
    refill: Option<RefillFn>,
}

/// A dataset on backend `B`: its identity, its shape, where its bytes are, and the spaces it is
/// bound in.
#[derive(Debug)]
pub(crate) struct DatasetCore<B: Backend> {
    id: u64,
    backend: B,
    layout_fingerprint: u64,
    group: String,
    group_index: usize,
    slots: Vec<DatasetSlot>,
    fence: Mutex<B::Fence>,
    /// The spaces (or anything else) this dataset is bound in.
    bound_in: Mutex<Vec<Weak<dyn Binder<B>>>>,
    bytes: usize,
    shareable: bool,
    /// Where the memory lives (also after a restore).
    location: Location,
    /// Where the bytes are: mapped at the dataset's own address (owning the physical memory),
    /// or on the host after an offload.
    residency: Residency<B>,
}

/// Something a dataset can be bound in (a space). The binding layer implements it, so a dataset
/// takes itself out of every binder before its memory goes without knowing what a space is.
/// Only a lone offload and a drop reach up through it; a space's sleep unbinds its own groups.
pub(crate) trait Binder<B: Backend>: Send + Sync {
    /// Unbinds dataset `dataset` (of group index `group`) if it is bound here, after the
    /// binder's fence; returns whether it was.
    fn unbind_dataset(&self, dataset: u64, group: usize) -> Result<bool>;
    /// Binds `dataset` again (undoing an unbind when an offload fails).
    fn bind_again(&self, dataset: &DatasetCore<B>) -> Result<()>;
}

/// What a space's sleep and wake need of a dataset, on the real driver ([`Dataset`], whose
/// restore also refills) or any ([`DatasetCore`]).
pub(crate) trait DatasetOf<B: Backend> {
    fn core(&self) -> &DatasetCore<B>;
    fn core_mut(&mut self) -> &mut DatasetCore<B>;
    /// [`DatasetCore::restore`], and whatever else a restore does for this kind of dataset.
    fn restore_on(&mut self, stream: &B::Stream) -> Result<TransferReport>;
}

/// Regenerates a discarded dataset's contents on restore (say, reloads weights from disk).
pub type Refill = Box<dyn FnMut(&Dataset, &Arc<CudaStream>) -> Result<()> + Send + Sync>;

/// Holds a [`Refill`]; it is a closure, so `Debug` shows only that one is set.
struct RefillFn(Refill);

impl std::fmt::Debug for RefillFn {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("Refill")
    }
}

/// Where a dataset's bytes are.
#[derive(Debug)]
enum Residency<B: Backend> {
    // Field order is drop order: unmapped, then released, then the addresses freed.
    Device {
        home: B::Mapping,
        memory: Arc<B::Memory>,
        reservation: B::Reservation,
    },
    /// Offloaded. The home address range stays reserved, so a restore maps the new memory at the
    /// same home address without reserving (and later freeing) addresses again.
    Host {
        copy: B::HostCopy,
        home: B::Reservation,
    },
}

/// A dataset's bytes copied to the host by [`DatasetCore::save_to_host`], its device memory
/// still held: half an offload.
#[derive(Debug)]
pub(crate) struct Saved<B: Backend> {
    copy: B::HostCopy,
    report: TransferReport,
}

impl<B: Backend> DatasetCore<B> {
    /// Fresh memory at `at` for group `group_index` of `placement`, mapped at a home address.
    pub(crate) fn new(
        backend: B,
        layout_fingerprint: u64,
        placement: &Placement,
        group_index: usize,
        shareable: bool,
        at: Location,
    ) -> Result<Self> {
        let bytes = placement.groups[group_index].bytes;
        let memory = Arc::new(backend.create_at(bytes, shareable, at)?);
        Self::from_memory(
            backend,
            layout_fingerprint,
            placement,
            group_index,
            memory,
            shareable,
            at,
        )
    }

    /// A dataset over existing memory of the group's size (fresh, or imported).
    pub(crate) fn from_memory(
        backend: B,
        layout_fingerprint: u64,
        placement: &Placement,
        group_index: usize,
        memory: Arc<B::Memory>,
        shareable: bool,
        location: Location,
    ) -> Result<Self> {
        let region = &placement.groups[group_index];
        let (reservation, home) = backend.map_alone(&memory)?;
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
            fence: Mutex::new(backend.fence(FencePolicy::Context)),
            backend,
            layout_fingerprint,
            group: region.name.clone(),
            group_index,
            slots,
            bound_in: Mutex::new(Vec::new()),
            bytes: region.bytes,
            shareable,
            location,
            residency: Residency::Device {
                home,
                memory,
                reservation,
            },
        })
    }

    pub(crate) fn id(&self) -> u64 {
        self.id
    }

    pub(crate) fn group(&self) -> &str {
        &self.group
    }

    pub(crate) fn group_index(&self) -> usize {
        self.group_index
    }

    pub(crate) fn bytes(&self) -> usize {
        self.bytes
    }

    pub(crate) fn layout_fingerprint(&self) -> u64 {
        self.layout_fingerprint
    }

    /// The device whose memory this is.
    pub(crate) fn device(&self) -> usize {
        self.backend.device()
    }

    pub(crate) fn is_resident(&self) -> bool {
        matches!(self.residency, Residency::Device { .. })
    }

    /// The home address; `Err(Offloaded)` while offloaded.
    pub(crate) fn home_ptr(&self) -> Result<u64> {
        match &self.residency {
            Residency::Device { home, .. } => Ok(home.ptr()),
            Residency::Host { .. } => Err(self.offloaded()),
        }
    }

    /// The device memory; `Err(Offloaded)` while offloaded.
    pub(crate) fn memory(&self) -> Result<&Arc<B::Memory>> {
        match &self.residency {
            Residency::Device { memory, .. } => Ok(memory),
            Residency::Host { .. } => Err(self.offloaded()),
        }
    }

    fn offloaded(&self) -> Error {
        Error::Offload(OffloadError::Offloaded { dataset: self.id })
    }

    /// Records that `stream` may use the dataset's memory (its fence waits for it).
    pub(crate) fn attach(&self, stream: &B::Stream) {
        let mut fence = self.fence.lock().unwrap_or_else(|p| p.into_inner());
        self.backend.attach(&mut fence, stream);
    }

    /// See [`Dataset::offload`].
    pub(crate) fn offload(
        &mut self,
        storage: &HostStorage,
        stream: &B::Stream,
    ) -> Result<TransferReport> {
        if !self.is_resident() {
            return Ok(TransferReport {
                dataset: self.id,
                bytes: 0,
                elapsed: Default::default(),
                storage: StorageUsed::Discarded,
            });
        }
        // Nothing may still write the memory while it is copied out. A lone offload is the one
        // place a dataset reaches up into the spaces that bind it (`Binder`); a space's sleep
        // unbinds its own groups itself and only asks for the copy and the release.
        let unbound_from = self.unbind_all(None)?;
        let saved = match self.save_to_host(storage, stream) {
            Ok(saved) => saved,
            Err(error) => {
                // Still on the device with its contents: put it back where it was bound.
                self.bind_again_in(&unbound_from);
                return Err(error);
            }
        };
        let report = self.release_to_host(saved);
        // An offload is asked for to free device memory ("free memory rises by `bytes`"): what
        // the release handed to the release queue (issue 43) goes now, with whatever else the
        // device held for release.
        self.backend.release_held();
        Ok(report)
    }

    /// The first half of an offload: after the dataset's fence, copies its bytes to `storage`
    /// and returns them, keeping the device memory. The caller must have unbound it everywhere
    /// first ([`DatasetCore::unbind_all`], or a space's own sleep). Dropping the result gives
    /// the host memory back and leaves the dataset as it was;
    /// [`DatasetCore::release_to_host`] finishes the offload. `Err(Offloaded)` if offloaded.
    pub(crate) fn save_to_host(
        &self,
        storage: &HostStorage,
        stream: &B::Stream,
    ) -> Result<Saved<B>> {
        let home_ptr = self.home_ptr()?;
        let mut copy = None;
        let report = host::timed(self.id, self.bytes, "offload", || {
            self.fence
                .lock()
                .unwrap_or_else(|p| p.into_inner())
                .wait()?;
            let pieces = host::copy::back_to_back(&[(home_ptr, self.bytes)]);
            let saved = self.backend.save(storage, stream, &pieces)?;
            let used = B::storage_used(&saved);
            copy = Some(saved);
            Ok(used)
        })?;
        let copy = copy.ok_or_else(|| self.offloaded())?;
        Ok(Saved { copy, report })
    }

    /// The second half of an offload, which cannot fail: the bytes saved by
    /// [`DatasetCore::save_to_host`] become the dataset's, and its home mapping is dropped,
    /// which unmaps and releases the device memory once no space maps it (the caller unbound
    /// it everywhere, after the fences, before the save). Returns the save's report.
    pub(crate) fn release_to_host(&mut self, saved: Saved<B>) -> TransferReport {
        let Saved { copy, report } = saved;
        if let Residency::Device { reservation, .. } = &self.residency {
            // The home range stays reserved for the restore.
            let home = reservation.clone();
            self.residency = Residency::Host { copy, home };
        }
        report
    }

    /// See [`Dataset::restore`] (without the refill).
    pub(crate) fn restore(&mut self, stream: &B::Stream) -> Result<TransferReport> {
        let (id, bytes) = (self.id, self.bytes);
        let Residency::Host {
            copy,
            home: reservation,
        } = &self.residency
        else {
            return Ok(TransferReport {
                dataset: id,
                bytes: 0,
                elapsed: Default::default(),
                storage: StorageUsed::Arena,
            });
        };
        let mut restored = None;
        let report = host::timed(id, bytes, "restore", || {
            // Same home address as before the offload: only create and map.
            let mapped = self
                .backend
                .create_at(bytes, self.shareable, self.location)
                .map(Arc::new)
                .and_then(|memory| {
                    let home = self.backend.map(reservation, 0, &memory, bytes)?;
                    Ok((home, memory))
                });
            let (home, memory) = match mapped {
                Err(Error::Driver(DriverError::OutOfMemory { .. })) => {
                    return Err(Error::Offload(OffloadError::RestoreOutOfMemory {
                        dataset: id,
                        asked: bytes,
                        free: self.backend.free_memory(),
                    }));
                }
                other => other?,
            };
            let pieces = host::copy::back_to_back(&[(home.ptr(), bytes)]);
            // On an error `home` drops: unmapped (the load waited for its copies) and released.
            self.backend.load(copy, stream, &pieces)?;
            restored = Some((home, memory));
            Ok(B::storage_used(copy))
        })?;
        if let Some((home, memory)) = restored {
            let reservation = reservation.clone();
            // Drops the host copy.
            self.residency = Residency::Device {
                home,
                memory,
                reservation,
            };
        }
        Ok(report)
    }

    /// Unbinds this dataset from every space it is bound in (each after its fence), but
    /// `except` (a space that unbound it itself); returns those it was unbound from. All or
    /// nothing: if one unbind fails, the dataset is bound again in those it was already taken
    /// out of, and the error returned.
    pub(crate) fn unbind_all(
        &self,
        except: Option<&Weak<dyn Binder<B>>>,
    ) -> Result<Vec<Arc<dyn Binder<B>>>> {
        let binders = self
            .bound_in
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .clone();
        let mut unbound = Vec::new();
        let others = binders
            .iter()
            .filter(|b| except.is_none_or(|except| !b.ptr_eq(except)));
        for binder in others.filter_map(Weak::upgrade) {
            match binder.unbind_dataset(self.id, self.group_index) {
                Ok(true) => unbound.push(binder),
                Ok(false) => {}
                Err(error) => {
                    self.bind_again_in(&unbound);
                    return Err(error);
                }
            }
        }
        Ok(unbound)
    }

    /// Binds this dataset again in `binders` (undoing [`DatasetCore::unbind_all`]), logging
    /// failures.
    pub(crate) fn bind_again_in(&self, binders: &[Arc<dyn Binder<B>>]) {
        for binder in binders {
            if let Err(rebind) = binder.bind_again(self) {
                tracing::error!(%rebind, dataset = self.id, "could not bind a dataset back after a failed offload");
            }
        }
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

    /// Remembers that the dataset is bound in `binder`, so dropping or offloading it unbinds it
    /// there first.
    pub(crate) fn note_bound_in(&self, binder: Weak<dyn Binder<B>>) {
        let mut binders = self.bound_in.lock().unwrap_or_else(|p| p.into_inner());
        binders.retain(|b| b.strong_count() > 0);
        if !binders.iter().any(|b| b.ptr_eq(&binder)) {
            binders.push(binder);
        }
    }

    fn slot(&self, name: &str) -> Result<&DatasetSlot> {
        self.slots
            .iter()
            .find(|s| s.name == name)
            .ok_or_else(|| Error::Layout(LayoutError::UnknownSlot { slot: name.into() }))
    }
}

impl<B: Backend> DatasetOf<B> for DatasetCore<B> {
    fn core(&self) -> &DatasetCore<B> {
        self
    }

    fn core_mut(&mut self) -> &mut DatasetCore<B> {
        self
    }

    fn restore_on(&mut self, stream: &B::Stream) -> Result<TransferReport> {
        self.restore(stream)
    }
}

impl DatasetOf<Vmm> for Dataset {
    fn core(&self) -> &DatasetCore<Vmm> {
        &self.core
    }

    fn core_mut(&mut self) -> &mut DatasetCore<Vmm> {
        &mut self.core
    }

    fn restore_on(&mut self, stream: &Arc<CudaStream>) -> Result<TransferReport> {
        self.restore(stream)
    }
}

impl Dataset {
    pub(crate) fn new(
        ctx: &Arc<CudaContext>,
        layout: &Layout,
        placement: &Placement,
        group_index: usize,
        access: &[usize],
        shareable: bool,
        at: Location,
    ) -> Result<Self> {
        let core = DatasetCore::new(
            Vmm::with_access(ctx, access),
            layout.fingerprint(),
            placement,
            group_index,
            shareable,
            at,
        )?;
        Ok(Self::from_core(core))
    }

    /// A dataset over existing physical memory of the group's size (fresh, or imported from
    /// another process).
    pub(crate) fn from_physical(
        ctx: &Arc<CudaContext>,
        layout: &Layout,
        placement: &Placement,
        group_index: usize,
        access: &[usize],
        physical: Physical,
    ) -> Result<Self> {
        let (shareable, location) = (physical.shareable(), physical.location());
        let core = DatasetCore::from_memory(
            Vmm::with_access(ctx, access),
            layout.fingerprint(),
            placement,
            group_index,
            Arc::new(physical),
            shareable,
            location,
        )?;
        Ok(Self::from_core(core))
    }

    fn from_core(core: DatasetCore<Vmm>) -> Self {
        Self {
            core,
            tag: None,
            refill: None,
        }
    }

    /// Unique for the life of the process.
    pub fn id(&self) -> u64 {
        self.core.id
    }

    /// The group this dataset backs.
    pub fn group(&self) -> &str {
        &self.core.group
    }

    /// Bytes of physical memory (the group's size, rounded to the granularity).
    pub fn bytes(&self) -> usize {
        self.core.bytes
    }

    /// Fingerprint of the layout it was made for.
    pub fn layout_fingerprint(&self) -> u64 {
        self.core.layout_fingerprint
    }

    /// The group's slots, in layout order, with their offsets inside this dataset: slot `s`
    /// is at [`home_ptr`](Self::home_ptr)` + s.offset` here, and at the space's slot address
    /// when bound.
    pub fn slots(&self) -> &[DatasetSlot] {
        &self.core.slots
    }

    /// The CUDA context (device) whose memory this is; it binds only into spaces of the same
    /// device.
    pub fn context(&self) -> &Arc<CudaContext> {
        self.core.backend.context()
    }

    /// The dataset's private address (its home mapping); `Err(Offloaded)` while offloaded.
    pub fn home_ptr(&self) -> Result<u64> {
        self.core.home_ptr()
    }

    /// A new file descriptor for this dataset's memory, owned by the caller (closed on drop), for
    /// passing to another process. The dataset must come from a space with
    /// [`SpaceOptions::shareable`](crate::SpaceOptions::shareable);
    /// [`send_dataset`](crate::share::send_dataset) does this and sends it.
    pub fn export(&self) -> Result<std::os::fd::OwnedFd> {
        self.core.memory()?.export()
    }

    /// Where the memory lives while resident (the space's device, a peer, or pinned host).
    pub fn location(&self) -> Location {
        self.core.location
    }

    /// Whether the bytes are in device memory (not offloaded).
    pub fn is_resident(&self) -> bool {
        self.core.is_resident()
    }

    /// A label for group operations ([`offload_tagged`](crate::sleep::offload_tagged)).
    pub fn set_tag(&mut self, tag: impl Into<String>) {
        self.tag = Some(tag.into());
    }

    /// The label set by [`set_tag`](Self::set_tag), if any.
    pub fn tag(&self) -> Option<&str> {
        self.tag.as_deref()
    }

    /// What restore runs after an offload with [`HostStorage::Discard`] (instead of leaving the
    /// memory uninitialised).
    pub fn set_refill(
        &mut self,
        refill: impl FnMut(&Dataset, &Arc<CudaStream>) -> Result<()> + Send + Sync + 'static,
    ) {
        self.refill = Some(RefillFn(Box::new(refill)));
    }

    /// Moves the contents to `storage` and releases the device memory (device free memory rises
    /// by [`Dataset::bytes`]). The dataset keeps its identity: after [`Dataset::restore`] and a
    /// bind, graphs captured over its slots replay on the same contents.
    ///
    /// A bound dataset is unbound first, from every space, after the GPU is done with it. If host
    /// memory cannot be had (or the copy fails), the dataset stays on the device with its
    /// contents and is bound again where it was. Offloading an offloaded dataset is a no-op.
    pub fn offload(
        &mut self,
        storage: &HostStorage,
        stream: &Arc<CudaStream>,
    ) -> Result<TransferReport> {
        self.core.offload(storage, stream)
    }

    /// Brings an offloaded dataset back into new device memory (no-op if resident), at the same
    /// home address it had before the offload ([`Dataset::home_ptr`]). Bind it again to put it
    /// under a space's slots.
    ///
    /// On out-of-memory returns
    /// [`OffloadError::RestoreOutOfMemory`](crate::error::OffloadError::RestoreOutOfMemory) with
    /// what was asked and what is
    /// free; the host copy is kept, and a retry after memory is freed succeeds.
    pub fn restore(&mut self, stream: &Arc<CudaStream>) -> Result<TransferReport> {
        let report = self.core.restore(stream)?;
        if report.storage == StorageUsed::Discarded {
            if let Some(mut refill) = self.refill.take() {
                let refilled = (refill.0)(self, stream);
                self.refill = Some(refill);
                refilled?;
            }
        }
        Ok(report)
    }

    /// A typed view of slot `name` at the dataset's home address (not the space's), to fill or
    /// read the dataset with cudarc copies or kernels whether or not it is bound.
    pub fn view<T>(&self, name: &str, stream: &Arc<CudaStream>) -> Result<SlotView<'_, T>> {
        let slot = self.core.slot(name)?;
        self.core.attach(stream);
        SlotView::new(
            self.core.home_ptr()? + slot.offset as u64,
            &slot.name,
            slot.bytes,
            stream,
        )
    }

    fn slot_bytes(&self, name: &str) -> Result<usize> {
        Ok(self.core.slot(name)?.bytes)
    }

    view::slot_copies!(
        "Copies `data` (exactly the slot's size) into slot `name`; returns when the copy is done."
    );
}

impl<B: Backend> Drop for DatasetCore<B> {
    fn drop(&mut self) {
        let binders = std::mem::take(self.bound_in.get_mut().unwrap_or_else(|p| p.into_inner()));
        for binder in binders.iter().filter_map(Weak::upgrade) {
            if let Err(error) = binder.unbind_dataset(self.id, self.group_index) {
                // The space keeps its mapping, and the mapping keeps the memory alive: nothing is
                // freed under the GPU. It is released when that space unbinds or drops.
                tracing::error!(%error, dataset = self.id, "could not unbind a dropped dataset");
            }
        }
        let fence = self.fence.get_mut().unwrap_or_else(|p| p.into_inner());
        if let Err(error) = fence.wait() {
            tracing::error!(%error, dataset = self.id, "waiting for the GPU before freeing a dataset failed; leaking it");
            if let Residency::Device { home, .. } = &mut self.residency {
                home.leak_on_drop();
            }
        }
        // `residency` drops next: unmap, then release (unless a space still maps it), then
        // free; or, if offloaded, the host copy goes back to its arena.
    }
}
