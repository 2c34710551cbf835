//! Spaces: a reserved address range carved into slots, with datasets bound under its groups.
//!
//! ```text
//!   Space (one cuMemAddressReserve, addresses fixed for its life)
//!   | group "weights": w1 | w2 | b1 | group "batch": x | y | scratch: tmp |
//!          ^ bind(dataset W7): one mapping   ^ bind(dataset B3)   ^ the space's own memory
//! ```
//!
//! [`bind`](self::bind) is the one place that maps and unmaps datasets under a space, and it
//! always waits on the space's [`Fence`] before unmapping. [`sleep`](self::sleep) puts a space
//! to sleep straight down: it unbinds its own groups, then asks each dataset only to copy its
//! bytes out and release its memory. Graphs see a space only through [`SpaceShared::attach`]
//! and [`SpaceShared::lock_replayable`].

mod backing;
mod bind;
pub(crate) mod listeners;
#[cfg(test)]
mod proptests;
mod sleep;
mod slot;

use std::collections::HashMap;
use std::sync::{Arc, Mutex, MutexGuard};

use bitvec::vec::BitVec;
use cudarc::driver::{sys, CudaContext, CudaStream};

use crate::dataset::Dataset;
use crate::driver::device;
use crate::driver::vmm::Location;
use crate::error::{DriverError, Error, GraphError, LayoutError, Result};
use crate::fence::FencePolicy;
use crate::ids::next_id;
use crate::layout::{Layout, Placement, Region};
use crate::strategy::{BindStrategy, CostModel};
use crate::view::{self, SlotView};
use crate::vmm_core::{Backend, ReservedRange, Vmm, Waiter};

use backing::{Backing, Mapped};
pub use slot::Slot;

/// Options for [`Space::with_options`].
#[derive(Clone, Debug, Default)]
pub struct SpaceOptions {
    /// How the space waits for the GPU before unmapping (default: the whole context).
    pub fence: FencePolicy,
    /// How groups are bound, unless `group_bind` names the group (default: remap).
    pub bind: BindStrategy,
    /// Per-group strategies.
    pub group_bind: HashMap<String, BindStrategy>,
    /// Create datasets exportable to other processes as POSIX file descriptors
    /// ([`send_dataset`](crate::share::send_dataset)).
    pub shareable: bool,
    /// The model `BindStrategy::Auto` decides with; `None` calibrates on the device (once per
    /// process and device).
    pub cost_model: Option<CostModel>,
    /// Other devices whose kernels may read and write the space (peer access). Every mapping of
    /// the space grants access to the space's device and to these, after every bind too.
    pub peers: Vec<usize>,
}

impl SpaceOptions {
    /// How the space waits for the GPU before unmapping.
    pub fn fence(mut self, fence: FencePolicy) -> Self {
        self.fence = fence;
        self
    }

    /// The strategy of every group not named with [`SpaceOptions::group_bind`].
    pub fn bind(mut self, strategy: BindStrategy) -> Self {
        self.bind = strategy;
        self
    }

    /// The strategy of group `group`.
    pub fn group_bind(mut self, group: impl Into<String>, strategy: BindStrategy) -> Self {
        self.group_bind.insert(group.into(), strategy);
        self
    }

    /// Whether datasets can be exported to other processes.
    pub fn shareable(mut self, shareable: bool) -> Self {
        self.shareable = shareable;
        self
    }

    /// The model `BindStrategy::Auto` decides with (skips calibration).
    pub fn cost_model(mut self, model: CostModel) -> Self {
        self.cost_model = Some(model);
        self
    }

    /// Lets kernels on the devices `peers` read and write the space at the same addresses.
    /// [`Space::with_options`] checks `cuDeviceCanAccessPeer` for each and returns
    /// [`DriverError::PeerAccess`](crate::error::DriverError::PeerAccess) when a pair cannot.
    pub fn peers(mut self, peers: impl IntoIterator<Item = usize>) -> Self {
        self.peers = peers.into_iter().collect();
        self
    }
}

/// A long-lived virtual address range holding a layout's slots at fixed addresses.
///
/// Cloning gives another handle to the same space. The addresses stay reserved until the last
/// handle, graph and binding is gone.
#[derive(Clone, Debug)]
pub struct Space {
    pub(crate) shared: Arc<SpaceShared>,
}

#[derive(Debug)]
pub(crate) struct SpaceState<B: Backend> {
    backings: Vec<Backing<B>>,
    /// Bit `i` set when group `i` has a dataset's data under it.
    bound: BitVec,
    fence: B::Fence,
    /// Stream for copy-in binds issued without a stream.
    copy_stream: Option<B::Stream>,
    /// The scratch region's memory; `None` while the space sleeps (or when it has no scratch).
    scratch: Option<Mapped<B>>,
    /// While asleep: the dataset each group had bound when the space went to sleep.
    sleeping: Option<Vec<Option<u64>>>,
}

// Field order is drop order: bindings and the scratch mapping (in `state`) are unmapped before
// the reservation they live in is freed (the mappings also hold the reservation alive).
// Generic over the driver (`Vmm` for [`Space`], the fake one in the property tests).
#[derive(Debug)]
pub(crate) struct SpaceShared<B: Backend = Vmm> {
    id: u64,
    backend: B,
    layout: Layout,
    placement: Placement,
    slots: Vec<Slot>,
    access: Vec<usize>,
    strategies: Vec<BindStrategy>,
    shareable: bool,
    state: Mutex<SpaceState<B>>,
    /// Told after a bind or a wake maps other memory under a part of the space.
    pub(crate) listeners: listeners::Listeners,
    reservation: B::Reservation,
}

/// Held while a graph launch is enqueued: no bind can unmap between the check and the launch.
pub(crate) struct ReplayLock<'a, B: Backend = Vmm> {
    _state: MutexGuard<'a, SpaceState<B>>,
}

impl Space {
    /// Reserves addresses for `layout` on `ctx`'s device, and backs its scratch slots.
    pub fn new(ctx: &Arc<CudaContext>, layout: Layout) -> Result<Self> {
        Self::with_options(ctx, layout, SpaceOptions::default())
    }

    /// [`Space::new`] with options: fence policy, bind strategies, shareable datasets.
    pub fn with_options(
        ctx: &Arc<CudaContext>,
        layout: Layout,
        options: SpaceOptions,
    ) -> Result<Self> {
        let access = access_list(ctx.ordinal(), &options.peers)?;
        let backend = Vmm::with_access(ctx, &access);
        let placement = layout.place(backend.granularity(false)?)?;
        let mut strategies = Vec::with_capacity(placement.groups.len());
        for region in &placement.groups {
            let mut strategy = options
                .group_bind
                .get(&region.name)
                .copied()
                .unwrap_or(options.bind);
            if strategy == BindStrategy::Auto {
                let model = match options.cost_model {
                    Some(model) => model,
                    None => CostModel::for_device(ctx)?,
                };
                strategy = model.choose(region.bytes);
            }
            strategies.push(strategy);
        }
        let shared = SpaceShared::new(
            backend,
            layout,
            placement,
            strategies,
            options.fence,
            options.shareable,
            access,
        )?;
        Ok(Self {
            shared: Arc::new(shared),
        })
    }

    /// The slot called `name`.
    pub fn slot(&self, name: &str) -> Result<&Slot> {
        self.shared.slot(name)
    }

    /// Calls `listener` each time other memory is mapped under slot `name`'s addresses (a bind
    /// of its group, or a wake for a scratch slot), until the listener is dropped.
    #[cfg_attr(not(feature = "nccl"), allow(dead_code))]
    pub(crate) fn listen_for_remaps(
        &self,
        name: &str,
        listener: std::sync::Weak<dyn listeners::RemapListener>,
    ) -> Result<()> {
        let part = match self.slot(name)?.group() {
            Some(group) => listeners::Part::Group(self.shared.placement.group_index(group)?),
            None => listeners::Part::Scratch,
        };
        self.shared.listeners.add(part, listener);
        Ok(())
    }

    /// Whether memory is mapped under slot `name` now (its group bound; for scratch, awake).
    #[cfg_attr(not(feature = "nccl"), allow(dead_code))]
    pub(crate) fn slot_has_memory(&self, name: &str) -> Result<bool> {
        let slot = self.slot(name)?;
        let state = self.shared.lock();
        Ok(self.shared.require_bound(&state, slot).is_ok())
    }

    /// Every slot, group by group, then scratch.
    pub fn slots(&self) -> &[Slot] {
        &self.shared.slots
    }

    /// The layout the space was made for.
    pub fn layout(&self) -> &Layout {
        &self.shared.layout
    }

    /// Where each slot and group sits.
    pub fn placement(&self) -> &Placement {
        &self.shared.placement
    }

    /// First address of the reserved range.
    pub fn base(&self) -> sys::CUdeviceptr {
        ReservedRange::base(&self.shared.reservation)
    }

    /// Bytes of address space reserved.
    pub fn reserved_bytes(&self) -> usize {
        ReservedRange::bytes(&self.shared.reservation)
    }

    /// The CUDA context the space lives in.
    pub fn context(&self) -> &Arc<CudaContext> {
        self.shared.backend.context()
    }

    /// Unique for the life of the process.
    pub fn id(&self) -> u64 {
        self.shared.id
    }

    /// Makes a dataset for group `group`: fresh physical memory on the space's device, laid out
    /// like the group's slots (contents undefined until written).
    pub fn new_dataset(&self, group: &str) -> Result<Dataset> {
        self.new_dataset_at(group, Location::Device(self.shared.backend.device()))
    }

    /// [`Space::new_dataset`] with the memory at `at`: a peer GPU (over NVLink or PCIe) or pinned
    /// host memory. Bound, the slots read and write it in place, with no copy; replays pay the
    /// slower link. Every device the space grants access to must be able to reach `at`
    /// ([`DriverError::PeerAccess`](crate::error::DriverError::PeerAccess) otherwise).
    pub fn new_dataset_at(&self, group: &str, at: Location) -> Result<Dataset> {
        let index = self.shared.placement.group_index(group)?;
        if let Location::Device(owner) = at {
            require_device(owner)?;
            for &device in &self.shared.access {
                if !device::can_access_peer(device, owner)? {
                    return Err(Error::Driver(DriverError::PeerAccess {
                        from: device,
                        to: owner,
                    }));
                }
            }
        }
        Dataset::new(
            self.context(),
            &self.shared.layout,
            &self.shared.placement,
            index,
            &self.shared.access,
            self.shared.shareable,
            at,
        )
    }

    /// The devices whose kernels may use the space: its own, then its peers.
    pub fn devices(&self) -> &[usize] {
        &self.shared.access
    }

    /// Puts `dataset`'s data under its group's slots, replacing what was there, and returns
    /// when it is done.
    ///
    /// With [`BindStrategy::Remap`]: one unmap, one map and one set-access for the whole group,
    /// whatever its slot count, after waiting on the space's fence so no work still using the
    /// previous dataset is cut off. All or nothing: if mapping the new dataset fails, the previous
    /// one is mapped back and the error is returned.
    /// With [`BindStrategy::CopyIn`]: the dataset's input slots are copied into the space's own
    /// memory, after the fence. A copy that fails leaves the group unbound (its memory may hold
    /// part of the new data), so replays report
    /// [`GraphError::Unbound`](crate::error::GraphError::Unbound) rather than mixing datasets.
    /// Binding the dataset already bound is a no-op.
    pub fn bind(&self, dataset: &Dataset) -> Result<()> {
        self.shared.bind_noted(&dataset.core, None)
    }

    /// Like [`Space::bind`], but a copy-in group's copy is enqueued on `stream` and not waited
    /// for: work later enqueued on `stream` sees the new data. With
    /// [`FencePolicy::AttachedStreams`] the copy waits on the GPU (not the host) for the other
    /// attached streams; with the context fence the host waits first. Remap groups bind exactly
    /// as with [`Space::bind`].
    pub fn bind_on(&self, dataset: &Dataset, stream: &Arc<CudaStream>) -> Result<()> {
        self.shared.bind_noted(&dataset.core, Some(stream))
    }

    /// For a copy-in group with `dataset` bound: copies the output slots from the space's memory
    /// into the dataset, on `stream`, and waits. For a remap group outputs are already in the
    /// dataset and nothing is done.
    pub fn copy_out(&self, dataset: &Dataset, stream: &Arc<CudaStream>) -> Result<()> {
        self.shared.copy_out(&dataset.core, stream)
    }

    /// The strategy group `group` was resolved to (`Remap` or `CopyIn`, never `Auto`).
    pub fn strategy(&self, group: &str) -> Result<BindStrategy> {
        Ok(self.shared.strategies[self.shared.placement.group_index(group)?])
    }

    /// Unmaps group `group` (after waiting on the fence). Replays then fail with
    /// [`GraphError::Unbound`](crate::error::GraphError::Unbound) until a dataset is bound again.
    pub fn unbind(&self, group: &str) -> Result<()> {
        let index = self.shared.placement.group_index(group)?;
        self.shared.unbind_group(index, None).map(drop)
    }

    /// The id of the dataset bound under `group`, if any.
    pub fn bound_dataset(&self, group: &str) -> Result<Option<u64>> {
        let index = self.shared.placement.group_index(group)?;
        Ok(self.shared.lock().backings[index].dataset())
    }

    /// Whether every group has a dataset bound.
    pub fn is_fully_bound(&self) -> bool {
        self.shared.lock().bound.all()
    }

    /// Records that `stream` may use the space's memory. Only matters with
    /// [`FencePolicy::AttachedStreams`]; views, copies, captures and replays attach their stream.
    pub fn attach(&self, stream: &Arc<CudaStream>) {
        self.shared.attach(stream);
    }

    /// A typed view of slot `name` for cudarc copies, cuBLAS and kernels. Its group must be bound.
    pub fn view<T>(&self, name: &str, stream: &Arc<CudaStream>) -> Result<SlotView<'_, T>> {
        let slot = self.slot(name)?;
        let mut state = self.shared.lock();
        self.shared.require_bound(&state, slot)?;
        Waiter::attach(&mut state.fence, stream);
        SlotView::new(slot.device_ptr(), slot.name(), slot.bytes(), stream)
    }

    fn slot_bytes(&self, name: &str) -> Result<usize> {
        Ok(self.slot(name)?.bytes())
    }

    view::slot_copies!(concat!(
        "Copies `data` (exactly the slot's size) into slot `name` through the bound dataset or ",
        "the scratch backing; returns when the copy is done."
    ));

    /// Whether the space is asleep (scratch released; see [`Space::sleep`]).
    pub fn is_asleep(&self) -> bool {
        self.shared.lock().sleeping.is_some()
    }
}

/// The narrow interface the graph and sleep modules use.
impl<B: Backend> SpaceShared<B> {
    /// Reserves addresses for `placement` and backs its scratch and its copy-in groups
    /// (`strategies`, one per group, resolved: never `Auto`); `access` lists the devices the
    /// backend's mappings grant access to (its own first).
    pub(crate) fn new(
        backend: B,
        layout: Layout,
        placement: Placement,
        strategies: Vec<BindStrategy>,
        fence: FencePolicy,
        shareable: bool,
        access: Vec<usize>,
    ) -> Result<Self> {
        let granularity = backend.granularity(false)?;
        let reservation = backend.reserve(placement.total_bytes, granularity)?;
        let scratch = match &placement.scratch {
            Some(region) => Some(map_own(&backend, &reservation, region)?),
            None => None,
        };
        let slots = placement
            .slots
            .iter()
            .map(|p| {
                Slot::new(
                    reservation.base() + p.offset as u64,
                    p.name.clone(),
                    p.bytes,
                    p.role,
                    p.group.map(|g| placement.groups[g].name.clone()),
                )
            })
            .collect();
        let groups = placement.groups.len();
        let mut backings = Vec::with_capacity(groups);
        for (region, strategy) in placement.groups.iter().zip(&strategies) {
            backings.push(match strategy {
                BindStrategy::CopyIn => Backing::CopyIn {
                    resident: map_own(&backend, &reservation, region)?,
                    current: None,
                    held: None,
                },
                _ => Backing::Remap(None),
            });
        }
        let state = SpaceState {
            backings,
            bound: BitVec::repeat(false, groups),
            fence: backend.fence(fence),
            copy_stream: None,
            scratch,
            sleeping: None,
        };
        let id = next_id();
        tracing::debug!(
            space = id,
            base = reservation.base(),
            bytes = placement.total_bytes,
            groups,
            "space created"
        );
        Ok(Self {
            id,
            backend,
            layout,
            placement,
            slots,
            access,
            strategies,
            shareable,
            state: Mutex::new(state),
            listeners: listeners::Listeners::default(),
            reservation,
        })
    }

    fn lock(&self) -> MutexGuard<'_, SpaceState<B>> {
        // Every mutation of the state is all-or-nothing, so a panic elsewhere cannot leave it
        // half-changed: a poisoned lock still holds consistent state.
        self.state
            .lock()
            .unwrap_or_else(|poisoned| poisoned.into_inner())
    }

    /// The devices granted access to the space's addresses (its own first).
    pub(crate) fn access(&self) -> &[usize] {
        &self.access
    }

    pub(crate) fn id(&self) -> u64 {
        self.id
    }

    /// Records that `stream` may use the space's memory.
    pub(crate) fn attach(&self, stream: &B::Stream) {
        self.backend.attach(&mut self.lock().fence, stream);
    }

    /// Checks that a replay may run now (`Err(Asleep)` without scratch memory, `Err(Unbound)`
    /// naming the first group with nothing bound), attaches `stream`, and holds the space until
    /// the returned lock drops.
    pub(crate) fn lock_replayable(&self, stream: &B::Stream) -> Result<ReplayLock<'_, B>> {
        let mut state = self.lock();
        // A sleeping space refuses replays as asleep, also one without scratch (its groups
        // were unbound by the sleep, not by the caller).
        if state.sleeping.is_some() {
            return Err(Error::Graph(GraphError::Asleep));
        }
        self.require_scratch(&state)?;
        if let Some(index) = state.bound.first_zero() {
            return Err(Error::Graph(GraphError::Unbound {
                group: self.placement.groups[index].name.clone(),
            }));
        }
        self.backend.attach(&mut state.fence, stream);
        Ok(ReplayLock { _state: state })
    }

    /// While asleep: what each group had bound when the space went to sleep.
    pub(crate) fn sleeping(&self) -> Option<Vec<Option<u64>>> {
        self.lock().sleeping.clone()
    }

    /// New scratch memory at the same addresses (contents undefined), if it has none.
    pub(crate) fn restore_scratch(&self) -> Result<()> {
        let mut state = self.lock();
        if let (None, Some(region)) = (&state.scratch, &self.placement.scratch) {
            state.scratch = Some(map_own(&self.backend, &self.reservation, region)?);
            self.listeners.notify(listeners::Part::Scratch);
        }
        Ok(())
    }

    /// Ends the sleep: replays are allowed again.
    pub(crate) fn leave_sleep(&self) {
        self.lock().sleeping = None;
    }

    fn slot(&self, name: &str) -> Result<&Slot> {
        self.slots
            .iter()
            .find(|s| s.name() == name)
            .ok_or_else(|| Error::Layout(LayoutError::UnknownSlot { slot: name.into() }))
    }

    fn require_bound(&self, state: &SpaceState<B>, slot: &Slot) -> Result<()> {
        match slot.group() {
            Some(group) => {
                let index = self.placement.group_index(group)?;
                if state.bound[index] {
                    Ok(())
                } else {
                    Err(Error::Graph(GraphError::Unbound {
                        group: group.to_string(),
                    }))
                }
            }
            None => self.require_scratch(state),
        }
    }

    fn require_scratch(&self, state: &SpaceState<B>) -> Result<()> {
        if self.placement.scratch.is_some() && state.scratch.is_none() {
            return Err(Error::Graph(GraphError::Asleep));
        }
        Ok(())
    }
}

impl<B: Backend> Drop for SpaceShared<B> {
    fn drop(&mut self) {
        let state = self
            .state
            .get_mut()
            .unwrap_or_else(|poisoned| poisoned.into_inner());
        if let Err(error) = state.fence.wait() {
            // Without proof that the GPU is done, nothing is unmapped: leak instead.
            tracing::error!(%error, space = self.id, "waiting for the GPU before freeing a space failed; leaking it");
            state.backings.iter_mut().for_each(Backing::leak_on_drop);
            if let Some(scratch) = &mut state.scratch {
                scratch.leak_on_drop();
            }
        }
        state.backings.clear(); // unmaps, before the reservation goes
        state.scratch = None;
    }
}

/// `own` then each of `peers` (deduplicated), after checking every peer exists and can reach
/// memory on `own` and the other way round (datasets may live on either).
fn access_list(own: usize, peers: &[usize]) -> Result<Vec<usize>> {
    let mut access = vec![own];
    for &peer in peers {
        if access.contains(&peer) {
            continue;
        }
        require_device(peer)?;
        for (from, to) in [(peer, own), (own, peer)] {
            if !device::can_access_peer(from, to)? {
                return Err(Error::Driver(DriverError::PeerAccess { from, to }));
            }
        }
        access.push(peer);
    }
    Ok(access)
}

/// `Err(NoSuchDevice)` unless device `ordinal` exists.
fn require_device(ordinal: usize) -> Result<()> {
    let count = device::device_count()?;
    if ordinal >= count {
        return Err(Error::Driver(DriverError::NoSuchDevice { ordinal, count }));
    }
    Ok(())
}

/// New memory of `region`'s size mapped at its place in the reservation (scratch, copy-in).
fn map_own<B: Backend>(
    backend: &B,
    reservation: &B::Reservation,
    region: &Region,
) -> Result<Mapped<B>> {
    let memory = Arc::new(backend.create_memory(region.bytes, false)?);
    let mapping = backend.map(reservation, region.offset, &memory, region.bytes)?;
    Ok(Mapped { mapping, memory })
}
