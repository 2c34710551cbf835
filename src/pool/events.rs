//! What a pool did to the address space, in order: the data behind the timeline picture.

use std::collections::VecDeque;
use std::sync::Arc;
use std::time::Duration;

use super::ledger::{ChunkId, TenantId};

/// Names a block (an allocation) of a pool.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct BlockId(pub u64);

/// One thing a pool (or a region) did. Not `#[non_exhaustive]`: other logs (the preload
/// layer's allocation monitor) build events to draw with the same timeline.
#[derive(Clone, Debug, PartialEq)]
pub struct Event {
    /// Time since the pool was created.
    pub at: Duration,
    /// What happened.
    pub kind: EventKind,
    /// The tenant it happened to; `None` for pool-wide events (a drain the caller asked for).
    pub tenant: Option<TenantId>,
    /// Device address the event concerns (0 when it concerns none, as for a release).
    pub address: u64,
    /// Bytes the event concerns; each kind says which.
    pub bytes: usize,
}

/// What an [`Event`] records. `address` and `bytes` are the event's fields.
#[derive(Clone, Debug, PartialEq)]
#[non_exhaustive]
pub enum EventKind {
    /// A tenant reserved `bytes` of virtual addresses at `address`.
    Register {
        /// The tenant's name.
        name: Arc<str>,
    },
    /// A tenant's reservation was freed, with everything it held.
    Unregister,
    /// New physical memory (`cuMemCreate`) of `bytes`.
    Create {
        /// The new chunk.
        chunk: ChunkId,
    },
    /// Physical memory returned to the driver (`cuMemRelease`).
    Release {
        /// The chunk released; its id may be reused by a later chunk.
        chunk: ChunkId,
    },
    /// A chunk mapped at `address`; `reused` when it came from the cache.
    Map {
        /// The chunk mapped.
        chunk: ChunkId,
        /// The block it now backs.
        block: BlockId,
        /// Whether it came from the cache (no `cuMemCreate`).
        reused: bool,
    },
    /// A chunk unmapped from `address` (it goes back to the cache).
    Unmap {
        /// The chunk unmapped.
        chunk: ChunkId,
        /// The block it backed.
        block: BlockId,
    },
    /// A block's address range was carved out (`bytes` of virtual capacity).
    Alloc {
        /// The new block.
        block: BlockId,
    },
    /// A block was freed.
    Free {
        /// The block freed.
        block: BlockId,
    },
    /// A block's length grew to `bytes`.
    Grow {
        /// The block grown.
        block: BlockId,
    },
    /// A block's length shrank to `bytes`.
    Shrink {
        /// The block shrunk.
        block: BlockId,
    },
    /// Cached chunks were released to make room: `chunks` of them, `bytes` in all.
    Drain {
        /// How many chunks were released.
        chunks: usize,
        /// Why.
        reason: DrainReason,
    },
    /// A request was refused (over budget, out of memory, out of virtual capacity).
    Refused,
}

/// Why the cache was drained.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub enum DrainReason {
    /// `cuMemCreate` reported out of memory.
    OutOfMemory,
    /// New memory would have exceeded the pool's budget.
    Budget,
    /// The caller asked ([`crate::ElasticPool::drain`]).
    Requested,
}

/// The most recent events, up to a capacity; older ones are dropped and counted.
#[derive(Clone, Debug)]
pub struct EventLog {
    events: VecDeque<Event>,
    capacity: usize,
    dropped: u64,
}

impl EventLog {
    pub fn new(capacity: usize) -> Self {
        Self {
            events: VecDeque::new(),
            capacity,
            dropped: 0,
        }
    }

    pub fn push(&mut self, event: Event) {
        if self.capacity == 0 {
            self.dropped += 1;
            return;
        }
        if self.events.len() == self.capacity {
            self.events.pop_front();
            self.dropped += 1;
        }
        self.events.push_back(event);
    }

    pub fn events(&self) -> impl Iterator<Item = &Event> {
        self.events.iter()
    }

    #[cfg(test)]
    pub fn is_empty(&self) -> bool {
        self.events.is_empty()
    }

    /// How many events were dropped because the log was full.
    pub fn dropped(&self) -> u64 {
        self.dropped
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn event(n: u64) -> Event {
        Event {
            at: Duration::from_micros(n),
            kind: EventKind::Refused,
            tenant: None,
            address: n,
            bytes: 0,
        }
    }

    #[test]
    fn keeps_the_most_recent_and_counts_the_rest() {
        let mut log = EventLog::new(3);
        (0..5).for_each(|n| log.push(event(n)));
        let kept: Vec<u64> = log.events().map(|e| e.address).collect();
        assert_eq!(kept, vec![2, 3, 4]);
        assert_eq!(log.dropped(), 2);
        let mut off = EventLog::new(0);
        off.push(event(1));
        assert!(off.is_empty());
        assert_eq!(off.dropped(), 1);
    }
}
