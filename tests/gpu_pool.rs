//! Elastic memory on a real GPU: growth in place, stitched ranges used end to end by kernels,
//! drain-and-retry against real out-of-memory, budgets across tenants, and no leaks.

mod common;

use common::{gpu, random_vec, rng, Gpu};
use rand::Rng;
use stablebuf::buffer::LinearBuffer;
use stablebuf::device::memory_info;
use stablebuf::error::{GraphError, LayoutError, PoolError};
use stablebuf::pool::Block;
use stablebuf::pool::{DrainReason, EventKind};
use stablebuf::{ElasticPool, Error, PoolOptions};

const MIB: usize = 1 << 20;
const GIB: usize = 1 << 30;

/// Writes the seeded pattern over `[first, first + count)` u32 elements, after checking that
/// the checker sees a poisoned (NaN-filled) range as all wrong, so a pass means something.
fn write_pattern(gpu: &Gpu, block: &Block, first: usize, count: usize, seed: u32) {
    gpu.kernels.fill(&gpu.stream, block, f32::NAN).unwrap();
    let wrong = gpu
        .kernels
        .pattern_mismatches(&gpu.stream, block, first, count, seed)
        .unwrap();
    assert_eq!(wrong, count as u64, "a poisoned range must fail the check");
    gpu.kernels
        .fill_pattern(&gpu.stream, block, first, count, seed)
        .unwrap();
}

fn mismatches(gpu: &Gpu, block: &Block, first: usize, count: usize, seed: u32) -> u64 {
    gpu.kernels
        .pattern_mismatches(&gpu.stream, block, first, count, seed)
        .unwrap()
}

#[test]
#[ignore = "needs a CUDA GPU"]
fn growth_keeps_the_address_and_the_data_and_copies_nothing() {
    let gpu = gpu();
    let mut rng = rng("growth");
    let pool = ElasticPool::new(&gpu.ctx, PoolOptions::default()).unwrap();
    let tenant = pool.register("grower", 8 * GIB).unwrap();
    let initial = 100 * MIB + 12; // not a granule multiple
    let mut block = tenant.alloc_growable(initial, GIB).unwrap();
    let address = block.address();
    assert_eq!(block.len(), initial);
    assert_eq!(block.capacity(), GIB);

    // Random host data in the first part, a seeded pattern over the rest of it.
    let head: Vec<f32> = random_vec(&mut rng, 1 << 16);
    let seed = rng.gen();
    let first_words = initial / 4;
    write_pattern(&gpu, &block, 0, first_words, seed);
    block.write(&gpu.stream, 0, &head).unwrap();
    let head_words = head.len();

    let mut mapped_before = block.info().unwrap().mappings;
    for (step, new_len) in [600 * MIB, 600 * MIB + 4, GIB].into_iter().enumerate() {
        let creates = pool.stats().creates;
        block.grow(new_len).unwrap();
        let info = block.info().unwrap();
        assert_eq!(block.address(), address, "step {step}: the address moved");
        assert_eq!(info.len, new_len);
        assert!(info.mapped >= new_len);
        // Growth appends at most one new chunk (one cuMemCreate, one mapping); nothing moves.
        assert!(info.mappings <= mapped_before + 1);
        assert!(pool.stats().creates <= creates + 1);
        mapped_before = info.mappings;
        let back: Vec<f32> = block.read(&gpu.stream, 0, head_words).unwrap();
        assert_eq!(back, head, "step {step}: host-written data changed");
        assert_eq!(
            mismatches(&gpu, &block, head_words, first_words - head_words, seed),
            0,
            "step {step}: pattern changed"
        );
    }
    // The new part is usable end to end.
    gpu.kernels
        .fill_pattern(
            &gpu.stream,
            &block,
            first_words,
            GIB / 4 - first_words,
            seed,
        )
        .unwrap();
    assert_eq!(
        mismatches(&gpu, &block, head_words, GIB / 4 - head_words, seed),
        0
    );

    // Past the reserved capacity: a typed error, and the block is as it was.
    let before = block.info().unwrap();
    match block.grow(GIB + 1) {
        Err(Error::Pool(PoolError::BeyondCapacity { asked, capacity })) => {
            assert_eq!((asked, capacity), (GIB + 1, GIB))
        }
        other => panic!("expected BeyondCapacity, got {other:?}"),
    }
    assert_eq!(block.info().unwrap(), before);

    // Shrink keeps the head, caches the tail; growing again reuses the cache, same address.
    block.shrink(300 * MIB).unwrap();
    assert!(pool.stats().cached > 0);
    let creates = pool.stats().creates;
    block.grow(GIB).unwrap(); // exactly what shrinking cached
    assert_eq!(block.address(), address);
    assert_eq!(
        pool.stats().creates,
        creates,
        "regrowth came from the cache"
    );
    let back: Vec<f32> = block.read(&gpu.stream, 0, head_words).unwrap();
    assert_eq!(back, head);
    assert_eq!(
        mismatches(&gpu, &block, head_words, 300 * MIB / 4 - head_words, seed),
        0
    );
    assert!(matches!(
        block.shrink(GIB + 4),
        Err(Error::Layout(LayoutError::InvalidShape(_)))
    ));
    let grows = pool
        .events()
        .iter()
        .filter(|e| matches!(e.kind, EventKind::Grow { .. }))
        .count();
    assert!(grows >= 5, "grows are logged: {grows}");
}

#[test]
#[ignore = "needs a CUDA GPU"]
fn stitched_chunks_form_one_range_that_kernels_read_and_write_end_to_end() {
    let gpu = gpu();
    let mut rng = rng("stitch");
    let pool = ElasticPool::new(&gpu.ctx, PoolOptions::default()).unwrap();
    let tenant = pool.register("stitcher", 4 * GIB).unwrap();
    let mut blocks: Vec<Option<Block>> = (0..8)
        .map(|_| Some(tenant.alloc(64 * MIB).unwrap()))
        .collect();
    let seed: u32 = rng.gen();
    for block in blocks.iter().flatten() {
        write_pattern(&gpu, block, 0, 16 * MIB, seed);
    }
    // Free every other block: four 64 MiB chunks, neither adjacent in addresses nor in memory.
    for index in [1, 3, 5, 7] {
        blocks[index] = None;
    }
    let stats = pool.stats();
    assert_eq!((stats.cached, stats.mapped), (256 * MIB, 256 * MIB));
    assert!(stats.virtual_fragmentation > 0.0, "{stats}");

    let stitched = tenant.alloc(256 * MIB).unwrap();
    let after = pool.stats();
    assert_eq!(after.creates, stats.creates, "no new physical memory");
    assert_eq!(stitched.info().unwrap().mappings, 4);
    assert_eq!((after.cached, after.stitched), (0, stats.stitched + 1));

    // A kernel reads and writes the whole range in place: x = a·x + b on fresh random data.
    let elements = 256 * MIB / 4;
    let x = random_vec(&mut rng, elements);
    stitched.write(&gpu.stream, 0, &x).unwrap();
    let (a, b) = (rng.gen_range(0.5f32..2.0), rng.gen_range(-1.0f32..1.0));
    gpu.kernels.affine(&gpu.stream, &stitched, a, b).unwrap();
    let y: Vec<f32> = stitched.read(&gpu.stream, 0, elements).unwrap();
    for (i, (got, x)) in y.iter().zip(&x).enumerate() {
        let want = a * x + b;
        assert!(
            approx::relative_eq!(*got, want, epsilon = 1e-6, max_relative = 1e-6),
            "element {i} (chunk {}): got {got}, want {want}",
            i * 4 / (64 * MIB)
        );
    }
    // And the pattern across every chunk seam, written and checked by kernels.
    write_pattern(&gpu, &stitched, 0, elements, seed ^ 1);
    assert_eq!(mismatches(&gpu, &stitched, 0, elements, seed ^ 1), 0);
    // The blocks left alone kept their data.
    for block in blocks.iter().flatten() {
        assert_eq!(mismatches(&gpu, block, 0, 16 * MIB, seed), 0);
    }

    // Without stitching the same request needs new memory.
    drop(stitched);
    pool.set_stitching(false);
    let creates = pool.stats().creates;
    let whole = tenant.alloc(256 * MIB).unwrap();
    assert_eq!(whole.info().unwrap().mappings, 1);
    assert_eq!(pool.stats().creates, creates + 1);

    let svg = pool.timeline_svg("stitching test").unwrap();
    assert!(svg.contains("stitcher"));
}

/// `count` blocks of 2 MiB with every other one freed: `count / 2` scattered 2 MiB chunks cached.
/// Returns the blocks that stay.
fn scatter_small_chunks(
    pool: &ElasticPool,
    tenant: &stablebuf::pool::Tenant,
    count: usize,
) -> Vec<Block> {
    pool.drain();
    let blocks: Vec<Block> = (0..count).map(|_| tenant.alloc(2 * MIB).unwrap()).collect();
    let kept: Vec<Block> = blocks.into_iter().step_by(2).collect();
    assert_eq!(pool.stats().cached, count / 2 * 2 * MIB);
    kept
}

#[test]
#[ignore = "needs a CUDA GPU"]
fn a_stitch_past_its_cap_creates_the_rest_unless_the_device_is_full() {
    let gpu = gpu();
    let mut rng = rng("stitch_cap");
    let pool = ElasticPool::new(&gpu.ctx, PoolOptions::default()).unwrap();
    let tenant = pool.register("capped", 4 * GIB).unwrap();
    let asked = 80 * MIB; // 40 cached 2 MiB chunks would cover it; its cap is 2 mappings
    let words = asked / 4;

    let kept = scatter_small_chunks(&pool, &tenant, 80);
    let creates = pool.stats().creates;
    let capped = tenant.alloc(asked).unwrap();
    let info = capped.info().unwrap();
    assert_eq!(info.mappings, 3, "2 cached chunks + 1 new: {info:?}");
    assert_eq!(pool.stats().creates, creates + 1);
    assert_eq!(
        pool.stats().cached,
        38 * 2 * MIB,
        "the smallest chunks stayed cached"
    );
    let seed: u32 = rng.gen();
    write_pattern(&gpu, &capped, 0, words, seed);
    assert_eq!(mismatches(&gpu, &capped, 0, words, seed), 0);
    drop((capped, kept));

    // No room for the 76 MiB the capped plan would create: every cached chunk is stitched, under
    // one set-access that spans 40 allocations.
    let kept = scatter_small_chunks(&pool, &tenant, 80);
    let filler = fill_device_leaving(&gpu, 16 * MIB);
    let creates = pool.stats().creates;
    let stitched = tenant.alloc(asked).unwrap();
    assert_eq!(stitched.info().unwrap().mappings, 40);
    let stats = pool.stats();
    assert_eq!((stats.creates, stats.cached), (creates, 0), "{stats}");
    // The checker allocates a counter: give the device room again before using it.
    drop(filler);
    write_pattern(&gpu, &stitched, 0, words, seed ^ 1);
    assert_eq!(mismatches(&gpu, &stitched, 0, words, seed ^ 1), 0);
    drop((stitched, kept, tenant));
    pool.drain();
}

/// Allocates linear memory until about `leave` bytes of the device are free.
fn fill_device_leaving(gpu: &Gpu, leave: usize) -> LinearBuffer {
    stablebuf::release::trim_all(); // memory held for release is not free to the driver
    let (free, _) = memory_info(&gpu.ctx).unwrap();
    assert!(free > leave + GIB, "the device has only {free} bytes free");
    LinearBuffer::new(&gpu.ctx, free - leave).unwrap()
}

#[test]
#[ignore = "needs a CUDA GPU"]
fn drain_and_retry_succeeds_where_a_plain_retry_fails() {
    let gpu = gpu();
    stablebuf::release::trim_all(); // memory held for release is not free to the driver
    let (baseline, _) = memory_info(&gpu.ctx).unwrap();
    let pool = ElasticPool::new(&gpu.ctx, PoolOptions::default().drain_on_oom(false)).unwrap();
    let tenant = pool.register("oom", 16 * GIB).unwrap();
    drop(tenant.alloc(2 * GIB).unwrap()); // 2 GiB cached, still device memory
    assert_eq!(pool.stats().cached, 2 * GIB);

    let filler = fill_device_leaving(&gpu, GIB);
    let asked = 1536 * MIB; // more than is free; the cached chunk is too big to stitch
    for attempt in 0..2 {
        match tenant.alloc(asked) {
            Err(Error::Pool(PoolError::PoolOutOfMemory {
                asked: a,
                cached,
                held,
                drained,
            })) => assert_eq!((a, cached, held, drained), (asked, 2 * GIB, 0, 0)),
            other => panic!("attempt {attempt}: expected PoolOutOfMemory, got {other:?}"),
        }
    }
    let stats = pool.stats();
    assert_eq!(
        (stats.cached, stats.mapped, stats.refusals),
        (2 * GIB, 0, 2)
    );

    pool.set_drain_on_oom(true);
    let block = tenant.alloc(asked).unwrap();
    let stats = pool.stats();
    assert_eq!((stats.cached, stats.mapped, stats.drains), (0, asked, 1));
    let drained: Vec<_> = pool
        .events()
        .into_iter()
        .filter_map(|e| match e.kind {
            EventKind::Drain { reason, chunks } => Some((reason, chunks, e.bytes)),
            _ => None,
        })
        .collect();
    assert_eq!(drained, vec![(DrainReason::OutOfMemory, 1, 2 * GIB)]);
    write_pattern(&gpu, &block, 0, asked / 4, 7);
    assert_eq!(mismatches(&gpu, &block, 0, asked / 4, 7), 0);

    // When even draining cannot help, the error says what was asked, cached and held.
    match tenant.alloc(4 * GIB) {
        Err(Error::Pool(PoolError::PoolOutOfMemory {
            asked: a,
            held,
            drained,
            ..
        })) => assert_eq!((a, held, drained), (4 * GIB, asked, 0)),
        other => panic!("expected PoolOutOfMemory, got {other:?}"),
    }
    drop((block, filler, tenant));
    pool.drain();
    drop(pool);
    stablebuf::release::trim_all(); // memory held for release is not free to the driver
    let (after, _) = memory_info(&gpu.ctx).unwrap();
    assert!(
        after + 4 * MIB >= baseline,
        "device memory leaked: {baseline} free before, {after} after"
    );
}

#[test]
#[ignore = "needs a CUDA GPU"]
fn budgets_and_limits_are_enforced_and_unregistering_frees_everything() {
    let gpu = gpu();
    let pool = ElasticPool::new(&gpu.ctx, PoolOptions::default().budget(512 * MIB)).unwrap();
    let a = pool
        .register_limited("a", 4 * GIB, Some(256 * MIB))
        .unwrap();
    let b = pool.register("b", 4 * GIB).unwrap();
    let small = pool.register("small", 64 * MIB).unwrap();

    let a1 = a.alloc(256 * MIB).unwrap();
    let before = (pool.stats(), a.stats().unwrap());
    match a.alloc(2 * MIB) {
        Err(Error::Pool(PoolError::OverBudget {
            scope,
            asked,
            limit,
            held,
        })) => {
            assert!(scope.contains("`a`"), "{scope}");
            assert_eq!((asked, limit, held), (2 * MIB, 256 * MIB, 256 * MIB));
        }
        other => panic!("expected the tenant limit, got {other:?}"),
    }
    let after = (pool.stats(), a.stats().unwrap());
    assert_eq!(after.1, before.1, "tenant state unchanged");
    assert_eq!(
        (after.0.mapped, after.0.chunks, after.0.mappings),
        (before.0.mapped, before.0.chunks, before.0.mappings)
    );

    let b1 = b.alloc(256 * MIB).unwrap();
    match b.alloc(2 * MIB) {
        Err(Error::Pool(PoolError::OverBudget { scope, limit, .. })) => {
            assert_eq!((scope.as_str(), limit), ("pool budget", 512 * MIB))
        }
        other => panic!("expected the pool budget, got {other:?}"),
    }
    assert_eq!(pool.stats().mapped, 512 * MIB, "no partial allocation");
    match small.alloc(128 * MIB) {
        Err(Error::Pool(PoolError::VirtualCapacity { capacity, .. })) => {
            assert_eq!(capacity, 64 * MIB)
        }
        other => panic!("expected VirtualCapacity, got {other:?}"),
    }

    // A's memory goes to the cache; B's next request releases it to stay within budget.
    drop(a1);
    assert_eq!(pool.stats().cached, 256 * MIB);
    let b2 = b.alloc(128 * MIB).unwrap();
    let stats = pool.stats();
    assert_eq!(
        (stats.mapped, stats.cached, stats.drains),
        (384 * MIB, 0, 1)
    );
    let b_stats = b.stats().unwrap();
    assert_eq!(
        (b_stats.mapped, b_stats.blocks, b_stats.mappings),
        (384 * MIB, 2, 2)
    );
    assert_eq!(a.stats().unwrap().mapped, 0);

    // Unregistering B frees all it holds; its blocks are then refused, never a fault.
    b.unregister().unwrap();
    let stats = pool.stats();
    assert_eq!(
        (stats.mapped, stats.cached, stats.tenants),
        (0, 384 * MIB, 2)
    );
    assert_eq!(b1.len(), 0);
    assert!(matches!(
        b2.read::<f32>(&gpu.stream, 0, 1),
        Err(Error::Pool(PoolError::TenantGone { .. }))
    ));
    assert!(matches!(
        gpu.kernels.pattern_mismatches(&gpu.stream, &b1, 0, 1, 0),
        Err(Error::Layout(LayoutError::BufferTooSmall { .. }))
    ));
    let mut b2 = b2;
    assert!(matches!(
        b2.grow(GIB),
        Err(Error::Pool(PoolError::TenantGone { .. }))
    ));
    drop((b1, b2)); // freeing after the tenant is gone is a no-op
                    // The context is fine: the cache serves A again.
    let a2 = a.alloc(128 * MIB).unwrap();
    write_pattern(&gpu, &a2, 0, 32 * MIB, 3);
    assert_eq!(mismatches(&gpu, &a2, 0, 32 * MIB, 3), 0);
}

#[test]
#[ignore = "needs a CUDA GPU"]
fn nothing_leaks_after_many_cycles_of_everything() {
    let gpu = gpu();
    let mut rng = rng("leaks");
    let cycle = |rng: &mut rand::rngs::StdRng| {
        let pool = ElasticPool::new(&gpu.ctx, PoolOptions::default().budget(2 * GIB)).unwrap();
        let t1 = pool.register("one", 8 * GIB).unwrap();
        let t2 = pool.register("two", 8 * GIB).unwrap();
        let mut blocks: Vec<Block> = (0..6)
            .map(|i| {
                let tenant = if i % 2 == 0 { &t1 } else { &t2 };
                tenant
                    .alloc_growable(rng.gen_range(1..64) * MIB, 256 * MIB)
                    .unwrap()
            })
            .collect();
        for block in &mut blocks {
            let len = rng.gen_range(block.len()..=256 * MIB);
            block.grow(len).unwrap();
        }
        blocks.swap_remove(rng.gen_range(0..blocks.len()));
        blocks[0].shrink(MIB).unwrap();
        let big = t1.alloc(384 * MIB).unwrap(); // served partly from the cache
        let mut last = blocks.pop().unwrap();
        t2.unregister().unwrap(); // with blocks still alive
        assert!(last.grow(GIB).is_err());
        drop((big, blocks, last, t1));
        assert_eq!(pool.stats().mapped, 0);
        pool.drain();
        let stats = pool.stats();
        assert_eq!((stats.chunks, stats.cached), (0, 0), "{stats}");
    };
    cycle(&mut rng); // warm-up: module loads and driver pools settle
    stablebuf::release::trim_all(); // memory held for release is not free to the driver
    let (baseline, _) = memory_info(&gpu.ctx).unwrap();
    for _ in 0..20 {
        cycle(&mut rng);
    }
    stablebuf::release::trim_all(); // memory held for release is not free to the driver
    let (after, _) = memory_info(&gpu.ctx).unwrap();
    assert!(
        after + 2 * MIB >= baseline,
        "device memory leaked: {baseline} free before, {after} after"
    );
}

#[test]
#[ignore = "needs a CUDA GPU"]
fn a_capture_in_progress_blocks_mapping_and_unmapping() {
    use stablebuf::cudarc::driver::sys::{CUgraphInstantiate_flags, CUstreamCaptureMode};
    let gpu = gpu();
    let pool = ElasticPool::new(&gpu.ctx, PoolOptions::default()).unwrap();
    let tenant = pool.register("capture", GIB).unwrap();
    let mut block = tenant.alloc_growable(64 * MIB, 256 * MIB).unwrap();
    block.grow(128 * MIB).unwrap(); // two chunks, so shrinking would unmap one
    write_pattern(&gpu, &block, 0, 32 * MIB, 11);
    tenant.attach(&gpu.stream).unwrap();
    gpu.stream
        .begin_capture(CUstreamCaptureMode::CU_STREAM_CAPTURE_MODE_RELAXED)
        .unwrap();
    gpu.kernels.fill(&gpu.stream, &block, 1.0).unwrap();
    let shrunk = block.shrink(MIB);
    let grown = block.grow(192 * MIB);
    let freed_tenant_blocks = tenant.alloc(2 * MIB);
    let graph = gpu
        .stream
        .end_capture(CUgraphInstantiate_flags::CUDA_GRAPH_INSTANTIATE_FLAG_AUTO_FREE_ON_LAUNCH)
        .unwrap();
    assert!(graph.is_some(), "the capture stayed valid");
    assert!(
        matches!(shrunk, Err(Error::Graph(GraphError::BindDuringCapture))),
        "{shrunk:?}"
    );
    assert!(
        matches!(grown, Err(Error::Graph(GraphError::BindDuringCapture))),
        "{grown:?}"
    );
    assert!(matches!(
        freed_tenant_blocks,
        Err(Error::Graph(GraphError::BindDuringCapture))
    ));
    // Never launched, so the block holds what it held, all of it still mapped.
    assert_eq!(block.len(), 128 * MIB);
    assert_eq!(mismatches(&gpu, &block, 0, 32 * MIB, 11), 0);
}

#[test]
#[ignore = "needs a CUDA GPU"]
fn a_graft_moves_the_donors_bytes_under_the_target_without_a_copy() {
    let gpu = gpu();
    let mut rng = rng("graft");
    let pool = ElasticPool::new(&gpu.ctx, PoolOptions::default()).unwrap();
    let tenant = pool.register("resizer", 16 * GIB).unwrap();
    let (old_len, new_len) = (1536 * MIB, 3 * GIB);
    let mut old = tenant.alloc(old_len).unwrap();
    let seed = rng.gen();
    write_pattern(&gpu, &old, 0, old_len / 4, seed);
    let mut new = tenant.alloc(new_len).unwrap();
    let address = new.address();
    gpu.kernels.fill(&gpu.stream, &new, f32::NAN).unwrap();
    let creates = pool.stats().creates;
    new.graft(&mut old).unwrap();
    assert_eq!(new.address(), address, "the target keeps its address");
    assert_eq!(new.len(), new_len);
    assert_eq!(old.len(), 0, "the donor holds nothing");
    assert!(matches!(
        old.info(),
        Err(Error::Pool(PoolError::TenantGone { .. }))
    ));
    assert_eq!(
        mismatches(&gpu, &new, 0, old_len / 4, seed),
        0,
        "the donor's bytes are at the start of the target"
    );
    // The rest of the target is usable memory, end to end.
    let tail_seed = seed.wrapping_add(1);
    gpu.kernels
        .fill_pattern(
            &gpu.stream,
            &new,
            old_len / 4,
            (new_len - old_len) / 4,
            tail_seed,
        )
        .unwrap();
    assert_eq!(
        mismatches(&gpu, &new, old_len / 4, (new_len - old_len) / 4, tail_seed),
        0
    );
    assert_eq!(
        mismatches(&gpu, &new, 0, old_len / 4, seed),
        0,
        "the head is untouched"
    );
    assert!(
        pool.stats().creates <= creates + 1,
        "at most one new chunk, for the part the donor does not cover"
    );
    assert_eq!(new.info().unwrap().mapped, new_len);
    let mut third = tenant.alloc(old_len).unwrap();
    let mut small = tenant.alloc(64 * MIB).unwrap();
    assert!(
        matches!(
            small.graft(&mut third),
            Err(Error::Layout(LayoutError::InvalidShape(_)))
        ),
        "donor too long"
    );
    assert_eq!(third.len(), old_len, "a refused graft changes nothing");
}
