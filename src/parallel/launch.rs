//! `longctx launch`: start one process per local GPU (rank) and supervise them.
//!
//! Each child gets the torchrun-style environment that [`super::env`] reads:
//! `RANK = node_rank · nproc_per_node + local_rank`, `LOCAL_RANK`, `WORLD_SIZE =
//! nnodes · nproc_per_node`, `LOCAL_WORLD_SIZE = nproc_per_node`, `GROUP_RANK` /
//! `NODE_RANK = node_rank`, `MASTER_ADDR`, `MASTER_PORT`, `LONGCTX_RDZV_TIMEOUT_S` and the
//! job secret `LONGCTX_RDZV_SECRET` (see [`super::secret`]): the launcher's own when it is
//! set (required with several nodes: the same value on every node), else a fresh random
//! one per launch.
//! `CUDA_VISIBLE_DEVICES` is passed through unchanged: every rank sees all GPUs of
//! the node (what NCCL wants for peer-to-peer paths) and uses ordinal `LOCAL_RANK`.
//!
//! Child output lines are prefixed with `[rank N] ` (stdout to stdout, stderr to
//! stderr). If a child exits non-zero or is killed by a signal, the others get
//! SIGTERM, then SIGKILL after `kill_grace`, and [`launch`] returns an error naming
//! the first failed rank and its status. SIGINT/SIGTERM sent to the launcher (Ctrl-C)
//! are forwarded to every child, and the launcher waits for them without a deadline: a
//! `longctx train` rank writes a checkpoint at the next step boundary and exits (a second
//! signal kills every rank at once). Children
//! run in their own process groups (signals reach their own children too) and get
//! SIGKILL if the launcher itself dies (`PR_SET_PDEATHSIG`, Linux).
//!
//! Root cause: ranks that stop because the rendezvous monitor told them another rank
//! failed exit with [`PEER_FAILED_EXIT_CODE`]; the launcher names a rank that failed
//! otherwise when there is one (then one it did not signal itself), whatever order the
//! exits were seen in.
//!
//! Multi-node: run one launcher per node with the same `--nnodes`, `--master-addr`,
//! `--master-port` and its own `--node-rank`; the ranks meet in the rendezvous of
//! [`super::rendezvous`]. A failure on another node reaches this node's ranks through
//! the rendezvous monitor; they exit non-zero and this launcher stops the rest.

use super::secret::{Secret, SECRET_ENV, SECRET_HOWTO};
use std::io::{BufRead, BufReader, Read, Write};
use std::os::unix::process::{CommandExt, ExitStatusExt};
use std::path::PathBuf;
use std::process::{Command, ExitStatus, Stdio};
use std::sync::atomic::{AtomicI32, Ordering};
use std::sync::Mutex;
use std::time::{Duration, Instant};

/// Exit code of a rank that stops because another rank failed (secondary failure).
pub const PEER_FAILED_EXIT_CODE: i32 = 86;

/// What to launch. See the module doc.
#[derive(Debug, Clone)]
pub struct LaunchOptions {
    pub nproc_per_node: usize,
    pub nnodes: usize,
    pub node_rank: usize,
    pub master_addr: String,
    /// 0 = pick a free port (single node only).
    pub master_port: u16,
    pub program: PathBuf,
    pub args: Vec<String>,
    pub rdzv_timeout: Duration,
    /// Time between SIGTERM and SIGKILL when stopping ranks.
    pub kill_grace: Duration,
    /// The job secret for the ranks; `None`: a fresh one (single node only).
    pub secret: Option<Secret>,
}

/// `--help` text on the job secret.
const SECRET_HELP: &str = "Authentication: the ranks prove to each other in the rendezvous that they belong to \
the same job with a shared secret, the environment variable LONGCTX_RDZV_SECRET (random, not chosen: at least 16 \
bytes and an estimated 100 bits of entropy). Unset on a \
single node, the launcher makes a random one per job and passes it to its ranks. With --nnodes > 1 export the same \
value on every node before launching, e.g.
  export LONGCTX_RDZV_SECRET=$(openssl rand -hex 32)
Ranks started by torchrun or Slurm read the same variable; it is required unless MASTER_ADDR is loopback.";

/// Command-line form of [`LaunchOptions`] (for `longctx launch`).
#[derive(clap::Args, Debug, Clone)]
#[command(after_help = SECRET_HELP)]
pub struct LaunchArgs {
    /// Ranks to start on this node (one per GPU).
    #[arg(long)]
    pub nproc_per_node: usize,
    /// Number of nodes (one launcher per node).
    #[arg(long, default_value_t = 1)]
    pub nnodes: usize,
    /// This node's index in 0..nnodes.
    #[arg(long, default_value_t = 0)]
    pub node_rank: usize,
    /// Address of node 0, where rank 0 listens [default: 127.0.0.1; required with --nnodes > 1].
    #[arg(long)]
    pub master_addr: Option<String>,
    /// Rendezvous TCP port on the master (0 = any free port, single node only).
    #[arg(long, default_value_t = 29500)]
    pub master_port: u16,
    /// Seconds the ranks wait for each other at start-up.
    #[arg(long, default_value_t = 300.0)]
    pub rdzv_timeout: f64,
    /// Seconds between SIGTERM and SIGKILL when stopping ranks.
    #[arg(long, default_value_t = 5.0)]
    pub kill_grace: f64,
    /// Program to run per rank [default: this executable].
    #[arg(long)]
    pub program: Option<PathBuf>,
    /// Arguments of each rank's program (after `--`).
    #[arg(last = true, required = true)]
    pub args: Vec<String>,
}

impl LaunchArgs {
    /// Resolve defaults (`program` = the current executable).
    pub fn into_options(self) -> Result<LaunchOptions, LaunchError> {
        let program = match self.program {
            Some(p) => p,
            None => std::env::current_exe().map_err(|e| LaunchError::Setting(format!("cannot find the current executable: {e}")))?,
        };
        let master_addr = match (self.master_addr, self.nnodes) {
            (Some(a), _) => a,
            (None, 1) => "127.0.0.1".to_string(),
            (None, n) => {
                return Err(LaunchError::Setting(format!(
                    "--master-addr is required with --nnodes {n} (the address of node 0, reachable from every node)"
                )))
            }
        };
        let secs = |name: &str, v: f64| {
            if v.is_finite() && v > 0.0 {
                Ok(Duration::from_secs_f64(v))
            } else {
                Err(LaunchError::Setting(format!("--{name} must be a positive number of seconds, got {v}")))
            }
        };
        Ok(LaunchOptions {
            nproc_per_node: self.nproc_per_node,
            nnodes: self.nnodes,
            node_rank: self.node_rank,
            master_addr,
            master_port: self.master_port,
            program,
            args: self.args,
            rdzv_timeout: secs("rdzv-timeout", self.rdzv_timeout)?,
            kill_grace: secs("kill-grace", self.kill_grace)?,
            secret: Secret::from_env().map_err(|e| LaunchError::Setting(e.to_string()))?,
        })
    }
}

#[derive(Debug, thiserror::Error)]
pub enum LaunchError {
    #[error("launch: {0}")]
    Setting(String),
    #[error("launch: cannot start {program} for rank {rank}: {source}")]
    Spawn { program: PathBuf, rank: usize, source: std::io::Error },
    #[error("launch: rank {rank} (local rank {local_rank}, pid {pid}) {status}; stopped the other ranks")]
    RankFailed { rank: usize, local_rank: usize, pid: u32, status: String, code: i32 },
    /// `clean`: every rank then exited 0 (a training rank checkpoints and exits 0 on a
    /// stop signal): an interruption, not a failure.
    #[error("launch: interrupted by {signal}; {}", if *clean { "every rank stopped cleanly" } else { "stopped all ranks" })]
    Interrupted { signal: String, code: i32, clean: bool },
}

impl LaunchError {
    /// Exit code for the launcher: the failed rank's code, 128 + signal number for a
    /// signal, 1 otherwise.
    pub fn exit_code(&self) -> i32 {
        match self {
            LaunchError::RankFailed { code, .. } | LaunchError::Interrupted { code, .. } => *code,
            _ => 1,
        }
    }
}

fn signal_name(sig: i32) -> String {
    let name = match sig {
        libc::SIGHUP => "SIGHUP",
        libc::SIGINT => "SIGINT",
        libc::SIGQUIT => "SIGQUIT",
        libc::SIGILL => "SIGILL",
        libc::SIGABRT => "SIGABRT",
        libc::SIGBUS => "SIGBUS",
        libc::SIGFPE => "SIGFPE",
        libc::SIGKILL => "SIGKILL",
        libc::SIGSEGV => "SIGSEGV",
        libc::SIGPIPE => "SIGPIPE",
        libc::SIGTERM => "SIGTERM",
        _ => return format!("signal {sig}"),
    };
    format!("signal {sig} ({name})")
}

/// Human description and launcher exit code of a child's status.
fn describe(status: ExitStatus) -> (String, i32) {
    match (status.code(), status.signal()) {
        (Some(c), _) => (format!("exited with status {c}"), c),
        (None, Some(s)) => (format!("was killed by {}", signal_name(s)), 128 + s),
        _ => ("ended with an unknown status".into(), 1),
    }
}

// ---------------------------------------------------------------- signals

/// Last SIGINT/SIGTERM received while a launch runs (0 = none).
static SIGNAL: AtomicI32 = AtomicI32::new(0);
/// Launches running and the handlers they replaced.
static HANDLERS: Mutex<(usize, Vec<(i32, libc::sigaction)>)> = Mutex::new((0, Vec::new()));

extern "C" fn on_signal(sig: libc::c_int) {
    SIGNAL.store(sig, Ordering::SeqCst);
}

fn install_handlers() {
    let mut h = HANDLERS.lock().unwrap_or_else(|p| p.into_inner());
    if h.0 == 0 {
        SIGNAL.store(0, Ordering::SeqCst);
        for sig in [libc::SIGINT, libc::SIGTERM] {
            // SAFETY: a plain sigaction with a handler that only stores an atomic.
            unsafe {
                let mut new: libc::sigaction = std::mem::zeroed();
                new.sa_sigaction = on_signal as *const () as libc::sighandler_t;
                new.sa_flags = libc::SA_RESTART;
                libc::sigemptyset(&mut new.sa_mask);
                let mut old: libc::sigaction = std::mem::zeroed();
                if libc::sigaction(sig, &new, &mut old) == 0 {
                    h.1.push((sig, old));
                }
            }
        }
    }
    h.0 += 1;
}

fn restore_handlers() {
    let mut h = HANDLERS.lock().unwrap_or_else(|p| p.into_inner());
    h.0 = h.0.saturating_sub(1);
    if h.0 == 0 {
        for (sig, old) in h.1.drain(..) {
            // SAFETY: restores the handler saved by install_handlers.
            unsafe {
                libc::sigaction(sig, &old, std::ptr::null_mut());
            }
        }
    }
}

/// Signal a child's whole process group (it leads one).
fn kill_group(pid: u32, sig: i32) {
    // SAFETY: kill(2) on a process group we created; errors (already gone) are ignored.
    unsafe {
        libc::kill(-(pid as libc::pid_t), sig);
    }
}

// ---------------------------------------------------------------- launch

/// Copy `src` to `dst` line by line, each line prefixed.
fn forward(src: impl Read, prefix: String, to_stderr: bool) {
    let mut src = BufReader::new(src);
    let mut line = Vec::new();
    loop {
        line.clear();
        match src.read_until(b'\n', &mut line) {
            Ok(0) | Err(_) => return,
            Ok(_) => {
                if !line.ends_with(b"\n") {
                    line.push(b'\n');
                }
                let mut out = Vec::with_capacity(prefix.len() + line.len());
                out.extend_from_slice(prefix.as_bytes());
                out.extend_from_slice(&line);
                let _ = if to_stderr {
                    std::io::stderr().lock().write_all(&out)
                } else {
                    std::io::stdout().lock().write_all(&out).and_then(|_| std::io::stdout().flush())
                };
            }
        }
    }
}

/// A free TCP port on `addr` (closed again at once; another process could take it).
fn free_port(addr: &str) -> Result<u16, LaunchError> {
    std::net::TcpListener::bind((addr, 0))
        .and_then(|l| l.local_addr())
        .map(|a| a.port())
        .map_err(|e| LaunchError::Setting(format!("cannot find a free port on {addr}: {e}")))
}

struct Rank {
    rank: usize,
    local_rank: usize,
    pid: u32,
    done: bool,
    /// We sent it SIGTERM/SIGKILL (its death by those is a consequence, not a cause).
    signaled: bool,
}

/// Start the ranks of this node and wait for them. `Ok(0)` when all exit 0.
pub fn launch(opts: LaunchOptions) -> Result<i32, LaunchError> {
    let LaunchOptions { nproc_per_node, nnodes, node_rank, .. } = opts;
    if nproc_per_node == 0 || nnodes == 0 {
        return Err(LaunchError::Setting("--nproc-per-node and --nnodes must be at least 1".into()));
    }
    if node_rank >= nnodes {
        return Err(LaunchError::Setting(format!("--node-rank {node_rank} is not below --nnodes {nnodes}")));
    }
    let port = match (opts.master_port, nnodes) {
        (0, 1) => free_port(&opts.master_addr)?,
        (0, _) => {
            return Err(LaunchError::Setting(
                "--master-port 0 (any free port) only works on a single node; give every node the same port".into(),
            ))
        }
        (p, _) => p,
    };
    let world = nnodes * nproc_per_node;
    let secret = job_secret(opts.secret.as_ref(), nnodes)?;

    install_handlers();
    let result = supervise(&opts, port, world, &secret);
    restore_handlers();
    result
}

type Exits = std::sync::mpsc::Receiver<(usize, std::io::Result<ExitStatus>)>;

/// The secret the ranks get: the given one, or a fresh one on a single node.
fn job_secret(given: Option<&Secret>, nnodes: usize) -> Result<Secret, LaunchError> {
    match given {
        Some(s) => Ok(s.clone()),
        None if nnodes == 1 => Secret::generate().and_then(|v| Secret::new(&v)).map_err(|e| LaunchError::Setting(e.to_string())),
        None => Err(LaunchError::Setting(format!(
            "--nnodes {nnodes}: export the same {SECRET_ENV} on every node before launching ({SECRET_HOWTO}); \
             a launcher makes its own secret only for a single node, and ranks of different nodes would not \
             authenticate each other"
        ))),
    }
}

fn supervise(opts: &LaunchOptions, port: u16, world: usize, secret: &Secret) -> Result<i32, LaunchError> {
    let mut ranks: Vec<Rank> = Vec::new();
    let mut pumps = Vec::new();
    // One waiter thread per child reports its exit.
    let (exited_tx, exited) = std::sync::mpsc::channel::<(usize, std::io::Result<ExitStatus>)>();
    for local_rank in 0..opts.nproc_per_node {
        let rank = opts.node_rank * opts.nproc_per_node + local_rank;
        let mut child = match rank_command(opts, port, world, rank, local_rank, secret).spawn() {
            Ok(c) => c,
            Err(source) => {
                stop_all(&mut ranks, &exited, opts.kill_grace);
                return Err(LaunchError::Spawn { program: opts.program.clone(), rank, source });
            }
        };
        let prefix = format!("[rank {rank}] ");
        if let Some(out) = child.stdout.take() {
            let p = prefix.clone();
            pumps.push(std::thread::spawn(move || forward(out, p, false)));
        }
        if let Some(err) = child.stderr.take() {
            pumps.push(std::thread::spawn(move || forward(err, prefix, true)));
        }
        let idx = ranks.len();
        ranks.push(Rank { rank, local_rank, pid: child.id(), done: false, signaled: false });
        let tx = exited_tx.clone();
        std::thread::spawn(move || {
            let st = child.wait();
            let _ = tx.send((idx, st));
        });
    }
    let outcome = watch(opts, &mut ranks, &exited);
    // Let the output threads drain; do not wait on pipes held open by escaped grandchildren.
    let until = Instant::now() + Duration::from_secs(2);
    for p in pumps {
        while !p.is_finished() && Instant::now() < until {
            std::thread::sleep(Duration::from_millis(10));
        }
        if p.is_finished() {
            let _ = p.join();
        }
    }
    outcome
}

/// The command of one local rank: torchrun's variables, piped output, its own process
/// group (so a stop reaches its children), killed if the launcher dies.
fn rank_command(opts: &LaunchOptions, port: u16, world: usize, rank: usize, local_rank: usize, secret: &Secret) -> Command {
    let mut cmd = Command::new(&opts.program);
    cmd.args(&opts.args)
        .env("RANK", rank.to_string())
        .env("LOCAL_RANK", local_rank.to_string())
        .env("WORLD_SIZE", world.to_string())
        .env("LOCAL_WORLD_SIZE", opts.nproc_per_node.to_string())
        .env("GROUP_RANK", opts.node_rank.to_string())
        .env("NODE_RANK", opts.node_rank.to_string())
        .env("MASTER_ADDR", &opts.master_addr)
        .env("MASTER_PORT", port.to_string())
        .env(super::rendezvous::TIMEOUT_ENV, opts.rdzv_timeout.as_secs_f64().to_string())
        .env(SECRET_ENV, secret.expose())
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .process_group(0);
    // SAFETY: prctl is async-signal-safe; it only sets the parent-death signal.
    unsafe {
        cmd.pre_exec(|| {
            libc::prctl(libc::PR_SET_PDEATHSIG, libc::SIGKILL);
            Ok(())
        });
    }
    cmd
}

/// How a rank's exit counts: `None` for success, else its class (0 = cause, 1 = stopped
/// because a peer failed, 2 = killed by the signal we sent it) and the error.
fn exit_failure(r: &Rank, st: std::io::Result<ExitStatus>) -> Option<(u8, LaunchError)> {
    let (status, code, class) = match st {
        Ok(st) if st.success() => return None,
        Ok(st) => {
            let (status, code) = describe(st);
            let ours = matches!(st.signal(), Some(libc::SIGTERM | libc::SIGKILL)) || code == 128 + libc::SIGTERM;
            let class = if r.signaled && ours {
                2
            } else if code == PEER_FAILED_EXIT_CODE {
                1
            } else {
                0
            };
            (status, code, class)
        }
        Err(e) => (format!("could not be waited for ({e})"), 1, 0),
    };
    Some((class, LaunchError::RankFailed { rank: r.rank, local_rank: r.local_rank, pid: r.pid, status, code }))
}

/// Waits for every rank; on a failure or a signal stops the others (SIGTERM, SIGKILL
/// after the grace; a second signal kills at once). The error names the first failure
/// of the lowest class (see [`exit_failure`]), or the interruption.
fn watch(opts: &LaunchOptions, ranks: &mut [Rank], exited: &Exits) -> Result<i32, LaunchError> {
    let mut failures: Vec<(u8, LaunchError)> = Vec::new();
    let mut interrupted: Option<LaunchError> = None;
    let mut stop_deadline: Option<Instant> = None;
    let mut forwarded = 0;
    while ranks.iter().any(|r| !r.done) {
        match exited.recv_timeout(Duration::from_millis(20)) {
            Ok((idx, st)) => {
                ranks[idx].done = true;
                failures.extend(exit_failure(&ranks[idx], st));
            }
            Err(std::sync::mpsc::RecvTimeoutError::Timeout) => {}
            Err(std::sync::mpsc::RecvTimeoutError::Disconnected) => break,
        }
        let sig = SIGNAL.swap(0, Ordering::SeqCst);
        let mut send = None;
        if sig != 0 {
            forwarded += 1;
            send = Some(if forwarded > 1 { libc::SIGKILL } else { sig });
            if failures.is_empty() && interrupted.is_none() {
                interrupted = Some(LaunchError::Interrupted { signal: signal_name(sig), code: 128 + sig, clean: false });
            }
            // No SIGKILL deadline: the ranks checkpoint and exit (a failure among them still
            // starts one below).
        } else if !failures.is_empty() && stop_deadline.is_none() {
            send = Some(libc::SIGTERM);
            stop_deadline = Some(Instant::now() + opts.kill_grace);
        }
        if stop_deadline.is_some_and(|d| Instant::now() >= d) {
            send = Some(libc::SIGKILL);
        }
        if let Some(sig) = send {
            for r in ranks.iter_mut().filter(|r| !r.done) {
                r.signaled = true;
                kill_group(r.pid, sig);
            }
        }
    }
    if let Some(LaunchError::Interrupted { signal, code, .. }) = interrupted {
        return Err(LaunchError::Interrupted { signal, code, clean: failures.is_empty() });
    }
    match failures.into_iter().enumerate().min_by_key(|(i, (class, _))| (*class, *i)) {
        Some((_, (_, e))) => Err(e),
        None => Ok(0),
    }
}

/// Stop already-started ranks (spawn failure path): SIGTERM, SIGKILL after `grace`.
fn stop_all(ranks: &mut [Rank], exited: &Exits, grace: Duration) {
    for r in ranks.iter() {
        kill_group(r.pid, libc::SIGTERM);
    }
    let until = Instant::now() + grace;
    while ranks.iter().any(|r| !r.done) {
        match exited.recv_timeout(Duration::from_millis(20)) {
            Ok((idx, _)) => ranks[idx].done = true,
            Err(std::sync::mpsc::RecvTimeoutError::Timeout) => {
                if Instant::now() >= until {
                    ranks.iter().filter(|r| !r.done).for_each(|r| kill_group(r.pid, libc::SIGKILL));
                }
            }
            Err(_) => return,
        }
    }
}
