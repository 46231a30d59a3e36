//! A step profile without Nsight: the engine and the trainer time their work by phase,
//! with CUDA events on the compute stream (the GPU's own clock, no synchronisation until
//! the step is read) or the wall clock on the CPU (where ops run synchronously).
//!
//! Spans are disjoint by construction (callers time leaf work only), so the phase sums
//! add up to at most the step time; what no span covers is reported as `other`.
//! Disabled (the default), [`Profiler::time`] only runs its closure.

use std::sync::Mutex;
use std::time::Instant;

use candle_core::Device;

use crate::Result;

/// What a span of work is.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Phase {
    /// Attention kernels (forward and backward, every mode's communication inside them included).
    Attention,
    /// Projections and MLP matmuls, forward and backward (weight and input gradients).
    Gemm,
    /// RMSNorm, RoPE, SwiGLU and their backwards.
    NormRopeAct,
    /// Final norm, `lm_head`, cross-entropy and their backward (chunked).
    Loss,
    /// Adding weight gradients into their f32 slots.
    GradAccum,
    /// Copies on the device: chunks written into whole-sequence buffers, contiguous copies,
    /// the embedding lookup.
    Copies,
    /// Host↔device traffic the step waits on: a unit's weights brought from the host shard
    /// (ZeRO-3 with offloaded weights), activations parked in host memory or brought back,
    /// and the waits for copies started ahead; apart from `copies` so that a profile tells
    /// device copies from transfers.
    Transfers,
    /// Element-wise sums: the residual adds and the sums of the projections' input gradients
    /// (q, k, v; gate and up), apart from the copies so that a profile tells the two apart.
    Adds,
    /// The optimizer step at the step's end (norm and clipping included; the whole update
    /// when it is applied at once, and a pending deferred update settled).
    Optimizer,
    /// The next forward's first unit made ready: with a deferred update (ZeRO-3, weights
    /// and optimizer state on the host) the device units' update, or the host update of
    /// the first units, as far as the GPU waits for it.
    UpdateFirst,
    /// The later units and the head made ready in the forward: the GPU's waits for the
    /// deferred host update (zero while the host keeps ahead of the forward).
    UpdateWait,
    /// Gradient/weight collectives outside attention.
    Comm,
}

impl Phase {
    pub const ALL: [Phase; 12] = [
        Phase::Attention,
        Phase::Gemm,
        Phase::NormRopeAct,
        Phase::Loss,
        Phase::GradAccum,
        Phase::Copies,
        Phase::Transfers,
        Phase::Adds,
        Phase::Optimizer,
        Phase::UpdateFirst,
        Phase::UpdateWait,
        Phase::Comm,
    ];

    pub fn name(self) -> &'static str {
        match self {
            Phase::Attention => "attention",
            Phase::Gemm => "gemm",
            Phase::NormRopeAct => "norm_rope_act",
            Phase::Loss => "loss",
            Phase::GradAccum => "grad_accum",
            Phase::Copies => "copies",
            Phase::Transfers => "transfers",
            Phase::Adds => "adds",
            Phase::Optimizer => "optimizer",
            Phase::UpdateFirst => "update_first",
            Phase::UpdateWait => "update_wait",
            Phase::Comm => "comm",
        }
    }
}

/// A recorded point in time: a CUDA event on the compute stream, or the wall clock (the
/// one timer of the crate: the step profiler and `longctx bench` use it).
pub enum Mark {
    #[cfg(feature = "cuda")]
    Event(candle_core::cuda::cudarc::driver::CudaEvent),
    Wall(Instant),
}

impl Mark {
    /// Records now on `dev`'s stream (CUDA), or reads the clock.
    pub fn now(dev: &Device) -> Result<Self> {
        #[cfg(feature = "cuda")]
        if let Device::Cuda(cd) = dev {
            use candle_core::cuda::cudarc::driver::sys::CUevent_flags;
            let ev = cd.cuda_stream().record_event(Some(CUevent_flags::CU_EVENT_DEFAULT)).map_err(candle_core::Error::wrap)?;
            return Ok(Mark::Event(ev));
        }
        let _ = dev;
        Ok(Mark::Wall(Instant::now()))
    }

    /// Seconds from `self` to `end` (waits for the end event).
    pub fn seconds_to(&self, end: &Mark) -> Result<f64> {
        match (self, end) {
            #[cfg(feature = "cuda")]
            (Mark::Event(a), Mark::Event(b)) => Ok(a.elapsed_ms(b).map_err(candle_core::Error::wrap)? as f64 / 1e3),
            (Mark::Wall(a), Mark::Wall(b)) => Ok(b.duration_since(*a).as_secs_f64()),
            #[allow(unreachable_patterns)]
            _ => Err(crate::Error::Setting("profile: a span started and ended on different devices".into())),
        }
    }
}

/// Seconds per phase of one step (or of several, summed).
#[derive(Clone, Debug, Default, PartialEq)]
pub struct PhaseTimes {
    pub seconds: [f64; Phase::ALL.len()],
}

impl PhaseTimes {
    pub fn get(&self, p: Phase) -> f64 {
        self.seconds[p as usize]
    }

    pub fn total(&self) -> f64 {
        self.seconds.iter().sum()
    }

    /// `{"attention": s, ..., "other": step − Σ}` for a metrics line.
    pub fn to_json(&self, step_seconds: f64) -> serde_json::Value {
        let mut m = serde_json::Map::new();
        for p in Phase::ALL {
            m.insert(p.name().into(), self.get(p).into());
        }
        m.insert("other".into(), (step_seconds - self.total()).max(0.0).into());
        serde_json::Value::Object(m)
    }

    /// One line: each phase's seconds and share of `step_seconds`.
    pub fn summary(&self, step_seconds: f64) -> String {
        let pct = |s: f64| if step_seconds > 0.0 { 100.0 * s / step_seconds } else { 0.0 };
        let mut parts: Vec<String> =
            Phase::ALL.iter().map(|&p| format!("{} {:.3}s ({:.0}%)", p.name(), self.get(p), pct(self.get(p)))).collect();
        let other = (step_seconds - self.total()).max(0.0);
        parts.push(format!("other {other:.3}s ({:.0}%)", pct(other)));
        parts.join(", ")
    }
}

/// Collects spans of one step; read and cleared with [`Profiler::take`].
#[derive(Default)]
pub struct Profiler {
    enabled: bool,
    spans: Mutex<Vec<(Phase, Mark, Mark)>>,
    /// `train.trace`: when the current step began (a line per point of it is printed).
    trace: Option<Mutex<Instant>>,
}

impl Profiler {
    pub fn new(enabled: bool) -> Self {
        Self { enabled, spans: Mutex::new(Vec::new()), trace: None }
    }

    /// Also print a line to stderr at every [`Self::trace`] point, with the seconds since
    /// the step began, after waiting for the device (`train.trace`: where a slow step
    /// spends its time, even one that never finishes).
    pub fn with_trace(mut self, on: bool) -> Self {
        self.trace = on.then(|| Mutex::new(Instant::now()));
        self
    }

    /// A new step begins (the trace's clock restarts).
    pub fn trace_step(&self, what: &str) {
        if let Some(t) = &self.trace {
            if let Ok(mut t) = t.lock() {
                *t = Instant::now();
            }
            eprintln!("trace      0.000 s  {what}");
        }
    }

    /// With `train.trace`: wait for `dev`, print the seconds since the step began and `what`.
    pub fn trace(&self, dev: &Device, what: impl FnOnce() -> String) -> Result<()> {
        if let Some(t) = &self.trace {
            dev.synchronize()?;
            let since = t.lock().map(|t| t.elapsed().as_secs_f64()).unwrap_or(0.0);
            eprintln!("trace {since:>10.3} s  {}", what());
        }
        Ok(())
    }

    pub fn enabled(&self) -> bool {
        self.enabled
    }

    /// Runs `f`, timing it as `phase` on `dev`'s compute stream when enabled.
    pub fn time<T>(&self, phase: Phase, dev: &Device, f: impl FnOnce() -> Result<T>) -> Result<T> {
        if !self.enabled {
            return f();
        }
        let start = Mark::now(dev)?;
        let out = f()?;
        let end = Mark::now(dev)?;
        if let Ok(mut s) = self.spans.lock() {
            s.push((phase, start, end));
        }
        Ok(out)
    }

    /// The phase sums of the spans recorded since the last call (waits for the GPU).
    pub fn take(&self) -> Result<PhaseTimes> {
        let spans = match self.spans.lock() {
            Ok(mut s) => std::mem::take(&mut *s),
            Err(_) => return Err(crate::Error::Setting("profile: poisoned by a failed step".into())),
        };
        let mut t = PhaseTimes::default();
        for (p, a, b) in &spans {
            t.seconds[*p as usize] += a.seconds_to(b)?;
        }
        Ok(t)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn spans_sum_by_phase() {
        let p = Profiler::new(true);
        let dev = Device::Cpu;
        let sleep = |ms| {
            std::thread::sleep(std::time::Duration::from_millis(ms));
            Ok(())
        };
        p.time(Phase::Gemm, &dev, || sleep(20)).unwrap();
        p.time(Phase::Gemm, &dev, || sleep(10)).unwrap();
        p.time(Phase::Loss, &dev, || sleep(5)).unwrap();
        let t = p.take().unwrap();
        assert!(t.get(Phase::Gemm) >= 0.030 && t.get(Phase::Gemm) < 5.0, "{t:?}");
        assert!(t.get(Phase::Loss) >= 0.005 && t.get(Phase::Loss) < 5.0, "{t:?}");
        assert_eq!(t.get(Phase::Attention), 0.0);
        assert_eq!(p.take().unwrap(), PhaseTimes::default(), "take clears");
        let off = Profiler::new(false);
        off.time(Phase::Gemm, &dev, || sleep(1)).unwrap();
        assert_eq!(off.take().unwrap().total(), 0.0);
        let j = t.to_json(1.0);
        assert!(j["other"].as_f64().unwrap() > 0.9);
    }
}
