//! Spaces, datasets, graphs, pools and regions used from several threads at once. Every
//! result is checked (patterns on the GPU, exact values), every test runs under a deadline so a
//! deadlock fails with a message instead of hanging, and device memory must come back.

mod common;

use std::sync::{Arc, Barrier, Mutex};
use std::time::Duration;

use common::deadline::within;
use common::leaks::{Baseline, MIB};
use common::{gpu, rng};
use rand::{Rng, SeedableRng};
use stablebuf::cudarc::driver::CudaStream;
use stablebuf::error::{GraphError, OffloadError, RegionError};
use stablebuf::kernels::Kernels;
use stablebuf::region::{Region, RegionOptions};
use stablebuf::{
    buffer, Dataset, ElasticPool, Error, FencePolicy, HostArena, HostStorage, Layout, PoolOptions,
    Space, SpaceOptions, StableGraph,
};

const LIMIT: Duration = Duration::from_secs(120);
/// The driver's own allocations move by a page now and then.
const SLACK: usize = 4 * MIB;

fn layout() -> Layout {
    Layout::builder()
        .group("x")
        .input("x", MIB)
        .output("y", 64 << 10)
        .scratch("t", MIB)
        .build()
        .unwrap()
}

fn dataset(space: &Space, kernels: &Kernels, stream: &Arc<CudaStream>, seed: u32) -> Dataset {
    let d = space.new_dataset("x").unwrap();
    let view = d.view::<u32>("x", stream).unwrap();
    kernels
        .fill_pattern(stream, &view, 0, MIB / 4, seed)
        .unwrap();
    stream.synchronize().unwrap();
    d
}

/// A graph copying x into scratch t.
fn copy_graph(space: &Space, stream: &Arc<CudaStream>) -> StableGraph {
    let (x, t) = (
        space.slot("x").unwrap().clone(),
        space.slot("t").unwrap().clone(),
    );
    space
        .capture(stream, move |s| buffer::copy_between(s, &t, 0, &x, 0, MIB))
        .unwrap()
}

/// Mismatches of t against the pattern of `seed`.
fn t_errors(space: &Space, kernels: &Kernels, stream: &Arc<CudaStream>, seed: u32) -> u64 {
    kernels
        .pattern_mismatches(stream, space.slot("t").unwrap(), 0, MIB / 4, seed)
        .unwrap()
}

#[test]
#[ignore = "needs a CUDA GPU"]
fn binds_on_one_space_while_another_space_replays() {
    let gpu = gpu();
    let baseline = Baseline::take(&gpu.ctx);
    let kernels = gpu.kernels.clone();
    let ctx = gpu.ctx.clone();
    let rounds = 300;
    within("binds beside replays", LIMIT, move || {
        let options = SpaceOptions::default().fence(FencePolicy::AttachedStreams);
        let (sa, sb) = (ctx.new_stream().unwrap(), ctx.new_stream().unwrap());
        let a = Space::with_options(&ctx, layout(), options.clone()).unwrap();
        let b = Space::with_options(&ctx, layout(), options).unwrap();
        let a_sets: Vec<Dataset> = (0..3)
            .map(|i| dataset(&a, &kernels, &sa, 100 + i))
            .collect();
        let b_set = dataset(&b, &kernels, &sb, 200);
        b.bind(&b_set).unwrap();
        // Copy nodes check their addresses when captured: capture with a dataset bound.
        a.bind(&a_sets[0]).unwrap();
        let (ga, gb) = (copy_graph(&a, &sa), copy_graph(&b, &sb));
        let barrier = Arc::new(Barrier::new(2));
        std::thread::scope(|scope| {
            let binder = scope.spawn(|| {
                barrier.wait();
                for round in 0..rounds {
                    let i = round % 3;
                    a.bind(&a_sets[i]).unwrap();
                    kernels.fill(&sa, a.slot("t").unwrap(), f32::NAN).unwrap();
                    ga.replay().unwrap();
                    sa.synchronize().unwrap();
                    let bad = t_errors(&a, &kernels, &sa, 100 + i as u32);
                    assert_eq!(bad, 0, "round {round}: space A replayed on the wrong data");
                }
            });
            let replayer = scope.spawn(|| {
                barrier.wait();
                for round in 0..rounds * 3 {
                    kernels.fill(&sb, b.slot("t").unwrap(), f32::NAN).unwrap();
                    gb.replay().unwrap();
                    sb.synchronize().unwrap();
                    assert_eq!(
                        t_errors(&b, &kernels, &sb, 200),
                        0,
                        "round {round}: space B"
                    );
                }
            });
            binder.join().unwrap();
            replayer.join().unwrap();
        });
        drop((ga, gb, a_sets, b_set, a, b));
    });
    eprintln!("threads: 2 (a binder on space A, a replayer on space B), {rounds} binds");
    baseline.compare(&gpu.ctx, SLACK).unwrap();
}

#[test]
#[ignore = "needs a CUDA GPU"]
fn one_graph_replayed_from_four_threads_at_once_counts_every_launch() {
    let gpu = gpu();
    let baseline = Baseline::take(&gpu.ctx);
    let ctx = gpu.ctx.clone();
    let kernels = gpu.kernels.clone();
    let (threads, launches) = (4usize, 250usize);
    within("one graph, four threads", LIMIT, move || {
        let space = Space::new(&ctx, layout()).unwrap();
        let stream = ctx.new_stream().unwrap();
        let d = dataset(&space, &kernels, &stream, 1);
        space.bind(&d).unwrap();
        space
            .write(&stream, "y", &vec![5.0f32; (64 << 10) / 4])
            .unwrap();
        let y = space.slot("y").unwrap().clone();
        let k = kernels.clone();
        // `StableGraph` is Sync: the same graph, shared by reference, replayed everywhere.
        let graph = space
            .capture(&stream, move |s| k.affine(s, &y, 1.0, 1.0))
            .unwrap();
        std::thread::scope(|scope| {
            for _ in 0..threads {
                scope.spawn(|| {
                    let mine = ctx.new_stream().unwrap();
                    for _ in 0..launches {
                        graph.replay_on(&mine).unwrap();
                    }
                    mine.synchronize().unwrap();
                });
            }
        });
        ctx.synchronize().unwrap();
        let got: Vec<f32> = space.read(&stream, "y").unwrap();
        // Launches of one executable run one after another on the GPU: none may be lost.
        let want = 5.0 + (threads * launches) as f32;
        let bad = got.iter().filter(|&&v| v != want).count();
        assert_eq!(
            bad, 0,
            "{bad} values differ from {want} (first: {})",
            got[0]
        );
        drop((graph, d, space));
    });
    eprintln!("threads: {threads} replaying one graph, {launches} launches each");
    baseline.compare(&gpu.ctx, SLACK).unwrap();
}

#[test]
#[ignore = "needs a CUDA GPU"]
fn pool_allocations_from_eight_threads_never_overlap_and_all_come_back() {
    let gpu = gpu();
    let baseline = Baseline::take(&gpu.ctx);
    let ctx = gpu.ctx.clone();
    let kernels = gpu.kernels.clone();
    let mut seeder = rng("pool_threads");
    let seed: u64 = seeder.gen();
    let (threads, rounds) = (8usize, 150usize);
    within("pool from eight threads", LIMIT, move || {
        let pool = ElasticPool::new(&ctx, PoolOptions::default()).unwrap();
        let tenants = [
            pool.register("even", 512 * MIB).unwrap(),
            pool.register("odd", 512 * MIB).unwrap(),
        ];
        std::thread::scope(|scope| {
            for thread in 0..threads {
                let (tenant, kernels, ctx) = (&tenants[thread % 2], &kernels, &ctx);
                scope.spawn(move || {
                    let mut rng = rand::rngs::StdRng::seed_from_u64(seed + thread as u64);
                    let stream = ctx.new_stream().unwrap();
                    let mut live = Vec::new();
                    for round in 0..rounds {
                        if (live.len() < 4 && rng.gen_bool(0.6)) || live.is_empty() {
                            let len = rng.gen_range(1..=3) * 2 * MIB;
                            let mut block = tenant.alloc_growable(len, 8 * MIB).unwrap();
                            let pattern = (thread * 100_000 + round) as u32;
                            kernels
                                .fill_pattern(&stream, &block, 0, len / 4, pattern)
                                .unwrap();
                            if rng.gen_bool(0.3) {
                                block.grow(len + 2 * MIB).unwrap();
                            }
                            live.push((block, len, pattern));
                        } else {
                            let (block, _, _) = live.swap_remove(rng.gen_range(0..live.len()));
                            block.free().unwrap();
                        }
                        // Everything this thread holds must still be its own.
                        for (block, len, pattern) in &live {
                            let bad = kernels
                                .pattern_mismatches(&stream, block, 0, len / 4, *pattern)
                                .unwrap();
                            assert_eq!(
                                bad, 0,
                                "thread {thread} round {round}: a block changed under it"
                            );
                        }
                    }
                    drop(live);
                });
            }
        });
        let stats = pool.stats();
        assert_eq!((stats.mapped, stats.mappings), (0, 0), "{stats}");
        pool.drain();
        drop(tenants);
    });
    eprintln!("threads: {threads} allocating from one pool, {rounds} rounds each");
    baseline.compare(&gpu.ctx, SLACK).unwrap();
}

#[test]
#[ignore = "needs a CUDA GPU"]
fn offload_and_restore_race_binds_and_replays_of_the_same_space() {
    let gpu = gpu();
    let baseline = Baseline::take(&gpu.ctx);
    let ctx = gpu.ctx.clone();
    let kernels = gpu.kernels.clone();
    let rounds = 200usize;
    within("offload beside binds", LIMIT, move || {
        let space = Space::new(&ctx, layout()).unwrap();
        let (s1, s2) = (ctx.new_stream().unwrap(), ctx.new_stream().unwrap());
        let arena = HostArena::new(&ctx, 8 * MIB).unwrap();
        let d1 = Mutex::new(dataset(&space, &kernels, &s1, 11));
        let d2 = dataset(&space, &kernels, &s2, 22);
        // Copy nodes check their addresses when captured: capture with a dataset bound.
        space.bind(&d2).unwrap();
        let graph = copy_graph(&space, &s2);
        let (mut replays, mut unbound) = (0usize, 0usize);
        std::thread::scope(|scope| {
            let offloader = scope.spawn(|| {
                for round in 0..rounds {
                    let mut d1 = d1.lock().unwrap();
                    let storage = if round % 2 == 0 {
                        HostStorage::Pinned(arena.clone())
                    } else {
                        HostStorage::Pageable
                    };
                    d1.offload(&storage, &s1).unwrap();
                    assert!(matches!(
                        space.bind(&d1),
                        Err(Error::Offload(OffloadError::Offloaded { .. }))
                    ));
                    d1.restore(&s1).unwrap();
                    space.bind(&d1).unwrap();
                }
            });
            // Binds d2 and replays while d1 comes and goes under the same group.
            for _ in 0..rounds * 2 {
                space.bind(&d2).unwrap();
                kernels
                    .fill(&s2, space.slot("t").unwrap(), f32::NAN)
                    .unwrap();
                match graph.replay() {
                    Ok(()) => {
                        replays += 1;
                        s2.synchronize().unwrap();
                        let as_d1 = t_errors(&space, &kernels, &s2, 11);
                        let as_d2 = t_errors(&space, &kernels, &s2, 22);
                        assert!(
                            as_d1 == 0 || as_d2 == 0,
                            "a replay read neither dataset ({as_d1} and {as_d2} mismatches)"
                        );
                    }
                    // The offload took d1 out between our bind (already replaced) and the replay.
                    Err(Error::Graph(GraphError::Unbound { .. })) => unbound += 1,
                    Err(other) => panic!("replay: {other}"),
                }
            }
            offloader.join().unwrap();
        });
        eprintln!("  {replays} replays checked, {unbound} refused as unbound");
        let d1 = d1.into_inner().unwrap();
        // Both threads ended with a bind: one of the two is bound, whole.
        let bound = space.bound_dataset("x").unwrap();
        assert!(
            bound == Some(d1.id()) || bound == Some(d2.id()),
            "{bound:?}"
        );
        drop((graph, d1, d2, space));
        assert_eq!(arena.free_bytes(), arena.capacity());
    });
    eprintln!("threads: 2 (offload/restore/bind of one dataset, binds and replays of another), {rounds} offloads");
    baseline.compare(&gpu.ctx, SLACK).unwrap();
}

#[test]
#[ignore = "needs a CUDA GPU"]
fn regions_used_from_four_threads_while_a_fifth_sleeps_and_wakes_them() {
    let gpu = gpu();
    let baseline = Baseline::take(&gpu.ctx);
    let ctx = gpu.ctx.clone();
    let mut seeder = rng("region_threads");
    let seed: u64 = seeder.gen();
    let (threads, rounds) = (4usize, 120usize);
    within("regions from five threads", LIMIT, move || {
        let region =
            Region::new(&ctx, "shared", RegionOptions::default().capacity(512 * MIB)).unwrap();
        let arena = HostArena::new(&ctx, 64 * MIB).unwrap();
        let done = std::sync::atomic::AtomicUsize::new(0);
        let (mut sleeps, mut refused) = (0usize, 0usize);
        std::thread::scope(|scope| {
            let workers: Vec<_> = (0..threads)
                .map(|thread| {
                    let (region, ctx, done) = (&region, &ctx, &done);
                    scope.spawn(move || {
                        let mut rng = rand::rngs::StdRng::seed_from_u64(seed + thread as u64);
                        let stream = ctx.new_stream().unwrap();
                        let mut live: Vec<(u64, Vec<u32>)> = Vec::new();
                        let mut asleep_refusals = 0usize;
                        for _ in 0..rounds {
                            if (live.len() < 3 && rng.gen_bool(0.6)) || live.is_empty() {
                                let words = rng.gen_range(1..=(3 * MIB / 4));
                                let data: Vec<u32> = (0..words).map(|_| rng.gen()).collect();
                                match region.alloc(words * 4) {
                                    Ok(address) => match region.write(&stream, address, &data) {
                                        Ok(()) => live.push((address, data)),
                                        Err(Error::Region(RegionError::RegionAsleep {
                                            ..
                                        })) => {
                                            // Asleep between alloc and write: try later.
                                            asleep_refusals += 1;
                                            region.free(address).unwrap();
                                        }
                                        Err(other) => panic!("write: {other}"),
                                    },
                                    Err(Error::Region(RegionError::RegionAsleep { .. })) => {
                                        asleep_refusals += 1
                                    }
                                    Err(other) => panic!("alloc: {other}"),
                                }
                            } else {
                                let (address, _) = live.swap_remove(rng.gen_range(0..live.len()));
                                assert_eq!(
                                    region.allocation_at(address).map(|a| a.0),
                                    Some(address)
                                );
                                region.free(address).unwrap();
                            }
                            // Every byte this thread wrote is still there (sleeps included).
                            for (address, data) in &live {
                                let mut out = vec![0u32; data.len()];
                                match region.read_into(&stream, *address, &mut out) {
                                    Ok(()) => {
                                        assert!(out == *data, "thread {thread}: contents changed")
                                    }
                                    Err(Error::Region(RegionError::RegionAsleep { .. })) => {
                                        asleep_refusals += 1
                                    }
                                    Err(other) => panic!("read: {other}"),
                                }
                            }
                        }
                        for (address, _) in live {
                            region.free(address).unwrap();
                        }
                        done.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
                        asleep_refusals
                    })
                })
                .collect();
            let stream = ctx.new_stream().unwrap();
            while done.load(std::sync::atomic::Ordering::SeqCst) < threads {
                region
                    .sleep(&HostStorage::Pinned(arena.clone()), &stream)
                    .unwrap();
                std::thread::sleep(Duration::from_millis(2));
                region.wake(&stream).unwrap();
                sleeps += 1;
                std::thread::sleep(Duration::from_millis(3));
            }
            refused = workers.into_iter().map(|w| w.join().unwrap()).sum();
        });
        let stats = region.stats();
        assert_eq!((stats.allocations, stats.asleep), (0, false), "{stats:?}");
        eprintln!("  {sleeps} sleep/wake cycles, {refused} calls refused while asleep");
        drop(region);
        assert_eq!(arena.free_bytes(), arena.capacity());
    });
    eprintln!(
        "threads: {} ({threads} allocating, writing and reading; 1 sleeping and waking)",
        threads + 1
    );
    baseline.compare(&gpu.ctx, SLACK).unwrap();
}
