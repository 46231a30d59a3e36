//! The PTX modules built from `src/cuda/*.cu` by build.rs, and launch helpers.
//!
//! Kernels are loaded once per device through Candle's
//! `CudaDevice::get_or_load_custom_func(fn_name, module_name, ptx)` and launched with
//! cudarc's launch builder on the device's stream, so they are ordered with the Candle
//! ops around them. Outputs are fresh allocations on that stream.
//!
//! Shapes: none of its own; `n` elements of a flat buffer.

use crate::common::contiguous;
use candle_core::cuda::cudarc::driver::{sys, CudaView, CudaViewMut, DeviceRepr, LaunchConfig};
use candle_core::cuda::{CudaDType, WrapErr};
use candle_core::{CudaDevice, CudaStorage, Layout, Result};

/// One PTX module.
#[derive(Clone, Copy, Debug)]
pub(crate) enum Module {
    RmsNorm,
    Rope,
    SwiGlu,
    CrossEntropy,
    AdamW,
    Accumulate,
    Add,
    Reduce,
}

impl Module {
    pub(crate) fn name(self) -> &'static str {
        match self {
            Module::RmsNorm => "longctx_rmsnorm",
            Module::Rope => "longctx_rope",
            Module::SwiGlu => "longctx_swiglu",
            Module::CrossEntropy => "longctx_cross_entropy",
            Module::AdamW => "longctx_adamw",
            Module::Accumulate => "longctx_accumulate",
            Module::Add => "longctx_add",
            Module::Reduce => "longctx_reduce",
        }
    }

    pub(crate) fn ptx(self) -> &'static str {
        match self {
            Module::RmsNorm => include_str!(concat!(env!("OUT_DIR"), "/rmsnorm.ptx")),
            Module::Rope => include_str!(concat!(env!("OUT_DIR"), "/rope.ptx")),
            Module::SwiGlu => include_str!(concat!(env!("OUT_DIR"), "/swiglu.ptx")),
            Module::CrossEntropy => include_str!(concat!(env!("OUT_DIR"), "/cross_entropy.ptx")),
            Module::AdamW => include_str!(concat!(env!("OUT_DIR"), "/adamw.ptx")),
            Module::Accumulate => include_str!(concat!(env!("OUT_DIR"), "/accumulate.ptx")),
            Module::Add => include_str!(concat!(env!("OUT_DIR"), "/add.ptx")),
            Module::Reduce => include_str!(concat!(env!("OUT_DIR"), "/reduce.ptx")),
        }
    }
}

/// Loads `$name` from `$module` on `$dev`, pushes the arguments and launches with `$cfg`.
/// Arguments are anything cudarc's launch builder takes: `&view`, `&mut view`, `&scalar`.
macro_rules! launch {
    ($dev:expr, $module:expr, $name:expr, $cfg:expr, $($arg:expr),+ $(,)?) => {{
        use candle_core::cuda::cudarc::driver::PushKernelArg as _;
        use candle_core::cuda::WrapErr as _;
        let module: $crate::cuda::Module = $module;
        let func = $dev.get_or_load_custom_func(&$name, module.name(), module.ptx())?;
        let mut builder = func.builder();
        $( builder.arg($arg); )+
        // SAFETY: the argument list matches the kernel's C signature (see src/cuda/*.cu),
        // every buffer holds the elements the kernel indexes (checked by the caller).
        unsafe { builder.launch($cfg) }.w()?;
    }};
}
pub(crate) use launch;

/// The null device pointer, for optional buffer arguments.
pub(crate) const NULL: u64 = 0;

/// The contiguous elements of a CUDA storage as a view.
pub(crate) fn view<'a, T: CudaDType + DeviceRepr>(op: &str, name: &str, s: &'a CudaStorage, l: &Layout) -> Result<CudaView<'a, T>> {
    let (a, b) = contiguous(op, name, l)?;
    Ok(s.as_cuda_slice::<T>()?.slice(a..b))
}

/// The contiguous elements of a CUDA storage as a mutable view.
pub(crate) fn view_mut<'a, T: CudaDType + DeviceRepr>(
    op: &str,
    name: &str,
    s: &'a mut CudaStorage,
    l: &Layout,
) -> Result<CudaViewMut<'a, T>> {
    let (a, b) = contiguous(op, name, l)?;
    Ok(s.as_cuda_slice_mut::<T>()?.slice_mut(a..b))
}

/// Streaming multiprocessors of the device (132 on an H200).
pub(crate) fn sm_count(dev: &CudaDevice) -> Result<usize> {
    let ctx = dev.cuda_stream().context().clone();
    Ok(ctx.attribute(sys::CUdevice_attribute::CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT).w()?.max(1) as usize)
}

/// Launch shape of a grid-stride elementwise kernel over `n` items: 256 threads, at most
/// 32 blocks per SM (enough to saturate memory bandwidth).
pub(crate) fn elementwise(dev: &CudaDevice, n: usize) -> Result<LaunchConfig> {
    let threads = 256usize;
    let blocks = n.div_ceil(threads).clamp(1, 32 * sm_count(dev)?);
    Ok(LaunchConfig { grid_dim: (blocks as u32, 1, 1), block_dim: (threads as u32, 1, 1), shared_mem_bytes: 0 })
}

/// Threads for a row kernel over rows of `h` elements: about `per_thread` elements each,
/// a multiple of 32 between 32 and `max`.
pub(crate) fn row_threads(h: usize, per_thread: usize, max: usize) -> u32 {
    (h.div_ceil(per_thread).div_ceil(32) * 32).clamp(32, max) as u32
}

/// Uninitialised device buffer of `n` elements (the kernel writes all of it).
pub(crate) fn alloc<T: DeviceRepr>(dev: &CudaDevice, n: usize) -> Result<candle_core::cuda::cudarc::driver::CudaSlice<T>> {
    // SAFETY: every caller launches a kernel that writes all `n` elements before any read.
    unsafe { dev.alloc::<T>(n) }
}
