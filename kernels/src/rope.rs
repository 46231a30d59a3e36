//! Rotary position embedding applied in place to q or k, with transformers' rotate_half
//! convention (pairs `(i, i + d/2)`), and its backward in place on dq or dk.
//!
//! Shapes: `b` batch, `s` tokens, `H` heads (query or kv), `d` head dim (even).
//! `x`: `[b, s, H, d]` (T, contiguous, overwritten). `cos`, `sin`: `[b, s, 1, d]` or
//! `[b, s, d]` (T or f32, contiguous), one row per token for that token's (global)
//! position, as `RopeTable` in src/model/rope.rs builds them.
//!
//! Forward: `y = x·cos + rotate_half(x)·sin`, i.e. `y_i = x_i·c_i − x_{i+d/2}·s_i`,
//! `y_{i+d/2} = x_{i+d/2}·c_{i+d/2} + x_i·s_{i+d/2}`. Backward: the transpose of that map,
//! `dx_i = dy_i·c_i + dy_{i+d/2}·s_{i+d/2}`, `dx_{i+d/2} = dy_{i+d/2}·c_{i+d/2} − dy_i·s_i`,
//! which is the rotation by −θ (the tables repeat each angle in both halves); it is the
//! exact gradient also when the tables carry an attention scaling (YaRN).

use crate::common::*;
use candle_core::backend::BackendStorage;
use candle_core::{bail, CpuStorage, DType, InplaceOp3, Layout, Result, Tensor};
use rayon::prelude::*;

const OP: &str = "rope";

/// Rotates `x [b, s, H, d]` in place by the angles of `cos`/`sin [b, s, (1,) d]`.
pub fn rope_fwd_inplace(x: &Tensor, cos: &Tensor, sin: &Tensor) -> Result<()> {
    apply(x, cos, sin, false)
}

/// Backward of [`rope_fwd_inplace`]: turns `dy` (the gradient of the rotated tensor,
/// `[b, s, H, d]`) into the gradient of its input, in place.
pub fn rope_bwd_inplace(dy: &Tensor, cos: &Tensor, sin: &Tensor) -> Result<()> {
    apply(dy, cos, sin, true)
}

fn apply(x: &Tensor, cos: &Tensor, sin: &Tensor, backward: bool) -> Result<()> {
    check_float(OP, "x", x)?;
    let (b, s, _heads, d) = match x.dims() {
        &[b, s, h, d] => (b, s, h, d),
        other => bail!("{OP}: `x` must be [b, s, heads, head_dim], got shape {other:?}"),
    };
    if d % 2 != 0 {
        bail!("{OP}: head dim {d} must be even");
    }
    check_contiguous(OP, "x", x)?;
    for (name, t) in [("cos", cos), ("sin", sin)] {
        let ok = matches!(t.dims(), &[tb, ts, 1, td] | &[tb, ts, td] if tb == b && ts == s && td == d);
        if !ok {
            bail!("{OP}: `{name}` must be [b, s, 1, d] or [b, s, d] = [{b}, {s}, (1,) {d}], got shape {:?}", t.dims());
        }
        if t.dtype() != x.dtype() && t.dtype() != DType::F32 {
            bail!("{OP}: `{name}` must be {:?} (like x) or f32, got {:?}", x.dtype(), t.dtype());
        }
        check_contiguous(OP, name, t)?;
        check_device(OP, name, t, x)?;
    }
    if cos.dtype() != sin.dtype() {
        bail!("{OP}: `cos` is {:?} but `sin` is {:?}", cos.dtype(), sin.dtype());
    }
    x.inplace_op3(cos, sin, &RopeOp { d, backward })
}

/// The CPU twin: `x` rows of `d`, `heads` rows per token.
fn rope_cpu<T: Elem, C: Elem>(x: &mut [T], cos: &[C], sin: &[C], heads: usize, d: usize, backward: bool) {
    let half = d / 2;
    x.par_chunks_mut(heads * d).enumerate().for_each(|(t, tok)| {
        let (c, s) = (&cos[t * d..(t + 1) * d], &sin[t * d..(t + 1) * d]);
        for row in tok.chunks_mut(d) {
            for i in 0..half {
                let (a, b) = (row[i].to_f(), row[i + half].to_f());
                let (c0, c1, s0, s1) = (c[i].to_f(), c[i + half].to_f(), s[i].to_f(), s[i + half].to_f());
                let (y0, y1) = if backward { (a * c0 + b * s1, b * c1 - a * s0) } else { (a * c0 - b * s0, b * c1 + a * s1) };
                row[i] = T::from_f(y0);
                row[i + half] = T::from_f(y1);
            }
        }
    });
}

struct RopeOp {
    d: usize,
    backward: bool,
}

impl InplaceOp3 for RopeOp {
    fn name(&self) -> &'static str {
        OP
    }

    fn cpu_fwd(&self, s1: &mut CpuStorage, l1: &Layout, s2: &CpuStorage, l2: &Layout, s3: &CpuStorage, l3: &Layout) -> Result<()> {
        let heads = l1.dims()[2];
        let table = s2.dtype();
        dispatch_float!(OP, s1.dtype(), T => {
            let x = cpu_slice_mut::<T>(OP, "x", s1, l1)?;
            if table == DType::F32 {
                rope_cpu::<T, f32>(x, cpu_slice(OP, "cos", s2, l2)?, cpu_slice(OP, "sin", s3, l3)?, heads, self.d, self.backward);
            } else {
                rope_cpu::<T, T>(x, cpu_slice(OP, "cos", s2, l2)?, cpu_slice(OP, "sin", s3, l3)?, heads, self.d, self.backward);
            }
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
        use crate::cuda::{elementwise, launch, view, view_mut, Module};
        let dev = s1.device().clone();
        let dims = l1.dims();
        let (tokens, heads, d) = (dims[0] * dims[1], dims[2] as i32, self.d as i32);
        let pairs = l1.shape().elem_count() / 2;
        if pairs == 0 {
            return Ok(());
        }
        let cfg = elementwise(&dev, pairs)?;
        let bwd = self.backward as i32;
        let table = s2.dtype();
        dispatch_float!(OP, s1.dtype(), T => {
            let mut x = view_mut::<T>(OP, "x", s1, l1)?;
            if table == DType::F32 {
                let (c, s) = (view::<f32>(OP, "cos", s2, l2)?, view::<f32>(OP, "sin", s3, l3)?);
                launch!(dev, Module::Rope, format!("rope_{}_f32", T::SUFFIX), cfg, &mut x, &c, &s, &tokens, &heads, &d, &bwd);
            } else {
                let (c, s) = (view::<T>(OP, "cos", s2, l2)?, view::<T>(OP, "sin", s3, l3)?);
                launch!(dev, Module::Rope, format!("rope_{0}_{0}", T::SUFFIX), cfg, &mut x, &c, &s, &tokens, &heads, &d, &bwd);
            }
            Ok(())
        })
    }
}
