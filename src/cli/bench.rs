//! `longctx bench`: the attention kernel and the training engine benchmarks (their code is
//! in `src/bench.rs` and `src/bench_engine.rs`).

use anyhow::Result;
use clap::Subcommand;

#[derive(Subcommand, Debug)]
pub enum BenchCmd {
    /// Attention kernel throughput (TFLOP/s) and correctness checks of every mode (CUDA build).
    Attention(crate::bench::BenchAttentionArgs),
    /// One forward+backward of the layer-wise engine: step time, tokens/s, device memory
    /// peak, with layer inputs on the device and/or offloaded (gradients compared).
    Engine(crate::bench_engine::BenchEngineArgs),
    /// The host AdamW pass (what `optimizer_on_host` runs per step) over N parameters:
    /// seconds per step, GB/s, and that time scaled to Llama-2-7B.
    Optimizer(crate::bench_optim::BenchOptimizerArgs),
}

pub fn bench(what: BenchCmd) -> Result<()> {
    match what {
        BenchCmd::Attention(a) => crate::bench::attention(&a),
        BenchCmd::Engine(a) => crate::bench_engine::engine(&a),
        BenchCmd::Optimizer(a) => crate::bench_optim::optimizer(&a),
    }
}
