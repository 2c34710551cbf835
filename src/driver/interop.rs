//! stablebuf types as cudarc kernel arguments.

/// Implements cudarc's `PushKernelArg` for `&$ty` and `&mut $ty`, pushing the `CUdeviceptr`
/// field `$field`. Invoked beside each type, so the field stays private to its module.
macro_rules! impl_kernel_arg {
    ($ty:ident $(<$($generic:tt),*>)?, $field:ident) => {
        // SAFETY: pushes a pointer to the value's `CUdeviceptr` field, which lives as long as
        // the borrow `'b`, and `'b` outlives the launch builder `'a`, as cudarc's own slice
        // impls do.
        #[allow(unsafe_code)]
        unsafe impl<'a, 'b: 'a $(, $($generic),*)?>
            cudarc::driver::PushKernelArg<&'b $ty $(<$($generic),*>)?>
            for cudarc::driver::LaunchArgs<'a>
        {
            #[inline(always)]
            fn arg(&mut self, value: &'b $ty $(<$($generic),*>)?) -> &mut Self {
                self.arg(&value.$field)
            }
        }

        // SAFETY: as above.
        #[allow(unsafe_code)]
        unsafe impl<'a, 'b: 'a $(, $($generic),*)?>
            cudarc::driver::PushKernelArg<&'b mut $ty $(<$($generic),*>)?>
            for cudarc::driver::LaunchArgs<'a>
        {
            #[inline(always)]
            fn arg(&mut self, value: &'b mut $ty $(<$($generic),*>)?) -> &mut Self {
                self.arg(&value.$field)
            }
        }
    };
}

pub(crate) use impl_kernel_arg;
