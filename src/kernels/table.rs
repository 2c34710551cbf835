//! What both kernel sets are: a loaded PTX module and its typed functions, loaded the same way.

/// Declares a kernel set: a struct holding its module and one typed function per field, with
/// `load` (the PTX into a context, then each field's function by its signature in
/// [`abi`](crate::driver::launch::abi)) and `module`.
///
/// ```text
///   kernel_table! {
///       /// docs
///       pub struct Kernels from PTX { naive: KernelFn<(u64, ..)> = MATMUL_NAIVE, .. }
///   }
/// ```
macro_rules! kernel_table {
    (
        $(#[$meta:meta])*
        pub struct $name:ident from $ptx:path {
            $($field:ident: $ty:ty = $signature:ident,)*
        }
    ) => {
        $(#[$meta])*
        #[derive(Debug)]
        pub struct $name {
            module: std::sync::Arc<cudarc::driver::CudaModule>,
            $($field: $ty,)*
        }

        impl $name {
            /// Loads the module into `ctx` (the driver JIT-compiles the PTX for the device once).
            pub fn load(
                ctx: &std::sync::Arc<cudarc::driver::CudaContext>,
            ) -> $crate::error::Result<Self> {
                let module = $crate::driver::launch::load_module(ctx, $ptx)?;
                Ok(Self {
                    $($field: $crate::driver::launch::function(
                        &module,
                        $crate::driver::launch::abi::$signature,
                    )?,)*
                    module,
                })
            }

            /// The module, to load other functions by name for `launch_builder`.
            pub fn module(&self) -> &std::sync::Arc<cudarc::driver::CudaModule> {
                &self.module
            }
        }
    };
}

pub(super) use kernel_table;
