//! Chunks: finding physical memory for a request (cache first, then one new chunk), draining
//! the cache on out-of-memory, and releasing chunks to the driver.

use std::sync::Arc;

use super::{over_budget, State};
use crate::error::{Error, PoolError, Result};
use crate::pool::backend::Backend;
use crate::pool::events::{DrainReason, EventKind};
use crate::pool::ledger::{mapping_cap, ChunkId, Plan, TenantId};

impl<B: Backend> State<B> {
    /// Finds `bytes` (granule multiple) of physical memory for `tenant`: cached chunks first,
    /// then one new chunk, draining the cache and retrying once if the driver is out of memory.
    /// On error nothing is held.
    ///
    /// A plan that would stitch more cached chunks than [`mapping_cap`] allows is first tried
    /// capped (the smallest chunks left in the cache, the rest created as one new chunk); if
    /// that new memory does not fit the device, the request is served uncapped, exactly as if
    /// there were no cap.
    pub(super) fn acquire(
        &mut self,
        tenant: TenantId,
        bytes: usize,
        room: usize,
    ) -> Result<Vec<(ChunkId, bool)>> {
        let name = self.tenant(tenant)?.name.clone();
        let (held_before, cached_before) = (self.book.held(), self.book.cached());
        let plan = match self
            .book
            .plan(tenant, bytes, self.switches.stitching, room, None)
        {
            Ok(plan) => plan,
            Err(refused) => return Err(self.refuse(tenant, over_budget(refused, &name))),
        };
        if let Some(capped) = self.capped(tenant, bytes, room, &plan) {
            match self.take_and_create(tenant, &capped) {
                Ok(chunks) => return Ok(self.count_served(chunks)),
                Err(error) if error.is_out_of_memory() => {
                    tracing::debug!(
                        bytes,
                        "no room for the new part of a capped stitch; stitching uncapped"
                    );
                }
                Err(error) => return Err(self.refuse(tenant, error)),
            }
        }
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
                        Error::Pool(PoolError::PoolOutOfMemory {
                            asked: bytes,
                            cached: cached_before,
                            held: held_before,
                            drained,
                        })
                    } else {
                        error
                    };
                    return Err(self.refuse(tenant, error));
                }
            }
        }
        Ok(self.count_served(chunks))
    }

    /// The plan with at most [`mapping_cap`] cached chunks, if it differs from `full` and its
    /// new chunk fits the budget without releasing any cache.
    fn capped(&self, tenant: TenantId, bytes: usize, room: usize, full: &Plan) -> Option<Plan> {
        let cap = mapping_cap(bytes);
        if !self.switches.stitching || full.reuse.len() <= cap {
            return None;
        }
        let capped = self.book.plan(tenant, bytes, true, room, Some(cap)).ok()?;
        (capped != *full && capped.create > 0 && capped.release_first.is_empty()).then_some(capped)
    }

    /// Takes the plan's cached chunks and creates its new one, with no drain on out-of-memory.
    /// On error nothing is held.
    fn take_and_create(&mut self, tenant: TenantId, plan: &Plan) -> Result<Vec<(ChunkId, bool)>> {
        for &id in &plan.reuse {
            let taken = self.book.take(id, tenant);
            debug_assert!(taken);
        }
        let mut chunks: Vec<(ChunkId, bool)> = plan.reuse.iter().map(|&id| (id, true)).collect();
        match self.create(tenant, plan.create) {
            Ok(id) => {
                chunks.push((id, false));
                Ok(chunks)
            }
            Err(error) => {
                self.give_back_all(&chunks);
                Err(error)
            }
        }
    }

    fn count_served(&mut self, chunks: Vec<(ChunkId, bool)>) -> Vec<(ChunkId, bool)> {
        if chunks.iter().any(|&(_, reused)| reused) {
            self.counters.reuses += 1;
        }
        if chunks.len() > 1 {
            self.counters.stitched += 1;
        }
        chunks
    }

    pub(super) fn create(&mut self, tenant: TenantId, bytes: usize) -> Result<ChunkId> {
        if !self.book.fits_budget(bytes) {
            // Cannot happen after a plan (it makes room first); a guard, not a path.
            let (limit, held) = (self.book.budget().unwrap_or(0), self.book.held());
            return Err(Error::Pool(PoolError::OverBudget {
                scope: "pool budget".into(),
                asked: bytes,
                limit,
                held,
            }));
        }
        let memory = self.backend.create(bytes)?;
        let id = self
            .book
            .insert(bytes, Some(tenant))
            .expect("budget and tenant checked above");
        self.memory.insert(id, Arc::new(memory));
        self.counters.creates += 1;
        self.created_for_requests += bytes;
        self.log(EventKind::Create { chunk: id }, Some(tenant), 0, bytes);
        Ok(id)
    }

    /// Bytes created for requests since the last call (and resets the count): how much a
    /// request just had to wait for `cuMemCreate`, so how much to create ahead of the next one.
    pub(crate) fn take_created(&mut self) -> usize {
        std::mem::take(&mut self.created_for_requests)
    }

    /// Puts memory created outside the lock (ahead of need) into the cache, where the next
    /// request finds it. Gives the memory back (the caller drops it: released) if it does not
    /// fit the budget now or is not a granule multiple.
    pub(crate) fn adopt(&mut self, memory: B::Memory, bytes: usize) -> Result<ChunkId, B::Memory> {
        let Some(id) = self.book.insert(bytes, None) else {
            return Err(memory);
        };
        self.memory.insert(id, Arc::new(memory));
        self.counters.creates += 1;
        self.log(EventKind::Create { chunk: id }, None, 0, bytes);
        Ok(id)
    }

    /// The memory the book can still take under the budget (`usize::MAX` without one).
    pub(crate) fn budget_room(&self) -> usize {
        self.book
            .budget()
            .map_or(usize::MAX, |b| b.saturating_sub(self.book.physical()))
    }

    /// The allocation granularity (every chunk is a multiple).
    pub(crate) fn granularity(&self) -> usize {
        self.book.granularity()
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

#[cfg(test)]
mod tests {
    use crate::fence::FencePolicy;
    use crate::pool::fake::{Call, Fake};
    use crate::pool::ledger::TenantId;
    use crate::pool::state::{State, Switches};

    const G: usize = 2 << 20;

    /// A pool on a fake device of `device` granules whose cache holds 20 one-granule chunks
    /// (40 one-granule blocks, every other one freed).
    fn fragmented(device: usize) -> (Fake, State<Fake>, TenantId) {
        let fake = Fake::new(device * G);
        let switches = Switches {
            stitching: true,
            drain_on_oom: true,
        };
        let mut state = State::new(fake.clone(), G, None, switches, FencePolicy::Context, 1024);
        let tenant = state.register("t", 256 * G, None).unwrap();
        let blocks: Vec<_> = (0..40)
            .map(|_| state.alloc(tenant, G, G).unwrap().0)
            .collect();
        for &block in blocks.iter().step_by(2) {
            state.free(tenant, block).unwrap();
        }
        assert_eq!(state.stats().cached, 20 * G);
        (fake, state, tenant)
    }

    #[test]
    fn with_room_on_the_device_a_request_stitches_at_most_its_cap_and_creates_the_rest() {
        let (fake, mut state, tenant) = fragmented(256);
        let creates = fake.calls(Call::Create);
        // 40 MiB: the cap is one chunk (one per 64 MiB), so 1 cached chunk + 19 granules new.
        let (block, _, _) = state.alloc(tenant, 20 * G, 20 * G).unwrap();
        let info = state.info(tenant, block).unwrap();
        assert_eq!((info.len, info.mapped, info.mappings), (20 * G, 20 * G, 2));
        assert_eq!(fake.calls(Call::Create), creates + 1);
        assert_eq!(
            state.stats().cached,
            19 * G,
            "the smallest chunks stay cached"
        );
        assert_eq!(fake.live_mappings(), state.stats().mappings);
        state.book().check_invariants().unwrap();
        state.unregister(tenant).unwrap();
    }

    #[test]
    fn on_a_full_device_the_same_request_stitches_every_chunk_it_needs() {
        let (fake, mut state, tenant) = fragmented(40);
        let creates = fake.calls(Call::Create);
        let (block, _, _) = state.alloc(tenant, 20 * G, 20 * G).unwrap();
        let info = state.info(tenant, block).unwrap();
        assert_eq!(
            info.mappings, 20,
            "no room for new memory: stitched uncapped"
        );
        assert_eq!(fake.calls(Call::Create), creates + 1, "one failed create");
        assert_eq!(fake.created_bytes(), 40 * G, "nothing new was made");
        assert_eq!(state.stats().cached, 0);
        let stats = state.stats();
        assert_eq!((stats.stitched, stats.refusals), (1, 0));
        state.book().check_invariants().unwrap();
        state.unregister(tenant).unwrap();
    }

    #[test]
    fn a_failed_set_access_over_a_stitched_run_leaves_nothing_mapped() {
        let (fake, mut state, tenant) = fragmented(40);
        let before = state.stats();
        let mappings = fake.live_mappings();
        fake.fail(Call::Access, 0);
        assert!(state.alloc(tenant, 20 * G, 20 * G).is_err());
        let after = state.stats();
        assert_eq!(
            fake.live_mappings(),
            mappings,
            "every mapping of the run undone"
        );
        assert_eq!(
            (after.mapped, after.mappings, after.cached),
            (before.mapped, before.mappings, before.cached)
        );
        state.book().check_invariants().unwrap();
        // The next request, with nothing injected, is served.
        let (block, _, _) = state.alloc(tenant, 20 * G, 20 * G).unwrap();
        assert_eq!(state.info(tenant, block).unwrap().mappings, 20);
        state.unregister(tenant).unwrap();
    }
    #[test]
    fn memory_created_ahead_serves_the_next_request_without_a_create() {
        use crate::pool::backend::Backend;
        let fake = Fake::new(256 * G);
        let switches = Switches {
            stitching: true,
            drain_on_oom: true,
        };
        let mut state = State::new(fake.clone(), G, None, switches, FencePolicy::Context, 64);
        let tenant = state.register("t", 64 * G, None).unwrap();
        let _first = state.alloc(tenant, 8 * G, 8 * G).unwrap();
        assert_eq!(
            state.take_created(),
            8 * G,
            "the first request created its memory"
        );
        assert_eq!(state.take_created(), 0, "and the count was reset");
        let ahead = fake.create(8 * G).unwrap();
        let id = state
            .adopt(ahead, 8 * G)
            .unwrap_or_else(|_| panic!("adopted"));
        assert!(state.book().is_cached(id));
        let creates = fake.calls(Call::Create);
        let _second = state.alloc(tenant, 8 * G, 8 * G).unwrap();
        assert_eq!(
            fake.calls(Call::Create),
            creates,
            "served from the adopted chunk"
        );
        assert_eq!(state.take_created(), 0);
        assert!(!state.book().is_cached(id));
        assert_eq!(state.stats().creates, 2);
        state.book().check_invariants().unwrap();
        // Over the budget, adopting gives the memory back (dropped: released).
        let mut capped = State::new(
            fake.clone(),
            G,
            Some(4 * G),
            switches,
            FencePolicy::Context,
            64,
        );
        assert_eq!(capped.budget_room(), 4 * G);
        let live = fake.live_chunks();
        assert!(capped.adopt(fake.create(8 * G).unwrap(), 8 * G).is_err());
        assert_eq!(fake.live_chunks(), live, "the refused chunk was released");
        state.unregister(tenant).unwrap();
    }
}
