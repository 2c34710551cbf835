//! Who must hear that other physical memory now lies under some of a space's addresses.
//!
//! Libraries that record the *pages* behind an address range, not just the addresses, go stale
//! when a bind or a wake maps other memory there: NCCL's `ncclCommRegister` is one (it retains
//! the allocation handle mapped at registration time). They register a [`RemapListener`] for
//! the part of the space they cover, and the bind layer calls it right after the new memory is
//! mapped and accessible, under the space's lock, so no replay or bind runs in between.

use std::sync::{Mutex, Weak};

/// A part of a space whose memory can change under its addresses.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Part {
    /// A group (its index in the placement): each bind maps a dataset's memory there.
    Group(usize),
    /// The scratch region: a wake maps new memory there.
    Scratch,
}

/// Told after other memory was mapped under a part of a space. A failure is the listener's to
/// record: the remap itself already happened and stays.
pub(crate) trait RemapListener: Send + Sync + std::fmt::Debug {
    fn remapped(&self);
}

/// The listeners of one space. Dead ones (their owner dropped them) are pruned as they are met.
#[derive(Debug, Default)]
pub(crate) struct Listeners {
    entries: Mutex<Vec<(Part, Weak<dyn RemapListener>)>>,
}

impl Listeners {
    pub(crate) fn add(&self, part: Part, listener: Weak<dyn RemapListener>) {
        self.lock().push((part, listener));
    }

    /// Calls every live listener of `part`.
    pub(crate) fn notify(&self, part: Part) {
        // Upgraded outside the call, so a listener may add or drop listeners while it runs.
        let live: Vec<_> = {
            let mut entries = self.lock();
            entries.retain(|(_, l)| l.strong_count() > 0);
            entries
                .iter()
                .filter(|(p, _)| *p == part)
                .filter_map(|(_, l)| l.upgrade())
                .collect()
        };
        for listener in live {
            listener.remapped();
        }
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, Vec<(Part, Weak<dyn RemapListener>)>> {
        self.entries.lock().unwrap_or_else(|p| p.into_inner())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::atomic::{AtomicUsize, Ordering};
    use std::sync::Arc;

    #[derive(Debug, Default)]
    struct Count(AtomicUsize);

    impl RemapListener for Count {
        fn remapped(&self) {
            self.0.fetch_add(1, Ordering::SeqCst);
        }
    }

    #[test]
    fn only_the_listeners_of_the_remapped_part_hear_it_and_dropped_ones_never() {
        let listeners = Listeners::default();
        let (group0, scratch, dropped) = (
            Arc::new(Count::default()),
            Arc::new(Count::default()),
            Arc::new(Count::default()),
        );
        let weak = |c: &Arc<Count>| Arc::downgrade(c) as Weak<dyn RemapListener>;
        listeners.add(Part::Group(0), weak(&group0));
        listeners.add(Part::Scratch, weak(&scratch));
        listeners.add(Part::Group(0), weak(&dropped));
        drop(dropped);
        listeners.notify(Part::Group(0));
        listeners.notify(Part::Group(1));
        assert_eq!(group0.0.load(Ordering::SeqCst), 1);
        assert_eq!(scratch.0.load(Ordering::SeqCst), 0);
        listeners.notify(Part::Scratch);
        assert_eq!(scratch.0.load(Ordering::SeqCst), 1);
        assert_eq!(listeners.lock().len(), 2, "the dropped listener was pruned");
    }
}
