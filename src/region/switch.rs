//! Which way a weight-set switch goes: remap the set under the region, or copy its bytes in.
//! Pure decision logic (no driver calls), tested on the CPU.
//!
//! ```text
//!   remap:  region ──map──▶ [ set B ]            fixed cost (~60–110 µs on an H100, a fence first)
//!   copy:   region ──map──▶ [ live set ] ◀─copy── [ set B ]   cost ∝ the span (~0.7 µs per MiB)
//! ```
//!
//! Below the device's crossover (about 100 MiB on an H100) a copy is the cheaper switch, above
//! it a remap; [`SwitchStrategy::Auto`] asks the calibrated [`CostModel`] on the region's span.

use crate::strategy::{BindStrategy, CostModel};

/// How [`Region::switch_to`](super::Region::switch_to) makes a region read a weight set.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
pub enum SwitchStrategy {
    /// Map the weight set under the region ([`Region::bind`](super::Region::bind)): one unmap,
    /// map and set-access after the fence, whatever the size. Writes to the region then land
    /// in the weight set.
    Remap,
    /// Copy the weight set's bytes into the region's own *live* set (made and bound on the
    /// first copy switch), ordered on the stream: time proportional to the region's span, no
    /// fence. The weight set itself is only read.
    Copy,
    /// The cheaper of the two for the region's used span, by the device's calibrated
    /// [`CostModel`] ([`CostModel::for_device`]).
    #[default]
    Auto,
}

/// Which way a switch went.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Switched {
    /// The weight set is mapped under the region (also when it was bound already: nothing was
    /// done).
    Remapped,
    /// The weight set's bytes were copied into the region's live set, which is bound.
    Copied,
}

impl SwitchStrategy {
    /// The way a switch of a region whose used span is `span` bytes goes. `Auto` picks the
    /// cheaper prediction of `model` (the [`CostModel::H100`] line without one); a region with
    /// no allocations (`span == 0`) is always remapped, as there is nothing to copy.
    pub fn resolve(self, span: usize, model: Option<&CostModel>) -> Switched {
        if span == 0 {
            return Switched::Remapped;
        }
        match self {
            SwitchStrategy::Remap => Switched::Remapped,
            SwitchStrategy::Copy => Switched::Copied,
            SwitchStrategy::Auto => match model.unwrap_or(&CostModel::H100).choose(span) {
                BindStrategy::CopyIn => Switched::Copied,
                _ => Switched::Remapped,
            },
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const MIB: usize = 1 << 20;

    #[test]
    fn forced_strategies_ignore_the_model() {
        let copy_always_wins = CostModel {
            remap_fixed_us: 1e6,
            remap_us_per_gib: 1e6,
            copy_fixed_us: 0.0,
            copy_us_per_gib: 1.0,
        };
        for bytes in [MIB, 1 << 30, 1 << 36] {
            for model in [None, Some(&copy_always_wins)] {
                assert_eq!(
                    SwitchStrategy::Remap.resolve(bytes, model),
                    Switched::Remapped
                );
                assert_eq!(SwitchStrategy::Copy.resolve(bytes, model), Switched::Copied);
            }
        }
    }

    #[test]
    fn auto_copies_below_the_crossover_and_remaps_above_it() {
        let model = CostModel::H100;
        let crossover = model.crossover_bytes().unwrap();
        let auto = |bytes| SwitchStrategy::Auto.resolve(bytes, Some(&model));
        assert_eq!(auto(8 * MIB), Switched::Copied);
        assert_eq!(auto(crossover - MIB), Switched::Copied);
        assert_eq!(auto(crossover + MIB), Switched::Remapped);
        assert_eq!(auto(512 * MIB), Switched::Remapped);
        // Without a model: the H100 line.
        assert_eq!(
            SwitchStrategy::Auto.resolve(8 * MIB, None),
            Switched::Copied
        );
        assert_eq!(
            SwitchStrategy::Auto.resolve(512 * MIB, None),
            Switched::Remapped
        );
    }

    #[test]
    fn auto_always_takes_the_cheaper_prediction() {
        let models = [
            CostModel::H100,
            CostModel {
                remap_fixed_us: 200.0,
                remap_us_per_gib: 10.0,
                copy_fixed_us: 3.0,
                copy_us_per_gib: 300.0,
            },
            CostModel {
                remap_fixed_us: 10.0,
                remap_us_per_gib: 1000.0,
                copy_fixed_us: 100.0,
                copy_us_per_gib: 100.0,
            },
        ];
        for model in &models {
            for shift in 12..38 {
                let bytes = 1usize << shift;
                let copy = model.copy_us(bytes);
                let remap = model.remap_us(bytes);
                let want = if copy <= remap {
                    Switched::Copied
                } else {
                    Switched::Remapped
                };
                assert_eq!(
                    SwitchStrategy::Auto.resolve(bytes, Some(model)),
                    want,
                    "{model:?} at {bytes} bytes"
                );
            }
        }
    }

    #[test]
    fn an_empty_region_is_remapped_whatever_the_strategy() {
        for strategy in [
            SwitchStrategy::Remap,
            SwitchStrategy::Copy,
            SwitchStrategy::Auto,
        ] {
            assert_eq!(strategy.resolve(0, None), Switched::Remapped);
        }
    }

    #[test]
    fn auto_is_the_default() {
        assert_eq!(SwitchStrategy::default(), SwitchStrategy::Auto);
    }
}
