//! Block kernel tests: the naive reference against Candle autograd, the CPU tiled kernel
//! against the naive reference in F64, and the LSE merge (split keys, -inf blocks, a causal
//! decomposition into blocks).
//!
//! Tolerances (max |a - ref| / max |ref| per tensor):
//! - f32 inputs: 1e-5 on o, lse, dq, dk, dv (the kernel accumulates in f32).
//! - bf16 inputs: 8e-3 — the reference sees the same bf16 values in F64, so the error is
//!   dominated by rounding the outputs to bf16 (2^-9 relative) plus f32 accumulation.
//!
//! Shapes: `q [b,s,hq,d]`, `k`/`v [b,t,hkv,d]`, `o [b,s,hq,d]`, `lse [b,hq,s]` f32.

use candle_core::{DType, Device, Result, Tensor, Var, D};
use longctx_attention::merge::{self, Acc};
use longctx_attention::{kernel, naive, Mask, Saved};

use longctx_attention::testing::rel_err;

/// Seeded normal values (`testing::randn`), a new seed per call in each test's thread, so a
/// failure reproduces.
fn randn(shape: (usize, usize, usize, usize), dtype: DType) -> Result<Tensor> {
    thread_local!(static CALLS: std::cell::Cell<u64> = const { std::cell::Cell::new(0) });
    let seed = CALLS.with(|c| {
        c.set(c.get() + 1);
        c.get()
    });
    let (a, b, c, d) = shape;
    longctx_attention::testing::randn(&[a, b, c, d], seed, &Device::Cpu)?.to_dtype(dtype)
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
        let (dq, dk, dv) = naive::bwd(&d_o, Saved::new(&q, &k, &v, &o, &lse), mask, scale)?;
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
    Ok(())
}

const TOL_F32: f64 = 1e-5;
const TOL_BF16: f64 = 8e-3;

/// One kernel-vs-reference case `(mask, s, t, hq, hkv, d)` of [`CASES`] at batch `b`;
/// returns the worst relative error over o, lse, dq, dk, dv.
fn check_case(case: Case, b: usize, dtype: DType, tol: f64) -> Result<f64> {
    let (mask, s, t, hq, hkv, d) = case;
    let scale = 1.5 / (d as f64).sqrt();
    let q = randn((b, s, hq, d), dtype)?;
    let k = randn((b, t, hkv, d), dtype)?;
    let v = randn((b, t, hkv, d), dtype)?;
    let d_o = randn((b, s, hq, d), dtype)?;
    let f64_ = |x: &Tensor| x.to_dtype(DType::F64);
    let (o_ref, lse_ref) = naive::fwd(&f64_(&q)?, &f64_(&k)?, &f64_(&v)?, mask, scale)?;
    let (o, lse) = kernel::fwd(&q, &k, &v, mask, scale)?;
    assert_eq!(o.dtype(), dtype);
    assert_eq!(lse.dtype(), DType::F32);
    // Both backwards get the same global o (rounded to the input dtype) and lse.
    let o_in = o_ref.to_dtype(dtype)?;
    let (q64, k64, v64, o64) = (f64_(&q)?, f64_(&k)?, f64_(&v)?, f64_(&o_in)?);
    let (dq_ref, dk_ref, dv_ref) = naive::bwd(&f64_(&d_o)?, Saved::new(&q64, &k64, &v64, &o64, &lse_ref), mask, scale)?;
    let (dq, dk, dv) = kernel::bwd(&d_o, Saved::new(&q, &k, &v, &o_in, &lse_ref), mask, scale)?;
    let mut worst = 0f64;
    for (name, a, r) in [("o", &o, &o_ref), ("lse", &lse, &lse_ref), ("dq", &dq, &dq_ref), ("dk", &dk, &dk_ref), ("dv", &dv, &dv_ref)] {
        assert_eq!(a.dims(), r.dims(), "{name} shape");
        let e = rel_err(a, r)?;
        assert!(e <= tol, "{mask:?} b{b} s{s} t{t} hq{hq} hkv{hkv} d{d} {dtype:?}: {name} rel err {e} > {tol}");
        worst = worst.max(e);
    }
    Ok(worst)
}

/// (mask, s, t, hq, hkv, d): odd lengths, s != t unmasked, head dims 64/128/40, GQA 1/4/8.
type Case = (Mask, usize, usize, usize, usize, usize);
const CASES: [Case; 7] = [
    (Mask::Causal, 37, 37, 4, 1, 64),
    (Mask::Causal, 129, 129, 8, 1, 40),
    (Mask::Causal, 70, 70, 2, 2, 128),
    (Mask::None, 50, 77, 2, 2, 128),
    (Mask::None, 37, 129, 8, 1, 64),
    (Mask::None, 65, 30, 4, 1, 40),
    (Mask::None, 1, 3, 1, 1, 7),
];

#[test]
fn cpu_kernel_matches_reference_f32() -> Result<()> {
    let mut worst = 0f64;
    for case in CASES {
        worst = worst.max(check_case(case, 2, DType::F32, TOL_F32)?);
    }
    println!("f32 worst relative error: {worst:.3e}");
    Ok(())
}

#[test]
fn cpu_kernel_matches_reference_bf16() -> Result<()> {
    let mut worst = 0f64;
    for case in CASES.into_iter().take(4) {
        worst = worst.max(check_case(case, 2, DType::BF16, TOL_BF16)?);
    }
    println!("bf16 worst relative error: {worst:.3e}");
    Ok(())
}

/// Non-contiguous inputs (a transposed view) give the same result as contiguous ones.
#[test]
fn cpu_kernel_accepts_strided_inputs() -> Result<()> {
    let q = randn((2, 4, 19, 16), DType::F32)?.transpose(1, 2)?; // [2,19,4,16] view
    let k = randn((2, 2, 23, 16), DType::F32)?.transpose(1, 2)?;
    let v = randn((2, 23, 2, 16), DType::F32)?;
    let (o1, l1) = kernel::fwd(&q, &k, &v, Mask::None, 0.25)?;
    let (o2, l2) = kernel::fwd(&q.contiguous()?, &k.contiguous()?, &v, Mask::None, 0.25)?;
    assert_eq!(rel_err(&o1, &o2)?, 0.0);
    assert_eq!(rel_err(&l1, &l2)?, 0.0);
    Ok(())
}

/// Splitting the keys into two unmasked blocks and merging equals the full attention;
/// block backwards with the global o/lse sum (dq) and concatenate (dk, dv) to the full one.
#[test]
fn split_keys_merge_equals_full() -> Result<()> {
    let (b, s, t, hq, hkv, d, cut) = (2, 40, 70, 4, 2, 32, 30);
    let scale = 1.0 / (d as f64).sqrt();
    let q = randn((b, s, hq, d), DType::F32)?;
    let k = randn((b, t, hkv, d), DType::F32)?;
    let v = randn((b, t, hkv, d), DType::F32)?;
    let d_o = randn((b, s, hq, d), DType::F32)?;
    let halves = [(0, cut), (cut, t - cut)];
    let mut acc: Option<Acc> = None;
    for (start, len) in halves {
        let (o_b, lse_b) = kernel::fwd(&q, &k.narrow(1, start, len)?, &v.narrow(1, start, len)?, Mask::None, scale)?;
        acc = Some(merge::merge(acc, &o_b, &lse_b)?);
    }
    let acc = acc.ok_or_else(|| candle_core::Error::Msg("no blocks".into()))?;
    let (o, lse) = acc.finish(DType::F32)?;
    let (o_full, lse_full) = kernel::fwd(&q, &k, &v, Mask::None, scale)?;
    assert!(rel_err(&o, &o_full)? <= TOL_F32, "merged o");
    assert!(rel_err(&lse, &lse_full)? <= TOL_F32, "merged lse");

    let (dq_full, dk_full, dv_full) = kernel::bwd(&d_o, Saved::new(&q, &k, &v, &o_full, &lse_full), Mask::None, scale)?;
    let mut dq = q.zeros_like()?;
    let (mut dks, mut dvs) = (vec![], vec![]);
    for (start, len) in halves {
        let (k_b, v_b) = (k.narrow(1, start, len)?, v.narrow(1, start, len)?);
        let (dq_b, dk_b, dv_b) = kernel::bwd(&d_o, Saved::new(&q, &k_b, &v_b, &o, &lse), Mask::None, scale)?;
        dq = (dq + dq_b)?;
        dks.push(dk_b);
        dvs.push(dv_b);
    }
    assert!(rel_err(&dq, &dq_full)? <= TOL_F32, "summed dq");
    assert!(rel_err(&Tensor::cat(&dks, 1)?, &dk_full)? <= TOL_F32, "block dk");
    assert!(rel_err(&Tensor::cat(&dvs, 1)?, &dv_full)? <= TOL_F32, "block dv");
    Ok(())
}

fn all_finite_or_neg_inf(x: &Tensor) -> Result<bool> {
    let v: Vec<f32> = x.to_dtype(DType::F32)?.flatten_all()?.to_vec1()?;
    Ok(v.iter().all(|x| !x.is_nan() && *x != f32::INFINITY))
}

/// Merging a block whose rows are all -inf leaves the accumulator unchanged (exactly),
/// and rows that are -inf on both sides stay o = 0, lse = -inf, without NaN; on both the
/// CPU fast path and the tensor-op path.
#[test]
fn merge_neg_inf_block_is_noop() -> Result<()> {
    let (b, s, h, d) = (2, 9, 3, 8);
    let (o, lse) = kernel::fwd(
        &randn((b, s, h, d), DType::F32)?,
        &randn((b, 5, h, d), DType::F32)?,
        &randn((b, 5, h, d), DType::F32)?,
        Mask::None,
        0.5,
    )?;
    let junk_o = (randn((b, s, h, d), DType::F32)? * 1e30)?;
    let neg_lse = Tensor::full(f32::NEG_INFINITY, (b, h, s), &Device::Cpu)?;
    for tensor_ops in [false, true] {
        let m = |acc: Option<Acc>, ob: &Tensor, lb: &Tensor, off: usize| {
            if tensor_ops {
                merge::merge_at_tensor_ops(acc, ob, lb, off)
            } else {
                merge::merge_at(acc, ob, lb, off)
            }
        };
        let acc = m(Some(Acc { o: o.clone(), lse: lse.clone() }), &junk_o, &neg_lse, 0)?;
        assert_eq!(rel_err(&acc.o, &o)?, 0.0, "o changed (tensor_ops={tensor_ops})");
        assert_eq!(rel_err(&acc.lse, &lse)?, 0.0, "lse changed (tensor_ops={tensor_ops})");
        // Empty accumulator and -inf block: rows 2..6 touched, all stay 0 / -inf.
        let empty = Acc::empty(b, s, h, d, &Device::Cpu)?;
        let acc = m(Some(empty), &junk_o.narrow(1, 0, 4)?, &neg_lse.narrow(2, 0, 4)?, 2)?;
        assert!(all_finite_or_neg_inf(&acc.o)? && all_finite_or_neg_inf(&acc.lse)?);
        assert_eq!(acc.o.abs()?.sum_all()?.to_scalar::<f32>()?, 0.0);
        let l: Vec<f32> = acc.lse.flatten_all()?.to_vec1()?;
        assert!(l.iter().all(|x| *x == f32::NEG_INFINITY));
        // A real block into an empty accumulator reproduces the block on its rows.
        let empty = Acc::empty(b, s, h, d, &Device::Cpu)?;
        let acc = m(Some(empty), &o.narrow(1, 3, 6)?, &lse.narrow(2, 3, 6)?, 3)?;
        assert!(rel_err(&acc.o.narrow(1, 3, 6)?, &o.narrow(1, 3, 6)?)? <= 1e-7);
        assert!(rel_err(&acc.lse.narrow(2, 3, 6)?, &lse.narrow(2, 3, 6)?)? <= 1e-7);
        assert_eq!(acc.o.narrow(1, 0, 3)?.abs()?.sum_all()?.to_scalar::<f32>()?, 0.0);
    }
    Ok(())
}

/// The CPU slice merge and the tensor-op merge agree (1e-6 relative) on partial rows.
#[test]
fn merge_paths_agree() -> Result<()> {
    let (b, s, h, d) = (2, 12, 3, 8);
    let mut accs = [Acc::empty(b, s, h, d, &Device::Cpu)?, Acc::empty(b, s, h, d, &Device::Cpu)?];
    for (off, len) in [(0, 12), (4, 5), (0, 3), (7, 5)] {
        let ob = randn((b, len, h, d), DType::F32)?;
        let lb = (randn((b, h, len, 1), DType::F32)?.squeeze(3)? * 5.0)?;
        accs[0] = merge::merge_at(Some(accs[0].clone()), &ob, &lb, off)?;
        accs[1] = merge::merge_at_tensor_ops(Some(accs[1].clone()), &ob, &lb, off)?;
    }
    assert!(rel_err(&accs[0].o, &accs[1].o)? <= 1e-6);
    assert!(rel_err(&accs[0].lse, &accs[1].lse)? <= 1e-6);
    Ok(())
}

/// Causal attention over 3 chunks as blocks: diagonal blocks causal, blocks below the
/// diagonal unmasked, merged by offset; equals one causal call, forward and backward.
#[test]
fn causal_three_block_decomposition() -> Result<()> {
    let (b, n, hq, hkv, d) = (2, 23, 4, 2, 24);
    let s = 3 * n;
    let scale = 1.0 / (d as f64).sqrt();
    let q = randn((b, s, hq, d), DType::F32)?;
    let k = randn((b, s, hkv, d), DType::F32)?;
    let v = randn((b, s, hkv, d), DType::F32)?;
    let d_o = randn((b, s, hq, d), DType::F32)?;
    let chunk = |x: &Tensor, c: usize| x.narrow(1, c * n, n);
    let blocks: Vec<(usize, usize, Mask)> =
        (0..3).flat_map(|qc| (0..=qc).map(move |kc| (qc, kc, if kc == qc { Mask::Causal } else { Mask::None }))).collect();
    let mut acc = Acc::empty(b, s, hq, d, &Device::Cpu)?;
    for &(qc, kc, mask) in &blocks {
        let (o_b, lse_b) = kernel::fwd(&chunk(&q, qc)?, &chunk(&k, kc)?, &chunk(&v, kc)?, mask, scale)?;
        acc = merge::merge_at(Some(acc), &o_b, &lse_b, qc * n)?;
    }
    let (o, lse) = acc.finish(DType::F32)?;
    let (o_full, lse_full) = kernel::fwd(&q, &k, &v, Mask::Causal, scale)?;
    assert!(rel_err(&o, &o_full)? <= TOL_F32, "o");
    assert!(rel_err(&lse, &lse_full)? <= TOL_F32, "lse");

    let (dq_full, dk_full, dv_full) = kernel::bwd(&d_o, Saved::new(&q, &k, &v, &o_full, &lse_full), Mask::Causal, scale)?;
    let mut dq: Vec<Tensor> = (0..3).map(|_| Tensor::zeros((b, n, hq, d), DType::F32, &Device::Cpu)).collect::<Result<_>>()?;
    let mut dk: Vec<Tensor> = (0..3).map(|_| Tensor::zeros((b, n, hkv, d), DType::F32, &Device::Cpu)).collect::<Result<_>>()?;
    let mut dv = dk.clone();
    for &(qc, kc, mask) in &blocks {
        let (q_b, k_b, v_b, o_b, lse_b) = (chunk(&q, qc)?, chunk(&k, kc)?, chunk(&v, kc)?, chunk(&o, qc)?, lse.narrow(2, qc * n, n)?);
        let (dq_b, dk_b, dv_b) = kernel::bwd(&chunk(&d_o, qc)?, Saved::new(&q_b, &k_b, &v_b, &o_b, &lse_b), mask, scale)?;
        dq[qc] = (&dq[qc] + dq_b)?;
        dk[kc] = (&dk[kc] + dk_b)?;
        dv[kc] = (&dv[kc] + dv_b)?;
    }
    assert!(rel_err(&Tensor::cat(&dq, 1)?, &dq_full)? <= TOL_F32, "dq");
    assert!(rel_err(&Tensor::cat(&dk, 1)?, &dk_full)? <= TOL_F32, "dk");
    assert!(rel_err(&Tensor::cat(&dv, 1)?, &dv_full)? <= TOL_F32, "dv");
    Ok(())
}

/// Rough CPU timing (run with `--release -- --ignored --nocapture`): causal fwd+bwd,
/// b=1, s=4096, 8 heads, d=64. No timing assertion; it checks the outputs are finite.
#[test]
#[ignore]
fn cpu_kernel_timing() -> Result<()> {
    let (s, h, d) = (4096, 8, 64);
    let q = randn((1, s, h, d), DType::F32)?;
    let k = randn((1, s, h, d), DType::F32)?;
    let v = randn((1, s, h, d), DType::F32)?;
    let d_o = randn((1, s, h, d), DType::F32)?;
    for mask in [Mask::Causal, Mask::None] {
        let t0 = std::time::Instant::now();
        let (o, lse) = kernel::fwd(&q, &k, &v, mask, 0.125)?;
        let t1 = std::time::Instant::now();
        let (dq, dk, dv) = kernel::bwd(&d_o, Saved::new(&q, &k, &v, &o, &lse), mask, 0.125)?;
        let t2 = std::time::Instant::now();
        println!(
            "{mask:?} s={s} h={h} d={d}: fwd {:.2}s bwd {:.2}s ({} rayon threads)",
            (t1 - t0).as_secs_f64(),
            (t2 - t1).as_secs_f64(),
            rayon::current_num_threads()
        );
        for x in [&o, &lse, &dq, &dk, &dv] {
            assert!(all_finite_or_neg_inf(x)?);
        }
    }
    Ok(())
}

/// A NaN in an output fails every tolerance (Candle's `max` skips NaNs; `rel_err` must not).
#[test]
fn rel_err_sees_nan() -> Result<()> {
    let want = Tensor::new(&[1f32, 2.0, 3.0, 4.0], &Device::Cpu)?;
    let got = Tensor::new(&[1f32, f32::NAN, 3.0, 4.0], &Device::Cpu)?;
    assert_eq!(rel_err(&got, &want)?, f64::INFINITY);
    assert_eq!(rel_err(&want, &got)?, f64::INFINITY);
    assert_eq!(rel_err(&want, &want)?, 0.0);
    let e = longctx_attention::testing::Errors { o: 0.0, lse: f64::NAN, dq: 1e-3, dk: 0.0, dv: 0.0 };
    assert_eq!(e.max(), f64::INFINITY);
    Ok(())
}
