//! Evaluating a checkpoint whose context was extended, and trying it.
//!
//! - [`model`]: a checkpoint to evaluate (local, hub id, built-in), its tokenizer and the
//!   context it was trained for; the length check (beyond it only with rope scaling or
//!   when asked).
//! - [`forward`]: per-token losses and argmax predictions of one sequence, on one device
//!   or split over the ranks of a sequence-parallel mode (same layout as training).
//! - [`ppl`]: perplexity against context length (sliding windows or truncation).
//! - [`needle`]: needle / passkey retrieval over a depth × length grid, teacher-forced and
//!   greedy scoring.
//! - [`ruler`]: RULER-style tasks (multi-key, multi-value, multi-query needles, variable
//!   tracking, common- and frequent-words extraction) over a grid of lengths, scored by
//!   recall of the expected strings.
//! - [`words`]: the bodies of the common- and frequent-words extraction tasks of `ruler`.
//! - [`generate`]: greedy and sampled generation with a KV cache.
//! - [`plot`]: PNG plots (plotters, embedded font).
//! - [`output`]: files written atomically (temp file, then rename).

pub mod forward;
pub mod generate;
pub mod model;
pub mod needle;
pub mod output;
pub mod plot;
pub mod ppl;
pub mod ruler;
pub mod words;

pub use forward::{Ranks, RanksSpec, TokenScores};
pub use model::EvalModel;
