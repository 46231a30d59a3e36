//! Ulysses: sequence-parallel attention by all-to-all head resharding.
//!
//! Shapes (P ranks, `S = s·P` global tokens, `H` any head count divisible by P):
//! - sequence-sharded `[b, s, H, d]`: this rank's contiguous token slice
//!   `[r·s, (r+1)·s)` of the global sequence, all heads;
//! - head-sharded `[b, S, H/P, d]`: the whole sequence, heads `[r·H/P, (r+1)·H/P)`.
//!
//! Forward: q, k, v go sequence → heads by one all-to-all each, the block kernel runs
//! causally on the full sequence for the local heads, and `o` (and `lse [b, hq, s]`)
//! come back heads → sequence. The backward of an all-to-all is the inverse all-to-all,
//! so the backward exchanges `do`, `o`, `lse` (and q, k, v again) to head-sharded form,
//! runs the kernel backward and sends `dq`, `dk`, `dv` back.
//!
//! GQA: rank r takes the contiguous query heads `[r·hq/P, (r+1)·hq/P)`, which use the
//! kv heads `[r·hkv/P, (r+1)·hkv/P)` when `hkv % P == 0`. When `P` is a multiple of
//! `hkv`, each kv head is first repeated `P/hkv` times *in place* (copies adjacent:
//! `[k0, k0, k1, k1, ..]`), so rank r gets copy `r` = original kv head `r·hkv/P`,
//! exactly the one its query heads use; the copies' gradients sum back.

use crate::comm::Comm;
use crate::docs::Masking;
use crate::kernel::Saved;
use crate::local::LocalAttention;
use crate::mode::AttentionMode;
use candle_core::{DType, Result, Tensor};
use std::sync::Arc;

/// One all-to-all: cut `x` into P equal parts along `split_dim` (part i goes to rank i)
/// and concatenate what arrives along `cat_dim` in rank order.
pub fn exchange(comm: &dyn Comm, x: &Tensor, split_dim: usize, cat_dim: usize) -> Result<Tensor> {
    let p = comm.world();
    let n = x.dim(split_dim)?;
    if p == 0 || n % p != 0 {
        return crate::shape_err!("all-to-all: dim {split_dim} of {:?} (= {n}) is not divisible by the world size {p}", x.dims());
    }
    let part = n / p;
    let xs = (0..p).map(|i| x.narrow(split_dim, i * part, part)?.contiguous()).collect::<Result<Vec<_>>>()?;
    let ys = comm.all_to_all(xs)?;
    if ys.len() != p {
        return crate::comm_err!("all-to-all returned {} parts for a world of {p}", ys.len());
    }
    Tensor::cat(&ys, cat_dim)
}

/// [`exchange`] of a tensor that must have `rank` dims.
fn reshard(comm: &dyn Comm, x: &Tensor, rank: usize, split_dim: usize, cat_dim: usize) -> Result<Tensor> {
    if x.rank() != rank {
        return crate::shape_err!("all-to-all: expected {rank} dims, got {:?}", x.dims());
    }
    exchange(comm, x, split_dim, cat_dim)
}

/// Sequence-sharded `[b, s, H, d]` → head-sharded `[b, s·P, H/P, d]` (global token order).
pub fn seq_to_heads(comm: &dyn Comm, x: &Tensor) -> Result<Tensor> {
    reshard(comm, x, 4, 2, 1)
}

/// Head-sharded `[b, S, H/P, d]` → sequence-sharded `[b, S/P, H, d]`; inverse of [`seq_to_heads`].
pub fn heads_to_seq(comm: &dyn Comm, x: &Tensor) -> Result<Tensor> {
    reshard(comm, x, 4, 1, 2)
}

/// Sequence-sharded `lse [b, H, s]` → head-sharded `[b, H/P, s·P]`.
pub fn lse_seq_to_heads(comm: &dyn Comm, lse: &Tensor) -> Result<Tensor> {
    reshard(comm, lse, 3, 1, 2)
}

/// Head-sharded `lse [b, H/P, S]` → sequence-sharded `[b, H, S/P]`.
pub fn lse_heads_to_seq(comm: &dyn Comm, lse: &Tensor) -> Result<Tensor> {
    reshard(comm, lse, 3, 2, 1)
}

/// How many times each kv head must be repeated before head sharding over `p` ranks:
/// 1 when `hkv % p == 0`; `p / hkv` when `p % hkv == 0` (and `hq % p == 0`); else an error
/// that lists the world sizes that would work.
pub fn kv_replication(hq: usize, hkv: usize, p: usize) -> Result<usize> {
    if p == 0 {
        return crate::config_err!("head sharding over a world of 0 ranks");
    }
    if hkv == 0 || !hq.is_multiple_of(hkv) {
        return crate::config_err!("query heads hq={hq} must be a positive multiple of kv heads hkv={hkv}");
    }
    let works = |p: usize| hq.is_multiple_of(p) && (hkv.is_multiple_of(p) || p.is_multiple_of(hkv));
    if works(p) {
        return Ok(if hkv.is_multiple_of(p) { 1 } else { p / hkv });
    }
    let ok: Vec<String> = (1..=hq).filter(|&w| works(w)).map(|w| w.to_string()).collect();
    let why = if !hq.is_multiple_of(p) {
        format!("query heads hq={hq} are not divisible by the world size P={p}")
    } else {
        format!("kv heads hkv={hkv} neither divisible by nor dividing P={p}")
    };
    crate::config_err!(
        "head sharding (Ulysses) with hq={hq}, hkv={hkv}, P={p}: {why}; \
         world sizes that work for these heads: {}",
        ok.join(", ")
    )
}

/// `x [b, t, hkv, d]` → `[b, t, hkv·r, d]` with each head repeated `r` times adjacently.
pub fn replicate_kv_heads(x: &Tensor, r: usize) -> Result<Tensor> {
    if r == 1 {
        return Ok(x.clone());
    }
    let (b, t, h, d) = x.dims4()?;
    x.unsqueeze(3)?.broadcast_as((b, t, h, r, d))?.reshape((b, t, h * r, d))
}

/// Backward of [`replicate_kv_heads`]: `dx [b, t, hkv·r, d]` → `[b, t, hkv, d]`, summing
/// the gradients of the copies (in f32, returned in the dtype of `dx`).
pub fn reduce_replicated_kv_grad(dx: &Tensor, r: usize) -> Result<Tensor> {
    if r == 1 {
        return Ok(dx.clone());
    }
    let (b, t, hr, d) = dx.dims4()?;
    if hr % r != 0 {
        return crate::shape_err!("replicated kv grad {:?}: heads {hr} not a multiple of {r}", dx.dims());
    }
    dx.to_dtype(DType::F32)?.reshape((b, t, hr / r, r, d))?.sum(3)?.to_dtype(dx.dtype())
}

/// Checks `q [b, s, hq, d]`, `k`/`v [b, s, hkv, d]` for head sharding over `p` ranks;
/// returns the kv replication factor.
pub fn check_heads(q: &Tensor, k: &Tensor, v: &Tensor, p: usize) -> Result<usize> {
    let (b, s, hq, d) = q.dims4()?;
    let (bk, sk, hkv, dk) = k.dims4()?;
    if k.dims() != v.dims() || bk != b || sk != s || dk != d {
        return crate::shape_err!("q {:?}, k {:?}, v {:?}: expected k = v = [{b}, {s}, hkv, {d}]", q.dims(), k.dims(), v.dims());
    }
    kv_replication(hq, hkv, p)
}

/// Ulysses around any inner mode (the one mechanism shared by [`Ulysses`] and
/// [`crate::usp::Usp`]): all-to-all q, k, v to head-sharded form over `comm` (kv heads
/// replicated when the group outnumbers them), run `inner` on the group's sequence,
/// all-to-all o and lse back.
pub fn head_sharded_forward(
    comm: &dyn Comm,
    inner: &dyn AttentionMode,
    q: &Tensor,
    k: &Tensor,
    v: &Tensor,
    mask: Masking<'_>,
    scale: f64,
) -> Result<(Tensor, Tensor)> {
    let r = check_heads(q, k, v, comm.world())?;
    let (qh, kh, vh) = to_heads(comm, q, k, v, r)?;
    let (oh, lseh) = inner.forward_masked(&qh, &kh, &vh, mask, scale)?; // [b,S,hq/P,d], [b,hq/P,S]
    Ok((heads_to_seq(comm, &oh)?, lse_heads_to_seq(comm, &lseh)?))
}

/// Backward of [`head_sharded_forward`]: `do`, `o`, `lse` go to head-sharded form, the
/// inner backward runs there, and `dq`, `dk`, `dv` come back by the inverse all-to-all
/// (gradients of replicated kv heads summed).
pub fn head_sharded_backward(
    comm: &dyn Comm,
    inner: &dyn AttentionMode,
    d_o: &Tensor,
    saved: Saved<'_>,
    mask: Masking<'_>,
    scale: f64,
) -> Result<(Tensor, Tensor, Tensor)> {
    let Saved { q, k, v, o, lse } = saved;
    let r = check_heads(q, k, v, comm.world())?;
    let (qh, kh, vh) = to_heads(comm, q, k, v, r)?;
    let (doh, oh, lseh) = (seq_to_heads(comm, d_o)?, seq_to_heads(comm, o)?, lse_seq_to_heads(comm, lse)?);
    let (dqh, dkh, dvh) = inner.backward_masked(&doh, Saved::new(&qh, &kh, &vh, &oh, &lseh), mask, scale)?;
    let dq = heads_to_seq(comm, &dqh)?;
    let dk = reduce_replicated_kv_grad(&heads_to_seq(comm, &dkh)?, r)?;
    let dv = reduce_replicated_kv_grad(&heads_to_seq(comm, &dvh)?, r)?;
    Ok((dq, dk, dv))
}

/// q, k, v to head-sharded full sequence (kv replicated `r` times first).
fn to_heads(comm: &dyn Comm, q: &Tensor, k: &Tensor, v: &Tensor, r: usize) -> Result<(Tensor, Tensor, Tensor)> {
    Ok((seq_to_heads(comm, q)?, seq_to_heads(comm, &replicate_kv_heads(k, r)?)?, seq_to_heads(comm, &replicate_kv_heads(v, r)?)?))
}

/// Ulysses attention; local tokens are the contiguous slice `[r·s, (r+1)·s)`.
#[derive(Debug, Clone)]
pub struct Ulysses {
    pub comm: Arc<dyn Comm>,
}

impl Ulysses {
    pub fn new(comm: Arc<dyn Comm>) -> Self {
        Self { comm }
    }
}

impl AttentionMode for Ulysses {
    fn name(&self) -> &'static str {
        "ulysses"
    }

    fn forward_masked(&self, q: &Tensor, k: &Tensor, v: &Tensor, mask: Masking<'_>, scale: f64) -> Result<(Tensor, Tensor)> {
        head_sharded_forward(self.comm.as_ref(), &LocalAttention, q, k, v, mask, scale)
    }

    fn backward_masked(&self, d_o: &Tensor, saved: Saved<'_>, mask: Masking<'_>, scale: f64) -> Result<(Tensor, Tensor, Tensor)> {
        head_sharded_backward(self.comm.as_ref(), &LocalAttention, d_o, saved, mask, scale)
    }
}
