//! Hugging Face checkpoints in and out.
//!
//! - [`cache`] — `--model`: `builtin:NAME`, `org/name[@rev]` or a local directory
//!   ([`ModelSpec`]) -> a model directory (HF cache layout, `HF_HUB_CACHE`/`HF_HOME`,
//!   `HF_HUB_OFFLINE`, download via hf-hub), or just its config ([`model_config`]).
//! - [`load`] — weights from `model.safetensors` or sharded `model.safetensors.index.json`,
//!   memory-mapped, converted to the run dtype: [`load_weights`], [`Checkpoint`]
//!   (streaming, `var_builder`), [`load_into_varmap`] for training, [`load_stored`] as stored.
//! - [`st_file`] — one safetensors file with its header validated (truncation, corruption).
//! - [`config`] — `config.json` as JSON; update `rope_theta` / `max_position_embeddings`.
//! - [`tokenizer`] — `tokenizer.json`.
//! - [`export`] — atomic export in the HF layout (sharded like transformers); what a run's
//!   export writes ([`ModelExport`]; a run's side, `for_run` and training checkpoints, in `train::export`).

pub mod cache;
pub mod config;
pub mod export;
pub mod load;
pub mod st_file;
pub mod tokenizer;

pub use cache::{model_config, resolve_model, resolve_model_config, HubOptions, ModelConfig, ModelSpec, ResolvedModel};
pub use config::{config_path, read_config, set_context_fields, set_torch_dtype};
pub use export::{export, export_map, side_files, ExportOptions, ExportReport, ModelExport};
pub use load::{load_into_varmap, load_stored, load_weights, Checkpoint};
pub use tokenizer::load_tokenizer;
