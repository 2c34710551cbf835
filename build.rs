//! Compiles the kernel sources under `kernels/` to PTX, each of them trying in order:
//! 1. `nvcc` (from `CUDA_HOME`/`CUDA_PATH` or `PATH`),
//! 2. NVRTC (opened with `dlopen`), when libnvrtc loads (the `nvidia-cuda-nvrtc-cu12` wheel's `lib`
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

const KERNELS: [Kernel; 3] = [
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
    Kernel {
        source: "kernels/decode_attention.cu",
        committed: "kernels/decode_attention.ptx",
        out_name: "decode_attention.ptx",
        compiler_env: "STABLEBUF_PTX_ATTENTION_COMPILER",
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
    // The kernels are the `demo-kernels` feature's; the library itself launches none.
    if std::env::var_os("CARGO_FEATURE_DEMO_KERNELS").is_none() {
        return;
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
    let lib = nvrtc_ffi::Nvrtc::open().ok_or_else(|| {
        "libnvrtc not loadable (put the nvidia-cuda-nvrtc wheel's lib on LD_LIBRARY_PATH)"
            .to_string()
    })?;
    let (major, minor) = lib.version()?;
    let arch = format!("--gpu-architecture={ARCH}");
    let ptx = lib.compile(source, &[&arch, "-default-device", "--std=c++14"])?;
    Ok((ptx, format!("nvrtc {major}.{minor} ({ARCH})")))
}

/// NVRTC opened with `dlopen`, not through cudarc: a build-dependency on cudarc would receive
/// stablebuf's `cudarc/...` features (cargo applies them to every dependency of that name, and
/// refuses the same crate under two names), so `dynamic-linking` or a CUDA version chosen for
/// the library would reach the build script, which must load NVRTC dynamically in every mode.
mod nvrtc_ffi {
    use std::ffi::{c_char, c_int, c_void, CStr, CString};

    extern "C" {
        fn dlopen(filename: *const c_char, flags: c_int) -> *mut c_void;
        fn dlsym(handle: *mut c_void, symbol: *const c_char) -> *mut c_void;
    }
    const RTLD_NOW: c_int = 2;
    const SUCCESS: c_int = 0;

    type Program = *mut c_void;

    type Version = unsafe extern "C" fn(*mut c_int, *mut c_int) -> c_int;
    type Create = unsafe extern "C" fn(
        *mut Program,
        *const c_char,
        *const c_char,
        c_int,
        *const *const c_char,
        *const *const c_char,
    ) -> c_int;
    type Compile = unsafe extern "C" fn(Program, c_int, *const *const c_char) -> c_int;
    type Size = unsafe extern "C" fn(Program, *mut usize) -> c_int;
    type Read = unsafe extern "C" fn(Program, *mut c_char) -> c_int;
    type Destroy = unsafe extern "C" fn(*mut Program) -> c_int;

    /// The NVRTC entry points the build uses; the library stays loaded for the process.
    pub struct Nvrtc {
        version: Version,
        create: Create,
        compile: Compile,
        ptx_size: Size,
        ptx: Read,
        log_size: Size,
        log: Read,
        destroy: Destroy,
    }

    impl Nvrtc {
        /// The first of the names cudarc's 13.0 bindings try that loads.
        pub fn open() -> Option<Self> {
            let handle = ["libnvrtc.so", "libnvrtc.so.13", "libnvrtc.so.12"]
                .iter()
                .find_map(|name| {
                    let name = CString::new(*name).ok()?;
                    // SAFETY: a valid C string; dlopen returns null on failure.
                    let handle = unsafe { dlopen(name.as_ptr(), RTLD_NOW) };
                    (!handle.is_null()).then_some(handle)
                })?;
            let symbol = |name: &str| {
                let name = CString::new(name).ok()?;
                // SAFETY: `handle` is a live library handle and `name` a valid C string.
                let address = unsafe { dlsym(handle, name.as_ptr()) };
                (!address.is_null()).then_some(address)
            };
            // SAFETY: each address is the NVRTC function of that name, whose C signature
            // (nvrtc.h) the field's type matches; nvrtcResult is a C enum (int).
            unsafe {
                Some(Self {
                    version: std::mem::transmute::<*mut c_void, Version>(symbol("nvrtcVersion")?),
                    create: std::mem::transmute::<*mut c_void, Create>(symbol(
                        "nvrtcCreateProgram",
                    )?),
                    compile: std::mem::transmute::<*mut c_void, Compile>(symbol(
                        "nvrtcCompileProgram",
                    )?),
                    ptx_size: std::mem::transmute::<*mut c_void, Size>(symbol("nvrtcGetPTXSize")?),
                    ptx: std::mem::transmute::<*mut c_void, Read>(symbol("nvrtcGetPTX")?),
                    log_size: std::mem::transmute::<*mut c_void, Size>(symbol(
                        "nvrtcGetProgramLogSize",
                    )?),
                    log: std::mem::transmute::<*mut c_void, Read>(symbol("nvrtcGetProgramLog")?),
                    destroy: std::mem::transmute::<*mut c_void, Destroy>(symbol(
                        "nvrtcDestroyProgram",
                    )?),
                })
            }
        }

        pub fn version(&self) -> Result<(i32, i32), String> {
            let (mut major, mut minor) = (0, 0);
            // SAFETY: writes two ints through valid pointers.
            check("nvrtcVersion", unsafe {
                (self.version)(&mut major, &mut minor)
            })?;
            Ok((major, minor))
        }

        /// Compiles `source` with `options` and returns the PTX, or the error with NVRTC's log.
        pub fn compile(&self, source: &str, options: &[&str]) -> Result<String, String> {
            let source = CString::new(source).map_err(|e| e.to_string())?;
            let name = CString::new("matmul.cu").expect("no NUL");
            let options: Vec<CString> = options
                .iter()
                .map(|o| CString::new(*o).expect("no NUL in options"))
                .collect();
            let option_ptrs: Vec<*const c_char> = options.iter().map(|o| o.as_ptr()).collect();
            let mut program: Program = std::ptr::null_mut();
            // SAFETY: valid C strings that outlive the program; no headers.
            check("nvrtcCreateProgram", unsafe {
                (self.create)(
                    &mut program,
                    source.as_ptr(),
                    name.as_ptr(),
                    0,
                    std::ptr::null(),
                    std::ptr::null(),
                )
            })?;
            // SAFETY: `program` is live until destroyed below; the option pointers are valid.
            let outcome = unsafe {
                match (self.compile)(program, option_ptrs.len() as c_int, option_ptrs.as_ptr()) {
                    SUCCESS => self.text(program, self.ptx_size, self.ptx, "nvrtcGetPTX"),
                    status => {
                        let log = self
                            .text(program, self.log_size, self.log, "nvrtcGetProgramLog")
                            .unwrap_or_default();
                        Err(format!(
                            "NVRTC: nvrtcCompileProgram failed ({status}): {log}"
                        ))
                    }
                }
            };
            // SAFETY: `program` came from nvrtcCreateProgram and is destroyed once.
            unsafe { (self.destroy)(&mut program) };
            outcome
        }

        /// Reads a NUL-terminated text (PTX or log) of the size `size` reports.
        unsafe fn text(
            &self,
            program: Program,
            size: Size,
            read: Read,
            call: &str,
        ) -> Result<String, String> {
            let mut len = 0usize;
            check(call, size(program, &mut len))?;
            let mut buffer = vec![0u8; len.max(1)];
            check(call, read(program, buffer.as_mut_ptr().cast()))?;
            let text = CStr::from_bytes_until_nul(&buffer).map_err(|e| e.to_string())?;
            Ok(text.to_string_lossy().into_owned())
        }
    }

    fn check(call: &str, status: c_int) -> Result<(), String> {
        if status == SUCCESS {
            Ok(())
        } else {
            Err(format!("NVRTC: {call} returned {status}"))
        }
    }
}
