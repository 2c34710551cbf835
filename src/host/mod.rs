//! Host memory for offloaded bytes: where they go ([`HostStorage`]), the pinned [`HostArena`],
//! and the copies to and from the device. [`Dataset::offload`](crate::Dataset::offload) /
//! [`restore`](crate::Dataset::restore), [`Region::sleep`](crate::region::Region::sleep) /
//! [`wake`](crate::region::Region::wake) and [`Space::sleep`](crate::Space::sleep) /
//! [`wake`](crate::Space::wake) handle binding, release and identity on top of this.
//!
//! | storage | how the bytes move | host cost | use when |
//! | --- | --- | --- | --- |
//! | [`HostStorage::Pinned`] arena, dataset fits | one async copy per range, PCIe speed (50–55 GB/s each way on the H100 host) | the arena, pinned once | the fast path: size the arena for what sleeps |
//! | arena, dataset does not fit | 64 MiB chunks through two staging regions of the arena: the GPU copies one chunk while up to 16 host threads copy the previous one to or from pageable memory | pageable memory of the dataset's size | datasets larger than the arena |
//! | [`HostStorage::Pageable`] | the same chunked path through the process's own staging buffer (2 × 64 MiB, pinned on the first pageable transfer, kept for the process) | pageable memory, and 128 MiB pinned once per process | no arena |
//! | [`HostStorage::Discard`] | nothing copied | none | data you can regenerate (weights on disk): restore leaves memory uninitialised or calls the dataset's refill |
//!
//! Why pageable memory is staged by us: handed pageable memory, the driver copies through a
//! small pinned buffer of its own on one thread. Measured on the H100 host that ran at 1.4–1.7
//! GB/s out (every offload writes freshly allocated pages, each faulted and zeroed on first
//! touch) and 8–10 GB/s back, against a target of 10 GB/s each way. Staged, the faults and
//! copies are spread over several threads and overlap the PCIe copy of the next chunk, and the
//! receiving buffer asks for transparent huge pages (one fault per 2 MiB): measured on the H100
//! host, 17–18 GB/s out and 27–31 GB/s back at 1 and 8 GiB. A second pageable
//! transfer running while another holds the process staging buffer copies directly (the old
//! speed) rather than wait. `benches/offload.rs` prints the GB/s of every path against a raw
//! pinned copy (the floor) and whether each reaches the target.
//!
//! Restore: a dataset keeps its home address range reserved while offloaded, so a restore
//! creates memory (`cuMemCreate`), maps it and grants access, then copies. A dataset is one
//! physical allocation by design (a bind is one mapping), so the creation cannot be split and
//! overlapped with the copy; the bench prints what each driver call of a restore costs
//! (`cuMemCreate`, `cuMemMap`, `cuMemSetAccess`, the copy) right after an offload and after the
//! device has settled, since memory released by the offload is scrubbed by the driver in the
//! background. Measured on the H100: create + map + set-access take 0.3 ms of a 22 ms restore of
//! 1 GiB; restore reaches 0.95–0.98× the raw pinned copy once the device has settled and 0.88×
//! right after an offload, when the copy itself runs slower.

mod arena;
pub(crate) mod copy;
mod parallel;
mod staging;
mod storage;

pub use arena::HostArena;
pub(crate) use copy::{HostCopy, Piece};
pub(crate) use storage::timed;
pub use storage::{HostStorage, StorageUsed, TransferReport};
