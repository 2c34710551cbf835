//! Property tests of the release queue against a fake device on the CPU: random sequences of
//! allocations, drops, steps, trims and policy changes, checked after every step against a
//! model (what is held, in which order, what the device has in use), and the background
//! thread's idle hook timed with an activity counter the test moves.

use std::collections::{HashSet, VecDeque};
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use proptest::prelude::*;

use super::{Held, Queue, ReleaseMode, ReleasePolicy};
use crate::error::{DriverError, Error, Result};

const G: usize = 2 << 20;

/// A device with `capacity` bytes: what is created stays in use until released.
#[derive(Debug, Default)]
struct Device {
    capacity: usize,
    used: AtomicUsize,
    next: AtomicU64,
    creates: AtomicU64,
    released: Mutex<Vec<u64>>,
    violations: Mutex<Vec<String>>,
}

impl Device {
    fn create(self: &Arc<Self>, bytes: usize) -> Result<Block> {
        self.creates.fetch_add(1, Ordering::SeqCst);
        let used = self.used.load(Ordering::SeqCst);
        if used + bytes > self.capacity {
            return Err(Error::Driver(DriverError::OutOfMemory {
                call: "cuMemCreate",
                bytes,
            }));
        }
        self.used.fetch_add(bytes, Ordering::SeqCst);
        Ok(Block {
            id: self.next.fetch_add(1, Ordering::SeqCst),
            bytes,
            device: self.clone(),
        })
    }

    fn released(&self) -> Vec<u64> {
        self.released.lock().unwrap().clone()
    }
}

/// A fake allocation, released by the queue (or dropped by the test to say "the owner released
/// it at once").
#[derive(Debug)]
struct Block {
    id: u64,
    bytes: usize,
    device: Arc<Device>,
}

impl Held for Block {
    fn bytes(&self) -> usize {
        self.bytes
    }

    fn release(self) {
        let mut released = self.device.released.lock().unwrap();
        if released.contains(&self.id) {
            self.device
                .violations
                .lock()
                .unwrap()
                .push(format!("block {} released twice", self.id));
        }
        released.push(self.id);
        self.device.used.fetch_sub(self.bytes, Ordering::SeqCst);
    }
}

fn manual() -> ReleasePolicy {
    ReleasePolicy {
        mode: ReleaseMode::Manual,
        ..ReleasePolicy::default()
    }
}

/// A queue whose policy the test switches.
fn queue(policy: Arc<Mutex<ReleasePolicy>>, activity: Arc<AtomicU64>) -> Queue<usize, Block> {
    Queue::new(
        move || *policy.lock().unwrap(),
        move || activity.load(Ordering::SeqCst),
        || {},
    )
}

#[derive(Clone, Debug)]
enum Op {
    Alloc { granules: usize },
    Drop { pick: usize },
    Step { budget_granules: usize },
    Trim,
    Immediate(bool),
}

fn op() -> impl Strategy<Value = Op> {
    prop_oneof![
        6 => prop_oneof![Just(1usize), Just(2), Just(4), Just(8), 1usize..12]
            .prop_map(|granules| Op::Alloc { granules }),
        5 => any::<usize>().prop_map(|pick| Op::Drop { pick }),
        2 => (0usize..10).prop_map(|budget_granules| Op::Step { budget_granules }),
        1 => Just(Op::Trim),
        1 => any::<bool>().prop_map(Op::Immediate),
    ]
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 256, ..ProptestConfig::default() })]

    /// Held memory is never double-released, never released while an owner has it, reused only
    /// for its own size (the newest first), released oldest first in pieces within the budget,
    /// and never makes an allocation fail that releasing at once would have let through.
    #[test]
    fn the_queue_matches_its_model(capacity_granules in 4usize..40, ops in prop::collection::vec(op(), 1..80)) {
        let device = Arc::new(Device { capacity: capacity_granules * G, ..Device::default() });
        let policy = Arc::new(Mutex::new(manual()));
        let queue = queue(policy.clone(), Arc::new(AtomicU64::new(0)));
        let mut live: Vec<Block> = Vec::new();
        // The held blocks, oldest first: (id, bytes).
        let mut held: VecDeque<(u64, usize)> = VecDeque::new();
        for op in ops {
            match op {
                Op::Alloc { granules } => {
                    let bytes = granules * G;
                    let creates = device.creates.load(Ordering::SeqCst);
                    let live_bytes: usize = live.iter().map(|b| b.bytes).sum();
                    let fit = held.iter().rposition(|&(_, b)| b == bytes);
                    let result = queue.acquire(&bytes, bytes, || device.create(bytes));
                    match fit {
                        Some(index) => {
                            let (id, _) = held.remove(index).unwrap();
                            let block = result.expect("a held block of the size is reused");
                            prop_assert_eq!(block.id, id, "the newest held block of the size");
                            prop_assert_eq!(device.creates.load(Ordering::SeqCst), creates);
                            live.push(block);
                        }
                        None => {
                            let possible = live_bytes + bytes <= device.capacity;
                            prop_assert_eq!(result.is_ok(), possible, "held memory made an allocation fail");
                            // Whatever the retries released went oldest first.
                            let released: HashSet<u64> = device.released().into_iter().collect();
                            while held.front().is_some_and(|(id, _)| released.contains(id)) {
                                held.pop_front();
                            }
                            prop_assert!(held.iter().all(|(id, _)| !released.contains(id)));
                            match result {
                                Ok(block) => live.push(block),
                                Err(error) => prop_assert!(error.is_out_of_memory()),
                            }
                        }
                    }
                }
                Op::Drop { pick } => {
                    if live.is_empty() {
                        continue;
                    }
                    let block = live.swap_remove(pick % live.len());
                    let (id, bytes) = (block.id, block.bytes);
                    let immediate = policy.lock().unwrap().mode == ReleaseMode::Immediate;
                    queue.put(bytes, block);
                    if immediate {
                        prop_assert_eq!(device.released().last().copied(), Some(id));
                    } else {
                        held.push_back((id, bytes));
                    }
                }
                Op::Step { budget_granules } => {
                    let budget = budget_granules * G;
                    let before = device.released().len();
                    let bytes = queue.step(budget);
                    let now = device.released();
                    let piece = &now[before..];
                    let first = held.front().map_or(0, |&(_, b)| b);
                    prop_assert!(bytes <= budget.max(first), "a piece over its budget");
                    prop_assert_eq!(held.is_empty(), piece.is_empty(), "a step releases when memory is held");
                    for id in piece {
                        let (oldest, _) = held.pop_front().unwrap();
                        prop_assert_eq!(*id, oldest, "oldest first");
                    }
                }
                Op::Trim => {
                    let expected: usize = held.iter().map(|&(_, b)| b).sum();
                    prop_assert_eq!(queue.trim(), expected);
                    held.clear();
                }
                Op::Immediate(on) => {
                    policy.lock().unwrap().mode = if on { ReleaseMode::Immediate } else { ReleaseMode::Manual };
                }
            }
            let stats = queue.stats();
            let held_bytes: usize = held.iter().map(|&(_, b)| b).sum();
            let live_bytes: usize = live.iter().map(|b| b.bytes).sum();
            prop_assert_eq!(stats.held_bytes, held_bytes);
            prop_assert_eq!(stats.held_allocations, held.len());
            prop_assert_eq!(device.used.load(Ordering::SeqCst), live_bytes + held_bytes);
            let released: HashSet<u64> = device.released().into_iter().collect();
            prop_assert!(live.iter().all(|b| !released.contains(&b.id)), "a live block was released");
            prop_assert!(device.violations.lock().unwrap().is_empty(), "{:?}", device.violations.lock().unwrap());
        }
        let live_bytes: usize = live.iter().map(|b| b.bytes).sum();
        drop(queue);
        // The last owner gone: nothing stays held.
        prop_assert_eq!(device.used.load(Ordering::SeqCst), live_bytes);
        for block in live {
            block.release();
        }
        prop_assert!(device.violations.lock().unwrap().is_empty());
    }
}

fn wait_until(deadline: Duration, mut done: impl FnMut() -> bool) -> bool {
    let start = Instant::now();
    while start.elapsed() < deadline {
        if done() {
            return true;
        }
        std::thread::sleep(Duration::from_millis(1));
    }
    done()
}

/// The background thread releases held memory in pieces once the process is idle, and not while
/// driver calls keep coming.
#[test]
fn the_background_thread_waits_for_idle_then_releases_in_pieces() {
    let device = Arc::new(Device {
        capacity: 64 * G,
        ..Device::default()
    });
    let policy = Arc::new(Mutex::new(ReleasePolicy {
        mode: ReleaseMode::Background,
        idle: Duration::from_millis(200),
        gap: Duration::from_millis(0),
        piece_bytes: 3 * G,
    }));
    let activity = Arc::new(AtomicU64::new(0));
    let queue = queue(policy, activity.clone());
    for _ in 0..8 {
        let block = device.create(2 * G).unwrap();
        queue.put(2 * G, block);
    }
    // Busy: a driver call every millisecond for 400 ms, nothing is released.
    let start = Instant::now();
    while start.elapsed() < Duration::from_millis(400) {
        activity.fetch_add(1, Ordering::SeqCst);
        std::thread::sleep(Duration::from_millis(1));
    }
    assert_eq!(
        queue.stats().held_allocations,
        8,
        "released while the process was busy"
    );
    // Idle: all of it goes, a piece (one 2-GiB block within a 3-granule budget) at a time.
    assert!(wait_until(Duration::from_secs(10), || queue.held_bytes() == 0));
    let stats = queue.stats();
    assert_eq!(stats.releases, 8);
    assert_eq!(stats.background_pieces, 8, "{stats:?}");
    assert_eq!(device.used.load(Ordering::SeqCst), 0);
}

/// A drop of the queue stops its thread and releases what is held; a held block of the right
/// size is reused while the thread waits for idle.
#[test]
fn reuse_before_release_and_release_at_the_end() {
    let device = Arc::new(Device {
        capacity: 16 * G,
        ..Device::default()
    });
    let policy = Arc::new(Mutex::new(ReleasePolicy {
        mode: ReleaseMode::Background,
        idle: Duration::from_secs(3600),
        ..ReleasePolicy::default()
    }));
    let queue = queue(policy, Arc::new(AtomicU64::new(0)));
    let block = device.create(8 * G).unwrap();
    let id = block.id;
    queue.put(8 * G, block);
    let again = queue
        .acquire(&(8 * G), 8 * G, || device.create(8 * G))
        .unwrap();
    assert_eq!(again.id, id);
    assert_eq!(device.creates.load(Ordering::SeqCst), 1);
    queue.put(8 * G, again);
    // 16 granules fit only once the held 8 are released: release, then retry.
    let big = queue
        .acquire(&(16 * G), 16 * G, || device.create(16 * G))
        .unwrap();
    assert_eq!(queue.stats().retries, 1);
    assert_eq!(queue.held_bytes(), 0);
    queue.put(16 * G, big);
    assert_eq!(queue.held_bytes(), 16 * G);
    drop(queue);
    assert_eq!(device.used.load(Ordering::SeqCst), 0);
    assert!(device.violations.lock().unwrap().is_empty());
}

/// Bad input does not panic: a zero piece budget releases one allocation a step, a zero idle
/// time releases at once in the background, a step or trim of an empty queue releases nothing.
#[test]
fn odd_policies_and_empty_queues() {
    let device = Arc::new(Device {
        capacity: 16 * G,
        ..Device::default()
    });
    let policy = Arc::new(Mutex::new(ReleasePolicy {
        mode: ReleaseMode::Manual,
        piece_bytes: 0,
        idle: Duration::ZERO,
        gap: Duration::ZERO,
    }));
    let queue = queue(policy.clone(), Arc::new(AtomicU64::new(0)));
    assert_eq!(queue.step(0), 0);
    assert_eq!(queue.trim(), 0);
    for _ in 0..3 {
        let block = device.create(G).unwrap();
        queue.put(G, block);
    }
    assert_eq!(queue.step(0), G);
    policy.lock().unwrap().mode = ReleaseMode::Background;
    queue.nudge();
    assert!(wait_until(Duration::from_secs(10), || queue.held_bytes() == 0));
    assert_eq!(queue.stats().releases, 3);
}
