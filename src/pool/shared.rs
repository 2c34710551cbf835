//! What the pool's handles ([`ElasticPool`](super::ElasticPool), [`Tenant`](super::Tenant),
//! [`Block`](super::Block)) share: the state behind its lock, the context and the create-ahead
//! worker.

use std::sync::{Arc, Mutex, MutexGuard, PoisonError};

use cudarc::driver::CudaContext;

use super::backend::Vmm;
use super::create_ahead::CreateAhead;
use super::state::State;

pub(crate) struct Shared {
    ctx: Arc<CudaContext>,
    granularity: usize,
    /// Behind an `Arc` so that the create-ahead worker can hold it weakly.
    state: Arc<Mutex<State<Vmm>>>,
    /// The create-ahead worker, when [`PoolOptions::create_ahead`](super::PoolOptions) is on.
    ahead: Option<CreateAhead>,
}

impl Shared {
    /// The pool of `state` on `ctx`, with a create-ahead worker when `create_ahead` is on.
    pub(crate) fn new(
        ctx: &Arc<CudaContext>,
        granularity: usize,
        state: State<Vmm>,
        create_ahead: bool,
    ) -> Self {
        let state = Arc::new(Mutex::new(state));
        let ahead =
            create_ahead.then(|| CreateAhead::start(Arc::downgrade(&state), Arc::downgrade(ctx)));
        Self {
            ctx: ctx.clone(),
            granularity,
            state,
            ahead,
        }
    }

    /// The state; a panic in another thread while it held the lock leaves the books as they
    /// were after its last completed step, so the lock is taken anyway rather than panicking.
    pub(crate) fn lock(&self) -> MutexGuard<'_, State<Vmm>> {
        self.state.lock().unwrap_or_else(PoisonError::into_inner)
    }

    pub(crate) fn context(&self) -> &Arc<CudaContext> {
        &self.ctx
    }

    /// The allocation granularity in bytes.
    pub(crate) fn granularity(&self) -> usize {
        self.granularity
    }

    /// After a request: what it created is what the create-ahead worker prepares next.
    pub(crate) fn after_request(&self, state: MutexGuard<'_, State<Vmm>>) {
        let mut state = state;
        let created = state.take_created();
        drop(state);
        if let Some(ahead) = &self.ahead {
            ahead.created(created);
        }
    }

    /// Waits until the create-ahead worker has handled every request sent so far (at once when
    /// there is no worker).
    pub(crate) fn settle(&self) {
        if let Some(ahead) = &self.ahead {
            ahead.settle();
        }
    }
}
