//! The decode stack shared by `examples/decode_loop.rs`, `benches/decode.rs` and
//! `tests/gpu_decode.rs`: its layout, device fill, forward pass (cuBLAS bf16 GemmEx plus the
//! decode kernels) and a float32 CPU reference.
//!
//! ```text
//!   L pre-norm MLP layers over a bf16 residual stream x (batch × hidden); inner = ratio × hidden
//!   layer l:  n = rms_norm(x, gamma_l)                  1 kernel
//!             u = n · W_up_lᵀ       (inner × hidden)    cuBLAS GemmEx, FP32 out
//!             a = act(u + b_up_l)                       1 kernel
//!             d = a · W_down_lᵀ     (hidden × inner)    cuBLAS GemmEx, FP32 out
//!             x = x + (d + b_down_l)                    1 kernel
//!   group "weights" (one dataset per weight set):  vectors | up0 | down0 | up1 | down1 | …
//!       vectors = for each layer [gamma (hidden) | b_up (inner) | b_down (hidden)], bf16
//!   scratch: x0 (the input batch) | x | normed | up_out | act | down_out | workspace (cuBLAS)
//! ```
//! Layer 0 reads the input `x0` and writes `x`; later layers update `x` in place, so a replay
//! needs no copy node and always starts from the same input. Scratch is sized for
//! `Shape::max_batch` rows; a pass may use fewer.
//!
//! Tensor parallel (`Shape::ranks` > 1, one process per rank): each rank holds rows
//! `rank·s .. (rank+1)·s` of every `W_up` and `b_up` and the same columns of every `W_down`
//! (`s = inner / ranks`: column- then row-parallel), so `d` is a partial sum, all-reduced (an
//! [`AllReduce`] the caller passes, NCCL in `examples/tensor_parallel.rs`) before the residual;
//! gamma and `b_down` are the same on every rank. With one rank the values are those of the
//! single-device stack; [`HostWeights::generate`] assembles the whole model from every rank's
//! shard for the CPU reference.
#![allow(dead_code)]

pub mod loops;
mod raw;

pub use raw::Raw;

/// The `--act` option of the decode examples: the MLP's activation.
#[derive(Clone, Copy, Debug, clap::ValueEnum)]
pub enum Act {
    Gelu,
    Silu,
}

impl From<Act> for Activation {
    fn from(act: Act) -> Self {
        match act {
            Act::Gelu => Activation::GeluTanh,
            Act::Silu => Activation::Silu,
        }
    }
}

use std::sync::Arc;

use stablebuf::cudarc::driver::{sys, CudaStream};
use stablebuf::error::LayoutError;
use stablebuf::kernels::{
    bf16_from_f32, f32_from_bf16, uniform_bf16, Activation, DecodeKernels, GemmOutput, WeightLayout,
};
use stablebuf::kernels::{Blas, RECOMMENDED_WORKSPACE};
use stablebuf::{Dataset, Error, Layout, Result, Space};

/// RMSNorm's epsilon.
pub const EPS: f32 = 1e-5;
const BF16: usize = 2;
const F32: usize = 4;

/// The size of the stack.
#[derive(Clone, Copy, Debug)]
pub struct Shape {
    pub layers: usize,
    pub hidden: usize,
    /// The MLP's inner width is `ratio × hidden`.
    pub ratio: usize,
    /// Rows the scratch slots hold; a forward pass may use fewer.
    pub max_batch: usize,
    pub act: Activation,
    /// Tensor-parallel ranks the MLP's inner width is split over (1: the whole stack here).
    pub ranks: usize,
    /// Which rank's shard this process holds (`0..ranks`).
    pub rank: usize,
}

impl Shape {
    /// The MLP's inner width (of the whole model).
    pub fn inner(&self) -> usize {
        self.ratio * self.hidden
    }

    /// The part of the inner width this rank holds (`inner / ranks`).
    pub fn shard(&self) -> usize {
        self.inner() / self.ranks.max(1)
    }

    /// The same stack whole, on one device (the CPU reference's shape).
    pub fn whole(&self) -> Self {
        Self {
            ranks: 1,
            rank: 0,
            ..*self
        }
    }

    /// The same stack as rank `rank` holds it.
    pub fn of_rank(&self, rank: usize) -> Self {
        Self { rank, ..*self }
    }

    /// bf16 elements of one layer's vectors here: gamma, b_up (this rank's part), b_down.
    pub fn vector_len(&self) -> usize {
        2 * self.hidden + self.shard()
    }

    /// Bytes of weights a forward pass reads on this rank (matrices and vectors, without
    /// padding).
    pub fn weight_bytes(&self) -> usize {
        self.layers * (2 * self.hidden * self.shard() + self.vector_len()) * BF16
    }

    fn check(&self) -> Result<()> {
        if self.ranks == 0 || self.rank >= self.ranks || !self.inner().is_multiple_of(self.ranks) {
            return Err(Error::Layout(LayoutError::InvalidShape(format!(
                "rank {} of {} ranks, inner width {}: the ranks must split the inner width evenly",
                self.rank,
                self.ranks,
                self.inner()
            ))));
        }
        Ok(())
    }

    /// Graph nodes of one pass that are ours (cuBLAS adds one or more per GEMM).
    pub fn own_kernels(&self) -> usize {
        3 * self.layers
    }
}

/// The layout: group "weights" and the scratch slots of one lane. See the module docs.
pub fn layout(shape: Shape) -> Result<Layout> {
    shape.check()?;
    let (h, inner, b) = (shape.hidden, shape.shard(), shape.max_batch);
    let mut builder = Layout::builder()
        .group("weights")
        .input("vectors", shape.layers * shape.vector_len() * BF16);
    for l in 0..shape.layers {
        builder = builder
            .input(format!("up{l}"), inner * h * BF16)
            .input(format!("down{l}"), h * inner * BF16);
    }
    builder
        .scratch("x0", b * h * BF16)
        .scratch("x", b * h * BF16)
        .scratch("normed", b * h * BF16)
        .scratch("up_out", b * inner * F32)
        .scratch("act", b * inner * BF16)
        .scratch("down_out", b * h * F32)
        .scratch("workspace", RECOMMENDED_WORKSPACE)
        .build()
}

/// Where one weight set's tensors are.
#[derive(Clone, Debug)]
pub struct Weights {
    pub vectors: Raw,
    pub up: Vec<Raw>,
    pub down: Vec<Raw>,
    shape: Shape,
}

impl Weights {
    /// The slots of `space`'s "weights" group: whatever dataset is bound there.
    pub fn in_space(space: &Space, shape: Shape) -> Result<Self> {
        let slot = |name: &str| space.slot(name).map(Raw::of);
        Ok(Self {
            vectors: slot("vectors")?,
            up: (0..shape.layers)
                .map(|l| slot(&format!("up{l}")))
                .collect::<Result<_>>()?,
            down: (0..shape.layers)
                .map(|l| slot(&format!("down{l}")))
                .collect::<Result<_>>()?,
            shape,
        })
    }

    /// Laid out like `dataset` from `base`: the dataset's own (home) memory when `base` is
    /// its home address, or a static buffer holding a byte copy of it.
    pub fn at(base: sys::CUdeviceptr, dataset: &Dataset, shape: Shape) -> Self {
        let slot = |name: &str| {
            let s = dataset
                .slots()
                .iter()
                .find(|s| s.name == name)
                .expect("a slot of the decode layout");
            Raw {
                ptr: base + s.offset as u64,
                bytes: s.bytes,
            }
        };
        Self {
            vectors: slot("vectors"),
            up: (0..shape.layers).map(|l| slot(&format!("up{l}"))).collect(),
            down: (0..shape.layers)
                .map(|l| slot(&format!("down{l}")))
                .collect(),
            shape,
        }
    }

    /// A dataset's own memory.
    pub fn home(dataset: &Dataset, shape: Shape) -> Result<Self> {
        Ok(Self::at(dataset.home_ptr()?, dataset, shape))
    }

    fn vector(&self, layer: usize, start: usize, len: usize) -> Raw {
        let first = layer * self.shape.vector_len() + start;
        self.vectors.part(first * BF16, len * BF16)
    }

    pub fn gamma(&self, layer: usize) -> Raw {
        self.vector(layer, 0, self.shape.hidden)
    }

    pub fn b_up(&self, layer: usize) -> Raw {
        self.vector(layer, self.shape.hidden, self.shape.shard())
    }

    pub fn b_down(&self, layer: usize) -> Raw {
        let s = self.shape;
        self.vector(layer, s.hidden + s.shard(), s.hidden)
    }
}

/// The scratch slots a pass uses.
#[derive(Clone, Copy, Debug)]
pub struct Acts {
    pub x0: Raw,
    pub x: Raw,
    pub normed: Raw,
    pub up_out: Raw,
    pub act: Raw,
    pub down_out: Raw,
    pub workspace: Raw,
}

impl Acts {
    pub fn in_space(space: &Space) -> Result<Self> {
        let slot = |name: &str| space.slot(name).map(Raw::of);
        Ok(Self {
            x0: slot("x0")?,
            x: slot("x")?,
            normed: slot("normed")?,
            up_out: slot("up_out")?,
            act: slot("act")?,
            down_out: slot("down_out")?,
            workspace: slot("workspace")?,
        })
    }
}

/// Sums a tensor-parallel layer's partial `d` (f32, in place) over every rank, on the stream
/// given; capturable. Every rank must make the same calls in the same order.
pub type AllReduce = Arc<dyn Fn(&Arc<CudaStream>, &Raw) -> Result<()> + Send + Sync>;

/// Enqueues one decode step for `batch` rows on `stream` (the stream `blas` was made on).
/// `reduce` sums each layer's partial down projection over the ranks (needed when
/// `shape.ranks > 1`).
#[allow(clippy::too_many_arguments)]
pub fn forward(
    blas: &Blas,
    kernels: &DecodeKernels,
    stream: &Arc<CudaStream>,
    w: &Weights,
    a: &Acts,
    shape: Shape,
    batch: usize,
    reduce: Option<&AllReduce>,
) -> Result<()> {
    if shape.ranks > 1 && reduce.is_none() {
        return Err(Error::Layout(LayoutError::InvalidShape(format!(
            "a stack split over {} ranks needs an all-reduce",
            shape.ranks
        ))));
    }
    let (h, inner) = (shape.hidden, shape.shard());
    for l in 0..shape.layers {
        let input = if l == 0 { &a.x0 } else { &a.x };
        kernels.rms_norm(stream, input, &w.gamma(l), &a.normed, [batch, h], EPS)?;
        blas.gemm_bf16(
            &a.normed,
            &w.up[l],
            WeightLayout::NByK,
            &a.up_out,
            GemmOutput::F32,
            [batch, inner, h],
        )?;
        kernels.bias_act(
            stream,
            &a.up_out,
            &w.b_up(l),
            &a.act,
            [batch, inner],
            shape.act,
        )?;
        blas.gemm_bf16(
            &a.act,
            &w.down[l],
            WeightLayout::NByK,
            &a.down_out,
            GemmOutput::F32,
            [batch, h, inner],
        )?;
        if let Some(reduce) = reduce {
            reduce(stream, &a.down_out.part(0, batch * h * F32))?;
        }
        kernels.residual_add(stream, &a.down_out, &w.b_down(l), input, &a.x, [batch, h])?;
    }
    Ok(())
}

/// [`forward`] as the work of a graph (owns what it needs, so it can be captured and
/// re-captured).
pub fn work(
    blas: Arc<Blas>,
    kernels: Arc<DecodeKernels>,
    w: Weights,
    a: Acts,
    shape: Shape,
    batch: usize,
    reduce: Option<AllReduce>,
) -> impl FnMut(&Arc<CudaStream>) -> Result<()> + Send + 'static {
    move |stream| {
        forward(
            &blas,
            &kernels,
            stream,
            &w,
            &a,
            shape,
            batch,
            reduce.as_ref(),
        )
    }
}

/// One random tensor of a weight set: which one, and the range of its values.
struct Tensor {
    what: Part,
    lo: f32,
    hi: f32,
}

enum Part {
    Gamma(usize),
    BiasUp(usize),
    BiasDown(usize),
    Up(usize),
    Down(usize),
}

/// Every tensor of a weight set with its value range: matrices uniform in ±sqrt(3 / fan_in)
/// (unit variance through each projection, so 32 layers stay in range), gamma in [0.8, 1.2],
/// biases in ±0.1.
fn tensors(shape: Shape) -> Vec<Tensor> {
    let up = (3.0 / shape.hidden as f32).sqrt();
    let down = (3.0 / shape.inner() as f32).sqrt();
    let mut all = Vec::new();
    for l in 0..shape.layers {
        all.push(Tensor {
            what: Part::Gamma(l),
            lo: 0.8,
            hi: 1.2,
        });
        all.push(Tensor {
            what: Part::BiasUp(l),
            lo: -0.1,
            hi: 0.1,
        });
        all.push(Tensor {
            what: Part::BiasDown(l),
            lo: -0.1,
            hi: 0.1,
        });
        all.push(Tensor {
            what: Part::Up(l),
            lo: -up,
            hi: up,
        });
        all.push(Tensor {
            what: Part::Down(l),
            lo: -down,
            hi: down,
        });
    }
    all
}

/// The seed of tensor `index` of weight set `seed` on `shape`'s rank: the tensors split over the
/// ranks (b_up, W_up, W_down) differ per rank (rank 0's seeds are the single-device stack's);
/// gamma and b_down are the same on every rank.
fn tensor_seed(shape: Shape, part: &Part, seed: u64, index: usize) -> u64 {
    let seed = seed.wrapping_mul(0x1_0000_0001).wrapping_add(index as u64);
    match part {
        Part::Gamma(_) | Part::BiasDown(_) => seed,
        Part::BiasUp(_) | Part::Up(_) | Part::Down(_) => {
            seed ^ (shape.rank as u64).wrapping_mul(0x9e37_79b9_7f4a_7c15)
        }
    }
}

/// Fills a weight set in place on the device from `seed` (see [`HostWeights::generate`] for the
/// same values on the host).
pub fn fill_weights(
    kernels: &DecodeKernels,
    stream: &Arc<CudaStream>,
    w: &Weights,
    shape: Shape,
    seed: u64,
) -> Result<()> {
    for (index, t) in tensors(shape).iter().enumerate() {
        let target = match t.what {
            Part::Gamma(l) => w.gamma(l),
            Part::BiasUp(l) => w.b_up(l),
            Part::BiasDown(l) => w.b_down(l),
            Part::Up(l) => w.up[l],
            Part::Down(l) => w.down[l],
        };
        let seed = tensor_seed(shape, &t.what, seed, index);
        kernels.fill_uniform(stream, &target, seed, t.lo, t.hi)?;
    }
    Ok(())
}

/// Fills the input batch (all `max_batch` rows of `x0`) from `seed`: uniform in ±1.
pub fn fill_input(
    kernels: &DecodeKernels,
    stream: &Arc<CudaStream>,
    a: &Acts,
    seed: u64,
) -> Result<()> {
    kernels.fill_uniform(stream, &a.x0, seed, -1.0, 1.0)
}

/// The input batch [`fill_input`] writes, on the host.
pub fn host_input(shape: Shape, seed: u64) -> Vec<u16> {
    (0..(shape.max_batch * shape.hidden) as u64)
        .map(|i| uniform_bf16(seed, i, -1.0, 1.0))
        .collect()
}

/// A weight set on the host, as bf16 bits (of the whole model, or of one rank's shard).
pub struct HostWeights {
    pub vectors: Vec<u16>,
    pub up: Vec<Vec<u16>>,
    pub down: Vec<Vec<u16>>,
}

impl HostWeights {
    /// The whole model (`shape.whole()`) of the set [`fill_weights`] writes with `seed` on
    /// each rank, bit for bit: with one rank, what it writes; with several, every rank's shard
    /// put in its place.
    pub fn generate(shape: Shape, seed: u64) -> Self {
        if shape.ranks <= 1 {
            return Self::shard(shape, seed);
        }
        let shards: Vec<Self> = std::thread::scope(|scope| {
            let handles: Vec<_> = (0..shape.ranks)
                .map(|rank| scope.spawn(move || Self::shard(shape.of_rank(rank), seed)))
                .collect();
            handles
                .into_iter()
                .map(|h| h.join().expect("a generating thread panicked"))
                .collect()
        });
        Self::assemble(shape, &shards)
    }

    /// The values [`fill_weights`] writes with `seed` on `shape`'s rank, bit for bit. The large
    /// matrices are generated on threads of their own.
    pub fn shard(shape: Shape, seed: u64) -> Self {
        let (h, inner, vl) = (shape.hidden, shape.shard(), shape.vector_len());
        let mut out = Self {
            vectors: vec![0; shape.layers * vl],
            up: vec![vec![0; inner * h]; shape.layers],
            down: vec![vec![0; h * inner]; shape.layers],
        };
        let fill = |target: &mut [u16], seed: u64, t: &Tensor| {
            for (i, v) in target.iter_mut().enumerate() {
                *v = uniform_bf16(seed, i as u64, t.lo, t.hi);
            }
        };
        let all = tensors(shape);
        let seeds: Vec<u64> = all
            .iter()
            .enumerate()
            .map(|(index, t)| tensor_seed(shape, &t.what, seed, index))
            .collect();
        for (t, &seed) in all.iter().zip(&seeds) {
            let target: &mut [u16] = match t.what {
                Part::Gamma(l) => &mut out.vectors[l * vl..l * vl + h],
                Part::BiasUp(l) => &mut out.vectors[l * vl + h..l * vl + h + inner],
                Part::BiasDown(l) => &mut out.vectors[l * vl + h + inner..(l + 1) * vl],
                Part::Up(_) | Part::Down(_) => continue,
            };
            fill(target, seed, t);
        }
        std::thread::scope(|scope| {
            let mut up = out.up.iter_mut();
            let mut down = out.down.iter_mut();
            for (t, &seed) in all.iter().zip(&seeds) {
                let target = match t.what {
                    Part::Up(_) => up.next(),
                    Part::Down(_) => down.next(),
                    _ => continue,
                }
                .expect("one matrix per layer");
                scope.spawn(move || fill(target, seed, t));
            }
        });
        out
    }

    /// The whole model from every rank's shard (`shards[r]` of rank `r`).
    fn assemble(shape: Shape, shards: &[Self]) -> Self {
        let whole = shape.whole();
        let (h, s, inner) = (shape.hidden, shape.shard(), whole.inner());
        let (vl, shard_vl) = (whole.vector_len(), shape.vector_len());
        let mut out = Self {
            vectors: vec![0; shape.layers * vl],
            up: vec![Vec::with_capacity(inner * h); shape.layers],
            down: vec![vec![0; h * inner]; shape.layers],
        };
        for l in 0..shape.layers {
            let vectors = &mut out.vectors[l * vl..(l + 1) * vl];
            let first = &shards[0].vectors[l * shard_vl..(l + 1) * shard_vl];
            vectors[..h].copy_from_slice(&first[..h]); // gamma: the same on every rank
            vectors[h + inner..].copy_from_slice(&first[h + s..]); // b_down: the same too
            for (rank, shard) in shards.iter().enumerate() {
                let part = &shard.vectors[l * shard_vl..(l + 1) * shard_vl];
                vectors[h + rank * s..h + (rank + 1) * s].copy_from_slice(&part[h..h + s]);
                out.up[l].extend_from_slice(&shard.up[l]); // rows rank·s ..
                for i in 0..h {
                    out.down[l][i * inner + rank * s..i * inner + (rank + 1) * s]
                        .copy_from_slice(&shard.down[l][i * s..(i + 1) * s]);
                }
            }
        }
        out
    }

    /// Copies the set (as generated for `dataset`'s rank) into `dataset` (blocking).
    pub fn upload(&self, dataset: &Dataset, stream: &Arc<CudaStream>) -> Result<()> {
        dataset.write(stream, "vectors", &self.vectors)?;
        for (l, (up, down)) in self.up.iter().zip(&self.down).enumerate() {
            dataset.write(stream, &format!("up{l}"), up)?;
            dataset.write(stream, &format!("down{l}"), down)?;
        }
        Ok(())
    }
}

fn round_bf16(v: f32) -> f32 {
    f32_from_bf16(bf16_from_f32(v))
}

/// Float32 CPU reference of one step for row `row` of `x0` (`max_batch × hidden` bf16 bits),
/// rounding to bf16 where the GPU stores bf16 and accumulating dot products in f64, on the
/// whole model (`w` from [`HostWeights::generate`]). Returns the row of `x` after the last layer.
pub fn cpu_forward_row(w: &HostWeights, x0: &[u16], row: usize, shape: Shape) -> Vec<f32> {
    let shape = shape.whole();
    let (h, inner, vl) = (shape.hidden, shape.inner(), shape.vector_len());
    let mut x: Vec<f32> = x0[row * h..(row + 1) * h]
        .iter()
        .map(|&b| f32_from_bf16(b))
        .collect();
    let dot = |weights: &[u16], input: &[f32]| -> f32 {
        weights
            .iter()
            .zip(input)
            .map(|(&w, &v)| f64::from(f32_from_bf16(w)) * f64::from(v))
            .sum::<f64>() as f32
    };
    for l in 0..shape.layers {
        let vectors = &w.vectors[l * vl..(l + 1) * vl];
        let (gamma, rest) = vectors.split_at(h);
        let (b_up, b_down) = rest.split_at(inner);
        let mean_square = x.iter().map(|v| f64::from(*v).powi(2)).sum::<f64>() / h as f64;
        let scale = (1.0 / (mean_square + f64::from(EPS)).sqrt()) as f32;
        let normed: Vec<f32> = x
            .iter()
            .zip(gamma)
            .map(|(v, &g)| round_bf16(v * scale * f32_from_bf16(g)))
            .collect();
        let act: Vec<f32> = (0..inner)
            .map(|j| {
                let u = dot(&w.up[l][j * h..(j + 1) * h], &normed);
                round_bf16(shape.act.apply(u + f32_from_bf16(b_up[j])))
            })
            .collect();
        for (i, xi) in x.iter_mut().enumerate() {
            let d = dot(&w.down[l][i * inner..(i + 1) * inner], &act);
            *xi = round_bf16(*xi + (d + f32_from_bf16(b_down[i])));
        }
    }
    x
}

/// Largest `|got − want|` over the elements, and whether every element is within `rtol·|want| +
/// atol` (NaN never is).
pub fn compare(got: &[f32], want: &[f32], rtol: f32, atol: f32) -> (f32, bool) {
    let mut worst = 0.0f32;
    let mut ok = got.len() == want.len();
    for (g, w) in got.iter().zip(want) {
        let error = (g - w).abs();
        if error.is_nan() || error > rtol * w.abs() + atol {
            ok = false;
        }
        if error.is_nan() || worst.is_nan() {
            worst = f32::NAN;
        } else {
            worst = worst.max(error);
        }
    }
    (worst, ok)
}

/// Root mean square of the values.
pub fn rms(values: &[f32]) -> f32 {
    (values.iter().map(|v| f64::from(*v).powi(2)).sum::<f64>() / values.len().max(1) as f64).sqrt()
        as f32
}
