//! Every way a checkpoint can be broken gives an error that names the file at fault and
//! says what to do. One test per failure; each asserts on the message text.

use std::path::Path;

use candle_core::{DType, Device, Tensor};
use longctx::hub::{self, HubOptions};

use crate::common;
use common::*;

fn t(n: usize) -> Tensor {
    Tensor::arange(0f32, n as f32, &Device::Cpu).unwrap()
}

fn load_err(dir: &Path) -> String {
    hub::load_weights(dir, DType::F32, &Device::Cpu).unwrap_err().to_string()
}

fn assert_mentions(msg: &str, parts: &[&str]) {
    for p in parts {
        assert!(msg.contains(p), "error message lacks `{p}`:\n{msg}");
    }
}

#[test]
fn missing_config_json() {
    let dir = tempfile::tempdir().unwrap();
    let err = hub::read_config(dir.path()).unwrap_err().to_string();
    let want = dir.path().join("config.json");
    assert_mentions(&err, &[want.to_str().unwrap(), "needs config.json"]);
}

#[test]
fn truncated_safetensors() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("model.safetensors");
    write_st(&path, &[("a", t(64)), ("b", t(64))]);
    let full = std::fs::metadata(&path).unwrap().len();
    let f = std::fs::OpenOptions::new().write(true).open(&path).unwrap();
    f.set_len(full - 100).unwrap();
    let err = load_err(dir.path());
    let numbers = format!("header says {full} bytes, file has {}", full - 100);
    assert_mentions(&err, &[path.to_str().unwrap(), "truncated", &numbers, "re-download"]);

    // Cut inside the header itself.
    f.set_len(20).unwrap();
    let err = load_err(dir.path());
    assert_mentions(&err, &[path.to_str().unwrap(), "truncated", "file has 20", "re-download"]);
}

#[test]
fn corrupt_header() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("model.safetensors");
    write_st(&path, &[("a", t(8))]);
    let mut bytes = std::fs::read(&path).unwrap();
    bytes[8..16].copy_from_slice(b"garbage!");
    std::fs::write(&path, &bytes).unwrap();
    let err = load_err(dir.path());
    assert_mentions(&err, &[path.to_str().unwrap(), "corrupt safetensors header", "re-download"]);

    // A length field that cannot be a header (random bytes, e.g. an HTML error page).
    std::fs::write(&path, b"<html><body>404 not found</body></html>").unwrap();
    let err = load_err(dir.path());
    assert_mentions(&err, &[path.to_str().unwrap(), "corrupt safetensors header", "header length"]);
}

/// A sharded checkpoint: `a` in shard 1, `b` in shard 2.
fn sharded(dir: &Path, write_shard2: bool, shard1_has_c: bool) {
    write_st(&dir.join("model-00001-of-00002.safetensors"), &[("a", t(4))]);
    if write_shard2 {
        write_st(&dir.join("model-00002-of-00002.safetensors"), &[("b", t(4))]);
    }
    let mut wm = serde_json::json!({"a": "model-00001-of-00002.safetensors", "b": "model-00002-of-00002.safetensors"});
    if shard1_has_c {
        wm["c"] = "model-00001-of-00002.safetensors".into();
    }
    let index = serde_json::json!({"metadata": {"total_size": 32}, "weight_map": wm});
    std::fs::write(dir.join("model.safetensors.index.json"), index.to_string()).unwrap();
}

#[test]
fn missing_shard_named_in_index() {
    let dir = tempfile::tempdir().unwrap();
    sharded(dir.path(), false, false);
    let err = load_err(dir.path());
    let index = dir.path().join("model.safetensors.index.json");
    assert_mentions(&err, &[index.to_str().unwrap(), "model-00002-of-00002.safetensors", "missing", "re-download"]);
}

#[test]
fn tensor_listed_in_index_missing_from_shard() {
    let dir = tempfile::tempdir().unwrap();
    sharded(dir.path(), true, true);
    let err = load_err(dir.path());
    let shard = dir.path().join("model-00001-of-00002.safetensors");
    assert_mentions(&err, &[shard.to_str().unwrap(), "`c`", "model.safetensors.index.json", "absent from this shard", "re-download"]);
}

#[test]
fn unsupported_dtype_is_named() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("model.safetensors");
    let ids = Tensor::new(&[1i64, 2, 3], &Device::Cpu).unwrap();
    write_st(&path, &[("w", t(4)), ("position_ids", ids)]);
    let err = load_err(dir.path());
    assert_mentions(&err, &[path.to_str().unwrap(), "`position_ids`", "I64", "floating-point"]);
}

#[test]
fn no_weights_in_directory() {
    let dir = tempfile::tempdir().unwrap();
    std::fs::write(dir.path().join("pytorch_model.bin"), b"x").unwrap();
    let err = load_err(dir.path());
    assert_mentions(&err, &[dir.path().to_str().unwrap(), "model.safetensors", "model.safetensors.index.json", "convert"]);
}

#[test]
fn missing_tokenizer() {
    let dir = tempfile::tempdir().unwrap();
    let err = hub::load_tokenizer(dir.path()).unwrap_err().to_string();
    let want = dir.path().join("tokenizer.json");
    assert_mentions(&err, &[want.to_str().unwrap(), "needs tokenizer.json"]);
    // With only the sentencepiece model, the message says how to convert it.
    std::fs::write(dir.path().join("tokenizer.model"), b"x").unwrap();
    let err = hub::load_tokenizer(dir.path()).unwrap_err().to_string();
    assert_mentions(&err, &["tokenizer.model", "save_pretrained"]);
}

#[test]
fn hub_id_not_in_offline_cache() {
    let cache = tempfile::tempdir().unwrap();
    let opts = HubOptions::offline_in(cache.path());
    let err = hub::resolve_model("org/absent", &opts).unwrap_err().to_string();
    assert_mentions(&err, &["org/absent", "models--org--absent", cache.path().to_str().unwrap(), "HF_HUB_OFFLINE", "download"]);

    // In the cache, but a file (the weights) was never downloaded.
    let hash = "89abcdef0123456789abcdef0123456789abcdef";
    let repo = cache.path().join("models--org--partial");
    std::fs::create_dir_all(repo.join("refs")).unwrap();
    std::fs::create_dir_all(repo.join("snapshots").join(hash)).unwrap();
    std::fs::write(repo.join("refs/main"), hash).unwrap();
    std::fs::write(repo.join("snapshots").join(hash).join("config.json"), "{}").unwrap();
    let err = hub::resolve_model("org/partial", &opts).unwrap_err().to_string();
    assert_mentions(&err, &["org/partial", "model.safetensors", hash, cache.path().to_str().unwrap(), "HF_HUB_OFFLINE"]);

    // A revision that was never fetched.
    let err = hub::resolve_model("org/partial@v2", &opts).unwrap_err().to_string();
    assert_mentions(&err, &["org/partial", "v2", "refs", cache.path().to_str().unwrap()]);
}

#[test]
fn local_path_that_does_not_exist() {
    let err = hub::resolve_model("./no/such/model/dir", &HubOptions::offline_in("/nonexistent")).unwrap_err().to_string();
    assert_mentions(&err, &["./no/such/model/dir", "not found", "org/name"]);
}

#[test]
fn weights_shape_mismatch_with_model_is_named() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("model.safetensors");
    write_st(&path, &[("w", t(6).reshape((2, 3)).unwrap())]);
    let vb = hub::Checkpoint::open(dir.path()).unwrap().var_builder(DType::F32, &Device::Cpu);
    let err = vb.get((3, 2), "w").unwrap_err().to_string();
    assert_mentions(&err, &[path.to_str().unwrap(), "`w`", "[2, 3]", "[3, 2]", "config.json"]);
}

#[test]
fn hub_unreachable_when_online() {
    // A port on loopback with nothing listening: connection refused at once.
    let port = std::net::TcpListener::bind("127.0.0.1:0").unwrap().local_addr().unwrap().port();
    let cache = tempfile::tempdir().unwrap();
    let mut opts = HubOptions::offline_in(cache.path());
    opts.offline = false;
    opts.endpoint = Some(format!("http://127.0.0.1:{port}"));
    let err = hub::resolve_model("org/tiny", &opts).unwrap_err().to_string();
    assert_mentions(&err, &["config.json", "org/tiny", "models--org--tiny", "HF_HUB_OFFLINE=1"]);
}
