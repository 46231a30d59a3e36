//! The layer-wise engine against one autograd graph over the whole model.
//!
//! `Engine::step` (graph-free forward keeping layer inputs, chunked head/loss, per-layer
//! recomputation with the explicit layer backward — and with Candle autograd per layer —,
//! chunked MLP and embedding backward) must give the gradients of
//! `scale · Σ token losses` that Candle's autograd gives through one graph of the model
//! API (`Llama::loss` + `backward`, the path checked against transformers), for every
//! parameter; so must `Engine::full_graph_step` (the multi-rank tests' second reference).
//!
//! Shapes: `b` batch, `s` tokens, `V` vocabulary. Tiny f32 models on the CPU.
//! Tolerance (f32): per parameter, `max|got − want| / max|want| ≤ 1e-5`; the loss sum
//! relative error ≤ 1e-6. Both paths do the same math in a different order (chunked
//! matmuls, split residual branches), so only rounding separates them.

use candle_core::{DType, Device, Tensor};
use longctx::model::{LlamaConfig, IGNORE_INDEX};
use longctx::train::engine::{Engine, EngineOptions, LayerBackward, StepResult};
use longctx::train::init::{random_init, to_vars};
use longctx::train::offload::Offload;
use longctx::train::profile::Phase;
use longctx_attention::local::LocalAttention;
use longctx_attention::AttentionMode;
use std::path::Path;
use std::sync::Arc;

use crate::common;
use common::rel_err;

/// Per-parameter relative gradient tolerance (f32).
const GRAD_TOL: f64 = 1e-5;
/// Relative tolerance of the loss sum (f32 sums of ~50 terms).
const LOSS_TOL: f64 = 1e-6;

/// A tiny Llama: hidden 32, head_dim 8, `hq` query and `hkv` kv heads.
fn config(hq: usize, hkv: usize, tied: bool, bias: bool, layers: usize) -> LlamaConfig {
    let json = serde_json::json!({
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "hidden_size": 32,
        "intermediate_size": 48,
        "num_hidden_layers": layers,
        "num_attention_heads": hq,
        "num_key_value_heads": hkv,
        "head_dim": 8,
        "rms_norm_eps": 1e-5,
        "rope_theta": 10000.0,
        "max_position_embeddings": 128,
        "vocab_size": 61,
        "tie_word_embeddings": tied,
        "attention_bias": bias,
        // larger than HF's 0.02 so that every layer contributes visibly to the loss
        "initializer_range": 0.2,
    });
    match LlamaConfig::from_value(Path::new("test/config.json"), json) {
        Ok(c) => c,
        Err(e) => panic!("test config: {e}"),
    }
}

fn engine(cfg: &LlamaConfig, token_chunk: usize, offload: bool) -> longctx::Result<Engine> {
    engine_with(cfg, EngineOptions { token_chunk, offload: Offload::of(offload, false), profile: true, ..Default::default() })
}

fn engine_with(cfg: &LlamaConfig, opts: EngineOptions) -> longctx::Result<Engine> {
    let vars = to_vars(random_init(cfg, 7, DType::F32, &Device::Cpu)?)?;
    Engine::from_vars(cfg, &vars, opts)
}

/// Deterministic ids `[b, s]` u32, targets `[b, s]` i64 (the next id; `masked(row, t)`
/// gives IGNORE_INDEX), positions `[b, s]` u32 = 0..s.
fn batch(b: usize, s: usize, vocab: usize, masked: impl Fn(usize, usize) -> bool) -> longctx::Result<(Tensor, Tensor, Tensor)> {
    let mut state = 0x2545_f491_4f6c_dd1du64;
    let mut ids = Vec::with_capacity(b * (s + 1));
    for _ in 0..b * (s + 1) {
        state ^= state << 13;
        state ^= state >> 7;
        state ^= state << 17;
        ids.push((state % vocab as u64) as u32);
    }
    let mut x = Vec::with_capacity(b * s);
    let mut y = Vec::with_capacity(b * s);
    for r in 0..b {
        for t in 0..s {
            x.push(ids[r * (s + 1) + t]);
            y.push(if masked(r, t) { IGNORE_INDEX } else { ids[r * (s + 1) + t + 1] as i64 });
        }
    }
    let pos: Vec<u32> = (0..b).flat_map(|_| 0..s as u32).collect();
    let dev = Device::Cpu;
    Ok((Tensor::from_vec(x, (b, s), &dev)?, Tensor::from_vec(y, (b, s), &dev)?, Tensor::from_vec(pos, (b, s), &dev)?))
}

/// `Llama::loss` on the tracked model, `backward` of `scale · loss`: loss sum, count and
/// gradients aligned with `Engine::params` (zeros for a parameter without gradient).
fn autograd_reference(
    eng: &Engine,
    ids: &Tensor,
    targets: &Tensor,
    pos: &Tensor,
    attn: &Arc<dyn AttentionMode>,
    scale: f64,
) -> longctx::Result<StepResult> {
    let (l, n) = eng.tracked.loss(ids, targets, pos, attn)?;
    let loss_sum = l.to_dtype(DType::F64)?.to_scalar::<f64>()?;
    let grads = (l * scale)?.backward()?;
    let mut out = Vec::new();
    for (_, var) in &eng.params {
        out.push(match grads.get(var.as_tensor()) {
            Some(g) => g.clone(),
            None => var.as_tensor().zeros_like()?,
        });
    }
    Ok(StepResult { loss_sum, n_tokens: n, grads: out, memory: Default::default() })
}

/// Asserts `got` matches `want` (loss sum, count, every gradient); returns the worst error.
fn assert_close(case: &str, eng: &Engine, got: &StepResult, want: &StepResult) -> longctx::Result<f64> {
    assert_eq!(got.n_tokens, want.n_tokens, "{case}: counted tokens");
    let loss_err = (got.loss_sum - want.loss_sum).abs() / want.loss_sum.abs();
    assert!(loss_err <= LOSS_TOL, "{case}: loss sum {} vs {} (rel {loss_err:.2e})", got.loss_sum, want.loss_sum);
    assert_eq!(got.grads.len(), eng.params.len(), "{case}: one gradient per parameter");
    let mut worst = 0f64;
    for ((name, var), (g, w)) in eng.params.iter().zip(got.grads.iter().zip(&want.grads)) {
        assert_eq!(g.dims(), var.as_tensor().dims(), "{case}: {name} gradient shape");
        assert_eq!(g.dtype(), DType::F32, "{case}: {name} gradient dtype");
        let wmax = w.abs()?.flatten_all()?.max(0)?.to_scalar::<f32>()?;
        assert!(wmax > 0.0, "{case}: reference gradient of {name} is zero; the test would be vacuous");
        let e = rel_err(g, w)?;
        assert!(e <= GRAD_TOL, "{case}: {name}: rel err {e:.2e} > {GRAD_TOL:.0e}");
        worst = worst.max(e);
    }
    Ok(worst)
}

/// Runs the engine and both references and asserts they agree; returns the worst error.
fn check(
    case: &str,
    cfg: &LlamaConfig,
    b: usize,
    s: usize,
    chunk: usize,
    offload: bool,
    masked: impl Fn(usize, usize) -> bool,
) -> longctx::Result<f64> {
    let eng = engine(cfg, chunk, offload)?;
    let (ids, targets, pos) = batch(b, s, cfg.vocab_size, masked)?;
    let attn: Arc<dyn AttentionMode> = Arc::new(LocalAttention);
    let n = targets.ge(0i64)?.to_dtype(DType::F32)?.sum_all()?.to_scalar::<f32>()? as usize;
    let scale = 1.0 / n.max(1) as f64;
    let want = autograd_reference(&eng, &ids, &targets, &pos, &attn, scale)?;
    let got = eng.step(&ids, &targets, &pos, s, &attn, scale)?;
    let worst = assert_close(case, &eng, &got, &want)?;
    // The profile saw every phase of the engine (wall clock on the CPU).
    let prof = eng.take_profile()?;
    for p in
        [Phase::Attention, Phase::Gemm, Phase::NormRopeAct, Phase::Loss, Phase::GradAccum, Phase::Copies, Phase::Transfers, Phase::Adds]
    {
        assert!(prof.get(p) > 0.0, "{case}: no time in phase {}: {prof:?}", p.name());
    }
    let full = eng.full_graph_step(&ids, &targets, &pos, s, &attn, scale)?;
    let worst_full = assert_close(&format!("{case} (full_graph_step)"), &eng, &full, &want)?;
    let base = EngineOptions { token_chunk: chunk, offload: Offload::of(offload, false), ..Default::default() };
    let auto = engine_with(cfg, EngineOptions { layer_backward: LayerBackward::Autograd, ..base.clone() })?;
    let got_auto = auto.step(&ids, &targets, &pos, s, &attn, scale)?;
    let worst_auto = assert_close(&format!("{case} (autograd layer backward)"), &auto, &got_auto, &want)?;
    let keep = engine_with(cfg, EngineOptions { save_attention: true, ..base.clone() })?;
    let got_keep = keep.step(&ids, &targets, &pos, s, &attn, scale)?;
    let worst_keep = assert_close(&format!("{case} (attention saved)"), &keep, &got_keep, &want)?;
    assert!(got_keep.memory.saved_bytes > got.memory.saved_bytes, "{case}: saved attention is counted");
    let host_want = if offload { got_keep.memory.saved_bytes } else { 0 };
    assert_eq!(got_keep.memory.saved_host_bytes, host_want, "{case}: saved attention goes where the layer inputs go");
    // The MLP's input and gate/up projections kept from the forward: the same products the
    // backward would recompute, so the same gradients bit for bit, alone and with the
    // attention kept, for every layer or the top one only; each kept tensor counted where
    // the layer inputs go.
    let (l, i, h) = (cfg.num_hidden_layers, cfg.intermediate_size, cfg.hidden_size);
    let layer_mlp_bytes = b * s * (h + 2 * i) * 4;
    for (opts, what, plain, plain_saved, mlp_bytes) in [
        (EngineOptions { save_mlp: true, ..base.clone() }, "MLP saved", &got, got.memory.saved_bytes, l * layer_mlp_bytes),
        (
            EngineOptions { save_mlp: true, save_attention: true, ..base.clone() },
            "attention and MLP saved",
            &got_keep,
            got_keep.memory.saved_bytes,
            l * layer_mlp_bytes,
        ),
        (
            EngineOptions { save_mlp_layers: Some(1), save_attention: true, ..base.clone() },
            "attention and the top layer's MLP saved",
            &got_keep,
            got_keep.memory.saved_bytes,
            layer_mlp_bytes,
        ),
    ] {
        let eng = engine_with(cfg, opts)?;
        let r = eng.step(&ids, &targets, &pos, s, &attn, scale)?;
        assert_eq!(r.loss_sum, plain.loss_sum, "{case} ({what}): loss");
        for ((name, _), (a, b)) in eng.params.iter().zip(r.grads.iter().zip(&plain.grads)) {
            assert_eq!(a.flatten_all()?.to_vec1::<f32>()?, b.flatten_all()?.to_vec1::<f32>()?, "{case} ({what}): {name}");
        }
        assert_eq!(r.memory.saved_bytes, plain_saved + mlp_bytes, "{case} ({what}): saved bytes");
        assert_eq!(r.memory.saved_host_bytes, if offload { r.memory.saved_bytes } else { 0 }, "{case} ({what}): host bytes");
    }
    // Only the layer inputs in host memory (`offload_layer_inputs`), the attention's and the
    // MLP's tensors kept beside them on the device: the same gradients bit for bit, the
    // inputs alone (one [b, s, h] tensor a layer) counted in host memory.
    if !offload {
        let opts = EngineOptions { offload: Offload::Inputs, save_attention: true, save_mlp: true, ..base.clone() };
        let both =
            engine_with(cfg, EngineOptions { offload: Offload::Off, ..opts.clone() })?.step(&ids, &targets, &pos, s, &attn, scale)?;
        let eng = engine_with(cfg, opts)?;
        let r = eng.step(&ids, &targets, &pos, s, &attn, scale)?;
        assert_eq!(r.loss_sum, both.loss_sum, "{case} (layer inputs offloaded): loss");
        for ((name, _), (a, b)) in eng.params.iter().zip(r.grads.iter().zip(&both.grads)) {
            assert_eq!(a.flatten_all()?.to_vec1::<f32>()?, b.flatten_all()?.to_vec1::<f32>()?, "{case} (layer inputs offloaded): {name}");
        }
        assert_eq!(r.memory.saved_bytes, both.memory.saved_bytes, "{case} (layer inputs offloaded): saved bytes");
        assert_eq!(r.memory.saved_host_bytes, l * b * s * h * 4, "{case} (layer inputs offloaded): host bytes, the inputs only");
    }
    eprintln!(
        "{case}: worst grad rel {worst:.2e} (full_graph_step {worst_full:.2e}, autograd layers {worst_auto:.2e}, attention saved {worst_keep:.2e}; MLP saved: bit-identical)"
    );
    Ok(worst)
}

#[test]
fn three_chunks_on_device() -> longctx::Result<()> {
    check("mha s=12 chunk=4", &config(4, 4, false, false, 2), 2, 12, 4, false, |_, _| false)?;
    Ok(())
}

#[test]
fn uneven_chunk_offloaded() -> longctx::Result<()> {
    // 12 = 5 + 5 + 2
    check("mha s=12 chunk=5 offload", &config(4, 4, false, false, 2), 2, 12, 5, true, |_, _| false)?;
    Ok(())
}

#[test]
fn one_chunk_equals_whole() -> longctx::Result<()> {
    check("mha s=12 chunk=64", &config(4, 4, false, false, 2), 2, 12, 64, false, |_, _| false)?;
    check("mha s=7 chunk=1", &config(4, 4, false, false, 1), 1, 7, 1, true, |_, _| false)?;
    Ok(())
}

#[test]
fn ignored_targets() -> longctx::Result<()> {
    // Chunk 1 (tokens 4..8) is fully ignored in both rows, row 1 also ignores odd tokens,
    // and the last token of row 0: head chunks with and without counted tokens.
    let masked = |r: usize, t: usize| (4..8).contains(&t) || (r == 1 && t % 2 == 1) || (r == 0 && t == 11);
    check("ignored chunk=4", &config(4, 4, false, false, 2), 2, 12, 4, false, masked)?;
    check("ignored chunk=5 offload", &config(4, 4, false, false, 2), 2, 12, 5, true, masked)?;
    Ok(())
}

#[test]
fn gqa_and_tied_embeddings() -> longctx::Result<()> {
    check("gqa 4/2 chunk=5", &config(4, 2, false, false, 2), 2, 13, 5, false, |_, _| false)?;
    check("gqa 4/1 tied chunk=3 offload", &config(4, 1, true, false, 2), 2, 10, 3, true, |r, t| r == 0 && t < 3)?;
    check("mha tied chunk=4", &config(2, 2, true, false, 3), 1, 12, 4, false, |_, _| false)?;
    Ok(())
}

#[test]
fn attention_biases() -> longctx::Result<()> {
    check("gqa bias chunk=5", &config(4, 2, false, true, 2), 2, 12, 5, true, |_, _| false)?;
    Ok(())
}

/// The gradient is linear in `scale`; a zero scale gives zero gradients but the same loss.
#[test]
fn scale_is_linear() -> longctx::Result<()> {
    let cfg = config(4, 2, false, false, 2);
    let eng = engine(&cfg, 5, false)?;
    let (ids, targets, pos) = batch(2, 12, cfg.vocab_size, |_, _| false)?;
    let attn: Arc<dyn AttentionMode> = Arc::new(LocalAttention);
    let one = eng.step(&ids, &targets, &pos, 12, &attn, 1.0)?;
    let quarter = eng.step(&ids, &targets, &pos, 12, &attn, 0.25)?;
    let zero = eng.step(&ids, &targets, &pos, 12, &attn, 0.0)?;
    assert_eq!(one.loss_sum, quarter.loss_sum);
    assert_eq!(one.loss_sum, zero.loss_sum);
    for ((name, _), ((a, q), z)) in eng.params.iter().zip(one.grads.iter().zip(&quarter.grads).zip(&zero.grads)) {
        let e = rel_err(&(q * 4.0)?, a)?;
        assert!(e <= GRAD_TOL, "{name}: 4·g(1/4) vs g(1): {e:.2e}");
        let zmax = z.abs()?.flatten_all()?.max(0)?.to_scalar::<f32>()?;
        assert_eq!(zmax, 0.0, "{name}: gradient with scale 0");
    }
    Ok(())
}

/// Address of a CPU f32 tensor's buffer.
fn data_ptr(t: &Tensor) -> usize {
    match &*t.storage_and_layout().0 {
        candle_core::Storage::Cpu(candle_core::CpuStorage::F32(v)) => v.as_ptr() as usize,
        _ => panic!("expected a CPU f32 tensor"),
    }
}

/// The activation store hands back exactly what was pushed (a group of tensors per
/// layer, in order), in the backward's order (take `l`, prefetch `l − 1`), keeps copies
/// (not aliases) of what it offloads (every tensor, or a group's first, the layer input,
/// alone), counts bytes, and refuses a second take or a missing slot with an error.
#[test]
fn activation_store_protocol() -> longctx::Result<()> {
    use longctx::train::offload::ActivationStore;
    let dev = Device::Cpu;
    let xs: Vec<Tensor> =
        (0..3).map(|i| Tensor::arange(0f32, 24.0, &dev)?.affine(1.0, i as f64)?.reshape((2, 3, 4))).collect::<candle_core::Result<_>>()?;
    let ys: Vec<Tensor> = xs.iter().map(|x| x.narrow(2, 0, 2)?.affine(2.0, 100.0)).collect::<candle_core::Result<_>>()?;
    for offload in [Offload::Off, Offload::Inputs, Offload::All] {
        let mut st = ActivationStore::new(offload);
        for step in 0..2 {
            st.begin()?;
            for (x, y) in xs.iter().zip(&ys) {
                st.push(&[x, y])?;
            }
            st.end_forward()?;
            assert_eq!(st.len(), 3);
            let n = 3 * (24 + 12) * 4;
            let host = match offload {
                Offload::Off => 0,
                Offload::Inputs => 3 * 24 * 4,
                Offload::All => n,
            };
            assert_eq!(st.bytes(), (n, host), "offload {offload:?} step {step}");
            for l in (0..3).rev() {
                let group = st.take(l, &dev)?;
                if l > 0 {
                    st.prefetch(l - 1, &dev)?;
                }
                assert_eq!(group.len(), 2, "group {l}");
                for (i, (t, want)) in group.iter().zip([&xs[l], &ys[l]]).enumerate() {
                    assert_eq!(t.dims(), want.dims());
                    assert_eq!(t.flatten_all()?.to_vec1::<f32>()?, want.flatten_all()?.to_vec1::<f32>()?, "slot {l}");
                    let same_storage = data_ptr(t) == data_ptr(want);
                    let offloaded = offload == Offload::All || (offload == Offload::Inputs && i == 0);
                    assert_eq!(same_storage, !offloaded, "offload {offload:?}: slot {l} tensor {i} must be a copy exactly when offloaded");
                }
                let again = st.take(l, &dev);
                assert!(again.is_err_and(|e| e.to_string().contains("taken twice")), "slot {l} taken twice");
            }
            assert!(st.take(3, &dev).is_err_and(|e| e.to_string().contains("no saved layer group 3")));
        }
    }
    Ok(())
}

/// An engine reused across steps (its store begins afresh each step) gives the same
/// gradients as a fresh one, with and without offload.
#[test]
fn engine_reused_across_steps() -> longctx::Result<()> {
    let cfg = config(4, 2, false, false, 3);
    let (ids, targets, pos) = batch(2, 11, cfg.vocab_size, |_, _| false)?;
    let attn: Arc<dyn AttentionMode> = Arc::new(LocalAttention);
    for offload in [false, true] {
        let eng = engine(&cfg, 4, offload)?;
        let first = eng.step(&ids, &targets, &pos, 11, &attn, 0.1)?;
        let second = eng.step(&ids, &targets, &pos, 11, &attn, 0.1)?;
        assert_eq!(first.loss_sum, second.loss_sum);
        assert_eq!(first.memory, second.memory);
        for ((name, _), (a, b)) in eng.params.iter().zip(first.grads.iter().zip(&second.grads)) {
            assert_eq!(a.flatten_all()?.to_vec1::<f32>()?, b.flatten_all()?.to_vec1::<f32>()?, "offload {offload}: {name}");
        }
    }
    Ok(())
}

/// The planner counts from the engine's own shapes: for several lengths, layouts and
/// settings, the planner's saved bytes (device or host) equal what the engine's store
/// held, and its layer/head transient equals what the engine reports (f32 on the CPU).
#[test]
fn planner_figures_equal_the_engine_report() -> longctx::Result<()> {
    use longctx::parallel::ParallelMode;
    use longctx::plan::{self, ModelShape, PlanRequest};
    let cfg = config(4, 2, false, false, 3);
    let attn: Arc<dyn AttentionMode> = Arc::new(LocalAttention);
    for (seq, gpus, mode) in
        [(64, 1, ParallelMode::DataParallel), (96, 1, ParallelMode::DataParallel), (128, 2, ParallelMode::ZigzagRingAttn)]
    {
        // (offload everything, offload the layer inputs only, save attention, save MLP)
        for (offload, inputs, save, mlp) in [
            (false, false, false, false),
            (true, false, false, false),
            (false, true, false, false),
            (false, false, true, false),
            (true, false, true, false),
            (false, false, false, true),
            (true, false, true, true),
            (false, true, true, true),
        ] {
            let chunk = 40;
            let mut req = PlanRequest::new(seq, gpus, 1 << 40, mode);
            (req.dtype_bytes, req.token_chunk, req.batch_size) = (4, chunk, 2);
            (req.offload_activations, req.offload_layer_inputs, req.save_attention, req.save_mlp) = (offload, inputs, save, mlp);
            let e = plan::estimate(&ModelShape::from_config(&cfg), &req)?;
            let s = e.layout.local_tokens; // this rank's tokens: what the engine is given
            let eng = engine_with(
                &cfg,
                EngineOptions {
                    token_chunk: chunk,
                    offload: Offload::of(offload, inputs),
                    save_attention: save,
                    save_mlp: mlp,
                    ..Default::default()
                },
            )?;
            let (ids, targets, pos) = batch(2, s, cfg.vocab_size, |_, _| false)?;
            let m = eng.step(&ids, &targets, &pos, seq, &attn, 0.01)?.memory;
            let case = format!("S={seq} {mode:?} offload={offload} inputs={inputs} save={save} mlp={mlp}");
            let (d, h) = (&e.device, &e.host);
            assert_eq!(m.saved_bytes as u64, d.saved_activations + d.saved_attention + d.saved_mlp + h.saved_activations, "{case}: saved");
            assert_eq!(d.saved_mlp > 0, mlp && !offload, "{case}: saved MLP on the device");
            assert_eq!(m.saved_host_bytes as u64, h.saved_activations, "{case}: saved in host memory");
            // q, k, v, o and the LSE of one layer, f32: counted in the layer's backward unless saved.
            let (eq, ekv) = (2 * s * cfg.num_attention_heads * cfg.head_dim, 2 * s * cfg.num_key_value_heads * cfg.head_dim);
            let core = ((2 * eq + 2 * ekv) * 4 + 4 * 2 * cfg.num_attention_heads * s) as u64;
            assert_eq!(m.transient_bytes as u64, (d.layer_backward + if save { core } else { 0 }).max(d.head), "{case}: transient");
        }
    }
    Ok(())
}

/// ZeRO-3 hooks that also record each unit asked for and the store's guess of the next.
struct Recording<'a> {
    inner: longctx::train::zero::Zero3Hooks<'a>,
    store: &'a longctx::train::zero::ParamStore,
    seen: std::cell::RefCell<Vec<(usize, Option<usize>)>>,
}

impl longctx::train::zero::ParamHooks for Recording<'_> {
    fn prepare(&self, u: usize) -> longctx::Result<()> {
        self.inner.prepare(u)
    }
    fn weights(&self, u: usize) -> longctx::Result<Option<Vec<Tensor>>> {
        self.seen.borrow_mut().push((u, self.store.next_after(u)));
        self.inner.weights(u)
    }
    fn grad_slots(&self) -> &[Tensor] {
        self.inner.grad_slots()
    }
    fn grads_done(&self, u: usize) -> longctx::Result<()> {
        self.inner.grads_done(u)
    }
}

/// The engine over ZeRO-3 hooks (no resident weights: every unit's weights come from a
/// `ParamStore`, its gradients go to per-unit scratch reduced into a shard) gives the
/// resident engine's loss and gradients, tied and untied heads, two micro-batches
/// accumulated. One rank: the shard is every unit in order, so it equals the flat gradient.
#[test]
fn zero3_hooks_give_the_resident_gradients() -> longctx::Result<()> {
    use longctx::train::zero::Partition;
    use longctx::train::zero::{ParamStore, ShardedGrads, Zero3Hooks};
    use std::collections::HashMap;
    for tied in [false, true] {
        let cfg = config(4, 2, tied, false, 2);
        let weights = random_init(&cfg, 7, DType::F32, &Device::Cpu)?;
        let opts = EngineOptions { token_chunk: 5, ..Default::default() };
        let resident = Engine::from_vars(&cfg, &to_vars(weights.clone())?, opts.clone())?;
        let shapes: HashMap<String, candle_core::Shape> = weights.iter().map(|(n, t)| (n.clone(), t.shape().clone())).collect();
        let sharded = Engine::for_shapes(&cfg, &shapes, DType::F32, &Device::Cpu, opts)?;
        let attn: Arc<dyn AttentionMode> = Arc::new(LocalAttention);
        let batches = [batch(2, 12, 61, |_, t| t == 3)?, batch(1, 12, 61, |_, _| false)?];
        let (mut want_loss, mut want) = (0.0, Vec::new());
        for (ids, tg, pos) in &batches {
            let r = resident.step(ids, tg, pos, 12, &attn, 0.1)?;
            want_loss += r.loss_sum;
            let flat = Tensor::cat(&r.grads.iter().map(|g| g.flatten_all()).collect::<candle_core::Result<Vec<_>>>()?, 0)?;
            want.push(flat);
        }
        let want = (&want[0] + &want[1])?.to_vec1::<f32>()?;
        let names: Vec<&str> = sharded.meta.iter().map(|(n, _)| n.as_str()).collect();
        let sizes: Vec<usize> = sharded.meta.iter().map(|(_, s)| s.elem_count()).collect();
        let meta_shapes: Vec<candle_core::Shape> = sharded.meta.iter().map(|(_, s)| s.clone()).collect();
        let got = longctx_attention::comm::thread::run_ranks(1, |comm| {
            let e = |e: longctx::Error| candle_core::Error::Msg(e.to_string());
            let part = Partition::per_layer(&names, &sizes, (0, 1)).map_err(e)?;
            let store =
                ParamStore::new(part.clone(), &sharded.meta, &weights, DType::F32, (&Device::Cpu, true, 0), comm.clone()).map_err(e)?;
            let grads = ShardedGrads::new(part, &meta_shapes, &Device::Cpu, comm.clone(), None).map_err(e)?;
            let hooks = Recording {
                inner: Zero3Hooks { store: Some(&store), grads: &grads, update: None },
                store: &store,
                seen: Default::default(),
            };
            let mut loss = 0.0;
            for (ids, tg, pos) in &batches {
                loss += sharded.step_into(ids, tg, pos, 12, &attn, 0.1, &hooks).map_err(e)?.loss_sum;
                // The store's guess of the next unit (what it copies ahead) is the unit the
                // engine asks for next: up through the forward and the head, down through
                // the backward (which never needs the embedding). A tied head also asks for
                // the embedding at the loss: one miss there, and one after it.
                let seen = hooks.seen.take();
                let asked: Vec<usize> = seen.iter().map(|s| s.0).collect();
                let misses = seen.windows(2).filter(|w| w[0].1 != Some(w[1].0)).count();
                assert_eq!(misses, if tied { 2 } else { 0 }, "tied {tied}: guesses {seen:?}");
                assert_eq!(seen.last().map(|s| s.1), Some(None), "nothing guessed after the last layer's backward: {seen:?}");
                let n = cfg.num_hidden_layers;
                assert_eq!(asked.len(), 2 * n + 2 + usize::from(tied), "tied {tied}: {asked:?}");
            }
            Ok((loss, grads.shard().to_vec1::<f32>()?))
        })
        .map_err(|e| longctx::Error::Setting(e.to_string()))?;
        let (loss, shard) = &got[0];
        assert!(((loss - want_loss) / want_loss).abs() <= LOSS_TOL, "tied {tied}: loss {loss} vs {want_loss}");
        assert_eq!(shard.len(), want.len(), "tied {tied}: one rank's shard is the whole flat gradient");
        let scale = want.iter().fold(0f32, |m, x| m.max(x.abs()));
        let diff = shard.iter().zip(&want).fold(0f32, |m, (a, b)| m.max((a - b).abs()));
        assert!(diff <= GRAD_TOL as f32 * scale, "tied {tied}: gradients differ by {diff} (scale {scale})");
    }
    Ok(())
}
