//! Liveness of an NCCL world (feature `nccl`): the communicator handles, the family
//! that fails together, the lock that orders calls and aborts, and the watchdog.
//!
//! - Calls: every NCCL call of this process runs under one lock ([`Family::enter`]);
//!   `ncclCommAbort` runs only under that lock too, so it never frees a communicator
//!   another thread is inside. An abort decided while a call holds the lock (from the
//!   watchdog, the failure monitor, or the failing call itself) is carried out when
//!   that call releases it; one that cannot get the lock is retried by the watchdog.
//!   A call the host never returns from (e.g. `ncclCommInitRank` waiting for a rank
//!   that is gone) cannot be aborted: the process is stopped by its failure monitor
//!   (see [`Family::settled`]).
//! - Family: the world and its splits; the first failure (an NCCL error, a local
//!   abort, an asynchronous error, a timed-out collective, a peer's failure) aborts them
//!   all and every later call errors with the reason. The hook, set before the world's
//!   `ncclCommInitRank`, tells the other processes of a failure found here.
//! - Watchdog: a thread per family polls `ncclCommGetAsyncError` and the completion
//!   events of the queued collectives; one still pending after the collective timeout
//!   aborts the family, naming this rank, the collective and the communicator.

use super::nccl::err_text;
use candle_core::cuda::cudarc::driver::{CudaContext, CudaEvent, CudaStream};
use candle_core::cuda::cudarc::nccl::sys;
use std::collections::VecDeque;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex, MutexGuard, Weak};
use std::time::{Duration, Instant};

/// One NCCL operation sequence (or abort) at a time in this process.
static CALLS: Mutex<()> = Mutex::new(());

fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|p| p.into_inner())
}

/// A raw communicator; freed by abort (never blocks on a dead peer) or destroy.
pub(super) struct Handle {
    pub(super) comm: sys::ncclComm_t,
    stream: Arc<CudaStream>,
    /// Guards the handle's lifetime (abort / destroy / async-error polling).
    alive: Mutex<bool>,
}

// SAFETY: an NCCL communicator may be used from any thread; calls on it and its abort
// are serialised by `CALLS`, its lifetime by `alive`.
unsafe impl Send for Handle {}
unsafe impl Sync for Handle {}

impl Handle {
    pub(super) fn new(comm: sys::ncclComm_t, stream: Arc<CudaStream>) -> Arc<Self> {
        Arc::new(Self { comm, stream, alive: Mutex::new(true) })
    }

    pub(super) fn is_alive(&self) -> bool {
        *lock(&self.alive)
    }

    /// `ncclCommAbort`, once. The guard proves no call is in flight.
    fn abort(&self, _calls: &MutexGuard<'static, ()>) {
        let mut alive = lock(&self.alive);
        if *alive {
            *alive = false;
            // SAFETY: `comm` is live (alive was true), no call is inside it (CALLS is
            // held), and it is not used after this.
            unsafe {
                sys::ncclCommAbort(self.comm);
            }
        }
    }

    /// The pending asynchronous error, if any (NCCL allows this query during calls).
    fn async_error(&self) -> Option<String> {
        let alive = lock(&self.alive);
        if !*alive {
            return None;
        }
        let mut r = sys::ncclResult_t::ncclSuccess;
        // SAFETY: `comm` is live while `alive` is held.
        let q = unsafe { sys::ncclCommGetAsyncError(self.comm, &mut r) };
        match (q, r) {
            (sys::ncclResult_t::ncclSuccess, sys::ncclResult_t::ncclSuccess | sys::ncclResult_t::ncclInProgress) => None,
            (sys::ncclResult_t::ncclSuccess, r) => Some(err_text(r, self.comm)),
            (q, _) => Some(err_text(q, self.comm)),
        }
    }
}

impl Drop for Handle {
    fn drop(&mut self) {
        let mut alive = lock(&self.alive);
        if *alive {
            *alive = false;
            // Let our queued work finish so that peers get their data, then free.
            let _ = self.stream.synchronize();
            // SAFETY: live communicator, no other user left (we are its last owner).
            unsafe {
                sys::ncclCommDestroy(self.comm);
            }
        }
    }
}

type Hook = Arc<dyn Fn(&str) + Send + Sync>;

/// A queued collective the watchdog waits for.
struct Work {
    what: String,
    queued: Instant,
    done: CudaEvent,
}

/// The world communicator and all its splits: they fail together. Made before the
/// world's communicator (see [`super::nccl::NcclComm::init`]) so that the failure
/// wiring is in place during `ncclCommInitRank`.
pub struct Family {
    rank: usize,
    world: usize,
    handles: Mutex<Vec<Weak<Handle>>>,
    reason: Mutex<Option<String>>,
    hook: Mutex<Option<Hook>>,
    /// Inside `ncclCommInitRank` (nothing can interrupt it).
    initialising: AtomicBool,
    /// The call holding the lock: what, and since when (a host call can block too,
    /// e.g. while NCCL connects to a peer that does not answer).
    current: Mutex<Option<(String, Instant)>>,
    /// Queued collectives, oldest first (one stream: they complete in order).
    works: Mutex<VecDeque<Work>>,
    calls: AtomicU64,
}

impl std::fmt::Debug for Family {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "NcclFamily(rank {} of {}, aborted: {:?})", self.rank, self.world, self.reason())
    }
}

/// The lock of NCCL calls, held; on release it carries out an abort decided meanwhile.
pub(super) struct Calls<'a> {
    guard: Option<MutexGuard<'static, ()>>,
    family: &'a Family,
}

impl Drop for Calls<'_> {
    fn drop(&mut self) {
        *lock(&self.family.current) = None;
        if let Some(g) = self.guard.take() {
            if self.family.reason().is_some() {
                self.family.abort_handles(&g);
            }
        }
    }
}

impl Family {
    /// The failure state of rank `rank` of an NCCL world of `world`, before its communicator.
    pub fn new(rank: usize, world: usize) -> Arc<Self> {
        Arc::new(Self {
            rank,
            world,
            handles: Mutex::new(Vec::new()),
            reason: Mutex::new(None),
            hook: Mutex::new(None),
            initialising: AtomicBool::new(false),
            current: Mutex::new(None),
            works: Mutex::new(VecDeque::new()),
            calls: AtomicU64::new(0),
        })
    }

    /// Called once with the reason when this process fails the family on its own (an
    /// NCCL error, `abort`, the watchdog): tell the other processes here, e.g.
    /// `monitor.report_failure(reason)`.
    pub fn set_abort_hook(&self, f: impl Fn(&str) + Send + Sync + 'static) {
        *lock(&self.hook) = Some(Arc::new(f));
    }

    /// Another process failed (no hook: they already know).
    pub fn abort_from_peer(&self, reason: &str) {
        self.abort(reason, false);
    }

    /// The reason the family was aborted, if it was.
    pub fn reason(&self) -> Option<String> {
        lock(&self.reason).clone()
    }

    /// Aborted and every communicator freed (false while a call the host cannot leave,
    /// such as `ncclCommInitRank`, keeps the abort from running: then the process must
    /// be stopped from outside, e.g. by the failure monitor's backstop).
    pub fn settled(&self) -> bool {
        self.reason().is_some()
            && !self.initialising.load(Ordering::SeqCst)
            && lock(&self.handles).iter().filter_map(Weak::upgrade).all(|h| !h.is_alive())
    }

    pub(super) fn set_initialising(&self, on: bool) {
        self.initialising.store(on, Ordering::SeqCst);
    }

    pub(super) fn add(&self, h: &Arc<Handle>) {
        lock(&self.handles).push(Arc::downgrade(h));
    }

    /// Take the call lock for the call `what` (see the module doc); the watchdog times
    /// the call from here until the lock is released.
    pub(super) fn enter(&self, what: &str) -> Calls<'_> {
        let guard = lock(&CALLS);
        *lock(&self.current) = Some((what.to_string(), Instant::now()));
        Calls { guard: Some(guard), family: self }
    }

    /// Fail the family (first reason wins): run the hook when `tell`, then abort every
    /// communicator now if no call holds the lock, else when it is released.
    pub(super) fn abort(&self, reason: &str, tell: bool) {
        {
            let mut r = lock(&self.reason);
            if r.is_some() {
                return;
            }
            *r = Some(reason.to_string());
        }
        let hook = lock(&self.hook).clone();
        if let (true, Some(hook)) = (tell, hook) {
            hook(reason);
        }
        self.try_abort_handles();
    }

    fn try_abort_handles(&self) {
        let g = match CALLS.try_lock() {
            Ok(g) => g,
            Err(std::sync::TryLockError::Poisoned(p)) => p.into_inner(),
            Err(std::sync::TryLockError::WouldBlock) => return,
        };
        self.abort_handles(&g);
    }

    fn abort_handles(&self, g: &MutexGuard<'static, ()>) {
        let handles: Vec<_> = lock(&self.handles).clone();
        for h in handles.iter().filter_map(Weak::upgrade) {
            h.abort(g);
        }
    }

    /// Watch the work queued last on `stream` (collective `what` on `comm`, a label).
    pub(super) fn track(&self, stream: &CudaStream, what: &str, comm: &str) -> candle_core::Result<()> {
        let n = self.calls.fetch_add(1, Ordering::SeqCst) + 1;
        let done = stream.record_event(None).map_err(|e| candle_core::Error::Msg(format!("NCCL {what}: recording an event: {e:?}")))?;
        let mut works = lock(&self.works);
        prune(&mut works);
        works.push_back(Work { what: format!("{what}, call {n} on {comm},"), queued: Instant::now(), done });
        Ok(())
    }

    /// A call blocked in the host, or the oldest queued collective, still not done
    /// after `limit`: what to say about it.
    fn overdue(&self, limit: Duration) -> Option<String> {
        if let Some((what, since)) = lock(&self.current).as_ref() {
            if since.elapsed() >= limit {
                return Some(format!("{what} has not returned"));
            }
        }
        let mut works = lock(&self.works);
        prune(&mut works);
        works.front().filter(|w| w.queued.elapsed() >= limit).map(|w| format!("{} did not complete", w.what))
    }

    /// Poll for asynchronous errors and overdue collectives until the family is gone.
    pub(super) fn start_watchdog(self: &Arc<Self>, ctx: Arc<CudaContext>, every: Duration, timeout: Option<Duration>) {
        let fam = Arc::downgrade(self);
        let every = timeout.map_or(every, |t| every.min(t / 4).max(Duration::from_millis(10)));
        std::thread::spawn(move || {
            // Event queries need the device's context on this thread.
            let _ = ctx.bind_to_thread();
            watchdog(fam, every, timeout)
        });
    }
}

/// Forget the finished collectives at the front (an event that cannot be queried counts
/// as finished: the asynchronous-error poll reports what went wrong).
fn prune(works: &mut VecDeque<Work>) {
    while works.front().is_some_and(|w| !matches!(w.done.try_is_complete(), Ok(false))) {
        works.pop_front();
    }
}

fn watchdog(family: Weak<Family>, every: Duration, timeout: Option<Duration>) {
    loop {
        std::thread::sleep(every);
        let Some(fam) = family.upgrade() else { return };
        if fam.reason().is_some() {
            // An abort that found the lock taken: retry until it ran.
            fam.try_abort_handles();
            if fam.settled() {
                return;
            }
            continue;
        }
        let handles: Vec<_> = lock(&fam.handles).clone();
        if let Some(e) = handles.iter().filter_map(Weak::upgrade).find_map(|h| h.async_error()) {
            fam.abort(&format!("rank {} of {}: NCCL asynchronous error: {e}", fam.rank, fam.world), true);
            continue;
        }
        if let Some((what, limit)) = timeout.and_then(|t| fam.overdue(t).map(|w| (w, t))) {
            let msg = format!(
                "rank {} of {}: NCCL {what} within {} (collective timeout, parallel.collective_timeout_s): \
                 a rank stopped taking part in it or is stuck; aborting every rank",
                fam.rank,
                fam.world,
                super::secs(limit)
            );
            fam.abort(&msg, true);
        }
    }
}
