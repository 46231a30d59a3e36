//! The layer-wise training engine: exact gradients without a graph over the whole model.
//!
//! Candle keeps every intermediate of a graph alive until `backward()` returns, so a long
//! sequence cannot be trained through one graph. Instead:
//! 1. forward: embed, then each decoder layer on *untracked* weights (detached views of the
//!    same storage), keeping only each layer's input `x_l [b, s, h]` in an
//!    [`ActivationStore`] (on the device, or in pinned host memory with copies that overlap
//!    compute when offloading);
//! 2. head: the final norm, `lm_head` and the cross-entropy run chunk by chunk over tokens
//!    (`token_chunk` tokens at a time), so the `[tokens, vocab]` logits never exist whole;
//!    each chunk's backward gives the grads of norm/head and a slice of `dL/dx_L`;
//! 3. backward, top layer first: recompute the attention half `h = x + attn(norm1(x))`
//!    with tracked weights (one graph for one layer's attention), run the MLP half
//!    `y = h + mlp(norm2(h))` chunk by chunk seeded with `(y_c · g_c).sum()`, then seed the
//!    attention graph with `(h · dL/dh).sum()` to get its param grads and `dL/dx_l`;
//! 4. embedding grads from `dL/dx_0`, chunk by chunk.
//!
//! Gradients are of `scale · Σ token losses` (the trainer passes `1 / global token count`),
//! accumulated in f32, detached.
//!
//! Shapes: `b` batch, `s` local tokens, `h` hidden, `V` vocabulary, `c` tokens per chunk.

use crate::model::{DecoderLayer, Llama, RmsNorm, RopeTables};
use crate::train::layer_grad::{
    accumulate, chunk_rows, put_rows, rms_backward, rms_forward, row_buffer, LayerPass, LayerShape, LayerSlots, SavedLayer,
};
use crate::train::offload::ActivationStore;
pub use crate::train::offload::Offload;
use crate::train::profile::{Phase, PhaseTimes, Profiler};
use crate::train::zero::{layer_unit, GradBuffer, ParamHooks};
use crate::Result;
use candle_core::{DType, Shape, Tensor, Var};
use candle_nn::VarBuilder;
use longctx_attention::AttentionMode;
use std::collections::HashMap;
use std::sync::{Arc, Mutex};

/// Knobs of the engine.
#[derive(Clone, Debug)]
pub struct EngineOptions {
    /// Tokens per chunk for the token-wise parts (MLP, norms, head, loss, embedding).
    pub token_chunk: usize,
    /// What of each layer's saved tensors is kept in host memory between forward and
    /// backward: nothing, the layer inputs, or everything.
    pub offload: Offload,
    /// How a decoder layer's backward is computed.
    pub layer_backward: LayerBackward,
    /// Time each phase of the step ([`Engine::take_profile`]).
    pub profile: bool,
    /// Keep each layer's attention q, k, v, o and LSE from the forward on the device, so
    /// the backward does not rerun the attention (explicit backward only; memory
    /// `layers × tokens × (2·hq + 2·hkv)·d` elements plus the LSE).
    pub save_attention: bool,
    /// Keep each layer's MLP input `h` and its gate and up projections from the forward on
    /// the device, per token chunk, so the backward does not rerun `o_proj`, the gate and
    /// the up projection (explicit backward only; memory `layers × tokens × (h + 2·i)`
    /// elements).
    pub save_mlp: bool,
    /// With `save_mlp`, or alone: keep the MLP tensors of the top `n` layers only (the
    /// others recompute them); `None` with `save_mlp` keeps every layer's.
    pub save_mlp_layers: Option<usize>,
    /// Print a line per layer and phase of every step, after waiting for the device
    /// (`train.trace`).
    pub trace: bool,
}

impl Default for EngineOptions {
    fn default() -> Self {
        Self {
            token_chunk: 4096,
            offload: Offload::Off,
            layer_backward: LayerBackward::Explicit,
            profile: false,
            save_attention: false,
            save_mlp: false,
            save_mlp_layers: None,
            trace: false,
        }
    }
}

/// How the engine differentiates one decoder layer.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Default, serde::Serialize, serde::Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum LayerBackward {
    /// Every gradient written out ([`super::layer_grad`]): the hot path.
    #[default]
    Explicit,
    /// Candle autograd over the recomputed layer: the reference the tests compare with.
    Autograd,
}

/// Memory the engine held, measured from the tensors it kept (bytes).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct MemoryReport {
    /// Saved layer inputs (∝ layers × tokens × hidden).
    pub saved_bytes: usize,
    /// Of which in host memory.
    pub saved_host_bytes: usize,
    /// Largest token-wise chunk intermediate set (logits chunk or MLP chunk; ∝ chunk).
    pub transient_bytes: usize,
}

/// Result of one forward+backward over a micro-batch.
pub struct StepResult {
    /// Σ token losses (unscaled) of this rank's tokens.
    pub loss_sum: f64,
    /// Counted (non-ignored) tokens of this rank.
    pub n_tokens: usize,
    /// f32 gradients of `scale · Σ losses`, aligned with [`Engine::params`].
    pub grads: Vec<Tensor>,
    pub memory: MemoryReport,
}

/// What [`Engine::step_into`] measured (its gradients went into the buffer).
#[derive(Clone, Copy, Debug)]
pub struct StepOutcome {
    /// Σ token losses (unscaled) of this rank's tokens.
    pub loss_sum: f64,
    /// Counted (non-ignored) tokens of this rank.
    pub n_tokens: usize,
    pub memory: MemoryReport,
}

/// A model pair over the same storage: `tracked` (Vars, for recomputation with autograd)
/// and `plain` (detached views, for the graph-free forward).
pub struct Engine {
    pub tracked: Llama,
    pub plain: Llama,
    /// `(name, var)` for every parameter, in the model's order; empty when the weights
    /// are not resident ([`Engine::for_shapes`], ZeRO-3: they come through the hooks).
    pub params: Vec<(String, Var)>,
    /// `(name, shape)` of every parameter, in the model's order (always).
    pub meta: Vec<(String, Shape)>,
    pub opts: EngineOptions,
    /// Saved layer inputs; kept across steps so pinned host buffers are reused.
    store: Mutex<ActivationStore>,
    /// Gradient slots of each layer's parameters (explicit backward).
    slots: Vec<LayerSlots>,
    /// Phase timings of the steps since the last [`Engine::take_profile`].
    prof: Profiler,
    /// Gradient slots of `model.embed_tokens.weight`, `lm_head.weight` (the embedding's
    /// when tied) and `model.norm.weight`.
    embed_slot: usize,
    head_slot: usize,
    norm_slot: usize,
    /// The parameter index range of each unit (`train::zero::units`: embedding, layers, head).
    units: Vec<std::ops::Range<usize>>,
}

/// Bytes of a tensor's elements.
pub(crate) fn bytes(t: &Tensor) -> usize {
    t.elem_count() * t.dtype().size_in_bytes()
}

impl Engine {
    /// Wrap a model loaded from Vars (e.g. `VarBuilder::from_varmap`). `vars` maps each
    /// parameter name to its Var (the tensors in `tracked` must be those Vars).
    pub fn new(tracked: Llama, vars: &HashMap<String, Var>, opts: EngineOptions) -> Result<Self> {
        let mut params = Vec::new();
        let mut plain_map = HashMap::new();
        for (name, t) in tracked.named_parameters() {
            let var = vars.get(&name).ok_or_else(|| crate::Error::Setting(format!("parameter `{name}` has no Var")))?;
            params.push((name.clone(), var.clone()));
            plain_map.insert(name, t.detach());
        }
        let dev = tracked.embed_tokens.embeddings().device().clone();
        let vb = VarBuilder::from_tensors(plain_map, tracked.dtype(), &dev);
        let mut plain = Llama::load(vb, &tracked.cfg)?;
        plain.rope = tracked.rope.clone();
        plain.local_rope = tracked.local_rope.clone();
        let meta = params.iter().map(|(n, v)| (n.clone(), v.as_tensor().shape().clone())).collect();
        Self::assemble(tracked, plain, params, meta, opts)
    }

    /// The engine over its two models: the gradient slots of every layer, the embedding,
    /// head and norm, and the units, found once from the parameter names.
    fn assemble(tracked: Llama, plain: Llama, params: Vec<(String, Var)>, meta: Vec<(String, Shape)>, opts: EngineOptions) -> Result<Self> {
        let names: Vec<&str> = meta.iter().map(|(n, _)| n.as_str()).collect();
        let slots = (0..plain.layers.len()).map(|l| LayerSlots::find(&names, l)).collect::<Result<Vec<_>>>()?;
        let slot = |name: &str| {
            names.iter().position(|n| *n == name).ok_or_else(|| crate::Error::Setting(format!("engine: parameter `{name}` not found")))
        };
        let embed_slot = slot("model.embed_tokens.weight")?;
        let head_slot = if plain.cfg.tie_word_embeddings { embed_slot } else { slot("lm_head.weight")? };
        let norm_slot = slot("model.norm.weight")?;
        let units = crate::train::zero::layer_groups(&names)?;
        let store = Mutex::new(ActivationStore::new(opts.offload));
        let prof = Profiler::new(opts.profile).with_trace(opts.trace);
        Ok(Self { tracked, plain, params, meta, opts, store, slots, prof, embed_slot, head_slot, norm_slot, units })
    }

    /// An engine without resident weights (ZeRO-3, parameter offload): every unit's
    /// weights come through the [`ParamHooks`] of each step. The model is built over
    /// placeholders of the right shapes that hold one element each; only the explicit
    /// backward runs this way.
    pub fn for_shapes(
        cfg: &crate::model::LlamaConfig,
        shapes: &HashMap<String, Shape>,
        dtype: DType,
        dev: &candle_core::Device,
        opts: EngineOptions,
    ) -> Result<Self> {
        if opts.layer_backward != LayerBackward::Explicit {
            return Err(crate::Error::Setting(
                "ZeRO-3 and parameter offload need `train.layer_backward = \"explicit\"` (the autograd reference keeps every weight)"
                    .into(),
            ));
        }
        let one = Tensor::zeros((), dtype, dev)?;
        let map = shapes.iter().map(|(n, s)| Ok((n.clone(), one.broadcast_as(s.clone())?))).collect::<Result<HashMap<_, _>>>()?;
        let plain = Llama::load(VarBuilder::from_tensors(map, dtype, dev), cfg)?;
        let meta: Vec<(String, Shape)> = plain.named_parameters().into_iter().map(|(n, t)| (n, t.shape().clone())).collect();
        Self::assemble(plain.clone(), plain, Vec::new(), meta, opts)
    }

    /// Unit `u`'s weights from the hooks as `name → tensor` (`None`: the model's own).
    fn unit_weights(&self, hooks: &dyn ParamHooks, u: usize) -> Result<Option<HashMap<String, Tensor>>> {
        let Some(ws) = hooks.weights(u)? else { return Ok(None) };
        let range = self.units.get(u).ok_or_else(|| crate::Error::Setting(format!("engine: no parameter unit {u}")))?;
        if ws.len() != range.len() {
            return Err(crate::Error::Setting(format!("engine: unit {u} came with {} tensors for {} parameters", ws.len(), range.len())));
        }
        Ok(Some(range.clone().map(|p| self.meta[p].0.clone()).zip(ws).collect()))
    }

    /// Decoder layer `l` over the hooks' weights (`None`: the model's own).
    fn layer_from(&self, hooks: &dyn ParamHooks, l: usize) -> Result<Option<DecoderLayer>> {
        let Some(map) = self.unit_weights(hooks, layer_unit(l))? else { return Ok(None) };
        let prefix = format!("model.layers.{l}.");
        let local: HashMap<String, Tensor> =
            map.into_iter().map(|(n, t)| (n.strip_prefix(&prefix).map(str::to_string).unwrap_or(n), t)).collect();
        let dev = self.plain.embed_tokens.embeddings().device().clone();
        Ok(Some(DecoderLayer::load(VarBuilder::from_tensors(local, self.plain.dtype(), &dev), &self.plain.cfg, l)?))
    }

    /// The final norm's and `lm_head`'s weights (from the hooks, or the model's own).
    fn head_weights(&self, hooks: &dyn ParamHooks) -> Result<(Tensor, Tensor)> {
        let tail = self.plain.layers.len() + 1;
        let Some(mut map) = self.unit_weights(hooks, tail)? else {
            return Ok((self.plain.norm.weight.clone(), self.plain.lm_head.weight().clone()));
        };
        let norm = map.remove("model.norm.weight").ok_or_else(|| crate::Error::Setting("engine: no `model.norm.weight`".into()))?;
        let head = match map.remove("lm_head.weight") {
            Some(w) => w,
            None => {
                let mut e = self.unit_weights(hooks, 0)?.ok_or_else(|| crate::Error::Setting("engine: no embedding weights".into()))?;
                e.remove("model.embed_tokens.weight")
                    .ok_or_else(|| crate::Error::Setting("engine: no `model.embed_tokens.weight`".into()))?
            }
        };
        Ok((norm, head))
    }

    /// Build both views from Vars (one per parameter name, dtype and device of the run).
    pub fn from_vars(cfg: &crate::model::LlamaConfig, vars: &HashMap<String, Var>, opts: EngineOptions) -> Result<Self> {
        let first = vars.values().next().ok_or_else(|| crate::Error::Setting("no parameters".into()))?;
        let (dtype, dev) = (first.dtype(), first.device().clone());
        let map: HashMap<String, Tensor> = vars.iter().map(|(n, v)| (n.clone(), v.as_tensor().clone())).collect();
        let tracked = Llama::load(VarBuilder::from_tensors(map, dtype, &dev), cfg)?;
        Self::new(tracked, vars, opts)
    }

    /// Pinned host memory held for offloaded layer inputs (bytes; CUDA only).
    pub fn pinned_bytes(&self) -> usize {
        self.store.lock().map(|s| s.pinned_bytes()).unwrap_or(0)
    }

    /// Seconds per phase of the steps since the last call (all zero unless
    /// `EngineOptions::profile`); waits for the GPU.
    pub fn take_profile(&self) -> Result<PhaseTimes> {
        self.prof.take()
    }

    /// The engine's profiler, for the trainer's own phases (optimizer, communication).
    pub fn profiler(&self) -> &Profiler {
        &self.prof
    }

    /// Use `rope_theta` from now on (a new stage); both views. (Gemma 3's sliding layers
    /// keep their own RoPE: a stage extends the full-attention layers'.)
    pub fn set_rope(&mut self, rope: crate::model::Rope) {
        self.tracked.rope = rope.clone();
        self.plain.rope = rope;
    }

    /// What the forward keeps of layer `l` besides its input: `(attention, mlp)` (the
    /// explicit backward only; the autograd reference recomputes everything). The MLP's
    /// tensors are kept for the top layers ([`crate::train::config::mlp_saved_layers`]).
    fn keeps(&self, l: usize) -> (bool, bool) {
        let explicit = self.opts.layer_backward == LayerBackward::Explicit;
        let n = self.plain.layers.len();
        let mlp_from = n - crate::train::config::mlp_saved_layers(self.opts.save_mlp, self.opts.save_mlp_layers, n);
        (self.opts.save_attention && explicit, l >= mlp_from && explicit)
    }

    fn chunks(&self, s: usize) -> Vec<(usize, usize)> {
        let c = self.opts.token_chunk.max(1);
        (0..s).step_by(c).map(|st| (st, c.min(s - st))).collect()
    }

    /// Add the gradients present in `grads` into the slots `acc` (f32, in place).
    fn collect(&self, grads: &candle_core::backprop::GradStore, acc: &[Tensor]) -> Result<()> {
        for (i, (_, var)) in self.params.iter().enumerate() {
            if let Some(g) = grads.get(var.as_tensor()) {
                accumulate(acc, i, &g.detach())?;
            }
        }
        Ok(())
    }

    /// Forward and backward of this rank's tokens, with fresh gradients (a buffer of
    /// their own): [`Self::step_into`] for tests and benchmarks.
    pub fn step(
        &self,
        ids: &Tensor,
        targets: &Tensor,
        positions: &Tensor,
        global_len: usize,
        attn: &Arc<dyn AttentionMode>,
        scale: f64,
    ) -> Result<StepResult> {
        let buf = GradBuffer::new(&self.params, 0, ids.device())?;
        let o = self.step_into(ids, targets, positions, global_len, attn, scale, &buf as &dyn ParamHooks)?;
        Ok(StepResult { loss_sum: o.loss_sum, n_tokens: o.n_tokens, grads: buf.views().to_vec(), memory: o.memory })
    }

    /// Forward and backward of this rank's tokens; the gradients are added into the hooks'
    /// slots (a [`GradBuffer`], or ZeRO-2/3's per-unit buffers), each unit reported done as
    /// soon as its gradients are, and each unit's weights taken from the hooks just before
    /// it runs (see [`ParamHooks`]).
    /// `ids [b, s]` u32, `targets [b, s]` i64 (negative = ignore), `positions [b, s]` u32
    /// global ids, `global_len` the global sequence length (for length-dependent RoPE),
    /// `scale` multiplies the loss before differentiation.
    #[allow(clippy::too_many_arguments)]
    pub fn step_into(
        &self,
        ids: &Tensor,
        targets: &Tensor,
        positions: &Tensor,
        global_len: usize,
        attn: &Arc<dyn AttentionMode>,
        scale: f64,
        hooks: &dyn ParamHooks,
    ) -> Result<StepOutcome> {
        let (_b, s) = ids.dims2()?;
        let dev = ids.device().clone();
        // Checked and counted once here (a read-back), not per loss chunk.
        let n_tokens = crate::model::count_targets(targets, self.tracked.cfg.vocab_size)?;
        let rope: RopeTables = self.plain.rope_tables(positions, Some(global_len))?;
        let mut mem = MemoryReport::default();
        let acc = hooks.grad_slots();
        let chunks = self.chunks(s);
        let n_layers = self.plain.layers.len();
        let tail = n_layers + 1;

        let mut store = self.store.lock().map_err(|_| crate::Error::Setting("activation store poisoned by a failed step".into()))?;
        store.begin()?;

        // 1. forward, graph-free; keep layer inputs.
        let pass = LayerPass { rope: &rope, attn, chunks: &chunks, prof: &self.prof, dev: &dev };
        let x = self.forward_layers(ids, hooks, &pass, &mut store)?; // [b, s, h]
        let shape = self.layer_shape(&x, chunks.first().map_or(0, |c| c.1))?;
        mem.transient_bytes = usize::try_from(shape.backward_bytes().max(shape.head_bytes())).unwrap_or(usize::MAX);
        store.end_forward()?;
        let (inputs, host) = store.bytes();
        (mem.saved_bytes, mem.saved_host_bytes) = (inputs, host);
        if let Some(top) = store.len().checked_sub(1) {
            store.prefetch(top, &dev)?; // the top layer's input comes back while the head runs
        }

        self.prof.trace(&dev, || "head and loss".into())?;
        self.prof.time(Phase::UpdateWait, &dev, || hooks.prepare(tail))?;
        // 2. head + loss, chunked; dL/dx_L.
        let (gx, loss_sum) = self.prof.time(Phase::Loss, &dev, || match self.opts.layer_backward {
            LayerBackward::Explicit => {
                let (norm_w, head_w) = self.head_weights(hooks)?;
                self.head_backward_fused(&x, targets, &chunks, scale, acc, (&norm_w, &head_w))
            }
            LayerBackward::Autograd => self.head_backward(&x, targets, &chunks, scale, acc, &mut mem),
        })?;
        drop(x);
        self.prof.time(Phase::GradAccum, &dev, || hooks.grads_done(tail))?;

        // 3. layers, top first, each recomputed from its saved input.
        let gx = self.backward_layers(hooks, &pass, &mut store, gx, acc)?;

        self.prof.trace(&dev, || "embedding backward".into())?;
        // 4. embedding: rows of dL/dx_0 added into the rows of their token ids.
        self.prof.time(Phase::GradAccum, &dev, || {
            self.embed_backward(ids, &gx, acc)?;
            hooks.grads_done(0)
        })?;

        Ok(StepOutcome { loss_sum, n_tokens, memory: mem })
    }

    /// Step 1 of [`Self::step_into`]: the forward, graph-free, unit by unit, each layer's
    /// input kept in `store` (with its attention's tensors when they are saved). Returns
    /// the last layer's output `[b, s, h]`.
    fn forward_layers(&self, ids: &Tensor, hooks: &dyn ParamHooks, pass: &LayerPass<'_>, store: &mut ActivationStore) -> Result<Tensor> {
        let dev = pass.dev;
        self.prof.time(Phase::UpdateFirst, dev, || hooks.prepare(0))?;
        let embed_w = self.prof.time(Phase::Transfers, dev, || self.unit_weights(hooks, 0))?;
        let mut x = self.prof.time(Phase::Copies, dev, || match embed_w {
            None => self.plain.embed(ids),
            Some(mut w) => {
                let e = w.remove("model.embed_tokens.weight").ok_or_else(|| crate::Error::Setting("engine: no embedding".into()))?;
                self.plain.embed_with(&e, ids)
            }
        })?; // [b, s, h]
        for l in 0..self.plain.layers.len() {
            self.prof.trace(dev, || format!("forward layer {l}"))?;
            let (keep_attention, keep_mlp) = self.keeps(l);
            // The layer's weights (ZeRO-3: gathered, or brought from the host).
            self.prof.time(Phase::UpdateWait, dev, || hooks.prepare(layer_unit(l)))?;
            let fetched = self.prof.time(Phase::Transfers, dev, || self.layer_from(hooks, l))?;
            let layer = fetched.as_ref().unwrap_or(&self.plain.layers[l]);
            let (y, sa, mlp) = pass.forward(layer, &x, keep_mlp)?;
            // The layer's input, and its attention's and MLP's tensors when they are kept
            // (all parked in host memory when offloading).
            let saved = SavedLayer { x, attention: keep_attention.then_some(sa), mlp };
            self.prof.time(Phase::Transfers, dev, || store.push(&saved.tensors()))?;
            x = y;
        }
        Ok(x)
    }

    /// Step 3 of [`Self::step_into`]: the layers' backward, top first, each recomputed
    /// from its saved input, from `gx = dL/dx_L`; each unit's gradients reported done (ZeRO-2/3:
    /// reduce-scattered then). Returns `dL/dx_0`.
    fn backward_layers(
        &self,
        hooks: &dyn ParamHooks,
        pass: &LayerPass<'_>,
        store: &mut ActivationStore,
        mut gx: Tensor,
        acc: &[Tensor],
    ) -> Result<Tensor> {
        let dev = pass.dev;
        for l in (0..self.plain.layers.len()).rev() {
            self.prof.trace(dev, || format!("backward layer {l}"))?;
            let group = self.prof.time(Phase::Transfers, dev, || {
                let group = store.take(l, dev)?;
                if l > 0 {
                    store.prefetch(l - 1, dev)?; // its copy overlaps this layer's backward
                }
                Ok(group)
            })?;
            let (keep_attention, keep_mlp) = self.keeps(l);
            let saved = SavedLayer::split(group, keep_attention, keep_mlp, pass.chunks.len())?;
            gx = match self.opts.layer_backward {
                LayerBackward::Explicit => {
                    let fetched = self.prof.time(Phase::Transfers, dev, || self.layer_from(hooks, l))?;
                    let layer = fetched.as_ref().unwrap_or(&self.plain.layers[l]);
                    pass.backward(layer, &self.slots[l], saved, gx, acc)?
                }
                LayerBackward::Autograd => self.autograd_layer_backward(l, &saved.x, &gx, pass.rope, pass.attn, pass.chunks, acc)?,
            };
            self.prof.time(Phase::GradAccum, dev, || hooks.grads_done(layer_unit(l)))?;
        }
        Ok(gx)
    }

    /// Layer `l`'s backward by Candle autograd over the recomputed layer (tracked
    /// weights): the attention half as one graph, the MLP half chunk by chunk.
    #[allow(clippy::too_many_arguments)]
    fn autograd_layer_backward(
        &self,
        l: usize,
        x_in: &Tensor,
        gx: &Tensor,
        rope: &RopeTables,
        attn: &Arc<dyn AttentionMode>,
        chunks: &[(usize, usize)],
        acc: &[Tensor],
    ) -> Result<Tensor> {
        let layer = &self.tracked.layers[l];
        let x_in = Var::from_tensor(x_in)?;
        let hmid = layer.attn_half(x_in.as_tensor(), rope, attn)?; // tracked graph of the attention half
        let hplain = hmid.detach();
        let mut gh_chunks = Vec::with_capacity(chunks.len());
        for &(st, len) in chunks {
            let hc = Var::from_tensor(&hplain.narrow(1, st, len)?.contiguous()?)?;
            let y = layer.mlp_half(hc.as_tensor())?;
            let seed = y.mul(&gx.narrow(1, st, len)?)?.sum_all()?;
            let grads = seed.backward()?;
            self.collect(&grads, acc)?;
            gh_chunks.push(match grads.get(hc.as_tensor()) {
                Some(g) => g.detach(),
                None => hc.as_tensor().zeros_like()?,
            });
        }
        let gh = Tensor::cat(&gh_chunks, 1)?;
        let grads = hmid.mul(&gh)?.sum_all()?.backward()?;
        self.collect(&grads, acc)?;
        Ok(match grads.get(x_in.as_tensor()) {
            Some(g) => g.detach(),
            None => x_in.as_tensor().zeros_like()?,
        })
    }

    /// The head with the fused kernels, chunk by chunk over tokens: final RMSNorm, then
    /// `lm_head` + cross-entropy with the chunk's logits `[c, V]` turned into their
    /// gradient in place (`longctx_kernels::linear_cross_entropy`), the `lm_head` gradient
    /// accumulated straight into its f32 slot, then the norm's backward, written into the
    /// rows of `dL/dx`. Returns `dL/dx [b, s, h]` (times `scale`) and the loss sum.
    fn head_backward_fused(
        &self,
        x: &Tensor,
        targets: &Tensor,
        chunks: &[(usize, usize)],
        scale: f64,
        acc: &[Tensor],
        (norm_w, w): (&Tensor, &Tensor),
    ) -> Result<(Tensor, f64)> {
        let norm = RmsNorm { weight: norm_w.clone(), ..self.plain.norm.clone() };
        // SAFETY: the loop below writes every chunk's rows of gx.
        let gx = unsafe { row_buffer(x.shape(), x.dtype(), x.device()) }?;
        let mut losses = Vec::with_capacity(chunks.len()); // f32 scalars, read once below
        for &ch in chunks {
            let xc = chunk_rows(x, ch)?; // [n, h]
            let tc = targets.narrow(1, ch.0, ch.1)?.contiguous()?.flatten_all()?; // [n]
            let (y, rstd) = rms_forward(&norm, &xc)?;
            let ce = longctx_kernels::linear_cross_entropy(&y, w, &tc, scale, ch.1.max(1), Some(&acc[self.head_slot]))?;
            let (dx, dw) = rms_backward(&norm, &xc, &rstd, &ce.dhidden, None)?;
            accumulate(acc, self.norm_slot, &dw)?;
            put_rows(&gx, &dx, ch)?;
            losses.push(ce.loss_sum);
        }
        let loss_sum =
            if losses.is_empty() { 0.0 } else { Tensor::stack(&losses, 0)?.to_dtype(DType::F64)?.to_vec1::<f64>()?.iter().sum() };
        Ok((gx, loss_sum))
    }

    /// Final norm, head and loss over token chunks of the top hidden `x [b, s, h]`,
    /// differentiated at once (weight gradients into `acc`). Returns `dL/dx [b, s, h]`
    /// (times `scale`) and the loss sum.
    fn head_backward(
        &self,
        x: &Tensor,
        targets: &Tensor,
        chunks: &[(usize, usize)],
        scale: f64,
        acc: &[Tensor],
        mem: &mut MemoryReport,
    ) -> Result<(Tensor, f64)> {
        let mut chunk_losses = Vec::with_capacity(chunks.len()); // f32 scalars, read once below
        let mut gx_chunks = Vec::with_capacity(chunks.len());
        for &(st, len) in chunks {
            let hc = Var::from_tensor(&x.narrow(1, st, len)?.contiguous()?)?;
            let logits = self.tracked.logits(&self.tracked.norm.forward(hc.as_tensor())?)?; // [b, c, V]
            mem.transient_bytes = mem.transient_bytes.max(bytes(&logits) + logits.elem_count() * 4);
            let l = crate::model::cross_entropy_sum_checked(&logits, &targets.narrow(1, st, len)?)?;
            chunk_losses.push(l.detach());
            let grads = (l * scale)?.backward()?;
            self.collect(&grads, acc)?;
            gx_chunks.push(match grads.get(hc.as_tensor()) {
                Some(g) => g.detach(),
                None => hc.as_tensor().zeros_like()?,
            });
        }
        let loss_sum: f64 = Tensor::stack(&chunk_losses, 0)?.to_dtype(DType::F64)?.to_vec1::<f64>()?.iter().sum();
        Ok((Tensor::cat(&gx_chunks, 1)?, loss_sum))
    }

    /// `dE [V, h]` f32 for `dL/dx_0 = gx [b, s, h]`: every row of `gx` added into its
    /// token's row of the embedding's slot, in place, in one pass.
    fn embed_backward(&self, ids: &Tensor, gx: &Tensor, acc: &[Tensor]) -> Result<()> {
        let h = self.tracked.cfg.hidden_size;
        // Gemma 3 scales the embedding output: its gradient flows back times the same factor.
        let factor = self.plain.embed_factor(gx.dtype())?.unwrap_or(1.0);
        let rows = gx.contiguous()?.reshape(((), h))?;
        let ids = ids.contiguous()?.flatten_all()?;
        Ok(longctx_kernels::embedding_grad_add(&acc[self.embed_slot], &ids, &rows, factor)?)
    }

    /// The sizes of one layer's pass over `x [b, s, h]` in chunks of `chunk` tokens.
    fn layer_shape(&self, x: &Tensor, chunk: usize) -> Result<LayerShape> {
        let c = &self.tracked.cfg;
        let (b, s, _) = x.dims3()?;
        Ok(LayerShape {
            batch: b,
            tokens: s,
            chunk,
            hidden: c.hidden_size,
            intermediate: c.intermediate_size,
            heads: c.num_attention_heads,
            kv_heads: c.num_key_value_heads,
            head_dim: c.head_dim,
            vocab: c.vocab_size,
            elem: x.dtype().size_in_bytes(),
        })
    }

    /// Reference: the same gradients through one full graph of the model's layers (small
    /// inputs only). Same arguments as [`Engine::step`]: `global_len` matters on a shard
    /// (dynamic NTK RoPE needs the global length, not this rank's largest position + 1).
    pub fn full_graph_step(
        &self,
        ids: &Tensor,
        targets: &Tensor,
        positions: &Tensor,
        global_len: usize,
        attn: &Arc<dyn AttentionMode>,
        scale: f64,
    ) -> Result<StepResult> {
        let m = &self.tracked;
        let rope = m.rope_tables(positions, Some(global_len))?;
        let mut x = m.embed(ids)?; // [b, s, h]
        for layer in &m.layers {
            x = layer.forward(&x, &rope, attn)?;
        }
        let logits = m.logits(&m.norm.forward(&x)?)?; // [b, s, V]
        let (l, n) = crate::model::cross_entropy_sum(&logits, targets)?;
        let loss_sum = l.to_dtype(DType::F64)?.to_scalar::<f64>()?;
        let grads = (l * scale)?.backward()?;
        let buf = GradBuffer::new(&self.params, 0, ids.device())?;
        self.collect(&grads, buf.views())?;
        Ok(StepResult { loss_sum, n_tokens: n, grads: buf.views().to_vec(), memory: MemoryReport::default() })
    }
}
