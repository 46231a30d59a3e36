//! `longctx plan`: per-GPU memory of a model at a length on a layout, whether it fits and
//! a layout that does. With `--config`, every stage of the run is planned; the layout flags
//! override the config exactly as they do for `train` ([`LayoutFlags`]).

use super::overrides::{LayoutFlags, StageFlags};
use super::{group, parse_dtype, size_arg, tokens_arg};
use anyhow::{anyhow, bail, Context, Result};
use clap::Args;
use longctx::plan::{self, PlanRequest};
use longctx::train::config::{ParallelMode, RunConfig};
use longctx::train::deepspeed::{Applied, BatchFlags};
use longctx::train::offload::Offload;
use std::path::{Path, PathBuf};

const MODEL_HELP: &str = "Model: `builtin:NAME`, a Hugging Face model directory (or its config.json), or a hub id \
                          (only config.json is fetched) [default: the --config's model]";
const SEQ_LENGTH_HELP: &str = "Sequence length in tokens (e.g. 524288, 512K, 1M) [required without --config]";
const WORLD_SIZE_HELP: &str = "Ranks, one GPU each [default: --gpus]; more ranks than GPUs is an error";
const PARALLEL_MODE_HELP: &str =
    "data_parallel | zigzag_ring_attn | ulysses_attn | fpdt | usp [default: the config's; data_parallel on 1 GPU, else zigzag_ring_attn]";
const BATCH_SIZE_HELP: &str = "Sequences per micro-batch per data-parallel rank [default: 1]";
const DTYPE_HELP: &str = "Model dtype on the GPU: bf16, f16 or f32 [default: the config's if not f32, else bf16]";

/// The layout flags are `train`'s ([`LayoutFlags`]); their help says plan's defaults.
#[derive(Args, Debug)]
#[command(
    mut_arg("model", |a| a.help(MODEL_HELP)),
    mut_arg("seq_length", |a| a.help(SEQ_LENGTH_HELP).value_parser(tokens_arg)),
    mut_arg("world_size", |a| a.help(WORLD_SIZE_HELP)),
    mut_arg("parallel_mode", |a| a.help(PARALLEL_MODE_HELP)),
    mut_arg("batch_size", |a| a.help(BATCH_SIZE_HELP)),
    mut_arg("dtype", |a| a.help(DTYPE_HELP))
)]
pub struct PlanArgs {
    /// Run config: plan every stage with its parallel settings (flags override).
    #[arg(long)]
    pub config: Option<PathBuf>,
    /// A DeepSpeed JSON config (its zero_optimization offloads, dtype, batch and
    /// accumulation), applied over --config's settings as `train --deepspeed` does.
    #[arg(long, value_name = "FILE")]
    pub deepspeed: Option<PathBuf>,
    #[command(flatten)]
    pub layout: LayoutFlags,
    /// GPUs in total [default: --world-size, else the config's world_size, else 1].
    #[arg(long)]
    pub gpus: Option<usize>,
    /// Nodes the GPUs are spread over.
    #[arg(long, default_value_t = 1)]
    pub nnodes: usize,
    /// Memory of one GPU: bytes or a size such as 141GB, 80GB, 96GiB; the default is an H200 as
    /// its driver reports it (150.8 GB).
    #[arg(long, default_value = longctx::plan::DEFAULT_GPU_MEMORY_ARG, value_parser = size_arg)]
    pub gpu_memory: u64,
    /// Host memory of one node (checked only when given), e.g. 2TB.
    #[arg(long, value_parser = size_arg)]
    pub host_memory: Option<u64>,
    /// Keep the AdamW state on the GPU even where the config says `optimizer_on_host`
    /// (the default, as for `train`, is the GPU; --optimizer-on-host moves it to the host).
    #[arg(long, conflicts_with = "optimizer_on_host")]
    pub optimizer_on_device: bool,
    /// Fixed allowance per GPU (CUDA context, workspaces, fragmentation).
    #[arg(long, default_value = "3GB", value_parser = size_arg)]
    pub overhead: u64,
    /// Print JSON instead of text.
    #[arg(long)]
    pub json: bool,
}

pub fn plan_cmd(a: PlanArgs) -> Result<()> {
    let file = match &a.config {
        Some(p) => {
            let mut c = RunConfig::from_file(p)?;
            let ds = longctx::train::deepspeed::resolve(&mut c, a.deepspeed.as_deref(), p)?;
            ds.lines.iter().for_each(|l| eprintln!("{l}"));
            ds.validate(&c, p)?;
            Some((c, p.clone(), ds))
        }
        None => None,
    };
    let spec = match (&a.layout.model, &file) {
        (Some(m), _) => m.clone(),
        (None, Some((c, _, _))) => c.model.source.clone(),
        (None, None) => bail!("--model is required (or --config with a model.source)"),
    };
    let info = longctx::hub::model_config(&spec, &longctx::hub::HubOptions::from_env(), true)?
        .ok_or_else(|| anyhow!("model `{spec}` not found"))?;
    let shape = plan::ModelShape::from_config(&info.cfg);
    // The config as written must suit the model; the flags are checked by the planner.
    if let Some((c, p, _)) = &file {
        plan::check_run(c, &info.cfg, p)?;
    }
    let from_file = file.is_some();
    let run = planned_run(&a, file.map(|(c, _, ds)| (c, ds)))?;
    let mut plans = Vec::new();
    for (label, r) in requests(&a, &run, from_file)? {
        let p =
            plan::plan(&shape, &r).with_context(|| if label.is_empty() { "planning".to_string() } else { format!("planning {label}") })?;
        plans.push((label, p));
    }
    if a.json {
        let v: Vec<&plan::Plan> = plans.iter().map(|(_, p)| p).collect();
        println!("{}", serde_json::to_string_pretty(&if v.len() == 1 { serde_json::to_value(v[0])? } else { serde_json::to_value(&v)? })?);
        return Ok(());
    }
    println!(
        "model: {spec}: {} parameters, {} layers, hidden {}, {} query / {} kv heads × {}, vocab {}",
        group(shape.params),
        shape.layers,
        shape.hidden,
        shape.heads,
        shape.kv_heads,
        shape.head_dim,
        shape.vocab
    );
    for (label, p) in &plans {
        if !label.is_empty() {
            println!("\n== {label}");
        }
        print_plan(p);
    }
    Ok(())
}

/// The run to plan: `--config`'s, else defaults (one rank per GPU; data parallel on one
/// GPU, else the zigzag ring), with the flags applied as `train` applies them. A config's
/// f32 (the CPU default) counts as bf16 unless `--dtype` says otherwise, and the flags
/// also beat a stage's own `parallel_mode` / `fpdt_chunk_size`.
/// `file`: the config and its DeepSpeed settings (applied and checked already).
fn planned_run(a: &PlanArgs, file: Option<(RunConfig, Applied)>) -> Result<RunConfig> {
    let from_file = file.is_some();
    let (mut c, ds) = match file {
        Some(f) => f,
        None => {
            let mut c = RunConfig::plain();
            c.parallel.world_size = a.layout.parallel.world_size.or(a.gpus).unwrap_or(1);
            c.parallel.mode = if c.parallel.world_size > 1 { ParallelMode::ZigzagRingAttn } else { ParallelMode::DataParallel };
            let ds = longctx::train::deepspeed::resolve(&mut c, a.deepspeed.as_deref(), Path::new(super::FLAGS))?;
            ds.lines.iter().for_each(|l| eprintln!("{l}"));
            (c, ds)
        }
    };
    if matches!(c.model.dtype.as_str(), "f32" | "float32") {
        c.model.dtype = "bf16".into();
    }
    a.layout.apply(&mut c)?;
    a.layout.parallel.apply_ring_degree(&mut c)?;
    if !from_file && a.layout.seq_length.is_none() {
        bail!("--seq-length is required (or --config with stages)");
    }
    StageFlags::default().apply(a.layout.seq_length, &mut c);
    // DeepSpeed's batch rule, on the layout planned.
    let flags = BatchFlags { batch_size: a.layout.batch_size.is_some(), gradient_accumulate_every: false };
    ds.finish(&mut c, flags)?.iter().for_each(|l| eprintln!("{l}"));
    Ok(c)
}

/// One request per stage of `run`, labelled by stage unless `--seq-length` made the one.
fn requests(a: &PlanArgs, run: &RunConfig, from_file: bool) -> Result<Vec<(String, PlanRequest)>> {
    let p = &run.parallel;
    let dtype_bytes = parse_dtype(&run.model.dtype, "--dtype")?.size_in_bytes();
    // The stages as `train` would run them, then what only `plan` asks about.
    let reqs = plan::run_requests(run, a.gpu_memory, dtype_bytes);
    Ok(run
        .stages
        .iter()
        .zip(reqs)
        .enumerate()
        .map(|(i, (st, mut r))| {
            r.gpus = a.gpus.unwrap_or(p.world_size);
            r.nnodes = a.nnodes;
            r.host_memory = a.host_memory;
            // As `train` runs it: the config's `train.optimizer_on_host` (default: the GPU).
            r.optimizer_on_host = run.train.optimizer_on_host && !a.optimizer_on_device;
            if !r.optimizer_on_host {
                r.optimizer_device_units = 0; // the whole state on the GPU
            }
            r.overhead = a.overhead;
            // A config's sp_size 0 is "all ranks", the request's None (a flag goes as given);
            // without a config, an unset --ulysses-size stays unset, as the planner's default.
            r.sp = (a.layout.parallel.sp_size.is_some() || p.sp_size > 0).then_some(p.sp_size);
            r.ulysses = (from_file || a.layout.parallel.ulysses_size.is_some()).then_some(p.ulysses_size);
            let label = if a.layout.seq_length.is_some() { String::new() } else { format!("stage {i} (rope_theta {})", st.rope_theta) };
            (label, r)
        })
        .collect())
}

fn print_plan(p: &plan::Plan) {
    let r = &p.request;
    let e = &p.estimate;
    let l = &e.layout;
    let mut how = format!("{}", l.mode);
    match l.mode {
        ParallelMode::Usp => how += &format!(" (ulysses {} × ring {})", l.ulysses, l.ring),
        ParallelMode::Fpdt => how += &format!(" (chunk {}{})", r.fpdt_chunk, if r.fpdt_offload { ", kv offload" } else { "" }),
        _ => {}
    }
    println!(
        "{} tokens, {how} on {} GPU(s) ({} rank(s), sp {} × dp {}): {} tokens per GPU, micro-batch {}, {}-byte weights, token chunk {}{}, {}",
        plan::tokens_label(r.seq_len),
        r.gpus,
        l.world,
        l.sp,
        l.dp,
        l.local_tokens,
        r.batch_size,
        r.dtype_bytes,
        r.token_chunk,
        match r.offload() {
            Offload::All => ", activations offloaded",
            Offload::Inputs => ", layer inputs offloaded",
            Offload::Off => "",
        },
        match r.optimizer_device_units {
            n if n > 0 && r.optimizer_on_host => {
                format!("optimizer state on the host but the first {n} unit(s)' on the GPU: --optimizer-device-units {n}")
            }
            _ => optimizer_place(r.optimizer_on_host).to_string(),
        }
    );
    print_device(p);
    print_host(p);
    print_suggestion(p);
}

/// Where the AdamW state is, and the flag that moves it (the default is the GPU, as for
/// `train`; `plan` and `inspect` say it in these words).
pub fn optimizer_place(on_host: bool) -> &'static str {
    if on_host {
        "optimizer state on the host: --optimizer-on-host"
    } else {
        "optimizer state on the GPU: the default, --optimizer-on-host moves it to the host"
    }
}

/// The device memory table.
fn print_device(p: &plan::Plan) {
    let (r, e) = (&p.request, &p.estimate);
    let d = &e.device;
    let z = r.zero_stage;
    let saved_mlp = match plan::mlp_layers(&p.model, r) {
        0 => "off".to_string(),
        n if n == p.model.layers => "MLP input, gate, up per layer".to_string(),
        n => format!("MLP input, gate, up of the top {n} of {} layers", p.model.layers),
    };
    let rows: [(&str, u64, &str); 15] = [
        (
            "weights",
            d.weights,
            match (z, r.offload_params) {
                (3, true) => "ZeRO-3, slice on the host: two layers gathered",
                (3, false) => "ZeRO-3: this rank's slice and two layers gathered",
                _ => "",
            },
        ),
        (
            "gradients (f32)",
            d.gradients,
            match (z >= 2, p.estimate.layout.world, r.offload_gradients && e.host.gradients > 0) {
                (true, 1, true) => "on the host but two layers' turns, one brought back (--offload-gradients), the device units'",
                (true, _, true) => "on the host but one layer's scratch, three slices in flight (--offload-gradients), the device units'",
                (true, 1, false) => "ZeRO-2, one rank: the whole slice, written in place",
                (true, _, false) => "ZeRO-2: this rank's slice and one layer's",
                _ => "one flat buffer",
            },
        ),
        (
            "optimizer (f32 master, m, v)",
            d.optimizer,
            match (r.optimizer_on_host, z) {
                (true, _) if r.optimizer_device_units > 0 => "the first units' (--optimizer-device-units), the rest on the host",
                (true, _) => "on the host",
                (false, 0) => "ZeRO-0: whole on every rank",
                _ => "sharded over all ranks",
            },
        ),
        ("saved activations", d.saved_activations, if r.offload().inputs() { "offloaded" } else { "" }),
        ("saved attention", d.saved_attention, if r.save_attention { "q, k, v, o, lse per layer" } else { "off" }),
        ("saved MLP", d.saved_mlp, &saved_mlp),
        ("layer transient", d.layer_transient, "backward of one layer, of which:"),
        (
            "  layer groups in flight",
            d.in_flight,
            match r.offload() {
                Offload::All => "brought back from the host",
                Offload::Inputs => "layer inputs brought back from the host",
                Offload::Off => "",
            },
        ),
        ("  gradient, core, chunk", d.layer_backward, "[b,s,h] gradient, q/k/v/o (+ grads), one chunk"),
        ("  attention workspace", d.attention_work, "f32 accumulators of the fused backward"),
        ("  attention mode", d.attention_mode, ""),
        ("head transient", d.head_transient, "logits chunk; not alive with the layer's"),
        ("overhead", d.overhead, "outside the memory pool"),
        ("optimizer step buffers", d.grad_reduce, "optimizer step only"),
        ("memory pool peak", d.pool_peak, "what a run's device_peak_bytes measures"),
    ];
    println!("  per GPU                             GB");
    for (name, v, note) in rows {
        println!("{}", format!("  {name:<30} {:>8}  {note}", plan::gb(v)).trim_end());
    }
    println!("  peak, forward/backward         {:>8}", plan::gb(d.peak_compute));
    println!("  peak, optimizer step           {:>8}", plan::gb(d.peak_step));
    println!(
        "  peak                           {:>8}  of {} GB: {}",
        plan::gb(d.peak),
        plan::gb(r.gpu_memory),
        if e.fits_gpu {
            format!("fits ({} GB free)", plan::gb(r.gpu_memory - d.peak))
        } else {
            format!("does NOT fit ({} GB short)", plan::gb(d.peak - r.gpu_memory))
        }
    );
}

/// The host memory line.
fn print_host(p: &plan::Plan) {
    let (r, e) = (&p.request, &p.estimate);
    let h = &e.host;
    println!(
        "  host: {} GB per rank (optimizer {}, weights {}, offloaded activations {}, fpdt parked {}, gradients {}, gradient pieces {}, \
         start weights {}, freed before the first step: the larger of them and the three before counts), {} GB per node of {} rank(s){}",
        plan::gb(h.per_rank),
        plan::gb(h.optimizer),
        plan::gb(h.weights),
        plan::gb(h.saved_activations),
        plan::gb(h.fpdt_parked),
        plan::gb(h.gradients),
        plan::gb(h.grads_copy),
        plan::gb(h.weights_copy),
        plan::gb(h.per_node),
        h.ranks_per_node,
        match (e.fits_host, r.host_memory) {
            (Some(true), Some(m)) => format!(": fits in {} GB", plan::gb(m)),
            (Some(false), Some(m)) => format!(": does NOT fit in {} GB", plan::gb(m)),
            _ => String::new(),
        }
    );
}

/// The suggested layout as flags (also printed by `inspect`): every flag it adds to the
/// request is named.
pub fn print_suggestion(p: &plan::Plan) {
    let r = &p.request;
    match &p.suggestion {
        Some(s) if s.as_requested && s.save_attention == r.save_attention && !mlp_added(p.model.layers, s, r) => {
            println!("  suggestion: as requested ({} GB peak)", plan::gb(s.peak))
        }
        Some(s) if s.as_requested => {
            let mut added = Vec::new();
            if s.save_attention && !r.save_attention {
                added.push("--save-attention".to_string());
            }
            if mlp_added(p.model.layers, s, r) {
                added.push(mlp_flag(s));
            }
            println!(
                "  suggestion: as requested, with {} (less recompute in the backward: faster; {} GB peak)",
                added.join(" "),
                plan::gb(s.peak)
            )
        }
        Some(s) => println!("  suggestion: {} ({} GB peak)", suggestion_flags(p.model.layers, s, r), plan::gb(s.peak)),
        None => {
            let largest = match plan::largest_suggested(&p.model, r) {
                Some((n, s)) => format!(
                    "the largest length that fits there is {} (with {}); for {}, add GPUs (the activation terms shrink with sp) or a smaller micro-batch",
                    plan::tokens_label(n),
                    suggestion_flags(p.model.layers, &s, &plan::PlanRequest { seq_len: n, ..r.clone() }),
                    plan::tokens_label(r.seq_len)
                ),
                None => "no length from 1K up fits there; add GPUs or a smaller micro-batch".to_string(),
            };
            println!(
                "  suggestion: none fits {} tokens on {} GPU(s) of {} GB; {largest}",
                plan::tokens_label(r.seq_len),
                r.gpus,
                plan::gb(r.gpu_memory)
            )
        }
    }
}

/// Whether suggestion `s` keeps the MLP of more of the model's `layers` than request `r`.
fn mlp_added(layers: usize, s: &plan::Suggestion, r: &plan::PlanRequest) -> bool {
    s.mlp_layers(layers) > longctx::train::config::mlp_saved_layers(r.save_mlp, r.save_mlp_layers, layers)
}

/// The flag that keeps the MLP tensors the way suggestion `s` does.
fn mlp_flag(s: &plan::Suggestion) -> String {
    match s.save_mlp_layers {
        Some(n) => format!("--save-mlp-layers {n}"),
        None => "--save-mlp".to_string(),
    }
}

/// The flags that turn request `r` into suggestion `s` (the mode always named).
fn suggestion_flags(layers: usize, s: &plan::Suggestion, r: &plan::PlanRequest) -> String {
    let mut flags = format!("--parallel-mode {}", s.mode);
    if s.mode != ParallelMode::DataParallel && s.sp != r.world {
        flags += &format!(" --sp-size {}", s.sp);
    }
    if s.mode == ParallelMode::Usp {
        flags += &format!(" --ulysses-size {}", s.ulysses);
    }
    if let Some(c) = s.fpdt_chunk {
        flags += &format!(" --fpdt-chunk-size {c}");
    }
    if s.fpdt_offload {
        flags += " --fpdt-offload";
    }
    if s.offload_activations && !r.offload_activations {
        flags +=
            if r.offload_layer_inputs { " --offload-activations (instead of --offload-layer-inputs)" } else { " --offload-activations" };
    }
    if s.save_attention && !r.save_attention {
        flags += " --save-attention";
    }
    if mlp_added(layers, s, r) {
        flags += &format!(" {}", mlp_flag(s));
    }
    for lever in plan::added_levers(s, r) {
        flags += &format!(" {}", lever.flag);
    }
    flags
}

/// The stages of a resolved run as `train --dry-run` prints them after the config, as TOML
/// comments (the output stays a config file): per stage its length, θ,
/// steps, layout, batch × accumulation × data-parallel ranks = tokens per optimizer step,
/// data and seed; the total tokens; and, when the model's config is at hand, the planner's
/// peak per GPU of each stage against `gpu_memory` (the GPU's, else an H200's, [`longctx::plan::DEFAULT_GPU_MEMORY`]).
pub fn print_run_plan(cfg: &RunConfig, model: Option<&longctx::model::LlamaConfig>, gpu_memory: Option<u64>) -> Result<()> {
    let gpu = gpu_memory.unwrap_or(longctx::plan::DEFAULT_GPU_MEMORY);
    let reqs = match model {
        Some(_) => plan::run_requests(cfg, gpu, plan::weight_bytes(cfg, Path::new(super::FLAGS))?),
        None => Vec::new(),
    };
    println!("# plan: {} stage(s) on {} rank(s)", cfg.stages.len(), cfg.parallel.world_size);
    let mut total = 0u128;
    for (i, st) in cfg.stages.iter().enumerate() {
        let s = cfg.stage_settings(i);
        let tokens = s.tokens_per_step();
        total += u128::from(tokens) * u128::from(st.steps);
        let mem = match (model, reqs.get(i)) {
            (Some(m), Some(r)) => match plan::estimate(&plan::ModelShape::from_config(m), r) {
                Ok(e) => format!(
                    "; peak {} per GPU{}",
                    super::human_bytes(e.device.peak),
                    if e.fits_gpu { String::new() } else { format!(" (does NOT fit {})", super::human_bytes(gpu)) }
                ),
                Err(e) => format!("; memory: {e}"),
            },
            _ => String::new(),
        };
        println!(
            "#   stage {i}: {} tokens, θ {}{}, {} steps, {} (sp {} × dp {}), batch {} × accumulate {} × dp {} = {} tokens/step, lr {:e}{}, data {} seed {}{}{mem}",
            plan::tokens_label(st.seq_length),
            st.rope_theta,
            match &st.rope {
                Some(r) => format!(
                    ", rope {}{}{}",
                    r.kind,
                    r.factor.map_or(String::new(), |f| format!(" ×{f}")),
                    r.original_max_position_embeddings.map_or(String::new(), |o| format!(" from {}", plan::tokens_label(o)))
                ),
                None => String::new(),
            },
            st.steps,
            s.mode,
            s.sp,
            s.dp,
            s.batch_size,
            s.gradient_accumulate_every,
            s.dp,
            group(tokens),
            s.learning_rate,
            if s.warmup_steps > 0 { format!(" warmup {}", s.warmup_steps) } else { String::new() },
            s.dataset,
            s.seed,
            if s.reset_optimizer { ", fresh optimizer" } else { "" },
        );
    }
    println!(
        "#   total: {} tokens; optimizer state on the {}",
        group(u64::try_from(total).unwrap_or(u64::MAX)),
        if cfg.train.optimizer_on_host || cfg.model.device == "cpu" { "host" } else { "GPU" }
    );
    if let Some(m) = model {
        let d = plan::disk_need(cfg, m, plan::weight_bytes(cfg, Path::new(super::FLAGS))? as u64, false);
        let free =
            longctx::device::disk_free(&cfg.output_dir).map_or(String::new(), |f| format!(" ({} free there)", super::human_bytes(f)));
        println!(
            "#   disk: checkpoint {}, export {}; {} free needed in {}{free}",
            super::human_bytes(d.checkpoint),
            super::human_bytes(d.export),
            super::human_bytes(d.peak),
            cfg.output_dir.display()
        );
    }
    Ok(())
}

/// Samples the dry run peeks at to describe documents packing.
pub const DOC_PEEK_SAMPLES: usize = 16;
/// Tokens the peek reads at most (fewer samples when they are long).
pub const DOC_PEEK_TOKENS: usize = 4 << 20;

/// `train --dry-run` with `data.packing = "documents"`: documents per sample and the
/// attention work relative to one document per sample, on the first samples of stage 0's
/// data (read through the same pipeline the trainer uses; no shuffle, so it stays fast).
pub fn print_document_peek(cfg: &RunConfig, model: Option<&longctx::hub::ModelConfig>) {
    if cfg.data.packing != longctx::train::config::PackingMode::Documents || cfg.stages.is_empty() {
        return;
    }
    match document_peek(cfg, model) {
        Ok(Some(p)) => println!("#   {}", plan::describe_document_peek(&p)),
        Ok(None) => println!("#   documents packing: (no peek: the model's config is not at hand)"),
        Err(e) => println!("#   documents packing: (no peek at the data: {e})"),
    }
}

fn document_peek(cfg: &RunConfig, model: Option<&longctx::hub::ModelConfig>) -> longctx::Result<Option<plan::DocumentPeek>> {
    use longctx::data::source::SourceSpec;
    use longctx::data::{DataSpec, Loader, Shard};
    let Some(m) = model else { return Ok(None) };
    let s = cfg.stage_settings(0);
    let datasets: Vec<String> =
        if s.mixture { cfg.data.sources.iter().map(|m| m.dataset.clone()).collect() } else { vec![s.dataset.clone()] };
    if datasets.iter().any(|d| matches!(SourceSpec::parse(d), SourceSpec::Hub { .. })) {
        return Err(longctx::Error::Setting("a dry run does not download a hub dataset; the trainer reads it".into()));
    }
    let mut spec = longctx::train::trainer::stage_data_spec(cfg, &m.cfg, &s)?;
    let DataSpec::Files(f) = &mut spec else { return Ok(None) };
    cfg.data.configure(f, &s);
    f.shuffle_buffer = 0;
    f.max_epochs = Some(1);
    let tokenizer = match &m.dir {
        Some(d) if d.join("tokenizer.json").is_file() => Some(longctx::hub::load_tokenizer(d)?),
        _ => None,
    };
    let mut loader = Loader::new(&spec, tokenizer.as_ref(), Shard::SINGLE)?;
    // At most DOC_PEEK_TOKENS tokens (one sample at least), so that long samples stay quick.
    let n = (DOC_PEEK_TOKENS / s.seq_length.max(1)).clamp(1, DOC_PEEK_SAMPLES);
    let mut samples = Vec::with_capacity(n);
    while samples.len() < n {
        match loader.next_sample()? {
            Some(x) => samples.push(x),
            None => break,
        }
    }
    Ok(Some(plan::document_peek(&samples, s.seq_length, loader.pack_stats().long_docs)))
}

#[cfg(test)]
mod tests {
    use super::*;
    use clap::Parser;

    #[derive(Parser)]
    struct Cmd {
        #[command(flatten)]
        a: PlanArgs,
    }

    fn args(v: &[&str]) -> PlanArgs {
        Cmd::try_parse_from(std::iter::once("plan").chain(v.iter().copied())).unwrap().a
    }

    fn planned(a: &PlanArgs, file: Option<RunConfig>) -> Vec<(String, PlanRequest)> {
        let from_file = file.is_some();
        requests(a, &planned_run(a, file.map(|c| (c, Applied::default()))).unwrap(), from_file).unwrap()
    }

    /// Without a config: one rank per GPU, the ring on several, bf16, the planner's defaults.
    #[test]
    fn without_a_config_the_defaults_follow_the_gpus() {
        let reqs = planned(&args(&["--model", "builtin:tiny", "--seq-length", "1K", "--gpus", "4"]), None);
        let [(label, r)] = &reqs[..] else { panic!("{reqs:?}") };
        assert_eq!(label, "");
        assert_eq!((r.seq_len, r.gpus, r.world, r.mode), (1024, 4, 4, ParallelMode::ZigzagRingAttn));
        assert_eq!((r.sp, r.ulysses, r.dtype_bytes, r.batch_size, r.token_chunk), (None, None, 2, 1, 4096));
        let a = args(&["--model", "builtin:tiny"]);
        assert!(planned_run(&a, None).unwrap_err().to_string().contains("--seq-length"));
    }

    /// A config is planned stage by stage; the layout flags override it as for `train`, and
    /// also a stage's own mode and FPDT chunk.
    #[test]
    fn flags_override_the_config_and_its_stages() {
        let mut c = RunConfig::default();
        c.parallel.world_size = 2;
        c.stages[1].parallel_mode = Some(ParallelMode::Fpdt);
        c.stages[1].fpdt_chunk_size = Some(128);
        let reqs = planned(&args(&[]), Some(c.clone()));
        assert_eq!(
            reqs.iter().map(|(l, _)| l.as_str()).collect::<Vec<_>>(),
            ["stage 0 (rope_theta 10000)", "stage 1 (rope_theta 100000)", "stage 2 (rope_theta 100000)"]
        );
        let r = &reqs[1].1;
        assert_eq!((r.mode, r.fpdt_chunk, r.world, r.gpus, r.dtype_bytes, r.batch_size), (ParallelMode::Fpdt, 128, 2, 2, 2, 8));
        let a = args(&["--parallel-mode", "usp", "--fpdt-chunk-size", "64", "--batch-size", "3", "--dtype", "f32", "--gpus", "4"]);
        for (_, r) in planned(&a, Some(c.clone())) {
            assert_eq!((r.mode, r.fpdt_chunk, r.batch_size, r.dtype_bytes, r.gpus), (ParallelMode::Usp, 64, 3, 4, 4));
        }
        let reqs = planned(&args(&["--seq-length", "512K"]), Some(c));
        let [(label, r)] = &reqs[..] else { panic!("{reqs:?}") };
        assert_eq!((label.as_str(), r.seq_len, r.mode), ("", 512 * 1024, ParallelMode::DataParallel));
    }
}
