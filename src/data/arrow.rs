//! Arrow IPC files as `datasets.Dataset.save_to_disk` writes them (`data-00000-of-00001.arrow`
//! beside `dataset_info.json` and `state.json`; the streaming format, the file format's
//! `ARROW1` magic is skipped too), read by hand: a token-id column (`list<int>` or
//! `large_list<int>`, e.g. `input_ids`) or a text column (`string` / `large_string`).
//! The column is configurable; by default `input_ids` if present, else `text`. A
//! per-token labels or loss-mask column (`list<int>`, see [`LabelSource`]) is read
//! alongside a token-id column, row for row.
//!
//! The file is memory-mapped and read one message at a time: each message is a length,
//! a flatbuffer (`Message`: a `Schema` first, then `RecordBatch`es; `DictionaryBatch`es
//! are skipped) and a body holding the batch's buffers. Only the flatbuffer fields this
//! reader needs are decoded (format/Message.fbs, Schema.fbs). Documents are made one row
//! at a time from the mapped body, so memory holds one document. Null rows, empty lists
//! and empty strings yield no document; a null token inside a list is an error;
//! compressed bodies (LZ4/ZSTD buffers) and dictionary-encoded columns are refused with a
//! message. Every offset and length is checked against the file: a malformed file is an
//! error naming it, never a panic.

use std::fs::File;
use std::path::Path;
use std::sync::Arc;

use memmap2::Mmap;

use super::docs::{labeled, token_id, Content, Doc, LabelCol, LabelSource, Loc};
use crate::{Error, Result};

/// Reads of a flatbuffer inside `buf`, every access bounds-checked.
struct Fb<'a> {
    buf: &'a [u8],
}

type R<T> = std::result::Result<T, String>;

impl Fb<'_> {
    fn bytes<const N: usize>(&self, at: usize) -> R<[u8; N]> {
        at.checked_add(N)
            .and_then(|end| self.buf.get(at..end))
            .and_then(|s| s.try_into().ok())
            .ok_or_else(|| format!("flatbuffer read past its end at {at}"))
    }
    fn u8(&self, at: usize) -> R<u8> {
        Ok(self.bytes::<1>(at)?[0])
    }
    fn u16(&self, at: usize) -> R<u16> {
        Ok(u16::from_le_bytes(self.bytes(at)?))
    }
    fn u32(&self, at: usize) -> R<u32> {
        Ok(u32::from_le_bytes(self.bytes(at)?))
    }
    fn i32(&self, at: usize) -> R<i32> {
        Ok(i32::from_le_bytes(self.bytes(at)?))
    }
    fn i64(&self, at: usize) -> R<i64> {
        Ok(i64::from_le_bytes(self.bytes(at)?))
    }
    /// `at + u32 at at` (an offset to a table, vector or string).
    fn follow(&self, at: usize) -> R<usize> {
        at.checked_add(self.u32(at)? as usize).ok_or_else(|| "flatbuffer offset overflows".to_string())
    }
    fn root(&self) -> R<usize> {
        self.follow(0)
    }
    /// Where field `id` of the table at `t` is stored, if present.
    fn field(&self, t: usize, id: usize) -> R<Option<usize>> {
        let vt = i64::try_from(t).map_err(|e| e.to_string())? - i64::from(self.i32(t)?);
        let vt = usize::try_from(vt).map_err(|_| "flatbuffer vtable before the buffer".to_string())?;
        let vt_len = self.u16(vt)? as usize;
        let slot = 4 + 2 * id;
        if slot + 2 > vt_len {
            return Ok(None);
        }
        match self.u16(vt + slot)? {
            0 => Ok(None),
            off => Ok(Some(t + off as usize)),
        }
    }
    fn table(&self, t: usize, id: usize) -> R<Option<usize>> {
        self.field(t, id)?.map(|p| self.follow(p)).transpose()
    }
    /// (start of the elements, count) of a vector field.
    fn vector(&self, t: usize, id: usize) -> R<Option<(usize, usize)>> {
        let Some(v) = self.table(t, id)? else { return Ok(None) };
        Ok(Some((v + 4, self.u32(v)? as usize)))
    }
    fn string(&self, t: usize, id: usize) -> R<Option<String>> {
        let Some((start, n)) = self.vector(t, id)? else { return Ok(None) };
        let s = start.checked_add(n).and_then(|e| self.buf.get(start..e)).ok_or("string past the buffer")?;
        Ok(Some(String::from_utf8_lossy(s).into_owned()))
    }
    fn scalar_u8(&self, t: usize, id: usize, default: u8) -> R<u8> {
        self.field(t, id)?.map_or(Ok(default), |p| self.u8(p))
    }
    fn scalar_i16(&self, t: usize, id: usize, default: i16) -> R<i16> {
        self.field(t, id)?.map_or(Ok(default), |p| Ok(self.u16(p)? as i16))
    }
    fn scalar_i32(&self, t: usize, id: usize, default: i32) -> R<i32> {
        self.field(t, id)?.map_or(Ok(default), |p| self.i32(p))
    }
    fn scalar_i64(&self, t: usize, id: usize, default: i64) -> R<i64> {
        self.field(t, id)?.map_or(Ok(default), |p| self.i64(p))
    }
}

// Type union tags (Schema.fbs).
const T_NULL: u8 = 1;
const T_INT: u8 = 2;
const T_UTF8: u8 = 5;
const T_LIST: u8 = 12;
const T_LARGE_UTF8: u8 = 20;
const T_LARGE_LIST: u8 = 21;
// Message header tags (Message.fbs).
const H_SCHEMA: u8 = 1;
const H_DICTIONARY: u8 = 2;
const H_RECORD_BATCH: u8 = 3;

/// A schema field: its type and children, as far as this reader needs them.
#[derive(Debug, Clone)]
struct FieldInfo {
    name: String,
    ty: u8,
    /// Int: bit width; Union: mode (0 sparse, 1 dense).
    param: i32,
    dictionary: bool,
    children: Vec<FieldInfo>,
}

impl FieldInfo {
    /// The field at table `t`; `budget`: fields still allowed in the schema (a crafted
    /// flatbuffer may point many children at one table: the count stays bounded).
    fn parse(fb: &Fb, t: usize, depth: usize, budget: &mut usize) -> R<Self> {
        if depth > 64 {
            return Err("fields nested deeper than 64".into());
        }
        *budget = budget.checked_sub(1).ok_or("more than 100,000 fields in the schema")?;
        let ty = fb.scalar_u8(t, 2, 0)?;
        let param = match (ty, fb.table(t, 3)?) {
            (T_INT, Some(tt)) => fb.scalar_i32(tt, 0, 0)?,
            (14, Some(tt)) => i32::from(fb.scalar_i16(tt, 0, 0)?),
            _ => 0,
        };
        let mut children = Vec::new();
        if let Some((start, n)) = fb.vector(t, 5)? {
            for i in 0..n.min(1 << 16) {
                children.push(FieldInfo::parse(fb, fb.follow(start + 4 * i)?, depth + 1, budget)?);
            }
        }
        Ok(Self { name: fb.string(t, 0)?.unwrap_or_default(), ty, param, dictionary: fb.table(t, 4)?.is_some(), children })
    }

    /// Buffers of this field alone in a record batch (children not counted).
    fn own_buffers(&self) -> R<usize> {
        if self.dictionary {
            return Ok(2); // validity + indices
        }
        Ok(match self.ty {
            T_NULL => 0,
            2 | 3 | 6..=11 | 15 | 18 => 2,
            4 | T_UTF8 | 19 | T_LARGE_UTF8 => 3,
            T_LIST | T_LARGE_LIST | 17 => 2,
            13 | 16 => 1,
            14 => 1 + usize::from(self.param == 1),
            22 => 0,
            25 | 26 => 3,
            t => return Err(format!("column `{}` has Arrow type id {t}, which this reader cannot skip", self.name)),
        })
    }

    /// (field nodes, buffers) of this field's subtree.
    fn counts(&self) -> R<(usize, usize)> {
        let mut acc = (1, self.own_buffers()?);
        if !self.dictionary {
            for c in &self.children {
                let (n, b) = c.counts()?;
                acc = (acc.0 + n, acc.1 + b);
            }
        }
        Ok(acc)
    }
}

/// What the chosen column holds.
#[derive(Debug, Clone, Copy)]
enum Kind {
    Text { large: bool },
    Ids { large: bool, bits: u32 },
}

/// A byte range of the file.
type Span = (usize, usize);

/// The chosen column of the current record batch: ranges into the mapped file.
struct BatchCol {
    rows: usize,
    next: usize,
    validity: Option<Span>,
    offsets: Span,
    /// Text bytes, or the list's integer values.
    values: Span,
    /// The list values' validity (None: no nulls).
    value_validity: Option<Span>,
}

pub struct ArrowDocs {
    file: Arc<Path>,
    map: Mmap,
    /// The open file and its size and modification time when mapped: checked before
    /// every message and row, so a file truncated or rewritten under a run is an error
    /// naming it instead of a SIGBUS on a vanished page.
    handle: File,
    opened: (u64, Option<std::time::SystemTime>),
    pos: usize,
    field: String,
    /// Index of the column among the top-level fields, its node and first buffer index.
    node: usize,
    buffer: usize,
    kind: Kind,
    batch: Option<BatchCol>,
    row: u64,
    done: bool,
    /// The label column: which one, its node, first buffer and kind.
    labels: Option<(LabelCol, usize, usize, Kind)>,
    /// Its part of the current record batch.
    label_batch: Option<BatchCol>,
}

/// One message: (header type, header table position inside the metadata, metadata span,
/// body span); `None` at the end-of-stream marker or the end of the file.
type Message = Option<(u8, usize, Span, Span)>;

impl ArrowDocs {
    pub fn open(file: Arc<Path>, column: Option<String>) -> Result<Self> {
        Self::open_with_labels(file, column, &LabelSource::None)
    }

    /// Like [`ArrowDocs::open`], with per-token labels as `labels` says ([`LabelSource`]).
    pub fn open_with_labels(file: Arc<Path>, column: Option<String>, labels: &LabelSource) -> Result<Self> {
        let f = File::open(&file).map_err(|e| Error::io(&*file, e))?;
        let meta = f.metadata().map_err(|e| Error::io(&*file, e))?;
        // SAFETY: the map is read-only and lives in this reader. A file truncated while it
        // is mapped would fault on access: `unchanged` checks the size and modification
        // time before every message and row (a change between that check and the read of
        // one row remains the memory-map caveat).
        let map = unsafe { Mmap::map(&f) }.map_err(|e| Error::io(&*file, e))?;
        let pos = if map.starts_with(b"ARROW1") { 8 } else { 0 };
        let mut me = Self {
            file,
            map,
            handle: f,
            opened: (meta.len(), meta.modified().ok()),
            pos,
            field: String::new(),
            node: 0,
            buffer: 0,
            kind: Kind::Text { large: false },
            batch: None,
            row: 0,
            done: false,
            labels: None,
            label_batch: None,
        };
        let (ty, header, meta, _) = me.message()?.ok_or_else(|| me.bad("no schema message".into()))?;
        if ty != H_SCHEMA {
            return Err(me.bad(format!("the first message is of type {ty}, not a schema")));
        }
        let fb = Fb { buf: &me.map[meta.0..meta.1] };
        let fields = (|| -> R<Vec<FieldInfo>> {
            let (start, n) = fb.vector(header, 1)?.unwrap_or((0, 0));
            let mut budget = 100_000;
            (0..n.min(1 << 16)).map(|i| FieldInfo::parse(&fb, fb.follow(start + 4 * i)?, 0, &mut budget)).collect()
        })()
        .map_err(|e| me.bad(e))?;
        let names: Vec<&str> = fields.iter().map(|f| f.name.as_str()).collect();
        let field = match column {
            Some(c) => c,
            None if names.contains(&"input_ids") => "input_ids".into(),
            None => "text".into(),
        };
        let (node, buffer, kind) = me.locate(&fields, &field, "a string or a list of integers")?;
        if let Some(col) = labels.pick(|k| names.contains(&k)) {
            match kind {
                Kind::Text { .. } if col.explicit => {
                    return Err(Error::data(
                        &*me.file,
                        format!(
                            "column `{field}` holds text, but labels (`{}`) need pre-tokenized token ids: give `input_ids` with `{}` of the same length",
                            col.name, col.name
                        ),
                    ))
                }
                Kind::Text { .. } => {}
                Kind::Ids { .. } => {
                    let (n, b, k) = me.locate(&fields, &col.name, "a list of integers (one per token)")?;
                    if matches!(k, Kind::Text { .. }) {
                        return Err(Error::data(&*me.file, format!("labels column `{}` is text; expected a list of integers (one per token)", col.name)));
                    }
                    me.labels = Some((col, n, b, k));
                }
            }
        }
        (me.field, me.node, me.buffer, me.kind) = (field, node, buffer, kind);
        Ok(me)
    }

    /// Node, first buffer and kind of column `field` (`expected` for the error).
    fn locate(&self, fields: &[FieldInfo], field: &str, expected: &str) -> Result<(usize, usize, Kind)> {
        let names: Vec<&str> = fields.iter().map(|f| f.name.as_str()).collect();
        let Some(idx) = fields.iter().position(|f| f.name == field) else {
            return Err(Error::data(&*self.file, format!("no column `{field}`; the columns are {names:?}")));
        };
        let (mut node, mut buffer) = (0, 0);
        for f in &fields[..idx] {
            let (n, b) = f.counts().map_err(|e| self.bad(e))?;
            (node, buffer) = (node + n, buffer + b);
        }
        let f = &fields[idx];
        let wrong = |what: &str| Error::data(&*self.file, format!("column `{field}` is {what}; expected {expected}"));
        if f.dictionary {
            return Err(wrong("dictionary-encoded"));
        }
        let kind = match (f.ty, f.children.as_slice()) {
            (T_UTF8, _) => Kind::Text { large: false },
            (T_LARGE_UTF8, _) => Kind::Text { large: true },
            (T_LIST | T_LARGE_LIST, [c]) if c.ty == T_INT && !c.dictionary && matches!(c.param, 8 | 16 | 32 | 64) => {
                Kind::Ids { large: f.ty == T_LARGE_LIST, bits: c.param as u32 }
            }
            (T_LIST | T_LARGE_LIST, _) => return Err(wrong("a list of something other than integers")),
            (t, _) => return Err(wrong(&format!("of Arrow type id {t}"))),
        };
        Ok((node, buffer, kind))
    }

    fn bad(&self, what: String) -> Error {
        Error::data(&*self.file, format!("not a readable Arrow IPC file ({what})"))
    }

    /// An error when the file is no longer what was mapped (size or modification time).
    fn unchanged(&self) -> Result<()> {
        let meta = self.handle.metadata().map_err(|e| Error::io(&*self.file, e))?;
        let (len, modified) = (meta.len(), meta.modified().ok());
        if (len, modified) == self.opened {
            return Ok(());
        }
        let what = if len != self.opened.0 {
            format!("its size went from {} to {len} bytes", self.opened.0)
        } else {
            "it was modified".to_string()
        };
        Err(Error::data(
            &*self.file,
            format!(
                "the file changed while the run was reading it ({what}); a dataset must not change under a run: \
                 put the original back (or point the run at a copy) and resume with --resume"
            ),
        ))
    }

    /// The message at `pos`, and `pos` moved past it.
    fn message(&mut self) -> Result<Message> {
        self.unchanged()?;
        let m = &self.map[..];
        let word = |at: usize| -> Option<u32> { m.get(at..at + 4).map(|b| u32::from_le_bytes([b[0], b[1], b[2], b[3]])) };
        let Some(first) = word(self.pos) else { return Ok(None) };
        let (len, meta_start) = if first == 0xFFFF_FFFF {
            (word(self.pos + 4).ok_or_else(|| self.bad("a message cut short".into()))?, self.pos + 8)
        } else {
            (first, self.pos + 4) // before Arrow 0.15: no continuation marker
        };
        if len == 0 {
            return Ok(None);
        }
        let meta_end = meta_start
            .checked_add(len as usize)
            .filter(|&e| e <= m.len())
            .ok_or_else(|| self.bad("message metadata past the end".into()))?;
        let fb = Fb { buf: &m[meta_start..meta_end] };
        let parsed = (|| -> R<(u8, usize, i64)> {
            let root = fb.root()?;
            let header = fb.table(root, 2)?.ok_or("message without a header")?;
            Ok((fb.scalar_u8(root, 1, 0)?, header, fb.scalar_i64(root, 3, 0)?))
        })();
        let (ty, header, body_len) = parsed.map_err(|e| self.bad(e))?;
        let body_end = usize::try_from(body_len)
            .ok()
            .and_then(|b| meta_end.checked_add(b))
            .filter(|&e| e <= m.len())
            .ok_or_else(|| self.bad(format!("message body of {body_len} bytes past the end of the file")))?;
        self.pos = body_end;
        Ok(Some((ty, header, (meta_start, meta_end), (meta_end, body_end))))
    }

    /// The next record batch's column, or `None` at the end.
    fn next_batch(&mut self) -> Result<Option<BatchCol>> {
        loop {
            let Some((ty, header, meta, body)) = self.message()? else { return Ok(None) };
            match ty {
                H_RECORD_BATCH => {
                    self.label_batch = match self.labels.as_ref() {
                        Some(&(_, node, buffer, kind)) => Some(self.batch_col_of(header, meta, body, node, buffer, kind)?),
                        None => None,
                    };
                    return self.batch_col(header, meta, body).map(Some);
                }
                H_DICTIONARY => continue,
                t => return Err(self.bad(format!("unexpected message type {t} after the schema"))),
            }
        }
    }

    fn batch_col(&self, header: usize, meta: Span, body: Span) -> Result<BatchCol> {
        self.batch_col_of(header, meta, body, self.node, self.buffer, self.kind)
    }

    /// The column at field node `col_node`, first buffer `b`, of kind `kind`.
    fn batch_col_of(&self, header: usize, meta: Span, body: Span, col_node: usize, b: usize, kind: Kind) -> Result<BatchCol> {
        let fb = Fb { buf: &self.map[meta.0..meta.1] };
        let r = (|| -> R<BatchCol> {
            if fb.table(header, 3)?.is_some() {
                return Err("its record batches are compressed (LZ4/ZSTD buffers); save the dataset without compression".into());
            }
            let rows = usize::try_from(fb.scalar_i64(header, 0, 0)?).map_err(|_| "negative row count")?;
            let (nodes, n_nodes) = fb.vector(header, 1)?.unwrap_or((0, 0));
            let (bufs, n_bufs) = fb.vector(header, 2)?.unwrap_or((0, 0));
            let node = |i: usize| -> R<(i64, i64)> {
                if i >= n_nodes {
                    return Err(format!("field node {i} of {n_nodes}"));
                }
                Ok((fb.i64(nodes + 16 * i)?, fb.i64(nodes + 16 * i + 8)?))
            };
            let buf = |i: usize| -> R<Span> {
                if i >= n_bufs {
                    return Err(format!("buffer {i} of {n_bufs}"));
                }
                let (off, len) = (fb.i64(bufs + 16 * i)?, fb.i64(bufs + 16 * i + 8)?);
                let (off, len) =
                    (usize::try_from(off).map_err(|_| "negative offset")?, usize::try_from(len).map_err(|_| "negative length")?);
                let start = body.0.checked_add(off).ok_or("buffer offset overflows")?;
                let end = start.checked_add(len).filter(|&e| e <= body.1).ok_or(format!("buffer {i} past its message body"))?;
                Ok((start, end))
            };
            let (len, nulls) = node(col_node)?;
            if usize::try_from(len).ok() != Some(rows) {
                return Err(format!("column length {len} but {rows} rows"));
            }
            let validity = (nulls > 0).then(|| buf(b)).transpose()?;
            let offsets = buf(b + 1)?;
            let (values, value_validity) = match kind {
                Kind::Text { .. } => (buf(b + 2)?, None),
                Kind::Ids { .. } => {
                    let (_, child_nulls) = node(col_node + 1)?;
                    ((buf(b + 3)?), (child_nulls > 0).then(|| buf(b + 2)).transpose()?)
                }
            };
            let width = match kind {
                Kind::Text { large } | Kind::Ids { large, .. } => {
                    if large {
                        8
                    } else {
                        4
                    }
                }
            };
            if rows > 0 && offsets.1 - offsets.0 < (rows + 1) * width {
                return Err(format!("offsets buffer of {} bytes for {rows} rows", offsets.1 - offsets.0));
            }
            if validity.is_some_and(|v| v.1 - v.0 < rows.div_ceil(8)) {
                return Err("validity bitmap shorter than the rows".into());
            }
            Ok(BatchCol { rows, next: 0, validity, offsets, values, value_validity })
        })();
        r.map_err(|e| self.bad(e))
    }

    fn bit(&self, bitmap: Span, i: usize) -> bool {
        self.map.get(bitmap.0 + i / 8).is_some_and(|b| b >> (i % 8) & 1 == 1)
    }

    fn offset(&self, offsets: Span, i: usize, large: bool) -> Option<usize> {
        let m = &self.map[offsets.0..offsets.1];
        if large {
            let b = m.get(8 * i..8 * i + 8)?;
            usize::try_from(i64::from_le_bytes(b.try_into().ok()?)).ok()
        } else {
            let b = m.get(4 * i..4 * i + 4)?;
            usize::try_from(i32::from_le_bytes(b.try_into().ok()?)).ok()
        }
    }

    /// The document of row `i` of the current batch (`None`: null or empty).
    fn row_doc(&self, c: &BatchCol, i: usize) -> Result<Option<Content>> {
        if c.validity.is_some_and(|v| !self.bit(v, i)) {
            return Ok(None);
        }
        let large = match self.kind {
            Kind::Text { large } | Kind::Ids { large, .. } => large,
        };
        let loc = Loc::Row(self.row);
        let (a, b) = match (self.offset(c.offsets, i, large), self.offset(c.offsets, i + 1, large)) {
            (Some(a), Some(b)) if a <= b => (a, b),
            _ => return Err(self.bad(format!("{loc}: bad offsets"))),
        };
        match self.kind {
            Kind::Text { .. } => {
                let bytes = self.map.get(c.values.0 + a..c.values.0 + b).filter(|_| c.values.0 + b <= c.values.1);
                let bytes = bytes.ok_or_else(|| self.bad(format!("{loc}: text past its buffer")))?;
                let s = std::str::from_utf8(bytes)
                    .map_err(|e| Error::data(&*self.file, format!("{loc}: `{}` is not UTF-8 ({e})", self.field)))?;
                Ok((!s.is_empty()).then(|| Content::Text(s.to_string())))
            }
            Kind::Ids { bits, .. } => {
                let mut ids = Vec::with_capacity(b - a);
                for n in self.ints(c, a, b, bits, &self.field)? {
                    ids.push(token_id(n, &self.file, loc, &self.field)?);
                }
                if ids.is_empty() {
                    return Ok(None);
                }
                match (self.labels.as_ref(), self.label_batch.as_ref()) {
                    (Some((col, _, _, Kind::Ids { large, bits })), Some(lc)) => {
                        let values = if lc.validity.is_some_and(|v| !self.bit(v, i)) {
                            Vec::new()
                        } else {
                            match (self.offset(lc.offsets, i, *large), self.offset(lc.offsets, i + 1, *large)) {
                                (Some(la), Some(lb)) if la <= lb => self.ints(lc, la, lb, *bits, &col.name)?,
                                _ => return Err(self.bad(format!("{loc}: bad offsets in `{}`", col.name))),
                            }
                        };
                        labeled(ids, values, col, &self.field, &self.file, &loc.to_string()).map(Some)
                    }
                    _ => Ok(Some(Content::Ids(ids))),
                }
            }
        }
    }

    /// The integers `a..b` of list column `c` (values `bits` wide); `name` for errors.
    fn ints(&self, c: &BatchCol, a: usize, b: usize, bits: u32, name: &str) -> Result<Vec<i64>> {
        let loc = Loc::Row(self.row);
        let w = bits as usize / 8;
        let (start, end) = (a.checked_mul(w), b.checked_mul(w));
        let vals = match (start, end) {
            (Some(s), Some(e)) if c.values.0 + e <= c.values.1 => &self.map[c.values.0 + s..c.values.0 + e],
            _ => return Err(self.bad(format!("{loc}: `{name}` values past their buffer"))),
        };
        let mut out = Vec::with_capacity(b - a);
        for (k, v) in vals.chunks_exact(w).enumerate() {
            if c.value_validity.is_some_and(|vv| !self.bit(vv, a + k)) {
                return Err(Error::data(&*self.file, format!("{loc}: `{name}` holds a null token id at position {k}")));
            }
            out.push(match w {
                1 => i64::from(v[0] as i8),
                2 => i64::from(i16::from_le_bytes([v[0], v[1]])),
                4 => i64::from(i32::from_le_bytes([v[0], v[1], v[2], v[3]])),
                _ => i64::from_le_bytes([v[0], v[1], v[2], v[3], v[4], v[5], v[6], v[7]]),
            });
        }
        Ok(out)
    }
}

impl Iterator for ArrowDocs {
    type Item = Result<Doc>;
    fn next(&mut self) -> Option<Result<Doc>> {
        while !self.done {
            if self.batch.as_ref().is_none_or(|b| b.next >= b.rows) {
                match self.next_batch() {
                    Ok(Some(b)) => self.batch = Some(b),
                    Ok(None) => self.done = true,
                    Err(e) => {
                        self.done = true;
                        return Some(Err(e));
                    }
                }
                continue;
            }
            let Some(c) = self.batch.take() else { continue };
            let i = c.next;
            let doc = self.unchanged().and_then(|_| self.row_doc(&c, i));
            self.batch = Some(BatchCol { next: i + 1, ..c });
            let loc = Loc::Row(self.row);
            self.row += 1;
            match doc {
                Ok(Some(content)) => return Some(Ok(Doc { content, file: self.file.clone(), loc })),
                Ok(None) => {}
                Err(e) => {
                    self.done = true;
                    return Some(Err(e));
                }
            }
        }
        None
    }
}
