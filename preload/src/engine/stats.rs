//! Counters the hooks bump, and `struct stablebuf_stats` as the C ABI hands it out.

use std::sync::atomic::{AtomicU64, Ordering};

/// Event counters, bumped lock-free from any thread.
#[derive(Debug, Default)]
pub struct Counters {
    pub runtime_allocs: AtomicU64,
    pub driver_allocs: AtomicU64,
    pub frees: AtomicU64,
    pub foreign_frees: AtomicU64,
    pub entry_points: AtomicU64,
    pub ipc_refusals: AtomicU64,
    pub oom_errors: AtomicU64,
    pub copies_deferred: AtomicU64,
    pub copies_elided: AtomicU64,
    pub copies_performed: AtomicU64,
    pub copies_cancelled: AtomicU64,
    pub bytes_elided: AtomicU64,
    pub pauses: AtomicU64,
    pub resumes: AtomicU64,
    pub last_pause_ns: AtomicU64,
    pub last_resume_ns: AtomicU64,
    /// Registrations of tagged memory the layer keeps current (set after each change).
    pub nccl_registrations: AtomicU64,
    /// Of those, the ones not registered with NCCL now (set after each change).
    pub nccl_suspended: AtomicU64,
    pub nccl_reregistrations: AtomicU64,
    pub nccl_failures: AtomicU64,
}

impl Counters {
    pub fn bump(counter: &AtomicU64) {
        counter.fetch_add(1, Ordering::Relaxed);
    }

    pub fn add(counter: &AtomicU64, value: u64) {
        counter.fetch_add(value, Ordering::Relaxed);
    }

    pub fn set(counter: &AtomicU64, value: u64) {
        counter.store(value, Ordering::Relaxed);
    }

    pub fn get(counter: &AtomicU64) -> u64 {
        counter.load(Ordering::Relaxed)
    }
}

/// `struct stablebuf_stats` of `include/stablebuf_preload.h`, field for field. The caller sets
/// `size` to `sizeof(struct stablebuf_stats)`; the layer writes at most that many bytes and sets
/// `size` to what it wrote, so callers built against an older, shorter struct keep working and
/// newer fields can be appended.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct StablebufStats {
    pub size: u64,
    pub abi_version: u64,
    pub mode: u64,
    pub live_allocations: u64,
    pub live_bytes: u64,
    pub runtime_allocs: u64,
    pub driver_allocs: u64,
    pub frees: u64,
    pub foreign_frees: u64,
    pub entry_points: u64,
    pub ipc_refusals: u64,
    pub oom_errors: u64,
    pub pool_mapped: u64,
    pub pool_cached: u64,
    pub pool_peak_mapped: u64,
    pub pool_mappings: u64,
    pub pool_creates: u64,
    pub pool_reuses: u64,
    pub pool_stitched: u64,
    pub pool_drains: u64,
    pub copies_deferred: u64,
    pub copies_elided: u64,
    pub copies_performed: u64,
    pub copies_cancelled: u64,
    pub bytes_elided: u64,
    pub tags: u64,
    pub tags_paused: u64,
    pub tagged_bytes: u64,
    pub host_bytes: u64,
    pub host_arena_bytes: u64,
    pub pauses: u64,
    pub resumes: u64,
    pub last_pause_ns: u64,
    pub last_resume_ns: u64,
    pub nccl_registrations: u64,
    pub nccl_suspended: u64,
    pub nccl_reregistrations: u64,
    pub nccl_failures: u64,
}

/// Version of the struct's layout; bumped when fields are appended (2: the `nccl_*` fields).
pub const ABI_VERSION: u64 = 2;

/// The field names in declaration order (the header test compares them with the C struct).
pub const FIELDS: &[&str] = &[
    "size",
    "abi_version",
    "mode",
    "live_allocations",
    "live_bytes",
    "runtime_allocs",
    "driver_allocs",
    "frees",
    "foreign_frees",
    "entry_points",
    "ipc_refusals",
    "oom_errors",
    "pool_mapped",
    "pool_cached",
    "pool_peak_mapped",
    "pool_mappings",
    "pool_creates",
    "pool_reuses",
    "pool_stitched",
    "pool_drains",
    "copies_deferred",
    "copies_elided",
    "copies_performed",
    "copies_cancelled",
    "bytes_elided",
    "tags",
    "tags_paused",
    "tagged_bytes",
    "host_bytes",
    "host_arena_bytes",
    "pauses",
    "resumes",
    "last_pause_ns",
    "last_resume_ns",
    "nccl_registrations",
    "nccl_suspended",
    "nccl_reregistrations",
    "nccl_failures",
];

impl StablebufStats {
    /// Fills the counter fields from `counters`.
    pub fn with_counters(mut self, counters: &Counters) -> Self {
        let get = Counters::get;
        self.runtime_allocs = get(&counters.runtime_allocs);
        self.driver_allocs = get(&counters.driver_allocs);
        self.frees = get(&counters.frees);
        self.foreign_frees = get(&counters.foreign_frees);
        self.entry_points = get(&counters.entry_points);
        self.ipc_refusals = get(&counters.ipc_refusals);
        self.oom_errors = get(&counters.oom_errors);
        self.copies_deferred = get(&counters.copies_deferred);
        self.copies_elided = get(&counters.copies_elided);
        self.copies_performed = get(&counters.copies_performed);
        self.copies_cancelled = get(&counters.copies_cancelled);
        self.bytes_elided = get(&counters.bytes_elided);
        self.pauses = get(&counters.pauses);
        self.resumes = get(&counters.resumes);
        self.last_pause_ns = get(&counters.last_pause_ns);
        self.last_resume_ns = get(&counters.last_resume_ns);
        self.nccl_registrations = get(&counters.nccl_registrations);
        self.nccl_suspended = get(&counters.nccl_suspended);
        self.nccl_reregistrations = get(&counters.nccl_reregistrations);
        self.nccl_failures = get(&counters.nccl_failures);
        self
    }

    /// The struct's bytes, the first `limit` of which go to the caller.
    pub fn to_bytes(&self) -> Vec<u8> {
        self.fields().iter().flat_map(|v| v.to_ne_bytes()).collect()
    }

    fn fields(&self) -> [u64; 38] {
        [
            self.size,
            self.abi_version,
            self.mode,
            self.live_allocations,
            self.live_bytes,
            self.runtime_allocs,
            self.driver_allocs,
            self.frees,
            self.foreign_frees,
            self.entry_points,
            self.ipc_refusals,
            self.oom_errors,
            self.pool_mapped,
            self.pool_cached,
            self.pool_peak_mapped,
            self.pool_mappings,
            self.pool_creates,
            self.pool_reuses,
            self.pool_stitched,
            self.pool_drains,
            self.copies_deferred,
            self.copies_elided,
            self.copies_performed,
            self.copies_cancelled,
            self.bytes_elided,
            self.tags,
            self.tags_paused,
            self.tagged_bytes,
            self.host_bytes,
            self.host_arena_bytes,
            self.pauses,
            self.resumes,
            self.last_pause_ns,
            self.last_resume_ns,
            self.nccl_registrations,
            self.nccl_suspended,
            self.nccl_reregistrations,
            self.nccl_failures,
        ]
    }
}

/// How many bytes to hand a caller that declared `asked` bytes of struct: whole fields only, at
/// most ours. `None` when the caller's struct cannot even hold `size`.
pub fn bytes_to_write(asked: u64) -> Option<usize> {
    let ours = std::mem::size_of::<StablebufStats>();
    let field = std::mem::size_of::<u64>();
    let asked = usize::try_from(asked).unwrap_or(usize::MAX);
    if asked < field {
        return None;
    }
    Some(asked.min(ours) / field * field)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_struct_is_its_fields_in_order() {
        assert_eq!(
            std::mem::size_of::<StablebufStats>(),
            FIELDS.len() * 8,
            "every field is a u64, no padding"
        );
        let stats = StablebufStats {
            size: 1,
            last_resume_ns: 2,
            copies_elided: 3,
            ..StablebufStats::default()
        };
        let bytes = stats.to_bytes();
        assert_eq!(bytes.len(), FIELDS.len() * 8);
        let at = |name: &str| {
            let index = FIELDS.iter().position(|f| *f == name).unwrap();
            u64::from_ne_bytes(bytes[index * 8..index * 8 + 8].try_into().unwrap())
        };
        assert_eq!(
            (at("size"), at("last_resume_ns"), at("copies_elided")),
            (1, 2, 3)
        );
    }

    #[test]
    fn older_and_newer_callers_get_whole_fields() {
        let ours = std::mem::size_of::<StablebufStats>();
        assert_eq!(bytes_to_write(ours as u64), Some(ours));
        assert_eq!(
            bytes_to_write(ours as u64 + 64),
            Some(ours),
            "a newer, longer struct"
        );
        assert_eq!(bytes_to_write(24), Some(24), "an older, shorter struct");
        assert_eq!(bytes_to_write(27), Some(24), "whole fields only");
        assert_eq!(bytes_to_write(7), None);
        assert_eq!(bytes_to_write(0), None);
    }

    #[test]
    fn counters_fill_their_fields() {
        let counters = Counters::default();
        Counters::bump(&counters.runtime_allocs);
        Counters::add(&counters.bytes_elided, 42);
        Counters::set(&counters.last_pause_ns, 7);
        let stats = StablebufStats::default().with_counters(&counters);
        assert_eq!(
            (
                stats.runtime_allocs,
                stats.bytes_elided,
                stats.last_pause_ns
            ),
            (1, 42, 7)
        );
    }

    #[test]
    fn the_header_declares_the_same_fields_in_the_same_order() {
        let header = include_str!("../../include/stablebuf_preload.h");
        let start = header
            .find("struct stablebuf_stats {")
            .expect("struct in the header");
        let body = &header[start..header[start..].find("};").unwrap() + start];
        let declared: Vec<&str> = body
            .lines()
            .filter_map(|line| line.trim().strip_prefix("uint64_t "))
            .map(|rest| rest.split(';').next().unwrap().trim())
            .collect();
        assert_eq!(declared, FIELDS);
    }
}
