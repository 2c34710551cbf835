//! Layouts: which slots exist, how big they are, and where they sit in a space.
//!
//! A layout is a list of named slots. Input and output slots belong to a **group**; scratch slots
//! belong to the space itself. Each group is the unit that datasets back and that binding swaps,
//! so its slots are laid out contiguously and one mapping covers the whole group:
//!
//! ```text
//!  space base                                                         base + total
//!  | group "weights"         | group "batch"   | scratch (resident)  |
//!  | w1     | w2     | b1    | x      | y      | tmp                 |
//!  ^ each slot starts on a granularity boundary (2 MiB on current GPUs)
//! ```
//!
//! Everything here is arithmetic: it needs no device and is tested on the CPU.

use crate::error::{Error, LayoutError, Result};
use crate::hash::fnv1a64;

/// What a slot is for. Inputs and outputs live in datasets and are swapped by binding; scratch
/// lives in memory the space owns and is never swapped.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Role {
    /// Data a graph reads: lives in the group's datasets, swapped by binding.
    Input,
    /// Data a graph writes for the caller: lives in datasets too, so each dataset keeps its
    /// own results.
    Output,
    /// Working memory of the space itself: resident, never swapped, shared by whatever is bound.
    Scratch,
}

/// One declared slot.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct SlotSpec {
    /// The slot's name, unique in the layout.
    pub name: String,
    /// Bytes asked for (before rounding to the granularity).
    pub bytes: usize,
    /// What the slot is for.
    pub role: Role,
    /// The group of an input or output slot; `None` for scratch.
    pub group: Option<String>,
}

/// The group new input and output slots join until [`LayoutBuilder::group`] names another.
pub const DEFAULT_GROUP: &str = "data";

/// Builds a [`Layout`]; errors are reported by [`LayoutBuilder::build`].
///
/// ```
/// use stablebuf::Layout;
/// let layout = Layout::builder()
///     .group("weights").input("w", 4096 * 4096 * 4)
///     .group("batch").input("x", 256 * 4096 * 4).output("y", 256 * 4096 * 4)
///     .scratch("tmp", 256 * 4096 * 4)
///     .build()
///     .unwrap();
/// assert_eq!(layout.groups(), ["weights", "batch"]);
/// ```
#[derive(Clone, Debug)]
pub struct LayoutBuilder {
    group: String,
    slots: Vec<SlotSpec>,
}

impl LayoutBuilder {
    /// Input and output slots declared after this call join group `name`.
    pub fn group(mut self, name: impl Into<String>) -> Self {
        self.group = name.into();
        self
    }

    /// An input slot of `bytes` in the current group.
    pub fn input(self, name: impl Into<String>, bytes: usize) -> Self {
        self.slot(name, bytes, Role::Input)
    }

    /// An output slot of `bytes` in the current group.
    pub fn output(self, name: impl Into<String>, bytes: usize) -> Self {
        self.slot(name, bytes, Role::Output)
    }

    /// A scratch slot of `bytes`, backed by the space itself and never swapped.
    pub fn scratch(self, name: impl Into<String>, bytes: usize) -> Self {
        self.slot(name, bytes, Role::Scratch)
    }

    /// A slot with an explicit role (scratch ignores the current group).
    pub fn slot(mut self, name: impl Into<String>, bytes: usize, role: Role) -> Self {
        let group = (role != Role::Scratch).then(|| self.group.clone());
        self.slots.push(SlotSpec {
            name: name.into(),
            bytes,
            role,
            group,
        });
        self
    }

    /// Checks the declarations and makes the layout.
    pub fn build(self) -> Result<Layout> {
        if self.slots.is_empty() {
            return Err(Error::Layout(LayoutError::EmptyLayout));
        }
        let mut groups: Vec<String> = Vec::new();
        for (i, slot) in self.slots.iter().enumerate() {
            if slot.name.is_empty() || slot.group.as_deref() == Some("") {
                return Err(Error::Layout(LayoutError::EmptyName));
            }
            if slot.bytes == 0 {
                return Err(Error::Layout(LayoutError::ZeroSizeSlot {
                    slot: slot.name.clone(),
                }));
            }
            if self.slots[..i].iter().any(|s| s.name == slot.name) {
                return Err(Error::Layout(LayoutError::DuplicateSlot {
                    slot: slot.name.clone(),
                }));
            }
            if let Some(group) = &slot.group {
                if !groups.contains(group) {
                    groups.push(group.clone());
                }
            }
        }
        let canonical: String = self
            .slots
            .iter()
            .map(|s| {
                format!(
                    "{}\0{}\0{:?}\0{}\n",
                    s.name,
                    s.bytes,
                    s.role,
                    s.group.as_deref().unwrap_or("")
                )
            })
            .collect();
        Ok(Layout {
            fingerprint: fnv1a64(canonical.bytes()),
            slots: self.slots,
            groups,
        })
    }
}

/// A checked list of slots. Cheap to clone; compare layouts by [`Layout::fingerprint`].
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Layout {
    slots: Vec<SlotSpec>,
    groups: Vec<String>,
    fingerprint: u64,
}

impl Layout {
    /// Starts an empty layout; slots join the group [`DEFAULT_GROUP`] until
    /// [`LayoutBuilder::group`] names another.
    pub fn builder() -> LayoutBuilder {
        LayoutBuilder {
            group: DEFAULT_GROUP.to_string(),
            slots: Vec::new(),
        }
    }

    /// Slots in declaration order.
    pub fn slots(&self) -> &[SlotSpec] {
        &self.slots
    }

    /// Groups (those holding input or output slots) in order of first declaration.
    pub fn groups(&self) -> &[String] {
        &self.groups
    }

    /// A hash of every slot's name, size, role and group: equal layouts have equal fingerprints,
    /// and a dataset binds only into spaces whose layout has its fingerprint.
    pub fn fingerprint(&self) -> u64 {
        self.fingerprint
    }

    /// Places the slots for allocation granularity `granularity` (a power of two).
    pub fn place(&self, granularity: usize) -> Result<Placement> {
        if !granularity.is_power_of_two() {
            return Err(Error::Layout(LayoutError::InvalidShape(format!(
                "granularity {granularity} is not a power of two"
            ))));
        }
        let too_big = || {
            Error::Layout(LayoutError::InvalidShape(
                "layout size overflows the address space".into(),
            ))
        };
        let mut slots = Vec::with_capacity(self.slots.len());
        let mut regions = Vec::new();
        let mut offset = 0usize;
        let names = self.groups.iter().map(Some).chain(std::iter::once(None));
        for (index, group) in names.enumerate() {
            let start = offset;
            let mut members = Vec::new();
            for spec in self.slots.iter().filter(|s| s.group.as_ref() == group) {
                let span = round_up(spec.bytes, granularity).ok_or_else(too_big)?;
                members.push(slots.len());
                slots.push(PlacedSlot {
                    name: spec.name.clone(),
                    role: spec.role,
                    group: group.map(|_| index),
                    offset,
                    bytes: spec.bytes,
                    span,
                });
                offset = offset.checked_add(span).ok_or_else(too_big)?;
            }
            if !members.is_empty() {
                let name = group.cloned().unwrap_or_default();
                regions.push(Region {
                    name,
                    offset: start,
                    bytes: offset - start,
                    slots: members,
                });
            }
        }
        let scratch = if self.slots.iter().any(|s| s.role == Role::Scratch) {
            regions.pop()
        } else {
            None
        };
        Ok(Placement {
            granularity,
            total_bytes: offset,
            groups: regions,
            scratch,
            slots,
        })
    }
}

/// `value` rounded up to a multiple of `granularity` (a power of two); `None` on overflow.
pub fn round_up(value: usize, granularity: usize) -> Option<usize> {
    value
        .checked_add(granularity - 1)
        .map(|v| v & !(granularity - 1))
}

/// Where every slot and group of a layout sits, as offsets from the space's base address.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Placement {
    /// The allocation granularity every offset and span is a multiple of (2 MiB on current
    /// GPUs).
    pub granularity: usize,
    /// Bytes of address space the whole layout needs.
    pub total_bytes: usize,
    /// Swappable groups, in layout order. Group `i` of the layout is `groups[i]`.
    pub groups: Vec<Region>,
    /// The resident region holding every scratch slot, if any.
    pub scratch: Option<Region>,
    /// Every slot, group by group, then scratch.
    pub slots: Vec<PlacedSlot>,
}

/// A contiguous run of slots mapped as one piece.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Region {
    /// The group's name ("" for the scratch region).
    pub name: String,
    /// Offset of its first slot from the space's base; a multiple of the granularity.
    pub offset: usize,
    /// A multiple of the granularity.
    pub bytes: usize,
    /// Indices into [`Placement::slots`].
    pub slots: Vec<usize>,
}

/// One slot's place.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct PlacedSlot {
    /// The slot's name.
    pub name: String,
    /// What the slot is for.
    pub role: Role,
    /// Index of its group in [`Placement::groups`]; `None` for scratch.
    pub group: Option<usize>,
    /// Offset from the space's base; a multiple of the granularity.
    pub offset: usize,
    /// Bytes asked for.
    pub bytes: usize,
    /// Bytes taken: `bytes` rounded up to the granularity.
    pub span: usize,
}

impl Placement {
    /// The index of group `name`.
    pub fn group_index(&self, name: &str) -> Result<usize> {
        self.groups
            .iter()
            .position(|g| g.name == name)
            .ok_or_else(|| Error::Layout(LayoutError::UnknownGroup { group: name.into() }))
    }

    /// The slot called `name`.
    pub fn slot(&self, name: &str) -> Result<&PlacedSlot> {
        self.slots
            .iter()
            .find(|s| s.name == name)
            .ok_or_else(|| Error::Layout(LayoutError::UnknownSlot { slot: name.into() }))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const MIB: usize = 1 << 20;
    const G: usize = 2 * MIB;

    fn sample() -> Layout {
        Layout::builder()
            .group("weights")
            .input("w1", 3 * MIB)
            .input("w2", 100)
            .group("batch")
            .input("x", G)
            .output("y", G + 1)
            .scratch("tmp", 5)
            .build()
            .unwrap()
    }

    #[test]
    fn slots_are_rounded_to_the_granularity_and_groups_are_contiguous() {
        let p = sample().place(G).unwrap();
        let spans: Vec<_> = p
            .slots
            .iter()
            .map(|s| (s.name.as_str(), s.offset, s.span))
            .collect();
        assert_eq!(
            spans,
            [
                ("w1", 0, 2 * G),
                ("w2", 2 * G, G),
                ("x", 3 * G, G),
                ("y", 4 * G, 2 * G),
                ("tmp", 6 * G, G)
            ]
        );
        assert_eq!(p.groups.len(), 2);
        assert_eq!((p.groups[0].offset, p.groups[0].bytes), (0, 3 * G));
        assert_eq!((p.groups[1].offset, p.groups[1].bytes), (3 * G, 3 * G));
        let scratch = p.scratch.as_ref().unwrap();
        assert_eq!((scratch.offset, scratch.bytes), (6 * G, G));
        assert_eq!(p.total_bytes, 7 * G);
        for s in &p.slots {
            assert_eq!(s.offset % G, 0);
            assert!(s.span >= s.bytes && s.span - s.bytes < G);
        }
    }

    #[test]
    fn every_group_is_one_contiguous_run_even_when_declarations_interleave() {
        let layout = Layout::builder()
            .group("a")
            .input("a1", 1)
            .group("b")
            .input("b1", 1)
            .group("a")
            .output("a2", 1)
            .scratch("s", 1)
            .group("b")
            .output("b2", 1)
            .build()
            .unwrap();
        let p = layout.place(G).unwrap();
        for (gi, region) in p.groups.iter().enumerate() {
            let mut end = region.offset;
            for &si in &region.slots {
                assert_eq!(
                    p.slots[si].offset, end,
                    "slot {} not adjacent",
                    p.slots[si].name
                );
                assert_eq!(p.slots[si].group, Some(gi));
                end += p.slots[si].span;
            }
            assert_eq!(end, region.offset + region.bytes);
        }
        assert_eq!(
            p.groups[0]
                .slots
                .iter()
                .map(|&i| &p.slots[i].name)
                .collect::<Vec<_>>(),
            ["a1", "a2"]
        );
    }

    #[test]
    fn no_scratch_means_no_resident_region() {
        let p = Layout::builder()
            .input("x", 1)
            .build()
            .unwrap()
            .place(G)
            .unwrap();
        assert!(p.scratch.is_none());
        assert_eq!(p.groups[0].name, DEFAULT_GROUP);
    }

    #[test]
    fn only_scratch_means_no_groups() {
        let p = Layout::builder()
            .scratch("s", 1)
            .build()
            .unwrap()
            .place(G)
            .unwrap();
        assert!(p.groups.is_empty());
        assert_eq!(p.scratch.unwrap().bytes, G);
    }

    #[test]
    fn bad_declarations_are_typed_errors() {
        assert!(matches!(
            Layout::builder().build(),
            Err(Error::Layout(LayoutError::EmptyLayout))
        ));
        assert!(matches!(
            Layout::builder().input("x", 0).build(),
            Err(Error::Layout(LayoutError::ZeroSizeSlot { slot })) if slot == "x"
        ));
        assert!(matches!(
            Layout::builder().input("x", 1).scratch("x", 1).build(),
            Err(Error::Layout(LayoutError::DuplicateSlot { slot })) if slot == "x"
        ));
        assert!(matches!(
            Layout::builder().input("", 1).build(),
            Err(Error::Layout(LayoutError::EmptyName))
        ));
        assert!(matches!(
            Layout::builder().group("").input("x", 1).build(),
            Err(Error::Layout(LayoutError::EmptyName))
        ));
        assert!(matches!(
            sample().place(3),
            Err(Error::Layout(LayoutError::InvalidShape(_)))
        ));
        assert!(matches!(
            Layout::builder()
                .input("x", usize::MAX)
                .build()
                .unwrap()
                .place(G),
            Err(Error::Layout(LayoutError::InvalidShape(_)))
        ));
    }

    #[test]
    fn lookups_name_what_is_missing() {
        let p = sample().place(G).unwrap();
        assert!(
            matches!(p.slot("nope"), Err(Error::Layout(LayoutError::UnknownSlot { slot })) if slot == "nope")
        );
        assert!(
            matches!(p.group_index("nope"), Err(Error::Layout(LayoutError::UnknownGroup { group })) if group == "nope")
        );
        assert_eq!(p.group_index("batch").unwrap(), 1);
        assert_eq!(p.slot("y").unwrap().bytes, G + 1);
    }

    #[test]
    fn fingerprint_changes_with_any_slot_property() {
        let base = sample().fingerprint();
        assert_eq!(base, sample().fingerprint());
        let variants = [
            Layout::builder().group("weights").input("w1", 3 * MIB + 1),
            Layout::builder().group("weights").input("w1b", 3 * MIB),
            Layout::builder().group("weights").output("w1", 3 * MIB),
            Layout::builder().group("weightz").input("w1", 3 * MIB),
        ];
        for v in variants {
            let layout = v
                .input("w2", 100)
                .group("batch")
                .input("x", G)
                .output("y", G + 1)
                .scratch("tmp", 5);
            assert_ne!(layout.build().unwrap().fingerprint(), base);
        }
    }

    #[test]
    fn round_up_is_exact_at_boundaries() {
        assert_eq!(round_up(0, G), Some(0));
        assert_eq!(round_up(1, G), Some(G));
        assert_eq!(round_up(G, G), Some(G));
        assert_eq!(round_up(G + 1, G), Some(2 * G));
        assert_eq!(round_up(usize::MAX, G), None);
    }
}
