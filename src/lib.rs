//! # stablebuf
//!
//! Stable device addresses for CUDA graphs while the data under them changes.
//!
//! A [`Space`] reserves one long-lived virtual address range (`cuMemAddressReserve`) and carves
//! it into named [`Slot`]s at fixed addresses. A [`Dataset`] is physical memory for one group of
//! slots. [`Space::bind`] maps a dataset under the group's addresses, replacing the previous one
//! with one unmap, one map and one set-access, so a [`StableGraph`] captured once replays on
//! new data with no copy, no re-capture and no re-instantiation.
//!
//! ```no_run
//! use stablebuf::kernels::{Kernels, MatmulKernel}; // feature `demo-kernels`
//! use stablebuf::{open_device, Layout, Space};
//!
//! # fn main() -> stablebuf::Result<()> {
//! let ctx = open_device(0)?;
//! let stream = ctx.new_stream()?;
//! let kernels = std::sync::Arc::new(Kernels::load(&ctx)?);
//! let n = 256;
//! let bytes = n * n * 4;
//! let layout = Layout::builder()
//!     .group("inputs").input("a", bytes).input("b", bytes)
//!     .scratch("c", bytes)
//!     .build()?;
//! let space = Space::new(&ctx, layout)?;
//!
//! // Two datasets for the "inputs" group.
//! let first = space.new_dataset("inputs")?;
//! let second = space.new_dataset("inputs")?;
//! first.write(&stream, "a", &vec![1.0f32; n * n])?;
//! first.write(&stream, "b", &vec![2.0f32; n * n])?;
//! second.write(&stream, "a", &vec![3.0f32; n * n])?;
//! second.write(&stream, "b", &vec![4.0f32; n * n])?;
//!
//! // Capture once, over the slots' fixed addresses.
//! let (a, b, c) = (space.slot("a")?.clone(), space.slot("b")?.clone(), space.slot("c")?.clone());
//! let k = kernels.clone();
//! let mut graph = space.capture(&stream, move |s| {
//!     k.matmul(s, MatmulKernel::Auto, &a, &b, &c, n, n, n).map(drop)
//! })?;
//!
//! space.bind(&first)?;
//! graph.replay()?;
//! let c1: Vec<f32> = space.read(&stream, "c")?; // 512.0 everywhere
//!
//! space.bind(&second)?; // same addresses, new memory
//! assert!(graph.check_update()?.is_success());
//! graph.replay()?;
//! let c2: Vec<f32> = space.read(&stream, "c")?; // 3072.0 everywhere
//! # Ok(()) }
//! ```
//!
//! ## Guarantees
//! - A slot's address never changes for the life of its space.
//! - Before memory is unmapped, the GPU work that may use it has finished (see [`FencePolicy`]).
//! - Replaying a graph while any group of its spaces is unbound is
//!   [`GraphError::Unbound`](crate::error::GraphError::Unbound), never a
//!   GPU fault.
//! - Every driver failure is an [`Error`] naming the call; after an error, state is unchanged.
//! - Drop order: unmap before release, release before freeing the reservation.
//!
//! ## The picture
//! ```text
//!   Space: one reservation, addresses fixed for its life
//!   base                                                                     base + reserved
//!   | group "weights"            | group "batch"      | scratch (the space's own) |
//!   | slot w1   | slot w2        | slot x  | slot y   | slot tmp                  |
//!        ^ graphs capture these addresses once
//!
//!   Dataset W7 (one cuMemCreate, laid out like group "weights"):  [ w1 | w2 ]
//!   space.bind(&W7):  unmap the old dataset (after the fence) → map W7 → set access:
//!                     ONE mapping for the whole group, whatever its slot count
//! ```
//!
//! [`ElasticPool`] ([`pool`]) covers memory that changes size rather than content: blocks at
//! fixed addresses that grow in place, a physical chunk pool that stitches scattered cached
//! chunks into one range and drains its cache on out-of-memory, budgets shared by tenants,
//! statistics and an SVG timeline. [`region::Region`] is what allocator hooks (the preload
//! layer, the Python package) build on: a tag's allocations side by side, slept, woken and
//! swapped with one mapping for the whole span, or, below the device's crossover (about 100 MiB
//! on an H100, where a copy is cheaper than a remap), switched by a copy
//! ([`region::Region::switch_to`], [`region::SwitchStrategy`]).
//!
//! ## Layers
//! Each module imports only from the lines above it (`scripts/module-graph` checks that there
//! is no loop):
//! ```text
//!   error, ids, hash                    leaves
//!   driver                              the only unsafe: VMM, graphs, launches, host memory, fds
//!   buffer, fence, host, layout         operands and range checks, waiting, host copies,
//! arithmetic
//!   strategy                            bind cost model (remap or copy)
//!   kernels, pool, view                 launchers and cuBLAS, elastic memory, typed views
//!   dataset, region                     backing for one group, tagged regions
//!   space (bind)                        the one place that unmaps under a space
//!   graph, share, sleep                 capture/replay/update, fd sharing, sleep and wake
//!   pipeline                            lanes of spaces and graphs
//! ```
//!
//! ## Public surface
//! The crate root has what a graph-replay loop needs (25 names). The modules add:
//! [`buffer`] (the [`DeviceBuffer`] trait, checked copies, the plain `cuMemAlloc` baseline),
//! [`device`] (device count, peer access, free memory, the thread's current context),
//! [`graph`] (what an update check reports, node kinds), [`host`] (what a transfer to or from
//! the host reports), [`vmm`] (raw reservations, chunks and mappings, to build your own
//! layouts or measure the driver floor), [`pool`] (blocks, tenants, statistics and events of
//! elastic memory), [`region`], [`sleep`] (offloading and restoring groups by tag), [`share`]
//! (sending a dataset to another process, the wire protocol, and [`share::publish`]: weight
//! sets published to another process), [`layout`] (placement arithmetic), and with the feature
//! `demo-kernels` [`kernels`] (the demo matmul and decode kernels and cuBLAS on slots, which
//! the examples, benches and tests use).
//!
//! ## Logging
//! Every driver call runs in a `debug` span of the `tracing` crate named after the call, with
//! the bytes it concerns, and logs its duration and result; binds, drains and transfers log
//! what they did. Install any subscriber to see them, e.g. `tracing-subscriber` with
//! `RUST_LOG=stablebuf=debug`. Failures inside `Drop` (which cannot return an error) are
//! logged at `error`.
//!
//! ## Examples
//! `cargo run --release --example <name> -- --help` describes each; with no arguments each runs
//! its default scenario in seconds and exits non-zero if a check fails. `inference_loop`
//! (rebinding vs copy-in vs re-capture in a graph-replay loop), `graph_update`,
//! `reuse_virtual_address`, `sleep_wake`, `resize` and `fragmentation` (elastic memory),
//! `ipc_producer` / `ipc_consumer` (sharing a dataset between processes).
//!
//! ## Features
//! - `timeline` (default): the SVG timelines of pools and regions, drawn with `plotters`.
//! - `cuda-13000` (default), `cuda-12090`, `cuda-12040`: which CUDA bindings cudarc uses.
//! - `demo-kernels` (off): the [`kernels`] module, the PTX kernels `build.rs` compiles from
//!   `kernels/` and cuBLAS on slots. The library itself never launches a kernel; the
//!   examples, benches and tests turn it on.
//! - `fault-injection` (off): a test seam in the driver layer that makes chosen driver calls
//!   fail (`tests/gpu_faults.rs`); not for production builds.

#![deny(unsafe_code)]
#![warn(missing_docs)]

pub mod buffer;
#[cfg(feature = "nccl")]
pub mod collective;
mod dataset;
#[allow(unsafe_code)] // the one module that wraps the driver; see its docs
mod driver;
pub mod error;
mod fence;
pub mod graph;
mod hash;
pub mod host;
mod ids;
#[cfg(feature = "demo-kernels")]
pub mod kernels;
pub mod kv;
pub mod layout;
mod pipeline;
pub mod pool;
pub mod region;
pub mod share;
pub mod sleep;
mod space;
mod strategy;
#[cfg(test)]
mod testing;
mod view;
mod vmm_core;

pub use buffer::DeviceBuffer;
pub use dataset::{Dataset, DatasetSlot, Refill};
pub use driver::{driver_present, open_device};
pub use error::{Error, Result};
pub use fence::FencePolicy;
pub use graph::StableGraph;
pub use host::{HostArena, HostStorage};
pub use layout::{Layout, LayoutBuilder, Role};
pub use pipeline::{Lane, Pipeline};
pub use pool::{ElasticPool, PoolOptions};
pub use space::{Slot, Space, SpaceOptions};
pub use strategy::{BindStrategy, CostModel};
pub use view::SlotView;

/// The devices: how many there are, whether one reaches another's memory, and free memory;
/// and for code that calls the crate from another runtime's threads (the Python package): the
/// thread's current context, kept and put back, and that runtime's streams, borrowed.
pub mod device {
    pub use crate::driver::context::{borrow_stream, make_current, SavedContext};
    pub use crate::driver::device::{can_access_peer, device_count};
    pub use crate::driver::graph::upload_foreign_exec;
    pub use crate::driver::memory_info;
}

/// Memory given back, released in the background (issue 43): when a space, a dataset, a
/// region's set or a pool's cache gives physical memory back, stablebuf keeps it, unmapped, in a
/// per-device queue; the next allocation of the same size reuses it, and it is released to the
/// driver in bounded pieces when the process is idle (a background thread), when an allocation
/// runs out of memory, or at [`trim`](release::trim). [`ReleasePolicy`](release::ReleasePolicy)
/// (or `STABLEBUF_RELEASE=immediate|background|manual`) chooses; [`stats`](release::stats)
/// shows what is held.
pub mod release {
    pub use crate::driver::deferred::{
        ensure_free, held_bytes, policy, release_step, set_policy, stats, trim, trim_all,
    };
    pub use crate::driver::held::{ReleaseMode, ReleasePolicy, ReleaseStats};
}

/// The raw VMM wrappers (reservation, physical memory, mapping), safe RAII types for callers
/// that want to build their own layouts or measure the driver floor.
pub mod vmm {
    pub use crate::driver::vmm::{
        granularity, granularity_at, Location, Mapping, Physical, Reservation,
    };
}

/// cudarc, re-exported so users name the same version's contexts and streams.
pub use cudarc;

/// Test support: make chosen driver calls fail, record the calls an operation makes, count the
/// driver handles alive (feature `fault-injection`; not part of the stable API).
#[cfg(feature = "fault-injection")]
#[doc(hidden)]
pub use driver::inject as fault_injection;
