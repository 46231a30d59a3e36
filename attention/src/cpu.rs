//! CPU block kernel: tiled flash-style attention over raw f32 slices with rayon.
//!
//! Shapes: `q [b,s,hq,d]`, `k`/`v [b,t,hkv,d]`, `o [b,s,hq,d]` (dtype of q), `lse [b,hq,s]` f32.
//! All inputs are converted once to contiguous f32 in that token-major layout, so every
//! token row of one head is a contiguous `[d]` slice. Each key tile is also copied
//! transposed (`[d,BK]`), so the scores of one query row against the tile are `d` axpys
//! over `BK` contiguous lanes (no horizontal sums); `P·V`, `dK`, `dV`, `dQ` are axpys over
//! contiguous `d`. The compiler vectorises these loops; on x86-64 CPUs with AVX2 the tile
//! functions run in a copy compiled for AVX2 (runtime detection). Only tile-sized buffers
//! are allocated: the full `s×t` score matrix never exists.
//!
//! Forward: one task per (batch, query head, query tile of `BQ` rows); per row an online
//! softmax (running max `m`, running sum `l`, f32 accumulator) over key tiles of `BK`.
//! Causal (diagonal block, `s == t`): query `i` sees keys `0..=i`; a band
//! ([`Mask::Band`]): the keys of its window. Each row reads only the keys it sees
//! ([`Mask::keys`]) and each query tile only the key tiles its rows see, so a band costs
//! its area, not `s·t`.
//!
//! Backward with the global `o`/`lse`: `P = exp(scale·q·k - lse)` is recomputed per tile,
//! `D = rowsum(dO∘O)`, `dS = P∘(dO·v - D)`. Two passes, each writing disjoint outputs:
//! - pass kv: one task per (batch, kv head, key tile) accumulates `dK = scale·Σ dS q` and
//!   `dV = Σ P dO` over all query rows of the whole GQA group;
//! - pass q: one task per (batch, query head, query tile) accumulates `dQ = scale·Σ dS k`.
//!
//! Rows whose `lse` is `-inf` (no key anywhere) get `P = 0` and are skipped.

use crate::kernel::{check_shapes, Mask, Saved};
use candle_core::{DType, Device, Result, Tensor};
use rayon::prelude::*;

/// Query rows per forward / dQ task.
const BQ: usize = 64;
/// Keys per tile (forward and dQ pass); keys per task in the dK/dV pass.
const BK: usize = 64;

/// Contiguous f32 copy of a tensor (converted once, any input dtype).
fn host_f32(x: &Tensor) -> Result<Vec<f32>> {
    x.to_dtype(DType::F32)?.contiguous()?.flatten_all()?.to_vec1::<f32>()
}

/// Dot product over contiguous `d`, 8 independent lanes so it vectorises.
#[inline(always)]
fn dot(a: &[f32], b: &[f32]) -> f32 {
    let n = a.len().min(b.len());
    let (a, b) = (&a[..n], &b[..n]);
    let mut acc = [0f32; 8];
    let mut ca = a.chunks_exact(8);
    let mut cb = b.chunks_exact(8);
    for (x, y) in (&mut ca).zip(&mut cb) {
        for l in 0..8 {
            acc[l] += x[l] * y[l];
        }
    }
    let mut sum = ((acc[0] + acc[4]) + (acc[1] + acc[5])) + ((acc[2] + acc[6]) + (acc[3] + acc[7]));
    for (x, y) in ca.remainder().iter().zip(cb.remainder()) {
        sum += x * y;
    }
    sum
}

/// Scores of one row against a transposed key tile: `out[j] = Σ_c x[c]·kt[c,j]`,
/// `kt [d,BK]`. Lanes past the tile's keys are zero padding.
#[inline(always)]
fn scores_t(x: &[f32], kt: &[f32], out: &mut [f32; BK]) {
    *out = [0f32; BK];
    for (&xc, row) in x.iter().zip(kt.chunks_exact(BK)) {
        for (o, &kv) in out.iter_mut().zip(row) {
            *o += xc * kv;
        }
    }
}

/// Copy key rows `j0..j1` of kv head `kh` transposed into `kt [d,BK]`, zero-padding the rest.
#[inline(always)]
fn load_t(dm: &Dims, src: &[f32], bi: usize, kh: usize, j0: usize, j1: usize, kt: &mut [f32]) {
    kt.fill(0.0);
    for j in j0..j1 {
        let row = &src[dm.k_at(bi, j, kh)..][..dm.d];
        for (c, &x) in row.iter().enumerate() {
            kt[c * BK + (j - j0)] = x;
        }
    }
}

/// `y += alpha * x` over contiguous `d`.
#[inline(always)]
fn axpy(y: &mut [f32], alpha: f32, x: &[f32]) {
    for (a, &b) in y.iter_mut().zip(x) {
        *a += alpha * b;
    }
}

/// `y += Σ_r a[r]·x[r]` over contiguous `d` for 4 rows at once (y is loaded and stored once).
#[inline(always)]
fn axpy4(y: &mut [f32], a: [f32; 4], x: [&[f32]; 4]) {
    for ((((yc, &x0), &x1), &x2), &x3) in y.iter_mut().zip(x[0]).zip(x[1]).zip(x[2]).zip(x[3]) {
        *yc += (a[0] * x0 + a[1] * x1) + (a[2] * x2 + a[3] * x3);
    }
}

/// `y += Σ_j coef[j]·row(j)` over the rows `row(0..coef.len())`, 4 at a time.
#[inline(always)]
fn axpy_rows<'a>(y: &mut [f32], coef: &[f32], row: impl Fn(usize) -> &'a [f32]) {
    let n4 = coef.len() / 4 * 4;
    for j in (0..n4).step_by(4) {
        axpy4(y, [coef[j], coef[j + 1], coef[j + 2], coef[j + 3]], [row(j), row(j + 1), row(j + 2), row(j + 3)]);
    }
    for (j, &c) in coef.iter().enumerate().skip(n4) {
        axpy(y, c, row(j));
    }
}

/// Branch-free `exp` for f32 (Cephes-style: `2^n · p(r)`, about 1 ulp), vectorisable.
/// Arguments below -87 flush to exactly 0; the kernel only passes arguments ≤ ~0.
#[inline(always)]
fn exp_f32(x: f32) -> f32 {
    const LO: f32 = -87.0;
    const HI: f32 = 88.0;
    const LOG2E: f32 = std::f32::consts::LOG2_E;
    const LN2_HI: f32 = 0.693_359_4;
    const LN2_LO: f32 = -2.121_944_4e-4;
    // 1.5 * 2^23: adding it rounds to the nearest integer, kept in the low mantissa bits.
    const ROUND: f32 = 12_582_912.0;
    let xc = x.clamp(LO, HI);
    let t = xc * LOG2E + ROUND;
    let n = t - ROUND;
    let ni = (t.to_bits() as i32).wrapping_sub(ROUND.to_bits() as i32);
    let r = xc - n * LN2_HI - n * LN2_LO;
    let p = ((((1.987_569_1e-4 * r + 1.398_199_9e-3) * r + 8.333_452e-3) * r + 4.166_579_6e-2) * r + 1.666_666_5e-1) * r + 0.5;
    let e = p * r * r + r + 1.0;
    let pow2 = f32::from_bits(((ni + 127) as u32) << 23);
    if x < LO {
        0.0
    } else {
        e * pow2
    }
}

/// In place `x[i] = exp(x[i] - shift)`.
#[inline(always)]
fn exp_shifted(x: &mut [f32], shift: f32) {
    for v in x.iter_mut() {
        *v = exp_f32(*v - shift);
    }
}

/// Defines `$fast`: runs the `#[inline(always)]` function `$plain` from a copy compiled
/// for AVX2+FMA when the CPU has them (runtime check), else the baseline build.
macro_rules! avx2_dispatch {
    ($fast:ident, $avx:ident, $plain:ident, ($($a:ident: $t:ty),*) -> $r:ty) => {
        #[cfg(target_arch = "x86_64")]
        #[target_feature(enable = "avx2,fma")]
        fn $avx($($a: $t),*) -> $r {
            $plain($($a),*)
        }
        fn $fast($($a: $t),*) -> $r {
            #[cfg(target_arch = "x86_64")]
            if std::arch::is_x86_feature_detected!("avx2") && std::arch::is_x86_feature_detected!("fma") {
                // SAFETY: the running CPU supports AVX2 and FMA (checked just above).
                return unsafe { $avx($($a),*) };
            }
            $plain($($a),*)
        }
    };
}

avx2_dispatch!(fwd_tile_fast, fwd_tile_avx2, fwd_tile,
    (dm: &Dims, qf: &[f32], kf: &[f32], vf: &[f32], bi: usize, h: usize, qt: usize) -> (Vec<f32>, Vec<f32>));
avx2_dispatch!(bwd_kv_tile_fast, bwd_kv_tile_avx2, bwd_kv_tile,
    (dm: &Dims, inp: &BwdIn, bi: usize, kh: usize, ktile: usize) -> (Vec<f32>, Vec<f32>));
avx2_dispatch!(bwd_q_tile_fast, bwd_q_tile_avx2, bwd_q_tile,
    (dm: &Dims, inp: &BwdIn, bi: usize, h: usize, qt: usize) -> Vec<f32>);

/// Sizes, mask and scale of one block call.
#[derive(Clone, Copy)]
struct Dims {
    s: usize,
    t: usize,
    hq: usize,
    hkv: usize,
    d: usize,
    mask: Mask,
    scale: f32,
}

/// Runs `f(bi, h, tile)` on every cell of the `[b, heads, tiles]` grid in parallel; returns
/// each cell with its result, in grid order.
fn par_grid<T: Send>(
    (b, heads, tiles): (usize, usize, usize),
    f: impl Fn(usize, usize, usize) -> T + Sync + Send,
) -> Vec<((usize, usize, usize), T)> {
    (0..b * heads * tiles)
        .into_par_iter()
        .map(|task| {
            let cell = (task / (heads * tiles), (task / tiles) % heads, task % tiles);
            (cell, f(cell.0, cell.1, cell.2))
        })
        .collect()
}

/// Copies the rows `[d]` of a tile into `dst`, row `r` at offset `at(r)`.
fn scatter_rows(dst: &mut [f32], tile: &[f32], d: usize, at: impl Fn(usize) -> usize) {
    for (r, row) in tile.chunks_exact(d.max(1)).enumerate() {
        dst[at(r)..at(r) + row.len()].copy_from_slice(row);
    }
}

impl Dims {
    fn new(dims: (usize, usize, usize, usize, usize, usize), mask: Mask, scale: f64) -> Self {
        let (_, s, t, hq, hkv, d) = dims;
        Dims { s, t, hq, hkv, d, mask, scale: scale as f32 }
    }
    /// Rows `i0..i1` of query tile `qt`, and the keys `[k0, k1)` any of them sees.
    #[inline(always)]
    fn q_tile(&self, qt: usize) -> (usize, usize, usize, usize) {
        let i0 = qt * BQ;
        let i1 = (i0 + BQ).min(self.s);
        let (k0, _) = self.mask.keys(i0, self.t);
        let (_, k1) = self.mask.keys(i1.max(1) - 1, self.t);
        (i0, i1, k0, k1.max(k0))
    }
    /// Query-head row `[d]` of token `i`: offset into `[b,s,hq,d]`.
    #[inline(always)]
    fn q_at(&self, bi: usize, i: usize, h: usize) -> usize {
        ((bi * self.s + i) * self.hq + h) * self.d
    }
    /// Kv-head row `[d]` of key `j`: offset into `[b,t,hkv,d]`.
    #[inline(always)]
    fn k_at(&self, bi: usize, j: usize, kh: usize) -> usize {
        ((bi * self.t + j) * self.hkv + kh) * self.d
    }
    /// Index into `[b,hq,s]`.
    #[inline(always)]
    fn lse_at(&self, bi: usize, h: usize, i: usize) -> usize {
        (bi * self.hq + h) * self.s + i
    }
    /// The keys `[lo, hi)` query `i` sees inside the key tile `[j0, j1)` (empty: `lo >= hi`).
    #[inline(always)]
    fn keys_in(&self, i: usize, j0: usize, j1: usize) -> (usize, usize) {
        let (lo, hi) = self.mask.keys(i, self.t);
        (lo.max(j0), hi.min(j1))
    }
    fn group(&self) -> usize {
        self.hq / self.hkv
    }
}

/// Forward: `(o [b,s,hq,d] dtype of q, lse [b,hq,s] f32)`.
pub fn fwd(q: &Tensor, k: &Tensor, v: &Tensor, mask: Mask, scale: f64) -> Result<(Tensor, Tensor)> {
    let dims = check_shapes(q, k, v, mask)?;
    let (b, s, _, hq, _, d) = dims;
    let dm = Dims::new(dims, mask, scale);
    let (qf, kf, vf) = (host_f32(q)?, host_f32(k)?, host_f32(v)?);
    let n_qt = s.div_ceil(BQ);
    let tiles = par_grid((b, hq, n_qt), |bi, h, qt| fwd_tile_fast(&dm, &qf, &kf, &vf, bi, h, qt));
    let mut o = vec![0f32; b * s * hq * d];
    let mut lse = vec![f32::NEG_INFINITY; b * hq * s];
    for ((bi, h, qt), (o_t, lse_t)) in tiles {
        let i0 = qt * BQ;
        scatter_rows(&mut o, &o_t, d, |r| dm.q_at(bi, i0 + r, h));
        for (r, l) in lse_t.into_iter().enumerate() {
            lse[dm.lse_at(bi, h, i0 + r)] = l;
        }
    }
    let dev = q.device();
    let o = to_device(o, (b, s, hq, d), dev)?.to_dtype(q.dtype())?;
    Ok((o, to_device(lse, (b, hq, s), dev)?))
}

fn to_device<S: Into<candle_core::Shape>>(x: Vec<f32>, shape: S, dev: &Device) -> Result<Tensor> {
    Tensor::from_vec(x, shape, &Device::Cpu)?.to_device(dev)
}

/// One forward task: rows `i0..i1` of query head `h` in batch `bi`.
/// Returns (`o` tile `[rows,d]`, `lse` tile `[rows]`).
#[inline(always)]
fn fwd_tile(dm: &Dims, qf: &[f32], kf: &[f32], vf: &[f32], bi: usize, h: usize, qt: usize) -> (Vec<f32>, Vec<f32>) {
    let (d, kh) = (dm.d, h / dm.group());
    let (i0, i1, k_start, k_end) = dm.q_tile(qt);
    let rows = i1 - i0;
    // Scaled query rows, so scores are plain dots.
    let mut qs = vec![0f32; rows * d];
    for r in 0..rows {
        let src = &qf[dm.q_at(bi, i0 + r, h)..][..d];
        for (x, &y) in qs[r * d..(r + 1) * d].iter_mut().zip(src) {
            *x = y * dm.scale;
        }
    }
    let mut m = vec![f32::NEG_INFINITY; rows];
    let mut l = vec![0f32; rows];
    let mut acc = vec![0f32; rows * d];
    let mut sc = [0f32; BK];
    let mut kt = vec![0f32; d * BK];
    for j0 in (k_start..k_end).step_by(BK) {
        let j1 = (j0 + BK).min(k_end);
        load_t(dm, kf, bi, kh, j0, j1, &mut kt);
        for r in 0..rows {
            let (js, je) = dm.keys_in(i0 + r, j0, j1);
            if je <= js {
                continue;
            }
            let (a, n) = (js - j0, je - j0);
            let qi = &qs[r * d..(r + 1) * d];
            scores_t(qi, &kt, &mut sc);
            let m_tile = sc[a..n].iter().fold(f32::NEG_INFINITY, |a, &x| a.max(x));
            let m_new = m[r].max(m_tile);
            // First tile of this row: nothing to rescale (and no -inf - -inf).
            let alpha = if m[r] == f32::NEG_INFINITY { 0.0 } else { exp_f32(m[r] - m_new) };
            exp_shifted(&mut sc[a..n], m_new);
            let acc_r = &mut acc[r * d..(r + 1) * d];
            if alpha != 1.0 {
                acc_r.iter_mut().for_each(|x| *x *= alpha);
            }
            axpy_rows(acc_r, &sc[a..n], |jj| &vf[dm.k_at(bi, js + jj, kh)..][..d]);
            l[r] = l[r] * alpha + sc[a..n].iter().sum::<f32>();
            m[r] = m_new;
        }
    }
    let mut lse = vec![f32::NEG_INFINITY; rows];
    for r in 0..rows {
        if l[r] > 0.0 {
            let inv = 1.0 / l[r];
            acc[r * d..(r + 1) * d].iter_mut().for_each(|x| *x *= inv);
            lse[r] = m[r] + l[r].ln();
        }
    }
    (acc, lse)
}

/// Inputs of the backward, as f32 host slices.
struct BwdIn {
    q: Vec<f32>,
    k: Vec<f32>,
    v: Vec<f32>,
    d_o: Vec<f32>,
    /// `[b,hq,s]`
    lse: Vec<f32>,
    /// `D = rowsum(dO∘O)`, `[b,hq,s]`
    dd: Vec<f32>,
}

/// Backward with the global `o`/`lse`: `(dq, dk, dv)` in the dtype of q.
pub fn bwd(d_o: &Tensor, saved: Saved<'_>, mask: Mask, scale: f64) -> Result<(Tensor, Tensor, Tensor)> {
    let dims = saved.check(d_o, mask)?;
    let (b, s, t, hq, hkv, d) = dims;
    let Saved { q, k, v, o, lse } = saved;
    let dm = Dims::new(dims, mask, scale);
    let d_of = host_f32(d_o)?;
    let of = host_f32(o)?;
    // D[b,hq,s] from the token-major rows of dO and O.
    let mut dd = vec![0f32; b * hq * s];
    for bi in 0..b {
        for i in 0..s {
            for h in 0..hq {
                let at = dm.q_at(bi, i, h);
                dd[dm.lse_at(bi, h, i)] = dot(&d_of[at..at + d], &of[at..at + d]);
            }
        }
    }
    drop(of);
    let inp = BwdIn { q: host_f32(q)?, k: host_f32(k)?, v: host_f32(v)?, d_o: d_of, lse: host_f32(lse)?, dd };

    // Pass kv: dK, dV per (batch, kv head, key tile).
    let n_kt = t.div_ceil(BK);
    let kv_tiles = par_grid((b, hkv, n_kt), |bi, kh, kt| bwd_kv_tile_fast(&dm, &inp, bi, kh, kt));
    let mut dk = vec![0f32; b * t * hkv * d];
    let mut dv = vec![0f32; b * t * hkv * d];
    for ((bi, kh, kt), (dk_t, dv_t)) in kv_tiles {
        let at = |jj| dm.k_at(bi, kt * BK + jj, kh);
        scatter_rows(&mut dk, &dk_t, d, at);
        scatter_rows(&mut dv, &dv_t, d, at);
    }

    // Pass q: dQ per (batch, query head, query tile).
    let n_qt = s.div_ceil(BQ);
    let q_tiles = par_grid((b, hq, n_qt), |bi, h, qt| bwd_q_tile_fast(&dm, &inp, bi, h, qt));
    let mut dq = vec![0f32; b * s * hq * d];
    for ((bi, h, qt), dq_t) in q_tiles {
        scatter_rows(&mut dq, &dq_t, d, |r| dm.q_at(bi, qt * BQ + r, h));
    }
    let (dev, dt) = (q.device(), q.dtype());
    Ok((
        to_device(dq, (b, s, hq, d), dev)?.to_dtype(dt)?,
        to_device(dk, (b, t, hkv, d), dev)?.to_dtype(dt)?,
        to_device(dv, (b, t, hkv, d), dev)?.to_dtype(dt)?,
    ))
}

/// Probabilities of row `i` against a key tile: `p[j] = exp(scale·q_i·k_j - lse_i)`
/// (only the first `n` lanes are meaningful).
#[inline(always)]
fn probs(qi: &[f32], kt: &[f32], scale: f32, lse_i: f32, n: usize, p: &mut [f32; BK]) {
    scores_t(qi, kt, p);
    for x in p[..n].iter_mut() {
        *x = exp_f32(*x * scale - lse_i);
    }
}

/// dK/dV task: keys `j0..j1` of kv head `kh`, summed over every query row of its GQA group.
/// Returns (`dk` tile `[keys,d]`, `dv` tile `[keys,d]`).
#[inline(always)]
fn bwd_kv_tile(dm: &Dims, inp: &BwdIn, bi: usize, kh: usize, ktile: usize) -> (Vec<f32>, Vec<f32>) {
    let (d, scale) = (dm.d, dm.scale);
    let j0 = ktile * BK;
    let j1 = (j0 + BK).min(dm.t);
    let keys = j1 - j0;
    let mut dk = vec![0f32; keys * d];
    let mut dv = vec![0f32; keys * d];
    let (mut p, mut dp) = ([0f32; BK], [0f32; BK]);
    let (mut kt, mut vt) = (vec![0f32; d * BK], vec![0f32; d * BK]);
    load_t(dm, &inp.k, bi, kh, j0, j1, &mut kt);
    load_t(dm, &inp.v, bi, kh, j0, j1, &mut vt);
    let zeros = vec![0f32; d];
    let g = dm.group();
    // Only the queries that see a key of this tile: [i_start, i_end).
    let (i_start, _) = dm.mask.queries(j0, dm.s);
    let (_, i_end) = dm.mask.queries(j1.max(1) - 1, dm.s);
    // Query rows go 4 at a time so each dK/dV row is loaded and stored once per 4 rows:
    // pc[r][j] = P, sc[r][j] = dS·scale, zero past the keys row r sees (or if it sees none).
    let mut pc = [[0f32; BK]; 4];
    let mut sc = [[0f32; BK]; 4];
    for h in kh * g..(kh + 1) * g {
        for i0 in (i_start..i_end.max(i_start)).step_by(4) {
            let mut qr: [&[f32]; 4] = [&zeros; 4];
            let mut dor: [&[f32]; 4] = [&zeros; 4];
            let mut n_max = 0;
            for r in 0..4 {
                pc[r] = [0f32; BK];
                sc[r] = [0f32; BK];
                let i = i0 + r;
                if i >= dm.s {
                    continue;
                }
                let lse_i = inp.lse[dm.lse_at(bi, h, i)];
                if lse_i == f32::NEG_INFINITY {
                    continue;
                }
                let (js, je) = dm.keys_in(i, j0, j1);
                if je <= js {
                    continue;
                }
                let (a, n) = (js - j0, je - j0);
                let at = dm.q_at(bi, i, h);
                let (qi, doi) = (&inp.q[at..at + d], &inp.d_o[at..at + d]);
                let d_i = inp.dd[dm.lse_at(bi, h, i)];
                probs(qi, &kt, scale, lse_i, n, &mut p);
                scores_t(doi, &vt, &mut dp);
                for jj in a..n {
                    pc[r][jj] = p[jj];
                    sc[r][jj] = p[jj] * (dp[jj] - d_i) * scale;
                }
                (qr[r], dor[r]) = (qi, doi);
                n_max = n_max.max(n);
            }
            for jj in 0..n_max {
                let a = [pc[0][jj], pc[1][jj], pc[2][jj], pc[3][jj]];
                axpy4(&mut dv[jj * d..(jj + 1) * d], a, dor);
                let a = [sc[0][jj], sc[1][jj], sc[2][jj], sc[3][jj]];
                axpy4(&mut dk[jj * d..(jj + 1) * d], a, qr);
            }
        }
    }
    (dk, dv)
}

/// dQ task: rows `i0..i1` of query head `h` against every key they see. Returns `[rows,d]`.
#[inline(always)]
fn bwd_q_tile(dm: &Dims, inp: &BwdIn, bi: usize, h: usize, qt: usize) -> Vec<f32> {
    let (d, kh, scale) = (dm.d, h / dm.group(), dm.scale);
    let (i0, i1, k_start, k_end) = dm.q_tile(qt);
    let rows = i1 - i0;
    let mut dq = vec![0f32; rows * d];
    let (mut p, mut dp) = ([0f32; BK], [0f32; BK]);
    let (mut kt, mut vt) = (vec![0f32; d * BK], vec![0f32; d * BK]);
    for j0 in (k_start..k_end).step_by(BK) {
        let j1 = (j0 + BK).min(k_end);
        load_t(dm, &inp.k, bi, kh, j0, j1, &mut kt);
        load_t(dm, &inp.v, bi, kh, j0, j1, &mut vt);
        for r in 0..rows {
            let i = i0 + r;
            let (js, je) = dm.keys_in(i, j0, j1);
            let lse_i = inp.lse[dm.lse_at(bi, h, i)];
            if je <= js || lse_i == f32::NEG_INFINITY {
                continue;
            }
            let (a, n) = (js - j0, je - j0);
            let at = dm.q_at(bi, i, h);
            let (qi, doi) = (&inp.q[at..at + d], &inp.d_o[at..at + d]);
            let d_i = inp.dd[dm.lse_at(bi, h, i)];
            probs(qi, &kt, scale, lse_i, n, &mut p);
            scores_t(doi, &vt, &mut dp);
            // p becomes dS·scale in place.
            for (pj, &dpj) in p[a..n].iter_mut().zip(&dp[a..n]) {
                *pj *= (dpj - d_i) * scale;
            }
            axpy_rows(&mut dq[r * d..(r + 1) * d], &p[a..n], |jj| &inp.k[dm.k_at(bi, js + jj, kh)..][..d]);
        }
    }
    dq
}

#[cfg(test)]
mod tests {
    use super::exp_f32;

    /// The polynomial exp is within 4e-7 relative of f64 exp on the range the kernel uses,
    /// and flushes very negative arguments (and -inf) to exactly 0.
    #[test]
    fn exp_f32_accuracy() {
        let mut worst = 0f64;
        for i in 0..=200_000 {
            let x = -87.0 + 88.0 * i as f32 / 200_000.0;
            let want = (x as f64).exp();
            worst = worst.max(((exp_f32(x) as f64) - want).abs() / want);
        }
        assert!(worst < 4e-7, "exp_f32 worst relative error {worst}");
        assert_eq!(exp_f32(f32::NEG_INFINITY), 0.0);
        assert_eq!(exp_f32(-100.0), 0.0);
        assert_eq!(exp_f32(0.0), 1.0);
    }
}
