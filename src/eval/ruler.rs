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
//!   the text, asked for every variable that holds N.
//!
//! Scores per case: teacher-forced exact match and share of answer tokens right (one
//! forward, any parallel mode), and the recall of the expected strings in the greedy
//! output ([`recall`]: each expected string found in it, case-insensitive, counts
//! `1 / expected`), the string-match score of RULER.

use serde::{Deserialize, Serialize};

use super::needle::{encode, number, FILLER_TEXT};
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
}

impl Task {
    pub const ALL: [Task; 5] = [Task::Single, Task::MultiKey, Task::MultiValue, Task::MultiQuery, Task::Vt];

    pub fn name(self) -> &'static str {
        match self {
            Task::Single => "single",
            Task::MultiKey => "multikey",
            Task::MultiValue => "multivalue",
            Task::MultiQuery => "multiquery",
            Task::Vt => "vt",
        }
    }

    /// A task by its name (also `niah_single`, `niah_multikey`, …, `variable_tracking`).
    pub fn parse(s: &str) -> Result<Task> {
        let t = s.trim().to_ascii_lowercase().replace(['-', '_'], "");
        let t = t.strip_prefix("niah").unwrap_or(&t);
        Ok(match t {
            "single" => Task::Single,
            "multikey" => Task::MultiKey,
            "multivalue" => Task::MultiValue,
            "multiquery" => Task::MultiQuery,
            "vt" | "variabletracking" => Task::Vt,
            _ => {
                return Err(Error::config(
                    "--tasks",
                    "tasks",
                    format!("unknown task `{s}`, expected single, multikey, multivalue, multiquery or vt"),
                ))
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
    /// The special tokens the tokenizer puts before a text.
    pub prefix: Vec<u32>,
    tok: tokenizers::Tokenizer,
}

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
        Ok(Self { haystack, digits, needles, hops, prefix, tok: tok.clone() })
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
    /// the expected strings.
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
                for i in (1..order.len()).rev() {
                    order.swap(i, rng.below(i + 1));
                }
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
        }
    }

    /// A case of `task` with `len` inputs: the sentences at random places of the haystack,
    /// in their order (the chain of `vt` in order).
    pub fn case(&self, task: Task, len: usize, seed: u64, index: u64) -> Result<TaskCase> {
        let tok = &self.tok;
        let mut rng = SplitMix64::from_parts(&[seed, index, 0x7275_6c65]);
        let (header, sentences, question, answer_text, expected) = self.pieces(task, &mut rng);
        let header_ids = encode(tok, header)?;
        let sentence_ids: Vec<Vec<u32>> = sentences.iter().map(|s| encode(tok, s)).collect::<Result<_>>()?;
        let q_ids = encode(tok, &question)?;
        let answer = crate::eval::needle::answer_after(tok, &q_ids, &question, &answer_text)?;
        let fixed = self.prefix.len() + header_ids.len() + sentence_ids.iter().map(Vec::len).sum::<usize>() + q_ids.len() + answer.len();
        if len < fixed {
            return Err(Error::config(
                "--lengths",
                "lengths",
                format!(
                    "length {len} is too short for task {} (its sentences, question and answer take {fixed} tokens); use longer lengths",
                    task.name()
                ),
            ));
        }
        let hay_len = len + 1 - fixed;
        let hay: Vec<u32> = self.haystack.iter().cycle().take(hay_len).copied().collect();
        let mut at: Vec<usize> = (0..sentence_ids.len()).map(|_| rng.below(hay_len + 1)).collect();
        at.sort_unstable();
        let mut raw: Vec<u32> = self.prefix.clone();
        raw.extend_from_slice(&header_ids);
        let mut prev = 0;
        for (p, ids) in at.into_iter().zip(sentence_ids) {
            raw.extend_from_slice(&hay[prev..p]);
            raw.extend(ids);
            prev = p;
        }
        raw.extend_from_slice(&hay[prev..]);
        raw.extend_from_slice(&q_ids);
        raw.extend_from_slice(&answer);
        debug_assert_eq!(raw.len(), len + 1);
        let answer_start = len - answer.len();
        Ok(TaskCase { task, sample: Sample::from_tokens(&raw, len, 0), answer_start, answer, expected, question })
    }
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
