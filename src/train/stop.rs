//! Stopping a run on request: SIGINT (Ctrl-C) or SIGTERM (a scheduler's preemption)
//! asks the trainer to write a checkpoint at the next step boundary and exit; a second
//! signal exits at once (the last complete checkpoint stands: checkpoints are swapped in
//! atomically).
//!
//! The handler only records the signal number in an atomic and writes one line to
//! stderr (both async-signal-safe); the trainer reads the flag at each step boundary and,
//! with several ranks, all-reduces it with the step's loss so that every rank stops
//! after the same step (see `trainer.rs`).

use crate::{Error, Result};
use std::sync::atomic::{AtomicBool, AtomicI32, Ordering};
use std::sync::Arc;

/// A stop request shared between signal handlers (or a test) and the trainer: the
/// number of the first signal received, 0 for none; and whether the run has a complete
/// checkpoint yet (what a second signal's message says).
#[derive(Debug, Clone, Default)]
pub struct StopFlag(Arc<AtomicI32>, Arc<AtomicBool>);

impl StopFlag {
    pub fn new() -> Self {
        Self::default()
    }

    /// Ask for a stop as signal `sig` would (tests, embedders).
    pub fn request(&self, sig: i32) {
        let _ = self.0.compare_exchange(0, sig, Ordering::SeqCst, Ordering::SeqCst);
    }

    /// The run has a complete checkpoint (written by it, or the one it resumed from).
    pub fn checkpoint_exists(&self) {
        self.1.store(true, Ordering::SeqCst);
    }

    /// The signal that asked for a stop, if any.
    pub fn requested(&self) -> Option<i32> {
        match self.0.load(Ordering::SeqCst) {
            0 => None,
            s => Some(s),
        }
    }

    /// Routes SIGINT and SIGTERM to this flag for the rest of the process: the first
    /// sets it (and says so on stderr), a second exits at once with status 128 + signal.
    /// `saves`: whether the run writes checkpoints (`train.save`), for the first message.
    pub fn install_signal_handlers(&self, saves: bool) -> Result<()> {
        for sig in [signal_hook::consts::SIGINT, signal_hook::consts::SIGTERM] {
            let (flag, checkpointed) = (self.0.clone(), self.1.clone());
            let handler = move || {
                const FIRST_SAVE: &[u8] =
                    b"\nstop requested: a checkpoint is written at the end of the current step (signal again to exit at once)\n";
                const FIRST_NO_SAVE: &[u8] =
                    b"\nstop requested: the run stops at the end of the current step, saving nothing (train.save = false; signal again to exit at once)\n";
                let first = if saves { FIRST_SAVE } else { FIRST_NO_SAVE };
                const SECOND: &[u8] = b"\nsecond stop signal: exiting now; the last complete checkpoint stands\n";
                const SECOND_NONE: &[u8] =
                    b"\nsecond stop signal: exiting now; no checkpoint was written yet, so this run's steps are lost\n";
                if flag.compare_exchange(0, sig, Ordering::SeqCst, Ordering::SeqCst).is_ok() {
                    write_stderr(first);
                } else {
                    write_stderr(if checkpointed.load(Ordering::SeqCst) { SECOND } else { SECOND_NONE });
                    signal_hook::low_level::exit(128 + sig);
                }
            };
            // SAFETY: the handler only does atomic operations, write(2) and _exit(2), all
            // async-signal-safe; it allocates nothing and takes no lock.
            unsafe { signal_hook::low_level::register(sig, handler) }
                .map_err(|e| Error::Setting(format!("cannot install the handler of signal {sig}: {e}")))?;
        }
        Ok(())
    }
}

/// write(2) of a static message to stderr (async-signal-safe; errors ignored).
fn write_stderr(msg: &[u8]) {
    // SAFETY: writes `msg.len()` bytes from a valid static buffer to fd 2.
    unsafe {
        libc::write(2, msg.as_ptr().cast(), msg.len());
    }
}

/// `SIGINT`, `SIGTERM` or `signal N`.
pub fn signal_name(sig: i32) -> String {
    match sig {
        libc::SIGINT => "SIGINT".into(),
        libc::SIGTERM => "SIGTERM".into(),
        s => format!("signal {s}"),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_first_request_is_kept() {
        let f = StopFlag::new();
        assert_eq!(f.requested(), None);
        f.request(libc::SIGTERM);
        f.request(libc::SIGINT);
        assert_eq!(f.requested(), Some(libc::SIGTERM));
        assert_eq!(signal_name(libc::SIGINT), "SIGINT");
    }
}
