//! Blocks: carving addresses, growing and shrinking in place, freeing.

use super::{BlockInfo, BlockState, State};
use crate::error::{Error, LayoutError, PoolError, Result};
use crate::pool::backend::{Backend, ReservedRange, Waiter};
use crate::pool::events::{BlockId, EventKind};
use crate::pool::ledger::TenantId;

impl<B: Backend> State<B> {
    /// Carves `capacity` bytes of the tenant's addresses into a block and maps `len` of them.
    ///
    /// A block that cannot grow (`capacity` is `len` rounded up) is carved an eighth larger where
    /// the tenant has the room, so the planner may finish it with a cached chunk slightly bigger
    /// than what is missing instead of creating memory; the unused spare addresses are handed
    /// back right after.
    pub(crate) fn alloc(
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
                return Err(Error::Layout(LayoutError::InvalidShape(format!(
                    "a block of {len} bytes with capacity {capacity}"
                ))))
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
            let error = Error::Pool(PoolError::VirtualCapacity {
                tenant: state.name.to_string(),
                asked: capacity,
                capacity: state.reservation.bytes(),
                largest_free_run: state.granules.largest_free_run() * granularity,
            });
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
                held: Vec::new(),
                held_len: 0,
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

    pub(crate) fn info(&self, tenant: TenantId, block: BlockId) -> Result<BlockInfo> {
        let granularity = self.book.granularity();
        let state = self.tenant(tenant)?;
        let block_state = self.block(tenant, block)?;
        Ok(BlockInfo {
            address: state.reservation.base() + (block_state.first_granule * granularity) as u64,
            len: block_state.len,
            capacity: block_state.capacity,
            mapped: block_state.mapped(),
            mappings: block_state.segments.len(),
            held: block_state
                .held
                .iter()
                .map(|&(id, _)| self.book.bytes_of(id).unwrap_or(0))
                .sum(),
        })
    }

    /// Maps more memory behind the block so it holds `new_len` bytes; nothing moves.
    pub(crate) fn grow(&mut self, tenant: TenantId, block: BlockId, new_len: usize) -> Result<()> {
        self.tenant(tenant)?.fence.check_not_capturing()?;
        // What the block holds unmapped comes first: it is where its first bytes live.
        self.map_held(tenant, block)?;
        let info = self.info(tenant, block)?;
        if new_len < info.len {
            return Err(Error::Layout(LayoutError::InvalidShape(format!(
                "grow to {new_len} bytes, below the current {}",
                info.len
            ))));
        }
        if new_len > info.capacity {
            return Err(self.refuse(
                tenant,
                Error::Pool(PoolError::BeyondCapacity {
                    asked: new_len,
                    capacity: info.capacity,
                }),
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
    pub(crate) fn shrink(
        &mut self,
        tenant: TenantId,
        block: BlockId,
        new_len: usize,
    ) -> Result<()> {
        let info = self.info(tenant, block)?;
        if new_len > info.len {
            return Err(Error::Layout(LayoutError::InvalidShape(format!(
                "shrink to {new_len} bytes, above the current {}",
                info.len
            ))));
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

    pub(super) fn set_len(&mut self, tenant: TenantId, block: BlockId, len: usize, grew: bool) {
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
    pub(crate) fn free(&mut self, tenant: TenantId, block: BlockId) -> Result<()> {
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
        // Never mapped, so nothing can use it: back to the cache whatever the fence said.
        self.give_back_all(&block_state.held);
        self.log(
            EventKind::Free { block },
            Some(tenant),
            info.address,
            info.capacity,
        );
        fenced
    }
}
