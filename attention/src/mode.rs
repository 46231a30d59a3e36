//! The one signature every sequence-parallel mode shares with the single-device kernel.

use crate::kernel::Saved;
use candle_core::{Result, Tensor};

/// Causal attention over the *global* sequence, called by each rank on its local
/// tokens (in the mode's token layout, see [`crate::layout`]).
///
/// `q [b, s, hq, d]`, `k`/`v [b, s, hkv, d]` -> `(o [b, s, hq, d], lse [b, hq, s] f32)`.
/// `backward` takes this rank's `do` and [`Saved`] inputs with the `o`/`lse` that `forward`
/// returned, and returns `(dq, dk, dv)` for this rank's inputs. Ranks call both collectively.
pub trait AttentionMode: Send + Sync + std::fmt::Debug {
    fn name(&self) -> &'static str;
    fn forward(&self, q: &Tensor, k: &Tensor, v: &Tensor, scale: f64) -> Result<(Tensor, Tensor)>;
    fn backward(&self, d_o: &Tensor, saved: Saved<'_>, scale: f64) -> Result<(Tensor, Tensor, Tensor)>;
}
