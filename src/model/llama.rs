//! The Llama block and model (also Mistral and Qwen2, which differ only in biases, and
//! Qwen3, which adds a per-head RMSNorm on q and k before RoPE), written as the math of
//! transformers' `LlamaForCausalLM`, with differentiable ops only. Gemma 3 text is the
//! same block with its own pieces (`LlamaConfig::gemma_block`): RMSNorms scaling by
//! `1 + w` in f32, a norm on the attention output and on the MLP output besides the two
//! input norms, GeGLU (tanh GELU), the embedding times `sqrt(h)`, q/k norms, attention
//! scale `query_pre_attn_scalar^-1/2`, and a second RoPE for its sliding-window layers.
//!
//! Shapes: `b` batch, `s` tokens (this rank's), `h` hidden, `hq`/`hkv` query/kv heads,
//! `d` head dim, `i` intermediate, `V` vocabulary.
//!
//! Module paths mirror the safetensors names:
//! `model.embed_tokens.weight`, `model.layers.N.self_attn.{q,k,v,o}_proj.{weight,bias}`,
//! `model.layers.N.mlp.{gate,up,down}_proj.weight`,
//! `model.layers.N.{input_layernorm,post_attention_layernorm}.weight`, `model.norm.weight`,
//! `model.layers.N.self_attn.{q_norm,k_norm}.weight` (Qwen3, Gemma 3, `[d]`),
//! `model.layers.N.{pre_feedforward_layernorm,post_feedforward_layernorm}.weight` (Gemma 3),
//! `lm_head.weight` (absent when `tie_word_embeddings`).
//!
//! The model knows nothing of ranks: attention goes through an [`AttentionMode`]
//! (`LocalAttention` on one device) and RoPE takes global position ids. A layer's sliding
//! window ([`LlamaConfig::layer_windows`]) goes with each attention call; the mode joins it
//! to whatever document mask it carries.

use super::config::LlamaConfig;
use super::loss;
use super::rope::{Rope, RopeTable, RopeTables};
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
/// to the input dtype, times the weight; Gemma's (`one_plus`) multiplies by `1 + w` in f32
/// and casts after.
#[derive(Debug, Clone)]
pub struct RmsNorm {
    pub weight: Tensor, // [h]
    pub eps: f64,
    /// Gemma: the weight is stored centred on 0 and applied as `1 + w`, before the cast.
    pub one_plus: bool,
}

impl RmsNorm {
    /// The norm named `name` under `vb`, of `dim` features, in the family's style.
    fn load(vb: &VarBuilder, cfg: &LlamaConfig, name: &str, dim: usize) -> Result<Self> {
        Ok(RmsNorm { weight: get(&vb.pp(name), cfg, "weight", &[dim])?, eps: cfg.rms_norm_eps, one_plus: cfg.gemma_block() })
    }

    pub fn forward(&self, x: &Tensor) -> candle_core::Result<Tensor> {
        let dtype = x.dtype();
        let x32 = x.to_dtype(DType::F32)?;
        let var = x32.sqr()?.mean_keepdim(D::Minus1)?; // [.., 1]
        let inv = (var + self.eps)?.sqrt()?.recip()?;
        let n = x32.broadcast_mul(&inv)?;
        if self.one_plus {
            return n.broadcast_mul(&(self.weight.to_dtype(DType::F32)? + 1.0)?)?.to_dtype(dtype);
        }
        n.to_dtype(dtype)?.broadcast_mul(&self.weight)
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
    /// The factor on q·k ([`LlamaConfig::attention_scale`]).
    pub scale: f64,
    /// Sliding window: query `i` sees keys `j` with `i − j < window` (`None`: full causal).
    pub window: Option<usize>,
}

impl Attention {
    fn load(vb: VarBuilder, cfg: &LlamaConfig, window: Option<usize>) -> Result<Self> {
        let (h, d, hq, hkv) = (cfg.hidden_size, cfg.head_dim, cfg.num_attention_heads, cfg.num_key_value_heads);
        let norm = |name: &str| -> Result<Option<RmsNorm>> { cfg.qk_norm().then(|| RmsNorm::load(&vb, cfg, name, d)).transpose() };
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
            scale: cfg.attention_scale(),
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
        let (o, _) = longctx_attention::op::attention_windowed(attn, &q, &k, &v, self.window, self.scale)?; // [b, s, hq, d]
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
        let scale = self.scale;
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

/// SwiGLU MLP: `down(silu(gate(x)) · up(x))` (Candle's `silu` has a backward); Gemma's
/// GeGLU takes the tanh GELU instead of silu (Candle's `gelu` is that one, with a backward).
#[derive(Debug, Clone)]
pub struct Mlp {
    pub gate_proj: Linear, // [i, h]
    pub up_proj: Linear,   // [i, h]
    pub down_proj: Linear, // [h, i]
    /// GeGLU with `gelu_pytorch_tanh` (Gemma 3) instead of SwiGLU.
    pub gelu_tanh: bool,
}

impl Mlp {
    fn load(vb: VarBuilder, cfg: &LlamaConfig) -> Result<Self> {
        let (h, i, bias) = (cfg.hidden_size, cfg.intermediate_size, cfg.has_mlp_bias());
        Ok(Mlp {
            gate_proj: linear(&vb.pp("gate_proj"), cfg, i, h, bias)?,
            up_proj: linear(&vb.pp("up_proj"), cfg, i, h, bias)?,
            down_proj: linear(&vb.pp("down_proj"), cfg, h, i, bias)?,
            gelu_tanh: cfg.gemma_block(),
        })
    }

    /// `[.., h] -> [.., h]`; token-wise, so it may be run on any chunk of tokens.
    pub fn forward(&self, x: &Tensor) -> candle_core::Result<Tensor> {
        let g = self.gate_proj.forward(x)?;
        let g = if self.gelu_tanh { g.gelu()? } else { g.silu()? };
        self.down_proj.forward(&g.mul(&self.up_proj.forward(x)?)?)
    }
}

/// One pre-norm decoder block: `x + attn(norm(x))`, then `+ mlp(norm(·))`; Gemma 3's
/// sandwich: `h = x + norm(attn(norm(x)))`, `y = h + norm(mlp(norm(h)))`.
#[derive(Debug, Clone)]
pub struct DecoderLayer {
    pub self_attn: Attention,
    pub mlp: Mlp,
    pub input_layernorm: RmsNorm,
    /// Llama: the norm of the MLP input. Gemma 3: the norm of the attention output.
    pub post_attention_layernorm: RmsNorm,
    /// Gemma 3: `(pre_feedforward_layernorm, post_feedforward_layernorm)`, the norms of
    /// the MLP input and output.
    pub feedforward_norms: Option<(RmsNorm, RmsNorm)>,
    /// Whether the layer takes the local RoPE table (Gemma 3's sliding-window layers).
    pub rope_local: bool,
}

impl DecoderLayer {
    /// Layer `l` of the model: its sliding window is the config's for that layer, and `l`
    /// picks its RoPE (Gemma 3's sliding layers have their own).
    pub fn load(vb: VarBuilder, cfg: &LlamaConfig, l: usize) -> Result<Self> {
        let h = cfg.hidden_size;
        let norm = |name: &str| RmsNorm::load(&vb, cfg, name, h);
        let feedforward_norms = match cfg.gemma_block() {
            true => Some((norm("pre_feedforward_layernorm")?, norm("post_feedforward_layernorm")?)),
            false => None,
        };
        Ok(DecoderLayer {
            self_attn: Attention::load(vb.pp("self_attn"), cfg, cfg.layer_window(l)?)?,
            mlp: Mlp::load(vb.pp("mlp"), cfg)?,
            input_layernorm: norm("input_layernorm")?,
            post_attention_layernorm: norm("post_attention_layernorm")?,
            feedforward_norms,
            rope_local: cfg.layer_rope_is_local(l),
        })
    }

    /// The norm of the MLP input.
    pub fn mlp_norm(&self) -> &RmsNorm {
        self.feedforward_norms.as_ref().map_or(&self.post_attention_layernorm, |(pre, _)| pre)
    }

    /// Gemma 3: the norm of the attention output, before the residual add.
    pub fn attn_out_norm(&self) -> Option<&RmsNorm> {
        self.feedforward_norms.as_ref().map(|_| &self.post_attention_layernorm)
    }

    /// Gemma 3: the norm of the MLP output, before the residual add.
    pub fn mlp_out_norm(&self) -> Option<&RmsNorm> {
        self.feedforward_norms.as_ref().map(|(_, post)| post)
    }

    /// `x + a`, `a` the attention output (normed first where the family does).
    fn attn_residual(&self, x: &Tensor, a: Tensor) -> Result<Tensor> {
        let a = match self.attn_out_norm() {
            Some(n) => n.forward(&a)?,
            None => a,
        };
        Ok(x.add(&a)?)
    }

    /// The attention half `h [b, s, h]` of the layer for its input `x [b, s, h]`.
    pub fn attn_half(&self, x: &Tensor, ropes: &RopeTables, attn: &Arc<dyn AttentionMode>) -> Result<Tensor> {
        let a = self.self_attn.forward(&self.input_layernorm.forward(x)?, ropes.get(self.rope_local), attn)?;
        self.attn_residual(x, a)
    }

    /// The MLP half `y` for the attention half's output `h` (token-wise: any chunk of tokens).
    pub fn mlp_half(&self, h: &Tensor) -> Result<Tensor> {
        let m = self.mlp.forward(&self.mlp_norm().forward(h)?)?;
        let m = match self.mlp_out_norm() {
            Some(n) => n.forward(&m)?,
            None => m,
        };
        Ok(h.add(&m)?)
    }

    /// `x [b, s, h]` -> `[b, s, h]`; `ropes` hold cos/sin for exactly these tokens.
    pub fn forward(&self, x: &Tensor, ropes: &RopeTables, attn: &Arc<dyn AttentionMode>) -> Result<Tensor> {
        self.mlp_half(&self.attn_half(x, ropes, attn)?)
    }

    /// [`Self::forward`] with the attention's keys and values cached (see
    /// [`Attention::forward_cached`]).
    pub fn forward_cached(&self, x: &Tensor, ropes: &RopeTables, cache: &mut Option<(Tensor, Tensor)>) -> Result<Tensor> {
        let a = self.self_attn.forward_cached(&self.input_layernorm.forward(x)?, ropes.get(self.rope_local), cache)?;
        self.mlp_half(&self.attn_residual(x, a)?)
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
        if let Some((pre, post)) = &self.feedforward_norms {
            out.push(("pre_feedforward_layernorm.weight".into(), pre.weight.clone()));
            out.push(("post_feedforward_layernorm.weight".into(), post.weight.clone()));
        }
        out
    }
}

/// The causal language model.
#[derive(Debug, Clone)]
pub struct Llama {
    pub cfg: LlamaConfig,
    /// The RoPE of every layer but Gemma 3's sliding ones (which take `local_rope`).
    pub rope: Rope,
    pub local_rope: Option<Rope>,
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
        let norm = RmsNorm::load(&m, cfg, "norm", h)?;
        let lm_head = if cfg.tie_word_embeddings {
            Linear::new(emb.clone(), None)
        } else {
            Linear::new(get(&vb.pp("lm_head"), cfg, "weight", &[v, h])?, None)
        };
        Ok(Llama {
            cfg: cfg.clone(),
            rope: Rope::new(cfg),
            local_rope: Rope::local(cfg),
            embed_tokens: Embedding::new(emb, h),
            layers,
            norm,
            lm_head,
        })
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

    /// [`Self::rope_table`] for every layer: the global table and Gemma 3's local one.
    pub fn rope_tables(&self, positions: &Tensor, seq_len: Option<usize>) -> Result<RopeTables> {
        let local = self.local_rope.as_ref().map(|r| r.table(positions, seq_len, self.dtype())).transpose()?;
        Ok(RopeTables { global: self.rope_table(positions, seq_len)?, local })
    }

    /// `ids [b, s]` u32 -> `[b, s, h]`.
    pub fn embed(&self, ids: &Tensor) -> Result<Tensor> {
        self.embed_with(self.embed_tokens.embeddings(), ids)
    }

    /// [`Self::embed`] with the embedding `weight [V, h]` given (ZeRO-3 brings it per
    /// step): the rows of `ids`, times Gemma 3's `sqrt(h)` rounded to the weight's dtype.
    pub fn embed_with(&self, weight: &Tensor, ids: &Tensor) -> Result<Tensor> {
        let x = Embedding::new(weight.clone(), self.cfg.hidden_size).forward(ids)?;
        match self.embed_factor(weight.dtype())? {
            Some(f) => Ok(x.broadcast_mul(&Tensor::new(f as f32, x.device())?.to_dtype(x.dtype())?)?),
            None => Ok(x),
        }
    }

    /// Gemma 3's embedding factor as the model applies it: `sqrt(h)` as f32, rounded to
    /// `dtype` (transformers: `embed_scale.to(weight.dtype)`); `None` for the others.
    pub fn embed_factor(&self, dtype: DType) -> Result<Option<f64>> {
        let Some(s) = self.cfg.embed_scale() else { return Ok(None) };
        let t = Tensor::new(s as f32, &candle_core::Device::Cpu)?.to_dtype(dtype)?;
        Ok(Some(t.to_dtype(DType::F64)?.to_scalar::<f64>()?))
    }

    /// Final hidden states `[b, s, h]`, after the last norm (input of `lm_head`).
    pub fn forward_hidden(&self, ids: &Tensor, positions: &Tensor, attn: &Arc<dyn AttentionMode>) -> Result<Tensor> {
        let rope = self.rope_tables(positions, None)?;
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
        let rope = self.rope_tables(&positions, None)?;
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
