//! `longctx launch`: one process per GPU running a longctx command, torchrun-style.

use anyhow::Result;
use longctx::parallel::LaunchArgs;

/// Runs the ranks and exits with the launcher's status: a failed rank's exit code, 128 +
/// the signal for a signal, 1 for other launcher errors.
pub fn launch(a: LaunchArgs) -> Result<()> {
    let opts = a.into_options()?;
    match longctx::parallel::launch(opts) {
        Ok(0) => Ok(()),
        Ok(code) => std::process::exit(code),
        Err(e) => {
            // A stop signal every rank answered cleanly (training: a checkpoint, then exit 0)
            // is no error; the status still says the run was interrupted.
            let clean = matches!(e, longctx::parallel::launch::LaunchError::Interrupted { clean: true, .. });
            eprintln!("{}{e}", if clean { "" } else { "error: " });
            std::process::exit(e.exit_code());
        }
    }
}
