//! The decode loop of `examples/decode_loop.rs` as a criterion bench: a memory-bound bf16 step
//! of 32 MLP layers (hidden 2048, MLP 4×, 2 GiB of weights per set, one graph of ~200 nodes)
//! given a new weight set every step by (a) stablebuf lanes rebinding, (b) serial copy-in,
//! (c) pipelined copy-in and (d) re-capture, against (e) the same replay with no swap.
//!
//! One criterion iteration is one chunk of 24 steps of the variant, followed at once by one
//! chunk of each of its partners (A B A B: its floor, and for the copy-ins the 3-lane rebind);
//! the time reported is µs per step (median of 6-step windows of CUDA-event step ends inside
//! the chunk). Every step's output is checked against the no-swap reference of its weight set.
//! At the end a table gives per-step medians and the median of the per-pair ratios with their
//! spread.

#[path = "../examples/decode/mod.rs"]
mod decode;

use std::cell::RefCell;
use std::sync::Arc;
use std::time::Duration;

use criterion::{Criterion, SamplingMode};
use decode::loops::{median, window_times, Checked, LaneSteps, Runner, Setup, Variant};
use decode::Shape;
use stablebuf::device::memory_info;
use stablebuf::kernels::{Activation, DecodeKernels};
use stablebuf::{driver_present, open_device, Space};

const CHUNK: usize = 24;
const SKIP: usize = 2;
const WINDOW: usize = 6;
const SETS: usize = 4;

/// Per-step µs of every sample, by (batch, variant), and the ratios of each pair.
#[derive(Default)]
struct Samples {
    per_step: Vec<(usize, String, f64)>,
    pairs: Vec<(usize, String, String, f64)>,
}

fn percentile(values: &[f64], p: f64) -> f64 {
    let mut sorted = values.to_vec();
    sorted.sort_by(f64::total_cmp);
    if sorted.is_empty() {
        return f64::NAN;
    }
    sorted[((sorted.len() - 1) as f64 * p).round() as usize]
}

fn main() {
    if !driver_present() {
        eprintln!("no CUDA driver: skipping the decode bench");
        return;
    }
    let ctx = open_device(0).expect("device 0");
    let kernels = Arc::new(DecodeKernels::load(&ctx).expect("decode kernels"));
    let shape = Shape {
        layers: 32,
        hidden: 2048,
        ratio: 4,
        max_batch: 8,
        act: Activation::GeluTanh,
        ranks: 1,
        rank: 0,
    };
    let main_space = Space::new(&ctx, decode::layout(shape).unwrap()).unwrap();
    let set_bytes = main_space.placement().groups[0].bytes;
    let (free, _) = memory_info(&ctx).unwrap();
    if (SETS + 3) * set_bytes + (1 << 30) > free {
        eprintln!(
            "decode bench: needs {} GiB free; skipping",
            (((SETS + 3) * set_bytes) >> 30) + 1
        );
        return;
    }
    let fill = ctx.new_stream().unwrap();
    let sets = decode::loops::make_sets(&main_space, &kernels, &fill, shape, SETS, 1).unwrap();
    let setup = Setup::new(&ctx, &kernels, shape, main_space, &sets).unwrap();
    let runner = Runner::new(&ctx, &kernels, shape, CHUNK).unwrap();
    let mut c = Criterion::default()
        .sample_size(10)
        .warm_up_time(Duration::from_millis(1))
        .measurement_time(Duration::from_millis(10))
        .configure_from_args();
    let samples = RefCell::new(Samples::default());
    let checked = RefCell::new(Checked::default());

    for batch in [1usize, 8] {
        let replay = setup.replay(batch).unwrap();
        let references = setup.references(&replay, batch).unwrap();
        let lanes2 = setup.lanes(2, batch).unwrap();
        let lanes3 = setup.lanes(3, batch).unwrap();
        // Every variant, and which others each one's iterations pair with.
        let variants: Vec<RefCell<Box<dyn Variant + '_>>> = vec![
            RefCell::new(Box::new(replay)),
            RefCell::new(Box::new(LaneSteps::new(lanes2.clone(), false, &sets))),
            RefCell::new(Box::new(LaneSteps::new(lanes2, true, &sets))),
            RefCell::new(Box::new(LaneSteps::new(lanes3.clone(), false, &sets))),
            RefCell::new(Box::new(LaneSteps::new(lanes3, true, &sets))),
            RefCell::new(Box::new(setup.copy_serial(batch).unwrap())),
            RefCell::new(Box::new(setup.copy_pipelined(batch).unwrap())),
            RefCell::new(Box::new(setup.recapture(batch).unwrap())),
        ];
        let index = |label: &str| {
            variants
                .iter()
                .position(|v| v.borrow().label() == label)
                .expect("a known variant")
        };
        let next = RefCell::new(vec![0usize; variants.len()]);
        // Runs one chunk of variant `k`, checks it, returns its per-step µs.
        let chunk = |k: usize| -> f64 {
            let mut variant = variants[k].borrow_mut();
            let first = next.borrow()[k];
            next.borrow_mut()[k] += CHUNK;
            let result = runner.chunk(variant.as_mut(), first, CHUNK, batch).unwrap();
            checked
                .borrow_mut()
                .add(variant.label(), &result, &references);
            median(&window_times(&result.ends_us, SKIP, WINDOW))
        };
        for k in 0..variants.len() {
            chunk(k); // warm-up, checked
        }
        let plan: [(&str, &[&str]); 5] = [
            ("a2", &["e2"]),
            ("a3", &["e3"]),
            ("b", &["e1", "a3"]),
            ("c", &["e1", "a3"]),
            ("d", &["e1"]),
        ];
        let mut group = c.benchmark_group(format!("decode/batch {batch}"));
        group.sampling_mode(SamplingMode::Flat);
        for (label, partners) in plan {
            let (k, partners): (usize, Vec<usize>) =
                (index(label), partners.iter().map(|p| index(p)).collect());
            group.bench_function(label, |b| {
                b.iter_custom(|iters| {
                    let mut total = 0.0;
                    for _ in 0..iters {
                        let us = chunk(k);
                        total += us;
                        let mut s = samples.borrow_mut();
                        s.per_step.push((batch, label.to_string(), us));
                        for &p in &partners {
                            let partner_us = chunk(p);
                            let partner = variants[p].borrow().label().to_string();
                            s.per_step.push((batch, partner.clone(), partner_us));
                            s.pairs
                                .push((batch, label.to_string(), partner, us / partner_us));
                        }
                    }
                    Duration::from_secs_f64(total * 1e-6)
                })
            });
        }
        group.finish();
    }
    c.final_summary();

    let samples = samples.into_inner();
    println!("\n== decode loop, µs per step (medians of samples; ratios: median of per-pair ratios, p10..p90)");
    println!(
        "{:>5} {:>8} {:>10} {:>9} {:>9} {:>18}",
        "batch", "variant", "µs/step", "partner", "its µs", "variant/partner"
    );
    let mut seen = Vec::new();
    for (batch, label, partner, _) in &samples.pairs {
        if seen.contains(&(batch, label, partner)) {
            continue;
        }
        seen.push((batch, label, partner));
        let per_step = |name: &str| {
            let values: Vec<f64> = samples
                .per_step
                .iter()
                .filter(|(b, l, _)| b == batch && l == name)
                .map(|(_, _, us)| *us)
                .collect();
            median(&values)
        };
        let ratios: Vec<f64> = samples
            .pairs
            .iter()
            .filter(|(b, l, p, _)| b == batch && l == label && p == partner)
            .map(|(_, _, _, r)| *r)
            .collect();
        println!(
            "{batch:>5} {label:>8} {:>10.1} {partner:>9} {:>9.1} {:>8.3}x ({:.3}..{:.3})",
            per_step(label),
            per_step(partner),
            median(&ratios),
            percentile(&ratios, 0.1),
            percentile(&ratios, 0.9)
        );
    }
    println!("targets (H100): a2/e2 and a3/e3 <= 1.05x; at batch 1, b/a3 and c/a3 >= 2x");
    let checked = checked.into_inner();
    println!(
        "outputs checked: {} steps, {} bit-identical to the reference, max |diff|/rms {:.1e}",
        checked.steps, checked.bitwise, checked.worst
    );
    assert!(
        checked.failures.is_empty(),
        "decode bench outputs differ from the reference: {:#?}",
        checked.failures
    );
}
