//! Chunks: finding physical memory for a request (cache first, then one new chunk), draining
//! the cache on out-of-memory, and releasing chunks to the driver.

use std::sync::Arc;

use super::{over_budget, State};
use crate::error::{Error, Result};
use crate::pool::backend::Backend;
use crate::pool::book::{ChunkId, TenantId};
use crate::pool::events::{DrainReason, EventKind};

impl<B: Backend> State<B> {
    /// Finds `bytes` (granule multiple) of physical memory for `tenant`: cached chunks first,
    /// then one new chunk, draining the cache and retrying once if the driver is out of memory.
    /// On error nothing is held.
    pub(super) fn acquire(
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

    pub(super) fn create(&mut self, tenant: TenantId, bytes: usize) -> Result<ChunkId> {
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
        let memory = self.backend.create(bytes)?;
        let id = self
            .book
            .insert(bytes, Some(tenant))
            .expect("budget and tenant checked above");
        self.memory.insert(id, Arc::new(memory));
        self.counters.creates += 1;
        self.log(EventKind::Create { chunk: id }, Some(tenant), 0, bytes);
        Ok(id)
    }

    pub(super) fn give_back_all(&mut self, chunks: &[(ChunkId, bool)]) {
        for &(id, _) in chunks {
            let given = self.book.give_back(id);
            debug_assert!(given);
        }
    }

    /// Releases cached chunks to the driver. Cached chunks are unmapped, and were unmapped only
    /// after their tenant's fence, so no work can use them.
    pub(super) fn release_cached(
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
    pub(crate) fn drain(&mut self) -> usize {
        let everything: Vec<ChunkId> = self.book.cached_chunks().map(|(id, _)| id).collect();
        self.release_cached(&everything, DrainReason::Requested, None)
    }
}
