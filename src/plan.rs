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
//! Device memory per GPU (bytes), from the shapes the engine allocates (the layer
//! transient is `train::layer_grad::LayerShape`, the same function the engine reports
//! its transient memory with):
//! ```text
//! weights            P·a                          model weights (every rank holds all)
//! gradients          4·W·L                        the flat f32 gradient buffer (L = ⌈P/W⌉)
//! optimizer          12·L                         f32 master + AdamW m, v, ZeRO-1 over all W
//!                                                 ranks; 0 when the optimizer lives on the host
//! grad_reduce        W = 1: 4·2²⁶                 optimizer step only: one slice of the
//!                    W > 1: (4 + a)·L + 2·P·a     gradient norm's squares; with several ranks
//!                                                 the reduce-scattered f32 shard, its new
//!                                                 weights and their all-gather (parts, joined)
//! saved_activations  L·b·s·h·a                    each layer's input; 0 when offloaded
//!                                                 (offload_activations or offload_layer_inputs)
//! saved_attention    L·core                       with save_attention: each layer's q, k, v, o
//!                                                 and f32 LSE; 0 when offloaded with the inputs
//!   core = (2·e_q + 2·e_kv)·a + 4·b·hq·s
//! saved_mlp          L_mlp·mlp                    with save_mlp: each layer's MLP input and
//!   mlp = b·s·(h + 2i)·a                          gate and up projections; 0 when offloaded;
//!                                                 L_mlp = L, or save_mlp_layers (the top ones)
//! in_flight          offloaded: 2·(b·s·h·a        the layer's input and the one below it,
//!                    (+ core + mlp))              brought back ahead (and what they saved;
//!                                                 the inputs alone with offload_layer_inputs)
//! layer_backward     b·s·h·a + core + (2·e_q + 2·e_kv)·a + chunk
//!                    (core left out when saved: counted above)   the incoming gradient
//!                    (overwritten with the outgoing one), the attention core and its
//!                    gradients; chunk = b·c·(6i + 6h)·a + 8·b·c: one token chunk's MLP
//!                    and norm intermediates (`LayerShape::backward_bytes`)
//! attention_work     8·b·s·hq·d                   the fused attention backward's f32
//!                                                 accumulators (cuDNN's workspace, measured on
//!                                                 H200; the native backward's, 4·b·hq·s'·(d+2)
//!                                                 with s' = s rounded up to 64, fits in it)
//! attention_mode     mode-specific, see below
//! head               2·b·s·h·a + b·c·(V + 4h)·a   the top hidden and its gradient, one
//!                                                 logits chunk (its gradient written over it)
//!                                                 and the chunk's hidden rows
//! overhead           fixed (default 3 GB): CUDA context, cuBLAS/cuDNN handles, NCCL
//!                    buffers, allocator fragmentation — outside the memory pool
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
//! Peaks (the layer's backward and the head are never alive together):
//! ```text
//! static        = weights + gradients + optimizer
//! layer         = in_flight + layer_backward + attention_work + attention_mode
//! head'         = head + (offloaded: one layer's group brought back, its input alone with
//!                 offload_layer_inputs)
//! pool_peak     = max(static + saved_activations + saved_attention + saved_mlp + max(layer, head'),
//!                     static + grad_reduce)       what the CUDA memory pool holds at most
//! peak          = pool_peak + overhead            fits ⇔ peak ≤ GPU memory
//! ```
//! `pool_peak` is what a run's `device_peak_bytes` (the pool's high-water mark) measures;
//! `scripts/gpu_long_check.sh` compares the two (within 10 % on an H200 from 16K to 1M).
//! Host memory per rank: the optimizer (12·⌈P/W⌉) and this rank's shard of the reduced
//! gradient (4·⌈P/W⌉) when on the host, offloaded saved activations, FPDT's parked
//! tensors with `fpdt_offload`, and the trainer's f32 copy of the start weights (4·P; freed before
//! the first step, so the larger of it and the two before is counted). Per node: times
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

use crate::model::LlamaConfig;
use crate::parallel::dims::{ParallelDims, ParallelMode};
use crate::train::config::{RunConfig, Stage};
use crate::train::layer_grad::LayerShape;
use crate::{Error, Result};
use serde::Serialize;
use std::path::Path;

/// Default fixed allowance per GPU (CUDA context, library workspaces, fragmentation).
pub const DEFAULT_OVERHEAD: u64 = 3_000_000_000;

/// A suggested layout (other than the request itself) must leave this fraction of the
/// GPU free: the model is an estimate, and a layout at 99% of memory is not a good tip.
pub const SUGGESTION_HEADROOM: f64 = 0.05;

/// Memory of one GPU where none is named or at hand: an H200 as its driver reports it
/// (143,771 MiB = 150.8 GB; the datasheet's "141 GB" is about its GiB).
pub const DEFAULT_GPU_MEMORY: u64 = 143_771 * 1024 * 1024;
/// [`DEFAULT_GPU_MEMORY`] as the command line's default value.
pub const DEFAULT_GPU_MEMORY_ARG: &str = "143771MiB";

/// The sizes of a model that memory depends on.
#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
pub struct ModelShape {
    pub params: u64,
    /// Parameters of one decoder layer (the largest ZeRO unit but for embedding and head).
    pub layer_params: u64,
    pub layers: usize,
    pub hidden: usize,
    pub intermediate: usize,
    pub heads: usize,
    pub kv_heads: usize,
    pub head_dim: usize,
    pub vocab: usize,
    /// The head shares the embedding's weights (`tie_word_embeddings`): the last ZeRO unit
    /// is the final norm alone.
    pub tied_head: bool,
}

impl ModelShape {
    pub fn from_config(cfg: &LlamaConfig) -> Self {
        Self {
            params: param_count(cfg),
            layer_params: cfg.layer_param_count().unwrap_or(u64::MAX),
            layers: cfg.num_hidden_layers,
            hidden: cfg.hidden_size,
            intermediate: cfg.intermediate_size,
            heads: cfg.num_attention_heads,
            kv_heads: cfg.num_key_value_heads,
            head_dim: cfg.head_dim,
            vocab: cfg.vocab_size,
            tied_head: cfg.tie_word_embeddings,
        }
    }
}

/// Parameters of a config, biases included, a tied head counted once (checked
/// arithmetic: [`LlamaConfig::param_count`]; a config that parsed is within
/// [`crate::limits::MAX_PARAMS`], so the saturation never shows).
pub fn param_count(cfg: &LlamaConfig) -> u64 {
    cfg.param_count().unwrap_or(u64::MAX)
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
    /// Only the layer inputs in host memory (`parallel.offload_layer_inputs`).
    pub offload_layer_inputs: bool,
    /// Keep each layer's attention tensors for the backward (selective recomputation).
    pub save_attention: bool,
    /// Keep each layer's MLP input and gate/up projections for the backward.
    pub save_mlp: bool,
    /// Keep them for the top this many layers only (`parallel.save_mlp_layers`).
    pub save_mlp_layers: Option<usize>,
    pub token_chunk: usize,
    /// Bytes per element of the model dtype (bf16/f16: 2, f32: 4).
    pub dtype_bytes: usize,
    /// AdamW state (f32 master, m, v) in host memory (the trainer's choice) or on the GPU.
    pub optimizer_on_host: bool,
    /// With `optimizer_on_host`: the first units whose state stays on the GPU
    /// (`train.optimizer_device_units`).
    pub optimizer_device_units: usize,
    /// ZeRO stage (0–3, `train.zero_stage`): what is sharded over the ranks.
    pub zero_stage: u8,
    /// Stage 3's slice of the weights in host memory (`train.offload_params`).
    pub offload_params: bool,
    /// Each unit's f32 gradient slice in host memory once the backward is done with it
    /// (`train.offload_gradients`; stage 2 or 3 with the host optimizer).
    pub offload_gradients: bool,
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
            offload_layer_inputs: false,
            save_attention: false,
            save_mlp: false,
            save_mlp_layers: None,
            token_chunk: 4096,
            dtype_bytes: 2,
            optimizer_on_host: true,
            optimizer_device_units: 0,
            zero_stage: 1,
            offload_params: false,
            offload_gradients: false,
            overhead: DEFAULT_OVERHEAD,
        }
    }

    /// What of each layer's saved tensors goes to host memory (`offload_activations` wins).
    pub fn offload(&self) -> crate::train::offload::Offload {
        crate::train::offload::Offload::of(self.offload_activations, self.offload_layer_inputs)
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
        c.parallel.offload_layer_inputs = self.offload_layer_inputs;
        c.parallel.save_attention = self.save_attention;
        c.parallel.save_mlp = self.save_mlp;
        c.parallel.save_mlp_layers = self.save_mlp_layers;
        c.parallel.token_chunk = self.token_chunk;
        c.train.batch_size = self.batch_size;
        c.train.zero_stage = self.zero_stage;
        c.train.offload_params = self.offload_params;
        c.train.offload_gradients = self.offload_gradients;
        c.train.optimizer_on_host = self.optimizer_on_host;
        c.train.optimizer_device_units = self.optimizer_device_units;
        c.stages = vec![Stage::new(self.seq_len, 10_000.0, 1)];
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
    pub saved_mlp: u64,
    pub in_flight: u64,
    pub layer_backward: u64,
    pub attention_work: u64,
    pub attention_mode: u64,
    pub head: u64,
    pub overhead: u64,
    /// `in_flight + layer_backward + attention_work + attention_mode`.
    pub layer_transient: u64,
    /// `head` plus, when offloading, one layer's group brought back.
    pub head_transient: u64,
    /// `max(layer_transient, head_transient)`.
    pub transient: u64,
    pub peak_compute: u64,
    pub peak_step: u64,
    /// What the CUDA memory pool holds at most: `max(peak_compute, peak_step)`.
    pub pool_peak: u64,
    /// `pool_peak + overhead`.
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
    /// The host optimizer's pinned pieces of the reduced gradient in f32 (a piece and the
    /// next; three units' slices when the update is deferred into the next forward) and a
    /// piece of its new weights (optimizer on the host).
    pub grads_copy: u64,
    /// This rank's slice of the weights (stage 3 with `offload_params`).
    pub weights: u64,
    /// This rank's f32 gradient slices of the units whose optimizer state is on the host
    /// (`offload_gradients`; page-locked).
    pub gradients: u64,
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
    /// Only the layer inputs in host memory (as requested; never added by the suggestion).
    pub offload_layer_inputs: bool,
    /// Keep attention tensors for the backward: on whenever it still fits.
    pub save_attention: bool,
    /// Keep the MLP's input and gate/up projections for the backward: on whenever it
    /// still fits (after the attention).
    pub save_mlp: bool,
    /// For the top this many layers only, when not every layer's fits (`None`: all).
    pub save_mlp_layers: Option<usize>,
    /// The memory levers: the optimizer state on the host, the ZeRO stage, the weights
    /// on the host (what was asked, unless nothing fit without them).
    pub optimizer_on_host: bool,
    pub zero_stage: u8,
    pub offload_params: bool,
    /// The last lever: each layer's f32 gradient in host memory (`offload_gradients`).
    pub offload_gradients: bool,
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
    if let Some(n) = req.save_mlp_layers {
        if n == 0 || n > model.layers {
            return bad("save_mlp_layers", format!("got {n}, expected 1 to the model's {} layers", model.layers));
        }
    }
    let units = if req.zero_stage >= 2 { model.layers + 2 } else { 1 };
    if req.optimizer_device_units > units {
        return bad(
            "optimizer_device_units",
            format!(
                "got {}, but the model has {units} ZeRO unit(s) under stage {} (the embedding, one per decoder layer, the norm \
                 with the head; stages 0-1: one); give at most {units}",
                req.optimizer_device_units, req.zero_stage
            ),
        );
    }
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

/// Ring buffers: k, v double-buffered, f32 dk/dv travelling + arriving, f32 dq/o.
fn ring_bytes(e_q: u128, e_r: u128, a: u128) -> u128 {
    4 * e_r * a + 16 * e_r + 4 * e_q
}

/// Head-sharded q, o and k, v with their gradients.
fn heads_bytes(e_q: u128, e_h: u128, a: u128) -> u128 {
    2 * (2 * e_q + 2 * e_h) * a
}

/// FPDT (resident on the device, parked where the offload flag says).
#[allow(clippy::too_many_arguments)]
fn fpdt_bytes(b: u128, seq: u128, s: u128, chunk: u128, hq: u128, hkv_u: u128, u: u128, d: u128, a: u128) -> (u128, u128) {
    let hq_u = hq / u;
    let e_q = b * s * hq * d;
    let resident = 4 * b * chunk * hkv_u * d * a
        + 3 * b * chunk * hq_u * d * a
        + 8 * b * chunk * hkv_u * d
        + 4 * b * chunk * hq_u * d
        + 4 * b * hq_u * chunk;
    let parked = 2 * b * seq * hkv_u * d * a + 3 * e_q * a + 4 * e_q + 4 * b * hq * s;
    (resident, parked)
}

/// Memory estimate of a request (validated first).
pub fn estimate(model: &ModelShape, req: &PlanRequest) -> Result<Estimate> {
    let lay = validate(model, req)?;
    let (dev, host) = device_and_host(model, req, &lay).ok_or_else(|| {
        Error::Setting(format!(
            "the memory estimate does not fit in 64 bits: some size (layers, width, vocabulary, length, batch or ranks) \
             is far too large ({} tokens × batch {})",
            req.seq_len, req.batch_size
        ))
    })?;
    let fits_gpu = dev.peak <= req.gpu_memory;
    let fits_host = req.host_memory.map(|m| host.per_node <= m);
    Ok(Estimate { layout: lay, device: dev, host, fits_gpu, fits_host, fits: fits_gpu && fits_host.unwrap_or(true) })
}

/// The formulas of the module doc, in u128 (no silent overflow); `None` when a figure
/// does not fit u64.
fn device_and_host(model: &ModelShape, req: &PlanRequest, lay: &Layout) -> Option<(DeviceMemory, HostMemory)> {
    let u = |x: usize| x as u128;
    let p = model.params as u128;
    let l = u(model.layers);
    let (a, w) = (u(req.dtype_bytes), u(lay.world));
    // ZeRO (`train::zero::units`): stage 0 keeps the whole optimizer state on every rank; from
    // stage 2 the units are the layers, the embedding and the head, each cut in `w`.
    let (h, v) = (u(model.hidden), u(model.vocab));
    let units = l + 2;
    // The last unit: the final norm, with the head unless it is tied to the embedding.
    let head_unit = if model.tied_head { h } else { v * h + h };
    // The largest unit (gathered whole under stage 3), and the largest after the
    // embedding's (the gradient scratch of several ranks).
    let after_embedding = u128::from(model.layer_params).max(head_unit);
    let unit_max = after_embedding.max(v * h);
    let zero = req.zero_stage;
    let shard = if zero >= 2 { p.div_ceil(w) + units } else { p.div_ceil(w) };
    let opt_elems = if zero == 0 { p } else { shard };
    // The engine's own byte counts for these shapes.
    let shape = LayerShape {
        batch: req.batch_size,
        tokens: lay.local_tokens,
        chunk: req.token_chunk,
        hidden: model.hidden,
        intermediate: model.intermediate,
        heads: model.heads,
        kv_heads: model.kv_heads,
        head_dim: model.head_dim,
        vocab: model.vocab,
        elem: req.dtype_bytes,
    };
    let (core, input) = (shape.core_bytes(), shape.input_bytes());
    let mlp = shape.mlp_bytes();
    let saved_attn = if req.save_attention { l * core } else { 0 };
    // The top `l_mlp` layers keep their MLP tensors; a layer group (brought back when
    // offloaded) is counted at its largest.
    let l_mlp = u(mlp_layers(model, req));
    let saved_mlp = l_mlp * mlp;
    let group = input + if req.save_attention { core } else { 0 } + if l_mlp > 0 { mlp } else { 0 };
    let on_host = req.optimizer_on_host;
    // What goes to host memory: the layer inputs, and (everything offloaded) the rest of
    // each group; `parked` of one group.
    let (off_inputs, off) = (req.offload().inputs(), req.offload().all());
    let parked = if off {
        group
    } else if off_inputs {
        input
    } else {
        0
    };
    let piece = opt_elems.min(u(crate::train::zero::HOST_PIECE)); // the host optimizer's piece
    let offload_params = zero == 3 && req.offload_params;
    // This rank's slice of each ZeRO unit (`zero::units`): from stage 2 the embedding, every
    // layer, then the final norm with the head (the norm alone when tied); below, one
    // unit, the whole slice. A split placement keeps the first `optimizer_device_units` of
    // them on the GPU.
    let unit_slices: Vec<u128> = if zero >= 2 {
        let layer = u128::from(model.layer_params).div_ceil(w);
        std::iter::once((v * h).div_ceil(w)).chain(std::iter::repeat_n(layer, model.layers)).chain([head_unit.div_ceil(w)]).collect()
    } else {
        vec![opt_elems]
    };
    let on_dev = req.optimizer_device_units.min(unit_slices.len());
    let all_on_device = on_dev == unit_slices.len();
    let dev_elems: u128 = unit_slices[..on_dev].iter().sum();
    // The host update's pinned f32 gradient pieces (`ShardedAdamW::pinned_piece_bytes`, the
    // engine's own `peak_pieces` over the host units' slices): deferred (weights and state on
    // the host) three units' pieces in flight, otherwise a piece and the next; and, not
    // deferred, a piece of new weights in the run dtype.
    let offload_grads = req.offload_gradients && zero >= 2 && on_host;
    let host_grads = if offload_grads { shard - dev_elems.min(shard) } else { 0 };
    let grads_copy = if offload_grads {
        // No gradient pieces; an update at once (the weights not on the host) rounds a
        // whole unit's new weights into one buffer.
        if offload_params || all_on_device {
            0
        } else {
            a * unit_max
        }
    } else if on_host && !all_on_device {
        let shards = unit_slices[on_dev..].iter().map(|&n| usize::try_from(n).ok()).collect::<Option<Vec<usize>>>()?;
        let pieces = crate::train::zero::peak_pieces(&shards, crate::train::zero::HOST_PIECE, offload_params);
        4 * pieces.iter().map(|&(len, k)| len as u128 * k as u128).sum::<u128>() + if offload_params { 0 } else { a * piece }
    } else {
        0
    };
    let mut host = HostMemory {
        optimizer: cvt(if on_host { 12 * opt_elems } else { 0 })?,
        saved_activations: cvt(if off_inputs { l * input } else { 0 } + if off { saved_attn + saved_mlp } else { 0 })?,
        weights_copy: cvt(4 * p)?,
        grads_copy: cvt(grads_copy)?,
        weights: cvt(if offload_params { shard * a } else { 0 })?,
        gradients: cvt(4 * host_grads)?,
        ..Default::default()
    };
    let attention_mode = attention_mode_bytes(model, req, lay, &mut host)?;
    // Stage 3: this rank's slice (unless offloaded) and two whole units (the one running,
    // the next coming); below, the whole model.
    let weights = match (zero, offload_params) {
        (3, true) => 2 * unit_max * a,
        (3, false) => shard * a + 2 * unit_max * a,
        _ => p * a,
    };
    // Stage 2 and 3: this rank's slice, the embedding's scratch and one unit's, each a whole
    // unit (the reduce-scatter's input; one rank: the slice only, written in place).
    // With the gradients in host memory the device keeps the device units' slices and,
    // one rank, two turns (each the largest host unit of its parity; and the embedding's
    // slice when it is a host unit); several ranks, the scratch as before and three reduced
    // slices in flight; and, from a step's second micro-batch, one slice brought back.
    let host_slice_max = unit_slices.iter().skip(on_dev).copied().max().unwrap_or(0);
    let gradients = match (zero >= 2, w, offload_grads) {
        (true, 1, true) => {
            let turn = |parity: usize| {
                unit_slices.iter().enumerate().skip(on_dev.max(1)).filter(|(u, _)| u % 2 == parity).map(|(_, &n)| n).max().unwrap_or(0)
            };
            4 * (dev_elems + turn(0) + turn(1) + if on_dev == 0 { unit_slices[0] } else { 0 } + host_slice_max)
        }
        (true, _, true) => 4 * (dev_elems + v * h + after_embedding + 3 * unit_max.div_ceil(w)),
        (true, 1, false) => 4 * shard,
        (true, _, false) => 4 * (shard + v * h + after_embedding),
        (false, _, _) => 4 * shard * w,
    };
    let optimizer = if on_host { 12 * dev_elems } else { 12 * opt_elems };
    // A split state under ZeRO-3 with the weights on the host keeps those units' weights on
    // the GPU too (`ParamStore`'s resident prefix).
    let weights = weights + if offload_params && on_host && !all_on_device { a * dev_elems } else { 0 };
    let grad_reduce = match zero {
        // The host update's piece on its way (none when the gradients are in host memory
        // already); a device update writes in place.
        2 | 3 if offload_grads && offload_params => 0,
        // A whole unit's new weights on their way (and, several ranks, gathered).
        2 | 3 if offload_grads => 3 * a * unit_max,
        2 | 3 if on_host => (4 + a) * piece,
        2 | 3 if offload_params => shard * a,
        2 | 3 => 0,
        0 if lay.world > 1 => 4 * p,
        _ if lay.world > 1 => (4 + a) * shard + 2 * p * a,
        _ => 4 << 26,
    };
    let saved = (if off_inputs { 0 } else { l * input }, if off { 0 } else { saved_attn }, if off { 0 } else { saved_mlp });
    // What was offloaded, in flight: the group coming back and the one in use.
    let in_flight = 2 * parked;
    let layer_backward = shape.backward_bytes() - if req.save_attention { core } else { 0 };
    let attention_work = shape.attention_work_bytes();
    let head = shape.head_bytes();
    let layer_transient = in_flight + layer_backward + attention_work + attention_mode;
    let head_transient = head + parked;
    let transient = layer_transient.max(head_transient);
    let fixed = weights + gradients + optimizer;
    let peak_compute = fixed + saved.0 + saved.1 + saved.2 + transient;
    let peak_step = fixed + grad_reduce;
    let pool_peak = peak_compute.max(peak_step);
    let ov = u128::from(req.overhead);
    let dev = DeviceMemory {
        weights: cvt(weights)?,
        gradients: cvt(gradients)?,
        optimizer: cvt(optimizer)?,
        grad_reduce: cvt(grad_reduce)?,
        saved_activations: cvt(saved.0)?,
        saved_attention: cvt(saved.1)?,
        saved_mlp: cvt(saved.2)?,
        in_flight: cvt(in_flight)?,
        layer_backward: cvt(layer_backward)?,
        attention_work: cvt(attention_work)?,
        attention_mode: cvt(attention_mode)?,
        head: cvt(head)?,
        overhead: req.overhead,
        layer_transient: cvt(layer_transient)?,
        head_transient: cvt(head_transient)?,
        transient: cvt(transient)?,
        peak_compute: cvt(peak_compute + ov)?,
        peak_step: cvt(peak_step + ov)?,
        pool_peak: cvt(pool_peak)?,
        peak: cvt(pool_peak + ov)?,
    };
    host_totals(&mut host, req)?;
    Some((dev, host))
}

/// The sequence-parallel mode's own transient bytes (exchange buffers, FPDT's resident
/// chunks); FPDT's parked chunks go to `host` when offloaded.
fn attention_mode_bytes(model: &ModelShape, req: &PlanRequest, lay: &Layout, host: &mut HostMemory) -> Option<u128> {
    let u = |x: usize| x as u128;
    let (hq, d, a, b) = (u(model.heads), u(model.head_dim), u(req.dtype_bytes), u(req.batch_size));
    let (seq, s) = (u(req.seq_len), u(lay.local_tokens));
    let (e_q, e_kv) = (b * s * hq * d, b * s * u(model.kv_heads) * d);
    let (hkv_u, uly, r) = (u128::from(kv_heads_per_rank(model.kv_heads, lay.ulysses)), u(lay.ulysses), u(lay.ring));
    Some(match lay.mode {
        ParallelMode::DataParallel => 0,
        ParallelMode::ZigzagRingAttn => ring_bytes(e_q, e_kv, a),
        ParallelMode::UlyssesAttn => heads_bytes(e_q, b * seq * hkv_u * d, a),
        ParallelMode::Usp => {
            let e_h = b * (seq / r) * hkv_u * d;
            heads_bytes(e_q, e_h, a) + ring_bytes(e_q, e_h, a)
        }
        ParallelMode::Fpdt => {
            let (resident, parked) = fpdt_bytes(b, seq, s, u(req.fpdt_chunk), hq, hkv_u, uly, d, a);
            if req.fpdt_offload {
                host.fpdt_parked = cvt(parked)?;
                resident
            } else {
                resident + parked
            }
        }
    })
}

/// Host memory per rank and per node from its terms.
fn host_totals(host: &mut HostMemory, req: &PlanRequest) -> Option<()> {
    // The start weights are freed before the first step parks anything (`limits::HostNeed`).
    let steps = u128::from(host.saved_activations) + u128::from(host.fpdt_parked) + u128::from(host.gradients);
    host.per_rank = cvt(u128::from(host.optimizer)
        + steps.max(u128::from(host.weights_copy))
        + u128::from(host.grads_copy)
        + u128::from(host.weights))?;
    host.ranks_per_node = req.world / req.nnodes.max(1);
    host.per_node = cvt(u128::from(host.per_rank) * host.ranks_per_node as u128)?;
    Some(())
}

fn cvt(x: u128) -> Option<u64> {
    u64::try_from(x).ok()
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
    // The memory levers, each tried over every layout before the next: as asked; the
    // optimizer state on the host; ZeRO-3 with the weights on the host too; and the
    // gradients on the host as well.
    let zero3 = PlanRequest { optimizer_on_host: true, zero_stage: 3, offload_params: true, ..req.clone() };
    let levers = [
        req.clone(),
        PlanRequest { optimizer_on_host: true, ..req.clone() },
        zero3.clone(),
        PlanRequest { offload_gradients: true, ..zero3 },
    ];
    let mut out = Vec::new();
    for (i, lever) in levers.iter().enumerate() {
        if i > 0 && *lever == levers[i - 1] {
            continue; // already asked for
        }
        out.extend(layout_candidates(lever));
    }
    out
}

/// The layouts of `req`'s GPUs (with and without activation offload).
fn layout_candidates(req: &PlanRequest) -> Vec<PlanRequest> {
    let mut out = Vec::new();
    for offload in [false, true] {
        for sp in divisors(req.world) {
            // Everything offloaded includes the layer inputs (the two are not set together).
            let base = PlanRequest {
                offload_activations: offload,
                offload_layer_inputs: req.offload_layer_inputs && !offload,
                sp: Some(sp),
                ulysses: None,
                fpdt_offload: false,
                ..req.clone()
            };
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
        offload_layer_inputs: r.offload_layer_inputs,
        save_attention: r.save_attention,
        save_mlp: mlp_layers(model, r) > 0,
        save_mlp_layers: r.save_mlp_layers.filter(|&n| n < model.layers),
        optimizer_on_host: r.optimizer_on_host,
        zero_stage: r.zero_stage,
        offload_params: r.offload_params,
        offload_gradients: r.offload_gradients && e.host.gradients > 0,
        peak: e.device.peak,
    };
    let budget = (req.gpu_memory as f64 * (1.0 - SUGGESTION_HEADROOM)) as u64;
    // Saving the attention is faster (no attention forward in the backward), and then
    // saving the MLP's projections (no o_proj, gate and up GEMMs in the backward; more
    // bytes for less time, so second): take the attention when it fits with the headroom,
    // then every layer's MLP, else the MLP of as many top layers as fit; keep what was
    // asked otherwise.
    let layers = model.layers;
    let with_saved = |r: &PlanRequest| -> PlanRequest {
        let fits = |r: &PlanRequest| matches!(estimate(model, r), Ok(e) if e.fits && e.device.peak <= budget);
        let mut r = r.clone();
        let attn = PlanRequest { save_attention: true, ..r.clone() };
        if attn != r && fits(&attn) {
            r = attn;
        }
        let have = mlp_layers(model, &r);
        if r.save_attention && have < layers {
            let with = |n: usize| PlanRequest { save_mlp: true, save_mlp_layers: (n < layers).then_some(n), ..r.clone() };
            // The peak grows with the layers kept: the largest count that fits, by bisection.
            let (mut lo, mut hi) = (have, layers);
            while lo < hi {
                let mid = (lo + hi).div_ceil(2);
                if fits(&with(mid)) {
                    lo = mid;
                } else {
                    hi = mid - 1;
                }
            }
            if lo > have {
                r = with(lo);
            }
        }
        r
    };
    if let Ok(e) = estimate(model, req) {
        if e.fits {
            let r = with_saved(req);
            let e = if r != *req { estimate(model, &r).unwrap_or(e) } else { e };
            return Some(mk(&r, &e, true));
        }
    }
    candidates(req).iter().find_map(|r| {
        let r = with_saved(r);
        estimate(model, &r).ok().filter(|e| e.fits && e.device.peak <= budget).map(|e| mk(&r, &e, false))
    })
}

/// How many layers (the top ones) keep their MLP tensors under request `req`.
pub fn mlp_layers(model: &ModelShape, req: &PlanRequest) -> usize {
    crate::train::config::mlp_saved_layers(req.save_mlp, req.save_mlp_layers, model.layers)
}

impl Suggestion {
    /// How many layers (the top ones) keep their MLP tensors under this suggestion, of a
    /// model with `layers` layers.
    pub fn mlp_layers(&self, layers: usize) -> usize {
        crate::train::config::mlp_saved_layers(self.save_mlp, self.save_mlp_layers, layers)
    }
}

/// Estimate and suggestion for a request (errors when the request itself is invalid).
pub fn plan(model: &ModelShape, req: &PlanRequest) -> Result<Plan> {
    let estimate = estimate(model, req)?;
    let suggestion = suggest(model, req);
    Ok(Plan { model: model.clone(), request: req.clone(), estimate, suggestion })
}

/// One request per stage of a run as `train` will run it (one rank per GPU, the
/// optimizer where `train.optimizer_on_host` puts it).
pub fn run_requests(cfg: &RunConfig, gpu_memory: u64, dtype_bytes: usize) -> Vec<PlanRequest> {
    let p = &cfg.parallel;
    cfg.stages
        .iter()
        .enumerate()
        .map(|(i, st)| {
            let mut r = PlanRequest::new(st.seq_length, p.world_size, gpu_memory, st.parallel_mode.unwrap_or(p.mode));
            r.optimizer_on_host = cfg.train.optimizer_on_host;
            r.optimizer_device_units = cfg.train.optimizer_device_units;
            r.zero_stage = cfg.train.zero_stage;
            r.offload_params = cfg.train.offload_params;
            r.offload_gradients = cfg.train.offload_gradients;
            r.dtype_bytes = dtype_bytes;
            r.batch_size = cfg.stage_settings(i).batch_size;
            r.sp = (p.sp_size > 0).then_some(p.sp_size);
            r.ulysses = Some(p.ulysses_size);
            r.fpdt_chunk = st.fpdt_chunk_size.unwrap_or(p.fpdt_chunk_size);
            r.fpdt_offload = p.fpdt_offload;
            r.offload_activations = p.offload_activations;
            r.offload_layer_inputs = p.offload_layer_inputs;
            r.save_attention = p.save_attention;
            r.save_mlp = p.save_mlp;
            r.save_mlp_layers = p.save_mlp_layers;
            r.token_chunk = p.token_chunk;
            r
        })
        .collect()
}

/// The largest length (a power of two, or 1.5 times one) at most `req.seq_len` that
/// validates and fits with the request's layout; `None` when none from 1K up does.
pub fn largest_fitting(model: &ModelShape, req: &PlanRequest) -> Option<usize> {
    let mut lens: Vec<usize> = (10..=40).flat_map(|k| [1usize << k, 3usize << (k - 1)]).filter(|&n| n <= req.seq_len).collect();
    lens.sort_unstable_by(|a, b| b.cmp(a));
    lens.into_iter().find(|&n| estimate(model, &PlanRequest { seq_len: n, ..req.clone() }).is_ok_and(|e| e.fits))
}

/// The largest length (as [`largest_fitting`] counts them) at most `req.seq_len` that some
/// layout of `req`'s GPUs fits ([`suggest`]), with that layout.
pub fn largest_suggested(model: &ModelShape, req: &PlanRequest) -> Option<(usize, Suggestion)> {
    let mut lens: Vec<usize> = (10..=40).flat_map(|k| [1usize << k, 3usize << (k - 1)]).filter(|&n| n <= req.seq_len).collect();
    lens.sort_unstable_by(|a, b| b.cmp(a));
    lens.into_iter().find_map(|n| suggest(model, &PlanRequest { seq_len: n, ..req.clone() }).map(|s| (n, s)))
}

/// Before any work: refuses a run whose stage would not fit the GPU's `gpu_memory` or,
/// when given, the host's `host_available` bytes (the ranks spread over `nodes` nodes,
/// launched: one process a rank), naming the numbers, the largest
/// length that fits as configured and a layout that fits the requested length.
pub fn preflight(
    cfg: &RunConfig,
    model: &LlamaConfig,
    gpu_memory: u64,
    host_available: Option<u64>,
    nodes: usize,
    source: &Path,
) -> Result<()> {
    let shape = ModelShape::from_config(model);
    let dtype_bytes = crate::train::trainer::parse_dtype(&cfg.model.dtype, source, "model.dtype")?.size_in_bytes();
    for (i, mut req) in run_requests(cfg, gpu_memory, dtype_bytes).into_iter().enumerate() {
        req.host_memory = host_available;
        req.nnodes = nodes.max(1);
        let e = estimate(&shape, &req)?;
        let what = format!("stage {i}: {} tokens ({})", req.seq_len, e.layout.mode);
        if !e.fits_gpu {
            let largest = largest_fitting(&shape, &PlanRequest { host_memory: None, ..req.clone() })
                .map_or("no length from 1K up fits this layout".to_string(), |n| {
                    format!("the largest length that fits this layout is {}", tokens_label(n))
                });
            // A layout that fits the host too (the GPU alone could suggest an offload
            // the host then refuses).
            let fix = match suggest(&shape, &req) {
                Some(s) => format!("; {} tokens fit with {}", req.seq_len, describe_suggestion(&s, &req)),
                None => String::new(),
            };
            return Err(Error::config(
                source,
                format!("stage[{i}].seq_length"),
                format!(
                    "{what} need an estimated {} GB per GPU, the GPU has {} GB; {largest}{fix} (see `longctx plan`; \
                     --skip-memory-check runs anyway)",
                    gb(e.device.peak),
                    gb(gpu_memory)
                ),
            ));
        }
        if e.fits_host == Some(false) {
            // Name the setting behind the largest host term that can be turned off.
            let h = &e.host;
            let activations = match req.offload() {
                crate::train::offload::Offload::Inputs => "parallel.offload_layer_inputs",
                _ => "parallel.offload_activations",
            };
            let field = [
                (h.saved_activations, activations),
                // Every rank's own f32 start weights: fewer ranks a node.
                (h.weights_copy, "parallel.world_size"),
                (h.gradients, "train.offload_gradients"),
                (h.weights, "train.offload_params"),
                (h.fpdt_parked, "parallel.fpdt_offload"),
                (h.optimizer, "train.optimizer_on_host"),
            ]
            .into_iter()
            .filter(|&(b, _)| b > 0)
            .max_by_key(|&(b, _)| b)
            .map_or("parallel.offload_activations", |(_, f)| f);
            return Err(Error::config(
                source,
                field,
                format!(
                    "{what} need {} GB of host memory per node (offloaded activations {} GB, optimizer {} GB, weights {} GB, \
                     gradients {} GB, FPDT {} GB, gradient pieces {} GB, start weights {} GB until the first step), {} GB are \
                     available; use a shorter length, more GPUs, or keep more on the GPU (see `longctx plan`; \
                     --skip-memory-check runs anyway)",
                    gb(h.per_node),
                    gb(h.saved_activations),
                    gb(h.optimizer),
                    gb(h.weights),
                    gb(h.gradients),
                    gb(h.fpdt_parked),
                    gb(h.grads_copy),
                    gb(h.weights_copy),
                    gb(host_available.unwrap_or(0))
                ),
            ));
        }
    }
    Ok(())
}

/// Bytes per weight of the run's model: `model.dtype`'s, 4 on the CPU (where runs are f32).
pub fn weight_bytes(cfg: &RunConfig, source: &Path) -> Result<usize> {
    if cfg.model.device == "cpu" {
        return Ok(4);
    }
    Ok(crate::train::trainer::parse_dtype(&cfg.model.dtype, source, "model.dtype")?.size_in_bytes())
}

/// What a run writes to its `output_dir` ([`disk_need`]), in bytes.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize)]
pub struct DiskNeed {
    /// One checkpoint: the weights in the run dtype and the f32 AdamW master, m and v.
    pub checkpoint: u64,
    /// The Hugging Face export of the final weights (the run dtype).
    pub export: u64,
    /// Free space the run needs at its fullest: a checkpoint replaces the previous one
    /// only once it is complete (atomic swap), and the export is written beside the last.
    pub peak: u64,
}

/// The disk space of a run of `model` (`dtype_bytes` per weight, 4 on the CPU): the
/// checkpoint written at each stage's end and every `train.checkpoint_every` steps,
/// then the export. `resume`: a checkpoint of the same size is already there (it is
/// replaced, so it needs no room of its own).
pub fn disk_need(cfg: &RunConfig, model: &LlamaConfig, dtype_bytes: u64, resume: bool) -> DiskNeed {
    let params = param_count(model);
    let checkpoint = params.saturating_mul(dtype_bytes.saturating_add(12));
    let export = params.saturating_mul(dtype_bytes);
    let steps: u64 = cfg.stages.iter().map(|s| s.steps).sum();
    let every = cfg.train.checkpoint_every;
    let writes = cfg.stages.len() as u64 + steps.checked_div(every).unwrap_or(0);
    let peak = if resume {
        checkpoint.max(export) // the new checkpoint beside the old; the export beside the new
    } else if writes >= 2 {
        checkpoint.saturating_mul(2).max(checkpoint.saturating_add(export))
    } else {
        checkpoint.saturating_add(export)
    };
    DiskNeed { checkpoint, export, peak }
}

/// Before any work: refuses a run whose checkpoints and export cannot fit the `free`
/// bytes of the filesystem of `cfg.output_dir`, naming the sizes and the fix (a failed
/// checkpoint write would otherwise end the run after its training steps).
pub fn preflight_disk(cfg: &RunConfig, model: &LlamaConfig, free: u64, resume: bool, source: &Path) -> Result<()> {
    let need = disk_need(cfg, model, weight_bytes(cfg, source)? as u64, resume);
    if need.peak <= free {
        return Ok(());
    }
    Err(Error::config(
        source,
        "output_dir",
        format!(
            "the run writes checkpoints of {} GB (weights and the f32 AdamW state) and an export of {} GB into {}: it needs {} GB \
             free at its fullest (a checkpoint replaces the previous one only once complete), the filesystem there has {} GB free; \
             set output_dir (--output-dir) on a larger disk or free space (--skip-memory-check runs anyway)",
            gb(need.checkpoint),
            gb(need.export),
            cfg.output_dir.display(),
            gb(need.peak),
            gb(free)
        ),
    ))
}

/// Suggestion `s` for request `req` in the words of the config keys (the memory levers
/// named where they differ from the request's).
pub fn describe_suggestion(s: &Suggestion, req: &PlanRequest) -> String {
    let mut out = format!("parallel.mode = \"{}\"", s.mode);
    if s.sp > 1 {
        out += &format!(", sp_size = {}", s.sp);
    }
    if s.ulysses > 1 {
        out += &format!(", ulysses_size = {}", s.ulysses);
    }
    if let Some(c) = s.fpdt_chunk {
        out += &format!(", fpdt_chunk_size = {c}{}", if s.fpdt_offload { ", fpdt_offload = true" } else { "" });
    }
    if s.offload_activations {
        out += ", offload_activations = true";
    }
    if s.offload_layer_inputs {
        out += ", offload_layer_inputs = true";
    }
    if s.save_attention {
        out += ", save_attention = true";
    }
    match (s.save_mlp, s.save_mlp_layers) {
        (true, Some(n)) => out += &format!(", save_mlp_layers = {n}"),
        (true, None) => out += ", save_mlp = true",
        _ => {}
    }
    for lever in added_levers(s, req) {
        out += &format!(", {}", lever.key);
    }
    out
}

/// A memory lever a suggestion pulls, in the words of the config and of `train`'s flags.
pub struct Lever {
    /// `train.zero_stage = 3`
    pub key: String,
    /// `--zero-stage 3`
    pub flag: String,
}

/// The memory levers suggestion `s` pulls beyond request `req` (the one list the refusal's
/// config keys and `plan`'s flags are both written from).
pub fn added_levers(s: &Suggestion, req: &PlanRequest) -> Vec<Lever> {
    let on = |name: &str| Lever { key: format!("train.{name} = true"), flag: format!("--{}", name.replace('_', "-")) };
    let mut out = Vec::new();
    if s.zero_stage != req.zero_stage {
        out.push(Lever { key: format!("train.zero_stage = {}", s.zero_stage), flag: format!("--zero-stage {}", s.zero_stage) });
    }
    for (pulled, asked, name) in [
        (s.optimizer_on_host, req.optimizer_on_host, "optimizer_on_host"),
        (s.offload_params, req.offload_params, "offload_params"),
        (s.offload_gradients, req.offload_gradients, "offload_gradients"),
    ] {
        if pulled && !asked {
            out.push(on(name));
        }
    }
    out
}

/// Checks a run config against its model: the head split of every stage's mode
/// ([`ParallelDims::new`], as the trainer will build it). Stages may differ in their
/// data-parallel size: the optimizer is sharded over all ranks, not over data-parallel
/// replicas. `source` names the config.
pub fn check_run(cfg: &RunConfig, model: &LlamaConfig, source: &Path) -> Result<()> {
    cfg.check_stage_ropes(model, source)?;
    if let Some(n) = cfg.parallel.save_mlp_layers {
        if n > model.num_hidden_layers {
            let msg = format!(
                "got {n}, expected at most the model's {} layers (leave it out, or set save_mlp = true, to keep every layer's MLP)",
                model.num_hidden_layers
            );
            return Err(Error::config(source, "parallel.save_mlp_layers", msg));
        }
    }
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

// Token counts are read and printed by `limits` (below every layer that names lengths).
pub use crate::limits::{gb, parse_tokens, tokens_label};

/// What a peek at the first samples of documents-packed data says (`train --dry-run`).
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct DocumentPeek {
    pub samples: usize,
    /// Documents per sample, averaged over the peeked samples.
    pub docs_per_sample: f64,
    /// The attention work (causal, block-diagonal over documents) relative to one
    /// document per sample: the mean over samples of Σ len_i² / S².
    pub attention_ratio: f64,
    /// Documents longer than S+1 tokens seen while packing (split over samples).
    pub long_docs: u64,
}

/// Measures `samples` (rows of `seq_len` positions, [`crate::data::Sample::doc_starts`]
/// convention); `long_docs` from the packer ([`crate::data::Loader::pack_stats`]).
pub fn document_peek(samples: &[crate::data::Sample], seq_len: usize, long_docs: u64) -> DocumentPeek {
    let n = samples.len().max(1) as f64;
    let s2 = (seq_len as f64).powi(2).max(1.0);
    let (mut docs, mut work) = (0usize, 0f64);
    for s in samples {
        let ranges = crate::data::doc_ranges(&s.doc_starts, seq_len);
        docs += ranges.len();
        work += ranges.iter().map(|r| (r.len() as f64).powi(2)).sum::<f64>() / s2;
    }
    DocumentPeek { samples: samples.len(), docs_per_sample: docs as f64 / n, attention_ratio: work / n, long_docs }
}

/// The dry run's line for a peek.
pub fn describe_document_peek(p: &DocumentPeek) -> String {
    let mut out = format!(
        "documents packing: {:.2} documents per sample, attention work {:.3}× that of one document per sample \
         (Σ len² / S², first {} sample(s) of stage 0)",
        p.docs_per_sample, p.attention_ratio, p.samples
    );
    if p.long_docs > 0 {
        out.push_str(&format!("; note: {} document(s) longer than a sample were split, each piece attending only to itself", p.long_docs));
    }
    out
}
