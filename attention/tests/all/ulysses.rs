//! Ulysses vs the single-device reference, plus its head-sharding helpers.
//!
//! Tolerance: f32 on the CPU, max-norm relative error (`max|got-want| / max|want|`)
//! ≤ 1e-5 for o, lse, dq, dk, dv. The mode only reorders data and runs the same
//! causal kernel on whole rows, so the error is rounding only.

use candle_core::{Device, Result, Tensor};
use longctx_attention::comm::thread::run_ranks;
use longctx_attention::layout::contiguous_indices;
use longctx_attention::mode::AttentionMode;
use longctx_attention::testing::{check_mode, layout_of, randn, random_inputs, rel_err, Drive, Errors};
use longctx_attention::ulysses::{heads_to_seq, kv_replication, reduce_replicated_kv_grad, replicate_kv_heads, seq_to_heads, Ulysses};
use std::sync::Arc;

const TOL: f64 = 1e-5;
const D: usize = 16;

fn scale() -> f64 {
    1.0 / (D as f64).sqrt()
}

fn run(drive: Drive, w: usize, b: usize, s: usize, hq: usize, hkv: usize, seed: u64) -> Result<Errors> {
    let inp = random_inputs(b, s, hq, hkv, D, seed, &Device::Cpu)?;
    let idx = layout_of(w, |r| contiguous_indices(s, w, r))?;
    check_mode(drive, &idx, &inp, scale(), |comm| Ok(Arc::new(Ulysses::new(comm)) as Arc<dyn AttentionMode>))
}

fn assert_close(what: &str, e: Errors) {
    println!("{what}: {e}");
    assert!(e.max() <= TOL, "{what}: errors {e} above {TOL:e}");
}

#[test]
fn matches_reference_for_every_world() -> Result<()> {
    // (W, hq, hkv): MHA, GQA without replication, GQA with replication (P > hkv).
    let cases = [(1, 8, 8), (2, 8, 8), (4, 8, 8), (8, 8, 8), (3, 6, 6), (3, 6, 3), (2, 8, 2), (4, 8, 2), (8, 8, 2), (4, 8, 1)];
    for (w, hq, hkv) in cases {
        let e = run(Drive::Direct, w, 2, 48, hq, hkv, 7 + w as u64)?;
        assert_close(&format!("W={w} hq={hq} hkv={hkv}"), e);
    }
    Ok(())
}

#[test]
fn awkward_length_on_eight_ranks() -> Result<()> {
    // 3824 / 8 = 478 local tokens; GQA 8/2 so kv heads are replicated 4×.
    let e = run(Drive::Direct, 8, 1, 3824, 8, 2, 11)?;
    assert_close("S=3824 W=8 hq=8 hkv=2", e);
    Ok(())
}

#[test]
fn through_candle_op_and_var_grads() -> Result<()> {
    for (w, hq, hkv) in [(4, 8, 2), (2, 4, 4)] {
        let e = run(Drive::Op, w, 2, 32, hq, hkv, 21)?;
        assert_close(&format!("op W={w} hq={hq} hkv={hkv}"), e);
    }
    Ok(())
}

#[test]
fn replication_factors() -> Result<()> {
    assert_eq!(kv_replication(8, 8, 4)?, 1);
    assert_eq!(kv_replication(8, 4, 2)?, 1);
    assert_eq!(kv_replication(8, 2, 2)?, 1);
    assert_eq!(kv_replication(8, 2, 4)?, 2);
    assert_eq!(kv_replication(8, 2, 8)?, 4);
    assert_eq!(kv_replication(32, 8, 16)?, 2);
    Ok(())
}

#[test]
fn invalid_heads_give_clear_errors() -> Result<()> {
    // hq not divisible by P.
    let e = format!("{}", kv_replication(6, 2, 4).err().ok_or_else(|| candle_core::Error::Msg("6/2 on 4 accepted".into()))?);
    assert!(e.contains("hq=6") && e.contains("P=4") && e.contains("1, 2, 6"), "{e}");
    // hkv neither divisible by nor dividing P.
    let e = format!("{}", kv_replication(12, 3, 2).err().ok_or_else(|| candle_core::Error::Msg("12/3 on 2 accepted".into()))?);
    assert!(e.contains("hkv=3") && e.contains("P=2") && e.contains("1, 3, 6, 12"), "{e}");
    // hkv does not divide hq.
    assert!(kv_replication(8, 3, 1).is_err());
    // Through the mode on real ranks: every rank fails with the config error.
    let inp = random_inputs(1, 16, 12, 3, D, 1, &Device::Cpu)?;
    let idx = layout_of(2, |r| contiguous_indices(16, 2, r))?;
    let got = check_mode(Drive::Direct, &idx, &inp, scale(), |comm| Ok(Arc::new(Ulysses::new(comm)) as Arc<dyn AttentionMode>));
    let e = format!("{}", got.err().ok_or_else(|| candle_core::Error::Msg("12/3 heads on 2 ranks accepted".into()))?);
    assert!(e.contains("hkv=3") && e.contains("P=2"), "{e}");
    Ok(())
}

#[test]
fn replicate_then_reduce_sums_copies() -> Result<()> {
    let x = randn(&[2, 5, 3, 4], 3, &Device::Cpu)?;
    let rep = replicate_kv_heads(&x, 4)?;
    assert_eq!(rep.dims(), &[2, 5, 12, 4]);
    // Copies are adjacent: head 4·j + c is original head j.
    for j in 0..3 {
        for c in 0..4 {
            assert_eq!(rel_err(&rep.narrow(2, 4 * j + c, 1)?, &x.narrow(2, j, 1)?)?, 0.0);
        }
    }
    let back = reduce_replicated_kv_grad(&rep, 4)?;
    assert!(rel_err(&back, &(x * 4.0)?)? <= 1e-7); // exact up to f32 rounding of a sum of 4
    Ok(())
}

#[test]
fn seq_to_heads_is_a_reshard_and_heads_to_seq_inverts_it() -> Result<()> {
    // Global x [1, 8, 4, 2]; rank r of 4 holds tokens [2r, 2r+2), all heads.
    let global = randn(&[1, 8, 4, 2], 5, &Device::Cpu)?;
    let ok = run_ranks(4, |comm| {
        let r = comm.rank();
        let local = global.narrow(1, 2 * r, 2)?;
        let heads = seq_to_heads(comm.as_ref(), &local)?;
        let want = global.narrow(2, r, 1)?; // all tokens, head r
        let back = heads_to_seq(comm.as_ref(), &heads)?;
        Ok((rel_err(&heads, &want)?, rel_err(&back, &local)?))
    })?;
    for (r, (a, b)) in ok.into_iter().enumerate() {
        assert_eq!((a, b), (0.0, 0.0), "rank {r}");
    }
    Ok(())
}

#[test]
fn single_rank_output_equals_local_attention() -> Result<()> {
    // Sanity on the helpers: W=1 is a pure pass-through, bit-exact with the kernel.
    let inp = random_inputs(1, 24, 4, 2, D, 9, &Device::Cpu)?;
    let got = run_ranks(1, |comm| Ulysses::new(comm).forward(&inp.q, &inp.k, &inp.v, scale()))?;
    let want = longctx_attention::kernel::fwd(&inp.q, &inp.k, &inp.v, longctx_attention::Mask::Causal, scale())?;
    let (o, lse): &(Tensor, Tensor) = &got[0];
    assert_eq!(rel_err(o, &want.0)?, 0.0);
    assert_eq!(rel_err(lse, &want.1)?, 0.0);
    Ok(())
}
