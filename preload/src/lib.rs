//! # stablebuf-preload
//!
//! An `LD_PRELOAD` library that puts unmodified CUDA programs and PyTorch on stablebuf:
//!
//! ```text
//! LD_PRELOAD=target/release/libstablebuf_preload.so STABLEBUF_PRELOAD_MODE=vmm python train.py
//! ```
//!
//! - **monitor**: every call passes through; allocations are logged and drawn as an
//!   address-over-time timeline at exit, with a one-line summary.
//! - **vmm** (default): `cudaMalloc`/`cuMemAlloc` (and their async, entry-point and `_v2`
//!   forms) are served from an [`stablebuf::ElasticPool`] — stable addresses in one reservation,
//!   cached physical chunks stitched together, drain-and-retry on out-of-memory — or, for
//!   memory allocated under a tag (`stablebuf_set_tag`), from that tag's region, which
//!   `stablebuf_pause` / `stablebuf_resume` release and restore at the same addresses.
//! - **copy elision** (opt-in): the grow-by-copy idiom (malloc larger, copy all, free old)
//!   moves physical memory instead of copying it.
//!
//! See `README.md` for the variables, the C ABI (`include/stablebuf_preload.h`), the rules and
//! the limits.
//!
//! ## Modules
//! Pure logic, tested on the CPU: [`env`](mod@env) (variables, help), [`codes`] (error codes of each
//! ABI), [`table`] (pointer ownership), [`tags`] (per-thread tag, tag book), [`elide`] (copy
//! elision state machine), [`entry`] (driver entry-point substitution), [`unseen`] (libraries that launch unseen), [`monitor`] (records,
//! timeline), [`query`] (pointer queries on the layer's memory), [`stats`], and [`engine`] (vmm's logic over a [`device::Device`]).
//! The GPU side: [`gpu`] (stablebuf pool and regions), `layer` (the process-wide state).
//! `unsafe` lives only in `real` (finding the real CUDA functions) and `ffi` (the exports).

#![deny(unsafe_code)]

pub mod codes;
pub mod device;
pub mod elide;
pub mod engine;
pub mod entry;
pub mod env;
#[allow(unsafe_code)]
mod ffi;
pub mod gpu;
mod layer;
pub mod monitor;
pub mod query;
#[allow(unsafe_code)]
mod real;
pub mod stats;
pub mod symbols;
pub mod table;
pub mod tags;
pub mod unseen;
