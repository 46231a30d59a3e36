//! BOS handling on a real tokenizer against transformers (fixtures by
//! scripts/make_bos_fixtures.py: SmolLM2's 49,152-token tokenizer, a tiny random Llama of
//! that vocabulary, and transformers 5's `tokenizer(text).input_ids` and greedy
//! `generate` ids for three variants: SmolLM2's own tokenizer (adds no BOS), its
//! tokenizer.json with a BOS-adding TemplateProcessing post-processor, and its
//! tokenizer_config.json with `add_bos_token: true` (which transformers 5 ignores when a
//! tokenizer.json exists)).
//!
//! Checked exactly (token ids are integers): the prompt ids of generate, the ids of a
//! document as train and eval ppl tokenize it, the prefix eval needle starts a case with,
//! the greedy continuation (f32 on the CPU from f16-exact weights), and what the
//! `generate` command prints.

use crate::common;

use std::io::Read;
use std::path::{Path, PathBuf};
use std::sync::Arc;

use candle_core::{DType, Device};
use longctx::data::docs::{Content, Doc, Loc, Tokenize};
use longctx::eval::generate::{generate, Sampling};
use longctx::eval::EvalModel;
use longctx::hub::{tokenizer, HubOptions};
use serde_json::Value;

const FIXTURE: &str = "tests/fixtures/bos_smollm2";

fn cases() -> Value {
    serde_json::from_str(&std::fs::read_to_string(Path::new(FIXTURE).join("cases.json")).unwrap()).unwrap()
}

/// A model directory for one variant: the fixture's weights and config, the plain
/// tokenizer.json with the variant's post-processor, the variant's tokenizer_config.json.
fn variant_dir(tmp: &Path, name: &str, v: &Value) -> PathBuf {
    let dir = tmp.join(name);
    std::fs::create_dir_all(&dir).unwrap();
    for f in ["config.json", "model.safetensors"] {
        std::fs::copy(Path::new(FIXTURE).join(f), dir.join(f)).unwrap();
    }
    let mut text = String::new();
    flate2::read::GzDecoder::new(std::fs::File::open(Path::new(FIXTURE).join("tokenizer.json.gz")).unwrap())
        .read_to_string(&mut text)
        .unwrap();
    let mut tok: Value = serde_json::from_str(&text).unwrap();
    tok["post_processor"] = v["post_processor"].clone();
    std::fs::write(dir.join("tokenizer.json"), serde_json::to_string(&tok).unwrap()).unwrap();
    std::fs::write(dir.join("tokenizer_config.json"), serde_json::to_string(&v["tokenizer_config"]).unwrap()).unwrap();
    dir
}

fn ids(v: &Value) -> Vec<u32> {
    v.as_array().unwrap().iter().map(|x| x.as_u64().unwrap() as u32).collect()
}

#[test]
fn prompts_documents_and_greedy_generation_match_transformers_with_and_without_a_bos() {
    let c = cases();
    let bos = c["bos_id"].as_u64().unwrap() as u32;
    let max_new = c["max_new_tokens"].as_u64().unwrap() as usize;
    let tmp = tempfile::tempdir().unwrap();
    let variants = c["variants"].as_object().unwrap();
    assert_eq!(variants.len(), 3);
    for (name, v) in variants {
        let dir = variant_dir(tmp.path(), name, v);
        let m = EvalModel::load(dir.to_str().unwrap(), &Device::Cpu, DType::F32, &HubOptions::from_env()).unwrap();
        let tok = m.tokenizer.as_ref().expect("the fixture has a tokenizer");
        let adds_bos = name == "bos_template";
        // eval needle's cases start with what the tokenizer puts before a text.
        assert_eq!(tokenizer::special_prefix(tok).unwrap(), if adds_bos { vec![bos] } else { vec![] }, "{name}: prefix");
        for p in v["prompts"].as_array().unwrap() {
            let prompt = p["prompt"].as_str().unwrap();
            let want_ids = ids(&p["input_ids"]);
            assert_eq!(want_ids.first() == Some(&bos), adds_bos, "{name}: the fixture's own BOS");
            let got = tokenizer::encode_text(tok, prompt).unwrap();
            assert_eq!(got, want_ids, "{name}: ids of {prompt:?}");
            let sampling = Sampling { temperature: 0.0, top_p: 1.0, seed: 0 };
            let new = generate(&m.model, &got, max_new, None, &sampling, true, |_| Ok(())).unwrap();
            let all: Vec<u32> = got.iter().chain(new.iter()).copied().collect();
            assert_eq!(all, ids(&p["generated"]), "{name}: greedy generation from {prompt:?}");
        }
        // A document as train and eval ppl tokenize it (no data.bos/eos).
        let d = &v["document"];
        let t = Tokenize { tokenizer: Some(Arc::new(tok.clone())), bos: None, eos: None, vocab_size: Some(49152) };
        let doc =
            Doc { content: Content::Text(d["text"].as_str().unwrap().into()), file: Arc::from(Path::new("doc.jsonl")), loc: Loc::Line(1) };
        assert_eq!(t.apply(doc.clone()).unwrap().ids, ids(&d["input_ids"]), "{name}: document ids");
        // data.bos is not added a second time where the tokenizer put it already.
        let t = Tokenize { bos: Some(bos), ..t };
        let got = t.apply(doc).unwrap().ids;
        assert_eq!(got.iter().take_while(|&&x| x == bos).count(), 1, "{name}: one BOS with data.bos set");
    }
}

/// The `generate` command prints the prompt and the greedy continuation that transformers
/// generates (decoded), with and without a BOS-adding post-processor.
#[test]
fn the_generate_command_continues_as_transformers_does() {
    let c = cases();
    let tmp = tempfile::tempdir().unwrap();
    for name in ["plain", "bos_template"] {
        let v = &c["variants"][name];
        let dir = variant_dir(tmp.path(), name, v);
        let p = &v["prompts"][0];
        let out = common::longctx_cmd(&[
            "generate",
            "--model",
            dir.to_str().unwrap(),
            "--prompt",
            p["prompt"].as_str().unwrap(),
            "--max-new-tokens",
            &c["max_new_tokens"].to_string(),
            "--ignore-eos",
        ])
        .output()
        .unwrap();
        assert!(out.status.success(), "{name}: {}", String::from_utf8_lossy(&out.stderr));
        let tok = tokenizer::load_tokenizer(&dir).unwrap();
        let want = tok.decode(&ids(&p["generated"]), true).unwrap();
        assert_eq!(String::from_utf8_lossy(&out.stdout).trim_end_matches('\n'), want, "{name}");
    }
}

/// `generate` checks its arguments before it streams anything: the error is not glued to
/// a printed prompt, and nothing reaches stdout.
#[test]
fn generate_refuses_bad_sampling_before_printing_the_prompt() {
    let c = cases();
    let tmp = tempfile::tempdir().unwrap();
    let dir = variant_dir(tmp.path(), "plain", &c["variants"]["plain"]);
    for (arg, needle) in [("--temperature=-1", "--temperature"), ("--top-p=0", "--top-p"), ("--top-p=1.5", "--top-p")] {
        let out = common::longctx_cmd(&["generate", "--model", dir.to_str().unwrap(), "--prompt", "Hello", arg]).output().unwrap();
        assert_eq!(out.status.code(), Some(1), "{arg}: {}", String::from_utf8_lossy(&out.stderr));
        assert!(out.stdout.is_empty(), "{arg}: stdout {:?}", String::from_utf8_lossy(&out.stdout));
        assert!(String::from_utf8_lossy(&out.stderr).contains(needle), "{arg}: {}", String::from_utf8_lossy(&out.stderr));
    }
}

/// A text passkey case on the real tokenizer: exactly `len` inputs, the tokenizer's prefix,
/// then the sentence stating the task, then the haystack with the needle at its depth (at
/// depth 0 right after that sentence, not on the first tokens), then the question whose
/// answer targets are the value's digits.
#[test]
fn text_passkey_cases_state_the_task_first_and_place_the_needle_at_its_depth() {
    use longctx::eval::needle::TextTask;
    let c = cases();
    let tmp = tempfile::tempdir().unwrap();
    for name in ["plain", "bos_template"] {
        let dir = variant_dir(tmp.path(), name, &c["variants"][name]);
        let tok = tokenizer::load_tokenizer(&dir).unwrap();
        let prefix = tokenizer::special_prefix(&tok).unwrap();
        let task = TextTask::new(&tok, None, true, 5, 0).unwrap();
        for (depth, len) in [(0.0, 300), (0.5, 300), (1.0, 300), (0.25, 1000)] {
            let case = task.case(len, depth, 3, 1).unwrap();
            assert_eq!(case.sample.ids.len(), len, "{name}: length");
            assert_eq!(case.sample.ids[..prefix.len()], prefix[..], "{name}: prefix");
            let text = tok.decode(&case.prompt()[prefix.len()..], false).unwrap();
            assert!(text.starts_with("A pass key is hidden"), "{name}: the task comes first: {text:.80}");
            let needle = format!("The pass key is {}. Remember it.", case.value);
            let at = text.find(&needle).expect("the needle is in the case");
            let stated = text.find("at the end.").unwrap() + "at the end.".len();
            let hay = text.len() - stated - text[text.rfind(" What is the pass key?").unwrap()..].len();
            let frac = (at - stated) as f64 / hay as f64;
            assert!((frac - depth).abs() < 0.08, "{name}: needle at {frac:.3} of the haystack, depth {depth}");
            assert!(text.ends_with("What is the pass key? The pass key is"), "{name}: {text:.80}");
            let answer = tok.decode(&case.answer, false).unwrap();
            assert_eq!(answer.trim(), case.value, "{name}: answer");
            let targets: Vec<u32> = case.sample.targets[case.answer_start..].iter().map(|&t| t as u32).collect();
            assert_eq!(targets, case.answer, "{name}: answer targets");
        }
    }
}
