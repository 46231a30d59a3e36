//! Where a dataset's files are: a file, a directory of files, or a hub dataset id.
//!
//! - A file: read as it is; its format comes from its extension unless given.
//! - A directory: every file below it (recursively, hidden entries skipped, symlinks
//!   followed but never around a loop) whose extension matches the format, sorted by
//!   path, so the order is the same everywhere.
//! - `org/name` or `org/name@revision` (when no such local path exists), or the explicit
//!   form `hf:org/name[@revision]`: a Hugging Face *dataset* repo. It is looked up in the
//!   HF cache (`datasets--org--name/snapshots/<commit>/`); with `HF_HUB_OFFLINE=1` only
//!   the cache is used, otherwise the files of the format are downloaded into the cache
//!   first with hf-hub (the cache dir, token and endpoint come from [`HubOptions`]).
//!   The snapshot directory is then read like a local directory.
//! - Splits: with a split given (the run config's `data.split`, default `train`), a
//!   directory or hub dataset whose file paths name splits (`train-00000-of-00002.parquet`,
//!   `data/validation/x.jsonl`, `test.jsonl.gz`) keeps only that split's files (and
//!   downloads only those); one whose paths name no split is read whole.
//! - Compression: `.jsonl.gz` (gzip) and `.jsonl.zst` (zstd) are JSON lines read through
//!   a streaming decoder.
//! - `.arrow`: a directory written by `datasets`' `save_to_disk` (its `dataset_info.json`
//!   and `state.json` are not data files and are ignored).

use std::path::{Path, PathBuf};

use serde::{Deserialize, Serialize};

use crate::hub::HubOptions;
use crate::{Error, Result};

/// Width of one token in a raw token file (little-endian).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum TokenWidth {
    U16,
    U32,
}

impl TokenWidth {
    pub fn bytes(self) -> usize {
        match self {
            TokenWidth::U16 => 2,
            TokenWidth::U32 => 4,
        }
    }
}

/// File format of a dataset.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Format {
    /// `.jsonl`: one JSON object per line.
    Jsonl,
    /// `.txt`: plain UTF-8 text.
    Text,
    /// `.parquet`.
    Parquet,
    /// `.bin`: raw little-endian tokens (nanoGPT style); the width is a separate setting.
    Tokens,
    /// `.arrow`: Arrow IPC, as `datasets`' `save_to_disk` writes it.
    Arrow,
}

impl Format {
    /// Extensions recognised for this format (file names ending in `.<ext>`).
    pub fn extensions(self) -> &'static [&'static str] {
        match self {
            Format::Jsonl => &["jsonl", "jsonl.gz", "jsonl.zst", "jsonl.zstd"],
            Format::Text => &["txt"],
            Format::Parquet => &["parquet"],
            Format::Tokens => &["bin"],
            Format::Arrow => &["arrow"],
        }
    }

    /// The format a file extension stands for, if any.
    pub fn from_extension(path: &Path) -> Option<Format> {
        let name = path.file_name()?.to_str()?.to_ascii_lowercase();
        [Format::Jsonl, Format::Text, Format::Parquet, Format::Tokens, Format::Arrow]
            .into_iter()
            .find(|f| f.extensions().iter().any(|e| name.strip_suffix(e).is_some_and(|stem| stem.ends_with('.') && stem.len() > 1)))
    }
}

/// Split names a dataset's file paths are recognised by (as the Hugging Face hub does).
pub const SPLIT_NAMES: [&str; 6] = ["train", "validation", "valid", "dev", "test", "eval"];

/// The split a file path (relative to the dataset root) names, if any: a directory named
/// like a split, or a file name starting with one followed by `-`, `_` or `.`.
pub fn split_of(rel: &Path) -> Option<&'static str> {
    let parts: Vec<String> = rel.iter().map(|c| c.to_string_lossy().to_ascii_lowercase()).collect();
    let (name, dirs) = parts.split_last()?;
    let named = |s: &str| name.strip_prefix(s).is_some_and(|r| r.starts_with(['-', '_', '.']));
    SPLIT_NAMES.into_iter().find(|s| dirs.iter().any(|d| d == s)).or_else(|| SPLIT_NAMES.into_iter().find(|s| named(s)))
}

/// Whether `rel` belongs to `split` among `all` (every path of the dataset): when no
/// path names a split, every file does.
pub fn in_split(rel: &Path, split: &str, any_named: bool) -> bool {
    if !any_named {
        return true;
    }
    let split = split.to_ascii_lowercase();
    let parts: Vec<String> = rel.iter().map(|c| c.to_string_lossy().to_ascii_lowercase()).collect();
    let Some((name, dirs)) = parts.split_last() else { return false };
    dirs.contains(&split) || name.strip_prefix(split.as_str()).is_some_and(|r| r.starts_with(['-', '_', '.']))
}

/// Keeps the paths of `split` (relative to `root` for the names); an error naming the
/// splits found when none is `split`.
fn filter_split(root: &Path, files: Vec<PathBuf>, split: &str) -> Result<Vec<PathBuf>> {
    let rel = |p: &Path| p.strip_prefix(root).unwrap_or(p).to_path_buf();
    let mut named: Vec<&str> = files.iter().filter_map(|p| split_of(&rel(p))).collect();
    named.sort_unstable();
    named.dedup();
    let any = !named.is_empty();
    let kept: Vec<PathBuf> = files.into_iter().filter(|p| in_split(&rel(p), split, any)).collect();
    if kept.is_empty() && any {
        return Err(Error::data(
            root,
            format!("no file of split `{split}`; the files name the splits {named:?}: set data.split (--dataset-split) to one, or `*` for every file"),
        ));
    }
    Ok(kept)
}

/// A resolved dataset: its format and its files in reading order.
#[derive(Debug, Clone)]
pub struct Resolved {
    /// The local path the files were found under (file, directory or hub snapshot).
    pub root: PathBuf,
    pub format: Format,
    pub files: Vec<PathBuf>,
}

/// What a `source` string names.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum SourceSpec {
    Local(PathBuf),
    Hub { repo_id: String, revision: String },
}

impl SourceSpec {
    /// An existing path is local; `hf:org/name[@rev]` or a non-existing `org/name[@rev]` is a hub id.
    pub fn parse(s: &str) -> Self {
        if let Some(rest) = s.strip_prefix("hf:") {
            return Self::hub(rest);
        }
        let path = Path::new(s);
        if path.exists() {
            return SourceSpec::Local(path.to_path_buf());
        }
        let id = s.split_once('@').map_or(s, |(id, _)| id);
        let parts: Vec<&str> = id.split('/').collect();
        let part_ok = |p: &str| {
            !p.is_empty() && !p.starts_with(['.', '-']) && p.chars().all(|c| c.is_ascii_alphanumeric() || matches!(c, '-' | '_' | '.'))
        };
        if parts.len() == 2 && parts.iter().all(|p| part_ok(p)) {
            Self::hub(s)
        } else {
            SourceSpec::Local(path.to_path_buf())
        }
    }

    fn hub(s: &str) -> Self {
        match s.split_once('@') {
            Some((id, rev)) if !rev.is_empty() => SourceSpec::Hub { repo_id: id.to_string(), revision: rev.to_string() },
            _ => SourceSpec::Hub { repo_id: s.trim_end_matches('@').to_string(), revision: "main".into() },
        }
    }
}

/// Resolves `source` to a list of files of one format, of `split` when given (see module docs).
pub fn resolve(source: &str, format: Option<Format>, split: Option<&str>, hub: &HubOptions) -> Result<Resolved> {
    let root = match SourceSpec::parse(source) {
        SourceSpec::Local(p) => p,
        SourceSpec::Hub { repo_id, revision } => {
            if !source.starts_with("hf:") {
                check_not_local_looking(&repo_id, hub)?; // (`hf:` says it is a hub id)
            }
            hub_snapshot(&repo_id, &revision, format, split, hub)?
        }
    };
    resolve_split(&root, format, split)
}

/// [`resolve_local`], then only the files of `split` (a directory whose paths name splits).
pub fn resolve_split(root: &Path, format: Option<Format>, split: Option<&str>) -> Result<Resolved> {
    let mut r = resolve_local(root, format)?;
    if let (Some(split), true) = (split, root.is_dir()) {
        r.files = filter_split(root, r.files, split)?;
    }
    Ok(r)
}

/// Resolves a local file or directory (see module docs).
pub fn resolve_local(root: &Path, format: Option<Format>) -> Result<Resolved> {
    if root.is_file() {
        let format = match format.or_else(|| Format::from_extension(root)) {
            Some(f) => f,
            None => {
                return Err(Error::data(
                    root,
                    "cannot tell the format from the extension; expected .jsonl(.gz/.zst), .txt, .parquet, .arrow or .bin, \
                     or set the dataset format explicitly",
                ))
            }
        };
        return Ok(Resolved { root: root.to_path_buf(), format, files: vec![root.to_path_buf()] });
    }
    if !root.is_dir() {
        return Err(Error::data(root, "dataset not found: no such file or directory (and not a hub id `org/name`)"));
    }
    let mut all = Vec::new();
    walk(root, &mut all, &mut Vec::new())?;
    all.sort();
    let format = match format {
        Some(f) => f,
        None => {
            let mut found: Vec<Format> = all.iter().filter_map(|p| Format::from_extension(p)).collect();
            found.sort_by_key(|f| *f as u8);
            found.dedup();
            match found.as_slice() {
                [one] => *one,
                [] => return Err(Error::data(root, "no dataset files (.jsonl(.gz/.zst), .txt, .parquet, .arrow, .bin) in this directory")),
                many => {
                    return Err(Error::data(root, format!("files of several formats ({many:?}) in this directory; set the dataset format")))
                }
            }
        }
    };
    let files: Vec<PathBuf> = all.into_iter().filter(|p| Format::from_extension(p) == Some(format)).collect();
    if files.is_empty() {
        return Err(Error::data(root, format!("no files with extension {:?} in this directory", format.extensions())));
    }
    Ok(Resolved { root: root.to_path_buf(), format, files })
}

/// All regular files below `dir` (symlinks followed, hidden names skipped). A directory
/// that is its own ancestor on the current path (a symlink loop, e.g. `data/up -> ..`) is
/// not entered again, with a note; `ancestors` holds the (device, inode) of the path.
fn walk(dir: &Path, out: &mut Vec<PathBuf>, ancestors: &mut Vec<(u64, u64)>) -> Result<()> {
    use std::os::unix::fs::MetadataExt;
    let meta = std::fs::metadata(dir).map_err(|e| Error::io(dir, e))?;
    let id = (meta.dev(), meta.ino());
    if ancestors.contains(&id) {
        eprintln!("note: {}: a symlink loop back to a directory being read; not followed", dir.display());
        return Ok(());
    }
    ancestors.push(id);
    let entries = std::fs::read_dir(dir).map_err(|e| Error::io(dir, e))?;
    for entry in entries {
        let entry = entry.map_err(|e| Error::io(dir, e))?;
        let path = entry.path();
        if entry.file_name().to_string_lossy().starts_with('.') {
            continue;
        }
        if path.is_dir() {
            walk(&path, out, ancestors)?;
        } else if path.is_file() {
            out.push(path);
        }
    }
    ancestors.pop();
    Ok(())
}

fn is_commit_hash(s: &str) -> bool {
    s.len() == 40 && s.chars().all(|c| c.is_ascii_hexdigit())
}

/// The cache folder of a dataset repo (hf-hub's naming: `datasets--org--name`).
fn dataset_folder(cache_dir: &Path, repo_id: &str) -> PathBuf {
    let repo = hf_hub::Repo::new(repo_id.to_string(), hf_hub::RepoType::Dataset);
    cache_dir.join(repo.folder_name())
}

/// The snapshot directory of `repo_id@revision`, downloading the dataset's files of
/// `format` (all known formats when `None`) first unless offline.
/// A dataset hub id that is not cached and looks like a mistyped local path
/// ([`crate::hub::cache::local_looking`], or a name ending in a data file's extension such
/// as `data/train.jsonl`) is an error before any download.
pub fn check_not_local_looking(repo_id: &str, hub: &HubOptions) -> Result<()> {
    if dataset_folder(&hub.cache_dir, repo_id).is_dir() {
        return Ok(());
    }
    if let Some(msg) = crate::hub::cache::local_looking(repo_id, "dataset") {
        return Err(Error::data(repo_id, msg));
    }
    // `data/train.jsonl` names a file by its extension even where `data/` is missing.
    if Format::from_extension(Path::new(repo_id)).is_some() {
        let dir = Path::new(repo_id).parent().map_or(String::new(), |d| d.display().to_string());
        return Err(Error::data(
            repo_id,
            format!(
                "dataset not found: no such file, nor a directory `{dir}`; not a hub id either (it ends in a file \
                 extension, and no such hub dataset is cached); check the path, or name a hub dataset `hf:{repo_id}`"
            ),
        ));
    }
    Ok(())
}

fn hub_snapshot(repo_id: &str, revision: &str, format: Option<Format>, split: Option<&str>, hub: &HubOptions) -> Result<PathBuf> {
    crate::hub::cache::check_ref_name("revision", &dataset_folder(&hub.cache_dir, repo_id), revision)?;
    if !hub.offline {
        download(repo_id, revision, format, split, hub)?;
    }
    let folder = dataset_folder(&hub.cache_dir, repo_id);
    let how = format!(
        "fetch it while online (without HF_HUB_OFFLINE, or `huggingface-cli download --repo-type dataset {repo_id}`) \
         into the cache {}, or pass a local path",
        hub.cache_dir.display()
    );
    if !folder.is_dir() {
        return Err(Error::data(&folder, format!("dataset `{repo_id}` is not in the Hugging Face cache; {how}")));
    }
    crate::hub::cache::check_ref_name("revision", &folder, revision)?;
    if is_commit_hash(revision) && folder.join("snapshots").join(revision).is_dir() {
        return Ok(folder.join("snapshots").join(revision));
    }
    let ref_file = folder.join("refs").join(revision);
    match std::fs::read_to_string(&ref_file) {
        Ok(c) if !c.trim().is_empty() => {
            crate::hub::cache::check_ref_name("ref file content", &ref_file, c.trim())?;
            Ok(folder.join("snapshots").join(c.trim()))
        }
        _ => Err(Error::data(&ref_file, format!("revision `{revision}` of dataset `{repo_id}` is not in the cache; {how}"))),
    }
}

/// Downloads the files of a dataset repo that have the format's extensions (of `split`
/// only, when the repo's file names name splits).
fn download(repo_id: &str, revision: &str, format: Option<Format>, split: Option<&str>, hub: &HubOptions) -> Result<()> {
    use hf_hub::api::sync::ApiBuilder;
    let folder = dataset_folder(&hub.cache_dir, repo_id);
    let fail = |what: String| {
        Error::data(
            &folder,
            format!("cannot download dataset `{repo_id}@{revision}`: {what} (no network? set HF_HUB_OFFLINE=1 to use the cache only)"),
        )
    };
    let mut builder = ApiBuilder::new().with_cache_dir(hub.cache_dir.clone()).with_token(hub.token.clone()).with_progress(hub.progress);
    if let Some(ep) = &hub.endpoint {
        builder = builder.with_endpoint(ep.clone());
    }
    let api = builder.build().map_err(|e| fail(e.to_string()))?;
    let repo = api.repo(hf_hub::Repo::with_revision(repo_id.to_string(), hf_hub::RepoType::Dataset, revision.to_string()));
    let info = repo.info().map_err(|e| fail(e.to_string()))?;
    let wanted = |name: &str| match format {
        Some(f) => Format::from_extension(Path::new(name)) == Some(f),
        None => Format::from_extension(Path::new(name)).is_some(),
    };
    let mut names: Vec<String> = info.siblings.into_iter().map(|s| s.rfilename).filter(|n| wanted(n)).collect();
    names.sort();
    if let Some(split) = split {
        let any = names.iter().any(|n| split_of(Path::new(n)).is_some());
        names.retain(|n| in_split(Path::new(n), split, any));
    }
    for name in names {
        repo.get(&name).map_err(|e| fail(format!("{name}: {e}")))?;
    }
    Ok(())
}
