//! Token cross-entropy with ignored targets, differentiable, in f32.
//!
//! Shapes: `b` batch, `s` tokens, `V` vocabulary.
//! Targets are `[b, s]` **i64** (u32/u8 are accepted and widened): a negative target
//! (Hugging Face uses `-100`) means "ignore this token"; otherwise it is the id the
//! logits at that position should predict (already shifted: the caller aligns targets
//! with positions, `targets[t] = ids[t + 1]`).
//! The log-softmax is a max-subtracted log-sum-exp built from differentiable ops
//! (Candle's `softmax_last_dim` has no backward).

use crate::error::{Error, Result};
use candle_core::{DType, Tensor, D};

/// The target value Hugging Face uses for ignored tokens (any negative value works).
pub const IGNORE_INDEX: i64 = -100;

/// Host-side check of the targets: returns the number of counted (non-negative) targets,
/// or an error if one is not below `vocab`. (Reads the targets back: callers that loss
/// a sequence chunk by chunk check once, then use [`cross_entropy_sum_checked`].)
pub fn count_targets(targets: &Tensor, vocab: usize) -> Result<usize> {
    let t: Vec<i64> = targets.flatten_all()?.to_vec1()?;
    let mut n = 0;
    for &x in &t {
        if x >= 0 {
            if x as u64 >= vocab as u64 {
                return Err(Error::Setting(format!("target token id {x} is not below vocab_size {vocab}")));
            }
            n += 1;
        }
    }
    Ok(n)
}

fn widen(targets: &Tensor) -> Result<Tensor> {
    match targets.dtype() {
        DType::I64 => Ok(targets.clone()),
        DType::U32 | DType::U8 => Ok(targets.to_dtype(DType::I64)?),
        other => Err(Error::Setting(format!("targets must be i64 (negative = ignore), got {other:?}"))),
    }
}

/// Per-token loss `[b, s]` f32: `logsumexp(logits) − logits[target]`, 0 where ignored.
/// Also returns the number of counted tokens.
pub fn per_token_loss(logits: &Tensor, targets: &Tensor) -> Result<(Tensor, usize)> {
    let n = count_targets(targets, logits.dim(D::Minus1)?)?;
    Ok((loss_terms(logits, targets)?, n))
}

/// Per-token loss `[b, s]` f32 of targets already checked by [`count_targets`].
fn loss_terms(logits: &Tensor, targets: &Tensor) -> Result<Tensor> {
    let (b, s, _) = logits.dims3()?;
    let targets = widen(targets)?;
    if targets.dims() != [b, s] {
        return Err(Error::Setting(format!("targets have shape {:?}, logits {:?}", targets.dims(), logits.dims())));
    }
    let x = logits.to_dtype(DType::F32)?; // [b, s, V]
                                          // The max only shifts the exponent; it is a constant for the gradient (exactly: the
                                          // derivative of logsumexp w.r.t. the shift is 1 − Σ softmax = 0), so detach it.
    let m = x.max_keepdim(D::Minus1)?.detach(); // [b, s, 1]
    let lse = x.broadcast_sub(&m)?.exp()?.sum_keepdim(D::Minus1)?.log()?.add(&m)?; // [b, s, 1]
    let valid = targets.ge(0i64)?; // [b, s] u8
    let safe = valid.where_cond(&targets, &targets.zeros_like()?)?; // ignored -> id 0
    let picked = x.gather(&safe.unsqueeze(D::Minus1)?.contiguous()?, D::Minus1)?; // [b, s, 1]
    let loss = lse.sub(&picked)?.squeeze(D::Minus1)?; // [b, s]
    Ok(loss.mul(&valid.to_dtype(DType::F32)?)?)
}

/// `(Σ per-token loss over counted tokens (scalar f32), number of counted tokens)`.
/// A SUM, not a mean: callers divide by the global count of counted tokens.
pub fn cross_entropy_sum(logits: &Tensor, targets: &Tensor) -> Result<(Tensor, usize)> {
    let (l, n) = per_token_loss(logits, targets)?;
    Ok((l.sum_all()?, n))
}

/// [`cross_entropy_sum`] of targets already checked by [`count_targets`]: no read-back,
/// so a chunked loss does not wait for the device at every chunk.
pub fn cross_entropy_sum_checked(logits: &Tensor, targets: &Tensor) -> Result<Tensor> {
    Ok(loss_terms(logits, targets)?.sum_all()?)
}
