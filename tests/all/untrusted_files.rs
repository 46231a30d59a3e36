//! Issue #16 item 6, untrusted files: safetensors headers whose data ranges overlap,
//! alias, leave gaps or run past the file are refused (in header order or not, what is
//! valid is read); token ids in config.json that do not fit u32 are refused, not
//! truncated; a hub revision or ref file that could leave the cache folder (`..`, path
//! separators) is refused for models and datasets; a dataset directory with symlink
//! loops is read once. Also the regression tests of what the fuzz targets found
//! (`fuzz/`, see `docs/reliability.md`).

use longctx::data::source::resolve_local;
use longctx::hub::st_file::SafetensorsFile;
use longctx::hub::HubOptions;
use longctx::model::LlamaConfig;
use std::path::{Path, PathBuf};

/// A safetensors file: `tensors` as (name, dtype, shape, [start, end]) and `data_len`
/// bytes of data (values 0, 1, 2, ...).
fn st_file(dir: &Path, name: &str, tensors: &[(&str, &str, &[usize], [usize; 2])], data_len: usize) -> PathBuf {
    let mut header = serde_json::Map::new();
    for (n, dt, shape, off) in tensors {
        header.insert(n.to_string(), serde_json::json!({"dtype": dt, "shape": shape, "data_offsets": off}));
    }
    let h = serde_json::to_vec(&header).unwrap();
    let mut bytes = (h.len() as u64).to_le_bytes().to_vec();
    bytes.extend_from_slice(&h);
    bytes.extend((0..data_len).map(|i| i as u8));
    let p = dir.join(name);
    std::fs::write(&p, bytes).unwrap();
    p
}

#[test]
fn safetensors_data_ranges_must_tile_the_data_section() {
    let tmp = tempfile::tempdir().unwrap();
    let d = tmp.path();
    let f32x2: &[usize] = &[2];
    let bad = [
        ("overlap.safetensors", vec![("a", "F32", f32x2, [0, 8]), ("b", "F32", f32x2, [4, 12])], 12, "`b`"),
        ("alias.safetensors", vec![("a", "F32", f32x2, [0, 8]), ("b", "F32", f32x2, [0, 8])], 8, "offset"),
        ("gap.safetensors", vec![("a", "F32", f32x2, [0, 8]), ("b", "F32", f32x2, [12, 20])], 20, "offset"),
        ("past.safetensors", vec![("a", "F32", f32x2, [0, 8]), ("b", "F32", f32x2, [8, 16])], 12, "truncated"),
        ("size.safetensors", vec![("a", "F32", f32x2, [0, 12])], 12, "corrupt"),
    ];
    for (name, tensors, len, needle) in bad {
        let p = st_file(d, name, &tensors, len);
        let e = SafetensorsFile::open(&p).err().map(|e| e.to_string()).unwrap_or_else(|| panic!("{name} was accepted"));
        assert!(e.contains(name) && e.contains(needle), "{name}: {e}");
    }
    // Out of order in the header but tiling the data: valid, each tensor its own bytes.
    let p = st_file(d, "order.safetensors", &[("b", "U8", &[4], [4, 8]), ("a", "U8", &[4], [0, 4]), ("e", "U8", &[0], [8, 8])], 8);
    let f = SafetensorsFile::open(&p).unwrap();
    assert_eq!((f.bytes("a"), f.bytes("b"), f.bytes("e")), (Some(&[0u8, 1, 2, 3][..]), Some(&[4u8, 5, 6, 7][..]), Some(&[][..])));
}

/// A sharded index naming a shard outside the model directory is refused.
#[test]
fn index_shard_names_must_stay_in_the_model_directory() {
    let tmp = tempfile::tempdir().unwrap();
    let dir = tmp.path().join("m");
    std::fs::create_dir_all(&dir).unwrap();
    st_file(tmp.path(), "outside.safetensors", &[("w", "F32", &[2], [0, 8])], 8);
    for shard in ["../outside.safetensors", "/etc/passwd"] {
        let index = serde_json::json!({"weight_map": {"w": shard}});
        std::fs::write(dir.join("model.safetensors.index.json"), index.to_string()).unwrap();
        let e = longctx::hub::Checkpoint::open(&dir).err().map(|e| e.to_string()).unwrap_or_else(|| panic!("{shard} accepted"));
        assert!(e.contains(shard) && e.contains("must be a file name inside the model directory"), "{e}");
    }
}

fn llama(extra: serde_json::Value) -> longctx::Result<LlamaConfig> {
    let mut v = serde_json::json!({
        "model_type": "llama", "hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 1,
        "num_attention_heads": 4, "vocab_size": 100,
    });
    for (k, x) in extra.as_object().unwrap() {
        v[k] = x.clone();
    }
    LlamaConfig::from_value(Path::new("m/config.json"), v)
}

#[test]
fn token_ids_that_do_not_fit_u32_are_refused_not_truncated() {
    for (key, v, shown) in [
        ("eos_token_id", serde_json::json!(4294967296u64), "4294967296"),
        ("bos_token_id", serde_json::json!(-2), "-2"),
        ("eos_token_id", serde_json::json!([2, 8589934592u64]), "8589934592"),
        ("pad_token_id", serde_json::json!("x"), "\"x\""),
        ("eos_token_id", serde_json::json!(2.5), "2.5"),
    ] {
        let e = llama(serde_json::json!({ key: v })).err().map(|e| e.to_string()).unwrap_or_else(|| panic!("{key} = {v} accepted"));
        assert!(e.contains("m/config.json") && e.contains(key) && e.contains(shown) && e.contains("4294967295"), "{e}");
    }
    let c = llama(serde_json::json!({"eos_token_id": 4294967295u64, "pad_token_id": -1, "bos_token_id": null})).unwrap();
    assert_eq!(c.eos_token_id(), Some(u32::MAX));
    assert_eq!(llama(serde_json::json!({"eos_token_id": [2, 3]})).unwrap().eos_token_id(), None, "a list gives no single EOS");
}

/// A cache with `org/tiny` (model) and `org/set` (dataset) at one commit; refs/main as given.
fn cache(main_ref: &str) -> tempfile::TempDir {
    let cache = tempfile::tempdir().unwrap();
    let commit = "0123456789abcdef0123456789abcdef01234567";
    for (folder, file) in [("models--org--tiny", "config.json"), ("datasets--org--set", "a.jsonl")] {
        let repo = cache.path().join(folder);
        std::fs::create_dir_all(repo.join("refs")).unwrap();
        std::fs::create_dir_all(repo.join("snapshots").join(commit)).unwrap();
        std::fs::write(repo.join("refs/main"), main_ref).unwrap();
        std::fs::write(repo.join("snapshots").join(commit).join(file), "{}").unwrap();
    }
    cache
}

#[test]
fn hub_revisions_and_ref_files_that_leave_the_cache_are_refused() {
    let c = cache("0123456789abcdef0123456789abcdef01234567");
    let opts = HubOptions::offline_in(c.path());
    for rev in ["../../../etc", "..", "a/b", "a\\b"] {
        let e = longctx::hub::model_config(&format!("org/tiny@{rev}"), &opts, false).unwrap_err().to_string();
        assert!(e.contains("is not a revision name") && e.contains("revision"), "{rev}: {e}");
        let e = longctx::hub::resolve_model(&format!("org/tiny@{rev}"), &opts).unwrap_err().to_string();
        assert!(e.contains("is not a revision name"), "{rev}: {e}");
        let e = longctx::data::source::resolve(&format!("hf:org/set@{rev}"), None, None, &opts).unwrap_err().to_string();
        assert!(e.contains("is not a revision name"), "dataset {rev}: {e}");
    }
    let c = cache("../../../../tmp");
    let opts = HubOptions::offline_in(c.path());
    let e = longctx::hub::model_config("org/tiny", &opts, false).unwrap_err().to_string();
    assert!(e.contains("ref file content") && e.contains("refs/main") && e.contains("delete this ref file"), "{e}");
    let e = longctx::data::source::resolve("hf:org/set", None, None, &opts).unwrap_err().to_string();
    assert!(e.contains("ref file content"), "{e}");
}

#[test]
fn dataset_directories_with_symlink_loops_are_read_once() {
    let tmp = tempfile::tempdir().unwrap();
    let root = tmp.path().join("data");
    std::fs::create_dir_all(root.join("sub")).unwrap();
    std::fs::write(root.join("a.jsonl"), "{\"text\": \"x\"}\n").unwrap();
    std::fs::write(root.join("sub/b.jsonl"), "{\"text\": \"y\"}\n").unwrap();
    std::os::unix::fs::symlink("..", root.join("sub/up")).unwrap(); // sub/up -> data
    std::os::unix::fs::symlink(".", root.join("sub/self")).unwrap(); // sub/self -> sub
    std::os::unix::fs::symlink(&root, root.join("root")).unwrap(); // absolute, to the top
    let r = resolve_local(&root, None).unwrap();
    let names: Vec<String> = r.files.iter().map(|p| p.strip_prefix(&root).unwrap().display().to_string()).collect();
    assert_eq!(names, ["a.jsonl", "sub/b.jsonl"], "each file once, no path through a loop");
}

/// Regression inputs found by the fuzz targets (`tests/fixtures/fuzz/`): a JSON syntax
/// error inside `decoder` and a BPE merge the `tokenizers` crate panics on; parquet files
/// whose footer gives a negative column-chunk offset (the crate asserts) or whose pages
/// make its decoders panic. Each is now an error naming the file; nothing panics out.
#[test]
fn inputs_found_by_fuzzing_are_errors() {
    let fixtures = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/fuzz");
    for name in ["tokenizer-decoder-syntax.json", "tokenizer-bpe-merge.json"] {
        let dir = tempfile::tempdir().unwrap();
        std::fs::copy(fixtures.join(name), dir.path().join("tokenizer.json")).unwrap();
        let e = std::panic::catch_unwind(|| longctx::hub::load_tokenizer(dir.path())).unwrap_or_else(|_| panic!("{name}: panicked"));
        let e = e.err().map(|e| e.to_string()).unwrap_or_else(|| panic!("{name}: accepted"));
        assert!(e.contains("tokenizer.json") && e.contains("cannot parse the tokenizer"), "{name}: {e}");
    }
    for name in ["parquet-negative-chunk.parquet", "parquet-decoder.parquet", "parquet-bit-reader.parquet", "parquet-bit-unpack.parquet"] {
        let path: std::sync::Arc<Path> = fixtures.join(name).into();
        let read = || -> longctx::Result<usize> {
            let docs = longctx::data::parquet::ParquetDocs::open(path.clone(), None)?;
            docs.map(|d| d.map(|_| 1)).sum()
        };
        let e = std::panic::catch_unwind(read).unwrap_or_else(|_| panic!("{name}: panicked"));
        let e = e.err().map(|e| e.to_string()).unwrap_or_else(|| panic!("{name}: read without an error"));
        assert!(e.contains(name), "{name}: {e}");
    }
}
