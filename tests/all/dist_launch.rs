//! Launcher, rendezvous and failure monitor, end to end with the probe binary on
//! loopback; and the rank-environment parser (torchrun and Slurm variables).
//!
//! Every process run here has a hard wall-clock limit (the helper kills it and fails
//! the test), so a hang is a failure, never a stuck suite. Time bounds asserted:
//! failure paths must end within 15 s (kill grace 1-2 s, rendezvous timeouts 2 s).

use longctx::parallel::env::{first_host, tasks_on_node};
use longctx::parallel::launch::PEER_FAILED_EXIT_CODE;
use longctx::parallel::DistEnv;
use std::collections::HashMap;
use std::io::{BufRead, BufReader, Read};
use std::process::{Child, Command, ExitStatus, Stdio};
use std::sync::mpsc;
use std::time::{Duration, Instant};

const PROBE: &str = env!("CARGO_BIN_EXE_longctx-dist-probe");

struct Output {
    status: ExitStatus,
    stdout: String,
    stderr: String,
    elapsed: Duration,
}

fn spawn(args: &[&str], env: &[(&str, String)]) -> Child {
    let mut cmd = Command::new(PROBE);
    cmd.args(args).stdin(Stdio::null()).stdout(Stdio::piped()).stderr(Stdio::piped());
    for k in ["RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "SLURM_PROCID"] {
        cmd.env_remove(k);
    }
    for (k, v) in env {
        cmd.env(k, v);
    }
    cmd.spawn().expect("start the probe")
}

/// Wait for `child` at most `limit`; on overrun kill it and fail the test.
fn finish(mut child: Child, limit: Duration) -> Output {
    let start = Instant::now();
    let pipe = |r: Option<Box<dyn Read + Send>>| {
        std::thread::spawn(move || {
            let mut s = String::new();
            if let Some(mut r) = r {
                let _ = r.read_to_string(&mut s);
            }
            s
        })
    };
    let out = pipe(child.stdout.take().map(|s| Box::new(s) as Box<dyn Read + Send>));
    let err = pipe(child.stderr.take().map(|s| Box::new(s) as Box<dyn Read + Send>));
    let status = loop {
        if let Some(st) = child.try_wait().unwrap() {
            break st;
        }
        if start.elapsed() > limit {
            let _ = child.kill();
            let _ = child.wait();
            panic!("process still running after {limit:?} (hang)");
        }
        std::thread::sleep(Duration::from_millis(20));
    };
    let elapsed = start.elapsed();
    Output { status, stdout: out.join().unwrap(), stderr: err.join().unwrap(), elapsed }
}

fn run(args: &[&str], limit: Duration) -> Output {
    finish(spawn(args, &[]), limit)
}

fn free_port() -> u16 {
    std::net::TcpListener::bind("127.0.0.1:0").unwrap().local_addr().unwrap().port()
}

fn rank_env(rank: usize, world: usize, port: u16, timeout_s: &str) -> Vec<(&'static str, String)> {
    vec![
        ("RANK", rank.to_string()),
        ("WORLD_SIZE", world.to_string()),
        ("LOCAL_RANK", rank.to_string()),
        ("LOCAL_WORLD_SIZE", world.to_string()),
        ("MASTER_ADDR", "127.0.0.1".to_string()),
        ("MASTER_PORT", port.to_string()),
        ("LONGCTX_RDZV_TIMEOUT_S", timeout_s.to_string()),
    ]
}

/// `(rank, world, blob)` from the probe lines `[rank N] rank N/W local L/LW blob H`.
fn blob_lines(stdout: &str) -> Vec<(usize, usize, String)> {
    stdout
        .lines()
        .filter_map(|l| {
            let rest = l.strip_prefix("[rank ")?;
            let (prefix_rank, rest) = rest.split_once("] rank ")?;
            let (rw, rest) = rest.split_once(' ')?;
            let (r, w) = rw.split_once('/')?;
            assert_eq!(prefix_rank, r, "output prefix names the printing rank: {l}");
            let blob = rest.split_once("blob ")?.1.to_string();
            Some((r.parse().ok()?, w.parse().ok()?, blob))
        })
        .collect()
}

#[test]
fn three_ranks_agree_on_the_blob() {
    let o = run(&["launch", "--nproc-per-node", "3", "--master-port", "0", "--rdzv-timeout", "20", "--", "run"], Duration::from_secs(40));
    assert!(o.status.success(), "launch failed: {:?}\n{}\n{}", o.status, o.stdout, o.stderr);
    let mut lines = blob_lines(&o.stdout);
    lines.sort();
    assert_eq!(lines.len(), 3, "one line per rank:\n{}", o.stdout);
    for (i, (r, w, blob)) in lines.iter().enumerate() {
        assert_eq!((*r, *w), (i, 3));
        assert_eq!(blob, &lines[0].2, "all ranks see rank 0's blob");
        assert_eq!(blob.len(), 16);
    }
}

#[test]
fn early_exit_of_one_rank_stops_the_launch() {
    let o = run(
        &["launch", "--nproc-per-node", "3", "--master-port", "0", "--kill-grace", "2", "--", "run", "--fail-rank", "1", "--sleep"],
        Duration::from_secs(40),
    );
    assert_eq!(o.status.code(), Some(3), "launcher exits with the failed rank's code\n{}", o.stderr);
    assert!(
        o.stderr.contains("rank 1 (local rank 1, pid") && o.stderr.contains("exited with status 3; stopped the other ranks"),
        "error names the rank and status:\n{}",
        o.stderr
    );
    assert!(o.elapsed < Duration::from_secs(15), "took {:?}", o.elapsed);
}

#[test]
fn failure_before_rendezvous_stops_waiting_ranks() {
    // Rank 2 dies at once; ranks 0 and 1 would wait 60 s in the rendezvous.
    let o = run(
        &[
            "launch", "--nproc-per-node", "3", "--master-port", "0", "--rdzv-timeout", "60", "--kill-grace", "1", "--", "run",
            "--fail-rank", "2", "--fail-before-rdzv", "--exit-code", "7",
        ],
        Duration::from_secs(40),
    );
    assert_eq!(o.status.code(), Some(7), "{}", o.stderr);
    assert!(o.stderr.contains("launch: rank 2 (local rank 2"), "{}", o.stderr);
    assert!(o.elapsed < Duration::from_secs(15), "took {:?}", o.elapsed);
}

/// Without a launcher (as across nodes), the monitor makes the surviving ranks exit
/// when one dies after the rendezvous.
#[test]
fn monitor_tells_survivors_when_a_rank_dies() {
    let port = free_port();
    let children: Vec<_> = (0..3)
        .map(|r| {
            let args: &[&str] = if r == 2 { &["run", "--fail-rank", "2"] } else { &["run", "--sleep"] };
            spawn(args, &rank_env(r, 3, port, "20"))
        })
        .collect();
    let outs: Vec<_> = children.into_iter().map(|c| finish(c, Duration::from_secs(30))).collect();
    assert_eq!(outs[2].status.code(), Some(3), "{}", outs[2].stderr);
    for (r, o) in outs.iter().enumerate().take(2) {
        assert_eq!(o.status.code(), Some(PEER_FAILED_EXIT_CODE), "rank {r} stops on the monitor's news: {}", o.stderr);
        assert!(o.stderr.contains("rank 2 exited without finishing"), "rank {r}: {}", o.stderr);
        assert!(o.elapsed < Duration::from_secs(15), "rank {r} took {:?}", o.elapsed);
    }
    // Same agreed blob on the three ranks.
    let blobs: Vec<String> = outs.iter().map(|o| o.stdout.split("blob ").nth(1).unwrap_or("").trim().to_string()).collect();
    assert!(!blobs[0].is_empty() && blobs.iter().all(|b| b == &blobs[0]), "{blobs:?}");
}

/// A reported failure reaches the others with its reason.
#[test]
fn reported_failure_carries_its_reason() {
    let port = free_port();
    let children: Vec<_> = (0..3)
        .map(|r| {
            let args: &[&str] = if r == 1 { &["run", "--fail-rank", "1", "--report", "--exit-code", "5"] } else { &["run", "--sleep"] };
            spawn(args, &rank_env(r, 3, port, "20"))
        })
        .collect();
    let outs: Vec<_> = children.into_iter().map(|c| finish(c, Duration::from_secs(30))).collect();
    for r in [0, 2] {
        assert_eq!(outs[r].status.code(), Some(PEER_FAILED_EXIT_CODE), "rank {r}: {}", outs[r].stderr);
        assert!(outs[r].stderr.contains("rank 1 failed: exit code 5"), "rank {r}: {}", outs[r].stderr);
    }
}

#[test]
fn rendezvous_times_out_naming_missing_ranks() {
    let port = free_port();
    let children: Vec<_> = (0..2).map(|r| spawn(&["run"], &rank_env(r, 4, port, "2"))).collect();
    let outs: Vec<_> = children.into_iter().map(|c| finish(c, Duration::from_secs(30))).collect();
    let want = format!("rendezvous timed out after 2 s waiting for ranks [2, 3] on 127.0.0.1:{port}");
    for (r, o) in outs.iter().enumerate() {
        assert_eq!(o.status.code(), Some(1), "rank {r}");
        assert!(o.stderr.contains(&want), "rank {r} reports the master's message:\n{}", o.stderr);
        assert!(o.elapsed < Duration::from_secs(10), "rank {r} took {:?}", o.elapsed);
    }
}

#[test]
fn rendezvous_timeout_under_the_launcher() {
    let o = run(
        &[
            "launch", "--nproc-per-node", "3", "--master-port", "0", "--rdzv-timeout", "2", "--kill-grace", "1", "--", "run",
            "--absent-rank", "2",
        ],
        Duration::from_secs(40),
    );
    assert_eq!(o.status.code(), Some(1), "{}", o.stderr);
    assert!(o.stderr.contains("rendezvous timed out after 2 s waiting for ranks [2]"), "{}", o.stderr);
    assert!(o.stderr.contains("stopped the other ranks"), "{}", o.stderr);
    assert!(o.elapsed < Duration::from_secs(15), "took {:?}", o.elapsed);
}

#[test]
fn client_times_out_when_master_never_comes() {
    let port = free_port();
    let o = finish(spawn(&["run"], &rank_env(1, 2, port, "1")), Duration::from_secs(30));
    assert_eq!(o.status.code(), Some(1));
    assert!(o.stderr.contains(&format!("waiting for rank 0 to accept on 127.0.0.1:{port}")), "{}", o.stderr);
}

#[test]
fn duplicate_rank_and_world_mismatch_are_rejected() {
    let port = free_port();
    let mut cs = vec![spawn(&["run"], &rank_env(0, 3, port, "10"))];
    std::thread::sleep(Duration::from_millis(300));
    cs.push(spawn(&["run"], &rank_env(1, 3, port, "10")));
    std::thread::sleep(Duration::from_millis(300));
    cs.push(spawn(&["run"], &rank_env(1, 3, port, "10")));
    let outs: Vec<_> = cs.into_iter().map(|c| finish(c, Duration::from_secs(30))).collect();
    for o in &outs {
        assert_eq!(o.status.code(), Some(1));
        assert!(o.stderr.contains("rank 1 joined twice"), "{}", o.stderr);
    }

    let port = free_port();
    let cs = vec![spawn(&["run"], &rank_env(0, 2, port, "10")), spawn(&["run"], &rank_env(1, 3, port, "10"))];
    let outs: Vec<_> = cs.into_iter().map(|c| finish(c, Duration::from_secs(30))).collect();
    for o in &outs {
        assert_eq!(o.status.code(), Some(1));
        assert!(o.stderr.contains("rank 1 has WORLD_SIZE = 3 but rank 0 has WORLD_SIZE = 2"), "{}", o.stderr);
    }
}

#[test]
fn ctrl_c_is_forwarded_to_the_ranks() {
    let mut child = spawn(&["launch", "--nproc-per-node", "2", "--master-port", "0", "--kill-grace", "2", "--", "run", "--sleep"], &[]);
    let pid = child.id();
    // Wait until both ranks are past the rendezvous.
    let stdout = child.stdout.take().unwrap();
    let (tx, rx) = mpsc::channel();
    std::thread::spawn(move || {
        for line in BufReader::new(stdout).lines().map_while(Result::ok) {
            let _ = tx.send(line);
        }
    });
    let mut seen = 0;
    let until = Instant::now() + Duration::from_secs(20);
    while seen < 2 {
        let left = until.saturating_duration_since(Instant::now());
        match rx.recv_timeout(left) {
            Ok(l) if l.contains(" blob ") => seen += 1,
            Ok(_) => {}
            Err(_) => {
                let _ = child.kill();
                panic!("ranks did not report in time");
            }
        }
    }
    // SAFETY: signalling our own child process.
    unsafe {
        libc::kill(pid as libc::pid_t, libc::SIGINT);
    }
    let o = finish(child, Duration::from_secs(20));
    assert_eq!(o.status.code(), Some(130), "{}", o.stderr);
    assert!(o.stderr.contains("interrupted by signal 2 (SIGINT)"), "{}", o.stderr);
    assert!(o.elapsed < Duration::from_secs(10), "took {:?}", o.elapsed);
}

// ---------------------------------------------------------------- environment

fn lookup(vars: &[(&str, &str)]) -> longctx::Result<Option<DistEnv>> {
    let m: HashMap<String, String> = vars.iter().map(|(k, v)| (k.to_string(), v.to_string())).collect();
    DistEnv::from_lookup(|k| m.get(k).cloned())
}

fn lookup_err(vars: &[(&str, &str)]) -> String {
    match lookup(vars) {
        Ok(e) => panic!("expected an error, got {e:?}"),
        Err(e) => e.to_string(),
    }
}

const TORCHRUN: [(&str, &str); 6] = [
    ("RANK", "5"),
    ("WORLD_SIZE", "8"),
    ("LOCAL_RANK", "1"),
    ("LOCAL_WORLD_SIZE", "4"),
    ("MASTER_ADDR", "node0"),
    ("MASTER_PORT", "29500"),
];

fn with(base: &[(&'static str, &'static str)], set: &[(&'static str, &'static str)]) -> Vec<(&'static str, &'static str)> {
    let mut v: Vec<_> = base.iter().filter(|(k, _)| !set.iter().any(|(s, _)| s == k)).cloned().collect();
    v.extend(set.iter().filter(|(_, v)| !v.is_empty()).cloned());
    v
}

#[test]
fn torchrun_environment() {
    let e = lookup(&TORCHRUN).unwrap().unwrap();
    assert_eq!(e, DistEnv { rank: 5, local_rank: 1, world: 8, local_world: 4, master_addr: "node0".into(), master_port: 29500 });
    assert_eq!(e.master(), "node0:29500");
    assert_eq!(lookup(&[]).unwrap(), None);

    let e = lookup_err(&with(&TORCHRUN, &[("MASTER_PORT", "")]));
    assert!(e.contains("`MASTER_PORT` is not set"), "{e}");
    let e = lookup_err(&with(&TORCHRUN, &[("RANK", "8")]));
    assert!(e.contains("RANK = 8 is not below WORLD_SIZE = 8"), "{e}");
    let e = lookup_err(&with(&TORCHRUN, &[("LOCAL_RANK", "4")]));
    assert!(e.contains("LOCAL_RANK = 4 is not below LOCAL_WORLD_SIZE = 4"), "{e}");
    let e = lookup_err(&with(&TORCHRUN, &[("LOCAL_WORLD_SIZE", "16")]));
    assert!(e.contains("LOCAL_WORLD_SIZE = 16 must be in 1..=8"), "{e}");
    let e = lookup_err(&with(&TORCHRUN, &[("WORLD_SIZE", "eight")]));
    assert!(e.contains("WORLD_SIZE = `eight` is not a non-negative integer"), "{e}");
    let e = lookup_err(&with(&TORCHRUN, &[("MASTER_PORT", "70000")]));
    assert!(e.contains("MASTER_PORT = `70000` is not a TCP port"), "{e}");
    let e = lookup_err(&[("RANK", "0")]);
    assert!(e.contains("`WORLD_SIZE` is not set"), "{e}");
    // torchrun variables win over Slurm's.
    let e = lookup(&with(&TORCHRUN, &[("SLURM_PROCID", "3"), ("SLURM_NTASKS", "4")])).unwrap().unwrap();
    assert_eq!(e.rank, 5);
}

const SLURM: [(&str, &str); 7] = [
    ("SLURM_PROCID", "6"),
    ("SLURM_NTASKS", "8"),
    ("SLURM_LOCALID", "2"),
    ("SLURM_NODEID", "1"),
    ("SLURM_TASKS_PER_NODE", "4(x2)"),
    ("SLURM_STEP_NODELIST", "gpu[07-08]"),
    ("MASTER_PORT", "29400"),
];

#[test]
fn slurm_environment() {
    let e = lookup(&SLURM).unwrap().unwrap();
    assert_eq!(e, DistEnv { rank: 6, local_rank: 2, world: 8, local_world: 4, master_addr: "gpu07".into(), master_port: 29400 });
    let e = lookup(&with(&SLURM, &[("MASTER_ADDR", "10.0.0.1")])).unwrap().unwrap();
    assert_eq!(e.master_addr, "10.0.0.1");
    let e = lookup(&with(&SLURM, &[("SLURM_TASKS_PER_NODE", "5,3"), ("SLURM_LOCALID", "1")])).unwrap().unwrap();
    assert_eq!(e.local_world, 3);
    let e = lookup(&with(&SLURM, &[("SLURM_NTASKS_PER_NODE", "4"), ("SLURM_TASKS_PER_NODE", "")])).unwrap().unwrap();
    assert_eq!(e.local_world, 4);
    let e = lookup(&with(&SLURM, &[("SLURM_STEP_NODELIST", ""), ("SLURM_JOB_NODELIST", "a1,b2")])).unwrap().unwrap();
    assert_eq!(e.master_addr, "a1");
    // A single task is not distributed.
    assert_eq!(lookup(&with(&SLURM, &[("SLURM_NTASKS", "1"), ("SLURM_PROCID", "0")])).unwrap(), None);

    let e = lookup_err(&with(&SLURM, &[("MASTER_PORT", "")]));
    assert!(e.contains("MASTER_PORT is not set"), "{e}");
    let e = lookup_err(&with(&SLURM, &[("SLURM_PROCID", "8")]));
    assert!(e.contains("RANK = 8 is not below WORLD_SIZE = 8"), "{e}");
    let e = lookup_err(&with(&SLURM, &[("SLURM_NODEID", "2")]));
    assert!(e.contains("SLURM_NODEID = 2 but SLURM_TASKS_PER_NODE = `4(x2)` describes only 2 node(s)"), "{e}");
    let e = lookup_err(&with(&SLURM, &[("SLURM_STEP_NODELIST", "rack[1-2]n[01-04]")]));
    assert!(e.contains("set MASTER_ADDR"), "{e}");
    let e = lookup_err(&with(&SLURM, &[("SLURM_STEP_NODELIST", "")]));
    assert!(e.contains("neither MASTER_ADDR nor a node list"), "{e}");
    let e = lookup_err(&with(&SLURM, &[("SLURM_LOCALID", "")]));
    assert!(e.contains("`SLURM_LOCALID` is not"), "{e}");
}

#[test]
fn slurm_host_lists_and_task_counts() {
    assert_eq!(first_host("node07").as_deref(), Some("node07"));
    assert_eq!(first_host("node[07-10,12]").as_deref(), Some("node07"));
    assert_eq!(first_host("gpu[3]-ib,cpu1").as_deref(), Some("gpu3-ib"));
    assert_eq!(first_host("a-1.x,b").as_deref(), Some("a-1.x"));
    assert_eq!(first_host("n[a-b]"), None);
    assert_eq!(first_host("n[[1]]"), None);
    assert_eq!(first_host(""), None);
    assert_eq!(tasks_on_node("4(x2),3", 0).unwrap(), 4);
    assert_eq!(tasks_on_node("4(x2),3", 1).unwrap(), 4);
    assert_eq!(tasks_on_node("4(x2),3", 2).unwrap(), 3);
    assert!(tasks_on_node("4(x2),3", 3).is_err());
    assert!(tasks_on_node("4(2)", 0).is_err());
}

// ---------------------------------------------------------------- monitor, in process

/// Three ranks as threads: a reported failure reaches everyone with its reason, each
/// failure callback runs exactly once, and reports made after a failure is known
/// change nothing (no echo of the first failure as a new one).
#[test]
fn monitor_callbacks_run_once_and_late_reports_are_silent() {
    use longctx::parallel::{rendezvous, RendezvousOptions};
    use std::sync::atomic::{AtomicUsize, Ordering};
    use std::sync::Arc;
    let port = free_port();
    let opts = RendezvousOptions { timeout: Duration::from_secs(10), ..Default::default() };
    let rdzvs: Vec<_> = std::thread::scope(|s| {
        let hs: Vec<_> = (0..3)
            .map(|r| {
                let env = DistEnv { rank: r, local_rank: r, world: 3, local_world: 3, master_addr: "127.0.0.1".into(), master_port: port };
                let opts = opts.clone();
                // each rank offers its own blob: only rank 0's may come back
                s.spawn(move || rendezvous(&env, move || Ok(vec![r as u8 + 7; 16]), &opts).unwrap())
            })
            .collect();
        hs.into_iter().map(|h| h.join().unwrap()).collect()
    });
    assert!(rdzvs.iter().all(|r| r.blob == vec![7u8; 16]), "every rank gets rank 0's blob");
    let calls: Vec<Arc<AtomicUsize>> = (0..3).map(|_| Arc::new(AtomicUsize::new(0))).collect();
    for (r, c) in rdzvs.iter().zip(&calls) {
        let c = c.clone();
        r.monitor.on_failure(move |_| {
            c.fetch_add(1, Ordering::SeqCst);
        });
    }
    rdzvs[2].monitor.report_failure("disk full");
    for (r, rd) in rdzvs.iter().enumerate() {
        let got = rd.monitor.wait_failure(Some(Duration::from_secs(5)));
        assert_eq!(got.as_deref(), Some("rank 2 failed: disk full"), "rank {r}");
    }
    // Late reports (the errors the failure causes) are not news.
    rdzvs[1].monitor.report_failure("NCCL aborted");
    rdzvs[0].monitor.report_failure("NCCL aborted");
    std::thread::sleep(Duration::from_millis(300));
    for (r, rd) in rdzvs.iter().enumerate() {
        assert_eq!(rd.monitor.failure().as_deref(), Some("rank 2 failed: disk full"), "rank {r}");
        assert_eq!(calls[r].load(Ordering::SeqCst), 1, "rank {r}: callback runs once");
    }
    // A callback registered after the failure runs at once.
    let late = Arc::new(AtomicUsize::new(0));
    let l = late.clone();
    rdzvs[0].monitor.on_failure(move |_| {
        l.fetch_add(1, Ordering::SeqCst);
    });
    assert_eq!(late.load(Ordering::SeqCst), 1);
}
