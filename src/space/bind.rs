//! Binding: what is under each group's addresses, and the one place that maps and unmaps
//! datasets under a space. Every unmap waits on the space's fence first.
//!
//! ```text
//!   group "weights" addresses   |  w1  |  w2  |  b1  |
//!   Remap:   dataset D's memory  [=== one mapping ===]   rebind = unmap + map + set-access
//!   CopyIn:  the space's memory  [=== one mapping ===]   rebind = copy D's inputs into it
//! ```

use std::sync::Arc;
use std::time::Instant;

use cudarc::driver::CudaStream;

use super::backing::{Backing, Binding};
use super::{SpaceShared, SpaceState};
use crate::dataset::{Binder, Dataset};
use crate::driver;
use crate::driver::vmm::{Mapping, Physical};
use crate::error::{DriverError, Error, GraphError, LayoutError, Result};

impl SpaceShared {
    /// The index of `dataset`'s group here, or why it cannot bind into this space.
    pub(super) fn check_compatible(&self, dataset: &Dataset) -> Result<usize> {
        if dataset.context().ordinal() != self.ctx.ordinal() {
            return Err(Error::Driver(DriverError::ContextMismatch {
                expected: self.ctx.ordinal(),
                found: dataset.context().ordinal(),
            }));
        }
        let index = dataset.group_index();
        let matches = dataset.layout_fingerprint() == self.layout.fingerprint()
            && self
                .placement
                .groups
                .get(index)
                .is_some_and(|g| g.bytes == dataset.bytes() && g.name == dataset.group());
        if !matches {
            return Err(Error::Layout(LayoutError::LayoutMismatch {
                group: dataset.group().into(),
                dataset_layout: dataset.layout_fingerprint(),
                space_layout: self.layout.fingerprint(),
            }));
        }
        Ok(index)
    }

    /// See `Space::bind` and `Space::bind_on`.
    pub(super) fn bind(&self, dataset: &Dataset, stream: Option<&Arc<CudaStream>>) -> Result<()> {
        let index = self.check_compatible(dataset)?;
        // An offloaded dataset is refused here, before anything changes.
        let (physical, home_ptr) = (dataset.physical()?.clone(), dataset.home_ptr()?);
        let region = &self.placement.groups[index];
        let mut state = self.lock();
        if state.backings[index].dataset() == Some(dataset.id()) {
            return Ok(());
        }
        let span = tracing::debug_span!("bind", space = self.id, group = %region.name, bytes = region.bytes);
        let _entered = span.enter();
        let start = Instant::now();
        let state = &mut *state;
        match &mut state.backings[index] {
            Backing::Remap(slot) => {
                state.fence.wait()?;
                let previous = slot.take();
                let restore = previous
                    .as_ref()
                    .map(|b| (b.dataset_id, b.mapping.physical().clone()));
                state.bound.set(index, false);
                drop(previous); // unmaps: the fence above has drained every use
                let map = |physical: &Arc<Physical>| {
                    Mapping::new(
                        &self.reservation,
                        region.offset,
                        physical,
                        0,
                        region.bytes,
                        &self.access,
                    )
                };
                match map(&physical) {
                    Ok(mapping) => {
                        *slot = Some(Binding {
                            dataset_id: dataset.id(),
                            mapping,
                        });
                        // Under the lock: no replay can use the group before its listeners
                        // (e.g. NCCL registrations) caught up with the new pages.
                        self.listeners.notify(super::listeners::Part::Group(index));
                    }
                    Err(error) => {
                        if let Some((dataset_id, physical)) = restore {
                            match map(&physical) {
                                Ok(mapping) => {
                                    *slot = Some(Binding {
                                        dataset_id,
                                        mapping,
                                    });
                                    state.bound.set(index, true);
                                }
                                Err(restore_error) => {
                                    tracing::error!(%restore_error, "could not map the previous dataset back");
                                }
                            }
                        }
                        return Err(error);
                    }
                }
            }
            Backing::CopyIn { resident, current } => {
                let copy_stream = match stream {
                    Some(stream) => {
                        state.fence.order_before(stream)?;
                        stream.clone()
                    }
                    None => {
                        state.fence.wait()?;
                        match &state.copy_stream {
                            Some(s) => s.clone(),
                            None => {
                                let s =
                                    driver::traced("cuStreamCreate", 0, || self.ctx.new_stream())?;
                                state.fence.attach(&s);
                                state.copy_stream = Some(s.clone());
                                s
                            }
                        }
                    }
                };
                state.fence.attach(&copy_stream);
                *current = None;
                state.bound.set(index, false);
                for (offset, bytes) in dataset.input_runs() {
                    let source = home_ptr + offset as u64;
                    let target = resident.ptr() + offset as u64;
                    driver::copy_device(&copy_stream, source, target, bytes)?;
                }
                if stream.is_none() {
                    driver::synchronize_stream(&copy_stream)?;
                }
                *current = Some(dataset.id());
            }
        }
        state.bound.set(index, true);
        tracing::debug!(
            dataset = dataset.id(),
            micros = start.elapsed().as_secs_f64() * 1e6,
            "bound"
        );
        Ok(())
    }

    /// See `Space::copy_out`.
    pub(super) fn copy_out(&self, dataset: &Dataset, stream: &Arc<CudaStream>) -> Result<()> {
        let index = self.check_compatible(dataset)?;
        let mut state = self.lock();
        let state = &mut *state;
        let home_ptr = dataset.home_ptr()?;
        if let Backing::CopyIn { resident, current } = &state.backings[index] {
            if *current != Some(dataset.id()) {
                return Err(Error::Graph(GraphError::Unbound {
                    group: dataset.group().into(),
                }));
            }
            state.fence.attach(stream);
            for (offset, bytes) in dataset.output_runs() {
                driver::copy_device(
                    stream,
                    resident.ptr() + offset as u64,
                    home_ptr + offset as u64,
                    bytes,
                )?;
            }
            driver::synchronize_stream(stream)?;
        }
        Ok(())
    }

    /// Takes group `index`'s data away, if bound (to `only_dataset`, when given). Returns
    /// whether something was unbound.
    pub(super) fn unbind_group(&self, index: usize, only_dataset: Option<u64>) -> Result<bool> {
        let mut state = self.lock();
        let state: &mut SpaceState = &mut state;
        let Some(bound) = state.backings[index].dataset() else {
            return Ok(false);
        };
        if only_dataset.is_some_and(|id| id != bound) {
            return Ok(false);
        }
        match &mut state.backings[index] {
            Backing::Remap(slot) => {
                state.fence.wait()?;
                *slot = None; // unmaps
            }
            // The copy stays in the space's memory; only the claim that it is current goes.
            Backing::CopyIn { current, .. } => *current = None,
        }
        state.bound.set(index, false);
        tracing::debug!(space = self.id, group = %self.placement.groups[index].name, "unbound");
        Ok(true)
    }
}

impl Binder for SpaceShared {
    fn unbind_dataset(&self, dataset: u64, group: usize) -> Result<bool> {
        self.unbind_group(group, Some(dataset))
    }

    fn bind_again(&self, dataset: &Dataset) -> Result<()> {
        self.bind(dataset, None)
    }
}
