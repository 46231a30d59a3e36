//! Loading checkpoints: single and sharded safetensors written by the `safetensors` crate
//! (an independent writer), dtype conversion, streaming VarBuilder, VarMap filling,
//! tokenizer, and model resolution through an on-disk Hugging Face hub cache.
//!
//! Tolerance: all comparisons are bit-exact (0 ulp). Test values are multiples of 1/4 in
//! [-2, 2], exactly representable in f32, f16 and bf16, so every conversion is exact.

use std::collections::HashMap;
use std::path::{Path, PathBuf};

use candle_core::{DType, Device, Tensor};
use longctx::hub::{self, Checkpoint, HubOptions, ModelSpec};

use crate::common;
use common::*;

/// Values exactly representable in f16 and bf16.
fn exact(shape: &[usize], seed: usize) -> Tensor {
    let n: usize = shape.iter().product();
    let v: Vec<f32> = (0..n).map(|i| (((i * 7 + seed * 3) % 17) as f32 - 8.0) * 0.25).collect();
    Tensor::from_vec(v, shape, &Device::Cpu).unwrap()
}

fn config_json() -> serde_json::Value {
    serde_json::json!({"architectures": ["LlamaForCausalLM"], "hidden_size": 4, "rope_theta": 10000.0})
}

fn originals() -> Vec<(&'static str, Tensor)> {
    vec![
        ("model.embed_tokens.weight", exact(&[8, 4], 1)),
        ("model.layers.0.self_attn.q_proj.weight", exact(&[4, 4], 2)),
        ("model.layers.1.mlp.up_proj.weight", exact(&[6, 4], 3)),
        ("model.norm.weight", exact(&[4], 4)),
    ]
}

#[test]
fn single_file_f32_loads_bit_exact() {
    let dir = tempfile::tempdir().unwrap();
    let orig = originals();
    write_st(&dir.path().join("model.safetensors"), &orig);
    let loaded = hub::load_weights(dir.path(), DType::F32, &Device::Cpu).unwrap();
    assert_eq!(loaded.len(), orig.len());
    for (name, t) in &orig {
        assert_same(&loaded[*name], t, name);
    }
}

#[test]
fn f16_and_bf16_on_disk_convert_to_f32() {
    for disk in [DType::F16, DType::BF16] {
        let dir = tempfile::tempdir().unwrap();
        let orig = originals();
        let on_disk: Vec<(&str, Tensor)> = orig.iter().map(|(n, t)| (*n, t.to_dtype(disk).unwrap())).collect();
        write_st(&dir.path().join("model.safetensors"), &on_disk);
        let ckpt = Checkpoint::open(dir.path()).unwrap();
        let want = if disk == DType::F16 { "F16" } else { "BF16" };
        assert_eq!(ckpt.info("model.norm.weight").unwrap().0, want);
        let loaded = ckpt.load_all(DType::F32, &Device::Cpu).unwrap();
        for (name, t) in &orig {
            assert_same(&loaded[*name], t, &format!("{disk:?} -> f32 {name}"));
        }
    }
}

#[test]
fn f32_on_disk_to_bf16_run_dtype() {
    let dir = tempfile::tempdir().unwrap();
    let orig = originals();
    write_st(&dir.path().join("model.safetensors"), &orig);
    let loaded = hub::load_weights(dir.path(), DType::BF16, &Device::Cpu).unwrap();
    for (name, t) in &orig {
        assert_same(&loaded[*name], &t.to_dtype(DType::BF16).unwrap(), name);
    }
}

/// Two shards and a hand-written index, as transformers writes them.
fn write_sharded(dir: &Path, orig: &[(&'static str, Tensor)], disk: DType) {
    let conv = |ts: &[(&'static str, Tensor)]| -> Vec<(&'static str, Tensor)> {
        ts.iter().map(|(n, t)| (*n, t.to_dtype(disk).unwrap())).collect()
    };
    write_st(&dir.join("model-00001-of-00002.safetensors"), &conv(&orig[..2]));
    write_st(&dir.join("model-00002-of-00002.safetensors"), &conv(&orig[2..]));
    let mut map = serde_json::Map::new();
    for (i, (n, _)) in orig.iter().enumerate() {
        let shard = if i < 2 { "model-00001-of-00002.safetensors" } else { "model-00002-of-00002.safetensors" };
        map.insert(n.to_string(), shard.into());
    }
    let index = serde_json::json!({"metadata": {"total_size": 0}, "weight_map": map});
    std::fs::write(dir.join("model.safetensors.index.json"), index.to_string()).unwrap();
}

#[test]
fn sharded_checkpoint_loads_all_tensors() {
    for disk in [DType::F32, DType::F16, DType::BF16] {
        let dir = tempfile::tempdir().unwrap();
        let orig = originals();
        write_sharded(dir.path(), &orig, disk);
        let ckpt = Checkpoint::open(dir.path()).unwrap();
        assert_eq!(ckpt.files().len(), 2);
        assert!(ckpt.index_file().is_some());
        let loaded = ckpt.load_all(DType::F32, &Device::Cpu).unwrap();
        assert_eq!(loaded.len(), orig.len());
        for (name, t) in &orig {
            assert_same(&loaded[*name], t, &format!("sharded {disk:?} {name}"));
        }
    }
}

#[test]
fn var_builder_streams_weights_and_checks_shapes() {
    let dir = tempfile::tempdir().unwrap();
    let orig = originals();
    write_sharded(dir.path(), &orig, DType::BF16);
    let vb = Checkpoint::open(dir.path()).unwrap().var_builder(DType::F32, &Device::Cpu);
    let q = vb.get((4, 4), "model.layers.0.self_attn.q_proj.weight").unwrap();
    assert_same(&q, &orig[1].1, "var_builder get");
    let q2 = vb.pp("model").pp("layers.0").get((4, 4), "self_attn.q_proj.weight").unwrap();
    assert_same(&q2, &orig[1].1, "var_builder prefixed get");
    assert!(vb.contains_tensor("model.norm.weight"));
    let err = vb.get((5, 4), "model.layers.0.self_attn.q_proj.weight").unwrap_err().to_string();
    assert!(err.contains("model-00001-of-00002.safetensors") && err.contains("[4, 4]") && err.contains("[5, 4]"), "{err}");
}

#[test]
fn load_into_varmap_makes_trainable_vars() {
    let dir = tempfile::tempdir().unwrap();
    let orig = originals();
    write_st(&dir.path().join("model.safetensors"), &orig);
    let varmap = candle_nn::VarMap::new();
    // A Var that already exists gets its value replaced, not duplicated.
    let vb = candle_nn::VarBuilder::from_varmap(&varmap, DType::F32, &Device::Cpu);
    let pre = vb.get_with_hints(4, "model.norm.weight", candle_nn::Init::Const(9.0)).unwrap();
    let n = hub::load_into_varmap(dir.path(), &varmap, DType::F32, &Device::Cpu).unwrap();
    assert_eq!(n, orig.len());
    assert_eq!(varmap.all_vars().len(), orig.len());
    assert_same(&pre, &orig[3].1, "existing var updated in place");
    let vb = candle_nn::VarBuilder::from_varmap(&varmap, DType::F32, &Device::Cpu);
    for (name, t) in &orig {
        let got = vb.get(t.dims(), name).unwrap();
        assert_same(&got, t, name);
    }
}

#[test]
fn tokenizer_json_loads_and_encodes() {
    let dir = tempfile::tempdir().unwrap();
    let tok = serde_json::json!({
        "version": "1.0", "truncation": null, "padding": null, "added_tokens": [],
        "normalizer": null, "pre_tokenizer": {"type": "Whitespace"}, "post_processor": null, "decoder": null,
        "model": {"type": "WordLevel", "vocab": {"hello": 0, "world": 1, "[UNK]": 2}, "unk_token": "[UNK]"}
    });
    std::fs::write(dir.path().join("tokenizer.json"), tok.to_string()).unwrap();
    let t = hub::load_tokenizer(dir.path()).unwrap();
    let enc = t.encode("hello world again", false).unwrap();
    assert_eq!(enc.get_ids(), &[0, 1, 2]);
}

const HASH: &str = "0123456789abcdef0123456789abcdef01234567";

/// Builds `<cache>/models--org--tiny` like huggingface_hub does: blobs, snapshot symlinks
/// into them, and `refs/main` holding the commit hash. Returns the snapshot dir.
fn build_cache(cache: &Path, sharded: bool) -> PathBuf {
    let repo = cache.join("models--org--tiny");
    let snap = repo.join("snapshots").join(HASH);
    let blobs = repo.join("blobs");
    std::fs::create_dir_all(&snap).unwrap();
    std::fs::create_dir_all(&blobs).unwrap();
    std::fs::create_dir_all(repo.join("refs")).unwrap();
    std::fs::write(repo.join("refs/main"), HASH).unwrap();
    // config.json as a blob + relative symlink, the way the real cache stores files.
    std::fs::write(blobs.join("cfgblob"), config_json().to_string()).unwrap();
    std::os::unix::fs::symlink("../../blobs/cfgblob", snap.join("config.json")).unwrap();
    if sharded {
        write_sharded(&snap, &originals(), DType::BF16);
    } else {
        write_st(&snap.join("model.safetensors"), &originals());
    }
    snap
}

#[test]
fn offline_hub_cache_resolves_main_commit_and_tag() {
    let cache = tempfile::tempdir().unwrap();
    let snap = build_cache(cache.path(), false);
    let opts = HubOptions::offline_in(cache.path());
    let r = hub::resolve_model("org/tiny", &opts).unwrap();
    assert_eq!(r.dir, snap);
    assert_eq!(r.hub, Some(("org/tiny".to_string(), HASH.to_string())));
    // An explicit commit hash needs no ref file.
    let r = hub::resolve_model(&format!("org/tiny@{HASH}"), &opts).unwrap();
    assert_eq!(r.dir, snap);
    // A tag through refs/<tag> (with a trailing newline, as some tools write it).
    std::fs::write(cache.path().join("models--org--tiny/refs/v1"), format!("{HASH}\n")).unwrap();
    let r = hub::resolve_model("org/tiny@v1", &opts).unwrap();
    assert_eq!(r.dir, snap);
    // And the resolved directory is a loadable model.
    let cfg = hub::read_config(&r.dir).unwrap();
    assert_eq!(cfg["hidden_size"], 4);
    let w = hub::load_weights(&r.dir, DType::F32, &Device::Cpu).unwrap();
    assert_same(&w["model.norm.weight"], &originals()[3].1, "weights from cache");
}

#[test]
fn offline_hub_cache_sharded() {
    let cache = tempfile::tempdir().unwrap();
    let snap = build_cache(cache.path(), true);
    let r = hub::resolve_model("org/tiny", &HubOptions::offline_in(cache.path())).unwrap();
    assert_eq!(r.dir, snap);
    let w = hub::load_weights(&r.dir, DType::F32, &Device::Cpu).unwrap();
    assert_eq!(w.len(), 4);
}

#[test]
fn local_directory_wins_over_hub_id() {
    let dir = tempfile::tempdir().unwrap();
    let r = hub::resolve_model(dir.path().to_str().unwrap(), &HubOptions::offline_in("/nonexistent")).unwrap();
    assert_eq!(r.dir, dir.path());
    assert!(r.hub.is_none());
}

#[test]
fn model_spec_parsing() {
    let hubid = |id: &str, rev: &str| ModelSpec::Hub { repo_id: id.into(), revision: rev.into() };
    assert_eq!(ModelSpec::parse("meta-llama/Llama-2-7b-hf"), hubid("meta-llama/Llama-2-7b-hf", "main"));
    assert_eq!(ModelSpec::parse("org/name@v1.0"), hubid("org/name", "v1.0"));
    assert_eq!(ModelSpec::parse("gpt2"), hubid("gpt2", "main"));
    assert_eq!(ModelSpec::parse("./no/such/dir"), ModelSpec::Local("./no/such/dir".into()));
    assert_eq!(ModelSpec::parse("/abs/path"), ModelSpec::Local("/abs/path".into()));
    assert_eq!(ModelSpec::parse("a/b/c"), ModelSpec::Local("a/b/c".into()));
}

#[test]
fn cache_dir_precedence_matches_huggingface_hub() {
    let home = Some(PathBuf::from("/home/u"));
    let opts = |vars: &[(&str, &str)]| {
        let m: HashMap<String, String> = vars.iter().map(|(k, v)| (k.to_string(), v.to_string())).collect();
        HubOptions::from_vars(|k| m.get(k).cloned(), home.clone())
    };
    assert_eq!(opts(&[]).cache_dir, PathBuf::from("/home/u/.cache/huggingface/hub"));
    assert_eq!(opts(&[("XDG_CACHE_HOME", "/x")]).cache_dir, PathBuf::from("/x/huggingface/hub"));
    assert_eq!(opts(&[("HF_HOME", "/h"), ("XDG_CACHE_HOME", "/x")]).cache_dir, PathBuf::from("/h/hub"));
    assert_eq!(opts(&[("HF_HOME", "~/hf")]).cache_dir, PathBuf::from("/home/u/hf/hub"));
    assert_eq!(opts(&[("HUGGINGFACE_HUB_CACHE", "/legacy"), ("HF_HOME", "/h")]).cache_dir, PathBuf::from("/legacy"));
    assert_eq!(opts(&[("HF_HUB_CACHE", "/c"), ("HUGGINGFACE_HUB_CACHE", "/legacy"), ("HF_HOME", "/h")]).cache_dir, PathBuf::from("/c"));
    // An empty variable counts as unset.
    assert_eq!(opts(&[("HF_HUB_CACHE", "")]).cache_dir, PathBuf::from("/home/u/.cache/huggingface/hub"));
    for (v, want) in [("1", true), ("ON", true), ("yes", true), ("True", true), ("0", false), ("false", false)] {
        assert_eq!(opts(&[("HF_HUB_OFFLINE", v)]).offline, want, "HF_HUB_OFFLINE={v}");
    }
    assert!(opts(&[("TRANSFORMERS_OFFLINE", "1")]).offline);
    assert!(!opts(&[]).offline);
    assert_eq!(opts(&[("HF_TOKEN", "hf_abc")]).token.as_deref(), Some("hf_abc"));
}

/// The one test that reads the real process environment. Env vars are process-global and
/// every integration test shares this process, so the checks run in a child: this test
/// binary again, filtered to this one test, with the variables set on its command (the
/// parent's environment is never changed).
#[test]
fn env_vars_select_cache_and_offline_mode() {
    const CHILD: &str = "LONGCTX_TEST_HUB_ENV_CHILD";
    if std::env::var_os(CHILD).is_none() {
        let cache = tempfile::tempdir().unwrap();
        // `all::hub_load` → the test's name as the harness knows it.
        let module = module_path!().split_once("::").map_or(module_path!(), |(_, m)| m);
        let name = format!("{module}::env_vars_select_cache_and_offline_mode");
        let o = std::process::Command::new(std::env::current_exe().unwrap())
            .args([name.as_str(), "--exact", "--test-threads=1", "--nocapture"])
            .env(CHILD, "1")
            .env("HF_HUB_CACHE", cache.path())
            .env("HF_HUB_OFFLINE", "1")
            .output()
            .unwrap();
        let (out, err) = (String::from_utf8_lossy(&o.stdout), String::from_utf8_lossy(&o.stderr));
        // "1 passed": the filter found the test, so the child checked something.
        assert!(o.status.success() && out.contains(" 1 passed;"), "the test in a child process:\n{out}\n{err}");
        return;
    }
    // The child: HF_HUB_CACHE and HF_HUB_OFFLINE as the parent set them.
    let cache = PathBuf::from(std::env::var_os("HF_HUB_CACHE").unwrap());
    let snap = build_cache(&cache, false);
    let opts = HubOptions::from_env();
    let resolved = hub::resolve_model("org/tiny", &opts);
    let missing = hub::resolve_model("org/absent", &opts);
    assert!(opts.offline);
    assert_eq!(opts.cache_dir, cache);
    assert_eq!(resolved.unwrap().dir, snap);
    let err = missing.unwrap_err().to_string();
    assert!(err.contains("org/absent") && err.contains(cache.to_str().unwrap()), "{err}");
}

/// A minimal stand-in for the hub's `resolve` endpoint on 127.0.0.1, speaking the part of
/// the protocol hf-hub uses: `GET /{repo}/resolve/{rev}/{file}` with `Range: bytes=N-`,
/// answered 206 with `x-repo-commit`, `etag`, `content-range`; 404 for unknown files.
/// It serves until `stop` is set or 60 s pass, one request per connection.
struct FakeHub {
    addr: std::net::SocketAddr,
    stop: std::sync::Arc<std::sync::atomic::AtomicBool>,
    requests: std::sync::Arc<std::sync::Mutex<Vec<String>>>,
    thread: Option<std::thread::JoinHandle<()>>,
}

impl FakeHub {
    fn start(files: HashMap<String, Vec<u8>>) -> Self {
        use std::io::{Read, Write};
        use std::sync::atomic::Ordering;
        let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        listener.set_nonblocking(true).unwrap();
        let addr = listener.local_addr().unwrap();
        let stop = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
        let requests = std::sync::Arc::new(std::sync::Mutex::new(Vec::new()));
        let (stop2, req2) = (stop.clone(), requests.clone());
        let thread = std::thread::spawn(move || {
            let deadline = std::time::Instant::now() + std::time::Duration::from_secs(60);
            while !stop2.load(Ordering::Relaxed) && std::time::Instant::now() < deadline {
                let Ok((mut conn, _)) = listener.accept() else {
                    std::thread::sleep(std::time::Duration::from_millis(2));
                    continue;
                };
                conn.set_nonblocking(false).unwrap();
                conn.set_read_timeout(Some(std::time::Duration::from_secs(5))).unwrap();
                let mut head = Vec::new();
                let mut buf = [0u8; 1024];
                while !head.windows(4).any(|w| w == b"\r\n\r\n") {
                    match conn.read(&mut buf) {
                        Ok(0) | Err(_) => break,
                        Ok(n) => head.extend_from_slice(&buf[..n]),
                    }
                }
                let head = String::from_utf8_lossy(&head).to_string();
                let path = head.split_whitespace().nth(1).unwrap_or("").to_string();
                let start: usize = head
                    .lines()
                    .find_map(|l| l.to_ascii_lowercase().strip_prefix("range: bytes=").map(|r| r.to_string()))
                    .and_then(|r| r.split('-').next().and_then(|s| s.trim().parse().ok()))
                    .unwrap_or(0);
                req2.lock().unwrap().push(path.clone());
                let file = path.strip_prefix("/org/tiny/resolve/main/").and_then(|f| files.get(f));
                let resp = match file {
                    Some(body) => {
                        let one = head.to_ascii_lowercase().contains("range: bytes=0-0");
                        let end = if one { 1 } else { body.len() };
                        let part = &body[start.min(body.len())..end];
                        let mut r = format!(
                            "HTTP/1.1 206 Partial Content\r\nx-repo-commit: {HASH}\r\netag: \"e{}\"\r\ncontent-range: bytes {start}-{}/{}\r\ncontent-length: {}\r\nconnection: close\r\n\r\n",
                            path.len() * 31 + body.len(),
                            end.saturating_sub(1),
                            body.len(),
                            part.len()
                        )
                        .into_bytes();
                        r.extend_from_slice(part);
                        r
                    }
                    None => b"HTTP/1.1 404 Not Found\r\ncontent-length: 0\r\nconnection: close\r\n\r\n".to_vec(),
                };
                let _ = conn.write_all(&resp);
            }
        });
        Self { addr, stop, requests, thread: Some(thread) }
    }
}

impl Drop for FakeHub {
    fn drop(&mut self) {
        self.stop.store(true, std::sync::atomic::Ordering::Relaxed);
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }
}

#[test]
fn online_download_through_hf_hub_fills_the_cache() {
    // A sharded model with a tokenizer.json but no other tokenizer files on the "hub".
    let src = tempfile::tempdir().unwrap();
    write_sharded(src.path(), &originals(), DType::BF16);
    let mut files = HashMap::new();
    for f in ["model.safetensors.index.json", "model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors"] {
        files.insert(f.to_string(), std::fs::read(src.path().join(f)).unwrap());
    }
    files.insert("config.json".to_string(), config_json().to_string().into_bytes());
    files.insert("tokenizer.json".to_string(), b"{}".to_vec());
    let server = FakeHub::start(files);

    let cache = tempfile::tempdir().unwrap();
    let mut opts = HubOptions::offline_in(cache.path());
    opts.offline = false;
    opts.endpoint = Some(format!("http://{}", server.addr));
    let r = hub::resolve_model("org/tiny", &opts).unwrap();
    let snap = cache.path().join("models--org--tiny/snapshots").join(HASH);
    assert_eq!(r.dir, snap);
    let w = hub::load_weights(&r.dir, DType::F32, &Device::Cpu).unwrap();
    for (name, t) in &originals() {
        assert_same(&w[*name], t, name);
    }
    assert!(snap.join("tokenizer.json").is_file());
    // Files the hub lacks are remembered under .no_exist, like huggingface_hub does.
    assert!(cache.path().join("models--org--tiny/.no_exist").join(HASH).join("tokenizer.model").exists());
    assert!(cache.path().join("models--org--tiny/.no_exist").join(HASH).join("model.safetensors").exists());

    // Second resolution is served from the cache: no request at all.
    let before = server.requests.lock().unwrap().len();
    let again = hub::resolve_model("org/tiny", &opts).unwrap();
    assert_eq!(again.dir, snap);
    assert_eq!(server.requests.lock().unwrap().len(), before, "cached model must not hit the network");
    // And the same cache now works offline.
    assert_eq!(hub::resolve_model("org/tiny", &HubOptions::offline_in(cache.path())).unwrap().dir, snap);
}
