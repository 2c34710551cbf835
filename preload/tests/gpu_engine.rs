//! The engine over real GPU devices (no LD_PRELOAD): untagged allocations on the pool, copy
//! elision by graft, tags paused and resumed with contents kept. `cargo test -- --ignored` on a
//! machine with a GPU; the demos in `demo/` test the library as preloaded.

use std::sync::Arc;
use std::time::Instant;

use stablebuf::cudarc::driver::{result, CudaContext};
use stablebuf_preload::cuda::codes::Fail;
use stablebuf_preload::engine::gpu::{GpuDevice, GpuOptions, HostSlot};
use stablebuf_preload::engine::stats::Counters;
use stablebuf_preload::engine::{Copied, CopyCall, Engine, Freed};

const MIB: usize = 1 << 20;

/// Loads the CUDA runtime into this process, as a CUDA program would have: the engine performs
/// deferred copies through the real `cudaMemcpy`, which it finds among loaded objects.
fn load_cuda_runtime() {
    for name in [c"libcudart.so.13", c"libcudart.so.12", c"libcudart.so"] {
        // SAFETY: dlopen with a valid C string; the handle is kept for the life of the process.
        let handle = unsafe { libc::dlopen(name.as_ptr(), libc::RTLD_NOW | libc::RTLD_GLOBAL) };
        if !handle.is_null() {
            return;
        }
    }
    panic!("this test needs libcudart on LD_LIBRARY_PATH (the bundle runner adds /usr/local/cuda/lib64)");
}

fn engine(elide: bool) -> (Engine<GpuDevice>, Arc<Counters>, Arc<CudaContext>) {
    load_cuda_runtime();
    let ctx = stablebuf::open_device(0).expect("a CUDA device");
    let options = GpuOptions {
        budget: None,
        stitching: true,
        drain_on_oom: true,
        origin: Instant::now(),
    };
    let host = Arc::new(HostSlot::new(None));
    let counters = Arc::new(Counters::default());
    let engine = Engine::new(
        move |ordinal| GpuDevice::open(ordinal, &options, host.clone()),
        elide,
        MIB,
        counters.clone(),
    );
    (engine, counters, ctx)
}

/// What the preloaded layer does before a hooked copy (a flush point): maps held allocations
/// and performs deferred copies. These helpers copy through cudarc, which the layer never sees.
fn flush_point(engine: &Engine<GpuDevice>) {
    if engine.touch() {
        engine.flush().unwrap();
    }
}

fn write(engine: &Engine<GpuDevice>, ctx: &CudaContext, address: u64, words: &[u32]) {
    flush_point(engine);
    ctx.bind_to_thread().unwrap();
    // SAFETY: `address` is a live allocation of at least `words` bytes on this context's device.
    unsafe { result::memcpy_htod_sync(address, words) }.unwrap();
}

fn read(engine: &Engine<GpuDevice>, ctx: &CudaContext, address: u64, count: usize) -> Vec<u32> {
    flush_point(engine);
    ctx.bind_to_thread().unwrap();
    let mut out = vec![0u32; count];
    // SAFETY: as above, for reading.
    unsafe { result::memcpy_dtoh_sync(&mut out, address) }.unwrap();
    out
}

fn pattern(count: usize, seed: u32) -> Vec<u32> {
    (0..count as u32)
        .map(|i| i.wrapping_mul(2_654_435_761) ^ seed)
        .collect()
}

#[test]
#[ignore = "needs a CUDA GPU"]
fn untagged_memory_and_copy_elision_on_a_gpu() {
    let (engine, counters, ctx) = engine(true);
    let bytes = 64 * MIB;
    let a = engine.alloc(0, bytes, None).unwrap();
    let data = pattern(bytes / 4, 7);
    write(&engine, &ctx, a, &data);
    let mappings = engine.view().pool.mappings;
    let b = engine.alloc(0, 2 * bytes, None).unwrap();
    assert_eq!(
        engine.view().pool.mappings,
        mappings,
        "b holds its memory unmapped until its first use"
    );
    let copy = CopyCall {
        dst: b,
        src: a,
        bytes,
        device_to_device: true,
        stream: 0,
        sync: true,
    };
    assert_eq!(engine.copy(copy).unwrap(), Copied::Deferred);
    assert_eq!(engine.free(a).unwrap(), Freed::Done);
    assert_eq!(
        Counters::get(&counters.copies_elided),
        1,
        "grafted, not copied"
    );
    assert_eq!(
        read(&engine, &ctx, b, bytes / 4),
        data,
        "b starts with a's bytes"
    );
    let tail = pattern(bytes / 4, 9);
    write(&engine, &ctx, b + bytes as u64, &tail);
    assert_eq!(
        read(&engine, &ctx, b + bytes as u64, bytes / 4),
        tail,
        "b's tail is backed"
    );
    assert_eq!(engine.free(b).unwrap(), Freed::Done);
    assert_eq!(engine.view().live_allocations, 0);
}

#[test]
#[ignore = "needs a CUDA GPU"]
fn a_tag_pauses_and_resumes_with_its_contents() {
    let (engine, _, ctx) = engine(false);
    let tag = engine.register_tag("weights");
    let bytes = 256 * MIB;
    let w = engine.alloc(0, bytes, Some(tag.clone())).unwrap();
    let data = pattern(bytes / 4, 3);
    write(&engine, &ctx, w, &data);
    let (before, _) = stablebuf::device::memory_info(&ctx).unwrap();
    let paused = engine.pause(Some("weights"), true).unwrap();
    let (after, _) = stablebuf::device::memory_info(&ctx).unwrap();
    assert!(
        after >= before + bytes,
        "pause freed {} bytes",
        after - before
    );
    assert_eq!(paused.copied, bytes);
    assert!(matches!(
        engine.alloc(0, MIB, Some(tag.clone())),
        Err(Fail::NotPermitted(_))
    ));
    engine.resume(Some("weights")).unwrap();
    engine.resume(Some("weights")).unwrap();
    assert_eq!(read(&engine, &ctx, w, bytes / 4), data);
    assert_eq!(engine.free(w).unwrap(), Freed::Done);
}
