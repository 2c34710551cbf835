//! A region's weight set published to another process (`share::publish`): the parent is the
//! engine (a region, a graph captured over it, exportable spare sets); a child process — this
//! same test binary, re-executed on its `export_child` test with `STABLEBUF_EXPORT_ROLE` set —
//! is the trainer that imports a set, writes new weights into it and commits. Checked against
//! CPU references on random data with outputs poisoned (NaN) before every replay; refusals
//! (fingerprint, size, tag, device) and a trainer killed mid-write leave the engine serving.

mod common;

use std::io::{BufRead, BufReader};
use std::os::unix::net::{UnixListener, UnixStream};
use std::os::unix::process::ExitStatusExt;
use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::sync::Arc;

use common::{gpu, Gpu};
use rand::{rngs::StdRng, Rng, SeedableRng};
use stablebuf::buffer::copy_between;
use stablebuf::cudarc::driver::sys::CUdeviceptr;
use stablebuf::error::{RegionError, ShareError};
use stablebuf::region::{Region, RegionOptions, Snapshot};
use stablebuf::share::publish::{
    self, offer_weight_set, receive_plain, receive_weight_set, wait_set_ack, Expectation,
    PublishMessage, SetOffer,
};
use stablebuf::share::ProtocolError;
use stablebuf::{open_device, DeviceBuffer, Error, HostStorage, StableGraph};

const MIB: usize = 1 << 20;
/// What a "killed" trainer prints once half its weights are written.
const READY: &str = "STABLEBUF-TRAINER-READY";
/// The weights: not a granule multiple, so the tail is exercised.
const X_BYTES: usize = 6 * MIB + 4096;
const Y_BYTES: usize = X_BYTES;
const ROLE: &str = "STABLEBUF_EXPORT_ROLE";

/// A device range as a kernel or copy operand.
struct Range {
    ptr: CUdeviceptr,
    bytes: usize,
}

impl DeviceBuffer for Range {
    fn device_address(&self) -> CUdeviceptr {
        self.ptr
    }
    fn byte_len(&self) -> usize {
        self.bytes
    }
}

fn weights(seed: u64) -> Vec<f32> {
    let mut rng = StdRng::seed_from_u64(seed);
    (0..X_BYTES / 4)
        .map(|_| rng.gen_range(-1.0f32..1.0))
        .collect()
}

fn fresh_seed() -> u64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap()
        .as_nanos() as u64
}

/// The engine side: a region holding `x` (weights) and `y` (output), a graph computing
/// `y = 2x + 1` captured once, and one exportable spare set.
struct Engine {
    gpu: Gpu,
    region: Region,
    x: u64,
    y: u64,
    graph: StableGraph,
    original: Snapshot,
    spare: Snapshot,
    first: Vec<f32>,
}

impl Engine {
    fn new(seed: u64) -> Engine {
        let gpu = gpu();
        let region = Region::new(&gpu.ctx, "weights", RegionOptions::default()).unwrap();
        let x = region.alloc(X_BYTES).unwrap();
        let y = region.alloc(Y_BYTES).unwrap();
        let first = weights(seed);
        region.write(&gpu.stream, x, &first).unwrap();
        let spare = region.snapshot_shareable(&gpu.stream).unwrap();
        assert!(spare.is_shareable());
        let original = region.bound().expect("a snapshot consolidates the region");
        let k = gpu.kernels.clone();
        let (xr, yr) = (
            Range {
                ptr: x,
                bytes: X_BYTES,
            },
            Range {
                ptr: y,
                bytes: Y_BYTES,
            },
        );
        let graph = StableGraph::capture(&gpu.stream, &[], move |s| {
            copy_between(s, &yr, 0, &xr, 0, xr.bytes)?;
            k.affine(s, &yr, 2.0, 1.0)
        })
        .unwrap();
        Engine {
            gpu,
            region,
            x,
            y,
            graph,
            original,
            spare,
            first,
        }
    }

    /// Poisons `y`, replays, and checks `y = 2 w + 1` element by element.
    fn replay_and_check(&self, want: &[f32], what: &str) {
        let words = Y_BYTES / 4;
        self.region
            .write(&self.gpu.stream, self.y, &vec![f32::NAN; words])
            .unwrap();
        self.region.check_replayable().unwrap();
        self.graph.replay().unwrap();
        self.gpu.stream.synchronize().unwrap();
        let mut got = vec![0f32; words];
        self.region
            .read_into(&self.gpu.stream, self.y, &mut got)
            .unwrap();
        for (i, (g, w)) in got.iter().zip(want).enumerate() {
            assert!(
                approx::relative_eq!(*g, 2.0 * w + 1.0, max_relative = 1e-6),
                "{what}: element {i}: got {g}, want {}",
                2.0 * w + 1.0
            );
        }
    }

    fn x_offset(&self) -> usize {
        (self.x - self.region.base()) as usize
    }
}

struct Trainer {
    child: Child,
    socket: UnixStream,
    path: PathBuf,
}

impl Trainer {
    /// Starts this binary as a trainer playing `role`, with `env` on top.
    fn spawn(engine: &Engine, role: &str, seed: u64, env: &[(&str, String)]) -> Trainer {
        let path = std::env::temp_dir().join(format!(
            "stablebuf-export-{}-{role}-{seed}.sock",
            std::process::id()
        ));
        let _ = std::fs::remove_file(&path);
        let listener = UnixListener::bind(&path).unwrap();
        let mut command = Command::new(std::env::current_exe().unwrap());
        command
            .args([
                "export_child",
                "--exact",
                "--include-ignored",
                "--nocapture",
                "--test-threads=1",
            ])
            .env(ROLE, role)
            .env("STABLEBUF_EXPORT_SOCKET", &path)
            .env("STABLEBUF_SEED", seed.to_string())
            .env(
                "STABLEBUF_EXPORT_FINGERPRINT",
                engine.region.layout_fingerprint().to_string(),
            )
            .env("STABLEBUF_EXPORT_BYTES", engine.spare.bytes().to_string())
            .env("STABLEBUF_EXPORT_X_OFFSET", engine.x_offset().to_string())
            .stdout(Stdio::piped());
        for (key, value) in env {
            command.env(key, value);
        }
        let child = command.spawn().unwrap();
        let (socket, _) = listener.accept().unwrap();
        Trainer {
            child,
            socket,
            path,
        }
    }

    /// Offers the engine's spare set and waits for the trainer's Ack.
    fn offer(&self, engine: &Engine) -> Result<(), Error> {
        let fingerprint = engine.region.layout_fingerprint();
        offer_weight_set(
            &self.socket,
            &engine.spare,
            "weights",
            fingerprint,
            &engine.gpu.ctx,
        )?;
        wait_set_ack(&self.socket, engine.spare.id())
    }

    /// Waits until the trainer prints [`READY`] (it then sleeps, waiting to be killed).
    fn wait_ready(&mut self) {
        let stdout = self.child.stdout.as_mut().expect("piped stdout");
        for line in BufReader::new(stdout).lines() {
            // The harness prints `test export_child ... ` without a newline before the child's
            // own output (--nocapture), so the marker may share its line.
            if line.unwrap().contains(READY) {
                return;
            }
        }
        panic!("the trainer exited before it was ready");
    }

    fn kill(mut self) {
        self.child.kill().unwrap();
        let status = self.child.wait().unwrap();
        assert_eq!(status.signal(), Some(9), "not killed: {status}");
        let _ = std::fs::remove_file(&self.path);
    }

    fn finish(mut self) {
        drop(self.socket);
        let status = self.child.wait().unwrap();
        let _ = std::fs::remove_file(&self.path);
        assert!(status.success(), "the trainer exited with {status}");
    }
}

fn env_u64(key: &str) -> u64 {
    std::env::var(key).unwrap().parse().unwrap()
}

// ---------------------------------------------------------------- the trainer (child process)

/// The trainer's entry: does nothing unless started by a test below with its role set.
#[test]
#[ignore = "needs a CUDA GPU"]
fn export_child() {
    let Ok(role) = std::env::var(ROLE) else {
        return;
    };
    let socket = UnixStream::connect(std::env::var("STABLEBUF_EXPORT_SOCKET").unwrap()).unwrap();
    let ctx = open_device(0).unwrap();
    let stream = ctx.new_stream().unwrap();
    let mut expect = Expectation {
        tag: Some("weights".into()),
        layout_fingerprint: Some(env_u64("STABLEBUF_EXPORT_FINGERPRINT")),
        bytes: Some(env_u64("STABLEBUF_EXPORT_BYTES")),
    };
    match role.as_str() {
        "writer" | "killed" => {
            let (set, offer) = receive_weight_set(&socket, &ctx, &expect).unwrap();
            assert!(set.is_imported());
            let seed = env_u64("STABLEBUF_SEED");
            let data = weights(seed);
            let written = if role == "killed" {
                X_BYTES / 2
            } else {
                X_BYTES
            };
            write_weights(&ctx, &stream, &set, &data[..written / 4]);
            if role == "killed" {
                println!("\n{READY}");
                std::io::Write::flush(&mut std::io::stdout()).unwrap();
                std::thread::sleep(std::time::Duration::from_secs(60));
                panic!("never killed");
            }
            // Everything written is done (write_weights synchronised): now commit.
            let commit = PublishMessage::Commit {
                set: offer.set,
                version: 1,
            };
            publish::send(&socket, &commit, None).unwrap();
            // Hold the set until the engine lets go of the connection.
            assert!(matches!(
                receive_plain(&socket),
                Err(Error::Share(ShareError::Protocol(ProtocolError::Closed)))
            ));
        }
        "picky" => {
            let field = std::env::var("STABLEBUF_EXPORT_WRONG").unwrap();
            match field.as_str() {
                "fingerprint" => expect.layout_fingerprint = Some(1),
                "bytes" => expect.bytes = Some(2 * MIB as u64),
                "tag" => expect.tag = Some("kv".into()),
                "device" => {} // the engine forges the offer's device
                other => panic!("unknown field {other}"),
            }
            let got = receive_weight_set(&socket, &ctx, &expect);
            let typed = match (field.as_str(), &got) {
                ("device", Err(Error::Share(ShareError::DeviceMismatch { .. }))) => true,
                ("fingerprint", Err(Error::Share(ShareError::OfferMismatch { what, .. }))) => {
                    *what == "layout fingerprint"
                }
                ("bytes", Err(Error::Share(ShareError::OfferMismatch { what, .. }))) => {
                    *what == "bytes"
                }
                ("tag", Err(Error::Share(ShareError::OfferMismatch { what, .. }))) => {
                    *what == "tag"
                }
                _ => false,
            };
            assert!(typed, "{field}: {:?}", got.map(|(_, offer)| offer));
        }
        other => panic!("unknown role {other}"),
    }
}

/// Writes `data` at the weights' offset of the imported set `set`, through a staging region
/// of the trainer's own, and waits for the copy.
fn write_weights(
    ctx: &Arc<stablebuf::cudarc::driver::CudaContext>,
    stream: &Arc<stablebuf::cudarc::driver::CudaStream>,
    set: &Snapshot,
    data: &[f32],
) {
    let bytes = std::mem::size_of_val(data);
    let staging = Region::new(ctx, "staging", RegionOptions::default()).unwrap();
    let source = staging.alloc(bytes).unwrap();
    staging.write(stream, source, data).unwrap();
    let target = Range {
        ptr: set.home_ptr().unwrap(),
        bytes: set.bytes(),
    };
    let offset = env_u64("STABLEBUF_EXPORT_X_OFFSET") as usize;
    copy_between(
        stream,
        &target,
        offset,
        &Range { ptr: source, bytes },
        0,
        bytes,
    )
    .unwrap();
    stream.synchronize().unwrap();
}

// ---------------------------------------------------------------- the engine (the tests)

#[test]
#[ignore = "needs a CUDA GPU"]
fn a_set_written_by_another_process_is_bound_and_the_graph_replays_on_it() {
    let seed = fresh_seed();
    eprintln!("publish: seed {seed}");
    let mut engine = Engine::new(seed);
    engine.replay_and_check(&engine.first, "before publishing");
    let trainer = Trainer::spawn(&engine, "writer", seed + 1, &[]);
    trainer.offer(&engine).unwrap();
    let commit = receive_plain(&trainer.socket).unwrap();
    assert_eq!(
        commit,
        PublishMessage::Commit {
            set: engine.spare.id(),
            version: 1
        }
    );
    // Still serving the first set until the bind.
    engine.replay_and_check(&engine.first, "committed, not bound yet");
    engine.region.bind(&engine.spare).unwrap();
    assert_eq!(
        engine.region.stats().mappings,
        1,
        "one mapping for the span"
    );
    let published = weights(seed + 1);
    engine.replay_and_check(&published, "bound the published set");
    assert!(engine.graph.check_update().unwrap().is_success());
    // Swapping back and forth is one remap each way.
    engine.region.bind(&engine.original).unwrap();
    engine.replay_and_check(&engine.first, "back on the first set");
    engine.region.bind(&engine.spare).unwrap();
    engine.replay_and_check(&published, "on the published set again");
    trainer.finish();
    // The set outlives the trainer: this process holds its own handle.
    engine.replay_and_check(&published, "after the trainer exited");
}

#[test]
#[ignore = "needs a CUDA GPU"]
fn a_sleeping_engine_wakes_straight_onto_a_published_set() {
    let seed = fresh_seed();
    eprintln!("wake onto: seed {seed}");
    let engine = Engine::new(seed);
    engine
        .region
        .sleep(&HostStorage::Discard, &engine.gpu.stream)
        .unwrap();
    let trainer = Trainer::spawn(&engine, "writer", seed + 1, &[]);
    trainer.offer(&engine).unwrap();
    assert!(matches!(
        receive_plain(&trainer.socket).unwrap(),
        PublishMessage::Commit { version: 1, .. }
    ));
    assert!(matches!(
        engine.region.bind(&engine.spare),
        Err(Error::Region(RegionError::RegionAsleep { .. }))
    ));
    engine.region.wake_onto(&engine.spare).unwrap();
    assert!(!engine.region.is_asleep());
    assert!(engine.region.bound().unwrap().same_as(&engine.spare));
    engine.replay_and_check(&weights(seed + 1), "woken onto the published set");
    assert!(matches!(
        engine.region.wake_onto(&engine.spare),
        Err(Error::Region(RegionError::SnapshotMismatch { .. }))
    ));
    trainer.finish();
}

#[test]
#[ignore = "needs a CUDA GPU"]
fn offers_that_differ_are_refused_naming_the_field_and_change_nothing() {
    let seed = fresh_seed();
    let engine = Engine::new(seed);
    for field in ["fingerprint", "bytes", "tag", "device"] {
        let trainer = Trainer::spawn(
            &engine,
            "picky",
            seed + 7,
            &[("STABLEBUF_EXPORT_WRONG", field.to_string())],
        );
        let answer = if field == "device" {
            offer_forged_device(&trainer.socket, &engine)
        } else {
            trainer.offer(&engine)
        };
        match answer {
            Err(Error::Share(ShareError::Rejected { reason })) => {
                eprintln!("{field}: rejected: {reason}")
            }
            other => panic!("{field}: expected a rejection, got {other:?}"),
        }
        trainer.finish(); // exits 0 only if it saw the matching typed error
        engine.replay_and_check(&engine.first, field);
    }
}

/// The spare set offered as if it lived on another GPU.
fn offer_forged_device(socket: &UnixStream, engine: &Engine) -> Result<(), Error> {
    let fd = engine.spare.export()?;
    let mut uuid = engine.gpu.ctx.uuid().unwrap().bytes.map(|b| b as u8);
    uuid[0] ^= 0xff;
    let offer = SetOffer {
        set: engine.spare.id(),
        tag: "weights".into(),
        layout_fingerprint: engine.region.layout_fingerprint(),
        bytes: engine.spare.bytes() as u64,
        granularity: 2 * MIB as u64,
        device_uuid: uuid,
    };
    publish::send(socket, &PublishMessage::Offer(offer), Some(&fd))?;
    wait_set_ack(socket, engine.spare.id())
}

#[test]
#[ignore = "needs a CUDA GPU"]
fn a_trainer_killed_mid_write_leaves_the_old_set_serving_and_the_set_reusable() {
    let seed = fresh_seed();
    eprintln!("killed: seed {seed}");
    let engine = Engine::new(seed);
    let mut trainer = Trainer::spawn(&engine, "killed", seed + 1, &[]);
    trainer.offer(&engine).unwrap();
    trainer.wait_ready(); // half the new weights are in the spare set
    let socket = trainer.socket.try_clone().unwrap();
    trainer.kill();
    assert!(matches!(
        receive_plain(&socket),
        Err(Error::Share(ShareError::Protocol(ProtocolError::Closed)))
    ));
    assert!(engine.region.bound().unwrap().same_as(&engine.original));
    engine.replay_and_check(&engine.first, "after the trainer died");
    // The half-written set is not bound; the next trainer writes it whole and it serves.
    let next = Trainer::spawn(&engine, "writer", seed + 2, &[]);
    next.offer(&engine).unwrap();
    assert!(matches!(
        receive_plain(&next.socket).unwrap(),
        PublishMessage::Commit { version: 1, .. }
    ));
    engine.region.bind(&engine.spare).unwrap();
    engine.replay_and_check(&weights(seed + 2), "rewritten by the next trainer");
    next.finish();
}
