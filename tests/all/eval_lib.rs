//! The evaluation library against independent references (CPU, f32, tiny models):
//! - scoring on hand-made predictions (all answer tokens right: a hit; one wrong: a miss);
//! - the needle cases: the answer is what the prompt's needle says, at the asked depth;
//! - sliding windows score every target of the stream exactly once;
//! - perplexity = exp(mean token loss), the loss computed here from the full logits in f64;
//! - the forward through each sequence-parallel mode (threads, W = 4; lengths that need
//!   padding) gives the single-device per-token losses;
//! - generation with the KV cache equals generation without it, token for token.
//!
//! Tolerances: per-token loss |Δ| ≤ 1e-4 nats (f32, only the summation order differs;
//! measured ~1e-6); perplexity relative ≤ 1e-5; cached hidden states relative ≤ 1e-5.

use std::collections::HashMap;
use std::sync::Arc;

use candle_core::{DType, Device, Tensor};
use candle_nn::VarBuilder;
use longctx::data::synthetic;
use longctx::eval::forward::{with_ranks, Ranks, RanksSpec};
use longctx::eval::generate::{generate, Sampling};
use longctx::eval::needle::{exact_match, token_accuracy, token_case};
use longctx::eval::ppl::{document_windows, perplexity, score_windows, sliding_windows, truncated_windows};
use longctx::model::{KvCache, Llama, LlamaConfig};
use longctx::parallel::ParallelMode;
use longctx_attention::local::LocalAttention;
use longctx_attention::AttentionMode;

use crate::common;

fn model(cfg: &LlamaConfig, seed: u64) -> Llama {
    let w: HashMap<String, Tensor> = longctx::train::init::random_init(cfg, seed, DType::F32, &Device::Cpu).unwrap();
    Llama::load(VarBuilder::from_tensors(w, DType::F32, &Device::Cpu), cfg).unwrap()
}

fn stream(n: usize, vocab: usize, seed: u64) -> Vec<u32> {
    let mut s = seed | 1;
    (0..n)
        .map(|_| {
            s ^= s << 13;
            s ^= s >> 7;
            s ^= s << 17;
            (s % vocab as u64) as u32
        })
        .collect()
}

/// Per-token losses of `ids` → `targets` from the full logits, log-softmax in f64.
fn reference_losses(m: &Llama, ids: &[u32], targets: &[i64]) -> Vec<f64> {
    let n = ids.len();
    let ids_t = Tensor::from_slice(ids, (1, n), &Device::Cpu).unwrap();
    let pos = Tensor::arange(0u32, n as u32, &Device::Cpu).unwrap().unsqueeze(0).unwrap();
    let attn: Arc<dyn AttentionMode> = Arc::new(LocalAttention);
    let logits = m.logits(&m.forward_hidden(&ids_t, &pos, &attn).unwrap()).unwrap();
    let rows: Vec<Vec<f32>> = logits.squeeze(0).unwrap().to_vec2().unwrap();
    rows.iter()
        .zip(targets)
        .map(|(r, &t)| {
            if t < 0 {
                return 0.0;
            }
            let max = r.iter().copied().fold(f32::MIN, f32::max) as f64;
            let lse = max + r.iter().map(|&x| (x as f64 - max).exp()).sum::<f64>().ln();
            lse - r[t as usize] as f64
        })
        .collect()
}

#[test]
fn scoring_on_hand_made_predictions() {
    let answer = [18u32, 23, 37, 45, 52];
    assert!(exact_match(&answer, &answer), "all answer tokens right is a hit");
    assert_eq!(token_accuracy(&answer, &answer), 1.0);
    for i in 0..answer.len() {
        let mut p = answer;
        p[i] += 1;
        assert!(!exact_match(&p, &answer), "one wrong token ({i}) is a miss");
        assert!((token_accuracy(&p, &answer) - 0.8).abs() < 1e-12);
    }
    assert!(!exact_match(&answer[..4], &answer), "a short prediction is a miss");
    assert!(!exact_match(&[], &[]), "an empty answer is never a hit");
    // A cell's share over trials: 3 hits of 4 = 75 %.
    let trials = [answer.to_vec(), answer.to_vec(), vec![0; 5], answer.to_vec()];
    let hits = trials.iter().filter(|p| exact_match(p, &answer)).count();
    assert_eq!(hits as f64 / trials.len() as f64, 0.75);
}

#[test]
fn token_cases_follow_the_training_format() {
    for (len, depth) in [(32usize, 0.0f64), (64, 0.5), (64, 1.0), (200, 0.25)] {
        let c = token_case(len, depth, 5, 256, 7, 3, 0).unwrap();
        assert_eq!(c.sample.ids.len(), len);
        assert_eq!(c.answer_start, len - 5);
        let tail: Vec<u32> = c.sample.targets[c.answer_start..].iter().map(|&t| t as u32).collect();
        assert_eq!(tail, c.answer, "the answer is the last targets");
        // The needle (KEY digits KEY_END) holds the same digits, at the asked depth.
        let ids = &c.sample.ids;
        let key = ids.iter().position(|&t| t == synthetic::KEY).unwrap();
        assert_eq!(&ids[key + 1..key + 6], c.answer.as_slice());
        assert_eq!(ids[key + 6], synthetic::KEY_END);
        let fill = len + 1 - (2 * 5 + 5);
        assert_eq!(key - 1, (depth * fill as f64).round() as usize, "needle depth");
        // The prompt ends with QUESTION KEY.
        let p = c.prompt();
        assert_eq!(&p[p.len() - 2..], &[synthetic::QUESTION, synthetic::KEY]);
        // Distractors: digit runs outside the needle, the needle untouched.
        let d = token_case(len.max(64), depth, 5, 256, 7, 3, 2).unwrap();
        let plain = token_case(len.max(64), depth, 5, 256, 7, 3, 0).unwrap();
        let changed = d.sample.ids.iter().zip(&plain.sample.ids).filter(|(a, b)| a != b).count();
        assert_eq!(changed, 10, "two distractors of 5 digits replace filler");
        assert_eq!(d.answer, plain.answer);
    }
}

#[test]
fn sliding_windows_score_every_target_once() {
    let s = stream(103, 50, 1);
    for (len, stride) in [(16usize, 8usize), (16, 16), (10, 3), (200, 50), (7, 1)] {
        let ws = sliding_windows(&s, len, stride, 1000);
        let mut scored = vec![0usize; s.len()];
        for w in &ws {
            assert!(w.ids.len() <= len);
            // Reconstruct each window's stream offset from its ids.
            let off = (0..s.len()).find(|&o| s[o..].starts_with(&w.ids)).unwrap();
            for (i, &t) in w.targets.iter().enumerate() {
                if t >= 0 {
                    assert_eq!(t as u32, s[off + i + 1]);
                    scored[off + i + 1] += 1;
                }
            }
        }
        assert_eq!(scored[0], 0);
        assert!(scored[1..].iter().all(|&c| c == 1), "len {len} stride {stride}: {scored:?}");
    }
    let docs = vec![stream(40, 50, 2), stream(10, 50, 3), stream(33, 50, 4)];
    let t = truncated_windows(&docs, 32, 10);
    assert_eq!(t.len(), 2, "the 10-token document is too short for 32");
    assert_eq!(t[1].ids, docs[2][..32].to_vec());
}

#[test]
fn perplexity_is_exp_of_the_mean_token_loss() {
    let cfg = common::small_config(false);
    let m = model(&cfg, 3);
    let s = stream(150, cfg.vocab_size, 5);
    let ws = sliding_windows(&s, 48, 20, 150);
    let (sum, n) = score_windows(&Ranks::single(7), &m, &ws, || {}).unwrap();
    assert_eq!(n, 149);
    let mut ref_sum = 0.0;
    for w in &ws {
        ref_sum += reference_losses(&m, &w.ids, &w.targets).iter().sum::<f64>();
    }
    let want = (ref_sum / 149.0).exp();
    let got = perplexity(sum, n, "test").unwrap();
    assert!((got - want).abs() / want < 1e-5, "ppl {got} vs reference {want}");
    assert!(perplexity(0.0, 0, "empty").is_err());
}

#[test]
fn every_parallel_mode_gives_the_single_device_losses() {
    let cfg = common::small_config(false);
    let m = model(&cfg, 11);
    let cases = [
        (ParallelMode::ZigzagRingAttn, 4, None),
        (ParallelMode::UlyssesAttn, 4, None),
        (ParallelMode::Fpdt, 4, None),
        (ParallelMode::Usp, 4, Some(2)),
        (ParallelMode::ZigzagRingAttn, 2, None),
        // FPDT with the default chunk (65536): shortened to the sequence (one chunk).
        (ParallelMode::Fpdt, 2, None),
    ];
    for len in [40usize, 37] {
        let ids = stream(len + 1, cfg.vocab_size, len as u64);
        let (x, y): (Vec<u32>, Vec<i64>) = (ids[..len].to_vec(), ids[1..].iter().map(|&t| t as i64).collect());
        let single = Ranks::single(5).token_scores(&m, &x, &y).unwrap();
        let reference = reference_losses(&m, &x, &y);
        for (a, b) in single.loss.iter().zip(&reference) {
            assert!((*a as f64 - b).abs() < 1e-4, "single device vs reference: {a} vs {b}");
        }
        for &(mode, w, ulysses) in &cases {
            let fpdt_chunk = if w == 2 { 65536 } else { 8 };
            let spec = RanksSpec { mode, world_size: w, ulysses, fpdt_chunk, token_chunk: 5, ..Default::default() };
            let got = with_ranks(
                &spec,
                "cpu",
                |_| Ok(()),
                |_| (cfg.num_attention_heads, cfg.num_key_value_heads),
                |r, _| {
                    assert_eq!(r.world(), w);
                    r.token_scores(&m, &x, &y)
                },
            )
            .unwrap()
            .unwrap();
            assert_eq!(got.loss.len(), len);
            let worst = got.loss.iter().zip(&single.loss).map(|(a, b)| (a - b).abs()).fold(0f32, f32::max);
            assert!(worst < 1e-4, "{mode} W={w} len {len}: per-token loss differs by {worst}");
            let agree = got.argmax.iter().zip(&single.argmax).filter(|(a, b)| a == b).count();
            assert!(agree + 1 >= len, "{mode} W={w}: argmax agrees on {agree}/{len}");
        }
    }
    // data_parallel over several ranks would evaluate everything twice: refused.
    let spec = RanksSpec { world_size: 2, ..Default::default() };
    let e = with_ranks(&spec, "cpu", |_| Ok(()), |_| (4, 2), |r, _| r.token_scores(&m, &[1, 2], &[2, 3])).unwrap_err();
    assert!(e.to_string().contains("sequence-parallel mode"), "{e}");
}

/// `--method documents`: documents packed into windows with their starts, boundary
/// targets unscored, a long document split; scored under the document mask in every
/// mode, each token's loss equals that of its document scored alone on one device.
#[test]
fn packed_document_windows_score_each_document_alone_in_every_mode() {
    let docs = vec![vec![1u32, 2, 3, 4, 5], vec![6], vec![7, 8, 9], vec![10, 11, 12, 13, 14, 15, 16, 17]];
    let w = document_windows(&docs, 6, 100);
    assert_eq!(w.len(), 3);
    assert_eq!((w[0].ids.clone(), w[0].doc_starts.clone()), (vec![1, 2, 3, 4, 5, 6], vec![0, 5]));
    assert_eq!(w[0].targets, vec![2, 3, 4, 5, -100, -100]);
    assert_eq!((w[1].ids.clone(), w[1].doc_starts.clone()), (vec![7, 8, 9, 10, 11, 12], vec![0, 3]));
    assert_eq!(w[1].targets, vec![8, 9, -100, 11, 12, -100]);
    assert_eq!(
        (w[2].ids.clone(), w[2].doc_starts.clone(), w[2].targets.clone()),
        (vec![13, 14, 15, 16, 17], vec![0], vec![14, 15, 16, 17, -100])
    );
    assert_eq!(document_windows(&docs, 6, 7).iter().map(|w| w.ids.len()).sum::<usize>(), 7, "max_tokens bounds the stream");

    let cfg = common::small_config(false);
    let m = model(&cfg, 5);
    let len = 40;
    let lens = [9usize, 1, 3, 2, 17, 8];
    let all = stream(len + 1, cfg.vocab_size, 3);
    let (mut starts, mut at) = (Vec::new(), 0);
    for l in lens {
        starts.push(at);
        at += l;
    }
    let x: Vec<u32> = all[..len].to_vec();
    let y: Vec<i64> = (0..len).map(|i| if starts.contains(&(i + 1)) || i + 1 == len { -100 } else { all[i + 1] as i64 }).collect();
    // Each document alone, one device.
    let mut want = vec![0f32; len];
    for (d, &a) in starts.iter().enumerate() {
        let b = a + lens[d];
        let s = Ranks::single(5).token_scores(&m, &x[a..b], &y[a..b]).unwrap();
        want[a..b].copy_from_slice(&s.loss);
    }
    let single = Ranks::single(5).token_scores_docs(&m, &x, &y, &starts).unwrap();
    let plain = Ranks::single(5).token_scores(&m, &x, &y).unwrap();
    let diff = |got: &[f32]| got.iter().zip(&want).zip(&y).filter(|(_, t)| **t >= 0).map(|((a, b), _)| (a - b).abs()).fold(0f32, f32::max);
    assert!(diff(&single.loss) < 1e-5, "one device: {}", diff(&single.loss));
    assert!(diff(&plain.loss) > 1e-3, "without the mask the losses must differ");
    for (mode, w, ulysses) in [
        (ParallelMode::ZigzagRingAttn, 4, None),
        (ParallelMode::UlyssesAttn, 2, None),
        (ParallelMode::Fpdt, 4, None),
        (ParallelMode::Usp, 4, Some(2)),
    ] {
        let spec = RanksSpec { mode, world_size: w, ulysses, fpdt_chunk: 8, token_chunk: 5, ..Default::default() };
        let got = with_ranks(
            &spec,
            "cpu",
            |_| Ok(()),
            |_| (cfg.num_attention_heads, cfg.num_key_value_heads),
            |r, _| r.token_scores_docs(&m, &x, &y, &starts),
        )
        .unwrap()
        .unwrap();
        assert!(diff(&got.loss) < 1e-5, "{mode} W={w}: {}", diff(&got.loss));
    }
}

#[test]
fn kv_cache_generation_equals_full_recompute() {
    for (cfg, seed) in [(common::small_config(false), 21u64), (longctx::train::init::builtin_config("tiny").unwrap(), 4)] {
        let m = model(&cfg, seed);
        let prompt = stream(13, cfg.vocab_size, seed);
        // Hidden states: prompt then 3 single tokens through the cache vs one full forward.
        let all = stream(16, cfg.vocab_size, seed + 1);
        let mut cache = KvCache::new(&m);
        let mut parts = vec![m.forward_hidden_cached(&Tensor::from_slice(&all[..13], (1, 13), &Device::Cpu).unwrap(), &mut cache).unwrap()];
        for t in 13..16 {
            parts.push(m.forward_hidden_cached(&Tensor::from_slice(&all[t..t + 1], (1, 1), &Device::Cpu).unwrap(), &mut cache).unwrap());
        }
        let cached = Tensor::cat(&parts, 1).unwrap();
        let attn: Arc<dyn AttentionMode> = Arc::new(LocalAttention);
        let pos = Tensor::arange(0u32, 16, &Device::Cpu).unwrap().unsqueeze(0).unwrap();
        let full = m.forward_hidden(&Tensor::from_slice(&all, (1, 16), &Device::Cpu).unwrap(), &pos, &attn).unwrap();
        let e = common::rel_err(&cached, &full).unwrap();
        assert!(e < 1e-5, "cached hidden states differ: {e}");
        assert_eq!(cache.len, 16);

        for sampling in [Sampling::GREEDY, Sampling { temperature: 0.9, top_p: 0.9, seed: 5 }] {
            let mut streamed = Vec::new();
            let with = generate(&m, &prompt, 24, None, &sampling, true, |t| {
                streamed.push(t);
                Ok(())
            })
            .unwrap();
            let without = generate(&m, &prompt, 24, None, &sampling, false, |_| Ok(())).unwrap();
            assert_eq!(with.len(), 24);
            assert_eq!(with, without, "{sampling:?}: KV cache changes the tokens");
            assert_eq!(streamed, with);
        }
        // EOS stops generation (and is returned).
        let first = generate(&m, &prompt, 5, None, &Sampling::GREEDY, true, |_| Ok(())).unwrap();
        let stopped = generate(&m, &prompt, 5, Some(first[1]), &Sampling::GREEDY, true, |_| Ok(())).unwrap();
        let at = first.iter().position(|&t| t == first[1]).unwrap();
        assert_eq!(stopped, first[..=at].to_vec());
    }
}
