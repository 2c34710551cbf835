//! Which Python exception a failure becomes, and the message it carries.
//!
//! Pure logic (no Python, no GPU): the extension turns a [`Failure`] into the matching
//! `stablebuf.*` exception class in `lib.rs`. Messages keep the numbers the core error carries
//! (bytes asked, bytes free, which budget), because they are what a user acts on.

use stablebuf::error::{DriverError, GraphError, OffloadError, PoolError, RegionError};
use std::fmt;

/// The Python exception class a failure maps to. Every class derives from `stablebuf.Error`.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Kind {
    /// `stablebuf.Error`: anything without a more precise class (driver failures, bad input).
    Error,
    /// `stablebuf.OutOfMemory`: device (or pinned host) memory or address space ran out.
    OutOfMemory,
    /// `stablebuf.OverBudget`: a budget refused the request.
    OverBudget,
    /// `stablebuf.Asleep`: the region is asleep (wake it first).
    Asleep,
    /// `stablebuf.Unbound`: the region has no weight set bound.
    Unbound,
    /// `stablebuf.UnknownTag`: no region has this tag.
    UnknownTag,
    /// `stablebuf.SnapshotMismatch`: the weight set cannot be bound into this region.
    SnapshotMismatch,
    /// `stablebuf.DeviceMismatch`: the region lives on another CUDA device than the one asked.
    DeviceMismatch,
}

impl Kind {
    /// Every kind, in the order the exception classes are created.
    pub const ALL: [Kind; 8] = [
        Kind::Error,
        Kind::OutOfMemory,
        Kind::OverBudget,
        Kind::Asleep,
        Kind::Unbound,
        Kind::UnknownTag,
        Kind::SnapshotMismatch,
        Kind::DeviceMismatch,
    ];

    /// The exception's class name in the `stablebuf` module.
    pub fn class_name(self) -> &'static str {
        match self {
            Kind::Error => "Error",
            Kind::OutOfMemory => "OutOfMemory",
            Kind::OverBudget => "OverBudget",
            Kind::Asleep => "Asleep",
            Kind::Unbound => "Unbound",
            Kind::UnknownTag => "UnknownTag",
            Kind::SnapshotMismatch => "SnapshotMismatch",
            Kind::DeviceMismatch => "DeviceMismatch",
        }
    }
}

/// A failure on its way to Python: the exception class and its message.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Failure {
    pub kind: Kind,
    pub message: String,
}

impl Failure {
    pub fn new(kind: Kind, message: impl Into<String>) -> Self {
        Self {
            kind,
            message: message.into(),
        }
    }

    /// A tag no region has; `known` lists the tags that exist, to spot a typo.
    pub fn unknown_tag(tag: &str, known: &[&str]) -> Self {
        let known = if known.is_empty() {
            "no region exists yet: allocate in `with stablebuf.region(tag):` first".to_string()
        } else {
            format!("known tags: {}", known.join(", "))
        };
        Self::new(Kind::UnknownTag, format!("unknown tag `{tag}` ({known})"))
    }

    /// Region `tag` lives on device `home` and was asked for on device `asked`: a tag names one
    /// region on one device.
    pub fn device_mismatch(tag: &str, home: i32, asked: i32) -> Self {
        Self::new(
            Kind::DeviceMismatch,
            format!(
                "region `{tag}` lives on device {home}, not on device {asked}: a tag names one \
                 region on one device, use another tag for a region on device {asked}"
            ),
        )
    }

    /// Maps a core error. `free` is the device's free memory when the error happened, if it
    /// could be read: out-of-memory messages then say how much was free.
    pub fn from_core(error: &stablebuf::Error, free: Option<usize>) -> Self {
        use stablebuf::Error;
        let free_note = |message: String| match free {
            Some(free) => format!("{message}; {free} bytes ({}) free on the device", gib(free)),
            None => message,
        };
        let plain = |kind| Self::new(kind, error.to_string());
        // Area by area: each core area's variants that have a class of their own, the rest
        // `stablebuf.Error` with the core message.
        match error {
            Error::Driver(driver) => match driver {
                DriverError::OutOfMemory { call, bytes } => Self::new(
                    Kind::OutOfMemory,
                    free_note(format!(
                        "out of device memory: asked {bytes} bytes ({}) in {call}",
                        gib(*bytes)
                    )),
                ),
                DriverError::NoDriver => Self::new(
                    Kind::Error,
                    "no CUDA driver: libcuda could not be loaded on this machine",
                ),
                _ => plain(Kind::Error),
            },
            Error::Offload(offload) => match offload {
                OffloadError::RestoreOutOfMemory { asked, free, .. } => Self::new(
                    Kind::OutOfMemory,
                    format!(
                        "out of device memory: waking asked for {asked} bytes ({}), {free} bytes \
                         ({}) are free; the region stays asleep with its host copy, retry once \
                         memory is free",
                        gib(*asked),
                        gib(*free)
                    ),
                ),
                OffloadError::HostOutOfMemory { bytes } => Self::new(
                    Kind::OutOfMemory,
                    format!(
                        "out of host memory: asked {bytes} bytes ({}) to keep a sleeping region",
                        gib(*bytes)
                    ),
                ),
                _ => plain(Kind::Error),
            },
            Error::Pool(pool) => match pool {
                PoolError::PoolOutOfMemory { asked, .. } => Self::new(
                    Kind::OutOfMemory,
                    free_note(format!("{error} (asked {asked} bytes)")),
                ),
                PoolError::VirtualCapacity { .. } => plain(Kind::OutOfMemory),
                PoolError::OverBudget { .. } => plain(Kind::OverBudget),
                _ => plain(Kind::Error),
            },
            Error::Region(region) => match region {
                RegionError::RegionAsleep { tag } => Self::new(
                    Kind::Asleep,
                    format!("region `{tag}` is asleep: call stablebuf.wake({tag:?}) first"),
                ),
                RegionError::SnapshotMismatch { .. } => plain(Kind::SnapshotMismatch),
                _ => plain(Kind::Error),
            },
            Error::Graph(graph) => match graph {
                GraphError::Asleep => plain(Kind::Asleep),
                GraphError::Unbound { group } => Self::new(
                    Kind::Unbound,
                    format!(
                        "region `{group}` has no weight set bound: bind one with stablebuf.bind"
                    ),
                ),
                _ => plain(Kind::Error),
            },
            _ => plain(Kind::Error),
        }
    }

    /// A panic caught at the C boundary or in a binding: a bug, reported rather than crashing.
    pub fn internal(what: &str) -> Self {
        Self::new(
            Kind::Error,
            format!("internal error in stablebuf (please report it): {what}"),
        )
    }

    /// Adds what was being done in front of the message.
    pub fn context(mut self, doing: impl fmt::Display) -> Self {
        self.message = format!("{doing}: {}", self.message);
        self
    }
}

impl fmt::Display for Failure {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}: {}", self.kind.class_name(), self.message)
    }
}

/// `bytes` in GiB with two decimals, for messages.
pub fn gib(bytes: usize) -> String {
    format!("{:.2} GiB", bytes as f64 / (1u64 << 30) as f64)
}

/// The text of a caught panic's payload.
pub fn panic_text(payload: &(dyn std::any::Any + Send)) -> String {
    if let Some(text) = payload.downcast_ref::<&str>() {
        (*text).to_string()
    } else if let Some(text) = payload.downcast_ref::<String>() {
        text.clone()
    } else {
        "a panic with no message".to_string()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use stablebuf::Error;

    #[test]
    fn out_of_memory_says_asked_and_free() {
        let failure = Failure::from_core(
            &Error::Driver(DriverError::OutOfMemory {
                call: "cuMemCreate",
                bytes: 3 << 30,
            }),
            Some(1 << 30),
        );
        assert_eq!(failure.kind, Kind::OutOfMemory);
        assert!(failure.message.contains("3221225472 bytes"), "{failure}");
        assert!(failure.message.contains("1073741824 bytes"), "{failure}");
        assert!(failure.message.contains("cuMemCreate"), "{failure}");

        let without_free = Failure::from_core(
            &Error::Driver(DriverError::OutOfMemory {
                call: "cuMemCreate",
                bytes: 1,
            }),
            None,
        );
        assert!(!without_free.message.contains("free"), "{without_free}");
    }

    #[test]
    fn a_failed_wake_says_asked_free_and_that_the_region_stays_asleep() {
        let failure = Failure::from_core(
            &Error::Offload(OffloadError::RestoreOutOfMemory {
                dataset: 7,
                asked: 8 << 30,
                free: 2 << 30,
            }),
            None,
        );
        assert_eq!(failure.kind, Kind::OutOfMemory);
        assert!(failure.message.contains("8589934592 bytes"), "{failure}");
        assert!(failure.message.contains("2147483648 bytes"), "{failure}");
        assert!(failure.message.contains("stays asleep"), "{failure}");
    }

    #[test]
    fn each_core_error_lands_in_its_class() {
        let cases = [
            (
                Error::Region(RegionError::RegionAsleep { tag: "w".into() }),
                Kind::Asleep,
            ),
            (Error::Graph(GraphError::Asleep), Kind::Asleep),
            (
                Error::Graph(GraphError::Unbound { group: "w".into() }),
                Kind::Unbound,
            ),
            (
                Error::Region(RegionError::SnapshotMismatch {
                    tag: "w".into(),
                    reason: "another region".into(),
                }),
                Kind::SnapshotMismatch,
            ),
            (
                Error::Pool(PoolError::OverBudget {
                    scope: "pool".into(),
                    asked: 5,
                    limit: 4,
                    held: 3,
                }),
                Kind::OverBudget,
            ),
            (
                Error::Pool(PoolError::PoolOutOfMemory {
                    asked: 5,
                    cached: 0,
                    held: 3,
                    drained: 0,
                }),
                Kind::OutOfMemory,
            ),
            (
                Error::Offload(OffloadError::HostOutOfMemory { bytes: 9 }),
                Kind::OutOfMemory,
            ),
            (
                Error::Pool(PoolError::VirtualCapacity {
                    tenant: "w".into(),
                    asked: 9,
                    capacity: 8,
                    largest_free_run: 4,
                }),
                Kind::OutOfMemory,
            ),
            (
                Error::Region(RegionError::UnknownAllocation { address: 0x10 }),
                Kind::Error,
            ),
            (Error::Driver(DriverError::NoDriver), Kind::Error),
            (Error::Graph(GraphError::BindDuringCapture), Kind::Error),
        ];
        for (error, kind) in cases {
            let failure = Failure::from_core(&error, None);
            assert_eq!(failure.kind, kind, "{error:?} became {failure}");
            assert!(!failure.message.is_empty());
        }
    }

    #[test]
    fn over_budget_names_the_budget_and_its_numbers() {
        let failure = Failure::from_core(
            &Error::Pool(PoolError::OverBudget {
                scope: "tenant `kv`".into(),
                asked: 100,
                limit: 64,
                held: 32,
            }),
            None,
        );
        for needle in ["tenant `kv`", "100", "64", "32"] {
            assert!(failure.message.contains(needle), "{needle} in {failure}");
        }
    }

    #[test]
    fn unknown_tags_list_the_known_ones() {
        let failure = Failure::unknown_tag("wieghts", &["weights", "kv"]);
        assert_eq!(failure.kind, Kind::UnknownTag);
        assert!(failure.message.contains("wieghts"));
        assert!(failure.message.contains("weights, kv"));
        let none = Failure::unknown_tag("x", &[]);
        assert!(none.message.contains("stablebuf.region"), "{none}");
    }

    #[test]
    fn a_device_mismatch_names_the_tag_and_both_devices() {
        let failure = Failure::device_mismatch("weights", 0, 1);
        assert_eq!(failure.kind, Kind::DeviceMismatch);
        for needle in ["`weights`", "device 0", "device 1"] {
            assert!(failure.message.contains(needle), "{needle} in {failure}");
        }
    }

    #[test]
    fn class_names_are_distinct() {
        let names: std::collections::HashSet<_> =
            Kind::ALL.iter().map(|kind| kind.class_name()).collect();
        assert_eq!(names.len(), Kind::ALL.len());
    }

    #[test]
    fn panic_payloads_become_text() {
        let caught = std::panic::catch_unwind(|| panic!("boom {}", 1)).unwrap_err();
        assert_eq!(panic_text(caught.as_ref()), "boom 1");
        let caught = std::panic::catch_unwind(|| std::panic::panic_any(5u8)).unwrap_err();
        assert_eq!(panic_text(caught.as_ref()), "a panic with no message");
    }
}
