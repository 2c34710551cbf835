//! NCCL collectives over stable buffers (feature `nccl`; libnccl is loaded at run time).
//!
//! One process per GPU, as NCCL is usually run. Each rank's space holds the send and receive
//! buffers as slots, so an all-reduce captured into the rank's graph keeps its addresses across
//! rebinds of the input datasets:
//!
//! ```text
//!   rank r:  x (dataset, rebound each step) ─ matmul ─▶ y (slot) ─ all-reduce(sum) ─▶ y
//!            one StableGraph per rank, captured once, replayed on every weight set
//! ```
//!
//! Buffer registration (`ncclCommRegister`, [`Collective::register`]) records the physical pages
//! behind a range. A rebind puts other pages under a slot's addresses, so a registration of a
//! slot whose group is rebound must be redone after the bind (drop the old one, register
//! again); slots in scratch or in groups that are not rebound keep theirs. This ordering is what
//! torch_memory_saver's users hit as stale registrations after a remap (#88).

use std::sync::Arc;

use cudarc::driver::{CudaContext, CudaStream};

use crate::buffer::{require_range, DeviceBuffer};
use crate::driver::nccl::{self, Communicator, Registration};
use crate::error::{Error, Result};

/// The id rank 0 creates and every rank joins with (128 bytes; send it to the other processes,
/// e.g. as [`CollectiveId::to_hex`] in an environment variable).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct CollectiveId(pub [u8; 128]);

impl CollectiveId {
    /// A new id (`ncclGetUniqueId`). Only rank 0 makes one.
    pub fn new() -> Result<Self> {
        nccl::unique_id().map(Self)
    }

    /// Lower-case hex, 256 characters.
    pub fn to_hex(&self) -> String {
        self.0.iter().map(|b| format!("{b:02x}")).collect()
    }

    /// Parses [`CollectiveId::to_hex`]'s output.
    pub fn from_hex(hex: &str) -> Result<Self> {
        let bad = || Error::InvalidShape(format!("not a 256-digit hex collective id: {hex:?}"));
        if hex.len() != 256 || !hex.is_ascii() {
            return Err(bad());
        }
        let mut id = [0u8; 128];
        for (i, byte) in id.iter_mut().enumerate() {
            *byte = u8::from_str_radix(&hex[2 * i..2 * i + 2], 16).map_err(|_| bad())?;
        }
        Ok(Self(id))
    }
}

/// One rank of an NCCL communicator. Cheap to clone; the communicator is destroyed with the
/// last clone.
#[derive(Clone, Debug)]
pub struct Collective {
    comm: Arc<Communicator>,
}

/// A buffer registered with a communicator; deregistered on drop.
#[derive(Debug)]
pub struct Registered {
    _registration: Registration,
}

impl Collective {
    /// Joins the communicator `id` as `rank` of `world`, on `ctx`'s device. Blocks until every
    /// rank has joined. [`Error::LibraryMissing`] when libnccl is not on the loader's path.
    pub fn join(
        ctx: &Arc<CudaContext>,
        rank: usize,
        world: usize,
        id: CollectiveId,
    ) -> Result<Self> {
        Ok(Self {
            comm: Arc::new(Communicator::new(ctx, rank, world, id.0)?),
        })
    }

    /// This process's rank.
    pub fn rank(&self) -> usize {
        self.comm.rank()
    }

    /// How many ranks the communicator has.
    pub fn world(&self) -> usize {
        self.comm.world()
    }

    /// Enqueues an in-place sum all-reduce of the f32 elements of `buffer` on `stream`; it can
    /// be captured into a graph (then every rank must replay its graph).
    pub fn all_reduce_sum(
        &self,
        stream: &Arc<CudaStream>,
        buffer: &impl DeviceBuffer,
    ) -> Result<()> {
        let count = buffer.byte_len() / std::mem::size_of::<f32>();
        require_range("all-reduce buffer", buffer.byte_len(), 0, count * 4)?;
        if count == 0 {
            return Err(Error::BufferTooSmall {
                what: "all-reduce buffer",
                needed: 4,
                available: buffer.byte_len(),
            });
        }
        self.comm
            .all_reduce_sum_f32(stream, buffer.device_address(), count)
    }

    /// Registers `buffer` with the communicator (`ncclCommRegister`), which lets NCCL skip
    /// staging copies on some transports. See the module docs for registrations and rebinds.
    pub fn register(&self, buffer: &impl DeviceBuffer) -> Result<Registered> {
        Ok(Registered {
            _registration: self
                .comm
                .register(buffer.device_address(), buffer.byte_len())?,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::CollectiveId;

    #[test]
    fn ids_round_trip_through_hex_and_bad_text_is_refused() {
        let mut raw = [0u8; 128];
        raw.iter_mut()
            .enumerate()
            .for_each(|(i, b)| *b = (i * 37) as u8);
        let id = CollectiveId(raw);
        assert_eq!(CollectiveId::from_hex(&id.to_hex()).unwrap(), id);
        assert!(CollectiveId::from_hex("abc").is_err());
        assert!(CollectiveId::from_hex(&"zz".repeat(128)).is_err());
    }
}
