//! The world of a run: this process's ranks, their communicator and device, built once
//! at start-up. The trainer asks for a world here and never names a backend.
//!
//! - In-process ([`run_threads`]): `n` ranks as threads of this process sharing one
//!   device (the mailbox backend of `longctx_attention::comm::thread`).
//! - Launched ([`join`]; `longctx launch`, torchrun, Slurm): one rank per process. The
//!   ranks meet in the TCP rendezvous on `MASTER_ADDR:MASTER_PORT`, then talk
//!   - on the CPU through the same mailbox collectives, their messages carried over the
//!     rendezvous connections (`comm::process`): the same bits as the threads run, for
//!     correctness runs and CI;
//!   - on CUDA devices over NCCL (rank 0's unique id travels in the rendezvous), each
//!     rank on `cuda:LOCAL_RANK`.
//!
//! Failure: the rendezvous monitor and the communicator are wired both ways, so an
//! error, a dead process or a silent one on any rank becomes an error on every rank
//! (blocked calls return), and [`Joined::finish`] exits a rank that stays stuck.

use super::env::DistEnv;
use super::rendezvous::{rendezvous, Monitor, RendezvousOptions};
use crate::{Error, Result};
use candle_core::Device;
use longctx_attention::comm::{process, thread, Comm};
use std::sync::Arc;
use std::time::Duration;

/// Environment variable (seconds) bounding how long a CPU rank waits for a peer's
/// message before it aborts the world (default [`thread::DEFAULT_TIMEOUT`]).
pub const COMM_TIMEOUT_ENV: &str = "LONGCTX_COMM_TIMEOUT_S";

/// Run `f` once per rank of an in-process world of `n` threads; results in rank order,
/// or the error of the rank that failed first.
pub fn run_threads<T: Send>(n: usize, f: impl Fn(Arc<dyn Comm>) -> Result<T> + Sync) -> Result<Vec<T>> {
    // The first failure, kept typed: an error that names a file or says why training
    // stopped is returned as it is (not as "invalid setting: rank r failed: ...").
    let first: std::sync::Mutex<Option<Error>> = std::sync::Mutex::new(None);
    let out = thread::run_ranks_with_timeout(n, comm_timeout()?, |comm| {
        f(comm).map_err(|e| {
            let msg = e.to_string();
            if let Ok(mut slot) = first.lock() {
                slot.get_or_insert(e);
            }
            candle_core::Error::Msg(msg)
        })
    });
    out.map_err(|e| match first.into_inner().ok().flatten() {
        Some(typed @ (Error::Diverged(_) | Error::Config { .. } | Error::Checkpoint { .. } | Error::Data { .. } | Error::Io { .. })) => {
            typed
        }
        _ => Error::Setting(e.to_string()),
    })
}

fn comm_timeout() -> Result<Duration> {
    match std::env::var(COMM_TIMEOUT_ENV) {
        Err(_) => Ok(thread::DEFAULT_TIMEOUT),
        Ok(v) => v
            .trim()
            .parse::<f64>()
            .ok()
            .filter(|s| s.is_finite() && *s > 0.0)
            .map(Duration::from_secs_f64)
            .ok_or_else(|| Error::Setting(format!("{COMM_TIMEOUT_ENV} = `{v}` is not a positive number of seconds"))),
    }
}

/// This process's rank of a launched world.
pub struct Joined {
    pub comm: Arc<dyn Comm>,
    /// `cpu`, or `cuda:LOCAL_RANK`.
    pub device: Device,
    monitor: Monitor,
}

impl std::fmt::Debug for Joined {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "Joined({:?}, {:?})", self.comm, self.device)
    }
}

impl Joined {
    /// End of this rank's work: a clean goodbye, or the failure told to every rank
    /// (and this process ended if it is still running 15 s later, e.g. stuck in a
    /// collective that an abort could not free).
    pub fn finish<T>(&self, result: &Result<T>) {
        match result {
            Ok(_) => self.monitor.finish(),
            Err(e) => {
                self.monitor.report_failure(&e.to_string());
                self.monitor.exit_after_failure(Duration::from_secs(15));
            }
        }
    }
}

/// Join the launched world `env` describes, with the device named by `device`
/// (`cpu`, or `cuda`/`cuda:N`, which means `cuda:LOCAL_RANK` here: one process per GPU).
pub fn join(env: &DistEnv, device: &str) -> Result<Joined> {
    let opts = RendezvousOptions::from_env()?;
    let want_cuda = match device {
        "cpu" => false,
        d if d.starts_with("cuda") => true,
        d => return Err(Error::config("<run config>", "model.device", format!("expected cpu, cuda or cuda:N, got `{d}`"))),
    };
    if want_cuda {
        return join_nccl(env, &opts);
    }
    let timeout = comm_timeout()?;
    let rdv = rendezvous(env, || Ok(b"longctx cpu world".to_vec()), &opts)?;
    let link = Arc::new(MonitorLink { monitor: rdv.monitor.clone(), rank: env.rank });
    let (comm, inbox) = process::world(env.rank, env.world, link, timeout)?;
    {
        let deliver = inbox.clone();
        rdv.monitor.on_data(move |bytes| deliver.deliver(bytes));
        rdv.monitor.on_failure(move |reason| inbox.abort(reason));
    }
    Ok(Joined { comm, device: Device::Cpu, monitor: rdv.monitor })
}

/// The process transport's link: messages ride the rendezvous connections.
struct MonitorLink {
    monitor: Monitor,
    rank: usize,
}

impl process::Link for MonitorLink {
    fn local_rank(&self) -> usize {
        self.rank
    }
    fn send(&self, to: usize, bytes: Vec<u8>) -> std::result::Result<(), String> {
        self.monitor.send_data(to, &bytes)
    }
    fn abort(&self, reason: &str) {
        self.monitor.report_failure(reason);
    }
}

#[cfg(not(feature = "nccl"))]
fn join_nccl(env: &DistEnv, _opts: &RendezvousOptions) -> Result<Joined> {
    Err(Error::Setting(format!(
        "rank {} of {}: model.device is CUDA, but this build has no NCCL; build with scripts/build_cuda.sh, or \
         use --device cpu for processes on the CPU",
        env.rank, env.world
    )))
}

#[cfg(feature = "nccl")]
fn join_nccl(env: &DistEnv, opts: &RendezvousOptions) -> Result<Joined> {
    use longctx_attention::comm::nccl::NcclComm;
    let rdv = rendezvous(env, || NcclComm::unique_id().map_err(Error::from), opts)?;
    // Open the device after the rendezvous, so that a rank without a GPU tells the
    // others at once (through the monitor) instead of leaving them waiting to join.
    let opened = (|| -> Result<(Device, Arc<NcclComm>)> {
        let device = crate::device::open_cuda(env.local_rank).map_err(|e| {
            let why = match e {
                Error::Setting(m) => m,
                other => other.to_string(),
            };
            Error::Setting(format!("rank {}: {why}: start at most one process per GPU on each node (--nproc-per-node)", env.rank))
        })?;
        let comm = NcclComm::new(&device, env.rank, env.world, &rdv.blob)?;
        Ok((device, comm))
    })();
    let (device, comm) = match opened {
        Ok(x) => x,
        Err(e) => {
            rdv.monitor.report_failure(&e.to_string());
            rdv.monitor.exit_after_failure(Duration::from_secs(15));
            return Err(e);
        }
    };
    {
        let c = comm.clone();
        rdv.monitor.on_failure(move |reason| c.abort_from_peer(reason));
        let m = rdv.monitor.clone();
        comm.set_abort_hook(move |reason| m.report_failure(reason));
    }
    Ok(Joined { comm, device, monitor: rdv.monitor })
}
