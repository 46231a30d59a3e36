//! Per-token losses and argmax predictions of one sequence, on one device or split over
//! the ranks of a sequence-parallel group, so that a context longer than one device
//! holds can be evaluated.
//!
//! The split is the training one: [`ParallelMode::local_indices`] picks this rank's
//! global tokens (zigzag for the ring, contiguous for Ulysses, per chunk for FPDT) and
//! [`apply_layout`] permutes ids, targets and position ids identically. The model runs
//! unchanged (it knows nothing of ranks) with the mode's attention; the rank results are
//! all-gathered and put back in global order. A length the mode cannot split is padded
//! at the end (pad ids, ignored targets): under causal attention later tokens change no
//! earlier result, and RoPE is given the unpadded length.
//!
//! Ranks are threads of this process (`--world-size N`) or processes started by
//! `longctx launch` (the torchrun-style environment), like training.

use std::sync::Arc;
use std::time::Duration;

use candle_core::{DType, Device, Tensor, D};
use longctx_attention::comm::Comm;
use longctx_attention::local::LocalAttention;
use longctx_attention::AttentionMode;

use crate::data::layout::apply_layout;
use crate::model::{loss, Llama};
use crate::parallel::dims::{build_groups, DimsRequest, Groups, ParallelDims};
use crate::parallel::ParallelMode;
use crate::{Error, Result};

/// What the user asked for: mode, in-process ranks, Ulysses degree (USP), FPDT chunk.
#[derive(Debug, Clone)]
pub struct RanksSpec {
    pub mode: ParallelMode,
    /// Ranks as threads of this process (ignored under a launcher: one rank per process).
    pub world_size: usize,
    /// USP's Ulysses degree (`None`: implied by the mode).
    pub ulysses: Option<usize>,
    /// FPDT chunk in global tokens (shortened to the padded sequence when longer).
    pub fpdt_chunk: usize,
    /// Tokens per chunk of the head and loss (`[tokens, vocab]` logits never exist whole).
    pub token_chunk: usize,
    /// A collective that waits longer than this for a peer aborts every rank.
    pub collective_timeout: Option<Duration>,
}

impl Default for RanksSpec {
    fn default() -> Self {
        Self {
            mode: ParallelMode::DataParallel,
            world_size: 1,
            ulysses: None,
            fpdt_chunk: 65536,
            token_chunk: 4096,
            collective_timeout: Some(Duration::from_secs(600)),
        }
    }
}

/// This rank's place in the evaluation: its sequence-parallel group and attention.
pub struct Ranks {
    pub mode: ParallelMode,
    /// `None` on one device.
    dims: Option<ParallelDims>,
    sp: Option<Arc<dyn Comm>>,
    groups: Option<Groups>,
    attn: Arc<dyn AttentionMode>,
    fpdt_chunk: usize,
    token_chunk: usize,
}

/// Per-token results of a sequence, in global order: `loss[t]` is the cross-entropy of
/// `targets[t]` (0 where the target is ignored), `argmax[t]` the most likely next token.
#[derive(Debug, Clone, PartialEq)]
pub struct TokenScores {
    pub loss: Vec<f32>,
    pub argmax: Vec<u32>,
}

impl Ranks {
    /// One device, no communication.
    pub fn single(token_chunk: usize) -> Self {
        Self {
            mode: ParallelMode::DataParallel,
            dims: None,
            sp: None,
            groups: None,
            attn: Arc::new(LocalAttention),
            fpdt_chunk: 0,
            token_chunk: token_chunk.max(1),
        }
    }

    /// This rank of `world` (every rank of it is one sequence-parallel group).
    pub fn new(spec: &RanksSpec, world: Arc<dyn Comm>, hq: usize, hkv: usize) -> Result<Self> {
        let n = world.world();
        if n == 1 {
            return Ok(Self::single(spec.token_chunk));
        }
        if spec.mode == ParallelMode::DataParallel {
            return Err(Error::config(
                "--parallel-mode",
                "parallel-mode",
                format!(
                    "{n} ranks with data_parallel would each evaluate the whole sequence; pick a sequence-parallel mode \
                     (zigzag_ring_attn, ulysses_attn, fpdt, usp) or one rank"
                ),
            ));
        }
        let dims = ParallelDims::new(&DimsRequest { mode: spec.mode, world: n, sp: Some(n), ulysses: spec.ulysses, hq, hkv })?;
        let groups = build_groups(&world, &dims)?;
        let attn = spec.mode.build(&groups, spec.fpdt_chunk, false);
        Ok(Self {
            mode: spec.mode,
            dims: Some(dims),
            sp: Some(groups.sp.clone()),
            groups: Some(groups),
            attn,
            fpdt_chunk: spec.fpdt_chunk,
            token_chunk: spec.token_chunk.max(1),
        })
    }

    /// The ranks of an existing layout (training's): this rank's sequence-parallel group
    /// of `groups` under `mode`. A group of one rank is one device.
    pub fn from_groups(mode: ParallelMode, dims: ParallelDims, groups: &Groups, fpdt_chunk: usize, token_chunk: usize) -> Self {
        if groups.sp.world() == 1 {
            return Self::single(token_chunk);
        }
        Self {
            mode,
            dims: Some(dims),
            sp: Some(groups.sp.clone()),
            groups: Some(groups.clone()),
            attn: mode.build(groups, fpdt_chunk, false),
            fpdt_chunk,
            token_chunk: token_chunk.max(1),
        }
    }

    /// Rank within the sequence-parallel group (0 on one device): rank 0 reports.
    pub fn rank(&self) -> usize {
        self.sp.as_ref().map_or(0, |c| c.rank())
    }

    pub fn world(&self) -> usize {
        self.sp.as_ref().map_or(1, |c| c.world())
    }

    /// The FPDT chunk for a sequence of `len` tokens: the requested one, shortened to the
    /// sequence rounded up to a multiple of `sp`, itself a multiple of `sp`.
    fn chunk_for(&self, len: usize) -> usize {
        let sp = self.world();
        let round = len.div_ceil(sp) * sp;
        (self.fpdt_chunk.min(round) / sp * sp).max(sp)
    }

    /// The length `len` is padded to so that the mode can split it.
    pub fn padded_len(&self, len: usize) -> usize {
        let multiple = match &self.dims {
            None => 1,
            Some(_) => self.mode.seq_multiple(self.world(), self.chunk_for(len)),
        };
        len.div_ceil(multiple) * multiple
    }

    /// Per-token losses and argmax of `ids` (one sequence, `targets` aligned: negative =
    /// ignored). Every rank calls it with the same sequence; every rank gets the whole
    /// result.
    pub fn token_scores(&self, model: &Llama, ids: &[u32], targets: &[i64]) -> Result<TokenScores> {
        self.token_scores_docs(model, ids, targets, &[])
    }

    /// [`Ranks::token_scores`] of a sequence of several documents starting at
    /// `doc_starts` (ascending, the first 0; empty: one document): attention under the
    /// document mask, positions restarting at every document.
    pub fn token_scores_docs(&self, model: &Llama, ids: &[u32], targets: &[i64], doc_starts: &[usize]) -> Result<TokenScores> {
        let len = ids.len();
        if len == 0 || targets.len() != len {
            return Err(Error::Setting(format!("token_scores: {len} ids and {} targets (need equal, at least 1)", targets.len())));
        }
        let padded = self.padded_len(len);
        let (mut ids_p, mut targets_p) = (ids.to_vec(), targets.to_vec());
        ids_p.resize(padded, 0);
        targets_p.resize(padded, loss::IGNORE_INDEX);
        // The padding joins the last document: causal attention keeps it out of every real token.
        let docs = longctx_attention::Docs::new(vec![doc_starts.to_vec()], padded)?;
        let ranges = docs.ranges(0);
        let mut global_pos = vec![0u32; padded];
        for d in &ranges {
            for (i, p) in global_pos[d.clone()].iter_mut().enumerate() {
                *p = i as u32;
            }
        }
        let (dims, sp) = match (&self.dims, &self.sp) {
            (Some(d), Some(c)) => (d, c),
            _ => {
                let attn = longctx_attention::mode::with_docs(&self.attn, Some(docs));
                let (l, a) = local_scores(model, &ids_p, &targets_p, &global_pos, len, &attn, self.token_chunk)?;
                return Ok(TokenScores { loss: l[..len].to_vec(), argmax: a[..len].to_vec() });
            }
        };
        let chunk = self.chunk_for(len);
        // FPDT's attention walks the chunks of this sequence: built for its chunk.
        let attn = match (&self.groups, self.mode) {
            (Some(g), ParallelMode::Fpdt) => self.mode.build(g, chunk, false),
            _ => self.attn.clone(),
        };
        let attn = longctx_attention::mode::with_docs(&attn, Some(docs));
        let all: Vec<Vec<usize>> = (0..sp.world()).map(|r| self.mode.local_indices(dims, r, padded, chunk)).collect::<Result<_>>()?;
        let local = apply_layout(&ids_p, &targets_p, padded, &all[sp.rank()])?;
        let positions: Vec<u32> = all[sp.rank()].iter().map(|&i| global_pos[i]).collect();
        let (l, a) = local_scores(model, &local.ids, &local.targets, &positions, len, &attn, self.token_chunk)?;
        // [2, L_local] f32: losses and argmax ids (exact in f32 below 2^24).
        let n = l.len();
        let mut packed = l;
        packed.extend(a.iter().map(|&x| x as f32));
        let t = Tensor::from_vec(packed, (2, n), &candle_core::Device::Cpu)?.to_device(model.embed_tokens.embeddings().device())?;
        let parts = sp.all_gather(&t)?;
        let parts: Vec<Tensor> = parts.into_iter().map(|p| p.to_device(&candle_core::Device::Cpu)).collect::<candle_core::Result<_>>()?;
        let global = longctx_attention::layout::gather(&parts, 1, &all)?; // [2, padded]
        let rows: Vec<Vec<f32>> = global.to_vec2()?;
        Ok(TokenScores { loss: rows[0][..len].to_vec(), argmax: rows[1][..len].iter().map(|&x| x as u32).collect() })
    }
}

/// The model over this rank's tokens: per-token loss and argmax, head and loss run
/// `token_chunk` tokens at a time. `seq_len`: the global (unpadded) length for RoPE.
fn local_scores(
    model: &Llama,
    ids: &[u32],
    targets: &[i64],
    positions: &[u32],
    seq_len: usize,
    attn: &Arc<dyn AttentionMode>,
    token_chunk: usize,
) -> Result<(Vec<f32>, Vec<u32>)> {
    let dev = model.embed_tokens.embeddings().device().clone();
    let n = ids.len();
    let ids_t = Tensor::from_slice(ids, (1, n), &dev)?;
    let pos_t = Tensor::from_slice(positions, (1, n), &dev)?;
    let rope = model.rope_tables(&pos_t, Some(seq_len))?;
    let mut x = model.embed(&ids_t)?;
    for layer in &model.layers {
        x = layer.forward(&x, &rope, attn)?;
    }
    let h = model.norm.forward(&x)?;
    let (mut losses, mut argmax) = (Vec::with_capacity(n), Vec::with_capacity(n));
    let mut start = 0;
    while start < n {
        let c = token_chunk.min(n - start);
        let logits = model.logits(&h.narrow(1, start, c)?)?; // [1, c, V]
        let tg = Tensor::from_slice(&targets[start..start + c], (1, c), &dev)?;
        let (l, _) = loss::per_token_loss(&logits, &tg)?;
        losses.extend(l.flatten_all()?.to_vec1::<f32>()?);
        argmax.extend(logits.to_dtype(DType::F32)?.argmax(D::Minus1)?.flatten_all()?.to_vec1::<u32>()?);
        start += c;
    }
    Ok((losses, argmax))
}

/// Runs `f` on every rank of the world `spec` describes and returns rank 0's result:
/// one device when `world_size` is 1, threads of this process sharing one device
/// otherwise, or this process's rank of a launched world (`device` then means
/// `cuda:LOCAL_RANK` or the CPU; only rank 0 returns `Some`). `load` runs once per
/// process, on the device the ranks of this process use (models, data).
pub fn with_ranks<M: Sync, T: Send>(
    spec: &RanksSpec,
    device: &str,
    load: impl FnOnce(&Device) -> Result<M>,
    heads: impl Fn(&M) -> (usize, usize),
    f: impl Fn(&Ranks, &M) -> Result<T> + Sync,
) -> Result<Option<T>> {
    if let Some(env) = crate::parallel::DistEnv::from_env()? {
        let joined = crate::parallel::world::join(&env, device, spec.collective_timeout)?;
        let res = load(&joined.device).and_then(|m| {
            let (hq, hkv) = heads(&m);
            let r = Ranks::new(spec, joined.comm.clone(), hq, hkv)?;
            f(&r, &m)
        });
        joined.finish(&res);
        let out = res?;
        return Ok((env.rank == 0).then_some(out));
    }
    let dev = crate::device::parse_device(device, std::path::Path::new("--device"))?;
    let m = load(&dev)?;
    if spec.world_size <= 1 {
        return f(&Ranks::single(spec.token_chunk), &m).map(Some);
    }
    let max = crate::limits::MAX_THREAD_RANKS;
    if spec.world_size > max {
        return Err(Error::config(
            "--world-size",
            "world-size",
            format!("got {}, expected 1 to {max} ranks as threads; use `longctx launch` for more", spec.world_size),
        ));
    }
    let (hq, hkv) = heads(&m);
    let mut outs = crate::parallel::world::run_threads(spec.world_size, spec.collective_timeout, |comm| {
        let r = Ranks::new(spec, comm, hq, hkv)?;
        f(&r, &m)
    })?;
    Ok(if outs.is_empty() { None } else { Some(outs.swap_remove(0)) })
}
