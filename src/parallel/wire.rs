//! Frames of the rendezvous connections and their authentication.
//!
//! A frame is `[kind u8][len u32 BE][payload: len bytes][tag: 32 bytes]`. The tag is
//! HMAC-SHA256, under the connection's session key, of `direction u8 ++ sequence u64 BE
//! ++ kind ++ len ++ payload`: `direction` tells the two ways of one connection apart
//! (a frame cannot be reflected back), `sequence` counts the tagged frames sent that
//! way (none can be dropped, repeated or reordered unnoticed).
//!
//! Session key = HMAC-SHA256(job secret, `"longctx rendezvous v2" ++ server nonce ++
//! client nonce`): rank 0 sends a fresh random nonce first (the challenge, the only
//! frame besides a refusal that has no tag), the connecting rank answers with a hello
//! carrying its own nonce, tagged with the key both can now derive. A frame captured
//! on one connection is therefore worthless on any other, in this job or another one;
//! and each side proves it holds the secret (rank 0 by the tag of its welcome).
//!
//! Limits: until the hello is verified a frame may carry at most
//! [`HANDSHAKE_MAX_PAYLOAD`] bytes; after it, control frames at most
//! [`CONTROL_MAX_PAYLOAD`], data frames up to the u32 length. A longer announced length
//! drops the connection before its payload is read.

use super::secret::Secret;
use hmac::{Hmac, Mac};
use sha2::Sha256;
use std::io::{ErrorKind, Read, Write};
use std::net::TcpStream;
use std::time::{Duration, Instant};

type HmacSha256 = Hmac<Sha256>;

/// Protocol magic of hellos and challenges.
pub(super) const MAGIC: &[u8; 8] = b"LONGCTX2";
pub(super) const TAG_BYTES: usize = 32;
pub(super) const NONCE_BYTES: usize = 32;
/// Largest frame payload before the peer is authenticated.
pub(super) const HANDSHAKE_MAX_PAYLOAD: usize = 256;
/// Largest control frame payload of an authenticated connection.
pub(super) const CONTROL_MAX_PAYLOAD: usize = 1 << 20;

pub(super) const HELLO: u8 = 1;
pub(super) const WELCOME: u8 = 2;
pub(super) const ERROR: u8 = 3;
pub(super) const PING: u8 = 4;
pub(super) const BYE: u8 = 5;
pub(super) const DATA: u8 = 6;
/// Rank 0's nonce (no tag: no key exists yet).
pub(super) const CHALLENGE: u8 = 7;
/// Rank 0 refuses a hello whose tag is wrong (no tag: the peer's key is unknown).
pub(super) const REJECT: u8 = 8;

/// Which way a frame travels on a connection.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) enum Dir {
    ToMaster = 1,
    FromMaster = 2,
}

/// Frames of these kinds carry no tag (sent before a session key exists).
fn tagged(kind: u8) -> bool {
    !matches!(kind, CHALLENGE | REJECT)
}

/// Fresh random bytes from the operating system.
pub(super) fn nonce() -> std::io::Result<[u8; NONCE_BYTES]> {
    use rand::TryRngCore;
    let mut n = [0u8; NONCE_BYTES];
    rand::rngs::OsRng.try_fill_bytes(&mut n).map_err(|e| std::io::Error::other(format!("random nonce: {e}")))?;
    Ok(n)
}

/// The key of one connection (see the module doc). Cheap to clone.
#[derive(Clone)]
pub(super) struct SessionKey {
    keyed: HmacSha256,
}

impl SessionKey {
    pub(super) fn derive(secret: &Secret, server_nonce: &[u8], client_nonce: &[u8]) -> Self {
        let mut m = keyed(secret.bytes());
        m.update(b"longctx rendezvous v2");
        m.update(server_nonce);
        m.update(client_nonce);
        Self { keyed: keyed(&m.finalize().into_bytes()) }
    }

    fn mac(&self, dir: Dir, seq: u64, kind: u8, parts: &[&[u8]]) -> HmacSha256 {
        let len: usize = parts.iter().map(|p| p.len()).sum();
        let mut m = self.keyed.clone();
        m.update(&[dir as u8]);
        m.update(&seq.to_be_bytes());
        m.update(&[kind]);
        m.update(&(len as u32).to_be_bytes());
        for p in parts {
            m.update(p);
        }
        m
    }

    fn tag(&self, dir: Dir, seq: u64, kind: u8, parts: &[&[u8]]) -> [u8; TAG_BYTES] {
        self.mac(dir, seq, kind, parts).finalize().into_bytes().into()
    }

    /// Constant-time check of `tag`.
    fn verify(&self, dir: Dir, seq: u64, kind: u8, payload: &[u8], tag: &[u8]) -> bool {
        self.mac(dir, seq, kind, &[payload]).verify_slice(tag).is_ok()
    }
}

fn keyed(key: &[u8]) -> HmacSha256 {
    // HMAC takes keys of any length (long ones are hashed), so this cannot fail.
    match HmacSha256::new_from_slice(key) {
        Ok(m) => m,
        Err(_) => unreachable!("HMAC accepts keys of every length"),
    }
}

/// Send a frame without a tag (challenge, refusal).
pub(super) fn send_plain(stream: &mut impl Write, kind: u8, payload: &[u8]) -> std::io::Result<()> {
    let mut f = Vec::with_capacity(5 + payload.len());
    f.push(kind);
    f.extend_from_slice(&(payload.len() as u32).to_be_bytes());
    f.extend_from_slice(payload);
    stream.write_all(&f)
}

/// The sending half of an authenticated connection.
pub(super) struct Writer {
    stream: TcpStream,
    key: SessionKey,
    dir: Dir,
    seq: u64,
}

impl Writer {
    pub(super) fn new(stream: TcpStream, key: SessionKey, dir: Dir) -> Self {
        Self { stream, key, dir, seq: 0 }
    }

    pub(super) fn send(&mut self, kind: u8, payload: &[u8]) -> std::io::Result<()> {
        self.send_parts(kind, &[payload])
    }

    /// One frame whose payload is the concatenation of `parts` (not copied when large).
    pub(super) fn send_parts(&mut self, kind: u8, parts: &[&[u8]]) -> std::io::Result<()> {
        let total: usize = parts.iter().map(|p| p.len()).sum();
        let len = u32::try_from(total).map_err(|_| {
            std::io::Error::new(ErrorKind::InvalidInput, format!("a frame of {total} bytes exceeds the 4 GiB limit of the transport"))
        })?;
        let tag = self.key.tag(self.dir, self.seq, kind, parts);
        self.seq += 1;
        let mut head = Vec::with_capacity(5 + TAG_BYTES + total.min(1 << 16));
        head.push(kind);
        head.extend_from_slice(&len.to_be_bytes());
        if total <= 1 << 16 {
            parts.iter().for_each(|p| head.extend_from_slice(p));
            head.extend_from_slice(&tag);
            return self.stream.write_all(&head);
        }
        self.stream.write_all(&head)?;
        for p in parts {
            self.stream.write_all(p)?;
        }
        self.stream.write_all(&tag)
    }

    pub(super) fn flush(&mut self) -> std::io::Result<()> {
        self.stream.flush()
    }
}

/// One frame as read.
pub(super) struct Frame {
    pub kind: u8,
    pub payload: Vec<u8>,
    /// The tag as received, when the reader has no key yet (the hello: checked by the caller).
    pub tag: Option<Vec<u8>>,
    /// Verified under the session key. Untagged kinds are never authentic.
    pub authentic: bool,
}

pub(super) enum ReadOutcome {
    Frame(Frame),
    /// No complete frame before the deadline.
    Idle,
    /// The connection closed, broke, or sent something that ends it (a bad tag, an
    /// oversized frame).
    Closed(String),
}

/// The receiving half; accumulates bytes so that a timeout mid-frame loses nothing.
pub(super) struct FrameReader {
    stream: TcpStream,
    buf: Vec<u8>,
    key: Option<SessionKey>,
    /// Direction of the frames this side receives.
    dir: Dir,
    seq: u64,
    max_payload: usize,
    data_ok: bool,
}

impl FrameReader {
    /// A reader for the handshake: small frames only, no key yet.
    pub(super) fn handshake(stream: TcpStream, dir: Dir) -> Self {
        Self { stream, buf: Vec::new(), key: None, dir, seq: 0, max_payload: HANDSHAKE_MAX_PAYLOAD, data_ok: false }
    }

    /// The peer is authenticated: check every later tagged frame under `key`
    /// (`first_seq` tagged frames of this direction were already seen), lift the limits.
    pub(super) fn authenticated(&mut self, key: SessionKey, first_seq: u64) {
        self.key = Some(key);
        self.seq = first_seq;
        self.max_payload = CONTROL_MAX_PAYLOAD;
        self.data_ok = true;
    }

    /// Bytes the frame at the head of the buffer needs in all, once its header is in.
    fn frame_len(&self) -> Option<std::result::Result<usize, String>> {
        if self.buf.len() < 5 {
            return None;
        }
        let kind = self.buf[0];
        let len = u32::from_be_bytes([self.buf[1], self.buf[2], self.buf[3], self.buf[4]]) as usize;
        if len > self.max_payload && !(kind == DATA && self.data_ok) {
            return Some(Err(format!("oversized frame: kind {kind} announces {len} bytes (limit {})", self.max_payload)));
        }
        Some(Ok(5 + len + if tagged(kind) { TAG_BYTES } else { 0 }))
    }

    fn parse(&mut self) -> Option<std::result::Result<Frame, String>> {
        let total = match self.frame_len()? {
            Ok(t) => t,
            Err(e) => return Some(Err(e)),
        };
        if self.buf.len() < total {
            return None;
        }
        let kind = self.buf[0];
        let rest = self.buf.split_off(total);
        let mut all = std::mem::replace(&mut self.buf, rest);
        let tag = tagged(kind).then(|| all.split_off(total - TAG_BYTES));
        all.drain(..5);
        let frame = match (&self.key, tag) {
            (Some(key), Some(tag)) => {
                if !key.verify(self.dir, self.seq, kind, &all, &tag) {
                    return Some(Err(format!("a frame of kind {kind} failed authentication (tampered, corrupted or injected)")));
                }
                self.seq += 1;
                Frame { kind, payload: all, tag: None, authentic: true }
            }
            (None, tag) => Frame { kind, payload: all, tag, authentic: false },
            (Some(_), None) => Frame { kind, payload: all, tag: None, authentic: false },
        };
        Some(Ok(frame))
    }

    /// Wait at most `wait` for one frame.
    pub(super) fn next(&mut self, wait: Duration) -> ReadOutcome {
        let until = Instant::now() + wait;
        loop {
            match self.parse() {
                Some(Ok(f)) => return ReadOutcome::Frame(f),
                Some(Err(e)) => return ReadOutcome::Closed(e),
                None => {}
            }
            let left = until.saturating_duration_since(Instant::now());
            if left.is_zero() {
                return ReadOutcome::Idle;
            }
            if let Err(e) = self.stream.set_read_timeout(Some(left.max(Duration::from_millis(1)))) {
                return ReadOutcome::Closed(e.to_string());
            }
            if let Some(end) = self.pump() {
                return end;
            }
        }
    }

    /// Reads what the socket has into the buffer: `None` to go on parsing, or how the read
    /// ended (nothing readable now: `Idle`; closed or failed: `Closed`).
    fn pump(&mut self) -> Option<ReadOutcome> {
        match self.read_some() {
            Ok(0) => Some(ReadOutcome::Closed("connection closed".into())),
            Ok(_) => None,
            Err(e) if matches!(e.kind(), ErrorKind::WouldBlock | ErrorKind::TimedOut) => Some(ReadOutcome::Idle),
            Err(e) if e.kind() == ErrorKind::Interrupted => None,
            Err(e) => Some(ReadOutcome::Closed(e.to_string())),
        }
    }

    /// One frame, if the bytes already buffered or readable at once make one; for a
    /// non-blocking socket (rank 0's queue of unauthenticated connections).
    pub(super) fn poll(&mut self) -> ReadOutcome {
        loop {
            match self.parse() {
                Some(Ok(f)) => return ReadOutcome::Frame(f),
                Some(Err(e)) => return ReadOutcome::Closed(e),
                None => {}
            }
            if let Some(end) = self.pump() {
                return end;
            }
        }
    }

    /// Bytes received that are not yet part of a returned frame.
    pub(super) fn buffered(&self) -> usize {
        self.buf.len()
    }

    /// One read straight into the buffer: at least the rest of the current frame, at most
    /// 1 MiB zero-filled per read (a read returns far less than a large frame).
    fn read_some(&mut self) -> std::io::Result<usize> {
        let want = match self.frame_len() {
            Some(Ok(total)) => total.saturating_sub(self.buf.len()).max(4096),
            _ => 4096,
        };
        let at = self.buf.len();
        self.buf.resize(at + want.min(1 << 20), 0);
        let got = self.stream.read(&mut self.buf[at..]);
        self.buf.truncate(at + *got.as_ref().unwrap_or(&0));
        got
    }
}

/// The hello a rank sends: `MAGIC ++ rank u32 ++ world u32 ++ client nonce`.
pub(super) struct Hello {
    pub rank: usize,
    pub world: usize,
    pub nonce: [u8; NONCE_BYTES],
}

impl Hello {
    pub(super) fn encode(&self) -> Vec<u8> {
        let mut p = MAGIC.to_vec();
        p.extend_from_slice(&(self.rank as u32).to_be_bytes());
        p.extend_from_slice(&(self.world as u32).to_be_bytes());
        p.extend_from_slice(&self.nonce);
        p
    }

    pub(super) fn decode(p: &[u8]) -> Option<Self> {
        if p.len() != 16 + NONCE_BYTES || &p[..8] != MAGIC {
            return None;
        }
        let u32_at = |i: usize| u32::from_be_bytes([p[i], p[i + 1], p[i + 2], p[i + 3]]) as usize;
        let mut nonce = [0u8; NONCE_BYTES];
        nonce.copy_from_slice(&p[16..]);
        Some(Self { rank: u32_at(8), world: u32_at(12), nonce })
    }

    /// The first tagged frame of a connection, ranks to rank 0.
    pub(super) fn verify(key: &SessionKey, payload: &[u8], tag: &[u8]) -> bool {
        key.verify(Dir::ToMaster, 0, HELLO, payload, tag)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::net::TcpListener;

    fn pair() -> (TcpStream, TcpStream) {
        let l = TcpListener::bind("127.0.0.1:0").unwrap();
        let a = TcpStream::connect(l.local_addr().unwrap()).unwrap();
        (a, l.accept().unwrap().0)
    }

    #[test]
    fn tags_bind_key_direction_order_and_content() {
        let s = Secret::new(super::super::secret::tests::GOOD).unwrap();
        let k = SessionKey::derive(&s, &[1; 32], &[2; 32]);
        let (a, b) = pair();
        let mut w = Writer::new(a, k.clone(), Dir::ToMaster);
        let mut r = FrameReader::handshake(b, Dir::ToMaster);
        r.authenticated(k.clone(), 0);
        w.send(PING, b"one").unwrap();
        w.send_parts(DATA, &[b"tw", b"o"]).unwrap();
        for want in [&b"one"[..], b"two"] {
            match r.next(Duration::from_secs(2)) {
                ReadOutcome::Frame(f) => assert!(f.authentic && f.payload == want),
                _ => panic!("no frame"),
            }
        }
        // Same bytes under another session (other nonce) or out of order: refused.
        let other = SessionKey::derive(&s, &[1; 32], &[3; 32]);
        let tag = k.tag(Dir::ToMaster, 2, PING, &[b"x"]);
        assert!(k.verify(Dir::ToMaster, 2, PING, b"x", &tag));
        assert!(!other.verify(Dir::ToMaster, 2, PING, b"x", &tag));
        assert!(!k.verify(Dir::FromMaster, 2, PING, b"x", &tag));
        assert!(!k.verify(Dir::ToMaster, 3, PING, b"x", &tag));
        assert!(!k.verify(Dir::ToMaster, 2, ERROR, b"x", &tag));
        assert!(!k.verify(Dir::ToMaster, 2, PING, b"y", &tag));
    }

    #[test]
    fn oversized_and_forged_frames_end_the_connection() {
        let (mut a, b) = pair();
        let mut r = FrameReader::handshake(b, Dir::ToMaster);
        a.write_all(&[HELLO, 0xff, 0xff, 0xff, 0xff]).unwrap();
        assert!(matches!(r.next(Duration::from_secs(2)), ReadOutcome::Closed(e) if e.contains("oversized")));

        let k = SessionKey::derive(&Secret::new(super::super::secret::tests::GOOD).unwrap(), &[1; 32], &[2; 32]);
        let (mut a, b) = pair();
        let mut r = FrameReader::handshake(b, Dir::ToMaster);
        r.authenticated(k, 0);
        let mut forged = vec![ERROR, 0, 0, 0, 3];
        forged.extend_from_slice(b"die");
        forged.extend_from_slice(&[0u8; TAG_BYTES]);
        a.write_all(&forged).unwrap();
        assert!(matches!(r.next(Duration::from_secs(2)), ReadOutcome::Closed(e) if e.contains("failed authentication")));
    }
}
