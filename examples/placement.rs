//! Replay cost of a graph that reads a 1 GiB slot, with the slot's dataset placed on this GPU,
//! on a peer GPU (over NVLink or PCIe, if there is a second GPU with peer access) and in pinned
//! host memory. The graph is the same exec in every case: only the bind changes.
//!
//! Run: `cargo run --release --example placement [-- <MiB>]` (default 1024).

mod support;

use std::time::Instant;

use clap::Parser;
use stablebuf::buffer::copy_between;
use stablebuf::vmm::Location;
use stablebuf::{Layout, Result, Space, SpaceOptions, StableGraph};

const MIB: usize = 1 << 20;

/// Replay cost of one graph reading a slot whose dataset sits on this GPU, on a peer GPU or in
/// pinned host memory: the same exec each time, only the bind changes.
#[derive(Parser)]
struct Args {
    /// Size of the slot the graph reads, in MiB.
    #[arg(default_value_t = 1024, value_parser = support::at_least(1))]
    mib: usize,
    #[command(flatten)]
    common: support::Common,
}

fn main() -> std::process::ExitCode {
    let args = Args::parse();
    support::run(&args.common, || run(&args))
}

fn run(args: &Args) -> Result<()> {
    let mib = args.mib;
    let bytes = mib * MIB;
    let ctx = args.common.open_device()?;
    let peer = (stablebuf::device::device_count()? >= 2
        && stablebuf::device::can_access_peer(0, 1)?
        && stablebuf::device::can_access_peer(1, 0)?)
    .then_some(1);
    let layout = Layout::builder()
        .group("data")
        .input("x", bytes)
        .scratch("y", bytes)
        .build()?;
    let options = SpaceOptions::default().peers(peer);
    let space = Space::with_options(&ctx, layout, options)?;
    let stream = ctx.new_stream()?;
    let words = bytes / 4;
    let pattern: Vec<f32> = (0..words).map(|i| (i % 977) as f32 * 0.5).collect();
    let mut placements = vec![("this GPU", Location::Device(0))];
    if let Some(peer) = peer {
        placements.push(("peer GPU", Location::Device(peer)));
    }
    placements.push(("pinned host", Location::Host));
    let (x, y) = (space.slot("x")?.clone(), space.slot("y")?.clone());
    // Copy nodes check their addresses when captured: capture with a dataset bound.
    let first = space.new_dataset("data")?;
    space.bind(&first)?;
    let graph = StableGraph::capture(&stream, &[&space], move |s| {
        copy_between(s, &y, 0, &x, 0, x.bytes())
    })?;
    drop(first);
    println!("graph: one copy that reads the {mib} MiB slot `x` and writes local scratch");
    let mut table = support::table(["dataset at", "replay µs", "GB/s", "vs this GPU"]);
    let mut notes = Vec::new();
    let mut local_us = None;
    for (name, at) in placements {
        let dataset = match space.new_dataset_at("data", at) {
            Ok(dataset) => dataset,
            Err(error) => {
                notes.push(format!("{name}: not available here: {error}"));
                continue;
            }
        };
        dataset.write(&stream, "x", &pattern)?;
        space.bind(&dataset)?;
        let mut times = Vec::new();
        for _ in 0..12 {
            stream.synchronize()?;
            let start = Instant::now();
            graph.replay()?;
            stream.synchronize()?;
            times.push(start.elapsed().as_secs_f64() * 1e6);
        }
        let head: Vec<f32> = space.read::<f32>(&stream, "y")?[..1024].to_vec();
        assert_eq!(head, pattern[..1024], "the replay read the bound dataset");
        let us = support::percentile(&times[2..], 0.5);
        let base = *local_us.get_or_insert(us);
        table.add_row([
            name.to_string(),
            format!("{us:.1}"),
            format!("{:.1}", bytes as f64 / us / 1e3),
            format!("{:.2}x", us / base),
        ]);
    }
    println!("{table}");
    if peer.is_none() {
        notes.push("peer GPU: needs a second GPU with peer access (not present here)".into());
    }
    for note in notes {
        println!("{note}");
    }
    Ok(())
}
