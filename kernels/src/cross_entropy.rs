//! Cross-entropy with the logits' gradient written in place, and the chunked
//! `lm_head` + cross-entropy built on it.
//!
//! Shapes: `n` rows (tokens, any leading dims `..` flattened), `h` hidden, `V` vocabulary,
//! `c` rows per chunk. `logits`: `[.., V]` (T ∈ {bf16, f16, f32}); `targets`: `[..]` i64,
//! negative = ignore (transformers' −100); `loss`: `[..]` f32; `hidden`, `dhidden`:
//! `[.., h]` (T); `weight` (lm_head): `[V, h]` (T); `dweight`: `[V, h]` f32.
//!
//! Per row: `loss = logsumexp(x) − x[t]` (the CPU sums the exponentials in f64), and `x ← scale·(softmax(x) − onehot(t))`, the
//! gradient of `scale · Σ loss` (zero for ignored rows, whose loss is 0) — exactly what
//! autograd gives for transformers' `cross_entropy(logits.float(), targets, reduction=sum)`
//! times `scale`, rounded back to the logits' dtype.

use crate::common::*;
use candle_core::backend::BackendStorage;
use candle_core::{bail, CpuStorage, DType, InplaceOp2, Layout, Result, Tensor};
use rayon::prelude::*;

const CE: &str = "cross_entropy_inplace";
const LCE: &str = "linear_cross_entropy";

/// Loss per row of `logits [.., V]` against `targets [..]` (i64, negative = ignore);
/// overwrites `logits` with `scale · dloss/dlogits`. Returns `loss [..]` f32.
///
/// Targets ≥ V: an error on the CPU; on the GPU (no host read-back) a NaN loss and a zero
/// gradient for that row — check targets on the host first, as the engine does.
pub fn cross_entropy_inplace(logits: &Tensor, targets: &Tensor, scale: f64) -> Result<Tensor> {
    check_float(CE, "logits", logits)?;
    let v = match logits.dims().last() {
        Some(&v) if v > 0 => v,
        _ => bail!("{CE}: `logits` must have a non-empty last (vocabulary) dim, got shape {:?}", logits.dims()),
    };
    let lead = &logits.dims()[..logits.rank() - 1];
    if targets.dims() != lead {
        bail!("{CE}: `targets` must have shape {lead:?} (the logits' without the vocabulary), got {:?}", targets.dims());
    }
    check_dtype(CE, "targets", targets, DType::I64)?;
    check_contiguous(CE, "logits", logits)?;
    check_contiguous(CE, "targets", targets)?;
    if v > i32::MAX as usize {
        bail!("{CE}: vocabulary {v} too large");
    }
    let op = CeOp { v, scale: scale as f32, extras: Extras::default() };
    logits.inplace_op2(targets, &op)?;
    op.extras.take(CE, 1).map(|mut e| e.remove(0))
}

/// Outputs of [`linear_cross_entropy`].
#[derive(Debug, Clone)]
pub struct LinearCe {
    /// `[..]` f32: loss per row (0 where ignored).
    pub loss: Tensor,
    /// `[]` f32: the sum of `loss` (no host read-back).
    pub loss_sum: Tensor,
    /// `[.., h]` (T): gradient of `scale · Σ loss` with respect to `hidden`.
    pub dhidden: Tensor,
    /// `[V, h]` f32: the weight gradient, accumulated into `dweight_acc` when one is given
    /// (then this is that tensor).
    pub dweight: Tensor,
}

/// `scale · Σ cross_entropy(hidden @ weightᵀ, targets)` and its gradients, `chunk` rows at
/// a time: per chunk, the logits `[c, V]` come from one GEMM, [`cross_entropy_inplace`]
/// turns them into their gradient in the same buffer, then `dhidden = dlogits @ weight`
/// and `dweight += dlogitsᵀ @ hidden` (accumulated in f32 by the GEMM, [`crate::matmul_acc_f32`]).
/// `hidden [.., h]` (T, contiguous), `weight [V, h]` (T), `targets [..]` i64,
/// `dweight_acc [V, h]` f32 (optional; contiguous).
pub fn linear_cross_entropy(
    hidden: &Tensor,
    weight: &Tensor,
    targets: &Tensor,
    scale: f64,
    chunk: usize,
    dweight_acc: Option<&Tensor>,
) -> Result<LinearCe> {
    check_float(LCE, "hidden", hidden)?;
    let h = match hidden.dims().last() {
        Some(&h) if h > 0 => h,
        _ => bail!("{LCE}: `hidden` must have a non-empty last dim, got shape {:?}", hidden.dims()),
    };
    let (v, wh) =
        weight.dims2().map_err(|_| candle_core::Error::Msg(format!("{LCE}: `weight` must be [V, h], got {:?}", weight.dims())))?;
    if wh != h {
        bail!("{LCE}: `weight` is [{v}, {wh}] but hidden has {h} features");
    }
    check_dtype(LCE, "weight", weight, hidden.dtype())?;
    check_device(LCE, "weight", weight, hidden)?;
    check_contiguous(LCE, "hidden", hidden)?;
    check_contiguous(LCE, "weight", weight)?;
    let lead = &hidden.dims()[..hidden.rank() - 1];
    if targets.dims() != lead {
        bail!("{LCE}: `targets` must have shape {lead:?}, got {:?}", targets.dims());
    }
    if chunk == 0 {
        bail!("{LCE}: chunk must be positive");
    }
    let dweight = match dweight_acc {
        Some(a) => {
            check_dims(LCE, "dweight_acc", a, &[v, h])?;
            check_dtype(LCE, "dweight_acc", a, DType::F32)?;
            check_contiguous(LCE, "dweight_acc", a)?;
            a.clone()
        }
        None => Tensor::zeros((v, h), DType::F32, hidden.device())?,
    };
    let rows = hidden.elem_count() / h;
    let hid = hidden.reshape((rows, h))?;
    let tgt = targets.reshape(rows)?.contiguous()?;
    let wt = weight.t()?; // [h, V], a view
    let (mut losses, mut dh) = (Vec::new(), Vec::new());
    for st in (0..rows).step_by(chunk) {
        let len = chunk.min(rows - st);
        let hc = hid.narrow(0, st, len)?; // [c, h], contiguous rows
        let logits = hc.matmul(&wt)?; // [c, V]
        losses.push(cross_entropy_inplace(&logits, &tgt.narrow(0, st, len)?, scale)?);
        dh.push(logits.matmul(weight)?); // [c, h]
        crate::matmul_acc_f32(&dweight, &logits, &hc, 1.0)?; // [V, h] += dlogitsᵀ·hc, in the GEMM
    }
    let (loss, dhidden) = if losses.is_empty() {
        (Tensor::zeros(rows, DType::F32, hidden.device())?, hidden.zeros_like()?)
    } else {
        (Tensor::cat(&losses, 0)?, Tensor::cat(&dh, 0)?)
    };
    let loss_sum = loss.sum_all()?;
    Ok(LinearCe { loss: loss.reshape(lead)?, loss_sum, dhidden: dhidden.reshape(hidden.shape())?, dweight })
}

fn ce_cpu<T: Elem>(logits: &mut [T], targets: &[i64], v: usize, scale: f32) -> Result<Vec<f32>> {
    if let Some(&t) = targets.iter().find(|&&t| t >= v as i64) {
        bail!("{CE}: target id {t} is not below the vocabulary size {v}");
    }
    let mut loss = vec![0f32; targets.len()];
    logits.par_chunks_mut(v).zip(targets.par_iter()).zip(loss.par_iter_mut()).for_each(|((row, &t), l)| {
        if t < 0 {
            row.iter_mut().for_each(|x| *x = T::from_f(0.0));
            return;
        }
        let t = t as usize;
        let m = row.iter().fold(f32::NEG_INFINITY, |m, x| m.max(x.to_f()));
        // The sum of exponentials in f64: a sequential f32 sum over a 49K vocabulary
        // lost 4.8e-5 of the loss (the GPU kernel's tree reduction does not).
        let s: f64 = row.iter().map(|x| f64::from((x.to_f() - m).exp())).sum();
        *l = (f64::from(m) + s.ln() - f64::from(row[t].to_f())) as f32;
        let inv = (1.0 / s) as f32;
        for (j, x) in row.iter_mut().enumerate() {
            let mut p = (x.to_f() - m).exp() * inv;
            if j == t {
                p -= 1.0;
            }
            *x = T::from_f(p * scale);
        }
    });
    Ok(loss)
}

struct CeOp {
    v: usize,
    scale: f32,
    extras: Extras,
}

impl InplaceOp2 for CeOp {
    fn name(&self) -> &'static str {
        CE
    }

    fn cpu_fwd(&self, s1: &mut CpuStorage, l1: &Layout, s2: &CpuStorage, l2: &Layout) -> Result<()> {
        let targets = cpu_slice::<i64>(CE, "targets", s2, l2)?;
        let shape = l2.shape().clone();
        dispatch_float!(CE, s1.dtype(), T => {
            let loss = ce_cpu(cpu_slice_mut::<T>(CE, "logits", s1, l1)?, targets, self.v, self.scale)?;
            self.extras.push(cpu_storage(loss), shape);
            Ok(())
        })
    }

    #[cfg(feature = "cuda")]
    fn cuda_fwd(&self, s1: &mut candle_core::CudaStorage, l1: &Layout, s2: &candle_core::CudaStorage, l2: &Layout) -> Result<()> {
        use crate::cuda::{alloc, launch, row_threads, view, view_mut, Module};
        use candle_core::cuda::cudarc::driver::LaunchConfig;
        use candle_core::{CudaStorage, Storage};
        let dev = s1.device().clone();
        let rows = l2.shape().elem_count();
        let targets = view::<i64>(CE, "targets", s2, l2)?;
        let mut loss = alloc::<f32>(&dev, rows)?;
        let (v, scale) = (self.v as i32, self.scale);
        let cfg = LaunchConfig { grid_dim: (rows as u32, 1, 1), block_dim: (row_threads(self.v, 16, 1024), 1, 1), shared_mem_bytes: 0 };
        dispatch_float!(CE, s1.dtype(), T => {
            let mut x = view_mut::<T>(CE, "logits", s1, l1)?;
            if rows > 0 {
                launch!(dev, Module::CrossEntropy, format!("ce_fwd_bwd_{}", T::SUFFIX), cfg, &mut x, &targets, &mut loss, &v, &scale);
            }
            Ok::<(), candle_core::Error>(())
        })?;
        self.extras.push(Storage::Cuda(CudaStorage::wrap_cuda_slice(loss, dev)), l2.shape().clone());
        Ok(())
    }
}
