//! The run configuration: a TOML file (every field optional, see `configs/`) whose
//! values command-line flags override. Resolved once at start-up, validated, printed.

use crate::train::optim::{AdamWConfig, LrSchedule, Schedule, WarmupType};
use crate::train::stage_eval::EvalSection;
use crate::{Error, Result};
use serde::{Deserialize, Serialize};
use std::path::{Path, PathBuf};

use crate::data::docs::LabelSource;
use crate::data::loader::{FilesConfig, MixSource};
use crate::data::packing::Packing;
use crate::limits::{check_range, MAX_BATCH, MAX_BATCH_TOKENS, MAX_LAYERS, MAX_SEQ_LEN, MAX_SHUFFLE_BUFFER, MAX_STEPS, MAX_WORLD_SIZE};
use crate::parallel::LengthField;

/// Largest learning rate accepted (AdamW moves each weight by about the learning rate
/// per step: anything above 1 destroys the model in one step).
pub const MAX_LEARNING_RATE: f64 = 1.0;
pub use crate::parallel::ParallelMode;

#[derive(Clone, Debug, Serialize, Deserialize, PartialEq)]
#[serde(deny_unknown_fields, default)]
pub struct ModelSection {
    /// `builtin:tiny` (seeded random init, no download), a local directory, or a hub id.
    pub source: String,
    /// Weights/activations dtype on the device: f32, bf16 or f16 (CPU runs use f32).
    pub dtype: String,
    /// `cpu` or `cuda` (`cuda:N` for a device index).
    pub device: String,
}
impl Default for ModelSection {
    fn default() -> Self {
        Self { source: "builtin:tiny".into(), dtype: "f32".into(), device: "cpu".into() }
    }
}

#[derive(Clone, Debug, Serialize, Deserialize, PartialEq)]
#[serde(deny_unknown_fields, default)]
pub struct DataSection {
    /// `synthetic:passkey`, a local file/directory (jsonl, txt, parquet, .bin tokens) or a hub dataset id.
    pub dataset: String,
    /// Column/field holding token ids or text (`input_ids` or `text`).
    pub column: Option<String>,
    /// Buffer of the streaming shuffle (0 = no shuffle).
    pub shuffle_buffer: usize,
    /// Split of a hub dataset or a dataset directory: only files whose path names it
    /// (`train-00000-of-00004.parquet`, `data/train/...`, `train.jsonl.gz`) are read, when
    /// any file names a split; `*` reads every file.
    pub split: String,
    /// How documents become samples: `concat` (one stream cut into windows of S+1 tokens),
    /// `truncate` (one document per sample, cut or padded) or `documents` (cut like concat,
    /// each sample keeping its document boundaries for document-aware attention).
    pub packing: PackingMode,
    /// Pad id of `truncate` packing.
    pub pad_id: u32,
    /// Positions restart at 0 at each document [default: true with `documents`, false
    /// otherwise; true with another packing is an error].
    #[serde(skip_serializing_if = "Option::is_none")]
    pub reset_positions: Option<bool>,
    /// Per-token labels column of pre-tokenized data (list of ints, -100 = not counted)
    /// [default: `labels` when the file has it]; `"none"`: never read labels.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub labels_column: Option<String>,
    /// A 0/1 loss-mask column instead of labels [default: `loss_mask` when the file has it
    /// and no labels column was found].
    #[serde(skip_serializing_if = "Option::is_none")]
    pub loss_mask_column: Option<String>,
    /// A mixture of weighted sources (`[[data.source]]`), read instead of `dataset` by
    /// every stage that names no dataset of its own.
    #[serde(rename = "source", skip_serializing_if = "Vec::is_empty")]
    pub sources: Vec<MixSource>,
}
impl Default for DataSection {
    fn default() -> Self {
        Self {
            dataset: "synthetic:passkey".into(),
            column: None,
            shuffle_buffer: 64,
            split: "train".into(),
            packing: PackingMode::Concat,
            pad_id: 0,
            reset_positions: None,
            labels_column: None,
            loss_mask_column: None,
            sources: Vec::new(),
        }
    }
}

/// `data.packing` (see [`crate::data::packing`]).
#[derive(Clone, Copy, Debug, Serialize, Deserialize, PartialEq, Eq, Default)]
#[serde(rename_all = "lowercase")]
pub enum PackingMode {
    #[default]
    Concat,
    Truncate,
    Documents,
}

impl DataSection {
    /// The packing of the data pipeline.
    pub fn packing(&self) -> Packing {
        match self.packing {
            PackingMode::Concat => Packing::Concat,
            PackingMode::Truncate => Packing::Truncate { pad_id: self.pad_id },
            PackingMode::Documents => Packing::Documents,
        }
    }

    /// Where labels come from ([`LabelSource`]).
    pub fn label_source(&self) -> LabelSource {
        match (self.labels_column.as_deref(), self.loss_mask_column.as_deref()) {
            (Some("none"), _) => LabelSource::None,
            (Some(c), _) => LabelSource::Labels(c.to_string()),
            (None, Some(c)) => LabelSource::LossMask(c.to_string()),
            (None, None) => LabelSource::Auto,
        }
    }

    /// Sets the `[data]` settings of the pipeline on a stage's files config: packing,
    /// reset_positions, labels, and the mixture when the stage reads it
    /// ([`StageSettings::mixture`]).
    pub fn configure(&self, f: &mut FilesConfig, s: &StageSettings) {
        f.packing = self.packing();
        f.reset_positions = self.reset_positions;
        f.labels = self.label_source();
        if s.mixture {
            f.mixture = self.sources.clone();
        }
    }

    /// The `[data]` checks; `source` names the config for the messages.
    pub fn validate(&self, source: &Path) -> Result<()> {
        if self.reset_positions == Some(true) && self.packing != PackingMode::Documents {
            let mode = self.packing().name();
            return Err(Error::config(
                source,
                "data.reset_positions",
                format!(
                    "is true, but packing `{mode}` keeps no document boundaries to restart positions at; \
                     set data.packing = \"documents\", or remove data.reset_positions"
                ),
            ));
        }
        if self.labels_column.is_some() && self.loss_mask_column.is_some() {
            return Err(Error::config(
                source,
                "data.loss_mask_column",
                "both data.labels_column and data.loss_mask_column are set; a dataset's targets come from one of them, keep one",
            ));
        }
        for (key, v) in [("data.labels_column", &self.labels_column), ("data.loss_mask_column", &self.loss_mask_column)] {
            if v.as_deref().is_some_and(|v| v.trim().is_empty()) {
                return Err(Error::config(source, key, "is empty; name a column, or leave the key out"));
            }
        }
        if !self.sources.is_empty() && !self.dataset.starts_with("synthetic:") {
            return Err(Error::config(
                source,
                "data.dataset",
                format!(
                    "`{}` is set next to {} [[data.source]] entries; the mixture replaces data.dataset: keep one of them",
                    self.dataset,
                    self.sources.len()
                ),
            ));
        }
        for (i, m) in self.sources.iter().enumerate() {
            m.check(source, &format!("data.source[{i}]"))?;
        }
        Ok(())
    }
}

#[derive(Clone, Debug, Serialize, Deserialize, PartialEq)]
#[serde(deny_unknown_fields, default)]
pub struct TrainSection {
    pub batch_size: usize,
    pub gradient_accumulate_every: usize,
    pub learning_rate: f64,
    pub lr_schedule: Schedule,
    pub warmup_steps: u64,
    /// The warm-up's shape: `linear` (longctx's schedules) or `log` (DeepSpeed's schedules
    /// only) [default: linear; log for DeepSpeed's, as DeepSpeed's default].
    pub warmup_type: Option<WarmupType>,
    /// Where the warm-up starts, as a fraction of the learning rate (DeepSpeed's
    /// `warmup_min_ratio`, or `warmup_min_lr / warmup_max_lr`); also where
    /// `warmup_decay_lr` decays back to.
    pub warmup_min_ratio: f64,
    pub min_lr_ratio: f64,
    /// The step at which the decay ends, counted from each stage's start (DeepSpeed's
    /// `total_num_steps`) [default: each stage's `steps`].
    pub schedule_steps: Option<u64>,
    /// Global-norm gradient clipping (0 = off).
    pub clip_grad: f64,
    pub adamw: AdamWConfig,
    /// Write a resumable checkpoint every N optimizer steps (0 = only at stage ends and
    /// by time, see `checkpoint_interval_min`).
    pub checkpoint_every: u64,
    /// Also write one when this many minutes have passed since the last (0 = off). All
    /// ranks agree on it at the step boundary.
    pub checkpoint_interval_min: f64,
    /// Write checkpoints and the final export. False: the run writes only its metrics
    /// (and TensorBoard events), for throughput measurements; it leaves nothing to resume
    /// from or to load.
    pub save: bool,
    /// Abort after this many optimizer steps in a row whose gradient norm (or loss) was
    /// not finite; each such step is skipped (no update, its data consumed). The last
    /// good checkpoint is kept.
    pub max_skipped_steps: u64,
    /// On a GPU, keep the optimizer state and its update in host memory (rayon AdamW,
    /// like DeepSpeed's offload_optimizer) instead of on the device. CPU runs: always host.
    pub optimizer_on_host: bool,
    /// With `optimizer_on_host`: the first N ZeRO units keep their AdamW state and its
    /// update on the GPU, the rest on the host (a split placement, like DeepSpeed's
    /// `offload_optimizer.ratio`). Units in the model's order: the embedding, one decoder
    /// layer each, the final norm with the head; under stages 0–1 the whole model is one
    /// unit. Under ZeRO-3 with `offload_params` the host update runs during the next step's
    /// forward, which must wait for the first units'; on the GPU their update takes
    /// milliseconds, and their weights stay there too (docs/benchmarks.md, session 38). Each
    /// unit costs 12 bytes per parameter of GPU memory, 14 with its weights (`longctx plan`
    /// counts it). 0: all of it on the host.
    pub optimizer_device_units: usize,
    /// ZeRO stage, as DeepSpeed numbers them: 0 every rank keeps the whole optimizer
    /// state (gradients all-reduced); 1 the optimizer state is sharded over the ranks (the
    /// default); 2 the gradients too, reduce-scattered layer by layer during the backward;
    /// 3 the weights too, each layer all-gathered just before it runs.
    pub zero_stage: u8,
    /// Keep this rank's slice of the weights in host memory and copy each layer to the
    /// GPU only while it runs (DeepSpeed's `offload_param`; needs `zero_stage = 3`).
    pub offload_params: bool,
    /// With the optimizer state in host memory under ZeRO stage 2 or 3
    /// (`optimizer_on_host`): each layer's f32 gradient slice goes there too as soon as
    /// the backward is done with it (copied under the next layer's backward), so the GPU
    /// holds two or three layers' gradients instead of the whole model's (4 bytes a
    /// parameter: 27 GB for 7B), memory for more `save_mlp_layers`. The host then holds
    /// them (the same 4 bytes a parameter, page-locked) and the update reads them there.
    /// The `optimizer_device_units` keep theirs on the GPU.
    pub offload_gradients: bool,
    /// Time each step by phase (attention, GEMMs, norms/RoPE/activation, loss, gradient
    /// accumulation, device copies, host transfers, element-wise adds, optimizer,
    /// communication) into metrics.jsonl (`profile`).
    pub profile: bool,
    /// Print one line per layer and phase of every step to stderr, with the seconds since
    /// the step began (each after waiting for the GPU, so slower): where a slow step, or one
    /// that never finishes, spends its time.
    pub trace: bool,
    /// How a decoder layer and the head are differentiated: `explicit` (fused kernels,
    /// the default) or `autograd` (Candle autograd over the recomputed layer: the
    /// reference, slower).
    pub layer_backward: crate::train::engine::LayerBackward,
    /// Start every stage after the first with fresh AdamW moments (a stage's own
    /// `reset_optimizer` wins). EasyContext runs each stage as a new job, so a new optimizer.
    pub reset_optimizer: bool,
    /// Peak dense TFLOP/s of one device, for the MFU in the progress and metrics
    /// [default: from the GPU's name; 989 (H100/H200 bf16) when unknown].
    pub peak_tflops: Option<f64>,
    /// Write TensorBoard event files (`<output_dir>/tensorboard/`) next to metrics.jsonl.
    pub tensorboard: bool,
}
impl Default for TrainSection {
    fn default() -> Self {
        Self {
            batch_size: 1,
            gradient_accumulate_every: 1,
            learning_rate: 2e-5,
            lr_schedule: Schedule::Constant,
            warmup_steps: 0,
            warmup_type: None,
            warmup_min_ratio: 0.0,
            min_lr_ratio: 0.1,
            schedule_steps: None,
            clip_grad: 1.0,
            adamw: AdamWConfig::default(),
            checkpoint_every: 0,
            checkpoint_interval_min: 30.0,
            save: true,
            max_skipped_steps: 5,
            optimizer_on_host: false,
            optimizer_device_units: 0,
            zero_stage: 1,
            offload_params: false,
            offload_gradients: false,
            profile: false,
            trace: false,
            layer_backward: Default::default(),
            reset_optimizer: false,
            peak_tflops: None,
            tensorboard: true,
        }
    }
}

impl TrainSection {
    /// The learning-rate schedule of a stage that starts at `base`, warms up over `warmup`
    /// steps and runs `stage_steps` steps.
    pub fn lr_schedule_for(&self, base: f64, warmup: u64, stage_steps: u64) -> LrSchedule {
        LrSchedule {
            schedule: self.lr_schedule,
            base,
            warmup_steps: warmup,
            warmup_type: self.warmup_type.unwrap_or(self.lr_schedule.default_warmup_type()),
            warmup_min_ratio: self.warmup_min_ratio,
            min_lr_ratio: self.min_lr_ratio,
            total_steps: self.schedule_steps.unwrap_or(stage_steps),
        }
    }
}

/// Default of `parallel.collective_timeout_s`.
pub const DEFAULT_COLLECTIVE_TIMEOUT_S: f64 = 600.0;

#[derive(Clone, Debug, Serialize, Deserialize, PartialEq)]
#[serde(deny_unknown_fields, default)]
pub struct ParallelSection {
    pub mode: ParallelMode,
    /// Ranks when not started by a launcher (threads of this process sharing the device).
    pub world_size: usize,
    /// Sequence-parallel degree (ranks sharing one sequence); the rest is data parallel.
    /// 0 = all ranks (world_size) for sequence-parallel modes, 1 for data_parallel.
    pub sp_size: usize,
    /// USP: Ulysses degree inside a ring group (sp_size = ulysses_size × ring).
    pub ulysses_size: usize,
    /// FPDT chunk size in global tokens.
    pub fpdt_chunk_size: usize,
    /// FPDT: keep kv chunks in host memory.
    pub fpdt_offload: bool,
    /// Keep saved layer inputs in host memory between forward and backward.
    pub offload_activations: bool,
    /// Keep only the saved layer inputs in host memory (the attention's and MLP's saved
    /// tensors stay on the device): a part of `offload_activations`, whose device memory
    /// goes to `save_mlp_layers` or the optimizer's device units.
    pub offload_layer_inputs: bool,
    /// Tokens per chunk for token-wise parts (norms, MLP, head, loss).
    pub token_chunk: usize,
    /// Keep each layer's attention output, LSE, q, k and v from the forward on the device
    /// so the backward does not rerun the attention (selective recomputation; costs
    /// `layers × tokens × (2·hq + 2·hkv)·head_dim` elements, see `longctx plan`).
    pub save_attention: bool,
    /// Keep each layer's MLP input and its gate and up projections from the forward on the
    /// device, per token chunk, so the backward does not rerun `o_proj`, the gate and the
    /// up projection (costs `layers × tokens × (hidden + 2·intermediate)` elements, see
    /// `longctx plan`).
    pub save_mlp: bool,
    /// Keep the MLP tensors of the top `save_mlp_layers` layers only (the others recompute
    /// them): a memory budget between `save_mlp = false` and every layer, which `longctx
    /// plan` suggests when all layers do not fit. Set, it applies whatever `save_mlp` says;
    /// at most the model's layers.
    pub save_mlp_layers: Option<usize>,
    /// Seconds a collective may wait for the other ranks before every rank aborts, naming
    /// the rank and the collective (a peer alive but stuck); 0 = wait forever. Applies to
    /// NCCL and to the CPU transports (threads, processes).
    pub collective_timeout_s: f64,
}
impl ParallelSection {
    /// What of each layer's saved tensors goes to host memory (`offload_activations` wins;
    /// the two are not set together, see [`RunConfig::validate`]).
    pub fn offload(&self) -> crate::train::offload::Offload {
        crate::train::offload::Offload::of(self.offload_activations, self.offload_layer_inputs)
    }
}

impl Default for ParallelSection {
    fn default() -> Self {
        Self {
            mode: ParallelMode::DataParallel,
            world_size: 1,
            sp_size: 0,
            ulysses_size: 1,
            fpdt_chunk_size: 65536,
            fpdt_offload: false,
            offload_activations: false,
            offload_layer_inputs: false,
            token_chunk: 4096,
            save_attention: false,
            save_mlp: false,
            save_mlp_layers: None,
            collective_timeout_s: DEFAULT_COLLECTIVE_TIMEOUT_S,
        }
    }
}

impl ParallelSection {
    /// How many layers, the top ones, keep their MLP tensors for the backward, of a model
    /// with `layers` layers: `save_mlp_layers` when set (at most `layers`), all with
    /// `save_mlp`, else none.
    pub fn mlp_saved_layers(&self, layers: usize) -> usize {
        mlp_saved_layers(self.save_mlp, self.save_mlp_layers, layers)
    }
}

/// [`ParallelSection::mlp_saved_layers`] from its two fields (also the planner's and the
/// engine's rule).
pub fn mlp_saved_layers(save_mlp: bool, save_mlp_layers: Option<usize>, layers: usize) -> usize {
    match save_mlp_layers {
        Some(n) => n.min(layers),
        None if save_mlp => layers,
        None => 0,
    }
}

/// `[attention]`: which CUDA kernel computes the attention blocks.
#[derive(Clone, Debug, Default, Serialize, Deserialize, PartialEq)]
#[serde(deny_unknown_fields, default)]
pub struct AttentionSection {
    /// `"auto"` (the default: per block call whichever of the two below was measured faster
    /// on that shape, `CudaKernel::uses_native`), `"cudnn"` (cuDNN's fused attention) or
    /// `"native"` (longctx's own Hopper kernels, forward and backward, sm_90a builds). A
    /// shape the native kernel does not cover runs cuDNN (said once when `"native"` was
    /// chosen). No effect on the CPU.
    pub kernel: longctx_attention::kernel::CudaKernel,
}

impl AttentionSection {
    pub fn is_default(&self) -> bool {
        *self == Self::default()
    }
}

/// One stage of a progressive rope_theta recipe; each starts from the previous weights.
/// Every optional key left unset takes the run-wide value (`[train]`, `[data]`,
/// `[parallel]`), except `seed`, which defaults to `seed + stage index` so that each
/// stage reads other documents (EasyContext's scripts use seeds 2022, 2023, ...).
#[derive(Clone, Debug, Serialize, Deserialize, PartialEq)]
#[serde(deny_unknown_fields)]
pub struct Stage {
    pub seq_length: usize,
    pub rope_theta: f64,
    pub steps: u64,
    pub learning_rate: Option<f64>,
    pub parallel_mode: Option<ParallelMode>,
    pub fpdt_chunk_size: Option<usize>,
    /// Seed of this stage's data order (and synthetic data) [default: run seed + index].
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub seed: Option<u64>,
    /// This stage's dataset [default: `data.dataset`].
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub dataset: Option<String>,
    /// Its column/field [default: `data.column`].
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub column: Option<String>,
    /// Sequences per micro-batch per data-parallel rank [default: `train.batch_size`].
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub batch_size: Option<usize>,
    /// Micro-batches per optimizer step [default: `train.gradient_accumulate_every`].
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub gradient_accumulate_every: Option<usize>,
    /// Warmup steps at the start of this stage [default: `train.warmup_steps`].
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub warmup_steps: Option<u64>,
    /// Start this stage with fresh AdamW moments and step counter (the f32 master weights
    /// are kept), as a new EasyContext/DeepSpeed run per stage does [default:
    /// `train.reset_optimizer`].
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub reset_optimizer: Option<bool>,
    /// The RoPE method this stage trains with, beside `rope_theta` [default: the
    /// checkpoint's own scaling, or none]; the export writes it into config.json.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub rope: Option<StageRope>,
}

/// A stage's `rope = { type = .., factor = .., .. }`: the RoPE extension method and its
/// parameters, with transformers' names and defaults (see docs/config.md).
#[derive(Clone, Debug, Serialize, Deserialize, PartialEq, Default)]
#[serde(deny_unknown_fields)]
pub struct StageRope {
    /// `default`, `linear`, `dynamic`, `yarn`, `llama3` or `longrope`.
    #[serde(rename = "type")]
    pub kind: String,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub factor: Option<f64>,
    /// The context the model was pretrained at (yarn, llama3, longrope; dynamic: the
    /// length past which the base grows [default: the model's max_position_embeddings]).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub original_max_position_embeddings: Option<usize>,
    /// YaRN: the ramp's rotation bounds [transformers' defaults 32 and 1].
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub beta_fast: Option<f64>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub beta_slow: Option<f64>,
    /// YaRN and LongRoPE: the cos/sin scale [default: from factor, as transformers].
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub attention_factor: Option<f64>,
    /// YaRN: attention_factor = mscale(factor, mscale) / mscale(factor, mscale_all_dim).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub mscale: Option<f64>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub mscale_all_dim: Option<f64>,
    /// Llama 3: wavelength band bounds (both required).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub low_freq_factor: Option<f64>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub high_freq_factor: Option<f64>,
    /// LongRoPE: per-frequency divisors (head_dim/2 each), short up to
    /// original_max_position_embeddings, long past it.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub short_factor: Option<Vec<f64>>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub long_factor: Option<Vec<f64>>,
}

impl StageRope {
    /// The keys each type takes besides `type` (the first ones it requires: see `check`).
    fn keys(kind: &str) -> Option<&'static [&'static str]> {
        Some(match kind {
            "default" => &[],
            "linear" => &["factor"],
            "dynamic" => &["factor", "original_max_position_embeddings"],
            "yarn" => {
                &["factor", "original_max_position_embeddings", "beta_fast", "beta_slow", "attention_factor", "mscale", "mscale_all_dim"]
            }
            "llama3" => &["factor", "original_max_position_embeddings", "low_freq_factor", "high_freq_factor"],
            "longrope" => &["short_factor", "long_factor", "original_max_position_embeddings", "factor", "attention_factor"],
            _ => return None,
        })
    }

    /// The keys that are set, by name.
    fn set_keys(&self) -> Vec<&'static str> {
        let mut out = Vec::new();
        let f = [
            ("factor", self.factor.is_some()),
            ("original_max_position_embeddings", self.original_max_position_embeddings.is_some()),
            ("beta_fast", self.beta_fast.is_some()),
            ("beta_slow", self.beta_slow.is_some()),
            ("attention_factor", self.attention_factor.is_some()),
            ("mscale", self.mscale.is_some()),
            ("mscale_all_dim", self.mscale_all_dim.is_some()),
            ("low_freq_factor", self.low_freq_factor.is_some()),
            ("high_freq_factor", self.high_freq_factor.is_some()),
            ("short_factor", self.short_factor.is_some()),
            ("long_factor", self.long_factor.is_some()),
        ];
        for (k, set) in f {
            if set {
                out.push(k);
            }
        }
        out
    }

    /// Everything that can be checked without the model: a known type, only its keys,
    /// the keys it requires, factor > 1 (≥ 1 for longrope), positive numbers. Errors are
    /// `(sub-field, message)`.
    pub fn check(&self) -> std::result::Result<(), (String, String)> {
        let ty = self.kind.as_str();
        let bad = |k: &str, m: String| Err((k.to_string(), m));
        let Some(keys) = Self::keys(ty) else {
            return bad("type", format!("unknown rope type \"{ty}\"; supported: {}", crate::model::config::ROPE_TYPES));
        };
        for k in self.set_keys() {
            if !keys.contains(&k) {
                let takes = if keys.is_empty() { "no other key".to_string() } else { keys.join(", ") };
                return bad(k, format!("not a parameter of rope type \"{ty}\" (it takes {takes})"));
            }
        }
        let positive = |k: &str, v: Option<f64>| match v {
            Some(x) if !(x.is_finite() && x > 0.0) => bad(k, format!("must be a positive number, got {x}")),
            _ => Ok(()),
        };
        for (k, v) in [
            ("beta_fast", self.beta_fast),
            ("beta_slow", self.beta_slow),
            ("attention_factor", self.attention_factor),
            ("mscale", self.mscale),
            ("mscale_all_dim", self.mscale_all_dim),
            ("low_freq_factor", self.low_freq_factor),
            ("high_freq_factor", self.high_freq_factor),
        ] {
            positive(k, v)?;
        }
        let needs_original = matches!(ty, "yarn" | "llama3" | "longrope");
        if needs_original && self.original_max_position_embeddings.is_none() {
            return bad(
                "original_max_position_embeddings",
                format!("missing; rope type \"{ty}\" scales from the pretrained context: set it to the model's pretrained length (e.g. 4096 for Llama-2)"),
            );
        }
        if self.original_max_position_embeddings == Some(0) {
            return bad("original_max_position_embeddings", "must be a positive integer, got 0".into());
        }
        match (ty, self.factor) {
            ("default", _) => {}
            ("longrope", Some(f)) if !(f.is_finite() && f >= 1.0) => {
                return bad("factor", format!("must be a number >= 1 for rope type \"longrope\", got {f}"))
            }
            ("longrope", _) => {}
            (_, None) => {
                return bad("factor", format!("missing; rope type \"{ty}\" needs a factor > 1 (target length / pretrained length)"))
            }
            (_, Some(f)) if !(f.is_finite() && f > 1.0) => {
                return bad("factor", format!("must be a number > 1 for rope type \"{ty}\" (1 leaves RoPE unchanged), got {f}"))
            }
            _ => {}
        }
        if ty == "llama3" {
            match (self.low_freq_factor, self.high_freq_factor) {
                (Some(lo), Some(hi)) if hi <= lo => {
                    return bad("high_freq_factor", format!("must be larger than low_freq_factor ({lo}), got {hi}"))
                }
                (Some(_), Some(_)) => {}
                (None, _) => return bad("low_freq_factor", "missing; required by rope type \"llama3\" (Llama 3.1 uses 1)".into()),
                (_, None) => return bad("high_freq_factor", "missing; required by rope type \"llama3\" (Llama 3.1 uses 4)".into()),
            }
        }
        if ty == "longrope" {
            for (k, v) in [("short_factor", &self.short_factor), ("long_factor", &self.long_factor)] {
                match v {
                    None => return bad(k, "missing; required by rope type \"longrope\" (a list of head_dim/2 numbers)".into()),
                    Some(xs) => {
                        if let Some(x) = xs.iter().find(|x| !(x.is_finite() && **x > 0.0)) {
                            return bad(k, format!("every entry must be a positive number, got {x}"));
                        }
                    }
                }
            }
        }
        Ok(())
    }

    /// The scaling for a model of `head_dim` exported with `max_position_embeddings`
    /// (`None` for `default`); checks the longrope lists' length (head_dim/2). Errors are
    /// `(sub-field, message)`.
    pub fn scaling(
        &self,
        head_dim: usize,
        max_position_embeddings: usize,
    ) -> std::result::Result<Option<crate::model::RopeScaling>, (String, String)> {
        use crate::model::RopeScaling as R;
        self.check()?;
        let omax = self.original_max_position_embeddings;
        let factor = self.factor.unwrap_or(1.0);
        Ok(Some(match self.kind.as_str() {
            "default" => return Ok(None),
            "linear" => R::Linear { factor },
            "dynamic" => R::Dynamic { factor },
            "yarn" => R::Yarn {
                factor,
                original_max_position_embeddings: omax,
                beta_fast: self.beta_fast,
                beta_slow: self.beta_slow,
                mscale: self.mscale,
                mscale_all_dim: self.mscale_all_dim,
                attention_factor: self.attention_factor,
                truncate: None,
            },
            "llama3" => R::Llama3 {
                factor,
                low_freq_factor: self.low_freq_factor.unwrap_or(1.0),
                high_freq_factor: self.high_freq_factor.unwrap_or(4.0),
                original_max_position_embeddings: omax.unwrap_or(max_position_embeddings),
            },
            _ => {
                let omax = omax.unwrap_or(max_position_embeddings);
                let list = |k: &str, v: &Option<Vec<f64>>| -> std::result::Result<Vec<f64>, (String, String)> {
                    let xs = v.clone().unwrap_or_default();
                    if xs.len() != head_dim / 2 {
                        return Err((
                            k.to_string(),
                            format!(
                                "has {} numbers; expected head_dim/2 = {} (one per rotated pair of the model's head_dim {head_dim})",
                                xs.len(),
                                head_dim / 2
                            ),
                        ));
                    }
                    Ok(xs)
                };
                R::LongRope {
                    short_factor: list("short_factor", &self.short_factor)?,
                    long_factor: list("long_factor", &self.long_factor)?,
                    // Resolved here (transformers: max_position_embeddings / original when
                    // absent) and written into the export, so that a changed
                    // max_position_embeddings there cannot change the trained attention factor.
                    factor: self.factor.unwrap_or(max_position_embeddings as f64 / omax as f64),
                    attention_factor: self.attention_factor,
                    original_max_position_embeddings: omax,
                }
            }
        }))
    }
}

impl Stage {
    /// The model config stage `index` trains with: `rope_theta`, and its `rope` method
    /// when it has one (else the checkpoint's own scaling). Dynamic NTK grows the base past
    /// `max_position_embeddings`, which is set to the stage's
    /// `original_max_position_embeddings` when given. `source` names the run config.
    pub fn model_config(&self, model: &crate::model::LlamaConfig, index: usize, source: &Path) -> Result<crate::model::LlamaConfig> {
        let Some(r) = &self.rope else { return Ok(model.with_rope_theta(self.rope_theta)) };
        // The max_position_embeddings the export writes for this stage (LongRoPE's factor
        // defaults to it over the original, as transformers computes from that file).
        let exported_max = self.seq_length.max(model.max_position_embeddings);
        let scaling =
            r.scaling(model.head_dim, exported_max).map_err(|(k, m)| Error::config(source, format!("stage[{index}].rope.{k}"), m))?;
        let mut cfg = model.with_rope(self.rope_theta, scaling);
        if let (Some(crate::model::RopeScaling::Dynamic { .. }), Some(o)) = (&cfg.rope_scaling, r.original_max_position_embeddings) {
            cfg.set_max_position_embeddings(o);
        }
        Ok(cfg)
    }

    /// A stage of `steps` optimizer steps at `seq_length` tokens and RoPE base `rope_theta`,
    /// every other setting from the run.
    pub fn new(seq_length: usize, rope_theta: f64, steps: u64) -> Self {
        Self {
            seq_length,
            rope_theta,
            steps,
            learning_rate: None,
            parallel_mode: None,
            fpdt_chunk_size: None,
            seed: None,
            dataset: None,
            column: None,
            batch_size: None,
            gradient_accumulate_every: None,
            warmup_steps: None,
            reset_optimizer: None,
            rope: None,
        }
    }
}

/// The settings stage `index` runs with: its own values, else the run's
/// ([`RunConfig::stage_settings`]).
#[derive(Clone, Debug, PartialEq)]
pub struct StageSettings {
    pub index: usize,
    pub seq_length: usize,
    pub mode: ParallelMode,
    pub seed: u64,
    pub dataset: String,
    pub column: Option<String>,
    pub batch_size: usize,
    pub gradient_accumulate_every: usize,
    pub learning_rate: f64,
    pub warmup_steps: u64,
    pub reset_optimizer: bool,
    /// The stage reads the `[[data.source]]` mixture (it names no dataset of its own and
    /// the run has sources); `dataset` is then the mixture's first source.
    pub mixture: bool,
    /// Sequence-parallel and data-parallel degrees under this stage's mode.
    pub sp: usize,
    pub dp: usize,
}

impl StageSettings {
    /// Sequences per optimizer step over all data-parallel ranks.
    pub fn samples_per_step(&self) -> u64 {
        (self.batch_size as u64).saturating_mul(self.gradient_accumulate_every as u64).saturating_mul(self.dp as u64)
    }

    /// Tokens per optimizer step: batch × accumulation × data-parallel ranks × length.
    pub fn tokens_per_step(&self) -> u64 {
        self.samples_per_step().saturating_mul(self.seq_length as u64)
    }
}

#[derive(Clone, Debug, Serialize, Deserialize, PartialEq, Default)]
#[serde(deny_unknown_fields, default)]
pub struct ExportSection {
    /// rope_theta written into the exported config.json (default: the last stage's).
    pub final_rope_theta: Option<f64>,
    /// max_position_embeddings written (default: the last stage's seq_length, or the
    /// model's own if larger).
    pub max_position_embeddings: Option<usize>,
    /// Largest shard, bytes.
    pub max_shard_bytes: Option<u64>,
    /// dtype of the exported weights (default: the checkpoint's torch_dtype, else f32... bf16).
    pub dtype: Option<String>,
}

#[derive(Clone, Debug, Serialize, Deserialize, PartialEq)]
#[serde(deny_unknown_fields, default)]
pub struct RunConfig {
    pub seed: u64,
    pub output_dir: PathBuf,
    // A section a TOML file leaves out gets that section's documented defaults
    // (`docs/config.md`), not the embedded demo's (lr 3e-3, batch 8, 256-token chunks).
    #[serde(default)]
    pub model: ModelSection,
    #[serde(default)]
    pub data: DataSection,
    #[serde(default)]
    pub train: TrainSection,
    #[serde(default)]
    pub parallel: ParallelSection,
    #[serde(default, skip_serializing_if = "AttentionSection::is_default")]
    pub attention: AttentionSection,
    #[serde(rename = "stage")]
    pub stages: Vec<Stage>,
    #[serde(default)]
    pub export: ExportSection,
    /// Evaluation at stage ends (and every `eval.every` steps) while training; off unless
    /// `eval.dataset` is set ([`crate::train::stage_eval`]).
    #[serde(default, skip_serializing_if = "EvalSection::is_off")]
    pub eval: EvalSection,
    /// A DeepSpeed config's keys, as in its JSON (`[deepspeed]` with `[deepspeed.zero_optimization]`
    /// etc.), mapped onto the sections above at start-up ([`crate::train::deepspeed`]);
    /// `--deepspeed FILE` replaces it.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub deepspeed: Option<serde_json::Value>,
}

impl Default for RunConfig {
    /// The embedded default: the demo main job. A tiny built-in Llama learns retrieval
    /// (`synthetic:retrieval-answer`: passkey and variable-tracking samples alternating,
    /// loss on the answers) at 32 tokens / θ 1e4, θ is raised to 1e5 at 256 tokens, then
    /// the context is extended to 1024 tokens (the stage-by-stage shape of the EasyContext
    /// recipes, scaled down to a laptop CPU). Measured (2 cores, release build, 87 s,
    /// 2026-12-01; 32 cases a cell, `eval ruler`): at 1024 the passkey 100 %, variable
    /// tracking 69 % recall and 40 % of its answer tokens (chance 18 % and 6 %). Tried:
    /// 600 at 32 + 100 at 1024 (145 s): 100 %, 67 %, 42 %; 600 + 60: 78 %, 63 % (recall
    /// over 11 output tokens); the passkey-only demo before (200 + 60) had no variable
    /// tracking to learn.
    fn default() -> Self {
        let stage = Stage::new;
        Self {
            seed: 42,
            output_dir: PathBuf::from("runs/demo"),
            model: ModelSection::default(),
            data: DataSection { dataset: "synthetic:retrieval-answer".into(), ..Default::default() },
            train: TrainSection { learning_rate: 3e-3, warmup_steps: 10, batch_size: 8, ..Default::default() },
            parallel: ParallelSection { token_chunk: 256, ..Default::default() },
            attention: AttentionSection::default(),
            stages: vec![stage(32, 10_000.0, 600), stage(256, 100_000.0, 150), stage(1024, 100_000.0, 50)],
            export: ExportSection::default(),
            eval: EvalSection::default(),
            deepspeed: None,
        }
    }
}

impl RunConfig {
    /// Defaults for a user's own model/data given by flags: the demo's model, data and
    /// stages, but plain training settings (batch 1, lr 2e-5, no warmup, token chunk 4096).
    pub fn plain() -> Self {
        Self {
            data: DataSection { dataset: "synthetic:passkey".into(), ..Default::default() },
            train: TrainSection::default(),
            parallel: ParallelSection::default(),
            ..Self::default()
        }
    }

    /// Read a TOML run config; unknown or mistyped fields are errors naming the field.
    pub fn from_file(path: &Path) -> Result<Self> {
        let text = std::fs::read_to_string(path).map_err(|e| Error::io(path, e))?;
        // A syntax error names no field: say where it is (line and column).
        if let Err(e) = text.parse::<toml::Table>() {
            let start = e.span().map_or(0, |s| s.start).min(text.len());
            let line = text[..start].matches('\n').count() + 1;
            let column = text[..start].rsplit('\n').next().map_or(0, |l| l.chars().count()) + 1;
            let mut msg = format!("not valid TOML: {}", e.message().trim_end());
            if msg.contains("as i128") {
                msg.push_str(&format!(" (TOML integers must lie within ±{}; use a smaller number)", i64::MAX));
            }
            return Err(Error::Syntax { file: path.to_path_buf(), line, column, msg });
        }
        let mut cfg: RunConfig = toml::from_str(&text).map_err(|e| {
            let field = e.span().map(|s| toml_field_at(&text, s)).unwrap_or_default();
            Error::config(path, field, e.message().to_string())
        })?;
        // A file that names no stage gets none (not the demo's): `validate` then asks for one.
        let has_stages = text.parse::<toml::Table>().map(|t| t.contains_key("stage")).unwrap_or(false);
        if !has_stages {
            cfg.stages.clear();
        }
        Ok(cfg)
    }

    /// The sequence-parallel degree of a stage run under `mode` (see [`ParallelMode::sp_degree`]).
    pub fn sp_size_for(&self, mode: ParallelMode) -> usize {
        mode.sp_degree(self.parallel.world_size, self.parallel.sp_size)
    }

    /// What stage `index` runs with: its own settings, else the run's (see [`Stage`]).
    /// Panics on nothing: an index past the stages gives the run's values at length 0.
    pub fn stage_settings(&self, index: usize) -> StageSettings {
        let (t, d) = (&self.train, &self.data);
        let fallback = Stage::new(0, 0.0, 0);
        let st = self.stages.get(index).unwrap_or(&fallback);
        let mode = st.parallel_mode.unwrap_or(self.parallel.mode);
        let sp = self.sp_size_for(mode).max(1);
        StageSettings {
            index,
            seq_length: st.seq_length,
            mode,
            seed: st.seed.unwrap_or(self.seed.wrapping_add(index as u64)),
            dataset: st.dataset.clone().or_else(|| d.sources.first().map(|m| m.dataset.clone())).unwrap_or_else(|| d.dataset.clone()),
            mixture: st.dataset.is_none() && !d.sources.is_empty(),
            column: st.column.clone().or_else(|| d.column.clone()),
            batch_size: st.batch_size.unwrap_or(t.batch_size),
            gradient_accumulate_every: st.gradient_accumulate_every.unwrap_or(t.gradient_accumulate_every),
            learning_rate: st.learning_rate.unwrap_or(t.learning_rate),
            warmup_steps: st.warmup_steps.unwrap_or(t.warmup_steps),
            reset_optimizer: st.reset_optimizer.unwrap_or(t.reset_optimizer && index > 0),
            sp,
            dp: (self.parallel.world_size / sp).max(1),
        }
    }

    /// The learning-rate schedule stage `index` runs with ([`RunConfig::stage_settings`]).
    pub fn lr_schedule(&self, index: usize) -> LrSchedule {
        let s = self.stage_settings(index);
        self.train.lr_schedule_for(s.learning_rate, s.warmup_steps, self.stages.get(index).map_or(0, |st| st.steps))
    }

    /// `parallel.collective_timeout_s` as a duration; `None` = no timeout.
    pub fn collective_timeout(&self) -> Option<std::time::Duration> {
        let s = self.parallel.collective_timeout_s;
        (s > 0.0 && s.is_finite()).then(|| std::time::Duration::from_secs_f64(s))
    }

    /// Check everything that can be checked without the model; `source` names where the
    /// values came from (a file or "flags") for the messages.
    pub fn validate(&self, source: &Path) -> Result<()> {
        let bad = |field: &str, msg: String| Err(Error::config(source, field, msg));
        if self.stages.is_empty() {
            return bad(
                "stage",
                "no stage given; add a [[stage]] with seq_length, rope_theta and steps (or pass --seq-length and --rope-theta)".into(),
            );
        }
        crate::train::trainer::parse_dtype(&self.model.dtype, source, "model.dtype")?; // checked on the CPU too
        if let Some(d) = &self.export.dtype {
            crate::train::trainer::parse_dtype(d, source, "export.dtype")?;
        }
        self.validate_numbers(source)?;
        self.validate_sizes(source)?;
        self.data.validate(source)?;
        let p = &self.parallel;
        if !p.collective_timeout_s.is_finite() || p.collective_timeout_s < 0.0 {
            return bad(
                "parallel.collective_timeout_s",
                format!("must be a number of seconds >= 0 (0 = no timeout), got {}", p.collective_timeout_s),
            );
        }
        if p.offload_activations && p.offload_layer_inputs {
            return bad(
                "parallel.offload_layer_inputs",
                "set together with parallel.offload_activations, which already keeps the layer inputs (and the rest of what \
                 is saved) in host memory; keep one of the two"
                    .into(),
            );
        }
        self.validate_stages(source)?;
        self.eval.validate(source)?;
        let longest = self.stages.iter().map(|s| s.seq_length).max().unwrap_or(0);
        if let Some(&l) = self.eval.lengths.iter().find(|&&l| l > longest) {
            return bad(
                "eval.lengths",
                format!("{l} is longer than every stage (the longest trains {longest} tokens); evaluate longer contexts with `longctx eval ppl` on the export"),
            );
        }
        if let Some(t) = self.export.final_rope_theta {
            if !t.is_finite() || t <= 0.0 {
                return bad("export.final_rope_theta", format!("must be a positive number, got {t}"));
            }
        }
        Ok(())
    }

    /// The optimization numbers: each finite and within its range (see the messages).
    fn validate_numbers(&self, source: &Path) -> Result<()> {
        let t = &self.train;
        let real = |field: &str, v: f64, lo: f64, lo_open: bool, hi: f64, hi_open: bool| -> Result<()> {
            let below = if lo_open { v <= lo } else { v < lo };
            let above = if hi_open { v >= hi } else { v > hi };
            if v.is_finite() && !below && !above {
                return Ok(());
            }
            let (l, h) = (if lo_open { "(" } else { "[" }, if hi_open || hi == f64::MAX { ")" } else { "]" });
            let hi = if hi == f64::MAX { "∞".to_string() } else { hi.to_string() };
            Err(Error::config(source, field, format!("got {v}, expected a number in {l}{lo}, {hi}{h}")))
        };
        real("train.learning_rate", t.learning_rate, 0.0, true, MAX_LEARNING_RATE, false)?;
        for (i, st) in self.stages.iter().enumerate() {
            if let Some(lr) = st.learning_rate {
                real(&format!("stage[{i}].learning_rate"), lr, 0.0, true, MAX_LEARNING_RATE, false)?;
            }
        }
        real("train.min_lr_ratio", t.min_lr_ratio, 0.0, false, 1.0, false)?;
        real("train.warmup_min_ratio", t.warmup_min_ratio, 0.0, false, 1.0, false)?;
        if t.warmup_type == Some(WarmupType::Log) && !t.lr_schedule.is_deepspeed() {
            return Err(Error::config(
                source,
                "train.warmup_type",
                format!(
                    "\"log\" is the warm-up of DeepSpeed's schedules (warmup_lr, warmup_decay_lr, warmup_cosine_lr); \
                     lr_schedule \"{}\" warms up linearly: remove warmup_type or choose one of those schedules",
                    t.lr_schedule.name()
                ),
            ));
        }
        real("train.clip_grad", t.clip_grad, 0.0, false, f64::MAX, false)?;
        real("train.adamw.beta1", t.adamw.beta1, 0.0, false, 1.0, true)?;
        real("train.adamw.beta2", t.adamw.beta2, 0.0, false, 1.0, true)?;
        real("train.adamw.eps", t.adamw.eps, 0.0, true, 1.0, false)?;
        real("train.adamw.weight_decay", t.adamw.weight_decay, 0.0, false, 1.0, false)?;
        real("train.checkpoint_interval_min", t.checkpoint_interval_min, 0.0, false, 1e7, false)?;
        if let Some(p) = t.peak_tflops {
            real("train.peak_tflops", p, 0.0, true, 1e7, false)?;
        }
        if t.zero_stage > 3 {
            return Err(Error::config(
                source,
                "train.zero_stage",
                format!("got {}, expected 0, 1, 2 or 3 (DeepSpeed's stages)", t.zero_stage),
            ));
        }
        if !t.save && t.checkpoint_every > 0 {
            return Err(Error::config(
                source,
                "train.checkpoint_every",
                format!("got {} with `train.save = false` (--no-save), which writes no checkpoint: drop one of them", t.checkpoint_every),
            ));
        }
        if t.offload_params && t.zero_stage != 3 {
            return Err(Error::config(
                source,
                "train.offload_params",
                format!("parameter offload needs `train.zero_stage = 3` (got {}); set it, or turn the offload off", t.zero_stage),
            ));
        }
        if t.offload_gradients && !(t.zero_stage >= 2 && t.optimizer_on_host) {
            return Err(Error::config(
                source,
                "train.offload_gradients",
                format!(
                    "the gradients go to host memory unit by unit under ZeRO stage 2 or 3, for the optimizer there (got \
                     zero_stage = {}, optimizer_on_host = {}); set zero_stage = 2 or 3 and optimizer_on_host = true \
                     (--zero-stage 3 --optimizer-on-host), or turn it off",
                    t.zero_stage, t.optimizer_on_host
                ),
            ));
        }
        if t.optimizer_device_units > 0 && !t.optimizer_on_host {
            return Err(Error::config(
                source,
                "train.optimizer_device_units",
                format!(
                    "got {} without `train.optimizer_on_host`: the whole AdamW state is on the GPU already; set \
                     `optimizer_on_host = true` (--optimizer-on-host) to keep the other units' on the host, or drop it",
                    t.optimizer_device_units
                ),
            ));
        }
        check_range(source, "train.optimizer_device_units", t.optimizer_device_units as u64, 0, 1 << 20)?;
        if t.zero_stage >= 2 && t.layer_backward != crate::train::engine::LayerBackward::Explicit {
            return Err(Error::config(
                source,
                "train.layer_backward",
                format!("ZeRO stage {} reduces gradients layer by layer: it needs the explicit backward (`explicit`)", t.zero_stage),
            ));
        }
        let steps = |field: &str, v: u64, lo: u64| check_range(source, field, v, lo, MAX_STEPS);
        steps("train.warmup_steps", t.warmup_steps, 0)?;
        if let Some(n) = t.schedule_steps {
            steps("train.schedule_steps", n, 1)?;
        }
        steps("train.max_skipped_steps", t.max_skipped_steps, 1)?;
        for (i, st) in self.stages.iter().enumerate() {
            if let Some(w) = st.warmup_steps {
                steps(&format!("stage[{i}].warmup_steps"), w, 0)?;
            }
        }
        Ok(())
    }

    /// Sizes: each within [`crate::limits`], and the tokens of one micro-batch computed
    /// without overflow, so nothing huge is allocated before it is refused.
    fn validate_sizes(&self, source: &Path) -> Result<()> {
        let (p, t) = (&self.parallel, &self.train);
        check_range(source, "parallel.world_size", p.world_size, 1, MAX_WORLD_SIZE)?;
        check_range(source, "parallel.sp_size", p.sp_size, 0, MAX_WORLD_SIZE)?;
        check_range(source, "parallel.ulysses_size", p.ulysses_size, 0, MAX_WORLD_SIZE)?;
        check_range(source, "parallel.token_chunk", p.token_chunk, 1, MAX_SEQ_LEN)?;
        check_range(source, "parallel.fpdt_chunk_size", p.fpdt_chunk_size, 1, MAX_SEQ_LEN)?;
        if let Some(n) = p.save_mlp_layers {
            check_range(source, "parallel.save_mlp_layers", n, 1, MAX_LAYERS)?;
        }
        check_range(source, "train.batch_size", t.batch_size, 1, MAX_BATCH)?;
        check_range(source, "train.gradient_accumulate_every", t.gradient_accumulate_every, 1, MAX_BATCH)?;
        check_range(source, "data.shuffle_buffer", self.data.shuffle_buffer, 0, MAX_SHUFFLE_BUFFER)?;
        for (i, st) in self.stages.iter().enumerate() {
            let f = |name: &str| format!("stage[{i}].{name}");
            check_range(source, &f("seq_length"), st.seq_length, 1, MAX_SEQ_LEN)?;
            check_range(source, &f("steps"), st.steps, 1, MAX_STEPS)?;
            if let Some(c) = st.fpdt_chunk_size {
                check_range(source, &f("fpdt_chunk_size"), c, 1, MAX_SEQ_LEN)?;
            }
            if let Some(b) = st.batch_size {
                check_range(source, &f("batch_size"), b, 1, MAX_BATCH)?;
            }
            if let Some(g) = st.gradient_accumulate_every {
                check_range(source, &f("gradient_accumulate_every"), g, 1, MAX_BATCH)?;
            }
            for (key, v) in [("dataset", &st.dataset), ("column", &st.column)] {
                if v.as_deref().is_some_and(|v| v.trim().is_empty()) {
                    return Err(Error::config(source, f(key), "is empty; name one, or leave the key out to use the run's"));
                }
            }
            let batch = st.batch_size.unwrap_or(t.batch_size);
            let tokens = (batch as u64).saturating_mul(st.seq_length as u64 + 1);
            if tokens > MAX_BATCH_TOKENS {
                let field = if st.batch_size.is_some() { f("batch_size") } else { "train.batch_size".into() };
                return Err(Error::config(
                    source,
                    &field,
                    format!(
                        "batch_size {batch} × (stage[{i}].seq_length {} + 1) = {tokens} tokens per micro-batch, more than {MAX_BATCH_TOKENS}; \
                         lower the batch size or the length",
                        st.seq_length
                    ),
                ));
            }
        }
        let e = &self.export;
        if let Some(n) = e.max_position_embeddings {
            check_range(source, "export.max_position_embeddings", n, 1, MAX_SEQ_LEN)?;
        }
        if let Some(n) = e.max_shard_bytes {
            check_range(source, "export.max_shard_bytes", n, 1, u64::MAX)?;
        }
        Ok(())
    }

    /// Every stage's `rope` against the model (the longrope lists' length is head_dim/2).
    pub fn check_stage_ropes(&self, model: &crate::model::LlamaConfig, source: &Path) -> Result<()> {
        for (i, st) in self.stages.iter().enumerate() {
            st.model_config(model, i, source)?;
        }
        Ok(())
    }

    /// The stages: positive values, non-decreasing length and θ, a valid `rope`, and each length split
    /// by its mode ([`ParallelMode::check_seq_len`]).
    fn validate_stages(&self, source: &Path) -> Result<()> {
        let bad = |field: &str, msg: String| Err(Error::config(source, field, msg));
        let p = &self.parallel;
        let (mut prev_len, mut prev_theta) = (0usize, 0f64);
        for (i, st) in self.stages.iter().enumerate() {
            let f = |name: &str| format!("stage[{i}].{name}");
            if !st.rope_theta.is_finite() || st.rope_theta <= 0.0 {
                return bad(&f("rope_theta"), format!("must be a positive number, got {}", st.rope_theta));
            }
            if st.seq_length < prev_len || st.rope_theta < prev_theta {
                return bad(
                    &f("seq_length"),
                    format!(
                        "stages must not decrease: stage {i} has seq_length {} / rope_theta {} after {prev_len} / {prev_theta}; order stages by increasing length and theta",
                        st.seq_length, st.rope_theta
                    ),
                );
            }
            (prev_len, prev_theta) = (st.seq_length, st.rope_theta);
            if let Some(r) = &st.rope {
                r.check().or_else(|(k, m)| bad(&f(&format!("rope.{k}")), m))?;
            }
            let mode = st.parallel_mode.unwrap_or(p.mode);
            let sp = self.sp_size_for(mode);
            if sp == 0 || !p.world_size.is_multiple_of(sp) {
                return bad("parallel.sp_size", format!("world_size {} is not a multiple of sp_size {sp}", p.world_size));
            }
            let chunk = st.fpdt_chunk_size.unwrap_or(p.fpdt_chunk_size);
            let ulysses = mode.ulysses_degree(sp, mode.ulysses_setting(p.ulysses_size)).unwrap_or(1);
            if let Err((field, msg)) = mode.check_seq_len(st.seq_length, sp, ulysses, chunk) {
                let field = match field {
                    LengthField::SeqLength => f("seq_length"),
                    LengthField::FpdtChunkSize => "parallel.fpdt_chunk_size".into(),
                    LengthField::UlyssesSize => "parallel.ulysses_size".into(),
                };
                return bad(&field, msg);
            }
        }
        Ok(())
    }
}

/// The dotted key a TOML parse error points at (`parallel.mode`, `stage[1].steps`): the
/// key of the `key = value` line holding the span, under the nearest table header above;
/// the span's own text when it is not on such a line (an unknown key names itself).
fn toml_field_at(text: &str, span: std::ops::Range<usize>) -> String {
    let start = span.start.min(text.len());
    let spanned = text.get(span.clone()).and_then(|t| t.lines().next()).unwrap_or("").trim().to_string();
    let line_start = text[..start].rfind('\n').map_or(0, |i| i + 1);
    let line = text[line_start..].lines().next().unwrap_or("");
    let Some((key, _)) = line.split_once('=') else { return spanned };
    let key = key.trim().trim_matches('"');
    if key.is_empty() || key.starts_with('[') || key.starts_with('#') {
        return spanned;
    }
    // Nearest table header above; count array-of-tables entries of that name.
    let mut section = String::new();
    let mut counts: std::collections::HashMap<String, usize> = std::collections::HashMap::new();
    for l in text[..line_start].lines() {
        let l = l.trim();
        if let Some(name) = l.strip_prefix("[[").and_then(|r| r.split_once("]]")).map(|(n, _)| n.trim().to_string()) {
            let n = counts.entry(name.clone()).or_insert(0);
            section = format!("{name}[{n}]");
            *n += 1;
        } else if let Some(name) = l.strip_prefix('[').and_then(|r| r.split_once(']')).map(|(n, _)| n.trim().to_string()) {
            section = name;
        }
    }
    if section.is_empty() {
        key.to_string()
    } else {
        format!("{section}.{key}")
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn default_is_valid() {
        RunConfig::default().validate(Path::new("<default>")).unwrap();
    }

    #[test]
    fn rejects_bad_settings() {
        let src = Path::new("run.toml");
        let mut c = RunConfig::default();
        c.stages[1].seq_length = 16;
        let e = c.validate(src).unwrap_err().to_string();
        assert!(e.contains("stage[1].seq_length") && e.contains("must not decrease"), "{e}");

        let mut c = RunConfig::default();
        c.stages[0].rope_theta = -1.0;
        let e = c.validate(src).unwrap_err().to_string();
        assert!(e.contains("rope_theta") && e.contains("positive"), "{e}");

        let mut c = RunConfig::default();
        c.parallel.mode = ParallelMode::ZigzagRingAttn;
        c.parallel.world_size = 3;
        c.stages[0].seq_length = 250;
        let e = c.validate(src).unwrap_err().to_string();
        assert!(e.contains("multiple of 2·3 = 6"), "{e}");

        let mut c = RunConfig::default();
        c.parallel.mode = ParallelMode::Fpdt;
        c.parallel.world_size = 2;
        c.parallel.fpdt_chunk_size = 96;
        let e = c.validate(src).unwrap_err().to_string();
        assert!(e.contains("multiple of the chunk size 96"), "{e}");

        let mut c = RunConfig::default();
        c.parallel.save_mlp_layers = Some(0);
        let e = c.validate(src).unwrap_err().to_string();
        assert!(e.contains("parallel.save_mlp_layers"), "{e}");
        // The count applies without save_mlp, at most the model's layers.
        c.parallel.save_mlp_layers = Some(3);
        c.validate(src).unwrap();
        assert_eq!(c.parallel.mlp_saved_layers(32), 3);
        assert_eq!(c.parallel.mlp_saved_layers(2), 2);
        c.parallel.save_mlp_layers = None;
        assert_eq!(c.parallel.mlp_saved_layers(32), 0);
        c.parallel.save_mlp = true;
        assert_eq!(c.parallel.mlp_saved_layers(32), 32);
    }

    #[test]
    fn toml_unknown_field_is_named() {
        let dir = std::env::temp_dir().join(format!("longctx-cfg-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let p = dir.join("bad.toml");
        std::fs::write(&p, "[train]\nbatch_sise = 2\n").unwrap();
        let e = RunConfig::from_file(&p).unwrap_err().to_string();
        assert!(e.contains("bad.toml") && e.contains("batch_sise"), "{e}");
        std::fs::write(&p, "[[stage]]\nseq_length = 1024\nrope_theta = 1e6\nsteps = 3\n[parallel]\nmode = \"zigzag_ring_attn\"\n").unwrap();
        let c = RunConfig::from_file(&p).unwrap();
        assert_eq!(c.parallel.mode, ParallelMode::ZigzagRingAttn);
        assert_eq!(c.stages.len(), 1);
        // Sections the file leaves out get their documented defaults, not the demo's.
        assert_eq!(c.train, TrainSection::default());
        assert_eq!(c.data, DataSection::default());
        assert_eq!(c.parallel.token_chunk, ParallelSection::default().token_chunk);
        assert_ne!(c.train.learning_rate, RunConfig::default().train.learning_rate, "the demo's lr must not leak in");
        assert_eq!((c.seed, c.output_dir.clone()), (RunConfig::default().seed, RunConfig::default().output_dir));
    }

    #[test]
    fn attention_kernel_is_read_checked_and_saved() {
        use longctx_attention::kernel::CudaKernel;
        let dir = std::env::temp_dir().join(format!("longctx-cfg-kernel-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let p = dir.join("run.toml");
        let stage = "[[stage]]\nseq_length = 64\nrope_theta = 1e4\nsteps = 1\n";
        std::fs::write(&p, format!("[attention]\nkernel = \"native\"\n{stage}")).unwrap();
        assert_eq!(RunConfig::from_file(&p).unwrap().attention.kernel, CudaKernel::Native);
        std::fs::write(&p, stage).unwrap();
        assert_eq!(RunConfig::from_file(&p).unwrap().attention.kernel, CudaKernel::Auto, "the default");
        std::fs::write(&p, format!("[attention]\nkernel = \"flash\"\n{stage}")).unwrap();
        let e = RunConfig::from_file(&p).unwrap_err().to_string();
        assert!(e.contains("run.toml") && e.contains("flash") && e.contains("cudnn") && e.contains("native"), "{e}");
        std::fs::write(&p, format!("[attention]\nkernal = \"native\"\n{stage}")).unwrap();
        let e = RunConfig::from_file(&p).unwrap_err().to_string();
        assert!(e.contains("kernal"), "{e}");
        std::fs::remove_dir_all(&dir).unwrap();
        // A saved config keeps a chosen kernel and leaves the default out (the configs of
        // runs saved before the section existed compare equal on resume).
        assert!(!toml::to_string(&RunConfig::default()).unwrap().contains("[attention]"));
        let mut c = RunConfig::default();
        c.attention.kernel = CudaKernel::Native;
        let back: RunConfig = toml::from_str(&toml::to_string(&c).unwrap()).unwrap();
        assert_eq!(back, c);
        c.attention.kernel = CudaKernel::Cudnn; // no longer the default: kept
        assert!(toml::to_string(&c).unwrap().contains("kernel = \"cudnn\""));
        let back: RunConfig = toml::from_str(&toml::to_string(&c).unwrap()).unwrap();
        assert_eq!(back, c);
    }
}
