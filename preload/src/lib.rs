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
//! Three layers, each using only the ones below it (`scripts/module-graph --src preload/src
//! --order hooks,engine,cuda`, run by `scripts/test`, fails on an import the other way):
//!
//! - [`hooks`]: the exported CUDA functions (`ffi`), the process-wide state behind them
//!   (`layer`) and its configuration ([`hooks::env`]: variables, help).
//! - [`engine`]: vmm's logic over a [`engine::device::Device`], pure and tested on the CPU
//!   with a fake device: the ownership [`engine::table`], [`engine::tags`], copy elision
//!   ([`engine::elide`]), pointer queries ([`engine::query`]), [`engine::stats`], monitor
//!   mode's records and timeline ([`engine::monitor`]), NCCL registrations of tagged memory
//!   renewed around pauses ([`engine::nccl`]); and the real device on stablebuf's pool and
//!   regions ([`engine::gpu`]).
//! - [`cuda`]: the real CUDA (and NCCL) functions (`real`, found at run time), the error codes
//!   of each ABI ([`cuda::codes`]), the exported symbols ([`cuda::symbols`]), driver entry-point
//!   versions ([`cuda::entry`]), the libraries that launch unseen ([`cuda::unseen`]) and the
//!   notices a user must see ([`cuda::notice`]).
//!
//! `unsafe` lives only in `real` and `ffi`.

#![deny(unsafe_code)]

// Three layers, each using only those below it (scripts/module-graph checks the order):
// hooks → engine → cuda.
pub mod cuda;
pub mod engine;
pub mod hooks;
