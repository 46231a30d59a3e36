//! Synthetic passkey retrieval: long-context data that needs no download and no
//! tokenizer, for the demo job, CI and quick checks that long-range attention works.
//!
//! Built-in vocabulary (ids; `vocab` ≥ MIN_VOCAB = 128; the model's vocab must be ≥ it):
//! ```text
//! 0 PAD   1 BOS   2 EOS
//! 3 KEY       "the passkey is"  (opens the needle, and again the answer)
//! 4 KEY_END   "remember it."    (closes the needle)
//! 5 QUESTION  "what is the passkey?"
//! 6 VAR       "VAR" (opens a variable assignment)
//! 7 VT_QUESTION "which variables hold the value"
//! 8..88       digits with their place: digit d at place i (0-based) is 8 + 10·i + d (i < 8)
//! 88..109     filler words: one fixed block of 21 words (think five short sentences)
//! 109..125    variable names (16)
//! 125..vocab  unused
//! ```
//! A sample is S+1 raw tokens `t` (S = seq_len), `ids = t[..S]`, `targets = t[1..]`:
//! ```text
//! BOS  filler…  KEY p1..pk KEY_END  filler…  QUESTION KEY p1..pk
//! ```
//! The filler repeats the fixed 21-word block, like the "The grass is green. The sky is
//! blue. ..." of the passkey papers; the needle sits at a uniformly random depth; the k
//! digits are uniform. The answer ends the sample, so with [`LossOn::Answer`] only the
//! last k targets count, with [`LossOn::All`] every target.
//!
//! Learnability: each answer digit needs ONE attention hop over the whole context: the
//! token before answer place i (KEY, or the answer digit of place i-1) looks up the only
//! earlier token of place i, the needle's, and copies its digit; place-tagged digit ids
//! make this a plain content lookup. Measured with the built-in tiny Llama (2 layers,
//! hidden 64), AdamW lr 3e-3, batch 8, `LossOn::Answer`, k = 5 (held-out digit accuracy,
//! chance 0.1): seq_len 24 reaches 1.00 within 125 steps (test `passkey_is_learnable` in
//! tests/all/data.rs); seq_len 32 reaches 0.95 in 200 steps, after which 25 steps at 256 give
//! 0.97; trained from scratch at 64 it is ~0.4 after 400 steps and at 128 still chance
//! after 300 (the needle's share of attention at init shrinks like 1/S), so start with
//! a short stage and extend, which is the point of the demo. With `LossOn::All` the
//! filler and the unpredictable needle digits dilute the signal: chance after 200 steps
//! at 32. Use `Answer` to show retrieval, `All` only to show the loss going down.
//!
//! Variable tracking (RULER's `vt` in the built-in vocabulary; with `vt_hops` > 0 every odd
//! sample is one, `synthetic:retrieval`): a chain of `hops + 1` distinct variables, the
//! first assigned the value, each next one the previous variable, the assignments in chain
//! order at random places of the filler, then the question with the value and the answer,
//! the chain's variables in order:
//! ```text
//! BOS  filler…  VAR x0 p1..pk  filler…  VAR x1 x0  filler…  VAR x2 x1  …  VT_QUESTION p1..pk x0 x1 x2
//! ```
//! The first answer variable is the one assigned the value (one hop over the context to the
//! value, then the token before it); each next one is the variable assigned the one just
//! written (a match on the current token, then the token before the match: an induction
//! head, which needs the model's two layers). Measured with the demo (2 layers, hidden 64):
//! see `RunConfig::default`.
//!
//! Sample `i` depends only on `(seed, i)`: random access, and resuming is exact.

use serde::{Deserialize, Serialize};

use super::packing::{Sample, IGNORE};
use super::shuffle::SplitMix64;
use crate::{Error, Result};

pub const PAD: u32 = 0;
pub const BOS: u32 = 1;
pub const EOS: u32 = 2;
pub const KEY: u32 = 3;
pub const KEY_END: u32 = 4;
pub const QUESTION: u32 = 5;
pub const VAR: u32 = 6;
pub const VT_QUESTION: u32 = 7;
/// Digit `d` at place `i`: `DIGIT0 + 10·i + d`.
pub const DIGIT0: u32 = 8;
/// Longest passkey (places with their own digit ids).
pub const MAX_DIGITS: usize = 8;
pub const FILLER0: u32 = DIGIT0 + 10 * MAX_DIGITS as u32;
/// Length of the filler block (ids FILLER0.., in order, repeated).
pub const FILLER_BLOCK: usize = 21;
/// First variable name of variable tracking.
pub const VAR0: u32 = FILLER0 + FILLER_BLOCK as u32;
/// Variable names (ids VAR0..VAR0 + VARIABLES).
pub const VARIABLES: usize = 16;
/// Most hops of a chain (every variable of it distinct).
pub const MAX_HOPS: usize = VARIABLES - 1;
/// Smallest accepted vocabulary.
pub const MIN_VOCAB: usize = 128;
// Every built-in id, the variable names included, is below the smallest vocabulary.
const _: () = assert!(VAR0 as usize + VARIABLES <= MIN_VOCAB);

/// Token id of digit `d` (0..=9) at place `i` (< MAX_DIGITS).
pub fn digit_token(i: usize, d: u8) -> u32 {
    DIGIT0 + 10 * i as u32 + d as u32
}

/// Which targets the loss counts.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum LossOn {
    /// Only the k answer digits at the end.
    #[default]
    Answer,
    /// Every next-token target.
    All,
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct PasskeyConfig {
    /// Vocabulary size of the model (≥ MIN_VOCAB = 128).
    #[serde(default = "default_vocab")]
    pub vocab: usize,
    pub seq_len: usize,
    /// Passkey length k (1..=MAX_DIGITS).
    #[serde(default = "default_digits")]
    pub digits: usize,
    #[serde(default)]
    pub seed: u64,
    #[serde(default)]
    pub loss_on: LossOn,
    /// 0: passkey samples only; else every odd sample is variable tracking with this many
    /// hops (1..=MAX_HOPS; the chain holds hops + 1 variables).
    #[serde(default)]
    pub vt_hops: usize,
}

fn default_vocab() -> usize {
    256
}
fn default_digits() -> usize {
    5
}

impl PasskeyConfig {
    pub fn new(seq_len: usize) -> Self {
        Self { vocab: default_vocab(), seq_len, digits: default_digits(), seed: 0, loss_on: LossOn::Answer, vt_hops: 0 }
    }
}

/// One generated sample with what an evaluation needs to know about it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PasskeyItem {
    pub sample: Sample,
    /// The passkey digits (0..=9).
    pub passkey: Vec<u8>,
    /// Index in `ids` of the KEY token opening the needle.
    pub needle_pos: usize,
    /// First target index of the answer: `targets[answer_start..]` are the digits (= S - k).
    pub answer_start: usize,
}

/// Passkey sample generator (see module docs).
#[derive(Debug, Clone)]
pub struct Passkey {
    cfg: PasskeyConfig,
    next: u64,
}

impl Passkey {
    pub fn new(cfg: PasskeyConfig) -> Result<Self> {
        if cfg.vocab < MIN_VOCAB || cfg.vocab > u32::MAX as usize {
            return Err(Error::Setting(format!(
                "passkey: vocab {} must be at least {MIN_VOCAB} (the built-in vocabulary uses ids 0..{})",
                cfg.vocab,
                FILLER0 as usize + FILLER_BLOCK
            )));
        }
        if !(1..=MAX_DIGITS).contains(&cfg.digits) {
            return Err(Error::Setting(format!("passkey: digits {} must be in 1..={MAX_DIGITS}", cfg.digits)));
        }
        if cfg.vt_hops > MAX_HOPS {
            return Err(Error::Setting(format!("passkey: vt_hops {} must be in 0..={MAX_HOPS} (0: no variable tracking)", cfg.vt_hops)));
        }
        let min = (2 * cfg.digits + 4).max(if cfg.vt_hops > 0 { vt_fixed(cfg.digits, cfg.vt_hops) - 1 } else { 0 });
        if cfg.seq_len < min {
            return Err(Error::Setting(format!(
                "passkey: seq_len {} is too short for {} digits{}; it must be at least {min}",
                cfg.seq_len,
                cfg.digits,
                if cfg.vt_hops > 0 { format!(" and variable tracking over {} hops", cfg.vt_hops) } else { String::new() }
            )));
        }
        Ok(Self { cfg, next: 0 })
    }

    pub fn config(&self) -> &PasskeyConfig {
        &self.cfg
    }

    /// Sample `index` with the needle at a random depth (with `vt_hops` > 0, an odd
    /// `index` is a variable-tracking sample).
    pub fn sample(&self, index: u64) -> PasskeyItem {
        if self.cfg.vt_hops > 0 && index % 2 == 1 {
            return self.variable_tracking(index);
        }
        self.generate(index, None)
    }

    /// Variable-tracking sample `index` (see the module docs; `vt_hops` hops, 0 giving a
    /// chain of one variable, which fits every length `new` accepts): `passkey` holds the
    /// value's digits, `needle_pos` the first assignment's VAR, the answer the chain's
    /// variables.
    pub fn variable_tracking(&self, index: u64) -> PasskeyItem {
        let (s, k, hops) = (self.cfg.seq_len, self.cfg.digits, self.cfg.vt_hops);
        let mut rng = SplitMix64::from_parts(&[self.cfg.seed, index, 0x7674]);
        let value: Vec<u8> = (0..k).map(|_| rng.below(10) as u8).collect();
        let digits: Vec<u32> = value.iter().enumerate().map(|(i, &d)| digit_token(i, d)).collect();
        let mut names: Vec<u32> = (0..VARIABLES as u32).map(|v| VAR0 + v).collect();
        rng.shuffle(&mut names);
        names.truncate(hops + 1);
        let mut sentences: Vec<Vec<u32>> = vec![[&[VAR, names[0]][..], &digits].concat()];
        sentences.extend(names.windows(2).map(|w| vec![VAR, w[1], w[0]]));
        let fill = s + 1 - vt_fixed(k, hops);
        let mut at: Vec<usize> = (0..sentences.len()).map(|_| rng.below(fill + 1)).collect();
        at.sort_unstable();
        let mut t = Vec::with_capacity(s + 1);
        t.push(BOS);
        let mut filler = (0..fill).map(|j| FILLER0 + (j % FILLER_BLOCK) as u32);
        let (mut prev, mut needle_pos) = (0, 0);
        for (i, (p, sentence)) in at.into_iter().zip(sentences).enumerate() {
            t.extend(filler.by_ref().take(p - prev));
            if i == 0 {
                needle_pos = t.len();
            }
            t.extend(sentence);
            prev = p;
        }
        t.extend(filler);
        t.push(VT_QUESTION);
        t.extend_from_slice(&digits);
        t.extend_from_slice(&names);
        debug_assert_eq!(t.len(), s + 1);
        let mut sample = Sample::from_tokens(&t, s, PAD);
        let answer_start = s - names.len();
        if self.cfg.loss_on == LossOn::Answer {
            sample.targets[..answer_start].fill(IGNORE);
        }
        PasskeyItem { sample, passkey: value, needle_pos, answer_start }
    }

    /// Sample `index`; `depth` in [0, 1] (0 = right after BOS, 1 = right before the
    /// question) overrides the random needle depth, for depth × length evaluation grids.
    pub fn generate(&self, index: u64, depth: Option<f64>) -> PasskeyItem {
        let s = self.cfg.seq_len;
        let k = self.cfg.digits;
        let mut rng = SplitMix64::from_parts(&[self.cfg.seed, index]);
        let passkey: Vec<u8> = (0..k).map(|_| rng.below(10) as u8).collect();
        // Raw tokens: BOS + filler(F) with the needle (k+2) inside + QUESTION KEY digits (k+2) = S+1.
        let fill = s + 1 - (2 * k + 5);
        let drawn = rng.below(fill + 1);
        let before = match depth {
            Some(d) => ((d.clamp(0.0, 1.0) * fill as f64).round() as usize).min(fill),
            None => drawn,
        };
        let digits: Vec<u32> = passkey.iter().enumerate().map(|(i, &d)| digit_token(i, d)).collect();
        let mut t = Vec::with_capacity(s + 1);
        t.push(BOS);
        let mut filler = (0..fill).map(|j| FILLER0 + (j % FILLER_BLOCK) as u32);
        t.extend(filler.by_ref().take(before));
        let needle_pos = t.len();
        t.push(KEY);
        t.extend_from_slice(&digits);
        t.push(KEY_END);
        t.extend(filler);
        t.push(QUESTION);
        t.push(KEY);
        t.extend_from_slice(&digits);
        debug_assert_eq!(t.len(), s + 1);
        let mut sample = Sample::from_tokens(&t, s, PAD);
        let answer_start = s - k;
        if self.cfg.loss_on == LossOn::Answer {
            sample.targets[..answer_start].fill(IGNORE);
        }
        PasskeyItem { sample, passkey, needle_pos, answer_start }
    }
}

/// Hops of the variable tracking in `synthetic:retrieval` (3 variables a chain).
pub const RETRIEVAL_HOPS: usize = 2;

/// The synthetic datasets by name, for messages.
pub const DATASETS: &str = "synthetic:passkey, synthetic:passkey-answer, synthetic:retrieval, synthetic:retrieval-answer";

/// The loss mask and variable-tracking hops of a synthetic dataset `synthetic:KIND`:
/// `passkey` (every next token), `passkey-answer` (the answer digits only), `retrieval`
/// and `retrieval-answer` (the same, every odd sample variable tracking over
/// [`RETRIEVAL_HOPS`] hops). `None` for any other kind.
pub fn dataset(kind: &str) -> Option<(LossOn, usize)> {
    match kind {
        "passkey" => Some((LossOn::All, 0)),
        "passkey-answer" => Some((LossOn::Answer, 0)),
        "retrieval" => Some((LossOn::All, RETRIEVAL_HOPS)),
        "retrieval-answer" => Some((LossOn::Answer, RETRIEVAL_HOPS)),
        _ => None,
    }
}

/// The variable-tracking hops of an answer-only synthetic dataset named in full
/// (`synthetic:passkey-answer` 0, `synthetic:retrieval-answer` [`RETRIEVAL_HOPS`]);
/// `None` for any other dataset: those are scored on every token.
pub fn answer_only(dataset: &str) -> Option<usize> {
    match dataset.trim().strip_prefix("synthetic:").and_then(self::dataset) {
        Some((LossOn::Answer, hops)) => Some(hops),
        _ => None,
    }
}

/// Raw tokens of a variable-tracking sample other than filler: BOS, the assignments
/// (k + 2, then 3 per hop), the question (1 + k) and the answer (hops + 1).
fn vt_fixed(digits: usize, hops: usize) -> usize {
    1 + (digits + 2) + 3 * hops + (1 + digits) + (hops + 1)
}

/// Samples 0, 1, 2, … in order, forever.
impl Iterator for Passkey {
    type Item = PasskeyItem;
    fn next(&mut self) -> Option<PasskeyItem> {
        let item = self.sample(self.next);
        self.next += 1;
        Some(item)
    }
}
