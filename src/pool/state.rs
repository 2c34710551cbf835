//! The pool's state behind its lock, and every operation that changes it.
//!
//! Each operation plans with the pure bookkeeping first ([`ChunkBook`], [`GranuleMap`]), then
//! makes the driver calls, and commits to the books only what succeeded; on an error it undoes
//! its own driver work, so the pool is as it was (apart from cache it released to make room).

use std::collections::{BTreeMap, HashMap};
use std::sync::Arc;
use std::time::Instant;

use cudarc::driver::{CudaContext, CudaStream};

use super::book::{BudgetScope, ChunkBook, ChunkId, OverBudget, TenantId};
use super::events::{BlockId, DrainReason, Event, EventKind, EventLog};
use super::granules::GranuleMap;
use super::stats::{PoolStats, TenantStats};
use crate::driver::vmm::{Mapping, Physical, Reservation};
use crate::error::{Error, Result};
use crate::fence::{Fence, FencePolicy};

/// Switches that may change while the pool lives.
#[derive(Clone, Copy, Debug)]
pub(crate) struct Switches {
    pub stitching: bool,
    pub drain_on_oom: bool,
}

pub(crate) struct State {
    ctx: Arc<CudaContext>,
    started: Instant,
    fence_policy: FencePolicy,
    access: Vec<usize>,
    pub switches: Switches,
    pub book: ChunkBook,
    memory: HashMap<ChunkId, Arc<Physical>>,
    tenants: BTreeMap<TenantId, TenantState>,
    next_tenant: u32,
    next_block: u64,
    pub events: EventLog,
    counters: Counters,
}

#[derive(Clone, Copy, Debug, Default)]
struct Counters {
    creates: u64,
    releases: u64,
    reuses: u64,
    stitched: u64,
    drains: u64,
    drained_bytes: usize,
    refusals: u64,
    peak_mapped: usize,
}

struct TenantState {
    name: Arc<str>,
    reservation: Arc<Reservation>,
    granules: GranuleMap,
    blocks: BTreeMap<BlockId, BlockState>,
    fence: Fence,
    peak_mapped: usize,
}

struct BlockState {
    first_granule: usize,
    capacity: usize,
    len: usize,
    segments: Vec<Segment>,
}

/// One chunk mapped into a block, at `offset` bytes from the block's start.
struct Segment {
    chunk: ChunkId,
    offset: usize,
    mapping: Mapping,
}

impl BlockState {
    fn mapped(&self) -> usize {
        self.segments
            .last()
            .map_or(0, |s| s.offset + s.mapping.bytes())
    }
}

/// What a block handle needs to know about itself.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct BlockInfo {
    pub address: u64,
    pub len: usize,
    pub capacity: usize,
    pub mapped: usize,
    pub mappings: usize,
}

fn over_budget(refused: OverBudget, name: &str) -> Error {
    let scope = match refused.scope {
        BudgetScope::Pool => "pool budget".to_string(),
        BudgetScope::Tenant(_) => format!("tenant `{name}`'s limit"),
    };
    Error::OverBudget {
        scope,
        asked: refused.asked,
        limit: refused.limit,
        held: refused.held,
    }
}

impl State {
    pub fn new(
        ctx: &Arc<CudaContext>,
        granularity: usize,
        budget: Option<usize>,
        switches: Switches,
        fence_policy: FencePolicy,
        event_capacity: usize,
    ) -> Self {
        Self {
            ctx: ctx.clone(),
            started: Instant::now(),
            fence_policy,
            access: vec![ctx.ordinal()],
            switches,
            book: ChunkBook::new(granularity, budget),
            memory: HashMap::new(),
            tenants: BTreeMap::new(),
            next_tenant: 1,
            next_block: 1,
            events: EventLog::new(event_capacity),
            counters: Counters::default(),
        }
    }

    fn log(&mut self, kind: EventKind, tenant: Option<TenantId>, address: u64, bytes: usize) {
        let at = self.started.elapsed();
        self.events.push(Event {
            at,
            kind,
            tenant,
            address,
            bytes,
        });
    }

    fn refuse(&mut self, tenant: TenantId, error: Error) -> Error {
        self.counters.refusals += 1;
        self.log(EventKind::Refused, Some(tenant), 0, 0);
        tracing::debug!(%error, "pool request refused");
        error
    }

    fn tenant(&self, tenant: TenantId) -> Result<&TenantState> {
        self.tenants.get(&tenant).ok_or_else(|| Error::TenantGone {
            tenant: format!("#{}", tenant.0),
        })
    }

    fn tenant_mut(&mut self, tenant: TenantId) -> Result<&mut TenantState> {
        self.tenants
            .get_mut(&tenant)
            .ok_or_else(|| Error::TenantGone {
                tenant: format!("#{}", tenant.0),
            })
    }

    fn block(&self, tenant: TenantId, block: BlockId) -> Result<&BlockState> {
        let state = self.tenant(tenant)?;
        state.blocks.get(&block).ok_or_else(|| Error::TenantGone {
            tenant: state.name.to_string(),
        })
    }

    // ---- tenants ----------------------------------------------------------------------------

    pub fn register(
        &mut self,
        name: &str,
        virtual_capacity: usize,
        physical_limit: Option<usize>,
    ) -> Result<TenantId> {
        let capacity = match self.book.round(virtual_capacity) {
            Some(c) if c > 0 => c,
            _ => {
                return Err(Error::InvalidShape(format!(
                    "tenant `{name}`: virtual capacity {virtual_capacity} bytes"
                )))
            }
        };
        if name.is_empty() {
            return Err(Error::EmptyName);
        }
        let reservation = Arc::new(Reservation::new(
            &self.ctx,
            capacity,
            self.book.granularity(),
        )?);
        let id = TenantId(self.next_tenant);
        self.next_tenant += 1;
        self.book.open_account(id, physical_limit);
        let base = reservation.base();
        let name: Arc<str> = Arc::from(name);
        self.tenants.insert(
            id,
            TenantState {
                name: name.clone(),
                granules: GranuleMap::new(capacity / self.book.granularity()),
                reservation,
                blocks: BTreeMap::new(),
                fence: Fence::new(&self.ctx, self.fence_policy),
                peak_mapped: 0,
            },
        );
        self.log(EventKind::Register { name }, Some(id), base, capacity);
        Ok(id)
    }

    pub fn attach(&mut self, tenant: TenantId, stream: &Arc<CudaStream>) -> Result<()> {
        self.tenant_mut(tenant)?.fence.attach(stream);
        Ok(())
    }

    /// Unmaps every block of the tenant (after its fence), returns the chunks to the cache and
    /// frees its reservation. If the fence fails, the tenant's mappings are leaked instead of
    /// unmapped under running work, and the error is returned.
    pub fn unregister(&mut self, tenant: TenantId) -> Result<()> {
        let fenced = self.tenant(tenant)?.fence.wait();
        let state = self.tenants.remove(&tenant).expect("checked above");
        let base = state.reservation.base();
        let capacity = state.reservation.bytes();
        for (block, block_state) in state.blocks {
            self.drop_segments(tenant, block, block_state.segments, fenced.is_ok());
        }
        let closed = self.book.close_account(tenant);
        debug_assert!(closed || fenced.is_err());
        self.log(EventKind::Unregister, Some(tenant), base, capacity);
        fenced
    }

    // ---- memory -----------------------------------------------------------------------------

    /// Finds `bytes` (granule multiple) of physical memory for `tenant`: cached chunks first,
    /// then one new chunk, draining the cache and retrying once if the driver is out of memory.
    /// On error nothing is held.
    fn acquire(
        &mut self,
        tenant: TenantId,
        bytes: usize,
        room: usize,
    ) -> Result<Vec<(ChunkId, bool)>> {
        let name = self.tenant(tenant)?.name.clone();
        let (held_before, cached_before) = (self.book.held(), self.book.cached());
        let plan = match self.book.plan(tenant, bytes, self.switches.stitching, room) {
            Ok(plan) => plan,
            Err(refused) => return Err(self.refuse(tenant, over_budget(refused, &name))),
        };
        if !plan.release_first.is_empty() {
            self.release_cached(&plan.release_first, DrainReason::Budget, Some(tenant));
        }
        for &id in &plan.reuse {
            let taken = self.book.take(id, tenant);
            debug_assert!(taken);
        }
        let mut chunks: Vec<(ChunkId, bool)> = plan.reuse.iter().map(|&id| (id, true)).collect();
        if plan.create > 0 {
            let created = match self.create(tenant, plan.create) {
                Err(error) if error.is_out_of_memory() && self.switches.drain_on_oom => {
                    // The plan's own chunks are held now, so this drains only the rest.
                    let others: Vec<ChunkId> =
                        self.book.cached_chunks().map(|(id, _)| id).collect();
                    let drained =
                        self.release_cached(&others, DrainReason::OutOfMemory, Some(tenant));
                    if drained > 0 {
                        self.create(tenant, plan.create).map_err(|e| (e, drained))
                    } else {
                        Err((error, 0))
                    }
                }
                other => other.map_err(|e| (e, 0)),
            };
            match created {
                Ok(id) => chunks.push((id, false)),
                Err((error, drained)) => {
                    self.give_back_all(&chunks);
                    let error = if error.is_out_of_memory() {
                        Error::PoolOutOfMemory {
                            asked: bytes,
                            cached: cached_before,
                            held: held_before,
                            drained,
                        }
                    } else {
                        error
                    };
                    return Err(self.refuse(tenant, error));
                }
            }
        }
        if chunks.iter().any(|&(_, reused)| reused) {
            self.counters.reuses += 1;
        }
        if chunks.len() > 1 {
            self.counters.stitched += 1;
        }
        Ok(chunks)
    }

    fn create(&mut self, tenant: TenantId, bytes: usize) -> Result<ChunkId> {
        if !self.book.fits_budget(bytes) {
            // Cannot happen after a plan (it makes room first); a guard, not a path.
            let (limit, held) = (self.book.budget().unwrap_or(0), self.book.held());
            return Err(Error::OverBudget {
                scope: "pool budget".into(),
                asked: bytes,
                limit,
                held,
            });
        }
        let memory = Physical::new(&self.ctx, bytes, false)?;
        let id = self
            .book
            .insert(bytes, Some(tenant))
            .expect("budget and tenant checked above");
        self.memory.insert(id, Arc::new(memory));
        self.counters.creates += 1;
        self.log(EventKind::Create { chunk: id }, Some(tenant), 0, bytes);
        Ok(id)
    }

    fn give_back_all(&mut self, chunks: &[(ChunkId, bool)]) {
        for &(id, _) in chunks {
            let given = self.book.give_back(id);
            debug_assert!(given);
        }
    }

    /// Releases cached chunks to the driver. Cached chunks are unmapped, and were unmapped only
    /// after their tenant's fence, so no work can use them.
    fn release_cached(
        &mut self,
        ids: &[ChunkId],
        reason: DrainReason,
        tenant: Option<TenantId>,
    ) -> usize {
        let mut released = 0;
        let mut count = 0;
        for &id in ids {
            if let Some(bytes) = self.book.remove(id) {
                self.memory.remove(&id); // the last Arc: cuMemRelease
                self.counters.releases += 1;
                self.log(EventKind::Release { chunk: id }, tenant, 0, bytes);
                released += bytes;
                count += 1;
            }
        }
        if count > 0 {
            self.counters.drains += 1;
            self.counters.drained_bytes += released;
            self.log(
                EventKind::Drain {
                    chunks: count,
                    reason,
                },
                tenant,
                0,
                released,
            );
            tracing::info!(
                ?reason,
                chunks = count,
                bytes = released,
                "drained the pool's cache"
            );
        }
        released
    }

    /// Releases every cached chunk; returns the bytes released.
    pub fn drain(&mut self) -> usize {
        let everything: Vec<ChunkId> = self.book.cached_chunks().map(|(id, _)| id).collect();
        self.release_cached(&everything, DrainReason::Requested, None)
    }

    /// Maps `chunks` one after another from the block's current mapped end. All or nothing.
    fn map_chunks(
        &mut self,
        tenant: TenantId,
        block: BlockId,
        chunks: &[(ChunkId, bool)],
    ) -> Result<()> {
        let granularity = self.book.granularity();
        let state = self.tenants.get(&tenant).expect("checked by the caller");
        let block_state = state.blocks.get(&block).expect("checked by the caller");
        let block_offset = block_state.first_granule * granularity;
        let mut offset = block_state.mapped();
        let mut made: Vec<Segment> = Vec::with_capacity(chunks.len());
        let mut failure = None;
        for &(chunk, _) in chunks {
            let memory = self.memory[&chunk].clone();
            let bytes = memory.bytes();
            match Mapping::new(
                &state.reservation,
                block_offset + offset,
                &memory,
                0,
                bytes,
                &self.access,
            ) {
                Ok(mapping) => {
                    made.push(Segment {
                        chunk,
                        offset,
                        mapping,
                    });
                    offset += bytes;
                }
                Err(error) => {
                    failure = Some(error);
                    break;
                }
            }
        }
        if let Some(error) = failure {
            drop(made); // never used by any work: unmapping at once is safe
            self.give_back_all(chunks);
            return Err(self.refuse(tenant, error));
        }
        let mut logged = Vec::with_capacity(made.len());
        for (segment, &(_, reused)) in made.iter().zip(chunks) {
            logged.push((
                segment.chunk,
                segment.mapping.ptr(),
                segment.mapping.bytes(),
                reused,
            ));
        }
        let state = self
            .tenants
            .get_mut(&tenant)
            .expect("checked by the caller");
        state
            .blocks
            .get_mut(&block)
            .expect("checked by the caller")
            .segments
            .extend(made);
        let (tenant_mapped, _) = self.book.held_by(tenant);
        state.peak_mapped = state.peak_mapped.max(tenant_mapped);
        self.counters.peak_mapped = self.counters.peak_mapped.max(self.book.held());
        for (chunk, address, bytes, reused) in logged {
            self.log(
                EventKind::Map {
                    chunk,
                    block,
                    reused,
                },
                Some(tenant),
                address,
                bytes,
            );
        }
        Ok(())
    }

    /// Unmaps segments (the fence was waited for, unless `fenced` is false: then they are
    /// leaked) and returns their chunks to the cache.
    fn drop_segments(
        &mut self,
        tenant: TenantId,
        block: BlockId,
        segments: Vec<Segment>,
        fenced: bool,
    ) {
        for mut segment in segments {
            let (address, bytes) = (segment.mapping.ptr(), segment.mapping.bytes());
            if fenced {
                drop(segment.mapping);
                let given = self.book.give_back(segment.chunk);
                debug_assert!(given);
                self.log(
                    EventKind::Unmap {
                        chunk: segment.chunk,
                        block,
                    },
                    Some(tenant),
                    address,
                    bytes,
                );
            } else {
                segment.mapping.leak_on_drop();
                drop(segment.mapping);
                self.book.forget_held(segment.chunk);
                // The leaked mapping keeps its own count of the memory forever.
                self.memory.remove(&segment.chunk);
            }
        }
    }

    // ---- blocks -----------------------------------------------------------------------------

    /// Carves `capacity` bytes of the tenant's addresses into a block and maps `len` of them.
    ///
    /// A block that cannot grow (`capacity` is `len` rounded up) is carved an eighth larger where
    /// the tenant has the room, so the planner may finish it with a cached chunk slightly bigger
    /// than what is missing instead of creating memory; the unused spare addresses are handed
    /// back right after.
    pub fn alloc(
        &mut self,
        tenant: TenantId,
        len: usize,
        capacity: usize,
    ) -> Result<(BlockId, u64, usize)> {
        let granularity = self.book.granularity();
        let rounded = self.book.round(capacity.max(len));
        let fixed = rounded == self.book.round(len);
        let block = BlockId(self.next_block);
        let state = self.tenant_mut(tenant)?;
        state.fence.check_not_capturing()?;
        let capacity = match rounded {
            Some(c) if c > 0 => c,
            _ => {
                return Err(Error::InvalidShape(format!(
                    "a block of {len} bytes with capacity {capacity}"
                )))
            }
        };
        let spare = if fixed {
            capacity / 8 / granularity * granularity
        } else {
            0
        };
        let carved = [capacity + spare, capacity]
            .into_iter()
            .find_map(|bytes| Some((state.granules.allocate(bytes / granularity)?, bytes)));
        let Some((first_granule, carved)) = carved else {
            let error = Error::VirtualCapacity {
                tenant: state.name.to_string(),
                asked: capacity,
                capacity: state.reservation.bytes(),
                largest_free_run: state.granules.largest_free_run() * granularity,
            };
            return Err(self.refuse(tenant, error));
        };
        let address = state.reservation.base() + (first_granule * granularity) as u64;
        state.blocks.insert(
            block,
            BlockState {
                first_granule,
                capacity: carved,
                len: 0,
                segments: Vec::new(),
            },
        );
        self.next_block += 1;
        self.log(EventKind::Alloc { block }, Some(tenant), address, carved);
        if len > 0 {
            if let Err(error) = self.grow(tenant, block, len) {
                let state = self.tenants.get_mut(&tenant).expect("present above");
                state.blocks.remove(&block);
                state.granules.release(first_granule, carved / granularity);
                self.log(EventKind::Free { block }, Some(tenant), address, carved);
                return Err(error);
            }
        }
        // Hand back the spare addresses the mapping did not use.
        let state = self.tenants.get_mut(&tenant).expect("present above");
        let block_state = state.blocks.get_mut(&block).expect("present above");
        let keep = capacity.max(block_state.mapped());
        if keep < carved {
            let released = state.granules.release(
                first_granule + keep / granularity,
                (carved - keep) / granularity,
            );
            debug_assert!(released);
            block_state.capacity = keep;
        }
        Ok((block, address, keep))
    }

    pub fn info(&self, tenant: TenantId, block: BlockId) -> Result<BlockInfo> {
        let granularity = self.book.granularity();
        let state = self.tenant(tenant)?;
        let block_state = self.block(tenant, block)?;
        Ok(BlockInfo {
            address: state.reservation.base() + (block_state.first_granule * granularity) as u64,
            len: block_state.len,
            capacity: block_state.capacity,
            mapped: block_state.mapped(),
            mappings: block_state.segments.len(),
        })
    }

    /// Maps more memory behind the block so it holds `new_len` bytes; nothing moves.
    pub fn grow(&mut self, tenant: TenantId, block: BlockId, new_len: usize) -> Result<()> {
        self.tenant(tenant)?.fence.check_not_capturing()?;
        let info = self.info(tenant, block)?;
        if new_len < info.len {
            return Err(Error::InvalidShape(format!(
                "grow to {new_len} bytes, below the current {}",
                info.len
            )));
        }
        if new_len > info.capacity {
            return Err(self.refuse(
                tenant,
                Error::BeyondCapacity {
                    asked: new_len,
                    capacity: info.capacity,
                },
            ));
        }
        let needed = self.book.round(new_len).expect("below capacity");
        if needed > info.mapped {
            let room = info.capacity - info.mapped;
            let chunks = self.acquire(tenant, needed - info.mapped, room)?;
            self.map_chunks(tenant, block, &chunks)?;
        }
        self.set_len(tenant, block, new_len, true);
        Ok(())
    }

    /// Keeps the first `new_len` bytes; whole chunks past them are unmapped (after the fence)
    /// and cached. A chunk that straddles `new_len` stays mapped.
    pub fn shrink(&mut self, tenant: TenantId, block: BlockId, new_len: usize) -> Result<()> {
        let info = self.info(tenant, block)?;
        if new_len > info.len {
            return Err(Error::InvalidShape(format!(
                "shrink to {new_len} bytes, above the current {}",
                info.len
            )));
        }
        let keep = self.book.round(new_len).expect("below len");
        let state = self.tenant(tenant)?;
        let block_state = self.block(tenant, block)?;
        let first_dropped = block_state
            .segments
            .iter()
            .position(|s| s.offset >= keep)
            .unwrap_or(block_state.segments.len());
        if first_dropped < block_state.segments.len() {
            state.fence.wait()?;
            let state = self.tenants.get_mut(&tenant).expect("present above");
            let dropped = state
                .blocks
                .get_mut(&block)
                .expect("present above")
                .segments
                .split_off(first_dropped);
            self.drop_segments(tenant, block, dropped, true);
        }
        self.set_len(tenant, block, new_len, false);
        Ok(())
    }

    fn set_len(&mut self, tenant: TenantId, block: BlockId, len: usize, grew: bool) {
        let Some(block_state) = self
            .tenants
            .get_mut(&tenant)
            .and_then(|t| t.blocks.get_mut(&block))
        else {
            return;
        };
        block_state.len = len;
        let kind = if grew {
            EventKind::Grow { block }
        } else {
            EventKind::Shrink { block }
        };
        let address = self.info(tenant, block).map_or(0, |i| i.address);
        self.log(kind, Some(tenant), address, len);
    }

    /// Frees a block: unmaps it after the fence and caches its chunks. If the fence fails, the
    /// mappings are leaked (never unmapped under work that may still run) and the error returned.
    pub fn free(&mut self, tenant: TenantId, block: BlockId) -> Result<()> {
        let info = self.info(tenant, block)?;
        let granularity = self.book.granularity();
        let state = self.tenant(tenant)?;
        let fenced = if info.mappings > 0 {
            state.fence.wait()
        } else {
            Ok(())
        };
        let state = self.tenants.get_mut(&tenant).expect("present above");
        let block_state = state.blocks.remove(&block).expect("present above");
        let (first, count) = (
            block_state.first_granule,
            block_state.capacity / granularity,
        );
        if fenced.is_ok() {
            let released = state.granules.release(first, count);
            debug_assert!(released);
        }
        self.drop_segments(tenant, block, block_state.segments, fenced.is_ok());
        self.log(
            EventKind::Free { block },
            Some(tenant),
            info.address,
            info.capacity,
        );
        fenced
    }

    // ---- statistics -------------------------------------------------------------------------

    pub fn tenant_stats(&self, tenant: TenantId) -> Result<TenantStats> {
        let granularity = self.book.granularity();
        let state = self.tenant(tenant)?;
        let (mapped, _) = self.book.held_by(tenant);
        Ok(TenantStats {
            name: state.name.to_string(),
            virtual_capacity: state.reservation.bytes(),
            virtual_in_use: state.granules.taken() * granularity,
            mapped,
            mappings: state.blocks.values().map(|b| b.segments.len()).sum(),
            blocks: state.blocks.len(),
            physical_limit: self.book.limit_of(tenant),
            largest_free_run: state.granules.largest_free_run() * granularity,
            virtual_fragmentation: state.granules.fragmentation(),
            peak_mapped: state.peak_mapped,
        })
    }

    pub fn all_tenant_stats(&self) -> Vec<TenantStats> {
        self.tenants
            .keys()
            .filter_map(|&id| self.tenant_stats(id).ok())
            .collect()
    }

    pub fn stats(&self) -> PoolStats {
        let granularity = self.book.granularity();
        let free_virtual: usize = self.tenants.values().map(|t| t.granules.free()).sum();
        let largest_run = self
            .tenants
            .values()
            .map(|t| t.granules.largest_free_run())
            .max()
            .unwrap_or(0);
        let cached = self.book.cached();
        let largest_cached = self.book.largest_cached_chunk();
        PoolStats {
            tenants: self.tenants.len(),
            reserved_virtual: self.tenants.values().map(|t| t.reservation.bytes()).sum(),
            mapped: self.book.held(),
            cached,
            budget: self.book.budget(),
            mappings: self
                .tenants
                .values()
                .flat_map(|t| t.blocks.values())
                .map(|b| b.segments.len())
                .sum(),
            chunks: self.book.chunk_count(),
            largest_free_run: largest_run * granularity,
            largest_cached_chunk: largest_cached,
            virtual_fragmentation: if free_virtual == 0 {
                0.0
            } else {
                1.0 - largest_run as f64 / free_virtual as f64
            },
            cache_fragmentation: if cached == 0 {
                0.0
            } else {
                1.0 - largest_cached as f64 / cached as f64
            },
            peak_mapped: self.counters.peak_mapped,
            creates: self.counters.creates,
            releases: self.counters.releases,
            reuses: self.counters.reuses,
            stitched: self.counters.stitched,
            drains: self.counters.drains,
            drained_bytes: self.counters.drained_bytes,
            refusals: self.counters.refusals,
        }
    }
}

impl Drop for State {
    fn drop(&mut self) {
        // Tenants hold the pool alive, so none is left here; only cached chunks, which are
        // unmapped. Release them before the context handle goes.
        debug_assert!(self.tenants.is_empty());
        self.memory.clear();
    }
}
