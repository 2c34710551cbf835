//! Segments: chunks mapped side by side into a block, unmapped back into the cache, and moved
//! from one block to another (grafting).

use super::{Segment, State};
use crate::error::{Error, LayoutError, Result};
use crate::pool::backend::{Backend, MappedRange, Waiter};
use crate::pool::events::{BlockId, EventKind};
use crate::pool::ledger::{ChunkId, TenantId};

/// The segments a graft maps: the donor's in front, the rest behind.
pub(super) type GraftRuns<B> = (Vec<Segment<B>>, Vec<Segment<B>>);
/// What [`State::begin_graft`] leaves a graft: the new backing it acquired, and the donor's
/// segments taken out of its block.
pub(super) type GraftStart<B> = (Vec<(ChunkId, bool)>, Vec<Segment<B>>);

impl<B: Backend> State<B> {
    /// Maps `chunks` side by side into `block` from `offset` bytes on, with one set-access for
    /// the whole run. Commits nothing: on failure nothing stays mapped and the error is returned.
    pub(super) fn map_run(
        &self,
        tenant: TenantId,
        block: BlockId,
        offset: usize,
        chunks: &[ChunkId],
    ) -> Result<Vec<Segment<B>>> {
        if chunks.is_empty() {
            return Ok(Vec::new());
        }
        let granularity = self.book.granularity();
        let state = self.tenants.get(&tenant).expect("checked by the caller");
        let block_state = state.blocks.get(&block).expect("checked by the caller");
        let block_offset = block_state.first_granule * granularity;
        let memory: Vec<_> = chunks.iter().map(|id| self.memory[id].clone()).collect();
        let mappings = self
            .backend
            .map_run(&state.reservation, block_offset + offset, &memory)?;
        let mut at = offset;
        Ok(chunks
            .iter()
            .zip(mappings)
            .map(|(&chunk, mapping)| {
                let segment: Segment<B> = Segment {
                    chunk,
                    offset: at,
                    mapping,
                };
                at += segment.mapping.bytes();
                segment
            })
            .collect())
    }

    /// Adds mapped segments to `block` (keeping them in offset order) and logs them.
    pub(super) fn commit_segments(
        &mut self,
        tenant: TenantId,
        block: BlockId,
        made: Vec<Segment<B>>,
        reused: impl Fn(ChunkId) -> bool,
    ) {
        let logged: Vec<(ChunkId, u64, usize)> = made
            .iter()
            .map(|s| (s.chunk, s.mapping.ptr(), s.mapping.bytes()))
            .collect();
        let state = self
            .tenants
            .get_mut(&tenant)
            .expect("checked by the caller");
        let segments = &mut state
            .blocks
            .get_mut(&block)
            .expect("checked by the caller")
            .segments;
        segments.extend(made);
        segments.sort_by_key(|s| s.offset);
        let (tenant_mapped, _) = self.book.held_by(tenant);
        state.peak_mapped = state.peak_mapped.max(tenant_mapped);
        self.counters.peak_mapped = self.counters.peak_mapped.max(self.book.held());
        for (chunk, address, bytes) in logged {
            let kind = EventKind::Map {
                chunk,
                block,
                reused: reused(chunk),
            };
            self.log(kind, Some(tenant), address, bytes);
        }
    }

    /// Maps `chunks` one after another from the block's current mapped end. All or nothing.
    pub(super) fn map_chunks(
        &mut self,
        tenant: TenantId,
        block: BlockId,
        chunks: &[(ChunkId, bool)],
    ) -> Result<()> {
        let end = self.block(tenant, block)?.mapped();
        let ids: Vec<ChunkId> = chunks.iter().map(|&(id, _)| id).collect();
        match self.map_run(tenant, block, end, &ids) {
            Ok(made) => {
                self.commit_segments(tenant, block, made, |id| {
                    chunks.iter().any(|&(c, reused)| c == id && reused)
                });
                Ok(())
            }
            Err(error) => {
                self.give_back_all(chunks);
                Err(self.refuse(tenant, error))
            }
        }
    }

    /// Unmaps segments (the fence was waited for, unless `fenced` is false: then they are
    /// leaked) and returns their chunks to the cache.
    pub(super) fn drop_segments(
        &mut self,
        tenant: TenantId,
        block: BlockId,
        segments: Vec<Segment<B>>,
        fenced: bool,
    ) {
        for mut segment in segments {
            let (address, bytes) = (segment.mapping.ptr(), segment.mapping.bytes());
            if fenced {
                drop(segment.mapping);
                let given = self.book.give_back(segment.chunk);
                debug_assert!(given);
                self.log_unmap(tenant, block, segment.chunk, address, bytes);
            } else {
                segment.mapping.leak_on_drop();
                drop(segment.mapping);
                self.book.forget_held(segment.chunk);
                // The leaked mapping keeps its own count of the memory forever.
                self.memory.remove(&segment.chunk);
            }
        }
    }

    pub(super) fn log_unmap(
        &mut self,
        tenant: TenantId,
        block: BlockId,
        chunk: ChunkId,
        at: u64,
        bytes: usize,
    ) {
        self.log(EventKind::Unmap { chunk, block }, Some(tenant), at, bytes);
    }

    /// Moves `donor`'s chunks under the start of `target` without copying: `target`'s chunks
    /// that overlap `[0, donor's mapped bytes)` go to the cache, the donor's chunks are mapped
    /// there in order, and the part of the removed chunks' range they do not cover is backed
    /// again (cache first). The donor block is freed. All or nothing.
    pub(crate) fn graft(
        &mut self,
        tenant: TenantId,
        target: BlockId,
        donor: BlockId,
    ) -> Result<()> {
        if target == donor {
            return Err(Error::Layout(LayoutError::InvalidShape(
                "a block cannot be grafted onto itself".into(),
            )));
        }
        if self.holds_unmapped(tenant, target) {
            return self.graft_onto_held(tenant, target, donor);
        }
        let target_info = self.info(tenant, target)?;
        let donor_info = self.info(tenant, donor)?;
        if donor_info.len > target_info.len || donor_info.mapped > target_info.capacity {
            return Err(Error::Layout(LayoutError::InvalidShape(format!(
                "graft of a {}-byte block ({} mapped) onto a {}-byte block ({} reserved)",
                donor_info.len, donor_info.mapped, target_info.len, target_info.capacity
            ))));
        }
        let moved = donor_info.mapped;
        let target_segments = &self.block(tenant, target)?.segments;
        let cut = target_segments
            .iter()
            .position(|s| s.offset >= moved)
            .unwrap_or(target_segments.len());
        let removed_end = target_segments[..cut]
            .last()
            .map_or(0, |s| s.offset + s.mapping.bytes());
        let filler_bytes = removed_end.saturating_sub(moved);
        // New backing for the gap first, so a refusal changes nothing; then unmap the donor's
        // segments and the target's covered ones (their chunks stay held).
        let (filler, donor_segments) =
            self.begin_graft(tenant, donor, filler_bytes, filler_bytes)?;
        let target_block = self
            .tenants
            .get_mut(&tenant)
            .and_then(|t| t.blocks.get_mut(&target))
            .expect("checked above");
        let removed: Vec<Segment<B>> = target_block.segments.drain(..cut).collect();
        let donor_chunks: Vec<ChunkId> = donor_segments.iter().map(|s| s.chunk).collect();
        let removed_chunks: Vec<(ChunkId, usize)> =
            removed.iter().map(|s| (s.chunk, s.offset)).collect();
        let unmapped: Vec<(BlockId, ChunkId, u64, usize)> = donor_segments
            .iter()
            .map(|s| (donor, s.chunk, s.mapping.ptr(), s.mapping.bytes()))
            .chain(
                removed
                    .iter()
                    .map(|s| (target, s.chunk, s.mapping.ptr(), s.mapping.bytes())),
            )
            .collect();
        drop(donor_segments); // unmaps, after the fence
        drop(removed);
        let (front, back) = self.map_graft(
            tenant,
            [target, donor],
            &donor_chunks,
            moved,
            &filler,
            &removed_chunks,
        )?;
        for (block, chunk, at, bytes) in unmapped {
            self.log_unmap(tenant, block, chunk, at, bytes);
        }
        for (chunk, _) in removed_chunks {
            let given = self.book.give_back(chunk);
            debug_assert!(given);
        }
        self.commit_segments(tenant, target, front, |_| false);
        self.commit_segments(tenant, target, back, |id| {
            filler.iter().any(|&(c, reused)| c == id && reused)
        });
        // The donor is empty now: free its addresses.
        self.free(tenant, donor)
    }

    /// The start of every graft, once its checks passed: refused during a capture; waits for
    /// the GPU (both blocks may be in use, and nothing may move under it); acquires `bytes` of
    /// new backing (`room` the most a stitched plan may take) while nothing has changed, so a
    /// refusal changes nothing; then takes the donor's segments out of its block. Dropping
    /// them unmaps them (after the wait); their chunks stay held.
    pub(super) fn begin_graft(
        &mut self,
        tenant: TenantId,
        donor: BlockId,
        bytes: usize,
        room: usize,
    ) -> Result<GraftStart<B>> {
        let tenant_state = self.tenant(tenant)?;
        tenant_state.fence.check_not_capturing()?;
        tenant_state.fence.wait()?;
        let backing = if bytes > 0 {
            self.acquire(tenant, bytes, room)?
        } else {
            Vec::new()
        };
        let donor_block = self
            .tenants
            .get_mut(&tenant)
            .and_then(|t| t.blocks.get_mut(&donor))
            .expect("checked by the caller");
        Ok((backing, std::mem::take(&mut donor_block.segments)))
    }

    /// The mapping step of a graft, once the donor's and the target's replaced segments are
    /// unmapped: `donor_chunks` at the target's start, `back` from `moved` on. On an error the
    /// runs mapped so far drop (which unmaps them), `back` goes to the cache, the target's
    /// `removed` chunks and the donor's go back where they were, and the refusal is returned.
    pub(super) fn map_graft(
        &mut self,
        tenant: TenantId,
        [target, donor]: [BlockId; 2],
        donor_chunks: &[ChunkId],
        moved: usize,
        back: &[(ChunkId, bool)],
        removed: &[(ChunkId, usize)],
    ) -> Result<GraftRuns<B>> {
        let back_ids: Vec<ChunkId> = back.iter().map(|&(id, _)| id).collect();
        let mapped = self
            .map_run(tenant, target, 0, donor_chunks)
            .and_then(|front| {
                let behind = self.map_run(tenant, target, moved, &back_ids)?;
                Ok((front, behind))
            });
        mapped.map_err(|error| {
            self.give_back_all(back);
            self.undo_graft(tenant, target, donor, removed, donor_chunks);
            self.refuse(tenant, error)
        })
    }

    /// Maps the pieces of an interrupted graft back where they were. Best effort: what cannot
    /// be mapped back goes to the cache, and the block's length shrinks to what is mapped.
    pub(super) fn undo_graft(
        &mut self,
        tenant: TenantId,
        target: BlockId,
        donor: BlockId,
        removed: &[(ChunkId, usize)],
        donor_chunks: &[ChunkId],
    ) {
        let removed_ids: Vec<ChunkId> = removed.iter().map(|&(id, _)| id).collect();
        let first = removed.first().map_or(0, |&(_, offset)| offset);
        let back = [
            (target, first, removed_ids.as_slice()),
            (donor, 0, donor_chunks),
        ];
        for (block, offset, chunks) in back {
            match self.map_run(tenant, block, offset, chunks) {
                Ok(made) => self.commit_segments(tenant, block, made, |_| false),
                Err(error) => {
                    tracing::error!(%error, "could not map a block's chunks back after a failed graft");
                    for &chunk in chunks {
                        self.book.give_back(chunk);
                    }
                    let mapped = self.block(tenant, block).map_or(0, |b| b.mapped());
                    if let Some(state) = self
                        .tenants
                        .get_mut(&tenant)
                        .and_then(|t| t.blocks.get_mut(&block))
                    {
                        state.len = state.len.min(mapped);
                    }
                }
            }
        }
    }
}
