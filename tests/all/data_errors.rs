//! Bad dataset input: each case must fail with a message naming the file and the problem.

use std::fs;
use std::io::Write;
use std::path::Path;
use std::sync::Arc;

use longctx::data::{FilesConfig, Loader, Packing, Shard, TokenWidth};

use parquet::data_type::Int32Type;
use parquet::file::properties::WriterProperties;
use parquet::file::writer::SerializedFileWriter;
use parquet::schema::parser::parse_message_type;

use crate::common;
use common::*;

/// Runs a loader over `cfg` to the first error (at construction or while reading).
fn first_error(cfg: &FilesConfig) -> String {
    let mut loader = match Loader::files(cfg, None, &offline_hub(), Shard::SINGLE) {
        Ok(l) => l,
        Err(e) => return e.to_string(),
    };
    for _ in 0..10_000 {
        match loader.next_sample() {
            Ok(Some(_)) => {}
            Ok(None) => panic!("expected an error, the data ended cleanly"),
            Err(e) => return e.to_string(),
        }
    }
    panic!("expected an error, got 10000 samples")
}

fn assert_mentions(err: &str, file: &Path, parts: &[&str]) {
    assert!(err.contains(&file.display().to_string()), "error does not name the file {}: {err}", file.display());
    for p in parts {
        assert!(err.contains(p), "error does not mention `{p}`: {err}");
    }
}

fn cfg(path: &Path, seq_len: usize) -> FilesConfig {
    let mut c = FilesConfig::new(path.to_str().unwrap(), seq_len);
    c.shuffle_buffer = 0;
    c
}

#[test]
fn parquet_without_the_named_column() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("p.parquet");
    let schema = Arc::new(parse_message_type("message m { required int32 label; }").unwrap());
    let props = Arc::new(WriterProperties::builder().build());
    let mut w = SerializedFileWriter::new(fs::File::create(&path).unwrap(), schema, props).unwrap();
    let mut rg = w.next_row_group().unwrap();
    let mut col = rg.next_column().unwrap().unwrap();
    col.typed::<Int32Type>().write_batch(&[1, 2, 3], None, None).unwrap();
    col.close().unwrap();
    rg.close().unwrap();
    w.close().unwrap();
    let err = first_error(&cfg(&path, 4));
    assert_mentions(&err, &path, &["no column `text`", "label"]);
    let mut c = cfg(&path, 4);
    c.column = Some("tokens".into());
    assert_mentions(&first_error(&c), &path, &["no column `tokens`"]);
    // A column of the wrong shape: a scalar int is not a list of token ids.
    c.column = Some("label".into());
    assert_mentions(&first_error(&c), &path, &["column `label`", "expected a string column"]);
}

#[test]
fn jsonl_without_the_named_field() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("d.jsonl");
    fs::write(&path, "{\"input_ids\": [1, 2]}\n{\"content\": [3]}\n").unwrap();
    let mut c = cfg(&path, 4);
    assert_mentions(&first_error(&c), &path, &["line 2", "no field `input_ids` or `text`", "content"]);
    c.column = Some("input_ids".into());
    assert_mentions(&first_error(&c), &path, &["line 2", "no field `input_ids`", "content"]);
    c.column = Some("body".into());
    assert_mentions(&first_error(&c), &path, &["line 1", "no field `body`"]);
}

#[test]
fn jsonl_line_that_is_not_json() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("d.jsonl");
    let mut f = fs::File::create(&path).unwrap();
    writeln!(f, "{{\"input_ids\": [1, 2, 3]}}").unwrap();
    writeln!(f).unwrap();
    writeln!(f, "{{\"input_ids\": [4, 5, 6]}}").unwrap();
    writeln!(f, "{{\"input_ids\": [7, 8,").unwrap();
    drop(f);
    assert_mentions(&first_error(&cfg(&path, 2)), &path, &["line 4", "not valid JSON"]);
}

#[test]
fn jsonl_negative_token_id() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("d.jsonl");
    fs::write(&path, "{\"input_ids\": [1, -2, 3]}\n").unwrap();
    assert_mentions(&first_error(&cfg(&path, 2)), &path, &["line 1", "-2", "not a token id"]);
}

#[test]
fn empty_dataset_and_too_few_tokens() {
    let dir = tempfile::tempdir().unwrap();
    let empty = dir.path().join("empty.jsonl");
    fs::write(&empty, "\n\n").unwrap();
    assert_mentions(&first_error(&cfg(&empty, 8)), &empty, &["too small", "0 documents", "fewer than one"]);
    let small = dir.path().join("small.jsonl");
    fs::write(&small, "{\"input_ids\": [1, 2, 3, 4]}\n{\"input_ids\": [5, 6, 7]}\n").unwrap();
    assert_mentions(&first_error(&cfg(&small, 8)), &small, &["2 documents", "7 tokens", "seq_len+1 = 9", "fewer than one"]);
    // Enough for one sample, not for one per data-parallel rank: not an error (issue #33),
    // a group of ranks spans epochs, so the two ranks take the samples of two consecutive
    // epochs, as one rank's stream has them.
    let mut one = Loader::files(&cfg(&small, 3), None, &offline_hub(), Shard::SINGLE).unwrap();
    let stream = [one.next_sample().unwrap().unwrap(), one.next_sample().unwrap().unwrap()];
    for (rank, want) in stream.iter().enumerate() {
        let mut loader = Loader::files(&cfg(&small, 3), None, &offline_hub(), Shard { rank, world: 2 }).unwrap();
        assert_eq!(loader.next_sample().unwrap().as_ref(), Some(want), "rank {rank} of 2");
    }
    // An empty directory names the directory.
    let d = dir.path().join("nothing");
    fs::create_dir(&d).unwrap();
    assert_mentions(&first_error(&cfg(&d, 8)), &d, &["no dataset files"]);
}

#[test]
fn raw_token_file_with_partial_token() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("t.bin");
    fs::write(&path, [0u8; 10]).unwrap();
    let mut c = cfg(&path, 2);
    c.token_width = TokenWidth::U32;
    assert_mentions(&first_error(&c), &path, &["size 10 bytes", "not a multiple of 4"]);
    fs::write(&path, [0u8; 7]).unwrap();
    c.token_width = TokenWidth::U16;
    assert_mentions(&first_error(&c), &path, &["size 7 bytes", "not a multiple of 2"]);
}

#[test]
fn token_id_not_below_vocab_size() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("d.jsonl");
    fs::write(&path, "{\"input_ids\": [1, 2, 3]}\n{\"input_ids\": [4, 500, 6]}\n").unwrap();
    let mut c = cfg(&path, 2);
    c.vocab_size = Some(256);
    assert_mentions(&first_error(&c), &path, &["line 2", "token id 500", "vocabulary size 256"]);
    // Raw token files report the absolute token offset.
    let bin = dir.path().join("t.bin");
    let bytes: Vec<u8> = [1u16, 2, 3, 300, 4].iter().flat_map(|t| t.to_le_bytes()).collect();
    fs::write(&bin, bytes).unwrap();
    let mut c = cfg(&bin, 2);
    c.vocab_size = Some(256);
    assert_mentions(&first_error(&c), &bin, &["token offset 3", "token id 300"]);
}

#[test]
fn truncation_of_a_raw_stream_and_text_without_tokenizer() {
    let dir = tempfile::tempdir().unwrap();
    let bin = dir.path().join("t.bin");
    fs::write(&bin, [1u8; 16]).unwrap();
    let mut c = cfg(&bin, 2);
    c.packing = Packing::Truncate { pad_id: 0 };
    assert!(first_error(&c).contains("truncation packing needs document boundaries"));
    let txt = dir.path().join("a.txt");
    fs::write(&txt, "hello world").unwrap();
    assert_mentions(&first_error(&cfg(&txt, 2)), &txt, &["no tokenizer"]);
}
