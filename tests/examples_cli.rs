//! The examples behave like command-line tools, checked on a machine without a GPU: each built
//! example binary answers `--help` (exit 0), refuses an unknown flag with a usage error (exit 2),
//! and, with no GPU, fails with the error's message and the "needs an NVIDIA GPU" hint, never a
//! panic or a `Debug` dump. Also tests the shared helpers of `examples/support`.
//!
//! The binaries are found beside this test's own: `target/<profile>/examples/` (plain
//! `cargo test` builds every example first) or `.bundle/examples/` in a GPU bundle.

#[path = "../examples/support/mod.rs"]
mod support;

use std::path::{Path, PathBuf};
use std::process::{Command, Output, Stdio};
use std::time::{Duration, Instant};

/// Every example binary, by name. Where the sources are at hand, every `examples/*.rs` (and
/// `examples/*/main.rs`) must have been built; otherwise (a bundle) every binary found counts.
fn examples() -> Vec<(String, PathBuf)> {
    let exe = std::env::current_exe().expect("the test's own path");
    let dir = exe
        .parent()
        .and_then(Path::parent)
        .expect("the test binary sits two levels below its build folder")
        .join("examples");
    let sources = Path::new(env!("CARGO_MANIFEST_DIR")).join("examples");
    let names: Vec<String> = if sources.is_dir() {
        std::fs::read_dir(&sources)
            .expect("read examples/")
            .map(|entry| entry.expect("a directory entry").path())
            .filter_map(|path| {
                let is_example =
                    path.extension().is_some_and(|e| e == "rs") || path.join("main.rs").is_file();
                let stem = path.file_stem()?.to_str()?.to_string();
                is_example.then_some(stem)
            })
            .collect()
    } else {
        std::fs::read_dir(&dir)
            .unwrap_or_else(|e| panic!("no example binaries in {}: {e}", dir.display()))
            .map(|entry| entry.expect("a directory entry").file_name())
            .filter_map(|name| name.to_str().map(str::to_string))
            // Cargo's hashed copies and dependency files have '-' or '.' in their names.
            .filter(|name| !name.contains('-') && !name.contains('.'))
            .collect()
    };
    assert!(!names.is_empty(), "no examples found");
    let optional = examples_with_required_features();
    let mut found: Vec<(String, PathBuf)> = names
        .into_iter()
        .filter_map(|name| {
            let binary = dir.join(&name);
            if !binary.is_file() && optional.contains(&name) {
                eprintln!("example `{name}` needs features this build lacks (skipped)");
                return None;
            }
            assert!(
                binary.is_file(),
                "example `{name}` is not built at {}: run `cargo build --examples` \
                 (plain `cargo test` builds them)",
                binary.display()
            );
            Some((name, binary))
        })
        .collect();
    found.sort();
    found
}

/// Examples that `Cargo.toml` builds only with some features (`[[example]]` tables with
/// `required-features`): without them they have no binary, and that is no failure.
fn examples_with_required_features() -> Vec<String> {
    let manifest = Path::new(env!("CARGO_MANIFEST_DIR")).join("Cargo.toml");
    let Ok(text) = std::fs::read_to_string(manifest) else {
        return Vec::new();
    };
    let mut optional = Vec::new();
    for table in text.split("[[example]]").skip(1) {
        let table = table.split("\n[").next().unwrap_or_default();
        let name = table.lines().find_map(|line| {
            let value = line.trim().strip_prefix("name")?.trim().strip_prefix('=')?;
            Some(value.trim().trim_matches('"').to_string())
        });
        if let Some(name) = name.filter(|_| table.contains("required-features")) {
            optional.push(name);
        }
    }
    optional
}

/// Runs `binary` with `args`, killing it after `limit`.
fn run(binary: &Path, args: &[&str], limit: Duration) -> Output {
    let mut child = Command::new(binary)
        .args(args)
        .env_remove("RUST_LOG")
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap_or_else(|e| panic!("start {}: {e}", binary.display()));
    let start = Instant::now();
    while child.try_wait().expect("wait for the example").is_none() {
        if start.elapsed() > limit {
            let _ = child.kill();
            panic!("{} {args:?} ran longer than {limit:?}", binary.display());
        }
        std::thread::sleep(Duration::from_millis(20));
    }
    child.wait_with_output().expect("collect the output")
}

fn text(output: &Output) -> String {
    format!(
        "{}{}",
        String::from_utf8_lossy(&output.stdout),
        String::from_utf8_lossy(&output.stderr)
    )
}

/// Signs that an error reached the user as something other than its message.
const DUMPS: [&str; 6] = [
    "panicked",
    "backtrace",
    "Error {",
    "Error: ",
    "NoDriver",
    "RUST_BACKTRACE",
];

#[test]
fn without_a_gpu_every_example_says_why_and_fails() {
    if stablebuf::driver_present() {
        eprintln!("a CUDA driver is present: the no-GPU path cannot be exercised here (skipped)");
        return;
    }
    let message = stablebuf::Error::Driver(stablebuf::error::DriverError::NoDriver).to_string();
    for (name, binary) in examples() {
        let output = run(&binary, &[], Duration::from_secs(60));
        let all = text(&output);
        let code = output.status.code();
        assert!(
            matches!(code, Some(c) if c != 0),
            "{name}: exit {code:?} without a GPU (wanted a non-zero exit code); output:\n{all}"
        );
        assert!(
            all.contains(&message),
            "{name}: the error's message `{message}` is missing; output:\n{all}"
        );
        assert!(
            all.contains(support::NEEDS_GPU),
            "{name}: the hint `{}` is missing; output:\n{all}",
            support::NEEDS_GPU
        );
        for dump in DUMPS {
            assert!(
                !all.contains(dump),
                "{name}: output has `{dump}` (a panic or a Debug dump); output:\n{all}"
            );
        }
    }
}

#[test]
fn every_example_answers_help() {
    for (name, binary) in examples() {
        let output = run(&binary, &["--help"], Duration::from_secs(30));
        let stdout = String::from_utf8_lossy(&output.stdout);
        assert_eq!(
            output.status.code(),
            Some(0),
            "{name} --help: {}",
            text(&output)
        );
        for wanted in ["Usage:", "--quiet", "--device"] {
            assert!(
                stdout.contains(wanted),
                "{name} --help lacks `{wanted}`:\n{stdout}"
            );
        }
    }
}

#[test]
fn every_example_refuses_an_unknown_flag_cleanly() {
    for (name, binary) in examples() {
        let output = run(&binary, &["--no-such-flag"], Duration::from_secs(30));
        let all = text(&output);
        assert_eq!(output.status.code(), Some(2), "{name}: {all}");
        assert!(
            all.contains("unexpected argument '--no-such-flag'"),
            "{name}: {all}"
        );
        assert!(!all.contains("panicked"), "{name}: {all}");
    }
}

#[test]
fn percentile_is_nearest_rank_on_sorted_values() {
    let values: Vec<f64> = (1..=100).rev().map(f64::from).collect(); // unsorted on purpose
    assert_eq!(support::percentile(&values, 0.0), 1.0);
    assert_eq!(support::percentile(&values, 0.5), 51.0); // index round(49.5) = 50
    assert_eq!(support::percentile(&values, 0.99), 99.0); // index round(98.01) = 98
    assert_eq!(support::percentile(&values, 1.0), 100.0);
    assert_eq!(support::percentile(&[7.5], 0.99), 7.5);
    assert!(support::percentile(&[], 0.5).is_nan());
    assert_eq!(values[0], 100.0, "the input is left as it was");
}

#[test]
fn tables_are_markdown_with_numbers_right_aligned() {
    let mut table = support::table(["approach", "µs"]);
    table.add_row(["copy-in".to_string(), "7.5".to_string()]);
    table.add_row(["rebind".to_string(), "123.0".to_string()]);
    let lines: Vec<String> = table.to_string().lines().map(str::to_string).collect();
    assert_eq!(lines.len(), 4, "header, rule, two rows:\n{table}");
    assert_eq!(lines[0], "| approach |    µs |");
    assert_eq!(lines[1], "|----------|-------|");
    assert_eq!(lines[2], "| copy-in  |   7.5 |");
    assert_eq!(lines[3], "| rebind   | 123.0 |");
}

#[test]
fn count_and_fraction_parsers_refuse_what_would_break_an_example() {
    let at_least_one = support::at_least(1);
    assert_eq!(at_least_one("3"), Ok(3));
    assert!(at_least_one("0").unwrap_err().contains("at least 1"));
    assert!(at_least_one("-1").is_err());
    assert!(at_least_one("many").is_err());
    assert_eq!(support::fraction("0.92"), Ok(0.92));
    assert_eq!(support::fraction("1"), Ok(1.0));
    for bad in ["0", "1.5", "-0.1", "NaN", "half"] {
        assert!(support::fraction(bad).is_err(), "{bad} was accepted");
    }
}
