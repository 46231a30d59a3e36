//! Sequence-parallel layout of a batch: which of the global tokens this rank holds.
//!
//! Shapes: global `ids [b, S]`, `targets [b, S]`; `indices [L]` = the global token
//! indices this rank holds, in local order (from `longctx_attention::layout`:
//! `zigzag_indices`, `contiguous_indices`, `fpdt_indices`, `usp_indices`); local
//! `ids [b, L]`, `targets [b, L]`, `positions [b, L]` (the same in every row, laid
//! out like HF's `position_ids`).
//!
//! Ids, targets and position ids are permuted identically: local token `j` of row `r` is
//! global token `indices[j]`, its target is the global target at `indices[j]` (targets
//! were shifted globally, before the split), and its RoPE position is `indices[j]`, or,
//! when positions restart at each document ([`apply_layout_docs`] with `reset_positions`),
//! `indices[j] − d` where `d` is the start of the document of row `r` that holds global
//! token `indices[j]`. Document starts stay global ([`LocalBatch::docs`]): the attention
//! needs the global token indices to know which tokens share a document.

use candle_core::Tensor;

use crate::{Error, Result};

/// One rank's share of a batch: `ids [b, L]`, `targets [b, L]`, `positions [b, L]` (row-major).
///
/// `docs[r]`: row `r`'s document starts, global (indices into the S positions, as in the
/// batch; empty = one document), untouched by the layout.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct LocalBatch {
    pub ids: Vec<u32>,
    pub targets: Vec<i64>,
    pub positions: Vec<u32>,
    pub batch: usize,
    pub local_len: usize,
    pub docs: Vec<Vec<u32>>,
}

fn check_indices(indices: &[usize], seq_len: usize) -> Result<()> {
    if let Some(&bad) = indices.iter().find(|&&i| i >= seq_len) {
        return Err(Error::Setting(format!(
            "layout index {bad} is outside the sequence of length {seq_len} (wrong seq_len for the layout?)"
        )));
    }
    if seq_len > u32::MAX as usize {
        return Err(Error::Setting(format!("sequence length {seq_len} does not fit u32 position ids")));
    }
    Ok(())
}

/// Gathers `indices` out of every row of `ids`/`targets` (`[b, S]` row-major); every row
/// is one document (positions = global indices).
pub fn apply_layout(ids: &[u32], targets: &[i64], seq_len: usize, indices: &[usize]) -> Result<LocalBatch> {
    apply_layout_docs(ids, targets, seq_len, indices, &[], false)
}

/// [`apply_layout`] for rows holding several documents: `docs[r]` are row `r`'s document
/// starts ([`crate::data::Sample::doc_starts`]; `docs` empty = no row has boundaries);
/// with `reset_positions` every position counts from the start of its document.
pub fn apply_layout_docs(
    ids: &[u32],
    targets: &[i64],
    seq_len: usize,
    indices: &[usize],
    docs: &[Vec<u32>],
    reset_positions: bool,
) -> Result<LocalBatch> {
    if seq_len == 0 || !ids.len().is_multiple_of(seq_len) || targets.len() != ids.len() {
        return Err(Error::Setting(format!(
            "layout: ids ({}) and targets ({}) must both hold whole rows of seq_len {seq_len}",
            ids.len(),
            targets.len()
        )));
    }
    check_indices(indices, seq_len)?;
    let b = ids.len() / seq_len;
    if !docs.is_empty() && docs.len() != b {
        return Err(Error::Setting(format!("layout: {} rows of document starts for a batch of {b} rows", docs.len())));
    }
    for (r, d) in docs.iter().enumerate() {
        crate::data::packing::check_doc_starts(d, seq_len).map_err(|e| Error::Setting(format!("layout: row {r}: {e}")))?;
    }
    let mut local_ids = Vec::with_capacity(b * indices.len());
    let mut local_targets = Vec::with_capacity(b * indices.len());
    let mut positions = Vec::with_capacity(b * indices.len());
    for r in 0..b {
        let row = r * seq_len;
        local_ids.extend(indices.iter().map(|&i| ids[row + i]));
        local_targets.extend(indices.iter().map(|&i| targets[row + i]));
        match docs.get(r).filter(|d| reset_positions && !d.is_empty()) {
            // The document of token i starts at the last start ≤ i (starts ascend from 0).
            Some(d) => positions.extend(indices.iter().map(|&i| {
                let k = d.partition_point(|&s| s as usize <= i);
                (i - d[k.saturating_sub(1)] as usize) as u32
            })),
            None => positions.extend(indices.iter().map(|&i| i as u32)),
        }
    }
    let docs = if docs.is_empty() { vec![Vec::new(); b] } else { docs.to_vec() };
    Ok(LocalBatch { ids: local_ids, targets: local_targets, positions, batch: b, local_len: indices.len(), docs })
}

/// Tensor form: `ids [b, S]`, `targets [b, S]` (any dtype, any device) ->
/// `(ids [b, L], targets [b, L], positions [b, L] u32)` on the same device.
pub fn apply_layout_tensors(ids: &Tensor, targets: &Tensor, indices: &[usize]) -> Result<(Tensor, Tensor, Tensor)> {
    let (b, s) = ids.dims2()?;
    if targets.dims() != ids.dims() {
        return Err(Error::Setting(format!("layout: targets shape {:?} differs from ids shape {:?}", targets.dims(), ids.dims())));
    }
    check_indices(indices, s)?;
    let pos: Vec<u32> = indices.iter().map(|&i| i as u32).collect();
    let index = Tensor::new(pos.as_slice(), ids.device())?;
    let local_ids = ids.index_select(&index, 1)?;
    let local_targets = targets.index_select(&index, 1)?;
    let positions = index.unsqueeze(0)?.repeat((b, 1))?;
    Ok((local_ids, local_targets, positions))
}
