//! Tenants: registering one reserves its addresses; unregistering frees everything it holds.

use std::collections::BTreeMap;
use std::sync::Arc;

use cudarc::driver::CudaStream;

use super::{State, TenantState};
use crate::error::{Error, LayoutError, Result};
use crate::pool::backend::{Backend, ReservedRange, Waiter};
use crate::pool::events::EventKind;
use crate::pool::granules::GranuleMap;
use crate::pool::ledger::TenantId;

impl<B: Backend> State<B> {
    pub(crate) fn register(
        &mut self,
        name: &str,
        virtual_capacity: usize,
        physical_limit: Option<usize>,
    ) -> Result<TenantId> {
        let capacity = match self.book.round(virtual_capacity) {
            Some(c) if c > 0 => c,
            _ => {
                return Err(Error::Layout(LayoutError::InvalidShape(format!(
                    "tenant `{name}`: virtual capacity {virtual_capacity} bytes"
                ))))
            }
        };
        if name.is_empty() {
            return Err(Error::Layout(LayoutError::EmptyName));
        }
        let reservation = self.backend.reserve(capacity, self.book.granularity())?;
        let id = TenantId(self.next_tenant);
        self.next_tenant += 1;
        self.book.open_account(id, physical_limit);
        let base = reservation.base();
        let name: Arc<str> = Arc::from(name);
        self.tenants.insert(
            id,
            TenantState {
                name: name.clone(),
                granules: GranuleMap::new(capacity / self.book.granularity()),
                reservation,
                blocks: BTreeMap::new(),
                fence: self.backend.fence(self.fence_policy),
                peak_mapped: 0,
            },
        );
        self.log(EventKind::Register { name }, Some(id), base, capacity);
        Ok(id)
    }

    pub(crate) fn attach(&mut self, tenant: TenantId, stream: &Arc<CudaStream>) -> Result<()> {
        self.tenant_mut(tenant)?.fence.attach(stream);
        Ok(())
    }

    /// Unmaps every block of the tenant (after its fence), returns the chunks to the cache and
    /// frees its reservation. If the fence fails, the tenant's mappings are leaked instead of
    /// unmapped under running work, and the error is returned.
    pub(crate) fn unregister(&mut self, tenant: TenantId) -> Result<()> {
        let fenced = self.tenant(tenant)?.fence.wait();
        let state = self.tenants.remove(&tenant).expect("checked above");
        let base = state.reservation.base();
        let capacity = state.reservation.bytes();
        for (block, block_state) in state.blocks {
            self.drop_segments(tenant, block, block_state.segments, fenced.is_ok());
            self.give_back_all(&block_state.held);
        }
        let closed = self.book.close_account(tenant);
        debug_assert!(closed || fenced.is_err());
        self.log(EventKind::Unregister, Some(tenant), base, capacity);
        fenced
    }
}
