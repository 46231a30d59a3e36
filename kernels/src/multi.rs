//! Write access to several tensors at once, for the ops that update more than one buffer
//! in place (AdamW: weights, both moments and the model-dtype copy).
//!
//! Candle's in-place ops (`InplaceOp1/2/3`) lock one destination for writing. Here each
//! destination gets its own `InplaceOp1`, applied from inside the previous one's forward,
//! so that all write locks are held together when the innermost level runs the work.
//! The storages are checked to be distinct first: a second write lock on the same
//! storage would never be granted.
//!
//! Shapes: none of its own.

use crate::common::check_distinct;
use candle_core::{bail, CpuStorage, CudaStorage, InplaceOp1, Layout, Result, Tensor};
use std::cell::RefCell;

/// One destination's storage, writable, with its layout.
pub(crate) enum MutStorage<'a> {
    Cpu(&'a mut CpuStorage),
    #[cfg_attr(not(feature = "cuda"), allow(dead_code))]
    Cuda(&'a mut CudaStorage),
}

enum Ptr {
    Cpu(*mut CpuStorage),
    Cuda(*mut CudaStorage),
}

type Work<'a> = Box<dyn FnOnce(Vec<(Ptr, Layout)>) -> Result<()> + 'a>;

struct Level<'r, 'w> {
    op: &'static str,
    rest: &'r [&'r Tensor],
    got: &'r RefCell<Vec<(Ptr, Layout)>>,
    work: &'r RefCell<Option<Work<'w>>>,
}

impl Level<'_, '_> {
    fn descend(&self) -> Result<()> {
        match self.rest.split_first() {
            Some((t, rest)) => t.inplace_op1(&Level { op: self.op, rest, got: self.got, work: self.work }),
            None => {
                let Some(work) = self.work.borrow_mut().take() else { bail!("{}: internal error, work run twice", self.op) };
                let got = std::mem::take(&mut *self.got.borrow_mut());
                work(got)
            }
        }
    }
}

impl InplaceOp1 for Level<'_, '_> {
    fn name(&self) -> &'static str {
        self.op
    }

    fn cpu_fwd(&self, s: &mut CpuStorage, l: &Layout) -> Result<()> {
        self.got.borrow_mut().push((Ptr::Cpu(s as *mut CpuStorage), l.clone()));
        self.descend()
    }

    fn cuda_fwd(&self, s: &mut CudaStorage, l: &Layout) -> Result<()> {
        self.got.borrow_mut().push((Ptr::Cuda(s as *mut CudaStorage), l.clone()));
        self.descend()
    }
}

/// Runs `f` with every storage of `dsts` (named by `names`) locked for writing, in order.
/// Tensors in `reads` are only checked to be distinct from the destinations (`f` reads
/// them through `storage_and_layout`, which would block on a storage locked here).
pub(crate) fn with_storages_mut<R>(
    op: &'static str,
    dsts: &[(&str, &Tensor)],
    reads: &[(&str, &Tensor)],
    f: impl FnOnce(&mut [(MutStorage<'_>, Layout)]) -> Result<R>,
) -> Result<R> {
    let all: Vec<(&str, &Tensor)> = dsts.iter().chain(reads).copied().collect();
    check_distinct(op, &all)?;
    let Some(((_, first), _)) = dsts.split_first() else { bail!("{op}: internal error, no destination") };
    let rest: Vec<&Tensor> = dsts[1..].iter().map(|(_, t)| *t).collect();
    let mut out: Option<R> = None;
    {
        let got = RefCell::new(Vec::with_capacity(dsts.len()));
        let out_ref = &mut out;
        let work: Work<'_> = Box::new(move |ptrs: Vec<(Ptr, Layout)>| {
            // SAFETY: every pointer comes from the `&mut` storage handed to an enclosing
            // `Level::*_fwd` frame, which is still running (we are called from its innermost
            // descendant) and does not touch its storage until we return; the storages are
            // pairwise distinct (checked above), so these exclusive borrows do not alias.
            let mut v: Vec<(MutStorage<'_>, Layout)> = ptrs
                .into_iter()
                .map(|(p, l)| match p {
                    Ptr::Cpu(p) => (MutStorage::Cpu(unsafe { &mut *p }), l),
                    Ptr::Cuda(p) => (MutStorage::Cuda(unsafe { &mut *p }), l),
                })
                .collect();
            *out_ref = Some(f(&mut v)?);
            Ok(())
        });
        let work = RefCell::new(Some(work));
        first.inplace_op1(&Level { op, rest: &rest, got: &got, work: &work })?;
    }
    match out {
        Some(r) => Ok(r),
        None => bail!("{op}: internal error, the in-place work did not run"),
    }
}
