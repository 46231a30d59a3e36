//! Worlds of processes on the CPU: the mailbox communicator of [`super::thread`] with
//! one rank per process, its messages carried between processes as bytes by a
//! [`Link`] (in longctx, the launcher's rendezvous connections).
//!
//! It exists for correctness and tests, not speed: a launched CPU run goes through
//! the same rendezvous, groups, sharded optimizer and per-rank files as a GPU run
//! over NCCL, and computes the same bits as the in-process threads run (same
//! collective algorithms, same summation order).
//!
//! Wire format of one message (little endian):
//! ```text
//! group u64 | src u64 | dst u64 | seq u64 | op u8 (index in OPS) | sig | payload
//! sig     = count u32, then per tensor: dtype u8 | rank u32 | dims u64 × rank
//! payload = 0u8 | len u32 | utf-8 reason            (a failure decided by the sender)
//!         | 1u8 | count u32 | per tensor: dtype u8 | rank u32 | dims u64 × rank | bytes u64 | data
//! ```

use super::thread::{Key, Msg, Sig, ThreadComm, World, OPS};
use super::Comm;
use candle_core::{DType, Device, Result, Tensor};
use std::sync::Arc;
use std::time::Duration;

/// How a world whose ranks live in several processes reaches the other processes.
pub trait Link: Send + Sync {
    /// World rank of this process's only rank.
    fn local_rank(&self) -> usize;
    /// Deliver one encoded message to the process of world rank `to`, which hands it
    /// to its [`Inbox::deliver`]; messages to one destination arrive in order.
    fn send(&self, to: usize, bytes: Vec<u8>) -> std::result::Result<(), String>;
    /// This world aborted here (`reason` names the rank and cause): tell the others,
    /// whose links call [`Inbox::abort`].
    fn abort(&self, reason: &str);
}

/// Where the link hands what arrives for this process.
#[derive(Clone)]
pub struct Inbox {
    world: Arc<World>,
}

impl std::fmt::Debug for Inbox {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("Inbox")
    }
}

impl Inbox {
    /// One message's bytes, as another process's link sent them. A message that does
    /// not decode aborts the world (a protocol fault, never silently dropped).
    pub fn deliver(&self, bytes: &[u8]) {
        match decode(bytes) {
            Ok((key, msg)) => self.world.deliver(key, msg),
            Err(e) => {
                self.world.abort_quietly(None, &format!("undecodable message from another rank: {e}"));
            }
        }
    }

    /// Another process failed (`reason` names it): every blocked or later call errors.
    pub fn abort(&self, reason: &str) {
        self.world.abort_quietly(None, reason);
    }
}

/// Rank `rank` of a world of `n` processes: the communicator and the inbox the link
/// must feed. Blocking calls give up after `timeout` (and abort the world).
pub fn world(rank: usize, n: usize, link: Arc<dyn Link>, timeout: Duration) -> Result<(Arc<dyn Comm>, Inbox)> {
    if rank >= n || link.local_rank() != rank {
        return crate::config_err!("process world: rank {rank} (link says {}) is not below the world size {n}", link.local_rank());
    }
    let w = Arc::new(World::new(timeout, Some(link)));
    let comm: Arc<dyn Comm> = ThreadComm::process_rank(w.clone(), n, rank);
    Ok((comm, Inbox { world: w }))
}

// ---------------------------------------------------------------- encoding

fn dtype_code(dt: DType) -> Result<u8> {
    Ok(match dt {
        DType::U8 => 0,
        DType::U32 => 1,
        DType::I64 => 2,
        DType::BF16 => 3,
        DType::F16 => 4,
        DType::F32 => 5,
        DType::F64 => 6,
        DType::I32 => 7,
        DType::I16 => 8,
        _ => return crate::config_err!("process world: cannot send dtype {dt:?}"),
    })
}

fn code_dtype(c: u8) -> std::result::Result<DType, String> {
    Ok(match c {
        0 => DType::U8,
        1 => DType::U32,
        2 => DType::I64,
        3 => DType::BF16,
        4 => DType::F16,
        5 => DType::F32,
        6 => DType::F64,
        7 => DType::I32,
        8 => DType::I16,
        _ => return Err(format!("unknown dtype code {c}")),
    })
}

fn put_u32(out: &mut Vec<u8>, x: usize) -> Result<()> {
    let x = u32::try_from(x).map_err(|_| candle_core::Error::Msg(format!("process world: {x} does not fit a u32")))?;
    out.extend_from_slice(&x.to_le_bytes());
    Ok(())
}

fn put_u64(out: &mut Vec<u8>, x: u64) {
    out.extend_from_slice(&x.to_le_bytes());
}

fn put_sig(out: &mut Vec<u8>, dims: &[usize], dt: DType) -> Result<()> {
    out.push(dtype_code(dt)?);
    put_u32(out, dims.len())?;
    for &d in dims {
        put_u64(out, d as u64);
    }
    Ok(())
}

/// Bytes of one message (see the module doc).
pub(super) fn encode(key: Key, msg: &Msg) -> Result<Vec<u8>> {
    let op = OPS.iter().position(|&o| o == msg.what).ok_or_else(|| candle_core::Error::Msg(format!("unknown op {}", msg.what)))?;
    let mut out = Vec::with_capacity(64);
    put_u64(&mut out, key.0);
    put_u64(&mut out, key.1 as u64);
    put_u64(&mut out, key.2 as u64);
    put_u64(&mut out, key.3);
    out.push(op as u8);
    put_u32(&mut out, msg.sig.len())?;
    for (dims, dt) in &msg.sig {
        put_sig(&mut out, dims, *dt)?;
    }
    match &msg.payload {
        Err(reason) => {
            out.push(0);
            put_u32(&mut out, reason.len())?;
            out.extend_from_slice(reason.as_bytes());
        }
        Ok(ts) => {
            out.push(1);
            put_u32(&mut out, ts.len())?;
            for t in ts {
                put_sig(&mut out, t.dims(), t.dtype())?;
                let bytes = (t.elem_count() * t.dtype().size_in_bytes()) as u64;
                put_u64(&mut out, bytes);
                let at = out.len();
                // Row-major elements of the (possibly strided) view, from the host.
                t.to_device(&Device::Cpu)?.write_bytes(&mut out)?;
                if (out.len() - at) as u64 != bytes {
                    return crate::config_err!("process world: tensor wrote {} bytes, expected {bytes}", out.len() - at);
                }
            }
        }
    }
    Ok(out)
}

struct Reader<'a> {
    b: &'a [u8],
}

impl<'a> Reader<'a> {
    fn take(&mut self, n: usize) -> std::result::Result<&'a [u8], String> {
        if self.b.len() < n {
            return Err(format!("message truncated: wanted {n} more bytes, {} left", self.b.len()));
        }
        let (h, t) = self.b.split_at(n);
        self.b = t;
        Ok(h)
    }
    fn u8(&mut self) -> std::result::Result<u8, String> {
        Ok(self.take(1)?[0])
    }
    fn u32(&mut self) -> std::result::Result<usize, String> {
        let b = self.take(4)?;
        Ok(u32::from_le_bytes([b[0], b[1], b[2], b[3]]) as usize)
    }
    fn u64(&mut self) -> std::result::Result<u64, String> {
        let b = self.take(8)?;
        let mut a = [0u8; 8];
        a.copy_from_slice(b);
        Ok(u64::from_le_bytes(a))
    }
    fn usize(&mut self) -> std::result::Result<usize, String> {
        usize::try_from(self.u64()?).map_err(|e| e.to_string())
    }
    fn sig(&mut self) -> std::result::Result<Sig, String> {
        let dt = code_dtype(self.u8()?)?;
        let rank = self.u32()?;
        if rank > 16 {
            return Err(format!("tensor of rank {rank}"));
        }
        let dims = (0..rank).map(|_| self.usize()).collect::<std::result::Result<Vec<_>, _>>()?;
        Ok((dims, dt))
    }
}

/// The inverse of [`encode`].
pub(super) fn decode(bytes: &[u8]) -> std::result::Result<(Key, Msg), String> {
    let mut r = Reader { b: bytes };
    let key = (r.u64()?, r.usize()?, r.usize()?, r.u64()?);
    let op = r.u8()? as usize;
    let what = *OPS.get(op).ok_or_else(|| format!("unknown op {op}"))?;
    let n = r.u32()?;
    let sig = (0..n).map(|_| r.sig()).collect::<std::result::Result<Vec<_>, _>>()?;
    let payload = match r.u8()? {
        0 => {
            let len = r.u32()?;
            Err(String::from_utf8_lossy(r.take(len)?).into_owned())
        }
        1 => {
            let count = r.u32()?;
            let mut ts = Vec::with_capacity(count.min(1024));
            for _ in 0..count {
                let (dims, dt) = r.sig()?;
                let len = r.usize()?;
                let want = dims.iter().try_fold(dt.size_in_bytes(), |a, &d| a.checked_mul(d));
                if want != Some(len) {
                    return Err(format!("tensor {dims:?} {dt:?} carries {len} bytes"));
                }
                let data = r.take(len)?;
                ts.push(Tensor::from_raw_buffer(data, dt, &dims, &Device::Cpu).map_err(|e| e.to_string())?);
            }
            Ok(ts)
        }
        k => return Err(format!("unknown payload kind {k}")),
    };
    if !r.b.is_empty() {
        return Err(format!("{} trailing bytes", r.b.len()));
    }
    Ok((key, Msg { what, sig, payload }))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn messages_round_trip_bit_exactly() {
        let a = Tensor::arange(0f32, 12., &Device::Cpu).unwrap().reshape((3, 4)).unwrap();
        let view = a.narrow(1, 1, 2).unwrap(); // strided: only the view's elements travel
        let h = Tensor::new(&[1.5f64, -2.0], &Device::Cpu).unwrap().to_dtype(DType::BF16).unwrap();
        let msg = Msg { what: "all_gather", sig: vec![(vec![3, 2], DType::F32)], payload: Ok(vec![view.clone(), h.clone()]) };
        let bytes = encode((7, 1, 2, 9), &msg).unwrap();
        let (key, got) = decode(&bytes).unwrap();
        assert_eq!(key, (7, 1, 2, 9));
        assert_eq!(got.what, "all_gather");
        assert_eq!(got.sig, msg.sig);
        let ts = got.payload.unwrap();
        assert_eq!(ts[0].to_vec2::<f32>().unwrap(), view.to_vec2::<f32>().unwrap());
        assert_eq!(ts[1].dtype(), DType::BF16);
        assert_eq!(ts[1].to_dtype(DType::F32).unwrap().to_vec1::<f32>().unwrap(), vec![1.5, -2.0]);

        let fail = Msg { what: "barrier", sig: vec![], payload: Err("rank 3: bad".into()) };
        let (_, got) = decode(&encode((0, 0, 1, 0), &fail).unwrap()).unwrap();
        assert_eq!(got.payload.err().as_deref(), Some("rank 3: bad"));
        // Truncation and garbage are errors, not panics.
        assert!(decode(&bytes[..bytes.len() - 1]).is_err_and(|e| e.contains("truncated")));
        assert!(decode(&[0u8; 3]).is_err_and(|e| e.contains("truncated")));
    }
}
