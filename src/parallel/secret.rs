//! The job secret that authenticates the rendezvous.
//!
//! Every rank of a job holds the same secret, `LONGCTX_RDZV_SECRET` ([`SECRET_ENV`]):
//! `longctx launch` makes a random one per job (single node) and hands it to its
//! children; with several nodes, or under an external launcher (torchrun, Slurm), the
//! user exports the same value on every rank. The rendezvous derives a fresh key per
//! connection from it (see [`super::wire`]), so the secret itself never travels.
//!
//! A secret must be random, not chosen: a process that squats on `MASTER_PORT` before rank 0
//! starts receives every rank's tagged hello and can try guesses offline against it (see
//! [`super::wire`] for why no protocol without a password-authenticated key exchange avoids
//! that). So besides a minimum length, [`Secret::new`] estimates the secret's entropy
//! ([`estimated_bits`]: repeats, runs such as `aaaa` or `0123`, common words and the alphabet
//! used all count for little) and refuses one below [`MIN_SECRET_BITS`].
//!
//! Without a secret a job of more than one rank runs only when the master address is
//! loopback (`127.0.0.0/8`, `::1`, `localhost`): then only processes of this machine can
//! reach rank 0, and the rendezvous runs with a fixed, publicly known key (frames are
//! still checked, but any local process could join) and says so. Any other master
//! address without a secret is an error naming the fix.

use crate::{Error, Result};
use rand::TryRngCore;
use std::net::IpAddr;

/// Environment variable holding the job secret (at least [`MIN_SECRET_LEN`] bytes and
/// [`MIN_SECRET_BITS`] bits of estimated entropy).
pub const SECRET_ENV: &str = "LONGCTX_RDZV_SECRET";
/// Shortest secret accepted, in bytes.
pub const MIN_SECRET_LEN: usize = 16;
/// Least estimated entropy of a secret, in bits ([`estimated_bits`]); 32 random hex digits
/// (`openssl rand -hex 16`) estimate about 125, the recommended 64 about 250.
pub const MIN_SECRET_BITS: f64 = 100.0;
/// Key of loopback jobs without a secret (not a secret: see the module doc).
const UNAUTHENTICATED_KEY: &str = "longctx rendezvous without LONGCTX_RDZV_SECRET (loopback only)";

/// How to make a secret by hand, for error messages.
pub const SECRET_HOWTO: &str = "export LONGCTX_RDZV_SECRET=$(openssl rand -hex 32)";

/// A validated job secret. Its `Debug` never shows the value.
#[derive(Clone, PartialEq, Eq)]
pub struct Secret(String);

impl std::fmt::Debug for Secret {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "Secret(<{} bytes, redacted>)", self.0.len())
    }
}

impl Secret {
    /// `value` as a secret: at least [`MIN_SECRET_LEN`] bytes after trimming whitespace,
    /// and at least [`MIN_SECRET_BITS`] of [`estimated_bits`].
    pub fn new(value: &str) -> Result<Self> {
        let v = value.trim();
        if v.len() < MIN_SECRET_LEN {
            return Err(Error::Setting(format!(
                "{SECRET_ENV} has {} bytes; it must have at least {MIN_SECRET_LEN} (use random bytes, e.g. {SECRET_HOWTO})",
                v.len()
            )));
        }
        let bits = estimated_bits(v);
        if bits < MIN_SECRET_BITS {
            return Err(Error::Setting(format!(
                "{SECRET_ENV} looks chosen, not random: about {bits:.0} bits of entropy (repeats, runs such as 0123, \
                 common words and a small alphabet count for little), at least {MIN_SECRET_BITS:.0} are required, since \
                 a process squatting on MASTER_PORT could test guesses of it offline; make one with {SECRET_HOWTO} \
                 (or let `longctx launch` make one on a single node)"
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

/// Words that make a secret guessable (matched case-insensitively); each costs little.
const COMMON_WORDS: &[&str] = &[
    "password", "passwd", "secret", "longctx", "rendezvous", "master", "admin", "root", "letmein", "changeme", "default", "example",
    "test", "qwerty", "asdf", "zxcv", "hello", "welcome", "token", "key", "pass", "job", "train", "cluster", "node", "llama", "slurm",
    "torch", "1234",
];

/// Cost in bits of a segment that repeats earlier text, a run, or a common word.
const PATTERN_BITS: f64 = 10.0;

/// How many symbols the alphabet of `s` has (the smallest usual one holding every char).
fn alphabet(s: &[char]) -> f64 {
    let all = |f: fn(&char) -> bool| s.iter().all(f);
    if all(char::is_ascii_digit) {
        10.0
    } else if all(|c| c.is_ascii_digit() || ('a'..='f').contains(c)) || all(|c| c.is_ascii_digit() || ('A'..='F').contains(c)) {
        16.0
    } else if all(char::is_ascii_lowercase) || all(char::is_ascii_uppercase) {
        26.0
    } else if all(|c| c.is_ascii_lowercase() || c.is_ascii_digit()) {
        36.0
    } else if all(|c| c.is_ascii_alphanumeric() || "+/=-_".contains(*c)) {
        64.0
    } else if all(|c| c.is_ascii_graphic() || *c == ' ') {
        95.0
    } else {
        256.0
    }
}

/// Length of the pattern starting at `i`: the longest earlier repeat, run of a constant
/// step (`aaaa`, `0123`, `fedc`) or common word; 0 below 3 chars.
fn pattern_at(s: &[char], i: usize) -> usize {
    let mut best = 0;
    for start in 0..i {
        let l = (0..s.len() - i).take_while(|&k| s[start + k] == s[i + k]).count();
        best = best.max(l);
    }
    for step in [-1i64, 0, 1] {
        let l = 1 + (i + 1..s.len()).take_while(|&k| s[k] as i64 - s[k - 1] as i64 == step).count();
        best = best.max(l);
    }
    let rest: String = s[i..].iter().collect::<String>().to_ascii_lowercase();
    for w in COMMON_WORDS {
        if rest.starts_with(w) {
            best = best.max(w.len());
        }
    }
    if best >= 3 {
        best
    } else {
        0
    }
}

/// Whether `s` reads as words: letters and separators (space, `-`, `_`, `.`), at least
/// one separator, no digit, each word in lower case, upper case or capitalized: a
/// passphrase, whose characters carry about 2 bits each, not log2 of their alphabet.
fn word_like(s: &[char]) -> bool {
    let text: String = s.iter().collect();
    let is_sep = |c: char| " -_.".contains(c);
    let word = |w: &str| {
        let rest_lower = w.chars().skip(1).all(|c| c.is_ascii_lowercase());
        w.chars().all(|c| c.is_ascii_uppercase()) || (w.chars().next().is_some_and(|c| c.is_ascii_alphabetic()) && rest_lower)
    };
    text.chars().any(is_sep) && text.chars().all(|c| c.is_ascii_alphabetic() || is_sep(c)) && text.split(is_sep).all(word)
}

/// A conservative estimate of the entropy of `s`, in bits: each char costs log2 of its
/// alphabet's size (at most 2 + log2 of the distinct chars used; 2 bits for words, see
/// [`word_like`]), except that a repeat of earlier text, a run of a constant step and a
/// common word of 3 chars or more cost at most [`PATTERN_BITS`] each.
pub fn estimated_bits(s: &str) -> f64 {
    // Patterns are searched in quadratic time: the first 512 chars decide.
    let chars: Vec<char> = s.chars().take(512).collect();
    let distinct = chars.iter().collect::<std::collections::BTreeSet<_>>().len().max(1) as f64;
    // 2 + log2(distinct): a random string of 22 base64 chars uses ~19 of them, and must keep
    // its 6 bits a char (with 1 + log2 it got 5.2, and an accidental 4-char repeat took
    // `openssl rand -base64 16` below the bar now and then).
    let per_char = if word_like(&chars) { 2.0 } else { alphabet(&chars).log2().min(2.0 + distinct.log2()) };
    let (mut bits, mut i) = (0.0, 0);
    while i < chars.len() {
        match pattern_at(&chars, i) {
            0 => {
                bits += per_char;
                i += 1;
            }
            l => {
                bits += PATTERN_BITS.min(per_char * l as f64);
                i += l;
            }
        }
    }
    bits
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
pub(crate) mod tests {
    use super::*;

    /// A fixed random secret (64 hex digits, as `openssl rand -hex 32` makes them).
    pub(crate) const GOOD: &str = "9f3c2a7be1d04f6a8c5e2b9d7a1f3e6c4b8d0a2f5e7c9b1d3a6f8e0c2b4d6a8f";

    #[test]
    fn secrets_are_checked_and_never_shown() {
        assert!(Secret::new("short").is_err_and(|e| e.to_string().contains("at least 16")));
        let s = Secret::new(&format!("  {GOOD}  ")).unwrap();
        assert_eq!(s.bytes(), GOOD.as_bytes());
        assert!(!format!("{s:?}").contains("9f3c"));
        let g = Secret::generate().unwrap();
        assert_eq!(g.len(), 64);
        assert_ne!(g, Secret::generate().unwrap());
        assert!(Secret::new(&g).is_ok(), "a generated secret is accepted");
    }

    /// Chosen secrets of 16 bytes or more are refused, with the reason and the fix; random
    /// ones of 16 bytes (32 hex digits) or more are accepted.
    #[test]
    fn low_entropy_secrets_are_refused() {
        let weak = [
            "0123456789abcdef",
            "test-secret-0123456789abcdef",
            "another-secret-0123456789",
            "aaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaa",
            "abababababababababababababababab",
            "passwordpasswordpassword",
            "Password1234567890!",
            "qwertyuiopasdfghjklzxcvbnm",
            "longctx-cluster-rendezvous-key",
            "correct horse battery staple",
            "1111222233334444555566667777",
            "deadbeefdeadbeefdeadbeefdeadbeef",
            "Correct-Horse-Battery-Staple-Again",
        ];
        for w in weak {
            let e = Secret::new(w).expect_err(w).to_string();
            assert!(e.contains("looks chosen, not random") && e.contains("openssl rand -hex 32"), "{w}: {e}");
            assert!(estimated_bits(w) < MIN_SECRET_BITS, "{w}");
        }
        // Random secrets: 1000 of each size, none refused (the estimate is conservative,
        // not noisy): 16 random bytes as 32 hex digits, as 22 base64 chars (`openssl rand
        // -base64 16` without its `==`), 24 base64url chars, and 32 bytes in hex.
        let hex = |b: &[u8]| b.iter().map(|x| format!("{x:02x}")).collect::<String>();
        let b64 = |b: &[u8]| {
            const A: &[u8] = b"ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789+/";
            b.iter().map(|x| A[(*x & 63) as usize] as char).collect::<String>()
        };
        let mut least = f64::INFINITY;
        for _ in 0..1000 {
            let mut r = [0u8; 32];
            rand::rngs::OsRng.try_fill_bytes(&mut r).unwrap();
            let url: String = b64(&r[..24]).replace('+', "-").replace('/', "_");
            for v in [hex(&r[..16]), b64(&r[..22]), url, hex(&r)] {
                least = least.min(estimated_bits(&v));
                assert!(Secret::new(&v).is_ok(), "random secret {v} refused: {:.0} bits", estimated_bits(&v));
            }
        }
        assert!(least >= MIN_SECRET_BITS, "{least}");
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
        let s = Secret::new(GOOD).unwrap();
        assert!(matches!(job_key(Some(&s), "node07", "node07:1"), Ok((k, true)) if k == s));
    }
}
