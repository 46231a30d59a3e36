//! USP (Ulysses inside groups of U ranks, zigzag ring across R groups) on U·R thread
//! ranks against single-device causal attention: o, lse, dq, dk, dv in global order.
//! Tolerance: max-norm relative error ≤ 1e-5 in f32 (all-to-alls move data exactly;
//! only the ring's f32 merge and gradient accumulation reorder sums).
//! Run with `--nocapture` to see the measured error per configuration.

use candle_core::{Device, Result};
use longctx_attention::comm::thread::run_ranks;
use longctx_attention::layout::usp_indices;
use longctx_attention::mode::AttentionMode;
use longctx_attention::testing::{check_mode, layout_of, random_inputs, Drive, Errors};
use longctx_attention::usp::Usp;
use std::sync::Arc;

const TOL: f64 = 1e-5;

/// Errors of USP on `(u, r)` (Ulysses × ring) ranks on a fresh random problem with `(hq, hkv)` heads.
fn usp_errors(drive: Drive, (u, r): (usize, usize), b: usize, s: usize, (hq, hkv): (usize, usize), d: usize, seed: u64) -> Result<Errors> {
    let inp = random_inputs(b, s, hq, hkv, d, seed, &Device::Cpu)?;
    let lists = layout_of(u * r, |k| usp_indices(s, u, r, k))?;
    let scale = 1.0 / (d as f64).sqrt();
    let e = check_mode(drive, &lists, &inp, scale, |world| {
        let m: Arc<dyn AttentionMode> = Arc::new(Usp::split(&world, u, r)?);
        Ok(m)
    })?;
    eprintln!("usp {drive:?} U={u} R={r} b={b} S={s} hq={hq} hkv={hkv} d={d}: {e} (max {:.2e})", e.max());
    Ok(e)
}

#[test]
fn usp_matches_single_device() -> Result<()> {
    // (U, R): 2×2, 4×2 and 2×4, plus the degenerate pure-ring and pure-Ulysses corners
    for (u, r) in [(2, 2), (4, 2), (2, 4), (1, 4), (4, 1)] {
        // MHA, and GQA 8/2 (with U = 4 > hkv the kv heads are replicated)
        for (b, hq, hkv) in [(2, 4, 4), (1, 8, 2)] {
            let e = usp_errors(Drive::Direct, (u, r), b, 2 * r * u * 6, (hq, hkv), 16, (10 * u + r) as u64)?;
            assert!(e.max() <= TOL, "U={u} R={r} hq={hq} hkv={hkv}: {e}");
        }
    }
    Ok(())
}

#[test]
fn usp_awkward_length_at_w8() -> Result<()> {
    // 3824 = 2·2·956 → each ring chunk is 956 tokens, 478 per Ulysses rank
    let e = usp_errors(Drive::Direct, (4, 2), 1, 3824, (4, 2), 16, 3824)?;
    assert!(e.max() <= TOL, "{e}");
    Ok(())
}

#[test]
fn usp_through_the_differentiable_op() -> Result<()> {
    let e = usp_errors(Drive::Op, (2, 2), 1, 48, (8, 2), 16, 42)?;
    assert!(e.max() <= TOL, "{e}");
    Ok(())
}

#[test]
fn usp_invalid_settings_give_clear_errors() {
    let msg = usp_indices(20, 4, 2, 0).err().map(|e| e.to_string()).unwrap_or_default();
    assert!(msg.contains("sequence length 20") && msg.contains("use a multiple of 8"), "{msg}");
    // U·R must be the world size
    let res = run_ranks(4, |c| Usp::split(&c, 3, 2).map(|_| ()));
    let msg = res.err().map(|e| e.to_string()).unwrap_or_default();
    assert!(msg.contains("ulysses 3 × ring 2 must equal the world size 4"), "{msg}");
    // 3 query heads cannot be sharded over U = 2
    let res = run_ranks(4, |c| {
        let usp = Usp::split(&c, 2, 2)?;
        let inp = random_inputs(1, 8, 3, 1, 8, 1, &Device::Cpu)?;
        usp.forward(&inp.q, &inp.k, &inp.v, 0.5).map(|_| ())
    });
    let msg = res.err().map(|e| e.to_string()).unwrap_or_default();
    assert!(msg.contains("hq=3"), "{msg}");
}

#[test]
fn usp_groups_are_consecutive_for_ulysses_and_strided_for_ring() -> Result<()> {
    let got = run_ranks(8, |c| {
        let usp = Usp::split(&c, 4, 2)?;
        Ok((c.rank(), usp.ulysses.rank(), usp.ulysses.world(), usp.ring.rank(), usp.ring.world()))
    })?;
    for (rank, ur, uw, rr, rw) in got {
        assert_eq!((ur, uw, rr, rw), (rank % 4, 4, rank / 4, 2), "world rank {rank}");
    }
    Ok(())
}
