//! Parallel dims: rank layout, group membership, invalid layouts, and groups built
//! over the in-process thread communicator.
//!
//! References: the layout is checked against an independent brute-force enumeration
//! (nested loops over dp, ring, ulysses in the documented order) and a hand-written
//! table; collective results against sums computed directly from the member lists.
//! Tolerance: exact (small integers in f32 sum exactly).

use candle_core::{Device, Tensor};
use longctx::parallel::{build_groups, DimsRequest, ParallelDims, ParallelMode};
use longctx_attention::comm::thread::run_ranks;
use std::collections::BTreeSet;

fn dims(mode: ParallelMode, world: usize, sp: Option<usize>, ulysses: Option<usize>) -> longctx::Result<ParallelDims> {
    ParallelDims::new(&DimsRequest { mode, world, sp, ulysses, hq: 32, hkv: 8 })
}

/// Brute-force reference: (dp_idx, ring_idx, ulysses_idx) of every rank, in rank order.
fn enumerate(dp: usize, ring: usize, ulysses: usize) -> Vec<(usize, usize, usize)> {
    let mut v = Vec::new();
    for d in 0..dp {
        for r in 0..ring {
            for u in 0..ulysses {
                v.push((d, r, u));
            }
        }
    }
    v
}

fn members(coords: &[(usize, usize, usize)], keep: impl Fn(&(usize, usize, usize)) -> bool) -> Vec<usize> {
    coords.iter().enumerate().filter(|(_, c)| keep(c)).map(|(i, _)| i).collect()
}

fn check_layout(d: &ParallelDims) {
    let coords = enumerate(d.dp, d.ring, d.ulysses);
    assert_eq!(coords.len(), d.world);
    for (rank, &(di, ri, ui)) in coords.iter().enumerate() {
        let c = d.coords(rank).unwrap();
        assert_eq!((c.dp_idx, c.ring_idx, c.ulysses_idx), (di, ri, ui), "coords of rank {rank} in {d:?}");
        assert_eq!(c.sp_idx, ri * d.ulysses + ui);
        assert_eq!(d.rank_of(di, ri, ui), rank);
        assert_eq!(d.sp_group(rank).unwrap(), members(&coords, |c| c.0 == di), "sp group of {rank}");
        assert_eq!(d.dp_group(rank).unwrap(), members(&coords, |c| c.1 == ri && c.2 == ui), "dp group of {rank}");
        assert_eq!(d.ulysses_group(rank).unwrap(), members(&coords, |c| c.0 == di && c.1 == ri), "ulysses group of {rank}");
        assert_eq!(d.ring_group(rank).unwrap(), members(&coords, |c| c.0 == di && c.2 == ui), "ring group of {rank}");
        // Ulysses groups are contiguous ranks (inside a node).
        let ug = d.ulysses_group(rank).unwrap();
        assert!(ug.windows(2).all(|w| w[1] == w[0] + 1));
    }
    assert!(d.coords(d.world).is_err());
}

#[test]
fn layouts_match_enumeration() {
    let cases = [
        (ParallelMode::DataParallel, 4, None, None, (4, 1, 1, 1)),
        (ParallelMode::ZigzagRingAttn, 4, None, None, (1, 4, 4, 1)),
        (ParallelMode::ZigzagRingAttn, 8, Some(4), None, (2, 4, 4, 1)),
        (ParallelMode::UlyssesAttn, 8, None, None, (1, 8, 1, 8)),
        (ParallelMode::UlyssesAttn, 6, Some(2), Some(2), (3, 2, 1, 2)),
        (ParallelMode::Fpdt, 4, Some(4), None, (1, 4, 1, 4)),
        (ParallelMode::Usp, 8, None, Some(2), (1, 8, 4, 2)),
        (ParallelMode::Usp, 8, Some(4), Some(2), (2, 4, 2, 2)),
        (ParallelMode::Usp, 12, Some(4), Some(2), (3, 4, 2, 2)),
        (ParallelMode::Usp, 16, Some(8), Some(4), (2, 8, 2, 4)),
        (ParallelMode::Usp, 1, None, Some(1), (1, 1, 1, 1)),
    ];
    for (mode, world, sp, u, (dp, sp_e, ring, uly)) in cases {
        let d = dims(mode, world, sp, u).unwrap_or_else(|e| panic!("{mode} world {world}: {e}"));
        assert_eq!((d.world, d.dp, d.sp, d.ring, d.ulysses, d.mode), (world, dp, sp_e, ring, uly, mode));
        check_layout(&d);
    }
}

#[test]
fn documented_example_dp2_ring2_ulysses2() {
    let d = dims(ParallelMode::Usp, 8, Some(4), Some(2)).unwrap();
    let groups = |f: &dyn Fn(usize) -> Vec<usize>| -> BTreeSet<Vec<usize>> { (0..8).map(f).collect() };
    let set = |v: &[&[usize]]| -> BTreeSet<Vec<usize>> { v.iter().map(|g| g.to_vec()).collect() };
    assert_eq!(groups(&|r| d.ulysses_group(r).unwrap()), set(&[&[0, 1], &[2, 3], &[4, 5], &[6, 7]]));
    assert_eq!(groups(&|r| d.ring_group(r).unwrap()), set(&[&[0, 2], &[1, 3], &[4, 6], &[5, 7]]));
    assert_eq!(groups(&|r| d.sp_group(r).unwrap()), set(&[&[0, 1, 2, 3], &[4, 5, 6, 7]]));
    assert_eq!(groups(&|r| d.dp_group(r).unwrap()), set(&[&[0, 4], &[1, 5], &[2, 6], &[3, 7]]));
}

fn err_text(r: longctx::Result<ParallelDims>) -> String {
    match r {
        Ok(d) => panic!("expected an error, got {d:?}"),
        Err(e) => e.to_string(),
    }
}

#[test]
fn invalid_layouts_are_rejected_with_reasons() {
    use ParallelMode::*;
    let e = err_text(dims(ZigzagRingAttn, 6, Some(4), None));
    assert!(e.contains("world size 6 is not divisible by sp = 4"), "{e}");
    let e = err_text(dims(Usp, 8, None, None));
    assert!(e.contains("usp needs the ulysses degree"), "{e}");
    let e = err_text(dims(Usp, 8, None, Some(3)));
    assert!(e.contains("sp = 8 is not divisible by ulysses = 3"), "{e}");
    let e = err_text(dims(DataParallel, 4, Some(2), None));
    assert!(e.contains("data_parallel"), "{e}");
    let e = err_text(dims(ZigzagRingAttn, 4, None, Some(2)));
    assert!(e.contains("does not use Ulysses"), "{e}");
    let e = err_text(dims(UlyssesAttn, 8, Some(4), Some(2)));
    assert!(e.contains("use usp"), "{e}");
    let e = err_text(dims(Fpdt, 0, None, None));
    assert!(e.contains("at least 1"), "{e}");

    // Heads: 32 query heads over 3 ranks.
    let req = |mode, world, u, hq, hkv| DimsRequest { mode, world, sp: None, ulysses: u, hq, hkv };
    let e = err_text(ParallelDims::new(&req(UlyssesAttn, 3, None, 32, 8)));
    assert!(e.contains("32 query heads cannot be split over ulysses = 3"), "{e}");
    // 6 kv heads over 4 ranks: neither divides the other.
    let e = err_text(ParallelDims::new(&req(Fpdt, 4, None, 24, 6)));
    assert!(e.contains("6 kv heads cannot be split over ulysses = 4"), "{e}");
    // kv replication: 2 kv heads over 8 ranks is fine, and so is 16 over 4.
    assert!(ParallelDims::new(&req(UlyssesAttn, 8, None, 32, 2)).is_ok());
    assert!(ParallelDims::new(&req(Usp, 8, Some(2), 32, 16)).is_ok());
    // Heads do not matter without Ulysses.
    assert!(ParallelDims::new(&req(ZigzagRingAttn, 3, None, 32, 8)).is_ok());
    let e = err_text(ParallelDims::new(&req(UlyssesAttn, 2, None, 8, 3)));
    assert!(e.contains("invalid"), "{e}");

    let e = ParallelDims::check_devices(8, 4).unwrap_err().to_string();
    assert!(e.contains("8 ranks on this node but only 4 GPU(s)"), "{e}");
    assert!(ParallelDims::check_devices(4, 8).is_ok());
}

#[test]
fn mode_names_round_trip() {
    for m in ParallelMode::ALL {
        assert_eq!(m.as_str().parse::<ParallelMode>().unwrap(), m);
        let json = serde_json::to_string(&m).unwrap();
        assert_eq!(json, format!("\"{}\"", m.as_str()));
        assert_eq!(serde_json::from_str::<ParallelMode>(&json).unwrap(), m);
    }
    let e = "ring".parse::<ParallelMode>().unwrap_err().to_string();
    assert!(e.contains("unknown parallel mode `ring`") && e.contains("zigzag_ring_attn"), "{e}");
}

/// Groups over 8 thread ranks (dp 2 × ring 2 × ulysses 2): each all-reduce sums only
/// over the group's members, group ranks are the documented indices, and a ring
/// exchange reaches the ring neighbour.
#[test]
fn groups_over_thread_comm_reduce_over_members_only() {
    let d = dims(ParallelMode::Usp, 8, Some(4), Some(2)).unwrap();
    let value = |r: usize| [(r + 1) as f32, (100 * (r + 1)) as f32];
    let sum_over = |ms: &[usize]| -> Vec<f32> {
        let mut s = vec![0f32; 2];
        for &m in ms {
            s[0] += value(m)[0];
            s[1] += value(m)[1];
        }
        s
    };
    let out = run_ranks(8, |world| {
        let rank = world.rank();
        let g = build_groups(&world, &d).map_err(candle_core::Error::wrap)?;
        let c = d.coords(rank).map_err(candle_core::Error::wrap)?;
        let x = Tensor::new(&value(rank), &Device::Cpu)?;
        let mut got = Vec::new();
        for comm in [&g.sp, &g.dp, &g.ulysses, &g.ring] {
            got.push((comm.rank(), comm.world(), comm.all_reduce_sum(&x)?.to_vec1::<f32>()?));
        }
        // Ring exchange inside the ring group: receive the previous ring rank's value.
        let next = g.ring.next();
        let prev = g.ring.prev();
        let recv = g.ring.sendrecv_start(vec![x.clone()], next, prev)?.wait()?;
        got.push((prev, 0, recv[0].to_vec1::<f32>()?));
        Ok((rank, c, got))
    })
    .unwrap();
    for (rank, c, got) in out {
        let lists = [d.sp_group(rank).unwrap(), d.dp_group(rank).unwrap(), d.ulysses_group(rank).unwrap(), d.ring_group(rank).unwrap()];
        let idx = [c.sp_idx, c.dp_idx, c.ulysses_idx, c.ring_idx];
        for k in 0..4 {
            assert_eq!(got[k].0, idx[k], "rank {rank} group {k}: rank in group");
            assert_eq!(got[k].1, lists[k].len(), "rank {rank} group {k}: group size");
            assert_eq!(got[k].2, sum_over(&lists[k]), "rank {rank} group {k}: all_reduce over {:?}", lists[k]);
        }
        let ring = &lists[3];
        let prev_global = ring[got[4].0];
        assert_eq!(got[4].2, value(prev_global).to_vec(), "rank {rank}: ring neighbour {prev_global}");
        assert_eq!(prev_global, d.rank_of(c.dp_idx, (c.ring_idx + d.ring - 1) % d.ring, c.ulysses_idx));
    }
}

/// When a group spans the whole world it is the world communicator itself.
#[test]
fn whole_world_groups_reuse_the_world() {
    let d = dims(ParallelMode::UlyssesAttn, 4, None, None).unwrap();
    let out = run_ranks(4, |world| {
        let g = build_groups(&world, &d).map_err(candle_core::Error::wrap)?;
        let x = Tensor::new(&[1f32], &Device::Cpu)?;
        Ok((
            std::sync::Arc::ptr_eq(&g.sp, &world) && std::sync::Arc::ptr_eq(&g.ulysses, &world),
            g.dp.world(),
            g.ring.world(),
            g.sp.all_reduce_sum(&x)?.to_vec1::<f32>()?[0],
            g.dp.all_reduce_sum(&x)?.to_vec1::<f32>()?[0],
        ))
    })
    .unwrap();
    for o in out {
        assert_eq!(o, (true, 1, 1, 4.0, 1.0));
    }
    // A world of another size is refused.
    let e = run_ranks(2, |world| build_groups(&world, &d).map(|_| ()).map_err(candle_core::Error::wrap));
    let e = e.unwrap_err().to_string();
    assert!(e.contains("world communicator has 2 ranks but the parallel layout expects 4"), "{e}");
}
