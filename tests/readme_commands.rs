//! The READMEs never name something that is not there. Every command, path, example, flag and
//! picture that `README.md`, `python/README.md` and `preload/README.md` show (in shell code
//! blocks, in inline code and in links) is checked against the repository:
//!
//! - `cargo run --example X` / `--test X` / `--bench X`: the target's source exists (or a
//!   `[[example]]`/`[[test]]`/`[[bench]]` table names it); `-p CRATE`: a workspace crate;
//! - `cargo run --example X -- --flag`: `--flag` is one of X's clap arguments (or a flag every
//!   example takes, from `examples/support`);
//! - paths (`scripts/test`, `python/examples/weight_swap.py`, `demo/run-gpu.sh` beside the
//!   preload README, `kernels/*.ptx`): they exist, relative to the README or to the root;
//! - a script run with `--flags` (`.bundle/run --demos`, whose runner `scripts/gpu-bundle`
//!   writes): the script's text handles each flag;
//! - links and images (`![..](docs/x.svg)`): the file exists.
//!
//! The unit tests at the bottom feed a synthetic README with one of each mistake and expect each
//! to be reported, so the checker cannot pass by checking nothing.

use std::collections::BTreeSet;
use std::path::{Path, PathBuf};

/// The READMEs a newcomer reads, relative to the repository root.
const READMES: [&str; 3] = ["README.md", "python/README.md", "preload/README.md"];

/// Fenced block languages whose lines are commands.
const SHELL_LANGUAGES: [&str; 5] = ["", "sh", "bash", "shell", "console"];

/// File endings that mark a token as a path even when its first folder is unknown.
const FILE_ENDINGS: [&str; 12] = [
    ".rs", ".sh", ".py", ".md", ".cu", ".h", ".svg", ".toml", ".csv", ".ptx", ".json", ".txt",
];

/// What a README shows in code: one command line (from a shell block or an inline span).
#[derive(Debug)]
struct Snippet {
    line: usize,
    text: String,
}

/// A README's code and links, split out of its Markdown.
#[derive(Debug, Default)]
struct Parsed {
    commands: Vec<Snippet>,
    links: Vec<Snippet>,
}

fn parse(markdown: &str) -> Parsed {
    let mut parsed = Parsed::default();
    let mut fence: Option<String> = None;
    for (index, line) in markdown.lines().enumerate() {
        let number = index + 1;
        let trimmed = line.trim_start();
        if let Some(rest) = trimmed.strip_prefix("```") {
            fence = match fence {
                Some(_) => None,
                None => Some(rest.trim().to_lowercase()),
            };
            continue;
        }
        if let Some(language) = &fence {
            if SHELL_LANGUAGES.contains(&language.as_str()) {
                let command = line.split(" #").next().unwrap_or_default().trim();
                if !command.is_empty() && !command.starts_with('#') {
                    parsed.commands.push(Snippet {
                        line: number,
                        text: command.to_string(),
                    });
                }
            }
            continue;
        }
        // Outside code blocks: inline code spans are commands or paths; the rest may hold links.
        let mut prose = String::new();
        for (i, part) in line.split('`').enumerate() {
            if i % 2 == 1 {
                parsed.commands.push(Snippet {
                    line: number,
                    text: part.to_string(),
                });
            } else {
                prose.push_str(part);
                prose.push(' ');
            }
        }
        let mut rest = prose.as_str();
        while let Some(at) = rest.find("](") {
            let after = &rest[at + 2..];
            let Some(end) = after.find(')') else { break };
            parsed.links.push(Snippet {
                line: number,
                text: after[..end].trim().to_string(),
            });
            rest = &after[end..];
        }
    }
    parsed
}

/// The repository as the checker sees it: files, the workspace's crates and targets.
struct Repo {
    root: PathBuf,
    crates: BTreeSet<String>,
    /// `[[example]]`, `[[test]]`, `[[bench]]` names declared in the manifests.
    declared: BTreeSet<(String, String)>,
}

impl Repo {
    fn open(root: &Path) -> Repo {
        let mut crates = BTreeSet::new();
        let mut declared = BTreeSet::new();
        for manifest in ["Cargo.toml", "preload/Cargo.toml", "python/Cargo.toml"] {
            let Ok(text) = std::fs::read_to_string(root.join(manifest)) else {
                continue;
            };
            let mut table = String::new();
            for line in text.lines() {
                let line = line.trim();
                if line.starts_with('[') {
                    table = line.trim_matches(|c| c == '[' || c == ']').to_string();
                } else if let Some(value) = line.strip_prefix("name =") {
                    let name = value.trim().trim_matches('"').to_string();
                    match table.as_str() {
                        "package" => {
                            crates.insert(name);
                        }
                        "example" | "test" | "bench" => {
                            declared.insert((table.clone(), name));
                        }
                        _ => {}
                    }
                }
            }
        }
        if let Ok(text) = std::fs::read_to_string(root.join("tools/plots/Cargo.toml")) {
            if text.contains("name = \"stablebuf-plots\"") {
                crates.insert("stablebuf-plots".into());
            }
        }
        Repo {
            root: root.to_path_buf(),
            crates,
            declared,
        }
    }

    /// Whether `path` (which may end in a `*` pattern in its last part) names something, tried
    /// beside the README first, then from the root.
    fn find(&self, readme_dir: &Path, path: &str) -> Option<PathBuf> {
        let path = path.trim_end_matches('/');
        for base in [self.root.join(readme_dir), self.root.clone()] {
            let candidate = base.join(path);
            let name = candidate.file_name()?.to_str()?.to_string();
            if let Some((prefix, suffix)) = name.split_once('*') {
                let folder = candidate.parent()?;
                let matched = std::fs::read_dir(folder).ok()?.flatten().any(|entry| {
                    let entry = entry.file_name();
                    let entry = entry.to_string_lossy();
                    entry.starts_with(prefix) && entry.ends_with(suffix)
                });
                if matched {
                    return Some(candidate);
                }
            } else if candidate.exists() {
                return Some(candidate);
            }
        }
        None
    }

    /// The source of a cargo target of `kind` ("example", "test", "bench") named `name`.
    fn target(&self, kind: &str, name: &str) -> Option<PathBuf> {
        let folder = match kind {
            "example" => "examples",
            "test" => "tests",
            _ => "benches",
        };
        let single = self.root.join(folder).join(format!("{name}.rs"));
        let nested = self.root.join(folder).join(name).join("main.rs");
        if single.is_file() {
            Some(single)
        } else if nested.is_file() {
            Some(nested)
        } else if self
            .declared
            .contains(&(kind.to_string(), name.to_string()))
        {
            Some(self.root.join("Cargo.toml"))
        } else {
            None
        }
    }

    fn read(&self, path: &Path) -> String {
        std::fs::read_to_string(path).unwrap_or_default()
    }
}

/// Whether an example's clap definition (or the flags every example shares) takes `--flag`.
fn example_takes(repo: &Repo, source: &Path, flag: &str) -> bool {
    if matches!(flag, "--help" | "-h" | "--version" | "-V") {
        return true;
    }
    let name = flag.trim_start_matches('-');
    let field = format!("{}:", name.replace('-', "_"));
    let long = format!("long = \"{name}\"");
    let shared = repo.read(&repo.root.join("examples/support/mod.rs"));
    [repo.read(source), shared]
        .iter()
        .any(|text| text.contains("#[arg(") && (text.contains(&field) || text.contains(&long)))
}

/// A token that looks like a path in the repository: relative, and either its first folder is
/// one the root or the README's folder has, or it ends like a file.
fn looks_like_path(repo: &Repo, readme_dir: &Path, token: &str) -> bool {
    if token.starts_with('/')
        || token.starts_with('$')
        || token.starts_with('-')
        || token.contains("://")
        || token.contains('<')
        || token.contains('=')
        || token.contains("...")
        || token.contains('%')
        || !token.contains('/')
    {
        return false;
    }
    let first = token
        .split('/')
        .find(|part| *part != ".")
        .unwrap_or_default();
    // Generated by the build, not part of the repository.
    if matches!(first, ".bundle" | ".tools" | "target" | ".gpu-out" | "dist") {
        return false;
    }
    let known = !first.is_empty()
        && (repo.root.join(first).exists() || repo.root.join(readme_dir).join(first).exists());
    known || FILE_ENDINGS.iter().any(|ending| token.ends_with(ending))
}

/// The tokens of one command line, without quotes and brackets; `&&`, `;` and `|` split it.
fn commands_of(text: &str) -> Vec<Vec<String>> {
    let mut commands = vec![Vec::new()];
    for raw in text.split_whitespace() {
        if matches!(raw, "&&" | ";" | "|" | "||") {
            commands.push(Vec::new());
            continue;
        }
        let token = raw.trim_matches(|c: char| "[]()\"',:;".contains(c));
        if !token.is_empty() {
            commands
                .last_mut()
                .expect("never empty")
                .push(token.to_string());
        }
    }
    commands.retain(|c| !c.is_empty());
    commands
}

fn check_cargo(repo: &Repo, tokens: &[String], problems: &mut Vec<String>) {
    let separator = tokens.iter().position(|t| t == "--");
    let cargo_part = &tokens[..separator.unwrap_or(tokens.len())];
    let mut example_source = None;
    for pair in cargo_part.windows(2) {
        let (flag, value) = (pair[0].as_str(), pair[1].as_str());
        let kind = match flag {
            "--example" => "example",
            "--test" => "test",
            "--bench" => "bench",
            "-p" | "--package" => {
                if !repo.crates.contains(value) {
                    problems.push(format!("`-p {value}`: no such crate in the workspace"));
                }
                continue;
            }
            _ => continue,
        };
        match repo.target(kind, value) {
            Some(source) => {
                if kind == "example" {
                    example_source = Some(source);
                }
            }
            None => problems.push(format!("`--{kind} {value}`: no such {kind}")),
        }
    }
    // Flags after `--` of `cargo run --example X` are the example's own.
    if let (Some(source), Some(at)) = (example_source, separator) {
        if tokens.get(1).is_some_and(|sub| sub == "run") {
            for flag in tokens[at + 1..].iter().filter(|t| t.starts_with('-')) {
                let flag = flag.split('=').next().unwrap_or_default();
                if !example_takes(repo, &source, flag) {
                    problems.push(format!(
                        "`{flag}`: not an argument of {}",
                        source.strip_prefix(&repo.root).unwrap_or(&source).display()
                    ));
                }
            }
        }
    }
}

/// Every problem of one README's text, as "file:line: what".
fn problems_in(repo: &Repo, readme: &str, markdown: &str) -> Vec<String> {
    let readme_dir = Path::new(readme).parent().unwrap_or(Path::new(""));
    let parsed = parse(markdown);
    let mut problems = Vec::new();
    for snippet in &parsed.commands {
        let mut found = Vec::new();
        for tokens in commands_of(&snippet.text) {
            // Leading VAR=value assignments set the environment, they are not the program.
            let start = tokens
                .iter()
                .position(|t| !t.contains('=') || t.starts_with('-'))
                .unwrap_or(tokens.len());
            let tokens = &tokens[start..];
            let Some(program) = tokens.first() else {
                continue;
            };
            if program == "cargo" {
                check_cargo(repo, tokens, &mut found);
            }
            // `python -m stablebuf...`: the package's module must exist.
            if ["python", "python3"].contains(&program.as_str()) {
                if let Some(module) = tokens
                    .iter()
                    .position(|t| t == "-m")
                    .and_then(|at| tokens.get(at + 1))
                    .filter(|m| m.starts_with("stablebuf"))
                {
                    let path = module.replace('.', "/");
                    let main = format!("python/{path}/__main__.py");
                    let single = format!("python/{path}.py");
                    if repo.find(readme_dir, &main).is_none()
                        && repo.find(readme_dir, &single).is_none()
                    {
                        found.push(format!("`python -m {module}`: no {main} or {single}"));
                    }
                }
            }
            // A script of the repository run with flags: its text must handle each of them.
            // `.bundle/run` is written by scripts/gpu-bundle.
            let script = if program == ".bundle/run" {
                repo.find(readme_dir, "scripts/gpu-bundle")
            } else if ["python", "python3"].contains(&program.as_str()) {
                tokens
                    .get(1)
                    .filter(|t| t.ends_with(".py"))
                    .and_then(|t| repo.find(readme_dir, t))
                    .or_else(|| {
                        let module = tokens.iter().position(|t| t == "-m")?;
                        let name = tokens.get(module + 1)?.replace('.', "/");
                        repo.find(readme_dir, &format!("python/{name}/__main__.py"))
                            .or_else(|| repo.find(readme_dir, &format!("python/{name}.py")))
                    })
            } else if looks_like_path(repo, readme_dir, program) {
                repo.find(readme_dir, program)
            } else {
                None
            };
            if let Some(script) = script.filter(|s| s.is_file()) {
                let text = repo.read(&script);
                for flag in tokens[1..].iter().filter(|t| t.starts_with("--")) {
                    let flag = flag.split('=').next().unwrap_or_default();
                    if flag != "--" && !text.contains(flag) {
                        found.push(format!(
                            "`{flag}`: {} does not handle it",
                            script.strip_prefix(&repo.root).unwrap_or(&script).display()
                        ));
                    }
                }
            }
            for token in tokens {
                if looks_like_path(repo, readme_dir, token)
                    && repo.find(readme_dir, token).is_none()
                {
                    found.push(format!("`{token}`: no such file or folder"));
                }
            }
        }
        for what in found {
            problems.push(format!("{readme}:{}: {what}", snippet.line));
        }
    }
    for link in &parsed.links {
        let target = link.text.split('#').next().unwrap_or_default();
        let target = target.split_whitespace().next().unwrap_or_default();
        if target.is_empty() || target.contains("://") || target.starts_with("mailto:") {
            continue;
        }
        if repo.find(readme_dir, target).is_none() {
            problems.push(format!(
                "{readme}:{}: link to `{target}`: no such file",
                link.line
            ));
        }
    }
    problems
}

/// The repository: where this test was built, or, for a binary carried to another machine in a
/// GPU bundle (`.bundle/run` runs from the repository root there), the current folder.
fn root() -> PathBuf {
    let built = PathBuf::from(env!("CARGO_MANIFEST_DIR"));
    if built.join("README.md").is_file() {
        return built;
    }
    std::env::current_dir().expect("the current folder")
}

#[test]
fn every_command_path_example_and_flag_the_readmes_name_exists() {
    let repo = Repo::open(&root());
    let mut problems = Vec::new();
    let mut commands = 0;
    for readme in READMES {
        let markdown = std::fs::read_to_string(root().join(readme))
            .unwrap_or_else(|e| panic!("read {readme}: {e}"));
        commands += parse(&markdown).commands.len();
        problems.extend(problems_in(&repo, readme, &markdown));
    }
    assert!(
        commands > 100,
        "only {commands} code snippets found: is the parser broken?"
    );
    assert!(
        problems.is_empty(),
        "the READMEs name things that do not exist:\n  {}",
        problems.join("\n  ")
    );
}

#[test]
fn the_first_screen_shows_the_example_and_the_tests() {
    let readme = std::fs::read_to_string(root().join("README.md")).expect("README.md");
    let first_screen: String = readme.lines().take(30).collect::<Vec<_>>().join("\n");
    for wanted in ["cargo run --release --example decode_loop", "scripts/test"] {
        assert!(
            first_screen.contains(wanted),
            "README.md's first 30 lines lack `{wanted}`"
        );
    }
}

/// A README with one mistake of each kind the checker knows, and one correct line of each.
const SYNTHETIC: &str = r#"# A README with mistakes

```sh
cargo run --release --example decode_loop -- --layers 8 --batches 1
cargo run --release --example no_such_example
cargo run --release --example decode_loop -- --no-such-flag 3
cargo test --test no_such_test
cargo build -p no-such-crate
scripts/no-such-script --all
.bundle/run --no-such-mode
python3 -m stablebuf.no_such_module
```


Run `scripts/test`, then `python3 python/examples/missing.py`, and read `kernels/*.nothing`.

![a picture](docs/no-such-picture.svg) and [a page](benches/README.md).
"#;

#[test]
fn the_checker_reports_each_kind_of_mistake() {
    let repo = Repo::open(&root());
    let problems = problems_in(&repo, "README.md", SYNTHETIC);
    let expected = [
        "README.md:5: `--example no_such_example`: no such example",
        "README.md:6: `--no-such-flag`: not an argument of examples/decode_loop.rs",
        "README.md:7: `--test no_such_test`: no such test",
        "README.md:8: `-p no-such-crate`: no such crate in the workspace",
        "README.md:9: `scripts/no-such-script`: no such file or folder",
        "README.md:10: `--no-such-mode`: scripts/gpu-bundle does not handle it",
        "README.md:11: `python -m stablebuf.no_such_module`: no python/stablebuf/no_such_module/__main__.py or python/stablebuf/no_such_module.py",
        "README.md:15: `python/examples/missing.py`: no such file or folder",
        "README.md:15: `kernels/*.nothing`: no such file or folder",
        "README.md:17: link to `docs/no-such-picture.svg`: no such file",
    ];
    for want in expected {
        assert!(
            problems.iter().any(|p| p == want),
            "not reported: {want}\nreported:\n  {}",
            problems.join("\n  ")
        );
    }
    assert_eq!(
        problems.len(),
        expected.len(),
        "correct lines were reported too:\n  {}",
        problems.join("\n  ")
    );
}

#[test]
fn a_readme_beside_its_files_may_name_them_relative_to_itself() {
    let repo = Repo::open(&root());
    let good = "Run `demo/run-gpu.sh <lib>` and read `include/stablebuf_preload.h`.\n";
    assert!(problems_in(&repo, "preload/README.md", good).is_empty());
    let problems = problems_in(&repo, "python/README.md", good);
    assert_eq!(problems.len(), 2, "{problems:?}");
}
