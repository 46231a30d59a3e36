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
