//! Sharing physical memory between processes: POSIX file descriptors exported from and imported
//! into CUDA, and passed over Unix sockets with SCM_RIGHTS.

use std::io::{IoSlice, IoSliceMut};
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd, RawFd};
use std::os::unix::net::UnixStream;
use std::sync::Arc;

use cudarc::driver::{sys, CudaContext};
use nix::sys::socket::{recvmsg, sendmsg, ControlMessage, ControlMessageOwned, MsgFlags};

use super::vmm::Physical;
use super::{bind_context, traced_raw};
use crate::error::{Error, Result, ShareError};

const POSIX_FD: sys::CUmemAllocationHandleType =
    sys::CUmemAllocationHandleType::CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR;

impl Physical {
    /// A new file descriptor referring to this memory (`cuMemExportToShareableHandle`). The memory
    /// must have been created shareable. The descriptor is owned: it is closed exactly once, on
    /// drop.
    pub(crate) fn export(&self) -> Result<OwnedFd> {
        if !self.shareable() {
            return Err(Error::Share(ShareError::NotShareable));
        }
        bind_context(self.context())?;
        let mut fd: i32 = -1;
        let handle = self.handle();
        traced_raw("cuMemExportToShareableHandle", self.bytes(), || {
            // SAFETY: for POSIX fds the driver writes an `int` through the pointer.
            unsafe {
                sys::cuMemExportToShareableHandle((&mut fd as *mut i32).cast(), handle, POSIX_FD, 0)
            }
        })?;
        // SAFETY: the driver just created this descriptor for us and nothing else owns it.
        Ok(unsafe { OwnedFd::from_raw_fd(fd) })
    }

    /// Memory of `bytes` imported from a descriptor another process exported
    /// (`cuMemImportFromShareableHandle`). The descriptor stays the caller's (close it when done:
    /// the imported handle keeps the memory alive by itself).
    pub(crate) fn import(ctx: &Arc<CudaContext>, fd: &OwnedFd, bytes: usize) -> Result<Self> {
        bind_context(ctx)?;
        let mut handle: sys::CUmemGenericAllocationHandle = 0;
        let raw = fd.as_raw_fd();
        traced_raw("cuMemImportFromShareableHandle", bytes, || {
            // SAFETY: for POSIX fds the driver takes the descriptor's value cast to a pointer and
            // does not take ownership of it; `handle` is a valid out-pointer.
            unsafe {
                sys::cuMemImportFromShareableHandle(&mut handle, raw as usize as *mut _, POSIX_FD)
            }
        })?;
        Ok(Physical::from_imported(ctx, handle, bytes))
    }
}

fn io_error(call: &'static str, errno: nix::errno::Errno) -> Error {
    Error::Io {
        call,
        source: std::io::Error::from_raw_os_error(errno as i32),
    }
}

/// Sends `bytes` and, if given, one descriptor in the same `sendmsg`.
pub(crate) fn send_with_fd(socket: &UnixStream, bytes: &[u8], fd: Option<&OwnedFd>) -> Result<()> {
    let raw: Vec<RawFd> = fd.iter().map(|f| f.as_raw_fd()).collect();
    let control = [ControlMessage::ScmRights(&raw)];
    let cmsgs: &[ControlMessage] = if raw.is_empty() { &[] } else { &control };
    let mut sent = 0;
    while sent < bytes.len() {
        let iov = [IoSlice::new(&bytes[sent..])];
        // The descriptor goes with the first chunk only.
        let cm = if sent == 0 { cmsgs } else { &[] };
        sent += sendmsg::<()>(socket.as_raw_fd(), &iov, cm, MsgFlags::MSG_NOSIGNAL, None)
            .map_err(|e| io_error("sendmsg", e))?;
    }
    Ok(())
}

/// The most descriptors Linux passes with one message (`SCM_MAX_FD`). Receiving with room for
/// that many means the kernel never truncates them: with less room it delivers some, sets
/// `MSG_CTRUNC`, and nix then refuses to list even the delivered ones, which would leak them.
const MAX_FDS_PER_MESSAGE: usize = 253;

/// Receives up to `buffer.len()` bytes and any descriptors sent with them (taking ownership, so
/// each is closed exactly once, however many came). Returns the byte count (0 = the peer closed
/// the socket).
pub(crate) fn receive_with_fds(
    socket: &UnixStream,
    buffer: &mut [u8],
) -> Result<(usize, Vec<OwnedFd>)> {
    let mut space = nix::cmsg_space!([RawFd; MAX_FDS_PER_MESSAGE]);
    let mut iov = [IoSliceMut::new(buffer)];
    let flags = MsgFlags::MSG_CMSG_CLOEXEC;
    let message = match recvmsg::<()>(socket.as_raw_fd(), &mut iov, Some(&mut space), flags) {
        Ok(message) => message,
        // A peer that exits with our last message unread resets the connection: for the
        // protocol that is the end of the stream, as a plain close would be.
        Err(nix::errno::Errno::ECONNRESET) => return Ok((0, Vec::new())),
        Err(e) => return Err(io_error("recvmsg", e)),
    };
    let cmsgs = match message.cmsgs() {
        Ok(cmsgs) => cmsgs,
        // Truncated control data (cannot happen with room for SCM_MAX_FD descriptors).
        Err(nix::errno::Errno::ENOBUFS) => {
            return Err(Error::Share(ShareError::Protocol(
                crate::error::ProtocolError::UnexpectedFds {
                    count: MAX_FDS_PER_MESSAGE + 1,
                },
            )))
        }
        Err(e) => return Err(io_error("recvmsg", e)),
    };
    let mut fds = Vec::new();
    for cmsg in cmsgs {
        if let ControlMessageOwned::ScmRights(received) = cmsg {
            // SAFETY: SCM_RIGHTS gave this process new descriptors that nothing else owns.
            fds.extend(
                received
                    .into_iter()
                    .map(|fd| unsafe { OwnedFd::from_raw_fd(fd) }),
            );
        }
    }
    Ok((message.bytes, fds))
}
