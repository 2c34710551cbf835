//! Tests of the built library itself (no GPU needed): what it exports, what it links, and how
//! it behaves when loaded into a process without CUDA.

use std::ffi::{c_char, c_int, c_void, CStr};
use std::path::{Path, PathBuf};
use std::process::Command;
use std::sync::OnceLock;

use stablebuf_preload::cuda::codes::{abi, cu, cuda};
use stablebuf_preload::cuda::symbols;
use stablebuf_preload::engine::stats::StablebufStats;

/// The cdylib cargo built next to this test (building it if it is missing).
fn library() -> PathBuf {
    static PATH: OnceLock<PathBuf> = OnceLock::new();
    PATH.get_or_init(|| {
        // target/<profile>/deps/cdylib-<hash> → target/<profile>/libstablebuf_preload.so
        let exe = std::env::current_exe().expect("test executable path");
        let profile_dir = exe
            .parent()
            .and_then(Path::parent)
            .expect("target/<profile>");
        // `cargo test` builds the cdylib beside its tests in deps/ (it uplifts it to the
        // profile folder only on `cargo build`); take either before building it again, since a
        // build of the preload crate alone resolves other features and recompiles the tree.
        let built_by_this_test_run = profile_dir.join("deps").join("libstablebuf_preload.so");
        if built_by_this_test_run.exists() {
            return built_by_this_test_run;
        }
        let path = profile_dir.join("libstablebuf_preload.so");
        if !path.exists() {
            let mut build = Command::new(env!("CARGO"));
            build.args(["build", "-p", "stablebuf-preload", "--lib"]);
            if profile_dir.ends_with("release") {
                build.arg("--release");
            }
            let status = build.status().expect("running cargo build");
            assert!(status.success(), "cargo build of the cdylib failed");
        }
        assert!(path.exists(), "{} not built", path.display());
        path
    })
    .clone()
}

fn tool(program: &str, args: &[&str]) -> String {
    let output = Command::new(program)
        .args(args)
        .output()
        .unwrap_or_else(|e| panic!("running {program} (binutils) failed: {e}"));
    assert!(output.status.success(), "{program} {args:?}: {output:?}");
    String::from_utf8(output.stdout).expect("UTF-8 output")
}

#[test]
fn exports_exactly_the_symbol_table() {
    let path = library();
    let listing = tool("nm", &["-D", "--defined-only", path.to_str().unwrap()]);
    let mut exported: Vec<&str> = listing
        .lines()
        .filter_map(|line| line.split_whitespace().nth(2))
        .collect();
    exported.sort_unstable();
    let mut expected: Vec<&str> = symbols::exported().collect();
    expected.sort_unstable();
    assert_eq!(
        exported, expected,
        "nm -D --defined-only differs from src/cuda/symbols.rs"
    );
    assert!(
        !exported
            .iter()
            .any(|s| s.starts_with("_ZN") || s.starts_with("_R")),
        "Rust symbols leak"
    );
}

#[test]
fn links_no_cuda_library() {
    let path = library();
    let dynamic = tool("readelf", &["-d", path.to_str().unwrap()]);
    let needed: Vec<&str> = dynamic.lines().filter(|l| l.contains("(NEEDED)")).collect();
    assert!(
        !needed.is_empty(),
        "readelf shows no NEEDED entries at all: {dynamic}"
    );
    for line in needed {
        assert!(
            !line.contains("libcuda") && !line.contains("libcudart"),
            "a link-time CUDA dependency makes the loader exit 127 where it is not found: {line}"
        );
    }
}

/// The library loaded with `dlopen` into this (CUDA-less) test process.
struct Loaded(*mut c_void);

// SAFETY: a dlopen handle is a process-wide token.
unsafe impl Send for Loaded {}
// SAFETY: as above.
unsafe impl Sync for Loaded {}

fn loaded() -> &'static Loaded {
    static HANDLE: OnceLock<Loaded> = OnceLock::new();
    HANDLE.get_or_init(|| {
        let path = std::ffi::CString::new(library().to_str().unwrap()).unwrap();
        // SAFETY: dlopen of our own library; its constructor only reads the environment.
        let handle = unsafe { libc::dlopen(path.as_ptr(), libc::RTLD_NOW | libc::RTLD_LOCAL) };
        assert!(!handle.is_null(), "dlopen failed");
        Loaded(handle)
    })
}

/// The library's function `name`, as the function type `F`.
fn function<F: Copy>(name: &CStr) -> F {
    // SAFETY: dlsym on a handle that is never closed.
    let found = unsafe { libc::dlsym(loaded().0, name.as_ptr()) };
    assert!(!found.is_null(), "{name:?} not exported");
    assert_eq!(std::mem::size_of::<F>(), std::mem::size_of::<*mut c_void>());
    // SAFETY: `F` is the function pointer type of the C prototype of `name` (the header).
    unsafe { std::mem::transmute_copy::<*mut c_void, F>(&found) }
}

type SetTag = unsafe extern "C" fn(*const c_char) -> c_int;
type Pause = unsafe extern "C" fn(*const c_char, c_int) -> c_int;
type Resume = unsafe extern "C" fn(*const c_char) -> c_int;
type Stats = unsafe extern "C" fn(*mut StablebufStats) -> c_int;
type ErrorString = unsafe extern "C" fn(c_int) -> *const c_char;
type Malloc = unsafe extern "C" fn(*mut *mut c_void, usize) -> c_int;
type MemAlloc = unsafe extern "C" fn(*mut u64, usize) -> c_int;
type MemGetInfo = unsafe extern "C" fn(*mut usize, *mut usize) -> c_int;

fn stats() -> StablebufStats {
    let get: Stats = function(c"stablebuf_stats");
    let mut stats = StablebufStats {
        size: std::mem::size_of::<StablebufStats>() as u64,
        ..StablebufStats::default()
    };
    // SAFETY: a full-size struct with its size set.
    assert_eq!(unsafe { get(&mut stats) }, abi::OK);
    stats
}

#[test]
fn the_c_abi_answers_without_a_gpu() {
    let set_tag: SetTag = function(c"stablebuf_set_tag");
    let pause: Pause = function(c"stablebuf_pause");
    let resume: Resume = function(c"stablebuf_resume");
    let error_string: ErrorString = function(c"stablebuf_error_string");
    // SAFETY: the prototypes of the header, with valid C strings and pointers to live locals.
    unsafe {
        assert_eq!(set_tag(c"abi-test".as_ptr()), abi::OK);
        assert_eq!(
            set_tag(c"\xff\xfe".as_ptr()),
            abi::INVALID_ARGUMENT,
            "not UTF-8"
        );
        assert_eq!(set_tag(std::ptr::null()), abi::OK, "NULL clears the tag");
        assert_eq!(pause(c"never-set".as_ptr(), 1), abi::UNKNOWN_TAG);
        assert_eq!(resume(c"never-set".as_ptr()), abi::UNKNOWN_TAG);
        // A known tag with no memory anywhere: pausing and resuming do nothing, twice.
        assert_eq!(pause(c"abi-test".as_ptr(), 1), abi::OK);
        assert_eq!(pause(c"abi-test".as_ptr(), 1), abi::OK);
        assert_eq!(resume(c"abi-test".as_ptr()), abi::OK);
        assert_eq!(resume(c"abi-test".as_ptr()), abi::OK);
        let text = CStr::from_ptr(error_string(abi::UNKNOWN_TAG))
            .to_str()
            .unwrap();
        assert!(text.contains("stablebuf_set_tag"), "{text}");
    }
    let stats = stats();
    assert_eq!(stats.size, std::mem::size_of::<StablebufStats>() as u64);
    assert_eq!(stats.abi_version, 2);
    assert_eq!(stats.mode, 2, "vmm is the default mode");
    assert!(stats.tags >= 1);
}

#[test]
fn an_older_shorter_stats_struct_gets_only_its_fields() {
    let get: Stats = function(c"stablebuf_stats");
    let mut buffer = [u64::MAX; 4];
    buffer[0] = 16; // size + abi_version only
                    // SAFETY: the buffer holds 32 bytes and declares 16.
    assert_eq!(unsafe { get(buffer.as_mut_ptr().cast()) }, abi::OK);
    assert_eq!(buffer[0], 16);
    assert_eq!(buffer[1], 2, "abi_version");
    assert_eq!(
        buffer[2],
        u64::MAX,
        "nothing written past the declared size"
    );
    buffer[0] = 4;
    // SAFETY: as above.
    let refused = unsafe { get(buffer.as_mut_ptr().cast()) };
    assert_eq!(refused, abi::INVALID_ARGUMENT);
    // SAFETY: NULL is refused, not dereferenced.
    assert_eq!(unsafe { get(std::ptr::null_mut()) }, abi::INVALID_ARGUMENT);
}

#[test]
fn hooks_without_cuda_return_errors_instead_of_crashing() {
    let malloc: Malloc = function(c"cudaMalloc");
    let mem_alloc: MemAlloc = function(c"cuMemAlloc_v2");
    let get_info: MemGetInfo = function(c"cudaMemGetInfo");
    let mut ptr: *mut c_void = std::ptr::null_mut();
    let mut device: u64 = 0;
    // SAFETY: the CUDA prototypes, with pointers to live locals or NULL where CUDA allows it.
    unsafe {
        assert_eq!(
            malloc(&mut ptr, 1 << 20),
            cuda::SHARED_OBJECT_SYMBOL_NOT_FOUND
        );
        assert_eq!(
            mem_alloc(&mut device, 1 << 20),
            cu::SHARED_OBJECT_SYMBOL_NOT_FOUND
        );
        assert_eq!(
            get_info(std::ptr::null_mut(), std::ptr::null_mut()),
            cuda::SHARED_OBJECT_SYMBOL_NOT_FOUND
        );
    }
    assert!(ptr.is_null() && device == 0, "nothing written on failure");
}

#[test]
fn a_child_after_fork_leaves_the_parents_state_alone() {
    let pause: Pause = function(c"stablebuf_pause");
    let get: Stats = function(c"stablebuf_stats");
    // SAFETY: the child calls only async-signal-tolerant code of the layer (no lock is held by
    // this test's other threads on the loaded copy's state at this point) and leaves with
    // _exit; the parent waits for it.
    unsafe {
        match libc::fork() {
            -1 => panic!("fork failed"),
            0 => {
                let mut stats = StablebufStats {
                    size: std::mem::size_of::<StablebufStats>() as u64,
                    ..StablebufStats::default()
                };
                let ok = get(&mut stats) == abi::OK
                    && stats.mode == 0
                    && pause(std::ptr::null(), 1) == abi::FORKED;
                libc::_exit(if ok { 0 } else { 1 });
            }
            child => {
                let mut status = 0;
                assert_eq!(libc::waitpid(child, &mut status, 0), child);
                assert!(libc::WIFEXITED(status));
                assert_eq!(
                    libc::WEXITSTATUS(status),
                    0,
                    "the child saw the parent's pool"
                );
            }
        }
    }
}

#[test]
fn preloading_into_a_program_without_cuda_is_harmless() {
    let path = library();
    let output = Command::new("sh")
        .args(["-c", "echo running"])
        .env("LD_PRELOAD", &path)
        .env("STABLEBUF_PRELOAD_HELP", "1")
        .env("STABLEBUF_PRELOAD_MODE", "monitor")
        .env("STABLEBUF_PRELOAD_BUDGET", "lots")
        .output()
        .expect("running sh");
    assert!(output.status.success(), "{output:?}");
    assert_eq!(String::from_utf8_lossy(&output.stdout).trim(), "running");
    let stderr = String::from_utf8_lossy(&output.stderr);
    for variable in stablebuf_preload::hooks::env::VARIABLES {
        assert!(
            stderr.contains(variable.name),
            "help lacks {}:\n{stderr}",
            variable.name
        );
    }
    assert!(
        stderr.contains("STABLEBUF_PRELOAD_BUDGET=\"lots\" is not a size"),
        "a bad value is reported: {stderr}"
    );
    assert!(
        !stderr.contains("stablebuf-preload monitor:"),
        "no summary when nothing happened"
    );
}

#[test]
fn nccl_hooks_without_libnccl_answer_system_error() {
    type Register =
        unsafe extern "C" fn(*mut c_void, *mut c_void, usize, *mut *mut c_void) -> c_int;
    type Deregister = unsafe extern "C" fn(*mut c_void, *mut c_void) -> c_int;
    let register: Register = function(c"ncclCommRegister");
    let deregister: Deregister = function(c"ncclCommDeregister");
    let mut handle: *mut c_void = std::ptr::null_mut();
    // SAFETY: the NCCL prototypes; no libnccl is loaded, so nothing is dereferenced but the
    // out-pointer to a live local.
    unsafe {
        assert_eq!(
            register(0xc000 as _, 0x1000 as _, 64, &mut handle),
            2,
            "ncclSystemError"
        );
        assert_eq!(deregister(0xc000 as _, 0x15 as _), 2);
    }
    assert!(handle.is_null());
}

/// A fake libnccl (soname libnccl.so.2) that prints each call, and a program linked with it,
/// built with `cc`; `None` (the test says so and passes) where no C compiler is found.
fn fake_nccl_program() -> Option<PathBuf> {
    let dir = std::env::temp_dir().join(format!("stablebuf-fake-nccl-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let lib_c = dir.join("fake_nccl.c");
    std::fs::write(
        &lib_c,
        r#"#include <stdio.h>
#include <stdint.h>
int ncclCommRegister(void *comm, void *buff, size_t size, void **handle) {
    printf("real register %p %p %zu\n", comm, buff, size);
    *handle = (void *)0x5500; return 0;
}
int ncclCommDeregister(void *comm, void *handle) { printf("real deregister %p %p\n", comm, handle); return 0; }
int ncclCommDestroy(void *comm) { printf("real destroy %p\n", comm); return 0; }
int ncclCommAbort(void *comm) { printf("real abort %p\n", comm); return 0; }
"#,
    )
    .unwrap();
    let main_c = dir.join("main.c");
    std::fs::write(
        &main_c,
        r#"#include <stdio.h>
#include <stdlib.h>
int ncclCommRegister(void *, void *, size_t, void **);
int ncclCommDeregister(void *, void *);
int ncclCommDestroy(void *);
int ncclCommAbort(void *);
int main(void) {
    void *comm = (void *)0xc000, *handle = NULL;
    int rc = ncclCommRegister(comm, (void *)0x1000, 64, &handle);
    printf("register rc %d handle %p\n", rc, handle);
    printf("deregister rc %d\n", ncclCommDeregister(comm, handle));
    printf("stale proxy rc %d\n", ncclCommDeregister(comm, (void *)0x15));
    printf("destroy rc %d\n", ncclCommDestroy(comm));
    printf("abort rc %d\n", ncclCommAbort((void *)0xc100));
    const char *graph = getenv("NCCL_GRAPH_REGISTER");
    printf("NCCL_GRAPH_REGISTER %s\n", graph ? graph : "(unset)");
    return 0;
}
"#,
    )
    .unwrap();
    let lib = dir.join("libnccl.so.2");
    let program = dir.join("main");
    let built = Command::new("cc")
        .args(["-shared", "-fPIC", "-Wl,-soname,libnccl.so.2", "-o"])
        .arg(&lib)
        .arg(&lib_c)
        .status();
    match built {
        Ok(status) => assert!(status.success(), "cc of the fake libnccl failed"),
        Err(error) => {
            eprintln!("no C compiler ({error}): the fake-libnccl test is skipped");
            return None;
        }
    }
    let status = Command::new("cc")
        .arg("-o")
        .arg(&program)
        .arg(&main_c)
        .arg(&lib)
        .arg(format!("-Wl,-rpath,{}", dir.display()))
        .status()
        .expect("cc");
    assert!(status.success(), "cc of the program failed");
    Some(program)
}

#[test]
fn nccl_calls_of_a_program_reach_the_hooks_and_pass_through_outside_tagged_memory() {
    let Some(program) = fake_nccl_program() else {
        return;
    };
    let run = |mode: &str, graph: Option<&str>| {
        let mut command = Command::new(&program);
        command
            .env("LD_PRELOAD", library())
            .env("STABLEBUF_PRELOAD_MODE", mode)
            .env_remove("NCCL_GRAPH_REGISTER");
        if let Some(value) = graph {
            command.env("NCCL_GRAPH_REGISTER", value);
        }
        let output = command.output().expect("running the program");
        assert!(output.status.success(), "{output:?}");
        (
            String::from_utf8_lossy(&output.stdout).into_owned(),
            String::from_utf8_lossy(&output.stderr).into_owned(),
        )
    };
    let (stdout, stderr) = run("vmm", None);
    // Memory that is not the layer's: NCCL's own handle, and every call reaches the real one.
    for line in [
        "real register 0xc000 0x1000 64",
        "register rc 0 handle 0x5500",
        "real deregister 0xc000 0x5500",
        "deregister rc 0",
        "stale proxy rc 4",
        "real destroy 0xc000",
        "destroy rc 0",
        "real abort 0xc100",
        "abort rc 0",
        "NCCL_GRAPH_REGISTER 0",
    ] {
        assert!(
            stdout.contains(line),
            "{line:?} missing:\n{stdout}\n{stderr}"
        );
    }
    assert!(
        !stdout.contains("real deregister 0xc000 0x15"),
        "a proxy handle never reaches NCCL:\n{stdout}"
    );
    assert!(
        stderr.contains("set NCCL_GRAPH_REGISTER=0"),
        "the notice says so: {stderr}"
    );
    let (stdout, stderr) = run("vmm", Some("1"));
    assert!(
        stdout.contains("NCCL_GRAPH_REGISTER 1"),
        "the user's value: {stdout}"
    );
    assert!(!stderr.contains("NCCL_GRAPH_REGISTER=0"), "{stderr}");
    let (stdout, _) = run("monitor", None);
    assert!(
        stdout.contains("NCCL_GRAPH_REGISTER (unset)"),
        "only vmm sets it: {stdout}"
    );
    assert!(stdout.contains("register rc 0 handle 0x5500"));
    if let Some(dir) = program.parent() {
        let _ = std::fs::remove_dir_all(dir);
    }
}
