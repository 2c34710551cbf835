//! Copy elision: the state machine, pure (no CUDA), so every rule is tested on the CPU.
//!
//! The pattern it catches is the resize idiom of programs that cannot grow memory in place:
//!
//! ```text
//!   b = cudaMalloc(3 GiB)              b is *fresh*: nothing touched it since its malloc
//!   cudaMemcpy(b, a, 1.5 GiB, D2D)     the whole of a, into the start of b: DEFERRED
//!   cudaFree(a)                        a's memory moves under b (Block::graft): no copy at all
//! ```
//!
//! Rules (what [`Elider::on_copy`] checks, in order):
//! - the copy is device to device (`cudaMemcpyDeviceToDevice` or `cudaMemcpyDefault`) and its
//!   stream is not capturing;
//! - the layer is sure it sees every call that may touch memory (no library with its own CUDA
//!   runtime loaded, no unwrapped driver function handed out);
//! - source and destination are pool allocations of the layer (untagged), on one device, and
//!   not the same one;
//! - the copy reads the **whole** source (from its start, exactly its size as asked) and writes
//!   the **start** of a destination at least as large;
//! - it is at least the configured minimum (below ~100 MiB a copy costs less than a remap);
//! - neither allocation is part of another deferred copy;
//! - the destination is **fresh**: allocated since the last flush point (no launch, copy,
//!   memset, synchronize, event or graph launch of any thread has run since its malloc).
//!
//! Then the copy is remembered instead of enqueued. What happens next decides its fate:
//! - the source is freed ([`Elider::on_free`] → [`FreeDecision::Graft`]): its physical memory
//!   is moved under the destination. Nothing can have read the destination or written the
//!   source in between (either would have been a flush point), so the result is the same bytes
//!   the copy would have produced;
//! - the destination is freed first ([`FreeDecision::Cancel`]): nobody can ever read what the
//!   copy wrote, so it is dropped;
//! - anything else first — any flush point, any copy that is not itself deferred
//!   ([`Elider::take_all`]): the copy is performed then, on its original stream.

use std::collections::HashMap;

/// A copy that was deferred. `stream` is the caller's stream handle as a number (0: the legacy
/// default stream); `sync` says it came from `cudaMemcpy` rather than `cudaMemcpyAsync`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct PendingCopy {
    pub dst: u64,
    pub src: u64,
    pub bytes: usize,
    pub stream: u64,
    pub device: usize,
    pub sync: bool,
}

/// A pool allocation a copy touches: its start, size as asked, and device.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Alloc {
    pub start: u64,
    pub bytes: usize,
    pub device: usize,
}

/// A `cudaMemcpy`/`cudaMemcpyAsync` as the state machine sees it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct CopyRequest {
    pub dst: u64,
    pub src: u64,
    pub bytes: usize,
    pub stream: u64,
    pub sync: bool,
    /// `cudaMemcpyDeviceToDevice` or `cudaMemcpyDefault`.
    pub device_to_device: bool,
    pub capturing: bool,
    /// The layer cannot see everything that may touch memory (a library with its own CUDA
    /// runtime is loaded, or an unwrapped driver function was handed out): never defer.
    pub unsure: bool,
    /// The pool allocations containing `dst` and `src`, if they are the layer's.
    pub dst_alloc: Option<Alloc>,
    pub src_alloc: Option<Alloc>,
}

/// Why a copy was not deferred (it is performed now, after every pending copy).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Reason {
    NotDeviceToDevice,
    Unsure,
    Capturing,
    NotPool,
    CrossDevice,
    SameAllocation,
    NotWholeSource,
    NotDestinationStart,
    DestinationTooSmall,
    TooSmall,
    Busy,
    DestinationNotFresh,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum CopyDecision {
    /// Remembered; the caller returns success without copying.
    Defer,
    /// Not deferrable: perform every pending copy, then this one.
    Perform(Reason),
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum FreeDecision {
    /// No deferred copy involves the allocation: free it.
    Plain,
    /// The allocation is the source of this deferred copy: move its memory under the
    /// destination instead of freeing it.
    Graft(PendingCopy),
    /// The allocation is the destination of this deferred copy: drop the copy, free it.
    Cancel(PendingCopy),
}

/// The state: fresh allocations (with the epoch of their malloc) and deferred copies.
///
/// The epoch is a counter the caller bumps at every flush point; an allocation is fresh while
/// the epoch has not moved since it was made. Keeping it outside lets the hot path (a kernel
/// launch) bump an atomic without taking any lock.
#[derive(Debug)]
pub struct Elider {
    min_bytes: usize,
    fresh: HashMap<u64, u64>,
    pending: Vec<PendingCopy>,
}

impl Elider {
    pub fn new(min_bytes: usize) -> Self {
        Self {
            min_bytes,
            fresh: HashMap::new(),
            pending: Vec::new(),
        }
    }

    /// A pool allocation was made at `start` during `epoch`.
    pub fn on_alloc(&mut self, start: u64, epoch: u64) {
        self.fresh.insert(start, epoch);
    }

    /// Decides about a copy. On [`CopyDecision::Defer`] the copy is recorded; on
    /// [`CopyDecision::Perform`] nothing changed and the caller flushes ([`Elider::take_all`])
    /// before performing the copy.
    pub fn on_copy(&mut self, copy: &CopyRequest, epoch: u64) -> CopyDecision {
        match self.check(copy, epoch) {
            Err(reason) => CopyDecision::Perform(reason),
            Ok(device) => {
                self.fresh.remove(&copy.dst);
                self.pending.push(PendingCopy {
                    dst: copy.dst,
                    src: copy.src,
                    bytes: copy.bytes,
                    stream: copy.stream,
                    device,
                    sync: copy.sync,
                });
                CopyDecision::Defer
            }
        }
    }

    fn check(&self, copy: &CopyRequest, epoch: u64) -> Result<usize, Reason> {
        if !copy.device_to_device {
            return Err(Reason::NotDeviceToDevice);
        }
        if copy.unsure {
            return Err(Reason::Unsure);
        }
        if copy.capturing {
            return Err(Reason::Capturing);
        }
        let (Some(dst), Some(src)) = (copy.dst_alloc, copy.src_alloc) else {
            return Err(Reason::NotPool);
        };
        if dst.device != src.device {
            return Err(Reason::CrossDevice);
        }
        if dst.start == src.start {
            return Err(Reason::SameAllocation);
        }
        if copy.src != src.start || copy.bytes != src.bytes {
            return Err(Reason::NotWholeSource);
        }
        if copy.dst != dst.start {
            return Err(Reason::NotDestinationStart);
        }
        if dst.bytes < copy.bytes {
            return Err(Reason::DestinationTooSmall);
        }
        if copy.bytes < self.min_bytes.max(1) {
            return Err(Reason::TooSmall);
        }
        let involved = |p: &PendingCopy| {
            [p.dst, p.src].contains(&dst.start) || [p.dst, p.src].contains(&src.start)
        };
        if self.pending.iter().any(involved) {
            return Err(Reason::Busy);
        }
        if self.fresh.get(&dst.start) != Some(&epoch) {
            return Err(Reason::DestinationNotFresh);
        }
        Ok(dst.device)
    }

    /// The allocation at `start` is being freed.
    pub fn on_free(&mut self, start: u64) -> FreeDecision {
        self.fresh.remove(&start);
        if let Some(index) = self.pending.iter().position(|p| p.src == start) {
            return FreeDecision::Graft(self.pending.remove(index));
        }
        if let Some(index) = self.pending.iter().position(|p| p.dst == start) {
            return FreeDecision::Cancel(self.pending.remove(index));
        }
        FreeDecision::Plain
    }

    /// Every deferred copy, oldest first, to be performed now (a flush point was reached).
    pub fn take_all(&mut self) -> Vec<PendingCopy> {
        std::mem::take(&mut self.pending)
    }

    pub fn pending(&self) -> usize {
        self.pending.len()
    }

    /// Whether the allocation at `start` is fresh at `epoch`.
    pub fn is_fresh(&self, start: u64, epoch: u64) -> bool {
        self.fresh.get(&start) == Some(&epoch)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const GIB: usize = 1 << 30;
    const A: u64 = 0x7f00_0000_0000;
    const B: u64 = 0x7f10_0000_0000;

    fn alloc(start: u64, bytes: usize) -> Option<Alloc> {
        Some(Alloc {
            start,
            bytes,
            device: 0,
        })
    }

    /// The resize idiom: copy all of `a` (1.5 GiB) into the start of `b` (3 GiB).
    fn resize_copy() -> CopyRequest {
        CopyRequest {
            dst: B,
            src: A,
            bytes: 3 * GIB / 2,
            stream: 0,
            sync: true,
            device_to_device: true,
            capturing: false,
            unsure: false,
            dst_alloc: alloc(B, 3 * GIB),
            src_alloc: alloc(A, 3 * GIB / 2),
        }
    }

    fn elider_with_fresh_b(epoch: u64) -> Elider {
        let mut elider = Elider::new(64 << 20);
        elider.on_alloc(A, epoch);
        elider.on_alloc(B, epoch);
        elider
    }

    #[test]
    fn the_resize_idiom_is_deferred_then_grafted() {
        let mut elider = elider_with_fresh_b(7);
        assert_eq!(elider.on_copy(&resize_copy(), 7), CopyDecision::Defer);
        assert_eq!(elider.pending(), 1);
        assert!(!elider.is_fresh(B, 7), "b is now the target of a copy");
        match elider.on_free(A) {
            FreeDecision::Graft(copy) => {
                assert_eq!((copy.dst, copy.src, copy.bytes), (B, A, 3 * GIB / 2));
                assert!(copy.sync);
            }
            other => panic!("expected a graft, got {other:?}"),
        }
        assert_eq!(elider.pending(), 0);
        assert_eq!(elider.on_free(B), FreeDecision::Plain);
    }

    #[test]
    fn a_flush_point_first_performs_the_copy() {
        let mut elider = elider_with_fresh_b(1);
        assert_eq!(elider.on_copy(&resize_copy(), 1), CopyDecision::Defer);
        let flushed = elider.take_all();
        assert_eq!(flushed.len(), 1);
        assert_eq!(flushed[0].dst, B);
        assert_eq!(
            elider.on_free(A),
            FreeDecision::Plain,
            "already performed: a plain free"
        );
    }

    #[test]
    fn freeing_the_destination_first_cancels_the_copy() {
        let mut elider = elider_with_fresh_b(1);
        elider.on_copy(&resize_copy(), 1);
        assert!(matches!(elider.on_free(B), FreeDecision::Cancel(c) if c.src == A));
        assert_eq!(elider.pending(), 0);
        assert_eq!(elider.on_free(A), FreeDecision::Plain);
    }

    #[test]
    fn a_destination_touched_since_its_malloc_is_not_fresh() {
        // The epoch moved (a launch, memset, sync... happened) after b was allocated.
        let mut elider = elider_with_fresh_b(1);
        assert_eq!(
            elider.on_copy(&resize_copy(), 2),
            CopyDecision::Perform(Reason::DestinationNotFresh)
        );
        assert_eq!(elider.pending(), 0, "nothing recorded");
        // Never allocated through the pool at all.
        let mut unknown = Elider::new(0);
        assert_eq!(
            unknown.on_copy(&resize_copy(), 0),
            CopyDecision::Perform(Reason::DestinationNotFresh)
        );
    }

    #[test]
    fn only_whole_sources_into_destination_starts() {
        let mut elider = elider_with_fresh_b(0);
        let mut partial = resize_copy();
        partial.bytes -= 4096;
        assert_eq!(
            elider.on_copy(&partial, 0),
            CopyDecision::Perform(Reason::NotWholeSource)
        );
        let mut offset_source = resize_copy();
        offset_source.src += 4096;
        offset_source.bytes -= 4096;
        assert_eq!(
            elider.on_copy(&offset_source, 0),
            CopyDecision::Perform(Reason::NotWholeSource)
        );
        let mut offset_destination = resize_copy();
        offset_destination.dst += 4096;
        assert_eq!(
            elider.on_copy(&offset_destination, 0),
            CopyDecision::Perform(Reason::NotDestinationStart)
        );
        let mut small_destination = resize_copy();
        small_destination.dst_alloc = alloc(B, GIB);
        assert_eq!(
            elider.on_copy(&small_destination, 0),
            CopyDecision::Perform(Reason::DestinationTooSmall)
        );
        // Equal sizes are fine.
        let mut equal = resize_copy();
        equal.dst_alloc = alloc(B, 3 * GIB / 2);
        assert_eq!(elider.on_copy(&equal, 0), CopyDecision::Defer);
    }

    #[test]
    fn other_kinds_devices_streams_and_sizes_are_performed() {
        let mut elider = elider_with_fresh_b(0);
        let cases = [
            (
                CopyRequest {
                    device_to_device: false,
                    ..resize_copy()
                },
                Reason::NotDeviceToDevice,
            ),
            (
                CopyRequest {
                    capturing: true,
                    ..resize_copy()
                },
                Reason::Capturing,
            ),
            (
                CopyRequest {
                    unsure: true,
                    ..resize_copy()
                },
                Reason::Unsure,
            ),
            (
                CopyRequest {
                    src_alloc: None,
                    ..resize_copy()
                },
                Reason::NotPool,
            ),
            (
                CopyRequest {
                    dst_alloc: Some(Alloc {
                        device: 1,
                        ..alloc(B, 3 * GIB).unwrap()
                    }),
                    ..resize_copy()
                },
                Reason::CrossDevice,
            ),
            (
                CopyRequest {
                    dst: A,
                    dst_alloc: alloc(A, 3 * GIB / 2),
                    ..resize_copy()
                },
                Reason::SameAllocation,
            ),
        ];
        for (copy, reason) in cases {
            assert_eq!(elider.on_copy(&copy, 0), CopyDecision::Perform(reason));
        }
        let mut tiny = Elider::new(64 << 20);
        tiny.on_alloc(B, 0);
        let small = CopyRequest {
            bytes: 1 << 20,
            src_alloc: alloc(A, 1 << 20),
            ..resize_copy()
        };
        assert_eq!(
            tiny.on_copy(&small, 0),
            CopyDecision::Perform(Reason::TooSmall)
        );
        assert_eq!(elider.pending(), 0);
    }

    #[test]
    fn allocations_in_a_pending_copy_are_busy() {
        const C: u64 = 0x7f20_0000_0000;
        let mut elider = elider_with_fresh_b(0);
        elider.on_alloc(C, 0);
        assert_eq!(elider.on_copy(&resize_copy(), 0), CopyDecision::Defer);
        // Chained resize b -> c before a is freed: b is the target of a pending copy.
        let chained = CopyRequest {
            dst: C,
            src: B,
            bytes: 3 * GIB,
            dst_alloc: alloc(C, 6 * GIB),
            src_alloc: alloc(B, 3 * GIB),
            ..resize_copy()
        };
        assert_eq!(
            elider.on_copy(&chained, 0),
            CopyDecision::Perform(Reason::Busy)
        );
        // A second, independent resize may be pending at the same time.
        const D: u64 = 0x7f30_0000_0000;
        let independent = CopyRequest {
            dst: C,
            src: D,
            bytes: GIB,
            dst_alloc: alloc(C, 2 * GIB),
            src_alloc: alloc(D, GIB),
            ..resize_copy()
        };
        assert_eq!(elider.on_copy(&independent, 0), CopyDecision::Defer);
        let flushed = elider.take_all();
        assert_eq!(
            flushed.iter().map(|c| c.dst).collect::<Vec<_>>(),
            vec![B, C],
            "oldest first"
        );
    }
}
