//! Progress and metrics (rank 0): a progress bar (loss, tokens/s, MFU, memory), one JSON
//! line per optimizer step in `<output_dir>/metrics.jsonl`, and a summary at the end.
//! Without a terminal, a plain line is printed every 10 steps instead of the bar.

use crate::model::LlamaConfig;
use crate::train::config::{ParallelMode, RunConfig, Stage};
use crate::train::engine::MemoryReport;
use crate::train::trainer::RunSummary;
use crate::{Error, Result};
use indicatif::{ProgressBar, ProgressStyle};
use std::io::{IsTerminal, Write};
use std::path::PathBuf;

/// Peak dense bf16 FLOP/s used for MFU (H100/H200 SXM), as in DESIGN.md.
pub const PEAK_FLOPS: f64 = 989e12;

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
    file: std::fs::File,
    bar: Option<ProgressBar>,
    tty: bool,
    n_params: usize,
    layers: usize,
    hidden: usize,
    ranks: usize,
    gpu: bool,
}

fn gib(b: usize) -> f64 {
    b as f64 / (1u64 << 30) as f64
}

impl Metrics {
    /// Opens `<output_dir>/metrics.jsonl`: emptied for a fresh run; for a run resumed at
    /// global step `g`, kept up to step `g` (lines a crashed run wrote after its last
    /// checkpoint are dropped, since those steps run again) and appended to.
    pub fn new(
        output_dir: &std::path::Path,
        cfg: &RunConfig,
        n_params: usize,
        mcfg: &LlamaConfig,
        resumed_at: Option<u64>,
    ) -> Result<Self> {
        std::fs::create_dir_all(output_dir).map_err(|e| Error::io(output_dir, e))?;
        let path = output_dir.join("metrics.jsonl");
        let kept: String = match resumed_at {
            Some(g) if path.is_file() => std::fs::read_to_string(&path)
                .map_err(|e| Error::io(&path, e))?
                .lines()
                .filter(|l| {
                    serde_json::from_str::<serde_json::Value>(l).ok().and_then(|v| v["global_step"].as_u64()).is_some_and(|s| s <= g)
                })
                .map(|l| format!("{l}\n"))
                .collect(),
            _ => String::new(),
        };
        let tmp = output_dir.join(".metrics.jsonl.tmp");
        std::fs::write(&tmp, kept).map_err(|e| Error::io(&tmp, e))?;
        std::fs::rename(&tmp, &path).map_err(|e| Error::io(&path, e))?;
        let file = std::fs::OpenOptions::new().append(true).open(&path).map_err(|e| Error::io(&path, e))?;
        Ok(Self {
            path,
            file,
            bar: None,
            tty: std::io::stderr().is_terminal(),
            n_params,
            layers: mcfg.num_hidden_layers,
            hidden: mcfg.hidden_size,
            ranks: cfg.parallel.world_size,
            gpu: cfg.model.device.starts_with("cuda"),
        })
    }

    /// Model FLOPs per token at `seq` (DESIGN.md: 6·params + 6·layers·hidden·seq).
    pub fn flops_per_token(&self, seq: usize) -> f64 {
        6.0 * self.n_params as f64 + 6.0 * (self.layers * self.hidden * seq) as f64
    }

    pub fn stage_start(&mut self, si: usize, st: &Stage, mode: ParallelMode, world: usize, sp: usize, dp: usize) -> Result<()> {
        if let Some(b) = self.bar.take() {
            b.finish_and_clear();
        }
        eprintln!(
            "stage {si}: seq_length {} rope_theta {} steps {} mode {mode} (world {world} = dp {dp} × sp {sp})",
            st.seq_length, st.rope_theta, st.steps
        );
        if self.tty {
            let bar = ProgressBar::new(st.steps);
            bar.set_style(
                ProgressStyle::with_template("{prefix} [{bar:30}] {pos}/{len} {msg}")
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
        let mfu = tok_s * self.flops_per_token(l.seq_len) / (PEAK_FLOPS * self.ranks as f64);
        let line = serde_json::json!({
            "stage": l.stage, "step": l.step, "global_step": l.global_step, "loss": l.loss, "lr": l.lr,
            "grad_norm": l.grad_norm, "skipped": l.skipped, "skipped_steps": l.skipped_steps, "tokens": l.tokens, "seconds": l.seconds, "engine_seconds": l.engine_seconds, "tokens_per_s": tok_s,
            "mfu": if self.gpu { Some(mfu) } else { None }, "seq_len": l.seq_len,
            "saved_activation_bytes": l.memory.saved_bytes, "saved_host_bytes": l.memory.saved_host_bytes,
            "transient_bytes": l.memory.transient_bytes, "device_peak_bytes": l.device_peak,
            "profile": l.profile.as_ref().map(|p| p.to_json(l.seconds)),
        });
        writeln!(self.file, "{line}").map_err(|e| Error::io(&self.path, e))?;
        let mfu_s = if self.gpu { format!(" mfu {:.1}%", 100.0 * mfu) } else { String::new() };
        let peak_s = l.device_peak.map(|b| format!(" peak {:.2} GiB", gib(b as usize))).unwrap_or_default();
        let msg = format!("loss {:.4} lr {:.2e} {:.0} tok/s{mfu_s} act {:.2} GiB{peak_s}", l.loss, l.lr, tok_s, gib(l.memory.saved_bytes));
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

    pub fn finish(&mut self, s: &RunSummary) -> Result<()> {
        if let Some(b) = self.bar.take() {
            b.finish();
        }
        eprintln!(
            "done: {} steps, {} tokens in {:.1} s ({:.0} tok/s)",
            s.steps,
            s.tokens,
            s.seconds,
            s.tokens as f64 / s.seconds.max(1e-9)
        );
        for (i, (a, b)) in s.stage_losses.iter().enumerate() {
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
        eprintln!("  export: {}", s.export_dir.display());
        eprintln!("  metrics: {}", self.path.display());
        Ok(())
    }
}
