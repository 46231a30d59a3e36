//! GPU timing of each fused op against the composed Candle ops the engine runs today, at
//! the TinyLlama-1.1B shape in bf16: hidden 2048, intermediate 5632, 32 query / 4 kv
//! heads of dim 64, vocabulary 32000, `T` tokens (first argument, default 16384).
//! Each figure is the mean over `reps` calls between two device synchronisations, after
//! one warm-up call. "fwd+bwd" composed = the forward composition plus Candle autograd of
//! `(y·dy).sum()`, as the engine seeds its per-layer graphs.
//!
//! Shapes: `T` tokens, `h` 2048, `i` 5632, `H` heads, `d` 64, `V` 32000, `n` parameters.
//!
//! Run: `bench_kernels [tokens]` (needs the `cuda` feature and a GPU).
//!
//! Measured on one H200 (2026-11-30, commit c4743cd), ms per call, composed → fused:
//! | op | 16K tokens | 64K tokens |
//! | --- | --- | --- |
//! | RMSNorm+residual fwd | 2.05 → 0.113 | 8.00 → 0.381 |
//! | RMSNorm+residual fwd+bwd | 10.4 → 0.326 | 40.1 → 1.32 |
//! | RoPE fwd, q and k | 2.10 → 0.051 | 8.17 → 0.184 |
//! | RoPE fwd+bwd, q and k | 10.4 → 0.106 | 41.1 → 0.385 |
//! | SwiGLU fwd | 0.740 → 0.207 | 2.97 → 0.783 |
//! | SwiGLU fwd+bwd | 14.8 → 0.509 | 58.2 → 2.06 |
//! | lm_head + CE fwd+bwd, chunks of 4096 | 66.2 → 10.9 | 252 → 45.7 |
//! | CE loss+grad only, one [4096, 32000] chunk | 12.4 → 0.409 | |
//! | AdamW, 1.1B f32 shard + bf16 copy | 97.2 → 9.98 | |

use candle_core::{DType, Device, Result, Tensor, Var, D};
use longctx_kernels::*;
use std::time::Instant;

fn time(dev: &Device, reps: usize, mut f: impl FnMut() -> Result<()>) -> Result<f64> {
    f()?;
    dev.synchronize()?;
    let t = Instant::now();
    for _ in 0..reps {
        f()?;
    }
    dev.synchronize()?;
    Ok(t.elapsed().as_secs_f64() * 1e3 / reps as f64)
}

fn report(what: &str, composed: f64, fused: f64) {
    println!("{what:<44} composed {composed:>9.3} ms   fused {fused:>9.3} ms   x{:>5.2}", composed / fused);
}

/// src/model/llama.rs's `RmsNorm::forward`.
fn rms_ref(x: &Tensor, w: &Tensor, eps: f64) -> Result<Tensor> {
    let dtype = x.dtype();
    let x32 = x.to_dtype(DType::F32)?;
    let inv = (x32.sqr()?.mean_keepdim(D::Minus1)? + eps)?.sqrt()?.recip()?;
    x32.broadcast_mul(&inv)?.to_dtype(dtype)?.broadcast_mul(w)
}

/// src/model/rope.rs's `RopeTable::apply`.
fn rope_ref(x: &Tensor, cos: &Tensor, sin: &Tensor) -> Result<Tensor> {
    let d = x.dim(D::Minus1)?;
    let rot = Tensor::cat(&[&x.narrow(D::Minus1, d / 2, d / 2)?.neg()?, &x.narrow(D::Minus1, 0, d / 2)?], D::Minus1)?;
    x.broadcast_mul(cos)?.add(&rot.broadcast_mul(sin)?)
}

/// src/model/loss.rs's per-token loss summed (targets i64, negative = ignore).
fn ce_ref(logits: &Tensor, targets: &Tensor) -> Result<Tensor> {
    let x = logits.to_dtype(DType::F32)?;
    let m = x.max_keepdim(D::Minus1)?.detach();
    let lse = x.broadcast_sub(&m)?.exp()?.sum_keepdim(D::Minus1)?.log()?.add(&m)?;
    let valid = targets.ge(0i64)?;
    let safe = valid.where_cond(targets, &targets.zeros_like()?)?;
    let picked = x.gather(&safe.unsqueeze(D::Minus1)?.contiguous()?, D::Minus1)?;
    lse.sub(&picked)?.squeeze(D::Minus1)?.mul(&valid.to_dtype(DType::F32)?)?.sum_all()
}

fn main() -> Result<()> {
    let tokens: usize = std::env::args().nth(1).and_then(|a| a.parse().ok()).unwrap_or(16384);
    let dev = Device::new_cuda(0)?;
    let bf = DType::BF16;
    let (h, inter, hq, hkv, d, v, eps) = (2048usize, 5632usize, 32usize, 4usize, 64usize, 32000usize, 1e-5);
    let reps = 10;
    println!("== bf16, {tokens} tokens (TinyLlama-1.1B shape) ==");
    let randn = |shape: &[usize], s: f32| -> Result<Tensor> { (Tensor::randn(0f32, 1.0, shape, &dev)? * s as f64)?.to_dtype(bf) };

    // RMSNorm + residual
    let x = randn(&[1, tokens, h], 1.0)?;
    let r = randn(&[1, tokens, h], 1.0)?;
    let w = (randn(&[h], 0.1)? + 1.0)?;
    let dy = randn(&[1, tokens, h], 1.0)?;
    let c = time(&dev, reps, || rms_ref(&x.add(&r)?, &w, eps).map(|_| ()))?;
    let f = time(&dev, reps, || rms_norm_fwd(&x, Some(&r), &w, eps).map(|_| ()))?;
    report("rmsnorm+residual fwd [T, 2048]", c, f);
    let c = time(&dev, reps, || {
        let (xv, rv, wv) = (Var::from_tensor(&x)?, Var::from_tensor(&r)?, Var::from_tensor(&w)?);
        let y = rms_ref(&xv.as_tensor().add(rv.as_tensor())?, wv.as_tensor(), eps)?;
        y.mul(&dy)?.sum_all()?.backward().map(|_| ())
    })?;
    let f = time(&dev, reps, || {
        let o = rms_norm_fwd(&x, Some(&r), &w, eps)?;
        rms_norm_bwd(&dy, &o.x_sum, &w, &o.rstd, Some(&dy)).map(|_| ())
    })?;
    report("rmsnorm+residual fwd+bwd [T, 2048]", c, f);
    drop((x, r, dy));

    // RoPE on q and k
    let q = randn(&[1, tokens, hq, d], 1.0)?;
    let k = randn(&[1, tokens, hkv, d], 1.0)?;
    let pos: Vec<u32> = (0..tokens as u32).collect();
    let inv: Vec<f32> = (0..d / 2).map(|i| 1.0 / 10000f32.powf((2 * i) as f32 / d as f32)).collect();
    let p = Tensor::from_vec(pos, (1, tokens, 1), &dev)?.to_dtype(DType::F32)?;
    let fr = p.broadcast_mul(&Tensor::from_vec(inv, (1, 1, d / 2), &dev)?)?;
    let emb = Tensor::cat(&[&fr, &fr], D::Minus1)?;
    let cos = emb.cos()?.to_dtype(bf)?.unsqueeze(2)?.contiguous()?;
    let sin = emb.sin()?.to_dtype(bf)?.unsqueeze(2)?.contiguous()?;
    let c = time(&dev, reps, || {
        rope_ref(&q, &cos, &sin)?;
        rope_ref(&k, &cos, &sin).map(|_| ())
    })?;
    let f = time(&dev, reps, || {
        rope_fwd_inplace(&q, &cos, &sin)?;
        rope_fwd_inplace(&k, &cos, &sin)
    })?;
    report("rope fwd q [T,32,64] + k [T,4,64]", c, f);
    let (dq, dk) = (randn(&[1, tokens, hq, d], 1.0)?, randn(&[1, tokens, hkv, d], 1.0)?);
    let c = time(&dev, reps, || {
        let (qv, kv) = (Var::from_tensor(&q)?, Var::from_tensor(&k)?);
        let s =
            rope_ref(qv.as_tensor(), &cos, &sin)?.mul(&dq)?.sum_all()?.add(&rope_ref(kv.as_tensor(), &cos, &sin)?.mul(&dk)?.sum_all()?)?;
        s.backward().map(|_| ())
    })?;
    let f = time(&dev, reps, || {
        rope_fwd_inplace(&q, &cos, &sin)?;
        rope_fwd_inplace(&k, &cos, &sin)?;
        rope_bwd_inplace(&dq, &cos, &sin)?;
        rope_bwd_inplace(&dk, &cos, &sin)
    })?;
    report("rope fwd+bwd q + k", c, f);
    drop((q, k, dq, dk));

    // SwiGLU
    let g = randn(&[tokens, inter], 2.0)?;
    let u = randn(&[tokens, inter], 1.0)?;
    let dout = randn(&[tokens, inter], 1.0)?;
    let c = time(&dev, reps, || g.silu()?.mul(&u).map(|_| ()))?;
    let f = time(&dev, reps, || swiglu_fwd(&g, &u).map(|_| ()))?;
    report("swiglu fwd [T, 5632]", c, f);
    let c = time(&dev, reps, || {
        let (gv, uv) = (Var::from_tensor(&g)?, Var::from_tensor(&u)?);
        gv.as_tensor().silu()?.mul(uv.as_tensor())?.mul(&dout)?.sum_all()?.backward().map(|_| ())
    })?;
    let f = time(&dev, reps, || {
        swiglu_fwd(&g, &u)?;
        swiglu_bwd(&dout, &g, &u).map(|_| ())
    })?;
    report("swiglu fwd+bwd [T, 5632]", c, f);
    drop((g, u, dout));

    // lm_head + cross-entropy, 4096-token chunks (the engine's default token_chunk)
    let chunk = 4096;
    let hid = randn(&[tokens, h], 1.0)?;
    let wl = randn(&[v, h], 0.02)?;
    let t: Vec<i64> = (0..tokens).map(|i| if i % 17 == 0 { -100 } else { ((i * 7919) % v) as i64 }).collect();
    let t = Tensor::from_vec(t, tokens, &dev)?;
    let scale = 1.0 / tokens as f64;
    let c = time(&dev, 3, || {
        let wv = Var::from_tensor(&wl)?;
        let mut acc: Option<Tensor> = None;
        for st in (0..tokens).step_by(chunk) {
            let len = chunk.min(tokens - st);
            let hv = Var::from_tensor(&hid.narrow(0, st, len)?)?;
            let logits = hv.as_tensor().matmul(&wv.as_tensor().t()?)?;
            let l = ce_ref(&logits, &t.narrow(0, st, len)?)?;
            let grads = (l * scale)?.backward()?;
            let gw = grads.get(wv.as_tensor()).unwrap().detach().to_dtype(DType::F32)?;
            acc = Some(match acc {
                Some(a) => a.add(&gw)?,
                None => gw,
            });
            let _dh = grads.get(hv.as_tensor()).unwrap().detach();
        }
        Ok(())
    })?;
    let acc = Tensor::zeros((v, h), DType::F32, &dev)?;
    let f = time(&dev, 3, || linear_cross_entropy(&hid, &wl, &t, scale, chunk, Some(&acc)).map(|_| ()))?;
    report("linear+CE fwd+bwd [T,2048]x[32000,2048] c4096", c, f);
    // the CE part alone on one chunk's logits
    let logits = hid.narrow(0, 0, chunk)?.matmul(&wl.t()?)?;
    let tc = t.narrow(0, 0, chunk)?;
    let c = time(&dev, reps, || {
        let lv = Var::from_tensor(&logits)?;
        (ce_ref(lv.as_tensor(), &tc)? * scale)?.backward().map(|_| ())
    })?;
    let f = time(&dev, reps, || cross_entropy_inplace(&logits, &tc, scale).map(|_| ()))?;
    report("CE loss+grad only, one chunk [4096, 32000]", c, f);
    drop((hid, wl, acc, logits));

    // AdamW over the whole 1.1B-parameter shard (one GPU, ZeRO world 1)
    let n = 1_100_048_384usize;
    let wp = Tensor::randn(0f32, 0.02, n, &dev)?;
    let gr = Tensor::randn(0f32, 1e-3, n, &dev)?;
    let (m, vv) = (Tensor::zeros(n, DType::F32, &dev)?, Tensor::zeros(n, DType::F32, &dev)?);
    let decay = Tensor::ones(n, DType::U8, &dev)?;
    let decay_f = Tensor::ones(n, DType::F32, &dev)?;
    let copy = Tensor::zeros(n, bf, &dev)?;
    let (lr, b1, b2, e, wd) = (2e-5, 0.9, 0.95, 1e-8, 0.1);
    let mut stp = 0u64;
    // optim.rs's DeviceAdamW::update (tensor ops), then the bf16 write-back cast
    let (mut mc, mut vc, mut wc) = (m.clone(), vv.clone(), wp.clone());
    let c = time(&dev, 3, || {
        stp += 1;
        let bc1 = 1.0 - f64::powi(b1, stp as i32);
        let bc2 = 1.0 - f64::powi(b2, stp as i32);
        mc = ((&mc * b1)? + (&gr * (1.0 - b1))?)?;
        vc = ((&vc * b2)? + (gr.sqr()? * (1.0 - b2))?)?;
        let denom = ((vc.sqrt()? / bc2.sqrt())? + e)?;
        let decayed = (&wc - (wc.mul(&decay_f)? * (lr * wd))?)?;
        wc = (decayed - (mc.div(&denom)? * (lr / bc1))?)?;
        wc.to_dtype(bf).map(|_| ())
    })?;
    drop((mc, vc, wc, decay_f));
    let mut stp = 0u64;
    let f = time(&dev, 3, || {
        stp += 1;
        let hp = AdamWStep { lr, beta1: b1, beta2: b2, eps: e, weight_decay: wd, step: stp, grad_scale: 1.0 };
        adamw_step(&wp, &gr, &m, &vv, Some(&decay), &hp, Some(&copy))
    })?;
    report("adamw 1.1B f32 shard + bf16 copy", c, f);
    Ok(())
}
