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
        5 => (0u32..3, 1usize..24, any::<bool>(), 0usize..8)
            .prop_map(|(tenant, granules, stitching, spare)| Op::Alloc { tenant, granules, stitching, spare }),
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
        } => {
            let tenant = TenantId(tenant);
            let asked = granules * G;
            let room = asked + spare * G;
            let cached_before: Vec<ChunkId> = book.cached_chunks().map(|(id, _)| id).collect();
            let Ok(plan) = book.plan(tenant, asked, stitching, room) else {
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
    #![proptest_config(ProptestConfig::with_cases(256))]

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
