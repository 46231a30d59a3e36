//! Training: run config, optimizer, layer-wise engine, trainer loop, checkpoints, metrics.

pub mod checkpoint;
pub mod config;
pub mod optim;

pub use config::{ParallelMode, RunConfig, Stage};
pub mod engine;
pub mod grads;
pub mod init;
pub mod layer_grad;
pub mod metrics;
pub mod offload;
pub mod profile;
pub mod trainer;
pub mod zero;
