//! What `kv_decode.rs` and `tests/gpu_kv.rs` share: a model's attention geometry, the decode
//! step over a [`KvCache`] as graph work (per layer: append the step's token, then decode
//! attention reading each sequence's length from device memory), a host mirror of the cache,
//! and a seeded serving run (admissions with prompts copied in, forks by prefix sharing,
//! releases, a sleep and wake) checked against the CPU reference every few steps and bit for
//! bit at the end.
#![allow(dead_code)]

use std::sync::Arc;

use rand::{rngs::StdRng, Rng};
use stablebuf::buffer::copy_between;
use stablebuf::cudarc::driver::CudaStream;
use stablebuf::kernels::{attention_reference, bf16_from_f32, AttentionKernels, AttentionShape};
use stablebuf::kv::{KvCache, KvKind, KvLayout};
use stablebuf::{Error, HostStorage, Layout, Result, Space};

#[path = "../decode/raw.rs"]
mod raw;

pub use raw::Raw;

/// The attention geometry of a model and the batch its cache is reserved for.
#[derive(Clone, Copy, Debug)]
pub struct Model {
    pub layers: usize,
    pub heads: usize,
    pub kv_heads: usize,
    pub head_dim: usize,
    pub max_batch: usize,
    pub max_len: usize,
}

impl Model {
    pub fn layout(&self) -> KvLayout {
        KvLayout {
            layers: self.layers,
            max_batch: self.max_batch,
            max_len: self.max_len,
            kv_heads: self.kv_heads,
            head_dim: self.head_dim,
            dtype_bytes: 2,
        }
    }

    /// Elements of one token in one layer's K (or V).
    pub fn token(&self) -> usize {
        self.kv_heads * self.head_dim
    }

    /// Elements of one layer's queries (and outputs): `[max_batch, heads, head_dim]`.
    pub fn q_elems(&self) -> usize {
        self.max_batch * self.heads * self.head_dim
    }

    /// The launch shape over `cache` (its rows are `seq_stride` bytes apart).
    pub fn shape(&self, cache: &KvCache) -> AttentionShape {
        AttentionShape {
            batch: self.max_batch,
            heads: self.heads,
            kv_heads: self.kv_heads,
            head_dim: self.head_dim,
            seq_stride: cache.seq_stride() / 2,
            max_len: self.max_len,
        }
    }
}

/// The step's inputs and outputs, one part per layer: queries, the new token's K and V (bf16),
/// the FP32 attention output.
#[derive(Clone, Copy, Debug)]
pub struct StepIo {
    q: Raw,
    k_new: Raw,
    v_new: Raw,
    out: Raw,
    model: Model,
}

impl StepIo {
    /// The slots [`StepIo`] needs, for a [`Layout`] builder.
    pub fn slots(model: &Model) -> [(&'static str, usize); 4] {
        let tokens = model.layers * model.max_batch * model.token() * 2;
        [
            ("q", model.layers * model.q_elems() * 2),
            ("k_new", tokens),
            ("v_new", tokens),
            ("out", model.layers * model.q_elems() * 4),
        ]
    }

    pub fn new(space: &Space, stream: &Arc<CudaStream>, model: Model) -> Result<Self> {
        let raw = |name: &str| -> Result<Raw> { Ok(Raw::of(&space.view::<u8>(name, stream)?)) };
        Ok(Self {
            q: raw("q")?,
            k_new: raw("k_new")?,
            v_new: raw("v_new")?,
            out: raw("out")?,
            model,
        })
    }

    fn q(&self, layer: usize) -> Raw {
        let bytes = self.model.q_elems() * 2;
        self.q.part(layer * bytes, bytes)
    }

    fn k_new(&self, layer: usize) -> Raw {
        let bytes = self.model.max_batch * self.model.token() * 2;
        self.k_new.part(layer * bytes, bytes)
    }

    fn v_new(&self, layer: usize) -> Raw {
        let bytes = self.model.max_batch * self.model.token() * 2;
        self.v_new.part(layer * bytes, bytes)
    }

    fn out(&self, layer: usize) -> Raw {
        let bytes = self.model.q_elems() * 4;
        self.out.part(layer * bytes, bytes)
    }
}

/// One decode step over `cache` as graph work: per layer, the step's token appended at each
/// sequence's `length - 1`, then attention over its valid tokens, then the cache's mark that
/// the step is done with the layer ([`KvCache::mark_layer_done`], for
/// [`KvCache::change_behind`]); each layer flagged in `gated` starts at its gate
/// ([`KvCache::gate_layer`]).
/// Lengths are read from `cache`'s device array, so one graph
/// captured at `max_batch` serves every step.
/// Gates on the last layer only (the usual choice: see [`step_work`]).
pub fn last_layer_gated(model: &Model) -> Vec<bool> {
    (0..model.layers).map(|l| l + 1 == model.layers).collect()
}

pub fn step_work(
    kernels: Arc<AttentionKernels>,
    model: Model,
    cache: &Arc<KvCache>,
    io: StepIo,
    gated: Vec<bool>,
) -> Result<impl FnMut(&Arc<CudaStream>) -> Result<()> + Send + 'static> {
    let marks = cache.clone();
    let shape = model.shape(cache);
    let k = (0..model.layers)
        .map(|l| cache.k_ptr(l))
        .collect::<Result<Vec<_>>>()?;
    let v = (0..model.layers)
        .map(|l| cache.v_ptr(l))
        .collect::<Result<Vec<_>>>()?;
    let lengths = cache.lengths_device_ptr();
    Ok(move |stream: &Arc<CudaStream>| {
        for layer in 0..model.layers {
            if gated.get(layer).copied().unwrap_or(false) {
                // A gated layer is remapped by the cache's worker once the step in flight is
                // done with it, while the next step runs the layers before (the last layer's
                // mark leaves only the step's end to remap behind).
                marks.gate_layer(layer, stream.cu_stream() as u64)?;
            }
            kernels.append(
                stream,
                shape,
                k[layer],
                v[layer],
                &io.k_new(layer),
                &io.v_new(layer),
                lengths,
            )?;
            kernels.decode_attention(
                stream,
                shape,
                &io.q(layer),
                k[layer],
                v[layer],
                lengths,
                &io.out(layer),
            )?;
            marks.mark_layer_done(layer, stream.cu_stream() as u64)?;
        }
        Ok(())
    })
}

/// The host's copy of what the cache must hold: per (layer, K/V) buffer, `max_batch` rows of
/// `cap` tokens, and each sequence's length.
pub struct Mirror {
    model: Model,
    cap: usize,
    rows: Vec<Vec<u16>>,
    pub lengths: Vec<usize>,
}

impl Mirror {
    pub fn new(model: Model, cap: usize) -> Self {
        let row = model.max_batch * cap * model.token();
        Self {
            model,
            cap,
            rows: vec![vec![0; row]; 2 * model.layers],
            lengths: vec![0; model.max_batch],
        }
    }

    fn at(&self, seq: usize, token: usize) -> usize {
        (seq * self.cap + token) * self.model.token()
    }

    /// Tokens `[0, len)` of `seq` in `buffer` (2·layer + {0: K, 1: V}).
    pub fn row(&self, buffer: usize, seq: usize) -> &[u16] {
        let start = self.at(seq, 0);
        &self.rows[buffer][start..start + self.lengths[seq] * self.model.token()]
    }

    fn set_token(&mut self, buffer: usize, seq: usize, token: usize, data: &[u16]) {
        assert!(
            token < self.cap,
            "the mirror holds {} tokens per sequence",
            self.cap
        );
        let start = self.at(seq, token);
        self.rows[buffer][start..start + data.len()].copy_from_slice(data);
    }

    /// The reference output of layer `layer` for queries `q` (bf16 bits), FP32.
    pub fn reference(&self, layer: usize, q: &[u16]) -> Result<Vec<f32>> {
        let shape = AttentionShape {
            batch: self.model.max_batch,
            heads: self.model.heads,
            kv_heads: self.model.kv_heads,
            head_dim: self.model.head_dim,
            seq_stride: self.cap * self.model.token(),
            max_len: self.cap,
        };
        let lengths: Vec<u32> = self.lengths.iter().map(|&l| l as u32).collect();
        attention_reference(
            shape,
            q,
            &self.rows[2 * layer],
            &self.rows[2 * layer + 1],
            &lengths,
        )
    }
}

/// Random bf16 bits in `[-scale, scale)`.
pub fn random_bf16(rng: &mut StdRng, len: usize, scale: f32) -> Vec<u16> {
    (0..len)
        .map(|_| bf16_from_f32(rng.gen_range(-scale..scale)))
        .collect()
}

/// The serving run's knobs.
#[derive(Clone, Copy, Debug)]
pub struct ServeRun {
    pub steps: usize,
    /// Longest prompt copied in at admission.
    pub max_prompt: usize,
    /// Compare with the CPU reference every this many steps (and at the last).
    pub check_every: usize,
    /// Sleep and wake the cache before this step (none if past the end).
    pub sleep_at: usize,
    /// Keep zeroed granules ready at random on the steps that change nothing behind
    /// ([`KvCache::zero_ahead`]); the gated layers' fresh slots then take them unzeroed.
    pub zero_ahead: bool,
}

/// What a serving run did, for the caller's report.
#[derive(Clone, Copy, Debug, Default)]
pub struct ServeReport {
    pub admitted: usize,
    pub forked: usize,
    pub released: usize,
    pub checked_outputs: usize,
    pub checked_tokens: usize,
    pub max_abs_error: f32,
    pub shared_granules_seen: usize,
    /// Zeroed granules [`KvCache::zero_ahead`] said were ready, summed over its calls.
    pub zeroed_ahead: usize,
    /// Bytes past a row's length up to the end of its last backed granule, read back and
    /// found zero at the end of the run.
    pub checked_tail_bytes: usize,
}

fn mismatch(what: String) -> Error {
    Error::Layout(stablebuf::error::LayoutError::InvalidShape(what))
}

/// A scratch space with [`StepIo`]'s slots and a staging slot of one sequence's prompt in every
/// buffer (`max_prompt` tokens each), also used to read rows back.
pub fn serve_space(
    ctx: &Arc<stablebuf::cudarc::driver::CudaContext>,
    model: &Model,
    max_prompt: usize,
) -> Result<Space> {
    let staging = 2 * model.layers * max_prompt * model.token() * 2;
    let layout = StepIo::slots(model)
        .iter()
        .fold(Layout::builder(), |b, (name, bytes)| {
            b.scratch(*name, *bytes)
        })
        .scratch("staging", staging)
        .build()?;
    Space::new(ctx, layout)
}

/// What a serving run writes prompts through: the cache, the scratch space with the staging
/// slot, the stream, and the staging slot's size in tokens.
struct Target<'a> {
    cache: &'a KvCache,
    space: &'a Space,
    stream: &'a Arc<CudaStream>,
    max_prompt: usize,
}

/// Copies `seq`'s prompt (`prompt` tokens, fresh random data) into the cache after growing it,
/// and into the mirror.
fn admit(
    rng: &mut StdRng,
    target: &Target<'_>,
    mirror: &mut Mirror,
    seq: usize,
    prompt: usize,
) -> Result<()> {
    let Target {
        cache,
        space,
        stream,
        max_prompt,
    } = *target;
    let model = mirror.model;
    let token = model.token();
    let buffers = 2 * model.layers;
    let mut staging = vec![0u16; buffers * max_prompt * token];
    for buffer in 0..buffers {
        let data = random_bf16(rng, prompt * token, 1.0);
        staging[buffer * max_prompt * token..][..prompt * token].copy_from_slice(&data);
    }
    space.write(stream, "staging", &staging)?;
    cache.grow(seq, prompt)?;
    cache.write_guard(seq, 0..prompt)?;
    let source = space.view::<u16>("staging", stream)?;
    let row = seq * cache.seq_stride();
    for buffer in 0..buffers {
        let kind = if buffer % 2 == 0 {
            KvKind::K
        } else {
            KvKind::V
        };
        let target = cache.buffer(buffer / 2, kind)?;
        copy_between(
            stream,
            &target,
            row,
            &source,
            buffer * max_prompt * token * 2,
            prompt * token * 2,
        )?;
    }
    stream.synchronize().map_err(Error::from)?;
    mirror.lengths[seq] = prompt;
    for buffer in 0..buffers {
        let data = &staging[buffer * max_prompt * token..][..prompt * token];
        for t in 0..prompt {
            mirror.set_token(buffer, seq, t, &data[t * token..(t + 1) * token]);
        }
    }
    Ok(())
}

/// Makes the first `tokens` tokens of `from` the start of the empty slot `to`, in the cache
/// (granules shared by mapping, [`KvCache::share_prefix`]) and in the mirror (copied).
fn fork(cache: &KvCache, mirror: &mut Mirror, from: usize, to: usize, tokens: usize) -> Result<()> {
    cache.share_prefix(from, to, tokens)?;
    let token = mirror.model.token();
    mirror.lengths[to] = tokens;
    for buffer in 0..2 * mirror.model.layers {
        let row: Vec<u16> = mirror.row(buffer, from)[..tokens * token].to_vec();
        for t in 0..tokens {
            mirror.set_token(buffer, to, t, &row[t * token..(t + 1) * token]);
        }
    }
    Ok(())
}

/// A seeded serving run over `cache` with the graph `replay` captured over it (see
/// [`step_work`]): sequences are admitted with random prompts, forked from a running one by
/// [`KvCache::share_prefix`], grown a token per step, released and replaced; each step writes
/// fresh random queries and tokens, poisons the output with NaN and replays. Outputs are
/// compared with the CPU reference every `check_every` steps, and every row's bytes with the
/// mirror at the end.
#[allow(clippy::too_many_arguments)]
pub fn serve(
    rng: &mut StdRng,
    cache: &KvCache,
    space: &Space,
    stream: &Arc<CudaStream>,
    replay: &dyn Fn() -> Result<()>,
    model: Model,
    run: ServeRun,
    cap: usize,
) -> Result<ServeReport> {
    let mut mirror = Mirror::new(model, cap);
    let mut report = ServeReport::default();
    let token = model.token();
    let per_granule = model.layout().tokens_per_granule(cache.granule());
    let target = Target {
        cache,
        space,
        stream,
        max_prompt: run.max_prompt,
    };
    for step in 0..run.steps {
        if step == run.sleep_at {
            cache.sleep(&HostStorage::Pageable)?;
            cache.wake()?;
        }
        // Step 0 forks a sequence of whole granules, so every run shares granules (mapped
        // twice) and copies on write; later forks share whole granules half the time.
        if step == 0 && model.max_batch >= 2 && run.max_prompt > per_granule {
            admit(rng, &target, &mut mirror, 0, run.max_prompt)?;
            report.admitted += 1;
            let tokens = rng.gen_range(per_granule..=run.max_prompt);
            fork(cache, &mut mirror, 0, 1, tokens)?;
            report.forked += 1;
            // Seen now: either sequence may end in this step's events below (a run at
            // seed 1795835686585439066 released one before the count was taken).
            report.shared_granules_seen = cache.stats().shared_granules;
        }
        // Events: admit into free slots, fork a running sequence, release one.
        for seq in 0..model.max_batch {
            let len = mirror.lengths[seq];
            if len == 0 && rng.gen_bool(0.3) {
                let running: Vec<usize> = (0..model.max_batch)
                    .filter(|&s| mirror.lengths[s] > 0)
                    .collect();
                if !running.is_empty() && rng.gen_bool(0.4) {
                    let from = running[rng.gen_range(0..running.len())];
                    let from_len = mirror.lengths[from];
                    let tokens = if from_len >= per_granule && rng.gen_bool(0.5) {
                        rng.gen_range(per_granule..=from_len)
                    } else {
                        rng.gen_range(1..=from_len)
                    };
                    fork(cache, &mut mirror, from, seq, tokens)?;
                    report.forked += 1;
                } else {
                    let prompt = rng.gen_range(1..=run.max_prompt);
                    admit(rng, &target, &mut mirror, seq, prompt)?;
                    report.admitted += 1;
                }
            } else if len > 0 && (len + 1 >= cap || rng.gen_bool(0.05)) {
                cache.release(seq)?;
                mirror.lengths[seq] = 0;
                report.released += 1;
            }
        }
        report.shared_granules_seen = report
            .shared_granules_seen
            .max(cache.stats().shared_granules);
        // The step's token: every running sequence grows by one, written by the graph.
        for seq in 0..model.max_batch {
            let len = mirror.lengths[seq];
            if len > 0 {
                cache.grow(seq, len + 1)?;
                cache.write_guard(seq, len..len + 1)?;
                mirror.lengths[seq] = len + 1;
            }
        }
        cache.publish_lengths()?;
        let q = random_bf16(rng, model.layers * model.q_elems(), 1.0);
        let k_new = random_bf16(rng, model.layers * model.max_batch * token, 1.0);
        let v_new = random_bf16(rng, model.layers * model.max_batch * token, 1.0);
        space.write(stream, "q", &q)?;
        space.write(stream, "k_new", &k_new)?;
        space.write(stream, "v_new", &v_new)?;
        space.write(
            stream,
            "out",
            &vec![f32::NAN; model.layers * model.q_elems()],
        )?;
        replay()?;
        // Every other step, behind the replay: the next step's growth and a few releases,
        // layer by layer after each layer's mark (the released rows leave the mirror after
        // this step's outputs are checked: the replay in flight still reads them).
        let mut gone = Vec::new();
        if step % 2 == 1 {
            let mut next = Vec::new();
            for seq in 0..model.max_batch {
                let len = mirror.lengths[seq];
                if len > 0 && rng.gen_bool(0.05) {
                    gone.push(seq);
                } else if len > 0 && len + 1 < cap {
                    next.push((seq, len + 1));
                }
            }
            cache.change_behind(&next, &gone)?;
            report.released += gone.len();
        } else if run.zero_ahead && rng.gen_bool(0.5) {
            // Off the step's path, behind its replay: granules zeroed for the next growth.
            let buffers = 2 * model.layers;
            report.zeroed_ahead +=
                cache.zero_ahead(rng.gen_range(1..=2 * buffers), rng.gen_range(1..=buffers))?;
        }
        stream.synchronize().map_err(Error::from)?;
        for layer in 0..model.layers {
            for seq in 0..model.max_batch {
                let len = mirror.lengths[seq];
                if len > 0 {
                    let at = (layer * model.max_batch + seq) * token;
                    mirror.set_token(2 * layer, seq, len - 1, &k_new[at..at + token]);
                    mirror.set_token(2 * layer + 1, seq, len - 1, &v_new[at..at + token]);
                }
            }
        }
        if step % run.check_every == 0 || step + 1 == run.steps {
            let out: Vec<f32> = space.read(stream, "out")?;
            for layer in 0..model.layers {
                let q_layer = &q[layer * model.q_elems()..][..model.q_elems()];
                let want = mirror.reference(layer, q_layer)?;
                let got = &out[layer * model.q_elems()..][..model.q_elems()];
                for (i, (&g, &w)) in got.iter().zip(&want).enumerate() {
                    let close = approx::relative_eq!(g, w, epsilon = 2e-4, max_relative = 2e-3);
                    if !close {
                        return Err(mismatch(format!(
                            "step {step} layer {layer}: output {i} (sequence {}) is {g}, the CPU \
                             reference {w}",
                            i / (model.heads * model.head_dim)
                        )));
                    }
                    report.max_abs_error = report.max_abs_error.max((g - w).abs());
                }
                report.checked_outputs += got.len();
            }
        }
        for seq in gone {
            mirror.lengths[seq] = 0;
        }
    }
    (report.checked_tokens, report.checked_tail_bytes) =
        check_rows(cache, space, stream, &mirror, run.max_prompt)?;
    Ok(report)
}

/// Reads every running sequence's rows back (through the staging slot, `max_prompt` tokens at
/// a time) and compares them with the mirror bit for bit, and checks that the rest of each
/// row's last backed granule, past its length, reads zero (a granule is zeroed before it backs
/// a row, whichever way it came: fresh, reused, [`KvCache::zero_ahead`], the copied tail of a
/// fork). Returns the tokens compared and the tail bytes checked.
fn check_rows(
    cache: &KvCache,
    space: &Space,
    stream: &Arc<CudaStream>,
    mirror: &Mirror,
    max_prompt: usize,
) -> Result<(usize, usize)> {
    let model = mirror.model;
    let token = model.token();
    let staging = space.view::<u16>("staging", stream)?;
    let chunk = 2 * model.layers * max_prompt;
    let per_granule = model.layout().tokens_per_granule(cache.granule());
    let mut compared = 0;
    let mut tail_bytes = 0;
    for buffer in 0..2 * model.layers {
        let kind = if buffer % 2 == 0 {
            KvKind::K
        } else {
            KvKind::V
        };
        let source = cache.buffer(buffer / 2, kind)?;
        for seq in 0..model.max_batch {
            let want = mirror.row(buffer, seq);
            let len = mirror.lengths[seq];
            for first in (0..len).step_by(chunk) {
                let n = chunk.min(len - first);
                copy_between(
                    stream,
                    &staging,
                    0,
                    &source,
                    seq * cache.seq_stride() + first * token * 2,
                    n * token * 2,
                )?;
                let got: Vec<u16> = space.read(stream, "staging")?;
                if got[..n * token] != want[first * token..(first + n) * token] {
                    let i = (0..n * token)
                        .find(|&i| got[i] != want[first * token + i])
                        .unwrap_or(0);
                    return Err(mismatch(format!(
                        "buffer {buffer} sequence {seq}: token {} differs from the mirror",
                        first + i / token
                    )));
                }
                compared += n;
            }
            // Past the length: to the end of the last granule the cache backs (its length may
            // be one ahead of the mirror's, grown behind the last step).
            let backed_to = cache.length(seq)?.max(len);
            let end = (backed_to.div_ceil(per_granule) * per_granule).min(model.max_len);
            let n = (end - len).min(chunk);
            if n == 0 {
                continue;
            }
            copy_between(
                stream,
                &staging,
                0,
                &source,
                seq * cache.seq_stride() + len * token * 2,
                n * token * 2,
            )?;
            let got: Vec<u16> = space.read(stream, "staging")?;
            if let Some(i) = got[..n * token].iter().position(|&word| word != 0) {
                return Err(mismatch(format!(
                    "buffer {buffer} sequence {seq}: token {} past the length {len} reads {:#06x}, \
                     not zero",
                    len + i / token,
                    got[i]
                )));
            }
            tail_bytes += n * token * 2;
        }
    }
    Ok((compared, tail_bytes))
}
