//! Property tests of the region state machine on the fake driver, which holds bytes: random
//! sequences of allocations, writes, frees, sleeps (pageable and discarded), wakes, snapshots,
//! binds, copy and remap switches, loads, unbinds, wakes onto a set, dropped sets and
//! publishes (a set exported, imported by another process and rewritten there through its own
//! mapping, the import kept or dropped), with driver failures injected at any call (a
//! `cuMemCreate` failure is an out-of-memory) and the device small enough to run out of memory
//! by itself.
//! After every step every byte the model knows is checked where the region reads it and in
//! every weight set the test holds, and the fake reports nothing the real driver would fault on
//! (a map over a mapped range, a copy to an unmapped address, an unmap under a running copy).
//! A failed operation must leave every byte and the region's state as they were.

use std::sync::Arc;

use bitvec::prelude::*;
use proptest::prelude::*;

use super::snapshot::{WeightSet, IMPORTED};
use super::state::{Fixed, RegionState};
use super::switch::{SwitchStrategy, Switched};
use crate::error::{Error, RegionError, ShareError};
use crate::fence::FencePolicy;
use crate::host::HostStorage;
use crate::ids::next_id;
use crate::vmm_core::fake::{Call, Fake, FakeStream};
use crate::vmm_core::{Backend, ReservedRange};

/// The fake's granule: small, so a sequence of hundreds of steps holds little host memory.
const G: usize = 4096;
const STREAM: FakeStream = FakeStream(7);

#[derive(Clone, Debug)]
enum Op {
    Alloc { bytes: usize },
    Write { pick: usize },
    Free { pick: usize },
    Sleep { discard: bool },
    Wake,
    Snapshot { shareable: bool },
    Bind { pick: usize },
    Switch { pick: usize, copy: bool },
    Load { pick: usize },
    Unbind,
    WakeOnto { pick: usize },
    DropSet { pick: usize },
    Publish { pick: usize, keep: bool },
    Fail { call: usize, skip: usize },
}

const CALLS: [Call; 10] = [
    Call::Reserve,
    Call::Create,
    Call::Map,
    Call::Access,
    Call::Wait,
    Call::Copy,
    Call::Save,
    Call::Load,
    Call::Export,
    Call::Import,
];

fn op() -> impl Strategy<Value = Op> {
    prop_oneof![
        6 => (1usize..5 * G).prop_map(|bytes| Op::Alloc { bytes }),
        6 => any::<usize>().prop_map(|pick| Op::Write { pick }),
        3 => any::<usize>().prop_map(|pick| Op::Free { pick }),
        2 => any::<bool>().prop_map(|discard| Op::Sleep { discard }),
        2 => Just(Op::Wake),
        3 => any::<bool>().prop_map(|shareable| Op::Snapshot { shareable }),
        3 => any::<usize>().prop_map(|pick| Op::Bind { pick }),
        3 => (any::<usize>(), any::<bool>()).prop_map(|(pick, copy)| Op::Switch { pick, copy }),
        2 => any::<usize>().prop_map(|pick| Op::Load { pick }),
        1 => Just(Op::Unbind),
        1 => any::<usize>().prop_map(|pick| Op::WakeOnto { pick }),
        1 => any::<usize>().prop_map(|pick| Op::DropSet { pick }),
        2 => (any::<usize>(), any::<bool>()).prop_map(|(pick, keep)| Op::Publish { pick, keep }),
        2 => (0..CALLS.len(), 0usize..3).prop_map(|(call, skip)| Op::Fail { call, skip }),
    ]
}

/// What each byte should hold, and whether anything says (not for fresh memory, after a
/// discarded sleep, or in the bytes of a set past what an allocation held when it was taken).
///
/// Bytes and a bit mask rather than `Vec<Option<u8>>`: [`check_known`] runs after every step
/// over every allocation and set, and comparing whole runs of known bytes (a `memcmp`) instead
/// of byte by byte makes this test several times faster in the unoptimized build CI runs.
#[derive(Clone, Debug, PartialEq)]
struct Known {
    bytes: Vec<u8>,
    known: BitVec<u64, Lsb0>,
}

impl Known {
    /// `len` bytes of which nothing is known.
    fn unknown(len: usize) -> Self {
        Self {
            bytes: vec![0; len],
            known: bitvec![u64, Lsb0; 0; len],
        }
    }

    /// Exactly `data`, every byte known.
    fn written(data: &[u8]) -> Self {
        Self {
            bytes: data.to_vec(),
            known: bitvec![u64, Lsb0; 1; data.len()],
        }
    }

    fn len(&self) -> usize {
        self.bytes.len()
    }

    /// Nothing is known any more.
    fn forget(&mut self) {
        self.known.fill(false);
    }

    /// `data` lands from byte `at`; what would fall past the end is dropped.
    fn write(&mut self, at: usize, data: &[u8]) {
        let at = at.min(self.len());
        let n = data.len().min(self.len() - at);
        self.bytes[at..at + n].copy_from_slice(&data[..n]);
        self.known[at..at + n].fill(true);
    }

    /// `other` (known and unknown bytes alike) lands from byte `at`, clipped at the end.
    fn place(&mut self, at: usize, other: &Known) {
        let at = at.min(self.len());
        let n = other.len().min(self.len() - at);
        self.bytes[at..at + n].copy_from_slice(&other.bytes[..n]);
        self.known[at..at + n].copy_from_bitslice(&other.known[..n]);
    }

    /// The `len` bytes from `at`; those past the end are unknown.
    fn slice(&self, at: usize, len: usize) -> Known {
        let mut out = Known::unknown(len);
        if at < self.len() {
            let n = len.min(self.len() - at);
            out.bytes[..n].copy_from_slice(&self.bytes[at..at + n]);
            out.known[..n].copy_from_bitslice(&self.known[at..at + n]);
        }
        out
    }

    /// The runs of known bytes, as ranges, in order.
    fn known_runs(&self) -> impl Iterator<Item = std::ops::Range<usize>> + '_ {
        let mut from = 0;
        std::iter::from_fn(move || {
            let start = from + self.known[from..].first_one()?;
            let end = self.known[start..]
                .first_zero()
                .map_or(self.len(), |n| start + n);
            from = end;
            Some(start..end)
        })
    }
}

#[derive(Clone, Debug)]
struct Allocation {
    address: u64,
    asked: usize,
    bytes: Known,
}

#[derive(Clone, Debug)]
struct Set {
    handle: Arc<WeightSet<Fake>>,
    /// From the region's base, the set's whole length.
    bytes: Known,
}

#[derive(Clone, Debug, Default)]
struct Model {
    allocations: Vec<Allocation>,
    sets: Vec<Set>,
    /// `Some(discarded)` while asleep.
    asleep: Option<bool>,
    unbound: bool,
    writes: u64,
    /// Sets another process imported and still holds (their memory lives on without the
    /// region's handle).
    imports: Vec<Arc<WeightSet<Fake>>>,
}

impl Model {
    fn replayable(&self) -> bool {
        self.asleep.is_none() && !self.unbound
    }

    /// The region's bytes as they would read now from `base`, `span` long.
    fn region_bytes(&self, base: u64, span: usize) -> Known {
        let mut out = Known::unknown(span);
        for a in &self.allocations {
            out.place((a.address - base) as usize, &a.bytes);
        }
        out
    }

    /// The region now reads `source` (from its base) in every allocation.
    fn read_from(&mut self, base: u64, source: &Known) {
        for a in &mut self.allocations {
            a.bytes = source.slice((a.address - base) as usize, a.bytes.len());
        }
    }
}

/// Which held set is mapped under the region now (writes to the region land in it).
fn bound_set(state: &RegionState<Fake>, model: &Model) -> Option<usize> {
    let bound = state.bound()?;
    model
        .sets
        .iter()
        .position(|s| Arc::ptr_eq(&s.handle, &bound))
}

fn pattern(write: u64, len: usize) -> Vec<u8> {
    let mut x = write.wrapping_mul(0x9e37_79b9_7f4a_7c15) | 1;
    (0..len)
        .map(|_| {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            (x >> 24) as u8 & 0x7f // never a fresh chunk's byte (0x80 and up)
        })
        .collect()
}

fn check_known(what: &str, got: &[u8], want: &Known) -> Result<(), TestCaseError> {
    prop_assert_eq!(got.len(), want.len(), "{}: length", what);
    for run in want.known_runs() {
        if got[run.clone()] != want.bytes[run.clone()] {
            // Byte by byte only once the run is known to differ, to name the first byte.
            for i in run {
                prop_assert_eq!(
                    got[i],
                    want.bytes[i],
                    "{}: byte {} of {}",
                    what,
                    i,
                    want.len()
                );
            }
        }
    }
    Ok(())
}

fn check(
    fake: &Fake,
    fixed: &Fixed<Fake>,
    state: &RegionState<Fake>,
    model: &Model,
) -> Result<(), TestCaseError> {
    prop_assert_eq!(fake.violations(), Vec::<String>::new());
    let stats = state.stats(fixed);
    prop_assert_eq!(stats.asleep, model.asleep.is_some());
    prop_assert_eq!(stats.allocations, model.allocations.len());
    prop_assert_eq!(
        state.check_replayable(fixed).is_ok(),
        model.replayable(),
        "replayable"
    );
    for a in &model.allocations {
        let read = fake.read(a.address, a.asked);
        if model.replayable() {
            let read = read.ok_or_else(|| {
                TestCaseError::fail(format!("allocation {:#x} unmapped", a.address))
            })?;
            check_known(&format!("allocation {:#x}", a.address), &read, &a.bytes)?;
        } else {
            prop_assert!(
                read.is_none(),
                "allocation {:#x} mapped while asleep or unbound",
                a.address
            );
        }
    }
    for (i, set) in model.sets.iter().enumerate() {
        let got = fake.contents(&set.handle.memory, 0, set.bytes.len());
        check_known(&format!("set {i}"), &got, &set.bytes)?;
    }
    Ok(())
}

/// Runs one step; returns whether it succeeded. On success the model follows it; on failure
/// nothing may have changed.
fn step(
    fake: &Fake,
    fixed: &Fixed<Fake>,
    state: &mut RegionState<Fake>,
    model: &mut Model,
    op: &Op,
) -> Result<bool, TestCaseError> {
    let base = fixed.reservation.base();
    let pick_set = |pick: usize| (!model.sets.is_empty()).then(|| pick % model.sets.len());
    let ok = match *op {
        Op::Alloc { bytes } => match state.alloc(fixed, bytes) {
            Ok(address) => {
                prop_assert!(model.replayable(), "alloc while asleep or unbound");
                model.allocations.push(Allocation {
                    address,
                    asked: bytes,
                    bytes: Known::unknown(bytes),
                });
                true
            }
            Err(_) => false,
        },
        Op::Write { pick } => {
            if model.allocations.is_empty() {
                return Ok(true);
            }
            let i = pick % model.allocations.len();
            model.writes += 1;
            let (address, asked) = (model.allocations[i].address, model.allocations[i].asked);
            let data = pattern(model.writes, asked);
            let written = fake.write(address, &data);
            prop_assert_eq!(
                written,
                model.replayable(),
                "a write faults iff not replayable"
            );
            if written {
                model.allocations[i].bytes = Known::written(&data);
                if let Some(k) = bound_set(state, model) {
                    model.sets[k].bytes.write((address - base) as usize, &data);
                }
            }
            written
        }
        Op::Free { pick } => {
            if model.allocations.is_empty() {
                return Ok(true);
            }
            let i = pick % model.allocations.len();
            match state.free(fixed, model.allocations[i].address) {
                Ok(asked) => {
                    prop_assert_eq!(asked, model.allocations[i].asked);
                    model.allocations.remove(i);
                    true
                }
                Err(_) => false,
            }
        }
        Op::Sleep { discard } => {
            let storage = if discard {
                HostStorage::Discard
            } else {
                HostStorage::Pageable
            };
            match state.sleep(fixed, &storage, &STREAM) {
                Ok(_) => {
                    if model.asleep.is_none() {
                        prop_assert!(!model.unbound, "an unbound region slept");
                        model.asleep = Some(discard);
                    }
                    true
                }
                Err(_) => false,
            }
        }
        Op::Wake => match state.wake(fixed, &STREAM) {
            Ok(_) => {
                if model.asleep.take() == Some(true) {
                    for a in &mut model.allocations {
                        a.bytes.forget();
                    }
                }
                true
            }
            Err(_) => false,
        },
        Op::Snapshot { shareable } => match state.snapshot(fixed, &STREAM, shareable) {
            Ok(handle) => {
                prop_assert!(model.replayable(), "a snapshot while asleep or unbound");
                let bytes = model.region_bytes(base, handle.bytes());
                model.sets.push(Set { handle, bytes });
                true
            }
            Err(_) => false,
        },
        Op::Bind { pick } => {
            let Some(k) = pick_set(pick) else {
                return Ok(true);
            };
            let handle = model.sets[k].handle.clone();
            match state.bind(fixed, &handle) {
                Ok(()) => {
                    prop_assert!(model.asleep.is_none(), "bound while asleep");
                    let source = model.sets[k].bytes.clone();
                    model.read_from(base, &source);
                    model.unbound = false;
                    true
                }
                Err(_) => false,
            }
        }
        Op::Switch { pick, copy } => {
            let Some(k) = pick_set(pick) else {
                return Ok(true);
            };
            let handle = model.sets[k].handle.clone();
            let strategy = if copy {
                SwitchStrategy::Copy
            } else {
                SwitchStrategy::Remap
            };
            match state.switch_to(fixed, &handle, strategy, None, &STREAM) {
                Ok(way) => {
                    prop_assert!(model.asleep.is_none(), "switched while asleep");
                    if !copy {
                        prop_assert_eq!(way, Switched::Remapped);
                    }
                    let source = model.sets[k].bytes.clone();
                    model.read_from(base, &source);
                    model.unbound = false;
                    true
                }
                Err(_) => false,
            }
        }
        Op::Load { pick } => {
            let Some(k) = pick_set(pick) else {
                return Ok(true);
            };
            let handle = model.sets[k].handle.clone();
            let into = bound_set(state, model);
            let span = state.stats(fixed).span;
            match state.load(fixed, &handle, &STREAM) {
                Ok(()) => {
                    prop_assert!(model.replayable(), "a load while asleep or unbound");
                    let source = model.sets[k].bytes.clone();
                    model.read_from(base, &source);
                    if let Some(j) = into.filter(|&j| j != k) {
                        model.sets[j].bytes.place(0, &source.slice(0, span));
                    }
                    true
                }
                Err(_) => false,
            }
        }
        Op::Unbind => match state.unbind(fixed) {
            Ok(()) => {
                prop_assert!(model.asleep.is_none(), "unbound while asleep");
                model.unbound = true;
                true
            }
            Err(_) => false,
        },
        Op::WakeOnto { pick } => {
            let Some(k) = pick_set(pick) else {
                return Ok(true);
            };
            let handle = model.sets[k].handle.clone();
            match state.wake_onto(fixed, &handle) {
                Ok(()) => {
                    prop_assert!(model.asleep.is_some(), "woke an awake region onto a set");
                    let source = model.sets[k].bytes.clone();
                    model.read_from(base, &source);
                    model.asleep = None;
                    model.unbound = false;
                    true
                }
                Err(_) => false,
            }
        }
        Op::DropSet { pick } => {
            if let Some(k) = pick_set(pick) {
                model.sets.remove(k);
            }
            true
        }
        Op::Publish { pick, keep } => {
            let Some(k) = pick_set(pick) else {
                return Ok(true);
            };
            let memory = model.sets[k].handle.memory.clone();
            let export = match fake.export(&memory) {
                Ok(export) => {
                    prop_assert!(memory.shareable(), "memory made without shareable exported");
                    export
                }
                Err(error) => {
                    if !memory.shareable() {
                        prop_assert!(
                            matches!(error, Error::Share(ShareError::NotShareable)),
                            "exporting a set made without shareable: {error}"
                        );
                    }
                    return Ok(false);
                }
            };
            // The other process: its own handle to the memory, mapped at its own address.
            let imported = match fake.import(&export) {
                Ok(memory) => WeightSet::new(next_id(), IMPORTED, fake, memory),
                Err(_) => return Ok(false),
            };
            drop(export);
            let Ok(home) = imported.home_ptr() else {
                return Ok(false);
            };
            model.writes += 1;
            let data = pattern(model.writes, imported.bytes());
            prop_assert!(fake.write(home, &data), "the importer's own mapping faults");
            // The region reads the new version where the set is mapped under it.
            if model.replayable() && bound_set(state, model) == Some(k) {
                for a in &mut model.allocations {
                    let offset = ((a.address - base) as usize).min(data.len());
                    a.bytes.write(0, &data[offset..]);
                }
            }
            model.sets[k].bytes = Known::written(&data);
            if keep {
                model.imports.push(imported);
            }
            true
        }
        Op::Fail { call, skip } => {
            fake.fail(CALLS[call], skip);
            true
        }
    };
    Ok(ok)
}

/// [`Known`] against the plain `Vec<Option<u8>>` it stands for, so the fast model is the model.
mod known_model {
    use super::*;

    type Plain = Vec<Option<u8>>;

    fn plain(known: &Known) -> Plain {
        (0..known.len())
            .map(|i| known.known[i].then_some(known.bytes[i]))
            .collect()
    }

    #[derive(Clone, Debug)]
    enum KnownOp {
        Write { at: usize, data: Vec<u8> },
        Place { at: usize, from: usize, len: usize },
        Forget,
    }

    fn known_op() -> impl Strategy<Value = KnownOp> {
        prop_oneof![
            4 => (0usize..80, prop::collection::vec(0u8..0x80, 0..40))
                .prop_map(|(at, data)| KnownOp::Write { at, data }),
            3 => (0usize..80, 0usize..80, 0usize..80)
                .prop_map(|(at, from, len)| KnownOp::Place { at, from, len }),
            1 => Just(KnownOp::Forget),
        ]
    }

    proptest! {
        #![proptest_config(crate::testing::proptest_config(256))]

        #[test]
        fn known_follows_a_byte_per_option_model(
            len in 0usize..70,
            ops in prop::collection::vec(known_op(), 0..24),
            flip in any::<prop::sample::Index>(),
        ) {
            let mut known = Known::unknown(len);
            let mut model: Plain = vec![None; len];
            for op in &ops {
                match op {
                    KnownOp::Write { at, data } => {
                        known.write(*at, data);
                        for (j, &b) in data.iter().enumerate() {
                            if let Some(slot) = model.get_mut(at + j) {
                                *slot = Some(b);
                            }
                        }
                    }
                    KnownOp::Place { at, from, len } => {
                        // A piece of itself, as the model places one allocation's bytes.
                        let piece = known.slice(*from, *len);
                        let plain_piece: Plain =
                            (0..*len).map(|i| model.get(from + i).copied().flatten()).collect();
                        prop_assert_eq!(plain(&piece), plain_piece.clone());
                        known.place(*at, &piece);
                        for (j, b) in plain_piece.into_iter().enumerate() {
                            if let Some(slot) = model.get_mut(at + j) {
                                *slot = b;
                            }
                        }
                    }
                    KnownOp::Forget => {
                        known.forget();
                        model.iter_mut().for_each(|b| *b = None);
                    }
                }
                prop_assert_eq!(plain(&known), model.clone());
            }
            // The check passes on the bytes it knows, whatever the unknown ones hold, and fails
            // on any known byte that differs.
            let mut got: Vec<u8> = model.iter().map(|b| b.unwrap_or(0xff)).collect();
            prop_assert!(check_known("same", &got, &known).is_ok());
            if !got.is_empty() {
                let i = flip.index(got.len());
                got[i] ^= 0x01;
                prop_assert_eq!(check_known("one flipped", &got, &known).is_ok(), model[i].is_none());
            }
        }
    }
}

fn region(fake: &Fake, capacity_granules: usize) -> (Fixed<Fake>, RegionState<Fake>) {
    let reservation = fake
        .reserve(capacity_granules * G, G)
        .expect("the fake reserves");
    let fixed = Fixed {
        id: next_id(),
        tag: "fake".into(),
        backend: fake.clone(),
        granularity: G,
        reservation,
    };
    let state = RegionState::new(&fixed, fake.fence(FencePolicy::Context));
    (fixed, state)
}

proptest! {
    #![proptest_config(crate::testing::proptest_config(256))]

    #[test]
    fn every_byte_a_region_reads_matches_the_model_under_random_operations_and_failures(
        device_granules in 12usize..96,
        ops in prop::collection::vec(op(), 1..160),
    ) {
        let fake = Fake::with_granularity(device_granules * G, G);
        let (fixed, mut state) = region(&fake, 256);
        let mut model = Model::default();
        for (n, op) in ops.iter().enumerate() {
            // On a refusal the model stays as it was, so the check below is that every byte is.
            let ok = step(&fake, &fixed, &mut state, &mut model, op)?;
            if !matches!(op, Op::Fail { .. }) {
                fake.clear_failure();
            }
            check(&fake, &fixed, &state, &model)
                .map_err(|e| TestCaseError::fail(format!("after step {n} {op:?} ({}): {e}", if ok { "ok" } else { "refused" })))?;
        }
        fake.clear_failure();
        state.release_all(&fixed);
        drop(state);
        model.sets.clear();
        model.imports.clear();
        prop_assert_eq!(fake.violations(), Vec::<String>::new());
        prop_assert_eq!(fake.live_mappings(), 0, "mappings left after the region and its sets dropped");
        prop_assert_eq!(fake.live_chunks(), 0, "memory left after the region and its sets dropped");
    }
}

/// Issue 33's shortest sequence on the fake driver (the GPU twin is
/// `gpu_region::a_snapshot_bound_over_a_longer_allocation_in_the_same_granules_reads_its_own_bytes`):
/// a set taken over a short allocation, bound after a longer one took the same granules, reads
/// the short allocation's bytes and, past its end, the stale bytes the set held; through a
/// pageable sleep, a refused snapshot, a wake and a free of another allocation.
#[test]
fn a_set_bound_over_a_longer_allocation_in_the_same_granules_reads_its_own_bytes() {
    let fake = Fake::with_granularity(64 * G, G);
    let (fixed, mut state) = region(&fake, 64);
    // The failing seed's lengths scaled to the fake's granule: both take two granules.
    let (short, long) = (G + 405, 2 * G - 300);
    let first = state.alloc(&fixed, G).unwrap();
    let first_data = pattern(1, G);
    assert!(fake.write(first, &first_data));
    let stale_owner = state.alloc(&fixed, long).unwrap();
    let stale = pattern(2, long);
    assert!(fake.write(stale_owner, &stale));
    drop(state.snapshot(&fixed, &STREAM, false).unwrap()); // folds everything into the span
    state.free(&fixed, stale_owner).unwrap();
    let old = state.alloc(&fixed, short).unwrap();
    assert_eq!(old, stale_owner, "the hole inside the span is reused");
    let old_data = pattern(3, short);
    assert!(fake.write(old, &old_data));
    let set = state.snapshot(&fixed, &STREAM, false).unwrap();
    state.free(&fixed, old).unwrap();
    let new = state.alloc(&fixed, long).unwrap();
    assert_eq!(new, old, "the longer allocation takes the same granules");
    assert!(fake.write(new, &pattern(4, long)));
    state.bind(&fixed, &set).unwrap();
    let mut want = old_data.clone();
    want.extend_from_slice(&stale[short..]);
    let read_all = |what: &str| {
        assert_eq!(fake.read(new, long).as_deref(), Some(&want[..]), "{what}");
        assert_eq!(
            fake.read(first, G).as_deref(),
            Some(&first_data[..]),
            "{what}: first"
        );
    };
    read_all("bound");
    state
        .sleep(&fixed, &HostStorage::Pageable, &STREAM)
        .unwrap();
    assert!(matches!(
        state.snapshot(&fixed, &STREAM, false),
        Err(Error::Region(RegionError::RegionAsleep { .. }))
    ));
    state.wake(&fixed, &STREAM).unwrap();
    read_all("after a pageable sleep, a refused snapshot and a wake");
    state.free(&fixed, first).unwrap();
    assert_eq!(
        fake.read(new, long).as_deref(),
        Some(&want[..]),
        "after a free"
    );
    assert!(fake.violations().is_empty(), "{:?}", fake.violations());
    state.release_all(&fixed);
    drop((state, set));
    assert_eq!((fake.live_mappings(), fake.live_chunks()), (0, 0));
}

/// A publish on the fake driver: a shareable set bound under the region, exported, imported by
/// another process and rewritten there through its own mapping, is what the region reads; the
/// imported memory outlives the region's handle; a set made without `shareable` is refused.
#[test]
fn a_published_set_rewritten_by_its_importer_is_what_the_region_reads() {
    let fake = Fake::with_granularity(64 * G, G);
    let (fixed, mut state) = region(&fake, 64);
    let at = state.alloc(&fixed, 3 * G).unwrap();
    assert!(fake.write(at, &pattern(1, 3 * G)));
    let private = state.snapshot(&fixed, &STREAM, false).unwrap();
    assert!(matches!(
        fake.export(&private.memory),
        Err(Error::Share(ShareError::NotShareable))
    ));
    let shared = state.snapshot(&fixed, &STREAM, true).unwrap();
    state.bind(&fixed, &shared).unwrap();
    let export = fake.export(&shared.memory).unwrap();
    let imported = WeightSet::new(next_id(), IMPORTED, &fake, fake.import(&export).unwrap());
    drop(export);
    let next = pattern(2, imported.bytes());
    assert!(fake.write(imported.home_ptr().unwrap(), &next));
    assert_eq!(
        fake.read(at, 3 * G).as_deref(),
        Some(&next[..3 * G]),
        "the region reads the importer's writes"
    );
    // An imported set belongs to no region here: binding it is refused, nothing changes.
    assert!(state.bind(&fixed, &imported).is_err());
    assert_eq!(fake.read(at, 3 * G).as_deref(), Some(&next[..3 * G]));
    state.bind(&fixed, &private).unwrap();
    assert_eq!(
        fake.read(at, 3 * G).as_deref(),
        Some(&pattern(1, 3 * G)[..])
    );
    let chunks = fake.live_chunks();
    drop(shared);
    assert_eq!(
        fake.live_chunks(),
        chunks,
        "the importer still holds the published memory"
    );
    assert_eq!(fake.contents(&imported.memory, 0, 3 * G), &next[..3 * G]);
    drop(imported);
    assert_eq!(fake.live_chunks(), chunks - 1);
    assert!(fake.violations().is_empty(), "{:?}", fake.violations());
    state.release_all(&fixed);
    drop((state, private));
    assert_eq!((fake.live_mappings(), fake.live_chunks()), (0, 0));
}
