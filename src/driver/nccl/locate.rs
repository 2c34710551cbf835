//! Where libnccl is on this machine: the candidates, in the order they are tried. Pure logic
//! (no loading), so the order is tested without NCCL or a GPU.
//!
//! 1. `STABLEBUF_NCCL_LIBRARY`: a path to the library (or a folder holding it). When set, it is
//!    the only candidate: a user who names a library must not silently get another one.
//! 2. The loader's own search by name (`LD_LIBRARY_PATH`, RUNPATH, the ldconfig cache):
//!    `libnccl.so.2` (the soname every NCCL 2.x release and the pip wheels ship) and `libnccl.so`
//!    (the development link a system package adds).
//! 3. `lib/` of the pip `nvidia-nccl-cu12` / `nvidia-nccl-cu13` package of the active Python
//!    environment, asked of its interpreter (`$PYTHON`, else `$VIRTUAL_ENV/bin/python`, else
//!    `$CONDA_PREFIX/bin/python`, else `python3` on `PATH`): that is where PyTorch's NCCL is.
//! 4. `$CUDA_HOME/lib64` and `$CUDA_PATH/lib64` (NCCL installed beside a toolkit).

use std::path::{Path, PathBuf};
use std::process::Command;

/// The sonames tried, newest ABI first.
pub(crate) const NAMES: [&str; 2] = ["libnccl.so.2", "libnccl.so"];

/// One thing to hand to `dlopen`: a bare name (the loader searches) or a path.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(crate) enum Candidate {
    Name(&'static str),
    Path(PathBuf),
}

impl std::fmt::Display for Candidate {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Candidate::Name(name) => write!(f, "{name} (loader path)"),
            Candidate::Path(path) => write!(f, "{}", path.display()),
        }
    }
}

/// The environment the search reads, as values (so tests can give their own).
#[derive(Clone, Debug, Default)]
pub(crate) struct SearchEnv {
    pub(crate) override_path: Option<String>,
    pub(crate) python_package_dirs: Vec<PathBuf>,
    pub(crate) cuda_homes: Vec<String>,
}

impl SearchEnv {
    /// This process's environment. Runs the Python interpreter only when `ask_python` (the
    /// caller does that after loading by name failed: a subprocess is not free).
    pub(crate) fn current(ask_python: bool) -> Self {
        let var = |name: &str| std::env::var(name).ok().filter(|v| !v.is_empty());
        Self {
            override_path: var("STABLEBUF_NCCL_LIBRARY"),
            python_package_dirs: if ask_python {
                python_nccl_dirs()
            } else {
                Vec::new()
            },
            cuda_homes: ["CUDA_HOME", "CUDA_PATH"]
                .iter()
                .filter_map(|v| var(v))
                .collect(),
        }
    }
}

/// The candidates in order (see the module docs).
pub(crate) fn candidates(env: &SearchEnv) -> Vec<Candidate> {
    if let Some(path) = &env.override_path {
        let path = PathBuf::from(path);
        return if path.is_dir() {
            NAMES
                .iter()
                .map(|n| Candidate::Path(path.join(n)))
                .collect()
        } else {
            vec![Candidate::Path(path)]
        };
    }
    let mut list: Vec<Candidate> = NAMES.iter().map(|n| Candidate::Name(n)).collect();
    let folders = env
        .python_package_dirs
        .iter()
        .cloned()
        .chain(env.cuda_homes.iter().map(|h| Path::new(h).join("lib64")));
    for folder in folders {
        for name in NAMES {
            let candidate = Candidate::Path(folder.join(name));
            if !list.contains(&candidate) {
                list.push(candidate);
            }
        }
    }
    list
}

/// The interpreter of the active Python environment, as a user's shell would pick it.
fn python() -> String {
    let var = |name: &str| std::env::var(name).ok().filter(|v| !v.is_empty());
    if let Some(python) = var("PYTHON") {
        return python;
    }
    for (env, bin) in [
        ("VIRTUAL_ENV", "bin/python"),
        ("CONDA_PREFIX", "bin/python"),
    ] {
        if let Some(prefix) = var(env) {
            let path = Path::new(&prefix).join(bin);
            if path.exists() {
                return path.display().to_string();
            }
        }
    }
    "python3".into()
}

/// The `lib/` folders of the pip NCCL packages the active interpreter imports, found by asking
/// it (`importlib`, no import of the packages themselves). Empty when there is no Python.
fn python_nccl_dirs() -> Vec<PathBuf> {
    // nvidia-nccl-cu12/13 install the namespace package `nvidia.nccl` (lib/ inside); newer
    // CUDA 13 wheels may instead put every library under `nvidia/cu13/lib`.
    const PROBE: &str = "import importlib.util as u, os\n\
        for name, sub in (('nvidia.nccl', 'lib'), ('nvidia', os.path.join('cu13', 'lib'))):\n\
        \x20   try:\n\
        \x20       spec = u.find_spec(name)\n\
        \x20   except Exception:\n\
        \x20       continue\n\
        \x20   for root in (spec.submodule_search_locations or []) if spec else []:\n\
        \x20       print(os.path.join(root, sub))\n";
    let output = Command::new(python())
        .args(["-c", PROBE])
        .stdin(std::process::Stdio::null())
        .stderr(std::process::Stdio::null())
        .output();
    match output {
        Ok(out) if out.status.success() => String::from_utf8_lossy(&out.stdout)
            .lines()
            .map(PathBuf::from)
            .filter(|p| p.is_dir())
            .collect(),
        _ => Vec::new(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_loader_path_comes_first_then_python_then_cuda_home() {
        let env = SearchEnv {
            override_path: None,
            python_package_dirs: vec![PathBuf::from("/venv/nvidia/nccl/lib")],
            cuda_homes: vec!["/cuda".into()],
        };
        let got: Vec<String> = candidates(&env).iter().map(|c| c.to_string()).collect();
        assert_eq!(
            got,
            [
                "libnccl.so.2 (loader path)",
                "libnccl.so (loader path)",
                "/venv/nvidia/nccl/lib/libnccl.so.2",
                "/venv/nvidia/nccl/lib/libnccl.so",
                "/cuda/lib64/libnccl.so.2",
                "/cuda/lib64/libnccl.so",
            ]
        );
    }

    #[test]
    fn an_override_is_the_only_candidate() {
        let env = SearchEnv {
            override_path: Some("/x/libnccl.so.2.27.5".into()),
            python_package_dirs: vec![PathBuf::from("/venv/nvidia/nccl/lib")],
            cuda_homes: vec![],
        };
        assert_eq!(
            candidates(&env),
            [Candidate::Path("/x/libnccl.so.2.27.5".into())]
        );
        let dir = std::env::temp_dir();
        let env = SearchEnv {
            override_path: Some(dir.display().to_string()),
            ..SearchEnv::default()
        };
        assert_eq!(
            candidates(&env),
            [
                Candidate::Path(dir.join("libnccl.so.2")),
                Candidate::Path(dir.join("libnccl.so"))
            ]
        );
    }

    #[test]
    fn a_folder_found_twice_is_tried_once() {
        let env = SearchEnv {
            override_path: None,
            python_package_dirs: vec![PathBuf::from("/a"), PathBuf::from("/a")],
            cuda_homes: vec![],
        };
        assert_eq!(candidates(&env).len(), 4);
    }
}
