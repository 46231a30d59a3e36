//! Test helper for the launcher, the rendezvous and the failure monitor.
//!
//! `longctx-dist-probe launch [launch flags] -- run [probe flags]` starts ranks like
//! `longctx launch` does; `longctx-dist-probe run` is one rank: it reads the rank
//! environment, joins the rendezvous (rank 0 contributes 128 random bytes), prints
//! `rank R/W local L/LW blob <fnv64 of the blob>` and ends cleanly, or misbehaves
//! on request to exercise the failure paths.

use clap::{Parser, Subcommand};
use longctx::dist::{self, DistEnv, LaunchArgs, RendezvousOptions};
use rand::Rng;
use std::time::Duration;

#[derive(Parser)]
#[command(about = "Probe of longctx's launcher, rendezvous and failure monitor")]
struct Cli {
    #[command(subcommand)]
    cmd: Cmd,
}

#[derive(Subcommand)]
enum Cmd {
    /// Start ranks (like `longctx launch`; the program defaults to this probe).
    Launch(LaunchArgs),
    /// Be one rank.
    Run(RunArgs),
}

#[derive(clap::Args)]
struct RunArgs {
    /// This rank exits with `--exit-code` (without saying goodbye).
    #[arg(long)]
    fail_rank: Option<usize>,
    /// Fail before the rendezvous instead of after it.
    #[arg(long)]
    fail_before_rdzv: bool,
    /// Report the failure through the monitor before exiting.
    #[arg(long)]
    report: bool,
    #[arg(long, default_value_t = 3)]
    exit_code: i32,
    /// This rank never joins the rendezvous (sleeps until killed).
    #[arg(long)]
    absent_rank: Option<usize>,
    /// After the rendezvous, wait until the monitor reports a failure, then exit with
    /// `dist::launch::PEER_FAILED_EXIT_CODE`.
    #[arg(long)]
    sleep: bool,
}

/// FNV-1a, 64 bit.
fn fnv64(bytes: &[u8]) -> u64 {
    bytes.iter().fold(0xcbf2_9ce4_8422_2325u64, |h, &b| (h ^ b as u64).wrapping_mul(0x0100_0000_01b3))
}

fn run(a: RunArgs) -> anyhow::Result<i32> {
    let env = DistEnv::from_env()?.ok_or_else(|| anyhow::anyhow!("not a distributed run: RANK / WORLD_SIZE unset"))?;
    let me = env.rank;
    if a.absent_rank == Some(me) {
        eprintln!("rank {me}: staying away from the rendezvous");
        loop {
            std::thread::sleep(Duration::from_secs(3600));
        }
    }
    if a.fail_rank == Some(me) && a.fail_before_rdzv {
        eprintln!("rank {me}: failing on purpose before the rendezvous");
        return Ok(a.exit_code);
    }
    let opts = RendezvousOptions::from_env()?;
    let rdzv = dist::rendezvous(
        &env,
        || {
            let mut id = vec![0u8; 128];
            rand::rng().fill(&mut id[..]);
            Ok(id)
        },
        &opts,
    )?;
    println!(
        "rank {me}/{} local {}/{} blob {:016x}",
        env.world,
        env.local_rank,
        env.local_world,
        fnv64(&rdzv.blob)
    );
    if a.fail_rank == Some(me) {
        eprintln!("rank {me}: failing on purpose after the rendezvous");
        if a.report {
            rdzv.monitor.report_failure(&format!("exit code {}", a.exit_code));
            std::thread::sleep(Duration::from_millis(200));
        }
        return Ok(a.exit_code);
    }
    if a.sleep {
        let reason = rdzv.monitor.wait_failure(None).unwrap_or_default();
        eprintln!("rank {me}: stopping: {reason}");
        return Ok(dist::launch::PEER_FAILED_EXIT_CODE);
    }
    rdzv.monitor.finish();
    Ok(0)
}

fn main() {
    let cli = Cli::parse();
    let code = match cli.cmd {
        Cmd::Launch(args) => match args.into_options().and_then(dist::launch) {
            Ok(c) => c,
            Err(e) => {
                eprintln!("{e}");
                e.exit_code()
            }
        },
        Cmd::Run(a) => match run(a) {
            Ok(c) => c,
            Err(e) => {
                eprintln!("error: {e}");
                1
            }
        },
    };
    std::process::exit(code);
}
