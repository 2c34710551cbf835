//! The pool's state behind its lock, and every operation that changes it.
//!
//! Each operation plans with the pure bookkeeping first ([`ChunkLedger`], [`GranuleMap`]), then
//! makes the driver calls, and commits to the books only what succeeded; on an error it undoes
//! its own driver work, so the pool is as it was (apart from cache it released to make room).

use std::collections::{BTreeMap, HashMap};
use std::sync::Arc;
use std::time::Instant;

use super::backend::{Backend, MappedRange};
use super::events::{BlockId, Event, EventKind, EventLog};
use super::granules::GranuleMap;
use super::ledger::{BudgetScope, ChunkId, ChunkLedger, OverBudget, TenantId};
use crate::error::{Error, PoolError, Result};
use crate::fence::FencePolicy;

mod blocks;
mod chunks;
mod deferred_map;
mod segments;
mod statistics;
mod tenants;

/// Switches that may change while the pool lives.
#[derive(Clone, Copy, Debug)]
pub(crate) struct Switches {
    pub(crate) stitching: bool,
    pub(crate) drain_on_oom: bool,
}

pub(crate) struct State<B: Backend> {
    backend: B,
    started: Instant,
    fence_policy: FencePolicy,
    switches: Switches,
    book: ChunkLedger,
    memory: HashMap<ChunkId, Arc<B::Memory>>,
    tenants: BTreeMap<TenantId, TenantState<B>>,
    next_tenant: u32,
    next_block: u64,
    events: EventLog,
    counters: Counters,
    /// Bytes of chunks created for requests since the pool last asked
    /// ([`State::take_created`]): what a create-ahead worker prepares next.
    created_for_requests: usize,
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

pub(super) struct TenantState<B: Backend> {
    name: Arc<str>,
    reservation: B::Reservation,
    granules: GranuleMap,
    blocks: BTreeMap<BlockId, BlockState<B>>,
    fence: B::Fence,
    peak_mapped: usize,
}

pub(super) struct BlockState<B: Backend> {
    first_granule: usize,
    capacity: usize,
    len: usize,
    segments: Vec<Segment<B>>,
    /// Chunks acquired for the block but not mapped yet ([`State::alloc_held`]): the memory
    /// is the block's (a refusal was reported at allocation), the mapping comes later.
    held: Vec<(ChunkId, bool)>,
    /// The length the block gets once `held` is mapped.
    held_len: usize,
}

/// One chunk mapped into a block, at `offset` bytes from the block's start.
pub(super) struct Segment<B: Backend> {
    chunk: ChunkId,
    offset: usize,
    mapping: B::Mapping,
}

impl<B: Backend> BlockState<B> {
    fn mapped(&self) -> usize {
        self.segments
            .last()
            .map_or(0, |s| s.offset + s.mapping.bytes())
    }
}

/// A block's figures now ([`Block::info`](crate::pool::Block::info)).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub struct BlockInfo {
    /// The block's device address (fixed for its life).
    pub address: u64,
    /// Usable bytes: what was asked for at allocation or by the last grow or shrink.
    pub len: usize,
    /// Bytes of addresses reserved for the block: the most it can grow to.
    pub capacity: usize,
    /// Bytes of physical memory mapped behind it: `len` rounded up to the granularity, or a
    /// little more when a stitched cached chunk overshot.
    pub mapped: usize,
    /// Mappings (chunks) behind it: 1 for a fresh block; more when stitched or grown.
    pub mappings: usize,
    /// Bytes of physical memory held for the block but not mapped yet
    /// ([`Tenant::alloc_held`](crate::pool::Tenant::alloc_held)); 0 once mapped.
    pub held: usize,
}

fn over_budget(refused: OverBudget, name: &str) -> Error {
    let scope = match refused.scope {
        BudgetScope::Pool => "pool budget".to_string(),
        BudgetScope::Tenant(_) => format!("tenant `{name}`'s limit"),
    };
    Error::Pool(PoolError::OverBudget {
        scope,
        asked: refused.asked,
        limit: refused.limit,
        held: refused.held,
    })
}

impl<B: Backend> State<B> {
    pub(crate) fn new(
        backend: B,
        granularity: usize,
        budget: Option<usize>,
        switches: Switches,
        fence_policy: FencePolicy,
        event_capacity: usize,
    ) -> Self {
        Self {
            backend,
            started: Instant::now(),
            fence_policy,
            switches,
            book: ChunkLedger::new(granularity, budget),
            memory: HashMap::new(),
            tenants: BTreeMap::new(),
            next_tenant: 1,
            next_block: 1,
            events: EventLog::new(event_capacity),
            counters: Counters::default(),
            created_for_requests: 0,
        }
    }

    pub(super) fn log(
        &mut self,
        kind: EventKind,
        tenant: Option<TenantId>,
        address: u64,
        bytes: usize,
    ) {
        let at = self.started.elapsed();
        self.events.push(Event {
            at,
            kind,
            tenant,
            address,
            bytes,
        });
    }

    pub(super) fn refuse(&mut self, tenant: TenantId, error: Error) -> Error {
        self.counters.refusals += 1;
        self.log(EventKind::Refused, Some(tenant), 0, 0);
        tracing::debug!(%error, "pool request refused");
        error
    }

    pub(crate) fn switches_mut(&mut self) -> &mut Switches {
        &mut self.switches
    }

    pub(crate) fn events(&self) -> &EventLog {
        &self.events
    }

    #[cfg(test)]
    pub(crate) fn book(&self) -> &ChunkLedger {
        &self.book
    }

    pub(super) fn tenant(&self, tenant: TenantId) -> Result<&TenantState<B>> {
        self.tenants.get(&tenant).ok_or_else(|| {
            Error::Pool(PoolError::TenantGone {
                tenant: format!("#{}", tenant.0),
            })
        })
    }

    pub(super) fn tenant_mut(&mut self, tenant: TenantId) -> Result<&mut TenantState<B>> {
        self.tenants.get_mut(&tenant).ok_or_else(|| {
            Error::Pool(PoolError::TenantGone {
                tenant: format!("#{}", tenant.0),
            })
        })
    }

    pub(super) fn block(&self, tenant: TenantId, block: BlockId) -> Result<&BlockState<B>> {
        let state = self.tenant(tenant)?;
        state.blocks.get(&block).ok_or_else(|| {
            Error::Pool(PoolError::TenantGone {
                tenant: state.name.to_string(),
            })
        })
    }
}

impl<B: Backend> Drop for State<B> {
    fn drop(&mut self) {
        // Tenants hold the pool alive, so none is left here; only cached chunks, which are
        // unmapped. Release them before the context handle goes.
        debug_assert!(self.tenants.is_empty());
        self.memory.clear();
    }
}
