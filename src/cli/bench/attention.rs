//! `longctx bench attention`: throughput of the block kernel and correctness checks.
//!
//! Throughput: causal attention, `q`/`k`/`v [b, s, h, d]`, timed one call at a time
//! (CUDA events around each call, waiting for each), median of `--iters` after `--warmup`
//! calls. By default the device's memory pool keeps freed buffers (see
//! `longctx_attention::cuda::retain_pool_memory`; `--release-pool` turns that off).
//! FLOP counts (the convention of FlashAttention and PyTorch benchmarks):
//! causal forward = 4·b·h·s²·d / 2 (two matmuls of 2·s²·d each, half of them masked),
//! backward = 2.5 × forward (five matmuls), forward+backward = 3.5 × forward.
//!
//! Every step runs for each `--kernel` (cuDNN, longctx's own Hopper kernels, and auto: per call the faster of the two).
//! Before any buffer is allocated the shape flags are checked and the throughput table's
//! estimated peak at the longest `--seq` is compared with the GPU's memory.
//!
//! `--check`: (1) the CUDA kernel against the CPU kernel on small shapes (inputs
//! rounded to bf16/f16 once, the CPU runs on those values in f32), for o, lse, dq, dk, dv;
//! (2) every sequence-parallel mode at W ∈ {2, 4} (ranks are threads sharing one GPU
//! stream) against the single-device CUDA result on the same inputs, then under a document
//! mask, a sliding window and both (against each document alone, or the dense masked
//! attention in f32 on the host). Errors are
//! `max|x - ref| / max|ref|` (lse: max absolute difference); the tolerances are stated
//! in [`Tol`] and a check that exceeds one fails the command.

use anyhow::{bail, Context};
use candle_core::{DType, Device, Tensor};
use longctx::parallel::{build_groups, DimsRequest, ParallelDims, ParallelMode};
use longctx::train::profile::Mark;
use longctx_attention::comm::{thread::run_ranks, Comm};
use longctx_attention::kernel::{self, CudaKernel, Mask, NativeRuns};
use longctx_attention::{layout, AttentionMode};
use std::sync::Arc;

/// Arguments of `longctx bench attention`.
#[derive(clap::Args, Debug, Clone)]
pub struct BenchAttentionArgs {
    /// Sequence lengths (tokens) to time.
    #[arg(long, value_delimiter = ',', default_values_t = vec![16384usize, 65536, 131072])]
    pub seq: Vec<usize>,
    /// Batch size.
    #[arg(long, default_value_t = 1)]
    pub batch: usize,
    /// Query heads.
    #[arg(long, default_value_t = 32)]
    pub heads: usize,
    /// Key/value heads (GQA); default: as many as query heads.
    #[arg(long)]
    pub kv_heads: Option<usize>,
    /// Head dimension.
    #[arg(long, default_value_t = 128)]
    pub head_dim: usize,
    /// Element type: bf16 or f16.
    #[arg(long, default_value = "bf16")]
    pub dtype: String,
    /// Untimed calls before timing.
    #[arg(long, default_value_t = 3)]
    pub warmup: usize,
    /// Timed calls (the median is reported).
    #[arg(long, default_value_t = 10)]
    pub iters: usize,
    /// Rounds of the throughput table: in each the kernels take turns call by call (so that
    /// each meets the GPU in the same state: a kernel timed right after a run of another
    /// read up to 10 % low at 16K on an H200), and each kernel's fastest round is reported.
    #[arg(long, default_value_t = 2, value_parser = clap::value_parser!(u64).range(1..=100))]
    pub rounds: u64,
    /// CUDA device ordinal.
    #[arg(long, default_value_t = 0)]
    pub gpu: usize,
    /// Run the correctness checks instead of the throughput benchmark.
    #[arg(long)]
    pub check: bool,
    /// Run the checks and then the benchmark.
    #[arg(long, conflicts_with = "check")]
    pub all: bool,
    /// Documents per sequence, comma-separated: besides the plain kernel, time attention
    /// under a document mask of that many equal documents (e.g. 1,16,64) and compare it
    /// with one document of the whole length.
    #[arg(long, value_delimiter = ',')]
    pub docs: Vec<usize>,
    /// Sliding windows in tokens, comma-separated: besides the plain kernel, time attention
    /// with each window (one document per sequence) against full causal attention.
    #[arg(long, value_delimiter = ',')]
    pub window: Vec<usize>,
    /// CUDA kernels to time and check, comma-separated: cudnn, native (longctx's own Hopper
    /// forward and backward), auto (per call the one measured faster on that shape: the
    /// default of `attention.kernel`) [default: all three].
    #[arg(long, value_delimiter = ',', default_values_t = vec!["cudnn".to_string(), "native".to_string(), "auto".to_string()])]
    pub kernel: Vec<String>,
    /// Leave the CUDA memory pool's release threshold at the driver default (0), so freed
    /// buffers go back to the driver at every synchronisation (default: retain them).
    #[arg(long)]
    pub release_pool: bool,
}

/// Entry point of `longctx bench attention`.
pub fn attention(args: &BenchAttentionArgs) -> anyhow::Result<()> {
    let dtype = match args.dtype.as_str() {
        "bf16" => DType::BF16,
        "f16" => DType::F16,
        other => bail!("--dtype {other}: expected bf16 or f16"),
    };
    let kernels = args
        .kernel
        .iter()
        .map(|k| k.parse::<CudaKernel>().map_err(|e| anyhow::anyhow!("--kernel: {e}")))
        .collect::<anyhow::Result<Vec<_>>>()?;
    if kernels.is_empty() {
        bail!("--kernel: expected at least one of {}", CudaKernel::names());
    }
    if !args.check {
        check_shape(args)?;
        if let Some(total) = longctx::device::gpu_total_memory(args.gpu) {
            check_fits(args, dtype, kernels.len(), total)?;
        }
    }
    let dev = Device::new_cuda_with_stream(args.gpu)
        .with_context(|| format!("opening CUDA device {} (is this binary built with --features cuda?)", args.gpu))?;
    report_cudnn();
    if !args.release_pool {
        retain_pool(&dev)?;
    }
    if args.check || args.all {
        let mut failed = Vec::new();
        for &k in &kernels {
            k.select();
            let before = native_runs();
            let mut ok = check(&dev, dtype, k)?;
            let ran = native_runs();
            if k == CudaKernel::Native && (ran.fwd == before.fwd || ran.bwd == before.bwd) {
                let which = if ran.fwd == before.fwd { "forward" } else { "backward" };
                println!("\nnative: FAIL, the native kernel ran no {which} (cuDNN ran them all: {})", native_missing());
                ok = false;
            }
            if !ok {
                failed.push(k.name());
            }
        }
        CudaKernel::Cudnn.select();
        // The checks that do not depend on the forward kernel, once.
        let shared = check_unsupported(&dev)? & check_stash(&dev)?;
        if !failed.is_empty() || !shared {
            let which = if failed.is_empty() { String::new() } else { format!(" with the {} kernel", failed.join(" and ")) };
            bail!("attention check failed{which} (see the rows marked FAIL)");
        }
        println!("\nall attention checks passed ({})", kernels.iter().map(|k| k.name()).collect::<Vec<_>>().join(", "));
    }
    if !args.check {
        throughput(&dev, dtype, args, &kernels)?;
        if !args.docs.is_empty() || !args.window.is_empty() {
            throughput_docs(&dev, dtype, args)?;
        }
    }
    CudaKernel::Cudnn.select();
    Ok(())
}

/// Forwards and backwards the native kernel has run ([`longctx_attention::cuda::native_runs`]).
#[cfg(feature = "cuda")]
fn native_runs() -> NativeRuns {
    longctx_attention::cuda::native_runs()
}

#[cfg(not(feature = "cuda"))]
fn native_runs() -> NativeRuns {
    NativeRuns::default()
}

/// Why the native kernel may not have run: not in this build, or not this GPU.
fn native_missing() -> &'static str {
    #[cfg(feature = "cuda")]
    if longctx_attention::cuda::native_built() {
        return "the build has the kernel, so the GPU or the shapes are not covered; see the note above";
    }
    "this build has no native kernel (CUDA_COMPUTE_CAP=90 and the CUTLASS headers: scripts/build_cuda.sh)"
}

#[cfg(feature = "cuda")]
fn report_cudnn() {
    match longctx_attention::cuda::cudnn_version() {
        Ok(v) => println!("cuDNN {}.{}.{}", v / 10000, (v / 100) % 100, v % 100),
        Err(e) => println!("cuDNN not loaded: {e}"),
    }
}

#[cfg(not(feature = "cuda"))]
fn report_cudnn() {}

#[cfg(feature = "cuda")]
fn retain_pool(dev: &Device) -> anyhow::Result<()> {
    Ok(longctx_attention::cuda::retain_pool_memory(dev.as_cuda_device()?)?)
}

#[cfg(not(feature = "cuda"))]
fn retain_pool(_dev: &Device) -> anyhow::Result<()> {
    Ok(())
}

// ---------------------------------------------------------------- throughput

/// The throughput shape's flags: every size at least 1, the query heads a multiple of the
/// key/value heads, every length at least 1.
fn check_shape(a: &BenchAttentionArgs) -> anyhow::Result<()> {
    let hkv = a.kv_heads.unwrap_or(a.heads);
    for (flag, v) in [("--batch", a.batch), ("--heads", a.heads), ("--kv-heads", hkv), ("--head-dim", a.head_dim)] {
        if v == 0 {
            bail!("{flag} 0: expected at least 1");
        }
    }
    if !a.heads.is_multiple_of(hkv) {
        bail!("--heads {} --kv-heads {hkv}: the query heads must be a multiple of the key/value heads (GQA)", a.heads);
    }
    if a.seq.is_empty() || a.seq.contains(&0) {
        bail!("--seq {:?}: expected lengths of at least 1 token", a.seq);
    }
    Ok(())
}

/// Device bytes the throughput table holds at its peak for length `s` with `kernels`
/// kernels (`None` past u64): q, k, v, dO; each kernel's saved (o, lse); during a timed
/// forward + backward one more (o, lse), dq, dk, dv and the native backward's f32 workspace
/// (dQ's accumulator, lse·log2 e and D over rows rounded up to 128). cuDNN's own workspace
/// is not counted.
fn throughput_bytes(a: &BenchAttentionArgs, s: usize, kernels: usize, elt: u64) -> Option<u64> {
    let (b, h, d) = (a.batch as u64, a.heads as u64, a.head_dim as u64);
    let hkv = a.kv_heads.unwrap_or(a.heads) as u64;
    let s = s as u64;
    let s_pad = s.checked_add(127)? / 128 * 128;
    let q = b.checked_mul(s)?.checked_mul(h)?.checked_mul(d)?.checked_mul(elt)?;
    let kv = b.checked_mul(s)?.checked_mul(hkv)?.checked_mul(d)?.checked_mul(elt)?;
    let lse = b.checked_mul(h)?.checked_mul(s)?.checked_mul(4)?;
    let saved = q.checked_add(lse)?;
    let workspace = b.checked_mul(h)?.checked_mul(s_pad)?.checked_mul(d.checked_add(2)?)?.checked_mul(4)?;
    let inputs = q.checked_mul(2)?.checked_add(kv.checked_mul(2)?)?;
    let grads = q.checked_add(kv.checked_mul(2)?)?;
    saved.checked_mul(kernels as u64 + 1)?.checked_add(inputs)?.checked_add(grads)?.checked_add(workspace)
}

/// Refuses a throughput run whose longest length would not fit a GPU of `total` bytes.
fn check_fits(a: &BenchAttentionArgs, dtype: DType, kernels: usize, total: u64) -> anyhow::Result<()> {
    let elt = dtype.size_in_bytes() as u64;
    let gib = |x: u64| x as f64 / (1u64 << 30) as f64;
    for &s in &a.seq {
        let need = throughput_bytes(a, s, kernels, elt);
        if need.is_none_or(|n| n > total) {
            let need = need.map_or("more than 2^64 bytes".to_string(), |n| format!("an estimated {:.1} GiB", gib(n)));
            bail!(
                "--seq {s} with --batch {} --heads {} --kv-heads {} --head-dim {} and {kernels} kernel(s) needs {need} \
                 of GPU memory, the GPU has {:.1} GiB: use a shorter --seq, fewer --heads or --batch, or fewer --kernel",
                a.batch,
                a.heads,
                a.kv_heads.unwrap_or(a.heads),
                a.head_dim,
                gib(total)
            );
        }
    }
    Ok(())
}

pub(crate) fn median(mut xs: Vec<f64>) -> f64 {
    xs.sort_by(|a, b| a.total_cmp(b));
    let n = xs.len();
    if n % 2 == 1 {
        xs[n / 2]
    } else {
        (xs[n / 2 - 1] + xs[n / 2]) / 2.0
    }
}

/// Median seconds of one call of `f`: CUDA events recorded on the device's stream around
/// each call (as PyTorch benchmarks time), waiting for the end event after each call.
fn time(dev: &Device, warmup: usize, iters: usize, mut f: impl FnMut() -> candle_core::Result<()>) -> anyhow::Result<f64> {
    Ok(time_each(dev, warmup, iters, 1, |_| f())?[0])
}

/// Median seconds of one call of each of `n` calls `f(0)` … `f(n - 1)`, timed in turn call
/// by call (in the order 0..n, then n..0, and so on), so that each meets the GPU in the same
/// state: on an H200 a kernel timed right after a run of another read up to 10 % low at 16K,
/// whichever it was. CUDA events recorded on the device's stream around each call (as
/// PyTorch benchmarks time), waiting for the end event after each call.
fn time_each(
    dev: &Device,
    warmup: usize,
    iters: usize,
    n: usize,
    mut f: impl FnMut(usize) -> candle_core::Result<()>,
) -> anyhow::Result<Vec<f64>> {
    for _ in 0..warmup {
        for i in 0..n {
            f(i)?;
        }
    }
    dev.synchronize()?;
    let mut ts = vec![Vec::with_capacity(iters.max(1)); n];
    for it in 0..iters.max(1) {
        for j in 0..n {
            let i = if it % 2 == 0 { j } else { n - 1 - j };
            let start = Mark::now(dev)?;
            f(i)?;
            let end = Mark::now(dev)?;
            ts[i].push(start.seconds_to(&end)?);
        }
    }
    Ok(ts.into_iter().map(median).collect())
}

fn randn(shape: &[usize], dtype: DType, dev: &Device) -> candle_core::Result<Tensor> {
    Tensor::randn(0f32, 1f32, shape, dev)?.to_dtype(dtype)
}

fn throughput(dev: &Device, dtype: DType, a: &BenchAttentionArgs, kernels: &[CudaKernel]) -> anyhow::Result<()> {
    let (b, h, d) = (a.batch, a.heads, a.head_dim);
    let hkv = a.kv_heads.unwrap_or(h);
    let scale = 1.0 / (d as f64).sqrt();
    let pool = if a.release_pool { "released at each sync" } else { "retained" };
    println!(
        "\ncausal attention, {dtype:?}, b={b}, heads {h} (kv {hkv}) × {d}; median of {} after {} warmup, the fastest of {} round(s), the kernels taking turns call by call; pool memory {pool}",
        a.iters, a.warmup, a.rounds
    );
    println!("FLOP: fwd = 4·b·h·s²·d/2, bwd = 2.5·fwd, fwd+bwd = 3.5·fwd\n");
    println!("| kernel | seq | fwd ms | fwd TFLOP/s | bwd ms | bwd TFLOP/s | fwd+bwd ms | fwd+bwd TFLOP/s |");
    println!("| --- | --- | --- | --- | --- | --- | --- | --- |");
    for &s in &a.seq {
        let q = randn(&[b, s, h, d], dtype, dev)?;
        let k = randn(&[b, s, hkv, d], dtype, dev)?;
        let v = randn(&[b, s, hkv, d], dtype, dev)?;
        let d_o = randn(&[b, s, h, d], dtype, dev)?;
        // per kernel: the forward's (o, lse) for its backward, and its label: which kernel
        // ran each direction, from the native counters over one untimed fwd + bwd
        let mut saved = Vec::with_capacity(kernels.len());
        let mut labels = Vec::with_capacity(kernels.len());
        for &kern in kernels {
            kern.select();
            let before = native_runs();
            let (o, lse) = kernel::fwd(&q, &k, &v, Mask::Causal, scale)?;
            kernel::bwd(&d_o, kernel::Saved::new(&q, &k, &v, &o, &lse), Mask::Causal, scale)?;
            let ran = native_runs();
            let which = |native: bool| if native { "native" } else { "cuDNN" };
            labels.push(match (kern, ran.fwd > before.fwd, ran.bwd > before.bwd) {
                (CudaKernel::Native, false, false) => "native (not covered: cuDNN ran)".to_string(),
                (CudaKernel::Native, true, false) => "native fwd, cuDNN bwd (not covered)".to_string(),
                (CudaKernel::Native, false, true) => "cuDNN fwd (not covered), native bwd".to_string(),
                (CudaKernel::Auto, f, b) => format!("auto: {} fwd, {} bwd", which(f), which(b)),
                (k, _, _) => k.name().to_string(),
            });
            saved.push((o, lse));
        }
        // per kernel the fastest round's (fwd, bwd, fwd+bwd) seconds; in a round the kernels
        // take turns call by call
        let mut best = vec![[f64::INFINITY; 3]; kernels.len()];
        for _ in 0..a.rounds {
            let fwd = time_each(dev, a.warmup, a.iters, kernels.len(), |i| {
                kernels[i].select();
                kernel::fwd(&q, &k, &v, Mask::Causal, scale).map(|_| ())
            })?;
            let bwd = time_each(dev, a.warmup, a.iters, kernels.len(), |i| {
                kernels[i].select();
                let (o, lse) = &saved[i];
                kernel::bwd(&d_o, kernel::Saved::new(&q, &k, &v, o, lse), Mask::Causal, scale).map(|_| ())
            })?;
            let fb = time_each(dev, a.warmup, a.iters, kernels.len(), |i| {
                kernels[i].select();
                let (o, lse) = kernel::fwd(&q, &k, &v, Mask::Causal, scale)?;
                kernel::bwd(&d_o, kernel::Saved::new(&q, &k, &v, &o, &lse), Mask::Causal, scale).map(|_| ())
            })?;
            for (i, slots) in best.iter_mut().enumerate() {
                for (slot, t) in slots.iter_mut().zip([fwd[i], bwd[i], fb[i]]) {
                    *slot = slot.min(t);
                }
            }
        }
        let f = 4.0 * (b * h) as f64 * (s as f64) * (s as f64) * d as f64 / 2.0;
        let tf = |flop: f64, t: f64| flop / t / 1e12;
        for (label, [t_f, t_b, t_fb]) in labels.into_iter().zip(best) {
            println!(
                "| {label} | {s} | {:.2} | {:.0} | {:.2} | {:.0} | {:.2} | {:.0} |",
                t_f * 1e3,
                tf(f, t_f),
                t_b * 1e3,
                tf(2.5 * f, t_b),
                t_fb * 1e3,
                tf(3.5 * f, t_fb)
            );
        }
    }
    Ok(())
}

/// Attention under a document mask of `n` equal documents per sequence (`--docs`) or a
/// sliding window (`--window`), through the single-device mode
/// (`LocalAttention::forward_docs`), against one document with full causal attention.
fn throughput_docs(dev: &Device, dtype: DType, a: &BenchAttentionArgs) -> anyhow::Result<()> {
    use longctx_attention::local::LocalAttention;
    let (b, h, d) = (a.batch, a.heads, a.head_dim);
    let hkv = a.kv_heads.unwrap_or(h);
    let scale = 1.0 / (d as f64).sqrt();
    println!("\nmasked causal attention (LocalAttention::forward_docs/backward_docs): equal documents per sequence, or a sliding window");
    println!("work = (query, key) pairs attended / S(S+1)/2 of one document; time ratio against one document of the same length\n");
    println!("| seq | mask | work | fwd ms | bwd ms | fwd+bwd ms | fwd+bwd vs one doc |");
    println!("| --- | --- | --- | --- | --- | --- | --- |");
    for &s in &a.seq {
        let q = randn(&[b, s, h, d], dtype, dev)?;
        let k = randn(&[b, s, hkv, d], dtype, dev)?;
        let v = randn(&[b, s, hkv, d], dtype, dev)?;
        let d_o = randn(&[b, s, h, d], dtype, dev)?;
        let mut one = None;
        let mut ns = a.docs.clone();
        if !ns.contains(&1) {
            ns.insert(0, 1);
        }
        let mut masks = Vec::new();
        for n in ns {
            if n == 0 || n > s {
                bail!("--docs {n}: expected 1 to the sequence length {s}");
            }
            let starts: Vec<usize> = (0..n).map(|i| i * s / n).collect();
            masks.push((format!("{n} docs"), longctx_attention::Docs::new(vec![starts; b], s)?));
        }
        for &w in &a.window {
            if w == 0 {
                bail!("--window 0: a window holds at least one token (the query itself)");
            }
            masks.push((format!("window {w}"), longctx_attention::Docs::whole(s)?.with_window(w)?));
        }
        for (label, docs) in masks {
            let m = LocalAttention;
            let (o, lse) = m.forward_docs(&q, &k, &v, Some(&docs), scale)?;
            let saved = kernel::Saved::new(&q, &k, &v, &o, &lse);
            let t_f = time(dev, a.warmup, a.iters, || m.forward_docs(&q, &k, &v, Some(&docs), scale).map(|_| ()))?;
            let t_b = time(dev, a.warmup, a.iters, || m.backward_docs(&d_o, saved, Some(&docs), scale).map(|_| ()))?;
            let t_fb = time(dev, a.warmup, a.iters, || {
                let (o, lse) = m.forward_docs(&q, &k, &v, Some(&docs), scale)?;
                m.backward_docs(&d_o, kernel::Saved::new(&q, &k, &v, &o, &lse), Some(&docs), scale).map(|_| ())
            })?;
            let base = *one.get_or_insert(t_fb);
            println!(
                "| {s} | {label} | {:.4} | {:.2} | {:.2} | {:.2} | {:.3} |",
                docs.work_fraction(),
                t_f * 1e3,
                t_b * 1e3,
                t_fb * 1e3,
                t_fb / base
            );
        }
    }
    Ok(())
}

// ---------------------------------------------------------------- correctness

/// Tolerances, as `max|x - ref| / max|ref|` (lse: absolute, in nats).
/// CUDA vs CPU: the fused kernel rounds P to bf16 before the P·V product and writes
/// bf16 outputs (relative step 2^-8 = 0.4%), so o ≤ 2%, gradients ≤ 5%; lse is
/// accumulated in f32 from the same bf16 inputs, ≤ 5e-3. Mode vs local CUDA: the same
/// kernel on split blocks plus an f32 merge, same bounds.
struct Tol {
    o: f64,
    lse: f64,
    grad: f64,
}

const TOL: Tol = Tol { o: 2e-2, lse: 5e-3, grad: 5e-2 };

fn rel_err(x: &Tensor, r: &Tensor) -> anyhow::Result<f64> {
    Ok(longctx_attention::testing::rel_err(x, r)?)
}

fn abs_err(x: &Tensor, r: &Tensor) -> anyhow::Result<f64> {
    let x = x.to_device(&Device::Cpu)?.to_dtype(DType::F32)?;
    let r = r.to_device(&Device::Cpu)?.to_dtype(DType::F32)?;
    Ok((x - r)?.abs()?.max_all()?.to_scalar::<f32>()? as f64)
}

/// Outputs of one forward + backward: o, lse, dq, dk, dv.
type Five = [Tensor; 5];

/// Compares `x` with `r`, prints one table row, returns whether it is within [`TOL`].
fn compare(label: &str, x: &Five, r: &Five) -> anyhow::Result<bool> {
    let e = [rel_err(&x[0], &r[0])?, abs_err(&x[1], &r[1])?, rel_err(&x[2], &r[2])?, rel_err(&x[3], &r[3])?, rel_err(&x[4], &r[4])?];
    let ok = e[0] <= TOL.o && e[1] <= TOL.lse && e[2..].iter().all(|&g| g <= TOL.grad);
    println!("| {label} | {:.2e} | {:.2e} | {:.2e} | {:.2e} | {:.2e} | {} |", e[0], e[1], e[2], e[3], e[4], if ok { "ok" } else { "FAIL" });
    Ok(ok)
}

fn fwd_bwd(q: &Tensor, k: &Tensor, v: &Tensor, d_o: &Tensor, mask: Mask, scale: f64) -> candle_core::Result<Five> {
    let (o, lse) = kernel::fwd(q, k, v, mask, scale)?;
    let (dq, dk, dv) = kernel::bwd(d_o, kernel::Saved::new(q, k, v, &o, &lse), mask, scale)?;
    Ok([o, lse, dq, dk, dv])
}

/// Uniform values of unit variance (in ±√3), from a seeded generator, rounded to `dtype`.
fn uniform(shape: &[usize], dtype: DType, rng: &mut rand::rngs::StdRng) -> candle_core::Result<Tensor> {
    use rand::Rng;
    let n: usize = shape.iter().product();
    let a = 3f32.sqrt();
    let data: Vec<f32> = (0..n).map(|_| rng.random_range(-a..a)).collect();
    Tensor::from_vec(data, shape, &Device::Cpu)?.to_dtype(dtype)
}

/// Random inputs rounded to `dtype` once, on the CPU: (q, k, v, do).
#[allow(clippy::too_many_arguments)]
fn inputs(b: usize, s: usize, t: usize, hq: usize, hkv: usize, d: usize, dtype: DType, seed: u64) -> anyhow::Result<[Tensor; 4]> {
    use rand::SeedableRng;
    let mut rng = rand::rngs::StdRng::seed_from_u64(seed);
    Ok([
        uniform(&[b, s, hq, d], dtype, &mut rng)?,
        uniform(&[b, t, hkv, d], dtype, &mut rng)?,
        uniform(&[b, t, hkv, d], dtype, &mut rng)?,
        uniform(&[b, s, hq, d], dtype, &mut rng)?,
    ])
}

/// The checks that depend on the forward kernel `kern` (set by the caller); whether all passed.
fn check(dev: &Device, dtype: DType, kern: CudaKernel) -> anyhow::Result<bool> {
    let mut ok = true;
    println!("\n{} CUDA kernel vs CPU kernel (f32 on the same {dtype:?}-rounded inputs)", kern.name());
    println!("tolerances: o {:.0e}, lse {:.0e} (abs), grads {:.0e}, relative to max|ref|\n", TOL.o, TOL.lse, TOL.grad);
    println!("| case | o | lse | dq | dk | dv | |");
    println!("| --- | --- | --- | --- | --- | --- | --- |");
    // (label, b, s, t, hq, hkv, d, mask, dtype)
    let cases = [
        ("causal s512 h4 d64", 1, 512, 512, 4, 4, 64, Mask::Causal, dtype),
        ("causal s512 h4/2 d128 b2 GQA", 2, 512, 512, 4, 2, 128, Mask::Causal, dtype),
        ("none s256×t512 h4/2 d128 GQA", 1, 256, 512, 4, 2, 128, Mask::None, dtype),
        ("none s512×t256 h8/2 d64 GQA", 1, 512, 256, 8, 2, 64, Mask::None, dtype),
        ("causal s384 h4 d128 f16", 1, 384, 384, 4, 4, 128, Mask::Causal, DType::F16),
        // sliding-window blocks (longctx_attention::band cuts them into cuDNN band calls)
        ("band s512 w100 h4/2 d128 GQA", 1, 512, 512, 4, 2, 128, Mask::Band { offset: 0, window: 100 }, dtype),
        ("band s256×t512 offset 300 w200 h8/2 d64", 1, 256, 512, 8, 2, 64, Mask::Band { offset: 300, window: 200 }, dtype),
        // (a window of 1 is no check of the backward: every row's softmax is exactly 1, the
        // true dq and dk are 0, and their relative error compares rounding noise with noise)
        ("band s512 w2 h4 d64 (a query and the key before it)", 1, 512, 512, 4, 4, 64, Mask::Band { offset: 0, window: 2 }, dtype),
        ("band s384 offset 384 w512 h4 d128 b2 f16", 2, 384, 384, 4, 4, 128, Mask::Band { offset: 384, window: 512 }, DType::F16),
    ];
    for (i, (label, b, s, t, hq, hkv, d, mask, dt)) in cases.into_iter().enumerate() {
        let [q, k, v, d_o] = inputs(b, s, t, hq, hkv, d, dt, 1000 + i as u64)?;
        let scale = 1.0 / (d as f64).sqrt();
        let f32s = |x: &Tensor| x.to_dtype(DType::F32);
        let reference = fwd_bwd(&f32s(&q)?, &f32s(&k)?, &f32s(&v)?, &f32s(&d_o)?, mask, scale)?;
        let on = |x: &Tensor| x.to_device(dev);
        let got = fwd_bwd(&on(&q)?, &on(&k)?, &on(&v)?, &on(&d_o)?, mask, scale)?;
        ok &= compare(label, &got, &reference)?;
    }
    ok &= check_modes(dev, dtype)?;
    println!("\n{} kernel: {}", kern.name(), if ok { "every check passed" } else { "FAIL" });
    Ok(ok)
}

/// Host parking ([`longctx_attention::stash`]): tensors of several dtypes, a narrowed view
/// (offset storage) and a transposed one (non-contiguous) come back bit-identical, with
/// every fetch started before any is used, kernels queued in between, buffers reused.
fn check_stash(dev: &Device) -> anyhow::Result<bool> {
    use longctx_attention::stash::Stash;
    let base = Tensor::randn(0f32, 1f32, (64, 1000), dev)?;
    let xs = vec![
        base.to_dtype(DType::BF16)?,
        base.to_dtype(DType::F16)?,
        base.clone(),
        base.narrow(0, 7, 30)?,
        base.t()?.to_dtype(DType::BF16)?,
        Tensor::arange(0u32, 4096, dev)?,
    ];
    let bits = |t: &Tensor| -> candle_core::Result<Vec<u8>> {
        let t = t.to_device(&Device::Cpu)?.flatten_all()?;
        Ok(match t.dtype() {
            DType::U32 => t.to_vec1::<u32>()?.iter().flat_map(|x| x.to_le_bytes()).collect(),
            _ => t.to_dtype(DType::F32)?.to_vec1::<f32>()?.iter().flat_map(|x| x.to_le_bytes()).collect(),
        })
    };
    let mut stash = Stash::new();
    let mut ok = true;
    let mut pinned_after = Vec::new();
    for round in 0..2 {
        let parked = xs.iter().map(|x| stash.park(x)).collect::<candle_core::Result<Vec<_>>>()?;
        let _busy = base.matmul(&base.t()?)?; // compute queued while copies run
        let coming = parked.iter().map(|p| stash.fetch(p, dev)).collect::<candle_core::Result<Vec<_>>>()?;
        drop(parked); // buffers back to the pool while the copies back may still run
        for (i, (f, x)) in coming.into_iter().zip(&xs).enumerate() {
            let y = f.ready()?;
            let same = y.dims() == x.dims() && y.dtype() == x.dtype() && bits(&y)? == bits(x)?;
            if !same {
                println!("stash round {round} tensor {i} ({:?} {:?}): FAIL, differs after the round trip", x.dtype(), x.dims());
            }
            ok &= same;
        }
        pinned_after.push(stash.pinned_bytes());
    }
    if pinned_after[0] != pinned_after[1] {
        println!("stash: pinned bytes grew from {} to {} in the second round: FAIL (buffers not reused)", pinned_after[0], pinned_after[1]);
        ok = false;
    }
    stash.settle()?;
    println!(
        "
host stash round trips (6 tensors × 2 rounds, {} KiB pinned): {}",
        stash.pinned_bytes() >> 10,
        if ok { "ok" } else { "FAIL" }
    );
    Ok(ok)
}

/// f32 on CUDA is refused with an error naming the dtype unless the fallback is allowed.
#[cfg(feature = "cuda")]
fn check_unsupported(dev: &Device) -> anyhow::Result<bool> {
    use longctx_attention::cuda::set_fallback;
    let [q, k, v, _] = inputs(1, 64, 64, 2, 2, 64, DType::F32, 7)?;
    let (q, k, v) = (q.to_device(dev)?, k.to_device(dev)?, v.to_device(dev)?);
    set_fallback(false);
    let refused = match kernel::fwd(&q, &k, &v, Mask::Causal, 0.125) {
        Err(e) => e.to_string().contains("F32"),
        Ok(_) => false,
    };
    set_fallback(true);
    let fell_back = kernel::fwd(&q, &k, &v, Mask::Causal, 0.125).is_ok();
    set_fallback(false);
    println!("\nf32 on CUDA: refused with a clear error: {refused}; runs with the fallback allowed: {fell_back}");
    Ok(refused && fell_back)
}

#[cfg(not(feature = "cuda"))]
fn check_unsupported(_dev: &Device) -> anyhow::Result<bool> {
    Ok(true)
}

/// FPDT chunk size used by the checks (global tokens).
const FPDT_CHUNK: usize = 256;

/// The modes checked, with their Ulysses degree at world `w` (USP: 2 × w/2 from w = 4).
const CHECKED_MODES: [ParallelMode; 4] = [ParallelMode::ZigzagRingAttn, ParallelMode::UlyssesAttn, ParallelMode::Fpdt, ParallelMode::Usp];
fn ulysses_for(mode: ParallelMode, w: usize) -> Option<usize> {
    (mode == ParallelMode::Usp).then_some(if w >= 4 { 2 } else { 1 })
}

/// One sp rank's attention and token indices for `mode` over `w` ranks (no data parallelism).
fn mode_on(
    comm: &Arc<dyn Comm>,
    mode: ParallelMode,
    w: usize,
    hq: usize,
    hkv: usize,
    seq: usize,
) -> longctx::Result<(Arc<dyn AttentionMode>, Vec<usize>)> {
    let dims = ParallelDims::new(&DimsRequest { mode, world: w, sp: Some(w), ulysses: ulysses_for(mode, w), hq, hkv })?;
    let groups = build_groups(comm, &dims)?;
    let idx = mode.local_indices(&dims, groups.sp.rank(), seq, FPDT_CHUNK)?;
    Ok((mode.build(&groups, FPDT_CHUNK, true), idx))
}

/// Every mode at W ∈ {2, 4}, ranks on threads sharing `dev`, vs the local CUDA result;
/// then the same under a document mask (documents crossing chunks and ranks, documents of
/// 1–3 tokens, several of one length) vs every document run alone through the kernel.
fn check_modes(dev: &Device, dtype: DType) -> anyhow::Result<bool> {
    let (b, s, hq, hkv, d) = (1, 1024, 8, 2, 128);
    let scale = 1.0 / (d as f64).sqrt();
    let [q, k, v, d_o] = inputs(b, s, s, hq, hkv, d, dtype, 4242)?;
    let (q, k, v, d_o) = (q.to_device(dev)?, k.to_device(dev)?, v.to_device(dev)?, d_o.to_device(dev)?);
    let plain = fwd_bwd(&q, &k, &v, &d_o, Mask::Causal, scale)?;
    let docs = longctx_attention::Docs::new(vec![vec![0, 100, 101, 103, 106, 300, 364, 428, 492, 556, 1000]], s)?;
    let by_doc = {
        let inp = longctx_attention::testing::Inputs { q: q.clone(), k: k.clone(), v: v.clone(), d_o: d_o.clone() };
        let r = longctx_attention::testing::reference_docs(&inp, &docs, scale)?;
        [r.o, r.lse, r.dq, r.dk, r.dv]
    };
    // Sliding windows (alone: 200 keys, crossing the chunks of every mode; with the
    // documents: 64) against the dense masked attention in f32 on the host.
    let window = longctx_attention::Docs::whole(s)?.with_window(200)?;
    let docs_window = docs.clone().with_window(64)?;
    let dense = |m: &longctx_attention::Docs| -> anyhow::Result<Five> {
        let host = |x: &Tensor| x.to_device(&Device::Cpu)?.to_dtype(DType::F32);
        let inp = longctx_attention::testing::Inputs { q: host(&q)?, k: host(&k)?, v: host(&v)?, d_o: host(&d_o)? };
        let docs = (m.rows() > 0).then_some(m);
        let r = longctx_attention::testing::reference_window(&inp, docs, m.window(), scale)?;
        Ok([r.o, r.lse, r.dq, r.dk, r.dv])
    };
    let (by_window, by_docs_window) = (dense(&window)?, dense(&docs_window)?);
    let mut ok = true;
    let passes = [(None, &plain), (Some(&docs), &by_doc), (Some(&window), &by_window), (Some(&docs_window), &by_docs_window)];
    for (i, (docs, reference)) in passes.into_iter().enumerate() {
        match i {
            0 => println!("\nmodes vs local CUDA kernel (S={s}, heads {hq}/{hkv} × {d}, {dtype:?}, ranks = threads on one GPU stream)\n"),
            1 => println!("\nmodes under a document mask (11 documents) vs each document alone through the CUDA kernel\n"),
            2 => println!("\nmodes under a sliding window of 200 keys vs dense masked attention (f32, host)\n"),
            _ => println!("\nmodes under the 11 documents and a window of 64 keys vs dense masked attention (f32, host)\n"),
        }
        println!("| mode | o | lse | dq | dk | dv | |");
        println!("| --- | --- | --- | --- | --- | --- | --- |");
        if let Some(docs) = docs {
            let m = longctx_attention::local::LocalAttention;
            let (o, lse) = m.forward_docs(&q, &k, &v, Some(docs), scale)?;
            let (dq, dk, dv) = m.backward_docs(&d_o, kernel::Saved::new(&q, &k, &v, &o, &lse), Some(docs), scale)?;
            ok &= compare("local", &[o, lse, dq, dk, dv], reference)?;
        }
        ok &= check_modes_on(dev, (&q, &k, &v, &d_o), docs, reference, (s, hq, hkv, scale))?;
    }
    Ok(ok)
}

fn check_modes_on(
    _dev: &Device,
    (q, k, v, d_o): (&Tensor, &Tensor, &Tensor, &Tensor),
    docs: Option<&longctx_attention::Docs>,
    reference: &Five,
    (s, hq, hkv, scale): (usize, usize, usize, f64),
) -> anyhow::Result<bool> {
    let mut ok = true;
    for mode in CHECKED_MODES {
        for w in [2usize, 4] {
            let label = format!("{mode} W={w}");
            let parts = run_ranks(w, |comm| {
                let (attn, idx) = mode_on(&comm, mode, w, hq, hkv, s).map_err(|e| candle_core::Error::Msg(e.to_string()))?;
                let take = |x: &Tensor| layout::take_seq(x, &idx);
                let (ql, kl, vl, gl) = (take(q)?, take(k)?, take(v)?, take(d_o)?);
                let (o, lse) = attn.forward_docs(&ql, &kl, &vl, docs, scale)?;
                let (dq, dk, dv) = attn.backward_docs(&gl, kernel::Saved::new(&ql, &kl, &vl, &o, &lse), docs, scale)?;
                Ok(([o, lse, dq, dk, dv], idx))
            });
            let parts = match parts {
                Ok(p) => p,
                Err(e) => {
                    println!("| {label} | error: {e} | | | | | FAIL |");
                    ok = false;
                    continue;
                }
            };
            let (parts, idx): (Vec<Five>, Vec<Vec<usize>>) = parts.into_iter().unzip();
            let pick = |i: usize| parts.iter().map(|p| p[i].clone()).collect::<Vec<_>>();
            let got = [
                layout::gather_seq(&pick(0), &idx)?,
                layout::gather(&pick(1), 2, &idx)?,
                layout::gather_seq(&pick(2), &idx)?,
                layout::gather_seq(&pick(3), &idx)?,
                layout::gather_seq(&pick(4), &idx)?,
            ];
            ok &= compare(&label, &got, reference)?;
        }
    }
    Ok(ok)
}

#[cfg(test)]
mod tests {
    use super::*;
    use clap::Parser;

    #[derive(clap::Parser)]
    struct Cli {
        #[command(flatten)]
        a: BenchAttentionArgs,
    }

    fn args(flags: &[&str]) -> BenchAttentionArgs {
        Cli::parse_from(std::iter::once("bench").chain(flags.iter().copied())).a
    }

    /// The estimate adds up the buffers by hand for one shape, and the check refuses what
    /// does not fit and names the flags.
    #[test]
    fn throughput_memory_is_checked_before_allocating() {
        let a = args(&["--seq", "65536", "--heads", "32", "--kv-heads", "4", "--head-dim", "64"]);
        let (q, kv, lse) = (65536u64 * 32 * 64 * 2, 65536u64 * 4 * 64 * 2, 32u64 * 65536 * 4);
        let work = 32u64 * 65536 * 66 * 4;
        let want = 2 * q + 2 * kv + 4 * (q + lse) + q + 2 * kv + work;
        assert_eq!(throughput_bytes(&a, 65536, 3, 2), Some(want));
        assert!(check_fits(&a, DType::BF16, 3, 141 << 30).is_ok());
        let e = check_fits(&a, DType::BF16, 3, want - 1).unwrap_err().to_string();
        assert!(e.contains("--seq 65536") && e.contains("GiB") && e.contains("shorter --seq"), "{e}");
        // past u64: an error, not an overflow
        let huge = args(&["--seq", &usize::MAX.to_string(), "--heads", "65536"]);
        let e = check_fits(&huge, DType::BF16, 1, 141 << 30).unwrap_err().to_string();
        assert!(e.contains("more than 2^64 bytes"), "{e}");
    }

    #[test]
    fn throughput_shape_flags_are_checked() {
        assert!(check_shape(&args(&["--heads", "32", "--kv-heads", "8"])).is_ok());
        let e = check_shape(&args(&["--heads", "32", "--kv-heads", "5"])).unwrap_err().to_string();
        assert!(e.contains("multiple of the key/value heads"), "{e}");
        for flags in [&["--batch", "0"][..], &["--head-dim", "0"], &["--kv-heads", "0"], &["--seq", "0"]] {
            let e = check_shape(&args(flags)).unwrap_err().to_string();
            assert!(e.contains(flags[0]) && e.contains("at least 1"), "{flags:?}: {e}");
        }
    }
}
