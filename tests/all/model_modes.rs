//! Whole model under each sequence-parallel mode at W = 4 against the single-device run.
//!
//! A tiny GQA Llama (hq 4, hkv 2, 2 layers). The global batch `ids/targets [b, S]` is
//! split with the trainer's layout (`ParallelMode::local_indices`, checked against the
//! attention crate's index functions): ids, targets and position ids permuted
//! identically. Every rank runs `Engine::step` (and, separately, the full-graph path
//! `Engine::full_graph_step`) with `scale = 1 / global counted tokens`, the gradients
//! and loss sums are summed over ranks, and must equal the single-device
//! `Engine::step` on the whole sequence with `LocalAttention`.
//!
//! Tolerances (f32): loss sum relative error ≤ 1e-5; per parameter
//! `max|got − want| / max|want| ≤ 2e-5` (measured ≤ 2.5e-6: only summation order differs).

use candle_core::{DType, Device, Tensor};
use longctx::data::layout::apply_layout_tensors;
use longctx::model::LlamaConfig;
use longctx::parallel::dims::{build_groups, DimsRequest, ParallelDims, ParallelMode};
use longctx::train::engine::{Engine, EngineOptions};
use longctx::train::init::{random_init, to_vars};
use longctx::train::offload::Offload;
use longctx_attention::comm::thread::run_ranks;
use longctx_attention::layout;
use longctx_attention::local::LocalAttention;
use longctx_attention::AttentionMode;
use std::collections::HashMap;
use std::sync::Arc;

use crate::common;

const LOSS_TOL: f64 = 1e-5;
const GRAD_TOL: f64 = 2e-5;
const W: usize = 4;
const S: usize = 32;
const B: usize = 2;
/// FPDT chunk in global tokens (4 chunks of 8, 2 local tokens per rank per chunk).
const FPDT_CHUNK: usize = 8;
/// Token chunk of the engine: local sequences of 8 run as 3 + 3 + 2.
const TOKEN_CHUNK: usize = 3;

/// The test model; `dynamic_rope`: dynamic NTK RoPE with max_position_embeddings 16 < S,
/// so the rotary base depends on the global length (a shard must not use its own).
fn config(dynamic_rope: bool, window: Option<usize>) -> LlamaConfig {
    let cfg = common::small_config(dynamic_rope);
    let Some(w) = window else { return cfg };
    // The same shape as a Mistral with a sliding window on every layer.
    let mut json = cfg.to_json_value();
    json["model_type"] = "mistral".into();
    json["architectures"] = serde_json::json!(["MistralForCausalLM"]);
    json["sliding_window"] = w.into();
    LlamaConfig::from_value("test/config.json", json).unwrap()
}

/// `ids [B, S]` u32 and shifted `targets [B, S]` i64 with a few ignored tokens.
fn global_batch(vocab: usize) -> longctx::Result<(Tensor, Tensor)> {
    common::token_batch(B, S, vocab, 0x9e37_79b9_7f4a_7c15, |r, t| (r == 0 && (5..9).contains(&t)) || (r == 1 && t % 7 == 3))
}

use common::rel_err;

/// Loss sum, counted tokens and gradients (summed over ranks when distributed).
struct Outcome {
    loss_sum: f64,
    n_tokens: usize,
    grads: Vec<Tensor>,
}

fn single_device(
    cfg: &LlamaConfig,
    weights: &HashMap<String, Tensor>,
    ids: &Tensor,
    targets: &Tensor,
    n: usize,
) -> longctx::Result<Outcome> {
    let eng =
        Engine::from_vars(cfg, &to_vars(weights.clone())?, EngineOptions { token_chunk: 5, offload: Offload::Off, ..Default::default() })?;
    let pos = Tensor::arange(0u32, S as u32, &Device::Cpu)?.unsqueeze(0)?.repeat((B, 1))?;
    let attn: Arc<dyn AttentionMode> = Arc::new(LocalAttention);
    let r = eng.step(ids, targets, &pos, S, &attn, 1.0 / n as f64)?;
    Ok(Outcome { loss_sum: r.loss_sum, n_tokens: r.n_tokens, grads: r.grads })
}

#[derive(Clone, Copy, Debug)]
struct Case {
    name: &'static str,
    mode: ParallelMode,
    ulysses: Option<usize>,
    fpdt_offload: bool,
    /// Engine::full_graph_step per rank instead of Engine::step.
    full_graph: bool,
    dynamic_rope: bool,
    /// A Mistral with this sliding window on every layer (issue #31).
    window: Option<usize>,
}

/// The attention crate's own index list for a case (independent of the trainer's).
fn expected_indices(case: &Case, rank: usize) -> candle_core::Result<Vec<usize>> {
    match case.mode {
        ParallelMode::ZigzagRingAttn => layout::zigzag_indices(S, W, rank),
        ParallelMode::UlyssesAttn => layout::contiguous_indices(S, W, rank),
        ParallelMode::Fpdt => layout::fpdt_indices(S, W, FPDT_CHUNK, rank),
        ParallelMode::Usp => layout::usp_indices(S, 2, 2, rank),
        ParallelMode::DataParallel => Ok((0..S).collect()),
    }
}

fn distributed(
    case: Case,
    cfg: &LlamaConfig,
    weights: &HashMap<String, Tensor>,
    ids: &Tensor,
    targets: &Tensor,
) -> longctx::Result<Outcome> {
    let err = |e: longctx::Error| candle_core::Error::Msg(e.to_string());
    let outs = run_ranks(W, |comm| {
        let dims = ParallelDims::new(&DimsRequest {
            mode: case.mode,
            world: W,
            sp: Some(W),
            ulysses: case.ulysses,
            hq: cfg.num_attention_heads,
            hkv: cfg.num_key_value_heads,
        })
        .map_err(err)?;
        let groups = build_groups(&comm, &dims).map_err(err)?;
        let attn = case.mode.build(&groups, FPDT_CHUNK, case.fpdt_offload);
        let sp_rank = groups.sp.rank();
        let idx = case.mode.local_indices(&dims, sp_rank, S, FPDT_CHUNK).map_err(err)?;
        assert_eq!(idx, expected_indices(&case, sp_rank)?, "{}: rank {sp_rank} layout", case.name);
        let (lids, ltargets, lpos) = apply_layout_tensors(ids, targets, &idx).map_err(err)?;
        // every rank builds its own Vars from the same initial weights, like the trainer
        let vars = to_vars(weights.clone()).map_err(err)?;
        let eng = Engine::from_vars(
            cfg,
            &vars,
            EngineOptions { token_chunk: TOKEN_CHUNK, offload: Offload::of(sp_rank % 2 == 1, false), ..Default::default() },
        )
        .map_err(err)?;
        let local = ltargets.ge(0i64)?.to_dtype(DType::F32)?.sum_all()?.to_scalar::<f32>()? as f64;
        let global = comm.all_reduce_sum(&Tensor::new(&[local], &Device::Cpu)?)?.to_vec1::<f64>()?[0];
        let scale = 1.0 / global;
        let r = if case.full_graph {
            eng.full_graph_step(&lids, &ltargets, &lpos, S, &attn, scale).map_err(err)?
        } else {
            eng.step(&lids, &ltargets, &lpos, S, &attn, scale).map_err(err)?
        };
        assert_eq!(r.n_tokens as f64, local, "{}: rank {sp_rank} counted tokens", case.name);
        let loss = comm.all_reduce_sum(&Tensor::new(&[r.loss_sum], &Device::Cpu)?)?.to_vec1::<f64>()?[0];
        let grads = r.grads.iter().map(|g| comm.all_reduce_sum(g)).collect::<candle_core::Result<Vec<_>>>()?;
        Ok(Outcome { loss_sum: loss, n_tokens: global as usize, grads })
    })?;
    outs.into_iter().next().ok_or_else(|| longctx::Error::Setting("no rank result".into()))
}

fn check(case: Case) -> longctx::Result<()> {
    let cfg = config(case.dynamic_rope, case.window);
    assert_eq!(cfg.layer_windows()?, vec![case.window; 2]);
    assert_eq!(cfg.rope_scaling.is_some(), case.dynamic_rope);
    let weights = random_init(&cfg, 11, DType::F32, &Device::Cpu)?;
    let (ids, targets) = global_batch(cfg.vocab_size)?;
    let n = targets.ge(0i64)?.to_dtype(DType::F32)?.sum_all()?.to_scalar::<f32>()? as usize;
    let want = single_device(&cfg, &weights, &ids, &targets, n)?;
    assert_eq!(want.n_tokens, n);
    let got = distributed(case, &cfg, &weights, &ids, &targets)?;
    assert_eq!(got.n_tokens, n, "{}: global count", case.name);
    let le = (got.loss_sum - want.loss_sum).abs() / want.loss_sum.abs();
    assert!(le <= LOSS_TOL, "{}: loss sum {} vs {} ({le:.2e})", case.name, got.loss_sum, want.loss_sum);
    let names = longctx::train::init::parameter_shapes(&cfg);
    assert_eq!(got.grads.len(), names.len());
    let mut worst = 0f64;
    // Engine::params follows the model's order, as parameter_shapes does.
    for ((name, _), (g, w)) in names.iter().zip(got.grads.iter().zip(&want.grads)) {
        let wmax = w.abs()?.flatten_all()?.max(0)?.to_scalar::<f32>()?;
        assert!(wmax > 0.0, "{}: reference gradient of {name} is zero", case.name);
        let e = rel_err(g, w)?;
        assert!(e <= GRAD_TOL, "{}: {name}: rel err {e:.2e} > {GRAD_TOL:.0e}", case.name);
        worst = worst.max(e);
    }
    eprintln!("{}: loss rel {le:.1e}, worst grad rel {worst:.2e}", case.name);
    Ok(())
}

fn case(name: &'static str, mode: ParallelMode, ulysses: Option<usize>, fpdt_offload: bool) -> Case {
    Case { name, mode, ulysses, fpdt_offload, full_graph: false, dynamic_rope: false, window: None }
}

#[test]
fn zigzag_ring_w4() -> longctx::Result<()> {
    check(case("zigzag ring", ParallelMode::ZigzagRingAttn, None, false))
}

#[test]
fn ulysses_w4() -> longctx::Result<()> {
    check(case("ulysses", ParallelMode::UlyssesAttn, None, false))
}

#[test]
fn fpdt_w4_on_device() -> longctx::Result<()> {
    check(case("fpdt", ParallelMode::Fpdt, None, false))
}

#[test]
fn fpdt_w4_offloaded() -> longctx::Result<()> {
    check(case("fpdt offload", ParallelMode::Fpdt, None, true))
}

#[test]
fn usp_2x2() -> longctx::Result<()> {
    check(case("usp 2x2", ParallelMode::Usp, Some(2), false))
}

#[test]
fn full_graph_per_rank() -> longctx::Result<()> {
    for mut c in [
        case("zigzag ring (full graph)", ParallelMode::ZigzagRingAttn, None, false),
        case("ulysses (full graph)", ParallelMode::UlyssesAttn, None, false),
        case("fpdt offload (full graph)", ParallelMode::Fpdt, None, true),
        case("usp 2x2 (full graph)", ParallelMode::Usp, Some(2), false),
    ] {
        c.full_graph = true;
        check(c)?;
    }
    Ok(())
}

/// Dynamic NTK RoPE: every shard must rotate with the base of the global length 32,
/// not of its own largest position (rank 0 of the contiguous layout ends at 7 < 16).
#[test]
fn dynamic_ntk_rope_uses_the_global_length() -> longctx::Result<()> {
    for (name, mode, full_graph) in [
        ("ulysses, dynamic rope", ParallelMode::UlyssesAttn, false),
        ("ulysses, dynamic rope (full graph)", ParallelMode::UlyssesAttn, true),
        ("zigzag ring, dynamic rope", ParallelMode::ZigzagRingAttn, false),
    ] {
        let mut c = case(name, mode, None, false);
        c.full_graph = full_graph;
        c.dynamic_rope = true;
        check(c)?;
    }
    Ok(())
}

/// A sliding window (Mistral, 6 tokens: across the ring's 4-token chunks and FPDT's
/// 8-token chunks, so across ranks) in every mode, the engine's layer backward and the
/// full graph, against the single-device run with the same window.
#[test]
fn sliding_window_in_every_mode() -> longctx::Result<()> {
    for (name, mode, ulysses, offload, full_graph) in [
        ("zigzag ring, window", ParallelMode::ZigzagRingAttn, None, false, false),
        ("ulysses, window", ParallelMode::UlyssesAttn, None, false, false),
        ("fpdt offload, window", ParallelMode::Fpdt, None, true, false),
        ("usp 2x2, window", ParallelMode::Usp, Some(2), false, false),
        ("zigzag ring, window (full graph)", ParallelMode::ZigzagRingAttn, None, false, true),
    ] {
        let mut c = case(name, mode, ulysses, offload);
        c.full_graph = full_graph;
        c.window = Some(6);
        check(c)?;
    }
    Ok(())
}
