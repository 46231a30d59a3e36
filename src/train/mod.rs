//! Training: run config, optimizer, layer-wise engine, trainer loop, checkpoints, metrics;
//! the output-directory lock, resume checks and stop signals around them.

pub mod checkpoint;
pub mod config;
pub mod deepspeed;
pub mod optim;

pub use config::{ParallelMode, RunConfig, Stage, StageSettings};
pub mod engine;
pub mod export;
/// Built-in model configs and random initialisation live under `model/` (below the data,
/// hub and eval layers that need them); re-exported here for existing callers.
pub use crate::model::init;
pub mod layer_grad;
pub mod metrics;
pub mod offload;
pub mod profile;
pub mod resume_check;
pub mod rundir;
pub mod stage_eval;
pub mod stop;
pub mod tensorboard;
pub mod trainer;
pub mod zero;
