//! Shared by the benches: a device (or a clean skip without one), criterion settings, and a
//! recorder that prints each group's medians side by side with ratios at the end of the run.
#![allow(dead_code)]

use std::collections::BTreeMap;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use criterion::Criterion;
use stablebuf::cudarc::driver::{CudaContext, CudaStream};
use stablebuf::{driver_present, open_device, Kernels};

pub struct Gpu {
    pub ctx: Arc<CudaContext>,
    pub stream: Arc<CudaStream>,
    pub kernels: Arc<Kernels>,
}

/// The device, or `None` (with a message) where there is none, so `cargo bench` on a machine
/// without a GPU skips instead of failing.
pub fn gpu() -> Option<Gpu> {
    if !driver_present() {
        eprintln!("no CUDA driver: skipping GPU benches");
        return None;
    }
    let ctx = open_device(0).ok()?;
    let stream = ctx.new_stream().ok()?;
    let kernels = Arc::new(Kernels::load(&ctx).ok()?);
    Some(Gpu {
        ctx,
        stream,
        kernels,
    })
}

pub fn criterion() -> Criterion {
    Criterion::default()
        .sample_size(10)
        .warm_up_time(Duration::from_millis(300))
        .measurement_time(Duration::from_secs(1))
        .configure_from_args()
}

type Key = (String, String); // (row, variant)

/// Seconds per iteration of every sample, by group, row and variant.
#[derive(Default)]
pub struct Recorder {
    samples: Mutex<BTreeMap<String, BTreeMap<Key, Vec<f64>>>>,
    order: Mutex<Vec<String>>,
}

impl Recorder {
    pub fn record(&self, group: &str, row: &str, variant: &str, seconds_per_iter: f64) {
        let mut samples = self.samples.lock().unwrap();
        let mut order = self.order.lock().unwrap();
        if !order.iter().any(|g| g == group) {
            order.push(group.to_string());
        }
        samples
            .entry(group.into())
            .or_default()
            .entry((row.into(), variant.into()))
            .or_default()
            .push(seconds_per_iter);
    }

    /// Median seconds per iteration.
    pub fn median(&self, group: &str, row: &str, variant: &str) -> Option<f64> {
        let samples = self.samples.lock().unwrap();
        let mut v = samples
            .get(group)?
            .get(&(row.to_string(), variant.to_string()))?
            .clone();
        v.sort_by(f64::total_cmp);
        (!v.is_empty()).then(|| v[v.len() / 2])
    }

    /// Prints, for `group`, one line per row: each variant's median (in `unit`, scaled by
    /// `scale`), then `numerator / denominator` for each ratio asked for.
    pub fn table(
        &self,
        group: &str,
        variants: &[&str],
        rows: &[String],
        unit: &str,
        scale: f64,
        ratios: &[(&str, &str)],
    ) {
        println!("\n== {group} (medians, {unit}; ratios from the same run)");
        let mut header = format!("{:<14}", "");
        for v in variants {
            header += &format!(" {v:>16}");
        }
        for (n, d) in ratios {
            header += &format!(" {:>22}", format!("{n}/{d}"));
        }
        println!("{header}");
        for row in rows {
            let mut line = format!("{row:<14}");
            for v in variants {
                match self.median(group, row, v) {
                    Some(s) => line += &format!(" {:>16.2}", s * scale),
                    None => line += &format!(" {:>16}", "-"),
                }
            }
            for (n, d) in ratios {
                match (self.median(group, row, n), self.median(group, row, d)) {
                    (Some(a), Some(b)) => line += &format!(" {:>21.2}x", a / b),
                    _ => line += &format!(" {:>22}", "-"),
                }
            }
            println!("{line}");
        }
    }
}

pub fn human_bytes(bytes: usize) -> String {
    if bytes >= 1 << 30 {
        format!("{}GiB", bytes >> 30)
    } else if bytes >= 1 << 20 {
        format!("{}MiB", bytes >> 20)
    } else {
        format!("{}KiB", bytes >> 10)
    }
}
