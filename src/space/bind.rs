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

use super::backing::{Backing, Binding, Mapped};
use super::{SpaceShared, SpaceState};
use crate::dataset::{Binder, DatasetCore};
use crate::error::{DriverError, Error, GraphError, LayoutError, Result};
use crate::vmm_core::{Backend, Waiter};

impl<B: Backend> SpaceShared<B> {
    /// The index of `dataset`'s group here, or why it cannot bind into this space.
    pub(super) fn check_compatible(&self, dataset: &DatasetCore<B>) -> Result<usize> {
        if dataset.device() != self.backend.device() {
            return Err(Error::Driver(DriverError::ContextMismatch {
                expected: self.backend.device(),
                found: dataset.device(),
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

    /// Binds `dataset` and records the binding with it, so that dropping or offloading it
    /// unbinds it here first.
    pub(crate) fn bind_noted(
        self: &Arc<Self>,
        dataset: &DatasetCore<B>,
        stream: Option<&B::Stream>,
    ) -> Result<()> {
        self.bind(dataset, stream)?;
        dataset.note_bound_in(self.binder());
        Ok(())
    }

    /// This space as a dataset's [`Binder`].
    pub(super) fn binder(self: &Arc<Self>) -> std::sync::Weak<dyn Binder<B>> {
        let shared: Arc<dyn Binder<B>> = self.clone();
        Arc::downgrade(&shared)
    }

    /// See `Space::bind` and `Space::bind_on`.
    pub(super) fn bind(&self, dataset: &DatasetCore<B>, stream: Option<&B::Stream>) -> Result<()> {
        let index = self.check_compatible(dataset)?;
        // An offloaded dataset is refused here, before anything changes.
        let (memory, home_ptr) = (dataset.memory()?.clone(), dataset.home_ptr()?);
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
                    .map(|b| (b.dataset_id, b.mapped.memory.clone()));
                state.bound.set(index, false);
                drop(previous); // unmaps: the fence above has drained every use
                let map = |memory: Arc<B::Memory>| -> Result<Mapped<B>> {
                    let mapping = self.backend.map(
                        &self.reservation,
                        region.offset,
                        &memory,
                        region.bytes,
                    )?;
                    Ok(Mapped { mapping, memory })
                };
                match map(memory) {
                    Ok(mapped) => {
                        *slot = Some(Binding {
                            dataset_id: dataset.id(),
                            mapped,
                        });
                        // Under the lock: no replay can use the group before its listeners
                        // (e.g. NCCL registrations) caught up with the new pages.
                        self.listeners.notify(super::listeners::Part::Group(index));
                    }
                    Err(error) => {
                        if let Some((dataset_id, memory)) = restore {
                            match map(memory) {
                                Ok(mapped) => {
                                    *slot = Some(Binding { dataset_id, mapped });
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
            Backing::CopyIn {
                resident,
                current,
                held,
            } => {
                let copy_stream = match stream {
                    Some(stream) => {
                        self.backend.order_before(&mut state.fence, stream)?;
                        stream.clone()
                    }
                    None => {
                        state.fence.wait()?;
                        match &state.copy_stream {
                            Some(s) => s.clone(),
                            None => {
                                let s = self.backend.new_stream()?;
                                self.backend.attach(&mut state.fence, &s);
                                state.copy_stream = Some(s.clone());
                                s
                            }
                        }
                    }
                };
                self.backend.attach(&mut state.fence, &copy_stream);
                *current = None;
                *held = None;
                state.bound.set(index, false);
                for (offset, bytes) in dataset.input_runs() {
                    let source = home_ptr + offset as u64;
                    let target = resident.ptr() + offset as u64;
                    self.backend
                        .copy_device(&copy_stream, source, target, bytes)?;
                }
                if stream.is_none() {
                    self.backend.synchronize(&copy_stream)?;
                }
                *current = Some(dataset.id());
                *held = Some(dataset.id());
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
    pub(super) fn copy_out(&self, dataset: &DatasetCore<B>, stream: &B::Stream) -> Result<()> {
        let index = self.check_compatible(dataset)?;
        let mut state = self.lock();
        let state = &mut *state;
        let home_ptr = dataset.home_ptr()?;
        if let Backing::CopyIn {
            resident, current, ..
        } = &state.backings[index]
        {
            if *current != Some(dataset.id()) {
                return Err(Error::Graph(GraphError::Unbound {
                    group: dataset.group().into(),
                }));
            }
            self.backend.attach(&mut state.fence, stream);
            for (offset, bytes) in dataset.output_runs() {
                self.backend.copy_device(
                    stream,
                    resident.ptr() + offset as u64,
                    home_ptr + offset as u64,
                    bytes,
                )?;
            }
            self.backend.synchronize(stream)?;
        }
        Ok(())
    }

    /// Takes group `index`'s data away, if bound (to `only_dataset`, when given). Returns
    /// whether something was unbound.
    pub(super) fn unbind_group(&self, index: usize, only_dataset: Option<u64>) -> Result<bool> {
        let mut state = self.lock();
        let state: &mut SpaceState<B> = &mut state;
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

impl<B: Backend> Binder<B> for SpaceShared<B> {
    fn unbind_dataset(&self, dataset: u64, group: usize) -> Result<bool> {
        self.unbind_group(group, Some(dataset))
    }

    fn bind_again(&self, dataset: &DatasetCore<B>) -> Result<()> {
        let index = self.check_compatible(dataset)?;
        {
            let mut state = self.lock();
            let state = &mut *state;
            if let Backing::CopyIn {
                current: current @ None,
                held: Some(held),
                ..
            } = &mut state.backings[index]
            {
                if *held == dataset.id() {
                    // The copy its bind made is still there, with what the GPU wrote since:
                    // bound again as it was (a new copy would take the home's inputs as they
                    // are now, which may differ).
                    *current = Some(*held);
                    state.bound.set(index, true);
                    return Ok(());
                }
            }
        }
        self.bind(dataset, None)
    }
}
