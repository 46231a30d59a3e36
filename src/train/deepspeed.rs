//! A DeepSpeed JSON config (the file `accelerate` or `deepspeed.initialize` reads, e.g.
//! EasyContext's `accelerate_configs/zero3_offload.json`) read as is and mapped onto the
//! run config: `--deepspeed FILE`, or the same keys in a `[deepspeed]` table of the TOML.
//!
//! Every key is accounted for, one line each: a key that sets something says what it set;
//! a key accepted without effect here says why (a note); an unknown key, or a choice
//! longctx does not implement, is a warning naming it. `"auto"` keeps longctx's own value
//! (as accelerate fills it from the training arguments). Values of the wrong type or out
//! of range, or a choice that cannot run (NVMe offload, an optimizer other than AdamW,
//! bf16 and fp16 at once, a parameter DeepSpeed's scheduler does not take), are errors
//! naming the file, the key and the fix.
//!
//! Each key means what it means to DeepSpeed, whatever the order of the keys:
//! - `scheduler`: `WarmupLR`, `WarmupDecayLR` and `WarmupCosineLR` select longctx's
//!   schedules of the same names ([`Schedule::WarmupLr`], ...), which follow DeepSpeed's
//!   formulas step for step; their parameters take DeepSpeed's defaults when absent
//!   (`warmup_num_steps` 1000, `warmup_type` "log", `cos_min_ratio` 0.0001, ...).
//! - `train_batch_size`, `train_micro_batch_size_per_gpu`, `gradient_accumulation_steps`:
//!   DeepSpeed's rule, once the flags and the data-parallel degree are known
//!   ([`Applied::finish`]): the one left out is derived from the others (both, from
//!   `train_batch_size` alone: accumulation 1), and three that disagree are refused.
//! - `zero_optimization.offload_param` has no effect below stage 3, as in DeepSpeed.
//!
//! Keys the config leaves out keep longctx's values, except what `train_batch_size`
//! derives. A value from the config that fails the run config's checks is blamed on its
//! key ([`Applied::validate`]).
//!
//! What ZeRO means here (`train::zero`: `units`, `stage12`, `stage3`): `stage` sets
//! `train.zero_stage` (0 replicated optimizer, 1 sharded optimizer state, 2 also the
//! gradients, reduce-scattered layer by layer, 3 also the 16-bit weights, all-gathered
//! layer by layer); `offload_optimizer.device = "cpu"` moves the optimizer state and its
//! update to the host (`train.optimizer_on_host`), `offload_param.device = "cpu"` this
//! rank's slice of the weights (`train.offload_params`).

use crate::limits::{MAX_BATCH, MAX_STEPS};
use crate::train::config::{RunConfig, MAX_LEARNING_RATE};
use crate::train::optim::{Schedule, WarmupType};
use crate::{Error, Result};
use serde_json::Value;
use std::path::{Path, PathBuf};

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

/// A batch key as the config gives it.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
enum Given {
    #[default]
    Absent,
    Auto,
    Num(u64),
}

/// Which batch settings the command line gave (they win over the config's, and count as
/// given in DeepSpeed's batch rule).
#[derive(Clone, Copy, Debug, Default)]
pub struct BatchFlags {
    /// `--batch-size`.
    pub batch_size: bool,
    /// `--gradient-accumulate-every`.
    pub gradient_accumulate_every: bool,
}

/// A DeepSpeed config applied to a run config: the report, and what is settled only once
/// the flags and the parallel layout are known ([`Applied::finish`]).
#[derive(Clone, Debug, Default)]
pub struct Applied {
    /// One line per key.
    pub lines: Vec<Line>,
    /// False when the run has no DeepSpeed config (then `finish` and `validate` add nothing).
    present: bool,
    /// The file the keys came from, and their prefix there (`deepspeed.` in a TOML).
    src: PathBuf,
    prefix: &'static str,
    total: Given,
    micro: Given,
    accum: Given,
    /// `warmup_min_lr`, kept as a rate: the ratio to the learning rate is taken again
    /// once a `--learning-rate` flag may have changed it.
    warmup_min_lr: Option<f64>,
    /// The longctx fields its keys set: field, key, and the value set (to blame a failed
    /// check on the key while no flag has replaced the value).
    set: Vec<(String, String, Option<Value>)>,
}

/// Take the DeepSpeed settings of a run: `file` (`--deepspeed`) when given, else the
/// config's own `[deepspeed]` table (read from `toml_src`), applied to `cfg` and removed
/// from it (the resolved settings are what a checkpoint records). Call
/// [`Applied::finish`] once the flags are applied, then [`Applied::validate`].
pub fn resolve(cfg: &mut RunConfig, file: Option<&Path>, toml_src: &Path) -> Result<Applied> {
    let table = cfg.deepspeed.take();
    match (file, table) {
        (Some(f), _) => apply_keys(&read(f)?, f, "", cfg),
        (None, Some(t)) => apply_keys(&t, toml_src, "deepspeed.", cfg),
        (None, None) => Ok(Applied::default()),
    }
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
        "ratio" => {
            "longctx splits the optimizer state by units, not by a fraction: `train.optimizer_device_units = N` \
             (--optimizer-device-units N) keeps the first N units' (the embedding, then one decoder layer each) on the GPU"
        }
        "buffer_count" | "fast_init" | "pipeline_read" | "pipeline_write" | "max_in_cpu" | "nvme_path" => {
            "no counterpart in longctx's host offload"
        }
        _ => return None,
    })
}

struct Report<'a> {
    src: &'a Path,
    prefix: &'static str,
    lines: Vec<Line>,
    /// Fields set, with the key that set them.
    set: Vec<(String, String)>,
}

impl<'a> Report<'a> {
    fn new(src: &'a Path, prefix: &'static str) -> Self {
        Report { src, prefix, lines: Vec::new(), set: Vec::new() }
    }

    fn push(&mut self, level: Level, key: &str, text: impl Into<String>) {
        self.lines.push(Line { level, key: key.to_string(), text: text.into() });
    }

    /// A line for `key` that set the longctx `fields`.
    fn set(&mut self, key: &str, fields: &[&str], text: impl Into<String>) {
        self.push(Level::Set, key, text);
        self.set.extend(fields.iter().map(|f| (f.to_string(), key.to_string())));
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
        Error::config(self.src, format!("{}{key}", self.prefix), msg.into())
    }

    /// `Some(x)` for a number, `None` for "auto"; an error otherwise.
    fn num(&self, key: &str, v: &Value) -> Result<Option<f64>> {
        match v {
            Value::Number(n) => n.as_f64().map(Some).ok_or_else(|| self.err(key, "expected a number")),
            Value::String(s) if s == "auto" => Ok(None),
            other => Err(self.err(key, format!("expected a number or \"auto\", got {other}"))),
        }
    }

    /// A number within `lo..hi` (each end open or closed), or `None` for "auto".
    fn real(&self, key: &str, v: &Value, (lo, lo_open): (f64, bool), (hi, hi_open): (f64, bool)) -> Result<Option<f64>> {
        let Some(x) = self.num(key, v)? else { return Ok(None) };
        let below = if lo_open { x <= lo } else { x < lo };
        let above = if hi_open { x >= hi } else { x > hi };
        if x.is_finite() && !below && !above {
            return Ok(Some(x));
        }
        let (l, h) = (if lo_open { "(" } else { "[" }, if hi_open || hi == f64::MAX { ")" } else { "]" });
        let hi = if hi == f64::MAX { "∞".to_string() } else { hi.to_string() };
        Err(self.err(key, format!("got {x}, expected a number in {l}{lo}, {hi}{h}")))
    }

    /// A whole number in `lo..=hi`, or `None` for "auto".
    fn count(&self, key: &str, v: &Value, lo: u64, hi: u64) -> Result<Option<u64>> {
        match self.num(key, v)? {
            None => Ok(None),
            Some(x) if x >= lo as f64 && x.fract() == 0.0 && x <= hi as f64 => Ok(Some(x as u64)),
            Some(x) => Err(self.err(key, format!("got {x}, expected a whole number from {lo} to {hi} (or \"auto\")"))),
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

/// The JSON pointer of a dotted run-config field (`train.adamw.beta1` → `/train/adamw/beta1`).
fn pointer(field: &str) -> String {
    field.split('.').map(|p| format!("/{p}")).collect()
}

/// Apply the DeepSpeed config `ds` (read from `src`) to `cfg`; the lines say what each
/// key did. Flags given on the command line are applied after this (they win), then
/// [`Applied::finish`].
pub fn apply(ds: &Value, src: &Path, cfg: &mut RunConfig) -> Result<Applied> {
    apply_keys(ds, src, "", cfg)
}

fn apply_keys(ds: &Value, src: &Path, prefix: &'static str, cfg: &mut RunConfig) -> Result<Applied> {
    let mut r = Report::new(src, prefix);
    let top = ds
        .as_object()
        .ok_or_else(|| r.err("", format!("a DeepSpeed config is one JSON object ({{\"zero_optimization\": {{...}}, ...}}), got {ds}")))?;
    let (mut total, mut micro, mut accum) = (Given::Absent, Given::Absent, Given::Absent);
    for (key, v) in top {
        match key.as_str() {
            // Taken below, after the keys they depend on, whatever their order.
            "bf16" | "bfloat16" | "fp16" | "scheduler" => {}
            "optimizer" => optimizer(&mut r, v, cfg)?,
            "zero_optimization" => zero(&mut r, v, cfg)?,
            "gradient_accumulation_steps" => accum = batch_key(&mut r, key, v, cfg)?,
            "train_micro_batch_size_per_gpu" => micro = batch_key(&mut r, key, v, cfg)?,
            "train_batch_size" => total = batch_key(&mut r, key, v, cfg)?,
            "gradient_clipping" => match r.real(key, v, (0.0, false), (f64::MAX, false))? {
                Some(x) => {
                    cfg.train.clip_grad = x;
                    r.set(key, &["train.clip_grad"], format!("train.clip_grad = {x}"));
                }
                None => r.push(Level::Note, key, format!("\"auto\": stays {}", cfg.train.clip_grad)),
            },
            k => r.no_effect(k, k, "unknown DeepSpeed key, ignored (check its spelling)"),
        }
    }
    precision(&mut r, top, cfg)?;
    // The scheduler's rates build on the optimizer's lr.
    let warmup_min_lr = match top.get("scheduler") {
        Some(v) => scheduler(&mut r, v, cfg)?,
        None => None,
    };
    let snapshot = serde_json::to_value(&*cfg).ok();
    let set = r.set.into_iter().map(|(f, k)| {
        let v = snapshot.as_ref().and_then(|s| s.pointer(&pointer(&f))).cloned();
        (f, k, v)
    });
    Ok(Applied { lines: r.lines, present: true, src: src.to_path_buf(), prefix, total, micro, accum, warmup_min_lr, set: set.collect() })
}

/// `train_batch_size`, `train_micro_batch_size_per_gpu` or `gradient_accumulation_steps`:
/// the last two set longctx's (every stage's) micro-batch and accumulation now; all three
/// take part in DeepSpeed's batch rule in [`Applied::finish`].
fn batch_key(r: &mut Report, key: &str, v: &Value, cfg: &mut RunConfig) -> Result<Given> {
    let n = r.count(key, v, 1, u64::from(u32::MAX))?;
    let t = &mut cfg.train;
    match (key, n) {
        ("train_batch_size", Some(n)) => r.push(
            Level::Note,
            key,
            format!("{n} sequences per optimizer step: checked against the micro-batch and accumulation, or completing them, once the data-parallel degree is known (a later line)"),
        ),
        ("train_batch_size", None) => r.push(Level::Note, key, "\"auto\": batch_size × gradient_accumulate_every × data-parallel ranks"),
        (_, Some(n)) if n > MAX_BATCH as u64 => return Err(r.err(key, format!("got {n}, expected at most {MAX_BATCH}"))),
        ("train_micro_batch_size_per_gpu", Some(n)) => {
            t.batch_size = n as usize;
            cfg.stages.iter_mut().for_each(|s| s.batch_size = None);
            r.set(key, &["train.batch_size"], format!("train.batch_size = {n} (every stage)"));
        }
        (_, Some(n)) => {
            t.gradient_accumulate_every = n as usize;
            cfg.stages.iter_mut().for_each(|s| s.gradient_accumulate_every = None);
            r.set(key, &["train.gradient_accumulate_every"], format!("train.gradient_accumulate_every = {n} (every stage)"));
        }
        ("train_micro_batch_size_per_gpu", None) => r.push(Level::Note, key, format!("\"auto\": train.batch_size stays {}", t.batch_size)),
        (_, None) => r.push(Level::Note, key, format!("\"auto\": train.gradient_accumulate_every stays {}", t.gradient_accumulate_every)),
    }
    Ok(match n {
        Some(n) => Given::Num(n),
        None => Given::Auto,
    })
}

/// `bf16` (or its old name `bfloat16`) and `fp16`: the one enabled sets `model.dtype`;
/// `enabled` is false when absent (DeepSpeed's default); a section present with neither
/// enabled (and none "auto") trains in f32, as DeepSpeed does.
fn precision(r: &mut Report, top: &serde_json::Map<String, Value>, cfg: &mut RunConfig) -> Result<()> {
    let (mut on, mut auto, mut present) = (Vec::new(), false, Vec::new());
    for key in ["bf16", "bfloat16", "fp16"] {
        let Some(v) = top.get(key) else { continue };
        let o = r.object(key, v)?;
        for k in o.keys().filter(|k| *k != "enabled") {
            r.push(Level::Note, &format!("{key}.{k}"), "loss scaling is not used (f32 master weights, f32 gradient sums)");
        }
        let ek = format!("{key}.enabled");
        if key == "bfloat16" && top.contains_key("bf16") {
            r.push(Level::Note, &ek, "ignored: DeepSpeed reads `bf16` when both `bf16` and `bfloat16` are given");
            continue;
        }
        let enabled = match o.get("enabled") {
            Some(e) => r.flag(&ek, e)?,
            None => Some(false),
        };
        match enabled {
            Some(true) => on.push((key, if key == "fp16" { "f16" } else { "bf16" })),
            Some(false) => present.push((ek, o.contains_key("enabled"))),
            None => {
                auto = true;
                r.push(Level::Note, &ek, format!("\"auto\": model.dtype stays \"{}\"", cfg.model.dtype));
            }
        }
    }
    if let [(a, _), (b, _)] = on.as_slice() {
        return Err(r.err(b, format!("both `{a}` and `{b}` are enabled; enable one")));
    }
    let dtype = match on.first() {
        Some((key, want)) => {
            cfg.model.dtype = want.to_string();
            r.set(&format!("{key}.enabled"), &["model.dtype"], format!("model.dtype = \"{want}\""));
            None
        }
        None if !auto && !present.is_empty() => Some("f32"),
        None => None,
    };
    for (ek, given) in present {
        let why = if given { "false" } else { "absent: false (DeepSpeed's default)" };
        match dtype {
            Some(d) => {
                cfg.model.dtype = d.into();
                r.set(
                    &ek,
                    &["model.dtype"],
                    format!("{why}, and no other precision enabled: DeepSpeed trains in fp32: model.dtype = \"{d}\""),
                );
            }
            None => r.push(Level::Note, &ek, format!("{why}: nothing to set")),
        }
    }
    Ok(())
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
                    optimizer_param(r, pk, pv, cfg)?;
                }
            }
            _ => r.push(Level::Warning, &format!("optimizer.{k}"), "unknown key, ignored"),
        }
    }
    Ok(())
}

/// One of `optimizer.params`, each checked against the range the run config allows.
fn optimizer_param(r: &mut Report, pk: &str, pv: &Value, cfg: &mut RunConfig) -> Result<()> {
    let key = format!("optimizer.params.{pk}");
    let a = &mut cfg.train.adamw;
    let unit = |open_hi: bool| ((0.0, false), (1.0, open_hi));
    match pk {
        "lr" => match r.real(&key, pv, (0.0, true), (MAX_LEARNING_RATE, false))? {
            Some(lr) => {
                cfg.train.learning_rate = lr;
                cfg.stages.iter_mut().for_each(|s| s.learning_rate = None);
                r.set(&key, &["train.learning_rate"], format!("train.learning_rate = {lr:e} (every stage)"));
            }
            None => r.push(Level::Note, &key, format!("\"auto\": stays {:e}", cfg.train.learning_rate)),
        },
        "betas" => {
            let b: Option<Vec<f64>> = pv.as_array().and_then(|a| a.iter().map(Value::as_f64).collect());
            match b.as_deref() {
                Some([b1, b2]) => {
                    let (lo, hi) = unit(true);
                    let (b1, b2) = (r.real(&key, &Value::from(*b1), lo, hi)?, r.real(&key, &Value::from(*b2), lo, hi)?);
                    (a.beta1, a.beta2) = (b1.unwrap_or(a.beta1), b2.unwrap_or(a.beta2));
                    r.set(
                        &key,
                        &["train.adamw.beta1", "train.adamw.beta2"],
                        format!("train.adamw.beta1 = {}, beta2 = {}", a.beta1, a.beta2),
                    );
                }
                // Hugging Face's ZeRO-3 JSONs say "auto" here as for lr and eps.
                _ if pv.as_str() == Some("auto") => {
                    r.push(Level::Note, &key, format!("\"auto\": stays beta1 = {}, beta2 = {}", a.beta1, a.beta2))
                }
                _ => return Err(r.err(&key, format!("expected [beta1, beta2] or \"auto\", got {pv}"))),
            }
        }
        "eps" | "weight_decay" => {
            let range = if pk == "eps" { ((0.0, true), (1.0, false)) } else { unit(false) };
            match r.real(&key, pv, range.0, range.1)? {
                Some(x) => {
                    *(if pk == "eps" { &mut a.eps } else { &mut a.weight_decay }) = x;
                    r.set(&key, &[&format!("train.adamw.{pk}")], format!("train.adamw.{pk} = {x:e}"));
                }
                None => r.push(Level::Note, &key, "\"auto\": longctx's default stays"),
            }
        }
        "adam_w_mode" => match pv.as_bool() {
            Some(true) | None => r.push(Level::Note, &key, "AdamW (decoupled weight decay) is what runs"),
            Some(false) => r.push(Level::Warning, &key, "false (L2-regularised Adam) is not implemented; AdamW runs instead"),
        },
        "torch_adam" | "fused" | "bias_correction" | "amsgrad" => {
            r.push(Level::Note, &key, "no effect here: longctx's AdamW (bias-corrected, fused on the GPU)")
        }
        _ => r.push(Level::Warning, &key, "unknown optimizer parameter, ignored"),
    }
    Ok(())
}

/// DeepSpeed's schedulers that longctx runs: the schedule, and the parameters each takes
/// (DeepSpeed passes `params` as keyword arguments: any other is refused there).
fn scheduler_kind(kind: &str) -> Option<(Schedule, &'static [&'static str])> {
    Some(match kind {
        "WarmupLR" => (Schedule::WarmupLr, &["warmup_min_lr", "warmup_max_lr", "warmup_num_steps", "warmup_type", "last_batch_iteration"]),
        "WarmupDecayLR" => (
            Schedule::WarmupDecayLr,
            &["total_num_steps", "warmup_min_lr", "warmup_max_lr", "warmup_num_steps", "warmup_type", "last_batch_iteration"],
        ),
        "WarmupCosineLR" => (
            Schedule::WarmupCosineLr,
            &["total_num_steps", "warmup_min_ratio", "warmup_num_steps", "cos_min_ratio", "warmup_type", "last_batch_iteration"],
        ),
        _ => return None,
    })
}

/// `scheduler`: DeepSpeed's WarmupLR, WarmupDecayLR and WarmupCosineLR, each parameter
/// for its own meaning (DeepSpeed's default when absent). Returns `warmup_min_lr` when
/// given as a rate (see [`Applied::finish`]).
fn scheduler(r: &mut Report, v: &Value, cfg: &mut RunConfig) -> Result<Option<f64>> {
    let o = r.object("scheduler", v)?;
    for k in o.keys().filter(|k| !matches!(k.as_str(), "type" | "params")) {
        r.push(Level::Warning, &format!("scheduler.{k}"), "unknown key, ignored");
    }
    let params = match o.get("params") {
        Some(p) => r.object("scheduler.params", p)?.clone(),
        None => Default::default(),
    };
    let stays = format!("train.lr_schedule stays \"{}\"", cfg.train.lr_schedule.name());
    let kind = match o.get("type") {
        Some(Value::String(s)) => s.as_str(),
        None => {
            r.push(Level::Warning, "scheduler", format!("no `type`: DeepSpeed builds no scheduler from it; {stays}"));
            return Ok(None);
        }
        Some(other) => return Err(r.err("scheduler.type", format!("expected a scheduler name such as \"WarmupLR\", got {other}"))),
    };
    let Some((schedule, takes)) = scheduler_kind(kind) else {
        let msg = format!("`{kind}` has no counterpart (WarmupLR, WarmupDecayLR and WarmupCosineLR do); {stays}");
        r.push(Level::Warning, "scheduler.type", msg);
        for k in params.keys() {
            r.push(Level::Warning, &format!("scheduler.params.{k}"), format!("ignored with `{kind}`"));
        }
        return Ok(None);
    };
    if let Some(k) = params.keys().find(|k| !takes.contains(&k.as_str())) {
        return Err(r.err(
            &format!("scheduler.params.{k}"),
            format!(
                "not a parameter of DeepSpeed's {kind}, which refuses it (an unexpected keyword argument); {kind} takes {}",
                takes.join(", ")
            ),
        ));
    }
    cfg.train.lr_schedule = schedule;
    r.set(
        "scheduler.type",
        &["train.lr_schedule"],
        format!("train.lr_schedule = \"{}\" (DeepSpeed's {kind}, step for step)", schedule.name()),
    );
    warmup_params(r, &params, cfg)?;
    let min_lr = match schedule {
        Schedule::WarmupCosineLr => {
            cosine_params(r, &params, cfg)?;
            None
        }
        _ => rate_params(r, kind, &params, cfg)?,
    };
    if schedule != Schedule::WarmupLr {
        total_steps(r, kind, &params, cfg)?;
    }
    if let Some(x) = params.get("last_batch_iteration") {
        let key = "scheduler.params.last_batch_iteration";
        match x.as_i64() {
            Some(-1) => r.push(Level::Note, key, "-1: the schedule starts at each stage's first step (`--resume` continues it)"),
            _ => r.push(
                Level::Warning,
                key,
                format!("{x}: starting DeepSpeed's schedule at a later iteration is not implemented; it starts at each stage's first step (`--resume` continues a run's)"),
            ),
        }
    }
    Ok(min_lr)
}

/// `warmup_num_steps` and `warmup_type`, shared by the three schedulers.
fn warmup_params(r: &mut Report, params: &serde_json::Map<String, Value>, cfg: &mut RunConfig) -> Result<()> {
    let key = "scheduler.params.warmup_num_steps";
    let (n, how) = match params.get("warmup_num_steps") {
        None => (Some(1000), "absent: DeepSpeed's default, "),
        Some(v) => (r.count(key, v, 0, MAX_STEPS)?, ""),
    };
    match n {
        Some(n) => {
            cfg.train.warmup_steps = n;
            cfg.stages.iter_mut().for_each(|s| s.warmup_steps = None);
            let two = match n {
                0 => " (DeepSpeed warms up over at least 2 iterations: up to 0.19.2 it takes 0 as 2, as here; 0.19.3 and later refuse 0)",
                1 => " (DeepSpeed warms up over at least 2 iterations, as here)",
                _ => "",
            };
            r.set(key, &["train.warmup_steps"], format!("{how}train.warmup_steps = {n} (every stage){two}"));
        }
        None => r.push(Level::Note, key, format!("\"auto\": train.warmup_steps stays {}", cfg.train.warmup_steps)),
    }
    let key = "scheduler.params.warmup_type";
    let (t, text) = match params.get("warmup_type") {
        None => (WarmupType::Log, "absent: DeepSpeed's default, train.warmup_type = \"log\"".to_string()),
        Some(Value::String(s)) if s == "log" || s == "linear" => {
            (if s == "log" { WarmupType::Log } else { WarmupType::Linear }, format!("train.warmup_type = \"{s}\""))
        }
        Some(Value::String(s)) => {
            r.push(Level::Warning, key, format!("`{s}` is neither \"log\" nor \"linear\": DeepSpeed warns and warms up by log, as here"));
            cfg.train.warmup_type = Some(WarmupType::Log);
            return Ok(());
        }
        Some(other) => return Err(r.err(key, format!("expected \"log\" or \"linear\", got {other}"))),
    };
    cfg.train.warmup_type = Some(t);
    r.set(key, &["train.warmup_type"], text);
    Ok(())
}

/// WarmupLR and WarmupDecayLR: `warmup_max_lr` is the rate after warm-up (it replaces the
/// optimizer's lr; absent: the optimizer's for WarmupLR, 0.001 for WarmupDecayLR, as
/// DeepSpeed's defaults); `warmup_min_lr` where the warm-up starts (and where
/// WarmupDecayLR ends), kept as its ratio to that rate.
fn rate_params(r: &mut Report, kind: &str, params: &serde_json::Map<String, Value>, cfg: &mut RunConfig) -> Result<Option<f64>> {
    let key = "scheduler.params.warmup_max_lr";
    let max = match params.get("warmup_max_lr") {
        Some(v) => r.real(key, v, (0.0, true), (MAX_LEARNING_RATE, false))?.map(|lr| (lr, "")),
        None if kind == "WarmupDecayLR" => Some((1e-3, "absent: DeepSpeed's default, ")),
        None => None,
    };
    match max {
        Some((lr, how)) => {
            cfg.train.learning_rate = lr;
            cfg.stages.iter_mut().for_each(|s| s.learning_rate = None);
            r.set(
                key,
                &["train.learning_rate"],
                format!("{how}train.learning_rate = {lr:e} (every stage; the rate after warm-up, in place of optimizer.params.lr)"),
            );
        }
        None => {
            let how = if params.contains_key("warmup_max_lr") { "\"auto\"" } else { "absent" };
            r.push(
                Level::Note,
                key,
                format!("{how}: warms up to the optimizer's rate, train.learning_rate = {:e}", cfg.train.learning_rate),
            );
        }
    }
    let key = "scheduler.params.warmup_min_lr";
    let lr = cfg.train.learning_rate;
    let min = match params.get("warmup_min_lr") {
        None => Some(0.0),
        Some(v) => r.real(key, v, (0.0, false), (f64::MAX, false))?,
    };
    let Some(min) = min else {
        r.push(Level::Note, key, format!("\"auto\": train.warmup_min_ratio stays {}", cfg.train.warmup_min_ratio));
        return Ok(None);
    };
    cfg.train.warmup_min_ratio = min_ratio(r, min, lr, "the rate after warm-up")?;
    let how = if params.contains_key("warmup_min_lr") { "" } else { "absent: DeepSpeed's default 0, " };
    let back = if kind == "WarmupDecayLR" { ", and where the decay ends" } else { "" };
    r.set(
        key,
        &["train.warmup_min_ratio"],
        format!(
            "{how}train.warmup_min_ratio = {} (warmup_min_lr {min:e} / {lr:e}: where the warm-up starts{back})",
            cfg.train.warmup_min_ratio
        ),
    );
    Ok(Some(min))
}

/// `warmup_min_lr` as a fraction of the learning rate `lr` (named `what` in the message).
fn min_ratio(r: &Report, min: f64, lr: f64, what: &str) -> Result<f64> {
    if min > lr {
        return Err(r.err(
            "scheduler.params.warmup_min_lr",
            format!(
                "{min:e} is above {what} ({lr:e}): DeepSpeed would lower the rate during the warm-up, which longctx does not do; \
                 give a warmup_min_lr of at most {lr:e}"
            ),
        ));
    }
    Ok(min / lr)
}

/// WarmupCosineLR: the optimizer's lr scaled by `warmup_min_ratio` at the start (default
/// 0) and `cos_min_ratio` at the end (default 0.0001).
fn cosine_params(r: &mut Report, params: &serde_json::Map<String, Value>, cfg: &mut RunConfig) -> Result<()> {
    let t = &mut cfg.train;
    let lr = t.learning_rate;
    for (name, default, field) in [("warmup_min_ratio", 0.0, "train.warmup_min_ratio"), ("cos_min_ratio", 1e-4, "train.min_lr_ratio")] {
        let key = format!("scheduler.params.{name}");
        let (x, how) = match params.get(name) {
            None => (Some(default), "absent: DeepSpeed's default, "),
            Some(v) => (r.real(&key, v, (0.0, false), (1.0, false))?, ""),
        };
        let slot = if name == "cos_min_ratio" { &mut t.min_lr_ratio } else { &mut t.warmup_min_ratio };
        match x {
            Some(x) => {
                *slot = x;
                r.set(&key, &[field], format!("{how}{field} = {x} (× train.learning_rate {lr:e})"));
            }
            None => r.push(Level::Note, &key, format!("\"auto\": {field} stays {slot}")),
        }
    }
    Ok(())
}

/// `total_num_steps` (WarmupDecayLR, WarmupCosineLR): where the decay ends, counted from
/// each stage's start; DeepSpeed needs it.
fn total_steps(r: &mut Report, kind: &str, params: &serde_json::Map<String, Value>, cfg: &mut RunConfig) -> Result<()> {
    let key = "scheduler.params.total_num_steps";
    let Some(v) = params.get("total_num_steps") else {
        return Err(r.err(
            key,
            format!("{kind} needs total_num_steps (DeepSpeed refuses it without): the step at which the decay ends, or \"auto\" for each stage's last step"),
        ));
    };
    match r.count(key, v, 1, MAX_STEPS)? {
        Some(n) => {
            cfg.train.schedule_steps = Some(n);
            r.set(key, &["train.schedule_steps"], format!("train.schedule_steps = {n} (the decay ends at step {n} of each stage)"));
        }
        None => {
            cfg.train.schedule_steps = None;
            r.push(Level::Note, key, "\"auto\": the decay ends with each stage's last step (train.schedule_steps unset)");
        }
    }
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
        Some(on) => r.set(&format!("{key}.device"), &[field], format!("{field} = {on}")),
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
            "stage" => match r.count(&key, x, 0, u64::from(u32::MAX))? {
                Some(s @ 0..=3) => {
                    cfg.train.zero_stage = s as u8;
                    r.set(&key, &["train.zero_stage"], format!("train.zero_stage = {s}"));
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
/// Why DeepSpeed's batch rule refuses a triple.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum BatchError {
    /// All three given: `train_batch_size` is not their product.
    Mismatch { product: u64 },
    /// The one left out would not be whole: `train_batch_size` is not a multiple of `per`.
    NotMultiple { per: u64 },
}

/// DeepSpeed's batch rule (`DeepSpeedConfig._set_batch_related_parameters` and its
/// assertion): `total` = micro-batch × accumulation × `dp` data-parallel ranks. Given both,
/// the product must be `total`; given one, the other is derived; given neither, the
/// accumulation is 1 and the micro-batch `total / dp`. Returns (micro-batch, accumulation).
fn batch_rule(total: u64, micro: Option<u64>, accum: Option<u64>, dp: u64) -> std::result::Result<(u64, u64), BatchError> {
    let whole = |per: u64| if per > 0 && total.is_multiple_of(per) { Ok(total / per) } else { Err(BatchError::NotMultiple { per }) };
    match (micro, accum) {
        (Some(m), Some(a)) => {
            let product = m.saturating_mul(a).saturating_mul(dp);
            if product == total {
                Ok((m, a))
            } else {
                Err(BatchError::Mismatch { product })
            }
        }
        (Some(m), None) => Ok((m, whole(m.saturating_mul(dp))?)),
        (None, Some(a)) => Ok((whole(a.saturating_mul(dp))?, a)),
        (None, None) => Ok((whole(dp)?, 1)),
    }
}

/// The two multiples of `per` nearest `total` (for a message).
fn multiples(total: u64, per: u64) -> String {
    let lo = total / per * per;
    if lo == 0 {
        format!("{per}")
    } else {
        format!("{lo} or {}", lo + per)
    }
}

impl Applied {
    /// Settle what needs the flags and the layout, after the flags are applied and the
    /// world size is final: DeepSpeed's batch rule per stage (with its data-parallel
    /// degree), `offload_param` below stage 3 (no effect, as in DeepSpeed), and the ratio
    /// of `warmup_min_lr` to a learning rate a flag may have changed. Returns more lines.
    pub fn finish(&self, cfg: &mut RunConfig, flags: BatchFlags) -> Result<Vec<Line>> {
        let mut r = Report::new(&self.src, self.prefix);
        if !self.present {
            return Ok(r.lines);
        }
        let key = "zero_optimization.offload_param.device";
        if self.sets("train.offload_params", cfg) && cfg.train.offload_params && cfg.train.zero_stage < 3 {
            cfg.train.offload_params = false;
            let s = cfg.train.zero_stage;
            r.push(
                Level::Warning,
                key,
                format!("\"cpu\" has no effect at ZeRO stage {s} (DeepSpeed offloads parameters at stage 3 only): train.offload_params = false; set zero_optimization.stage to 3 to offload the weights"),
            );
        }
        if let Some(min) = self.warmup_min_lr {
            let lr = cfg.train.learning_rate;
            let ratio = min_ratio(&r, min, lr, "the learning rate the flags set")?;
            if ratio != cfg.train.warmup_min_ratio {
                cfg.train.warmup_min_ratio = ratio;
                let text = format!("train.warmup_min_ratio = {ratio} (warmup_min_lr {min:e} / the learning rate {lr:e} the flags set)");
                r.push(Level::Set, "scheduler.params.warmup_min_lr", text);
            }
        }
        self.finish_batch(&mut r, cfg, flags)?;
        Ok(r.lines)
    }

    /// Whether a key of this config set `field` and the value is still the one it set.
    fn sets(&self, field: &str, cfg: &RunConfig) -> bool {
        self.setter(field, cfg).is_some()
    }

    /// The key that set `field`, while `cfg` still holds the value it set.
    fn setter(&self, field: &str, cfg: &RunConfig) -> Option<&str> {
        let (_, key, then) = self.set.iter().rev().find(|(f, _, _)| f == field)?;
        let now = serde_json::to_value(cfg).ok()?;
        (now.pointer(&pointer(field)) == then.as_ref() && then.is_some()).then_some(key.as_str())
    }

    /// `cfg.validate(source)`, with a failing value that came from this config blamed on
    /// the key that set it (file and key), not on the TOML or the flags.
    pub fn validate(&self, cfg: &RunConfig, source: &Path) -> Result<()> {
        cfg.validate(source).map_err(|e| self.blame(cfg, e))
    }

    fn blame(&self, cfg: &RunConfig, e: Error) -> Error {
        let Error::Config { field, msg, .. } = &e else { return e };
        match self.setter(field, cfg) {
            Some(key) => Error::config(&self.src, format!("{}{key}", self.prefix), format!("{msg} (`{field}`, as this key sets it)")),
            None => e,
        }
    }

    /// How the micro-batch or the accumulation of stage `i` was given, for a message.
    fn given_label(&self, micro: bool, flag: bool, stage: &str, value: usize) -> String {
        let (given, key, flag_name, field) = if micro {
            (self.micro, "train_micro_batch_size_per_gpu", "--batch-size", "batch_size")
        } else {
            (self.accum, "gradient_accumulation_steps", "--gradient-accumulate-every", "gradient_accumulate_every")
        };
        match (flag, given) {
            (true, _) => format!("{flag_name} {value} (the flag)"),
            (false, Given::Auto) => format!("{key} \"auto\" = {stage}{field} {value}"),
            _ => format!("{key} {value}"),
        }
    }

    /// DeepSpeed's batch rule for every stage (see [`batch_rule`]); the derived micro-batch
    /// and accumulation become the run's (a stage's own where stages differ).
    fn finish_batch(&self, r: &mut Report, cfg: &mut RunConfig, flags: BatchFlags) -> Result<()> {
        let Given::Num(total) = self.total else { return Ok(()) };
        let given_micro = flags.batch_size || self.micro != Given::Absent;
        let given_accum = flags.gradient_accumulate_every || self.accum != Given::Absent;
        let n = cfg.stages.len();
        let (mut out, mut texts) = (Vec::with_capacity(n), Vec::with_capacity(n));
        for i in 0..n {
            let s = cfg.stage_settings(i);
            let own = |b: bool| if b { format!("stage[{i}].") } else { "train.".to_string() };
            let micro_l = self.given_label(true, flags.batch_size, &own(cfg.stages[i].batch_size.is_some()), s.batch_size);
            let accum_l = self.given_label(
                false,
                flags.gradient_accumulate_every,
                &own(cfg.stages[i].gradient_accumulate_every.is_some()),
                s.gradient_accumulate_every,
            );
            let ranks = match s.sp {
                1 => format!("{} data-parallel rank{}", s.dp, if s.dp == 1 { "" } else { "s" }),
                sp => format!(
                    "{} data-parallel rank{} (parallel.world_size {} / sequence-parallel {sp})",
                    s.dp,
                    if s.dp == 1 { "" } else { "s" },
                    cfg.parallel.world_size
                ),
            };
            let at = if n > 1 { format!("stage[{i}]: ") } else { String::new() };
            let (m, a) = (given_micro.then_some(s.batch_size as u64), given_accum.then_some(s.gradient_accumulate_every as u64));
            let (micro, accum) = batch_rule(total, m, a, s.dp as u64).map_err(|e| {
                let msg = match (e, m.is_some(), a.is_some()) {
                    (BatchError::Mismatch { product }, _, _) => format!(
                        "{at}{total} ≠ {micro_l} × {accum_l} × {ranks} = {product}; DeepSpeed refuses this (train_batch_size must be micro-batch × accumulation × data-parallel ranks): \
                         set train_batch_size to {product}, or leave out gradient_accumulation_steps (or train_batch_size) to derive it"
                    ),
                    (BatchError::NotMultiple { per }, true, _) => format!(
                        "{at}{total} is not a multiple of {micro_l} × {ranks} = {per}, so no whole gradient_accumulation_steps gives it (DeepSpeed refuses it too): \
                         use a train_batch_size of {}, or another micro-batch", multiples(total, per)
                    ),
                    (BatchError::NotMultiple { per }, false, true) => format!(
                        "{at}{total} is not a multiple of {accum_l} × {ranks} = {per}, so no whole micro-batch gives it (DeepSpeed refuses it too): \
                         use a train_batch_size of {}, or another accumulation", multiples(total, per)
                    ),
                    (BatchError::NotMultiple { per }, false, false) => format!(
                        "{at}{total} is not a multiple of the {ranks}: with train_batch_size alone DeepSpeed takes accumulation 1 and a micro-batch of \
                         train_batch_size / ranks, which must be whole: use a train_batch_size of {}, or give train_micro_batch_size_per_gpu", multiples(total, per)
                    ),
                };
                r.err("train_batch_size", msg)
            })?;
            if micro > MAX_BATCH as u64 || accum > MAX_BATCH as u64 {
                let msg = format!("{at}{total} gives a micro-batch of {micro} and {accum} accumulation steps over {ranks}; each must be at most {MAX_BATCH}: lower train_batch_size");
                return Err(r.err("train_batch_size", msg));
            }
            let how = match (m, a) {
                (Some(_), Some(_)) => "as given".to_string(),
                (Some(_), None) => format!("train.gradient_accumulate_every = {accum}, derived as DeepSpeed derives it"),
                (None, Some(_)) => format!("train.batch_size = {micro}, derived as DeepSpeed derives it"),
                (None, None) => {
                    format!("train.batch_size = {micro}, train.gradient_accumulate_every = 1, as DeepSpeed takes train_batch_size alone")
                }
            };
            let level = if m.is_some() && a.is_some() { Level::Note } else { Level::Set };
            texts.push((level, format!("{total} = {micro} × {accum} × {ranks}: {how}")));
            out.push((m.is_none().then_some(micro as usize), a.is_none().then_some(accum as usize)));
        }
        // One line when every stage says the same, else one per stage.
        let same = texts.windows(2).all(|w| w[0] == w[1]);
        for (i, (level, text)) in texts.into_iter().enumerate() {
            match (same, i) {
                (true, 0) => r.push(level, "train_batch_size", text),
                (true, _) => {}
                (false, _) => r.push(level, "train_batch_size", format!("stage[{i}]: {text}")),
            }
        }
        set_derived(cfg, &out);
        Ok(())
    }
}

/// Derived (micro-batch, accumulation) per stage (`None`: given): the first stage's
/// become the run's; a stage that differs keeps its own.
fn set_derived(cfg: &mut RunConfig, out: &[(Option<usize>, Option<usize>)]) {
    if let Some(m) = out.iter().find_map(|d| d.0) {
        cfg.train.batch_size = m;
    }
    if let Some(a) = out.iter().find_map(|d| d.1) {
        cfg.train.gradient_accumulate_every = a;
    }
    let (m0, a0) = (cfg.train.batch_size, cfg.train.gradient_accumulate_every);
    for (st, (m, a)) in cfg.stages.iter_mut().zip(out) {
        if let Some(m) = m {
            st.batch_size = (*m != m0).then_some(*m);
        }
        if let Some(a) = a {
            st.gradient_accumulate_every = (*a != a0).then_some(*a);
        }
    }
}
