//! The public handles: [`ElasticPool`] (shared, cloneable) and [`Tenant`].

use std::sync::Arc;

use cudarc::driver::{CudaContext, CudaStream};

use super::backend::Vmm;
use super::block::Block;
use super::events::{BlockId, Event};
use super::ledger::TenantId;
use super::shared::Shared;
use super::state::{State, Switches};
use super::stats::{PoolStats, TenantStats};
use crate::driver::vmm::granularity;
use crate::error::Result;
use crate::fence::FencePolicy;

/// Options for [`ElasticPool::new`].
#[derive(Clone, Debug)]
pub struct PoolOptions {
    /// Global limit on physical memory (mapped plus cached), shared by all tenants.
    pub budget: Option<usize>,
    /// Serve requests by laying several cached chunks side by side (default on).
    pub stitching: bool,
    /// On `cuMemCreate` out of memory, release the cache and retry once (default on).
    pub drain_on_oom: bool,
    /// How to wait for the GPU before unmapping (default: the whole context).
    pub fence: FencePolicy,
    /// How many recent events the log keeps (default 65,536; 0 turns it off).
    pub event_capacity: usize,
    /// After a request had to create memory, create as much again in the background for the
    /// next one (default off; see [`super::create_ahead`]).
    pub create_ahead: bool,
}

impl Default for PoolOptions {
    fn default() -> Self {
        Self {
            budget: None,
            stitching: true,
            drain_on_oom: true,
            fence: FencePolicy::Context,
            event_capacity: 1 << 16,
            create_ahead: false,
        }
    }
}

impl PoolOptions {
    /// Caps the pool's physical memory (mapped plus cached, all tenants) at `bytes`; a request
    /// over it is refused with [`PoolError::OverBudget`](crate::error::PoolError::OverBudget) after
    /// the cache
    /// was released, if that would have made room.
    pub fn budget(mut self, bytes: usize) -> Self {
        self.budget = Some(bytes);
        self
    }

    /// Whether a request may be served by several cached chunks mapped side by side
    /// ([`PoolOptions::stitching`]).
    pub fn stitching(mut self, on: bool) -> Self {
        self.stitching = on;
        self
    }

    /// Whether an out-of-memory `cuMemCreate` releases the cache and retries once
    /// ([`PoolOptions::drain_on_oom`]).
    pub fn drain_on_oom(mut self, on: bool) -> Self {
        self.drain_on_oom = on;
        self
    }

    /// How tenants wait for the GPU before unmapping ([`PoolOptions::fence`]). With
    /// [`FencePolicy::AttachedStreams`], call [`Tenant::attach`] for every stream that uses a
    /// tenant's blocks.
    pub fn fence(mut self, policy: FencePolicy) -> Self {
        self.fence = policy;
        self
    }

    /// Whether a worker thread creates memory ahead of need ([`PoolOptions::create_ahead`]):
    /// a growing workload's next grow then maps memory that already exists.
    pub fn create_ahead(mut self, on: bool) -> Self {
        self.create_ahead = on;
        self
    }

    /// How many recent events the log keeps; older ones are dropped and counted
    /// ([`ElasticPool::dropped_events`]). 0 turns the log (and the timeline) off.
    pub fn event_capacity(mut self, events: usize) -> Self {
        self.event_capacity = events;
        self
    }
}

/// A pool of physical device memory shared by tenants. Cloning gives another handle to the
/// same pool. See the [module docs](crate::pool).
#[derive(Clone)]
pub struct ElasticPool {
    shared: Arc<Shared>,
}

impl std::fmt::Debug for ElasticPool {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ElasticPool")
            .field("granularity", &self.shared.granularity())
            .field("stats", &self.stats())
            .finish()
    }
}

impl ElasticPool {
    /// An empty pool on `ctx`'s device: it holds no memory until tenants allocate. Fails only if
    /// the driver cannot report the allocation granularity.
    pub fn new(ctx: &Arc<CudaContext>, options: PoolOptions) -> Result<Self> {
        let granularity = granularity(ctx, false)?;
        let state = State::new(
            Vmm::new(ctx),
            granularity,
            options.budget,
            Switches {
                stitching: options.stitching,
                drain_on_oom: options.drain_on_oom,
            },
            options.fence,
            options.event_capacity,
        );
        let shared = Arc::new(Shared::new(ctx, granularity, state, options.create_ahead));
        Ok(Self { shared })
    }

    /// Registers a tenant with `virtual_capacity` bytes of addresses of its own (rounded up to
    /// the granularity). Its blocks live in that range; its physical memory comes from the pool.
    pub fn register(&self, name: &str, virtual_capacity: usize) -> Result<Tenant> {
        self.register_limited(name, virtual_capacity, None)
    }

    /// [`ElasticPool::register`] with a physical limit for this tenant alone, inside the pool's
    /// budget.
    pub fn register_limited(
        &self,
        name: &str,
        virtual_capacity: usize,
        physical_limit: Option<usize>,
    ) -> Result<Tenant> {
        let id = self
            .shared
            .lock()
            .register(name, virtual_capacity, physical_limit)?;
        Ok(Tenant {
            shared: self.shared.clone(),
            id,
            name: Arc::from(name),
            unregistered: false,
        })
    }

    /// The allocation granularity in bytes (2 MiB on current GPUs): every chunk, block length
    /// and capacity is a multiple of it.
    pub fn granularity(&self) -> usize {
        self.shared.granularity()
    }

    /// The CUDA context (device) the pool allocates on.
    pub fn context(&self) -> &Arc<CudaContext> {
        self.shared.context()
    }

    /// The pool's figures now: memory mapped and cached, driver calls, drains, fragmentation.
    pub fn stats(&self) -> PoolStats {
        self.shared.lock().stats()
    }

    /// [`TenantStats`] of every registered tenant, in registration order.
    pub fn tenant_stats(&self) -> Vec<TenantStats> {
        self.shared.lock().all_tenant_stats()
    }

    /// Releases every cached chunk to the driver; returns the bytes released.
    pub fn drain(&self) -> usize {
        self.shared.lock().drain()
    }

    /// Waits until memory the pool is creating ahead of need ([`PoolOptions::create_ahead`]) is
    /// in its cache; returns at once when nothing is under way or the option is off.
    pub fn settle(&self) {
        self.shared.settle();
    }

    /// Turns stitching on or off for later requests (see [`PoolOptions::stitching`]).
    pub fn set_stitching(&self, on: bool) {
        self.shared.lock().switches_mut().stitching = on;
    }

    /// Turns drain-and-retry on or off for later requests (see [`PoolOptions::drain_on_oom`]).
    pub fn set_drain_on_oom(&self, on: bool) {
        self.shared.lock().switches_mut().drain_on_oom = on;
    }

    /// The logged events, oldest first.
    pub fn events(&self) -> Vec<Event> {
        self.shared.lock().events().events().cloned().collect()
    }

    /// How many events the log dropped because it was full.
    pub fn dropped_events(&self) -> u64 {
        self.shared.lock().events().dropped()
    }

    /// The logged events as an SVG timeline of the address space (see [`super::timeline`]).
    #[cfg(feature = "timeline")]
    pub fn timeline_svg(&self, title: &str) -> Result<String> {
        super::timeline::render_svg(&self.events(), title)
    }

    /// [`ElasticPool::timeline_svg`] written to `path`.
    #[cfg(feature = "timeline")]
    pub fn write_timeline(&self, title: &str, path: impl AsRef<std::path::Path>) -> Result<()> {
        super::timeline::write_svg(&self.events(), title, path)
    }
}

/// A user of an [`ElasticPool`]: its own virtual address range, statistics and optional limit.
/// Dropping it (or [`Tenant::unregister`]) frees everything it holds: its blocks are unmapped
/// after the fence, their chunks return to the pool's cache, and its addresses are freed.
/// Blocks that outlive it report [`PoolError::TenantGone`](crate::error::PoolError::TenantGone).
pub struct Tenant {
    shared: Arc<Shared>,
    id: TenantId,
    name: Arc<str>,
    unregistered: bool,
}

impl std::fmt::Debug for Tenant {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Tenant")
            .field("id", &self.id)
            .field("name", &self.name)
            .finish()
    }
}

impl Tenant {
    /// The tenant's id in the pool's [`Event`] log and statistics.
    pub fn id(&self) -> TenantId {
        self.id
    }

    /// The name given at registration (used in errors and statistics).
    pub fn name(&self) -> &str {
        &self.name
    }

    /// A block of `bytes` at an address that stays fixed for its life.
    pub fn alloc(&self, bytes: usize) -> Result<Block> {
        self.alloc_growable(bytes, bytes)
    }

    /// A block of `len` bytes that reserves `max_len` bytes of addresses, so it can grow to
    /// `max_len` in place: [`Block::grow`] maps more memory behind it and never copies.
    pub fn alloc_growable(&self, len: usize, max_len: usize) -> Result<Block> {
        self.carve(|state, tenant| state.alloc(tenant, len, max_len))
    }

    /// A block of `bytes` whose memory is acquired now (a refusal is reported here, as by
    /// [`Tenant::alloc`]) but not mapped: its length is 0 until [`Block::map_held`] maps it, or
    /// until [`Block::graft`] moves another block's memory under its first bytes and maps only
    /// the rest. For a caller that learns at its next call whether a fresh block is a copy's
    /// destination (the preload layer's copy elision): the map, set-access and unmap of the
    /// part the graft replaces are never paid.
    pub fn alloc_held(&self, bytes: usize) -> Result<Block> {
        self.carve(|state, tenant| state.alloc_held(tenant, bytes))
    }

    /// Runs one of the state's block allocations under the lock and wraps what it carved.
    fn carve(
        &self,
        alloc: impl FnOnce(&mut State<Vmm>, TenantId) -> Result<(BlockId, u64, usize)>,
    ) -> Result<Block> {
        let mut state = self.shared.lock();
        let (id, address, capacity) = alloc(&mut state, self.id)?;
        self.shared.after_request(state);
        Ok(Block::new(
            self.shared.clone(),
            self.id,
            self.name.clone(),
            id,
            address,
            capacity,
        ))
    }

    /// Remembers that `stream` uses this tenant's memory (needed with
    /// [`FencePolicy::AttachedStreams`]).
    pub fn attach(&self, stream: &Arc<CudaStream>) -> Result<()> {
        self.shared.lock().attach(self.id, stream)
    }

    /// The tenant's figures now; [`PoolError::TenantGone`](crate::error::PoolError::TenantGone)
    /// after it was
    /// unregistered.
    pub fn stats(&self) -> Result<TenantStats> {
        self.shared.lock().tenant_stats(self.id)
    }

    /// Frees everything the tenant holds and its addresses. If waiting for the GPU fails, the
    /// tenant's mappings are leaked rather than unmapped under running work, and the error is
    /// returned.
    pub fn unregister(mut self) -> Result<()> {
        self.unregistered = true;
        self.shared.lock().unregister(self.id)
    }
}

impl Drop for Tenant {
    fn drop(&mut self) {
        if self.unregistered {
            return;
        }
        if let Err(error) = self.shared.lock().unregister(self.id) {
            tracing::error!(%error, tenant = %self.name, "unregistering a tenant failed");
        }
    }
}
