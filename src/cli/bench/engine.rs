//! `longctx bench engine`: one forward+backward of the layer-wise engine on one device,
//! with layer inputs kept on the device and/or offloaded to host memory.
//!
//! For each sequence length and offload setting: `--warmup` untimed steps, then `--iters`
//! timed steps (wall clock; each step ends with a device synchronisation because the loss
//! is read back). Reported per setting: median seconds, tokens/s, the device memory pool's
//! high-water mark during the timed steps, saved layer-input bytes and pinned host bytes.
//!
//! With `--offload both`, the gradients of the offloaded run are compared with those kept
//! on the device: `max |g_off - g_dev| / max |g_dev|` over every parameter (worst one
//! reported), beside the same figure for two identical runs without offload (the run-to-run
//! noise of the kernels: atomics in gradient kernels make GPU runs differ slightly). The
//! command fails when the offload difference exceeds twice the run-to-run difference plus
//! `--tolerance` (default 0; with deterministic kernels, as on the CPU, offload must then
//! change nothing). A race in the copies would show as a difference of order 1. One JSON
//! line per setting goes to stdout; the table to stderr.

use super::attention::median;
use anyhow::{bail, Context};
use candle_core::{DType, Tensor, Var};
use longctx::model::LlamaConfig;
use longctx::train::engine::{Engine, EngineOptions, Offload};
use longctx::train::metrics::device_memory;
use longctx::train::trainer::{load_start_model, parse_device};
use longctx::train::RunConfig;
use longctx_attention::local::LocalAttention;
use longctx_attention::AttentionMode;
use std::collections::HashMap;
use std::path::Path;
use std::sync::Arc;
use std::time::Instant;

/// Arguments of `longctx bench engine`.
#[derive(clap::Args, Debug, Clone)]
pub struct BenchEngineArgs {
    /// Model: `builtin:NAME` (random weights; tiny, tinyllama-1.1b-shape, llama2-7b-shape),
    /// a directory or a Hugging Face repo id.
    #[arg(long, default_value = "builtin:tinyllama-1.1b-shape")]
    pub model: String,
    /// Sequence lengths (tokens per sequence) to run.
    #[arg(long, value_delimiter = ',', default_values_t = vec![16384usize, 65536])]
    pub seq: Vec<usize>,
    /// Sequences per step.
    #[arg(long, default_value_t = 1)]
    pub batch: usize,
    /// Tokens per chunk of the token-wise parts (MLP, norms, head, loss).
    #[arg(long, default_value_t = 8192)]
    pub token_chunk: usize,
    /// Weight and activation type on a GPU (bf16, f16, f32); the CPU always uses f32.
    #[arg(long, default_value = "bf16")]
    pub dtype: String,
    /// Device: cpu, cuda or cuda:N.
    #[arg(long, default_value = "cuda")]
    pub device: String,
    /// Layer inputs: `off` (kept on the device), `on` (host memory), `both` (compare).
    #[arg(long, default_value = "both", value_parser = ["off", "on", "both"])]
    pub offload: String,
    /// Untimed steps per setting.
    #[arg(long, default_value_t = 1)]
    pub warmup: usize,
    /// Timed steps per setting (the median is reported).
    #[arg(long, default_value_t = 3)]
    pub iters: usize,
    /// Allowed excess of the offload gradient difference over twice the run-to-run one.
    #[arg(long, default_value_t = 0.0)]
    pub tolerance: f64,
    /// Seed of the random weights and tokens.
    #[arg(long, default_value_t = 0)]
    pub seed: u64,
    /// Split each timed step by phase (CUDA events: attention, GEMMs, norms/RoPE/activation,
    /// loss, gradient accumulation, copies, element-wise adds) and print the mean seconds per phase.
    #[arg(long)]
    pub profile: bool,
    /// Keep each layer's attention tensors for the backward (selective recomputation).
    #[arg(long)]
    pub save_attention: bool,
    /// Keep each layer's MLP input and gate/up projections for the backward.
    #[arg(long)]
    pub save_mlp: bool,
    /// Instead of timing: check the explicit layer backward (fused kernels) against the
    /// autograd reference at each length. Gradients of three runs on the same weights and
    /// tokens: autograd in f32 (the reference), autograd in `--dtype`, explicit in
    /// `--dtype`. Fails unless `|explicit − f32| ≤ 2·|autograd − f32| + --tolerance`
    /// (worst `max|Δ| / max|ref|` over parameters): the fused path within the model
    /// dtype's own noise.
    #[arg(long)]
    pub check_grads: bool,
}

struct Outcome {
    seconds: f64,
    /// Mean seconds per phase of the timed steps (with `--profile`).
    profile: Option<longctx::train::profile::PhaseTimes>,
    peak: Option<u64>,
    saved: usize,
    host: usize,
    loss: f64,
    /// Gradients of the last two timed steps.
    grads: Vec<Tensor>,
    prev: Option<Vec<Tensor>>,
}

/// Worst `max|a-b| / max|b|` over parameters.
fn grad_diff(a: &[Tensor], b: &[Tensor]) -> anyhow::Result<f64> {
    let mut worst = 0f64;
    for (x, r) in a.iter().zip(b) {
        let d = x.sub(r)?.abs()?.max_all()?.to_dtype(DType::F64)?.to_scalar::<f64>()?;
        let m = r.abs()?.max_all()?.to_dtype(DType::F64)?.to_scalar::<f64>()?;
        worst = worst.max(if m > 0.0 { d / m } else { d });
    }
    Ok(worst)
}

/// Bytes in MiB below 1 GiB, else in GiB.
fn human(b: u64) -> String {
    if b < 1 << 30 {
        format!("{:.1} MiB", b as f64 / (1u64 << 20) as f64)
    } else {
        format!("{:.2} GiB", b as f64 / (1u64 << 30) as f64)
    }
}

/// One offload setting at one length: warm-up, then the timed steps.
fn run_setting(
    a: &BenchEngineArgs,
    cfg: &LlamaConfig,
    vars: &HashMap<String, Var>,
    dev: &candle_core::Device,
    (ids, targets, pos): (&Tensor, &Tensor, &Tensor),
    s: usize,
    off: bool,
) -> anyhow::Result<Outcome> {
    let n = a.batch * s;
    let attn: Arc<dyn AttentionMode> = Arc::new(LocalAttention);
    let opts = EngineOptions {
        token_chunk: a.token_chunk,
        offload: Offload::of(off, false),
        profile: a.profile,
        save_attention: a.save_attention,
        save_mlp: a.save_mlp,
        ..Default::default()
    };
    let eng = Engine::from_vars(cfg, vars, opts)?;
    let run = |eng: &Engine| eng.step(ids, targets, pos, s, &attn, 1.0 / n as f64);
    for _ in 0..a.warmup {
        run(&eng)?;
    }
    dev.synchronize()?;
    eng.take_profile()?; // the warm-up's spans are not reported
    device_memory(dev, true)?;
    let mut ts = Vec::new();
    let mut phases = longctx::train::profile::PhaseTimes::default();
    // Gradients go to host memory right after each timed step, so the device peak
    // is the engine's own; two steps' are kept only to measure run-to-run noise.
    let host = |gs: &[Tensor]| gs.iter().map(|g| g.to_device(&candle_core::Device::Cpu)).collect::<candle_core::Result<Vec<_>>>();
    let (mut last, mut prev, mut peak) = (None, None, None);
    for _ in 0..a.iters {
        let t0 = Instant::now();
        let r = run(&eng)?;
        dev.synchronize()?;
        ts.push(t0.elapsed().as_secs_f64());
        let p = eng.take_profile()?;
        phases.seconds.iter_mut().zip(p.seconds).for_each(|(x, y)| *x += y / a.iters as f64);
        peak = peak.max(device_memory(dev, true)?.map(|(_, h)| h));
        let grads = host(&r.grads)?;
        let stats = (r.memory, r.loss_sum / r.n_tokens.max(1) as f64);
        drop(r);
        prev = last.replace((grads, stats)).filter(|_| a.offload == "both");
    }
    let (grads, (memory, loss)) = last.context("no timed step")?;
    Ok(Outcome {
        seconds: median(ts),
        profile: a.profile.then_some(phases),
        peak,
        saved: memory.saved_bytes,
        host: eng.pinned_bytes().max(memory.saved_host_bytes),
        loss,
        grads,
        prev: prev.map(|p| p.0),
    })
}

/// Deterministic ids, targets and positions `[batch, s]` for a length.
fn tokens(a: &BenchEngineArgs, cfg: &LlamaConfig, s: usize, dev: &candle_core::Device) -> anyhow::Result<(Tensor, Tensor, Tensor)> {
    let n = a.batch * s;
    let ids: Vec<u32> = (0..n).map(|i| ((i as u64 * 2654435761 + a.seed) % cfg.vocab_size as u64) as u32).collect();
    let targets: Vec<i64> = (0..n).map(|i| ((i as u64 * 40503 + 7 + a.seed) % cfg.vocab_size as u64) as i64).collect();
    let pos: Vec<u32> = (0..n).map(|i| (i % s) as u32).collect();
    Ok((
        Tensor::from_vec(ids, (a.batch, s), dev)?,
        Tensor::from_vec(targets, (a.batch, s), dev)?,
        Tensor::from_vec(pos, (a.batch, s), dev)?,
    ))
}

/// `--check-grads`: the explicit backward against autograd, within the dtype's noise.
fn check_grads(a: &BenchEngineArgs, cfg: &LlamaConfig, vars: &HashMap<String, Var>, dev: &candle_core::Device) -> anyhow::Result<()> {
    use longctx::train::engine::LayerBackward;
    let f32_vars: HashMap<String, Var> = vars
        .iter()
        .map(|(n, v)| Ok((n.clone(), Var::from_tensor(&v.as_tensor().to_dtype(DType::F32)?)?)))
        .collect::<anyhow::Result<_>>()?;
    let attn: Arc<dyn AttentionMode> = Arc::new(LocalAttention);
    let mut failed = false;
    for &s in &a.seq {
        let (ids, targets, pos) = tokens(a, cfg, s, dev)?;
        let scale = 1.0 / (a.batch * s) as f64;
        let run = |vars: &HashMap<String, Var>, lb: LayerBackward| -> anyhow::Result<(Vec<Tensor>, f64)> {
            let opts = EngineOptions {
                token_chunk: a.token_chunk,
                save_attention: a.save_attention,
                save_mlp: a.save_mlp,
                layer_backward: lb,
                ..Default::default()
            };
            let r = Engine::from_vars(cfg, vars, opts)?.step(&ids, &targets, &pos, s, &attn, scale)?;
            let host = r.grads.iter().map(|g| g.to_device(&candle_core::Device::Cpu)).collect::<candle_core::Result<Vec<_>>>()?;
            Ok((host, r.loss_sum * scale))
        };
        let (reference, l_ref) = run(&f32_vars, LayerBackward::Autograd)?;
        let (auto, l_auto) = run(vars, LayerBackward::Autograd)?;
        let (expl, l_expl) = run(vars, LayerBackward::Explicit)?;
        let (noise, diff) = (grad_diff(&auto, &reference)?, grad_diff(&expl, &reference)?);
        let ok = diff <= 2.0 * noise + a.tolerance;
        failed |= !ok;
        eprintln!(
            "seq {s}{}{}: explicit vs f32 {diff:.3e}, autograd vs f32 {noise:.3e} (noise); losses f32 {l_ref:.6}, autograd {l_auto:.6}, \
             explicit {l_expl:.6}: {}",
            if a.save_attention { ", attention saved" } else { "" },
            if a.save_mlp { ", MLP saved" } else { "" },
            if ok { "ok" } else { "FAILED" }
        );
        println!(
            "{}",
            serde_json::json!({"seq": s, "grad_diff_explicit": diff, "grad_diff_autograd": noise, "loss_f32": l_ref,
                "loss_autograd": l_auto, "loss_explicit": l_expl, "save_attention": a.save_attention, "save_mlp": a.save_mlp, "ok": ok})
        );
    }
    if failed {
        bail!("the explicit layer backward differs from the f32 reference by more than twice the autograd path's own error");
    }
    Ok(())
}

/// Refuses, before anything is allocated, a length whose estimated memory (`longctx
/// plan`'s model of the engine: weights, f32 gradients, saved tensors, one layer's
/// transients) exceeds what the device has: the GPU's memory, or on the CPU the host's
/// available memory. `--check-grads` is counted in f32 (its reference runs in f32).
fn check_memory(a: &BenchEngineArgs, cfg: &LlamaConfig, dev: &candle_core::Device, dtype: DType) -> anyhow::Result<()> {
    use longctx::parallel::dims::ParallelMode;
    use longctx::plan::{estimate, gb, ModelShape, PlanRequest};
    let host = longctx::device::host_available();
    let (have, what) = if dev.is_cpu() {
        (host, "host memory available")
    } else {
        (longctx::device::gpu_memory(&a.device, Path::new("--device"))?, "GPU memory")
    };
    let Some(have) = have else { return Ok(()) }; // the machine does not say
    let shape = ModelShape::from_config(cfg);
    // Each offload setting that runs (on the CPU the layer inputs stay in the same memory).
    let offloads: &[bool] = match a.offload.as_str() {
        _ if a.check_grads || dev.is_cpu() => &[false],
        "on" => &[true],
        "off" => &[false],
        _ => &[false, true],
    };
    for (&s, &off) in a.seq.iter().flat_map(|s| offloads.iter().map(move |o| (s, o))) {
        let mut r = PlanRequest::new(s, 1, have, ParallelMode::DataParallel);
        r.batch_size = a.batch;
        r.token_chunk = a.token_chunk;
        r.save_attention = a.save_attention;
        r.save_mlp = a.save_mlp;
        r.offload_activations = off;
        r.dtype_bytes = if a.check_grads { 4 } else { dtype.size_in_bytes() };
        if dev.is_cpu() {
            r.overhead = 0; // no CUDA context or workspaces
        } else {
            r.host_memory = host;
        }
        let e = estimate(&shape, &r).with_context(|| format!("--seq {s}: estimating its memory"))?;
        if e.device.peak > have {
            let (batch, device, need, have) = (a.batch, &a.device, gb(e.device.peak), gb(have));
            let saved = if a.save_attention || a.save_mlp { ", or drop --save-attention / --save-mlp" } else { "" };
            bail!(
                "--seq {s} (batch {batch}): needs an estimated {need} GB on {device}, the {what} is {have} GB; lower --seq or \
                 --batch{saved} (`longctx plan` gives the estimate by part)"
            );
        }
        if e.fits_host == Some(false) {
            let (batch, need, have) = (a.batch, gb(e.host.per_node), gb(host.unwrap_or(0)));
            bail!(
                "--seq {s} (batch {batch}): the offloaded layer inputs need an estimated {need} GB of host memory, {have} GB are \
                 available; use --offload off or a shorter --seq"
            );
        }
    }
    Ok(())
}

pub fn engine(a: &BenchEngineArgs) -> anyhow::Result<()> {
    if a.iters == 0 {
        bail!("--iters must be at least 1");
    }
    if a.batch == 0 || a.token_chunk == 0 || a.seq.contains(&0) {
        bail!("--batch, --token-chunk and every --seq must be at least 1");
    }
    let dev = parse_device(&a.device, Path::new("--device"))?;
    let dtype = if dev.is_cpu() { DType::F32 } else { longctx::train::trainer::parse_dtype(&a.dtype, Path::new("--dtype"), "dtype")? };
    let mut rc = RunConfig::plain();
    rc.model.source = a.model.clone();
    rc.seed = a.seed;
    let opts = longctx::hub::HubOptions::from_env();
    if let Some(m) = longctx::hub::model_config(&a.model, &opts, false).context("reading the model config")? {
        check_memory(a, &m.cfg, &dev, dtype)?;
    }
    let start = load_start_model(&rc).context("loading the model")?;
    let cfg: &LlamaConfig = &start.cfg;
    let mut vars: HashMap<String, Var> = HashMap::new();
    for (n, t) in &start.weights {
        vars.insert(n.clone(), Var::from_tensor(&t.to_dtype(dtype)?.to_device(&dev)?)?);
    }
    drop(start.weights);
    let settings: Vec<bool> = match a.offload.as_str() {
        "off" => vec![false],
        "on" => vec![true],
        _ => vec![false, true],
    };
    eprintln!(
        "bench engine: {} ({} layers, hidden {}), batch {}, token chunk {}, {:?} on {:?}",
        a.model, cfg.num_hidden_layers, cfg.hidden_size, a.batch, a.token_chunk, dtype, dev
    );
    eprintln!("{:>8} {:>8} {:>9} {:>10} {:>11} {:>11} {:>11}", "seq", "offload", "step s", "tok/s", "dev peak", "saved", "pinned");
    if a.check_grads {
        return check_grads(a, cfg, &vars, &dev);
    }
    let mut failed = false;
    for &s in &a.seq {
        let n = a.batch * s;
        let (ids, targets, pos) = tokens(a, cfg, s, &dev)?;
        let mut outs: Vec<(bool, Outcome)> = Vec::new();
        for &off in &settings {
            let o = run_setting(a, cfg, &vars, &dev, (&ids, &targets, &pos), s, off)?;
            let tok_s = n as f64 / o.seconds;
            eprintln!(
                "{:>8} {:>8} {:>9.3} {:>10.0} {:>11} {:>11} {:>11}",
                s,
                if off { "host" } else { "device" },
                o.seconds,
                tok_s,
                o.peak.map(human).unwrap_or_else(|| "-".into()),
                human(o.saved as u64),
                human(o.host as u64),
            );
            if let Some(p) = &o.profile {
                eprintln!("  profile: {}", p.summary(o.seconds));
            }
            println!(
                "{}",
                serde_json::json!({"seq": s, "batch": a.batch, "offload": off, "seconds": o.seconds, "tokens_per_s": tok_s,
                    "device_peak_bytes": o.peak, "saved_bytes": o.saved, "host_bytes": o.host, "loss": o.loss,
                    "profile": o.profile.as_ref().map(|p| p.to_json(o.seconds))})
            );
            outs.push((off, o));
        }
        if let [(false, dev_run), (true, host_run)] = &outs[..] {
            let noise = match &dev_run.prev {
                Some(p) => grad_diff(p, &dev_run.grads)?,
                None => 0.0,
            };
            let diff = grad_diff(&host_run.grads, &dev_run.grads)?;
            let ok = diff <= 2.0 * noise + a.tolerance;
            failed |= !ok;
            eprintln!(
                "  seq {s}: gradients offloaded vs kept {diff:.3e}, two runs kept {noise:.3e}, losses {:.6} / {:.6}: {}",
                host_run.loss,
                dev_run.loss,
                if ok { "ok" } else { "FAILED" }
            );
            println!("{}", serde_json::json!({"seq": s, "grad_diff_offload": diff, "grad_diff_runs": noise, "ok": ok}));
        }
    }
    if failed {
        bail!("offloaded gradients differ from those kept on the device beyond the run-to-run noise");
    }
    Ok(())
}
