//! Issue #16 item 3, the output directory and preemption, on real processes (the dev
//! binary): SIGINT and SIGTERM write a checkpoint at the next step boundary and exit with
//! 128 + the signal, and `--resume` then ends bit for bit where an uninterrupted run ends;
//! a second signal exits at once; a launched run stops every rank after the same step
//! when one rank is signalled; a second run on a directory in use is refused, a dead
//! run's lock is taken over; a fresh run refuses a directory that holds a run unless
//! `--overwrite`.
//!
//! Runs: built-in tiny Llama, passkey data, one stage of 64 tokens, CPU; a run of 100
//! steps takes a few seconds, so a signal sent after step 3 always lands mid-run.

use std::path::{Path, PathBuf};
use std::process::{Child, Command, Output, Stdio};
use std::time::{Duration, Instant};

const STEPS: u64 = 100;

fn exe() -> &'static str {
    env!("CARGO_BIN_EXE_longctx")
}

/// The binary, outside any launcher, offline.
fn longctx(args: &[&str]) -> Command {
    let mut c = Command::new(exe());
    c.args(args).env("HF_HUB_OFFLINE", "1").stdout(Stdio::piped()).stderr(Stdio::piped());
    for k in ["RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "LONGCTX_FAULT"] {
        c.env_remove(k);
    }
    c
}

/// A run config of `steps` steps (no step or time checkpoints unless `every`).
fn config(dir: &Path, steps: u64, every: u64) -> PathBuf {
    let p = dir.join(format!("run-{steps}-{every}.toml"));
    let text = format!(
        "seed = 7\n[train]\nbatch_size = 2\nlearning_rate = 3e-3\ncheckpoint_every = {every}\ncheckpoint_interval_min = 0.0\n\
         [parallel]\ntoken_chunk = 64\n[[stage]]\nseq_length = 64\nrope_theta = 10000.0\nsteps = {steps}\n"
    );
    std::fs::write(&p, text).unwrap();
    p
}

fn train(cfg: &Path, out: &Path, extra: &[&str]) -> Command {
    let mut args = vec!["train", "--config", cfg.to_str().unwrap(), "--output-dir", out.to_str().unwrap()];
    args.extend_from_slice(extra);
    longctx(&args)
}

/// Wait for `child` at most `limit` (then kill it and fail).
fn wait(mut child: Child, limit: Duration) -> Output {
    let start = Instant::now();
    while child.try_wait().expect("wait").is_none() {
        if start.elapsed() > limit {
            let _ = child.kill();
            panic!("longctx did not finish within {limit:?}");
        }
        std::thread::sleep(Duration::from_millis(20));
    }
    child.wait_with_output().expect("output")
}

fn run(mut c: Command) -> Output {
    wait(c.spawn().expect("spawn longctx"), Duration::from_secs(300))
}

fn stderr(o: &Output) -> String {
    String::from_utf8_lossy(&o.stderr).into_owned()
}

fn logged_steps(out: &Path) -> usize {
    std::fs::read_to_string(out.join("metrics.jsonl")).map(|t| t.lines().filter(|l| l.contains("\"loss\"")).count()).unwrap_or(0)
}

/// Wait until the run in `out` has logged `k` steps.
fn wait_for_steps(out: &Path, k: usize) {
    let start = Instant::now();
    while logged_steps(out) < k {
        assert!(start.elapsed() < Duration::from_secs(120), "{}: {k} steps not logged in time", out.display());
        std::thread::sleep(Duration::from_millis(10));
    }
}

fn kill(pid: u32, sig: i32) {
    // SAFETY: kill(2) on a child process this test started.
    let rc = unsafe { libc::kill(pid as libc::pid_t, sig) };
    assert_eq!(rc, 0, "kill({pid}, {sig}) failed");
}

fn state(out: &Path) -> serde_json::Value {
    let p = out.join("checkpoint/state.json");
    serde_json::from_str(&std::fs::read_to_string(&p).unwrap_or_else(|e| panic!("{}: {e}", p.display()))).unwrap()
}

/// (global step, loss bits, grad-norm bits) of every logged step.
fn log(out: &Path) -> Vec<(u64, u64, u64)> {
    let text = std::fs::read_to_string(out.join("metrics.jsonl")).unwrap();
    text.lines()
        .map(|l| serde_json::from_str::<serde_json::Value>(l).unwrap())
        .filter(|v| v.get("loss").is_some())
        .map(|v| (v["global_step"].as_u64().unwrap(), v["loss"].as_f64().unwrap().to_bits(), v["grad_norm"].as_f64().unwrap().to_bits()))
        .collect()
}

fn same_file(a: &Path, b: &Path) {
    let (x, y) = (std::fs::read(a).unwrap(), std::fs::read(b).unwrap());
    assert!(x == y, "{} and {} differ", a.display(), b.display());
}

/// SIGINT, then SIGTERM, each sent after step 3: the run writes a checkpoint at the end
/// of the step in progress, says so, exports nothing and exits with 128 + the signal;
/// `--resume` ends with the exported weights and per-step log of the uninterrupted run.
#[test]
fn a_signal_writes_a_checkpoint_and_the_resumed_run_is_bit_exact() {
    let tmp = tempfile::tempdir().unwrap();
    let cfg = config(tmp.path(), STEPS, 0);
    let whole = tmp.path().join("whole");
    let o = run(train(&cfg, &whole, &[]));
    assert!(o.status.success(), "{}", stderr(&o));
    for (sig, name) in [(libc::SIGINT, "SIGINT"), (libc::SIGTERM, "SIGTERM")] {
        let out = tmp.path().join(name);
        let child = train(&cfg, &out, &[]).spawn().unwrap();
        wait_for_steps(&out, 3);
        kill(child.id(), sig);
        let o = wait(child, Duration::from_secs(60));
        let err = stderr(&o);
        assert_eq!(o.status.code(), Some(128 + sig), "{name}: exit status; stderr:\n{err}");
        assert!(err.contains("stop requested") && err.contains(&format!("on {name}; checkpoint in")), "{name}: {err}");
        let done = state(&out)["global_step"].as_u64().unwrap();
        assert!((3..STEPS).contains(&done), "{name}: stopped after step {done}");
        assert_eq!(logged_steps(&out) as u64, done, "{name}: the checkpoint is of the last logged step");
        assert!(!out.join("export").exists(), "{name}: a stopped run exports nothing");
        let o = run(train(&cfg, &out, &["--resume"]));
        assert!(o.status.success(), "{name}: resume: {}", stderr(&o));
        assert_eq!(log(&out), log(&whole), "{name}: per-step log (loss and gradient-norm bits)");
        same_file(&out.join("export/model.safetensors"), &whole.join("export/model.safetensors"));
    }
}

/// Two signals in a row: the second exits at once (status 128 + its number) with a message;
/// whatever checkpoint exists then is complete.
#[test]
fn a_second_signal_exits_at_once() {
    let tmp = tempfile::tempdir().unwrap();
    let out = tmp.path().join("run");
    let child = train(&config(tmp.path(), STEPS, 1), &out, &[]).spawn().unwrap();
    wait_for_steps(&out, 2);
    kill(child.id(), libc::SIGINT);
    kill(child.id(), libc::SIGTERM);
    let o = wait(child, Duration::from_secs(60));
    let err = stderr(&o);
    // Either may be handled second (several threads can take a signal): 128 + that one.
    let code = o.status.code();
    assert!(code == Some(128 + libc::SIGTERM) || code == Some(128 + libc::SIGINT), "exit status {code:?}: {err}");
    assert!(err.contains("second stop signal: exiting now"), "{err}");
    if out.join("checkpoint").exists() {
        assert!(state(&out)["global_step"].as_u64().is_some() && out.join("checkpoint/model.safetensors").is_file());
    }
}

/// `longctx launch` of two ranks; rank 0 alone gets SIGTERM (its pid is in the lock file):
/// the request travels with the step's loss, both ranks checkpoint the same step (one
/// optimizer shard each) and exit 0, and a launched `--resume` ends with the weights of
/// the uninterrupted run (in-process ranks compute the same bits as processes).
#[test]
fn a_launched_run_stops_every_rank_after_the_same_step() {
    let tmp = tempfile::tempdir().unwrap();
    let cfg = config(tmp.path(), STEPS, 0);
    let whole = tmp.path().join("whole");
    let o = run(train(&cfg, &whole, &["--world-size", "2"]));
    assert!(o.status.success(), "{}", stderr(&o));
    let out = tmp.path().join("launched");
    let launch = |extra: &[&str]| {
        let mut a = vec!["launch", "--nproc-per-node", "2", "--master-port", "0", "--", "train", "--device", "cpu"];
        a.extend_from_slice(&["--config", cfg.to_str().unwrap(), "--output-dir", out.to_str().unwrap()]);
        a.extend_from_slice(extra);
        longctx(&a)
    };
    let child = launch(&[]).spawn().unwrap();
    wait_for_steps(&out, 3);
    let lock = std::fs::read_to_string(out.join(".longctx.lock")).unwrap();
    let pid: u32 = lock.lines().find_map(|l| l.strip_prefix("pid=")).and_then(|p| p.parse().ok()).expect("pid in the lock file");
    assert_ne!(pid, child.id(), "rank 0 holds the lock, not the launcher");
    kill(pid, libc::SIGTERM);
    let o = wait(child, Duration::from_secs(120));
    let err = stderr(&o);
    assert!(o.status.success(), "every rank stops cleanly: {err}");
    let done = state(&out)["global_step"].as_u64().unwrap();
    assert!(err.contains(&format!("[rank 0] stopped after step {done} on SIGTERM")), "{err}");
    assert_eq!(state(&out)["optimizer_shards"], 2);
    for d in 0..2 {
        assert!(out.join(format!("checkpoint/optimizer-shard{d}.safetensors")).is_file(), "rank {d}'s shard");
    }
    let o = run(launch(&["--resume"]));
    assert!(o.status.success(), "{}", stderr(&o));
    assert_eq!(log(&out), log(&whole), "per-step log of the resumed launched run");
    same_file(&out.join("export/model.safetensors"), &whole.join("export/model.safetensors"));
}

/// While a run holds its output directory, a second run there is refused, naming the
/// holder's pid, and leaves the first run's metrics alone. After the first is killed
/// (SIGKILL: its lock file still names it), `--resume` takes the lock over with a note.
#[test]
fn a_directory_in_use_is_refused_and_a_dead_runs_lock_is_taken_over() {
    let tmp = tempfile::tempdir().unwrap();
    let cfg = config(tmp.path(), STEPS, 1);
    let out = tmp.path().join("run");
    let first = train(&cfg, &out, &[]).spawn().unwrap();
    wait_for_steps(&out, 2);
    for extra in [&[][..], &["--resume"], &["--overwrite"]] {
        let o = run(train(&cfg, &out, extra));
        let err = stderr(&o);
        assert_eq!(o.status.code(), Some(1), "{extra:?}: {err}");
        assert!(err.contains("in use by another longctx run") && err.contains(&format!("pid {}", first.id())), "{extra:?}: {err}");
        assert!(err.contains(".longctx.lock") && err.contains("--output-dir"), "{extra:?}: {err}");
    }
    assert!(logged_steps(&out) >= 2, "the refused runs did not truncate the first run's metrics");
    kill(first.id(), libc::SIGKILL);
    let o = wait(first, Duration::from_secs(30));
    assert!(!o.status.success());
    let o = run(train(&cfg, &out, &["--resume"]));
    let err = stderr(&o);
    assert!(o.status.success(), "{err}");
    assert!(err.contains("taking over the lock") && err.contains("no longer running"), "{err}");
    assert!(out.join("export/model.safetensors").is_file());
    assert_eq!(std::fs::read_to_string(out.join(".longctx.lock")).unwrap(), "", "the lock is released (emptied) at the end");
}

/// A finished run's directory: a fresh run is refused (naming what is there and the
/// three ways out); `--overwrite` replaces it; `--resume --overwrite` is a usage error.
#[test]
fn a_fresh_run_refuses_a_directory_that_holds_a_run() {
    let tmp = tempfile::tempdir().unwrap();
    let cfg = config(tmp.path(), 3, 0);
    let out = tmp.path().join("run");
    assert!(run(train(&cfg, &out, &[])).status.success());
    let o = run(train(&cfg, &out, &[]));
    let err = stderr(&o);
    assert_eq!(o.status.code(), Some(1), "{err}");
    for needle in ["holds a run", "checkpoint", "metrics.jsonl", "export", "--resume", "--overwrite", "--output-dir"] {
        assert!(err.contains(needle), "`{needle}` missing: {err}");
    }
    let before = std::fs::read(out.join("export/model.safetensors")).unwrap();
    let o = run(train(&cfg, &out, &["--overwrite", "--seed", "8"]));
    assert!(o.status.success() && stderr(&o).contains("--overwrite: removing"), "{}", stderr(&o));
    assert!(before != std::fs::read(out.join("export/model.safetensors")).unwrap(), "the new run's export replaced the old");
    assert_eq!(logged_steps(&out), 3, "the new run's metrics only");
    let o = run(train(&cfg, &out, &["--resume", "--overwrite"]));
    assert_eq!(o.status.code(), Some(1));
    assert!(stderr(&o).contains("--overwrite"), "{}", stderr(&o));
}
