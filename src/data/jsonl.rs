//! JSON lines: one JSON object per line, the document in a field that is either a
//! string (text, tokenized later) or an array of integers (token ids).
//! The field is configurable; by default `input_ids` if the line has it, else `text`.
//! Blank lines are skipped. Lines are read one at a time (streaming), through a gzip
//! (`.jsonl.gz`) or zstd (`.jsonl.zst`, `.jsonl.zstd`) decoder when the name says so.

use std::fs::File;
use std::io::{BufRead, BufReader, Read};
use std::path::Path;
use std::sync::Arc;

use serde_json::Value;

use super::docs::{labeled, token_id, Content, Doc, LabelSource, Loc};
use crate::{Error, Result};

pub struct JsonlDocs {
    file: Arc<Path>,
    reader: BufReader<Box<dyn Read + Send>>,
    column: Option<String>,
    line_no: u64,
    buf: Vec<u8>,
    done: bool,
    labels: LabelSource,
}

impl JsonlDocs {
    pub fn open(file: Arc<Path>, column: Option<String>) -> Result<Self> {
        let f = File::open(&file).map_err(|e| Error::io(&*file, e))?;
        let name = file.file_name().map(|n| n.to_string_lossy().to_ascii_lowercase()).unwrap_or_default();
        let raw: Box<dyn Read + Send> = if name.ends_with(".gz") {
            Box::new(flate2::read::MultiGzDecoder::new(BufReader::new(f)))
        } else if name.ends_with(".zst") || name.ends_with(".zstd") {
            Box::new(zstd::stream::read::Decoder::new(f).map_err(|e| Error::data(&*file, format!("not a zstd stream ({e})")))?)
        } else {
            Box::new(f)
        };
        Ok(Self { file, reader: BufReader::new(raw), column, line_no: 0, buf: Vec::new(), done: false, labels: LabelSource::None })
    }

    /// Reads per-token labels as `labels` says (see [`LabelSource`]).
    pub fn with_labels(mut self, labels: LabelSource) -> Self {
        self.labels = labels;
        self
    }

    /// The integers of an array field (`what` names it in errors).
    fn ints(&self, field: &str, items: &[Value]) -> Result<Vec<i64>> {
        items.iter().map(|item| item.as_i64().ok_or_else(|| self.err(format!("`{field}` must hold integers, found {item}")))).collect()
    }

    fn err(&self, msg: String) -> Error {
        Error::data(&*self.file, format!("line {}: {msg}", self.line_no))
    }

    /// The document of one non-blank line.
    fn parse(&self, line: &str) -> Result<Doc> {
        let value: Value = serde_json::from_str(line).map_err(|e| self.err(format!("not valid JSON ({e})")))?;
        let Value::Object(mut obj) = value else {
            return Err(self.err("expected a JSON object".into()));
        };
        let field = match &self.column {
            Some(c) => c.as_str(),
            None if obj.contains_key("input_ids") => "input_ids",
            None => "text",
        };
        let Some(v) = obj.get_mut(field) else {
            let keys: Vec<&str> = obj.keys().map(String::as_str).collect();
            let wanted = if self.column.is_some() { format!("`{field}`") } else { "`input_ids` or `text`".into() };
            return Err(self.err(format!("no field {wanted}; the fields are {keys:?}")));
        };
        let loc = Loc::Line(self.line_no);
        let content = match v {
            Value::String(s) => Content::Text(std::mem::take(s)),
            Value::Array(items) => {
                let mut ids = Vec::with_capacity(items.len());
                for item in items {
                    let Some(n) = item.as_i64() else {
                        return Err(self.err(format!("`{field}` must hold integers, found {item}")));
                    };
                    ids.push(token_id(n, &self.file, loc, field)?);
                }
                Content::Ids(ids)
            }
            other => return Err(self.err(format!("`{field}` must be a string or an array of token ids, found {other}"))),
        };
        let content = match (content, self.labels.pick(|k| obj.contains_key(k))) {
            (Content::Ids(ids), Some(col)) => match obj.get(&col.name) {
                Some(Value::Array(items)) => {
                    let values = self.ints(&col.name, items)?;
                    labeled(ids, values, &col, field, &self.file, &loc.to_string())?
                }
                Some(other) => return Err(self.err(format!("`{}` must be an array of integers (one per token), found {other}", col.name))),
                None if col.explicit => {
                    return Err(self.err(format!("no field `{}` (the configured labels column) next to `{field}`", col.name)))
                }
                None => Content::Ids(ids),
            },
            (Content::Text(_), Some(col)) if col.explicit => {
                return Err(self.err(format!(
                    "`{field}` holds text, but labels (`{}`) need pre-tokenized token ids: give `input_ids` with `{}` of the same length",
                    col.name, col.name
                )))
            }
            (c, _) => c,
        };
        Ok(Doc { content, file: self.file.clone(), loc })
    }
}

impl Iterator for JsonlDocs {
    type Item = Result<Doc>;
    fn next(&mut self) -> Option<Result<Doc>> {
        while !self.done {
            self.buf.clear();
            match self.reader.read_until(b'\n', &mut self.buf) {
                Ok(0) => self.done = true,
                Ok(_) => {
                    self.line_no += 1;
                    let line = match std::str::from_utf8(&self.buf) {
                        Ok(s) => s.trim(),
                        Err(e) => {
                            self.done = true;
                            return Some(Err(self.err(format!("not valid UTF-8 ({e})"))));
                        }
                    };
                    if line.is_empty() {
                        continue;
                    }
                    let doc = self.parse(line);
                    self.done = doc.is_err();
                    return Some(doc);
                }
                Err(e) => {
                    self.done = true;
                    // A damaged or truncated compressed file surfaces here.
                    return Some(Err(self.err(format!("cannot read ({e}); a compressed file may be damaged or truncated"))));
                }
            }
        }
        None
    }
}
