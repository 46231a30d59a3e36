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
    /// (`err` is not the error's `source()`: the message holds it already, and a source
    /// would print it a second time in a chain such as `error: ...: {path}: {err}: {err}`.)
    #[error("{path}: {err}")]
    Io { path: PathBuf, err: std::io::Error },
    /// A config file that is not valid TOML (or JSON): where, and what.
    #[error("{file}: line {line}, column {column}: {msg}")]
    Syntax { file: PathBuf, line: usize, column: usize, msg: String },
    #[error(transparent)]
    Candle(candle_core::Error),
}

pub type Result<T> = std::result::Result<T, Error>;

/// Candle attaches a backtrace to its errors whenever `RUST_BACKTRACE` is set (and prints
/// it inside the message); ours say what went wrong and how to fix it, so it is dropped.
impl From<candle_core::Error> for Error {
    fn from(e: candle_core::Error) -> Self {
        Error::Candle(without_backtrace(e))
    }
}

fn without_backtrace(e: candle_core::Error) -> candle_core::Error {
    match e {
        candle_core::Error::WithBacktrace { inner, .. } => without_backtrace(*inner),
        other => other,
    }
}

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
        Error::Io { path: path.into(), err: source }
    }
}

#[cfg(test)]
mod tests {
    /// A Candle error carrying a backtrace (as with `RUST_BACKTRACE` set) reads as its
    /// message alone.
    #[test]
    fn candle_backtraces_are_dropped() {
        let inner = candle_core::Error::Msg("NCCL call timed out".into());
        let e =
            candle_core::Error::WithBacktrace { inner: Box::new(inner), backtrace: Box::new(std::backtrace::Backtrace::force_capture()) };
        assert_eq!(super::Error::from(e).to_string(), "NCCL call timed out");
    }
}
