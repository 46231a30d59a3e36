//! NCCL backend (feature `nccl`): one process per GPU, tensors on that GPU.
//!
//! Creation: rank 0 calls [`NcclComm::unique_id`], the id reaches every rank out of
//! band (`longctx::parallel::rendezvous`), then every rank calls [`NcclComm::new`] with its
//! rank, the world size and the id (`ncclCommInitRank`, blocks until all ranks joined).
//!
//! Operations:
//! - `sendrecv_start`: one NCCL group of sends and receives (`ncclGroupStart/End`), so
//!   neighbours that send to each other never deadlock; `all_to_all` likewise with one
//!   send and one receive per peer (NCCL has no all-to-all of its own).
//! - `all_reduce_sum`, `all_gather`, `reduce_scatter_sum`: NCCL's collectives
//!   (all-reduce gives the same bits on every rank). `barrier`: a 1-element all-reduce,
//!   then the host waits for it.
//! - `sub`: `ncclCommSplit` with colour = smallest member, key = position. Unlike the
//!   thread backend, a split is collective over *all* ranks of the parent: every rank
//!   calls `sub` at the same point with its own group, and the groups of one call
//!   partition the parent (what `longctx::parallel::build_groups` does).
//!
//! Receive sizes: NCCL cannot learn the size of an incoming message, so receives are
//! posted with the shapes and dtypes of what this rank sends (to `to` in
//! `sendrecv_start`, to rank `j` for `ys[j]` in `all_to_all`). Every sequence-parallel
//! mode exchanges equal shapes. With `check_shapes` (or `LONGCTX_NCCL_CHECK=1`) the
//! ranks first exchange a signature of their messages and a mismatch is an error on
//! both sides, at the cost of a host round trip per call.
//!
//! Streams: by default the NCCL work runs on a dedicated stream of the device. Before
//! queuing, the NCCL stream waits for everything queued on Candle's compute stream (an
//! event, no host wait): cudarc's per-buffer events cannot be relied on for inputs,
//! because Candle hands the outputs of its kernels to cudarc as read-only arguments and
//! so no write event is ever recorded for them (issue 12: NCCL read gradients and kv
//! blocks before they were computed). Collectives then make the compute stream wait
//! for the NCCL stream before returning; `sendrecv_start` does that only in
//! `Pending::wait`, so the ring overlaps its transfer with compute. Memory: a buffer
//! freed on one stream while the other still uses it is held back by cudarc's read and
//! write events (recorded on the NCCL stream for everything NCCL touches, and on the
//! compute stream for every kernel argument), so the stream-ordered pool cannot hand
//! it out early. Creating the stream switches cudarc to multi-stream mode (a
//! synchronisation, then event waits on every kernel launch). With
//! `dedicated_stream: false` everything runs on Candle's stream instead (no overlap).
//!
//! Failure (see [`super::nccl_family`]): an NCCL error, a local `abort`, or (with
//! `watchdog`) an asynchronous NCCL error or a collective still pending after the
//! collective timeout, seen by a polling thread, aborts every communicator of the
//! family (the world and its splits, `ncclCommAbort`, which also ends kernels stuck on
//! a dead or stalled peer); every later call errors with the reason. The family's abort
//! hook, set before `ncclCommInitRank` ([`NcclComm::init`]), tells the other processes,
//! e.g. through the rendezvous monitor, whose own failure callback should call
//! [`Family::abort_from_peer`].
//!
//! Calls are serialised per process (NCCL group state is per thread and communicator
//! use must be ordered the same on every rank), and `ncclCommAbort` with them: it
//! never runs while another thread is inside a call.

use super::{Comm, Pending};
use crate::cuda::raw;
use candle_core::cuda::cudarc::driver::CudaStream;
use candle_core::cuda::cudarc::nccl::sys;
use candle_core::cuda::WrapErr;
use candle_core::{CudaDevice, CudaStorage, DType, Device, Result, Tensor};
use std::ffi::{c_void, CStr};
use std::sync::Arc;
use std::time::Duration;

pub use super::nccl_family::Family;
use super::nccl_family::{Calls, Handle};

/// Size of an NCCL unique id.
pub const ID_BYTES: usize = 128;

/// Default collective timeout (`parallel.collective_timeout_s`).
pub const DEFAULT_COLLECTIVE_TIMEOUT: Duration = Duration::from_secs(600);

#[derive(Debug, Clone)]
pub struct NcclOptions {
    /// Run NCCL on its own stream (overlap with compute); else on Candle's stream.
    pub dedicated_stream: bool,
    /// Exchange message signatures before p2p calls and error on a mismatch.
    pub check_shapes: bool,
    /// Poll `ncclCommGetAsyncError` and the queued collectives at this interval and abort
    /// on an error or an overdue collective.
    pub watchdog: Option<Duration>,
    /// A collective still pending this long after it was queued aborts the world (needs
    /// `watchdog`); `None`: no limit.
    pub collective_timeout: Option<Duration>,
}

impl Default for NcclOptions {
    fn default() -> Self {
        let check = matches!(std::env::var("LONGCTX_NCCL_CHECK").as_deref(), Ok("1") | Ok("true") | Ok("yes"));
        // `LONGCTX_NCCL_STREAM=compute`: NCCL on Candle's stream (no overlap; tells
        // ordering faults from logic faults).
        let dedicated = !matches!(std::env::var("LONGCTX_NCCL_STREAM").as_deref(), Ok("compute"));
        Self {
            dedicated_stream: dedicated,
            check_shapes: check,
            watchdog: Some(Duration::from_secs(1)),
            collective_timeout: Some(DEFAULT_COLLECTIVE_TIMEOUT),
        }
    }
}

pub(super) fn err_text(r: sys::ncclResult_t, comm: sys::ncclComm_t) -> String {
    // SAFETY: NCCL returns static strings (or a per-communicator buffer) for these.
    let text = unsafe {
        let s = sys::ncclGetErrorString(r);
        if s.is_null() {
            String::new()
        } else {
            CStr::from_ptr(s).to_string_lossy().into_owned()
        }
    };
    let last = if comm.is_null() {
        String::new()
    } else {
        // SAFETY: as above; `comm` is a live communicator.
        unsafe {
            let s = sys::ncclGetLastError(comm);
            if s.is_null() {
                String::new()
            } else {
                CStr::from_ptr(s).to_string_lossy().into_owned()
            }
        }
    };
    if last.is_empty() {
        format!("{r:?}: {text}")
    } else {
        format!("{r:?}: {text} ({last})")
    }
}

fn ok(r: sys::ncclResult_t, what: &str, comm: sys::ncclComm_t) -> std::result::Result<(), String> {
    if r == sys::ncclResult_t::ncclSuccess {
        Ok(())
    } else {
        Err(format!("NCCL {what} failed: {}", err_text(r, comm)))
    }
}

fn nccl_dtype(dt: DType) -> Result<sys::ncclDataType_t> {
    use sys::ncclDataType_t as N;
    Ok(match dt {
        DType::U8 => N::ncclUint8,
        DType::U32 => N::ncclUint32,
        DType::I32 => N::ncclInt32,
        DType::I64 => N::ncclInt64,
        DType::F16 => N::ncclFloat16,
        DType::BF16 => N::ncclBfloat16,
        DType::F32 => N::ncclFloat32,
        DType::F64 => N::ncclFloat64,
        _ => return crate::config_err!("NCCL cannot reduce dtype {dt:?}"),
    })
}

/// NCCL communicator over the CUDA device of this process. See the module doc.
pub struct NcclComm {
    handle: Arc<Handle>,
    family: Arc<Family>,
    rank: usize,
    world: usize,
    /// Which communicator, for messages: `the world`, `group [0, 2]`.
    label: Arc<str>,
    device: CudaDevice,
    /// The stream NCCL work is queued on.
    stream: Arc<CudaStream>,
    check_shapes: bool,
}

impl std::fmt::Debug for NcclComm {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "NcclComm(rank {} of {}, {:?})", self.rank, self.world, self.device)
    }
}

impl NcclComm {
    /// A fresh NCCL unique id (rank 0), to hand to every rank.
    pub fn unique_id() -> Result<Vec<u8>> {
        let mut id = std::mem::MaybeUninit::<sys::ncclUniqueId>::uninit();
        // SAFETY: ncclGetUniqueId fills the whole id on success.
        let id = unsafe {
            if let Err(e) = ok(sys::ncclGetUniqueId(id.as_mut_ptr()), "ncclGetUniqueId", std::ptr::null_mut()) {
                return crate::comm_err!("{e}");
            }
            id.assume_init()
        };
        Ok(id.internal.iter().map(|&c| c as u8).collect())
    }

    /// Join the world `id` names as `rank` of `world` on `device` (default options).
    pub fn new(device: &Device, rank: usize, world: usize, id: &[u8]) -> Result<Arc<Self>> {
        Self::with_options(device, rank, world, id, NcclOptions::default())
    }

    /// [`Self::init`] with a family of its own (set its hook with [`Self::set_abort_hook`]).
    pub fn with_options(device: &Device, rank: usize, world: usize, id: &[u8], opts: NcclOptions) -> Result<Arc<Self>> {
        Self::init(device, rank, world, id, opts, Family::new(rank, world))
    }

    /// Join the world `id` names as `rank` of `world` on `device`, in `family`, whose
    /// hook and peer-failure wiring the caller set up beforehand (so that a failure
    /// during `ncclCommInitRank` is neither lost nor left unreported). A family aborted
    /// before or during the init gives an error.
    pub fn init(device: &Device, rank: usize, world: usize, id: &[u8], opts: NcclOptions, family: Arc<Family>) -> Result<Arc<Self>> {
        let Device::Cuda(dev) = device else {
            return crate::config_err!("NCCL needs a CUDA device, got {device:?}");
        };
        if rank >= world {
            return crate::config_err!("NCCL: rank {rank} is not below the world size {world}");
        }
        if id.len() != ID_BYTES {
            return crate::config_err!("NCCL: the unique id has {} bytes, expected {ID_BYTES}", id.len());
        }
        let (Ok(nranks), Ok(me)) = (i32::try_from(world), i32::try_from(rank)) else {
            return crate::config_err!("NCCL: world size {world} does not fit an i32");
        };
        let compute = raw::bind(dev)?;
        let stream = if opts.dedicated_stream { compute.context().new_stream().w()? } else { compute };
        let mut uid = sys::ncclUniqueId { internal: [0; ID_BYTES] };
        for (d, &s) in uid.internal.iter_mut().zip(id) {
            *d = s as _;
        }
        if let Some(every) = opts.watchdog {
            family.start_watchdog(stream.context().clone(), every, opts.collective_timeout);
        }
        let handle = {
            let calls = family.enter("ncclCommInitRank");
            if let Some(r) = family.reason() {
                return crate::comm_err!("rank {rank} of {world}: not creating the NCCL communicator: {r}");
            }
            let mut comm: sys::ncclComm_t = std::ptr::null_mut();
            family.set_initialising(true);
            // SAFETY: `comm` receives a new communicator; the id is a full ncclUniqueId.
            let r = unsafe { sys::ncclCommInitRank(&mut comm, nranks, uid, me) };
            family.set_initialising(false);
            if let Err(e) = ok(r, "ncclCommInitRank", std::ptr::null_mut()) {
                drop(calls);
                let reason = format!("rank {rank} of {world}: {e}");
                family.abort(&reason, true);
                return crate::comm_err!("{reason}");
            }
            let handle = Handle::new(comm, stream.clone());
            family.add(&handle);
            handle // `calls` aborts it on release if a failure came meanwhile
        };
        if let Some(r) = family.reason() {
            return crate::comm_err!("rank {rank} of {world}: NCCL communicator aborted during its creation: {r}");
        }
        let label: Arc<str> = Arc::from("the world");
        Ok(Arc::new(Self { handle, family, rank, world, label, device: dev.clone(), stream, check_shapes: opts.check_shapes }))
    }

    /// Called once with the reason when this process aborts the family on its own
    /// (an NCCL error, `abort`, the watchdog): tell the other processes here, e.g.
    /// `monitor.report_failure(reason)`. Prefer setting it on the [`Family`] before
    /// [`Self::init`].
    pub fn set_abort_hook(&self, f: impl Fn(&str) + Send + Sync + 'static) {
        self.family.set_abort_hook(f);
    }

    /// Abort because another process failed (no hook: they already know).
    pub fn abort_from_peer(&self, reason: &str) {
        self.family.abort_from_peer(reason);
    }

    /// The reason the family was aborted, if it was.
    pub fn aborted(&self) -> Option<String> {
        self.family.reason()
    }

    /// The family this communicator fails with.
    pub fn family(&self) -> &Arc<Family> {
        &self.family
    }

    /// The stream NCCL work is queued on.
    pub fn stream(&self) -> &Arc<CudaStream> {
        &self.stream
    }

    fn alive(&self) -> Result<()> {
        match self.family.reason() {
            Some(r) => crate::comm_err!("NCCL communicator aborted: {r}"),
            None => Ok(()),
        }
    }

    /// The call lock for `what`, once the communicator is known to be usable under it.
    fn enter(&self, what: &str) -> Result<Calls<'_>> {
        let calls = self.family.enter(&format!("{what} (on {})", self.label));
        self.alive()?;
        if !self.handle.is_alive() {
            return crate::comm_err!("NCCL communicator ({}) already freed", self.label);
        }
        Ok(calls)
    }

    /// An NCCL error on this rank: abort the family (and tell the others), then error.
    fn failed<T>(&self, msg: String) -> Result<T> {
        let reason = format!("rank {} of {}: {msg}", self.rank, self.world);
        self.family.abort(&reason, true);
        crate::comm_err!("{reason}")
    }

    /// Contiguous, on this communicator's GPU.
    fn prepare(&self, ts: Vec<Tensor>, what: &str) -> Result<Vec<Tensor>> {
        let here = Device::Cuda(self.device.clone());
        ts.into_iter()
            .map(|t| {
                if t.device().same_device(&here) {
                    t.contiguous()
                } else {
                    crate::config_err!("NCCL {what}: tensor on {:?}, expected {here:?}", t.device())
                }
            })
            .collect()
    }

    /// Uninitialised buffer for `n` elements of `dt` on the NCCL stream (at least one
    /// element: zero-size allocations are not portable).
    fn alloc(&self, dt: DType, n: usize) -> Result<CudaStorage> {
        // SAFETY: every buffer is entirely written by NCCL before anything reads it.
        unsafe { raw::alloc(&self.stream, &self.device, dt, n.max(1)) }
    }

    /// Queue a group of sends and receives (raw byte buffers).
    fn p2p(&self, ops: &[P2p]) -> Result<()> {
        let comm = self.handle.comm;
        let st = self.stream.cu_stream() as sys::cudaStream_t;
        let u8t = sys::ncclDataType_t::ncclUint8;
        // SAFETY: pointers address live device buffers of `bytes` bytes on this GPU (the
        // callers hold their storage and pointer guards until after group end).
        let res = unsafe {
            ok(sys::ncclGroupStart(), "ncclGroupStart", comm).and_then(|_| {
                let mut first = Ok(());
                for op in ops {
                    let r = match *op {
                        P2p::Send { ptr, bytes, peer } => sys::ncclSend(ptr as *const c_void, bytes, u8t, peer as i32, comm, st),
                        P2p::Recv { ptr, bytes, peer } => sys::ncclRecv(ptr as *mut c_void, bytes, u8t, peer as i32, comm, st),
                    };
                    if first.is_ok() {
                        first = ok(r, "ncclSend/ncclRecv", comm);
                    }
                }
                let end = ok(sys::ncclGroupEnd(), "ncclGroupEnd", comm);
                first.and(end)
            })
        };
        res.or_else(|e| self.failed(e))
    }

    /// Grouped point-to-point exchange: `sends[i] = (peer, tensors)`, receives posted
    /// from `recv_from[i]` with the shapes of `sends[i].1` (see the module doc).
    fn exchange(&self, sends: &[(usize, Vec<Tensor>)], recv_from: &[usize], what: &str) -> Result<(Vec<Vec<Tensor>>, Done)> {
        self.alive()?;
        if self.check_shapes {
            self.check_signatures(sends, recv_from, what)?;
        }
        let _calls = self.enter(what)?;
        self.stream.context().bind_to_thread().w()?;
        self.after_compute()?;
        // Every message tensor, flat: what it sends, to whom, and from whom its receive comes.
        let mut ins: Vec<&Tensor> = Vec::new();
        let (mut to, mut from) = (Vec::new(), Vec::new());
        for ((peer, ts), src) in sends.iter().zip(recv_from) {
            ins.extend(ts);
            to.extend(ts.iter().map(|_| *peer));
            from.extend(ts.iter().map(|_| *src));
        }
        let mut outs: Vec<CudaStorage> = ins.iter().map(|t| self.alloc(t.dtype(), t.elem_count())).collect::<Result<_>>()?;
        let bytes: Vec<usize> = ins.iter().map(|t| t.elem_count() * t.dtype().size_in_bytes()).collect();
        // `with_ptrs` records the uses on the NCCL stream after the group end queued them.
        raw::with_ptrs(&self.stream, &ins, &mut outs.iter_mut().collect::<Vec<_>>(), |src, dst| {
            let sends = src.iter().zip(&bytes).zip(&to).map(|((&ptr, &bytes), &peer)| P2p::Send { ptr, bytes, peer });
            let recvs = dst.iter().zip(&bytes).zip(&from).map(|((&ptr, &bytes), &peer)| P2p::Recv { ptr, bytes, peer });
            self.p2p(&sends.chain(recvs).collect::<Vec<_>>())
        })??;
        self.family.track(&self.stream, what, &self.label)?;
        let done = self.done()?;
        let mut outs = outs.into_iter().zip(&ins).map(|(o, t)| raw::tensor(o, t.shape().clone()));
        let outs = sends.iter().map(|(_, ts)| outs.by_ref().take(ts.len()).collect()).collect();
        Ok((outs, done))
    }

    /// Queue on the NCCL stream a wait for everything queued so far on Candle's compute
    /// stream. Needed for every input: Candle passes the outputs of its own kernels to
    /// cudarc as read-only arguments, so cudarc records no write event for them and the
    /// per-buffer wait in `device_ptr` does not order NCCL after the kernel that wrote
    /// the buffer (NCCL read inputs before they were computed: issue 12).
    fn after_compute(&self) -> Result<()> {
        let compute = self.device.cuda_stream();
        if compute.cu_stream() != self.stream.cu_stream() {
            self.stream.join(&compute).w()?;
        }
        Ok(())
    }

    /// The point on the NCCL stream after the work just queued (None on Candle's stream).
    fn done(&self) -> Result<Done> {
        let compute = self.device.cuda_stream();
        if compute.cu_stream() == self.stream.cu_stream() {
            return Ok(Done(None));
        }
        Ok(Done(Some(raw::Mark::record(&self.stream, compute)?)))
    }

    /// Send each peer the signature of what we send it; what we receive from
    /// `recv_from[i]` must have the signature of `sends[i]`.
    fn check_signatures(&self, sends: &[(usize, Vec<Tensor>)], recv_from: &[usize], what: &str) -> Result<()> {
        let sig = |ts: &[Tensor]| -> i64 {
            use std::hash::{Hash, Hasher};
            let mut h = std::collections::hash_map::DefaultHasher::new();
            for t in ts {
                (t.dims(), t.dtype().as_str()).hash(&mut h);
            }
            (h.finish() >> 1) as i64
        };
        let mine: Vec<i64> = sends.iter().map(|(_, ts)| sig(ts)).collect();
        let probes: Vec<(usize, Vec<Tensor>)> = sends
            .iter()
            .zip(&mine)
            .map(|((peer, _), s)| Ok((*peer, vec![Tensor::new(&[*s], &Device::Cuda(self.device.clone()))?])))
            .collect::<Result<_>>()?;
        let check = NcclComm { check_shapes: false, ..self.shallow() };
        let (got, done) = check.exchange(&probes, recv_from, what)?;
        done.wait()?;
        for ((g, expect), from) in got.iter().zip(&mine).zip(recv_from) {
            let g = g[0].to_vec1::<i64>()?[0];
            if g != *expect {
                return self.failed(format!(
                    "{what}: rank {from} sends a message whose shapes/dtypes differ from what this rank sends back (NCCL needs them equal)"
                ));
            }
        }
        Ok(())
    }

    fn shallow(&self) -> NcclComm {
        NcclComm {
            handle: self.handle.clone(),
            family: self.family.clone(),
            rank: self.rank,
            world: self.world,
            label: self.label.clone(),
            device: self.device.clone(),
            stream: self.stream.clone(),
            check_shapes: self.check_shapes,
        }
    }

    /// One collective with a single input and a single fresh output of `out_elems`
    /// elements of the input's dtype.
    fn collective(
        &self,
        x: &Tensor,
        out_elems: usize,
        what: &str,
        call: impl FnOnce(*const c_void, *mut c_void, sys::ncclComm_t, sys::cudaStream_t) -> sys::ncclResult_t,
    ) -> Result<CudaStorage> {
        let calls = self.enter(what)?;
        self.stream.context().bind_to_thread().w()?;
        self.after_compute()?;
        let mut out = self.alloc(x.dtype(), out_elems)?;
        let r = raw::with_ptrs(&self.stream, &[x], &mut [&mut out], |src, dst| {
            call(src[0] as *const c_void, dst[0] as *mut c_void, self.handle.comm, self.stream.cu_stream() as _)
        })?;
        ok(r, what, self.handle.comm).or_else(|e| self.failed(e))?;
        self.family.track(&self.stream, what, &self.label)?;
        drop(calls);
        // The result is used at once: the compute stream waits for it here (also what
        // any consumer through raw pointers or another stream orders against).
        self.done()?.wait()?;
        Ok(out)
    }
}

/// Completion of queued NCCL work: `wait` makes Candle's compute stream wait for it (the
/// host does not block). Like PyTorch's `work.wait()`.
struct Done(Option<raw::Mark>);

impl Done {
    fn wait(self) -> Result<()> {
        match self.0 {
            Some(mark) => mark.wait(),
            None => Ok(()),
        }
    }
}

enum P2p {
    Send { ptr: u64, bytes: usize, peer: usize },
    Recv { ptr: u64, bytes: usize, peer: usize },
}

impl Comm for NcclComm {
    fn rank(&self) -> usize {
        self.rank
    }

    fn world(&self) -> usize {
        self.world
    }

    fn sendrecv_start(&self, send: Vec<Tensor>, to: usize, from: usize) -> Result<Pending> {
        if to >= self.world || from >= self.world {
            return crate::config_err!("sendrecv: peers {to}/{from} out of range for world {}", self.world);
        }
        let send = self.prepare(send, "sendrecv")?;
        let (mut got, done) = self.exchange(&[(to, send)], &[from], "sendrecv")?;
        let got = got.pop().unwrap_or_default();
        // Compute overlaps the transfer until the caller waits.
        Ok(Pending::new(move || {
            done.wait()?;
            Ok(got)
        }))
    }

    fn all_to_all(&self, xs: Vec<Tensor>) -> Result<Vec<Tensor>> {
        if xs.len() != self.world {
            return crate::config_err!("all_to_all: {} tensors for a world of {}", xs.len(), self.world);
        }
        let xs = self.prepare(xs, "all_to_all")?;
        let sends: Vec<(usize, Vec<Tensor>)> = xs.into_iter().enumerate().map(|(j, x)| (j, vec![x])).collect();
        let from: Vec<usize> = (0..self.world).collect();
        let (got, done) = self.exchange(&sends, &from, "all_to_all")?;
        done.wait()?;
        Ok(got.into_iter().flatten().collect())
    }

    fn all_reduce_sum(&self, x: &Tensor) -> Result<Tensor> {
        let x = self.prepare(vec![x.clone()], "all_reduce_sum")?.remove(0);
        let dt = nccl_dtype(x.dtype())?;
        let n = x.elem_count();
        let out = self.collective(&x, n, "all_reduce_sum (ncclAllReduce)", |s, d, c, st| {
            // SAFETY: s and d address n elements of dt on this GPU.
            unsafe { sys::ncclAllReduce(s, d, n, dt, sys::ncclRedOp_t::ncclSum, c, st) }
        })?;
        Ok(raw::tensor(out, x.shape().clone()))
    }

    fn all_gather(&self, x: &Tensor) -> Result<Vec<Tensor>> {
        let x = self.prepare(vec![x.clone()], "all_gather")?.remove(0);
        let n = x.elem_count();
        let bytes = n * x.dtype().size_in_bytes();
        let out = self.collective(&x, n * self.world, "all_gather (ncclAllGather)", |s, d, c, st| {
            // SAFETY: s has `bytes` bytes, d has world × bytes.
            unsafe { sys::ncclAllGather(s, d, bytes, sys::ncclDataType_t::ncclUint8, c, st) }
        })?;
        let all = raw::tensor(out, (self.world * n,)); // the buffer has at least 1 element
        (0..self.world).map(|j| all.narrow(0, j * n, n)?.reshape(x.shape())).collect()
    }

    fn reduce_scatter_sum(&self, xs: Vec<Tensor>) -> Result<Tensor> {
        if xs.len() != self.world {
            return crate::config_err!("reduce_scatter: {} tensors for a world of {}", xs.len(), self.world);
        }
        let xs = self.prepare(xs, "reduce_scatter")?;
        let shape = xs[0].shape().clone();
        if xs.iter().any(|x| x.shape() != &shape || x.dtype() != xs[0].dtype()) {
            return crate::shape_err!(
                "reduce_scatter: all parts must have one shape and dtype (NCCL), got {:?}",
                xs.iter().map(|x| x.dims().to_vec()).collect::<Vec<_>>()
            );
        }
        let n = shape.elem_count();
        let dt = nccl_dtype(xs[0].dtype())?;
        let flat: Vec<Tensor> = xs.iter().map(|x| x.flatten_all()).collect::<Result<_>>()?;
        let stacked = Tensor::cat(&flat, 0)?;
        let out = self.collective(&stacked, n, "reduce_scatter_sum (ncclReduceScatter)", |s, d, c, st| {
            // SAFETY: s has world × n elements, d has n.
            unsafe { sys::ncclReduceScatter(s, d, n, dt, sys::ncclRedOp_t::ncclSum, c, st) }
        })?;
        Ok(raw::tensor(out, shape))
    }

    fn barrier(&self) -> Result<()> {
        let one = Tensor::zeros(1, DType::F32, &Device::Cuda(self.device.clone()))?;
        let _ = self.all_reduce_sum(&one)?;
        self.stream.synchronize().w()?;
        self.alive()
    }

    fn sub(&self, ranks: &[usize]) -> Result<Arc<dyn Comm>> {
        self.alive()?;
        if ranks.is_empty() || ranks.windows(2).any(|w| w[0] >= w[1]) || ranks.iter().any(|&r| r >= self.world) {
            return crate::config_err!("sub: ranks {ranks:?} must be ascending, distinct and below {}", self.world);
        }
        let Some(pos) = ranks.iter().position(|&r| r == self.rank) else {
            return crate::config_err!("sub: ranks {ranks:?} do not contain this rank {}", self.rank);
        };
        let label: Arc<str> = if &*self.label == "the world" {
            Arc::from(format!("group {ranks:?}"))
        } else {
            Arc::from(format!("group {ranks:?} of {}", self.label))
        };
        let handle = {
            let _calls = self.enter("sub (ncclCommSplit)")?;
            self.stream.context().bind_to_thread().w()?;
            let mut child: sys::ncclComm_t = std::ptr::null_mut();
            // SAFETY: collective over all parent ranks (see the module doc); a null
            // config inherits the parent's.
            let r = unsafe { sys::ncclCommSplit(self.handle.comm, ranks[0] as i32, pos as i32, &mut child, std::ptr::null_mut()) };
            ok(r, "ncclCommSplit", self.handle.comm).or_else(|e| self.failed(e))?;
            if child.is_null() {
                return self.failed(format!("ncclCommSplit gave no communicator for group {ranks:?}"));
            }
            let handle = Handle::new(child, self.stream.clone());
            self.family.add(&handle);
            handle // `_calls` aborts it on release if the family failed meanwhile
        };
        self.alive()?;
        Ok(Arc::new(NcclComm {
            handle,
            family: self.family.clone(),
            rank: pos,
            world: ranks.len(),
            label,
            device: self.device.clone(),
            stream: self.stream.clone(),
            check_shapes: self.check_shapes,
        }))
    }

    fn abort(&self, reason: &str) {
        self.family.abort(reason, true);
    }
}
