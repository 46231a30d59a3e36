//! Export in the Hugging Face layout: round trip through our loader and through the
//! independent `safetensors` crate reader, sharding like transformers, index contents,
//! config fields, tokenizer files, and the atomic replace of an existing directory.
//!
//! Tolerance: bit-exact (0 ulp) everywhere — export writes the bytes of the requested
//! dtype and the loader reads them back; f32 -> bf16 is compared against candle's own
//! `to_dtype(BF16)` of the same values.

use std::collections::{BTreeMap, HashMap};
use std::path::Path;

use candle_core::{DType, Device, Tensor};
use longctx::hub::{self, Checkpoint, ExportOptions};

use crate::common;
use common::*;

fn ramp(shape: &[usize], seed: u32) -> Tensor {
    let n: usize = shape.iter().product();
    // Arbitrary f32 values (not bf16-representable) so dtype conversion is really exercised.
    let v: Vec<f32> = (0..n).map(|i| ((i as u32).wrapping_mul(2654435761u32) ^ seed) as f32 * 1.37e-9 - 2.9).collect();
    Tensor::from_vec(v, shape, &Device::Cpu).unwrap()
}

/// Tiny Llama-like state dict: 3 layers, names chosen so lexicographic and natural
/// order differ (layers.10 vs layers.2).
fn state_dict() -> Vec<(String, Tensor)> {
    let mut v = vec![
        ("model.embed_tokens.weight".to_string(), ramp(&[16, 8], 1)),
        ("lm_head.weight".to_string(), ramp(&[16, 8], 2)),
        ("model.norm.weight".to_string(), ramp(&[8], 3)),
    ];
    for l in [0, 2, 10] {
        v.push((format!("model.layers.{l}.self_attn.q_proj.weight"), ramp(&[8, 8], 10 + l)));
        v.push((format!("model.layers.{l}.input_layernorm.weight"), ramp(&[8], 20 + l)));
    }
    v
}

fn config() -> serde_json::Value {
    serde_json::json!({
        "architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 8,
        "rope_theta": 10000.0, "max_position_embeddings": 2048, "torch_dtype": "float32",
        "bos_token_id": 1
    })
}

fn read_json(p: &Path) -> serde_json::Value {
    serde_json::from_str(&std::fs::read_to_string(p).unwrap()).unwrap()
}

fn ls(dir: &Path) -> Vec<String> {
    let mut v: Vec<String> = std::fs::read_dir(dir).unwrap().map(|e| e.unwrap().file_name().into_string().unwrap()).collect();
    v.sort();
    v
}

#[test]
fn single_file_round_trip_f32_bit_exact() {
    let tmp = tempfile::tempdir().unwrap();
    let out = tmp.path().join("out");
    let sd = state_dict();
    let rep = hub::export(&out, &sd, &config(), None, &ExportOptions::default()).unwrap();
    assert_eq!(rep.weight_files, vec!["model.safetensors"]);
    assert_eq!(ls(&out), vec!["config.json", "model.safetensors"]);
    let want_total: u64 = sd.iter().map(|(_, t)| t.elem_count() as u64 * 4).sum();
    assert_eq!(rep.total_size, want_total);

    let loaded = hub::load_weights(&out, DType::F32, &Device::Cpu).unwrap();
    assert_eq!(loaded.len(), sd.len());
    for (n, t) in &sd {
        assert_same(&loaded[n], t, n);
    }
    // The independent reader agrees, and the metadata is what transformers requires.
    let bytes = std::fs::read(out.join("model.safetensors")).unwrap();
    let (_, meta) = safetensors::SafeTensors::read_metadata(&bytes).unwrap();
    assert_eq!(meta.metadata().as_ref().unwrap().get("format").map(String::as_str), Some("pt"));
    let st = safetensors::SafeTensors::deserialize(&bytes).unwrap();
    for (n, t) in &sd {
        let view = st.tensor(n).unwrap();
        assert_eq!(view.dtype(), safetensors::Dtype::F32);
        let got: Vec<u32> = view.data().chunks(4).map(|c| u32::from_le_bytes([c[0], c[1], c[2], c[3]])).collect();
        assert_eq!(got, bits(t), "{n} via safetensors crate");
    }
}

#[test]
fn bf16_export_matches_candle_conversion_and_sets_torch_dtype() {
    let tmp = tempfile::tempdir().unwrap();
    let out = tmp.path().join("out");
    let sd = state_dict();
    let opts = ExportOptions { dtype: Some(DType::BF16), ..Default::default() };
    hub::export(&out, &sd, &config(), None, &opts).unwrap();
    let ckpt = Checkpoint::open(&out).unwrap();
    assert_eq!(ckpt.info("lm_head.weight").unwrap().0, "BF16");
    let loaded = ckpt.load_all(DType::BF16, &Device::Cpu).unwrap();
    for (n, t) in &sd {
        assert_same(&loaded[n], &t.to_dtype(DType::BF16).unwrap(), n);
    }
    assert_eq!(read_json(&out.join("config.json"))["torch_dtype"], "bfloat16");
}

#[test]
fn sharding_follows_max_shard_bytes_and_index_is_complete() {
    let tmp = tempfile::tempdir().unwrap();
    let out = tmp.path().join("out");
    let sd = state_dict();
    // Sizes (f32): embed/lm_head 512 B, q_proj 256 B, norms 32 B; total 2*512 + 32 + 3*(256+32) = 1920 B.
    let opts = ExportOptions { max_shard_bytes: 600, dtype: None };
    let rep = hub::export(&out, &sd, &config(), None, &opts).unwrap();
    // Natural order: lm_head(512) | embed(512) | l0.ln(32) l0.q(256) l2.ln(32) l2.q(256) -> 576 |
    // l10.ln(32) l10.q(256) norm(32) -> 320.
    let n = rep.weight_files.len();
    assert_eq!(n, 4, "{:?}", rep.weight_files);
    for (i, f) in rep.weight_files.iter().enumerate() {
        assert_eq!(f, &format!("model-{:05}-of-00004.safetensors", i + 1));
    }
    let index = read_json(&out.join("model.safetensors.index.json"));
    assert_eq!(index["metadata"]["total_size"], 1920);
    let wm: BTreeMap<String, String> = serde_json::from_value(index["weight_map"].clone()).unwrap();
    assert_eq!(wm.len(), sd.len());
    assert_eq!(wm["lm_head.weight"], "model-00001-of-00004.safetensors");
    assert_eq!(wm["model.embed_tokens.weight"], "model-00002-of-00004.safetensors");
    assert_eq!(wm["model.layers.2.self_attn.q_proj.weight"], "model-00003-of-00004.safetensors");
    assert_eq!(wm["model.layers.10.self_attn.q_proj.weight"], "model-00004-of-00004.safetensors");
    assert_eq!(wm["model.norm.weight"], "model-00004-of-00004.safetensors");
    // Every shard holds exactly what the index says, within the size limit.
    for f in &rep.weight_files {
        let bytes = std::fs::read(out.join(f)).unwrap();
        let st = safetensors::SafeTensors::deserialize(&bytes).unwrap();
        let mut names: Vec<String> = st.names().into_iter().map(String::from).collect();
        names.sort();
        let mut want: Vec<String> = wm.iter().filter(|(_, s)| *s == f).map(|(k, _)| k.clone()).collect();
        want.sort();
        assert_eq!(names, want, "{f}");
        let data: usize = st.tensors().iter().map(|(_, v)| v.data().len()).sum();
        assert!(data <= 600, "{f} holds {data} bytes > max_shard_bytes");
    }
    assert!(!out.join("model.safetensors").exists());
    let loaded = hub::load_weights(&out, DType::F32, &Device::Cpu).unwrap();
    for (n, t) in &sd {
        assert_same(&loaded[n], t, n);
    }
}

#[test]
fn tensor_bigger_than_max_shard_goes_alone() {
    let tmp = tempfile::tempdir().unwrap();
    let out = tmp.path().join("out");
    let sd = vec![
        ("a.weight".to_string(), ramp(&[4], 1)),  // 16 B
        ("b.weight".to_string(), ramp(&[64], 2)), // 256 B > max
        ("c.weight".to_string(), ramp(&[4], 3)),  // 16 B
        ("d.weight".to_string(), ramp(&[4], 4)),  // 16 B
    ];
    let opts = ExportOptions { max_shard_bytes: 40, dtype: None };
    let rep = hub::export(&out, &sd, &config(), None, &opts).unwrap();
    assert_eq!(rep.weight_files.len(), 3);
    let wm = read_json(&out.join("model.safetensors.index.json"))["weight_map"].clone();
    assert_eq!(wm["a.weight"], "model-00001-of-00003.safetensors");
    assert_eq!(wm["b.weight"], "model-00002-of-00003.safetensors");
    assert_eq!(wm["c.weight"], "model-00003-of-00003.safetensors");
    assert_eq!(wm["d.weight"], "model-00003-of-00003.safetensors");
}

#[test]
fn context_fields_and_other_config_fields() {
    let tmp = tempfile::tempdir().unwrap();
    let out = tmp.path().join("out");
    let mut cfg = config();
    hub::set_context_fields(&mut cfg, 5_000_000.0, 1 << 20).unwrap();
    hub::export(&out, &state_dict(), &cfg, None, &ExportOptions::default()).unwrap();
    let got = read_json(&out.join("config.json"));
    assert_eq!(got["rope_theta"].as_f64(), Some(5_000_000.0));
    assert_eq!(got["max_position_embeddings"], 1 << 20);
    assert_eq!(got["architectures"][0], "LlamaForCausalLM");
    assert_eq!(got["bos_token_id"], 1);
    assert_eq!(got["torch_dtype"], "float32");
}

/// Every side file of the source directory travels with the weights (the tokenizer, an
/// instruct model's `chat_template.jinja`, files only a tokenizer class reads), and again
/// through a second export of the export; the source's weights, config, model card,
/// hidden files and subdirectories do not.
#[test]
fn tokenizer_chat_and_other_side_files_are_copied_and_survive_a_round_trip() {
    let tmp = tempfile::tempdir().unwrap();
    let src = tmp.path().join("src");
    std::fs::create_dir_all(src.join("original")).unwrap();
    let template = "{% for message in messages %}<|im_start|>{{ message['role'] }}\n{{ message['content'] }}<|im_end|>\n{% endfor %}";
    for (f, body) in [
        ("tokenizer.json", "{\"tok\": 1}"),
        ("tokenizer_config.json", "{\"cfg\": 2}"),
        ("special_tokens_map.json", "{\"sp\": 3}"),
        ("tokenizer.model", "sentencepiece bytes"),
        ("chat_template.jinja", template),
        ("vocab.json", "{\"a\": 0}"),
        ("merges.txt", "#version: 0.2"),
        ("generation_config.json", "{\"do_sample\": false}"),
        ("config.json", "{\"source\": true}"),
        ("model.safetensors", "source weights"),
        ("pytorch_model.bin", "source weights"),
        ("model.safetensors.index.json", "{}"),
        ("README.md", "card of the source model"),
        (".gitattributes", "*.bin filter=lfs"),
        ("original/consolidated.00.pth", "weights"),
    ] {
        std::fs::write(src.join(f), body).unwrap();
    }
    let out = tmp.path().join("out");
    hub::export(&out, &state_dict(), &config(), Some(&src), &ExportOptions::default()).unwrap();
    let want = vec![
        "chat_template.jinja",
        "config.json",
        "generation_config.json",
        "merges.txt",
        "model.safetensors",
        "special_tokens_map.json",
        "tokenizer.json",
        "tokenizer.model",
        "tokenizer_config.json",
        "vocab.json",
    ];
    assert_eq!(ls(&out), want);
    assert_eq!(std::fs::read_to_string(out.join("chat_template.jinja")).unwrap(), template);
    assert!(read_json(&out.join("config.json")).get("source").is_none(), "the export's own config.json, not the source's");
    // The export of an export keeps them all.
    let again = tmp.path().join("again");
    hub::ModelExport::from_model_dir(&out).unwrap().write(&again).unwrap();
    assert_eq!(ls(&again), want);
    for f in ["chat_template.jinja", "tokenizer.json", "vocab.json"] {
        assert_eq!(std::fs::read(again.join(f)).unwrap(), std::fs::read(src.join(f)).unwrap(), "{f}");
    }
}

#[test]
fn existing_directory_is_replaced_cleanly() {
    let tmp = tempfile::tempdir().unwrap();
    let out = tmp.path().join("ckpt");
    // An old sharded export plus a stray file: none of it may survive.
    let old = vec![("old.weight".to_string(), ramp(&[64], 9)), ("old2.weight".to_string(), ramp(&[64], 8))];
    hub::export(&out, &old, &config(), None, &ExportOptions { max_shard_bytes: 300, dtype: None }).unwrap();
    std::fs::write(out.join("stray.txt"), "x").unwrap();
    assert!(out.join("model.safetensors.index.json").exists());

    let sd = state_dict();
    hub::export(&out, &sd, &config(), None, &ExportOptions::default()).unwrap();
    assert_eq!(ls(&out), vec!["config.json", "model.safetensors"]);
    assert_eq!(ls(tmp.path()), vec!["ckpt"], "no temporary or old sibling left behind");
    let loaded = hub::load_weights(&out, DType::F32, &Device::Cpu).unwrap();
    assert_eq!(loaded.len(), sd.len());
}

#[test]
fn failing_export_leaves_old_checkpoint_intact() {
    let tmp = tempfile::tempdir().unwrap();
    let out = tmp.path().join("ckpt");
    let old = vec![("old.weight".to_string(), ramp(&[8], 9))];
    hub::export(&out, &old, &config(), None, &ExportOptions::default()).unwrap();
    let before = std::fs::read(out.join("model.safetensors")).unwrap();

    // The failure happens late: weights are already written when copying tokenizer.json
    // (a link to a file that is gone, as a hub cache's deleted blob) fails.
    let src = tmp.path().join("src");
    std::fs::create_dir_all(&src).unwrap();
    std::os::unix::fs::symlink(tmp.path().join("gone"), src.join("tokenizer.json")).unwrap();
    let err = hub::export(&out, &state_dict(), &config(), Some(&src), &ExportOptions::default());
    assert!(err.as_ref().is_err_and(|e| e.to_string().contains("tokenizer.json")), "{err:?}");
    assert_eq!(ls(tmp.path()), vec!["ckpt", "src"], "temporary directory removed");
    assert_eq!(ls(&out), vec!["config.json", "model.safetensors"]);
    assert_eq!(std::fs::read(out.join("model.safetensors")).unwrap(), before);

    // Errors found before writing (duplicate names) create nothing at a new path.
    let fresh = tmp.path().join("fresh");
    let dup = vec![("a".to_string(), ramp(&[2], 1)), ("a".to_string(), ramp(&[2], 2))];
    let err = hub::export(&fresh, &dup, &config(), None, &ExportOptions::default()).unwrap_err().to_string();
    assert!(err.contains("`a` appears twice"), "{err}");
    assert!(!fresh.exists());
}

#[test]
fn export_map_and_nested_new_path() {
    let tmp = tempfile::tempdir().unwrap();
    let out = tmp.path().join("a/b/c");
    let sd: HashMap<String, Tensor> = state_dict().into_iter().collect();
    hub::export_map(&out, &sd, &config(), None, &ExportOptions { max_shard_bytes: 1000, dtype: Some(DType::F16) }).unwrap();
    let loaded = hub::load_weights(&out, DType::F16, &Device::Cpu).unwrap();
    for (n, t) in &sd {
        assert_same(&loaded[n], &t.to_dtype(DType::F16).unwrap(), n);
    }
    assert_eq!(read_json(&out.join("config.json"))["torch_dtype"], "float16");
}

#[test]
fn context_fields_in_transformers5_rope_parameters_and_v4_rope_scaling() {
    use serde_json::json;
    // transformers >= 5: rope_theta lives in rope_parameters (which wins over the top level);
    // llama3 without original_max_position_embeddings gets the old length pinned.
    let mut v5 = json!({"max_position_embeddings": 8192, "dtype": "float32",
        "rope_parameters": {"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0}});
    hub::set_context_fields(&mut v5, 2e7, 65536).unwrap();
    hub::set_torch_dtype(&mut v5, DType::BF16).unwrap();
    assert_eq!(
        v5,
        json!({"max_position_embeddings": 65536, "dtype": "bfloat16",
            "rope_parameters": {"rope_type": "llama3", "rope_theta": 2e7, "factor": 8.0, "original_max_position_embeddings": 8192}})
    );
    // Per-layer-type rope_parameters: every dict is updated; an explicit original is kept.
    let mut nested = json!({"max_position_embeddings": 4096, "rope_parameters": {
        "full_attention": {"rope_type": "yarn", "rope_theta": 1e6, "factor": 4.0, "original_max_position_embeddings": 1024},
        "sliding_attention": {"rope_type": "default", "rope_theta": 1e4}}});
    hub::set_context_fields(&mut nested, 5e6, 16384).unwrap();
    assert_eq!(nested["rope_parameters"]["full_attention"]["rope_theta"].as_f64(), Some(5e6));
    assert_eq!(nested["rope_parameters"]["full_attention"]["original_max_position_embeddings"], 1024);
    assert_eq!(nested["rope_parameters"]["sliding_attention"]["rope_theta"].as_f64(), Some(5e6));
    assert!(nested.get("rope_theta").is_none());
    // transformers 4: top-level rope_theta, rope_scaling without a rope_theta of its own.
    let mut v4 = json!({"max_position_embeddings": 4096, "rope_theta": 10000.0, "torch_dtype": "float16",
        "rope_scaling": {"type": "yarn", "factor": 2.0}});
    hub::set_context_fields(&mut v4, 1e6, 32768).unwrap();
    hub::set_torch_dtype(&mut v4, DType::F32).unwrap();
    assert_eq!(
        v4,
        json!({"max_position_embeddings": 32768, "rope_theta": 1e6, "torch_dtype": "float32",
            "rope_scaling": {"type": "yarn", "factor": 2.0, "original_max_position_embeddings": 4096}})
    );
}

/// Export golden fixtures (made by transformers) through our loader + exporter, sharded,
/// once unchanged and with a new rope_theta / max_position_embeddings, and let
/// scripts/check_export_transformers.py load them with `AutoModelForCausalLM` and compare
/// logits (max abs difference <= 1e-5) with the fixture's reference / the same override
/// applied in Python. Skipped where python3 cannot import transformers and torch.
#[test]
fn transformers_loads_our_export_and_matches_reference_logits() {
    let has_python = std::process::Command::new("python3")
        .args(["-c", "import transformers, torch"])
        .output()
        .map(|o| o.status.success())
        .unwrap_or(false);
    if !has_python {
        println!("skipped: python transformers not available");
        return;
    }
    let root = Path::new(env!("CARGO_MANIFEST_DIR"));
    let fixture = |name: &str| root.join("tests/fixtures").join(name);
    // (fixture, new rope_theta and max_position_embeddings, or None for unchanged)
    let cases: [(&str, Option<(f64, usize)>); 3] =
        [("llama_mha", None), ("llama_mha", Some((123_456.0, 4096))), ("llama3_rope", Some((250_000.0, 8192)))];
    for (name, _) in &cases {
        if !fixture(name).join("reference.safetensors").is_file() {
            println!("skipped: tests/fixtures/{name} not present");
            return;
        }
    }
    let tmp = tempfile::tempdir().unwrap();
    let mut args = vec![root.join("scripts/check_export_transformers.py").display().to_string()];
    for (i, (name, change)) in cases.iter().enumerate() {
        let src = fixture(name);
        let weights = hub::load_weights(&src, DType::F32, &Device::Cpu).unwrap();
        let mut cfg = hub::read_config(&src).unwrap();
        if let Some((theta, max_pos)) = change {
            hub::set_context_fields(&mut cfg, *theta, *max_pos).unwrap();
        }
        let out = tmp.path().join(format!("{i}_{name}"));
        // Shards of a third of the weights: forces a sharded checkpoint with an index.
        let total: usize = weights.values().map(|t| t.elem_count() * 4).sum();
        let opts = ExportOptions { max_shard_bytes: (total / 3) as u64, dtype: Some(DType::F32) };
        let rep = hub::export_map(&out, &weights, &cfg, Some(&src), &opts).unwrap();
        assert!(
            rep.weight_files.len() >= 3,
            "expected a sharded export, got {:?} ({} tensors, {} bytes)",
            rep.weight_files,
            weights.len(),
            rep.total_size
        );
        let (theta, max_pos) = match change {
            Some((t, m)) => (t.to_string(), m.to_string()),
            None => ("same".to_string(), "same".to_string()),
        };
        args.extend(["--case".into(), out.display().to_string(), src.display().to_string(), theta, max_pos]);
    }
    let started = std::time::Instant::now();
    let run = std::process::Command::new("python3")
        .args(&args)
        .env("HF_HUB_OFFLINE", "1")
        .env("TRANSFORMERS_VERBOSITY", "error")
        .output()
        .unwrap();
    let stdout = String::from_utf8_lossy(&run.stdout);
    println!("{stdout}(python: {:.1} s)", started.elapsed().as_secs_f64());
    assert!(run.status.success(), "transformers check failed:\n{stdout}\n{}", String::from_utf8_lossy(&run.stderr));
}
