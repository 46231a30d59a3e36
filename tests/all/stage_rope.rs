//! A stage's `rope = { type = .., .. }`: what it trains with, what the export writes into
//! config.json, and the errors for bad input.
//!
//! - A YaRN stage trained on the Qwen3 fixture (tests/fixtures/qwen3_tied: the whole
//!   pipeline, explicit layer backward through q/k norms) exports the weights under the
//!   checkpoint's names and a config.json whose `rope_parameters` say yarn, factor 4,
//!   original_max_position_embeddings 16 and the stage's θ; longctx's RoPE built from the
//!   exported config equals the one the stage trained with, bit for bit (inv_freq and
//!   attention factor).
//! - tests/fixtures/yarn_export: the config.json such a stage exported from llama_mha
//!   and transformers' RoPE for it (scripts/make_rope_fixtures.py): cos/sin within 1e-6
//!   absolute, inv_freq within 1 ulp-ish (2e-7 relative), attention factor to 1e-7.
//! - The v4 form (`rope_theta` + `rope_scaling`) is written back as `rope_scaling`.
//! - Qwen3 + YaRN trains to the same weights under ZeRO-3 as ZeRO-1 (1e-6 relative) and
//!   over two sequence-parallel ranks (zigzag ring, Ulysses) as on one (1e-5 relative).

use candle_core::{safetensors, DType, Device, Tensor};
use longctx::hub::export::ModelExport;
use longctx::model::{LlamaConfig, Rope, RopeScaling};
use longctx::train::config::{RunConfig, Stage, StageRope};
use longctx::train::export::RunProgress;
use longctx::train::trainer::run;
use serde_json::{json, Value};
use std::path::{Path, PathBuf};

fn fixture(name: &str) -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures").join(name)
}

fn yarn(factor: f64, original: usize) -> StageRope {
    StageRope { kind: "yarn".into(), factor: Some(factor), original_max_position_embeddings: Some(original), ..Default::default() }
}

/// `(inv_freq, attention factor)` of a config at `seq_len`.
fn freqs(cfg: &LlamaConfig, seq_len: usize) -> (Vec<f32>, f32) {
    Rope::new(cfg).inv_freq(seq_len)
}

#[test]
fn yarn_stage_trains_and_exports_what_it_trained() {
    let tmp = tempfile::tempdir().unwrap();
    let model_dir = fixture("qwen3_tied");
    let mut c = RunConfig { seed: 3, output_dir: tmp.path().to_path_buf(), ..RunConfig::default() };
    c.model.source = model_dir.to_string_lossy().into_owned();
    c.data.dataset = "synthetic:passkey".into();
    c.train.batch_size = 1;
    c.parallel.token_chunk = 32;
    c.stages = vec![Stage { rope: Some(yarn(4.0, 16)), ..Stage::new(64, 2e6, 2) }];
    c.validate(Path::new("<test>")).unwrap();
    let s = run(&c, false).unwrap();
    assert!(s.stage_losses.iter().all(|(_, a, b)| a.is_finite() && b.is_finite()), "{s:?}");

    let export = tmp.path().join("export");
    let written: Value = serde_json::from_str(&std::fs::read_to_string(export.join("config.json")).unwrap()).unwrap();
    let rp = &written["rope_parameters"];
    assert_eq!(rp["rope_type"], "yarn", "{written:#}");
    assert_eq!(rp["factor"].as_f64(), Some(4.0));
    assert_eq!(rp["original_max_position_embeddings"], json!(16), "an integer, as transformers writes it");
    assert_eq!(rp["rope_theta"].as_f64(), Some(2e6));
    assert!(written.get("rope_scaling").is_none_or(Value::is_null), "one RoPE dict: {written:#}");
    assert_eq!(written["model_type"], "qwen3");
    assert_eq!(written["max_position_embeddings"], json!(4096), "the model's own (larger than the stage's 64)");

    // Same tensor names as the checkpoint (q_norm/k_norm included, tied head absent).
    let names = |p: &Path| {
        let mut v: Vec<String> = safetensors::load(p, &Device::Cpu).unwrap().into_keys().collect();
        v.sort();
        v
    };
    assert_eq!(names(&export.join("model.safetensors")), names(&model_dir.join("model.safetensors")));

    // The RoPE transformers is told to build is the one the stage trained with.
    let model = LlamaConfig::from_file(model_dir.join("config.json")).unwrap();
    let trained = c.stages[0].model_config(&model, 0, Path::new("<test>")).unwrap();
    let exported = LlamaConfig::from_file(export.join("config.json")).unwrap();
    assert_eq!(exported.rope_scaling, trained.rope_scaling);
    for len in [16, 64, 1000] {
        assert_eq!(freqs(&exported, len), freqs(&trained, len), "seq_len {len}");
    }
    let (_, att) = freqs(&trained, 64);
    assert_eq!(att, (0.1 * 4f64.ln() + 1.0) as f32, "YaRN's attention factor 0.1·ln(factor) + 1");
}

/// The config.json a stage `rope = { type = "yarn", factor = 4,
/// original_max_position_embeddings = 256 }` at θ 5e5 and length 1024 exports from
/// tests/fixtures/llama_mha (plain RoPE).
fn yarn_export_config() -> Value {
    let run = RunConfig { stages: vec![Stage { rope: Some(yarn(4.0, 256)), ..Stage::new(1024, 5e5, 1) }], ..RunConfig::default() };
    let src: Value = serde_json::from_str(&std::fs::read_to_string(fixture("llama_mha").join("config.json")).unwrap()).unwrap();
    assert_eq!(src["rope_parameters"]["rope_type"], "default", "the stage adds YaRN");
    let e =
        ModelExport::new(Vec::new(), src, None).for_run(&run, RunProgress { stage: 1, stage_step: 0 }, 2048, Path::new("<test>")).unwrap();
    e.final_config().unwrap()
}

/// Writes tests/fixtures/yarn_export/config.json (then run scripts/make_rope_fixtures.py
/// for transformers' values): `cargo test --test all stage_rope:: -- --ignored`.
#[test]
#[ignore]
fn write_yarn_export_fixture() {
    let d = fixture("yarn_export");
    std::fs::create_dir_all(&d).unwrap();
    std::fs::write(d.join("config.json"), serde_json::to_string_pretty(&yarn_export_config()).unwrap() + "\n").unwrap();
}

/// Qwen3 under ZeRO-3 (weights gathered per layer through the engine's hooks, the
/// q/k norms among them) trains to the same weights as under ZeRO-1: the exports agree
/// within 1e-6 relative per tensor (f32 on the CPU; only summation order differs).
#[test]
fn qwen3_zero3_equals_zero1() {
    let (a, b) = (qwen3_export(1, None), qwen3_export(3, None));
    assert_eq!(a.len(), b.len());
    for (name, t) in &a {
        let e = longctx_attention::testing::rel_err(&b[name], t).unwrap();
        assert!(e <= 1e-6, "{name}: ZeRO-3 vs ZeRO-1 rel err {e:e}");
    }
}

/// Qwen3 with its sequence split over two ranks (zigzag ring, Ulysses: global positions
/// into the YaRN table, the q/k norms per token) trains to the weights of one rank.
#[test]
fn qwen3_sequence_parallel_equals_one_rank() {
    use longctx::train::config::ParallelMode;
    let one = qwen3_export(1, None);
    for mode in [ParallelMode::ZigzagRingAttn, ParallelMode::UlyssesAttn] {
        let two = qwen3_export(1, Some(mode));
        for (name, t) in &one {
            let e = longctx_attention::testing::rel_err(&two[name], t).unwrap();
            assert!(e <= 1e-5, "{mode:?}: {name}: rel err {e:e} against one rank");
        }
    }
}

/// The export of two YaRN steps on the Qwen3 fixture under ZeRO `zero`, on one rank or,
/// with `sp`, two sequence-parallel ranks.
fn qwen3_export(zero: u8, sp: Option<longctx::train::config::ParallelMode>) -> std::collections::HashMap<String, Tensor> {
    {
        let tmp = tempfile::tempdir().unwrap();
        let mut c = RunConfig { seed: 4, output_dir: tmp.path().to_path_buf(), ..RunConfig::default() };
        c.model.source = fixture("qwen3_tied").to_string_lossy().into_owned();
        c.data.dataset = "synthetic:passkey".into();
        c.train.batch_size = 1;
        c.train.zero_stage = zero;
        c.train.learning_rate = 1e-2; // weights that move visibly in two steps
        c.parallel.token_chunk = 16;
        c.stages = vec![Stage { rope: Some(yarn(2.0, 32)), ..Stage::new(64, 1e6, 2) }];
        if let Some(mode) = sp {
            c.parallel.mode = mode;
            c.parallel.world_size = 2;
        }
        c.validate(Path::new("<test>")).unwrap();
        run(&c, false).unwrap();
        safetensors::load(tmp.path().join("export/model.safetensors"), &Device::Cpu).unwrap()
    }
}

/// The export of a YaRN stage from llama_mha (the committed config.json) against
/// transformers' RoPE for that file.
#[test]
fn exported_yarn_config_gives_transformers_frequencies() {
    let d = fixture("yarn_export");
    let cfg = LlamaConfig::from_file(d.join("config.json")).unwrap();
    let r = safetensors::load(d.join("rope.safetensors"), &Device::Cpu).unwrap();
    let (inv, att) = Rope::new(&cfg).inv_freq(0);
    let want: Vec<f32> = r["inv_freq"].to_vec1().unwrap();
    for (i, (a, b)) in inv.iter().zip(&want).enumerate() {
        assert!((a - b).abs() <= 2e-7 * b.abs(), "inv_freq[{i}]: {a} vs {b}");
    }
    let want_att = r["attention_scaling"].to_scalar::<f32>().unwrap();
    assert!((att - want_att).abs() <= 1e-7, "attention factor {att} vs {want_att}");
    let pos = r["position_ids"].to_dtype(DType::U32).unwrap();
    let t = Rope::new(&cfg).table(&pos, None, DType::F32).unwrap();
    let err = |a: &Tensor, b: &Tensor| a.squeeze(2).unwrap().sub(b).unwrap().abs().unwrap().max_all().unwrap().to_scalar::<f32>().unwrap();
    let (ec, es) = (err(&t.cos, &r["cos"]), err(&t.sin, &r["sin"]));
    assert!(ec <= 1e-6 && es <= 1e-6, "cos err {ec:e}, sin err {es:e}");
    println!("yarn_export: cos/sin abs err {ec:.1e}/{es:.1e}");

    // And that file is what the exporter writes today for that stage.
    let now = yarn_export_config();
    let committed: Value = serde_json::from_str(&std::fs::read_to_string(d.join("config.json")).unwrap()).unwrap();
    assert_eq!(now["rope_parameters"], committed["rope_parameters"]);
    assert_eq!(now["max_position_embeddings"], committed["max_position_embeddings"]);
}

/// A v4 config (`rope_theta` + `rope_scaling: null`) gets its `rope_scaling` filled in;
/// a stage back to `default` on a scaled checkpoint writes it null; a dynamic stage
/// keeps its threshold as max_position_embeddings.
#[test]
fn export_writes_the_checkpoints_rope_key() {
    let v4 = json!({"model_type": "llama", "hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 1,
        "num_attention_heads": 2, "vocab_size": 64, "rope_theta": 10000.0, "rope_scaling": null,
        "max_position_embeddings": 4096});
    let export = |cfg: &Value, rope: StageRope, len: usize| {
        let run = RunConfig { stages: vec![Stage { rope: Some(rope), ..Stage::new(len, 5e5, 1) }], ..RunConfig::default() };
        let e = ModelExport::new(Vec::new(), cfg.clone(), None)
            .for_run(&run, RunProgress { stage: 1, stage_step: 0 }, 4096, Path::new("<test>"))
            .unwrap();
        e.final_config().unwrap()
    };
    let out = export(&v4, yarn(16.0, 4096), 65536);
    assert_eq!(out["rope_scaling"]["rope_type"], "yarn", "{out:#}");
    assert_eq!(out["rope_scaling"]["factor"].as_f64(), Some(16.0));
    assert_eq!(out["rope_theta"].as_f64(), Some(5e5));
    assert_eq!(out["max_position_embeddings"], json!(65536));
    let back = LlamaConfig::from_value("config.json", out).unwrap();
    assert!(matches!(back.rope_scaling, Some(RopeScaling::Yarn { factor, .. }) if factor == 16.0));

    let scaled = LlamaConfig::from_value("config.json", v4.clone()).unwrap().with_rope(1e4, back.rope_scaling.clone()).to_json_value();
    let out = export(&scaled, StageRope { kind: "default".into(), ..Default::default() }, 8192);
    assert!(out["rope_scaling"].is_null(), "{out:#}");

    // A top-level original_max_position_embeddings (Phi-3 style): transformers 5.24 reads
    // the dict's for a Llama (checked), so does longctx; the export keeps both equal to
    // the stage's.
    let mut top = v4.clone();
    top["original_max_position_embeddings"] = json!(2048);
    top["rope_scaling"] = json!({"rope_type": "yarn", "factor": 2.0, "original_max_position_embeddings": 1024});
    let read = LlamaConfig::from_value("config.json", top.clone()).unwrap();
    assert_eq!(read.rope_scaling.as_ref().and_then(RopeScaling::original_max_position_embeddings), Some(1024));
    let out = export(&top, yarn(16.0, 4096), 65536);
    assert_eq!(out["original_max_position_embeddings"], json!(4096));
    assert_eq!(out["rope_scaling"]["original_max_position_embeddings"], json!(4096));

    let dynamic =
        StageRope { kind: "dynamic".into(), factor: Some(2.0), original_max_position_embeddings: Some(2048), ..Default::default() };
    let out = export(&v4, dynamic, 8192);
    assert_eq!(out["rope_scaling"], json!({"rope_type": "dynamic", "factor": 2.0}));
    assert_eq!(out["max_position_embeddings"], json!(2048), "the length past which transformers grows the base");
}

/// The message of a run config (TOML) that `validate` or the model check refuses.
fn refused(stage_rope: &str, model: Option<&LlamaConfig>) -> String {
    let text = format!("[[stage]]\nseq_length = 1024\nrope_theta = 1e6\nsteps = 1\nrope = {stage_rope}\n");
    let path = Path::new("<test>");
    let c: RunConfig = match toml::from_str(&text) {
        Ok(c) => c,
        Err(e) => return e.to_string(),
    };
    let e = match (c.validate(path), model) {
        (Err(e), _) => e,
        (Ok(()), Some(m)) => c.check_stage_ropes(m, path).expect_err("refused"),
        (Ok(()), None) => panic!("accepted: {stage_rope}"),
    };
    e.to_string()
}

#[test]
fn bad_stage_rope_is_refused_naming_the_field() {
    let m = refused(r#"{ type = "ntk-by-parts", factor = 4.0 }"#, None);
    assert!(m.contains("stage[0].rope.type") && m.contains("ntk-by-parts") && m.contains("yarn, llama3, longrope"), "{m}");
    for rope in [
        r#"{ type = "linear", factor = 1.0 }"#,
        r#"{ type = "dynamic", factor = 0.5 }"#,
        r#"{ type = "yarn", factor = 1.0, original_max_position_embeddings = 4096 }"#,
        r#"{ type = "llama3", factor = 1.0, original_max_position_embeddings = 8192, low_freq_factor = 1.0, high_freq_factor = 4.0 }"#,
    ] {
        let m = refused(rope, None);
        assert!(m.contains("stage[0].rope.factor") && m.contains("> 1"), "{rope}: {m}");
    }
    let m = refused(
        r#"{ type = "longrope", factor = 0.5, original_max_position_embeddings = 256, short_factor = [1.0], long_factor = [1.0] }"#,
        None,
    );
    assert!(m.contains("stage[0].rope.factor") && m.contains(">= 1"), "{m}");
    let m = refused(r#"{ type = "yarn", factor = 4.0 }"#, None);
    assert!(m.contains("stage[0].rope.original_max_position_embeddings") && m.contains("missing"), "{m}");
    let m = refused(r#"{ type = "linear" }"#, None);
    assert!(m.contains("stage[0].rope.factor") && m.contains("missing"), "{m}");
    let m = refused(r#"{ type = "linear", factor = 4.0, beta_fast = 32.0 }"#, None);
    assert!(m.contains("stage[0].rope.beta_fast") && m.contains("takes factor"), "{m}");
    let m = refused(r#"{ type = "llama3", factor = 8.0, original_max_position_embeddings = 8192 }"#, None);
    assert!(m.contains("stage[0].rope.low_freq_factor"), "{m}");
    // Unknown keys are TOML errors naming the key.
    let m = refused(r#"{ type = "yarn", factr = 4.0 }"#, None);
    assert!(m.contains("factr"), "{m}");

    // LongRoPE lists must have head_dim/2 entries: checked against the model.
    let model = LlamaConfig::from_file(fixture("llama_longrope").join("config.json")).unwrap();
    let m = refused(
        r#"{ type = "longrope", original_max_position_embeddings = 256, short_factor = [1.0, 1.0], long_factor = [1.0, 2.0] }"#,
        Some(&model),
    );
    assert!(m.contains("stage[0].rope.short_factor") && m.contains("head_dim/2 = 8") && m.contains("has 2"), "{m}");
    let m = refused(r#"{ type = "longrope", original_max_position_embeddings = 256, short_factor = [1.0] }"#, None);
    assert!(m.contains("stage[0].rope.long_factor") && m.contains("missing"), "{m}");
    // A right-sized one is accepted and trains LongRoPE.
    let ok = RunConfig {
        stages: vec![Stage {
            rope: Some(StageRope {
                kind: "longrope".into(),
                original_max_position_embeddings: Some(256),
                short_factor: Some(vec![1.0; 8]),
                long_factor: Some(vec![2.0; 8]),
                ..Default::default()
            }),
            ..Stage::new(1024, 1e4, 1)
        }],
        ..RunConfig::default()
    };
    ok.check_stage_ropes(&model, Path::new("<test>")).unwrap();
    let trained = ok.stages[0].model_config(&model, 0, Path::new("<test>")).unwrap();
    match trained.rope_scaling {
        // factor from max_position_embeddings / original when not given: 1024 / 256.
        Some(RopeScaling::LongRope { factor, .. }) => assert_eq!(factor, 4.0),
        other => panic!("{other:?}"),
    }
}

/// A checkpoint of a family longctx does not implement is refused naming it and the
/// supported ones; a config.json LongRoPE list of the wrong length names the field.
#[test]
fn unsupported_family_and_bad_longrope_config() {
    let base = json!({"hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 1, "num_attention_heads": 2, "vocab_size": 64});
    let mut gemma2 = base.clone();
    gemma2["model_type"] = json!("gemma2");
    let m = LlamaConfig::from_value("config.json", gemma2).unwrap_err().to_string();
    assert!(m.contains("\"gemma2\"") && m.contains("gemma3_text") && m.contains("phi3") && m.contains("Qwen3ForCausalLM"), "{m}");
    let mut v = base;
    v["model_type"] = json!("llama");
    v["rope_scaling"] = json!({"rope_type": "longrope", "original_max_position_embeddings": 256,
        "short_factor": [1.0, 1.0, 1.0], "long_factor": vec![1.0f64; 8]});
    let m = LlamaConfig::from_value("config.json", v).unwrap_err().to_string();
    assert!(m.contains("rope_scaling.short_factor") && m.contains("head_dim/2 = 8"), "{m}");
}

/// `recipes/LongRoPE-128K-Phi-3-mini.toml` holds the factors its header derives: per stage of
/// scale s = length / 4096, factor_i = 1 / (g_i + (1 − g_i)/s), g_i the NTK-by-parts ramp
/// clamp((r_i − 1)/31, 0, 1) of r_i = 4096 · 10000^(−2i/96) / 2π rotations (4 significant
/// digits in the file); short factors all 1; 48 of each (Phi-3-mini's head dim 96 / 2).
#[test]
fn longrope_phi3_recipe_holds_the_factors_its_header_derives() {
    let path = Path::new(env!("CARGO_MANIFEST_DIR")).join("recipes/LongRoPE-128K-Phi-3-mini.toml");
    let c = RunConfig::from_file(&path).unwrap();
    c.validate(&path).unwrap();
    assert_eq!(c.stages.len(), 2);
    for st in &c.stages {
        let r = st.rope.as_ref().expect("a longrope stage");
        assert_eq!((r.kind.as_str(), r.original_max_position_embeddings), ("longrope", Some(4096)));
        let s = st.seq_length as f64 / 4096.0;
        assert_eq!(r.factor, Some(s), "factor = length / 4096");
        let short = r.short_factor.as_ref().unwrap();
        let long = r.long_factor.as_ref().unwrap();
        assert_eq!((short.len(), long.len()), (48, 48));
        assert!(short.iter().all(|&f| f == 1.0));
        for (i, &got) in long.iter().enumerate() {
            let rot = 4096.0 * 10000f64.powf(-2.0 * i as f64 / 96.0) / (2.0 * std::f64::consts::PI);
            let g = ((rot - 1.0) / 31.0).clamp(0.0, 1.0);
            let want = 1.0 / (g + (1.0 - g) / s);
            assert!((got - want).abs() <= 5e-4 * want, "stage {} factor {i}: {got} vs {want}", st.seq_length);
        }
    }
}
