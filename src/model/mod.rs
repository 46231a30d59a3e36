//! The Llama family as Hugging Face transformers defines it (llama, mistral, qwen2, qwen3, phi3,
//! gemma3_text):
//! - [`config`]: `config.json` parsing/validation/write-back ([`LlamaConfig`]).
//! - [`rope`]: rotary embedding per rope type, cos/sin for global position ids.
//! - [`llama`]: RMSNorm, attention (through a sequence-parallel [`AttentionMode`]), SwiGLU
//!   MLP, decoder layer, whole model; differentiable with Candle's autograd.
//! - [`loss`]: masked token cross-entropy (sum), in f32.
//! - [`init`]: built-in model configs (`builtin:NAME`) and seeded random initialisation.
//!
//! [`AttentionMode`]: longctx_attention::AttentionMode

pub mod config;
pub mod init;
pub mod llama;
pub mod loss;
pub mod rope;

pub use config::{Arch, LlamaConfig, LocalRope, RopeScaling};
pub use llama::{Attention, DecoderLayer, KvCache, Llama, Mlp, RmsNorm};
pub use loss::{count_targets, cross_entropy_sum, cross_entropy_sum_checked, per_token_loss, IGNORE_INDEX};
pub use rope::{Rope, RopeTable, RopeTables};
