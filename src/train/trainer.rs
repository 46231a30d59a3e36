//! The training loop: stages of increasing length and rope_theta, each step
//! `forward+backward (engine) → reduce grads → clip → AdamW (ZeRO-1) → write back`.
//!
//! Ranks: in-process (threads sharing the device, `parallel.world_size`) or, under
//! `longctx launch`/torchrun/Slurm, one process per GPU (NCCL builds). Every rank runs
//! [`rank_main`] in lockstep; rank 0 prints, writes metrics, checkpoints and the export.
//!
//! Exactness: the loss is Σ token losses / Σ counted tokens over all ranks and all
//! micro-batches of the step (the count is all-reduced *before* the backward and used as
//! the gradient scale), never a mean of means.
//!
//! Reliability (`docs/reliability.md`): the output directory is locked and a run in it is
//! not overwritten by accident (`rundir`); a resume is checked against the saved config
//! (`resume_check`); a step whose gradient norm or loss is not finite is skipped (every
//! rank sees the same all-reduced value), `train.max_skipped_steps` of them in a row
//! abort; weights are checked after every update and, with the optimizer state, before
//! every checkpoint, so nothing non-finite is written; a stop request (SIGINT/SIGTERM,
//! [`StopFlag`]) or a due time-based checkpoint is all-reduced with the step's loss so
//! that every rank checkpoints after the same step.

use crate::data::loader::{DataSpec, DataState, FilesConfig, Loader, Shard};
use crate::data::synthetic::PasskeyConfig;
use crate::eval::forward::Ranks;
use crate::model::{LlamaConfig, Rope};
use crate::parallel::dims::{build_groups, Groups, ParallelDims, ParallelMode};
use crate::train::checkpoint::{self, TrainState};
use crate::train::config::{RunConfig, Stage, StageSettings};
use crate::train::engine::{Engine, EngineOptions, MemoryReport};
use crate::train::metrics::{Metrics, StepLine};
use crate::train::profile::Phase;
use crate::train::rundir::{self, RunDirLock};
use crate::train::stage_eval::{EvalAt, StageEval};
pub use crate::train::stop::StopFlag;
pub use crate::train::zero::Resident;
use crate::train::zero::{all_reduce_scalar, ranks_flagging, Guard, Start, StepStats, Update, ZeroConfig, ZeroState};
use crate::{Error, Result};
use candle_core::{DType, Device, Tensor, Var};
use longctx_attention::comm::Comm;
use longctx_attention::AttentionMode;
use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Instant;

/// What a run produced.
#[derive(Debug, Clone)]
pub struct RunSummary {
    /// Mean loss of the first and last optimizer step of every stage this invocation ran
    /// (a resumed run: from the stage it resumed in), with the stage's index.
    pub stage_losses: Vec<(usize, f64, f64)>,
    /// Optimizer steps done over the whole run (counted across resumes).
    pub steps: u64,
    /// Of them, done by this invocation (less than `steps` when resumed).
    pub run_steps: u64,
    /// Tokens trained on over the whole run (counted across resumes).
    pub tokens: u64,
    /// Of them, by this invocation (what its tokens per second are of).
    pub run_tokens: u64,
    /// Seconds of this invocation.
    pub seconds: f64,
    /// Where the export is; None when the run writes none (`train.save = false`).
    pub export_dir: Option<PathBuf>,
    /// Largest memory report seen (rank 0).
    pub memory: MemoryReport,
    /// Most device memory in use in any step (rank 0, CUDA only).
    pub device_peak: Option<u64>,
    /// False when the run stopped before its last step ([`RunSummary::stopped`]): a
    /// checkpoint was written at the stop, no export.
    pub completed: bool,
    /// Why it stopped early, when it did.
    pub stopped: Option<StopReason>,
    /// Optimizer steps skipped over the whole run (non-finite gradient norm or loss).
    pub skipped_steps: u64,
    /// What rank 0 held of the weights, gradients and optimizer state (ZeRO, offload).
    pub resident: Resident,
    /// A resume found the run finished (its checkpoint after the last stage, its export in
    /// place): nothing was trained or written.
    pub already_finished: bool,
}

/// Why a run stopped before its last step (a checkpoint was written there).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum StopReason {
    /// [`RunOptions::stop_at_global_step`].
    AtStep,
    /// A stop request: the signal this process received, `None` when another rank's
    /// request stopped it.
    Signal(Option<i32>),
}

/// How one invocation of a run behaves (the config describes the whole run).
#[derive(Debug, Clone, Default)]
pub struct RunOptions {
    /// Stop once the run has done this many optimizer steps in total (the global step,
    /// counted across resumes), writing a checkpoint there and no export; `run(cfg, true)`
    /// then continues exactly as if the run had not stopped (a preemption, on purpose).
    /// A run resumed at or past the stop does nothing and writes nothing.
    pub stop_at_global_step: Option<u64>,
    /// A fresh run may replace a run already in the output directory (its checkpoint,
    /// metrics and export are removed first); without it, such a directory is refused.
    pub overwrite: bool,
    /// A resume may change the parallel layout (world size, mode, batch split): the
    /// optimizer state is re-cut, the run continues within rounding (see `resume_check`).
    pub allow_layout_change: bool,
    /// Checked at every step boundary: when set (by a signal handler, see
    /// [`StopFlag::install_signal_handlers`]), the run writes a checkpoint and stops.
    pub stop: Option<StopFlag>,
    /// Faults to inject (reliability tests).
    pub faults: Vec<Fault>,
}

/// A fault injected into a run, to test the numeric guards (`tests/all/numeric_guards.rs`).
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum Fault {
    /// Rank `rank`'s gradient of the first parameter is NaN in the optimizer steps
    /// `first..=last` (global step numbers, from 1).
    NanGradient { rank: usize, first: u64, last: u64 },
    /// The update of optimizer step `step` leaves the first parameter NaN on every rank
    /// (an update that exploded).
    NanWeights { step: u64 },
    /// Rank `rank`'s loss of optimizer step `step` is NaN (its gradients stay finite).
    NanLoss { rank: usize, step: u64 },
    /// Rank `rank`'s share of every step's loss and gradients is scaled by `factor`: a
    /// deliberately broken parallel run (what `longctx check` must catch).
    Skew { rank: usize, factor: f64 },
    /// Rank `rank` looks for the output directory in a place of its own, as a rank on
    /// another node with a node-local directory would (the start-up check must stop it).
    PrivateDir { rank: usize },
}

/// Environment variable the `longctx` binary reads faults from, for tests of real
/// processes: a comma-separated list of `nan-grad:RANK:FIRST-LAST`, `nan-weights:STEP`
/// `nan-loss:RANK:STEP`, `skew:RANK:FACTOR` and `private-dir:RANK` ([`Fault::parse_list`]). Not for production runs.
pub const FAULT_ENV: &str = "LONGCTX_FAULT";

impl Fault {
    /// Faults from the [`FAULT_ENV`] syntax; the error names the bad item.
    pub fn parse_list(s: &str) -> Result<Vec<Fault>> {
        let bad = |item: &str| {
            Error::Setting(format!(
                "{FAULT_ENV}: `{item}` is not `nan-grad:RANK:FIRST-LAST`, `nan-weights:STEP`, `nan-loss:RANK:STEP`, `skew:RANK:FACTOR` or `private-dir:RANK`"
            ))
        };
        let mut out = Vec::new();
        for item in s.split(',').map(str::trim).filter(|i| !i.is_empty()) {
            let parts: Vec<&str> = item.split(':').collect();
            let num = |x: &str| x.parse::<u64>().map_err(|_| bad(item));
            out.push(match parts.as_slice() {
                ["nan-grad", rank, range] => {
                    let (a, b) = range.split_once('-').ok_or_else(|| bad(item))?;
                    Fault::NanGradient { rank: num(rank)? as usize, first: num(a)?, last: num(b)? }
                }
                ["nan-weights", step] => Fault::NanWeights { step: num(step)? },
                ["nan-loss", rank, step] => Fault::NanLoss { rank: num(rank)? as usize, step: num(step)? },
                ["private-dir", rank] => Fault::PrivateDir { rank: num(rank)? as usize },
                ["skew", rank, factor] => {
                    let factor = factor.parse::<f64>().ok().filter(|f| f.is_finite()).ok_or_else(|| bad(item))?;
                    Fault::Skew { rank: num(rank)? as usize, factor }
                }
                _ => return Err(bad(item)),
            });
        }
        Ok(out)
    }
}

/// The model a run starts from, resolved once (shared by all in-process ranks).
pub struct StartModel {
    pub cfg: LlamaConfig,
    pub config_json: serde_json::Value,
    /// Host copies of the initial weights (f32 or the checkpoint dtype).
    pub weights: HashMap<String, Tensor>,
    /// Where tokenizer files come from (None for built-in models).
    pub source_dir: Option<PathBuf>,
    pub tokenizer: Option<tokenizers::Tokenizer>,
}

pub use crate::device::{parse_device, parse_dtype};

/// Resolve `model.source` into a config and initial weights (seeded random ones for a
/// built-in model), for a process running all `parallel.world_size` ranks.
pub fn load_start_model(cfg: &RunConfig) -> Result<StartModel> {
    load_start_model_for(cfg, NodeRanks::InProcess(cfg.parallel.world_size))
}

/// Where a run's ranks live on a node, for its host memory check.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum NodeRanks {
    /// This process runs this many ranks (one copy of the start weights for all).
    InProcess(usize),
    /// A launched rank, one of this many processes on its node (`LOCAL_WORLD_SIZE`),
    /// each with its own start weights.
    Launched(usize),
}

/// [`load_start_model`] for a process whose node holds `ranks`: the host memory the
/// node's ranks need is checked against the machine's before any weight is allocated.
pub fn load_start_model_for(cfg: &RunConfig, ranks: NodeRanks) -> Result<StartModel> {
    let m = crate::hub::resolve_model_config(&cfg.model.source, &crate::hub::HubOptions::from_env())?;
    let need = match ranks {
        NodeRanks::InProcess(n) => host_need(cfg, &m.cfg, n)?,
        NodeRanks::Launched(n) => host_need_on_node(cfg, &m.cfg, n)?,
    };
    crate::limits::check_host_memory(&need, crate::limits::physical_memory(), Path::new("<run config>"))?;
    cfg.check_stage_ropes(&m.cfg, Path::new("<run config>"))?; // every stage's `rope` before any work
    let (mcfg, json) = (m.cfg, m.json);
    let Some(dir) = m.dir else {
        let weights = crate::model::init::random_init(&mcfg, cfg.seed, DType::F32, &Device::Cpu)?;
        return Ok(StartModel { cfg: mcfg, config_json: json, weights, source_dir: None, tokenizer: None });
    };
    let weights = crate::hub::load_weights(&dir, DType::F32, &Device::Cpu)?;
    let tokenizer = if dir.join("tokenizer.json").is_file() { Some(crate::hub::load_tokenizer(&dir)?) } else { None };
    Ok(StartModel { cfg: mcfg, config_json: json, weights, source_dir: Some(dir), tokenizer })
}

/// What the `local` launched processes of one node keep in host memory at least: each
/// its own f32 start weights, CPU rank, saved activations and gradient slices, and its
/// shard (one of the run's `world_size`) of the host optimizer state (the whole state
/// under ZeRO stage 0) and offloaded weights.
pub fn host_need_on_node(cfg: &RunConfig, mcfg: &LlamaConfig, local: usize) -> Result<crate::limits::HostNeed> {
    use crate::limits::mul;
    let one = host_need(cfg, mcfg, 1)?;
    let (n, w) = (local as u64, cfg.parallel.world_size.max(1) as u64);
    let what = "the host memory estimate";
    let shards = |total: u64| -> Result<u64> { mul(what, &[total.div_ceil(w), n]) };
    Ok(crate::limits::HostNeed {
        start_weights: mul(what, &[one.start_weights, n])?,
        cpu_ranks: mul(what, &[one.cpu_ranks, n])?,
        // Stage 0 gives every rank the whole state; from stage 1 each holds its shard.
        optimizer: if cfg.train.zero_stage == 0 { mul(what, &[one.optimizer, n])? } else { shards(one.optimizer)? },
        activations: mul(what, &[one.activations, n])?,
        weights: shards(one.weights)?,
        gradients: mul(what, &[one.gradients, n])?,
    })
}

/// What a run of `ranks` in-process ranks keeps in host memory at least, by part
/// ([`crate::limits::HostNeed`]). The saved activations there: on the CPU every layer
/// input (f32); on GPUs what the step offloads, as `longctx plan` counts it (the layer
/// inputs, with `offload_activations` the attention's and MLP's saved tensors too, and
/// FPDT's parked chunks with `fpdt_offload`), the largest stage's; and the gradients
/// there with `offload_gradients`.
pub fn host_need(cfg: &RunConfig, mcfg: &LlamaConfig, ranks: usize) -> Result<crate::limits::HostNeed> {
    use crate::limits::mul;
    let cpu = cfg.model.device == "cpu";
    let what = "the saved activations";
    let dtype = parse_dtype(&cfg.model.dtype, Path::new("<run config>"), "model.dtype")?;
    // Every layer input of stage `i`, `elem` bytes an element.
    let inputs = |i: usize, elem: u64| {
        let s = cfg.stage_settings(i);
        let (l, b, local, h) = (mcfg.num_hidden_layers as u64, s.batch_size as u64, (s.seq_length / s.sp) as u64, mcfg.hidden_size as u64);
        mul(what, &[l, b, local, h, elem])
    };
    // On GPUs what the planner counts (one owner of these sizes); a stage it cannot
    // estimate (the run's own checks name such layouts) keeps the inputs as a lower bound.
    let planned = match cpu {
        true => Vec::new(),
        false => {
            let shape = crate::plan::ModelShape::from_config(mcfg);
            let reqs = crate::plan::run_requests(cfg, u64::MAX, dtype.size_in_bytes());
            reqs.iter()
                .map(|r| {
                    crate::plan::estimate(&shape, r)
                        .ok()
                        .map(|e| (e.host.saved_activations.saturating_add(e.host.fpdt_parked), e.host.gradients))
                })
                .collect()
        }
    };
    let (mut act, mut grads) = (0u64, None::<u64>);
    for i in 0..cfg.stages.len() {
        let parked = match (cpu, planned.get(i).copied().flatten()) {
            (true, _) => inputs(i, 4)?, // f32, all in host memory
            (false, Some((b, g))) => {
                grads = Some(grads.unwrap_or(0).max(g));
                b
            }
            (false, None) if cfg.parallel.offload().inputs() => inputs(i, dtype.size_in_bytes() as u64)?,
            (false, None) => 0,
        };
        act = act.max(parked);
    }
    let params = mcfg.param_count()?;
    let offloaded = if cfg.train.zero_stage == 3 && cfg.train.offload_params && !cpu { mul(what, &[params, 2])? } else { 0 };
    let mut need = crate::limits::host_need(params, ranks as u64, cpu, cfg.train.optimizer_on_host, act, offloaded)?;
    // The gradient slices in host memory (`offload_gradients`): the planner's figure per
    // rank (the host units' slices), or 4 bytes a parameter where it cannot estimate.
    if cfg.train.offload_gradients && !cpu {
        let per_rank = match grads {
            Some(g) => g,
            None => mul("the host memory estimate", &[params, 4])?.div_ceil(cfg.parallel.world_size.max(1) as u64),
        };
        need.gradients = mul("the host memory estimate", &[per_rank, ranks as u64])?;
    }
    Ok(need)
}

/// The data spec of a stage (its dataset, column and seed: [`RunConfig::stage_settings`]).
fn data_spec(cfg: &RunConfig, model: &StartModel, s: &StageSettings) -> Result<DataSpec> {
    stage_data_spec(cfg, &model.cfg, s)
}

/// The data a stage reads for a model `mcfg`: its dataset and column, its seed, the
/// run's split and shuffle buffer, the model's vocabulary and EOS.
pub fn stage_data_spec(cfg: &RunConfig, mcfg: &LlamaConfig, s: &StageSettings) -> Result<DataSpec> {
    let (ds, seq_len) = (&s.dataset, s.seq_length);
    let field = if cfg.stages.get(s.index).is_some_and(|st| st.dataset.is_some()) {
        format!("stage[{}].dataset", s.index)
    } else {
        "data.dataset".to_string()
    };
    if let Some(kind) = ds.strip_prefix("synthetic:") {
        let Some((loss_on, vt_hops)) = crate::data::synthetic::dataset(kind) else {
            return Err(Error::config(
                "<run config>",
                &field,
                format!("unknown synthetic dataset `{ds}`; available: {}", crate::data::synthetic::DATASETS),
            ));
        };
        let mut p = PasskeyConfig::new(seq_len);
        p.vocab = mcfg.vocab_size;
        p.seed = s.seed;
        p.loss_on = loss_on;
        p.vt_hops = vt_hops;
        return Ok(DataSpec::Passkey(p));
    }
    let mut f = FilesConfig::new(ds.clone(), seq_len);
    f.column = s.column.clone();
    f.split = (cfg.data.split != "*").then(|| cfg.data.split.clone());
    f.vocab_size = Some(mcfg.vocab_size);
    f.shuffle_buffer = cfg.data.shuffle_buffer;
    f.seed = s.seed;
    f.eos = mcfg.eos_token_id();
    cfg.data.configure(&mut f, s); // packing, positions, loss masks, mixtures
    Ok(DataSpec::Files(f))
}

/// One micro-batch on this rank: `ids`, `targets`, `pos [b, s_local]`, the counted
/// targets, and the attention it runs with (the stage's, under the batch's document mask).
struct Micro {
    ids: Tensor,
    targets: Tensor,
    pos: Tensor,
    counted: usize,
    attn: Arc<dyn AttentionMode>,
    /// Attention work under the document mask relative to one document per row.
    attention_work: f64,
}

/// Per-rank context shared by the threads.
struct Shared<'a> {
    cfg: &'a RunConfig,
    /// The model's config and files; its start weights moved into `start`.
    model: &'a StartModel,
    start: StartWeights,
    device: Device,
    dtype: DType,
    resume: Option<&'a checkpoint::Loaded>,
    opts: &'a RunOptions,
    /// When the start model began loading, and the seconds that took (random
    /// initialisation or reading the files): the start-up report.
    began: Instant,
    loaded_in: f64,
}

/// The start weights (host, f32 or the checkpoint dtype: 27 GB for a 7B model), lent to
/// each rank while it builds its weights and optimizer state, and freed once every rank
/// has (they are not needed after).
type Weights = Arc<HashMap<String, Tensor>>;

struct StartWeights {
    /// The weights while some rank has not taken them yet, and how many ranks still will.
    slot: std::sync::Mutex<(Option<Weights>, usize)>,
}

impl StartWeights {
    fn new(weights: HashMap<String, Tensor>, ranks: usize) -> Self {
        Self { slot: std::sync::Mutex::new((Some(Arc::new(weights)), ranks.max(1))) }
    }

    /// The weights for one rank; the last of the ranks takes them out of the slot, so they
    /// are freed when the ranks drop theirs.
    fn lend(&self) -> Result<Weights> {
        let mut slot = self.slot.lock().map_err(|_| Error::Setting("start weights: a rank panicked".into()))?;
        let (weights, left) = &mut *slot;
        let w = weights.clone().ok_or_else(|| Error::Setting("start weights already released".into()))?;
        *left -= 1;
        if *left == 0 {
            *weights = None;
        }
        Ok(w)
    }
}

/// Run the whole config in this process (in-process ranks; or the world of a launched
/// process when `world` is given).
pub fn run(cfg: &RunConfig, resume: bool) -> Result<RunSummary> {
    run_with(cfg, resume, &RunOptions::default())
}

/// [`run`] with options (early stop, overwrite, stop flag...: [`RunOptions`]).
pub fn run_with(cfg: &RunConfig, resume: bool, opts: &RunOptions) -> Result<RunSummary> {
    let src = Path::new("<run config>");
    let (ranks, max) = (cfg.parallel.world_size, crate::limits::MAX_THREAD_RANKS);
    if ranks > max {
        let msg = format!("got {ranks}, expected 1 to {max} ranks as threads of one process; use `longctx launch` for more");
        return Err(Error::config(src, "parallel.world_size", msg));
    }
    let device = parse_device(&cfg.model.device, src)?;
    let dtype = if device.is_cpu() { DType::F32 } else { parse_dtype(&cfg.model.dtype, src, "model.dtype")? };
    // the modes and the model call the block kernel without knowing which one runs
    cfg.attention.kernel.select();
    let _lock = RunDirLock::acquire(&cfg.output_dir)?;
    rundir::prepare(&cfg.output_dir, resume, opts.overwrite)?;
    let loaded = match resume.then(|| open_checkpoint(cfg, opts, true)).transpose()? {
        Some(Resume::Finished(s)) => return Ok(s),
        Some(Resume::Continue(l)) => Some(l),
        None => None,
    };
    rundir::write_config(cfg)?;
    let began = Instant::now();
    let mut model = load_start_model(cfg)?;
    let start = StartWeights::new(std::mem::take(&mut model.weights), cfg.parallel.world_size);
    let loaded_in = began.elapsed().as_secs_f64();
    let shared = Shared { cfg, model: &model, start, device, dtype, resume: loaded.as_ref(), opts, began, loaded_in };
    let outs = crate::parallel::world::run_threads(cfg.parallel.world_size, cfg.collective_timeout(), |comm| rank_main(&shared, comm))?;
    outs.into_iter().next().flatten().ok_or_else(|| Error::Setting("rank 0 returned no summary".into()))
}

/// What a resume found: a checkpoint to continue from, or a run already finished.
enum Resume {
    Continue(checkpoint::Loaded),
    /// The checkpoint is after the last stage and the export is in place: nothing to do.
    Finished(RunSummary),
}

/// The checkpoint to resume from, its state checked against its own saved config and
/// against `cfg` ([`crate::train::resume_check`]) before any tensor is read; the allowed
/// changes and where the run resumes are printed when `report`. A run whose checkpoint is
/// after its last stage and whose export is in place is finished: nothing is loaded.
fn open_checkpoint(cfg: &RunConfig, opts: &RunOptions, report: bool) -> Result<Resume> {
    let dir = checkpoint::resume_dir(&cfg.output_dir);
    let state = checkpoint::read_state(&dir).map_err(checkpoint::cannot_resume)?;
    let notes = crate::train::resume_check::check(&state, &dir.join("state.json"), cfg, opts.allow_layout_change)?;
    if report && !notes.is_empty() {
        eprintln!("note: resuming with changed settings: {}", notes.join(", "));
    }
    let export_dir = cfg.output_dir.join("export");
    let n = cfg.stages.len();
    if state.stage >= n {
        if export_dir.join("model.safetensors").is_file() && export_dir.join("config.json").is_file() {
            if report {
                eprintln!(
                    "the run in {} is finished (all {n} stage(s), global step {}); its export is in {}: nothing to do (to train \
                     further, add a stage to its config and --resume; to start again, --overwrite)",
                    cfg.output_dir.display(),
                    state.global_step,
                    export_dir.display()
                );
            }
            let tokens = tokens_done(&state);
            return Ok(Resume::Finished(RunSummary {
                stage_losses: Vec::new(),
                steps: state.global_step,
                run_steps: 0,
                tokens,
                run_tokens: 0,
                seconds: 0.0,
                export_dir: Some(export_dir),
                memory: MemoryReport::default(),
                device_peak: None,
                completed: true,
                stopped: None,
                skipped_steps: state.skipped_steps,
                resident: Resident::default(),
                already_finished: true,
            }));
        }
        if report {
            eprintln!(
                "note: the run in {} finished its stages (global step {}) but its export is missing; writing it again",
                cfg.output_dir.display(),
                state.global_step
            );
        }
    } else if report {
        eprintln!(
            "resuming stage {} at step {}/{} (global {}) from {}",
            state.stage,
            state.stage_step,
            cfg.stages[state.stage].steps,
            state.global_step,
            dir.display()
        );
    }
    Ok(Resume::Continue(checkpoint::load(&cfg.output_dir)?))
}

/// Tokens a run had trained on when `state` was saved, by the config saved with it: every
/// stage before the one in progress whole, and the steps done in that one.
fn tokens_done(state: &TrainState) -> u64 {
    let Ok(saved) = serde_json::from_value::<RunConfig>(state.config.clone()) else { return 0 };
    let per_step = |i: usize| saved.stage_settings(i).tokens_per_step();
    let whole: u64 = (0..state.stage.min(saved.stages.len())).map(|i| saved.stages[i].steps.saturating_mul(per_step(i))).sum();
    let current = if state.stage < saved.stages.len() { state.stage_step.saturating_mul(per_step(state.stage)) } else { 0 };
    whole.saturating_add(current)
}

/// One rank's whole run: set-up, the stages, the final export. Returns the summary on rank 0.
fn rank_main(sh: &Shared<'_>, world: Arc<dyn Comm>) -> Result<Option<RunSummary>> {
    let cfg = sh.cfg;
    let mut run = RankRun::new(sh, world)?;
    let (start_stage, start_step, mut data_state) = run.resume_point()?;
    let mut stage_losses = Vec::new();
    let mut stopped = None;
    for (si, stage) in cfg.stages.iter().enumerate().skip(start_stage) {
        let first_step = if si == start_stage { start_step } else { 0 };
        let ((first, last), stop) = run.stage(si, stage, first_step, data_state.take())?;
        stage_losses.push((si, first, last));
        if stop.is_some() {
            stopped = stop;
            break;
        }
    }
    let is_main = run.world.rank() == 0;
    let export_dir = cfg.train.save.then(|| cfg.output_dir.join("export"));
    if let Some(reason) = stopped {
        run.world.barrier()?;
        if is_main {
            let why = match reason {
                StopReason::AtStep => "as asked".to_string(),
                StopReason::Signal(Some(sig)) => format!("on {}", crate::train::stop::signal_name(sig)),
                StopReason::Signal(None) => "on another rank's stop request".to_string(),
            };
            if cfg.train.save {
                eprintln!(
                    "stopped after step {} {why}; checkpoint in {} (continue with --resume)",
                    run.global_step,
                    checkpoint::checkpoint_dir(&cfg.output_dir).display()
                );
            } else {
                eprintln!("stopped after step {} {why}; nothing saved (train.save = false)", run.global_step);
            }
        }
    } else if let Some(dir) = &export_dir {
        let whole = run.whole_weights()?; // gathered on every rank under ZeRO-3
        if is_main {
            run.export(dir, whole)?;
        }
        run.world.barrier()?;
    }
    let summary = RunSummary {
        stage_losses,
        steps: run.global_step,
        run_steps: run.global_step - run.steps_before,
        tokens: run.tokens_before + run.total_tokens,
        run_tokens: run.total_tokens,
        seconds: run.t0.elapsed().as_secs_f64(),
        export_dir,
        memory: run.memory,
        device_peak: run.device_peak,
        completed: stopped.is_none(),
        stopped,
        skipped_steps: run.skipped_steps,
        resident: run.resident,
        already_finished: false,
    };
    if let (None, Some(m)) = (stopped, run.metrics.as_mut()) {
        m.finish(&summary)?;
        if cfg.eval.is_on() {
            crate::train::stage_eval::write_plot(&cfg.output_dir)?;
        }
    }
    Ok(if is_main { Some(summary) } else { None })
}

/// What one rank carries through its run.
struct RankRun<'a> {
    sh: &'a Shared<'a>,
    world: Arc<dyn Comm>,
    engine: Engine,
    /// The optimizer, the gradients, the weights under ZeRO-3 and a deferred update.
    zero: ZeroState,
    /// What this rank holds (reported at start-up and in the summary).
    resident: Resident,
    /// Rank 0 only.
    metrics: Option<Metrics>,
    /// Rebuilt when a stage changes the mode.
    groups: Option<(ParallelMode, ParallelDims, Groups)>,
    /// Largest memory report seen.
    memory: MemoryReport,
    device_peak: Option<u64>,
    /// Tokens of this invocation.
    total_tokens: u64,
    /// Steps and tokens the run had done when this invocation resumed it.
    steps_before: u64,
    tokens_before: u64,
    global_step: u64,
    t0: Instant,
    /// Steps skipped (non-finite gradient norm or loss) over the run, and in a row now.
    skipped_steps: u64,
    skipped_in_row: u64,
    /// When and at which global step the last checkpoint was written (by this run, or
    /// the one resumed from).
    last_checkpoint: (Instant, Option<u64>),
    /// The global step at which the optimizer state last started fresh (a stage's
    /// `reset_optimizer`; 0 at the run's start), saved in the checkpoint.
    optimizer_since: u64,
    /// `[eval]`: what is evaluated at stage ends (and every `eval.every` steps).
    eval: Option<StageEval>,
}

/// What one optimizer step decided, the same on every rank.
struct StepOut {
    loss: f64,
    /// Some rank was asked to stop.
    stop: bool,
    /// Some rank's time-based checkpoint interval has passed.
    checkpoint_due: bool,
}

/// One stage's layout and data on this rank.
struct StageRun {
    attn: Arc<dyn AttentionMode>,
    indices: Vec<usize>,
    loader: Loader,
    /// Data-parallel size.
    dp: usize,
    /// Seed, data, batch, accumulation, learning rate and warmup of the stage.
    settings: StageSettings,
}

/// The weights a rank starts from, by name: the start model's, or the checkpoint's when
/// resuming (each checked against the model's shape).
fn start_tensors<'w>(sh: &'w Shared<'_>, start_weights: &'w HashMap<String, Tensor>) -> Result<Vec<(&'w String, &'w Tensor)>> {
    let mut picked = Vec::with_capacity(start_weights.len());
    for (n, start) in start_weights.iter() {
        let t = match sh.resume {
            Some(l) => {
                let file = l.dir.join("model.safetensors");
                let t = l.weights.get(n).ok_or_else(|| Error::checkpoint(&file, format!("tensor `{n}` missing")))?;
                if t.dims() != start.dims() {
                    return Err(Error::checkpoint(
                        &file,
                        format!(
                            "tensor `{n}` has shape {:?}, the model's is {:?}: this checkpoint is of another model",
                            t.dims(),
                            start.dims()
                        ),
                    ));
                }
                t
            }
            None => start,
        };
        picked.push((n, t));
    }
    Ok(picked)
}

/// The engine over the weights on the device; under ZeRO-3 no rank holds the whole weights
/// (the engine has only their shapes): the weights come back for each rank to keep its
/// slices of ([`ZeroState::new`]).
fn build_engine(sh: &Shared<'_>, zc: &ZeroConfig, picked: Vec<(&String, &Tensor)>) -> Result<(Engine, Option<HashMap<String, Tensor>>)> {
    let (cfg, mcfg) = (sh.cfg, &sh.model.cfg);
    let opts = EngineOptions {
        token_chunk: cfg.parallel.token_chunk,
        offload: cfg.parallel.offload(),
        profile: cfg.train.profile,
        trace: cfg.train.trace,
        save_attention: cfg.parallel.save_attention,
        save_mlp: cfg.parallel.save_mlp,
        save_mlp_layers: cfg.parallel.save_mlp_layers,
        layer_backward: cfg.train.layer_backward,
    };
    if zc.shards_weights() {
        let shapes: HashMap<String, candle_core::Shape> = picked.iter().map(|(n, t)| ((*n).clone(), t.shape().clone())).collect();
        let weights: HashMap<String, Tensor> = picked.iter().map(|(n, t)| ((*n).clone(), (*t).clone())).collect();
        return Ok((Engine::for_shapes(mcfg, &shapes, sh.dtype, &sh.device, opts)?, Some(weights)));
    }
    // Rounded to the run dtype on the host in parallel (one core per tensor), then
    // copied to the device one by one.
    let converted: Vec<(&String, Tensor)> = {
        use rayon::prelude::*;
        picked.into_par_iter().map(|(n, t)| Ok((n, t.to_dtype(sh.dtype)?))).collect::<Result<_>>()?
    };
    let mut vars: HashMap<String, Var> = HashMap::new();
    for (n, t) in converted {
        vars.insert(n.clone(), Var::from_tensor(&t.to_device(&sh.device)?)?);
    }
    Ok((Engine::from_vars(mcfg, &vars, opts)?, None))
}

/// The ZeRO settings of a run's `[train]` section.
fn zero_config(t: &crate::train::config::TrainSection) -> ZeroConfig {
    ZeroConfig {
        stage: t.zero_stage,
        offload_params: t.offload_params,
        optimizer_on_host: t.optimizer_on_host,
        optimizer_device_units: t.optimizer_device_units,
        offload_gradients: t.offload_gradients,
        adamw: t.adamw.clone(),
        clip_grad: t.clip_grad,
    }
}

/// Rank 0's start-up lines: what each rank holds, and how long the start took.
fn report_start(sh: &Shared<'_>, wsize: usize, resident: &Resident) {
    let t = &sh.cfg.train;
    eprintln!(
        "ZeRO stage {} over {wsize} rank(s){}{}: each rank holds {resident}",
        t.zero_stage,
        if t.offload_params { ", weights offloaded" } else { "" },
        match (t.optimizer_on_host, t.optimizer_device_units) {
            (false, _) => String::new(),
            (true, 0) => ", optimizer offloaded".to_string(),
            (true, n) => format!(", optimizer offloaded but the first {n} unit(s)' (on the GPU)"),
        },
    );
    let total = sh.began.elapsed().as_secs_f64();
    eprintln!("start-up: {total:.1} s (start model {:.1} s, weights and optimizer state {:.1} s)", sh.loaded_in, total - sh.loaded_in);
}

impl<'a> RankRun<'a> {
    /// Weights on the device (from the start model, or the checkpoint when resuming), the
    /// engine, this rank's optimizer slice and, on rank 0, the metrics log.
    fn new(sh: &'a Shared<'a>, world: Arc<dyn Comm>) -> Result<Self> {
        let (cfg, mcfg) = (sh.cfg, &sh.model.cfg);
        let zc = zero_config(&cfg.train);
        let start_weights = sh.start.lend()?;
        let (engine, sliced) = build_engine(sh, &zc, start_tensors(sh, &start_weights)?)?;
        let n_params: usize = engine.meta.iter().map(|(_, s)| s.elem_count()).sum();
        let is_main = world.rank() == 0;
        let resumed_at = sh.resume.map(|l| l.state.global_step);
        let metrics = if is_main { Some(Metrics::new(&cfg.output_dir, cfg, n_params, mcfg, resumed_at)?) } else { None };
        // ZeRO over every rank of the world (`train.zero_stage`; `train::zero`).
        let start = Start { meta: &engine.meta, params: &engine.params, masters: start_weights, sliced, resume: sh.resume };
        let zero = ZeroState::new(zc, start, world.clone(), (&sh.device, sh.dtype))?;
        let resident = zero.resident();
        if is_main {
            report_start(sh, world.world(), &resident);
        }
        let global_step = sh.resume.map_or(0, |l| l.state.global_step);
        let (skipped_steps, skipped_in_row) = sh.resume.map_or((0, 0), |l| (l.state.skipped_steps, l.state.skipped_in_row));
        if let (Some(_), Some(f)) = (sh.resume, &sh.opts.stop) {
            f.checkpoint_exists(); // the one resumed from
        }
        Ok(Self {
            sh,
            world,
            engine,
            zero,
            resident,
            metrics,
            groups: None,
            memory: MemoryReport::default(),
            device_peak: None,
            total_tokens: 0,
            steps_before: global_step,
            tokens_before: sh.resume.map_or(0, |l| tokens_done(&l.state)),
            global_step,
            t0: Instant::now(),
            skipped_steps,
            skipped_in_row,
            last_checkpoint: (Instant::now(), sh.resume.map(|l| l.state.global_step)),
            optimizer_since: sh.resume.map_or(0, |l| l.state.optimizer_since_step),
            eval: match cfg.eval.is_on() {
                true => {
                    let longest = cfg.stages.iter().map(|s| s.seq_length).max().unwrap_or(0);
                    Some(StageEval::new(cfg.eval.clone(), mcfg.max_position_embeddings, longest, cfg.seed)?)
                }
                false => None,
            },
        })
    }

    /// Where a resumed run starts: stage, step within it, data cursor.
    fn resume_point(&self) -> Result<(usize, u64, Option<DataState>)> {
        let Some(l) = self.sh.resume else { return Ok((0, 0, None)) };
        let data = serde_json::from_value::<Option<DataState>>(l.state.data.clone())
            .map_err(|e| Error::checkpoint(checkpoint::checkpoint_dir(&self.sh.cfg.output_dir), format!("corrupt data cursor: {e}")))?;
        Ok((l.state.stage, l.state.stage_step, data))
    }

    /// Groups, attention mode, token layout and data of stage `si`.
    fn stage_setup(&mut self, si: usize, stage: &Stage, first_step: u64, data: Option<DataState>) -> Result<StageRun> {
        let (cfg, mcfg) = (self.sh.cfg, &self.sh.model.cfg);
        let mode = stage.parallel_mode.unwrap_or(cfg.parallel.mode);
        let chunk = stage.fpdt_chunk_size.unwrap_or(cfg.parallel.fpdt_chunk_size);
        if self.groups.as_ref().map(|g| g.0) != Some(mode) {
            let p = &cfg.parallel;
            let req = mode.dims_request(self.world.world(), p.sp_size, p.ulysses_size, mcfg.num_attention_heads, mcfg.num_key_value_heads);
            let dims = ParallelDims::new(&req)?;
            let g = build_groups(&self.world, &dims)?;
            self.groups = Some((mode, dims, g));
        }
        let (_, dims, g) = self.groups.as_ref().ok_or_else(|| Error::Setting("groups".into()))?;
        let attn = mode.build(g, chunk, cfg.parallel.fpdt_offload);
        let (dp_rank, dp) = (g.dp.rank(), g.dp.world());
        // θ and, when the stage sets one, its RoPE method (the same table as eval's).
        self.engine.set_rope(Rope::new(&stage.model_config(mcfg, si, Path::new("<run config>"))?));
        let indices = mode.local_indices(dims, g.sp.rank(), stage.seq_length, chunk)?;
        let settings = cfg.stage_settings(si);
        let spec = data_spec(cfg, self.sh.model, &settings)?;
        let mut loader = Loader::new(&spec, self.sh.model.tokenizer.as_ref(), Shard { rank: dp_rank, world: dp })?;
        if let Some(ds) = &data {
            loader.restore(ds)?;
        }
        // A stage that starts with a fresh optimizer (EasyContext: a new job per stage)
        // resets it at its first step, also when a run resumes there: the checkpoint at a
        // stage's end holds the moments before the reset, so the resumed run resets the
        // same way. The step it happened at is recorded in the checkpoint.
        if settings.reset_optimizer && first_step == 0 {
            let g = Guard { prof: self.engine.profiler(), kept: self.kept_checkpoint() };
            self.zero.reset_optimizer(&g)?;
            self.optimizer_since = self.global_step;
        }
        if let Some(m) = self.metrics.as_mut() {
            m.stage_start(si, stage, &settings, self.world.world(), dims.sp, dp)?;
        }
        Ok(StageRun { attn, indices, loader, dp, settings })
    }

    /// Steps `first_step..` of stage `si`: (first and last loss, why the run stopped).
    fn stage(&mut self, si: usize, stage: &Stage, first_step: u64, data: Option<DataState>) -> Result<((f64, f64), Option<StopReason>)> {
        let mut st = self.stage_setup(si, stage, first_step, data)?;
        let (mut first_loss, mut last_loss) = (f64::NAN, f64::NAN);
        let limit = self.sh.opts.stop_at_global_step;
        let last_stage = si + 1 == self.sh.cfg.stages.len();
        for step in first_step..stage.steps {
            if limit.is_some_and(|n| self.global_step >= n) {
                // resumed at or past the stop: nothing to do, the checkpoint stands
                return Ok(((first_loss, last_loss), Some(StopReason::AtStep)));
            }
            let out = self.step(&mut st, si, stage, step)?;
            if step == first_step {
                first_loss = out.loss;
            }
            last_loss = out.loss;
            let every = self.sh.cfg.train.checkpoint_every;
            let stage_end = step + 1 == stage.steps;
            let stop = if limit.is_some_and(|n| self.global_step >= n) {
                Some(StopReason::AtStep)
            } else if out.stop && !(stage_end && last_stage) {
                // (a request during the very last step lets the run finish and export)
                Some(StopReason::Signal(self.sh.opts.stop.as_ref().and_then(StopFlag::requested)))
            } else {
                None
            };
            if self.sh.cfg.eval.due(stage_end, self.global_step) {
                // (before the checkpoint: a run resumed from it has this line, one resumed
                // from an earlier one evaluates again)
                self.evaluate(si, stage, &st, step + 1, stage_end)?;
            }
            let due = (every > 0 && self.global_step.is_multiple_of(every)) || stage_end || stop.is_some() || out.checkpoint_due;
            if due && self.sh.cfg.train.save {
                let (ns, nst) = if stage_end { (si + 1, 0) } else { (si, step + 1) };
                let data = if stage_end { None } else { Some(st.loader.state()) };
                self.save_checkpoint(ns, nst, data)?;
            }
            if stop.is_some() {
                return Ok(((first_loss, last_loss), stop));
            }
        }
        Ok(((first_loss, last_loss), None))
    }

    /// Scores the model as it stands ([`StageEval`]); rank 0 logs the line. Every rank
    /// calls it (the weights are gathered under ZeRO-3, the forward is collective).
    fn evaluate(&mut self, si: usize, stage: &Stage, st: &StageRun, step: u64, stage_end: bool) -> Result<()> {
        let Some(mut ev) = self.eval.take() else { return Ok(()) };
        let res = (|| {
            let mcfg = stage.model_config(&self.sh.model.cfg, si, Path::new("<run config>"))?;
            let weights: HashMap<String, Tensor> = self.whole_weights()?.into_iter().collect();
            let dtype = weights.values().next().map_or(DType::F32, Tensor::dtype);
            let model = crate::model::Llama::load(candle_nn::VarBuilder::from_tensors(weights, dtype, &self.sh.device), &mcfg)?;
            let (mode, dims, g) = self.groups.as_ref().ok_or_else(|| Error::Setting("groups".into()))?;
            let chunk = stage.fpdt_chunk_size.unwrap_or(self.sh.cfg.parallel.fpdt_chunk_size);
            let ranks = Ranks::from_groups(*mode, *dims, g, chunk, self.sh.cfg.parallel.token_chunk);
            let at = EvalAt { stage: si, step, global_step: self.global_step, stage_end, seq_len: st.settings.seq_length };
            ev.run(&model, self.sh.model.tokenizer.as_ref(), &ranks, &g.dp, at)
        })();
        self.eval = Some(ev);
        let line = res?;
        if let Some(m) = self.metrics.as_mut() {
            m.eval(&line)?;
        }
        Ok(())
    }

    /// The micro-batches of one step on this rank, localized.
    fn micro_batches(&mut self, st: &mut StageRun, si: usize, step: u64) -> Result<Vec<Micro>> {
        let sh = self.sh;
        let mut micro = Vec::new();
        for _ in 0..st.settings.gradient_accumulate_every {
            let batch = st.loader.next_batch(st.settings.batch_size)?.ok_or_else(|| {
                Error::data(&st.settings.dataset, format!("dataset exhausted at stage {si} step {step}; use more data or fewer steps"))
            })?;
            let local = batch.localize(&st.indices)?;
            let (b, s) = (batch.batch, st.indices.len());
            let ids = Tensor::from_slice(&local.ids, (b, s), &sh.device)?;
            let targets = Tensor::from_slice(&local.targets, (b, s), &sh.device)?;
            let pos = Tensor::from_slice(&local.positions, (b, s), &sh.device)?;
            let counted = local.targets.iter().filter(|&&t| t >= 0).count();
            // Packed documents: the stage's attention under this batch's document mask
            // (global token indices; the mode itself when every row is one document).
            let docs = if local.docs.iter().any(|d| d.len() > 1) {
                let rows = local.docs.iter().map(|d| d.iter().map(|&x| x as usize).collect()).collect();
                Some(longctx_attention::Docs::new(rows, batch.seq_len)?)
            } else {
                None
            };
            let attention_work = docs.as_ref().map_or(1.0, |d| d.work_fraction());
            let attn = longctx_attention::mode::with_docs(&st.attn, docs);
            micro.push(Micro { ids, targets, pos, counted, attn, attention_work });
        }
        Ok(micro)
    }

    /// Forward and backward of every micro-batch, each adding into the one flat gradient
    /// buffer: (local loss sum, engine seconds).
    fn forward_backward(&mut self, stage: &Stage, micro: &[Micro], scale: f64) -> Result<(f64, f64)> {
        let hooks = self.zero.hooks()?;
        let (mut loss_sum, mut engine_seconds) = (0f64, 0f64);
        let mut mem = self.memory;
        let rank = self.world.rank();
        let skew = self.sh.opts.faults.iter().find_map(|f| match f {
            Fault::Skew { rank: r, factor } if *r == rank => Some(*factor),
            _ => None,
        });
        let skew = skew.unwrap_or(1.0);
        for m in micro {
            let te = Instant::now();
            let r = self.engine.step_into(&m.ids, &m.targets, &m.pos, stage.seq_length, &m.attn, scale * skew, &hooks)?;
            engine_seconds += te.elapsed().as_secs_f64();
            loss_sum += r.loss_sum * skew;
            mem.saved_bytes = mem.saved_bytes.max(r.memory.saved_bytes);
            mem.saved_host_bytes = mem.saved_host_bytes.max(r.memory.saved_host_bytes);
            mem.transient_bytes = mem.transient_bytes.max(r.memory.transient_bytes);
        }
        self.memory = mem;
        Ok((loss_sum, engine_seconds))
    }

    /// One optimizer step (all micro-batches of it), logged. The loss, this rank's stop
    /// request and whether its checkpoint interval has passed are all-reduced together, so
    /// every rank takes the same decisions: skip a non-finite step, stop, checkpoint.
    fn step(&mut self, st: &mut StageRun, si: usize, stage: &Stage, step: u64) -> Result<StepOut> {
        crate::parallel::world::test_stall(self.world.rank(), self.global_step)?;
        let (sh, cfg) = (self.sh, self.sh.cfg);
        let ts = Instant::now();
        self.engine.profiler().trace_step(&format!("step {} of stage {si}: reading its data", step + 1));
        crate::train::metrics::device_memory(&sh.device, true)?; // reset the high-water mark
        let micro = self.micro_batches(st, si, step)?;
        let local_count: usize = micro.iter().map(|m| m.counted).sum();
        let global_count = all_reduce_scalar(&self.world, local_count as f64, &sh.device)?;
        let scale = if global_count > 0.0 { 1.0 / global_count } else { 0.0 };
        let (loss_sum, engine_seconds) = self.forward_backward(stage, &micro, scale)?;
        // The previous step's deferred update: applied in the forward, guarded now.
        self.zero.settle(&Guard { prof: self.engine.profiler(), kept: self.kept_checkpoint() })?;
        let agreed = self.agree(loss_sum)?;
        let loss = agreed[0] / global_count.max(1.0);
        let lr = cfg.train.lr_schedule_for(st.settings.learning_rate, st.settings.warmup_steps, stage.steps).lr(step);
        let stats = self.update(lr, loss, step_label(si, step + 1, stage.steps, self.global_step + 1))?;
        let s = &st.settings;
        let tokens = (s.batch_size * s.gradient_accumulate_every * st.dp * stage.seq_length) as u64;
        self.total_tokens += tokens;
        let step_peak = crate::train::metrics::device_memory(&sh.device, false)?.map(|(_, high)| high);
        let profile = if cfg.train.profile { Some(self.engine.take_profile()?) } else { None };
        self.device_peak = self.device_peak.max(step_peak);
        let mut line = StepLine {
            stage: si,
            step: step + 1,
            steps: stage.steps,
            global_step: self.global_step,
            loss,
            lr,
            grad_norm: stats.grad_norm,
            skipped: stats.skipped,
            skipped_steps: self.skipped_steps,
            tokens,
            seconds: ts.elapsed().as_secs_f64(),
            engine_seconds,
            seq_len: stage.seq_length,
            attention_work: micro.iter().map(|m| m.attention_work).sum::<f64>() / micro.len().max(1) as f64,
            memory: self.memory,
            device_peak: step_peak,
            profile,
        };
        // The guards are part of every step: its time counts them too. The line is
        // written even when they abort the run.
        self.engine.profiler().trace(&sh.device, || "guards".into())?;
        let guarded = self.after_update(&line);
        line.seconds = ts.elapsed().as_secs_f64();
        if let Some(m) = self.metrics.as_mut() {
            m.step(&line)?;
        }
        guarded?;
        Ok(StepOut { loss, stop: agreed[1] > 0.0, checkpoint_due: agreed[2] > 0.0 })
    }

    /// The step's loss sum (made NaN by [`Fault::NanLoss`]), this rank's stop request and
    /// whether its checkpoint interval has passed, all-reduced in one collective:
    /// `[loss sum, stop, checkpoint due]`, the same on every rank.
    fn agree(&self, mut loss_sum: f64) -> Result<Vec<f64>> {
        let (sh, rank, next) = (self.sh, self.world.rank(), self.global_step + 1);
        if sh.opts.faults.contains(&Fault::NanLoss { rank, step: next }) {
            loss_sum = f64::NAN;
        }
        let stop_local = sh.opts.stop.as_ref().is_some_and(|f| f.requested().is_some());
        let interval = sh.cfg.train.checkpoint_interval_min * 60.0;
        let due_local = interval > 0.0 && self.last_checkpoint.0.elapsed().as_secs_f64() >= interval;
        let flags = [loss_sum, f64::from(u8::from(stop_local)), f64::from(u8::from(due_local))];
        self.engine.profiler().time(Phase::Comm, &sh.device, || all_reduce_f64s(&self.world, &flags, &sh.device))
    }

    /// The step's optimizer update (`at`: the step's label for a deferred update's guard),
    /// counted: the global step advances, a skipped update counts towards the abort. A
    /// non-finite loss (the same on every rank) skips the update like a non-finite
    /// gradient norm does inside the optimizer step.
    fn update(&mut self, lr: f64, loss: f64, at: String) -> Result<StepStats> {
        self.engine.profiler().trace(&self.sh.device, || "optimizer".into())?;
        self.inject_nan_gradient()?;
        let next = self.global_step + 1;
        let poison = self.sh.opts.faults.contains(&Fault::NanWeights { step: next });
        let stats = self.zero.update(self.engine.profiler(), Update { lr, skip: !loss.is_finite(), at, poison })?;
        self.global_step = next;
        if stats.skipped {
            self.skipped_steps += 1;
            self.skipped_in_row += 1;
        } else {
            self.skipped_in_row = 0;
        }
        Ok(stats)
    }

    /// The numeric guards after a step (the same outcome on every rank): a skipped step is
    /// warned about and, `train.max_skipped_steps` in a row, aborts the run; an applied
    /// update must leave every weight finite, else the run aborts before anything is
    /// written. Either way the last good checkpoint stays.
    fn after_update(&mut self, l: &StepLine) -> Result<()> {
        let max = self.sh.cfg.train.max_skipped_steps;
        let at = step_label(l.stage, l.step, l.steps, l.global_step);
        if l.skipped {
            if self.world.rank() == 0 {
                eprintln!(
                    "warning: {at}: {} is not finite (loss {}, gradient norm {}): update skipped, its data consumed \
                     ({} in a row; the run stops after {max})",
                    if l.loss.is_finite() { "the gradient norm" } else { "the loss" },
                    l.loss,
                    l.grad_norm,
                    self.skipped_in_row
                );
            }
            if self.skipped_in_row >= max {
                return Err(Error::Diverged(format!(
                    "{} optimizer steps in a row had a non-finite gradient norm or loss (up to {at}; train.max_skipped_steps = \
                     {max}); {}; {}",
                    self.skipped_in_row,
                    self.kept_checkpoint(),
                    self.skip_cause()
                )));
            }
            return Ok(());
        }
        // (a deferred update is guarded when it is settled: `ZeroState::settle`)
        let poison = self.sh.opts.faults.contains(&Fault::NanWeights { step: self.global_step });
        if let Some(bad) = self.zero.check_weights(poison)? {
            return Err(Error::Diverged(format!(
                "the update of {at} made the weights non-finite (first: {bad}; gradient norm {}, lr {:.3e}); nothing was written: {}; \
                 lower the learning rate or raise clipping, then --resume",
                l.grad_norm,
                l.lr,
                self.kept_checkpoint()
            )));
        }
        Ok(())
    }

    /// Every weight, whole, on the host or where it lives (collective under ZeRO-3: every
    /// rank calls it), for checkpoints, evaluations and the export.
    fn whole_weights(&mut self) -> Result<Vec<(String, Tensor)>> {
        let g = Guard { prof: self.engine.profiler(), kept: self.kept_checkpoint() };
        self.zero.whole_weights(&g)
    }

    /// What to do about steps skipped in a row: when this invocation applied no update
    /// at all, the weights are still the loaded ones, so the learning rate cannot be the
    /// cause; name where they came from.
    fn skip_cause(&self) -> String {
        if self.global_step - self.steps_before > self.skipped_in_row {
            return "lower the learning rate, raise warmup or clipping, or check the data, then --resume".into();
        }
        let from = match self.sh.resume {
            Some(l) => format!("the checkpoint this run resumed ({})", l.dir.display()),
            None => format!("the model loaded from {}", self.sh.cfg.model.source),
        };
        format!(
            "no update was applied since this run started, so the learning rate is not the cause: the weights are still \
             those of {from} (every value of it was checked finite at load, but the forward pass overflows: look for huge \
             weights, or load in a wider --dtype), or the data is at fault"
        )
    }

    /// Where the last good checkpoint is, for the messages of an abort.
    fn kept_checkpoint(&self) -> String {
        let dir = checkpoint::checkpoint_dir(&self.sh.cfg.output_dir);
        match self.last_checkpoint.1 {
            // Not written by this invocation: it was not seen to be good.
            Some(g) if self.sh.resume.is_some() && g == self.steps_before => {
                format!("the checkpoint this run resumed from ({}, after global step {g}) is left as it was", dir.display())
            }
            Some(g) => format!("the last good checkpoint ({}, after global step {g}) is kept", dir.display()),
            None => "no checkpoint was written yet (the run starts over)".into(),
        }
    }

    /// [`Fault::NanGradient`]: this rank's first gradient made NaN in the chosen steps.
    fn inject_nan_gradient(&self) -> Result<()> {
        let g = self.global_step + 1;
        for f in &self.sh.opts.faults {
            if let Fault::NanGradient { rank, first, last } = f {
                if *rank == self.world.rank() && (*first..=*last).contains(&g) {
                    self.zero.poison_gradient()?;
                }
            }
        }
        Ok(())
    }

    /// The Hugging Face export of the final weights (rank 0), as `longctx export` of the
    /// final checkpoint writes it ([`crate::hub::ModelExport::for_run`]).
    fn export(&self, export_dir: &Path, tensors: Vec<(String, Tensor)>) -> Result<()> {
        let (sh, cfg) = (self.sh, self.sh.cfg);
        let finished = crate::train::export::RunProgress::finished(cfg);
        crate::hub::ModelExport::new(tensors, sh.model.config_json.clone(), sh.model.source_dir.clone())
            .for_run(cfg, finished, sh.model.cfg.max_position_embeddings, Path::new("<run config>"))?
            .write(export_dir)?;
        Ok(())
    }
}

/// "stage s step k/n (global step g)": where an update happened, in the guards' messages.
fn step_label(stage: usize, step: u64, steps: u64, global_step: u64) -> String {
    format!("stage {stage} step {step}/{steps} (global step {global_step})")
}

/// Sum of `xs` over ranks, element by element, in f64 (one collective).
fn all_reduce_f64s(comm: &Arc<dyn Comm>, xs: &[f64], device: &Device) -> Result<Vec<f64>> {
    if comm.world() == 1 {
        return Ok(xs.to_vec());
    }
    let t = Tensor::from_slice(xs, xs.len(), device)?;
    Ok(comm.all_reduce_sum(&t)?.to_device(&Device::Cpu)?.to_vec1::<f64>()?)
}

impl RankRun<'_> {
    /// A checkpoint of the state after the current step (`stage`, `stage_step` where the
    /// run continues, the data cursor). Before anything is written, every rank checks its
    /// optimizer shard and the weights for non-finite values and all agree (all-reduce):
    /// a bad state aborts the run and leaves the previous checkpoint in place.
    fn save_checkpoint(&mut self, stage: usize, stage_step: u64, data: Option<DataState>) -> Result<()> {
        let g = Guard { prof: self.engine.profiler(), kept: self.kept_checkpoint() };
        let (bad_weight, bad_shard) = self.zero.checkpoint_check(&g)?;
        let rank = self.world.rank();
        let bad_ranks = ranks_flagging(&self.world, bad_shard.is_some(), &self.sh.device)?;
        if bad_weight.is_some() || bad_ranks > 0.0 {
            let what = match (bad_weight, bad_shard) {
                (Some(w), _) => format!("weight {w} holds NaN or infinite values"),
                (None, Some(s)) => format!("rank {rank}'s {s}"),
                (None, None) => format!("the optimizer state of {bad_ranks} other rank(s) is not finite"),
            };
            return Err(Error::Diverged(format!(
                "not writing the checkpoint after global step {}: {what}; {}; lower the learning rate or raise clipping",
                self.global_step,
                self.kept_checkpoint()
            )));
        }
        // Every rank writes its own optimizer shard into the temporary directory rank 0
        // made; rank 0 then adds the weights and state and swaps it into place.
        let out = &self.sh.cfg.output_dir;
        if rank == 0 {
            checkpoint::begin(out)?;
        }
        self.world.barrier()?;
        self.zero.write_shard(&checkpoint::tmp_dir(out))?;
        self.world.barrier()?;
        let whole = self.zero.whole_weights(&g)?; // gathered on every rank under ZeRO-3
        if rank == 0 {
            let weights: HashMap<String, Tensor> = whole.into_iter().collect();
            let state = TrainState {
                stage,
                stage_step,
                global_step: self.global_step,
                adam_step: self.zero.adam_step(),
                data: serde_json::to_value(&data).map_err(|e| Error::Setting(e.to_string()))?,
                optimizer_shards: self.zero.optimizer_shards(),
                optimizer_units: self.zero.optimizer_units(),
                config: serde_json::to_value(self.sh.cfg).map_err(|e| Error::Setting(e.to_string()))?,
                skipped_steps: self.skipped_steps,
                skipped_in_row: self.skipped_in_row,
                optimizer_since_step: self.optimizer_since,
            };
            checkpoint::finish(out, &weights, &state)?;
        }
        self.world.barrier()?;
        self.last_checkpoint = (Instant::now(), Some(self.global_step));
        if let Some(f) = &self.sh.opts.stop {
            f.checkpoint_exists();
        }
        Ok(())
    }
}

/// Run as one process of a launched world (`longctx launch`, torchrun, Slurm): the
/// world comes from [`crate::parallel::world::join`] (NCCL on `cuda:LOCAL_RANK`, or the CPU
/// process transport with `model.device = cpu`); then the same rank loop as in-process
/// runs. A failing rank tells the others, which stop within a bounded time.
pub fn run_launched(cfg: &RunConfig, resume: bool, env: &crate::parallel::env::DistEnv, opts: &RunOptions) -> Result<Option<RunSummary>> {
    if env.world != cfg.parallel.world_size {
        return Err(Error::Setting(format!(
            "WORLD_SIZE is {} but parallel.world_size is {}; leave --world-size unset under a launcher",
            env.world, cfg.parallel.world_size
        )));
    }
    let joined = crate::parallel::world::join(env, &cfg.model.device, cfg.collective_timeout())?;
    // the modes and the model call the block kernel without knowing which one runs
    cfg.attention.kernel.select();
    let result = (|| {
        let dtype =
            if joined.device.is_cpu() { DType::F32 } else { parse_dtype(&cfg.model.dtype, Path::new("<run config>"), "model.dtype")? };
        // Rank 0 writes metrics, checkpoints and the export: it holds the directory.
        let _lock = if env.rank == 0 {
            let lock = RunDirLock::acquire(&cfg.output_dir)?;
            rundir::prepare(&cfg.output_dir, resume, opts.overwrite)?;
            Some(lock)
        } else {
            None
        };
        // Every rank writes into the output directory: it must be the same one on every node.
        let private = opts.faults.iter().any(|f| matches!(f, Fault::PrivateDir { rank } if *rank == env.rank));
        let look_in = if private { cfg.output_dir.join("node-local") } else { cfg.output_dir.clone() };
        rundir::check_shared(&cfg.output_dir, &look_in, &joined.comm, &joined.device)?;
        let loaded = match resume.then(|| open_checkpoint(cfg, opts, env.rank == 0)).transpose()? {
            Some(Resume::Finished(s)) => return Ok((env.rank == 0).then_some(s)),
            Some(Resume::Continue(l)) => Some(l),
            None => None,
        };
        if env.rank == 0 {
            rundir::write_config(cfg)?;
        }
        let began = Instant::now();
        let mut model = load_start_model_for(cfg, NodeRanks::Launched(env.local_world))?;
        let start = StartWeights::new(std::mem::take(&mut model.weights), 1);
        let loaded_in = began.elapsed().as_secs_f64();
        let shared =
            Shared { cfg, model: &model, start, device: joined.device.clone(), dtype, resume: loaded.as_ref(), opts, began, loaded_in };
        rank_main(&shared, joined.comm.clone())
    })();
    joined.finish(&result);
    result
}
