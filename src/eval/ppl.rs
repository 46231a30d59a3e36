//! Perplexity against context length.
//!
//! Documents (any dataset `train` reads, or synthetic passkey samples) are tokenized as
//! training does (EOS after each document), then for each context length `L` of the grid:
//!
//! - [`Method::Sliding`]: the documents are concatenated into one stream and its first
//!   `max_tokens` tokens are scored by windows of `L` inputs starting every `stride`
//!   tokens; a window scores only the targets the previous window did not (the first
//!   scores all), so every length scores exactly the same targets, each with up to `L`
//!   tokens of context (at least `L − stride` after the first window).
//! - [`Method::Truncate`]: each document (up to `max_docs`) is cut to its first `L + 1`
//!   tokens and all its targets are scored; documents shorter than that are skipped, so
//!   each length scores documents that really are that long.
//!
//! - [`Method::Documents`]: the documents are packed one after another into windows of
//!   `L` inputs (the first `max_tokens` tokens of the stream) and each window is scored
//!   under a document mask: a token sees only its own document, positions restart at
//!   every document, and the target across a boundary is not scored. A document longer
//!   than the window continues in the next one as a document of its own. This is what
//!   training with `data.packing = "documents"` sees; every length scores the same
//!   tokens except those boundary targets.
//!
//! Perplexity = exp(Σ token losses / counted tokens), the same sum over ranks as training.

use serde::{Deserialize, Serialize};

use super::forward::Ranks;
use crate::data::docs::{MultiFileDocs, ReadOptions, TextSplit, Tokenize};
use crate::data::source::{resolve, TokenWidth};
use crate::data::synthetic::{LossOn, Passkey, PasskeyConfig};
use crate::hub::HubOptions;
use crate::model::Llama;
use crate::{Error, Result};

/// How windows are cut (see module docs).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Method {
    Sliding,
    Truncate,
    Documents,
}

/// One scoring window: `ids [n]`, `targets [n]` (negative = not scored), and where its
/// documents start (empty: one document, plain causal attention).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Window {
    pub ids: Vec<u32>,
    pub targets: Vec<i64>,
    pub doc_starts: Vec<usize>,
}

/// The documents of the first `max_tokens` tokens packed into windows of `len` inputs
/// with their starts (see module docs); the last window may be shorter.
pub fn document_windows(docs: &[Vec<u32>], len: usize, max_tokens: usize) -> Vec<Window> {
    let mut out = Vec::new();
    if len == 0 {
        return out;
    }
    let mut cur = Window { ids: Vec::with_capacity(len), targets: Vec::with_capacity(len), doc_starts: Vec::new() };
    let mut budget = max_tokens;
    for d in docs {
        let mut rest = &d[..d.len().min(budget)];
        budget -= rest.len();
        while !rest.is_empty() {
            let take = rest.len().min(len - cur.ids.len());
            cur.doc_starts.push(cur.ids.len());
            cur.ids.extend_from_slice(&rest[..take]);
            // Targets within this piece; its last token's next token is not in it.
            cur.targets.extend(rest[1..take].iter().map(|&t| t as i64));
            cur.targets.push(crate::data::IGNORE);
            rest = &rest[take..];
            if cur.ids.len() == len {
                out.push(std::mem::replace(
                    &mut cur,
                    Window { ids: Vec::with_capacity(len), targets: Vec::with_capacity(len), doc_starts: Vec::new() },
                ));
            }
        }
        if budget == 0 {
            break;
        }
    }
    if !cur.ids.is_empty() {
        out.push(cur);
    }
    out
}

/// Sliding windows of `len` inputs every `stride` tokens over the first `max_tokens` of
/// `stream` (see module docs).
pub fn sliding_windows(stream: &[u32], len: usize, stride: usize, max_tokens: usize) -> Vec<Window> {
    let total = stream.len().min(max_tokens);
    let mut out = Vec::new();
    if total < 2 || len == 0 {
        return out;
    }
    let stride = stride.clamp(1, len);
    // Target index j (1..total) is the stream token j predicted from tokens before it;
    // `done`: the last target index a previous window scored.
    let mut done = 0usize;
    let mut begin = 0usize;
    loop {
        let end = (begin + len).min(total - 1); // inputs begin..end, targets begin+1..=end
        let ids = stream[begin..end].to_vec();
        let targets = (begin..end).map(|i| if i + 1 > done { stream[i + 1] as i64 } else { crate::data::IGNORE }).collect();
        done = end;
        out.push(Window { ids, targets, doc_starts: Vec::new() });
        if end >= total - 1 {
            break;
        }
        begin += stride;
    }
    out
}

/// Each document cut to `len + 1` tokens (`len` scored targets); shorter ones skipped.
pub fn truncated_windows(docs: &[Vec<u32>], len: usize, max_docs: usize) -> Vec<Window> {
    docs.iter()
        .filter(|d| d.len() > len)
        .take(max_docs)
        .map(|d| Window { ids: d[..len].to_vec(), targets: d[1..=len].iter().map(|&t| t as i64).collect(), doc_starts: Vec::new() })
        .collect()
}

/// `synthetic:passkey-answer` (`vt_hops` 0) or `synthetic:retrieval-answer` (its hops)
/// at length `len`: `n` samples of that length, each its own window, scored on the answers
/// only (the loss mask the dataset trains with: the perplexity of retrieving across the
/// haystack, not of the filler). Samples `0..n` of the seed, as `read_docs` numbers them.
pub fn passkey_answer_windows(vocab: usize, seed: u64, len: usize, n: usize, vt_hops: usize) -> Result<Vec<Window>> {
    let mut pc = PasskeyConfig::new(len);
    pc.vocab = vocab;
    pc.seed = seed;
    pc.loss_on = LossOn::Answer;
    pc.vt_hops = vt_hops;
    let gen = Passkey::new(pc)?;
    Ok((0..n.max(1) as u64)
        .map(|i| {
            let s = gen.sample(i).sample;
            Window { ids: s.ids, targets: s.targets, doc_starts: Vec::new() }
        })
        .collect())
}

/// Where documents come from.
#[derive(Debug, Clone)]
pub struct DocSource {
    /// `synthetic:passkey`, or a file / directory / hub dataset id.
    pub dataset: String,
    pub column: Option<String>,
    /// Only the files of this split (as `train`'s `data.split`; `*`: every file).
    pub split: String,
    pub token_width: TokenWidth,
    /// Stop reading after this many tokens (all documents together) or documents.
    pub max_tokens: usize,
    pub max_docs: usize,
    pub seed: u64,
}

/// Token documents of `src` for `model` (tokenizer for text, EOS after each document,
/// ids checked against the vocabulary). Synthetic passkey documents are `longest + 1`
/// tokens each.
pub fn read_docs(src: &DocSource, model: &Llama, tokenizer: Option<&tokenizers::Tokenizer>, longest: usize) -> Result<Vec<Vec<u32>>> {
    let cfg = &model.cfg;
    if let Some(kind) = src.dataset.strip_prefix("synthetic:") {
        let Some((_, vt_hops)) = crate::data::synthetic::dataset(kind) else {
            return Err(Error::config(
                "--dataset",
                "dataset",
                format!("unknown synthetic dataset `{}`; available: {}", src.dataset, crate::data::synthetic::DATASETS),
            ));
        };
        let mut pc = PasskeyConfig::new(longest);
        pc.vocab = cfg.vocab_size;
        pc.seed = src.seed;
        pc.loss_on = LossOn::All;
        pc.vt_hops = vt_hops;
        let gen = Passkey::new(pc)?;
        let n = src.max_docs.min(src.max_tokens.div_ceil(longest.saturating_add(1))).max(1);
        return Ok((0..n as u64)
            .map(|i| {
                let s = gen.sample(i).sample;
                let mut t = s.ids.clone();
                t.extend(s.targets.last().map(|&x| x as u32));
                t
            })
            .collect());
    }
    let resolved = resolve(&src.dataset, None, Some(src.split.as_str()), &HubOptions::from_env())?;
    let opts =
        ReadOptions { format: resolved.format, column: src.column.clone(), text_split: TextSplit::File, token_width: src.token_width };
    let tok = Tokenize {
        tokenizer: tokenizer.map(|t| std::sync::Arc::new(t.clone())),
        bos: None,
        eos: cfg.eos_token_id(),
        vocab_size: Some(cfg.vocab_size),
    };
    let mut docs = Vec::new();
    let mut tokens = 0usize;
    for d in MultiFileDocs::new(resolved.files.clone(), opts) {
        let d = tok.apply(d?)?;
        tokens += d.ids.len();
        docs.push(d.ids);
        if tokens >= src.max_tokens || docs.len() >= src.max_docs {
            break;
        }
    }
    if tokens < 2 {
        return Err(Error::data(&resolved.root, "the dataset holds no document with at least 2 tokens: nothing to score"));
    }
    Ok(docs)
}

/// Perplexity of one model at one length.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct PplPoint {
    pub model: String,
    pub length: usize,
    pub ppl: f64,
    /// Mean token loss (nats).
    pub loss: f64,
    pub tokens: usize,
    pub windows: usize,
    pub seconds: f64,
}

/// Σ loss and count of the scored targets of `windows` (every rank calls it alike);
/// `progress` is called after each window.
pub fn score_windows(ranks: &Ranks, model: &Llama, windows: &[Window], mut progress: impl FnMut()) -> Result<(f64, usize)> {
    let (mut sum, mut n) = (0f64, 0usize);
    for w in windows {
        let s = ranks.token_scores_docs(model, &w.ids, &w.targets, &w.doc_starts)?;
        for (l, t) in s.loss.iter().zip(&w.targets) {
            if *t >= 0 {
                sum += *l as f64;
                n += 1;
            }
        }
        progress();
    }
    Ok((sum, n))
}

/// `exp(sum / n)`; errors when nothing was scored.
pub fn perplexity(sum: f64, n: usize, what: &str) -> Result<f64> {
    if n == 0 {
        return Err(Error::Setting(format!("{what}: no token was scored (documents too short for this length? lower --lengths)")));
    }
    Ok((sum / n as f64).exp())
}

/// The CSV of a perplexity table.
pub fn to_csv(points: &[PplPoint]) -> String {
    let mut s = String::from("model,length,ppl,loss,tokens,windows,seconds\n");
    for p in points {
        let name = if p.model.contains([',', '"']) { format!("\"{}\"", p.model.replace('"', "\"\"")) } else { p.model.clone() };
        s.push_str(&format!("{name},{},{},{},{},{},{:.3}\n", p.length, p.ppl, p.loss, p.tokens, p.windows, p.seconds));
    }
    s
}
