//! Generation: greedy or sampled (temperature, top-p, seed), with a KV cache (each new
//! token runs the model on that token only) or without (the whole sequence again, the
//! reference the cache is tested against). Stops at EOS or after `max_new` tokens.

use candle_core::{DType, Device, Tensor};
use rand::{Rng, SeedableRng};

use crate::model::{KvCache, Llama};
use crate::{Error, Result};

/// How the next token is picked.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Sampling {
    /// 0 = greedy (argmax, first of equal maxima).
    pub temperature: f64,
    /// Nucleus: sample among the most likely tokens whose probabilities sum to `top_p`.
    pub top_p: f64,
    pub seed: u64,
}

impl Sampling {
    pub const GREEDY: Sampling = Sampling { temperature: 0.0, top_p: 1.0, seed: 0 };

    pub fn check(&self) -> Result<()> {
        if !(self.temperature >= 0.0 && self.temperature.is_finite()) {
            return Err(Error::config(
                "--temperature",
                "temperature",
                format!("got {}, expected a number ≥ 0 (0 = greedy)", self.temperature),
            ));
        }
        if !(self.top_p > 0.0 && self.top_p <= 1.0) {
            return Err(Error::config("--top-p", "top-p", format!("got {}, expected a number in (0, 1]", self.top_p)));
        }
        Ok(())
    }
}

/// Index of the largest value (the first one of equal maxima).
pub fn argmax(logits: &[f32]) -> u32 {
    let mut best = 0;
    for (i, &x) in logits.iter().enumerate() {
        if x > logits[best] {
            best = i;
        }
    }
    best as u32
}

/// A token drawn from `softmax(logits / temperature)` restricted to the top-p nucleus.
pub fn sample(logits: &[f32], s: &Sampling, rng: &mut impl Rng) -> u32 {
    if s.temperature == 0.0 {
        return argmax(logits);
    }
    let max = logits.iter().copied().fold(f32::NEG_INFINITY, f32::max) as f64;
    let mut p: Vec<(usize, f64)> = logits.iter().enumerate().map(|(i, &x)| (i, ((x as f64 - max) / s.temperature).exp())).collect();
    let z: f64 = p.iter().map(|x| x.1).sum();
    p.sort_by(|a, b| b.1.total_cmp(&a.1).then(a.0.cmp(&b.0)));
    let mut keep = 0;
    let mut cum = 0.0;
    for (_, w) in &p {
        keep += 1;
        cum += w / z;
        if cum >= s.top_p {
            break;
        }
    }
    let kept = &p[..keep.max(1)];
    let total: f64 = kept.iter().map(|x| x.1).sum();
    let mut u = rng.random::<f64>() * total;
    for (i, w) in kept {
        if u < *w {
            return *i as u32;
        }
        u -= w;
    }
    kept[kept.len() - 1].0 as u32
}

fn last_logits(model: &Llama, hidden: &Tensor) -> Result<Vec<f32>> {
    let s = hidden.dim(1)?;
    let l = model.logits(&hidden.narrow(1, s - 1, 1)?)?;
    Ok(l.to_dtype(DType::F32)?.flatten_all()?.to_vec1()?)
}

/// Generates up to `max_new` tokens after `prompt` (not returned), stopping after `eos`
/// (included). `on_token` sees each token as it comes (to stream it).
pub fn generate(
    model: &Llama,
    prompt: &[u32],
    max_new: usize,
    eos: Option<u32>,
    sampling: &Sampling,
    use_cache: bool,
    mut on_token: impl FnMut(u32) -> Result<()>,
) -> Result<Vec<u32>> {
    sampling.check()?;
    if prompt.is_empty() {
        return Err(Error::config("--prompt", "prompt", "the prompt is empty: generation needs at least one token"));
    }
    if let Some(&bad) = prompt.iter().find(|&&t| t as usize >= model.cfg.vocab_size) {
        return Err(Error::config(
            "--prompt",
            "prompt",
            format!("token id {bad} is not below the vocabulary size {}", model.cfg.vocab_size),
        ));
    }
    let dev: Device = model.embed_tokens.embeddings().device().clone();
    let mut rng = rand::rngs::StdRng::seed_from_u64(sampling.seed);
    // Grown as tokens come: generation may stop at EOS long before `max_new`.
    let mut out = Vec::with_capacity(max_new.min(4096));
    let mut cache = KvCache::new(model);
    let mut all = prompt.to_vec();
    let attn: std::sync::Arc<dyn longctx_attention::AttentionMode> = std::sync::Arc::new(longctx_attention::local::LocalAttention);
    for step in 0..max_new {
        let logits = if use_cache {
            let new: &[u32] = if step == 0 { prompt } else { &all[all.len() - 1..] };
            let ids = Tensor::from_slice(new, (1, new.len()), &dev)?;
            last_logits(model, &model.forward_hidden_cached(&ids, &mut cache)?)?
        } else {
            let ids = Tensor::from_slice(&all, (1, all.len()), &dev)?;
            let pos = Tensor::arange(0u32, all.len() as u32, &dev)?.unsqueeze(0)?;
            last_logits(model, &model.forward_hidden(&ids, &pos, &attn)?)?
        };
        let t = sample(&logits, sampling, &mut rng);
        out.push(t);
        all.push(t);
        on_token(t)?;
        if Some(t) == eos {
            break;
        }
    }
    Ok(out)
}
