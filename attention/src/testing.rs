//! Helpers shared by the mode tests (hidden from the docs; not a stable API).
//!
//! Shapes: global `q [b, S, hq, d]`, `k`/`v [b, S, hkv, d]`, `do [b, S, hq, d]`,
//! `lse [b, hq, S]`; each rank gets the rows of its layout's index list
//! ([`crate::layout`]) and the results are put back in global order before they are
//! compared with the single-device reference ([`crate::local::LocalAttention`]).
//!
//! Errors are max-norm relative: `max|got - want| / max|want|` per tensor.

use crate::comm::thread::run_ranks;
use crate::comm::Comm;
use crate::docs::{Docs, Masking};
use crate::kernel::Saved;
use crate::layout::{gather, gather_seq, take_seq};
use crate::local::LocalAttention;
use crate::mode::AttentionMode;
use candle_core::{DType, Device, Result, Tensor, Var};
use std::sync::Arc;

/// Global inputs of one attention call plus the upstream gradient `do`.
#[derive(Debug, Clone)]
pub struct Inputs {
    pub q: Tensor,   // [b, S, hq, d]
    pub k: Tensor,   // [b, S, hkv, d]
    pub v: Tensor,   // [b, S, hkv, d]
    pub d_o: Tensor, // [b, S, hq, d]
}

/// Forward and backward results, in global token order.
#[derive(Debug, Clone)]
pub struct Outputs {
    pub o: Tensor,   // [b, S, hq, d]
    pub lse: Tensor, // [b, hq, S]
    pub dq: Tensor,  // [b, S, hq, d]
    pub dk: Tensor,  // [b, S, hkv, d]
    pub dv: Tensor,  // [b, S, hkv, d]
}

/// Max-norm relative error of each output.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Errors {
    pub o: f64,
    pub lse: f64,
    pub dq: f64,
    pub dk: f64,
    pub dv: f64,
}

impl Errors {
    /// The largest error; NaN counts as infinite (`f64::max` would skip it).
    pub fn max(&self) -> f64 {
        [self.o, self.lse, self.dq, self.dk, self.dv].into_iter().fold(0.0, |m, e| if e.is_nan() { f64::INFINITY } else { m.max(e) })
    }
}

impl std::fmt::Display for Errors {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "o {:.2e} lse {:.2e} dq {:.2e} dk {:.2e} dv {:.2e}", self.o, self.lse, self.dq, self.dk, self.dv)
    }
}

/// Standard normal f32 tensor from a fixed seed (splitmix64 + Box-Muller), built on
/// the CPU and moved to `device`, so every device sees the same numbers.
pub fn randn(shape: &[usize], seed: u64, device: &Device) -> Result<Tensor> {
    let n: usize = shape.iter().product();
    let mut state = seed ^ 0x9e37_79b9_7f4a_7c15;
    let mut next = || {
        state = state.wrapping_add(0x9e37_79b9_7f4a_7c15);
        let mut z = state;
        z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
        z ^ (z >> 31)
    };
    let mut out = Vec::with_capacity(n + 1);
    while out.len() < n {
        // uniforms in (0, 1]
        let u1 = ((next() >> 11) as f64 + 1.0) / (1u64 << 53) as f64;
        let u2 = (next() >> 11) as f64 / (1u64 << 53) as f64;
        let r = (-2.0 * u1.ln()).sqrt();
        let t = 2.0 * std::f64::consts::PI * u2;
        out.push((r * t.cos()) as f32);
        out.push((r * t.sin()) as f32);
    }
    out.truncate(n);
    Tensor::from_vec(out, shape, &Device::Cpu)?.to_device(device)
}

/// Random f32 inputs (q, k, v, do), seeded.
pub fn random_inputs(b: usize, s: usize, hq: usize, hkv: usize, d: usize, seed: u64, device: &Device) -> Result<Inputs> {
    Ok(Inputs {
        q: randn(&[b, s, hq, d], seed, device)?,
        k: randn(&[b, s, hkv, d], seed.wrapping_add(1), device)?,
        v: randn(&[b, s, hkv, d], seed.wrapping_add(2), device)?,
        d_o: randn(&[b, s, hq, d], seed.wrapping_add(3), device)?,
    })
}

/// Single-device causal attention on the whole sequence, forward and backward.
pub fn reference(inp: &Inputs, scale: f64) -> Result<Outputs> {
    let m = LocalAttention;
    let (o, lse) = m.forward(&inp.q, &inp.k, &inp.v, scale)?;
    let (dq, dk, dv) = m.backward(&inp.d_o, Saved::new(&inp.q, &inp.k, &inp.v, &o, &lse), scale)?;
    Ok(Outputs { o, lse, dq, dk, dv })
}

/// The independent reference of a document mask: every document of every row run on
/// its own through single-device causal attention (no document code involved), the
/// results laid back in place.
pub fn reference_docs(inp: &Inputs, docs: &Docs, scale: f64) -> Result<Outputs> {
    let (b, _, _, _) = inp.q.dims4()?;
    let mut rows: Vec<Outputs> = Vec::with_capacity(b);
    for r in 0..b {
        let mut parts: Vec<Outputs> = Vec::new();
        for d in docs.ranges(r) {
            let cut = |t: &Tensor| t.narrow(0, r, 1)?.narrow(1, d.start, d.len());
            let one = Inputs { q: cut(&inp.q)?, k: cut(&inp.k)?, v: cut(&inp.v)?, d_o: cut(&inp.d_o)? };
            parts.push(reference(&one, scale)?);
        }
        let cat = |f: fn(&Outputs) -> &Tensor, dim: usize| Tensor::cat(&parts.iter().map(|p| f(p).clone()).collect::<Vec<_>>(), dim);
        rows.push(Outputs {
            o: cat(|x| &x.o, 1)?,
            lse: cat(|x| &x.lse, 2)?,
            dq: cat(|x| &x.dq, 1)?,
            dk: cat(|x| &x.dk, 1)?,
            dv: cat(|x| &x.dv, 1)?,
        });
    }
    let cat = |f: fn(&Outputs) -> &Tensor| Tensor::cat(&rows.iter().map(|p| f(p).clone()).collect::<Vec<_>>(), 0);
    Ok(Outputs { o: cat(|x| &x.o)?, lse: cat(|x| &x.lse)?, dq: cat(|x| &x.dq)?, dk: cat(|x| &x.dk)?, dv: cat(|x| &x.dv)? })
}

/// Attention with an explicit dense mask, in f64 with plain loops (no kernel, no mask code
/// of this crate): query `i` of batch row `r` sees key `j` iff `keep(r, i, j)`. `q [b,s,hq,d]`,
/// `k`/`v [b,t,hkv,d]`; the backward takes this forward's own `o`/`lse`. Rows that see no
/// key get `o = 0`, `lse = -inf` and zero gradients.
pub fn dense_attention(inp: &Inputs, keep: impl Fn(usize, usize, usize) -> bool, scale: f64) -> Result<Outputs> {
    let (b, s, hq, d) = inp.q.dims4()?;
    let (_, t, hkv, _) = inp.k.dims4()?;
    let host = |x: &Tensor| -> Result<Vec<f64>> { x.to_dtype(DType::F64)?.flatten_all()?.to_vec1() };
    let (q, k, v, d_o) = (host(&inp.q)?, host(&inp.k)?, host(&inp.v)?, host(&inp.d_o)?);
    let g = hq / hkv;
    let qa = |r: usize, i: usize, h: usize| ((r * s + i) * hq + h) * d;
    let ka = |r: usize, j: usize, h: usize| ((r * t + j) * hkv + h / g) * d;
    let dot = |a: &[f64], b: &[f64]| a.iter().zip(b).map(|(x, y)| x * y).sum::<f64>();
    let (mut o, mut lse) = (vec![0f64; q.len()], vec![f64::NEG_INFINITY; b * hq * s]);
    let (mut dq, mut dk, mut dv) = (vec![0f64; q.len()], vec![0f64; k.len()], vec![0f64; v.len()]);
    for r in 0..b {
        for h in 0..hq {
            for i in 0..s {
                let qi = &q[qa(r, i, h)..][..d];
                let js: Vec<usize> = (0..t).filter(|&j| keep(r, i, j)).collect();
                if js.is_empty() {
                    continue;
                }
                let sc: Vec<f64> = js.iter().map(|&j| scale * dot(qi, &k[ka(r, j, h)..][..d])).collect();
                let m = sc.iter().cloned().fold(f64::NEG_INFINITY, f64::max);
                let l = m + sc.iter().map(|x| (x - m).exp()).sum::<f64>().ln();
                lse[(r * hq + h) * s + i] = l;
                let p: Vec<f64> = sc.iter().map(|x| (x - l).exp()).collect();
                let oi = qa(r, i, h);
                for (&j, &pj) in js.iter().zip(&p) {
                    for c in 0..d {
                        o[oi + c] += pj * v[ka(r, j, h) + c];
                    }
                }
                let doi = &d_o[oi..][..d];
                let dd = dot(doi, &o[oi..][..d]);
                for (&j, &pj) in js.iter().zip(&p) {
                    let ds = pj * (dot(doi, &v[ka(r, j, h)..][..d]) - dd);
                    for c in 0..d {
                        dq[oi + c] += scale * ds * k[ka(r, j, h) + c];
                        dk[ka(r, j, h) + c] += scale * ds * qi[c];
                        dv[ka(r, j, h) + c] += pj * doi[c];
                    }
                }
            }
        }
    }
    let dev = inp.q.device();
    let t4 = |x: Vec<f64>, sh: (usize, usize, usize, usize)| Tensor::from_vec(x, sh, dev)?.to_dtype(DType::F32);
    Ok(Outputs {
        o: t4(o, (b, s, hq, d))?,
        lse: Tensor::from_vec(lse, (b, hq, s), dev)?.to_dtype(DType::F32)?,
        dq: t4(dq, (b, s, hq, d))?,
        dk: t4(dk, (b, t, hkv, d))?,
        dv: t4(dv, (b, t, hkv, d))?,
    })
}

/// The dense reference of a document mask with a sliding window: query `i` sees key `j`
/// iff `j ≤ i`, `i − j < window` and both lie in one document of the row.
pub fn reference_window(inp: &Inputs, docs: Option<&Docs>, window: Option<usize>, scale: f64) -> Result<Outputs> {
    let s = inp.q.dim(1)?;
    let doc_of = |r: usize| -> Vec<usize> {
        let mut out = vec![0; s];
        if let Some(d) = docs {
            for (n, range) in d.ranges(r).into_iter().enumerate() {
                out[range].iter_mut().for_each(|x| *x = n);
            }
        }
        out
    };
    let rows: Vec<Vec<usize>> = (0..inp.q.dim(0)?).map(doc_of).collect();
    let w = window.unwrap_or(usize::MAX);
    dense_attention(inp, |r, i, j| j <= i && i - j < w && rows[r][i] == rows[r][j], scale)
}

/// `max|got - want| / max|want|` in f64 on the host (the absolute difference when `want`
/// is all zeros; shapes must agree). Equal entries count 0 (two `-inf` too); a NaN anywhere
/// in `got` or `want`, or an infinity on one side only, gives infinity:
/// Candle's `max` skips NaNs, which would let a NaN output pass any tolerance.
pub fn rel_err(got: &Tensor, want: &Tensor) -> Result<f64> {
    if got.dims() != want.dims() {
        return crate::shape_err!("rel_err: got {:?}, want {:?}", got.dims(), want.dims());
    }
    let host = |t: &Tensor| -> Result<Vec<f64>> { t.to_device(&candle_core::Device::Cpu)?.to_dtype(DType::F64)?.flatten_all()?.to_vec1() };
    let (g, w) = (host(got)?, host(want)?);
    let (mut diff, mut norm) = (0f64, 0f64);
    for (a, b) in g.iter().zip(&w) {
        if b.is_finite() {
            norm = norm.max(b.abs());
        }
        if a == b {
            // equal, infinities included (a row that sees no key has lse = -inf on both sides)
            continue;
        }
        let d = (a - b).abs();
        if d.is_nan() {
            return Ok(f64::INFINITY);
        }
        diff = diff.max(d);
    }
    Ok(if norm == 0.0 { diff } else { diff / norm })
}

pub fn compare(got: &Outputs, want: &Outputs) -> Result<Errors> {
    Ok(Errors {
        o: rel_err(&got.o, &want.o)?,
        lse: rel_err(&got.lse, &want.lse)?,
        dq: rel_err(&got.dq, &want.dq)?,
        dk: rel_err(&got.dk, &want.dk)?,
        dv: rel_err(&got.dv, &want.dv)?,
    })
}

/// How a rank drives its mode in [`run_mode_with`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Drive {
    /// `mode.forward` then `mode.backward` directly.
    Direct,
    /// Through [`crate::op::attention_with_lse`] on `Var`s and Candle's backward of
    /// `sum(o * do)`, so the gradients are those a training step would see.
    Op,
}

/// Runs `make(comm)`'s mode on `indices.len()` thread ranks, rank `r` holding the
/// global tokens `indices[r]`, and returns the results in global order.
pub fn run_mode<F>(indices: &[Vec<usize>], inp: &Inputs, scale: f64, make: F) -> Result<Outputs>
where
    F: Fn(Arc<dyn Comm>) -> Result<Arc<dyn AttentionMode>> + Sync,
{
    run_mode_with(Drive::Direct, indices, inp, scale, make)
}

/// [`run_mode`] with a choice of how each rank drives its mode.
pub fn run_mode_with<F>(drive: Drive, indices: &[Vec<usize>], inp: &Inputs, scale: f64, make: F) -> Result<Outputs>
where
    F: Fn(Arc<dyn Comm>) -> Result<Arc<dyn AttentionMode>> + Sync,
{
    run_mode_docs(drive, indices, inp, None, scale, make)
}

/// [`run_mode_with`] under a document mask (global token indices): `Direct` passes it to
/// `forward_docs`/`backward_docs`, `Op` wraps the mode with [`crate::mode::with_docs`].
pub fn run_mode_docs<F>(drive: Drive, indices: &[Vec<usize>], inp: &Inputs, docs: Option<&Docs>, scale: f64, make: F) -> Result<Outputs>
where
    F: Fn(Arc<dyn Comm>) -> Result<Arc<dyn AttentionMode>> + Sync,
{
    run_mode_masked(drive, indices, inp, Masking::docs(docs), scale, make)
}

/// [`run_mode_docs`] with a sliding window too: `Direct` passes `mask` to
/// `forward_masked`/`backward_masked`; `Op` wraps the mode with the documents and passes
/// the window through [`crate::op::attention_windowed`], as the model does.
pub fn run_mode_masked<F>(drive: Drive, indices: &[Vec<usize>], inp: &Inputs, mask: Masking<'_>, scale: f64, make: F) -> Result<Outputs>
where
    F: Fn(Arc<dyn Comm>) -> Result<Arc<dyn AttentionMode>> + Sync,
{
    let world = indices.len();
    let per_rank = run_ranks(world, |comm| {
        let idx = &indices[comm.rank()];
        let (q, k, v, d_o) = (take_seq(&inp.q, idx)?, take_seq(&inp.k, idx)?, take_seq(&inp.v, idx)?, take_seq(&inp.d_o, idx)?);
        let mode = make(comm)?;
        match drive {
            Drive::Direct => {
                let (o, lse) = mode.forward_masked(&q, &k, &v, mask, scale)?;
                let (dq, dk, dv) = mode.backward_masked(&d_o, Saved::new(&q, &k, &v, &o, &lse), mask, scale)?;
                Ok(Outputs { o, lse, dq, dk, dv })
            }
            Drive::Op => {
                let mode = crate::mode::with_docs(&mode, mask.docs.cloned());
                let (qv, kv, vv) = (Var::from_tensor(&q)?, Var::from_tensor(&k)?, Var::from_tensor(&v)?);
                let (o, lse) = crate::op::attention_windowed(&mode, qv.as_tensor(), kv.as_tensor(), vv.as_tensor(), mask.window, scale)?;
                let grads = (&o * &d_o)?.sum_all()?.backward()?;
                let grad = |x: &Var, name: &str| -> Result<Tensor> {
                    match grads.get(x.as_tensor()) {
                        Some(g) => Ok(g.clone()),
                        None => crate::shape_err!("op backward produced no gradient for {name}"),
                    }
                };
                Ok(Outputs { dq: grad(&qv, "q")?, dk: grad(&kv, "k")?, dv: grad(&vv, "v")?, o: o.detach(), lse })
            }
        }
    })?;
    let pick = |f: fn(&Outputs) -> &Tensor| per_rank.iter().map(|x| f(x).clone()).collect::<Vec<_>>();
    Ok(Outputs {
        o: gather_seq(&pick(|x| &x.o), indices)?,
        lse: gather(&pick(|x| &x.lse), 2, indices)?,
        dq: gather_seq(&pick(|x| &x.dq), indices)?,
        dk: gather_seq(&pick(|x| &x.dk), indices)?,
        dv: gather_seq(&pick(|x| &x.dv), indices)?,
    })
}

/// Errors of a mode against the single-device reference.
pub fn check_mode<F>(drive: Drive, indices: &[Vec<usize>], inp: &Inputs, scale: f64, make: F) -> Result<Errors>
where
    F: Fn(Arc<dyn Comm>) -> Result<Arc<dyn AttentionMode>> + Sync,
{
    let want = reference(inp, scale)?;
    let got = run_mode_with(drive, indices, inp, scale, make)?;
    compare(&got, &want)
}

/// What [`named_mode`] gives to build a rank's mode from its communicator.
pub type ModeMaker = Box<dyn Fn(Arc<dyn Comm>) -> Result<Arc<dyn AttentionMode>> + Sync>;

/// A mode of the mode tests by name over `w` ranks, with the layout it runs on: each
/// rank's global indices of `s` tokens and a maker for [`run_mode_masked`]. `local` (one
/// rank, all tokens), `ring` (zigzag), `ulysses` (contiguous), `fpdt` (chunks of `chunk`
/// global tokens, kv offload) and `usp` (2 × w/2).
pub fn named_mode(mode: &str, s: usize, w: usize, chunk: usize) -> Result<(Vec<Vec<usize>>, ModeMaker)> {
    use crate::layout::{contiguous_indices, fpdt_indices, usp_indices, zigzag_indices};
    let lists = match mode {
        "local" => vec![(0..s).collect()],
        "ring" => layout_of(w, |r| zigzag_indices(s, w, r))?,
        "ulysses" => layout_of(w, |r| contiguous_indices(s, w, r))?,
        "fpdt" => layout_of(w, |r| fpdt_indices(s, w, chunk, r))?,
        "usp" => layout_of(w, |r| usp_indices(s, 2, w / 2, r))?,
        _ => return crate::shape_err!("unknown test mode `{mode}`: local, ring, ulysses, fpdt or usp"),
    };
    let mode = mode.to_string();
    let make: ModeMaker = Box::new(move |c: Arc<dyn Comm>| -> Result<Arc<dyn AttentionMode>> {
        Ok(match mode.as_str() {
            "ring" => Arc::new(crate::ring::ZigzagRing::new(c)),
            "ulysses" => Arc::new(crate::ulysses::Ulysses::new(c)),
            "fpdt" => Arc::new(crate::fpdt::Fpdt::new(c, chunk, true)),
            "usp" => Arc::new(crate::usp::Usp::split(&c, 2, w / 2)?),
            _ => Arc::new(LocalAttention),
        })
    });
    Ok((lists, make))
}

/// Per-rank index lists of a layout function `f(rank)` over `world` ranks.
pub fn layout_of(world: usize, f: impl Fn(usize) -> Result<Vec<usize>>) -> Result<Vec<Vec<usize>>> {
    (0..world).map(f).collect()
}
