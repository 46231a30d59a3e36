//! Rank 0's queue of connections not yet authenticated (issue #33: a flood of idle
//! connections reopened as they were dropped kept every real rank out).
//!
//! Rank 0 sends each new connection its challenge at once and keeps it, non-blocking, in
//! one bounded queue; its rendezvous loop polls every queued connection for the hello
//! (so an idle one costs a file descriptor, no thread). A hello that verifies leaves the
//! queue at once: authenticated peers are never subject to its limits. The limits:
//! - at most [`PER_ADDRESS_PENDING`] connections per peer address (IPv6: per /64, what
//!   one host is usually given) and [`MAX_PENDING`] in all;
//! - a new connection is always taken: when its address is at its limit, the oldest
//!   connection of that address is evicted; when the queue is full, the oldest of the
//!   address holding the most. Idle ones (no byte received) go first, and a victim is
//!   read once before it goes, so a hello already sent is never lost to an eviction;
//! - a connection has [`PREAUTH_TIMEOUT`] to send its hello.
//!
//! So a flood from other addresses cannot evict a rank's connection (it evicts its own,
//! or those of the largest address), and a flood from a rank's own address must open
//! [`PER_ADDRESS_PENDING`] connections between the rank's connect and its hello (a few
//! hundred microseconds on a LAN) to evict it; the rank then retries. What it cannot
//! stop: an attacker that floods from more addresses than the queue holds, or that
//! saturates rank 0's CPU or network (see docs/reliability.md).

use super::rendezvous::fmt_secs;
use super::secret::{Secret, SECRET_ENV};
use super::wire::{self, send_plain, Dir, Frame, FrameReader, Hello, ReadOutcome, SessionKey, Writer, CHALLENGE, HELLO, MAGIC, REJECT};
use std::collections::{BTreeMap, VecDeque};
use std::net::{IpAddr, SocketAddr, TcpStream};
use std::time::{Duration, Instant};

/// Connections waiting for their hello, in all.
pub const MAX_PENDING: usize = 256;
/// Connections waiting for their hello from one address (IPv6: one /64).
pub const PER_ADDRESS_PENDING: usize = 64;
/// How long a new connection may take to send its hello.
pub const PREAUTH_TIMEOUT: Duration = Duration::from_secs(2);

/// A connection that passed the handshake.
pub(super) struct Joiner {
    pub hello: Hello,
    pub writer: Writer,
    pub reader: FrameReader,
}

pub(super) enum Handshake {
    Joined(Box<Joiner>),
    Dropped(SocketAddr, String),
}

/// A connection that was sent its challenge and has not yet sent a verified hello.
struct Pending {
    stream: TcpStream,
    addr: SocketAddr,
    server_nonce: [u8; wire::NONCE_BYTES],
    reader: FrameReader,
    since: Instant,
}

impl Pending {
    fn idle(&self) -> bool {
        self.reader.buffered() == 0
    }
}

/// The peers that count as one address for the limits.
fn host_of(addr: &SocketAddr) -> IpAddr {
    match addr.ip() {
        IpAddr::V6(v6) => match v6.to_ipv4_mapped() {
            Some(v4) => IpAddr::V4(v4),
            None => {
                let s = v6.segments();
                IpAddr::V6(std::net::Ipv6Addr::new(s[0], s[1], s[2], s[3], 0, 0, 0, 0))
            }
        },
        ip => ip,
    }
}

/// Rank 0's pre-authentication queue (see the module doc).
pub(super) struct Admission {
    key: Secret,
    queue: VecDeque<Pending>,
    per_host: BTreeMap<IpAddr, usize>,
    /// Handshakes finished (joined or dropped), for the rendezvous loop to take.
    done: Vec<Handshake>,
}

impl Admission {
    pub(super) fn new(key: &Secret) -> Self {
        Self { key: key.clone(), queue: VecDeque::new(), per_host: BTreeMap::new(), done: Vec::new() }
    }

    /// The finished handshakes since the last call.
    pub(super) fn take_done(&mut self) -> Vec<Handshake> {
        std::mem::take(&mut self.done)
    }

    /// Challenge a new connection and queue it, making room first when needed.
    pub(super) fn admit(&mut self, stream: TcpStream, addr: SocketAddr) {
        let server_nonce = match wire::nonce() {
            Ok(n) => n,
            Err(e) => return self.done.push(Handshake::Dropped(addr, e.to_string())),
        };
        let prepared = stream.set_nonblocking(true).and_then(|()| stream.set_nodelay(true)).and_then(|()| stream.try_clone());
        let mut plain = match prepared {
            Ok(s) => s,
            Err(e) => return self.done.push(Handshake::Dropped(addr, e.to_string())),
        };
        let mut challenge = MAGIC.to_vec();
        challenge.extend_from_slice(&server_nonce);
        if let Err(e) = send_plain(&mut plain, CHALLENGE, &challenge) {
            return self.done.push(Handshake::Dropped(addr, format!("sending the challenge: {e}")));
        }
        self.make_room(host_of(&addr));
        let reader = FrameReader::handshake(plain, Dir::ToMaster);
        *self.per_host.entry(host_of(&addr)).or_insert(0) += 1;
        self.queue.push_back(Pending { stream, addr, server_nonce, reader, since: Instant::now() });
    }

    /// Evict one connection if `host` is at its limit or the queue is full.
    fn make_room(&mut self, host: IpAddr) {
        let count = |h: &IpAddr| self.per_host.get(h).copied().unwrap_or(0);
        let (victim_host, why) = if count(&host) >= PER_ADDRESS_PENDING {
            (host, format!("{PER_ADDRESS_PENDING} connections from this address are waiting to authenticate"))
        } else if self.queue.len() >= MAX_PENDING {
            let Some((&largest, _)) = self.per_host.iter().max_by_key(|e| *e.1) else { return };
            (largest, format!("{MAX_PENDING} connections are waiting to authenticate, most from this address"))
        } else {
            return;
        };
        let of_host = |p: &Pending| host_of(&p.addr) == victim_host;
        let at = self.queue.iter().position(|p| of_host(p) && p.idle()).or_else(|| self.queue.iter().position(of_host));
        let Some(at) = at else { return };
        let Some(mut p) = self.queue.remove(at) else { return };
        self.forget(&p);
        // A hello that already arrived is taken, not lost.
        match p.reader.poll() {
            ReadOutcome::Frame(f) => self.done.push(self.check_hello(p, f)),
            ReadOutcome::Closed(w) => self.done.push(Handshake::Dropped(p.addr, w)),
            ReadOutcome::Idle => {
                let _ = p.stream.shutdown(std::net::Shutdown::Both);
                self.done.push(Handshake::Dropped(p.addr, format!("evicted, the oldest idle one: {why}")));
            }
        }
    }

    fn forget(&mut self, p: &Pending) {
        let h = host_of(&p.addr);
        if let Some(n) = self.per_host.get_mut(&h) {
            *n -= 1;
            if *n == 0 {
                self.per_host.remove(&h);
            }
        }
    }

    /// Read every queued connection once; finish those with a hello, a fault or an
    /// expired deadline. Returns whether any connection progressed.
    pub(super) fn poll(&mut self, now: Instant) -> bool {
        let mut progressed = false;
        let mut keep = VecDeque::with_capacity(self.queue.len());
        while let Some(mut p) = self.queue.pop_front() {
            let outcome = match p.reader.poll() {
                ReadOutcome::Frame(f) => Some(self.check_hello_of(&p, f)),
                ReadOutcome::Closed(why) => Some(Err(why)),
                ReadOutcome::Idle if now.duration_since(p.since) >= PREAUTH_TIMEOUT => {
                    Some(Err(format!("sent no hello within {}", fmt_secs(PREAUTH_TIMEOUT))))
                }
                ReadOutcome::Idle => None,
            };
            match outcome {
                None => keep.push_back(p),
                Some(result) => {
                    progressed = true;
                    self.forget(&p);
                    self.done.push(finish(p, result));
                }
            }
        }
        self.queue = keep;
        progressed
    }

    fn check_hello(&self, p: Pending, f: Frame) -> Handshake {
        let result = self.check_hello_of(&p, f);
        finish(p, result)
    }

    /// The verified hello and its session key, or why the connection is dropped.
    fn check_hello_of(&self, p: &Pending, frame: Frame) -> Result<(Hello, SessionKey), String> {
        let Frame { kind, payload, tag, .. } = frame;
        if kind != HELLO {
            return Err(format!("sent a frame of kind {kind} instead of a hello"));
        }
        let (Some(hello), Some(tag)) = (Hello::decode(&payload), tag) else {
            return Err(format!("sent a malformed hello ({} bytes)", payload.len()));
        };
        let session = SessionKey::derive(&self.key, &p.server_nonce, &hello.nonce);
        if !Hello::verify(&session, &payload, &tag) {
            let why = format!(
                "authentication failed: every rank of a job must have the same {SECRET_ENV} (rank 0's differs from this \
                 rank's, or one of them has none)"
            );
            let _ = send_plain(&mut (&p.stream), REJECT, why.as_bytes());
            return Err(format!("a hello as rank {} failed authentication (wrong or missing {SECRET_ENV})", hello.rank));
        }
        Ok((hello, session))
    }
}

/// The end of a queued connection's handshake: joined (blocking again, for the monitor)
/// or dropped (closed).
fn finish(mut p: Pending, result: Result<(Hello, SessionKey), String>) -> Handshake {
    let (hello, session) = match result {
        Ok(x) => x,
        Err(why) => {
            let _ = p.stream.shutdown(std::net::Shutdown::Both);
            return Handshake::Dropped(p.addr, why);
        }
    };
    if let Err(e) = p.stream.set_nonblocking(false).and_then(|()| p.stream.set_write_timeout(Some(Duration::from_secs(5)))) {
        return Handshake::Dropped(p.addr, e.to_string());
    }
    p.reader.authenticated(session.clone(), 1);
    Handshake::Joined(Box::new(Joiner { hello, writer: Writer::new(p.stream, session, Dir::FromMaster), reader: p.reader }))
}
