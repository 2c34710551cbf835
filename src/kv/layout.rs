//! The shape of a KV cache and where each byte of it lives: one reservation holding, for each
//! layer, a K buffer and a V buffer of `max_batch` sequence rows, each row token-major
//! (`[token, kv_head, dim]`) and a whole number of granules long.
//!
//! ```text
//!   reservation: | L0 K | L0 V | L1 K | L1 V | ...          (buffer b = 2·layer + {0: K, 1: V})
//!   one buffer:  | seq 0 row | seq 1 row | ... | seq max_batch-1 row |
//!   one row:     | granule 0 | granule 1 | ... |   (seq_stride = granules_per_seq · granule)
//!   token t of a row: bytes [t · token_bytes, (t + 1) · token_bytes), kv_head-major inside
//! ```

use crate::error::{Error, LayoutError, Result};

/// The model and batch a [`KvCache`](super::KvCache) is reserved for.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct KvLayout {
    /// Transformer layers (each has a K and a V buffer).
    pub layers: usize,
    /// Sequence slots (the batch the decode graph is captured at).
    pub max_batch: usize,
    /// Tokens reserved per sequence.
    pub max_len: usize,
    /// Key/value heads (grouped-query attention: fewer than the query heads).
    pub kv_heads: usize,
    /// Elements per head.
    pub head_dim: usize,
    /// Bytes per element (2 for bf16).
    pub dtype_bytes: usize,
}

impl KvLayout {
    /// Bytes of one token in one buffer (one layer's K, or its V): `kv_heads · head_dim ·
    /// dtype_bytes`.
    pub fn token_bytes(&self) -> usize {
        self.kv_heads * self.head_dim * self.dtype_bytes
    }

    /// Whole tokens of one sequence in one granule of `granule` bytes (one layer's K or V).
    pub fn tokens_per_granule(&self, granule: usize) -> usize {
        granule / self.token_bytes().max(1)
    }

    pub(crate) fn check(&self) -> Result<()> {
        let dims = [
            ("layers", self.layers),
            ("max_batch", self.max_batch),
            ("max_len", self.max_len),
            ("kv_heads", self.kv_heads),
            ("head_dim", self.head_dim),
            ("dtype_bytes", self.dtype_bytes),
        ];
        for (name, value) in dims {
            if value == 0 || i32::try_from(value).is_err() {
                return Err(Error::Layout(LayoutError::InvalidShape(format!(
                    "KV layout: {name} = {value} must be in 1..=i32::MAX"
                ))));
            }
        }
        Ok(())
    }
}

/// [`KvLayout`] placed on granules of one size: every offset the cache computes.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct Geometry {
    pub layout: KvLayout,
    pub granule: usize,
    pub token_bytes: usize,
    /// Granules of one sequence row.
    pub granules_per_seq: usize,
    /// Bytes of one sequence row.
    pub seq_stride: usize,
    /// K and V of every layer: `2 · layers`.
    pub buffers: usize,
    /// Bytes of the whole reservation.
    pub total_bytes: usize,
}

impl Geometry {
    pub fn new(layout: KvLayout, granule: usize) -> Result<Self> {
        layout.check()?;
        let overflow = || {
            Error::Layout(LayoutError::InvalidShape(format!(
                "KV layout {layout:?} overflows the address space"
            )))
        };
        let token_bytes = layout
            .kv_heads
            .checked_mul(layout.head_dim)
            .and_then(|b| b.checked_mul(layout.dtype_bytes))
            .ok_or_else(overflow)?;
        let row = token_bytes
            .checked_mul(layout.max_len)
            .ok_or_else(overflow)?;
        let granules_per_seq = row.div_ceil(granule);
        let seq_stride = granules_per_seq * granule;
        let buffers = layout.layers.checked_mul(2).ok_or_else(overflow)?;
        let total_bytes = seq_stride
            .checked_mul(layout.max_batch)
            .and_then(|b| b.checked_mul(buffers))
            .filter(|&b| b <= 1 << 50)
            .ok_or_else(overflow)?;
        Ok(Self {
            layout,
            granule,
            token_bytes,
            granules_per_seq,
            seq_stride,
            buffers,
            total_bytes,
        })
    }

    /// Byte offset of buffer `buffer`, sequence `seq`'s row in the reservation.
    pub fn row_offset(&self, buffer: usize, seq: usize) -> usize {
        (buffer * self.layout.max_batch + seq) * self.seq_stride
    }

    /// Index of a granule slot; `slot · granule` is its offset in the reservation.
    pub fn slot(&self, buffer: usize, seq: usize, granule: usize) -> usize {
        (buffer * self.layout.max_batch + seq) * self.granules_per_seq + granule
    }

    /// The layer whose K or V buffer holds `slot`.
    pub fn layer_of(&self, slot: usize) -> usize {
        slot / (self.layout.max_batch * self.granules_per_seq) / 2
    }

    /// Granules that hold any byte of the first `tokens` tokens of a row.
    pub fn granules_for(&self, tokens: usize) -> usize {
        (tokens * self.token_bytes).div_ceil(self.granule)
    }

    /// Every slot count: `buffers · max_batch · granules_per_seq`.
    pub fn slots(&self) -> usize {
        self.buffers * self.layout.max_batch * self.granules_per_seq
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const MIB2: usize = 2 << 20;

    #[test]
    fn tokens_per_granule_of_the_planned_models() {
        let llama8b = KvLayout {
            layers: 32,
            max_batch: 8,
            max_len: 8192,
            kv_heads: 8,
            head_dim: 128,
            dtype_bytes: 2,
        };
        assert_eq!(llama8b.token_bytes(), 2048);
        assert_eq!(llama8b.tokens_per_granule(MIB2), 1024);
        let small = KvLayout {
            layers: 4,
            kv_heads: 2,
            head_dim: 64,
            ..llama8b
        };
        assert_eq!(small.token_bytes(), 256);
        assert_eq!(small.tokens_per_granule(MIB2), 8192);
        let g = Geometry::new(llama8b, MIB2).unwrap();
        assert_eq!(g.granules_per_seq, 8);
        assert_eq!(g.slots(), 64 * 8 * 8);
        assert_eq!(g.row_offset(1, 0), 8 * 8 * MIB2);
    }

    #[test]
    fn bad_layouts_are_errors() {
        let mut layout = KvLayout {
            layers: 1,
            max_batch: 1,
            max_len: 1,
            kv_heads: 1,
            head_dim: 1,
            dtype_bytes: 2,
        };
        layout.head_dim = 0;
        assert!(Geometry::new(layout, MIB2).is_err());
        layout.head_dim = 1 << 20;
        layout.max_len = 1 << 30;
        assert!(Geometry::new(layout, MIB2).is_err());
    }
}
