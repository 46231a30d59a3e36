//! Deterministic randomness for the data pipeline.
//!
//! [`SplitMix64`] is a tiny, fully specified PRNG (Steele, Lea & Flood 2014): the same
//! seed gives the same numbers on every machine and every build, unlike `rand`'s
//! `StdRng`, whose algorithm may change between releases.
//!
//! [`ShuffleBuffer`] is a streaming shuffle with a fixed-size buffer of `cap` items:
//! the first `cap` items fill it; then each new item goes into a uniformly chosen slot
//! whose previous occupant is emitted; at the end of the stream the remaining buffer is
//! emitted in a Fisher–Yates-shuffled order. Every random draw comes from one
//! SplitMix64 seeded by `(seed, epoch)`, and draws happen at fixed points of the input
//! order, so the output order is a pure function of (seed, epoch, input stream).
//! `cap ≤ 1` passes items through unchanged.

/// SplitMix64 pseudo-random generator.
#[derive(Debug, Clone)]
pub struct SplitMix64 {
    state: u64,
}

impl SplitMix64 {
    pub fn new(seed: u64) -> Self {
        Self { state: seed }
    }

    /// Seed derived from several words (e.g. seed, epoch, sample index).
    pub fn from_parts(parts: &[u64]) -> Self {
        let mut r = SplitMix64::new(0x6c6f_6e67_6374_7821);
        for &p in parts {
            r.state ^= p;
            r.state = r.next_u64();
        }
        r
    }

    pub fn next_u64(&mut self) -> u64 {
        self.state = self.state.wrapping_add(0x9e37_79b9_7f4a_7c15);
        let mut z = self.state;
        z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
        z ^ (z >> 31)
    }

    /// Uniform in `0..n` (`n > 0`), by the multiply-shift map (bias < n / 2^64).
    pub fn below(&mut self, n: usize) -> usize {
        ((self.next_u64() as u128 * n as u128) >> 64) as usize
    }

    /// Fisher–Yates shuffle of `v` in place (last index first).
    pub fn shuffle<T>(&mut self, v: &mut [T]) {
        for i in (1..v.len()).rev() {
            v.swap(i, self.below(i + 1));
        }
    }
}

/// Streaming buffered shuffle (see module docs).
pub struct ShuffleBuffer<T> {
    cap: usize,
    buf: Vec<T>,
    rng: SplitMix64,
    draining: bool,
}

impl<T> ShuffleBuffer<T> {
    pub fn new(cap: usize, seed: u64, epoch: u64) -> Self {
        Self { cap, buf: Vec::with_capacity(cap), rng: SplitMix64::from_parts(&[seed, epoch]), draining: false }
    }

    /// Feeds one item; returns the item to emit now, if any.
    pub fn push(&mut self, item: T) -> Option<T> {
        if self.cap <= 1 {
            return Some(item);
        }
        if self.buf.len() < self.cap {
            self.buf.push(item);
            return None;
        }
        let j = self.rng.below(self.cap);
        Some(std::mem::replace(&mut self.buf[j], item))
    }

    /// After the input ended: the remaining items one by one, in shuffled order.
    pub fn drain_next(&mut self) -> Option<T> {
        if !self.draining {
            self.draining = true;
            // Fisher–Yates over what is left.
            for i in (1..self.buf.len()).rev() {
                let j = self.rng.below(i + 1);
                self.buf.swap(i, j);
            }
        }
        self.buf.pop()
    }
}
