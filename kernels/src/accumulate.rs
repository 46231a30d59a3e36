//! Gradient accumulation into an f32 buffer in place: `acc ← acc + alpha·x`, with `x` in
//! any activation dtype (the bf16 output of a weight-gradient GEMM, say), so that no f32
//! copy of `x` and no fresh sum are allocated; and the embedding's weight gradient,
//! `slot[ids[r]] += scale·g[r]` row by row ([`embedding_grad_add`]), in one pass over `g`.
//!
//! Shapes: `acc`: `[..]` f32 (contiguous, updated); `x`: the same shape (T ∈ {bf16, f16,
//! f32}, contiguous). `slot`: `[V, h]` f32 (contiguous, updated); `ids`: `[n]` u32; `g`:
//! `[n, h]` (T, contiguous).

use crate::common::*;
use candle_core::backend::BackendStorage;
use candle_core::{CpuStorage, DType, InplaceOp2, Layout, Result, Tensor};
use rayon::prelude::*;

const OP: &str = "accumulate_f32";
const EMBED: &str = "embedding_grad_add";

/// `acc [..] f32 ← acc + alpha · x [..]`, in place.
pub fn accumulate_f32(acc: &Tensor, x: &Tensor, alpha: f64) -> Result<()> {
    check_dtype(OP, "acc", acc, DType::F32)?;
    check_float(OP, "x", x)?;
    check_dims(OP, "x", x, acc.dims())?;
    check_contiguous(OP, "acc", acc)?;
    check_contiguous(OP, "x", x)?;
    acc.inplace_op2(x, &AccOp { alpha: alpha as f32 })
}

/// `slot [V, h] f32`: row `ids[r]` += `scale · g[r]` for every row `r` of `g [n, h]`, in
/// place; `ids [n]` u32. On the GPU rows with the same id add up in no fixed order (f32
/// atomics); the CPU twin adds them in row order and refuses an id ≥ V (the GPU skips it).
pub fn embedding_grad_add(slot: &Tensor, ids: &Tensor, g: &Tensor, scale: f64) -> Result<()> {
    check_dtype(EMBED, "slot", slot, DType::F32)?;
    check_dtype(EMBED, "ids", ids, DType::U32)?;
    check_float(EMBED, "g", g)?;
    let (_, h) = slot.dims2()?;
    let n = ids.dims1()?;
    check_dims(EMBED, "g", g, &[n, h])?;
    for (name, t) in [("slot", slot), ("ids", ids), ("g", g)] {
        check_contiguous(EMBED, name, t)?;
        check_device(EMBED, name, t, slot)?;
    }
    slot.inplace_op3(ids, g, &EmbedOp { scale: scale as f32 })
}

struct EmbedOp {
    scale: f32,
}

impl candle_core::InplaceOp3 for EmbedOp {
    fn name(&self) -> &'static str {
        EMBED
    }

    fn cpu_fwd(&self, s1: &mut CpuStorage, l1: &Layout, s2: &CpuStorage, l2: &Layout, s3: &CpuStorage, l3: &Layout) -> Result<()> {
        let (vocab, h) = (l1.dims()[0], l1.dims()[1]);
        let slot = cpu_f32_mut(EMBED, "slot", s1, l1)?;
        let ids = cpu_slice::<u32>(EMBED, "ids", s2, l2)?;
        if let Some((r, id)) = ids.iter().enumerate().find(|(_, &id)| id as usize >= vocab) {
            candle_core::bail!("{EMBED}: token id {id} at row {r} is not below the vocabulary size {vocab}");
        }
        // The rows of each id in row order (a counting sort), then every id's slot row on its
        // own thread: rows add in row order, so the result does not depend on scheduling.
        let mut start = vec![0usize; vocab + 1];
        for &id in ids {
            start[id as usize + 1] += 1;
        }
        for v in 0..vocab {
            start[v + 1] += start[v];
        }
        let mut next = start.clone();
        let mut order = vec![0usize; ids.len()];
        for (r, &id) in ids.iter().enumerate() {
            order[next[id as usize]] = r;
            next[id as usize] += 1;
        }
        let scale = self.scale;
        dispatch_float!(EMBED, s3.dtype(), T => {
            let g = cpu_slice::<T>(EMBED, "g", s3, l3)?;
            slot.par_chunks_mut(h.max(1)).enumerate().for_each(|(id, row)| {
                for &r in &order[start[id]..start[id + 1]] {
                    row.iter_mut().zip(&g[r * h..(r + 1) * h]).for_each(|(a, v)| *a += scale * v.to_f());
                }
            });
            Ok(())
        })
    }

    #[cfg(feature = "cuda")]
    fn cuda_fwd(
        &self,
        s1: &mut candle_core::CudaStorage,
        l1: &Layout,
        s2: &candle_core::CudaStorage,
        l2: &Layout,
        s3: &candle_core::CudaStorage,
        l3: &Layout,
    ) -> Result<()> {
        use crate::cuda::{launch, sm_count, view, view_mut, Module};
        use candle_core::cuda::cudarc::driver::LaunchConfig;
        let dev = s1.device().clone();
        let (vocab, h) = (l1.dims()[0], l1.dims()[1]);
        let rows = l2.shape().elem_count();
        if rows == 0 || h == 0 {
            return Ok(());
        }
        let (h_arg, vocab_arg) =
            (i32::try_from(h).map_err(candle_core::Error::wrap)?, u32::try_from(vocab).map_err(candle_core::Error::wrap)?);
        let cfg = LaunchConfig { grid_dim: (rows.min(32 * sm_count(&dev)?) as u32, 1, 1), block_dim: (256, 1, 1), shared_mem_bytes: 0 };
        let scale = self.scale;
        let mut slot = view_mut::<f32>(EMBED, "slot", s1, l1)?;
        let ids = view::<u32>(EMBED, "ids", s2, l2)?;
        dispatch_float!(EMBED, s3.dtype(), T => {
            let g = view::<T>(EMBED, "g", s3, l3)?;
            launch!(dev, Module::Accumulate, format!("embed_grad_add_{}", T::SUFFIX), cfg, &mut slot, &ids, &g, &rows, &h_arg, &vocab_arg, &scale);
            Ok(())
        })
    }
}

struct AccOp {
    alpha: f32,
}

impl InplaceOp2 for AccOp {
    fn name(&self) -> &'static str {
        OP
    }

    fn cpu_fwd(&self, s1: &mut CpuStorage, l1: &Layout, s2: &CpuStorage, l2: &Layout) -> Result<()> {
        let acc = cpu_f32_mut(OP, "acc", s1, l1)?;
        let alpha = self.alpha;
        dispatch_float!(OP, s2.dtype(), T => {
            let x = cpu_slice::<T>(OP, "x", s2, l2)?;
            acc.par_iter_mut().zip(x).for_each(|(a, v)| *a += alpha * v.to_f());
            Ok(())
        })
    }

    #[cfg(feature = "cuda")]
    fn cuda_fwd(&self, s1: &mut candle_core::CudaStorage, l1: &Layout, s2: &candle_core::CudaStorage, l2: &Layout) -> Result<()> {
        use crate::cuda::{elementwise, launch, view, view_mut, Module};
        let dev = s1.device().clone();
        let n = l1.shape().elem_count();
        if n == 0 {
            return Ok(());
        }
        let cfg = elementwise(&dev, n)?;
        let alpha = self.alpha;
        let mut acc = view_mut::<f32>(OP, "acc", s1, l1)?;
        dispatch_float!(OP, s2.dtype(), T => {
            let x = view::<T>(OP, "x", s2, l2)?;
            launch!(dev, Module::Accumulate, format!("accumulate_{}", T::SUFFIX), cfg, &mut acc, &x, &n, &alpha);
            Ok(())
        })
    }
}
