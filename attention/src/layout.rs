//! Token layouts: which global tokens each rank holds, in which local order.
//!
//! A layout is a permutation of the global sequence `0..S` cut into per-rank index
//! lists. The same list applied with [`take_seq`] permutes input ids, targets and
//! position ids identically (RoPE must use the global positions, [`positions`]), and
//! [`gather_seq`] puts per-rank tensors back in global order.
//!
//! - zigzag (ring over `W` ranks): the sequence is cut into `2W` chunks of `B = S/2W`;
//!   rank `r` holds chunk `r` then chunk `2W-1-r`, so every rank does the same causal work.
//! - contiguous (Ulysses over `P` ranks): rank `r` holds `[rS/P, (r+1)S/P)`.
//! - FPDT round-robin (`P` ranks, chunk size `C` global tokens, `u = S/C` chunks):
//!   rank `r`'s local chunk `i` is global `[iC + rC/P, iC + (r+1)C/P)`, so that after the
//!   Ulysses all-to-all local chunk `i` is the global segment `[iC, (i+1)C)`.
//! - USP (`R` ring groups of `U` Ulysses ranks, world `W = U·R`, rank = `ring_idx·U +
//!   ulysses_idx`): zigzag over the ring dimension (`2R` chunks, group `g` holds chunks
//!   `g` and `2R-1-g`, `2S/2R` tokens), then the group's zigzag-local sequence is split
//!   contiguously over its `U` ranks, so that the Ulysses all-to-all (which concatenates
//!   the members' tokens in rank order) rebuilds exactly the zigzag-local sequence.
//!
//! Shapes: `x [b, S, ...]` global, `[b, s, ...]` local (`s = S / W`); [`take`] and
//! [`gather`] work along any dim (e.g. dim 2 of `lse [b, h, S]`).

use candle_core::{Result, Tensor};

fn check_rank(what: &str, rank: usize, world: usize) -> Result<()> {
    if world == 0 {
        return crate::config_err!("{what}: world size must be at least 1");
    }
    if rank >= world {
        return crate::config_err!("{what}: rank {rank} is outside a world of {world}");
    }
    Ok(())
}

/// Global token indices held by rank `r` of `w` in the zigzag layout, in local order.
pub fn zigzag_indices(s: usize, w: usize, r: usize) -> Result<Vec<usize>> {
    check_rank("zigzag layout", r, w)?;
    if s == 0 || !s.is_multiple_of(2 * w) {
        return crate::config_err!("sequence length {s} is not divisible by 2·world = {}; use a multiple of {}", 2 * w, 2 * w);
    }
    let b = s / (2 * w);
    let lo = r * b;
    let hi = (2 * w - 1 - r) * b;
    Ok((lo..lo + b).chain(hi..hi + b).collect())
}

/// Global position ids of rank `r`'s tokens in the zigzag layout.
pub fn zigzag_positions(s: usize, w: usize, r: usize) -> Result<Vec<u32>> {
    positions(&zigzag_indices(s, w, r)?)
}

/// Global token indices of rank `r` of `p` when the sequence is split contiguously.
pub fn contiguous_indices(s: usize, p: usize, r: usize) -> Result<Vec<usize>> {
    check_rank("contiguous layout", r, p)?;
    if s == 0 || !s.is_multiple_of(p) {
        return crate::config_err!("sequence length {s} is not divisible by the world size {p}; use a multiple of {p}");
    }
    let n = s / p;
    Ok((r * n..(r + 1) * n).collect())
}

/// Global token indices of rank `r` of `p` in the FPDT round-robin layout with chunk
/// size `c` global tokens.
pub fn fpdt_indices(s: usize, p: usize, c: usize, r: usize) -> Result<Vec<usize>> {
    check_rank("FPDT layout", r, p)?;
    if c == 0 || !c.is_multiple_of(p) {
        return crate::config_err!("FPDT chunk size {c} is not divisible by the world size {p}; use a multiple of {p}");
    }
    if s == 0 || !s.is_multiple_of(c) {
        return crate::config_err!("sequence length {s} is not a multiple of the FPDT chunk size {c}");
    }
    let part = c / p;
    Ok((0..s / c)
        .flat_map(|i| {
            let start = i * c + r * part;
            start..start + part
        })
        .collect())
}

/// Global token indices of world rank `rank = ring_idx·u + ulysses_idx` in the USP
/// layout (`u` Ulysses ranks per group, `r` ring groups).
pub fn usp_indices(s: usize, u: usize, r: usize, rank: usize) -> Result<Vec<usize>> {
    if u == 0 || r == 0 {
        return crate::config_err!("USP layout: ulysses size {u} and ring size {r} must be at least 1");
    }
    check_rank("USP layout", rank, u * r)?;
    if s == 0 || !s.is_multiple_of(2 * r) || !(s / r).is_multiple_of(u) {
        let m = lcm(2 * r, r * u);
        return crate::config_err!(
            "sequence length {s} does not fit USP with ring {r} × ulysses {u}: it must be divisible by 2·ring = {} \
             and S/ring by ulysses {u}; use a multiple of {m}",
            2 * r
        );
    }
    let group = zigzag_indices(s, r, rank / u)?;
    let n = group.len() / u;
    let j = rank % u;
    Ok(group[j * n..(j + 1) * n].to_vec())
}

fn lcm(a: usize, b: usize) -> usize {
    let (mut x, mut y) = (a, b);
    while y != 0 {
        (x, y) = (y, x % y);
    }
    a / x * b
}

/// Position ids (`u32`) of a list of global token indices.
pub fn positions(indices: &[usize]) -> Result<Vec<u32>> {
    indices
        .iter()
        .map(|&i| u32::try_from(i).map_err(|_| crate::error::AttnError::Config(format!("position {i} does not fit in u32")).into()))
        .collect()
}

/// `x` restricted to `indices` along `dim`, in that order.
pub fn take(x: &Tensor, dim: usize, indices: &[usize]) -> Result<Tensor> {
    let n = x.dims().get(dim).copied();
    let Some(n) = n else {
        return crate::shape_err!("take: tensor {:?} has no dim {dim}", x.dims());
    };
    if let Some(&bad) = indices.iter().find(|&&i| i >= n) {
        return crate::shape_err!("take: index {bad} out of range for dim {dim} of size {n}");
    }
    let ids = Tensor::from_vec(positions(indices)?, indices.len(), x.device())?;
    x.index_select(&ids, dim)
}

/// `x [b, S, ...]` restricted to `indices` along the sequence dim 1.
pub fn take_seq(x: &Tensor, indices: &[usize]) -> Result<Tensor> {
    take(x, 1, indices)
}

/// Inverse of [`take`] over all ranks: `parts[r]` holds the global rows
/// `indices[r]` along `dim`; returns the global tensor. The index lists must
/// together be a permutation of `0..S`.
pub fn gather(parts: &[Tensor], dim: usize, indices: &[Vec<usize>]) -> Result<Tensor> {
    if parts.len() != indices.len() || parts.is_empty() {
        return crate::shape_err!("gather: {} parts but {} index lists", parts.len(), indices.len());
    }
    let total: usize = indices.iter().map(|v| v.len()).sum();
    // inverse[g] = row of the concatenation that holds global token g
    let mut inverse = vec![usize::MAX; total];
    let mut row = 0;
    for (r, (p, idx)) in parts.iter().zip(indices).enumerate() {
        if p.dims().get(dim) != Some(&idx.len()) {
            return crate::shape_err!("gather: part {r} {:?} has no dim {dim} of size {}", p.dims(), idx.len());
        }
        for &g in idx {
            if g >= total || inverse[g] != usize::MAX {
                return crate::shape_err!("gather: index lists are not a permutation of 0..{total} (index {g} of rank {r})");
            }
            inverse[g] = row;
            row += 1;
        }
    }
    let all = Tensor::cat(parts, dim)?;
    take(&all, dim, &inverse)
}

/// Inverse of [`take_seq`] over all ranks (sequence dim 1).
pub fn gather_seq(parts: &[Tensor], indices: &[Vec<usize>]) -> Result<Tensor> {
    gather(parts, 1, indices)
}

/// Rank `r`'s zigzag share of a global `x [b, S, ...]`.
pub fn zigzag_split(x: &Tensor, w: usize, r: usize) -> Result<Tensor> {
    let Some(&s) = x.dims().get(1) else {
        return crate::shape_err!("zigzag_split: tensor {:?} has no sequence dim 1", x.dims());
    };
    take_seq(x, &zigzag_indices(s, w, r)?)
}

/// Global tensor from every rank's zigzag share (`locals[r]` of rank `r`).
pub fn zigzag_gather(locals: &[Tensor]) -> Result<Tensor> {
    let w = locals.len();
    let Some(first) = locals.first() else {
        return crate::shape_err!("zigzag_gather: no parts");
    };
    let s = first.dims().get(1).copied().unwrap_or(0) * w;
    let indices = (0..w).map(|r| zigzag_indices(s, w, r)).collect::<Result<Vec<_>>>()?;
    gather_seq(locals, &indices)
}

#[cfg(test)]
mod tests {
    use super::*;
    use candle_core::Device;

    /// Every layout must cover `0..S` exactly once over its ranks.
    fn is_partition(lists: &[Vec<usize>], s: usize) -> bool {
        let mut all: Vec<usize> = lists.iter().flatten().copied().collect();
        all.sort_unstable();
        all == (0..s).collect::<Vec<_>>()
    }

    #[test]
    fn zigzag_chunks_and_positions() -> Result<()> {
        // S = 16, W = 2: chunks of 4; rank 0 holds chunks 0 and 3, rank 1 chunks 1 and 2
        assert_eq!(zigzag_indices(16, 2, 0)?, vec![0, 1, 2, 3, 12, 13, 14, 15]);
        assert_eq!(zigzag_indices(16, 2, 1)?, vec![4, 5, 6, 7, 8, 9, 10, 11]);
        assert_eq!(zigzag_positions(12, 3, 2)?, vec![4, 5, 6, 7]);
        for (s, w) in [(2, 1), (16, 4), (3824, 8), (48, 3)] {
            let lists = (0..w).map(|r| zigzag_indices(s, w, r)).collect::<Result<Vec<_>>>()?;
            assert!(is_partition(&lists, s), "S={s} W={w}");
        }
        Ok(())
    }

    #[test]
    fn zigzag_rejects_bad_lengths() {
        let msg = zigzag_indices(3000, 8, 0).err().map(|e| e.to_string()).unwrap_or_default();
        assert!(msg.contains("sequence length 3000 is not divisible by 2·world = 16; use a multiple of 16"), "{msg}");
        assert!(zigzag_indices(16, 2, 2).is_err());
        assert!(zigzag_indices(0, 2, 0).is_err());
    }

    #[test]
    fn fpdt_round_robin() -> Result<()> {
        // S = 16, C = 8, P = 2: rank 0 holds [0,4) and [8,12), rank 1 [4,8) and [12,16)
        assert_eq!(fpdt_indices(16, 2, 8, 0)?, vec![0, 1, 2, 3, 8, 9, 10, 11]);
        assert_eq!(fpdt_indices(16, 2, 8, 1)?, vec![4, 5, 6, 7, 12, 13, 14, 15]);
        let lists = (0..4).map(|r| fpdt_indices(96, 4, 24, r)).collect::<Result<Vec<_>>>()?;
        assert!(is_partition(&lists, 96));
        assert!(fpdt_indices(96, 4, 30, 0).err().map(|e| e.to_string()).unwrap_or_default().contains("chunk size 30"));
        assert!(fpdt_indices(100, 4, 24, 0).err().map(|e| e.to_string()).unwrap_or_default().contains("not a multiple"));
        Ok(())
    }

    #[test]
    fn usp_is_zigzag_over_groups_then_contiguous() -> Result<()> {
        // S = 16, U = 2, R = 2: group 0 = zigzag rank 0 = [0..4, 12..16], split over 2 ranks
        assert_eq!(usp_indices(16, 2, 2, 0)?, vec![0, 1, 2, 3]);
        assert_eq!(usp_indices(16, 2, 2, 1)?, vec![12, 13, 14, 15]);
        assert_eq!(usp_indices(16, 2, 2, 2)?, vec![4, 5, 6, 7]);
        assert_eq!(usp_indices(16, 2, 2, 3)?, vec![8, 9, 10, 11]);
        for (s, u, r) in [(64, 4, 2), (48, 2, 3), (16, 1, 4), (16, 4, 1)] {
            let lists = (0..u * r).map(|k| usp_indices(s, u, r, k)).collect::<Result<Vec<_>>>()?;
            assert!(is_partition(&lists, s), "S={s} U={u} R={r}");
            // concatenating a group's members in order gives the ring's zigzag share
            for g in 0..r {
                let cat: Vec<usize> = lists[g * u..(g + 1) * u].iter().flatten().copied().collect();
                assert_eq!(cat, zigzag_indices(s, r, g)?);
            }
        }
        assert!(usp_indices(20, 4, 2, 0).is_err()); // S/R = 10 not divisible by U = 4
        Ok(())
    }

    #[test]
    fn take_and_gather_are_inverse() -> Result<()> {
        let (s, w) = (24, 3);
        let x = Tensor::arange(0f32, (2 * s * 5) as f32, &Device::Cpu)?.reshape((2, s, 5))?;
        let lists = (0..w).map(|r| zigzag_indices(s, w, r)).collect::<Result<Vec<_>>>()?;
        let parts = lists.iter().map(|l| take_seq(&x, l)).collect::<Result<Vec<_>>>()?;
        // rank 1's first local token is global token 4 (chunk 1 of 6, chunks of 4)
        assert_eq!(parts[1].narrow(1, 0, 1)?.flatten_all()?.to_vec1::<f32>()?[0], (4 * 5) as f32);
        let back = gather_seq(&parts, &lists)?;
        assert_eq!(back.flatten_all()?.to_vec1::<f32>()?, x.flatten_all()?.to_vec1::<f32>()?);
        let zz = (0..w).map(|r| zigzag_split(&x, w, r)).collect::<Result<Vec<_>>>()?;
        assert_eq!(zigzag_gather(&zz)?.flatten_all()?.to_vec1::<f32>()?, x.flatten_all()?.to_vec1::<f32>()?);
        // a duplicated index is refused
        assert!(gather_seq(&parts, &[lists[0].clone(), lists[0].clone(), lists[2].clone()]).is_err());
        Ok(())
    }
}
