//! Prefix sharing and copy-on-write. Sharing is granule-aligned: the granules wholly inside the
//! prefix are the same physical memory in both rows (mapped twice); the granule holding the
//! prefix's tail, the first where the sequences diverge, is copied at once, its bytes past the
//! prefix zeroed. A later write into a granule still shared copies it first
//! ([`KvState::write_guard`]), so every row reads what an unshared cache would, bit for bit.

use std::ops::Range;

use super::state::KvState;
use crate::error::{KvError, Result};
use crate::vmm_core::{Backend, Waiter};

impl<B: Backend> KvState<B> {
    /// Makes the first `tokens` tokens of `from` the first tokens of the empty slot `to`.
    pub fn share_prefix(&mut self, from: usize, to: usize, tokens: usize) -> Result<()> {
        self.check_seq(from)?;
        self.check_seq(to)?;
        self.check_awake()?;
        let length = self.lengths[from];
        if from == to || tokens > length {
            return Err(KvError::BadPrefix {
                from,
                to,
                tokens,
                length,
            }
            .into());
        }
        if self.lengths[to] != 0 || self.backed[to] != 0 {
            return Err(KvError::NotEmpty {
                seq: to,
                length: self.lengths[to],
            }
            .into());
        }
        if tokens == 0 {
            return Ok(());
        }
        self.repair()?;
        let granule = self.geometry.granule;
        let prefix_bytes = tokens * self.geometry.token_bytes;
        let (whole, tail) = (prefix_bytes / granule, prefix_bytes % granule);
        let buffers = self.geometry.buffers;
        let mut fresh = if tail > 0 {
            self.take_granules(buffers)?
        } else {
            Vec::new()
        };
        let fenced = self
            .fence
            .wait()
            .and_then(|()| self.settle_retiring(&self.table.retiring()));
        if let Err(error) = fenced {
            for granule in fresh {
                self.recycle(granule);
            }
            return Err(error);
        }
        let mut changes = Vec::new();
        let mut copies = Vec::new();
        for buffer in 0..buffers {
            for g in 0..whole {
                let source = self.geometry.slot(buffer, from, g);
                let data = self.table.slots[source].data.clone();
                changes.push((self.geometry.slot(buffer, to, g), data));
            }
            if tail > 0 {
                let (source, target) = (
                    self.geometry.slot(buffer, from, whole),
                    self.geometry.slot(buffer, to, whole),
                );
                changes.push((target, fresh.pop()));
                copies.push((source, target));
            }
        }
        let undo = self.apply(changes)?;
        let copied = copies.iter().try_for_each(|&(source, target)| {
            let (source, target) = (self.slot_address(source), self.slot_address(target));
            self.backend.copy_device(&self.lane, source, target, tail)?;
            self.backend
                .fill_zero(&self.lane, target + tail as u64, granule - tail)
        });
        if let Err(error) = copied.and_then(|()| self.backend.synchronize(&self.lane)) {
            self.undo_fresh(undo);
            return Err(error);
        }
        self.backed[to] = whole + usize::from(tail > 0);
        self.lengths[to] = tokens;
        Ok(())
    }

    /// Checks that `tokens` of `seq` may be written (they lie inside its length) and gives every
    /// granule they touch that other rows still share a private copy first. After it returns
    /// `Ok`, writing those tokens (in any layer, K or V) changes no other sequence.
    pub fn write_guard(&mut self, seq: usize, tokens: Range<usize>) -> Result<()> {
        self.check_seq(seq)?;
        self.check_awake()?;
        let length = self.lengths[seq];
        if tokens.end > length || tokens.start > tokens.end {
            return Err(KvError::WritePastLength {
                seq,
                first: tokens.start,
                end: tokens.end,
                length,
            }
            .into());
        }
        if tokens.is_empty() {
            return Ok(());
        }
        self.repair()?;
        let (token_bytes, granule) = (self.geometry.token_bytes, self.geometry.granule);
        let first = tokens.start * token_bytes / granule;
        let end = (tokens.end * token_bytes).div_ceil(granule);
        let mut shared = Vec::new();
        for buffer in 0..self.geometry.buffers {
            for g in first..end {
                let slot = self.geometry.slot(buffer, seq, g);
                if self.table.owners(slot) > 1 {
                    let source = self.table.other_owner(slot).expect("shared by another row");
                    shared.push((source, slot));
                }
            }
        }
        if shared.is_empty() {
            return Ok(());
        }
        let mut fresh = self.take_granules(shared.len())?;
        if let Err(error) = self.fence.wait() {
            for granule in fresh {
                self.recycle(granule);
            }
            return Err(error);
        }
        let changes = shared
            .iter()
            .map(|&(_, slot)| (slot, fresh.pop()))
            .collect();
        let undo = self.apply(changes)?;
        let copied = shared.iter().try_for_each(|&(source, target)| {
            let (source, target) = (self.slot_address(source), self.slot_address(target));
            self.backend
                .copy_device(&self.lane, source, target, granule)
        });
        if let Err(error) = copied.and_then(|()| self.backend.synchronize(&self.lane)) {
            self.undo_fresh(undo);
            return Err(error);
        }
        Ok(())
    }
}
