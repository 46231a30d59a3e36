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

/// Run `f` once per rank of an in-process world of `n` threads; results in rank order,
/// or the error of the rank that failed first. A blocking call that waits longer than
/// `collective_timeout` (`None`: no limit) for a peer aborts the world.
pub fn run_threads<T: Send>(
    n: usize,
    collective_timeout: Option<Duration>,
    f: impl Fn(Arc<dyn Comm>) -> Result<T> + Sync,
) -> Result<Vec<T>> {
    let timeout = collective_timeout.unwrap_or(Duration::MAX);
    // The first failure, kept typed: an error that names a file or says why training
    // stopped is returned as it is (not as "invalid setting: rank r failed: ...").
    let first: std::sync::Mutex<Option<Error>> = std::sync::Mutex::new(None);
    let out = thread::run_ranks_with_timeout(n, timeout, |comm| {
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

/// Test hook (fault injection): `LONGCTX_TEST_STALL=RANK@STEP` makes world rank RANK stop
/// taking part before optimizer step STEP (counted from 0 over the run): it sleeps for
/// good, alive (its heartbeats go on) but never entering another collective, as a rank
/// stuck in a kernel or a deadlock would. What `parallel.collective_timeout_s` is for.
pub const TEST_STALL_ENV: &str = "LONGCTX_TEST_STALL";

/// Called by the trainer before each step; see [`TEST_STALL_ENV`].
pub fn test_stall(rank: usize, step: u64) -> Result<()> {
    let Ok(v) = std::env::var(TEST_STALL_ENV) else { return Ok(()) };
    let parsed = v.trim().split_once('@').and_then(|(r, s)| Some((r.parse::<usize>().ok()?, s.parse::<u64>().ok()?)));
    let Some((r, s)) = parsed else {
        return Err(Error::Setting(format!("{TEST_STALL_ENV} = `{v}`: expected RANK@STEP, e.g. 1@2 (a test hook; unset it)")));
    };
    if (r, s) == (rank, step) {
        eprintln!("rank {rank}: {TEST_STALL_ENV}: no longer taking part from step {step} (test hook)");
        loop {
            std::thread::sleep(Duration::from_secs(3600));
        }
    }
    Ok(())
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
/// A collective that waits longer than `collective_timeout` (`None`: no limit) for the
/// other ranks aborts every rank with a message naming the rank and the collective.
pub fn join(env: &DistEnv, device: &str, collective_timeout: Option<Duration>) -> Result<Joined> {
    let opts = RendezvousOptions::from_env()?;
    let want_cuda = match device {
        "cpu" => false,
        d if d.starts_with("cuda") => true,
        d => return Err(Error::config("<run config>", "model.device", format!("expected cpu, cuda or cuda:N, got `{d}`"))),
    };
    if want_cuda {
        return join_nccl(env, &opts, collective_timeout);
    }
    let timeout = collective_timeout.unwrap_or(Duration::MAX);
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
fn join_nccl(env: &DistEnv, _opts: &RendezvousOptions, _timeout: Option<Duration>) -> Result<Joined> {
    Err(Error::Setting(format!(
        "rank {} of {}: model.device is CUDA, but this build has no NCCL; build with scripts/build_cuda.sh, or \
         use --device cpu for processes on the CPU",
        env.rank, env.world
    )))
}

#[cfg(feature = "nccl")]
fn join_nccl(env: &DistEnv, opts: &RendezvousOptions, collective_timeout: Option<Duration>) -> Result<Joined> {
    use longctx_attention::comm::nccl::{Family, NcclComm, NcclOptions};
    let rdv = rendezvous(env, || NcclComm::unique_id().map_err(Error::from), opts)?;
    // The failure wiring goes in before the communicator: a failure found here during
    // ncclCommInitRank is told to the others, and one found elsewhere aborts ours.
    let family = Family::new(env.rank, env.world);
    {
        let m = rdv.monitor.clone();
        family.set_abort_hook(move |reason| m.report_failure(reason));
        let f = family.clone();
        rdv.monitor.on_failure(move |reason| f.abort_from_peer(reason));
        stop_if_unsettled(&rdv.monitor, family.clone(), env.rank, Duration::from_secs(15));
    }
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
        let nccl_opts = NcclOptions { collective_timeout, ..NcclOptions::default() };
        let comm = NcclComm::init(&device, env.rank, env.world, &rdv.blob, nccl_opts, family.clone())?;
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
    Ok(Joined { comm, device, monitor: rdv.monitor })
}

/// Backstop: after a failure, stop the process if `family` has not been able to abort
/// its communicators within `grace` (a call the host cannot leave, e.g.
/// `ncclCommInitRank` waiting for a rank that is gone).
#[cfg(feature = "nccl")]
fn stop_if_unsettled(monitor: &Monitor, family: Arc<longctx_attention::comm::nccl::Family>, rank: usize, grace: Duration) {
    monitor.on_failure(move |reason| {
        let (family, reason) = (family.clone(), reason.to_string());
        std::thread::spawn(move || {
            std::thread::sleep(grace);
            if !family.settled() {
                eprintln!("rank {rank}: stopping: {reason} (an NCCL call could not be interrupted)");
                std::process::exit(super::launch::PEER_FAILED_EXIT_CODE);
            }
        });
    });
}
