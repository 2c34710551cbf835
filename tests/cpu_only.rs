//! Tests that need no GPU: they run in CI.

include!("../kernels/fingerprint.rs");

/// Each kernel source, its committed PTX, the PTX the crate was built with, and its compiler.
const KERNEL_FILES: [(&str, &str, &str, &str); 2] = [
    (
        "kernels/matmul.cu",
        "kernels/matmul.ptx",
        stablebuf::kernels::PTX,
        stablebuf::kernels::PTX_COMPILER,
    ),
    (
        "kernels/decode.cu",
        "kernels/decode.ptx",
        stablebuf::kernels::PTX_DECODE,
        stablebuf::kernels::PTX_DECODE_COMPILER,
    ),
];

#[test]
fn committed_ptx_matches_the_kernel_source() {
    for (source, committed, _, _) in KERNEL_FILES {
        let text = std::fs::read_to_string(source).unwrap();
        let ptx = std::fs::read_to_string(committed).unwrap();
        let expected = format!("{PTX_SOURCE_HEADER}{:016x}", source_fingerprint(&text));
        assert_eq!(
            ptx.lines().next(),
            Some(expected.as_str()),
            "{committed} is stale: run scripts/regen-ptx"
        );
    }
}

#[test]
fn built_ptx_equals_the_committed_ptx_when_built_by_the_same_nvrtc() {
    let version_of = |ptx: &str| {
        ptx.lines()
            .find(|l| l.contains("Cuda compilation tools"))
            .map(str::to_owned)
    };
    for (_, committed_path, built, compiler) in KERNEL_FILES {
        let committed = std::fs::read_to_string(committed_path).unwrap();
        eprintln!("{committed_path}: built by {compiler}");
        if compiler == "committed" || version_of(built) == version_of(&committed) {
            assert_eq!(built, committed, "{committed_path}: run scripts/regen-ptx");
        } else {
            // Another compiler (nvcc, another NVRTC) emits different text: check the same source.
            assert_eq!(
                built.lines().next(),
                committed.lines().next(),
                "{committed_path}"
            );
        }
    }
}

#[test]
fn ptx_has_every_kernel_the_launchers_load() {
    let entries: [(&str, &[&str]); 2] = [
        (
            stablebuf::kernels::PTX,
            &[
                "matmul_naive",
                "matmul_tiled",
                "matmul_regtile",
                "bias_act",
                "fill_f32",
                "spin_ns",
            ],
        ),
        (
            stablebuf::kernels::PTX_DECODE,
            &[
                "bias_act_bf16",
                "residual_add_bf16",
                "rms_norm_bf16",
                "fill_bf16",
                "fill_uniform_bf16",
                "convert_f32_to_bf16",
                "convert_bf16_to_f32",
                "partial_sums_bf16",
            ],
        ),
    ];
    for (ptx, names) in entries {
        for entry in names {
            assert!(ptx.contains(&format!(".entry {entry}(")), "{entry} missing");
        }
        assert!(
            ptx.contains(".target sm_70"),
            "PTX must JIT on any VMM-capable GPU"
        );
    }
}

#[test]
fn ci_builds_the_kernels_with_a_compiler_not_the_fallback() {
    if std::env::var_os("CI").is_some() {
        for (_, committed, _, compiler) in KERNEL_FILES {
            assert_ne!(
                compiler, "committed",
                ".ci/run must install NVRTC ({committed})"
            );
        }
    }
}

#[test]
fn opening_a_device_without_a_driver_is_a_typed_error() {
    match stablebuf::open_device(0) {
        Err(stablebuf::Error::Driver(stablebuf::error::DriverError::NoDriver)) => {
            assert!(!stablebuf::driver_present())
        }
        Ok(ctx) => assert!(stablebuf::driver_present() && ctx.ordinal() == 0),
        Err(other) => assert!(
            stablebuf::driver_present(),
            "unexpected error without a driver: {other}"
        ),
    }
}

#[test]
fn device_queries_without_a_driver_are_typed_errors() {
    if stablebuf::driver_present() {
        return; // a machine with a driver answers for real; the GPU suite covers it
    }
    assert!(matches!(
        stablebuf::device::device_count(),
        Err(stablebuf::Error::Driver(
            stablebuf::error::DriverError::NoDriver
        ))
    ));
    assert!(matches!(
        stablebuf::device::can_access_peer(0, 1),
        Err(stablebuf::Error::Driver(
            stablebuf::error::DriverError::NoDriver
        ))
    ));
}
