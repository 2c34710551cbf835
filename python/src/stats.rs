//! One region's statistics as the flat record `stablebuf.stats()` returns per tag.

use stablebuf::region::RegionStats;

/// A value of the record: byte counts and counts are integers, `asleep` a flag.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Value {
    Int(u64),
    Flag(bool),
}

/// What the Python side reports for one tag (PyTorch's own view, `tensor_bytes` and `cached`,
/// is added in Python from the tag's pool).
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct TagStats {
    /// Virtual bytes reserved for the tag.
    pub reserved: usize,
    /// Bytes PyTorch holds from the region (its segments, granule-rounded).
    pub allocated: usize,
    /// How many segments that is.
    pub allocations: usize,
    /// End of the highest live allocation, from the region's base.
    pub span: usize,
    /// Physical bytes mapped under the region now.
    pub mapped: usize,
    /// Mappings that takes (1 after a wake or a snapshot).
    pub mappings: usize,
    /// Whether the region is asleep.
    pub asleep: bool,
    /// Bytes kept on the host while asleep.
    pub host_bytes: usize,
}

impl From<&RegionStats> for TagStats {
    fn from(stats: &RegionStats) -> Self {
        Self {
            reserved: stats.reserved,
            allocated: stats.allocated,
            allocations: stats.allocations,
            span: stats.span,
            mapped: stats.mapped,
            mappings: stats.mappings,
            asleep: stats.asleep,
            host_bytes: stats.host_bytes,
        }
    }
}

/// The record's keys, in order.
pub const KEYS: [&str; 8] = [
    "reserved",
    "allocated",
    "allocations",
    "span",
    "mapped",
    "mappings",
    "asleep",
    "host_bytes",
];

impl TagStats {
    /// `(key, value)` pairs in [`KEYS`] order.
    pub fn fields(&self) -> [(&'static str, Value); 8] {
        let int = |v: usize| Value::Int(v as u64);
        [
            (KEYS[0], int(self.reserved)),
            (KEYS[1], int(self.allocated)),
            (KEYS[2], int(self.allocations)),
            (KEYS[3], int(self.span)),
            (KEYS[4], int(self.mapped)),
            (KEYS[5], int(self.mappings)),
            (KEYS[6], Value::Flag(self.asleep)),
            (KEYS[7], int(self.host_bytes)),
        ]
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn each_field_lands_under_its_own_key() {
        let stats = TagStats {
            reserved: 1,
            allocated: 2,
            allocations: 3,
            span: 4,
            mapped: 5,
            mappings: 6,
            asleep: true,
            host_bytes: 8,
        };
        let fields = stats.fields();
        let keys: Vec<&str> = fields.iter().map(|(k, _)| *k).collect();
        assert_eq!(keys, KEYS);
        let ints: Vec<u64> = fields
            .iter()
            .filter_map(|(_, v)| match v {
                Value::Int(n) => Some(*n),
                Value::Flag(_) => None,
            })
            .collect();
        assert_eq!(ints, vec![1, 2, 3, 4, 5, 6, 8]);
        assert_eq!(fields[6], ("asleep", Value::Flag(true)));
    }
}
