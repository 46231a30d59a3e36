//! AdamW with decoupled weight decay over a flat f32 shard of the parameters (ZeRO-1 ready).
//!
//! The parameters of the model, in a fixed order, are viewed as one flat f32 vector of
//! `n` elements, zero-padded to `W·L` with `L = ⌈n/W⌉`. Rank `r` of the `W` ranks owns the
//! slice `[r·L, (r+1)·L)` (see the trainer) and keeps, for that slice only, the f32 master
//! weights and the f32 moments `m`, `v` (on the host, updated with rayon, or on the
//! device with [`DeviceAdamW`]). One step:
//! `m ← β1·m + (1−β1)·g`, `v ← β2·v + (1−β2)·g²`,
//! `w ← w − lr·( m/(1−β1^t) / (√(v/(1−β2^t)) + ε) + wd·w )` (wd only where `decay` is set).
//! Defaults follow EasyContext: β 0.9/0.95, ε 1e-8, weight decay 0.1.

use rayon::prelude::*;
use serde::{Deserialize, Serialize};

#[derive(Clone, Debug, Serialize, Deserialize, PartialEq)]
#[serde(deny_unknown_fields)]
pub struct AdamWConfig {
    #[serde(default = "d_beta1")]
    pub beta1: f64,
    #[serde(default = "d_beta2")]
    pub beta2: f64,
    #[serde(default = "d_eps")]
    pub eps: f64,
    #[serde(default = "d_wd")]
    pub weight_decay: f64,
}
fn d_beta1() -> f64 {
    0.9
}
fn d_beta2() -> f64 {
    0.95
}
fn d_eps() -> f64 {
    1e-8
}
fn d_wd() -> f64 {
    0.1
}
impl Default for AdamWConfig {
    fn default() -> Self {
        Self { beta1: d_beta1(), beta2: d_beta2(), eps: d_eps(), weight_decay: d_wd() }
    }
}

/// Optimizer state of one shard: master weights and moments, all f32, on the host.
#[derive(Clone, Debug)]
pub struct AdamW {
    pub cfg: AdamWConfig,
    /// Steps taken so far (bias correction uses `step` after increment).
    pub step: u64,
    pub master: Vec<f32>, // [hi - lo]
    pub m: Vec<f32>,      // [hi - lo]
    pub v: Vec<f32>,      // [hi - lo]
    /// Whether weight decay applies (2-D weight matrices yes; norms, biases no), as runs:
    /// `(start, decay)` sorted by start, the first at 0; a run lasts until the next one
    /// (a few hundred runs for a model, not one flag per element).
    pub decay: Vec<(usize, bool)>,
}

impl AdamW {
    /// Start from the current weights of this shard, with a flag per element.
    pub fn new(cfg: AdamWConfig, master: Vec<f32>, decay: Vec<bool>) -> Self {
        assert_eq!(decay.len(), master.len(), "one decay flag per element");
        Self::with_runs(cfg, master, Segment::runs(&decay).into_iter().map(|s| (s.start, s.decay)).collect())
    }

    /// Start from the current weights of this shard, with the decay runs (see [`AdamW::decay`]).
    pub fn with_runs(cfg: AdamWConfig, master: Vec<f32>, decay: Vec<(usize, bool)>) -> Self {
        let n = master.len();
        Self { cfg, step: 0, master, m: vec![0.0; n], v: vec![0.0; n], decay }
    }

    /// One AdamW update of the shard with gradient `grad` (already averaged and clipped).
    pub fn update(&mut self, grad: &[f32], lr: f64) {
        self.update_into::<f32>(grad, 1.0, lr, None);
    }

    /// One AdamW update with gradient `gscale · grad` (`gscale`: the clip factor, applied
    /// as an f32 product first, as the device kernel does), in one parallel pass that
    /// also writes the new weights rounded to `P` into `copy` (the model-dtype weights the
    /// GPU receives): no scaled gradient copy, no f32 master copy, no separate
    /// conversion pass over the shard.
    pub fn update_into<P: HostElem>(&mut self, grad: &[f32], gscale: f32, lr: f64, copy: Option<&mut [P]>) {
        assert_eq!(grad.len(), self.master.len(), "gradient shard length");
        let k = self.begin_step(lr, gscale);
        self.apply_range(&k, 0, grad, copy);
    }

    /// Count one step and give the scalars of its update (learning rate `lr`, gradient
    /// factor `gscale`); [`AdamW::apply_range`] then updates the shard piece by piece.
    pub fn begin_step(&mut self, lr: f64, gscale: f32) -> StepConsts {
        self.step += 1;
        let c = &self.cfg;
        let mut k = longctx_kernels::AdamWScalars::new(&longctx_kernels::AdamWStep {
            lr,
            beta1: c.beta1,
            beta2: c.beta2,
            eps: c.eps,
            weight_decay: c.weight_decay,
            step: self.step,
            grad_scale: 1.0,
        });
        k.gscale = gscale; // already an f32 product factor (as the device kernel gets it)
        k
    }

    /// The update of elements `[lo, lo + grad.len())` of the shard (see
    /// [`AdamW::update_into`]), for a step begun with [`AdamW::begin_step`]. Returns
    /// whether every new weight written to `copy` is finite (true without a copy): the
    /// numeric guard of an update whose weights never leave host memory, checked in the
    /// same pass rather than by reading them again.
    pub fn apply_range<P: HostElem>(&mut self, k: &StepConsts, lo: usize, grad: &[f32], copy: Option<&mut [P]>) -> bool {
        let n = grad.len();
        assert!(lo + n <= self.master.len(), "gradient piece past the shard");
        const CHUNK: usize = 1 << 14;
        let runs = &self.decay;
        // Per chunk, the spans of equal decay (runs last a whole parameter), each updated
        // by a branch-free loop over zipped slices that vectorises; the same f32 operations
        // in the same order as the device kernel (a span without decay skips `w − 0`,
        // which leaves every w as it is, −0 and NaN included). The new weights are then
        // rounded to `P` and checked finite in one more vectorised pass over the chunk,
        // still in cache.
        let body = |c: usize, w: &mut [f32], m: &mut [f32], v: &mut [f32], g: &[f32], out: Option<&mut [P]>| -> bool {
            let a = lo + c * CHUNK;
            for_decay_spans(runs, a, a + w.len(), |x, y, decay| {
                let (i, j) = (x - a, y - a);
                adamw_span(k, decay, &mut w[i..j], &mut m[i..j], &mut v[i..j], &g[i..j]);
            });
            out.is_none_or(|o| P::convert(o, w))
        };
        let state = self.master[lo..lo + n]
            .par_chunks_mut(CHUNK)
            .zip(self.m[lo..lo + n].par_chunks_mut(CHUNK))
            .zip(self.v[lo..lo + n].par_chunks_mut(CHUNK))
            .zip(grad.par_chunks(CHUNK))
            .enumerate();
        match copy {
            Some(out) => {
                assert_eq!(out.len(), n, "weight copy length");
                state
                    .zip(out.par_chunks_mut(CHUNK))
                    .map(|((c, (((w, m), v), g)), o)| body(c, w, m, v, g, Some(o)))
                    .reduce(|| true, |a, b| a && b)
            }
            None => {
                state.for_each(|(c, (((w, m), v), g))| {
                    body(c, w, m, v, g, None);
                });
                true
            }
        }
    }
}

/// The scalars of one AdamW step ([`AdamW::begin_step`]), shared with the device kernel.
pub type StepConsts = longctx_kernels::AdamWScalars;

/// One AdamW update of a span of equal decay (see [`AdamW::apply_range`]).
#[inline(always)]
fn adamw_span(k: &StepConsts, decay: bool, w: &mut [f32], m: &mut [f32], v: &mut [f32], g: &[f32]) {
    let StepConsts { b1, b2, step_size, bc2_sqrt, eps, wd_lr, gscale } = *k;
    let (w, m, v) = (&mut w[..g.len()], &mut m[..g.len()], &mut v[..g.len()]);
    let one = |w: &mut f32, m: &mut f32, v: &mut f32, g: f32, decay: bool| {
        let gi = g * gscale;
        *m = b1 * *m + (1.0 - b1) * gi;
        *v = b2 * *v + (1.0 - b2) * gi * gi;
        let denom = v.sqrt() / bc2_sqrt + eps;
        if decay {
            *w -= wd_lr * *w;
        }
        *w -= step_size * *m / denom;
    };
    // Two loops, so that neither carries a per-element branch.
    if decay {
        for (((w, m), v), &g) in w.iter_mut().zip(m.iter_mut()).zip(v.iter_mut()).zip(g) {
            one(w, m, v, g, true);
        }
    } else {
        for (((w, m), v), &g) in w.iter_mut().zip(m.iter_mut()).zip(v.iter_mut()).zip(g) {
            one(w, m, v, g, false);
        }
    }
}

/// Calls `f(x, y, decay)` for the spans `[x, y)` of equal decay that tile `[a, b)`, from
/// the runs of [`AdamW::decay`] (an element belongs to the last run starting at or before
/// it; before the first run it does not decay).
fn for_decay_spans(runs: &[(usize, bool)], a: usize, b: usize, mut f: impl FnMut(usize, usize, bool)) {
    let mut x = a;
    let mut r = runs.partition_point(|&(st, _)| st <= x); // runs starting at or before x
    while x < b {
        let decay = r > 0 && runs[r - 1].1;
        let y = runs.get(r).map_or(b, |&(st, _)| st.min(b));
        f(x, y, decay);
        x = y;
        while r < runs.len() && runs[r].0 <= x {
            r += 1;
        }
    }
}

/// A model dtype the host optimizer writes its new weights in (round to nearest even,
/// as Candle's `to_dtype` and the device kernel do).
pub trait HostElem: Copy + Send + Sync + candle_core::WithDType {
    fn from_f32(x: f32) -> Self;
    /// `out[i] = from_f32(src[i])`; whether every converted value is finite.
    fn convert(out: &mut [Self], src: &[f32]) -> bool {
        let mut finite = true;
        for (o, &x) in out.iter_mut().zip(src) {
            *o = Self::from_f32(x);
            finite &= o.to_f64().is_finite();
        }
        finite
    }
}
impl HostElem for f32 {
    fn from_f32(x: f32) -> Self {
        x
    }
    fn convert(out: &mut [Self], src: &[f32]) -> bool {
        let mut finite = true;
        for (o, &x) in out.iter_mut().zip(src) {
            *o = x;
            finite &= x.is_finite();
        }
        finite
    }
}
impl HostElem for half::bf16 {
    fn from_f32(x: f32) -> Self {
        half::bf16::from_f32(x)
    }
    /// Branch-free (it vectorises), bit for bit `half::bf16::from_f32`: round to nearest
    /// even; a NaN keeps its sign and top mantissa bits with the quiet bit set.
    fn convert(out: &mut [Self], src: &[f32]) -> bool {
        let mut bad = 0u16;
        for (o, &x) in out.iter_mut().zip(src) {
            let b = x.to_bits();
            let rounded = (b.wrapping_add(0x7FFF + ((b >> 16) & 1)) >> 16) as u16;
            let nan = ((b >> 16) | 0x0040) as u16;
            let h = if b & 0x7FFF_FFFF > 0x7F80_0000 { nan } else { rounded };
            *o = half::bf16::from_bits(h);
            bad |= u16::from(h & 0x7F80 == 0x7F80); // exponent all ones: inf or NaN
        }
        bad == 0
    }
}
impl HostElem for half::f16 {
    fn from_f32(x: f32) -> Self {
        half::f16::from_f32(x)
    }
}

/// The same AdamW on the device: the fused kernel (`longctx_kernels::adamw_step`) over
/// the flat f32 shard, in place, one launch per [`Segment`] (a parameter's part of the
/// shard: its weight-decay flag and where its new model-dtype weights go). Used on GPUs
/// unless `train.optimizer_on_host`; on the CPU its twin computes exactly
/// [`AdamW::update`]. No host round trip of gradients and weights, no per-element decay
/// mask. Its state is copied to/from [`AdamW`] for checkpoints.
pub struct DeviceAdamW {
    pub master: candle_core::Tensor, // [shard] f32, updated in place
    pub m: candle_core::Tensor,      // [shard] f32, updated in place
    pub v: candle_core::Tensor,      // [shard] f32, updated in place
}

/// A range `[start, start + len)` of the shard updated by one kernel launch.
#[derive(Clone, Debug)]
pub struct Segment {
    pub start: usize,
    pub len: usize,
    /// Weight decay applies (2-D weights).
    pub decay: bool,
    /// Receives the new weights rounded to its dtype (`[len]`, contiguous; a view of the
    /// model's weight or of the shard's all-gather buffer).
    pub copy: Option<candle_core::Tensor>,
}

impl Segment {
    /// Maximal runs of equal `decay` over a whole shard, without copies.
    pub fn runs(decay: &[bool]) -> Vec<Segment> {
        let mut out: Vec<Segment> = Vec::new();
        for (i, &d) in decay.iter().enumerate() {
            match out.last_mut() {
                Some(s) if s.decay == d => s.len += 1,
                _ => out.push(Segment { start: i, len: 1, decay: d, copy: None }),
            }
        }
        out
    }
}

impl DeviceAdamW {
    /// Upload a host optimizer's state to `device`.
    pub fn from_host(h: &AdamW, device: &candle_core::Device) -> candle_core::Result<Self> {
        Self::from_host_prefix(h, h.master.len(), device)
    }

    /// Upload the first `len` elements of a host optimizer's state to `device` (the part
    /// of a split state that lives there; the host keeps the rest).
    pub fn from_host_prefix(h: &AdamW, len: usize, device: &candle_core::Device) -> candle_core::Result<Self> {
        use candle_core::Tensor;
        if len > h.master.len() {
            candle_core::bail!("device optimizer of {len} elements over a host state of {}", h.master.len());
        }
        let up = |x: &[f32]| Tensor::from_slice(&x[..len], len, device);
        Ok(Self { master: up(&h.master)?, m: up(&h.m)?, v: up(&h.v)? })
    }

    /// Elements of the state held here.
    pub fn elems(&self) -> usize {
        self.master.elem_count()
    }

    /// Copy the state back into `h` (for a checkpoint): the whole vectors when this holds
    /// all of it (`h`'s may have been released), else the first [`Self::elems`] elements.
    pub fn to_host(&self, h: &mut AdamW) -> candle_core::Result<()> {
        let n = self.elems();
        if h.master.len() <= n {
            h.master = self.master.to_vec1()?;
            h.m = self.m.to_vec1()?;
            h.v = self.v.to_vec1()?;
        } else {
            h.master[..n].copy_from_slice(&self.master.to_vec1::<f32>()?);
            h.m[..n].copy_from_slice(&self.m.to_vec1::<f32>()?);
            h.v[..n].copy_from_slice(&self.v.to_vec1::<f32>()?);
        }
        Ok(())
    }

    /// One update of `segments` with `grad [shard] · grad_scale` (the clip factor, 1 for
    /// none), step number `step` (after increment; the caller counts it in the host
    /// state's `step`, shared by a split state's two parts). `grad` covers at least the
    /// segments. Elements outside every segment (the padding) are left as they are, as a
    /// zero gradient would.
    pub fn update_at(
        &mut self,
        c: &AdamWConfig,
        step: u64,
        grad: &candle_core::Tensor,
        lr: f64,
        grad_scale: f64,
        segments: &[Segment],
    ) -> candle_core::Result<()> {
        let grad = grad.contiguous()?;
        for s in segments {
            if s.start + s.len > self.elems() {
                candle_core::bail!("optimizer segment [{}, {}) past the {} elements on the device", s.start, s.start + s.len, self.elems());
            }
            let hp = longctx_kernels::AdamWStep {
                lr,
                beta1: c.beta1,
                beta2: c.beta2,
                eps: c.eps,
                weight_decay: if s.decay { c.weight_decay } else { 0.0 },
                step,
                grad_scale,
            };
            let part = |t: &candle_core::Tensor| t.narrow(0, s.start, s.len);
            let (w, g, m, v) = (part(&self.master)?, part(&grad)?, part(&self.m)?, part(&self.v)?);
            longctx_kernels::adamw_step(&w, &g, &m, &v, None, &hp, s.copy.as_ref())?;
        }
        Ok(())
    }
}

/// Learning-rate schedule. The first three are longctx's own (EasyContext's); the last
/// three are DeepSpeed's schedulers of the same names, step for step
/// (`deepspeed/runtime/lr_schedules.py`), as a DeepSpeed JSON's `scheduler` selects them.
#[derive(Clone, Copy, Debug, Serialize, Deserialize, PartialEq, Eq, Default)]
#[serde(rename_all = "snake_case")]
pub enum Schedule {
    /// Linear warmup over `warmup_steps` (none when 0), then constant: EasyContext's
    /// `get_constant_schedule_with_warmup`.
    #[default]
    Constant,
    /// The same: linear warmup then constant (the name of the warmup's shape, kept for the
    /// configs that use it).
    Linear,
    /// Linear warmup then cosine decay to `min_lr_ratio · lr` at the last step.
    Cosine,
    /// DeepSpeed's `WarmupLR`: from `warmup_min_ratio · lr` to `lr` over the warm-up (log or
    /// linear), then constant.
    WarmupLr,
    /// DeepSpeed's `WarmupDecayLR`: the same warm-up, then linear decay back to
    /// `warmup_min_ratio · lr` at `total_steps`.
    WarmupDecayLr,
    /// DeepSpeed's `WarmupCosineLR`: the same warm-up, then cosine decay to
    /// `min_lr_ratio · lr` at `total_steps`.
    WarmupCosineLr,
}

impl Schedule {
    /// The name a config spells it with (`lr_schedule = "..."`).
    pub fn name(self) -> &'static str {
        match self {
            Schedule::Constant => "constant",
            Schedule::Linear => "linear",
            Schedule::Cosine => "cosine",
            Schedule::WarmupLr => "warmup_lr",
            Schedule::WarmupDecayLr => "warmup_decay_lr",
            Schedule::WarmupCosineLr => "warmup_cosine_lr",
        }
    }

    /// The schedule a config or flag names (see [`Schedule::name`]).
    pub fn from_name(name: &str) -> Option<Self> {
        [Self::Constant, Self::Linear, Self::Cosine, Self::WarmupLr, Self::WarmupDecayLr, Self::WarmupCosineLr]
            .into_iter()
            .find(|s| s.name() == name)
    }

    /// One of DeepSpeed's schedules (`warmup_type` applies, and DeepSpeed's step count).
    pub fn is_deepspeed(self) -> bool {
        matches!(self, Schedule::WarmupLr | Schedule::WarmupDecayLr | Schedule::WarmupCosineLr)
    }

    /// The warm-up shape when the config names none: DeepSpeed's default is log.
    pub fn default_warmup_type(self) -> WarmupType {
        if self.is_deepspeed() {
            WarmupType::Log
        } else {
            WarmupType::Linear
        }
    }
}

/// How DeepSpeed's schedules warm up (their `warmup_type`): at iteration `i` of `w`, the
/// fraction `ln(i + 1) / ln(w)` (log) or `i / w` (linear) of the way up.
#[derive(Clone, Copy, Debug, Serialize, Deserialize, PartialEq, Eq)]
#[serde(rename_all = "snake_case")]
pub enum WarmupType {
    Log,
    Linear,
}

/// A stage's learning-rate schedule: everything [`LrSchedule::lr`] needs besides the step
/// (see `TrainSection::lr_schedule_for`).
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct LrSchedule {
    pub schedule: Schedule,
    /// The peak rate.
    pub base: f64,
    pub warmup_steps: u64,
    pub warmup_type: WarmupType,
    /// Where the warm-up starts, as a fraction of `base`.
    pub warmup_min_ratio: f64,
    /// Where the cosine decay ends, as a fraction of `base`.
    pub min_lr_ratio: f64,
    /// The step at which the decay ends (counted from the stage's start).
    pub total_steps: u64,
}

impl LrSchedule {
    /// Learning rate of optimizer step `step` (0-based, counted from the stage's start).
    pub fn lr(&self, step: u64) -> f64 {
        if self.schedule.is_deepspeed() {
            return self.deepspeed_lr(step);
        }
        let (w, s0) = (self.warmup_steps, self.warmup_min_ratio);
        let warm = if w > 0 && step < w { s0 + (1.0 - s0) * (step + 1) as f64 / w as f64 } else { 1.0 };
        if self.schedule != Schedule::Cosine || step < w {
            return self.base * warm;
        }
        let span = self.total_steps.saturating_sub(w).max(1) as f64;
        let t = ((step - w) as f64 / span).min(1.0);
        let cos = 0.5 * (1.0 + (std::f64::consts::PI * t).cos());
        self.base * (self.min_lr_ratio + (1.0 - self.min_lr_ratio) * cos)
    }

    /// DeepSpeed's rate for optimizer step `step`. DeepSpeed's engine steps the scheduler
    /// after each optimizer step, so step k runs at the rate of the scheduler's iteration
    /// k − 1; step 0 at the rate it set when built (`warmup_min_lr` for WarmupLR and
    /// WarmupDecayLR, 0 for WarmupCosineLR). The warm-up spans at least 2 iterations.
    /// Past `total_steps` the decay stays at its end (DeepSpeed's clamp).
    fn deepspeed_lr(&self, step: u64) -> f64 {
        let s0 = self.warmup_min_ratio;
        let Some(i) = step.checked_sub(1) else {
            return if self.schedule == Schedule::WarmupCosineLr { 0.0 } else { self.base * s0 };
        };
        let w = self.warmup_steps.max(2);
        if i < w {
            let up = match self.warmup_type {
                WarmupType::Log => ((i + 1) as f64).ln() / (w as f64).ln(),
                WarmupType::Linear => i as f64 / w as f64,
            };
            return self.base * (s0 + (1.0 - s0) * up);
        }
        let (i, w, total) = (i as f64, w as f64, self.total_steps as f64);
        let span = (total - w).max(1.0);
        match self.schedule {
            Schedule::WarmupDecayLr => self.base * (s0 + (1.0 - s0) * ((total - i) / span).max(0.0)),
            Schedule::WarmupCosineLr => {
                let progress = ((i - w + 1.0) / span).min(1.0);
                let f = self.min_lr_ratio;
                self.base * (f + (1.0 - f) * 0.5 * (1.0 + (std::f64::consts::PI * progress).cos())).max(0.0)
            }
            _ => self.base,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The spans tile the range in order and carry each element's decay as the per-element
    /// rule gives it (the last run starting at or before it; none before the first run),
    /// with runs that start late, share a start, or are empty.
    #[test]
    fn decay_spans_tile_the_range_with_each_elements_flag() {
        let runs = [(3usize, true), (3, false), (7, true), (7, true), (8, false), (20, true)];
        let flag = |i: usize| runs.iter().rev().find(|&&(st, _)| st <= i).is_some_and(|&(_, d)| d);
        for a in 0..25 {
            for b in a..26 {
                let mut at = a;
                for_decay_spans(&runs, a, b, |x, y, d| {
                    assert!(x == at && y > x && y <= b, "[{a}, {b}): span [{x}, {y}) after {at}");
                    assert!((x..y).all(|i| flag(i) == d), "[{a}, {b}): span [{x}, {y}) decay {d}");
                    at = y;
                });
                assert_eq!(at, b, "[{a}, {b}) not covered");
            }
        }
        for_decay_spans(&[], 0, 5, |x, y, d| assert_eq!((x, y, d), (0, 5, false)));
    }

    /// The vectorised bf16 rounding equals `half::bf16::from_f32` bit for bit (ties to
    /// even, overflow to infinity, NaN payloads, signed zeros, subnormals, a sweep of bit
    /// patterns), and reports a non-finite result exactly when there is one.
    #[test]
    fn bf16_conversion_equals_half_and_flags_non_finite_values() {
        let mut xs: Vec<f32> = vec![0.0, -0.0, 1.0, -1.0, f32::MAX, f32::MIN, f32::INFINITY, f32::NEG_INFINITY, f32::NAN, -f32::NAN];
        xs.extend(
            [0x3F80_8000u32, 0x3F81_8000, 0x7F7F_8000, 0x7F7F_7FFF, 0xFF7F_8000, 0x0000_8000, 0x0001_8000, 0x7FC1_2345, 0xFF80_0001]
                .map(f32::from_bits),
        );
        xs.extend((0..u32::MAX / 65_521).map(|i| f32::from_bits(i.wrapping_mul(65_521))));
        let mut out = vec![half::bf16::ZERO; xs.len()];
        let all_finite = <half::bf16 as HostElem>::convert(&mut out, &xs);
        for (x, o) in xs.iter().zip(&out) {
            assert_eq!(o.to_bits(), half::bf16::from_f32(*x).to_bits(), "{x:e} ({:#010x})", x.to_bits());
        }
        assert!(!all_finite);
        for x in [1.5f32, -2.0, f32::MAX, 0x7F7F_7FFF_u32 as f32] {
            let mut one = [half::bf16::ZERO];
            let finite = <half::bf16 as HostElem>::convert(&mut one, &[x]);
            assert_eq!(finite, half::bf16::from_f32(x).is_finite(), "{x:e}");
        }
    }

    /// The fused device update (its CPU twin here) equals the host update bit for bit,
    /// with the clip factor applied inside.
    #[test]
    fn device_update_equals_host_update() {
        let cfg = AdamWConfig::default();
        let n = 1000;
        let w0: Vec<f32> = (0..n).map(|i| ((i * 37 % 101) as f32 - 50.0) / 25.0).collect();
        let decay: Vec<bool> = (0..n).map(|i| i % 3 != 0).collect();
        let mut host = AdamW::new(cfg.clone(), w0.clone(), decay.clone());
        let mut twin = AdamW::new(cfg, w0, decay.clone());
        let mut dev = DeviceAdamW::from_host(&twin, &candle_core::Device::Cpu).unwrap();
        let segs = Segment::runs(&decay);
        for t in 1..=4 {
            let g: Vec<f32> = (0..n).map(|i| ((i * 13 + t * 7) % 29) as f32 / 10.0 - 1.4).collect();
            let coef = 0.5f64;
            host.update(&g.iter().map(|x| x * coef as f32).collect::<Vec<_>>(), 1e-3);
            let gt = candle_core::Tensor::from_slice(&g, n, &candle_core::Device::Cpu).unwrap();
            twin.step += 1;
            dev.update_at(&twin.cfg, twin.step, &gt, 1e-3, coef, &segs).unwrap();
        }
        dev.to_host(&mut twin).unwrap();
        assert_eq!(host.step, twin.step);
        assert_eq!(host.master, twin.master, "master");
        assert_eq!(host.m, twin.m, "m");
        assert_eq!(host.v, twin.v, "v");
    }

    /// The fused host pass (clip factor inside, bf16 weights written in the same pass)
    /// equals scaling the gradient first, updating, then rounding the masters to bf16 as
    /// Candle's `to_dtype` does: bit for bit, over several chunks of the parallel loop.
    #[test]
    fn fused_host_update_equals_the_separate_passes() {
        let n = 40_000;
        let w0: Vec<f32> = (0..n).map(|i| ((i * 37 % 101) as f32 - 50.0) / 25.0).collect();
        let decay: Vec<bool> = (0..n).map(|i| i % 5 != 0).collect();
        let mut fused = AdamW::new(AdamWConfig::default(), w0.clone(), decay.clone());
        let mut plain = AdamW::new(AdamWConfig::default(), w0, decay);
        let mut out = vec![half::bf16::ZERO; n];
        for t in 1..=3 {
            let g: Vec<f32> = (0..n).map(|i| ((i * 13 + t * 7) % 29) as f32 / 10.0 - 1.4).collect();
            fused.update_into(&g, 0.25, 1e-3, Some(&mut out));
            plain.update(&g.iter().map(|x| x * 0.25f32).collect::<Vec<_>>(), 1e-3);
        }
        assert_eq!(fused.master, plain.master);
        assert_eq!((&fused.m, &fused.v), (&plain.m, &plain.v));
        let want = candle_core::Tensor::from_slice(&plain.master, n, &candle_core::Device::Cpu)
            .unwrap()
            .to_dtype(candle_core::DType::BF16)
            .unwrap()
            .to_vec1::<half::bf16>()
            .unwrap();
        assert!(out.iter().zip(&want).all(|(a, b)| a.to_bits() == b.to_bits()), "bf16 copy differs from to_dtype");
    }

    /// Against a scalar f64 transcription of the formula for a few steps.
    #[test]
    #[allow(clippy::needless_range_loop)] // the reference reads like the formula
    fn adamw_matches_scalar_reference() {
        let cfg = AdamWConfig::default();
        let w0 = [0.5f32, -1.0, 2.0];
        let mut opt = AdamW::new(cfg.clone(), w0.to_vec(), vec![true, false, true]);
        let (mut w, mut m, mut v) = ([0.5f64, -1.0, 2.0], [0f64; 3], [0f64; 3]);
        for t in 1..=5u64 {
            let g = [0.1 * t as f64, -0.3, 0.02];
            let lr = 1e-2;
            opt.update(&g.map(|x| x as f32), lr);
            for i in 0..3 {
                m[i] = cfg.beta1 * m[i] + (1.0 - cfg.beta1) * g[i];
                v[i] = cfg.beta2 * v[i] + (1.0 - cfg.beta2) * g[i] * g[i];
                let mh = m[i] / (1.0 - cfg.beta1.powi(t as i32));
                let vh = v[i] / (1.0 - cfg.beta2.powi(t as i32));
                if i != 1 {
                    w[i] -= lr * cfg.weight_decay * w[i];
                }
                w[i] -= lr * mh / (vh.sqrt() + cfg.eps);
            }
        }
        for i in 0..3 {
            assert!((opt.master[i] as f64 - w[i]).abs() < 1e-6, "{i}: {} vs {}", opt.master[i], w[i]);
        }
    }

    #[test]
    fn schedules() {
        let at = |schedule, step, total, warmup, min_lr_ratio| {
            let s = LrSchedule {
                schedule,
                base: 1.0,
                warmup_steps: warmup,
                warmup_type: WarmupType::Linear,
                warmup_min_ratio: 0.0,
                min_lr_ratio,
                total_steps: total,
            };
            s.lr(step)
        };
        // Every schedule warms up (constant: EasyContext's constant-with-warmup).
        assert!((at(Schedule::Constant, 0, 10, 5, 0.0) - 0.2).abs() < 1e-12);
        assert_eq!(at(Schedule::Constant, 5, 10, 5, 0.0), 1.0);
        assert_eq!(at(Schedule::Constant, 0, 10, 0, 0.0), 1.0);
        assert!((at(Schedule::Linear, 0, 10, 4, 0.0) - 0.25).abs() < 1e-12);
        assert!((at(Schedule::Cosine, 4, 10, 4, 0.0) - 1.0).abs() < 1e-12);
        assert!((at(Schedule::Cosine, 10, 10, 4, 0.1) - 0.1).abs() < 1e-12);
    }

    /// A warm-up start above 0 lifts longctx's own linear warm-up: from
    /// `s0 + (1 − s0)/w` at step 0 to 1 at step w − 1.
    #[test]
    fn own_warmup_starts_at_its_ratio() {
        let s = LrSchedule {
            schedule: Schedule::Cosine,
            base: 2.0,
            warmup_steps: 4,
            warmup_type: WarmupType::Linear,
            warmup_min_ratio: 0.2,
            min_lr_ratio: 0.0,
            total_steps: 8,
        };
        assert!((s.lr(0) - 2.0 * (0.2 + 0.8 * 0.25)).abs() < 1e-12);
        assert!((s.lr(3) - 2.0).abs() < 1e-12);
        assert!(s.lr(8).abs() < 1e-12);
    }
}
