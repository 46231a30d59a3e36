//! Memory planner: how much memory one GPU needs to train a Llama-family model at
//! sequence length `S` on `G` GPUs with a given parallel mode, whether that fits, and a
//! layout that does fit (mode, offloads, FPDT chunk size).
//!
//! The model follows what this crate's trainer and layer-wise engine actually keep
//! (see `train::engine` and `train::trainer`), with a fixed allowance for the rest.
//!
//! Notation: `P` parameters, `L` layers, `h` hidden, `i` intermediate, `V` vocabulary,
//! `hq`/`hkv` query/kv heads, `d` head dim, `b` micro-batch, `S` global tokens,
//! `W` ranks = `dp · sp`, `sp = U · R` (Ulysses × ring; zigzag: U = 1, ulysses/fpdt:
//! R = 1), `s = S / sp` local tokens per GPU, `c = min(token_chunk, s)`, `C` the FPDT chunk,
//! `a` bytes per element of the model dtype (bf16: 2), `hkv_U` kv heads per rank after
//! the Ulysses split (`hkv / U`, or 1 when kv heads are replicated because `U % hkv == 0`),
//! `e_q = b·s·hq·d`, `e_kv = b·s·hkv·d` (elements of local q and local k).
//!
//! Device memory per GPU (bytes):
//! ```text
//! weights            P·a                          model weights (every rank holds all)
//! gradients          4·P                          f32 gradient accumulators (engine)
//! optimizer          12·⌈P/W⌉                     f32 master + AdamW m, v, ZeRO-1 over all W ranks;
//!                                                 0 when the optimizer lives on the host
//! grad_reduce        4·P                          flat f32 gradient for the all-reduce
//!                                                 (optimizer step only)
//! saved_activations  L·b·s·h·a                    each layer's input, kept from forward
//!                                                 to backward; 0 when offloaded
//! saved_attention    L·((2·e_q + 2·e_kv)·a        with save_attention: each layer's q, k,
//!                      + 4·b·hq·s)                v, o and f32 LSE kept for the backward
//! layer_io           b·s·h·(8a + 12)              [b, s, h] tensors of one layer's
//!                    backward: input, norm output, attention output, residual, incoming
//!                    and outgoing gradients, and the grads of the two projections'
//!                    outputs (8 in the model dtype) + RMSNorm's f32 input, normalised
//!                    copy and its gradient (3 in f32)
//! attention_local    2·(2·e_q + 2·e_kv)·a         q, k, v, o of the local tokens and
//!                                                 their gradients
//! lse                4·b·hq·s                     the kernel's f32 log-sum-exp
//! attention_mode     mode-specific, see below
//! mlp_chunk          b·c·(2a·(4i + 2h) + 16h)     one token chunk of the MLP backward:
//!                    gate, up, act, product [c, i] and norm out, down out [c, h] with
//!                    their grads, + RMSNorm's f32 input/normalised copies with grads
//! head               2·b·c·V·(a + 4) + 2·b·s·h·a  one logits chunk (model dtype and f32
//!                    log-softmax, with grads) + the final hidden states and their grad
//! overhead           fixed (default 3 GB): CUDA context, cuBLAS/cuDNN workspaces, NCCL
//!                    buffers, allocator fragmentation
//! ```
//! Mode-specific attention memory (`ring(e_q, e_r) = 4·e_r·a + 16·e_r + 4·e_q`: k, v
//! double-buffered in flight, f32 dk/dv accumulators travelling and arriving, an f32
//! dq / o accumulator; `heads(e_q, e_h) = 2·(2·e_q + 2·e_h)·a`: the head-sharded q, o
//! and k, v after the all-to-all, with their gradients):
//! ```text
//! data_parallel      0
//! zigzag_ring_attn   ring(e_q, e_kv)
//! ulysses_attn       heads(e_q, b·S·hkv_U·d)                      U = sp
//! usp                heads(e_q, e_h) + ring(e_q, e_h),  e_h = b·(S/R)·hkv_U·d
//! fpdt               resident + parked (parked goes to the host with fpdt_offload)
//!   resident = 4·b·C·hkv_U·d·a     two kv chunks (k, v)
//!            + 3·b·C·(hq/U)·d·a    q, do, o of the current chunk
//!            + 8·b·C·hkv_U·d       f32 dk, dv of the current kv chunk
//!            + 4·b·C·(hq/U)·d      f32 dq of the current chunk
//!            + 4·b·(hq/U)·C        its lse
//!   parked   = 2·b·S·hkv_U·d·a + 3·e_q·a + 4·e_q + 4·b·hq·s   every chunk's k, v;
//!                                  q, do, o; f32 dq partials; lse
//! ```
//! Peaks: the layer transient (`layer_io + attention_local + lse + attention_mode +
//! mlp_chunk`) and the head transient are never alive together, so
//! ```text
//! transient     = max(layer transient, head)
//! peak_compute  = weights + gradients + optimizer + saved_activations + saved_attention
//!                 + transient + overhead
//! peak_step     = weights + gradients + grad_reduce + optimizer + overhead
//! peak          = max(peak_compute, peak_step)         fits ⇔ peak ≤ GPU memory
//! ```
//! Host memory per rank: the optimizer (12·⌈P/W⌉) and this rank's shard of the reduced
//! gradient (4·⌈P/W⌉) when on the host, offloaded saved activations, FPDT's parked
//! tensors with `fpdt_offload`, and the trainer's f32 copy of the start weights (4·P). Per node: times
//! the ranks per node. Host memory is checked only when given.
//!
//! Suggestion: the requested layout when it fits; otherwise the first layout that fits
//! with [`SUGGESTION_HEADROOM`] of the GPU to spare, in order of expected speed: without activation offload before with it; the smallest
//! sequence-parallel degree first (the rest data parallel); per degree ulysses_attn,
//! zigzag_ring_attn, usp (largest Ulysses degree first), then fpdt without and with
//! kv offload, with the largest power-of-two chunk that divides `S`, is a multiple of
//! `sp` and fits.
//!
//! Arithmetic is checked: a request too large for 64-bit byte counts is an error naming
//! the estimate, never a wrapped number.
//!
//! Every request is validated with the trainer's own rules ([`RunConfig::validate`]:
//! zigzag 2W divisibility, FPDT chunk layout, ...; [`ParallelDims::new`]: head split)
//! and no more ranks than GPUs ([`ParallelDims::check_devices`]).

use crate::dist::dims::{ParallelDims, ParallelMode};
use crate::model::LlamaConfig;
use crate::train::config::{RunConfig, Stage};
use crate::{Error, Result};
use serde::Serialize;
use std::path::Path;

/// Default fixed allowance per GPU (CUDA context, library workspaces, fragmentation).
pub const DEFAULT_OVERHEAD: u64 = 3_000_000_000;

/// A suggested layout (other than the request itself) must leave this fraction of the
/// GPU free: the model is an estimate, and a layout at 99% of memory is not a good tip.
pub const SUGGESTION_HEADROOM: f64 = 0.05;

/// The sizes of a model that memory depends on.
#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
pub struct ModelShape {
    pub params: u64,
    pub layers: usize,
    pub hidden: usize,
    pub intermediate: usize,
    pub heads: usize,
    pub kv_heads: usize,
    pub head_dim: usize,
    pub vocab: usize,
}

impl ModelShape {
    pub fn from_config(cfg: &LlamaConfig) -> Self {
        Self {
            params: param_count(cfg),
            layers: cfg.num_hidden_layers,
            hidden: cfg.hidden_size,
            intermediate: cfg.intermediate_size,
            heads: cfg.num_attention_heads,
            kv_heads: cfg.num_key_value_heads,
            head_dim: cfg.head_dim,
            vocab: cfg.vocab_size,
        }
    }
}

/// Parameters of a config, biases included, a tied head counted once (checked
/// arithmetic: [`crate::limits::param_count`]; a config that parsed is within
/// [`crate::limits::MAX_PARAMS`], so the saturation never shows).
pub fn param_count(cfg: &LlamaConfig) -> u64 {
    crate::limits::param_count(cfg).unwrap_or(u64::MAX)
}

/// What to plan for. [`PlanRequest::new`] fills the defaults of `longctx plan`.
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct PlanRequest {
    /// Global sequence length `S`.
    pub seq_len: usize,
    /// Sequences per micro-batch per data-parallel rank.
    pub batch_size: usize,
    /// GPUs in total (over all nodes).
    pub gpus: usize,
    /// Nodes the GPUs are spread over (equally).
    pub nnodes: usize,
    /// Ranks (processes, one GPU each); at most `gpus`.
    pub world: usize,
    /// Memory of one GPU, bytes.
    pub gpu_memory: u64,
    /// Host memory of one node, bytes (checked only when given).
    pub host_memory: Option<u64>,
    pub mode: ParallelMode,
    /// Sequence-parallel degree; `None` = all ranks for sequence-parallel modes.
    pub sp: Option<usize>,
    /// USP: Ulysses degree inside a ring group.
    pub ulysses: Option<usize>,
    pub fpdt_chunk: usize,
    pub fpdt_offload: bool,
    pub offload_activations: bool,
    /// Keep each layer's attention tensors for the backward (selective recomputation).
    pub save_attention: bool,
    pub token_chunk: usize,
    /// Bytes per element of the model dtype (bf16/f16: 2, f32: 4).
    pub dtype_bytes: usize,
    /// AdamW state (f32 master, m, v) in host memory (the trainer's choice) or on the GPU.
    pub optimizer_on_host: bool,
    /// Fixed allowance per GPU, bytes.
    pub overhead: u64,
}

impl PlanRequest {
    /// Defaults: one rank per GPU, micro-batch 1, bf16, optimizer on the host,
    /// FPDT chunk 65536, token chunk 4096, no offload, one node.
    pub fn new(seq_len: usize, gpus: usize, gpu_memory: u64, mode: ParallelMode) -> Self {
        Self {
            seq_len,
            batch_size: 1,
            gpus,
            nnodes: 1,
            world: gpus,
            gpu_memory,
            host_memory: None,
            mode,
            sp: None,
            ulysses: None,
            fpdt_chunk: 65536,
            fpdt_offload: false,
            offload_activations: false,
            save_attention: false,
            token_chunk: 4096,
            dtype_bytes: 2,
            optimizer_on_host: true,
            overhead: DEFAULT_OVERHEAD,
        }
    }

    /// The run config the trainer would validate for this request (one stage).
    fn run_config(&self) -> RunConfig {
        let mut c = RunConfig::default();
        c.parallel.mode = self.mode;
        c.parallel.world_size = self.world;
        c.parallel.sp_size = self.sp.unwrap_or(0);
        c.parallel.ulysses_size = self.ulysses.unwrap_or(1);
        c.parallel.fpdt_chunk_size = self.fpdt_chunk;
        c.parallel.fpdt_offload = self.fpdt_offload;
        c.parallel.offload_activations = self.offload_activations;
        c.parallel.save_attention = self.save_attention;
        c.parallel.token_chunk = self.token_chunk;
        c.train.batch_size = self.batch_size;
        c.stages = vec![Stage {
            seq_length: self.seq_len,
            rope_theta: 10_000.0,
            steps: 1,
            learning_rate: None,
            parallel_mode: None,
            fpdt_chunk_size: None,
        }];
        c
    }
}

/// The parallel layout of a request.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize)]
pub struct Layout {
    pub mode: ParallelMode,
    pub world: usize,
    pub dp: usize,
    pub sp: usize,
    pub ulysses: usize,
    pub ring: usize,
    /// Tokens of one sequence on one GPU (`S / sp`).
    pub local_tokens: usize,
}

/// Device memory of one GPU, bytes (see the module doc for each formula).
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize)]
pub struct DeviceMemory {
    pub weights: u64,
    pub gradients: u64,
    pub optimizer: u64,
    pub grad_reduce: u64,
    pub saved_activations: u64,
    pub saved_attention: u64,
    pub layer_io: u64,
    pub attention_local: u64,
    pub lse: u64,
    pub attention_mode: u64,
    pub mlp_chunk: u64,
    pub head: u64,
    pub overhead: u64,
    /// `layer_io + attention_local + lse + attention_mode + mlp_chunk`.
    pub layer_transient: u64,
    /// `max(layer_transient, head)`.
    pub transient: u64,
    pub peak_compute: u64,
    pub peak_step: u64,
    pub peak: u64,
}

/// Host memory, bytes.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize)]
pub struct HostMemory {
    pub optimizer: u64,
    pub saved_activations: u64,
    pub fpdt_parked: u64,
    /// The trainer's f32 copy of the start weights.
    pub weights_copy: u64,
    /// This rank's shard of the reduced gradient in f32 (optimizer on the host).
    pub grads_copy: u64,
    pub per_rank: u64,
    pub ranks_per_node: usize,
    pub per_node: u64,
}

/// The estimate for one request.
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct Estimate {
    pub layout: Layout,
    pub device: DeviceMemory,
    pub host: HostMemory,
    /// `device.peak ≤ gpu_memory`.
    pub fits_gpu: bool,
    /// `host.per_node ≤ host_memory` when host memory was given.
    pub fits_host: Option<bool>,
    pub fits: bool,
}

/// A layout that fits.
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct Suggestion {
    /// The request itself fits.
    pub as_requested: bool,
    pub mode: ParallelMode,
    pub sp: usize,
    pub ulysses: usize,
    pub fpdt_chunk: Option<usize>,
    pub fpdt_offload: bool,
    pub offload_activations: bool,
    /// Keep attention tensors for the backward: on whenever it still fits.
    pub save_attention: bool,
    /// Peak device memory of this layout, bytes.
    pub peak: u64,
}

/// Estimate, fit and suggestion.
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct Plan {
    pub model: ModelShape,
    pub request: PlanRequest,
    pub estimate: Estimate,
    pub suggestion: Option<Suggestion>,
}

/// Checks a request with the trainer's rules; returns its layout.
pub fn validate(model: &ModelShape, req: &PlanRequest) -> Result<Layout> {
    let flags = Path::new("<plan>");
    let bad = |field: &str, msg: String| Err(Error::config(flags, field, msg));
    if req.gpus == 0 {
        return bad("gpus", "must be at least 1".into());
    }
    crate::limits::check_range(flags, "gpus", req.gpus, 1, crate::limits::MAX_WORLD_SIZE)?;
    if req.nnodes == 0 || !req.gpus.is_multiple_of(req.nnodes) {
        return bad("nnodes", format!("{} GPUs cannot be spread equally over {} node(s)", req.gpus, req.nnodes));
    }
    if req.world == 0 || !req.world.is_multiple_of(req.nnodes) {
        return bad("world_size", format!("{} ranks cannot be spread equally over {} node(s)", req.world, req.nnodes));
    }
    if req.batch_size == 0 {
        return bad("batch_size", "must be at least 1".into());
    }
    if !matches!(req.dtype_bytes, 2 | 4) {
        return bad("dtype", format!("expected 2 (bf16/f16) or 4 (f32) bytes per element, got {}", req.dtype_bytes));
    }
    let setting = |field: &str, e: Error| match e {
        Error::Setting(m) => Error::config(flags, field, m),
        other => other,
    };
    ParallelDims::check_devices(req.world / req.nnodes, req.gpus / req.nnodes).map_err(|e| setting("world_size", e))?;
    req.run_config().validate(flags).map_err(|e| match e {
        // Name the request's field, not the synthetic stage's.
        Error::Config { file, field, msg } => {
            Error::Config { file, field: field.strip_prefix("stage[0].").unwrap_or(&field).to_string(), msg }
        }
        other => other,
    })?;
    let (sp, ulysses) = (req.sp.unwrap_or(0), req.ulysses.unwrap_or(1));
    let dims = ParallelDims::new(&req.mode.dims_request(req.world, sp, ulysses, model.heads, model.kv_heads))
        .map_err(|e| setting("parallel_mode", e))?;
    Ok(Layout {
        mode: dims.mode,
        world: dims.world,
        dp: dims.dp,
        sp: dims.sp,
        ulysses: dims.ulysses,
        ring: dims.ring,
        local_tokens: req.seq_len / dims.sp,
    })
}

/// kv heads per rank after splitting `hkv` over `u` Ulysses ranks (replicated when `u > hkv`).
fn kv_heads_per_rank(hkv: usize, u: usize) -> u64 {
    if hkv.is_multiple_of(u) {
        (hkv / u) as u64
    } else {
        1
    }
}

/// Every byte count below is computed with checked arithmetic: a request whose memory
/// does not fit in 64 bits is an error, never a wrapped number.
const WHAT: &str = "the memory estimate";

fn m(xs: &[u64]) -> Result<u64> {
    crate::limits::mul(WHAT, xs)
}

fn s(xs: &[u64]) -> Result<u64> {
    crate::limits::add(WHAT, xs)
}

/// Ring buffers: k, v double-buffered, f32 dk/dv travelling + arriving, f32 dq/o.
fn ring_bytes(e_q: u64, e_r: u64, a: u64) -> Result<u64> {
    s(&[m(&[4, e_r, a])?, m(&[16, e_r])?, m(&[4, e_q])?])
}

/// Head-sharded q, o and k, v with their gradients.
fn heads_bytes(e_q: u64, e_h: u64, a: u64) -> Result<u64> {
    m(&[2, s(&[m(&[2, e_q])?, m(&[2, e_h])?])?, a])
}

/// FPDT (resident on the device, parked where the offload flag says).
#[allow(clippy::too_many_arguments)]
fn fpdt_bytes(b: u64, seq: u64, sl: u64, chunk: u64, hq: u64, hkv_u: u64, u: u64, d: u64, a: u64) -> Result<(u64, u64)> {
    let hq_u = hq / u.max(1);
    let e_q = m(&[b, sl, hq, d])?;
    let resident = s(&[
        m(&[4, b, chunk, hkv_u, d, a])?,
        m(&[3, b, chunk, hq_u, d, a])?,
        m(&[8, b, chunk, hkv_u, d])?,
        m(&[4, b, chunk, hq_u, d])?,
        m(&[4, b, hq_u, chunk])?,
    ])?;
    let parked = s(&[m(&[2, b, seq, hkv_u, d, a])?, m(&[3, e_q, a])?, m(&[4, e_q])?, m(&[4, b, hq, sl])?])?;
    Ok((resident, parked))
}

/// Memory estimate of a request (validated first).
pub fn estimate(model: &ModelShape, req: &PlanRequest) -> Result<Estimate> {
    let lay = validate(model, req)?;
    let p = model.params;
    let (l, h, i, v) = (model.layers as u64, model.hidden as u64, model.intermediate as u64, model.vocab as u64);
    let (hq, hkv, d) = (model.heads as u64, model.kv_heads as u64, model.head_dim as u64);
    let (b, a) = (req.batch_size as u64, req.dtype_bytes as u64);
    let seq = req.seq_len as u64;
    let sl = lay.local_tokens as u64;
    let c = (req.token_chunk as u64).min(sl);
    let e_q = m(&[b, sl, hq, d])?;
    let e_kv = m(&[b, sl, hkv, d])?;
    let shard = p.div_ceil(lay.world as u64);
    let mut dev = DeviceMemory {
        weights: m(&[p, a])?,
        gradients: m(&[4, p])?,
        optimizer: if req.optimizer_on_host { 0 } else { m(&[12, shard])? },
        grad_reduce: m(&[4, p])?,
        layer_io: m(&[b, sl, h, s(&[m(&[8, a])?, 12])?])?,
        attention_local: m(&[2, s(&[m(&[2, e_q])?, m(&[2, e_kv])?])?, a])?,
        lse: m(&[4, b, hq, sl])?,
        mlp_chunk: m(&[b, c, s(&[m(&[2, a, s(&[m(&[4, i])?, m(&[2, h])?])?])?, m(&[16, h])?])?])?,
        head: s(&[m(&[2, b, c, v, a + 4])?, m(&[2, b, sl, h, a])?])?,
        overhead: req.overhead,
        ..Default::default()
    };
    let saved = m(&[l, b, sl, h, a])?;
    let mut host = HostMemory {
        optimizer: if req.optimizer_on_host { m(&[12, shard])? } else { 0 },
        weights_copy: m(&[4, p])?,
        grads_copy: if req.optimizer_on_host { m(&[4, shard])? } else { 0 },
        ..Default::default()
    };
    if req.offload_activations {
        host.saved_activations = saved;
    } else {
        dev.saved_activations = saved;
    }
    if req.save_attention {
        dev.saved_attention = m(&[l, s(&[m(&[s(&[m(&[2, e_q])?, m(&[2, e_kv])?])?, a])?, m(&[4, b, hq, sl])?])?])?;
    }
    dev.attention_mode = attention_mode_bytes(model, req, &lay, &mut host, (e_q, e_kv, b, seq, sl, d, a))?;
    finish_estimate(lay, dev, host, req)
}

/// The mode-specific attention memory on the device (FPDT's parked tensors go to `host`
/// with `fpdt_offload`).
fn attention_mode_bytes(
    model: &ModelShape,
    req: &PlanRequest,
    lay: &Layout,
    host: &mut HostMemory,
    (e_q, e_kv, b, seq, sl, d, a): (u64, u64, u64, u64, u64, u64, u64),
) -> Result<u64> {
    let (u, r) = (lay.ulysses as u64, lay.ring as u64);
    let hkv_u = kv_heads_per_rank(model.kv_heads, lay.ulysses);
    Ok(match lay.mode {
        ParallelMode::DataParallel => 0,
        ParallelMode::ZigzagRingAttn => ring_bytes(e_q, e_kv, a)?,
        ParallelMode::UlyssesAttn => heads_bytes(e_q, m(&[b, seq, hkv_u, d])?, a)?,
        ParallelMode::Usp => {
            let e_h = m(&[b, seq / r.max(1), hkv_u, d])?;
            s(&[heads_bytes(e_q, e_h, a)?, ring_bytes(e_q, e_h, a)?])?
        }
        ParallelMode::Fpdt => {
            let (resident, parked) = fpdt_bytes(b, seq, sl, req.fpdt_chunk as u64, model.heads as u64, hkv_u, u, d, a)?;
            if req.fpdt_offload {
                host.fpdt_parked = parked;
                resident
            } else {
                s(&[resident, parked])?
            }
        }
    })
}

/// Peaks and fit from the parts (see the module doc).
fn finish_estimate(lay: Layout, mut dev: DeviceMemory, mut host: HostMemory, req: &PlanRequest) -> Result<Estimate> {
    dev.layer_transient = s(&[dev.layer_io, dev.attention_local, dev.lse, dev.attention_mode, dev.mlp_chunk])?;
    dev.transient = dev.layer_transient.max(dev.head);
    let base = s(&[dev.weights, dev.gradients, dev.optimizer, dev.overhead])?;
    dev.peak_compute = s(&[base, dev.saved_activations, dev.saved_attention, dev.transient])?;
    dev.peak_step = s(&[base, dev.grad_reduce])?;
    dev.peak = dev.peak_compute.max(dev.peak_step);
    host.per_rank = s(&[host.optimizer, host.saved_activations, host.fpdt_parked, host.weights_copy, host.grads_copy])?;
    host.ranks_per_node = req.world / req.nnodes;
    host.per_node = m(&[host.per_rank, host.ranks_per_node as u64])?;
    let fits_gpu = dev.peak <= req.gpu_memory;
    let fits_host = req.host_memory.map(|mem| host.per_node <= mem);
    Ok(Estimate { layout: lay, device: dev, host, fits_gpu, fits_host, fits: fits_gpu && fits_host.unwrap_or(true) })
}

/// Divisors of `n`, ascending.
fn divisors(n: usize) -> Vec<usize> {
    (1..=n).filter(|&k| n.is_multiple_of(k)).collect()
}

/// FPDT chunk sizes to try: powers of two dividing `seq`, multiples of `sp`, largest first.
pub fn fpdt_chunk_candidates(seq: usize, sp: usize) -> Vec<usize> {
    let mut out: Vec<usize> = (0..usize::BITS)
        .map(|k| 1usize << k)
        .take_while(|&c| c <= seq)
        .filter(|&c| seq.is_multiple_of(c) && c.is_multiple_of(sp))
        .collect();
    out.reverse();
    out
}

/// The layouts the suggestion tries, in order of preference (see the module doc).
fn candidates(req: &PlanRequest) -> Vec<PlanRequest> {
    let mut out = Vec::new();
    for offload in [false, true] {
        for sp in divisors(req.world) {
            let base = PlanRequest { offload_activations: offload, sp: Some(sp), ulysses: None, fpdt_offload: false, ..req.clone() };
            if sp == 1 {
                out.push(PlanRequest { mode: ParallelMode::DataParallel, sp: None, ..base });
                continue;
            }
            out.push(PlanRequest { mode: ParallelMode::UlyssesAttn, ..base.clone() });
            out.push(PlanRequest { mode: ParallelMode::ZigzagRingAttn, ..base.clone() });
            for u in divisors(sp).into_iter().rev().filter(|&u| u > 1 && u < sp) {
                out.push(PlanRequest { mode: ParallelMode::Usp, ulysses: Some(u), ..base.clone() });
            }
            for fpdt_offload in [false, true] {
                for chunk in fpdt_chunk_candidates(req.seq_len, sp) {
                    out.push(PlanRequest { mode: ParallelMode::Fpdt, fpdt_chunk: chunk, fpdt_offload, ..base.clone() });
                }
            }
        }
    }
    out
}

/// A layout that fits: the request itself when it does, else the first candidate that
/// validates and fits. `None` when nothing fits on these GPUs.
pub fn suggest(model: &ModelShape, req: &PlanRequest) -> Option<Suggestion> {
    let mk = |r: &PlanRequest, e: &Estimate, as_requested: bool| Suggestion {
        as_requested,
        mode: e.layout.mode,
        sp: e.layout.sp,
        ulysses: e.layout.ulysses,
        fpdt_chunk: (e.layout.mode == ParallelMode::Fpdt).then_some(r.fpdt_chunk),
        fpdt_offload: e.layout.mode == ParallelMode::Fpdt && r.fpdt_offload,
        offload_activations: r.offload_activations,
        save_attention: r.save_attention,
        peak: e.device.peak,
    };
    let budget = (req.gpu_memory as f64 * (1.0 - SUGGESTION_HEADROOM)) as u64;
    // Saving the attention is faster (no attention forward in the backward): take it when
    // it fits with the headroom, and keep what was asked otherwise.
    let with_saved = |r: &PlanRequest| -> PlanRequest {
        let on = PlanRequest { save_attention: true, ..r.clone() };
        match estimate(model, &on) {
            Ok(e) if e.fits && e.device.peak <= budget => on,
            _ => r.clone(),
        }
    };
    if let Ok(e) = estimate(model, req) {
        if e.fits {
            let r = with_saved(req);
            let e = if r.save_attention != req.save_attention { estimate(model, &r).unwrap_or(e) } else { e };
            return Some(mk(&r, &e, true));
        }
    }
    candidates(req).iter().find_map(|r| {
        let r = with_saved(r);
        estimate(model, &r).ok().filter(|e| e.fits && e.device.peak <= budget).map(|e| mk(&r, &e, false))
    })
}

/// Estimate and suggestion for a request (errors when the request itself is invalid).
pub fn plan(model: &ModelShape, req: &PlanRequest) -> Result<Plan> {
    let estimate = estimate(model, req)?;
    let suggestion = suggest(model, req);
    Ok(Plan { model: model.clone(), request: req.clone(), estimate, suggestion })
}

/// Checks a run config against its model: the head split of every stage's mode
/// ([`ParallelDims::new`], as the trainer will build it). Stages may differ in their
/// data-parallel size: the optimizer is sharded over all ranks, not over data-parallel
/// replicas. `source` names the config.
pub fn check_run(cfg: &RunConfig, model: &LlamaConfig, source: &Path) -> Result<()> {
    for (i, st) in cfg.stages.iter().enumerate() {
        let mode = st.parallel_mode.unwrap_or(cfg.parallel.mode);
        let field = if st.parallel_mode.is_some() { format!("stage[{i}].parallel_mode") } else { "parallel.mode".to_string() };
        let p = &cfg.parallel;
        let req = mode.dims_request(p.world_size, p.sp_size, p.ulysses_size, model.num_attention_heads, model.num_key_value_heads);
        ParallelDims::new(&req).map_err(|e| {
            let msg = match e {
                Error::Setting(m) => m,
                other => other.to_string(),
            };
            Error::config(
                source,
                &field,
                format!(
                    "{msg} (model: {} query heads, {} kv heads; world_size {})",
                    model.num_attention_heads, model.num_key_value_heads, cfg.parallel.world_size
                ),
            )
        })?;
    }
    Ok(())
}

/// A byte size: an integer (bytes) or a number with a unit, decimal `KB`, `MB`, `GB`,
/// `TB` (powers of 1000, as transformers' `max_shard_size`) or binary `KiB`, `MiB`,
/// `GiB`, `TiB`; case-insensitive, `B` optional (`5G` = `5GB`).
pub fn parse_size(s: &str) -> std::result::Result<u64, String> {
    let t = s.trim();
    let split = t.find(|c: char| !(c.is_ascii_digit() || c == '.')).unwrap_or(t.len());
    let (num, unit) = (&t[..split], t[split..].trim());
    let mult: f64 = match unit.to_ascii_lowercase().as_str() {
        "" | "b" => 1.0,
        "k" | "kb" => 1e3,
        "m" | "mb" => 1e6,
        "g" | "gb" => 1e9,
        "t" | "tb" => 1e12,
        "kib" => 1024.0,
        "mib" => 1024.0 * 1024.0,
        "gib" => 1024.0 * 1024.0 * 1024.0,
        "tib" => 1024.0 * 1024.0 * 1024.0 * 1024.0,
        _ => return Err(format!("`{s}`: unknown unit `{unit}` (expected bytes or a number with KB, MB, GB, TB, KiB, MiB, GiB, TiB)")),
    };
    let x: f64 = num.parse().map_err(|_| format!("`{s}`: expected a size such as 5GB, 500MB, 80GiB or a byte count"))?;
    let bytes = x * mult;
    if bytes.is_nan() || bytes < 1.0 || !bytes.is_finite() || bytes > u64::MAX as f64 {
        return Err(format!("`{s}`: must be at least 1 byte"));
    }
    Ok(bytes.round() as u64)
}

/// A token count: an integer or a number with `K` (×1024) or `M` (×1024²), as long-context
/// recipes name lengths (`512K` = 524288).
pub fn parse_tokens(s: &str) -> std::result::Result<usize, String> {
    let t = s.trim();
    let (num, mult) = match t.chars().last().map(|c| c.to_ascii_uppercase()) {
        Some('K') => (&t[..t.len() - 1], 1024usize),
        Some('M') => (&t[..t.len() - 1], 1024 * 1024),
        _ => (t, 1),
    };
    match num.parse::<usize>() {
        Ok(n) if n > 0 => n.checked_mul(mult).ok_or_else(|| format!("`{s}`: too large")),
        _ => Err(format!("`{s}`: expected a positive token count such as 65536, 64K or 1M")),
    }
}

/// `bytes` in GB (10⁹ bytes) with two decimals.
pub fn gb(bytes: u64) -> String {
    format!("{:.2}", bytes as f64 / 1e9)
}

/// A token count as recipes write it (`524288` → `512K`, `1048576` → `1M`).
pub fn tokens_label(n: usize) -> String {
    if n >= 1 << 20 && n.is_multiple_of(1 << 20) {
        format!("{}M", n >> 20)
    } else if n >= 1024 && n.is_multiple_of(1024) {
        format!("{}K", n >> 10)
    } else {
        n.to_string()
    }
}
