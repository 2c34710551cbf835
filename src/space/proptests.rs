//! Property tests of a space and its datasets on the fake driver, which holds bytes: random
//! sequences of writes (to a dataset's home address, and through a bound remap group), binds
//! (remap and copy-in groups), unbinds, lone offloads (kept or discarded) and restores, sleeps
//! and wakes of the space, with a driver failure injected at any call and a device small enough
//! to run out of memory by itself. After every step every byte the model knows is checked
//! where the datasets and the space read it, the space's bookkeeping against the model, and
//! the fake reports nothing the real driver would fault on (an unmap under a running copy, a
//! copy to an unmapped address, a map over a mapped range). A failed operation is a typed error
//! and leaves everything as it was (but for what the docs allow: a copy-in bind that fails in
//! its copy leaves the group unbound; a failed wake keeps what it restored and bound).

use std::sync::Arc;

use proptest::prelude::*;

use super::SpaceShared;
use crate::dataset::DatasetCore;
use crate::driver::vmm::Location;
use crate::fence::FencePolicy;
use crate::host::HostStorage;
use crate::layout::{Layout, Placement};
use crate::strategy::BindStrategy;
use crate::vmm_core::fake::{Call, Fake, FakeStream};
use crate::vmm_core::ReservedRange;

const G: usize = 4096;
const STREAM: FakeStream = FakeStream(3);
/// Datasets per group.
const PER_GROUP: usize = 3;

const CALLS: [Call; 8] = [
    Call::Create,
    Call::Map,
    Call::Access,
    Call::Wait,
    Call::Copy,
    Call::Save,
    Call::Load,
    Call::Reserve,
];

#[derive(Clone, Debug)]
enum Op {
    Write {
        d: usize,
        at: usize,
        len: usize,
        byte: u8,
    },
    WriteSpace {
        g: usize,
        at: usize,
        len: usize,
        byte: u8,
    },
    Bind {
        d: usize,
    },
    Unbind {
        g: usize,
    },
    Offload {
        d: usize,
        discard: bool,
    },
    Restore {
        d: usize,
    },
    Sleep {
        mask: u8,
        discard: bool,
    },
    Wake {
        mask: u8,
    },
    Fail {
        call: usize,
        skip: usize,
    },
}

fn op() -> impl Strategy<Value = Op> {
    let d = 0..2 * PER_GROUP;
    prop_oneof![
        3 => (d.clone(), 0usize..3 * G, 1usize..600, 0u8..0x80)
            .prop_map(|(d, at, len, byte)| Op::Write { d, at, len, byte }),
        2 => (0usize..2, 0usize..3 * G, 1usize..600, 0u8..0x80)
            .prop_map(|(g, at, len, byte)| Op::WriteSpace { g, at, len, byte }),
        4 => d.clone().prop_map(|d| Op::Bind { d }),
        1 => (0usize..2).prop_map(|g| Op::Unbind { g }),
        2 => (d.clone(), any::<bool>()).prop_map(|(d, discard)| Op::Offload { d, discard }),
        2 => d.prop_map(|d| Op::Restore { d }),
        2 => (any::<u8>(), prop::bool::weighted(0.2))
            .prop_map(|(mask, discard)| Op::Sleep { mask, discard }),
        2 => any::<u8>().prop_map(|mask| Op::Wake { mask }),
        2 => (0..CALLS.len(), 0usize..3).prop_map(|(call, skip)| Op::Fail { call, skip }),
    ]
}

/// What the test knows of one dataset: its bytes (`None`: unknown) and whether it is resident.
#[derive(Clone, Debug, PartialEq)]
struct DatasetModel {
    bytes: Vec<Option<u8>>,
    resident: bool,
}

#[derive(Clone, Debug, PartialEq)]
struct Model {
    datasets: Vec<DatasetModel>,
    /// The dataset under each group.
    bound: Vec<Option<usize>>,
    /// A copy-in group's bytes (the inputs copied at its bind).
    copied: Vec<Vec<Option<u8>>>,
    /// While asleep: what each group had bound at the sleep.
    asleep: Option<Vec<Option<usize>>>,
}

struct World {
    fake: Fake,
    placement: Placement,
    space: Arc<SpaceShared<Fake>>,
    datasets: Vec<DatasetCore<Fake>>,
    strategies: Vec<BindStrategy>,
}

fn layout() -> Layout {
    Layout::builder()
        .group("a")
        .input("a1", 5000)
        .output("a2", 300)
        .group("b")
        .input("b1", 3000)
        .input("b2", 100)
        .scratch("s", 2000)
        .build()
        .expect("a valid layout")
}

fn world(fake: &Fake, copy_in: [bool; 2]) -> World {
    let layout = layout();
    let placement = layout.place(G).expect("placed");
    let strategies: Vec<BindStrategy> = copy_in
        .iter()
        .map(|&c| {
            if c {
                BindStrategy::CopyIn
            } else {
                BindStrategy::Remap
            }
        })
        .collect();
    let fingerprint = layout.fingerprint();
    let space = SpaceShared::new(
        fake.clone(),
        layout,
        placement.clone(),
        strategies.clone(),
        FencePolicy::Context,
        false,
        vec![0],
    )
    .expect("the fake device has room for the space");
    let datasets = (0..2 * PER_GROUP)
        .map(|d| {
            DatasetCore::new(
                fake.clone(),
                fingerprint,
                &placement,
                d / PER_GROUP,
                false,
                Location::Device(0),
            )
            .expect("the fake device has room for the datasets")
        })
        .collect();
    World {
        fake: fake.clone(),
        placement,
        space: Arc::new(space),
        datasets,
        strategies,
    }
}

impl World {
    fn group_of(&self, d: usize) -> usize {
        d / PER_GROUP
    }

    fn bound(&self) -> Vec<Option<usize>> {
        let state = self.space.lock();
        state
            .backings
            .iter()
            .map(|b| {
                b.dataset()
                    .map(|id| self.datasets.iter().position(|d| d.id() == id).unwrap())
            })
            .collect()
    }

    fn group_base(&self, g: usize) -> u64 {
        self.space.reservation.base() + self.placement.groups[g].offset as u64
    }

    fn chosen(&mut self, mask: u8) -> Vec<&mut DatasetCore<Fake>> {
        self.datasets
            .iter_mut()
            .enumerate()
            .filter(|(d, _)| mask & (1 << d) != 0)
            .map(|(_, d)| d)
            .collect()
    }
}

fn storage(discard: bool) -> HostStorage {
    if discard {
        HostStorage::Discard
    } else {
        HostStorage::Pageable
    }
}

/// Applies `op` to the world and the model; returns whether it succeeded.
fn step(w: &mut World, m: &mut Model, op: &Op) -> Result<bool, TestCaseError> {
    let ok = match *op {
        Op::Fail { call, skip } => {
            w.fake.fail(CALLS[call], skip);
            true
        }
        Op::Write { d, at, len, byte } => {
            let size = w.datasets[d].bytes();
            let (at, len) = (at.min(size - 1), len.min(size - at.min(size - 1)));
            let Ok(home) = w.datasets[d].home_ptr() else {
                prop_assert!(!m.datasets[d].resident);
                return Ok(false);
            };
            prop_assert!(w.fake.write(home + at as u64, &vec![byte; len]));
            m.datasets[d].bytes[at..at + len].fill(Some(byte));
            true
        }
        Op::WriteSpace { g, at, len, byte } => {
            // A kernel writing through the space: only into a bound remap group while awake.
            let Some(d) = m.bound[g] else {
                return Ok(false);
            };
            if w.strategies[g] != BindStrategy::Remap || m.asleep.is_some() {
                return Ok(false);
            }
            let size = w.placement.groups[g].bytes;
            let (at, len) = (at.min(size - 1), len.min(size - at.min(size - 1)));
            prop_assert!(w.fake.write(w.group_base(g) + at as u64, &vec![byte; len]));
            m.datasets[d].bytes[at..at + len].fill(Some(byte));
            true
        }
        Op::Bind { d } => {
            let g = w.group_of(d);
            let before = w.bound()[g];
            match w.space.bind_noted(&w.datasets[d], None) {
                Ok(()) => {
                    prop_assert!(m.datasets[d].resident, "bound an offloaded dataset");
                    if w.strategies[g] == BindStrategy::CopyIn && before != Some(d) {
                        let mut copied = vec![None; w.placement.groups[g].bytes];
                        for (offset, bytes) in w.datasets[d].input_runs() {
                            copied[offset..offset + bytes]
                                .copy_from_slice(&m.datasets[d].bytes[offset..offset + bytes]);
                        }
                        m.copied[g] = copied;
                    }
                    m.bound[g] = Some(d);
                    true
                }
                Err(_) => {
                    // Documented: a copy-in bind whose copy fails leaves the group unbound.
                    if w.strategies[g] == BindStrategy::CopyIn && w.bound()[g].is_none() {
                        m.bound[g] = None;
                    }
                    false
                }
            }
        }
        Op::Unbind { g } => match w.space.unbind_group(g, None) {
            Ok(_) => {
                m.bound[g] = None;
                true
            }
            Err(_) => false,
        },
        Op::Offload { d, discard } => match w.datasets[d].offload(&storage(discard), &STREAM) {
            Ok(_) => {
                if m.datasets[d].resident {
                    m.datasets[d].resident = false;
                    if discard {
                        m.datasets[d].bytes.fill(None);
                    }
                    for bound in &mut m.bound {
                        if *bound == Some(d) {
                            *bound = None;
                        }
                    }
                }
                true
            }
            Err(_) => false,
        },
        Op::Restore { d } => match w.datasets[d].restore(&STREAM) {
            Ok(_) => {
                m.datasets[d].resident = true;
                true
            }
            Err(_) => false,
        },
        Op::Sleep { mask, discard } => {
            let space = w.space.clone();
            let result = space.sleep(w.chosen(mask), &storage(discard), &STREAM);
            match result {
                Ok(reports) => {
                    if m.asleep.is_none() {
                        m.asleep = Some(m.bound.clone());
                        let mut offloaded = 0;
                        for g in 0..m.bound.len() {
                            if let Some(d) = m.bound[g].filter(|d| mask & (1 << d) != 0) {
                                m.datasets[d].resident = false;
                                if discard {
                                    m.datasets[d].bytes.fill(None);
                                }
                                m.bound[g] = None;
                                offloaded += 1;
                            }
                        }
                        prop_assert_eq!(reports.len(), offloaded);
                    } else {
                        prop_assert!(reports.is_empty());
                    }
                    true
                }
                Err(_) => false,
            }
        }
        Op::Wake { mask } => {
            let space = w.space.clone();
            let result = space.wake(w.chosen(mask), &STREAM);
            match result {
                Ok(_) => {
                    if let Some(asleep) = m.asleep.take() {
                        for (g, d) in asleep.into_iter().enumerate() {
                            if let Some(d) = d.filter(|d| mask & (1 << d) != 0) {
                                m.datasets[d].resident = true;
                                if w.strategies[g] == BindStrategy::CopyIn && m.bound[g] != Some(d)
                                {
                                    let mut copied = vec![None; w.placement.groups[g].bytes];
                                    for (offset, bytes) in w.datasets[d].input_runs() {
                                        copied[offset..offset + bytes].copy_from_slice(
                                            &m.datasets[d].bytes[offset..offset + bytes],
                                        );
                                    }
                                    m.copied[g] = copied;
                                }
                                m.bound[g] = Some(d);
                            }
                        }
                    }
                    true
                }
                Err(_) => {
                    // Documented: still asleep; what was restored and bound stays so. Follow
                    // the world there (the bytes are checked below).
                    prop_assert!(w.space.lock().sleeping.is_some());
                    let bound = w.bound();
                    for (d, dataset) in w.datasets.iter().enumerate() {
                        if dataset.is_resident() && !m.datasets[d].resident {
                            m.datasets[d].resident = true;
                        }
                    }
                    for (g, now) in bound.into_iter().enumerate() {
                        if now != m.bound[g] {
                            // A copy-in bind whose copy failed leaves its group unbound.
                            let Some(d) = now else {
                                prop_assert_eq!(w.strategies[g], BindStrategy::CopyIn);
                                m.bound[g] = None;
                                continue;
                            };
                            if w.strategies[g] == BindStrategy::CopyIn {
                                let mut copied = vec![None; w.placement.groups[g].bytes];
                                for (offset, bytes) in w.datasets[d].input_runs() {
                                    copied[offset..offset + bytes].copy_from_slice(
                                        &m.datasets[d].bytes[offset..offset + bytes],
                                    );
                                }
                                m.copied[g] = copied;
                            }
                            m.bound[g] = Some(d);
                        }
                    }
                    false
                }
            }
        }
    };
    Ok(ok)
}

fn check_bytes(what: &str, got: &[u8], want: &[Option<u8>]) -> Result<(), TestCaseError> {
    prop_assert_eq!(got.len(), want.len());
    if let Some(i) = (0..got.len()).find(|&i| want[i].is_some_and(|b| b != got[i])) {
        prop_assert!(
            false,
            "{}: byte {} is {:#x}, the model says {:#x}",
            what,
            i,
            got[i],
            want[i].unwrap()
        );
    }
    Ok(())
}

fn check(w: &World, m: &Model) -> Result<(), TestCaseError> {
    prop_assert_eq!(w.fake.violations(), Vec::<String>::new());
    prop_assert_eq!(w.bound(), m.bound.clone(), "the groups' datasets");
    prop_assert_eq!(w.space.lock().sleeping.is_some(), m.asleep.is_some());
    {
        let state = w.space.lock();
        for (g, bound) in m.bound.iter().enumerate() {
            prop_assert_eq!(state.bound[g], bound.is_some());
        }
        // Awake, the scratch is there (a failed wake may have made it already).
        prop_assert!(
            state.scratch.is_some() || m.asleep.is_some(),
            "no scratch while awake"
        );
    }
    for (d, (dataset, model)) in w.datasets.iter().zip(&m.datasets).enumerate() {
        prop_assert_eq!(
            dataset.is_resident(),
            model.resident,
            "dataset {} residency",
            d
        );
        if let Ok(home) = dataset.home_ptr() {
            let got = w
                .fake
                .read(home, dataset.bytes())
                .expect("the home is mapped");
            check_bytes(&format!("dataset {d} at home"), &got, &model.bytes)?;
        }
    }
    for (g, bound) in m.bound.iter().enumerate() {
        let (base, bytes) = (w.group_base(g), w.placement.groups[g].bytes);
        match (w.strategies[g], bound) {
            (BindStrategy::Remap, Some(d)) => {
                let got = w.fake.read(base, bytes).expect("a bound group is mapped");
                check_bytes(&format!("group {g}"), &got, &m.datasets[*d].bytes)?;
            }
            (BindStrategy::Remap, None) => {
                prop_assert!(
                    w.fake.chunk_at(base).is_none(),
                    "group {} mapped unbound",
                    g
                );
            }
            (_, Some(_)) => {
                let got = w.fake.read(base, bytes).expect("a copy-in group is mapped");
                check_bytes(&format!("copy-in group {g}"), &got, &m.copied[g])?;
            }
            (_, None) => {}
        }
    }
    Ok(())
}

proptest! {
    #![proptest_config(crate::testing::proptest_config(192))]

    #[test]
    fn every_byte_of_a_space_and_its_datasets_matches_the_model_under_random_operations_and_failures(
        copy_in in any::<[bool; 2]>(),
        spare_granules in 0usize..24,
        ops in prop::collection::vec(op(), 1..120),
    ) {
        // The space (its scratch and copy-in groups: 6 granules at most) and six datasets (3
        // or 2 granules each) fit; what is left decides how often a restore runs out of memory.
        let fake = Fake::with_granularity((6 + 15 + spare_granules) * G, G);
        let mut w = world(&fake, copy_in);
        let sizes: Vec<usize> = w.datasets.iter().map(|d| d.bytes()).collect();
        let mut m = Model {
            datasets: sizes
                .iter()
                .map(|&bytes| DatasetModel { bytes: vec![None; bytes], resident: true })
                .collect(),
            bound: vec![None; 2],
            copied: w.placement.groups.iter().map(|g| vec![None; g.bytes]).collect(),
            asleep: None,
        };
        for (n, op) in ops.iter().enumerate() {
            let ok = step(&mut w, &mut m, op)?;
            if !matches!(op, Op::Fail { .. }) {
                fake.clear_failure();
            }
            check(&w, &m).map_err(|e| {
                TestCaseError::fail(format!(
                    "after step {n} {op:?} ({}): {e}",
                    if ok { "ok" } else { "refused" }
                ))
            })?;
        }
        fake.clear_failure();
        let World { space, datasets, .. } = w;
        drop(datasets);
        drop(space);
        prop_assert_eq!(fake.violations(), Vec::<String>::new());
        prop_assert_eq!(fake.live_mappings(), 0, "mappings left after the space and datasets");
        prop_assert_eq!(fake.live_chunks(), 0, "memory left after the space and datasets");
    }
}
