//! Mailbox backend: the ranks of a world are threads of one process, or (through
//! [`super::process`]) processes joined by a byte link, one rank each.
//!
//! Messages are `Vec<Tensor>` dropped into mailboxes keyed by
//! `(group id, source world rank, destination world rank, sequence number)`: the n-th
//! message a rank sends to a peer within a group is the n-th receive that peer posts
//! from it, so out-of-order waits and interleaved groups can never mix messages.
//! Sends never block (mailboxes are unbounded); tensors are copied at send time, so a
//! sender may keep mutating its own buffers, and moved to the receiver's device.
//!
//! Collectives are built from these point-to-point messages and are deterministic:
//! `all_reduce_sum` reduces on member 0 in rank order and hands the same bits to
//! everyone. Every message carries the sender's input signature (shapes and dtypes)
//! so that every member runs the same consistency check and a mismatch errors on all
//! of them.
//!
//! Failure: the world has one abort flag with a reason. Every blocking wait is a timed
//! wait loop that checks the flag and an overall timeout (default
//! [`DEFAULT_TIMEOUT`]); a timeout or a local usage error aborts the world, so one
//! failed rank turns into an error on every rank instead of a hang. [`run_ranks`]
//! runs a closure per rank on scoped threads, aborts the world when one of them errors
//! or panics, and returns the root-cause error.
//!
//! Processes: the same ranks and collectives, with a [`Link`] that carries messages for
//! world ranks of other processes (serialized by [`super::process`]) and tells them of
//! an abort. Since the algorithms are the same, a world of processes computes the same
//! bits as a world of threads.

use super::process::Link;
use super::{Comm, Pending};
use candle_core::{DType, Device, Result, Tensor};
use std::collections::HashMap;
use std::hash::{Hash, Hasher};
use std::sync::{Arc, Condvar, Mutex, MutexGuard};
use std::time::{Duration, Instant};

/// How long a blocking call waits for a peer before it gives up and aborts the world.
/// A world made with `Duration::MAX` never gives up (a timeout of 0 = off in the config).
pub const DEFAULT_TIMEOUT: Duration = Duration::from_secs(300);

/// Group id of the whole world.
const WORLD_GROUP: u64 = 0;

/// (group id, source world rank, destination world rank, sequence number).
pub(super) type Key = (u64, usize, usize, u64);

/// Shape and dtype of one tensor: what the receiver checks before using a message.
pub(super) type Sig = (Vec<usize>, DType);

/// One message between two ranks.
pub(super) struct Msg {
    /// The operation that sent it (a mismatch means ranks called different collectives).
    pub(super) what: &'static str,
    /// Signature of the sender's whole input to the collective.
    pub(super) sig: Vec<Sig>,
    /// The tensors, or a failure decided by the sender (e.g. a mismatched all-reduce).
    pub(super) payload: std::result::Result<Vec<Tensor>, String>,
}

/// Every operation name a [`Msg`] can carry (the wire format sends the index).
pub(super) const OPS: [&str; 6] = ["sendrecv", "all_to_all", "all_reduce_sum", "all_gather", "reduce_scatter_sum", "barrier"];

#[derive(Default)]
struct State {
    mail: HashMap<Key, Msg>,
    /// `(world rank that aborted, reason)`.
    aborted: Option<(Option<usize>, String)>,
}

/// What every rank of one world shares (in a world of processes: this process's view).
pub(super) struct World {
    timeout: Duration,
    state: Mutex<State>,
    cv: Condvar,
    /// The other processes, when ranks are processes.
    link: Option<Arc<dyn Link>>,
}

impl World {
    pub(super) fn new(timeout: Duration, link: Option<Arc<dyn Link>>) -> Self {
        World { timeout, state: Mutex::new(State::default()), cv: Condvar::new(), link }
    }

    fn lock(&self) -> MutexGuard<'_, State> {
        // A thread that panicked while holding the lock cannot have left the map
        // half-updated (insert/remove are single calls), so the poison is ignored.
        self.state.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Hand a message to its destination: this process's mailbox or the link.
    fn post(&self, key: Key, msg: Msg) -> Result<()> {
        if let Some(link) = self.link.as_ref().filter(|l| l.local_rank() != key.2) {
            if let Err(e) = super::process::encode(key, &msg).map_err(|e| e.to_string()).and_then(|b| link.send(key.2, b)) {
                let reason = format!("rank {}: sending {} to rank {}: {e}", key.1, msg.what, key.2);
                self.abort(Some(key.1), &reason);
                return crate::comm_err!("{reason}");
            }
            return Ok(());
        }
        self.deliver(key, msg);
        Ok(())
    }

    /// A message arrived for a rank of this process.
    pub(super) fn deliver(&self, key: Key, msg: Msg) {
        self.lock().mail.insert(key, msg);
        self.cv.notify_all();
    }

    /// Sets the abort flag unless already set; returns whether this call set it. The
    /// first abort of a world of processes is told to the others through the link.
    fn abort(&self, origin: Option<usize>, reason: &str) -> bool {
        let first = self.abort_quietly(origin, reason);
        if let (true, Some(link)) = (first, &self.link) {
            link.abort(reason);
        }
        first
    }

    /// [`Self::abort`] without telling the other processes (they told us).
    pub(super) fn abort_quietly(&self, origin: Option<usize>, reason: &str) -> bool {
        let first = {
            let mut st = self.lock();
            if st.aborted.is_none() {
                st.aborted = Some((origin, reason.to_string()));
                true
            } else {
                false
            }
        };
        self.cv.notify_all();
        first
    }

    fn aborted(&self) -> Option<(Option<usize>, String)> {
        self.lock().aborted.clone()
    }

    /// Blocks until the message `key` has arrived, the world is aborted, or the
    /// timeout expires (which aborts the world). `me`/`peer` are only for messages.
    fn wait(&self, key: Key, me: &str, peer: &str, what: &str) -> Result<Msg> {
        // No deadline when the timeout does not fit (Duration::MAX: off).
        let deadline = Instant::now().checked_add(self.timeout);
        let mut st = self.lock();
        loop {
            if let Some((_, reason)) = &st.aborted {
                return crate::comm_err!("{me} waiting in {what} for {peer}: world aborted: {reason}");
            }
            if let Some(msg) = st.mail.remove(&key) {
                return Ok(msg);
            }
            let now = Instant::now();
            if deadline.is_some_and(|d| now >= d) {
                let reason = format!(
                    "{me} timed out after {} waiting in {what} for {peer} (collective timeout: {peer} is stuck or stopped taking part)",
                    super::secs(self.timeout)
                );
                drop(st);
                self.abort(Some(key.2), &reason);
                return crate::comm_err!("{reason}");
            }
            let slice = deadline.map_or(Duration::from_millis(500), |d| (d - now).min(Duration::from_millis(500)));
            st = self.cv.wait_timeout(st, slice).unwrap_or_else(|p| p.into_inner()).0;
        }
    }
}

/// One rank's handle on a communicator (the world or a sub-group).
pub struct ThreadComm {
    world: Arc<World>,
    group: u64,
    /// World ranks of the members, ascending; `members[rank]` is this rank.
    members: Vec<usize>,
    rank: usize,
    /// Next sequence number per destination / source member.
    send_seq: Mutex<Vec<u64>>,
    recv_seq: Mutex<Vec<u64>>,
    /// Number of `sub` calls made on this handle (part of the new group's id).
    subs: Mutex<u64>,
}

impl std::fmt::Debug for ThreadComm {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ThreadComm").field("group", &self.group).field("rank", &self.rank).field("members", &self.members).finish()
    }
}

fn sig_of(ts: &[Tensor]) -> Vec<Sig> {
    ts.iter().map(|t| (t.dims().to_vec(), t.dtype())).collect()
}

/// Detached private copy of what is sent (the sender may mutate its buffers later): the
/// elements of the view only (`Tensor::copy` would clone the whole underlying buffer of a
/// narrowed view). On a GPU each rank thread queues work on its own stream, so the copy is
/// waited for here: the receiver's stream must not read it before the sender's has written it.
fn snapshot(ts: &[Tensor]) -> Result<Vec<Tensor>> {
    let out = ts.iter().map(|t| t.detach().force_contiguous()).collect::<Result<Vec<_>>>()?;
    let mut synced: Vec<&candle_core::Device> = Vec::new();
    for t in &out {
        let d = t.device();
        if !d.is_cpu() && !synced.iter().any(|s| s.same_device(d)) {
            d.synchronize()?;
            synced.push(d);
        }
    }
    Ok(out)
}

fn next_seq(counters: &Mutex<Vec<u64>>, peer: usize) -> u64 {
    let mut c = counters.lock().unwrap_or_else(|p| p.into_inner());
    let n = c[peer];
    c[peer] += 1;
    n
}

impl ThreadComm {
    /// The `n` rank handles of a new world, with the default timeout.
    pub fn world(n: usize) -> Vec<Arc<dyn Comm>> {
        Self::world_with_timeout(n, DEFAULT_TIMEOUT)
    }

    /// The `n` rank handles of a new world whose blocking calls give up after `timeout`.
    pub fn world_with_timeout(n: usize, timeout: Duration) -> Vec<Arc<dyn Comm>> {
        Self::handles(n, timeout).into_iter().map(|c| c as Arc<dyn Comm>).collect()
    }

    fn handles(n: usize, timeout: Duration) -> Vec<Arc<ThreadComm>> {
        let world = Arc::new(World::new(timeout, None));
        (0..n).map(|r| Arc::new(Self::member(world.clone(), WORLD_GROUP, (0..n).collect(), r))).collect()
    }

    /// Rank `rank` of a world of `n` processes (this process's handle; the world's other
    /// ranks are reached through the world's link).
    pub(super) fn process_rank(world: Arc<World>, n: usize, rank: usize) -> Arc<ThreadComm> {
        Arc::new(Self::member(world, WORLD_GROUP, (0..n).collect(), rank))
    }

    fn member(world: Arc<World>, group: u64, members: Vec<usize>, rank: usize) -> Self {
        let n = members.len();
        Self { world, group, members, rank, send_seq: Mutex::new(vec![0; n]), recv_seq: Mutex::new(vec![0; n]), subs: Mutex::new(0) }
    }

    fn me(&self) -> String {
        self.name(self.rank)
    }

    /// "rank 1" in the world, "rank 1 (world rank 5) of group 0x..." in a sub-group.
    fn name(&self, r: usize) -> String {
        if self.group == WORLD_GROUP {
            format!("rank {r}")
        } else {
            format!("rank {r} (world rank {}) of group {:#x}", self.members[r], self.group)
        }
    }

    /// Aborts the world because of a usage error on this rank and returns that error.
    fn fail<T>(&self, msg: String) -> Result<T> {
        let msg = format!("{}: {msg}", self.me());
        self.world.abort(Some(self.members[self.rank]), &msg);
        crate::comm_err!("{msg}")
    }

    fn check_peer(&self, peer: usize, role: &str) -> Result<()> {
        if peer >= self.members.len() {
            return self.fail(format!("{role} rank {peer} is outside the communicator of {} ranks", self.members.len()));
        }
        Ok(())
    }

    fn send(&self, to: usize, msg: Msg) -> Result<()> {
        if let Some((_, reason)) = self.world.aborted() {
            return crate::comm_err!("{} sending {} to {}: world aborted: {reason}", self.me(), msg.what, self.name(to));
        }
        let seq = next_seq(&self.send_seq, to);
        self.world.post((self.group, self.members[self.rank], self.members[to], seq), msg)
    }

    /// Reserves the next receive slot from `from` (in program order) and returns its key.
    fn recv_key(&self, from: usize) -> Key {
        let seq = next_seq(&self.recv_seq, from);
        (self.group, self.members[from], self.members[self.rank], seq)
    }

    fn recv(&self, key: Key, from: usize, what: &'static str) -> Result<Msg> {
        let msg = self.world.wait(key, &self.me(), &self.name(from), what)?;
        if msg.what != what {
            return self.fail(format!(
                "expected {what} from {} but got {}: ranks called collectives in different orders",
                self.name(from),
                msg.what
            ));
        }
        Ok(msg)
    }

    fn tensors(&self, msg: Msg, device: &Device) -> Result<Vec<Tensor>> {
        match msg.payload {
            Ok(ts) => ts.iter().map(|t| t.to_device(device)).collect(),
            Err(reason) => crate::comm_err!("{}: {reason}", self.me()),
        }
    }

    /// [`Self::exchange`] of one tensor per member: `xs[j]` goes to member `j`.
    fn exchange_one_each(&self, what: &'static str, xs: Vec<Tensor>) -> Result<Vec<Vec<Tensor>>> {
        let n = self.members.len();
        if xs.len() != n {
            return self.fail(format!("{what} needs one tensor per rank ({n}), got {}", xs.len()));
        }
        let device = xs[0].device().clone();
        let sig = sig_of(&xs);
        let parts = snapshot(&xs)?.into_iter().map(|x| vec![x]).collect();
        self.exchange(what, parts, sig, &device)
    }

    /// Sends `xs[i]` (already snapshots; with the signature of what this member sends)
    /// to every member `i`; checks that every member sent tensors of one shape and dtype
    /// ([`Self::check_uniform`]) and returns, per member `j`, the tensors it sent here, on
    /// `device`.
    fn exchange(&self, what: &'static str, xs: Vec<Vec<Tensor>>, sig: Vec<Sig>, device: &Device) -> Result<Vec<Vec<Tensor>>> {
        let n = self.members.len();
        let keys: Vec<Key> = (0..n).map(|j| self.recv_key(j)).collect();
        for (i, x) in xs.into_iter().enumerate() {
            self.send(i, Msg { what, sig: sig.clone(), payload: Ok(x) })?;
        }
        let (mut sigs, mut out) = (Vec::with_capacity(n), Vec::with_capacity(n));
        for (j, key) in keys.into_iter().enumerate() {
            let msg = self.recv(key, j, what)?;
            sigs.push(msg.sig.clone());
            out.push(self.tensors(msg, device)?);
        }
        if let Err(e) = Self::check_uniform(what, &sigs) {
            return crate::comm_err!("{}: {e}", self.me());
        }
        Ok(out)
    }

    /// The same check on every member: all tensors of all members share one shape and dtype.
    fn check_uniform(what: &str, sigs: &[Vec<Sig>]) -> std::result::Result<(), String> {
        let first = sigs.iter().flat_map(|s| s.iter()).next();
        let Some((shape0, dtype0)) = first else { return Ok(()) };
        for (j, s) in sigs.iter().enumerate() {
            for (i, (shape, dtype)) in s.iter().enumerate() {
                if shape != shape0 || dtype != dtype0 {
                    return Err(format!(
                        "{what}: mismatched inputs: rank {j} tensor {i} is {shape:?} {dtype:?}, expected {shape0:?} {dtype0:?} (rank 0 tensor 0)"
                    ));
                }
            }
        }
        Ok(())
    }
}

impl Comm for ThreadComm {
    fn rank(&self) -> usize {
        self.rank
    }

    fn world(&self) -> usize {
        self.members.len()
    }

    fn sendrecv_start(&self, send: Vec<Tensor>, to: usize, from: usize) -> Result<Pending> {
        self.check_peer(to, "destination")?;
        self.check_peer(from, "source")?;
        let device = send.first().map(|t| t.device().clone());
        let key = self.recv_key(from);
        let msg = Msg { what: "sendrecv", sig: sig_of(&send), payload: Ok(snapshot(&send)?) };
        self.send(to, msg)?;
        let world = self.world.clone();
        let (me, peer) = (self.me(), self.name(from));
        Ok(Pending::new(move || {
            let msg = world.wait(key, &me, &peer, "sendrecv")?;
            if msg.what != "sendrecv" {
                let reason = format!("{me}: expected sendrecv from {peer} but got {}", msg.what);
                world.abort(Some(key.2), &reason);
                return crate::comm_err!("{reason}");
            }
            match msg.payload {
                Ok(ts) => match &device {
                    Some(d) => ts.iter().map(|t| t.to_device(d)).collect(),
                    None => Ok(ts),
                },
                Err(reason) => crate::comm_err!("{me}: {reason}"),
            }
        }))
    }

    fn all_to_all(&self, xs: Vec<Tensor>) -> Result<Vec<Tensor>> {
        Ok(self.exchange_one_each("all_to_all", xs)?.into_iter().flatten().collect())
    }

    fn all_reduce_sum(&self, x: &Tensor) -> Result<Tensor> {
        let n = self.members.len();
        let what = "all_reduce_sum";
        // Gather on member 0, which checks, sums in rank order and broadcasts the
        // result (or the failure) so that every member gets the same bits.
        if self.rank != 0 {
            let key = self.recv_key(0);
            self.send(0, Msg { what, sig: sig_of(std::slice::from_ref(x)), payload: Ok(snapshot(std::slice::from_ref(x))?) })?;
            let msg = self.recv(key, 0, what)?;
            let mut ts = self.tensors(msg, x.device())?;
            return match ts.pop() {
                Some(t) if ts.is_empty() => Ok(t),
                _ => self.fail("all_reduce_sum: rank 0 sent no single result".to_string()),
            };
        }
        let keys: Vec<Key> = (1..n).map(|j| self.recv_key(j)).collect();
        let mut sigs = vec![sig_of(std::slice::from_ref(x))];
        let mut parts = vec![x.clone()];
        for (j, key) in (1..n).zip(keys) {
            let msg = self.recv(key, j, what)?;
            sigs.push(msg.sig.clone());
            if let Ok(ts) = msg.payload {
                parts.extend(ts);
            }
        }
        let reply = match Self::check_uniform(what, &sigs) {
            Err(e) => Err(e),
            Ok(()) => {
                let mut acc = parts[0].to_device(x.device())?;
                for p in &parts[1..] {
                    acc = (acc + p.to_device(x.device())?)?;
                }
                Ok(acc)
            }
        };
        // One snapshot for all: receivers only read it.
        let payload = match &reply {
            Ok(t) => Ok(snapshot(std::slice::from_ref(t))?),
            Err(e) => Err(e.clone()),
        };
        for j in 1..n {
            self.send(j, Msg { what, sig: Vec::new(), payload: payload.clone() })?;
        }
        match reply {
            Ok(t) => Ok(t),
            Err(e) => crate::comm_err!("{}: {e}", self.me()),
        }
    }

    fn all_gather(&self, x: &Tensor) -> Result<Vec<Tensor>> {
        let n = self.members.len();
        let sig = sig_of(std::slice::from_ref(x));
        let one = snapshot(std::slice::from_ref(x))?; // one copy for all: receivers only read it
        Ok(self.exchange("all_gather", vec![one; n], sig, x.device())?.into_iter().flatten().collect())
    }

    fn reduce_scatter_sum(&self, xs: Vec<Tensor>) -> Result<Tensor> {
        let mut acc: Option<Tensor> = None;
        for ts in self.exchange_one_each("reduce_scatter_sum", xs)? {
            for t in ts {
                acc = Some(match acc {
                    None => t,
                    Some(a) => (a + t)?,
                });
            }
        }
        match acc {
            Some(a) => Ok(a),
            None => self.fail("reduce_scatter_sum: nothing arrived".to_string()),
        }
    }

    fn barrier(&self) -> Result<()> {
        let n = self.members.len();
        self.exchange("barrier", vec![Vec::new(); n], Vec::new(), &Device::Cpu)?;
        Ok(())
    }

    fn sub(&self, ranks: &[usize]) -> Result<Arc<dyn Comm>> {
        let n = self.members.len();
        if ranks.is_empty() || ranks.windows(2).any(|w| w[0] >= w[1]) || ranks.iter().any(|&r| r >= n) {
            return self.fail(format!("sub: ranks {ranks:?} must be ascending, distinct and below {n}"));
        }
        let Some(pos) = ranks.iter().position(|&r| r == self.rank) else {
            return self.fail(format!("sub: ranks {ranks:?} do not contain this rank {}", self.rank));
        };
        let count = {
            let mut c = self.subs.lock().unwrap_or_else(|p| p.into_inner());
            *c += 1;
            *c
        };
        // Members make the same sequence of `sub` calls, so (parent, call count,
        // members) names the group identically on all of them and nowhere else.
        let mut h = std::collections::hash_map::DefaultHasher::new();
        (self.group, count, ranks).hash(&mut h);
        let group = h.finish() | 1; // never WORLD_GROUP
        let members = ranks.iter().map(|&r| self.members[r]).collect();
        Ok(Arc::new(Self::member(self.world.clone(), group, members, pos)))
    }

    fn abort(&self, reason: &str) {
        self.world.abort(Some(self.members[self.rank]), reason);
    }
}

/// Text of a panic payload.
fn panic_text(p: &(dyn std::any::Any + Send)) -> String {
    if let Some(s) = p.downcast_ref::<&str>() {
        s.to_string()
    } else if let Some(s) = p.downcast_ref::<String>() {
        s.clone()
    } else {
        "non-string panic payload".to_string()
    }
}

/// Runs `f` on `n` ranks (scoped threads of a fresh world, default timeout) and
/// returns their results in rank order, or the root-cause error.
pub fn run_ranks<T: Send>(n: usize, f: impl Fn(Arc<dyn Comm>) -> Result<T> + Sync) -> Result<Vec<T>> {
    run_ranks_with_timeout(n, DEFAULT_TIMEOUT, f)
}

/// [`run_ranks`] with a given communication timeout.
///
/// When a rank returns an error or panics, the world is aborted so that the others
/// stop waiting; the error returned is that of the rank that failed first (the root
/// cause), prefixed with its rank, not the "world aborted" errors it caused.
pub fn run_ranks_with_timeout<T: Send>(n: usize, timeout: Duration, f: impl Fn(Arc<dyn Comm>) -> Result<T> + Sync) -> Result<Vec<T>> {
    if n == 0 {
        return crate::config_err!("run_ranks: world size must be at least 1");
    }
    let handles = ThreadComm::handles(n, timeout);
    let world = handles[0].world.clone();
    let f = &f;
    let results: Vec<Result<T>> = std::thread::scope(|scope| {
        let joins: Vec<_> = handles
            .into_iter()
            .enumerate()
            .map(|(r, comm)| {
                let world = world.clone();
                scope.spawn(move || {
                    let out = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| f(comm)));
                    let out = match out {
                        Ok(res) => res,
                        Err(p) => Err(candle_core::Error::Msg(format!("panicked: {}", panic_text(&*p)))),
                    };
                    if let Err(e) = &out {
                        world.abort(Some(r), &format!("rank {r} failed: {e}"));
                    }
                    out
                })
            })
            .collect();
        joins
            .into_iter()
            .enumerate()
            .map(|(r, j)| match j.join() {
                Ok(res) => res,
                Err(p) => Err(candle_core::Error::Msg(format!("rank {r} thread died: {}", panic_text(&*p)))),
            })
            .collect()
    });
    let origin = world.aborted().and_then(|(o, _)| o);
    let mut errs: Vec<(usize, candle_core::Error)> = Vec::new();
    let mut oks = Vec::with_capacity(n);
    for (r, res) in results.into_iter().enumerate() {
        match res {
            Ok(t) => oks.push(t),
            Err(e) => errs.push((r, e)),
        }
    }
    if errs.is_empty() {
        return Ok(oks);
    }
    // The rank that aborted the world failed first; otherwise take the lowest rank.
    let idx = errs.iter().position(|(r, _)| Some(*r) == origin).unwrap_or(0);
    let (r, e) = errs.swap_remove(idx);
    Err(e.context(format!("rank {r} of {n} failed")))
}
