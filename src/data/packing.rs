//! Packing token documents into training samples of `seq_len` (= S) positions.
//!
//! A raw sample is up to S+1 consecutive tokens `t[0..=S]`; the training sample is
//! `ids[i] = t[i]`, `targets[i] = t[i+1]` for `i < S` (next-token prediction).
//!
//! - [`Packing::Concat`]: all documents (with their BOS/EOS) are concatenated into one
//!   stream, cut into disjoint windows of exactly S+1 tokens: sample k is stream tokens
//!   `[k(S+1), (k+1)(S+1))`. The tail shorter than S+1 at the end of the data is dropped.
//! - [`Packing::Truncate`]: one document per sample, truncated to its first S+1 tokens;
//!   a shorter document is padded: ids with `pad_id`, targets with [`IGNORE`].
//!   Documents of fewer than 2 tokens (nothing to predict) are skipped. Raw token
//!   files have no document boundaries and are refused in this mode.

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
}

/// One training sample. `ids [S]`, `targets [S]` (`IGNORE` = not counted).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Sample {
    pub ids: Vec<u32>,
    pub targets: Vec<i64>,
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
        Sample { ids, targets }
    }

    /// Number of counted (non-ignored) targets.
    pub fn counted(&self) -> usize {
        self.targets.iter().filter(|&&t| t != IGNORE).count()
    }
}

/// Running totals, used to explain an empty dataset.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct PackStats {
    pub docs: u64,
    pub tokens: u64,
    pub samples: u64,
}

/// Pulls token documents from `docs` and cuts raw samples (≤ S+1 tokens each).
pub struct Packer<I> {
    docs: I,
    seq_len: usize,
    packing: Packing,
    buf: Vec<u32>,
    start: usize,
    pub stats: PackStats,
}

impl<I: Iterator<Item = Result<TokenDoc>>> Packer<I> {
    pub fn new(docs: I, seq_len: usize, packing: Packing) -> Self {
        Self { docs, seq_len, packing, buf: Vec::new(), start: 0, stats: PackStats::default() }
    }

    fn pull(&mut self) -> Result<Option<TokenDoc>> {
        let doc = self.docs.next().transpose()?;
        if let Some(d) = &doc {
            self.stats.docs += 1;
            self.stats.tokens += d.ids.len() as u64;
        }
        Ok(doc)
    }

    /// The next raw sample, or `None` at the end of the data.
    pub fn next_raw(&mut self) -> Result<Option<Vec<u32>>> {
        let out = match self.packing {
            Packing::Concat => self.next_concat()?,
            Packing::Truncate { .. } => self.next_truncated()?,
        };
        if out.is_some() {
            self.stats.samples += 1;
        }
        Ok(out)
    }

    fn next_concat(&mut self) -> Result<Option<Vec<u32>>> {
        let need = self.seq_len + 1;
        while self.buf.len() - self.start < need {
            let Some(doc) = self.pull()? else { return Ok(None) };
            // Drop consumed tokens before growing the buffer: it stays under S+1 + one document.
            self.buf.drain(..self.start);
            self.start = 0;
            self.buf.extend_from_slice(&doc.ids);
        }
        let out = self.buf[self.start..self.start + need].to_vec();
        self.start += need;
        Ok(Some(out))
    }

    fn next_truncated(&mut self) -> Result<Option<Vec<u32>>> {
        loop {
            let Some(doc) = self.pull()? else { return Ok(None) };
            if doc.is_stream {
                return Err(Error::Setting(
                    "truncation packing needs document boundaries, but raw token files (.bin) are one \
                     continuous stream; use concat packing"
                        .into(),
                ));
            }
            if doc.ids.len() >= 2 {
                let mut ids = doc.ids;
                ids.truncate(self.seq_len + 1);
                return Ok(Some(ids));
            }
        }
    }
}
