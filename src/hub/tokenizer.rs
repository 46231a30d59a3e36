//! The tokenizer of a model directory: the Hugging Face fast-tokenizer `tokenizer.json`,
//! with the special tokens transformers adds to a text.
//!
//! Special tokens (BOS/EOS) are what `AutoTokenizer.from_pretrained(dir)(text)` adds, in
//! every command that tokenizes text (train, eval ppl, eval needle, generate): those of
//! `tokenizer.json`'s post-processor (Llama 2's and Llama 3's templates add BOS; SmolLM2's
//! and Qwen2's add nothing). transformers 5 ignores `tokenizer_config.json`'s
//! `add_bos_token`/`add_eos_token` whenever a `tokenizer.json` exists (4.x's Llama
//! tokenizer rebuilt its template from them); so does longctx, which always reads
//! `tokenizer.json` (tests/all/bos_real_tokenizer.rs checks both against transformers).
//! `config.json`'s `bos_token_id` is not consulted: a model's config may name a BOS that
//! its tokenizer never adds.

use std::path::Path;

use crate::{Error, Result};

pub const TOKENIZER_FILE: &str = "tokenizer.json";

/// Loads `dir/tokenizer.json`.
pub fn load_tokenizer(dir: impl AsRef<Path>) -> Result<tokenizers::Tokenizer> {
    let dir = dir.as_ref();
    let path = dir.join(TOKENIZER_FILE);
    if !path.is_file() {
        let hint = if dir.join("tokenizer.model").is_file() {
            " (only the sentencepiece tokenizer.model is there: convert it once with transformers, \
             `AutoTokenizer.from_pretrained(dir).save_pretrained(dir)` writes tokenizer.json)"
        } else {
            ""
        };
        return Err(Error::checkpoint(
            &path,
            format!("missing: the model directory needs tokenizer.json (the Hugging Face fast tokenizer){hint}"),
        ));
    }
    let text = std::fs::read_to_string(&path).map_err(|e| Error::io(&path, e))?;
    let bad = |what: String| Error::checkpoint(&path, format!("cannot parse the tokenizer ({what}); re-download tokenizer.json"));
    // The JSON syntax first: the `tokenizers` crate panics on some malformed files
    // (a syntax error inside `decoder`, found by `fuzz/`'s tokenizer_json target).
    serde_json::from_str::<serde_json::Value>(&text).map_err(|e| bad(format!("not valid JSON: {e}")))?;
    // And any panic left in its deserializers becomes an error naming the file.
    let tok = match std::panic::catch_unwind(|| text.parse::<tokenizers::Tokenizer>()) {
        Ok(Ok(t)) => t,
        Ok(Err(e)) => return Err(bad(e.to_string())),
        Err(_) => return Err(bad("the tokenizers library panicked on its content".into())),
    };
    Ok(tok)
}

/// `tokenizer(text).input_ids` as transformers gives it: the text's ids with the special
/// tokens the tokenizer adds (module docs).
pub fn encode_text(tok: &tokenizers::Tokenizer, text: &str) -> std::result::Result<Vec<u32>, String> {
    tok.encode_fast(text, true).map(|e| e.get_ids().to_vec()).map_err(|e| e.to_string())
}

/// The special tokens the tokenizer puts before a text (BOS for Llama's tokenizers,
/// nothing for SmolLM2's): what a prompt assembled from pieces starts with.
pub fn special_prefix(tok: &tokenizers::Tokenizer) -> std::result::Result<Vec<u32>, String> {
    let probe = "a";
    let with = encode_text(tok, probe)?;
    let without = tok.encode_fast(probe, false).map(|e| e.get_ids().to_vec()).map_err(|e| e.to_string())?;
    Ok(with.windows(without.len().max(1)).position(|w| w == without.as_slice()).map(|at| with[..at].to_vec()).unwrap_or_default())
}
