//! The MLP shared by the inference-loop and sleep/wake examples: layout, forward pass (cuBLAS
//! SGEMM or the PTX matmul, then bias + ReLU), and a CPU reference for sampled rows.
#![allow(dead_code)]

use std::sync::Arc;

use stablebuf::cudarc::driver::{sys, CudaStream};
use stablebuf::kernels::{Blas, Kernels, MatmulKernel, RECOMMENDED_WORKSPACE};
use stablebuf::{DeviceBuffer, Layout, Result, Slot, Space};

#[derive(Clone, Copy)]
pub struct Shape {
    pub layers: usize,
    pub hidden: usize,
    pub batch: usize,
    pub ptx: bool,
}

pub fn layout(shape: Shape) -> Result<Layout> {
    let (h, b) = (shape.hidden, shape.batch);
    let mut builder = Layout::builder().group("weights");
    for l in 0..shape.layers {
        builder = builder
            .input(format!("w{l}"), h * h * 4)
            .input(format!("b{l}"), h * 4);
    }
    builder = builder.group("batch").input("x", b * h * 4);
    for l in 0..shape.layers {
        builder = builder.scratch(format!("h{l}"), b * h * 4);
    }
    builder.scratch("workspace", RECOMMENDED_WORKSPACE).build()
}

/// A device buffer given by address, for the re-capture variant (which points graphs at the
/// datasets' own addresses, as a loop without stable slots must).
pub struct Raw(pub u64, pub usize);

impl DeviceBuffer for Raw {
    fn device_address(&self) -> sys::CUdeviceptr {
        self.0
    }
    fn byte_len(&self) -> usize {
        self.1
    }
}

/// The addresses one forward pass uses.
pub struct Pass<T> {
    pub x: T,
    pub weights: Vec<(T, T)>,
    pub hidden: Vec<T>,
}

/// Enqueues the MLP's forward pass.
pub fn forward<T: DeviceBuffer>(
    blas: &Blas,
    kernels: &Kernels,
    stream: &Arc<CudaStream>,
    p: &Pass<T>,
    shape: Shape,
) -> Result<()> {
    let (h, b) = (shape.hidden, shape.batch);
    for l in 0..shape.layers {
        let input = if l == 0 { &p.x } else { &p.hidden[l - 1] };
        if shape.ptx {
            kernels.matmul(
                stream,
                MatmulKernel::Auto,
                input,
                &p.weights[l].0,
                &p.hidden[l],
                b,
                h,
                h,
            )?;
        } else {
            blas.sgemm(input, &p.weights[l].0, &p.hidden[l], b, h, h)?;
        }
        kernels.bias_act(
            stream,
            &p.hidden[l],
            &p.weights[l].1,
            b,
            h,
            l + 1 < shape.layers,
        )?;
    }
    Ok(())
}

pub fn slot_pass(space: &Space, shape: Shape) -> Result<Pass<Slot>> {
    let get = |name: String| space.slot(&name).cloned();
    Ok(Pass {
        x: get("x".into())?,
        weights: (0..shape.layers)
            .map(|l| Ok((get(format!("w{l}"))?, get(format!("b{l}"))?)))
            .collect::<Result<_>>()?,
        hidden: (0..shape.layers)
            .map(|l| get(format!("h{l}")))
            .collect::<Result<_>>()?,
    })
}

/// The work one space's graph replays: a cuBLAS handle on `stream` with the space's workspace.
pub fn space_work(
    space: &Space,
    stream: &Arc<CudaStream>,
    kernels: &Arc<Kernels>,
    shape: Shape,
) -> Result<impl FnMut(&Arc<CudaStream>) -> Result<()> + Send + 'static> {
    let blas = Blas::new(stream, space.slot("workspace")?)?;
    let pass = slot_pass(space, shape)?;
    // Warm up outside the capture (cuBLAS picks and loads its kernels on first use).
    let kernels = kernels.clone();
    Ok(move |s: &Arc<CudaStream>| forward(&blas, &kernels, s, &pass, shape))
}

/// Host copies of one weight set: (w, b) per layer.
pub type HostWeights = Vec<(Vec<f32>, Vec<f32>)>;

/// CPU reference for `rows` sampled rows of the batch: returns rows × hidden outputs.
pub fn cpu_forward(x: &[f32], weights: &HostWeights, rows: &[usize], shape: Shape) -> Vec<f32> {
    let h = shape.hidden;
    let mut out = Vec::new();
    for &r in rows {
        let mut act: Vec<f64> = x[r * h..(r + 1) * h]
            .iter()
            .map(|&v| f64::from(v))
            .collect();
        for (l, (w, b)) in weights.iter().enumerate() {
            let mut next = vec![0f64; h];
            for (k, a) in act.iter().enumerate() {
                let row = &w[k * h..(k + 1) * h];
                for (n, wv) in next.iter_mut().zip(row) {
                    *n += a * f64::from(*wv);
                }
            }
            for (n, bv) in next.iter_mut().zip(b) {
                *n += f64::from(*bv);
                if l + 1 < shape.layers && *n < 0.0 {
                    *n = 0.0;
                }
            }
            act = next;
        }
        out.extend(act.iter().map(|&v| v as f32));
    }
    out
}
