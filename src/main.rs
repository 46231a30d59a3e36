//! `longctx`: extend the context window of Llama-family models by continued training.
//!
//! Subcommands (each in `src/cli/`):
//! - `train`: the main job (with no argument it trains a tiny built-in Llama on synthetic
//!   passkey data on the CPU); flags follow EasyContext's train.py and override `--config`;
//! - `export`: a training checkpoint or any HF model directory → an HF checkpoint with a
//!   new `rope_theta` / `max_position_embeddings` / dtype / shard size;
//! - `inspect`: architecture, parameter count, dtype, RoPE and a training memory estimate;
//! - `plan`: per-GPU memory of a layout, whether it fits, and a layout that does;
//! - `launch`: one process per GPU (`longctx launch --nproc-per-node 8 -- train ...`);
//! - `bench attention`: throughput and correctness of the attention kernel (CUDA).
//! - `bench engine`: step time and memory of the training engine, activation offload on/off.
//! - `eval ppl`, `eval needle`: perplexity against length, needle/passkey heatmaps (PNG);
//! - `generate`: greedy or sampled generation with a KV cache;
//! - `check`: a run's parallel layout against one device, step by step, with a verdict.
//!
//! Every failure prints one `error: ...` line (with context; a usage error adds clap's
//! tips and usage) and exits with status 1.

mod cli;

use clap::{CommandFactory, FromArgMatches, Parser, Subcommand};

#[derive(Parser, Debug)]
#[command(
    name = "longctx",
    version,
    about = "Long-context continued training of Llama-family models (ring / Ulysses / FPDT sequence parallelism)"
)]
struct Cli {
    #[command(subcommand)]
    cmd: Cmd,
}

#[derive(Subcommand, Debug)]
#[allow(clippy::large_enum_variant)] // parsed once; boxing would only obscure the match
enum Cmd {
    /// Train (continued pre-training over one or more rope_theta stages). With no
    /// argument: the embedded demo (tiny built-in Llama, synthetic passkey data, CPU).
    Train(cli::train::TrainArgs),
    /// Write a Hugging Face checkpoint from a training checkpoint or an HF model, with a
    /// new rope_theta, max_position_embeddings, dtype or shard size.
    Export(cli::export::ExportArgs),
    /// Show a model's architecture, parameter count, dtype, RoPE settings and the memory
    /// training it at a sequence length takes.
    Inspect(cli::inspect::InspectArgs),
    /// Predict memory per GPU for a model, sequence length, GPU count and parallel mode;
    /// say whether it fits and suggest a mode (and FPDT chunk size) that does.
    Plan(cli::plan::PlanArgs),
    /// Start one process per GPU running a longctx command (torchrun-style environment):
    /// `longctx launch --nproc-per-node 8 -- train --config recipes/X.toml`.
    Launch(longctx::parallel::LaunchArgs),
    /// Evaluate a checkpoint: perplexity against context length (`eval ppl`), needle /
    /// passkey retrieval over depth × length (`eval needle`); JSON/CSV and PNG plots.
    Eval {
        #[command(subcommand)]
        what: cli::eval::EvalCmd,
    },
    /// Generate from a prompt (greedy, or sampled with temperature / top-p / seed) with a
    /// KV cache, streaming tokens; stops at EOS or --max-new-tokens.
    Generate(cli::generate::GenerateArgs),
    /// Check a run's parallel layout: its first steps (as configured, threads or
    /// --launch processes) against one device on the same samples, loss and gradient norm
    /// per step, with a verdict: `longctx check -- --config X.toml --world-size 4`.
    Check(cli::check::CheckArgs),
    /// Benchmarks.
    Bench {
        #[command(subcommand)]
        what: cli::bench::BenchCmd,
    },
}

fn main() {
    let parsed = cli::underscore_spellings(Cli::command()).try_get_matches().and_then(|m| Cli::from_arg_matches(&m));
    let cli = match parsed {
        Ok(c) => c,
        Err(e) if !e.use_stderr() => {
            // --help / --version: print to stdout and succeed.
            let _ = e.print();
            std::process::exit(0);
        }
        Err(e) => {
            // Usage errors: clap's whole message (the problem, its tips such as "a similar
            // argument exists", the usage line), status 1.
            eprintln!("{}", e.render().to_string().trim_end());
            std::process::exit(1);
        }
    };
    let res = match cli.cmd {
        Cmd::Train(a) => cli::train::train(a),
        Cmd::Export(a) => cli::export::export(a),
        Cmd::Inspect(a) => cli::inspect::inspect(a),
        Cmd::Plan(a) => cli::plan::plan_cmd(a),
        Cmd::Launch(a) => cli::launch::launch(a),
        Cmd::Eval { what } => cli::eval::eval(what),
        Cmd::Generate(a) => cli::generate::generate_cmd(a),
        Cmd::Check(a) => cli::check::check(a),
        Cmd::Bench { what } => cli::bench::bench(what),
    };
    if let Err(e) = res {
        eprintln!("error: {}", one_line(&format!("{e:#}")));
        std::process::exit(1);
    }
}

/// Error chains are printed on one line.
fn one_line(s: &str) -> String {
    s.lines().map(str::trim).filter(|l| !l.is_empty()).collect::<Vec<_>>().join(" ")
}
