//! Elastic memory: blocks that grow in place, a physical chunk pool with drain-and-retry,
//! stitching of scattered chunks into one range, budgets shared by tenants, statistics, and a
//! picture of it all.
//!
//! ```no_run
//! use stablebuf::{open_device, ElasticPool, PoolOptions};
//!
//! # fn main() -> stablebuf::Result<()> {
//! let ctx = open_device(0)?;
//! let pool = ElasticPool::new(&ctx, PoolOptions::default().budget(40 << 30))?;
//! let llm = pool.register("llm", 64 << 30)?; // addresses only: reserving costs nothing
//! let mut kv = llm.alloc_growable(1536 << 20, 3 << 30)?;
//! let at = kv.address();
//! kv.grow(3 << 30)?; // maps 1.5 GiB more behind the same address; nothing is copied
//! assert_eq!(kv.address(), at);
//! println!("{}", pool.stats());
//! pool.write_timeline("llm", "timeline.svg")?;
//! # Ok(()) }
//! ```
//!
//! # Concepts
//!
//! A **tenant** reserves a range of virtual addresses (its capacity) and carves **blocks** out
//! of it, best fit, one bit per granule. A block's physical memory is one or
//! more **chunks** (`cuMemCreate` allocations) mapped side by side:
//!
//! ```text
//!   tenant "llm" reservation (64 GiB of addresses, no memory)
//!   |--- block A ---|-- block B (capacity 3 GiB) ----------|          free            |
//!   [chunk 7][chunk 2][ chunk 9: 1.5 GiB  ][ chunk 4: 1.5 GiB ]
//!                     ^ B's address never changes; grow maps chunk 4 behind chunk 9
//! ```
//!
//! Freed chunks are unmapped (after the fence: the GPU must be done with them) and **cached**.
//! A later request takes cached chunks first, largest first, and lays them side by side in its
//! range (**stitching**), so memory freed in scattered 64 MiB pieces serves one 40 GiB block
//! with no `cuMemCreate`. What the cache cannot cover becomes one new chunk. Stitching trades
//! driver calls for mappings: each mapping costs tens of µs to map and set access, so the
//! planner takes the largest chunks first, grants access to a stitched run with one
//! `cuMemSetAccess`, and creates at most one new chunk per request. While the device has room,
//! a request maps at most one cached chunk per 64 MiB it asks for and creates the rest (mapping
//! thousands of small chunks costs more than new memory); when the new memory does not fit, it
//! stitches as many as it needs.
//!
//! When `cuMemCreate` runs out of memory, the pool **drains** (releases) the cached chunks the
//! request does not use and retries once; if that fails too the error is
//! [`PoolError::PoolOutOfMemory`](crate::error::PoolError::PoolOutOfMemory) with what was asked,
//! cached and
//! held. A **budget** caps the pool's physical memory (mapped plus cached) across tenants, and
//! each tenant may have a limit of its own; a request over either is refused whole
//! ([`PoolError::OverBudget`](crate::error::PoolError::OverBudget)), after the cache was released
//! if that
//! would have made room.
//!
//! [`PoolStats`] and [`TenantStats`] report reserved addresses, mapped and cached memory,
//! mappings, the largest free run and fragmentation. Every map, unmap, grow and drain is logged
//! with its address and time ([`Event`]); [`ElasticPool::write_timeline`] draws the log as an
//! SVG of address against time.
//!
//! # Guarantees
//! - A block's address is fixed for its life; grow and shrink keep its contents (shrink keeps
//!   the part below the new length).
//! - Nothing is unmapped before the tenant's fence ([`crate::FencePolicy`]) has waited for the
//!   GPU; where that wait fails in a `Drop`, the memory is leaked, never unmapped under work.
//! - A failed request changes nothing but the cache it released to make room.
//! - Blocks of an unregistered tenant have length 0: copies and kernel launchers refuse them.

use crate::vmm_core as backend;
mod block;
pub mod create_ahead;
mod elastic;
mod events;
#[cfg(test)]
use crate::vmm_core::fake;
mod granules;
mod ledger;
#[cfg(test)]
mod proptests;
mod shared;
mod state;
mod stats;
#[cfg(feature = "timeline")]
pub mod timeline;

pub use block::Block;
pub use elastic::{ElasticPool, PoolOptions, Tenant};
pub use events::{BlockId, DrainReason, Event, EventKind};
pub use ledger::{ChunkId, TenantId};
pub use state::BlockInfo;
pub use stats::{human_bytes, PoolStats, TenantStats};

pub(crate) use events::EventLog;
pub(crate) use granules::GranuleMap;

/// The old path of [`create_ahead`], which was renamed in 0.2.
#[deprecated(since = "0.2.0", note = "renamed to `stablebuf::pool::create_ahead`")]
pub mod ahead {
    /// [`create_ahead::HEADROOM_PERCENT`](super::create_ahead::HEADROOM_PERCENT).
    // A constant rather than a re-export: a deprecated module alone warns nobody who uses it.
    #[deprecated(
        since = "0.2.0",
        note = "now `stablebuf::pool::create_ahead::HEADROOM_PERCENT`"
    )]
    pub const HEADROOM_PERCENT: usize = super::create_ahead::HEADROOM_PERCENT;
}

// The old path of the chunk ledger (`ledger.rs` was `book.rs`), for the property tests until
// they name `ledger` and `ChunkLedger` themselves.
#[cfg(test)]
mod book {
    pub(crate) use super::ledger::{ChunkId, ChunkLedger as ChunkBook, TenantId};
}
