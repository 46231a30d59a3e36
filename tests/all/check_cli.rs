//! `longctx check`: a run's layout against one device. It passes for exact layouts
//! (zigzag ring as threads with data parallelism, USP as launched processes) and fails,
//! naming the layout and the difference, when one rank is deliberately off by 1 %
//! (`LONGCTX_FAULT=skew:1:1.01`, a test-only fault).

use crate::common;

use common::{fails, longctx_cmd, run_cmd};

const RUN: [&str; 10] =
    ["--model", "builtin:tiny", "--dataset", "synthetic:passkey", "--seq-length", "64", "--batch-size", "2", "--device", "cpu"];

fn check(extra_check: &[&str], extra_run: &[&str], fault: Option<&str>) -> common::Out {
    let mut args = vec!["check"];
    args.extend(extra_check);
    args.push("--");
    args.extend(RUN);
    args.extend(extra_run);
    let mut c = longctx_cmd(&args);
    if let Some(f) = fault {
        c.env("LONGCTX_FAULT", f);
    }
    run_cmd(c)
}

#[test]
fn exact_layouts_pass() {
    let o = check(
        &[],
        &["--world-size", "4", "--sp-size", "2", "--parallel-mode", "zigzag_ring_attn", "--gradient-accumulate-every", "2"],
        None,
    );
    assert_eq!(o.code, 0, "{}", o.stderr);
    assert!(o.stdout.contains("ok: zigzag_ring_attn on 4 rank(s) (sp 2 × dp 2) matches one device"), "{}", o.stdout);
    assert_eq!(o.stdout.lines().filter(|l| l.starts_with("| ") && !l.starts_with("| step") && !l.starts_with("| ---")).count(), 3);
    let o = check(&["--launch", "--steps", "2"], &["--world-size", "4", "--parallel-mode", "usp", "--ulysses-size", "2"], None);
    assert_eq!(o.code, 0, "{}", o.stderr);
    assert!(o.stdout.contains("ok: usp on 4 rank(s)"), "{}", o.stdout);
}

#[test]
fn a_broken_rank_fails_the_check() {
    let o = check(&[], &["--world-size", "2", "--parallel-mode", "ulysses_attn"], Some("skew:1:1.01"));
    fails(&o, &["ulysses_attn on 2 rank(s)", "differs from one device", "tolerance 1e-5"], false);
    // The same fault on a rank the run does not have changes nothing.
    let o = check(&[], &["--world-size", "2", "--parallel-mode", "ulysses_attn"], Some("skew:5:1.01"));
    assert_eq!(o.code, 0, "{}", o.stderr);
}

#[test]
fn bad_arguments_are_named() {
    let o = check(&["--steps", "0"], &[], None);
    fails(&o, &["--steps"], true);
    let o = check(&[], &["--parallel-mode", "nonsense"], None);
    fails(&o, &["do not resolve", "nonsense"], true);
}
