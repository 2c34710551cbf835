//! How a bind puts a dataset's data under a group's slots: remap or copy, and a cost model that
//! picks between them.
//!
//! A remap costs about the same at any size (unmap + map + set-access: ~50 µs at 2 MiB, ~110 µs
//! at 1 GiB on an H100); a copy costs time proportional to the bytes (~8 µs at 2 MiB, ~720 µs at
//! 1 GiB). Below roughly 100 MiB copying wins.

use std::collections::HashMap;
use std::sync::{Arc, Mutex, OnceLock};
use std::time::Instant;

use cudarc::driver::CudaContext;

use crate::driver::{
    self,
    vmm::{granularity, Mapping, Physical, Reservation},
};
use crate::error::Result;

/// How binding puts a dataset's data under a group's slots.
///
/// - `Remap` maps the dataset's memory under the slots. The cost is fixed, whatever the size.
///   Outputs land in the dataset itself.
/// - `CopyIn` keeps memory the space owns under the slots and copies the dataset's *input*
///   slots into it. The cost is proportional to the bytes, and the space needs the group's size
///   again in memory. Outputs land in the space's memory;
///   [`Space::copy_out`](crate::Space::copy_out) copies them into the dataset when you need
///   them there.
/// - `Auto` resolves to one of the two when the space is created, using the cost model for the
///   group's size.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum BindStrategy {
    /// Map the dataset's memory under the slots (the default).
    #[default]
    Remap,
    /// Copy the dataset's input slots into memory the space owns.
    CopyIn,
    /// Pick one of the two for the group's size with the cost model, when the space is created.
    Auto,
}

/// Predicted bind cost, linear in bytes for each strategy (µs = fixed + per_gib × GiB).
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct CostModel {
    /// Cost of a remap of any size, in µs (unmap + map + set-access, fence included).
    pub remap_fixed_us: f64,
    /// What each GiB adds to a remap, in µs.
    pub remap_us_per_gib: f64,
    /// Cost of an empty device-to-device copy, in µs.
    pub copy_fixed_us: f64,
    /// What each GiB adds to a copy, in µs (the inverse of copy bandwidth).
    pub copy_us_per_gib: f64,
}

const GIB: f64 = (1u64 << 30) as f64;

impl CostModel {
    /// Fitted to the H100 measurements in the project's notes. Used when calibration is skipped.
    pub const H100: CostModel = CostModel {
        remap_fixed_us: 60.0,
        remap_us_per_gib: 40.0,
        copy_fixed_us: 6.0,
        copy_us_per_gib: 710.0,
    };

    /// Predicted µs to bind `bytes` by remapping.
    pub fn remap_us(&self, bytes: usize) -> f64 {
        self.remap_fixed_us + self.remap_us_per_gib * bytes as f64 / GIB
    }

    /// Predicted µs to bind `bytes` by copying them in.
    pub fn copy_us(&self, bytes: usize) -> f64 {
        self.copy_fixed_us + self.copy_us_per_gib * bytes as f64 / GIB
    }

    /// The cheaper strategy for `bytes` (never `Auto`).
    pub fn choose(&self, bytes: usize) -> BindStrategy {
        if self.copy_us(bytes) <= self.remap_us(bytes) {
            BindStrategy::CopyIn
        } else {
            BindStrategy::Remap
        }
    }

    /// The size above which remapping is cheaper (`None` if one strategy always wins).
    pub fn crossover_bytes(&self) -> Option<usize> {
        let slope = self.copy_us_per_gib - self.remap_us_per_gib;
        let gap = self.remap_fixed_us - self.copy_fixed_us;
        (slope > 0.0 && gap > 0.0).then(|| (gap / slope * GIB) as usize)
    }

    /// Fits the model on `ctx`'s device: times warm remaps and device-to-device copies at two sizes
    /// (the fastest of nine runs, each including the fence a bind pays: interference such as
    /// driver work deferred from a large free elsewhere only ever adds time), then draws a line
    /// through each pair. Costs some tens of milliseconds and 1 GiB of device memory for the
    /// duration of the call.
    pub fn calibrate(ctx: &Arc<CudaContext>) -> Result<CostModel> {
        let sizes = [8usize << 20, 256 << 20];
        let mut remap = [0.0; 2];
        let mut copy = [0.0; 2];
        let gran = granularity(ctx, false)?;
        let stream = driver::traced("cuStreamCreate", 0, || ctx.new_stream())?;
        let access = [ctx.ordinal()];
        for (i, &bytes) in sizes.iter().enumerate() {
            let reservation = Arc::new(Reservation::new(ctx, 2 * bytes, gran)?);
            let memory = [
                Arc::new(Physical::new(ctx, bytes, false)?),
                Arc::new(Physical::new(ctx, bytes, false)?),
            ];
            let mut mapping = Some(Mapping::new(
                &reservation,
                0,
                &memory[0],
                0,
                bytes,
                &access,
            )?);
            let other = Mapping::new(&reservation, bytes, &memory[1], 0, bytes, &access)?;
            let mut times = Vec::new();
            for round in 0..9 {
                let start = Instant::now();
                driver::synchronize_context(ctx)?;
                drop(mapping.take()); // unmap, as a rebind does
                mapping = Some(Mapping::new(
                    &reservation,
                    0,
                    &memory[round % 2],
                    0,
                    bytes,
                    &access,
                )?);
                times.push(start.elapsed().as_secs_f64() * 1e6);
            }
            remap[i] = fastest(&times);
            let target = mapping.as_ref().map(Mapping::ptr).unwrap_or_default();
            let mut times = Vec::new();
            for _ in 0..9 {
                let start = Instant::now();
                driver::synchronize_context(ctx)?;
                driver::copy_device(&stream, other.ptr(), target, bytes)?;
                driver::synchronize_stream(&stream)?;
                times.push(start.elapsed().as_secs_f64() * 1e6);
            }
            copy[i] = fastest(&times);
        }
        let line = |t: [f64; 2]| {
            let per_gib = ((t[1] - t[0]) / ((sizes[1] - sizes[0]) as f64 / GIB)).max(0.0);
            ((t[0] - per_gib * sizes[0] as f64 / GIB).max(0.0), per_gib)
        };
        let (remap_fixed_us, remap_us_per_gib) = line(remap);
        let (copy_fixed_us, copy_us_per_gib) = line(copy);
        let model = CostModel {
            remap_fixed_us,
            remap_us_per_gib,
            copy_fixed_us,
            copy_us_per_gib,
        };
        tracing::info!(?model, crossover = ?model.crossover_bytes(), "bind cost model calibrated");
        Ok(model)
    }

    /// The calibrated model of `ctx`'s device, measured once per process and device.
    pub fn for_device(ctx: &Arc<CudaContext>) -> Result<CostModel> {
        static MODELS: OnceLock<Mutex<HashMap<usize, CostModel>>> = OnceLock::new();
        let models = MODELS.get_or_init(Default::default);
        if let Some(model) = models
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .get(&ctx.ordinal())
        {
            return Ok(*model);
        }
        let model = Self::calibrate(ctx)?;
        models
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .insert(ctx.ordinal(), model);
        Ok(model)
    }
}

fn fastest(values: &[f64]) -> f64 {
    values.iter().copied().fold(f64::INFINITY, f64::min)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_h100_model_crosses_over_near_100_mib() {
        let model = CostModel::H100;
        let crossover = model.crossover_bytes().unwrap();
        assert!((60 << 20..140 << 20).contains(&crossover), "{crossover}");
        assert_eq!(model.choose(2 << 20), BindStrategy::CopyIn);
        assert_eq!(model.choose(1 << 30), BindStrategy::Remap);
    }

    #[test]
    fn choose_picks_the_cheaper_prediction_at_every_size() {
        let model = CostModel::H100;
        for shift in 16..35 {
            let bytes = 1usize << shift;
            let best = model.remap_us(bytes).min(model.copy_us(bytes));
            let chosen = match model.choose(bytes) {
                BindStrategy::CopyIn => model.copy_us(bytes),
                _ => model.remap_us(bytes),
            };
            assert_eq!(chosen, best, "{bytes}");
        }
    }

    #[test]
    fn a_model_where_copy_always_wins_has_no_crossover() {
        let model = CostModel {
            remap_fixed_us: 100.0,
            remap_us_per_gib: 1000.0,
            copy_fixed_us: 10.0,
            copy_us_per_gib: 100.0,
        };
        assert_eq!(model.crossover_bytes(), None);
        assert_eq!(model.choose(1 << 34), BindStrategy::CopyIn);
    }
}
