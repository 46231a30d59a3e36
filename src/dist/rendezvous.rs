//! TCP rendezvous on `MASTER_ADDR:MASTER_PORT`, then a failure monitor on the same
//! connections.
//!
//! Rendezvous: rank 0 listens (on the unspecified address of MASTER_ADDR's family,
//! port MASTER_PORT) and generates a blob (the NCCL unique id on GPU, any bytes on
//! CPU). Every other rank connects, retrying until the timeout, and sends
//! `(rank, world)`. Rank 0 rejects out-of-range or duplicate ranks and disagreeing
//! world sizes, and once all `world - 1` peers have joined sends the blob to each.
//! Any failure (bad peer, timeout) is sent to every connected rank as an error frame,
//! so all ranks report the same message, e.g.
//! `rendezvous timed out after 5 s waiting for ranks [2, 3] on 127.0.0.1:29500`.
//!
//! Monitor: afterwards rank 0 keeps one connection per peer (a star). Both sides send
//! a heartbeat every `heartbeat`; a peer is declared lost when its connection closes
//! without a goodbye (the process died: the kernel closes its sockets at once) or when
//! it is silent for `peer_timeout` (machine or network gone). Rank 0 relays every
//! failure to all peers, so every rank learns of any rank's failure within about one
//! round trip (process death) or `peer_timeout` (silent peer). What to do then is the
//! caller's choice via [`Monitor::on_failure`]: with NCCL, abort the communicator so
//! blocked collectives return, then [`Monitor::exit_after_failure`] as a backstop.
//! A rank that ends cleanly calls [`Monitor::finish`] (a goodbye), otherwise its exit
//! counts as a failure for the others. Rank 0 finishes last: it waits (at most
//! `peer_timeout`) for every peer's goodbye, since it relays their data (below).
//!
//! Data: the same star carries the messages of CPU worlds of processes
//! ([`Monitor::send_data`], [`Monitor::on_data`]): a rank sends every message to rank 0,
//! which keeps those addressed to it and forwards the others, in order per connection.
//! Enough for correctness runs and tests; GPUs talk over NCCL.
//!
//! Wire format: frames `[kind u8][len u32 BE][payload]`; hello payload =
//! `b"LONGCTX1" ++ rank u32 BE ++ world u32 BE`; data payload = `to u32 BE ++ bytes`.

use super::comm_error;
use super::env::DistEnv;
use super::launch::PEER_FAILED_EXIT_CODE;
use crate::Result;
use std::collections::BTreeMap;
use std::io::{ErrorKind, Read, Write};
use std::net::{IpAddr, Ipv4Addr, Ipv6Addr, SocketAddr, TcpListener, TcpStream, ToSocketAddrs};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Condvar, Mutex};
use std::time::{Duration, Instant};

/// Default rendezvous timeout.
pub const DEFAULT_TIMEOUT: Duration = Duration::from_secs(300);
/// Environment variable (seconds, may be fractional) overriding the default timeout;
/// `longctx launch` sets it for its children from `--rdzv-timeout`.
pub const TIMEOUT_ENV: &str = "LONGCTX_RDZV_TIMEOUT_S";
/// Environment variable (seconds) overriding how long a silent peer is waited for
/// (default 30 s) before it is declared lost.
pub const PEER_TIMEOUT_ENV: &str = "LONGCTX_PEER_TIMEOUT_S";

const MAGIC: &[u8; 8] = b"LONGCTX1";
const HELLO: u8 = 1;
const WELCOME: u8 = 2;
const ERROR: u8 = 3;
const PING: u8 = 4;
const BYE: u8 = 5;
const DATA: u8 = 6;
/// Largest control frame; data frames may use the whole u32 length.
const MAX_PAYLOAD: usize = 1 << 20;

#[derive(Debug, Clone)]
pub struct RendezvousOptions {
    /// How long to wait for all ranks to join.
    pub timeout: Duration,
    /// Heartbeat interval of the monitor.
    pub heartbeat: Duration,
    /// Silence after which a peer is declared lost.
    pub peer_timeout: Duration,
}

impl Default for RendezvousOptions {
    fn default() -> Self {
        Self { timeout: DEFAULT_TIMEOUT, heartbeat: Duration::from_secs(1), peer_timeout: Duration::from_secs(30) }
    }
}

impl RendezvousOptions {
    /// Defaults, with the timeout taken from `LONGCTX_RDZV_TIMEOUT_S` and the peer
    /// timeout from `LONGCTX_PEER_TIMEOUT_S` when set.
    pub fn from_env() -> Result<Self> {
        let mut o = Self::default();
        let secs = |name: &str| -> Result<Option<Duration>> {
            match std::env::var(name) {
                Err(_) => Ok(None),
                Ok(v) => v
                    .trim()
                    .parse()
                    .ok()
                    .filter(|s: &f64| s.is_finite() && *s > 0.0)
                    .map(|s| Some(Duration::from_secs_f64(s)))
                    .ok_or_else(|| crate::Error::Setting(format!("{name} = `{v}` is not a positive number of seconds"))),
            }
        };
        if let Some(t) = secs(TIMEOUT_ENV)? {
            o.timeout = t;
        }
        if let Some(t) = secs(PEER_TIMEOUT_ENV)? {
            o.peer_timeout = t;
            o.heartbeat = o.heartbeat.min(t / 3);
        }
        Ok(o)
    }
}

/// The outcome of a rendezvous: the agreed blob and the failure monitor.
#[derive(Debug)]
pub struct Rendezvous {
    pub blob: Vec<u8>,
    pub monitor: Monitor,
}

/// `5 s`, `2.5 s`.
pub fn fmt_secs(d: Duration) -> String {
    let s = d.as_secs_f64();
    if (s - s.round()).abs() < 1e-9 {
        format!("{} s", s.round() as u64)
    } else {
        format!("{s:.1} s")
    }
}

/// Join the run described by `env`. Rank 0 calls `make_blob` and sends its result to
/// everyone; other ranks never call it.
pub fn rendezvous(env: &DistEnv, make_blob: impl FnOnce() -> Result<Vec<u8>>, opts: &RendezvousOptions) -> Result<Rendezvous> {
    if env.world == 1 {
        return Ok(Rendezvous { blob: make_blob()?, monitor: Monitor::new(0, 1, opts, vec![]) });
    }
    if env.rank == 0 {
        master(env, make_blob()?, opts)
    } else {
        client(env, opts)
    }
}

// ---------------------------------------------------------------- framing

fn frame(kind: u8, payload: &[u8]) -> Vec<u8> {
    let mut f = Vec::with_capacity(5 + payload.len());
    f.push(kind);
    f.extend_from_slice(&(payload.len() as u32).to_be_bytes());
    f.extend_from_slice(payload);
    f
}

enum ReadOutcome {
    Frame(u8, Vec<u8>),
    /// No complete frame before the read timeout.
    Idle,
    /// The peer closed the connection (or it broke).
    Closed(String),
}

/// Accumulates bytes so a read timeout in the middle of a frame loses nothing.
struct FrameReader {
    stream: TcpStream,
    buf: Vec<u8>,
}

impl FrameReader {
    fn new(stream: TcpStream) -> Self {
        Self { stream, buf: Vec::new() }
    }

    fn parse(&mut self) -> Option<std::result::Result<(u8, Vec<u8>), String>> {
        if self.buf.len() < 5 {
            return None;
        }
        let len = u32::from_be_bytes([self.buf[1], self.buf[2], self.buf[3], self.buf[4]]) as usize;
        if len > MAX_PAYLOAD && self.buf[0] != DATA {
            return Some(Err(format!("protocol error: frame of {len} bytes")));
        }
        if self.buf.len() < 5 + len {
            return None;
        }
        let kind = self.buf[0];
        let payload = if self.buf.len() == 5 + len {
            let mut all = std::mem::take(&mut self.buf);
            all.drain(..5);
            all
        } else {
            let p = self.buf[5..5 + len].to_vec();
            self.buf.drain(..5 + len);
            p
        };
        Some(Ok((kind, payload)))
    }

    /// Wait at most `wait` for one frame.
    fn next(&mut self, wait: Duration) -> ReadOutcome {
        let until = Instant::now() + wait;
        loop {
            match self.parse() {
                Some(Ok((k, p))) => return ReadOutcome::Frame(k, p),
                Some(Err(e)) => return ReadOutcome::Closed(e),
                None => {}
            }
            let left = until.saturating_duration_since(Instant::now());
            if left.is_zero() {
                return ReadOutcome::Idle;
            }
            if let Err(e) = self.stream.set_read_timeout(Some(left.max(Duration::from_millis(1)))) {
                return ReadOutcome::Closed(e.to_string());
            }
            // Read straight into the buffer, at least the rest of the current frame.
            let want = if self.buf.len() >= 5 {
                let len = u32::from_be_bytes([self.buf[1], self.buf[2], self.buf[3], self.buf[4]]) as usize;
                (5 + len).saturating_sub(self.buf.len()).max(4096)
            } else {
                4096
            };
            // At most 1 MiB zero-filled per read: a read returns far less than a large
            // frame, and each call fills its window afresh.
            let at = self.buf.len();
            self.buf.resize(at + want.min(1 << 20), 0);
            let got = self.stream.read(&mut self.buf[at..]);
            self.buf.truncate(at + *got.as_ref().unwrap_or(&0));
            match got {
                Ok(0) => return ReadOutcome::Closed("connection closed".into()),
                Ok(_) => {}
                Err(e) if matches!(e.kind(), ErrorKind::WouldBlock | ErrorKind::TimedOut) => return ReadOutcome::Idle,
                Err(e) if e.kind() == ErrorKind::Interrupted => {}
                Err(e) => return ReadOutcome::Closed(e.to_string()),
            }
        }
    }
}

fn send(stream: &mut TcpStream, kind: u8, payload: &[u8]) -> std::io::Result<()> {
    stream.write_all(&frame(kind, payload))
}

// ---------------------------------------------------------------- rank 0

fn master(env: &DistEnv, blob: Vec<u8>, opts: &RendezvousOptions) -> Result<Rendezvous> {
    let start = Instant::now();
    let deadline = start + opts.timeout;
    let where_ = env.master();
    let ip: IpAddr = match env.master_addr.trim_matches(|c| c == '[' || c == ']').parse::<IpAddr>() {
        Ok(IpAddr::V6(_)) => Ipv6Addr::UNSPECIFIED.into(),
        _ => Ipv4Addr::UNSPECIFIED.into(),
    };
    let bind = SocketAddr::new(ip, env.master_port);
    let listener = TcpListener::bind(bind).map_err(|e| {
        comm_error(format!("rendezvous: rank 0 cannot listen on {bind}: {e} (is another run using MASTER_PORT = {}?)", env.master_port))
    })?;
    listener.set_nonblocking(true).map_err(|e| comm_error(format!("rendezvous: {bind}: {e}")))?;

    // Joined ranks: write half and the reader (which may already hold later bytes).
    let mut joined: BTreeMap<usize, (TcpStream, FrameReader)> = BTreeMap::new();
    // Tell everyone connected why we give up, then give up.
    let abort = |joined: &mut BTreeMap<usize, (TcpStream, FrameReader)>, extra: Option<&mut TcpStream>, msg: String| {
        for (s, _) in joined.values_mut() {
            let _ = send(s, ERROR, msg.as_bytes());
        }
        if let Some(s) = extra {
            let _ = send(s, ERROR, msg.as_bytes());
        }
        comm_error(msg)
    };
    while joined.len() + 1 < env.world {
        if Instant::now() >= deadline {
            let missing: Vec<usize> = (1..env.world).filter(|r| !joined.contains_key(r)).collect();
            let msg = format!("rendezvous timed out after {} waiting for ranks {missing:?} on {where_}", fmt_secs(opts.timeout));
            return Err(abort(&mut joined, None, msg));
        }
        let mut stream = match listener.accept() {
            Ok((s, _)) => s,
            Err(e) if e.kind() == ErrorKind::WouldBlock || e.kind() == ErrorKind::Interrupted => {
                std::thread::sleep(Duration::from_millis(10));
                continue;
            }
            Err(e) => return Err(abort(&mut joined, None, format!("rendezvous: accept on {bind}: {e}"))),
        };
        let _ = stream.set_nonblocking(false);
        let _ = stream.set_nodelay(true);
        let _ = stream.set_write_timeout(Some(Duration::from_secs(5)));
        // A real rank sends its hello right after connecting; anything else is dropped.
        let wait = deadline.saturating_duration_since(Instant::now()).min(Duration::from_secs(2));
        let mut reader = match stream.try_clone() {
            Ok(s) => FrameReader::new(s),
            Err(_) => continue,
        };
        let (kind, payload) = match reader.next(wait) {
            ReadOutcome::Frame(k, p) => (k, p),
            _ => continue,
        };
        if kind != HELLO || payload.len() != 16 || &payload[..8] != MAGIC {
            continue;
        }
        let rank = u32::from_be_bytes([payload[8], payload[9], payload[10], payload[11]]) as usize;
        let world = u32::from_be_bytes([payload[12], payload[13], payload[14], payload[15]]) as usize;
        let problem = if world != env.world {
            Some(format!("rendezvous on {where_}: rank {rank} has WORLD_SIZE = {world} but rank 0 has WORLD_SIZE = {}", env.world))
        } else if rank == 0 || rank >= env.world {
            Some(format!(
                "rendezvous on {where_}: a process joined as rank {rank}, which is not in 1..{} (two rank 0s, or a bad RANK?)",
                env.world
            ))
        } else if joined.contains_key(&rank) {
            Some(format!("rendezvous on {where_}: rank {rank} joined twice (two processes with RANK = {rank}?)"))
        } else {
            None
        };
        if let Some(msg) = problem {
            return Err(abort(&mut joined, Some(&mut stream), msg));
        }
        joined.insert(rank, (stream, reader));
    }
    for (rank, (s, _)) in joined.iter_mut() {
        if let Err(e) = send(s, WELCOME, &blob) {
            let msg = format!("rendezvous on {where_}: rank {rank} left before receiving the id ({e})");
            return Err(abort(&mut joined, None, msg));
        }
    }
    let peers = joined.into_iter().map(|(r, (s, rd))| (r, s, rd)).collect();
    Ok(Rendezvous { blob, monitor: Monitor::new(0, env.world, opts, peers) })
}

// ---------------------------------------------------------------- other ranks

fn client(env: &DistEnv, opts: &RendezvousOptions) -> Result<Rendezvous> {
    let start = Instant::now();
    let where_ = env.master();
    // Rank 0's own timeout message should win: wait a little longer than it does.
    let deadline = start + opts.timeout + Duration::from_secs(2);
    let mut last_err = String::from("no attempt");
    let mut stream = loop {
        if Instant::now() >= deadline {
            return Err(comm_error(format!(
                "rendezvous timed out after {} waiting for rank 0 to accept on {where_} (last error: {last_err})",
                fmt_secs(opts.timeout)
            )));
        }
        match where_.to_socket_addrs() {
            Err(e) => last_err = format!("cannot resolve {where_}: {e}"),
            Ok(addrs) => {
                let mut got = None;
                for a in addrs {
                    match TcpStream::connect_timeout(&a, Duration::from_secs(1)) {
                        Ok(s) => {
                            got = Some(s);
                            break;
                        }
                        Err(e) => last_err = e.to_string(),
                    }
                }
                if let Some(s) = got {
                    break s;
                }
            }
        }
        std::thread::sleep(Duration::from_millis(100));
    };
    let _ = stream.set_nodelay(true);
    let _ = stream.set_write_timeout(Some(Duration::from_secs(5)));
    let mut hello = MAGIC.to_vec();
    hello.extend_from_slice(&(env.rank as u32).to_be_bytes());
    hello.extend_from_slice(&(env.world as u32).to_be_bytes());
    send(&mut stream, HELLO, &hello).map_err(|e| comm_error(format!("rendezvous: sending to {where_}: {e}")))?;
    let mut reader = FrameReader::new(stream.try_clone().map_err(|e| comm_error(format!("rendezvous: {where_}: {e}")))?);
    loop {
        let left = deadline.saturating_duration_since(Instant::now());
        if left.is_zero() {
            return Err(comm_error(format!(
                "rendezvous timed out after {} on {where_}: connected, but rank 0 did not hear from all {} ranks",
                fmt_secs(opts.timeout),
                env.world
            )));
        }
        match reader.next(left) {
            ReadOutcome::Frame(WELCOME, blob) => {
                // The reader goes along: it may already hold the monitor's first frames.
                let monitor = Monitor::new(env.rank, env.world, opts, vec![(0, stream, reader)]);
                return Ok(Rendezvous { blob, monitor });
            }
            ReadOutcome::Frame(ERROR, msg) => return Err(comm_error(String::from_utf8_lossy(&msg).into_owned())),
            ReadOutcome::Frame(..) | ReadOutcome::Idle => {}
            ReadOutcome::Closed(why) => return Err(comm_error(format!("rendezvous: rank 0 on {where_} dropped the connection ({why})"))),
        }
    }
}

// ---------------------------------------------------------------- monitor

/// A failure callback and whether it already ran (each runs at most once).
struct Callback {
    f: Box<dyn Fn(&str) + Send + Sync>,
    ran: AtomicBool,
}

impl Callback {
    fn call(&self, reason: &str) {
        if !self.ran.swap(true, Ordering::SeqCst) {
            (self.f)(reason)
        }
    }
}

struct Shared {
    rank: usize,
    world: usize,
    failure: Mutex<Option<String>>,
    failed: Condvar,
    callbacks: Mutex<Vec<Arc<Callback>>>,
    /// Write halves: rank 0 holds one per peer, others hold rank 0's.
    writers: Mutex<BTreeMap<usize, TcpStream>>,
    closing: AtomicBool,
    /// Set by the first `fail` (the failure becomes visible only after its relay).
    claimed: AtomicBool,
    /// How long rank 0's `finish` waits for the peers' goodbyes.
    peer_timeout: Duration,
    /// Where data addressed to this rank goes (held back until a sink is set).
    data: Mutex<DataSink>,
}

type Sink = Arc<dyn Fn(&[u8]) + Send + Sync>;

enum DataSink {
    Waiting(Vec<Vec<u8>>),
    Ready(Sink),
}

impl Shared {
    fn take_data(&self, bytes: &[u8]) {
        let sink = {
            let mut d = self.data.lock().unwrap_or_else(|p| p.into_inner());
            match &mut *d {
                DataSink::Waiting(q) => {
                    q.push(bytes.to_vec());
                    return;
                }
                DataSink::Ready(f) => f.clone(),
            }
        };
        sink(bytes);
    }

    /// Write one data frame for `to` on the connection `via`.
    fn write_data(&self, via: usize, to: usize, bytes: &[u8]) -> std::result::Result<(), String> {
        let len = u32::try_from(bytes.len() + 4)
            .map_err(|_| format!("a message of {} bytes is too large for the CPU transport (limit 4 GiB)", bytes.len()))?;
        let mut ws = self.writers.lock().unwrap_or_else(|p| p.into_inner());
        let w = ws.get_mut(&via).ok_or_else(|| format!("no connection to rank {via} (it finished or failed)"))?;
        let mut head = [0u8; 9];
        head[0] = DATA;
        head[1..5].copy_from_slice(&len.to_be_bytes());
        head[5..9].copy_from_slice(&(to as u32).to_be_bytes());
        w.write_all(&head).and_then(|_| w.write_all(bytes)).map_err(|e| format!("writing to rank {via}: {e}"))
    }
}

impl Shared {
    /// Record the first failure, relay it (rank 0) and run the callbacks.
    fn fail(&self, reason: String, from_peer: Option<usize>) {
        if self.claimed.swap(true, Ordering::SeqCst) {
            return;
        }
        // Relay before the failure becomes visible: a main thread that sees it may
        // exit the process at once, taking the unsent relay with it.
        if self.rank == 0 {
            let mut ws = self.writers.lock().unwrap_or_else(|p| p.into_inner());
            for (peer, w) in ws.iter_mut() {
                if Some(*peer) != from_peer {
                    let _ = send(w, ERROR, reason.as_bytes());
                }
            }
        }
        *self.failure.lock().unwrap_or_else(|p| p.into_inner()) = Some(reason.clone());
        self.failed.notify_all();
        let cbs: Vec<_> = self.callbacks.lock().unwrap_or_else(|p| p.into_inner()).clone();
        for cb in cbs {
            cb.call(&reason);
        }
    }
}

/// Failure monitor of a distributed run (see the module doc). Cheap to clone.
#[derive(Clone)]
pub struct Monitor {
    shared: Arc<Shared>,
}

impl std::fmt::Debug for Monitor {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "Monitor(rank {} of {}, failure: {:?})", self.shared.rank, self.shared.world, self.failure())
    }
}

impl Monitor {
    fn new(rank: usize, world: usize, opts: &RendezvousOptions, peers: Vec<(usize, TcpStream, FrameReader)>) -> Self {
        let shared = Arc::new(Shared {
            rank,
            world,
            failure: Mutex::new(None),
            failed: Condvar::new(),
            callbacks: Mutex::new(Vec::new()),
            writers: Mutex::new(BTreeMap::new()),
            closing: AtomicBool::new(false),
            claimed: AtomicBool::new(false),
            data: Mutex::new(DataSink::Waiting(Vec::new())),
            peer_timeout: opts.peer_timeout,
        });
        // All write halves first: a watcher may relay a failure as soon as it starts.
        let mut readers = Vec::new();
        for (peer, stream, reader) in peers {
            shared.writers.lock().unwrap_or_else(|p| p.into_inner()).insert(peer, stream);
            readers.push((peer, reader));
        }
        for (peer, reader) in readers {
            let sh = shared.clone();
            let opts = opts.clone();
            std::thread::spawn(move || watch(sh, peer, reader, opts));
        }
        if world > 1 {
            let sh = Arc::downgrade(&shared);
            let beat = opts.heartbeat;
            std::thread::spawn(move || loop {
                std::thread::sleep(beat);
                let Some(sh) = sh.upgrade() else { return };
                if sh.closing.load(Ordering::SeqCst) {
                    return;
                }
                let mut ws = sh.writers.lock().unwrap_or_else(|p| p.into_inner());
                for w in ws.values_mut() {
                    let _ = send(w, PING, &[]);
                }
            });
        }
        Self { shared }
    }

    pub fn rank(&self) -> usize {
        self.shared.rank
    }
    pub fn world(&self) -> usize {
        self.shared.world
    }

    /// The first failure seen, if any.
    pub fn failure(&self) -> Option<String> {
        self.shared.failure.lock().unwrap_or_else(|p| p.into_inner()).clone()
    }

    /// Block until a failure is seen (or `timeout` passes; `None` = forever).
    pub fn wait_failure(&self, timeout: Option<Duration>) -> Option<String> {
        let until = timeout.map(|t| Instant::now() + t);
        let mut f = self.shared.failure.lock().unwrap_or_else(|p| p.into_inner());
        loop {
            if f.is_some() {
                return f.clone();
            }
            match until {
                None => f = self.shared.failed.wait(f).unwrap_or_else(|p| p.into_inner()),
                Some(u) => {
                    let left = u.saturating_duration_since(Instant::now());
                    if left.is_zero() {
                        return None;
                    }
                    f = self.shared.failed.wait_timeout(f, left).unwrap_or_else(|p| p.into_inner()).0;
                }
            }
        }
    }

    /// Run `f(reason)` once on the first failure (at once if it already happened).
    /// Runs on the monitor's thread: keep it short (abort a communicator, set a flag).
    pub fn on_failure(&self, f: impl Fn(&str) + Send + Sync + 'static) {
        let cb = Arc::new(Callback { f: Box::new(f), ran: AtomicBool::new(false) });
        self.shared.callbacks.lock().unwrap_or_else(|p| p.into_inner()).push(cb.clone());
        if let Some(reason) = self.failure() {
            cb.call(&reason);
        }
    }

    /// Backstop: after a failure, print it and exit the process with
    /// [`PEER_FAILED_EXIT_CODE`] if it is still running `grace` later (time for the main
    /// thread to fail cleanly first).
    pub fn exit_after_failure(&self, grace: Duration) {
        let rank = self.shared.rank;
        let code = PEER_FAILED_EXIT_CODE;
        self.on_failure(move |reason| {
            let reason = reason.to_string();
            std::thread::spawn(move || {
                std::thread::sleep(grace);
                eprintln!("rank {rank}: stopping: {reason}");
                std::process::exit(code);
            });
        });
    }

    /// This rank failed: tell every rank (through rank 0) and record it locally.
    /// A no-op once a failure is known here (it came from elsewhere, or was reported):
    /// the errors it causes on this rank are not news.
    pub fn report_failure(&self, reason: &str) {
        if self.shared.claimed.load(Ordering::SeqCst) {
            return;
        }
        let msg = format!("rank {} failed: {reason}", self.shared.rank);
        if self.shared.rank != 0 {
            let mut ws = self.shared.writers.lock().unwrap_or_else(|p| p.into_inner());
            for w in ws.values_mut() {
                let _ = send(w, ERROR, msg.as_bytes());
            }
        }
        self.shared.fail(msg, None);
    }

    /// Send `bytes` to the rank `to` (not this one), whose [`Monitor::on_data`] sink gets
    /// them; in order per destination. Routed through rank 0 (see the module doc).
    pub fn send_data(&self, to: usize, bytes: &[u8]) -> std::result::Result<(), String> {
        let sh = &self.shared;
        if to == sh.rank || to >= sh.world {
            return Err(format!("rank {}: cannot send data to rank {to} (world of {})", sh.rank, sh.world));
        }
        let via = if sh.rank == 0 { to } else { 0 };
        sh.write_data(via, to, bytes)
    }

    /// Where data sent to this rank goes; what arrived before is handed over first, in order.
    pub fn on_data(&self, f: impl Fn(&[u8]) + Send + Sync + 'static) {
        let f: Sink = Arc::new(f);
        let mut d = self.shared.data.lock().unwrap_or_else(|p| p.into_inner());
        if let DataSink::Waiting(q) = &mut *d {
            for m in q.drain(..) {
                f(&m);
            }
        }
        *d = DataSink::Ready(f);
    }

    /// Clean end of this rank: say goodbye so the others do not count our exit as a
    /// failure, and stop watching. Rank 0 first waits (at most `peer_timeout`) until
    /// every peer has said goodbye or is gone: it may still have their data to relay.
    pub fn finish(&self) {
        if self.shared.rank == 0 {
            let until = Instant::now() + self.shared.peer_timeout;
            loop {
                let left = self.shared.writers.lock().unwrap_or_else(|p| p.into_inner()).len();
                if left == 0 || self.failure().is_some() || Instant::now() >= until {
                    break;
                }
                std::thread::sleep(Duration::from_millis(5));
            }
        }
        self.shared.closing.store(true, Ordering::SeqCst);
        let mut ws = self.shared.writers.lock().unwrap_or_else(|p| p.into_inner());
        for w in ws.values_mut() {
            let _ = send(w, BYE, &[]);
            let _ = w.flush();
        }
    }
}

/// Reader thread for one peer connection.
fn watch(sh: Arc<Shared>, peer: usize, mut reader: FrameReader, opts: RendezvousOptions) {
    let who = if peer == 0 { "rank 0 (rendezvous master)".to_string() } else { format!("rank {peer}") };
    let mut last_heard = Instant::now();
    loop {
        if sh.closing.load(Ordering::SeqCst) {
            return;
        }
        match reader.next(opts.heartbeat) {
            ReadOutcome::Frame(kind, payload) => {
                last_heard = Instant::now();
                match kind {
                    PING => {}
                    BYE => {
                        sh.writers.lock().unwrap_or_else(|p| p.into_inner()).remove(&peer);
                        return;
                    }
                    ERROR => {
                        // Rank 0 relays messages already naming the failed rank.
                        sh.fail(String::from_utf8_lossy(&payload).into_owned(), Some(peer));
                    }
                    DATA if payload.len() >= 4 => {
                        let to = u32::from_be_bytes([payload[0], payload[1], payload[2], payload[3]]) as usize;
                        if to == sh.rank {
                            sh.take_data(&payload[4..]);
                        } else if sh.rank == 0 {
                            if let Err(e) = sh.write_data(to, to, &payload[4..]) {
                                sh.fail(format!("rank 0: relaying data from rank {peer} to rank {to}: {e}"), None);
                            }
                        } else {
                            // Only rank 0 relays: anything else is a protocol fault.
                            sh.fail(format!("rank {}: got data addressed to rank {to} from {who}", sh.rank), Some(peer));
                        }
                    }
                    _ => {}
                }
            }
            ReadOutcome::Idle => {
                if last_heard.elapsed() >= opts.peer_timeout {
                    sh.fail(format!("{who} silent for {} (hung or unreachable)", fmt_secs(opts.peer_timeout)), Some(peer));
                    return;
                }
            }
            ReadOutcome::Closed(why) => {
                if !sh.closing.load(Ordering::SeqCst) {
                    sh.writers.lock().unwrap_or_else(|p| p.into_inner()).remove(&peer);
                    sh.fail(format!("{who} exited without finishing ({why})"), Some(peer));
                }
                return;
            }
        }
    }
}
