//! Two real processes sharing datasets over a Unix socket. This binary is its own child: with
//! `STABLEBUF_IPC_ROLE` set it plays the producer, otherwise it runs the tests as the consumer.
//! A custom harness (`harness = false`) because the child must not run the tests itself; it
//! prints libtest's summary line, and without `--include-ignored` reports every test as ignored
//! (they need a GPU).

mod common;

use std::io::{BufRead, BufReader};
use std::os::fd::{AsRawFd, OwnedFd};
use std::os::unix::net::{UnixListener, UnixStream};
use std::os::unix::process::ExitStatusExt;
use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use common::{assert_matches, capture_matmul, cpu_matmul, random_vec};
use rand::{rngs::StdRng, SeedableRng};
use stablebuf::device::memory_info;
use stablebuf::error::{DriverError, LayoutError, ShareError};
use stablebuf::kernels::{Kernels, MatmulKernel};
use stablebuf::share::{receive_dataset, send_ack, send_dataset, wait_ack};
use stablebuf::share::{receive_message, send_message, Message, Offer, ProtocolError};
use stablebuf::{open_device, Error, Layout, Space, SpaceOptions};

const PATTERN_LEN: usize = 16 << 20; // u32 elements: 64 MiB
const M: usize = 128;
const N: usize = 96;
const K: usize = 160;

fn pattern_layout(extra: usize) -> Layout {
    Layout::builder()
        .group("data")
        .input("pattern", PATTERN_LEN * 4 + extra)
        .build()
        .unwrap()
}

fn pattern(i: usize) -> u32 {
    ((i as u32).wrapping_mul(2).wrapping_add(1337)) ^ 0xDEAD_BEEF
}

/// The small dataset a producer is killed while sharing.
const KILLED_LEN: usize = 1 << 20; // u32 elements: 4 MiB

fn killed_layout() -> Layout {
    Layout::builder()
        .group("data")
        .input("pattern", KILLED_LEN * 4)
        .build()
        .unwrap()
}

/// Where a producer is killed: after connecting; after making its dataset; after sending a
/// frame's length only; after half a frame with the descriptor; after the whole offer; after
/// reading the consumer's ack.
const KILL_STEPS: [&str; 6] = [
    "connected",
    "allocated",
    "header",
    "half",
    "offered",
    "acked",
];

fn matmul_layout() -> Layout {
    Layout::builder()
        .group("inputs")
        .input("a", M * K * 4)
        .input("b", K * N * 4)
        .scratch("c", M * N * 4)
        .build()
        .unwrap()
}

fn matrices(seed: u64) -> (Vec<f32>, Vec<f32>) {
    let mut rng = StdRng::seed_from_u64(seed);
    (random_vec(&mut rng, M * K), random_vec(&mut rng, K * N))
}

// ---------------------------------------------------------------- producer (child process)

fn producer(role: &str) -> i32 {
    let socket = UnixStream::connect(std::env::var("STABLEBUF_IPC_SOCKET").unwrap()).unwrap();
    let seed: u64 = std::env::var("STABLEBUF_SEED").unwrap().parse().unwrap();
    let ctx = open_device(0).unwrap();
    let stream = ctx.new_stream().unwrap();
    let shareable = SpaceOptions::default().shareable(true);
    match role {
        "pattern" => {
            let space = Space::with_options(&ctx, pattern_layout(0), shareable).unwrap();
            let d = space.new_dataset("data").unwrap();
            d.write(
                &stream,
                "pattern",
                &(0..PATTERN_LEN).map(pattern).collect::<Vec<_>>(),
            )
            .unwrap();
            send_dataset(&socket, &d).unwrap();
            wait_ack(&socket, d.id()).unwrap();
            0 // exits now: the consumer must keep reading the memory after this
        }
        "matmul" => {
            let space = Space::with_options(&ctx, matmul_layout(), shareable).unwrap();
            for round in 0..2 {
                let (a, b) = matrices(seed + round);
                let d = space.new_dataset("inputs").unwrap();
                d.write(&stream, "a", &a).unwrap();
                d.write(&stream, "b", &b).unwrap();
                space.bind(&d).unwrap(); // the producer's own binding, replaced next round
                send_dataset(&socket, &d).unwrap();
                wait_ack(&socket, d.id()).unwrap();
            }
            0
        }
        "mismatch" => {
            let space = Space::with_options(&ctx, pattern_layout(4096), shareable).unwrap();
            let d = space.new_dataset("data").unwrap();
            send_dataset(&socket, &d).unwrap();
            match wait_ack(&socket, d.id()) {
                Err(Error::Share(ShareError::Rejected { reason })) => {
                    eprintln!("producer: rejected as expected: {reason}");
                    0
                }
                other => {
                    eprintln!("producer: expected a rejection, got {other:?}");
                    3
                }
            }
        }
        "killed" => {
            // Does the protocol up to the step it is told, says so on stdout, and waits to be
            // killed (SIGKILL) by the consumer there.
            let step = std::env::var("STABLEBUF_IPC_STEP").unwrap();
            let ready = || -> ! {
                println!("ready");
                std::io::Write::flush(&mut std::io::stdout()).unwrap();
                std::thread::sleep(Duration::from_secs(60));
                eprintln!("producer: never killed at step {step}");
                std::process::exit(4);
            };
            if step == "connected" {
                ready();
            }
            let space = Space::with_options(&ctx, killed_layout(), shareable).unwrap();
            let d = space.new_dataset("data").unwrap();
            d.write(
                &stream,
                "pattern",
                &(0..KILLED_LEN).map(pattern).collect::<Vec<_>>(),
            )
            .unwrap();
            if step == "allocated" {
                ready();
            }
            let offer = Offer {
                layout_fingerprint: space.layout().fingerprint(),
                group: "data".into(),
                bytes: d.bytes() as u64,
                granularity: stablebuf::vmm::granularity(&ctx, true).unwrap() as u64,
                device_uuid: ctx.uuid().unwrap().bytes.map(|b| b as u8),
                dataset: d.id(),
            };
            let frame = Message::Offer(offer).frame();
            match step.as_str() {
                "header" => std::io::Write::write_all(&mut &socket, &frame[..4]).unwrap(),
                "half" => {
                    let fd = d.export().unwrap();
                    send_with_descriptor(&socket, &frame[..frame.len() / 2], &fd);
                }
                "offered" => send_dataset(&socket, &d).unwrap(),
                "acked" => {
                    send_dataset(&socket, &d).unwrap();
                    wait_ack(&socket, d.id()).unwrap();
                }
                other => panic!("unknown step {other}"),
            }
            ready();
        }
        "malformed" => {
            // 1. A frame that is not a stablebuf message.
            std::io::Write::write_all(&mut &socket, &[4, 0, 0, 0, b'J', b'U', b'N', b'K']).unwrap();
            // 2. A well-formed offer whose descriptor is a pipe, not CUDA memory.
            let space = Space::with_options(&ctx, pattern_layout(0), shareable).unwrap();
            let region = &space.placement().groups[0];
            let uuid = ctx.uuid().unwrap().bytes.map(|b| b as u8);
            let offer = Offer {
                layout_fingerprint: space.layout().fingerprint(),
                group: "data".into(),
                bytes: region.bytes as u64,
                granularity: stablebuf::vmm::granularity(&ctx, true).unwrap() as u64,
                device_uuid: uuid,
                dataset: 1,
            };
            let (read, _write) = std::io::pipe().unwrap();
            send_message(&socket, &Message::Offer(offer), Some(&read.into())).unwrap();
            // 3. Half a frame, then death mid-handshake.
            std::io::Write::write_all(&mut &socket, &[64, 0, 0, 0, b'S', b'B']).unwrap();
            std::process::exit(0);
        }
        other => panic!("unknown role {other}"),
    }
}

// ---------------------------------------------------------------- consumer (the tests)

struct Peer {
    child: Child,
    socket: UnixStream,
    path: PathBuf,
}

impl Peer {
    fn spawn(role: &str, seed: u64) -> Peer {
        let path =
            std::env::temp_dir().join(format!("stablebuf-ipc-{}-{role}.sock", std::process::id()));
        let _ = std::fs::remove_file(&path);
        let listener = UnixListener::bind(&path).unwrap();
        let child = Command::new(std::env::current_exe().unwrap())
            .env("STABLEBUF_IPC_ROLE", role)
            .env("STABLEBUF_IPC_SOCKET", &path)
            .env("STABLEBUF_SEED", seed.to_string())
            .spawn()
            .unwrap();
        let (socket, _) = listener.accept().unwrap();
        Peer {
            child,
            socket,
            path,
        }
    }

    /// A producer that stops at `step` (see [`KILL_STEPS`]) and reports it on its stdout.
    fn spawn_to_kill(step: &str) -> Peer {
        let path = std::env::temp_dir().join(format!(
            "stablebuf-ipc-{}-killed-{step}.sock",
            std::process::id()
        ));
        let _ = std::fs::remove_file(&path);
        let listener = UnixListener::bind(&path).unwrap();
        let child = Command::new(std::env::current_exe().unwrap())
            .env("STABLEBUF_IPC_ROLE", "killed")
            .env("STABLEBUF_IPC_STEP", step)
            .env("STABLEBUF_IPC_SOCKET", &path)
            .env("STABLEBUF_SEED", "0")
            .stdout(Stdio::piped())
            .spawn()
            .unwrap();
        let (socket, _) = listener.accept().unwrap();
        Peer {
            child,
            socket,
            path,
        }
    }

    /// Waits until the producer says it reached its step.
    fn wait_ready(&mut self) {
        let stdout = self.child.stdout.as_mut().expect("piped stdout");
        // The marker is looked for anywhere in a line: whatever else the child prints (a
        // harness prefix, a log line) may share it.
        for line in BufReader::new(stdout).lines() {
            if line.unwrap().contains("ready") {
                return;
            }
        }
        panic!("the producer died before its step");
    }

    /// SIGKILL, then reap it.
    fn kill(mut self) -> UnixStream {
        self.child.kill().unwrap();
        let status = self.child.wait().unwrap();
        assert_eq!(
            status.signal(),
            Some(9),
            "the producer was not killed: {status}"
        );
        let _ = std::fs::remove_file(&self.path);
        self.socket
    }

    fn finish(mut self) {
        let status = self.child.wait().unwrap();
        let _ = std::fs::remove_file(&self.path);
        assert!(status.success(), "producer exited with {status}");
    }
}

fn open_fds() -> usize {
    std::fs::read_dir("/proc/self/fd").unwrap().count()
}

/// Sends `bytes` with `fd` attached, as `send_dataset` does, but only part of a frame.
fn send_with_descriptor(socket: &UnixStream, bytes: &[u8], fd: &OwnedFd) {
    use nix::sys::socket::{sendmsg, ControlMessage, MsgFlags};
    let raw = [fd.as_raw_fd()];
    let iov = [std::io::IoSlice::new(bytes)];
    let sent = sendmsg::<()>(
        socket.as_raw_fd(),
        &iov,
        &[ControlMessage::ScmRights(&raw)],
        MsgFlags::empty(),
        None,
    )
    .unwrap();
    assert_eq!(sent, bytes.len());
}

/// [`without_leaks`] for tests that kill a process: the driver frees a dead process's memory
/// as the process is torn down, so device memory is given a few seconds to come back.
fn without_leaks_after_a_kill(test: impl FnOnce()) {
    let ctx = open_device(0).unwrap();
    ctx.synchronize().unwrap();
    stablebuf::release::trim_all(); // memory held for release is not free to the driver
    let (fds, (free, _)) = (open_fds(), memory_info(&ctx).unwrap());
    test();
    ctx.synchronize().unwrap();
    assert_eq!(open_fds(), fds, "file descriptors leaked");
    let deadline = Instant::now() + Duration::from_secs(5);
    loop {
        stablebuf::release::trim_all(); // memory held for release is not free to the driver
        let (now, _) = memory_info(&ctx).unwrap();
        let lost = free.saturating_sub(now);
        if lost <= 2 << 20 {
            return;
        }
        assert!(
            Instant::now() < deadline,
            "device memory leaked: {lost} bytes"
        );
        std::thread::sleep(Duration::from_millis(50));
    }
}

/// Runs `test` and checks that no descriptor and no device memory outlive it.
fn without_leaks(test: impl FnOnce()) {
    let ctx = open_device(0).unwrap();
    ctx.synchronize().unwrap();
    stablebuf::release::trim_all(); // memory held for release is not free to the driver
    let (fds, (free, _)) = (open_fds(), memory_info(&ctx).unwrap());
    test();
    ctx.synchronize().unwrap();
    stablebuf::release::trim_all(); // memory held for release is not free to the driver
    let (fds_after, (free_after, _)) = (open_fds(), memory_info(&ctx).unwrap());
    assert_eq!(fds_after, fds, "file descriptors leaked");
    assert!(
        free.saturating_sub(free_after) <= 2 << 20,
        "device memory leaked: {} bytes",
        free - free_after
    );
}

fn pattern_is_verified_and_outlives_the_producer() {
    without_leaks(|| {
        let ctx = open_device(0).unwrap();
        let stream = ctx.new_stream().unwrap();
        let space = Space::new(&ctx, pattern_layout(0)).unwrap();
        let peer = Peer::spawn("pattern", 0);
        let (dataset, offer) = receive_dataset(&peer.socket, &space).unwrap();
        send_ack(&peer.socket, offer.dataset).unwrap();
        peer.finish(); // the producer has exited
        space.bind(&dataset).unwrap();
        let got: Vec<u32> = space.read(&stream, "pattern").unwrap();
        let bad = got
            .iter()
            .enumerate()
            .filter(|(i, v)| **v != pattern(*i))
            .count();
        assert_eq!(bad, 0, "{bad} of {PATTERN_LEN} elements differ");
        eprintln!("consumer: verified all {PATTERN_LEN} elements after the producer exited");
    });
}

fn a_consumer_graph_replays_on_shared_data_and_on_new_data_after_reimport() {
    without_leaks(|| {
        let ctx = open_device(0).unwrap();
        let stream = ctx.new_stream().unwrap();
        let kernels = std::sync::Arc::new(Kernels::load(&ctx).unwrap());
        let space = Space::new(&ctx, matmul_layout()).unwrap();
        let graph = capture_matmul(&space, &stream, &kernels, MatmulKernel::Auto, (M, N, K));
        let seed = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .unwrap()
            .as_nanos() as u64;
        eprintln!("matmul over shared data: seed {seed}");
        let peer = Peer::spawn("matmul", seed);
        let mut held = Vec::new();
        for round in 0..2 {
            let (dataset, offer) = receive_dataset(&peer.socket, &space).unwrap();
            space.bind(&dataset).unwrap();
            kernels
                .fill(&stream, space.slot("c").unwrap(), f32::NAN)
                .unwrap();
            graph.replay().unwrap();
            let (x, y) = matrices(seed + round);
            assert_matches(
                &space.read(&stream, "c").unwrap(),
                &cpu_matmul(&x, &y, M, N, K),
                K,
                &format!("round {round}"),
            );
            send_ack(&peer.socket, offer.dataset).unwrap();
            held.push(dataset);
        }
        peer.finish();
        drop(held);
    });
}

fn a_mismatched_layout_is_rejected_on_both_sides() {
    without_leaks(|| {
        let ctx = open_device(0).unwrap();
        let space = Space::new(&ctx, pattern_layout(0)).unwrap();
        let peer = Peer::spawn("mismatch", 0);
        assert!(matches!(
            receive_dataset(&peer.socket, &space),
            Err(Error::Layout(LayoutError::LayoutMismatch { .. }))
        ));
        peer.finish(); // exits 0 only if it saw the Reject
    });
}

fn malformed_messages_foreign_fds_and_a_dying_producer_are_typed_errors() {
    without_leaks(|| {
        let ctx = open_device(0).unwrap();
        let space = Space::new(&ctx, pattern_layout(0)).unwrap();
        let peer = Peer::spawn("malformed", 0);
        assert!(matches!(
            receive_dataset(&peer.socket, &space),
            Err(Error::Share(ShareError::Protocol(ProtocolError::BadMagic)))
        ));
        match receive_dataset(&peer.socket, &space) {
            Err(Error::Driver(DriverError::Failed {
                call: "cuMemImportFromShareableHandle",
                ..
            })) => {}
            other => panic!("a pipe imported as CUDA memory: {other:?}"),
        }
        assert!(matches!(
            receive_dataset(&peer.socket, &space),
            Err(Error::Share(ShareError::Protocol(
                ProtocolError::Truncated { .. }
            )))
        ));
        assert!(matches!(
            receive_message(&peer.socket),
            Err(Error::Share(ShareError::Protocol(ProtocolError::Closed)))
        ));
        peer.finish();
    });
}

fn a_producer_killed_at_each_protocol_step_leaves_typed_errors_and_no_leak() {
    let ctx = open_device(0).unwrap();
    let stream = ctx.new_stream().unwrap();
    for step in KILL_STEPS {
        without_leaks_after_a_kill(|| {
            let space = Space::new(&ctx, killed_layout()).unwrap();
            let mut peer = Peer::spawn_to_kill(step);
            let check = |dataset: &stablebuf::Dataset| {
                space.bind(dataset).unwrap();
                let got: Vec<u32> = space.read(&stream, "pattern").unwrap();
                let bad = got
                    .iter()
                    .enumerate()
                    .filter(|(i, v)| **v != pattern(*i))
                    .count();
                assert_eq!(bad, 0, "{step}: {bad} elements differ");
            };
            match step {
                "acked" => {
                    // The producer waits for our ack before its step: answer it first.
                    let (dataset, offer) = receive_dataset(&peer.socket, &space).unwrap();
                    send_ack(&peer.socket, offer.dataset).unwrap();
                    peer.wait_ready();
                    let socket = peer.kill();
                    check(&dataset); // the memory outlives its maker
                    assert!(matches!(
                        receive_message(&socket),
                        Err(Error::Share(ShareError::Protocol(ProtocolError::Closed)))
                    ));
                }
                "offered" => {
                    peer.wait_ready();
                    let socket = peer.kill();
                    // The offer and its descriptor were delivered before the kill. Whether the
                    // driver still imports memory whose exporter died is its business: either
                    // the data is intact or the import is a typed error.
                    match receive_dataset(&socket, &space) {
                        Ok((dataset, offer)) => {
                            check(&dataset);
                            eprintln!("consumer: imported after the producer died; data intact");
                            match send_ack(&socket, offer.dataset) {
                                Err(Error::Io { .. }) => {}
                                other => panic!("{step}: an ack to a dead producer gave {other:?}"),
                            }
                        }
                        Err(Error::Driver(DriverError::Failed {
                            call: "cuMemImportFromShareableHandle",
                            result,
                            ..
                        })) => eprintln!(
                            "consumer: import after the producer died refused: {result:?}"
                        ),
                        Err(other) => panic!("{step}: {other:?}"),
                    }
                }
                _ => {
                    peer.wait_ready();
                    let socket = peer.kill();
                    let got = receive_dataset(&socket, &space);
                    let typed = match step {
                        "connected" | "allocated" => {
                            matches!(
                                got,
                                Err(Error::Share(ShareError::Protocol(ProtocolError::Closed)))
                            )
                        }
                        _ => matches!(
                            got,
                            Err(Error::Share(ShareError::Protocol(
                                ProtocolError::Truncated { .. }
                            )))
                        ),
                    };
                    assert!(typed, "{step}: {:?}", got.map(|(_, offer)| offer));
                }
            }
            eprintln!("consumer: producer killed after {step}: typed errors, nothing leaked");
        });
    }
}

fn main() {
    if let Ok(role) = std::env::var("STABLEBUF_IPC_ROLE") {
        std::process::exit(producer(&role));
    }
    let run = std::env::args().any(|a| a == "--include-ignored" || a == "--ignored");
    let tests: [(&str, fn()); 5] = [
        (
            "pattern_is_verified_and_outlives_the_producer",
            pattern_is_verified_and_outlives_the_producer,
        ),
        (
            "a_consumer_graph_replays_on_shared_data_and_on_new_data_after_reimport",
            a_consumer_graph_replays_on_shared_data_and_on_new_data_after_reimport,
        ),
        (
            "a_mismatched_layout_is_rejected_on_both_sides",
            a_mismatched_layout_is_rejected_on_both_sides,
        ),
        (
            "malformed_messages_foreign_fds_and_a_dying_producer_are_typed_errors",
            malformed_messages_foreign_fds_and_a_dying_producer_are_typed_errors,
        ),
        (
            "a_producer_killed_at_each_protocol_step_leaves_typed_errors_and_no_leak",
            a_producer_killed_at_each_protocol_step_leaves_typed_errors_and_no_leak,
        ),
    ];
    println!("\nrunning {} tests", tests.len());
    let (mut passed, mut failed, mut ignored) = (0, 0, 0);
    for (name, test) in tests {
        if !run {
            println!("test {name} ... ignored, needs a CUDA GPU");
            ignored += 1;
        } else if std::panic::catch_unwind(test).is_ok() {
            println!("test {name} ... ok");
            passed += 1;
        } else {
            println!("test {name} ... FAILED");
            failed += 1;
        }
    }
    let verdict = if failed == 0 { "ok" } else { "FAILED" };
    println!("\ntest result: {verdict}. {passed} passed; {failed} failed; {ignored} ignored; 0 measured; 0 filtered out\n");
    std::process::exit(i32::from(failed > 0));
}
