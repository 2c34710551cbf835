//! Property tests of the KV cache on the fake driver: random grows, releases, prefix shares,
//! writes (with copy-on-write), sleeps and wakes, some with a driver call made to fail, checked
//! after every step against a byte model: each row's bytes up to its length, zeros past it,
//! and which rows share physical granules.

use std::collections::HashMap;

use proptest::prelude::*;

use super::layout::KvLayout;
use super::state::KvState;
use crate::error::{DriverError, Error, KvError};
use crate::fence::FencePolicy;
use crate::host::HostStorage;
use crate::vmm_core::fake::{Call, Fake, FakeStream};
use crate::vmm_core::Backend;

/// A small granule, so rows span several and the model stays cheap.
const G: usize = 256;

#[derive(Clone, Debug)]
enum Op {
    Grow {
        seq: usize,
        len: usize,
    },
    Release {
        seq: usize,
    },
    Share {
        from: usize,
        to: usize,
        tokens: usize,
    },
    /// With `inside`, `first` and `count` are taken modulo the sequence's length, so the
    /// write lands (most writes); else as drawn (often past the length).
    Write {
        seq: usize,
        first: usize,
        count: usize,
        seed: u8,
        inside: bool,
    },
    Sleep,
    Wake,
    Publish,
    /// Makes `count` free granules hold zeros (gated layers take them without staging).
    ZeroAhead {
        count: usize,
        at_most: usize,
    },
    /// Grows and releases behind a step in flight, layer by layer; the wait for layer
    /// `fail_at`'s mark fails (a driver error).
    Behind {
        grow: Vec<(usize, usize)>,
        release: Vec<usize>,
        fail_at: Option<usize>,
        /// Bit `l`: layer `l` is gated (remapped after the call, by a [`Remap`]).
        later_mask: u8,
    },
}

fn op(max_batch: usize, max_len: usize) -> impl Strategy<Value = Op> {
    let seq = 0..max_batch + 1; // one past the end: NoSuchSequence
    prop_oneof![
        6 => (seq.clone(), 0..max_len + 3).prop_map(|(seq, len)| Op::Grow { seq, len }),
        2 => seq.clone().prop_map(|seq| Op::Release { seq }),
        3 => (seq.clone(), seq.clone(), 0..max_len + 2)
            .prop_map(|(from, to, tokens)| Op::Share { from, to, tokens }),
        6 => (seq, 0..max_len + 2, 0usize..20, any::<u8>(), prop::bool::weighted(0.8))
            .prop_map(|(seq, first, count, seed, inside)| Op::Write { seq, first, count, seed, inside }),
        1 => Just(Op::Sleep),
        1 => Just(Op::Wake),
        1 => Just(Op::Publish),
        2 => (0usize..6, 1usize..4).prop_map(|(count, at_most)| Op::ZeroAhead { count, at_most }),
        4 => (
            prop::collection::vec((0..max_batch + 1, 0..max_len + 3), 0..3),
            prop::collection::vec(0..max_batch + 1, 0..2),
            prop::option::weighted(0.2, 0usize..2),
            prop_oneof![2 => Just(0u8), 1 => any::<u8>()],
        )
            .prop_map(|(grow, release, fail_at, later_mask)| Op::Behind {
                grow,
                release,
                fail_at,
                later_mask,
            }),
    ]
}

fn failure() -> impl Strategy<Value = Option<(Call, usize)>> {
    let call = prop_oneof![
        Just(Call::Create),
        Just(Call::Map),
        Just(Call::Access),
        Just(Call::Wait),
        Just(Call::Copy),
        Just(Call::Fill),
        Just(Call::Save),
        Just(Call::Load),
        Just(Call::Write),
    ];
    prop_oneof![4 => Just(None), 1 => (call, 0usize..12).prop_map(Some)]
}

/// What the cache should hold.
#[derive(Clone, Debug)]
struct Model {
    /// Per sequence, per buffer: the bytes of its valid tokens.
    bytes: Vec<Vec<Vec<u8>>>,
    /// Per sequence: the logical granule behind each backed granule of its rows; equal ids
    /// are one physical granule (in every buffer alike).
    granules: Vec<Vec<u64>>,
    next_id: u64,
    asleep: bool,
}

impl Model {
    fn length(&self, seq: usize, token_bytes: usize) -> usize {
        self.bytes[seq][0].len() / token_bytes
    }

    fn fresh(&mut self) -> u64 {
        self.next_id += 1;
        self.next_id
    }

    /// A grow of `seq` to `len` tokens (never shrinking), backed by `target(len)` granules.
    fn grow(
        &mut self,
        seq: usize,
        len: usize,
        token_bytes: usize,
        target: impl Fn(usize) -> usize,
    ) {
        let len = len.max(self.length(seq, token_bytes));
        for buffer in &mut self.bytes[seq] {
            buffer.resize(len * token_bytes, 0);
        }
        while self.granules[seq].len() < target(len) {
            let id = self.fresh();
            self.granules[seq].push(id);
        }
    }
}

fn data(seed: u8, n: usize, salt: usize) -> Vec<u8> {
    (0..n)
        .map(|i| {
            (seed as usize)
                .wrapping_mul(31)
                .wrapping_add(i * 7 + salt * 13) as u8
                | 1
        })
        .collect()
}

struct Case {
    fake: Fake,
    state: KvState<Fake>,
    layout: KvLayout,
    ahead: usize,
}

impl Case {
    fn row(&self, buffer: usize, seq: usize) -> u64 {
        self.state.base() + self.state.geometry.row_offset(buffer, seq) as u64
    }

    /// Runs `op` on the cache and, where it succeeds, on the model.
    fn step(&mut self, model: &mut Model, op: &Op) -> Result<bool, TestCaseError> {
        let tb = self.state.geometry.token_bytes;
        let buffers = self.state.geometry.buffers;
        let max_batch = self.layout.max_batch;
        let max_len = self.layout.max_len;
        let normalised;
        let op = match *op {
            Op::Write {
                seq,
                first,
                count,
                seed,
                inside: true,
            } if seq < max_batch => {
                let len = model.length(seq, tb);
                let first = first % (len + 1);
                normalised = Op::Write {
                    seq,
                    first,
                    count: count.min(len - first),
                    seed,
                    inside: true,
                };
                &normalised
            }
            _ => op,
        };
        let result = match *op {
            Op::Grow { seq, len } => self.state.grow(seq, len),
            Op::Release { seq } => self.state.release(seq),
            Op::Share { from, to, tokens } => self.state.share_prefix(from, to, tokens),
            Op::Write {
                seq, first, count, ..
            } => self.state.write_guard(seq, first..first + count),
            Op::Sleep => self.state.sleep(&HostStorage::Pageable).map(drop),
            Op::Wake => self.state.wake().map(drop),
            Op::Publish => self.state.publish_lengths(),
            Op::ZeroAhead { count, at_most } => {
                let before = self.state.free.zeroed_len();
                let result = self.state.zero_ahead(count, at_most);
                if let Ok(ready) = result {
                    prop_assert_eq!(ready, before.max(count.min(before + at_most)));
                    prop_assert_eq!(self.state.free.zeroed_len(), ready);
                } else {
                    prop_assert!(self.state.free.zeroed_len() == before);
                }
                result.map(drop)
            }
            Op::Behind {
                ref grow,
                ref release,
                fail_at,
                later_mask,
            } => {
                if fail_at.is_some() {
                    // One failure per operation, as every other one: an undo after a failed
                    // wait maps again, and a driver failure there too is not recoverable.
                    self.fake.clear_failure();
                }
                let mut waited = Vec::new();
                let later: Vec<bool> = (0..self.layout.layers)
                    .map(|l| later_mask >> l & 1 == 1)
                    .collect();
                let result = self.state.change_behind(
                    grow,
                    release,
                    |layer| {
                        waited.push(layer);
                        if fail_at == Some(layer) {
                            return Err(Error::Driver(DriverError::Failed {
                                call: "cuEventSynchronize",
                                result: cudarc::driver::sys::CUresult::CUDA_ERROR_LAUNCH_FAILED,
                                bytes: 0,
                            }));
                        }
                        Ok(())
                    },
                    &later,
                );
                // Layers not left for later are waited for in order, each once, and none
                // after a failed wait.
                let inline: Vec<usize> = (0..self.layout.layers).filter(|&l| !later[l]).collect();
                prop_assert_eq!(&waited[..], &inline[..waited.len()]);
                // A change that got past its last wait timed each layer remapped inline.
                if let Ok((true, _)) = result {
                    prop_assert_eq!(self.state.times.inline_layers, inline.len());
                }
                match result {
                    // The layers left for later: remapped now (their marks passed), the
                    // mappings taken back; a driver failure there is reported (and the slots
                    // it left unmapped are repaired by the next operation).
                    Ok((_, Some(mut remap))) => {
                        prop_assert!(remap.layers.iter().all(|&l| later[l]));
                        let lane = self.state.lane;
                        remap.zero_retired_and_wait(&lane);
                        remap.run();
                        match self.state.install(remap) {
                            Ok(()) => Ok(()),
                            Err(error) => {
                                self.state.repair().map_err(|e| {
                                    TestCaseError::fail(format!("repair after {error}: {e}"))
                                })?;
                                Ok(())
                            }
                        }
                    }
                    Ok((_, None)) => Ok(()),
                    Err(error) => Err(error),
                }
            }
        };
        // Typed refusals of bad input, decided from the model alone.
        let expected_refusal = match *op {
            Op::Grow { seq, len } => seq >= max_batch || len > max_len || model.asleep,
            Op::Release { seq } => seq >= max_batch || model.asleep,
            Op::Share { from, to, tokens } => {
                from >= max_batch
                    || to >= max_batch
                    || model.asleep
                    || from == to
                    || tokens > model.length(from, tb)
                    || !model.granules[to].is_empty()
                    || model.length(to, tb) != 0
            }
            Op::Write {
                seq, first, count, ..
            } => seq >= max_batch || model.asleep || first + count > model.length(seq, tb),
            Op::Behind {
                ref grow,
                ref release,
                ..
            } => {
                let seqs: Vec<usize> = grow
                    .iter()
                    .map(|&(seq, _)| seq)
                    .chain(release.iter().copied())
                    .collect();
                let mut distinct = seqs.clone();
                distinct.sort_unstable();
                distinct.dedup();
                model.asleep
                    || seqs.iter().any(|&seq| seq >= max_batch)
                    || distinct.len() != seqs.len()
                    || grow.iter().any(|&(_, len)| len > max_len)
            }
            Op::ZeroAhead { .. } => model.asleep,
            _ => false,
        };
        match &result {
            Err(Error::Kv(kv)) => {
                prop_assert!(expected_refusal, "unexpected refusal {kv:?} of {op:?}");
                if let Op::Write { .. } = op {
                    prop_assert!(
                        matches!(
                            kv,
                            KvError::WritePastLength { .. }
                                | KvError::NoSuchSequence { .. }
                                | KvError::Asleep
                        ),
                        "{kv:?}"
                    );
                }
                return Ok(false);
            }
            Err(_) => {
                prop_assert!(
                    !expected_refusal,
                    "a driver error where {op:?} is bad input"
                );
                return Ok(false);
            }
            Ok(()) => prop_assert!(!expected_refusal, "{op:?} was accepted"),
        }
        let geometry = self.state.geometry;
        match *op {
            Op::Grow { seq, len } => model.grow(seq, len, tb, |len| {
                geometry.granules_for((len + self.ahead).min(max_len))
            }),
            Op::Release { seq } => {
                model.bytes[seq] = vec![Vec::new(); buffers];
                model.granules[seq].clear();
            }
            Op::Share { from, to, tokens } => {
                if tokens > 0 {
                    for buffer in 0..buffers {
                        model.bytes[to][buffer] = model.bytes[from][buffer][..tokens * tb].to_vec();
                    }
                    let (whole, tail) = (tokens * tb / G, tokens * tb % G);
                    model.granules[to] = model.granules[from][..whole].to_vec();
                    if tail > 0 {
                        let id = model.fresh();
                        model.granules[to].push(id);
                    }
                }
            }
            Op::Write {
                seq,
                first,
                count,
                seed,
                ..
            } => {
                if count > 0 {
                    // Copy-on-write in the model: every granule touched that another row
                    // holds gets a new id.
                    for g in first * tb / G..((first + count) * tb).div_ceil(G) {
                        let id = model.granules[seq][g];
                        let shared = (0..max_batch)
                            .any(|other| other != seq && model.granules[other].contains(&id));
                        if shared {
                            model.granules[seq][g] = model.fresh();
                        }
                    }
                    for buffer in 0..buffers {
                        let bytes = data(seed, count * tb, buffer);
                        let address = self.row(buffer, seq) + (first * tb) as u64;
                        prop_assert!(self.fake.write(address, &bytes), "write faulted");
                        model.bytes[seq][buffer][first * tb..(first + count) * tb]
                            .copy_from_slice(&bytes);
                    }
                }
            }
            Op::Behind {
                ref grow,
                ref release,
                ..
            } => {
                for &(seq, len) in grow {
                    model.grow(seq, len, tb, |len| {
                        geometry.granules_for((len + self.ahead).min(max_len))
                    });
                }
                for &seq in release {
                    model.bytes[seq] = vec![Vec::new(); buffers];
                    model.granules[seq].clear();
                }
            }
            Op::Sleep => model.asleep = true,
            Op::Wake => model.asleep = false,
            Op::Publish | Op::ZeroAhead { .. } => {}
        }
        Ok(true)
    }

    /// Every invariant, against the model.
    fn check(&self, model: &Model) -> Result<(), TestCaseError> {
        let geometry = self.state.geometry;
        let tb = geometry.token_bytes;
        prop_assert_eq!(self.fake.violations(), Vec::<String>::new());
        prop_assert_eq!(self.state.sleeping.is_some(), model.asleep);
        let mut ids: HashMap<u64, u64> = HashMap::new();
        let mut mapped = 0;
        for seq in 0..self.layout.max_batch {
            let len = model.length(seq, tb);
            prop_assert_eq!(self.state.lengths[seq], len);
            prop_assert_eq!(self.state.backed[seq], model.granules[seq].len());
            for buffer in 0..geometry.buffers {
                let row = self.fake.read(self.row(buffer, seq), geometry.seq_stride);
                let row = row.ok_or_else(|| TestCaseError::fail("a row reads unmapped memory"))?;
                if model.asleep {
                    prop_assert!(row.iter().all(|&b| b == 0), "a sleeping row reads non-zero");
                    continue;
                }
                prop_assert_eq!(&row[..len * tb], &model.bytes[seq][buffer][..]);
                prop_assert!(
                    row[len * tb..].iter().all(|&b| b == 0),
                    "seq {} buffer {}: bytes past the length are not zero",
                    seq,
                    buffer
                );
                for g in 0..geometry.granules_per_seq {
                    let slot = geometry.slot(buffer, seq, g);
                    let (chunk, read_only) = self
                        .fake
                        .chunk_at(self.state.slot_address(slot))
                        .ok_or_else(|| TestCaseError::fail("unmapped slot"))?;
                    match model.granules[seq].get(g) {
                        None => {
                            let retiring = self.state.table.slots[slot].retiring;
                            prop_assert!(
                                read_only || retiring,
                                "an unbacked slot is writable and not retiring"
                            );
                            if retiring {
                                prop_assert_eq!(
                                    self.state.table.owners(slot),
                                    1,
                                    "a retiring granule is shared"
                                );
                            }
                        }
                        Some(&id) => {
                            mapped += 1;
                            prop_assert!(
                                !self.state.table.slots[slot].retiring,
                                "a backed slot is retiring"
                            );
                            prop_assert!(!read_only, "a backed slot is read-only");
                            // Same model id <=> same chunk, within one buffer.
                            let key = id * geometry.buffers as u64 + buffer as u64;
                            let expected = *ids.entry(key).or_insert(chunk);
                            prop_assert_eq!(expected, chunk, "a shared granule was copied");
                        }
                    }
                }
            }
        }
        let mut chunks: Vec<u64> = ids.values().copied().collect();
        chunks.sort_unstable();
        let distinct = chunks.len();
        chunks.dedup();
        prop_assert_eq!(chunks.len(), distinct, "two model granules share one chunk");
        if !model.asleep {
            let stats = self.state.stats();
            prop_assert_eq!(stats.mapped_granules, mapped);
            prop_assert_eq!(stats.physical_granules, distinct);
        }
        Ok(())
    }
}

proptest! {
    #![proptest_config(crate::testing::proptest_config(128))]

    #[test]
    fn every_byte_of_the_kv_cache_matches_the_model_under_random_operations_and_failures(
        head_dim in prop_oneof![Just(3usize), Just(4usize)],
        ahead in prop_oneof![Just(0usize), Just(5usize), Just(20usize)],
        device_granules in 40usize..120,
        ops in prop::collection::vec(
            (op(3, 40), failure()), 1..60),
    ) {
        let layout = KvLayout { layers: 2, max_batch: 3, max_len: 40, kv_heads: 2, head_dim, dtype_bytes: 2 };
        let fake = Fake::with_granularity(device_granules * G, G);
        let fence = fake.fence(FencePolicy::Context);
        let state = KvState::new(fake.clone(), layout, FakeStream(1), fence, ahead).unwrap();
        let buffers = state.geometry.buffers;
        let mut case = Case { fake, state, layout, ahead };
        let mut model = Model {
            bytes: vec![vec![Vec::new(); buffers]; 3],
            granules: vec![Vec::new(); 3],
            next_id: 0,
            asleep: false,
        };
        case.check(&model)?;
        for (op, failure) in &ops {
            if let Some((call, skip)) = *failure {
                case.fake.fail(call, skip);
            }
            case.step(&mut model, op)?;
            case.fake.clear_failure();
            case.check(&model)?;
        }
        // The lengths a kernel reads, once published.
        if !model.asleep {
            case.state.publish_lengths().unwrap();
            let lengths = case.fake.read(case.state.lengths_ptr(), 12).unwrap();
            for seq in 0..3 {
                let len = u32::from_le_bytes(lengths[seq * 4..seq * 4 + 4].try_into().unwrap());
                prop_assert_eq!(len as usize, case.state.lengths[seq]);
            }
        }
        drop(case.state);
        prop_assert_eq!(case.fake.live_mappings(), 0);
        prop_assert_eq!(case.fake.live_chunks(), 0);
    }
}

#[test]
fn the_zero_granule_is_one_chunk_mapped_read_only_everywhere() {
    let layout = KvLayout {
        layers: 2,
        max_batch: 2,
        max_len: 64,
        kv_heads: 2,
        head_dim: 4,
        dtype_bytes: 2,
    };
    let fake = Fake::with_granularity(64 * G, G);
    let fence = fake.fence(FencePolicy::Context);
    let mut state = KvState::new(fake.clone(), layout, FakeStream(1), fence, 0).unwrap();
    let slots = state.geometry.slots();
    // One zero chunk + one lengths chunk, the zero one under every slot.
    assert_eq!(fake.live_chunks(), 2);
    let zero = fake.chunk_at(state.base()).unwrap();
    assert!(zero.1);
    for slot in 0..slots {
        assert_eq!(fake.chunk_at(state.slot_address(slot)), Some(zero));
    }
    // Reads past any length see zeros; a write there faults on the fake as on the GPU.
    assert!(fake
        .read(state.base(), slots * G)
        .unwrap()
        .iter()
        .all(|&b| b == 0));
    assert!(!fake.write(state.base(), &[1]));
    fake.violations().is_empty().then_some(()).unwrap();
    // A write past the length is a typed error; within it, after a grow, it lands.
    assert!(matches!(
        state.write_guard(0, 0..1),
        Err(Error::Kv(KvError::WritePastLength { length: 0, .. }))
    ));
    state.grow(0, 1).unwrap();
    state.write_guard(0, 0..1).unwrap();
    assert!(fake.write(state.base(), &[1; 16]));
    assert!(matches!(
        state.grow(5, 1),
        Err(Error::Kv(KvError::NoSuchSequence {
            seq: 5,
            max_batch: 2
        }))
    ));
}
