//! The in-process communicator: every collective against the values it must produce
//! (exact: only small integers in f32, so equality is exact), sub-groups that must not
//! mix messages, and failures that must become errors on every rank instead of hangs.

use candle_core::{DType, Device, Result, Tensor};
use longctx_attention::comm::thread::{run_ranks, run_ranks_with_timeout, ThreadComm};
use longctx_attention::comm::Comm;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

const WORLDS: [usize; 5] = [1, 2, 3, 4, 8];

fn full(v: f32, n: usize) -> Result<Tensor> {
    Tensor::full(v, n, &Device::Cpu)
}

fn values(t: &Tensor) -> Result<Vec<f32>> {
    t.to_dtype(DType::F32)?.flatten_all()?.to_vec1()
}

#[test]
fn sendrecv_ring_and_out_of_order_waits() -> Result<()> {
    for w in WORLDS {
        run_ranks(w, |c| {
            let r = c.rank() as f32;
            // two exchanges in flight, waited in reverse order
            let first = c.sendrecv_start(vec![full(r, 3)?, full(10.0 + r, 2)?], c.next(), c.prev())?;
            let second = c.sendrecv_start(vec![full(100.0 + r, 1)?], c.prev(), c.next())?;
            let got2 = second.wait()?;
            let got1 = first.wait()?;
            let (p, n) = (c.prev() as f32, c.next() as f32);
            assert_eq!(got1.len(), 2);
            assert_eq!(values(&got1[0])?, vec![p; 3]);
            assert_eq!(values(&got1[1])?, vec![10.0 + p; 2]);
            assert_eq!(values(&got2[0])?, vec![100.0 + n]);
            Ok(())
        })?;
    }
    Ok(())
}

#[test]
fn sent_tensors_are_snapshots() -> Result<()> {
    // the receiver must see what was sent even if the sender overwrites its buffer after
    run_ranks(2, |c| {
        let buf = candle_core::Var::from_tensor(&full(c.rank() as f32, 4)?)?;
        let p = c.sendrecv_start(vec![buf.as_tensor().clone()], c.next(), c.prev())?;
        buf.set(&full(-1.0, 4)?)?;
        let got = p.wait()?;
        assert_eq!(values(&got[0])?, vec![c.prev() as f32; 4]);
        Ok(())
    })?;
    Ok(())
}

#[test]
fn all_to_all_routes_every_part() -> Result<()> {
    for w in WORLDS {
        run_ranks(w, |c| {
            let r = c.rank();
            let xs = (0..w).map(|i| full((100 * r + i) as f32, 2)).collect::<Result<Vec<_>>>()?;
            let ys = c.all_to_all(xs)?;
            assert_eq!(ys.len(), w);
            for (j, y) in ys.iter().enumerate() {
                assert_eq!(values(y)?, vec![(100 * j + r) as f32; 2], "w={w} rank {r} part {j}");
            }
            Ok(())
        })?;
    }
    Ok(())
}

#[test]
fn all_reduce_sum_is_exact_and_bitwise_identical() -> Result<()> {
    for w in WORLDS {
        let outs = run_ranks(w, |c| {
            let r = c.rank() as f32;
            let x = Tensor::new(&[1.0f32 + r, 2.0 * r, -r], &Device::Cpu)?;
            let y = c.all_reduce_sum(&x)?;
            let s: f32 = (0..w).map(|i| i as f32).sum();
            assert_eq!(values(&y)?, vec![w as f32 + s, 2.0 * s, -s]);
            // non-integer values: every rank must get the very same bits
            let z = Tensor::new(&[0.1f32 * (r + 1.0), 1.0 / (r + 3.0), 1e-7 * r], &Device::Cpu)?;
            c.all_reduce_sum(&z)?.to_vec1::<f32>()
        })?;
        let bits: Vec<Vec<u32>> = outs.iter().map(|v| v.iter().map(|x| x.to_bits()).collect()).collect();
        assert!(bits.iter().all(|b| b == &bits[0]), "w={w}: all_reduce results differ between ranks");
    }
    Ok(())
}

#[test]
fn all_gather_and_reduce_scatter() -> Result<()> {
    for w in WORLDS {
        run_ranks(w, |c| {
            let r = c.rank();
            let ys = c.all_gather(&full(r as f32, 3)?)?;
            assert_eq!(ys.len(), w);
            for (j, y) in ys.iter().enumerate() {
                assert_eq!(values(y)?, vec![j as f32; 3]);
            }
            let xs = (0..w).map(|i| full((10 * r + i) as f32, 2)).collect::<Result<Vec<_>>>()?;
            let y = c.reduce_scatter_sum(xs)?;
            // sum over ranks q of 10q + r
            let want = (10 * w * (w - 1) / 2 + w * r) as f32;
            assert_eq!(values(&y)?, vec![want; 2], "w={w} rank {r}");
            Ok(())
        })?;
    }
    Ok(())
}

#[test]
fn barrier_waits_for_everyone() -> Result<()> {
    for w in [2, 4] {
        let flag = AtomicBool::new(false);
        run_ranks(w, |c| {
            if c.rank() == w - 1 {
                std::thread::sleep(Duration::from_millis(150));
                flag.store(true, Ordering::SeqCst);
            }
            c.barrier()?;
            assert!(flag.load(Ordering::SeqCst), "rank {} passed the barrier early", c.rank());
            Ok(())
        })?;
    }
    Ok(())
}

/// Splits `w = rows·cols` ranks into row groups (consecutive) and column groups
/// (stride `cols`) and runs interleaved traffic in both; the values identify the group.
fn check_split(rows: usize, cols: usize) -> Result<()> {
    let w = rows * cols;
    run_ranks(w, |c| {
        let r = c.rank();
        let (row, col) = (r / cols, r % cols);
        let row_members: Vec<usize> = (0..cols).map(|i| row * cols + i).collect();
        let col_members: Vec<usize> = (0..rows).map(|k| col + k * cols).collect();
        let rg = c.sub(&row_members)?;
        let cg = c.sub(&col_members)?;
        assert_eq!((rg.rank(), rg.world(), cg.rank(), cg.world()), (col, cols, row, rows));
        // p2p in both groups and the world in flight together, waited in mixed order
        let pr = rg.sendrecv_start(vec![full(r as f32, 1)?], rg.next(), rg.prev())?;
        let pc = cg.sendrecv_start(vec![full(1000.0 + r as f32, 1)?], cg.next(), cg.prev())?;
        let pw = c.sendrecv_start(vec![full(-(r as f32), 1)?], c.next(), c.prev())?;
        let gc = pc.wait()?;
        let gw = pw.wait()?;
        let gr = pr.wait()?;
        assert_eq!(values(&gr[0])?, vec![row_members[rg.prev()] as f32]);
        assert_eq!(values(&gc[0])?, vec![1000.0 + col_members[cg.prev()] as f32]);
        assert_eq!(values(&gw[0])?, vec![-(c.prev() as f32)]);
        // collectives in both groups
        let row_sum = rg.all_reduce_sum(&full(r as f32, 2)?)?;
        let col_all = cg.all_gather(&full(r as f32, 1)?)?;
        let row_want: usize = row_members.iter().sum();
        assert_eq!(values(&row_sum)?, vec![row_want as f32; 2]);
        let col_got = col_all.iter().map(|t| values(t).map(|v| v[0])).collect::<Result<Vec<_>>>()?;
        assert_eq!(col_got, col_members.iter().map(|&m| m as f32).collect::<Vec<_>>());
        // a nested group inside the row group (pairs), if it has at least 2 members
        if cols >= 2 {
            let pair: Vec<usize> = if col < 2 { vec![0, 1] } else { vec![col] };
            let pg = rg.sub(&pair)?;
            let s = pg.all_reduce_sum(&full(r as f32, 1)?)?;
            let want: usize = pair.iter().map(|&i| row_members[i]).sum();
            assert_eq!(values(&s)?, vec![want as f32]);
        }
        c.barrier()
    })?;
    Ok(())
}

#[test]
fn sub_groups_do_not_mix_messages() -> Result<()> {
    check_split(2, 2)?;
    check_split(4, 2)?;
    check_split(2, 4)
}

#[test]
fn sub_rejects_bad_member_lists() {
    let res = run_ranks_with_timeout(2, Duration::from_secs(10), |c| {
        let bad = if c.rank() == 0 { vec![1, 0] } else { vec![1, 2] };
        c.sub(&bad).map(|_| ())
    });
    let msg = res.err().map(|e| e.to_string()).unwrap_or_default();
    assert!(msg.contains("ascending") || msg.contains("below"), "unexpected error: {msg}");
}

#[test]
fn one_failing_rank_fails_every_rank_quickly() {
    for w in [2, 4, 8] {
        let failing = w / 2;
        let outcomes = Mutex::new(vec![String::new(); w]);
        let t0 = Instant::now();
        let res = run_ranks(w, |c| {
            let r = c.rank();
            let out = if r == failing {
                Err(candle_core::Error::Msg("deliberate failure in rank code".into()))
            } else {
                // would block forever: the failing rank never joins
                c.all_reduce_sum(&full(1.0, 4)?).and_then(|_| c.barrier())
            };
            if let Err(e) = &out {
                outcomes.lock().unwrap()[r] = e.to_string();
            }
            out
        });
        let elapsed = t0.elapsed();
        assert!(elapsed < Duration::from_secs(5), "w={w}: took {elapsed:?}");
        let err = res.err().map(|e| e.to_string()).unwrap_or_default();
        assert!(err.contains("deliberate failure"), "w={w}: root cause lost: {err}");
        assert!(err.contains(&format!("rank {failing} of {w}")), "w={w}: failing rank not named: {err}");
        let outcomes = outcomes.into_inner().unwrap();
        for (r, o) in outcomes.iter().enumerate() {
            assert!(!o.is_empty(), "w={w}: rank {r} did not return an error");
            if r != failing {
                assert!(o.contains("aborted") && o.contains("deliberate failure"), "w={w} rank {r}: {o}");
            }
        }
    }
}

#[test]
fn a_panicking_rank_fails_every_rank() {
    let t0 = Instant::now();
    let res = run_ranks(3, |c| {
        if c.rank() == 1 {
            panic!("deliberate panic in rank 1");
        }
        c.barrier()
    });
    assert!(t0.elapsed() < Duration::from_secs(5));
    let err = res.err().map(|e| e.to_string()).unwrap_or_default();
    assert!(err.contains("deliberate panic") && err.contains("rank 1 of 3"), "{err}");
}

/// Runs `f` on the raw handles of a world (no run_ranks abort on error) and returns
/// every rank's result.
fn raw<T: Send>(w: usize, timeout: Duration, f: impl Fn(Arc<dyn Comm>) -> Result<T> + Sync) -> Vec<Result<T>> {
    let comms = ThreadComm::world_with_timeout(w, timeout);
    std::thread::scope(|s| {
        let f = &f;
        let hs: Vec<_> = comms.into_iter().map(|c| s.spawn(move || f(c))).collect();
        hs.into_iter().map(|h| h.join().unwrap()).collect()
    })
}

#[test]
fn mismatched_collectives_error_on_every_rank() {
    let w = 3;
    // all_reduce: rank 1 has a different shape
    let res = raw(w, Duration::from_secs(20), |c| {
        let n = if c.rank() == 1 { 3 } else { 2 };
        c.all_reduce_sum(&full(1.0, n)?)
    });
    for (r, x) in res.iter().enumerate() {
        let msg = x.as_ref().err().map(|e| e.to_string()).unwrap_or_default();
        assert!(msg.contains("mismatched"), "all_reduce rank {r}: {msg}");
    }
    // all_reduce: rank 2 has a different dtype
    let res = raw(w, Duration::from_secs(20), |c| {
        let t = full(1.0, 2)?;
        c.all_reduce_sum(&if c.rank() == 2 { t.to_dtype(DType::F64)? } else { t })
    });
    assert!(res.iter().all(|x| x.as_ref().is_err_and(|e| e.to_string().contains("F64"))));
    // all_to_all and all_gather with one odd shape
    let res = raw(w, Duration::from_secs(20), |c| {
        let n = if c.rank() == 0 { 1 } else { 2 };
        c.all_to_all((0..w).map(|_| full(0.0, n)).collect::<Result<Vec<_>>>()?)
    });
    assert!(res.iter().all(|x| x.as_ref().is_err_and(|e| e.to_string().contains("mismatched"))));
    let res = raw(w, Duration::from_secs(20), |c| c.all_gather(&full(0.0, 1 + c.rank() / 2)?));
    assert!(res.iter().all(|x| x.as_ref().is_err_and(|e| e.to_string().contains("mismatched"))));
    // different collectives on different ranks
    let res = raw(2, Duration::from_secs(20), |c| if c.rank() == 0 { c.all_gather(&full(0.0, 1)?).map(|_| ()) } else { c.barrier() });
    assert!(res.iter().all(|x| x.is_err()), "collective order mismatch went unnoticed");
}

#[test]
fn a_missing_peer_times_out() {
    let t0 = Instant::now();
    let res = raw(2, Duration::from_millis(300), |c| {
        if c.rank() == 0 {
            c.sendrecv_start(vec![full(0.0, 1)?], 0, 1)?.wait().map(|_| ())
        } else {
            Ok(()) // never sends
        }
    });
    assert!(t0.elapsed() < Duration::from_secs(3));
    let msg = res[0].as_ref().err().map(|e| e.to_string()).unwrap_or_default();
    assert!(msg.contains("timed out") && msg.contains("rank 1"), "{msg}");
    assert!(res[1].is_ok());
}
