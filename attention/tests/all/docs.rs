//! Document masks in every mode: a packed batch (several documents per row, different
//! per row) through local, zigzag ring, Ulysses, FPDT and USP on 2 and 4 thread ranks
//! against its documents run one by one through single-device causal attention
//! (`testing::reference_docs`, no document code involved): o, lse, dq, dk, dv.
//! Document sets include one that spans every rank and chunk, and documents of 1–3
//! tokens. Tolerance: max-norm relative error ≤ 1e-5 in f32.

use candle_core::{Device, Result};
use longctx_attention::docs::Docs;
use longctx_attention::local::LocalAttention;
use longctx_attention::mode::AttentionMode;
use longctx_attention::testing::{compare, named_mode, random_inputs, reference_docs, run_mode_docs, Drive, Errors};
use std::sync::Arc;

const TOL: f64 = 1e-5;
const S: usize = 48;

/// Two rows of document starts over S = 48 tokens: row 0 has a long document spanning
/// every rank and chunk (3..45) between short ones; row 1 has documents of 1, 2 and 3
/// tokens mixed with longer ones.
fn doc_sets() -> Vec<Vec<Vec<usize>>> {
    vec![
        vec![vec![0, 3, 45], vec![0, 1, 3, 6, 7, 20, 22, 23, 40]],
        vec![vec![0, 12, 24, 36], vec![0, 47]],
        vec![(0..S).collect(), vec![0, 5]],
    ]
}

fn errors(mode: &str, w: usize, drive: Drive, starts: &[Vec<usize>], seed: u64) -> Result<Errors> {
    let (hq, hkv, d) = (4, 2, 8);
    let inp = random_inputs(starts.len(), S, hq, hkv, d, seed, &Device::Cpu)?;
    let docs = Docs::new(starts.to_vec(), S)?;
    let scale = 1.0 / (d as f64).sqrt();
    let want = reference_docs(&inp, &docs, scale)?;
    let chunk = 24; // FPDT: 2 chunks of 24 global tokens
    let (lists, make) = named_mode(mode, S, w, chunk)?;
    let got = run_mode_docs(drive, &lists, &inp, Some(&docs), scale, make)?;
    compare(&got, &want)
}

#[test]
fn every_mode_equals_its_documents_run_one_by_one() -> Result<()> {
    for (i, starts) in doc_sets().iter().enumerate() {
        for (mode, ws) in [("local", &[1][..]), ("ring", &[2, 4]), ("ulysses", &[2, 4]), ("fpdt", &[2, 4]), ("usp", &[4])] {
            for &w in ws {
                let e = errors(mode, w, Drive::Direct, starts, 7 + i as u64)?;
                assert!(e.max() <= TOL, "{mode} W={w} docs {starts:?}: {e}");
            }
        }
    }
    Ok(())
}

#[test]
fn the_differentiable_op_carries_the_mask() -> Result<()> {
    let starts = &doc_sets()[0];
    for (mode, w) in [("local", 1), ("ring", 4), ("ulysses", 2), ("fpdt", 2), ("usp", 4)] {
        let e = errors(mode, w, Drive::Op, starts, 3)?;
        assert!(e.max() <= TOL, "{mode} W={w}: {e}");
    }
    Ok(())
}

/// Without the mask the same batch gives other results: the test can fail.
#[test]
fn the_mask_changes_the_result() -> Result<()> {
    let starts = &doc_sets()[0];
    let inp = random_inputs(2, S, 4, 2, 8, 1, &Device::Cpu)?;
    let docs = Docs::new(starts.clone(), S)?;
    let want = reference_docs(&inp, &docs, 0.35)?;
    let plain = run_mode_docs(Drive::Direct, &[(0..S).collect()], &inp, None, 0.35, |_| Ok(Arc::new(LocalAttention)))?;
    assert!(compare(&plain, &want)?.o > 1e-2);
    Ok(())
}

#[test]
fn a_mask_of_the_wrong_length_is_refused() {
    let inp = random_inputs(1, S, 4, 2, 8, 1, &Device::Cpu).unwrap();
    let docs = Docs::new(vec![vec![0, 10]], S + 2).unwrap();
    let msg = LocalAttention.forward_docs(&inp.q, &inp.k, &inp.v, Some(&docs), 0.3).unwrap_err().to_string();
    assert!(msg.contains("covers 50 tokens") && msg.contains("48"), "{msg}");
}
