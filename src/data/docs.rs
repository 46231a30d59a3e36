//! Documents: what every file reader yields, the chain over a dataset's files, and
//! the turn from a document into token ids (tokenizer, BOS/EOS, vocabulary check).
//!
//! Readers are lazy: a file is opened when the previous one is exhausted, and each
//! reader holds at most one document (or one parquet record batch) in memory.

use std::fmt;
use std::path::{Path, PathBuf};
use std::sync::Arc;

use tokenizers::Tokenizer;

use super::source::{Format, TokenWidth};
use super::{arrow, jsonl, parquet, text, tokens};
use crate::{Error, Result};

/// What a document holds.
#[derive(Debug, Clone, PartialEq)]
pub enum Content {
    /// Text to tokenize.
    Text(String),
    /// Pre-tokenized ids of one document.
    Ids(Vec<u32>),
    /// Pre-tokenized ids with per-token labels (`labels[i]` = the label of token i, HF
    /// convention; [`super::IGNORE`] = not counted), from a `labels` or `loss_mask` column.
    Labeled(Vec<u32>, Vec<i64>),
    /// A piece of a raw token stream (no document boundary: no BOS/EOS is added).
    Stream(Vec<u32>),
}

/// Where in its file a document came from, for error messages.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Loc {
    /// 1-based line of a JSON lines file.
    Line(u64),
    /// 0-based row of a parquet file.
    Row(u64),
    /// 1-based blank-line-separated paragraph of a text file.
    Paragraph(u64),
    /// The whole file.
    File,
    /// 0-based token offset in a raw token file.
    Token(u64),
}

impl fmt::Display for Loc {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Loc::Line(n) => write!(f, "line {n}"),
            Loc::Row(n) => write!(f, "row {n}"),
            Loc::Paragraph(n) => write!(f, "paragraph {n}"),
            Loc::File => write!(f, "whole file"),
            Loc::Token(n) => write!(f, "token offset {n}"),
        }
    }
}

/// One document and where it came from.
#[derive(Debug, Clone)]
pub struct Doc {
    pub content: Content,
    pub file: Arc<Path>,
    pub loc: Loc,
}

/// How plain text files are cut into documents.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, serde::Serialize, serde::Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum TextSplit {
    /// One document per file (books, articles).
    #[default]
    File,
    /// One document per paragraph: runs of non-blank lines separated by blank lines.
    Paragraph,
}

/// How to read documents out of files.
#[derive(Debug, Clone)]
pub struct ReadOptions {
    pub format: Format,
    /// JSON field / parquet column; `None` = `input_ids` if present, else `text`.
    pub column: Option<String>,
    pub text_split: TextSplit,
    pub token_width: TokenWidth,
}

/// Where per-token labels come from, for pre-tokenized `input_ids` data.
///
/// - `Auto` (the default): a `labels` column (list of ints, same length as the ids,
///   -100 = not counted) when the file has one, else a `loss_mask` column (0/1 per
///   token) when it has one, else none (every target counted).
/// - `None`: no labels, even if the file has such columns.
/// - `Labels(col)` / `LossMask(col)`: that column, which every row must have.
///
/// Text documents take no labels (an explicit column with text data is an error).
#[derive(Debug, Clone, Default, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum LabelSource {
    #[default]
    Auto,
    None,
    Labels(String),
    LossMask(String),
}

/// The label column one file uses: its name and whether it is a 0/1 mask.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct LabelCol {
    pub name: String,
    pub is_mask: bool,
    /// Named by the config (a row without it is an error) rather than found.
    pub explicit: bool,
}

impl LabelSource {
    /// The label column of a file whose columns/fields include `has(name)`.
    pub(crate) fn pick(&self, has: impl Fn(&str) -> bool) -> Option<LabelCol> {
        let col = |name: &str, is_mask, explicit| Some(LabelCol { name: name.to_string(), is_mask, explicit });
        match self {
            LabelSource::None => None,
            LabelSource::Labels(c) => col(c, false, true),
            LabelSource::LossMask(c) => col(c, true, true),
            LabelSource::Auto if has("labels") => col("labels", false, false),
            LabelSource::Auto if has("loss_mask") => col("loss_mask", true, false),
            LabelSource::Auto => None,
        }
    }
}

/// Pairs a document's ids with the values of its label column (checked: same length,
/// labels are -100 or ≥ 0, a mask is 0/1); `at` names the file position for errors.
pub(crate) fn labeled(ids: Vec<u32>, values: Vec<i64>, col: &LabelCol, ids_field: &str, file: &Path, at: &str) -> Result<Content> {
    if values.len() != ids.len() {
        return Err(Error::data(
            file,
            format!(
                "{at}: `{}` has {} values but `{ids_field}` has {} tokens; they must have the same length (one per token)",
                col.name,
                values.len(),
                ids.len()
            ),
        ));
    }
    let labels = if col.is_mask {
        let mut out = Vec::with_capacity(ids.len());
        for (i, (&t, &m)) in ids.iter().zip(&values).enumerate() {
            out.push(match m {
                1 => t as i64,
                0 => super::IGNORE,
                _ => {
                    return Err(Error::data(file, format!("{at}: `{}` value {m} at token {i} is not 0 or 1", col.name)));
                }
            });
        }
        out
    } else {
        if let Some((i, &bad)) = values.iter().enumerate().find(|(_, &v)| v < 0 && v != super::IGNORE) {
            return Err(Error::data(
                file,
                format!("{at}: `{}` value {bad} at token {i} is neither a token id nor -100 (not counted)", col.name),
            ));
        }
        values
    };
    Ok(Content::Labeled(ids, labels))
}

/// A reader over one file.
pub type FileDocs = Box<dyn Iterator<Item = Result<Doc>>>;

fn open_file(path: &Path, opts: &ReadOptions, labels: &LabelSource) -> Result<FileDocs> {
    let file: Arc<Path> = Arc::from(path);
    Ok(match opts.format {
        Format::Jsonl => Box::new(jsonl::JsonlDocs::open(file, opts.column.clone())?.with_labels(labels.clone())),
        Format::Text => Box::new(text::TextDocs::open(file, opts.text_split)?),
        Format::Parquet => Box::new(parquet::ParquetDocs::open_with_labels(file, opts.column.clone(), labels)?),
        Format::Tokens => Box::new(tokens::TokenFileDocs::open(file, opts.token_width)?),
        Format::Arrow => Box::new(arrow::ArrowDocs::open_with_labels(file, opts.column.clone(), labels)?),
    })
}

/// The documents of several files, one after the other.
pub struct MultiFileDocs {
    files: Vec<PathBuf>,
    next_file: usize,
    current: Option<FileDocs>,
    opts: ReadOptions,
    labels: LabelSource,
}

impl MultiFileDocs {
    /// Documents without labels ([`LabelSource::None`]).
    pub fn new(files: Vec<PathBuf>, opts: ReadOptions) -> Self {
        Self { files, next_file: 0, current: None, opts, labels: LabelSource::None }
    }

    /// Reads per-token labels as `labels` says (jsonl, parquet and Arrow files).
    pub fn with_labels(mut self, labels: LabelSource) -> Self {
        self.labels = labels;
        self
    }
}

impl Iterator for MultiFileDocs {
    type Item = Result<Doc>;
    fn next(&mut self) -> Option<Result<Doc>> {
        loop {
            if let Some(cur) = self.current.as_mut() {
                match cur.next() {
                    Some(item) => return Some(item),
                    None => self.current = None,
                }
            }
            let path = self.files.get(self.next_file)?;
            self.next_file += 1;
            match open_file(path, &self.opts, &self.labels) {
                Ok(docs) => self.current = Some(docs),
                Err(e) => return Some(Err(e)),
            }
        }
    }
}

/// Turns documents into token ids.
#[derive(Clone, Default)]
pub struct Tokenize {
    pub tokenizer: Option<Arc<Tokenizer>>,
    /// Prepended to every document (not to raw stream pieces) unless it starts with it
    /// already (text whose tokenizer adds the same BOS, see [`crate::hub::tokenizer`]).
    pub bos: Option<u32>,
    /// Appended to every document (not to raw stream pieces) unless it ends with it already.
    pub eos: Option<u32>,
    /// When set, every id must be below it.
    pub vocab_size: Option<usize>,
}

/// Token ids of one document; `is_stream` marks a raw stream piece (no boundaries).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TokenDoc {
    pub ids: Vec<u32>,
    pub is_stream: bool,
    /// Per-token labels (`labels[i]` = the label of token i; [`super::IGNORE`] = not
    /// counted), when the data has a labels or loss-mask column.
    pub labels: Option<Vec<i64>>,
}

impl Tokenize {
    pub fn apply(&self, doc: Doc) -> Result<TokenDoc> {
        let where_ = |doc_loc: Loc| doc_loc.to_string();
        let mut labels = None;
        let (body, is_stream) = match doc.content {
            Content::Stream(ids) => (ids, true),
            Content::Ids(ids) => (ids, false),
            Content::Labeled(ids, l) => {
                labels = Some(l);
                (ids, false)
            }
            Content::Text(text) => {
                let Some(tok) = &self.tokenizer else {
                    return Err(Error::data(&*doc.file, format!("{}: the dataset holds text but no tokenizer was given", where_(doc.loc))));
                };
                // With the special tokens the tokenizer adds, as transformers' tokenizer(text).
                let ids = crate::hub::tokenizer::encode_text(tok, text.as_str())
                    .map_err(|e| Error::data(&*doc.file, format!("{}: tokenizer failed: {e}", where_(doc.loc))))?;
                (ids, false)
            }
        };
        if let Some(v) = self.vocab_size {
            if let Some((i, &bad)) = body.iter().enumerate().find(|(_, &t)| t as usize >= v) {
                let at = match doc.loc {
                    Loc::Token(off) => format!("token offset {}", off + i as u64),
                    loc => format!("{loc}, token {i}"),
                };
                return Err(Error::data(&*doc.file, format!("{at}: token id {bad} is not below the vocabulary size {v}")));
            }
            if let Some((i, &bad)) = labels.iter().flatten().enumerate().find(|(_, &l)| l >= v as i64) {
                return Err(Error::data(&*doc.file, format!("{}, token {i}: label {bad} is not below the vocabulary size {v}", doc.loc)));
            }
        }
        if is_stream {
            return Ok(TokenDoc { ids: body, is_stream, labels: None });
        }
        // `bos`/`eos` where the tokenizer has not already put the same token there; an
        // added token's label is the token itself (counted, as without labels).
        let bos = self.bos.filter(|b| body.first() != Some(b));
        let eos = self.eos.filter(|e| body.last() != Some(e));
        let mut ids = Vec::with_capacity(body.len() + 2);
        ids.extend(bos);
        ids.extend_from_slice(&body);
        ids.extend(eos);
        let labels = labels.map(|l| {
            let mut out = Vec::with_capacity(ids.len());
            out.extend(bos.map(|b| b as i64));
            out.extend(l);
            out.extend(eos.map(|e| e as i64));
            out
        });
        Ok(TokenDoc { ids, is_stream, labels })
    }
}

/// Checks a JSON/parquet integer as a token id.
pub(crate) fn token_id(v: i64, file: &Path, loc: Loc, field: &str) -> Result<u32> {
    u32::try_from(v)
        .map_err(|_| Error::data(file, format!("{loc}: `{field}` holds {v}, which is not a token id (expected 0..=4294967295)")))
}
