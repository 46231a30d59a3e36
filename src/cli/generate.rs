//! `longctx generate`: greedy or sampled generation with a KV cache from a prompt (or a
//! prompt file), on the CPU or one GPU, streaming tokens to the terminal.

use std::io::Write;
use std::path::PathBuf;

use super::eval::DEMO_EXPORT;
use super::parse_dtype;
use anyhow::{bail, Context, Result};
use clap::Args;
use longctx::data::synthetic;
use longctx::eval::generate::{generate, Sampling};
use longctx::eval::model::{self as memory, device_and_dtype};
use longctx::eval::EvalModel;
use longctx::hub::HubOptions;

#[derive(Args, Debug)]
pub struct GenerateArgs {
    /// Model: a directory (a run's export), a hub id, or builtin:NAME.
    #[arg(long, default_value = DEMO_EXPORT)]
    pub model: String,
    /// The prompt: text for a model with tokenizer.json; for a model without one, token
    /// ids separated by spaces or commas [default: text "Once upon a time"; without a
    /// tokenizer, a synthetic passkey prompt of 64 tokens ending with the question].
    #[arg(long, conflicts_with = "prompt_file")]
    pub prompt: Option<String>,
    /// Read the prompt from this file.
    #[arg(long)]
    pub prompt_file: Option<PathBuf>,
    /// Stop after this many new tokens (or at the EOS token).
    #[arg(long, default_value_t = 64)]
    pub max_new_tokens: usize,
    /// 0 = greedy; otherwise sample from softmax(logits / temperature).
    #[arg(long, default_value_t = 0.0, allow_negative_numbers = true)]
    pub temperature: f64,
    /// Sample only among the most likely tokens whose probabilities add up to this.
    #[arg(long, default_value_t = 1.0, allow_negative_numbers = true)]
    pub top_p: f64,
    /// Seed of the sampler.
    #[arg(long, default_value_t = 0)]
    pub seed: u64,
    /// Run without the KV cache (the whole sequence again for every token; a reference).
    #[arg(long)]
    pub no_cache: bool,
    /// Keep going past the EOS token.
    #[arg(long)]
    pub ignore_eos: bool,
    /// cpu, cuda or cuda:N.
    #[arg(long, default_value = "cpu")]
    pub device: String,
    /// dtype on a GPU: f32, bf16 or f16 (the CPU runs f32).
    #[arg(long, default_value = "bf16")]
    pub dtype: String,
    /// CUDA attention kernel: auto (per call the faster of the two on that shape), cudnn, or
    /// native (longctx's own Hopper kernel, sm_90a builds; shapes it does not cover, such as
    /// decoding steps of one query against more keys, run cuDNN). No effect on the CPU.
    #[arg(long, default_value = "auto")]
    pub attention_kernel: longctx_attention::kernel::CudaKernel,
}

/// Readable names of the synthetic passkey vocabulary (for a model without tokenizer).
fn token_name(t: u32) -> String {
    match t {
        synthetic::PAD => "<pad>".into(),
        synthetic::BOS => "<bos>".into(),
        synthetic::EOS => "<eos>".into(),
        synthetic::KEY => "<key>".into(),
        synthetic::KEY_END => "</key>".into(),
        synthetic::QUESTION => "<question>".into(),
        synthetic::VAR => "<var>".into(),
        synthetic::VT_QUESTION => "<vt-question>".into(),
        t if (synthetic::DIGIT0..synthetic::FILLER0).contains(&t) => format!("{}", (t - synthetic::DIGIT0) % 10),
        t if (synthetic::VAR0..synthetic::VAR0 + synthetic::VARIABLES as u32).contains(&t) => format!("V{}", t - synthetic::VAR0),
        t => format!("#{t}"),
    }
}

pub fn generate_cmd(a: GenerateArgs) -> Result<()> {
    let (dev, dtype) = device_and_dtype(&a.device, parse_dtype(&a.dtype, "dtype")?)?;
    a.attention_kernel.select();
    // Sizes first, before any weight is read: the KV cache of --max-new-tokens tokens (and
    // the weights) must fit the device, and the positions must fit 32 bits.
    let hub = HubOptions::from_env();
    let fix = "lower --max-new-tokens";
    let have = memory::eval_memory_available(&a.device)?;
    if let Some(mc) = longctx::hub::model_config(&a.model, &hub, false)? {
        let need = memory::eval_memory(&mc.cfg, dtype, 1, a.max_new_tokens as u64)?;
        let parts = [("weights", need.weights), ("KV cache", need.kv_cache)];
        memory::check_eval_size(a.max_new_tokens as u64, &parts, have, &a.device, "--max-new-tokens", fix)?;
    }
    let m = EvalModel::load(&a.model, &dev, dtype, &hub).with_context(|| format!("loading the model {}", a.model))?;
    eprintln!("{}", m.describe());
    let prompt = prompt_ids(&a, &m)?;
    if prompt.is_empty() {
        bail!("--prompt: the prompt is empty");
    }
    let sampling = Sampling { temperature: a.temperature, top_p: a.top_p, seed: a.seed };
    // Every argument is checked before anything is streamed: an error never follows the
    // printed prompt on the same line.
    sampling.check()?;
    let vocab = m.cfg().vocab_size;
    if let Some(&bad) = prompt.iter().find(|&&t| t as usize >= vocab) {
        bail!("--prompt: token id {bad} is not below the model's vocabulary size {vocab}");
    }
    // With the prompt known, the whole sequence: its forward and cache (the weights are
    // loaded already, so on the CPU they are no longer in the available memory).
    let total = (prompt.len() as u64).saturating_add(a.max_new_tokens as u64);
    let need = memory::eval_memory(m.cfg(), dtype, prompt.len() as u64, total)?;
    let have = match (memory::eval_memory_available(&a.device)?, a.device.trim() == "cpu") {
        (Some(h), false) => Some(h.saturating_sub(need.weights)),
        (h, _) => h,
    };
    let parts = [("prompt activations", need.activations), ("KV cache", need.kv_cache)];
    memory::check_eval_size(total, &parts, have, &a.device, "--max-new-tokens", "lower --max-new-tokens or shorten the prompt")?;
    let eos = if a.ignore_eos { None } else { m.cfg().eos_token_id() };
    if prompt.len() + a.max_new_tokens > m.max_context() {
        eprintln!(
            "note: {} prompt + {} new tokens exceed the model's context of {} tokens",
            prompt.len(),
            a.max_new_tokens,
            m.max_context()
        );
    }
    let mut out = std::io::stdout();
    let t0 = std::time::Instant::now();
    let mut shown = String::new();
    let mut generated: Vec<u32> = Vec::new();
    match &m.tokenizer {
        Some(_) => {
            let p = m.tokenizer.as_ref().map(|t| t.decode(&prompt, true).unwrap_or_default()).unwrap_or_default();
            write!(out, "{p}")?;
        }
        None => write!(out, "{}", prompt.iter().map(|&t| token_name(t)).collect::<Vec<_>>().join(" "))?,
    }
    out.flush()?;
    let tokens = generate(&m.model, &prompt, a.max_new_tokens, eos, &sampling, !a.no_cache, |t| {
        generated.push(t);
        let piece = match &m.tokenizer {
            // Decode everything so far and print what is new (pieces join correctly).
            Some(tok) => {
                let all = tok.decode(&generated, true).unwrap_or_default();
                let new = all.get(shown.len()..).unwrap_or("").to_string();
                shown = all;
                new
            }
            None => format!(" {}", token_name(t)),
        };
        write!(out, "{piece}").and_then(|_| out.flush()).map_err(|e| longctx::Error::io("<stdout>", e))
    })?;
    writeln!(out)?;
    let s = t0.elapsed().as_secs_f64();
    eprintln!(
        "{} tokens in {:.2} s ({:.1} tokens/s){}",
        tokens.len(),
        s,
        tokens.len() as f64 / s.max(1e-9),
        if a.no_cache { ", no KV cache" } else { "" }
    );
    Ok(())
}

/// The prompt as token ids: `--prompt` / `--prompt-file` through the model's tokenizer (as
/// transformers' `tokenizer(prompt)`), token ids without one, or a synthetic passkey
/// sample when neither is given.
fn prompt_ids(a: &GenerateArgs, m: &EvalModel) -> Result<Vec<u32>> {
    let text = match (&a.prompt, &a.prompt_file) {
        (Some(p), _) => Some(p.clone()),
        (None, Some(f)) => Some(std::fs::read_to_string(f).with_context(|| format!("--prompt-file: cannot read {}", f.display()))?),
        (None, None) => None,
    };
    Ok(match (&m.tokenizer, text) {
        (Some(tok), t) => {
            let t = t.unwrap_or_else(|| "Once upon a time".into());
            // As transformers' tokenizer(prompt): its own BOS/EOS rule, not config.json's bos_token_id.
            longctx::hub::tokenizer::encode_text(tok, t.as_str()).map_err(|e| anyhow::anyhow!("tokenizing the prompt: {e}"))?
        }
        (None, Some(t)) => t
            .split(|c: char| c.is_whitespace() || c == ',')
            .filter(|s| !s.is_empty())
            .map(|s| s.parse::<u32>().map_err(|_| anyhow::anyhow!("--prompt: the model has no tokenizer.json, so the prompt must be token ids separated by spaces or commas; `{s}` is not one")))
            .collect::<Result<_>>()?,
        (None, None) => {
            let case = longctx::eval::needle::token_case(64, 0.5, 5, m.cfg().vocab_size, a.seed, 0, 0)?;
            eprintln!("prompt: a synthetic passkey sample of 64 tokens (no tokenizer.json); the passkey is {}", case.value);
            case.prompt()
        }
    })
}

#[cfg(test)]
mod tests {
    use super::GenerateArgs;
    use clap::Parser;
    use longctx_attention::kernel::CudaKernel;

    #[derive(Parser)]
    struct Cmd {
        #[command(flatten)]
        a: GenerateArgs,
    }

    #[test]
    fn attention_kernel_flag() {
        let parse = |v: &[&str]| Cmd::try_parse_from(std::iter::once("generate").chain(v.iter().copied())).map(|c| c.a);
        assert_eq!(parse(&[]).unwrap().attention_kernel, CudaKernel::Auto);
        assert_eq!(parse(&["--attention-kernel", "native"]).unwrap().attention_kernel, CudaKernel::Native);
        let e = parse(&["--attention-kernel", "sdpa"]).map(|_| ()).expect_err("sdpa is no kernel").to_string();
        assert!(e.contains("--attention-kernel") && e.contains("sdpa") && e.contains("cudnn, native, auto"), "{e}");
    }
}
