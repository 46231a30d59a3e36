//! Test helper for the launcher, the rendezvous and the failure monitor.
//!
//! `longctx-dist-probe launch [launch flags] -- run [probe flags]` starts ranks like
//! `longctx launch` does; `longctx-dist-probe run` is one rank: it reads the rank
//! environment, joins the rendezvous (rank 0 contributes 128 random bytes), prints
//! `rank R/W local L/LW blob <fnv64 of the blob>` and ends cleanly, or misbehaves
//! on request to exercise the failure paths.

use clap::{Parser, Subcommand};
use longctx::parallel::{self, DistEnv, LaunchArgs, RendezvousOptions};
use rand::Rng;
use std::time::Duration;

#[derive(Parser)]
#[command(about = "Probe of longctx's launcher, rendezvous and failure monitor")]
struct Cli {
    #[command(subcommand)]
    cmd: Cmd,
}

#[derive(Subcommand)]
enum Cmd {
    /// Start ranks (like `longctx launch`; the program defaults to this probe).
    Launch(LaunchArgs),
    /// Be one rank.
    Run(RunArgs),
}

#[derive(clap::Args)]
struct RunArgs {
    /// This rank exits with `--exit-code` (without saying goodbye).
    #[arg(long)]
    fail_rank: Option<usize>,
    /// Fail before the rendezvous instead of after it.
    #[arg(long)]
    fail_before_rdzv: bool,
    /// Report the failure through the monitor before exiting.
    #[arg(long)]
    report: bool,
    #[arg(long, default_value_t = 3)]
    exit_code: i32,
    /// This rank never joins the rendezvous (sleeps until killed).
    #[arg(long)]
    absent_rank: Option<usize>,
    /// GPU builds (`--features nccl`): after the rendezvous, create an NCCL world on
    /// GPU `LOCAL_RANK` and check every collective against host-computed values.
    #[arg(long)]
    nccl_selftest: bool,
    /// With `--nccl-selftest`: this rank exits (code 3) while the others are inside
    /// an all-reduce; they must be unblocked by the monitor's abort.
    #[arg(long)]
    nccl_fail_rank: Option<usize>,
    /// After the rendezvous, wait until the monitor reports a failure, then exit with
    /// `parallel::launch::PEER_FAILED_EXIT_CODE`.
    #[arg(long)]
    sleep: bool,
}

/// FNV-1a, 64 bit.
fn fnv64(bytes: &[u8]) -> u64 {
    bytes.iter().fold(0xcbf2_9ce4_8422_2325u64, |h, &b| (h ^ b as u64).wrapping_mul(0x0100_0000_01b3))
}

fn run(a: RunArgs) -> anyhow::Result<i32> {
    let env = DistEnv::from_env()?.ok_or_else(|| anyhow::anyhow!("not a distributed run: RANK / WORLD_SIZE unset"))?;
    let me = env.rank;
    if a.absent_rank == Some(me) {
        eprintln!("rank {me}: staying away from the rendezvous");
        loop {
            std::thread::sleep(Duration::from_secs(3600));
        }
    }
    if a.fail_rank == Some(me) && a.fail_before_rdzv {
        eprintln!("rank {me}: failing on purpose before the rendezvous");
        return Ok(a.exit_code);
    }
    let opts = RendezvousOptions::from_env()?;
    let nccl = a.nccl_selftest;
    let rdzv = parallel::rendezvous(
        &env,
        || {
            if nccl {
                return nccl_id();
            }
            let mut id = vec![0u8; 128];
            rand::rng().fill(&mut id[..]);
            Ok(id)
        },
        &opts,
    )?;
    println!("rank {me}/{} local {}/{} blob {:016x}", env.world, env.local_rank, env.local_world, fnv64(&rdzv.blob));
    if a.fail_rank == Some(me) {
        eprintln!("rank {me}: failing on purpose after the rendezvous");
        if a.report {
            rdzv.monitor.report_failure(&format!("exit code {}", a.exit_code));
            std::thread::sleep(Duration::from_millis(200));
        }
        return Ok(a.exit_code);
    }
    if nccl {
        let code = nccl_selftest(&env, &rdzv, a.nccl_fail_rank)?;
        if code == 0 {
            rdzv.monitor.finish();
        }
        return Ok(code);
    }
    if a.sleep {
        let reason = rdzv.monitor.wait_failure(None).unwrap_or_default();
        eprintln!("rank {me}: stopping: {reason}");
        return Ok(parallel::launch::PEER_FAILED_EXIT_CODE);
    }
    rdzv.monitor.finish();
    Ok(0)
}

#[cfg(not(feature = "nccl"))]
fn nccl_id() -> longctx::Result<Vec<u8>> {
    Err(longctx::Error::Setting("--nccl-selftest needs a build with --features nccl".into()))
}

#[cfg(not(feature = "nccl"))]
fn nccl_selftest(_: &DistEnv, _: &parallel::Rendezvous, _: Option<usize>) -> anyhow::Result<i32> {
    anyhow::bail!("--nccl-selftest needs a build with --features nccl")
}

#[cfg(feature = "nccl")]
fn nccl_id() -> longctx::Result<Vec<u8>> {
    Ok(longctx::attention::comm::nccl::NcclComm::unique_id()?)
}

/// Every collective of the NCCL backend against values computed on the host (small
/// integers: sums are exact in f32 and bf16, so the checks are equalities), the
/// groups of `build_groups`, bus bandwidths, and optionally the failure path.
#[cfg(feature = "nccl")]
fn nccl_selftest(env: &DistEnv, rdzv: &parallel::Rendezvous, fail_rank: Option<usize>) -> anyhow::Result<i32> {
    use longctx::attention::comm::nccl::{Family, NcclComm, NcclOptions};
    use longctx::attention::comm::Comm;
    use std::sync::Arc;
    use std::time::Instant;

    let (r, w) = (env.rank, env.world);
    let dev = longctx::device::open_cuda(env.local_rank)?;
    // Failure wiring before the communicator, as `parallel::world::join` does.
    let family = Family::new(r, w);
    {
        let f = family.clone();
        rdzv.monitor.on_failure(move |why| f.abort_from_peer(why));
        let m = rdzv.monitor.clone();
        family.set_abort_hook(move |why| m.report_failure(why));
        rdzv.monitor.exit_after_failure(Duration::from_secs(15));
    }
    let t0 = Instant::now();
    let nc = NcclComm::init(&dev, r, w, &rdzv.blob, NcclOptions::default(), family)?;
    println!("rank {r}: NCCL world of {w} up in {:.2} s", t0.elapsed().as_secs_f64());
    let comm: Arc<dyn Comm> = nc.clone();
    collective_checks(&comm, &dev, r, w)?;
    ordering_checks(&comm, &dev, r, w)?;
    println!("rank {r}: all NCCL checks passed");
    bandwidth(&comm, &dev, r, w)?;
    if let Some(f) = fail_rank {
        return dead_peer(&comm, &dev, rdzv, r, f);
    }
    Ok(0)
}

/// Every collective against values computed on the host, and the groups.
#[cfg(feature = "nccl")]
fn collective_checks(
    comm: &std::sync::Arc<dyn longctx::attention::comm::Comm>,
    dev: &candle_core::Device,
    r: usize,
    w: usize,
) -> anyhow::Result<()> {
    use anyhow::ensure;
    use candle_core::{DType, Tensor};
    let full = |v: f64, shape: &[usize], dt: DType| -> candle_core::Result<Tensor> { Tensor::full(v as f32, shape, dev)?.to_dtype(dt) };
    let vals = |t: &Tensor| -> candle_core::Result<Vec<f32>> { t.to_dtype(DType::F32)?.flatten_all()?.to_vec1::<f32>() };

    // all_reduce_sum: rank k contributes (k+1)·i.
    for dt in [DType::F32, DType::BF16] {
        let i = Tensor::arange(0f32, 64., dev)?;
        let x = (i.clone() * (r + 1) as f64)?.to_dtype(dt)?;
        let got = vals(&comm.all_reduce_sum(&x)?)?;
        let total = (w * (w + 1) / 2) as f32;
        let want: Vec<f32> = (0..64).map(|i| i as f32 * total).collect();
        ensure!(got == want, "all_reduce_sum {dt:?}: got {:?}.. want {:?}..", &got[..4], &want[..4]);
    }
    // all_gather: ys[j] = j.
    let ys = comm.all_gather(&full(r as f64, &[3, 5], DType::F32)?)?;
    for (j, y) in ys.iter().enumerate() {
        ensure!(y.dims() == [3, 5] && vals(y)?.iter().all(|&v| v == j as f32), "all_gather part {j}");
    }
    // reduce_scatter_sum: xs[i] = 10k + i on rank k; rank i gets Σ_k (10k + i).
    let xs = (0..w).map(|i| full((10 * r + i) as f64, &[4], DType::F32)).collect::<candle_core::Result<Vec<_>>>()?;
    let got = vals(&comm.reduce_scatter_sum(xs)?)?;
    let want = (0..w).map(|k| (10 * k + r) as f32).sum::<f32>();
    ensure!(got.iter().all(|&v| v == want), "reduce_scatter_sum: {got:?} want {want}");
    // all_to_all: xs[j] = 100k + j on rank k; ys[j] = 100j + r.
    let xs = (0..w).map(|j| full((100 * r + j) as f64, &[2, 3], DType::BF16)).collect::<candle_core::Result<Vec<_>>>()?;
    for (j, y) in comm.all_to_all(xs)?.iter().enumerate() {
        ensure!(vals(y)?.iter().all(|&v| v == (100 * j + r) as f32), "all_to_all part {j}: {:?}", vals(y)?);
    }
    // sendrecv_start on the ring, two tensors of different dtypes.
    let (next, prev) = (comm.next(), comm.prev());
    let got = comm.sendrecv_start(vec![full(r as f64, &[7], DType::F32)?, full(r as f64, &[2, 2], DType::BF16)?], next, prev)?.wait()?;
    ensure!(got.len() == 2 && got[1].dims() == [2, 2], "sendrecv shapes");
    ensure!(vals(&got[0])?.iter().chain(vals(&got[1])?.iter()).all(|&v| v == prev as f32), "sendrecv values");
    comm.barrier()?;
    // Groups: data parallel (sp groups are single ranks: split), and a split of the whole world.
    let dims = parallel::ParallelDims::new(&parallel::DimsRequest {
        mode: parallel::ParallelMode::DataParallel,
        world: w,
        sp: None,
        ulysses: None,
        hq: 8,
        hkv: 8,
    })?;
    let g = parallel::build_groups(comm, &dims)?;
    ensure!(g.sp.world() == 1 && g.dp.world() == w && g.dp.rank() == r, "group sizes");
    let one = full(1.0, &[1], DType::F32)?;
    ensure!(vals(&g.sp.all_reduce_sum(&one)?)? == [1.0], "sp group sum");
    let all: Vec<usize> = (0..w).collect();
    let split = comm.sub(&all)?;
    ensure!(vals(&split.all_reduce_sum(&one)?)? == [w as f32], "split world sum");
    Ok(())
}

/// Bus bandwidth of a 256 MiB bf16 all-reduce and ring exchange.
#[cfg(feature = "nccl")]
fn bandwidth(
    comm: &std::sync::Arc<dyn longctx::attention::comm::Comm>,
    dev: &candle_core::Device,
    r: usize,
    w: usize,
) -> anyhow::Result<()> {
    use candle_core::{DType, Tensor};
    use std::time::Instant;
    let (next, prev) = (comm.next(), comm.prev());
    let n = 128 << 20;
    let big = Tensor::ones(n, DType::BF16, dev)?;
    for _ in 0..3 {
        comm.all_reduce_sum(&big)?;
    }
    comm.barrier()?;
    let reps = 10;
    let t = Instant::now();
    for _ in 0..reps {
        comm.all_reduce_sum(&big)?;
    }
    comm.barrier()?;
    let s = t.elapsed().as_secs_f64() / reps as f64;
    let bytes = (2 * n) as f64;
    println!(
        "rank {r}: all_reduce 256 MiB bf16: {:.2} ms, bus bandwidth {:.0} GB/s",
        s * 1e3,
        bytes / s * 2.0 * (w - 1) as f64 / w as f64 / 1e9
    );
    let t = Instant::now();
    for _ in 0..reps {
        comm.sendrecv_start(vec![big.clone()], next, prev)?.wait()?;
    }
    comm.barrier()?;
    let s = t.elapsed().as_secs_f64() / reps as f64;
    println!("rank {r}: ring sendrecv 256 MiB: {:.2} ms, {:.0} GB/s per direction", s * 1e3, bytes / s / 1e9);

    Ok(())
}

/// The failure path: rank `f` exits mid-run; the others report how the next collectives end.
#[cfg(feature = "nccl")]
fn dead_peer(
    comm: &std::sync::Arc<dyn longctx::attention::comm::Comm>,
    dev: &candle_core::Device,
    rdzv: &parallel::Rendezvous,
    r: usize,
    f: usize,
) -> anyhow::Result<i32> {
    use candle_core::{DType, Tensor};
    use std::time::Instant;
    let big = Tensor::ones(128 << 20, DType::BF16, dev)?;
    let one = Tensor::ones(1, DType::F32, dev)?;
    comm.barrier()?;
    if r == f {
        println!("rank {r}: exiting in the middle of the run on purpose");
        std::process::exit(3);
    }
    std::thread::sleep(Duration::from_millis(500));
    let t = Instant::now();
    let res = comm.all_reduce_sum(&big).and_then(|y| y.narrow(0, 0, 4)?.to_dtype(DType::F32)?.to_vec1::<f32>());
    println!(
        "rank {r}: all_reduce with a dead peer returned after {:.1} s: {:?}; monitor: {:?}",
        t.elapsed().as_secs_f64(),
        res.as_ref().map(|_| "Ok"),
        rdzv.monitor.failure()
    );
    let again = comm.all_reduce_sum(&one).map(|_| ());
    println!("rank {r}: next call: {again:?}");
    Ok(parallel::launch::PEER_FAILED_EXIT_CODE)
}

fn main() {
    let cli = Cli::parse();
    let code = match cli.cmd {
        Cmd::Launch(args) => match args.into_options().and_then(parallel::launch) {
            Ok(c) => c,
            Err(e) => {
                eprintln!("{e}");
                e.exit_code()
            }
        },
        Cmd::Run(a) => match run(a) {
            Ok(c) => c,
            Err(e) => {
                eprintln!("error: {e}");
                1
            }
        },
    };
    std::process::exit(code);
}

/// Stream ordering between Candle's compute stream and the NCCL stream: the inputs are
/// produced by a slow queue of kernels ending in an elementwise one (whose output Candle
/// passes to cudarc as read-only, so cudarc records no write event for it) and handed to
/// NCCL at once; the outputs are consumed at once. Before the fix (NCCL stream made to
/// wait for the compute stream) NCCL read the inputs before they were written.
#[cfg(feature = "nccl")]
fn ordering_checks(
    comm: &std::sync::Arc<dyn longctx::attention::comm::Comm>,
    dev: &candle_core::Device,
    r: usize,
    w: usize,
) -> anyhow::Result<()> {
    use anyhow::ensure;
    use candle_core::{DType, Tensor};
    let n = 4096;
    // eye·eye·…·(c·ones) = c·ones, exact in f32; 24 GEMMs of 4096³ queue ~50 ms of work.
    let slow = |c: f64| -> candle_core::Result<Tensor> {
        let eye = Tensor::eye(n, DType::F32, dev)?;
        let mut x = (Tensor::ones((n, n), DType::F32, dev)? * c)?;
        for _ in 0..24 {
            x = eye.matmul(&x)?;
        }
        x.affine(1.0, 1.0) // last kernel elementwise: c + 1 everywhere
    };
    let check = |t: &Tensor, want: f32, what: &str| -> anyhow::Result<()> {
        let v = t.flatten_all()?.to_vec1::<f32>()?;
        let bad = v.iter().filter(|&&x| x != want).count();
        ensure!(bad == 0, "ordering: {what}: {bad} of {} elements differ from {want} (first {:?})", v.len(), &v[..4]);
        Ok(())
    };
    for round in 0..3 {
        // all-reduce: Σ_k (k + 1) over ranks.
        let x = slow(r as f64)?;
        let y = comm.all_reduce_sum(&x)?;
        drop(x); // freed while NCCL may still read it: the pool must not hand it out early
        let z = slow(0.0)?; // same size, allocated right after
        check(&y, (w * (w + 1) / 2) as f32, &format!("all_reduce round {round}"))?;
        check(&z, 1.0, &format!("reuse after all_reduce round {round}"))?;
        // ring exchange of a freshly computed tensor.
        let x = slow(r as f64)?;
        let got = comm.sendrecv_start(vec![x], comm.next(), comm.prev())?.wait()?;
        check(&got[0], (comm.prev() + 1) as f32, &format!("sendrecv round {round}"))?;
        // all-gather and all-to-all.
        let ys = comm.all_gather(&slow(r as f64)?)?;
        for (j, y) in ys.iter().enumerate() {
            check(y, (j + 1) as f32, &format!("all_gather part {j} round {round}"))?;
        }
        let xs = (0..w).map(|j| slow((10 * r + j) as f64)).collect::<candle_core::Result<Vec<_>>>()?;
        for (j, y) in comm.all_to_all(xs)?.iter().enumerate() {
            check(y, (10 * j + r + 1) as f32, &format!("all_to_all part {j} round {round}"))?;
        }
    }
    println!("rank {r}: stream ordering checks passed");
    Ok(())
}
