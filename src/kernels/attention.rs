//! Decode attention over a KV cache on stable addresses (`kernels/decode_attention.cu`, issue
//! 45): grouped-query heads, bf16 K/V in the cache's token-major rows, lengths read from device
//! memory so one captured graph serves every step, and only valid tokens read. With the append
//! of each step's new token and a CPU reference ([`attention_reference`]) for tests.

use std::sync::Arc;

use cudarc::driver::{CudaStream, LaunchConfig};

use super::args::{dim, grid_stride, need_elems, BF16, F32};
use super::table::kernel_table;
use crate::buffer::DeviceBuffer;
use crate::driver::launch::abi::{AppendArgs, AttentionArgs};
use crate::driver::launch::KernelFn;
use crate::error::{Error, LayoutError, Result};

/// Largest head dimension the kernel takes.
pub const MAX_HEAD_DIM: usize = 256;

/// The shape of one decode-attention launch over one layer of a KV cache.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct AttentionShape {
    /// Sequences (the cache's `max_batch`: the graph covers every slot).
    pub batch: usize,
    /// Query heads.
    pub heads: usize,
    /// Key/value heads; divides `heads`.
    pub kv_heads: usize,
    /// Elements per head (at most [`MAX_HEAD_DIM`]).
    pub head_dim: usize,
    /// Elements from one sequence's row to the next (`KvCache::seq_stride() / 2` for bf16).
    pub seq_stride: usize,
    /// Tokens per row; lengths are clamped to it.
    pub max_len: usize,
}

impl AttentionShape {
    fn check(&self) -> Result<()> {
        for (name, value) in [
            ("batch", self.batch),
            ("heads", self.heads),
            ("kv_heads", self.kv_heads),
            ("head_dim", self.head_dim),
            ("max_len", self.max_len),
        ] {
            dim(name, value)?;
        }
        let row = self.max_len * self.kv_heads * self.head_dim;
        if !self.heads.is_multiple_of(self.kv_heads)
            || self.head_dim > MAX_HEAD_DIM
            || self.seq_stride < row
            || self.batch > 65_535
        {
            return Err(Error::Layout(LayoutError::InvalidShape(format!(
                "attention: heads {} must be a multiple of kv_heads {}, head_dim {} at most \
                 {MAX_HEAD_DIM}, seq_stride {} at least max_len x kv_heads x head_dim = {row}, \
                 batch {} at most 65535",
                self.heads, self.kv_heads, self.head_dim, self.seq_stride, self.batch
            ))));
        }
        Ok(())
    }

    /// `1 / sqrt(head_dim)`.
    pub fn scale(&self) -> f32 {
        1.0 / (self.head_dim as f32).sqrt()
    }
}

kernel_table! {
    /// The decode-attention module and its functions.
    pub struct AttentionKernels from super::PTX_ATTENTION {
        attention: KernelFn<AttentionArgs> = DECODE_ATTENTION_BF16,
        append: KernelFn<AppendArgs> = KV_APPEND_BF16,
        to_bf16: KernelFn<(u64, u64, u64)> = ATTENTION_OUT_BF16,
    }
}

impl AttentionKernels {
    /// Enqueues `out[b, h] = softmax(q[b, h] · K[b, 0..len_b, h / group]ᵀ · scale) · V[..]`
    /// for every sequence `b` and head `h`, FP32 out; `k` and `v` are one layer's buffers of a
    /// KV cache (`KvCache::k_ptr`), `lengths` its device lengths (`u32`). The addresses must
    /// stay mapped for `batch` rows of `seq_stride` elements: a `KvCache` maps all of them.
    #[allow(clippy::too_many_arguments)]
    pub fn decode_attention(
        &self,
        stream: &Arc<CudaStream>,
        shape: AttentionShape,
        q: &impl DeviceBuffer,
        k: u64,
        v: u64,
        lengths: u64,
        out: &impl DeviceBuffer,
    ) -> Result<()> {
        shape.check()?;
        let rows = shape.batch * shape.heads;
        need_elems("attention q", q, [rows, shape.head_dim], BF16)?;
        need_elems("attention out", out, [rows, shape.head_dim], F32)?;
        let cfg = LaunchConfig {
            grid_dim: (shape.heads as u32, shape.batch as u32, 1),
            block_dim: (128, 1, 1),
            shared_mem_bytes: 0,
        };
        let args = (
            q.device_address(),
            k,
            v,
            lengths,
            out.device_address(),
            shape.heads as i32,
            shape.kv_heads as i32,
            shape.head_dim as i32,
            shape.seq_stride as u64,
            shape.max_len as i32,
            shape.scale(),
        );
        self.attention.launch(stream, cfg, args)
    }

    /// Enqueues the write of each sequence's new token (`k_new`, `v_new`: `[batch, kv_heads ·
    /// head_dim]` bf16) at position `length - 1` of its rows; free slots (length 0) write
    /// nothing. Grow the sequences (and publish the lengths) first.
    #[allow(clippy::too_many_arguments)]
    pub fn append(
        &self,
        stream: &Arc<CudaStream>,
        shape: AttentionShape,
        k: u64,
        v: u64,
        k_new: &impl DeviceBuffer,
        v_new: &impl DeviceBuffer,
        lengths: u64,
    ) -> Result<()> {
        shape.check()?;
        let token = shape.kv_heads * shape.head_dim;
        need_elems("append k_new", k_new, [shape.batch, token], BF16)?;
        need_elems("append v_new", v_new, [shape.batch, token], BF16)?;
        let args = (
            k,
            v,
            k_new.device_address(),
            v_new.device_address(),
            lengths,
            shape.batch as i32,
            token as i32,
            shape.seq_stride as u64,
            shape.max_len as i32,
        );
        let cfg = grid_stride((shape.batch * token) as u64);
        self.append.launch(stream, cfg, args)
    }

    /// Enqueues a conversion of the FP32 attention output to bf16 (`n` elements).
    pub fn output_bf16(
        &self,
        stream: &Arc<CudaStream>,
        input: &impl DeviceBuffer,
        output: &impl DeviceBuffer,
        n: usize,
    ) -> Result<()> {
        need_elems("attention output f32", input, [n, 1], F32)?;
        need_elems("attention output bf16", output, [n, 1], BF16)?;
        let cfg = grid_stride(n as u64);
        self.to_bf16.launch(
            stream,
            cfg,
            (input.device_address(), output.device_address(), n as u64),
        )
    }
}

/// The CPU reference of [`AttentionKernels::decode_attention`]: `q` `[batch, heads, dim]`
/// bf16 bits, `k` and `v` the layer's buffers as host copies (`batch · seq_stride` elements),
/// `lengths` per sequence. Computes in f64 with a two-pass softmax; FP32 out.
pub fn attention_reference(
    shape: AttentionShape,
    q: &[u16],
    k: &[u16],
    v: &[u16],
    lengths: &[u32],
) -> Result<Vec<f32>> {
    shape.check()?;
    let (heads, dim) = (shape.heads, shape.head_dim);
    let group = heads / shape.kv_heads;
    let token = shape.kv_heads * dim;
    let sizes_ok = q.len() >= shape.batch * heads * dim
        && k.len() >= shape.batch * shape.seq_stride
        && v.len() >= shape.batch * shape.seq_stride
        && lengths.len() >= shape.batch;
    if !sizes_ok {
        return Err(Error::Layout(LayoutError::InvalidShape(
            "attention reference: host buffers shorter than the shape".into(),
        )));
    }
    let bf = |bits: u16| f64::from(super::f32_from_bf16(bits));
    let scale = f64::from(shape.scale());
    let mut out = vec![0f32; shape.batch * heads * dim];
    for b in 0..shape.batch {
        let len = (lengths[b] as usize).min(shape.max_len);
        for h in 0..heads {
            let g = h / group;
            let qh = &q[(b * heads + h) * dim..][..dim];
            let at = |t: usize| b * shape.seq_stride + t * token + g * dim;
            let scores: Vec<f64> = (0..len)
                .map(|t| {
                    let kt = &k[at(t)..][..dim];
                    // The kernel scales q before the dot product, in FP32.
                    let dot: f64 = qh
                        .iter()
                        .zip(kt)
                        .map(|(&x, &y)| f64::from(super::f32_from_bf16(x) * shape.scale()) * bf(y))
                        .sum();
                    let _ = scale;
                    dot
                })
                .collect();
            let max = scores.iter().copied().fold(f64::NEG_INFINITY, f64::max);
            let weights: Vec<f64> = scores.iter().map(|s| (s - max).exp()).collect();
            let total: f64 = weights.iter().sum();
            let o = &mut out[(b * heads + h) * dim..][..dim];
            for (t, w) in weights.iter().enumerate() {
                let vt = &v[at(t)..][..dim];
                for (od, &vd) in o.iter_mut().zip(vt) {
                    *od += (w / total * bf(vd)) as f32;
                }
            }
        }
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::kernels::bf16_from_f32;

    fn shape() -> AttentionShape {
        AttentionShape {
            batch: 2,
            heads: 4,
            kv_heads: 2,
            head_dim: 8,
            seq_stride: 16 * 2 * 8,
            max_len: 16,
        }
    }

    #[test]
    fn one_token_gives_its_value_and_an_empty_sequence_zeros() {
        let s = shape();
        let q: Vec<u16> = (0..s.batch * s.heads * s.head_dim)
            .map(|i| bf16_from_f32((i % 7) as f32 * 0.25))
            .collect();
        let k = vec![bf16_from_f32(0.5); s.batch * s.seq_stride];
        let v: Vec<u16> = (0..s.batch * s.seq_stride)
            .map(|i| bf16_from_f32((i % 11) as f32))
            .collect();
        let out = attention_reference(s, &q, &k, &v, &[1, 0]).unwrap();
        for h in 0..s.heads {
            let g = h / 2;
            for d in 0..s.head_dim {
                let expected = super::super::f32_from_bf16(v[g * s.head_dim + d]);
                assert_eq!(out[h * s.head_dim + d], expected);
            }
        }
        assert!(out[s.heads * s.head_dim..].iter().all(|&x| x == 0.0));
    }

    #[test]
    fn equal_keys_average_the_values_and_tokens_past_the_length_are_ignored() {
        let s = shape();
        let q = vec![bf16_from_f32(1.0); s.batch * s.heads * s.head_dim];
        let k = vec![bf16_from_f32(0.25); s.batch * s.seq_stride];
        let token = s.kv_heads * s.head_dim;
        let mut v = vec![bf16_from_f32(1000.0); s.batch * s.seq_stride];
        for t in 0..4 {
            for e in 0..token {
                v[t * token + e] = bf16_from_f32(t as f32);
            }
        }
        let out = attention_reference(s, &q, &k, &v, &[4, 16]).unwrap();
        for x in &out[..s.heads * s.head_dim] {
            approx::assert_relative_eq!(*x, 1.5, max_relative = 1e-6);
        }
        let bad = AttentionShape { kv_heads: 3, ..s };
        assert!(attention_reference(bad, &q, &k, &v, &[1, 1]).is_err());
    }
}
