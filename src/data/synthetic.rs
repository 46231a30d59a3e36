//! Synthetic passkey retrieval: long-context data that needs no download and no
//! tokenizer, for the demo job, CI and quick checks that long-range attention works.
//!
//! Built-in vocabulary (ids; `vocab` ≥ 32, the model's vocab must be at least this):
//! ```text
//! 0 PAD   1 BOS   2 EOS
//! 3..=12  digits 0..9           (DIGIT0 + d)
//! 13 KEY       "the passkey is"  (opens the needle, and again the answer)
//! 14 KEY_END   "remember it."    (closes the needle)
//! 15 QUESTION  "what is the passkey?"
//! 16..vocab    filler words
//! ```
//! A sample is S+1 raw tokens `t` (S = seq_len), `ids = t[..S]`, `targets = t[1..]`:
//! ```text
//! BOS  filler…  KEY d1..dk KEY_END  filler…  QUESTION KEY d1..dk
//! ```
//! The filler is a pattern of P = FILLER_PERIOD distinct filler words, drawn per sample,
//! repeated (like the "The grass is green. The sky is blue." of the passkey papers),
//! interrupted by the needle at a uniformly random depth; the k digits are uniform.
//! Why it is learnable by a tiny model: answering is an induction task (at the second
//! KEY, find the first KEY and copy what followed it), and with [`LossOn::All`] the
//! repeated random filler trains exactly that induction mechanism on almost every
//! position (after the first period the filler is predictable only by copying).
//! The answer digits end the sample, so with [`LossOn::Answer`] only the last k targets
//! count. Sample `i` depends only on `(seed, i)`: random access, and resuming is exact.

use serde::{Deserialize, Serialize};

use super::packing::{Sample, IGNORE};
use super::shuffle::SplitMix64;
use crate::{Error, Result};

pub const PAD: u32 = 0;
pub const BOS: u32 = 1;
pub const EOS: u32 = 2;
pub const DIGIT0: u32 = 3;
pub const KEY: u32 = 13;
pub const KEY_END: u32 = 14;
pub const QUESTION: u32 = 15;
pub const FILLER0: u32 = 16;
/// Length of the repeated filler pattern.
pub const FILLER_PERIOD: usize = 16;
/// Smallest accepted vocabulary.
pub const MIN_VOCAB: usize = 32;

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
    /// Vocabulary size of the model (≥ 32): ids 16..vocab are filler words.
    #[serde(default = "default_vocab")]
    pub vocab: usize,
    pub seq_len: usize,
    /// Passkey length k (1..=16).
    #[serde(default = "default_digits")]
    pub digits: usize,
    #[serde(default)]
    pub seed: u64,
    #[serde(default)]
    pub loss_on: LossOn,
}

fn default_vocab() -> usize {
    256
}
fn default_digits() -> usize {
    5
}

impl PasskeyConfig {
    pub fn new(seq_len: usize) -> Self {
        Self { vocab: default_vocab(), seq_len, digits: default_digits(), seed: 0, loss_on: LossOn::Answer }
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
                "passkey: vocab {} must be at least {MIN_VOCAB} (ids 0..=15 are reserved, 16.. are filler)",
                cfg.vocab
            )));
        }
        if !(1..=16).contains(&cfg.digits) {
            return Err(Error::Setting(format!("passkey: digits {} must be in 1..=16", cfg.digits)));
        }
        let min = 2 * cfg.digits + 4;
        if cfg.seq_len < min {
            return Err(Error::Setting(format!(
                "passkey: seq_len {} is too short for {} digits; it must be at least {min}",
                cfg.seq_len, cfg.digits
            )));
        }
        Ok(Self { cfg, next: 0 })
    }

    pub fn config(&self) -> &PasskeyConfig {
        &self.cfg
    }

    /// Sample `index` with the needle at a random depth.
    pub fn sample(&self, index: u64) -> PasskeyItem {
        self.generate(index, None)
    }

    /// Sample `index`; `depth` in [0, 1] (0 = right after BOS, 1 = right before the
    /// question) overrides the random needle depth, for depth × length evaluation grids.
    pub fn generate(&self, index: u64, depth: Option<f64>) -> PasskeyItem {
        let s = self.cfg.seq_len;
        let k = self.cfg.digits;
        let mut rng = SplitMix64::from_parts(&[self.cfg.seed, index]);
        let passkey: Vec<u8> = (0..k).map(|_| rng.below(10) as u8).collect();
        // P distinct filler words (partial Fisher–Yates over the filler ids).
        let mut words: Vec<u32> = (FILLER0..self.cfg.vocab as u32).collect();
        for i in 0..FILLER_PERIOD {
            let j = i + rng.below(words.len() - i);
            words.swap(i, j);
        }
        words.truncate(FILLER_PERIOD);
        // Raw tokens: BOS + filler(F) with the needle (k+2) inside + QUESTION KEY digits (k+2) = S+1.
        let fill = s + 1 - (2 * k + 5);
        let drawn = rng.below(fill + 1);
        let before = match depth {
            Some(d) => ((d.clamp(0.0, 1.0) * fill as f64).round() as usize).min(fill),
            None => drawn,
        };
        let digit = |d: &u8| DIGIT0 + *d as u32;
        let mut t = Vec::with_capacity(s + 1);
        t.push(BOS);
        let mut filler = (0..fill).map(|j| words[j % FILLER_PERIOD]);
        t.extend(filler.by_ref().take(before));
        let needle_pos = t.len();
        t.push(KEY);
        t.extend(passkey.iter().map(digit));
        t.push(KEY_END);
        t.extend(filler);
        t.push(QUESTION);
        t.push(KEY);
        t.extend(passkey.iter().map(digit));
        debug_assert_eq!(t.len(), s + 1);
        let mut sample = Sample::from_tokens(&t, s, PAD);
        let answer_start = s - k;
        if self.cfg.loss_on == LossOn::Answer {
            sample.targets[..answer_start].fill(IGNORE);
        }
        PasskeyItem { sample, passkey, needle_pos, answer_start }
    }
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
