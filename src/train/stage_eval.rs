//! Evaluation during training (`[eval]` in the run config, `--eval-dataset`): at every
//! stage end, and every `eval.every` global steps when set, the model as it stands is
//! scored on held-out documents and a passkey grid, through the stage's own parallel
//! layout, and the result is one `"event": "eval"` line in metrics.jsonl (and TensorBoard
//! scalars `eval/ppl@L`, `eval/passkey@L`).
//!
//! - Perplexity at the stage's length and at the model's original context (or at
//!   `eval.lengths`): `sliding` scores the first `eval.tokens` tokens of the held-out
//!   stream in windows of L (the same targets at every length), `truncate` each document
//!   of more than L tokens cut to L + 1 (`eval.max_docs` of them);
//!   `synthetic:passkey-answer` scores fresh passkey samples on their answer digits only
//!   (what that dataset trains, as `eval ppl` scores it).
//! - Passkey: `eval.passkey_trials` cases per (length, depth), teacher-forced exact match
//!   of the answer (one forward per case, exact in every mode): the text passkey task of
//!   `eval needle --passkey` when the model has a tokenizer, the demo's token format
//!   otherwise.
//!
//! Every rank takes part: the sequence-parallel ranks of a data-parallel replica share
//! each forward ([`Ranks`]), the replicas split the windows and cases and sum their
//! results. The evaluation runs before the step's checkpoint is written, so a resumed
//! run neither repeats nor loses a line (metrics.jsonl keeps lines up to the checkpoint's
//! step). At the end of a run, `eval.png` plots perplexity against length, one line per
//! evaluated model (every stage's).

use std::path::Path;
use std::sync::Arc;
use std::time::Instant;

use candle_core::{Device, Tensor};
use longctx_attention::comm::Comm;
use serde::{Deserialize, Serialize};

use crate::eval::forward::Ranks;
use crate::eval::needle::{self, TextTask};
use crate::eval::ppl::{self, DocSource, Method, Window};
use crate::model::Llama;
use crate::{Error, Result};

/// `[eval]`: what to evaluate during training (off while `dataset` is empty).
#[derive(Clone, Debug, Serialize, Deserialize, PartialEq)]
#[serde(deny_unknown_fields, default)]
pub struct EvalSection {
    /// Held-out documents (any dataset `train` reads; `synthetic:passkey` draws fresh
    /// synthetic samples). Empty: no evaluation during training.
    pub dataset: String,
    /// Column or field with text or token ids (default: as `train` finds it).
    pub column: Option<String>,
    /// Files of this split of a dataset directory (`*`: every file).
    pub split: String,
    /// Also every this many global steps (0: at stage ends only).
    pub every: u64,
    /// Lengths to score (default: the stage's length and the model's original context).
    pub lengths: Vec<usize>,
    /// `sliding` or `truncate` (see the module docs).
    pub method: Method,
    /// Tokens scored per length by `sliding` (0: twice the longest stage's length).
    pub tokens: usize,
    /// Documents scored per length by `truncate`.
    pub max_docs: usize,
    /// Passkey cases per (length, depth); 0: no passkey grid.
    pub passkey_trials: usize,
    /// Needle depths of the passkey grid, each in [0, 1].
    pub passkey_depths: Vec<f64>,
}

impl Default for EvalSection {
    fn default() -> Self {
        Self {
            dataset: String::new(),
            column: None,
            split: "*".into(),
            every: 0,
            lengths: Vec::new(),
            method: Method::Sliding,
            tokens: 0,
            max_docs: 16,
            passkey_trials: 2,
            passkey_depths: vec![0.0, 0.25, 0.5, 0.75],
        }
    }
}

/// Most tokens `eval.tokens` may ask for (1 GiB of ids held while evaluating).
const MAX_EVAL_TOKENS: usize = 1 << 28;

/// Digits of the passkey (as `eval needle`'s default).
const PASSKEY_DIGITS: usize = 5;

impl EvalSection {
    /// Whether the run evaluates at all.
    pub fn is_on(&self) -> bool {
        !self.dataset.trim().is_empty()
    }

    /// Not [`Self::is_on`] (the config is written without the section then).
    pub fn is_off(&self) -> bool {
        !self.is_on()
    }

    /// The section's values, each in range (`source` names the config for the message).
    pub fn validate(&self, source: &Path) -> Result<()> {
        if !self.is_on() {
            return Ok(());
        }
        let bad = |field: &str, msg: String| Err(Error::config(source, field, msg));
        if self.method == Method::Documents {
            return bad("eval.method", "got \"documents\", expected \"sliding\" or \"truncate\"".into());
        }
        for &l in &self.lengths {
            crate::limits::check_range(source, "eval.lengths", l, 2, crate::limits::MAX_SEQ_LEN)?;
        }
        crate::limits::check_range(source, "eval.tokens", self.tokens, 0, MAX_EVAL_TOKENS)?;
        crate::limits::check_range(source, "eval.max_docs", self.max_docs, 1, 1 << 20)?;
        crate::limits::check_range(source, "eval.passkey_trials", self.passkey_trials, 0, 1000)?;
        crate::limits::check_range(source, "eval.every", self.every, 0, crate::limits::MAX_STEPS)?;
        if self.passkey_trials > 0 {
            needle::check_depths(&self.passkey_depths).map_err(|e| Error::config(source, "eval.passkey_depths", e.to_string()))?;
        }
        if self.split.trim().is_empty() {
            return bad("eval.split", "is empty; name a split, or `*` for every file".into());
        }
        Ok(())
    }

    /// Whether to evaluate after `global_step` (the step just done).
    pub fn due(&self, stage_end: bool, global_step: u64) -> bool {
        self.is_on() && (stage_end || (self.every > 0 && global_step.is_multiple_of(self.every)))
    }

    /// The lengths scored for a stage of `stage_len` tokens of a model trained for
    /// `original` (ascending, distinct). Lengths of `eval.lengths` beyond the stage's are
    /// left for the stages that train that long (this stage's layout is sized for its own).
    pub fn lengths_for(&self, stage_len: usize, original: usize) -> Vec<usize> {
        let mut l = if self.lengths.is_empty() {
            vec![original.min(stage_len), stage_len]
        } else {
            self.lengths.iter().copied().filter(|&l| l <= stage_len).collect()
        };
        l.sort_unstable();
        l.dedup();
        l
    }
}

/// Perplexity of one length.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct PplAt {
    pub length: usize,
    /// `None`: no window of this length (documents too short for `truncate`).
    pub ppl: Option<f64>,
    pub tokens: usize,
}

/// Passkey results of one (length, depth).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct PasskeyAt {
    pub length: usize,
    pub depth: f64,
    pub trials: usize,
    /// Cases whose answer was predicted exactly (teacher-forced).
    pub right: usize,
}

/// One evaluation: a metrics.jsonl line.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct EvalLine {
    /// Always "eval".
    pub event: String,
    pub stage: usize,
    /// Steps of the stage done.
    pub step: u64,
    pub global_step: u64,
    /// Whether this is the stage's last step.
    pub stage_end: bool,
    pub seq_len: usize,
    pub rope_theta: f64,
    pub ppl: Vec<PplAt>,
    pub passkey: Vec<PasskeyAt>,
    /// Right cases over all passkey cases (`None` without a grid).
    pub passkey_rate: Option<f64>,
    pub seconds: f64,
}

impl EvalLine {
    /// "ppl 12.3 at 2K, 9.8 at 16K; passkey 15/16 (93.8 %)".
    pub fn summary(&self) -> String {
        let ppl: Vec<String> = self
            .ppl
            .iter()
            .map(|p| match p.ppl {
                Some(v) => format!("{v:.3} at {}", crate::limits::tokens_label(p.length)),
                None => format!("- at {} (no document that long)", crate::limits::tokens_label(p.length)),
            })
            .collect();
        let right: usize = self.passkey.iter().map(|c| c.right).sum();
        let total: usize = self.passkey.iter().map(|c| c.trials).sum();
        let pk = self.passkey_rate.map_or(String::new(), |r| format!("; passkey {right}/{total} ({:.1} %)", 100.0 * r));
        format!("ppl {}{pk}", ppl.join(", "))
    }
}

/// Where the evaluation stands in the run.
#[derive(Debug, Clone, Copy)]
pub struct EvalAt {
    pub stage: usize,
    pub step: u64,
    pub global_step: u64,
    pub stage_end: bool,
    pub seq_len: usize,
}

/// The evaluation a run carries: its section, the model's original context and the
/// held-out documents (read at the first evaluation).
pub struct StageEval {
    section: EvalSection,
    original: usize,
    /// The longest stage: sizes the held-out stream (and synthetic documents) once, so
    /// that every evaluation of the run scores the same tokens.
    longest: usize,
    seed: u64,
    /// The documents and the token count they were read for.
    docs: Option<(usize, Vec<Vec<u32>>)>,
}

impl StageEval {
    /// `original`: the start model's trained context (max_position_embeddings);
    /// `longest`: the run's longest stage. The dataset is looked up now, so that a wrong
    /// path fails before training, not at the first stage's end.
    pub fn new(section: EvalSection, original: usize, longest: usize, seed: u64) -> Result<Self> {
        let d = section.dataset.trim();
        match d.strip_prefix("synthetic:") {
            Some(kind) if crate::data::synthetic::dataset(kind).is_some() => {}
            Some(_) => {
                return Err(Error::Setting(format!(
                    "eval.dataset `{d}`: unknown synthetic dataset; use one of {}, or held-out files",
                    crate::data::synthetic::DATASETS
                )))
            }
            None => {
                crate::data::source::resolve(d, None, Some(section.split.as_str()), &crate::hub::HubOptions::from_env())
                    .map_err(|e| Error::Setting(format!("eval.dataset (--eval-dataset) `{d}`: {e}")))?;
            }
        }
        Ok(Self { section, original, longest: longest.max(2), seed, docs: None })
    }

    /// Scores `model` (every rank calls it alike; `dp` sums the replicas' shares).
    pub fn run(
        &mut self,
        model: &Llama,
        tokenizer: Option<&tokenizers::Tokenizer>,
        ranks: &Ranks,
        dp: &Arc<dyn Comm>,
        at: EvalAt,
    ) -> Result<EvalLine> {
        let t0 = Instant::now();
        let lengths = self.section.lengths_for(at.seq_len, self.original);
        let longest = self.longest;
        let section = self.section.clone();
        let answers_only = crate::data::synthetic::answer_only(&section.dataset);
        let (seed, vocab) = (self.seed ^ 0x5eed_e7a1, model.cfg.vocab_size);
        let docs = if answers_only.is_some() { &Vec::new() } else { self.docs(model, tokenizer, longest)? };
        let device = model.embed_tokens.embeddings().device().clone();
        let mut ppl_out = Vec::with_capacity(lengths.len());
        for &len in &lengths {
            let windows = if let Some(hops) = answers_only {
                // the answers only, as that dataset trains (and `eval ppl` scores it)
                let tokens = if section.tokens == 0 { 2 * longest } else { section.tokens };
                ppl::passkey_answer_windows(vocab, seed, len, tokens.div_ceil(len), hops)?
            } else {
                windows(&section, docs, len, longest)
            };
            let mine: Vec<Window> = windows.into_iter().enumerate().filter(|(i, _)| i % dp.world() == dp.rank()).map(|(_, w)| w).collect();
            let (sum, n) = ppl::score_windows(ranks, model, &mine, || {})?;
            let total = sum_over(dp, &[sum, n as f64], &device)?;
            let n = total[1].round() as usize;
            let ppl = (n > 0).then(|| (total[0] / n as f64).exp());
            ppl_out.push(PplAt { length: len, ppl, tokens: n });
        }
        let passkey = self.passkey(model, tokenizer, ranks, dp, &lengths, &device)?;
        let right: usize = passkey.iter().map(|c| c.right).sum();
        let total: usize = passkey.iter().map(|c| c.trials).sum();
        Ok(EvalLine {
            event: "eval".into(),
            stage: at.stage,
            step: at.step,
            global_step: at.global_step,
            stage_end: at.stage_end,
            seq_len: at.seq_len,
            rope_theta: model.cfg.rope_theta,
            ppl: ppl_out,
            passkey_rate: (total > 0).then(|| right as f64 / total as f64),
            passkey,
            seconds: t0.elapsed().as_secs_f64(),
        })
    }

    /// The held-out documents, read at the first evaluation for the run's longest stage.
    fn docs(&mut self, model: &Llama, tokenizer: Option<&tokenizers::Tokenizer>, longest: usize) -> Result<&Vec<Vec<u32>>> {
        let want = match self.section.method {
            Method::Truncate => longest,
            _ => (if self.section.tokens == 0 { 2 * longest } else { self.section.tokens }) + 1,
        };
        if self.docs.is_none() {
            let truncate = self.section.method == Method::Truncate;
            let src = DocSource {
                dataset: self.section.dataset.clone(),
                column: self.section.column.clone(),
                split: self.section.split.clone(),
                token_width: crate::data::source::TokenWidth::U16, // (raw token files: as `train` reads them)
                // `truncate` needs documents of every length: read up to 64 per kept one.
                max_tokens: if truncate { usize::MAX } else { want },
                max_docs: if truncate { self.section.max_docs.saturating_mul(64) } else { usize::MAX },
                seed: self.seed ^ 0x5eed_e7a1,
            };
            let docs = ppl::read_docs(&src, model, tokenizer, longest)
                .map_err(|e| Error::Setting(format!("eval.dataset `{}`: {e}", self.section.dataset)))?;
            self.docs = Some((want, docs));
        }
        self.docs.as_ref().map(|(_, d)| d).ok_or_else(|| Error::Setting("eval documents".into()))
    }

    /// The passkey grid: cases split over the replicas, right answers summed.
    fn passkey(
        &self,
        model: &Llama,
        tokenizer: Option<&tokenizers::Tokenizer>,
        ranks: &Ranks,
        dp: &Arc<dyn Comm>,
        lengths: &[usize],
        device: &Device,
    ) -> Result<Vec<PasskeyAt>> {
        let s = &self.section;
        if s.passkey_trials == 0 {
            return Ok(Vec::new());
        }
        let task = match tokenizer {
            Some(tok) => Some(TextTask::new(tok, None, true, PASSKEY_DIGITS, 0)?),
            None => None,
        };
        let min = if task.is_some() { 32 } else { 2 * PASSKEY_DIGITS + 4 };
        let mut cells = Vec::new();
        let mut case_no = 0usize;
        for &len in lengths.iter().filter(|&&l| l >= min) {
            for &depth in &s.passkey_depths {
                let mut right = 0.0;
                for t in 0..s.passkey_trials {
                    case_no += 1;
                    if case_no % dp.world() != dp.rank() {
                        continue;
                    }
                    let index = ((len as u64) << 20) ^ (((depth * 1000.0) as u64) << 8) ^ t as u64;
                    let case = match &task {
                        Some(task) => task.case(len, depth, self.seed, index)?,
                        None => needle::token_case(len, depth, PASSKEY_DIGITS, model.cfg.vocab_size, self.seed, index, 0)?,
                    };
                    let scores = ranks.token_scores(model, &case.sample.ids, &case.sample.targets)?;
                    right += f64::from(u8::from(needle::exact_match(&scores.argmax[case.answer_start..], &case.answer)));
                }
                cells.push(PasskeyAt { length: len, depth, trials: s.passkey_trials, right: right as usize });
            }
        }
        let rights: Vec<f64> = cells.iter().map(|c| c.right as f64).collect();
        let summed = sum_over(dp, &rights, device)?;
        for (c, r) in cells.iter_mut().zip(summed) {
            c.right = r.round() as usize;
        }
        Ok(cells)
    }
}

/// The scoring windows of one length (see the module docs).
fn windows(s: &EvalSection, docs: &[Vec<u32>], len: usize, longest: usize) -> Vec<Window> {
    match s.method {
        Method::Truncate => ppl::truncated_windows(docs, len, s.max_docs),
        _ => {
            let tokens = if s.tokens == 0 { 2 * longest } else { s.tokens };
            let stream: Vec<u32> = docs.iter().flatten().copied().take(tokens + 1).collect();
            ppl::sliding_windows(&stream, len, len, tokens)
        }
    }
}

/// Element-wise sum over the ranks of `comm`, in f64.
fn sum_over(comm: &Arc<dyn Comm>, xs: &[f64], device: &Device) -> Result<Vec<f64>> {
    if comm.world() == 1 || xs.is_empty() {
        return Ok(xs.to_vec());
    }
    let t = Tensor::from_slice(xs, xs.len(), device)?;
    Ok(comm.all_reduce_sum(&t)?.to_device(&Device::Cpu)?.to_vec1::<f64>()?)
}

/// The evaluation lines of `<output_dir>/metrics.jsonl`, in order.
pub fn read_lines(metrics: &Path) -> Result<Vec<EvalLine>> {
    let text = std::fs::read_to_string(metrics).map_err(|e| Error::io(metrics, e))?;
    Ok(text.lines().filter(|l| l.contains("\"event\":\"eval\"")).filter_map(|l| serde_json::from_str::<EvalLine>(l).ok()).collect())
}

/// `eval.png`: perplexity against length, one line per evaluation (every stage's model);
/// `false` (nothing written) when no line has a perplexity.
pub fn plot(lines: &[EvalLine], path: &Path) -> Result<bool> {
    let series: Vec<(String, Vec<(f64, f64)>)> = lines
        .iter()
        .map(|l| {
            let at = if l.stage_end { format!("stage {} end", l.stage) } else { format!("stage {} step {}", l.stage, l.step) };
            let pk = l.passkey_rate.map_or(String::new(), |r| format!(", passkey {:.0} %", 100.0 * r));
            let pts = l.ppl.iter().filter_map(|p| Some((p.length as f64, p.ppl?))).collect();
            (format!("{at} (θ {:.0e}{pk})", l.rope_theta), pts)
        })
        .filter(|(_, p): &(String, Vec<(f64, f64)>)| !p.is_empty())
        .collect();
    if series.is_empty() {
        return Ok(false);
    }
    crate::eval::plot::lines(
        path,
        "held-out perplexity during training, per evaluated model",
        "context length (tokens)",
        "perplexity",
        &series,
    )?;
    Ok(true)
}

/// `<output_dir>/eval.png` from the run's metrics.jsonl (written atomically); nothing
/// when no evaluation has a perplexity.
pub fn write_plot(output_dir: &Path) -> Result<()> {
    let lines = read_lines(&output_dir.join("metrics.jsonl"))?;
    let path = output_dir.join("eval.png");
    let tmp = crate::eval::output::temp_sibling(&path);
    if plot(&lines, &tmp)? {
        crate::eval::output::commit(&tmp, &path)?;
        eprintln!("evaluations during training: {} (perplexity against length, one line per evaluated model)", path.display());
    }
    Ok(())
}
