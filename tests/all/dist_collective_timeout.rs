//! A rank alive but no longer taking part (the `LONGCTX_TEST_STALL` hook: it sleeps
//! before a step, its heartbeats going on, as one stuck in a kernel or a deadlock would)
//! must not hold the others forever: after `parallel.collective_timeout_s`
//! (`--collective-timeout`) they abort with a message naming the rank and the
//! collective, and the launcher stops the job. On the CPU process transport, the path
//! CI can run; the NCCL watchdog does the same on GPUs.

use std::process::{Command, Output, Stdio};
use std::time::{Duration, Instant};

fn exe() -> &'static str {
    env!("CARGO_BIN_EXE_longctx")
}

fn text(o: &Output) -> String {
    format!("{}{}", String::from_utf8_lossy(&o.stdout), String::from_utf8_lossy(&o.stderr))
}

fn run_limited(cmd: &mut Command, limit: Duration) -> (Output, Duration) {
    let start = Instant::now();
    let mut child = cmd.stdin(Stdio::null()).stdout(Stdio::piped()).stderr(Stdio::piped()).spawn().expect("spawn longctx");
    loop {
        if child.try_wait().expect("wait").is_some() {
            return (child.wait_with_output().expect("output"), start.elapsed());
        }
        if start.elapsed() > limit {
            let _ = child.kill();
            let o = child.wait_with_output().expect("output");
            panic!("still running after {limit:?} (a stuck rank held the job):\n{}", text(&o));
        }
        std::thread::sleep(Duration::from_millis(20));
    }
}

fn train(out: &std::path::Path, extra: &[&str]) -> Command {
    let mut c = Command::new(exe());
    c.args(["launch", "--nproc-per-node", "2", "--master-port", "0", "--kill-grace", "1", "--"])
        .args(["train", "--model", "builtin:tiny", "--dataset", "synthetic:passkey", "--seq-length", "32"])
        .args(["--rope-theta", "1e5", "--max-train-steps", "40", "--batch-size", "2", "--device", "cpu"])
        .args(["--parallel-mode", "data_parallel", "--token-chunk", "16", "--output-dir"])
        .arg(out)
        .args(extra);
    c
}

#[test]
fn a_stalled_rank_makes_every_rank_abort_after_the_collective_timeout() {
    let tmp = tempfile::tempdir().unwrap();
    let out = tmp.path().join("run");
    let (o, took) = run_limited(train(&out, &["--collective-timeout", "3"]).env("LONGCTX_TEST_STALL", "1@2"), Duration::from_secs(60));
    let t = text(&o);
    assert!(!o.status.success(), "the job went on without rank 1:\n{t}");
    assert!(t.contains("rank 1: LONGCTX_TEST_STALL: no longer taking part from step 2"), "the hook ran:\n{t}");
    // Rank 0 names itself, the collective it waited in, the rank it waited for, and why.
    let line = t.lines().find(|l| l.contains("timed out after 3 s waiting in")).unwrap_or_else(|| panic!("no timeout message:\n{t}"));
    assert!(line.contains("[rank 0]") && line.contains("rank 0 timed out") && line.contains("for rank 1"), "{line}");
    assert!(line.contains("collective timeout"), "{line}");
    let collective = ["all_reduce_sum", "all_gather", "reduce_scatter_sum", "barrier", "sendrecv", "all_to_all"];
    assert!(collective.iter().any(|c| line.contains(&format!("waiting in {c} "))), "names the collective: {line}");
    assert!(t.contains("launch: rank 0 (local rank 0"), "the launcher names the rank that failed:\n{t}");
    assert!(took < Duration::from_secs(45), "took {took:?}");
    assert!(!out.join("export").exists(), "no export after an aborted run");
}

#[test]
fn the_collective_timeout_is_checked() {
    let tmp = tempfile::tempdir().unwrap();
    let o = Command::new(exe())
        .args(["train", "--collective-timeout", "-1", "--dry-run", "--output-dir"])
        .arg(tmp.path().join("run"))
        .output()
        .unwrap();
    let t = text(&o);
    assert!(!o.status.success(), "{t}");
    assert!(t.contains("parallel.collective_timeout_s") && t.contains("got -1"), "{t}");
    // 0 turns it off, and the config shows the key.
    let o = Command::new(exe())
        .args(["train", "--collective-timeout", "0", "--dry-run", "--output-dir"])
        .arg(tmp.path().join("run"))
        .output()
        .unwrap();
    assert!(o.status.success(), "{}", text(&o));
    assert!(text(&o).contains("collective_timeout_s = 0"), "{}", text(&o));
}
