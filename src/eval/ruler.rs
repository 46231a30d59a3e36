//! RULER-style synthetic tasks over a grid of lengths, on a model with `tokenizer.json`.
//!
//! Every case is `L + 1` text tokens: the tokenizer's special prefix, one sentence stating
//! the task, a haystack (a user's text or [`FILLER_TEXT`], repeated to the length) with the
//! task's sentences put at random places, the question, and the answer. The model reads
//! the first `L`; the answer is the last targets. Tasks ([`Task`]):
//! - `single`: one needle "The special magic number for KEY is: N.", asked for by its key;
//! - `multikey`: several needles with different keys, asked for one of them;
//! - `multivalue`: several needles with one key and different numbers, all asked for;
//! - `multiquery`: several needles with different keys, all keys asked at once;
//! - `vt` (variable tracking): a chain `VAR A = N.`, `VAR B = VAR A.`, … in that order in
//!   the text, asked for every variable that holds N;
//! - `cwe` (common-words extraction): no haystack but a numbered list of words in which
//!   a few common words occur many times and many uncommon words a few times, asked for
//!   the common words ([`crate::eval::words::common_list`]);
//! - `fwe` (frequent-words extraction): no haystack but coded words with Zipf counts,
//!   asked for the three most frequent ones after the noise word `...`
//!   ([`crate::eval::words::frequent_text`]).
//!
//! The list or text of `cwe` and `fwe` fills the length; what one more item would not fit
//! into is filled with a pad token after the task's sentence ([`crate::eval::words::pad_token`]).
//!
//! A model without `tokenizer.json` (the demo's export) gets the tasks in the built-in token
//! vocabulary it trained on ([`token_case`], [`crate::data::synthetic`]): `single` (the
//! passkey sample) and `vt` (the variable-tracking sample of `synthetic:retrieval`); its
//! recall counts the expected token runs in the greedy output ([`recall_ids`]).
//!
//! Scores per case: teacher-forced exact match and share of answer tokens right (one
//! forward, any parallel mode), and the recall of the expected strings in the greedy
//! output ([`recall`]: each expected string found in it, case-insensitive, counts
//! `1 / expected`), the string-match score of RULER.

use serde::{Deserialize, Serialize};

use super::needle::{encode, number, FILLER_TEXT};
use super::words;
use crate::data::shuffle::SplitMix64;
use crate::data::Sample;
use crate::{Error, Result};

/// One task of the suite.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Task {
    Single,
    MultiKey,
    MultiValue,
    MultiQuery,
    Vt,
    Cwe,
    Fwe,
}

impl Task {
    pub const ALL: [Task; 7] = [Task::Single, Task::MultiKey, Task::MultiValue, Task::MultiQuery, Task::Vt, Task::Cwe, Task::Fwe];

    /// The task's name in `--tasks`, the files and the plots.
    pub fn name(self) -> &'static str {
        match self {
            Task::Single => "single",
            Task::MultiKey => "multikey",
            Task::MultiValue => "multivalue",
            Task::MultiQuery => "multiquery",
            Task::Vt => "vt",
            Task::Cwe => "cwe",
            Task::Fwe => "fwe",
        }
    }

    /// A task by its name (also `niah_single`, `niah_multikey`, …, `variable_tracking`,
    /// `common_words_extraction`, `freq_words_extraction`, `frequent_words_extraction`).
    pub fn parse(s: &str) -> Result<Task> {
        let t = s.trim().to_ascii_lowercase().replace(['-', '_'], "");
        let t = t.strip_prefix("niah").unwrap_or(&t);
        Ok(match t {
            "single" => Task::Single,
            "multikey" => Task::MultiKey,
            "multivalue" => Task::MultiValue,
            "multiquery" => Task::MultiQuery,
            "vt" | "variabletracking" => Task::Vt,
            "cwe" | "commonwords" | "commonwordsextraction" => Task::Cwe,
            "fwe" | "freqwords" | "frequentwords" | "freqwordsextraction" | "frequentwordsextraction" => Task::Fwe,
            _ => {
                let names: Vec<&str> = Task::ALL.iter().map(|t| t.name()).collect();
                return Err(Error::config("--tasks", "tasks", format!("unknown task `{s}`, expected one of {}", names.join(", "))));
            }
        })
    }
}

/// RULER's string-match score of one output: the share of `expected` strings that occur
/// in `output` (case-insensitive); 0 when nothing is expected.
pub fn recall(output: &str, expected: &[String]) -> f64 {
    if expected.is_empty() {
        return 0.0;
    }
    let out = output.to_lowercase();
    expected.iter().filter(|e| out.contains(&e.to_lowercase())).count() as f64 / expected.len() as f64
}

/// The token-format twin of [`recall`]: the share of `expected` token runs that occur
/// (contiguous, in order within a run) in `output`; 0 when nothing is expected.
pub fn recall_ids(output: &[u32], expected: &[Vec<u32>]) -> f64 {
    if expected.is_empty() {
        return 0.0;
    }
    let found = |e: &Vec<u32>| !e.is_empty() && output.windows(e.len()).any(|w| w == e.as_slice());
    expected.iter().filter(|e| found(e)).count() as f64 / expected.len() as f64
}

/// The tasks of the built-in token vocabulary.
pub const TOKEN_TASKS: [Task; 2] = [Task::Single, Task::Vt];

/// A case of `task` in the built-in token vocabulary (a model of `vocab` ids without a
/// tokenizer): `single` is the passkey sample of `len` inputs with `digits` digits, `vt`
/// the variable-tracking sample over `hops` hops ([`crate::data::synthetic`]). Each expected
/// string is a token run: the whole number for `single`, each variable for `vt`.
pub fn token_case(task: Task, len: usize, vocab: usize, digits: usize, hops: usize, seed: u64, index: u64) -> Result<TaskCase> {
    use crate::data::synthetic::{LossOn, Passkey, PasskeyConfig, VAR0};
    if !TOKEN_TASKS.contains(&task) {
        return Err(Error::config(
            "--tasks",
            "tasks",
            format!(
                "task {} needs a model with tokenizer.json; in the built-in token vocabulary (a model without one, like the \
                 demo's export) the tasks are single and vt",
                task.name()
            ),
        ));
    }
    if !(1..=crate::data::synthetic::MAX_DIGITS).contains(&digits) {
        return Err(Error::config(
            "--digits",
            "digits",
            format!("got {digits}, expected 1 to 8 in the token format (the places with digit ids)"),
        ));
    }
    if !(1..=crate::data::synthetic::MAX_HOPS).contains(&hops) {
        return Err(Error::config("--hops", "hops", format!("got {hops}, expected 1 to 15 in the token format (16 variable names)")));
    }
    let cfg =
        PasskeyConfig { vocab, seq_len: len, digits, seed, loss_on: LossOn::Answer, vt_hops: if task == Task::Vt { hops } else { 0 } };
    let gen = Passkey::new(cfg).map_err(|e| match e {
        Error::Setting(m) if m.contains("too short") => too_short(task, len, m),
        e => e,
    })?;
    let item = if task == Task::Vt { gen.variable_tracking(index) } else { gen.generate(index, None) };
    let answer: Vec<u32> = item.sample.targets[item.answer_start..].iter().map(|&t| t as u32).collect();
    let (expected, expected_ids, question) = if task == Task::Vt {
        let names = answer.iter().map(|&v| format!("V{}", v - VAR0)).collect();
        (names, answer.iter().map(|&v| vec![v]).collect(), "<vt-question> value".to_string())
    } else {
        (vec![item.passkey.iter().map(|d| char::from(b'0' + d)).collect()], vec![answer.clone()], "<question> <key>".to_string())
    };
    Ok(TaskCase { task, sample: item.sample, answer_start: item.answer_start, answer, expected, expected_ids, question })
}

/// One case of a task.
#[derive(Debug, Clone, PartialEq)]
pub struct TaskCase {
    pub task: Task,
    pub sample: Sample,
    /// Index of the first answer target: `targets[answer_start..]` is the answer.
    pub answer_start: usize,
    pub answer: Vec<u32>,
    /// The strings the output must hold (numbers, or variable names), in answer order.
    pub expected: Vec<String>,
    /// Token format only ([`token_case`]): the token runs the output must hold, one per
    /// expected string; empty for text cases, which are scored on the decoded text.
    pub expected_ids: Vec<Vec<u32>>,
    /// The question as text (what the prompt ends with).
    pub question: String,
}

impl TaskCase {
    /// What generation starts from: every token before the answer (ends with the question).
    pub fn prompt(&self) -> Vec<u32> {
        self.sample.ids[..=self.answer_start].to_vec()
    }
}

/// Words of the keys (`amber-falcon`), our own lists.
const KEY_ADJ: [&str; 16] = [
    "amber", "brisk", "calm", "dusty", "eager", "faded", "gentle", "hollow", "icy", "jolly", "keen", "lunar", "misty", "noble", "olive",
    "proud",
];
const KEY_NOUN: [&str; 16] = [
    "falcon", "harbor", "meadow", "lantern", "glacier", "orchard", "canyon", "violin", "compass", "pebble", "thistle", "beacon", "saddle",
    "willow", "kettle", "ribbon",
];

/// The text pieces of the tasks: the haystack and the sizes of the tasks.
#[derive(Debug, Clone)]
pub struct RulerTask {
    /// Haystack token ids (repeated as needed); never empty.
    pub haystack: Vec<u32>,
    pub digits: usize,
    /// Needles of multikey, multivalue and multiquery (the keys or values there are).
    pub needles: usize,
    /// Variable tracking: assignments after the first one (the chain has `hops + 1` variables).
    pub hops: usize,
    /// Common-words extraction: the common words asked for ([`RulerTask::with_common_words`]).
    pub common_words: usize,
    /// The special tokens the tokenizer puts before a text.
    pub prefix: Vec<u32>,
    tok: tokenizers::Tokenizer,
}

/// RULER's number of common words.
pub const COMMON_WORDS: usize = 10;

/// `a, b and c`.
fn join_and(items: &[String]) -> String {
    match items {
        [] => String::new(),
        [a] => a.clone(),
        [init @ .., last] => format!("{} and {last}", init.join(", ")),
    }
}

impl RulerTask {
    /// The haystack: `text`, or [`FILLER_TEXT`] when `None`; an empty one is an error.
    pub fn new(tok: &tokenizers::Tokenizer, text: Option<&str>, digits: usize, needles: usize, hops: usize) -> Result<Self> {
        let (haystack, prefix) = crate::eval::needle::text_basics(tok, text, FILLER_TEXT, digits)?;
        if !(2..=KEY_ADJ.len() * KEY_NOUN.len()).contains(&needles) {
            return Err(Error::config("--needles", "needles", format!("got {needles}, expected 2 to 256")));
        }
        if !(1..=64).contains(&hops) {
            return Err(Error::config("--hops", "hops", format!("got {hops}, expected 1 to 64")));
        }
        Ok(Self { haystack, digits, needles, hops, common_words: COMMON_WORDS, prefix, tok: tok.clone() })
    }

    /// Sets the common words of `cwe` (1 to 100; [`COMMON_WORDS`] unless set).
    pub fn with_common_words(mut self, n: usize) -> Result<Self> {
        if !(1..=100).contains(&n) {
            return Err(Error::config("--common-words", "common_words", format!("got {n}, expected 1 to 100 (RULER asks for 10)")));
        }
        self.common_words = n;
        Ok(self)
    }

    /// `n` distinct keys.
    fn keys(rng: &mut SplitMix64, n: usize) -> Vec<String> {
        let mut out: Vec<String> = Vec::with_capacity(n);
        while out.len() < n {
            let k = format!("{}-{}", KEY_ADJ[rng.below(KEY_ADJ.len())], KEY_NOUN[rng.below(KEY_NOUN.len())]);
            if !out.contains(&k) {
                out.push(k);
            }
        }
        out
    }

    /// `n` distinct numbers of the task's digits.
    fn values(&self, rng: &mut SplitMix64, n: usize) -> Vec<String> {
        let mut out: Vec<String> = Vec::with_capacity(n);
        let mut tries = 0;
        while out.len() < n {
            let v = number(rng, self.digits);
            tries += 1;
            if !out.contains(&v) || tries > 1000 {
                out.push(v);
            }
        }
        out
    }

    /// `n` distinct variable names of five capital letters.
    fn variables(rng: &mut SplitMix64, n: usize) -> Vec<String> {
        let mut out: Vec<String> = Vec::with_capacity(n);
        while out.len() < n {
            let v: String = (0..5).map(|_| char::from(b'A' + rng.below(26) as u8)).collect();
            if !out.contains(&v) {
                out.push(v);
            }
        }
        out
    }

    /// The task's header, its sentences (in text order), the question, the answer text and
    /// the expected strings (the haystack tasks; `cwe` and `fwe` are [`RulerTask::words_case`]).
    fn pieces(&self, task: Task, rng: &mut SplitMix64) -> (&'static str, Vec<String>, String, String, Vec<String>) {
        let needle = |k: &str, v: &str| format!(" The special magic number for {k} is: {v}. ");
        let niah = "Some special magic numbers are hidden in the long text below, each one for a key. Remember them: you will be asked about them at the end.";
        let ask_one =
            |k: &str| format!(" What is the special magic number for {k} mentioned in the text? The special magic number for {k} is:");
        match task {
            Task::Single => {
                let (k, v) = (Self::keys(rng, 1).remove(0), self.values(rng, 1).remove(0));
                (niah, vec![needle(&k, &v)], ask_one(&k), format!(" {v}"), vec![v])
            }
            Task::MultiKey => {
                let (ks, vs) = (Self::keys(rng, self.needles), self.values(rng, self.needles));
                let q = rng.below(self.needles);
                let sentences = ks.iter().zip(&vs).map(|(k, v)| needle(k, v)).collect();
                (niah, sentences, ask_one(&ks[q]), format!(" {}", vs[q]), vec![vs[q].clone()])
            }
            Task::MultiValue => {
                let (k, vs) = (Self::keys(rng, 1).remove(0), self.values(rng, self.needles));
                let sentences = vs.iter().map(|v| needle(&k, v)).collect();
                let q = format!(
                    " What are all the special magic numbers for {k} mentioned in the text? The special magic numbers for {k} are:"
                );
                (niah, sentences, q, format!(" {}", vs.join(", ")), vs)
            }
            Task::MultiQuery => {
                let (ks, vs) = (Self::keys(rng, self.needles), self.values(rng, self.needles));
                let sentences = ks.iter().zip(&vs).map(|(k, v)| needle(k, v)).collect();
                // Asked in another order than the text's.
                let mut order: Vec<usize> = (0..self.needles).collect();
                rng.shuffle(&mut order);
                let asked: Vec<String> = order.iter().map(|&i| ks[i].clone()).collect();
                let want: Vec<String> = order.iter().map(|&i| vs[i].clone()).collect();
                let keys = join_and(&asked);
                let q = format!(
                    " What are the special magic numbers for {keys} mentioned in the text? The special magic numbers for {keys} are:"
                );
                (niah, sentences, q, format!(" {}", want.join(", ")), want)
            }
            Task::Vt => {
                let names = Self::variables(rng, self.hops + 1);
                let v = self.values(rng, 1).remove(0);
                let mut sentences = vec![format!(" VAR {} = {v}. ", names[0])];
                sentences.extend(names.windows(2).map(|w| format!(" VAR {} = VAR {}. ", w[1], w[0])));
                let header =
                    "Variable assignments are hidden in the long text below. Keep track of them: you will be asked about them at the end.";
                let q = format!(
                    " Which variables hold the value {v} in the text, assigned directly or through other variables? The variables that hold {v} are:"
                );
                (header, sentences, q, format!(" {}", names.join(", ")), names)
            }
            Task::Cwe | Task::Fwe => unreachable!("the words tasks have no haystack pieces"),
        }
    }

    /// The tokens left for the body of a case of `len` inputs once `fixed` tokens are taken
    /// (`len + 1 - fixed`); an error naming the task when there are none.
    fn budget(task: Task, len: usize, fixed: usize) -> Result<usize> {
        if len < fixed {
            return Err(too_short(task, len, format!("its sentences, question and answer take {fixed} tokens")));
        }
        Ok(len + 1 - fixed)
    }

    /// The case from its parts: prefix, header, body, question, answer (`len + 1` tokens).
    fn assemble(&self, task: Task, len: usize, parts: [&[u32]; 4], expected: Vec<String>, question: String) -> TaskCase {
        let mut raw: Vec<u32> = self.prefix.clone();
        for p in parts {
            raw.extend_from_slice(p);
        }
        debug_assert_eq!(raw.len(), len + 1);
        let answer = parts[3];
        let answer_start = len - answer.len();
        TaskCase {
            task,
            sample: Sample::from_tokens(&raw, len, 0),
            answer_start,
            answer: answer.to_vec(),
            expected,
            expected_ids: Vec::new(),
            question,
        }
    }

    /// A case of `task` with `len` inputs: the sentences at random places of the haystack,
    /// in their order (the chain of `vt` in order); `cwe` and `fwe` fill the length with
    /// their list or text instead ([`RulerTask::words_case`]).
    pub fn case(&self, task: Task, len: usize, seed: u64, index: u64) -> Result<TaskCase> {
        let tok = &self.tok;
        let mut rng = SplitMix64::from_parts(&[seed, index, 0x7275_6c65]);
        if matches!(task, Task::Cwe | Task::Fwe) {
            return self.words_case(task, len, &mut rng);
        }
        let (header, sentences, question, answer_text, expected) = self.pieces(task, &mut rng);
        let header_ids = encode(tok, header)?;
        let sentence_ids: Vec<Vec<u32>> = sentences.iter().map(|s| encode(tok, s)).collect::<Result<_>>()?;
        let q_ids = encode(tok, &question)?;
        let answer = crate::eval::needle::answer_after(tok, &q_ids, &question, &answer_text)?;
        let fixed = self.prefix.len() + header_ids.len() + sentence_ids.iter().map(Vec::len).sum::<usize>() + q_ids.len() + answer.len();
        let hay_len = Self::budget(task, len, fixed)?;
        let hay: Vec<u32> = self.haystack.iter().cycle().take(hay_len).copied().collect();
        let mut at: Vec<usize> = (0..sentence_ids.len()).map(|_| rng.below(hay_len + 1)).collect();
        at.sort_unstable();
        let mut body: Vec<u32> = Vec::with_capacity(hay_len + fixed);
        let mut prev = 0;
        for (p, ids) in at.into_iter().zip(sentence_ids) {
            body.extend_from_slice(&hay[prev..p]);
            body.extend(ids);
            prev = p;
        }
        body.extend_from_slice(&hay[prev..]);
        Ok(self.assemble(task, len, [&header_ids, &body, &q_ids, &answer], expected, question))
    }

    /// A case of `cwe` or `fwe`: the task's sentence, pad tokens for what no further item
    /// fits into, the list (`cwe`) or coded text (`fwe`) filling the rest, the question.
    fn words_case(&self, task: Task, len: usize, rng: &mut SplitMix64) -> Result<TaskCase> {
        let tok = &self.tok;
        let n = self.common_words;
        // The words: the shuffled pool (`cwe`, the first `n` common) or the coded vocabulary
        // in rank order (`fwe`, the noise word first).
        let (header, question, expected, pool, coded) = if task == Task::Cwe {
            let mut pool = words::WORDS.to_vec();
            rng.shuffle(&mut pool);
            let header = "Below is a numbered list of words. Some words appear in it more often than the others: \
                          remember the ones that appear most often, you will be asked for them at the end.";
            let question = format!(
                " Question: What are the {n} most common words in the numbered list above? Answer: The {n} words that appear most often in the list are:"
            );
            (header, question, pool.iter().take(n).map(|w| w.to_string()).collect::<Vec<_>>(), pool, Vec::new())
        } else {
            let vocab = words::coded_vocab(rng, (len / 50).max(16));
            let header = "Read the coded text below and keep count of how often each coded word appears: you will be asked \
                          for the three most frequent ones at the end. Ignore the dots '...'.";
            let question = " Question: Ignoring the dots '...', what are the three most frequent coded words in the text above? \
                            Answer: The three most frequent coded words in the text are:"
                .to_string();
            (header, question, vocab[1..=words::FREQUENT].to_vec(), Vec::new(), vocab)
        };
        let header_ids = encode(tok, header)?;
        let q_ids = encode(tok, &question)?;
        let answer = crate::eval::needle::answer_after(tok, &q_ids, &question, &format!(" {}", expected.join(", ")))?;
        let budget = Self::budget(task, len, self.prefix.len() + header_ids.len() + q_ids.len() + answer.len())?;
        let body = if task == Task::Cwe {
            words::common_list(tok, &pool[..n], &pool[n..], budget, rng)?.map(|l| l.ids)
        } else {
            words::frequent_text(tok, &coded, budget, rng)?
        };
        let Some(list) = body else {
            let what = if task == Task::Cwe {
                format!("its {n} common words, each twice, and as many uncommon words do not fit into {budget} tokens")
            } else {
                format!("{budget} tokens leave the three most frequent coded words no more frequent than the others")
            };
            return Err(too_short(task, len, what));
        };
        let mut body = vec![words::pad_token(tok)?; budget - list.len()];
        body.extend(list);
        Ok(self.assemble(task, len, [&header_ids, &body, &q_ids, &answer], expected, question))
    }
}

/// `true` for the error of a length too short for a task ([`RulerTask::case`]).
pub fn is_too_short(e: &Error) -> bool {
    matches!(e, Error::Config { field, msg, .. } if field == "lengths" && msg.contains("is too short for task"))
}

/// The error of a length too short for a task: `what` says why.
fn too_short(task: Task, len: usize, what: String) -> Error {
    let hint = if task == Task::Cwe { "use longer lengths, or fewer --common-words" } else { "use longer lengths" };
    Error::config("--lengths", "lengths", format!("length {len} is too short for task {} ({what}); {hint}", task.name()))
}

/// The result of one task at one length.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct TaskCell {
    pub task: Task,
    pub length: usize,
    pub trials: usize,
    /// Share of trials whose every answer token is the argmax under teacher forcing.
    pub teacher_forced: f64,
    /// Share of answer tokens right under teacher forcing.
    pub token_accuracy: f64,
    /// Mean [`recall`] of the greedy outputs (`None`: not run).
    pub recall: Option<f64>,
}

/// `task,length,trials,teacher_forced,token_accuracy,recall` lines (recall empty when not run).
pub fn to_csv(cells: &[TaskCell]) -> String {
    let mut s = String::from("task,length,trials,teacher_forced,token_accuracy,recall\n");
    for c in cells {
        let r = c.recall.map(|r| format!("{r:.6}")).unwrap_or_default();
        s.push_str(&format!("{},{},{},{:.6},{:.6},{r}\n", c.task.name(), c.length, c.trials, c.teacher_forced, c.token_accuracy));
    }
    s
}
