//! The rendezvous under attack: a real job (`longctx launch -- train --device cpu`, one
//! launcher per "node" on loopback, so that rank 0 waits while a hostile client acts)
//! must complete while someone without the job secret poses as a rank, sends garbage,
//! an oversized frame, a forged error frame, or holds idle sockets open; rank 0 logs
//! each dropped connection and is never stopped by one. A rank with the wrong secret is
//! refused with a message naming `LONGCTX_RDZV_SECRET`, and the job still runs when the
//! right rank comes. Every process has a hard wall-clock limit (a hang fails the test).

use std::io::{Read, Write};
use std::net::TcpStream;
use std::path::Path;
use std::process::{Child, Command, Output, Stdio};
use std::time::{Duration, Instant};

const SECRET: &str = "3d9a0f6c21b84e57a9c0d3f1e6b2a8c47f5e1d0b9a3c6e2f8d4b7a1c0e9f5d3b";
/// Another random secret (a rank of another job).
const OTHER_SECRET: &str = "c81f4e0a7d2b96e35f0a1c8d4b7e2f69a3d5c0e8b1f47a2d6c9e03b5f8a1d4e7";
/// Frame kinds of the rendezvous (src/parallel/wire.rs).
const HELLO: u8 = 1;
const ERROR: u8 = 3;
const CHALLENGE: u8 = 7;
const REJECT: u8 = 8;

fn exe() -> &'static str {
    env!("CARGO_BIN_EXE_longctx")
}

fn free_port() -> u16 {
    std::net::TcpListener::bind("127.0.0.1:0").unwrap().local_addr().unwrap().port()
}

/// One launcher of a two-"node" job on loopback: node `node` runs rank `node`, a tiny
/// two-step data-parallel training run on the CPU.
fn node(node: usize, port: u16, secret: &str, out: &Path, rdzv_timeout_s: u32) -> Child {
    let mut c = Command::new(exe());
    c.args(["launch", "--nnodes", "2", "--nproc-per-node", "1", "--master-addr", "127.0.0.1", "--kill-grace", "1"])
        .args(["--node-rank", &node.to_string(), "--master-port", &port.to_string(), "--rdzv-timeout", &rdzv_timeout_s.to_string()])
        .args(["--", "train", "--model", "builtin:tiny", "--dataset", "synthetic:passkey", "--seq-length", "32"])
        .args(["--rope-theta", "1e5", "--max-train-steps", "2", "--batch-size", "2", "--device", "cpu"])
        .args(["--parallel-mode", "data_parallel", "--token-chunk", "16", "--output-dir"])
        .arg(out)
        .env("LONGCTX_RDZV_SECRET", secret)
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped());
    c.spawn().expect("start longctx launch")
}

/// Wait for `child` at most `limit` (then kill it and fail).
fn wait_limited(mut child: Child, limit: Duration, what: &str) -> Output {
    let start = Instant::now();
    loop {
        if child.try_wait().expect("wait").is_some() {
            return child.wait_with_output().expect("output");
        }
        if start.elapsed() > limit {
            let _ = child.kill();
            let o = child.wait_with_output().expect("output");
            panic!("{what}: still running after {limit:?}\nstderr:\n{}", String::from_utf8_lossy(&o.stderr));
        }
        std::thread::sleep(Duration::from_millis(20));
    }
}

fn text(o: &Output) -> String {
    format!("{}{}", String::from_utf8_lossy(&o.stdout), String::from_utf8_lossy(&o.stderr))
}

/// A connection to rank 0, once it listens.
fn connect(port: u16) -> TcpStream {
    let until = Instant::now() + Duration::from_secs(30);
    loop {
        if let Ok(s) = TcpStream::connect(("127.0.0.1", port)) {
            s.set_read_timeout(Some(Duration::from_secs(10))).unwrap();
            return s;
        }
        assert!(Instant::now() < until, "rank 0 never listened on port {port}");
        std::thread::sleep(Duration::from_millis(50));
    }
}

/// Read one untagged frame (challenge, refusal).
fn read_plain(s: &mut TcpStream) -> (u8, Vec<u8>) {
    let mut head = [0u8; 5];
    s.read_exact(&mut head).expect("a frame header from rank 0");
    let len = u32::from_be_bytes([head[1], head[2], head[3], head[4]]) as usize;
    assert!(len < 4096, "frame of {len} bytes");
    let mut p = vec![0u8; len];
    s.read_exact(&mut p).expect("a frame payload from rank 0");
    (head[0], p)
}

fn frame(kind: u8, payload: &[u8], tag: &[u8]) -> Vec<u8> {
    let mut f = vec![kind];
    f.extend_from_slice(&(payload.len() as u32).to_be_bytes());
    f.extend_from_slice(payload);
    f.extend_from_slice(tag);
    f
}

/// Runs the job with `attack` done against rank 0 between its start and rank 1's;
/// returns rank 0's launcher output (after asserting that both nodes succeeded). What
/// `attack` returns (sockets it holds open) is kept alive until the job ends.
fn job_survives<T>(attack: impl FnOnce(u16) -> T) -> String {
    let tmp = tempfile::tempdir().unwrap();
    let out = tmp.path().join("run");
    let port = free_port();
    let n0 = node(0, port, SECRET, &out, 20);
    let held = attack(port);
    let n1 = node(1, port, SECRET, &out, 20);
    let o1 = wait_limited(n1, Duration::from_secs(60), "node 1");
    let o0 = wait_limited(n0, Duration::from_secs(30), "node 0");
    drop(held);
    assert!(o0.status.success(), "rank 0's node failed (the attack must not stop it):\n{}", text(&o0));
    assert!(o1.status.success(), "rank 1's node failed:\n{}", text(&o1));
    assert!(out.join("export/model.safetensors").is_file(), "the job exported nothing:\n{}", text(&o0));
    text(&o0)
}

#[test]
fn a_forged_rank_without_the_secret_is_dropped_and_the_job_completes() {
    let log = job_survives(|port| {
        let mut s = connect(port);
        let (kind, challenge) = read_plain(&mut s);
        assert_eq!((kind, challenge.len()), (CHALLENGE, 40), "rank 0 opens with a challenge");
        // A well-formed hello as rank 1 of 2, with a tag made up without the secret.
        let mut hello = b"LONGCTX2".to_vec();
        hello.extend_from_slice(&1u32.to_be_bytes());
        hello.extend_from_slice(&2u32.to_be_bytes());
        hello.extend_from_slice(&[7u8; 32]);
        s.write_all(&frame(HELLO, &hello, &[0u8; 32])).unwrap();
        let (kind, why) = read_plain(&mut s);
        assert_eq!(kind, REJECT, "a forged hello is refused");
        assert!(String::from_utf8_lossy(&why).contains("LONGCTX_RDZV_SECRET"), "{}", String::from_utf8_lossy(&why));
        // The connection is closed: no welcome, no NCCL id.
        let mut rest = Vec::new();
        let _ = s.read_to_end(&mut rest);
        assert!(rest.is_empty(), "rank 0 sent more after refusing: {} bytes", rest.len());
    });
    assert!(log.contains("a hello as rank 1 failed authentication"), "rank 0 logs the forged rank:\n{log}");
}

#[test]
fn garbage_bytes_are_dropped_and_the_job_completes() {
    let log = job_survives(|port| {
        let mut s = connect(port);
        let _ = s.write_all(b"GET / HTTP/1.1\r\nHost: x\r\n\r\n");
        let mut s2 = connect(port);
        let _ = read_plain(&mut s2);
        let _ = s2.write_all(&frame(HELLO, &[1, 2, 3], &[0u8; 32])); // a tiny, malformed hello
        std::thread::sleep(Duration::from_millis(300));
        (s, s2)
    });
    assert!(log.contains("dropped a connection from 127.0.0.1"), "rank 0 logs the dropped connections:\n{log}");
    assert!(log.contains("sent a malformed hello (3 bytes)"), "{log}");
    assert!(log.contains("oversized frame: kind 71"), "HTTP is not a frame: {log}");
}

#[test]
fn an_oversized_frame_is_dropped_unread_and_the_job_completes() {
    let log = job_survives(|port| {
        let mut s = connect(port);
        let _ = read_plain(&mut s);
        s.write_all(&[HELLO, 0xff, 0xff, 0xff, 0xf0]).unwrap();
        // Keep streaming: rank 0 must not buffer it (it closes the connection instead).
        let mut sent = 0usize;
        let chunk = vec![0u8; 1 << 16];
        while sent < 64 << 20 && s.write_all(&chunk).is_ok() {
            sent += chunk.len();
        }
        assert!(sent < 64 << 20, "rank 0 kept reading an oversized frame ({sent} bytes)");
    });
    assert!(log.contains("oversized frame"), "rank 0 logs the oversized frame:\n{log}");
}

#[test]
fn idle_sockets_do_not_hold_up_the_rendezvous() {
    // Four silent connections and one that stops mid-frame, all held open for the whole
    // job. Rank 0 polls every queued connection: if it waited on each in turn for its
    // hello deadline, the rendezvous would be late by their sum.
    let _log = job_survives(|port| {
        let mut held: Vec<TcpStream> = (0..4).map(|_| connect(port)).collect();
        let mut slow = connect(port);
        slow.write_all(&[HELLO, 0, 0]).unwrap();
        held.push(slow);
        held
    });
}

#[test]
fn a_connection_flood_only_delays_the_rendezvous() {
    // 100 silent connections from the ranks' own address: rank 0 keeps 64 per address and
    // evicts the oldest as new ones come; the real rank 1's connection is the newest, its
    // hello is read and it joins (the sustained flood: tests/all/dist_rendezvous_flood.rs).
    let t = Instant::now();
    let log = job_survives(|port| (0..100).map(|_| connect(port)).collect::<Vec<_>>());
    assert!(log.contains("evicted, the oldest idle one: 64 connections from this address"), "{log}");
    assert!(log.contains("further dropped connections are counted, not logged"), "the log is bounded:\n{log}");
    assert!(t.elapsed() < Duration::from_secs(28), "took {:?}", t.elapsed());
}

#[test]
fn a_forged_error_frame_cannot_stop_rank_0() {
    let log = job_survives(|port| {
        // Straight away, before the challenge is read.
        let mut s = connect(port);
        s.write_all(&frame(ERROR, b"rank 1 failed: forged", &[0u8; 32])).unwrap();
        // After the challenge, as a reply to it.
        let mut s2 = connect(port);
        let _ = read_plain(&mut s2);
        s2.write_all(&frame(ERROR, b"rank 1 failed: forged", &[0u8; 32])).unwrap();
        std::thread::sleep(Duration::from_millis(300));
        (s, s2)
    });
    assert!(log.contains("sent a frame of kind 3 instead of a hello"), "rank 0 logs and drops it:\n{log}");
    assert!(!log.contains("failed: forged"), "a forged error reached the job:\n{log}");
}

#[test]
fn a_rank_with_the_wrong_secret_is_refused_and_the_right_one_still_joins() {
    let tmp = tempfile::tempdir().unwrap();
    let out = tmp.path().join("run");
    let port = free_port();
    let n0 = node(0, port, SECRET, &out, 25);
    let wrong = wait_limited(node(1, port, OTHER_SECRET, &out, 25), Duration::from_secs(30), "wrong node 1");
    let w = text(&wrong);
    assert!(!wrong.status.success(), "a rank with the wrong secret joined:\n{w}");
    assert!(w.contains("rank 1 was refused; unauthenticated reply from 127.0.0.1:"), "the refusal is quoted as unauthenticated:\n{w}");
    assert!(w.contains("\"authentication failed"), "the refusal says why:\n{w}");
    assert!(w.contains("same LONGCTX_RDZV_SECRET"), "the refusal names the fix:\n{w}");
    let o1 = wait_limited(node(1, port, SECRET, &out, 25), Duration::from_secs(60), "node 1");
    let o0 = wait_limited(n0, Duration::from_secs(30), "node 0");
    assert!(o1.status.success(), "{}", text(&o1));
    assert!(o0.status.success(), "rank 0 survives a wrong-secret rank:\n{}", text(&o0));
    assert!(text(&o0).contains("a hello as rank 1 failed authentication"), "{}", text(&o0));
}

#[test]
fn a_secret_is_required_off_loopback_and_across_nodes() {
    // Ranks of an external launcher, master off loopback, no secret: refused before listening.
    let o = Command::new(exe())
        .args(["train", "--device", "cpu", "--max-train-steps", "1"])
        .env_remove("LONGCTX_RDZV_SECRET")
        .envs([("RANK", "0"), ("WORLD_SIZE", "2"), ("LOCAL_RANK", "0"), ("LOCAL_WORLD_SIZE", "1")])
        .envs([("MASTER_ADDR", "192.0.2.1"), ("MASTER_PORT", "29999")])
        .output()
        .unwrap();
    let t = text(&o);
    assert!(!o.status.success(), "{t}");
    assert!(t.contains("LONGCTX_RDZV_SECRET is not set") && t.contains("192.0.2.1:29999"), "{t}");
    // Several nodes: every launcher needs the same secret, so it is not made up.
    let o = Command::new(exe())
        .args(["launch", "--nnodes", "2", "--node-rank", "1", "--nproc-per-node", "1", "--master-addr", "127.0.0.1"])
        .args(["--", "train"])
        .env_remove("LONGCTX_RDZV_SECRET")
        .output()
        .unwrap();
    let t = text(&o);
    assert!(!o.status.success(), "{t}");
    assert!(t.contains("export the same LONGCTX_RDZV_SECRET on every node"), "{t}");
    // A short secret names the rule.
    let o =
        Command::new(exe()).args(["launch", "--nproc-per-node", "1", "--", "train"]).env("LONGCTX_RDZV_SECRET", "short").output().unwrap();
    assert!(text(&o).contains("at least 16"), "{}", text(&o));
    // A chosen one of 28 bytes names the entropy rule and how to make one.
    let o = Command::new(exe())
        .args(["launch", "--nproc-per-node", "1", "--", "train"])
        .env("LONGCTX_RDZV_SECRET", "test-secret-0123456789abcdef")
        .output()
        .unwrap();
    assert!(!o.status.success(), "{}", text(&o));
    assert!(text(&o).contains("looks chosen, not random") && text(&o).contains("openssl rand -hex 32"), "{}", text(&o));
    // And --help documents the variable.
    let o = Command::new(exe()).args(["launch", "--help"]).output().unwrap();
    assert!(text(&o).contains("LONGCTX_RDZV_SECRET"), "{}", text(&o));
}
