//! The tokenizer of a model directory: the Hugging Face fast-tokenizer `tokenizer.json`.

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
    match std::panic::catch_unwind(|| text.parse::<tokenizers::Tokenizer>()) {
        Ok(Ok(t)) => Ok(t),
        Ok(Err(e)) => Err(bad(e.to_string())),
        Err(_) => Err(bad("the tokenizers library panicked on its content".into())),
    }
}
