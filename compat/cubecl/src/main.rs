//! stablebuf beside cubecl-cuda: both on device 0's primary context through one cudarc. Random
//! data goes from a cubecl buffer into a stablebuf slot (device to device), through a stablebuf
//! kernel, and back into a new cubecl buffer, which cubecl reads; the host checks the values.
//!
//! Prints `compat cubecl check: passed` and exits 0, or the failure and exits 1.

use cubecl_common::bytes::Bytes;
use cubecl_common::future::block_on;
use cubecl_core::Runtime;
use cubecl_cuda::{CudaDevice, CudaRuntime};
use stablebuf::buffer::copy_between;
use stablebuf::cudarc::driver::sys;
use stablebuf::kernels::Kernels;
use stablebuf::{open_device, DeviceBuffer, Layout, Space};

type Result<T> = std::result::Result<T, Box<dyn std::error::Error>>;

const N: usize = 1 << 20;
const BYTES: usize = N * std::mem::size_of::<f32>();
const A: f32 = -0.75;
const B: f32 = 2.0;

fn main() {
    match run() {
        Ok(()) => println!("compat cubecl check: passed"),
        Err(error) => {
            println!("compat cubecl check: failed: {error}");
            std::process::exit(1);
        }
    }
}

/// A cubecl buffer's device range, as a stablebuf `DeviceBuffer`.
struct CubeclRange {
    ptr: sys::CUdeviceptr,
    bytes: usize,
}

impl DeviceBuffer for CubeclRange {
    fn device_address(&self) -> sys::CUdeviceptr {
        self.ptr
    }

    fn byte_len(&self) -> usize {
        self.bytes
    }
}

fn run() -> Result<()> {
    // stablebuf's context is the device's primary context, the one cubecl-cuda retains.
    let ctx = open_device(0)?;
    let stream = ctx.new_stream()?;
    let kernels = Kernels::load(&ctx)?;
    let client = CudaRuntime::client(&CudaDevice { index: 0 });

    let x = random(N, 0x5eed_cafe);
    let input = client.create(Bytes::from_elems(x.clone()));
    let output = client.empty(BYTES);
    let input_resource = client.get_resource(input.clone())?;
    let output_resource = client.get_resource(output.clone())?;
    // cubecl's upload runs on its own stream: wait for it before stablebuf reads the buffer.
    block_on(client.sync())?;
    let source = CubeclRange {
        ptr: input_resource.resource().ptr,
        bytes: BYTES,
    };
    let target = CubeclRange {
        ptr: output_resource.resource().ptr,
        bytes: BYTES,
    };

    let layout = Layout::builder().group("g").input("x", BYTES).build()?;
    let space = Space::new(&ctx, layout)?;
    let dataset = space.new_dataset("g")?;
    space.bind(&dataset)?;
    let slot = space.slot("x")?;
    copy_between(&stream, slot, 0, &source, 0, BYTES)?;
    kernels.affine(&stream, slot, A, B)?;
    copy_between(&stream, &target, 0, slot, 0, BYTES)?;
    stream.synchronize()?;

    let got: Vec<f32> = bytemuck_f32(&client.read_one(output)?);
    let gap = x
        .iter()
        .zip(&got)
        .map(|(&x, &y)| (A * x + B - y).abs() / (1.0 + (A * x + B).abs()))
        .fold(0f32, f32::max);
    println!(
        "cubecl -> slot -> affine -> cubecl: {} values, max relative gap {gap:.2e}",
        got.len()
    );
    if got.len() != N || gap > 1e-6 {
        return Err(format!("results differ: {} values, gap {gap:e}", got.len()).into());
    }
    Ok(())
}

/// Uniform values in [-8, 8) from a xorshift generator: random, never all zero.
fn random(n: usize, mut state: u64) -> Vec<f32> {
    (0..n)
        .map(|_| {
            state ^= state << 13;
            state ^= state >> 7;
            state ^= state << 17;
            (state >> 40) as f32 / (1u64 << 24) as f32 * 16.0 - 8.0
        })
        .collect()
}

fn bytemuck_f32(bytes: &[u8]) -> Vec<f32> {
    bytes
        .chunks_exact(4)
        .map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]]))
        .collect()
}
