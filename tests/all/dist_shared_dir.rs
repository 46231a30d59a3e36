//! A launched run whose ranks do not share the output directory (a node-local directory on
//! a multi-node job) stops at start-up, naming the rank and the fix, instead of failing at
//! its first checkpoint. Simulated on one machine with the test-only fault
//! `private-dir:RANK` (that rank looks for rank 0's marker in a directory of its own).

use crate::common;

#[test]
fn ranks_that_do_not_share_the_output_directory_stop_at_start() {
    let tmp = tempfile::tempdir().unwrap();
    let out = tmp.path().join("run");
    let args = [
        "launch",
        "--nproc-per-node",
        "2",
        "--master-port",
        "0",
        "--",
        "train",
        "--model",
        "builtin:tiny",
        "--dataset",
        "synthetic:passkey",
        "--seq-length",
        "32",
        "--max-train-steps",
        "1",
        "--device",
        "cpu",
        "--parallel-mode",
        "zigzag_ring_attn",
        "--output-dir",
        out.to_str().unwrap(),
    ];
    let mut c = common::longctx_cmd(&args);
    c.env("LONGCTX_FAULT", "private-dir:1");
    let o = common::run_cmd(c);
    assert_ne!(o.code, 0, "{}", o.stderr);
    assert!(o.stderr.contains("rank 1 does not see rank 0's output directory") && o.stderr.contains("--output-dir"), "{}", o.stderr);
    assert!(!out.join("metrics.jsonl").exists() || std::fs::read_to_string(out.join("metrics.jsonl")).unwrap().is_empty(), "no step ran");
    assert!(!out.join(".longctx-shared-check").exists(), "the marker is removed");
    // Without the fault the same launch trains.
    let o = common::run_cmd(common::longctx_cmd(&[&args[..args.len() - 1], &[tmp.path().join("ok").to_str().unwrap()]].concat()));
    assert_eq!(o.code, 0, "{}", o.stderr);
}
