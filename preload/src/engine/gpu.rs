//! The [`Device`] of a real GPU: stablebuf's [`ElasticPool`] (one tenant for untagged
//! allocations) and one [`Region`] per tag, with one pinned [`HostArena`] shared by all
//! devices for pauses that keep contents.
//!
//! Safe Rust: driver work goes through stablebuf (cudarc underneath, which loads libcuda by
//! itself, so none of it passes through this library's hooks), and the few runtime calls
//! through `real`.

use std::collections::BTreeMap;
use std::sync::{Arc, Mutex, MutexGuard, PoisonError};
use std::time::{Duration, Instant};

use stablebuf::cudarc::driver::{CudaContext, CudaStream};
use stablebuf::pool::{human_bytes, Event};
use stablebuf::pool::{Block, Tenant};
use stablebuf::{ElasticPool, HostArena, PoolOptions};

use crate::cuda::codes::Fail;
use crate::cuda::real;
use crate::engine::device::{Device, PoolView, TagView, Transfer};
use crate::engine::elide::PendingCopy;

use stablebuf::host::StorageUsed;
use stablebuf::region::{Region, RegionOptions};
use stablebuf::HostStorage;

/// The untagged tenant reserves this many times the device's memory in addresses (at least
/// 64 GiB): reserving is nearly free, and room keeps best fit from running out of runs.
const VIRTUAL_FACTOR: usize = 4;
const MIN_VIRTUAL: usize = 64 << 30;

fn lock<T>(mutex: &Mutex<T>) -> MutexGuard<'_, T> {
    mutex.lock().unwrap_or_else(PoisonError::into_inner)
}

/// Options every device is opened with.
#[derive(Clone, Debug)]
pub struct GpuOptions {
    pub budget: Option<usize>,
    pub stitching: bool,
    pub drain_on_oom: bool,
    /// The layer's start: timelines of all devices share this clock.
    pub origin: Instant,
}

/// The pinned host arena, shared by every device: pinned once, at the first pause that keeps
/// contents (or by `stablebuf_reserve_host`, or `STABLEBUF_PRELOAD_HOST_ARENA` at that first
/// use), replaced by a larger one only while no paused tag holds bytes in it.
#[derive(Debug, Default)]
pub struct HostSlot {
    configured: Option<usize>,
    arena: Mutex<Option<Arc<HostArena>>>,
}

impl HostSlot {
    pub fn new(configured: Option<usize>) -> Self {
        Self {
            configured,
            arena: Mutex::new(None),
        }
    }

    /// An arena for a pause of `needed` bytes: the current one if it has room or is in use
    /// (then a pause that does not fit streams through it into pageable memory), else a new,
    /// larger one (this pins: ~0.5 s per GiB, once).
    pub fn arena_for(&self, ctx: &Arc<CudaContext>, needed: usize) -> Result<Arc<HostArena>, Fail> {
        let mut slot = lock(&self.arena);
        if let Some(arena) = slot.as_ref() {
            let in_use = arena.free_bytes() < arena.capacity();
            if arena.largest_free() >= needed || in_use {
                return Ok(arena.clone());
            }
        }
        let old = slot.as_ref().map_or(0, |a| a.capacity());
        let size = needed.max(self.configured.unwrap_or(0)).max(old);
        tracing::info!(
            bytes = size,
            "pinning {} of host memory for pauses (once; later pauses reuse it)",
            human_bytes(size)
        );
        let started = Instant::now();
        match HostArena::new(ctx, size) {
            Ok(arena) => {
                tracing::info!(
                    seconds = started.elapsed().as_secs_f64(),
                    "host memory pinned"
                );
                *slot = Some(arena.clone());
                Ok(arena)
            }
            Err(error) => match slot.as_ref() {
                // Could not grow: the old arena still serves (a pause that does not fit it is
                // staged through it).
                Some(arena) => Ok(arena.clone()),
                None => Err(Fail::from(error)),
            },
        }
    }

    pub fn capacity(&self) -> usize {
        lock(&self.arena).as_ref().map_or(0, |a| a.capacity())
    }
}

/// One tag's region on one device.
struct RegionEntry {
    region: Region,
    created: Instant,
}

pub struct GpuDevice {
    ordinal: usize,
    ctx: Arc<CudaContext>,
    pool: ElasticPool,
    tenant: Tenant,
    stream: Arc<CudaStream>,
    created: Instant,
    origin: Instant,
    host: Arc<HostSlot>,
    regions: Mutex<BTreeMap<Arc<str>, RegionEntry>>,
}

impl GpuDevice {
    /// Opens device `ordinal`: retains its primary context (as the runtime does), makes the
    /// pool, the untagged tenant and a stream for pauses.
    pub fn open(ordinal: usize, options: &GpuOptions, host: Arc<HostSlot>) -> Result<Self, Fail> {
        let ctx = stablebuf::open_device(ordinal)?;
        let (_, total) = stablebuf::device::memory_info(&ctx)?;
        let mut pool_options = PoolOptions::default()
            .stitching(options.stitching)
            .drain_on_oom(options.drain_on_oom);
        if let Some(budget) = options.budget {
            pool_options = pool_options.budget(budget);
        }
        let pool = ElasticPool::new(&ctx, pool_options)?;
        let capacity = total.saturating_mul(VIRTUAL_FACTOR).max(MIN_VIRTUAL);
        let tenant = pool.register("untagged", capacity)?;
        let stream = ctx.new_stream().map_err(stablebuf::Error::from)?;
        tracing::info!(ordinal, total, capacity, "stablebuf pool opened");
        Ok(Self {
            ordinal,
            ctx,
            pool,
            tenant,
            stream,
            created: Instant::now(),
            origin: options.origin,
            host,
            regions: Mutex::new(BTreeMap::new()),
        })
    }

    fn offset(&self, at: Instant) -> Duration {
        at.saturating_duration_since(self.origin)
    }
}

impl GpuDevice {
    fn region(&self, tag: &str) -> Result<Region, Fail> {
        let mut regions = lock(&self.regions);
        if let Some(entry) = regions.get(tag) {
            return Ok(entry.region.clone());
        }
        let region = Region::new(&self.ctx, tag, RegionOptions::default())?;
        regions.insert(
            Arc::from(tag),
            RegionEntry {
                region: region.clone(),
                created: Instant::now(),
            },
        );
        Ok(region)
    }

    fn existing_region(&self, tag: &str) -> Option<Region> {
        lock(&self.regions).get(tag).map(|e| e.region.clone())
    }
}

fn transfer(report: stablebuf::host::TransferReport) -> Transfer {
    Transfer {
        bytes: report.bytes,
        copied: if report.storage == StorageUsed::Discarded {
            0
        } else {
            report.bytes
        },
        elapsed: report.elapsed,
    }
}

impl Device for GpuDevice {
    type Block = Block;

    fn alloc(&self, bytes: usize) -> Result<(u64, Block), Fail> {
        let block = self.tenant.alloc(bytes)?;
        Ok((block.address(), block))
    }

    fn alloc_held(&self, bytes: usize) -> Result<(u64, Block), Fail> {
        let block = self.tenant.alloc_held(bytes)?;
        Ok((block.address(), block))
    }

    fn map_held(&self, block: &mut Block) -> Result<(), Fail> {
        block.map_held().map_err(Fail::from)
    }

    fn free(&self, block: Block) -> Result<(), Fail> {
        block.free().map_err(Fail::from)
    }

    fn graft(&self, target: &mut Block, mut source: Block) -> Result<(), (Fail, Option<Block>)> {
        // All or nothing: on an error both blocks are as they were, so the caller can copy.
        match target.graft(&mut source) {
            Ok(()) => {
                // The source now holds nothing; dropping it frees no memory.
                drop(source);
                Ok(())
            }
            Err(error) => Err((Fail::from(error), Some(source))),
        }
    }

    fn copy_now(&self, copy: &PendingCopy) -> Result<(), Fail> {
        real::copy_and_wait(copy.device, copy.dst, copy.src, copy.bytes, copy.stream)
    }

    fn is_capturing(&self, stream: u64) -> bool {
        real::stream_is_capturing(stream)
    }

    fn tag_alloc(&self, tag: &str, bytes: usize) -> Result<u64, Fail> {
        Ok(self.region(tag)?.alloc(bytes)?)
    }

    fn tag_free(&self, tag: &str, address: u64) -> Result<(), Fail> {
        let region = self
            .existing_region(tag)
            .ok_or_else(|| Fail::Internal(format!("no region for tag {tag:?}")))?;
        region.free(address).map(drop).map_err(Fail::from)
    }

    fn pause(&self, tag: &str, keep: bool) -> Result<Transfer, Fail> {
        let Some(region) = self.existing_region(tag) else {
            return Ok(Transfer::default());
        };
        let storage = if keep {
            let needed = region.stats().allocated;
            HostStorage::Pinned(self.host.arena_for(&self.ctx, needed)?)
        } else {
            HostStorage::Discard
        };
        Ok(transfer(region.sleep(&storage, &self.stream)?))
    }

    fn resume(&self, tag: &str) -> Result<Transfer, Fail> {
        match self.existing_region(tag) {
            Some(region) => Ok(transfer(region.wake(&self.stream)?)),
            None => Ok(Transfer::default()),
        }
    }

    fn reserve_host(&self, bytes: usize) -> Result<(), Fail> {
        self.host.arena_for(&self.ctx, bytes).map(drop)
    }

    fn host_arena_bytes(&self) -> usize {
        self.host.capacity()
    }

    fn pool(&self) -> PoolView {
        let stats = self.pool.stats();
        PoolView {
            mapped: stats.mapped,
            cached: stats.cached,
            peak_mapped: stats.peak_mapped,
            mappings: stats.mappings,
            creates: stats.creates,
            reuses: stats.reuses,
            stitched: stats.stitched,
            drains: stats.drains,
        }
    }

    fn tag(&self, tag: &str) -> Option<TagView> {
        let stats = self.existing_region(tag)?.stats();
        Some(TagView {
            allocated: stats.allocated,
            mapped: stats.mapped,
            host_bytes: stats.host_bytes,
            asleep: stats.asleep,
        })
    }

    fn events(&self) -> Vec<(Duration, u32, Vec<Event>)> {
        let base = self.ordinal as u32 * 10_000;
        let mut sources = vec![(self.offset(self.created), base, self.pool.events())];
        for (index, entry) in lock(&self.regions).values().enumerate() {
            sources.push((
                self.offset(entry.created),
                base + 5_000 + index as u32 * 100,
                entry.region.events(),
            ));
        }
        sources
    }

    fn summary(&self) -> String {
        let mut line = format!("pool: {}", self.pool.stats());
        for (tag, entry) in lock(&self.regions).iter() {
            let stats = entry.region.stats();
            line.push_str(&format!(
                "; tag {tag:?}: {} in {} allocations{}",
                human_bytes(stats.allocated),
                stats.allocations,
                if stats.asleep {
                    format!(", paused ({} on the host)", human_bytes(stats.host_bytes))
                } else {
                    String::new()
                }
            ));
        }
        line
    }
}
