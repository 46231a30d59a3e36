//! Library errors. Every variant names the file and/or field at fault and what was
//! expected, so the message tells the user how to fix the input.

use std::path::PathBuf;

#[derive(Debug, thiserror::Error)]
pub enum Error {
    /// A field of a config file (config.json, a run TOML...) is missing or wrong.
    #[error("{file}: field `{field}`: {msg}")]
    Config { file: PathBuf, field: String, msg: String },
    /// A checkpoint file (safetensors, index, tokenizer) is missing, corrupt or disagrees with the config.
    #[error("{file}: {msg}")]
    Checkpoint { file: PathBuf, msg: String },
    /// A dataset problem.
    #[error("{file}: {msg}")]
    Data { file: PathBuf, msg: String },
    /// A setting (flags, parallel layout) that cannot work.
    #[error("invalid setting: {0}")]
    Setting(String),
    /// Training stopped because numbers went non-finite (see `docs/reliability.md`); the
    /// message says what was kept and what to change.
    #[error("training stopped: {0}")]
    Diverged(String),
    #[error("{path}: {source}")]
    Io { path: PathBuf, source: std::io::Error },
    #[error(transparent)]
    Candle(#[from] candle_core::Error),
}

pub type Result<T> = std::result::Result<T, Error>;

impl Error {
    pub fn config(file: impl Into<PathBuf>, field: impl Into<String>, msg: impl Into<String>) -> Self {
        Error::Config { file: file.into(), field: field.into(), msg: msg.into() }
    }
    pub fn checkpoint(file: impl Into<PathBuf>, msg: impl Into<String>) -> Self {
        Error::Checkpoint { file: file.into(), msg: msg.into() }
    }
    pub fn data(file: impl Into<PathBuf>, msg: impl Into<String>) -> Self {
        Error::Data { file: file.into(), msg: msg.into() }
    }
    pub fn io(path: impl Into<PathBuf>, source: std::io::Error) -> Self {
        Error::Io { path: path.into(), source }
    }
}
