//! Data layer: readers, packing, shuffle, DP sharding, resume, SP layout, passkey.
//! Every expectation is computed by an independent naive reference in this file
//! (plain concatenation / slicing / index arithmetic); comparisons are exact (integers).

use std::fs;
use std::io::Write;
use std::path::{Path, PathBuf};
use std::sync::Arc;

use longctx::data::docs::{Content, MultiFileDocs, ReadOptions};
use longctx::data::{
    apply_layout, apply_layout_tensors, synthetic, DataState, FilesConfig, Format, Loader, LossOn, Packing, Passkey, PasskeyConfig, Sample,
    Shard, TextSplit, TokenWidth, IGNORE,
};
use longctx::hub::HubOptions;

use parquet::basic::Compression;
use parquet::data_type::{ByteArray, ByteArrayType, Int32Type, Int64Type};
use parquet::file::properties::WriterProperties;
use parquet::file::writer::SerializedFileWriter;
use parquet::schema::parser::parse_message_type;

use crate::common;
use common::*;

/// `n` documents of pseudo-random lengths 1..=40 with distinct token values.
fn make_docs(n: usize) -> Vec<Vec<u32>> {
    let mut next = 10u32;
    (0..n)
        .map(|i| {
            let len = 1 + (i * 7 + 3) % 40;
            (0..len)
                .map(|_| {
                    next += 1;
                    next % 5000 + 3
                })
                .collect()
        })
        .collect()
}

fn write_jsonl_ids(path: &Path, docs: &[Vec<u32>]) {
    let mut f = fs::File::create(path).unwrap();
    for d in docs {
        writeln!(f, "{}", serde_json::json!({ "input_ids": d, "meta": "x" })).unwrap();
    }
}

/// Reference: concatenate with BOS/EOS, cut disjoint windows of S+1.
fn reference_concat(docs: &[Vec<u32>], s: usize, bos: Option<u32>, eos: Option<u32>) -> Vec<Sample> {
    let mut stream = Vec::new();
    for d in docs {
        stream.extend(bos);
        stream.extend_from_slice(d);
        stream.extend(eos);
    }
    stream
        .chunks_exact(s + 1)
        .map(|w| Sample { ids: w[..s].to_vec(), targets: w[1..].iter().map(|&t| t as i64).collect(), doc_starts: vec![] })
        .collect()
}

fn drain(loader: &mut Loader) -> Vec<Sample> {
    let mut out = Vec::new();
    while let Some(s) = loader.next_sample().unwrap() {
        out.push(s);
    }
    out
}

/// [`drain`] that returns a reading error instead of panicking.
fn drain_result(loader: &mut Loader) -> longctx::Result<Vec<Sample>> {
    let mut out = Vec::new();
    while let Some(s) = loader.next_sample()? {
        out.push(s);
    }
    Ok(out)
}

fn one_epoch(cfg: &FilesConfig) -> FilesConfig {
    FilesConfig { max_epochs: Some(1), ..cfg.clone() }
}

#[test]
fn concat_packing_boundaries_exact() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("d.jsonl");
    let docs = make_docs(50);
    write_jsonl_ids(&path, &docs);
    for (s, bos, eos) in [(7, None, None), (16, Some(1), Some(2)), (33, None, Some(2)), (1, Some(1), None)] {
        let mut cfg = FilesConfig::new(path.to_str().unwrap(), s);
        cfg.bos = bos;
        cfg.eos = eos;
        cfg.shuffle_buffer = 0;
        let got = drain(&mut Loader::files(&one_epoch(&cfg), None, &offline_hub(), Shard::SINGLE).unwrap());
        let want = reference_concat(&docs, s, bos, eos);
        assert!(!want.is_empty());
        assert_eq!(got, want, "seq_len {s} bos {bos:?} eos {eos:?}");
    }
}

#[test]
fn truncate_packing_pads_with_ignore() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("d.jsonl");
    let docs = vec![vec![5u32; 1], (10..30).collect(), vec![7, 8], (40..45).collect()];
    write_jsonl_ids(&path, &docs);
    let s = 8;
    let mut cfg = FilesConfig::new(path.to_str().unwrap(), s);
    cfg.packing = Packing::Truncate { pad_id: 0 };
    cfg.eos = Some(2);
    cfg.shuffle_buffer = 0;
    let got = drain(&mut Loader::files(&one_epoch(&cfg), None, &offline_hub(), Shard::SINGLE).unwrap());
    // doc [5]+eos has 2 tokens: 1 target. Doc 10..30 is truncated to 9 tokens.
    let want = vec![
        Sample {
            ids: vec![5, 2, 0, 0, 0, 0, 0, 0],
            targets: vec![2, IGNORE, IGNORE, IGNORE, IGNORE, IGNORE, IGNORE, IGNORE],
            doc_starts: vec![],
        },
        Sample { ids: (10..18).collect(), targets: (11..19).collect(), doc_starts: vec![] },
        Sample {
            ids: vec![7, 8, 2, 0, 0, 0, 0, 0],
            targets: vec![8, 2, IGNORE, IGNORE, IGNORE, IGNORE, IGNORE, IGNORE],
            doc_starts: vec![],
        },
        Sample { ids: vec![40, 41, 42, 43, 44, 2, 0, 0], targets: vec![41, 42, 43, 44, 2, IGNORE, IGNORE, IGNORE], doc_starts: vec![] },
    ];
    assert_eq!(got, want);
    // Without EOS the one-token document has nothing to predict and is skipped.
    cfg.eos = None;
    let got = drain(&mut Loader::files(&one_epoch(&cfg), None, &offline_hub(), Shard::SINGLE).unwrap());
    assert_eq!(got.len(), 3);
    assert_eq!(got[0].ids[..8], (10..18).collect::<Vec<u32>>()[..]);
}

fn shuffled(path: &Path, seed: u64, buffer: usize) -> Vec<Sample> {
    let mut cfg = FilesConfig::new(path.to_str().unwrap(), 5);
    cfg.seed = seed;
    cfg.shuffle_buffer = buffer;
    drain(&mut Loader::files(&one_epoch(&cfg), None, &offline_hub(), Shard::SINGLE).unwrap())
}

#[test]
fn shuffle_is_deterministic_per_seed_and_a_permutation() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("d.jsonl");
    let docs = make_docs(60);
    write_jsonl_ids(&path, &docs);
    let plain = shuffled(&path, 0, 0);
    assert!(plain.len() > 100, "{} samples", plain.len());
    let a = shuffled(&path, 7, 16);
    let b = shuffled(&path, 7, 16);
    let c = shuffled(&path, 8, 16);
    assert_eq!(a, b, "same seed must give the same order");
    assert_ne!(a, c, "different seeds must give different orders");
    assert_ne!(a, plain, "a shuffle buffer of 16 must move samples");
    let key = |v: &[Sample]| {
        let mut k: Vec<Vec<u32>> = v.iter().map(|s| s.ids.clone()).collect();
        k.sort();
        k
    };
    assert_eq!(key(&a), key(&plain), "shuffle must be a permutation of the packed samples");
    assert_eq!(key(&c), key(&plain));
}

/// The sharding tests' data: 40 documents of ids in `dir`, 6-token samples, seed 3, a
/// shuffle buffer of 8.
fn sharding_config(dir: &Path) -> FilesConfig {
    let path = dir.join("d.jsonl");
    write_jsonl_ids(&path, &make_docs(40));
    let mut cfg = FilesConfig::new(path.to_str().unwrap(), 6);
    cfg.seed = 3;
    cfg.shuffle_buffer = 8;
    cfg
}

/// Across epoch wraps (issue #33): the epochs make one global stream whatever the world
/// size; a group of ranks may span the end of an epoch, so rank `d` of `D` gets global
/// samples `d, d+D, ...` of the one-rank stream, and no epoch's last samples are dropped
/// (an epoch of an odd number of samples used to lose its last one on two ranks).
#[test]
fn dp_sharding_keeps_the_global_stream_across_epochs() {
    let dir = tempfile::tempdir().unwrap();
    let cfg = sharding_config(dir.path());
    let per_epoch = drain(&mut Loader::files(&one_epoch(&cfg), None, &offline_hub(), Shard::SINGLE).unwrap()).len();
    let take = |l: &mut Loader, n: usize| (0..n).map(|_| l.next_sample().unwrap().expect("unbounded epochs")).collect::<Vec<_>>();
    assert!(!per_epoch.is_multiple_of(2), "an epoch of {per_epoch} samples: the groups of 2 must span a wrap");
    let n = 3 * per_epoch + 1;
    let global = take(&mut Loader::files(&cfg, None, &offline_hub(), Shard::SINGLE).unwrap(), n);
    for world in [2usize, 3, 4] {
        for rank in 0..world {
            let mut l = Loader::files(&cfg, None, &offline_hub(), Shard { rank, world }).unwrap();
            for (k, s) in take(&mut l, n / world).iter().enumerate() {
                assert_eq!(s, &global[k * world + rank], "world {world} rank {rank} sample {k} (epoch of {per_epoch})");
            }
        }
    }
}

#[test]
fn dp_sharding_partitions_samples() {
    let dir = tempfile::tempdir().unwrap();
    let cfg = sharding_config(dir.path());
    let global = drain(&mut Loader::files(&one_epoch(&cfg), None, &offline_hub(), Shard::SINGLE).unwrap());
    for world in [2usize, 3, 4] {
        let per_rank: Vec<Vec<Sample>> = (0..world)
            .map(|rank| drain(&mut Loader::files(&one_epoch(&cfg), None, &offline_hub(), Shard { rank, world }).unwrap()))
            .collect();
        let groups = global.len() / world;
        for (rank, samples) in per_rank.iter().enumerate() {
            assert_eq!(samples.len(), groups, "world {world} rank {rank}: equal counts, last partial group dropped");
            for (k, s) in samples.iter().enumerate() {
                assert_eq!(s, &global[k * world + rank], "world {world} rank {rank} sample {k}");
            }
        }
        // No overlap and full coverage of the complete groups (samples are all distinct here).
        let mut all: Vec<Vec<u32>> = per_rank.iter().flatten().map(|s| s.ids.clone()).collect();
        all.sort();
        let n = all.len();
        all.dedup();
        assert_eq!(all.len(), n, "world {world}: a sample was given to two ranks");
        assert_eq!(n, groups * world);
    }
}

#[test]
fn state_restore_continues_exactly_across_epochs() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("d.jsonl");
    write_jsonl_ids(&path, &make_docs(30));
    let mut cfg = FilesConfig::new(path.to_str().unwrap(), 9);
    cfg.seed = 11;
    cfg.shuffle_buffer = 5;
    cfg.max_epochs = Some(3);
    let shard = Shard { rank: 1, world: 2 };
    let mut full = Loader::files(&cfg, None, &offline_hub(), shard).unwrap();
    let reference = drain(&mut full);
    let per_epoch = reference.len() / 3;
    assert!(per_epoch >= 4);
    // Epochs are reshuffled: epoch 1 is not a replay of epoch 0.
    assert_ne!(reference[..per_epoch], reference[per_epoch..2 * per_epoch]);
    for cut in [0, 1, per_epoch - 1, per_epoch, per_epoch + 2, 2 * per_epoch + 1] {
        let mut a = Loader::files(&cfg, None, &offline_hub(), shard).unwrap();
        for _ in 0..cut {
            a.next_sample().unwrap().unwrap();
        }
        let json = serde_json::to_string(&a.state()).unwrap();
        let state: DataState = serde_json::from_str(&json).unwrap();
        let mut b = Loader::files(&cfg, None, &offline_hub(), shard).unwrap();
        b.restore(&state).unwrap();
        let rest = drain(&mut b);
        assert_eq!(rest, reference[cut..], "resumed after {cut} samples");
    }
    // A state for another seed is refused.
    let mut other = Loader::files(&FilesConfig { seed: 12, ..cfg.clone() }, None, &offline_hub(), shard).unwrap();
    let err = other.restore(&full.state()).unwrap_err().to_string();
    assert!(err.contains("seed 11"), "{err}");
}

fn tiny_tokenizer() -> tokenizers::Tokenizer {
    tokenizer_with(serde_json::Value::Null, serde_json::Value::Null)
}

/// The tiny tokenizer as a `tokenizer.json` that asks for truncation to 3 tokens and
/// padding to 16 (some published tokenizers carry such settings).
fn truncating_tokenizer() -> tokenizers::Tokenizer {
    tokenizer_with(
        serde_json::json!({"direction": "Right", "max_length": 3, "strategy": "LongestFirst", "stride": 0}),
        serde_json::json!({"strategy": {"Fixed": 16}, "direction": "Right", "pad_to_multiple_of": null,
            "pad_id": 0, "pad_type_id": 0, "pad_token": "[UNK]"}),
    )
}

fn tokenizer_with(truncation: serde_json::Value, padding: serde_json::Value) -> tokenizers::Tokenizer {
    let words = ["[UNK]", "the", "quick", "brown", "fox", "jumps", "over", "lazy", "dog", "a", "cat", "sat"];
    let vocab: serde_json::Map<String, serde_json::Value> =
        words.iter().enumerate().map(|(i, w)| (w.to_string(), serde_json::json!(i + 3))).collect();
    let json = serde_json::json!({
        "version": "1.0", "truncation": truncation, "padding": padding, "added_tokens": [],
        "normalizer": null, "pre_tokenizer": { "type": "WhitespaceSplit" }, "post_processor": null,
        "decoder": null, "model": { "type": "WordLevel", "vocab": vocab, "unk_token": "[UNK]" }
    });
    json.to_string().parse().unwrap()
}

/// Word ids of the tiny tokenizer (reference tokenization).
fn word_ids(text: &str) -> Vec<u32> {
    let words = ["[UNK]", "the", "quick", "brown", "fox", "jumps", "over", "lazy", "dog", "a", "cat", "sat"];
    text.split_whitespace().map(|w| words.iter().position(|x| *x == w).map_or(3, |i| i as u32 + 3)).collect()
}

const TEXTS: [&str; 5] =
    ["the quick brown fox jumps over the lazy dog", "a cat sat", "the dog sat over a cat", "zebra the", "fox fox fox fox"];

fn write_parquet_ids(path: &Path, docs: &[Vec<u32>], rows_per_group: usize, int32: bool) {
    let ty = if int32 { "int32" } else { "int64" };
    let schema = Arc::new(
        parse_message_type(&format!(
            "message m {{ optional group input_ids (LIST) {{ repeated group list {{ optional {ty} element; }} }} \
             required int32 other; }}"
        ))
        .unwrap(),
    );
    let props = Arc::new(WriterProperties::builder().set_compression(Compression::SNAPPY).set_data_page_row_count_limit(3).build());
    let mut w = SerializedFileWriter::new(fs::File::create(path).unwrap(), schema, props).unwrap();
    for group in docs.chunks(rows_per_group) {
        let mut rg = w.next_row_group().unwrap();
        let (mut vals, mut def, mut rep) = (Vec::new(), Vec::new(), Vec::new());
        for d in group {
            if d.is_empty() {
                def.push(1);
                rep.push(0);
            }
            for (j, &t) in d.iter().enumerate() {
                vals.push(t as i64);
                def.push(3);
                rep.push(if j == 0 { 0 } else { 1 });
            }
        }
        let mut col = rg.next_column().unwrap().unwrap();
        if int32 {
            let v: Vec<i32> = vals.iter().map(|&x| x as i32).collect();
            col.typed::<Int32Type>().write_batch(&v, Some(&def), Some(&rep)).unwrap();
        } else {
            col.typed::<Int64Type>().write_batch(&vals, Some(&def), Some(&rep)).unwrap();
        }
        col.close().unwrap();
        let mut col = rg.next_column().unwrap().unwrap();
        let other: Vec<i32> = (0..group.len() as i32).collect();
        col.typed::<Int32Type>().write_batch(&other, None, None).unwrap();
        col.close().unwrap();
        rg.close().unwrap();
    }
    w.close().unwrap();
}

fn write_parquet_text(path: &Path, texts: &[Option<&str>], rows_per_group: usize) {
    let schema = Arc::new(parse_message_type("message m { optional binary text (UTF8); }").unwrap());
    let props = Arc::new(WriterProperties::builder().set_compression(Compression::SNAPPY).build());
    let mut w = SerializedFileWriter::new(fs::File::create(path).unwrap(), schema, props).unwrap();
    for group in texts.chunks(rows_per_group) {
        let mut rg = w.next_row_group().unwrap();
        let vals: Vec<ByteArray> = group.iter().flatten().map(|t| ByteArray::from(*t)).collect();
        let def: Vec<i16> = group.iter().map(|t| t.is_some() as i16).collect();
        let mut col = rg.next_column().unwrap().unwrap();
        col.typed::<ByteArrayType>().write_batch(&vals, Some(&def), None).unwrap();
        col.close().unwrap();
        rg.close().unwrap();
    }
    w.close().unwrap();
}

fn read_docs(files: Vec<PathBuf>, format: Format, column: Option<&str>) -> Vec<(Content, String)> {
    let opts = ReadOptions { format, column: column.map(str::to_string), text_split: TextSplit::Paragraph, token_width: TokenWidth::U16 };
    MultiFileDocs::new(files, opts).map(|d| d.unwrap()).map(|d| (d.content, d.loc.to_string())).collect()
}

#[test]
fn parquet_input_ids_column_over_row_groups_and_pages() {
    let dir = tempfile::tempdir().unwrap();
    let mut docs = make_docs(23);
    docs[4] = vec![]; // an empty list yields no document
    for int32 in [false, true] {
        let path = dir.path().join(format!("ids{int32}.parquet"));
        write_parquet_ids(&path, &docs, 5, int32);
        let got = read_docs(vec![path.clone()], Format::Parquet, None);
        let want: Vec<(Content, String)> =
            docs.iter().enumerate().filter(|(_, d)| !d.is_empty()).map(|(i, d)| (Content::Ids(d.clone()), format!("row {i}"))).collect();
        assert_eq!(got, want, "int32 = {int32}");
        // Through the loader: the same samples as the reference concatenation.
        let mut cfg = FilesConfig::new(path.to_str().unwrap(), 12);
        cfg.shuffle_buffer = 0;
        cfg.eos = Some(2);
        let got = drain(&mut Loader::files(&one_epoch(&cfg), None, &offline_hub(), Shard::SINGLE).unwrap());
        let nonempty: Vec<Vec<u32>> = docs.iter().filter(|d| !d.is_empty()).cloned().collect();
        assert_eq!(got, reference_concat(&nonempty, 12, None, Some(2)));
    }
}

#[test]
fn parquet_text_column_is_tokenized() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("t.parquet");
    let rows: Vec<Option<&str>> = vec![Some(TEXTS[0]), None, Some(TEXTS[1]), Some(TEXTS[2]), Some(TEXTS[3]), Some(TEXTS[4])];
    write_parquet_text(&path, &rows, 4);
    let got = read_docs(vec![path.clone()], Format::Parquet, None);
    let want: Vec<(Content, String)> =
        rows.iter().enumerate().filter_map(|(i, t)| t.map(|t| (Content::Text(t.to_string()), format!("row {i}")))).collect();
    assert_eq!(got, want);
    let tok = tiny_tokenizer();
    let mut cfg = FilesConfig::new(path.to_str().unwrap(), 4);
    cfg.shuffle_buffer = 0;
    cfg.bos = Some(1);
    let got = drain(&mut Loader::files(&one_epoch(&cfg), Some(&tok), &offline_hub(), Shard::SINGLE).unwrap());
    let ref_docs: Vec<Vec<u32>> = TEXTS.iter().map(|t| word_ids(t)).collect();
    assert_eq!(got, reference_concat(&ref_docs, 4, Some(1), None));
}

#[test]
fn jsonl_text_field_and_named_field() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("t.jsonl");
    let mut f = fs::File::create(&path).unwrap();
    for (i, t) in TEXTS.iter().enumerate() {
        writeln!(f, "{}", serde_json::json!({ "text": "ignored", "body": t, "id": i })).unwrap();
        writeln!(f).unwrap(); // blank lines are skipped
    }
    drop(f);
    // Truncation and padding stored in tokenizer.json must not cut or pad documents.
    let tok = truncating_tokenizer();
    assert_eq!(tok.encode(TEXTS[0], false).unwrap().get_ids().len(), 16, "the tokenizer itself truncates and pads");
    let mut cfg = FilesConfig::new(path.to_str().unwrap(), 3);
    cfg.column = Some("body".into());
    cfg.eos = Some(2);
    cfg.shuffle_buffer = 0;
    let got = drain(&mut Loader::files(&one_epoch(&cfg), Some(&tok), &offline_hub(), Shard::SINGLE).unwrap());
    let ref_docs: Vec<Vec<u32>> = TEXTS.iter().map(|t| word_ids(t)).collect();
    assert_eq!(got, reference_concat(&ref_docs, 3, None, Some(2)));
}

#[test]
fn plain_text_paragraphs_and_whole_files() {
    let dir = tempfile::tempdir().unwrap();
    fs::write(dir.path().join("b.txt"), format!("{}\n{}\n\n\n{}\r\n", TEXTS[0], TEXTS[1], TEXTS[2])).unwrap();
    fs::write(dir.path().join("a.txt"), format!("\n{}\n", TEXTS[3])).unwrap();
    fs::write(dir.path().join("skip.md"), "not read").unwrap();
    // Paragraph mode, files in sorted order: a.txt then b.txt.
    let files = vec![dir.path().join("a.txt"), dir.path().join("b.txt")];
    let got = read_docs(files, Format::Text, None);
    let want = vec![
        (Content::Text(TEXTS[3].into()), "paragraph 1".to_string()),
        (Content::Text(format!("{}\n{}", TEXTS[0], TEXTS[1])), "paragraph 1".to_string()),
        (Content::Text(TEXTS[2].into()), "paragraph 2".to_string()),
    ];
    assert_eq!(got, want);
    // Whole-file mode through the loader on the directory.
    let tok = tiny_tokenizer();
    let mut cfg = FilesConfig::new(dir.path().to_str().unwrap(), 2);
    cfg.text_split = TextSplit::File;
    cfg.eos = Some(2);
    cfg.shuffle_buffer = 0;
    let got = drain(&mut Loader::files(&one_epoch(&cfg), Some(&tok), &offline_hub(), Shard::SINGLE).unwrap());
    let ref_docs = vec![word_ids(TEXTS[3]), word_ids(&format!("{} {} {}", TEXTS[0], TEXTS[1], TEXTS[2]))];
    assert_eq!(got, reference_concat(&ref_docs, 2, None, Some(2)));
}

#[test]
fn raw_u16_and_u32_token_files() {
    let dir = tempfile::tempdir().unwrap();
    let tokens: Vec<u32> = (0..1000u32).map(|i| (i * 7919) % 65536).collect();
    let mut b16 = Vec::new();
    let mut b32 = Vec::new();
    for &t in &tokens {
        b16.extend_from_slice(&(t as u16).to_le_bytes());
        b32.extend_from_slice(&(t * 3 + 70000).to_le_bytes());
    }
    // Two u16 files read as one stream: the second half continues the first.
    let d16 = dir.path().join("u16");
    fs::create_dir(&d16).unwrap();
    fs::write(d16.join("train_000.bin"), &b16[..1000]).unwrap();
    fs::write(d16.join("train_001.bin"), &b16[1000..]).unwrap();
    let f32_ = dir.path().join("x.bin");
    fs::write(&f32_, &b32).unwrap();
    let s = 31;
    let mut cfg = FilesConfig::new(d16.to_str().unwrap(), s);
    cfg.shuffle_buffer = 0;
    cfg.eos = Some(2); // not applied to raw streams
    let got = drain(&mut Loader::files(&one_epoch(&cfg), None, &offline_hub(), Shard::SINGLE).unwrap());
    assert_eq!(got, reference_concat(std::slice::from_ref(&tokens), s, None, None));
    let mut cfg = FilesConfig::new(f32_.to_str().unwrap(), s);
    cfg.token_width = TokenWidth::U32;
    cfg.shuffle_buffer = 0;
    let got = drain(&mut Loader::files(&one_epoch(&cfg), None, &offline_hub(), Shard::SINGLE).unwrap());
    let want: Vec<u32> = tokens.iter().map(|t| t * 3 + 70000).collect();
    assert_eq!(got, reference_concat(&[want], s, None, None));
}

#[test]
fn hub_dataset_id_resolves_from_cache_offline() {
    let cache = tempfile::tempdir().unwrap();
    let commit = "0123456789abcdef0123456789abcdef01234567";
    let repo = cache.path().join("datasets--someorg--tiny-set");
    fs::create_dir_all(repo.join("refs")).unwrap();
    fs::write(repo.join("refs/main"), commit).unwrap();
    let data = repo.join("snapshots").join(commit).join("data");
    fs::create_dir_all(&data).unwrap();
    let docs = make_docs(20);
    write_jsonl_ids(&data.join("train-00001.jsonl"), &docs[10..]);
    write_jsonl_ids(&data.join("train-00000.jsonl"), &docs[..10]);
    fs::write(repo.join("snapshots").join(commit).join("README.md"), "card").unwrap();
    let mut cfg = FilesConfig::new("someorg/tiny-set", 8);
    cfg.shuffle_buffer = 0;
    let opts = HubOptions::offline_in(cache.path());
    let got = drain(&mut Loader::files(&one_epoch(&cfg), None, &opts, Shard::SINGLE).unwrap());
    assert_eq!(got, reference_concat(&docs, 8, None, None));
    // Missing repo: the error names the cache folder and says how to fetch it.
    let cfg = FilesConfig::new("someorg/absent", 8);
    let err = Loader::files(&cfg, None, &opts, Shard::SINGLE).err().unwrap().to_string();
    assert!(err.contains("datasets--someorg--absent") && err.contains("not in the Hugging Face cache"), "{err}");
}

/// A hub snapshot (and a local directory) whose file names name splits: `split = train`
/// reads only the train files, `validation` only those, `*` every file; a split no file
/// names is an error listing the splits found; a directory naming no split is read whole.
#[test]
fn split_filter_keeps_the_split_files() {
    let cache = tempfile::tempdir().unwrap();
    let commit = "89abcdef0123456789abcdef0123456789abcdef";
    let repo = cache.path().join("datasets--someorg--split-set");
    fs::create_dir_all(repo.join("refs")).unwrap();
    fs::write(repo.join("refs/main"), commit).unwrap();
    let snap = repo.join("snapshots").join(commit);
    fs::create_dir_all(snap.join("data")).unwrap();
    fs::create_dir_all(snap.join("test")).unwrap();
    let docs = make_docs(30);
    write_jsonl_ids(&snap.join("data/train-00000-of-00002.jsonl"), &docs[..10]);
    write_jsonl_ids(&snap.join("data/train-00001-of-00002.jsonl"), &docs[10..20]);
    write_jsonl_ids(&snap.join("data/validation-00000-of-00001.jsonl"), &docs[20..25]);
    write_jsonl_ids(&snap.join("test/part0.jsonl"), &docs[25..]);
    let opts = HubOptions::offline_in(cache.path());
    let load = |source: &str, split: Option<&str>| {
        let mut cfg = FilesConfig::new(source, 8);
        cfg.shuffle_buffer = 0;
        cfg.split = split.map(str::to_string);
        let mut l = Loader::files(&one_epoch(&cfg), None, &opts, Shard::SINGLE)?;
        drain_result(&mut l)
    };
    let snap_s = snap.to_str().unwrap();
    for source in ["someorg/split-set", snap_s] {
        assert_eq!(load(source, Some("train")).unwrap(), reference_concat(&docs[..20], 8, None, None), "{source}: train");
        assert_eq!(load(source, Some("validation")).unwrap(), reference_concat(&docs[20..25], 8, None, None), "{source}");
        assert_eq!(load(source, Some("test")).unwrap(), reference_concat(&docs[25..], 8, None, None), "{source}: a test/ directory");
        assert_eq!(load(source, None).unwrap(), reference_concat(&docs, 8, None, None), "{source}: every file, by path");
        let err = load(source, Some("dev")).err().unwrap().to_string();
        assert!(err.contains("`dev`") && err.contains("\"train\"") && err.contains("--dataset-split"), "{err}");
    }
    // No file names a split: all are read.
    let plain = tempfile::tempdir().unwrap();
    write_jsonl_ids(&plain.path().join("a.jsonl"), &docs[..15]);
    write_jsonl_ids(&plain.path().join("b.jsonl"), &docs[15..]);
    assert_eq!(load(plain.path().to_str().unwrap(), Some("train")).unwrap(), reference_concat(&docs, 8, None, None));
}

/// `.jsonl.gz` (one gzip member and several) and `.jsonl.zst` give the ids of the plain
/// file; in a directory they are found like `.jsonl`; a damaged one is an error naming it.
#[test]
fn compressed_jsonl_loads_the_same_ids() {
    let dir = tempfile::tempdir().unwrap();
    let docs = make_docs(40);
    let plain = dir.path().join("d.jsonl");
    write_jsonl_ids(&plain, &docs);
    let bytes = fs::read(&plain).unwrap();
    let gz = |data: &[u8]| {
        let mut e = flate2::write::GzEncoder::new(Vec::new(), flate2::Compression::default());
        e.write_all(data).unwrap();
        e.finish().unwrap()
    };
    let (half, rest) = bytes.split_at(bytes.len() / 2);
    let files = [
        ("d1.jsonl.gz", gz(&bytes)),
        ("d2.jsonl.gz", [gz(half), gz(rest)].concat()), // concatenated members (pigz, bgzip)
        ("d3.jsonl.zst", zstd::stream::encode_all(&bytes[..], 3).unwrap()),
        ("d4.JSONL.ZSTD", zstd::stream::encode_all(&bytes[..], 1).unwrap()),
    ];
    let load = |p: &Path| {
        let mut cfg = FilesConfig::new(p.to_str().unwrap(), 9);
        cfg.shuffle_buffer = 0;
        cfg.eos = Some(2);
        let mut l = Loader::files(&one_epoch(&cfg), None, &offline_hub(), Shard::SINGLE)?;
        drain_result(&mut l)
    };
    let want = load(&plain).unwrap();
    assert_eq!(want, reference_concat(&docs, 9, None, Some(2)));
    for (name, data) in &files {
        let p = dir.path().join(name);
        fs::write(&p, data).unwrap();
        assert_eq!(Format::from_extension(&p), Some(Format::Jsonl), "{name}");
        assert_eq!(load(&p).unwrap(), want, "{name}");
    }
    let only_gz = tempfile::tempdir().unwrap();
    fs::write(only_gz.path().join("x.jsonl.gz"), &files[0].1).unwrap();
    assert_eq!(load(only_gz.path()).unwrap(), want, "a directory of .jsonl.gz");
    let bad = dir.path().join("bad.jsonl.gz");
    fs::write(&bad, &files[0].1[..files[0].1.len() / 2]).unwrap();
    let err = load(&bad).err().map(|e| e.to_string()).unwrap_or_default();
    assert!(err.contains("bad.jsonl.gz") && err.contains("damaged or truncated"), "{err}");
}

/// A real `datasets` `save_to_disk` directory (scripts/make_arrow_fixture.py: a DatasetDict,
/// train in two Arrow files, validation in one): the train split's `input_ids` load the
/// same ids as the JSON lines of the same rows (a null row and an empty list yield
/// nothing), its `text` column the same texts; the validation split its own rows; a wrong
/// column is an error listing the columns; damaged copies are errors, never panics.
#[test]
fn arrow_save_to_disk_loads_the_same_ids() {
    let fx = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures");
    let load = |p: &Path, split: Option<&str>, column: Option<&str>| -> longctx::Result<Vec<Sample>> {
        let mut cfg = FilesConfig::new(p.to_str().unwrap(), 7);
        cfg.shuffle_buffer = 0;
        cfg.eos = Some(2);
        cfg.split = split.map(str::to_string);
        cfg.column = column.map(str::to_string);
        let mut l = Loader::files(&one_epoch(&cfg), None, &offline_hub(), Shard::SINGLE)?;
        drain_result(&mut l)
    };
    let want = load(&fx.join("arrow_dataset_train.jsonl"), None, None).unwrap();
    assert!(want.len() > 10);
    assert_eq!(load(&fx.join("arrow_dataset"), Some("train"), None).unwrap(), want, "the train split");
    assert_eq!(load(&fx.join("arrow_dataset/train"), None, Some("input_ids")).unwrap(), want, "the train directory");
    // validation: rows 100..103 of the script's formula
    let val: Vec<Vec<u32>> = (100u32..103).map(|r| (0..3 + (r * 5) % 17).map(|k| (r * 31 + k * 7) % 250 + 3).collect()).collect();
    assert_eq!(load(&fx.join("arrow_dataset"), Some("validation"), None).unwrap(), reference_concat(&val, 7, None, Some(2)));
    // text column: the same strings as the JSON lines (read as documents, no tokenizer here)
    let texts = |format: Format, files: Vec<PathBuf>| -> Vec<String> {
        let opts = ReadOptions { format, column: Some("text".into()), text_split: TextSplit::File, token_width: TokenWidth::U16 };
        MultiFileDocs::new(files, opts)
            .map(|d| match d.unwrap().content {
                Content::Text(t) => t,
                other => panic!("{other:?}"),
            })
            .collect()
    };
    let arrow_files: Vec<PathBuf> = (0..2).map(|i| fx.join(format!("arrow_dataset/train/data-0000{i}-of-00002.arrow"))).collect();
    let t = texts(Format::Arrow, arrow_files.clone());
    assert_eq!(t.len(), 12, "every row has a text");
    let from_json = texts(Format::Jsonl, vec![fx.join("arrow_dataset_train.jsonl")]);
    assert!(from_json.iter().all(|x| t.contains(x)) && t[0] == from_json[0], "{t:?}");
    for (column, needle) in [("nope", "the columns are"), ("meta", "expected a string or a list of integers")] {
        let err = load(&fx.join("arrow_dataset/train"), None, Some(column)).err().map(|e| e.to_string()).unwrap_or_default();
        assert!(err.contains(needle) && err.contains(".arrow"), "{column}: {err}");
    }
    // Damaged copies: truncated at every 7th byte, one byte flipped at every 5th.
    let dir = tempfile::tempdir().unwrap();
    let bytes = fs::read(&arrow_files[0]).unwrap();
    let p = dir.path().join("d.arrow");
    for cut in (0..bytes.len()).step_by(7) {
        fs::write(&p, &bytes[..cut]).unwrap();
        let _ = load(&p, None, None); // an error or fewer rows, never a panic
    }
    let mut errors = 0;
    for at in (0..bytes.len()).step_by(5) {
        let mut b = bytes.clone();
        b[at] ^= 0x5a;
        fs::write(&p, &b).unwrap();
        errors += usize::from(load(&p, None, None).is_err());
    }
    assert!(errors > 0);
}

#[test]
fn layout_permutes_ids_targets_positions_identically() {
    use longctx::attention::layout::{fpdt_indices, usp_indices, zigzag_indices};
    let (b, s) = (2usize, 16usize);
    // Row r: ids[i] = 100r + i, targets[i] = 100r + i + 1 (so every entry encodes its global index).
    let ids: Vec<u32> = (0..b).flat_map(|r| (0..s).map(move |i| (100 * r + i) as u32)).collect();
    let targets: Vec<i64> = (0..b).flat_map(|r| (0..s).map(move |i| (100 * r + i + 1) as i64)).collect();
    let layouts: Vec<(String, Vec<Vec<usize>>)> = vec![
        ("zigzag W=4".into(), (0..4).map(|r| zigzag_indices(s, 4, r).unwrap()).collect()),
        ("fpdt P=2 C=8".into(), (0..2).map(|r| fpdt_indices(s, 2, 8, r).unwrap()).collect()),
        ("usp U=2 R=2".into(), (0..4).map(|r| usp_indices(s, 2, 2, r).unwrap()).collect()),
    ];
    for (name, per_rank) in layouts {
        let mut seen = vec![0usize; s];
        for idx in &per_rank {
            let local = apply_layout(&ids, &targets, s, idx).unwrap();
            let l = idx.len();
            let want_pos: Vec<u32> = (0..b).flat_map(|_| idx.iter().map(|&i| i as u32)).collect();
            assert_eq!(local.positions, want_pos, "{name}: positions [b, L] are the global indices");
            for r in 0..b {
                for j in 0..l {
                    let g = local.positions[r * l + j] as usize;
                    assert_eq!(local.ids[r * l + j] as usize, 100 * r + g, "{name} ids");
                    assert_eq!(local.targets[r * l + j] as usize, 100 * r + g + 1, "{name} targets");
                }
            }
            for &i in idx {
                seen[i] += 1;
            }
            // The tensor form agrees with the Vec form.
            let dev = candle_core::Device::Cpu;
            let t_ids = candle_core::Tensor::from_slice(&ids, (b, s), &dev).unwrap();
            let t_tg = candle_core::Tensor::from_slice(&targets, (b, s), &dev).unwrap();
            let (li, lt, lp) = apply_layout_tensors(&t_ids, &t_tg, idx).unwrap();
            assert_eq!(li.flatten_all().unwrap().to_vec1::<u32>().unwrap(), local.ids);
            assert_eq!(lt.flatten_all().unwrap().to_vec1::<i64>().unwrap(), local.targets);
            assert_eq!(lp.dims(), &[b, l]);
            assert_eq!(lp.flatten_all().unwrap().to_vec1::<u32>().unwrap(), local.positions);
        }
        assert!(seen.iter().all(|&c| c == 1), "{name}: every global token on exactly one rank: {seen:?}");
    }
    // Zigzag by hand for W=2, S=8: rank 0 holds chunks 0 and 3, rank 1 chunks 1 and 2.
    let z0 = apply_layout(&ids[..8], &targets[..8], 8, &zigzag_indices(8, 2, 0).unwrap()).unwrap();
    assert_eq!(z0.positions, vec![0, 1, 6, 7]);
    assert_eq!(z0.ids, vec![0, 1, 6, 7]);
    assert_eq!(z0.targets, vec![1, 2, 7, 8]);
    assert!(apply_layout(&ids, &targets, s, &[s]).is_err(), "index out of range must be refused");
}

#[test]
fn passkey_samples_are_well_formed_and_deterministic() {
    for (s, k) in [(14usize, 5usize), (64, 5), (1000, 3), (257, 1)] {
        let cfg = PasskeyConfig { vocab: 256, seq_len: s, digits: k, seed: 9, loss_on: LossOn::Answer, vt_hops: 0 };
        let p = Passkey::new(cfg.clone()).unwrap();
        let mut depths = Vec::new();
        for i in 0..20u64 {
            let item = p.sample(i);
            let (ids, tg) = (&item.sample.ids, &item.sample.targets);
            assert_eq!((ids.len(), tg.len()), (s, s));
            assert_eq!(ids[0], synthetic::BOS);
            assert!(ids.iter().all(|&t| (t as usize) < 256));
            let n = item.needle_pos;
            assert_eq!(ids[n], synthetic::KEY);
            // Place-tagged digits: digit d at place i is DIGIT0 + 10 i + d.
            let digits: Vec<u32> = item.passkey.iter().enumerate().map(|(i, &d)| synthetic::DIGIT0 + 10 * i as u32 + d as u32).collect();
            assert!(item.passkey.iter().all(|&d| d < 10));
            assert_eq!(ids[n + 1..n + 1 + k], digits[..], "needle holds the passkey");
            assert_eq!(ids[n + 1 + k], synthetic::KEY_END);
            // The answer: targets[S-k..] are the digits, everything before is ignored.
            assert_eq!(item.answer_start, s - k);
            assert_eq!(ids[s - k - 1], synthetic::QUESTION);
            assert_eq!(ids[s - k], synthetic::KEY, "the answer prefix repeats the needle's KEY");
            let want: Vec<i64> = digits.iter().map(|&d| d as i64).collect();
            assert_eq!(tg[s - k..], want[..]);
            assert!(tg[..s - k].iter().all(|&t| t == IGNORE));
            assert_eq!(item.sample.counted(), k);
            // Filler: the fixed block FILLER0, FILLER0+1, ..., repeated (the needle interrupts it).
            let filler: Vec<u32> = ids[1..s - k - 1].iter().copied().filter(|&t| t >= synthetic::FILLER0).collect();
            assert_eq!(filler.len(), s + 1 - (2 * k + 5));
            for (j, &w) in filler.iter().enumerate() {
                assert_eq!(w, synthetic::FILLER0 + (j % synthetic::FILLER_BLOCK) as u32, "filler word {j}");
            }
            assert_eq!(item, p.sample(i), "sample {i} must be reproducible");
            depths.push(n);
        }
        if s >= 64 {
            depths.sort();
            depths.dedup();
            assert!(depths.len() > 5, "needle depths should vary: {depths:?}");
        }
        // All-token loss keeps the same ids and counts every target.
        let all = Passkey::new(PasskeyConfig { loss_on: LossOn::All, ..cfg }).unwrap().sample(3);
        assert_eq!(all.sample.ids, p.sample(3).sample.ids);
        assert_eq!(all.sample.counted(), s);
        assert_eq!(all.sample.targets[..s - 1], all.sample.ids[1..].iter().map(|&t| t as i64).collect::<Vec<_>>()[..]);
    }
    let a = Passkey::new(PasskeyConfig { seed: 1, ..PasskeyConfig::new(64) }).unwrap().sample(0);
    let b = Passkey::new(PasskeyConfig { seed: 2, ..PasskeyConfig::new(64) }).unwrap().sample(0);
    assert_ne!(a, b, "different seeds must give different samples");
    let d0 = Passkey::new(PasskeyConfig::new(64)).unwrap().generate(0, Some(0.0));
    let d1 = Passkey::new(PasskeyConfig::new(64)).unwrap().generate(0, Some(1.0));
    assert_eq!(d0.needle_pos, 1);
    // Depth 1: after BOS and all the filler, fill = S+1 - (2k+5) = 65 - 15 = 50 tokens.
    assert_eq!(d1.needle_pos, 1 + 50);
}

#[test]
fn passkey_loader_shards_and_resumes() {
    let cfg = PasskeyConfig::new(32);
    let p = Passkey::new(cfg.clone()).unwrap();
    let shard = Shard { rank: 2, world: 3 };
    let mut a = Loader::passkey(&cfg, shard).unwrap();
    for k in 0..4u64 {
        assert_eq!(a.next_sample().unwrap().unwrap(), p.sample(3 * k + 2).sample);
    }
    let state = a.state();
    assert_eq!(state.position, 12);
    let mut b = Loader::passkey(&cfg, shard).unwrap();
    b.restore(&state).unwrap();
    let batch = b.next_batch(2).unwrap().unwrap();
    let want = [a.next_sample().unwrap().unwrap(), a.next_sample().unwrap().unwrap()];
    assert_eq!(batch.ids, [want[0].ids.clone(), want[1].ids.clone()].concat());
    assert_eq!(batch.targets, [want[0].targets.clone(), want[1].targets.clone()].concat());
    let (ti, tt) = batch.to_tensors(&candle_core::Device::Cpu).unwrap();
    assert_eq!((ti.dims(), tt.dims()), (&[2usize, 32][..], &[2usize, 32][..]));
    assert_eq!(tt.dtype(), candle_core::DType::I64);
}

/// Variable tracking in the built-in vocabulary (`synthetic:retrieval`): every odd sample
/// is a chain `VAR x0 value`, `VAR x1 x0`, … in chain order among the filler, then the
/// question with the value and the chain's variables as the answer (the only counted
/// targets); even samples stay the passkey samples; each sample depends on (seed, i) only.
#[test]
fn variable_tracking_samples_hold_their_chain_in_order() {
    use synthetic::{BOS, FILLER0, FILLER_BLOCK, VAR, VAR0, VARIABLES, VT_QUESTION};
    let (s, k, hops) = (64, 5, 3);
    let cfg = PasskeyConfig { vt_hops: hops, ..PasskeyConfig::new(s) };
    let p = Passkey::new(cfg.clone()).unwrap();
    let plain = Passkey::new(PasskeyConfig::new(s)).unwrap();
    let mut first_at = Vec::new();
    for i in 0..40u64 {
        let item = p.sample(i);
        if i % 2 == 0 {
            assert_eq!(item, plain.sample(i), "even sample {i} is the passkey sample");
            continue;
        }
        assert_eq!(item, p.variable_tracking(i));
        let (ids, tg) = (&item.sample.ids, &item.sample.targets);
        let mut raw = ids.clone();
        raw.push(*tg.last().unwrap() as u32);
        assert_eq!((ids.len(), raw[0]), (s, BOS));
        // The answer: hops + 1 distinct variables, the only counted targets.
        let n = hops + 1;
        assert_eq!(item.answer_start, s - n);
        let chain: Vec<u32> = raw[s + 1 - n..].to_vec();
        assert!(chain.iter().all(|&v| (VAR0..VAR0 + VARIABLES as u32).contains(&v)), "{chain:?}");
        let mut distinct = chain.clone();
        distinct.sort_unstable();
        distinct.dedup();
        assert_eq!(distinct.len(), n, "the chain's variables are distinct: {chain:?}");
        assert!(tg[..s - n].iter().all(|&t| t == IGNORE));
        assert_eq!(tg[s - n..], chain.iter().map(|&v| v as i64).collect::<Vec<_>>()[..]);
        // The question: VT_QUESTION and the value's place-tagged digits.
        let value: Vec<u32> = item.passkey.iter().enumerate().map(|(j, &d)| synthetic::digit_token(j, d)).collect();
        let q = s + 1 - n - (k + 1);
        assert_eq!(raw[q], VT_QUESTION);
        assert_eq!(raw[q + 1..q + 1 + k], value[..]);
        // The assignments, found in text order: VAR x0 value, then VAR x_{j+1} x_j.
        let vars: Vec<usize> = (0..q).filter(|&j| raw[j] == VAR).collect();
        assert_eq!(vars.len(), n, "one VAR per assignment");
        assert_eq!(item.needle_pos, vars[0]);
        assert_eq!(raw[vars[0] + 1], chain[0]);
        assert_eq!(raw[vars[0] + 2..vars[0] + 2 + k], value[..], "the first variable holds the value");
        for j in 1..n {
            assert_eq!(raw[vars[j] + 1..vars[j] + 3], [chain[j], chain[j - 1]], "assignment {j}");
        }
        // Everything else is the filler block in order.
        let mut is_task = vec![false; q];
        is_task[vars[0]..vars[0] + 2 + k].iter_mut().for_each(|b| *b = true);
        for &v in &vars[1..] {
            is_task[v..v + 3].iter_mut().for_each(|b| *b = true);
        }
        let filler: Vec<u32> = (1..q).filter(|&j| !is_task[j]).map(|j| raw[j]).collect();
        assert_eq!(filler.len(), s + 1 - (1 + (k + 2) + 3 * hops + (k + 1) + n));
        for (j, &w) in filler.iter().enumerate() {
            assert_eq!(w, FILLER0 + (j % FILLER_BLOCK) as u32, "filler word {j}");
        }
        first_at.push(vars[0]);
    }
    first_at.sort_unstable();
    first_at.dedup();
    assert!(first_at.len() > 5, "the assignments' places vary: {first_at:?}");
    // Every token counted with LossOn::All; the shortest length that fits, and errors.
    let all = Passkey::new(PasskeyConfig { loss_on: LossOn::All, ..cfg }).unwrap().sample(1);
    assert_eq!(all.sample.counted(), s);
    let fits = 1 + (k + 2) + 3 * hops + (k + 1) + (hops + 1) - 1;
    assert!(Passkey::new(PasskeyConfig { vt_hops: hops, ..PasskeyConfig::new(fits) }).is_ok());
    let bad = |c: PasskeyConfig| Passkey::new(c).err().map(|e| e.to_string()).unwrap_or_default();
    let short = bad(PasskeyConfig { vt_hops: hops, ..PasskeyConfig::new(fits - 1) });
    assert!(short.contains(&format!("at least {fits}")) && short.contains("variable tracking over 3 hops"), "{short}");
    assert!(bad(PasskeyConfig { vt_hops: 16, ..PasskeyConfig::new(256) }).contains("0..=15"));
}

#[test]
fn passkey_config_errors() {
    let bad = |c: PasskeyConfig| Passkey::new(c).err().map(|e| e.to_string()).unwrap_or_default();
    assert!(bad(PasskeyConfig { vocab: 100, ..PasskeyConfig::new(64) }).contains("at least 128"));
    assert!(bad(PasskeyConfig { digits: 9, ..PasskeyConfig::new(64) }).contains("1..=8"));
    assert!(bad(PasskeyConfig::new(13)).contains("at least 14"));
}

/// The synthetic task is learnable by the tiny built-in Llama: 150 AdamW steps at
/// seq_len 24 (batch 8, lr 3e-3, loss on the answer only) must take held-out digit
/// accuracy from chance (0.1) to ≥ 0.9 (measured: 1.00 from step 125 on).
#[test]
fn passkey_is_learnable() {
    use candle_core::{DType, Device, Tensor, D};
    use candle_nn::Optimizer;
    use longctx::attention::{local::LocalAttention, AttentionMode};
    use longctx::data::Batch;
    use longctx::model::Llama;
    let (s, b) = (24usize, 8usize);
    let cfg = longctx::train::init::builtin_config("tiny").unwrap();
    let vars = longctx::train::init::to_vars(longctx::train::init::random_init(&cfg, 42, DType::F32, &Device::Cpu).unwrap()).unwrap();
    let tensors = vars.iter().map(|(k, v)| (k.clone(), v.as_tensor().clone())).collect();
    let model = Llama::load(candle_nn::VarBuilder::from_tensors(tensors, DType::F32, &Device::Cpu), &cfg).unwrap();
    let attn: Arc<dyn AttentionMode> = Arc::new(LocalAttention);
    let params = candle_nn::ParamsAdamW { lr: 3e-3, weight_decay: 0.0, ..Default::default() };
    let mut opt = candle_nn::AdamW::new(vars.values().cloned().collect(), params).unwrap();
    let positions = Tensor::from_slice(&(0..b).flat_map(|_| 0..s as u32).collect::<Vec<_>>(), (b, s), &Device::Cpu).unwrap();
    let batch = |p: &Passkey, first: u64| {
        let items: Vec<_> = (first..first + b as u64).map(|i| p.sample(i)).collect();
        let samples: Vec<Sample> = items.iter().map(|it| it.sample.clone()).collect();
        (items, Batch::from_samples(&samples, s).to_tensors(&Device::Cpu).unwrap())
    };
    let accuracy = |model: &Llama| {
        let held_out = Passkey::new(PasskeyConfig { seed: 777, ..PasskeyConfig::new(s) }).unwrap();
        let (mut right, mut total) = (0, 0);
        for k in 0..4 {
            let (items, (ids, _)) = batch(&held_out, k * b as u64);
            let logits = model.logits(&model.forward_hidden(&ids, &positions, &attn).unwrap()).unwrap();
            let pred: Vec<Vec<u32>> = logits.argmax(D::Minus1).unwrap().to_vec2().unwrap();
            for (r, it) in items.iter().enumerate() {
                for (p, t) in pred[r][it.answer_start..s].iter().zip(&it.sample.targets[it.answer_start..s]) {
                    right += (*p as i64 == *t) as usize;
                    total += 1;
                }
            }
        }
        right as f64 / total as f64
    };
    let before = accuracy(&model);
    let train = Passkey::new(PasskeyConfig { seed: 42, ..PasskeyConfig::new(s) }).unwrap();
    for step in 0..150u64 {
        let (_, (ids, targets)) = batch(&train, step * b as u64);
        let (sum, n) = model.loss(&ids, &targets, &positions, &attn).unwrap();
        opt.backward_step(&(sum / n as f64).unwrap()).unwrap();
    }
    let after = accuracy(&model);
    assert!(before < 0.3, "untrained accuracy {before} should be near chance (0.1)");
    assert!(after >= 0.9, "digit accuracy after 150 steps: {after} (expected ≥ 0.9)");
}

/// An Arrow file truncated or rewritten while a run reads it (#33): the next document is
/// an error naming the file and saying what changed, never a SIGBUS on a vanished page of
/// the memory map; the untouched file reads to its end.
#[test]
fn an_arrow_file_changed_under_a_reader_is_an_error_naming_it() {
    use longctx::data::arrow::ArrowDocs;
    let fx = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/arrow_dataset/train/data-00000-of-00002.arrow");
    let dir = std::env::temp_dir().join(format!("longctx-arrow-changed-{}", std::process::id()));
    fs::create_dir_all(&dir).unwrap();
    let path = dir.join("data-00000-of-00001.arrow");
    let count =
        |p: &Path| ArrowDocs::open(Arc::from(p), Some("input_ids".into())).unwrap().inspect(|d| assert!(d.is_ok(), "{d:?}")).count();
    fs::copy(&fx, &path).unwrap();
    let all = count(&path);
    assert!(all >= 3, "{all} documents");
    // truncated after the first document was read
    let mut r = ArrowDocs::open(Arc::from(path.as_path()), Some("input_ids".into())).unwrap();
    r.next().unwrap().unwrap();
    let f = fs::OpenOptions::new().write(true).open(&path).unwrap();
    f.set_len(64).unwrap();
    let e = r.find_map(|d| d.err()).expect("an error, not the rest of the documents").to_string();
    assert!(e.contains("data-00000-of-00001.arrow") && e.contains("changed while the run was reading it") && e.contains("64 bytes"), "{e}");
    // rewritten in place with the same size (only its modification time tells)
    fs::copy(&fx, &path).unwrap();
    let mut r = ArrowDocs::open(Arc::from(path.as_path()), Some("input_ids".into())).unwrap();
    r.next().unwrap().unwrap();
    let later = fs::metadata(&path).unwrap().modified().unwrap() + std::time::Duration::from_secs(5);
    fs::OpenOptions::new().write(true).open(&path).unwrap().set_modified(later).unwrap();
    let e = r.find_map(|d| d.err()).expect("an error").to_string();
    assert!(e.contains("it was modified") && e.contains("--resume"), "{e}");
    let _ = fs::remove_dir_all(&dir);
}
