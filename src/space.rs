//! Spaces: a reserved address range carved into slots, with datasets bound under its groups.
//!
//! This is the one place that maps and unmaps datasets under a space's addresses, and it always
//! waits on the space's [`Fence`] before unmapping.

use std::collections::HashMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, MutexGuard, Weak};
use std::time::Instant;

use bitvec::vec::BitVec;
use cudarc::driver::{sys, CudaContext, CudaStream, DeviceRepr};

use crate::dataset::Dataset;
use crate::driver::vmm::{self, Mapping, Physical, Reservation};
use crate::driver::{self, kernels::DeviceBuffer};
use crate::error::{Error, Result};
use crate::fence::{Fence, FencePolicy};
use crate::graph::StableGraph;
use crate::layout::{Layout, Placement, Region, Role};
use crate::offload::{HostStorage, TransferReport};
use crate::strategy::{BindStrategy, CostModel};
use crate::view::{self, SlotView};

static NEXT_ID: AtomicU64 = AtomicU64::new(1);

pub(crate) fn next_id() -> u64 {
    NEXT_ID.fetch_add(1, Ordering::Relaxed)
}

/// A named, fixed address inside a space. Cheap to clone; pass `&Slot` as a kernel argument.
///
/// The address is valid for the life of the space. Whether memory is behind it depends on the
/// slot's group being bound (scratch slots always are).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Slot {
    pub(crate) ptr: sys::CUdeviceptr,
    name: String,
    bytes: usize,
    role: Role,
    group: Option<String>,
}

impl Slot {
    pub fn name(&self) -> &str {
        &self.name
    }

    /// The device address. Never changes for the life of the space.
    pub fn device_ptr(&self) -> sys::CUdeviceptr {
        self.ptr
    }

    /// Bytes declared in the layout.
    pub fn bytes(&self) -> usize {
        self.bytes
    }

    pub fn role(&self) -> Role {
        self.role
    }

    /// The slot's group; `None` for scratch.
    pub fn group(&self) -> Option<&str> {
        self.group.as_deref()
    }
}

impl DeviceBuffer for Slot {
    fn device_address(&self) -> sys::CUdeviceptr {
        self.ptr
    }

    fn byte_len(&self) -> usize {
        self.bytes
    }
}

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
    /// ([`send_dataset`](crate::send_dataset)).
    pub shareable: bool,
    /// The model `BindStrategy::Auto` decides with; `None` calibrates on the device (once per
    /// process and device).
    pub cost_model: Option<CostModel>,
}

impl SpaceOptions {
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

    pub fn shareable(mut self, shareable: bool) -> Self {
        self.shareable = shareable;
        self
    }

    pub fn cost_model(mut self, model: CostModel) -> Self {
        self.cost_model = Some(model);
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
struct Binding {
    dataset_id: u64,
    mapping: Mapping,
}

/// What is under one group's addresses.
#[derive(Debug)]
enum Backing {
    /// The bound dataset's own memory, mapped there.
    Remap(Option<Binding>),
    /// Memory the space owns, holding a copy of the inputs of dataset `current`.
    CopyIn {
        resident: Mapping,
        current: Option<u64>,
    },
}

impl Backing {
    fn dataset(&self) -> Option<u64> {
        match self {
            Backing::Remap(binding) => binding.as_ref().map(|b| b.dataset_id),
            Backing::CopyIn { current, .. } => *current,
        }
    }

    fn leak_on_drop(&mut self) {
        match self {
            Backing::Remap(Some(binding)) => binding.mapping.leak_on_drop(),
            Backing::Remap(None) => {}
            Backing::CopyIn { resident, .. } => resident.leak_on_drop(),
        }
    }
}

#[derive(Debug)]
pub(crate) struct SpaceState {
    backings: Vec<Backing>,
    /// Bit `i` set when group `i` has a dataset's data under it.
    bound: BitVec,
    pub(crate) fence: Fence,
    /// Stream for copy-in binds issued without a stream.
    copy_stream: Option<Arc<CudaStream>>,
    /// The scratch region's memory; `None` while the space sleeps (or when it has no scratch).
    scratch: Option<Mapping>,
    /// While asleep: the dataset each group had bound when the space went to sleep.
    sleeping: Option<Vec<Option<u64>>>,
}

// Field order is drop order: bindings and the scratch mapping (in `state`) are unmapped before
// the reservation they live in is freed (the mappings also hold the reservation alive).
#[derive(Debug)]
pub(crate) struct SpaceShared {
    pub(crate) id: u64,
    ctx: Arc<CudaContext>,
    layout: Layout,
    placement: Placement,
    slots: Vec<Slot>,
    access: Vec<usize>,
    strategies: Vec<BindStrategy>,
    shareable: bool,
    state: Mutex<SpaceState>,
    reservation: Arc<Reservation>,
}

impl Space {
    /// Reserves addresses for `layout` on `ctx`'s device, and backs its scratch slots.
    pub fn new(ctx: &Arc<CudaContext>, layout: Layout) -> Result<Self> {
        Self::with_options(ctx, layout, SpaceOptions::default())
    }

    pub fn with_options(
        ctx: &Arc<CudaContext>,
        layout: Layout,
        options: SpaceOptions,
    ) -> Result<Self> {
        let granularity = vmm::granularity(ctx, false)?;
        let placement = layout.place(granularity)?;
        let reservation = Arc::new(Reservation::new(ctx, placement.total_bytes, granularity)?);
        let access = vec![ctx.ordinal()];
        let scratch = match &placement.scratch {
            Some(region) => Some(map_scratch(ctx, &reservation, region, &access)?),
            None => None,
        };
        let slots = placement
            .slots
            .iter()
            .map(|p| Slot {
                ptr: reservation.base() + p.offset as u64,
                name: p.name.clone(),
                bytes: p.bytes,
                role: p.role,
                group: p.group.map(|g| placement.groups[g].name.clone()),
            })
            .collect();
        let groups = placement.groups.len();
        let mut strategies = Vec::with_capacity(groups);
        let mut backings = Vec::with_capacity(groups);
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
            backings.push(match strategy {
                BindStrategy::CopyIn => {
                    let physical = Arc::new(Physical::new(ctx, region.bytes, false)?);
                    let resident = Mapping::new(
                        &reservation,
                        region.offset,
                        &physical,
                        0,
                        region.bytes,
                        &access,
                    )?;
                    Backing::CopyIn {
                        resident,
                        current: None,
                    }
                }
                _ => Backing::Remap(None),
            });
            strategies.push(strategy);
        }
        let state = SpaceState {
            backings,
            bound: BitVec::repeat(false, groups),
            fence: Fence::new(ctx, options.fence),
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
            shared: Arc::new(SpaceShared {
                id,
                ctx: ctx.clone(),
                layout,
                placement,
                slots,
                access,
                strategies,
                shareable: options.shareable,
                state: Mutex::new(state),
                reservation,
            }),
        })
    }

    /// The slot called `name`.
    pub fn slot(&self, name: &str) -> Result<&Slot> {
        self.shared.slot(name)
    }

    /// Every slot, group by group, then scratch.
    pub fn slots(&self) -> &[Slot] {
        &self.shared.slots
    }

    pub fn layout(&self) -> &Layout {
        &self.shared.layout
    }

    /// Where each slot and group sits.
    pub fn placement(&self) -> &Placement {
        &self.shared.placement
    }

    /// First address of the reserved range.
    pub fn base(&self) -> sys::CUdeviceptr {
        self.shared.reservation.base()
    }

    /// Bytes of address space reserved.
    pub fn reserved_bytes(&self) -> usize {
        self.shared.reservation.bytes()
    }

    pub fn context(&self) -> &Arc<CudaContext> {
        &self.shared.ctx
    }

    /// Makes a dataset for group `group`: fresh physical memory laid out like the group's slots
    /// (contents undefined until written).
    pub fn new_dataset(&self, group: &str) -> Result<Dataset> {
        let index = self.shared.placement.group_index(group)?;
        Dataset::new(
            &self.shared.ctx,
            &self.shared.layout,
            &self.shared.placement,
            index,
            &self.shared.access,
            self.shared.shareable,
        )
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
    /// part of the new data), so replays report [`Error::Unbound`] rather than mixing datasets.
    /// Binding the dataset already bound is a no-op.
    pub fn bind(&self, dataset: &Dataset) -> Result<()> {
        self.shared.bind(dataset, None)?;
        dataset.note_bound_in(Arc::downgrade(&self.shared));
        Ok(())
    }

    /// Like [`Space::bind`], but a copy-in group's copy is enqueued on `stream` and not waited
    /// for: work later enqueued on `stream` sees the new data. With
    /// [`FencePolicy::AttachedStreams`] the copy waits on the GPU (not the host) for the other
    /// attached streams; with the context fence the host waits first. Remap groups bind exactly
    /// as with [`Space::bind`].
    pub fn bind_on(&self, dataset: &Dataset, stream: &Arc<CudaStream>) -> Result<()> {
        self.shared.bind(dataset, Some(stream))?;
        dataset.note_bound_in(Arc::downgrade(&self.shared));
        Ok(())
    }

    /// For a copy-in group with `dataset` bound: copies the output slots from the space's memory
    /// into the dataset, on `stream`, and waits. For a remap group outputs are already in the
    /// dataset and nothing is done.
    pub fn copy_out(&self, dataset: &Dataset, stream: &Arc<CudaStream>) -> Result<()> {
        self.shared.copy_out(dataset, stream)
    }

    /// The strategy group `group` was resolved to (`Remap` or `CopyIn`, never `Auto`).
    pub fn strategy(&self, group: &str) -> Result<BindStrategy> {
        Ok(self.shared.strategies[self.shared.placement.group_index(group)?])
    }

    /// Unmaps group `group` (after waiting on the fence). Replays then fail with
    /// [`Error::Unbound`] until a dataset is bound again.
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
        self.shared.lock().fence.attach(stream);
    }

    /// A typed view of slot `name` for cudarc copies, cuBLAS and kernels. Its group must be bound.
    pub fn view<T>(&self, name: &str, stream: &Arc<CudaStream>) -> Result<SlotView<'_, T>> {
        let slot = self.slot(name)?;
        let mut state = self.shared.lock();
        self.shared.require_bound(&state, slot)?;
        state.fence.attach(stream);
        SlotView::new(slot.ptr, &slot.name, slot.bytes, stream)
    }

    /// Copies `data` (exactly the slot's size) into slot `name` through the bound dataset or the
    /// scratch backing; returns when the copy is done.
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

    /// Puts the space to sleep: every dataset among `datasets` that is bound here is offloaded to
    /// `storage` (unbinding it after the GPU is done with it), and the scratch memory is released
    /// (its contents are not kept). Replays fail with [`Error::Asleep`] until [`Space::wake`].
    /// Datasets bound here but not passed stay bound.
    pub fn sleep(
        &self,
        datasets: &mut [&mut Dataset],
        storage: &HostStorage,
        stream: &Arc<CudaStream>,
    ) -> Result<Vec<TransferReport>> {
        let bound: Vec<Option<u64>> = self
            .shared
            .lock()
            .backings
            .iter()
            .map(Backing::dataset)
            .collect();
        let mut reports = Vec::new();
        for dataset in datasets
            .iter_mut()
            .filter(|d| bound.contains(&Some(d.id())))
        {
            reports.push(dataset.offload(storage, stream)?);
        }
        let mut state = self.shared.lock();
        state.fence.wait()?;
        state.scratch = None; // unmaps and releases
        state.sleeping = Some(bound);
        Ok(reports)
    }

    /// Wakes a sleeping space: new scratch memory (uninitialised) at the same addresses, and
    /// every dataset among `datasets` that was bound at sleep restored and bound again, so
    /// graphs captured before the sleep replay on the same contents. No-op when awake.
    pub fn wake(
        &self,
        datasets: &mut [&mut Dataset],
        stream: &Arc<CudaStream>,
    ) -> Result<Vec<TransferReport>> {
        let sleeping = {
            let mut state = self.shared.lock();
            let Some(sleeping) = state.sleeping.clone() else {
                return Ok(Vec::new());
            };
            if let (None, Some(region)) = (&state.scratch, &self.shared.placement.scratch) {
                state.scratch = Some(map_scratch(
                    &self.shared.ctx,
                    &self.shared.reservation,
                    region,
                    &self.shared.access,
                )?);
            }
            sleeping
        };
        let mut reports = Vec::new();
        for dataset in datasets
            .iter_mut()
            .filter(|d| sleeping.contains(&Some(d.id())))
        {
            reports.push(dataset.restore(stream)?);
            self.bind(dataset)?;
        }
        self.shared.lock().sleeping = None;
        Ok(reports)
    }

    /// Whether the space is asleep (scratch released).
    pub fn is_asleep(&self) -> bool {
        self.shared.lock().sleeping.is_some()
    }

    /// Captures `work` on `stream` as a graph over this space. See [`StableGraph::capture`].
    pub fn capture<F>(&self, stream: &Arc<CudaStream>, work: F) -> Result<StableGraph>
    where
        F: FnMut(&Arc<CudaStream>) -> Result<()> + Send + 'static,
    {
        StableGraph::capture(stream, &[self], work)
    }
}

impl SpaceShared {
    pub(crate) fn lock(&self) -> MutexGuard<'_, SpaceState> {
        // Every mutation of the state is all-or-nothing, so a panic elsewhere cannot leave it
        // half-changed: a poisoned lock still holds consistent state.
        self.state
            .lock()
            .unwrap_or_else(|poisoned| poisoned.into_inner())
    }

    fn slot(&self, name: &str) -> Result<&Slot> {
        self.slots
            .iter()
            .find(|s| s.name == name)
            .ok_or_else(|| Error::UnknownSlot { slot: name.into() })
    }

    fn require_bound(&self, state: &SpaceState, slot: &Slot) -> Result<()> {
        match &slot.group {
            Some(group) => {
                let index = self.placement.group_index(group)?;
                if state.bound[index] {
                    Ok(())
                } else {
                    Err(Error::Unbound {
                        group: group.clone(),
                    })
                }
            }
            None => self.require_scratch(state),
        }
    }

    fn require_scratch(&self, state: &SpaceState) -> Result<()> {
        if self.placement.scratch.is_some() && state.scratch.is_none() {
            return Err(Error::Asleep);
        }
        Ok(())
    }

    /// `Err(Asleep)` without scratch memory, else `Err(Unbound)` naming the first group with
    /// nothing bound.
    pub(crate) fn require_all_bound(&self, state: &SpaceState) -> Result<()> {
        self.require_scratch(state)?;
        match state.bound.first_zero() {
            None => Ok(()),
            Some(index) => Err(Error::Unbound {
                group: self.placement.groups[index].name.clone(),
            }),
        }
    }

    fn check_compatible(&self, dataset: &Dataset) -> Result<usize> {
        if dataset.context().ordinal() != self.ctx.ordinal() {
            return Err(Error::ContextMismatch {
                expected: self.ctx.ordinal(),
                found: dataset.context().ordinal(),
            });
        }
        let index = dataset.group_index();
        let matches = dataset.layout_fingerprint() == self.layout.fingerprint()
            && self
                .placement
                .groups
                .get(index)
                .is_some_and(|g| g.bytes == dataset.bytes() && g.name == dataset.group());
        if !matches {
            return Err(Error::LayoutMismatch {
                group: dataset.group().into(),
                dataset_layout: dataset.layout_fingerprint(),
                space_layout: self.layout.fingerprint(),
            });
        }
        Ok(index)
    }

    fn bind(&self, dataset: &Dataset, stream: Option<&Arc<CudaStream>>) -> Result<()> {
        let index = self.check_compatible(dataset)?;
        // An offloaded dataset is refused here, before anything changes.
        let (physical, home_ptr) = (dataset.physical()?.clone(), dataset.home_ptr()?);
        let region = &self.placement.groups[index];
        let mut state = self.lock();
        if state.backings[index].dataset() == Some(dataset.id()) {
            return Ok(());
        }
        let span = tracing::debug_span!("bind", space = self.id, group = %region.name, bytes = region.bytes);
        let _entered = span.enter();
        let start = Instant::now();
        let state = &mut *state;
        match &mut state.backings[index] {
            Backing::Remap(slot) => {
                state.fence.wait()?;
                let previous = slot.take();
                let restore = previous
                    .as_ref()
                    .map(|b| (b.dataset_id, b.mapping.physical().clone()));
                state.bound.set(index, false);
                drop(previous); // unmaps: the fence above has drained every use
                let map = |physical: &Arc<Physical>| {
                    Mapping::new(
                        &self.reservation,
                        region.offset,
                        physical,
                        0,
                        region.bytes,
                        &self.access,
                    )
                };
                match map(&physical) {
                    Ok(mapping) => {
                        *slot = Some(Binding {
                            dataset_id: dataset.id(),
                            mapping,
                        })
                    }
                    Err(error) => {
                        if let Some((dataset_id, physical)) = restore {
                            match map(&physical) {
                                Ok(mapping) => {
                                    *slot = Some(Binding {
                                        dataset_id,
                                        mapping,
                                    });
                                    state.bound.set(index, true);
                                }
                                Err(restore_error) => {
                                    tracing::error!(%restore_error, "could not map the previous dataset back");
                                }
                            }
                        }
                        return Err(error);
                    }
                }
            }
            Backing::CopyIn { resident, current } => {
                let copy_stream = match stream {
                    Some(stream) => {
                        state.fence.order_before(stream)?;
                        stream.clone()
                    }
                    None => {
                        state.fence.wait()?;
                        match &state.copy_stream {
                            Some(s) => s.clone(),
                            None => {
                                let s =
                                    driver::traced("cuStreamCreate", 0, || self.ctx.new_stream())?;
                                state.fence.attach(&s);
                                state.copy_stream = Some(s.clone());
                                s
                            }
                        }
                    }
                };
                state.fence.attach(&copy_stream);
                *current = None;
                state.bound.set(index, false);
                for (offset, bytes) in dataset.input_runs() {
                    let source = home_ptr + offset as u64;
                    let target = resident.ptr() + offset as u64;
                    driver::copy_device(&copy_stream, source, target, bytes)?;
                }
                if stream.is_none() {
                    driver::synchronize_stream(&copy_stream)?;
                }
                *current = Some(dataset.id());
            }
        }
        state.bound.set(index, true);
        tracing::debug!(
            dataset = dataset.id(),
            micros = start.elapsed().as_secs_f64() * 1e6,
            "bound"
        );
        Ok(())
    }

    fn copy_out(&self, dataset: &Dataset, stream: &Arc<CudaStream>) -> Result<()> {
        let index = self.check_compatible(dataset)?;
        let mut state = self.lock();
        let state = &mut *state;
        let home_ptr = dataset.home_ptr()?;
        if let Backing::CopyIn { resident, current } = &state.backings[index] {
            if *current != Some(dataset.id()) {
                return Err(Error::Unbound {
                    group: dataset.group().into(),
                });
            }
            state.fence.attach(stream);
            for (offset, bytes) in dataset.output_runs() {
                driver::copy_device(
                    stream,
                    resident.ptr() + offset as u64,
                    home_ptr + offset as u64,
                    bytes,
                )?;
            }
            driver::synchronize_stream(stream)?;
        }
        Ok(())
    }

    /// Takes group `index`'s data away, if bound (to `only_dataset`, when given). Returns
    /// whether something was unbound.
    pub(crate) fn unbind_group(&self, index: usize, only_dataset: Option<u64>) -> Result<bool> {
        let mut state = self.lock();
        let state = &mut *state;
        let Some(bound) = state.backings[index].dataset() else {
            return Ok(false);
        };
        if only_dataset.is_some_and(|id| id != bound) {
            return Ok(false);
        }
        match &mut state.backings[index] {
            Backing::Remap(slot) => {
                state.fence.wait()?;
                *slot = None; // unmaps
            }
            // The copy stays in the space's memory; only the claim that it is current goes.
            Backing::CopyIn { current, .. } => *current = None,
        }
        state.bound.set(index, false);
        tracing::debug!(space = self.id, group = %self.placement.groups[index].name, "unbound");
        Ok(true)
    }

    /// Binds `dataset` again (used to undo an unbind when an offload fails).
    pub(crate) fn rebind(&self, dataset: &Dataset) -> Result<()> {
        self.bind(dataset, None)
    }
}

impl Drop for SpaceShared {
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

/// Unbinds `dataset_id` from the space behind `space`, if it is still alive and bound there.
pub(crate) fn unbind_everywhere(
    space: &Weak<SpaceShared>,
    dataset_id: u64,
    group: usize,
) -> Result<Option<Arc<SpaceShared>>> {
    match space.upgrade() {
        Some(shared) => Ok(shared
            .unbind_group(group, Some(dataset_id))?
            .then_some(shared)),
        None => Ok(None),
    }
}

fn map_scratch(
    ctx: &Arc<CudaContext>,
    reservation: &Arc<Reservation>,
    region: &Region,
    access: &[usize],
) -> Result<Mapping> {
    let physical = Arc::new(Physical::new(ctx, region.bytes, false)?);
    Mapping::new(
        reservation,
        region.offset,
        &physical,
        0,
        region.bytes,
        access,
    )
}
