//! RAII wrappers over the CUDA virtual memory management calls.
//!
//! ```text
//!   Reservation   cuMemAddressReserve / cuMemAddressFree   virtual addresses, no memory
//!   Physical      cuMemCreate / cuMemRelease               memory, no address
//!   Mapping       cuMemMap + cuMemSetAccess / cuMemUnmap   physical memory visible at an address
//! ```
//!
//! Drop order is enforced by ownership: a [`Mapping`] holds an `Arc` of its [`Physical`] and of
//! its [`Reservation`], so a mapping is always unmapped before its memory is released, and memory
//! is released before its address range is freed. What this layer cannot know is whether the GPU
//! still uses a mapping: the bind layer waits for that before it drops one.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;

use cudarc::driver::{sys, CudaContext};

use super::deferred::{device_queue, DeviceQueue, HeldPhysical};
use super::{bind_context, release, traced_raw};
use crate::error::{Error, LayoutError, Result};

/// Where physical memory lives.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Location {
    /// On GPU `ordinal`.
    Device(usize),
    /// Pinned host memory (`CU_MEM_LOCATION_TYPE_HOST`, drivers ≥ 12.2 that support it): GPUs
    /// read and write it over PCIe or NVLink-C2C without a copy.
    Host,
    /// Pinned host memory on NUMA node `node` (`CU_MEM_LOCATION_TYPE_HOST_NUMA`).
    HostNuma(u32),
}

impl Location {
    /// The device whose context allocates it, for device memory.
    pub fn device(self) -> Option<usize> {
        match self {
            Location::Device(ordinal) => Some(ordinal),
            Location::Host | Location::HostNuma(_) => None,
        }
    }

    fn raw(self) -> sys::CUmemLocation {
        use sys::CUmemLocationType as T;
        match self {
            Location::Device(ordinal) => location(T::CU_MEM_LOCATION_TYPE_DEVICE, ordinal as i32),
            Location::Host => location(T::CU_MEM_LOCATION_TYPE_HOST, 0),
            Location::HostNuma(node) => location(T::CU_MEM_LOCATION_TYPE_HOST_NUMA, node as i32),
        }
    }
}

/// Device `ordinal` as a memory location.
fn device_location(ordinal: i32) -> sys::CUmemLocation {
    location(sys::CUmemLocationType::CU_MEM_LOCATION_TYPE_DEVICE, ordinal)
}

/// A memory location. C lays it out as `{ CUmemLocationType type; int id; }` in every CUDA
/// version, but from 13.2 the bindings put `id` in an anonymous union, so it is written by
/// offset: the same code then compiles with every binding version cudarc offers (a dependent may
/// choose one, or let nvcc's version choose).
fn location(kind: sys::CUmemLocationType, id: i32) -> sys::CUmemLocation {
    const _: () = assert!(
        std::mem::size_of::<sys::CUmemLocation>() == 8
            && std::mem::offset_of!(sys::CUmemLocation, type_) == 0
            && std::mem::size_of::<sys::CUmemLocationType>() == 4
    );
    // SAFETY: a plain C struct for which all-zero bytes are valid.
    let mut location: sys::CUmemLocation = unsafe { std::mem::zeroed() };
    location.type_ = kind;
    // SAFETY: the asserts above pin the layout: `id` is the 4-byte int at offset 4, inside the
    // struct and aligned for i32.
    unsafe {
        std::ptr::addr_of_mut!(location)
            .cast::<i32>()
            .add(1)
            .write(id)
    };
    location
}

fn allocation_prop(at: Location, shareable: bool) -> sys::CUmemAllocationProp {
    // SAFETY: CUmemAllocationProp is a plain C struct for which all-zero bytes are valid
    // (null pointer, zero enums and flags); cudarc gives it no Default.
    let mut prop: sys::CUmemAllocationProp = unsafe { std::mem::zeroed() };
    prop.type_ = sys::CUmemAllocationType::CU_MEM_ALLOCATION_TYPE_PINNED;
    prop.location = at.raw();
    if shareable {
        prop.requestedHandleTypes =
            sys::CUmemAllocationHandleType::CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR;
    }
    prop
}

/// The allocation granularity of `ctx`'s device: every size and offset of a mapping is a
/// multiple of it (2 MiB on current NVIDIA GPUs).
pub fn granularity(ctx: &CudaContext, shareable: bool) -> Result<usize> {
    granularity_at(ctx, Location::Device(ctx.ordinal()), shareable)
}

/// The allocation granularity of memory at `at`, asked through `ctx`.
pub fn granularity_at(ctx: &CudaContext, at: Location, shareable: bool) -> Result<usize> {
    bind_context(ctx)?;
    let prop = allocation_prop(at, shareable);
    let mut granularity = 0usize;
    traced_raw("cuMemGetAllocationGranularity", 0, || {
        // SAFETY: both pointers are valid for the duration of the call.
        unsafe {
            sys::cuMemGetAllocationGranularity(
                &mut granularity,
                &prop,
                sys::CUmemAllocationGranularity_flags::CU_MEM_ALLOC_GRANULARITY_MINIMUM,
            )
        }
    })?;
    Ok(granularity)
}

/// A range of device virtual addresses, reserved with no memory behind it.
#[derive(Debug)]
pub struct Reservation {
    ctx: Arc<CudaContext>,
    base: sys::CUdeviceptr,
    bytes: usize,
}

impl Reservation {
    /// Reserves `bytes` (a multiple of the granularity) aligned to `alignment`.
    pub fn new(ctx: &Arc<CudaContext>, bytes: usize, alignment: usize) -> Result<Self> {
        bind_context(ctx)?;
        let mut base: sys::CUdeviceptr = 0;
        traced_raw("cuMemAddressReserve", bytes, || {
            // SAFETY: `base` is a valid out-pointer; a zero hint lets the driver choose.
            unsafe { sys::cuMemAddressReserve(&mut base, bytes, alignment, 0, 0) }
        })?;
        Ok(Self {
            ctx: ctx.clone(),
            base,
            bytes,
        })
    }

    /// The first reserved address (aligned as asked).
    pub fn base(&self) -> sys::CUdeviceptr {
        self.base
    }

    /// Bytes of addresses reserved.
    pub fn bytes(&self) -> usize {
        self.bytes
    }
}

impl Drop for Reservation {
    fn drop(&mut self) {
        let (base, bytes) = (self.base, self.bytes);
        release(&self.ctx, "cuMemAddressFree", bytes, || {
            // SAFETY: the range came from cuMemAddressReserve with this size, and every
            // Mapping inside it holds an Arc of this Reservation, so none is left mapped.
            unsafe { sys::cuMemAddressFree(base, bytes) }
        });
    }
}

/// `cuMemCreate`: a handle the caller owns and must release.
#[cfg_attr(any(test, feature = "fault-injection"), track_caller)]
fn create_handle(
    ctx: &Arc<CudaContext>,
    bytes: usize,
    shareable: bool,
    at: Location,
) -> Result<sys::CUmemGenericAllocationHandle> {
    bind_context(ctx)?;
    let prop = allocation_prop(at, shareable);
    let mut handle: sys::CUmemGenericAllocationHandle = 0;
    traced_raw("cuMemCreate", bytes, || {
        // SAFETY: valid out-pointer and property struct; flags must be 0.
        unsafe { sys::cuMemCreate(&mut handle, bytes, &prop, 0) }
    })?;
    Ok(handle)
}

/// Physical device memory with no address (`cuMemCreate`).
#[derive(Debug)]
pub struct Physical {
    ctx: Arc<CudaContext>,
    handle: sys::CUmemGenericAllocationHandle,
    bytes: usize,
    shareable: bool,
    location: Location,
    /// The device's release queue, for memory made by [`Physical::reusable`]: the drop hands
    /// the handle to it instead of releasing it (see [`super::held`]).
    queue: Option<Arc<DeviceQueue>>,
}

impl Physical {
    /// `bytes` of non-exportable memory on `ctx`'s device for stablebuf's own spaces, datasets,
    /// regions and pools: served from the device's release queue when it holds an allocation of
    /// this size (no `cuMemCreate`), else created (releasing held memory and retrying if the
    /// device is out of memory); on drop handed back to the queue instead of released.
    pub(crate) fn reusable(ctx: &Arc<CudaContext>, bytes: usize) -> Result<Self> {
        let queue = device_queue(ctx.ordinal());
        let at = Location::Device(ctx.ordinal());
        let held = queue.acquire(&bytes, bytes, || {
            Ok(HeldPhysical {
                ctx: ctx.clone(),
                handle: create_handle(ctx, bytes, false, at)?,
                bytes,
            })
        })?;
        Ok(Self {
            ctx: held.ctx,
            handle: held.handle,
            bytes: held.bytes,
            shareable: false,
            location: Location::Device(ctx.ordinal()),
            queue: Some(queue),
        })
    }

    /// Allocates `bytes` (a multiple of the granularity) on `ctx`'s device.
    pub fn new(ctx: &Arc<CudaContext>, bytes: usize, shareable: bool) -> Result<Self> {
        Self::new_at(ctx, bytes, shareable, Location::Device(ctx.ordinal()))
    }

    /// Allocates `bytes` (a multiple of the location's granularity) at `at`: this device, a
    /// peer GPU, or pinned host memory. Mapped with access for a device, kernels there read and
    /// write it in place.
    pub fn new_at(
        ctx: &Arc<CudaContext>,
        bytes: usize,
        shareable: bool,
        at: Location,
    ) -> Result<Self> {
        let handle = create_handle(ctx, bytes, shareable, at)?;
        Ok(Self {
            ctx: ctx.clone(),
            handle,
            bytes,
            shareable,
            location: at,
            queue: None,
        })
    }

    /// [`Physical::reusable`] where it applies (non-exportable memory on `ctx`'s own device),
    /// else [`Physical::new_at`].
    pub(crate) fn owned_at(
        ctx: &Arc<CudaContext>,
        bytes: usize,
        shareable: bool,
        at: Location,
    ) -> Result<Self> {
        if !shareable && at == Location::Device(ctx.ordinal()) {
            Self::reusable(ctx, bytes)
        } else {
            Self::new_at(ctx, bytes, shareable, at)
        }
    }

    /// Where the memory lives.
    pub fn location(&self) -> Location {
        self.location
    }

    /// Bytes of physical memory allocated.
    pub fn bytes(&self) -> usize {
        self.bytes
    }

    /// Whether it was created exportable as a POSIX file descriptor.
    pub(crate) fn shareable(&self) -> bool {
        self.shareable
    }

    pub(crate) fn handle(&self) -> sys::CUmemGenericAllocationHandle {
        self.handle
    }

    pub(crate) fn context(&self) -> &Arc<CudaContext> {
        &self.ctx
    }

    /// Takes ownership of a handle from `cuMemImportFromShareableHandle`.
    pub(crate) fn from_imported(
        ctx: &Arc<CudaContext>,
        handle: sys::CUmemGenericAllocationHandle,
        bytes: usize,
    ) -> Self {
        Self {
            ctx: ctx.clone(),
            handle,
            bytes,
            shareable: true,
            location: Location::Device(ctx.ordinal()),
            queue: None,
        }
    }
}

impl Drop for Physical {
    fn drop(&mut self) {
        let (handle, bytes) = (self.handle, self.bytes);
        if let Some(queue) = self.queue.take() {
            // Every Mapping of it held an Arc of this value, so none is left mapped: the queue
            // only defers the release. If this was the queue's last owner, dropping `queue`
            // here releases everything it holds.
            let held = HeldPhysical {
                ctx: self.ctx.clone(),
                handle,
                bytes,
            };
            queue.put(bytes, held);
            return;
        }
        release(&self.ctx, "cuMemRelease", bytes, || {
            // SAFETY: the handle came from cuMemCreate and is released once, here; every
            // Mapping of it holds an Arc of this value, so none is left mapped.
            unsafe { sys::cuMemRelease(handle) }
        });
    }
}

/// Physical memory mapped at an address inside a reservation, readable and writable by the
/// devices it was given access for. Unmapped on drop.
#[derive(Debug)]
pub struct Mapping {
    ptr: sys::CUdeviceptr,
    bytes: usize,
    physical: Arc<Physical>,
    reservation: Arc<Reservation>,
    /// Set when the owner could not prove the GPU is done with the range: the mapping, its
    /// memory and its reservation are then kept for the life of the process instead of freed.
    leak: bool,
    /// Set when the address was handed out as a kernel operand (`DeviceBuffer`): nothing then
    /// tracks which streams use the range, so dropping waits for the whole context.
    exposed: AtomicBool,
}

impl Mapping {
    /// Maps `bytes` of `physical`, starting at `physical_offset`, at `reservation`'s base +
    /// `offset`, and grants read-write access to `access_devices` (device ordinals). All or
    /// nothing: if access cannot be set, the range is unmapped again before returning the error.
    pub fn new(
        reservation: &Arc<Reservation>,
        offset: usize,
        physical: &Arc<Physical>,
        physical_offset: usize,
        bytes: usize,
        access_devices: &[usize],
    ) -> Result<Self> {
        let fits_va = offset
            .checked_add(bytes)
            .is_some_and(|end| end <= reservation.bytes());
        let fits_pa = physical_offset
            .checked_add(bytes)
            .is_some_and(|end| end <= physical.bytes());
        if bytes == 0 || !fits_va || !fits_pa {
            return Err(Error::Layout(LayoutError::InvalidShape(format!(
                "mapping {bytes} bytes at offset {offset} of a {} byte reservation from offset \
                 {physical_offset} of {} bytes of memory",
                reservation.bytes(),
                physical.bytes()
            ))));
        }
        let mapping = Self::map_only(reservation, offset, physical, physical_offset, bytes)?;
        set_access(mapping.ptr, bytes, access_devices)?; // on error `mapping` drops and unmaps
        Ok(mapping)
    }

    /// `cuMemMap` alone: the range is mapped but no device may access it yet. The caller checked
    /// the bounds and sets access before handing the mapping out.
    fn map_only(
        reservation: &Arc<Reservation>,
        offset: usize,
        physical: &Arc<Physical>,
        physical_offset: usize,
        bytes: usize,
    ) -> Result<Self> {
        bind_context(&reservation.ctx)?;
        let ptr = reservation.base() + offset as u64;
        let handle = physical.handle;
        traced_raw("cuMemMap", bytes, || {
            // SAFETY: [ptr, ptr + bytes) lies inside a live reservation (checked by the caller)
            // and the handle is live; an overlap with an existing mapping is reported by the
            // driver.
            unsafe { sys::cuMemMap(ptr, bytes, physical_offset, handle, 0) }
        })?;
        Ok(Self {
            ptr,
            bytes,
            physical: physical.clone(),
            reservation: reservation.clone(),
            leak: false,
            exposed: AtomicBool::new(false),
        })
    }

    /// Maps each of `physicals` whole, side by side from `reservation`'s base + `offset`, then
    /// grants read-write access to `access_devices` over the whole run with ONE
    /// `cuMemSetAccess` (the driver accepts a range that spans several allocations as long as
    /// all of it is mapped). Measured on the H100, the one call costs what one call per chunk
    /// costs in all (the price is per mapped page, not per call), but it is one driver call.
    ///
    /// All or nothing: on any error every mapping made so far is unmapped before returning.
    pub fn new_many(
        reservation: &Arc<Reservation>,
        offset: usize,
        physicals: &[Arc<Physical>],
        access_devices: &[usize],
    ) -> Result<Vec<Self>> {
        let total = physicals
            .iter()
            .try_fold(0usize, |sum, p| sum.checked_add(p.bytes()));
        let fits = |total: usize| {
            total > 0
                && offset
                    .checked_add(total)
                    .is_some_and(|end| end <= reservation.bytes())
        };
        let Some(total) = total.filter(|&t| fits(t)) else {
            return Err(Error::Layout(LayoutError::InvalidShape(format!(
                "mapping {} allocations at offset {offset} of a {} byte reservation",
                physicals.len(),
                reservation.bytes()
            ))));
        };
        let mut made: Vec<Self> = Vec::with_capacity(physicals.len());
        let mut at = offset;
        for physical in physicals {
            // On error `made` drops here and unmaps what was mapped.
            made.push(Self::map_only(
                reservation,
                at,
                physical,
                0,
                physical.bytes(),
            )?);
            at += physical.bytes();
        }
        // One call for the whole run: the driver documents a range "containing all allocations
        // created by cuMemMap" as valid. On failure `made` drops and unmaps everything.
        let start = reservation.base() + offset as u64;
        set_access(start, total, access_devices)?;
        Ok(made)
    }

    /// `physical` mapped whole `count` times side by side from `reservation`'s base + `offset`,
    /// then ONE `cuMemSetAccess` granting `access_devices` read access only over the run: the
    /// same physical memory at many addresses (the KV cache's shared zero granule under every
    /// range not backed yet), which kernels may read and never write. All or nothing.
    pub(crate) fn read_only_run(
        reservation: &Arc<Reservation>,
        offset: usize,
        physical: &Arc<Physical>,
        count: usize,
        access_devices: &[usize],
    ) -> Result<Vec<Self>> {
        let total = physical.bytes().checked_mul(count);
        let fits = |total: usize| {
            total > 0
                && offset
                    .checked_add(total)
                    .is_some_and(|end| end <= reservation.bytes())
        };
        let Some(total) = total.filter(|&t| fits(t)) else {
            return Err(Error::Layout(LayoutError::InvalidShape(format!(
                "mapping {count} read-only copies of {} bytes at offset {offset} of a {} byte \
                 reservation",
                physical.bytes(),
                reservation.bytes()
            ))));
        };
        let mut made: Vec<Self> = Vec::with_capacity(count);
        for i in 0..count {
            let at = offset + i * physical.bytes();
            made.push(Self::map_only(
                reservation,
                at,
                physical,
                0,
                physical.bytes(),
            )?);
        }
        let start = reservation.base() + offset as u64;
        set_access_flags(
            start,
            total,
            access_devices,
            sys::CUmemAccess_flags::CU_MEM_ACCESS_FLAGS_PROT_READ,
        )?;
        Ok(made)
    }

    /// The reservation this mapping lives in.
    pub(crate) fn reservation(&self) -> &Arc<Reservation> {
        &self.reservation
    }

    /// `physical` mapped whole at a fresh reservation of its own: a private address for it.
    pub fn alone(
        ctx: &Arc<CudaContext>,
        physical: &Arc<Physical>,
        access_devices: &[usize],
    ) -> Result<Self> {
        let bytes = physical.bytes();
        let reservation = Arc::new(Reservation::new(ctx, bytes, granularity(ctx, false)?)?);
        Self::new(&reservation, 0, physical, 0, bytes, access_devices)
    }

    /// The mapped address. Unlike passing the mapping itself to a launcher (as a
    /// [`DeviceBuffer`](crate::DeviceBuffer)), this does not make the drop wait for the device:
    /// synchronize work you enqueue on this address yourself before dropping the mapping.
    pub fn ptr(&self) -> sys::CUdeviceptr {
        self.ptr
    }

    /// Bytes mapped.
    pub fn bytes(&self) -> usize {
        self.bytes
    }

    /// The address, marking the mapping exposed (see the field's docs).
    pub(crate) fn expose(&self) -> sys::CUdeviceptr {
        self.exposed.store(true, Ordering::Relaxed);
        self.ptr
    }

    /// Never unmap this range: used when waiting for the GPU failed and the range may still be
    /// in use. Leaking is the only choice that cannot corrupt memory or fault.
    pub(crate) fn leak_on_drop(&mut self) {
        self.leak = true;
    }
}

/// Grants read-write access to `devices` over `[ptr, ptr + bytes)`, which the caller has fully
/// mapped (one mapping, or several side by side) with mappings it owns.
fn set_access(ptr: sys::CUdeviceptr, bytes: usize, devices: &[usize]) -> Result<()> {
    set_access_flags(
        ptr,
        bytes,
        devices,
        sys::CUmemAccess_flags::CU_MEM_ACCESS_FLAGS_PROT_READWRITE,
    )
}

/// Grants `flags` (read-write, or read only) to `devices` over `[ptr, ptr + bytes)`, which the
/// caller has fully mapped with mappings it owns.
fn set_access_flags(
    ptr: sys::CUdeviceptr,
    bytes: usize,
    devices: &[usize],
    flags: sys::CUmemAccess_flags,
) -> Result<()> {
    let descriptors: Vec<sys::CUmemAccessDesc> = devices
        .iter()
        .map(|&ordinal| {
            // SAFETY: a plain C struct for which all-zero bytes are valid.
            let mut desc: sys::CUmemAccessDesc = unsafe { std::mem::zeroed() };
            desc.location = device_location(ordinal as i32);
            desc.flags = flags;
            desc
        })
        .collect();
    traced_raw("cuMemSetAccess", bytes, || {
        // SAFETY: the range is mapped end to end by live mappings the caller owns (a gap is
        // reported by the driver, not acted on); `descriptors` outlives the call.
        unsafe { sys::cuMemSetAccess(ptr, bytes, descriptors.as_ptr(), descriptors.len()) }
    })
}

impl Drop for Mapping {
    fn drop(&mut self) {
        let (ptr, bytes) = (self.ptr, self.bytes);
        if self.leak {
            // Keep one count of each forever so neither is released under the mapping.
            std::mem::forget(self.physical.clone());
            std::mem::forget(self.reservation.clone());
            tracing::warn!(
                ptr,
                bytes,
                "mapping leaked because the GPU may still use it"
            );
            return;
        }
        if self.exposed.load(Ordering::Relaxed) {
            if let Err(error) = super::synchronize_context(&self.reservation.ctx) {
                tracing::error!(%error, ptr, bytes, "waiting before unmapping an exposed mapping failed; leaking it");
                std::mem::forget(self.physical.clone());
                std::mem::forget(self.reservation.clone());
                return;
            }
        }
        release(&self.reservation.ctx, "cuMemUnmap", bytes, || {
            // SAFETY: exactly the range mapped in `new`. The owner (bind layer) has waited
            // for all work that used it before dropping this value.
            unsafe { sys::cuMemUnmap(ptr, bytes) }
        });
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    // Bindings that still name the field: the offset write must land in `id`.
    #[cfg(not(any(feature = "cuda-13020", feature = "cuda-13030", feature = "cuda-13040")))]
    #[test]
    fn device_location_writes_the_id_field() {
        let location = device_location(7);
        assert_eq!(location.id, 7);
        assert_eq!(
            location.type_,
            sys::CUmemLocationType::CU_MEM_LOCATION_TYPE_DEVICE
        );
    }
}
