//! Property tests of the pool's bookkeeping: random sequences of requests, frees, drains and
//! tenant churn, with every invariant checked after every step.

use std::collections::BTreeMap;

use proptest::prelude::*;

use super::book::{ChunkBook, ChunkId, TenantId};
use super::granules::GranuleMap;

const G: usize = 2 << 20;

#[derive(Clone, Debug)]
enum Op {
    Alloc {
        tenant: u32,
        granules: usize,
        stitching: bool,
        spare: usize,
        cap: Option<usize>,
    },
    Free {
        pick: usize,
    },
    Drain {
        keep: usize,
    },
    Churn {
        tenant: u32,
    },
}

fn op() -> impl Strategy<Value = Op> {
    prop_oneof![
        5 => (0u32..3, 1usize..24, any::<bool>(), 0usize..8, prop::option::of(1usize..6))
            .prop_map(|(tenant, granules, stitching, spare, cap)| Op::Alloc { tenant, granules, stitching, spare, cap }),
        4 => any::<usize>().prop_map(|pick| Op::Free { pick }),
        1 => (0usize..4).prop_map(|keep| Op::Drain { keep }),
        1 => (0u32..3).prop_map(|tenant| Op::Churn { tenant }),
    ]
}

/// The allocations the test made: tenant and the chunks serving it.
type Live = Vec<(TenantId, Vec<ChunkId>)>;

fn apply(book: &mut ChunkBook, live: &mut Live, op: &Op) -> Result<(), TestCaseError> {
    match *op {
        Op::Alloc {
            tenant,
            granules,
            stitching,
            spare,
            cap,
        } => {
            let tenant = TenantId(tenant);
            let asked = granules * G;
            let room = asked + spare * G;
            let cached_before: Vec<ChunkId> = book.cached_chunks().map(|(id, _)| id).collect();
            let uncapped = book.plan(tenant, asked, stitching, room, None);
            let planned = book.plan(tenant, asked, stitching, room, cap);
            prop_assert_eq!(
                uncapped.is_ok(),
                planned.is_ok(),
                "a cap never changes whether a request fits"
            );
            if let (Some(cap), Ok(full), Ok(plan)) = (cap, &uncapped, &planned) {
                prop_assert!(
                    plan.reuse.len() <= cap + 1,
                    "the cap, plus a covering chunk"
                );
                if full.reuse.len() <= cap {
                    prop_assert_eq!(plan, full, "a cap the plan does not reach changes nothing");
                }
            }
            let Ok(plan) = planned else {
                // Refused: it must really not fit, even with the whole cache released.
                let limit_hit = book
                    .limit_of(tenant)
                    .is_some_and(|limit| book.held_by(tenant).0 + asked > limit);
                let budget_hit = book.budget().is_some_and(|b| book.held() + asked > b);
                prop_assert!(limit_hit || budget_hit, "refused {asked} for no reason");
                return Ok(());
            };
            let reused: usize = plan
                .reuse
                .iter()
                .map(|&id| book.bytes_of(id).unwrap())
                .sum();
            let planned = reused + plan.create;
            prop_assert!(planned >= asked, "the plan covers the request");
            prop_assert!(planned <= room, "the plan fits its room");
            prop_assert!(planned - asked <= asked / 8, "overshoot beyond an eighth");
            if plan.create > 0 {
                prop_assert_eq!(planned, asked, "new memory is never oversized");
            }
            if let Some(limit) = book.limit_of(tenant) {
                prop_assert!(book.held_by(tenant).0 + planned <= limit);
            }
            for id in plan.reuse.iter().chain(&plan.release_first) {
                prop_assert!(
                    cached_before.contains(id),
                    "planned chunk {:?} not cached",
                    id
                );
            }
            prop_assert!(plan.release_first.iter().all(|id| !plan.reuse.contains(id)));
            let mut distinct = plan.reuse.clone();
            distinct.sort();
            distinct.dedup();
            prop_assert_eq!(distinct.len(), plan.reuse.len(), "a chunk planned twice");
            if !stitching {
                prop_assert!(plan.reuse.len() <= 1);
                prop_assert!(
                    plan.reuse.is_empty() || plan.create == 0,
                    "no partial reuse"
                );
            }
            for &id in &plan.release_first {
                prop_assert!(book.remove(id).is_some());
            }
            let mut chunks = Vec::new();
            for &id in &plan.reuse {
                prop_assert!(book.take(id, tenant));
                chunks.push(id);
            }
            if plan.create > 0 {
                let id = book.insert(plan.create, Some(tenant));
                prop_assert!(
                    id.is_some(),
                    "the plan made room, yet the new chunk does not fit"
                );
                chunks.push(id.unwrap());
            }
            live.push((tenant, chunks));
        }
        Op::Free { pick } => {
            if !live.is_empty() {
                let (_, chunks) = live.swap_remove(pick % live.len());
                for id in chunks {
                    prop_assert!(book.give_back(id));
                }
            }
        }
        Op::Drain { keep } => {
            let cached: Vec<ChunkId> = book.cached_chunks().map(|(id, _)| id).skip(keep).collect();
            for id in cached {
                prop_assert!(book.remove(id).is_some());
            }
        }
        Op::Churn { tenant } => {
            // Unregister: everything it holds goes back to the cache, then it comes back.
            let tenant = TenantId(tenant);
            let limit = book.limit_of(tenant);
            for (_, chunks) in live.iter().filter(|(t, _)| *t == tenant) {
                for &id in chunks {
                    prop_assert!(book.give_back(id));
                }
            }
            live.retain(|(t, _)| *t != tenant);
            prop_assert!(book.close_account(tenant));
            prop_assert!(book.open_account(tenant, limit));
        }
    }
    Ok(())
}

fn check(book: &ChunkBook, live: &Live) -> Result<(), TestCaseError> {
    book.check_invariants().map_err(TestCaseError::fail)?;
    let mut owner: BTreeMap<ChunkId, TenantId> = BTreeMap::new();
    let mut per_tenant: BTreeMap<TenantId, usize> = BTreeMap::new();
    for (tenant, chunks) in live {
        for &id in chunks {
            prop_assert!(owner.insert(id, *tenant).is_none(), "{:?} owned twice", id);
            prop_assert_eq!(book.holder_of(id), Some(*tenant));
            *per_tenant.entry(*tenant).or_default() += book.bytes_of(id).unwrap();
        }
    }
    let held: usize = per_tenant.values().sum();
    prop_assert_eq!(held, book.held(), "held bytes match the live allocations");
    for tenant in 0..3 {
        let tenant = TenantId(tenant);
        let expected = per_tenant.get(&tenant).copied().unwrap_or(0);
        prop_assert_eq!(book.held_by(tenant).0, expected);
    }
    if let Some(budget) = book.budget() {
        prop_assert!(book.physical() <= budget);
    }
    Ok(())
}

proptest! {
    #![proptest_config(crate::testing::proptest_config(256))]

    #[test]
    fn chunk_accounting_holds_under_random_traffic(
        budget in prop::option::of(16usize..96),
        limited in any::<bool>(),
        ops in prop::collection::vec(op(), 1..120),
    ) {
        let mut book = ChunkBook::new(G, budget.map(|g| g * G));
        for tenant in 0..3 {
            let limit = (limited && tenant == 0).then_some(20 * G);
            prop_assert!(book.open_account(TenantId(tenant), limit));
        }
        let mut live = Live::new();
        for op in &ops {
            apply(&mut book, &mut live, op)?;
            check(&book, &live)?;
        }
        // Freeing everything leaves only cache, and draining it leaves nothing.
        for (_, chunks) in live.drain(..) {
            for id in chunks {
                prop_assert!(book.give_back(id));
            }
        }
        prop_assert_eq!(book.held(), 0);
        let cached: Vec<ChunkId> = book.cached_chunks().map(|(id, _)| id).collect();
        for id in cached {
            prop_assert!(book.remove(id).is_some());
        }
        prop_assert_eq!((book.physical(), book.chunk_count()), (0, 0));
    }

    #[test]
    fn granule_map_matches_a_plain_model(
        ops in prop::collection::vec((any::<bool>(), 1usize..12, any::<usize>()), 1..200),
    ) {
        const N: usize = 64;
        let mut map = GranuleMap::new(N);
        let mut model = [false; N];
        let mut ranges: Vec<(usize, usize)> = Vec::new();
        for (allocate, count, pick) in ops {
            if allocate || ranges.is_empty() {
                let fits = {
                    let mut best: Option<(usize, usize)> = None;
                    let mut start = 0;
                    while start < N {
                        if model[start] { start += 1; continue; }
                        let mut end = start;
                        while end < N && !model[end] { end += 1; }
                        let length = end - start;
                        if length >= count && best.is_none_or(|(_, l)| length < l) {
                            best = Some((start, length));
                        }
                        start = end;
                    }
                    best.map(|(s, _)| s)
                };
                let got = map.allocate(count);
                prop_assert_eq!(got, fits, "best fit, lowest address among equals");
                if let Some(start) = got {
                    model[start..start + count].fill(true);
                    ranges.push((start, count));
                }
            } else {
                let (start, count) = ranges.swap_remove(pick % ranges.len());
                prop_assert!(map.release(start, count));
                prop_assert!(!map.release(start, count), "a double free is refused");
                model[start..start + count].fill(false);
            }
            prop_assert_eq!(map.taken(), model.iter().filter(|&&b| b).count());
            for (index, &bit) in model.iter().enumerate() {
                prop_assert_eq!(map.is_taken(index), bit);
            }
            let runs: usize = map.free_runs().map(|(_, l)| l).sum();
            prop_assert_eq!(runs, map.free());
            prop_assert!((0.0..=1.0).contains(&map.fragmentation()));
        }
    }
}

/// The whole pool state machine (planner, books, tenants, blocks, segments, drains, grafts)
/// against the fake driver, with driver failures injected at random calls.
mod against_a_fake_driver {
    use proptest::prelude::*;

    use crate::error::{DriverError, Error, LayoutError, PoolError};
    use crate::fence::FencePolicy;
    use crate::pool::book::TenantId;
    use crate::pool::events::BlockId;
    use crate::pool::fake::{Call, Fake};
    use crate::pool::state::{State, Switches};

    const G: usize = 2 << 20;

    #[derive(Clone, Debug)]
    enum Op {
        Register {
            capacity: usize,
            limit: Option<usize>,
        },
        Unregister {
            pick: usize,
        },
        Alloc {
            pick: usize,
            len: usize,
            extra: usize,
        },
        Grow {
            pick: usize,
            by: usize,
        },
        Shrink {
            pick: usize,
            keep: usize,
        },
        Free {
            pick: usize,
        },
        Graft {
            pick: usize,
            donor: usize,
        },
        Drain,
        Fail {
            call: u8,
            skip: usize,
        },
    }

    fn op() -> impl Strategy<Value = Op> {
        prop_oneof![
            1 => (16usize..96, prop::option::of(8usize..48))
                .prop_map(|(capacity, limit)| Op::Register { capacity, limit }),
            1 => any::<usize>().prop_map(|pick| Op::Unregister { pick }),
            6 => (any::<usize>(), 1usize..12, 0usize..6)
                .prop_map(|(pick, len, extra)| Op::Alloc { pick, len, extra }),
            3 => (any::<usize>(), 1usize..6).prop_map(|(pick, by)| Op::Grow { pick, by }),
            2 => (any::<usize>(), 0usize..8).prop_map(|(pick, keep)| Op::Shrink { pick, keep }),
            4 => any::<usize>().prop_map(|pick| Op::Free { pick }),
            2 => (any::<usize>(), any::<usize>()).prop_map(|(pick, donor)| Op::Graft { pick, donor }),
            1 => Just(Op::Drain),
            2 => (0u8..5, 0usize..3).prop_map(|(call, skip)| Op::Fail { call, skip }),
        ]
    }

    /// What the test expects: tenants and their blocks with lengths (in granules).
    #[derive(Default)]
    struct Model {
        tenants: Vec<(TenantId, Vec<(BlockId, usize)>)>,
    }

    impl Model {
        fn block(&self, pick: usize) -> Option<(TenantId, BlockId, usize)> {
            let all: Vec<(TenantId, BlockId, usize)> = self
                .tenants
                .iter()
                .flat_map(|(t, blocks)| blocks.iter().map(move |&(b, len)| (*t, b, len)))
                .collect();
            (!all.is_empty()).then(|| all[pick % all.len()])
        }

        fn set_len(&mut self, tenant: TenantId, block: BlockId, len: usize) {
            for (t, blocks) in &mut self.tenants {
                if *t == tenant {
                    for entry in blocks.iter_mut().filter(|e| e.0 == block) {
                        entry.1 = len;
                    }
                }
            }
        }

        fn remove(&mut self, tenant: TenantId, block: BlockId) {
            for (t, blocks) in &mut self.tenants {
                if *t == tenant {
                    blocks.retain(|e| e.0 != block);
                }
            }
        }
    }

    fn typed(error: &Error) -> bool {
        matches!(
            error,
            Error::Driver(DriverError::OutOfMemory { .. })
                | Error::Pool(PoolError::PoolOutOfMemory { .. })
                | Error::Driver(DriverError::Failed { .. })
                | Error::Pool(PoolError::OverBudget { .. })
                | Error::Pool(PoolError::VirtualCapacity { .. })
                | Error::Pool(PoolError::BeyondCapacity { .. })
                | Error::Layout(LayoutError::InvalidShape(_))
        )
    }

    fn check(state: &State<Fake>, fake: &Fake, model: &Model) -> Result<(), TestCaseError> {
        state
            .book()
            .check_invariants()
            .map_err(TestCaseError::fail)?;
        let stats = state.stats();
        prop_assert_eq!(
            fake.live_chunks(),
            stats.chunks + fake.leaked_mappings(),
            "every chunk the driver holds is in the books, or leaked with its mapping"
        );
        prop_assert_eq!(
            fake.live_mappings(),
            stats.mappings,
            "mappings match the blocks"
        );
        // The statistics add up: the pool's figures are the tenants', the tenants' the blocks'.
        let tenants = state.all_tenant_stats();
        prop_assert_eq!(
            stats.mapped,
            tenants.iter().map(|t| t.mapped).sum::<usize>()
        );
        prop_assert_eq!(
            stats.mappings,
            tenants.iter().map(|t| t.mappings).sum::<usize>()
        );
        prop_assert_eq!(stats.tenants, model.tenants.len());
        prop_assert_eq!(
            fake.created_bytes(),
            stats.mapped + stats.cached + fake.leaked_bytes(),
            "physical bytes: mapped, cached, or leaked with a mapping"
        );
        for (tenant, blocks) in &model.tenants {
            let ts = state
                .tenant_stats(*tenant)
                .map_err(|e| TestCaseError::fail(e.to_string()))?;
            prop_assert_eq!(ts.blocks, blocks.len());
            let mut mapped = 0;
            for &(block, _) in blocks {
                mapped += state
                    .info(*tenant, block)
                    .map_err(|e| TestCaseError::fail(e.to_string()))?
                    .mapped;
            }
            prop_assert_eq!(ts.mapped, mapped, "a tenant holds what its blocks map");
        }
        for (tenant, blocks) in &model.tenants {
            for &(block, len) in blocks {
                let info = state
                    .info(*tenant, block)
                    .map_err(|e| TestCaseError::fail(e.to_string()))?;
                prop_assert_eq!(info.len, len * G, "block length");
                prop_assert!(info.mapped >= info.len, "a block's bytes are all mapped");
                prop_assert!(info.mapped <= info.capacity);
            }
        }
        Ok(())
    }

    proptest! {
        // Long sequences (up to 400 steps) reach the states short ones never do: caches
        // fragmented by many frees, tenants churned while others hold stitched blocks.
        #![proptest_config(crate::testing::proptest_config(256))]

        #[test]
        fn the_pool_stays_consistent_under_random_traffic_and_injected_failures(
            budget in prop::option::of(24usize..128),
            device in 32usize..160,
            stitching in any::<bool>(),
            ops in prop::collection::vec(op(), 1..400),
        ) {
            let fake = Fake::new(device * G);
            let switches = Switches { stitching, drain_on_oom: true };
            let mut state = State::new(fake.clone(), G, budget.map(|b| b * G), switches, FencePolicy::Context, 1024);
            let mut model = Model::default();
            let mut injected = 0usize;
            for op in &ops {
                let before = state.stats();
                let failing = matches!(op, Op::Fail { .. });
                let outcome = match *op {
                    Op::Fail { call, skip } => {
                        let call = [Call::Reserve, Call::Create, Call::Map, Call::Access, Call::Wait][call as usize];
                        fake.fail(call, skip);
                        injected += 1;
                        Ok(())
                    }
                    Op::Register { capacity, limit } => {
                        let name = format!("t{}", model.tenants.len());
                        state.register(&name, capacity * G, limit.map(|l| l * G)).map(|id| {
                            model.tenants.push((id, Vec::new()));
                        })
                    }
                    Op::Unregister { pick } => {
                        if model.tenants.is_empty() {
                            Ok(())
                        } else {
                            let (tenant, _) = model.tenants.remove(pick % model.tenants.len());
                            // Even when the fence fails, the tenant is gone (its memory leaked).
                            state.unregister(tenant)
                        }
                    }
                    Op::Alloc { pick, len, extra } => {
                        if model.tenants.is_empty() {
                            Ok(())
                        } else {
                            let index = pick % model.tenants.len();
                            let tenant = model.tenants[index].0;
                            state.alloc(tenant, len * G, (len + extra) * G).map(|(block, _, _)| {
                                model.tenants[index].1.push((block, len));
                            })
                        }
                    }
                    Op::Grow { pick, by } => match model.block(pick) {
                        Some((tenant, block, len)) => state
                            .grow(tenant, block, (len + by) * G)
                            .map(|()| model.set_len(tenant, block, len + by)),
                        None => Ok(()),
                    },
                    Op::Shrink { pick, keep } => match model.block(pick) {
                        Some((tenant, block, len)) => {
                            let keep = keep.min(len);
                            state
                                .shrink(tenant, block, keep * G)
                                .map(|()| model.set_len(tenant, block, keep))
                        }
                        None => Ok(()),
                    },
                    Op::Free { pick } => match model.block(pick) {
                        Some((tenant, block, _)) => {
                            // Freed even when the fence fails (its memory is leaked then).
                            model.remove(tenant, block);
                            state.free(tenant, block)
                        }
                        None => Ok(()),
                    },
                    Op::Graft { pick, donor } => match (model.block(pick), model.block(donor)) {
                        (Some((t, target, _)), Some((d, donor, _))) if t == d => {
                            state.graft(t, target, donor).map(|()| model.remove(t, donor))
                        }
                        _ => Ok(()),
                    },
                    Op::Drain => {
                        state.drain();
                        Ok(())
                    }
                };
                if let Err(error) = &outcome {
                    prop_assert!(typed(error), "untyped error {error:?} for {op:?}");
                    let after = state.stats();
                    let freeing = matches!(op, Op::Free { .. } | Op::Unregister { .. });
                    if !freeing {
                        // A refusal changes nothing but the cache it released.
                        prop_assert_eq!(after.mapped, before.mapped, "{:?} changed mapped memory", op);
                        prop_assert_eq!(after.mappings, before.mappings, "{:?} changed mappings", op);
                    }
                }
                if !failing {
                    fake.clear_failure();
                }
                check(&state, &fake, &model)?;
            }
            // Everything freed and drained: nothing is left but what a failed fence leaked.
            for (tenant, _) in model.tenants.drain(..) {
                let _ = state.unregister(tenant);
            }
            state.drain();
            prop_assert_eq!(fake.live_mappings(), 0);
            prop_assert_eq!(fake.live_chunks(), fake.leaked_mappings());
            let _ = injected;
        }
    }
}

mod grafting {
    use crate::fence::FencePolicy;
    use crate::pool::fake::{Call, Fake};
    use crate::pool::state::{State, Switches};

    const G: usize = 2 << 20;

    #[test]
    fn a_graft_moves_the_donors_chunks_and_backs_the_rest_from_the_cache() {
        let fake = Fake::new(64 * G);
        let switches = Switches {
            stitching: true,
            drain_on_oom: true,
        };
        let mut state = State::new(fake.clone(), G, None, switches, FencePolicy::Context, 256);
        let tenant = state.register("t", 64 * G, None).unwrap();
        // One chunk each; then a 1-granule chunk in the cache for the gap.
        let (spare, _, _) = state.alloc(tenant, G, G).unwrap();
        let (target, _, _) = state.alloc(tenant, 3 * G, 3 * G).unwrap();
        let (donor, _, _) = state.alloc(tenant, 2 * G, 2 * G).unwrap();
        state.free(tenant, spare).unwrap();
        let creates = fake.calls(Call::Create);
        let chunks_before = state.stats().chunks;
        state.graft(tenant, target, donor).unwrap();
        let info = state.info(tenant, target).unwrap();
        assert_eq!((info.len, info.mapped, info.mappings), (3 * G, 3 * G, 2));
        assert!(state.info(tenant, donor).is_err(), "the donor is gone");
        assert_eq!(
            fake.calls(Call::Create),
            creates,
            "the gap came from the cache"
        );
        assert_eq!(
            state.stats().chunks,
            chunks_before,
            "nothing created or released"
        );
        assert_eq!(fake.live_mappings(), state.stats().mappings);
        assert!(state.graft(tenant, target, target).is_err());
        let (longer, _, _) = state.alloc(tenant, 4 * G, 4 * G).unwrap();
        let before = state.stats();
        assert!(
            state.graft(tenant, target, longer).is_err(),
            "donor longer than target"
        );
        assert_eq!(state.stats().mappings, before.mappings);
        state.unregister(tenant).unwrap();
    }

    fn pool(device_granules: usize) -> (Fake, State<Fake>, crate::pool::book::TenantId) {
        let fake = Fake::new(device_granules * G);
        let switches = Switches {
            stitching: true,
            drain_on_oom: true,
        };
        let mut state = State::new(fake.clone(), G, None, switches, FencePolicy::Context, 256);
        let tenant = state.register("t", 64 * G, None).unwrap();
        (fake, state, tenant)
    }

    #[test]
    fn a_held_block_holds_its_memory_unmapped_until_it_is_mapped() {
        let (fake, mut state, tenant) = pool(8);
        let maps = fake.calls(Call::Map);
        let (block, _, _) = state.alloc_held(tenant, 3 * G).unwrap();
        let info = state.info(tenant, block).unwrap();
        assert_eq!(
            (info.len, info.mapped, info.mappings, info.held),
            (0, 0, 0, 3 * G)
        );
        assert_eq!(fake.calls(Call::Map), maps, "nothing mapped");
        assert_eq!(fake.live_mappings(), 0);
        // The memory is the block's: a request past the device is refused at allocation.
        assert!(state
            .alloc_held(tenant, 6 * G)
            .unwrap_err()
            .is_out_of_memory());
        state.map_held(tenant, block).unwrap();
        let info = state.info(tenant, block).unwrap();
        assert_eq!((info.len, info.mapped, info.held), (3 * G, 3 * G, 0));
        assert_eq!(fake.calls(Call::Map), maps + 1);
        state.map_held(tenant, block).unwrap(); // nothing left to map
        assert_eq!(fake.calls(Call::Map), maps + 1);
        // Freed unmapped, a held block's memory goes to the cache.
        let (unused, _, _) = state.alloc_held(tenant, 2 * G).unwrap();
        let cached = state.stats().cached;
        state.free(tenant, unused).unwrap();
        assert_eq!(state.stats().cached, cached + 2 * G);
        let (left_held, _, _) = state.alloc_held(tenant, 2 * G).unwrap();
        let _ = left_held;
        state.unregister(tenant).unwrap();
        assert_eq!(fake.live_mappings(), 0);
    }

    #[test]
    fn a_graft_onto_a_held_block_maps_the_donor_and_only_the_rest() {
        let (fake, mut state, tenant) = pool(64);
        // The resize idiom, twice: the second round reuses only cached memory.
        for round in 0..2 {
            let (donor, _, _) = state.alloc(tenant, 3 * G, 3 * G).unwrap();
            let creates = fake.calls(Call::Create);
            let (maps, accesses) = (fake.calls(Call::Map), fake.calls(Call::Access));
            let (target, _, _) = state.alloc_held(tenant, 6 * G).unwrap();
            state.graft(tenant, target, donor).unwrap();
            let info = state.info(tenant, target).unwrap();
            assert_eq!((info.len, info.mapped, info.held), (6 * G, 6 * G, 0));
            assert_eq!(info.mappings, 2, "the donor's chunk, then the tail's");
            assert_eq!(fake.calls(Call::Map) - maps, 2, "round {round}");
            assert_eq!(fake.calls(Call::Access) - accesses, 2, "round {round}");
            if round > 0 {
                assert_eq!(fake.calls(Call::Create), creates, "all from the cache");
            }
            assert!(state.info(tenant, donor).is_err(), "the donor is gone");
            assert_eq!(fake.live_mappings(), state.stats().mappings);
            state.free(tenant, target).unwrap();
        }
        state.unregister(tenant).unwrap();
    }

    #[test]
    fn a_failed_graft_onto_a_held_block_leaves_both_as_they_were() {
        let (fake, mut state, tenant) = pool(64);
        let (donor, _, _) = state.alloc(tenant, 2 * G, 2 * G).unwrap();
        let (target, _, _) = state.alloc_held(tenant, 4 * G).unwrap();
        fake.fail(Call::Map, 0);
        assert!(state.graft(tenant, target, donor).is_err());
        fake.clear_failure();
        let donor_info = state.info(tenant, donor).unwrap();
        assert_eq!((donor_info.len, donor_info.mapped), (2 * G, 2 * G));
        let info = state.info(tenant, target).unwrap();
        assert_eq!((info.len, info.mapped, info.held), (0, 0, 4 * G));
        assert_eq!(fake.live_mappings(), state.stats().mappings);
        // Then the caller's fallback: map the target and copy.
        state.map_held(tenant, target).unwrap();
        assert_eq!(state.info(tenant, target).unwrap().len, 4 * G);
        // A donor longer than the target is refused before anything moves.
        let (longer, _, _) = state.alloc(tenant, 6 * G, 6 * G).unwrap();
        let (short, _, _) = state.alloc_held(tenant, 2 * G).unwrap();
        assert!(state.graft(tenant, short, longer).is_err());
        assert_eq!(state.info(tenant, short).unwrap().held, 2 * G);
        state.unregister(tenant).unwrap();
        assert_eq!(fake.live_mappings(), 0);
    }
}
