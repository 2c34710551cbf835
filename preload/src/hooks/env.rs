//! Configuration from environment variables, and the help text that lists them.
//!
//! Parsing is pure: [`Config::from_lookup`] takes any name → value function, so the tests do not
//! touch the process environment. A value that does not parse never stops the program: the
//! variable falls back to its default and a warning says so.

use std::path::PathBuf;

/// What the layer does with the calls it sees.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Mode {
    /// Everything passes straight through to CUDA.
    Off,
    /// Everything passes through; allocations are logged and drawn as a timeline at exit.
    Monitor,
    /// Allocations are served from stablebuf's pool (untagged) and regions (tagged).
    Vmm,
}

impl Mode {
    pub fn name(self) -> &'static str {
        match self {
            Mode::Off => "off",
            Mode::Monitor => "monitor",
            Mode::Vmm => "vmm",
        }
    }

    /// The number reported in `stablebuf_stats.mode`.
    pub fn code(self) -> u64 {
        match self {
            Mode::Off => 0,
            Mode::Monitor => 1,
            Mode::Vmm => 2,
        }
    }
}

/// One environment variable the layer reads.
#[derive(Clone, Copy, Debug)]
pub struct Variable {
    pub name: &'static str,
    pub values: &'static str,
    pub default: &'static str,
    pub doc: &'static str,
}

pub const MODE: &str = "STABLEBUF_PRELOAD_MODE";
pub const BUDGET: &str = "STABLEBUF_PRELOAD_BUDGET";
pub const ELIDE_COPIES: &str = "STABLEBUF_PRELOAD_ELIDE_COPIES";
pub const ELIDE_MIN: &str = "STABLEBUF_PRELOAD_ELIDE_MIN";
pub const TIMELINE: &str = "STABLEBUF_PRELOAD_TIMELINE";
pub const HOST_ARENA: &str = "STABLEBUF_PRELOAD_HOST_ARENA";
pub const STITCHING: &str = "STABLEBUF_PRELOAD_STITCHING";
pub const DRAIN_ON_OOM: &str = "STABLEBUF_PRELOAD_DRAIN_ON_OOM";
pub const NCCL_REGISTER: &str = "STABLEBUF_PRELOAD_NCCL_REGISTER";
pub const LOG: &str = "STABLEBUF_PRELOAD_LOG";
pub const HELP: &str = "STABLEBUF_PRELOAD_HELP";

/// What the layer does with `ncclCommRegister` of tagged memory ([`NCCL_REGISTER`]).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum NcclRegister {
    /// Registered, deregistered before a pause of the tag and registered again after its
    /// resume (`engine/nccl.rs`).
    Renew,
    /// Answered as NCCL answers a registration it skips (success, NULL handle), without asking
    /// NCCL: NCCL copies through its own buffers.
    Skip,
    /// Every NCCL call passes straight through (NCCL keeps the old pages after a resume).
    Pass,
}

impl NcclRegister {
    pub fn name(self) -> &'static str {
        match self {
            NcclRegister::Renew => "renew",
            NcclRegister::Skip => "skip",
            NcclRegister::Pass => "pass",
        }
    }
}

/// Every variable, in the order the help text lists them.
pub const VARIABLES: &[Variable] = &[
    Variable {
        name: MODE,
        values: "off | monitor | vmm",
        default: "vmm",
        doc: "off: pass every call through. monitor: pass through, log each allocation, write \
              the timeline and a summary at exit. vmm: serve cudaMalloc/cuMemAlloc from \
              stablebuf's pool (untagged) or from one region per tag (tagged, pausable).",
    },
    Variable {
        name: BUDGET,
        values: "bytes (suffixes K, M, G, T; binary)",
        default: "none",
        doc: "vmm: most physical memory the pool may hold per device, mapped plus cached. A \
              request over it is answered out of memory (cudaErrorMemoryAllocation) after the \
              cache was released. Tagged (region) memory is not counted.",
    },
    Variable {
        name: ELIDE_COPIES,
        values: "0 | 1",
        default: "0",
        doc: "vmm: defer a device-to-device cudaMemcpy/cudaMemcpyAsync of a whole allocation \
              into the start of a fresh, larger one; if the source is freed before any other \
              work, move its memory under the destination instead of copying. See the README \
              for the exact rules and limits.",
    },
    Variable {
        name: ELIDE_MIN,
        values: "bytes",
        default: "64M",
        doc: "vmm with copy elision: smallest copy worth deferring (below ~100 MiB a copy is \
              about as cheap as remapping).",
    },
    Variable {
        name: TIMELINE,
        values: "path.svg",
        default: "none",
        doc: "monitor and vmm: write the address-over-time timeline there at exit (drawn from \
              recorded events; no CUDA call is made at exit). %p in the path becomes the \
              process id. A process that allocated nothing writes nothing.",
    },
    Variable {
        name: HOST_ARENA,
        values: "bytes",
        default: "sized at the first pause",
        doc: "vmm: pinned host memory for pauses that keep contents, pinned once. Unset, the \
              first such pause pins what it needs (slow: ~0.5 s per GiB) and later pauses reuse \
              it; set it, or call stablebuf_reserve_host(), to pay that up front.",
    },
    Variable {
        name: STITCHING,
        values: "0 | 1",
        default: "1",
        doc: "vmm: serve one request from several cached chunks laid side by side.",
    },
    Variable {
        name: DRAIN_ON_OOM,
        values: "0 | 1",
        default: "1",
        doc: "vmm: when the driver is out of memory, release the pool's cache and retry once.",
    },
    Variable {
        name: NCCL_REGISTER,
        values: "renew | skip | pass",
        default: "renew",
        doc: "vmm: ncclCommRegister of tagged memory. renew: registered, deregistered before a \
              pause of the tag and registered again after its resume (a graph that captured a \
              collective over such a buffer must be captured again after the resume). skip: \
              answered with a NULL handle, as NCCL answers a registration it skips; NCCL then \
              copies through its own buffers (right, slower). pass: passed through (NCCL \
              keeps the old pages after a resume: wrong results; for comparison only). Other \
              memory is always passed through.",
    },
    Variable {
        name: LOG,
        values: "tracing filter, e.g. warn, info, stablebuf_preload=debug",
        default: "unset: silent",
        doc: "write the layer's tracing events to stderr with this filter. Failures are warn or \
              error; each allocation in monitor mode is info.",
    },
    Variable {
        name: HELP,
        values: "1",
        default: "unset",
        doc: "print this text to stderr when the library loads.",
    },
];

/// Everything the environment says, parsed.
#[derive(Clone, Debug, PartialEq)]
pub struct Config {
    pub mode: Mode,
    pub budget: Option<usize>,
    pub elide_copies: bool,
    pub elide_min: usize,
    pub timeline: Option<PathBuf>,
    pub host_arena: Option<usize>,
    pub stitching: bool,
    pub drain_on_oom: bool,
    pub log: Option<String>,
    pub help: bool,
    pub nccl_register: NcclRegister,
}

impl Default for Config {
    fn default() -> Self {
        Self {
            mode: Mode::Vmm,
            budget: None,
            elide_copies: false,
            elide_min: 64 << 20,
            timeline: None,
            host_arena: None,
            stitching: true,
            drain_on_oom: true,
            log: None,
            help: false,
            nccl_register: NcclRegister::Renew,
        }
    }
}

impl Config {
    /// Reads every variable through `lookup`; returns the configuration and one warning per
    /// value that did not parse (that variable keeps its default).
    pub fn from_lookup(lookup: impl Fn(&str) -> Option<String>) -> (Config, Vec<String>) {
        let mut config = Config::default();
        let mut warnings = Vec::new();
        let get = |name: &str| lookup(name).filter(|v| !v.trim().is_empty());
        if let Some(value) = get(MODE) {
            match parse_mode(&value) {
                Some(mode) => config.mode = mode,
                None => {
                    // Unknown: the safe reading is to stay out of the way.
                    config.mode = Mode::Off;
                    warnings.push(format!(
                        "{MODE}={value:?} is not off, monitor or vmm: the layer is off"
                    ));
                }
            }
        }
        let size = |name: &str, warnings: &mut Vec<String>| -> Option<usize> {
            let value = get(name)?;
            match parse_size(&value) {
                Some(bytes) => Some(bytes),
                None => {
                    warnings.push(format!(
                        "{name}={value:?} is not a size (e.g. 8G, 512M, 1048576): ignored"
                    ));
                    None
                }
            }
        };
        config.budget = size(BUDGET, &mut warnings);
        config.host_arena = size(HOST_ARENA, &mut warnings);
        if let Some(bytes) = size(ELIDE_MIN, &mut warnings) {
            config.elide_min = bytes;
        }
        let flag = |name: &str, default: bool, warnings: &mut Vec<String>| -> bool {
            let Some(value) = get(name) else {
                return default;
            };
            parse_bool(&value).unwrap_or_else(|| {
                warnings.push(format!(
                    "{name}={value:?} is not 0 or 1: using {}",
                    u8::from(default)
                ));
                default
            })
        };
        config.elide_copies = flag(ELIDE_COPIES, false, &mut warnings);
        config.stitching = flag(STITCHING, true, &mut warnings);
        config.drain_on_oom = flag(DRAIN_ON_OOM, true, &mut warnings);
        config.help = flag(HELP, false, &mut warnings);
        if let Some(value) = get(NCCL_REGISTER) {
            match parse_nccl_register(&value) {
                Some(policy) => config.nccl_register = policy,
                None => warnings.push(format!(
                    "{NCCL_REGISTER}={value:?} is not renew, skip or pass: using renew"
                )),
            }
        }
        config.timeline = get(TIMELINE).map(PathBuf::from);
        config.log = get(LOG);
        (config, warnings)
    }

    /// The timeline's path for process `pid`: `%p` in the variable's value becomes the pid, so
    /// several processes of one program each write their own.
    pub fn timeline_path(&self, pid: u32) -> Option<PathBuf> {
        let path = self.timeline.as_ref()?.to_str()?;
        Some(PathBuf::from(path.replace("%p", &pid.to_string())))
    }

    /// Whether copy elision is in force (it needs vmm mode).
    pub fn eliding(&self) -> bool {
        self.mode == Mode::Vmm && self.elide_copies
    }
}

pub fn parse_mode(value: &str) -> Option<Mode> {
    match value.trim().to_ascii_lowercase().as_str() {
        "off" | "0" | "none" => Some(Mode::Off),
        "monitor" => Some(Mode::Monitor),
        "vmm" => Some(Mode::Vmm),
        _ => None,
    }
}

pub fn parse_nccl_register(value: &str) -> Option<NcclRegister> {
    match value.trim().to_ascii_lowercase().as_str() {
        "renew" => Some(NcclRegister::Renew),
        "skip" => Some(NcclRegister::Skip),
        "pass" => Some(NcclRegister::Pass),
        _ => None,
    }
}

pub fn parse_bool(value: &str) -> Option<bool> {
    match value.trim().to_ascii_lowercase().as_str() {
        "1" | "true" | "yes" | "on" => Some(true),
        "0" | "false" | "no" | "off" => Some(false),
        _ => None,
    }
}

/// A byte count: digits (a decimal fraction allowed with a suffix), then optionally K, M, G or
/// T (powers of 1024), optionally followed by `B` or `iB`; case does not matter. `8G`,
/// `512MiB`, `1.5g` and `4096` all parse.
pub fn parse_size(value: &str) -> Option<usize> {
    let text = value.trim().to_ascii_lowercase();
    let number_end = text
        .find(|c: char| !(c.is_ascii_digit() || c == '.'))
        .unwrap_or(text.len());
    let (number, suffix) = text.split_at(number_end);
    let shift = match suffix.trim() {
        "" | "b" => 0,
        "k" | "kb" | "kib" => 10,
        "m" | "mb" | "mib" => 20,
        "g" | "gb" | "gib" => 30,
        "t" | "tb" | "tib" => 40,
        _ => return None,
    };
    if number.is_empty() || number.starts_with('.') || number.ends_with('.') {
        return None;
    }
    if let Ok(whole) = number.parse::<u64>() {
        let bytes = whole.checked_mul(1u64 << shift)?;
        return usize::try_from(bytes).ok();
    }
    if shift == 0 {
        return None; // fractions of a byte
    }
    let fraction: f64 = number.parse().ok()?;
    let bytes = fraction * (1u64 << shift) as f64;
    if !bytes.is_finite() || bytes >= usize::MAX as f64 {
        return None;
    }
    Some(bytes.round() as usize)
}

/// NCCL's variable for registering the buffers of collectives captured in CUDA graphs (on by
/// default in NCCL).
pub const NCCL_GRAPH_REGISTER: &str = "NCCL_GRAPH_REGISTER";

/// What the layer does about [`NCCL_GRAPH_REGISTER`] at load time: in vmm mode, where the
/// variable is unset (or empty, which NCCL reads as unset), it is set to `0`, and this notice
/// says why and how to keep NCCL's default. `None`: leave the environment alone.
///
/// NCCL registers the buffers of a collective captured in a graph inside its own enqueue path
/// (`ncclCommGraphRegister`, not an exported function), so the layer cannot renew those
/// registrations around a pause as it does `ncclCommRegister`'s; in one process driving
/// several GPUs such a registration of tagged memory keeps the old pages after a resume.
/// Across processes (one per GPU) graph registration of the layer's memory never succeeds
/// anyway (the export fails and NCCL copies), so nothing is lost there.
pub fn nccl_graph_register_default(mode: Mode, current: Option<&str>) -> Option<String> {
    if mode != Mode::Vmm || current.is_some_and(|v| !v.trim().is_empty()) {
        return None;
    }
    Some(format!(
        "stablebuf-preload: set {NCCL_GRAPH_REGISTER}=0 for NCCL (vmm mode): NCCL's own \
         registration of buffers in collectives captured in CUDA graphs cannot be renewed by the \
         layer, and would keep the old pages of tagged memory across a pause and resume. Set \
         {NCCL_GRAPH_REGISTER}=1 to keep NCCL's default (safe when no captured collective uses \
         tagged memory that is paused)."
    ))
}

/// The text `STABLEBUF_PRELOAD_HELP=1` prints: every variable, its values, default and meaning.
pub fn help_text() -> String {
    let mut text = String::from(
        "stablebuf-preload: an LD_PRELOAD layer that serves cudaMalloc/cuMemAlloc from \
         stablebuf's VMM pool.\n\
         Usage: LD_PRELOAD=/path/to/libstablebuf_preload.so [VARIABLE=value ...] program\n\
         Programs built with nvcc need -cudart shared (the default links the runtime \
         statically and cannot be hooked).\n\nVariables:\n",
    );
    for variable in VARIABLES {
        text.push_str(&format!(
            "  {}={}\n      default: {}\n      {}\n",
            variable.name, variable.values, variable.default, variable.doc
        ));
    }
    text.push_str(
        "\nC ABI (include/stablebuf_preload.h): stablebuf_set_tag, stablebuf_pause, \
         stablebuf_resume, stablebuf_stats, stablebuf_reserve_host, stablebuf_error_string.\n",
    );
    text
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::collections::HashMap;

    fn config(pairs: &[(&str, &str)]) -> (Config, Vec<String>) {
        let map: HashMap<String, String> = pairs
            .iter()
            .map(|(k, v)| (k.to_string(), v.to_string()))
            .collect();
        Config::from_lookup(|name| map.get(name).cloned())
    }

    #[test]
    fn sizes_take_binary_suffixes_and_fractions() {
        assert_eq!(parse_size("4096"), Some(4096));
        assert_eq!(parse_size("8G"), Some(8 << 30));
        assert_eq!(parse_size("512m"), Some(512 << 20));
        assert_eq!(parse_size("512MiB"), Some(512 << 20));
        assert_eq!(parse_size(" 2 GB "), Some(2 << 30));
        assert_eq!(parse_size("1.5G"), Some(3 << 29));
        assert_eq!(parse_size("64k"), Some(64 << 10));
        assert_eq!(parse_size("1T"), Some(1 << 40));
        for bad in [
            "",
            "G",
            "8X",
            "-1",
            "1.5",
            ".5G",
            "5.G",
            "1e9",
            "99999999999999999999",
        ] {
            assert_eq!(parse_size(bad), None, "{bad:?} must not parse");
        }
    }

    #[test]
    fn defaults_when_nothing_is_set() {
        let (config, warnings) = config(&[]);
        assert_eq!(config, Config::default());
        assert_eq!(config.mode, Mode::Vmm);
        assert!(!config.elide_copies && !config.eliding());
        assert!(warnings.is_empty());
    }

    #[test]
    fn every_variable_is_read() {
        let (config, warnings) = config(&[
            (MODE, "Monitor"),
            (BUDGET, "40G"),
            (ELIDE_COPIES, "1"),
            (ELIDE_MIN, "1M"),
            (TIMELINE, "/tmp/t.svg"),
            (HOST_ARENA, "8G"),
            (STITCHING, "0"),
            (DRAIN_ON_OOM, "false"),
            (LOG, "debug"),
            (HELP, "1"),
            (NCCL_REGISTER, "Skip"),
        ]);
        assert!(warnings.is_empty(), "{warnings:?}");
        assert_eq!(config.mode, Mode::Monitor);
        assert_eq!(config.budget, Some(40 << 30));
        assert!(config.elide_copies);
        assert!(!config.eliding(), "elision needs vmm mode");
        assert_eq!(config.elide_min, 1 << 20);
        assert_eq!(config.timeline, Some(PathBuf::from("/tmp/t.svg")));
        assert_eq!(config.host_arena, Some(8 << 30));
        assert!(!config.stitching && !config.drain_on_oom);
        assert_eq!(config.log.as_deref(), Some("debug"));
        assert!(config.help);
        assert_eq!(config.nccl_register, NcclRegister::Skip);
    }

    #[test]
    fn bad_values_warn_and_fall_back() {
        let (config, warnings) = config(&[
            (MODE, "fast"),
            (BUDGET, "lots"),
            (STITCHING, "maybe"),
            (NCCL_REGISTER, "sometimes"),
        ]);
        assert_eq!(
            config.mode,
            Mode::Off,
            "an unknown mode turns the layer off"
        );
        assert_eq!(config.budget, None);
        assert!(config.stitching);
        assert_eq!(config.nccl_register, NcclRegister::Renew);
        assert_eq!(warnings.len(), 4, "{warnings:?}");
        assert!(warnings[3].contains(NCCL_REGISTER), "{warnings:?}");
        assert!(warnings[0].contains(MODE) && warnings[1].contains(BUDGET));
        let (config, _) = config_vmm_elide();
        assert!(config.eliding());
    }

    fn config_vmm_elide() -> (Config, Vec<String>) {
        config(&[(MODE, "vmm"), (ELIDE_COPIES, "yes")])
    }

    #[test]
    fn the_timeline_path_takes_the_pid() {
        let (config, _) = config(&[(TIMELINE, "/tmp/t-%p.svg")]);
        assert_eq!(
            config.timeline_path(42),
            Some(PathBuf::from("/tmp/t-42.svg"))
        );
        let (plain, _) = config_plain();
        assert_eq!(plain.timeline_path(42), None);
    }

    fn config_plain() -> (Config, Vec<String>) {
        config(&[])
    }

    #[test]
    fn help_lists_every_variable_with_its_default() {
        let help = help_text();
        for variable in VARIABLES {
            assert!(help.contains(variable.name), "{} missing", variable.name);
            assert!(help.contains(variable.default));
        }
        assert!(help.contains("-cudart shared"));
        // Every constant above is in the table.
        for name in [
            MODE,
            BUDGET,
            ELIDE_COPIES,
            ELIDE_MIN,
            TIMELINE,
            HOST_ARENA,
            STITCHING,
            DRAIN_ON_OOM,
            NCCL_REGISTER,
            LOG,
            HELP,
        ] {
            assert!(VARIABLES.iter().any(|v| v.name == name), "{name}");
        }
    }

    #[test]
    fn nccl_graph_registration_is_turned_off_only_in_vmm_mode_and_only_if_unset() {
        let notice = nccl_graph_register_default(Mode::Vmm, None).expect("vmm, unset");
        assert!(
            notice.contains("NCCL_GRAPH_REGISTER=0") && notice.contains("NCCL_GRAPH_REGISTER=1")
        );
        assert!(
            nccl_graph_register_default(Mode::Vmm, Some(" ")).is_some(),
            "empty is unset"
        );
        assert_eq!(
            nccl_graph_register_default(Mode::Vmm, Some("1")),
            None,
            "the user's value"
        );
        assert_eq!(nccl_graph_register_default(Mode::Vmm, Some("0")), None);
        assert_eq!(nccl_graph_register_default(Mode::Monitor, None), None);
        assert_eq!(nccl_graph_register_default(Mode::Off, None), None);
    }

    #[test]
    fn the_readme_documents_every_variable() {
        let readme = include_str!("../../README.md");
        for variable in VARIABLES {
            assert!(
                readme.contains(variable.name),
                "README.md does not mention {}",
                variable.name
            );
        }
        assert!(readme.contains(NCCL_GRAPH_REGISTER));
    }
}
