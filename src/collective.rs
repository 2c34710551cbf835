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
//! ## Finding libnccl
//! Looked for, in order: the file (or folder) named by `STABLEBUF_NCCL_LIBRARY`; `libnccl.so.2`
//! and `libnccl.so` on the loader's path (`LD_LIBRARY_PATH`, ldconfig); the `lib/` folder of the
//! pip `nvidia-nccl-cu12`/`-cu13` package of the active Python environment (the one PyTorch
//! uses; the interpreter is `$PYTHON`, `$VIRTUAL_ENV`'s, `$CONDA_PREFIX`'s or `python3`); then
//! `$CUDA_HOME/lib64`. [`DriverError::LibraryMissing`](crate::error::DriverError::LibraryMissing)
//! lists every place tried; [`library`] says which
//! one was used.
//!
//! ## Registrations and rebinds
//! A registration (`ncclCommRegister`) records the physical pages behind a range, not just its
//! addresses. A rebind puts other pages under a slot's addresses, so a registration made with
//! [`Collective::register`] goes stale when the slot's group is rebound (or, for a scratch
//! slot, when the space wakes). [`Collective::register_slot`] does the right thing on its own:
//! the space tells it after every bind of the slot's group (and every wake), under the space's
//! lock, and it deregisters the old pages and registers the new ones before any replay can run.
//! What the two GPUs of our test machine showed is in `tests/gpu_multi.rs` and the README.

use std::sync::{Arc, Mutex};

use cudarc::driver::{sys, CudaContext, CudaStream};

use crate::buffer::{require_range, DeviceBuffer};
use crate::driver::nccl::{self, Communicator, Registration};
use crate::error::{Error, LayoutError, Result};
use crate::space::listeners::RemapListener;
use crate::space::Space;

/// Where libnccl was loaded from and its version number (`ncclGetVersion`, e.g. 22705 for
/// 2.27.5), loading it if needed.
/// [`DriverError::LibraryMissing`](crate::error::DriverError::LibraryMissing) lists every place
/// tried.
pub fn library() -> Result<(String, i32)> {
    nccl::library()
}

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
        let bad = || {
            Error::Layout(LayoutError::InvalidShape(format!(
                "not a 256-digit hex collective id: {hex:?}"
            )))
        };
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
    /// rank has joined. [`DriverError::LibraryMissing`](crate::error::DriverError::LibraryMissing)
    /// when libnccl is not on the loader's path.
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
            return Err(Error::Layout(LayoutError::BufferTooSmall {
                what: "all-reduce buffer",
                needed: 4,
                available: buffer.byte_len(),
            }));
        }
        self.comm
            .all_reduce_sum_f32(stream, buffer.device_address(), count)
    }

    /// Registers `buffer` with the communicator (`ncclCommRegister`), which lets NCCL skip
    /// staging copies on some transports. The registration covers the pages mapped now: for a
    /// slot whose memory a bind or wake replaces, use [`Collective::register_slot`].
    pub fn register(&self, buffer: &impl DeviceBuffer) -> Result<Registered> {
        Ok(Registered {
            _registration: self
                .comm
                .register(buffer.device_address(), buffer.byte_len())?,
        })
    }

    /// Registers slot `name` of `space` and keeps the registration current: after every bind
    /// of the slot's group (for a scratch slot: every wake) the old pages are deregistered and
    /// the new ones registered, before the bind returns. Deregistered on drop.
    pub fn register_slot(&self, space: &Space, name: &str) -> Result<SlotRegistration> {
        let slot = space.slot(name)?;
        let tracked = Arc::new(TrackedRegistration {
            comm: self.comm.clone(),
            ptr: slot.device_ptr(),
            bytes: slot.bytes(),
            state: Mutex::new(TrackedState::default()),
        });
        // Listening first, so a bind racing with this call is not missed; registered now only
        // if memory is there (a bind registers it otherwise).
        let listener: Arc<dyn RemapListener> = tracked.clone();
        space.listen_for_remaps(name, Arc::downgrade(&listener))?;
        if space.slot_has_memory(name)? {
            tracked.refresh()?;
        }
        Ok(SlotRegistration {
            tracked,
            _listener: listener,
        })
    }
}

/// A slot registered with a communicator and re-registered after every remap of its memory
/// ([`Collective::register_slot`]); deregistered on drop.
#[derive(Debug)]
pub struct SlotRegistration {
    tracked: Arc<TrackedRegistration>,
    /// The space holds only a weak reference: dropping this ends the tracking.
    _listener: Arc<dyn RemapListener>,
}

impl SlotRegistration {
    /// Whether the slot's current pages are registered (false after a failed re-registration,
    /// or before the slot's group was first bound). Collectives work either way; NCCL then
    /// takes its unregistered path.
    pub fn is_registered(&self) -> bool {
        self.tracked.lock().registration.is_some()
    }

    /// How many times the registration was made (1 + the remaps it followed).
    pub fn registrations(&self) -> u64 {
        self.tracked.lock().registrations
    }

    /// The last re-registration failure, if the last attempt failed.
    pub fn last_error(&self) -> Option<String> {
        self.tracked.lock().last_error.clone()
    }
}

#[derive(Debug)]
struct TrackedRegistration {
    comm: Arc<Communicator>,
    ptr: sys::CUdeviceptr,
    bytes: usize,
    state: Mutex<TrackedState>,
}

#[derive(Debug, Default)]
struct TrackedState {
    registration: Option<Registration>,
    registrations: u64,
    last_error: Option<String>,
}

impl TrackedRegistration {
    fn lock(&self) -> std::sync::MutexGuard<'_, TrackedState> {
        self.state.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Deregisters the old pages (if any), then registers what is mapped now.
    fn refresh(&self) -> Result<()> {
        let mut state = self.lock();
        drop(state.registration.take());
        match self.comm.register(self.ptr, self.bytes) {
            Ok(registration) => {
                state.registration = Some(registration);
                state.registrations += 1;
                state.last_error = None;
                Ok(())
            }
            Err(error) => {
                state.last_error = Some(error.to_string());
                Err(error)
            }
        }
    }
}

impl RemapListener for TrackedRegistration {
    fn remapped(&self) {
        if let Err(error) = self.refresh() {
            tracing::error!(%error, ptr = self.ptr, "re-registering a slot with NCCL after a remap failed; collectives take the unregistered path");
        }
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
