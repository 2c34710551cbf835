//! `stablebuf._native.KvCache`: the core crate's [`stablebuf::kv::KvCache`] for Python (issue 45).
//!
//! One cache per object, on one device, in that device's primary context (the one PyTorch
//! uses). Every call that reaches the driver runs inside a [`ContextScope`], so PyTorch's
//! current device is the same after it. Each layer's K and V buffer is exported through DLPack
//! ([`DlpackExport`]) as `[max_batch, max_len, kv_heads, head_dim]` with the row stride of the
//! cache (whole granules per sequence), so `torch.from_dlpack` gives a tensor whose address
//! never changes while the memory under it follows the sequences. The tensors keep the cache
//! alive (each capsule holds the cache's `Arc`).
//!
//! The pure parts (dtype names, the views' shapes and strides) are plain functions tested here
//! without a GPU.

use std::sync::Arc;

use pyo3::exceptions::PyValueError;
use pyo3::prelude::*;
use pyo3::types::PyDict;
use stablebuf::cudarc::driver::CudaContext;
use stablebuf::kv::{KvCache as CoreKv, KvKind, KvLayout, KvOptions, KvStats};
use stablebuf::HostStorage;

use crate::context::{ContextNeutral, ContextScope};
use crate::dlpack::{ArrayDesc, DlpackExport, DEVICE_CUDA};
use crate::errors::Failure;
use crate::regions;

/// `(DLPack type code, bits, bytes)` of the element types a KV cache holds.
pub fn dtype_code(name: &str) -> Option<(u8, u8, usize)> {
    match name {
        "bfloat16" | "bf16" => Some((4, 16, 2)),
        "float16" | "fp16" | "half" => Some((2, 16, 2)),
        "float32" | "fp32" | "float" => Some((2, 32, 4)),
        _ => None,
    }
}

/// The view of one K or V buffer: `[max_batch, max_len, kv_heads, head_dim]`, each sequence
/// `seq_stride` bytes after the previous one, tokens compact inside a row.
pub fn buffer_view(layout: &KvLayout, seq_stride: usize, (code, bits): (u8, u8)) -> ArrayDesc {
    let elem = layout.dtype_bytes;
    let token = (layout.kv_heads * layout.head_dim) as i64;
    ArrayDesc {
        code,
        bits,
        shape: vec![
            layout.max_batch as i64,
            layout.max_len as i64,
            layout.kv_heads as i64,
            layout.head_dim as i64,
        ],
        strides: Some(vec![
            (seq_stride / elem) as i64,
            token,
            layout.head_dim as i64,
            1,
        ]),
    }
}

/// The device lengths as `int32` (the cache stores `u32`, always below `i32::MAX`: PyTorch
/// handles `int32` everywhere, `uint32` barely).
pub fn lengths_view(max_batch: usize) -> ArrayDesc {
    ArrayDesc {
        code: 0, // kDLInt
        bits: 32,
        shape: vec![max_batch as i64],
        strides: None,
    }
}

/// The stats as `(name, value)` pairs (`asleep` as 0/1 is given apart).
pub fn stats_fields(s: &KvStats) -> [(&'static str, usize); 9] {
    [
        ("mapped_granules", s.mapped_granules),
        ("physical_granules", s.physical_granules),
        ("shared_granules", s.shared_granules),
        ("free_granules", s.free_granules),
        ("zeroed_granules", s.zeroed_granules),
        ("bytes", s.bytes),
        ("unshared_bytes", s.unshared_bytes),
        ("granule", s.granule),
        ("sequences", s.sequences),
    ]
}

/// What the capsules and the Python object share: the cache, dropped in a context-neutral way,
/// and its device's context.
struct Shared {
    cache: ContextNeutral<CoreKv>,
    ctx: Arc<CudaContext>,
}

fn core_failure(error: stablebuf::Error) -> Failure {
    Failure::from_core(&error, None)
}

/// A KV cache on stable addresses (see `stablebuf.hf.StableCache` for the Hugging Face glue).
///
/// Each layer's K and V is one reserved range of `max_batch` rows of `max_len` tokens; `grow`
/// maps memory into a sequence's rows as it lengthens, `release` hands it back. Unmapped
/// ranges read zeros (one shared read-only granule), so a kernel reading a whole row faults
/// nowhere; writing past a sequence's length does fault on the GPU: grow first.
#[pyclass(module = "stablebuf", name = "KvCache", frozen)]
pub struct KvCache {
    shared: Arc<Shared>,
    layout: KvLayout,
    device: i32,
    code: (u8, u8),
    dtype: String,
    granule: usize,
    seq_stride: usize,
}

impl KvCache {
    fn run<R>(
        &self,
        py: Python<'_>,
        f: impl FnOnce(&CoreKv) -> stablebuf::Result<R> + Send,
    ) -> PyResult<R>
    where
        R: Send,
    {
        let shared = self.shared.clone();
        Ok(py.detach(move || {
            let _scope = ContextScope::enter(&shared.ctx)?;
            f(&shared.cache).map_err(core_failure)
        })?)
    }

    fn export(&self, ptr: u64, array: ArrayDesc) -> DlpackExport {
        let owner: Arc<dyn std::any::Any + Send + Sync> = self.shared.clone();
        DlpackExport::of_array(ptr, array, (DEVICE_CUDA, self.device), owner)
    }
}

#[pymethods]
impl KvCache {
    /// Reserves the cache on CUDA device `device` (no data memory yet: one zero granule and
    /// the lengths). `ahead_tokens`: tokens `grow` maps past the length asked for.
    #[new]
    #[pyo3(signature = (device, layers, max_batch, max_len, kv_heads, head_dim, dtype="bfloat16", ahead_tokens=0))]
    #[allow(clippy::too_many_arguments)]
    fn new(
        py: Python<'_>,
        device: i32,
        layers: usize,
        max_batch: usize,
        max_len: usize,
        kv_heads: usize,
        head_dim: usize,
        dtype: &str,
        ahead_tokens: usize,
    ) -> PyResult<Self> {
        let Some((code, bits, dtype_bytes)) = dtype_code(dtype) else {
            return Err(PyValueError::new_err(format!(
                "dtype {dtype:?}: expected \"bfloat16\", \"float16\" or \"float32\""
            )));
        };
        let layout = KvLayout {
            layers,
            max_batch,
            max_len,
            kv_heads,
            head_dim,
            dtype_bytes,
        };
        let (cache, ctx) = py.detach(move || -> Result<_, Failure> {
            let _scope = ContextScope::keep();
            let ctx = regions::device_context(device)?;
            let _inner = ContextScope::enter(&ctx)?;
            let options = KvOptions {
                ahead_tokens,
                ..KvOptions::default()
            };
            let cache = CoreKv::with_options(&ctx, layout, options).map_err(core_failure)?;
            Ok((cache, ctx))
        })?;
        let granule = cache.granule();
        let seq_stride = cache.seq_stride();
        Ok(Self {
            shared: Arc::new(Shared {
                cache: ContextNeutral::new(cache),
                ctx,
            }),
            layout,
            device,
            code: (code, bits),
            dtype: dtype.to_string(),
            granule,
            seq_stride,
        })
    }

    #[getter]
    fn device(&self) -> i32 {
        self.device
    }
    #[getter]
    fn layers(&self) -> usize {
        self.layout.layers
    }
    #[getter]
    fn max_batch(&self) -> usize {
        self.layout.max_batch
    }
    #[getter]
    fn max_len(&self) -> usize {
        self.layout.max_len
    }
    #[getter]
    fn kv_heads(&self) -> usize {
        self.layout.kv_heads
    }
    #[getter]
    fn head_dim(&self) -> usize {
        self.layout.head_dim
    }
    #[getter]
    fn dtype(&self) -> &str {
        &self.dtype
    }
    /// Bytes of one granule (2 MiB on current GPUs).
    #[getter]
    fn granule(&self) -> usize {
        self.granule
    }
    /// Bytes from one sequence's row to the next in a K or V buffer.
    #[getter]
    fn seq_stride(&self) -> usize {
        self.seq_stride
    }
    /// Bytes of one token in one buffer (`kv_heads · head_dim · dtype`).
    #[getter]
    fn token_bytes(&self) -> usize {
        self.layout.token_bytes()
    }
    /// Tokens of one sequence in one granule of one buffer.
    #[getter]
    fn tokens_per_granule(&self) -> usize {
        self.layout.tokens_per_granule(self.granule)
    }

    /// Sets `seq`'s length to `length` (never shrinks) and maps zeroed memory into its rows of
    /// every layer up to it (plus `ahead_tokens`). All or nothing; waits for the device when it
    /// maps.
    fn grow(&self, py: Python<'_>, seq: usize, length: usize) -> PyResult<()> {
        self.run(py, |c| c.grow(seq, length))
    }

    /// `grow` for several sequences: `lengths` is a list of `(seq, length)`, in one call.
    fn grow_many(&self, py: Python<'_>, lengths: Vec<(usize, usize)>) -> PyResult<()> {
        self.run(py, |c| {
            lengths.iter().try_for_each(|&(seq, len)| c.grow(seq, len))
        })
    }

    /// Records on `stream` (a `CUstream` as an int: `torch.cuda.current_stream().cuda_stream`)
    /// that the work enqueued so far is done with layer `layer`'s K and V. Call it in the
    /// decode step after each layer's attention, also while the step is captured (every replay
    /// then records it), to use `change_behind`.
    fn mark_layer_done(&self, py: Python<'_>, layer: usize, stream: u64) -> PyResult<()> {
        self.run(py, move |c| c.mark_layer_done(layer, stream))
    }

    /// Enqueues on `stream` (as for `mark_layer_done`; captured or not) a wait at layer
    /// `layer`'s gate. Call it in the decode step before the layer's K and V are written or
    /// read, typically for the last layer only: `change_behind` then returns before that
    /// layer is remapped, and a worker thread remaps it once the step in flight is done with
    /// it and opens the gate, so the remap overlaps the next step's first layers. Every step
    /// that touches the layer must wait at its gate.
    fn gate_layer(&self, py: Python<'_>, layer: usize, stream: u64) -> PyResult<()> {
        self.run(py, move |c| c.gate_layer(layer, stream))
    }

    /// Grows `grow`'s `(seq, length)` and releases `release`'s slots behind the step still
    /// running: layer by layer, once the step's mark of the layer passed, so the host's map
    /// calls overlap the step's later layers. Every piece of work that reads the cache must
    /// record all marks. All or nothing; returns whether any mapping changed.
    #[pyo3(signature = (grow, release=Vec::new()))]
    fn change_behind(
        &self,
        py: Python<'_>,
        grow: Vec<(usize, usize)>,
        release: Vec<usize>,
    ) -> PyResult<bool> {
        self.run(py, move |c| c.change_behind(&grow, &release))
    }

    /// Frees slot `seq`: its rows read zeros again, their memory goes to the free list.
    fn release(&self, py: Python<'_>, seq: usize) -> PyResult<()> {
        self.run(py, |c| c.release(seq))
    }

    /// Makes the first `tokens` tokens of `src` the start of the empty slot `dst`: whole
    /// granules shared, the one where they diverge copied.
    fn share_prefix(&self, py: Python<'_>, src: usize, dst: usize, tokens: usize) -> PyResult<()> {
        self.run(py, |c| c.share_prefix(src, dst, tokens))
    }

    /// Checks that tokens `start..end` of `seq` lie within its length and copies any granule
    /// still shared that they touch (call before writing shared tokens).
    fn write_guard(&self, py: Python<'_>, seq: usize, start: usize, end: usize) -> PyResult<()> {
        self.run(py, |c| c.write_guard(seq, start..end))
    }

    /// The host's length of `seq`.
    fn length(&self, py: Python<'_>, seq: usize) -> PyResult<usize> {
        self.run(py, |c| c.length(seq))
    }

    /// Every slot's host length.
    fn lengths(&self, py: Python<'_>) -> PyResult<Vec<usize>> {
        let max_batch = self.layout.max_batch;
        self.run(py, |c| (0..max_batch).map(|s| c.length(s)).collect())
    }

    /// Copies the host lengths to the device lengths (`lengths_tensor`), on the cache's own
    /// stream, synchronously: call it when no kernel reads them.
    fn publish_lengths(&self, py: Python<'_>) -> PyResult<()> {
        self.run(py, |c| c.publish_lengths())
    }

    /// Saves the data (`keep`: to host memory; else discards it) and releases the device
    /// memory; addresses stay and read zeros. Returns the bytes saved.
    #[pyo3(signature = (keep=true))]
    fn sleep(&self, py: Python<'_>, keep: bool) -> PyResult<usize> {
        let storage = if keep {
            HostStorage::Pageable
        } else {
            HostStorage::Discard
        };
        self.run(py, move |c| c.sleep(&storage))
    }

    /// Restores what `sleep` saved; returns the bytes restored.
    fn wake(&self, py: Python<'_>) -> PyResult<usize> {
        self.run(py, |c| c.wake())
    }

    /// Makes sure `count` free granules hold zeros, zeroing at most `at_most` in this call
    /// (each costs the host ~0.1 ms; default: all that are missing), so gated layers take them
    /// as they are when a row opens a granule (no mapping of their own to zero them on the
    /// step's path); call it while a step that changes nothing runs. Returns how many free
    /// granules hold zeros now.
    #[pyo3(signature = (count, at_most=None))]
    fn zero_ahead(&self, py: Python<'_>, count: usize, at_most: Option<usize>) -> PyResult<usize> {
        let at_most = at_most.unwrap_or(usize::MAX);
        self.run(py, move |c| c.zero_ahead(count, at_most))
    }

    /// Releases the free list's memory; returns the bytes released.
    fn trim(&self, py: Python<'_>) -> PyResult<usize> {
        self.run(py, |c| Ok(c.trim()))
    }

    /// `{"mapped_granules", "physical_granules", "shared_granules", "free_granules",
    /// "zeroed_granules", "bytes",
    /// "unshared_bytes", "granule", "sequences", "asleep"}`.
    fn stats<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyDict>> {
        let s = self.run(py, |c| Ok(c.stats()))?;
        let out = PyDict::new(py);
        for (key, value) in stats_fields(&s) {
            out.set_item(key, value)?;
        }
        out.set_item("asleep", s.asleep)?;
        Ok(out)
    }

    /// Where the host's time went in the last `change_behind` that changed a mapping, in
    /// microseconds: `{"settle", "staging", "waits", "remaps", "sync", "hand_off"}` and
    /// `"inline_layers"` (a count).
    fn last_change_times<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyDict>> {
        let t = self.run(py, |c| Ok(c.last_change_times()))?;
        let out = PyDict::new(py);
        for (key, value) in [
            ("settle", t.settle),
            ("staging", t.staging),
            ("waits", t.waits),
            ("remaps", t.remaps),
            ("sync", t.sync),
            ("hand_off", t.hand_off),
        ] {
            out.set_item(key, value.as_secs_f64() * 1e6)?;
        }
        out.set_item("inline_layers", t.inline_layers)?;
        Ok(out)
    }

    /// Device address of layer `layer`'s K (`kind="k"`) or V (`"v"`) buffer.
    #[pyo3(signature = (layer, kind="k"))]
    fn buffer_ptr(&self, py: Python<'_>, layer: usize, kind: &str) -> PyResult<u64> {
        let kind = parse_kind(kind)?;
        self.run(py, move |c| c.buffer_ptr(layer, kind))
    }

    /// Layer `layer`'s K or V buffer for `torch.from_dlpack`:
    /// `[max_batch, max_len, kv_heads, head_dim]` of `dtype`, strides
    /// `(seq_stride / elem, kv_heads · head_dim, head_dim, 1)`. The tensor keeps the cache alive.
    #[pyo3(signature = (layer, kind="k"))]
    fn buffer(&self, py: Python<'_>, layer: usize, kind: &str) -> PyResult<DlpackExport> {
        let ptr = self.buffer_ptr(py, layer, kind)?;
        let array = buffer_view(&self.layout, self.seq_stride, self.code);
        Ok(self.export(ptr, array))
    }

    /// The device lengths (`int32 [max_batch]`, as last published) for `torch.from_dlpack`.
    fn lengths_buffer(&self, py: Python<'_>) -> PyResult<DlpackExport> {
        let ptr = self.run(py, |c| Ok(c.lengths_device_ptr()))?;
        Ok(self.export(ptr, lengths_view(self.layout.max_batch)))
    }

    fn __repr__(&self) -> String {
        format!(
            "KvCache(device={}, layers={}, max_batch={}, max_len={}, kv_heads={}, head_dim={}, dtype={:?})",
            self.device,
            self.layout.layers,
            self.layout.max_batch,
            self.layout.max_len,
            self.layout.kv_heads,
            self.layout.head_dim,
            self.dtype
        )
    }
}

fn parse_kind(kind: &str) -> PyResult<KvKind> {
    match kind {
        "k" | "K" | "key" | "keys" => Ok(KvKind::K),
        "v" | "V" | "value" | "values" => Ok(KvKind::V),
        other => Err(PyValueError::new_err(format!(
            "kind {other:?}: expected \"k\" or \"v\""
        ))),
    }
}

pub fn register(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add_class::<KvCache>()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn layout() -> KvLayout {
        KvLayout {
            layers: 2,
            max_batch: 3,
            max_len: 100,
            kv_heads: 2,
            head_dim: 64,
            dtype_bytes: 2,
        }
    }

    #[test]
    fn dtypes_are_dlpack_codes() {
        assert_eq!(dtype_code("bfloat16"), Some((4, 16, 2)));
        assert_eq!(dtype_code("float16"), Some((2, 16, 2)));
        assert_eq!(dtype_code("float32"), Some((2, 32, 4)));
        assert_eq!(dtype_code("int8"), None);
    }

    #[test]
    fn a_buffer_view_strides_whole_granule_rows() {
        let granule = 2 << 20;
        let view = buffer_view(&layout(), granule, (4, 16));
        assert_eq!(view.shape, vec![3, 100, 2, 64]);
        assert_eq!(view.strides, Some(vec![(granule / 2) as i64, 128, 64, 1]));
        // The last sequence's last token ends inside its own row.
        let span = view.span_bytes();
        assert_eq!(span, 2 * granule + 100 * 256);
        assert!(span <= 3 * granule);
    }

    #[test]
    fn the_lengths_view_is_int32() {
        let view = lengths_view(5);
        assert_eq!((view.code, view.bits), (0, 32));
        assert_eq!(view.span_bytes(), 20);
    }

    #[test]
    fn kinds_parse() {
        assert_eq!(parse_kind("k").unwrap(), KvKind::K);
        assert_eq!(parse_kind("values").unwrap(), KvKind::V);
    }

    #[test]
    fn a_byte_array_spans_its_bytes() {
        assert_eq!(ArrayDesc::bytes(17).span_bytes(), 17);
        assert_eq!(ArrayDesc::bytes(0).span_bytes(), 0);
    }
}
