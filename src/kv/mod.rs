//! KV caches on stable addresses: per-sequence K and V rows whose memory follows the tokens,
//! under a decode graph captured once at `max_batch` (issue 45).
//!
//! Each layer's K and V are one reserved range of `max_batch` rows of `max_len` tokens,
//! token-major per sequence (`[seq, token, kv_head, dim]`), so any kernel that takes a base
//! pointer and a sequence stride reads them (vAttention's layout). Physical 2 MiB granules are
//! mapped into a row as its sequence grows ([`KvCache::grow`], ahead of need by
//! [`KvOptions::ahead_tokens`]) and go to a free list on [`KvCache::release`], where the next
//! request in any slot reuses them without a `cuMemCreate`.
//!
//! Never a fault: every granule-sized range not backed by data maps ONE shared zero granule,
//! read-only. A kernel that reads past a sequence's length (SDPA with a mask over `max_len`)
//! reads zeros; one that reads only valid tokens takes them from
//! [`KvCache::lengths_device_ptr`] (`u32` per slot, refreshed by
//! [`KvCache::publish_lengths`]). A write past a sequence's length is
//! [`KvError::WritePastLength`] from
//! [`KvCache::write_guard`].
//!
//! Behind the step: a decode step that records [`KvCache::mark_layer_done`] after each layer's
//! attention (captured or not) lets [`KvCache::change_behind`] grow and release sequences
//! while the step still runs, layer by layer once each mark passed, so the map calls overlap
//! the step's later layers. A release there remaps nothing: it leaves the rows' granules zeroed
//! and mapped (retiring: free, reading zeros) until the next fenced operation unmaps them. The
//! last layer's mark leaves only the step's tail: a step that waits at that layer's gate
//! ([`KvCache::gate_layer`]) lets a worker thread remap it while the next step runs the layers
//! before the gate (`behind`).
//!
//! Prefix sharing ([`KvCache::share_prefix`]) maps the prefix's whole granules into both rows
//! and copies the granule where they diverge; [`KvCache::write_guard`] copies any granule still
//! shared before a write into it. [`KvCache::sleep`] saves each distinct granule once and
//! releases all physical memory but the zero granule; [`KvCache::wake`] restores it, sharing
//! included.
//!
//! ```text
//!   L0 K: | seq 0: [data][data][zero][zero] | seq 1: [shared][data][zero][zero] | ...
//!   L0 V: | seq 0: [data][data][zero][zero] | seq 1: [shared][data][zero][zero] | ...
//!          every [zero] is the same physical granule, mapped read-only
//! ```
//!
//! Tokens per granule, per (sequence, layer, K/V): `2 MiB / (kv_heads · head_dim · dtype)`:
//! 1,024 for Llama-3-8B (8 KV heads × 128, bf16); 8,192 for a small model of 2 KV heads × 64.

mod behind;
mod free;
mod layout;
#[cfg(test)]
mod proptests;
mod share;
mod sleep;
mod state;
mod stats;
mod table;
mod times;

use std::ops::Range;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::Instant;

use cudarc::driver::{CudaContext, CudaStream};

use crate::buffer::DeviceBuffer;
use crate::driver::event::StepMark;
use crate::driver::traced;
use crate::error::{Error, KvError, LayoutError, Result};
use crate::fence::FencePolicy;
use crate::host::HostStorage;
use crate::vmm_core::{Backend, Vmm};

pub use layout::KvLayout;
use state::KvState;
pub use stats::KvStats;
pub use times::ChangeTimes;

/// Options for [`KvCache::with_options`].
#[derive(Clone, Debug)]
pub struct KvOptions {
    /// Tokens [`KvCache::grow`] backs past the length asked for, so the decode steps that follow
    /// find their granules mapped (default 0: the granule holding the last token; with 2 MiB
    /// granules a row already has hundreds of tokens of room).
    pub ahead_tokens: usize,
    /// How the cache waits for the GPU before it unmaps a range (default: the whole context).
    pub fence: FencePolicy,
}

impl Default for KvOptions {
    fn default() -> Self {
        Self {
            ahead_tokens: 0,
            fence: FencePolicy::Context,
        }
    }
}

/// K or V.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum KvKind {
    /// Keys.
    K,
    /// Values.
    V,
}

/// One layer's K or V buffer of a [`KvCache`] ([`KvCache::buffer`]): its address and length
/// for the launchers' and copies' range checks.
#[derive(Clone, Copy, Debug)]
pub struct KvBuffer<'a> {
    address: u64,
    bytes: usize,
    _cache: std::marker::PhantomData<&'a KvCache>,
}

impl DeviceBuffer for KvBuffer<'_> {
    fn device_address(&self) -> cudarc::driver::sys::CUdeviceptr {
        self.address
    }

    fn byte_len(&self) -> usize {
        self.bytes
    }
}

/// A KV cache on stable addresses. See the module docs. `Send + Sync`; every method locks.
#[derive(Debug)]
pub struct KvCache {
    state: Mutex<KvState<Vmm>>,
    lane: Arc<CudaStream>,
    /// One per layer: where the decode step is done with that layer's K and V
    /// ([`KvCache::mark_layer_done`]), for [`KvCache::change_behind`].
    marks: Vec<StepMark>,
    /// Whether each mark was ever recorded.
    marked: Vec<AtomicBool>,
    /// Layers' gates ([`KvCache::gate_layer`]) and the worker that remaps behind them.
    behind: behind::Behind,
}

impl KvCache {
    /// Reserves the cache for `layout` on `ctx`'s device, with default options.
    pub fn new(ctx: &Arc<CudaContext>, layout: KvLayout) -> Result<KvCache> {
        Self::with_options(ctx, layout, KvOptions::default())
    }

    /// Reserves the cache; maps the zero granule over all of it. Costs one granule of zeros
    /// and one for the lengths, plus one mapping per granule of address space.
    pub fn with_options(
        ctx: &Arc<CudaContext>,
        layout: KvLayout,
        options: KvOptions,
    ) -> Result<KvCache> {
        let backend = Vmm::new(ctx);
        let lane = traced("cuStreamCreate", 0, || ctx.new_stream())?;
        let fence = backend.fence(options.fence);
        let marks = (0..layout.layers)
            .map(|_| StepMark::new(ctx))
            .collect::<Result<Vec<_>>>()?;
        let state = KvState::new(backend, layout, lane.clone(), fence, options.ahead_tokens)?;
        Ok(KvCache {
            state: Mutex::new(state),
            lane,
            marked: (0..layout.layers).map(|_| AtomicBool::new(false)).collect(),
            marks,
            behind: behind::Behind::new(ctx, layout.layers)?,
        })
    }

    fn lock(&self) -> MutexGuard<'_, KvState<Vmm>> {
        self.state.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// The state, with the mappings of the last remap behind a step taken back (waiting for
    /// it if it still runs): every call that changes mappings starts here.
    fn settled(&self) -> Result<MutexGuard<'_, KvState<Vmm>>> {
        let mut state = self.lock();
        self.behind.settle(&mut state)?;
        Ok(state)
    }

    /// The layout the cache was reserved for.
    pub fn layout(&self) -> KvLayout {
        self.lock().geometry.layout
    }

    /// Bytes of one granule (the driver's granularity, 2 MiB on current GPUs).
    pub fn granule(&self) -> usize {
        self.lock().geometry.granule
    }

    /// Bytes from one sequence's row to the next in a K or V buffer (whole granules).
    pub fn seq_stride(&self) -> usize {
        self.lock().geometry.seq_stride
    }

    /// The stream the cache zeroes and copies granules on; each call waits for its own work.
    pub fn lane(&self) -> &Arc<CudaStream> {
        &self.lane
    }

    /// Base address of layer `layer`'s K (or V) buffer: `[max_batch, seq_stride]` bytes,
    /// token-major rows.
    pub fn buffer_ptr(&self, layer: usize, kind: KvKind) -> Result<u64> {
        let state = self.lock();
        let layers = state.geometry.layout.layers;
        if layer >= layers {
            return Err(Error::Layout(LayoutError::InvalidShape(format!(
                "layer {layer} of a {layers}-layer KV cache"
            ))));
        }
        let buffer = 2 * layer + usize::from(kind == KvKind::V);
        Ok(state.base() + state.geometry.row_offset(buffer, 0) as u64)
    }

    /// Layer `layer`'s K (or V) buffer as a copy operand ([`crate::buffer::copy_between`]):
    /// `max_batch` rows of [`KvCache::seq_stride`] bytes, every byte mapped (data or zeros).
    /// Borrows the cache, so the range cannot outlive the reservation. Copy into a row only
    /// after [`KvCache::write_guard`] over the tokens written: the zero granule is read-only.
    pub fn buffer(&self, layer: usize, kind: KvKind) -> Result<KvBuffer<'_>> {
        let address = self.buffer_ptr(layer, kind)?;
        let state = self.lock();
        let bytes = state.geometry.layout.max_batch * state.geometry.seq_stride;
        Ok(KvBuffer {
            address,
            bytes,
            _cache: std::marker::PhantomData,
        })
    }

    /// Base address of layer `layer`'s K buffer.
    pub fn k_ptr(&self, layer: usize) -> Result<u64> {
        self.buffer_ptr(layer, KvKind::K)
    }

    /// Base address of layer `layer`'s V buffer.
    pub fn v_ptr(&self, layer: usize) -> Result<u64> {
        self.buffer_ptr(layer, KvKind::V)
    }

    /// The device array of `max_batch` `u32` sequence lengths (as last published).
    pub fn lengths_device_ptr(&self) -> u64 {
        self.lock().lengths_ptr()
    }

    /// The host's length of `seq`.
    pub fn length(&self, seq: usize) -> Result<usize> {
        let state = self.lock();
        state.check_seq(seq)?;
        Ok(state.lengths[seq])
    }

    /// Sets `seq`'s length to `len` (never shrinks) and backs its rows in every layer up to
    /// `len` plus the look-ahead with zeroed granules. All or nothing.
    pub fn grow(&self, seq: usize, len: usize) -> Result<()> {
        self.settled()?.grow(seq, len)
    }

    /// Records, at the current end of `stream` (a `CUstream` of the cache's device as a
    /// number; 0: the legacy default stream), that the work before it is done with layer
    /// `layer`'s K and V. Call it in the decode step right after the layer's attention, also
    /// while the step is captured: the mark becomes a node of the graph and every replay
    /// records it, so [`KvCache::change_behind`] can remap a layer while the replay runs the
    /// layers after it.
    pub fn mark_layer_done(&self, layer: usize, stream: u64) -> Result<()> {
        let Some(mark) = self.marks.get(layer) else {
            return Err(Error::Layout(LayoutError::InvalidShape(format!(
                "layer {layer} of a {}-layer KV cache",
                self.marks.len()
            ))));
        };
        mark.record(stream)?;
        self.marked[layer].store(true, Ordering::Relaxed);
        Ok(())
    }

    /// Grows `grow`'s `(seq, len)` and releases `release`'s sequences while the decode step
    /// enqueued last still runs: layer by layer, it waits for the step's mark of that layer
    /// ([`KvCache::mark_layer_done`]) and then remaps that layer's rows, so the next step finds
    /// its memory mapped and the host's map calls overlap the step's later layers instead of
    /// adding to the time between steps. Use it only when every piece of work that reads the
    /// cache records all the marks (the captured step does): the marks stand in for the
    /// cache's fence here. All or nothing; returns whether any mapping changed. Gated layers
    /// ([`KvCache::gate_layer`]) are remapped after it returns; a driver error there is
    /// returned by the next call that changes mappings, which maps those slots first.
    pub fn change_behind(&self, grow: &[(usize, usize)], release: &[usize]) -> Result<bool> {
        if let Some(layer) = self.marked.iter().position(|m| !m.load(Ordering::Relaxed)) {
            return Err(KvError::LayerNotMarked { layer }.into());
        }
        let marks = &self.marks;
        let later = self.behind.later();
        let began = Instant::now();
        let mut state = self.settled()?;
        let settle = began.elapsed();
        let (changed, remap) =
            state.change_behind(grow, release, |layer| marks[layer].wait(), &later)?;
        let handing = Instant::now();
        if let Some(remap) = remap {
            self.behind
                .hand_off(self.lane.context(), &mut state, remap, marks)?;
        }
        if changed {
            state.times.settle = settle;
            state.times.hand_off = handing.elapsed();
        }
        Ok(changed)
    }

    /// Where the host's time went in the last [`KvCache::change_behind`] that changed a
    /// mapping (to take a slow step apart).
    pub fn last_change_times(&self) -> ChangeTimes {
        self.lock().times
    }

    /// Enqueues on `stream` (as for [`KvCache::mark_layer_done`]; captured or not) a wait at
    /// layer `layer`'s gate, and a mark that the step got past it. Call it in the decode step
    /// before the layer's K and V are written or read, for the last layer at least (its mark
    /// leaves only the step's tail to remap behind): [`KvCache::change_behind`] then returns
    /// before remapping gated layers, and a worker thread remaps each once the step in flight
    /// passed the layer's mark and opens its gate, so the remaps overlap the rest of that
    /// step and the next step's layers before each gate. A step that reaches a closed gate
    /// waits for that layer's remap. Gates are words in pinned host
    /// memory that the host opens with a store: no stream work can queue behind a waiting
    /// step. Every step that touches the layer must wait at its gate.
    pub fn gate_layer(&self, layer: usize, stream: u64) -> Result<()> {
        if layer >= self.marks.len() {
            return Err(Error::Layout(LayoutError::InvalidShape(format!(
                "layer {layer} of a {}-layer KV cache",
                self.marks.len()
            ))));
        }
        self.behind.gate(layer, stream)
    }

    /// Frees slot `seq`: its rows map the zero granule again, their granules go to the free
    /// list, its length is 0.
    pub fn release(&self, seq: usize) -> Result<()> {
        self.settled()?.release(seq)
    }

    /// Makes the first `tokens` tokens of `from` the start of the empty slot `to`: whole
    /// granules shared (mapped twice), the divergent granule copied.
    pub fn share_prefix(&self, from: usize, to: usize, tokens: usize) -> Result<()> {
        self.settled()?.share_prefix(from, to, tokens)
    }

    /// Checks that `tokens` of `seq` lie inside its length and copies any granule they touch
    /// that is still shared, so writing them changes no other sequence.
    pub fn write_guard(&self, seq: usize, tokens: Range<usize>) -> Result<()> {
        self.settled()?.write_guard(seq, tokens)
    }

    /// Copies the host lengths to [`KvCache::lengths_device_ptr`]; call it before the replay
    /// that should see them.
    pub fn publish_lengths(&self) -> Result<()> {
        self.lock().publish_lengths()
    }

    /// Saves the cache's data to `storage` and releases its physical memory; addresses stay
    /// and read zeros. Returns the bytes saved.
    pub fn sleep(&self, storage: &HostStorage) -> Result<usize> {
        self.settled()?.sleep(storage)
    }

    /// Restores what [`KvCache::sleep`] saved. Returns the bytes restored.
    pub fn wake(&self) -> Result<usize> {
        self.settled()?.wake()
    }

    /// Makes sure `count` granules of the free list hold zeros, so that layers behind a gate
    /// ([`KvCache::gate_layer`]) take them as they are when a row opens a granule: without
    /// them [`KvCache::change_behind`] maps each fresh granule alone to zero it before the
    /// step's marks (host time on the step's path, ~0.1 ms a granule). Free granules of
    /// unknown contents are zeroed first, then new memory is made (held in the free list, as
    /// a release's is; [`KvCache::trim`] gives it back). Call it where the host waits anyway,
    /// such as while a step that changes no mapping runs; for one row opening a granule in
    /// every gated layer, `count` is 2 x the gated layers. `at_most` bounds the granules this
    /// call zeroes (each costs the host ~0.1 ms), so a call fits in a step's wait. Returns how
    /// many free granules hold zeros now. On an error none of those it took counts as zeroed,
    /// and nothing else changed.
    pub fn zero_ahead(&self, count: usize, at_most: usize) -> Result<usize> {
        let _span = tracing::debug_span!("kv_zero_ahead", count, at_most).entered();
        self.lock().zero_ahead(count, at_most)
    }

    /// Releases the free list's memory; returns the bytes released.
    pub fn trim(&self) -> usize {
        let mut state = self.lock();
        // A remap still running keeps released granules mapped: take it back first (its
        // error, if any, is the next call's to report through the slots it left unmapped).
        let _ = self.behind.settle(&mut state);
        state.trim()
    }

    /// Work on `stream` just used the cache (for [`FencePolicy::LastUse`]).
    pub fn note_use(&self, stream: &Arc<CudaStream>) -> Result<()> {
        let mut state = self.lock();
        let key = state.backend.stream_key(stream);
        state.fence.note_use(key)
    }

    /// What the cache holds now.
    pub fn stats(&self) -> KvStats {
        self.lock().stats()
    }
}

impl Drop for KvCache {
    fn drop(&mut self) {
        // Take back a remap behind the step before the state (and its fence) goes.
        let mut state = self.lock();
        if let Err(error) = self.behind.settle(&mut state) {
            tracing::warn!(%error, "a remap behind the step failed as the KV cache was dropped");
        }
    }
}
