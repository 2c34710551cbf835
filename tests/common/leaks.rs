//! What a test must give back: file descriptors and device memory.

use std::sync::Arc;

use stablebuf::cudarc::driver::CudaContext;
use stablebuf::device::memory_info;

pub const MIB: usize = 1 << 20;

/// Open file descriptors of this process.
pub fn open_fds() -> usize {
    std::fs::read_dir("/proc/self/fd")
        .expect("/proc/self/fd")
        .count()
}

/// Free device memory once the GPU is idle.
pub fn free_memory(ctx: &Arc<CudaContext>) -> usize {
    ctx.synchronize()
        .expect("synchronize before reading free memory");
    // Memory given back is held for release in the background (issue 43): release it first.
    stablebuf::release::trim_all();
    memory_info(ctx).expect("cuMemGetInfo").0
}

/// Free device memory plus what stablebuf holds for release on the device (free to its next
/// allocation of the size, released when the process is idle): the figure to compare with a
/// model mid-run without trimming, which would change what the run measures.
pub fn free_memory_counting_held(ctx: &Arc<CudaContext>) -> usize {
    ctx.synchronize()
        .expect("synchronize before reading free memory");
    memory_info(ctx).expect("cuMemGetInfo").0 + stablebuf::release::held_bytes(ctx.ordinal())
}

/// File descriptors and free device memory at one quiet moment.
#[derive(Clone, Copy, Debug)]
pub struct Baseline {
    pub fds: usize,
    pub free: usize,
}

impl Baseline {
    pub fn take(ctx: &Arc<CudaContext>) -> Self {
        Self {
            free: free_memory(ctx),
            fds: open_fds(),
        }
    }

    /// `Err` describing what is missing now: any descriptor, or more than `slack` bytes of
    /// device memory (the driver's own allocations move by a page now and then).
    pub fn compare(&self, ctx: &Arc<CudaContext>, slack: usize) -> Result<(), String> {
        let now = Self::take(ctx);
        let mut missing = Vec::new();
        if now.fds != self.fds {
            missing.push(format!("{} file descriptors (now {})", self.fds, now.fds));
        }
        let lost = self.free.saturating_sub(now.free);
        if lost > slack {
            missing.push(format!(
                "{lost} bytes of device memory ({:.1} MiB)",
                lost as f64 / MIB as f64
            ));
        }
        if missing.is_empty() {
            Ok(())
        } else {
            Err(format!("not back to baseline: {}", missing.join(", ")))
        }
    }
}
