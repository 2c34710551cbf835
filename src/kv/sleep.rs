//! Sleep and wake of the whole cache: every distinct data granule saved once (a shared prefix
//! granule is one copy), all physical memory released, and the zero granule mapped everywhere,
//! so a graph replayed while the cache sleeps reads zeros and never faults. Wake maps fresh
//! granules where the saved ones were, sharing restored, and copies the bytes back.

use super::state::{KvState, Sleeping};
use crate::error::Result;
use crate::host::HostStorage;
use crate::vmm_core::{Backend, Waiter};

impl<B: Backend> KvState<B> {
    /// Saves every distinct granule to `storage` and releases all physical memory but the zero
    /// granule and the lengths. Lengths are kept. Sleeping twice is a no-op.
    pub fn sleep(&mut self, storage: &HostStorage) -> Result<usize> {
        if self.sleeping.is_some() {
            return Ok(0);
        }
        self.repair()?;
        self.fence.wait()?;
        self.settle_retiring(&self.table.retiring())?;
        let distinct = self.table.distinct();
        let groups: Vec<Vec<usize>> = distinct.iter().map(|(slots, _)| slots.clone()).collect();
        drop(distinct);
        let pieces = self.pieces(&groups);
        let copy = self.backend.save(storage, &self.lane, &pieces)?;
        let changes = groups.iter().flatten().map(|&slot| (slot, None)).collect();
        self.apply(changes)?; // the granules drop with the returned list
        self.free.clear();
        self.sleeping = Some(Sleeping { copy, groups });
        Ok(pieces.len() * self.geometry.granule)
    }

    /// Backs every saved granule again and copies its bytes back. Waking an awake cache is a
    /// no-op.
    pub fn wake(&mut self) -> Result<usize> {
        let Some(sleeping) = self.sleeping.take() else {
            return Ok(0);
        };
        let result = self.wake_from(&sleeping);
        if result.is_err() {
            self.sleeping = Some(sleeping);
        }
        result
    }

    fn wake_from(&mut self, sleeping: &Sleeping<B>) -> Result<usize> {
        self.repair()?;
        let granules = match self.take_granules(sleeping.groups.len()) {
            Ok(granules) => granules,
            Err(error) => {
                self.free.clear();
                return Err(error);
            }
        };
        self.fence.wait()?;
        let mut changes = Vec::new();
        for (slots, granule) in sleeping.groups.iter().zip(&granules) {
            for &slot in slots {
                changes.push((slot, Some(granule.clone())));
            }
        }
        drop(granules);
        let undo = self.apply(changes)?;
        let pieces = self.pieces(&sleeping.groups);
        if let Err(error) = self.backend.load(&sleeping.copy, &self.lane, &pieces) {
            self.undo_fresh(undo);
            self.free.clear();
            return Err(error);
        }
        Ok(pieces.len() * self.geometry.granule)
    }
}
