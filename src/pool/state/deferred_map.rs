//! Blocks whose memory is held but not mapped yet.
//!
//! A copy-elision layer learns only at the *next* call what a fresh allocation is for. In the
//! resize idiom (`b = malloc(3 GiB)`, copy `a` into `b`, `free(a)`), `a`'s memory ends up
//! under `b`'s first bytes: mapping `b` whole at its malloc, then unmapping its first part at
//! the graft, costs a map, a set-access and an unmap of memory nobody reads.
//! [`State::alloc_held`] acquires the memory at the allocation (so a refusal is reported
//! there, as `cudaMalloc` would) and maps nothing; the first use maps it
//! ([`State::map_held`]), or a graft puts the donor's memory in front and maps only the rest
//! ([`State::graft_onto_held`]):
//!
//! ```text
//!   alloc_held(3 GiB)     b: [ held: 3 GiB, unmapped          ]   a: [ A mapped ]
//!   graft(b <- a)         b: [ A mapped  | T mapped (cache)   ]   a: freed
//!                         the held 3 GiB go back to the cache
//! ```

use super::State;
use crate::error::{Error, LayoutError, PoolError, Result};
use crate::pool::backend::{Backend, MappedRange};
use crate::pool::events::BlockId;
use crate::pool::ledger::{ChunkId, TenantId};

impl<B: Backend> State<B> {
    /// Carves a block for `len` bytes and acquires its memory (cache first), mapping nothing:
    /// the block's length is 0 until [`State::map_held`] or a graft onto it.
    pub(crate) fn alloc_held(
        &mut self,
        tenant: TenantId,
        len: usize,
    ) -> Result<(BlockId, u64, usize)> {
        let (block, address, capacity) = self.alloc(tenant, 0, len)?;
        let needed = self.book.round(len).expect("carved above");
        match self.acquire(tenant, needed, capacity) {
            Ok(chunks) => {
                let state = self.tenants.get_mut(&tenant).expect("carved above");
                let block_state = state.blocks.get_mut(&block).expect("carved above");
                block_state.held = chunks;
                block_state.held_len = len;
                Ok((block, address, capacity))
            }
            Err(error) => {
                // Nothing is mapped: freeing only gives the addresses back.
                let freed = self.free(tenant, block);
                debug_assert!(freed.is_ok());
                Err(error)
            }
        }
    }

    /// Maps what the block holds unmapped (one run, one set-access) and gives it its length.
    /// Nothing to do for a block that holds nothing unmapped. On a driver error the chunks go
    /// back to the cache and the block stays empty.
    pub(crate) fn map_held(&mut self, tenant: TenantId, block: BlockId) -> Result<()> {
        let state = self.tenant_mut(tenant)?;
        let Some(block_state) = state.blocks.get_mut(&block) else {
            return Err(Error::Pool(PoolError::TenantGone {
                tenant: state.name.to_string(),
            }));
        };
        if block_state.held.is_empty() {
            return Ok(());
        }
        let held = std::mem::take(&mut block_state.held);
        let len = std::mem::take(&mut block_state.held_len);
        self.map_chunks(tenant, block, &held)?;
        self.set_len(tenant, block, len, true);
        Ok(())
    }

    /// Whether the block holds memory it has not mapped yet.
    pub(super) fn holds_unmapped(&self, tenant: TenantId, block: BlockId) -> bool {
        self.block(tenant, block)
            .is_ok_and(|block_state| !block_state.held.is_empty())
    }

    /// [`State::graft`] onto a block that holds its memory unmapped: the donor's chunks are
    /// mapped at the start, the rest of the block's length is backed from the cache (or one new
    /// chunk), and only then is the held memory given back to the cache. All or nothing: on an
    /// error the target still holds its memory unmapped and the donor is as it was.
    pub(super) fn graft_onto_held(
        &mut self,
        tenant: TenantId,
        target: BlockId,
        donor: BlockId,
    ) -> Result<()> {
        let target_info = self.info(tenant, target)?;
        let donor_info = self.info(tenant, donor)?;
        let target_len = self.block(tenant, target)?.held_len;
        let moved = donor_info.mapped;
        if donor_info.len > target_len || moved > target_info.capacity {
            return Err(Error::Layout(LayoutError::InvalidShape(format!(
                "graft of a {}-byte block ({moved} mapped) onto a {target_len}-byte block ({} \
                 reserved)",
                donor_info.len, target_info.capacity
            ))));
        }
        let tail_bytes = self
            .book
            .round(target_len)
            .expect("carved")
            .saturating_sub(moved);
        // The tail's memory first, while the target still holds its own: a refusal changes
        // nothing, and the caller can map the held memory and copy instead.
        let (tail, donor_segments) =
            self.begin_graft(tenant, donor, tail_bytes, target_info.capacity - moved)?;
        let donor_chunks: Vec<ChunkId> = donor_segments.iter().map(|s| s.chunk).collect();
        let unmapped: Vec<(ChunkId, u64, usize)> = donor_segments
            .iter()
            .map(|s| (s.chunk, s.mapping.ptr(), s.mapping.bytes()))
            .collect();
        drop(donor_segments); // unmaps, after the fence
                              // On an error the target still holds its memory: nothing of it was
                              // removed.
        let (front, back) =
            self.map_graft(tenant, [target, donor], &donor_chunks, moved, &tail, &[])?;
        for (chunk, at, bytes) in unmapped {
            self.log_unmap(tenant, donor, chunk, at, bytes);
        }
        let block_state = self
            .tenants
            .get_mut(&tenant)
            .and_then(|t| t.blocks.get_mut(&target))
            .expect("checked above");
        let held = std::mem::take(&mut block_state.held);
        block_state.held_len = 0;
        self.give_back_all(&held);
        self.commit_segments(tenant, target, front, |_| false);
        self.commit_segments(tenant, target, back, |id| {
            tail.iter().any(|&(c, reused)| c == id && reused)
        });
        self.set_len(tenant, target, target_len, true);
        // The donor is empty now: free its addresses.
        self.free(tenant, donor)
    }
}
