//! TensorBoard event files, written by hand: scalars per optimizer step that TensorBoard
//! (`tensorboard --logdir <output_dir>/tensorboard`) and Weights & Biases (`wandb sync
//! --sync-tensorboard <output_dir>/tensorboard`) read.
//!
//! The file is a sequence of TFRecords: `u64` length (little endian), masked CRC-32C of
//! those 8 bytes, the data, masked CRC-32C of the data. Each record is an `Event`
//! protobuf (tensorflow/core/util/event.proto) with only the fields needed here:
//! `wall_time` (1, double), `step` (2, int64), `file_version` (3, string; the first
//! record, `brain.Event:2`), `summary` (5: `Summary { repeated Value value = 1 }`, each
//! `Value { string tag = 1; float simple_value = 2 }`) and `session_log` (6:
//! `SessionLog { status = 1 }`; START when a run resumes, so that TensorBoard drops the
//! points of steps a crashed run wrote after its last checkpoint).

use crate::{Error, Result};
use std::io::Write;
use std::path::{Path, PathBuf};

/// CRC-32C (Castagnoli, reflected polynomial 0x82F63B78) of `data`.
pub fn crc32c(data: &[u8]) -> u32 {
    const TABLE: [u32; 256] = {
        let mut t = [0u32; 256];
        let mut i = 0;
        while i < 256 {
            let mut c = i as u32;
            let mut k = 0;
            while k < 8 {
                c = if c & 1 != 0 { 0x82F6_3B78 ^ (c >> 1) } else { c >> 1 };
                k += 1;
            }
            t[i] = c;
            i += 1;
        }
        t
    };
    let mut c = !0u32;
    for &b in data {
        c = TABLE[((c ^ u32::from(b)) & 0xff) as usize] ^ (c >> 8);
    }
    !c
}

/// The TFRecord mask of a CRC: rotate right by 15, add a constant.
pub fn masked_crc(data: &[u8]) -> u32 {
    crc32c(data).rotate_right(15).wrapping_add(0xa282_ead8)
}

/// A protobuf message being built: fields appended in order.
#[derive(Default)]
struct Proto(Vec<u8>);

impl Proto {
    fn varint(&mut self, mut v: u64) {
        while v >= 0x80 {
            self.0.push((v as u8) | 0x80);
            v >>= 7;
        }
        self.0.push(v as u8);
    }
    fn key(&mut self, field: u32, wire: u8) {
        self.varint(u64::from(field) << 3 | u64::from(wire));
    }
    fn double(&mut self, field: u32, v: f64) {
        self.key(field, 1);
        self.0.extend_from_slice(&v.to_le_bytes());
    }
    fn float(&mut self, field: u32, v: f32) {
        self.key(field, 5);
        self.0.extend_from_slice(&v.to_le_bytes());
    }
    fn int(&mut self, field: u32, v: i64) {
        self.key(field, 0);
        self.varint(v as u64);
    }
    fn bytes(&mut self, field: u32, b: &[u8]) {
        self.key(field, 2);
        self.varint(b.len() as u64);
        self.0.extend_from_slice(b);
    }
}

/// An `Event` with a wall time and a step.
fn event(wall_time: f64, step: u64) -> Proto {
    let mut e = Proto::default();
    e.double(1, wall_time);
    e.int(2, i64::try_from(step).unwrap_or(i64::MAX));
    e
}

fn now() -> f64 {
    std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map_or(0.0, |d| d.as_secs_f64())
}

/// One event file of this process (a new one per run or resume, as TensorBoard expects).
pub struct EventWriter {
    path: PathBuf,
    file: std::fs::File,
}

impl EventWriter {
    /// Creates `dir/events.out.tfevents.<unix time>.longctx.<pid>` with its version record;
    /// `resumed_at`: the global step a resumed run continues after (a START session log
    /// at the next step tells readers to drop later points of the earlier file).
    pub fn create(dir: &Path, resumed_at: Option<u64>) -> Result<Self> {
        std::fs::create_dir_all(dir).map_err(|e| Error::io(dir, e))?;
        let t = now();
        let path = dir.join(format!("events.out.tfevents.{}.longctx.{}", t as u64, std::process::id()));
        let file = std::fs::File::create(&path).map_err(|e| Error::io(&path, e))?;
        let mut w = Self { path, file };
        let mut e = event(t, 0);
        e.bytes(3, b"brain.Event:2");
        w.record(&e.0)?;
        if let Some(g) = resumed_at {
            let mut log = Proto::default();
            log.int(1, 1); // SessionLog.START
            let mut e = event(t, g + 1);
            e.bytes(6, &log.0);
            w.record(&e.0)?;
        }
        w.flush()?;
        Ok(w)
    }

    pub fn path(&self) -> &Path {
        &self.path
    }

    /// One event holding a scalar per `(tag, value)` at `step` (non-finite values are
    /// written as they are: TensorBoard shows NaN).
    pub fn scalars(&mut self, step: u64, values: &[(&str, f64)]) -> Result<()> {
        let mut summary = Proto::default();
        for (tag, v) in values {
            let mut value = Proto::default();
            value.bytes(1, tag.as_bytes());
            value.float(2, *v as f32);
            summary.bytes(1, &value.0);
        }
        let mut e = event(now(), step);
        e.bytes(5, &summary.0);
        self.record(&e.0)?;
        self.flush()
    }

    fn record(&mut self, data: &[u8]) -> Result<()> {
        let len = (data.len() as u64).to_le_bytes();
        let mut buf = Vec::with_capacity(data.len() + 16);
        buf.extend_from_slice(&len);
        buf.extend_from_slice(&masked_crc(&len).to_le_bytes());
        buf.extend_from_slice(data);
        buf.extend_from_slice(&masked_crc(data).to_le_bytes());
        self.file.write_all(&buf).map_err(|e| Error::io(&self.path, e))
    }

    fn flush(&mut self) -> Result<()> {
        self.file.flush().map_err(|e| Error::io(&self.path, e))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn crc32c_known_values() {
        // RFC 3720 B.4 test vectors.
        assert_eq!(crc32c(&[0u8; 32]), 0x8A91_36AA);
        assert_eq!(crc32c(&[0xffu8; 32]), 0x62A8_AB43);
        assert_eq!(crc32c(b"123456789"), 0xE306_9283);
    }
}
