//! Pointer queries on the layer's memory: what `cuPointerGetAttribute(s)`,
//! `cuMemGetAddressRange` and `cuMemRetainAllocationHandle` answer for a pointer into an
//! allocation the layer made, so that a program (or NCCL's and PyTorch's registration paths)
//! sees what CUDA shows for memory `cudaMalloc` returned.
//!
//! The driver alone would describe the layer's VMM mappings: a pool allocation stitched from
//! several chunks has one range per chunk, a pointer's `RANGE_SIZE` can be the size of the
//! layer's whole reservation, and a retained handle covers one chunk only. So the layer
//! answers the range attributes from its ownership table (one allocation: its start, the size
//! asked for), asks the driver about the allocation's start for the per-allocation
//! identifiers (so every pointer into it gets the same ones), refuses to hand out a physical
//! handle (as CUDA does for `cudaMalloc` memory), names the allocating (primary) context
//! where the driver names none for a VMM mapping, and passes everything else through.

/// An allocation of the layer, as a pointer query describes it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Allocation {
    pub start: u64,
    /// The size the caller asked for.
    pub bytes: usize,
    /// The device ordinal it lives on.
    pub device: usize,
}

impl Allocation {
    pub fn contains(&self, address: u64) -> bool {
        address >= self.start && address - self.start < self.bytes as u64
    }
}

/// `CUpointer_attribute` values (cuda.h) the layer answers or redirects.
pub mod attribute {
    pub const CONTEXT: i32 = 1;
    pub const BUFFER_ID: i32 = 7;
    pub const IS_LEGACY_CUDA_IPC_CAPABLE: i32 = 10;
    pub const RANGE_START_ADDR: i32 = 11;
    pub const RANGE_SIZE: i32 = 12;
    pub const ALLOWED_HANDLE_TYPES: i32 = 14;
    pub const MAPPING_SIZE: i32 = 18;
    pub const MAPPING_BASE_ADDR: i32 = 19;
    pub const MEMORY_BLOCK_ID: i32 = 20;
}

/// What to answer for one attribute of a pointer into an [`Allocation`].
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Answer {
    /// Write this 64-bit value (`CUdeviceptr`, `size_t`, `unsigned long long` and `void *` are
    /// all 8 bytes on the platforms the layer builds for).
    Value(u64),
    /// Ask the driver, about this address instead of the caller's: the allocation's start,
    /// for attributes that identify the allocation.
    AskAt(u64),
    /// Ask the driver about the caller's pointer, unchanged.
    PassThrough,
    /// Ask the driver; where it names no context (VMM mappings belong to none), answer the
    /// primary context of this device, the one the layer allocated in: `cudaMalloc` memory
    /// names the context it was allocated in.
    ContextOf { device: usize },
}

/// The answer for `attribute` of a pointer into `allocation`.
pub fn answer(attribute: i32, allocation: &Allocation) -> Answer {
    use attribute::*;
    match attribute {
        // One allocation, whatever mappings serve it.
        RANGE_START_ADDR | MAPPING_BASE_ADDR => Answer::Value(allocation.start),
        RANGE_SIZE | MAPPING_SIZE => Answer::Value(allocation.bytes as u64),
        // The same identifiers for every pointer into the allocation, as CUDA gives. The
        // handle types too (the driver's answer for the first chunk; its width is the
        // driver's to write): whatever they say, `cuMemRetainAllocationHandle` is refused.
        BUFFER_ID | MEMORY_BLOCK_ID | ALLOWED_HANDLE_TYPES => Answer::AskAt(allocation.start),
        // The driver's answer is the truth: VMM memory is not legacy-IPC capable, and the
        // layer refuses cudaIpcGetMemHandle on it. The one documented difference from a plain
        // `cudaMalloc` (which answers 1).
        IS_LEGACY_CUDA_IPC_CAPABLE => Answer::PassThrough,
        CONTEXT => Answer::ContextOf {
            device: allocation.device,
        },
        _ => Answer::PassThrough,
    }
}

/// Why `cuMemRetainAllocationHandle` is refused on the layer's memory: CUDA refuses it for
/// `cudaMalloc` memory, and the layer's allocation may be several physical chunks, so any one
/// handle would stand for the wrong memory.
pub const RETAIN_REFUSED: &str = "the pointer is memory the layer allocated for cudaMalloc or \
     cuMemAlloc; CUDA gives no allocation handle for such memory (and one chunk's handle would \
     not cover the allocation). Allocate with cuMemCreate, or run with \
     STABLEBUF_PRELOAD_MODE=off, to share it by handle";

#[cfg(test)]
mod tests {
    use super::attribute::*;
    use super::*;

    const ALLOCATION: Allocation = Allocation {
        start: 0x7f00_0000_0000,
        bytes: 256 << 20,
        device: 1,
    };

    #[test]
    fn the_range_is_the_whole_allocation_as_asked() {
        assert_eq!(
            answer(RANGE_START_ADDR, &ALLOCATION),
            Answer::Value(0x7f00_0000_0000)
        );
        assert_eq!(answer(RANGE_SIZE, &ALLOCATION), Answer::Value(256 << 20));
        assert_eq!(
            answer(MAPPING_BASE_ADDR, &ALLOCATION),
            Answer::Value(0x7f00_0000_0000)
        );
        assert_eq!(answer(MAPPING_SIZE, &ALLOCATION), Answer::Value(256 << 20));
    }

    #[test]
    fn identifiers_are_asked_at_the_start_so_every_pointer_shares_them() {
        for attribute in [BUFFER_ID, MEMORY_BLOCK_ID, ALLOWED_HANDLE_TYPES] {
            assert_eq!(
                answer(attribute, &ALLOCATION),
                Answer::AskAt(ALLOCATION.start)
            );
        }
    }

    #[test]
    fn the_rest_is_the_drivers_answer_about_the_callers_pointer() {
        // Memory type, device ordinal, mapped, legacy IPC: the driver's own answer.
        for attribute in [2, 3, 6, 8, 9, IS_LEGACY_CUDA_IPC_CAPABLE, 13, 15, 16] {
            assert_eq!(answer(attribute, &ALLOCATION), Answer::PassThrough);
        }
    }

    #[test]
    fn the_context_falls_back_to_the_allocations_device() {
        assert_eq!(
            answer(CONTEXT, &ALLOCATION),
            Answer::ContextOf { device: 1 }
        );
    }

    #[test]
    fn contains_is_half_open() {
        assert!(ALLOCATION.contains(ALLOCATION.start));
        assert!(ALLOCATION.contains(ALLOCATION.start + (256 << 20) - 1));
        assert!(!ALLOCATION.contains(ALLOCATION.start + (256 << 20)));
        assert!(!ALLOCATION.contains(ALLOCATION.start - 1));
    }
}
