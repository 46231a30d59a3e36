//! Needle in a haystack and passkey retrieval over a depth × length grid.
//!
//! A case is `L + 1` raw tokens `haystack…needle…haystack question answer`; the model
//! reads the first `L` (`ids`), `targets` are the next tokens, and the answer is the
//! last `k` targets. Two scores per case:
//! - teacher-forced exact match: the argmax at every answer position is the answer
//!   token (one forward, through any sequence-parallel mode) — [`exact_match`];
//! - greedy generation: the first `k` tokens generated after the question are the answer
//!   (KV cache, one device) — [`exact_match`] on them.
//!
//! Two formats:
//! - [`Format::Tokens`], for models without a tokenizer such as the demo export: the
//!   synthetic passkey format the demo trained on ([`crate::data::synthetic`]: built-in
//!   vocabulary, place-tagged digits), the needle depth set by the grid. A distractor is
//!   a run of `k` random digits not framed by the passkey tokens.
//! - [`Format::Text`], for models with `tokenizer.json`: a haystack from a text file or
//!   generated filler after a sentence that states the task, a needle sentence with a random number ("the special magic number",
//!   or with `--passkey` the classic "pass key" sentence and filler), a question, and the
//!   number as the answer; distractors are similar sentences with other numbers.

use serde::{Deserialize, Serialize};

use crate::data::shuffle::SplitMix64;
use crate::data::synthetic::{self, Passkey, PasskeyConfig};
use crate::data::Sample;
use crate::{Error, Result};

/// The generated filler of the text haystack (our own sentences, repeated).
pub const FILLER_TEXT: &str = "The river runs past the old mill. Birds sing in the tall trees. \
A farmer walks his dog along the road. The wind is calm today. Children play near the lake. ";
/// The filler of the classic passkey task.
pub const PASSKEY_FILLER_TEXT: &str = "The grass is green. The sky is blue. The sun is yellow. Here we go. There and back again. ";

/// Which prompt format.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Format {
    Tokens,
    Text,
}

/// One evaluation case.
#[derive(Debug, Clone, PartialEq)]
pub struct Case {
    pub sample: Sample,
    /// Index of the first answer target: `targets[answer_start..]` is the answer.
    pub answer_start: usize,
    pub answer: Vec<u32>,
    /// The needle's value (digits as text).
    pub value: String,
}

impl Case {
    /// What generation starts from: every raw token before the answer.
    pub fn prompt(&self) -> Vec<u32> {
        self.sample.ids[..=self.answer_start].to_vec()
    }
}

/// `true` when every answer token is predicted: `predicted[i] == answer[i]` for all `i`
/// (and as many predictions as answer tokens). One wrong token → `false`.
pub fn exact_match(predicted: &[u32], answer: &[u32]) -> bool {
    !answer.is_empty() && predicted.len() >= answer.len() && predicted[..answer.len()] == *answer
}

/// Fraction of answer tokens predicted right (position by position).
pub fn token_accuracy(predicted: &[u32], answer: &[u32]) -> f64 {
    if answer.is_empty() {
        return 0.0;
    }
    answer.iter().zip(predicted).filter(|(a, p)| a == p).count() as f64 / answer.len() as f64
}

/// A synthetic-vocabulary case of `len` inputs (the demo's training format).
pub fn token_case(len: usize, depth: f64, digits: usize, vocab: usize, seed: u64, index: u64, distractors: usize) -> Result<Case> {
    let mut pc = PasskeyConfig::new(len);
    pc.vocab = vocab;
    pc.digits = digits;
    pc.seed = seed;
    let gen = Passkey::new(pc)?;
    let item = gen.generate(index, Some(depth));
    let s = item.sample;
    // Raw tokens back (S + 1), to place distractors into the filler.
    let mut raw = s.ids.clone();
    raw.extend(s.targets.last().map(|&t| t as u32));
    let needle = item.needle_pos..item.needle_pos + digits + 2;
    let is_filler = |t: u32| (synthetic::FILLER0..synthetic::FILLER0 + synthetic::FILLER_BLOCK as u32).contains(&t);
    let mut rng = SplitMix64::from_parts(&[seed, index, 0xd157]);
    let answer: Vec<u32> = item.passkey.iter().enumerate().map(|(i, &d)| synthetic::digit_token(i, d)).collect();
    for _ in 0..distractors {
        for _try in 0..64 {
            let p = rng.below(raw.len().saturating_sub(digits));
            let span = p..p + digits;
            if span.clone().all(|j| is_filler(raw[j])) && !(span.start < needle.end && needle.start < span.end) {
                let other: Vec<u8> = (0..digits).map(|_| rng.below(10) as u8).collect();
                for (i, d) in other.iter().enumerate() {
                    raw[p + i] = synthetic::digit_token(i, *d);
                }
                break;
            }
        }
    }
    let sample = Sample::from_tokens(&raw, len, synthetic::PAD);
    let value = item.passkey.iter().map(|d| char::from(b'0' + d)).collect();
    Ok(Case { sample, answer_start: item.answer_start, answer, value })
}

/// The text pieces of a case.
#[derive(Debug, Clone)]
pub struct TextTask {
    /// Haystack token ids (repeated as needed); never empty.
    pub haystack: Vec<u32>,
    pub passkey: bool,
    pub digits: usize,
    /// Distractor needles per case.
    pub distractors: usize,
    /// What every case starts with: the special tokens the tokenizer puts before a text
    /// ([`crate::hub::tokenizer::special_prefix`]: BOS for Llama's, nothing for SmolLM2's).
    pub prefix: Vec<u32>,
    tok: tokenizers::Tokenizer,
}

pub(crate) fn number(rng: &mut SplitMix64, digits: usize) -> String {
    (0..digits).map(|i| char::from(b'0' + if i == 0 { 1 + rng.below(9) as u8 } else { rng.below(10) as u8 })).collect()
}

pub(crate) fn encode(tok: &tokenizers::Tokenizer, text: &str) -> Result<Vec<u32>> {
    tok.encode_fast(text, false).map(|e| e.get_ids().to_vec()).map_err(|e| Error::Setting(format!("tokenizer failed on `{text}`: {e}")))
}

/// What every text task (needle, `eval ruler`) starts from: the haystack ids (`text`, or
/// `filler` repeated when `None`; an empty one is an error), the digits checked (1 to 18),
/// and the tokenizer's special prefix.
pub(crate) fn text_basics(tok: &tokenizers::Tokenizer, text: Option<&str>, filler: &str, digits: usize) -> Result<(Vec<u32>, Vec<u32>)> {
    let body = text.map_or_else(|| filler.repeat(4), str::to_string);
    let haystack = encode(tok, &body)?;
    if haystack.is_empty() || body.trim().is_empty() {
        return Err(Error::config(
            "--haystack",
            "haystack",
            "the haystack text is empty; give a file with text in it, or omit --haystack for the generated filler",
        ));
    }
    if !(1..=18).contains(&digits) {
        return Err(Error::config("--digits", "digits", format!("got {digits}, expected 1 to 18")));
    }
    let prefix = crate::hub::tokenizer::special_prefix(tok).map_err(|e| Error::Setting(format!("tokenizer failed: {e}")))?;
    Ok((haystack, prefix))
}

/// The answer tokens as the tokenizer cuts them after `q_ids` in `question + answer + "."`
/// (the final "." not asked for); `answer_text` encoded alone when the cut differs.
pub(crate) fn answer_after(tok: &tokenizers::Tokenizer, q_ids: &[u32], question: &str, answer_text: &str) -> Result<Vec<u32>> {
    let with_answer = encode(tok, &format!("{question}{answer_text}."))?;
    if with_answer.len() > q_ids.len() && with_answer[..q_ids.len()] == *q_ids {
        let a = &with_answer[q_ids.len()..];
        let dot = encode(tok, ".")?;
        let keep = if a.len() > dot.len() && a.ends_with(&dot) { a.len() - dot.len() } else { a.len() };
        Ok(a[..keep].to_vec())
    } else {
        encode(tok, answer_text)
    }
}

impl TextTask {
    /// The haystack: `text`, or the generated filler when `None`; an empty one is an error.
    /// `distractors`: see the field.
    pub fn new(tok: &tokenizers::Tokenizer, text: Option<&str>, passkey: bool, digits: usize, distractors: usize) -> Result<Self> {
        let filler = if passkey { PASSKEY_FILLER_TEXT } else { FILLER_TEXT };
        let (haystack, prefix) = text_basics(tok, text, filler, digits)?;
        Ok(Self { haystack, passkey, digits, distractors, prefix, tok: tok.clone() })
    }

    /// A case of `len` inputs with the needle at `depth` of the haystack.
    pub fn case(&self, len: usize, depth: f64, seed: u64, index: u64) -> Result<Case> {
        let (tok, distractors) = (&self.tok, self.distractors);
        let mut rng = SplitMix64::from_parts(&[seed, index]);
        let value = number(&mut rng, self.digits);
        let (needle, question) = if self.passkey {
            (
                format!(" The pass key is {value}. Remember it. {value} is the pass key. "),
                " What is the pass key? The pass key is".to_string(),
            )
        } else {
            (
                format!(" The special magic number is {value}. "),
                " What is the special magic number mentioned in the text? The special magic number is".to_string(),
            )
        };
        // The task is stated first, so that depth 0 puts the needle after it rather than on
        // the first tokens (without a BOS they are the attention sink, and a model reads
        // little of what sits there: SmolLM2-135M misses a needle at depth 0 even at 1K).
        let header = if self.passkey {
            "A pass key is hidden somewhere in the long text below. Find it and keep it in mind: you will be asked for it at the end."
        } else {
            "A special magic number is hidden somewhere in the long text below. Find it and keep it in mind: you will be asked for it at the end."
        };
        let header_ids = encode(tok, header)?;
        let needle_ids = encode(tok, &needle)?;
        let q_ids = encode(tok, &question)?;
        let answer = answer_after(tok, &q_ids, &question, &format!(" {value}"))?;
        let mut distractor_ids = Vec::new();
        for _ in 0..distractors {
            let other = number(&mut rng, self.digits);
            let s = if self.passkey {
                format!(" The old pass key was {other}. Forget it. ")
            } else {
                format!(" The special magic number of another story is {other}. ")
            };
            distractor_ids.push(encode(tok, &s)?);
        }
        let fixed = self.prefix.len()
            + header_ids.len()
            + needle_ids.len()
            + q_ids.len()
            + answer.len()
            + distractor_ids.iter().map(Vec::len).sum::<usize>();
        if len + 1 < fixed + 1 {
            return Err(Error::config(
                "--lengths",
                "lengths",
                format!("length {len} is too short for the needle, question and answer ({fixed} tokens); use longer lengths"),
            ));
        }
        let hay_len = len + 1 - fixed;
        let hay: Vec<u32> = self.haystack.iter().cycle().take(hay_len).copied().collect();
        let at = ((depth.clamp(0.0, 1.0) * hay_len as f64).round() as usize).min(hay_len);
        // Distractors spread evenly, away from the needle's own position.
        let mut inserts: Vec<(usize, Vec<u32>)> = vec![(at, needle_ids)];
        for (i, d) in distractor_ids.into_iter().enumerate() {
            let mut p = ((i as f64 + 0.5) / distractors as f64 * hay_len as f64) as usize;
            if p == at {
                p = (p + hay_len / (2 * distractors + 2)).min(hay_len);
            }
            inserts.push((p, d));
        }
        inserts.sort_by_key(|(p, _)| *p);
        let mut raw: Vec<u32> = self.prefix.clone();
        raw.extend_from_slice(&header_ids);
        let mut prev = 0;
        for (p, ids) in inserts {
            raw.extend_from_slice(&hay[prev..p]);
            raw.extend(ids);
            prev = p;
        }
        raw.extend_from_slice(&hay[prev..]);
        raw.extend_from_slice(&q_ids);
        raw.extend_from_slice(&answer);
        debug_assert_eq!(raw.len(), len + 1);
        let answer_start = len - answer.len();
        Ok(Case { sample: Sample::from_tokens(&raw, len, 0), answer_start, answer, value })
    }
}

/// Checks a depth grid: every depth in [0, 1].
pub fn check_depths(depths: &[f64]) -> Result<()> {
    if depths.is_empty() {
        return Err(Error::config("--depths", "depths", "no depth given; e.g. --depths 0,0.25,0.5,0.75,1"));
    }
    if let Some(d) = depths.iter().find(|d| !(0.0..=1.0).contains(*d)) {
        return Err(Error::config(
            "--depths",
            "depths",
            format!("depth {d} is outside [0, 1] (0 = the needle at the start of the haystack, 1 = at its end)"),
        ));
    }
    Ok(())
}

/// The result of one grid cell.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Cell {
    pub length: usize,
    pub depth: f64,
    pub trials: usize,
    /// Share of trials whose every answer token is the argmax under teacher forcing.
    pub teacher_forced: f64,
    /// Share of answer tokens right under teacher forcing.
    pub token_accuracy: f64,
    /// Share of trials whose greedy generation starts with the answer (`None`: not run).
    pub greedy: Option<f64>,
}

/// Mean over cells of a score, for a summary line.
pub fn mean(cells: &[Cell], f: impl Fn(&Cell) -> Option<f64>) -> Option<f64> {
    let v: Vec<f64> = cells.iter().filter_map(f).collect();
    (!v.is_empty()).then(|| v.iter().sum::<f64>() / v.len() as f64)
}
