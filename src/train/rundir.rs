//! The output directory of a run: one run at a time, and a finished or stopped run is
//! never overwritten by accident.
//!
//! - [`RunDirLock`]: `<output_dir>/.longctx.lock` holds `pid` and `host` of the run using
//!   the directory, under an exclusive `flock` for the life of the run. A second run
//!   finds the lock held (or, on the same host, a live pid in it) and refuses with both
//!   named. A lock left by a process that died (SIGKILL, power loss) is taken over with
//!   a note. The file stays (emptied) when the run ends: removing it would let two
//!   newcomers lock two different files.
//! - [`prepare`]: a fresh run (not `--resume`) refuses a directory that holds a run
//!   (checkpoint, metrics or export) unless `--overwrite`, which removes them first.
//! - [`write_config`]: the resolved config of the latest start, `<output_dir>/config.toml`.
//!
//! Distributed runs: rank 0 (the process that writes metrics, checkpoints and exports)
//! holds the lock.

use crate::train::checkpoint::CHECKPOINT_DIR;
use crate::{Error, Result};
use std::io::{Read, Seek, Write};
use std::os::fd::AsRawFd;
use std::path::{Path, PathBuf};

pub const LOCK_FILE: &str = ".longctx.lock";

/// What a run leaves in its output directory (besides the lock).
const RUN_FILES: [&str; 7] = [
    CHECKPOINT_DIR,
    ".checkpoint.old",
    ".checkpoint.tmp",
    "metrics.jsonl",
    ".metrics.jsonl.tmp",
    "export",
    crate::train::metrics::TENSORBOARD_DIR,
];

/// The lock of an output directory, held until dropped.
#[derive(Debug)]
pub struct RunDirLock {
    path: PathBuf,
    file: std::fs::File,
}

/// `pid` and `host` written in a lock file.
#[derive(Debug, Clone, PartialEq, Eq)]
struct Holder {
    pid: i32,
    host: String,
}

fn hostname() -> String {
    let mut buf = [0u8; 256];
    // SAFETY: gethostname writes at most `buf.len()` bytes into the buffer.
    let rc = unsafe { libc::gethostname(buf.as_mut_ptr().cast(), buf.len()) };
    if rc != 0 {
        return "unknown".into();
    }
    let end = buf.iter().position(|&b| b == 0).unwrap_or(buf.len());
    String::from_utf8_lossy(&buf[..end]).into_owned()
}

fn parse_holder(text: &str) -> Option<Holder> {
    let mut pid = None;
    let mut host = String::new();
    for line in text.lines() {
        match line.split_once('=') {
            Some(("pid", v)) => pid = v.trim().parse::<i32>().ok().filter(|&p| p > 0),
            Some(("host", v)) => host = v.trim().to_string(),
            _ => {}
        }
    }
    Some(Holder { pid: pid?, host })
}

/// Whether process `pid` exists on this host (kill(pid, 0): EPERM means it exists).
fn alive(pid: i32) -> bool {
    // SAFETY: signal 0 only checks for existence and permission; nothing is sent.
    let rc = unsafe { libc::kill(pid, 0) };
    rc == 0 || std::io::Error::last_os_error().raw_os_error() == Some(libc::EPERM)
}

impl RunDirLock {
    /// Locks `output_dir` (creating it) for this process. See the module doc.
    pub fn acquire(output_dir: &Path) -> Result<Self> {
        std::fs::create_dir_all(output_dir).map_err(|e| Error::io(output_dir, e))?;
        let path = output_dir.join(LOCK_FILE);
        let mut file =
            std::fs::OpenOptions::new().read(true).write(true).create(true).truncate(false).open(&path).map_err(|e| Error::io(&path, e))?;
        let mut text = String::new();
        // A lock file that is not text is treated as empty (and overwritten once locked).
        let _ = file.read_to_string(&mut text);
        let previous = parse_holder(&text);
        let in_use = |h: Option<&Holder>| {
            let who = h.map_or("another process".to_string(), |h| format!("pid {} on host {}", h.pid, h.host));
            Error::config(
                &path,
                "output_dir",
                format!(
                    "the output directory {} is in use by another longctx run ({who}); wait for it to end, stop it, or choose \
                     another --output-dir (if no run uses it, delete this lock file)",
                    output_dir.display()
                ),
            )
        };
        // SAFETY: flock on a file descriptor we own.
        if unsafe { libc::flock(file.as_raw_fd(), libc::LOCK_EX | libc::LOCK_NB) } != 0 {
            return Err(in_use(previous.as_ref()));
        }
        let me = std::process::id() as i32;
        let host = hostname();
        if let Some(h) = previous.as_ref().filter(|h| h.pid != me) {
            // Some filesystems accept flock without locking: on this host, a live pid wins.
            if h.host == host && alive(h.pid) {
                return Err(in_use(Some(h)));
            }
            eprintln!(
                "note: {}: taking over the lock of pid {} on host {} (that run is no longer running)",
                path.display(),
                h.pid,
                if h.host.is_empty() { "?" } else { &h.host }
            );
        }
        let body = format!("pid={me}\nhost={host}\n");
        let write = |f: &mut std::fs::File| -> std::io::Result<()> {
            f.set_len(0)?;
            f.rewind()?;
            f.write_all(body.as_bytes())?;
            f.sync_all()
        };
        write(&mut file).map_err(|e| Error::io(&path, e))?;
        Ok(Self { path, file })
    }

    pub fn path(&self) -> &Path {
        &self.path
    }
}

impl Drop for RunDirLock {
    fn drop(&mut self) {
        // Empty the file (a later run then finds no holder), then unlock explicitly: the
        // lock belongs to the open file, which a process forked meanwhile by another
        // thread (a test spawning a child, say) shares until its exec closes it; closing
        // our descriptor alone would leave the directory locked until then.
        let _ = self.file.set_len(0);
        let _ = self.file.sync_all();
        // SAFETY: flock on a file descriptor we own.
        unsafe { libc::flock(self.file.as_raw_fd(), libc::LOCK_UN) };
    }
}

/// Whether `output_dir` holds a run, and which of its files.
pub fn run_files(output_dir: &Path) -> Vec<&'static str> {
    RUN_FILES.iter().copied().filter(|f| output_dir.join(f).exists()).collect()
}

/// Bytes the previous run's files in `output_dir` take (what `--overwrite` frees before
/// the new run writes): every file under the entries of [`run_files`], links not followed.
pub fn run_bytes(output_dir: &Path) -> u64 {
    fn walk(p: &Path) -> u64 {
        match std::fs::symlink_metadata(p) {
            Ok(m) if m.is_dir() => std::fs::read_dir(p).map_or(0, |rd| rd.flatten().map(|e| walk(&e.path())).sum()),
            Ok(m) if m.is_file() => m.len(),
            _ => 0,
        }
    }
    run_files(output_dir).iter().map(|f| walk(&output_dir.join(f))).sum()
}

/// Before a run starts writing into `output_dir` (call with the lock held): a resumed run
/// uses what is there; a fresh run refuses a directory holding a run unless `overwrite`,
/// which removes the previous run's checkpoint, metrics and export first.
pub fn prepare(output_dir: &Path, resume: bool, overwrite: bool) -> Result<()> {
    if resume && overwrite {
        return Err(Error::Setting("--resume continues the run in the output directory and --overwrite replaces it: give one".into()));
    }
    if resume {
        return Ok(());
    }
    let found = run_files(output_dir);
    if found.is_empty() {
        return Ok(());
    }
    if !overwrite {
        return Err(Error::config(
            output_dir,
            "output_dir",
            format!(
                "holds a run ({}); continue it with --resume, replace it with --overwrite, or choose another --output-dir",
                found.join(", ")
            ),
        ));
    }
    eprintln!("note: --overwrite: removing the previous run's {} in {}", found.join(", "), output_dir.display());
    for f in found {
        let p = output_dir.join(f);
        let r = if p.is_dir() { std::fs::remove_dir_all(&p) } else { std::fs::remove_file(&p) };
        r.map_err(|e| Error::io(&p, e))?;
    }
    Ok(())
}

/// The resolved config of the run's latest start, as `train` prints it at the start (and
/// `train --quiet` does not): `<output_dir>/config.toml`. Not a run file: a run that fails
/// before its first step leaves it, and the next start replaces it.
pub const CONFIG_FILE: &str = "config.toml";

/// Writes [`CONFIG_FILE`] (call with the lock held, after [`prepare`]).
pub fn write_config(cfg: &crate::train::config::RunConfig) -> Result<()> {
    let text = toml::to_string(cfg).map_err(|e| Error::Setting(format!("the run config as TOML: {e}")))?;
    let path = cfg.output_dir.join(CONFIG_FILE);
    let tmp = cfg.output_dir.join(format!(".{CONFIG_FILE}.tmp"));
    std::fs::write(&tmp, format!("# the resolved config of this run's latest start (longctx train)\n{text}"))
        .map_err(|e| Error::io(&tmp, e))?;
    std::fs::rename(&tmp, &path).map_err(|e| Error::io(&path, e))
}

/// Marker rank 0 writes for [`check_shared`].
const SHARED_CHECK: &str = ".longctx-shared-check";

/// Every rank of a launched run must see rank 0's output directory: each writes its
/// optimizer shard into the checkpoint there, and a node-local directory would fail only
/// at the first checkpoint, after hours. Rank 0 writes a marker with a fresh number, the
/// number goes to every rank by an all-reduce (a barrier after the write), and each rank
/// reads the marker; a rank that does not find it says so, and every rank stops.
/// `look_in`: where this rank looks (the output directory; another in the test of a
/// node-local directory).
pub fn check_shared(
    output_dir: &Path,
    look_in: &Path,
    comm: &std::sync::Arc<dyn longctx_attention::comm::Comm>,
    device: &candle_core::Device,
) -> Result<()> {
    use crate::train::zero::{all_reduce_scalar, ranks_flagging};
    if comm.world() == 1 {
        return Ok(());
    }
    let rank = comm.rank();
    let mine = if rank == 0 {
        // Below 2^53: exact in the f64 all-reduce.
        let t = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map(|d| d.as_nanos()).unwrap_or(0);
        let n = ((t as u64) ^ ((std::process::id() as u64) << 32)) & ((1 << 52) - 1);
        let path = output_dir.join(SHARED_CHECK);
        let tmp = output_dir.join(format!("{SHARED_CHECK}.tmp"));
        std::fs::write(&tmp, n.to_string()).map_err(|e| Error::io(&tmp, e))?;
        std::fs::rename(&tmp, &path).map_err(|e| Error::io(&path, e))?;
        n as f64
    } else {
        0.0
    };
    let want = all_reduce_scalar(comm, mine, device)?;
    let seen = std::fs::read_to_string(look_in.join(SHARED_CHECK)).ok().and_then(|s| s.trim().parse::<f64>().ok());
    let ok = seen == Some(want);
    // (a rank that does not see the marker counts itself even when rank 0 stopped the
    // world on the count before this rank got the result, and reports its own finding)
    let missing = ranks_flagging(comm, !ok, device);
    if rank == 0 {
        let _ = std::fs::remove_file(output_dir.join(SHARED_CHECK));
    }
    let missing = missing?;
    if !ok {
        return Err(Error::Setting(format!(
            "rank {rank} does not see rank 0's output directory {} (no {SHARED_CHECK} written by rank 0 there): every rank writes its \
             checkpoint shard into it, so it must be one shared directory (a network file system) on every node; set --output-dir to a shared path",
            output_dir.display()
        )));
    }
    if missing > 0.0 {
        return Err(Error::Setting(format!(
            "{missing} rank(s) do not see the output directory {}: it must be one shared directory on every node (see their errors); set --output-dir to a shared path",
            output_dir.display()
        )));
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    #[test]
    fn run_bytes_counts_the_previous_runs_files_only() {
        let d = std::env::temp_dir().join(format!("longctx-run-bytes-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&d);
        std::fs::create_dir_all(d.join(super::CHECKPOINT_DIR).join("sub")).unwrap();
        std::fs::write(d.join(super::CHECKPOINT_DIR).join("a"), [0u8; 100]).unwrap();
        std::fs::write(d.join(super::CHECKPOINT_DIR).join("sub/b"), [0u8; 20]).unwrap();
        std::fs::write(d.join("notes.txt"), [0u8; 7]).unwrap(); // not a run file: kept, not counted
        assert_eq!(super::run_bytes(&d), 120);
        let _ = std::fs::remove_dir_all(&d);
    }

    use super::*;

    #[test]
    fn holder_lines_parse() {
        assert_eq!(parse_holder("pid=12\nhost=a\n"), Some(Holder { pid: 12, host: "a".into() }));
        assert_eq!(parse_holder(""), None);
        assert_eq!(parse_holder("pid=-3\n"), None);
        assert!(alive(std::process::id() as i32));
    }

    /// A copy of the lock's descriptor held elsewhere (as a child forked by another thread
    /// holds one until its exec) does not keep the directory locked once the run's lock
    /// is dropped; while the lock lives, a second one is refused.
    #[test]
    fn a_dropped_lock_is_released_even_if_its_descriptor_was_copied() {
        let tmp = tempfile::tempdir().unwrap();
        let lock = RunDirLock::acquire(tmp.path()).unwrap();
        let e = RunDirLock::acquire(tmp.path()).unwrap_err().to_string();
        assert!(e.contains("in use by another longctx run"), "{e}");
        // SAFETY: dup of a descriptor we own; the copy is closed below.
        let copy = unsafe { libc::dup(lock.file.as_raw_fd()) };
        assert!(copy >= 0);
        drop(lock);
        let again = RunDirLock::acquire(tmp.path());
        // SAFETY: the descriptor made by dup above, closed once.
        unsafe { libc::close(copy) };
        again.unwrap();
    }
}
