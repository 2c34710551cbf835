//! Two matmuls in sequence on the same slot addresses. After the first, its physical memory is
//! released while the addresses stay reserved; the second dataset is mapped there and the same
//! kernel, with the same pointers, computes on it. Exits non-zero on any mismatch.

#[path = "../tests/common/mod.rs"]
mod common;
mod support;

use clap::Parser;
use common::{assert_matches, cpu_matmul, max_abs_error, random_vec, rng};
use stablebuf::device::memory_info;
use stablebuf::kernels::{Kernels, MatmulKernel};
use stablebuf::{Layout, Space};

/// Run a matmul on a dataset, release its physical memory, map a second dataset at the same
/// slot addresses and run the same kernel with the same pointers; checked against the CPU.
#[derive(Parser)]
struct Args {
    #[command(flatten)]
    common: support::Common,
}

fn main() -> std::process::ExitCode {
    let args = Args::parse();
    support::run(&args.common, || run(&args))
}

fn run(args: &Args) -> stablebuf::Result<()> {
    let (m, n, k) = (512usize, 384usize, 640usize);
    let ctx = args.common.open_device()?;
    let stream = ctx.new_stream()?;
    let kernels = Kernels::load(&ctx)?;
    let layout = Layout::builder()
        .group("matmul")
        .input("a", m * k * 4)
        .input("b", k * n * 4)
        .output("c", m * n * 4)
        .build()?;
    let space = Space::new(&ctx, layout)?;
    let mut rng = rng("reuse_virtual_address");
    let names = ["a", "b", "c"];
    let mut address_sets = Vec::new();

    for run in 1..=2 {
        let dataset = space.new_dataset("matmul")?;
        let (a, b) = (random_vec(&mut rng, m * k), random_vec(&mut rng, k * n));
        dataset.write(&stream, "a", &a)?;
        dataset.write(&stream, "b", &b)?;
        dataset.write(&stream, "c", &vec![f32::NAN; m * n])?; // poison
        space.bind(&dataset)?;
        let slots: Vec<_> = names
            .iter()
            .map(|s| space.slot(s).cloned())
            .collect::<Result<_, _>>()?;
        kernels.matmul(
            &stream,
            MatmulKernel::Auto,
            &slots[0],
            &slots[1],
            &slots[2],
            m,
            n,
            k,
        )?;
        let got: Vec<f32> = space.read(&stream, "c")?;
        let want = cpu_matmul(&a, &b, m, n, k);
        println!(
            "run {run}: dataset {} bound ({} MiB physical)",
            dataset.id(),
            dataset.bytes() >> 20
        );
        for slot in &slots {
            println!("  {:<2} at {:#x}", slot.name(), slot.device_ptr());
        }
        println!(
            "  max |error| vs CPU reference: {:.2e}",
            max_abs_error(&got, &want)
        );
        assert_matches(&got, &want, k, &format!("run {run}"));
        address_sets.push(slots.iter().map(|s| s.device_ptr()).collect::<Vec<_>>());

        let (held, _) = memory_info(&ctx)?;
        drop(dataset); // unbinds (after the GPU is done) and releases the physical memory
        let (free_after, _) = memory_info(&ctx)?;
        println!(
            "  released: free device memory {} MiB while bound, {} MiB after dropping the dataset (+{} MiB)",
            held >> 20,
            free_after >> 20,
            (free_after.saturating_sub(held)) >> 20
        );
        if free_after <= held {
            eprintln!("physical memory was not released");
            std::process::exit(1);
        }
    }

    let same = address_sets[0] == address_sets[1];
    println!("same: {}", if same { "YES" } else { "NO" });
    if !same {
        std::process::exit(1);
    }
    Ok(())
}
