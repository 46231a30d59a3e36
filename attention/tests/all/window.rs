//! Sliding-window attention (issue #31): the band block kernel and every mode against a
//! dense masked attention written with plain loops (`testing::dense_attention`, no mask
//! code of the crate involved): o, lse, dq, dk, dv, max-norm relative error ≤ 1e-5 in f32.
//!
//! - kernel: `Mask::Band` blocks of many shapes (more rows than keys, offsets past the
//!   window, rows that see nothing) through the CPU kernel, the naive kernel and the
//!   dispatching `kernel::fwd`/`bwd` (which cuts bands as the CUDA path does);
//! - modes: local, zigzag ring (W = 2, 4), Ulysses, FPDT (3 chunks), USP 2×2, with windows
//!   of 1, smaller than a chunk, crossing chunks and ranks, and ≥ the sequence, with and
//!   without packed documents, driven directly and through the differentiable op.

use candle_core::{Device, Result};
use longctx_attention::docs::{Docs, Masking};
use longctx_attention::kernel::{self, Mask, Saved};
use longctx_attention::local::LocalAttention;
use longctx_attention::testing::{
    compare, dense_attention, named_mode, randn, random_inputs, reference_window, run_mode_masked, Drive, Errors, Inputs, Outputs,
};
use longctx_attention::{cpu, naive};
use std::sync::Arc;

const TOL: f64 = 1e-5;
const S: usize = 48;

type Kernel = fn(&Inputs, Mask, f64) -> Result<Outputs>;

fn run_kernel(inp: &Inputs, mask: Mask, scale: f64, fwd: FwdFn, bwd: BwdFn) -> Result<Outputs> {
    let (o, lse) = fwd(&inp.q, &inp.k, &inp.v, mask, scale)?;
    let (dq, dk, dv) = bwd(&inp.d_o, Saved::new(&inp.q, &inp.k, &inp.v, &o, &lse), mask, scale)?;
    Ok(Outputs { o, lse, dq, dk, dv })
}
type FwdFn =
    fn(&candle_core::Tensor, &candle_core::Tensor, &candle_core::Tensor, Mask, f64) -> Result<(candle_core::Tensor, candle_core::Tensor)>;
type BwdFn = fn(&candle_core::Tensor, Saved<'_>, Mask, f64) -> Result<(candle_core::Tensor, candle_core::Tensor, candle_core::Tensor)>;

fn block_inputs(s: usize, t: usize, seed: u64) -> Result<Inputs> {
    let (b, hq, hkv, d) = (2, 4, 2, 8);
    let dev = Device::Cpu;
    Ok(Inputs {
        q: randn(&[b, s, hq, d], seed, &dev)?,
        k: randn(&[b, t, hkv, d], seed + 1, &dev)?,
        v: randn(&[b, t, hkv, d], seed + 2, &dev)?,
        d_o: randn(&[b, s, hq, d], seed + 3, &dev)?,
    })
}

/// The CPU kernel, the naive kernel and the dispatching kernel (band cut into calls) on
/// band blocks, each against the dense mask `y ≤ x + offset, x + offset − y < window`.
#[test]
fn band_blocks_equal_a_dense_mask() -> Result<()> {
    let kernels: [(&str, Kernel); 3] = [
        ("cpu", |i, m, s| run_kernel(i, m, s, cpu::fwd, cpu::bwd)),
        ("naive", |i, m, s| run_kernel(i, m, s, naive::fwd, naive::bwd)),
        ("dispatch", |i, m, s| run_kernel(i, m, s, kernel::fwd, kernel::bwd)),
    ];
    let scale = 0.35;
    // shapes across the CPU kernel's 64-row/64-key tiles, more rows than keys, single rows
    for (n, (s, t)) in [(1, 1), (16, 16), (70, 70), (130, 40), (40, 130), (5, 1), (1, 9)].into_iter().enumerate() {
        let inp = block_inputs(s, t, 11 + n as u64)?;
        for offset in [0, 1, 7, 65, 140] {
            for window in [1, 3, 20, 64, 500] {
                let want = dense_attention(&inp, |_, x, y| y <= x + offset && x + offset - y < window, scale)?;
                for (name, k) in &kernels {
                    let e = compare(&k(&inp, Mask::Band { offset, window }, scale)?, &want)?;
                    assert!(e.max() <= TOL, "{name} {s}x{t} offset {offset} window {window}: {e}");
                }
            }
        }
    }
    Ok(())
}

/// A band that covers the whole block equals `Mask::None`; one of offset 0 wider than the
/// block equals `Mask::Causal`; a narrower one differs (the test can fail).
#[test]
fn bands_reduce_to_the_old_masks() -> Result<()> {
    let inp = block_inputs(32, 32, 5)?;
    let r = |m| run_kernel(&inp, m, 0.3, kernel::fwd, kernel::bwd);
    let e = compare(&r(Mask::Band { offset: 40, window: 100 })?, &r(Mask::None)?)?;
    assert!(e.max() <= TOL, "{e}");
    let e = compare(&r(Mask::Band { offset: 0, window: 32 })?, &r(Mask::Causal)?)?;
    assert!(e.max() <= TOL, "{e}");
    assert!(compare(&r(Mask::Band { offset: 0, window: 31 })?, &r(Mask::Causal)?)?.o > 1e-3);
    Ok(())
}

#[test]
fn a_zero_window_is_refused() {
    let inp = block_inputs(4, 4, 1).unwrap();
    let msg = kernel::fwd(&inp.q, &inp.k, &inp.v, Mask::Band { offset: 0, window: 0 }, 0.3).unwrap_err().to_string();
    assert!(msg.contains("window of 0"), "{msg}");
    let msg = Docs::whole(8).unwrap().with_window(0).unwrap_err().to_string();
    assert!(msg.contains("window of 0") || msg.contains("0 tokens"), "{msg}");
}

fn doc_sets() -> Vec<Option<Vec<Vec<usize>>>> {
    vec![None, Some(vec![vec![0, 3, 45], vec![0, 1, 3, 6, 7, 20, 22, 23, 40]]), Some(vec![vec![0, 12, 24, 36], vec![0, 47]])]
}

fn errors(mode: &str, w: usize, drive: Drive, starts: Option<&[Vec<usize>]>, window: usize, seed: u64) -> Result<Errors> {
    let (hq, hkv, d) = (4, 2, 8);
    let inp = random_inputs(2, S, hq, hkv, d, seed, &Device::Cpu)?;
    let docs = starts.map(|s| Docs::new(s.to_vec(), S)).transpose()?;
    let scale = 1.0 / (d as f64).sqrt();
    let want = reference_window(&inp, docs.as_ref(), Some(window), scale)?;
    let chunk = 16; // FPDT: 3 chunks of 16 global tokens
    let (lists, make) = named_mode(mode, S, w, chunk)?;
    let mask = Masking { docs: docs.as_ref(), window: Some(window) };
    let got = run_mode_masked(drive, &lists, &inp, mask, scale, make)?;
    compare(&got, &want)
}

const MODES: [(&str, &[usize]); 5] = [("local", &[1]), ("ring", &[2, 4]), ("ulysses", &[2]), ("fpdt", &[2, 4]), ("usp", &[4])];

/// Windows of 1, smaller than a zigzag chunk at W = 4 (6 tokens), crossing chunks and
/// ranks, and ≥ the sequence, with and without documents.
#[test]
fn every_mode_honours_the_window() -> Result<()> {
    for (i, starts) in doc_sets().iter().enumerate() {
        for window in [1, 4, 13, 30, 48, 100] {
            for (mode, ws) in MODES {
                for &w in ws {
                    let e = errors(mode, w, Drive::Direct, starts.as_deref(), window, 7 + i as u64)?;
                    assert!(e.max() <= TOL, "{mode} W={w} window {window} docs {starts:?}: {e}");
                }
            }
        }
    }
    Ok(())
}

/// The differentiable op carries the window beside the documents (as the model calls it).
#[test]
fn the_differentiable_op_carries_the_window() -> Result<()> {
    for starts in [None, doc_sets()[1].as_deref()] {
        for (mode, w) in [("local", 1), ("ring", 4), ("ulysses", 2), ("fpdt", 2), ("usp", 4)] {
            let e = errors(mode, w, Drive::Op, starts, 9, 3)?;
            assert!(e.max() <= TOL, "{mode} W={w} docs {starts:?}: {e}");
        }
    }
    Ok(())
}

/// Without the window the same inputs give other results: the tests above can fail.
#[test]
fn the_window_changes_the_result() -> Result<()> {
    let inp = random_inputs(2, S, 4, 2, 8, 1, &Device::Cpu)?;
    let want = reference_window(&inp, None, Some(9), 0.35)?;
    let plain = run_mode_masked(Drive::Direct, &[(0..S).collect()], &inp, Masking::default(), 0.35, |_| Ok(Arc::new(LocalAttention)))?;
    assert!(compare(&plain, &want)?.o > 1e-2);
    Ok(())
}
