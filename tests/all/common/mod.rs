//! Helpers shared by the integration tests: a small test model, token batches, bit-exact
//! tensor comparison, a safetensors writer independent of ours, an offline hub.
#![allow(dead_code)]

pub mod fixture;

use candle_core::{Device, Tensor};
use longctx::model::{LlamaConfig, IGNORE_INDEX};
use std::path::Path;

/// The test model (2 layers, 4/2 heads × 8, vocab 61); `dynamic_rope`: dynamic NTK RoPE
/// with max_position_embeddings 16, so the rotary base depends on the global length.
pub fn small_config(dynamic_rope: bool) -> LlamaConfig {
    let mut json = serde_json::json!({
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "hidden_size": 32,
        "intermediate_size": 48,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": 8,
        "rms_norm_eps": 1e-5,
        "rope_theta": 10000.0,
        "max_position_embeddings": 64,
        "vocab_size": 61,
        "tie_word_embeddings": false,
        "initializer_range": 0.2,
    });
    if dynamic_rope {
        json["max_position_embeddings"] = 16.into();
        json["rope_scaling"] = serde_json::json!({"rope_type": "dynamic", "factor": 2.0});
    }
    match LlamaConfig::from_value(Path::new("test/config.json"), json) {
        Ok(c) => c,
        Err(e) => panic!("test config: {e}"),
    }
}

/// `ids [b, s]` u32 and shifted targets `[b, s]` i64 from a xorshift stream seeded by
/// `seed`; `masked(row, t)` → ignored target.
pub fn token_batch(
    b: usize,
    s: usize,
    vocab: usize,
    seed: u64,
    masked: impl Fn(usize, usize) -> bool,
) -> longctx::Result<(Tensor, Tensor)> {
    let mut state = seed | 1;
    let mut raw = Vec::new();
    for _ in 0..b * (s + 1) {
        state ^= state << 13;
        state ^= state >> 7;
        state ^= state << 17;
        raw.push((state % vocab as u64) as u32);
    }
    let (mut x, mut y) = (Vec::new(), Vec::new());
    for r in 0..b {
        for t in 0..s {
            x.push(raw[r * (s + 1) + t]);
            y.push(if masked(r, t) { IGNORE_INDEX } else { raw[r * (s + 1) + t + 1] as i64 });
        }
    }
    Ok((Tensor::from_vec(x, (b, s), &Device::Cpu)?, Tensor::from_vec(y, (b, s), &Device::Cpu)?))
}

/// `max|got − want| / max|want|` (the absolute difference when `want` is all zeros; a NaN
/// gives infinity): the attention crate's one definition.
pub fn rel_err(got: &Tensor, want: &Tensor) -> longctx::Result<f64> {
    Ok(longctx_attention::testing::rel_err(got, want)?)
}

/// The f32 bit patterns of a tensor's values.
pub fn bits(t: &Tensor) -> Vec<u32> {
    t.to_dtype(candle_core::DType::F32).unwrap().flatten_all().unwrap().to_vec1::<f32>().unwrap().iter().map(|x| x.to_bits()).collect()
}

/// Same shape, dtype and bits.
pub fn assert_same(a: &Tensor, b: &Tensor, what: &str) {
    assert_eq!(a.dims(), b.dims(), "{what}: shape");
    assert_eq!(a.dtype(), b.dtype(), "{what}: dtype");
    assert_eq!(bits(a), bits(b), "{what}: values differ (bit-exact expected)");
}

/// Writes a safetensors file with the `safetensors` crate (not our exporter).
pub fn write_st(path: &Path, tensors: &[(&str, Tensor)]) {
    let meta = std::collections::HashMap::from([("format".to_string(), "pt".to_string())]);
    let items: Vec<(&str, &Tensor)> = tensors.iter().map(|(n, t)| (*n, t)).collect();
    safetensors::serialize_to_file(items, Some(meta), path).unwrap();
}

/// Hub options that never touch the network or a real cache.
pub fn offline_hub() -> longctx::hub::HubOptions {
    longctx::hub::HubOptions::offline_in("/nonexistent-hf-cache")
}

/// The repository root: the CLI tests run the binary from here.
pub fn repo_root() -> &'static Path {
    Path::new(env!("CARGO_MANIFEST_DIR"))
}

/// The `longctx` binary (the dev build) with `args`, run from the repository root,
/// outside any launcher (the rank variables removed) and offline.
pub fn longctx_cmd(args: &[&str]) -> std::process::Command {
    let mut c = std::process::Command::new(env!("CARGO_BIN_EXE_longctx"));
    c.args(args).current_dir(repo_root()).env("HF_HUB_OFFLINE", "1");
    for k in ["RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "SLURM_PROCID", "SLURM_NTASKS"] {
        c.env_remove(k);
    }
    c
}

/// What a run of the binary gave.
pub struct Out {
    pub code: i32,
    pub stdout: String,
    pub stderr: String,
}

pub fn run_cmd(mut c: std::process::Command) -> Out {
    let o = c.output().expect("cannot run the longctx binary");
    Out {
        code: o.status.code().unwrap_or(-1),
        stdout: String::from_utf8_lossy(&o.stdout).into_owned(),
        stderr: String::from_utf8_lossy(&o.stderr).into_owned(),
    }
}

/// `longctx ARGS`.
pub fn run(args: &[&str]) -> Out {
    run_cmd(longctx_cmd(args))
}

/// `longctx ARGS`, which must exit 0.
pub fn ok(args: &[&str]) -> Out {
    let o = run(args);
    assert_eq!(o.code, 0, "longctx {args:?} failed:\n{}", o.stderr);
    o
}

/// Exit status 1, exactly one `error:` line, containing every needle; no panic. With
/// `alone`, that line is all of stderr (nothing else was printed).
pub fn fails(o: &Out, needles: &[&str], alone: bool) -> String {
    assert_eq!(o.code, 1, "expected exit status 1, got {}; stderr:\n{}", o.code, o.stderr);
    let errs: Vec<&str> = o.stderr.lines().filter(|l| l.starts_with("error:")).collect();
    assert_eq!(errs.len(), 1, "expected one error line:\n{}", o.stderr);
    for n in needles {
        assert!(errs[0].contains(n), "error line lacks `{n}`: {}", errs[0]);
    }
    if alone {
        assert_eq!(o.stderr.trim_end(), errs[0], "more than the error line on stderr");
    }
    assert!(!o.stderr.contains("panicked") && !o.stderr.contains("backtrace"), "{}", o.stderr);
    errs[0].to_string()
}
