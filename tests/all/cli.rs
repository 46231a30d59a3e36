//! The `longctx` binary end to end: help texts, flag/TOML resolution, one clear error per
//! bad input (exit status 1, one `error:` line naming the field), every preset and recipe
//! validating, the tiny CPU recipe training and exporting, `export`, `inspect`, `plan`
//! and `launch`. Uses the dev binary (CARGO_BIN_EXE_longctx); never touches the network.

use longctx::train::config::{ParallelMode, RunConfig};
use std::path::{Path, PathBuf};

use crate::common;
use common::{fails, longctx_cmd as longctx, ok, repo_root as root, run, run_cmd};

fn tmp() -> tempfile::TempDir {
    tempfile::tempdir().unwrap()
}

fn write(dir: &Path, name: &str, text: &str) -> PathBuf {
    let p = dir.join(name);
    std::fs::write(&p, text).unwrap();
    p
}

/// A config.json shaped like Llama-2-7B (for `plan`, which reads only the config).
fn llama2_7b_dir(dir: &Path) -> PathBuf {
    let d = dir.join("llama-2-7b");
    std::fs::create_dir_all(&d).unwrap();
    write(
        &d,
        "config.json",
        r#"{"architectures":["LlamaForCausalLM"],"model_type":"llama","hidden_size":4096,
            "intermediate_size":11008,"num_hidden_layers":32,"num_attention_heads":32,
            "num_key_value_heads":32,"max_position_embeddings":4096,"vocab_size":32000,
            "rms_norm_eps":1e-5,"rope_theta":10000.0,"tie_word_embeddings":false}"#,
    );
    d
}

#[test]
fn help_lists_every_flag() {
    let cases: [(&[&str], &[&str]); 8] = [
        (&["--help"], &["train", "export", "inspect", "plan", "launch", "bench"]),
        (
            &["train", "--help"],
            &[
                "--config",
                "--batch-size",
                "--gradient-accumulate-every",
                "--output-dir",
                "--max-train-steps",
                "--learning-rate",
                "--dataset",
                "--dataset-column",
                "--model",
                "--seq-length",
                "--rope-theta",
                "--parallel-mode",
                "--fpdt-chunk-size",
                "--fpdt-offload",
                "--world-size",
                "--sp-size",
                "--ulysses-size",
                "--offload-activations",
                "--offload-layer-inputs",
                "--token-chunk",
                "--dtype",
                "--device",
                "--seed",
                "--checkpoint-every",
                "--no-save",
                "--resume",
                "--final-rope-theta",
                "--dry-run",
                "zigzag_ring_attn",
            ],
        ),
        (&["export", "--help"], &["<SOURCE>", "--output-dir", "--rope-theta", "--max-position-embeddings", "--max-shard-size", "--dtype"]),
        (&["inspect", "--help"], &["--model", "--seq-length", "--gpus", "--gpu-memory", "--parallel-mode", "--json"]),
        (
            &["plan", "--help"],
            &[
                "--model", "--config", "--seq-length", "--gpus", "--nnodes", "--world-size", "--gpu-memory", "--host-memory",
                "--parallel-mode", "--sp-size", "--ulysses-size", "--fpdt-chunk-size", "--fpdt-offload", "--offload-activations",
                "--offload-layer-inputs", "--token-chunk", "--batch-size", "--dtype", "--optimizer-on-device", "--overhead", "--json",
            ],
        ),
        (&["launch", "--help"], &["--nproc-per-node", "--nnodes", "--node-rank", "--master-addr", "--master-port", "--rdzv-timeout"]),
        (&["bench", "attention", "--help"], &["--seq", "--heads", "--head-dim", "--dtype", "--check"]),
        (
            &["bench", "engine", "--help"],
            &[
                "--model", "--seq", "--batch", "--token-chunk", "--dtype", "--device", "--offload", "--warmup", "--iters", "--tolerance",
                "--seed",
            ],
        ),
    ];
    for (args, flags) in cases {
        let o = ok(args);
        for f in flags {
            assert!(o.stdout.contains(f), "`longctx {}` does not mention {f}:\n{}", args.join(" "), o.stdout);
        }
    }
}

/// `bench engine` on the CPU: both settings run, one JSON line each plus the gradient
/// comparison, which passes (offload changes nothing on the CPU: difference 0).
#[test]
fn bench_engine_on_the_cpu() {
    let o = ok(&["bench", "engine", "--model", "builtin:tiny", "--device", "cpu", "--seq", "64,96", "--token-chunk", "40", "--iters", "2"]);
    let lines: Vec<serde_json::Value> = o.stdout.lines().map(|l| serde_json::from_str(l).unwrap()).collect();
    assert_eq!(lines.len(), 6, "{}", o.stdout);
    for seq in [64, 96] {
        let cmp = lines.iter().find(|l| l["seq"] == seq && l.get("grad_diff_offload").is_some()).unwrap();
        assert_eq!(cmp["grad_diff_offload"].as_f64(), Some(0.0), "{cmp}");
        assert_eq!(cmp["ok"], true);
        let host = lines.iter().find(|l| l["seq"] == seq && l["offload"] == true).unwrap();
        assert_eq!(host["host_bytes"], host["saved_bytes"], "{host}");
        assert!(host["tokens_per_s"].as_f64().unwrap() > 0.0);
    }
    fails(&run(&["bench", "engine", "--device", "cpu", "--model", "builtin:tiny", "--iters", "0"]), &["--iters"], true);
    fails(&run(&["bench", "engine", "--device", "cpu", "--model", "builtin:tiny", "--seq", "64,0"]), &["--seq", "at least 1"], true);
}

/// `bench engine` refuses a length that cannot fit before it allocates anything (it
/// aborted allocating 25.6 GB for 10⁸ tokens of the tiny model): the estimate, what the
/// machine has and the fix, whatever the machine (10⁹ tokens need terabytes).
#[test]
fn bench_engine_refuses_what_cannot_fit() {
    let o = run(&["bench", "engine", "--device", "cpu", "--model", "builtin:tiny", "--seq", "64,1000000000"]);
    let e =
        fails(&o, &["--seq 1000000000 (batch 1): needs an estimated ", " GB on cpu, the host memory available is ", "lower --seq"], true);
    // the figures in their places: the estimate (terabytes) against what the machine has
    let num = |after: &str| -> f64 {
        let rest = &e[e.find(after).unwrap() + after.len()..];
        rest.split(' ').next().unwrap().parse().unwrap_or_else(|_| panic!("no number after `{after}`: {e}"))
    };
    let (need, have) = (num("needs an estimated "), num("available is "));
    assert!(need > 1000.0 && have > 0.0 && need > have, "{e}");
    assert!(o.stdout.is_empty(), "nothing may run before the check: {}", o.stdout);
}

/// `bench attention`: a bad throughput shape is one clear error before any device is
/// opened (so also in a build without CUDA).
#[test]
fn bench_attention_shape_errors() {
    fails(&run(&["bench", "attention", "--heads", "32", "--kv-heads", "5"]), &["--kv-heads 5", "multiple"], false);
    fails(&run(&["bench", "attention", "--seq", "0"]), &["--seq", "at least 1"], false);
}

/// `bench optimizer`: runs on a small shard and reports its time scaled to 7B; bad counts
/// are one clear error.
#[test]
fn bench_optimizer_on_the_cpu() {
    let o = ok(&["bench", "optimizer", "--params", "100000", "--iters", "2", "--threads", "1"]);
    assert!(o.stdout.contains("host AdamW, 100000 parameters, 1 threads") && o.stdout.contains("Llama-2-7B"), "{}", o.stdout);
    fails(&run(&["bench", "optimizer", "--params", "1.5"]), &["--params", "whole count"], false);
}

/// `bench engine --check-grads` on the CPU (f32: the autograd run equals the reference,
/// so the explicit path must be within the stated tolerance of it), with and without
/// saved attention; the explicit path rounds differently from autograd (deterministically
/// on the CPU), so a tolerance of 0 fails.
#[test]
fn bench_engine_check_grads_on_the_cpu() {
    let base = ["bench", "engine", "--model", "builtin:tiny", "--device", "cpu", "--seq", "64", "--token-chunk", "40", "--check-grads"];
    for extra in [&[][..], &["--save-attention"][..]] {
        let args: Vec<&str> = base.iter().chain(extra).chain(&["--tolerance", "1e-5"]).copied().collect();
        let o = ok(&args);
        let line: serde_json::Value = serde_json::from_str(o.stdout.trim()).unwrap();
        assert_eq!(line["grad_diff_autograd"].as_f64(), Some(0.0), "{line}");
        let d = line["grad_diff_explicit"].as_f64().unwrap();
        assert!(d > 0.0 && d <= 1e-5, "{line}");
        assert_eq!(line["ok"], true);
    }
    fails(&run(&base), &["twice the autograd path"], false);
}

#[test]
fn train_flags_override_the_toml() {
    let d = tmp();
    let cfg = write(
        d.path(),
        "run.toml",
        "output_dir = \"from-toml\"\n[train]\nbatch_size = 2\nlearning_rate = 1e-3\ngradient_accumulate_every = 3\n\
         [parallel]\nmode = \"zigzag_ring_attn\"\nworld_size = 2\n\
         [[stage]]\nseq_length = 128\nrope_theta = 1e4\nsteps = 10\n[[stage]]\nseq_length = 256\nrope_theta = 1e5\nsteps = 10\n",
    );
    let c = cfg.to_str().unwrap();
    // Without flags: the TOML's values.
    let o = ok(&["train", "--config", c, "--dry-run"]);
    let r: RunConfig = toml::from_str(&o.stdout).unwrap();
    assert_eq!((r.train.batch_size, r.train.gradient_accumulate_every, r.stages.len()), (2, 3, 2));
    assert_eq!(r.parallel.mode, ParallelMode::ZigzagRingAttn);
    // Flags win; --seq-length/--rope-theta make one stage of --max-train-steps steps.
    let o = ok(&[
        "train", "--config", c, "--dry-run", "--batch-size", "3", "--learning-rate", "5e-4", "--output-dir", "from-flags",
        "--parallel-mode", "ulysses_attn", "--seq-length", "512", "--rope-theta", "5e5", "--max-train-steps", "7", "--token-chunk", "64",
    ]);
    let r: RunConfig = toml::from_str(&o.stdout).unwrap();
    assert_eq!(r.train.batch_size, 3);
    assert_eq!(r.train.gradient_accumulate_every, 3, "not overridden, kept from the TOML");
    assert_eq!(r.train.learning_rate, 5e-4);
    assert_eq!(r.output_dir, PathBuf::from("from-flags"));
    assert_eq!(r.parallel.mode, ParallelMode::UlyssesAttn);
    assert_eq!(r.parallel.world_size, 2);
    assert_eq!(r.parallel.token_chunk, 64);
    assert_eq!(r.stages.len(), 1);
    assert_eq!((r.stages[0].seq_length, r.stages[0].rope_theta, r.stages[0].steps), (512, 5e5, 7));
    // --max-train-steps alone caps every stage; --rope-theta alone sets every stage's theta.
    let o = ok(&["train", "--config", c, "--dry-run", "--max-train-steps", "4", "--rope-theta", "2e5"]);
    let r: RunConfig = toml::from_str(&o.stdout).unwrap();
    assert!(r.stages.iter().all(|s| s.steps == 4 && s.rope_theta == 2e5));
}

/// `--parallel-mode` and `--fpdt-chunk-size` replace a stage's own choice too (as the
/// training flags do), so every stage runs the mode the command line names.
#[test]
fn parallel_flags_replace_each_stages_own_choice() {
    let d = tmp();
    let cfg = write(
        d.path(),
        "modes.toml",
        "[parallel]\nworld_size = 2\n[[stage]]\nseq_length = 128\nrope_theta = 1e4\nsteps = 1\nparallel_mode = \"fpdt\"\n\
         fpdt_chunk_size = 64\n[[stage]]\nseq_length = 256\nrope_theta = 1e5\nsteps = 1\n",
    );
    let c = cfg.to_str().unwrap();
    let r: RunConfig = toml::from_str(&ok(&["train", "--config", c, "--dry-run"]).stdout).unwrap();
    assert_eq!(r.stages[0].parallel_mode, Some(ParallelMode::Fpdt), "without the flag the stage keeps its own");
    let o = ok(&["train", "--config", c, "--dry-run", "--parallel-mode", "ulysses_attn", "--fpdt-chunk-size", "128"]);
    let r: RunConfig = toml::from_str(&o.stdout).unwrap();
    assert!(r.stages.iter().all(|s| s.parallel_mode.is_none() && s.fpdt_chunk_size.is_none()), "{:?}", r.stages);
    assert_eq!(r.parallel.mode, ParallelMode::UlyssesAttn);
}

#[test]
fn zigzag_length_not_divisible_by_2w() {
    let o = run(&[
        "train", "--dry-run", "--parallel-mode", "zigzag_ring_attn", "--world-size", "4", "--seq-length", "100", "--rope-theta", "1e4",
    ]);
    fails(&o, &["stage[0].seq_length", "2·4 = 8", "100"], true);
}

#[test]
fn fpdt_chunk_layout() {
    let o = run(&[
        "train", "--dry-run", "--parallel-mode", "fpdt", "--world-size", "2", "--seq-length", "1000", "--rope-theta", "1e4",
        "--fpdt-chunk-size", "256",
    ]);
    fails(&o, &["stage[0].seq_length", "multiple of the chunk size 256"], true);
    let o = run(&[
        "train", "--dry-run", "--parallel-mode", "fpdt", "--world-size", "4", "--seq-length", "1024", "--rope-theta", "1e4",
        "--fpdt-chunk-size", "254",
    ]);
    fails(&o, &["parallel.fpdt_chunk_size", "multiple of sp_size 4"], true);
}

#[test]
fn heads_not_divisible_for_ulysses() {
    // builtin:tiny has 4 query / 2 kv heads: Ulysses over 8 ranks cannot split them.
    let o =
        run(&["train", "--dry-run", "--parallel-mode", "ulysses_attn", "--world-size", "8", "--seq-length", "256", "--rope-theta", "1e4"]);
    fails(&o, &["parallel.mode", "4 query heads", "ulysses = 8"], true);
    // ...over 4 ranks it can (kv heads replicated).
    ok(&["train", "--dry-run", "--parallel-mode", "ulysses_attn", "--world-size", "4", "--seq-length", "256", "--rope-theta", "1e4"]);
}

#[test]
fn non_positive_theta() {
    fails(&run(&["train", "--dry-run", "--seq-length", "256", "--rope-theta", "0"]), &["stage[0].rope_theta", "positive"], true);
    fails(&run(&["train", "--dry-run", "--rope-theta", "-5"]), &["rope_theta", "positive", "-5"], true);
    fails(&run(&["train", "--dry-run", "--final-rope-theta", "-1"]), &["export.final_rope_theta", "positive"], true);
    fails(&run(&["export", "runs/none", "-o", "x", "--rope-theta", "-2"]), &["--rope-theta", "positive"], true);
}

#[test]
fn stages_must_not_decrease() {
    let d = tmp();
    let cfg = write(
        d.path(),
        "dec.toml",
        "[[stage]]\nseq_length = 512\nrope_theta = 1e5\nsteps = 2\n[[stage]]\nseq_length = 256\nrope_theta = 1e6\nsteps = 2\n",
    );
    fails(
        &run(&["train", "--config", cfg.to_str().unwrap(), "--dry-run"]),
        &["dec.toml", "stage[1].seq_length", "must not decrease"],
        true,
    );
    let cfg = write(
        d.path(),
        "dec2.toml",
        "[[stage]]\nseq_length = 256\nrope_theta = 1e6\nsteps = 2\n[[stage]]\nseq_length = 512\nrope_theta = 1e5\nsteps = 2\n",
    );
    fails(&run(&["train", "--config", cfg.to_str().unwrap(), "--dry-run"]), &["dec2.toml", "stage[1]", "must not decrease"], true);
}

#[test]
fn unknown_parallel_mode() {
    fails(&run(&["train", "--dry-run", "--parallel-mode", "ring"]), &["--parallel-mode", "`ring`", "zigzag_ring_attn"], true);
    // A bad dtype is caught by the dry run even for a CPU run (which trains in f32).
    fails(&run(&["train", "--dry-run", "--dtype", "bf17"]), &["model.dtype", "`bf17`"], true);
    let d = tmp();
    let cfg = write(d.path(), "m.toml", "[parallel]\nmode = \"ring\"\n[[stage]]\nseq_length = 256\nrope_theta = 1e4\nsteps = 1\n");
    fails(&run(&["train", "--config", cfg.to_str().unwrap(), "--dry-run"]), &["m.toml", "field `parallel.mode`", "ring"], true);
    // A bad value inside the second stage names that stage's key.
    let cfg = write(
        d.path(),
        "s.toml",
        "[[stage]]\nseq_length = 256\nrope_theta = 1e4\nsteps = 1\n[[stage]]\nseq_length = 512\nrope_theta = 1e5\nsteps = -3\n",
    );
    fails(&run(&["train", "--config", cfg.to_str().unwrap(), "--dry-run"]), &["s.toml", "field `stage[1].steps`", "-3"], true);
    fails(
        &run(&["plan", "--model", "builtin:tiny", "--seq-length", "256", "--parallel-mode", "ring"]),
        &["--parallel-mode", "`ring`"],
        true,
    );
}

#[test]
fn unknown_config_field() {
    let d = tmp();
    let cfg = write(d.path(), "typo.toml", "[train]\nbatch_sise = 2\n[[stage]]\nseq_length = 256\nrope_theta = 1e4\nsteps = 1\n");
    fails(&run(&["train", "--config", cfg.to_str().unwrap(), "--dry-run"]), &["typo.toml", "train.batch_sise"], true);
}

#[test]
fn stage_less_config_needs_a_length() {
    let d = tmp();
    let cfg = write(d.path(), "nostage.toml", "[train]\nbatch_size = 2\n");
    let c = cfg.to_str().unwrap();
    fails(&run(&["train", "--config", c, "--dry-run"]), &["nostage.toml", "`stage`", "--seq-length"], true);
    ok(&["train", "--config", c, "--dry-run", "--seq-length", "256", "--rope-theta", "1e4"]);
}

#[test]
fn dataset_without_the_named_column() {
    let d = tmp();
    let mut lines = String::new();
    for i in 0..8 {
        let ids: Vec<String> = (0..80).map(|j| ((i * 7 + j) % 250 + 3).to_string()).collect();
        lines += &format!("{{\"input_ids\": [{}]}}\n", ids.join(","));
    }
    let data = write(d.path(), "ids.jsonl", &lines);
    let out = d.path().join("run");
    let o = run(&[
        "train",
        "--dataset",
        data.to_str().unwrap(),
        "--dataset-column",
        "text",
        "--seq-length",
        "64",
        "--rope-theta",
        "1e4",
        "--max-train-steps",
        "1",
        "--output-dir",
        out.to_str().unwrap(),
    ]);
    fails(&o, &["ids.jsonl", "`text`", "input_ids"], false);
}

/// `--no-save` (`train.save = false`): the run trains and writes its metrics, but no
/// checkpoint and no export; a stop that would need a checkpoint is refused up front.
#[test]
fn no_save_writes_only_metrics() {
    let d = tmp();
    let out = d.path().join("run");
    let out_s = out.to_str().unwrap();
    let base = [
        "train", "--model", "builtin:tiny", "--device", "cpu", "--dataset", "synthetic:passkey", "--seq-length", "64", "--rope-theta",
        "1e4", "--max-train-steps", "2", "--output-dir", out_s, "--no-save", "-q",
    ];
    let o = ok(&base);
    assert!(o.stdout.contains("nothing saved"), "{}", o.stdout);
    let metrics = std::fs::read_to_string(out.join("metrics.jsonl")).unwrap();
    assert_eq!(metrics.lines().filter(|l| l.contains("\"loss\"")).count(), 2, "{metrics}");
    let mut names: Vec<String> = std::fs::read_dir(&out).unwrap().map(|e| e.unwrap().file_name().to_string_lossy().into_owned()).collect();
    names.sort();
    assert_eq!(names, [".longctx.lock", "config.toml", "metrics.jsonl", "tensorboard"], "only the metrics, the config and the events");
    let other = d.path().join("other");
    let other_s = other.to_str().unwrap();
    let with = |extra: &[&str]| {
        let mut a: Vec<&str> = base.iter().map(|&x| if x == out_s { other_s } else { x }).collect();
        a.extend_from_slice(extra);
        run(&a)
    };
    fails(&with(&["--stop-at-step", "1"]), &["--stop-at-step 1", "--no-save", "drop one"], true);
    fails(&with(&["--checkpoint-every", "1"]), &["train.checkpoint_every", "--no-save", "drop one"], true);
}

#[test]
fn more_ranks_than_gpus() {
    let o = run(&["plan", "--model", "builtin:tiny", "--seq-length", "256", "--gpus", "4", "--world-size", "8"]);
    fails(&o, &["world_size", "8 ranks", "4 GPU"], true);
}

#[test]
fn every_preset_and_recipe_passes_dry_run() {
    let mut n = 0;
    for dir in ["configs", "recipes"] {
        let mut files: Vec<PathBuf> = std::fs::read_dir(root().join(dir)).unwrap().map(|e| e.unwrap().path()).collect();
        files.sort();
        for f in files.into_iter().filter(|f| f.extension().is_some_and(|e| e == "toml")) {
            let args = ["train", "--config", f.to_str().unwrap(), "--dry-run"];
            let o = run(&args);
            // A recipe over a corpus that a script makes (SmolLM2-135M-64K: data/longdocs,
            // not in a clean clone) names the missing file; with a dataset given it plans.
            let o = if o.code != 0 {
                fails(&o, &["dataset not found", "data/", "--dataset"], false);
                ok(&[&args[..], &["--dataset", "tests/fixtures/arrow_dataset_train.jsonl"]].concat())
            } else {
                o
            };
            let r: RunConfig = toml::from_str(&o.stdout).unwrap();
            assert!(!r.stages.is_empty(), "{}", f.display());
            n += 1;
        }
    }
    assert!(n >= 9, "expected 5 presets and 4 recipes, found {n}");
}

/// EasyContext's spellings of the flags (and its mode name usp_attn, its --ring_degree)
/// resolve to the same config as longctx's own: each alias alone, then a whole
/// EasyContext command line.
#[test]
fn easycontext_flag_spellings_resolve_to_the_same_config() {
    let d = tmp();
    let out = d.path().join("o");
    let out = out.to_str().unwrap();
    let base = ["train", "--dry-run", "--model", "builtin:tiny", "--world-size", "4"];
    let pairs: [(&[&str], &[&str]); 14] = [
        (&["--batch-size", "2"], &["--batch_size", "2"]),
        (&["--gradient-accumulate-every", "3"], &["--gradient_accumulate_every", "3"]),
        (&["--learning-rate", "1e-4"], &["--learning_rate", "1e-4"]),
        (&["--max-train-steps", "5"], &["--max_train_steps", "5"]),
        (&["--seq-length", "256"], &["--seq_length", "256"]),
        (&["--rope-theta", "1e5"], &["--rope_theta", "1e5"]),
        (&["--output-dir", out], &["--output_dir", out]),
        (&["--parallel-mode", "ulysses_attn"], &["--parallel_mode", "ulysses_attn"]),
        (&["--parallel-mode", "usp", "--ulysses-size", "2"], &["--parallel_mode", "usp_attn", "--ring_degree", "2"]),
        (&["--parallel-mode", "usp", "--ulysses-size", "4"], &["--parallel-mode", "usp", "--ring-degree", "1"]),
        (&["--warmup-steps", "3"], &["--warmup_steps", "3"]),
        (&["--dataset-column", "text"], &["--dataset_column", "text"]),
        (&["--sp-size", "2", "--parallel-mode", "zigzag_ring_attn"], &["--sp_size", "2", "--parallel_mode", "zigzag_ring_attn"]),
        (&["--seed", "7"], &["--seed", "7", "--wandb", "EasyContext"]),
    ];
    // The plan's disk line ends with the free space of the output directory's filesystem,
    // which other tests running beside this one change between the two runs.
    let settled = |o: &str| -> String {
        o.lines()
            .map(|l| if l.starts_with("#   disk:") { l.rsplit_once(" (").map_or(l, |(head, _)| head) } else { l })
            .collect::<Vec<_>>()
            .join("\n")
    };
    for (canon, alias) in pairs {
        let a = ok(&[&base[..], canon].concat());
        let b = ok(&[&base[..], alias].concat());
        assert_eq!(settled(&a.stdout), settled(&b.stdout), "{canon:?} vs {alias:?}");
    }
    // A line of EasyContext's 1M script (stage 2), with our model and world size.
    let easy = ok(&[
        &base[..],
        &[
            "--batch-size",
            "1",
            "--gradient-accumulate-every",
            "4",
            "--output-dir",
            out,
            "--seed",
            "2023",
            "--wandb",
            "EasyContext",
            "--max-train-steps",
            "500",
            "--learning-rate",
            "2e-5",
            "--seq-length",
            "256",
            "--rope-theta",
            "10000000",
            "--parallel_mode",
            "zigzag_ring_attn",
        ],
    ]
    .concat());
    let r: RunConfig = toml::from_str(&easy.stdout).unwrap();
    assert_eq!(
        (r.parallel.mode, r.seed, r.stages[0].steps, r.train.gradient_accumulate_every),
        (ParallelMode::ZigzagRingAttn, 2023, 500, 4)
    );
    assert!(easy.stdout.contains("tokens/step"), "the dry run prints the plan:\n{}", easy.stdout);
    assert!(easy.stderr.contains("wandb sync --sync-tensorboard"), "{}", easy.stderr);
    // A misspelled flag: clap's whole message, with its hint.
    let o = run(&["train", "--parallel-modes", "usp"]);
    assert_eq!(o.code, 1);
    assert!(o.stderr.contains("error: unexpected argument '--parallel-modes'"), "{}", o.stderr);
    assert!(o.stderr.contains("similar argument exists") && o.stderr.contains("--parallel-mode"), "{}", o.stderr);
    let o = run(&["train", "--dry-run", "--parallel_mode", "dist_flash_attn"]);
    fails(&o, &["--parallel-mode", "dist_flash_attn", "zigzag_ring_attn"], true);
    let o = run(&["train", "--dry-run", "--world-size", "4", "--parallel-mode", "usp", "--ring-degree", "3"]);
    fails(&o, &["--ring-degree", "divisor", "4"], true);
}

/// `train --dry-run` prints the plan after the config, as TOML comments: per stage the
/// tokens per optimizer step and the total.
#[test]
fn dry_run_prints_tokens_per_step() {
    let o = ok(&["train", "--config", "recipes/EasyContext-1M-Llama-2-7B.toml", "--dry-run"]);
    let r: RunConfig = toml::from_str(&o.stdout).unwrap();
    assert_eq!(r.stages.len(), 7);
    assert!(o.stdout.contains("#   stage 0: 32K tokens") && o.stdout.contains("= 1,048,576 tokens/step"), "{}", o.stdout);
    assert!(o.stdout.contains("= 1,024,000 tokens/step") && o.stdout.contains("total: 3,674,112,000 tokens"), "{}", o.stdout);
}

#[test]
fn easycontext_recipe_has_the_issue_stages() {
    let r = RunConfig::from_file(&root().join("recipes/EasyContext-1M-Llama-2-7B.toml")).unwrap();
    let got: Vec<(usize, f64)> = r.stages.iter().map(|s| (s.seq_length, s.rope_theta)).collect();
    let want = vec![(32768, 1e6), (65536, 5e6), (256000, 1e7), (256000, 2.5e7), (256000, 5e7), (512000, 1e8), (512000, 2.5e8)];
    assert_eq!(got, want);
    assert_eq!(r.export.final_rope_theta, Some(1e9));
    let f = RunConfig::from_file(&root().join("recipes/FPDT-256K-6.7B.toml")).unwrap();
    assert_eq!(
        (f.parallel.mode, f.parallel.fpdt_chunk_size, f.parallel.fpdt_offload, f.parallel.world_size),
        (ParallelMode::Fpdt, 65536, true, 4)
    );
}

/// Every stage of the Llama-2-7B recipes fits on H200s (the default: 143,771 MiB as the
/// driver reports it) by the planner.
#[test]
fn recipes_fit_by_the_planner() {
    let d = tmp();
    let m = llama2_7b_dir(d.path());
    for recipe in ["recipes/EasyContext-1M-Llama-2-7B.toml", "recipes/FPDT-256K-6.7B.toml"] {
        let o = ok(&["plan", "--config", recipe, "--model", m.to_str().unwrap(), "--json"]);
        let v: serde_json::Value = serde_json::from_str(&o.stdout).unwrap();
        let plans = v.as_array().expect("one plan per stage");
        assert!(plans.len() >= 2);
        for p in plans {
            assert_eq!(p["estimate"]["fits"], true, "{recipe}: {}", p["request"]);
            assert_eq!(p["request"]["gpu_memory"], 143_771u64 * 1024 * 1024);
        }
    }
}

#[test]
fn plan_text_and_json() {
    let d = tmp();
    let m = llama2_7b_dir(d.path());
    let m = m.to_str().unwrap();
    // The hand-computed peak of tests/all/plan.rs (zigzag, 512K, 8 GPUs).
    let o = ok(&[
        "plan", "--model", m, "--seq-length", "512K", "--gpus", "8", "--parallel-mode", "zigzag_ring_attn", "--optimizer-on-host", "--json",
    ]);
    let v: serde_json::Value = serde_json::from_str(&o.stdout).unwrap();
    assert_eq!(v["estimate"]["device"]["peak"], 75_856_690_688u64);
    assert_eq!(v["suggestion"]["as_requested"], true);
    // Text: a verdict and a usable suggestion.
    let o = ok(&["plan", "--model", m, "--seq-length", "512K", "--gpus", "8", "--parallel-mode", "data_parallel"]);
    assert!(o.stdout.contains("does NOT fit"), "{}", o.stdout);
    assert!(o.stdout.contains("suggestion: --parallel-mode ulysses_attn --sp-size 4"), "{}", o.stdout);
    // The last lever as a flag (tests/all/plan.rs has the bytes): given back, the flags fit.
    let base = ["plan", "--model", m, "--seq-length", "384K", "--gpu-memory", "80GB", "--host-memory", "256GB"];
    let o = ok(&base);
    let flags = o.stdout.split("suggestion: ").nth(1).and_then(|t| t.split(" (").next()).unwrap_or_else(|| panic!("{}", o.stdout));
    assert!(flags.contains("--offload-gradients") && flags.contains("--offload-params"), "{}", o.stdout);
    let o = ok(&[&base[..], &flags.split_whitespace().collect::<Vec<_>>()].concat());
    assert!(o.stdout.contains("suggestion: as requested (") && !o.stdout.contains("does NOT fit"), "{}", o.stdout);
}

/// The planner's partial MLP suggestion as text: at 256K on 8 GPUs (zigzag) the attention and
/// the MLP of some top layers fit (tests/all/plan.rs has the bytes); the flag it names is
/// the one that, given back, makes the request what it suggests.
#[test]
fn plan_suggests_mlp_layers_as_flags() {
    let d = tmp();
    let m = llama2_7b_dir(d.path());
    let m = m.to_str().unwrap();
    let base = ["plan", "--model", m, "--seq-length", "256K", "--gpus", "8", "--parallel-mode", "zigzag_ring_attn", "--optimizer-on-host"];
    let o = ok(&base);
    let tail = o.stdout.split("suggestion: as requested, with --save-attention --save-mlp-layers ").nth(1);
    let n: usize = tail.and_then(|t| t.split_whitespace().next()).and_then(|n| n.parse().ok()).unwrap_or_else(|| panic!("{}", o.stdout));
    assert!((1..32).contains(&n), "{}", o.stdout);
    let n_s = n.to_string();
    let o = ok(&[&base[..], &["--save-attention", "--save-mlp-layers", &n_s]].concat());
    assert!(o.stdout.contains(&format!("MLP input, gate, up of the top {n} of 32 layers")), "{}", o.stdout);
    assert!(o.stdout.contains("suggestion: as requested ("), "{}", o.stdout);
    // Past the model's layers: refused, naming the field and the bound.
    fails(&run(&[&base[..], &["--save-mlp-layers", "33"]].concat()), &["save_mlp_layers", "got 33", "32 layers"], false);
}

#[test]
fn inspect_fixture() {
    let o = ok(&["inspect", "--model", "tests/fixtures/llama_gqa_bias", "--json"]);
    let v: serde_json::Value = serde_json::from_str(&o.stdout).unwrap();
    // hidden 64, mlp 128, 2 layers, 4 q / 2 kv heads × 16, vocab 128, attention and MLP biases:
    // embed 8192 + 2 × (q 4160 + k 2080 + v 2080 + o 4160 + gate 8320 + up 8320 + down 8256
    // + norms 128) + norm 64 + head 8192 = 91,456.
    assert_eq!(v["parameters"], 91_456);
    assert_eq!(v["parameters_from_config"], 91_456);
    assert_eq!(v["stored"]["dtypes"]["F32"], 91_456);
    assert_eq!(v["architecture"], "LlamaForCausalLM");
    assert_eq!(v["rope_theta"], 500000.0);
    assert_eq!(v["max_position_embeddings"], 2048);
    assert_eq!(
        (v["num_attention_heads"].as_u64(), v["num_key_value_heads"].as_u64(), v["head_dim"].as_u64()),
        (Some(4), Some(2), Some(16))
    );
    assert_eq!(v["memory"]["request"]["seq_len"], 2048, "defaults to max_position_embeddings");
    assert_eq!(v["memory"]["estimate"]["fits"], true);
    let o = ok(&["inspect", "--model", "tests/fixtures/llama_yarn", "--seq-length", "4K"]);
    assert!(o.stdout.contains("yarn"), "{}", o.stdout);
    assert!(o.stdout.contains("at 4K tokens"), "{}", o.stdout);
}

/// The tiny CPU recipe end to end, then `export` of its checkpoint and `inspect` of the result.
#[test]
fn tiny_recipe_trains_exports_and_reexports() {
    let d = tmp();
    let out = d.path().join("run");
    let o = ok(&["train", "--config", "recipes/tiny-cpu.toml", "--output-dir", out.to_str().unwrap()]);
    assert!(o.stdout.contains("exported to"), "{}", o.stdout);
    let recipe = RunConfig::from_file(&root().join("recipes/tiny-cpu.toml")).unwrap();
    let final_theta = recipe.export.final_rope_theta.unwrap();
    let cfg: serde_json::Value = serde_json::from_slice(&std::fs::read(out.join("export/config.json")).unwrap()).unwrap();
    assert_eq!(cfg["rope_theta"].as_f64(), Some(final_theta));
    assert_eq!(cfg["max_position_embeddings"], 256);
    assert!(out.join("checkpoint/state.json").is_file());

    // Re-export the run's checkpoint with another theta, sharded, same weights bit for bit.
    let re = d.path().join("re");
    let o = ok(&["export", out.to_str().unwrap(), "-o", re.to_str().unwrap(), "--rope-theta", "1e6", "--max-shard-size", "100KB"]);
    assert!(o.stdout.contains("rope_theta 1000000"), "{}", o.stdout);
    let cfg: serde_json::Value = serde_json::from_slice(&std::fs::read(re.join("config.json")).unwrap()).unwrap();
    assert_eq!(cfg["rope_theta"].as_f64(), Some(1e6));
    assert_eq!(cfg["max_position_embeddings"], 256);
    assert!(re.join("model.safetensors.index.json").is_file(), "100KB shards of a 500 kB model");
    let a = longctx::hub::load_weights(out.join("export"), candle_core::DType::F32, &candle_core::Device::Cpu).unwrap();
    let b = longctx::hub::load_weights(&re, candle_core::DType::F32, &candle_core::Device::Cpu).unwrap();
    assert_eq!(a.len(), b.len());
    for (name, t) in &a {
        let x: Vec<f32> = t.flatten_all().unwrap().to_vec1().unwrap();
        let y: Vec<f32> = b[name].flatten_all().unwrap().to_vec1().unwrap();
        assert!(x == y, "{name} differs between the run's export and the re-export");
    }
    // From the checkpoint directory itself, bf16, default theta = the run's final one.
    let bf = d.path().join("bf16");
    ok(&["export", out.join("checkpoint").to_str().unwrap(), "-o", bf.to_str().unwrap(), "--dtype", "bf16"]);
    let cfg: serde_json::Value = serde_json::from_slice(&std::fs::read(bf.join("config.json")).unwrap()).unwrap();
    assert_eq!(cfg["rope_theta"].as_f64(), Some(final_theta));
    assert_eq!(cfg["torch_dtype"], "bfloat16");
    // Inspect the export.
    let o = ok(&["inspect", "--model", bf.to_str().unwrap(), "--json"]);
    let v: serde_json::Value = serde_json::from_str(&o.stdout).unwrap();
    assert_eq!(v["stored"]["dtypes"]["BF16"], v["parameters"]);
    assert_eq!(v["rope_theta"].as_f64(), Some(final_theta));
    // Exporting onto the source is refused.
    fails(&run(&["export", bf.to_str().unwrap(), "-o", bf.to_str().unwrap()]), &["would replace the source"], true);
    fails(&run(&["export", out.to_str().unwrap(), "-o", out.to_str().unwrap()]), &["would replace the source"], true);
    fails(&run(&["export", out.to_str().unwrap(), "-o", out.join("checkpoint").to_str().unwrap()]), &["would replace the source"], true);
    assert!(out.join("checkpoint/state.json").is_file());
}

#[test]
fn bad_sizes_and_export_sources() {
    // (clap usage errors: its whole message, the error line then its hint to --help)
    fails(
        &run(&["export", "tests/fixtures/llama_mha", "-o", "x", "--max-shard-size", "5XB"]),
        &["--max-shard-size", "unknown unit"],
        false,
    );
    fails(&run(&["export", "no/such/dir/anywhere", "-o", "x"]), &["no/such/dir/anywhere"], true);
    fails(&run(&["inspect", "--model", "tests/fixtures/llama_mha", "--gpu-memory", "lots"]), &["--gpu-memory"], false);
}

#[cfg(not(feature = "nccl"))]
#[test]
fn launched_train_on_cuda_needs_nccl() {
    // On the CPU a launched run works (tests/all/dist_train.rs); on CUDA it needs NCCL.
    let mut c = longctx(&["train", "--max-train-steps", "1", "--device", "cuda"]);
    for (k, v) in [
        ("RANK", "0"),
        ("WORLD_SIZE", "2"),
        ("LOCAL_RANK", "0"),
        ("LOCAL_WORLD_SIZE", "2"),
        ("MASTER_ADDR", "127.0.0.1"),
        ("MASTER_PORT", "29599"),
    ] {
        c.env(k, v);
    }
    fails(&run_cmd(c), &["model.device is CUDA, but this build has no NCCL", "--device cpu"], true);
    // Through `launch`: every rank fails that way and the launcher reports it.
    let o = run(&["launch", "--nproc-per-node", "2", "--master-port", "0", "--", "train", "--max-train-steps", "1", "--device", "cuda"]);
    assert_eq!(o.code, 1, "{}", o.stderr);
    assert!(o.stderr.contains("this build has no NCCL") && o.stderr.contains("launch: rank"), "{}", o.stderr);
}

#[test]
fn launch_runs_a_command_per_rank() {
    let o = ok(&["launch", "--nproc-per-node", "2", "--master-port", "0", "--", "inspect", "--model", "builtin:tiny"]);
    assert!(o.stdout.contains("[rank 0] model") && o.stdout.contains("[rank 1] model"), "{}", o.stdout);
}

/// `train.trace = true`: one stderr line per point of every step, in order, each with the
/// seconds since the step began.
#[test]
fn train_trace_prints_a_line_per_layer_and_phase() {
    let dir = tempfile::tempdir().unwrap();
    let cfg = dir.path().join("trace.toml");
    std::fs::write(&cfg, "[train]\ntrace = true\n\n[[stage]]\nseq_length = 32\nrope_theta = 1e4\nsteps = 1\n").unwrap();
    let out = dir.path().join("run");
    let o = common::longctx_cmd(&[
        "train",
        "--config",
        cfg.to_str().unwrap(),
        "--model",
        "builtin:tiny",
        "--output-dir",
        out.to_str().unwrap(),
    ])
    .output()
    .unwrap();
    let err = String::from_utf8_lossy(&o.stderr);
    assert!(o.status.success(), "{err}");
    // (`trace = true` of the resolved config is printed too: a trace line has a number.)
    let lines: Vec<&str> = err
        .lines()
        .filter(|l| l.strip_prefix("trace ").is_some_and(|r| r.trim_start().starts_with(|c: char| c.is_ascii_digit())))
        .collect();
    let want = [
        "step 1 of stage 0", "forward layer 0", "forward layer 1", "head and loss", "backward layer 1", "backward layer 0",
        "embedding backward", "optimizer", "guards",
    ];
    assert_eq!(lines.len(), want.len(), "{lines:#?}");
    for (l, w) in lines.iter().zip(want) {
        assert!(l.contains(" s  ") && l.contains(w), "`{l}` should be `{w}`");
    }
}

/// The dry run's plan names a stage's RoPE method (the YaRN recipe: factor 16 from 4K).
#[test]
fn dry_run_names_a_stages_rope_method() {
    let o = ok(&["train", "--config", "recipes/YaRN-64K-Llama-2-7B.toml", "--dry-run"]);
    let all = format!("{}{}", o.stdout, o.stderr);
    assert!(all.contains("θ 10000, rope yarn ×16 from 4K, 400 steps"), "{all}");
}

/// An integer beyond TOML's 64 bits is named with its line and the limit.
#[test]
fn an_integer_too_large_for_toml_is_named() {
    let d = tmp();
    let f = d.path().join("big.toml");
    std::fs::write(&f, "[[stage]]\nseq_length = 64\nrope_theta = 1e4\nsteps = 99999999999999999999\n").unwrap();
    let o = run(&["train", "--config", f.to_str().unwrap(), "--dry-run"]);
    fails(&o, &["big.toml", "line 4", "9223372036854775807"], true);
}

/// `--offload-layer-inputs` in the shape users run it: a CPU training run (attention and
/// MLP saved, 3 steps) gives the loss and gradient norm of the run that keeps its layer
/// inputs, to the bit (on the CPU the store copies what it offloads; the bookkeeping is
/// the GPU's); with `--offload-activations` too clap refuses the flags, and a config with
/// both keys is refused naming them.
#[test]
fn offload_layer_inputs_trains_like_keeping_them() {
    let d = tmp();
    let train = |name: &str, extra: &[&str]| -> Vec<(f64, f64)> {
        let out = d.path().join(name);
        let mut a = vec![
            "train", "--model", "builtin:tiny", "--device", "cpu", "--dataset", "synthetic:passkey", "--seq-length", "64", "--rope-theta",
            "1e4", "--max-train-steps", "3", "--token-chunk", "24", "--save-attention", "--save-mlp", "--no-save", "-q", "--output-dir",
        ];
        a.push(out.to_str().unwrap());
        a.extend_from_slice(extra);
        ok(&a);
        let text = std::fs::read_to_string(out.join("metrics.jsonl")).unwrap();
        text.lines()
            .filter_map(|l| serde_json::from_str::<serde_json::Value>(l).ok())
            .filter(|v| v.get("loss").is_some())
            .map(|v| (v["loss"].as_f64().unwrap(), v["grad_norm"].as_f64().unwrap()))
            .collect()
    };
    let kept = train("kept", &[]);
    assert_eq!(kept.len(), 3, "{kept:?}");
    assert_eq!(train("inputs", &["--offload-layer-inputs"]), kept);
    fails(
        &run(&["train", "--dry-run", "--offload-activations", "--offload-layer-inputs"]),
        &["--offload-activations", "--offload-layer-inputs"],
        false,
    );
    let cfg = write(
        d.path(),
        "both.toml",
        "[parallel]\noffload_activations = true\noffload_layer_inputs = true\n[[stage]]\nseq_length = 64\nrope_theta = 1e4\nsteps = 2\n",
    );
    fails(
        &run(&["train", "--dry-run", "--config", cfg.to_str().unwrap()]),
        &["both.toml", "parallel.offload_layer_inputs", "offload_activations"],
        false,
    );
}
