//! GPU tests of the KV cache on stable addresses (issue 45) under the real driver: every byte
//! of an empty cache reads as zeros and faults nowhere (a full-range copy, attention over
//! `max_len` of unbacked rows), writes past a length are typed errors, and a seeded serving run
//! (prompts copied in, forks by prefix sharing, releases, sleep and wake) under one graph
//! matches the CPU reference every few steps and the host mirror bit for bit at the end.

mod common;
#[path = "../examples/kv/mod.rs"]
mod kv;

use std::sync::Arc;

use common::{gpu, rng};
use kv::{random_bf16, serve, serve_space, step_work, Model, ServeRun, StepIo};
use rand::Rng;
use stablebuf::buffer::copy_between;
use stablebuf::error::KvError;
use stablebuf::kernels::AttentionKernels;
use stablebuf::kv::{KvCache, KvKind};
use stablebuf::{Error, Layout, Space, StableGraph};

/// Llama-3-8B's attention shape (1,024 tokens per granule), small enough to check in seconds.
fn model() -> Model {
    Model {
        layers: 2,
        heads: 16,
        kv_heads: 8,
        head_dim: 128,
        max_batch: 6,
        max_len: 4096,
    }
}

#[test]
#[ignore = "needs a CUDA GPU"]
fn an_empty_cache_reads_zeros_everywhere_and_never_faults() {
    let gpu = gpu();
    let model = model();
    let cache = KvCache::new(&gpu.ctx, model.layout()).unwrap();
    let row = cache.seq_stride();
    let layout = Layout::builder()
        .scratch("row", row)
        .scratch("lengths", model.max_batch * 4)
        .scratch("q", model.q_elems() * 2)
        .scratch("out", model.q_elems() * 4)
        .build()
        .unwrap();
    let space = Space::new(&gpu.ctx, layout).unwrap();
    let mut rng = rng("an_empty_cache_reads_zeros_everywhere_and_never_faults");

    // A whole row of the last layer's V, every granule of it unbacked, copied out.
    space.write(&gpu.stream, "row", &vec![0xA5u8; row]).unwrap();
    let v = cache.buffer(model.layers - 1, KvKind::V).unwrap();
    let target = space.view::<u8>("row", &gpu.stream).unwrap();
    copy_between(
        &gpu.stream,
        &target,
        0,
        &v,
        (model.max_batch - 1) * row,
        row,
    )
    .unwrap();
    let bytes: Vec<u8> = space.read(&gpu.stream, "row").unwrap();
    assert!(bytes.iter().all(|&b| b == 0), "an unbacked row reads zeros");

    // Attention over max_len tokens of every unbacked row (a length array of max_len, as a
    // masked read over a static shape does): all zeros out, no fault.
    let kernels = AttentionKernels::load(&gpu.ctx).unwrap();
    space
        .write(
            &gpu.stream,
            "lengths",
            &vec![model.max_len as u32; model.max_batch],
        )
        .unwrap();
    let q = random_bf16(&mut rng, model.q_elems(), 1.0);
    space.write(&gpu.stream, "q", &q).unwrap();
    space
        .write(&gpu.stream, "out", &vec![f32::NAN; model.q_elems()])
        .unwrap();
    let lengths = space.view::<u32>("lengths", &gpu.stream).unwrap();
    let shape = model.shape(&cache);
    for layer in 0..model.layers {
        kernels
            .decode_attention(
                &gpu.stream,
                shape,
                &space.view::<u16>("q", &gpu.stream).unwrap(),
                cache.k_ptr(layer).unwrap(),
                cache.v_ptr(layer).unwrap(),
                stablebuf::DeviceBuffer::device_address(&lengths),
                &space.view::<f32>("out", &gpu.stream).unwrap(),
            )
            .unwrap();
    }
    gpu.stream.synchronize().unwrap();
    let out: Vec<f32> = space.read(&gpu.stream, "out").unwrap();
    assert!(
        out.iter().all(|&x| x == 0.0),
        "attention over zeros is zero"
    );

    // Writes past a length are typed errors, and the cache is intact after them.
    cache.grow(0, 10).unwrap();
    assert!(matches!(
        cache.write_guard(0, 9..11),
        Err(Error::Kv(KvError::WritePastLength { length: 10, .. }))
    ));
    assert!(matches!(
        cache.grow(1, model.max_len + 1),
        Err(Error::Kv(KvError::BeyondMaxLen { .. }))
    ));
    assert!(matches!(
        cache.share_prefix(0, 0, 5),
        Err(Error::Kv(KvError::BadPrefix { .. }))
    ));
    assert_eq!(cache.length(0).unwrap(), 10);
    assert_eq!(cache.length(1).unwrap(), 0);
    cache.write_guard(0, 0..10).unwrap();
    // The grown row reads zeros too (new granules are zeroed), also past its length.
    let k = cache.buffer(0, KvKind::K).unwrap();
    copy_between(&gpu.stream, &target, 0, &k, 0, row).unwrap();
    let bytes: Vec<u8> = space.read(&gpu.stream, "row").unwrap();
    assert!(bytes.iter().all(|&b| b == 0), "a grown row starts zeroed");
    let stats = cache.stats();
    assert_eq!(stats.sequences, 1);
    assert_eq!(stats.mapped_granules, 2 * model.layers);
}

#[test]
#[ignore = "needs a CUDA GPU"]
fn a_random_serving_run_under_one_graph_matches_the_cpu_reference() {
    let gpu = gpu();
    let model = model();
    let cache = Arc::new(KvCache::new(&gpu.ctx, model.layout()).unwrap());
    let kernels = Arc::new(AttentionKernels::load(&gpu.ctx).unwrap());
    let max_prompt = 1300; // crosses the first granule boundary (1,024 tokens)
    let space = serve_space(&gpu.ctx, &model, max_prompt).unwrap();
    let io = StepIo::new(&space, &gpu.stream, model).unwrap();
    let mut rng = rng("a_random_serving_run_under_one_graph_matches_the_cpu_reference");
    // The last layer gated, and each earlier one at random: the cache's worker remaps several
    // layers one after another while the next step runs up to each gate.
    let gated: Vec<bool> = (0..model.layers)
        .map(|l| l + 1 == model.layers || rng.gen_bool(0.5))
        .collect();
    eprintln!("gated layers: {gated:?}");
    let graph = StableGraph::capture(
        &gpu.stream,
        &[&space],
        step_work(kernels, model, &cache, io, gated).unwrap(),
    )
    .unwrap();
    let steps = 40;
    let report = serve(
        &mut rng,
        &cache,
        &space,
        &gpu.stream,
        &|| graph.replay(),
        model,
        ServeRun {
            steps,
            max_prompt,
            check_every: 5,
            sleep_at: 17,
            zero_ahead: true,
        },
        max_prompt + steps + 1,
    )
    .unwrap();
    eprintln!("{report:?}");
    assert!(report.admitted > 0 && report.checked_tokens > 0);
    assert!(
        report.shared_granules_seen > 0,
        "a fork shared whole granules: {report:?}"
    );
    assert!(report.checked_outputs >= 8 * model.layers * model.q_elems());
    assert!(
        report.zeroed_ahead > 0 && report.checked_tail_bytes > 0,
        "zero_ahead ran and rows were read past their lengths: {report:?}"
    );
    // Every mapping is undone on release; the free list is kept for reuse, then trimmed.
    for seq in 0..model.max_batch {
        cache.release(seq).unwrap();
    }
    let stats = cache.stats();
    assert_eq!((stats.mapped_granules, stats.sequences), (0, 0));
    cache.trim();
    assert_eq!(cache.stats().free_granules, 0);
}
