//! Hugging Face checkpoints in and out.
//!
//! - [`cache`] — `--model org/name[@rev]` or a local directory -> a model directory
//!   (HF cache layout, `HF_HUB_CACHE`/`HF_HOME`, `HF_HUB_OFFLINE`, download via hf-hub).
//! - [`load`] — weights from `model.safetensors` or sharded `model.safetensors.index.json`,
//!   memory-mapped, converted to the run dtype: [`load_weights`], [`Checkpoint`]
//!   (streaming, `var_builder`), [`load_into_varmap`] for training.
//! - [`st_file`] — one safetensors file with its header validated (truncation, corruption).
//! - [`config`] — `config.json` as JSON; update `rope_theta` / `max_position_embeddings`.
//! - [`tokenizer`] — `tokenizer.json`.
//! - [`export`] — atomic export in the HF layout (sharded like transformers).

pub mod cache;
pub mod config;
pub mod export;
pub mod load;
pub mod st_file;
pub mod tokenizer;

pub use cache::{resolve_model, HubOptions, ModelSpec, ResolvedModel};
pub use config::{config_path, disable_sliding_window, read_config, set_context_fields, set_torch_dtype};
pub use export::{export, export_map, ExportOptions, ExportReport};
pub use load::{load_into_varmap, load_weights, Checkpoint};
pub use tokenizer::load_tokenizer;
