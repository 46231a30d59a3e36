//! The communicator abstraction every mode talks through.
//!
//! Backends: [`thread`] (ranks are threads of one process; tensors may live on any
//! Candle device), [`process`] (one rank per process, CPU tensors, messages carried by
//! a byte link: the same algorithms as `thread`, for launched CPU runs and their
//! tests), and [`nccl`] (one process per GPU, behind the `nccl` feature). Every call is collective
//! over the members of the communicator unless stated otherwise. A failure on one
//! rank (an error, a mismatched collective, a timeout) must surface as an error on
//! every rank, never as a hang.

use candle_core::{Result, Tensor};
use std::sync::Arc;

#[cfg(feature = "nccl")]
pub mod nccl;
#[cfg(feature = "nccl")]
mod nccl_family;
pub mod process;
pub mod thread;

/// A timeout for messages: `5 s`, `2.5 s`.
pub(crate) fn secs(d: std::time::Duration) -> String {
    let s = d.as_secs_f64();
    if (s - s.round()).abs() < 1e-9 {
        format!("{} s", s.round() as u64)
    } else {
        format!("{s:.1} s")
    }
}

/// A receive that was posted and may still be in flight.
pub struct Pending {
    wait: Box<dyn FnOnce() -> Result<Vec<Tensor>> + Send>,
}

impl Pending {
    pub fn new(wait: impl FnOnce() -> Result<Vec<Tensor>> + Send + 'static) -> Self {
        Self { wait: Box::new(wait) }
    }
    /// Block until the tensors have arrived.
    pub fn wait(self) -> Result<Vec<Tensor>> {
        (self.wait)()
    }
}

pub trait Comm: Send + Sync + std::fmt::Debug {
    /// This rank within the communicator, `0..world()`.
    fn rank(&self) -> usize;
    fn world(&self) -> usize;
    /// Point-to-point exchange: post `send` to `to` and a receive from `from`, return at
    /// once. `wait()` yields what `from` sent (same count, shapes and dtypes as it sent).
    /// A rank may send to itself.
    fn sendrecv_start(&self, send: Vec<Tensor>, to: usize, from: usize) -> Result<Pending>;
    /// `xs[i]` goes to rank `i`; returns `ys` with `ys[j]` the tensor rank `j` sent here.
    fn all_to_all(&self, xs: Vec<Tensor>) -> Result<Vec<Tensor>>;
    /// Elementwise sum over ranks (same result, bit for bit, on every rank).
    fn all_reduce_sum(&self, x: &Tensor) -> Result<Tensor>;
    /// `ys[j]` is rank `j`'s `x`.
    fn all_gather(&self, x: &Tensor) -> Result<Vec<Tensor>>;
    /// `xs[i]` summed over ranks lands on rank `i`.
    fn reduce_scatter_sum(&self, xs: Vec<Tensor>) -> Result<Tensor>;
    fn barrier(&self) -> Result<()>;
    /// Sub-communicator of the members `ranks` (ranks of this communicator, ascending,
    /// containing `self.rank()`); every member calls it with the same list.
    fn sub(&self, ranks: &[usize]) -> Result<Arc<dyn Comm>>;
    /// Mark the whole world failed: every rank blocked in (or later entering) a call
    /// gets an error naming `reason`.
    fn abort(&self, reason: &str);

    /// Next rank on the ring.
    fn next(&self) -> usize {
        (self.rank() + 1) % self.world()
    }
    /// Previous rank on the ring.
    fn prev(&self) -> usize {
        (self.rank() + self.world() - 1) % self.world()
    }
}
