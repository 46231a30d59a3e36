//! `longctx bench`: the attention kernel, the training engine and the host optimizer
//! benchmarks, one file each beside this one.

pub mod attention;
pub mod engine;
pub mod optim;

use anyhow::Result;
use clap::Subcommand;

#[derive(Subcommand, Debug)]
pub enum BenchCmd {
    /// Attention kernel throughput (TFLOP/s) and correctness checks of every mode (CUDA build).
    Attention(attention::BenchAttentionArgs),
    /// One forward+backward of the layer-wise engine: step time, tokens/s, device memory
    /// peak, with layer inputs on the device and/or offloaded (gradients compared).
    Engine(engine::BenchEngineArgs),
    /// The host AdamW pass (what `optimizer_on_host` runs per step) over N parameters:
    /// seconds per step, GB/s, and that time scaled to Llama-2-7B.
    Optimizer(optim::BenchOptimizerArgs),
}

pub fn bench(what: BenchCmd) -> Result<()> {
    match what {
        BenchCmd::Attention(a) => attention::attention(&a),
        BenchCmd::Engine(a) => engine::engine(&a),
        BenchCmd::Optimizer(a) => optim::optimizer(&a),
    }
}
