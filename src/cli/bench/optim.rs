//! `longctx bench optimizer`: the host AdamW pass (`AdamW::update_into`: the clip factor
//! applied inside, the new weights written in the model dtype in the same pass) over a
//! flat shard of N parameters with rayon on every core; seconds per step, the memory
//! traffic it moves (30 bytes per parameter with a bf16 copy: w, m, v, g read; w, m, v
//! written; the copy written) and that time scaled to the Llama-2-7B shape's 6.74e9
//! parameters. The host↔device copies of a GPU run are not part of it.

use super::attention::median;
use anyhow::bail;
use longctx::train::optim::{AdamW, AdamWConfig};
use std::time::Instant;

#[derive(clap::Args, Debug, Clone)]
pub struct BenchOptimizerArgs {
    /// Parameters in the shard (e.g. 268435456, 1e9); the state takes 16 bytes each plus
    /// 2 for the bf16 copy.
    #[arg(long, default_value = "268435456", value_parser = count_arg)]
    pub params: usize,
    /// Timed steps (after one untimed).
    #[arg(long, default_value_t = 3)]
    pub iters: usize,
    /// Threads (0: every core).
    #[arg(long, default_value_t = 0)]
    pub threads: usize,
}

fn count_arg(s: &str) -> Result<usize, String> {
    let x: f64 = s.parse().map_err(|_| format!("`{s}`: expected a count such as 268435456 or 1e9"))?;
    if !(1.0..=1e11).contains(&x) || x.fract() != 0.0 {
        return Err(format!("`{s}`: expected a whole count from 1 to 1e11"));
    }
    Ok(x as usize)
}

const LLAMA2_7B_PARAMS: f64 = 6.738e9;

pub fn optimizer(a: &BenchOptimizerArgs) -> anyhow::Result<()> {
    if a.iters == 0 {
        bail!("--iters: at least 1");
    }
    let need = a.params as u128 * 18;
    if let Some(avail) = longctx::device::host_available() {
        if need > avail as u128 {
            bail!(
                "--params {}: needs {:.1} GB of host memory, {:.1} GB available; lower --params",
                a.params,
                need as f64 / 1e9,
                avail as f64 / 1e9
            );
        }
    }
    let pool = rayon::ThreadPoolBuilder::new().num_threads(a.threads).build()?;
    let n = a.params;
    let mut opt = AdamW::new(AdamWConfig::default(), vec![0.01; n], vec![true; n]);
    let grad = vec![1e-3f32; n];
    let mut out = vec![half::bf16::ZERO; n];
    let mut times = Vec::new();
    for i in 0..=a.iters {
        let t = Instant::now();
        pool.install(|| opt.update_into(&grad, 0.5, 1e-5, Some(&mut out)));
        if i > 0 {
            times.push(t.elapsed().as_secs_f64());
        }
    }
    let s = median(times);
    let gbs = 30.0 * n as f64 / s / 1e9;
    println!(
        "host AdamW, {n} parameters, {} threads: {s:.3} s per step ({gbs:.1} GB/s of state traffic); \
         scaled to Llama-2-7B ({LLAMA2_7B_PARAMS:.3e} parameters): {:.2} s",
        pool.current_num_threads(),
        s * LLAMA2_7B_PARAMS / n as f64
    );
    Ok(())
}
