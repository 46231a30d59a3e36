//! The one signature every sequence-parallel mode shares with the single-device kernel.

use crate::docs::{Docs, Masking};
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
    /// The forward under a document mask and a sliding window ([`Masking`]; both `None`:
    /// plain causal). `mask.docs` holds global token indices; every rank of a group passes
    /// the same mask. Modes turn it into one mask with [`crate::docs::resolve`].
    fn forward_masked(&self, q: &Tensor, k: &Tensor, v: &Tensor, mask: Masking<'_>, scale: f64) -> Result<(Tensor, Tensor)>;
    /// The backward of [`AttentionMode::forward_masked`] with the same `mask`.
    fn backward_masked(&self, d_o: &Tensor, saved: Saved<'_>, mask: Masking<'_>, scale: f64) -> Result<(Tensor, Tensor, Tensor)>;
    /// The forward under a document mask (`None`: every row one document, plain causal).
    fn forward_docs(&self, q: &Tensor, k: &Tensor, v: &Tensor, docs: Option<&Docs>, scale: f64) -> Result<(Tensor, Tensor)> {
        self.forward_masked(q, k, v, Masking::docs(docs), scale)
    }
    /// The backward of [`AttentionMode::forward_docs`] with the same `docs`.
    fn backward_docs(&self, d_o: &Tensor, saved: Saved<'_>, docs: Option<&Docs>, scale: f64) -> Result<(Tensor, Tensor, Tensor)> {
        self.backward_masked(d_o, saved, Masking::docs(docs), scale)
    }
    /// Causal attention (one document per row).
    fn forward(&self, q: &Tensor, k: &Tensor, v: &Tensor, scale: f64) -> Result<(Tensor, Tensor)> {
        self.forward_docs(q, k, v, None, scale)
    }
    fn backward(&self, d_o: &Tensor, saved: Saved<'_>, scale: f64) -> Result<(Tensor, Tensor, Tensor)> {
        self.backward_docs(d_o, saved, None, scale)
    }
}

/// A mode with a fixed document mask: what a trainer hands the model for one batch (the
/// model calls [`AttentionMode::forward`], or [`AttentionMode::forward_masked`] with its
/// layer's window, and knows nothing of documents).
#[derive(Debug, Clone)]
pub struct WithDocs {
    pub inner: std::sync::Arc<dyn AttentionMode>,
    pub docs: std::sync::Arc<Docs>,
}

impl AttentionMode for WithDocs {
    fn name(&self) -> &'static str {
        self.inner.name()
    }
    fn forward_masked(&self, q: &Tensor, k: &Tensor, v: &Tensor, mask: Masking<'_>, scale: f64) -> Result<(Tensor, Tensor)> {
        self.inner.forward_masked(q, k, v, Masking { docs: Some(mask.docs.unwrap_or(&self.docs)), ..mask }, scale)
    }
    fn backward_masked(&self, d_o: &Tensor, saved: Saved<'_>, mask: Masking<'_>, scale: f64) -> Result<(Tensor, Tensor, Tensor)> {
        self.inner.backward_masked(d_o, saved, Masking { docs: Some(mask.docs.unwrap_or(&self.docs)), ..mask }, scale)
    }
}

/// `mode` with `docs` fixed, or `mode` itself when there is no (non-trivial) mask.
pub fn with_docs(mode: &std::sync::Arc<dyn AttentionMode>, docs: Option<Docs>) -> std::sync::Arc<dyn AttentionMode> {
    match docs.filter(|d| !d.is_trivial()) {
        Some(d) => std::sync::Arc::new(WithDocs { inner: mode.clone(), docs: std::sync::Arc::new(d) }),
        None => mode.clone(),
    }
}
