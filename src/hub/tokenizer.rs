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
    tokenizers::Tokenizer::from_file(&path)
        .map_err(|e| Error::checkpoint(&path, format!("cannot parse the tokenizer ({e}); re-download tokenizer.json")))
}
