//! Compiles the kernel sources under `kernels/` to PTX, each of them trying in order:
//! 1. `nvcc` (from `CUDA_HOME`/`CUDA_PATH` or `PATH`),
//! 2. NVRTC through cudarc, when libnvrtc loads (the `nvidia-cuda-nvrtc-cu12` wheel's `lib`
//!    folder on `LD_LIBRARY_PATH` is enough),
//! 3. the PTX committed beside the source, with a warning (and another if it is stale).
//!
//! `STABLEBUF_PTX_COMPILER=nvcc|nvrtc|committed` forces one path (and fails if it is missing).
//! `STABLEBUF_WRITE_PTX=1` rewrites the committed PTX from a fresh compile (`scripts/regen-ptx`).

use std::path::{Path, PathBuf};
use std::process::Command;

include!("kernels/fingerprint.rs");

/// One kernel source, its committed fallback, and what the crate sees of it.
struct Kernel {
    source: &'static str,
    committed: &'static str,
    /// File name in `OUT_DIR` that `src/kernels/ptx.rs` includes.
    out_name: &'static str,
    /// Environment variable (read with `env!`) naming the compiler that produced it.
    compiler_env: &'static str,
}

const KERNELS: [Kernel; 2] = [
    Kernel {
        source: "kernels/matmul.cu",
        committed: "kernels/matmul.ptx",
        out_name: "matmul.ptx",
        compiler_env: "STABLEBUF_PTX_COMPILER",
    },
    Kernel {
        source: "kernels/decode.cu",
        committed: "kernels/decode.ptx",
        out_name: "decode.ptx",
        compiler_env: "STABLEBUF_PTX_DECODE_COMPILER",
    },
];

/// Old enough to JIT on every GPU that has the VMM API (Volta and newer).
const ARCH: &str = "compute_70";

fn main() {
    println!("cargo:rerun-if-changed=kernels/fingerprint.rs");
    for var in [
        "LD_LIBRARY_PATH",
        "CUDA_HOME",
        "CUDA_PATH",
        "STABLEBUF_PTX_COMPILER",
        "STABLEBUF_WRITE_PTX",
    ] {
        println!("cargo:rerun-if-env-changed={var}");
    }
    let out_dir = PathBuf::from(std::env::var("OUT_DIR").expect("cargo sets OUT_DIR"));
    let forced = std::env::var("STABLEBUF_PTX_COMPILER").ok();
    let write_committed = std::env::var("STABLEBUF_WRITE_PTX").as_deref() == Ok("1");
    for kernel in &KERNELS {
        build(kernel, &out_dir, forced.as_deref(), write_committed);
    }
}

fn build(kernel: &Kernel, out_dir: &Path, forced: Option<&str>, write_committed: bool) {
    let Kernel {
        source: source_path,
        committed: committed_path,
        ..
    } = *kernel;
    println!("cargo:rerun-if-changed={source_path}");
    println!("cargo:rerun-if-changed={committed_path}");
    let source = std::fs::read_to_string(source_path)
        .unwrap_or_else(|e| panic!("{source_path} is not readable: {e}"));

    let compiled = match forced {
        Some("nvcc") => Some(
            nvcc(source_path, out_dir)
                .unwrap_or_else(|e| panic!("nvcc forced but failed on {source_path}: {e}")),
        ),
        Some("nvrtc") => Some(
            nvrtc(&source)
                .unwrap_or_else(|e| panic!("NVRTC forced but failed on {source_path}: {e}")),
        ),
        Some("committed") => None,
        Some(other) => panic!("STABLEBUF_PTX_COMPILER={other}: expected nvcc, nvrtc or committed"),
        None => match nvcc(source_path, out_dir) {
            Ok(found) => Some(found),
            Err(nvcc_err) => match nvrtc(&source) {
                Ok(found) => Some(found),
                Err(nvrtc_err) => {
                    println!(
                        "cargo:warning=stablebuf: no kernel compiler for {source_path} \
                         ({nvcc_err}; {nvrtc_err}); using the PTX committed in {committed_path}"
                    );
                    None
                }
            },
        },
    };

    let (ptx, compiler) = match compiled {
        Some((ptx, compiler)) => (ptx, compiler),
        None => {
            let committed = std::fs::read_to_string(committed_path)
                .unwrap_or_else(|e| panic!("{committed_path} is not readable: {e}"));
            let expected = format!("{PTX_SOURCE_HEADER}{:016x}", source_fingerprint(&source));
            if committed.lines().next() != Some(expected.as_str()) {
                println!(
                    "cargo:warning=stablebuf: {committed_path} is stale (does not match \
                     {source_path}); run scripts/regen-ptx"
                );
            }
            (committed, "committed".to_string())
        }
    };

    if write_committed {
        assert!(
            compiler != "committed",
            "STABLEBUF_WRITE_PTX=1 needs nvcc or NVRTC"
        );
        std::fs::write(committed_path, stamp(&source, &ptx))
            .unwrap_or_else(|e| panic!("write {committed_path}: {e}"));
        println!("cargo:warning=stablebuf: rewrote {committed_path} with {compiler}");
    }

    std::fs::write(out_dir.join(kernel.out_name), stamp(&source, &ptx))
        .expect("write PTX to OUT_DIR");
    println!("cargo:rustc-env={}={compiler}", kernel.compiler_env);
}

/// Puts the source fingerprint on the first line (replacing an existing stamp).
fn stamp(source: &str, ptx: &str) -> String {
    let body = match ptx.lines().next() {
        Some(first) if first.starts_with(PTX_SOURCE_HEADER) => {
            ptx[first.len()..].trim_start_matches('\n')
        }
        _ => ptx,
    };
    format!(
        "{PTX_SOURCE_HEADER}{:016x}\n{body}",
        source_fingerprint(source)
    )
}

fn nvcc(source_path: &str, out_dir: &Path) -> Result<(String, String), String> {
    let from_home = ["CUDA_HOME", "CUDA_PATH"]
        .iter()
        .filter_map(std::env::var_os)
        .map(|home| PathBuf::from(home).join("bin").join("nvcc"))
        .find(|p| p.is_file());
    let nvcc = from_home.unwrap_or_else(|| PathBuf::from("nvcc"));
    let version = Command::new(&nvcc)
        .arg("--version")
        .output()
        .map_err(|_| "nvcc not found".to_string())?;
    let version = String::from_utf8_lossy(&version.stdout);
    let release = version
        .lines()
        .find_map(|l| l.split("release ").nth(1))
        .map(|r| r.split(',').next().unwrap_or(r).to_string())
        .unwrap_or_else(|| "unknown".into());
    let stem = Path::new(source_path)
        .file_stem()
        .and_then(|s| s.to_str())
        .unwrap_or("kernels");
    let out = out_dir.join(format!("nvcc-{stem}.ptx"));
    // CUDA 13 dropped Volta: fall back to the oldest architecture this nvcc accepts.
    for arch in [ARCH, "compute_75"] {
        let status = Command::new(&nvcc)
            .args(["--ptx", "-O3", &format!("-arch={arch}"), "-o"])
            .arg(&out)
            .arg(source_path)
            .status()
            .map_err(|e| format!("nvcc failed to start: {e}"))?;
        if status.success() {
            let ptx = std::fs::read_to_string(&out).map_err(|e| e.to_string())?;
            return Ok((ptx, format!("nvcc {release} ({arch})")));
        }
    }
    Err(format!("nvcc could not compile {source_path}"))
}

fn nvrtc(source: &str) -> Result<(String, String), String> {
    // SAFETY: only probes whether the shared library can be opened.
    if !unsafe { cudarc::nvrtc::sys::is_culib_present() } {
        return Err(
            "libnvrtc not loadable (put the nvidia-cuda-nvrtc wheel's lib on LD_LIBRARY_PATH)"
                .into(),
        );
    }
    let (mut major, mut minor) = (0, 0);
    // SAFETY: nvrtcVersion writes two ints through valid pointers.
    let status = unsafe { cudarc::nvrtc::sys::nvrtcVersion(&mut major, &mut minor) };
    if status != cudarc::nvrtc::sys::nvrtcResult::NVRTC_SUCCESS {
        return Err(format!("nvrtcVersion: {status:?}"));
    }
    let opts = cudarc::nvrtc::CompileOptions {
        arch: Some(ARCH),
        options: vec!["-default-device".into(), "--std=c++14".into()],
        ..Default::default()
    };
    let ptx =
        cudarc::nvrtc::compile_ptx_with_opts(source, opts).map_err(|e| format!("NVRTC: {e}"))?;
    Ok((ptx.to_src(), format!("nvrtc {major}.{minor} ({ARCH})")))
}
