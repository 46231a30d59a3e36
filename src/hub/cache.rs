//! Resolving `--model`: `builtin:NAME`, a local directory, or a Hugging Face hub id
//! (`org/name`, optionally `org/name@revision`) looked up in the HF cache and downloaded
//! if needed; [`model_config`] reads only a model's config.json.
//!
//! Cache layout (shared with Python's huggingface_hub / transformers):
//! ```text
//! <cache>/models--org--name/refs/<revision>        the commit hash the revision points to
//! <cache>/models--org--name/snapshots/<hash>/<file> the files (often symlinks into blobs/)
//! <cache>/models--org--name/blobs/<etag>
//! ```
//! The cache directory follows huggingface_hub exactly: `HF_HUB_CACHE`, else the legacy
//! `HUGGINGFACE_HUB_CACHE`, else `$HF_HOME/hub`, else `$XDG_CACHE_HOME/huggingface/hub`,
//! else `~/.cache/huggingface/hub`. (hf-hub 0.4 itself only honours `HF_HOME`, so we
//! compute the directory and hand it over.) `HF_HUB_OFFLINE` (or `TRANSFORMERS_OFFLINE`)
//! set to 1/ON/YES/TRUE means the network is never touched.

use std::path::{Path, PathBuf};

use serde_json::Value;

use super::config::{config_path, read_config, CONFIG_FILE};
use super::export::TOKENIZER_FILES;
use super::load::{INDEX_FILE, SINGLE_FILE};
use crate::model::LlamaConfig;
use crate::{Error, Result};

/// Where and how to look models up on the hub.
#[derive(Debug, Clone)]
pub struct HubOptions {
    /// The hub cache directory (the one holding `models--org--name` folders).
    pub cache_dir: PathBuf,
    /// Never touch the network; everything must already be in `cache_dir`.
    pub offline: bool,
    /// Access token for gated/private models (`HF_TOKEN`, else `$HF_HOME/token`).
    pub token: Option<String>,
    /// Hub endpoint (`HF_ENDPOINT`), default https://huggingface.co.
    pub endpoint: Option<String>,
    /// Show download progress bars.
    pub progress: bool,
}

fn non_empty(v: Option<String>) -> Option<String> {
    v.filter(|s| !s.trim().is_empty())
}

/// `~/x` -> `$HOME/x`, like Python's `os.path.expanduser`.
fn expand_home(p: String, home: &Option<PathBuf>) -> PathBuf {
    match (p.strip_prefix("~/"), home) {
        (Some(rest), Some(h)) => h.join(rest),
        _ if p == "~" => home.clone().unwrap_or_else(|| PathBuf::from(p)),
        _ => PathBuf::from(p),
    }
}

/// huggingface_hub's truthy values for boolean environment variables.
pub fn env_flag_true(v: Option<&str>) -> bool {
    v.is_some_and(|v| matches!(v.trim().to_ascii_uppercase().as_str(), "1" | "ON" | "YES" | "TRUE"))
}

impl HubOptions {
    /// Options from the process environment (see module docs).
    pub fn from_env() -> Self {
        Self::from_vars(|k| std::env::var(k).ok(), dirs_home())
    }

    /// Options from a variable lookup (`var(name)`) and home directory: the pure core of
    /// [`HubOptions::from_env`], testable without touching the process environment.
    pub fn from_vars(var: impl Fn(&str) -> Option<String>, home: Option<PathBuf>) -> Self {
        let get = |k: &str| non_empty(var(k));
        let hf_home = match get("HF_HOME") {
            Some(h) => expand_home(h, &home),
            None => {
                let xdg = get("XDG_CACHE_HOME")
                    .map(|x| expand_home(x, &home))
                    .or_else(|| home.as_ref().map(|h| h.join(".cache")))
                    .unwrap_or_else(|| PathBuf::from(".cache"));
                xdg.join("huggingface")
            }
        };
        let cache_dir = get("HF_HUB_CACHE")
            .or_else(|| get("HUGGINGFACE_HUB_CACHE"))
            .map(|c| expand_home(c, &home))
            .unwrap_or_else(|| hf_home.join("hub"));
        let offline = env_flag_true(get("HF_HUB_OFFLINE").or_else(|| get("TRANSFORMERS_OFFLINE")).as_deref());
        let token = get("HF_TOKEN").or_else(|| {
            let path = get("HF_TOKEN_PATH").map(|p| expand_home(p, &home)).unwrap_or_else(|| hf_home.join("token"));
            non_empty(std::fs::read_to_string(path).ok()).map(|t| t.trim().to_string())
        });
        Self { cache_dir, offline, token, endpoint: get("HF_ENDPOINT"), progress: true }
    }

    /// Offline lookups in an explicit cache directory (tests, air-gapped machines).
    pub fn offline_in(cache_dir: impl Into<PathBuf>) -> Self {
        Self { cache_dir: cache_dir.into(), offline: true, token: None, endpoint: None, progress: false }
    }
}

fn dirs_home() -> Option<PathBuf> {
    std::env::var_os("HOME").filter(|h| !h.is_empty()).map(PathBuf::from)
}

/// What `--model` (or `model.source`) named.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum ModelSpec {
    /// `builtin:NAME`: a model the trainer builds with seeded random weights, no files
    /// (see [`crate::model::init`]).
    Builtin(String),
    /// A path: a model directory (or, for [`model_config`], a config.json).
    Local(PathBuf),
    /// A hub id and its revision (`main` unless `@rev` is given).
    Hub { repo_id: String, revision: String },
}

impl ModelSpec {
    /// `builtin:NAME` is a built-in model; an existing path is a local directory; `org/name`
    /// or `org/name@rev` (or a bare legacy `name`) is a hub id; anything else is a local
    /// path that does not exist.
    pub fn parse(s: &str) -> Self {
        if let Some(name) = s.strip_prefix("builtin:") {
            return ModelSpec::Builtin(name.to_string());
        }
        let path = Path::new(s);
        if path.exists() {
            return ModelSpec::Local(path.to_path_buf());
        }
        let (id, rev) = match s.split_once('@') {
            Some((id, rev)) if !rev.is_empty() => (id, rev),
            _ => (s, "main"),
        };
        let part_ok = |p: &str| {
            !p.is_empty()
                && !p.starts_with(['.', '-'])
                && !p.contains("..")
                && p.chars().all(|c| c.is_ascii_alphanumeric() || matches!(c, '-' | '_' | '.'))
        };
        let parts: Vec<&str> = id.split('/').collect();
        if (1..=2).contains(&parts.len()) && parts.iter().all(|p| part_ok(p)) {
            ModelSpec::Hub { repo_id: id.to_string(), revision: rev.to_string() }
        } else {
            ModelSpec::Local(path.to_path_buf())
        }
    }
}

/// For a hub id (`what`: "model" or "dataset") that is not cached and looks like a
/// mistyped local path (`dir/name` where `dir` is an existing local directory, as
/// `runs/tyni` is): the message saying so, listing what `dir` holds, instead of trying the
/// network. `None` when the id does not look local.
pub fn local_looking(id: &str, what: &str) -> Option<String> {
    let parent = Path::new(id).parent().filter(|d| !d.as_os_str().is_empty() && d.is_dir())?;
    let mut names: Vec<String> =
        std::fs::read_dir(parent).ok()?.filter_map(|e| e.ok()).map(|e| e.file_name().to_string_lossy().into_owned()).collect();
    names.sort();
    let holds = match names.len() {
        0 => "nothing".to_string(),
        n if n > 8 => format!("{}, ...", names[..8].join(", ")),
        _ => names.join(", "),
    };
    Some(format!(
        "no such {} ({} holds: {holds}); as a hub id it is not cached; check the path, or to use the hub {what} `{id}` \
         download it first (`huggingface-cli download{} {id}`{})",
        if what == "dataset" { "file or directory" } else { "directory" },
        parent.display(),
        if what == "dataset" { " --repo-type dataset" } else { "" },
        if what == "dataset" { ", or name it `hf:ID`" } else { "" }
    ))
}

/// A resolved model: the local directory holding config.json, weights and tokenizer.
#[derive(Debug, Clone)]
pub struct ResolvedModel {
    pub dir: PathBuf,
    /// `(repo_id, commit)` when it came from the hub cache.
    pub hub: Option<(String, String)>,
}

/// Resolves `spec` (see [`ModelSpec::parse`]) to a local model directory, downloading
/// from the hub unless `opts.offline`. A built-in model has none: an error.
pub fn resolve_model(spec: &str, opts: &HubOptions) -> Result<ResolvedModel> {
    match ModelSpec::parse(spec) {
        ModelSpec::Builtin(_) => Err(Error::checkpoint(
            spec,
            "a built-in model has no model directory (the trainer makes its weights); train it and use the run's output",
        )),
        ModelSpec::Local(dir) => {
            if !dir.is_dir() {
                return Err(Error::checkpoint(
                    &dir,
                    "model directory not found, and this is not a hub id of the form `org/name[@revision]`",
                ));
            }
            Ok(ResolvedModel { dir, hub: None })
        }
        ModelSpec::Hub { repo_id, revision } => {
            if !repo_folder(&opts.cache_dir, &repo_id).is_dir() {
                if let Some(msg) = local_looking(&repo_id, "model") {
                    return Err(Error::checkpoint(&repo_id, msg));
                }
            }
            if opts.offline {
                resolve_offline(&repo_id, &revision, &opts.cache_dir)
            } else {
                download(&repo_id, &revision, opts)
            }
        }
    }
}

fn repo_folder(cache_dir: &Path, repo_id: &str) -> PathBuf {
    cache_dir.join(format!("models--{}", repo_id.replace('/', "--")))
}

fn is_commit_hash(s: &str) -> bool {
    s.len() == 40 && s.chars().all(|c| c.is_ascii_hexdigit())
}

/// Finds `repo_id@revision` in the cache without any network access and checks that the
/// files needed to train (config, every weight file) are there.
pub fn resolve_offline(repo_id: &str, revision: &str, cache_dir: &Path) -> Result<ResolvedModel> {
    let folder = repo_folder(cache_dir, repo_id);
    let how = format!(
        "offline mode (HF_HUB_OFFLINE) forbids downloading: fetch it while online (run longctx \
         without HF_HUB_OFFLINE, or `huggingface-cli download {repo_id}`) into the cache {}, or pass a local directory",
        cache_dir.display()
    );
    if !folder.is_dir() {
        return Err(Error::checkpoint(&folder, format!("model `{repo_id}` is not in the Hugging Face cache; {how}")));
    }
    let Some(commit) = cached_commit(&folder, revision)? else {
        return Err(Error::checkpoint(
            folder.join("refs").join(revision),
            format!("revision `{revision}` of `{repo_id}` is not in the cache (no ref file); {how}"),
        ));
    };
    let dir = folder.join("snapshots").join(&commit);
    let need = |file: &str| -> Result<()> {
        if dir.join(file).is_file() {
            Ok(())
        } else {
            Err(Error::checkpoint(dir.join(file), format!("file `{file}` of `{repo_id}` (commit {commit}) is not in the cache; {how}")))
        }
    };
    need(CONFIG_FILE)?;
    if !dir.join(SINGLE_FILE).is_file() {
        if !dir.join(INDEX_FILE).is_file() {
            need(SINGLE_FILE)?;
        }
        for shard in index_shards(&dir.join(INDEX_FILE))? {
            need(&shard)?;
        }
    }
    Ok(ResolvedModel { dir, hub: Some((repo_id.to_string(), commit)) })
}

/// A revision, or the commit a ref file holds, is used as one path component inside the
/// cache: refused when it is empty or could name another place (`..`, `/`, `\`, NUL).
/// `what` says which (for the message), `file` where it came from.
pub fn check_ref_name(what: &str, file: &Path, name: &str) -> Result<()> {
    let bad = name.is_empty() || name == "." || name.contains("..") || name.contains(['/', '\\', '\0']);
    if bad {
        return Err(Error::checkpoint(
            file,
            format!(
                "{what} `{}` is not a revision name (it is empty or contains `..` or a path separator); use a branch or tag \
                 name or a 40-hex commit hash{}",
                name.escape_debug(),
                if what.starts_with("ref") { ", or delete this ref file and download again" } else { "" }
            ),
        ));
    }
    Ok(())
}

/// The commit `revision` stands for in the repo cache `folder`: a commit hash with its
/// snapshot there, or what the ref file `refs/<revision>` says (`None` when absent).
fn cached_commit(folder: &Path, revision: &str) -> Result<Option<String>> {
    check_ref_name("revision", folder, revision)?;
    if is_commit_hash(revision) && folder.join("snapshots").join(revision).is_dir() {
        return Ok(Some(revision.to_string()));
    }
    let ref_file = folder.join("refs").join(revision);
    let Ok(commit) = std::fs::read_to_string(&ref_file) else { return Ok(None) };
    let commit = commit.trim();
    if commit.is_empty() {
        return Ok(None);
    }
    check_ref_name("ref file content", &ref_file, commit)?;
    Ok(Some(commit.to_string()))
}

/// `file` of `repo_id@revision` in the cache, when it is there (no network).
pub fn cached_file(cache_dir: &Path, repo_id: &str, revision: &str, file: &str) -> Result<Option<PathBuf>> {
    let folder = repo_folder(cache_dir, repo_id);
    let Some(commit) = cached_commit(&folder, revision)? else { return Ok(None) };
    let path = folder.join("snapshots").join(commit).join(file);
    Ok(path.is_file().then_some(path))
}

/// The distinct shard file names of an index, sorted.
fn index_shards(index: &Path) -> Result<Vec<String>> {
    #[derive(serde::Deserialize)]
    struct Index {
        weight_map: std::collections::BTreeMap<String, String>,
    }
    let text = std::fs::read_to_string(index).map_err(|e| Error::io(index, e))?;
    let parsed: Index = serde_json::from_str(&text)
        .map_err(|e| Error::checkpoint(index, format!("not a valid index ({e}); expected a `weight_map` object")))?;
    let mut shards: Vec<String> = parsed.weight_map.into_values().collect();
    shards.sort();
    shards.dedup();
    Ok(shards)
}

/// The hub client for `repo_id@revision` (downloads go into `opts.cache_dir`).
fn hub_repo(repo_id: &str, revision: &str, opts: &HubOptions) -> Result<hf_hub::api::sync::ApiRepo> {
    let mut builder = hf_hub::api::sync::ApiBuilder::new()
        .with_cache_dir(opts.cache_dir.clone())
        .with_token(opts.token.clone())
        .with_progress(opts.progress);
    if let Some(ep) = &opts.endpoint {
        builder = builder.with_endpoint(ep.clone());
    }
    let api = builder.build().map_err(|e| Error::Setting(format!("cannot set up the Hugging Face hub client: {e}")))?;
    Ok(api.repo(hf_hub::Repo::with_revision(repo_id.to_string(), hf_hub::RepoType::Model, revision.to_string())))
}

/// A failed download of `file`, with what to do about it.
fn download_error(opts: &HubOptions, repo_id: &str, revision: &str, file: &str, e: hf_hub::api::sync::ApiError) -> Error {
    use hf_hub::api::sync::ApiError;
    let hint = match &e {
        ApiError::RequestError(r) if matches!(**r, ureq::Error::Status(401 | 403, _)) => {
            " (gated or private model: accept its licence on the hub and set HF_TOKEN)"
        }
        ApiError::RequestError(r) if matches!(**r, ureq::Error::Status(404, _)) => " (no such repo, revision or file on the hub)",
        _ => " (no network? set HF_HUB_OFFLINE=1 to use the cache only)",
    };
    Error::checkpoint(repo_folder(&opts.cache_dir, repo_id), format!("cannot download `{file}` of `{repo_id}@{revision}`: {e}{hint}"))
}

/// Downloads (or finds in the cache) config, weights and tokenizer files of `repo_id`.
fn download(repo_id: &str, revision: &str, opts: &HubOptions) -> Result<ResolvedModel> {
    use hf_hub::api::sync::ApiError;
    check_ref_name("revision", &repo_folder(&opts.cache_dir, repo_id), revision)?;
    let repo = hub_repo(repo_id, revision, opts)?;
    let not_found = |e: &ApiError| matches!(e, ApiError::RequestError(r) if matches!(**r, ureq::Error::Status(404, _)));
    let fail = |file: &str, e: ApiError| download_error(opts, repo_id, revision, file, e);
    let config = repo.get(CONFIG_FILE).map_err(|e| fail(CONFIG_FILE, e))?;
    let dir =
        config.parent().map(Path::to_path_buf).ok_or_else(|| Error::checkpoint(&config, "downloaded file has no parent directory"))?;
    let commit = dir.file_name().and_then(|s| s.to_str()).unwrap_or_default().to_string();
    // Files the hub said do not exist are remembered, as huggingface_hub does, in
    // `.no_exist/<commit>/<file>`, so a cached model needs no request for them again.
    let no_exist = repo_folder(&opts.cache_dir, repo_id).join(".no_exist").join(&commit);
    let optional = |file: &str| -> Result<bool> {
        if no_exist.join(file).exists() {
            return Ok(false);
        }
        match repo.get(file) {
            Ok(_) => Ok(true),
            Err(e) if not_found(&e) => {
                // Best effort: a missing marker only costs one more request next time.
                let _ = std::fs::create_dir_all(&no_exist).and_then(|_| std::fs::write(no_exist.join(file), b""));
                Ok(false)
            }
            Err(e) => Err(fail(file, e)),
        }
    };
    if !optional(SINGLE_FILE)? {
        let index = repo.get(INDEX_FILE).map_err(|e| fail(INDEX_FILE, e))?;
        for shard in index_shards(&index)? {
            repo.get(&shard).map_err(|e| fail(&shard, e))?;
        }
    }
    for f in TOKENIZER_FILES {
        optional(f)?;
    }
    Ok(ResolvedModel { dir, hub: Some((repo_id.to_string(), commit)) })
}

/// A model's config.json, read without the weights.
#[derive(Debug, Clone)]
pub struct ModelConfig {
    pub cfg: LlamaConfig,
    /// The file as JSON, every field as written (exports edit and write it back).
    pub json: Value,
    /// The directory it is in; `None` for a built-in model.
    pub dir: Option<PathBuf>,
}

impl ModelConfig {
    /// The config of `builtin:NAME` (see [`crate::model::init`]).
    pub fn builtin(name: &str) -> Result<Self> {
        Ok(Self { cfg: crate::model::init::builtin_config(name)?, json: crate::model::init::builtin_config_json(name)?, dir: None })
    }

    /// A config.json file.
    pub fn read(path: &Path) -> Result<Self> {
        let text = std::fs::read_to_string(path).map_err(|e| Error::io(path, e))?;
        let json: Value = serde_json::from_str(&text).map_err(|e| Error::checkpoint(path, format!("not valid JSON: {e}")))?;
        let cfg = LlamaConfig::from_value(path, json.clone())?;
        Ok(Self { cfg, json, dir: path.parent().map(Path::to_path_buf) })
    }
}

/// The config of a model without its weights (`inspect`, `plan`, the trainer's early
/// layout check): `builtin:NAME`, a directory holding config.json, a config.json, or a hub
/// id, from the cache, or else downloaded (config.json only) when `download` and not
/// offline. `Ok(None)`: a hub model whose config is not cached, and `download` is false.
pub fn model_config(spec: &str, opts: &HubOptions, download: bool) -> Result<Option<ModelConfig>> {
    let path = match ModelSpec::parse(spec) {
        ModelSpec::Builtin(name) => return ModelConfig::builtin(&name).map(Some),
        ModelSpec::Local(p) if p.is_file() => p,
        ModelSpec::Local(p) if p.is_dir() => config_path(&p)?,
        ModelSpec::Local(p) => {
            return Err(Error::checkpoint(
                p,
                "model not found: neither a directory, a config.json, `builtin:NAME` nor a hub id `org/name[@revision]`",
            ))
        }
        ModelSpec::Hub { repo_id, revision } => match cached_file(&opts.cache_dir, &repo_id, &revision, CONFIG_FILE)? {
            Some(p) => p,
            None if local_looking(&repo_id, "model").is_some() => {
                return Err(Error::checkpoint(&repo_id, local_looking(&repo_id, "model").unwrap_or_default()))
            }
            None if !download => return Ok(None),
            None if opts.offline => {
                return Err(Error::checkpoint(
                    repo_folder(&opts.cache_dir, &repo_id),
                    format!(
                        "model `{repo_id}` (revision `{revision}`) has no cached config.json and HF_HUB_OFFLINE forbids \
                         downloading it; fetch it while online, or pass a local directory"
                    ),
                ))
            }
            None => {
                let quiet = HubOptions { progress: false, ..opts.clone() };
                let repo = hub_repo(&repo_id, &revision, &quiet)?;
                repo.get(CONFIG_FILE).map_err(|e| download_error(opts, &repo_id, &revision, CONFIG_FILE, e))?
            }
        },
    };
    ModelConfig::read(&path).map(Some)
}

/// The config of a model resolved by [`resolve_model`] (weights downloaded when needed),
/// or of a built-in one.
pub fn resolve_model_config(spec: &str, opts: &HubOptions) -> Result<ModelConfig> {
    if let ModelSpec::Builtin(name) = ModelSpec::parse(spec) {
        return ModelConfig::builtin(&name);
    }
    let dir = resolve_model(spec, opts)?.dir;
    let json = read_config(&dir)?;
    let cfg = LlamaConfig::from_value(dir.join(CONFIG_FILE), json.clone())?;
    Ok(ModelConfig { cfg, json, dir: Some(dir) })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn builtin_models_have_a_config_and_no_directory() {
        assert_eq!(ModelSpec::parse("builtin:tiny"), ModelSpec::Builtin("tiny".into()));
        let opts = HubOptions::offline_in("/nonexistent");
        let m = model_config("builtin:tiny", &opts, false).unwrap().unwrap();
        let r = resolve_model_config("builtin:tiny", &opts).unwrap();
        assert_eq!((m.dir, r.dir), (None, None));
        assert_eq!((m.json, m.cfg.hidden_size), (r.json, r.cfg.hidden_size));
        assert!(resolve_model("builtin:tiny", &opts).unwrap_err().to_string().contains("built-in"));
        assert!(model_config("builtin:nope", &opts, false).unwrap_err().to_string().contains("builtin:nope"));
        // `@layers=N`: the same shape with N layers; a bad count is named.
        let two = model_config("builtin:tinyllama-1.1b-shape@layers=2", &opts, false).unwrap().unwrap();
        assert_eq!((two.cfg.num_hidden_layers, two.cfg.hidden_size), (2, 2048));
        for bad in ["0", "x", "5000"] {
            let e = model_config(&format!("builtin:tiny@layers={bad}"), &opts, false).unwrap_err().to_string();
            assert!(e.contains("@layers=") && e.contains(bad), "{e}");
        }
    }

    /// A hub id's config.json comes from the cache; missing, it is `None` without
    /// `download`, an error naming HF_HUB_OFFLINE with it when offline.
    #[test]
    fn hub_config_from_the_cache() {
        let cache = tempfile::tempdir().unwrap();
        let commit = "0123456789abcdef0123456789abcdef01234567";
        let folder = cache.path().join("models--org--tiny");
        let snap = folder.join("snapshots").join(commit);
        std::fs::create_dir_all(&snap).unwrap();
        std::fs::create_dir_all(folder.join("refs")).unwrap();
        std::fs::write(folder.join("refs/main"), commit).unwrap();
        let json = crate::model::init::builtin_config_json("tiny").unwrap();
        std::fs::write(snap.join(CONFIG_FILE), json.to_string()).unwrap();
        let opts = HubOptions::offline_in(cache.path());
        for spec in ["org/tiny", "org/tiny@main"].into_iter().map(String::from).chain([format!("org/tiny@{commit}")]) {
            let m = model_config(&spec, &opts, false).unwrap().unwrap();
            assert_eq!((m.dir.as_deref(), &m.json), (Some(snap.as_path()), &json), "{spec}");
        }
        assert!(model_config("org/tiny@v2", &opts, false).unwrap().is_none());
        assert!(model_config("org/absent", &opts, false).unwrap().is_none());
        let err = model_config("org/absent", &opts, true).unwrap_err().to_string();
        assert!(err.contains("org/absent") && err.contains("HF_HUB_OFFLINE"), "{err}");
    }
}
