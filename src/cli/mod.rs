//! The subcommands of the `longctx` binary: each file holds a command's clap arguments
//! and the code that turns them into library calls and printed output. The work itself
//! (training, export, planning, model lookup) is in the `longctx` library; errors get
//! their context (anyhow) here.
//!
//! - [`train`]: `longctx train` (flags over a TOML run config, see [`overrides`]);
//! - [`export`]: a training checkpoint or an HF model → an HF checkpoint;
//! - [`inspect`]: a model's architecture, size and training memory;
//! - [`plan`]: per-GPU memory of a layout (the same flag overrides as `train`);
//! - [`launch`]: one process per GPU;
//! - [`bench`]: the attention and engine benchmarks;
//! - [`eval`]: perplexity against length and needle/passkey grids, with plots;
//! - [`generate`]: generation with a KV cache, streamed.

pub mod bench;
pub mod check;
pub mod eval;
pub mod export;
pub mod generate;
pub mod inspect;
pub mod launch;
pub mod overrides;
pub mod plan;
pub mod train;

use anyhow::Result;
use longctx::train::config::ParallelMode;
use std::path::Path;

/// Where errors about command-line values say they come from.
pub const FLAGS: &str = "<flags>";

/// Every long flag of every command also takes its underscore spelling, listed in its
/// `--help` (`--parallel_mode` for `--parallel-mode`, `--nproc_per_node` for
/// `--nproc-per-node`), as EasyContext's and torchrun's flags are written: one rule instead
/// of an alias per flag. A hidden hyphen alias (`--ulysses-degree`) gets a hidden one.
pub fn underscore_spellings(cmd: clap::Command) -> clap::Command {
    cmd.mut_args(|a| {
        let all: Vec<String> = a.get_all_aliases().unwrap_or_default().iter().map(|s| s.to_string()).collect();
        let shown: Vec<String> = a.get_visible_aliases().unwrap_or_default().iter().map(|s| s.to_string()).collect();
        let mut a = a;
        for name in a.get_long().map(str::to_string).into_iter().chain(all.iter().cloned()) {
            let under = name.replace('-', "_");
            if under == name || all.contains(&under) || a.get_long() == Some(under.as_str()) {
                continue;
            }
            let visible = a.get_long() == Some(name.as_str()) || shown.contains(&name);
            a = if visible { a.visible_alias(under) } else { a.alias(under) };
        }
        a
    })
    .mut_subcommands(underscore_spellings)
}

/// A dtype flag (`f32`, `bf16`, `f16`); errors name the flag.
pub fn parse_dtype(s: &str, field: &str) -> Result<candle_core::DType> {
    Ok(longctx::train::trainer::parse_dtype(s, Path::new(FLAGS), field)?)
}

/// A parallel-mode flag; errors name the flag and list the modes.
pub fn parse_mode(v: &str, field: &str) -> Result<ParallelMode> {
    v.parse::<ParallelMode>().map_err(|e| {
        let msg = match e {
            longctx::Error::Setting(m) => m,
            other => other.to_string(),
        };
        longctx::Error::config(FLAGS, field, msg).into()
    })
}

/// A RoPE base given as a flag: positive and finite.
pub fn positive_theta(v: f64, field: &str) -> Result<f64> {
    if v > 0.0 && v.is_finite() {
        Ok(v)
    } else {
        Err(longctx::Error::config(FLAGS, field, format!("must be a positive number, got {v}")).into())
    }
}

/// clap value parser: bytes or a size such as 141GB, 96GiB.
pub fn size_arg(s: &str) -> std::result::Result<u64, String> {
    longctx::plan::parse_size(s)
}

/// clap value parser: tokens such as 524288, 512K, 1M.
pub fn tokens_arg(s: &str) -> std::result::Result<usize, String> {
    longctx::plan::parse_tokens(s)
}

/// clap value parser: [`tokens_arg`], and 0 passed on as it is, for settings whose range
/// the run config's validation checks with the key's name (`parallel.token_chunk`...).
pub fn chunk_arg(s: &str) -> std::result::Result<usize, String> {
    if s.trim() == "0" {
        return Ok(0);
    }
    tokens_arg(s)
}

/// Bytes in GB, MB or kB (powers of 1000).
pub fn human_bytes(b: u64) -> String {
    match b {
        b if b >= 1_000_000_000 => format!("{:.2} GB", b as f64 / 1e9),
        b if b >= 1_000_000 => format!("{:.2} MB", b as f64 / 1e6),
        b => format!("{:.1} kB", b as f64 / 1e3),
    }
}

/// 6738415616 → 6,738,415,616.
pub fn group(n: u64) -> String {
    let s = n.to_string();
    let mut out = String::new();
    for (i, ch) in s.chars().enumerate() {
        if i > 0 && (s.len() - i).is_multiple_of(3) {
            out.push(',');
        }
        out.push(ch);
    }
    out
}
