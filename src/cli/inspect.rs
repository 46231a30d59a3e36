//! `longctx inspect`: a model's architecture, parameter count, dtype, RoPE settings and
//! the memory training it takes (text or JSON).

use super::plan::print_suggestion;
use super::{group, human_bytes, parse_mode, size_arg, tokens_arg};
use anyhow::{anyhow, Context, Result};
use clap::Args;
use longctx::hub::load::StoredWeights;
use longctx::model::LlamaConfig;
use longctx::plan::{self, PlanRequest};
use longctx::train::config::ParallelMode;

#[derive(Args, Debug)]
pub struct InspectArgs {
    /// Model: `builtin:NAME`, a Hugging Face model directory (or its config.json), or a
    /// hub id (config.json is fetched; weights are read only if already cached).
    #[arg(long)]
    pub model: String,
    /// Sequence length of the training memory estimate (e.g. 65536, 64K, 1M)
    /// [default: max_position_embeddings].
    #[arg(long, value_parser = tokens_arg)]
    pub seq_length: Option<usize>,
    /// GPUs of the memory estimate.
    #[arg(long, default_value_t = 1)]
    pub gpus: usize,
    /// Memory of one GPU: bytes or a size such as 141GB, 80GiB; the default is an H200 as its
    /// driver reports it (150.8 GB).
    #[arg(long, default_value = longctx::plan::DEFAULT_GPU_MEMORY_ARG, value_parser = size_arg)]
    pub gpu_memory: u64,
    /// Parallel mode of the estimate [default: data_parallel on 1 GPU, zigzag_ring_attn on more].
    #[arg(long)]
    pub parallel_mode: Option<String>,
    /// Keep the AdamW state (f32 master, m, v) in host memory in the estimate [default: on
    /// the GPU, as `train` and `plan` run it].
    #[arg(long)]
    pub optimizer_on_host: bool,
    /// Print JSON instead of text.
    #[arg(long)]
    pub json: bool,
}

/// What `inspect` found: the config, the weight files (when at hand) and the estimate.
struct Inspection<'a> {
    a: &'a InspectArgs,
    cfg: &'a LlamaConfig,
    stored: Option<StoredWeights>,
    shape: plan::ModelShape,
    mode: ParallelMode,
    seq: usize,
    plan: plan::Plan,
    arch: String,
    rope_scaling: Option<String>,
}

pub fn inspect(a: InspectArgs) -> Result<()> {
    let m = longctx::hub::model_config(&a.model, &longctx::hub::HubOptions::from_env(), true)?
        .ok_or_else(|| anyhow!("model `{}` not found", a.model))?;
    let c = &m.cfg;
    let stored = match &m.dir {
        Some(d) => longctx::hub::load::stored_weights(d).with_context(|| format!("reading the weights in {}", d.display()))?,
        None => None,
    };
    let shape = plan::ModelShape::from_config(c);
    let seq = a.seq_length.unwrap_or(c.max_position_embeddings);
    let mode = match &a.parallel_mode {
        Some(v) => parse_mode(v, "--parallel-mode")?,
        None if a.gpus > 1 => ParallelMode::ZigzagRingAttn,
        None => ParallelMode::DataParallel,
    };
    let mut req = PlanRequest::new(seq, a.gpus, a.gpu_memory, mode);
    req.optimizer_on_host = a.optimizer_on_host; // the GPU by default, as `train` and `plan`
    let p = plan::plan(&shape, &req).context("memory estimate")?;
    let arch = c.architectures.as_ref().map(|v| v.join(",")).unwrap_or_else(|| c.arch.model_type().to_string());
    let rope_scaling = c.rope_scaling.as_ref().map(|r| format!("{} (factor {})", r.type_name(), r.factor()));
    let i = Inspection { a: &a, cfg: c, stored, shape, mode, seq, plan: p, arch, rope_scaling };
    if a.json {
        print_json(&i)
    } else {
        print_text(&i);
        Ok(())
    }
}

fn print_json(i: &Inspection<'_>) -> Result<()> {
    let c = i.cfg;
    let out = serde_json::json!({
        "model": i.a.model,
        "architecture": i.arch,
        "model_type": c.arch.model_type(),
        "parameters": i.stored.as_ref().map_or(i.shape.params, |w| w.parameters),
        "parameters_from_config": i.shape.params,
        "stored": i.stored,
        "torch_dtype": c.torch_dtype,
        "rope_theta": c.rope_theta,
        "rope_scaling": i.rope_scaling,
        "max_position_embeddings": c.max_position_embeddings,
        "vocab_size": c.vocab_size,
        "hidden_size": c.hidden_size,
        "intermediate_size": c.intermediate_size,
        "num_hidden_layers": c.num_hidden_layers,
        "num_attention_heads": c.num_attention_heads,
        "num_key_value_heads": c.num_key_value_heads,
        "head_dim": c.head_dim,
        "tie_word_embeddings": c.tie_word_embeddings,
        "memory": i.plan,
    });
    println!("{}", serde_json::to_string_pretty(&out)?);
    Ok(())
}

fn print_text(i: &Inspection<'_>) {
    let (c, a) = (i.cfg, i.a);
    println!("model                    {}", a.model);
    println!("architecture             {} (model_type {})", i.arch, c.arch.model_type());
    match &i.stored {
        Some(w) => {
            let dts: Vec<String> = w.dtypes.iter().map(|(k, n)| format!("{k} ({} params)", group(*n))).collect();
            println!(
                "parameters               {} ({} tensors in {} file(s), {} on disk)",
                group(w.parameters),
                w.tensors,
                w.files,
                human_bytes(w.bytes)
            );
            println!("dtype on disk            {}", dts.join(", "));
            if w.parameters != i.shape.params {
                println!("parameters (config)      {} — differs from the weight files", group(i.shape.params));
            }
        }
        None => {
            println!("parameters               {} (from config.json; no weight files at hand)", group(i.shape.params));
            println!("dtype on disk            - (config torch_dtype: {})", c.torch_dtype.as_deref().unwrap_or("unset"));
        }
    }
    println!("rope_theta               {}", c.rope_theta);
    println!("rope_scaling             {}", i.rope_scaling.as_deref().unwrap_or("none"));
    println!("max_position_embeddings  {}", c.max_position_embeddings);
    println!("vocab_size               {}", c.vocab_size);
    println!("layers / hidden / mlp    {} / {} / {}", c.num_hidden_layers, c.hidden_size, c.intermediate_size);
    println!("heads / kv heads / dim   {} / {} / {}", c.num_attention_heads, c.num_key_value_heads, c.head_dim);
    println!("tied embeddings          {}", c.tie_word_embeddings);
    let e = &i.plan.estimate;
    println!(
        "training memory          {} GB per GPU at {} tokens, {} on {} GPU(s) (bf16, {}): {} in {} GB",
        plan::gb(e.device.peak),
        plan::tokens_label(i.seq),
        i.mode,
        a.gpus,
        super::plan::optimizer_place(a.optimizer_on_host),
        if e.fits { "fits" } else { "does not fit" },
        plan::gb(a.gpu_memory)
    );
    print_suggestion(&i.plan);
}
