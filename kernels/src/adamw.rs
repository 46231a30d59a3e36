//! AdamW over a flat f32 parameter shard in one pass, in place: the math and the f32
//! operation order of `src/train/optim.rs` (`AdamW::update`), so the CPU twin and the CUDA
//! kernel give the host optimizer's numbers bit for bit. Decoupled weight decay as
//! PyTorch's AdamW: `w ← w − lr·wd·w` before the Adam step, only where `decay` is set.
//!
//! One step `t` (1 after the first update), with `g ← grad·grad_scale` (the clip factor):
//! `m ← β1·m + (1−β1)·g`, `v ← β2·v + (1−β2)·g²`,
//! `w ← w − lr·( m/(1−β1^t) / (√(v/(1−β2^t)) + ε) + wd·w )`, evaluated as optim.rs does:
//! `denom = √v/√(1−β2^t) + ε`, `w −= (lr·wd)·w`, `w −= (lr/(1−β1^t))·m/denom`.
//!
//! Shapes: `n` elements of the shard. `params`, `grads`, `m`, `v`: `[n]` f32 (contiguous;
//! `params`, `m`, `v` updated); `decay`: `[n]` u8 (nonzero = decay; absent = everywhere);
//! `param_copy`: `[n]` (bf16, f16 or f32), receives the new weights rounded to its dtype
//! (the model-dtype write-back of ZeRO's step 4).

use crate::common::*;
use crate::multi::{with_storages_mut, MutStorage};
use candle_core::backend::BackendStorage;
use candle_core::{bail, DType, Result, Tensor};
use rayon::prelude::*;

const OP: &str = "adamw_step";

/// Hyper-parameters of one AdamW step.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct AdamWStep {
    pub lr: f64,
    pub beta1: f64,
    pub beta2: f64,
    pub eps: f64,
    pub weight_decay: f64,
    /// The step number after increment (1 on the first update): bias correction uses it.
    pub step: u64,
    /// Multiplies the gradient first (gradient clipping); 1 for none.
    pub grad_scale: f64,
}

/// The f32 scalars of one step, derived once in f64 and rounded: what this kernel, its CPU
/// twin and the trainer's host AdamW (`longctx::train::optim`) all use, so the three agree
/// bit for bit.
#[derive(Clone, Copy, Debug)]
pub struct Scalars {
    pub b1: f32,
    pub b2: f32,
    /// `lr / (1 − β1^t)`.
    pub step_size: f32,
    /// `√(1 − β2^t)`.
    pub bc2_sqrt: f32,
    pub eps: f32,
    /// `lr · weight_decay`.
    pub wd_lr: f32,
    /// The gradient's factor (clipping).
    pub gscale: f32,
}

impl Scalars {
    pub fn new(hp: &AdamWStep) -> Self {
        let bc1 = 1.0 - hp.beta1.powi(hp.step as i32);
        let bc2 = 1.0 - hp.beta2.powi(hp.step as i32);
        Scalars {
            b1: hp.beta1 as f32,
            b2: hp.beta2 as f32,
            step_size: (hp.lr / bc1) as f32,
            bc2_sqrt: bc2.sqrt() as f32,
            eps: hp.eps as f32,
            wd_lr: (hp.lr * hp.weight_decay) as f32,
            gscale: hp.grad_scale as f32,
        }
    }
}

/// One AdamW step over the shard, in place on `params`, `m`, `v` (and `param_copy`).
/// `params [n]`, `grads [n]`, `m [n]`, `v [n]` f32; `decay [n]` u8 (optional);
/// `param_copy [n]` bf16/f16/f32 (optional). All contiguous, on one device.
pub fn adamw_step(
    params: &Tensor,
    grads: &Tensor,
    m: &Tensor,
    v: &Tensor,
    decay: Option<&Tensor>,
    hp: &AdamWStep,
    param_copy: Option<&Tensor>,
) -> Result<()> {
    if hp.step == 0 || hp.step > i32::MAX as u64 {
        bail!("{OP}: step must be the step number after increment (1, 2, ...), got {}", hp.step);
    }
    let n = params.elem_count();
    let mut named = vec![("params", params), ("grads", grads), ("m", m), ("v", v)];
    for (name, t) in &named {
        check_dtype(OP, name, t, DType::F32)?;
    }
    if let Some(d) = decay {
        check_dtype(OP, "decay", d, DType::U8)?;
        named.push(("decay", d));
    }
    if let Some(c) = param_copy {
        check_float(OP, "param_copy", c)?;
        named.push(("param_copy", c));
    }
    for (name, t) in &named {
        if t.elem_count() != n || t.rank() != 1 {
            bail!("{OP}: `{name}` must be a flat [{n}] tensor like params, got shape {:?}", t.dims());
        }
        check_contiguous(OP, name, t)?;
        check_device(OP, name, t, params)?;
    }
    let sc = Scalars::new(hp);
    let mut dsts = vec![("params", params), ("m", m), ("v", v)];
    if let Some(c) = param_copy {
        dsts.push(("param_copy", c));
    }
    let mut reads = vec![("grads", grads)];
    if let Some(d) = decay {
        reads.push(("decay", d));
    }
    with_storages_mut(OP, &dsts, &reads, |st| {
        let (w, rest) = st.split_first_mut().expect("params");
        let (m, rest) = rest.split_first_mut().expect("m");
        let (v, rest) = rest.split_first_mut().expect("v");
        let copy = rest.first_mut();
        match (&mut w.0, &mut m.0, &mut v.0) {
            (MutStorage::Cpu(ws), MutStorage::Cpu(ms), MutStorage::Cpu(vs)) => {
                let w_ = cpu_f32_mut(OP, "params", ws, &w.1)?;
                let m_ = cpu_f32_mut(OP, "m", ms, &m.1)?;
                let v_ = cpu_f32_mut(OP, "v", vs, &v.1)?;
                with_cpu(OP, "grads", grads, |gs, gl| {
                    let g = cpu_slice::<f32>(OP, "grads", gs, gl)?;
                    let mut run = |dec: Option<&[u8]>| -> Result<()> {
                        match copy {
                            Some((MutStorage::Cpu(cs), cl)) => {
                                dispatch_float!(OP, cs.dtype(), P => {
                                    let c = cpu_slice_mut::<P>(OP, "param_copy", cs, cl)?;
                                    adamw_cpu(w_, g, m_, v_, dec, Some(c), &sc);
                                    Ok(())
                                })
                            }
                            Some(_) => bail!("{OP}: `param_copy` is not on the CPU like params"),
                            None => {
                                adamw_cpu::<f32>(w_, g, m_, v_, dec, None, &sc);
                                Ok(())
                            }
                        }
                    };
                    match decay {
                        Some(d) => with_cpu(OP, "decay", d, |ds, dl| run(Some(cpu_slice::<u8>(OP, "decay", ds, dl)?))),
                        None => run(None),
                    }
                })
            }
            #[cfg(feature = "cuda")]
            (MutStorage::Cuda(ws), MutStorage::Cuda(ms), MutStorage::Cuda(vs)) => {
                adamw_cuda(ws, &w.1, ms, &m.1, vs, &v.1, copy, grads, decay, &sc)
            }
            _ => bail!("{OP}: params, m and v must be on one device (CPU or CUDA)"),
        }
    })
}

/// The CPU twin: optim.rs's loop, plus the gradient scale and the model-dtype copy.
fn adamw_cpu<P: Elem>(w: &mut [f32], g: &[f32], m: &mut [f32], v: &mut [f32], decay: Option<&[u8]>, copy: Option<&mut [P]>, sc: &Scalars) {
    const CHUNK: usize = 1 << 14;
    let one = |i: usize, w: &mut f32, m: &mut f32, v: &mut f32| {
        let gi = g[i] * sc.gscale;
        *m = sc.b1 * *m + (1.0 - sc.b1) * gi;
        *v = sc.b2 * *v + (1.0 - sc.b2) * gi * gi;
        let denom = v.sqrt() / sc.bc2_sqrt + sc.eps;
        if decay.is_none_or(|d| d[i] != 0) {
            *w -= sc.wd_lr * *w;
        }
        *w -= sc.step_size * *m / denom;
    };
    let body = |c: usize, (w, (m, v)): (&mut [f32], (&mut [f32], &mut [f32]))| {
        for k in 0..w.len() {
            one(c * CHUNK + k, &mut w[k], &mut m[k], &mut v[k]);
        }
    };
    w.par_chunks_mut(CHUNK).zip(m.par_chunks_mut(CHUNK).zip(v.par_chunks_mut(CHUNK))).enumerate().for_each(|(c, t)| body(c, t));
    if let Some(copy) = copy {
        copy.par_iter_mut().zip(w.par_iter()).for_each(|(c, &x)| *c = P::from_f(x));
    }
}

#[cfg(feature = "cuda")]
#[allow(clippy::too_many_arguments)]
fn adamw_cuda(
    ws: &mut candle_core::CudaStorage,
    wl: &candle_core::Layout,
    ms: &mut candle_core::CudaStorage,
    ml: &candle_core::Layout,
    vs: &mut candle_core::CudaStorage,
    vl: &candle_core::Layout,
    copy: Option<&mut (MutStorage<'_>, candle_core::Layout)>,
    grads: &Tensor,
    decay: Option<&Tensor>,
    sc: &Scalars,
) -> Result<()> {
    use crate::cuda::{elementwise, launch, view, view_mut, Module, NULL};
    use candle_core::cuda::cudarc::driver::CudaView;
    let dev = ws.device().clone();
    let n = wl.shape().elem_count();
    if n == 0 {
        return Ok(());
    }
    let cfg = elementwise(&dev, n)?;
    let mut w = view_mut::<f32>(OP, "params", ws, wl)?;
    let mut m = view_mut::<f32>(OP, "m", ms, ml)?;
    let mut v = view_mut::<f32>(OP, "v", vs, vl)?;
    let Scalars { b1, b2, step_size, bc2_sqrt, eps, wd_lr, gscale } = *sc;
    with_cuda(OP, "grads", grads, |gs, gl| {
        let g = view::<f32>(OP, "grads", gs, gl)?;
        let mut run = |dec: Option<CudaView<u8>>| -> Result<()> {
            macro_rules! go {
                ($suffix:expr, $copy:expr) => {
                    match &dec {
                        Some(d) => launch!(
                            dev,
                            Module::AdamW,
                            format!("adamw_{}", $suffix),
                            cfg,
                            &mut w,
                            &g,
                            &mut m,
                            &mut v,
                            d,
                            $copy,
                            &n,
                            &b1,
                            &b2,
                            &step_size,
                            &bc2_sqrt,
                            &eps,
                            &wd_lr,
                            &gscale
                        ),
                        None => launch!(
                            dev,
                            Module::AdamW,
                            format!("adamw_{}", $suffix),
                            cfg,
                            &mut w,
                            &g,
                            &mut m,
                            &mut v,
                            &NULL,
                            $copy,
                            &n,
                            &b1,
                            &b2,
                            &step_size,
                            &bc2_sqrt,
                            &eps,
                            &wd_lr,
                            &gscale
                        ),
                    }
                };
            }
            match copy {
                Some((MutStorage::Cuda(cs), cl)) => {
                    let cs: &mut candle_core::CudaStorage = cs;
                    dispatch_float!(OP, cs.dtype(), P => {
                        let mut c = view_mut::<P>(OP, "param_copy", cs, cl)?;
                        go!(P::SUFFIX, &mut c);
                        Ok(())
                    })
                }
                Some(_) => bail!("{OP}: `param_copy` is not on the GPU like params"),
                None => {
                    go!("f32", &NULL);
                    Ok(())
                }
            }
        };
        match decay {
            Some(d) => with_cuda(OP, "decay", d, |ds, dl| run(Some(view::<u8>(OP, "decay", ds, dl)?))),
            None => run(None),
        }
    })
}
