//! Where the host's time went in the last change behind a step: the parts a slow step can be
//! taken apart into ([`KvCache::last_change_times`](super::KvCache::last_change_times)).

use std::time::Duration;

/// The host's time in the parts of the last
/// [`KvCache::change_behind`](super::KvCache::change_behind) that changed a mapping.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct ChangeTimes {
    /// Taking back the remap handed to the worker by the change before (waiting for it).
    pub settle: Duration,
    /// Mapping the gated layers' fresh granules alone and enqueueing their zeroing.
    pub staging: Duration,
    /// Waiting for the step's marks of the layers remapped inline.
    pub waits: Duration,
    /// Remapping those layers and enqueueing the zeroing of their fresh granules.
    pub remaps: Duration,
    /// Waiting for the lane's zeroing (and, for released rows, zeroing them).
    pub sync: Duration,
    /// Handing the gated layers' remap to the worker (or remapping them here where it could not).
    pub hand_off: Duration,
    /// Layers remapped inline.
    pub inline_layers: usize,
}
