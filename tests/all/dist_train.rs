//! Training as real processes on the CPU, in the shape users run it on GPUs:
//! `longctx launch --nproc-per-node N -- train --device cpu ...` starts N processes that
//! meet in the TCP rendezvous, build their groups, shard the optimizer, write per-rank
//! checkpoint shards and export, exchanging tensors over the rendezvous connections.
//! Each run is compared with the in-process run of the same world (`--world-size N`,
//! ranks as threads): every step's loss and gradient norm and every exported weight
//! within 1e-6 relative (the collectives are the same algorithms, so in practice the
//! bits agree), and the checkpoint's optimizer shards likewise.
//!
//! Failures: a rank killed mid-run, a rank that stops answering (SIGSTOP), NaN weights or gradients:
//! every rank exits non-zero within a bounded time naming the rank and the cause, and no
//! export or half-written checkpoint is left behind.

use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Output, Stdio};
use std::time::{Duration, Instant};

/// Relative tolerance, processes against threads (f32, same algorithms).
const TOL: f64 = 1e-6;

fn exe() -> &'static str {
    env!("CARGO_BIN_EXE_longctx")
}

/// Common flags: tiny built-in model, passkey data, 3 steps with clipping and a
/// checkpoint every step.
fn train_args(out: &Path, mode: &str, extra: &[&str]) -> Vec<String> {
    let mut a: Vec<String> = [
        "train", "--model", "builtin:tiny", "--dataset", "synthetic:passkey", "--seq-length", "64", "--rope-theta", "1e5",
        "--max-train-steps", "3", "--batch-size", "2", "--learning-rate", "3e-3", "--clip-grad", "1.0", "--device", "cpu",
        "--checkpoint-every", "1", "--token-chunk", "24", "--parallel-mode", mode, "--output-dir",
    ]
    .iter()
    .map(|s| s.to_string())
    .collect();
    a.push(out.display().to_string());
    a.extend(extra.iter().map(|s| s.to_string()));
    a
}

/// Replace the value of `flag` in `args`.
fn set(args: &mut [String], flag: &str, value: &str) {
    let i = args.iter().position(|x| x == flag).unwrap_or_else(|| panic!("no {flag}"));
    args[i + 1] = value.into();
}

fn output(cmd: &mut Command, limit: Duration) -> Output {
    let child = cmd.stdout(Stdio::piped()).stderr(Stdio::piped()).spawn().expect("spawn longctx");
    wait_limited(child, limit)
}

/// Wait for `child` at most `limit` (then kill it and fail).
fn wait_limited(mut child: Child, limit: Duration) -> Output {
    let start = Instant::now();
    loop {
        if child.try_wait().expect("wait").is_some() {
            return child.wait_with_output().expect("output");
        }
        if start.elapsed() > limit {
            let _ = child.kill();
            let o = child.wait_with_output().expect("output");
            panic!(
                "still running after {limit:?}\nstdout:\n{}\nstderr:\n{}",
                String::from_utf8_lossy(&o.stdout),
                String::from_utf8_lossy(&o.stderr)
            );
        }
        std::thread::sleep(Duration::from_millis(20));
    }
}

fn ok(o: &Output, what: &str) {
    assert!(
        o.status.success(),
        "{what} failed ({:?})\nstdout:\n{}\nstderr:\n{}",
        o.status,
        String::from_utf8_lossy(&o.stdout),
        String::from_utf8_lossy(&o.stderr)
    );
}

/// In-process ranks.
fn threads(out: &Path, n: usize, mode: &str, extra: &[&str]) {
    let mut args = train_args(out, mode, extra);
    args.extend(["--world-size".to_string(), n.to_string()]);
    ok(&output(Command::new(exe()).args(&args), Duration::from_secs(300)), &format!("threads {mode} x{n}"));
}

/// One process per rank, through `longctx launch`.
fn processes(out: &Path, n: usize, mode: &str, extra: &[&str]) {
    let mut args: Vec<String> =
        ["launch", "--nproc-per-node", &n.to_string(), "--master-port", "0", "--"].iter().map(|s| s.to_string()).collect();
    args.extend(train_args(out, mode, extra));
    ok(&output(Command::new(exe()).args(&args), Duration::from_secs(300)), &format!("processes {mode} x{n}"));
}

/// `(step, loss, grad_norm)` of every line of metrics.jsonl that has a loss.
fn steps(dir: &Path) -> Vec<(u64, f64, f64)> {
    let text = std::fs::read_to_string(dir.join("metrics.jsonl")).expect("metrics.jsonl");
    text.lines()
        .filter_map(|l| serde_json::from_str::<serde_json::Value>(l).ok())
        .filter(|v| v.get("loss").is_some())
        .map(|v| {
            (
                v["global_step"].as_u64().expect("global_step"),
                v["loss"].as_f64().expect("loss"),
                v["grad_norm"].as_f64().expect("grad_norm"),
            )
        })
        .collect()
}

fn rel(a: f64, b: f64) -> f64 {
    if a == b {
        0.0
    } else {
        (a - b).abs() / a.abs().max(b.abs()).max(1e-30)
    }
}

fn tensors(path: &Path) -> HashMap<String, Vec<f32>> {
    let t = candle_core::safetensors::load(path, &candle_core::Device::Cpu).unwrap_or_else(|e| panic!("{}: {e}", path.display()));
    t.into_iter().map(|(k, v)| (k, v.to_dtype(candle_core::DType::F32).unwrap().flatten_all().unwrap().to_vec1::<f32>().unwrap())).collect()
}

/// Every tensor of two safetensors files within TOL (max |a−b| / max |b|, per tensor).
fn same_tensors(a: &Path, b: &Path) {
    let (ta, tb) = (tensors(a), tensors(b));
    assert_eq!(
        ta.keys().collect::<std::collections::BTreeSet<_>>(),
        tb.keys().collect::<std::collections::BTreeSet<_>>(),
        "{} vs {}",
        a.display(),
        b.display()
    );
    for (k, va) in &ta {
        let vb = &tb[k];
        assert_eq!(va.len(), vb.len(), "{k}");
        let scale = vb.iter().fold(0f64, |m, x| m.max(x.abs() as f64)).max(1e-30);
        let diff = va.iter().zip(vb).fold(0f64, |m, (x, y)| m.max((*x as f64 - *y as f64).abs()));
        assert!(diff / scale <= TOL, "{}: tensor {k}: max diff {diff:e} (scale {scale:e}) vs {}", a.display(), b.display());
    }
}

fn safetensors_in(dir: &Path) -> Vec<PathBuf> {
    let mut v: Vec<PathBuf> = std::fs::read_dir(dir)
        .unwrap_or_else(|e| panic!("{}: {e}", dir.display()))
        .map(|e| e.unwrap().path())
        .filter(|p| p.extension().is_some_and(|x| x == "safetensors"))
        .collect();
    v.sort();
    v
}

/// The process run of `(n, mode, extra)` against the thread run.
fn compare(n: usize, mode: &str, extra: &[&str]) {
    let tmp = tempfile::tempdir().unwrap();
    let (t, p) = (tmp.path().join("threads"), tmp.path().join("processes"));
    threads(&t, n, mode, extra);
    processes(&p, n, mode, extra);
    let (st, sp) = (steps(&t), steps(&p));
    assert_eq!(st.len(), 3, "threads logged {st:?}");
    assert_eq!(st.len(), sp.len(), "{mode} x{n}: steps {st:?} vs {sp:?}");
    for ((gt, lt, nt), (gp, lp, np)) in st.iter().zip(&sp) {
        assert_eq!(gt, gp);
        assert!(lt.is_finite() && nt.is_finite(), "{mode} x{n}: step {gt}: loss {lt} norm {nt}");
        assert!(rel(*lt, *lp) <= TOL, "{mode} x{n} step {gt}: loss threads {lt} processes {lp}");
        assert!(rel(*nt, *np) <= TOL, "{mode} x{n} step {gt}: grad norm threads {nt} processes {np}");
    }
    // The export and every file of the checkpoint (weights, one optimizer shard per rank).
    same_tensors(&p.join("export/model.safetensors"), &t.join("export/model.safetensors"));
    let (ct, cp) = (safetensors_in(&t.join("checkpoint")), safetensors_in(&p.join("checkpoint")));
    let names = |v: &[PathBuf]| v.iter().map(|p| p.file_name().unwrap().to_owned()).collect::<Vec<_>>();
    assert_eq!(names(&ct), names(&cp), "{mode} x{n}: checkpoint files");
    assert_eq!(ct.len(), n + 1, "{mode} x{n}: weights + one optimizer shard per rank: {:?}", names(&ct));
    for (a, b) in cp.iter().zip(&ct) {
        same_tensors(a, b);
    }
}

#[test]
fn two_processes_match_two_threads_in_every_mode() {
    compare(2, "data_parallel", &[]); // dp 2 × sp 1
    compare(2, "zigzag_ring_attn", &[]); // dp 1 × sp 2
    compare(2, "ulysses_attn", &[]);
    compare(2, "fpdt", &["--fpdt-chunk-size", "16", "--fpdt-offload"]);
    compare(2, "usp", &[]); // ring of 2, Ulysses groups of 1
}

#[test]
fn four_processes_match_four_threads_in_every_mode() {
    compare(4, "data_parallel", &[]);
    compare(4, "zigzag_ring_attn", &[]);
    compare(4, "zigzag_ring_attn", &["--sp-size", "2"]); // dp 2 × sp 2
    compare(4, "ulysses_attn", &[]); // 4 query heads, 2 kv heads replicated
    compare(4, "fpdt", &["--fpdt-chunk-size", "32"]);
    compare(4, "usp", &["--ulysses-size", "2"]); // ring 2 × Ulysses 2
}

/// A launched run stopped after 2 of 3 steps (`--stop-at-step`, a checkpoint with one
/// optimizer shard per rank) and resumed by a launched run with another world size
/// (`--allow-layout-change`) ends where the uninterrupted run ends: the same bits with
/// the same world, within 1e-4 when the shards are re-cut.
#[test]
fn processes_stop_and_resume_from_their_own_checkpoint() {
    let tmp = tempfile::tempdir().unwrap();
    let whole = tmp.path().join("whole");
    processes(&whole, 2, "zigzag_ring_attn", &[]);
    for (n, tol) in [(2, TOL), (4, 1e-4)] {
        let parts = tmp.path().join(format!("parts{n}"));
        processes(&parts, 2, "zigzag_ring_attn", &["--stop-at-step", "2"]);
        assert!(!parts.join("export").exists(), "a stopped run exports nothing");
        let resume: &[&str] = if n == 2 { &["--resume"] } else { &["--resume", "--allow-layout-change"] };
        processes(&parts, n, "zigzag_ring_attn", resume);
        let (sw, sp) = (steps(&whole), steps(&parts));
        let last = |v: &[(u64, f64, f64)]| *v.iter().find(|s| s.0 == 3).expect("step 3 logged");
        let (w3, p3) = (last(&sw), last(&sp));
        assert!(rel(w3.1, p3.1) <= tol && rel(w3.2, p3.2) <= tol, "resumed on {n}: step 3: whole {w3:?} resumed {p3:?}");
        if n == 2 {
            same_tensors(&parts.join("export/model.safetensors"), &whole.join("export/model.safetensors"));
        }
    }
}

/// Ranks started by hand (as torchrun or Slurm would), so that the test can kill or stop one.
fn spawn_ranks(out: &Path, n: usize, steps: &str, flags: &[(&str, &str)], env: &[(&str, &str)], extra: &[&str]) -> Vec<Child> {
    let port = std::net::TcpListener::bind("127.0.0.1:0").unwrap().local_addr().unwrap().port();
    (0..n)
        .map(|r| {
            let mut a = train_args(out, "zigzag_ring_attn", extra);
            set(&mut a, "--max-train-steps", steps);
            for (f, v) in flags {
                set(&mut a, f, v);
            }
            let mut c = Command::new(exe());
            c.args(&a)
                .env("RANK", r.to_string())
                .env("LOCAL_RANK", r.to_string())
                .env("WORLD_SIZE", n.to_string())
                .env("LOCAL_WORLD_SIZE", n.to_string())
                .env("MASTER_ADDR", "127.0.0.1")
                .env("MASTER_PORT", port.to_string())
                .stdout(Stdio::piped())
                .stderr(Stdio::piped());
            for (k, v) in env {
                c.env(k, v);
            }
            c.spawn().expect("spawn rank")
        })
        .collect()
}

fn wait_for_steps(out: &Path, k: usize, limit: Duration) {
    let start = Instant::now();
    while std::fs::read_to_string(out.join("metrics.jsonl")).map(|t| t.lines().filter(|l| l.contains("\"loss\"")).count()).unwrap_or(0) < k
    {
        assert!(start.elapsed() < limit, "no {k} steps logged within {limit:?}");
        std::thread::sleep(Duration::from_millis(20));
    }
}

/// Nothing half-written: no export, and a checkpoint, if any, is complete.
fn no_half_written(out: &Path) {
    assert!(!out.join("export").exists(), "an export after a failed run");
    let ck = out.join("checkpoint");
    if ck.exists() {
        assert!(ck.join("state.json").is_file() && ck.join("model.safetensors").is_file(), "incomplete checkpoint");
    }
}

/// Two hand-started ranks; once two steps are logged, `hurt` is done to rank 1. Rank 0
/// must fail within `bound` with a message containing `expect`, leaving nothing
/// half-written. `env` goes to both ranks.
fn rank_0_stops_when_rank_1_is_lost(env: &[(&str, &str)], hurt: &str, bound: Duration, expect: &str) {
    let tmp = tempfile::tempdir().unwrap();
    let out = tmp.path().join("run");
    let mut ranks = spawn_ranks(&out, 2, "100000", &[], env, &[]);
    wait_for_steps(&out, 2, Duration::from_secs(120));
    let pid = ranks[1].id().to_string();
    assert!(Command::new("kill").args([hurt, &pid]).status().unwrap().success());
    let t = Instant::now();
    let o0 = wait_limited(ranks.remove(0), bound + Duration::from_secs(20));
    let lost = t.elapsed();
    let _ = Command::new("kill").args(["-KILL", &pid]).status();
    let _ = wait_limited(ranks.remove(0), Duration::from_secs(5));
    let err = String::from_utf8_lossy(&o0.stderr);
    assert!(!o0.status.success(), "rank 0 went on without its peer ({hurt}): {err}");
    assert!(err.contains(expect), "rank 0 must name the lost rank and why (`{expect}`): {err}");
    assert!(lost < bound, "rank 0 took {lost:?} to stop after `kill {hurt}` of rank 1 (bound {bound:?})");
    no_half_written(&out);
}

#[test]
fn a_killed_rank_stops_every_rank() {
    // SIGKILL: no goodbye, the socket closes at once.
    rank_0_stops_when_rank_1_is_lost(&[], "-KILL", Duration::from_secs(10), "rank 1 exited without finishing");
}

#[test]
fn a_silent_rank_stops_every_rank() {
    // SIGSTOP: the connection stays open but nothing arrives for the peer timeout.
    rank_0_stops_when_rank_1_is_lost(&[("LONGCTX_PEER_TIMEOUT_S", "5")], "-STOP", Duration::from_secs(20), "rank 1 silent for 5 s");
}

/// An update that makes the weights NaN (injected: a learning rate that large is refused
/// by the config checks) stops every rank before anything is written; NaN gradients on
/// one rank only make every rank skip the same steps, and `--max-skipped-steps` of them
/// in a row stop every rank.
#[test]
fn non_finite_numbers_stop_every_rank_before_anything_is_written() {
    let tmp = tempfile::tempdir().unwrap();
    let flags = [("--parallel-mode", "data_parallel"), ("--checkpoint-every", "0")];
    for (name, fault, cause) in [
        ("weights", "nan-weights:2", "made the weights non-finite"),
        ("grads", "nan-grad:1:2-20", "2 optimizer steps in a row had a non-finite gradient norm"),
    ] {
        let out = tmp.path().join(name);
        // Ranks by hand, so that each one's own status and message can be read (a launcher
        // stops the others as soon as the first one fails).
        let ranks = spawn_ranks(&out, 2, "20", &flags, &[("LONGCTX_FAULT", fault)], &["--max-skipped-steps", "2"]);
        for (r, child) in ranks.into_iter().enumerate() {
            let o = wait_limited(child, Duration::from_secs(120));
            let err = String::from_utf8_lossy(&o.stderr);
            assert!(!o.status.success(), "{name}: rank {r}: a run whose numbers became NaN succeeded:\n{err}");
            assert!(err.contains(&format!("rank {r} of 2")), "{name}: rank {r} must name itself: {err}");
            assert!(err.contains(cause), "{name}: rank {r} must name the cause: {err}");
        }
        no_half_written(&out);
        assert!(!out.join("checkpoint").exists(), "{name}: no checkpoint holds the non-finite state");
    }
}
