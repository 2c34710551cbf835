//! NCCL communicators (cudarc's `nccl` feature, loaded at run time) wrapped as owned values.
//!
//! cudarc's own `Comm` is tied to one stream and is not `Send`, so it cannot live in a captured
//! graph's work; this wrapper enqueues on any stream and serialises calls with a lock, which is
//! what NCCL asks of a communicator used from several threads.

use std::sync::{Arc, Mutex};

use cudarc::driver::{sys, CudaContext, CudaStream};
use cudarc::nccl::{result, sys as nccl};

use super::bind_context;
use crate::error::{Error, Result};

fn nccl_call<T>(
    call: &'static str,
    f: impl FnOnce() -> std::result::Result<T, result::NcclError>,
) -> Result<T> {
    let span = tracing::debug_span!("nccl", call);
    let _entered = span.enter();
    f().map_err(|result::NcclError(code)| Error::Nccl {
        call,
        code: code as i32,
    })
}

/// Whether libnccl can be loaded here.
pub(crate) fn nccl_present() -> bool {
    // SAFETY: only tries to open the shared library; no NCCL call is made.
    unsafe { nccl::is_culib_present() }
}

fn require_nccl() -> Result<()> {
    if nccl_present() {
        Ok(())
    } else {
        Err(Error::LibraryMissing { library: "libnccl" })
    }
}

/// A new unique id for rank 0 to hand to the other ranks (`ncclGetUniqueId`).
pub(crate) fn unique_id() -> Result<[u8; 128]> {
    require_nccl()?;
    let id = nccl_call("ncclGetUniqueId", result::get_uniqueid)?;
    Ok(id.internal.map(|c| c as u8))
}

#[derive(Debug)]
struct Handle(nccl::ncclComm_t);

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
        require_nccl()?;
        if world == 0 || rank >= world {
            return Err(Error::InvalidShape(format!(
                "rank {rank} of a world of {world}"
            )));
        }
        bind_context(ctx)?;
        let id = nccl::ncclUniqueId {
            internal: id.map(|b| b as ::core::ffi::c_char),
        };
        let mut comm = std::mem::MaybeUninit::uninit();
        nccl_call("ncclCommInitRank", || {
            // SAFETY: `comm` is a valid out-pointer; rank and world were checked above.
            unsafe { result::comm_init_rank(comm.as_mut_ptr(), world as i32, id, rank as i32) }
        })?;
        // SAFETY: ncclCommInitRank succeeded, so it wrote the communicator.
        let comm = unsafe { comm.assume_init() };
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
        nccl_call("ncclAllReduce", || {
            // SAFETY: in place on a checked, mapped range; the stream belongs to this device.
            unsafe {
                result::all_reduce(
                    ptr as *const _,
                    ptr as *mut _,
                    count,
                    nccl::ncclDataType_t::ncclFloat32,
                    nccl::ncclRedOp_t::ncclSum,
                    handle.0,
                    stream.cu_stream() as nccl::cudaStream_t,
                )
            }
        })
        .map(drop)
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
        nccl_call("ncclCommRegister", || {
            // SAFETY: a mapped range the caller keeps mapped while registered; valid out-pointer.
            unsafe { nccl::ncclCommRegister(handle.0, ptr as *mut _, bytes, &mut registered) }
                .result()
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
            nccl_call("ncclCommDestroy", || {
                // SAFETY: the communicator is live and destroyed once, here, with no clone left.
                unsafe { result::comm_destroy(handle.0) }
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
        let deregistered = nccl_call("ncclCommDeregister", || {
            // SAFETY: the handle came from ncclCommRegister on this communicator, dropped once.
            unsafe { nccl::ncclCommDeregister(handle.0, self.handle as *mut _) }.result()
        });
        if let Err(error) = deregistered {
            tracing::error!(%error, ptr = self.ptr, "deregistering an NCCL buffer failed");
        }
    }
}
