//! The block-kernel contract, dispatched per device.
//!
//! `fwd(q [b,s,hq,d], k [b,t,hkv,d], v [b,t,hkv,d], mask, scale) -> (o [b,s,hq,d] dtype of q, lse [b,hq,s] f32)`
//! `bwd(do, Saved { q, k, v, o, lse }, mask, scale) -> (dq, dk, dv)` in the dtype of q, where
//! `o`/`lse` are the *final* (global) output and log-sum-exp: the kernel recomputes
//! `P = exp(S - lse)` and `D = rowsum(do * o)` from them, so block backwards of a
//! split attention sum to the exact gradient.
//! `Mask::Causal` is the diagonal block (s == t, query i sees keys 0..=i).
//! `Mask::Band` is a block of a sliding-window attention (see [`Mask::Band`]); it goes
//! through [`crate::band`], which trims it to the rows and keys that meet and cuts it so
//! that every kernel call has `s ≤ t` and a band both sides of the diagonal (what cuDNN
//! takes).

use candle_core::{Result, Tensor};

/// Which CUDA kernel runs the block forward and backward (`attention.kernel` in a run
/// config): cuDNN's fused attention, longctx's own Hopper kernels
/// (`attention/csrc/native_{fwd,bwd}_sm90.cu`, sm_90a), or per call whichever of the two
/// was measured faster on a block of that shape ([`CudaKernel::uses_native`]; the default).
/// A shape or GPU the native kernel does not cover runs cuDNN (said once per direction on
/// stderr when `native` was asked for by name). The CPU kernel is the same for all.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash, serde::Serialize, serde::Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum CudaKernel {
    Cudnn,
    Native,
    #[default]
    Auto,
}

/// The direction of a block call (its index in per-direction counters: `pass as usize`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Pass {
    Fwd = 0,
    Bwd = 1,
}

/// Block calls the native kernel has run in a process, per direction (`cuda::native_runs`
/// in CUDA builds; always zero elsewhere). Calls it handed to cuDNN do not count.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct NativeRuns {
    pub fwd: u64,
    pub bwd: u64,
}

impl CudaKernel {
    pub const ALL: [CudaKernel; 3] = [CudaKernel::Cudnn, CudaKernel::Native, CudaKernel::Auto];

    /// The name in configs and flags (serde's spelling too).
    pub fn name(self) -> &'static str {
        match self {
            CudaKernel::Cudnn => "cudnn",
            CudaKernel::Native => "native",
            CudaKernel::Auto => "auto",
        }
    }

    /// Every name, comma-separated, for messages.
    pub fn names() -> String {
        Self::ALL.map(Self::name).join(", ")
    }

    /// Make this the CUDA block kernel of the calls that follow in this process
    /// (`cuda::set_kernel`); builds without CUDA have only the CPU kernel and ignore it.
    pub fn select(self) {
        #[cfg(feature = "cuda")]
        crate::cuda::set_kernel(self);
    }

    /// Whether a block call of this shape goes to the native kernel first (it still hands
    /// what it does not cover to cuDNN). `s` query rows, `t` keys, head dim `d`, `causal`
    /// for the diagonal block (else no mask; a band is not covered by the native kernel).
    ///
    /// `Auto` takes the native kernel where it was faster than cuDNN 9.14 on one H200
    /// (docs/benchmarks.md, issue #36), and cuDNN where it was slower by more than the
    /// noise of about 1 % (where level, as the d 64 forward at 16K–64K, the side of the longer
    /// blocks). Causal blocks, TFLOP/s native / cuDNN from `bench attention` with the two
    /// taking turns call by call (sessions 24 and 26; earlier tables timed one kernel after
    /// the other and favoured the first); unmasked blocks (the ring's and FPDT's off the
    /// diagonal) from native_check, native / cuDNN in one process (session 27):
    /// - backward, head dim 64: native at every length and mask (8K 453 / 388, 16K 461 /
    ///   405, 64K 481 / 431; unmasked 8K × 8K 471 / 412, 16K × 16K 487 / 439, 128K × 64K
    ///   490 / 452);
    /// - backward, head dim 128: native for causal blocks from 32K (32K 536 / 527, 64K
    ///   548 / 530) and for unmasked blocks from 64K (64K × 64K 564 / 552, 128K × 64K 555 /
    ///   549, 64K × 128K 552 / 552); cuDNN below (causal 8K 459 / 477, 16K 509 / 518;
    ///   unmasked 8K × 8K 510 / 555, 16K × 8K 521 / 531, 16K × 16K 534 / 540);
    /// - forward, head dim 128: native at every length and mask (causal, session 26: 8K
    ///   576 / 567, 16K 580 / 577, 32K 606 / 594, 64K 615 / 602, 128K 612 / 559; unmasked,
    ///   session 27: 8K × 8K 665 / 647, 16K × 8K 672 / 657, 16K × 16K 620 / 677 and 682 /
    ///   613 in two visits, 64K × 64K 637 / 629, 128K × 64K 621 / 603, 64K × 128K 619 / 588);
    /// - forward, head dim 64: native for causal blocks at every length since its row sums
    ///   come from the tensor cores (session 26: 8K 450 / 439, 16K 510 / 510, 32K 494 /
    ///   494, 64K 500 / 500, 128K 514 / 499; where level, the side of the longer blocks),
    ///   and for unmasked blocks from 64K, where level (64K × 64K 528 / 524, 128K × 64K 526 /
    ///   521, 64K × 128K 525 / 521); cuDNN below (8K × 8K 476 / 517, 16K × 8K 489 / 527,
    ///   16K × 16K 519 / 537).
    ///
    /// Other head dims go to cuDNN under `Auto` (the native kernel covers 64 and 128 only).
    pub fn uses_native(self, pass: Pass, d: usize, causal: bool, s: usize, t: usize) -> bool {
        match self {
            CudaKernel::Cudnn => false,
            CudaKernel::Native => true,
            CudaKernel::Auto => {
                let len = s.min(t);
                match (pass, d) {
                    (Pass::Bwd, 128) => len >= if causal { 32 * 1024 } else { 64 * 1024 },
                    (Pass::Fwd, 64) => causal || len >= 64 * 1024,
                    (_, d) => d == 64 || d == 128,
                }
            }
        }
    }
}

impl std::str::FromStr for CudaKernel {
    type Err = String;
    fn from_str(s: &str) -> std::result::Result<Self, String> {
        Self::ALL
            .into_iter()
            .find(|k| k.name().eq_ignore_ascii_case(s))
            .ok_or_else(|| format!("unknown attention kernel `{s}`: expected one of {}", Self::names()))
    }
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Mask {
    None,
    Causal,
    /// A block of sliding-window attention: query `x` (local row) sees key `y` iff
    /// `y ≤ x + offset` and `x + offset − y < window`, where `offset` is the global index
    /// of the block's first query minus that of its first key (so globally: `j ≤ i` and
    /// `i − j < window`). `window ≥ 1`. Rows that see no key get `o = 0`, `lse = −inf`.
    Band {
        offset: usize,
        window: usize,
    },
}

impl Mask {
    /// The keys `[lo, hi)` (of `t`) that query row `x` sees; empty when `lo >= hi`.
    #[inline(always)]
    pub fn keys(self, x: usize, t: usize) -> (usize, usize) {
        match self {
            Mask::None => (0, t),
            Mask::Causal => (0, (x + 1).min(t)),
            Mask::Band { offset, window } => {
                let end = x + offset + 1;
                (end.saturating_sub(window).min(t), end.min(t))
            }
        }
    }

    /// The query rows `[lo, hi)` (of `s`) that see key `y`; empty when `lo >= hi`.
    #[inline(always)]
    pub fn queries(self, y: usize, s: usize) -> (usize, usize) {
        match self {
            Mask::None => (0, s),
            Mask::Causal => (y.min(s), s),
            Mask::Band { offset, window } => (y.saturating_sub(offset).min(s), (y + window).saturating_sub(offset).min(s)),
        }
    }
}

/// What a backward needs from its forward, borrowed: the inputs and the *final* (global)
/// output and log-sum-exp.
///
/// - `q [b, s, hq, d]`, `k`/`v [b, t, hkv, d]` (`t = s` for a mode's local tokens);
/// - `o [b, s, hq, d]` in the dtype of `q`, `lse [b, hq, s]` f32.
///
/// The upstream gradient `do` (shaped like `o`) is passed beside it. A block of a split
/// attention takes the parts it needs, e.g. `Saved { k: &k_j, v: &v_j, ..saved }`.
#[derive(Clone, Copy, Debug)]
pub struct Saved<'a> {
    pub q: &'a Tensor,
    pub k: &'a Tensor,
    pub v: &'a Tensor,
    pub o: &'a Tensor,
    pub lse: &'a Tensor,
}

impl<'a> Saved<'a> {
    pub fn new(q: &'a Tensor, k: &'a Tensor, v: &'a Tensor, o: &'a Tensor, lse: &'a Tensor) -> Self {
        Self { q, k, v, o, lse }
    }

    /// Checks that `do` and `o` are shaped like `q`; errors name `what` (the caller).
    pub fn check_do(&self, d_o: &Tensor, what: &str) -> Result<()> {
        if d_o.dims() != self.q.dims() || self.o.dims() != self.q.dims() {
            return crate::shape_err!("{what}: do {:?} and o {:?} must match q {:?}", d_o.dims(), self.o.dims(), self.q.dims());
        }
        Ok(())
    }

    /// [`check_shapes`] of `q`, `k`, `v` plus the backward's extra inputs: `do` and `o`
    /// shaped like `q`, `lse [b, hq, s]`. Returns (b, s, t, hq, hkv, d).
    pub fn check(&self, d_o: &Tensor, mask: Mask) -> Result<(usize, usize, usize, usize, usize, usize)> {
        let dims = check_shapes(self.q, self.k, self.v, mask)?;
        let (b, s, _, hq, _, _) = dims;
        self.check_do(d_o, "attention backward")?;
        if self.lse.dims() != [b, hq, s] {
            return crate::shape_err!("attention backward: lse {:?} must be [b, hq, s] = {:?}", self.lse.dims(), [b, hq, s]);
        }
        Ok(dims)
    }
}

/// Check shapes of a block call; returns (b, s, t, hq, hkv, d).
pub fn check_shapes(q: &Tensor, k: &Tensor, v: &Tensor, mask: Mask) -> Result<(usize, usize, usize, usize, usize, usize)> {
    let (b, s, hq, d) = q.dims4()?;
    let (bk, t, hkv, dk) = k.dims4()?;
    if k.dims() != v.dims() {
        return crate::shape_err!("k {:?} and v {:?} differ", k.dims(), v.dims());
    }
    if bk != b || dk != d {
        return crate::shape_err!("q {:?} and k {:?} disagree on batch or head dim", q.dims(), k.dims());
    }
    if hkv == 0 || hq % hkv != 0 {
        return crate::shape_err!("query heads {hq} not a multiple of kv heads {hkv}");
    }
    if mask == Mask::Causal && s != t {
        return crate::shape_err!("causal block needs equal q/kv lengths, got {s} vs {t}");
    }
    if let Mask::Band { window: 0, .. } = mask {
        return crate::config_err!("sliding-window block with a window of 0 keys (the window must be at least 1)");
    }
    Ok((b, s, t, hq, hkv, d))
}

/// A block of one query or one key row: what a document of one token (or a one-token
/// piece of a document cut by a chunk) gives. cuDNN refuses `s_q = s_kv = 1` ("not
/// supported", H200, cuDNN 9.14), so on the GPU such a block runs the naive kernel in f32:
/// its score matrix has at most `max(s, t)` entries per head, nothing to speed up.
fn sliver(s: usize, t: usize) -> bool {
    s.min(t) == 1
}

/// Block forward on whatever device the inputs live on (a band through [`crate::band`]).
pub fn fwd(q: &Tensor, k: &Tensor, v: &Tensor, mask: Mask, scale: f64) -> Result<(Tensor, Tensor)> {
    check_shapes(q, k, v, mask)?;
    match mask {
        Mask::Band { offset, window } => crate::band::fwd(q, k, v, offset, window, scale),
        _ => device_fwd(q, k, v, mask, scale),
    }
}

/// Block backward with the global `o` and `lse` (a band through [`crate::band`]).
pub fn bwd(d_o: &Tensor, saved: Saved<'_>, mask: Mask, scale: f64) -> Result<(Tensor, Tensor, Tensor)> {
    saved.check(d_o, mask)?;
    match mask {
        Mask::Band { offset, window } => crate::band::bwd(d_o, saved, offset, window, scale),
        _ => device_bwd(d_o, saved, mask, scale),
    }
}

/// The device's kernel for one block (a band here is one [`crate::band`] already cut).
pub(crate) fn device_fwd(q: &Tensor, k: &Tensor, v: &Tensor, mask: Mask, scale: f64) -> Result<(Tensor, Tensor)> {
    let (_, s, t, _, _, _) = check_shapes(q, k, v, mask)?;
    let _sliver = sliver(s, t); // read by the CUDA arm only
    match q.device() {
        candle_core::Device::Cpu => crate::cpu::fwd(q, k, v, mask, scale),
        #[cfg(feature = "cuda")]
        candle_core::Device::Cuda(_) if !_sliver => crate::cuda::fwd(q, k, v, mask, scale),
        _ => {
            let f = |x: &Tensor| x.to_dtype(candle_core::DType::F32);
            let (o, lse) = crate::naive::fwd(&f(q)?, &f(k)?, &f(v)?, mask, scale)?;
            Ok((o.to_dtype(q.dtype())?, lse))
        }
    }
}

/// The device's kernel backward for one block (see [`device_fwd`]).
pub(crate) fn device_bwd(d_o: &Tensor, saved: Saved<'_>, mask: Mask, scale: f64) -> Result<(Tensor, Tensor, Tensor)> {
    let (_, s, t, _, _, _) = saved.check(d_o, mask)?;
    let _sliver = sliver(s, t); // read by the CUDA arm only
    match saved.q.device() {
        candle_core::Device::Cpu => crate::cpu::bwd(d_o, saved, mask, scale),
        #[cfg(feature = "cuda")]
        candle_core::Device::Cuda(_) if !_sliver => crate::cuda::bwd(d_o, saved, mask, scale),
        _ => {
            let f = |x: &Tensor| x.to_dtype(candle_core::DType::F32);
            let Saved { q, k, v, o, lse } = saved;
            let (q32, k32, v32, o32) = (f(q)?, f(k)?, f(v)?, f(o)?);
            let (dq, dk, dv) = crate::naive::bwd(&f(d_o)?, Saved::new(&q32, &k32, &v32, &o32, lse), mask, scale)?;
            Ok((dq.to_dtype(q.dtype())?, dk.to_dtype(k.dtype())?, dv.to_dtype(v.dtype())?))
        }
    }
}

#[cfg(test)]
mod tests {
    use super::{CudaKernel, Pass};

    const K: usize = 1024;

    #[test]
    fn names_parse_back() {
        for k in CudaKernel::ALL {
            assert_eq!(k.name().parse::<CudaKernel>().unwrap(), k);
            assert_eq!(k.name().to_uppercase().parse::<CudaKernel>().unwrap(), k);
        }
        let e = "flash".parse::<CudaKernel>().unwrap_err();
        assert!(e.contains("flash") && e.contains("cudnn, native, auto"), "{e}");
        assert_eq!(CudaKernel::default(), CudaKernel::Auto);
    }

    #[test]
    fn named_kernels_ignore_the_shape() {
        for (pass, d, causal, s, t) in
            [(Pass::Fwd, 64, true, 8 * K, 8 * K), (Pass::Bwd, 128, false, 2 * K, 4 * K), (Pass::Bwd, 96, true, 64 * K, 64 * K)]
        {
            assert!(CudaKernel::Native.uses_native(pass, d, causal, s, t));
            assert!(!CudaKernel::Cudnn.uses_native(pass, d, causal, s, t));
        }
    }

    /// The shapes users run (docs/benchmarks.md): the backward native for the issue's
    /// single-GPU shapes from 64K, the forward for every causal block; cuDNN where the
    /// native kernel was measured slower.
    #[test]
    fn auto_follows_the_measured_table() {
        let auto = |pass, d, causal, s: usize, t: usize| CudaKernel::Auto.uses_native(pass, d, causal, s, t);
        for len in [64 * K, 128 * K, 512 * K] {
            for d in [64, 128] {
                assert!(auto(Pass::Bwd, d, true, len, len), "bwd d {d} causal {len}");
            }
            assert!(auto(Pass::Fwd, 128, true, len, len), "fwd d 128 causal {len}");
        }
        // head dim 128 backward: cuDNN below 32K causal and below 64K unmasked (the shorter
        // side counts)
        assert!(auto(Pass::Bwd, 128, true, 32 * K, 32 * K));
        assert!(!auto(Pass::Bwd, 128, true, 32 * K - 1, 32 * K - 1));
        assert!(!auto(Pass::Bwd, 128, true, 8 * K, 8 * K));
        assert!(auto(Pass::Bwd, 128, false, 64 * K, 64 * K) && auto(Pass::Bwd, 128, false, 128 * K, 64 * K));
        assert!(!auto(Pass::Bwd, 128, false, 32 * K, 32 * K) && !auto(Pass::Bwd, 128, false, 64 * K - 1, 128 * K));
        assert!(!auto(Pass::Bwd, 128, false, 8 * K, 16 * K));
        // head dim 64 backward: native everywhere
        for (causal, s, t) in [(true, 8 * K, 8 * K), (true, 16 * K, 16 * K), (false, 8 * K, 8 * K), (false, 16 * K, 8 * K)] {
            assert!(auto(Pass::Bwd, 64, causal, s, t));
        }
        // forward, causal blocks: native at every length and both head dims
        for len in [1, 8 * K, 16 * K, 64 * K - 1] {
            assert!(auto(Pass::Fwd, 128, true, len, len) && auto(Pass::Fwd, 64, true, len, len), "fwd causal {len}");
        }
        // head dim 128 forward, unmasked blocks: native at every length
        for (s, t) in [(1, 1), (8 * K, 8 * K), (16 * K, 8 * K), (64 * K, 128 * K)] {
            assert!(auto(Pass::Fwd, 128, false, s, t), "fwd d 128 unmasked {s} x {t}");
        }
        // head dim 64 forward, unmasked blocks: cuDNN below 64K, native from there
        assert!(!auto(Pass::Fwd, 64, false, 8 * K, 8 * K) && !auto(Pass::Fwd, 64, false, 32 * K, 128 * K));
        assert!(auto(Pass::Fwd, 64, false, 64 * K, 64 * K) && auto(Pass::Fwd, 64, false, 128 * K, 64 * K));
        // head dims the native kernel does not cover go to cuDNN
        assert!(!auto(Pass::Fwd, 96, true, 64 * K, 64 * K) && !auto(Pass::Bwd, 256, false, 8 * K, 8 * K));
    }
}
