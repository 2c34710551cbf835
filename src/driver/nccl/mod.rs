//! NCCL communicators wrapped as owned values, over libnccl opened at run time ([`library`],
//! found where users have it: [`locate`]).
//!
//! A communicator is not tied to a stream: it enqueues on any stream (so it can live in a
//! captured graph's work) and serialises calls with a lock, which is what NCCL asks of a
//! communicator used from several threads.

mod library;
mod locate;

use std::sync::{Arc, Mutex};

use cudarc::driver::{sys, CudaContext, CudaStream};

use self::library::{nccl, Nccl, NcclResult, UniqueId, NCCL_FLOAT32, NCCL_SUM};
use super::bind_context;
use crate::error::{DriverError, Error, LayoutError, Result};

/// Runs one NCCL call inside a tracing span and maps a failure to
/// [`DriverError::Nccl`](crate::error::DriverError::Nccl).
fn nccl_call(call: &'static str, f: impl FnOnce(&Nccl) -> NcclResult) -> Result<()> {
    let lib = nccl()?;
    let span = tracing::debug_span!("nccl", call);
    let _entered = span.enter();
    match f(lib) {
        0 => Ok(()),
        code => {
            tracing::debug!(call, code, text = %lib.error_string(code), "failed");
            Err(Error::Driver(DriverError::Nccl { call, code }))
        }
    }
}

/// Where libnccl was loaded from and its version (`ncclGetVersion`, e.g. 22705), loading it if
/// needed; [`DriverError::LibraryMissing`](crate::error::DriverError::LibraryMissing) lists the
/// places tried.
pub(crate) fn library() -> Result<(String, i32)> {
    nccl().map(|lib| (lib.origin.clone(), lib.version))
}

/// A new unique id for rank 0 to hand to the other ranks (`ncclGetUniqueId`).
pub(crate) fn unique_id() -> Result<[u8; 128]> {
    let mut id = UniqueId { internal: [0; 128] };
    nccl_call("ncclGetUniqueId", |lib| {
        // SAFETY: valid out-pointer to a 128-byte id.
        unsafe { (lib.get_unique_id)(&mut id) }
    })?;
    Ok(id.internal.map(|c| c as u8))
}

#[derive(Debug)]
struct Handle(library::Comm);

// SAFETY: an NCCL communicator may be used from any thread as long as calls on it are not
// concurrent; every call goes through the `Mutex` around this handle.
unsafe impl Send for Handle {}

/// One rank's communicator. Destroyed when the last clone and registration are gone.
#[derive(Debug)]
pub(crate) struct Communicator {
    ctx: Arc<CudaContext>,
    handle: Mutex<Handle>,
    rank: usize,
    world: usize,
}

impl Communicator {
    /// Joins the communicator of `world` ranks named by `id` as `rank`, on `ctx`'s device
    /// (`ncclCommInitRank`; blocks until every rank has joined).
    pub(crate) fn new(
        ctx: &Arc<CudaContext>,
        rank: usize,
        world: usize,
        id: [u8; 128],
    ) -> Result<Self> {
        if world == 0 || rank >= world {
            return Err(Error::Layout(LayoutError::InvalidShape(format!(
                "rank {rank} of a world of {world}"
            ))));
        }
        bind_context(ctx)?;
        let id = UniqueId {
            internal: id.map(|b| b as std::ffi::c_char),
        };
        let mut comm: library::Comm = std::ptr::null_mut();
        nccl_call("ncclCommInitRank", |lib| {
            // SAFETY: `comm` is a valid out-pointer; rank and world were checked above.
            unsafe { (lib.comm_init_rank)(&mut comm, world as i32, id, rank as i32) }
        })?;
        Ok(Self {
            ctx: ctx.clone(),
            handle: Mutex::new(Handle(comm)),
            rank,
            world,
        })
    }

    pub(crate) fn rank(&self) -> usize {
        self.rank
    }

    pub(crate) fn world(&self) -> usize {
        self.world
    }

    /// Enqueues an in-place sum all-reduce of `count` f32 at `ptr` on `stream`. The caller
    /// checked that the range holds `count` floats and stays mapped until the stream is done.
    pub(crate) fn all_reduce_sum_f32(
        &self,
        stream: &CudaStream,
        ptr: sys::CUdeviceptr,
        count: usize,
    ) -> Result<()> {
        let handle = self.handle.lock().unwrap_or_else(|p| p.into_inner());
        nccl_call("ncclAllReduce", |lib| {
            // SAFETY: in place on a checked, mapped range; the stream belongs to this device.
            unsafe {
                (lib.all_reduce)(
                    ptr as *const _,
                    ptr as *mut _,
                    count,
                    NCCL_FLOAT32,
                    NCCL_SUM,
                    handle.0,
                    stream.cu_stream() as *mut _,
                )
            }
        })
    }

    /// Registers `[ptr, ptr + bytes)` with the communicator (`ncclCommRegister`); the returned
    /// handle deregisters it.
    pub(crate) fn register(
        self: &Arc<Self>,
        ptr: sys::CUdeviceptr,
        bytes: usize,
    ) -> Result<Registration> {
        let handle = self.handle.lock().unwrap_or_else(|p| p.into_inner());
        let mut registered: *mut ::core::ffi::c_void = std::ptr::null_mut();
        nccl_call("ncclCommRegister", |lib| {
            // SAFETY: a mapped range the caller keeps mapped while registered; valid out-pointer.
            unsafe { (lib.comm_register)(handle.0, ptr as *mut _, bytes, &mut registered) }
        })?;
        Ok(Registration {
            comm: self.clone(),
            handle: registered as usize,
            ptr,
        })
    }
}

impl Drop for Communicator {
    fn drop(&mut self) {
        let handle = self.handle.get_mut().unwrap_or_else(|p| p.into_inner());
        let destroyed = bind_context(&self.ctx).and_then(|()| {
            nccl_call("ncclCommDestroy", |lib| {
                // SAFETY: the communicator is live and destroyed once, here, with no clone left.
                unsafe { (lib.comm_destroy)(handle.0) }
            })
        });
        if let Err(error) = destroyed {
            tracing::error!(%error, rank = self.rank, "destroying an NCCL communicator failed");
        }
    }
}

/// A registered buffer; deregistered on drop.
#[derive(Debug)]
pub(crate) struct Registration {
    comm: Arc<Communicator>,
    handle: usize,
    ptr: sys::CUdeviceptr,
}

impl Drop for Registration {
    fn drop(&mut self) {
        let handle = self.comm.handle.lock().unwrap_or_else(|p| p.into_inner());
        let deregistered = nccl_call("ncclCommDeregister", |lib| {
            // SAFETY: the handle came from ncclCommRegister on this communicator, dropped once.
            unsafe { (lib.comm_deregister)(handle.0, self.handle as *mut _) }
        });
        if let Err(error) = deregistered {
            tracing::error!(%error, ptr = self.ptr, "deregistering an NCCL buffer failed");
        }
    }
}
