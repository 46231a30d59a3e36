//! Training: run config, optimizer, layer-wise engine, trainer loop, checkpoints, metrics;
//! the output-directory lock, resume checks and stop signals around them.

pub mod checkpoint;
pub mod config;
pub mod deepspeed;
pub mod optim;

pub use config::{ParallelMode, RunConfig, Stage, StageSettings};
pub mod engine;
pub mod grads;
pub mod init;
pub mod layer_grad;
pub mod metrics;
pub mod offload;
pub mod profile;
pub mod resume_check;
pub mod rundir;
pub mod stop;
pub mod tensorboard;
pub mod trainer;
pub mod units;
pub mod zero;
pub mod zero3;
