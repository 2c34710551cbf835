//! The crate's errors: one enum per area, each wrapped by [`Error`], so `?` converts them.
//!
//! Match on the area, then on the variant: `Err(Error::Graph(GraphError::Unbound { group }))`.
//! [`Error::is_out_of_memory`] answers the most common question across areas.

use cudarc::driver::sys::CUresult;

/// Everything that can go wrong in stablebuf, by area. Variants carry the numbers a caller
/// needs to act.
///
/// After any error the object it came from is unchanged: a failed bind leaves the previous
/// dataset bound, a failed layout build creates nothing, and so on.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum Error {
    /// A driver, device or library call failed, or a device cannot do what was asked.
    #[error(transparent)]
    Driver(#[from] DriverError),

    /// A layout, slot, shape or buffer size is wrong: bad input, caught on the host before any GPU
    /// work.
    #[error(transparent)]
    Layout(#[from] LayoutError),

    /// A capture or replay is refused: bindings changed during a capture, or a replay would read
    /// unbound or released memory.
    #[error(transparent)]
    Graph(#[from] GraphError),

    /// Moving bytes to the host and back (offload, restore, sleep, wake) failed; the data stays
    /// where it was.
    #[error(transparent)]
    Offload(#[from] OffloadError),

    /// The elastic pool refused a request: memory, budget or address capacity, or its tenant is
    /// gone.
    #[error(transparent)]
    Pool(#[from] PoolError),

    /// A tagged region refused an operation: it is asleep, the address is not its, or a weight set
    /// does not fit it.
    #[error(transparent)]
    Region(#[from] RegionError),

    /// Sharing with another process failed: the wire protocol, the peer's answer, or what it
    /// offered.
    #[error(transparent)]
    Share(#[from] ShareError),

    /// A KV cache ([`KvCache`](crate::kv::KvCache)) refused an operation: a sequence slot or
    /// length out of range, a write past a sequence's length, or the cache is asleep.
    #[error(transparent)]
    Kv(#[from] KvError),

    /// An operating-system call failed: a socket call, or writing a timeline file.
    #[error("{call}: {source}")]
    Io {
        /// The call, e.g. `"sendmsg"`, `"recvmsg"` or `"write"`.
        call: &'static str,
        /// The operating system's error.
        source: std::io::Error,
    },
}

/// Shorthand used throughout the crate.
pub type Result<T, E = Error> = std::result::Result<T, E>;

impl Error {
    /// Whether this error means the device ran out of memory: the driver's, or the pool's
    /// after draining its cache.
    pub fn is_out_of_memory(&self) -> bool {
        matches!(
            self,
            Error::Driver(DriverError::OutOfMemory { .. })
                | Error::Pool(PoolError::PoolOutOfMemory { .. })
        )
    }
}

/// An error of a cudarc call made by user code inside a capture or launch.
impl From<cudarc::driver::DriverError> for Error {
    fn from(error: cudarc::driver::DriverError) -> Self {
        Error::Driver(DriverError::Cudarc(error))
    }
}

/// A malformed or unexpected message from a peer process.
impl From<ProtocolError> for Error {
    fn from(error: ProtocolError) -> Self {
        Error::Share(ShareError::Protocol(error))
    }
}

/// A driver, device or library call failed, or a device cannot do what was asked.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum DriverError {
    /// A CUDA driver call failed. `call` is the driver function's name.
    #[error("{call} failed with {result:?} ({bytes} bytes)")]
    Failed {
        /// The driver function, e.g. `"cuMemMap"`.
        call: &'static str,
        /// The code the driver returned.
        result: CUresult,
        /// Bytes the call concerned (the size mapped, copied or allocated); 0 where it has none.
        bytes: usize,
    },

    /// The driver could not provide physical memory.
    #[error("{call}: out of device memory asking for {bytes} bytes")]
    OutOfMemory {
        /// The driver function that ran out, e.g. `"cuMemCreate"`.
        call: &'static str,
        /// Bytes it was asked for.
        bytes: usize,
    },

    /// A cuBLAS call failed. `call` is the cuBLAS function's name.
    #[error("{call} failed with {status:?}")]
    Cublas {
        /// The cuBLAS function, e.g. `"cublasSgemm_v2"`.
        call: &'static str,
        /// The status cuBLAS returned.
        status: cudarc::cublas::sys::cublasStatus_t,
    },

    /// An NCCL call failed. `code` is its `ncclResult_t`.
    #[error("{call} failed with NCCL result {code}")]
    Nccl {
        /// The NCCL function, e.g. `"ncclAllReduce"`.
        call: &'static str,
        /// The `ncclResult_t` it returned (0 is success; 1..=7 are NCCL's error kinds).
        code: i32,
    },

    /// A library stablebuf loads at run time was found nowhere it looked.
    #[error(
        "{library} could not be loaded; tried: {searched}. Install it (e.g. pip install \
         nvidia-nccl-cu13 in the active Python environment), put its folder on LD_LIBRARY_PATH, \
         or name the file in STABLEBUF_NCCL_LIBRARY"
    )]
    LibraryMissing {
        /// The library's name, e.g. `"libnccl"`.
        library: &'static str,
        /// Every candidate tried, with why it failed, in order.
        searched: String,
    },

    /// No CUDA driver (libcuda) could be loaded on this machine.
    #[error("no CUDA driver found: libcuda could not be loaded")]
    NoDriver,

    /// A device ordinal past the devices this process sees.
    #[error("device {ordinal} does not exist ({count} CUDA devices)")]
    NoSuchDevice {
        /// The ordinal asked for.
        ordinal: usize,
        /// How many devices this process sees (ordinals `0..count`).
        count: usize,
    },

    /// Kernels on device `from` cannot reach memory on device `to` (`cuDeviceCanAccessPeer`).
    #[error("device {from} cannot access memory on device {to}")]
    PeerAccess {
        /// Ordinal of the device whose kernels would read or write.
        from: usize,
        /// Ordinal of the device that holds the memory.
        to: usize,
    },

    /// A dataset or buffer belongs to another CUDA context (device).
    #[error("object belongs to CUDA device {found}, expected device {expected}")]
    ContextMismatch {
        /// Ordinal of the device of the space (or pool) that was asked.
        expected: usize,
        /// Ordinal of the device the object belongs to.
        found: usize,
    },

    /// An error from a cudarc call made by user code inside a capture or launch.
    #[error("cudarc: {0}")]
    Cudarc(#[from] cudarc::driver::DriverError),
}

/// A layout, slot, shape or buffer size is wrong: bad input, caught on the host before any GPU
/// work.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum LayoutError {
    /// A slot was declared with zero bytes.
    #[error("slot `{slot}` has zero size")]
    ZeroSizeSlot {
        /// The slot's name.
        slot: String,
    },

    /// Two slots share a name.
    #[error("slot `{slot}` is declared twice")]
    DuplicateSlot {
        /// The name declared twice.
        slot: String,
    },

    /// A layout with no slots.
    #[error("a layout needs at least one slot")]
    EmptyLayout,

    /// An empty slot or group name.
    #[error("slot and group names must not be empty")]
    EmptyName,

    /// The named slot is not in this layout (or not in this dataset's group).
    #[error("unknown slot `{slot}`")]
    UnknownSlot {
        /// The name that was asked for.
        slot: String,
    },

    /// The named group is not in this layout, or holds only scratch slots.
    #[error("unknown slot group `{group}`")]
    UnknownGroup {
        /// The name that was asked for.
        group: String,
    },

    /// The slot is scratch: it lives in the space's resident backing, not in datasets.
    #[error("slot `{slot}` is scratch and belongs to no dataset")]
    ScratchSlot {
        /// The scratch slot's name.
        slot: String,
    },

    /// A dataset made for one layout was offered to a space of another.
    #[error("dataset of group `{group}` was made for layout {dataset_layout:016x}, this space has layout {space_layout:016x}")]
    LayoutMismatch {
        /// The dataset's group.
        group: String,
        /// Fingerprint of the layout the dataset was made for
        /// ([`Layout::fingerprint`](crate::Layout::fingerprint)).
        dataset_layout: u64,
        /// Fingerprint of the space's layout.
        space_layout: u64,
    },

    /// Host data whose size does not match the slot.
    #[error("slot `{slot}` holds {slot_bytes} bytes, host data has {host_bytes}")]
    HostLength {
        /// The slot's name.
        slot: String,
        /// Bytes the slot holds.
        slot_bytes: usize,
        /// Bytes of the host data given.
        host_bytes: usize,
    },

    /// The slot's byte size is not a whole number of elements of the requested type.
    #[error("slot `{slot}` ({bytes} bytes) is not a whole number of {elem_bytes}-byte elements")]
    ElementSize {
        /// The slot's name.
        slot: String,
        /// The slot's size in bytes.
        bytes: usize,
        /// `size_of` the element type asked for.
        elem_bytes: usize,
    },

    /// A kernel helper was given buffers too small for the shape asked for.
    #[error("{what}: needs {needed} bytes, buffer has {available}")]
    BufferTooSmall {
        /// Which operand of which operation, e.g. `"matmul a"`.
        what: &'static str,
        /// Bytes the shape asked for needs (offset included).
        needed: usize,
        /// Bytes the buffer has ([`DeviceBuffer::byte_len`](crate::DeviceBuffer::byte_len)).
        available: usize,
    },

    /// A dimension that must be positive and fit the kernel's `int` arguments does not. The
    /// text names the dimension and its value.
    #[error("invalid shape: {0}")]
    InvalidShape(String),
}

/// A capture or replay is refused: bindings changed during a capture, or a replay would read
/// unbound or released memory.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum GraphError {
    /// The space's scratch memory is released (the space is asleep): wake it first.
    #[error("the space is asleep: its scratch memory is released")]
    Asleep,

    /// A graph would run on a device the space does not grant access to its addresses (see
    /// `SpaceOptions::peers`): its kernels would fault, so the capture is refused.
    #[error("device {device} has no access to the space's addresses (granted: {granted:?}); add it with SpaceOptions::peers")]
    NotGranted {
        /// Ordinal of the device the graph would run on.
        device: usize,
        /// The devices the space grants access to.
        granted: Vec<usize>,
    },

    /// Binding, unbinding or dropping backing while a stream capture is in progress would
    /// invalidate the capture (and the driver forbids it in global capture mode); a weight-set
    /// copy ([`Region::load`](crate::region::Region::load), a copy switch) would be recorded
    /// into the graph.
    #[error("cannot change bindings while a stream capture is in progress")]
    BindDuringCapture,

    /// A replay (or slot access) needs the group's dataset bound, and it is not.
    #[error("slot group `{group}` has no dataset bound")]
    Unbound {
        /// The group with nothing bound (for a region, its tag).
        group: String,
    },

    /// A capture produced no graph (the stream captured nothing).
    #[error("the capture recorded no work")]
    EmptyCapture,

    /// A capture was started on a stream that is already capturing.
    #[error("the stream is already capturing")]
    AlreadyCapturing,
}

/// Moving bytes to the host and back (offload, restore, sleep, wake) failed; the data stays where
/// it was.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum OffloadError {
    /// Host memory for an offload could not be allocated; the dataset stays on the device.
    #[error("could not allocate {bytes} bytes of host memory")]
    HostOutOfMemory {
        /// Bytes of host memory that were asked for.
        bytes: usize,
    },

    /// The dataset is offloaded: restore it before binding, viewing or copying it.
    #[error("dataset {dataset} is offloaded to the host")]
    Offloaded {
        /// The dataset's id ([`Dataset::id`](crate::Dataset::id)).
        dataset: u64,
    },

    /// A restore found too little device memory; the host copy is kept and a later retry works.
    #[error("restoring dataset {dataset} needs {asked} bytes of device memory, {free} are free")]
    RestoreOutOfMemory {
        /// The id of the dataset (or region) being restored.
        dataset: u64,
        /// Bytes of device memory the restore needs.
        asked: usize,
        /// Bytes free on the device when it was refused (`cuMemGetInfo`; 0 if that failed too).
        free: usize,
    },
}

/// The elastic pool refused a request: memory, budget or address capacity, or its tenant is gone.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum PoolError {
    /// The pool could not get physical memory even after draining its cache (`drained` bytes
    /// released). `cached` and `held` are the pool's figures when the request came.
    #[error("pool out of device memory: asked {asked} bytes with {held} held and {cached} cached; drained {drained}, the driver still refused")]
    PoolOutOfMemory {
        /// Bytes the request asked for.
        asked: usize,
        /// Bytes the pool had cached (unmapped, kept for reuse) when the request came.
        cached: usize,
        /// Bytes of physical memory mapped into the pool's blocks when the request came.
        held: usize,
        /// Bytes of cache released before the retry.
        drained: usize,
    },

    /// A request would exceed the pool's physical budget or a tenant's own limit, even after
    /// releasing the cache. Nothing was allocated.
    #[error("over budget ({scope}): asked {asked} bytes, limit {limit}, {held} already held")]
    OverBudget {
        /// Which limit: `"pool budget"` or `` "tenant `name`'s limit" ``.
        scope: String,
        /// Bytes the request asked for.
        asked: usize,
        /// The limit, in bytes.
        limit: usize,
        /// Bytes already mapped under that limit (the tenant's blocks, or every tenant's for the
        /// pool budget).
        held: usize,
    },

    /// A tenant's virtual address capacity has no free run long enough for the request.
    #[error("tenant `{tenant}`: no {asked}-byte range free in its {capacity}-byte reservation (largest free run {largest_free_run})")]
    VirtualCapacity {
        /// The tenant's (or region's) name.
        tenant: String,
        /// Bytes of addresses the request needs (granule-rounded).
        asked: usize,
        /// Bytes of addresses the tenant reserved.
        capacity: usize,
        /// The longest free stretch of its reservation, in bytes.
        largest_free_run: usize,
    },

    /// A block was asked to grow past the virtual capacity it reserved.
    #[error("cannot grow a block to {asked} bytes: it reserved {capacity}")]
    BeyondCapacity {
        /// The length asked for, in bytes.
        asked: usize,
        /// The block's reserved capacity, in bytes.
        capacity: usize,
    },

    /// The block's tenant was unregistered: its memory is gone.
    #[error("tenant `{tenant}` was unregistered; its blocks hold no memory")]
    TenantGone {
        /// The tenant's name.
        tenant: String,
    },

    /// Rendering the timeline picture failed; the text is the renderer's (or the file's) error.
    #[error("rendering the timeline: {0}")]
    Timeline(String),
}

/// A tagged region refused an operation: it is asleep, the address is not its, or a weight set does
/// not fit it.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum RegionError {
    /// The region is asleep: its physical memory is released. Wake it first.
    #[error("region `{tag}` is asleep: wake it first")]
    RegionAsleep {
        /// The region's tag.
        tag: String,
    },

    /// No allocation of the region starts at this address.
    #[error("no allocation starts at {address:#x}")]
    UnknownAllocation {
        /// The device address that was given.
        address: u64,
    },

    /// A snapshot cannot be bound into this region.
    #[error("region `{tag}`: {reason}")]
    SnapshotMismatch {
        /// The tag of the region asked to bind it.
        tag: String,
        /// What differs (another region, another span, ...), in words.
        reason: String,
    },
}

/// A KV cache refused an operation. Nothing changed: the cache is as it was before the call.
#[derive(Debug, thiserror::Error, PartialEq, Eq)]
#[non_exhaustive]
pub enum KvError {
    /// A sequence slot past the cache's `max_batch`.
    #[error("sequence {seq} does not exist (max_batch {max_batch})")]
    NoSuchSequence {
        /// The slot asked for.
        seq: usize,
        /// Slots the cache has (`0..max_batch`).
        max_batch: usize,
    },

    /// A length past the cache's `max_len`.
    #[error("sequence {seq}: {asked} tokens asked, the cache holds at most {max_len}")]
    BeyondMaxLen {
        /// The sequence.
        seq: usize,
        /// Tokens asked for.
        asked: usize,
        /// Tokens per sequence the cache reserved.
        max_len: usize,
    },

    /// A write to tokens `[first, end)` of a sequence reaches past its length: those tokens are
    /// not backed (or read-only zeros); grow the sequence first.
    #[error("sequence {seq}: write to tokens {first}..{end} past its length {length}")]
    WritePastLength {
        /// The sequence.
        seq: usize,
        /// First token written.
        first: usize,
        /// One past the last token written.
        end: usize,
        /// The sequence's length.
        length: usize,
    },

    /// A prefix can only be shared into an empty sequence slot (release it first).
    #[error("sequence {seq} holds {length} tokens: share a prefix into an empty slot")]
    NotEmpty {
        /// The target sequence.
        seq: usize,
        /// Its length.
        length: usize,
    },

    /// A shared prefix longer than the source sequence, or a sequence shared with itself.
    #[error("cannot share {tokens} tokens of sequence {from} (length {length}) into {to}")]
    BadPrefix {
        /// The source sequence.
        from: usize,
        /// The target sequence.
        to: usize,
        /// Tokens asked for.
        tokens: usize,
        /// The source's length.
        length: usize,
    },

    /// The cache is asleep: its physical memory is released. Wake it first.
    #[error("the KV cache is asleep: wake it first")]
    Asleep,

    /// One call names a sequence twice (to grow and to release, or to grow twice).
    #[error("sequence {seq} named twice in one change")]
    NamedTwice {
        /// The sequence.
        seq: usize,
    },

    /// A change behind a step needs every layer's mark, and no step recorded this one:
    /// call `mark_layer_done` in the decode step after the layer's attention.
    #[error("layer {layer} was never marked done by a step: record its mark after the layer's attention")]
    LayerNotMarked {
        /// The layer.
        layer: usize,
    },

    /// The thread that remaps gated layers behind the step could not start, or stopped
    /// before a remap it was handed (its layers are remapped by the next call instead).
    #[error("the KV cache's remap worker could not run a remap behind the step")]
    WorkerStopped,
}

/// Sharing with another process failed: the wire protocol, the peer's answer, or what it offered.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum ShareError {
    /// A message from a peer process was malformed or unexpected.
    #[error("protocol: {0}")]
    Protocol(#[from] ProtocolError),

    /// The peer refused what was sent, saying why.
    #[error("the peer rejected the dataset: {reason}")]
    Rejected {
        /// The peer's reason, as it sent it.
        reason: String,
    },

    /// Export asked of memory not created shareable
    /// ([`SpaceOptions::shareable`](crate::SpaceOptions::shareable)).
    #[error("the dataset was not created shareable")]
    NotShareable,

    /// A dataset offered by another process lives on another GPU.
    #[error("the dataset is on another device (uuid {found:02x?}, this one {expected:02x?})")]
    DeviceMismatch {
        /// The UUID of this process's device.
        expected: [u8; 16],
        /// The UUID of the device the dataset lives on.
        found: [u8; 16],
    },

    /// A published weight set does not match what the importing process expects; `what` names
    /// the first field that differs (`"layout fingerprint"`, `"bytes"`, `"tag"`). Nothing was
    /// imported.
    #[error("the offered weight set differs in its {what}: expected {expected}, offered {found}")]
    OfferMismatch {
        /// The field that differs.
        what: &'static str,
        /// What this process expected, as text.
        expected: String,
        /// What the peer offered, as text.
        found: String,
    },
}

/// What is wrong with a message.
#[derive(Debug, thiserror::Error, PartialEq, Eq)]
#[non_exhaustive]
pub enum ProtocolError {
    /// The message (or the stream, mid-message) ended before a part it announces.
    #[error("message truncated: needed {needed} bytes, got {got}")]
    Truncated {
        /// Bytes needed to the end of the part being read.
        needed: usize,
        /// Bytes that arrived.
        got: usize,
    },
    /// The first bytes are not stablebuf's magic: the peer speaks something else.
    #[error("not a stablebuf message (bad magic)")]
    BadMagic,
    /// The peer speaks another version of the protocol.
    #[error("protocol version {got}, this build speaks {supported}")]
    Version {
        /// The peer's version.
        got: u16,
        /// [`PROTOCOL_VERSION`](crate::share::PROTOCOL_VERSION) of this build.
        supported: u16,
    },
    /// The message kind byte names no known message (the value is that byte).
    #[error("unknown message kind {0}")]
    UnknownKind(u8),
    /// Bytes follow the message's last field (the value: how many).
    #[error("{extra} bytes follow the message's last field")]
    TrailingBytes {
        /// Bytes after the last field.
        extra: usize,
    },
    /// A string field is longer than the protocol allows.
    #[error("a string field of {bytes} bytes is over the limit")]
    StringTooLong {
        /// The announced length of the string.
        bytes: usize,
    },
    /// A string field (a group name, a reason) is not valid UTF-8.
    #[error("a string field is not UTF-8")]
    BadUtf8,
    /// The announced length (the value, in bytes) exceeds
    /// [`MAX_MESSAGE`](crate::share::MAX_MESSAGE).
    #[error("message of {0} bytes is over the limit")]
    TooLarge(usize),
    /// An offer came without the file descriptor of its memory.
    #[error("an offer arrived without its file descriptor")]
    MissingFd,
    /// More descriptors came than a message carries (they are closed, not leaked).
    #[error("{count} file descriptors arrived where at most one was expected")]
    UnexpectedFds {
        /// How many arrived.
        count: usize,
    },
    /// The peer closed the connection where a new message should have begun.
    #[error("the peer closed the connection")]
    Closed,
    /// A valid message of the wrong kind for this point of the exchange.
    #[error("expected {expected}, got another message")]
    Unexpected {
        /// The kind that was expected, e.g. `"an ack"`.
        expected: &'static str,
    },
}
