//! TCP rendezvous on `MASTER_ADDR:MASTER_PORT`, then a failure monitor on the same
//! connections.
//!
//! Rendezvous: rank 0 listens on the address `MASTER_ADDR` names (an IP literal
//! exactly; a host name as resolved on rank 0's machine, or every interface when that is
//! only loopback and the world spans nodes), port MASTER_PORT, and generates a blob (the
//! NCCL unique id on GPU, any bytes on CPU). Every other rank connects, retrying until
//! the timeout, and proves it holds the job secret (see [`super::secret`] and
//! [`super::wire`]): rank 0 sends a random challenge, the rank answers with a hello
//! `(rank, world, nonce)` tagged with the connection's session key. Rank 0 keeps the
//! connections not yet authenticated in one bounded queue that it polls (see
//! [`super::admission`]: per-address and total limits, eviction of the oldest idle
//! connection, a [`PREAUTH_TIMEOUT`] for the hello), so a flood of idle or garbage
//! connections cannot keep the real ranks out; a connection that is idle, malformed,
//! oversized, evicted or fails authentication is dropped and logged on rank 0's stderr,
//! and the rendezvous goes on (a refused hello gets a refusal naming
//! `LONGCTX_RDZV_SECRET`, which the rank prints as an unauthenticated reply: it carries
//! no tag, so it could come from any process holding the port).
//! Authenticated hellos are checked: out-of-range or duplicate ranks and disagreeing
//! world sizes end the rendezvous; once all `world - 1` peers have joined rank 0 sends
//! the blob to each. Any failure (bad peer, timeout) is sent to every connected rank as
//! an error frame, so all ranks report the same message, e.g.
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
//! Every frame on these connections is authenticated: one whose tag is wrong ends the
//! connection (a lost peer), so nobody without the secret can inject a failure.
//!
//! Data: the same star carries the messages of CPU worlds of processes
//! ([`Monitor::send_data`], [`Monitor::on_data`]): a rank sends every message to rank 0,
//! which keeps those addressed to it and forwards the others, in order per connection.
//! Enough for correctness runs and tests; GPUs talk over NCCL.
//!
//! Payloads: hello = [`wire::Hello`]; challenge = `b"LONGCTX2" ++ nonce`; data = `to u32
//! BE ++ bytes`; error and refusal = UTF-8 text; framing in [`super::wire`].

use super::admission::{Admission, Handshake};
use super::comm_error;
use super::env::DistEnv;
use super::launch::PEER_FAILED_EXIT_CODE;
use super::secret::{job_key, Secret, SECRET_ENV};
use super::wire::{
    self, Dir, Frame, FrameReader, Hello, ReadOutcome, SessionKey, Writer, BYE, CHALLENGE, DATA, ERROR, HELLO, MAGIC, NONCE_BYTES, PING,
    REJECT, WELCOME,
};
use crate::Result;
use std::collections::BTreeMap;
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
/// How long a rank waits for rank 0's challenge on a new connection before it retries.
pub const HANDSHAKE_TIMEOUT: Duration = Duration::from_secs(10);
pub use super::admission::{MAX_PENDING, PER_ADDRESS_PENDING, PREAUTH_TIMEOUT};
/// Dropped connections logged one by one; the rest are only counted.
const LOGGED_DROPS: usize = 16;
/// Connections accepted per round of rank 0's rendezvous loop.
const ACCEPTS_PER_ROUND: usize = 64;

#[derive(Debug, Clone)]
pub struct RendezvousOptions {
    /// How long to wait for all ranks to join.
    pub timeout: Duration,
    /// Heartbeat interval of the monitor.
    pub heartbeat: Duration,
    /// Silence after which a peer is declared lost.
    pub peer_timeout: Duration,
    /// The job secret (`LONGCTX_RDZV_SECRET`); `None`: only a loopback rendezvous runs.
    pub secret: Option<Secret>,
}

impl Default for RendezvousOptions {
    fn default() -> Self {
        Self { timeout: DEFAULT_TIMEOUT, heartbeat: Duration::from_secs(1), peer_timeout: Duration::from_secs(30), secret: None }
    }
}

impl RendezvousOptions {
    /// Defaults, with the timeout taken from `LONGCTX_RDZV_TIMEOUT_S`, the peer
    /// timeout from `LONGCTX_PEER_TIMEOUT_S` and the secret from `LONGCTX_RDZV_SECRET`
    /// when set.
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
        o.secret = Secret::from_env()?;
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
    let (key, authenticated) = job_key(opts.secret.as_ref(), &env.master_addr, &env.master())?;
    if env.rank == 0 {
        if !authenticated {
            eprintln!(
                "warning: {SECRET_ENV} is not set: the rendezvous on {} is not authenticated (any process of this machine \
                 could join); `longctx launch` sets one, or export the same random value to every rank",
                env.master()
            );
        }
        master(env, make_blob()?, opts, &key)
    } else {
        client(env, opts, &key)
    }
}

// ---------------------------------------------------------------- rank 0

/// Listen where `MASTER_ADDR` says (see the module doc).
fn listen(env: &DistEnv) -> Result<TcpListener> {
    let host = env.master_addr.trim().trim_start_matches('[').trim_end_matches(']');
    let port = env.master_port;
    let addrs: Vec<SocketAddr> = match host.parse::<IpAddr>() {
        Ok(ip) => vec![SocketAddr::new(ip, port)],
        Err(_) => {
            let mut found: Vec<SocketAddr> = (host, port)
                .to_socket_addrs()
                .map_err(|e| {
                    comm_error(format!(
                        "rendezvous: rank 0 cannot resolve MASTER_ADDR = {host}: {e}; set MASTER_ADDR to rank 0's IP address"
                    ))
                })?
                .collect();
            let spans_nodes = env.world > env.local_world;
            if spans_nodes && !host.eq_ignore_ascii_case("localhost") && found.iter().all(|a| a.ip().is_loopback()) {
                // e.g. Debian's `127.0.1.1 hostname`: the other nodes resolve it elsewhere.
                let any: IpAddr =
                    if found.iter().any(|a| a.is_ipv6()) { Ipv6Addr::UNSPECIFIED.into() } else { Ipv4Addr::UNSPECIFIED.into() };
                eprintln!(
                    "note: MASTER_ADDR = {host} resolves to loopback on rank 0's machine ({:?}); listening on every interface \
                     so that the other nodes reach it (give rank 0's IP address to listen on that address only)",
                    found.iter().map(|a| a.ip()).collect::<Vec<_>>()
                );
                found = vec![SocketAddr::new(any, port)];
            }
            found
        }
    };
    let mut errors = Vec::new();
    for a in &addrs {
        match TcpListener::bind(a) {
            Ok(l) => {
                l.set_nonblocking(true).map_err(|e| comm_error(format!("rendezvous: {a}: {e}")))?;
                return Ok(l);
            }
            Err(e) => errors.push(format!("{a}: {e}")),
        }
    }
    Err(comm_error(format!(
        "rendezvous: rank 0 cannot listen on MASTER_ADDR = {host}, MASTER_PORT = {port} ({}): rank 0 must run on the machine \
         MASTER_ADDR names, and no other run may use MASTER_PORT",
        if errors.is_empty() { "it resolves to no address".to_string() } else { errors.join("; ") }
    )))
}

/// Log of the connections rank 0 dropped (the first few one by one, then a count).
struct Drops {
    where_: String,
    count: usize,
}

impl Drops {
    fn log(&mut self, addr: Option<SocketAddr>, why: &str) {
        self.count += 1;
        let from = addr.map(|a| format!(" from {a}")).unwrap_or_default();
        if self.count <= LOGGED_DROPS {
            eprintln!("rendezvous on {}: dropped a connection{from}: {why}", self.where_);
        }
        if self.count == LOGGED_DROPS {
            eprintln!("rendezvous on {}: further dropped connections are counted, not logged", self.where_);
        }
    }

    fn summary(&self) {
        if self.count > LOGGED_DROPS {
            eprintln!("rendezvous on {}: dropped {} connections in all", self.where_, self.count);
        }
    }
}

/// Accept the pending connections (at most [`ACCEPTS_PER_ROUND`], so that a flood cannot
/// keep the caller from polling the queue, its deadline and joined ranks) into the
/// pre-authentication queue. Returns whether any came.
fn accept_ready(listener: &TcpListener, queue: &mut Admission, drops: &mut Drops) -> bool {
    for n in 0..ACCEPTS_PER_ROUND {
        match listener.accept() {
            Ok((stream, addr)) => queue.admit(stream, addr),
            Err(e) if e.kind() == std::io::ErrorKind::Interrupted => {}
            Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => return n > 0,
            Err(e) => {
                // e.g. out of file descriptors: this connection is lost, the rendezvous goes on.
                drops.log(None, &format!("accept failed: {e}"));
                std::thread::sleep(Duration::from_millis(10));
                return true;
            }
        }
    }
    true
}

/// Joined ranks: write half and the reader (which may already hold later bytes).
type Members = BTreeMap<usize, (Writer, FrameReader)>;

/// Tell every joined rank (and `extra`) why the rendezvous ends, and make the error.
fn give_up(joined: &mut Members, extra: Option<&mut Writer>, msg: String) -> crate::Error {
    for (w, _) in joined.values_mut() {
        let _ = w.send(ERROR, msg.as_bytes());
    }
    if let Some(w) = extra {
        let _ = w.send(ERROR, msg.as_bytes());
    }
    comm_error(msg)
}

/// What is wrong with an authenticated hello (a misconfigured job: fatal).
fn hello_problem(env: &DistEnv, joined: &Members, h: &Hello) -> Option<String> {
    let where_ = env.master();
    let (rank, world) = (h.rank, h.world);
    if world != env.world {
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
    }
}

fn master(env: &DistEnv, blob: Vec<u8>, opts: &RendezvousOptions, key: &Secret) -> Result<Rendezvous> {
    let deadline = Instant::now() + opts.timeout;
    let where_ = env.master();
    let listener = listen(env)?;
    let mut queue = Admission::new(key);
    let mut drops = Drops { where_: where_.clone(), count: 0 };
    let mut joined = Members::new();
    while joined.len() + 1 < env.world {
        if Instant::now() >= deadline {
            let missing: Vec<usize> = (1..env.world).filter(|r| !joined.contains_key(r)).collect();
            let msg = format!("rendezvous timed out after {} waiting for ranks {missing:?} on {where_}", fmt_secs(opts.timeout));
            return Err(give_up(&mut joined, None, msg));
        }
        let accepted = accept_ready(&listener, &mut queue, &mut drops);
        let progressed = queue.poll(Instant::now());
        for outcome in queue.take_done() {
            match outcome {
                Handshake::Dropped(addr, why) => drops.log(Some(addr), &why),
                Handshake::Joined(mut j) => {
                    if let Some(msg) = hello_problem(env, &joined, &j.hello) {
                        return Err(give_up(&mut joined, Some(&mut j.writer), msg));
                    }
                    joined.insert(j.hello.rank, (j.writer, j.reader));
                }
            }
        }
        if !accepted && !progressed {
            std::thread::sleep(Duration::from_micros(500));
        }
    }
    drop(listener);
    drops.summary();
    for (rank, (w, _)) in joined.iter_mut() {
        if let Err(e) = w.send(WELCOME, &blob) {
            let msg = format!("rendezvous on {where_}: rank {rank} left before receiving the id ({e})");
            return Err(give_up(&mut joined, None, msg));
        }
    }
    let peers = joined.into_iter().map(|(r, (w, rd))| (r, w, rd)).collect();
    Ok(Rendezvous { blob, monitor: Monitor::new(0, env.world, opts, peers) })
}

// ---------------------------------------------------------------- other ranks

/// The end of one connection attempt of a rank.
enum Attempt {
    Done(Result<Rendezvous>),
    /// Try again (rank 0 not there yet, busy, or not answering).
    Retry(String),
}

fn connect(where_: &str) -> std::result::Result<TcpStream, String> {
    let addrs = where_.to_socket_addrs().map_err(|e| format!("cannot resolve {where_}: {e}"))?;
    let mut last = format!("{where_} resolves to no address");
    for a in addrs {
        match TcpStream::connect_timeout(&a, Duration::from_secs(1)) {
            Ok(s) => return Ok(s),
            Err(e) => last = e.to_string(),
        }
    }
    Err(last)
}

fn client(env: &DistEnv, opts: &RendezvousOptions, key: &Secret) -> Result<Rendezvous> {
    let where_ = env.master();
    // Rank 0's own timeout message should win: wait a little longer than it does.
    let deadline = Instant::now() + opts.timeout + Duration::from_secs(2);
    let mut last_err = String::from("no attempt");
    loop {
        if Instant::now() >= deadline {
            return Err(comm_error(format!(
                "rendezvous timed out after {} waiting for rank 0 to accept on {where_} (last error: {last_err})",
                fmt_secs(opts.timeout)
            )));
        }
        match connect(&where_) {
            Err(e) => last_err = e,
            Ok(stream) => match join_once(env, opts, key, stream, deadline) {
                Attempt::Done(r) => return r,
                Attempt::Retry(why) => last_err = why,
            },
        }
        std::thread::sleep(Duration::from_millis(100));
    }
}

/// Read rank 0's challenge on `stream`, send the hello, wait for the welcome.
fn join_once(env: &DistEnv, opts: &RendezvousOptions, key: &Secret, stream: TcpStream, deadline: Instant) -> Attempt {
    let where_ = env.master();
    let peer = stream.peer_addr().map(|a| a.to_string()).unwrap_or_else(|_| where_.clone());
    let _ = stream.set_nodelay(true);
    let _ = stream.set_write_timeout(Some(Duration::from_secs(5)));
    let Ok(read_half) = stream.try_clone() else { return Attempt::Retry("cannot clone the socket".into()) };
    let mut reader = FrameReader::handshake(read_half, Dir::FromMaster);
    let wait = deadline.saturating_duration_since(Instant::now()).min(HANDSHAKE_TIMEOUT);
    let server_nonce = match reader.next(wait) {
        ReadOutcome::Frame(f) if f.kind == CHALLENGE && f.payload.len() == 8 + NONCE_BYTES && f.payload.starts_with(MAGIC) => {
            f.payload[8..].to_vec()
        }
        ReadOutcome::Frame(f) => return Attempt::Retry(format!("rank 0 sent a frame of kind {} instead of a challenge", f.kind)),
        ReadOutcome::Idle => {
            return Attempt::Retry(format!("connected, but no challenge within {} (is rank 0 the same longctx version?)", fmt_secs(wait)))
        }
        ReadOutcome::Closed(why) => return Attempt::Retry(format!("rank 0 closed the connection before its challenge ({why})")),
    };
    let hello = match wire::nonce() {
        Ok(nonce) => Hello { rank: env.rank, world: env.world, nonce },
        Err(e) => return Attempt::Done(Err(comm_error(format!("rendezvous: {e}")))),
    };
    let session = SessionKey::derive(key, &server_nonce, &hello.nonce);
    let mut writer = Writer::new(stream, session.clone(), Dir::ToMaster);
    if let Err(e) = writer.send(HELLO, &hello.encode()) {
        return Attempt::Retry(format!("sending the hello to {where_}: {e}"));
    }
    reader.authenticated(session, 0);
    await_welcome(env, opts, writer, reader, deadline, peer)
}

/// A refusal as the rank prints it: its text came from whoever answered on MASTER_PORT,
/// which proved no knowledge of the secret (a refusal has no tag), so it is quoted as such.
fn unauthenticated_refusal(env: &DistEnv, peer: &str, text: &[u8]) -> String {
    format!(
        "rendezvous on {}: rank {} was refused; unauthenticated reply from {peer} (rank 0, or any process holding \
         MASTER_PORT): \"{}\"",
        env.master(),
        env.rank,
        String::from_utf8_lossy(text).chars().take(400).filter(|c| !c.is_control()).collect::<String>()
    )
}

/// Wait for rank 0's authenticated welcome (or error). A connection closed before it is
/// retried: rank 0 may have evicted it from its pre-authentication queue under a flood
/// before reading the hello (rank 0 sends an error frame before it closes on purpose).
fn await_welcome(
    env: &DistEnv,
    opts: &RendezvousOptions,
    writer: Writer,
    mut reader: FrameReader,
    deadline: Instant,
    peer: String,
) -> Attempt {
    let where_ = env.master();
    loop {
        let left = deadline.saturating_duration_since(Instant::now());
        if left.is_zero() {
            return Attempt::Done(Err(comm_error(format!(
                "rendezvous timed out after {} on {where_}: connected, but rank 0 did not hear from all {} ranks",
                fmt_secs(opts.timeout),
                env.world
            ))));
        }
        match reader.next(left) {
            ReadOutcome::Frame(f) if f.authentic && f.kind == WELCOME => {
                // The reader goes along: it may already hold the monitor's first frames.
                let monitor = Monitor::new(env.rank, env.world, opts, vec![(0, writer, reader)]);
                return Attempt::Done(Ok(Rendezvous { blob: f.payload, monitor }));
            }
            ReadOutcome::Frame(f) if f.authentic && f.kind == ERROR => {
                return Attempt::Done(Err(comm_error(String::from_utf8_lossy(&f.payload).into_owned())))
            }
            ReadOutcome::Frame(f) if f.kind == REJECT => {
                return Attempt::Done(Err(comm_error(unauthenticated_refusal(env, &peer, &f.payload))))
            }
            ReadOutcome::Frame(_) | ReadOutcome::Idle => {}
            ReadOutcome::Closed(why) => {
                return Attempt::Retry(format!("rank 0 on {where_} closed the connection before its welcome ({why})"))
            }
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
    writers: Mutex<BTreeMap<usize, Writer>>,
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
        if bytes.len() > u32::MAX as usize - 4 {
            return Err(format!("a message of {} bytes is too large for the CPU transport (limit 4 GiB)", bytes.len()));
        }
        let sent = {
            let mut ws = self.writers.lock().unwrap_or_else(|p| p.into_inner());
            let w = ws.get_mut(&via).ok_or_else(|| format!("no connection to rank {via} (it finished or failed)"))?;
            w.send_parts(DATA, &[&(to as u32).to_be_bytes(), bytes])
        };
        sent.map_err(|e| match lost_peer(via, &e) {
            // The peer's end closed: the same failure its reader thread reports when it
            // sees the close first (which of the two comes first is a race).
            Some(why) => {
                self.fail(why.clone(), Some(via));
                why
            }
            None => format!("writing to rank {via}: {e}"),
        })
    }
}

/// The failure of a write to rank `peer` whose connection the peer closed (it exited or
/// was killed): named as its reader thread names it; `None` for other errors.
fn lost_peer(peer: usize, e: &std::io::Error) -> Option<String> {
    use std::io::ErrorKind::{BrokenPipe, ConnectionAborted, ConnectionReset, UnexpectedEof};
    if !matches!(e.kind(), BrokenPipe | ConnectionReset | ConnectionAborted | UnexpectedEof) {
        return None;
    }
    let who = if peer == 0 { "rank 0 (rendezvous master)".to_string() } else { format!("rank {peer}") };
    Some(format!("{who} exited without finishing (writing to it: {e})"))
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
                    let _ = w.send(ERROR, reason.as_bytes());
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
    fn new(rank: usize, world: usize, opts: &RendezvousOptions, peers: Vec<(usize, Writer, FrameReader)>) -> Self {
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
        for (peer, writer, reader) in peers {
            shared.writers.lock().unwrap_or_else(|p| p.into_inner()).insert(peer, writer);
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
                    let _ = w.send(PING, &[]);
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
                let _ = w.send(ERROR, msg.as_bytes());
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
            let _ = w.send(BYE, &[]);
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
            // Untagged frames (challenge, refusal) mean nothing here: never act on them.
            ReadOutcome::Frame(f) if !f.authentic => {}
            ReadOutcome::Frame(Frame { kind, payload, .. }) => {
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

#[cfg(test)]
mod tests {
    use super::*;
    use std::io::{Error, ErrorKind};

    /// A write that finds the peer's end closed names the peer as lost, as its reader
    /// thread does; other write errors stay write errors.
    #[test]
    fn a_write_to_a_closed_peer_names_it_lost() {
        let pipe = Error::from(ErrorKind::BrokenPipe);
        assert_eq!(lost_peer(1, &pipe).unwrap(), format!("rank 1 exited without finishing (writing to it: {pipe})"));
        let reset = Error::from(ErrorKind::ConnectionReset);
        assert!(lost_peer(0, &reset).unwrap().starts_with("rank 0 (rendezvous master) exited without finishing"));
        assert_eq!(lost_peer(1, &Error::from(ErrorKind::InvalidInput)), None);
        assert_eq!(lost_peer(1, &Error::from(ErrorKind::TimedOut)), None);
    }
}
