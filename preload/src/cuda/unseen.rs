//! Libraries that reach the GPU without passing through the layer's hooks.
//!
//! Copy elision is only correct if every launch, copy and synchronisation between a deferred
//! copy and the free of its source is a flush point. Libraries that link the CUDA runtime
//! statically (cuBLAS, cuDNN, cuFFT, NCCL...) or open `libcuda` themselves and look functions
//! up with `dlsym` on its handle (Triton's launcher) launch kernels the layer never sees. When
//! one of them is loaded in the process, the layer stops deferring copies ("when unsure, copy"):
//! see `README.md`, *Copy elision*.

/// File-name fragments of libraries known to launch GPU work outside the layer's view.
pub const UNSEEN_LAUNCHERS: &[&str] = &[
    "libcublas", // libcublas, libcublasLt: static cudart inside
    "libcudnn",  // every libcudnn_* sub-library
    "libnccl",   // NCCL: static cudart, its own driver lookups
    "libcufft",  // libcufft, libcufftw
    "libcurand",
    "libcusparse",
    "libcusolver", // libcusolver, libcusolverMg
    "libcutensor",
    "libcudss",
    "libnvjpeg",
    "libnpp", // libnppc, libnppi*, libnpps
    "libnvshmem",
    "libcufile",
    "libnvinfer", // TensorRT
    "libtriton",
    "cuda_utils", // Triton's launcher module (dlopen + dlsym of libcuda)
    "libmagma",
    "libflashinfer",
];

/// The fragment of [`UNSEEN_LAUNCHERS`] that the loaded object at `path` matches, if any.
/// Only the file name counts (a directory called `libcublas` holding other files does not).
pub fn launches_unseen(path: &str) -> Option<&'static str> {
    let file = path.rsplit('/').next().unwrap_or(path);
    UNSEEN_LAUNCHERS
        .iter()
        .copied()
        .find(|fragment| file.contains(fragment))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn libraries_with_their_own_runtime_are_recognised() {
        for path in [
            "/usr/local/cuda/lib64/libcublas.so.13",
            "/x/nvidia/cublas/lib/libcublasLt.so.13",
            "/site-packages/nvidia/cudnn/lib/libcudnn_engines_precompiled.so.9",
            "/site-packages/nvidia/nccl/lib/libnccl.so.2",
            "/home/u/.triton/cache/abc/cuda_utils.cpython-312-x86_64-linux-gnu.so",
        ] {
            assert!(launches_unseen(path).is_some(), "{path}");
        }
    }

    #[test]
    fn the_runtime_the_driver_and_plain_programs_are_not() {
        for path in [
            "/usr/local/cuda/lib64/libcudart.so.13",
            "/usr/lib/x86_64-linux-gnu/libcuda.so.1",
            "/lib/x86_64-linux-gnu/libc.so.6",
            "/tmp/out/elision_interleavings",
            "/libcublas/dir/libfoo.so",
            "",
        ] {
            assert_eq!(launches_unseen(path), None, "{path}");
        }
    }
}
