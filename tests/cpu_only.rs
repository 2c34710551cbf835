//! Tests that need no GPU: they run in CI.

include!("../kernels/fingerprint.rs");

#[test]
fn committed_ptx_matches_the_kernel_source() {
    let source = std::fs::read_to_string("kernels/matmul.cu").unwrap();
    let committed = std::fs::read_to_string("kernels/matmul.ptx").unwrap();
    let expected = format!("{PTX_SOURCE_HEADER}{:016x}", source_fingerprint(&source));
    assert_eq!(
        committed.lines().next(),
        Some(expected.as_str()),
        "kernels/matmul.ptx is stale: run scripts/regen-ptx"
    );
}

#[test]
fn built_ptx_equals_the_committed_ptx_when_built_by_the_same_nvrtc() {
    let committed = std::fs::read_to_string("kernels/matmul.ptx").unwrap();
    let version_of = |ptx: &str| {
        ptx.lines()
            .find(|l| l.contains("Cuda compilation tools"))
            .map(str::to_owned)
    };
    let compiler = stablebuf::kernels::PTX_COMPILER;
    eprintln!("PTX compiled by: {compiler}");
    if compiler == "committed" || version_of(stablebuf::kernels::PTX) == version_of(&committed) {
        assert_eq!(stablebuf::kernels::PTX, committed, "run scripts/regen-ptx");
    } else {
        // Another compiler (nvcc, another NVRTC) emits different text: check the same source.
        assert_eq!(
            stablebuf::kernels::PTX.lines().next(),
            committed.lines().next()
        );
    }
}

#[test]
fn ptx_has_every_kernel_the_launchers_load() {
    for entry in [
        "matmul_naive",
        "matmul_tiled",
        "matmul_regtile",
        "bias_act",
        "fill_f32",
        "spin_ns",
    ] {
        assert!(
            stablebuf::kernels::PTX.contains(&format!(".entry {entry}(")),
            "{entry} missing"
        );
    }
    assert!(
        stablebuf::kernels::PTX.contains(".target sm_70"),
        "PTX must JIT on any VMM-capable GPU"
    );
}

#[test]
fn ci_builds_the_kernels_with_a_compiler_not_the_fallback() {
    if std::env::var_os("CI").is_some() {
        assert_ne!(
            stablebuf::kernels::PTX_COMPILER,
            "committed",
            ".ci/run must install NVRTC"
        );
    }
}

#[test]
fn opening_a_device_without_a_driver_is_a_typed_error() {
    match stablebuf::open_device(0) {
        Err(stablebuf::Error::NoDriver) => assert!(!stablebuf::driver_present()),
        Ok(ctx) => assert!(stablebuf::driver_present() && ctx.ordinal() == 0),
        Err(other) => assert!(
            stablebuf::driver_present(),
            "unexpected error without a driver: {other}"
        ),
    }
}
