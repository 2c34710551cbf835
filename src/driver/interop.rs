//! stablebuf types as cudarc kernel arguments.

use cudarc::driver::{LaunchArgs, PushKernelArg};

use crate::space::Slot;
use crate::view::SlotView;

// SAFETY: pushes a pointer to the slot's `CUdeviceptr` field, which lives as long as the borrow
// `'b`, and `'b` outlives the launch builder `'a`, as cudarc's own slice impls do.
unsafe impl<'a, 'b: 'a> PushKernelArg<&'b Slot> for LaunchArgs<'a> {
    #[inline(always)]
    fn arg(&mut self, slot: &'b Slot) -> &mut Self {
        self.arg(&slot.ptr)
    }
}

// SAFETY: as above.
unsafe impl<'a, 'b: 'a> PushKernelArg<&'b mut Slot> for LaunchArgs<'a> {
    #[inline(always)]
    fn arg(&mut self, slot: &'b mut Slot) -> &mut Self {
        self.arg(&slot.ptr)
    }
}

// SAFETY: as above, for the view's address field.
unsafe impl<'a, 'b: 'a, 'c: 'b, T> PushKernelArg<&'b SlotView<'c, T>> for LaunchArgs<'a> {
    #[inline(always)]
    fn arg(&mut self, view: &'b SlotView<'c, T>) -> &mut Self {
        self.arg(&view.ptr)
    }
}

// SAFETY: as above.
unsafe impl<'a, 'b: 'a, 'c: 'b, T> PushKernelArg<&'b mut SlotView<'c, T>> for LaunchArgs<'a> {
    #[inline(always)]
    fn arg(&mut self, view: &'b mut SlotView<'c, T>) -> &mut Self {
        self.arg(&view.ptr)
    }
}
