//! The loader: dataset files (or synthetic passkey data) -> this rank's samples and
//! batches, with a resumable cursor.
//!
//! Pipeline for files, identical on every data-parallel rank:
//! files -> documents -> token ids (+BOS/EOS) -> packing -> buffered shuffle (seed, epoch)
//! = the global sample stream of an epoch. Its samples are taken in groups of `world`:
//! rank `d` keeps sample `d` of each group, i.e. global samples `d, d+D, d+2D, ...`
//! (a last incomplete group is dropped, so all ranks see the same number of samples).
//! When the stream ends, the next epoch starts with a new shuffle order
//! (until `max_epochs`, if set).
//!
//! Cursor: [`DataState`] holds the epoch and `position`, the number of global samples of
//! that epoch already drawn (a multiple of `world`). [`Loader::restore`] rebuilds the
//! epoch's stream and skips `position` samples (they are re-read and re-tokenized, not
//! returned: exact because the stream is deterministic; the cost is that of reading
//! the skipped data once). The synthetic source jumps there directly.

use std::sync::Arc;

use candle_core::{Device, Tensor};
use serde::{Deserialize, Serialize};
use tokenizers::Tokenizer;

use super::docs::{MultiFileDocs, ReadOptions, TextSplit, TokenDoc, Tokenize};
use super::layout::{apply_layout, LocalBatch};
use super::packing::{Packer, Packing, Sample};
use super::shuffle::ShuffleBuffer;
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
        }
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
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Batch {
    pub ids: Vec<u32>,
    pub targets: Vec<i64>,
    pub batch: usize,
    pub seq_len: usize,
}

impl Batch {
    pub fn from_samples(samples: &[Sample], seq_len: usize) -> Self {
        let mut ids = Vec::with_capacity(samples.len() * seq_len);
        let mut targets = Vec::with_capacity(samples.len() * seq_len);
        for s in samples {
            ids.extend_from_slice(&s.ids);
            targets.extend_from_slice(&s.targets);
        }
        Self { ids, targets, batch: samples.len(), seq_len }
    }

    /// `ids` as u32 `[b, S]` and `targets` as i64 `[b, S]` on `device`.
    pub fn to_tensors(&self, device: &Device) -> candle_core::Result<(Tensor, Tensor)> {
        let ids = Tensor::from_slice(&self.ids, (self.batch, self.seq_len), device)?;
        let targets = Tensor::from_slice(&self.targets, (self.batch, self.seq_len), device)?;
        Ok((ids, targets))
    }

    /// This rank's tokens under a sequence-parallel layout (see [`apply_layout`]).
    pub fn localize(&self, indices: &[usize]) -> Result<LocalBatch> {
        apply_layout(&self.ids, &self.targets, self.seq_len, indices)
    }
}

/// The file pipeline of one epoch.
struct FilesEpoch {
    packer: Packer<Box<dyn Iterator<Item = Result<TokenDoc>>>>,
    shuffle: ShuffleBuffer<Vec<u32>>,
    input_done: bool,
}

impl FilesEpoch {
    fn next_raw(&mut self) -> Result<Option<Vec<u32>>> {
        while !self.input_done {
            match self.packer.next_raw()? {
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
    resolved: Resolved,
    tokenize: Tokenize,
    epoch: Option<FilesEpoch>,
}

impl Files {
    fn start_epoch(&mut self, epoch: u64) {
        let opts = ReadOptions {
            format: self.resolved.format,
            column: self.cfg.column.clone(),
            text_split: self.cfg.text_split,
            token_width: self.cfg.token_width,
        };
        let tokenize = self.tokenize.clone();
        let docs = MultiFileDocs::new(self.resolved.files.clone(), opts).map(move |d| d.and_then(|d| tokenize.apply(d)));
        let docs: Box<dyn Iterator<Item = Result<TokenDoc>>> = Box::new(docs);
        self.epoch = Some(FilesEpoch {
            packer: Packer::new(docs, self.cfg.seq_len, self.cfg.packing),
            shuffle: ShuffleBuffer::new(self.cfg.shuffle_buffer, self.cfg.seed, epoch),
            input_done: false,
        });
    }

    /// Draws one group of `world` raw samples and keeps sample `rank` (if `keep`).
    /// `Ok(None)`: the epoch ended before the group was complete.
    fn draw_group(&mut self, shard: Shard, keep: bool) -> Result<Option<Option<Vec<u32>>>> {
        let Some(ep) = self.epoch.as_mut() else { return Ok(None) };
        let mut mine = None;
        for j in 0..shard.world {
            match ep.next_raw()? {
                Some(raw) => {
                    if keep && j == shard.rank {
                        mine = Some(raw);
                    }
                }
                None => return Ok(None),
            }
        }
        Ok(Some(mine))
    }

    fn empty_error(&self, shard: Shard) -> Error {
        let stats = self.epoch.as_ref().map(|e| e.packer.stats).unwrap_or_default();
        let need = self.cfg.seq_len + 1;
        let what = if shard.world > 1 {
            format!("fewer than the {} needed to give each of the {} data-parallel ranks one", shard.world, shard.world)
        } else {
            "fewer than one".to_string()
        };
        Error::data(
            &self.resolved.root,
            format!(
                "the dataset is too small: {} documents, {} tokens, {} samples of seq_len+1 = {need} tokens, {what}",
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
        let resolved = resolve(&cfg.source, cfg.format, cfg.split.as_deref(), hub)?;
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
        let mut files = Files { cfg: cfg.clone(), resolved, tokenize, epoch: None };
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
        loop {
            if self.max_epochs.is_some_and(|m| self.epoch >= m) {
                return Ok(None);
            }
            let files = match &mut self.source {
                Source::Passkey(p) => {
                    let s = p.sample(self.position + shard.rank as u64);
                    self.position += shard.world as u64;
                    self.consumed += 1;
                    return Ok(Some(s.sample));
                }
                Source::Files(f) => f,
            };
            if let Some(raw) = files.draw_group(shard, true)? {
                self.position += shard.world as u64;
                self.consumed += 1;
                let pad = match files.cfg.packing {
                    Packing::Truncate { pad_id } => pad_id,
                    Packing::Concat => 0,
                };
                let raw = raw.unwrap_or_default();
                return Ok(Some(Sample::from_tokens(&raw, self.seq_len, pad)));
            }
            if self.position == 0 {
                return Err(files.empty_error(shard));
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
        Ok(Some(Batch::from_samples(&samples, self.seq_len)))
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
        let one = Shard { rank: 0, world: 1 };
        for i in 0..state.position {
            if files.draw_group(one, false)?.is_none() {
                return Err(Error::data(
                    &files.resolved.root,
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
