//! What the layer knows of CUDA itself: the real functions (found at run time, never linked),
//! the error codes of each ABI, the table of hooked symbols, the driver's entry-point
//! versions, the libraries that launch work the layer cannot see, and the notices it prints.
//! The bottom layer: it uses neither the engine nor the hooks.

pub mod codes;
pub mod entry;
pub mod notice;
#[allow(unsafe_code)]
pub(crate) mod real;
pub mod symbols;
pub mod unseen;
