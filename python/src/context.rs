//! Which CUDA context is current on the calling thread while this crate calls the driver.
//!
//! PyTorch takes its current device from the thread's current context (`cudaGetDevice` answers
//! with the device of the context the driver has current). The core crate makes a region's
//! context current before its driver calls and leaves it current after them, so with regions on
//! several devices a sleep of a region on device 1, called while device 0 is current, would
//! leave device 1 current under the caller. Every call here that reaches the driver therefore
//! runs inside a [`ContextScope`]: the region's context is current for the call, and the
//! context that was current before is current again when the scope ends (also on an error or
//! a panic). Values that release device memory when dropped (weight sets held by Python) are
//! wrapped in [`ContextNeutral`] for the same reason. The driver calls are the core's
//! ([`stablebuf::device::SavedContext`], [`stablebuf::device::make_current`]).
//!
//! ```text
//!   current:  device 0 ─┬─ device 1 (region's) ──── core calls ────┬─ device 0
//!                       ContextScope::enter(region on device 1)   scope dropped
//! ```

use std::ops::Deref;

use stablebuf::cudarc::driver::CudaContext;
use stablebuf::device::{make_current, SavedContext};

use crate::errors::Failure;

/// Puts back, when dropped, the CUDA context that was current on this thread when it was made.
#[must_use = "the previous context is put back when the scope is dropped"]
pub struct ContextScope {
    /// The context current at the start (or that none was); `None` where it could not be read
    /// (no driver, or the driver refused), and then nothing is put back.
    previous: Option<SavedContext>,
}

impl ContextScope {
    /// Remembers this thread's current context, to put it back at the end of the scope.
    pub fn keep() -> Self {
        Self {
            previous: SavedContext::save().ok(),
        }
    }

    /// Remembers this thread's current context and makes `ctx` current for the scope.
    pub fn enter(ctx: &CudaContext) -> Result<Self, Failure> {
        let scope = Self::keep();
        scope.switch_to(ctx)?;
        Ok(scope)
    }

    /// Makes `ctx` current for the rest of the scope (a call over regions of several devices
    /// switches between their contexts; the caller's comes back at the end all the same).
    pub fn switch_to(&self, ctx: &CudaContext) -> Result<(), Failure> {
        make_current(ctx).map_err(|error| {
            Failure::from_core(&error, None).context(format_args!(
                "making device {}'s context current",
                ctx.ordinal()
            ))
        })
    }
}

impl Drop for ContextScope {
    fn drop(&mut self) {
        if let Some(previous) = &self.previous {
            // A context that was current a moment ago can only fail to become current again
            // when the driver is unusable (a sticky error), which the caller's next CUDA call
            // reports; a drop has no one to tell.
            let _ = previous.restore();
        }
    }
}

/// A value whose drop leaves this thread's current CUDA context as it found it.
///
/// Python lets go of a weight set wherever it likes, whichever device is current; dropping the
/// last handle waits for and releases memory in the set's own context, which would then stay
/// current and move PyTorch's current device.
pub struct ContextNeutral<T>(Option<T>);

impl<T> ContextNeutral<T> {
    pub fn new(value: T) -> Self {
        Self(Some(value))
    }
}

impl<T> Deref for ContextNeutral<T> {
    type Target = T;

    fn deref(&self) -> &T {
        self.0.as_ref().expect("only a drop takes the value")
    }
}

impl<T> Drop for ContextNeutral<T> {
    fn drop(&mut self) {
        let _scope = ContextScope::keep();
        drop(self.0.take());
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::atomic::{AtomicUsize, Ordering};
    use std::sync::Arc;

    struct CountsDrops(Arc<AtomicUsize>);

    impl Drop for CountsDrops {
        fn drop(&mut self) {
            self.0.fetch_add(1, Ordering::SeqCst);
        }
    }

    #[test]
    fn a_neutral_value_reads_through_and_drops_its_value_once() {
        let drops = Arc::new(AtomicUsize::new(0));
        let value = ContextNeutral::new((CountsDrops(drops.clone()), 7));
        assert_eq!(value.1, 7);
        assert_eq!(drops.load(Ordering::SeqCst), 0);
        drop(value);
        assert_eq!(drops.load(Ordering::SeqCst), 1);
    }

    #[test]
    fn without_a_driver_a_scope_remembers_nothing_and_puts_nothing_back() {
        if stablebuf::driver_present() {
            return; // a GPU machine: the GPU tests check that the current device is kept
        }
        let scope = ContextScope::keep();
        assert!(scope.previous.is_none());
        drop(scope);
    }
}
