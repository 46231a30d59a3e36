//! The Llama block and model (also Mistral and Qwen2, which differ only in biases, and
//! Qwen3, which adds a per-head RMSNorm on q and k before RoPE), written as the math of
//! transformers' `LlamaForCausalLM`, with differentiable ops only.
//!
//! Shapes: `b` batch, `s` tokens (this rank's), `h` hidden, `hq`/`hkv` query/kv heads,
//! `d` head dim, `i` intermediate, `V` vocabulary.
//!
//! Module paths mirror the safetensors names:
//! `model.embed_tokens.weight`, `model.layers.N.self_attn.{q,k,v,o}_proj.{weight,bias}`,
//! `model.layers.N.mlp.{gate,up,down}_proj.weight`,
//! `model.layers.N.{input_layernorm,post_attention_layernorm}.weight`, `model.norm.weight`,
//! `model.layers.N.self_attn.{q_norm,k_norm}.weight` (Qwen3, `[d]`),
//! `lm_head.weight` (absent when `tie_word_embeddings`).
//!
//! The model knows nothing of ranks: attention goes through an [`AttentionMode`]
//! (`LocalAttention` on one device) and RoPE takes global position ids. A layer's sliding
//! window ([`LlamaConfig::layer_windows`]) goes with each attention call; the mode joins it
//! to whatever document mask it carries.

use super::config::LlamaConfig;
use super::loss;
use super::rope::{Rope, RopeTable};
use crate::error::{Error, Result};
use candle_core::{DType, Module, Tensor, D};
use candle_nn::{Embedding, Linear, VarBuilder};
use longctx_attention::AttentionMode;
use std::path::PathBuf;
use std::sync::Arc;

/// Where a tensor problem is reported: the checkpoint folder of the config.
fn ckpt_path(cfg: &LlamaConfig) -> PathBuf {
    match cfg.source().parent() {
        Some(p) if !p.as_os_str().is_empty() => p.to_path_buf(),
        _ => PathBuf::from("checkpoint"),
    }
}

/// The shape a backend reported in a shape-mismatch error, if that is what `e` is.
fn mismatch_shape(e: &candle_core::Error) -> Option<Vec<usize>> {
    use candle_core::Error as E;
    match e {
        E::UnexpectedShape { got, .. } => Some(got.dims().to_vec()),
        E::WithBacktrace { inner, .. } | E::WithPath { inner, .. } | E::Context { inner, .. } => mismatch_shape(inner),
        _ => None,
    }
}

/// Fetches `name` under `vb`, checking presence and shape; errors name the tensor.
/// (Presence is checked first: a `VarMap` backend would otherwise create a fresh variable.)
fn get(vb: &VarBuilder, cfg: &LlamaConfig, name: &str, shape: &[usize]) -> Result<Tensor> {
    let full = if vb.prefix().is_empty() { name.to_string() } else { format!("{}.{name}", vb.prefix()) };
    if !vb.contains_tensor(name) {
        return Err(Error::checkpoint(ckpt_path(cfg), format!("missing tensor `{full}` (expected shape {shape:?})")));
    }
    let mismatch = |got: &[usize]| Error::checkpoint(ckpt_path(cfg), format!("tensor `{full}`: expected shape {shape:?}, got {got:?}"));
    match vb.get(shape, name) {
        // Backends that check the shape themselves report a mismatch as an error...
        Err(e) => Err(match mismatch_shape(&e) {
            Some(got) => mismatch(&got),
            None => Error::checkpoint(ckpt_path(cfg), format!("tensor `{full}`: {e}")),
        }),
        // ...and one that does not is checked here.
        Ok(t) if t.dims() != shape => Err(mismatch(t.dims())),
        Ok(t) => Ok(t),
    }
}

fn linear(vb: &VarBuilder, cfg: &LlamaConfig, out_dim: usize, in_dim: usize, bias: bool) -> Result<Linear> {
    let w = get(vb, cfg, "weight", &[out_dim, in_dim])?;
    let b = if bias { Some(get(vb, cfg, "bias", &[out_dim])?) } else { None };
    Ok(Linear::new(w, b))
}

/// RMSNorm as transformers computes it: in f32, `x · rsqrt(mean(x²) + eps)`, cast back
/// to the input dtype, times the weight.
#[derive(Debug, Clone)]
pub struct RmsNorm {
    pub weight: Tensor, // [h]
    pub eps: f64,
}

impl RmsNorm {
    pub fn forward(&self, x: &Tensor) -> candle_core::Result<Tensor> {
        let dtype = x.dtype();
        let x32 = x.to_dtype(DType::F32)?;
        let var = x32.sqr()?.mean_keepdim(D::Minus1)?; // [.., 1]
        let inv = (var + self.eps)?.sqrt()?.recip()?;
        x32.broadcast_mul(&inv)?.to_dtype(dtype)?.broadcast_mul(&self.weight)
    }
}

/// Self-attention: projections, RoPE on q and k, causal attention through the mode, o_proj.
#[derive(Debug, Clone)]
pub struct Attention {
    pub q_proj: Linear, // [hq·d, h]
    pub k_proj: Linear, // [hkv·d, h]
    pub v_proj: Linear, // [hkv·d, h]
    pub o_proj: Linear, // [h, hq·d]
    /// Qwen3: RMSNorm over each head's `d` features of q and of k, before RoPE.
    pub q_norm: Option<RmsNorm>, // [d]
    pub k_norm: Option<RmsNorm>, // [d]
    pub num_heads: usize,
    pub num_kv_heads: usize,
    pub head_dim: usize,
    /// Sliding window: query `i` sees keys `j` with `i − j < window` (`None`: full causal).
    pub window: Option<usize>,
}

impl Attention {
    fn load(vb: VarBuilder, cfg: &LlamaConfig, window: Option<usize>) -> Result<Self> {
        let (h, d, hq, hkv) = (cfg.hidden_size, cfg.head_dim, cfg.num_attention_heads, cfg.num_key_value_heads);
        let norm = |name: &str| -> Result<Option<RmsNorm>> {
            if !cfg.qk_norm() {
                return Ok(None);
            }
            Ok(Some(RmsNorm { weight: get(&vb.pp(name), cfg, "weight", &[d])?, eps: cfg.rms_norm_eps }))
        };
        Ok(Attention {
            q_proj: linear(&vb.pp("q_proj"), cfg, hq * d, h, cfg.qkv_bias())?,
            k_proj: linear(&vb.pp("k_proj"), cfg, hkv * d, h, cfg.qkv_bias())?,
            v_proj: linear(&vb.pp("v_proj"), cfg, hkv * d, h, cfg.qkv_bias())?,
            o_proj: linear(&vb.pp("o_proj"), cfg, h, hq * d, cfg.o_bias())?,
            q_norm: norm("q_norm")?,
            k_norm: norm("k_norm")?,
            num_heads: hq,
            num_kv_heads: hkv,
            head_dim: d,
            window,
        })
    }

    /// `q [b, s, hq, d]`, `k [b, s, hkv, d]` projected from `x [b, s, h]`, each head
    /// RMS-normed when the model has q/k norms (Qwen3), before RoPE.
    pub fn project_qk(&self, x: &Tensor) -> candle_core::Result<(Tensor, Tensor)> {
        let (b, s, _) = x.dims3()?;
        let d = self.head_dim;
        let q = self.q_proj.forward(x)?.reshape((b, s, self.num_heads, d))?;
        let k = self.k_proj.forward(x)?.reshape((b, s, self.num_kv_heads, d))?;
        let norm = |n: &Option<RmsNorm>, t: Tensor| match n {
            Some(n) => n.forward(&t),
            None => Ok(t),
        };
        Ok((norm(&self.q_norm, q)?, norm(&self.k_norm, k)?))
    }

    /// `x [b, s, h]` (already normed) -> `[b, s, h]`.
    pub fn forward(&self, x: &Tensor, rope: &RopeTable, attn: &Arc<dyn AttentionMode>) -> candle_core::Result<Tensor> {
        let (b, s, _) = x.dims3()?;
        let d = self.head_dim;
        let (q, k) = self.project_qk(x)?; // [b, s, hq, d], [b, s, hkv, d]
        let v = self.v_proj.forward(x)?.reshape((b, s, self.num_kv_heads, d))?; // [b, s, hkv, d]
        let q = rope.apply(&q)?;
        let k = rope.apply(&k)?;
        let scale = 1.0 / (d as f64).sqrt();
        let (o, _) = longctx_attention::op::attention_windowed(attn, &q, &k, &v, self.window, scale)?; // [b, s, hq, d]
        self.o_proj.forward(&o.reshape((b, s, self.num_heads * d))?)
    }

    /// [`Self::forward`] for `s` new tokens that follow the `t` tokens whose keys and values
    /// are in `cache` (`[b, t, hkv, d]` each, RoPE applied; `None`: none yet): the new
    /// queries see every cached key and the new keys causally (the two blocks merged by
    /// log-sum-exp; a single new token after a cache, the decoding step, takes a plain f32
    /// attention over all keys instead); the new keys and values are appended to `cache`.
    /// Under a sliding window each block is masked to it (the cached keys as a band at
    /// offset `t`, the decoding step over the last `window` keys only). No graph is meant.
    pub fn forward_cached(&self, x: &Tensor, rope: &RopeTable, cache: &mut Option<(Tensor, Tensor)>) -> candle_core::Result<Tensor> {
        use longctx_attention::kernel::{fwd, Mask};
        use longctx_attention::merge::merge;
        let (b, s, _) = x.dims3()?;
        let d = self.head_dim;
        let (q, k) = self.project_qk(x)?;
        let q = rope.apply(&q)?.contiguous()?;
        let k = rope.apply(&k)?.contiguous()?;
        let v = self.v_proj.forward(x)?.reshape((b, s, self.num_kv_heads, d))?.contiguous()?;
        let scale = 1.0 / (d as f64).sqrt();
        // The new tokens among themselves; the new tokens against `t` cached ones.
        let diag = match self.window {
            Some(w) if w < s => Mask::Band { offset: 0, window: w },
            _ => Mask::Causal,
        };
        let past = |t: usize| match self.window {
            Some(window) => Mask::Band { offset: t, window },
            None => Mask::None,
        };
        let o = match cache.take() {
            // One new token (decoding): it sees every key (the last `window` under a window),
            // so no mask; scores `[b, hq, 1, t]` are small, and the plain f32 matmul path has
            // no per-shape set-up (the fused kernel would plan a new graph for every length t,
            // once per token and layer).
            Some((k_old, v_old)) if s == 1 => {
                let k_all = Tensor::cat(&[&k_old, &k], 1)?;
                let v_all = Tensor::cat(&[&v_old, &v], 1)?;
                let n = k_all.dim(1)?;
                let from = self.window.map_or(0, |w| n.saturating_sub(w));
                let f32 = |t: &Tensor| t.narrow(1, from, n - from)?.to_dtype(candle_core::DType::F32);
                let (o, _) =
                    longctx_attention::naive::fwd(&q.to_dtype(candle_core::DType::F32)?, &f32(&k_all)?, &f32(&v_all)?, Mask::None, scale)?;
                *cache = Some((k_all, v_all));
                o.to_dtype(q.dtype())?
            }
            None => {
                let (o_new, _) = fwd(&q, &k, &v, diag, scale)?;
                *cache = Some((k, v));
                o_new
            }
            Some((k_old, v_old)) => {
                let (o_new, lse_new) = fwd(&q, &k, &v, diag, scale)?;
                let (o_old, lse_old) = fwd(&q, &k_old, &v_old, past(k_old.dim(1)?), scale)?;
                let acc = merge(Some(merge(None, &o_old, &lse_old)?), &o_new, &lse_new)?;
                *cache = Some((Tensor::cat(&[&k_old, &k], 1)?, Tensor::cat(&[&v_old, &v], 1)?));
                acc.finish(q.dtype())?.0
            }
        };
        self.o_proj.forward(&o.reshape((b, s, self.num_heads * d))?)
    }
}

/// SwiGLU MLP: `down(silu(gate(x)) · up(x))` (Candle's `silu` has a backward).
#[derive(Debug, Clone)]
pub struct Mlp {
    pub gate_proj: Linear, // [i, h]
    pub up_proj: Linear,   // [i, h]
    pub down_proj: Linear, // [h, i]
}

impl Mlp {
    fn load(vb: VarBuilder, cfg: &LlamaConfig) -> Result<Self> {
        let (h, i, bias) = (cfg.hidden_size, cfg.intermediate_size, cfg.has_mlp_bias());
        Ok(Mlp {
            gate_proj: linear(&vb.pp("gate_proj"), cfg, i, h, bias)?,
            up_proj: linear(&vb.pp("up_proj"), cfg, i, h, bias)?,
            down_proj: linear(&vb.pp("down_proj"), cfg, h, i, bias)?,
        })
    }

    /// `[.., h] -> [.., h]`; token-wise, so it may be run on any chunk of tokens.
    pub fn forward(&self, x: &Tensor) -> candle_core::Result<Tensor> {
        let g = self.gate_proj.forward(x)?.silu()?;
        self.down_proj.forward(&g.mul(&self.up_proj.forward(x)?)?)
    }
}

/// One pre-norm decoder block: `x + attn(norm(x))`, then `+ mlp(norm(·))`.
#[derive(Debug, Clone)]
pub struct DecoderLayer {
    pub self_attn: Attention,
    pub mlp: Mlp,
    pub input_layernorm: RmsNorm,
    pub post_attention_layernorm: RmsNorm,
}

impl DecoderLayer {
    /// Layer `index` of the model (its sliding window is the config's for that layer).
    pub fn load(vb: VarBuilder, cfg: &LlamaConfig, index: usize) -> Result<Self> {
        let h = cfg.hidden_size;
        let norm =
            |name: &str| -> Result<RmsNorm> { Ok(RmsNorm { weight: get(&vb.pp(name), cfg, "weight", &[h])?, eps: cfg.rms_norm_eps }) };
        Ok(DecoderLayer {
            self_attn: Attention::load(vb.pp("self_attn"), cfg, cfg.layer_window(index)?)?,
            mlp: Mlp::load(vb.pp("mlp"), cfg)?,
            input_layernorm: norm("input_layernorm")?,
            post_attention_layernorm: norm("post_attention_layernorm")?,
        })
    }

    /// `x [b, s, h]` -> `[b, s, h]`; `rope` holds cos/sin for exactly these tokens.
    pub fn forward(&self, x: &Tensor, rope: &RopeTable, attn: &Arc<dyn AttentionMode>) -> Result<Tensor> {
        let a = self.self_attn.forward(&self.input_layernorm.forward(x)?, rope, attn)?;
        let x = x.add(&a)?;
        let m = self.mlp.forward(&self.post_attention_layernorm.forward(&x)?)?;
        Ok(x.add(&m)?)
    }

    /// [`Self::forward`] with the attention's keys and values cached (see
    /// [`Attention::forward_cached`]).
    pub fn forward_cached(&self, x: &Tensor, rope: &RopeTable, cache: &mut Option<(Tensor, Tensor)>) -> Result<Tensor> {
        let a = self.self_attn.forward_cached(&self.input_layernorm.forward(x)?, rope, cache)?;
        let x = x.add(&a)?;
        let m = self.mlp.forward(&self.post_attention_layernorm.forward(&x)?)?;
        Ok(x.add(&m)?)
    }

    /// The layer's parameters with their names relative to `model.layers.N.`.
    pub fn named_parameters(&self) -> Vec<(String, Tensor)> {
        let mut out = Vec::new();
        fn lin(out: &mut Vec<(String, Tensor)>, name: &str, l: &Linear) {
            out.push((format!("{name}.weight"), l.weight().clone()));
            if let Some(b) = l.bias() {
                out.push((format!("{name}.bias"), b.clone()));
            }
        }
        let a = &self.self_attn;
        lin(&mut out, "self_attn.q_proj", &a.q_proj);
        lin(&mut out, "self_attn.k_proj", &a.k_proj);
        lin(&mut out, "self_attn.v_proj", &a.v_proj);
        lin(&mut out, "self_attn.o_proj", &a.o_proj);
        if let (Some(qn), Some(kn)) = (&a.q_norm, &a.k_norm) {
            out.push(("self_attn.q_norm.weight".into(), qn.weight.clone()));
            out.push(("self_attn.k_norm.weight".into(), kn.weight.clone()));
        }
        lin(&mut out, "mlp.gate_proj", &self.mlp.gate_proj);
        lin(&mut out, "mlp.up_proj", &self.mlp.up_proj);
        lin(&mut out, "mlp.down_proj", &self.mlp.down_proj);
        out.push(("input_layernorm.weight".into(), self.input_layernorm.weight.clone()));
        out.push(("post_attention_layernorm.weight".into(), self.post_attention_layernorm.weight.clone()));
        out
    }
}

/// The causal language model.
#[derive(Debug, Clone)]
pub struct Llama {
    pub cfg: LlamaConfig,
    pub rope: Rope,
    pub embed_tokens: Embedding, // [V, h]
    pub layers: Vec<DecoderLayer>,
    pub norm: RmsNorm,
    /// `[V, h]`; shares the embedding tensor when `tie_word_embeddings`.
    pub lm_head: Linear,
}

impl Llama {
    /// Builds the model from `vb` (rooted at the checkpoint's top level, so that names
    /// read `model.…` and `lm_head.weight`). The dtype and device are `vb`'s.
    pub fn load(vb: VarBuilder, cfg: &LlamaConfig) -> Result<Self> {
        let (h, v) = (cfg.hidden_size, cfg.vocab_size);
        let m = vb.pp("model");
        let emb = get(&m.pp("embed_tokens"), cfg, "weight", &[v, h])?;
        let mut layers = Vec::with_capacity(cfg.num_hidden_layers);
        for i in 0..cfg.num_hidden_layers {
            layers.push(DecoderLayer::load(m.pp(format!("layers.{i}")), cfg, i)?);
        }
        let norm = RmsNorm { weight: get(&m.pp("norm"), cfg, "weight", &[h])?, eps: cfg.rms_norm_eps };
        let lm_head = if cfg.tie_word_embeddings {
            Linear::new(emb.clone(), None)
        } else {
            Linear::new(get(&vb.pp("lm_head"), cfg, "weight", &[v, h])?, None)
        };
        Ok(Llama { cfg: cfg.clone(), rope: Rope::new(cfg), embed_tokens: Embedding::new(emb, h), layers, norm, lm_head })
    }

    /// Dtype of the weights (and of hidden states).
    pub fn dtype(&self) -> DType {
        self.embed_tokens.embeddings().dtype()
    }

    /// cos/sin for `positions [b, s]` (u32 global ids) in the model dtype; `seq_len` is the
    /// global sequence length (only dynamic NTK uses it; `None`: max position + 1).
    pub fn rope_table(&self, positions: &Tensor, seq_len: Option<usize>) -> Result<RopeTable> {
        Ok(self.rope.table(positions, seq_len, self.dtype())?)
    }

    /// `ids [b, s]` u32 -> `[b, s, h]`.
    pub fn embed(&self, ids: &Tensor) -> Result<Tensor> {
        Ok(self.embed_tokens.forward(ids)?)
    }

    /// Final hidden states `[b, s, h]`, after the last norm (input of `lm_head`).
    pub fn forward_hidden(&self, ids: &Tensor, positions: &Tensor, attn: &Arc<dyn AttentionMode>) -> Result<Tensor> {
        let rope = self.rope_table(positions, None)?;
        let mut x = self.embed(ids)?;
        for layer in &self.layers {
            x = layer.forward(&x, &rope, attn)?;
        }
        Ok(self.norm.forward(&x)?)
    }

    /// Final hidden states `[b, s, h]` of `ids [b, s]`, the tokens that follow the
    /// `cache.len()` tokens already in `cache` (positions `cache.len()..`); appends their
    /// keys and values to it. Equals [`Self::forward_hidden`] over the whole sequence at
    /// these rows (except for dynamic NTK RoPE, whose base depends on the length: cached
    /// keys keep the base of the length they were computed at, as in transformers).
    pub fn forward_hidden_cached(&self, ids: &Tensor, cache: &mut KvCache) -> Result<Tensor> {
        let (b, s) = ids.dims2()?;
        if cache.layers.len() != self.layers.len() {
            return Err(Error::Setting(format!(
                "kv cache has {} layers, the model {}; make it with KvCache::new(model)",
                cache.layers.len(),
                self.layers.len()
            )));
        }
        let start = u32::try_from(cache.len).map_err(|_| Error::Setting("kv cache position does not fit u32".into()))?;
        let end = u32::try_from(cache.len + s).map_err(|_| Error::Setting("kv cache position does not fit u32".into()))?;
        let positions = Tensor::arange(start, end, ids.device())?.unsqueeze(0)?.repeat((b, 1))?;
        let rope = self.rope_table(&positions, None)?;
        let mut x = self.embed(ids)?;
        for (layer, slot) in self.layers.iter().zip(cache.layers.iter_mut()) {
            x = layer.forward_cached(&x, &rope, slot)?;
        }
        cache.len += s;
        Ok(self.norm.forward(&x)?)
    }

    /// `hidden [b, s, h]` -> logits `[b, s, V]` (model dtype).
    pub fn logits(&self, hidden: &Tensor) -> Result<Tensor> {
        Ok(self.lm_head.forward(hidden)?)
    }

    /// Per-token loss `[b, s]` f32 (0 where ignored) and the count of counted tokens.
    /// Targets: see [`loss`] (i64, negative = ignore).
    pub fn per_token_loss(
        &self,
        ids: &Tensor,
        targets: &Tensor,
        positions: &Tensor,
        attn: &Arc<dyn AttentionMode>,
    ) -> Result<(Tensor, usize)> {
        let logits = self.logits(&self.forward_hidden(ids, positions, attn)?)?;
        loss::per_token_loss(&logits, targets)
    }

    /// `(Σ token losses (scalar f32), counted tokens)`: a SUM; divide by the global count.
    pub fn loss(&self, ids: &Tensor, targets: &Tensor, positions: &Tensor, attn: &Arc<dyn AttentionMode>) -> Result<(Tensor, usize)> {
        let (l, n) = self.per_token_loss(ids, targets, positions, attn)?;
        Ok((l.sum_all()?, n))
    }

    /// Every parameter with its safetensors name (`lm_head.weight` omitted when tied).
    pub fn named_parameters(&self) -> Vec<(String, Tensor)> {
        let mut out = vec![("model.embed_tokens.weight".to_string(), self.embed_tokens.embeddings().clone())];
        for (i, l) in self.layers.iter().enumerate() {
            out.extend(l.named_parameters().into_iter().map(|(n, t)| (format!("model.layers.{i}.{n}"), t)));
        }
        out.push(("model.norm.weight".into(), self.norm.weight.clone()));
        if !self.cfg.tie_word_embeddings {
            out.push(("lm_head.weight".into(), self.lm_head.weight().clone()));
        }
        out
    }
}

/// Keys and values (RoPE applied) of the tokens a [`Llama`] has seen, per layer, for
/// generation: [`Llama::forward_hidden_cached`] reads and extends it.
#[derive(Debug, Clone)]
pub struct KvCache {
    /// Per layer `(k, v)`, each `[b, len, hkv, d]`; `None` before the first token.
    pub layers: Vec<Option<(Tensor, Tensor)>>,
    /// Tokens cached (the position of the next token).
    pub len: usize,
}

impl KvCache {
    /// An empty cache for `model`.
    pub fn new(model: &Llama) -> Self {
        Self { layers: vec![None; model.layers.len()], len: 0 }
    }
}
