//! Datasets, packing and synthetic long-context data.
//!
//! Flow (every stage streams; no dataset is ever loaded whole):
//! ```text
//! source (file | dir | hub id) -> documents (jsonl / txt / parquet / raw .bin)
//!   -> token ids (tokenizer, BOS/EOS, vocab check) -> packing (concat | truncate | documents)
//!   -> buffered shuffle (seed, epoch) -> data-parallel shard -> Sample / Batch
//!   -> sequence-parallel layout (ids, targets, positions permuted together)
//! ```
//! - [`source`]: resolving a path / directory / hub dataset id to files of one format.
//! - [`docs`], [`jsonl`] (plain, gzip, zstd), [`text`], [`parquet`], [`arrow`] (`save_to_disk`),
//!   [`tokens`]: file readers.
//! - [`packing`]: documents -> samples; `targets` are i64 with [`IGNORE`] (= -100) not counted.
//! - [`shuffle`]: SplitMix64 and the buffered shuffle.
//! - [`loader`]: the whole pipeline with DP sharding and a resumable [`DataState`].
//! - [`layout`]: a batch -> this rank's tokens under a sequence-parallel layout.
//! - [`synthetic`]: passkey retrieval samples over a built-in 256-id vocabulary.

pub mod arrow;
pub mod docs;
pub mod jsonl;
pub mod layout;
pub mod loader;
pub mod packing;
pub mod parquet;
pub mod shuffle;
pub mod source;
pub mod synthetic;
pub mod text;
pub mod tokens;

pub use docs::{Content, Doc, LabelSource, Loc, TextSplit};
pub use layout::{apply_layout, apply_layout_docs, apply_layout_tensors, LocalBatch};
pub use loader::{Batch, DataSpec, DataState, FilesConfig, Loader, MixSource, Shard};
pub use packing::{doc_ranges, Packing, RawSample, Sample, IGNORE};
pub use source::{Format, TokenWidth};
pub use synthetic::{LossOn, Passkey, PasskeyConfig, PasskeyItem};
