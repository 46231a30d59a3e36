//! Masked-token loss averaging across ranks: the step's loss is Σ token losses / Σ counted
//! tokens over every rank (never a mean of per-rank means), and its gradient is the
//! single-device gradient of that mean.
//!
//! 1. Sequence parallel (W = 4, ulysses and zigzag ring) with very uneven counts: one rank
//!    has no counted token at all, one only a few.
//! 2. Data parallel (W = 2), a different sample per rank with different masks, against
//!    the single-device run on the concatenated batch.
//! 3. The trainer: data parallel 2 × batch 1, batch 2 on one rank and gradient
//!    accumulation 2 × batch 1 see the same samples and must log the same losses and
//!    gradient norms; so must every sequence-parallel mode at W = 4 (zigzag ring,
//!    Ulysses, FPDT with and without offload, USP 2×2).
//! 4. One trainer step (dp 2, ZeRO-1 shards) equals the step written out by hand: engine
//!    gradients of Σloss/Σcount on both samples, global-norm clipping, AdamW with weight
//!    decay on matrices only. Exported weights within `1e-6 + lr·δ/(|g| + ε)` absolute
//!    (updates are ~1e-2): δ = 1e-5·max|g| of the tensor is the gradient rounding the
//!    dp-2 sum may differ by, and AdamW's first step `g/(|g| + ε)` amplifies it for the
//!    few elements whose gradient is near ε.
//!
//! Tolerances (f32): mean loss relative error ≤ 1e-5, per parameter gradient
//! `max|got − want| / max|want| ≤ 2e-5`; trainer logs ≤ 1e-4 relative (three AdamW steps
//! of rounding-level differences).

use candle_core::{DType, Device, Tensor};
use longctx::data::layout::apply_layout_tensors;
use longctx::model::LlamaConfig;
use longctx::parallel::dims::ParallelMode;
use longctx::train::config::{RunConfig, Stage};
use longctx::train::engine::{Engine, EngineOptions};
use longctx::train::init::{random_init, to_vars};
use longctx::train::offload::Offload;
use longctx_attention::comm::thread::run_ranks;
use longctx_attention::comm::Comm;
use longctx_attention::layout;
use longctx_attention::local::LocalAttention;
use longctx_attention::ring::ZigzagRing;
use longctx_attention::ulysses::Ulysses;
use longctx_attention::AttentionMode;
use std::collections::HashMap;
use std::path::Path;
use std::sync::Arc;

use crate::common;

const LOSS_TOL: f64 = 1e-5;
const GRAD_TOL: f64 = 2e-5;
const TRAINER_TOL: f64 = 1e-4;

fn config() -> LlamaConfig {
    common::small_config(false)
}

fn batch(b: usize, s: usize, vocab: usize, seed: u64, masked: impl Fn(usize, usize) -> bool) -> longctx::Result<(Tensor, Tensor)> {
    common::token_batch(b, s, vocab, seed, masked)
}

fn positions(b: usize, s: usize) -> longctx::Result<Tensor> {
    Ok(Tensor::arange(0u32, s as u32, &Device::Cpu)?.unsqueeze(0)?.repeat((b, 1))?)
}

fn count(targets: &Tensor) -> longctx::Result<usize> {
    Ok(targets.flatten_all()?.to_vec1::<i64>()?.iter().filter(|&&t| t >= 0).count())
}

use common::rel_err;

/// Mean loss and gradients of the single-device run.
fn single(cfg: &LlamaConfig, w: &HashMap<String, Tensor>, ids: &Tensor, targets: &Tensor) -> longctx::Result<(f64, Vec<Tensor>)> {
    let (b, s) = ids.dims2()?;
    let eng = Engine::from_vars(cfg, &to_vars(w.clone())?, EngineOptions { token_chunk: 8, offload: Offload::Off, ..Default::default() })?;
    let n = count(targets)?;
    let attn: Arc<dyn AttentionMode> = Arc::new(LocalAttention);
    let r = eng.step(ids, targets, &positions(b, s)?, s, &attn, 1.0 / n as f64)?;
    assert_eq!(r.n_tokens, n);
    Ok((r.loss_sum / n as f64, r.grads))
}

/// What one rank of a distributed run reports: its loss sum and count, and the mean loss
/// and the gradients summed over ranks.
struct RankOut {
    local_loss: f64,
    local_count: usize,
    mean: f64,
    grads: Vec<Tensor>,
}

/// Every rank: count locally, all-reduce the count, step with `1/global`, all-reduce.
fn rank_step(
    comm: &Arc<dyn Comm>,
    eng: &Engine,
    ids: &Tensor,
    targets: &Tensor,
    pos: &Tensor,
    global_len: usize,
    attn: &Arc<dyn AttentionMode>,
) -> longctx::Result<RankOut> {
    let local = count(targets)?;
    let global = comm.all_reduce_sum(&Tensor::new(&[local as f64], &Device::Cpu)?)?.to_vec1::<f64>()?[0];
    let r = eng.step(ids, targets, pos, global_len, attn, 1.0 / global)?;
    assert_eq!(r.n_tokens, local);
    let loss = comm.all_reduce_sum(&Tensor::new(&[r.loss_sum], &Device::Cpu)?)?.to_vec1::<f64>()?[0];
    let grads = r.grads.iter().map(|g| comm.all_reduce_sum(g)).collect::<candle_core::Result<Vec<_>>>()?;
    Ok(RankOut { local_loss: r.loss_sum, local_count: local, mean: loss / global, grads })
}

fn compare(what: &str, got_mean: f64, got: &[Tensor], want_mean: f64, want: &[Tensor]) -> longctx::Result<()> {
    let le = (got_mean - want_mean).abs() / want_mean.abs();
    assert!(le <= LOSS_TOL, "{what}: mean loss {got_mean} vs {want_mean} ({le:.2e})");
    assert_eq!(got.len(), want.len());
    let mut worst = 0f64;
    for (i, (g, w)) in got.iter().zip(want).enumerate() {
        let e = rel_err(g, w)?;
        assert!(e <= GRAD_TOL, "{what}: parameter {i}: rel err {e:.2e}");
        worst = worst.max(e);
    }
    eprintln!("{what}: mean loss rel {le:.1e}, worst grad rel {worst:.2e}");
    Ok(())
}

/// Sequence parallel with uneven counts; `indices(r)` is rank r's layout, `mode(comm)` the mode.
fn sp_uneven(
    what: &str,
    indices: impl Fn(usize) -> candle_core::Result<Vec<usize>> + Sync,
    make: impl Fn(Arc<dyn Comm>) -> Arc<dyn AttentionMode> + Sync,
    masked: impl Fn(usize, usize) -> bool,
) -> longctx::Result<()> {
    const W: usize = 4;
    const S: usize = 32;
    let cfg = config();
    let w = random_init(&cfg, 5, DType::F32, &Device::Cpu)?;
    let (ids, targets) = batch(2, S, cfg.vocab_size, 77, masked)?;
    let (want_mean, want) = single(&cfg, &w, &ids, &targets)?;
    let err = |e: longctx::Error| candle_core::Error::Msg(e.to_string());
    let outs = run_ranks(W, |comm| {
        let idx = indices(comm.rank())?;
        let (lids, lt, lpos) = apply_layout_tensors(&ids, &targets, &idx).map_err(err)?;
        let eng = Engine::from_vars(
            &cfg,
            &to_vars(w.clone()).map_err(err)?,
            EngineOptions { token_chunk: 3, offload: Offload::Off, ..Default::default() },
        )
        .map_err(err)?;
        rank_step(&comm, &eng, &lids, &lt, &lpos, S, &make(comm.clone())).map_err(err)
    })?;
    let counts: Vec<usize> = outs.iter().map(|o| o.local_count).collect();
    eprintln!("{what}: counted tokens per rank {counts:?}");
    assert_eq!(counts[0], 0, "{what}: the test wants rank 0 fully masked");
    assert!(counts[1] * 4 < counts[2], "{what}: the test wants rank 1 to count far fewer tokens than rank 2");
    // The naive mean of the per-rank means (ranks with tokens) is measurably different,
    // so agreement below is not an accident of equal counts.
    let means: Vec<f64> = outs.iter().filter(|o| o.local_count > 0).map(|o| o.local_loss / o.local_count as f64).collect();
    let naive = means.iter().sum::<f64>() / means.len() as f64;
    assert!((naive - want_mean).abs() / want_mean > 1e-3, "{what}: mean of means {naive} ≈ {want_mean}; pick other masks");
    for o in &outs {
        compare(what, o.mean, &o.grads, want_mean, &want)?;
    }
    Ok(())
}

#[test]
fn ulysses_uneven_counts() -> longctx::Result<()> {
    // contiguous layout over 4 ranks of 8 tokens: rank 0 = tokens 0..8 (all ignored),
    // rank 1 = 8..16 (only token 15 of row 1 counted), ranks 2, 3 fully counted
    sp_uneven(
        "ulysses",
        |r| layout::contiguous_indices(32, 4, r),
        |c| Arc::new(Ulysses::new(c)),
        |row, t| t < 8 || ((8..16).contains(&t) && !(row == 1 && t == 15)),
    )
}

#[test]
fn zigzag_uneven_counts() -> longctx::Result<()> {
    // zigzag over 4 ranks, chunks of 4: rank 0 = chunks 0 and 7 (all ignored),
    // rank 1 = chunks 1 and 6 (only tokens 4 and 27 of row 0 counted)
    sp_uneven(
        "zigzag ring",
        |r| layout::zigzag_indices(32, 4, r),
        |c| Arc::new(ZigzagRing::new(c)),
        |row, t| !(4..28).contains(&t) || (((4..8).contains(&t) || (24..28).contains(&t)) && !(row == 0 && (t == 4 || t == 27))),
    )
}

/// Data parallel: rank r holds sample r only; grads summed over ranks equal the
/// single-device gradient on the batch of both samples.
#[test]
fn data_parallel_matches_concatenated_batch() -> longctx::Result<()> {
    const S: usize = 20;
    let cfg = config();
    let w = random_init(&cfg, 9, DType::F32, &Device::Cpu)?;
    // row 0 counts 5 tokens, row 1 counts 20
    let (ids, targets) = batch(2, S, cfg.vocab_size, 1234, |row, t| row == 0 && t % 4 != 0)?;
    let (want_mean, want) = single(&cfg, &w, &ids, &targets)?;
    let err = |e: longctx::Error| candle_core::Error::Msg(e.to_string());
    let outs = run_ranks(2, |comm| {
        let r = comm.rank();
        let (lids, lt) = (ids.narrow(0, r, 1)?, targets.narrow(0, r, 1)?);
        let eng = Engine::from_vars(
            &cfg,
            &to_vars(w.clone()).map_err(err)?,
            EngineOptions { token_chunk: 7, offload: Offload::of(r == 1, false), ..Default::default() },
        )
        .map_err(err)?;
        let attn: Arc<dyn AttentionMode> = Arc::new(LocalAttention);
        rank_step(&comm, &eng, &lids, &lt, &positions(1, S).map_err(err)?, S, &attn).map_err(err)
    })?;
    assert_eq!(outs.iter().map(|o| o.local_count).collect::<Vec<_>>(), vec![5, 20]);
    let naive = outs.iter().map(|o| o.local_loss / o.local_count as f64).sum::<f64>() / 2.0;
    assert!((naive - want_mean).abs() / want_mean > 1e-3, "mean of means {naive} ≈ {want_mean}");
    for o in &outs {
        compare("data parallel W=2", o.mean, &o.grads, want_mean, &want)?;
    }
    Ok(())
}

/// Per-step `(loss, grad_norm)` from `metrics.jsonl`.
fn logged(dir: &Path) -> Vec<(f64, f64)> {
    let text = match std::fs::read_to_string(dir.join("metrics.jsonl")) {
        Ok(t) => t,
        Err(e) => panic!("metrics.jsonl in {}: {e}", dir.display()),
    };
    text.lines()
        .filter_map(|l| serde_json::from_str::<serde_json::Value>(l).ok())
        .filter(|v| v.get("loss").is_some())
        .map(|v| (v["loss"].as_f64().unwrap_or(f64::NAN), v["grad_norm"].as_f64().unwrap_or(f64::NAN)))
        .collect()
}

fn trainer_run(dir: &Path, world: usize, batch: usize, accum: usize, mode: ParallelMode) -> longctx::Result<Vec<(f64, f64)>> {
    trainer_run_with(dir, world, batch, accum, mode, |_| {})
}

fn trainer_run_with(
    dir: &Path,
    world: usize,
    batch: usize,
    accum: usize,
    mode: ParallelMode,
    tweak: impl Fn(&mut RunConfig),
) -> longctx::Result<Vec<(f64, f64)>> {
    let mut c = RunConfig { output_dir: dir.to_path_buf(), ..Default::default() };
    c.train.batch_size = batch;
    c.train.gradient_accumulate_every = accum;
    c.train.learning_rate = 3e-3;
    c.train.warmup_steps = 0;
    c.parallel.world_size = world;
    c.parallel.mode = mode;
    c.parallel.token_chunk = 24;
    c.stages = vec![Stage::new(64, 10_000.0, 3)];
    tweak(&mut c);
    c.validate(Path::new("<test>"))?;
    longctx::train::trainer::run(&c, false)?;
    Ok(logged(dir))
}

/// The trainer sees samples 0 and 1 of the passkey stream in every variant.
#[test]
fn trainer_dp_batch_and_accumulation_agree() -> longctx::Result<()> {
    let tmp = tempfile::tempdir().map_err(|e| longctx::Error::io("<tempdir>", e))?;
    let want = trainer_run(&tmp.path().join("b2"), 1, 2, 1, ParallelMode::DataParallel)?;
    assert_eq!(want.len(), 3);
    for (name, world, batch, accum, mode) in [
        ("dp 2 × batch 1", 2, 1, 1, ParallelMode::DataParallel),
        ("batch 1 × accumulate 2", 1, 1, 2, ParallelMode::DataParallel),
        ("zigzag sp 2 × batch 2", 2, 2, 1, ParallelMode::ZigzagRingAttn),
    ] {
        let got = trainer_run(&tmp.path().join(name.replace(' ', "_")), world, batch, accum, mode)?;
        assert_logs_agree(name, &got, &want);
    }
    Ok(())
}

fn assert_logs_agree(name: &str, got: &[(f64, f64)], want: &[(f64, f64)]) {
    assert_eq!(got.len(), want.len(), "{name}: logged steps");
    for (i, ((gl, gn), (wl, wn))) in got.iter().zip(want).enumerate() {
        let (el, en) = ((gl - wl).abs() / wl.abs(), (gn - wn).abs() / wn.abs());
        assert!(
            el <= TRAINER_TOL && en <= TRAINER_TOL,
            "{name}: step {i}: loss {gl} vs {wl} ({el:.1e}), grad norm {gn} vs {wn} ({en:.1e})"
        );
    }
}

/// The trainer's sequence-parallel modes at W = 4 (dp 1) log what one rank logs.
#[test]
fn trainer_sequence_parallel_modes_agree() -> longctx::Result<()> {
    let tmp = tempfile::tempdir().map_err(|e| longctx::Error::io("<tempdir>", e))?;
    let want = trainer_run(&tmp.path().join("one"), 1, 2, 1, ParallelMode::DataParallel)?;
    assert_eq!(want.len(), 3);
    let fpdt = |offload: bool| {
        move |c: &mut RunConfig| {
            c.parallel.fpdt_chunk_size = 16;
            c.parallel.fpdt_offload = offload;
            c.parallel.offload_activations = offload;
        }
    };
    type Tweak = Box<dyn Fn(&mut RunConfig)>;
    let cases: Vec<(&str, ParallelMode, Tweak)> = vec![
        ("zigzag ring 4", ParallelMode::ZigzagRingAttn, Box::new(|_: &mut RunConfig| {})),
        ("ulysses 4", ParallelMode::UlyssesAttn, Box::new(|_: &mut RunConfig| {})),
        ("fpdt 4", ParallelMode::Fpdt, Box::new(fpdt(false))),
        ("fpdt 4 offload", ParallelMode::Fpdt, Box::new(fpdt(true))),
        ("usp 2x2", ParallelMode::Usp, Box::new(|c: &mut RunConfig| c.parallel.ulysses_size = 2)),
    ];
    for (name, mode, tweak) in cases {
        let got = trainer_run_with(&tmp.path().join(name.replace(' ', "_")), 4, 2, 1, mode, tweak)?;
        assert_logs_agree(name, &got, &want);
    }
    Ok(())
}

/// One trainer step against the same step computed by hand from `Engine::step` and the
/// AdamW formula in f64.
#[test]
fn trainer_step_is_clip_then_adamw_of_the_mean_gradient() -> longctx::Result<()> {
    use longctx::data::{Batch, LossOn, Passkey, PasskeyConfig};
    let tmp = tempfile::tempdir().map_err(|e| longctx::Error::io("<tempdir>", e))?;
    let dir = tmp.path().join("one_step");
    let (lr, clip, seq) = (1e-2, 0.5, 64);
    let mut c = RunConfig { seed: 17, output_dir: dir.clone(), ..Default::default() };
    c.data.dataset = "synthetic:passkey".into(); // loss on every token, as built by hand below
    c.train.batch_size = 1;
    c.train.learning_rate = lr;
    c.train.warmup_steps = 0;
    c.train.clip_grad = clip;
    c.parallel.world_size = 2;
    c.parallel.token_chunk = 24;
    c.stages = vec![Stage::new(seq, 10_000.0, 1)];
    c.validate(Path::new("<test>"))?;
    longctx::train::trainer::run(&c, false)?;
    let logged = logged(&dir);
    let trained = candle_core::safetensors::load(dir.join("export/model.safetensors"), &Device::Cpu)?;

    // By hand: the same initial weights and the two samples the two ranks drew.
    let mcfg = longctx::train::init::builtin_config("tiny")?;
    let w0 = random_init(&mcfg, c.seed, DType::F32, &Device::Cpu)?;
    let mut pk = PasskeyConfig::new(seq);
    pk.vocab = mcfg.vocab_size;
    pk.seed = c.seed;
    pk.loss_on = LossOn::All;
    let gen = Passkey::new(pk)?;
    let batch = Batch::from_samples(&[gen.sample(0).sample, gen.sample(1).sample], seq);
    let (ids, targets) = batch.to_tensors(&Device::Cpu)?;
    let n = count(&targets)?;
    let eng =
        Engine::from_vars(&mcfg, &to_vars(w0.clone())?, EngineOptions { token_chunk: 24, offload: Offload::Off, ..Default::default() })?;
    let attn: Arc<dyn AttentionMode> = Arc::new(LocalAttention);
    let r = eng.step(&ids, &targets, &positions(2, seq)?, seq, &attn, 1.0 / n as f64)?;
    let loss = r.loss_sum / n as f64;
    let mut sq = 0f64;
    let grads: Vec<Vec<f32>> = r.grads.iter().map(|g| g.flatten_all()?.to_vec1::<f32>()).collect::<candle_core::Result<_>>()?;
    for g in &grads {
        sq += g.iter().map(|&x| (x as f64) * (x as f64)).sum::<f64>();
    }
    let norm = sq.sqrt();
    assert_eq!(logged.len(), 1);
    let (ll, ln) = logged[0];
    assert!((ll - loss).abs() / loss <= 1e-5, "logged loss {ll} vs Σloss/Σcount {loss}");
    assert!((ln - norm).abs() / norm <= 1e-5, "logged grad norm {ln} vs {norm}");
    assert!(norm > clip, "the test wants clipping active (norm {norm})");
    let coef = clip / (norm + 1e-6);
    let a = longctx::train::optim::AdamWConfig::default();
    let (bc1, bc2) = (1.0 - a.beta1, 1.0 - a.beta2);
    let mut worst = 0f64;
    let mut moved = 0usize;
    for ((name, _), g) in eng.params.iter().zip(&grads) {
        let before = w0[name].flatten_all()?.to_vec1::<f32>()?;
        let after = trained.get(name).unwrap_or_else(|| panic!("{name} missing from the export")).flatten_all()?.to_vec1::<f32>()?;
        let decay = w0[name].rank() >= 2;
        let delta = 1e-5 * g.iter().fold(0f64, |m, &x| m.max((x as f64 * coef).abs()));
        for ((&w, &gi), &got) in before.iter().zip(g).zip(&after) {
            let gi = gi as f64 * coef;
            let tol = 1e-6 + lr * delta / (gi.abs() + a.eps);
            let (m, v) = ((1.0 - a.beta1) * gi, (1.0 - a.beta2) * gi * gi);
            let mut want = w as f64;
            if decay {
                want -= lr * a.weight_decay * want;
            }
            want -= lr * (m / bc1) / ((v / bc2).sqrt() + a.eps);
            let e = (got as f64 - want).abs();
            assert!(e <= tol, "{name}: {got} vs by hand {want} (w0 {w}, g {gi:e}, tolerance {tol:.1e})");
            worst = worst.max(e);
            moved += usize::from((got - w).abs() > 1e-3);
        }
    }
    // most weights move by about lr: the comparison is not of two unchanged copies
    let total: usize = eng.params.iter().map(|(_, v)| v.as_tensor().elem_count()).sum();
    assert!(moved * 20 > total, "only {moved} of {total} weights moved");
    eprintln!("one trainer step vs by hand: worst weight diff {worst:.1e}, {moved} weights moved by > 1e-3");
    Ok(())
}
