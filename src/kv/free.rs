//! The physical granules a cache keeps for reuse, those known to hold zeros apart: a granule
//! that retired (zeroed while mapped at a released row) and was unmapped since needs no
//! zeroing before it backs a row again, so a remap behind a gate can take it as it is.

use std::sync::Arc;

use crate::vmm_core::Backend;

#[derive(Debug)]
pub(crate) struct FreeGranules<B: Backend> {
    /// Contents unknown (a plain release's, or fresh from the driver).
    dirty: Vec<Arc<B::Memory>>,
    /// Zeroed, and unmapped since.
    zeroed: Vec<Arc<B::Memory>>,
}

impl<B: Backend> Default for FreeGranules<B> {
    fn default() -> Self {
        Self {
            dirty: Vec::new(),
            zeroed: Vec::new(),
        }
    }
}

impl<B: Backend> FreeGranules<B> {
    pub fn push(&mut self, memory: Arc<B::Memory>, zeroed: bool) {
        if zeroed {
            self.zeroed.push(memory);
        } else {
            self.dirty.push(memory);
        }
    }

    /// Any granule, a dirty one first (zeroed ones are kept for where zeroing costs most).
    pub fn pop(&mut self) -> Option<Arc<B::Memory>> {
        self.dirty.pop().or_else(|| self.zeroed.pop())
    }

    /// A granule known to hold zeros.
    pub fn pop_zeroed(&mut self) -> Option<Arc<B::Memory>> {
        self.zeroed.pop()
    }

    /// A granule of unknown contents.
    pub fn pop_dirty(&mut self) -> Option<Arc<B::Memory>> {
        self.dirty.pop()
    }

    /// How many granules are known to hold zeros.
    pub fn zeroed_len(&self) -> usize {
        self.zeroed.len()
    }

    pub fn len(&self) -> usize {
        self.dirty.len() + self.zeroed.len()
    }

    pub fn clear(&mut self) {
        self.dirty.clear();
        self.zeroed.clear();
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::vmm_core::fake::Fake;

    #[test]
    fn zeroed_granules_are_kept_for_those_who_ask_for_them() {
        let fake = Fake::with_granularity(8 * 256, 256);
        let memory = |fake: &Fake| Arc::new(fake.create(256).unwrap());
        let mut free = FreeGranules::<Fake>::default();
        let (dirty, zeroed) = (memory(&fake), memory(&fake));
        free.push(zeroed.clone(), true);
        free.push(dirty.clone(), false);
        assert_eq!(free.len(), 2);
        assert!(Arc::ptr_eq(&free.pop().unwrap(), &dirty));
        assert!(free.pop_zeroed().is_some());
        assert!(free.pop_zeroed().is_none() && free.pop().is_none());
        free.push(dirty, false);
        assert!(
            free.pop_zeroed().is_none(),
            "a dirty granule is never handed out as zeroed"
        );
        assert_eq!(free.zeroed_len(), 0);
        assert!(free.pop_dirty().is_some() && free.pop_dirty().is_none());
        free.push(zeroed, true);
        assert!(free.pop_dirty().is_none(), "a zeroed granule is not dirty");
        assert_eq!(free.zeroed_len(), 1);
        free.clear();
        assert_eq!(free.len(), 0);
    }
}
