//! Host-side copies between pinned staging memory and pageable memory, on several threads.
//!
//! One thread copies pageable memory at a few GB/s, and much less into freshly allocated pages,
//! each of which faults (and is zeroed by the kernel) on first touch. Split over threads, the
//! faults and copies run side by side and the staged path keeps up with PCIe.

use std::num::NonZeroUsize;
use std::thread;

/// At most this many threads copy at once: beyond it, memory bandwidth, not the thread count,
/// bounds a copy (page faults on fresh memory scale further than copies do).
pub(crate) const MAX_THREADS: usize = 16;
/// A thread gets at least this many bytes; smaller copies use fewer threads.
const MIN_BYTES_PER_THREAD: usize = 4 << 20;
/// Threads' shares are cut at multiples of this, so no huge page is faulted by two threads.
const SHARE_ALIGN: usize = 2 << 20;

/// Threads used for host copies: the machine's parallelism, at most [`MAX_THREADS`].
pub(crate) fn threads() -> usize {
    thread::available_parallelism()
        .map_or(1, NonZeroUsize::get)
        .clamp(1, MAX_THREADS)
}

/// Performs every copy `(target, source)` (equal lengths, disjoint targets), spread over up to
/// `threads` threads by bytes; the calling thread takes the first share. Returns when all are
/// done.
pub(crate) fn copy_all(jobs: Vec<(&mut [u8], &[u8])>, threads: usize) {
    let total: usize = jobs.iter().map(|(target, _)| target.len()).sum();
    let threads = threads.min(total / MIN_BYTES_PER_THREAD).max(1);
    let shares = split(jobs, total.div_ceil(threads).next_multiple_of(SHARE_ALIGN));
    let mut shares = shares.into_iter();
    let Some(mine) = shares.next() else {
        return;
    };
    thread::scope(|scope| {
        for share in shares {
            scope.spawn(move || run(share));
        }
        run(mine);
    });
}

/// Writes one byte of every page of `buffer` (a zeroed buffer stays zeroed), spread over up to
/// `threads` threads, so the kernel faults its pages in side by side rather than one by one
/// inside a later single-threaded call (pinning, or the first copy into it).
pub(crate) fn fault_in(buffer: &mut [u8], threads: usize) {
    const PAGE: usize = 4096;
    if buffer.is_empty() {
        return;
    }
    let threads = threads.min(buffer.len() / MIN_BYTES_PER_THREAD).max(1);
    let share = buffer.len().div_ceil(threads).next_multiple_of(SHARE_ALIGN);
    thread::scope(|scope| {
        for part in buffer.chunks_mut(share) {
            scope.spawn(move || {
                for page in part.chunks_mut(PAGE) {
                    touch(&mut page[0]);
                }
            });
        }
    });
}

/// Stores the byte's own value back, so the page is written (faulted in) but keeps its contents;
/// `black_box` keeps the compiler from dropping the store.
fn touch(byte: &mut u8) {
    *byte = std::hint::black_box(*byte);
}

fn run(share: Vec<(&mut [u8], &[u8])>) {
    for (target, source) in share {
        target.copy_from_slice(source);
    }
}

/// Cuts `jobs` into consecutive shares of `share` bytes (the last one shorter), splitting jobs
/// where a share ends.
fn split<'a>(
    jobs: Vec<(&'a mut [u8], &'a [u8])>,
    share: usize,
) -> Vec<Vec<(&'a mut [u8], &'a [u8])>> {
    let share = share.max(1);
    let mut shares = Vec::new();
    let mut current = Vec::new();
    let mut filled = 0;
    for (mut target, mut source) in jobs {
        assert_eq!(target.len(), source.len(), "a copy between unequal ranges");
        while !target.is_empty() {
            let take = (share - filled).min(target.len());
            let (head, tail) = std::mem::take(&mut target).split_at_mut(take);
            let (from, rest) = source.split_at(take);
            current.push((head, from));
            (target, source) = (tail, rest);
            filled += take;
            if filled == share {
                shares.push(std::mem::take(&mut current));
                filled = 0;
            }
        }
    }
    if !current.is_empty() {
        shares.push(current);
    }
    shares
}

/// The disjoint parts `[start, start + len)` of `buffer`, in the order given; `None` unless the
/// ranges are sorted, do not overlap and lie inside the buffer.
pub(crate) fn carve(
    buffer: &mut [u8],
    ranges: impl IntoIterator<Item = (usize, usize)>,
) -> Option<Vec<&mut [u8]>> {
    let mut parts = Vec::new();
    let mut rest = buffer;
    let mut consumed = 0;
    for (start, len) in ranges {
        let skip = start.checked_sub(consumed)?;
        if skip.checked_add(len)? > rest.len() {
            return None;
        }
        let (_, tail) = std::mem::take(&mut rest).split_at_mut(skip);
        let (part, tail) = tail.split_at_mut(len);
        parts.push(part);
        rest = tail;
        consumed = start + len;
    }
    Some(parts)
}

#[cfg(test)]
mod tests {

    #[test]
    fn faulting_in_keeps_every_byte() {
        let mut buffer: Vec<u8> = (0..(9 << 20) + 17).map(|i| (i % 251) as u8).collect();
        let before = buffer.clone();
        for threads in [1, 3, 16] {
            fault_in(&mut buffer, threads);
            assert_eq!(buffer, before, "{threads} threads");
        }
        fault_in(&mut [], 4);
    }

    use super::*;

    fn pattern(len: usize, seed: u8) -> Vec<u8> {
        (0..len)
            .map(|i| (i as u8).wrapping_mul(31) ^ seed)
            .collect()
    }

    #[test]
    fn every_byte_of_every_job_is_copied_once_whatever_the_thread_count() {
        let sources = [
            pattern(9 << 20, 1),
            pattern(5, 2),
            pattern(3 << 20, 3),
            pattern(0, 4),
        ];
        for threads in [1, 2, 3, 8] {
            let mut targets: Vec<Vec<u8>> = sources.iter().map(|s| vec![0; s.len()]).collect();
            let jobs = targets
                .iter_mut()
                .zip(&sources)
                .map(|(t, s)| (t.as_mut_slice(), s.as_slice()))
                .collect();
            copy_all(jobs, threads);
            assert_eq!(targets, sources, "{threads} threads");
        }
    }

    #[test]
    fn shares_are_cut_at_the_share_size_across_jobs() {
        let (mut a, mut b) = (vec![0u8; 10], vec![0u8; 7]);
        let (x, y) = (vec![1u8; 10], vec![2u8; 7]);
        let shares = split(vec![(&mut a[..], &x[..]), (&mut b[..], &y[..])], 6);
        let lengths: Vec<Vec<usize>> = shares
            .iter()
            .map(|s| s.iter().map(|(t, _)| t.len()).collect())
            .collect();
        assert_eq!(lengths, [vec![6], vec![4, 2], vec![5]]);
    }

    #[test]
    fn carving_gives_the_asked_ranges_and_refuses_bad_ones() {
        let mut buffer: Vec<u8> = (0..20).collect();
        let parts = carve(&mut buffer, [(2, 3), (5, 0), (10, 4)]).unwrap();
        let got: Vec<Vec<u8>> = parts.iter().map(|p| p.to_vec()).collect();
        assert_eq!(got, [vec![2, 3, 4], vec![], vec![10, 11, 12, 13]]);
        assert!(carve(&mut buffer, [(4, 2), (3, 1)]).is_none(), "unsorted");
        assert!(
            carve(&mut buffer, [(4, 2), (5, 1)]).is_none(),
            "overlapping"
        );
        assert!(carve(&mut buffer, [(18, 3)]).is_none(), "past the end");
        assert!(carve(&mut buffer, [(usize::MAX, 2)]).is_none(), "overflow");
    }
}
