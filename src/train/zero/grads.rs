//! The gradients of one optimizer step, in one flat f32 buffer.
//!
//! The parameters, in `Engine::params` order, are laid end to end in one f32 vector of
//! `n` elements, zero-padded to a length the optimizer chooses (`W·L` for ZeRO over `W`
//! ranks, see `super::stage12`). Each parameter's gradient is a view of its range, shaped
//! like the parameter: the engine accumulates into the views in place (the weight-gradient
//! GEMMs write into them with `beta = 1`), micro-batches add into the same buffer, and the
//! optimizer reads the flat vector as it is — no per-step allocation, no flattening copy.
//!
//! Shapes: `flat [padded]` f32; `views[p]` the shape of parameter `p`.

use crate::Result;
use candle_core::{DType, Device, Tensor, Var};

/// One flat f32 gradient buffer and a view of it per parameter.
pub struct GradBuffer {
    flat: Tensor,       // [padded] f32
    views: Vec<Tensor>, // per parameter, its shape, over `flat`
}

impl GradBuffer {
    /// Zeros for `params`, padded to `padded` elements (at least their total).
    pub fn new(params: &[(String, Var)], padded: usize, dev: &Device) -> Result<Self> {
        let n: usize = params.iter().map(|(_, v)| v.as_tensor().elem_count()).sum();
        let flat = Tensor::zeros(padded.max(n), DType::F32, dev)?;
        let mut views = Vec::with_capacity(params.len());
        let mut off = 0;
        for (_, v) in params {
            let len = v.as_tensor().elem_count();
            views.push(flat.narrow(0, off, len)?.reshape(v.as_tensor().shape())?);
            off += len;
        }
        Ok(Self { flat, views })
    }

    /// The whole buffer, `[padded]` f32.
    pub fn flat(&self) -> &Tensor {
        &self.flat
    }

    /// Parameter `p`'s gradient (a view: writes go into the buffer).
    pub fn views(&self) -> &[Tensor] {
        &self.views
    }

    /// Set every gradient to zero, in place (the start of an optimizer step).
    pub fn zero(&self) -> Result<()> {
        zero_flat(&self.flat)
    }

    /// Bytes on the device.
    pub fn bytes(&self) -> usize {
        self.flat.elem_count() * 4
    }
}

/// Candle's CUDA element-wise kernels (fill, cast, unary, binary) index with a 32-bit
/// counter: over 2^32 or more elements the loop never ends (the GPU spins, the step never
/// finishes). A 7B model's flat f32 gradient is 6.7e9 elements, so every whole-buffer
/// Candle op on it goes through pieces of at most this many elements.
pub const CANDLE_MAX_ELEMS: usize = 1 << 30;

/// Set the 1-D tensor `t` to zero in place, [`CANDLE_MAX_ELEMS`] elements at a time.
pub fn zero_flat(t: &Tensor) -> Result<()> {
    zero_in_pieces(t, CANDLE_MAX_ELEMS)
}

fn zero_in_pieces(t: &Tensor, piece: usize) -> Result<()> {
    let n = t.elem_count();
    let mut at = 0;
    while at < n {
        let len = piece.min(n - at);
        t.narrow(0, at, len)?.zero_set()?;
        at += len;
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn zeroing_in_pieces_reaches_every_element() {
        for n in [1usize, 6, 7, 9] {
            let t = Tensor::arange(1f32, n as f32 + 1.0, &Device::Cpu).unwrap();
            zero_in_pieces(&t, 3).unwrap();
            assert_eq!(t.to_vec1::<f32>().unwrap(), vec![0.0; n], "n = {n}");
        }
    }
}
