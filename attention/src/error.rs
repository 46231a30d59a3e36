//! Errors of invalid settings. They convert into `candle_core::Error` so that every
//! function of this crate returns `candle_core::Result`.

#[derive(Debug, thiserror::Error)]
pub enum AttnError {
    /// A setting that cannot work (sequence length, heads, world size...).
    #[error("invalid attention setting: {0}")]
    Config(String),
    /// Tensor shapes that disagree with the contract.
    #[error("attention shape error: {0}")]
    Shape(String),
    /// A communication failure (peer failed, timeout, mismatched collective).
    #[error("communication error: {0}")]
    Comm(String),
}

impl From<AttnError> for candle_core::Error {
    fn from(e: AttnError) -> Self {
        candle_core::Error::wrap(e)
    }
}

/// Shorthand: `Err(AttnError::Config(format!(..)).into())`.
#[macro_export]
macro_rules! config_err {
    ($($arg:tt)*) => { Err($crate::error::AttnError::Config(format!($($arg)*)).into()) };
}
#[macro_export]
macro_rules! shape_err {
    ($($arg:tt)*) => { Err($crate::error::AttnError::Shape(format!($($arg)*)).into()) };
}
#[macro_export]
macro_rules! comm_err {
    ($($arg:tt)*) => { Err($crate::error::AttnError::Comm(format!($($arg)*)).into()) };
}
