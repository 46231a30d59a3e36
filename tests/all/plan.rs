//! The memory planner (`longctx::plan`) against numbers worked out by hand for a
//! Llama-2-7B-shaped model, its monotonicity in the sequence length, the validity of its
//! suggestions, its input validation, and the parameter count against weight files.
//!
//! All comparisons are exact (integer bytes): the formulas are integer arithmetic.

use longctx::model::LlamaConfig;
use longctx::parallel::ParallelMode;
use longctx::plan::{self, ModelShape, PlanRequest};
use std::path::Path;

/// Llama-2-7B's config.json (the fields that matter).
fn llama2_7b() -> LlamaConfig {
    let json = serde_json::json!({
        "architectures": ["LlamaForCausalLM"], "model_type": "llama",
        "hidden_size": 4096, "intermediate_size": 11008, "num_hidden_layers": 32,
        "num_attention_heads": 32, "num_key_value_heads": 32, "max_position_embeddings": 4096,
        "vocab_size": 32000, "rms_norm_eps": 1e-5, "rope_theta": 10000.0, "tie_word_embeddings": false
    });
    LlamaConfig::from_value("llama-2-7b/config.json", json).unwrap()
}

fn shape() -> ModelShape {
    ModelShape::from_config(&llama2_7b())
}

const H200: u64 = 141_000_000_000;
const K: usize = 1024;

fn req(seq: usize, mode: ParallelMode) -> PlanRequest {
    PlanRequest::new(seq, 8, H200, mode)
}

#[test]
fn llama2_7b_parameter_count() {
    // embed 32000·4096 = 131,072,000; per layer q,k,v,o 4·4096² = 67,108,864, MLP 3·4096·11008
    // = 135,266,304, norms 8192 → 202,383,360 × 32 = 6,476,267,520; final norm 4096; head
    // 131,072,000. Total 6,738,415,616 (the count transformers reports for Llama-2-7b-hf).
    assert_eq!(shape().params, 6_738_415_616);
}

/// Hand-worked figures of the zigzag 512K / 8-GPU Llama-2-7B case (module doc formulas).
mod hand {
    pub const P: u64 = 6_738_415_616;
    /// Local q (and k: 32 kv heads) elements: 65536 · 32 · 128.
    pub const E: u64 = 268_435_456;
    /// One `[b, s, h]` tensor: 65536 · 4096 · 2.
    pub const INPUT: u64 = 536_870_912;
    /// q, k, v, o (4E · 2 bytes) and the f32 LSE 4 · 32 · 65536.
    pub const CORE: u64 = 4 * E * 2 + 8_388_608;
    /// One 4096-token chunk: 4096 · (6·11008 + 6·4096) · 2 + 8 · 4096.
    pub const CHUNK: u64 = 742_424_576;
    /// The incoming gradient, the core, its gradients (4E · 2) and a chunk.
    pub const LAYER_BACKWARD: u64 = INPUT + CORE + 4 * E * 2 + CHUNK;
    /// The fused backward's f32 accumulators, 8E.
    pub const WORK: u64 = 8 * E;
    /// Zigzag ring buffers: 4E·2 + 16E + 4E = 28E.
    pub const RING: u64 = 28 * E;
    pub const SAVED: u64 = 32 * INPUT;
    pub const OVERHEAD: u64 = 3_000_000_000;
    /// 2P weights + 4P gradients (optimizer on the host).
    pub const STATIC: u64 = 2 * P + 4 * P;
    pub const PEAK: u64 = STATIC + SAVED + LAYER_BACKWARD + WORK + RING + OVERHEAD;
}

#[test]
fn zigzag_512k_on_8_gpus_by_hand() {
    use hand::*;
    let e = plan::estimate(&shape(), &req(512 * K, ParallelMode::ZigzagRingAttn)).unwrap();
    let d = &e.device;
    assert_eq!((e.layout.sp, e.layout.dp, e.layout.local_tokens), (8, 1, 65536));
    assert_eq!(d.weights, 13_476_831_232); // 2P
    assert_eq!(d.gradients, 26_953_662_464); // 4·W·⌈P/W⌉ = 4P (P divides by 8)
    assert_eq!(d.optimizer, 0); // on the host by default
    assert_eq!(d.saved_activations, 17_179_869_184); // 32 · 65536 · 4096 · 2
    assert_eq!(d.saved_attention, 0);
    assert_eq!(d.in_flight, 0);
    assert_eq!(d.layer_backward, LAYER_BACKWARD);
    assert_eq!(d.layer_backward, 5_582_651_392);
    assert_eq!(d.attention_work, WORK);
    assert_eq!(d.attention_mode, RING);
    assert_eq!(d.head, 2 * INPUT + 4096 * (32000 + 4 * 4096) * 2); // top hidden + grad, logits chunk + rows
    assert_eq!(d.layer_transient, LAYER_BACKWARD + WORK + RING);
    assert_eq!(d.transient, d.layer_transient);
    assert_eq!(d.peak_compute, PEAK);
    assert_eq!(d.peak_step, STATIC + (6 * P / 8 + 4 * P) + OVERHEAD); // reduce-scattered shard, new weights, all-gather
    assert_eq!(d.pool_peak, PEAK - OVERHEAD);
    assert_eq!(d.peak, PEAK);
    assert!(e.fits);
    // Host per rank: optimizer 12P/8 (ZeRO-1 over all 8 ranks, though dp = 1), the host
    // update's pinned f32 pieces of its P/8 = 842,301,952-element slice (12 of 2^26 and a
    // rest of 36,995,584; a piece and the next at once: two full ones, and the rest beside
    // one) and one piece of new weights (bf16), and the f32 start weights 4P; 8 ranks on the
    // node.
    assert_eq!(6_738_415_616u64 / 8 - 12 * (1 << 26), 36_995_584);
    let pieces: u64 = 4 * (2 * (1 << 26) + 36_995_584) + 2 * (1 << 26);
    assert_eq!(e.host.optimizer, 10_107_623_424);
    assert_eq!(e.host.grads_copy, pieces);
    assert_eq!(e.host.per_rank, 10_107_623_424 + pieces + 26_953_662_464);
    assert_eq!(e.host.per_node, 8 * (10_107_623_424 + pieces + 26_953_662_464));
    assert_eq!(e.fits_host, None);
}

#[test]
fn other_modes_512k_by_hand() {
    let m = shape();
    // Ulysses: head-sharded q, o (2e) and k, v for the full sequence with 32/8 = 4 kv heads
    // (524288·4·128 = e each), with grads: 2·(2e + 2e)·2 = 16e.
    let u = plan::estimate(&m, &req(512 * K, ParallelMode::UlyssesAttn)).unwrap();
    assert_eq!(u.device.attention_mode, 4_294_967_296);
    assert_eq!(u.device.peak_compute, hand::PEAK - hand::RING + 4_294_967_296);
    assert_eq!(u.device.peak, u.device.peak_compute.max(u.device.peak_step)); // here the optimizer step

    // USP 4 × 2: e_h = 524288/2 · (32/4) · 128 = e; heads 2·(2e + 2e)·2 = 16e,
    // ring 4·e·2 + 16e + 4e = 28e → 44e.
    let mut r = req(512 * K, ParallelMode::Usp);
    r.ulysses = Some(4);
    let p = plan::estimate(&m, &r).unwrap();
    assert_eq!((p.layout.ulysses, p.layout.ring), (4, 2));
    assert_eq!(p.device.attention_mode, 44 * 268_435_456);

    // FPDT, chunk 65536, offload: resident 873,463,808 on the GPU; parked on the host:
    // k, v 2·524288·4·128·2 + q, do, o 3e·2 + f32 dq 4e + lse 4·32·65536 = 3,766,484,992.
    let mut f = req(512 * K, ParallelMode::Fpdt);
    f.fpdt_offload = true;
    let e = plan::estimate(&m, &f).unwrap();
    assert_eq!(e.device.attention_mode, 873_463_808);
    assert_eq!(e.host.fpdt_parked, 3_766_484_992);
    f.fpdt_offload = false;
    let e = plan::estimate(&m, &f).unwrap();
    assert_eq!(e.device.attention_mode, 873_463_808 + 3_766_484_992);
    assert_eq!(e.host.fpdt_parked, 0);

    // Data parallel at 512K: every GPU holds the whole sequence, 8× the activation terms.
    let dp = plan::estimate(&m, &req(512 * K, ParallelMode::DataParallel)).unwrap();
    assert_eq!(dp.layout.dp, 8);
    assert_eq!(dp.device.saved_activations, 8 * 17_179_869_184);
    assert_eq!(dp.device.attention_mode, 0);
    assert_eq!(dp.host.optimizer, 12 * 6_738_415_616 / 8); // ZeRO-1 over 8 ranks
    assert!(!dp.fits);

    // Optimizer on the GPU: 12P / W on the device, nothing on the host.
    let mut od = req(64 * K, ParallelMode::ZigzagRingAttn);
    od.optimizer_on_host = false;
    let e = plan::estimate(&m, &od).unwrap();
    assert_eq!(e.device.optimizer, 10_107_623_424);
    assert_eq!(e.host.optimizer, 0);

    // Activation offload moves the saved inputs to the host.
    let mut oa = req(512 * K, ParallelMode::ZigzagRingAttn);
    oa.offload_activations = true;
    let e = plan::estimate(&m, &oa).unwrap();
    assert_eq!(e.device.saved_activations, 0);
    assert_eq!(e.host.saved_activations, 17_179_869_184);
    // On the device instead: the layer's input and the one below it, brought back ahead.
    assert_eq!(e.device.in_flight, 2 * hand::INPUT);
    assert_eq!(e.device.peak_compute, hand::PEAK - hand::SAVED + 2 * hand::INPUT);
    assert_eq!(e.device.peak, e.device.peak_step); // now the optimizer step is the peak
    assert_eq!(e.device.peak_step, hand::STATIC + (6 * hand::P / 8 + 4 * hand::P) + hand::OVERHEAD);
}

#[test]
fn fits_is_monotone_in_sequence_length() {
    let m = shape();
    for mode in [ParallelMode::ZigzagRingAttn, ParallelMode::UlyssesAttn, ParallelMode::DataParallel] {
        let mut prev_peak = 0;
        let mut fits = Vec::new();
        for k in 10..=24 {
            let e = plan::estimate(&m, &req(1 << k, mode)).unwrap();
            assert!(e.device.peak >= prev_peak, "{mode}: peak decreased at 2^{k}");
            prev_peak = e.device.peak;
            fits.push(e.fits);
        }
        // A prefix of `true` then only `false`, with both present.
        let first_no = fits.iter().position(|f| !f).expect("something must not fit at 16M tokens");
        assert!(first_no > 0, "{mode}: 1K tokens must fit");
        assert!(fits[first_no..].iter().all(|f| !f), "{mode}: fits again after not fitting: {fits:?}");
    }
}

#[test]
fn suggestions_are_valid_and_fit() {
    let m = shape();
    for (seq, mode) in [
        (512 * K, ParallelMode::DataParallel),
        (2048 * K, ParallelMode::ZigzagRingAttn),
        (1536 * K, ParallelMode::UlyssesAttn),
        (1024 * K, ParallelMode::Fpdt),
    ] {
        let r = req(seq, mode);
        let p = plan::plan(&m, &r).unwrap();
        let s = p.suggestion.unwrap_or_else(|| panic!("{mode} at {seq}: no suggestion"));
        let mut sr = PlanRequest {
            mode: s.mode,
            sp: Some(s.sp),
            offload_activations: s.offload_activations,
            fpdt_offload: s.fpdt_offload,
            ..r.clone()
        };
        if s.mode == ParallelMode::Usp {
            sr.ulysses = Some(s.ulysses);
        }
        if let Some(c) = s.fpdt_chunk {
            sr.fpdt_chunk = c;
            assert!(c.is_power_of_two() && seq % c == 0 && c % s.sp == 0, "chunk {c}");
        }
        let e = plan::estimate(&m, &sr).expect("the suggested layout validates");
        assert!(e.fits, "suggested layout does not fit: {s:?}");
        assert_eq!(e.device.peak, s.peak);
        if p.estimate.fits {
            assert!(s.as_requested);
        } else {
            assert!(!s.as_requested);
            assert!(s.peak as f64 <= H200 as f64 * (1.0 - plan::SUGGESTION_HEADROOM));
        }
    }
    // 512K data parallel does not fit; the suggestion is the smallest sp that does,
    // without offload: Ulysses over 4 ranks (2 replicas).
    let s = plan::suggest(&m, &req(512 * K, ParallelMode::DataParallel)).unwrap();
    assert_eq!((s.mode, s.sp, s.offload_activations), (ParallelMode::UlyssesAttn, 4, false));
    // A fitting request is its own suggestion.
    let s = plan::suggest(&m, &req(64 * K, ParallelMode::ZigzagRingAttn)).unwrap();
    assert!(s.as_requested && s.mode == ParallelMode::ZigzagRingAttn);
    // Nothing fits 64M tokens on 8 GPUs.
    assert!(plan::suggest(&m, &req(64 * 1024 * K, ParallelMode::ZigzagRingAttn)).is_none());
}

#[test]
fn fpdt_chunk_candidates() {
    assert_eq!(plan::fpdt_chunk_candidates(3 << 16, 8), vec![65536, 32768, 16384, 8192, 4096, 2048, 1024, 512, 256, 128, 64, 32, 16, 8]);
    assert_eq!(plan::fpdt_chunk_candidates(1 << 20, 4)[0], 1 << 20);
    assert!(plan::fpdt_chunk_candidates(12, 8).is_empty());
}

fn err(r: &PlanRequest) -> String {
    plan::estimate(&shape(), r).unwrap_err().to_string()
}

#[test]
fn invalid_requests_are_named() {
    let e = err(&req(100, ParallelMode::ZigzagRingAttn));
    assert!(e.contains("`seq_length`") && e.contains("2·8 = 16"), "{e}");

    let mut f = req(100_000, ParallelMode::Fpdt);
    f.fpdt_chunk = 65536;
    let e = err(&f);
    assert!(e.contains("`seq_length`") && e.contains("multiple of the chunk size 65536"), "{e}");
    f.seq_len = 65536 * 2;
    f.fpdt_chunk = 65532; // not a multiple of 8
    let e = err(&f);
    assert!(e.contains("fpdt_chunk_size") && e.contains("multiple of sp_size 8"), "{e}");

    let mut w = req(65536, ParallelMode::ZigzagRingAttn);
    w.world = 16;
    let e = err(&w);
    assert!(e.contains("`world_size`") && e.contains("16 ranks") && e.contains("8 GPU"), "{e}");

    // 32 heads do not split over 24 Ulysses ranks.
    let mut u = PlanRequest::new(24 * 4096, 24, H200, ParallelMode::UlyssesAttn);
    u.world = 24;
    let e = err(&u);
    assert!(e.contains("`parallel_mode`") && e.contains("32 query heads") && e.contains("ulysses = 24"), "{e}");

    let mut z = req(65536, ParallelMode::ZigzagRingAttn);
    z.dtype_bytes = 3;
    assert!(err(&z).contains("`dtype`"));
}

#[test]
fn check_run_catches_heads_and_allows_dp_changes() {
    use longctx::train::config::{RunConfig, Stage};
    let tiny = longctx::train::init::builtin_config("tiny").unwrap(); // 4 query / 2 kv heads
    let src = Path::new("run.toml");
    let mut c = RunConfig::default();
    c.parallel.world_size = 8;
    c.parallel.mode = ParallelMode::UlyssesAttn;
    let e = plan::check_run(&c, &tiny, src).unwrap_err().to_string();
    assert!(e.contains("run.toml") && e.contains("parallel.mode") && e.contains("4 query heads"), "{e}");
    c.parallel.mode = ParallelMode::ZigzagRingAttn;
    plan::check_run(&c, &tiny, src).unwrap();
    // data_parallel (dp 8) then a ring stage (dp 1): allowed, the optimizer is sharded
    // over all 8 ranks either way.
    c.parallel.mode = ParallelMode::DataParallel;
    c.stages.push(Stage { parallel_mode: Some(ParallelMode::ZigzagRingAttn), ..Stage::new(1024, 1e6, 1) });
    plan::check_run(&c, &tiny, src).unwrap();
    // ... but not a later Ulysses stage the heads cannot split into.
    c.stages.push(Stage { parallel_mode: Some(ParallelMode::UlyssesAttn), ..Stage::new(2048, 1e6, 1) });
    let e = plan::check_run(&c, &tiny, src).unwrap_err().to_string();
    assert!(e.contains("parallel_mode") && e.contains("4 query heads"), "{e}");
    // The MLP kept for more layers than the model has.
    let mut c = RunConfig::default();
    c.parallel.save_mlp_layers = Some(tiny.num_hidden_layers + 1);
    let e = plan::check_run(&c, &tiny, src).unwrap_err().to_string();
    let want = format!("expected at most the model's {} layers", tiny.num_hidden_layers);
    assert!(e.contains("run.toml") && e.contains("parallel.save_mlp_layers") && e.contains(&want), "{e}");
    c.parallel.save_mlp_layers = Some(tiny.num_hidden_layers);
    plan::check_run(&c, &tiny, src).unwrap();
}

/// The config-derived count equals the sum of the shapes stored in every fixture
/// checkpoint (biases, GQA, tied heads).
#[test]
fn param_count_matches_weight_files() {
    let root = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures");
    let mut seen = 0;
    for entry in std::fs::read_dir(&root).unwrap() {
        let dir = entry.unwrap().path();
        if !dir.join("config.json").is_file() || !dir.join("model.safetensors").is_file() {
            continue;
        }
        let cfg = LlamaConfig::from_file(dir.join("config.json")).unwrap();
        let ck = longctx::hub::Checkpoint::open(&dir).unwrap();
        let stored: u64 = ck.names().iter().map(|n| ck.info(n).unwrap().1.iter().product::<usize>() as u64).sum();
        assert_eq!(plan::param_count(&cfg), stored, "{}", dir.display());
        seen += 1;
    }
    assert!(seen >= 3, "expected the committed fixtures, found {seen}");
}

#[test]
fn sizes_and_token_counts() {
    assert_eq!(plan::parse_size("5GB"), Ok(5_000_000_000));
    assert_eq!(plan::parse_size("500MB"), Ok(500_000_000));
    assert_eq!(plan::parse_size("2GiB"), Ok(2 << 30));
    assert_eq!(plan::parse_size("1.5gb"), Ok(1_500_000_000));
    assert_eq!(plan::parse_size("12345"), Ok(12345));
    assert_eq!(plan::parse_size("10K"), Ok(10_000));
    assert!(plan::parse_size("5XB").unwrap_err().contains("unknown unit"));
    assert!(plan::parse_size("0").is_err());
    assert!(plan::parse_size("GB").is_err());
    assert_eq!(plan::parse_tokens("512K"), Ok(524288));
    assert_eq!(plan::parse_tokens("1M"), Ok(1 << 20));
    assert_eq!(plan::parse_tokens("65536"), Ok(65536));
    assert!(plan::parse_tokens("0").is_err() && plan::parse_tokens("12x").is_err());
    assert_eq!(plan::tokens_label(524288), "512K");
    assert_eq!(plan::tokens_label(1 << 20), "1M");
    assert_eq!(plan::tokens_label(1000), "1000");
    // One printer for the one parser: K = 1024, and a round decimal count (EasyContext's
    // 256000, exactly 250K) printed as it is; every label reads back as its count.
    assert_eq!(plan::tokens_label(256_000), "256000");
    assert_eq!(plan::tokens_label(65536), "64K");
    assert_eq!(plan::tokens_label(3 << 19), "1536K");
    for n in [1, 1000, 4096, 65536, 256_000, 524_288, 1 << 20, 3 << 19, 1_000_000, 16 << 20] {
        assert_eq!(plan::parse_tokens(&plan::tokens_label(n)), Ok(n), "{n}");
    }
}

#[test]
fn saved_attention_by_hand_and_chosen_when_it_fits() {
    // zigzag 512K on 8 GPUs: e = 65536·32·128 = 268,435,456 elements of local q (and of k:
    // Llama-2-7B has 32 kv heads). Per layer: (2e + 2e)·2 bytes + 4·32·65536 LSE.
    let mut r = req(512 * K, ParallelMode::ZigzagRingAttn);
    let off = plan::estimate(&shape(), &r).unwrap();
    r.save_attention = true;
    let on = plan::estimate(&shape(), &r).unwrap();
    assert_eq!(off.device.saved_attention, 0);
    assert_eq!(on.device.saved_attention, 32 * (8 * 268_435_456 + 8_388_608));
    // The layer's own core is then part of what is saved, not of its backward's transient.
    assert_eq!(on.device.peak_compute, off.device.peak_compute + on.device.saved_attention - hand::CORE);
    // 75.9 GB without it + 69.0 GB saved − 2.2 GB = 142.7 GB > 141 GB: it does not fit, so
    // the suggestion keeps the request as it is.
    assert!(!on.fits);
    let s = plan::suggest(&shape(), &req(512 * K, ParallelMode::ZigzagRingAttn)).unwrap();
    assert!(s.as_requested && !s.save_attention, "{s:?}");
    // At 128K on 8 GPUs (16K tokens each) it fits easily and is suggested, and so is the
    // saved MLP: per layer 16384 tokens × (4096 + 2·11008) × 2 bytes = 855,638,016.
    let s = plan::suggest(&shape(), &req(128 * K, ParallelMode::ZigzagRingAttn)).unwrap();
    assert!(s.as_requested && s.save_attention && s.save_mlp, "{s:?}");
    let both = PlanRequest { save_attention: true, save_mlp: true, ..req(128 * K, ParallelMode::ZigzagRingAttn) };
    let e = plan::estimate(&shape(), &both).unwrap();
    assert_eq!(s.peak, e.device.peak);
    let attn_only = plan::estimate(&shape(), &PlanRequest { save_mlp: false, ..both.clone() }).unwrap();
    assert_eq!(e.device.saved_mlp, 32 * 855_638_016);
    assert_eq!(e.device.peak_compute, attn_only.device.peak_compute + e.device.saved_mlp);
    // Offloaded, the MLP's tensors go to the host with the layer inputs.
    let off = plan::estimate(&shape(), &PlanRequest { offload_activations: true, ..both.clone() }).unwrap();
    let off_attn = plan::estimate(&shape(), &PlanRequest { offload_activations: true, save_mlp: false, ..both }).unwrap();
    assert_eq!(off.device.saved_mlp, 0);
    assert_eq!(off.host.saved_activations, off_attn.host.saved_activations + 32 * 855_638_016);
    // At 256K (32K tokens each) the attention still fits with the headroom, the MLP of
    // every layer no longer: the suggestion keeps it for the most top layers that fit
    // with the headroom (one more would not), each counted at 32768 × (4096 + 2·11008) × 2 bytes.
    let r256 = req(256 * K, ParallelMode::ZigzagRingAttn);
    let s = plan::suggest(&shape(), &r256).unwrap();
    assert!(s.as_requested && s.save_attention && s.save_mlp, "{s:?}");
    let n = s.save_mlp_layers.expect("a count of layers");
    assert!((1..32).contains(&n), "{s:?}");
    let budget = (H200 as f64 * (1.0 - plan::SUGGESTION_HEADROOM)) as u64;
    let with = |n: usize| {
        let r = PlanRequest { save_attention: true, save_mlp: false, save_mlp_layers: Some(n), ..r256.clone() };
        plan::estimate(&shape(), &r).unwrap()
    };
    let (e, over) = (with(n), with(n + 1));
    assert_eq!(s.peak, e.device.peak);
    assert!(e.device.peak <= budget && over.device.peak > budget, "{} {} {budget}", e.device.peak, over.device.peak);
    assert_eq!(e.device.saved_mlp, n as u64 * 32768 * 26112 * 2);
    assert_eq!(over.device.peak - e.device.peak, 32768 * 26112 * 2);
    // A count past the model's layers is refused, naming the field and the bound.
    let err = plan::estimate(&shape(), &PlanRequest { save_mlp_layers: Some(33), ..r256 }).unwrap_err().to_string();
    assert!(err.contains("save_mlp_layers") && err.contains("got 33") && err.contains("32 layers"), "{err}");
}

/// A run config for the 1.1B shape on one GPU, one stage of `seq` tokens.
fn run_1b(seq: usize, offload: bool) -> longctx::train::RunConfig {
    let mut c = longctx::train::RunConfig::plain();
    c.model.dtype = "bf16".into();
    c.parallel.offload_activations = offload;
    c.parallel.token_chunk = 8192;
    c.stages = vec![longctx::train::Stage::new(seq, 1e6, 1)];
    c
}

/// `train`'s memory check before any work: a length that does not fit is refused with
/// the estimate, the GPU's size, the largest length that fits as configured and a layout
/// that fits; a host too small for the offloaded activations is refused with the need;
/// what fits passes.
#[test]
fn preflight_refuses_with_the_numbers_and_a_fix() {
    let cfg = longctx::train::init::builtin_config("tinyllama-1.1b-shape").unwrap();
    let src = Path::new("run.toml");
    let h200 = 141_000_000_000u64;
    // 2M tokens on the device (no offload): does not fit one H200.
    let e = plan::preflight(&run_1b(2 * K * K, false), &cfg, h200, None, 1, src).unwrap_err().to_string();
    assert!(e.contains("stage[0].seq_length") && e.contains("2097152 tokens") && e.contains("141.00 GB"), "{e}");
    let largest =
        plan::largest_fitting(&ModelShape::from_config(&cfg), &plan::run_requests(&run_1b(2 * K * K, false), h200, 2)[0]).unwrap();
    assert!(e.contains(&format!("the largest length that fits this layout is {}", plan::tokens_label(largest))), "{e}");
    assert!((256 * K..2 * K * K).contains(&largest), "{largest}");
    assert!(e.contains("offload_activations = true") || e.contains("fpdt"), "a layout that fits: {e}");
    // Offloading 512K needs about 47 GB of host memory for the layer inputs.
    let e = plan::preflight(&run_1b(512 * K, true), &cfg, h200, Some(20_000_000_000), 1, src).unwrap_err().to_string();
    assert!(e.contains("host memory") && e.contains("offloaded activations 47.24 GB") && e.contains("20.00 GB are available"), "{e}");
    assert!(e.contains("parallel.offload_activations") && e.contains("gradients 0.00 GB"), "the largest term's setting: {e}");
    plan::preflight(&run_1b(512 * K, true), &cfg, h200, Some(200_000_000_000), 1, src).unwrap();
    plan::preflight(&run_1b(64 * K, false), &cfg, h200, None, 1, src).unwrap();
    // Two launched ranks: on one node they need twice one rank's host memory, on two
    // nodes one rank's each.
    let mut two = run_1b(512 * K, true);
    two.parallel.world_size = 2;
    let req = &plan::run_requests(&two, h200, 2)[0];
    let per_rank = plan::estimate(&ModelShape::from_config(&cfg), req).unwrap().host.per_rank;
    let host = Some(per_rank * 3 / 2);
    let e = plan::preflight(&two, &cfg, h200, host, 1, src).unwrap_err().to_string();
    assert!(e.contains("host memory per node"), "{e}");
    plan::preflight(&two, &cfg, h200, host, 2, src).unwrap();
    // The optimizer state the largest part on the host: its setting is the one named,
    // and the parts list the weights and gradients there.
    let mut z3 = run_1b(8 * K, false);
    (z3.train.zero_stage, z3.train.offload_params, z3.train.optimizer_on_host, z3.train.offload_gradients) = (3, true, true, true);
    let e = plan::preflight(&z3, &cfg, h200, Some(1_000_000_000), 1, src).unwrap_err().to_string();
    assert!(e.contains("train.optimizer_on_host") && !e.contains("parallel.offload_activations"), "{e}");
    let p = plan::param_count(&cfg);
    assert!(e.contains(&format!("weights {} GB", plan::gb(2 * p))) && e.contains(&format!("optimizer {} GB", plan::gb(12 * p))), "{e}");
}

/// `train`'s disk check before any work: Llama-2-7B (6,738,415,616 parameters) in bf16
/// writes checkpoints of 14 bytes per parameter (bf16 weights, f32 master, m, v) and an
/// export of 2. One checkpoint and the export: 107.81 GB at the fullest; a second
/// checkpoint (two stages, or `checkpoint_every`) is written beside the first: 2 × 94.34
/// GB; a resumed run replaces the checkpoint it found. On the CPU the weights are f32.
#[test]
fn disk_check_counts_the_checkpoint_beside_the_previous_and_the_export() {
    let m = llama2_7b();
    let p = 6_738_415_616u64;
    assert_eq!(plan::param_count(&m), p);
    let mut one = run_1b(64 * K, false);
    one.model.device = "cuda".into();
    let d = plan::disk_need(&one, &m, 2, false);
    assert_eq!((d.checkpoint, d.export, d.peak), (14 * p, 2 * p, 16 * p));
    let mut two = one.clone();
    two.stages.push(longctx::train::Stage::new(128 * K, 1e6, 1));
    assert_eq!(plan::disk_need(&two, &m, 2, false).peak, 28 * p);
    let mut every = one.clone();
    every.stages[0].steps = 10;
    every.train.checkpoint_every = 5;
    assert_eq!(plan::disk_need(&every, &m, 2, false).peak, 28 * p);
    every.train.checkpoint_every = 20; // never reached: only the stage end's checkpoint
    assert_eq!(plan::disk_need(&every, &m, 2, false).peak, 16 * p);
    assert_eq!(plan::disk_need(&two, &m, 2, true).peak, 14 * p);

    let src = Path::new("run.toml");
    one.output_dir = "/data/run".into();
    let e = plan::preflight_disk(&one, &m, 64_000_000_000, false, src).unwrap_err().to_string();
    for want in ["output_dir", "94.34 GB", "13.48 GB", "/data/run", "107.81 GB", "64.00 GB free", "--output-dir", "--skip-memory-check"] {
        assert!(e.contains(want), "missing {want:?}: {e}");
    }
    plan::preflight_disk(&one, &m, 16 * p, false, src).unwrap();
    plan::preflight_disk(&one, &m, 16 * p - 1, false, src).unwrap_err();
    // On the CPU: f32 weights, 16 + 4 bytes per parameter.
    one.model.device = "cpu".into();
    plan::preflight_disk(&one, &m, 20 * p, false, src).unwrap();
    plan::preflight_disk(&one, &m, 20 * p - 1, false, src).unwrap_err();
}

/// ZeRO-3 with the weights and optimizer state on the host, one GPU, 64K: the GPU holds
/// two whole layers of weights (202,383,360 elements each, the largest unit) instead of
/// the model, and the gradient as this rank's slice (all of it on one rank, 34 units
/// padded by one element each, written in place); with two ranks half of it plus the
/// embedding's and one layer's scratch (each whole: both ranks' parts of it, the
/// reduce-scatter's input; `zero_stages` checks this against what the engine allocates); the host holds the
/// 16-bit slice. ZeRO-2 keeps the whole weights on the GPU.
#[test]
fn zero_3_with_offloads_by_hand() {
    let mut r = PlanRequest::new(64 * K, 1, H200, ParallelMode::DataParallel);
    r.zero_stage = 3;
    r.offload_params = true;
    let e = plan::estimate(&shape(), &r).unwrap();
    let (layer, units) = (202_383_360u64, 34u64);
    let shard = 6_738_415_616 + units;
    assert_eq!(e.device.weights, 2 * layer * 2);
    assert_eq!(e.device.gradients, 4 * shard);
    let two = plan::estimate(
        &shape(),
        &PlanRequest { zero_stage: 3, offload_params: true, ..PlanRequest::new(64 * K, 2, H200, ParallelMode::DataParallel) },
    )
    .unwrap();
    assert_eq!(two.device.gradients, 4 * ((6_738_415_616 / 2 + units) + 131_072_000 + layer));
    assert_eq!(e.device.optimizer, 0);
    assert_eq!(e.host.weights, 2 * shard);
    assert_eq!(e.host.optimizer, 12 * shard);
    // The deferred host update's pinned f32 pieces (2^26 elements at most, cut per unit):
    // three units in flight, per size the most any three hold. A layer is 3 full pieces and
    // 1,056,768 elements; the embedding (131,072,000) and the norm + head (131,076,096) are
    // one full piece and 63,963,136 / 63,967,232: 9 full pieces, 3 layer rests, one of each.
    let full = 1u64 << 26;
    assert_eq!(e.host.grads_copy, 4 * (9 * full + 3 * (layer - 3 * full) + (131_072_000 - full) + (131_076_096 - full)));
    assert_eq!(e.host.grads_copy, 2_940_321_792);
    r.offload_params = false;
    let on_gpu = plan::estimate(&shape(), &r).unwrap();
    assert_eq!(on_gpu.device.weights, 2 * shard + 2 * layer * 2);
    assert_eq!(on_gpu.host.weights, 0);
    // Not deferred: a piece and the next (f32), per size the most any two hold (the pool
    // keeps a buffer of each size it met), and a piece of new weights (bf16).
    let f32_pieces = 2 * full + (layer - 3 * full) + (131_072_000 - full) + (131_076_096 - full);
    assert_eq!(on_gpu.host.grads_copy, 4 * f32_pieces + 2 * full);
    r.zero_stage = 2;
    assert_eq!(plan::estimate(&shape(), &r).unwrap().device.weights, 2 * 6_738_415_616);
}

/// 7B at 256K on one H200 with its 134 GB of host memory: nothing fits as asked; the
/// optimizer on the host with activations offloaded would overflow the host, so the
/// suggestion is ZeRO-3 with the weights and optimizer state on the host.
#[test]
fn the_suggestion_reaches_for_zero_3_when_nothing_else_fits() {
    let mut r = PlanRequest::new(256 * K, 1, H200, ParallelMode::DataParallel);
    r.optimizer_on_host = false;
    r.host_memory = Some(134_000_000_000);
    let p = plan::plan(&shape(), &r).unwrap();
    assert!(!p.estimate.fits);
    let s = p.suggestion.expect("a suggestion");
    assert_eq!((s.zero_stage, s.offload_params, s.optimizer_on_host, s.offload_activations), (3, true, true, false), "{s:?}");
    assert!(s.peak <= H200);
}

/// The last lever: 7B on one 80 GB GPU with 256 GB of host memory. At 320K ZeRO-3 with
/// the weights and optimizer on the host (activations offloaded) still fits; at 384K only
/// with the gradients on the host too, and the suggestion (and `train`'s refusal, in the
/// config's words) names `offload_gradients`; it never reaches for it when it is not needed.
#[test]
fn the_suggestion_puts_the_gradients_on_the_host_last() {
    let gpu = 80_000_000_000u64;
    let req = |n: usize| {
        let mut r = PlanRequest::new(n, 1, gpu, ParallelMode::DataParallel);
        r.optimizer_on_host = false;
        r.host_memory = Some(256_000_000_000);
        r
    };
    let s = plan::suggest(&shape(), &req(320 * K)).expect("320K fits");
    assert_eq!((s.zero_stage, s.offload_params, s.offload_gradients), (3, true, false), "{s:?}");
    let s = plan::suggest(&shape(), &req(384 * K)).expect("384K fits with the gradients on the host");
    assert_eq!((s.zero_stage, s.offload_params, s.optimizer_on_host, s.offload_gradients), (3, true, true, true), "{s:?}");
    assert!(s.peak <= gpu);
    // Without that lever, nothing fits 384K there.
    let mut without = req(384 * K);
    (without.zero_stage, without.offload_params, without.optimizer_on_host, without.offload_activations) = (3, true, true, true);
    for save_attention in [false, true] {
        let e = plan::estimate(&shape(), &PlanRequest { save_attention, ..without.clone() }).unwrap();
        assert!(e.device.peak > gpu - gpu / 20, "{} GB", plan::gb(e.device.peak));
        let g = plan::estimate(&shape(), &PlanRequest { save_attention, offload_gradients: true, ..without.clone() }).unwrap();
        assert_eq!(e.device.peak - g.device.peak, e.device.gradients - g.device.gradients);
    }
    let d = plan::describe_suggestion(&s, &req(384 * K));
    for key in ["train.zero_stage = 3", "train.optimizer_on_host = true", "train.offload_params = true", "train.offload_gradients = true"] {
        assert!(d.contains(key), "{key} in {d}");
    }
    // Levers the request already pulled are not named again.
    let asked = PlanRequest { zero_stage: 3, offload_params: true, optimizer_on_host: true, ..req(384 * K) };
    let d = plan::describe_suggestion(&plan::suggest(&shape(), &asked).unwrap(), &asked);
    assert!(d.contains("train.offload_gradients = true") && !d.contains("zero_stage") && !d.contains("offload_params"), "{d}");
}

/// A split optimizer placement (`train.optimizer_device_units`), 7B at 64K, ZeRO-3 with
/// weights and state on the host, one rank: the first units' AdamW state (12 bytes a
/// parameter) and their weights (2) move onto the GPU, the host keeps the whole slice's, and the deferred
/// update's pinned pieces start after them (as `ShardedAdamW::pinned_piece_bytes` counts).
#[test]
fn a_split_optimizer_placement_by_hand() {
    let mut r = PlanRequest::new(64 * K, 1, H200, ParallelMode::DataParallel);
    r.zero_stage = 3;
    r.offload_params = true;
    let base = plan::estimate(&shape(), &r).unwrap();
    let (embedding, layer, head, units) = (131_072_000u64, 202_383_360u64, 131_076_096u64, 34usize);
    let full = 1u64 << 26;
    for (n, on_gpu, pieces) in [
        (0, 0, 9 * full + 3 * (layer - 3 * full) + (embedding - full) + (head - full)),
        // Units 1..: no embedding piece; three layers still follow.
        (2, embedding + layer, 9 * full + 3 * (layer - 3 * full) + (head - full)),
        // The last layer and the head left: one window holds both.
        (32, embedding + 31 * layer, 4 * full + (layer - 3 * full) + (head - full)),
        (units, embedding + 32 * layer + head, 0),
    ] {
        r.optimizer_device_units = n;
        let e = plan::estimate(&shape(), &r).unwrap();
        assert_eq!(e.device.optimizer, 12 * on_gpu, "{n} units");
        // Split, those units' 16-bit weights stay on the GPU beside their state; all of it
        // there, the weights stay on the host as with the state on the GPU.
        let resident = if n < units { 2 * on_gpu } else { 0 };
        assert_eq!(e.device.weights, base.device.weights + resident, "{n} units");
        assert_eq!(e.device.peak, base.device.peak + 12 * on_gpu + resident, "{n} units: the peak grows by the state and weights");
        assert_eq!(e.host.optimizer, base.host.optimizer, "{n} units: the host keeps the whole slice's state");
        assert_eq!(e.host.grads_copy, 4 * pieces, "{n} units");
    }
    // Validated as `train` validates it: without the host optimizer it is refused.
    r.optimizer_on_host = false;
    r.optimizer_device_units = 2;
    assert!(err(&r).contains("train.optimizer_device_units"), "{}", err(&r));
}

#[test]
fn more_device_units_than_the_model_has_are_refused() {
    let mut r = PlanRequest::new(64 * K, 1, H200, ParallelMode::DataParallel);
    r.zero_stage = 3;
    r.optimizer_device_units = 35;
    let e = err(&r);
    assert!(e.contains("optimizer_device_units") && e.contains("got 35") && e.contains("at most 34"), "{e}");
    r.zero_stage = 1;
    r.optimizer_device_units = 2;
    assert!(err(&r).contains("at most 1"), "{}", err(&r));
}

/// Only the layer inputs in host memory (`parallel.offload_layer_inputs`), 7B at 64K,
/// ZeRO-3 with weights and state on the host, attention and 10 layers' MLP saved: the
/// inputs (32 × 65536 × 4096 bf16) leave the GPU and land on the host, the attention's
/// and MLP's tensors stay, two inputs are in flight in a layer's backward and one beside
/// the head; the host counts the start weights or the inputs, whichever is larger (never
/// both: the start weights are freed before the first step). With everything offloaded
/// as well, the request is refused by the config's rule, naming both keys.
#[test]
fn layer_inputs_offloaded_by_hand() {
    let mut r = PlanRequest::new(64 * K, 1, H200, ParallelMode::DataParallel);
    (r.zero_stage, r.offload_params, r.save_attention, r.save_mlp_layers, r.token_chunk) = (3, true, true, Some(10), 8192);
    let kept = plan::estimate(&shape(), &r).unwrap();
    r.offload_layer_inputs = true;
    let off = plan::estimate(&shape(), &r).unwrap();
    let input = 65_536u64 * 4096 * 2;
    assert_eq!(kept.device.saved_activations, 32 * input);
    assert_eq!(off.device.saved_activations, 0);
    assert_eq!(off.host.saved_activations, 32 * input);
    assert_eq!((off.device.saved_attention, off.device.saved_mlp), (kept.device.saved_attention, kept.device.saved_mlp));
    assert_eq!((kept.device.in_flight, off.device.in_flight), (0, 2 * input));
    assert_eq!(off.device.head_transient, kept.device.head_transient + input);
    assert_eq!(off.device.pool_peak, kept.device.pool_peak - 32 * input + 2 * input, "the layer's backward is the peak");
    // 17.2 GB of inputs against 27.0 GB of start weights: the host total does not move.
    assert!(off.host.weights_copy > off.host.saved_activations);
    assert_eq!(off.host.per_rank, kept.host.per_rank);
    let many = plan::estimate(&shape(), &PlanRequest { seq_len: 128 * K, ..r.clone() }).unwrap();
    let kept_many = plan::estimate(&shape(), &PlanRequest { seq_len: 128 * K, offload_layer_inputs: false, ..r.clone() }).unwrap();
    assert_eq!(many.host.per_rank, kept_many.host.per_rank - many.host.weights_copy + 64 * input, "inputs larger than the start weights");
    let both = plan::estimate(&shape(), &PlanRequest { offload_activations: true, ..r.clone() }).unwrap_err().to_string();
    assert!(both.contains("offload_layer_inputs") && both.contains("offload_activations"), "{both}");
}

/// The trainer's host check before any weight is allocated (`trainer::host_need`), 7B at
/// 64K on one GPU, ZeRO-3 with weights and optimizer state on the host, attention and the
/// top 6 layers' MLP saved: the offloaded tensors counted as `longctx plan` counts them,
/// by hand. Inputs only: 32 × 65536 × 4096 × 2 bytes. Everything: plus each layer's q, k,
/// v, o (4 × 65536 × 4096 × 2) and f32 LSE (4 × 32 × 65536), and the 6 layers' MLP input,
/// gate and up (65536 × (4096 + 2 × 11008) × 2). Before, the check counted the inputs
/// alone for both, so a run that overflows the host (this one: 86 GB more) got past it.
#[test]
fn the_trainers_host_check_counts_what_the_step_offloads() {
    use longctx::train::config::{RunConfig, Stage};
    let m = llama2_7b();
    let mut c = RunConfig::default();
    c.model.device = "cuda".into();
    c.model.dtype = "bf16".into();
    c.train.zero_stage = 3;
    c.train.offload_params = true;
    c.train.optimizer_on_host = true;
    c.parallel.save_attention = true;
    c.parallel.save_mlp_layers = Some(6);
    c.parallel.token_chunk = 8192;
    c.train.batch_size = 1;
    c.stages = vec![Stage::new(64 * K, 1e6, 1)];
    let (s, h, i, l, heads) = (65_536u64, 4096u64, 11_008u64, 32u64, 32u64);
    let inputs = l * s * h * 2;
    let attention = l * (4 * s * h * 2 + 4 * heads * s);
    let mlp = 6 * s * (h + 2 * i) * 2;
    for (all, inp, want) in [(false, false, 0), (false, true, inputs), (true, false, inputs + attention + mlp)] {
        (c.parallel.offload_activations, c.parallel.offload_layer_inputs) = (all, inp);
        let need = longctx::train::trainer::host_need(&c, &m, 1).unwrap();
        assert_eq!(need.activations, want, "offload_activations {all}, offload_layer_inputs {inp}");
        let req = &plan::run_requests(&c, H200, 2)[0];
        assert_eq!(need.activations, plan::estimate(&shape(), req).unwrap().host.saved_activations, "{all} {inp}: as plan counts");
        // Optimizer (12 bytes a parameter) and the bf16 weights on the host besides.
        assert_eq!(need.optimizer, 12 * 6_738_415_616);
        assert_eq!(need.weights, 2 * 6_738_415_616);
    }
    // Everything offloaded needs more than a 128 GiB machine has: refused, naming the parts.
    (c.parallel.offload_activations, c.parallel.offload_layer_inputs) = (true, false);
    let need = longctx::train::trainer::host_need(&c, &m, 1).unwrap();
    let e = longctx::limits::check_host_memory(&need, Some(128 << 30), Path::new("run.toml")).unwrap_err().to_string();
    assert!(e.contains("saved activations 106.7 GB") && e.contains("run.toml"), "{e}");
    assert!(e.contains("parallel.offload_activations") && e.contains("`parallel.offload_layer_inputs` alone"), "{e}");
}

/// `train.offload_gradients` in the planner and the trainer's host check, by hand at the
/// 7B shape on one GPU (ZeRO-3, weights and optimizer on the host, then the weights on the
/// GPU; units: the embedding,
/// 32 layers of 202,383,360 parameters, the norm with the head): the device keeps two
/// layers' f32 turns, the embedding's slice and one layer's brought back from the host in a
/// step's later micro-batches (`4·(3·202,383,360 + 131,072,000)`), or with 3 device units
/// their slices, two turns and one brought back; the host the other units' slices (4 bytes a
/// parameter) and no gradient pieces. The device memory freed is what more saved MLP
/// layers take. The trainer's check counts the 4 bytes a parameter with the activations
/// (after the start weights are gone) and names the setting when it does not fit.
#[test]
fn gradients_in_host_memory_move_four_bytes_a_parameter_off_the_gpu() {
    use longctx::train::config::{RunConfig, Stage};
    let (p, layer, embed) = (6_738_415_616u128, 202_383_360u128, 131_072_000u128);
    let mut r = PlanRequest::new(64 * K, 1, H200, ParallelMode::DataParallel);
    (r.zero_stage, r.offload_params, r.optimizer_on_host, r.save_attention, r.token_chunk) = (3, true, true, true, 8192);
    let base = plan::estimate(&shape(), &r).unwrap();
    let shard = p + 34; // the planner pads each of the 34 units by up to one element
    assert_eq!(u128::from(base.device.gradients), 4 * shard, "the whole slice on the device");
    r.offload_gradients = true;
    let e = plan::estimate(&shape(), &r).unwrap();
    assert_eq!(u128::from(e.device.gradients), 4 * (2 * layer + embed + layer), "two turns, the embedding, one brought back");
    assert_eq!(u128::from(e.host.gradients), 4 * shard);
    assert_eq!(e.host.grads_copy, 0, "the update reads the slices in place: no pieces");
    assert_eq!(e.device.pool_peak - e.device.gradients, base.device.pool_peak - base.device.gradients, "the rest is the same");
    r.optimizer_device_units = 3;
    let e = plan::estimate(&shape(), &r).unwrap();
    let dev = embed + 2 * layer;
    assert_eq!(u128::from(e.device.gradients), 4 * (dev + 3 * layer));
    assert_eq!(u128::from(e.host.gradients), 4 * (shard - dev));
    // The weights on the GPU (an update at once after the backward): the same gradient
    // figures; the host rounds a whole layer's new weights (bf16) instead of pieces.
    r.offload_params = false;
    let e = plan::estimate(&shape(), &r).unwrap();
    assert_eq!(u128::from(e.device.gradients), 4 * (dev + 3 * layer));
    assert_eq!(u128::from(e.host.grads_copy), 2 * layer);
    // Not where the optimizer is on the GPU, nor below stage 2: refused by the trainer's rules.
    for (stage, host_opt) in [(3u8, false), (1, true)] {
        (r.zero_stage, r.optimizer_on_host, r.optimizer_device_units) = (stage, host_opt, 0);
        let err = plan::estimate(&shape(), &r).unwrap_err().to_string();
        assert!(err.contains("train.offload_gradients"), "{err}");
    }

    let mut c = RunConfig::default();
    c.model.device = "cuda".into();
    c.model.dtype = "bf16".into();
    (c.train.zero_stage, c.train.offload_params, c.train.optimizer_on_host, c.train.offload_gradients) = (3, true, true, true);
    c.parallel.save_attention = true;
    c.parallel.offload_layer_inputs = true;
    c.train.batch_size = 1;
    c.stages = vec![Stage::new(64 * K, 1e6, 1)];
    let need = longctx::train::trainer::host_need(&c, &llama2_7b(), 1).unwrap();
    assert_eq!(u128::from(need.gradients), 4 * shard, "as plan counts it");
    // With 3 device units their slices are not counted on the host.
    c.train.optimizer_device_units = 3;
    let fewer = longctx::train::trainer::host_need(&c, &llama2_7b(), 1).unwrap();
    assert_eq!(u128::from(fewer.gradients), 4 * (shard - dev));
    c.train.optimizer_device_units = 0;
    let inputs = 32 * 65_536 * 4096 * 2u64;
    assert_eq!(need.total().unwrap(), inputs + need.gradients + need.optimizer + need.weights, "the start weights are gone by then");
    // With the layer inputs also on the host it outgrows a 128 GiB machine: the gradients are named.
    let e = longctx::limits::check_host_memory(&need, Some(128 << 30), Path::new("run.toml")).unwrap_err().to_string();
    assert!(e.contains("offloaded gradients 27.0 GB") && e.contains("train.offload_gradients = false"), "{e}");
    c.parallel.offload_layer_inputs = false;
    let need = longctx::train::trainer::host_need(&c, &llama2_7b(), 1).unwrap();
    longctx::limits::check_host_memory(&need, Some(128 << 30), Path::new("run.toml")).unwrap();
}

/// Launched ranks (`longctx launch`, one process each) check their node's host memory,
/// not their own: 7B, ZeRO-3 with weights, optimizer and gradients on the host, on 16
/// ranks, 8 processes a node. Each process loads its own f32 start weights (8 × 27 GB
/// until the first step); the optimizer state, the offloaded weights and the gradient
/// slices are per rank, so a node holds 8 of the 16 shards. In-process ranks share one
/// copy of the start weights.
#[test]
fn launched_ranks_check_their_nodes_host_memory() {
    use longctx::train::config::{RunConfig, Stage};
    use longctx::train::trainer::{host_need, host_need_on_node};
    let m = llama2_7b();
    let p = 6_738_415_616u64;
    let mut c = RunConfig::default();
    c.model.device = "cuda".into();
    c.model.dtype = "bf16".into();
    (c.train.zero_stage, c.train.offload_params, c.train.optimizer_on_host, c.train.offload_gradients) = (3, true, true, true);
    c.parallel.world_size = 16;
    c.train.batch_size = 1;
    c.stages = vec![Stage::new(64 * K, 1e6, 1)];
    let node = host_need_on_node(&c, &m, 8).unwrap();
    let rank = host_need(&c, &m, 1).unwrap();
    assert_eq!(node.start_weights, 8 * 4 * p, "each process its own start weights");
    assert_eq!(node.optimizer, 8 * (12 * p).div_ceil(16), "8 of the 16 shards");
    assert_eq!(node.weights, 8 * (2 * p).div_ceil(16));
    assert_eq!(node.gradients, 8 * rank.gradients);
    assert!(rank.gradients.abs_diff(4 * p / 16) <= 4 * 34, "a rank's slice: {}", rank.gradients);
    // 216 GB of start weights: more than a node of 128 GiB has, refused before any weight
    // is allocated; in one process the same ranks would share one copy.
    let e = longctx::limits::check_host_memory(&node, Some(128 << 30), Path::new("run.toml")).unwrap_err().to_string();
    assert!(e.contains("start weights 215.6 GB"), "{e}");
    let in_process = host_need(&c, &m, 8).unwrap();
    assert_eq!(in_process.start_weights, 4 * p);
    // One process on its own node, one rank in all: the same as in-process.
    c.parallel.world_size = 1;
    assert_eq!(host_need_on_node(&c, &m, 1).unwrap(), host_need(&c, &m, 1).unwrap());
    // ZeRO stage 0: every rank keeps the whole optimizer state.
    c.parallel.world_size = 16;
    (c.train.zero_stage, c.train.offload_params, c.train.offload_gradients) = (0, false, false);
    let node = host_need_on_node(&c, &m, 8).unwrap();
    assert_eq!((node.optimizer, node.weights, node.gradients), (8 * 12 * p, 0, 0));
    c.train.zero_stage = 1;
    assert_eq!(host_need_on_node(&c, &m, 8).unwrap().optimizer, 8 * (12 * p).div_ceil(16));
}
