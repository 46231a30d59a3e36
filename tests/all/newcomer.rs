//! Issue #34, a new user's first hour, through the binary: a resume says what it does and
//! continues the run's own config; a finished run is left as it is; a run that never
//! stepped leaves nothing that blocks its directory; warmup is honoured in every schedule;
//! the planner names its flags; paths and lengths are read one way in every command.
//!
//! Runs: built-in tiny Llama, passkey data, CPU, a few steps of 32 and 64 tokens.

use std::path::{Path, PathBuf};

use crate::common;
use common::{longctx_cmd as longctx, ok, run, run_cmd, Out};

/// Exit status 1, exactly one `error:` line holding every needle, no panic.
fn fails(o: &Out, needles: &[&str]) -> String {
    common::fails(o, needles, false)
}

fn assert_has(text: &str, needles: &[&str]) {
    for n in needles {
        assert!(text.contains(n), "`{n}` missing from:\n{text}");
    }
}

/// Two stages (4 steps of 32 tokens, 2 of 64), batch 2: 256 then 256 tokens per step.
const TWO_STAGES: &str = "seed = 9\n[model]\nsource = \"builtin:tiny\"\ndevice = \"cpu\"\n[data]\ndataset = \"synthetic:passkey\"\n\
    [train]\nbatch_size = 2\nlearning_rate = 3e-3\ncheckpoint_interval_min = 0.0\n[parallel]\ntoken_chunk = 32\n\
    [[stage]]\nseq_length = 32\nrope_theta = 10000.0\nsteps = 4\n[[stage]]\nseq_length = 64\nrope_theta = 100000.0\nsteps = 2\n";

fn write_config(dir: &Path, text: &str) -> PathBuf {
    let p = dir.join("run.toml");
    std::fs::write(&p, text).unwrap();
    p
}

fn tensorboard_files(out: &Path) -> usize {
    std::fs::read_dir(out.join("tensorboard")).map_or(0, |d| d.count())
}

/// `--resume` alone continues with the config saved in the checkpoint (not the demo's),
/// says where it resumes, and its summary counts the whole run's tokens and names the
/// stages it ran by their own index. Resumed again once finished, it says so and writes
/// nothing.
#[test]
fn resume_alone_uses_the_saved_config_and_says_where_it_resumes() {
    let tmp = tempfile::tempdir().unwrap();
    let cfg = write_config(tmp.path(), TWO_STAGES);
    let out = tmp.path().join("run");
    let (cfg_s, out_s) = (cfg.to_str().unwrap(), out.to_str().unwrap());
    ok(&["train", "--config", cfg_s, "--output-dir", out_s, "--stop-at-step", "5"]);
    // Resumed with no --config: the saved config, unchanged, from stage 1 after its step 1.
    let o = ok(&["train", "--resume", "--output-dir", out_s]);
    assert!(!o.stderr.contains("changed settings"), "{}", o.stderr);
    let ckpt = out.join("checkpoint");
    assert_has(
        &o.stderr,
        &[
            "note: --resume without --config: the run's config as saved in",
            &format!("resuming stage 1 at step 1/2 (global 5) from {}", ckpt.display()),
            // 4 × 2 × 32 + 2 × 2 × 64 over the run; 1 step of 2 × 64 in this invocation.
            "done: 6 steps, 512 tokens over the run; this invocation: 1 steps, 128 tokens in",
            "  stage 1: loss",
        ],
    );
    assert!(!o.stderr.contains("  stage 0: loss"), "stage 0 did not run in this invocation:\n{}", o.stderr);
    assert!(out.join("export/model.safetensors").is_file());
    // Checkpoint and export files get the same permissions (the umask's).
    use std::os::unix::fs::PermissionsExt;
    let mode = |p: &str| std::fs::metadata(out.join(p)).unwrap().permissions().mode() & 0o777;
    assert_eq!(mode("checkpoint/model.safetensors"), mode("checkpoint/state.json"));
    assert_eq!(mode("checkpoint/optimizer-shard0.safetensors"), mode("export/model.safetensors"));
    // Finished: resumed again, it says so, re-exports nothing, adds no TensorBoard file.
    let tb = tensorboard_files(&out);
    let export_time = std::fs::metadata(out.join("export/model.safetensors")).unwrap().modified().unwrap();
    let o = ok(&["train", "--resume", "--output-dir", out_s]);
    assert_has(&o.stderr, &["is finished (all 2 stage(s), global step 6)", "nothing to do"]);
    assert_has(&o.stdout, &["already finished"]);
    assert_eq!(tensorboard_files(&out), tb, "a TensorBoard file was added");
    assert_eq!(std::fs::metadata(out.join("export/model.safetensors")).unwrap().modified().unwrap(), export_time);
    // Finished but its export gone: written again, still without a TensorBoard file.
    std::fs::remove_dir_all(out.join("export")).unwrap();
    let o = ok(&["train", "--resume", "--output-dir", out_s]);
    assert_has(&o.stderr, &["finished its stages (global step 6) but its export is missing; writing it again"]);
    assert!(out.join("export/model.safetensors").is_file());
    assert_eq!(tensorboard_files(&out), tb, "a TensorBoard file was added");
    // A flag over the saved config is compared as with --config.
    let o = ok(&["train", "--resume", "--output-dir", out_s, "--learning-rate", "1e-3"]);
    assert_has(&o.stderr, &["train.learning_rate: 0.003 -> 0.001"]);
}

/// A run that fails before its first step (here a missing dataset) leaves no metrics or
/// TensorBoard file: the corrected command runs without --overwrite, and `--resume` there
/// says there is no checkpoint instead of an OS error.
#[test]
fn a_run_that_never_stepped_does_not_block_its_directory() {
    let tmp = tempfile::tempdir().unwrap();
    let cfg = write_config(tmp.path(), TWO_STAGES);
    let out = tmp.path().join("run");
    let (cfg_s, out_s) = (cfg.to_str().unwrap(), out.to_str().unwrap());
    let missing = tmp.path().join("no-such-data.jsonl");
    let o = run(&["train", "--config", cfg_s, "--output-dir", out_s, "--dataset", missing.to_str().unwrap()]);
    assert_eq!(o.code, 1, "{}", o.stderr);
    for f in ["metrics.jsonl", "tensorboard", "checkpoint", "export"] {
        assert!(!out.join(f).exists(), "{f} left behind by a run that never stepped");
    }
    fails(&run(&["train", "--resume", "--output-dir", out_s]), &["holds no checkpoint", "start it without --resume"]);
    ok(&["train", "--config", cfg_s, "--output-dir", out_s, "--max-train-steps", "1"]);
}

/// The same run with a dataset that exists but cannot be read (no such column): it fails
/// after the trainer set up, before its first step, and leaves no metrics either.
#[test]
fn a_run_that_fails_in_its_data_set_up_leaves_no_metrics() {
    let tmp = tempfile::tempdir().unwrap();
    let cfg = write_config(tmp.path(), TWO_STAGES);
    let out = tmp.path().join("run");
    let data = tmp.path().join("bad.jsonl");
    std::fs::write(&data, "{\"other\": 1}\n").unwrap();
    let (cfg_s, out_s) = (cfg.to_str().unwrap(), out.to_str().unwrap());
    let o = run(&["train", "--config", cfg_s, "--output-dir", out_s, "--dataset", data.to_str().unwrap()]);
    assert_eq!(o.code, 1, "{}", o.stderr);
    for f in ["metrics.jsonl", "tensorboard"] {
        assert!(!out.join(f).exists(), "{f} left behind by a run that never stepped:\n{}", o.stderr);
    }
    // (--quiet: the resolved config is not printed.)
    let o = ok(&["train", "--config", cfg_s, "--output-dir", out_s, "--max-train-steps", "1", "--quiet"]);
    assert_has(&o.stderr, &["--quiet: not printed; written to", "config.toml"]);
    assert!(!o.stderr.contains("[train]") && !o.stderr.contains("resolved config"), "{}", o.stderr);
    // The resolved config, flags applied, is in the output directory and runs as a --config.
    let saved = out.join("config.toml");
    let text = std::fs::read_to_string(&saved).unwrap();
    assert_has(&text, &["[train]", "batch_size = 2", "steps = 1", "seq_length = 64"]);
    let o = ok(&["train", "--config", saved.to_str().unwrap(), "--dry-run"]);
    assert_has(&o.stdout, &["steps = 1"]);
}

/// `warmup_steps` under the default constant schedule warms up (EasyContext's
/// constant-with-warmup): the logged learning rate of steps 1 and 2 of 4 warmup steps.
#[test]
fn warmup_is_honoured_in_the_constant_schedule() {
    let tmp = tempfile::tempdir().unwrap();
    let cfg = write_config(tmp.path(), TWO_STAGES);
    let out = tmp.path().join("run");
    let o = ok(&[
        "train",
        "--config",
        cfg.to_str().unwrap(),
        "--output-dir",
        out.to_str().unwrap(),
        "--warmup-steps",
        "4",
        "--seq-length",
        "32",
        "--max-train-steps",
        "2",
        "--dry-run",
    ]);
    assert_has(&o.stdout, &["lr_schedule = \"constant\"", "warmup 4"]);
    ok(&[
        "train",
        "--config",
        cfg.to_str().unwrap(),
        "--output-dir",
        out.to_str().unwrap(),
        "--warmup-steps",
        "4",
        "--max-train-steps",
        "2",
    ]);
    let text = std::fs::read_to_string(out.join("metrics.jsonl")).unwrap();
    let lrs: Vec<f64> = text.lines().map(|l| serde_json::from_str::<serde_json::Value>(l).unwrap()["lr"].as_f64().unwrap()).collect();
    assert_eq!(lrs.len(), 4, "{text}");
    for (got, want) in lrs.iter().zip([3e-3 / 4.0, 3e-3 / 2.0, 3e-3 / 4.0, 3e-3 / 2.0]) {
        assert!((got - want).abs() < 1e-12, "lr {got}, expected {want} (warmup restarts each stage): {lrs:?}");
    }
}

/// The GB figure after `label` in a plan's text.
fn gb_after(text: &str, label: &str) -> f64 {
    let line = text.lines().find(|l| l.trim_start().starts_with(label)).unwrap_or_else(|| panic!("no `{label}` line:\n{text}"));
    line.trim_start()[label.len()..].split_whitespace().next().unwrap().parse().unwrap()
}

/// `plan`'s suggestion names every flag it adds: "as requested" only with the request's own
/// peak, and the saved attention it turns on as `--save-attention`.
#[test]
fn plan_suggestion_names_every_flag_it_adds() {
    let o = ok(&["plan", "--model", "builtin:tinyllama-1.1b-shape", "--seq-length", "64K"]);
    let peak = gb_after(&o.stdout, "peak   ");
    let line = o.stdout.lines().find(|l| l.contains("suggestion:")).unwrap();
    assert!(line.contains("--save-attention"), "{}", o.stdout);
    assert!(!line.contains("as requested (") || line.contains(&format!("({peak:.2} GB peak)")), "{}", o.stdout);
    assert_has(&o.stdout, &["optimizer state on the GPU: the default"]);
}

/// At a length nothing fits, `plan` names the largest length that does on those GPUs.
#[test]
fn plan_names_the_largest_length_that_fits() {
    let o = ok(&["plan", "--model", "builtin:tinyllama-1.1b-shape", "--seq-length", "16M"]);
    assert_has(&o.stdout, &["none fits 16M tokens on 1 GPU(s)", "the largest length that fits there is", "(with --parallel-mode"]);
}

/// `inspect` and `plan` assume the same optimizer placement (the GPU, as `train`) and say so.
#[test]
fn inspect_and_plan_agree_on_the_optimizer_placement() {
    let model = ["--model", "builtin:llama2-7b-shape", "--seq-length", "32K"];
    let i = ok(&[&["inspect"], &model[..]].concat());
    let p = ok(&[&["plan"], &model[..]].concat());
    assert_has(&i.stdout, &["optimizer state on the GPU: the default"]);
    let line = i.stdout.lines().find(|l| l.starts_with("training memory")).unwrap();
    let inspect_peak: f64 = line.split_whitespace().nth(2).unwrap().parse().unwrap();
    assert_eq!(inspect_peak, gb_after(&p.stdout, "peak   "), "{line}\n{}", p.stdout);
    let i = ok(&[&["inspect", "--optimizer-on-host"], &model[..]].concat());
    let p = ok(&[&["plan", "--optimizer-on-host"], &model[..]].concat());
    assert_has(&i.stdout, &["optimizer state on the host"]);
    let line = i.stdout.lines().find(|l| l.starts_with("training memory")).unwrap();
    let inspect_peak: f64 = line.split_whitespace().nth(2).unwrap().parse().unwrap();
    assert_eq!(inspect_peak, gb_after(&p.stdout, "peak   "), "{line}\n{}", p.stdout);
}

/// One parser of lengths for every command (`train --seq-length 64K`), one printer
/// (K = 1024; EasyContext's 256000 printed as it is).
#[test]
fn lengths_are_read_and_printed_one_way() {
    let o = ok(&["train", "--model", "builtin:tiny", "--seq-length", "64K", "--dry-run"]);
    assert_has(&o.stdout, &["seq_length = 65536", "stage 0: 64K tokens"]);
    let o = ok(&["train", "--model", "builtin:tiny", "--token-chunk", "4K", "--fpdt-chunk-size", "1K", "--dry-run"]);
    assert_has(&o.stdout, &["token_chunk = 4096", "fpdt_chunk_size = 1024"]);
    let o = ok(&["plan", "--model", "builtin:tinyllama-1.1b-shape", "--seq-length", "256000"]);
    assert_has(&o.stdout, &["256000 tokens,"]);
    assert!(!o.stdout.contains("250K"), "{}", o.stdout);
    fails(&run(&["train", "--model", "builtin:tiny", "--seq-length", "64Q", "--dry-run"]), &["64Q", "64K"]);
}

/// Without --config, naming only --model keeps the demo's stages but not its settings:
/// the printed config says so.
#[test]
fn the_demo_with_a_model_flag_says_what_it_keeps() {
    let o = ok(&["train", "--model", "builtin:tiny", "--dry-run"]);
    assert!(o.stdout.starts_with("# no --config: with --model/--dataset the run keeps the demo's 3 stages"), "{}", o.stdout);
    assert_has(&o.stdout, &["batch 1, learning rate 2e-5"]);
    let o = ok(&["train", "--dry-run"]);
    assert!(!o.stdout.contains("no --config"), "{}", o.stdout);
}

/// A relative path that looks like a hub id (`runs/tyni` where `runs/` exists) is reported
/// as a missing directory, not tried on the network: for models (train, --dry-run too,
/// export) and datasets.
#[test]
fn a_mistyped_local_path_is_not_taken_for_a_hub_id() {
    let tmp = tempfile::tempdir().unwrap();
    std::fs::create_dir_all(tmp.path().join("runs/tiny")).unwrap();
    let in_tmp = |args: &[&str]| {
        let mut c = longctx(args);
        // Online (no HF_HUB_OFFLINE): the check must come before any download.
        c.current_dir(tmp.path())
            .env_remove("HF_HUB_OFFLINE")
            .env("HF_HOME", tmp.path().join("hf"))
            .env("HF_ENDPOINT", "http://127.0.0.1:9");
        run_cmd(c)
    };
    let want = ["runs/tyni", "no such directory (runs holds: tiny)", "as a hub id it is not cached"];
    fails(&in_tmp(&["train", "--model", "runs/tyni", "--dry-run"]), &want);
    fails(&in_tmp(&["train", "--model", "runs/tyni", "--output-dir", "out"]), &want);
    fails(&in_tmp(&["export", "runs/tyni", "--output-dir", "out"]), &want);
    fails(
        &in_tmp(&["train", "--dataset", "runs/data.jsonl", "--dry-run"]),
        &["runs/data.jsonl", "no such file or directory (runs holds: tiny)", "not cached"],
    );
    fails(&in_tmp(&["train", "--dataset", "nope.jsonl", "--dry-run"]), &["nope.jsonl", "dataset not found"]);
    // A file name under a directory that is missing too: not a hub id (it ends in an extension).
    let want = ["data/train.jsonl", "no such file, nor a directory `data`", "hf:data/train.jsonl"];
    fails(&in_tmp(&["train", "--dataset", "data/train.jsonl", "--dry-run"]), &want);
    fails(&in_tmp(&["train", "--dataset", "data/train.jsonl", "--output-dir", "out"]), &want);
    // `hf:` names a hub dataset explicitly: no local-path check (the dry run does not fetch it).
    ok_in(&in_tmp(&["train", "--dataset", "hf:runs/data.jsonl", "--dry-run"]));
}

fn ok_in(o: &Out) {
    assert_eq!(o.code, 0, "{}", o.stderr);
}

/// `--model` naming a run's output directory (not its export) says where the model is.
#[test]
fn a_run_directory_as_model_points_at_its_export() {
    let tmp = tempfile::tempdir().unwrap();
    let export = tmp.path().join("demo/export");
    std::fs::create_dir_all(&export).unwrap();
    std::fs::write(export.join("config.json"), "{}").unwrap();
    let dir = tmp.path().join("demo");
    let o = run(&["train", "--model", dir.to_str().unwrap(), "--dry-run"]);
    fails(&o, &["is a run's output directory: its model is", &export.display().to_string()]);
}

/// `eval` takes the underscore spellings `train` and `plan` take, and says why perplexity
/// on synthetic:passkey-answer scores every token.
#[test]
fn eval_takes_the_underscore_spellings_and_explains_passkey_answer() {
    let o = ok(&["eval", "ppl", "--help"]);
    assert_has(&o.stdout, &["parallel_mode", "world_size", "output_dir", "dataset_column"]);
    let tmp = tempfile::tempdir().unwrap();
    let dir = tmp.path().to_str().unwrap();
    // `eval ppl` on an answer-only synthetic dataset: its note, and (scored tokens, windows).
    let answers = |dataset: &str, len: &str, max_tokens: &str| {
        let o = ok(&[
            "eval", "ppl", "--model", "builtin:tiny", "--dataset", dataset, "--parallel_mode", "data_parallel", "--lengths", len,
            "--max-tokens", max_tokens, "--output_dir", dir,
        ]);
        assert_has(&o.stderr, &[&format!("{dataset}: perplexity of the answers only")]);
        let v: serde_json::Value = serde_json::from_str(&std::fs::read_to_string(tmp.path().join("ppl.json")).unwrap()).unwrap();
        (v["points"][0]["tokens"].as_u64(), v["points"][0]["windows"].as_u64())
    };
    // The answer-only mask is kept: 5 scored digits per 16-token sample, 4 samples (64 tokens).
    assert_eq!(answers("synthetic:passkey-answer", "16", "64"), (Some(5 * 4), Some(4)));
    // The demo's own data, synthetic:retrieval-answer: passkey samples (5 answer digits) and
    // variable-tracking samples (3 variables) alternate; 4 samples of 33 tokens.
    assert_eq!(answers("synthetic:retrieval-answer", "32", "132"), (Some(5 + 3 + 5 + 3), Some(4)));
    let o = run(&["eval", "ppl", "--model", "builtin:tiny", "--dataset", "synthetic:nope", "--lengths", "32", "--output-dir", dir]);
    fails(&o, &["unknown synthetic dataset `synthetic:nope`", "synthetic:retrieval-answer"]);
}

/// Every long flag of every command takes its underscore spelling (EasyContext's and
/// torchrun's way of writing them), and `--help` lists each one.
#[test]
fn every_flag_takes_its_underscore_spelling_and_help_lists_it() {
    let commands: [&[&str]; 10] = [
        &["train"],
        &["plan"],
        &["inspect"],
        &["eval", "ppl"],
        &["eval", "needle"],
        &["eval", "ruler"],
        &["generate"],
        &["export"],
        &["check"],
        &["launch"],
    ];
    for cmd in commands {
        let help = ok(&[cmd, &["--help"][..]].concat()).stdout;
        // The flags defined (`      --seq-length <SEQ_LENGTH>`, `  -q, --quiet`), not those named in prose.
        let flags: Vec<String> = help
            .lines()
            .filter_map(|l| {
                let t = l.trim_start();
                let t = if t.starts_with('-') && !t.starts_with("--") { t.split_once(", ").map_or("", |(_, r)| r) } else { t };
                let name: String = t.strip_prefix("--")?.chars().take_while(|c| c.is_ascii_alphanumeric() || *c == '-').collect();
                name.contains('-').then_some(name)
            })
            .collect();
        assert!(!flags.is_empty(), "{cmd:?}: no multi-word flag in\n{help}");
        for f in flags {
            assert!(help.contains(&format!("--{}", f.replace('-', "_"))), "{cmd:?}: --{f} has no underscore spelling in\n{help}");
        }
    }
    let o = ok(&["inspect", "--model", "builtin:tiny", "--seq_length", "1K", "--optimizer_on_host"]);
    assert_has(&o.stdout, &["at 1K tokens", "optimizer state on the host"]);
    ok(&["launch", "--nproc_per_node", "1", "--master_port", "0", "--program", "/bin/sh", "--", "-c", "true"]);
}

/// A TOML syntax error says its line and column; a missing config file says its OS error once.
#[test]
fn config_file_errors_say_where_once() {
    let tmp = tempfile::tempdir().unwrap();
    let cfg = write_config(tmp.path(), "seed = 1\n[train\nbatch_size = 2\n");
    let e = fails(&run(&["train", "--config", cfg.to_str().unwrap(), "--dry-run"]), &["run.toml: line 2, column", "not valid TOML"]);
    assert!(!e.contains("field ``"), "{e}");
    let missing = tmp.path().join("nope.toml");
    let e = fails(&run(&["train", "--config", missing.to_str().unwrap(), "--dry-run"]), &["nope.toml", "No such file or directory"]);
    assert_eq!(e.matches("No such file or directory").count(), 1, "{e}");
}

/// A second signal before the run wrote any checkpoint does not claim that one stands.
#[test]
fn a_second_signal_before_any_checkpoint_says_none_stands() {
    let tmp = tempfile::tempdir().unwrap();
    let text = TWO_STAGES.replace("steps = 4\n", "steps = 400\n");
    let cfg = write_config(tmp.path(), &text);
    let out = tmp.path().join("run");
    let mut c = longctx(&["train", "--config", cfg.to_str().unwrap(), "--output-dir", out.to_str().unwrap()]);
    c.stdout(std::process::Stdio::piped()).stderr(std::process::Stdio::piped());
    let child = c.spawn().unwrap();
    let start = std::time::Instant::now();
    while std::fs::read_to_string(out.join("metrics.jsonl")).map_or(0, |t| t.lines().count()) < 2 {
        assert!(start.elapsed().as_secs() < 120, "no step within 120 s");
        std::thread::sleep(std::time::Duration::from_millis(20));
    }
    for sig in [libc::SIGINT, libc::SIGTERM] {
        // SAFETY: kill(2) of the child we spawned.
        unsafe { libc::kill(child.id() as i32, sig) };
    }
    let o = child.wait_with_output().unwrap();
    let err = String::from_utf8_lossy(&o.stderr);
    assert!(!o.status.success(), "{err}");
    if out.join("checkpoint").exists() {
        return; // the first signal's checkpoint won the race (rare): nothing to check
    }
    assert!(err.contains("second stop signal: exiting now; no checkpoint was written yet"), "{err}");
    assert!(!err.contains("the last complete checkpoint stands"), "{err}");
}

/// Ctrl-C under `launch` that every rank answers cleanly (exit 0, as a training rank does
/// after its checkpoint) ends with the interruption's status and no `error:` line.
#[test]
fn a_clean_ctrl_c_under_launch_is_no_error() {
    use std::io::BufRead;
    let script = "trap 'exit 0' INT TERM; echo ready; while :; do sleep 0.05; done";
    let mut c = longctx(&["launch", "--nproc-per-node", "2", "--master-port", "0", "--program", "/bin/sh", "--", "-c", script]);
    c.stdout(std::process::Stdio::piped()).stderr(std::process::Stdio::piped());
    let mut child = c.spawn().unwrap();
    let stdout = child.stdout.take().unwrap();
    let mut lines = std::io::BufReader::new(stdout).lines();
    let mut ready = 0;
    while ready < 2 {
        match lines.next() {
            Some(Ok(l)) if l.contains("ready") => ready += 1,
            Some(Ok(_)) => {}
            _ => panic!("the ranks did not start"),
        }
    }
    // SAFETY: kill(2) of the child we spawned.
    unsafe { libc::kill(child.id() as i32, libc::SIGINT) };
    let o = child.wait_with_output().unwrap();
    let err = String::from_utf8_lossy(&o.stderr);
    assert_eq!(o.status.code(), Some(130), "{err}");
    assert!(err.contains("interrupted by signal 2 (SIGINT); every rank stopped cleanly"), "{err}");
    assert!(!err.lines().any(|l| l.starts_with("error:")), "{err}");
}

/// The README's first screen (its first 50 lines) holds the two set-up commands, says
/// where the binary is and what to run next; each of those commands parses, and the plan
/// (no model download, no training) runs.
#[test]
fn the_readme_first_screen_says_what_to_run_next() {
    let readme = std::fs::read_to_string(common::repo_root().join("README.md")).unwrap();
    let screen = readme.lines().take(50).collect::<Vec<_>>().join("\n");
    assert_has(&screen, &["cargo run --release -- train", "cargo test --workspace", "`target/release/longctx`", "Next"]);
    let next: Vec<Vec<&str>> = screen
        .lines()
        .filter_map(|l| l.strip_prefix("target/release/longctx "))
        .map(|l| l.split('#').next().unwrap().split_whitespace().collect())
        .collect();
    assert!(next.len() >= 2, "no commands after the set-up on the README's first screen:\n{screen}");
    for args in &next {
        let sub = if args[0] == "eval" { 2 } else { 1 };
        ok(&[&args[..sub], &["--help"][..]].concat());
        if args[0] == "plan" {
            assert_has(&ok(args).stdout, &["suggestion:"]);
        }
    }
}

/// On an 80-column terminal (a pty through util-linux `script`) the progress bar fits its
/// line with the loss and the ETA in view, each finished stage's bar stays on its own line,
/// and the next line (the next stage, the summary) starts a line of its own.
#[test]
fn the_progress_bar_fits_80_columns_and_stays_per_stage() {
    if !Path::new("/usr/bin/script").exists() {
        eprintln!("skipped: no /usr/bin/script to give the run a terminal");
        return;
    }
    let tmp = tempfile::tempdir().unwrap();
    let cfg = write_config(tmp.path(), &TWO_STAGES.replace("steps = 4\n", "steps = 12\n"));
    let out = tmp.path().join("run");
    let cmd = format!(
        "stty cols 80 rows 40; exec {} train --config {} --output-dir {} -q",
        env!("CARGO_BIN_EXE_longctx"),
        cfg.display(),
        out.display()
    );
    let mut c = std::process::Command::new("/usr/bin/script");
    c.args(["-q", "-e", "-c", &cmd, "/dev/null"]).env("HF_HUB_OFFLINE", "1");
    let o = run_cmd(c);
    assert_eq!(o.code, 0, "{}{}", o.stdout, o.stderr);
    // What stays on screen: each line's text after its last carriage return, escapes removed.
    let screen: Vec<String> = o
        .stdout
        .split('\n')
        .map(|l| {
            let last = l.trim_end_matches('\r').rsplit('\r').next().unwrap_or("");
            let mut text = String::new();
            let mut chars = last.chars();
            while let Some(ch) = chars.next() {
                if ch == '\u{1b}' {
                    chars.by_ref().find(|c| c.is_ascii_alphabetic());
                } else {
                    text.push(ch);
                }
            }
            text
        })
        .collect();
    let all = screen.join("\n");
    for l in screen.iter().filter(|l| l.starts_with("stage 0 [") || l.starts_with("stage 1 [")) {
        assert!(l.chars().count() <= 80, "{} columns: {l}\n{all}", l.chars().count());
    }
    for (bar, at) in [("stage 0 [", "12/12 loss"), ("stage 1 [", "2/2 loss")] {
        assert!(screen.iter().any(|l| l.starts_with(bar) && l.contains(at) && l.contains(" eta ")), "no finished `{bar}` bar:\n{all}");
    }
    for first in ["stage 1: seq_length 64", "done: 14 steps"] {
        assert!(screen.iter().any(|l| l.starts_with(first)), "`{first}` does not start a line:\n{all}");
    }
}
