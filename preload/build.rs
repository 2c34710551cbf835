//! Writes the linker version script from the symbol table in `src/cuda/symbols.rs`: the cdylib
//! exports exactly those names and keeps everything else (Rust symbols, dependencies) local.

use std::fmt::Write as _;
use std::path::PathBuf;

#[allow(dead_code)]
mod symbols {
    include!("src/cuda/symbols.rs");
}

fn main() {
    println!("cargo:rerun-if-changed=src/cuda/symbols.rs");
    println!("cargo:rerun-if-changed=build.rs");
    let mut script = String::from("{\n  global:\n");
    for name in symbols::exported() {
        writeln!(script, "    {name};").expect("writing to a String");
    }
    script.push_str("  local:\n    *;\n};\n");
    let out = PathBuf::from(std::env::var_os("OUT_DIR").expect("cargo sets OUT_DIR"));
    let path = out.join("exports.map");
    std::fs::write(&path, script).expect("writing the version script");
    println!(
        "cargo:rustc-cdylib-link-arg=-Wl,--version-script={}",
        path.display()
    );
}
