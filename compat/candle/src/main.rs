//! stablebuf beside candle: a candle `CudaDevice`'s own context and stream drive a stablebuf
//! `Space` (with a graph captured over it) and an `ElasticPool`, and data moves between candle
//! tensors and stablebuf memory on the GPU. Every result is checked twice: against candle's own
//! kernels on the GPU and against values computed on the host, on random data.
//!
//! The device is left as candle makes it, cudarc's event tracking on (see compat/README.md for
//! what that means): stablebuf's memory never takes part in it, cudarc's copies order candle's
//! tensors against it, and the captured graph touches stablebuf memory only.
//!
//! Prints `compat candle check: passed` and exits 0, or the failure and exits 1.

use std::sync::Arc;

use candle_core::op::BackpropOp;
use candle_core::{CudaDevice, CudaStorage, Device, Storage, Tensor};
use stablebuf::buffer::copy_between;
use stablebuf::cudarc::driver::{sys, CudaStream, DevicePtr, DevicePtrMut, SyncOnDrop};
use stablebuf::kernels::Kernels;
use stablebuf::{DeviceBuffer, ElasticPool, Layout, PoolOptions, Space};

type Result<T> = std::result::Result<T, Box<dyn std::error::Error>>;

/// Elements per tensor: 4 MiB of f32, two granules of VMM memory on current GPUs.
const N: usize = 1 << 20;
const BYTES: usize = N * std::mem::size_of::<f32>();
/// The map `x -> A·x + B` that stablebuf's `affine` kernel and candle's `affine` both apply.
const A: f32 = 1.5;
const B: f32 = -0.25;

fn main() {
    match run() {
        Ok(()) => println!("compat candle check: passed"),
        Err(error) => {
            println!("compat candle check: failed: {error}");
            std::process::exit(1);
        }
    }
}

fn run() -> Result<()> {
    // candle's device with a stream of its own (a non-blocking stream: the legacy default
    // stream cannot be captured). Nothing about it is changed for stablebuf.
    let candle = CudaDevice::new_with_stream(0)?;
    let stream = candle.cuda_stream();
    let ctx = stream.context().clone();
    let device = Device::Cuda(candle.clone());
    println!(
        "candle device: cudarc event tracking {}, managing stream synchronisation {}",
        ctx.is_event_tracking(),
        ctx.is_managing_stream_synchronization()
    );
    let kernels = Arc::new(Kernels::load(&ctx)?);

    space_with_candle_data(&candle, &device, &stream, &kernels)?;
    pool_with_candle_data(&candle, &device, &stream, &kernels)?;
    Ok(())
}

/// Two datasets of one slot filled from candle tensors; one graph captured on candle's stream
/// replays on each after a rebind; the slot is read back into new candle tensors.
fn space_with_candle_data(
    candle: &CudaDevice,
    device: &Device,
    stream: &Arc<CudaStream>,
    kernels: &Arc<Kernels>,
) -> Result<()> {
    let layout = Layout::builder()
        .group("inputs")
        .input("x", BYTES)
        .build()?;
    let space = Space::new(stream.context(), layout)?;
    let (first, second) = (space.new_dataset("inputs")?, space.new_dataset("inputs")?);
    let x1 = Tensor::randn(0f32, 1f32, N, device)?;
    let x2 = Tensor::rand(-4f32, 4f32, N, device)?;

    space.bind(&first)?;
    tensor_to_slot(&x1, &space, "x", stream)?;
    space.bind(&second)?;
    tensor_to_slot(&x2, &space, "x", stream)?;

    let slot = space.slot("x")?.clone();
    let k = kernels.clone();
    space.bind(&first)?;
    let mut graph = space.capture(stream, move |s| k.affine(s, &slot, A, B))?;
    graph.replay()?;
    let y1 = slot_to_tensor(&space, "x", candle, stream)?;

    space.bind(&second)?;
    let update = graph.check_update()?;
    if !update.is_success() {
        return Err(format!("graph not reusable after the rebind: {update:?}").into());
    }
    graph.replay()?;
    let y2 = slot_to_tensor(&space, "x", candle, stream)?;

    compare("space, first dataset", &x1, &y1)?;
    compare("space, second dataset", &x2, &y2)
}

/// A growable block from a pool on candle's context: one candle tensor copied in, the block grown
/// in place, a second tensor copied behind the first, a stablebuf kernel over all of it, and the
/// result copied into a new candle tensor.
fn pool_with_candle_data(
    candle: &CudaDevice,
    device: &Device,
    stream: &Arc<CudaStream>,
    kernels: &Kernels,
) -> Result<()> {
    let pool = ElasticPool::new(stream.context(), PoolOptions::default())?;
    let tenant = pool.register("candle", 4 * BYTES)?;
    tenant.attach(stream)?;
    let mut block = tenant.alloc_growable(BYTES, 2 * BYTES)?;
    let address = block.address();

    let x3 = Tensor::randn(2f32, 3f32, N, device)?;
    let x4 = Tensor::rand(-1f32, 5f32, N, device)?;
    tensor_to_buffer(&x3, &block, 0, stream)?;
    block.grow(2 * BYTES)?;
    if block.address() != address {
        return Err("the block moved when it grew".into());
    }
    tensor_to_buffer(&x4, &block, BYTES, stream)?;
    kernels.affine(stream, &block, A, B)?;

    let mut out = stream.alloc_zeros::<f32>(2 * N)?;
    {
        let (ptr, sync) = out.device_ptr_mut(stream);
        let target = Borrowed::new(ptr, 2 * BYTES, sync);
        copy_between(stream, &target, 0, &block, 0, 2 * BYTES)?;
    }
    let y = wrap(out, 2 * N, candle);
    compare("pool block", &Tensor::cat(&[&x3, &x4], 0)?, &y)?;

    let stats = pool.stats();
    println!("pool after the check: {stats:?}");
    drop(block);
    tenant.unregister()?;
    Ok(())
}

/// Device memory of a candle tensor as a stablebuf `DeviceBuffer`, holding cudarc's guard for
/// as long as it lives: with event tracking on, taking the pointer made the stream wait for the
/// tensor's last write, and dropping the guard records this use, so candle orders later work on
/// the tensor after it.
struct Borrowed<'a> {
    ptr: sys::CUdeviceptr,
    bytes: usize,
    _sync: SyncOnDrop<'a>,
}

impl<'a> Borrowed<'a> {
    fn new(ptr: sys::CUdeviceptr, bytes: usize, sync: SyncOnDrop<'a>) -> Self {
        Self {
            ptr,
            bytes,
            _sync: sync,
        }
    }
}

impl DeviceBuffer for Borrowed<'_> {
    fn device_address(&self) -> sys::CUdeviceptr {
        self.ptr
    }

    fn byte_len(&self) -> usize {
        self.bytes
    }
}

/// Copies a contiguous f32 candle tensor into slot `name` with cudarc's own `memcpy_dtod`: the
/// tensor is a cudarc `CudaView`, the slot a stablebuf `SlotView`, and both name one cudarc.
fn tensor_to_slot(
    tensor: &Tensor,
    space: &Space,
    name: &str,
    stream: &Arc<CudaStream>,
) -> Result<()> {
    let (storage, layout) = tensor.storage_and_layout();
    let Storage::Cuda(cuda) = &*storage else {
        return Err("expected a CUDA tensor".into());
    };
    let (start, end) = layout
        .contiguous_offsets()
        .ok_or("expected a contiguous tensor")?;
    let source = cuda.as_cuda_slice::<f32>()?.slice(start..end);
    let mut slot = space.view::<f32>(name, stream)?;
    if slot.len() != source.len() {
        return Err(format!(
            "slot {name} holds {} f32, tensor {}",
            slot.len(),
            source.len()
        )
        .into());
    }
    stream.memcpy_dtod(&source, &mut slot)?;
    Ok(())
}

/// Copies a contiguous f32 candle tensor into `target` at `offset` bytes with stablebuf's checked
/// device copy.
fn tensor_to_buffer(
    tensor: &Tensor,
    target: &impl DeviceBuffer,
    offset: usize,
    stream: &Arc<CudaStream>,
) -> Result<()> {
    let (storage, layout) = tensor.storage_and_layout();
    let Storage::Cuda(cuda) = &*storage else {
        return Err("expected a CUDA tensor".into());
    };
    let (start, end) = layout
        .contiguous_offsets()
        .ok_or("expected a contiguous tensor")?;
    let view = cuda.as_cuda_slice::<f32>()?.slice(start..end);
    let bytes = view.len() * std::mem::size_of::<f32>();
    let (ptr, sync) = view.device_ptr(stream);
    let source = Borrowed::new(ptr, bytes, sync);
    copy_between(stream, target, offset, &source, 0, bytes)?;
    Ok(())
}

/// Copies slot `name` into a new candle tensor (device to device).
fn slot_to_tensor(
    space: &Space,
    name: &str,
    candle: &CudaDevice,
    stream: &Arc<CudaStream>,
) -> Result<Tensor> {
    let slot = space.view::<f32>(name, stream)?;
    let mut out = stream.alloc_zeros::<f32>(slot.len())?;
    stream.memcpy_dtod(&slot, &mut out)?;
    let len = slot.len();
    Ok(wrap(out, len, candle))
}

fn wrap(
    slice: stablebuf::cudarc::driver::CudaSlice<f32>,
    len: usize,
    candle: &CudaDevice,
) -> Tensor {
    let storage = Storage::Cuda(CudaStorage::wrap_cuda_slice(slice, candle.clone()));
    Tensor::from_storage(storage, len, BackpropOp::none(), false)
}

/// `got` must be `A·x + B`: checked against candle's `affine` on the GPU and against the host.
fn compare(what: &str, x: &Tensor, got: &Tensor) -> Result<()> {
    let expected_gpu = x.affine(f64::from(A), f64::from(B))?;
    let gpu_gap: f32 = (got - &expected_gpu)?.abs()?.max(0)?.to_scalar()?;

    let x: Vec<f32> = x.to_vec1()?;
    let got: Vec<f32> = got.to_vec1()?;
    // Random data, not a constant: a copy that moved nothing or the wrong range would show.
    let mean = x.iter().map(|&v| f64::from(v)).sum::<f64>() / x.len() as f64;
    let var = x
        .iter()
        .map(|&v| (f64::from(v) - mean).powi(2))
        .sum::<f64>()
        / x.len() as f64;
    if var < 0.1 {
        return Err(format!("{what}: input variance {var:.3}: not random data").into());
    }
    let host_gap = x
        .iter()
        .zip(&got)
        .map(|(&x, &y)| (A * x + B - y).abs() / (1.0 + (A * x + B).abs()))
        .fold(0f32, f32::max);
    println!(
        "{what}: {} values, max |got - candle| = {gpu_gap:.2e}, max relative gap to host = {host_gap:.2e}",
        got.len()
    );
    if gpu_gap > 1e-5 || host_gap > 1e-6 {
        return Err(
            format!("{what}: results differ (candle {gpu_gap:e}, host {host_gap:e})").into(),
        );
    }
    Ok(())
}
