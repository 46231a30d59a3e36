//! Fuzz target bodies: each takes arbitrary bytes as the content of one file longctx reads
//! from an untrusted source and drives the library's own entry point over it. A body
//! must never panic, abort or hang: malformed input is an `Err` (ignored here). The
//! libFuzzer targets (`fuzz_targets/`) and the stable runner (`src/bin/smoke.rs`) call
//! these; [`TARGETS`] lists them with valid seed inputs.

use candle_core::{DType, Device};
use longctx::data::loader::{DataSpec, FilesConfig, Loader, Shard};
use std::cell::RefCell;
use std::path::{Path, PathBuf};

/// A fuzz target: name, body, seed inputs.
pub struct Target {
    pub name: &'static str,
    pub run: fn(&[u8]),
    pub seeds: fn() -> Vec<Vec<u8>>,
}

pub const TARGETS: &[Target] = &[
    Target { name: "safetensors_header", run: safetensors_header, seeds: seeds::safetensors },
    Target { name: "safetensors_index", run: safetensors_index, seeds: seeds::index },
    Target { name: "config_json", run: config_json, seeds: seeds::config },
    Target { name: "tokenizer_json", run: tokenizer_json, seeds: seeds::tokenizer },
    Target { name: "dataset_jsonl", run: dataset_jsonl, seeds: seeds::jsonl },
    Target { name: "dataset_text", run: dataset_text, seeds: seeds::text },
    Target { name: "dataset_parquet", run: dataset_parquet, seeds: seeds::parquet },
    Target { name: "dataset_tokens", run: dataset_tokens, seeds: seeds::tokens },
    Target { name: "dataset_arrow", run: dataset_arrow, seeds: seeds::arrow },
    Target { name: "dataset_jsonl_compressed", run: dataset_jsonl_compressed, seeds: seeds::jsonl_compressed },
    Target { name: "checkpoint_state", run: checkpoint_state, seeds: seeds::state },
];

/// libfuzzer-sys aborts on every panic, even one longctx catches and turns into an error
/// (the `tokenizers` and `parquet` crates panic on some malformed files; longctx catches
/// those). Called first by each libFuzzer target: panics are printed, not fatal, so only
/// a panic that escapes the target body (caught by libfuzzer-sys, which then aborts) is a
/// crash. The stable runner counts the caught ones itself.
pub fn keep_caught_panics() {
    static ONCE: std::sync::Once = std::sync::Once::new();
    ONCE.call_once(|| std::panic::set_hook(Box::new(|info| eprintln!("{info}"))));
}

thread_local! {
    /// One scratch directory per thread, reused by every input (emptied first).
    static SCRATCH: RefCell<Option<tempfile::TempDir>> = const { RefCell::new(None) };
}

/// An empty scratch directory holding `files` (name, bytes); `f` runs with its path.
fn with_files(files: &[(&str, &[u8])], f: impl FnOnce(&Path)) {
    SCRATCH.with(|s| {
        let mut s = s.borrow_mut();
        let dir = s.get_or_insert_with(|| tempfile::tempdir().expect("scratch directory"));
        let root: PathBuf = dir.path().join("in");
        let _ = std::fs::remove_dir_all(&root);
        std::fs::create_dir_all(&root).expect("scratch directory");
        for (name, bytes) in files {
            std::fs::write(root.join(name), bytes).expect("scratch file");
        }
        f(&root);
    });
}

/// A valid one-tensor shard named `s.safetensors` (for the index target).
fn valid_shard() -> Vec<u8> {
    seeds::safetensors_bytes(&[("w", "F32", &[2], &1.0f32.to_le_bytes().repeat(2))])
}

/// `model.safetensors`: header parsing and checks, then every tensor read as f32.
pub fn safetensors_header(data: &[u8]) {
    with_files(&[("model.safetensors", data)], |dir| {
        if let Ok(f) = longctx::hub::st_file::SafetensorsFile::open(&dir.join("model.safetensors")) {
            for name in f.names() {
                let _ = f.bytes(name);
                let _ = f.load(name, DType::F32, &Device::Cpu);
            }
        }
    });
}

/// `model.safetensors.index.json` next to one valid shard: index parsing, shard names,
/// routing, then loading the weights.
pub fn safetensors_index(data: &[u8]) {
    let shard = valid_shard();
    with_files(&[("model.safetensors.index.json", data), ("s.safetensors", &shard)], |dir| {
        if let Ok(c) = longctx::hub::Checkpoint::open(dir) {
            let _ = c.names().iter().map(|n| c.info(n)).count();
            let _ = longctx::hub::load_weights(dir, DType::F32, &Device::Cpu);
        }
    });
}

/// `config.json`: the typed Llama config, its write-back, parameter count, a memory
/// plan, and the context-extension edit.
pub fn config_json(data: &[u8]) {
    let Ok(mut v) = serde_json::from_slice::<serde_json::Value>(data) else { return };
    if let Ok(cfg) = longctx::model::LlamaConfig::from_value(Path::new("config.json"), v.clone()) {
        let _ = cfg.to_json_value();
        let _ = longctx::limits::param_count(&cfg);
        let shape = longctx::plan::ModelShape::from_config(&cfg);
        let req = longctx::plan::PlanRequest::new(65536, 8, 80_000_000_000, longctx::parallel::dims::ParallelMode::ZigzagRingAttn);
        let _ = longctx::plan::plan(&shape, &req);
    }
    let _ = longctx::hub::set_context_fields(&mut v, 1e6, 65536);
}

/// `tokenizer.json`: loading, then encoding and decoding a short text.
pub fn tokenizer_json(data: &[u8]) {
    with_files(&[("tokenizer.json", data)], |dir| {
        if let Ok(t) = longctx::hub::load_tokenizer(dir) {
            if let Ok(enc) = t.encode("Hello world, 123 passkey.", false) {
                let _ = t.decode(enc.get_ids(), false);
            }
        }
    });
}

/// Runs the data pipeline (read, tokenize, pack, shuffle) over one file, a few batches.
fn dataset(file: &str, data: &[u8], tweak: impl FnOnce(&mut FilesConfig)) {
    let tok = seeds::tokenizer_object();
    with_files(&[(file, data)], |dir| {
        let mut cfg = FilesConfig::new(dir.join(file).display().to_string(), 16);
        cfg.vocab_size = Some(64);
        cfg.shuffle_buffer = 4;
        cfg.max_epochs = Some(2);
        tweak(&mut cfg);
        let Ok(mut loader) = Loader::new(&DataSpec::Files(cfg), Some(&tok), Shard::SINGLE) else { return };
        for _ in 0..32 {
            match loader.next_batch(2) {
                Ok(Some(_)) => {}
                _ => break,
            }
        }
        let _ = loader.state();
    });
}

pub fn dataset_jsonl(data: &[u8]) {
    dataset("d.jsonl", data, |_| {});
}

pub fn dataset_text(data: &[u8]) {
    dataset("d.txt", data, |_| {});
}

pub fn dataset_parquet(data: &[u8]) {
    dataset("d.parquet", data, |_| {});
}

/// Arrow IPC files (`datasets`' `save_to_disk`), both columns (the first byte picks one).
pub fn dataset_arrow(data: &[u8]) {
    let column = if data.first().is_some_and(|b| b & 1 == 1) { "text" } else { "input_ids" };
    dataset("d.arrow", data, |c| c.column = Some(column.into()));
}

/// Compressed JSON lines: gzip or zstd by the input's own magic bytes (zstd otherwise).
pub fn dataset_jsonl_compressed(data: &[u8]) {
    let name = if data.starts_with(&[0x1f, 0x8b]) { "d.jsonl.gz" } else { "d.jsonl.zst" };
    dataset(name, data, |_| {});
}

/// Raw token files, both widths (the first byte picks one).
pub fn dataset_tokens(data: &[u8]) {
    let width = if data.first().is_some_and(|b| b & 1 == 1) { longctx::data::TokenWidth::U32 } else { longctx::data::TokenWidth::U16 };
    dataset("d.bin", data, |c| c.token_width = width);
}

/// A checkpoint's `state.json`: parsed, checked against the default run config as a
/// resume would, and its data cursor restored into a passkey loader.
pub fn checkpoint_state(data: &[u8]) {
    let Ok(state) = serde_json::from_slice::<longctx::train::checkpoint::TrainState>(data) else { return };
    let cfg = longctx::train::config::RunConfig::default();
    let _ = longctx::train::resume_check::check(&state, Path::new("state.json"), &cfg, false);
    if let Ok(Some(ds)) = serde_json::from_value::<Option<longctx::data::DataState>>(state.data.clone()) {
        let spec = DataSpec::Passkey(longctx::data::PasskeyConfig::new(32));
        if let Ok(mut l) = Loader::new(&spec, None, Shard::SINGLE) {
            if l.restore(&ds).is_ok() {
                let _ = l.next_batch(1);
            }
        }
    }
}

/// Valid inputs to start mutating from.
pub mod seeds {
    use std::sync::Arc;

    /// A safetensors file of `(name, dtype, shape, bytes)`, laid out in order.
    pub fn safetensors_bytes(tensors: &[(&str, &str, &[usize], &[u8])]) -> Vec<u8> {
        let mut header = serde_json::Map::new();
        let mut data = Vec::new();
        for (name, dtype, shape, bytes) in tensors {
            let off = [data.len(), data.len() + bytes.len()];
            header.insert(name.to_string(), serde_json::json!({"dtype": dtype, "shape": shape, "data_offsets": off}));
            data.extend_from_slice(bytes);
        }
        header.insert("__metadata__".into(), serde_json::json!({"format": "pt"}));
        let h = serde_json::to_vec(&header).expect("header");
        let mut out = (h.len() as u64).to_le_bytes().to_vec();
        out.extend_from_slice(&h);
        out.extend_from_slice(&data);
        out
    }

    pub fn safetensors() -> Vec<Vec<u8>> {
        let f = |x: f32| x.to_le_bytes();
        let w: Vec<u8> = [f(1.0), f(-2.0), f(0.5), f(3.0)].concat();
        vec![
            safetensors_bytes(&[
                ("a", "F32", &[2, 2], &w),
                ("b", "BF16", &[2], &[0x80, 0x3f, 0x00, 0x40]),
                ("c", "I64", &[1], &[7, 0, 0, 0, 0, 0, 0, 0]),
            ]),
            safetensors_bytes(&[("e", "F16", &[0], &[])]),
        ]
    }

    pub fn index() -> Vec<Vec<u8>> {
        vec![
            br#"{"metadata": {"total_size": 8}, "weight_map": {"w": "s.safetensors"}}"#.to_vec(),
            br#"{"weight_map": {"w": "s.safetensors", "v": "t.safetensors"}}"#.to_vec(),
        ]
    }

    pub fn config() -> Vec<Vec<u8>> {
        let tiny = longctx::train::init::builtin_config_json("tiny").expect("builtin config");
        let mut yarn = tiny.clone();
        yarn["rope_scaling"] = serde_json::json!({"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 256});
        let mut llama3 = tiny.clone();
        llama3["rope_parameters"] =
            serde_json::json!({"rope_type": "llama3", "rope_theta": 5e5, "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0});
        llama3["eos_token_id"] = serde_json::json!([2, 3]);
        [tiny, yarn, llama3].iter().map(|v| v.to_string().into_bytes()).collect()
    }

    /// A word-level tokenizer over the words of the seeds (ids below 64).
    pub fn tokenizer_text() -> String {
        let words = ["<unk>", "<s>", "</s>", "hello", "world", "the", "passkey", "is", "1", "2", "3", "."];
        let vocab: serde_json::Map<String, serde_json::Value> = words.iter().enumerate().map(|(i, w)| (w.to_string(), i.into())).collect();
        serde_json::json!({
            "version": "1.0", "truncation": null, "padding": null, "added_tokens": [], "normalizer": {"type": "Lowercase"},
            "pre_tokenizer": {"type": "Whitespace"}, "post_processor": null, "decoder": null,
            "model": {"type": "WordLevel", "vocab": vocab, "unk_token": "<unk>"}
        })
        .to_string()
    }

    pub fn tokenizer_object() -> tokenizers::Tokenizer {
        tokenizer_text().parse().expect("the seed tokenizer")
    }

    pub fn tokenizer() -> Vec<Vec<u8>> {
        let fixture = concat!(env!("CARGO_MANIFEST_DIR"), "/../tests/fixtures/llama_mha/tokenizer.json");
        let mut v = vec![tokenizer_text().into_bytes()];
        v.extend(std::fs::read(fixture).ok());
        v
    }

    pub fn jsonl() -> Vec<Vec<u8>> {
        vec![
            b"{\"text\": \"hello world the passkey is 1 2 3 .\"}\n{\"text\": \"the world\"}\n".to_vec(),
            b"{\"input_ids\": [1, 5, 9, 2]}\n{\"input_ids\": []}\n{\"input_ids\": [3, 4, 5, 6, 7, 8, 9, 10, 11, 12]}\n".to_vec(),
        ]
    }

    pub fn text() -> Vec<Vec<u8>> {
        vec![b"hello world\n\nthe passkey is 1 2 3 .\n".to_vec(), "h\u{e9}llo \u{1F600}\n".as_bytes().to_vec()]
    }

    /// The Arrow fixture of tests/all/data.rs (written by `datasets`).
    pub fn arrow() -> Vec<Vec<u8>> {
        vec![
            include_bytes!("../../tests/fixtures/arrow_dataset/train/data-00000-of-00002.arrow").to_vec(),
            include_bytes!("../../tests/fixtures/arrow_dataset/validation/data-00000-of-00001.arrow").to_vec(),
        ]
    }

    /// The JSON lines seeds, gzipped and zstd-compressed.
    pub fn jsonl_compressed() -> Vec<Vec<u8>> {
        use std::io::Write;
        jsonl()
            .into_iter()
            .flat_map(|j| {
                let mut gz = flate2::write::GzEncoder::new(Vec::new(), flate2::Compression::default());
                gz.write_all(&j).expect("gzip");
                [gz.finish().expect("gzip"), zstd::stream::encode_all(&j[..], 3).expect("zstd")]
            })
            .collect()
    }

    pub fn tokens() -> Vec<Vec<u8>> {
        vec![(0u16..40).flat_map(|t| t.to_le_bytes()).collect(), (1u32..30).flat_map(|t| t.to_le_bytes()).collect()]
    }

    /// Parquet files: token-id lists and text, written with the parquet crate.
    pub fn parquet() -> Vec<Vec<u8>> {
        use parquet::data_type::{ByteArray, ByteArrayType, Int64Type};
        use parquet::file::properties::WriterProperties;
        use parquet::file::writer::SerializedFileWriter;
        use parquet::schema::parser::parse_message_type;
        let write = |schema: &str, f: &dyn Fn(&mut parquet::file::writer::SerializedColumnWriter<'_>)| -> Vec<u8> {
            let schema = Arc::new(parse_message_type(schema).expect("schema"));
            let props = Arc::new(WriterProperties::builder().set_compression(parquet::basic::Compression::SNAPPY).build());
            let mut buf = Vec::new();
            let mut w = SerializedFileWriter::new(&mut buf, schema, props).expect("writer");
            let mut rg = w.next_row_group().expect("row group");
            let mut col = rg.next_column().expect("column").expect("one column");
            f(&mut col);
            col.close().expect("close column");
            rg.close().expect("close row group");
            w.close().expect("close file");
            buf
        };
        let ids = write("message m { optional group input_ids (LIST) { repeated group list { optional int64 element; } } }", &|c| {
            let vals: Vec<i64> = (1..20).collect();
            let def = vec![3i16; vals.len()];
            let rep: Vec<i16> = (0..vals.len()).map(|i| i16::from(i % 5 != 0)).collect();
            c.typed::<Int64Type>().write_batch(&vals, Some(&def), Some(&rep)).expect("ids");
        });
        let text = write("message m { optional binary text (UTF8); }", &|c| {
            let vals = [ByteArray::from("hello world"), ByteArray::from("the passkey is 1 2 3 .")];
            c.typed::<ByteArrayType>().write_batch(&vals, Some(&[1, 0, 1]), None).expect("text");
        });
        vec![ids, text]
    }

    pub fn state() -> Vec<Vec<u8>> {
        let cfg = serde_json::to_value(longctx::train::config::RunConfig::default()).expect("config");
        let data = serde_json::json!({"seed": 42, "seq_len": 32, "epoch": 0, "position": 16, "consumed": 16});
        let s = serde_json::json!({
            "stage": 0, "stage_step": 2, "global_step": 2, "adam_step": 2, "data": data, "optimizer_shards": 1,
            "config": cfg, "skipped_steps": 0, "skipped_in_row": 0
        });
        vec![s.to_string().into_bytes()]
    }
}
