//! Size limits, checked before anything is allocated, so that a huge number in a config
//! file or a flag is an error naming the key instead of an allocation abort or a silent
//! overflow. The limits are far above any real model or run (the largest Llama has 126
//! layers, 16384 hidden, 128K vocabulary; long-context runs reach a few million tokens).
//!
//! Two kinds of checks:
//! - ranges of single values ([`check_range`], used by the run config and `config.json`);
//! - the host memory a run needs before its first allocation ([`check_host_memory`]):
//!   products computed with checked arithmetic (an overflow is an error), compared with
//!   the machine's physical memory.

use crate::{Error, Result};
use std::path::Path;

/// Ranks of one run (processes or threads).
pub const MAX_WORLD_SIZE: usize = 1 << 16;
/// Ranks as threads of one process (`parallel.world_size` without a launcher).
pub const MAX_THREAD_RANKS: usize = 1 << 10;
/// Tokens of one sequence (positions are u32).
pub const MAX_SEQ_LEN: usize = 1 << 31;
/// Sequences per micro-batch, micro-batches per step.
pub const MAX_BATCH: usize = 1 << 20;
/// Tokens of one micro-batch on one rank (`batch_size × (seq_length + 1)`).
pub const MAX_BATCH_TOKENS: u64 = 1 << 34;
/// Samples held by the shuffle buffer.
pub const MAX_SHUFFLE_BUFFER: usize = 1 << 24;
/// Optimizer steps of one stage.
pub const MAX_STEPS: u64 = 1 << 40;
/// Decoder layers, heads.
pub const MAX_LAYERS: usize = 1 << 14;
pub const MAX_HEADS: usize = 1 << 14;
/// Hidden size, head dim, intermediate size.
pub const MAX_WIDTH: usize = 1 << 22;
/// Vocabulary (token ids are u32).
pub const MAX_VOCAB: usize = 1 << 32;
/// Parameters of a model (about 17.6 trillion).
pub const MAX_PARAMS: u64 = 1 << 44;

/// `lo ≤ v ≤ hi`, else a config error naming `field`, the value and the range.
pub fn check_range<T: PartialOrd + std::fmt::Display + Copy>(file: &Path, field: &str, v: T, lo: T, hi: T) -> Result<()> {
    if v < lo || v > hi {
        return Err(Error::config(file, field, format!("got {v}, expected {lo} to {hi}")));
    }
    Ok(())
}

/// `a × b × ...` with overflow as an error naming `what`.
pub fn mul(what: &str, xs: &[u64]) -> Result<u64> {
    xs.iter().try_fold(1u64, |acc, &x| acc.checked_mul(x)).ok_or_else(|| overflow(what))
}

/// `a + b + ...` with overflow as an error naming `what`.
pub fn add(what: &str, xs: &[u64]) -> Result<u64> {
    xs.iter().try_fold(0u64, |acc, &x| acc.checked_add(x)).ok_or_else(|| overflow(what))
}

fn overflow(what: &str) -> Error {
    Error::Setting(format!(
        "{what} does not fit in 64 bits: some size (layers, width, vocabulary, length, batch or ranks) is far too large"
    ))
}

/// Physical memory of this machine, bytes (`None` when the OS does not say).
pub fn physical_memory() -> Option<u64> {
    // SAFETY: sysconf only reads system configuration values.
    let (pages, size) = unsafe { (libc::sysconf(libc::_SC_PHYS_PAGES), libc::sysconf(libc::_SC_PAGESIZE)) };
    (pages > 0 && size > 0).then(|| (pages as u64).saturating_mul(size as u64))
}

/// What a run keeps in host memory at its peak, by part (bytes). The start weights are
/// freed once every rank has built its weights and optimizer state, before the first step
/// saves an activation, so [`Self::total`] counts the larger of the two, not both.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct HostNeed {
    /// The f32 copy of the start weights (every run).
    pub start_weights: u64,
    /// Weights, f32 gradients and the flat gradient of each in-process rank, when the
    /// device is the CPU.
    pub cpu_ranks: u64,
    /// The f32 master weights and AdamW moments, when they live on the host.
    pub optimizer: u64,
    /// Saved activations of the in-process ranks in host memory, largest stage: every
    /// layer input on the CPU; on GPUs what the step offloads (inputs, the attention's and
    /// MLP's saved tensors with `offload_activations`, FPDT's parked chunks).
    pub activations: u64,
    /// The 16-bit weights kept in host memory (ZeRO-3 with `offload_params`; all ranks'
    /// slices together).
    pub weights: u64,
    /// The f32 gradient slices kept in host memory (`offload_gradients`; all ranks'),
    /// page-locked once the start weights are gone, like the activations.
    pub gradients: u64,
}

impl HostNeed {
    pub fn total(&self) -> Result<u64> {
        let steps = add("the host memory estimate", &[self.activations, self.gradients])?;
        add("the host memory estimate", &[self.start_weights.max(steps), self.cpu_ranks, self.optimizer, self.weights])
    }
}

/// The host memory a run of `params` parameters needs at least (see [`HostNeed`]):
/// `ranks` in-process ranks, `cpu` when they compute on the CPU, `optimizer_on_host`,
/// `act_per_rank` bytes of saved activations per rank kept on the host, and
/// `offloaded_weights` bytes of weights there (ZeRO-3 `offload_params`).
pub fn host_need(
    params: u64,
    ranks: u64,
    cpu: bool,
    optimizer_on_host: bool,
    act_per_rank: u64,
    offloaded_weights: u64,
) -> Result<HostNeed> {
    let what = "the host memory estimate";
    let start_weights = mul(what, &[params, 4])?;
    let cpu_ranks = if cpu { mul(what, &[params, 12, ranks])? } else { 0 };
    let optimizer = if cpu || optimizer_on_host { mul(what, &[params, 12])? } else { 0 };
    let activations = mul(what, &[act_per_rank, ranks])?;
    Ok(HostNeed { start_weights, cpu_ranks, optimizer, activations, weights: offloaded_weights, gradients: 0 })
}

/// Errors when `need` exceeds the physical memory `have` (bytes): the message names the
/// parts and the keys that decide them.
pub fn check_host_memory(need: &HostNeed, have: Option<u64>, source: &Path) -> Result<()> {
    let total = need.total()?;
    let Some(have) = have else { return Ok(()) };
    if total <= have {
        return Ok(());
    }
    let gb = |b: u64| format!("{:.1} GB", b as f64 / 1e9);
    // GPU ranks whose offloaded activations decide it: offloading less is the first fix.
    let offloads = need.cpu_ranks == 0 && need.activations + need.gradients > need.start_weights;
    let (fields, fix) = match offloads {
        true if need.gradients > 0 => (
            "train.offload_gradients / parallel.offload_activations / parallel.offload_layer_inputs / stage.seq_length",
            "keep the gradients on the GPU (`train.offload_gradients = false`) or offload fewer activations, shorter \
             sequences or more GPUs",
        ),
        true => (
            "parallel.offload_activations / parallel.offload_layer_inputs / stage.seq_length",
            "offload less (`parallel.offload_layer_inputs` alone parks only the layer inputs; without either the \
             activations stay on the GPU), shorter sequences or more GPUs",
        ),
        false => (
            "model.source / stage.seq_length / train.batch_size / parallel.world_size",
            "use a smaller model, shorter sequences, a smaller batch or fewer in-process ranks (or run on GPUs)",
        ),
    };
    Err(Error::config(
        source,
        fields,
        format!(
            "this run needs at least {} of host memory before its first step (start weights {}, CPU ranks {}, optimizer {}, \
             saved activations {}, offloaded weights {}, offloaded gradients {}) but this machine has {}; {fix}",
            gb(total),
            gb(need.start_weights),
            gb(need.cpu_ranks),
            gb(need.optimizer),
            gb(need.activations),
            gb(need.weights),
            gb(need.gradients),
            gb(have)
        ),
    ))
}

/// A token count: an integer or a number with `K` (×1024) or `M` (×1024²), as long-context
/// recipes name lengths (`512K` = 524288).
pub fn parse_tokens(s: &str) -> std::result::Result<usize, String> {
    let t = s.trim();
    let (num, mult) = match t.chars().last().map(|c| c.to_ascii_uppercase()) {
        Some('K') => (&t[..t.len() - 1], 1024usize),
        Some('M') => (&t[..t.len() - 1], 1024 * 1024),
        _ => (t, 1),
    };
    match num.parse::<usize>() {
        Ok(n) if n > 0 => n.checked_mul(mult).ok_or_else(|| format!("`{s}`: too large")),
        _ => Err(format!("`{s}`: expected a positive token count such as 65536, 64K or 1M")),
    }
}

/// `bytes` in GB (10⁹ bytes) with two decimals.
pub fn gb(bytes: u64) -> String {
    format!("{:.2}", bytes as f64 / 1e9)
}

/// A token count as recipes write it, the one printer of lengths (K = 1024, M = 1024²,
/// as [`parse_tokens`] reads them): `524288` → `512K`, `1048576` → `1M`; a count that reads
/// as a round decimal number is printed as it is (EasyContext's `256000`, not `250K`).
pub fn tokens_label(n: usize) -> String {
    if n.is_multiple_of(1000) {
        n.to_string()
    } else if n >= 1 << 20 && n.is_multiple_of(1 << 20) {
        format!("{}M", n >> 20)
    } else if n >= 1024 && n.is_multiple_of(1024) {
        format!("{}K", n >> 10)
    } else {
        n.to_string()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn checked_products_fail_on_overflow() {
        assert_eq!(mul("x", &[1 << 20, 1 << 20]).unwrap(), 1 << 40);
        assert!(mul("the thing", &[1 << 40, 1 << 40]).unwrap_err().to_string().contains("the thing"));
        assert!(add("y", &[u64::MAX, 1]).is_err());
    }

    #[test]
    fn host_memory_beyond_the_machine_is_refused_with_the_parts() {
        let need = host_need(1 << 40, 2, true, true, 0, 0).unwrap();
        let e = check_host_memory(&need, Some(1 << 30), Path::new("run.toml")).unwrap_err().to_string();
        assert!(e.contains("run.toml") && e.contains("host memory") && e.contains("start weights"), "{e}");
        check_host_memory(&host_need(1000, 1, true, true, 1000, 0).unwrap(), Some(1 << 30), Path::new("x")).unwrap();
    }

    /// The start weights are gone before a step saves anything: the larger of the two
    /// counts, not their sum. The 7B shape at 64K with its layer inputs on the host (17.2 GB
    /// of bf16) and the weights and optimizer there: 121.3 GB, which a 128 GiB machine holds.
    #[test]
    fn start_weights_and_saved_activations_are_not_held_together() {
        let p = 6_738_415_616u64;
        let act = 32 * 65_536 * 4096 * 2;
        let need = host_need(p, 1, false, true, act, 2 * p).unwrap();
        assert_eq!(need.total().unwrap(), 4 * p + 12 * p + 2 * p);
        let long = host_need(p, 1, false, true, 4 * act, 2 * p).unwrap();
        assert_eq!(long.total().unwrap(), 4 * act + 12 * p + 2 * p);
        check_host_memory(&need, Some(128 << 30), Path::new("x")).unwrap();
    }
}
