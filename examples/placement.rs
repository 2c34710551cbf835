//! Replay cost of a graph that reads a 1 GiB slot, with the slot's dataset placed on this GPU,
//! on a peer GPU (over NVLink or PCIe, if there is a second GPU with peer access) and in pinned
//! host memory. The graph is the same exec in every case: only the bind changes.
//!
//! Run: `cargo run --release --example placement [-- <MiB>]` (default 1024).

use std::time::Instant;

use stablebuf::buffer::copy_between;
use stablebuf::{open_device, Layout, Location, Result, Space, SpaceOptions, StableGraph};

const MIB: usize = 1 << 20;

fn main() {
    if let Err(error) = run() {
        eprintln!("error: {error}");
        eprintln!(
            "this example needs an NVIDIA GPU with a CUDA driver ≥ 12.4; see scripts/gpu-bundle"
        );
        std::process::exit(1);
    }
}

fn median(mut values: Vec<f64>) -> f64 {
    values.sort_by(f64::total_cmp);
    values[values.len() / 2]
}

fn run() -> Result<()> {
    let mib: usize = std::env::args()
        .nth(1)
        .and_then(|a| a.parse().ok())
        .unwrap_or(1024);
    let bytes = mib * MIB;
    let ctx = open_device(0)?;
    let peer = (stablebuf::device_count()? >= 2
        && stablebuf::can_access_peer(0, 1)?
        && stablebuf::can_access_peer(1, 0)?)
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
    println!(
        "{:<14} {:>12} {:>10} {:>12}",
        "dataset at", "replay µs", "GB/s", "vs this GPU"
    );
    let mut local_us = None;
    for (name, at) in placements {
        let dataset = match space.new_dataset_at("data", at) {
            Ok(dataset) => dataset,
            Err(error) => {
                println!("{name:<14} not available here: {error}");
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
        let us = median(times[2..].to_vec());
        let base = *local_us.get_or_insert(us);
        println!(
            "{name:<14} {us:>12.1} {:>10.1} {:>11.2}x",
            bytes as f64 / us / 1e3,
            us / base
        );
    }
    if peer.is_none() {
        println!("peer GPU       needs a second GPU with peer access (not present here)");
    }
    Ok(())
}
