//! NCCL over stable buffers on every visible GPU (one rank per device, one thread per rank, in
//! one process): an all-reduce captured in each rank's graph over a slot whose memory is rebound
//! between replays and slept/woken, with the buffer registered never, once (a plain
//! `Collective::register`, which the rebind leaves pointing at the old pages), or tracked
//! (`Collective::register_slot`, re-registered by the bind). Every replay's result is checked
//! against the CPU sum over ranks, with the space's memory made exportable (`shareable`, POSIX
//! file descriptors, as NCCL's own `ncclMemAlloc` makes it) or not. Needs two GPUs; ignored
//! (never passed) elsewhere.
//!
//! Each case runs in a child process of this test binary (a failing NCCL case can leave its
//! communicators unusable, or crash: that must not take the other cases with it); the parent
//! prints every case's outcome and asserts on them. Run with
//! `NCCL_DEBUG=INFO NCCL_DEBUG_SUBSYS=INIT,REG` to see which path NCCL took.
#![cfg(feature = "nccl")]

mod common;

use std::process::Command;
use std::sync::{Arc, Barrier};
use std::time::Duration;

use common::{deadline, rng};
use stablebuf::buffer::copy_between;
use stablebuf::collective::{Collective, CollectiveId};
use stablebuf::kernels::Kernels;
use stablebuf::{open_device, HostArena, HostStorage, Layout, Space, SpaceOptions, StableGraph};

const MIB: usize = 1 << 20;
const DATASETS: usize = 3;
const ROUNDS: usize = 9;

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Registration {
    Never,
    Once,
    Tracked,
}

impl Registration {
    fn parse(text: &str) -> Self {
        match text {
            "Never" => Self::Never,
            "Once" => Self::Once,
            "Tracked" => Self::Tracked,
            other => panic!("unknown registration mode {other:?}"),
        }
    }
}

/// One case: the registration mode and whether the space's memory is exportable.
#[derive(Clone, Copy, Debug)]
struct Case {
    mode: Registration,
    shareable: bool,
}

/// What one rank saw in one mode: for each round, whether every element was right.
#[derive(Debug)]
struct RankReport {
    rank: usize,
    correct: Vec<bool>,
    worst: f32,
    registrations: u64,
}

/// `data[rank][dataset]`: rank `rank`'s input `x` in dataset `dataset`.
type Data = Vec<Vec<Vec<f32>>>;

fn expected(data: &Data, dataset: usize) -> Vec<f32> {
    let words = data[0][dataset].len();
    (0..words)
        .map(|i| data.iter().map(|rank| 2.0 * rank[dataset][i] + 0.5).sum())
        .collect()
}

fn run_rank(
    rank: usize,
    world: usize,
    id: CollectiveId,
    case: Case,
    data: Arc<Data>,
    barrier: Arc<Barrier>,
) -> RankReport {
    let mode = case.mode;
    let ctx = open_device(rank).unwrap();
    let stream = ctx.new_stream().unwrap();
    let kernels = Arc::new(Kernels::load(&ctx).unwrap());
    let collective = Collective::join(&ctx, rank, world, id).unwrap();
    let bytes = data[rank][0].len() * 4;
    let layout = Layout::builder()
        .group("io")
        .input("x", bytes)
        .output("y", bytes)
        .build()
        .unwrap();
    let space = Space::with_options(
        &ctx,
        layout,
        SpaceOptions::default().shareable(case.shareable),
    )
    .unwrap();
    let mut datasets: Vec<_> = data[rank]
        .iter()
        .map(|x| {
            let d = space.new_dataset("io").unwrap();
            d.write(&stream, "x", x).unwrap();
            d
        })
        .collect();
    space.bind(&datasets[0]).unwrap();
    // NCCL connects its peers on a collective's first use (lazily, per algorithm); that setup
    // cannot run inside a capture, so one eager all-reduce of the same size comes first.
    collective
        .all_reduce_sum(&stream, space.slot("y").unwrap())
        .unwrap();
    stream.synchronize().unwrap();
    let (x, y, c, k) = (
        space.slot("x").unwrap().clone(),
        space.slot("y").unwrap().clone(),
        collective.clone(),
        kernels.clone(),
    );
    let graph = StableGraph::capture(&stream, &[&space], move |s| {
        copy_between(s, &y, 0, &x, 0, x.bytes())?;
        k.affine(s, &y, 2.0, 0.5)?;
        c.all_reduce_sum(s, &y)
    })
    .unwrap();
    let once = (mode == Registration::Once)
        .then(|| collective.register(space.slot("y").unwrap()).unwrap());
    let tracked =
        (mode == Registration::Tracked).then(|| collective.register_slot(&space, "y").unwrap());
    let arena = HostArena::new(&ctx, 2 * bytes * DATASETS).unwrap();
    let storage = HostStorage::Pinned(arena);
    let words = bytes / 4;
    let mut correct = Vec::new();
    let mut worst = 0f32;
    for round in 0..ROUNDS {
        let index = round % DATASETS;
        space.bind(&datasets[index]).unwrap();
        if round % 3 == 2 {
            // Sleep and wake: the dataset comes back in new physical memory.
            space.sleep(datasets.iter_mut(), &storage, &stream).unwrap();
            space.wake(datasets.iter_mut(), &stream).unwrap();
        }
        space.write(&stream, "y", &vec![f32::NAN; words]).unwrap();
        stream.synchronize().unwrap();
        // Every rank poisoned before any rank's all-reduce can read its peer's buffer.
        barrier.wait();
        graph.replay().unwrap();
        stream.synchronize().unwrap();
        let got: Vec<f32> = space.read(&stream, "y").unwrap();
        let want = expected(&data, index);
        let mut round_ok = true;
        for (g, w) in got.iter().zip(&want) {
            let error = (g - w).abs() / w.abs().max(1.0);
            if error.is_nan() || error > 1e-5 {
                round_ok = false;
            }
            if error.is_finite() {
                worst = worst.max(error);
            }
        }
        correct.push(round_ok);
        barrier.wait();
    }
    let registrations = tracked.as_ref().map_or(u64::from(once.is_some()), |t| {
        assert!(t.is_registered(), "rank {rank}: {:?}", t.last_error());
        t.registrations()
    });
    drop((once, tracked, graph));
    RankReport {
        rank,
        correct,
        worst,
        registrations,
    }
}

fn run_case(case: Case, data: Arc<Data>) -> Vec<RankReport> {
    let world = data.len();
    let id = CollectiveId::new().unwrap();
    let barrier = Arc::new(Barrier::new(world));
    let ranks: Vec<_> = (0..world)
        .map(|rank| {
            let (data, barrier) = (data.clone(), barrier.clone());
            std::thread::spawn(move || run_rank(rank, world, id, case, data, barrier))
        })
        .collect();
    ranks
        .into_iter()
        .map(|r| {
            r.join()
                .expect("a rank panicked (its peers were left waiting)")
        })
        .collect()
}

/// The data every case uses: the same in every child (seeded by the parent).
fn case_data(seed: u64, world: usize) -> Arc<Data> {
    use rand::{Rng, SeedableRng};
    let mut rng = rand::rngs::StdRng::seed_from_u64(seed);
    // 4 MiB per buffer: above NCCL's thresholds for registered (zero-copy) transfers.
    let words = 4 * MIB / 4;
    Arc::new(
        (0..world)
            .map(|_| {
                (0..DATASETS)
                    .map(|_| (0..words).map(|_| rng.gen_range(-1.0f32..1.0)).collect())
                    .collect()
            })
            .collect(),
    )
}

const TEST_NAME: &str =
    "an_all_reduce_in_a_graph_stays_right_across_rebinds_and_sleep_with_every_registration_mode";

/// In a child: runs the case named by the environment and prints one line per rank.
fn child_case(spec: &str) {
    let mut parts = spec.split(',');
    let (seed, mode, shareable) = (
        parts.next().unwrap().parse().unwrap(),
        Registration::parse(parts.next().unwrap()),
        parts.next().unwrap() == "shareable",
    );
    let world = stablebuf::device::device_count().unwrap();
    let case = Case { mode, shareable };
    let reports = deadline::within("nccl ranks", Duration::from_secs(120), move || {
        run_case(case, case_data(seed, world))
    });
    for report in reports {
        let right = report.correct.iter().filter(|c| **c).count();
        println!(
            "CASE {mode:?} {} rank {} right {right} of {ROUNDS} worst {:.1e} registrations {}",
            if shareable { "shareable" } else { "private" },
            report.rank,
            report.worst,
            report.registrations
        );
    }
}

#[test]
#[ignore = "needs two CUDA GPUs"]
fn an_all_reduce_in_a_graph_stays_right_across_rebinds_and_sleep_with_every_registration_mode() {
    if let Ok(spec) = std::env::var("STABLEBUF_NCCL_CASE") {
        return child_case(&spec);
    }
    let world = stablebuf::device::device_count().expect("a CUDA driver");
    assert!(world >= 2, "this test needs two CUDA GPUs, found {world}");
    let (library, version) = stablebuf::collective::library().expect("libnccl");
    eprintln!("libnccl {version} from {library}");
    let seed: u64 = {
        use rand::Rng;
        rng("nccl_registration").gen()
    };
    let exe = std::env::current_exe().unwrap();
    // (mode, shareable) -> ranks that were right every round, or why the case failed.
    let mut outcomes = Vec::new();
    for shareable in [true, false] {
        for mode in [
            Registration::Never,
            Registration::Tracked,
            Registration::Once,
        ] {
            let label = if shareable { "shareable" } else { "private" };
            let output = Command::new(&exe)
                .args([TEST_NAME, "--exact", "--include-ignored", "--nocapture"])
                .env("STABLEBUF_NCCL_CASE", format!("{seed},{mode:?},{label}"))
                .output()
                .expect("run a child case");
            let stdout = String::from_utf8_lossy(&output.stdout);
            let stderr = String::from_utf8_lossy(&output.stderr);
            // The marker is looked for anywhere in a line: libtest prints `test … ... ` with no
            // newline before the child's own output, so rank 0's line may share it.
            let lines: Vec<&str> = stdout
                .lines()
                .filter_map(|l| l.find("CASE ").map(|at| &l[at..]))
                .collect();
            for line in &lines {
                println!("{line}");
            }
            let all_right = output.status.success()
                && lines.len() == world
                && lines
                    .iter()
                    .all(|l| l.contains(&format!("right {ROUNDS} of {ROUNDS}")));
            if !output.status.success() || lines.len() != world {
                let why: Vec<&str> = stderr
                    .lines()
                    .chain(stdout.lines())
                    .filter(|l| l.contains("panicked") || l.contains("Err") || l.contains("WARN"))
                    .take(4)
                    .collect();
                println!(
                    "CASE {mode:?} {label} FAILED ({}): {}",
                    output.status,
                    why.join(" | ")
                );
            }
            outcomes.push((mode, shareable, all_right));
        }
    }
    for (mode, shareable, right) in &outcomes {
        println!(
            "nccl registration finding: {mode:?}, {} memory: {}",
            if *shareable { "exportable" } else { "private" },
            if *right {
                "right in every round"
            } else {
                "WRONG or failed"
            }
        );
    }
    // What stablebuf promises: without registration, and with register_slot, an all-reduce
    // over memory that rebinds and sleeps is right in every round (exportable memory).
    for (mode, shareable, right) in &outcomes {
        if *shareable && *mode != Registration::Once {
            assert!(right, "{mode:?} over exportable memory: wrong results");
        }
    }
}
