//! The tag table: which region a tag names, which allocator slot serves it, and which region
//! owns an address.
//!
//! Pure bookkeeping, generic over the region type so it is tested without a GPU. Each entry
//! records the device its region lives on: regions of different tags may live on different
//! devices, a tag on one only. Entries are never removed: a tag's PyTorch pool calls its slot's
//! entry point for the life of the process, so a slot must keep meaning the same region.

use crate::errors::{Failure, Kind};

/// How many tags a process can have: one exported allocation entry point per tag
/// (`stablebuf_alloc_0` .. `stablebuf_alloc_63`).
pub const MAX_TAGS: usize = 64;

/// Longest tag accepted, in bytes.
pub const MAX_TAG_BYTES: usize = 128;

/// What the table needs to know of a region: the address range it reserved.
pub trait Reserved {
    fn base(&self) -> u64;
    fn capacity(&self) -> usize;

    fn contains(&self, address: u64) -> bool {
        address >= self.base() && address - self.base() < self.capacity() as u64
    }
}

/// One tag: its region and the device it lives on. Its slot is its index in the table.
#[derive(Clone, Debug)]
pub struct Entry<R> {
    pub tag: String,
    pub device: i32,
    pub region: R,
}

/// Tags in the order they were registered; a tag's index is its allocator slot.
#[derive(Debug)]
pub struct TagTable<R> {
    entries: Vec<Entry<R>>,
}

impl<R> Default for TagTable<R> {
    fn default() -> Self {
        Self {
            entries: Vec::new(),
        }
    }
}

/// `Ok` for a usable tag: non-empty, at most [`MAX_TAG_BYTES`], no control characters.
pub fn validate_tag(tag: &str) -> Result<(), Failure> {
    if tag.is_empty() {
        return Err(Failure::new(Kind::Error, "a tag must not be empty"));
    }
    if tag.len() > MAX_TAG_BYTES {
        return Err(Failure::new(
            Kind::Error,
            format!(
                "tag of {} bytes: at most {MAX_TAG_BYTES} are allowed",
                tag.len()
            ),
        ));
    }
    if tag.chars().any(char::is_control) {
        return Err(Failure::new(
            Kind::Error,
            format!("tag {tag:?} contains control characters"),
        ));
    }
    Ok(())
}

impl<R: Reserved> TagTable<R> {
    pub fn new() -> Self {
        Self::default()
    }

    pub fn len(&self) -> usize {
        self.entries.len()
    }

    pub fn is_empty(&self) -> bool {
        self.entries.is_empty()
    }

    /// Tags in registration (slot) order.
    pub fn tags(&self) -> Vec<&str> {
        self.entries.iter().map(|e| e.tag.as_str()).collect()
    }

    pub fn entries(&self) -> &[Entry<R>] {
        &self.entries
    }

    /// The allocator slot of `tag`, if registered.
    pub fn slot(&self, tag: &str) -> Option<usize> {
        self.entries.iter().position(|e| e.tag == tag)
    }

    /// The entry of `tag`, or [`Kind::UnknownTag`] listing the known tags.
    pub fn get(&self, tag: &str) -> Result<&Entry<R>, Failure> {
        self.entries
            .iter()
            .find(|e| e.tag == tag)
            .ok_or_else(|| Failure::unknown_tag(tag, &self.tags()))
    }

    /// The entry behind allocator slot `slot`.
    pub fn at_slot(&self, slot: usize) -> Result<&Entry<R>, Failure> {
        self.entries.get(slot).ok_or_else(|| {
            Failure::new(
                Kind::UnknownTag,
                format!(
                    "allocator slot {slot} has no region (only {} tags exist): \
                     use the pool that stablebuf.region(tag) creates",
                    self.entries.len()
                ),
            )
        })
    }

    /// The entry whose reservation contains `address`.
    pub fn owner(&self, address: u64) -> Option<&Entry<R>> {
        self.entries.iter().find(|e| e.region.contains(address))
    }

    /// Registers `tag` on `device`, creating its region with `create`, and returns its slot.
    /// An existing tag returns its slot (nothing is created) if it is on the same device: a tag
    /// names one region on one device, and asking for it from another device is a
    /// [`Kind::DeviceMismatch`] naming both. Regions of different tags may live on different
    /// devices.
    pub fn register(
        &mut self,
        tag: &str,
        device: i32,
        create: impl FnOnce() -> Result<R, Failure>,
    ) -> Result<usize, Failure> {
        validate_tag(tag)?;
        if let Some(slot) = self.slot(tag) {
            let home = self.entries[slot].device;
            if home != device {
                return Err(Failure::device_mismatch(tag, home, device));
            }
            return Ok(slot);
        }
        if self.entries.len() == MAX_TAGS {
            return Err(Failure::new(
                Kind::Error,
                format!("at most {MAX_TAGS} tags per process"),
            ));
        }
        let region = create()?;
        self.entries.push(Entry {
            tag: tag.to_string(),
            device,
            region,
        });
        Ok(self.entries.len() - 1)
    }

    /// The entries of `tags`, in the order given, duplicates dropped. All or nothing: one
    /// unknown tag fails the whole call, so nothing is done to the others.
    pub fn resolve<S: AsRef<str>>(&self, tags: &[S]) -> Result<Vec<&Entry<R>>, Failure> {
        let mut found: Vec<&Entry<R>> = Vec::with_capacity(tags.len());
        for tag in tags {
            let entry = self.get(tag.as_ref())?;
            if !found.iter().any(|e| e.tag == entry.tag) {
                found.push(entry);
            }
        }
        Ok(found)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[derive(Clone, Debug, PartialEq)]
    struct FakeRegion {
        base: u64,
        capacity: usize,
    }

    impl Reserved for FakeRegion {
        fn base(&self) -> u64 {
            self.base
        }
        fn capacity(&self) -> usize {
            self.capacity
        }
    }

    fn fake(base: u64) -> impl FnOnce() -> Result<FakeRegion, Failure> {
        move || {
            Ok(FakeRegion {
                base,
                capacity: 1 << 20,
            })
        }
    }

    #[test]
    fn slots_follow_registration_order_and_registering_again_is_a_lookup() {
        let mut table = TagTable::new();
        assert_eq!(table.register("weights", 0, fake(0x1000_0000)), Ok(0));
        assert_eq!(table.register("kv", 0, fake(0x2000_0000)), Ok(1));
        let mut created = false;
        let again = table.register("weights", 0, || {
            created = true;
            fake(0x3000_0000)()
        });
        assert_eq!(again, Ok(0));
        assert!(!created, "an existing tag creates no second region");
        assert_eq!(table.tags(), vec!["weights", "kv"]);
        assert_eq!(table.at_slot(1).unwrap().tag, "kv");
        assert_eq!(table.at_slot(2).unwrap_err().kind, Kind::UnknownTag);
    }

    #[test]
    fn addresses_find_their_region_and_nothing_else() {
        let mut table = TagTable::new();
        table.register("a", 0, fake(0x1000_0000)).unwrap();
        table.register("b", 0, fake(0x2000_0000)).unwrap();
        assert_eq!(table.owner(0x1000_0000).unwrap().tag, "a");
        assert_eq!(table.owner(0x1000_0000 + (1 << 20) - 1).unwrap().tag, "a");
        assert!(
            table.owner(0x1000_0000 + (1 << 20)).is_none(),
            "one past the end"
        );
        assert_eq!(table.owner(0x2000_0010).unwrap().tag, "b");
        assert!(table.owner(0x0fff_ffff).is_none());
        assert!(table.owner(u64::MAX).is_none(), "no overflow at the top");
    }

    #[test]
    fn resolve_is_all_or_nothing_and_drops_duplicates() {
        let mut table = TagTable::new();
        table.register("a", 0, fake(0x1000_0000)).unwrap();
        table.register("b", 0, fake(0x2000_0000)).unwrap();
        let found = table.resolve(&["b", "a", "b"]).unwrap();
        let names: Vec<&str> = found.iter().map(|e| e.tag.as_str()).collect();
        assert_eq!(names, vec!["b", "a"]);
        let failure = table.resolve(&["a", "nope"]).unwrap_err();
        assert_eq!(failure.kind, Kind::UnknownTag);
        assert!(failure.message.contains("nope") && failure.message.contains("a, b"));
        assert!(table.resolve::<&str>(&[]).unwrap().is_empty());
    }

    #[test]
    fn bad_tags_are_refused_without_creating_anything() {
        let mut table: TagTable<FakeRegion> = TagTable::new();
        for bad in ["", "tab\there", &"x".repeat(MAX_TAG_BYTES + 1)] {
            let failure = table
                .register(bad, 0, || panic!("nothing is created for a bad tag"))
                .unwrap_err();
            assert_eq!(failure.kind, Kind::Error, "{bad:?}");
        }
        assert!(table.is_empty());
    }

    #[test]
    fn tags_live_on_several_devices_but_a_tag_on_one_only() {
        let mut table: TagTable<FakeRegion> = TagTable::new();
        assert_eq!(table.register("a", 0, fake(0x1000_0000)), Ok(0));
        assert_eq!(table.register("b", 1, fake(0x2000_0000)), Ok(1));
        assert_eq!(table.at_slot(1).unwrap().device, 1);
        assert_eq!(
            table.register("b", 1, fake(0)),
            Ok(1),
            "the same device finds it"
        );
        let moved = table
            .register("a", 1, || {
                panic!("nothing is created for a tag of another device")
            })
            .unwrap_err();
        assert_eq!(moved.kind, Kind::DeviceMismatch, "{moved}");
        assert!(moved.message.contains("`a`"), "{moved}");
        assert!(
            moved.message.contains("device 0") && moved.message.contains("device 1"),
            "{moved}"
        );
        assert_eq!(table.len(), 2);
        assert_eq!(
            table.get("a").unwrap().device,
            0,
            "the tag stays where it was"
        );
    }

    #[test]
    fn a_failed_creation_registers_nothing() {
        let mut table: TagTable<FakeRegion> = TagTable::new();
        let failure = table
            .register("a", 0, || Err(Failure::new(Kind::Error, "no driver")))
            .unwrap_err();
        assert_eq!(failure.message, "no driver");
        assert!(table.is_empty());
        assert_eq!(table.register("a", 0, fake(0x1000)), Ok(0));
    }

    #[test]
    fn at_most_max_tags() {
        let mut table = TagTable::new();
        for n in 0..MAX_TAGS {
            let base = (n as u64 + 1) << 32;
            assert_eq!(table.register(&format!("t{n}"), 0, fake(base)), Ok(n));
        }
        let failure = table.register("one more", 0, fake(1)).unwrap_err();
        assert!(failure.message.contains(&MAX_TAGS.to_string()), "{failure}");
        assert_eq!(
            table.register("t3", 0, fake(1)),
            Ok(3),
            "existing tags still resolve"
        );
    }
}
