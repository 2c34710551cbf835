//! The one error type of the crate.

use cudarc::driver::{sys::CUresult, DriverError};

/// Everything that can go wrong in stablebuf. Variants carry the numbers a caller needs to act.
///
/// After any error the object it came from is unchanged: a failed bind leaves the previous
/// dataset bound, a failed layout build creates nothing, and so on.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum Error {
    /// A CUDA driver call failed. `call` is the driver function's name.
    #[error("{call} failed with {result:?} ({bytes} bytes)")]
    Driver {
        call: &'static str,
        result: CUresult,
        bytes: usize,
    },

    /// The driver could not provide physical memory.
    #[error("{call}: out of device memory asking for {bytes} bytes")]
    OutOfMemory { call: &'static str, bytes: usize },

    /// A cuBLAS call failed. `call` is the cuBLAS function's name.
    #[error("{call} failed with {status:?}")]
    Cublas {
        call: &'static str,
        status: cudarc::cublas::sys::cublasStatus_t,
    },

    /// Host memory for an offload could not be allocated; the dataset stays on the device.
    #[error("could not allocate {bytes} bytes of host memory")]
    HostOutOfMemory { bytes: usize },

    /// The dataset is offloaded: restore it before binding, viewing or copying it.
    #[error("dataset {dataset} is offloaded to the host")]
    Offloaded { dataset: u64 },

    /// A restore found too little device memory; the host copy is kept and a later retry works.
    #[error("restoring dataset {dataset} needs {asked} bytes of device memory, {free} are free")]
    RestoreOutOfMemory {
        dataset: u64,
        asked: usize,
        free: usize,
    },

    /// The space's scratch memory is released (the space is asleep): wake it first.
    #[error("the space is asleep: its scratch memory is released")]
    Asleep,

    /// The region is asleep: its physical memory is released. Wake it first.
    #[error("region `{tag}` is asleep: wake it first")]
    RegionAsleep { tag: String },

    /// No allocation of the region starts at this address.
    #[error("no allocation starts at {address:#x}")]
    UnknownAllocation { address: u64 },

    /// A snapshot cannot be bound into this region.
    #[error("region `{tag}`: {reason}")]
    SnapshotMismatch { tag: String, reason: String },

    /// A socket call failed.
    #[error("{call}: {source}")]
    Io {
        call: &'static str,
        source: std::io::Error,
    },

    /// A message from a peer process was malformed or unexpected.
    #[error("protocol: {0}")]
    Protocol(#[from] ProtocolError),

    /// The peer refused what was sent, saying why.
    #[error("the peer rejected the dataset: {reason}")]
    Rejected { reason: String },

    /// Export asked of memory not created shareable (`SpaceOptions::shareable`).
    #[error("the dataset was not created shareable")]
    NotShareable,

    /// A dataset offered by another process lives on another GPU.
    #[error("the dataset is on another device (uuid {found:02x?}, this one {expected:02x?})")]
    DeviceMismatch { expected: [u8; 16], found: [u8; 16] },

    /// No CUDA driver (libcuda) could be loaded on this machine.
    #[error("no CUDA driver found: libcuda could not be loaded")]
    NoDriver,

    /// A slot was declared with zero bytes.
    #[error("slot `{slot}` has zero size")]
    ZeroSizeSlot { slot: String },

    /// Two slots share a name.
    #[error("slot `{slot}` is declared twice")]
    DuplicateSlot { slot: String },

    /// A layout with no slots.
    #[error("a layout needs at least one slot")]
    EmptyLayout,

    /// An empty slot or group name.
    #[error("slot and group names must not be empty")]
    EmptyName,

    /// The named slot is not in this layout (or not in this dataset's group).
    #[error("unknown slot `{slot}`")]
    UnknownSlot { slot: String },

    /// The named group is not in this layout, or holds only scratch slots.
    #[error("unknown slot group `{group}`")]
    UnknownGroup { group: String },

    /// The slot is scratch: it lives in the space's resident backing, not in datasets.
    #[error("slot `{slot}` is scratch and belongs to no dataset")]
    ScratchSlot { slot: String },

    /// A dataset made for one layout was offered to a space of another.
    #[error("dataset of group `{group}` was made for layout {dataset_layout:016x}, this space has layout {space_layout:016x}")]
    LayoutMismatch {
        group: String,
        dataset_layout: u64,
        space_layout: u64,
    },

    /// A dataset or buffer belongs to another CUDA context (device).
    #[error("object belongs to CUDA device {found}, expected device {expected}")]
    ContextMismatch { expected: usize, found: usize },

    /// Host data whose size does not match the slot.
    #[error("slot `{slot}` holds {slot_bytes} bytes, host data has {host_bytes}")]
    HostLength {
        slot: String,
        slot_bytes: usize,
        host_bytes: usize,
    },

    /// The slot's byte size is not a whole number of elements of the requested type.
    #[error("slot `{slot}` ({bytes} bytes) is not a whole number of {elem_bytes}-byte elements")]
    ElementSize {
        slot: String,
        bytes: usize,
        elem_bytes: usize,
    },

    /// Binding, unbinding or dropping backing while a stream capture is in progress would
    /// invalidate the capture (and the driver forbids it in global capture mode).
    #[error("cannot change bindings while a stream capture is in progress")]
    BindDuringCapture,

    /// A replay (or slot access) needs the group's dataset bound, and it is not.
    #[error("slot group `{group}` has no dataset bound")]
    Unbound { group: String },

    /// A kernel helper was given buffers too small for the shape asked for.
    #[error("{what}: needs {needed} bytes, buffer has {available}")]
    BufferTooSmall {
        what: &'static str,
        needed: usize,
        available: usize,
    },

    /// A dimension that must be positive and fit the kernel's `int` arguments does not.
    #[error("invalid shape: {0}")]
    InvalidShape(String),

    /// A capture produced no graph (the stream captured nothing).
    #[error("the capture recorded no work")]
    EmptyCapture,

    /// A capture was started on a stream that is already capturing.
    #[error("the stream is already capturing")]
    AlreadyCapturing,

    /// The pool could not get physical memory even after draining its cache (`drained` bytes
    /// released). `cached` and `held` are the pool's figures when the request came.
    #[error("pool out of device memory: asked {asked} bytes with {held} held and {cached} cached; drained {drained}, the driver still refused")]
    PoolOutOfMemory {
        asked: usize,
        cached: usize,
        held: usize,
        drained: usize,
    },

    /// A request would exceed the pool's physical budget or a tenant's own limit, even after
    /// releasing the cache. Nothing was allocated.
    #[error("over budget ({scope}): asked {asked} bytes, limit {limit}, {held} already held")]
    OverBudget {
        scope: String,
        asked: usize,
        limit: usize,
        held: usize,
    },

    /// A tenant's virtual address capacity has no free run long enough for the request.
    #[error("tenant `{tenant}`: no {asked}-byte range free in its {capacity}-byte reservation (largest free run {largest_free_run})")]
    VirtualCapacity {
        tenant: String,
        asked: usize,
        capacity: usize,
        largest_free_run: usize,
    },

    /// A block was asked to grow past the virtual capacity it reserved.
    #[error("cannot grow a block to {asked} bytes: it reserved {capacity}")]
    BeyondCapacity { asked: usize, capacity: usize },

    /// The block's tenant was unregistered: its memory is gone.
    #[error("tenant `{tenant}` was unregistered; its blocks hold no memory")]
    TenantGone { tenant: String },

    /// Rendering the timeline picture failed.
    #[error("rendering the timeline: {0}")]
    Timeline(String),

    /// An error from a cudarc call made by user code inside a capture or launch.
    #[error("cudarc: {0}")]
    Cudarc(#[from] DriverError),
}

/// Shorthand used throughout the crate.
pub type Result<T, E = Error> = std::result::Result<T, E>;

impl Error {
    /// Whether this error means the device ran out of memory.
    pub fn is_out_of_memory(&self) -> bool {
        matches!(
            self,
            Error::OutOfMemory { .. } | Error::PoolOutOfMemory { .. }
        )
    }
}

/// What is wrong with a message.
#[derive(Debug, thiserror::Error, PartialEq, Eq)]
#[non_exhaustive]
pub enum ProtocolError {
    #[error("message truncated: needed {needed} bytes, got {got}")]
    Truncated { needed: usize, got: usize },
    #[error("not a stablebuf message (bad magic)")]
    BadMagic,
    #[error("protocol version {got}, this build speaks {supported}")]
    Version { got: u16, supported: u16 },
    #[error("unknown message kind {0}")]
    UnknownKind(u8),
    #[error("{extra} bytes follow the message's last field")]
    TrailingBytes { extra: usize },
    #[error("a string field of {bytes} bytes is over the limit")]
    StringTooLong { bytes: usize },
    #[error("a string field is not UTF-8")]
    BadUtf8,
    #[error("message of {0} bytes is over the limit")]
    TooLarge(usize),
    #[error("an offer arrived without its file descriptor")]
    MissingFd,
    #[error("{count} file descriptors arrived where at most one was expected")]
    UnexpectedFds { count: usize },
    #[error("the peer closed the connection")]
    Closed,
    #[error("expected {expected}, got another message")]
    Unexpected { expected: &'static str },
}
