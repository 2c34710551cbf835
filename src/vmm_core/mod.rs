//! The one seam between stablebuf's memory managers and the driver.
//!
//! The elastic pool ([`crate::pool`]) and the regions ([`crate::region`]) reserve address
//! ranges, create physical memory, map it, copy bytes and wait on fences only through
//! [`Backend`]. [`Vmm`] is the real one (VMM calls on one context); the tests run the same
//! state machines against [`fake::Fake`], a CPU stand-in that also holds the bytes, with
//! failures injected at any call and what the real driver would fault on recorded.
//!
//! ```text
//!   pool::State<B>      region::RegionState<B>
//!            \              /
//!             Backend (this module)
//!            /              \
//!        Vmm (driver)     Fake (tests, CPU)
//! ```

mod backend;
#[cfg(test)]
pub(crate) mod fake;
mod real;

pub(crate) use backend::{Backend, MappedRange, PhysicalMemory, ReservedRange, Waiter};
pub(crate) use real::Vmm;
