//! Parquet files with either a token-id column (`list<int32|int64>`, e.g. `input_ids`)
//! or a text column (`string`), like the packed HF datasets used for long-context
//! training. The column is configurable; by default `input_ids` if present, else `text`.
//!
//! Streaming: row groups are read one at a time, and inside a row group the column is
//! decoded [`BATCH`] records at a time with the low-level column reader (definition and
//! repetition levels), so memory holds one batch of documents, never the file.
//! Empty lists, empty strings and null rows yield no document; a null token inside a
//! list is an error. Codecs: uncompressed and snappy (the crate is built without others).
//! Malformed files are errors naming the file: chunk byte ranges are checked before the
//! crate reads them, levels and values are indexed with checks, and a panic inside the
//! crate is caught (`fuzz/` dataset_parquet).

use std::collections::VecDeque;
use std::fs::File;
use std::path::Path;
use std::sync::Arc;

use parquet::basic::{Repetition, Type as PhysicalType};
use parquet::column::reader::{ColumnReader, ColumnReaderImpl};
use parquet::data_type::{ByteArrayType, DataType, Int32Type, Int64Type};
use parquet::file::reader::{FileReader, SerializedFileReader};

use super::docs::{labeled, token_id, Content, Doc, LabelCol, LabelSource, Loc};
use crate::{Error, Result};

/// Records decoded per read call.
pub const BATCH: usize = 64;

/// The typed column reader of the current row group.
enum Col {
    Text(ColumnReaderImpl<ByteArrayType>),
    I32(ColumnReaderImpl<Int32Type>),
    I64(ColumnReaderImpl<Int64Type>),
}

pub struct ParquetDocs {
    file: Arc<Path>,
    reader: SerializedFileReader<File>,
    field: String,
    /// Leaf column index in the file schema.
    leaf: usize,
    max_def: i16,
    max_rep: i16,
    leaf_optional: bool,
    next_row_group: usize,
    col: Option<Col>,
    /// Rows seen so far (0-based index of the next record).
    row: u64,
    queue: VecDeque<Doc>,
    done: bool,
    /// The label column (`labels` / `loss_mask`), read alongside the ids.
    labels: Option<Labels>,
}

/// A per-token label column: list<int32|int64>, decoded record for record with the ids.
struct Labels {
    col: LabelCol,
    leaf: usize,
    max_def: i16,
    reader: Option<Col>,
}

impl ParquetDocs {
    pub fn open(file: Arc<Path>, column: Option<String>) -> Result<Self> {
        Self::open_with_labels(file, column, &LabelSource::None)
    }

    /// Like [`ParquetDocs::open`], with per-token labels as `labels` says ([`LabelSource`]).
    pub fn open_with_labels(file: Arc<Path>, column: Option<String>, labels: &LabelSource) -> Result<Self> {
        let f = File::open(&file).map_err(|e| Error::io(&*file, e))?;
        let unreadable = |e: String| Error::data(&*file, format!("not a readable parquet file ({e})"));
        let reader = std::panic::catch_unwind(|| SerializedFileReader::new(f))
            .map_err(|_| unreadable("malformed footer".into()))?
            .map_err(|e| unreadable(e.to_string()))?;
        let schema = reader.metadata().file_metadata().schema_descr_ptr();
        let top: Vec<String> = schema.root_schema().get_fields().iter().map(|f| f.name().to_string()).collect();
        let field = match column {
            Some(c) => c,
            None if top.iter().any(|n| n == "input_ids") => "input_ids".to_string(),
            None => "text".to_string(),
        };
        let leaves: Vec<usize> = (0..schema.num_columns())
            .filter(|&i| schema.column(i).path().parts().first().map(String::as_str) == Some(field.as_str()))
            .collect();
        let leaf = match leaves.as_slice() {
            [one] => *one,
            [] => {
                return Err(Error::data(&*file, format!("no column `{field}`; the columns are {top:?}")));
            }
            _ => {
                return Err(Error::data(
                    &*file,
                    format!("column `{field}` is a struct with several leaves; expected a string or a list of integers"),
                ))
            }
        };
        let desc = schema.column(leaf);
        let (max_def, max_rep) = (desc.max_def_level(), desc.max_rep_level());
        match (desc.physical_type(), max_rep) {
            (PhysicalType::BYTE_ARRAY, 0) | (PhysicalType::INT32 | PhysicalType::INT64, 1) => {}
            (t, r) => {
                return Err(Error::data(
                    &*file,
                    format!(
                        "column `{field}` has physical type {t} with {r} level(s) of repetition; \
                         expected a string column (text) or a list<int32|int64> column (token ids)"
                    ),
                ))
            }
        }
        let leaf_optional = desc.self_type().get_basic_info().repetition() == Repetition::OPTIONAL;
        let is_text = desc.physical_type() == PhysicalType::BYTE_ARRAY;
        let labels = match labels.pick(|k| top.iter().any(|n| n == k)) {
            None => None,
            Some(col) if is_text => {
                if col.explicit {
                    return Err(Error::data(
                        &*file,
                        format!(
                            "column `{field}` holds text, but labels (`{}`) need pre-tokenized token ids: give `input_ids` with `{}` of the same length",
                            col.name, col.name
                        ),
                    ));
                }
                None
            }
            Some(col) => {
                let found: Vec<usize> =
                    (0..schema.num_columns()).filter(|&i| schema.column(i).path().parts().first() == Some(&col.name)).collect();
                let bad = |what: String| Error::data(&*file, format!("labels column `{}`: {what}", col.name));
                let leaf = match found.as_slice() {
                    [one] => *one,
                    [] => return Err(bad(format!("no such column; the columns are {top:?}"))),
                    _ => return Err(bad("is a struct with several leaves; expected a list of integers".into())),
                };
                let d = schema.column(leaf);
                if !matches!(d.physical_type(), PhysicalType::INT32 | PhysicalType::INT64) || d.max_rep_level() != 1 {
                    return Err(bad(format!(
                        "has physical type {} with {} level(s) of repetition; expected a list<int32|int64> (one value per token)",
                        d.physical_type(),
                        d.max_rep_level()
                    )));
                }
                Some(Labels { col, leaf, max_def: d.max_def_level(), reader: None })
            }
        };
        Ok(Self {
            file,
            reader,
            field,
            leaf,
            max_def,
            max_rep,
            leaf_optional,
            next_row_group: 0,
            col: None,
            row: 0,
            queue: VecDeque::new(),
            done: false,
            labels,
        })
    }

    fn err(&self, msg: String) -> Error {
        Error::data(&*self.file, format!("column `{}`: {msg}", self.field))
    }

    /// Opens the column reader of the next row group; false when there is none.
    fn open_row_group(&mut self) -> Result<bool> {
        let i = self.next_row_group;
        if i >= self.reader.num_row_groups() {
            return Ok(false);
        }
        self.next_row_group += 1;
        self.check_chunk(i)?;
        let rg = self.reader.get_row_group(i).map_err(|e| self.err(format!("row group {i}: {e}")))?;
        let col = rg.get_column_reader(self.leaf).map_err(|e| self.err(format!("row group {i}: {e}")))?;
        self.col = Some(match col {
            ColumnReader::ByteArrayColumnReader(r) => Col::Text(r),
            ColumnReader::Int32ColumnReader(r) => Col::I32(r),
            ColumnReader::Int64ColumnReader(r) => Col::I64(r),
            _ => return Err(self.err(format!("row group {i}: unexpected physical type"))),
        });
        if let Some(leaf) = self.labels.as_ref().map(|l| l.leaf) {
            self.check_chunk_of(i, leaf)?;
            let col = rg.get_column_reader(leaf).map_err(|e| self.err(format!("row group {i}: labels: {e}")))?;
            let reader = match col {
                ColumnReader::Int32ColumnReader(r) => Col::I32(r),
                ColumnReader::Int64ColumnReader(r) => Col::I64(r),
                _ => return Err(self.err(format!("row group {i}: labels: unexpected physical type"))),
            };
            if let Some(l) = self.labels.as_mut() {
                l.reader = Some(reader);
            }
        }
        Ok(true)
    }

    /// The byte range the footer gives the column chunk of row group `i` must lie in the
    /// file (the parquet crate asserts on negative ones: found by `fuzz/`'s
    /// dataset_parquet target).
    fn check_chunk(&self, i: usize) -> Result<()> {
        self.check_chunk_of(i, self.leaf)
    }

    fn check_chunk_of(&self, i: usize, leaf: usize) -> Result<()> {
        let len = std::fs::metadata(&*self.file).map_err(|e| Error::io(&*self.file, e))?.len();
        let c = self.reader.metadata().row_group(i).column(leaf);
        let start = c.dictionary_page_offset().unwrap_or_else(|| c.data_page_offset());
        let size = c.compressed_size();
        let end = start.checked_add(size);
        if start < 0 || size < 0 || end.is_none_or(|e| e as u64 > len) {
            return Err(self.err(format!("row group {i}: column chunk at byte {start}, {size} bytes, is not inside the {len}-byte file")));
        }
        Ok(())
    }

    /// Decodes up to [`BATCH`] records of the current row group into the queue;
    /// returns the number of levels read (0 = row group exhausted).
    fn fill(&mut self) -> Result<usize> {
        let (mut def, mut rep) = (Vec::new(), Vec::new());
        let Some(col) = self.col.as_mut() else { return Ok(0) };
        let res = match col {
            Col::Text(r) => {
                let mut vals = Vec::new();
                read(r, &mut def, &mut rep, &mut vals).map(|levels| (levels, Vals::Text(vals)))
            }
            Col::I32(r) => {
                let mut vals = Vec::new();
                read(r, &mut def, &mut rep, &mut vals).map(|levels| (levels, Vals::Ints(vals.into_iter().map(i64::from).collect())))
            }
            Col::I64(r) => {
                let mut vals = Vec::new();
                read(r, &mut def, &mut rep, &mut vals).map(|levels| (levels, Vals::Ints(vals)))
            }
        };
        let ((records, levels), vals) = res.map_err(|e| self.err(format!("near row {}: {e}", self.row)))?;
        let first_row = self.row;
        let labels = self.read_labels(records)?;
        match vals {
            Vals::Text(v) => self.push_texts(levels, &def, &v)?,
            Vals::Ints(v) => self.push_lists(levels, &def, &rep, &v, first_row, labels.as_deref())?,
        }
        Ok(levels)
    }

    /// The label lists of the next `records` records (`None` when there is no label
    /// column; a null record gives an empty list).
    fn read_labels(&mut self, records: usize) -> Result<Option<Vec<Vec<i64>>>> {
        let row = self.row;
        let Some(l) = self.labels.as_mut() else { return Ok(None) };
        let name = l.col.name.clone();
        let Some(reader) = l.reader.as_mut() else { return Ok(None) };
        let (mut def, mut rep) = (Vec::new(), Vec::new());
        let mut out: Vec<Vec<i64>> = Vec::with_capacity(records);
        while out.len() < records {
            let want = records - out.len();
            let (got, levels, vals) = match reader {
                Col::I32(r) => {
                    let mut v = Vec::new();
                    let (rec, _, lv) = r
                        .read_records(want, Some(&mut def), Some(&mut rep), &mut v)
                        .map_err(|e| e.to_string())
                        .map_err(|e| Error::data(&*self.file, format!("labels column `{name}`: near row {row}: {e}")))?;
                    (rec, lv, v.into_iter().map(i64::from).collect::<Vec<_>>())
                }
                Col::I64(r) => {
                    let mut v = Vec::new();
                    let (rec, _, lv) = r
                        .read_records(want, Some(&mut def), Some(&mut rep), &mut v)
                        .map_err(|e| e.to_string())
                        .map_err(|e| Error::data(&*self.file, format!("labels column `{name}`: near row {row}: {e}")))?;
                    (rec, lv, v)
                }
                Col::Text(_) => return Ok(None),
            };
            if got == 0 {
                return Err(Error::data(
                    &*self.file,
                    format!("labels column `{name}`: fewer rows than column `{}` near row {row}", self.field),
                ));
            }
            let mut vi = 0;
            for k in 0..levels {
                if rep.get(k) == Some(&0) || out.is_empty() {
                    out.push(Vec::new());
                }
                if def.get(k).is_none_or(|&d| d == l.max_def) {
                    let v = *vals.get(vi).ok_or_else(|| {
                        Error::data(&*self.file, format!("labels column `{name}`: near row {row}: fewer values than levels"))
                    })?;
                    vi += 1;
                    if let Some(last) = out.last_mut() {
                        last.push(v);
                    }
                }
            }
            def.clear();
            rep.clear();
        }
        out.truncate(records);
        Ok(Some(out))
    }

    fn push_texts(&mut self, levels: usize, def: &[i16], vals: &[parquet::data_type::ByteArray]) -> Result<()> {
        let mut vi = 0;
        #[allow(clippy::needless_range_loop)] // `def` is empty when the column is required
        for k in 0..levels {
            let row = self.row;
            self.row += 1;
            let present = self.max_def == 0 || def.get(k) == Some(&self.max_def);
            if !present {
                continue;
            }
            let bytes = vals.get(vi).ok_or_else(|| self.err(format!("row {row}: fewer values than the levels say")))?.data();
            vi += 1;
            let text = std::str::from_utf8(bytes).map_err(|e| self.err(format!("row {row}: not valid UTF-8 ({e})")))?;
            if !text.is_empty() {
                self.queue.push_back(Doc { content: Content::Text(text.to_string()), file: self.file.clone(), loc: Loc::Row(row) });
            }
        }
        Ok(())
    }

    fn push_lists(
        &mut self,
        levels: usize,
        def: &[i16],
        rep: &[i16],
        vals: &[i64],
        first_row: u64,
        labels: Option<&[Vec<i64>]>,
    ) -> Result<()> {
        let mut docs = Vec::new();
        self.decode_lists(levels, def, rep, vals, &mut docs)?;
        for (row, ids) in docs {
            let content = match (labels, self.labels.as_ref()) {
                (Some(ls), Some(l)) => {
                    let values = ls.get((row - first_row) as usize).cloned().unwrap_or_default();
                    labeled(ids, values, &l.col, &self.field, &self.file, &Loc::Row(row).to_string())?
                }
                _ => Content::Ids(ids),
            };
            self.queue.push_back(Doc { content, file: self.file.clone(), loc: Loc::Row(row) });
        }
        Ok(())
    }

    fn decode_lists(&mut self, levels: usize, def: &[i16], rep: &[i16], vals: &[i64], docs: &mut Vec<(u64, Vec<u32>)>) -> Result<()> {
        let mut vi = 0;
        let mut cur: Option<(u64, Vec<u32>)> = None;
        let short = |me: &Self| me.err(format!("near row {}: fewer levels or values than the column says", me.row));
        for k in 0..levels {
            if self.max_rep == 0 || rep.get(k).ok_or_else(|| short(self))? == &0 {
                docs.extend(cur.take().filter(|(_, ids)| !ids.is_empty()));
                cur = Some((self.row, Vec::new()));
                self.row += 1;
            }
            let Some((row, ids)) = cur.as_mut() else {
                return Err(self.err(format!("near row {}: repeated value without a record start", self.row)));
            };
            let d = if self.max_def == 0 { 0 } else { *def.get(k).ok_or_else(|| short(self))? };
            if d == self.max_def {
                let v = *vals.get(vi).ok_or_else(|| short(self))?;
                ids.push(token_id(v, &self.file, Loc::Row(*row), &self.field)?);
                vi += 1;
            } else if self.leaf_optional && d == self.max_def - 1 {
                return Err(self.err(format!("row {row}: null token id inside the list")));
            }
        }
        docs.extend(cur.filter(|(_, ids)| !ids.is_empty()));
        Ok(())
    }

    fn advance(&mut self) -> Result<Option<Doc>> {
        loop {
            if let Some(doc) = self.queue.pop_front() {
                return Ok(Some(doc));
            }
            if self.col.is_none() && !self.open_row_group()? {
                return Ok(None);
            }
            if self.fill()? == 0 {
                self.col = None;
            }
        }
    }
}

enum Vals {
    Text(Vec<parquet::data_type::ByteArray>),
    Ints(Vec<i64>),
}

/// One `read_records` call of [`BATCH`] records; returns the number of levels read.
fn read<T: DataType>(
    r: &mut ColumnReaderImpl<T>,
    def: &mut Vec<i16>,
    rep: &mut Vec<i16>,
    vals: &mut Vec<T::T>,
) -> parquet::errors::Result<(usize, usize)> {
    let (records, values, levels) = r.read_records(BATCH, Some(def), Some(rep), vals)?;
    // Non-nullable, non-repeated columns decode no levels: one level per record.
    Ok((records, if levels == 0 { records.max(values) } else { levels }))
}

impl Iterator for ParquetDocs {
    type Item = Result<Doc>;
    fn next(&mut self) -> Option<Result<Doc>> {
        if self.done {
            return None;
        }
        // The parquet crate asserts on some malformed files; a panic in it is an error
        // naming the file, not the end of the run.
        let out = match std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| self.advance())) {
            Ok(r) => r,
            Err(_) => Err(Error::data(&*self.file, "the parquet reader failed on this file (malformed); re-create it")),
        };
        if !matches!(out, Ok(Some(_))) {
            self.done = true;
        }
        out.transpose()
    }
}
