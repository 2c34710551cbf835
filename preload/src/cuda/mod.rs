//! What the layer knows of CUDA itself: the real functions (found at run time, never linked),
//! the error codes of each ABI, the table of hooked symbols, the driver's entry-point
//! versions, the libraries that launch work the layer cannot see, and the notices it prints.
//! The bottom layer: it uses neither the engine nor the hooks.
//!
//! The flush points (most of the hooked functions) are named once, with their prototypes, in
//! `flush_points.rs`, which `symbols.rs` (the exported names), `real.rs` (the real functions)
//! and `hooks/ffi.rs` (the hooks themselves) each include with their own macros.

pub mod codes;
pub mod entry;
pub mod notice;
#[allow(unsafe_code)]
pub(crate) mod real;
pub mod symbols;
pub mod unseen;
