//! The job secret that authenticates the rendezvous.
//!
//! Every rank of a job holds the same secret, `LONGCTX_RDZV_SECRET` ([`SECRET_ENV`]):
//! `longctx launch` makes a random one per job (single node) and hands it to its
//! children; with several nodes, or under an external launcher (torchrun, Slurm), the
//! user exports the same value on every rank. The rendezvous derives a fresh key per
//! connection from it (see [`super::wire`]), so the secret itself never travels.
//!
//! Without a secret a job of more than one rank runs only when the master address is
//! loopback (`127.0.0.0/8`, `::1`, `localhost`): then only processes of this machine can
//! reach rank 0, and the rendezvous runs with a fixed, publicly known key (frames are
//! still checked, but any local process could join) and says so. Any other master
//! address without a secret is an error naming the fix.

use crate::{Error, Result};
use rand::TryRngCore;
use std::net::IpAddr;

/// Environment variable holding the job secret (at least [`MIN_SECRET_LEN`] bytes).
pub const SECRET_ENV: &str = "LONGCTX_RDZV_SECRET";
/// Shortest secret accepted, in bytes.
pub const MIN_SECRET_LEN: usize = 16;
/// Key of loopback jobs without a secret (not a secret: see the module doc).
const UNAUTHENTICATED_KEY: &str = "longctx rendezvous without LONGCTX_RDZV_SECRET (loopback only)";

/// How to make a secret by hand, for error messages.
pub const SECRET_HOWTO: &str = "export LONGCTX_RDZV_SECRET=$(head -c 32 /dev/urandom | od -An -tx1 | tr -d ' \\n')";

/// A validated job secret. Its `Debug` never shows the value.
#[derive(Clone, PartialEq, Eq)]
pub struct Secret(String);

impl std::fmt::Debug for Secret {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "Secret(<{} bytes, redacted>)", self.0.len())
    }
}

impl Secret {
    /// `value` as a secret: at least [`MIN_SECRET_LEN`] bytes after trimming whitespace.
    pub fn new(value: &str) -> Result<Self> {
        let v = value.trim();
        if v.len() < MIN_SECRET_LEN {
            return Err(Error::Setting(format!(
                "{SECRET_ENV} has {} bytes; it must have at least {MIN_SECRET_LEN} (use random bytes, e.g. {SECRET_HOWTO})",
                v.len()
            )));
        }
        Ok(Self(v.to_string()))
    }

    /// The secret in `LONGCTX_RDZV_SECRET`, if set (an empty value counts as unset).
    pub fn from_env() -> Result<Option<Self>> {
        match std::env::var(SECRET_ENV) {
            Ok(v) if !v.trim().is_empty() => Self::new(&v).map(Some),
            Ok(_) | Err(std::env::VarError::NotPresent) => Ok(None),
            Err(std::env::VarError::NotUnicode(_)) => {
                Err(Error::Setting(format!("{SECRET_ENV} is not valid UTF-8; use hex or base64 text, e.g. {SECRET_HOWTO}")))
            }
        }
    }

    /// A fresh random secret (32 bytes from the operating system, as 64 hex digits).
    pub fn generate() -> Result<String> {
        let mut bytes = [0u8; 32];
        rand::rngs::OsRng
            .try_fill_bytes(&mut bytes)
            .map_err(|e| Error::Setting(format!("cannot read random bytes from the operating system for {SECRET_ENV}: {e}")))?;
        Ok(bytes.iter().map(|b| format!("{b:02x}")).collect())
    }

    pub(super) fn bytes(&self) -> &[u8] {
        self.0.as_bytes()
    }

    /// The value, to hand to child processes (`longctx launch`).
    pub fn expose(&self) -> &str {
        &self.0
    }
}

/// Whether `addr` (an IP literal, bracketed or not, or a host name) is loopback.
/// Host names other than `localhost` count as not loopback.
pub fn is_loopback(addr: &str) -> bool {
    let a = addr.trim().trim_start_matches('[').trim_end_matches(']');
    match a.parse::<IpAddr>() {
        Ok(ip) => ip.is_loopback(),
        Err(_) => a.eq_ignore_ascii_case("localhost"),
    }
}

/// The key material of a job whose rank 0 listens on `master` (`host:port`, for
/// messages) at `master_addr`: the secret when there is one; else the fixed key of
/// loopback jobs (`Ok((key, false))`), or an error with the fix for any other address.
pub fn job_key(secret: Option<&Secret>, master_addr: &str, master: &str) -> Result<(Secret, bool)> {
    if let Some(s) = secret {
        return Ok((s.clone(), true));
    }
    if is_loopback(master_addr) {
        return Ok((Secret(UNAUTHENTICATED_KEY.to_string()), false));
    }
    Err(Error::Setting(format!(
        "{SECRET_ENV} is not set, so the rendezvous on {master} would let anyone who reaches that port join the job; \
         set it to the same random value on every rank ({SECRET_HOWTO}), or start the ranks with `longctx launch`, \
         which makes one (a loopback MASTER_ADDR such as 127.0.0.1 runs without it)"
    )))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn secrets_are_checked_and_never_shown() {
        assert!(Secret::new("short").is_err_and(|e| e.to_string().contains("at least 16")));
        let s = Secret::new("  0123456789abcdef0123  ").unwrap();
        assert_eq!(s.bytes(), b"0123456789abcdef0123");
        assert!(!format!("{s:?}").contains("0123"));
        let g = Secret::generate().unwrap();
        assert_eq!(g.len(), 64);
        assert_ne!(g, Secret::generate().unwrap());
    }

    #[test]
    fn only_loopback_runs_without_a_secret() {
        for a in ["127.0.0.1", "127.3.2.1", "::1", "[::1]", "localhost", "LOCALHOST"] {
            assert!(is_loopback(a), "{a}");
            assert!(matches!(job_key(None, a, "x:1"), Ok((_, false))), "{a}");
        }
        for a in ["10.0.0.1", "0.0.0.0", "node07", "::"] {
            assert!(!is_loopback(a), "{a}");
            let e = job_key(None, a, "node07:29500").unwrap_err().to_string();
            assert!(e.contains("LONGCTX_RDZV_SECRET is not set") && e.contains("node07:29500"), "{e}");
        }
        let s = Secret::new("0123456789abcdef").unwrap();
        assert!(matches!(job_key(Some(&s), "node07", "node07:1"), Ok((k, true)) if k == s));
    }
}
