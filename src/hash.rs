//! The FNV-1a hash behind layout fingerprints and the kernel-source fingerprint. It is the same
//! file `build.rs` includes, so the crate and its build script cannot disagree.

#![allow(dead_code)] // build.rs uses the header constant; the crate uses the functions.

include!("../kernels/fingerprint.rs");
