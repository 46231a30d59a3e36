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

use crate::data::loader::{DataSpec, DataState, FilesConfig, Loader, Shard};
use crate::data::synthetic::{LossOn, PasskeyConfig};
use crate::dist::dims::{build_groups, Groups, ParallelDims, ParallelMode};
use crate::model::{LlamaConfig, Rope};
use crate::train::checkpoint::{self, TrainState};
use crate::train::config::{RunConfig, Stage};
use crate::train::engine::{Engine, EngineOptions, MemoryReport};
use crate::train::grads::GradBuffer;
use crate::train::metrics::{Metrics, StepLine};
use crate::train::optim::lr_at;
use crate::train::profile::Phase;
use crate::train::zero::{all_reduce_scalar, ShardedAdamW};
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
    /// Mean loss of the first and last optimizer step of every stage.
    pub stage_losses: Vec<(f64, f64)>,
    pub steps: u64,
    pub tokens: u64,
    pub seconds: f64,
    pub export_dir: PathBuf,
    /// Largest memory report seen (rank 0).
    pub memory: MemoryReport,
    /// Most device memory in use in any step (rank 0, CUDA only).
    pub device_peak: Option<u64>,
    /// False when [`RunLimits`] stopped the run before its last step: a checkpoint was
    /// written at the stop, no export.
    pub completed: bool,
}

/// Where one invocation of a run stops early (the config describes the whole run).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct RunLimits {
    /// Stop once the run has done this many optimizer steps in total (the global step,
    /// counted across resumes), writing a checkpoint there and no export; `run(cfg, true)`
    /// then continues exactly as if the run had not stopped (a preemption, on purpose).
    /// A run resumed at or past the stop does nothing and writes nothing.
    pub stop_at_global_step: Option<u64>,
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

/// A dtype name (`f32`/`float32`, `bf16`/`bfloat16`, `f16`/`float16`); errors name
/// `file` and `field`.
pub fn parse_dtype(s: &str, file: &Path, field: &str) -> Result<DType> {
    match s {
        "f32" | "float32" => Ok(DType::F32),
        "bf16" | "bfloat16" => Ok(DType::BF16),
        "f16" | "float16" => Ok(DType::F16),
        _ => Err(Error::config(file, field, format!("expected f32, bf16 or f16, got `{s}`"))),
    }
}

pub use crate::device::parse_device;

/// Resolve `model.source` into a config and initial weights (seeded random ones for a
/// built-in model).
pub fn load_start_model(cfg: &RunConfig) -> Result<StartModel> {
    let m = crate::hub::resolve_model_config(&cfg.model.source, &crate::hub::HubOptions::from_env())?;
    let (mcfg, json) = (m.cfg, m.json);
    let Some(dir) = m.dir else {
        let weights = crate::train::init::random_init(&mcfg, cfg.seed, DType::F32, &Device::Cpu)?;
        return Ok(StartModel { cfg: mcfg, config_json: json, weights, source_dir: None, tokenizer: None });
    };
    let weights = crate::hub::load_weights(&dir, DType::F32, &Device::Cpu)?;
    let tokenizer = if dir.join("tokenizer.json").is_file() { Some(crate::hub::load_tokenizer(&dir)?) } else { None };
    Ok(StartModel { cfg: mcfg, config_json: json, weights, source_dir: Some(dir), tokenizer })
}

/// The data spec of a stage.
fn data_spec(cfg: &RunConfig, model: &StartModel, seq_len: usize) -> Result<DataSpec> {
    let ds = &cfg.data.dataset;
    if let Some(kind) = ds.strip_prefix("synthetic:") {
        // `passkey`: loss on every next token; `passkey-answer`: loss on the answer digits
        // only (what retrieval accuracy is about; the demo's default).
        let loss_on = match kind {
            "passkey" => LossOn::All,
            "passkey-answer" => LossOn::Answer,
            _ => {
                return Err(Error::config(
                    "<run config>",
                    "data.dataset",
                    format!("unknown synthetic dataset `{ds}`; available: synthetic:passkey, synthetic:passkey-answer"),
                ))
            }
        };
        let mut p = PasskeyConfig::new(seq_len);
        p.vocab = model.cfg.vocab_size;
        p.seed = cfg.seed;
        p.loss_on = loss_on;
        return Ok(DataSpec::Passkey(p));
    }
    let mut f = FilesConfig::new(ds.clone(), seq_len);
    f.column = cfg.data.column.clone();
    f.vocab_size = Some(model.cfg.vocab_size);
    f.shuffle_buffer = cfg.data.shuffle_buffer;
    f.seed = cfg.seed;
    f.eos = model.cfg.extra.get("eos_token_id").and_then(|v| v.as_u64()).map(|v| v as u32);
    Ok(DataSpec::Files(f))
}

/// Per-rank context shared by the threads.
struct Shared<'a> {
    cfg: &'a RunConfig,
    model: &'a StartModel,
    device: Device,
    dtype: DType,
    resume: Option<&'a checkpoint::Loaded>,
    limits: RunLimits,
}

/// Run the whole config in this process (in-process ranks; or the world of a launched
/// process when `world` is given).
pub fn run(cfg: &RunConfig, resume: bool) -> Result<RunSummary> {
    run_with_limits(cfg, resume, RunLimits::default())
}

/// [`run`] that may stop early (see [`RunLimits`]).
pub fn run_with_limits(cfg: &RunConfig, resume: bool, limits: RunLimits) -> Result<RunSummary> {
    let src = Path::new("<run config>");
    let device = parse_device(&cfg.model.device, src)?;
    let dtype = if device.is_cpu() { DType::F32 } else { parse_dtype(&cfg.model.dtype, src, "model.dtype")? };
    let model = load_start_model(cfg)?;
    let loaded = if resume { Some(checkpoint::load(&cfg.output_dir)?) } else { None };
    let shared = Shared { cfg, model: &model, device, dtype, resume: loaded.as_ref(), limits };
    let outs = crate::dist::world::run_threads(cfg.parallel.world_size, cfg.collective_timeout(), |comm| rank_main(&shared, comm))?;
    outs.into_iter().next().flatten().ok_or_else(|| Error::Setting("rank 0 returned no summary".into()))
}

/// One rank's whole run: set-up, the stages, the final export. Returns the summary on rank 0.
fn rank_main(sh: &Shared<'_>, world: Arc<dyn Comm>) -> Result<Option<RunSummary>> {
    let cfg = sh.cfg;
    let mut run = RankRun::new(sh, world)?;
    let (start_stage, start_step, mut data_state) = run.resume_point()?;
    let mut stage_losses = Vec::new();
    let mut stopped = false;
    for (si, stage) in cfg.stages.iter().enumerate().skip(start_stage) {
        let first_step = if si == start_stage { start_step } else { 0 };
        let (losses, stop) = run.stage(si, stage, first_step, data_state.take())?;
        stage_losses.push(losses);
        if stop {
            stopped = true;
            break;
        }
    }
    let is_main = run.world.rank() == 0;
    let export_dir = cfg.output_dir.join("export");
    if stopped {
        run.world.barrier()?;
        if is_main {
            eprintln!(
                "stopped after step {} as asked; checkpoint in {} (continue with --resume)",
                run.global_step,
                checkpoint::checkpoint_dir(&cfg.output_dir).display()
            );
        }
    } else {
        if is_main {
            run.export(&export_dir)?;
        }
        run.world.barrier()?;
    }
    let summary = RunSummary {
        stage_losses,
        steps: run.global_step,
        tokens: run.total_tokens,
        seconds: run.t0.elapsed().as_secs_f64(),
        export_dir,
        memory: run.memory,
        device_peak: run.device_peak,
        completed: !stopped,
    };
    if let (false, Some(m)) = (stopped, run.metrics.as_mut()) {
        m.finish(&summary)?;
    }
    Ok(if is_main { Some(summary) } else { None })
}

/// What one rank carries through its run.
struct RankRun<'a> {
    sh: &'a Shared<'a>,
    world: Arc<dyn Comm>,
    engine: Engine,
    optim: ShardedAdamW,
    /// This rank's gradients of the current step (`[W·L]` f32, see `grads`).
    grads: GradBuffer,
    /// Rank 0 only.
    metrics: Option<Metrics>,
    /// Rebuilt when a stage changes the mode.
    groups: Option<(ParallelMode, ParallelDims, Groups)>,
    /// Largest memory report seen.
    memory: MemoryReport,
    device_peak: Option<u64>,
    total_tokens: u64,
    global_step: u64,
    t0: Instant,
}

/// One stage's layout and data on this rank.
struct StageRun {
    attn: Arc<dyn AttentionMode>,
    indices: Vec<usize>,
    loader: Loader,
    /// Data-parallel size.
    dp: usize,
    lr_base: f64,
}

impl<'a> RankRun<'a> {
    /// Weights on the device (from the start model, or the checkpoint when resuming), the
    /// engine, this rank's optimizer slice and, on rank 0, the metrics log.
    fn new(sh: &'a Shared<'a>, world: Arc<dyn Comm>) -> Result<Self> {
        let (cfg, mcfg) = (sh.cfg, &sh.model.cfg);
        let mut vars: HashMap<String, Var> = HashMap::new();
        for (n, t) in &sh.model.weights {
            let t = match sh.resume {
                Some(l) => l
                    .weights
                    .get(n)
                    .ok_or_else(|| Error::checkpoint(checkpoint::checkpoint_dir(&cfg.output_dir), format!("tensor `{n}` missing")))?,
                None => t,
            };
            vars.insert(n.clone(), Var::from_tensor(&t.to_dtype(sh.dtype)?.to_device(&sh.device)?)?);
        }
        let opts = EngineOptions {
            token_chunk: cfg.parallel.token_chunk,
            offload_activations: cfg.parallel.offload_activations,
            profile: cfg.train.profile,
            save_attention: cfg.parallel.save_attention,
            layer_backward: cfg.train.layer_backward,
        };
        let engine = Engine::from_vars(mcfg, &vars, opts)?;
        let n_params: usize = engine.params.iter().map(|(_, v)| v.as_tensor().elem_count()).sum();
        let is_main = world.rank() == 0;
        let resumed_at = sh.resume.map(|l| l.state.global_step);
        let metrics = if is_main { Some(Metrics::new(&cfg.output_dir, cfg, n_params, mcfg, resumed_at)?) } else { None };
        if let (true, Some(w)) = (is_main, mcfg.sliding_window()) {
            eprintln!(
                "note: the model's config asks for a sliding attention window of {w} tokens; longctx trains full causal \
                 attention over each sequence and exports with the window turned off (sliding_window: null), so \
                 transformers runs the attention that was trained"
            );
        }
        // ZeRO-1 over every rank of the world. On a GPU (unless `optimizer_on_host`) the
        // state lives and updates on the device. Masters start from the f32 host copy of
        // the start weights (not from weights already rounded to the run dtype), or from
        // the checkpoint's optimizer state when resuming.
        let on_device = (!sh.device.is_cpu() && !cfg.train.optimizer_on_host).then_some(&sh.device);
        let resume_opt = sh.resume.map(|l| (l.state.adam_step, l));
        let optim = ShardedAdamW::new(
            cfg.train.adamw.clone(),
            &engine.params,
            &sh.model.weights,
            (world.rank(), world.world()),
            on_device,
            resume_opt,
        )?;
        let global_step = sh.resume.map_or(0, |l| l.state.global_step);
        let grads = GradBuffer::new(&engine.params, optim.padded_len(), &sh.device)?;
        Ok(Self {
            sh,
            world,
            engine,
            optim,
            grads,
            metrics,
            groups: None,
            memory: MemoryReport::default(),
            device_peak: None,
            total_tokens: 0,
            global_step,
            t0: Instant::now(),
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
    fn stage_setup(&mut self, si: usize, stage: &Stage, data: Option<DataState>) -> Result<StageRun> {
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
        self.engine.set_rope(Rope::new(&mcfg.with_rope_theta(stage.rope_theta)));
        let indices = mode.local_indices(dims, g.sp.rank(), stage.seq_length, chunk)?;
        let spec = data_spec(cfg, self.sh.model, stage.seq_length)?;
        let mut loader = Loader::new(&spec, self.sh.model.tokenizer.as_ref(), Shard { rank: dp_rank, world: dp })?;
        if let Some(ds) = &data {
            loader.restore(ds)?;
        }
        if let Some(m) = self.metrics.as_mut() {
            m.stage_start(si, stage, mode, self.world.world(), dims.sp, dp)?;
        }
        let lr_base = stage.learning_rate.unwrap_or(cfg.train.learning_rate);
        Ok(StageRun { attn, indices, loader, dp, lr_base })
    }

    /// Steps `first_step..` of stage `si`: (first and last loss, whether the run stopped).
    fn stage(&mut self, si: usize, stage: &Stage, first_step: u64, data: Option<DataState>) -> Result<((f64, f64), bool)> {
        let mut st = self.stage_setup(si, stage, data)?;
        let (mut first_loss, mut last_loss) = (f64::NAN, f64::NAN);
        let limit = self.sh.limits.stop_at_global_step;
        for step in first_step..stage.steps {
            if limit.is_some_and(|n| self.global_step >= n) {
                // resumed at or past the stop: nothing to do, the checkpoint stands
                return Ok(((first_loss, last_loss), true));
            }
            let loss = self.step(&mut st, si, stage, step)?;
            if step == first_step {
                first_loss = loss;
            }
            last_loss = loss;
            let every = self.sh.cfg.train.checkpoint_every;
            let stage_end = step + 1 == stage.steps;
            let stop = limit.is_some_and(|n| self.global_step >= n);
            if (every > 0 && self.global_step.is_multiple_of(every)) || stage_end || stop {
                let (ns, nst) = if stage_end { (si + 1, 0) } else { (si, step + 1) };
                let data = if stage_end { None } else { Some(st.loader.state()) };
                self.optim.sync_to_host()?;
                save_checkpoint(self.sh, &self.world, &self.engine, &self.optim, ns, nst, self.global_step, data)?;
            }
            if stop {
                return Ok(((first_loss, last_loss), true));
            }
        }
        Ok(((first_loss, last_loss), false))
    }

    /// One optimizer step (all micro-batches of it); returns the loss, after logging it.
    fn step(&mut self, st: &mut StageRun, si: usize, stage: &Stage, step: u64) -> Result<f64> {
        crate::dist::world::test_stall(self.world.rank(), self.global_step)?;
        let (sh, cfg) = (self.sh, self.sh.cfg);
        let ts = Instant::now();
        crate::train::metrics::device_memory(&sh.device, true)?; // reset the high-water mark
                                                                 // Micro-batches of this step, localized.
        let mut micro = Vec::new();
        for _ in 0..cfg.train.gradient_accumulate_every {
            let batch = st.loader.next_batch(cfg.train.batch_size)?.ok_or_else(|| {
                Error::data(&cfg.data.dataset, format!("dataset exhausted at stage {si} step {step}; use more data or fewer steps"))
            })?;
            let local = batch.localize(&st.indices)?;
            let (b, s) = (batch.batch, st.indices.len());
            let ids = Tensor::from_slice(&local.ids, (b, s), &sh.device)?;
            let targets = Tensor::from_slice(&local.targets, (b, s), &sh.device)?;
            let pos = Tensor::from_slice(&local.positions, (b, s), &sh.device)?;
            let counted = local.targets.iter().filter(|&&t| t >= 0).count();
            micro.push((ids, targets, pos, counted));
        }
        let local_count: usize = micro.iter().map(|m| m.3).sum();
        let global_count = all_reduce_scalar(&self.world, local_count as f64, &sh.device)?;
        let scale = if global_count > 0.0 { 1.0 / global_count } else { 0.0 };
        // Every micro-batch adds into the same flat gradient buffer.
        self.grads.zero()?;
        let (mut loss_sum, mut engine_seconds) = (0f64, 0f64);
        for (ids, targets, pos, _) in &micro {
            let te = Instant::now();
            let r = self.engine.step_into(ids, targets, pos, stage.seq_length, &st.attn, scale, &self.grads)?;
            engine_seconds += te.elapsed().as_secs_f64();
            loss_sum += r.loss_sum;
            let m = &mut self.memory;
            m.saved_bytes = m.saved_bytes.max(r.memory.saved_bytes);
            m.saved_host_bytes = m.saved_host_bytes.max(r.memory.saved_host_bytes);
            m.transient_bytes = m.transient_bytes.max(r.memory.transient_bytes);
        }
        let loss = self.engine.profiler().time(Phase::Comm, &sh.device, || all_reduce_scalar(&self.world, loss_sum, &sh.device))?
            / global_count.max(1.0);
        // The loss is all-reduced: every rank sees the same value and stops together,
        // before a non-finite loss reaches the weights.
        if !loss.is_finite() {
            return Err(Error::Setting(format!(
                "stage {si} step {}: loss is {loss} (summed over all ranks; the weights were not updated); lower the \
                 learning rate or check the data",
                step + 1
            )));
        }
        let t = &cfg.train;
        let lr = lr_at(t.lr_schedule, st.lr_base, step, stage.steps, t.warmup_steps, t.min_lr_ratio);
        let norm = self.engine.profiler().time(Phase::Optimizer, &sh.device, || {
            Ok(self.optim.step(&self.world, &self.grads, &self.engine.params, lr, t.clip_grad, (sh.dtype, &sh.device))?.grad_norm)
        })?;
        self.global_step += 1;
        let tokens = (t.batch_size * t.gradient_accumulate_every * st.dp * stage.seq_length) as u64;
        self.total_tokens += tokens;
        let step_peak = crate::train::metrics::device_memory(&sh.device, false)?.map(|(_, high)| high);
        let profile = if cfg.train.profile { Some(self.engine.take_profile()?) } else { None };
        self.device_peak = self.device_peak.max(step_peak);
        if let Some(m) = self.metrics.as_mut() {
            m.step(&StepLine {
                stage: si,
                step: step + 1,
                steps: stage.steps,
                global_step: self.global_step,
                loss,
                lr,
                grad_norm: norm,
                tokens,
                seconds: ts.elapsed().as_secs_f64(),
                engine_seconds,
                seq_len: stage.seq_length,
                memory: self.memory,
                device_peak: step_peak,
                profile,
            })?;
        }
        Ok(loss)
    }

    /// The Hugging Face export of the final weights (rank 0), as `longctx export` of the
    /// final checkpoint writes it ([`crate::hub::ModelExport::for_run`]).
    fn export(&self, export_dir: &Path) -> Result<()> {
        let (sh, cfg) = (self.sh, self.sh.cfg);
        let tensors: Vec<(String, Tensor)> = self.engine.params.iter().map(|(n, v)| (n.clone(), v.as_tensor().detach())).collect();
        let finished = crate::hub::RunProgress::finished(cfg);
        crate::hub::ModelExport::new(tensors, sh.model.config_json.clone(), sh.model.source_dir.clone())
            .for_run(cfg, finished, sh.model.cfg.max_position_embeddings, Path::new("<run config>"))?
            .write(export_dir)?;
        Ok(())
    }
}

#[allow(clippy::too_many_arguments)]
fn save_checkpoint(
    sh: &Shared<'_>,
    world: &Arc<dyn Comm>,
    engine: &Engine,
    optim: &ShardedAdamW,
    stage: usize,
    stage_step: u64,
    global_step: u64,
    data: Option<DataState>,
) -> Result<()> {
    // Every rank writes its own optimizer shard into the temporary directory rank 0 made;
    // rank 0 then adds the weights and state and swaps it into place.
    let (rank, n) = (world.rank(), world.world());
    let out = &sh.cfg.output_dir;
    if rank == 0 {
        checkpoint::begin(out)?;
    }
    world.barrier()?;
    checkpoint::write_shard(&checkpoint::tmp_dir(out), rank, &optim.shard())?;
    world.barrier()?;
    if rank == 0 {
        let weights: HashMap<String, Tensor> = engine.params.iter().map(|(n, v)| (n.clone(), v.as_tensor().detach())).collect();
        let state = TrainState {
            stage,
            stage_step,
            global_step,
            adam_step: optim.steps(),
            data: serde_json::to_value(&data).map_err(|e| Error::Setting(e.to_string()))?,
            optimizer_shards: n,
            config: serde_json::to_value(sh.cfg).map_err(|e| Error::Setting(e.to_string()))?,
        };
        checkpoint::finish(out, &weights, &state)?;
    }
    world.barrier()?;
    Ok(())
}

/// Run as one process of a launched world (`longctx launch`, torchrun, Slurm): the
/// world comes from [`crate::dist::world::join`] (NCCL on `cuda:LOCAL_RANK`, or the CPU
/// process transport with `model.device = cpu`); then the same rank loop as in-process
/// runs. A failing rank tells the others, which stop within a bounded time.
pub fn run_launched(cfg: &RunConfig, resume: bool, env: &crate::dist::env::DistEnv, limits: RunLimits) -> Result<Option<RunSummary>> {
    if env.world != cfg.parallel.world_size {
        return Err(Error::Setting(format!(
            "WORLD_SIZE is {} but parallel.world_size is {}; leave --world-size unset under a launcher",
            env.world, cfg.parallel.world_size
        )));
    }
    let joined = crate::dist::world::join(env, &cfg.model.device, cfg.collective_timeout())?;
    let result = (|| {
        let dtype =
            if joined.device.is_cpu() { DType::F32 } else { parse_dtype(&cfg.model.dtype, Path::new("<run config>"), "model.dtype")? };
        let model = load_start_model(cfg)?;
        let loaded = if resume { Some(checkpoint::load(&cfg.output_dir)?) } else { None };
        let shared = Shared { cfg, model: &model, device: joined.device.clone(), dtype, resume: loaded.as_ref(), limits };
        rank_main(&shared, joined.comm.clone())
    })();
    joined.finish(&result);
    result
}
