//! The consumer half of the two-process demo (see `ipc_producer`): connects to the producer's
//! socket, receives the file descriptor and the layout fingerprint, refuses a mismatched layout,
//! imports the memory, binds it at its own stable slot address, verifies every element and sends
//! an ACK. Started without a socket path, it runs `ipc_producer`, which starts a consumer, so
//! either binary alone runs the whole exchange.

mod support;

use std::os::unix::net::UnixStream;
use std::path::PathBuf;
use std::process::Command;

use clap::Parser;
use stablebuf::share::{receive_dataset, send_ack};
use stablebuf::{Layout, Result, Space};

const LEN: usize = 16 << 20;

/// The consumer of the two-process demo: receives a dataset's file descriptor from
/// `ipc_producer`, maps it at its own slot address, verifies it and acknowledges.
#[derive(Parser)]
struct Args {
    /// The producer's socket. Without it, this runs `ipc_producer`, which starts a consumer.
    socket: Option<PathBuf>,
    #[command(flatten)]
    common: support::Common,
}

fn main() -> std::process::ExitCode {
    let args = Args::parse();
    support::run(&args.common, || run(&args))
}

fn run(args: &Args) -> Result<()> {
    let Some(path) = &args.socket else {
        let producer = std::env::current_exe()
            .map_err(|e| stablebuf::Error::Io {
                call: "current_exe",
                source: e,
            })?
            .with_file_name("ipc_producer");
        let status = Command::new(producer)
            .args(["--device", &args.common.device.to_string()])
            .status()
            .map_err(|e| stablebuf::Error::Io {
                call: "spawn ipc_producer",
                source: e,
            })?;
        std::process::exit(status.code().unwrap_or(1));
    };
    let ctx = args.common.open_device()?;
    let stream = ctx.new_stream()?;
    let layout = Layout::builder()
        .group("data")
        .input("pattern", LEN * 4)
        .build()?;
    let space = Space::new(&ctx, layout)?;
    let socket = UnixStream::connect(path).map_err(|e| stablebuf::Error::Io {
        call: "connect",
        source: e,
    })?;
    let (dataset, offer) = receive_dataset(&socket, &space)?;
    println!(
        "consumer: received fd for {} MiB of group `{}`, layout {:016x} (matches ours)",
        offer.bytes >> 20,
        offer.group,
        offer.layout_fingerprint
    );
    space.bind(&dataset)?;
    println!(
        "consumer: mapped at our slot address {:#x}",
        space.slot("pattern")?.device_ptr()
    );
    let data: Vec<u32> = space.read(&stream, "pattern")?;
    let bad = data
        .iter()
        .enumerate()
        .filter(|&(i, &v)| v != ((i as u32).wrapping_mul(2).wrapping_add(1337) ^ 0xDEAD_BEEF))
        .count();
    if bad > 0 {
        eprintln!("consumer: {bad} of {LEN} elements differ");
        std::process::exit(1);
    }
    println!("consumer: verified all {LEN} elements: OK");
    send_ack(&socket, offer.dataset)?;
    println!("consumer: sent ACK");
    Ok(())
}
