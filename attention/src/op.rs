//! Makes any [`AttentionMode`] a differentiable Candle op.
//!
//! The forward runs outside the graph (on detached inputs); the result is attached to
//! the graph by a `CustomOp3` whose forward hands back the precomputed output (which then
//! lives only as the graph's output) and whose backward calls the mode's backward with
//! that output as the global `o`, and the saved `lse`.

use crate::docs::Masking;
use crate::kernel::Saved;
use crate::mode::AttentionMode;
use candle_core::backend::BackendStorage;
use candle_core::{CpuStorage, CustomOp3, Layout, Result, Shape, Storage, Tensor};
use std::sync::{Arc, Mutex};

struct AttnOp {
    mode: Arc<dyn AttentionMode>,
    /// `[b, s, hq, d]`, contiguous, offset 0; taken by the forward (which copies it into
    /// the graph's output), so only one copy stays alive with the graph.
    o: Mutex<Option<Tensor>>,
    lse: Tensor, // [b, hq, s] f32
    /// The layer's sliding window (`None`: full causal).
    window: Option<usize>,
    scale: f64,
}

impl AttnOp {
    fn take_o(&self) -> Result<Tensor> {
        self.o
            .lock()
            .map_err(|_| candle_core::Error::Msg("attention op: poisoned".into()))?
            .take()
            .ok_or_else(|| candle_core::Error::Msg("attention op: forward ran twice".into()))
    }
}

/// `o` itself when it is a plain contiguous buffer from offset 0 (what `cpu_fwd` /
/// `cuda_fwd` hand back by cloning the storage), else a contiguous copy.
fn owned(o: Tensor) -> Result<Tensor> {
    let plain = {
        let (_, l) = o.storage_and_layout();
        l.is_contiguous() && l.start_offset() == 0
    };
    if plain {
        Ok(o)
    } else {
        o.copy()
    }
}

impl CustomOp3 for AttnOp {
    fn name(&self) -> &'static str {
        "seq-parallel-attention"
    }
    fn cpu_fwd(&self, _: &CpuStorage, _: &Layout, _: &CpuStorage, _: &Layout, _: &CpuStorage, _: &Layout) -> Result<(CpuStorage, Shape)> {
        let o = self.take_o()?;
        let (st, l) = o.storage_and_layout();
        match &*st {
            Storage::Cpu(c) => Ok((c.try_clone(l)?, o.shape().clone())),
            _ => candle_core::bail!("attention output is not on the CPU"),
        }
    }
    #[cfg(feature = "cuda")]
    fn cuda_fwd(
        &self,
        _: &candle_core::CudaStorage,
        _: &Layout,
        _: &candle_core::CudaStorage,
        _: &Layout,
        _: &candle_core::CudaStorage,
        _: &Layout,
    ) -> Result<(candle_core::CudaStorage, Shape)> {
        let o = self.take_o()?;
        let (st, l) = o.storage_and_layout();
        match &*st {
            Storage::Cuda(c) => Ok((c.try_clone(l)?, o.shape().clone())),
            _ => candle_core::bail!("attention output is not on a CUDA device"),
        }
    }
    fn bwd(
        &self,
        q: &Tensor,
        k: &Tensor,
        v: &Tensor,
        res: &Tensor,
        grad: &Tensor,
    ) -> Result<(Option<Tensor>, Option<Tensor>, Option<Tensor>)> {
        let (q, k, v, o) = (q.detach(), k.detach(), v.detach(), res.detach());
        let saved = Saved::new(&q, &k, &v, &o, &self.lse);
        let (dq, dk, dv) = self.mode.backward_masked(&grad.contiguous()?, saved, Masking::window(self.window), self.scale)?;
        Ok((Some(dq), Some(dk), Some(dv)))
    }
}

/// Differentiable causal attention through `mode`; returns `o [b, s, hq, d]`.
pub fn attention(mode: &Arc<dyn AttentionMode>, q: &Tensor, k: &Tensor, v: &Tensor, scale: f64) -> Result<Tensor> {
    let (o, _) = attention_with_lse(mode, q, k, v, scale)?;
    Ok(o)
}

/// Like [`attention`] but also returns the (non-differentiable) `lse [b, hq, s]`.
pub fn attention_with_lse(mode: &Arc<dyn AttentionMode>, q: &Tensor, k: &Tensor, v: &Tensor, scale: f64) -> Result<(Tensor, Tensor)> {
    attention_windowed(mode, q, k, v, None, scale)
}

/// [`attention_with_lse`] under a sliding window of `window` keys (`None`: full causal),
/// which joins whatever document mask `mode` carries ([`crate::mode::WithDocs`]).
pub fn attention_windowed(
    mode: &Arc<dyn AttentionMode>,
    q: &Tensor,
    k: &Tensor,
    v: &Tensor,
    window: Option<usize>,
    scale: f64,
) -> Result<(Tensor, Tensor)> {
    let (q, k, v) = (q.contiguous()?, k.contiguous()?, v.contiguous()?);
    let (o, lse) = mode.forward_masked(&q.detach(), &k.detach(), &v.detach(), Masking::window(window), scale)?;
    let o = owned(o)?;
    if !(q.track_op() || k.track_op() || v.track_op()) {
        return Ok((o, lse));
    }
    let op = AttnOp { mode: mode.clone(), o: Mutex::new(Some(o)), lse: lse.clone(), window, scale };
    let tracked = q.apply_op3_arc(&k, &v, Arc::new(Box::new(op)))?;
    Ok((tracked, lse))
}
