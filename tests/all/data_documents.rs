//! Document-aware data (issue #30, data side): documents packing, reset positions under
//! the sequence-parallel layouts, labels / loss_mask columns (jsonl, parquet), mixtures
//! (determinism, resume, filters, upsampling), the planner's peek, and the errors.
//! Expectations come from naive references written here (token-by-token document ids);
//! comparisons are exact.

use std::fs;
use std::io::Write;
use std::path::Path;
use std::sync::Arc;

use longctx::attention::layout::{contiguous_indices, zigzag_indices};
use longctx::data::{apply_layout, apply_layout_docs, Batch, FilesConfig, LabelSource, Loader, MixSource, Packing, Sample, Shard, IGNORE};
use longctx::train::config::{PackingMode, RunConfig};

use parquet::basic::Compression;
use parquet::data_type::{Int32Type, Int64Type};
use parquet::file::properties::WriterProperties;
use parquet::file::writer::SerializedFileWriter;
use parquet::schema::parser::parse_message_type;

use crate::common;
use common::*;

/// `n` documents of lengths 1..=`max_len` (many of 1–3 tokens), distinct token values from `base`.
fn make_docs(n: usize, max_len: usize, base: u32) -> Vec<Vec<u32>> {
    let mut next = base;
    (0..n)
        .map(|i| {
            let len = 1 + (i * 7 + 3 * (i / 3)) % max_len;
            (0..len)
                .map(|_| {
                    next += 1;
                    next
                })
                .collect()
        })
        .collect()
}

fn write_jsonl(path: &Path, rows: &[serde_json::Value]) {
    let mut f = fs::File::create(path).unwrap();
    for r in rows {
        writeln!(f, "{r}").unwrap();
    }
}

fn write_jsonl_ids(path: &Path, docs: &[Vec<u32>]) {
    write_jsonl(path, &docs.iter().map(|d| serde_json::json!({ "input_ids": d })).collect::<Vec<_>>());
}

fn drain(loader: &mut Loader) -> Vec<Sample> {
    let mut out = Vec::new();
    while let Some(s) = loader.next_sample().unwrap() {
        out.push(s);
    }
    out
}

fn first_error(cfg: &FilesConfig) -> String {
    match Loader::files(cfg, None, &offline_hub(), Shard::SINGLE) {
        Err(e) => e.to_string(),
        Ok(mut l) => loop {
            match l.next_sample() {
                Err(e) => break e.to_string(),
                Ok(None) => panic!("no error"),
                Ok(Some(_)) => {}
            }
        },
    }
}

fn files_cfg(path: &Path, s: usize, packing: Packing) -> FilesConfig {
    let mut c = FilesConfig::new(path.to_str().unwrap(), s);
    c.packing = packing;
    c.shuffle_buffer = 0;
    c.max_epochs = Some(1);
    c
}

/// Reference for documents packing: the stream with a document id per token, cut into
/// windows of S+1; a document starts where the id changes (and at 0); a target whose
/// token belongs to another document is ignored; `labels` (per token) give the targets.
fn reference_documents(docs: &[Vec<u32>], labels: Option<&[Vec<i64>]>, s: usize) -> Vec<Sample> {
    let (mut stream, mut doc_of, mut lab) = (Vec::new(), Vec::new(), Vec::new());
    for (k, d) in docs.iter().enumerate() {
        stream.extend_from_slice(d);
        doc_of.extend(std::iter::repeat_n(k, d.len()));
        match labels {
            Some(l) => lab.extend_from_slice(&l[k]),
            None => lab.extend(d.iter().map(|&t| t as i64)),
        }
    }
    let mut out = Vec::new();
    let mut a = 0;
    while a + s < stream.len() {
        let ids = stream[a..a + s].to_vec();
        let mut doc_starts = vec![0u32];
        doc_starts.extend((1..s).filter(|&i| doc_of[a + i] != doc_of[a + i - 1]).map(|i| i as u32));
        let targets = (0..s).map(|i| if doc_of[a + i + 1] == doc_of[a + i] { lab[a + i + 1] } else { IGNORE }).collect();
        out.push(Sample { ids, targets, doc_starts });
        a += s + 1;
    }
    out
}

#[test]
fn documents_packing_small_case_exact() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("d.jsonl");
    let docs: Vec<Vec<u32>> = vec![vec![1, 2, 3], vec![4], vec![5, 6], (7..=14).collect(), vec![15, 16, 17, 18]];
    write_jsonl_ids(&path, &docs);
    let mut loader = Loader::files(&files_cfg(&path, 5, Packing::Documents), None, &offline_hub(), Shard::SINGLE).unwrap();
    let got: Vec<Sample> = (0..3).map(|_| loader.next_sample().unwrap().unwrap()).collect();
    // (read before the data ends: the stats are those of the current epoch)
    assert_eq!(loader.pack_stats().long_docs, 1);
    assert!(loader.next_sample().unwrap().is_none());
    let want = vec![
        // Boundaries at 3 (doc [4]) and 4 (doc [5, 6]): the targets before them are ignored;
        // the 1-token document [4] predicts nothing.
        Sample { ids: vec![1, 2, 3, 4, 5], targets: vec![2, 3, IGNORE, IGNORE, 6], doc_starts: vec![0, 3, 4] },
        // 7..=14 is longer than S+1 = 6: its first piece fills this sample ...
        Sample { ids: vec![7, 8, 9, 10, 11], targets: vec![8, 9, 10, 11, 12], doc_starts: vec![0] },
        // ... and its second piece (13, 14) is a document of its own at 0.
        Sample { ids: vec![13, 14, 15, 16, 17], targets: vec![14, IGNORE, 16, 17, 18], doc_starts: vec![0, 2] },
    ];
    assert_eq!(got, want);
    assert_eq!(got[0].doc_ranges(), vec![0..3, 3..4, 4..5]);
    assert_eq!(got[1].doc_ranges(), vec![0..5]);
    assert_eq!(got[0].counted(), 3);
    assert!(loader.reset_positions(), "documents packing resets positions by default");

    // Concat over the same data keeps every target and no boundaries.
    let concat = drain(&mut Loader::files(&files_cfg(&path, 5, Packing::Concat), None, &offline_hub(), Shard::SINGLE).unwrap());
    assert_eq!(concat.len(), 3);
    assert!(concat.iter().all(|s| s.doc_starts.is_empty() && s.counted() == 5));
    assert_eq!(concat[0].ids, got[0].ids);
}

#[test]
fn documents_packing_matches_reference_over_lengths() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("d.jsonl");
    let docs = make_docs(120, 40, 10);
    assert!(docs.iter().filter(|d| d.len() <= 3).count() >= 8, "the data must hold 1-3 token documents");
    write_jsonl_ids(&path, &docs);
    for s in [1usize, 2, 3, 7, 16, 33, 64] {
        let got = drain(&mut Loader::files(&files_cfg(&path, s, Packing::Documents), None, &offline_hub(), Shard::SINGLE).unwrap());
        let want = reference_documents(&docs, None, s);
        assert!(!want.is_empty());
        assert_eq!(got, want, "seq_len {s}");
        for x in &got {
            assert_eq!(x.doc_starts[0], 0);
            assert!(x.doc_starts.windows(2).all(|w| w[0] < w[1]) && x.doc_starts.iter().all(|&d| (d as usize) < s));
        }
    }
    // Empty documents (`"input_ids": []`) add no boundary.
    let mut with_empty = docs.clone();
    for k in [0, 5, 6, 40] {
        with_empty.insert(k, Vec::new());
    }
    let empty_path = dir.path().join("e.jsonl");
    write_jsonl_ids(&empty_path, &with_empty);
    let got = drain(&mut Loader::files(&files_cfg(&empty_path, 16, Packing::Documents), None, &offline_hub(), Shard::SINGLE).unwrap());
    assert_eq!(got, reference_documents(&docs, None, 16), "empty documents");
    // With BOS/EOS added, the boundaries move with the added tokens.
    let mut cfg = files_cfg(&path, 16, Packing::Documents);
    (cfg.bos, cfg.eos) = (Some(1), Some(2));
    let got = drain(&mut Loader::files(&cfg, None, &offline_hub(), Shard::SINGLE).unwrap());
    let with: Vec<Vec<u32>> = docs.iter().map(|d| [&[1][..], d, &[2]].concat()).collect();
    assert_eq!(got, reference_documents(&with, None, 16));
}

/// Reference position of global token `i` of a row whose documents start at `starts`.
fn reference_position(starts: &[u32], i: usize, reset: bool) -> u32 {
    if !reset || starts.is_empty() {
        return i as u32;
    }
    let mut d = i;
    while !starts.contains(&(d as u32)) {
        d -= 1;
    }
    (i - d) as u32
}

#[test]
fn reset_positions_under_zigzag_and_contiguous_layouts() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("d.jsonl");
    write_jsonl_ids(&path, &make_docs(60, 12, 10));
    let s = 32;
    for reset in [None, Some(false)] {
        let mut cfg = files_cfg(&path, s, Packing::Documents);
        cfg.reset_positions = reset;
        let mut loader = Loader::files(&cfg, None, &offline_hub(), Shard::SINGLE).unwrap();
        let batch = loader.next_batch(3).unwrap().unwrap();
        let want_reset = reset.is_none();
        assert_eq!(batch.reset_positions, want_reset);
        assert_eq!(batch.doc_starts.len(), 3);
        assert!(batch.has_documents());
        let layouts: Vec<(&str, Vec<Vec<usize>>)> = vec![
            ("zigzag W=2", (0..2).map(|r| zigzag_indices(s, 2, r).unwrap()).collect()),
            ("zigzag W=4", (0..4).map(|r| zigzag_indices(s, 4, r).unwrap()).collect()),
            ("contiguous P=4", (0..4).map(|r| contiguous_indices(s, 4, r).unwrap()).collect()),
            ("one rank", vec![(0..s).collect()]),
        ];
        for (name, per_rank) in layouts {
            for idx in &per_rank {
                let local = batch.localize(idx).unwrap();
                assert_eq!(local.docs, batch.doc_starts, "{name}: document starts stay global");
                for r in 0..3 {
                    for (j, &i) in idx.iter().enumerate() {
                        let k = r * idx.len() + j;
                        assert_eq!(local.ids[k], batch.ids[r * s + i], "{name}");
                        assert_eq!(local.targets[k], batch.targets[r * s + i], "{name}");
                        assert_eq!(local.positions[k], reference_position(&batch.doc_starts[r], i, want_reset), "{name} row {r} token {i}");
                    }
                }
            }
        }
        // The whole-row positions agree with the one-rank layout.
        let all: Vec<usize> = (0..s).collect();
        assert_eq!(batch.positions(), batch.localize(&all).unwrap().positions);
        if want_reset {
            assert!(batch.positions().iter().filter(|&&p| p == 0).count() > 3, "positions restart at each document");
        }
    }
}

#[test]
fn layout_without_documents_is_unchanged() {
    let (b, s) = (2usize, 8usize);
    let ids: Vec<u32> = (0..(b * s) as u32).collect();
    let targets: Vec<i64> = (1..=(b * s) as i64).collect();
    let idx = zigzag_indices(s, 2, 1).unwrap();
    let plain = apply_layout(&ids, &targets, s, &idx).unwrap();
    assert_eq!(plain.positions, idx.iter().chain(idx.iter()).map(|&i| i as u32).collect::<Vec<_>>());
    assert_eq!(plain.docs, vec![Vec::<u32>::new(); b]);
    // Reset without boundaries (empty starts) changes nothing either.
    let docs = vec![Vec::new(), Vec::new()];
    assert_eq!(apply_layout_docs(&ids, &targets, s, &idx, &docs, true).unwrap(), plain);
    // A concat batch has empty starts per row and no reset.
    let samples: Vec<Sample> = (0..b).map(|r| Sample::from_tokens(&ids[r * s..(r + 1) * s], s, 0)).collect();
    let batch = Batch::from_samples(&samples, s);
    assert_eq!(batch.doc_starts, vec![Vec::<u32>::new(); b]);
    assert!(!batch.reset_positions && !batch.has_documents());
}

#[test]
fn document_spans_that_do_not_cover_the_sample_are_refused() {
    let s = 8;
    let ids = vec![0u32; s];
    let targets = vec![0i64; s];
    let idx: Vec<usize> = (0..s).collect();
    let e = apply_layout_docs(&ids, &targets, s, &idx, &[vec![2, 5]], true).unwrap_err().to_string();
    assert!(e.contains("must cover the sample") && e.contains("starts at 2"), "{e}");
    let e = apply_layout_docs(&ids, &targets, s, &idx, &[vec![0, 5, 3]], true).unwrap_err().to_string();
    assert!(e.contains("strictly ascending") && e.contains("5 then 3"), "{e}");
    let e = apply_layout_docs(&ids, &targets, s, &idx, &[vec![0, 8]], true).unwrap_err().to_string();
    assert!(e.contains("document start 8 is outside the sample of 8 positions"), "{e}");
    let e = apply_layout_docs(&ids, &targets, s, &idx, &[vec![0], vec![0]], true).unwrap_err().to_string();
    assert!(e.contains("2 rows of document starts for a batch of 1 rows"), "{e}");
}

/// Rows of ids with labels: every third token of each document masked out.
fn labelled_docs() -> (Vec<Vec<u32>>, Vec<Vec<i64>>) {
    let docs = make_docs(30, 15, 100);
    let labels = docs.iter().map(|d| d.iter().enumerate().map(|(j, &t)| if j % 3 == 1 { IGNORE } else { t as i64 }).collect()).collect();
    (docs, labels)
}

/// Reference for concat with labels: targets[i] = label of stream token i+1.
fn reference_concat_labels(docs: &[Vec<u32>], labels: &[Vec<i64>], s: usize) -> Vec<Sample> {
    let stream: Vec<u32> = docs.concat();
    let lab: Vec<i64> = labels.concat();
    (0..stream.len() / (s + 1))
        .map(|k| {
            let a = k * (s + 1);
            Sample { ids: stream[a..a + s].to_vec(), targets: lab[a + 1..a + s + 1].to_vec(), doc_starts: vec![] }
        })
        .collect()
}

fn check_labelled(path: &Path, docs: &[Vec<u32>], labels: &[Vec<i64>], what: &str) {
    let s = 16;
    let got = drain(&mut Loader::files(&files_cfg(path, s, Packing::Concat), None, &offline_hub(), Shard::SINGLE).unwrap());
    let want = reference_concat_labels(docs, labels, s);
    assert_eq!(got, want, "{what}: concat");
    let masked_in: usize = want.iter().map(|x| x.targets.iter().filter(|&&t| t != IGNORE).count()).sum();
    assert_eq!(got.iter().map(Sample::counted).sum::<usize>(), masked_in, "{what}: only masked-in targets counted");
    assert!(masked_in < got.len() * s, "{what}: some targets are masked out");

    let got = drain(&mut Loader::files(&files_cfg(path, s, Packing::Documents), None, &offline_hub(), Shard::SINGLE).unwrap());
    assert_eq!(got, reference_documents(docs, Some(labels), s), "{what}: documents");

    let got = drain(&mut Loader::files(&files_cfg(path, s, Packing::Truncate { pad_id: 0 }), None, &offline_hub(), Shard::SINGLE).unwrap());
    let want: Vec<Sample> = docs
        .iter()
        .zip(labels)
        .filter(|(d, _)| d.len() >= 2)
        .map(|(d, l)| {
            let n = d.len().min(s + 1);
            let mut ids = vec![0u32; s];
            ids[..n.min(s)].copy_from_slice(&d[..n.min(s)]);
            let mut targets = vec![IGNORE; s];
            targets[..n - 1].copy_from_slice(&l[1..n]);
            Sample { ids, targets, doc_starts: vec![] }
        })
        .collect();
    assert_eq!(got, want, "{what}: truncate");
}

#[test]
fn labels_and_loss_mask_from_jsonl() {
    let dir = tempfile::tempdir().unwrap();
    let (docs, labels) = labelled_docs();
    let path = dir.path().join("labels.jsonl");
    write_jsonl(&path, &docs.iter().zip(&labels).map(|(d, l)| serde_json::json!({ "input_ids": d, "labels": l })).collect::<Vec<_>>());
    check_labelled(&path, &docs, &labels, "jsonl labels");

    let path = dir.path().join("mask.jsonl");
    let rows: Vec<_> = docs
        .iter()
        .zip(&labels)
        .map(|(d, l)| serde_json::json!({ "input_ids": d, "loss_mask": l.iter().map(|&x| i64::from(x != IGNORE)).collect::<Vec<_>>() }))
        .collect();
    write_jsonl(&path, &rows);
    check_labelled(&path, &docs, &labels, "jsonl loss_mask");

    // A named column, and `None` that ignores the column.
    let path = dir.path().join("named.jsonl");
    write_jsonl(&path, &docs.iter().zip(&labels).map(|(d, l)| serde_json::json!({ "input_ids": d, "lab": l })).collect::<Vec<_>>());
    let mut cfg = files_cfg(&path, 16, Packing::Concat);
    cfg.labels = LabelSource::Labels("lab".into());
    let got = drain(&mut Loader::files(&cfg, None, &offline_hub(), Shard::SINGLE).unwrap());
    assert_eq!(got, reference_concat_labels(&docs, &labels, 16));
    let path = dir.path().join("labels.jsonl");
    let mut cfg = files_cfg(&path, 16, Packing::Concat);
    cfg.labels = LabelSource::None;
    let got = drain(&mut Loader::files(&cfg, None, &offline_hub(), Shard::SINGLE).unwrap());
    assert!(got.iter().all(|x| x.counted() == 16), "labels off: every target counted");
}

/// input_ids and one more list column (`name`, int64 or int32) per row.
fn write_parquet_ids_with(path: &Path, docs: &[Vec<u32>], extra: &[Vec<i64>], name: &str, int32: bool, rows_per_group: usize) {
    let ty = if int32 { "int32" } else { "int64" };
    let schema = Arc::new(
        parse_message_type(&format!(
            "message m {{ optional group input_ids (LIST) {{ repeated group list {{ optional int64 element; }} }} \
             optional group {name} (LIST) {{ repeated group list {{ optional {ty} element; }} }} }}"
        ))
        .unwrap(),
    );
    let props = Arc::new(WriterProperties::builder().set_compression(Compression::SNAPPY).set_data_page_row_count_limit(3).build());
    let mut w = SerializedFileWriter::new(fs::File::create(path).unwrap(), schema, props).unwrap();
    let levels = |rows: &[Vec<i64>]| {
        let (mut vals, mut def, mut rep) = (Vec::new(), Vec::new(), Vec::new());
        for d in rows {
            for (j, &t) in d.iter().enumerate() {
                vals.push(t);
                def.push(3);
                rep.push(i16::from(j != 0));
            }
        }
        (vals, def, rep)
    };
    let ids: Vec<Vec<i64>> = docs.iter().map(|d| d.iter().map(|&t| t as i64).collect()).collect();
    for (g_ids, g_extra) in ids.chunks(rows_per_group).zip(extra.chunks(rows_per_group)) {
        let mut rg = w.next_row_group().unwrap();
        let (v, d, r) = levels(g_ids);
        let mut col = rg.next_column().unwrap().unwrap();
        col.typed::<Int64Type>().write_batch(&v, Some(&d), Some(&r)).unwrap();
        col.close().unwrap();
        let (v, d, r) = levels(g_extra);
        let mut col = rg.next_column().unwrap().unwrap();
        if int32 {
            let v: Vec<i32> = v.iter().map(|&x| x as i32).collect();
            col.typed::<Int32Type>().write_batch(&v, Some(&d), Some(&r)).unwrap();
        } else {
            col.typed::<Int64Type>().write_batch(&v, Some(&d), Some(&r)).unwrap();
        }
        col.close().unwrap();
        rg.close().unwrap();
    }
    w.close().unwrap();
}

#[test]
fn labels_and_loss_mask_from_parquet() {
    let dir = tempfile::tempdir().unwrap();
    let (docs, labels) = labelled_docs();
    // More rows than one read batch (64) and several row groups, so the label column is
    // read in step with the ids across batches and groups.
    let docs: Vec<Vec<u32>> = docs.iter().cycle().take(150).cloned().collect();
    let labels: Vec<Vec<i64>> = labels.iter().cycle().take(150).cloned().collect();
    for rows_per_group in [7, 100] {
        let path = dir.path().join(format!("labels{rows_per_group}.parquet"));
        write_parquet_ids_with(&path, &docs, &labels, "labels", false, rows_per_group);
        check_labelled(&path, &docs, &labels, "parquet labels");
    }
    let mask: Vec<Vec<i64>> = labels.iter().map(|l| l.iter().map(|&x| i64::from(x != IGNORE)).collect()).collect();
    let path = dir.path().join("mask.parquet");
    write_parquet_ids_with(&path, &docs, &mask, "loss_mask", true, 9);
    check_labelled(&path, &docs, &labels, "parquet loss_mask");
}

#[test]
fn label_errors_name_file_row_and_field() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("bad.jsonl");
    write_jsonl(
        &path,
        &[
            serde_json::json!({ "input_ids": [1, 2, 3], "labels": [1, 2, 3] }),
            serde_json::json!({ "input_ids": [4, 5, 6], "labels": [5, 6] }),
        ],
    );
    let e = first_error(&files_cfg(&path, 2, Packing::Concat));
    assert!(e.contains("bad.jsonl") && e.contains("line 2") && e.contains("`labels` has 2 values but `input_ids` has 3 tokens"), "{e}");

    let path = dir.path().join("mask.jsonl");
    write_jsonl(&path, &[serde_json::json!({ "input_ids": [1, 2, 3], "loss_mask": [1, 2, 0] })]);
    let e = first_error(&files_cfg(&path, 2, Packing::Concat));
    assert!(e.contains("mask.jsonl") && e.contains("line 1") && e.contains("`loss_mask` value 2 at token 1 is not 0 or 1"), "{e}");

    let path = dir.path().join("neg.jsonl");
    write_jsonl(&path, &[serde_json::json!({ "input_ids": [1, 2, 3], "labels": [1, -5, 3] })]);
    let e = first_error(&files_cfg(&path, 2, Packing::Concat));
    assert!(e.contains("`labels` value -5 at token 1 is neither a token id nor -100"), "{e}");

    let path = dir.path().join("missing.jsonl");
    write_jsonl(&path, &[serde_json::json!({ "input_ids": [1, 2, 3] })]);
    let mut cfg = files_cfg(&path, 2, Packing::Concat);
    cfg.labels = LabelSource::Labels("labels".into());
    let e = first_error(&cfg);
    assert!(e.contains("missing.jsonl") && e.contains("line 1") && e.contains("no field `labels`"), "{e}");

    let path = dir.path().join("bad.parquet");
    let docs: Vec<Vec<u32>> = vec![vec![1, 2, 3], vec![4, 5, 6, 7], vec![8, 9]];
    let labels: Vec<Vec<i64>> = vec![vec![1, 2, 3], vec![4, 5, 6], vec![8, 9]];
    write_parquet_ids_with(&path, &docs, &labels, "labels", false, 2);
    let e = first_error(&files_cfg(&path, 2, Packing::Concat));
    assert!(e.contains("bad.parquet") && e.contains("row 1") && e.contains("`labels` has 3 values but `input_ids` has 4 tokens"), "{e}");
}

fn mix_cfg(a: &Path, b: &Path, seed: u64) -> FilesConfig {
    let mut c = files_cfg(a, 8, Packing::Documents);
    c.seed = seed;
    c.mixture = vec![MixSource::new(a.to_str().unwrap(), 3.0), MixSource::new(b.to_str().unwrap(), 1.0)];
    c
}

#[test]
fn mixture_is_deterministic_weighted_and_resumable() {
    let dir = tempfile::tempdir().unwrap();
    let (a, b) = (dir.path().join("a.jsonl"), dir.path().join("b.jsonl"));
    let (da, db) = (make_docs(200, 6, 10_000), make_docs(200, 6, 20_000));
    write_jsonl_ids(&a, &da);
    write_jsonl_ids(&b, &db);
    let run = |seed| drain(&mut Loader::files(&mix_cfg(&a, &b, seed), None, &offline_hub(), Shard::SINGLE).unwrap());
    let first = run(7);
    assert_eq!(first, run(7), "same seed, same stream");
    assert_ne!(first, run(8), "another seed, another interleaving");
    // Every document of both sources appears once, in its source's order (only the tail
    // shorter than a sample is dropped): the tokens of each source form a prefix of it.
    let ids: Vec<u32> = first.iter().flat_map(|s| s.ids.iter().copied()).collect();
    let from_a: Vec<u32> = ids.iter().copied().filter(|&t| t < 20_000).collect();
    let from_b: Vec<u32> = ids.iter().copied().filter(|&t| t > 20_000).collect();
    let (sa, sb) = (da.concat(), db.concat());
    assert!(is_subsequence(&from_a, &sa) && is_subsequence(&from_b, &sb));
    // Each sample's last raw token is only a target, and the tail under S+1 is dropped.
    assert!(sa.len() + sb.len() - (ids.len() + first.len()) < 9, "both sources are read to their end");
    // Early on, source a (weight 3) gives about 3 of every 4 documents.
    let early: Vec<u32> = first[..60].iter().flat_map(|s| s.ids.iter().copied()).collect();
    let share_a = early.iter().filter(|&&t| t < 20_000).count() as f64 / early.len() as f64;
    assert!((0.6..0.9).contains(&share_a), "share of source a in the first samples: {share_a}");

    // Resume after k samples continues with the same samples.
    let cfg = FilesConfig { max_epochs: None, ..mix_cfg(&a, &b, 7) };
    let mut whole = Loader::files(&cfg, None, &offline_hub(), Shard::SINGLE).unwrap();
    let all: Vec<Sample> = (0..first.len() + 10).map(|_| whole.next_sample().unwrap().unwrap()).collect();
    for k in [0usize, 5, 33, first.len() - 1, first.len() + 3] {
        let mut l = Loader::files(&cfg, None, &offline_hub(), Shard::SINGLE).unwrap();
        for _ in 0..k {
            l.next_sample().unwrap();
        }
        let state = l.state();
        let mut resumed = Loader::files(&cfg, None, &offline_hub(), Shard::SINGLE).unwrap();
        resumed.restore(&state).unwrap();
        let next: Vec<Sample> = (0..5).map(|_| resumed.next_sample().unwrap().unwrap()).collect();
        assert_eq!(next, all[k..k + 5], "resumed after {k} samples");
    }
    // Two data-parallel ranks split the same mixed stream.
    let r: Vec<Vec<Sample>> = (0..2)
        .map(|rank| drain(&mut Loader::files(&mix_cfg(&a, &b, 7), None, &offline_hub(), Shard { rank, world: 2 }).unwrap()))
        .collect();
    assert_eq!(r[0][..], first.iter().step_by(2).take(r[0].len()).cloned().collect::<Vec<_>>()[..]);
    assert_eq!(r[1][..], first.iter().skip(1).step_by(2).take(r[1].len()).cloned().collect::<Vec<_>>()[..]);
}

fn is_subsequence(part: &[u32], whole: &[u32]) -> bool {
    let mut it = whole.iter();
    part.iter().all(|p| it.any(|w| w == p))
}

#[test]
fn mixture_filters_and_upsampling() {
    let dir = tempfile::tempdir().unwrap();
    let (a, b) = (dir.path().join("a.jsonl"), dir.path().join("b.jsonl"));
    let da: Vec<Vec<u32>> = (0..40u32).map(|i| (0..1 + i % 10).map(|j| 1000 + 20 * i + j).collect()).collect();
    let db: Vec<Vec<u32>> = (0..40u32).map(|i| vec![5000 + 2 * i, 5001 + 2 * i]).collect();
    write_jsonl_ids(&a, &da);
    write_jsonl_ids(&b, &db);
    let mut cfg = mix_cfg(&a, &b, 1);
    cfg.mixture[0].min_tokens = Some(3);
    cfg.mixture[0].max_tokens = Some(8);
    cfg.mixture[0].upsample = 3;
    cfg.mixture[0].upsample_min_tokens = 7;
    // Concat, one token per sample plus its target: the samples spell the mixed stream.
    cfg.packing = Packing::Concat;
    cfg.seq_len = 1;
    let got = drain(&mut Loader::files(&cfg, None, &offline_hub(), Shard::SINGLE).unwrap());
    let stream: Vec<u32> = got.iter().flat_map(|s| [s.ids[0], s.targets[0] as u32]).collect();
    let toks_a: Vec<u32> = stream.iter().copied().filter(|&t| (1000..5000).contains(&t)).collect();
    let toks_b: Vec<u32> = stream.iter().copied().filter(|&t| t >= 5000).collect();
    // Source a: documents under 3 tokens skipped, cut at 8, those of ≥ 7 tokens thrice in a row.
    let mut want_a = Vec::new();
    for d in &da {
        if d.len() < 3 {
            continue;
        }
        let d = &d[..d.len().min(8)];
        for _ in 0..if d.len() >= 7 { 3 } else { 1 } {
            want_a.extend_from_slice(d);
        }
    }
    let want_b = db.concat();
    // Only the last token of the mixed stream may be missing (a tail shorter than S+1).
    assert!(want_a.starts_with(&toks_a) && toks_a.len() + 1 >= want_a.len(), "source a: {} of {} tokens", toks_a.len(), want_a.len());
    assert!(want_b.starts_with(&toks_b) && toks_b.len() + 1 >= want_b.len());
    assert!(toks_a.len() + toks_b.len() + 1 >= want_a.len() + want_b.len());
}

#[test]
fn mixture_and_reset_errors_name_the_field() {
    let dir = tempfile::tempdir().unwrap();
    let (a, b) = (dir.path().join("a.jsonl"), dir.path().join("b.jsonl"));
    write_jsonl_ids(&a, &make_docs(10, 5, 10));
    write_jsonl_ids(&b, &make_docs(10, 5, 1000));
    for w in [0.0, -1.0, f64::NAN, f64::INFINITY] {
        let mut cfg = mix_cfg(&a, &b, 1);
        cfg.mixture[1].weight = w;
        let e = first_error(&cfg);
        assert!(e.contains("data.source[1].weight") && e.contains("finite number > 0"), "{w}: {e}");
    }
    let mut cfg = files_cfg(&a, 4, Packing::Concat);
    cfg.reset_positions = Some(true);
    let e = first_error(&cfg);
    assert!(e.contains("data.reset_positions") && e.contains("`concat`") && e.contains("data.packing = \"documents\""), "{e}");
    cfg.packing = Packing::Truncate { pad_id: 0 };
    assert!(first_error(&cfg).contains("`truncate`"));

    // The same through the run config's validation (TOML).
    let toml_cfg = |data: &str| {
        let p = dir.path().join("run.toml");
        fs::write(&p, format!("{data}\n[[stage]]\nseq_length = 16\nrope_theta = 1e4\nsteps = 1\n")).unwrap();
        RunConfig::from_file(&p).and_then(|c| c.validate(&p).map(|_| c))
    };
    let e = toml_cfg("[data]\npacking = \"concat\"\nreset_positions = true").unwrap_err().to_string();
    assert!(e.contains("run.toml") && e.contains("data.reset_positions") && e.contains("set data.packing = \"documents\""), "{e}");
    let e = toml_cfg(&format!("[[data.source]]\ndataset = {:?}\nweight = 0.7\n[[data.source]]\ndataset = {:?}\nweight = -2", a, b))
        .unwrap_err()
        .to_string();
    assert!(e.contains("data.source[1].weight") && e.contains("got -2"), "{e}");
    let e = toml_cfg(&format!("[data]\ndataset = {a:?}\n[[data.source]]\ndataset = {b:?}\nweight = 1")).unwrap_err().to_string();
    assert!(e.contains("data.dataset") && e.contains("replaces data.dataset"), "{e}");
    let e = toml_cfg("[data]\nlabels_column = \"l\"\nloss_mask_column = \"m\"").unwrap_err().to_string();
    assert!(e.contains("data.loss_mask_column") && e.contains("keep one"), "{e}");
    let e = toml_cfg("[data]\npacking = \"pack\"").unwrap_err().to_string();
    assert!(e.contains("data.packing"), "{e}");

    // A valid mixture config: stages read it, and `configure` carries it to the loader.
    let c = toml_cfg(&format!(
        "[data]\npacking = \"documents\"\nlabels_column = \"lab\"\n[[data.source]]\ndataset = {a:?}\nweight = 0.7\nmin_tokens = 2\n\
         [[data.source]]\ndataset = {b:?}\nweight = 0.3\nupsample = 2\nupsample_min_tokens = 4"
    ))
    .unwrap();
    assert_eq!(c.data.packing, PackingMode::Documents);
    let s = c.stage_settings(0);
    assert!(s.mixture);
    assert_eq!(s.dataset, a.to_str().unwrap());
    let mut f = FilesConfig::new(s.dataset.clone(), s.seq_length);
    c.data.configure(&mut f, &s);
    assert_eq!(f.packing, Packing::Documents);
    assert!(f.resets_positions());
    assert_eq!(f.labels, LabelSource::Labels("lab".into()));
    assert_eq!(f.mixture.len(), 2);
    assert_eq!((f.mixture[0].min_tokens, f.mixture[1].upsample, f.mixture[1].upsample_min_tokens), (Some(2), 2, 4));
    // A round trip through the printed config keeps it.
    let back: RunConfig = toml::from_str(&toml::to_string_pretty(&c).unwrap()).unwrap();
    assert_eq!(back.data, c.data);
}

#[test]
fn raw_token_files_are_refused_by_documents_packing() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("t.bin");
    fs::write(&path, (0u16..64).flat_map(|t| t.to_le_bytes()).collect::<Vec<u8>>()).unwrap();
    let e = first_error(&files_cfg(&path, 4, Packing::Documents));
    assert!(e.contains("documents packing needs document boundaries") && e.contains("use concat packing"), "{e}");
}

#[test]
fn planner_peek_measures_documents_and_attention_work() {
    let s = 5;
    let mk = |starts: Vec<u32>| Sample { ids: vec![0; s], targets: vec![0; s], doc_starts: starts };
    let samples = vec![mk(vec![0, 3, 4]), mk(vec![0]), mk(vec![])];
    let p = longctx::plan::document_peek(&samples, s, 2);
    assert_eq!(p.samples, 3);
    assert!((p.docs_per_sample - 5.0 / 3.0).abs() < 1e-12);
    // (9 + 1 + 1) / 25, 1, 1 -> mean
    assert!((p.attention_ratio - (11.0 / 25.0 + 2.0) / 3.0).abs() < 1e-12, "{}", p.attention_ratio);
    let line = longctx::plan::describe_document_peek(&p);
    assert!(
        line.contains("1.67 documents per sample") && line.contains("0.813×") && line.contains("2 document(s) longer than a sample"),
        "{line}"
    );
    let quiet = longctx::plan::describe_document_peek(&longctx::plan::DocumentPeek { long_docs: 0, ..p });
    assert!(!quiet.contains("longer than"));
}

/// `train --dry-run` with documents packing prints the peek of stage 0's first samples:
/// the same numbers as the library's peek over the same pipeline, and the split note.
#[test]
fn dry_run_reports_documents_per_sample() {
    let dir = tempfile::tempdir().unwrap();
    let data = dir.path().join("d.jsonl");
    let mut docs = make_docs(80, 6, 10);
    docs.insert(3, (100..150).collect()); // longer than a sample of 16 + 1
    write_jsonl_ids(&data, &docs);
    let cfg_path = dir.path().join("run.toml");
    let toml = format!(
        "output_dir = {:?}\n[model]\nsource = \"builtin:tiny\"\n[data]\ndataset = {data:?}\npacking = \"documents\"\n\
         [[stage]]\nseq_length = 16\nrope_theta = 1e4\nsteps = 1\n",
        dir.path().join("out")
    );
    fs::write(&cfg_path, toml).unwrap();
    let o = ok(&["train", "--config", cfg_path.to_str().unwrap(), "--dry-run"]);
    let line = o.stdout.lines().find(|l| l.contains("documents packing:")).unwrap_or_else(|| panic!("no peek line:\n{}", o.stdout));

    // The library's peek over the trainer's pipeline for stage 0.
    let c = RunConfig::from_file(&cfg_path).unwrap();
    let s = c.stage_settings(0);
    let m = longctx::hub::ModelConfig::builtin("tiny").unwrap();
    let mut spec = longctx::train::trainer::stage_data_spec(&c, &m.cfg, &s).unwrap();
    let longctx::data::DataSpec::Files(f) = &mut spec else { panic!("files expected") };
    c.data.configure(f, &s);
    f.shuffle_buffer = 0;
    let mut loader = Loader::new(&spec, None, Shard::SINGLE).unwrap();
    let samples: Vec<Sample> = (0..16).map(|_| loader.next_sample().unwrap().unwrap()).collect();
    let p = longctx::plan::document_peek(&samples, 16, loader.pack_stats().long_docs);
    assert!(p.docs_per_sample > 2.0 && p.attention_ratio < 0.6, "{p:?}");
    assert_eq!(p.long_docs, 1);
    assert_eq!(line.trim_start_matches('#').trim(), longctx::plan::describe_document_peek(&p));
    assert!(line.contains("1 document(s) longer than a sample were split"), "{line}");
    // The printed config reads back (the peek lines are comments) with the packing kept.
    let back: RunConfig = toml::from_str(&o.stdout).unwrap();
    assert_eq!(back.data.packing, PackingMode::Documents);
}

/// Arrow files (the `save_to_disk` fixture, which has no label column of its own): a
/// label column is read row for row with the ids. Its `input_ids` named as the labels give
/// the targets of no labels; named as a 0/1 mask they are refused naming file, row and
/// column; a text column as labels is refused.
#[test]
fn arrow_label_columns_are_read_row_for_row() {
    let fx = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/arrow_dataset");
    let mut cfg = FilesConfig::new(fx.to_str().unwrap(), 7);
    (cfg.shuffle_buffer, cfg.max_epochs, cfg.split) = (0, Some(1), Some("train".into()));
    for packing in [Packing::Concat, Packing::Documents] {
        cfg.packing = packing;
        cfg.labels = LabelSource::Auto;
        let auto = drain(&mut Loader::files(&cfg, None, &offline_hub(), Shard::SINGLE).unwrap());
        assert!(!auto.is_empty());
        cfg.labels = LabelSource::Labels("input_ids".into());
        assert_eq!(drain(&mut Loader::files(&cfg, None, &offline_hub(), Shard::SINGLE).unwrap()), auto);
    }
    cfg.labels = LabelSource::LossMask("input_ids".into());
    let e = first_error(&cfg);
    assert!(e.contains(".arrow") && e.contains("row 0") && e.contains("`input_ids` value") && e.contains("is not 0 or 1"), "{e}");
    cfg.labels = LabelSource::Labels("text".into());
    let e = first_error(&cfg);
    assert!(e.contains(".arrow") && e.contains("labels column `text` is text"), "{e}");
}

/// Documents packing through the shuffle buffer and two data-parallel ranks: a loader
/// restored from a saved cursor yields exactly the samples the uninterrupted one does
/// (the document starts are derived from the data, so they come back too).
#[test]
fn documents_packing_resumes_exactly_with_shuffle_and_ranks() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("d.jsonl");
    write_jsonl_ids(&path, &make_docs(150, 20, 10));
    let mut cfg = files_cfg(&path, 12, Packing::Documents);
    (cfg.shuffle_buffer, cfg.max_epochs, cfg.seed) = (5, None, 3);
    for rank in 0..2 {
        let shard = Shard { rank, world: 2 };
        let mut whole = Loader::files(&cfg, None, &offline_hub(), shard).unwrap();
        let all: Vec<Sample> = (0..60).map(|_| whole.next_sample().unwrap().unwrap()).collect();
        assert!(all.iter().any(|s| s.doc_starts.len() > 2));
        for k in [1usize, 17, 40] {
            let mut l = Loader::files(&cfg, None, &offline_hub(), shard).unwrap();
            (0..k).for_each(|_| drop(l.next_sample().unwrap()));
            let mut resumed = Loader::files(&cfg, None, &offline_hub(), shard).unwrap();
            resumed.restore(&l.state()).unwrap();
            let next: Vec<Sample> = (0..10).map(|_| resumed.next_sample().unwrap().unwrap()).collect();
            assert_eq!(next, all[k..k + 10], "rank {rank}, resumed after {k}");
        }
    }
}

#[test]
fn text_with_a_named_label_column_is_refused_and_stages_keep_their_own_dataset() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("t.jsonl");
    write_jsonl(&path, &[serde_json::json!({ "text": "a b c", "labels": [1, 2, 3] })]);
    let mut cfg = files_cfg(&path, 2, Packing::Concat);
    cfg.labels = LabelSource::Labels("labels".into());
    let e = first_error(&cfg);
    assert!(e.contains("t.jsonl") && e.contains("line 1") && e.contains("need pre-tokenized token ids"), "{e}");

    let p = dir.path().join("run.toml");
    fs::write(
        &p,
        "[[data.source]]\ndataset = \"a.jsonl\"\nweight = 1\n[[data.source]]\ndataset = \"b.jsonl\"\nweight = 2\n\
         [[stage]]\nseq_length = 16\nrope_theta = 1e4\nsteps = 1\n\
         [[stage]]\nseq_length = 32\nrope_theta = 1e5\nsteps = 1\ndataset = \"own.jsonl\"\n",
    )
    .unwrap();
    let c = RunConfig::from_file(&p).unwrap();
    c.validate(&p).unwrap();
    let (s0, s1) = (c.stage_settings(0), c.stage_settings(1));
    assert!(s0.mixture && !s1.mixture);
    assert_eq!((s0.dataset.as_str(), s1.dataset.as_str()), ("a.jsonl", "own.jsonl"));
    let mut f = FilesConfig::new(s1.dataset.clone(), 32);
    c.data.configure(&mut f, &s1);
    assert!(f.mixture.is_empty());
    assert_eq!(c.data.packing(), Packing::Concat);
    assert!(!f.resets_positions());
}
