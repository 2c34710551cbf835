// Shared by build.rs and the crate (through `include!`): FNV-1a, and the fingerprint that ties
// the committed PTX to the kernel source it was generated from.

/// First line of the committed PTX: this prefix, then the source's fingerprint in hex.
pub const PTX_SOURCE_HEADER: &str = "// stablebuf kernels source fnv1a64: ";

/// FNV-1a, 64 bit.
pub fn fnv1a64(bytes: impl IntoIterator<Item = u8>) -> u64 {
    let mut hash: u64 = 0xcbf2_9ce4_8422_2325;
    for byte in bytes {
        hash ^= u64::from(byte);
        hash = hash.wrapping_mul(0x0000_0100_0000_01b3);
    }
    hash
}

/// FNV-1a over the source with line endings normalised, so a checkout with CRLF endings
/// fingerprints the same as one with LF.
pub fn source_fingerprint(source: &str) -> u64 {
    fnv1a64(source.bytes().filter(|&b| b != b'\r'))
}
