//! Packing token documents into training samples of `seq_len` (= S) positions.
//!
//! A raw sample is up to S+1 consecutive tokens `t[0..=S]`; the training sample is
//! `ids[i] = t[i]`, `targets[i] = t[i+1]` for `i < S` (next-token prediction). When the
//! data carries labels (a `labels` or `loss_mask` column, see [`super::docs`]), each raw
//! token has a label `l[j]` (HF convention: the label of token j) and
//! `targets[i] = l[i+1]`.
//!
//! - [`Packing::Concat`]: all documents (with their BOS/EOS) are concatenated into one
//!   stream, cut into disjoint windows of exactly S+1 tokens: sample k is stream tokens
//!   `[k(S+1), (k+1)(S+1))`. The tail shorter than S+1 at the end of the data is dropped.
//! - [`Packing::Truncate`]: one document per sample, truncated to its first S+1 tokens;
//!   a shorter document is padded: ids with `pad_id`, targets with [`IGNORE`].
//!   Documents of fewer than 2 tokens (nothing to predict) are skipped. Raw token
//!   files have no document boundaries and are refused in this mode.
//! - [`Packing::Documents`]: cut like concat (windows of S+1 tokens, no padding), but each
//!   sample keeps its document boundaries in [`Sample::doc_starts`]. A document that does
//!   not fit what is left of a sample continues in the next one, where its piece is a
//!   document of its own (starting at 0). A target that crosses a boundary (the last
//!   position of a document, whose next token starts another document) is [`IGNORE`];
//!   so is the target of a 1-token document. Raw token files are refused (no boundaries).

use serde::{Deserialize, Serialize};

use super::docs::TokenDoc;
use crate::{Error, Result};

/// Target value that the loss ignores (as in PyTorch's cross-entropy).
pub const IGNORE: i64 = -100;

/// How documents become samples.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase", tag = "mode")]
pub enum Packing {
    Concat,
    Truncate { pad_id: u32 },
    Documents,
}

impl Packing {
    /// Whether samples carry document boundaries ([`Sample::doc_starts`]).
    pub fn has_documents(&self) -> bool {
        matches!(self, Packing::Documents)
    }

    /// The name used in configs: `concat`, `truncate` or `documents`.
    pub fn name(&self) -> &'static str {
        match self {
            Packing::Concat => "concat",
            Packing::Truncate { .. } => "truncate",
            Packing::Documents => "documents",
        }
    }
}

/// A raw sample as the packer cuts it: up to S+1 tokens, their labels when the data has
/// labels (`labels[j]` = the label of token j, [`IGNORE`] = not counted), and the
/// document starts inside it (ascending, in `0..=S`; empty = no boundaries kept).
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct RawSample {
    pub tokens: Vec<u32>,
    pub labels: Option<Vec<i64>>,
    pub bounds: Vec<u32>,
}

/// One training sample. `ids [S]`, `targets [S]` (`IGNORE` = not counted).
///
/// `doc_starts`: the start (within the S positions) of every document, ascending; empty
/// means the whole sample is one document (concat and truncate packing). When non-empty
/// the first entry is 0 and all are below S.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Sample {
    pub ids: Vec<u32>,
    pub targets: Vec<i64>,
    pub doc_starts: Vec<u32>,
}

impl Sample {
    /// Builds a sample from up to S+1 raw tokens (see module docs).
    pub fn from_tokens(tokens: &[u32], seq_len: usize, pad_id: u32) -> Sample {
        let mut ids = vec![pad_id; seq_len];
        let mut targets = vec![IGNORE; seq_len];
        let n = tokens.len().min(seq_len + 1);
        let m = n.min(seq_len);
        ids[..m].copy_from_slice(&tokens[..m]);
        for (t, &next) in targets.iter_mut().zip(tokens.get(1..n).unwrap_or(&[])) {
            *t = next as i64;
        }
        Sample { ids, targets, doc_starts: Vec::new() }
    }

    /// Builds a sample from a raw sample: targets from the labels when there are, and
    /// every target that crosses a document boundary ignored (see module docs).
    pub fn from_raw(raw: &RawSample, seq_len: usize, pad_id: u32) -> Sample {
        let mut s = Sample::from_tokens(&raw.tokens, seq_len, pad_id);
        if let Some(labels) = &raw.labels {
            let n = raw.tokens.len().min(seq_len + 1).min(labels.len());
            for (t, &l) in s.targets.iter_mut().zip(labels.get(1..n).unwrap_or(&[])) {
                *t = l;
            }
        }
        for &d in &raw.bounds {
            let d = d as usize;
            if (1..=seq_len).contains(&d) {
                s.targets[d - 1] = IGNORE;
            }
        }
        if !raw.bounds.is_empty() {
            s.doc_starts = raw.bounds.iter().copied().filter(|&d| (d as usize) < seq_len).collect();
            if s.doc_starts.first() != Some(&0) {
                s.doc_starts.insert(0, 0);
            }
        }
        s
    }

    /// Number of counted (non-ignored) targets.
    pub fn counted(&self) -> usize {
        self.targets.iter().filter(|&&t| t != IGNORE).count()
    }

    /// The documents of this sample as ranges of positions (one `0..S` range when
    /// `doc_starts` is empty).
    pub fn doc_ranges(&self) -> Vec<std::ops::Range<usize>> {
        doc_ranges(&self.doc_starts, self.ids.len())
    }
}

/// The documents of a row of `seq_len` positions whose documents start at `doc_starts`
/// (the [`Sample::doc_starts`] convention: empty = one document) as ranges.
pub fn doc_ranges(doc_starts: &[u32], seq_len: usize) -> Vec<std::ops::Range<usize>> {
    if doc_starts.is_empty() {
        #[allow(clippy::single_range_in_vec_init)] // one document: the whole row
        return if seq_len == 0 { Vec::new() } else { vec![0..seq_len] };
    }
    let mut out = Vec::with_capacity(doc_starts.len());
    for (k, &a) in doc_starts.iter().enumerate() {
        let b = doc_starts.get(k + 1).map_or(seq_len, |&b| b as usize);
        out.push(a as usize..b);
    }
    out
}

/// Checks that `doc_starts` follow the [`Sample::doc_starts`] convention for a row of
/// `seq_len` positions: empty, or starting at 0, strictly ascending, all below `seq_len`.
pub fn check_doc_starts(doc_starts: &[u32], seq_len: usize) -> std::result::Result<(), String> {
    if doc_starts.is_empty() {
        return Ok(());
    }
    if doc_starts[0] != 0 {
        return Err(format!("document spans must cover the sample: the first starts at {}, not 0", doc_starts[0]));
    }
    if let Some(w) = doc_starts.windows(2).find(|w| w[1] <= w[0]) {
        return Err(format!("document starts must be strictly ascending, found {} then {}", w[0], w[1]));
    }
    if let Some(&last) = doc_starts.last().filter(|&&l| l as usize >= seq_len) {
        return Err(format!("document start {last} is outside the sample of {seq_len} positions"));
    }
    Ok(())
}

/// Running totals, used to explain an empty dataset and by the planner's peek.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct PackStats {
    pub docs: u64,
    pub tokens: u64,
    pub samples: u64,
    /// Documents of more than S+1 tokens (documents packing splits them over samples).
    pub long_docs: u64,
}

/// Pulls token documents from `docs` and cuts raw samples (≤ S+1 tokens each).
pub struct Packer<I> {
    docs: I,
    seq_len: usize,
    packing: Packing,
    buf: Vec<u32>,
    /// Labels of `buf`'s tokens, once some document had labels (earlier tokens get
    /// their own id as label: counted as without labels).
    labels: Option<Vec<i64>>,
    /// Document starts in `buf` (documents packing), ascending.
    starts: std::collections::VecDeque<usize>,
    start: usize,
    pub stats: PackStats,
}

impl<I: Iterator<Item = Result<TokenDoc>>> Packer<I> {
    pub fn new(docs: I, seq_len: usize, packing: Packing) -> Self {
        Self { docs, seq_len, packing, buf: Vec::new(), labels: None, starts: Default::default(), start: 0, stats: PackStats::default() }
    }

    fn pull(&mut self) -> Result<Option<TokenDoc>> {
        let doc = self.docs.next().transpose()?;
        if let Some(d) = &doc {
            self.stats.docs += 1;
            self.stats.tokens += d.ids.len() as u64;
            if d.ids.len() > self.seq_len + 1 {
                self.stats.long_docs += 1;
            }
            if d.is_stream && self.packing != Packing::Concat {
                let what = if self.packing.has_documents() { "documents" } else { "truncation" };
                return Err(Error::Setting(format!(
                    "{what} packing needs document boundaries, but raw token files (.bin) are one continuous stream; \
                     use concat packing"
                )));
            }
        }
        Ok(doc)
    }

    /// The next raw sample's tokens, or `None` at the end of the data.
    pub fn next_raw(&mut self) -> Result<Option<Vec<u32>>> {
        Ok(self.next_sample()?.map(|r| r.tokens))
    }

    /// The next raw sample (tokens, labels, document starts), or `None` at the end.
    pub fn next_sample(&mut self) -> Result<Option<RawSample>> {
        let out = match self.packing {
            Packing::Concat | Packing::Documents => self.next_window()?,
            Packing::Truncate { .. } => self.next_truncated()?,
        };
        if out.is_some() {
            self.stats.samples += 1;
        }
        Ok(out)
    }

    fn next_window(&mut self) -> Result<Option<RawSample>> {
        let need = self.seq_len + 1;
        let docs = self.packing.has_documents();
        while self.buf.len() - self.start < need {
            let Some(doc) = self.pull()? else { return Ok(None) };
            // Drop consumed tokens before growing the buffer: it stays under S+1 + one document.
            self.buf.drain(..self.start);
            if let Some(l) = self.labels.as_mut() {
                l.drain(..self.start);
            }
            let cut = self.start;
            self.starts.retain(|&s| s >= cut);
            self.starts.iter_mut().for_each(|s| *s -= cut);
            self.start = 0;
            // (an empty document has no tokens and so no start of its own)
            if docs && !doc.ids.is_empty() && self.starts.back() != Some(&self.buf.len()) {
                self.starts.push_back(self.buf.len());
            }
            self.push_labels(&doc);
            self.buf.extend_from_slice(&doc.ids);
        }
        let (a, b) = (self.start, self.start + need);
        let tokens = self.buf[a..b].to_vec();
        let labels = self.labels.as_ref().map(|l| l[a..b].to_vec());
        let mut bounds = Vec::new();
        if docs {
            bounds.push(0);
            while self.starts.front().is_some_and(|&s| s < b) {
                let s = self.starts.pop_front().unwrap_or(a);
                if s > a {
                    bounds.push((s - a) as u32);
                }
            }
        }
        self.start = b;
        Ok(Some(RawSample { tokens, labels, bounds }))
    }

    /// Appends `doc`'s labels to the label buffer (created on the first labelled document).
    fn push_labels(&mut self, doc: &TokenDoc) {
        if self.labels.is_none() && doc.labels.is_some() {
            self.labels = Some(self.buf.iter().map(|&t| t as i64).collect());
        }
        if let Some(l) = self.labels.as_mut() {
            match &doc.labels {
                Some(dl) => l.extend_from_slice(dl),
                None => l.extend(doc.ids.iter().map(|&t| t as i64)),
            }
        }
    }

    fn next_truncated(&mut self) -> Result<Option<RawSample>> {
        loop {
            let Some(doc) = self.pull()? else { return Ok(None) };
            if doc.ids.len() >= 2 {
                let mut ids = doc.ids;
                ids.truncate(self.seq_len + 1);
                let labels = doc.labels.map(|mut l| {
                    l.truncate(ids.len());
                    l
                });
                return Ok(Some(RawSample { tokens: ids, labels, bounds: Vec::new() }));
            }
        }
    }
}
