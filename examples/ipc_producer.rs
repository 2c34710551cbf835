//! The producer half of the seed's two-process demo: GPU memory made shareable, filled with
//! `data[i] = (i * 2 + 1337) ^ 0xDEADBEEF`, exported as a POSIX file descriptor and sent over a
//! Unix socket (SCM_RIGHTS) to a consumer, which maps it at its own stable slot address, verifies
//! every element and acknowledges. One command runs both: this spawns `ipc_consumer` (the sibling
//! binary) with the socket path. Exits non-zero on any failure.

mod support;

use std::os::unix::net::UnixListener;
use std::process::Command;

use clap::Parser;
use stablebuf::share::{send_dataset, wait_ack};
use stablebuf::{Layout, Result, Space, SpaceOptions};

const LEN: usize = 16 << 20; // u32 elements, 64 MiB

/// The producer of the two-process demo: exports a filled dataset as a file descriptor over a
/// Unix socket to `ipc_consumer` (started here), which maps and verifies it.
#[derive(Parser)]
struct Args {
    #[command(flatten)]
    common: support::Common,
}

fn main() -> std::process::ExitCode {
    let args = Args::parse();
    support::run(&args.common, || run(&args))
}

fn run(args: &Args) -> Result<()> {
    let ctx = args.common.open_device()?;
    let stream = ctx.new_stream()?;
    let layout = Layout::builder()
        .group("data")
        .input("pattern", LEN * 4)
        .build()?;
    let space = Space::with_options(&ctx, layout, SpaceOptions::default().shareable(true))?;
    let dataset = space.new_dataset("data")?;
    let data: Vec<u32> = (0..LEN as u32)
        .map(|i| (i.wrapping_mul(2).wrapping_add(1337)) ^ 0xDEAD_BEEF)
        .collect();
    dataset.write(&stream, "pattern", &data)?;
    println!(
        "producer: wrote {LEN} elements ({} MiB) with data[i] = (i * 2 + 1337) ^ 0xDEADBEEF",
        (LEN * 4) >> 20
    );

    let path = std::env::temp_dir().join(format!("stablebuf-demo-{}.sock", std::process::id()));
    let _ = std::fs::remove_file(&path);
    let listener = UnixListener::bind(&path).map_err(|e| stablebuf::Error::Io {
        call: "bind",
        source: e,
    })?;
    let consumer = std::env::current_exe()
        .map_err(|e| stablebuf::Error::Io {
            call: "current_exe",
            source: e,
        })?
        .with_file_name("ipc_consumer");
    let mut child = Command::new(&consumer)
        .arg(&path)
        .args(["--device", &args.common.device.to_string()])
        .spawn()
        .map_err(|e| stablebuf::Error::Io {
            call: "spawn ipc_consumer",
            source: e,
        })?;
    let (socket, _) = listener.accept().map_err(|e| stablebuf::Error::Io {
        call: "accept",
        source: e,
    })?;

    send_dataset(&socket, &dataset)?;
    println!("producer: exported the memory as a file descriptor and sent it with its layout fingerprint");
    wait_ack(&socket, dataset.id())?;
    println!("producer: received ACK");
    let status = child.wait().map_err(|e| stablebuf::Error::Io {
        call: "wait",
        source: e,
    })?;
    let _ = std::fs::remove_file(&path);
    if !status.success() {
        eprintln!("producer: consumer failed ({status})");
        std::process::exit(1);
    }
    println!("producer: done");
    Ok(())
}
