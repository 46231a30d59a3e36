//! The parallel modes, each in one place: its name, how its degrees are resolved from
//! the settings, which sequence lengths it can split, the attention it builds over a
//! rank's groups, and the token layout (which global tokens a rank holds).
//!
//! The trainer, the planner, config validation and the benchmarks all ask this module;
//! none of them matches on the mode for these questions itself.
//!
//! | mode | sp | ulysses × ring | seq_length must be a multiple of | layout |
//! | --- | --- | --- | --- | --- |
//! | `data_parallel` | 1 | 1 × 1 | 1 | whole sequence |
//! | `zigzag_ring_attn` | sp | 1 × sp | 2·sp | zigzag (chunks `i`, `2sp-1-i`) |
//! | `ulysses_attn` | sp | sp × 1 | sp | contiguous |
//! | `fpdt` | sp | sp × 1 | chunk (itself a multiple of sp) | contiguous per chunk |
//! | `usp` | sp | u × sp/u | 2·sp | zigzag over rings, contiguous in a Ulysses group |

use std::fmt;
use std::str::FromStr;
use std::sync::Arc;

use longctx_attention::fpdt::Fpdt;
use longctx_attention::layout;
use longctx_attention::local::LocalAttention;
use longctx_attention::ring::ZigzagRing;
use longctx_attention::ulysses::Ulysses;
use longctx_attention::usp::Usp;
use longctx_attention::AttentionMode;

use super::dims::{DimsRequest, Groups, ParallelDims};
use crate::{Error, Result};

/// How attention (and the sequence) is distributed.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, serde::Serialize, serde::Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum ParallelMode {
    /// Every rank holds whole sequences; sp = 1.
    DataParallel,
    /// Zigzag ring attention over sp ranks (ulysses = 1, ring = sp).
    ZigzagRingAttn,
    /// Ulysses all-to-all over sp ranks (ulysses = sp, ring = 1).
    UlyssesAttn,
    /// FPDT (Ulysses-Offload): Ulysses layout with chunked, offloaded attention.
    Fpdt,
    /// Ulysses inside groups of `ulysses` ranks, zigzag ring across `sp / ulysses` groups.
    #[serde(alias = "usp_attn")]
    Usp,
}

/// The setting a sequence-length rule failed on, for the message's field name.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum LengthField {
    SeqLength,
    FpdtChunkSize,
    UlyssesSize,
}

impl ParallelMode {
    pub const ALL: [ParallelMode; 5] =
        [ParallelMode::DataParallel, ParallelMode::ZigzagRingAttn, ParallelMode::UlyssesAttn, ParallelMode::Fpdt, ParallelMode::Usp];

    /// The config / CLI spelling.
    pub fn as_str(self) -> &'static str {
        match self {
            ParallelMode::DataParallel => "data_parallel",
            ParallelMode::ZigzagRingAttn => "zigzag_ring_attn",
            ParallelMode::UlyssesAttn => "ulysses_attn",
            ParallelMode::Fpdt => "fpdt",
            ParallelMode::Usp => "usp",
        }
    }

    /// The sequence-parallel degree for the `sp_size` setting (0 = every rank of `world`).
    /// `data_parallel` splits no sequence, whatever the setting (a run whose stages mix
    /// modes keeps one `sp_size`).
    pub fn sp_degree(self, world: usize, sp_setting: usize) -> usize {
        match self {
            ParallelMode::DataParallel => 1,
            _ if sp_setting == 0 => world,
            _ => sp_setting,
        }
    }

    /// The Ulysses degree to ask for, from the `ulysses_size` setting: only USP takes it
    /// (the other modes imply theirs, see [`Self::ulysses_degree`]).
    pub fn ulysses_setting(self, ulysses_size: usize) -> Option<usize> {
        (self == ParallelMode::Usp).then_some(ulysses_size.max(1))
    }

    /// The request for [`ParallelDims::new`] from a run's settings (`sp_size` 0 = all ranks).
    pub fn dims_request(self, world: usize, sp_size: usize, ulysses_size: usize, hq: usize, hkv: usize) -> DimsRequest {
        DimsRequest { mode: self, world, sp: Some(self.sp_degree(world, sp_size)), ulysses: self.ulysses_setting(ulysses_size), hq, hkv }
    }

    /// Resolve the Ulysses degree within a sequence-parallel group of `sp` ranks.
    pub fn ulysses_degree(self, sp: usize, requested: Option<usize>) -> Result<usize> {
        let setting = |m: String| Err(Error::Setting(m));
        match (self, requested) {
            (ParallelMode::DataParallel | ParallelMode::ZigzagRingAttn, None | Some(1)) => Ok(1),
            (ParallelMode::DataParallel | ParallelMode::ZigzagRingAttn, Some(u)) => {
                setting(format!("mode {self} does not use Ulysses, but ulysses = {u} was given (use usp)"))
            }
            (ParallelMode::UlyssesAttn | ParallelMode::Fpdt, None) => Ok(sp),
            (ParallelMode::UlyssesAttn | ParallelMode::Fpdt, Some(u)) if u == sp => Ok(sp),
            (ParallelMode::UlyssesAttn | ParallelMode::Fpdt, Some(u)) => setting(format!(
                "mode {self} runs Ulysses over the whole sp group (ulysses = sp = {sp}), but ulysses = {u} was given (use usp to mix with a ring)"
            )),
            (ParallelMode::Usp, None) => {
                setting(format!("mode usp needs the ulysses degree (a divisor of sp = {sp}, typically the GPUs per node)"))
            }
            (ParallelMode::Usp, Some(0)) => setting("mode usp: ulysses must be at least 1".into()),
            (ParallelMode::Usp, Some(u)) => Ok(u),
        }
    }

    /// The multiple a sequence length must be of to split under this mode over `sp`
    /// ranks (`chunk`: FPDT's chunk in global tokens, itself a multiple of `sp`): the one
    /// rule that config validation ([`Self::check_seq_len`]) and eval's padding use.
    pub fn seq_multiple(self, sp: usize, chunk: usize) -> usize {
        match self {
            ParallelMode::DataParallel => 1,
            ParallelMode::ZigzagRingAttn | ParallelMode::Usp => 2 * sp,
            ParallelMode::UlyssesAttn => sp,
            ParallelMode::Fpdt => chunk,
        }
    }

    /// Checks that a sequence of `seq` tokens splits under this mode over `sp` ranks
    /// (`ulysses` of them in a Ulysses group; `chunk`: FPDT's chunk in global tokens).
    /// The error names the setting at fault and the multiple that would work.
    pub fn check_seq_len(self, seq: usize, sp: usize, ulysses: usize, chunk: usize) -> std::result::Result<(), (LengthField, String)> {
        // `shown`: how the multiple is made up, for the message.
        let multiple = self.seq_multiple(sp, chunk);
        let need = |what: String, shown: String| {
            if seq.is_multiple_of(multiple) {
                Ok(())
            } else {
                Err((LengthField::SeqLength, format!("{what} needs a multiple of {shown}, got {seq}")))
            }
        };
        match self {
            ParallelMode::DataParallel => Ok(()),
            ParallelMode::ZigzagRingAttn => need(format!("zigzag ring over {sp} ranks"), format!("2·{sp} = {multiple}")),
            ParallelMode::UlyssesAttn => need(format!("ulysses over {sp} ranks"), multiple.to_string()),
            ParallelMode::Fpdt => {
                if chunk == 0 || !chunk.is_multiple_of(sp) {
                    return Err((
                        LengthField::FpdtChunkSize,
                        format!("fpdt chunk size {chunk} must be a positive multiple of sp_size {sp}"),
                    ));
                }
                if !seq.is_multiple_of(multiple) {
                    return Err((
                        LengthField::SeqLength,
                        format!("fpdt needs seq_length to be a multiple of the chunk size {chunk}, got {seq}; use --fpdt-chunk-size dividing it"),
                    ));
                }
                Ok(())
            }
            ParallelMode::Usp => {
                let u = ulysses.max(1);
                if !sp.is_multiple_of(u) {
                    return Err((LengthField::UlyssesSize, format!("usp: sp_size {sp} is not a multiple of ulysses_size {u}")));
                }
                need(format!("usp ({u} ulysses × {} ring)", sp / u), multiple.to_string())
            }
        }
    }

    /// The attention of this mode over a rank's groups (`chunk`, `offload`: FPDT's).
    pub fn build(self, groups: &Groups, chunk: usize, offload: bool) -> Arc<dyn AttentionMode> {
        match self {
            ParallelMode::DataParallel => Arc::new(LocalAttention),
            ParallelMode::ZigzagRingAttn => Arc::new(ZigzagRing::new(groups.sp.clone())),
            ParallelMode::UlyssesAttn => Arc::new(Ulysses::new(groups.sp.clone())),
            ParallelMode::Fpdt => Arc::new(Fpdt::new(groups.sp.clone(), chunk, offload)),
            ParallelMode::Usp => Arc::new(Usp::new(groups.ulysses.clone(), groups.ring.clone())),
        }
    }

    /// Global token indices that sp rank `sp_rank` holds, in its local order, for a
    /// sequence of `seq` tokens.
    pub fn local_indices(self, dims: &ParallelDims, sp_rank: usize, seq: usize, chunk: usize) -> Result<Vec<usize>> {
        let sp = dims.sp;
        let r = match self {
            ParallelMode::DataParallel => Ok((0..seq).collect()),
            ParallelMode::ZigzagRingAttn => layout::zigzag_indices(seq, sp, sp_rank),
            ParallelMode::UlyssesAttn => layout::contiguous_indices(seq, sp, sp_rank),
            ParallelMode::Fpdt => layout::fpdt_indices(seq, sp, chunk, sp_rank),
            ParallelMode::Usp => layout::usp_indices(seq, dims.ulysses, dims.ring, sp_rank),
        };
        r.map_err(Error::from)
    }
}

impl fmt::Display for ParallelMode {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

impl FromStr for ParallelMode {
    type Err = Error;
    /// The mode names, and EasyContext's `usp_attn` for `usp`.
    fn from_str(s: &str) -> Result<Self> {
        if s == "usp_attn" {
            return Ok(ParallelMode::Usp);
        }
        Self::ALL.into_iter().find(|m| m.as_str() == s).ok_or_else(|| {
            let names: Vec<_> = Self::ALL.iter().map(|m| m.as_str()).collect();
            let hint = if s == "dist_flash_attn" {
                " (EasyContext's dist_flash_attn is not implemented: zigzag_ring_attn balances the causal work the same way)"
            } else {
                ""
            };
            Error::Setting(format!("unknown parallel mode `{s}`, expected one of {}{hint}", names.join(", ")))
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_round_trip() {
        for m in ParallelMode::ALL {
            assert_eq!(m.as_str().parse::<ParallelMode>().unwrap(), m);
        }
        assert!("ring".parse::<ParallelMode>().unwrap_err().to_string().contains("zigzag_ring_attn"));
    }

    #[test]
    fn length_rules() {
        use LengthField::*;
        let f = |m: ParallelMode, seq, sp, u, c| m.check_seq_len(seq, sp, u, c).map_err(|e| e.0);
        assert_eq!(f(ParallelMode::DataParallel, 7, 1, 1, 0), Ok(()));
        assert_eq!(f(ParallelMode::ZigzagRingAttn, 9, 3, 1, 0), Err(SeqLength));
        assert_eq!(f(ParallelMode::ZigzagRingAttn, 12, 2, 1, 0), Ok(()));
        assert_eq!(f(ParallelMode::UlyssesAttn, 12, 3, 3, 0), Ok(()));
        assert_eq!(f(ParallelMode::Fpdt, 64, 2, 2, 12), Err(SeqLength));
        assert_eq!(f(ParallelMode::Fpdt, 64, 3, 3, 16), Err(FpdtChunkSize));
        assert_eq!(f(ParallelMode::Usp, 64, 4, 3, 0), Err(UlyssesSize));
        assert_eq!(f(ParallelMode::Usp, 12, 4, 2, 0), Err(SeqLength));
        assert_eq!(f(ParallelMode::Usp, 16, 4, 2, 0), Ok(()));
    }

    #[test]
    fn degrees() {
        assert_eq!(ParallelMode::DataParallel.sp_degree(8, 4), 1);
        assert_eq!(ParallelMode::Fpdt.sp_degree(8, 0), 8);
        assert_eq!(ParallelMode::Usp.sp_degree(8, 4), 4);
        assert_eq!(ParallelMode::Usp.ulysses_setting(0), Some(1));
        assert_eq!(ParallelMode::UlyssesAttn.ulysses_setting(4), None);
        assert_eq!(ParallelMode::UlyssesAttn.ulysses_degree(4, None).unwrap(), 4);
        assert!(ParallelMode::ZigzagRingAttn.ulysses_degree(4, Some(2)).is_err());
        assert!(ParallelMode::Usp.ulysses_degree(4, None).is_err());
    }
}
