//! Seeded `u32` patterns written and checked on the GPU (`Kernels::fill_pattern`,
//! `Kernels::pattern_mismatches`): a value depends only on its index and the seed, so the same
//! bytes can be checked wherever they are mapped.

use stablebuf::cudarc::driver::sys::CUdeviceptr;
use stablebuf::DeviceBuffer;

use super::Gpu;

/// A raw device range (a region allocation, a snapshot's home) as a kernel operand.
#[derive(Clone, Copy, Debug)]
pub struct DeviceRange {
    pub ptr: CUdeviceptr,
    pub bytes: usize,
}

impl DeviceBuffer for DeviceRange {
    fn device_address(&self) -> CUdeviceptr {
        self.ptr
    }
    fn byte_len(&self) -> usize {
        self.bytes
    }
}

/// Writes the pattern of `seed` over every whole `u32` of `buffer` and waits for it.
pub fn fill(gpu: &Gpu, buffer: &impl DeviceBuffer, seed: u32) {
    let count = buffer.byte_len() / 4;
    gpu.kernels
        .fill_pattern(&gpu.stream, buffer, 0, count, seed)
        .expect("fill_pattern");
    gpu.stream.synchronize().expect("synchronize after a fill");
}

/// How many of the first `count` `u32`s of `buffer` differ from the pattern of `seed`.
pub fn errors_in(gpu: &Gpu, buffer: &impl DeviceBuffer, count: usize, seed: u32) -> u64 {
    gpu.kernels
        .pattern_mismatches(&gpu.stream, buffer, 0, count, seed)
        .expect("pattern_mismatches")
}

/// How many `u32`s of `buffer` differ from the pattern of `seed`.
pub fn errors(gpu: &Gpu, buffer: &impl DeviceBuffer, seed: u32) -> u64 {
    errors_in(gpu, buffer, buffer.byte_len() / 4, seed)
}
