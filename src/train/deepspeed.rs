//! A DeepSpeed JSON config (the file `accelerate` or `deepspeed.initialize` reads, e.g.
//! EasyContext's `accelerate_configs/zero3_offload.json`) read as is and mapped onto the
//! run config: `--deepspeed FILE`, or the same keys in a `[deepspeed]` table of the TOML.
//!
//! Every key is accounted for, one line each: a key that sets something says what it set;
//! a key accepted without effect here says why (a note); an unknown key, or a choice
//! longctx does not implement, is a warning naming it. `"auto"` keeps longctx's own value
//! (as accelerate fills it from the training arguments). Values of the wrong type, or a
//! choice that cannot run (NVMe offload, an optimizer other than AdamW, bf16 and fp16 at
//! once), are errors naming the key and the fix.
//!
//! What ZeRO means here (`train::units`, `train::zero`, `train::zero3`): `stage` sets
//! `train.zero_stage` (0 replicated optimizer, 1 sharded optimizer state, 2 also the
//! gradients, reduce-scattered layer by layer, 3 also the 16-bit weights, all-gathered
//! layer by layer); `offload_optimizer.device = "cpu"` moves the optimizer state and its
//! update to the host (`train.optimizer_on_host`), `offload_param.device = "cpu"` this
//! rank's slice of the weights (`train.offload_params`).

use crate::train::config::RunConfig;
use crate::train::optim::Schedule;
use crate::{Error, Result};
use serde_json::Value;
use std::path::Path;

/// How a key was taken.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Level {
    /// It set a longctx setting.
    Set,
    /// Accepted, no effect here (the line says why).
    Note,
    /// Unknown, or a choice longctx does not implement (the line says what happens).
    Warning,
}

/// One line of the report.
#[derive(Clone, Debug)]
pub struct Line {
    pub level: Level,
    /// The key path, e.g. `zero_optimization.offload_optimizer.device`.
    pub key: String,
    pub text: String,
}

impl std::fmt::Display for Line {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let tag = match self.level {
            Level::Set => "deepspeed",
            Level::Note => "deepspeed note",
            Level::Warning => "deepspeed warning",
        };
        write!(f, "{tag}: `{}`: {}", self.key, self.text)
    }
}

/// Take the DeepSpeed settings of a run: `file` (`--deepspeed`) when given, else the
/// config's own `[deepspeed]` table (read from `toml_src`), applied to `cfg` and removed
/// from it (the resolved settings are what a checkpoint records).
pub fn resolve(cfg: &mut RunConfig, file: Option<&Path>, toml_src: &Path) -> Result<Vec<Line>> {
    let table = cfg.deepspeed.take();
    let (ds, src) = match file {
        Some(f) => (read(f)?, f),
        None => match table {
            Some(t) => (t, toml_src),
            None => return Ok(Vec::new()),
        },
    };
    apply(&ds, src, cfg)
}

/// Read a DeepSpeed JSON file.
pub fn read(path: &Path) -> Result<Value> {
    let text = std::fs::read_to_string(path).map_err(|e| Error::io(path, e))?;
    let v: Value = serde_json::from_str(&text)
        .map_err(|e| Error::config(path, "", format!("not valid JSON ({e}); a DeepSpeed config is one JSON object")))?;
    if !v.is_object() {
        return Err(Error::config(path, "", "a DeepSpeed config is one JSON object ({\"zero_optimization\": {...}, ...})"));
    }
    Ok(v)
}

/// Keys accepted without effect, and why.
fn no_effect(key: &str) -> Option<&'static str> {
    Some(match key {
        "steps_per_print" => "progress is printed every step and logged to metrics.jsonl",
        "wall_clock_breakdown" => "use `train.profile = true` for a per-phase step profile",
        "zero_allow_untested_optimizer" | "zero_force_ds_cpu_optimizer" => "the optimizer is longctx's own AdamW",
        "prescale_gradients" | "gradient_predivide_factor" => "gradients are summed in f32 and divided once by the global token count",
        "communication_data_type" | "seq_parallel_communication_data_type" => {
            "gradients are reduced in f32; attention traffic is in the model dtype"
        }
        "tensorboard" | "wandb" | "csv_monitor" | "comet" => "metrics go to metrics.jsonl and TensorBoard files (`train.tensorboard`)",
        "flops_profiler" | "comms_logger" | "dump_state" | "memory_breakdown" => "use `train.profile` and `longctx plan`",
        "activation_checkpointing" => "every layer is recomputed in the backward (only its input is kept)",
        "checkpoint" | "load_universal_checkpoint" => "checkpoints are longctx's own (resumable on any world size)",
        "data_types" => "gradient accumulation is always in f32",
        "overlap_comm" => "gradients are reduced layer by layer as the backward reaches them (stage >= 2), or in one collective after it",
        "contiguous_gradients" => "gradients always live in one contiguous f32 buffer",
        "reduce_bucket_size" | "allgather_bucket_size" | "sub_group_size" => {
            "the buckets are the model's units: one decoder layer, the embedding, the head"
        }
        "reduce_scatter" | "allgather_partitions" => "always on (reduce-scatter of gradients, all-gather of weights)",
        "round_robin_gradients" | "elastic_checkpoint" | "ignore_unused_parameters" | "load_from_fp32_weights" => {
            "no counterpart in longctx's ZeRO"
        }
        "stage3_prefetch_bucket_size"
        | "stage3_param_persistence_threshold"
        | "stage3_max_live_parameters"
        | "stage3_max_reuse_distance"
        | "stage3_gather_16bit_weights_on_model_save"
        | "stage3_gather_fp16_weights_on_model_save"
        | "zero_hpz_partition_size"
        | "zero_quantized_weights"
        | "zero_quantized_gradients"
        | "mics_shard_size" => {
            "stage 3 gathers one decoder layer at a time, a layer ahead; checkpoints and exports always hold the full 16-bit weights"
        }
        "pin_memory" => {
            "host copies always use page-locked memory: offloaded activations and the offloaded weight slice are pinned, the host \
             optimizer's gradients arrive through pinned buffers (its own state is not pinned)"
        }
        "buffer_count" | "fast_init" | "ratio" | "pipeline_read" | "pipeline_write" | "max_in_cpu" | "nvme_path" => {
            "no counterpart in longctx's host offload"
        }
        _ => return None,
    })
}

struct Report<'a> {
    src: &'a Path,
    lines: Vec<Line>,
}

impl Report<'_> {
    fn push(&mut self, level: Level, key: &str, text: impl Into<String>) {
        self.lines.push(Line { level, key: key.to_string(), text: text.into() });
    }

    /// A key that sets nothing: a note saying why it has no effect here, or a warning
    /// when longctx does not know it. `name` is the key's last part, `key` its path.
    fn no_effect(&mut self, key: &str, name: &str, unknown: &str) {
        match no_effect(name) {
            Some(why) => self.push(Level::Note, key, format!("no effect here: {why}")),
            None => self.push(Level::Warning, key, unknown.to_string()),
        }
    }

    fn err(&self, key: &str, msg: impl Into<String>) -> Error {
        Error::config(self.src, key, msg.into())
    }

    /// `Some(x)` for a number, `None` for "auto"; an error otherwise.
    fn num(&self, key: &str, v: &Value) -> Result<Option<f64>> {
        match v {
            Value::Number(n) => n.as_f64().map(Some).ok_or_else(|| self.err(key, "expected a number")),
            Value::String(s) if s == "auto" => Ok(None),
            other => Err(self.err(key, format!("expected a number or \"auto\", got {other}"))),
        }
    }

    fn count(&self, key: &str, v: &Value) -> Result<Option<u64>> {
        match self.num(key, v)? {
            None => Ok(None),
            Some(x) if x >= 0.0 && x.fract() == 0.0 && x <= u32::MAX as f64 => Ok(Some(x as u64)),
            Some(x) => Err(self.err(key, format!("expected a whole number, got {x}"))),
        }
    }

    /// `Some(b)` for a bool, `None` for "auto".
    fn flag(&self, key: &str, v: &Value) -> Result<Option<bool>> {
        match v {
            Value::Bool(b) => Ok(Some(*b)),
            Value::String(s) if s == "auto" => Ok(None),
            other => Err(self.err(key, format!("expected true, false or \"auto\", got {other}"))),
        }
    }

    fn object<'v>(&self, key: &str, v: &'v Value) -> Result<&'v serde_json::Map<String, Value>> {
        v.as_object().ok_or_else(|| self.err(key, format!("expected an object {{...}}, got {v}")))
    }
}

/// Apply the DeepSpeed config `ds` (read from `src`) to `cfg`; the lines say what each
/// key did. Flags given on the command line are applied after this (they win).
pub fn apply(ds: &Value, src: &Path, cfg: &mut RunConfig) -> Result<Vec<Line>> {
    let mut r = Report { src, lines: Vec::new() };
    let top = ds
        .as_object()
        .ok_or_else(|| r.err("", format!("a DeepSpeed config is one JSON object ({{\"zero_optimization\": {{...}}, ...}}), got {ds}")))?;
    let mut dtype_set: Option<&str> = None;
    for (key, v) in top {
        match key.as_str() {
            "bf16" | "fp16" => {
                let enabled = match v.get("enabled") {
                    Some(e) => r.flag(&format!("{key}.enabled"), e)?,
                    None => Some(true),
                };
                for k in r.object(key, v)?.keys().filter(|k| *k != "enabled") {
                    r.push(Level::Note, &format!("{key}.{k}"), "loss scaling is not used (f32 master weights, f32 gradient sums)");
                }
                let want = if key == "bf16" { "bf16" } else { "f16" };
                match enabled {
                    Some(true) => {
                        if let Some(other) = dtype_set {
                            return Err(r.err(key, format!("both `{other}` and `{want}` are enabled; enable one")));
                        }
                        dtype_set = Some(want);
                        cfg.model.dtype = want.into();
                        r.push(Level::Set, &format!("{key}.enabled"), format!("model.dtype = \"{want}\""));
                    }
                    Some(false) => r.push(Level::Note, &format!("{key}.enabled"), "false: nothing to set"),
                    None => r.push(Level::Note, &format!("{key}.enabled"), format!("\"auto\": model.dtype stays \"{}\"", cfg.model.dtype)),
                }
            }
            "optimizer" => optimizer(&mut r, v, cfg)?,
            "scheduler" => scheduler(&mut r, v, cfg)?,
            "zero_optimization" => zero(&mut r, v, cfg)?,
            "gradient_accumulation_steps" => match r.count(key, v)? {
                Some(0) => return Err(r.err(key, "must be at least 1")),
                Some(n) => {
                    cfg.train.gradient_accumulate_every = n as usize;
                    r.push(Level::Set, key, format!("train.gradient_accumulate_every = {n}"));
                }
                None => r.push(Level::Note, key, format!("\"auto\": stays {}", cfg.train.gradient_accumulate_every)),
            },
            "train_micro_batch_size_per_gpu" => match r.count(key, v)? {
                Some(0) => return Err(r.err(key, "must be at least 1")),
                Some(n) => {
                    cfg.train.batch_size = n as usize;
                    r.push(Level::Set, key, format!("train.batch_size = {n}"));
                }
                None => r.push(Level::Note, key, format!("\"auto\": stays {}", cfg.train.batch_size)),
            },
            "train_batch_size" => match r.count(key, v)? {
                Some(n) => r.push(
                    Level::Note,
                    key,
                    format!("{n}: longctx derives it (batch_size × gradient_accumulate_every × data-parallel ranks); `train --dry-run` prints it"),
                ),
                None => r.push(Level::Note, key, "\"auto\": derived from the batch, accumulation and data-parallel ranks"),
            },
            "gradient_clipping" => match r.num(key, v)? {
                Some(x) if x >= 0.0 && x.is_finite() => {
                    cfg.train.clip_grad = x;
                    r.push(Level::Set, key, format!("train.clip_grad = {x}"));
                }
                Some(x) => return Err(r.err(key, format!("must be ≥ 0 (0 = off), got {x}"))),
                None => r.push(Level::Note, key, format!("\"auto\": stays {}", cfg.train.clip_grad)),
            },
            k => r.no_effect(k, k, "unknown DeepSpeed key, ignored (check its spelling)"),
        }
    }
    Ok(r.lines)
}

fn optimizer(r: &mut Report, v: &Value, cfg: &mut RunConfig) -> Result<()> {
    let o = r.object("optimizer", v)?;
    for (k, x) in o {
        match k.as_str() {
            "type" => {
                let t = x.as_str().unwrap_or_default();
                if !matches!(t.to_ascii_lowercase().as_str(), "adamw" | "adam") {
                    return Err(r.err("optimizer.type", format!("`{x}`: longctx trains with AdamW only; use \"AdamW\"")));
                }
                r.push(Level::Set, "optimizer.type", "AdamW (decoupled weight decay)");
            }
            "params" => {
                for (pk, pv) in r.object("optimizer.params", x)? {
                    let key = format!("optimizer.params.{pk}");
                    let a = &mut cfg.train.adamw;
                    match pk.as_str() {
                        "lr" => match r.num(&key, pv)? {
                            Some(lr) => {
                                cfg.train.learning_rate = lr;
                                r.push(Level::Set, &key, format!("train.learning_rate = {lr:e}"));
                            }
                            None => r.push(Level::Note, &key, format!("\"auto\": stays {:e}", cfg.train.learning_rate)),
                        },
                        "betas" => {
                            let b: Option<Vec<f64>> = pv.as_array().and_then(|a| a.iter().map(Value::as_f64).collect());
                            match b.as_deref() {
                                Some([b1, b2]) => {
                                    (a.beta1, a.beta2) = (*b1, *b2);
                                    r.push(Level::Set, &key, format!("train.adamw.beta1 = {b1}, beta2 = {b2}"));
                                }
                                // Hugging Face's ZeRO-3 JSONs say "auto" here as for lr and eps.
                                _ if pv.as_str() == Some("auto") => {
                                    r.push(Level::Note, &key, format!("\"auto\": stays beta1 = {}, beta2 = {}", a.beta1, a.beta2))
                                }
                                _ => return Err(r.err(&key, format!("expected [beta1, beta2] or \"auto\", got {pv}"))),
                            }
                        }
                        "eps" | "weight_decay" => match r.num(&key, pv)? {
                            Some(x) => {
                                if pk == "eps" {
                                    a.eps = x;
                                } else {
                                    a.weight_decay = x;
                                }
                                r.push(Level::Set, &key, format!("train.adamw.{pk} = {x:e}"));
                            }
                            None => r.push(Level::Note, &key, "\"auto\": longctx's default stays"),
                        },
                        "adam_w_mode" => match pv.as_bool() {
                            Some(true) | None => r.push(Level::Note, &key, "AdamW (decoupled weight decay) is what runs"),
                            Some(false) => {
                                r.push(Level::Warning, &key, "false (L2-regularised Adam) is not implemented; AdamW runs instead")
                            }
                        },
                        "torch_adam" | "fused" | "bias_correction" | "amsgrad" => {
                            r.push(Level::Note, &key, "no effect here: longctx's AdamW (bias-corrected, fused on the GPU)")
                        }
                        _ => r.push(Level::Warning, &key, "unknown optimizer parameter, ignored"),
                    }
                }
            }
            _ => r.push(Level::Warning, &format!("optimizer.{k}"), "unknown key, ignored"),
        }
    }
    Ok(())
}

fn scheduler(r: &mut Report, v: &Value, cfg: &mut RunConfig) -> Result<()> {
    let o = r.object("scheduler", v)?;
    let kind = o.get("type").and_then(Value::as_str).unwrap_or("");
    let params = match o.get("params") {
        Some(p) => r.object("scheduler.params", p)?.clone(),
        None => Default::default(),
    };
    for k in o.keys().filter(|k| !matches!(k.as_str(), "type" | "params")) {
        r.push(Level::Warning, &format!("scheduler.{k}"), "unknown key, ignored");
    }
    match kind {
        "WarmupLR" | "WarmupDecayLR" | "WarmupCosineLR" => {}
        other => {
            r.push(
                Level::Warning,
                "scheduler.type",
                format!(
                    "`{other}` has no counterpart; train.lr_schedule stays `{:?}` (constant, linear warmup, or cosine)",
                    cfg.train.lr_schedule
                ),
            );
            return Ok(());
        }
    }
    let mut warm = None;
    for (k, x) in &params {
        let key = format!("scheduler.params.{k}");
        match k.as_str() {
            "warmup_num_steps" => {
                warm = r.count(&key, x)?;
                if let Some(n) = warm {
                    cfg.train.warmup_steps = n;
                    r.push(Level::Set, &key, format!("train.warmup_steps = {n}"));
                }
            }
            // After warm-up DeepSpeed runs at warmup_max_lr (it replaces the optimizer's lr).
            "warmup_max_lr" | "cos_max_lr" => {
                if let Some(lr) = r.num(&key, x)? {
                    cfg.train.learning_rate = lr;
                    r.push(Level::Set, &key, format!("train.learning_rate = {lr:e} (the rate after warm-up)"));
                }
            }
            "warmup_min_lr" => {
                if r.num(&key, x)?.is_some_and(|v| v != 0.0) && warm.unwrap_or(0) > 0 {
                    r.push(Level::Note, &key, "longctx's warm-up starts from 0");
                } else {
                    r.push(Level::Note, &key, "no effect (no warm-up, or it starts from 0 as here)");
                }
            }
            "warmup_type" => {
                if x.as_str() != Some("linear") {
                    r.push(Level::Warning, &key, format!("{x}: longctx's warm-up is linear"));
                } else {
                    r.push(Level::Note, &key, "linear, as here");
                }
            }
            "total_num_steps" => r.push(Level::Note, &key, "the decay spans each stage's `steps`"),
            "cos_min_ratio" | "warmup_min_ratio" => {
                if let Some(x) = r.num(&key, x)? {
                    cfg.train.min_lr_ratio = x;
                    r.push(Level::Set, &key, format!("train.min_lr_ratio = {x}"));
                }
            }
            _ => r.push(Level::Warning, &key, "unknown scheduler parameter, ignored"),
        }
    }
    let schedule = match kind {
        "WarmupLR" if cfg.train.warmup_steps > 0 => Schedule::Linear,
        "WarmupLR" => Schedule::Constant,
        _ => {
            r.push(Level::Note, "scheduler.type", format!("`{kind}` runs as warm-up then cosine decay to min_lr_ratio · lr"));
            Schedule::Cosine
        }
    };
    cfg.train.lr_schedule = schedule;
    r.push(Level::Set, "scheduler.type", format!("train.lr_schedule = {schedule:?}"));
    Ok(())
}

/// An `offload_*` section: `Some(true)` for `device = "cpu"`, `Some(false)` for "none",
/// `None` without a device; reports the setting `field` (or that `stays` where the
/// config puts it) and every other key of the section.
fn offload(r: &mut Report, key: &str, v: &Value, field: &str, stays: &str) -> Result<Option<bool>> {
    let o = r.object(key, v)?;
    let on = match o.get("device") {
        None => None,
        Some(Value::String(d)) => match d.as_str() {
            "cpu" | "none" => Some(d == "cpu"),
            "nvme" => return Err(r.err(&format!("{key}.device"), "\"nvme\" offload is not supported; use \"cpu\" or \"none\"")),
            other => return Err(r.err(&format!("{key}.device"), format!("`{other}`: expected \"cpu\" or \"none\""))),
        },
        Some(other) => return Err(r.err(&format!("{key}.device"), format!("expected \"cpu\" or \"none\", got {other}"))),
    };
    match on {
        Some(on) => r.push(Level::Set, &format!("{key}.device"), format!("{field} = {on}")),
        None => r.push(Level::Note, key, format!("no `device`: {stays} where the config puts it")),
    }
    for sub in r.object(key, v)?.keys().filter(|s| *s != "device") {
        r.no_effect(&format!("{key}.{sub}"), sub, "unknown key, ignored");
    }
    Ok(on)
}

fn zero(r: &mut Report, v: &Value, cfg: &mut RunConfig) -> Result<()> {
    for (k, x) in r.object("zero_optimization", v)? {
        let key = format!("zero_optimization.{k}");
        match k.as_str() {
            "stage" => match r.count(&key, x)? {
                Some(s @ 0..=3) => {
                    cfg.train.zero_stage = s as u8;
                    r.push(Level::Set, &key, format!("train.zero_stage = {s}"));
                }
                Some(s) => return Err(r.err(&key, format!("{s}: DeepSpeed stages are 0 to 3"))),
                None => r.push(Level::Note, &key, "\"auto\": the config's `train.zero_stage` (default 1)"),
            },
            "offload_optimizer" => {
                if let Some(on) = offload(r, &key, x, "train.optimizer_on_host", "the optimizer stays")? {
                    cfg.train.optimizer_on_host = on;
                }
            }
            "offload_param" => {
                if let Some(on) = offload(r, &key, x, "train.offload_params", "the weights stay")? {
                    cfg.train.offload_params = on;
                }
            }
            other => r.no_effect(&key, other, "unknown ZeRO key, ignored (check its spelling)"),
        }
    }
    Ok(())
}
