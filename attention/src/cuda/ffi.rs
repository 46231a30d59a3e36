//! Declarations of the C shim in `attention/csrc/cudnn_sdpa.{h,cpp}` and of the native
//! Hopper kernels in `attention/csrc/native_{fwd,bwd}_sm90.cu` (both compiled by build.rs; the
//! native one only when build.rs found the CUTLASS headers and builds for sm_90).

use std::ffi::{c_char, c_int, c_void};

pub const BF16: i32 = 0;
pub const F16: i32 = 1;

pub const OK: c_int = 0;
pub const FAILED: c_int = 1;
pub const UNSUPPORTED: c_int = 2;
pub const UNAVAILABLE: c_int = 3;

/// Mirrors `longctx_sdpa_desc`.
#[repr(C)]
#[derive(Clone, Copy, Debug)]
pub struct Desc {
    pub ordinal: i32,
    pub dtype: i32,
    pub b: i64,
    pub s: i64,
    pub t: i64,
    pub hq: i64,
    pub hkv: i64,
    pub d: i64,
    pub causal: i32,
    pub scale: f32,
    /// Sliding-window band: query `x` sees key `y` iff `y ≤ x + band_right` and
    /// `y > x − band_left` (top-left aligned); `band_left = 0`: no band.
    pub band_left: i64,
    pub band_right: i64,
}

extern "C" {
    pub fn longctx_sdpa_fwd(
        desc: *const Desc,
        q: *const c_void,
        k: *const c_void,
        v: *const c_void,
        o: *mut c_void,
        lse: *mut f32,
        stream: *mut c_void,
        err: *mut c_char,
        err_len: usize,
    ) -> c_int;

    pub fn longctx_sdpa_bwd(
        desc: *const Desc,
        q: *const c_void,
        k: *const c_void,
        v: *const c_void,
        o: *const c_void,
        d_o: *const c_void,
        lse: *const f32,
        dq: *mut c_void,
        dk: *mut c_void,
        dv: *mut c_void,
        stream: *mut c_void,
        err: *mut c_char,
        err_len: usize,
    ) -> c_int;

    pub fn longctx_sdpa_cudnn_version(err: *mut c_char, err_len: usize) -> i64;

    /// Same arguments and codes as `longctx_sdpa_fwd` (`csrc/native_fmha.h`).
    #[cfg(longctx_native)]
    pub fn longctx_native_fwd(
        desc: *const Desc,
        q: *const c_void,
        k: *const c_void,
        v: *const c_void,
        o: *mut c_void,
        lse: *mut f32,
        stream: *mut c_void,
        err: *mut c_char,
        err_len: usize,
    ) -> c_int;

    /// Same arguments and codes as `longctx_sdpa_bwd` (`csrc/native_fmha.h`).
    #[cfg(longctx_native)]
    pub fn longctx_native_bwd(
        desc: *const Desc,
        q: *const c_void,
        k: *const c_void,
        v: *const c_void,
        o: *const c_void,
        d_o: *const c_void,
        lse: *const f32,
        dq: *mut c_void,
        dk: *mut c_void,
        dv: *mut c_void,
        stream: *mut c_void,
        err: *mut c_char,
        err_len: usize,
    ) -> c_int;
}
