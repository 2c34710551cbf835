//! [`Snapshot`]: one physical allocation laid out like a region's span (a weight set).

use std::os::fd::OwnedFd;
use std::sync::{Arc, Mutex};

use cudarc::driver::CudaContext;

use crate::driver::vmm::Physical;
use crate::error::Result;
use crate::vmm_core::{Backend, MappedRange, PhysicalMemory, Vmm};

/// The region id of an imported snapshot: ids start at 1, so no region of this process has it.
pub(super) const IMPORTED: u64 = 0;

/// A weight set on any [`Backend`]: what [`Snapshot`] is on the real driver, and what the
/// region state machine handles (tests run it on the fake driver).
#[derive(Debug)]
pub(crate) struct WeightSet<B: Backend> {
    pub(super) id: u64,
    pub(super) region_id: u64,
    backend: B,
    // Field order is drop order: the home mapping is unmapped first, then the memory is
    // released, then the home address range is freed (the mapping holds the range too, but
    // this last handle makes the range outlive the memory).
    home: Mutex<Option<B::Mapping>>,
    pub(super) memory: Arc<B::Memory>,
    home_range: Mutex<Option<B::Reservation>>,
}

impl<B: Backend> WeightSet<B> {
    pub(super) fn new(id: u64, region_id: u64, backend: &B, memory: Arc<B::Memory>) -> Arc<Self> {
        Arc::new(Self {
            id,
            region_id,
            backend: backend.clone(),
            home: Mutex::new(None),
            memory,
            home_range: Mutex::new(None),
        })
    }

    pub(super) fn bytes(&self) -> usize {
        self.memory.bytes()
    }

    /// The set's private address, mapped on first use (one map and set-access).
    pub(super) fn home_ptr(&self) -> Result<u64> {
        let mut home = self.home.lock().unwrap_or_else(|p| p.into_inner());
        if let Some(mapping) = home.as_ref() {
            return Ok(mapping.ptr());
        }
        let (range, mapping) = self.backend.map_alone(&self.memory)?;
        let ptr = mapping.ptr();
        *self.home_range.lock().unwrap_or_else(|p| p.into_inner()) = Some(range);
        *home = Some(mapping);
        Ok(ptr)
    }
}

impl<B: Backend> Drop for WeightSet<B> {
    fn drop(&mut self) {
        let home = self.home.get_mut().unwrap_or_else(|p| p.into_inner());
        if let Some(mapping) = home {
            // Work on the home address is not tracked: wait for everything before unmapping.
            if let Err(error) = self.backend.synchronize_device() {
                tracing::error!(%error, snapshot = self.id, "waiting before unmapping a snapshot failed; leaking it");
                mapping.leak_on_drop();
            }
        }
    }
}

/// A weight set: ONE physical allocation laid out like its region's used span, so binding it is
/// one mapping whatever the number of allocations. Cheap to clone; the memory lives while any
/// clone, or the region it is bound in, holds it.
///
/// It can also be mapped at a private home address ([`Snapshot::home_ptr`]) to be read or
/// written whether or not it is bound.
#[derive(Clone, Debug)]
pub struct Snapshot {
    pub(super) set: Arc<WeightSet<Vmm>>,
}

impl Snapshot {
    pub(super) fn from_set(set: Arc<WeightSet<Vmm>>) -> Self {
        Self { set }
    }

    /// Unique for the life of the process.
    pub fn id(&self) -> u64 {
        self.set.id
    }

    /// The id of the region it was taken from (and can be bound into).
    pub fn region_id(&self) -> u64 {
        self.set.region_id
    }

    /// Bytes of physical memory: the region's used span when it was taken.
    pub fn bytes(&self) -> usize {
        self.set.bytes()
    }

    /// The snapshot's private address, mapped on first use (one map and set-access). Work
    /// enqueued there must be finished before the last handle drops: dropping waits for the
    /// whole context first.
    pub fn home_ptr(&self) -> Result<u64> {
        self.set.home_ptr()
    }

    /// Whether it was made exportable
    /// ([`Region::snapshot_shareable`](super::Region::snapshot_shareable)
    /// or imported from another process).
    pub fn is_shareable(&self) -> bool {
        self.set.memory.shareable()
    }

    /// A new POSIX file descriptor for this memory (`cuMemExportToShareableHandle`), to send
    /// to another process ([`share::publish`](crate::share::publish) does). The descriptor is
    /// owned: it closes on drop; the memory lives on in every process that imported it.
    /// [`NotShareable`](crate::error::ShareError::NotShareable) unless made with
    /// [`Region::snapshot_shareable`](super::Region::snapshot_shareable).
    pub fn export(&self) -> Result<OwnedFd> {
        self.set.memory.export()
    }

    /// `bytes` of memory another process exported, imported into `ctx`
    /// (`cuMemImportFromShareableHandle`; the descriptor stays the caller's). It belongs to no
    /// region of this process (it cannot be bound here): reach it through
    /// [`Snapshot::home_ptr`], which maps it read-write for `ctx`'s device.
    /// `access` lists the devices that may read and write it once mapped (`ctx`'s device and,
    /// say, a peer GPU whose kernels write into it over NVLink).
    pub(crate) fn import(
        ctx: &Arc<CudaContext>,
        fd: &OwnedFd,
        bytes: usize,
        access: &[usize],
    ) -> Result<Self> {
        let memory = Arc::new(Physical::import(ctx, fd, bytes)?);
        let backend = Vmm::with_access(ctx, access);
        Ok(Self::from_set(WeightSet::new(
            crate::ids::next_id(),
            IMPORTED,
            &backend,
            memory,
        )))
    }

    /// Whether it came from another process
    /// ([`receive_weight_set`](crate::share::publish::receive_weight_set)).
    pub fn is_imported(&self) -> bool {
        self.set.region_id == IMPORTED
    }

    /// Whether `self` and `other` are handles to the same memory.
    pub fn same_as(&self, other: &Snapshot) -> bool {
        Arc::ptr_eq(&self.set, &other.set)
    }
}
