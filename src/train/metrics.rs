//! Progress and metrics (rank 0): a progress bar (loss, tokens/s, MFU, memory, elapsed
//! time and the run's ETA), one JSON line per optimizer step in
//! `<output_dir>/metrics.jsonl`, the same scalars as TensorBoard events in
//! `<output_dir>/tensorboard/` ([`crate::train::tensorboard`]), and a summary at the end.
//! Without a terminal, a plain line is printed every 10 steps instead of the bar.

use crate::model::LlamaConfig;
use crate::train::config::{RunConfig, Stage, StageSettings};
use crate::train::engine::MemoryReport;
use crate::train::stage_eval::EvalLine;
use crate::train::tensorboard::EventWriter;
use crate::train::trainer::RunSummary;
use crate::{Error, Result};
use indicatif::{ProgressBar, ProgressStyle};
use std::io::{IsTerminal, Write};
use std::path::PathBuf;
use std::time::Instant;

/// Peak dense bf16 FLOP/s used for MFU when the GPU is not known (H100/H200 SXM), as in
/// DESIGN.md; `train.peak_tflops` (`--peak-tflops`) sets another.
pub const PEAK_FLOPS: f64 = 989e12;

/// Where the TensorBoard event files go, under the output directory.
pub const TENSORBOARD_DIR: &str = "tensorboard";

/// Peak dense bf16 (tensor core) TFLOP/s of a GPU by its name as the driver reports it
/// (vendor data sheets, without sparsity); `None` when not in the table.
pub fn peak_tflops_for(gpu_name: &str) -> Option<f64> {
    let n = gpu_name.to_ascii_uppercase();
    // Most specific first (`H100 PCIE` before `H100`).
    const TABLE: [(&str, f64); 16] = [
        ("GB200", 2500.0),
        ("B200", 2250.0),
        ("B100", 1750.0),
        ("H200", 989.0),
        ("H100 PCIE", 756.0),
        ("H100 NVL", 835.0),
        ("H100", 989.0),
        ("H800", 989.0),
        ("H20", 148.0),
        ("A100", 312.0),
        ("A800", 312.0),
        ("L40S", 362.0),
        ("L40", 181.0),
        ("L4", 121.0),
        ("A10", 125.0),
        ("RTX 4090", 165.0),
    ];
    TABLE.iter().find(|(k, _)| n.contains(k)).map(|&(_, v)| v)
}

/// Seconds left after step `step` of stage `si` of `plan` (steps, tokens per step, length
/// per stage) when a step of stage `si` takes `step_seconds`: later stages' steps scaled by
/// their FLOPs per step (`flops_per_token(length)` × tokens).
pub fn eta(plan: &[(u64, u64, usize)], si: usize, step: u64, step_seconds: f64, flops_per_token: impl Fn(usize) -> f64) -> Option<f64> {
    let cost = |&(_, tokens, len): &(u64, u64, usize)| tokens as f64 * flops_per_token(len);
    let cur = plan.get(si)?;
    let mut left = cur.0.saturating_sub(step) as f64 * step_seconds;
    for later in plan.iter().skip(si + 1) {
        left += later.0 as f64 * step_seconds * cost(later) / cost(cur).max(1.0);
    }
    Some(left)
}

/// `h:mm:ss`.
pub fn hms(seconds: f64) -> String {
    let s = if seconds.is_finite() && seconds > 0.0 { seconds.round() as u64 } else { 0 };
    format!("{}:{:02}:{:02}", s / 3600, s / 60 % 60, s % 60)
}

pub struct StepLine {
    pub stage: usize,
    pub step: u64,
    pub steps: u64,
    pub global_step: u64,
    pub loss: f64,
    pub lr: f64,
    pub grad_norm: f64,
    /// The update of this step was skipped (non-finite gradient norm or loss).
    pub skipped: bool,
    /// Steps skipped so far over the run.
    pub skipped_steps: u64,
    pub tokens: u64,
    pub seconds: f64,
    /// Of which forward+backward (the rest: data, gradient reduction, optimizer, write-back).
    pub engine_seconds: f64,
    pub seq_len: usize,
    /// Attention work of the step's samples relative to one document per sample
    /// (Σ lenᵢ(lenᵢ+1) / S(S+1), averaged; 1 without documents packing): MFU counts only
    /// the attention that was computed.
    pub attention_work: f64,
    pub memory: MemoryReport,
    /// Most device memory in use during the step (bytes; CUDA only).
    pub device_peak: Option<u64>,
    /// Seconds per phase, when profiling (`train.profile`).
    pub profile: Option<crate::train::profile::PhaseTimes>,
}

/// Device memory in use now and at most since the last reset (bytes), on CUDA; resets the
/// high-water mark when `reset`. `None` on other devices.
pub fn device_memory(dev: &candle_core::Device, reset: bool) -> Result<Option<(u64, u64)>> {
    #[cfg(feature = "cuda")]
    if let candle_core::Device::Cuda(c) = dev {
        return Ok(Some(longctx_attention::cuda::pool_memory(c, reset)?));
    }
    let _ = (dev, reset);
    Ok(None)
}

pub struct Metrics {
    path: PathBuf,
    /// `metrics.jsonl` and the TensorBoard writer, opened at the first step
    /// ([`Metrics::open`]): a run that fails before it (a missing dataset, say) leaves
    /// nothing that would make its directory look like it holds a run.
    files: Option<(std::fs::File, Option<EventWriter>)>,
    output_dir: PathBuf,
    resumed_at: Option<u64>,
    tensorboard_on: bool,
    /// The TensorBoard file of this run, once opened.
    tensorboard_path: Option<PathBuf>,
    bar: Option<ProgressBar>,
    tty: bool,
    n_params: usize,
    layers: usize,
    hidden: usize,
    ranks: usize,
    gpu: bool,
    /// Peak FLOP/s of one device (MFU's denominator per rank).
    peak_flops: f64,
    /// Per stage: steps, tokens per step, length (the ETA's cost model).
    plan: Vec<(u64, u64, usize)>,
    /// Since this process started the run.
    started: Instant,
    /// Smoothed seconds per step of the current stage.
    step_seconds: Option<f64>,
}

fn gib(b: usize) -> f64 {
    b as f64 / (1u64 << 30) as f64
}

impl Metrics {
    /// The metrics of a run in `output_dir`; `<output_dir>/metrics.jsonl` and the
    /// TensorBoard file are opened at the first step ([`Metrics::open`]).
    pub fn new(
        output_dir: &std::path::Path,
        cfg: &RunConfig,
        n_params: usize,
        mcfg: &LlamaConfig,
        resumed_at: Option<u64>,
    ) -> Result<Self> {
        let gpu = cfg.model.device.starts_with("cuda");
        let peak_tflops = cfg.train.peak_tflops.or_else(|| {
            let name = crate::device::gpu_name(&cfg.model.device)?;
            let p = peak_tflops_for(&name);
            if p.is_none() {
                eprintln!("note: the peak TFLOP/s of `{name}` is not known; MFU assumes 989 (set --peak-tflops)");
            }
            p
        });
        let plan = (0..cfg.stages.len())
            .map(|i| {
                let s = cfg.stage_settings(i);
                (cfg.stages[i].steps, s.tokens_per_step(), s.seq_length)
            })
            .collect();
        Ok(Self {
            path: output_dir.join("metrics.jsonl"),
            files: None,
            output_dir: output_dir.to_path_buf(),
            resumed_at,
            tensorboard_on: cfg.train.tensorboard,
            tensorboard_path: None,
            bar: None,
            tty: std::io::stderr().is_terminal(),
            n_params,
            layers: mcfg.num_hidden_layers,
            hidden: mcfg.hidden_size,
            ranks: cfg.parallel.world_size,
            gpu,
            peak_flops: peak_tflops.map_or(PEAK_FLOPS, |t| t * 1e12),
            plan,
            started: Instant::now(),
            step_seconds: None,
        })
    }

    /// Opens `<output_dir>/metrics.jsonl` (emptied for a fresh run; for a run resumed at
    /// global step `g`, kept up to step `g`, since lines a crashed run wrote after its last
    /// checkpoint are of steps that run again, and appended to) and the TensorBoard file.
    fn open(&mut self) -> Result<&mut (std::fs::File, Option<EventWriter>)> {
        if self.files.is_none() {
            let (dir, path) = (&self.output_dir, &self.path);
            std::fs::create_dir_all(dir).map_err(|e| Error::io(dir, e))?;
            let kept: String = match self.resumed_at {
                Some(g) if path.is_file() => std::fs::read_to_string(path)
                    .map_err(|e| Error::io(path, e))?
                    .lines()
                    .filter(|l| {
                        serde_json::from_str::<serde_json::Value>(l).ok().and_then(|v| v["global_step"].as_u64()).is_some_and(|s| s <= g)
                    })
                    .map(|l| format!("{l}\n"))
                    .collect(),
                _ => String::new(),
            };
            let tmp = dir.join(".metrics.jsonl.tmp");
            std::fs::write(&tmp, kept).map_err(|e| Error::io(&tmp, e))?;
            std::fs::rename(&tmp, path).map_err(|e| Error::io(path, e))?;
            let file = std::fs::OpenOptions::new().append(true).open(path).map_err(|e| Error::io(path, e))?;
            let tb = if self.tensorboard_on { Some(EventWriter::create(&dir.join(TENSORBOARD_DIR), self.resumed_at)?) } else { None };
            self.tensorboard_path = tb.as_ref().map(|t| t.path().to_path_buf());
            self.files = Some((file, tb));
        }
        self.files.as_mut().ok_or_else(|| Error::Setting("metrics file not open".into()))
    }

    /// Seconds left in the run after step `step` of stage `si`: the current stage's
    /// smoothed step time for its remaining steps, scaled by FLOPs per step for the later
    /// stages (tokens per step × FLOPs per token at their length).
    pub fn eta_seconds(&self, si: usize, step: u64) -> Option<f64> {
        eta(&self.plan, si, step, self.step_seconds?, |len| self.flops_per_token(len))
    }

    /// Model FLOPs per token at `seq` (DESIGN.md: 6·params + 6·layers·hidden·seq).
    pub fn flops_per_token(&self, seq: usize) -> f64 {
        self.flops_per_token_at(seq as f64)
    }

    /// [`Self::flops_per_token`] with the attention term at an effective length (`seq`
    /// times the attention work of packed documents).
    pub fn flops_per_token_at(&self, seq: f64) -> f64 {
        6.0 * self.n_params as f64 + 6.0 * (self.layers * self.hidden) as f64 * seq
    }

    pub fn stage_start(&mut self, si: usize, st: &Stage, s: &StageSettings, world: usize, sp: usize, dp: usize) -> Result<()> {
        if let Some(b) = self.bar.take() {
            end_bar(b); // (the finished stage's bar stays on screen)
        }
        self.step_seconds = None;
        eprintln!(
            "stage {si}: seq_length {} rope_theta {} steps {} mode {} (world {world} = dp {dp} × sp {sp}); batch {} × accumulate {} × dp {dp} \
             = {} tokens per step; data {} (seed {}){}",
            st.seq_length,
            st.rope_theta,
            st.steps,
            s.mode,
            s.batch_size,
            s.gradient_accumulate_every,
            s.tokens_per_step(),
            s.dataset,
            s.seed,
            if s.reset_optimizer { "; fresh optimizer" } else { "" }
        );
        if self.tty {
            let bar = ProgressBar::new(st.steps);
            bar.set_style(
                ProgressStyle::with_template("{prefix} [{bar:20}] {pos}/{len} {wide_msg}")
                    .map_err(|e| Error::Setting(e.to_string()))?
                    .progress_chars("=> "),
            );
            bar.set_prefix(format!("stage {si}"));
            self.bar = Some(bar);
        }
        Ok(())
    }

    pub fn step(&mut self, l: &StepLine) -> Result<()> {
        let tok_s = l.tokens as f64 / l.seconds.max(1e-9);
        let mfu = tok_s * self.flops_per_token_at(l.seq_len as f64 * l.attention_work) / (self.peak_flops * self.ranks as f64);
        // The first step of a stage (warm-up, allocations) counts less once others came.
        self.step_seconds = Some(match self.step_seconds {
            None => l.seconds,
            Some(t) => 0.8 * t + 0.2 * l.seconds,
        });
        let line = serde_json::json!({
            "stage": l.stage, "step": l.step, "global_step": l.global_step, "loss": l.loss, "lr": l.lr,
            "grad_norm": l.grad_norm, "skipped": l.skipped, "skipped_steps": l.skipped_steps, "tokens": l.tokens, "seconds": l.seconds, "engine_seconds": l.engine_seconds, "tokens_per_s": tok_s,
            "mfu": if self.gpu { Some(mfu) } else { None }, "seq_len": l.seq_len, "attention_work": l.attention_work,
            "saved_activation_bytes": l.memory.saved_bytes, "saved_host_bytes": l.memory.saved_host_bytes,
            "transient_bytes": l.memory.transient_bytes, "device_peak_bytes": l.device_peak,
            "profile": l.profile.as_ref().map(|p| p.to_json(l.seconds)),
        });
        let path = self.path.clone();
        let gpu = self.gpu;
        let (file, tensorboard) = self.open()?;
        writeln!(file, "{line}").map_err(|e| Error::io(&path, e))?;
        if let Some(tb) = tensorboard.as_mut() {
            let mut v: Vec<(&str, f64)> = vec![
                ("train/loss", l.loss),
                ("train/lr", l.lr),
                ("train/grad_norm", l.grad_norm),
                ("train/tokens_per_s", tok_s),
                ("train/seq_len", l.seq_len as f64),
                ("train/stage", l.stage as f64),
                ("train/step_seconds", l.seconds),
                ("memory/saved_activation_gib", gib(l.memory.saved_bytes)),
                ("memory/saved_host_gib", gib(l.memory.saved_host_bytes)),
                ("memory/transient_gib", gib(l.memory.transient_bytes)),
            ];
            if gpu {
                v.push(("train/mfu", mfu));
            }
            if let Some(p) = l.device_peak {
                v.push(("memory/device_peak_gib", gib(p as usize)));
            }
            tb.scalars(l.global_step, &v)?;
        }
        let mfu_s = if self.gpu { format!(" mfu {:.1}%", 100.0 * mfu) } else { String::new() };
        let peak_s = l.device_peak.map(|b| format!(" peak {:.2} GiB", gib(b as usize))).unwrap_or_default();
        let eta = self.eta_seconds(l.stage, l.step).map_or(String::new(), |e| format!(" eta {}", hms(e)));
        // Loss, rate and ETA first: at 80 columns the bar's line is cut after them.
        let msg = format!(
            "loss {:.4} lr {:.2e}{eta} | {:.0} tok/s{mfu_s} act {:.2} GiB{peak_s} | run {}",
            l.loss,
            l.lr,
            tok_s,
            gib(l.memory.saved_bytes),
            hms(self.started.elapsed().as_secs_f64())
        );
        if let Some(p) = &l.profile {
            eprintln!("stage {} step {}/{} profile: {}", l.stage, l.step, l.steps, p.summary(l.seconds));
        }
        match &self.bar {
            Some(b) => {
                b.set_position(l.step);
                b.set_message(msg);
            }
            None => {
                if l.step.is_multiple_of(10) || l.step == 1 || l.step == l.steps {
                    eprintln!("stage {} step {}/{}: {msg}", l.stage, l.step, l.steps);
                }
            }
        }
        Ok(())
    }

    /// An evaluation during training ([`crate::train::stage_eval`]): its metrics.jsonl
    /// line, TensorBoard scalars `eval/ppl@L` and `eval/passkey@L`, and a console line.
    pub fn eval(&mut self, e: &EvalLine) -> Result<()> {
        let line = serde_json::to_string(e).map_err(|err| Error::Setting(format!("eval line: {err}")))?;
        let path = self.path.clone();
        let (file, tensorboard) = self.open()?;
        writeln!(file, "{line}").map_err(|err| Error::io(&path, err))?;
        if let Some(tb) = tensorboard.as_mut() {
            let mut names = Vec::new();
            for p in &e.ppl {
                if let Some(v) = p.ppl {
                    names.push((format!("eval/ppl@{}", crate::limits::tokens_label(p.length)), v));
                }
            }
            for &len in e.passkey.iter().map(|c| &c.length).collect::<std::collections::BTreeSet<_>>() {
                let cells = e.passkey.iter().filter(|c| c.length == len);
                let (right, total) = cells.fold((0, 0), |(r, t), c| (r + c.right, t + c.trials));
                names.push((format!("eval/passkey@{}", crate::limits::tokens_label(len)), right as f64 / total.max(1) as f64));
            }
            let v: Vec<(&str, f64)> = names.iter().map(|(n, v)| (n.as_str(), *v)).collect();
            tb.scalars(e.global_step, &v)?;
        }
        let msg =
            format!("eval after stage {} step {} (global step {}, {:.1} s): {}", e.stage, e.step, e.global_step, e.seconds, e.summary());
        match &self.bar {
            Some(b) => b.println(msg),
            None => eprintln!("{msg}"),
        }
        Ok(())
    }

    pub fn finish(&mut self, s: &RunSummary) -> Result<()> {
        if let Some(b) = self.bar.take() {
            end_bar(b);
        }
        let rate = format!("{:.0} tok/s", s.run_tokens as f64 / s.seconds.max(1e-9));
        if s.run_steps == s.steps {
            eprintln!("done: {} steps, {} tokens in {:.1} s ({rate})", s.steps, s.tokens, s.seconds);
        } else {
            // Resumed: the run's totals, and what this invocation did (its rate).
            eprintln!(
                "done: {} steps, {} tokens over the run; this invocation: {} steps, {} tokens in {:.1} s ({rate})",
                s.steps, s.tokens, s.run_steps, s.run_tokens, s.seconds
            );
        }
        for (i, a, b) in &s.stage_losses {
            eprintln!("  stage {i}: loss {a:.4} -> {b:.4}");
        }
        if s.skipped_steps > 0 {
            eprintln!("  skipped updates: {} (non-finite gradient norm or loss; see the `skipped` field of the metrics)", s.skipped_steps);
        }
        eprintln!(
            "  memory: saved activations {:.3} GiB ({:.3} GiB on host), largest chunk transient {:.3} GiB",
            gib(s.memory.saved_bytes),
            gib(s.memory.saved_host_bytes),
            gib(s.memory.transient_bytes)
        );
        if let Some(p) = s.device_peak {
            eprintln!("  device memory: peak {:.2} GiB in use", gib(p as usize));
        }
        match &s.export_dir {
            Some(d) => eprintln!("  export: {}", d.display()),
            None => eprintln!("  export: none (train.save = false)"),
        }
        eprintln!("  metrics: {}", self.path.display());
        if let Some(tb) = &self.tensorboard_path {
            eprintln!("  tensorboard: {}", tb.display());
        }
        Ok(())
    }
}

/// Leaves a finished bar on screen and ends its line (the terminal's cursor stays at the
/// end of the bar, so the next line printed would run on from it).
fn end_bar(b: ProgressBar) {
    b.finish();
    eprintln!();
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn peak_by_gpu_name() {
        assert_eq!(peak_tflops_for("NVIDIA H200"), Some(989.0));
        assert_eq!(peak_tflops_for("NVIDIA H100 PCIe"), Some(756.0));
        assert_eq!(peak_tflops_for("NVIDIA A100-SXM4-80GB"), Some(312.0));
        assert_eq!(peak_tflops_for("NVIDIA L40S"), Some(362.0));
        assert_eq!(peak_tflops_for("Some Future GPU"), None);
    }

    #[test]
    fn eta_scales_later_stages_by_their_cost() {
        // 10 steps of 1 s left in stage 0; stage 1: 5 steps of twice the tokens at the same
        // cost per token: 10 s more.
        let plan = [(20, 100, 8), (5, 200, 8)];
        assert_eq!(eta(&plan, 0, 10, 1.0, |_| 1.0), Some(20.0));
        assert_eq!(eta(&plan, 1, 5, 2.0, |_| 1.0), Some(0.0));
        assert_eq!(eta(&plan, 2, 0, 1.0, |_| 1.0), None);
        assert_eq!(hms(3723.4), "1:02:03");
    }
}
