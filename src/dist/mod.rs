//! Distribution: parallel dims and process groups, the rank environment, the TCP
//! rendezvous with its failure monitor, and the process launcher.
//!
//! Start-up of one rank of a multi-GPU run:
//! 1. [`DistEnv::from_env`] (torchrun-style variables set by [`launch`], or Slurm);
//! 2. [`rendezvous`]: rank 0's NCCL unique id reaches every rank; keep the returned
//!    [`Monitor`] and register an abort of the communicator with [`Monitor::on_failure`];
//! 3. the world communicator (NCCL: `longctx_attention::comm::nccl::NcclComm`);
//! 4. [`ParallelDims::new`] from the config, then [`build_groups`].
//!
//! - [`dims`]: `ParallelDims`, the rank layout, group membership, `build_groups`.
//! - [`env`]: `DistEnv` from torchrun or Slurm variables.
//! - [`rendezvous`]: TCP rendezvous and the failure monitor.
//! - [`launch`]: one child per local rank, output prefixed, failures stop everyone.

pub mod dims;
pub mod env;
pub mod launch;
pub mod rendezvous;

pub use dims::{build_groups, Coords, DimsRequest, Groups, ParallelDims, ParallelMode};
pub use env::DistEnv;
pub use launch::{launch, LaunchArgs, LaunchError, LaunchOptions};
pub use rendezvous::{rendezvous, Monitor, Rendezvous, RendezvousOptions};

/// A communication failure (rendezvous, lost peer), as the attention crate reports them.
pub(crate) fn comm_error(msg: impl Into<String>) -> crate::Error {
    crate::Error::Candle(longctx_attention::AttnError::Comm(msg.into()).into())
}
