//! Zigzag ring attention on W thread ranks against single-device causal attention
//! (LocalAttention on the whole sequence): o, lse, dq, dk, dv, gathered back to global
//! order. Tolerance: max-norm relative error ≤ 1e-5 in f32 (the ring only reorders
//! f32 sums: the lse merge and the dk/dv/dq accumulation).
//! Run with `--nocapture` to see the measured error per world size.

use candle_core::{Device, Result};
use longctx_attention::comm::thread::run_ranks;
use longctx_attention::comm::Comm;
use longctx_attention::layout::zigzag_indices;
use longctx_attention::mode::AttentionMode;
use longctx_attention::ring::ZigzagRing;
use longctx_attention::testing::{check_mode, compare, layout_of, random_inputs, reference, run_mode, Drive, Errors};
use std::sync::Arc;

const TOL: f64 = 1e-5;

fn ring(comm: Arc<dyn Comm>) -> Result<Arc<dyn AttentionMode>> {
    Ok(Arc::new(ZigzagRing::new(comm)))
}

/// Errors of the zigzag ring at world `w` on a fresh random problem with `(hq, hkv)` heads.
fn ring_errors(drive: Drive, w: usize, b: usize, s: usize, (hq, hkv): (usize, usize), d: usize, seed: u64) -> Result<Errors> {
    let inp = random_inputs(b, s, hq, hkv, d, seed, &Device::Cpu)?;
    let lists = layout_of(w, |r| zigzag_indices(s, w, r))?;
    let scale = 1.0 / (d as f64).sqrt();
    let e = check_mode(drive, &lists, &inp, scale, ring)?;
    eprintln!("ring {drive:?} W={w} b={b} S={s} hq={hq} hkv={hkv} d={d}: {e} (max {:.2e})", e.max());
    Ok(e)
}

#[test]
fn ring_matches_single_device_mha_and_gqa() -> Result<()> {
    for w in [1, 2, 3, 4, 8] {
        // MHA and GQA (8 query heads on 2 kv heads); 12 tokens per chunk
        for (b, hq, hkv) in [(2, 4, 4), (1, 8, 2)] {
            let e = ring_errors(Drive::Direct, w, b, 2 * w * 12, (hq, hkv), 16, 7 + w as u64)?;
            assert!(e.max() <= TOL, "W={w} hq={hq} hkv={hkv}: {e}");
        }
    }
    Ok(())
}

#[test]
fn ring_awkward_length_at_w8() -> Result<()> {
    // 3824 = 16 · 239: chunks of 239 tokens, not a power of two
    let e = ring_errors(Drive::Direct, 8, 1, 3824, (4, 2), 16, 3824)?;
    assert!(e.max() <= TOL, "{e}");
    Ok(())
}

#[test]
fn ring_through_the_differentiable_op() -> Result<()> {
    // gradients as Candle's backward sees them: Vars, op::attention, sum(o·do).backward()
    for w in [2, 4] {
        let e = ring_errors(Drive::Op, w, 1, 2 * w * 10, (8, 2), 16, 99)?;
        assert!(e.max() <= TOL, "W={w}: {e}");
    }
    Ok(())
}

#[test]
fn ring_on_one_rank_is_exactly_local() -> Result<()> {
    let inp = random_inputs(1, 40, 4, 2, 16, 5, &Device::Cpu)?;
    let want = reference(&inp, 0.25)?;
    let got = run_mode(&[(0..40).collect()], &inp, 0.25, ring)?;
    let e = compare(&got, &want)?;
    assert_eq!(e.max(), 0.0, "W=1 ring differs from LocalAttention: {e}");
    Ok(())
}

#[test]
fn invalid_settings_give_clear_errors() {
    let msg = zigzag_indices(3000, 8, 0).err().map(|e| e.to_string()).unwrap_or_default();
    assert!(msg.contains("3000") && msg.contains("use a multiple of 16"), "{msg}");
    // an odd local length cannot be two zigzag chunks
    let res = run_ranks(2, |c| {
        let inp = random_inputs(1, 5, 2, 2, 8, 1, &Device::Cpu)?;
        ZigzagRing::new(c).forward(&inp.q, &inp.k, &inp.v, 0.5).map(|_| ())
    });
    let msg = res.err().map(|e| e.to_string()).unwrap_or_default();
    assert!(msg.contains("local length 5 must be even"), "{msg}");
}
