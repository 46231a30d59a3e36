//! Distribution: parallel dims and process groups, the rank environment, the TCP
//! rendezvous with its failure monitor, and the process launcher.
//!
//! Start-up of one rank of a launched run (GPU or CPU):
//! 1. [`DistEnv::from_env`] (torchrun-style variables set by [`launch`], or Slurm);
//! 2. [`world::join`]: the [`rendezvous`] (rank 0's NCCL unique id reaches every rank),
//!    the world communicator (NCCL on GPUs, the process transport on the CPU) and the
//!    failure wiring between it and the [`Monitor`];
//! 3. [`ParallelDims::new`] from the config, then [`build_groups`].
//!
//! In-process runs (ranks as threads) start at [`world::run_threads`] instead.
//!
//! - [`mode`]: `ParallelMode`, everything that differs per mode (degrees, length rules,
//!   the attention it builds, the token layout).
//! - [`dims`]: `ParallelDims`, the rank layout, group membership, `build_groups`.
//! - [`env`]: `DistEnv` from torchrun or Slurm variables.
//! - [`rendezvous`]: TCP rendezvous and the failure monitor.
//! - [`secret`]: the job secret (`LONGCTX_RDZV_SECRET`) that authenticates the rendezvous.
//! - `admission`: rank 0's bounded queue of connections not yet authenticated.
//! - `wire`: the frames of the rendezvous connections and their authentication (HMAC-SHA256).
//! - [`launch`]: one child per local rank, output prefixed, failures stop everyone.
//! - [`world`]: the world communicator of a run, threads or processes.

mod admission;
pub mod dims;
pub mod env;
pub mod launch;
pub mod mode;
pub mod rendezvous;
pub mod secret;
mod wire;
pub mod world;

pub use dims::{build_groups, Coords, DimsRequest, Groups, ParallelDims};
pub use env::DistEnv;
pub use launch::{launch, LaunchArgs, LaunchError, LaunchOptions};
pub use mode::{LengthField, ParallelMode};
pub use rendezvous::{rendezvous, Monitor, Rendezvous, RendezvousOptions};
pub use secret::{Secret, SECRET_ENV};

/// A communication failure (rendezvous, lost peer), as the attention crate reports them.
pub(crate) fn comm_error(msg: impl Into<String>) -> crate::Error {
    crate::Error::Candle(longctx_attention::AttnError::Comm(msg.into()).into())
}
