//! Document masks: block-diagonal causal attention over packed documents, optionally
//! with a sliding window.
//!
//! A packed sample holds several documents; query `i` sees key `j` only when `j ≤ i` and
//! both lie in the same document. [`Docs`] holds, per batch row, the global index at
//! which every document starts (the first at 0), and optionally a sliding window `W`:
//! then `i − j < W` too (transformers' sliding-window layers, Mistral / Qwen2 / Gemma).
//! A mode receives both as a [`Masking`] (the batch's documents, the layer's window) and
//! turns it into one `Docs` with [`resolve`].
//!
//! Every mode describes each block it computes by the global token ranges of its local
//! q rows and kv rows ([`Block`]: ranges in local order, e.g. a zigzag rank's two chunks).
//! [`fwd`] / [`bwd`] cut the block into pieces, one per pair (q range ∩ document,
//! kv range ∩ the same document): a piece whose kv range ends before its q range starts
//! is unmasked, one on the diagonal (the same range) is causal, one after is dropped.
//! Under a window a piece is also classified against it: entirely inside stays as above,
//! entirely outside is dropped (no kernel call: the work scales with `S·W`), partly inside
//! becomes a band ([`Mask::Band`], cut further by [`crate::band`]).
//! Each piece is one call of the block kernel ([`crate::kernel`]) with that mask, so the
//! work is the sum over documents of their own causal blocks, ∝ Σ lenᵢ² and never S²;
//! a block with no piece at all is skipped (`None`: no kernel call, nothing to merge).
//!
//! Shapes (crate legend): `q [b, s, hq, d]`, `k`/`v [b, t, hkv, d]`, `o [b, s, hq, d]`,
//! `lse [b, hq, s]` f32. A q row that shares no document with any kv row of the block
//! gets `o = 0`, `lse = -inf` (the merge treats it as "no key seen"); its gradients are 0.
//! The ranges of the q and kv sides must come from one grid (each pair equal or
//! disjoint), which every mode's layout guarantees; anything else is an error.

use crate::kernel::{self, Mask, Saved};
use crate::merge;
use candle_core::{DType, Result, Tensor};
use std::collections::BTreeMap;
use std::ops::Range;

/// Document starts per batch row over a global sequence of `len` tokens.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Docs {
    /// Empty: one document in every row, whatever the batch.
    rows: Vec<Vec<usize>>,
    len: usize,
    window: Option<usize>,
}

/// What masks a mode's attention beyond causality: the batch's packed documents (`None`:
/// one per row) and the layer's sliding window (`None`: full causal).
#[derive(Debug, Clone, Copy, Default)]
pub struct Masking<'a> {
    pub docs: Option<&'a Docs>,
    pub window: Option<usize>,
}

impl<'a> Masking<'a> {
    pub fn docs(docs: Option<&'a Docs>) -> Self {
        Masking { docs, window: None }
    }
    pub fn window(window: Option<usize>) -> Self {
        Masking { docs: None, window }
    }
}

impl Docs {
    /// `rows[r]`: the start of every document of row `r`, ascending, the first 0, all
    /// `< len`; an empty row is one document. Errors name the row and the offending start.
    pub fn new(rows: Vec<Vec<usize>>, len: usize) -> Result<Self> {
        if len == 0 {
            return crate::config_err!("document mask: the sequence is empty");
        }
        for (r, starts) in rows.iter().enumerate() {
            if let Some(&first) = starts.first() {
                if first != 0 {
                    return crate::config_err!(
                        "document mask: row {r}'s first document starts at {first}, expected 0 (the spans must cover the sample)"
                    );
                }
            }
            if let Some(w) = starts.windows(2).find(|w| w[1] <= w[0]) {
                return crate::config_err!("document mask: row {r}'s document starts must ascend, got {} then {}", w[0], w[1]);
            }
            if let Some(&last) = starts.last() {
                if last >= len {
                    return crate::config_err!(
                        "document mask: row {r} has a document starting at {last}, outside the sequence of {len} tokens"
                    );
                }
            }
        }
        Ok(Self { rows, len, window: None })
    }

    /// One document in every row over `len` tokens (a mask only through a window).
    pub fn whole(len: usize) -> Result<Self> {
        Self::new(Vec::new(), len)
    }

    /// The same documents under a sliding window of `window` keys (the smaller of the two
    /// when one is set already). A window of 0 is refused.
    pub fn with_window(mut self, window: usize) -> Result<Self> {
        if window == 0 {
            return crate::config_err!("sliding window of 0 tokens: a query must see at least itself (window ≥ 1)");
        }
        self.window = Some(self.window.map_or(window, |w| w.min(window)));
        Ok(self)
    }

    /// The sliding window, if any.
    pub fn window(&self) -> Option<usize> {
        self.window
    }

    /// Global sequence length.
    pub fn len(&self) -> usize {
        self.len
    }

    /// Never true (a mask covers at least one token); for clippy's `len` convention.
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// Batch rows (0 for [`Docs::whole`]: any batch).
    pub fn rows(&self) -> usize {
        self.rows.len()
    }

    /// Every row a single document and no window that masks anything: plain causal attention.
    pub fn is_trivial(&self) -> bool {
        self.rows.iter().all(|r| r.len() <= 1) && self.window.is_none_or(|w| w >= self.len)
    }

    /// The documents of row `r` as global ranges.
    pub fn ranges(&self, r: usize) -> Vec<Range<usize>> {
        let starts = self.rows.get(r).map(Vec::as_slice).unwrap_or(&[]);
        if starts.is_empty() {
            return vec![0..self.len];
        }
        starts.iter().enumerate().map(|(i, &a)| a..starts.get(i + 1).copied().unwrap_or(self.len)).collect()
    }

    /// Causal attention work (query-key pairs) relative to one document per row:
    /// Σ lenᵢ(lenᵢ+1) / (rows · S(S+1)).
    pub fn work_fraction(&self) -> f64 {
        let pairs = |n: usize| n as f64 * (n as f64 + 1.0) / 2.0;
        // (query, key) pairs a document of n tokens attends: all causal ones, or under a
        // window of w the first w rows' triangle and w keys for every later row
        let seen = |n: usize| match self.window {
            Some(w) if w < n => pairs(w) + ((n - w) * w) as f64,
            _ => pairs(n),
        };
        let rows = self.rows().max(1);
        let total: f64 = (0..rows).flat_map(|r| self.ranges(r)).map(|d| seen(d.len())).sum();
        total / (rows as f64 * pairs(self.len))
    }
}

/// The one mask a mode attends under for `global` tokens: the documents of `m` (checked to
/// cover them) with its window; `None` when nothing masks beyond causality (the modes' fast
/// path). `what` names the mode in errors.
pub fn resolve<'a>(m: Masking<'a>, global: usize, what: &str) -> Result<Option<std::borrow::Cow<'a, Docs>>> {
    use std::borrow::Cow;
    check_len(m.docs, global, what)?;
    let docs = match (m.docs, m.window) {
        (d, None) => d.map(Cow::Borrowed),
        (Some(d), Some(w)) => Some(Cow::Owned(d.clone().with_window(w)?)),
        (None, Some(w)) => Some(Cow::Owned(Docs::whole(global)?.with_window(w)?)),
    };
    Ok(docs.filter(|d| !d.is_trivial()))
}

/// Checks that `docs` covers the `global` tokens a mode attends over; `what` names the mode.
pub fn check_len(docs: Option<&Docs>, global: usize, what: &str) -> Result<()> {
    match docs {
        Some(d) if d.len() != global => {
            crate::shape_err!("{what}: the document mask covers {} tokens, the sequence has {global}", d.len())
        }
        _ => Ok(()),
    }
}

/// One block of a split attention under a document mask: the global token ranges that
/// the local q rows and kv rows hold, in local order (their lengths sum to `s` and `t`).
#[derive(Debug, Clone, Copy)]
pub struct Block<'a> {
    pub docs: &'a Docs,
    pub q: &'a [Range<usize>],
    pub kv: &'a [Range<usize>],
}

/// A contiguous local run of rows inside one document.
#[derive(Debug, Clone, PartialEq, Eq)]
struct Run {
    /// Local row offset.
    at: usize,
    /// Global range.
    glob: Range<usize>,
}

/// A kernel call: q run × kv run with `mask`.
#[derive(Debug, Clone, PartialEq, Eq)]
struct Piece {
    q: Run,
    kv: Run,
    mask: Mask,
}

/// `segs` (global ranges in local order) cut at document boundaries: (document, run).
fn runs(segs: &[Range<usize>], docs: &[Range<usize>]) -> Vec<(usize, Run)> {
    let mut out = Vec::new();
    let mut at = 0;
    for seg in segs {
        let first = docs.partition_point(|d| d.end <= seg.start);
        for (di, d) in docs.iter().enumerate().skip(first) {
            if d.start >= seg.end {
                break;
            }
            let glob = d.start.max(seg.start)..d.end.min(seg.end);
            out.push((di, Run { at: at + glob.start - seg.start, glob }));
        }
        at += seg.len();
    }
    out
}

/// The kernel calls of row `r` of `blk`, in q-run order.
fn pieces(blk: &Block<'_>, r: usize) -> Result<Vec<Piece>> {
    let docs = blk.docs.ranges(r);
    let (qr, kr) = (runs(blk.q, &docs), runs(blk.kv, &docs));
    let mut by_doc: BTreeMap<usize, Vec<&Run>> = BTreeMap::new();
    for (d, run) in &kr {
        by_doc.entry(*d).or_default().push(run);
    }
    let mut out = Vec::new();
    let w = blk.docs.window.unwrap_or(usize::MAX);
    for (d, q) in &qr {
        for kv in by_doc.get(d).into_iter().flatten() {
            // the nearest and farthest (query, key) pairs of the piece, i − j
            let (near, far) = (q.glob.start.saturating_sub(kv.glob.end - 1), (q.glob.end - 1).saturating_sub(kv.glob.start));
            let band = Mask::Band { offset: q.glob.start.saturating_sub(kv.glob.start), window: w };
            let mask = if kv.glob.end <= q.glob.start {
                if near >= w {
                    continue; // every key left the window
                }
                if far < w {
                    Mask::None
                } else {
                    band
                }
            } else if kv.glob == q.glob {
                if far < w {
                    Mask::Causal
                } else {
                    band
                }
            } else if kv.glob.start >= q.glob.end {
                continue; // keys after every query: nothing to see
            } else {
                return crate::config_err!(
                    "document mask: q tokens {:?} and kv tokens {:?} overlap without being the same range (the layout's blocks must share one grid)",
                    q.glob,
                    kv.glob
                );
            };
            out.push(Piece { q: q.clone(), kv: (*kv).clone(), mask });
        }
    }
    Ok(out)
}

/// Consecutive lone diagonal pieces of one length: `n` documents of `len` tokens from
/// local row `at`, computed as one kernel call with the documents as its batch (a view:
/// `[1, n·len, h, d]` is `[n, len, h, d]`), so 64 documents of 1K cost one launch.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct Group {
    at: usize,
    len: usize,
    n: usize,
}

/// Splits a row's pieces into batched groups and the rest. A piece joins a group when it
/// is the only piece of its q run and of its kv run, causal on the diagonal (the same
/// rows on both sides), and follows the group's last document directly with its length.
fn batched(ps: Vec<Piece>) -> (Vec<Group>, Vec<Piece>) {
    let mut uses: BTreeMap<(usize, bool), usize> = BTreeMap::new();
    for p in &ps {
        *uses.entry((p.q.at, true)).or_default() += 1;
        *uses.entry((p.kv.at, false)).or_default() += 1;
    }
    let (mut groups, mut rest): (Vec<Group>, Vec<Piece>) = (Vec::new(), Vec::new());
    for p in ps {
        let lone = uses[&(p.q.at, true)] == 1 && uses[&(p.kv.at, false)] == 1;
        if !(lone && p.mask == Mask::Causal && p.q.at == p.kv.at && p.q.glob == p.kv.glob) {
            rest.push(p);
            continue;
        }
        let len = p.q.glob.len();
        match groups.last_mut() {
            Some(g) if g.len == len && g.at + g.n * g.len == p.q.at => g.n += 1,
            _ => groups.push(Group { at: p.q.at, len, n: 1 }),
        }
    }
    (groups, rest)
}

/// Row `r`'s rows of a group as its batch: `[n, len, h, d]`.
fn as_batch(x: &Tensor, r: usize, g: Group) -> Result<Tensor> {
    let (_, _, h, d) = x.dims4()?;
    cut(x, r, 1, g.at, g.n * g.len)?.reshape((g.n, g.len, h, d))
}

/// A group's `[n, len, h, d]` result back to `[1, n·len, h, d]`.
fn from_batch(x: &Tensor, g: Group) -> Result<Tensor> {
    let (_, _, h, d) = x.dims4()?;
    x.reshape((1, g.n * g.len, h, d))
}

fn check_block(blk: &Block<'_>, b: usize, s: usize, t: usize) -> Result<()> {
    let (qs, ks): (usize, usize) = (blk.q.iter().map(|r| r.len()).sum(), blk.kv.iter().map(|r| r.len()).sum());
    if qs != s || ks != t {
        return crate::shape_err!("document mask: the block's ranges cover {qs} q and {ks} kv tokens, the tensors hold {s} and {t}");
    }
    if blk.docs.rows() != b && blk.docs.rows() != 0 {
        return crate::shape_err!("document mask: {} rows of documents for a batch of {b}", blk.docs.rows());
    }
    if let Some(r) = blk.q.iter().chain(blk.kv).find(|r| r.end > blk.docs.len()) {
        return crate::shape_err!("document mask: block range {r:?} lies outside the sequence of {} tokens", blk.docs.len());
    }
    Ok(())
}

/// Whether any q row of `blk` sees a kv row (in any batch row): a block for which this
/// is false is skipped by the modes before its kv is even fetched.
pub fn meets(blk: &Block<'_>) -> Result<bool> {
    for r in 0..blk.docs.rows().max(1) {
        if !pieces(blk, r)?.is_empty() {
            return Ok(true);
        }
    }
    Ok(false)
}

/// Row `r`, rows `at..at + len` along `dim` (1 for `[b, s, h, d]`, 2 for `lse [b, h, s]`).
fn cut(x: &Tensor, r: usize, dim: usize, at: usize, len: usize) -> Result<Tensor> {
    x.narrow(0, r, 1)?.narrow(dim, at, len)
}

/// `parts` (local offset → tensor along `dim`) laid into `n` rows, `fill` between them.
fn assemble(parts: BTreeMap<usize, Tensor>, dim: usize, n: usize, fill: impl Fn(usize) -> Result<Tensor>) -> Result<Tensor> {
    let mut out = Vec::with_capacity(2 * parts.len() + 1);
    let mut at = 0;
    for (off, p) in parts {
        if off > at {
            out.push(fill(off - at)?);
        }
        at = off + p.dim(dim)?;
        out.push(p);
    }
    if at < n {
        out.push(fill(n - at)?);
    }
    Tensor::cat(&out, dim)
}

/// Block forward, or with `blk = None` the plain kernel with `mask`. `None` back: the
/// block shares no document between its q and kv rows (nothing computed).
pub fn fwd(q: &Tensor, k: &Tensor, v: &Tensor, mask: Mask, blk: Option<Block<'_>>, scale: f64) -> Result<Option<(Tensor, Tensor)>> {
    let Some(blk) = blk else { return kernel::fwd(q, k, v, mask, scale).map(Some) };
    let (b, s, hq, d) = q.dims4()?;
    let t = k.dim(1)?;
    check_block(&blk, b, s, t)?;
    let (mut os, mut lses, mut any) = (Vec::with_capacity(b), Vec::with_capacity(b), false);
    for r in 0..b {
        let (groups, rest) = batched(pieces(&blk, r)?);
        let mut by_q: BTreeMap<usize, Vec<Piece>> = BTreeMap::new();
        for p in rest {
            by_q.entry(p.q.at).or_default().push(p);
        }
        let (mut o_parts, mut l_parts) = (BTreeMap::new(), BTreeMap::new());
        for g in groups {
            let (o, lse) = kernel::fwd(&as_batch(q, r, g)?, &as_batch(k, r, g)?, &as_batch(v, r, g)?, Mask::Causal, scale)?;
            // lse [n, hq, len] -> [1, hq, n·len]
            let lse = lse.transpose(0, 1)?.contiguous()?.reshape((1, hq, g.n * g.len))?;
            o_parts.insert(g.at, from_batch(&o, g)?);
            l_parts.insert(g.at, lse);
            any = true;
        }
        for (at, ps) in by_q {
            let n = ps[0].q.glob.len();
            let qp = cut(q, r, 1, at, n)?;
            let mut acc: Option<merge::Acc> = None;
            let mut single = None;
            for p in &ps {
                let m = p.kv.glob.len();
                let (o, lse) = kernel::fwd(&qp, &cut(k, r, 1, p.kv.at, m)?, &cut(v, r, 1, p.kv.at, m)?, p.mask, scale)?;
                if ps.len() == 1 {
                    single = Some((o, lse));
                } else {
                    acc = Some(merge::merge(acc, &o, &lse)?);
                }
            }
            let (o, lse) = match (single, acc) {
                (Some(x), _) => x,
                (None, Some(acc)) => acc.finish(q.dtype())?,
                (None, None) => continue,
            };
            any = true;
            o_parts.insert(at, o);
            l_parts.insert(at, lse);
        }
        os.push(assemble(o_parts, 1, s, |n| Tensor::zeros((1, n, hq, d), q.dtype(), q.device()))?);
        lses.push(assemble(l_parts, 2, s, |n| Tensor::full(f32::NEG_INFINITY, (1, hq, n), q.device()))?);
    }
    if !any {
        return Ok(None);
    }
    Ok(Some((Tensor::cat(&os, 0)?, Tensor::cat(&lses, 0)?)))
}

/// Block backward with the global `o`/`lse` in `saved`, or with `blk = None` the plain
/// kernel with `mask`. `None` back: no piece, so no gradient from this block.
pub fn bwd(d_o: &Tensor, saved: Saved<'_>, mask: Mask, blk: Option<Block<'_>>, scale: f64) -> Result<Option<(Tensor, Tensor, Tensor)>> {
    let Some(blk) = blk else { return kernel::bwd(d_o, saved, mask, scale).map(Some) };
    let Saved { q, k, v, o, lse } = saved;
    let (b, s, hq, d) = q.dims4()?;
    let (_, t, hkv, _) = k.dims4()?;
    check_block(&blk, b, s, t)?;
    saved.check_do(d_o, "document-masked attention backward")?;
    let (mut dqs, mut dks, mut dvs, mut any) = (Vec::with_capacity(b), Vec::with_capacity(b), Vec::with_capacity(b), false);
    let zeros = |n: usize, h: usize| Tensor::zeros((1, n, h, d), DType::F32, q.device());
    for r in 0..b {
        let (mut dq, mut dk, mut dv): (BTreeMap<usize, Tensor>, BTreeMap<usize, Tensor>, BTreeMap<usize, Tensor>) =
            (BTreeMap::new(), BTreeMap::new(), BTreeMap::new());
        let (groups, rest) = batched(pieces(&blk, r)?);
        for g in groups {
            let lg = cut(lse, r, 2, g.at, g.n * g.len)?.reshape((hq, g.n, g.len))?.transpose(0, 1)?.contiguous()?;
            let (qg, og, dog) = (as_batch(q, r, g)?, as_batch(o, r, g)?, as_batch(d_o, r, g)?);
            let (g_q, g_k, g_v) =
                kernel::bwd(&dog, Saved::new(&qg, &as_batch(k, r, g)?, &as_batch(v, r, g)?, &og, &lg), Mask::Causal, scale)?;
            dq.insert(g.at, from_batch(&g_q.to_dtype(DType::F32)?, g)?);
            dk.insert(g.at, from_batch(&g_k.to_dtype(DType::F32)?, g)?);
            dv.insert(g.at, from_batch(&g_v.to_dtype(DType::F32)?, g)?);
            any = true;
        }
        for p in rest {
            let (n, m) = (p.q.glob.len(), p.kv.glob.len());
            let (qp, op, dop) = (cut(q, r, 1, p.q.at, n)?, cut(o, r, 1, p.q.at, n)?, cut(d_o, r, 1, p.q.at, n)?);
            let lp = cut(lse, r, 2, p.q.at, n)?.contiguous()?;
            let (kp, vp) = (cut(k, r, 1, p.kv.at, m)?, cut(v, r, 1, p.kv.at, m)?);
            let (g_q, g_k, g_v) = kernel::bwd(&dop, Saved::new(&qp, &kp, &vp, &op, &lp), p.mask, scale)?;
            for (map, at, g) in [(&mut dq, p.q.at, g_q), (&mut dk, p.kv.at, g_k), (&mut dv, p.kv.at, g_v)] {
                let sum = merge::add_f32(map.remove(&at), &g)?;
                map.insert(at, sum);
            }
            any = true;
        }
        dqs.push(assemble(dq, 1, s, |n| zeros(n, hq))?);
        dks.push(assemble(dk, 1, t, |n| zeros(n, hkv))?);
        dvs.push(assemble(dv, 1, t, |n| zeros(n, hkv))?);
    }
    if !any {
        return Ok(None);
    }
    Ok(Some((
        Tensor::cat(&dqs, 0)?.to_dtype(q.dtype())?,
        Tensor::cat(&dks, 0)?.to_dtype(k.dtype())?,
        Tensor::cat(&dvs, 0)?.to_dtype(v.dtype())?,
    )))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn docs(rows: Vec<Vec<usize>>, len: usize) -> Docs {
        Docs::new(rows, len).unwrap()
    }

    #[test]
    fn runs_cut_ranges_at_documents() {
        let d = docs(vec![vec![0, 3, 10]], 16);
        let got = runs(&[0..4, 12..16], &d.ranges(0));
        let want = vec![(0, Run { at: 0, glob: 0..3 }), (1, Run { at: 3, glob: 3..4 }), (2, Run { at: 4, glob: 12..16 })];
        assert_eq!(got, want);
    }

    #[test]
    fn pieces_of_a_zigzag_diagonal_block() {
        // chunks of 4 at 0..4 and 12..16 (rank 0 of 2); a document 2..14 spans both
        let d = docs(vec![vec![0, 2, 14]], 16);
        let segs = [0..4, 12..16];
        let p = pieces(&Block { docs: &d, q: &segs, kv: &segs }, 0).unwrap();
        let masks: Vec<(Range<usize>, Range<usize>, Mask)> = p.iter().map(|p| (p.q.glob.clone(), p.kv.glob.clone(), p.mask)).collect();
        assert_eq!(
            masks,
            vec![
                (0..2, 0..2, Mask::Causal),
                (2..4, 2..4, Mask::Causal),
                (12..14, 2..4, Mask::None),
                (12..14, 12..14, Mask::Causal),
                (14..16, 14..16, Mask::Causal)
            ]
        );
    }

    #[test]
    fn equal_documents_on_the_diagonal_are_one_batched_call() {
        // 4 documents of 4, then one of 3 and one of 5 (lengths differ: groups of their own)
        let d = docs(vec![vec![0, 4, 8, 12, 16, 19]], 24);
        let all = [0..24];
        let (groups, rest) = batched(pieces(&Block { docs: &d, q: &all, kv: &all }, 0).unwrap());
        assert_eq!(groups, vec![Group { at: 0, len: 4, n: 4 }, Group { at: 16, len: 3, n: 1 }, Group { at: 19, len: 5, n: 1 }]);
        assert!(rest.is_empty());
        // a document spanning both zigzag chunks has two pieces on its q rows: not batched
        let d = docs(vec![vec![0, 2, 14]], 16);
        let segs = [0..4, 12..16];
        let (groups, rest) = batched(pieces(&Block { docs: &d, q: &segs, kv: &segs }, 0).unwrap());
        assert_eq!(groups, vec![Group { at: 0, len: 2, n: 1 }, Group { at: 6, len: 2, n: 1 }]);
        assert_eq!(rest.len(), 3);
    }

    #[test]
    fn work_counts_the_pairs_a_window_keeps() {
        // 8 tokens, window 3: rows 0..3 see 1, 2, 3 keys, rows 3..8 see 3 each: 21 of 36
        let w = Docs::whole(8).unwrap().with_window(3).unwrap();
        assert!((w.work_fraction() - 21.0 / 36.0).abs() < 1e-12);
        // two documents of 4 under the same window: 2 × (1 + 2 + 3 + 3) = 18 of 36
        let dw = Docs::new(vec![vec![0, 4]], 8).unwrap().with_window(3).unwrap();
        assert!((dw.work_fraction() - 18.0 / 36.0).abs() < 1e-12);
        assert!((Docs::whole(8).unwrap().work_fraction() - 1.0).abs() < 1e-12);
    }

    #[test]
    fn a_window_drops_far_blocks_and_bands_the_rest() {
        let d = Docs::whole(64).unwrap().with_window(4).unwrap();
        let (q, near, far) = ([32..48], [16..32], [0..16]);
        // keys 0..16 are ≥ 17 tokens before every query of 32..48: no piece, no kernel call
        assert!(!meets(&Block { docs: &d, q: &q, kv: &far }).unwrap());
        let p = pieces(&Block { docs: &d, q: &q, kv: &near }, 0).unwrap();
        assert_eq!(p.iter().map(|p| p.mask).collect::<Vec<_>>(), vec![Mask::Band { offset: 16, window: 4 }]);
        let p = pieces(&Block { docs: &d, q: &q, kv: &q }, 0).unwrap();
        assert_eq!(p.iter().map(|p| p.mask).collect::<Vec<_>>(), vec![Mask::Band { offset: 0, window: 4 }]);
        // a window wider than the pieces changes nothing
        let wide = Docs::whole(64).unwrap().with_window(33).unwrap();
        let p = pieces(&Block { docs: &wide, q: &q, kv: &near }, 0).unwrap();
        assert_eq!(p[0].mask, Mask::None);
    }

    #[test]
    fn blocks_sharing_no_document_are_skipped() {
        let d = docs(vec![vec![0, 4]], 8);
        let q = Tensor::ones((1, 4, 2, 4), DType::F32, &candle_core::Device::Cpu).unwrap();
        let (qs, ks) = ([4..8], [0..4]);
        assert!(fwd(&q, &q, &q, Mask::None, Some(Block { docs: &d, q: &qs, kv: &ks }), 0.5).unwrap().is_none());
    }

    #[test]
    fn bad_documents_are_refused() {
        assert!(Docs::new(vec![vec![1, 4]], 8).unwrap_err().to_string().contains("expected 0"));
        assert!(Docs::new(vec![vec![0, 4, 4]], 8).unwrap_err().to_string().contains("ascend"));
        assert!(Docs::new(vec![vec![0, 8]], 8).unwrap_err().to_string().contains("outside"));
    }

    #[test]
    fn work_fraction_of_equal_documents() {
        let d = docs(vec![(0..64).map(|i| i * 16).collect()], 1024);
        let f = d.work_fraction();
        assert!((f - 64.0 * 16.0 * 17.0 / (1024.0 * 1025.0)).abs() < 1e-12, "{f}");
    }
}
