//! Accounting for physical chunks: who holds which chunk, what is cached, what the budget
//! allows. Pure bookkeeping (no driver calls), so every rule is tested on the CPU.
//!
//! A chunk is one `cuMemCreate` allocation, a multiple of the granularity. It is either *held*
//! by a tenant (mapped into one of its blocks) or *cached* (unmapped, kept for reuse). The
//! driver cannot split a physical allocation, so chunks are never split; a request is served by
//! several cached chunks laid side by side in virtual memory (stitching) plus, if those fall
//! short, one new chunk for the rest.
//!
//! ```text
//!   cached:   [64M] [64M]  [128M]          request 256M, stitching on
//!   plan:     reuse 128M + 64M + 64M, create 0    → three mappings, no cuMemCreate
//! ```

use std::collections::BTreeMap;

use bitvec::prelude::*;

/// Stitching is worth a mapping per this many bytes of a request, on average (see
/// [`mapping_cap`]).
pub const STITCH_BREAK_EVEN_BYTES: usize = 64 << 20;

/// The most cached chunks a request of `bytes` stitches while the device has room for new
/// memory: one per [`STITCH_BREAK_EVEN_BYTES`] of the request, rounded up. Taken largest first,
/// so what the cap leaves out are the smallest chunks, and the rest of the request becomes one
/// new chunk.
///
/// Why 64 MiB (driver costs measured on the H100, `shared/notes/driver-costs.md`): a stitched
/// chunk costs one mapping for its life: `cuMemMap` ~1 µs, its share of `cuMemSetAccess` (28–45
/// µs per mapping when granted one by one; 959 µs for 32 × 64 MiB) and `cuMemUnmap` 19–27 µs
/// when freed, about 57 µs in all. New memory costs `cuMemCreate` (13 µs up to 64 MiB, 39 µs
/// at 1 GiB) and, when the cache is drained, `cuMemRelease` (14 µs at 2 MiB, 55 µs at 64 MiB,
/// 506 µs at 1 GiB), plus ONE mapping whatever its size. At 64 MiB the two balance (57 µs for
/// one more mapping against 13 + 55 µs), so a chunk much smaller than that is cheaper to
/// create afresh than to map. A request stitched from thousands of 2 MiB chunks would cost
/// tens of milliseconds of mappings against well under a millisecond of new memory.
///
/// The cap is a time rule, not a memory rule: when the new memory does not fit (the driver is
/// out of memory, or the pool's budget would have to release cache to make room), the pool
/// stitches without a cap instead, so memory the cache holds is never left unused while a
/// request fails.
pub fn mapping_cap(bytes: usize) -> usize {
    bytes.div_ceil(STITCH_BREAK_EVEN_BYTES).max(1)
}

/// Names a chunk for as long as it exists. Slots are reused after a chunk is released.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct ChunkId(pub u32);

/// Names a tenant of a pool.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct TenantId(pub u32);

/// Which limit a request ran into.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum BudgetScope {
    /// The pool's global physical budget, shared by all tenants.
    Pool,
    /// One tenant's own physical limit.
    Tenant(TenantId),
}

/// A request the budget cannot admit, with the numbers that explain why.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct OverBudget {
    pub scope: BudgetScope,
    pub asked: usize,
    pub limit: usize,
    /// Bytes held (mapped) under that limit when the request came.
    pub held: usize,
}

/// How a request will be served: cached chunks to reuse, bytes of new memory to create, and
/// cached chunks to release first so the new memory fits the budget.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Plan {
    pub reuse: Vec<ChunkId>,
    pub create: usize,
    pub release_first: Vec<ChunkId>,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
struct Chunk {
    bytes: usize,
    holder: Option<TenantId>,
}

#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
struct Account {
    held: usize,
    chunks: usize,
    limit: Option<usize>,
}

/// The chunk table and the byte counts derived from it.
#[derive(Clone, Debug)]
pub struct ChunkLedger {
    granularity: usize,
    budget: Option<usize>,
    slots: Vec<Option<Chunk>>,
    /// One bit per slot: the chunk there is cached. Scanning for reusable chunks walks only
    /// these bits.
    cached: BitVec<u64, Lsb0>,
    held_bytes: usize,
    cached_bytes: usize,
    accounts: BTreeMap<TenantId, Account>,
}

impl ChunkLedger {
    pub fn new(granularity: usize, budget: Option<usize>) -> Self {
        Self {
            granularity: granularity.max(1),
            budget,
            slots: Vec::new(),
            cached: BitVec::new(),
            held_bytes: 0,
            cached_bytes: 0,
            accounts: BTreeMap::new(),
        }
    }

    pub fn granularity(&self) -> usize {
        self.granularity
    }

    pub fn budget(&self) -> Option<usize> {
        self.budget
    }

    /// `bytes` rounded up to whole granules; `None` on overflow.
    pub fn round(&self, bytes: usize) -> Option<usize> {
        bytes.checked_next_multiple_of(self.granularity)
    }

    pub fn held(&self) -> usize {
        self.held_bytes
    }

    pub fn cached(&self) -> usize {
        self.cached_bytes
    }

    /// Bytes of physical memory the pool owns: held plus cached.
    pub fn physical(&self) -> usize {
        self.held_bytes + self.cached_bytes
    }

    pub fn chunk_count(&self) -> usize {
        self.slots.iter().flatten().count()
    }

    pub fn cached_chunks(&self) -> impl Iterator<Item = (ChunkId, usize)> + '_ {
        self.cached.iter_ones().map(|slot| {
            let bytes = self.slots[slot].map_or(0, |chunk| chunk.bytes);
            (ChunkId(slot as u32), bytes)
        })
    }

    pub fn largest_cached_chunk(&self) -> usize {
        self.cached_chunks().map(|(_, b)| b).max().unwrap_or(0)
    }

    pub fn bytes_of(&self, id: ChunkId) -> Option<usize> {
        self.chunk(id).map(|chunk| chunk.bytes)
    }

    pub fn holder_of(&self, id: ChunkId) -> Option<TenantId> {
        self.chunk(id).and_then(|chunk| chunk.holder)
    }

    pub fn is_cached(&self, id: ChunkId) -> bool {
        self.cached.get(id.0 as usize).is_some_and(|bit| *bit)
    }

    /// Adds a tenant with an optional physical limit of its own. Returns false if it exists.
    pub fn open_account(&mut self, tenant: TenantId, limit: Option<usize>) -> bool {
        if self.accounts.contains_key(&tenant) {
            return false;
        }
        self.accounts.insert(
            tenant,
            Account {
                limit,
                ..Account::default()
            },
        );
        true
    }

    /// Removes a tenant that holds nothing. Returns false if it still holds chunks (or is
    /// unknown), and then changes nothing.
    pub fn close_account(&mut self, tenant: TenantId) -> bool {
        match self.accounts.get(&tenant) {
            Some(account) if account.chunks == 0 => {
                self.accounts.remove(&tenant);
                true
            }
            _ => false,
        }
    }

    /// Bytes and chunks `tenant` holds.
    pub fn held_by(&self, tenant: TenantId) -> (usize, usize) {
        self.accounts
            .get(&tenant)
            .map_or((0, 0), |account| (account.held, account.chunks))
    }

    pub fn limit_of(&self, tenant: TenantId) -> Option<usize> {
        self.accounts.get(&tenant).and_then(|account| account.limit)
    }

    /// Plans serving `bytes` (a multiple of the granularity) for `tenant`, mapping at most
    /// `room` bytes (`room >= bytes`: the address space the request may fill). Reads only:
    /// nothing changes until the caller commits the plan piece by piece.
    ///
    /// With `stitching`, cached chunks are taken largest first while they fit in what is still
    /// missing, so the fewest mappings cover the most bytes, and at most `cap` of them when a
    /// cap is given ([`mapping_cap`]); without stitching a single cached chunk is reused only if
    /// it covers the whole request (what a block cache can do). Either way, the last piece may
    /// be a cached chunk somewhat larger than what is missing, overshooting by at most an eighth
    /// of the request (and within `room` and the tenant's limit): one mapping instead of a
    /// `cuMemCreate` and a mapping, so it is taken past the cap too. Whatever is left is created
    /// as one new chunk. If the new chunk would push the pool over its budget, enough cached
    /// chunks that the plan does not use are released first (largest first, fewest calls); if
    /// even that is not enough, the request is refused as a whole.
    pub fn plan(
        &self,
        tenant: TenantId,
        bytes: usize,
        stitching: bool,
        room: usize,
        cap: Option<usize>,
    ) -> Result<Plan, OverBudget> {
        let account = self.accounts.get(&tenant).copied().unwrap_or_default();
        let mut headroom = usize::MAX;
        if let Some(limit) = account.limit {
            if account.held.saturating_add(bytes) > limit {
                return Err(OverBudget {
                    scope: BudgetScope::Tenant(tenant),
                    asked: bytes,
                    limit,
                    held: account.held,
                });
            }
            headroom = limit - account.held - bytes;
        }
        let slack = (bytes / 8).min(room.saturating_sub(bytes)).min(headroom);

        let mut cached: Vec<(ChunkId, usize)> = self.cached_chunks().collect();
        // Largest first; among equals the lowest id, so plans are deterministic.
        cached.sort_by(|a, b| b.1.cmp(&a.1).then(a.0.cmp(&b.0)));
        let mut reuse = Vec::new();
        let mut missing = bytes;
        if stitching {
            let cap = cap.unwrap_or(usize::MAX);
            for &(id, size) in &cached {
                if missing == 0 || reuse.len() >= cap {
                    break;
                }
                if size <= missing {
                    reuse.push(id);
                    missing -= size;
                }
            }
        }
        if missing > 0 {
            // The smallest unused chunk that covers the rest within the slack.
            let cover = cached.iter().rev().find(|&&(id, size)| {
                size >= missing && size - missing <= slack && !reuse.contains(&id)
            });
            if let Some(&(id, _)) = cover {
                reuse.push(id);
                missing = 0;
            }
        }

        let mut plan = Plan {
            reuse,
            create: missing,
            release_first: Vec::new(),
        };
        if let Some(budget) = self.budget {
            let after = self.physical().saturating_add(plan.create);
            if after > budget {
                let mut to_free = after - budget;
                for &(id, size) in &cached {
                    if to_free == 0 {
                        break;
                    }
                    if !plan.reuse.contains(&id) {
                        plan.release_first.push(id);
                        to_free = to_free.saturating_sub(size);
                    }
                }
                if to_free > 0 {
                    return Err(OverBudget {
                        scope: BudgetScope::Pool,
                        asked: bytes,
                        limit: budget,
                        held: self.held_bytes,
                    });
                }
            }
        }
        Ok(plan)
    }

    /// Whether creating `bytes` more fits the budget now.
    pub fn fits_budget(&self, bytes: usize) -> bool {
        self.budget
            .is_none_or(|budget| self.physical().saturating_add(bytes) <= budget)
    }

    /// Records a new chunk, held by `tenant` (or cached if `None`). Returns `None`, changing
    /// nothing, if the tenant is unknown, the size is not a positive multiple of the granularity,
    /// or the chunk would break the budget.
    pub fn insert(&mut self, bytes: usize, holder: Option<TenantId>) -> Option<ChunkId> {
        if bytes == 0 || !bytes.is_multiple_of(self.granularity) || !self.fits_budget(bytes) {
            return None;
        }
        if let Some(tenant) = holder {
            self.accounts.get(&tenant)?;
        }
        let slot = match self.slots.iter().position(Option::is_none) {
            Some(slot) => slot,
            None => {
                self.slots.push(None);
                self.cached.push(false);
                self.slots.len() - 1
            }
        };
        self.slots[slot] = Some(Chunk {
            bytes,
            holder: None,
        });
        self.cached.set(slot, true);
        self.cached_bytes += bytes;
        let id = ChunkId(slot as u32);
        if let Some(tenant) = holder {
            let taken = self.take(id, tenant);
            debug_assert!(taken);
        }
        Some(id)
    }

    /// Moves a cached chunk to `tenant`. False (nothing changes) unless it is cached and the
    /// tenant exists.
    pub fn take(&mut self, id: ChunkId, tenant: TenantId) -> bool {
        if !self.is_cached(id) || !self.accounts.contains_key(&tenant) {
            return false;
        }
        let slot = id.0 as usize;
        let Some(chunk) = self.slots[slot].as_mut() else {
            return false;
        };
        chunk.holder = Some(tenant);
        let bytes = chunk.bytes;
        self.cached.set(slot, false);
        self.cached_bytes -= bytes;
        self.held_bytes += bytes;
        if let Some(account) = self.accounts.get_mut(&tenant) {
            account.held += bytes;
            account.chunks += 1;
        }
        true
    }

    /// Moves a held chunk back to the cache. False (nothing changes) unless it is held.
    pub fn give_back(&mut self, id: ChunkId) -> bool {
        let Some(tenant) = self.holder_of(id) else {
            return false;
        };
        let slot = id.0 as usize;
        let Some(chunk) = self.slots[slot].as_mut() else {
            return false;
        };
        chunk.holder = None;
        let bytes = chunk.bytes;
        self.cached.set(slot, true);
        self.held_bytes -= bytes;
        self.cached_bytes += bytes;
        if let Some(account) = self.accounts.get_mut(&tenant) {
            account.held -= bytes;
            account.chunks -= 1;
        }
        true
    }

    /// Forgets a cached chunk (its memory was released). Returns its size; `None` (nothing
    /// changes) unless it is cached.
    pub fn remove(&mut self, id: ChunkId) -> Option<usize> {
        if !self.is_cached(id) {
            return None;
        }
        let slot = id.0 as usize;
        let chunk = self.slots[slot].take()?;
        self.cached.set(slot, false);
        self.cached_bytes -= chunk.bytes;
        Some(chunk.bytes)
    }

    /// Forgets a held chunk whose memory is leaked on purpose (the GPU might still use it, so
    /// it is never released). Returns its size; `None` (nothing changes) unless it is held.
    pub fn forget_held(&mut self, id: ChunkId) -> Option<usize> {
        let tenant = self.holder_of(id)?;
        let chunk = self.slots[id.0 as usize].take()?;
        self.held_bytes -= chunk.bytes;
        if let Some(account) = self.accounts.get_mut(&tenant) {
            account.held -= chunk.bytes;
            account.chunks -= 1;
        }
        Some(chunk.bytes)
    }

    fn chunk(&self, id: ChunkId) -> Option<&Chunk> {
        self.slots.get(id.0 as usize).and_then(Option::as_ref)
    }

    /// Checks every invariant; returns the first one broken. Used by tests after every step.
    #[cfg(test)]
    pub fn check_invariants(&self) -> Result<(), String> {
        let (mut held, mut cached) = (0usize, 0usize);
        let mut per_tenant: BTreeMap<TenantId, (usize, usize)> = BTreeMap::new();
        for (slot, chunk) in self.slots.iter().enumerate() {
            let bit = self.cached[slot];
            match chunk {
                None if bit => return Err(format!("empty slot {slot} marked cached")),
                None => {}
                Some(chunk) => {
                    if chunk.bytes == 0 || chunk.bytes % self.granularity != 0 {
                        return Err(format!("chunk {slot} has {} bytes", chunk.bytes));
                    }
                    match (chunk.holder, bit) {
                        (None, true) => cached += chunk.bytes,
                        (Some(tenant), false) => {
                            held += chunk.bytes;
                            let entry = per_tenant.entry(tenant).or_default();
                            entry.0 += chunk.bytes;
                            entry.1 += 1;
                        }
                        (holder, bit) => {
                            return Err(format!(
                                "chunk {slot}: holder {holder:?}, cached bit {bit}"
                            ))
                        }
                    }
                }
            }
        }
        if held != self.held_bytes || cached != self.cached_bytes {
            return Err(format!(
                "totals: held {held} vs {}, cached {cached} vs {}",
                self.held_bytes, self.cached_bytes
            ));
        }
        for (tenant, account) in &self.accounts {
            let (bytes, chunks) = per_tenant.remove(tenant).unwrap_or_default();
            if (bytes, chunks) != (account.held, account.chunks) {
                return Err(format!(
                    "{tenant:?}: holds {bytes} in {chunks}, account says {} in {}",
                    account.held, account.chunks
                ));
            }
            if account.limit.is_some_and(|limit| account.held > limit) {
                return Err(format!("{tenant:?} over its limit"));
            }
        }
        if let Some((tenant, _)) = per_tenant.into_iter().next() {
            return Err(format!("chunks held by unknown {tenant:?}"));
        }
        if !self.fits_budget(0) {
            return Err(format!(
                "physical {} over budget {:?}",
                self.physical(),
                self.budget
            ));
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const G: usize = 2 << 20;
    const A: TenantId = TenantId(1);
    const B: TenantId = TenantId(2);

    fn book(budget: Option<usize>) -> ChunkLedger {
        let mut book = ChunkLedger::new(G, budget);
        assert!(book.open_account(A, None));
        assert!(book.open_account(B, None));
        book
    }

    /// Caches chunks of these sizes (in granules) and returns their ids.
    fn cache(book: &mut ChunkLedger, granules: &[usize]) -> Vec<ChunkId> {
        granules
            .iter()
            .map(|&g| book.insert(g * G, None).unwrap())
            .collect()
    }

    #[test]
    fn stitching_takes_largest_fitting_chunks_first() {
        let mut book = book(None);
        let ids = cache(&mut book, &[1, 4, 2, 8, 2]);
        // 8 is too big; 4 + 2 leaves 1 missing, the second 2 overshoots, the 1 fits.
        let plan = book.plan(A, 7 * G, true, 7 * G, None).unwrap();
        assert_eq!(plan.reuse, vec![ids[1], ids[2], ids[0]]);
        assert_eq!(plan.create, 0);
        let reused: usize = plan
            .reuse
            .iter()
            .map(|&id| book.bytes_of(id).unwrap())
            .sum();
        assert_eq!(reused + plan.create, 7 * G);
        assert!(plan.release_first.is_empty());
        book.check_invariants().unwrap();
    }

    #[test]
    fn stitching_covers_exactly_and_creates_the_rest() {
        let mut book = book(None);
        let ids = cache(&mut book, &[4, 4, 4]);
        let plan = book.plan(A, 10 * G, true, 10 * G, None).unwrap();
        assert_eq!(plan.reuse, vec![ids[0], ids[1]]);
        assert_eq!(
            plan.create,
            2 * G,
            "a 4-granule chunk would overshoot the last 2"
        );
        let plan = book.plan(A, 12 * G, true, 12 * G, None).unwrap();
        assert_eq!((plan.reuse.len(), plan.create), (3, 0));
    }

    #[test]
    fn without_stitching_only_an_exact_chunk_is_reused() {
        let mut book = book(None);
        let ids = cache(&mut book, &[4, 4, 8]);
        let plan = book.plan(A, 12 * G, false, 12 * G, None).unwrap();
        assert_eq!((plan.reuse.len(), plan.create), (0, 12 * G));
        let plan = book.plan(A, 4 * G, false, 4 * G, None).unwrap();
        assert_eq!(plan.reuse.len(), 1);
        assert!(ids[..2].contains(&plan.reuse[0]));
        assert_eq!(plan.create, 0);
    }

    #[test]
    fn the_last_piece_may_overshoot_by_an_eighth_within_room() {
        let mut book = book(None);
        let ids = cache(&mut book, &[32, 32, 32, 4]);
        // 66 granules: 32 + 32, then 2 missing; the 4-granule chunk overshoots by 2 <= 66/8.
        let plan = book.plan(A, 66 * G, true, 80 * G, None).unwrap();
        assert_eq!(plan.reuse, vec![ids[0], ids[1], ids[3]]);
        assert_eq!(plan.create, 0);
        // Without room to spare the rest is created instead.
        let plan = book.plan(A, 66 * G, true, 66 * G, None).unwrap();
        assert_eq!((plan.reuse.len(), plan.create), (2, 2 * G));
        // 61 granules: 32 + 4 + 25 missing; a 32-chunk overshoots by 7 <= 61/8 = 7.6.
        let plan = book.plan(A, 61 * G, true, 128 * G, None).unwrap();
        assert_eq!((plan.reuse.len(), plan.create), (3, 0));
        // 20 granules: a 32-chunk would overshoot by 12 > 20/8; stitching takes the 4, creates 16.
        let plan = book.plan(A, 20 * G, true, 128 * G, None).unwrap();
        assert_eq!((plan.reuse, plan.create), (vec![ids[3]], 16 * G));
        // A block cache reuses one chunk that covers the whole request within the slack.
        let plan = book.plan(A, 30 * G, false, 64 * G, None).unwrap();
        assert_eq!((plan.reuse, plan.create), (vec![ids[2]], 0));
        // Never past the tenant's own limit.
        let mut limited = ChunkLedger::new(G, None);
        limited.open_account(A, Some(31 * G));
        let big = limited.insert(32 * G, None).unwrap();
        assert!(limited
            .plan(A, 30 * G, false, 64 * G, None)
            .unwrap()
            .reuse
            .is_empty());
        assert_eq!(limited.bytes_of(big), Some(32 * G));
    }

    #[test]
    fn a_cap_leaves_the_smallest_chunks_cached_and_creates_the_rest() {
        let mut book = book(None);
        let ids = cache(&mut book, &[8, 4, 2, 1, 1]);
        let full = book.plan(A, 16 * G, true, 16 * G, None).unwrap();
        assert_eq!((full.reuse.len(), full.create), (5, 0));
        let capped = book.plan(A, 16 * G, true, 16 * G, Some(2)).unwrap();
        assert_eq!((capped.reuse, capped.create), (vec![ids[0], ids[1]], 4 * G));
        assert_eq!(
            book.plan(A, 16 * G, true, 16 * G, Some(5)).unwrap(),
            full,
            "a cap the plan does not reach changes nothing"
        );
        // 9 granules with 1 to spare: the 8 under the cap of one, then the 2-granule chunk
        // covers the last one (overshoot 1 <= 9/8): one mapping instead of a create and one.
        let mut two = ChunkLedger::new(G, None);
        two.open_account(A, None);
        let (eight, pair) = (
            two.insert(8 * G, None).unwrap(),
            two.insert(2 * G, None).unwrap(),
        );
        let plan = two.plan(A, 9 * G, true, 10 * G, Some(1)).unwrap();
        assert_eq!((plan.reuse, plan.create), (vec![eight, pair], 0));
    }

    #[test]
    fn the_cap_is_one_mapping_per_64_mib_rounded_up() {
        assert_eq!(mapping_cap(0), 1);
        assert_eq!(mapping_cap(G), 1);
        assert_eq!(mapping_cap(STITCH_BREAK_EVEN_BYTES), 1);
        assert_eq!(mapping_cap(STITCH_BREAK_EVEN_BYTES + G), 2);
        assert_eq!(
            mapping_cap(2 << 30),
            32,
            "2 GiB from 32 x 64 MiB stitches whole"
        );
    }

    #[test]
    fn budget_releases_unused_cache_before_refusing() {
        let mut book = book(Some(16 * G));
        let ids = cache(&mut book, &[2, 4, 6]);
        let held = book.insert(4 * G, Some(A)).unwrap();
        assert_eq!(book.physical(), 16 * G);
        // 3 granules: no cached chunk fits without stitching, so 3 new; 3 over budget, so the
        // largest unused cached chunk (6) is released first.
        let plan = book.plan(A, 3 * G, false, 3 * G, None).unwrap();
        assert_eq!(plan.create, 3 * G);
        assert_eq!(plan.release_first, vec![ids[2]]);
        // 13 granules cannot fit: 4 are held, and 13 + 4 > 16.
        let refused = book.plan(B, 13 * G, false, 13 * G, None).unwrap_err();
        assert_eq!(
            refused,
            OverBudget {
                scope: BudgetScope::Pool,
                asked: 13 * G,
                limit: 16 * G,
                held: 4 * G
            }
        );
        // Stitching serves 12 from the cache without creating anything.
        let plan = book.plan(B, 12 * G, true, 12 * G, None).unwrap();
        assert_eq!((plan.create, plan.release_first.len()), (0, 0));
        assert!(book.give_back(held));
        book.check_invariants().unwrap();
    }

    #[test]
    fn tenant_limit_is_checked_before_anything_else() {
        let mut book = ChunkLedger::new(G, None);
        assert!(book.open_account(A, Some(4 * G)));
        assert!(!book.open_account(A, None), "already open");
        book.insert(3 * G, Some(A)).unwrap();
        let refused = book.plan(A, 2 * G, true, 2 * G, None).unwrap_err();
        assert_eq!(refused.scope, BudgetScope::Tenant(A));
        assert_eq!(
            (refused.asked, refused.limit, refused.held),
            (2 * G, 4 * G, 3 * G)
        );
        assert!(book.plan(A, G, true, G, None).is_ok());
    }

    #[test]
    fn chunks_move_between_states_only_along_allowed_edges() {
        let mut book = book(None);
        let id = book.insert(2 * G, None).unwrap();
        assert!(!book.give_back(id), "cached, not held");
        assert!(book.take(id, A));
        assert!(!book.take(id, B), "already held");
        assert_eq!(book.remove(id), None, "held chunks cannot be forgotten");
        assert!(!book.close_account(A), "A holds a chunk");
        assert_eq!(book.held_by(A), (2 * G, 1));
        assert!(book.give_back(id));
        assert_eq!(book.remove(id), Some(2 * G));
        assert_eq!(book.remove(id), None);
        assert!(book.close_account(A));
        assert_eq!(book.insert(G + 1, None), None, "not a granule multiple");
        assert_eq!(book.insert(G, Some(TenantId(9))), None, "unknown tenant");
        assert_eq!(book.physical(), 0);
        book.check_invariants().unwrap();
    }
}
