//! FPDT (chunked Ulysses with host offload) vs the single-device reference.
//!
//! Tolerance: f32 on the CPU, max-norm relative error (`max|got-want| / max|want|`)
//! ≤ 1e-5 for o, lse, dq, dk, dv. The chunks are merged with log-sum-exp and the
//! gradients summed over chunks in f32, so the error is rounding only.

use candle_core::{Device, Result, Tensor};
use longctx_attention::comm::thread::run_ranks;
use longctx_attention::fpdt::Fpdt;
use longctx_attention::layout::fpdt_indices;
use longctx_attention::mode::AttentionMode;
use longctx_attention::testing::{check_mode, layout_of, randn, random_inputs, Drive, Errors};
use longctx_attention::Saved;
use std::sync::{Arc, Mutex};

const TOL: f64 = 1e-5;
const D: usize = 16;

fn scale() -> f64 {
    1.0 / (D as f64).sqrt()
}

/// Runs FPDT on `w` ranks with `u` chunks of `c` global tokens and `(hq, hkv)` heads;
/// returns the errors and each rank's high-water mark of resident kv chunks.
fn run(drive: Drive, w: usize, b: usize, (u, c): (usize, usize), (hq, hkv): (usize, usize), offload: bool) -> Result<(Errors, Vec<usize>)> {
    let s = u * c;
    let inp = random_inputs(b, s, hq, hkv, D, 100 + w as u64, &Device::Cpu)?;
    let idx = layout_of(w, |r| fpdt_indices(s, w, c, r))?;
    let modes: Mutex<Vec<Arc<Fpdt>>> = Mutex::new(Vec::new());
    let e = check_mode(drive, &idx, &inp, scale(), |comm| {
        let m = Arc::new(Fpdt::new(comm, c, offload));
        modes.lock().map_err(|_| candle_core::Error::Msg("mode list poisoned".into()))?.push(m.clone());
        Ok(m as Arc<dyn AttentionMode>)
    })?;
    let peaks = modes
        .into_inner()
        .map_err(|_| candle_core::Error::Msg("mode list poisoned".into()))?
        .iter()
        .map(|m| m.max_resident_kv_chunks())
        .collect();
    Ok((e, peaks))
}

fn assert_close(what: &str, e: Errors) {
    println!("{what}: {e}");
    assert!(e.max() <= TOL, "{what}: errors {e} above {TOL:e}");
}

#[test]
fn matches_reference_for_every_world_with_and_without_offload() -> Result<()> {
    // (W, hq, hkv), 4 chunks of C = 24 global tokens (S = 96).
    let cases = [(1, 8, 8), (2, 8, 8), (4, 8, 8), (8, 8, 8), (3, 6, 3), (2, 8, 2), (4, 8, 2), (8, 8, 2)];
    for (w, hq, hkv) in cases {
        for offload in [false, true] {
            let (e, _) = run(Drive::Direct, w, 2, (4, 24), (hq, hkv), offload)?;
            assert_close(&format!("W={w} hq={hq} hkv={hkv} offload={offload}"), e);
        }
    }
    Ok(())
}

#[test]
fn offload_keeps_at_most_two_kv_chunks_resident() -> Result<()> {
    for u in [4, 6] {
        let (e, peaks) = run(Drive::Direct, 4, 1, (u, 16), (8, 2), true)?;
        assert_close(&format!("offload u={u}"), e);
        // Two, not fewer: the prefetch of chunk j+1 overlaps the compute of chunk j.
        assert!(peaks.iter().all(|&p| p == 2), "u={u}: resident kv chunk peaks {peaks:?}, expected 2 per rank");
        // Without offload every parked chunk stays on the device, and the counter says so.
        let (_, peaks) = run(Drive::Direct, 4, 1, (u, 16), (8, 2), false)?;
        assert!(peaks.iter().all(|&p| p == u), "u={u} no offload: peaks {peaks:?}, expected {u}");
    }
    Ok(())
}

#[test]
fn single_chunk_and_many_chunks() -> Result<()> {
    // u = 1 (plain Ulysses) and u = 8 with one local token per chunk and rank.
    let (e, _) = run(Drive::Direct, 2, 1, (1, 32), (4, 2), true)?;
    assert_close("u=1", e);
    let (e, _) = run(Drive::Direct, 4, 1, (8, 4), (4, 4), true)?;
    assert_close("u=8 c/P=1", e);
    Ok(())
}

#[test]
fn through_candle_op_and_var_grads() -> Result<()> {
    for offload in [false, true] {
        let (e, _) = run(Drive::Op, 4, 2, (4, 16), (8, 2), offload)?;
        assert_close(&format!("op W=4 offload={offload}"), e);
    }
    Ok(())
}

/// Runs `Fpdt` forward on `w` ranks with local inputs of `s` tokens; returns the error text.
fn config_error(w: usize, s: usize, c: usize, hq: usize, hkv: usize) -> Result<String> {
    let q = randn(&[1, s, hq, D], 1, &Device::Cpu)?;
    let k = randn(&[1, s, hkv, D], 2, &Device::Cpu)?;
    let got = run_ranks(w, |comm| Fpdt::new(comm, c, true).forward(&q, &k, &k, scale()));
    match got {
        Ok(_) => Err(candle_core::Error::Msg(format!("W={w} s={s} C={c} hq={hq} hkv={hkv} was accepted"))),
        Err(e) => Ok(format!("{e}")),
    }
}

#[test]
fn invalid_settings_give_clear_errors() -> Result<()> {
    // S = 2·20 = 40 not a multiple of C = 16.
    let e = config_error(2, 20, 16, 4, 4)?;
    assert!(e.contains("S=40") && e.contains("C=16"), "{e}");
    // C = 30 not a multiple of P = 4.
    let e = config_error(4, 30, 30, 4, 4)?;
    assert!(e.contains("C=30") && e.contains("P=4"), "{e}");
    // Heads: hq = 6 on 4 ranks.
    let e = config_error(4, 8, 16, 6, 2)?;
    assert!(e.contains("hq=6") && e.contains("P=4"), "{e}");
    // Heads: hkv = 3 neither divides nor is divided by P = 2.
    let e = config_error(2, 8, 16, 12, 3)?;
    assert!(e.contains("hkv=3") && e.contains("P=2"), "{e}");
    Ok(())
}

#[test]
fn backward_rejects_mismatched_do() -> Result<()> {
    let q = randn(&[1, 8, 4, D], 1, &Device::Cpu)?;
    let bad: Tensor = randn(&[1, 8, 2, D], 2, &Device::Cpu)?;
    let lse = q.narrow(3, 0, 1)?.squeeze(3)?.transpose(1, 2)?;
    let got = run_ranks(1, |comm| Fpdt::new(comm, 4, false).backward(&bad, Saved::new(&q, &q, &q, &q, &lse), scale()));
    let e = got.err().map(|e| e.to_string()).unwrap_or_default();
    assert!(e.contains("FPDT backward: do"), "FPDT's own shape check names do: {e}");
    Ok(())
}
