//! The loader: dataset files (or synthetic passkey data) -> this rank's samples and
//! batches, with a resumable cursor.
//!
//! Pipeline for files, identical on every data-parallel rank:
//! files -> documents -> token ids (+BOS/EOS) -> packing -> buffered shuffle (seed, epoch)
//! = the global sample stream of an epoch. When the stream ends, the next epoch starts
//! with a new shuffle order (until `max_epochs`, if set): the epochs, one after the
//! other, make the run's global stream, the same whatever the data-parallel degree. Its
//! samples are taken in groups of `world`: rank `d` keeps sample `d` of each group, i.e.
//! global samples `d, d+D, d+2D, ...`; a group may span the end of an epoch (its first
//! samples from one, the rest from the next), so no sample is dropped at a wrap and an
//! optimizer step takes the next batch × accumulation × dp samples of the stream whatever
//! the layout (`--allow-layout-change` continues the same samples: issue #33). Only at
//! the end of the data (`max_epochs`) is a last incomplete group dropped.
//!
//! Mixtures ([`FilesConfig::mixture`]): several sources, each read by its own document
//! stream (with its own filters and upsampling, see [`MixSource`]), interleaved document
//! by document: each next document comes from a source drawn with probability
//! proportional to its weight by a SplitMix64 seeded by (seed, epoch). A source that runs
//! out leaves the draw (the others keep their relative weights); the epoch ends when all
//! have. The draws happen at fixed points of the stream, so the mixed stream is a pure
//! function of (seed, epoch, data) and resumes exactly like a single source.
//!
//! Cursor: [`DataState`] holds the epoch and `position`, the number of global samples of
//! that epoch already drawn (by all ranks together). [`Loader::restore`] rebuilds the
//! epoch's stream and skips `position` samples (they are re-read and re-tokenized, not
//! returned: exact because the stream is deterministic; the cost is that of reading
//! the skipped data once). The synthetic source jumps there directly.

use std::sync::Arc;

use candle_core::{Device, Tensor};
use serde::{Deserialize, Serialize};
use tokenizers::Tokenizer;

use super::docs::{LabelSource, MultiFileDocs, ReadOptions, TextSplit, TokenDoc, Tokenize};
use super::layout::{apply_layout_docs, LocalBatch};
use super::packing::{PackStats, Packer, Packing, RawSample, Sample};
use super::shuffle::{ShuffleBuffer, SplitMix64};
use super::source::{resolve, Format, Resolved, TokenWidth};
use super::synthetic::{Passkey, PasskeyConfig};
use crate::hub::HubOptions;
use crate::{Error, Result};

/// A file dataset and how to turn it into samples.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct FilesConfig {
    /// File, directory, or hub dataset id (`org/name[@rev]`, `hf:org/name`).
    pub source: String,
    /// Samples have `seq_len` input positions (S+1 raw tokens).
    pub seq_len: usize,
    /// `None`: from the file extensions.
    #[serde(default)]
    pub format: Option<Format>,
    /// JSON field / parquet column; `None`: `input_ids` if present, else `text`.
    #[serde(default)]
    pub column: Option<String>,
    #[serde(default)]
    pub text_split: TextSplit,
    #[serde(default = "default_width")]
    pub token_width: TokenWidth,
    #[serde(default = "default_packing")]
    pub packing: Packing,
    /// Added before / after every document (not inside raw token files).
    #[serde(default)]
    pub bos: Option<u32>,
    #[serde(default)]
    pub eos: Option<u32>,
    /// When set, every token id must be below it (checked as documents are read).
    #[serde(default)]
    pub vocab_size: Option<usize>,
    /// Shuffle buffer size in samples (≤ 1: no shuffle). Memory: `4·(S+1)` bytes each.
    #[serde(default = "default_buffer")]
    pub shuffle_buffer: usize,
    #[serde(default)]
    pub seed: u64,
    /// Stop after this many passes (`None`: repeat forever).
    #[serde(default)]
    pub max_epochs: Option<u64>,
    /// Read only the files of this split of a directory or hub dataset
    /// ([`super::source::in_split`]); `None`: every file.
    #[serde(default)]
    pub split: Option<String>,
    /// Positions restart at 0 at each document (documents packing only); `None`: true
    /// with documents packing, false otherwise. `Some(true)` with another packing is an error.
    #[serde(default)]
    pub reset_positions: Option<bool>,
    /// Where per-token labels come from (pre-tokenized data; see [`LabelSource`]).
    #[serde(default)]
    pub labels: LabelSource,
    /// Several sources mixed by weight (see module docs); when non-empty, `source` and
    /// `column` are not used.
    #[serde(default)]
    pub mixture: Vec<MixSource>,
}

/// One source of a mixture.
///
/// Filters and upsampling act on a document's tokens after tokenization (with BOS/EOS):
/// a document of fewer than `min_tokens` tokens is skipped, one of more than `max_tokens`
/// is cut to its first `max_tokens`; then a document of at least `upsample_min_tokens`
/// tokens is yielded `upsample` times in a row (per-source length upsampling: more long
/// documents without changing the mixture's weights of sources).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct MixSource {
    /// File, directory or hub dataset id, as [`FilesConfig::source`].
    pub dataset: String,
    /// Relative weight (> 0, finite): the share of documents drawn from this source.
    pub weight: f64,
    /// Its column [default: `input_ids` if present, else `text`].
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub column: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub min_tokens: Option<usize>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub max_tokens: Option<usize>,
    /// Times each long document is repeated (1 = no upsampling).
    #[serde(default = "one")]
    pub upsample: u32,
    /// Documents of at least this many tokens are the long ones `upsample` repeats.
    #[serde(default)]
    pub upsample_min_tokens: usize,
}

fn one() -> u32 {
    1
}

impl MixSource {
    /// A source of weight `weight`, no filters, no upsampling.
    pub fn new(dataset: impl Into<String>, weight: f64) -> Self {
        Self { dataset: dataset.into(), weight, column: None, min_tokens: None, max_tokens: None, upsample: 1, upsample_min_tokens: 0 }
    }

    /// Checks the numbers; `field` is this source's config key (`data.source[1]`).
    pub fn check(&self, file: &std::path::Path, field: &str) -> Result<()> {
        if !self.weight.is_finite() || self.weight <= 0.0 {
            return Err(Error::config(
                file,
                format!("{field}.weight"),
                format!("got {}, expected a finite number > 0 (the source's relative share of documents)", self.weight),
            ));
        }
        if self.dataset.trim().is_empty() {
            return Err(Error::config(file, format!("{field}.dataset"), "is empty; name a file, directory or hub dataset id"));
        }
        if let (Some(lo), Some(hi)) = (self.min_tokens, self.max_tokens) {
            if lo > hi {
                return Err(Error::config(file, format!("{field}.min_tokens"), format!("{lo} is above max_tokens {hi}")));
            }
        }
        if self.max_tokens == Some(0) {
            return Err(Error::config(file, format!("{field}.max_tokens"), "must be at least 1"));
        }
        if self.upsample == 0 || self.upsample > 1000 {
            return Err(Error::config(
                file,
                format!("{field}.upsample"),
                format!("got {}, expected a repeat count in 1..=1000 (1 = no upsampling)", self.upsample),
            ));
        }
        Ok(())
    }
}

fn default_width() -> TokenWidth {
    TokenWidth::U16
}
fn default_packing() -> Packing {
    Packing::Concat
}
fn default_buffer() -> usize {
    64
}

impl FilesConfig {
    /// Defaults: format from extensions, concat packing, no BOS/EOS, shuffle buffer 64, seed 0.
    pub fn new(source: impl Into<String>, seq_len: usize) -> Self {
        Self {
            source: source.into(),
            seq_len,
            format: None,
            column: None,
            text_split: TextSplit::File,
            token_width: default_width(),
            packing: default_packing(),
            bos: None,
            eos: None,
            vocab_size: None,
            shuffle_buffer: default_buffer(),
            seed: 0,
            max_epochs: None,
            split: None,
            reset_positions: None,
            labels: LabelSource::Auto,
            mixture: Vec::new(),
        }
    }

    /// Whether positions restart at each document (see [`FilesConfig::reset_positions`]).
    pub fn resets_positions(&self) -> bool {
        self.reset_positions.unwrap_or(self.packing.has_documents())
    }

    /// `reset_positions` against the packing: positions can only restart where samples
    /// keep document boundaries.
    pub fn check_reset_positions(&self) -> Result<()> {
        if self.reset_positions == Some(true) && !self.packing.has_documents() {
            return Err(Error::Setting(format!(
                "data.reset_positions = true needs document boundaries, but packing is `{}`; set data.packing = \"documents\", \
                 or leave reset_positions out (false)",
                self.packing.name()
            )));
        }
        Ok(())
    }
}

/// Which data to load.
#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(rename_all = "lowercase", tag = "kind")]
pub enum DataSpec {
    Files(FilesConfig),
    Passkey(PasskeyConfig),
}

/// This process's place among the data-parallel ranks.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct Shard {
    pub rank: usize,
    pub world: usize,
}

impl Shard {
    pub const SINGLE: Shard = Shard { rank: 0, world: 1 };
}

/// The resumable cursor of a [`Loader`].
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct DataState {
    pub seed: u64,
    pub seq_len: usize,
    pub epoch: u64,
    /// Global samples of `epoch` already drawn (by all ranks together).
    pub position: u64,
    /// Samples this rank has returned since the start (informative).
    pub consumed: u64,
}

/// A batch of samples: `ids [b, S]`, `targets [b, S]` row-major (`IGNORE` = not counted).
///
/// `doc_starts[r]`: the document starts of row `r` ([`Sample::doc_starts`]: empty = one
/// document); `reset_positions`: positions restart at 0 at each document.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Batch {
    pub ids: Vec<u32>,
    pub targets: Vec<i64>,
    pub batch: usize,
    pub seq_len: usize,
    pub doc_starts: Vec<Vec<u32>>,
    pub reset_positions: bool,
}

impl Batch {
    /// The samples as rows (positions not reset; see [`Batch::reset_positions`]).
    pub fn from_samples(samples: &[Sample], seq_len: usize) -> Self {
        let mut ids = Vec::with_capacity(samples.len() * seq_len);
        let mut targets = Vec::with_capacity(samples.len() * seq_len);
        for s in samples {
            ids.extend_from_slice(&s.ids);
            targets.extend_from_slice(&s.targets);
        }
        let doc_starts = samples.iter().map(|s| s.doc_starts.clone()).collect();
        Self { ids, targets, batch: samples.len(), seq_len, doc_starts, reset_positions: false }
    }

    /// Whether some row holds more than one document.
    pub fn has_documents(&self) -> bool {
        self.doc_starts.iter().any(|d| d.len() > 1)
    }

    /// The position id of every token (`[b, S]` row-major): its index in the row, or,
    /// with `reset_positions`, its index in its document.
    pub fn positions(&self) -> Vec<u32> {
        let all: Vec<usize> = (0..self.seq_len).collect();
        self.localize(&all).map(|l| l.positions).unwrap_or_default()
    }

    /// `ids` as u32 `[b, S]` and `targets` as i64 `[b, S]` on `device`.
    pub fn to_tensors(&self, device: &Device) -> candle_core::Result<(Tensor, Tensor)> {
        let ids = Tensor::from_slice(&self.ids, (self.batch, self.seq_len), device)?;
        let targets = Tensor::from_slice(&self.targets, (self.batch, self.seq_len), device)?;
        Ok((ids, targets))
    }

    /// This rank's tokens under a sequence-parallel layout (see [`apply_layout`]).
    pub fn localize(&self, indices: &[usize]) -> Result<LocalBatch> {
        apply_layout_docs(&self.ids, &self.targets, self.seq_len, indices, &self.doc_starts, self.reset_positions)
    }
}

/// The file pipeline of one epoch.
struct FilesEpoch {
    packer: Packer<Box<dyn Iterator<Item = Result<TokenDoc>>>>,
    shuffle: ShuffleBuffer<RawSample>,
    input_done: bool,
}

type DocStream = Box<dyn Iterator<Item = Result<TokenDoc>>>;

/// One source's documents after its filters and upsampling (see [`MixSource`]).
struct SourceDocs {
    inner: DocStream,
    min_tokens: usize,
    max_tokens: Option<usize>,
    upsample: u32,
    upsample_min_tokens: usize,
    repeat: Option<(TokenDoc, u32)>,
}

impl Iterator for SourceDocs {
    type Item = Result<TokenDoc>;
    fn next(&mut self) -> Option<Result<TokenDoc>> {
        if let Some((doc, left)) = self.repeat.take() {
            if left > 1 {
                self.repeat = Some((doc.clone(), left - 1));
            }
            return Some(Ok(doc));
        }
        loop {
            let mut doc = match self.inner.next()? {
                Ok(d) => d,
                Err(e) => return Some(Err(e)),
            };
            if doc.ids.len() < self.min_tokens {
                continue;
            }
            if let Some(m) = self.max_tokens.filter(|&m| doc.ids.len() > m) {
                doc.ids.truncate(m);
                if let Some(l) = doc.labels.as_mut() {
                    l.truncate(m);
                }
            }
            if self.upsample > 1 && doc.ids.len() >= self.upsample_min_tokens {
                self.repeat = Some((doc.clone(), self.upsample - 1));
            }
            return Some(Ok(doc));
        }
    }
}

/// Documents of several sources interleaved by weight (see module docs).
struct MixDocs {
    sources: Vec<(SourceDocs, f64, bool)>,
    rng: SplitMix64,
}

impl Iterator for MixDocs {
    type Item = Result<TokenDoc>;
    fn next(&mut self) -> Option<Result<TokenDoc>> {
        loop {
            let total: f64 = self.sources.iter().filter(|s| s.2).map(|s| s.1).sum();
            if total <= 0.0 {
                return None;
            }
            // Uniform in [0, total) from 53 random bits.
            let u = (self.rng.next_u64() >> 11) as f64 / (1u64 << 53) as f64 * total;
            let mut acc = 0.0;
            let mut pick = None;
            for (i, s) in self.sources.iter().enumerate().filter(|(_, s)| s.2) {
                acc += s.1;
                pick = Some(i);
                if u < acc {
                    break;
                }
            }
            let i = pick?;
            match self.sources[i].0.next() {
                Some(d) => return Some(d),
                None => self.sources[i].2 = false,
            }
        }
    }
}

impl FilesEpoch {
    fn next_raw(&mut self) -> Result<Option<RawSample>> {
        while !self.input_done {
            match self.packer.next_sample()? {
                Some(s) => {
                    if let Some(out) = self.shuffle.push(s) {
                        return Ok(Some(out));
                    }
                }
                None => self.input_done = true,
            }
        }
        Ok(self.shuffle.drain_next())
    }
}

struct Files {
    cfg: FilesConfig,
    /// One per source: the mixture's, or the single `cfg.source` (weight 1, no filters).
    sources: Vec<MixSource>,
    resolved: Vec<Resolved>,
    tokenize: Tokenize,
    epoch: Option<FilesEpoch>,
}

impl Files {
    fn source_docs(&self, i: usize) -> SourceDocs {
        let (src, resolved) = (&self.sources[i], &self.resolved[i]);
        let opts = ReadOptions {
            format: resolved.format,
            column: src.column.clone(),
            text_split: self.cfg.text_split,
            token_width: self.cfg.token_width,
        };
        let tokenize = self.tokenize.clone();
        let docs = MultiFileDocs::new(resolved.files.clone(), opts)
            .with_labels(self.cfg.labels.clone())
            .map(move |d| d.and_then(|d| tokenize.apply(d)));
        SourceDocs {
            inner: Box::new(docs),
            min_tokens: src.min_tokens.unwrap_or(0),
            max_tokens: src.max_tokens,
            upsample: src.upsample.max(1),
            upsample_min_tokens: src.upsample_min_tokens,
            repeat: None,
        }
    }

    fn start_epoch(&mut self, epoch: u64) {
        let docs: DocStream = if self.sources.len() == 1 {
            Box::new(self.source_docs(0))
        } else {
            let sources = (0..self.sources.len()).map(|i| (self.source_docs(i), self.sources[i].weight, true)).collect();
            // A stream of its own (the tag keeps it apart from the shuffle's draws).
            Box::new(MixDocs { sources, rng: SplitMix64::from_parts(&[self.cfg.seed, epoch, 0x006d_6978_7475_7265]) })
        };
        self.epoch = Some(FilesEpoch {
            packer: Packer::new(docs, self.cfg.seq_len, self.cfg.packing),
            shuffle: ShuffleBuffer::new(self.cfg.shuffle_buffer, self.cfg.seed, epoch),
            input_done: false,
        });
    }

    /// The next raw sample of the current epoch; `None` at its end (or with no epoch).
    fn next_in_epoch(&mut self) -> Result<Option<RawSample>> {
        match self.epoch.as_mut() {
            Some(ep) => ep.next_raw(),
            None => Ok(None),
        }
    }

    fn empty_error(&self) -> Error {
        let stats = self.epoch.as_ref().map(|e| e.packer.stats).unwrap_or_default();
        let need = self.cfg.seq_len + 1;
        Error::data(
            &self.resolved[0].root,
            format!(
                "the dataset is too small: {} documents, {} tokens, {} samples of seq_len+1 = {need} tokens, fewer than one",
                stats.docs, stats.tokens, stats.samples
            ),
        )
    }
}

enum Source {
    Files(Box<Files>),
    Passkey(Passkey),
}

/// Yields this rank's samples; see module docs.
pub struct Loader {
    source: Source,
    shard: Shard,
    seq_len: usize,
    seed: u64,
    max_epochs: Option<u64>,
    epoch: u64,
    position: u64,
    consumed: u64,
    reset_positions: bool,
}

fn check_shard(shard: Shard) -> Result<()> {
    if shard.world == 0 || shard.rank >= shard.world {
        return Err(Error::Setting(format!(
            "data-parallel rank {} of world {}: the rank must be below the world size (≥ 1)",
            shard.rank, shard.world
        )));
    }
    Ok(())
}

impl Loader {
    /// A loader for `spec`; hub lookups use [`HubOptions::from_env`].
    pub fn new(spec: &DataSpec, tokenizer: Option<&Tokenizer>, shard: Shard) -> Result<Self> {
        match spec {
            DataSpec::Files(cfg) => Self::files(cfg, tokenizer, &HubOptions::from_env(), shard),
            DataSpec::Passkey(cfg) => Self::passkey(cfg, shard),
        }
    }

    /// A loader over dataset files. `tokenizer` is needed only for text data.
    pub fn files(cfg: &FilesConfig, tokenizer: Option<&Tokenizer>, hub: &HubOptions, shard: Shard) -> Result<Self> {
        check_shard(shard)?;
        if cfg.seq_len == 0 {
            return Err(Error::Setting("data: seq_len must be at least 1".into()));
        }
        if let Some(v) = cfg.vocab_size {
            for (name, id) in [("bos", cfg.bos), ("eos", cfg.eos)] {
                if id.is_some_and(|id| id as usize >= v) {
                    return Err(Error::Setting(format!("data: {name} id {id:?} is not below the vocabulary size {v}")));
                }
            }
        }
        cfg.check_reset_positions()?;
        let sources = if cfg.mixture.is_empty() {
            vec![MixSource { column: cfg.column.clone(), ..MixSource::new(cfg.source.clone(), 1.0) }]
        } else {
            for (i, m) in cfg.mixture.iter().enumerate() {
                m.check(std::path::Path::new("<data config>"), &format!("data.source[{i}]"))?;
            }
            cfg.mixture.iter().map(|m| MixSource { column: m.column.clone().or_else(|| cfg.column.clone()), ..m.clone() }).collect()
        };
        let resolved = sources.iter().map(|m| resolve(&m.dataset, cfg.format, cfg.split.as_deref(), hub)).collect::<Result<Vec<_>>>()?;
        let tokenize = Tokenize {
            // Documents are tokenized whole: truncation or padding that a tokenizer.json
            // carries (some set max_length 512) would silently cut long documents.
            tokenizer: tokenizer
                .map(|t| {
                    let mut t = t.clone();
                    t.with_truncation(None).map_err(|e| Error::Setting(format!("tokenizer: cannot turn truncation off: {e}")))?;
                    t.with_padding(None);
                    Ok::<_, Error>(Arc::new(t))
                })
                .transpose()?,
            bos: cfg.bos,
            eos: cfg.eos,
            vocab_size: cfg.vocab_size,
        };
        let mut files = Files { cfg: cfg.clone(), sources, resolved, tokenize, epoch: None };
        files.start_epoch(0);
        Ok(Self {
            source: Source::Files(Box::new(files)),
            shard,
            seq_len: cfg.seq_len,
            seed: cfg.seed,
            max_epochs: cfg.max_epochs,
            epoch: 0,
            position: 0,
            consumed: 0,
            reset_positions: cfg.resets_positions(),
        })
    }

    /// A loader over synthetic passkey samples (infinite; sample `i` depends on (seed, i) only).
    pub fn passkey(cfg: &PasskeyConfig, shard: Shard) -> Result<Self> {
        check_shard(shard)?;
        Ok(Self {
            source: Source::Passkey(Passkey::new(cfg.clone())?),
            shard,
            seq_len: cfg.seq_len,
            seed: cfg.seed,
            max_epochs: None,
            epoch: 0,
            position: 0,
            consumed: 0,
            reset_positions: false,
        })
    }

    pub fn seq_len(&self) -> usize {
        self.seq_len
    }

    pub fn shard(&self) -> Shard {
        self.shard
    }

    /// This rank's next sample, or `None` after `max_epochs`.
    pub fn next_sample(&mut self) -> Result<Option<Sample>> {
        let shard = self.shard;
        if let Source::Passkey(p) = &mut self.source {
            let s = p.sample(self.position + shard.rank as u64);
            self.position += shard.world as u64;
            self.consumed += 1;
            return Ok(Some(s.sample));
        }
        let mut mine = None;
        for j in 0..shard.world {
            match self.next_global()? {
                Some(raw) if j == shard.rank => mine = Some(raw),
                Some(_) => {}
                None => return Ok(None),
            }
        }
        let Source::Files(files) = &self.source else { return Ok(None) };
        self.consumed += 1;
        let pad = match files.cfg.packing {
            Packing::Truncate { pad_id } => pad_id,
            Packing::Concat | Packing::Documents => 0,
        };
        Ok(mine.map(|raw| Sample::from_raw(&raw, self.seq_len, pad)))
    }

    /// The next sample of the global file stream: epoch after epoch (see the module doc);
    /// `None` after `max_epochs`.
    fn next_global(&mut self) -> Result<Option<RawSample>> {
        loop {
            if self.max_epochs.is_some_and(|m| self.epoch >= m) {
                return Ok(None);
            }
            let Source::Files(files) = &mut self.source else { return Ok(None) };
            if let Some(raw) = files.next_in_epoch()? {
                self.position += 1;
                return Ok(Some(raw));
            }
            if self.position == 0 {
                return Err(files.empty_error());
            }
            self.epoch += 1;
            self.position = 0;
            files.start_epoch(self.epoch);
        }
    }

    /// The next `b` samples as a batch, or `None` if the data ended first.
    pub fn next_batch(&mut self, b: usize) -> Result<Option<Batch>> {
        let mut samples = Vec::with_capacity(b);
        for _ in 0..b {
            match self.next_sample()? {
                Some(s) => samples.push(s),
                None => return Ok(None),
            }
        }
        let mut batch = Batch::from_samples(&samples, self.seq_len);
        batch.reset_positions = self.reset_positions;
        Ok(Some(batch))
    }

    /// Whether this loader's batches restart positions at each document.
    pub fn reset_positions(&self) -> bool {
        self.reset_positions
    }

    /// The packer's running totals of the current epoch (documents, tokens, samples, long
    /// documents split); zero for synthetic data.
    pub fn pack_stats(&self) -> PackStats {
        match &self.source {
            Source::Files(f) => f.epoch.as_ref().map(|e| e.packer.stats).unwrap_or_default(),
            Source::Passkey(_) => PackStats::default(),
        }
    }

    /// The cursor to save with a checkpoint.
    pub fn state(&self) -> DataState {
        DataState { seed: self.seed, seq_len: self.seq_len, epoch: self.epoch, position: self.position, consumed: self.consumed }
    }

    /// Continues exactly where `state` was taken (same data, seed and seq_len required;
    /// the data-parallel world may differ: the next group starts at `state.position`).
    pub fn restore(&mut self, state: &DataState) -> Result<()> {
        if state.seed != self.seed || state.seq_len != self.seq_len {
            return Err(Error::Setting(format!(
                "data state was saved with seed {} and seq_len {}, but this loader has seed {} and seq_len {}",
                state.seed, state.seq_len, self.seed, self.seq_len
            )));
        }
        self.epoch = state.epoch;
        self.position = state.position;
        self.consumed = state.consumed;
        let files = match &mut self.source {
            Source::Passkey(_) => return Ok(()),
            Source::Files(f) => f,
        };
        if self.max_epochs.is_some_and(|m| state.epoch >= m) {
            files.epoch = None;
            return Ok(());
        }
        files.start_epoch(state.epoch);
        for i in 0..state.position {
            if files.next_in_epoch()?.is_none() {
                return Err(Error::data(
                    &files.resolved[0].root,
                    format!(
                        "cannot restore the data cursor: epoch {} has only {i} samples, the state says {} were drawn \
                         (has the dataset changed?)",
                        state.epoch, state.position
                    ),
                ));
            }
        }
        Ok(())
    }
}
