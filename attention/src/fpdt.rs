//! FPDT (Ulysses-Offload): Ulysses applied chunk by chunk, kv chunks parked on the host.
//!
//! Shapes (P ranks, chunk `C` global tokens, `u = S / C` chunks, `c = C / P`):
//! - local input `q [b, s = u·c, hq, d]`, `k`/`v [b, s, hkv, d]` in the round-robin layout
//!   ([`crate::layout`]): local chunk i of rank r = global tokens `[iC + r·c, iC + (r+1)·c)`;
//! - after [`seq_to_heads`] a chunk is the global segment `[iC, (i+1)C)` for this rank's
//!   heads: `qh [b, C, hq/P, d]`, `kh`/`vh [b, C, hkv·rep/P, d]`, `lse [b, hq/P, C]`.
//!
//! Forward, chunk i: exchange the chunk, park its k, v (on the host when `offload`), then
//! attend `qh_i` to kv chunks `0..=i`, merging with log-sum-exp (`Mask::Causal` only on
//! the diagonal `j == i`, which uses the freshly exchanged chunk before it is dropped),
//! fetching chunk `j+1` before computing chunk `j`: at most two kv chunks live on the
//! compute device at once (counted, see [`Fpdt::max_resident_kv_chunks`]).
//!
//! Backward, kv-outer / q-inner: q, do, o, lse of every chunk are exchanged once and
//! parked; for kv chunk i (exchanged again, the only resident kv chunk) the q chunks
//! `i..u` run the kernel backward with the saved global o/lse, the next q chunk (and its
//! dq partial sum) fetched while the current one computes; `dk_i`, `dv_i` accumulate in
//! f32 on the device, each dq partial sum in f32 on the device and is parked again between
//! uses. `dq_i` is complete after kv chunk i, so every chunk's grads go back
//! (heads → sequence) at the end of step i. Accumulators are rebuilt functionally
//! (`a + b`), never written in place.
//!
//! Under a document mask ([`crate::docs`]) every chunk pair is cut into per-document
//! pieces by its global ranges, and a pair that shares no document (or lies wholly outside
//! a sliding window) is skipped before its chunk is fetched (forward) or its q side
//! brought back (backward): under a window only the chunks it reaches move.
//!
//! Parking goes through a [`Stash`]: on CUDA, pinned host buffers with the copies on
//! their own stream, overlapping the kernels (see [`crate::stash`]).

use crate::comm::Comm;
use crate::docs::{self, Block, Masking};
use crate::kernel::{Mask, Saved};
use crate::merge::{self, add_f32};
use crate::mode::AttentionMode;
use crate::stash::{Fetched, Parked, Stash};
use crate::ulysses::{
    check_heads, heads_to_seq, lse_heads_to_seq, lse_seq_to_heads, reduce_replicated_kv_grad, replicate_kv_heads, seq_to_heads,
};
use candle_core::{Device, Result, Tensor};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};

/// Count of kv chunks resident on the compute device, with its high-water mark.
#[derive(Debug, Default)]
struct Residency {
    now: AtomicUsize,
    max: AtomicUsize,
}

/// One kv chunk counted as resident on the compute device while this lives.
#[derive(Debug)]
struct Slot(Arc<Residency>);

impl Slot {
    fn take(r: &Arc<Residency>) -> Self {
        let now = r.now.fetch_add(1, Ordering::SeqCst) + 1;
        r.max.fetch_max(now, Ordering::SeqCst);
        Slot(r.clone())
    }
}

impl Drop for Slot {
    fn drop(&mut self) {
        self.0.now.fetch_sub(1, Ordering::SeqCst);
    }
}

/// A parked tensor: in host memory (offload) or kept on the compute device.
enum Held {
    Dev(Tensor),
    Host(Parked),
}

/// A parked tensor on its way to the compute device.
enum Coming {
    Dev(Tensor),
    Host(Fetched),
}

impl Coming {
    fn ready(self) -> Result<Tensor> {
        match self {
            Coming::Dev(t) => Ok(t),
            Coming::Host(f) => f.ready(),
        }
    }
}

/// A kv chunk `[b, C, hkv', d]`; `slot` is set while it occupies compute-device memory.
struct KvChunk<T> {
    k: T,
    v: T,
    _slot: Option<Slot>,
}

impl KvChunk<Coming> {
    fn ready(self) -> Result<KvChunk<Tensor>> {
        Ok(KvChunk { k: self.k.ready()?, v: self.v.ready()?, _slot: self._slot })
    }
}

/// The q-side tensors of one chunk in head-sharded form.
struct QChunk<T> {
    q: T,   // [b, C, hq/P, d]
    d_o: T, // [b, C, hq/P, d]
    o: T,   // [b, C, hq/P, d]
    lse: T, // [b, hq/P, C] f32
}

impl QChunk<Coming> {
    fn ready(self) -> Result<QChunk<Tensor>> {
        Ok(QChunk { q: self.q.ready()?, d_o: self.d_o.ready()?, o: self.o.ready()?, lse: self.lse.ready()? })
    }
}

/// The stash of parked tensors, shared by clones of one [`Fpdt`] (one rank's thread).
#[derive(Default)]
struct SharedStash(Mutex<Stash>);

impl std::fmt::Debug for SharedStash {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("Stash")
    }
}

/// FPDT attention over the round-robin layout with chunks of `chunk` global tokens.
#[derive(Debug, Clone)]
pub struct Fpdt {
    pub comm: Arc<dyn Comm>,
    /// `C`, global tokens per chunk (divisible by the world size, dividing `S`).
    pub chunk: usize,
    /// Park kv chunks, saved o/lse/q/do and dq partials on the host (`Device::Cpu`).
    pub offload: bool,
    residency: Arc<Residency>,
    stash: Arc<SharedStash>,
}

impl Fpdt {
    pub fn new(comm: Arc<dyn Comm>, chunk: usize, offload: bool) -> Self {
        Self { comm, chunk, offload, residency: Arc::default(), stash: Arc::default() }
    }

    /// Most kv chunks that were resident on the compute device at once, since creation.
    /// With `offload` this is at most 2; without, the parked chunks stay on the device.
    pub fn max_resident_kv_chunks(&self) -> usize {
        self.residency.max.load(Ordering::SeqCst)
    }

    /// Validates the chunking for `s` local tokens; returns `(u, c)`: chunks and local
    /// tokens per chunk.
    pub fn plan(&self, s: usize) -> Result<(usize, usize)> {
        let (p, big_c) = (self.comm.world(), self.chunk);
        if big_c == 0 || big_c % p != 0 {
            return crate::config_err!("FPDT chunk C={big_c} must be a positive multiple of the world size P={p}");
        }
        let total = s * p;
        if total == 0 || !total.is_multiple_of(big_c) {
            return crate::config_err!(
                "FPDT: global length S={total} (local {s} × P={p}) is not a positive multiple of the chunk C={big_c}"
            );
        }
        Ok((total / big_c, big_c / p))
    }

    fn stash(&self) -> Result<std::sync::MutexGuard<'_, Stash>> {
        self.stash.0.lock().map_err(|_| candle_core::Error::Msg("FPDT: stash poisoned by a failed call".into()))
    }

    /// Parks `t`: in host memory when offloading, else kept where it is.
    fn hold(&self, t: Tensor) -> Result<Held> {
        if self.offload {
            Ok(Held::Host(self.stash()?.park(&t)?))
        } else {
            Ok(Held::Dev(t))
        }
    }

    /// Starts bringing a parked tensor to `dev`.
    fn bring(&self, h: &Held, dev: &Device) -> Result<Coming> {
        match h {
            Held::Dev(t) => Ok(Coming::Dev(t.clone())),
            Held::Host(p) => Ok(Coming::Host(self.stash()?.fetch(p, dev)?)),
        }
    }

    /// Exchanges local kv chunk `[b, c, hkv, d]` to head-sharded `[b, C, hkv', d]` on the device.
    fn exchange_kv(&self, k: &Tensor, v: &Tensor, rep: usize) -> Result<KvChunk<Tensor>> {
        let c = self.comm.as_ref();
        let k = seq_to_heads(c, &replicate_kv_heads(k, rep)?)?;
        let v = seq_to_heads(c, &replicate_kv_heads(v, rep)?)?;
        Ok(KvChunk { k, v, _slot: Some(Slot::take(&self.residency)) })
    }

    /// Parks a device kv chunk; without offload the parked chunk keeps its device slot.
    fn park_kv(&self, kv: KvChunk<Tensor>) -> Result<KvChunk<Held>> {
        let slot = if self.offload { None } else { kv._slot };
        Ok(KvChunk { k: self.hold(kv.k)?, v: self.hold(kv.v)?, _slot: slot })
    }

    /// Starts bringing a parked kv chunk to `dev` (a new resident slot when it was on the host).
    fn fetch_kv(&self, kv: &KvChunk<Held>, dev: &Device) -> Result<KvChunk<Coming>> {
        let slot = if self.offload { Some(Slot::take(&self.residency)) } else { None };
        Ok(KvChunk { k: self.bring(&kv.k, dev)?, v: self.bring(&kv.v, dev)?, _slot: slot })
    }

    fn fetch_q(&self, qc: &QChunk<Held>, dev: &Device) -> Result<QChunk<Coming>> {
        Ok(QChunk {
            q: self.bring(&qc.q, dev)?,
            d_o: self.bring(&qc.d_o, dev)?,
            o: self.bring(&qc.o, dev)?,
            lse: self.bring(&qc.lse, dev)?,
        })
    }
}

impl AttentionMode for Fpdt {
    fn name(&self) -> &'static str {
        "fpdt"
    }

    fn forward_masked(&self, q: &Tensor, k: &Tensor, v: &Tensor, mask: Masking<'_>, scale: f64) -> Result<(Tensor, Tensor)> {
        let rep = check_heads(q, k, v, self.comm.world())?;
        let (u, cl) = self.plan(q.dim(1)?)?;
        let big_c = cl * self.comm.world();
        let docs = docs::resolve(mask, u * big_c, "FPDT")?;
        let docs = docs.as_deref();
        let chunk = |i: usize| [i * big_c..(i + 1) * big_c];
        let (c, dev) = (self.comm.as_ref(), q.device());
        let mut parked: Vec<KvChunk<Held>> = Vec::with_capacity(u);
        let (mut os, mut lses) = (Vec::with_capacity(u), Vec::with_capacity(u));
        for i in 0..u {
            let qi = chunk(i);
            let qh = seq_to_heads(c, &q.narrow(1, i * cl, cl)?)?;
            let fresh = self.exchange_kv(&k.narrow(1, i * cl, cl)?, &v.narrow(1, i * cl, cl)?, rep)?;
            // The earlier chunks this one sees (all of them without documents).
            let mut js = Vec::with_capacity(i);
            for j in 0..i {
                let kj = chunk(j);
                if docs.map_or(Ok(true), |d| docs::meets(&Block { docs: d, q: &qi, kv: &kj }))? {
                    js.push(j);
                }
            }
            // Diagonal block on the fresh chunk, with the first earlier chunk already on its way.
            let mut next = match js.first() {
                Some(&j) => Some(self.fetch_kv(&parked[j], dev)?),
                None => None,
            };
            let diag = docs::fwd(&qh, &fresh.k, &fresh.v, Mask::Causal, docs.map(|d| Block { docs: d, q: &qi, kv: &qi }), scale)?;
            parked.push(self.park_kv(fresh)?);
            let Some((o_b, lse_b)) = diag else { return crate::shape_err!("FPDT: chunk {i} sees no key of its own") };
            let mut acc = merge::merge(None, &o_b, &lse_b)?;
            for (n, &j) in js.iter().enumerate() {
                let cur = match next.take() {
                    Some(kv) => kv.ready()?,
                    None => self.fetch_kv(&parked[j], dev)?.ready()?,
                };
                next = match js.get(n + 1) {
                    Some(&jn) => Some(self.fetch_kv(&parked[jn], dev)?),
                    None => None,
                };
                let kj = chunk(j);
                let blk = docs.map(|d| Block { docs: d, q: &qi, kv: &kj });
                let part = docs::fwd(&qh, &cur.k, &cur.v, Mask::None, blk, scale)?;
                drop(cur);
                if let Some((o_b, lse_b)) = part {
                    acc = merge::merge(Some(acc), &o_b, &lse_b)?;
                }
            }
            let (oh, lseh) = acc.finish(q.dtype())?;
            os.push(heads_to_seq(c, &oh)?);
            lses.push(lse_heads_to_seq(c, &lseh)?);
        }
        drop(parked);
        self.stash()?.settle()?;
        Ok((Tensor::cat(&os, 1)?, Tensor::cat(&lses, 2)?))
    }

    fn backward_masked(&self, d_o: &Tensor, saved: Saved<'_>, mask: Masking<'_>, scale: f64) -> Result<(Tensor, Tensor, Tensor)> {
        let Saved { q, k, v, o, lse } = saved;
        let rep = check_heads(q, k, v, self.comm.world())?;
        let (u, cl) = self.plan(q.dim(1)?)?;
        let big_c = cl * self.comm.world();
        let docs = docs::resolve(mask, u * big_c, "FPDT backward")?;
        let docs = docs.as_deref();
        let chunk = |i: usize| [i * big_c..(i + 1) * big_c];
        let (c, dev) = (self.comm.as_ref(), q.device());
        saved.check_do(d_o, "FPDT backward")?;
        // The q side of every chunk, head-sharded and parked.
        let mut qside = Vec::with_capacity(u);
        for j in 0..u {
            let part = |t: &Tensor| t.narrow(1, j * cl, cl);
            qside.push(QChunk {
                q: self.hold(seq_to_heads(c, &part(q)?)?)?,
                d_o: self.hold(seq_to_heads(c, &part(d_o)?)?)?,
                o: self.hold(seq_to_heads(c, &part(o)?)?)?,
                lse: self.hold(lse_seq_to_heads(c, &lse.narrow(2, j * cl, cl)?)?)?,
            });
        }
        // f32 [b, C, hq/P, d] partial sums of dq, parked between uses.
        let mut dq_acc: Vec<Option<Held>> = (0..u).map(|_| None).collect();
        let (mut dqs, mut dks, mut dvs) = (Vec::with_capacity(u), Vec::with_capacity(u), Vec::with_capacity(u));
        // The q side of chunk j and its dq partial sum, on their way to the device.
        let fetch = |j: usize, dq_acc: &[Option<Held>]| -> Result<(QChunk<Coming>, Option<Coming>)> {
            let dq = match &dq_acc[j] {
                Some(h) => Some(self.bring(h, dev)?),
                None => None,
            };
            Ok((self.fetch_q(&qside[j], dev)?, dq))
        };
        for i in 0..u {
            let kv = self.exchange_kv(&k.narrow(1, i * cl, cl)?, &v.narrow(1, i * cl, cl)?, rep)?;
            let (mut dk_acc, mut dv_acc) = (None, None); // f32 on the device
            let mut dq_done = None; // dq_i, complete after its first (diagonal) block
                                    // The q chunks that see kv chunk i (all of i..u without documents; i itself always).
            let ki = chunk(i);
            let mut js = Vec::with_capacity(u - i);
            for j in i..u {
                let qj = chunk(j);
                if j == i || docs.map_or(Ok(true), |d| docs::meets(&Block { docs: d, q: &qj, kv: &ki }))? {
                    js.push(j);
                }
            }
            let mut next = Some(fetch(i, &dq_acc)?);
            for (n, &j) in js.iter().enumerate() {
                let (cur, dq_prev) = match next.take() {
                    Some(x) => x,
                    None => fetch(j, &dq_acc)?,
                };
                dq_acc[j] = None; // its content is in `dq_prev`
                next = match js.get(n + 1) {
                    Some(&jn) => Some(fetch(jn, &dq_acc)?),
                    None => None,
                };
                let cur = cur.ready()?;
                let mask = if j == i { Mask::Causal } else { Mask::None };
                let qj = chunk(j);
                let blk = docs.map(|d| Block { docs: d, q: &qj, kv: &ki });
                let grads = docs::bwd(&cur.d_o, Saved::new(&cur.q, &kv.k, &kv.v, &cur.o, &cur.lse), mask, blk, scale)?;
                let dq_prev = match dq_prev {
                    Some(cm) => Some(cm.ready()?),
                    None => None,
                };
                let dq = match grads {
                    Some((dq_p, dk_p, dv_p)) => {
                        dk_acc = Some(add_f32(dk_acc, &dk_p)?);
                        dv_acc = Some(add_f32(dv_acc, &dv_p)?);
                        Some(add_f32(dq_prev, &dq_p)?)
                    }
                    None => dq_prev,
                };
                if j == i {
                    dq_done = dq;
                } else if let Some(dq) = dq {
                    dq_acc[j] = Some(self.hold(dq)?);
                }
            }
            drop(kv);
            let (dqh, dkh, dvh) = match (dq_done, dk_acc, dv_acc) {
                (Some(a), Some(b), Some(c)) => (a, b, c),
                _ => return crate::shape_err!("FPDT backward: chunk {i} got no gradient"),
            };
            dqs.push(heads_to_seq(c, &dqh.to_dtype(q.dtype())?)?);
            dks.push(reduce_replicated_kv_grad(&heads_to_seq(c, &dkh.to_dtype(k.dtype())?)?, rep)?);
            dvs.push(reduce_replicated_kv_grad(&heads_to_seq(c, &dvh.to_dtype(v.dtype())?)?, rep)?);
        }
        drop(qside);
        self.stash()?.settle()?;
        Ok((Tensor::cat(&dqs, 1)?, Tensor::cat(&dks, 1)?, Tensor::cat(&dvs, 1)?))
    }
}
