//! Sequence-parallel attention with exact block kernels.
//!
//! Shape legend (used in every file of this crate):
//! - `b` batch, `s` local (this rank's) tokens, `S` global tokens, `hq` query heads,
//!   `hkv` key/value heads (GQA: `hq % hkv == 0`), `d` head dim.
//! - `q [b, s, hq, d]`, `k`/`v [b, s_kv, hkv, d]`, `o [b, s, hq, d]` (dtype of `q`),
//!   `lse [b, hq, s]` f32 (natural-log sum of exp of the scaled scores).
//!
//! Layers:
//! - [`kernel`]: the block kernel contract `fwd -> (o, lse)`, `bwd(do, Saved { q, k, v, o, lse })`,
//!   dispatched per device (CPU tiled kernel in [`cpu`], CUDA cuDNN behind `cuda`).
//! - [`band`]: sliding-window band blocks cut into calls every kernel takes.
//! - [`docs`]: document masks (block-diagonal causal over packed documents) and sliding
//!   windows, cut into kernel calls per document and window; every mode takes them
//!   ([`mode::AttentionMode::forward_masked`]).
//! - [`merge`]: the one stable log-sum-exp merge of partial results.
//! - [`comm`]: the communicator abstraction and its in-process (threads) backend.
//! - [`layout`]: zigzag / round-robin token layouts and global position ids.
//! - modes, each with the single-device signature ([`mode::AttentionMode`]):
//!   [`local`], [`ring`] (zigzag), [`ulysses`], [`fpdt`], [`usp`].
//! - [`op`]: wraps any mode into a differentiable Candle op.
//! - [`stash`]: parking tensors in (pinned) host memory with copies off the compute stream.

// Lists of token ranges (a block's q and kv rows) often hold one range: meant, not a typo.
#![allow(clippy::single_range_in_vec_init)]

pub mod band;
pub mod comm;
pub mod cpu;
#[cfg(feature = "cuda")]
pub mod cuda;
pub mod docs;
pub mod error;
pub mod fpdt;
pub mod kernel;
pub mod layout;
pub mod local;
pub mod merge;
pub mod mode;
pub mod naive;
pub mod op;
pub mod ring;
pub mod stash;
#[doc(hidden)]
pub mod testing;
pub mod ulysses;
pub mod usp;

pub use docs::{Docs, Masking};
pub use error::AttnError;
pub use kernel::{Mask, Saved};
pub use mode::AttentionMode;
pub use op::attention;
