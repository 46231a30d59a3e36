//! Output files written atomically: into a hidden temporary sibling, synced, then renamed
//! over the destination, so a reader never sees half a file.

use std::io::Write;
use std::path::{Path, PathBuf};

use crate::{Error, Result};

/// A hidden temporary sibling of `path` that keeps its extension (the PNG writer picks
/// the format from it).
pub fn temp_sibling(path: &Path) -> PathBuf {
    let name = path.file_name().map(|n| n.to_string_lossy().into_owned()).unwrap_or_else(|| "out".into());
    let ext = path.extension().map(|e| format!(".{}", e.to_string_lossy())).unwrap_or_default();
    path.with_file_name(format!(".{name}.tmp-{}{ext}", std::process::id()))
}

/// Moves a finished temporary file into place.
pub fn commit(tmp: &Path, path: &Path) -> Result<()> {
    if let Ok(f) = std::fs::File::open(tmp) {
        let _ = f.sync_all();
    }
    std::fs::rename(tmp, path).map_err(|e| {
        let _ = std::fs::remove_file(tmp);
        Error::io(path, e)
    })
}

/// Writes `bytes` to `path` atomically.
pub fn write_atomic(path: &Path, bytes: &[u8]) -> Result<()> {
    let tmp = temp_sibling(path);
    let res = (|| {
        let mut f = std::fs::File::create(&tmp)?;
        f.write_all(bytes)?;
        f.sync_all()
    })();
    if let Err(e) = res {
        let _ = std::fs::remove_file(&tmp);
        return Err(Error::io(&tmp, e));
    }
    commit(&tmp, path)
}

/// Pretty JSON of `value`, written atomically.
pub fn write_json<T: serde::Serialize>(path: &Path, value: &T) -> Result<()> {
    let mut text = serde_json::to_string_pretty(value).map_err(|e| Error::Setting(format!("{}: {e}", path.display())))?;
    text.push('\n');
    write_atomic(path, text.as_bytes())
}

/// Creates the output directory (and its parents).
pub fn ensure_dir(dir: &Path) -> Result<()> {
    std::fs::create_dir_all(dir).map_err(|e| Error::io(dir, e))
}

/// The files of one evaluation, replaced together: each is written to a temporary sibling
/// first, and only when every one of them is complete are they renamed into place and the
/// files of an earlier run that this one does not write removed. A run that fails while
/// writing leaves the previous run's set as it was (its temporaries are removed). Two runs
/// at the same moment on one directory still race file by file; the last rename wins.
#[derive(Default)]
pub struct OutputSet {
    /// (temporary, destination), in the order they were staged.
    files: Vec<(PathBuf, PathBuf)>,
}

impl OutputSet {
    /// Where to write `dest` for now.
    pub fn stage(&mut self, dest: &Path) -> PathBuf {
        let tmp = dest.with_file_name(format!(".staged-{}", temp_sibling(dest).file_name().unwrap_or_default().to_string_lossy()));
        self.files.push((tmp.clone(), dest.to_path_buf()));
        tmp
    }

    /// `bytes` staged for `dest`.
    pub fn write(&mut self, dest: &Path, bytes: &[u8]) -> Result<()> {
        let tmp = self.stage(dest);
        write_atomic(&tmp, bytes)
    }

    /// Pretty JSON staged for `dest`.
    pub fn write_json<T: serde::Serialize>(&mut self, dest: &Path, value: &T) -> Result<()> {
        let tmp = self.stage(dest);
        write_json(&tmp, value)
    }

    /// Moves every staged file into place, then removes `stale` (outputs of an earlier run
    /// that this run does not produce).
    pub fn commit(mut self, stale: &[PathBuf]) -> Result<()> {
        let files = std::mem::take(&mut self.files);
        for (i, (tmp, dest)) in files.iter().enumerate() {
            if let Err(e) = commit(tmp, dest) {
                for (t, _) in &files[i + 1..] {
                    let _ = std::fs::remove_file(t);
                }
                return Err(e);
            }
        }
        for p in stale {
            match std::fs::remove_file(p) {
                Ok(()) => {}
                Err(e) if e.kind() == std::io::ErrorKind::NotFound => {}
                Err(e) => return Err(Error::io(p, e)),
            }
        }
        Ok(())
    }
}

impl Drop for OutputSet {
    fn drop(&mut self) {
        for (tmp, _) in &self.files {
            let _ = std::fs::remove_file(tmp);
        }
    }
}
