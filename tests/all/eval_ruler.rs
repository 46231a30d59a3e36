//! RULER-style tasks (`longctx eval ruler`, `src/eval/ruler.rs`): each task's scoring on
//! hand-made outputs (all right, one wrong, empty), each task's case layout on SmolLM2's
//! real tokenizer (tests/fixtures/bos_smollm2; with and without a BOS-adding
//! post-processor): the exact length, the expected strings in the prompt, the question
//! at its end, the answer as the last targets; for the words tasks (cwe, fwe) the words
//! asked for counted in the decoded prompt to be the most frequent ones; and the
//! command's files on a small model.

use crate::common;

use std::io::Read;
use std::path::{Path, PathBuf};

use std::collections::HashMap;

use longctx::data::shuffle::SplitMix64;
use longctx::eval::ruler::{recall, recall_ids, to_csv, token_case, RulerTask, Task, TaskCase, TaskCell};
use longctx::eval::words;
use longctx::hub::tokenizer;
use serde_json::Value;

const FIXTURE: &str = "tests/fixtures/bos_smollm2";

fn root() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
}

/// SmolLM2's tokenizer, with the fixture's BOS-adding post-processor when `bos`.
fn smollm2(tmp: &Path, bos: bool) -> tokenizers::Tokenizer {
    let mut text = String::new();
    flate2::read::GzDecoder::new(std::fs::File::open(root().join(FIXTURE).join("tokenizer.json.gz")).unwrap())
        .read_to_string(&mut text)
        .unwrap();
    let mut tok: Value = serde_json::from_str(&text).unwrap();
    if bos {
        let cases: Value = serde_json::from_str(&std::fs::read_to_string(root().join(FIXTURE).join("cases.json")).unwrap()).unwrap();
        tok["post_processor"] = cases["variants"]["bos_template"]["post_processor"].clone();
    }
    let dir = tmp.join(if bos { "bos" } else { "plain" });
    std::fs::create_dir_all(&dir).unwrap();
    std::fs::write(dir.join("tokenizer.json"), serde_json::to_string(&tok).unwrap()).unwrap();
    tokenizer::load_tokenizer(&dir).unwrap()
}

fn decode(tok: &tokenizers::Tokenizer, ids: &[u32]) -> String {
    tok.decode(ids, false).unwrap()
}

fn strings(v: &[&str]) -> Vec<String> {
    v.iter().map(|s| s.to_string()).collect()
}

#[test]
fn recall_counts_each_expected_string_found() {
    let e = strings(&["1234567", "7654321", "5555555"]);
    assert_eq!(recall(" 1234567, 7654321, 5555555.", &e), 1.0);
    assert_eq!(recall("5555555 then 1234567 and 7654321", &e), 1.0, "order does not matter");
    assert!((recall(" 1234567, 7654320, 5555555.", &e) - 2.0 / 3.0).abs() < 1e-12);
    assert_eq!(recall("", &e), 0.0);
    assert_eq!(recall("anything", &[]), 0.0);
    assert_eq!(recall("the variables are abcde", &strings(&["ABCDE"])), 1.0, "case-insensitive");
}

/// Checks a case's layout: exactly `len` inputs, the answer as the last targets, the
/// tokenizer's prefix first and the question last. Returns the prompt's text after the
/// prefix and the same without the question.
fn check_layout(tok: &tokenizers::Tokenizer, c: &TaskCase, len: usize, what: &str) -> (String, String) {
    let prefix = tokenizer::special_prefix(tok).unwrap();
    assert_eq!(c.sample.ids.len(), len, "{what}");
    assert_eq!(c.sample.targets.len(), len, "{what}");
    assert_eq!(c.answer_start + c.answer.len(), len, "{what}");
    let tail: Vec<u32> = c.sample.targets[c.answer_start..].iter().map(|&t| t as u32).collect();
    assert_eq!(tail, c.answer, "{what}");
    assert!(c.sample.targets.iter().all(|&t| t >= 0), "{what}: every target is a token");
    let prompt = c.prompt();
    assert_eq!(prompt.len(), len + 1 - c.answer.len(), "{what}");
    assert!(prompt.starts_with(&prefix), "{what}: the tokenizer's prefix first");
    let q = tok.encode_fast(c.question.as_str(), false).unwrap().get_ids().to_vec();
    assert!(prompt.ends_with(&q), "{what}: the question at the end");
    (decode(tok, &prompt[prefix.len()..]), decode(tok, &prompt[prefix.len()..prompt.len() - q.len()]))
}

/// A case's output when every expected string is given, when one is wrong, and empty.
fn check_scoring(c: &TaskCase) {
    let n = c.expected.len() as f64;
    let all = c.expected.join(", ");
    assert_eq!(recall(&all, &c.expected), 1.0, "{:?}: all right", c.task);
    let mut wrong = c.expected.clone();
    wrong[0] = if wrong[0].chars().all(|ch| ch.is_ascii_digit()) { "0".repeat(wrong[0].len()) } else { "QQQQQ".into() };
    assert!(!c.expected.contains(&wrong[0]));
    let got = recall(&wrong.join(", "), &c.expected);
    assert!((got - (n - 1.0) / n).abs() < 1e-12, "{:?}: one wrong gives {got}, expected {}", c.task, (n - 1.0) / n);
    assert_eq!(recall("", &c.expected), 0.0, "{:?}: empty", c.task);
}

#[test]
fn every_task_is_laid_out_exactly_and_scored_by_recall_on_the_real_tokenizer() {
    let tmp = tempfile::tempdir().unwrap();
    for bos in [false, true] {
        let tok = smollm2(tmp.path(), bos);
        let prefix = tokenizer::special_prefix(&tok).unwrap();
        assert_eq!(prefix.is_empty(), !bos);
        let suite = RulerTask::new(&tok, None, 7, 4, 4).unwrap();
        for task in Task::ALL.into_iter().filter(|t| !matches!(t, Task::Cwe | Task::Fwe)) {
            for len in [300usize, 777, 2048] {
                for index in 0..3u64 {
                    let c = suite.case(task, len, 11, index).unwrap();
                    let what = format!("{task:?} len {len} #{index} bos {bos}");
                    let (text, body) = check_layout(&tok, &c, len, &what);
                    let body = body.as_str();
                    // The task is stated first.
                    let first = if task == Task::Vt { "Variable assignments are hidden" } else { "Some special magic numbers are hidden" };
                    assert!(text.starts_with(first), "{what}: {}", &text[..80]);
                    // The expected strings are in the text before the question, the answer holds them all.
                    assert!(!c.expected.is_empty());
                    for e in &c.expected {
                        assert!(body.contains(e.as_str()), "{what}: {e} not in the haystack");
                    }
                    assert_eq!(recall(&decode(&tok, &c.answer), &c.expected), 1.0, "{what}: answer {:?}", decode(&tok, &c.answer));
                    match task {
                        Task::Single | Task::MultiKey => {
                            assert_eq!(c.expected.len(), 1, "{what}");
                            assert!(c.expected[0].len() == 7 && c.expected[0].chars().all(|ch| ch.is_ascii_digit()));
                            let needles = body.matches("The special magic number for ").count();
                            assert_eq!(needles, if task == Task::Single { 1 } else { 4 }, "{what}");
                            // The asked key's own needle holds the expected value.
                            let key = c.question.split("number for ").nth(1).unwrap().split(' ').next().unwrap();
                            assert!(body.contains(&format!("for {key} is: {}.", c.expected[0])), "{what}");
                        }
                        Task::MultiValue => {
                            assert_eq!(c.expected.len(), 4, "{what}");
                            let key = c.question.split("numbers for ").nth(1).unwrap().split(' ').next().unwrap();
                            for v in &c.expected {
                                assert!(body.contains(&format!("for {key} is: {v}.")), "{what}");
                            }
                        }
                        Task::MultiQuery => {
                            assert_eq!(c.expected.len(), 4, "{what}");
                            // Every key is asked, each value in the text after its key.
                            let asked = c.question.split(" mentioned").next().unwrap();
                            let n_keys = body.matches("The special magic number for ").count();
                            assert_eq!(n_keys, 4, "{what}");
                            for v in &c.expected {
                                let key = body.split(&format!(" is: {v}.")).next().unwrap().rsplit("number for ").next().unwrap();
                                assert!(asked.contains(key), "{what}: key {key} of {v} not asked in {asked}");
                            }
                        }
                        Task::Vt => {
                            assert_eq!(c.expected.len(), 5, "{what}: hops + 1 variables");
                            let value = c.question.split("the value ").nth(1).unwrap().split(' ').next().unwrap();
                            assert!(body.contains(&format!("VAR {} = {value}.", c.expected[0])), "{what}");
                            // The chain in text order.
                            let mut at = body.find(&format!("VAR {} =", c.expected[0])).unwrap();
                            for w in c.expected.windows(2) {
                                let p = body.find(&format!("VAR {} = VAR {}.", w[1], w[0])).unwrap_or_else(|| panic!("{what}: {w:?}"));
                                assert!(p > at, "{what}: chain out of order");
                                at = p;
                            }
                        }
                        Task::Cwe | Task::Fwe => unreachable!(),
                    }
                    check_scoring(&c);
                }
            }
        }
        // Cases are reproducible and differ by index.
        let a = suite.case(Task::MultiKey, 500, 3, 1).unwrap();
        assert_eq!(a, suite.case(Task::MultiKey, 500, 3, 1).unwrap());
        assert_ne!(a.sample.ids, suite.case(Task::MultiKey, 500, 3, 2).unwrap().sample.ids);
    }
}

#[test]
fn a_user_haystack_is_used_and_short_lengths_and_bad_settings_are_refused() {
    let tmp = tempfile::tempdir().unwrap();
    let tok = smollm2(tmp.path(), false);
    let hay = "It was a bright cold day in April, and the clocks were striking thirteen. ";
    let suite = RulerTask::new(&tok, Some(hay), 5, 3, 2).unwrap();
    let c = suite.case(Task::MultiQuery, 400, 0, 0).unwrap();
    let text = decode(&tok, &c.prompt());
    assert!(text.contains("the clocks were striking thirteen"));
    assert!(!text.contains("The river runs past the old mill"));
    assert_eq!(c.expected.len(), 3);
    assert!(c.expected.iter().all(|v| v.len() == 5));
    assert_eq!(suite.case(Task::Vt, 400, 0, 0).unwrap().expected.len(), 3);
    let e = suite.case(Task::MultiQuery, 40, 0, 0).unwrap_err().to_string();
    assert!(e.contains("too short") && e.contains("multiquery"), "{e}");
    assert!(RulerTask::new(&tok, Some("   "), 5, 3, 2).is_err());
    assert!(RulerTask::new(&tok, None, 0, 3, 2).is_err());
    assert!(RulerTask::new(&tok, None, 5, 1, 2).is_err());
    assert!(RulerTask::new(&tok, None, 5, 3, 0).is_err());
    assert_eq!(Task::parse("niah_multikey").unwrap(), Task::MultiKey);
    assert_eq!(Task::parse("variable_tracking").unwrap(), Task::Vt);
    assert_eq!(Task::parse("cwe").unwrap(), Task::Cwe);
    assert_eq!(Task::parse("common_words_extraction").unwrap(), Task::Cwe);
    assert_eq!(Task::parse("FWE").unwrap(), Task::Fwe);
    assert_eq!(Task::parse("freq_words_extraction").unwrap(), Task::Fwe);
    let e = Task::parse("qa").unwrap_err().to_string();
    assert!(e.contains("unknown task `qa`") && e.contains("single, multikey, multivalue, multiquery, vt, cwe, fwe"), "{e}");
    assert!(suite.clone().with_common_words(0).is_err() && suite.clone().with_common_words(101).is_err());
    let e = suite.clone().with_common_words(10).unwrap().case(Task::Cwe, 120, 0, 0).unwrap_err().to_string();
    assert!(e.contains("too short for task cwe") && e.contains("--common-words"), "{e}");
    let e = suite.case(Task::Fwe, 110, 0, 0).unwrap_err().to_string();
    assert!(e.contains("too short for task fwe"), "{e}");
    let cells = vec![TaskCell { task: Task::Vt, length: 256, trials: 2, teacher_forced: 0.5, token_accuracy: 0.75, recall: None }];
    assert_eq!(to_csv(&cells), "task,length,trials,teacher_forced,token_accuracy,recall\nvt,256,2,0.500000,0.750000,\n");
}

#[test]
fn token_recall_counts_each_expected_run_found() {
    let e = vec![vec![110], vec![112], vec![109]];
    assert_eq!(recall_ids(&[110, 112, 109], &e), 1.0);
    assert_eq!(recall_ids(&[109, 110, 112], &e), 1.0, "order does not matter");
    assert!((recall_ids(&[110, 113, 109], &e) - 2.0 / 3.0).abs() < 1e-12, "one wrong");
    assert_eq!(recall_ids(&[], &e), 0.0, "empty output");
    assert_eq!(recall_ids(&[1, 2], &[]), 0.0, "nothing expected");
    // A number is one run: every digit in place, contiguous.
    let n = vec![vec![9, 18, 27]];
    assert_eq!(recall_ids(&[3, 9, 18, 27], &n), 1.0);
    assert_eq!(recall_ids(&[9, 18, 28], &n), 0.0);
    assert_eq!(recall_ids(&[9, 5, 18, 27], &n), 0.0, "interrupted");
}

/// The token format (a model without tokenizer.json, like the demo's export): `single` is
/// the passkey sample, `vt` the variable-tracking sample, both `len` inputs with the answer
/// as the last targets; the other tasks are refused by name.
#[test]
fn token_cases_are_the_demos_samples_with_their_answers() {
    use longctx::data::synthetic::{self, Passkey, PasskeyConfig};
    for len in [32, 300, 1024] {
        let c = token_case(Task::Single, len, 256, 5, 2, 7, 3).unwrap();
        let item = Passkey::new(PasskeyConfig { seed: 7, ..PasskeyConfig::new(len) }).unwrap().sample(3);
        assert_eq!(c.sample, item.sample);
        assert_eq!((c.answer_start, c.answer.len()), (len - 5, 5));
        assert_eq!(c.expected_ids, vec![c.answer.clone()], "one run: the whole number");
        assert_eq!(c.expected, vec![item.passkey.iter().map(|d| char::from(b'0' + d)).collect::<String>()]);
        assert_eq!(c.prompt().last(), Some(&synthetic::KEY));
        let v = token_case(Task::Vt, len, 256, 5, 2, 7, 3).unwrap();
        let item = Passkey::new(PasskeyConfig { seed: 7, vt_hops: 2, ..PasskeyConfig::new(len) }).unwrap().variable_tracking(3);
        assert_eq!(v.sample, item.sample);
        assert_eq!((v.answer_start, v.answer.len()), (len - 3, 3));
        assert_eq!(v.expected_ids, v.answer.iter().map(|&t| vec![t]).collect::<Vec<_>>(), "each variable its own run");
        assert_eq!(v.expected, v.answer.iter().map(|t| format!("V{}", t - synthetic::VAR0)).collect::<Vec<_>>());
        assert_eq!(v.sample.ids[len - 3 - 5], synthetic::VT_QUESTION);
    }
    for t in [Task::MultiKey, Task::MultiValue, Task::MultiQuery, Task::Cwe, Task::Fwe] {
        let e = token_case(t, 256, 256, 5, 2, 0, 0).unwrap_err().to_string();
        assert!(e.contains(&format!("task {} needs a model with tokenizer.json", t.name())) && e.contains("single and vt"), "{e}");
    }
    let e = token_case(Task::Single, 256, 256, 9, 2, 0, 0).unwrap_err().to_string();
    assert!(e.contains("--digits") && e.contains("got 9, expected 1 to 8"), "{e}");
    let e = token_case(Task::Vt, 256, 256, 5, 16, 0, 0).unwrap_err().to_string();
    assert!(e.contains("--hops") && e.contains("got 16, expected 1 to 15"), "{e}");
    let e = token_case(Task::Vt, 20, 256, 5, 2, 0, 0).unwrap_err().to_string();
    assert!(e.contains("too short for task vt") && e.contains("at least 22"), "{e}");
}

#[test]
fn the_ruler_command_writes_its_files_through_two_zigzag_ranks() {
    // Every task, cwe and fwe included, end to end on the tiny test model.
    let tmp = tempfile::tempdir().unwrap();
    let model = root().join("tests/fixtures/llama_mha");
    let ev = tmp.path().join("eval");
    let s = |p: &Path| p.to_str().unwrap().to_string();
    let args = |extra: &[&str]| {
        let mut v: Vec<String> =
            ["eval", "ruler", "--model", &s(&model), "--lengths", "700,1024", "--trials", "2", "--output-dir", &s(&ev)]
                .iter()
                .map(|x| x.to_string())
                .collect();
        v.extend(extra.iter().map(|x| x.to_string()));
        v
    };
    let run = |a: Vec<String>| {
        let a: Vec<&str> = a.iter().map(String::as_str).collect();
        common::longctx_cmd(&a).output().unwrap()
    };
    let out = run(args(&[]));
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    let j: Value = serde_json::from_str(&std::fs::read_to_string(ev.join("ruler.json")).unwrap()).unwrap();
    assert_eq!(j["cells"].as_array().unwrap().len(), 14, "7 tasks × 2 lengths");
    assert_eq!(j["common_words"], 10);
    assert_eq!(j["trained_context"], 2048);
    for c in j["cells"].as_array().unwrap() {
        let r = c["recall"].as_f64().unwrap();
        assert!((0.0..=1.0).contains(&r) && c["trials"] == 2);
    }
    let csv = std::fs::read_to_string(ev.join("ruler.csv")).unwrap();
    assert_eq!(csv.lines().count(), 15);
    for row in ["vt,1024,2,", "cwe,700,2,", "cwe,1024,2,", "fwe,700,2,", "fwe,1024,2,"] {
        assert!(csv.lines().any(|l| l.starts_with(row)), "{row} not in {csv}");
    }
    for f in ["ruler.png", "ruler_teacher_forced.png"] {
        assert!(std::fs::read(ev.join(f)).unwrap().starts_with(b"\x89PNG"), "{f}");
    }
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(stdout.contains("multiquery\trecall") && stdout.contains("cwe\trecall") && stdout.contains("fwe\trecall"), "{stdout}");
    // The teacher-forced forward through 2 zigzag ranks scores as one device does.
    let ev2 = tmp.path().join("eval2");
    let mut a = args(&["--no-generate", "--parallel-mode", "zigzag_ring_attn", "--world-size", "2", "--tasks", "single,vt,cwe,fwe"]);
    let i = a.iter().position(|x| x == &s(&ev)).unwrap();
    a[i] = s(&ev2);
    let out = run(a);
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    let j2: Value = serde_json::from_str(&std::fs::read_to_string(ev2.join("ruler.json")).unwrap()).unwrap();
    assert_eq!(j2["cells"].as_array().unwrap().len(), 8, "4 tasks × 2 lengths");
    assert!(!ev2.join("ruler.png").exists(), "no greedy plot with --no-generate");
    for c in j2["cells"].as_array().unwrap() {
        assert!(c["recall"].is_null());
        let one = j["cells"].as_array().unwrap().iter().find(|d| d["task"] == c["task"] && d["length"] == c["length"]).unwrap();
        assert_eq!(one["token_accuracy"], c["token_accuracy"], "{c}");
    }
    // The help names every task; an unknown one and a bad --common-words are refused.
    let out = run(vec!["eval".into(), "ruler".into(), "--help".into()]);
    let help = String::from_utf8_lossy(&out.stdout);
    assert!(help.contains("cwe (common-words extraction)") && help.contains("fwe (frequent-words extraction)"), "{help}");
    assert!(help.contains("--common-words"), "{help}");
    let out = run(args(&["--tasks", "cwe,qa"]));
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success() && err.contains("unknown task `qa`") && err.contains("vt, cwe, fwe"), "{err}");
    let out = run(args(&["--tasks", "cwe", "--common-words", "0"]));
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success() && err.contains("--common-words") && err.contains("expected 1 to 100"), "{err}");
    // The default grid (256, 512, 1024, 2048 for this model): lengths too short for cwe on
    // this character-level tokenizer (about 530 tokens) are skipped with a note; given with
    // --lengths, they are an error.
    let ev3 = tmp.path().join("eval3");
    let out = run(vec![
        "eval".into(),
        "ruler".into(),
        "--model".into(),
        s(&model),
        "--tasks".into(),
        "cwe,fwe".into(),
        "--trials".into(),
        "1".into(),
        "--no-generate".into(),
        "--output-dir".into(),
        s(&ev3),
    ]);
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "{err}");
    assert!(err.contains("note: cwe skipped at length 256") && err.contains("note: cwe skipped at length 512"), "{err}");
    let j3: Value = serde_json::from_str(&std::fs::read_to_string(ev3.join("ruler.json")).unwrap()).unwrap();
    let cells: Vec<(String, u64)> =
        j3["cells"].as_array().unwrap().iter().map(|c| (c["task"].as_str().unwrap().to_string(), c["length"].as_u64().unwrap())).collect();
    let want: Vec<(String, u64)> =
        [("cwe", 1024), ("cwe", 2048), ("fwe", 512), ("fwe", 1024), ("fwe", 2048)].iter().map(|(t, l)| (t.to_string(), *l)).collect();
    assert_eq!(cells, want, "{err}");
    let out = run(args(&["--tasks", "cwe", "--lengths", "512"]));
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success() && err.contains("length 512 is too short for task cwe"), "{err}");
    // A model without tokenizer.json is refused with a clear error.
    let bare = tmp.path().join("bare");
    std::fs::create_dir_all(&bare).unwrap();
    for f in ["config.json", "model.safetensors"] {
        std::fs::copy(model.join(f), bare.join(f)).unwrap();
    }
    // Without tokenizer.json: the built-in token format, whose tasks are single and vt.
    let bare_args = |extra: &[&str]| {
        let mut v: Vec<String> = ["eval", "ruler", "--model", &s(&bare), "--lengths", "700", "--trials", "2", "--output-dir", &s(&ev)]
            .iter()
            .map(|x| x.to_string())
            .collect();
        v.extend(extra.iter().map(|x| x.to_string()));
        v
    };
    let out = run(bare_args(&["--tasks", "single,multikey"]));
    assert!(!out.status.success());
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains("task multikey needs a model with tokenizer.json") && err.contains("single and vt"), "{err}");
    let out = run(bare_args(&[]));
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    let j: Value = serde_json::from_str(&std::fs::read_to_string(ev.join("ruler.json")).unwrap()).unwrap();
    assert_eq!((j["format"].as_str(), j["digits"].as_u64(), j["hops"].as_u64()), (Some("tokens"), Some(5), Some(2)));
    assert_eq!(j["cells"].as_array().unwrap().len(), 2, "single and vt at 700");
}

/// Word counts of a decoded `cwe` list (` 1. word 2. word …`): the numbering must run
/// 1, 2, 3, … with one word after each number.
fn count_list(list: &str, what: &str) -> HashMap<String, usize> {
    let mut counts = HashMap::new();
    let toks: Vec<&str> = list.split_whitespace().collect();
    assert!(toks.len().is_multiple_of(2), "{what}: a number and a word per item");
    for (i, pair) in toks.chunks(2).enumerate() {
        assert_eq!(pair[0], format!("{}.", i + 1), "{what}: item {i}");
        *counts.entry(pair[1].to_string()).or_insert(0) += 1;
    }
    counts
}

/// Word counts of a decoded `fwe` text, dots (the noise word and any pad) left out.
fn count_text(text: &str) -> HashMap<String, usize> {
    let mut counts = HashMap::new();
    for w in text.split_whitespace().filter(|w| !w.chars().all(|c| c == '.')) {
        *counts.entry(w.to_string()).or_insert(0) += 1;
    }
    counts
}

/// `expected` are exactly the most frequent words of `counts`, each strictly more frequent
/// than any other word.
fn check_most_frequent(counts: &HashMap<String, usize>, expected: &[String], what: &str) {
    let least_asked = expected.iter().map(|e| counts.get(e).copied().unwrap_or(0)).min().unwrap();
    let most_other = counts.iter().filter(|(w, _)| !expected.contains(w)).map(|(_, &c)| c).max().unwrap_or(0);
    assert!(least_asked > most_other, "{what}: asked words {least_asked}× at least, another {most_other}×: {expected:?}");
    assert!(most_other >= 1, "{what}: other words are there too");
}

#[test]
fn the_words_tasks_ask_for_the_words_that_are_the_most_frequent_in_the_prompt() {
    let tmp = tempfile::tempdir().unwrap();
    for bos in [false, true] {
        let tok = smollm2(tmp.path(), bos);
        let suite = RulerTask::new(&tok, None, 7, 4, 4).unwrap();
        let small = suite.clone().with_common_words(3).unwrap();
        for (task, suite, len) in [
            (Task::Cwe, &suite, 256),
            (Task::Cwe, &suite, 777),
            (Task::Cwe, &suite, 2048),
            (Task::Cwe, &suite, 8192),
            (Task::Cwe, &small, 300),
            (Task::Fwe, &suite, 256),
            (Task::Fwe, &suite, 777),
            (Task::Fwe, &suite, 2048),
            (Task::Fwe, &suite, 8192),
        ] {
            for index in 0..3u64 {
                let c = suite.case(task, len, 11, index).unwrap();
                let what = format!("{task:?} len {len} #{index} bos {bos}");
                let (text, body) = check_layout(&tok, &c, len, &what);
                let (first, last) = match task {
                    Task::Cwe => ("Below is a numbered list of words.", "you will be asked for them at the end."),
                    _ => ("Read the coded text below", "Ignore the dots '...'."),
                };
                assert!(text.starts_with(first), "{what}: {}", &text[..80]);
                let list = &body[body.find(last).unwrap() + last.len()..];
                let counts = if task == Task::Cwe { count_list(list, &what) } else { count_text(list) };
                let n = if task == Task::Cwe { suite.common_words } else { 3 };
                assert_eq!(c.expected.len(), n, "{what}");
                check_most_frequent(&counts, &c.expected, &what);
                if task == Task::Cwe {
                    assert!(c.question.contains(&format!("the {n} most common words")), "{what}");
                    assert!(counts.len() >= 2 * n, "{what}: as many uncommon words as common ones at least");
                    assert!(counts.keys().all(|w| words::WORDS.contains(&w.as_str())), "{what}");
                } else {
                    assert!(list.contains(" ... "), "{what}: the noise word");
                    assert!(c.expected.iter().all(|w| w.len() == 6 && w.chars().all(|ch| ch.is_ascii_lowercase())), "{what}");
                    // In rank order (more or as frequent as the next).
                    assert!(c.expected.windows(2).all(|w| counts[&w[0]] >= counts[&w[1]]), "{what}: {counts:?}");
                }
                assert_eq!(recall(&decode(&tok, &c.answer), &c.expected), 1.0, "{what}: answer {:?}", decode(&tok, &c.answer));
                check_scoring(&c);
            }
        }
        // Reproducible per seed and index, different otherwise.
        for task in [Task::Cwe, Task::Fwe] {
            let a = suite.case(task, 1000, 3, 1).unwrap();
            assert_eq!(a, suite.case(task, 1000, 3, 1).unwrap(), "{task:?}");
            assert_ne!(a.sample.ids, suite.case(task, 1000, 3, 2).unwrap().sample.ids, "{task:?}");
            assert_ne!(a.sample.ids, suite.case(task, 1000, 4, 1).unwrap().sample.ids, "{task:?}");
        }
    }
}

/// The list of cwe and the text of fwe on SmolLM2's tokenizer: never over the budget, short
/// of it by less than one item (cwe: a number and a word; fwe: the noise word).
#[test]
fn the_words_bodies_fill_their_budget_to_within_one_item() {
    let tmp = tempfile::tempdir().unwrap();
    let tok = smollm2(tmp.path(), false);
    let n_tokens = |s: &str| tok.encode_fast(s, false).unwrap().get_ids().len();
    let longest_word = words::WORDS.iter().map(|w| n_tokens(&format!(" {w}"))).max().unwrap();
    for budget in [200usize, 700, 3000, 20_000] {
        let mut rng = SplitMix64::new(budget as u64);
        let (common, uncommon) = words::WORDS.split_at(10);
        let l = words::common_list(&tok, common, uncommon, budget, &mut rng).unwrap().unwrap();
        let item = n_tokens(&format!(" {}.", budget)) + longest_word;
        assert!(l.ids.len() <= budget && budget - l.ids.len() <= item, "cwe {budget}: {} tokens", l.ids.len());
        assert!(l.common_repeats >= 2 * l.uncommon_repeats && l.uncommon_words >= 10, "cwe {budget}: {l:?}");
        let vocab = words::coded_vocab(&mut rng, (budget / 50).max(16));
        let ids = words::frequent_text(&tok, &vocab, budget, &mut rng).unwrap().unwrap();
        let noise = n_tokens(" ...");
        assert!(ids.len() <= budget && budget - ids.len() < noise, "fwe {budget}: {} tokens", ids.len());
    }
    // The shapes: at the shortest, common words twice and uncommon ones once; longer, every
    // word of the pool, the common ones more than twice as often.
    let mut rng = SplitMix64::new(1);
    let shape = |budget: usize, rng: &mut SplitMix64| {
        let l = words::common_list(&tok, &words::WORDS[..10], &words::WORDS[10..], budget, rng).unwrap().unwrap();
        (l.common_repeats, l.uncommon_repeats, l.uncommon_words)
    };
    assert_eq!(shape(200, &mut rng), (2, 1, 19));
    assert_eq!(shape(20_000, &mut rng), (83, 7, 301));
    assert!(words::common_list(&tok, &words::WORDS[..10], &words::WORDS[10..], 100, &mut rng).unwrap().is_none());
}

#[test]
fn scoring_of_the_words_tasks_on_hand_made_outputs() {
    // cwe: ten common words, the output in RULER's numbered form or comma-separated.
    let cwe = strings(&["badger", "cedar", "violin", "lemon", "kayak", "quilt", "tiger", "sled", "maple", "pearl"]);
    assert_eq!(recall(" 1. badger 2. cedar 3. violin 4. lemon 5. kayak 6. quilt 7. tiger 8. sled 9. maple 10. pearl", &cwe), 1.0);
    assert_eq!(recall(" Pearl, maple, sled, tiger, quilt, kayak, lemon, violin, cedar, badger.", &cwe), 1.0);
    assert!((recall(" badger, cedar, violin, lemon, kayak, quilt, tiger, sled, maple, walrus", &cwe) - 0.9).abs() < 1e-12);
    assert_eq!(recall("", &cwe), 0.0);
    // fwe: three coded words.
    let fwe = strings(&["qhwzke", "bmtoal", "ypsrvd"]);
    assert_eq!(recall(" qhwzke, bmtoal and ypsrvd.", &fwe), 1.0);
    assert!((recall(" qhwzke, bmtoal, ypsrvx", &fwe) - 2.0 / 3.0).abs() < 1e-12);
    assert_eq!(recall("", &fwe), 0.0);
}
