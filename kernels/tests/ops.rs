//! Each fused op against the composed Candle ops the model uses today (forward) and
//! against Candle autograd of that composition (backward); AdamW against a naive f64 loop;
//! cross-entropy against `candle_nn::loss::cross_entropy` with ignored rows. On the CPU
//! these test the CPU twins; with the `cuda` feature and a GPU, the `cuda_*` tests run the
//! CUDA kernels against the CPU twins and against the composed ops on the GPU.
//!
//! Shapes: `b` batch, `s` tokens, `h` hidden, `i` intermediate, `H` heads, `d` head dim,
//! `V` vocabulary, `n` rows or elements.
//!
//! Tolerances (checked per element as `|got − want| ≤ rtol·|want| + atol·max|want|`):
//! - f32, fused vs composed forward: rtol 1e-5, atol 1e-6;
//! - f32, fused backward vs autograd: rtol 1e-5, atol 1e-5 (sums over rows reorder);
//! - bf16, fused vs composed bf16 ops: rtol 1.6e-2 (two bf16 ulps: the composition rounds
//!   after every op, the fused kernel once), atol 4e-3;
//! - bf16 backward vs f32 autograd of the same (bf16-valued) inputs: rtol 1.6e-2, atol 8e-3;
//! - AdamW: CPU twin bit-exact vs optim.rs's f32 loop; within 1e-6 (abs) of an f64 loop.

use candle_core::{DType, Device, Result, Tensor, Var, D};
use longctx_kernels::*;

// ---------------------------------------------------------------- helpers

/// Deterministic pseudo-random values in [-scale, scale) (xorshift), as `dtype` on `dev`.
fn rand(shape: &[usize], seed: u64, scale: f32, dtype: DType, dev: &Device) -> Tensor {
    let n: usize = shape.iter().product();
    let mut x = seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1;
    let v: Vec<f32> = (0..n)
        .map(|_| {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            ((x >> 40) as f32 / (1u64 << 24) as f32 * 2.0 - 1.0) * scale
        })
        .collect();
    Tensor::from_vec(v, shape, &Device::Cpu).unwrap().to_dtype(dtype).unwrap().to_device(dev).unwrap()
}

fn vec32(t: &Tensor) -> Vec<f32> {
    t.to_dtype(DType::F32).unwrap().flatten_all().unwrap().to_vec1::<f32>().unwrap()
}

/// Per-element `|got − want| ≤ rtol·|want| + atol·max|want|`; returns the largest error
/// relative to max|want| (printed, for the record).
fn assert_close(what: &str, got: &Tensor, want: &Tensor, rtol: f32, atol: f32) -> f32 {
    assert_eq!(got.dims(), want.dims(), "{what}: shapes");
    let (g, w) = (vec32(got), vec32(want));
    let scale = w.iter().fold(0f32, |m, x| m.max(x.abs())).max(1e-30);
    let mut worst = (0f32, 0usize);
    for (i, (a, b)) in g.iter().zip(&w).enumerate() {
        let err = (a - b).abs();
        assert!(err <= rtol * b.abs() + atol * scale, "{what}: element {i}: got {a}, want {b} (|err| {err}, max|want| {scale})");
        if err > worst.0 {
            worst = (err, i);
        }
    }
    let rel = worst.0 / scale;
    eprintln!("{what}: max |err| {:.3e} = {rel:.3e} of max|want| {scale:.3e}", worst.0);
    rel
}

const F32_FWD: (f32, f32) = (1e-5, 1e-6);
const F32_BWD: (f32, f32) = (1e-5, 1e-5);
const BF16_FWD: (f32, f32) = (1.6e-2, 4e-3);
const BF16_BWD: (f32, f32) = (1.6e-2, 8e-3);

fn tol(dtype: DType, fwd: bool) -> (f32, f32) {
    match (dtype, fwd) {
        (DType::F32, true) => F32_FWD,
        (DType::F32, false) => F32_BWD,
        (_, true) => BF16_FWD,
        (_, false) => BF16_BWD,
    }
}

// ---------------------------------------------------------------- composed references

/// src/model/llama.rs's `RmsNorm::forward`.
fn rms_ref(x: &Tensor, w: &Tensor, eps: f64) -> Result<Tensor> {
    let dtype = x.dtype();
    let x32 = x.to_dtype(DType::F32)?;
    let var = x32.sqr()?.mean_keepdim(D::Minus1)?;
    let inv = (var + eps)?.sqrt()?.recip()?;
    x32.broadcast_mul(&inv)?.to_dtype(dtype)?.broadcast_mul(w)
}

/// src/model/rope.rs's `rotate_half` and `RopeTable::apply`.
fn rotate_half(x: &Tensor) -> Result<Tensor> {
    let d = x.dim(D::Minus1)?;
    Tensor::cat(&[&x.narrow(D::Minus1, d / 2, d / 2)?.neg()?, &x.narrow(D::Minus1, 0, d / 2)?], D::Minus1)
}
fn rope_ref(x: &Tensor, cos: &Tensor, sin: &Tensor) -> Result<Tensor> {
    x.broadcast_mul(cos)?.add(&rotate_half(x)?.broadcast_mul(sin)?)
}

/// cos/sin `[b, s, 1, d]` for positions `[b, s]` as src/model/rope.rs builds them
/// (default RoPE, theta 10000).
fn rope_tables(pos: &[u32], b: usize, s: usize, d: usize, dtype: DType, dev: &Device) -> (Tensor, Tensor) {
    let inv: Vec<f32> = (0..d / 2).map(|i| 1.0 / (10000f64.powf((2 * i) as f64 / d as f64) as f32)).collect();
    let inv = Tensor::from_vec(inv, (1, 1, d / 2), dev).unwrap();
    let p = Tensor::from_vec(pos.to_vec(), (b, s), dev).unwrap().to_dtype(DType::F32).unwrap().reshape((b, s, 1)).unwrap();
    let f = p.broadcast_mul(&inv).unwrap();
    let emb = Tensor::cat(&[&f, &f], D::Minus1).unwrap();
    let t = |x: Tensor| x.to_dtype(dtype).unwrap().unsqueeze(2).unwrap().contiguous().unwrap();
    (t(emb.cos().unwrap()), t(emb.sin().unwrap()))
}

/// Global positions of a zigzag shard: two separated runs (not 0..s).
fn positions(b: usize, s: usize) -> Vec<u32> {
    (0..b * s).map(|k| (k % s) as u32 + if k % s < s / 2 { 1000 } else { 60000 } + (k / s) as u32 * 7).collect()
}

// ---------------------------------------------------------------- RMSNorm

fn rmsnorm_fwd_case(dev: &Device, dtype: DType) {
    let (b, s, h, eps) = (2, 5, 96, 1e-5);
    let x = rand(&[b, s, h], 1, 2.0, dtype, dev);
    let r = rand(&[b, s, h], 2, 1.0, dtype, dev);
    let w = (rand(&[h], 3, 0.5, DType::F32, dev) + 1.0).unwrap().to_dtype(dtype).unwrap();
    let (rt, at) = tol(dtype, true);
    let tag = format!("{:?} {dtype:?}", dev.location());

    let out = rms_norm_fwd(&x, Some(&r), &w, eps).unwrap();
    let sum = x.add(&r).unwrap();
    assert_close(&format!("rmsnorm fwd x_sum {tag}"), &out.x_sum, &sum, rt, at);
    assert_close(&format!("rmsnorm fwd y {tag}"), &out.y, &rms_ref(&sum, &w, eps).unwrap(), rt, at);
    let s32 = sum.to_dtype(DType::F32).unwrap();
    let rstd =
        (s32.sqr().unwrap().mean_keepdim(D::Minus1).unwrap() + eps).unwrap().sqrt().unwrap().recip().unwrap().squeeze(D::Minus1).unwrap();
    assert_close(&format!("rmsnorm fwd rstd {tag}"), &out.rstd, &rstd, F32_FWD.0, F32_FWD.1);

    let out = rms_norm_fwd(&x, None, &w, eps).unwrap();
    assert_close(&format!("rmsnorm fwd (no residual) y {tag}"), &out.y, &rms_ref(&x, &w, eps).unwrap(), rt, at);
}

fn rmsnorm_bwd_case(dev: &Device, dtype: DType) {
    let (n, h, eps) = (37, 83, 1e-6); // h not a multiple of 8: the kernels' one-column path
    let xs = rand(&[n, h], 11, 2.0, dtype, dev);
    let w = (rand(&[h], 12, 0.5, DType::F32, dev) + 1.0).unwrap().to_dtype(dtype).unwrap();
    let dy = rand(&[n, h], 13, 1.0, dtype, dev);
    let dres = rand(&[n, h], 14, 1.0, dtype, dev);
    let fwd = rms_norm_fwd(&xs, None, &w, eps).unwrap();
    let g = rms_norm_bwd(&dy, &fwd.x_sum, &w, &fwd.rstd, Some(&dres)).unwrap();
    let g0 = rms_norm_bwd(&dy, &fwd.x_sum, &w, &fwd.rstd, None).unwrap();
    assert_eq!(g.dweight.dtype(), DType::F32);

    // f32 autograd of the composition on the same values; the residual gradient adds.
    let xv = Var::from_tensor(&xs.to_dtype(DType::F32).unwrap()).unwrap();
    let wv = Var::from_tensor(&w.to_dtype(DType::F32).unwrap()).unwrap();
    let y = rms_ref(xv.as_tensor(), wv.as_tensor(), eps).unwrap();
    let grads = y.mul(&dy.to_dtype(DType::F32).unwrap()).unwrap().sum_all().unwrap().backward().unwrap();
    let dx_ref = grads.get(xv.as_tensor()).unwrap();
    let dw_ref = grads.get(wv.as_tensor()).unwrap();
    let (rt, at) = tol(dtype, false);
    let tag = format!("{:?} {dtype:?}", dev.location());
    assert_close(&format!("rmsnorm bwd dx {tag}"), &g0.dx, dx_ref, rt, at);
    assert_close(&format!("rmsnorm bwd dx+dres {tag}"), &g.dx, &(dx_ref + dres.to_dtype(DType::F32).unwrap()).unwrap(), rt, at);
    assert_close(&format!("rmsnorm bwd dw {tag}"), &g.dweight, dw_ref, rt, at);
}

/// [`rms_norm_bwd_into`] against [`rms_norm_bwd`] with the same residual gradient: the same
/// values (bit for bit: one kernel, one formula), written into rows of a larger buffer and
/// nowhere else; `dweight` identical.
fn rmsnorm_bwd_into_case(dev: &Device, dtype: DType, (n, h): (usize, usize)) {
    let xs = rand(&[n, h], 15, 2.0, dtype, dev);
    let w = (rand(&[h], 16, 0.5, DType::F32, dev) + 1.0).unwrap().to_dtype(dtype).unwrap();
    let dy = rand(&[n, h], 17, 1.0, dtype, dev);
    let fwd = rms_norm_fwd(&xs, None, &w, 1e-6).unwrap();
    let whole = rand(&[n + 5, h], 18, 1.0, dtype, dev);
    let before = vec32(&whole);
    let rows = whole.narrow(0, 2, n).unwrap();
    let want = rms_norm_bwd(&dy, &fwd.x_sum, &w, &fwd.rstd, Some(&rows.copy().unwrap())).unwrap();
    let dw = rms_norm_bwd_into(&rows, &dy, &fwd.x_sum, &w, &fwd.rstd).unwrap();
    let tag = format!("rmsnorm bwd_into {dtype:?} {n}x{h} on {:?}", dev.location());
    assert_eq!(vec32(&rows), vec32(&want.dx), "{tag}: dx");
    assert_eq!(vec32(&dw), vec32(&want.dweight), "{tag}: dweight");
    let after = vec32(&whole);
    assert_eq!(&after[..2 * h], &before[..2 * h], "{tag}: wrote before its rows");
    assert_eq!(&after[(n + 2) * h..], &before[(n + 2) * h..], "{tag}: wrote past its rows");
    let e = rms_norm_bwd_into(&dy, &dy, &fwd.x_sum, &w, &fwd.rstd).unwrap_err().to_string();
    assert!(e.contains("share storage"), "{e}");
}

#[test]
fn rmsnorm_cpu() {
    rmsnorm_bwd_into_case(&Device::Cpu, DType::BF16, (130, 64));
    rmsnorm_bwd_into_case(&Device::Cpu, DType::F32, (7, 83));
    for dt in [DType::F32, DType::BF16] {
        rmsnorm_fwd_case(&Device::Cpu, dt);
        rmsnorm_bwd_case(&Device::Cpu, dt);
    }
}

// ---------------------------------------------------------------- RoPE

fn rope_case(dev: &Device, dtype: DType, table_dtype: DType, d: usize) {
    let (b, s, heads) = (2, 6, 3);
    let x = rand(&[b, s, heads, d], 21, 1.0, dtype, dev);
    let (cos, sin) = rope_tables(&positions(b, s), b, s, d, table_dtype, dev);
    let tag = format!("{:?} {dtype:?} tables {table_dtype:?} d {d}", dev.location());
    let (rt, at) = tol(dtype, true);

    let y = x.copy().unwrap();
    rope_fwd_inplace(&y, &cos, &sin).unwrap();
    let (c, sn) = (cos.to_dtype(dtype).unwrap(), sin.to_dtype(dtype).unwrap());
    assert_close(&format!("rope fwd {tag}"), &y, &rope_ref(&x, &c, &sn).unwrap(), rt, at);

    // backward = transpose: against f32 autograd of the composition
    let dy = rand(&[b, s, heads, d], 22, 1.0, dtype, dev);
    let xv = Var::from_tensor(&x.to_dtype(DType::F32).unwrap()).unwrap();
    let (c32, s32) = (cos.to_dtype(DType::F32).unwrap(), sin.to_dtype(DType::F32).unwrap());
    let grads = rope_ref(xv.as_tensor(), &c32, &s32)
        .unwrap()
        .mul(&dy.to_dtype(DType::F32).unwrap())
        .unwrap()
        .sum_all()
        .unwrap()
        .backward()
        .unwrap();
    let dx = dy.copy().unwrap();
    rope_bwd_inplace(&dx, &cos, &sin).unwrap();
    let (rt, at) = tol(dtype, false);
    assert_close(&format!("rope bwd {tag}"), &dx, grads.get(xv.as_tensor()).unwrap(), rt, at);

    // forward then backward (rotation by θ then −θ) gives back the input
    let z = x.copy().unwrap();
    rope_fwd_inplace(&z, &cos, &sin).unwrap();
    rope_bwd_inplace(&z, &cos, &sin).unwrap();
    let (rt, at) = if dtype == DType::F32 && table_dtype == DType::F32 { (1e-6, 1e-6) } else { tol(dtype, false) };
    assert_close(&format!("rope fwd+bwd = id {tag}"), &z, &x, rt, at);
}

#[test]
fn rope_cpu() {
    for d in [16, 12] {
        rope_case(&Device::Cpu, DType::F32, DType::F32, d);
        rope_case(&Device::Cpu, DType::BF16, DType::BF16, d);
        rope_case(&Device::Cpu, DType::BF16, DType::F32, d);
    }
}

// ---------------------------------------------------------------- SwiGLU

fn swiglu_case(dev: &Device, dtype: DType) {
    let shape = [3, 7, 41]; // 861 elements: 107 packs of 8 and a tail of 5 on the GPU
    let g = rand(&shape, 31, 4.0, dtype, dev);
    let u = rand(&shape, 32, 2.0, dtype, dev);
    let tag = format!("{:?} {dtype:?}", dev.location());
    let (rt, at) = tol(dtype, true);
    assert_close(&format!("swiglu fwd {tag}"), &swiglu_fwd(&g, &u).unwrap(), &g.silu().unwrap().mul(&u).unwrap(), rt, at);

    let dout = rand(&shape, 33, 1.0, dtype, dev);
    let gv = Var::from_tensor(&g.to_dtype(DType::F32).unwrap()).unwrap();
    let uv = Var::from_tensor(&u.to_dtype(DType::F32).unwrap()).unwrap();
    let y = gv.as_tensor().silu().unwrap().mul(uv.as_tensor()).unwrap();
    let grads = y.mul(&dout.to_dtype(DType::F32).unwrap()).unwrap().sum_all().unwrap().backward().unwrap();
    let (dg, du) = swiglu_bwd(&dout, &g, &u).unwrap();
    let (rt, at) = tol(dtype, false);
    assert_close(&format!("swiglu bwd dgate {tag}"), &dg, grads.get(gv.as_tensor()).unwrap(), rt, at);
    assert_close(&format!("swiglu bwd dup {tag}"), &du, grads.get(uv.as_tensor()).unwrap(), rt, at);
    // the one-pass backward: the same three values as the two ops, bit for bit
    let (dg2, du2, out) = swiglu_bwd_fwd(&dout, &g, &u).unwrap();
    assert_eq!(vec32(&dg2), vec32(&dg), "swiglu bwd_fwd dgate {tag}");
    assert_eq!(vec32(&du2), vec32(&du), "swiglu bwd_fwd dup {tag}");
    assert_eq!(vec32(&out), vec32(&swiglu_fwd(&g, &u).unwrap()), "swiglu bwd_fwd out {tag}");
}

#[test]
fn swiglu_cpu() {
    swiglu_case(&Device::Cpu, DType::F32);
    swiglu_case(&Device::Cpu, DType::BF16);
}

// ---------------------------------------------------------------- sums

/// `add` (two and three terms) and `add_into` (rows of a larger buffer, the other rows
/// untouched) against Candle's `+` in f32 of the same values, rounded once to the dtype:
/// f32 exact to 1e-6, bf16 within one ulp (a composed bf16 sum rounds after every term).
fn add_case(dev: &Device, dtype: DType) {
    let shape = [3, 7, 41]; // 861 elements: 107 packs of 8 and a tail of 5 on the GPU
    let (a, b, c) = (rand(&shape, 41, 3.0, dtype, dev), rand(&shape, 42, 1.0, dtype, dev), rand(&shape, 43, 0.5, dtype, dev));
    let f = |t: &Tensor| t.to_dtype(DType::F32).unwrap();
    let want2 = (f(&a) + f(&b)).unwrap().to_dtype(dtype).unwrap();
    let want3 = ((f(&a) + f(&b)).unwrap() + f(&c)).unwrap().to_dtype(dtype).unwrap();
    let tag = format!("{:?} {dtype:?}", dev.location());
    let (rt, at) = if dtype == DType::F32 { (1e-6, 1e-7) } else { (8e-3, 0.0) };
    assert_close(&format!("add a+b {tag}"), &add(&a, &b, None).unwrap(), &want2, rt, at);
    assert_close(&format!("add a+b+c {tag}"), &add(&a, &b, Some(&c)).unwrap(), &want3, rt, at);
    // rows 2..5 of a [1, 9, 41] buffer (a view one row in: 41 elements, not 16-byte aligned)
    let (n, h) = (3, 41);
    let buf = rand(&[1, 9, h], 44, 1.0, dtype, dev);
    let before = vec32(&buf);
    let dst = buf.narrow(1, 2, n).unwrap().reshape((n, h)).unwrap();
    let (x, y) = (rand(&[n, h], 45, 2.0, dtype, dev), rand(&[n, h], 46, 2.0, dtype, dev));
    add_into(&dst, &x, &y).unwrap();
    let after = vec32(&buf);
    let want = vec32(&(f(&x) + f(&y)).unwrap().to_dtype(dtype).unwrap());
    for (i, (&got, &old)) in after.iter().zip(&before).enumerate() {
        match i.checked_sub(2 * h).filter(|&k| k < n * h) {
            Some(k) => assert!((got - want[k]).abs() <= rt * want[k].abs() + 1e-7, "add_into {tag}: element {i}: {got} vs {}", want[k]),
            None => assert_eq!(got.to_bits(), old.to_bits(), "add_into {tag}: element {i} outside the rows changed"),
        }
    }
    // bad input: shapes, dtypes, a destination that is an input
    assert!(add(&a, &b.narrow(2, 0, 40).unwrap().contiguous().unwrap(), None).is_err());
    assert!(add(&a, &b.to_dtype(DType::F16).unwrap(), None).is_err());
    assert!(add_into(&x, &x, &y).is_err());
}

#[test]
fn add_cpu() {
    add_case(&Device::Cpu, DType::F32);
    add_case(&Device::Cpu, DType::BF16);
}

// ---------------------------------------------------------------- Gemma: (1 + w) RMSNorm, GeGLU-tanh

/// transformers' `Gemma3RMSNorm`, written out: f32 math, `· (1 + w)`, cast last.
fn rms_1p_ref(x: &Tensor, w: &Tensor, eps: f64) -> Result<Tensor> {
    let x32 = x.to_dtype(DType::F32)?;
    let inv = (x32.sqr()?.mean_keepdim(D::Minus1)? + eps)?.sqrt()?.recip()?;
    x32.broadcast_mul(&inv)?.broadcast_mul(&(w.to_dtype(DType::F32)? + 1.0)?)?.to_dtype(x.dtype())
}

fn gemma_case(dev: &Device, dtype: DType) {
    let (n, h, eps) = (37, 83, 1e-6);
    let tag = format!("{:?} {dtype:?}", dev.location());
    let xs = rand(&[n, h], 41, 2.0, dtype, dev);
    let w = rand(&[h], 42, 0.5, dtype, dev); // centred on 0: the norm scales by 1 + w
    let dy = rand(&[n, h], 43, 1.0, dtype, dev);
    let dres = rand(&[n, h], 44, 1.0, dtype, dev);
    let (y, rstd) = rms_norm_1p_fwd(&xs, &w, eps).unwrap();
    let (rt, at) = tol(dtype, true);
    assert_close(&format!("gemma rmsnorm fwd {tag}"), &y, &rms_1p_ref(&xs, &w, eps).unwrap(), rt, at);
    let xv = Var::from_tensor(&xs.to_dtype(DType::F32).unwrap()).unwrap();
    let wv = Var::from_tensor(&w.to_dtype(DType::F32).unwrap()).unwrap();
    let yr = rms_1p_ref(xv.as_tensor(), wv.as_tensor(), eps).unwrap();
    let grads = yr.mul(&dy.to_dtype(DType::F32).unwrap()).unwrap().sum_all().unwrap().backward().unwrap();
    let (dx, dw) = rms_norm_1p_bwd(&dy, &xs, &w, &rstd, Some(&dres)).unwrap();
    let (rt, at) = tol(dtype, false);
    let want_dx = (grads.get(xv.as_tensor()).unwrap() + dres.to_dtype(DType::F32).unwrap()).unwrap();
    assert_close(&format!("gemma rmsnorm bwd dx+dres {tag}"), &dx, &want_dx, rt, at);
    assert_close(&format!("gemma rmsnorm bwd dw {tag}"), &dw, grads.get(wv.as_tensor()).unwrap(), rt, at);

    // GeGLU-tanh against Candle's `gelu` (the tanh approximation) and its autograd.
    let shape = [3, 7, 41];
    let g = rand(&shape, 45, 4.0, dtype, dev);
    let u = rand(&shape, 46, 2.0, dtype, dev);
    let (rt, at) = tol(dtype, true);
    let want = g.to_dtype(DType::F32).unwrap().gelu().unwrap().mul(&u.to_dtype(DType::F32).unwrap()).unwrap();
    assert_close(&format!("geglu fwd {tag}"), &geglu_tanh_fwd(&g, &u).unwrap(), &want, rt, at);
    let dout = rand(&shape, 47, 1.0, dtype, dev);
    let gv = Var::from_tensor(&g.to_dtype(DType::F32).unwrap()).unwrap();
    let uv = Var::from_tensor(&u.to_dtype(DType::F32).unwrap()).unwrap();
    let yr = gv.as_tensor().gelu().unwrap().mul(uv.as_tensor()).unwrap();
    let grads = yr.mul(&dout.to_dtype(DType::F32).unwrap()).unwrap().sum_all().unwrap().backward().unwrap();
    let (dg, du) = geglu_tanh_bwd(&dout, &g, &u).unwrap();
    let (rt, at) = tol(dtype, false);
    assert_close(&format!("geglu bwd dgate {tag}"), &dg, grads.get(gv.as_tensor()).unwrap(), rt, at);
    assert_close(&format!("geglu bwd dup {tag}"), &du, grads.get(uv.as_tensor()).unwrap(), rt, at);
}

#[test]
fn gemma_ops_cpu() {
    gemma_case(&Device::Cpu, DType::F32);
    gemma_case(&Device::Cpu, DType::BF16);
}

// ---------------------------------------------------------------- cross-entropy

fn targets(n: usize, v: usize, dev: &Device) -> (Tensor, Vec<i64>) {
    let t: Vec<i64> = (0..n).map(|i| if i % 5 == 3 { -100 } else { ((i * 7919 + 3) % v) as i64 }).collect();
    (Tensor::from_vec(t.clone(), n, dev).unwrap(), t)
}

/// `scale · Σ` over counted rows of `candle_nn::loss::cross_entropy` (a mean over the
/// rows it is given: the counted rows are selected first), with its autograd gradient.
fn ce_ref(logits: &Tensor, t: &[i64], scale: f64) -> (Tensor, Tensor) {
    let dev = logits.device();
    let keep: Vec<u32> = t.iter().enumerate().filter(|(_, &x)| x >= 0).map(|(i, _)| i as u32).collect();
    let kept_t: Vec<u32> = keep.iter().map(|&i| t[i as usize] as u32).collect();
    let lv = Var::from_tensor(&logits.to_dtype(DType::F32).unwrap()).unwrap();
    let idx = Tensor::from_vec(keep.clone(), keep.len(), dev).unwrap();
    let sel = lv.as_tensor().index_select(&idx, 0).unwrap();
    let mean = candle_nn::loss::cross_entropy(&sel, &Tensor::from_vec(kept_t, keep.len(), dev).unwrap()).unwrap();
    let total = (mean * keep.len() as f64).unwrap();
    let grads = (&total * scale).unwrap().backward().unwrap();
    (total, grads.get(lv.as_tensor()).unwrap().clone())
}

fn ce_case(dev: &Device, dtype: DType) {
    let (n, v, scale) = (23, 300, 0.37);
    let logits = rand(&[n, v], 41, 6.0, dtype, dev);
    let (t, tv) = targets(n, v, dev);
    let grad = logits.copy().unwrap();
    let loss = cross_entropy_inplace(&grad, &t, scale).unwrap();
    let (total, gref) = ce_ref(&logits, &tv, scale);
    let tag = format!("{:?} {dtype:?}", dev.location());
    let (rt, at) = tol(dtype, false);
    assert_close(&format!("ce loss sum {tag}"), &loss.sum_all().unwrap(), &total, 1e-5, 0.0);
    for (i, (l, &ti)) in vec32(&loss).iter().zip(&tv).enumerate() {
        if ti < 0 {
            assert_eq!(*l, 0.0, "ignored row {i} has loss {l}");
        }
    }
    assert_close(&format!("ce dlogits {tag}"), &grad, &gref, rt, at);
}

#[test]
fn cross_entropy_cpu() {
    ce_case(&Device::Cpu, DType::F32);
    ce_case(&Device::Cpu, DType::BF16);
    // a target outside the vocabulary is an error on the CPU, not a panic
    let l = Tensor::zeros((2, 4), DType::F32, &Device::Cpu).unwrap();
    let t = Tensor::new(&[1i64, 4], &Device::Cpu).unwrap();
    assert!(cross_entropy_inplace(&l, &t, 1.0).unwrap_err().to_string().contains("not below the vocabulary"));
}

/// At a real vocabulary (SmolLM2's 49,152) and a trained model's peaked rows (the target's
/// logit 12 above logits in [-2, 2]: loss about 0.44, the way a real model's tokens are
/// small losses over a long tail), the loss matches an f64 reference to 1e-6 relative per
/// row. A sequential f32 sum of the exponentials was 1e-5 to 1e-4 off here (4.8e-5 on
/// SmolLM2's own logits).
#[test]
fn cross_entropy_cpu_large_vocabulary_against_f64() {
    let (n, v) = (8, 49_152);
    let tv: Vec<i64> = (0..n).map(|i| ((i * 12_345 + 11) % v) as i64).collect();
    let mut x = vec32(&rand(&[n, v], 77, 2.0, DType::F32, &Device::Cpu));
    for (i, &t) in tv.iter().enumerate() {
        x[i * v + t as usize] = 12.0;
    }
    let logits = Tensor::from_vec(x.clone(), (n, v), &Device::Cpu).unwrap();
    let loss = vec32(&cross_entropy_inplace(&logits, &Tensor::from_vec(tv.clone(), n, &Device::Cpu).unwrap(), 1.0).unwrap());
    for (i, row) in x.chunks(v).enumerate() {
        let m = row.iter().fold(f64::NEG_INFINITY, |m, &a| m.max(a as f64));
        let lse = m + row.iter().map(|&a| (a as f64 - m).exp()).sum::<f64>().ln();
        let want = lse - row[tv[i] as usize] as f64;
        let rel = ((loss[i] as f64 - want) / want).abs();
        assert!(rel <= 1e-6, "row {i}: loss {} vs f64 {want}: {rel:.2e} relative (allowed 1e-6)", loss[i]);
    }
}

fn linear_ce_case(dev: &Device, dtype: DType) {
    let (b, s, h, v, scale) = (2, 19, 32, 150, 1.0 / 30.0);
    let hid = rand(&[b, s, h], 51, 1.0, dtype, dev);
    let w = rand(&[v, h], 52, 0.5, dtype, dev);
    let (t, tv) = targets(b * s, v, dev);
    let t = t.reshape((b, s)).unwrap();
    let acc = Tensor::zeros((v, h), DType::F32, dev).unwrap();
    let out = linear_cross_entropy(&hid, &w, &t, scale, 8, Some(&acc)).unwrap();
    // f32 autograd of lm_head + cross-entropy on the same values
    let hv = Var::from_tensor(&hid.to_dtype(DType::F32).unwrap()).unwrap();
    let wv = Var::from_tensor(&w.to_dtype(DType::F32).unwrap()).unwrap();
    let logits = hv.as_tensor().reshape((b * s, h)).unwrap().matmul(&wv.as_tensor().t().unwrap()).unwrap();
    let keep: Vec<u32> = tv.iter().enumerate().filter(|(_, &x)| x >= 0).map(|(i, _)| i as u32).collect();
    let kept_t: Vec<u32> = keep.iter().map(|&i| tv[i as usize] as u32).collect();
    let sel = logits.index_select(&Tensor::from_vec(keep.clone(), keep.len(), dev).unwrap(), 0).unwrap();
    let mean = candle_nn::loss::cross_entropy(&sel, &Tensor::from_vec(kept_t, keep.len(), dev).unwrap()).unwrap();
    let total = (mean * keep.len() as f64).unwrap();
    let grads = (&total * scale).unwrap().backward().unwrap();
    let tag = format!("{:?} {dtype:?}", dev.location());
    let (rt, at) = tol(dtype, false);
    let lrt = if dtype == DType::F32 { 1e-5 } else { 1e-2 };
    assert_close(&format!("linear ce loss {tag}"), &out.loss_sum, &total, lrt, 0.0);
    assert_eq!(out.loss.dims(), &[b, s]);
    assert_close(&format!("linear ce dhidden {tag}"), &out.dhidden, grads.get(hv.as_tensor()).unwrap(), rt, at);
    assert_close(&format!("linear ce dweight {tag}"), &out.dweight, grads.get(wv.as_tensor()).unwrap(), rt, at);
    assert_close(&format!("linear ce accumulates in place {tag}"), &acc, &out.dweight, 0.0, 0.0);
}

#[test]
fn linear_cross_entropy_cpu() {
    linear_ce_case(&Device::Cpu, DType::F32);
    linear_ce_case(&Device::Cpu, DType::BF16);
}

// ---------------------------------------------------------------- AdamW

struct Hp {
    lr: f64,
    b1: f64,
    b2: f64,
    eps: f64,
    wd: f64,
}
const HP: Hp = Hp { lr: 1e-2, b1: 0.9, b2: 0.95, eps: 1e-8, wd: 0.1 };

fn step(t: u64, gscale: f64) -> AdamWStep {
    AdamWStep { lr: HP.lr, beta1: HP.b1, beta2: HP.b2, eps: HP.eps, weight_decay: HP.wd, step: t, grad_scale: gscale }
}

/// src/train/optim.rs's `AdamW::update` loop, transcribed (f32, same operation order).
#[allow(clippy::too_many_arguments)]
fn optim_rs_f32(w: &mut [f32], m: &mut [f32], v: &mut [f32], g: &[f32], dec: &[bool], t: u64, gscale: f32) {
    let (b1, b2) = (HP.b1 as f32, HP.b2 as f32);
    let bc1 = 1.0 - HP.b1.powi(t as i32);
    let bc2 = 1.0 - HP.b2.powi(t as i32);
    let step_size = (HP.lr / bc1) as f32;
    let bc2_sqrt = bc2.sqrt() as f32;
    let (eps, wd_lr) = (HP.eps as f32, (HP.lr * HP.wd) as f32);
    for i in 0..w.len() {
        let gi = g[i] * gscale;
        m[i] = b1 * m[i] + (1.0 - b1) * gi;
        v[i] = b2 * v[i] + (1.0 - b2) * gi * gi;
        let denom = v[i].sqrt() / bc2_sqrt + eps;
        if dec[i] {
            w[i] -= wd_lr * w[i];
        }
        w[i] -= step_size * m[i] / denom;
    }
}

/// Runs 4 steps of the fused op on `dev`; returns (params, m, v, bf16 copy) as f32 vectors.
fn adamw_run(dev: &Device, n: usize, w0: &[f32], gs: &[Vec<f32>], dec: &[bool], gscale: f64) -> [Vec<f32>; 4] {
    let w = Tensor::from_slice(w0, n, dev).unwrap();
    let m = Tensor::zeros(n, DType::F32, dev).unwrap();
    let v = Tensor::zeros(n, DType::F32, dev).unwrap();
    let copy = Tensor::zeros(n, DType::BF16, dev).unwrap();
    let d: Vec<u8> = dec.iter().map(|&x| x as u8).collect();
    let d = Tensor::from_vec(d, n, dev).unwrap();
    for (t, g) in gs.iter().enumerate() {
        let g = Tensor::from_slice(g, n, dev).unwrap();
        adamw_step(&w, &g, &m, &v, Some(&d), &step(t as u64 + 1, gscale), Some(&copy)).unwrap();
    }
    [vec32(&w), vec32(&m), vec32(&v), vec32(&copy)]
}

fn adamw_inputs(n: usize) -> (Vec<f32>, Vec<Vec<f32>>, Vec<bool>) {
    let w0 = vec32(&rand(&[n], 61, 1.0, DType::F32, &Device::Cpu));
    let gs = (0..4).map(|t| vec32(&rand(&[n], 62 + t, 0.3, DType::F32, &Device::Cpu))).collect();
    let dec = (0..n).map(|i| i % 3 != 0).collect();
    (w0, gs, dec)
}

#[test]
fn adamw_cpu() {
    let n = 40_000; // more than one rayon chunk of the twin
    let gscale = 0.75;
    let (w0, gs, dec) = adamw_inputs(n);
    let [w, m, v, copy] = adamw_run(&Device::Cpu, n, &w0, &gs, &dec, gscale);
    // bit-exact against optim.rs's f32 loop
    let (mut rw, mut rm, mut rv) = (w0.clone(), vec![0f32; n], vec![0f32; n]);
    for (t, g) in gs.iter().enumerate() {
        optim_rs_f32(&mut rw, &mut rm, &mut rv, g, &dec, t as u64 + 1, gscale as f32);
    }
    assert_eq!(w, rw, "params differ from optim.rs's loop");
    assert_eq!(m, rm);
    assert_eq!(v, rv);
    for (c, x) in copy.iter().zip(&w) {
        assert_eq!(*c, half::bf16::from_f32(*x).to_f32());
    }
    // within 1e-6 of a naive f64 AdamW (decoupled weight decay)
    let mut worst = 0f64;
    for i in 0..n {
        let (mut wi, mut mi, mut vi) = (w0[i] as f64, 0f64, 0f64);
        for (t, g) in gs.iter().enumerate() {
            let t = t as i32 + 1;
            let gi = g[i] as f64 * gscale;
            mi = HP.b1 * mi + (1.0 - HP.b1) * gi;
            vi = HP.b2 * vi + (1.0 - HP.b2) * gi * gi;
            let upd = (mi / (1.0 - HP.b1.powi(t))) / ((vi / (1.0 - HP.b2.powi(t))).sqrt() + HP.eps);
            wi -= HP.lr * (upd + if dec[i] { HP.wd * wi } else { 0.0 });
        }
        worst = worst.max((w[i] as f64 - wi).abs());
    }
    eprintln!("adamw cpu vs f64: max |err| {worst:.3e}");
    assert!(worst < 1e-6, "adamw vs f64 loop: {worst}");
}

#[test]
fn accumulate_cpu() {
    let acc = rand(&[5, 9], 71, 1.0, DType::F32, &Device::Cpu);
    let want = vec32(&acc);
    let x = rand(&[5, 9], 72, 1.0, DType::BF16, &Device::Cpu);
    accumulate_f32(&acc, &x, -0.5).unwrap();
    let got = vec32(&acc);
    for ((g, w), x) in got.iter().zip(&want).zip(vec32(&x)) {
        assert_eq!(*g, w + -0.5 * x);
    }
}

/// The embedding's gradient rows against Candle's `index_add` on the CPU of the f32 rows
/// times the scale (ids repeating, as tokens do): exact on the CPU (rows added in order, as
/// `index_add` does), within f32 reordering on the GPU (atomics); a view of a larger
/// buffer as the engine's slot is. (The reference runs on the CPU: Candle 0.11's CUDA
/// `index_add` indexes its fresh output with the input's offset and panics on such a view.)
fn embed_grad_case(dev: &Device, dtype: DType, (n, v, h): (usize, usize, usize), tol: f32) {
    let flat = rand(&[3 + v * h + 4], 140, 1.0, DType::F32, dev);
    let slot = flat.narrow(0, 3, v * h).unwrap().reshape((v, h)).unwrap();
    let before = vec32(&flat);
    let ids: Vec<u32> = (0..n).map(|r| ((r * 7 + r / 3) % (v - 1)) as u32).collect();
    let ids = Tensor::from_vec(ids, n, &Device::Cpu).unwrap().to_device(dev).unwrap();
    let g = rand(&[n, h], 141, 1.0, dtype, dev);
    let c = |t: &Tensor| t.to_device(&Device::Cpu).unwrap();
    let want = c(&slot).copy().unwrap().index_add(&c(&ids), &(c(&g).to_dtype(DType::F32).unwrap() * 0.75).unwrap(), 0).unwrap();
    embedding_grad_add(&slot, &ids, &g, 0.75).unwrap();
    let tag = format!("embedding_grad_add {dtype:?} ({n}, {v}, {h}) on {:?}", dev.location());
    assert_close(&tag, &c(&slot), &want, 0.0, tol);
    let after = vec32(&flat);
    assert_eq!(&after[..3], &before[..3], "{tag}: wrote before its view");
    assert_eq!(&after[3 + v * h..], &before[3 + v * h..], "{tag}: wrote past its view");
}

/// `acc [o, i] += alpha · dyᵀ · x` against the composed f32 ops (`dy`, `x` of `dtype`;
/// a view into a larger f32 buffer as the engine's gradient slots are).
fn matmul_acc_case(dev: &Device, dtype: DType, (n, o, i): (usize, usize, usize)) {
    let flat = rand(&[7 + o * i + 5], 110, 1.0, DType::F32, dev);
    let acc = flat.narrow(0, 7, o * i).unwrap().reshape((o, i)).unwrap();
    let before = flat.copy().unwrap();
    let (dy, x) = (rand(&[n, o], 111, 1.0, dtype, dev), rand(&[n, i], 112, 1.0, dtype, dev));
    let f = |t: &Tensor| t.to_dtype(DType::F32).unwrap();
    let want = (acc.copy().unwrap() + (f(&dy).t().unwrap().matmul(&f(&x)).unwrap() * -0.5).unwrap()).unwrap();
    matmul_acc_f32(&acc, &dy, &x, -0.5).unwrap();
    // f32 sums over n rows in another order (the GEMM's blocking): n·ε relative to the terms.
    assert_close(&format!("matmul_acc {dtype:?} on {dev:?}"), &acc, &want, 1e-5, 1e-5 * n as f32);
    let (b, a) = (vec32(&before), vec32(&flat));
    assert_eq!(&a[..7], &b[..7], "matmul_acc wrote before its view");
    assert_eq!(&a[7 + o * i..], &b[7 + o * i..], "matmul_acc wrote past its view");
}

/// `dst ← a·op(b) (+ dst)` against the composed f32 ops rounded once (`a`, `b`, `dst` of
/// `dtype`; `dst` rows of a larger buffer, as the engine's whole-sequence buffers are): on
/// the CPU exact (the twin is that composition), on the GPU within `tol` relative to the
/// largest element (the f32 sums over `k` reorder, which may flip a rounding).
fn matmul_into_case(dev: &Device, dtype: DType, (n, k, o): (usize, usize, usize), tol: f32) {
    let a = rand(&[n, k], 130, 1.0, dtype, dev);
    let f = |t: &Tensor| t.to_dtype(DType::F32).unwrap();
    for (rhs, b) in [(Rhs::Transposed, rand(&[o, k], 131, 1.0, dtype, dev)), (Rhs::AsIs, rand(&[k, o], 132, 1.0, dtype, dev))] {
        let prod = match rhs {
            Rhs::Transposed => f(&a).matmul(&f(&b).t().unwrap()).unwrap(),
            Rhs::AsIs => f(&a).matmul(&f(&b)).unwrap(),
        };
        for accumulate in [false, true] {
            let whole = rand(&[n + 3, o], 133, 1.0, dtype, dev);
            let before = vec32(&whole);
            let dst = whole.narrow(0, 1, n).unwrap();
            let want = match accumulate {
                true => (&prod + f(&dst)).unwrap().to_dtype(dtype).unwrap(),
                false => prod.to_dtype(dtype).unwrap(),
            };
            let start = vec32(&dst);
            matmul_into(&dst, &a, &b, rhs, accumulate).unwrap();
            let tag = format!("matmul_into {rhs:?} accumulate {accumulate} {dtype:?} ({n}, {k}, {o}) on {:?}", dev.location());
            assert_close(&tag, &dst, &want, 0.0, tol);
            if n * k * o <= 1 << 16 {
                // and against a naive f64 loop over the same values: within one rounding to
                // the dtype (bf16: 2⁻⁸ relative) plus f32's error over k terms
                let (av, bv) = (vec32(&a), vec32(&b));
                let naive: Vec<f32> = (0..n * o)
                    .map(|e| {
                        let (r, c) = (e / o, e % o);
                        let dot: f64 = (0..k)
                            .map(|j| {
                                av[r * k + j] as f64
                                    * match rhs {
                                        Rhs::Transposed => bv[c * k + j] as f64,
                                        Rhs::AsIs => bv[j * o + c] as f64,
                                    }
                            })
                            .sum();
                        (dot + if accumulate { start[e] as f64 } else { 0.0 }) as f32
                    })
                    .collect();
                let naive = Tensor::from_vec(naive, (n, o), &Device::Cpu).unwrap();
                let rel = if dtype == DType::F32 { 1e-6 } else { 8e-3 };
                assert_close(&format!("{tag} vs f64"), &dst.to_device(&Device::Cpu).unwrap(), &naive, rel, 1e-6 * k as f32);
            }
            let after = vec32(&whole);
            assert_eq!(&after[..o], &before[..o], "{tag}: wrote before its rows");
            assert_eq!(&after[(n + 1) * o..], &before[(n + 1) * o..], "{tag}: wrote past its rows");
        }
    }
}

#[test]
fn matmul_acc_cpu() {
    for dt in [DType::F32, DType::BF16] {
        matmul_acc_case(&Device::Cpu, dt, (37, 12, 20));
    }
    let acc = Tensor::zeros((3, 4), DType::F32, &Device::Cpu).unwrap();
    let (dy, x) = (rand(&[5, 3], 1, 1.0, DType::F32, &Device::Cpu), rand(&[6, 4], 2, 1.0, DType::F32, &Device::Cpu));
    let e = matmul_acc_f32(&acc, &dy, &x, 1.0).unwrap_err().to_string();
    assert!(e.contains("same rows"), "{e}");
}

#[test]
fn embedding_grad_add_cpu() {
    for dt in [DType::F32, DType::BF16] {
        embed_grad_case(&Device::Cpu, dt, (300, 37, 300), 0.0);
    }
    let cpu = &Device::Cpu;
    let slot = Tensor::zeros((4, 8), DType::F32, cpu).unwrap();
    let ids = Tensor::from_vec(vec![1u32, 4, 2], 3, cpu).unwrap();
    let e = embedding_grad_add(&slot, &ids, &rand(&[3, 8], 1, 1.0, DType::F32, cpu), 1.0).unwrap_err().to_string();
    assert!(e.contains("token id 4 at row 1") && e.contains("vocabulary size 4"), "{e}");
    let e = embedding_grad_add(&slot, &ids, &rand(&[3, 7], 1, 1.0, DType::F32, cpu), 1.0).unwrap_err().to_string();
    assert!(e.contains("`g`"), "{e}");
}

#[test]
fn matmul_into_cpu() {
    for dt in [DType::F32, DType::BF16] {
        matmul_into_case(&Device::Cpu, dt, (37, 20, 12), 0.0);
    }
    let cpu = &Device::Cpu;
    let (a, b) = (rand(&[5, 3], 1, 1.0, DType::F32, cpu), rand(&[4, 6], 2, 1.0, DType::F32, cpu));
    let dst = Tensor::zeros((5, 4), DType::F32, cpu).unwrap();
    let e = matmul_into(&dst, &a, &b, Rhs::Transposed, false).unwrap_err().to_string();
    assert!(e.contains("do not multiply") && e.contains("[4, 6]"), "{e}");
    let sq = rand(&[4, 4], 3, 1.0, DType::F32, cpu);
    let e = matmul_into(&sq, &sq, &rand(&[4, 4], 4, 1.0, DType::F32, cpu), Rhs::AsIs, true).unwrap_err().to_string();
    assert!(e.contains("share storage"), "{e}");
    let e = matmul_into(&dst, &rand(&[5, 4], 5, 1.0, DType::BF16, cpu), &sq, Rhs::AsIs, false).unwrap_err().to_string();
    assert!(e.contains("dst") && e.contains("BF16"), "{e}");
}

// ---------------------------------------------------------------- reductions

/// `Σ x²` against a sequential f64 loop over the same (dtype-rounded) values: the sums
/// reorder in f64 only, so within 1e-12 relative; the non-finite count against a plain
/// count, NaN and ±∞ placed at the ends and the middle.
fn reductions_case(dev: &Device, dtype: DType, n: usize) {
    let x = rand(&[n], 120, 3.0, dtype, dev);
    let want: f64 = vec32(&x).iter().map(|&v| (v as f64) * (v as f64)).sum();
    let got = sum_squares(&x).unwrap();
    assert!((got - want).abs() <= 1e-12 * want, "sum_squares {dtype:?} n={n} on {dev:?}: {got} vs {want}");
    assert_eq!(sum_squares(&x).unwrap().to_bits(), got.to_bits(), "sum_squares not deterministic");
    // The partial sums left on the device add up, in order, to the same bits.
    let parts = sum_squares_partials(&x).unwrap();
    assert!(parts.device().same_device(dev) && parts.dtype() == DType::F64, "partials on {:?} as {:?}", parts.device(), parts.dtype());
    let summed: f64 = parts.to_vec1::<f64>().unwrap().iter().sum();
    assert_eq!(summed.to_bits(), got.to_bits(), "sum_squares_partials {dtype:?} n={n} on {dev:?}: {summed} vs {got}");
    let mut v = vec32(&x);
    let bad = [0, n / 2, n - 1];
    v[bad[0]] = f32::NAN;
    v[bad[1]] = f32::INFINITY;
    v[bad[2]] = f32::NEG_INFINITY;
    let y = Tensor::from_vec(v, n, &Device::Cpu).unwrap().to_dtype(dtype).unwrap().to_device(dev).unwrap();
    let counts = count_non_finite(&[x.clone(), y.clone(), y.narrow(0, 1, n - 2).unwrap().contiguous().unwrap()]).unwrap();
    assert_eq!(counts, vec![0, 3, 1], "count_non_finite {dtype:?} n={n} on {dev:?}");
    assert!(sum_squares(&y).unwrap().is_nan() || sum_squares(&y).unwrap().is_infinite());
}

#[test]
fn reductions_cpu() {
    for dt in [DType::F32, DType::BF16, DType::F16] {
        reductions_case(&Device::Cpu, dt, 100_003);
        reductions_case(&Device::Cpu, dt, 5);
    }
    assert_eq!(sum_squares(&Tensor::zeros(0, DType::F32, &Device::Cpu).unwrap()).unwrap(), 0.0);
    let none = sum_squares_partials(&Tensor::zeros(0, DType::F32, &Device::Cpu).unwrap()).unwrap();
    assert_eq!(none.to_vec1::<f64>().unwrap(), [0.0]);
    assert!(count_non_finite(&[]).unwrap().is_empty());
    let xt = rand(&[4, 8], 121, 1.0, DType::F32, &Device::Cpu).t().unwrap();
    assert!(sum_squares(&xt).unwrap_err().to_string().contains("contiguous"));
}

// ---------------------------------------------------------------- argument checks

#[test]
fn bad_arguments_are_errors() {
    let dev = Device::Cpu;
    let x = rand(&[4, 8], 81, 1.0, DType::F32, &dev);
    let w = rand(&[8], 82, 1.0, DType::F32, &dev);
    let xt = x.t().unwrap(); // [8, 4], not contiguous
    let w4 = rand(&[4], 83, 1.0, DType::F32, &dev);
    let e = rms_norm_fwd(&xt, None, &w4, 1e-5).unwrap_err().to_string();
    assert!(e.contains("contiguous"), "{e}");
    let e = rms_norm_fwd(&x, None, &w.to_dtype(DType::BF16).unwrap(), 1e-5).unwrap_err().to_string();
    assert!(e.contains("weight"), "{e}");
    let e = swiglu_fwd(&x, &x.to_dtype(DType::F64).unwrap()).unwrap_err().to_string();
    assert!(e.contains("up"), "{e}");
    let e = swiglu_fwd(&x.to_dtype(DType::F64).unwrap(), &x.to_dtype(DType::F64).unwrap()).unwrap_err().to_string();
    assert!(e.contains("F64"), "{e}");
    let q = rand(&[1, 4, 2, 8], 84, 1.0, DType::F32, &dev);
    let (c, s) = rope_tables(&[0, 1, 2], 1, 3, 8, DType::F32, &dev);
    assert!(rope_fwd_inplace(&q, &c, &s).is_err());
    let p = Tensor::zeros(8, DType::F32, &dev).unwrap();
    let e = adamw_step(&p, &p, &p.zeros_like().unwrap(), &p.zeros_like().unwrap(), None, &step(1, 1.0), None).unwrap_err().to_string();
    assert!(e.contains("share storage"), "{e}");
    let g = p.zeros_like().unwrap();
    let e = adamw_step(&p, &g, &p.zeros_like().unwrap(), &p.zeros_like().unwrap(), None, &step(0, 1.0), None).unwrap_err().to_string();
    assert!(e.contains("step"), "{e}");
}

// ---------------------------------------------------------------- CUDA: kernels vs CPU twins and composed ops on the GPU

#[cfg(feature = "cuda")]
mod cuda {
    use super::*;

    fn gpu() -> Option<Device> {
        match Device::new_cuda(0) {
            Ok(d) => Some(d),
            Err(e) => {
                eprintln!("no CUDA device ({e}); CUDA test skipped");
                None
            }
        }
    }

    fn cpu(t: &Tensor) -> Tensor {
        t.to_device(&Device::Cpu).unwrap()
    }

    /// The CUDA kernel against the CPU twin on the same inputs: f32 within 1e-5, bf16 within
    /// one bf16 ulp (the f32 sums inside reorder, which may flip a rounding).
    fn twin_tol(dtype: DType) -> (f32, f32) {
        if dtype == DType::F32 {
            (1e-5, 1e-6)
        } else {
            (8e-3, 1e-3)
        }
    }

    #[test]
    fn cuda_rmsnorm() {
        let Some(g) = gpu() else { return };
        for dt in [DType::F32, DType::BF16] {
            rmsnorm_fwd_case(&g, dt);
            rmsnorm_bwd_case(&g, dt);
            let (n, h) = (300, 2048);
            let x = rand(&[n, h], 91, 2.0, dt, &g);
            let r = rand(&[n, h], 92, 1.0, dt, &g);
            let w = (rand(&[h], 93, 0.5, DType::F32, &g) + 1.0).unwrap().to_dtype(dt).unwrap();
            let dy = rand(&[n, h], 94, 1.0, dt, &g);
            let og = rms_norm_fwd(&x, Some(&r), &w, 1e-5).unwrap();
            let oc = rms_norm_fwd(&cpu(&x), Some(&cpu(&r)), &cpu(&w), 1e-5).unwrap();
            let (rt, at) = twin_tol(dt);
            assert_close(&format!("cuda vs twin rmsnorm y {dt:?}"), &cpu(&og.y), &oc.y, rt, at);
            assert_close(&format!("cuda vs twin rmsnorm x_sum {dt:?}"), &cpu(&og.x_sum), &oc.x_sum, 0.0, 0.0);
            assert_close(&format!("cuda vs twin rmsnorm rstd {dt:?}"), &cpu(&og.rstd), &oc.rstd, 1e-5, 0.0);
            // the same rstd on both sides: a different last bit of r may flip a bf16 rounding of n
            let bg = rms_norm_bwd(&dy, &og.x_sum, &w, &oc.rstd.to_device(&g).unwrap(), Some(&r)).unwrap();
            let bc = rms_norm_bwd(&cpu(&dy), &oc.x_sum, &cpu(&w), &oc.rstd, Some(&cpu(&r))).unwrap();
            assert_close(&format!("cuda vs twin rmsnorm dx {dt:?}"), &cpu(&bg.dx), &bc.dx, rt, at);
            assert_close(&format!("cuda vs twin rmsnorm dw {dt:?}"), &cpu(&bg.dweight), &bc.dweight, 1e-4, 1e-5);
        }
    }

    /// The composed Gemma ops on the GPU against the same references (any device).
    #[test]
    fn cuda_gemma_ops() {
        if let Some(dev) = gpu() {
            super::gemma_case(&dev, DType::F32);
            super::gemma_case(&dev, DType::BF16);
        }
    }

    #[test]
    fn cuda_rope() {
        let Some(g) = gpu() else { return };
        for d in [16, 12] {
            rope_case(&g, DType::F32, DType::F32, d);
            rope_case(&g, DType::BF16, DType::BF16, d);
            rope_case(&g, DType::BF16, DType::F32, d);
        }
        let (b, s, heads, d) = (1, 64, 4, 64);
        for dt in [DType::F32, DType::BF16] {
            let x = rand(&[b, s, heads, d], 95, 1.0, dt, &g);
            let (c, sn) = rope_tables(&positions(b, s), b, s, d, dt, &g);
            let (xg, xc) = (x.copy().unwrap(), cpu(&x));
            rope_fwd_inplace(&xg, &c, &sn).unwrap();
            rope_fwd_inplace(&xc, &cpu(&c), &cpu(&sn)).unwrap();
            assert_close(&format!("cuda vs twin rope {dt:?}"), &cpu(&xg), &xc, 1e-6, 1e-6);
        }
    }

    #[test]
    fn cuda_add() {
        let Some(g) = gpu() else { return };
        for dt in [DType::F32, DType::BF16] {
            super::add_case(&g, dt);
            let (a, b, c) = (rand(&[64, 4096], 47, 3.0, dt, &g), rand(&[64, 4096], 48, 1.0, dt, &g), rand(&[64, 4096], 49, 1.0, dt, &g));
            let got = add(&a, &b, Some(&c)).unwrap();
            let want = add(&cpu(&a), &cpu(&b), Some(&cpu(&c))).unwrap();
            assert_close(&format!("cuda vs twin add {dt:?}"), &cpu(&got), &want, 0.0, 0.0);
        }
    }

    #[test]
    fn cuda_swiglu() {
        let Some(g) = gpu() else { return };
        for dt in [DType::F32, DType::BF16] {
            swiglu_case(&g, dt);
            let (ga, u, d) = (rand(&[64, 5632], 96, 4.0, dt, &g), rand(&[64, 5632], 97, 2.0, dt, &g), rand(&[64, 5632], 98, 1.0, dt, &g));
            let (rt, at) = twin_tol(dt);
            assert_close(
                &format!("cuda vs twin swiglu fwd {dt:?}"),
                &cpu(&swiglu_fwd(&ga, &u).unwrap()),
                &swiglu_fwd(&cpu(&ga), &cpu(&u)).unwrap(),
                rt,
                at,
            );
            let (dg, du) = swiglu_bwd(&d, &ga, &u).unwrap();
            let (cg, cu) = swiglu_bwd(&cpu(&d), &cpu(&ga), &cpu(&u)).unwrap();
            assert_close(&format!("cuda vs twin swiglu dgate {dt:?}"), &cpu(&dg), &cg, rt, at);
            assert_close(&format!("cuda vs twin swiglu dup {dt:?}"), &cpu(&du), &cu, rt, at);
            // a view starting one element into its buffer: not 16-byte aligned, one-element path
            let big = rand(&[1001], 102, 3.0, dt, &g);
            let (gm, um) = (big.narrow(0, 1, 1000).unwrap(), rand(&[1000], 103, 1.0, dt, &g));
            let want = swiglu_fwd(&cpu(&gm), &cpu(&um)).unwrap();
            assert_close(&format!("cuda vs twin swiglu fwd, unaligned {dt:?}"), &cpu(&swiglu_fwd(&gm, &um).unwrap()), &want, rt, at);
        }
    }

    #[test]
    fn cuda_cross_entropy() {
        let Some(g) = gpu() else { return };
        for dt in [DType::F32, DType::BF16] {
            ce_case(&g, dt);
            linear_ce_case(&g, dt);
            let (n, v) = (64, 32000);
            let logits = rand(&[n, v], 99, 8.0, dt, &g);
            let (t, _) = targets(n, v, &g);
            let (lg, lc) = (logits.copy().unwrap(), cpu(&logits));
            let a = cross_entropy_inplace(&lg, &t, 0.01).unwrap();
            let b = cross_entropy_inplace(&lc, &cpu(&t), 0.01).unwrap();
            let (rt, at) = twin_tol(dt);
            assert_close(&format!("cuda vs twin ce loss {dt:?}"), &cpu(&a), &b, 1e-5, 1e-6);
            assert_close(&format!("cuda vs twin ce dlogits {dt:?}"), &cpu(&lg), &lc, rt, at);
        }
        // out-of-range target on the GPU: NaN loss, zero gradient (documented)
        let l = Tensor::ones((2, 4), DType::F32, &g).unwrap();
        let loss = cross_entropy_inplace(&l, &Tensor::new(&[1i64, 4], &g).unwrap(), 1.0).unwrap();
        let lv = vec32(&loss);
        assert!(lv[0].is_finite() && lv[1].is_nan());
        assert_eq!(&vec32(&l)[4..], &[0.0; 4]);
    }

    #[test]
    fn cuda_adamw() {
        let Some(g) = gpu() else { return };
        let n = 1 << 20;
        let (w0, gs, dec) = adamw_inputs(n);
        let a = adamw_run(&g, n, &w0, &gs, &dec, 0.75);
        let b = adamw_run(&Device::Cpu, n, &w0, &gs, &dec, 0.75);
        for (k, name) in ["params", "m", "v", "bf16 copy"].iter().enumerate() {
            let diff = a[k].iter().zip(&b[k]).filter(|(x, y)| x != y).count();
            eprintln!("cuda vs twin adamw {name}: {diff} of {n} elements differ");
            assert_eq!(diff, 0, "adamw {name}: CUDA differs from the CPU twin");
        }
    }

    #[test]
    fn cuda_matmul_acc() {
        let Some(g) = gpu() else { return };
        for dt in [DType::F32, DType::BF16, DType::F16] {
            matmul_acc_case(&g, dt, (4096, 256, 2048));
            matmul_acc_case(&g, dt, (37, 12, 20));
        }
    }

    #[test]
    fn cuda_matmul_into() {
        let Some(g) = gpu() else { return };
        for dt in [DType::F32, DType::BF16, DType::F16] {
            // within one ulp of the dtype at the largest element (f32: the k-term sums reorder)
            let tol = if dt == DType::F32 { 1e-5 } else { 8e-3 };
            matmul_into_case(&g, dt, (4096, 256, 2048), tol);
            matmul_into_case(&g, dt, (37, 20, 12), tol);
        }
    }

    #[test]
    fn cuda_embedding_grad_add() {
        let Some(g) = gpu() else { return };
        for dt in [DType::F32, DType::BF16] {
            // each slot row sums up to ~n/v rows: f32 reordering, relative to the largest
            embed_grad_case(&g, dt, (8192, 100, 2048), 1e-5);
            embed_grad_case(&g, dt, (37, 11, 83), 1e-5);
        }
    }

    #[test]
    fn cuda_rmsnorm_bwd_into() {
        let Some(g) = gpu() else { return };
        for dt in [DType::F32, DType::BF16] {
            rmsnorm_bwd_into_case(&g, dt, (300, 2048));
            rmsnorm_bwd_into_case(&g, dt, (37, 83));
        }
    }

    #[test]
    fn cuda_accumulate() {
        let Some(g) = gpu() else { return };
        let acc = rand(&[1000, 33], 100, 1.0, DType::F32, &g);
        let want = vec32(&acc);
        let x = rand(&[1000, 33], 101, 1.0, DType::BF16, &g);
        accumulate_f32(&acc, &x, 0.25).unwrap();
        for ((a, w), x) in vec32(&acc).iter().zip(&want).zip(vec32(&x)) {
            assert_eq!(*a, w + 0.25 * x);
        }
    }

    #[test]
    fn cuda_reductions() {
        let Some(g) = gpu() else { return };
        for dt in [DType::F32, DType::BF16, DType::F16] {
            reductions_case(&g, dt, 5);
            reductions_case(&g, dt, 3_000_017);
        }
    }
}
