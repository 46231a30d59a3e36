//! longctx: long-context continued training of Llama-family models on Candle.
//!
//! - [`model`]: the Llama family as Hugging Face defines it (config, RoPE, blocks, loss).
//! - [`hub`]: checkpoints in (safetensors, sharded, hub cache) and out (HF layout export).
//! - [`train`]: the training loop / engine, optimizer, schedules.
//! - [`data`]: datasets, packing, synthetic long-context data.
//! - [`device`]: opening the CPU or a GPU from `model.device` or a rank.
//! - [`dist`]: parallel dims, process groups, launch.
//! - [`eval`]: perplexity against length, needle/passkey grids, generation, plots.
//! - [`guard`]: finiteness checks (nothing non-finite is checkpointed or exported).
//! - [`limits`]: size limits checked before allocating.
//! - [`plan`]: per-GPU memory model, fit check and layout suggestion (`longctx plan`).
//!
//! Attention and the sequence-parallel modes live in the `longctx-attention` crate.

pub mod data;
pub mod device;
pub mod error;
pub mod eval;
pub mod guard;
pub mod hub;
pub mod limits;
pub mod model;
pub mod parallel;
pub mod plan;
pub mod train;

pub use error::{Error, Result};
pub use longctx_attention as attention;
