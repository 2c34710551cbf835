//! The exported CUDA functions and the process-wide state behind them: the top layer. Each
//! hook finds the layer (`layer`), configured from the environment (`env`), and hands the call
//! to the engine or to the real CUDA function (`ffi`).

pub mod env;
#[allow(unsafe_code)]
mod ffi;
pub(crate) mod layer;
