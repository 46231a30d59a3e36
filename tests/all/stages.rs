//! Per-stage settings: the EasyContext recipes against the published scripts (tokens per
//! optimizer step, length, θ, steps, learning rate, dataset, seed of every stage), stage
//! seeds (each stage reads other documents), per-stage batch and accumulation (the tokens
//! a run logs per step), and the TensorBoard event files a run writes, decoded by a reader
//! written here from the format's description (TFRecord framing with masked CRC-32C, the
//! `Event`/`Summary` protobuf), not by longctx's writer.

use longctx::data::{DataSpec, Loader, Shard};
use longctx::train::config::{ParallelMode, RunConfig, Stage};
use longctx::train::trainer::{run, stage_data_spec};
use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

fn root() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
}

/// One stage of a published script: length, θ, steps, tokens per optimizer step, lr,
/// the dataset's name, seed, mode.
type Published = (usize, f64, u64, u64, f64, &'static str, u64, ParallelMode);

fn check_recipe(file: &str, want: &[Published], total_tokens: u64) {
    let path = root().join(file);
    let c = RunConfig::from_file(&path).unwrap_or_else(|e| panic!("{file}: {e}"));
    c.validate(&path).unwrap_or_else(|e| panic!("{file}: {e}"));
    assert_eq!(c.stages.len(), want.len(), "{file}: stages");
    let mut total = 0u64;
    for (i, (st, w)) in c.stages.iter().zip(want).enumerate() {
        let s = c.stage_settings(i);
        let got: Published = (st.seq_length, st.rope_theta, st.steps, s.tokens_per_step(), s.learning_rate, "", s.seed, s.mode);
        assert_eq!((got.0, got.1, got.2), (w.0, w.1, w.2), "{file} stage {i}: length, θ, steps");
        assert_eq!(got.3, w.3, "{file} stage {i}: tokens per optimizer step");
        assert_eq!((got.4, got.6, got.7), (w.4, w.6, w.7), "{file} stage {i}: lr, seed, mode");
        assert_eq!(s.dataset, w.5, "{file} stage {i}: dataset");
        assert_eq!(s.reset_optimizer, i > 0, "{file} stage {i}: a fresh optimizer per stage after the first");
        total += s.tokens_per_step() * st.steps;
    }
    assert_eq!(total, total_tokens, "{file}: tokens over the run");
    // zero3_offload.json: AdamW (0.9, 0.95), eps 1e-8, weight decay 0.1, constant lr, no
    // warmup, optimizer state on the host.
    let a = &c.train.adamw;
    assert_eq!((a.beta1, a.beta2, a.eps, a.weight_decay), (0.9, 0.95, 1e-8, 0.1), "{file}: AdamW");
    assert_eq!((c.train.warmup_steps, c.train.optimizer_on_host), (0, true), "{file}");
    assert_eq!(c.parallel.world_size, 8, "{file}: one node of 8 GPUs");
}

/// `recipes/EasyContext-1M-Llama-2-7B.toml` is EasyContext's
/// `train_scripts/EasyContext-1M-Llama-2-7B.sh` stage by stage: about 1M tokens per step,
/// 3.67B in all.
#[test]
fn easycontext_1m_recipe_matches_the_script() {
    use ParallelMode::{DataParallel as Dp, ZigzagRingAttn as Ring};
    let (up, c256, c1m) = (
        "yaofu/slimpajama-per-source-length-upsample",
        "PY007/slimpajama_llama_tokenized_upsample_4096_chunk_256K",
        "PY007/slimpajama_llama_tokenized_upsample_4096_chunk_1M",
    );
    let want: [Published; 7] = [
        (32768, 1e6, 1000, 1_048_576, 2e-5, up, 42, Dp),
        (65536, 5e6, 1000, 1_048_576, 2e-5, up, 2022, Dp),
        (256000, 1e7, 500, 1_024_000, 2e-5, c256, 2023, Ring),
        (256000, 2.5e7, 500, 1_024_000, 2e-5, c256, 2024, Ring),
        (256000, 5e7, 150, 1_024_000, 2e-5, c256, 2025, Ring),
        (512000, 1e8, 300, 1_024_000, 2e-5, c1m, 2026, Ring),
        (512000, 2.5e8, 90, 1_024_000, 1e-5, c1m, 2027, Ring),
    ];
    check_recipe("recipes/EasyContext-1M-Llama-2-7B.toml", &want, 3_674_112_000);
}

/// `recipes/EasyContext-256K-danube2-1.8B.toml` is `train_scripts/EasyContext-256K-danube2.sh`:
/// nine stages from 16K (θ 3e4) to 256K (θ 1e8), 1,024,000 tokens per step.
#[test]
fn easycontext_danube_recipe_matches_the_script() {
    use ParallelMode::{DataParallel as Dp, ZigzagRingAttn as Ring};
    let (c128, c1m) =
        ("PY007/slimpajama_mistral_tokenized_upsample_4096_chunk_128K", "PY007/slimpajama_mistral_tokenized_upsample_4096_chunk_1M");
    let t = 1_024_000;
    let want: [Published; 9] = [
        (16000, 3e4, 400, t, 2e-5, c128, 2024, Dp),
        (32000, 1e5, 400, t, 2e-5, c128, 2025, Dp),
        (32000, 3e5, 400, t, 2e-5, c128, 2026, Dp),
        (64000, 1e6, 400, t, 2e-5, c128, 2027, Ring),
        (64000, 2.5e6, 400, t, 2e-5, c128, 2028, Ring),
        (64000, 5e6, 400, t, 2e-5, c128, 2029, Ring),
        (128000, 1e7, 300, t, 2e-5, c128, 2030, Ring),
        (128000, 3e7, 200, t, 2e-5, c128, 2031, Ring),
        (256000, 1e8, 200, t, 2e-5, c1m, 2032, Ring),
    ];
    check_recipe("recipes/EasyContext-256K-danube2-1.8B.toml", &want, 3_174_400_000);
}

/// The first batch a stage's loader gives.
fn first_batch(c: &RunConfig, stage: usize) -> Vec<u32> {
    let m = longctx::hub::resolve_model_config(&c.model.source, &longctx::hub::HubOptions::from_env()).unwrap().cfg;
    let spec: DataSpec = stage_data_spec(c, &m, &c.stage_settings(stage)).unwrap();
    let mut l = Loader::new(&spec, None, Shard::SINGLE).unwrap();
    l.next_batch(2).unwrap().expect("a batch").ids
}

/// Stages of the same length read different first samples (seed + index by default, or
/// their own seed); the same seed given to both reads the same. Files and synthetic data.
#[test]
fn stage_seeds_give_different_first_samples() {
    let tmp = tempfile::tempdir().unwrap();
    let data = tmp.path().join("docs.jsonl");
    let lines: Vec<String> = (0..64u32)
        .map(|d| serde_json::json!({ "input_ids": (0..20).map(|k| 3 + (d * 20 + k) % 250).collect::<Vec<_>>() }).to_string())
        .collect();
    std::fs::write(&data, lines.join("\n")).unwrap();
    for dataset in [data.to_str().unwrap(), "synthetic:passkey"] {
        let mut c = RunConfig::plain();
        c.data.dataset = dataset.into();
        c.data.shuffle_buffer = 32;
        c.stages = vec![Stage::new(32, 1e4, 1), Stage::new(32, 1e5, 1), Stage { seed: Some(77), ..Stage::new(32, 1e5, 1) }];
        assert_eq!([c.stage_settings(0).seed, c.stage_settings(1).seed, c.stage_settings(2).seed], [42, 43, 77]);
        let (a, b, d) = (first_batch(&c, 0), first_batch(&c, 1), first_batch(&c, 2));
        assert_ne!(a, b, "{dataset}: stage 1 re-reads stage 0's first samples");
        assert_ne!(b, d, "{dataset}");
        c.stages[1].seed = Some(42);
        assert_eq!(first_batch(&c, 1), a, "{dataset}: the same seed, the same samples");
    }
}

/// A tiny two-stage run whose second stage has its own batch size and accumulation.
fn tiny_run(dir: &Path) -> RunConfig {
    let mut c = RunConfig { seed: 5, output_dir: dir.to_path_buf(), ..RunConfig::default() };
    c.train.batch_size = 2;
    c.train.learning_rate = 3e-3;
    c.parallel.token_chunk = 32;
    c.stages = vec![
        Stage::new(32, 1e4, 3),
        Stage { batch_size: Some(1), gradient_accumulate_every: Some(3), reset_optimizer: Some(true), ..Stage::new(32, 1e5, 2) },
    ];
    c.validate(Path::new("<test>")).unwrap();
    c
}

fn metrics(dir: &Path) -> Vec<serde_json::Value> {
    let text = std::fs::read_to_string(dir.join("metrics.jsonl")).unwrap();
    text.lines().map(|l| serde_json::from_str::<serde_json::Value>(l).unwrap()).filter(|v| v.get("loss").is_some()).collect()
}

/// Tokens per optimizer step follow each stage's batch × accumulation; the stage with a
/// fresh optimizer restarts the AdamW step count, and the checkpoint records where.
#[test]
fn per_stage_accumulation_sets_tokens_per_step() {
    let tmp = tempfile::tempdir().unwrap();
    let c = tiny_run(tmp.path());
    assert_eq!((c.stage_settings(0).tokens_per_step(), c.stage_settings(1).tokens_per_step()), (64, 96));
    let s = run(&c, false).unwrap();
    let tokens: Vec<u64> = metrics(tmp.path()).iter().map(|v| v["tokens"].as_u64().unwrap()).collect();
    assert_eq!(tokens, [64, 64, 64, 96, 96], "2 × 1 × 32, then 1 × 3 × 32");
    assert_eq!(s.tokens, 3 * 64 + 2 * 96);
    let state: serde_json::Value = serde_json::from_slice(&std::fs::read(tmp.path().join("checkpoint/state.json")).unwrap()).unwrap();
    assert_eq!((state["adam_step"].as_u64(), state["optimizer_since_step"].as_u64()), (Some(2), Some(3)), "{state}");
}

// ---- an independent TensorBoard event file reader -------------------------------------

/// CRC-32C, bit by bit (no table), and the TFRecord mask.
fn crc32c_bitwise(data: &[u8]) -> u32 {
    let mut crc = 0xffff_ffffu32;
    for &b in data {
        crc ^= u32::from(b);
        for _ in 0..8 {
            let lsb = crc & 1;
            crc >>= 1;
            if lsb == 1 {
                crc ^= 0x82f6_3b78;
            }
        }
    }
    crc ^ 0xffff_ffff
}

fn mask(crc: u32) -> u32 {
    crc.rotate_right(15).wrapping_add(0xa282_ead8)
}

/// The records of a TFRecord file, each length and data CRC checked.
fn records(bytes: &[u8]) -> Vec<Vec<u8>> {
    let mut out = Vec::new();
    let mut at = 0;
    while at < bytes.len() {
        let len_bytes = &bytes[at..at + 8];
        let len = u64::from_le_bytes(len_bytes.try_into().unwrap()) as usize;
        let len_crc = u32::from_le_bytes(bytes[at + 8..at + 12].try_into().unwrap());
        assert_eq!(len_crc, mask(crc32c_bitwise(len_bytes)), "length CRC of the record at byte {at}");
        let data = &bytes[at + 12..at + 12 + len];
        let data_crc = u32::from_le_bytes(bytes[at + 12 + len..at + 16 + len].try_into().unwrap());
        assert_eq!(data_crc, mask(crc32c_bitwise(data)), "data CRC of the record at byte {at}");
        out.push(data.to_vec());
        at += 16 + len;
    }
    assert_eq!(at, bytes.len(), "a truncated record");
    out
}

/// A protobuf field's value.
#[derive(Debug, Clone)]
enum Field {
    Varint(u64),
    Fixed64([u8; 8]),
    Fixed32([u8; 4]),
    Bytes(Vec<u8>),
}

fn varint(b: &[u8], at: &mut usize) -> u64 {
    let (mut v, mut shift) = (0u64, 0);
    loop {
        let byte = b[*at];
        *at += 1;
        v |= u64::from(byte & 0x7f) << shift;
        if byte & 0x80 == 0 {
            return v;
        }
        shift += 7;
    }
}

/// Every (field number, value) of a message, in order.
fn fields(b: &[u8]) -> Vec<(u64, Field)> {
    let (mut out, mut at) = (Vec::new(), 0);
    while at < b.len() {
        let key = varint(b, &mut at);
        let f = match key & 7 {
            0 => Field::Varint(varint(b, &mut at)),
            1 => {
                at += 8;
                Field::Fixed64(b[at - 8..at].try_into().unwrap())
            }
            2 => {
                let n = varint(b, &mut at) as usize;
                at += n;
                Field::Bytes(b[at - n..at].to_vec())
            }
            5 => {
                at += 4;
                Field::Fixed32(b[at - 4..at].try_into().unwrap())
            }
            w => panic!("wire type {w}"),
        };
        out.push((key >> 3, f));
    }
    out
}

/// Scalars per tag: step → value; and whether the version record came first.
fn read_events(file: &Path) -> (BTreeMap<String, BTreeMap<u64, f32>>, String) {
    let bytes = std::fs::read(file).unwrap();
    let recs = records(&bytes);
    let mut version = String::new();
    let mut scalars: BTreeMap<String, BTreeMap<u64, f32>> = BTreeMap::new();
    for (i, r) in recs.iter().enumerate() {
        let mut step = 0;
        let mut wall = 0f64;
        for (n, f) in fields(r) {
            match (n, f) {
                (1, Field::Fixed64(b)) => wall = f64::from_le_bytes(b),
                (2, Field::Varint(v)) => step = v,
                (3, Field::Bytes(b)) => {
                    assert_eq!(i, 0, "file_version is the first record");
                    version = String::from_utf8(b).unwrap();
                }
                (5, Field::Bytes(summary)) => {
                    for (n, value) in fields(&summary) {
                        let Field::Bytes(value) = value else { panic!("Summary.value") };
                        assert_eq!(n, 1);
                        let (mut tag, mut x) = (String::new(), None);
                        for (n, f) in fields(&value) {
                            match (n, f) {
                                (1, Field::Bytes(t)) => tag = String::from_utf8(t).unwrap(),
                                (2, Field::Fixed32(v)) => x = Some(f32::from_le_bytes(v)),
                                other => panic!("unexpected Summary.Value field {other:?}"),
                            }
                        }
                        scalars.entry(tag).or_default().insert(step, x.expect("simple_value"));
                    }
                }
                (6, Field::Bytes(_)) => {} // session_log
                other => panic!("unexpected Event field {other:?}"),
            }
        }
        assert!(wall > 1.6e9, "wall_time in seconds since the epoch: {wall}");
    }
    (scalars, version)
}

/// The run's event file holds loss, lr, tokens/s, grad norm and memory per global step,
/// the same values as metrics.jsonl (as f32).
#[test]
fn tensorboard_events_match_the_metrics() {
    let tmp = tempfile::tempdir().unwrap();
    let mut c = tiny_run(tmp.path());
    c.stages[0].steps = 2;
    c.stages.truncate(1);
    run(&c, false).unwrap();
    let files: Vec<PathBuf> = std::fs::read_dir(tmp.path().join("tensorboard")).unwrap().map(|e| e.unwrap().path()).collect();
    assert_eq!(files.len(), 1, "{files:?}");
    assert!(files[0].file_name().unwrap().to_string_lossy().starts_with("events.out.tfevents."), "TensorBoard's name pattern");
    let (scalars, version) = read_events(&files[0]);
    assert_eq!(version, "brain.Event:2");
    let lines = metrics(tmp.path());
    for tag in ["train/loss", "train/lr", "train/tokens_per_s", "train/grad_norm", "memory/saved_activation_gib"] {
        assert!(scalars.contains_key(tag), "{tag} missing: {:?}", scalars.keys());
    }
    for l in &lines {
        let g = l["global_step"].as_u64().unwrap();
        for (tag, key) in
            [("train/loss", "loss"), ("train/lr", "lr"), ("train/grad_norm", "grad_norm"), ("train/tokens_per_s", "tokens_per_s")]
        {
            assert_eq!(scalars[tag][&g], l[key].as_f64().unwrap() as f32, "{tag} at step {g}");
        }
    }
    assert_eq!(scalars["train/loss"].len(), lines.len());
}
